r"""Masked scaled-dot-product attention: ``attention(q, k, v, ...)``.

Math, for one batch entry b and head h, queries i < Lq, keys j < Lk:

    S_ij   = scale * q_i . k_j                                   scale defaults to D^-1/2
    vis_ij = (j < key_length_b) and (not causal or j <= i) and attn_mask allows (i, j)
    lse_i  = log sum_{j: vis_ij} exp(S_ij)                       -inf when row i sees no key
    P_ij   = exp(S_ij - lse_i) if vis_ij else 0                  a row that sees no key is all 0
    O_i    = sum_j Pd_ij v_j,     Pd_ij = P_ij * keep_ij / (1 - p)   (dropout with probability p)

Backward, given dO:

    dV_j   = sum_i Pd_ij dO_i
    dPd_ij = dO_i . v_j,           dP_ij = dPd_ij * keep_ij / (1 - p)
    delta_i = sum_j P_ij dP_ij = dO_i . O_i
    dS_ij  = P_ij (dP_ij - delta_i)
    dQ_i   = scale sum_j dS_ij k_j,       dK_j = scale sum_i dS_ij q_i

A row with no visible key has P = 0, hence dS = 0: its output and its gradients are exactly 0,
never NaN (the unfused softmax over an all -inf row gives NaN; pytorch #103749).

Layout is that of ``torch.nn.functional.scaled_dot_product_attention``: q (B, H, Lq, D),
k (B, H, Lk, D), v (B, H, Lk, Dv), any strides. ``causal`` is top-left aligned (query i sees keys
j <= i), like SDPA's ``is_causal``.

This file holds the PyTorch reference (the fallback and the test oracle); the Triton and C++
kernels register themselves as further backends of the same dispatch entry.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastnmt import _checks, dispatch

# ---------------------------------------------------------------------------------------------
# PyTorch reference: the unfused computation a user writes by hand.
# ---------------------------------------------------------------------------------------------


def hidden_keys(
    key_lengths, key_padding_mask, causal, lq: int, lk: int, device
) -> torch.Tensor | None:
    """Bool mask, True where query i may not see key j, broadcastable to (B, 1, Lq, Lk)."""
    hidden = None
    if key_lengths is not None:
        key_padding_mask = torch.arange(lk, device=device) >= key_lengths[:, None]  # (B, Lk)
    if key_padding_mask is not None:
        hidden = key_padding_mask[:, None, None, :]  # (B, 1, 1, Lk)
    if causal:
        later = torch.ones(lq, lk, dtype=torch.bool, device=device).triu(1)  # (Lq, Lk): j > i
        hidden = later if hidden is None else hidden | later
    return hidden


def masked_scores(q, k, key_lengths, key_padding_mask, attn_mask, causal, scale):
    """Scaled scores with -inf where a key is not visible, and the rows that see no key."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
    if attn_mask is not None:
        scores = (
            scores.masked_fill(~attn_mask, float("-inf"))
            if attn_mask.dtype == torch.bool
            else scores + attn_mask
        )
    hidden = hidden_keys(key_lengths, key_padding_mask, causal, q.shape[-2], k.shape[-2], q.device)
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    empty_rows = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (B, H, Lq, 1)
    # A finite stand-in row keeps softmax (and its backward) free of NaN; its P is zeroed below.
    return scores.masked_fill(empty_rows, 0.0), empty_rows


def attention_reference(
    q, k, v, key_lengths, key_padding_mask, attn_mask, causal, dropout_p, scale, return_lse
):
    scores, empty_rows = masked_scores(
        q, k, key_lengths, key_padding_mask, attn_mask, causal, scale
    )
    probs = torch.softmax(scores, dim=-1).masked_fill(empty_rows, 0.0)  # (B, H, Lq, Lk)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.matmul(probs, v)  # (B, H, Lq, Dv)
    lse = None
    if return_lse:
        lse = torch.logsumexp(scores.float(), dim=-1)  # (B, H, Lq)
        lse = lse.masked_fill(empty_rows.squeeze(-1), float("-inf"))
    return out, lse


def attention_probabilities(
    q, k, *, key_lengths=None, key_padding_mask=None, attn_mask=None, causal=False, scale=None
) -> torch.Tensor:
    """Attention probabilities P (B, H, Lq, Lk), before dropout; rows that see no key are 0.

    For inspection and plotting (``need_weights``); takes the masks of ``attention()``.
    """
    scale = _check_scores_inputs(q, k, key_lengths, key_padding_mask, attn_mask, causal, scale)
    scores, empty_rows = masked_scores(
        q, k, key_lengths, key_padding_mask, attn_mask, causal, scale
    )
    return torch.softmax(scores.float(), dim=-1).masked_fill(empty_rows, 0.0).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Argument checks and the registered op.
# ---------------------------------------------------------------------------------------------


def _check_key_lengths(key_lengths, batch: int, lk: int, like: torch.Tensor) -> None:
    _checks.tensor("key_lengths", key_lengths, ndim=1)
    if key_lengths.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"key_lengths must be int32 or int64, got {key_lengths.dtype}")
    _checks.shape("key_lengths", key_lengths, (batch,), "one length per batch entry")
    _checks.same_device("key_lengths", key_lengths, "q", like)
    # Out-of-range lengths would silently read padding; the check costs one sync outside tracing.
    if not torch.compiler.is_compiling() and key_lengths.numel():
        low, high = torch.aminmax(key_lengths)
        if low < 0 or high > lk:
            raise ValueError(
                f"key_lengths must lie in [0, {lk}] (the key length), got values in "
                f"[{int(low)}, {int(high)}]"
            )


def _check_masks(key_padding_mask, attn_mask, q, expected_scores: tuple[int, ...]) -> None:
    batch, lk = expected_scores[0], expected_scores[-1]
    if key_padding_mask is not None:
        _checks.tensor("key_padding_mask", key_padding_mask, ndim=2)
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(
                f"key_padding_mask must be a bool tensor (True = padding), got "
                f"{key_padding_mask.dtype}"
            )
        _checks.shape("key_padding_mask", key_padding_mask, (batch, lk), "(B, Lk)")
        _checks.same_device("key_padding_mask", key_padding_mask, "q", q)
    if attn_mask is not None:
        _checks.tensor("attn_mask", attn_mask)
        if attn_mask.dtype != torch.bool:
            _checks.same_dtype("attn_mask", attn_mask, "q", q)
        _checks.same_device("attn_mask", attn_mask, "q", q)
        try:
            broadcast = torch.broadcast_shapes(attn_mask.shape, expected_scores)
        except RuntimeError:
            broadcast = None
        if attn_mask.dim() > 4 or broadcast != torch.Size(expected_scores):
            raise ValueError(
                f"attn_mask must broadcast to (B, H, Lq, Lk) = {expected_scores}, got "
                f"{tuple(attn_mask.shape)}"
            )


def _check_scores_inputs(q, k, key_lengths, key_padding_mask, attn_mask, causal, scale) -> float:
    """Checks what the scores S depend on; returns the scale to use."""
    for name, tensor in (("q", q), ("k", k)):
        _checks.tensor(name, tensor, ndim=4, floating=True)
    _checks.same_device("k", k, "q", q)
    _checks.same_dtype("k", k, "q", q)
    batch, heads, lq, head_dim = q.shape
    lk = k.shape[2]
    _checks.shape("k", k, (batch, heads, lk, head_dim), "(B, H, Lk, D) matching q's B, H, D")
    if key_lengths is not None and key_padding_mask is not None:
        raise ValueError("give key_lengths or key_padding_mask, not both")
    if key_lengths is not None:
        _check_key_lengths(key_lengths, batch, lk, q)
    _check_masks(key_padding_mask, attn_mask, q, (batch, heads, lq, lk))
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    return head_dim**-0.5 if scale is None else _checks.positive("scale", scale)


def _prepare(
    q,
    k,
    v,
    *,
    key_lengths=None,
    key_padding_mask=None,
    attn_mask=None,
    causal=False,
    dropout_p=0.0,
    scale=None,
    return_lse=False,
):
    scale = _check_scores_inputs(q, k, key_lengths, key_padding_mask, attn_mask, causal, scale)
    _checks.tensor("v", v, ndim=4, floating=True)
    _checks.same_device("v", v, "q", q)
    _checks.same_dtype("v", v, "q", q)
    _checks.shape("v", v, (*k.shape[:3], v.shape[-1]), "(B, H, Lk, Dv) matching k's B, H, Lk")
    prepared = dict(
        q=q,
        k=k,
        v=v,
        key_lengths=key_lengths,
        key_padding_mask=key_padding_mask,
        attn_mask=attn_mask,
        causal=causal,
        dropout_p=_checks.probability("dropout_p", dropout_p),
        scale=scale,
        return_lse=bool(return_lse),
    )
    return q.device, prepared


ATTENTION = dispatch.define("attention", _prepare)
ATTENTION.register("reference")(attention_reference)


def attention(
    q,
    k,
    v,
    *,
    key_lengths=None,
    key_padding_mask=None,
    attn_mask=None,
    causal=False,
    dropout_p=0.0,
    scale=None,
    return_lse=False,
):
    """Masked scaled-dot-product attention on the best available backend.

    Args:
        q, k, v: (B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, Dv); one floating dtype, any strides.
        key_lengths: int (B,): keys j >= key_lengths[b] are padding. Or
        key_padding_mask: bool (B, Lk), True = padding (as in ``nn.MultiheadAttention``).
        attn_mask: extra mask broadcastable to (B, H, Lq, Lk): bool (True = may attend, as in
            SDPA) or additive float. Backends that cannot take it step aside for it.
        causal: query i sees keys j <= i (top-left aligned).
        dropout_p: dropout on the attention probabilities (pass 0.0 in evaluation).
        scale: score scale, default D ** -0.5.
        return_lse: also return the fp32 log-sum-exp (B, H, Lq) of each row (-inf for a row
            that sees no key).

    Returns:
        out (B, H, Lq, Dv), or (out, lse) when ``return_lse``. A row that sees no key is 0.
    """
    out, lse = ATTENTION(
        q,
        k,
        v,
        key_lengths=key_lengths,
        key_padding_mask=key_padding_mask,
        attn_mask=attn_mask,
        causal=causal,
        dropout_p=dropout_p,
        scale=scale,
        return_lse=return_lse,
    )
    return (out, lse) if return_lse else out
