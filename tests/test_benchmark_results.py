"""benchmarks/results.py: pytest-benchmark JSON and GPU markdown into
benchmarks/results/<device>.md, and every committed results file is that script's output for the
inputs it names."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import results
from tests.helpers import inner_pytest_env

ROOT = Path(__file__).resolve().parents[1]
RESULT_FILES = sorted((ROOT / "benchmarks" / "results").glob("*.md"))


def _benchmark_json(path: Path, flags: list[str], benchmarks: list[dict]) -> Path:
    machine = {
        "cpu": {"brand_raw": "Some CPU", "count": 2, "flags": flags},
        "python_version": "3.11.9",
        "fastnmt_versions": {"torch": "2.13.0+cpu", "fastnmt": "0.1.0", "triton": "3.9.0"},
    }
    data = {"machine_info": machine, "commit_info": {"id": "0123456789abcdef"}}
    path.write_text(json.dumps({**data, "benchmarks": benchmarks}))
    return path


def _row(group: str, median_s: float | None, **info) -> dict:
    row = {"group": group, "name": f"test_{group}", "extra_info": info}
    if median_s is not None:
        row["stats"] = {"median": median_s}
    return row


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.name)
def test_committed_results_are_the_scripts_output(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recorded input paths are relative to the repository
    arguments = results.recorded_arguments(path)
    assert results.main([*arguments, "--check"]) == 0


def test_check_fails_on_a_file_edited_by_hand(tmp_path):
    source = _benchmark_json(tmp_path / "b.json", ["avx2"], [_row("g", 0.001, op="x")])
    assert results.main([str(source), "--out", str(tmp_path)]) == 0
    written = tmp_path / "cpu-avx2.md"
    assert results.main([str(source), "--out", str(tmp_path), "--check"]) == 0
    written.write_text(written.read_text().replace("| x |", "| y |"))
    assert results.main([str(source), "--out", str(tmp_path), "--check"]) == 1


@pytest.mark.parametrize(
    ("flags", "device"),
    [
        (["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"], "cpu-amx"),
        (["avx2", "avx512f", "avx512_bf16", "avx512_vnni"], "cpu-avx512bf16"),
        (["avx2", "avx512f"], "cpu-avx512"),
        (["avx2"], "cpu-avx2"),
    ],
)
def test_the_device_is_named_by_the_best_isa(tmp_path, flags, device):
    source = _benchmark_json(tmp_path / "b.json", flags, [_row("g", 0.001, op="x")])
    assert results.main([str(source), "--out", str(tmp_path)]) == 0
    text = (tmp_path / f"{device}.md").read_text()
    has = {name: name in {n for names, n in results.ISA_FLAGS if set(names) & set(flags)}
           for _, name in results.ISA_FLAGS}  # fmt: skip
    assert "| ISA | " + ", ".join(f"{n} {'yes' if h else 'no'}" for n, h in has.items()) in text


def test_a_benchmark_json_becomes_one_table_per_group(tmp_path):
    rows = [
        _row("attention", 0.0125, op="attention", backend="cpp", dtype="float32", tokens=2450),
        _row("attention", 0.0241, op="attention", backend="ref", dtype="float32", tokens=2450),
        _row("train step", None, preset="tiny", tgt_tokens_per_s=4112),
        {
            "group": "serve",
            "name": "test_serve",
            "stats": {"median": 30.0},
            "extra_info": {"offline": {"sent_per_s": 229.9}, "64 clients": {"sent_per_s": 154.5}},
        },
    ]
    source = _benchmark_json(tmp_path / "b.json", ["avx2"], rows)
    note = "What these figures are."
    assert results.main([str(source), "--out", str(tmp_path), "--note", note]) == 0
    text = (tmp_path / "cpu-avx2.md").read_text()
    assert text.splitlines()[2:5] == ["# Benchmark results: cpu-avx2", "", note]
    assert "| CPU | Some CPU, 2 cores |" in text
    assert "| versions | python 3.11.9, torch 2.13.0+cpu, triton 3.9.0, fastnmt 0.1.0 |" in text
    assert "| commit | `0123456` |" in text
    # the values every row shares are stated once; the median in ms
    attention = text.split("## attention\n")[1].split("## ")[0]
    assert "All rows: op attention, dtype float32, tokens 2,450." in attention
    assert "| backend | median ms |" in attention
    assert "| cpp | 12.5 |" in attention and "| ref | 24.1 |" in attention
    assert "| preset | tgt tokens/s |\n|---|---|\n| tiny | 4,112 |" in text
    # one row per dict of extra_info, named by its key; no median of the whole run
    assert "| row | sent/s |\n|---|---|\n| offline | 229.9 |\n| 64 clients | 154.5 |" in text


def test_gpu_bench_and_gpu_check_markdown(tmp_path):
    bench = tmp_path / "gpu.md"
    bench.write_text(
        "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, fastnmt 0.1.0\n\n"
        "| dtype | benchmark | implementation | ms | vs PyTorch | peak MiB |\n"
        "|---|---|---|---|---|---|\n"
        "| bfloat16 | attention L64 | fastnmt | 0.530 | 0.38x |  |\n"
    )
    report = tmp_path / "gpu-check.md"
    report.write_text(
        "# fastnmt GPU check (rows), 2026-01-01T00:00Z, commit abcdef1\n\n"
        "NVIDIA H100 80GB HBM3, 570.1, 81559 MiB\ntorch 2.11.0+cu130, triton 3.6.0\n\n"
        "- install: exit 0 in 41 s (log: install.log)\n\n"
        "### Training\n\n| run | tok/s |\n|---|---|\n| auto | 100 |\n"
    )
    assert results.main([str(bench), str(report), "--out", str(tmp_path)]) == 0
    text = (tmp_path / "gpu-h100.md").read_text()
    assert "| GPU | NVIDIA H100 80GB HBM3 |" in text
    assert "| versions | torch 2.11.0+cu130, triton 3.6.0, fastnmt 0.1.0 |" in text
    assert "| commit | `abcdef1` |" in text
    assert "## gpu\n\n| dtype | benchmark |" in text
    assert "## Training\n\n| run | tok/s |\n|---|---|\n| auto | 100 |\n" in text
    assert "install" not in text and "2026" not in text  # log lines and dates stay out


def test_real_pytest_benchmark_output(tmp_path):
    """The fields read from pytest-benchmark's own JSON are where this version writes them."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_b.py").write_text(
        textwrap.dedent(
            """
            def test_b(benchmark):
                benchmark.group = "group b"
                benchmark.pedantic(lambda: None, rounds=3)
                benchmark.extra_info.update(op="noop", tokens=7)
            """
        )
    )
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "c"], check=True)
    output = tmp_path / "b.json"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_b.py"]
    command += ["-c", "pytest.ini", f"--benchmark-json={output}"]
    subprocess.run(command, cwd=tmp_path, check=True, capture_output=True, env=inner_pytest_env())
    assert results.main([str(output), "--out", str(tmp_path), "--device", "here"]) == 0
    text = (tmp_path / "here.md").read_text()
    assert "## group b\n\n| op | tokens | median ms |" in text
    assert re.search(r"\| commit \| `[0-9a-f]{7}`( with uncommitted changes)? \|", text)
    assert "| CPU | " in text and "| ISA | AMX " in text and "| versions | python " in text


def test_a_missing_input_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        results.main([str(tmp_path / "absent.json")])
    assert exit_info.value.code == 2
    assert "no such input" in capsys.readouterr().err


def test_rows_of_other_fields_join_a_table_or_start_one(tmp_path):
    rows = [
        _row("translate", None, search="greedy", cache="kv", sent_per_s=300.0),
        _row("translate", None, search="greedy", engine="fastnmt", sent_per_s=600.0),
        _row("translate", None, search="greedy", engine="ct2", sent_per_s=400.0, batching="32"),
    ]
    source = _benchmark_json(tmp_path / "b.json", ["avx2"], rows)
    assert results.main([str(source), "--out", str(tmp_path)]) == 0
    text = (tmp_path / "cpu-avx2.md").read_text()
    assert "| search | cache | sent/s |\n|---|---|---|\n| greedy | kv | 300 |\n" in text
    joined = ["| engine | sent/s | batching |", "|---|---|---|", "| fastnmt | 600 |  |"]
    assert "\n".join([*joined, "| ct2 | 400 | 32 |"]) in text
