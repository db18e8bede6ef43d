"""python -m fastnmt.score: one line per pair, the translator's scores, ensembles, bad input."""

import gc
import subprocess
import sys

import pytest

from fastnmt import score
from fastnmt.translator import Translator
from tests.helpers import tiny_checkpoint
from tests.test_translator import SENTENCES, TARGETS


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("checkpoint"))


@pytest.fixture
def pairs(tmp_path):
    source, target = tmp_path / "source.txt", tmp_path / "target.txt"
    source.write_text("".join(s + "\n" for s in SENTENCES), encoding="utf-8")
    target.write_text("".join(t + "\n" for t in TARGETS), encoding="utf-8")
    return source, target


def _main(capsys, *arguments):
    code = score.main([*map(str, arguments)])
    out, err = capsys.readouterr()
    return code, out, err


def test_one_line_per_pair_with_the_translator_s_scores(checkpoint_dir, pairs, capsys):
    code, out, err = _main(
        capsys, "--checkpoint", checkpoint_dir, "--source", pairs[0], "--target", pairs[1],
        "--alpha", 0.6, "--precision", "fp32",
    )  # fmt: skip
    assert code == 0, err
    assert f"Scored {len(SENTENCES)} pairs in" in err
    rows = [[float(x) for x in line.split("\t")] for line in out.splitlines()]
    translator = Translator.from_checkpoint(checkpoint_dir, precision="fp32")
    expected = translator.score(SENTENCES, TARGETS, alpha=0.6)
    assert len(rows) == len(expected)
    for row, want in zip(rows, expected, strict=True):
        assert row == pytest.approx([want.log_prob, want.per_token, want.normalised], abs=1e-3)
    assert all(row[0] < 0 for row in rows)
    assert gc.get_freeze_count() > 0  # the loaded objects, out of the collector's walks


def test_the_files_are_scored_a_buffer_at_a_time_with_the_same_scores(
    checkpoint_dir, pairs, capsys, tmp_path
):
    """--buffer-size 4: two buffers of the six pairs (the last one short), each written as it
    is scored; the scores are those of the pairs scored together."""
    outputs = []
    for size in (10000, 4):
        code, out, err = _main(
            capsys, "--checkpoint", checkpoint_dir, "--source", pairs[0], "--target", pairs[1],
            "--buffer-size", size, "--precision", "fp32",
        )  # fmt: skip
        assert code == 0, err
        outputs.append([[float(x) for x in line.split("\t")] for line in out.splitlines()])
    assert len(outputs[1]) == len(SENTENCES)
    for together, buffered in zip(*outputs, strict=True):
        assert buffered == pytest.approx(together, abs=1e-4)


def test_a_bad_line_anywhere_is_refused_before_any_scoring(checkpoint_dir, pairs, capsys, tmp_path):
    """The last line is not UTF-8: the error comes before the first buffer is scored, and
    the output file is never opened."""
    pairs[1].write_bytes(pairs[1].read_bytes().rstrip(b"\n") + b"\xff\n")
    output = tmp_path / "scores.tsv"
    code, out, err = _main(
        capsys, "--checkpoint", checkpoint_dir, "--source", pairs[0], "--target", pairs[1],
        "--buffer-size", 2, "--output", output,
    )  # fmt: skip
    assert code == 2 and out == ""
    assert err == f"error: {pairs[1]}:{len(TARGETS)}: not valid UTF-8 (byte 0xff)\n"
    assert not output.exists()


def test_an_ensemble_of_one_checkpoint_twice_scores_as_it(checkpoint_dir, pairs, capsys, tmp_path):
    outputs = []
    for checkpoints in ([checkpoint_dir], [checkpoint_dir, checkpoint_dir]):
        output = tmp_path / f"scores{len(checkpoints)}.tsv"
        code, out, err = _main(
            capsys, "--checkpoint", *checkpoints, "--source", pairs[0], "--target", pairs[1],
            "--output", output, "--precision", "fp32",
        )  # fmt: skip
        assert code == 0 and out == "", err
        outputs.append([[float(x) for x in line.split("\t")] for line in output.open()])
    for alone, twice in zip(*outputs, strict=True):
        assert twice == pytest.approx(alone, abs=1e-3)


def test_a_target_file_with_another_line_count_is_a_one_line_error(checkpoint_dir, pairs, capsys):
    pairs[1].write_text("Ein Mann.\n", encoding="utf-8")
    code, out, err = _main(
        capsys, "--checkpoint", checkpoint_dir, "--source", pairs[0], "--target", pairs[1]
    )
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: line-count mismatch") and "target.txt has 1\n" in err


def test_the_command_runs_as_a_module(checkpoint_dir, pairs):
    process = subprocess.run(
        [sys.executable, "-m", "fastnmt.score", "--checkpoint", str(checkpoint_dir),
         "--source", str(pairs[0]), "--target", str(pairs[1]), "--max-tokens", "0"],
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    assert process.returncode == 2
    assert process.stderr.decode() == "error: --max-tokens must be positive, got 0\n"
