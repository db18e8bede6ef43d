"""Decoding speed: sentences/s and target tokens/s translating Multi30k test_2016_flickr.

Rows: greedy and beam 4, batches of 32 and 64 sentences or the Translator's default batching, the
fused path (auto: the C++ kernels on a CPU) and the reference path, and the KV cache against
recomputing the whole prefix every step.

A trained model gives realistic output lengths: set FASTNMT_BENCH_CHECKPOINT=DIR to translate all
1,000 sentences with it. Without one, a randomly initialised ``tiny`` model (the same size)
translates the first SUBSET sentences with every output forced to its source's length (no eos),
so rows still compare like for like; ``extra_info["model"]`` says which.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

import fastnmt
from fastnmt.data import Vocabulary, load_multi30k
from fastnmt.model import Transformer, preset
from fastnmt.translator import Translator, fastest_dtype

SUBSET = 200  # sentences translated by the random model
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"
PATHS = ("fused", "reference")
DEFAULT = "default"  # the Translator's own batching: up to 6,000 source tokens, 256 sentences
ROWS = [  # (search, batch, path, cache)
    *[(s, b, p, "kv-cache") for s in ("greedy", "beam4") for b in (32, 64) for p in PATHS],
    *[(s, b, "fused", c) for s in ("greedy", "beam4") for b in (64, DEFAULT)
      for c in ("kv-cache", "recompute") if (b, c) != (64, "kv-cache")],
]  # fmt: skip


def _data_dir() -> Path | None:
    if os.environ.get("FASTNMT_DATA_DIR") or not SHARED_DATA.exists():
        return None  # $FASTNMT_DATA_DIR, or the download cache
    return SHARED_DATA


@pytest.fixture(scope="module")
def setup() -> tuple[Translator, list[str], dict]:
    """(translator, source sentences, options of translate_full that fix the model's kind)."""
    test = load_multi30k("test_2016_flickr", "en", "de", _data_dir())
    path = os.environ.get("FASTNMT_BENCH_CHECKPOINT")
    if path:
        translator = Translator.from_checkpoint(path)
        return translator, test.src, {"model": f"checkpoint {path}"}
    vocab = Vocabulary.train(test.src + test.tgt, 8000)
    torch.manual_seed(0)
    model = Transformer(preset("tiny", vocab_size=len(vocab))).eval().requires_grad_(False)
    translator = Translator(model, vocab, dtype=fastest_dtype("cpu"))
    fixed = {"eos": False, "max_len_a": 1.0, "max_len_b": 0}  # output length = source length
    info = {"model": "random tiny, output length = source length (eos suppressed)", **fixed}
    return translator, test.src[:SUBSET], info


@pytest.mark.parametrize(("search", "batch", "path", "cache"), ROWS, ids=lambda v: str(v))
def test_translate(benchmark, setup, search, batch, path, cache):
    translator, sentences, info = setup
    defaults = translator.max_sentences, translator.max_tokens
    options = {k: v for k, v in info.items() if k != "model"}
    options.update(beam=1 if search == "greedy" else 4, incremental=cache == "kv-cache")
    if batch != DEFAULT:
        translator.max_sentences, translator.max_tokens = batch, 1 << 30
    results = {}

    def run():
        started = time.perf_counter()
        translations = translator.translate_full(sentences, **options)
        results["seconds"] = time.perf_counter() - started
        results["tokens"] = sum(len(t.candidates[0].tokens) for t in translations)

    try:
        with fastnmt.backend("reference" if path == "reference" else "auto"):
            translator.translate(sentences[:64], **options)  # warm-up: kernels, allocator
            benchmark.group = "translate"
            benchmark.pedantic(run, rounds=1, iterations=1)
    finally:  # the translator is shared by the module's rows
        translator.max_sentences, translator.max_tokens = defaults
    seconds = results["seconds"]
    benchmark.extra_info.update(
        model=info["model"],
        search=search,
        batch_sentences=batch,
        path=path,
        cache=cache,
        dtype=str(translator.model.embedding.weight.dtype).removeprefix("torch."),
        sentences=len(sentences),
        target_tokens=results["tokens"],
        sentences_per_s=round(len(sentences) / seconds, 1),
        target_tokens_per_s=round(results["tokens"] / seconds),
    )
