"""One training step of the translation model (forward, label-smoothed loss, backward, Adam) as
``python -m fastnmt.train`` runs it, in target tokens/s: the fused path (the dispatcher's choice:
C++ kernels on a CPU, Triton on a GPU), the fused path with the unfused (reference) loss, and the
reference path everywhere.

The batch is synthetic but shaped like a Multi30k token bucket: sentences of 12-16 subwords,
sources and targets of similar length, about ``TOKENS`` target tokens in all.
"""

import random
from contextlib import nullcontext

import pytest
import torch

import fastnmt
from fastnmt.data import make_batch
from fastnmt.devices import autocast
from fastnmt.model import Transformer, preset
from fastnmt.training.trainer import label_smoothed_loss

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Target tokens per batch: the trainer's default --max-tokens for tiny; less for base on a CPU,
# where one step of 4096 tokens takes many seconds.
TOKENS = {"tiny": 4096, "base": 4096 if DEVICE.type == "cuda" else 1024}
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
VARIANTS = {  # name -> the backend() block the step runs in
    "fused": lambda: nullcontext(),
    "fused, reference loss": lambda: fastnmt.backend("reference", ops=["linear_cross_entropy"]),
    "reference": lambda: fastnmt.backend("reference"),
}
ROUNDS = 5


def synthetic_batch(cfg, target_tokens: int, seed: int = 0):
    rng = random.Random(seed)
    sources, targets = [], []
    while sum(len(t) + 1 for t in targets) < target_tokens:
        length = rng.randint(12, 16)
        sources.append(
            [rng.randrange(4, cfg.vocab_size) for _ in range(length + rng.randint(-2, 2))]
        )
        targets.append([rng.randrange(4, cfg.vocab_size) for _ in range(length)])
    return make_batch(sources, targets, list(range(len(sources)))).to(DEVICE)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("preset_name", ["tiny", "base"])
def test_training_step(benchmark, preset_name, precision, variant):
    torch.manual_seed(0)
    cfg = preset(preset_name)
    model = Transformer(cfg).to(DEVICE).train()
    optimizer = torch.optim.Adam(
        model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True
    )  # as the trainer
    batch = synthetic_batch(cfg, TOKENS[preset_name])
    tokens = batch.num_tgt_tokens

    def step():
        with VARIANTS[variant](), autocast(DEVICE, PRECISIONS[precision]):
            states = model(batch.src, batch.src_lengths, batch.tgt_in)
            loss, _, _ = label_smoothed_loss(model, states, batch.tgt_out, batch.tgt_positions, 0.1)
        (loss / tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()

    benchmark.group = f"train step {preset_name} {precision}"
    benchmark.pedantic(step, rounds=ROUNDS, warmup_rounds=1)
    benchmark.extra_info.update(
        preset=preset_name,
        precision=precision,
        variant=variant,
        device=DEVICE.type,
        tgt_tokens=tokens,
        sentences=batch.src.shape[0],
    )
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["tgt_tokens_per_s"] = round(tokens / benchmark.stats.stats.median)
