"""fastnmt inside Hugging Face models: a Marian-base-shaped model (``tools/marian_base.py``: 6+6
layers, d_model 512, 8 heads, FFN 2048, vocabulary 58,101, swish, random weights), on Multi30k
sentences.

- fine-tuning step (forward with labels, backward, AdamW) on 64 sentence pairs: transformers with
  ``attn_implementation="sdpa"`` against ``apply_fastnmt``, fp32 and bf16 autocast; target
  tokens/s and peak memory in extra_info;
- translation of test_2016_flickr (beam 4, at most 128 new tokens): transformers' ``generate``
  against fastnmt's Translator on the imported model (same beam, length penalty, limits; the
  outputs are checked identical). FASTNMT_BENCH_SENTENCES (default 100) sentences: a random model
  rarely stops before 128 tokens, so all 1,000 take many minutes on a CPU.
  FASTNMT_BENCH_HF_MODEL: a saved MarianMT directory (model and tokenizer, e.g. a Hub Opus-MT
  checkpoint, or one trained with ``apply_fastnmt``) to translate instead: one that ends its
  sentences, as real checkpoints do.

Run: ``pytest benchmarks/integrations --benchmark-only``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

import fastnmt

transformers = pytest.importorskip("transformers", minversion="5.0")
fastnmt_hf = pytest.importorskip("fastnmt.integrations.transformers")
from tools.marian_base import PAD, marian_base  # noqa: E402 (after the import checks)

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
SENTENCES = int(os.environ.get("FASTNMT_BENCH_SENTENCES", "100"))
MAX_NEW_TOKENS = 128


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("variant", ["hf sdpa", "apply_fastnmt"])
def test_fine_tuning_step(benchmark, peak_memory, tokenizer_dir, multi30k, variant, precision):
    tokenizer = transformers.MarianTokenizer.from_pretrained(tokenizer_dir)
    train = multi30k("train")
    batch = tokenizer(train.src[:64], text_target=train.tgt[:64], return_tensors="pt", padding=True)
    batch["labels"] = batch["labels"].masked_fill(batch["labels"] == PAD, -100)
    model = marian_base().train()
    if variant == "apply_fastnmt":
        fastnmt_hf.apply_fastnmt(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    dtype = PRECISIONS[precision]

    def step():
        with torch.autocast("cpu", dtype, enabled=dtype is not None):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # Adam's state exists before memory is measured
    memory = peak_memory(step)
    benchmark.group = f"fine-tuning step, Marian-base, {precision}"
    benchmark.pedantic(step, rounds=3, warmup_rounds=0)
    tokens = int((batch["labels"] != -100).sum())
    benchmark.extra_info.update(variant=variant, precision=precision, tgt_tokens=tokens)
    benchmark.extra_info["peak_memory_mb"] = round(memory)
    if benchmark.stats is not None:
        benchmark.extra_info["tgt_tokens_per_s"] = round(tokens / benchmark.stats.stats.median)


@pytest.fixture(scope="module")
def translation_setup(request, tmp_path_factory, multi30k):
    test = multi30k("test_2016_flickr")
    if trained := os.environ.get("FASTNMT_BENCH_HF_MODEL"):
        return Path(trained), test.src[:SENTENCES], {}
    folder = tmp_path_factory.mktemp("marian-base-model")
    for path in request.getfixturevalue("tokenizer_dir").iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    marian_base(dropout=0.0).save_pretrained(folder)
    return folder, test.src[:SENTENCES], {}


def _hf_translate(folder: Path, sentences: list[str]) -> list[str]:
    model = transformers.MarianMTModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    tokenizer = transformers.MarianTokenizer.from_pretrained(folder)
    outputs = []
    with torch.inference_mode():
        for start in range(0, len(sentences), 64):
            inputs = tokenizer(sentences[start : start + 64], return_tensors="pt", padding=True)
            generated = model.generate(
                **inputs,
                num_beams=4,
                max_new_tokens=MAX_NEW_TOKENS,
                length_penalty=1.0,
                early_stopping=True,
                bad_words_ids=[[model.config.pad_token_id]],
            )
            outputs += tokenizer.batch_decode(generated, skip_special_tokens=True)
    return outputs


@pytest.mark.parametrize("engine", ["hf generate", "fastnmt Translator"])
def test_translation(benchmark, translation_setup, engine):
    folder, sentences, results = translation_setup
    if engine == "hf generate":
        run = lambda: _hf_translate(folder, sentences)  # noqa: E731
    else:
        translator = fastnmt.Translator.from_pretrained(folder, precision="fp32")
        options = dict(beam=4, lenpen=1.0, max_len_a=0, max_len_b=MAX_NEW_TOKENS)
        run = lambda: translator.translate(sentences, **options)  # noqa: E731
    started = time.perf_counter()
    results[engine] = benchmark.pedantic(run, rounds=1, warmup_rounds=0)
    seconds = time.perf_counter() - started
    benchmark.group = f"translation, Marian-base, beam 4, {len(sentences)} sentences"
    benchmark.extra_info.update(engine=engine, sentences_per_s=round(len(sentences) / seconds, 2))
    if len(results) == 2:
        same = sum(a == b for a, b in zip(*results.values(), strict=True))
        benchmark.extra_info["identical_outputs"] = f"{same}/{len(sentences)}"
