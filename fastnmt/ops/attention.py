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
hidden, draws dropout in-kernel and writes the LSE; a backward of three kernels (delta, dK/dV,
dQ) that recompute P from the LSE and the dropout mask from its seed, with no atomics. Its fp32
products use TF32 where torch allows it for its own fp32 matmuls (``dot_precision``). The C++
kernels register themselves as a further backend of the same dispatch entry; the reference is the
fallback (e.g. for ``attn_mask``) and the test oracle.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fastnmt.ops import checks, dispatch, registration
from fastnmt.ops.triton import tl, triton
from fastnmt.ops.triton.common import (
    LaunchConfig,
    Launcher,
    as_dtype,
    cdiv,
    chosen_seed,
    dot_precision,
    kernel_output_dtype,
    launch_options,
    new_output,
    new_output_like,
    power_of_2_at_least,
    upcast_in_interpreter,
    use_gpu_tiles,
)

# ---------------------------------------------------------------------------------------------
# Triton kernels. One program handles one (batch entry b, head h) and one block of rows: query
# rows (forward, dQ, delta) or key rows (dK/dV). Scores are kept in log2 units,
# S2 = S * log2(e), so the softmax uses exp2; LSE is stored in natural-log units.
# ---------------------------------------------------------------------------------------------

LOG2_E = tl.constexpr(1.4426950408889634)


@triton.jit
def _load_tile(
    base,  # pointer to element (0, 0) of a matrix view
    rows,  # (R,) row indices
    cols,  # (C,) column indices
    stride_row,  # elements between consecutive rows
    stride_col,  # elements between consecutive columns
    n_rows,  # rows >= n_rows read as 0
    n_cols,  # columns >= n_cols read as 0 (head dims padded to a power of two)
    UPCAST: tl.constexpr,  # compute from an fp32 copy (bf16 under the interpreter)
):
    return _load_rows(base, rows * stride_row, rows, cols, stride_col, n_rows, n_cols, UPCAST)


@triton.jit
def _load_rows(
    base,  # pointer that the row offsets start from
    row_offsets,  # (R,) elements from base to each row's column 0
    rows,  # (R,) row indices: rows >= n_rows read as 0
    cols,  # (C,) column indices
    stride_col,
    n_rows,
    n_cols,
    UPCAST: tl.constexpr,
):
    """``_load_tile`` for rows at any offsets (the keys of a cache read through its rows)."""
    ptrs = base + row_offsets[:, None] + cols[None, :] * stride_col
    tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _store_tile(base, tile, rows, cols, stride_row, stride_col, n_rows, n_cols):
    """Writes the in-range part of ``tile`` (R, C); arguments as ``_load_tile``'s."""
    ptrs = base + rows[:, None] * stride_row + cols[None, :] * stride_col
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tl.store(ptrs, tile.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _cache_entries(
    CACHE_ROWS,  # (B, Lk) int batch entries of K and V holding the keys
    stride_cb,  # elements between batch entries of CACHE_ROWS
    stride_cn,  # elements between keys of CACHE_ROWS
    b,  # batch entry
    offs_n,  # (BLOCK_N,) key indices j
    Lk,  # key length
):
    """(BLOCK_N,) int32 cache_rows[b, j]: the entries whose rows j are batch entry b's keys (a
    decoding cache that is never reordered). Offsets from them stay int32 (the launcher sends
    larger caches to the reference): int64 ones double the registers of the pointer tiles and
    spill the decoding tiling at D = 128."""
    rows = tl.load(CACHE_ROWS + b.to(tl.int64) * stride_cb + offs_n * stride_cn,
                   mask=offs_n < Lk, other=0)  # fmt: skip
    return rows.to(tl.int32)


@triton.jit
def _visible_keys(
    PADDING,  # (B, Lk) uint8 view of key_padding_mask, 1 = padding (read when HAS_PADDING)
    stride_pb,  # elements between batch entries of PADDING
    stride_pn,  # elements between keys of PADDING
    b,  # batch entry
    offs_m,  # (BLOCK_M,) query indices i
    offs_n,  # (BLOCK_N,) key indices j
    Lq,  # rows i >= Lq are outside the tensor: hidden
    key_end,  # keys j >= key_end are hidden: min(Lk, key_length_b)
    CAUSAL: tl.constexpr,
    HAS_PADDING: tl.constexpr,
):
    """vis_ij of the math comment as a (BLOCK_M, BLOCK_N) mask."""
    visible = (offs_m < Lq)[:, None] & (offs_n < key_end)[None, :]
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= offs_m[:, None])
    if HAS_PADDING:
        row = PADDING + b.to(tl.int64) * stride_pb
        padded = tl.load(row + offs_n * stride_pn, mask=offs_n < key_end, other=1)
        visible = visible & (padded == 0)[None, :]
    return visible


@triton.jit
def _dropout_keep(
    seed,  # int64 Philox key of this call
    offset,  # int64 start of this call's counter range (its low 32 bits are used)
    bh,  # b * H + h
    offs_m,  # (BLOCK_M,) query indices i
    offs_n,  # (BLOCK_N,) key indices j
    Lk,  # key length
    dropout_p,  # fp32 drop probability
):
    """keep_ij (BLOCK_M, BLOCK_N): a function of (seed, offset, b, h, i, j) only, so the forward
    and both backward kernels draw the same mask whatever their block sizes.

    Each (b, h) gets its own Philox key, seed + bh, and counters offset + i * Lk + j on 32 bits:
    64-bit counters would double the cost of Philox's multiplies and the registers it holds.
    """
    element = offs_m[:, None] * Lk + offs_n[None, :]
    counter = offset.to(tl.uint32) + element.to(tl.uint32)  # wraps modulo 2**32
    return tl.rand(seed + bh, counter) >= dropout_p


@triton.jit
def _key_end(KEY_LENGTHS, b, Lk, HAS_LENGTHS: tl.constexpr):
    """key_lengths[b] clamped to [0, Lk]: keys at or past it are padding. Clamped before the
    int32 cast, so that no int64 length wraps around."""
    key_end = Lk
    if HAS_LENGTHS:
        length = tl.load(KEY_LENGTHS + b)
        key_end = tl.minimum(tl.maximum(length, 0), Lk).to(tl.int32)
    return key_end


@triton.jit
def _attention_forward_kernel(
    Q,  # (B, H, Lq, D) queries
    K,  # (B, H, Lk, D) keys
    V,  # (B, H, Lk, Dv) values
    OUT,  # (B, H, Lq, Dv) output O
    LSE,  # (B, H, Lq) fp32 output, contiguous: lse_i, -inf for a row that sees no key
    KEY_LENGTHS,  # (B,) int key lengths (read when HAS_LENGTHS)
    PADDING,  # (B, Lk) uint8 view of the bool key_padding_mask (read when HAS_PADDING)
    SEED,  # (2,) int64 dropout (seed, offset) (read when DROPOUT)
    CACHE_ROWS,  # (B, Lk) int batch entries of K and V holding the keys (when HAS_CACHE_ROWS)
    # strides of Q:
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    # strides of K:
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    # strides of V:
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    # strides of OUT:
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    # strides of PADDING:
    stride_pb,
    stride_pn,
    # strides of CACHE_ROWS:
    stride_cb,
    stride_cn,
    # heads, query and key lengths, head dims of q/k and v:
    H,
    Lq,
    Lk,
    D,
    Dv,
    scale,  # score scale (float; cast to fp32 here)
    dropout_p,  # drop probability p
    CAUSAL: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    DROPOUT: tl.constexpr,
    HAS_CACHE_ROWS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # tl.dot's input_precision: "ieee", or "tf32" where allowed
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per step of the online softmax
    BLOCK_D: tl.constexpr,  # D padded to a power of two
    BLOCK_DV: tl.constexpr,  # Dv padded to a power of two
):
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    Q += b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    K += h.to(tl.int64) * stride_kh
    V += h.to(tl.int64) * stride_vh
    if not HAS_CACHE_ROWS:  # with cache rows, each key row has its own batch entry
        K += b.to(tl.int64) * stride_kb
        V += b.to(tl.int64) * stride_vb
    OUT += b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    qk_scale = tl.cast(scale, tl.float32) * LOG2_E  # S2 = qk_scale * q . k
    dropout_p = tl.cast(dropout_p, tl.float32)
    key_end = _key_end(KEY_LENGTHS, b, Lk, HAS_LENGTHS)
    loop_end = key_end
    if CAUSAL:  # keys past the block's last query are hidden for all its rows
        loop_end = tl.minimum(loop_end, (tl.program_id(1) + 1) * BLOCK_M)
    if DROPOUT:
        seed, offset = tl.load(SEED), tl.load(SEED + 1)

    q = _load_tile(Q, offs_m, offs_d, stride_qm, stride_qd, Lq, D, UPCAST)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of S2
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(S2 - m_i) (before dropout)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)  # running sum of Pd v, unnormalised
    for start_n in range(0, loop_end, BLOCK_N):
        offs_n = start_n + offs_n0
        if HAS_CACHE_ROWS:
            entries = _cache_entries(CACHE_ROWS, stride_cb, stride_cn, b, offs_n, Lk)
            k_rows = entries * stride_kb + offs_n * stride_kn
            v_rows = entries * stride_vb + offs_n * stride_vn
        else:
            k_rows, v_rows = offs_n * stride_kn, offs_n * stride_vn
        # Loads stop at key_end, not Lk: a decoding cache past its filled length holds whatever
        # its memory held (NaN included), and a hidden key's p = 0 times a NaN value is NaN.
        k = _load_rows(K, k_rows, offs_n, offs_d, stride_kd, key_end, D, UPCAST)
        v = _load_rows(V, v_rows, offs_n, offs_dv, stride_vd, key_end, Dv, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = _visible_keys(
            PADDING, stride_pb, stride_pn, b, offs_m, offs_n, Lq, key_end, CAUSAL, HAS_PADDING
        )
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:  # 1 / (1 - p) is applied once, at the end
            p = tl.where(_dropout_keep(seed, offset, bh, offs_m, offs_n, Lk, dropout_p), p, 0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    if DROPOUT:
        out = out / (1.0 - dropout_p)
    _store_tile(OUT, out, offs_m, offs_dv, stride_om, stride_od, Lq, Dv)
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) / LOG2_E, float("-inf"))
    tl.store(LSE + bh.to(tl.int64) * Lq + offs_m, lse, mask=offs_m < Lq)


@triton.jit
def _attention_backward_delta_kernel(
    OUT,  # (B, H, Lq, Dv) forward output
    DO,  # (B, H, Lq, Dv) gradient of the output
    DELTA,  # (B, H, Lq) fp32 output, contiguous: delta_i = dO_i . O_i
    # strides of OUT:
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    # strides of DO:
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    # heads, query length, head dim of v:
    H,
    Lq,
    Dv,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_DV: tl.constexpr,  # Dv padded to a power of two
):
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    OUT += b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    DO += b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
    o = _load_tile(OUT, offs_m, offs_dv, stride_om, stride_od, Lq, Dv, UPCAST).to(tl.float32)
    do = _load_tile(DO, offs_m, offs_dv, stride_dom, stride_dod, Lq, Dv, UPCAST).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * Lq + offs_m, tl.sum(o * do, 1), mask=offs_m < Lq)


@triton.jit
def _probabilities_and_dp(
    q,  # (BLOCK_M, BLOCK_D) queries
    k,  # (BLOCK_N, BLOCK_D) keys
    v,  # (BLOCK_N, BLOCK_DV) values
    do,  # (BLOCK_M, BLOCK_DV) output gradients
    lse2,  # (BLOCK_M,) lse in log2 units, +inf for rows that see no key (P = 0 there)
    visible,  # (BLOCK_M, BLOCK_N) vis_ij
    keep,  # (BLOCK_M, BLOCK_N) keep_ij (vis_ij without dropout: P is 0 off it anyway)
    qk_scale,  # scale * log2(e)
    dropout_p,
    DOT_PRECISION: tl.constexpr,
):
    """P (before dropout), Pd (after) and dP of the math comment for one tile, recomputed from
    the LSE; shared by the dK/dV and dQ kernels."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)
    inverse_keep = 1.0 / (1.0 - dropout_p)
    pd = tl.where(keep, p * inverse_keep, 0.0)
    dp = tl.where(keep, tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION) * inverse_keep, 0.0)
    return p, pd, dp


@triton.jit
def _attention_backward_dkdv_kernel(
    # (B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, Dv) forward inputs:
    Q,
    K,
    V,
    DO,  # (B, H, Lq, Dv) gradient of the output
    LSE,  # (B, H, Lq) fp32, contiguous: the forward's lse
    DELTA,  # (B, H, Lq) fp32, contiguous: delta_i (minus the gradient of lse_i, if any)
    # (B, H, Lk, D), (B, H, Lk, Dv) outputs, dense in K's and V's dimension orders:
    DK,
    DV,
    # strides of DK and DV:
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dvd,
    # as in the forward kernel:
    KEY_LENGTHS,
    PADDING,
    SEED,
    # strides of Q:
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    # strides of K:
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    # strides of V:
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    # strides of DO:
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    # strides of PADDING:
    stride_pb,
    stride_pn,
    # heads, lengths, head dims, score scale and drop probability, as in the forward kernel:
    H,
    Lq,
    Lk,
    D,
    Dv,
    scale,
    dropout_p,
    CAUSAL: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # queries per step
    BLOCK_N: tl.constexpr,  # key rows per program
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dV_j = sum_i Pd_ij dO_i and dK_j = scale sum_i dS_ij q_i for one block of keys: each
    program owns its rows of dK and dV, so no atomics are needed."""
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    start_n = tl.program_id(1) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    Q += b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    K += b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    V += b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    DO += b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
    LSE += bh.to(tl.int64) * Lq
    DELTA += bh.to(tl.int64) * Lq
    qk_scale = tl.cast(scale, tl.float32) * LOG2_E
    dropout_p = tl.cast(dropout_p, tl.float32)
    key_end = _key_end(KEY_LENGTHS, b, Lk, HAS_LENGTHS)
    # A block of padding keys gets zero gradients without reading a query.
    loop_start = tl.where(start_n < key_end, 0, Lq)
    if CAUSAL:  # queries before the block's first key see none of its keys
        loop_start = tl.maximum(loop_start, (start_n // BLOCK_M) * BLOCK_M)
    if DROPOUT:
        seed, offset = tl.load(SEED), tl.load(SEED + 1)

    k = _load_tile(K, offs_n, offs_d, stride_kn, stride_kd, key_end, D, UPCAST)
    v = _load_tile(V, offs_n, offs_dv, stride_vn, stride_vd, key_end, Dv, UPCAST)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for start_m in range(loop_start, Lq, BLOCK_M):
        offs_m = start_m + offs_m0
        q = _load_tile(Q, offs_m, offs_d, stride_qm, stride_qd, Lq, D, UPCAST)
        do = _load_tile(DO, offs_m, offs_dv, stride_dom, stride_dod, Lq, Dv, UPCAST)
        lse = tl.load(LSE + offs_m, mask=offs_m < Lq, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2_E)
        delta = tl.load(DELTA + offs_m, mask=offs_m < Lq, other=0.0)
        visible = _visible_keys(
            PADDING, stride_pb, stride_pn, b, offs_m, offs_n, Lq, key_end, CAUSAL, HAS_PADDING
        )
        keep = visible  # without dropout every visible key is kept
        if DROPOUT:
            keep = _dropout_keep(seed, offset, bh, offs_m, offs_n, Lk, dropout_p)
        p, pd, dp = _probabilities_and_dp(
            q, k, v, do, lse2, visible, keep, qk_scale, dropout_p, DOT_PRECISION
        )
        dv += tl.dot(tl.trans(pd.to(do.dtype)), do, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT_PRECISION)

    dk *= tl.cast(scale, tl.float32)
    DK += b.to(tl.int64) * stride_dkb + h.to(tl.int64) * stride_dkh
    DV += b.to(tl.int64) * stride_dvb + h.to(tl.int64) * stride_dvh
    _store_tile(DK, dk, offs_n, offs_d, stride_dkn, stride_dkd, Lk, D)
    _store_tile(DV, dv, offs_n, offs_dv, stride_dvn, stride_dvd, Lk, Dv)


@triton.jit
def _attention_backward_dq_kernel(
    # as in the dK/dV kernel:
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,  # (B, H, Lq, D) output, dense in Q's dimension order
    # strides of DQ:
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_dqd,
    # as in the forward kernel:
    KEY_LENGTHS,
    PADDING,
    SEED,
    # strides of Q:
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    # strides of K:
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    # strides of V:
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    # strides of DO:
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    # strides of PADDING:
    stride_pb,
    stride_pn,
    # heads, lengths, head dims, score scale and drop probability, as in the forward kernel:
    H,
    Lq,
    Lk,
    D,
    Dv,
    scale,
    dropout_p,
    CAUSAL: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per step
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dQ_i = scale sum_j dS_ij k_j for one block of queries, visiting the keys it sees."""
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    Q += b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    K += b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    V += b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    DO += b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
    qk_scale = tl.cast(scale, tl.float32) * LOG2_E
    dropout_p = tl.cast(dropout_p, tl.float32)
    key_end = _key_end(KEY_LENGTHS, b, Lk, HAS_LENGTHS)
    loop_end = key_end
    if CAUSAL:
        loop_end = tl.minimum(loop_end, (tl.program_id(1) + 1) * BLOCK_M)
    if DROPOUT:
        seed, offset = tl.load(SEED), tl.load(SEED + 1)

    q = _load_tile(Q, offs_m, offs_d, stride_qm, stride_qd, Lq, D, UPCAST)
    do = _load_tile(DO, offs_m, offs_dv, stride_dom, stride_dod, Lq, Dv, UPCAST)
    lse = tl.load(LSE + bh.to(tl.int64) * Lq + offs_m, mask=offs_m < Lq, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2_E)
    delta = tl.load(DELTA + bh.to(tl.int64) * Lq + offs_m, mask=offs_m < Lq, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, loop_end, BLOCK_N):
        offs_n = start_n + offs_n0
        k = _load_tile(K, offs_n, offs_d, stride_kn, stride_kd, key_end, D, UPCAST)
        v = _load_tile(V, offs_n, offs_dv, stride_vn, stride_vd, key_end, Dv, UPCAST)
        visible = _visible_keys(
            PADDING, stride_pb, stride_pn, b, offs_m, offs_n, Lq, key_end, CAUSAL, HAS_PADDING
        )
        keep = visible  # without dropout every visible key is kept
        if DROPOUT:
            keep = _dropout_keep(seed, offset, bh, offs_m, offs_n, Lk, dropout_p)
        p, _, dp = _probabilities_and_dp(
            q, k, v, do, lse2, visible, keep, qk_scale, dropout_p, DOT_PRECISION
        )
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)

    dq *= tl.cast(scale, tl.float32)
    DQ += b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
    _store_tile(DQ, dq, offs_m, offs_d, stride_dqm, stride_dqd, Lq, D)


@triton.jit
def _dropout_keep_kernel(
    KEEP,  # (B, H, Lq, Lk) uint8 output, contiguous: keep_ij
    SEED,  # (2,) int64 dropout (seed, offset)
    Lq,
    Lk,
    dropout_p,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The mask the attention kernels draw for SEED, written out (for tests and debugging)."""
    bh = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = _dropout_keep(tl.load(SEED), tl.load(SEED + 1), bh, offs_m, offs_n, Lk, dropout_p)
    KEEP += bh.to(tl.int64) * Lq * Lk
    _store_tile(KEEP, keep.to(tl.uint8), offs_m, offs_n, Lk, 1, Lq, Lk)


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
# Launchers: launch configurations, output buffers and grids of the Triton kernels.
# ---------------------------------------------------------------------------------------------

MAX_HEAD_DIM = 128
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# A documented heuristic rather than triton.autotune: MT batches change shape every step, and
# autotuning each new shape would cost more than it saves. Keyed on buckets of (Lq, Lk):
# - "decode": Lq <= 16, incremental decoding and beam search against a KV cache (forward only):
#   16-row query blocks, so a step of 1-4 queries does not compute 64 rows of padding;
# - "short": lengths up to 256, the sentences of machine translation: 64-row tiles, so that small
#   batches still give enough programs to fill the GPU;
# - "long": longer sequences: 128-row query blocks with 8 warps, as FlashAttention-2;
# and on the head dim: each bucket maps the widest head dim a config serves to the config (the
# first that fits is used; a bucket a kernel lacks falls back to "short"). Wide heads need
# narrower key blocks or more warps to stay in registers: every config below compiles without
# spills with every mask feature and dropout on (python -m fastnmt.compile_check), under triton
# 3.6 (what the H100 machine runs; it allocates registers less tightly than 3.9, so key blocks
# twice as wide spill there) and 3.9.
_GPU_CONFIGS = {
    "forward": {
        "decode": {128: LaunchConfig(16, 32, 4, 2)},
        "short": {64: LaunchConfig(64, 32, 4, 2), 128: LaunchConfig(64, 32, 8, 2)},
        "long": {64: LaunchConfig(128, 64, 8, 3), 128: LaunchConfig(64, 32, 8, 2)},
    },
    "dkdv": {"short": {128: LaunchConfig(32, 64, 8, 2)}},
    "dq": {
        "short": {64: LaunchConfig(64, 32, 4, 2), 128: LaunchConfig(64, 16, 8, 2)},
        "long": {64: LaunchConfig(128, 32, 8, 2)},
    },
    # delta reads two (rows, Dv) tiles and reduces them (no keys): small blocks, few registers.
    "delta": {"short": {128: LaunchConfig(32, 0, 4, 1)}},
}
_KEEP_CONFIG = LaunchConfig(64, 64, 4, 1)  # of the dropout-mask kernel (tests, debugging)


def _interpreter_block(length: int) -> int:
    """The interpreter's cost grows with the number of blocks: one block per sequence up to 128."""
    return min(128, max(16, power_of_2_at_least(length)))


def _length_buckets(lq: int, lk: int) -> list[str]:
    """The buckets of (lq, lk), most specific first."""
    return ["decode"] * (lq <= 16) + ["long"] * (max(lq, lk) > 256) + ["short"]


def launch_config(kernel: str, lq: int, lk: int, head_dim: int) -> LaunchConfig:
    """Block sizes of ``kernel`` ("forward", "dkdv", "dq" or "delta") for lengths lq, lk and the
    larger of the q/k and v head dims."""
    return _chosen_config(kernel, lq, lk, head_dim, use_gpu_tiles())


@functools.lru_cache(maxsize=4096)  # per call signature, as the dispatcher's decisions
def _chosen_config(kernel: str, lq: int, lk: int, head_dim: int, gpu_tiles: bool) -> LaunchConfig:
    if not gpu_tiles:
        return LaunchConfig(_interpreter_block(lq), _interpreter_block(lk), 4, 1)
    for bucket in _length_buckets(lq, lk):
        for widest, config in _GPU_CONFIGS[kernel].get(bucket, {}).items():
            if head_dim <= widest:
                return config
    raise AssertionError(f"no {kernel} config for head dim {head_dim}")  # > MAX_HEAD_DIM


def _head_block(head_dim: int) -> int:
    """Head dims are padded to a power of two (>= 16, the smallest tl.dot) and masked."""
    return max(16, power_of_2_at_least(head_dim))


@functools.lru_cache(maxsize=1024)
def _options(
    config: LaunchConfig,
    head_dim: int,
    value_dim: int,
    dtype: torch.dtype,
    precision: str,
    causal: bool,
    has_lengths: bool,
    has_padding: bool,
    dropout: bool,
    has_cache_rows: bool | None,  # None: the kernel has no such flag (the backward's)
) -> dict:
    """The constexprs and launch options of the forward, dK/dV and dQ kernels."""
    extra = {} if has_cache_rows is None else {"HAS_CACHE_ROWS": has_cache_rows}
    return launch_options(
        **extra,
        CAUSAL=causal,
        HAS_LENGTHS=has_lengths,
        HAS_PADDING=has_padding,
        DROPOUT=dropout,
        UPCAST=upcast_in_interpreter(dtype),
        DOT_PRECISION=precision,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=_head_block(head_dim),
        BLOCK_DV=_head_block(value_dim),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


@functools.lru_cache(maxsize=256)
def _delta_options(config: LaunchConfig, value_dim: int, dtype: torch.dtype) -> dict:
    return launch_options(
        UPCAST=upcast_in_interpreter(dtype),
        BLOCK_M=config.block_m,
        BLOCK_DV=_head_block(value_dim),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _padding_view(key_padding_mask):
    """The bool mask as uint8 (same bytes, no copy) and its strides: Triton loads bytes."""
    if key_padding_mask is None:
        return None, (0, 0)
    padding = key_padding_mask.view(torch.uint8)
    return padding, padding.stride()


def _new_attention_output(shape, dtype, device) -> torch.Tensor:
    """An empty (B, H, Lq, Dv) output lying (B, Lq, H, Dv) in memory, as FlashAttention's: joining
    the heads to (B, Lq, H * Dv) for the output projection is then a view, not a copy (the
    kernels write through strides). The C++ op allocates the same."""
    _, heads, lq, value_dim = shape
    strides = (lq * heads * value_dim, value_dim, heads * value_dim, 1)
    return new_output(shape, dtype, device, strides)


_FORWARD = Launcher(_attention_forward_kernel)
_DELTA = Launcher(_attention_backward_delta_kernel)
_DKDV = Launcher(_attention_backward_dkdv_kernel)
_DQ = Launcher(_attention_backward_dq_kernel)
_KEEP = Launcher(_dropout_keep_kernel)


def _launch_forward(
    q, k, v, key_lengths, key_padding_mask, seed, causal, dropout_p, scale, cache_rows
):
    batch, heads, lq, head_dim = q.shape
    lk, value_dim = k.shape[2], v.shape[3]
    out = _new_attention_output(
        (batch, heads, lq, value_dim), kernel_output_dtype(q.dtype), q.device
    )
    lse = new_output((batch, heads, lq), torch.float32, q.device)
    padding, padding_strides = _padding_view(key_padding_mask)
    config = launch_config("forward", lq, lk, max(head_dim, value_dim))
    options = _options(
        config, head_dim, value_dim, q.dtype, dot_precision(q.dtype), causal,
        key_lengths is not None, padding is not None, seed is not None, cache_rows is not None,
    )  # fmt: skip
    _FORWARD(
        q.device,
        (batch * heads, cdiv(lq, config.block_m), 1),
        (
            q, k, v, out, lse, key_lengths, padding, seed, cache_rows,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *padding_strides,
            *(cache_rows.stride() if cache_rows is not None else (0, 0)),
            heads, lq, lk, head_dim, value_dim, scale, dropout_p,
        ),
        options,
    )  # fmt: skip
    return as_dtype(out, q.dtype), lse


def _launch_delta(out, grad_out, grad_lse):
    """delta_i = dO_i . O_i in fp32, minus the gradient g_i reaching lse_i (when the caller used
    the LSE): d lse_i / d S_ij = P_ij adds P_ij g_i to dS_ij = P_ij (dP_ij - delta_i)."""
    batch, heads, lq, value_dim = out.shape
    delta = new_output((batch, heads, lq), torch.float32, out.device)
    config = launch_config("delta", lq, lq, value_dim)
    _DELTA(
        out.device,
        (batch * heads, cdiv(lq, config.block_m), 1),
        (out, grad_out, delta, *out.stride(), *grad_out.stride(), heads, lq, value_dim),
        _delta_options(config, value_dim, out.dtype),
    )
    return delta if grad_lse is None else delta - grad_lse


def _launch_backward(
    grad_out, grad_lse, q, k, v, out, lse, key_lengths, key_padding_mask, seed, causal, dropout_p,
    scale,
):  # fmt: skip
    batch, heads, lq, head_dim = q.shape
    lk, value_dim = k.shape[2], v.shape[3]
    delta = _launch_delta(out, grad_out, grad_lse)
    grad_dtype = kernel_output_dtype(q.dtype)
    # Dense in each input's dimension order (torch.empty_like, as SDPA's): the gradient of
    # proj(h).view(B, L, H, D).transpose(1, 2) then reaches proj's output without a copy.
    grad_q = new_output_like(q, grad_dtype)
    grad_k = new_output_like(k, grad_dtype)
    grad_v = new_output_like(v, grad_dtype)
    padding, padding_strides = _padding_view(key_padding_mask)
    shared = (
        key_lengths, padding, seed,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *padding_strides,
        heads, lq, lk, head_dim, value_dim, scale, dropout_p,
    )  # fmt: skip
    flags = (
        q.dtype, dot_precision(q.dtype), causal, key_lengths is not None, padding is not None,
        seed is not None, None,
    )  # fmt: skip
    key_grads = (grad_k, grad_v, *grad_k.stride(), *grad_v.stride())
    config = launch_config("dkdv", lq, lk, max(head_dim, value_dim))
    _DKDV(
        q.device,
        (batch * heads, cdiv(lk, config.block_n), 1),
        (q, k, v, grad_out, lse, delta, *key_grads, *shared),
        _options(config, head_dim, value_dim, *flags),
    )
    config = launch_config("dq", lq, lk, max(head_dim, value_dim))
    _DQ(
        q.device,
        (batch * heads, cdiv(lq, config.block_m), 1),
        (q, k, v, grad_out, lse, delta, grad_q, *grad_q.stride(), *shared),
        _options(config, head_dim, value_dim, *flags),
    )
    if grad_dtype == q.dtype:  # k and v have q's dtype
        return grad_q, grad_k, grad_v
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


def dropout_keep_mask(seed: torch.Tensor, shape: tuple[int, int, int, int], dropout_p: float):
    """Bool (B, H, Lq, Lk) keep_ij that the Triton kernels apply for ``seed`` (the
    ``dropout_seed`` given to ``attention``, or the one it draws), written out by a kernel that
    shares their ``_dropout_keep``.

    Without a ``dropout_seed``, the Triton backend draws its seed with
    ``triton_common.dropout_seed(q.device)`` as its first random draw, so ``torch.manual_seed(s)``
    before both gives the mask of an ``attention`` call (tests use this to check outputs and
    gradients against the reference given the kernel's own mask).
    """
    batch, heads, lq, lk = shape
    keep = new_output(shape, torch.uint8, seed.device)
    config = _KEEP_CONFIG
    grid = (batch * heads, cdiv(lq, config.block_m), cdiv(lk, config.block_n))
    _KEEP(
        seed.device,
        grid,
        (keep, seed, lq, lk, dropout_p),
        launch_options(
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps,
            num_stages=config.num_stages,
        ),
    )  # fmt: skip
    return keep.bool()


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
