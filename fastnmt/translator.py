"""Batched translation with a trained model: sort by length, batch by tokens, restore order."""

from __future__ import annotations

import contextlib

import torch

from fastnmt.data import Vocabulary, make_batch, pack_by_tokens
from fastnmt.model import Transformer


def autocast(device: torch.device | str, dtype: torch.dtype | None):
    """Autocast to ``dtype`` on ``device``'s type, or nothing for full precision."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype)


@torch.no_grad()
def greedy_translate(
    model: Transformer,
    vocab: Vocabulary,
    sentences: list[str],
    *,
    max_tokens: int = 4096,
    max_len_a: float = 1.2,
    max_len_b: int = 10,
    device: torch.device | str = "cpu",
    autocast_dtype: torch.dtype | None = None,
) -> list[str]:
    """Greedy translations of ``sentences``, in input order; output length is capped at
    ``max_len_a * source_length + max_len_b`` tokens."""
    encoded = vocab.encode(sentences)
    sizes = [len(ids) + 1 for ids in encoded]  # + eos
    order = sorted(range(len(sizes)), key=sizes.__getitem__)
    output: list[str] = [""] * len(sentences)
    was_training = model.training
    model.eval()
    for indices in pack_by_tokens(order, sizes, max_tokens):
        batch = make_batch(
            [encoded[i] for i in indices],
            None,
            indices,
            pad_id=vocab.pad_id,
            bos_id=vocab.bos_id,
            eos_id=vocab.eos_id,
        ).to(device)
        max_len = min(int(max_len_a * batch.src.shape[1] + max_len_b), model.cfg.max_positions)
        with autocast(device, autocast_dtype):
            hypotheses = model.greedy(batch.src, batch.src_lengths, max_len)
        for index, text in zip(indices, vocab.decode(hypotheses), strict=True):
            output[index] = text
    model.train(was_training)
    return output
