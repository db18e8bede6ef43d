"""Training batches in a few fixed shapes: the first part of CUDA-graph training.

A CUDA graph replays one captured step for one set of tensor shapes, and ``torch.compile``
specializes on shapes too; token-bucketed batches (``data.TokenBatches``) come in a new shape
almost every step. ``ShapeBuckets(max_tokens, max_len, count)`` fixes ``count`` shapes: lengths
evenly spaced up to the longest padded sequence (NVIDIA's MLPerf RNN-T training buckets its
graphs the same way), each with as many rows as ``max_tokens`` allows at that length, so a piece
never holds more padded tokens than a batch may. ``split(batch)`` pads a batch to the shortest
bucket that holds its sequences and splits its rows into as many pieces of that shape as needed
(short sentences come many to a batch); the trainer runs the pieces as micro-batches of one
update, normalised by the batch's real target tokens, so the update is the same sum over the
same sentences.

A piece's padding is inert: padded rows have no source or target tokens (every backend gives a
row that sees no key a zero output), padded target cells hold ``pad_id``, which the loss ignores
(``label_smoothed_loss``'s ``ignore_index``), and ``tgt_positions`` lists every cell, so it has a
fixed size too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastnmt.data import Batch


@dataclass(frozen=True)
class BatchShape:
    rows: int
    length: int  # of the source and of the target sequences (eos / bos included)


class ShapeBuckets:
    """``count`` batch shapes for batches of at most ``max_tokens`` padded tokens of sequences of
    at most ``max_len`` tokens (before eos / bos)."""

    def __init__(self, max_tokens: int, max_len: int, count: int, pad_id: int):
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        longest = max_len + 1  # eos on the source, bos / eos on the target
        lengths = sorted({math.ceil(longest * (i + 1) / count) for i in range(count)})
        self.shapes = tuple(BatchShape(max(1, max_tokens // n), n) for n in lengths)
        self.pad_id = pad_id

    def shape_of(self, batch: Batch) -> BatchShape:
        """The shortest bucket whose length holds the batch's source and target."""
        needed = max(batch.src.shape[1], batch.tgt_in.shape[1])
        for shape in self.shapes:
            if shape.length >= needed:
                return shape
        raise ValueError(
            f"batch has sequences of {needed} tokens; the longest bucket holds "
            f"{self.shapes[-1].length}"
        )

    def split(self, batch: Batch) -> list[Batch]:
        """``batch`` as pieces of its bucket's shape, in row order."""
        shape = self.shape_of(batch)
        rows = batch.src.shape[0]
        return [
            self._padded(batch, start, min(rows, start + shape.rows), shape)
            for start in range(0, rows, shape.rows)
        ]

    def _padded(self, batch: Batch, start: int, end: int, shape: BatchShape) -> Batch:
        def pad(tensor: torch.Tensor, fill: int) -> torch.Tensor:
            part = tensor[start:end]
            size = (shape.rows, *[shape.length] * (part.dim() - 1))
            out = torch.full(size, fill, dtype=part.dtype, device=part.device)
            out[tuple(slice(0, size) for size in part.shape)] = part
            return out

        return Batch(
            src=pad(batch.src, self.pad_id),
            src_lengths=pad(batch.src_lengths, 0),
            tgt_in=pad(batch.tgt_in, self.pad_id),
            tgt_out=pad(batch.tgt_out, self.pad_id),
            tgt_lengths=pad(batch.tgt_lengths, 0),
            indices=pad(batch.indices, -1),
            tgt_positions=torch.arange(shape.rows * shape.length, device=batch.src.device),
        )
