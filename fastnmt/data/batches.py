"""Batches: padded id tensors for a step, collated from token arrays, and token-bucketed batching
of an encoded corpus (DataLoader workers, DDP ranks, exact resume)."""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

import numpy as np
import torch
import torch.utils.data

from fastnmt.data.corpus import EncodedCorpus, TokenArray


@dataclass
class Batch:
    """Padded id tensors for one step; lengths count the eos."""

    src: torch.Tensor  # (B, S) int64, pad_id padded, each row ends with eos
    src_lengths: torch.Tensor  # (B,) int64
    tgt_in: torch.Tensor  # (B, T) bos + target (decoder input)
    tgt_out: torch.Tensor  # (B, T) target + eos (what the decoder must predict)
    tgt_lengths: torch.Tensor  # (B,) int64
    indices: torch.Tensor  # (B,) positions of these pairs in the corpus, to restore order
    # (tokens,) int64 flat positions of the non-pad targets in tgt_out.view(-1): the loss gathers
    # them without a boolean mask, whose size a GPU would have to report back (a host sync).
    tgt_positions: torch.Tensor

    @property
    def num_tgt_tokens(self) -> int:
        """Non-pad target tokens: the normaliser of the loss and the unit of throughput."""
        return self.tgt_positions.shape[0]

    def __reduce__(self):
        """Pickled as one buffer: a DataLoader worker sends each batch to the trainer in one
        copy, not one shared-memory segment per tensor (each costs about a millisecond)."""
        tensors = [getattr(self, f.name) for f in fields(self)]
        flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
        return _unpickle_batch, (flat.numpy().tobytes(), [tuple(t.shape) for t in tensors])

    def _map(self, function) -> Batch:
        return replace(self, **{f.name: function(getattr(self, f.name)) for f in fields(self)})

    def pin_memory(self) -> Batch:
        """Called by a DataLoader with ``pin_memory=True`` (in its pinning thread)."""
        return self._map(torch.Tensor.pin_memory)

    def to(self, device: torch.device | str) -> Batch:
        device = torch.device(device)

        def move(tensor):
            if device.type == "cuda":  # from pinned memory: the copy does not block the host
                return tensor.pin_memory().to(device, non_blocking=True)
            return tensor.to(device)

        return self._map(move)


def _unpickle_batch(data: bytes, shapes: list[tuple[int, ...]]) -> Batch:
    flat = torch.frombuffer(bytearray(data), dtype=torch.int64)
    parts = flat.split([math.prod(shape) for shape in shapes])
    return Batch(*(part.view(shape) for part, shape in zip(parts, shapes, strict=True)))


def _padded(
    ids: np.ndarray, lengths: np.ndarray, pad_id: int, *, first: int | None = None, last=None
) -> np.ndarray:
    """(B, width) int64 rows: ``first`` if given, the row's ids, ``last`` if given, then padding;
    ``ids`` holds the rows' ids concatenated."""
    lead = int(first is not None)
    width = int(lengths.max(initial=0)) + lead + int(last is not None)
    out = np.full((len(lengths), width), pad_id, np.int64)
    columns = np.arange(width)
    out[(columns >= lead) & (columns < lengths[:, None] + lead)] = ids  # row-major, like ids
    if first is not None:
        out[:, 0] = first
    if last is not None:
        out[np.arange(len(lengths)), lengths + lead] = last
    return out


def collate(
    src: TokenArray,
    tgt: TokenArray | None,
    rows: np.ndarray,
    indices: np.ndarray,
    *,
    pad_id: int = 0,
    bos_id: int = 1,
    eos_id: int = 2,
) -> Batch:
    """The Batch of sequences ``rows`` (``indices``: their positions, for restoring order). ``tgt``
    None is for translation: the target tensors are then empty (B, 0)."""
    src_ids, src_lengths = src.gather(rows)
    if tgt is None:
        tgt_in = tgt_out = np.zeros((len(rows), 0), np.int64)
        tgt_lengths = np.zeros(len(rows), np.int64)
    else:
        tgt_ids, lengths = tgt.gather(rows)
        tgt_in = _padded(tgt_ids, lengths, pad_id, first=bos_id)
        tgt_out = _padded(tgt_ids, lengths, pad_id, last=eos_id)
        tgt_lengths = lengths + 1
    targets = np.arange(tgt_out.shape[1]) < tgt_lengths[:, None]
    return Batch(
        src=torch.from_numpy(_padded(src_ids, src_lengths, pad_id, last=eos_id)),
        src_lengths=torch.from_numpy(src_lengths + 1),
        tgt_in=torch.from_numpy(tgt_in),
        tgt_out=torch.from_numpy(tgt_out),
        tgt_lengths=torch.from_numpy(tgt_lengths),
        indices=torch.from_numpy(np.asarray(indices, np.int64)),
        tgt_positions=torch.from_numpy(np.flatnonzero(targets)),
    )


def make_batch(
    src: list[list[int]],
    tgt: list[list[int]] | None,
    indices: list[int],
    *,
    pad_id: int = 0,
    bos_id: int = 1,
    eos_id: int = 2,
) -> Batch:
    """Collate id sequences (lists, without bos/eos) into a Batch. ``tgt`` None is for
    translation: the target tensors are then empty (B, 0)."""
    targets = None if tgt is None else TokenArray.from_lists(tgt)
    rows = np.arange(len(src))
    specials = {"pad_id": pad_id, "bos_id": bos_id, "eos_id": eos_id}
    return collate(TokenArray.from_lists(src), targets, rows, np.asarray(indices), **specials)


def pack_by_tokens(sizes: np.ndarray, max_tokens: int) -> np.ndarray:
    """Split a sequence of pair sizes into consecutive runs whose padded size (count x largest)
    fits ``max_tokens``, greedily; returns the run boundaries (0, ..., len(sizes)). A pair too long
    for any batch gets one of its own rather than being dropped.

    One numpy step per batch, not a Python step per pair: a batch starting at p holds at most
    max_tokens // sizes[p] pairs, and within that window the padded size of the first k pairs,
    k x running max, only grows with k, so the batch is the count of those that fit."""
    bounds = [0]
    start = 0
    while start < len(sizes):
        window = sizes[start : start + max(1, max_tokens // int(sizes[start]))]
        padded = np.arange(1, len(window) + 1) * np.maximum.accumulate(window)
        start += max(1, int(np.count_nonzero(padded <= max_tokens)))
        bounds.append(start)
    return np.asarray(bounds, np.int64)


def seeded_generator(label: str) -> np.random.Generator:
    """A numpy generator from a string (any --seed, negative too, makes a valid seed)."""
    return np.random.default_rng(int.from_bytes(hashlib.sha256(label.encode()).digest()[:8]))


class _Collator(torch.utils.data.Dataset):
    """What a DataLoader worker runs: the Batch of the pairs it is given, then the pages it read
    are released (see TokenArray)."""

    def __init__(self, corpus: EncodedCorpus, special_ids: dict[str, int]):
        self.corpus, self.special_ids = corpus, special_ids

    def __getitem__(self, rows: np.ndarray) -> Batch:
        batch = collate(self.corpus.src, self.corpus.tgt, rows, rows, **self.special_ids)
        self.corpus.release_pages()
        return batch


class _Batches(torch.utils.data.Sampler):
    """The DataLoader's sampler: the batches (pair positions) of the pass being iterated."""

    def __init__(self):
        self.batches: list[np.ndarray] = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class TokenBatches:
    """Token-bucketed batches over an EncodedCorpus, like fairseq's --max-tokens.

    Pairs are sorted by (source length, target length) with a seeded random tie-break and packed
    consecutively while batch size x longest sequence (bos/eos and padding counted, either side)
    stays within ``max_tokens``; similar lengths together waste little padding. The batches are
    fixed; their order is shuffled per epoch from (seed, epoch) alone, so any process can recreate
    any epoch (resume, DDP ranks) without shared state. All of it is numpy over the lengths
    array (no Python object per pair), so a corpus of millions of pairs is planned in seconds and
    held in a few bytes per pair.

    With ``world_size`` W > 1, rank r takes batches r, r+W, r+2W, ... of the epoch's list. The list
    is first padded to a multiple of W by repeating its first batches (as DistributedSampler does),
    so every rank runs the same number of steps and no pair is skipped in any epoch.

    ``iterate`` collates in ``workers`` DataLoader worker processes (0: in this process), which
    prefetch the next batches while the current one trains; ``pin_memory`` for a CUDA device.
    """

    def __init__(
        self,
        corpus: EncodedCorpus,
        max_tokens: int,
        *,
        seed: int = 1,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        pad_id: int = 0,
        bos_id: int = 1,
        eos_id: int = 2,
        workers: int = 0,
        pin_memory: bool = False,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.max_tokens = max_tokens
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.order, self.bounds = self._plan(corpus)
        corpus.release_pages()  # the lengths were read once, for the plan
        self._pass = _Batches()
        special_ids = {"pad_id": pad_id, "bos_id": bos_id, "eos_id": eos_id}
        self._loader = torch.utils.data.DataLoader(
            _Collator(corpus, special_ids),
            sampler=self._pass,
            batch_size=None,
            num_workers=workers,
            persistent_workers=workers > 0,  # one worker start per run, not per epoch
            pin_memory=pin_memory,
            # A private generator: a DataLoader draws a seed for its workers at every pass, which
            # must not consume the global RNG the trainer checkpoints (exact resume).
            generator=torch.Generator(),
        )

    def _plan(self, corpus: EncodedCorpus) -> tuple[np.ndarray, np.ndarray]:
        """The pairs in batch order and the batch boundaries in it."""
        src_sizes = corpus.src.lengths.astype(np.int32) + 1  # + eos
        tgt_sizes = corpus.tgt.lengths.astype(np.int32) + 1  # + bos (input) or eos (output)
        index_type = np.int32 if len(src_sizes) < 2**31 else np.int64
        order = np.arange(len(src_sizes), dtype=index_type)
        # A private generator: batching must not consume the global RNG the trainer checkpoints.
        seeded_generator(f"fastnmt-order-{self.seed}").shuffle(order)
        key = src_sizes[order].astype(np.int64) << 32 | tgt_sizes[order]
        order = order[np.argsort(key, kind="stable")]  # stable: ties stay shuffled
        del key
        sizes = np.maximum(src_sizes, tgt_sizes)[order]
        return order, pack_by_tokens(sizes, self.max_tokens)

    @property
    def num_batches(self) -> int:
        """Batches per epoch, all ranks together."""
        return len(self.bounds) - 1

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return math.ceil(self.num_batches / self.world_size)

    def batch(self, number: int) -> np.ndarray:
        """The corpus positions of batch ``number``."""
        return self.order[self.bounds[number] : self.bounds[number + 1]]

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches (corpus positions) for ``epoch``, in the order they are trained."""
        positions = list(range(self.num_batches))
        if self.shuffle:
            random.Random(f"fastnmt-epoch-{self.seed}-{epoch}").shuffle(positions)
        padded_count = len(self) * self.world_size
        padded = [positions[i % len(positions)] for i in range(padded_count)]
        return [self.batch(p) for p in padded[self.rank :: self.world_size]]

    def iterate(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """This rank's batches for ``epoch``, skipping the first ``start`` (resuming mid-epoch).
        One pass at a time: a new call ends the previous pass."""
        self._pass.batches = self.epoch_batches(epoch)[start:]
        return iter(self._loader)

    def close(self) -> None:
        """End the worker processes (also done when this object is garbage-collected)."""
        self._loader = None
