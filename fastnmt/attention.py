"""Drop-in attention API: ``scaled_dot_product_attention``, ``MultiheadAttention``, ``KVCache``
(its ``CacheRows``), ``swap_multihead_attention``.

``MultiheadAttention`` takes ``torch.nn.MultiheadAttention``'s constructor and forward arguments,
has the same parameter names (so its state_dict loads unchanged) and gives the same results, on
fastnmt's dispatched attention op. It adds ``key_lengths=`` (padding as lengths, what fused kernels
want) and a ``KVCache`` for incremental decoding. Differences from torch, on purpose:

- a query that sees no key gets a 0 output and 0 weights, never NaN;
- with dropout, the returned weights are the probabilities before dropout (what one plots);
- ``is_causal=True`` is enough on its own (torch also wants the causal ``attn_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fastnmt.ops import attention, attention_probabilities, checks, gather_cache_rows


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    *,
    key_lengths=None,
    key_padding_mask=None,
    return_lse=False,
):
    """``torch.nn.functional.scaled_dot_product_attention`` with fastnmt's kernels and masks.

    Layout and the first arguments are SDPA's: query (B, H, Lq, D), key (B, H, Lk, D), value
    (B, H, Lk, Dv); ``attn_mask`` bool (True = may attend) or additive float, broadcastable to
    (B, H, Lq, Lk). Adds ``key_lengths`` (int (B,)) or ``key_padding_mask`` (bool (B, Lk), True =
    padding), and ``return_lse``. Rows that see no key give 0 rather than NaN.
    """
    return attention(
        query,
        key,
        value,
        key_lengths=key_lengths,
        key_padding_mask=key_padding_mask,
        attn_mask=attn_mask,
        causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
        return_lse=return_lse,
    )


class CacheRows:
    """Which storage entry holds each batch entry's key at each position of a ``KVCache``:
    ``table`` (B, capacity) int64 once reordered (None before: entry b's keys are storage entry
    b's). KVCaches that append the same positions and reorder together, a search's self-attention
    caches (one per decoder layer), can share one: its table is then written once per position
    and gathered once per reorder, rather than once per layer (each a kernel on a GPU).
    KVCaches that share one are reordered through it (``reorder``), once."""

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
            capacity = self.clock.rows.shape[1]
            self._key = key.new_empty(capacity, *key.shape[:2], key.shape[3])
            self._value = value.new_empty(self._key.shape)
        self._key.index_copy_(0, self.clock.position, key.permute(2, 0, 1, 3))
        self._value.index_copy_(0, self.clock.position, value.permute(2, 0, 1, 3))

    def stored(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys and values (N, H, T, D) and the clock's cache rows (N, T)."""
        key, value = (x.permute(1, 2, 0, 3) for x in (self._key, self._value))
        return key, value, self.clock.rows


class MultiheadAttention(nn.Module):
    """Drop-in for ``torch.nn.MultiheadAttention`` on fastnmt's attention op.

    Same constructor, parameters and forward as torch's, plus ``key_lengths`` and ``cache``
    (see the module docstring for the few deliberate differences).
    """

    def __init__(
        self,
        embed_dim,
        num_heads,
        dropout=0.0,
        bias=True,
        add_bias_kv=False,
        add_zero_attn=False,
        kdim=None,
        vdim=None,
        batch_first=False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"embed_dim and num_heads must be positive, got {embed_dim} and {num_heads}"
            )
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = checks.probability("dropout", dropout)
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(name, None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        # The rows of in_proj_weight (and in_proj_bias) of each projection part.
        e = embed_dim
        self.projection_rows = {
            "q": slice(0, e),
            "k": slice(e, 2 * e),
            "v": slice(2 * e, 3 * e),
            "kv": slice(e, 3 * e),
            "qkv": slice(0, 3 * e),
        }
        # Packed GEMMs (int8 or bf16) of the input projections, by part: set by fastnmt.quantize.
        self.packed_projections: nn.ModuleDict | None = None
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """The initialisation of ``torch.nn.MultiheadAttention``."""
        for weight in (
            self.in_proj_weight,
            self.q_proj_weight,
            self.k_proj_weight,
            self.v_proj_weight,
        ):
            if weight is not None:
                nn.init.xavier_uniform_(weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        for extra in (self.bias_k, self.bias_v):
            if extra is not None:
                nn.init.xavier_normal_(extra)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiheadAttention:
        """A fastnmt copy of ``module``: same settings, weights, device, dtype and mode."""
        reference = module.out_proj.weight
        new = cls(
            module.embed_dim,
            module.num_heads,
            dropout=module.dropout,
            bias=module.in_proj_bias is not None,
            add_bias_kv=module.bias_k is not None,
            add_zero_attn=module.add_zero_attn,
            kdim=module.kdim,
            vdim=module.vdim,
            batch_first=module.batch_first,
            device=reference.device,
            dtype=reference.dtype,
        )
        new.load_state_dict(module.state_dict())
        return new.train(module.training)

    def _in_projections(self, *inputs: tuple[torch.Tensor, str]) -> list[torch.Tensor]:
        """Each input x (B, L, in) projected by its part (q, k, v, kv or qkv: outputs side by
        side), with the int8 or bf16 GEMMs ``fastnmt.quantize`` packed when it did."""
        if self.packed_projections is not None:
            return [self.packed_projections[part](x) for x, part in inputs]
        parts = [part for _, part in inputs]
        biases = self._rows_of(self.in_proj_bias, parts)
        if self._qkv_same_embed_dim:
            weights = self._rows_of(self.in_proj_weight, parts)
        else:
            separate = {"q": self.q_proj_weight, "k": self.k_proj_weight, "v": self.v_proj_weight}
            weights = [separate[part] for part in parts]
        return [F.linear(x, w, b) for (x, _), w, b in zip(inputs, weights, biases, strict=True)]

    def _rows_of(self, stacked: torch.Tensor | None, parts: list[str]) -> list:
        """The rows of ``in_proj_weight`` or ``in_proj_bias`` (None: Nones) of each part, in
        order: the tensor itself for all of it; one ``split`` when the parts cover it, whose
        backward concatenates their gradients once, where a slice per part gives each a
        zero-filled gradient of the whole tensor, then a sum (three kernels a part on a GPU)."""
        if stacked is None:
            return [None] * len(parts)
        rows = [self.projection_rows[part] for part in parts]
        sizes = [part.stop - part.start for part in rows]
        if sum(sizes) < stacked.shape[0]:
            return [stacked[part] for part in rows]
        return [stacked] if len(sizes) == 1 else list(stacked.split(sizes))

    def _project(self, query, key, value, cache):
        """Project (B, L, E) inputs to heads (B, H, L, D); with a cache, add to / read from it,
        then k and v are its storage and the cache rows come with them (else None).
        Inputs that are the same tensor share one GEMM (self-attention: qkv; cross: kv)."""
        if cache is not None and cache.static and cache.length:
            return self._heads(self._in_projections((query, "q"))[0]), *cache.stored()
        same = self._qkv_same_embed_dim
        if query is key and key is value and same:
            q, k, v = self._in_projections((query, "qkv"))[0].chunk(3, dim=-1)
        elif key is value and same:
            q, kv = self._in_projections((query, "q"), (key, "kv"))
            k, v = kv.chunk(2, dim=-1)
        else:
            q, k, v = self._in_projections((query, "q"), (key, "k"), (value, "v"))
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        if cache is None:
            return q, k, v, None
        cache.append(k, v)
        return q, *cache.stored()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
        *,
        key_lengths=None,
        cache=None,
    ):
        """Arguments and results of ``torch.nn.MultiheadAttention.forward``, plus:

        key_lengths: int (B,), keys at positions >= key_lengths[b] are padding (instead of
            ``key_padding_mask``; what the fused kernels take directly).
        cache: a ``KVCache`` for incremental decoding (see its docstring). Masks then refer to
            all keys, cached ones included.
        """
        batched = query.dim() == 3
        query, key, value = (
            self._batch_first(x, name, batched)
            for name, x in (("query", query), ("key", key), ("value", value))
        )
        if not batched:
            key_padding_mask = None if key_padding_mask is None else key_padding_mask[None]
            key_lengths = None if key_lengths is None else key_lengths[None]
        if key_lengths is None and cache is not None:
            key_lengths = cache.key_lengths  # a FixedKVCache's positions not yet written
        batch = query.shape[0]
        q, k, v, cache_rows = self._project(query, key, value, cache)  # (B, H, L, D)
        # Weights, extra keys and gradients take a batch of keys: read the cache's rows once.
        extra_keys = self.bias_k is not None or self.add_zero_attn
        if cache_rows is not None and (need_weights or _gradients_through(q, k) or extra_keys):
            k, v = gather_cache_rows(k, cache_rows), gather_cache_rows(v, cache_rows)
            cache_rows = None
        past = k.shape[2] - q.shape[2] if cache is not None and not cache.static else 0
        masks = _AttentionMasks.from_module_arguments(
            key_padding_mask,
            key_lengths,
            attn_mask,
            is_causal,
            (batch, self.num_heads, q.shape[2], k.shape[2]),
            past,
            q,
        )
        k, v, masks = self._extra_keys(k, v, masks, q.shape[2])
        result = attention(
            q,
            k,
            v,
            key_lengths=masks.key_lengths,
            key_padding_mask=masks.key_padding_mask,
            attn_mask=masks.attn_mask,
            causal=masks.causal,
            dropout_p=self.dropout if self.training else 0.0,
            return_lse=need_weights,
            cache_rows=cache_rows,
        )
        out, lse = result if need_weights else (result, None)  # (B, H, Lq, D), (B, H, Lq)
        out = self._out_projection(out)
        weights = None
        if need_weights:
            weights = attention_probabilities(
                q,
                k,
                key_lengths=masks.key_lengths,
                key_padding_mask=masks.key_padding_mask,
                attn_mask=masks.attn_mask,
                causal=masks.causal,
                lse=lse,  # P = exp(S - lse): the fused path needs no second softmax
            )  # (B, H, Lq, Lk)
            weights = weights.mean(dim=1) if average_attn_weights else weights
            weights = weights if batched else weights[0]
        if not batched:
            return out[0], weights
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def attend(self, query, key, *, key_lengths=None, causal=False, cache=None, dropout_seed=None):
        """``forward(query, key, key, ...)``'s output for fastnmt's model, with less host work
        per call (a decoding step makes six): batch-first (B, L, E) inputs, the value is the
        key, masks only as ``key_lengths`` and ``causal``, no weights and no ``bias_k`` or
        ``add_zero_attn`` (``forward`` checks and translates torch's arguments at every call);
        ``dropout_seed`` as ``fastnmt.ops.attention`` takes it."""
        q, k, v, cache_rows = self._project(query, key, key, cache)  # (B, H, L, D)
        if key_lengths is None and cache is not None:
            key_lengths = cache.key_lengths  # a FixedKVCache's positions not yet written
        past = k.shape[2] - q.shape[2] if cache is not None and not cache.static else 0
        attn_mask, causal = bottom_right_causal(causal, q.shape[2], k.shape[2], past, q.device)
        if cache_rows is not None and _gradients_through(q, k):
            k, v = gather_cache_rows(k, cache_rows), gather_cache_rows(v, cache_rows)
            cache_rows = None
        out = attention(
            q,
            k,
            v,
            key_lengths=key_lengths,
            attn_mask=attn_mask,
            causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
            cache_rows=cache_rows,
            dropout_seed=dropout_seed,
        )
        return self._out_projection(out)

    def _out_projection(self, out: torch.Tensor) -> torch.Tensor:
        """Heads (B, H, L, D) joined to (B, L, E) and projected."""
        batch, _, length, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, self.embed_dim))

    def _batch_first(self, x, name: str, batched: bool) -> torch.Tensor:
        """(B, L, E) view of an input given in the module's layout."""
        checks.tensor(name, x, floating=True)
        if x.dim() != (3 if batched else 2):
            layout = "(N, L, E)" if self.batch_first else "(L, N, E)"
            raise ValueError(
                f"{name} must be {layout} (3 dimensions) or unbatched (L, E), like query; got "
                f"shape {tuple(x.shape)}"
            )
        if not batched:
            return x[None]
        return x if self.batch_first else x.transpose(0, 1)

    def _extra_keys(self, k, v, masks, q_len: int):
        """Append ``bias_k``/``bias_v`` and the zero key of ``add_zero_attn`` (torch's options)."""
        batch = k.shape[0]
        extra_k, extra_v = [], []
        if self.bias_k is not None:
            extra_k.append(self._heads(self.bias_k.expand(batch, 1, -1)))
            extra_v.append(self._heads(self.bias_v.expand(batch, 1, -1)))
        if self.add_zero_attn:
            extra_k.append(k.new_zeros(*k.shape[:2], 1, k.shape[3]))
            extra_v.append(v.new_zeros(*v.shape[:2], 1, v.shape[3]))
        if not extra_k:
            return k, v, masks
        k, v = torch.cat([k, *extra_k], dim=2), torch.cat([v, *extra_v], dim=2)
        return k, v, masks.with_visible_keys(len(extra_k), q_len, k.shape[2])


def merge_masks(first, second):
    """Combine two op-style masks (bool: True = may attend; float: additive)."""
    if first is None or second is None:
        return second if first is None else first
    if first.dtype == torch.bool and second.dtype == torch.bool:
        return first & second
    return _additive(first) + _additive(second)


def _additive(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, float("-inf")
    )


def bottom_right_causal(causal: bool, lq: int, lk: int, past: int, device):
    """(bool mask or None, causal flag) for the op: with ``past`` keys before the queries (a
    cache) the Lq queries are the last positions (bottom-right alignment), which the op's
    top-left ``causal`` is not; one query sees every key and needs no mask."""
    if not (causal and past):
        return None, causal
    return (causal_allowed(lq, lk, past, device) if lq > 1 else None), False


def _gradients_through(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a call must give gradients for q or k: the kernels read cache rows only without
    (a cache's keys are then gathered first)."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)


def causal_allowed(lq: int, lk: int, past: int, device) -> torch.Tensor:
    """Bool (Lq, Lk), True where query i (at position past + i) may see key j."""
    positions = torch.arange(past, past + lq, device=device)
    return torch.arange(lk, device=device)[None, :] <= positions[:, None]


@dataclass
class _AttentionMasks:
    """The masks of one ``MultiheadAttention`` call in the attention op's terms."""

    key_lengths: torch.Tensor | None
    key_padding_mask: torch.Tensor | None  # bool (B, Lk), True = padding
    attn_mask: torch.Tensor | None  # bool (True = may attend) or additive, to (B, H, Lq, Lk)
    causal: bool

    @classmethod
    def from_module_arguments(
        cls, key_padding_mask, key_lengths, attn_mask, is_causal, shape, past, like
    ):
        """Translate torch's masks; ``shape`` is (B, H, Lq, Lk), ``past`` the cached queries."""
        batch, _, lq, lk = shape
        if is_causal:
            attn_mask = None  # torch treats is_causal as a hint that attn_mask is causal
        elif attn_mask is not None:
            attn_mask = _op_attn_mask(attn_mask, shape, like)
        if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
            # torch also takes an additive float padding mask: one more additive mask here.
            checks.shape("key_padding_mask", key_padding_mask, (batch, lk), "(N, S)")
            additive = key_padding_mask.to(like.dtype)[:, None, None, :]
            attn_mask, key_padding_mask = merge_masks(attn_mask, additive), None
        cached_causal, causal = bottom_right_causal(bool(is_causal), lq, lk, past, like.device)
        return cls(key_lengths, key_padding_mask, merge_masks(attn_mask, cached_causal), causal)

    def with_visible_keys(self, count: int, lq: int, lk: int) -> _AttentionMasks:
        """Masks after ``count`` keys that every query sees were appended (``lk`` keys in all)."""
        padding = self.key_padding_mask
        if self.key_lengths is not None:
            positions = torch.arange(lk - count, device=self.key_lengths.device)
            padding = positions >= self.key_lengths[:, None]
        if padding is not None:
            padding = F.pad(padding, (0, count), value=False)
        attn_mask = self.attn_mask
        if self.causal:
            device = attn_mask.device if attn_mask is not None else None
            causal = causal_allowed(lq, lk - count, 0, device)
            attn_mask = merge_masks(attn_mask, causal)
        if attn_mask is not None:
            attn_mask = F.pad(attn_mask, (0, count), value=attn_mask.dtype == torch.bool or 0.0)
        return _AttentionMasks(None, padding, attn_mask, False)


def _op_attn_mask(attn_mask, shape, like) -> torch.Tensor:
    """torch's attn_mask (L, S) or (N*H, L, S), bool True = not allowed, to the op's form."""
    batch, heads, lq, lk = shape
    checks.tensor("attn_mask", attn_mask)
    if tuple(attn_mask.shape) == (lq, lk):
        attn_mask = attn_mask[None, None]
    elif tuple(attn_mask.shape) == (batch * heads, lq, lk):
        attn_mask = attn_mask.view(batch, heads, lq, lk)
    else:
        raise ValueError(
            f"attn_mask must have shape (L, S) = {(lq, lk)} or (N * num_heads, L, S) = "
            f"{(batch * heads, lq, lk)}, got {tuple(attn_mask.shape)}"
        )
    if attn_mask.dtype == torch.bool:
        return ~attn_mask
    return attn_mask.to(like.dtype)


def swap_multihead_attention(model: nn.Module) -> nn.Module:
    """Replace every ``torch.nn.MultiheadAttention`` inside ``model`` by fastnmt's, in place,
    keeping weights, settings, device, dtype and train/eval mode; returns ``model`` (or the new
    module when ``model`` itself is one).

    ``torch.nn.TransformerEncoderLayer`` has an inference fast path (eval mode, no grad) that calls
    torch's fused encoder kernel on the attention weights instead of the attention module; it gives
    the same results. ``torch.backends.mha.set_fastpath_enabled(False)`` routes it through fastnmt.
    """
    if isinstance(model, nn.MultiheadAttention):
        return MultiheadAttention.from_torch(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.MultiheadAttention):
                setattr(parent, name, MultiheadAttention.from_torch(child))
    return model
