"""Drop-in attention API: ``scaled_dot_product_attention``, ``MultiheadAttention``, ``KVCache``
(its ``CacheRows``), ``swap_multihead_attention``.

``MultiheadAttention`` takes ``torch.nn.MultiheadAttention``'s constructor and forward arguments,
has the same parameter names (so its state_dict loads unchanged) and gives the same results, on
fastnmt's dispatched attention op. It adds ``key_lengths=`` (padding as lengths, what fused kernels
want), a ``KVCache`` for incremental decoding (``fastnmt.kv_cache``, whose caches are importable
from here too) and, in ``attend``, packed sequences without padding (``Packed``). Differences from
torch, on purpose:

- a query that sees no key gets a 0 output and 0 weights, never NaN;
- with dropout, the returned weights are the probabilities before dropout (what one plots);
- ``is_causal=True`` is enough on its own (torch also wants the causal ``attn_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fastnmt.kv_cache import CacheRows as CacheRows  # the caches, importable from here too
from fastnmt.kv_cache import FixedKVCache as FixedKVCache
from fastnmt.kv_cache import KVCache as KVCache
from fastnmt.kv_cache import StepClock as StepClock
from fastnmt.ops import (
    attention,
    attention_probabilities,
    attention_varlen,
    checks,
    gather_cache_rows,
)


@dataclass(frozen=True)
class Packed:
    """Sequences packed end to end, without padding (``attention_varlen``'s layout): sequence b
    is rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1 of a (total, ...) tensor."""

    cu_seqlens: torch.Tensor  # (B + 1,) int64
    longest: int  # the longest sequence's length
    positions: torch.Tensor  # (total,) int64: each row's position in its sequence

    @classmethod
    def of_lengths(
        cls, lengths: list[int] | np.ndarray, device: torch.device | str = "cpu"
    ) -> Packed:
        """The layout of sequences of ``lengths`` (built on the host, then moved)."""
        counts = np.asarray(lengths, dtype=np.int64)
        cu_seqlens = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu_seqlens[1:])
        positions = np.arange(cu_seqlens[-1]) - np.repeat(cu_seqlens[:-1], counts)
        return cls(
            torch.from_numpy(cu_seqlens).to(device),
            int(counts.max(initial=0)),
            torch.from_numpy(positions).to(device),
        )


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

    def _heads(self, x: torch.Tensor) -> torch.Tensor:  # (B, L, E) -> (B, H, L, D)
        if x.dim() == 2:  # packed: (total, E) -> (total, H, D)
            return x.view(x.shape[0], self.num_heads, self.head_dim)
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
            self._batch_first(x, name, batched, features)
            for name, x, features in (
                ("query", query, "embed_dim"),
                ("key", key, "kdim"),
                ("value", value, "vdim"),
            )
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

    def attend(
        self,
        query,
        key,
        *,
        key_lengths=None,
        causal=False,
        cache=None,
        dropout_seed=None,
        packed: tuple[Packed, Packed] | None = None,
    ):
        """``forward(query, key, key, ...)``'s output for fastnmt's model, with less host work
        per call (a decoding step makes six): batch-first (B, L, E) inputs, the value is the
        key, masks only as ``key_lengths`` and ``causal``, no weights and no ``bias_k`` or
        ``add_zero_attn`` (``forward`` checks and translates torch's arguments at every call);
        ``dropout_seed`` as ``fastnmt.ops.attention`` takes it. ``packed``: the queries' and the
        keys' layouts, query (total_q, E) and key (total_k, E) then being packed sequences
        (``attention_varlen``; no cache)."""
        q, k, v, cache_rows = self._project(query, key, key, cache)  # (B, H, L, D)
        if packed is not None:  # (total, H, D)
            out = self._attend_packed(q, k, v, *packed, causal, dropout_seed)
            return self._out_projection(out)
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

    def _attend_packed(self, q, k, v, queries: Packed, keys: Packed, causal: bool, dropout_seed):
        return attention_varlen(
            q, k, v, queries.cu_seqlens, keys.cu_seqlens, queries.longest, keys.longest,
            causal=causal, dropout_p=self.dropout if self.training else 0.0,
            dropout_seed=dropout_seed,
        )  # fmt: skip

    def _out_projection(self, out: torch.Tensor) -> torch.Tensor:
        """Heads (B, H, L, D) joined to (B, L, E) and projected; packed, (total, H, D) to
        (total, E)."""
        if out.dim() == 3:
            return self.out_proj(out.reshape(out.shape[0], self.embed_dim))
        batch, _, length, _ = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, self.embed_dim))

    def _batch_first(self, x, name: str, batched: bool, features: str) -> torch.Tensor:
        """(B, L, E) view of an input given in the module's layout, whose last dimension must
        be the module's attribute ``features`` (its projection's input features)."""
        checks.tensor(name, x, floating=True)
        if x.dim() != (3 if batched else 2):
            layout = "(N, L, E)" if self.batch_first else "(L, N, E)"
            raise ValueError(
                f"{name} must be {layout} (3 dimensions) or unbatched (L, E), like query; got "
                f"shape {tuple(x.shape)}"
            )
        if x.shape[-1] != getattr(self, features):
            raise ValueError(
                f"{name} must have {features} = {getattr(self, features)} features in its last "
                f"dimension, got shape {tuple(x.shape)}"
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
