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

# The fields a piece pads (tgt_positions lists every cell of a shape: the same for every piece),
# the token fields padded with pad_id, and what pads the others.
_PADDED = ("src", "src_lengths", "tgt_in", "tgt_out", "tgt_lengths", "indices")
_TOKENS = frozenset({"src", "tgt_in", "tgt_out"})
_FILLS = {"src_lengths": 0, "tgt_lengths": 0, "indices": -1}


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

    def row_ranges(self, batch: Batch) -> tuple[BatchShape, list[tuple[int, int]]]:
        """The batch's bucket and the (start, end) rows of each of its pieces, in row order."""
        shape = self.shape_of(batch)
        rows = batch.src.shape[0]
        return shape, [(i, min(rows, i + shape.rows)) for i in range(0, rows, shape.rows)]

    def split(self, batch: Batch) -> list[Batch]:
        """``batch`` as pieces of its bucket's shape, in row order."""
        shape, ranges = self.row_ranges(batch)
        device = batch.src.device
        pieces = []
        for start, end in ranges:
            piece = self.empty(shape, device)
            self.write(piece, batch, start, end)
            pieces.append(piece)
        return pieces

    def empty(self, shape: BatchShape, device, *, pin_memory: bool = False) -> Batch:
        """A batch of ``shape`` holding padding only (all-padded rows are inert); in pinned host
        memory with ``pin_memory``, which a copy to a GPU reads without blocking the host."""

        def full(size, fill):
            out = torch.empty(size, dtype=torch.int64, device=device, pin_memory=pin_memory)
            return out.fill_(fill)

        grid = (shape.rows, shape.length)
        return Batch(
            src=full(grid, self.pad_id),
            src_lengths=full((shape.rows,), 0),
            tgt_in=full(grid, self.pad_id),
            tgt_out=full(grid, self.pad_id),
            tgt_lengths=full((shape.rows,), 0),
            indices=full((shape.rows,), -1),
            tgt_positions=torch.arange(shape.rows * shape.length, device=device),
        )

    def write(
        self, out: Batch, batch: Batch, start: int, end: int, names: tuple[str, ...] = _PADDED
    ) -> None:
        """Rows [start, end) of ``batch``, padded, into ``out`` (a batch of their bucket's shape,
        reused: every cell is written)."""
        for name in names:
            part, target = getattr(batch, name)[start:end], getattr(out, name)
            target.fill_(self.pad_id if name in _TOKENS else _FILLS[name])
            target[tuple(slice(0, size) for size in part.shape)] = part
