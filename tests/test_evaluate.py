"""python -m fastnmt.evaluate: a Multi30k split and own data, three labelled scores."""

import re

import pytest

from fastnmt import evaluate
from tests.helpers import tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("checkpoint"))


def _scores(text: str) -> dict[str, str]:
    return dict(re.findall(r"^(BLEU|chrF|tokenized lowercased BLEU) [\d.]+ \((.*)\)$", text, re.M))


def test_own_tsv_data_gets_three_labelled_scores(checkpoint_dir, tmp_path, capsys):
    data = tmp_path / "test.tsv"
    data.write_text("A man.\tEin Mann.\nTwo dogs.\tZwei Hunde.\n", encoding="utf-8")
    output = tmp_path / "hyp.txt"
    arguments = ["--checkpoint", str(checkpoint_dir), "--test-tsv", str(data), "--beam", "2"]
    assert evaluate.main([*arguments, "--max-len-b", "3", "--output", str(output)]) == 0
    out = capsys.readouterr().out
    assert "en->de, beam 2: 2 sentences" in out
    scores = _scores(out)
    assert scores.keys() == {"BLEU", "chrF", "tokenized lowercased BLEU"}
    assert "case:mixed" in scores["BLEU"] and "tok:13a" in scores["BLEU"]
    assert "case:lc" in scores["tokenized lowercased BLEU"]
    assert len(output.read_text(encoding="utf-8").splitlines()) == 2


def test_multi30k_split_with_the_checkpoints_languages(checkpoint_dir, capsys):
    arguments = ["--checkpoint", str(checkpoint_dir)]  # Multi30k found as the package finds it
    assert evaluate.main([*arguments, "--split", "val", "--beam", "1", "--max-len-a", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "multi30k/val en->de, greedy: 1,014 sentences" in out
    assert len(_scores(out)) == 3


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--split", "dev"], "--split must be one of"),
        (["--test-tsv", "missing.tsv"], "missing.tsv: file not found"),
        (["--beam", "0"], "--beam must be positive"),
    ],
)
def test_bad_input_is_a_one_line_error(checkpoint_dir, capsys, arguments, message):
    assert evaluate.main(["--checkpoint", str(checkpoint_dir), *arguments]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_missing_checkpoint_is_a_one_line_error(tmp_path, capsys):
    assert evaluate.main(["--checkpoint", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
