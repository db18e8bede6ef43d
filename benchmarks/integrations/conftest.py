"""What the Hugging Face benchmarks share: Multi30k en-de and a Marian-base-shaped tokenizer
(the model is ``tools/marian_base.py``'s)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import sentencepiece as spm

from fastnmt.data import ParallelCorpus, load_multi30k

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "multi30k"


@pytest.fixture(scope="session")
def multi30k():
    """``multi30k(split)``: the en-de pairs of a Multi30k split (the shared local copy when
    there is one and $FASTNMT_DATA_DIR is unset)."""
    local = None if os.environ.get("FASTNMT_DATA_DIR") or not SHARED_DATA.exists() else SHARED_DATA

    def load(split: str) -> ParallelCorpus:
        return load_multi30k(split, "en", "de", local)

    return load


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, multi30k) -> Path:
    """A Marian tokenizer: en and de sentencepiece models of 6,000 pieces, and 58,101 ids."""
    transformers = pytest.importorskip("transformers", minversion="5.0")
    from tools.marian_base import EOS, PAD

    folder = tmp_path_factory.mktemp("marian-base")
    train = multi30k("train")
    for name, texts in (("source", train.src), ("target", train.tgt)):
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_prefix=str(folder / name), vocab_size=6000,
            bos_id=-1, eos_id=-1, minloglevel=2,
        )  # fmt: skip
        (folder / f"{name}.model").rename(folder / f"{name}.spm")
    vocab = {"</s>": EOS, "<unk>": 1}
    for name in ("source", "target"):
        processor = spm.SentencePieceProcessor(model_file=str(folder / f"{name}.spm"))
        for i in range(processor.get_piece_size()):
            vocab.setdefault(processor.id_to_piece(i), len(vocab))
    # Every id has a piece, as in Opus-MT's vocab.json: a random model emits any of them.
    vocab.update({f"\u2581filler{i}": i for i in range(len(vocab), PAD)})
    vocab["<pad>"] = PAD
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    tokenizer = transformers.MarianTokenizer(
        source_spm=str(folder / "source.spm"),
        target_spm=str(folder / "target.spm"),
        vocab=str(folder / "vocab.json"),
    )
    tokenizer.save_pretrained(folder)
    return folder
