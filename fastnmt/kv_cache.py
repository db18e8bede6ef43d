"""Key/value caches of incremental decoding, the ``cache=`` of
``fastnmt.attention.MultiheadAttention``: attention ``append``s each call's projected keys and
values (a static cache: the first call's only) and reads ``stored()``, the keys and values as
stored and the cache rows that pick each batch entry's storage entry per position
(``fastnmt.ops.attention(..., cache_rows=)``), masked by ``key_lengths`` (None: every stored
position is a key).

- ``KVCache``: storage that grows with the decoded positions; a beam search's reorder moves a
  table of rows (``CacheRows``), never the keys.
- ``FixedKVCache`` with its ``StepClock``: room for every position of a search, at fixed shapes
  and addresses, written at a device position, so that a CUDA graph can replay a decoding step
  (``fastnmt.decoding.static_search``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastnmt.ops import gather_cache_rows


class CacheRows:
    """Which storage entry holds each batch entry's key at each position of a ``KVCache``:
    ``table`` (B, capacity) int64, None until the first reorder (entry b's keys are then storage
    entry b's). KVCaches that append the same positions and reorder together, a search's
    self-attention caches (one per decoder layer), can share one: its table is then written once
    per position and gathered once per reorder, rather than once per layer (each a kernel on a
    GPU). KVCaches that share one are reordered through it (``reorder``), once."""

    def __init__(self):
        self.table: torch.Tensor | None = None
        self.capacity = 0  # positions of the caches' storage
        self.written = 0  # positions whose rows are set
        self._entries: torch.Tensor | None = None  # (B, 1) arange: a fresh position's rows

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` positions (the caches' storage grew), rows written kept."""
        if capacity <= self.capacity:
            return
        if self.table is not None:
            table = self.table.new_zeros(self.table.shape[0], capacity)
            table[:, : self.written] = self.table[:, : self.written]
            self.table = table
        self.capacity = capacity

    def append(self, batch: int, start: int, end: int) -> None:
        """Positions start..end-1 hold each batch entry's own keys (its storage entry)."""
        if end <= self.written:  # a cache sharing these rows wrote them
            return
        if self.table is not None:
            if self._entries is None or self._entries.shape[0] != batch:
                self._entries = torch.arange(batch, device=self.table.device)[:, None]
            self.table[:, start:end] = self._entries
        self.written = end

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch entries ``index`` (B',) in that order: only the (B', capacity) rows move."""
        if self.table is None:
            self.table = index[:, None].expand(-1, self.capacity).contiguous()
        else:
            self.table = self.table.index_select(0, index)


@dataclass
class KVCache:
    """Projected keys and values of one attention layer, kept across decoding steps.

    ``static=False`` (self-attention): every call appends that step's keys/values.
    ``static=True`` (cross-attention): keys/values are projected on the first call and reused.
    Storage grows by doubling from ``reserve`` positions, so appending a step does not copy the
    whole cache. ``reorder`` copies no keys either: a beam search reorders its hypotheses every
    step, and gathering the whole cache each time cost a tenth of a CPU decoding step. Instead
    ``rows`` records which storage entry holds each batch entry's key at each position, and
    attention reads the storage through it (``attention(..., cache_rows=)``); appended keys go
    to the storage entry of their batch index, at positions no entry refers to yet. Caches that
    append and reorder together may share their rows (``shared_rows``, a ``CacheRows``).
    """

    static: bool = False
    reserve: int = 16  # positions the first append allocates room for
    key_lengths = None  # every stored position is a key (``FixedKVCache`` masks some)
    length: int = 0
    _key: torch.Tensor | None = field(default=None, repr=False)  # (P, H, capacity, D)
    _value: torch.Tensor | None = field(default=None, repr=False)
    shared_rows: CacheRows = field(default_factory=CacheRows, repr=False)

    @property
    def rows(self) -> torch.Tensor | None:
        """(B, capacity) int64: batch entry b's key t is _key[rows[b, t], :, t]; None:
        _key[b, :, t]."""
        return self.shared_rows.table

    @property
    def key(self) -> torch.Tensor | None:
        """The cached keys (B, H, length, D), gathered from the storage when reordered."""
        return None if self._key is None else self._batch(self._key)

    @property
    def value(self) -> torch.Tensor | None:
        return None if self._value is None else self._batch(self._value)

    def _batch(self, storage: torch.Tensor) -> torch.Tensor:
        filled = storage[:, :, : self.length]
        return filled if self.rows is None else gather_cache_rows(filled, self.stored()[2])

    def stored(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What attention reads: keys and values (P, H, length, D) as stored and the cache rows
        (B, length) that pick each batch entry's (None: entry b is storage entry b)."""
        rows = None if self.rows is None else self.rows[:, : self.length]
        return self._key[:, :, : self.length], self._value[:, :, : self.length], rows

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Add keys/values (B, H, T, D) after the cached ones."""
        batch, end = key.shape[0], self.length + key.shape[2]
        if self._key is None or end > self._key.shape[2] or batch > self._key.shape[0]:
            self._grow(key, value, end)
        self._key[:batch, :, self.length : end] = key
        self._value[:batch, :, self.length : end] = value
        self.shared_rows.append(batch, self.length, end)
        self.length = end

    def _grow(self, key: torch.Tensor, value: torch.Tensor, needed: int) -> None:
        old = self._key
        if old is None:
            capacity = max(needed, self.reserve)
        elif needed > old.shape[2]:  # doubling keeps appends amortized O(1)
            capacity = max(needed, 2 * old.shape[2])
        else:  # more entries only (after a beam search's first step, one per sentence)
            capacity = old.shape[2]
        entries = max(key.shape[0], 0 if old is None else old.shape[0])
        old_value = self._value
        self._key = self._new_storage(key, entries, capacity)
        self._value = self._new_storage(value, entries, capacity)
        if self.length:
            self._key[: old.shape[0], :, : self.length] = old[:, :, : self.length]
            self._value[: old.shape[0], :, : self.length] = old_value[:, :, : self.length]
        self.shared_rows.grow(capacity)

    def _new_storage(self, like: torch.Tensor, entries: int, capacity: int) -> torch.Tensor:
        """(entries, H, capacity, D) storage. A self-attention cache is position-major in
        memory, so that each step's keys are one contiguous write (strided writes into fresh
        pages cost a decoding step 2x the attention's time); a static one is entry-major, so
        that each entry's keys are read contiguously at every step."""
        heads, width = like.shape[1], like.shape[3]
        if self.static:
            return like.new_empty(entries, heads, capacity, width)
        return like.new_empty(capacity, entries, heads, width).permute(1, 2, 0, 3)

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch entries ``index`` (B',) in that order, e.g. the surviving beams: only the
        (B', capacity) rows are gathered (caches sharing their rows: call it on one of them)."""
        if self._key is not None:
            self.shared_rows.reorder(index)


class StepClock:
    """The decoding position that every layer's ``FixedKVCache`` of one search shares, as device
    tensors (a CUDA graph replays the same step at every position): N batch entries, room for
    T positions. A step calls ``begin``, runs the decoder, then ``end``; a beam search's reorder
    gathers the one (N, T) table of cache rows all layers read."""

    def __init__(self, entries: int, capacity: int, device: torch.device):
        self.position = torch.zeros(1, dtype=torch.int64, device=device)  # the step's position
        self.key_lengths = torch.ones(entries, dtype=torch.int64, device=device)  # (N,)
        self.entries = torch.arange(entries, device=device)[:, None]  # (N, 1)
        # (N, T): entry n's key at position t is the storage entry rows[n, t]'s (KVCache.rows).
        self.rows = self.entries.expand(entries, capacity).contiguous()

    def restart(self) -> None:
        self.position.zero_()
        self.rows.copy_(self.entries.expand_as(self.rows))

    def begin(self) -> None:
        """Keys up to the step's position are visible; its keys go to each entry's storage."""
        torch.add(self.position.expand_as(self.key_lengths), 1, out=self.key_lengths)
        self.rows.index_copy_(1, self.position, self.entries)

    def end(self) -> None:
        self.position.add_(1)

    def reorder(self, index: torch.Tensor) -> None:
        """Entries ``index`` (N,) continue (a beam search's surviving hypotheses)."""
        self.rows.copy_(self.rows.index_select(0, index))


class FixedKVCache:
    """A self-attention cache with room for every position of a search, written at the device
    position of a ``StepClock``: its shapes and addresses never change, so a CUDA graph can
    replay a decoding step. Attention reads all T positions through the clock's rows and masks
    the ones not yet written with the clock's key lengths."""

    static = False

    def __init__(self, clock: StepClock):
        self.clock = clock
        self._key: torch.Tensor | None = None  # (T, N, H, D): a step's keys are one slice
        self._value: torch.Tensor | None = None

    @property
    def key_lengths(self) -> torch.Tensor:
        return self.clock.key_lengths

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write one step's keys/values (N, H, 1, D) at the clock's position."""
        if self._key is None:  # the first call, before any capture
            # Zeros, not uninitialised memory: attention masks the positions not yet written,
            # but a NaN there would still reach a reference backend's output (0 * NaN).
            capacity = self.clock.rows.shape[1]
            self._key = key.new_zeros(capacity, *key.shape[:2], key.shape[3])
            self._value = value.new_zeros(self._key.shape)
        self._key.index_copy_(0, self.clock.position, key.permute(2, 0, 1, 3))
        self._value.index_copy_(0, self.clock.position, value.permute(2, 0, 1, 3))

    def stored(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys and values (N, H, T, D) and the clock's cache rows (N, T)."""
        key, value = (x.permute(1, 2, 0, 3) for x in (self._key, self._value))
        return key, value, self.clock.rows
