"""python -m fastnmt.translate: line counts, stdin, summary, scores, bad input, Ctrl-C."""

import io
import re
import signal
import subprocess
import sys

import pytest

from fastnmt import translate
from fastnmt.cli import forced_backend
from fastnmt.ops import dispatch
from tests.helpers import tiny_checkpoint

SUMMARY = re.compile(
    r"Translated (\d+) sentences \((\d+) tokens\) in [\d.]+ s \([\d.,]+ sent/s, [\d,]+ tok/s\)"
)
LINES = ["A man is walking his dog.", "", "Two children play.", "", ""]


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("checkpoint"))


def _main(monkeypatch, capsys, stdin: bytes, *arguments):
    """Run the CLI in this process with ``stdin``; (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    code = translate.main(["--max-len-b", "4", "--beam", "2", *map(str, arguments)])
    out, err = capsys.readouterr()
    return code, out, err


def test_stdin_keeps_every_line_and_reports_a_summary(checkpoint_dir, monkeypatch, capsys):
    text = "\n".join(LINES) + "\n"
    code, out, err = _main(monkeypatch, capsys, text.encode(), "--checkpoint", checkpoint_dir)
    assert code == 0, err
    outputs = out.split("\n")[:-1]
    assert len(outputs) == len(LINES)
    assert [o == "" for o in outputs] == [line == "" for line in LINES]
    summary = SUMMARY.search(err)
    assert summary and summary.group(1) == "5"


def test_last_line_without_newline_and_crlf(checkpoint_dir, monkeypatch, capsys):
    code, out, _ = _main(monkeypatch, capsys, b"Dogs.\r\n\r\nCats.", "--checkpoint", checkpoint_dir)
    assert code == 0 and out.count("\n") == 3 and out.split("\n")[1] == ""


def test_invalid_utf8_is_replaced_and_counted(checkpoint_dir, monkeypatch, capsys, tmp_path):
    source = tmp_path / "input.txt"
    source.write_bytes(b"Dogs.\n\xff\xfe cats\nA man.\n\xc3 end\n")
    output = tmp_path / "output.txt"
    code, out, err = _main(
        monkeypatch, capsys, b"", "--checkpoint", checkpoint_dir, "--input", source,
        "--output", output,
    )  # fmt: skip
    assert code == 0 and out == ""
    assert len(output.read_text(encoding="utf-8").split("\n")) == 5  # 4 lines + final newline
    assert "2 lines held invalid UTF-8" in err and "(lines 2, 4)" in err


def test_reference_scores_and_nbest(checkpoint_dir, monkeypatch, capsys, tmp_path):
    reference = tmp_path / "reference.txt"
    reference.write_text("Ein Mann.\nZwei Hunde.\n", encoding="utf-8")
    code, out, err = _main(
        monkeypatch, capsys, b"A man.\nTwo dogs.\n", "--checkpoint", checkpoint_dir,
        "--reference", reference, "--nbest", "2",
    )  # fmt: skip
    assert code == 0, err
    assert re.search(r"^BLEU [\d.]+ \(nrefs:1\|case:mixed\|.*tok:13a", err, re.M)
    assert re.search(r"^chrF [\d.]+ \(nrefs:1\|", err, re.M)
    numbers = [line.split(" ||| ")[0] for line in out.splitlines()]
    assert numbers == ["1", "1", "2", "2"]
    scores = [float(line.split(" ||| ")[2]) for line in out.splitlines()]
    assert scores[0] >= scores[1] and scores[2] >= scores[3]


def test_static_search_translates_as_the_dynamic_one(checkpoint_dir, monkeypatch, capsys):
    text = "\n".join(LINES).encode()
    outputs = {
        choice: _main(monkeypatch, capsys, text, "--checkpoint", checkpoint_dir, "--nbest", 2,
                      "--static-search", choice)
        for choice in ("on", "off")
    }  # fmt: skip
    assert outputs["on"][0] == 0 and outputs["on"][1] == outputs["off"][1]


def test_truncation_warning_names_the_line(monkeypatch, capsys, tmp_path):
    short = tiny_checkpoint(tmp_path, max_positions=6)
    text = b"Dogs.\nTwo children play football in the park near a big red house.\n"
    code, out, err = _main(monkeypatch, capsys, text, "--checkpoint", short)
    assert code == 0 and out.count("\n") == 2
    assert re.search(r"^warning: line 2: \d+ subword tokens, truncated", err, re.M)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--beam", "0"], "--beam must be positive"),
        (["--nbest", "3"], "--nbest must be between 1 and --beam"),
        (["--plot-attention", "plots", "--plot-lines", "x"], "--plot-lines must look like"),
        (["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
        (["--device", "cuda:64"], "--device cuda:64: "),
        (["--static-search", "on", "--shortlist", "x"], "no shortlist with it"),
        (["--sampling", "topk", "--sampling-topk", "0"], "--sampling-topk must be at least 1"),
        (["--sampling", "topp", "--sampling-topp", "0"], "--sampling-topp must be in (0, 1]"),
        (["--sampling", "topp", "--sampling-topp", "1.5"], "--sampling-topp must be in (0, 1]"),
        (["--sampling", "topk", "--temperature", "0"], "--temperature must be >= 1e-06"),
        (["--sampling", "topk", "--temperature", "-1"], "--temperature must be >= 1e-06"),
        (["--sampling", "topk", "--temperature", "1e-40"], "--temperature must be >= 1e-06"),
        (["--sampling", "topk", "--samples", "0"], "--samples must be at least 1"),
        (["--sampling", "topk", "--nbest", "2"], "--nbest must be between 1 and --samples (1)"),
        (["--sampling", "topp", "--sampling-topk", "5"], "--sampling-topk is for --sampling topk"),
        (["--temperature", "0.5"], "--temperature needs --sampling"),
        (["--seed", "1"], "--seed needs --sampling"),
        (["--no-repeat-ngram", "-1"], "--no-repeat-ngram must be >= 0"),
        (["--prefix-file", "/nonexistent/prefixes"], "/nonexistent/prefixes"),
    ],
)
def test_bad_values_are_one_line_errors(checkpoint_dir, monkeypatch, capsys, arguments, message):
    code, out, err = _main(monkeypatch, capsys, b"", "--checkpoint", checkpoint_dir, *arguments)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def _cli(*arguments, **kwargs):
    command = [sys.executable, "-m", "fastnmt.translate", *map(str, arguments)]
    return subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs
    )


def test_cli_on_stdin_and_bad_checkpoint_in_a_subprocess(checkpoint_dir, tmp_path):
    process = _cli("--checkpoint", checkpoint_dir, "--beam", "1")
    out, err = process.communicate(b"A man.\n\nDogs.\n", timeout=120)
    assert process.returncode == 0, err
    assert out.decode().count("\n") == 3 and out.decode().split("\n")[1] == ""
    assert SUMMARY.search(err.decode())
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 10)
    for path in (tmp_path / "missing", corrupt):
        process = _cli("--checkpoint", path)
        out, err = process.communicate(b"A man.\n", timeout=120)
        assert process.returncode == 2 and out == b""
        lines = err.decode().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0]


def test_ctrl_c_on_stdin_exits_130_without_a_traceback(checkpoint_dir):
    # A shell that starts jobs in the background (as CI may) makes them ignore SIGINT, and Python
    # then installs no KeyboardInterrupt handler: give the translator the default disposition.
    process = _cli(
        "--checkpoint", checkpoint_dir, "--buffer-size", "1", "--beam", "1",
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    process.stdin.write(b"A man.\n")
    process.stdin.flush()
    assert process.stdout.readline(), "the first line is translated before more input arrives"
    process.send_signal(signal.SIGINT)  # now waiting for the next line
    # Wait with stdin still open: closing it (communicate) could let the process see EOF and
    # finish normally before Python runs its SIGINT handler.
    assert process.wait(timeout=60) == 130
    err = process.stderr.read().decode()
    assert "Traceback" not in err and "interrupted" in err


def test_sampling_with_a_seed_is_reproducible_in_any_batching(checkpoint_dir, monkeypatch, capsys):
    text = "".join(line + "\n" for line in LINES).encode()
    sampling = ("--sampling", "topk", "--sampling-topk", 20, "--samples", 3, "--nbest", 3)
    outputs = [
        _main(monkeypatch, capsys, text, "--checkpoint", checkpoint_dir, *sampling, "--seed", 9,
              *batching)[:2]
        for batching in ((), ("--max-sentences", 1, "--buffer-size", 1))
    ]  # fmt: skip
    assert outputs[0] == outputs[1] and outputs[0][0] == 0
    numbers = [line.split(" ||| ")[0] for line in outputs[0][1].splitlines()]
    assert numbers == ["1"] * 3 + ["2"] + ["3"] * 3 + ["4", "5"]  # an empty line: one line


def test_prefix_file_forces_each_line_s_start(checkpoint_dir, monkeypatch, capsys, tmp_path):
    prefixes = tmp_path / "prefixes.txt"
    prefixes.write_text("Ein Mann\n\nZwei\n\n\n", encoding="utf-8")
    text = "".join(line + "\n" for line in LINES).encode()
    code, out, err = _main(
        monkeypatch, capsys, text, "--checkpoint", checkpoint_dir, "--prefix-file", prefixes,
        "--no-repeat-ngram", 3,
    )  # fmt: skip
    assert code == 0, err
    outputs = out.split("\n")
    assert outputs[0].startswith("Ein Mann") and outputs[2].startswith("Zwei")
    prefixes.write_text("Ein Mann\n", encoding="utf-8")
    code, _, err = _main(
        monkeypatch, capsys, text, "--checkpoint", checkpoint_dir, "--prefix-file", prefixes
    )
    assert code == 2 and err.splitlines()[-1].startswith("error: --prefix-file has 1 lines")
    prefixes.write_text("Ein Mann geht mit seinem Hund im Park spazieren\n", encoding="utf-8")
    code, _, err = _main(
        monkeypatch, capsys, b"Dogs.", "--checkpoint", checkpoint_dir, "--prefix-file", prefixes
    )
    assert code == 2 and err.splitlines()[-1].startswith("error: prefix of line 1:")
    assert "Traceback" not in err


def test_an_ensemble_of_one_checkpoint_twice_translates_as_it(checkpoint_dir, monkeypatch, capsys):
    text = "\n".join(LINES).encode()
    alone = _main(monkeypatch, capsys, text, "--checkpoint", checkpoint_dir)
    twice = _main(monkeypatch, capsys, text, "--checkpoint", checkpoint_dir, checkpoint_dir)
    assert alone[0] == twice[0] == 0 and alone[1] == twice[1]


def test_checkpoints_with_different_vocabularies_are_a_one_line_error(
    checkpoint_dir, monkeypatch, capsys, tmp_path
):
    other = tiny_checkpoint(tmp_path, pieces=280)
    code, out, err = _main(monkeypatch, capsys, b"A man.", "--checkpoint", checkpoint_dir, other)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "has another vocabulary than" in err


def test_backend_is_forced_onto_the_ops_that_have_it():
    """``--backend triton``: the model's ops on Triton, the decoding ops (no Triton kernels)
    choosing their own, where forcing every op would refuse the first decoding step."""
    with forced_backend("triton"):
        assert dispatch.forced_backend("attention") == "triton"
        assert dispatch.forced_backend("log_softmax_topk") is None
        assert dispatch.forced_backend("sample_token") is None
    with forced_backend("cpp"):
        assert {dispatch.forced_backend(op) for op in dispatch.OPS} == {"cpp"}
