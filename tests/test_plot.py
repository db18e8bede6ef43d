"""Attention heat maps (PNG files) and hard alignments."""

import io
import sys

import pytest
import torch

from fastnmt import translate
from fastnmt.model import AttentionRecord
from fastnmt.plot import hard_alignment, pharaoh, plot_attention
from fastnmt.translator import Candidate, Translation, Translator
from tests.helpers import tiny_checkpoint

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("checkpoint"))


def test_heat_maps_per_layer_and_kind_are_png_files(checkpoint_dir, tmp_path):
    translator = Translator.from_checkpoint(checkpoint_dir)
    [translation] = translator.translate_full(["A man walks."], beam=2, attention=True)
    paths = plot_attention(translation, translator.vocab, tmp_path / "maps", "s1")
    assert [p.name for p in paths] == ["s1.cross.layer1.png"]
    paths = plot_attention(translation, translator.vocab, tmp_path, "s1", self_attention=True)
    assert sorted(p.name for p in paths) == [
        "s1.cross.layer1.png", "s1.decoder.layer1.png", "s1.encoder.layer1.png",
    ]  # fmt: skip
    assert all(p.read_bytes().startswith(PNG) and p.stat().st_size > 5000 for p in paths)
    with pytest.raises(ValueError, match="attention=True"):
        plot_attention(translator.translate_full(["A man."])[0], translator.vocab, tmp_path)


def test_hard_alignment_is_the_argmax_over_source_of_the_head_average():
    # 2 heads, 3 generated tokens + eos, 3 source tokens + eos.
    cross = torch.zeros(2, 4, 4)
    cross[0, 0, 2] = cross[1, 0, 2] = 1.0  # target 0 -> source 2
    cross[0, 1, 0], cross[1, 1, 1] = 1.0, 0.6  # averaged: source 0 (0.5) beats source 1 (0.3)
    cross[:, 2, 3] = 1.0  # source eos is never an answer: the best real token wins
    cross[:, 2, 1] = 0.2
    cross[:, 3, 0] = 1.0  # the eos row is left out
    translation = Translation(
        "x", [7, 8, 9], [Candidate("y", [4, 5, 6], -1.0, -1.0, True)],
        attention=AttentionRecord(cross=[torch.rand(2, 4, 4), cross]),
    )  # fmt: skip
    assert hard_alignment(translation) == [(2, 0), (0, 1), (1, 2)]
    assert pharaoh(hard_alignment(translation)) == "2-0 0-1 1-2"
    assert len(hard_alignment(translation, layer=0)) == 3


def test_cli_writes_heat_maps_of_chosen_lines_and_alignments(checkpoint_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"A man.\n\nTwo dogs run.\n")))
    alignments = tmp_path / "align.txt"
    code = translate.main([
        "--checkpoint", str(checkpoint_dir), "--max-len-b", "3", "--alignments", str(alignments),
        "--plot-attention", str(tmp_path / "plots"), "--plot-lines", "2-3",
    ])  # fmt: skip
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["line3.cross.layer1.png"]
    lines = alignments.read_text().split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""
    sources = len(Translator.from_checkpoint(checkpoint_dir).vocab.encode(["A man."])[0])
    pairs = [tuple(map(int, pair.split("-"))) for pair in lines[0].split()]
    assert [target for _, target in pairs] == list(range(len(pairs))) and pairs
    assert all(0 <= source < sources for source, _ in pairs)
