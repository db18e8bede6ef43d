"""The GPU tools run end to end on a CPU, at tiny shapes (tools/gpu_bench.py --smoke)."""

import importlib.util
import json
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch

from fastnmt.ops.triton.common import gpu_tiles
from tests.helpers import inner_pytest_env

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_smoke_writes_a_table_with_every_benchmark():
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_bench.py"), "--smoke", "--compile"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    table = result.stdout
    for row in ("SDPA bool mask", "SDPA float mask", "SDPA no mask", "add_layer_norm",
                "feed_forward", "linear_cross_entropy", "training step tiny",
                "), eager", "), torch.compile", "decoding tiny, beam 4", "static search",
                "HF Marian-base fine-tuning step", "| apply_fastnmt |"):  # fmt: skip
        assert row in table, row


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _gpu_bench():
    return _tool("gpu_bench")


# The tools' checks below call their main in this process: a subprocess apiece would mostly
# import torch again (test_gpu_bench_smoke_writes_a_table_with_every_benchmark and
# test_gpu_check_smoke_runs_the_whole_plan run them as scripts).


def _without_cuda(monkeypatch) -> None:
    """A CPU machine's view on any machine: torch sees no GPU (the refusals' tests)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_gpu_bench_selects_groups_and_refuses_a_cpu_without_smoke(monkeypatch, capsys):
    bench = _gpu_bench()
    assert bench.main(["--smoke", "--only", "attention"]) == 0
    table = capsys.readouterr().out
    assert "SDPA bool mask" in table and "training step" not in table
    _without_cuda(monkeypatch)
    assert bench.main([]) == 2 and "no CUDA device" in capsys.readouterr().err


def test_gpu_bench_kernels_lists_each_eager_steps_costliest_kernels(capsys):
    """``--kernels N``: per eager step (here each training backend), N rows by time, no table."""
    assert _gpu_bench().main(["--smoke", "--only", "training", "--kernels", "3"]) == 0
    out = capsys.readouterr().out
    sections = out.split("### ")[1:]
    assert [s.splitlines()[0] for s in sections] == [
        f"training step tiny (4 x 6 tokens), eager: fastnmt ops ({backend})"
        for backend in ("auto", "reference")
    ]
    for section in sections:
        rows = [line for line in section.splitlines() if line.startswith("| `")]
        assert len(rows) == 3, section
        times = [float(row.split(" | ")[2]) for row in rows]
        assert times == sorted(times, reverse=True) and times[-1] > 0, section
    assert "| implementation |" not in out


def test_attention_sweep_runs_its_variants_and_saves_the_base_case(tmp_path, capsys):
    """Every variant in the interpreter, which passes them all (each forced config included);
    on a GPU the first two (the base case compiled; the verdict is test_attention's)."""
    sweep = _tool("attention_sweep")
    first = 2 if torch.cuda.is_available() else len(sweep.variants())
    assert sweep.main([str(tmp_path), "--first", str(first)]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name, _, _ in sweep.variants()[:first]:
        for mask in ("full", "causal"):
            line = next(x for x in lines if x.startswith(f"{name}, {mask} "))
            assert all(f"{t} " in line for t in ("out", "dq", "dk", "dv")), line
            assert torch.cuda.is_available() or "!" not in line, line
    assert lines[-1].endswith(" variant runs over the bound")
    saved = torch.load(tmp_path / "attention-case.pt")
    assert saved["causal"]["causal"] and not saved["full"]["causal"]
    case = saved["full"]
    assert case["q"].shape == (3, 1, 45, 112) and case["dv"].shape == (3, 1, 70, 65)
    assert case["dq"].dtype == torch.bfloat16 and case["key_lengths"].tolist() == [70, 0, 1]


def test_attention_sweep_forces_one_kernels_config_and_restores_the_choice():
    sweep = _tool("attention_sweep")
    attention, config = sweep.attention_module, sweep.OTHER_CONFIGS["dq"][0]
    choose = attention.launch_config
    with sweep.forced_configs({"dq": config}):
        assert attention.launch_config("dq", 45, 70, 112) == config
        assert attention.launch_config("dkdv", 45, 70, 112) == choose("dkdv", 45, 70, 112)
    assert attention.launch_config is choose


def test_gpu_check_forces_one_norm_constant_and_restores_the_plans(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # gpu_check puts the checkout's folders first
    check = _tool("gpu_check")
    norm = check.norm_triton
    with gpu_tiles():
        chosen = norm._tile(4096, 512)
        with check.forced_norm_tuning("_GPU_TILE", 2048):
            assert norm._tile(4096, 512) == (4, 512, 4) and norm._GPU_TILE == 2048
        assert norm._tile(4096, 512) == chosen == (8, 512, 8) and norm._GPU_TILE == 4096
        with check.forced_norm_tuning("_SUM_TILE", (64, 8)):
            assert norm._sums_plan(True, True, torch.float32)[0]["BLOCK"] == 8
        assert norm._sums_plan(True, True, torch.float32)[0]["BLOCK"] == 32


def test_training_run_summary_reads_the_metrics_log(tmp_path):
    records = [
        {"event": "train", "step": 100, "tgt_tokens_per_s": 5000.0},
        {"event": "train", "step": 200, "tgt_tokens_per_s": 9000.0},
        {"event": "valid", "step": 200, "bleu": 30.0},
        {"event": "train", "step": 300, "tgt_tokens_per_s": 7000.0},
        {"event": "test", "BLEU": 38.25, "chrF": 62.6, "beam": 4},  # as the trainer logs it
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    table = _gpu_bench().run_summary(metrics, "-m fastnmt.train --max-time 180s")
    assert (
        table.splitlines()[-1]
        == "| `-m fastnmt.train --max-time 180s` | 300 | 7,000 | 38.25 (beam 4) |"
    )
    metrics.write_text(json.dumps(records[0]) + "\n")  # stopped before the test
    assert _gpu_bench().run_summary(metrics, "x").endswith("| 100 | 5,000 | not reached |")


def test_each_step_row_is_built_after_the_last_rows_step_is_freed():
    """A row's peak memory is its own: the previous row's model and optimizer state are garbage
    before the next step is built (still referenced, they would count in its peak)."""
    bench = _gpu_bench()
    built = []

    def build():
        assert all(ref() is None for ref in built), "the last row's model is still alive"
        model = torch.nn.Linear(4, 4)
        built.append(weakref.ref(model))
        return lambda: model(torch.ones(4)).sum().backward()

    rows = [bench.step_row("a step", name, build, torch.device("cpu")) for name in "ab"]
    assert [row.name for row in rows] == ["a", "b"] and len(built) == 2
    assert all(row.ms > 0 and row.peak_mib is None for row in rows)  # no peak off CUDA


# The GPU check: a priority run whose rows reach its report as they are measured.

STAGE_TABLES = {
    "firsts": "### Firsts: the code that never ran on a GPU",
    "kernels": "### Kernel-only:",
    "eager": "### Host µs per forward + backward call",
    "train": "### python -m fastnmt.train",
    "decode": "### test2016 with the auto run's checkpoint",
    "hf": "### Hugging Face Marian-base step",
    "profiles": "### Profile: static beam-4 search",
    "configs": "### Attention launch configurations",
    "norm-configs": "### add_layer_norm tuning constants",
}


def _table_rows(report: str, title: str) -> list[list[str]]:
    """The cells of each row of the table under ``title`` in a markdown report."""
    lines = report.split(title, 1)[1].splitlines()[1:]
    rows = []
    for line in lines[3:]:  # the title's end, the header, the rule
        if not line.startswith("| "):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_gpu_check_smoke_runs_the_whole_plan(tmp_path):
    """``tools/gpu-check --smoke``: every stage of the rows call, each exiting 0, each table
    with its rows, every first check passing, three training runs (each with its validation
    BLEU) and four decoding rows; the output folder holds only the report and the stages' logs
    (the runs and their data are in the work folder)."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "GPU_CHECK_BUDGET": "1200", "GPU_CHECK_WORK": str(work)}
    result = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu-check"), "--smoke", str(out)],
        capture_output=True, text=True, timeout=1500, cwd=ROOT, env=env,
    )  # fmt: skip
    report = (out / "gpu-check.md").read_text()
    assert result.returncode == 0, report
    for stage, title in STAGE_TABLES.items():
        assert f"- {stage}: exit 0 in " in report, stage
        assert _table_rows(report, title), stage
    firsts = _table_rows(report, STAGE_TABLES["firsts"])
    assert len(firsts) == 10 and all(row[2] == "PASS" for row in firsts), firsts
    training = _table_rows(report, STAGE_TABLES["train"])
    assert [row[0] for row in training] == ["torch", "auto", "reference"]
    assert all(int(row[1]) == 4 and row[-1].startswith("0 ") for row in training), training
    assert all(0 <= float(row[5]) <= 100 for row in training), training  # validation BLEU
    decoding = _table_rows(report, STAGE_TABLES["decode"])
    assert [(row[0], row[1]) for row in decoding] == [
        ("static", "4"), ("static", "1"), ("dynamic", "4"), ("dynamic", "1"),
        ("score (packed pairs)", "-"),
    ]  # fmt: skip
    speeds = [float(cell.replace(",", "")) for row in decoding for cell in row[2:4]]
    assert all(speed > 0 for speed in speeds), decoding
    assert _table_rows(report, STAGE_TABLES["profiles"])[0][0] == "(all)"
    configs = _table_rows(report, STAGE_TABLES["configs"])
    kernels = {kernel for _, kernel, config, *_ in configs if config.endswith("(chosen)")}
    assert kernels == {"forward", "dkdv", "dq"}, configs
    assert all(row[4].endswith("x") for row in configs), configs  # each one timed
    norm = _table_rows(report, STAGE_TABLES["norm-configs"])
    constants = [name for _, name, value, *_ in norm if value.endswith("(chosen)")]
    lengths = {row[0] for row in norm}
    assert constants == ["_GPU_TILE", "_PROGRAMS_PER_SM", "_SUM_TILE"] * len(lengths), norm
    assert all(row[4].endswith("x") and float(row[5]) == 0 for row in norm), norm  # same sums
    logs = [f"{stage}.log" for stage in STAGE_TABLES]
    assert sorted(p.name for p in out.iterdir()) == sorted(["gpu-check.md", *logs])
    assert (work / "train-auto" / "checkpoint_best").exists() and (work / "prepared").is_dir()


def test_a_cut_gpu_check_stage_keeps_every_row_it_reached(tmp_path):
    """Rows are on disk as soon as they are measured: a stage killed midway keeps them."""
    stage = subprocess.Popen(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "firsts", "--smoke", "--out",
         str(tmp_path)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    report = tmp_path / "gpu-check.md"
    deadline = time.monotonic() + 300
    try:
        while stage.poll() is None and time.monotonic() < deadline:
            if report.exists() and len(_table_rows(report.read_text(), "### Firsts")) >= 2:
                break
            time.sleep(0.05)
    finally:
        stage.kill()
        stage.wait()
    rows = _table_rows(report.read_text(), "### Firsts")
    assert len(rows) >= 2 and rows[0][0] == "attention, key lengths" and rows[0][2] == "PASS"


def test_gpu_check_refuses_a_cpu_without_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))  # gpu_check puts the checkout's folders first
    check = _tool("gpu_check")
    _without_cuda(monkeypatch)
    assert check.main(["kernels", "--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err


FAILING_TESTS = (
    """
import time

import pytest


@pytest.fixture
def broken():
    raise RuntimeError("the fixture broke")


def test_passes():
    pass


@pytest.fixture
def slow():
    time.sleep(0.2)
    yield
    time.sleep(0.2)


def test_sleeps(slow):
    time.sleep(0.2)


def test_errors(broken):
    pass


def test_fails():
    values = list(range(3))
"""
    + "    values.append(len(values))\n" * 60
    + """    assert values[-1] == -1, "the last value"
"""
)


@pytest.mark.parametrize("workers", [None, 2], ids=["plain", "xdist"])
def test_failures_and_durations_files_get_each_test_once(tmp_path, workers):
    """$FASTNMT_FAILURES_FILE (tests/conftest.py): a line naming each failed or errored test,
    then the last 40 lines of its traceback; passing tests write nothing. $FASTNMT_DURATIONS_FILE:
    a line per test, its setup, call and teardown seconds and its id. With pytest-xdist, the
    controller writes each once."""
    if workers and importlib.util.find_spec("xdist") is None:
        pytest.skip("pytest-xdist is not installed")
    (tmp_path / "test_tiny.py").write_text(FAILING_TESTS)
    failures = tmp_path / "failures.md"
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    durations = tmp_path / "durations.txt"
    env = inner_pytest_env(
        FASTNMT_FAILURES_FILE=str(failures), FASTNMT_DURATIONS_FILE=str(durations), PYTHONPATH=path
    )
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
               "tests.conftest", "--rootdir", str(tmp_path), "test_tiny.py"]  # fmt: skip
    if workers:
        command += ["-n", str(workers)]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert result.returncode == 1, result.stdout + result.stderr
    text = failures.read_text()
    headers = [line for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    assert sorted(headers) == [
        "ERROR at setup test_tiny.py::test_errors", "FAILED test_tiny.py::test_fails"
    ]  # fmt: skip
    errored, failed = (text.split(header, 1)[1].split("```")[1] for header in sorted(headers))
    assert "RuntimeError: the fixture broke" in errored
    lines = failed.strip("\n").splitlines()
    assert len(lines) == 40 and "AssertionError: the last value" in failed, failed
    timed = [line.split(" ", 1) for line in durations.read_text().splitlines()]
    seconds = {test.removeprefix("test_tiny.py::"): float(value) for value, test in timed}
    assert len(timed) == 4 and sorted(seconds) == [
        "test_errors", "test_fails", "test_passes", "test_sleeps"
    ]  # fmt: skip
    assert 0.6 <= seconds["test_sleeps"] < 5 and seconds["test_passes"] < 0.2, seconds
