"""``attn_implementation="fastnmt"`` for Hugging Face transformers (>= 5.0).

transformers looks attention up by name in two registries: ``AttentionInterface`` (the function a
model's attention modules call) and ``AttentionMaskInterface`` (how the model builds the mask it
passes them). fastnmt's kernels take padding, not dense masks, so the mask builder is the
flash-attention one: the 2D (B, Lk) padding mask (True = keep), or None when nothing is padded.
Left and right padding are the same to a padding mask. Causality comes from the module
(``is_causal``) or the call's ``is_causal``; with a KV cache the Lq new queries are the last
positions (bottom-right alignment).

Packed calls: ``apply_fastnmt``'s layers drop padded positions before their projections and FFN
and give the attention modules (1, tokens, d) hidden states. They pass ``fastnmt_query_packing`` /
``fastnmt_key_packing`` (a ``Packing``) through the module's kwargs, and the attention function
runs ``attention_varlen`` on the packed queries and keys as they are; where it cannot (a packed
side facing a padded one, weights asked for, grouped-query heads), it puts them back in their
padded (B, H, L, D) places for the kernels, and packs the output again.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fastnmt.attention import bottom_right_causal, merge_masks
from fastnmt.ops import attention, attention_probabilities, attention_varlen

NAME = "fastnmt"


class UnsupportedModelError(ValueError):
    """A model or call fastnmt's attention cannot serve; the message is one line."""


class Packing(NamedTuple):
    """The kept positions of a (batch, length) padded layout, packed as (1, tokens, ...)."""

    rows: torch.Tensor  # (tokens,) int64: flat indices b * length + i of the kept positions
    batch: int
    length: int
    cu_seqlens: torch.Tensor  # (B + 1,) int64: each row's first packed position
    longest: int  # the most positions a row keeps

    @classmethod
    def of(cls, mask: torch.Tensor) -> Packing:
        """From a (B, L) mask, True / 1 = kept (host syncs, for the row count and the longest
        row: once per mask a model passes its stack)."""
        kept = mask.bool()
        lengths = kept.sum(1)
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
        longest = int(lengths.max()) if len(lengths) else 0
        return cls(kept.flatten().nonzero().squeeze(1), *mask.shape, cu_seqlens, longest)

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) -> (1, tokens, ...)."""
        return padded.flatten(0, 1).index_select(0, self.rows).unsqueeze(0)

    def unpack(self, packed: torch.Tensor, fill: torch.Tensor | None = None) -> torch.Tensor:
        """(1, tokens, ...) -> (B, L, ...); the dropped positions from ``fill`` (else zeros).
        index_put, not index_copy: index_copy's backward keeps the packed rows themselves (for
        their shape), index_put's only the row indices."""
        rows = packed[0]
        if fill is None:
            flat = rows.new_zeros(self.batch * self.length, *rows.shape[1:])
        else:
            flat = fill.flatten(0, 1).to(rows.dtype)
        return flat.index_put((self.rows,), rows).unflatten(0, (self.batch, self.length))

    def unpack_heads(self, packed: torch.Tensor) -> torch.Tensor:
        """(1, H, tokens, D) -> (B, H, L, D), zeros at the dropped positions."""
        return self.unpack(packed.transpose(1, 2)).transpose(1, 2)


def _masks(attention_mask, causal: bool, lq: int, lk: int, device):
    """(key_padding_mask, attn_mask, causal) in the op's terms from transformers' mask."""
    key_padding_mask = attn_mask = None
    if attention_mask is not None and attention_mask.dim() == 2:  # (B, Lk), True = keep
        key_padding_mask = ~attention_mask[:, -lk:].bool()
    elif attention_mask is not None:  # a 4D mask a caller built: bool (True = keep) or additive
        attn_mask = attention_mask
    # With a KV cache the Lq queries come after its lk - lq keys.
    cached, causal = bottom_right_causal(causal, lq, lk, lk - lq, device)
    return key_padding_mask, merge_masks(attn_mask, cached), causal


def _wants_probabilities(module, kwargs) -> bool:
    config = getattr(module, "config", None)
    return bool(kwargs.get("output_attentions", getattr(config, "output_attentions", False)))


def fastnmt_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention-function contract: query (B, H, Lq, D), key/value (B, H, Lk, D)
    -> ((B, Lq, H, D), probabilities (B, H, Lq, Lk) when output_attentions, else None). Packed
    queries / keys are (1, H, tokens, D), and so is the output then (1, tokens, H, D)."""
    if kwargs.get("position_bias") is not None:
        raise UnsupportedModelError(
            f"attn_implementation={NAME!r} does not take T5/mT5's additive position bias (its "
            "kernels mask by padding and causality only); use 'sdpa' or 'eager' for this model"
        )
    query_packing = kwargs.get("fastnmt_query_packing")
    key_packing = kwargs.get("fastnmt_key_packing")
    causal = bool(getattr(module, "is_causal", False) if is_causal is None else is_causal)
    need_weights = _wants_probabilities(module, kwargs)
    if _runs_packed(query, key, query_packing, key_packing, need_weights):
        heads = (x[0].transpose(0, 1) for x in (query, key, value))  # (tokens, H, D) views
        out = attention_varlen(
            *heads, query_packing.cu_seqlens, key_packing.cu_seqlens, query_packing.longest,
            key_packing.longest, causal=causal, dropout_p=dropout, scale=scaling,
        )  # fmt: skip
        return out.unsqueeze(0), None
    if query_packing is not None:
        query = query_packing.unpack_heads(query)
    if key_packing is not None:
        key, value = key_packing.unpack_heads(key), key_packing.unpack_heads(value)
    if key.shape[1] != query.shape[1]:  # grouped-query attention: each key head serves a group
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    lq, lk = query.shape[2], key.shape[2]
    key_padding_mask, attn_mask, causal = _masks(attention_mask, causal, lq, lk, query.device)
    masks = dict(key_padding_mask=key_padding_mask, attn_mask=attn_mask, causal=causal)
    result = attention(
        query, key, value, dropout_p=dropout, scale=scaling, return_lse=need_weights, **masks
    )
    out, lse = result if need_weights else (result, None)
    weights = None
    if need_weights:  # exact from the log-sum-exp: no second softmax
        weights = attention_probabilities(query, key, scale=scaling, lse=lse, **masks)
    out = out.transpose(1, 2)
    return (out if query_packing is None else query_packing.pack(out)), weights


def _runs_packed(query, key, query_packing, key_packing, need_weights) -> bool:
    """Whether a call's packed sides go to ``attention_varlen`` as they are: both packed (their
    masks are all the masking there is: a packing comes from a 2D padding mask, and no KV cache
    is packed), as many key heads as query heads, and no weights."""
    if query_packing is None or key_packing is None or need_weights:
        return False
    return key.shape[1] == query.shape[1]


def register() -> None:
    """Register ``"fastnmt"`` in transformers' attention and mask registries (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    AttentionInterface.register(NAME, fastnmt_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
