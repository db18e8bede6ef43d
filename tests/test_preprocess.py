"""``python -m fastnmt.preprocess``: prepares, then reuses, with a progress bar on a terminal; bad
input is one line and exit status 2. The prepared format itself: tests/data/test_prepared.py."""

import io
import json
import random
import sys

import pytest

from fastnmt import preprocess
from tests.data.test_prepared import VOCAB, random_pairs, write_parallel


@pytest.fixture
def text(corpus):
    return random_pairs(corpus, random.Random())


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_cli_prepares_then_reuses_with_a_progress_bar_on_a_terminal(text, tmp_path, monkeypatch):
    source = write_parallel(tmp_path / "text", *text)
    arguments = ["--train", str(tmp_path / "text" / "train"), "--vocab-size", str(VOCAB)]
    arguments += ["--prepared-dir", str(tmp_path / "prepared"), "--workers", "2"]
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert preprocess.main(arguments) == 0
    shown = sys.stderr.getvalue()
    assert "preprocess: 100%" in shown and "B/s]" in shown  # tqdm: bytes, rate
    assert "training pairs kept" in shown
    manifest = json.loads((tmp_path / "prepared" / "manifest.json").read_text())
    assert [record["path"] for record in manifest["inputs"]] == [
        str(p.resolve()) for p in source.paths
    ]
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert preprocess.main(arguments) == 0
    assert sys.stderr.getvalue().startswith(f"using the prepared data in {tmp_path / 'prepared'}")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--vocab-size", "0"], "--vocab-size must be positive, got 0"),
        (["--spm-sample", "-1"], "--spm-sample must be positive, got -1"),
        (["--src-lang", "xx"], "--src-lang must be one of"),
        (["--train", "nothing"], "nothing: no file found"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(arguments, message, tmp_path, capsys):
    assert preprocess.main([*arguments, "--prepared-dir", str(tmp_path / "p")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
