"""The Triton kernels of ``fastnmt.ops.attention`` (the math is there); their launchers are in
``fastnmt.ops.triton.attention``.

A FlashAttention-2 forward (online softmax in exp2, fp32 accumulation) that takes key lengths, the
bool key-padding mask and a decoding cache's row indices as they are, draws dropout in-kernel and
writes the LSE; a backward of three kernels (delta, dK/dV, dQ) that recompute P from the LSE and
the dropout mask from its seed, with no atomics; and a kernel that writes the dropout mask out
(tests, debugging).
"""

from __future__ import annotations

from fastnmt.ops.triton import tl, triton

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
    queries,  # query indices i, (BLOCK_M, 1), or (1, BLOCK_M) for a tile with keys along its rows
    keys,  # key indices j, (1, BLOCK_N), or (BLOCK_N, 1)
    Lq,  # rows i >= Lq are outside the tensor: hidden
    key_end,  # keys j >= key_end are hidden: min(Lk, key_length_b)
    CAUSAL: tl.constexpr,
    HAS_PADDING: tl.constexpr,
):
    """vis_ij of the math comment as a mask of the tile's shape."""
    visible = (queries < Lq) & (keys < key_end)
    if CAUSAL:
        visible = visible & (keys <= queries)
    if HAS_PADDING:
        row = PADDING + b.to(tl.int64) * stride_pb
        padded = tl.load(row + keys * stride_pn, mask=keys < key_end, other=1)
        visible = visible & (padded == 0)
    return visible


@triton.jit
def _dropout_keep(
    seed,  # int64 Philox key of this call
    offset,  # int64 start of this call's counter range (its low 32 bits are used)
    bh,  # b * H + h
    queries,  # query indices i, as _visible_keys's
    keys,  # key indices j, as _visible_keys's
    Lk,  # key length
    dropout_p,  # fp32 drop probability
):
    """keep_ij of the tile: a function of (seed, offset, b, h, i, j) only, so the forward and
    both backward kernels draw the same mask whatever their block sizes and tile orientations.

    Each (b, h) gets its own Philox key, seed + bh, and counters offset + i * Lk + j on 32 bits:
    64-bit counters would double the cost of Philox's multiplies and the registers it holds.
    """
    element = queries * Lk + keys
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
def _packed_sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, Lk):
    """Sequence b of packed (varlen) inputs: its first query row and first key row (int64), its
    query count and its key count (at most Lk, the longest sequence's)."""
    q_start = tl.load(CU_SEQLENS_Q + b).to(tl.int64)
    k_start = tl.load(CU_SEQLENS_K + b).to(tl.int64)
    queries = (tl.load(CU_SEQLENS_Q + b + 1) - q_start).to(tl.int32)
    keys = tl.minimum((tl.load(CU_SEQLENS_K + b + 1) - k_start).to(tl.int32), Lk)
    return q_start, k_start, queries, keys


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
    CU_SEQLENS_Q,  # (B + 1,) int: packed sequences' first query rows (read when VARLEN)
    CU_SEQLENS_K,  # (B + 1,) int: their first key rows (read when VARLEN)
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
    total_q,  # packed query rows: LSE is (H, total_q) (when VARLEN)
    CAUSAL: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    DROPOUT: tl.constexpr,
    HAS_CACHE_ROWS: tl.constexpr,
    VARLEN: tl.constexpr,  # packed sequences (total, H, D): batch strides 0, rows from cu_seqlens
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
    if VARLEN:  # Lq, Lk: the longest sequences'; these rows: sequence b's own
        q_start, k_start, Lq, key_end = _packed_sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, Lk)
        Q += q_start * stride_qm
        K += k_start * stride_kn
        V += k_start * stride_vn
        OUT += q_start * stride_om
        LSE += h.to(tl.int64) * total_q + q_start
    else:
        LSE += bh.to(tl.int64) * Lq
    loop_end = tl.where(tl.program_id(1) * BLOCK_M < Lq, key_end, 0)  # no query: no key read
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
            PADDING, stride_pb, stride_pn, b, offs_m[:, None], offs_n[None, :], Lq, key_end,
            CAUSAL, HAS_PADDING,
        )  # fmt: skip
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:  # 1 / (1 - p) is applied once, at the end
            keep = _dropout_keep(seed, offset, bh, offs_m[:, None], offs_n[None, :], Lk, dropout_p)
            p = tl.where(keep, p, 0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    if DROPOUT:
        out = out / (1.0 - dropout_p)
    _store_tile(OUT, out, offs_m, offs_dv, stride_om, stride_od, Lq, Dv)
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) / LOG2_E, float("-inf"))
    tl.store(LSE + offs_m, lse, mask=offs_m < Lq)


@triton.jit
def _probabilities_and_dp(
    rows_s,  # the scores' rows: (BLOCK_M, BLOCK_D) queries, or (BLOCK_N, BLOCK_D) keys
    cols_s,  # the scores' columns: the keys, or the queries
    rows_dp,  # dP's rows: (BLOCK_M, BLOCK_DV) output gradients, or (BLOCK_N, BLOCK_DV) values
    cols_dp,  # dP's columns: the values, or the output gradients
    lse2,  # lse in log2 units along the queries' axis, +inf for rows that see no key (P = 0)
    visible,  # vis_ij of the tile
    keep,  # keep_ij (vis_ij without dropout: P is 0 off it anyway)
    qk_scale,  # scale * log2(e)
    dropout_p,
    DOT_PRECISION: tl.constexpr,
):
    """P (before dropout), Pd (after) and dP of the math comment for one tile, recomputed from
    the LSE; shared by the dQ kernel (queries along the rows) and the dK/dV kernel (keys)."""
    s = tl.dot(rows_s, tl.trans(cols_s), input_precision=DOT_PRECISION) * qk_scale
    p = tl.where(visible, tl.exp2(s - lse2), 0.0)
    inverse_keep = 1.0 / (1.0 - dropout_p)
    pd = tl.where(keep, p * inverse_keep, 0.0)
    dp = tl.dot(rows_dp, tl.trans(cols_dp), input_precision=DOT_PRECISION)
    return p, pd, tl.where(keep, dp * inverse_keep, 0.0)


@triton.jit
def _attention_backward_dkdv_kernel(
    # (B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, Dv) forward inputs:
    Q,
    K,
    V,
    DO,  # (B, H, Lq, Dv) gradient of the output
    LSE,  # (B, H, Lq) fp32, contiguous: the forward's lse
    DELTA,  # (B, H, Lq) fp32, contiguous: delta_i (minus lse_i's gradient), by the dQ kernel
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
    CU_SEQLENS_Q,
    CU_SEQLENS_K,
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
    # heads, lengths, head dims, score scale, drop probability, packed queries, as in the forward
    # kernel:
    H,
    Lq,
    Lk,
    D,
    Dv,
    scale,
    dropout_p,
    total_q,
    CAUSAL: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr,
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
    qk_scale = tl.cast(scale, tl.float32) * LOG2_E
    dropout_p = tl.cast(dropout_p, tl.float32)
    key_end = _key_end(KEY_LENGTHS, b, Lk, HAS_LENGTHS)
    key_rows = Lk  # the gradient rows written: padding keys' too (zeros)
    if VARLEN:  # sequence b's rows only
        q_start, k_start, Lq, key_end = _packed_sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, Lk)
        key_rows = key_end
        Q += q_start * stride_qm
        DO += q_start * stride_dom
        K += k_start * stride_kn
        V += k_start * stride_vn
        DK += k_start * stride_dkn
        DV += k_start * stride_dvn
        LSE += h.to(tl.int64) * total_q + q_start
        DELTA += h.to(tl.int64) * total_q + q_start
    else:
        LSE += bh.to(tl.int64) * Lq
        DELTA += bh.to(tl.int64) * Lq
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
        # Tiles with the keys along their rows (P^T, dP^T, dS^T), as in Triton's fused-attention
        # tutorial: the dV and dK dots take them as they are. tl.trans of a dot's result feeding
        # another dot is miscompiled on Hopper by triton 3.4 to 3.7.0 (a wrong dK).
        visible = _visible_keys(
            PADDING, stride_pb, stride_pn, b, offs_m[None, :], offs_n[:, None], Lq, key_end,
            CAUSAL, HAS_PADDING,
        )  # fmt: skip
        keep = visible  # without dropout every visible key is kept
        if DROPOUT:
            keep = _dropout_keep(seed, offset, bh, offs_m[None, :], offs_n[:, None], Lk, dropout_p)
        pt, pdt, dpt = _probabilities_and_dp(
            k, q, v, do, lse2[None, :], visible, keep, qk_scale, dropout_p, DOT_PRECISION
        )
        dv += tl.dot(pdt.to(do.dtype), do, input_precision=DOT_PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PRECISION)

    dk *= tl.cast(scale, tl.float32)
    DK += b.to(tl.int64) * stride_dkb + h.to(tl.int64) * stride_dkh
    DV += b.to(tl.int64) * stride_dvb + h.to(tl.int64) * stride_dvh
    _store_tile(DK, dk, offs_n, offs_d, stride_dkn, stride_dkd, key_rows, D)
    _store_tile(DV, dv, offs_n, offs_dv, stride_dvn, stride_dvd, key_rows, Dv)


@triton.jit
def _attention_backward_dq_kernel(
    # as in the dK/dV kernel:
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,  # (B, H, Lq) fp32 output, contiguous: delta_i, written here for the dK/dV kernel
    DQ,  # (B, H, Lq, D) output, dense in Q's dimension order
    OUT,  # (B, H, Lq, Dv) the forward's output
    GRAD_LSE,  # (B, H, Lq) fp32, contiguous: the gradient reaching lse (when HAS_GRAD_LSE)
    # strides of DQ:
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_dqd,
    # strides of OUT:
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    # as in the forward kernel:
    KEY_LENGTHS,
    PADDING,
    SEED,
    CU_SEQLENS_Q,
    CU_SEQLENS_K,
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
    # heads, lengths, head dims, score scale, drop probability, packed queries, as in the forward
    # kernel:
    H,
    Lq,
    Lk,
    D,
    Dv,
    scale,
    dropout_p,
    total_q,
    CAUSAL: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    DROPOUT: tl.constexpr,
    VARLEN: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_GRAD_LSE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per step
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """dQ_i = scale sum_j dS_ij k_j for one block of queries, visiting the keys it sees, after
    delta_i = dO_i . O_i - g_i (g_i: the gradient reaching lse_i, when the caller used the LSE:
    d lse_i / d S_ij = P_ij adds P_ij g_i to dS_ij = P_ij (dP_ij - delta_i)), which it stores
    for the dK/dV kernel, launched after it: a kernel of its own would be one launch more."""
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
    OUT += b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    DQ += b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
    qk_scale = tl.cast(scale, tl.float32) * LOG2_E
    dropout_p = tl.cast(dropout_p, tl.float32)
    key_end = _key_end(KEY_LENGTHS, b, Lk, HAS_LENGTHS)
    if VARLEN:  # sequence b's rows only
        q_start, k_start, Lq, key_end = _packed_sequence(CU_SEQLENS_Q, CU_SEQLENS_K, b, Lk)
        Q += q_start * stride_qm
        DO += q_start * stride_dom
        OUT += q_start * stride_om
        DQ += q_start * stride_dqm
        K += k_start * stride_kn
        V += k_start * stride_vn
        rows = h.to(tl.int64) * total_q + q_start  # of LSE, DELTA and GRAD_LSE
    else:
        rows = bh.to(tl.int64) * Lq
    loop_end = tl.where(tl.program_id(1) * BLOCK_M < Lq, key_end, 0)  # no query: no key read
    if CAUSAL:
        loop_end = tl.minimum(loop_end, (tl.program_id(1) + 1) * BLOCK_M)
    if DROPOUT:
        seed, offset = tl.load(SEED), tl.load(SEED + 1)

    q = _load_tile(Q, offs_m, offs_d, stride_qm, stride_qd, Lq, D, UPCAST)
    do = _load_tile(DO, offs_m, offs_dv, stride_dom, stride_dod, Lq, Dv, UPCAST)
    lse = tl.load(LSE + rows + offs_m, mask=offs_m < Lq, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2_E)
    o = _load_tile(OUT, offs_m, offs_dv, stride_om, stride_od, Lq, Dv, UPCAST)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_GRAD_LSE:
        delta -= tl.load(GRAD_LSE + rows + offs_m, mask=offs_m < Lq, other=0.0)
    tl.store(DELTA + rows + offs_m, delta, mask=offs_m < Lq)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, loop_end, BLOCK_N):
        offs_n = start_n + offs_n0
        k = _load_tile(K, offs_n, offs_d, stride_kn, stride_kd, key_end, D, UPCAST)
        v = _load_tile(V, offs_n, offs_dv, stride_vn, stride_vd, key_end, Dv, UPCAST)
        visible = _visible_keys(
            PADDING, stride_pb, stride_pn, b, offs_m[:, None], offs_n[None, :], Lq, key_end,
            CAUSAL, HAS_PADDING,
        )  # fmt: skip
        keep = visible  # without dropout every visible key is kept
        if DROPOUT:
            keep = _dropout_keep(seed, offset, bh, offs_m[:, None], offs_n[None, :], Lk, dropout_p)
        p, _, dp = _probabilities_and_dp(
            q, k, do, v, lse2[:, None], visible, keep, qk_scale, dropout_p, DOT_PRECISION
        )
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)

    dq *= tl.cast(scale, tl.float32)
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
    seed, offset = tl.load(SEED), tl.load(SEED + 1)
    keep = _dropout_keep(seed, offset, bh, offs_m[:, None], offs_n[None, :], Lk, dropout_p)
    KEEP += bh.to(tl.int64) * Lq * Lk
    _store_tile(KEEP, keep.to(tl.uint8), offs_m, offs_n, Lk, 1, Lq, Lk)
