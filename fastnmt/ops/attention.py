r"""Masked scaled-dot-product attention: ``attention(q, k, v, ...)``.

Math, for one batch entry b and head h, queries i < Lq, keys j < Lk:

    S_ij   = scale * q_i . k_j                                   scale defaults to D^-1/2
    vis_ij = (j < key_length_b) and (not causal or j <= i) and attn_mask allows (i, j)
             key_length_b clamped to [0, Lk]: a negative length shows no key, one past Lk all
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

The Triton backend: a FlashAttention-2 forward (online softmax in exp2, fp32 accumulation, one
program per (b, h, block of queries)) that takes key lengths and the bool key-padding mask as they
are (no dense mask, no host sync), skips the key blocks past a sequence's length or causally
hidden, draws dropout in-kernel and writes the LSE; a backward of two kernels (dQ, which also
writes delta_i = dO_i . O_i, then dK/dV) that recompute P from the LSE and the dropout mask from
its seed, with no atomics. Its fp32
products use TF32 where torch allows it for its own fp32 matmuls (``dot_precision``). The C++
kernels register themselves as a further backend of the same dispatch entry; the reference is the
fallback (e.g. for ``attn_mask``) and the test oracle.

``attention_varlen`` is the same math over packed sequences (FlashAttention's varlen layout: q
(total_q, H, D), sequence b's rows from cu_seqlens_q[b]), on the same kernels: each program (or
C++ work unit) of a sequence reads its rows from the sequence's first, and the LSE is (H,
total_q). No padding is computed, read or written.

The Triton kernels are in ``fastnmt.ops.triton.attention_kernels``, their launchers in
``fastnmt.ops.triton.attention``; the C++ kernels in csrc/attention.cpp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastnmt.ops import checks, dispatch, registration
from fastnmt.ops.extension import extension_available
from fastnmt.ops.triton.attention import (
    _TRITON_DTYPES,
    MAX_HEAD_DIM,
    _launch_backward,
    _launch_backward_varlen,
    _launch_forward,
    _launch_forward_varlen,
    _new_attention_output,
)
from fastnmt.ops.triton.common import chosen_seed

# ---------------------------------------------------------------------------------------------
# PyTorch reference: the unfused computation a user writes by hand.
# ---------------------------------------------------------------------------------------------


def hidden_keys(
    key_lengths, key_padding_mask, causal, lq: int, lk: int, device
) -> torch.Tensor | None:
    """Bool mask, True where query i may not see key j, broadcastable to (B, 1, Lq, Lk)."""
    hidden = None
    if key_lengths is not None:  # a length < 0 hides every key, one > lk none: clamped
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


def gather_cache_rows(x: torch.Tensor, cache_rows: torch.Tensor) -> torch.Tensor:
    """Keys or values x (P, H, Lk, D) as the batch (B, H, Lk, D) that ``cache_rows`` (B, Lk)
    describes: entry b's row j is x[cache_rows[b, j], :, j]."""
    positions = torch.arange(x.shape[2], device=x.device)
    return x[cache_rows, :, positions].transpose(1, 2)  # (B, Lk, H, D) -> (B, H, Lk, D)


def attention_reference(
    q, k, v, key_lengths, key_padding_mask, attn_mask, causal, dropout_p, scale, return_lse,
    cache_rows, dropout_seed=None,
):  # fmt: skip
    """The PyTorch oracle; its dropout draws from torch's generator (``dropout_seed`` keys the
    fused kernels' masks only)."""
    if cache_rows is not None:
        k, v = gather_cache_rows(k, cache_rows), gather_cache_rows(v, cache_rows)
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


def attention_torch(
    q, k, v, key_lengths, key_padding_mask, attn_mask, causal, dropout_p, scale, return_lse,
    cache_rows, dropout_seed=None,
):  # fmt: skip
    """PyTorch's ``F.scaled_dot_product_attention`` given every mask as one (what a model
    written with PyTorch's built-ins runs: the baseline fastnmt is measured against). Its dropout
    draws from torch's generator; it returns no log-sum-exp (``_torch_reasons``)."""
    if cache_rows is not None:
        k, v = gather_cache_rows(k, cache_rows), gather_cache_rows(v, cache_rows)
    hidden = hidden_keys(key_lengths, key_padding_mask, causal, q.shape[-2], k.shape[-2], q.device)
    mask = attn_mask
    if hidden is not None:
        if attn_mask is None:
            mask = ~hidden  # SDPA's bool masks say where a query may attend
        elif attn_mask.dtype == torch.bool:
            mask = attn_mask & ~hidden
        else:
            mask = attn_mask.masked_fill(hidden, float("-inf"))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale
    )  # rows that see no key are 0, as the contract says (torch >= 2.5)
    return out, None


def attention_probabilities(
    q,
    k,
    *,
    key_lengths=None,
    key_padding_mask=None,
    attn_mask=None,
    causal=False,
    scale=None,
    lse=None,
) -> torch.Tensor:
    """Attention probabilities P (B, H, Lq, Lk), before dropout; rows that see no key are 0.

    For inspection and plotting (``need_weights``); takes the masks of ``attention()``. With the
    ``lse`` (B, H, Lq) that ``attention(..., return_lse=True)`` returned for the same inputs, P is
    recomputed as exp(S - lse) (one matmul, no row maximum to find), so a fused kernel needs no
    naive fallback to give weights. For chosen heads, pass those heads of q, k and lse.
    """
    scale = _check_scores_inputs(q, k, key_lengths, key_padding_mask, attn_mask, causal, scale)
    scores, empty_rows = masked_scores(
        q, k, key_lengths, key_padding_mask, attn_mask, causal, scale
    )
    if lse is None:
        probs = torch.softmax(scores.float(), dim=-1)
    else:
        checks.tensor("lse", lse)
        checks.shape("lse", lse, scores.shape[:3], "(B, H, Lq) as attention() returns it")
        # -inf marks rows that see no key; a finite stand-in keeps the backward free of NaN.
        finite_lse = lse.float().masked_fill(empty_rows.squeeze(-1), 0.0)
        probs = torch.exp(scores.float() - finite_lse[..., None])
        # The kernel's lse sums its own S (another order of products, its own exp) and is rounded
        # at its own magnitude: an error e in it scales the whole row by exp(-e), a few ulps of
        # lse, not of P (1e-6 at ordinary scores, more as they grow). Dividing by the row's sum
        # cancels that factor, leaving P with the rounding of a softmax of these scores.
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs.masked_fill(empty_rows, 0.0).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Argument checks and the registered op.
# ---------------------------------------------------------------------------------------------


def _check_key_lengths(key_lengths, batch: int, lk: int, like: torch.Tensor) -> None:
    checks.tensor("key_lengths", key_lengths, ndim=1)
    if key_lengths.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"key_lengths must be int32 or int64, got {key_lengths.dtype}")
    checks.shape("key_lengths", key_lengths, (batch,), "one length per batch entry")
    checks.same_device("key_lengths", key_lengths, "q", like)
    # Every backend clamps lengths to [0, lk]; reading them to reject the out-of-range ones
    # syncs a GPU with the host, so only in debugging runs (FASTNMT_CHECK_VALUES=1).
    if checks.values_checked() and not torch.compiler.is_compiling() and key_lengths.numel():
        low, high = torch.aminmax(key_lengths)
        if low < 0 or high > lk:
            raise ValueError(
                f"key_lengths must lie in [0, {lk}] (the key length), got values in "
                f"[{int(low)}, {int(high)}]"
            )


def _check_masks(key_padding_mask, attn_mask, q, expected_scores: tuple[int, ...]) -> None:
    batch, lk = expected_scores[0], expected_scores[-1]
    if key_padding_mask is not None:
        checks.tensor("key_padding_mask", key_padding_mask, ndim=2)
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(
                f"key_padding_mask must be a bool tensor (True = padding), got "
                f"{key_padding_mask.dtype}"
            )
        checks.shape("key_padding_mask", key_padding_mask, (batch, lk), "(B, Lk)")
        checks.same_device("key_padding_mask", key_padding_mask, "q", q)
    if attn_mask is not None:
        checks.tensor("attn_mask", attn_mask)
        if attn_mask.dtype != torch.bool:
            checks.same_dtype("attn_mask", attn_mask, "q", q)
        checks.same_device("attn_mask", attn_mask, "q", q)
        try:
            broadcast = torch.broadcast_shapes(attn_mask.shape, expected_scores)
        except RuntimeError:
            broadcast = None
        if attn_mask.dim() > 4 or broadcast != torch.Size(expected_scores):
            raise ValueError(
                f"attn_mask must broadcast to (B, H, Lq, Lk) = {expected_scores}, got "
                f"{tuple(attn_mask.shape)}"
            )


def _check_cache_rows(cache_rows, q, k) -> None:
    batch, lk, entries = q.shape[0], k.shape[2], k.shape[0]
    checks.tensor("cache_rows", cache_rows, ndim=2)
    if cache_rows.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cache_rows must be int32 or int64, got {cache_rows.dtype}")
    checks.shape("cache_rows", cache_rows, (batch, lk), "(B, Lk): q's B, k's Lk")
    checks.same_device("cache_rows", cache_rows, "q", q)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k)):
        raise ValueError("cache_rows is for decoding: no backward, so q, k, v must not need grad")
    # The C++ kernel checks the entries always; other backends only in debugging runs (reading
    # them would sync a GPU with the host every decoding step).
    if checks.values_checked() and not torch.compiler.is_compiling() and cache_rows.numel():
        low, high = torch.aminmax(cache_rows)
        if low < 0 or high >= entries:
            raise ValueError(
                f"cache_rows must lie in [0, {entries}) (k's batch entries), got values in "
                f"[{int(low)}, {int(high)}]"
            )


def _check_scores_inputs(
    q, k, key_lengths, key_padding_mask, attn_mask, causal, scale, cache_rows=None
) -> float:
    """Checks what the scores S depend on; returns the scale to use."""
    for name, tensor in (("q", q), ("k", k)):
        checks.tensor(name, tensor, ndim=4, floating=True)
    checks.same_device("k", k, "q", q)
    checks.same_dtype("k", k, "q", q)
    batch, heads, lq, head_dim = q.shape
    lk = k.shape[2]
    if cache_rows is None:
        checks.shape("k", k, (batch, heads, lk, head_dim), "(B, H, Lk, D) matching q's B, H, D")
    else:  # k holds its own batch of entries, which cache_rows picks from
        checks.shape("k", k, (k.shape[0], heads, lk, head_dim), "(P, H, Lk, D): q's H and D")
        _check_cache_rows(cache_rows, q, k)
    if key_lengths is not None and key_padding_mask is not None:
        raise ValueError("give key_lengths or key_padding_mask, not both")
    if key_lengths is not None:
        _check_key_lengths(key_lengths, batch, lk, q)
    _check_masks(key_padding_mask, attn_mask, q, (batch, heads, lq, lk))
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    return head_dim**-0.5 if scale is None else checks.positive("scale", scale)


def _prepare(
    q,
    k,
    v,
    key_lengths=None,
    key_padding_mask=None,
    attn_mask=None,
    causal=False,
    dropout_p=0.0,
    scale=None,
    return_lse=False,
    cache_rows=None,
    dropout_seed=None,
):
    scale = _check_scores_inputs(
        q, k, key_lengths, key_padding_mask, attn_mask, causal, scale, cache_rows
    )
    checks.tensor("v", v, ndim=4, floating=True)
    checks.same_device("v", v, "q", q)
    checks.same_dtype("v", v, "q", q)
    checks.shape("v", v, (*k.shape[:3], v.shape[-1]), "(B, H, Lk, Dv) matching k's B, H, Lk")
    prepared = dict(
        q=q,
        k=k,
        v=v,
        key_lengths=key_lengths,
        key_padding_mask=key_padding_mask,
        attn_mask=attn_mask,
        causal=causal,
        dropout_p=checks.probability("dropout_p", dropout_p),
        scale=scale,
        return_lse=bool(return_lse),
        cache_rows=cache_rows,
        dropout_seed=checks.dropout_seed(dropout_seed, "q", q),
    )
    return q.device, prepared


ATTENTION = dispatch.define("attention", _prepare)
ATTENTION.register("reference")(attention_reference)


def _torch_reasons(return_lse, **_):
    if return_lse:
        yield "return_lse: F.scaled_dot_product_attention returns no log-sum-exp"


ATTENTION.register("torch", _torch_reasons)(attention_torch)


# Each fused backend is two torch.library ops (forward, backward) tied together by autograd: the
# Triton ops' below (``triton_library_op``: torch.compile sees their kernels), the C++ ops'
# (csrc/attention.cpp, the same arguments in the same order; opaque to torch.compile) in C++.
# The forward saves its inputs, output, LSE and the dropout
# seed; the backward recomputes P from the LSE and regenerates the dropout mask from the seed.


@registration.triton_library_op("fastnmt::attention_forward")
def _attention_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_lengths: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    causal: bool,
    dropout_p: float,
    scale: float,
    cache_rows: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_forward(
        q, k, v, key_lengths, key_padding_mask, seed, causal, dropout_p, scale, cache_rows
    )


@registration.triton_library_op("fastnmt::attention_backward")
def _attention_backward_op(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_lengths: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    causal: bool,
    dropout_p: float,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launch_backward(
        grad_out, grad_lse, q, k, v, out, lse, key_lengths, key_padding_mask, seed, causal,
        dropout_p, scale,
    )  # fmt: skip


def _forward_fake(q, k, v, key_lengths, key_padding_mask, seed, causal, dropout_p, scale, _rows):
    out = _new_attention_output((*q.shape[:3], v.shape[3]), q.dtype, q.device)
    return out, q.new_empty(q.shape[:3], dtype=torch.float32)


def _backward_fake(grad_out, grad_lse, q, k, v, *_):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # as the launcher's


def _setup_context(ctx, inputs, output):
    q, k, v, key_lengths, key_padding_mask, seed, causal, dropout_p, scale, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_lengths, key_padding_mask, seed)
    ctx.causal, ctx.dropout_p, ctx.scale = causal, dropout_p, scale
    # An unused LSE (the usual case) gets no zero-filled gradient to allocate and subtract.
    ctx.set_materialize_grads(False)


def _make_backward(backward_op):
    """The autograd backward of a forward op whose backward op is ``backward_op``."""

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, key_lengths, key_padding_mask, seed = ctx.saved_tensors
        if grad_out is None:  # only the LSE was used
            grad_out = torch.zeros_like(out)
        grads = backward_op(
            grad_out, grad_lse, q, k, v, out, lse, key_lengths, key_padding_mask, seed,
            ctx.causal, ctx.dropout_p, ctx.scale,
        )  # fmt: skip
        # key_lengths, key_padding_mask, seed, causal, dropout_p, scale, cache_rows (never
        # given with gradients: _check_cache_rows)
        return *grads, None, None, None, None, None, None, None

    return backward


def _triton_unsupported(q, k, v, attn_mask, cache_rows, **_):
    if attn_mask is not None:
        yield "attn_mask: the Triton kernel takes key_lengths / key_padding_mask and causal only"
    if cache_rows is not None and max(_span(k), _span(v)) >= 2**31:
        yield "cache_rows into k/v storage of 2**31 or more elements (the kernel's offsets: int32)"
    if q.dtype not in _TRITON_DTYPES:
        yield f"dtype {q.dtype}: the Triton kernel runs {', '.join(map(str, _TRITON_DTYPES))}"
    if max(q.shape[3], v.shape[3]) > MAX_HEAD_DIM:
        yield f"head dim {max(q.shape[3], v.shape[3])} > {MAX_HEAD_DIM}"


def _span(x: torch.Tensor) -> int:
    """Elements from x's first to its last element, + 1."""
    return 1 + sum((size - 1) * stride for size, stride in zip(x.shape, x.stride(), strict=True))


_CPP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _cpp_unsupported(q, attn_mask, **_):
    if attn_mask is not None:
        yield "attn_mask: the C++ kernel takes key_lengths / key_padding_mask and causal only"
    if q.dtype not in _CPP_DTYPES:
        yield f"dtype {q.dtype}: the C++ kernel runs {', '.join(map(str, _CPP_DTYPES))}"


def _running(_backend: str, forward):
    """The implementation of the op that calls ``forward`` with the forward op's arguments."""

    def implementation(
        q, k, v, key_lengths, key_padding_mask, attn_mask, causal, dropout_p, scale, return_lse,
        cache_rows, dropout_seed,
    ):  # fmt: skip
        seed = chosen_seed(dropout_seed, dropout_p, q.device)
        out, lse = forward(
            q, k, v, key_lengths, key_padding_mask, seed, causal, dropout_p, scale, cache_rows
        )
        return out, (lse if return_lse else None)

    return implementation


# The Triton ops and the C++ ops (same signatures) share their fakes. The C++ ops
# (csrc/attention.cpp, CPU tensors) take ``out`` but ignore it: their backward computes
# delta_i = sum_j P_ij dP_ij from P, exactly in fp32, rather than from the rounded output.
registration.register_kernels(
    ATTENTION,
    triton=((_attention_forward_op, _attention_backward_op), (_launch_forward, _launch_backward)),
    cpp=("attention_cpp", "attention_cpp_backward"),
    unsupported={"triton": _triton_unsupported, "cpp": _cpp_unsupported},
    running=_running,
    forward_fake=_forward_fake,
    backward_fake=_backward_fake,
    setup_context=_setup_context,
    make_backward=_make_backward,
)


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
    cache_rows=None,
    dropout_seed=None,
):
    """Masked scaled-dot-product attention on the best available backend.

    Args:
        q, k, v: (B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, Dv); one floating dtype, any strides.
        key_lengths: int (B,): keys j >= key_lengths[b] are padding. Every backend clamps the
            lengths to [0, Lk] (a negative one hides every key, one past Lk hides none) rather
            than reading them on the host, which would sync a GPU; with FASTNMT_CHECK_VALUES=1
            an out-of-range length raises ValueError instead (debugging). Or
        key_padding_mask: bool (B, Lk), True = padding (as in ``nn.MultiheadAttention``).
        attn_mask: extra mask broadcastable to (B, H, Lq, Lk): bool (True = may attend, as in
            SDPA) or additive float. Backends that cannot take it step aside for it.
        causal: query i sees keys j <= i (top-left aligned).
        dropout_p: dropout on the attention probabilities (pass 0.0 in evaluation).
        scale: score scale, default D ** -0.5.
        return_lse: also return the fp32 log-sum-exp (B, H, Lq) of each row (-inf for a row
            that sees no key).
        cache_rows: int (B, Lk), decoding only (no gradients): k and v are then (P, H, Lk, ...)
            with any P, and entry b's key j is k[cache_rows[b, j], :, j] (likewise v). A beam
            search's cache is then never reordered: only this small index follows the beams
            (``KVCache``). Entries must lie in [0, P): the C++ backend always checks, the others
            under FASTNMT_CHECK_VALUES=1 (a host sync otherwise).
        dropout_seed: int64 (2,), one of ``fastnmt.ops.dropout_seeds``: the fused kernels'
            dropout mask is a function of it (the reference draws from torch's generator).
            Default: drawn for this call, one small kernel on a GPU; a model draws every op's
            seed at once.

    Returns:
        out (B, H, Lq, Dv), or (out, lse) when ``return_lse``. A row that sees no key is 0.
    """
    out, lse = ATTENTION(
        q, k, v, key_lengths, key_padding_mask, attn_mask, causal, dropout_p, scale, return_lse,
        cache_rows, dropout_seed,
    )  # fmt: skip
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Packed sequences (FlashAttention's varlen layout): no padding anywhere.
# ---------------------------------------------------------------------------------------------


class _Unpacking:
    """Packed sequences (total, ...) -> a padded batch (B, ..., L, ...) and back; sequence b is
    rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1."""

    def __init__(self, cu_seqlens: torch.Tensor, longest: int):
        starts = cu_seqlens[:-1].long()
        self.lengths = cu_seqlens[1:].long() - starts  # (B,)
        positions = torch.arange(longest, device=cu_seqlens.device)
        self.valid = positions < self.lengths[:, None]  # (B, L)
        # Padding positions read an appended zero row (index total).
        total = cu_seqlens[-1:].long()
        self.rows = torch.where(self.valid, starts[:, None] + positions, total)  # (B, L)

    def padded(self, x: torch.Tensor) -> torch.Tensor:  # (total, H, D) -> (B, H, L, D)
        zero = x.new_zeros(1, *x.shape[1:])
        return torch.cat([x, zero])[self.rows].transpose(1, 2)

    def packed(self, x: torch.Tensor) -> torch.Tensor:  # (B, H, L, ...) -> (total, H, ...)
        return x.transpose(1, 2)[self.valid]


def _over_unpacked(padded_attention):
    """A varlen implementation that runs ``padded_attention`` (``attention_reference``'s
    arguments) over the sequences unpacked into a padded batch, differentiably."""

    def implementation(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, dropout_p,
        scale, return_lse, dropout_seed=None,
    ):  # fmt: skip
        queries = _Unpacking(cu_seqlens_q, max_seqlen_q)
        keys = _Unpacking(cu_seqlens_k, max_seqlen_k)
        out, lse = padded_attention(
            queries.padded(q), keys.padded(k), keys.padded(v), keys.lengths, None, None, causal,
            dropout_p, scale, return_lse, None,
        )  # fmt: skip
        lse = None if lse is None else queries.packed(lse[..., None])[..., 0].t()  # (H, total)
        return queries.packed(out), lse

    return implementation


def _check_cu_seqlens(name: str, cu_seqlens, like: torch.Tensor) -> None:
    checks.tensor(name, cu_seqlens, ndim=1)
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or not len(cu_seqlens):
        raise ValueError(
            f"{name} must be int32 or int64 of shape (B + 1,), got {cu_seqlens.dtype} of shape "
            f"{tuple(cu_seqlens.shape)}"
        )
    checks.same_device(name, cu_seqlens, "q", like)


def _check_packed_values(name: str, cu_seqlens, rows: int, longest: int, longest_name: str):
    """cu_seqlens runs from 0 to ``rows`` without decreasing, no sequence longer than
    ``longest`` (a host read: the C++ kernel checks always, the others under value checks)."""
    lengths = cu_seqlens.diff()
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != rows:
        raise ValueError(f"{name} must run from 0 to {rows} (the packed rows)")
    if len(lengths) and (int(lengths.min()) < 0 or int(lengths.max()) > longest):
        raise ValueError(f"{name} must give lengths in [0, {longest_name} = {longest}]")


def _prepare_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, dropout_p=0.0,
    scale=None, return_lse=False, dropout_seed=None,
):  # fmt: skip
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        checks.tensor(name, tensor, ndim=3, floating=True)
        checks.same_device(name, tensor, "q", q)
        checks.same_dtype(name, tensor, "q", q)
    heads, head_dim = q.shape[1:]
    checks.shape("k", k, (k.shape[0], heads, head_dim), "(total_k, H, D): q's H and D")
    checks.shape("v", v, (k.shape[0], heads, v.shape[2]), "(total_k, H, Dv): k's rows, q's H")
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q)
    if len(cu_seqlens_q) != len(cu_seqlens_k):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must both be (B + 1,), got {len(cu_seqlens_q)} and "
            f"{len(cu_seqlens_k)} entries"
        )
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if checks.values_checked() and not torch.compiler.is_compiling():
        _check_packed_values("cu_seqlens_q", cu_seqlens_q, len(q), max_seqlen_q, "max_seqlen_q")
        _check_packed_values("cu_seqlens_k", cu_seqlens_k, len(k), max_seqlen_k, "max_seqlen_k")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    scale = head_dim**-0.5 if scale is None else checks.positive("scale", scale)
    return q.device, dict(
        q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
        dropout_p=checks.probability("dropout_p", dropout_p), scale=scale,
        return_lse=bool(return_lse), dropout_seed=checks.dropout_seed(dropout_seed, "q", q),
    )  # fmt: skip


ATTENTION_VARLEN = dispatch.define("attention_varlen", _prepare_varlen)
ATTENTION_VARLEN.register("reference")(_over_unpacked(attention_reference))
ATTENTION_VARLEN.register("torch", _torch_reasons)(_over_unpacked(attention_torch))


def _varlen_unsupported(kernel: str, dtypes: tuple[torch.dtype, ...], widest: int | None = None):
    """The reasons the ``kernel`` ("C++" or "Triton") varlen kernels cannot run a call."""

    def unsupported(q, v, **_):
        if q.dtype not in dtypes:
            yield f"dtype {q.dtype}: the {kernel} kernel runs {', '.join(map(str, dtypes))}"
        if widest is not None and max(q.shape[2], v.shape[2]) > widest:
            yield f"head dim {max(q.shape[2], v.shape[2])} > {widest}"

    return unsupported


def _varlen_running(_backend: str, forward):
    """The varlen implementation that calls ``forward`` (the op's arguments but return_lse)."""

    def implementation(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, dropout_p,
        scale, return_lse, dropout_seed,
    ):  # fmt: skip
        seed = chosen_seed(dropout_seed, dropout_p, q.device)
        out, lse = forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed, causal,
            dropout_p, scale,
        )  # fmt: skip
        return out, (lse if return_lse else None)

    return implementation


@registration.triton_library_op("fastnmt::attention_varlen_forward")
def _attention_varlen_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    seed: torch.Tensor | None,
    causal: bool,
    dropout_p: float,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_forward_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed, causal, dropout_p,
        scale,
    )  # fmt: skip


@registration.triton_library_op("fastnmt::attention_varlen_backward")
def _attention_varlen_backward_op(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    seed: torch.Tensor | None,
    causal: bool,
    dropout_p: float,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launch_backward_varlen(
        grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, seed, causal, dropout_p, scale,
    )  # fmt: skip


def _varlen_fake(q, k, v, cu_seqlens_q, *_):
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed, *rest = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens_q, cu_seqlens_k, seed)
    ctx.sizes, ctx.rest = (max_seqlen_q, max_seqlen_k), rest  # rest: causal, dropout_p, scale
    ctx.set_materialize_grads(False)  # an unused LSE gets no zero-filled gradient


def _make_varlen_backward(backward_op):
    """The autograd backward of a varlen forward op whose backward op is ``backward_op``."""

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed = ctx.saved_tensors
        if grad_out is None:  # only the LSE was used
            grad_out = torch.zeros_like(out)
        grads = backward_op(
            grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.sizes, seed,
            *ctx.rest,
        )  # fmt: skip
        # cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed, causal, dropout_p, scale
        return *grads, None, None, None, None, None, None, None, None

    return backward


# As the padded op's: the Triton ops and the C++ ops (same signatures) share their fakes; the C++
# forward's autograd is registered here, in Python (the padded one's is in C++).
registration.register_kernels(
    ATTENTION_VARLEN,
    triton=(
        (_attention_varlen_forward_op, _attention_varlen_backward_op),
        (_launch_forward_varlen, _launch_backward_varlen),
    ),
    cpp=("attention_varlen_cpp", "attention_varlen_cpp_backward"),
    unsupported={
        "triton": _varlen_unsupported("Triton", _TRITON_DTYPES, MAX_HEAD_DIM),
        "cpp": _varlen_unsupported("C++", _CPP_DTYPES),
    },
    running=_varlen_running,
    forward_fake=_varlen_fake,
    backward_fake=_backward_fake,
    setup_context=_varlen_setup_context,
    make_backward=_make_varlen_backward,
)
if extension_available():
    torch.library.register_autograd(
        "fastnmt::attention_varlen_cpp",
        _make_varlen_backward(torch.ops.fastnmt.attention_varlen_cpp_backward),
        setup_context=_varlen_setup_context,
    )


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    causal=False,
    dropout_p=0.0,
    scale=None,
    return_lse=False,
    dropout_seed=None,
):
    """``attention`` over packed sequences, without padding (FlashAttention's
    ``flash_attn_varlen_func`` layout): sequence b's queries are rows cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1] - 1 of q, its keys and values those of cu_seqlens_k in k and v.

    Args:
        q, k, v: (total_q, H, D), (total_k, H, D), (total_k, H, Dv); one floating dtype, any
            strides.
        cu_seqlens_q, cu_seqlens_k: int32 or int64 (B + 1,), each from 0 to its total,
            non-decreasing (an empty sequence is allowed: a query that sees no key gives 0).
        max_seqlen_q, max_seqlen_k: ints, at least every sequence's length (the host knows them
            when it packs; reading them from the tensors would sync a GPU).
        causal: query i of a sequence sees its keys j <= i (top-left aligned, as ``attention``).
        dropout_p: dropout on the attention probabilities (pass 0.0 in evaluation).
        scale: score scale, default D ** -0.5.
        return_lse: also return the fp32 log-sum-exp (H, total_q) of each row.
        dropout_seed: as ``attention``'s; the fused kernels draw keep_ij of sequence b's query i
            and key j as ``attention``'s do for (b, i, j) with Lq = max_seqlen_q and Lk =
            max_seqlen_k.

    Backends: the padded op's kernels, forward and backward, each program reading its
    sequence's rows through cu_seqlens: Triton (CUDA) and C++ (CPU tensors); elsewhere the
    reference runs the sequences unpacked into a padded batch. The C++ backend checks
    cu_seqlens always, the others under FASTNMT_CHECK_VALUES=1.

    Returns:
        out (total_q, H, Dv), or (out, lse) when ``return_lse``.
    """
    out, lse = ATTENTION_VARLEN(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, dropout_p,
        scale, return_lse, dropout_seed,
    )  # fmt: skip
    return (out, lse) if return_lse else out
