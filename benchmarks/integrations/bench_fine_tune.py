"""The fine-tuning step of ``python -m fastnmt.train --init-from`` against a plain transformers
loop, on the same model and the same batches: a Marian-base-shaped checkpoint (``tools/
marian_base.py``: 6+6 layers, d_model 512, vocabulary 58,101, Opus-MT's shape, random weights)
and Multi30k en-de pairs; target tokens/s of updates (forward, loss with label smoothing 0.1,
backward, Adam), fp32 and bf16 autocast.

- fastnmt: the Trainer that ``--init-from DIR`` builds (the imported weights on fastnmt's fused
  ops; on a GPU its CUDA-graph updates, as by default), one ``train_step`` per batch;
- transformers: ``MarianMTModel`` with ``attn_implementation="sdpa"``, the loss transformers'
  Trainer computes with ``label_smoothing_factor=0.1`` (cross entropy with label smoothing over
  the logits of the target positions), fused AdamW (its default optimizer), no gradient clipping
  (fastnmt's default).

The batches are the trainer's own (``--max-tokens 4096``): transformers gets each one's source
ids, the attention mask of its source lengths, the decoder inputs (Marian's start symbol, pad,
first) and the labels (padding -> -100). FASTNMT_BENCH_BATCHES (default 4) batches per round.

Run: ``pytest benchmarks/integrations/bench_fine_tune.py --benchmark-only``.
"""

from __future__ import annotations

import itertools
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from fastnmt import train

transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("fastnmt.integrations.transformers")
from tools.marian_base import marian_base  # noqa: E402 (after the import checks)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
BATCHES = int(os.environ.get("FASTNMT_BENCH_BATCHES", "4"))
MAX_TOKENS = 4096
LABEL_SMOOTHING = 0.1
PAIRS = 2000  # the training file the trainer prepares; BATCHES of its batches are trained on


@pytest.fixture(scope="module")
def marian_dir(tokenizer_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("marian-base-model")
    for path in tokenizer_dir.iterdir():
        shutil.copy(path, folder / path.name)
    marian_base().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def corpus(multi30k, tmp_path_factory):
    """train.tsv and valid.tsv of Multi30k en-de pairs."""
    folder = tmp_path_factory.mktemp("fine-tune-corpus")
    for name, split, count in (("train", "train", PAIRS), ("valid", "val", 8)):
        pairs = multi30k(split)
        lines = [f"{s}\t{t}\n" for s, t in zip(pairs.src[:count], pairs.tgt[:count], strict=True)]
        (folder / f"{name}.tsv").write_text("".join(lines), encoding="utf-8")
    return folder


def _trainer(marian_dir, corpus, output, precision: str) -> train.Trainer:
    """The Trainer of ``python -m fastnmt.train --init-from marian_dir``, ready to step."""
    arguments = [
        "--init-from", str(marian_dir), "--train-tsv", str(corpus / "train.tsv"),
        "--valid-tsv", str(corpus / "valid.tsv"), "--output-dir", str(output),
        "--max-tokens", str(MAX_TOKENS), "--label-smoothing", str(LABEL_SMOOTHING),
        "--precision", precision, "--device", str(DEVICE), "--no-progress",
        "--data-workers", "0",
    ]  # fmt: skip
    trainer = train.prepare(train.build_parser().parse_args(arguments))
    if trainer.args.cuda_graphs == "on":
        trainer.model.train()
        trainer.bucketed.capture(trainer.optimizer, lambda line: None)
    return trainer


def _transformers_step(marian_dir, precision: str, pad_id: int):
    """A plain transformers update of one fastnmt batch."""
    model = transformers.MarianMTModel.from_pretrained(marian_dir, attn_implementation="sdpa")
    model.to(DEVICE).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, fused=True)
    dtype = PRECISIONS[precision]

    def step(batch) -> None:
        batch = batch.to(DEVICE)
        positions = torch.arange(batch.src.shape[1], device=DEVICE)
        mask = (positions < batch.src_lengths[:, None]).long()
        labels = batch.tgt_out.masked_fill(batch.tgt_out == pad_id, -100)
        with torch.autocast(DEVICE.type, dtype, enabled=dtype is not None):
            logits = model(input_ids=batch.src, attention_mask=mask, decoder_input_ids=batch.tgt_in)
            loss = F.cross_entropy(
                logits.logits.flatten(0, 1),
                labels.flatten(),
                ignore_index=-100,
                label_smoothing=LABEL_SMOOTHING,
            )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("engine", ["transformers sdpa", "fastnmt trainer"])
def test_fine_tuning_step(benchmark, marian_dir, corpus, tmp_path, engine, precision):
    trainer = _trainer(marian_dir, corpus, tmp_path, precision)
    batches = list(itertools.islice(trainer.batches.iterate(epoch=1), BATCHES))
    if engine == "fastnmt trainer":

        def update(batch) -> None:
            trainer.train_step([batch])

    else:
        update = _transformers_step(marian_dir, precision, trainer.vocab.pad_id)

    def run() -> None:
        for batch in batches:
            update(batch)
        _synchronize()

    update(batches[0])  # the optimizer's state exists, kernels are compiled
    _synchronize()
    benchmark.group = f"fine-tuning updates, Marian-base, {precision}, {DEVICE.type}"
    benchmark.pedantic(run, rounds=3, warmup_rounds=0)
    tokens = sum(batch.num_tgt_tokens for batch in batches)
    benchmark.extra_info.update(engine=engine, precision=precision, tgt_tokens=tokens)
    if benchmark.stats is not None:
        benchmark.extra_info["tgt_tokens_per_s"] = round(tokens / benchmark.stats.stats.median)
