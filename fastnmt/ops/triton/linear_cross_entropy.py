"""The Triton kernels of ``fastnmt.ops.linear_cross_entropy`` (the math and the chunking are
described there) and their chunked driver.

The Triton row kernel makes two passes over a row in BLOCK_V blocks: an online max / sum of
exponentials / sum / argmax, then the gradient.
"""

from __future__ import annotations

import torch

from fastnmt.ops.triton import common as triton_common
from fastnmt.ops.triton import tl, triton

# ---------------------------------------------------------------------------------------------
# Triton kernel: one program per row of a chunk of logits.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _cross_entropy_rows_kernel(
    Z,  # (rows, V) logits of a chunk, contiguous; overwritten with g when COMPUTE_GRAD
    TARGET,  # (rows,) int64 target ids
    STATS,  # (rows, 4) fp32 output: nll_i, [argmax z_i == t_i], [counted], loss_i
    V,  # vocabulary size
    smoothing,  # eps
    ignore_index,  # target id of tokens that count for nothing
    COMPUTE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * V
    target = tl.load(TARGET + row)
    counted = target != ignore_index
    # -1 (no column) for a target outside [0, V), as ignore_index usually is: nothing is read out
    # of bounds for a wrong target either (the op checks them only under FASTNMT_CHECK_VALUES=1).
    gold = tl.where((target >= 0) & (target < V), target, -1)

    # Pass 1: running max m, sum of exp(z - m), sum of (z - m) (kept relative to m: a sum of z
    # would cancel against V * lse), and the first index of the max.
    m = -float("inf")
    sum_exp = 0.0
    sum_shifted = 0.0
    argmax = 0
    for start in range(0, V, BLOCK_V):
        columns = start + tl.arange(0, BLOCK_V)
        inside = columns < V
        z = tl.load(z_row + columns, mask=inside, other=-float("inf")).to(tl.float32)
        block_max = tl.max(z, 0)
        argmax = tl.where(block_max > m, start + tl.argmax(z, 0), argmax)
        new_m = tl.maximum(m, block_max)
        sum_exp = sum_exp * tl.exp(m - new_m) + tl.sum(tl.exp(z - new_m), 0)
        previous_m = tl.where(start > 0, m, new_m)  # m is -inf before the first block
        sum_shifted += tl.sum(tl.where(inside, z - new_m, 0.0), 0) - start * (new_m - previous_m)
        m = new_m
    log_sum = tl.log(sum_exp)
    lse = m + log_sum
    nll = lse - tl.load(z_row + gold, mask=gold >= 0, other=0.0).to(tl.float32)
    uniform = smoothing / V
    loss = (1.0 - smoothing) * nll + uniform * (V * log_sum - sum_shifted)
    tl.store(STATS + row * 4, tl.where(counted, nll, 0.0))
    tl.store(STATS + row * 4 + 1, tl.where(counted & (argmax == gold), 1.0, 0.0))
    tl.store(STATS + row * 4 + 2, tl.where(counted, 1.0, 0.0))
    tl.store(STATS + row * 4 + 3, tl.where(counted, loss, 0.0))

    # Pass 2: g = p - eps / V - (1 - eps) [v = t], zero for an ignored token.
    if COMPUTE_GRAD:
        for start in range(0, V, BLOCK_V):
            columns = start + tl.arange(0, BLOCK_V)
            inside = columns < V
            z = tl.load(z_row + columns, mask=inside, other=0.0).to(tl.float32)
            g = tl.exp(z - lse) - uniform - tl.where(columns == gold, 1.0 - smoothing, 0.0)
            g = tl.where(counted, g, 0.0)
            tl.store(z_row + columns, g.to(Z.dtype.element_ty), mask=inside)


@triton.jit
def _sum_statistics_kernel(
    STATS,  # (rows, 4) fp32: every row's nll, correct, counted, loss (the row kernel's STATS)
    rows,
    LOSS,  # () fp32 output: the summed loss, or its mean over counted tokens when MEAN
    SUMS,  # (3,) fp64 output: summed nll, correct, counted
    MEAN: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """One program: the column sums of STATS in fp64, in a fixed order (deterministic)."""
    columns = tl.arange(0, 4)
    total = tl.zeros((BLOCK_ROWS, 4), dtype=tl.float64)
    for start in range(0, rows, BLOCK_ROWS):
        row = start + tl.arange(0, BLOCK_ROWS).to(tl.int64)
        inside = row[:, None] < rows
        total += tl.load(STATS + row[:, None] * 4 + columns[None, :], mask=inside, other=0.0)
    sums = tl.sum(total, 0)
    loss = tl.sum(tl.where(columns == 3, sums, 0.0), 0)
    if MEAN:  # s = 1 / counted tokens; the loss is 0 when none count
        loss = loss / tl.maximum(tl.sum(tl.where(columns == 2, sums, 0.0), 0), 1.0)
    tl.store(LOSS, loss.to(tl.float32))
    tl.store(SUMS + columns, sums, mask=columns < 3)


@triton.jit
def _scale_block(SOURCE, DESTINATION, n, block, factor, BLOCK: tl.constexpr):
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    g = tl.load(SOURCE + offsets, mask=inside).to(tl.float32)
    tl.store(DESTINATION + offsets, (g * factor).to(DESTINATION.dtype.element_ty), mask=inside)


@triton.jit
def _scale_gradients_kernel(
    DLOSS,  # () the loss's gradient
    SUMS,  # (3,) fp64: summed nll, correct, counted (the forward's)
    DH, GRAD_H, n_h,  # the summed loss's dh (N, E) and the output gradient, n_h elements
    DW, GRAD_W, n_w,  # dw (V, E), fp32
    DB, GRAD_B, n_b,  # db (V,), fp32; n_b = 0 without a bias
    MEAN: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """GRAD_* = (dloss s) D* in fp32, cast to GRAD_*'s dtype: the programs cover DH's blocks,
    then DW's, then DB's."""
    factor = tl.load(DLOSS).to(tl.float32)
    if MEAN:
        factor = factor / tl.maximum(tl.load(SUMS + 2), 1.0).to(tl.float32)
    block = tl.program_id(0)
    blocks_h = tl.cdiv(n_h, BLOCK)
    blocks_w = tl.cdiv(n_w, BLOCK)
    if block < blocks_h:
        _scale_block(DH, GRAD_H, n_h, block, factor, BLOCK)
    elif block < blocks_h + blocks_w:
        _scale_block(DW, GRAD_W, n_w, block - blocks_h, factor, BLOCK)
    else:
        _scale_block(DB, GRAD_B, n_b, block - blocks_h - blocks_w, factor, BLOCK)


# ---------------------------------------------------------------------------------------------
# Launchers: the chunked driver of the Triton row kernel (the C++ op has its own, in
# csrc/linear_cross_entropy.cpp: the same math and chunking).
# ---------------------------------------------------------------------------------------------

_CHUNK_ELEMENTS = 1 << 23  # logits per chunk on a CPU: 16 MB in bf16, 32 MB in fp32 (cache)
# On a GPU a chunk costs launches, not cache misses: 256 MB in bf16, one chunk for 4,096 tokens
# over 32k words (the launches of a call do not grow with the vocabulary below that).
_GPU_CHUNK_ELEMENTS = 1 << 27
_GPU_BLOCK_V = 4096  # 16 values per thread with 8 warps
_INTERPRETER_BLOCK_V = 1 << 16  # the interpreter's cost grows with the number of blocks


def chunk_rows(vocab: int, gpu: bool) -> int:
    """Tokens per chunk: about _GPU_CHUNK_ELEMENTS logits on a GPU (``gpu``), _CHUNK_ELEMENTS on
    a CPU, a multiple of 16."""
    budget = _GPU_CHUNK_ELEMENTS if gpu else _CHUNK_ELEMENTS
    return max(16, budget // vocab // 16 * 16)


def _block_v(vocab: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the row kernel."""
    limit = _GPU_BLOCK_V if triton_common.use_gpu_tiles() else _INTERPRETER_BLOCK_V
    block_v = min(limit, triton_common.power_of_2_at_least(vocab))
    return block_v, _num_warps(block_v)


def _num_warps(block_v: int) -> int:
    return min(8, max(1, block_v // 512))  # up to 16 values per thread


_ROWS = triton_common.Launcher(_cross_entropy_rows_kernel)
_SUM_STATISTICS = triton_common.Launcher(_sum_statistics_kernel)
_SCALE_GRADIENTS = triton_common.Launcher(_scale_gradients_kernel)


def _triton_rows(logits, target, stats, label_smoothing, ignore_index, compute_grad):
    """The row step on the Triton kernel: logits become g in place, ``stats`` (rows, 4) gets
    each row's statistics (the kernel's STATS)."""
    rows, vocab = logits.shape
    # The interpreter computes bf16 wrongly: run the kernel on an fp32 copy (see triton_common).
    upcast = triton_common.upcast_in_interpreter(logits.dtype)
    z = logits.float() if upcast else logits
    block_v, num_warps = _block_v(vocab)
    _ROWS(
        z.device,
        (rows, 1, 1),
        (z, target, stats, vocab, label_smoothing, ignore_index),
        triton_common.launch_options(
            COMPUTE_GRAD=compute_grad, BLOCK_V=block_v, num_warps=num_warps
        ),
    )
    if upcast and compute_grad:
        logits.copy_(z)


_STATISTICS_BLOCK_ROWS = 512


def _sum_statistics(stats, mean):
    """(loss fp32 (), [nll, correct, tokens] fp64 (3,)) from every row's ``stats``."""
    loss = triton_common.new_output((), torch.float32, stats.device)
    sums = triton_common.new_output((3,), torch.float64, stats.device)
    _SUM_STATISTICS(
        stats.device,
        (1, 1, 1),
        (stats, stats.shape[0], loss, sums),
        triton_common.launch_options(MEAN=mean, BLOCK_ROWS=_STATISTICS_BLOCK_ROWS),
    )
    return loss, sums


def _chunked(
    hidden,
    weight,
    bias,
    target,
    label_smoothing,
    ignore_index,
    mean,
    compute_grad,
    dtype,
):
    """(loss, statistics, dhidden, dweight, dbias): the loss and the gradient of the *summed*
    loss (the backward applies s), one chunk of logits at a time. dhidden has hidden's dtype,
    dweight and dbias stay fp32 (sums over all tokens may exceed fp16's range); each is empty
    unless compute_grad (dbias also without a bias).

    Its launches are per chunk a GEMM for the logits, the row kernel and one or two GEMMs for
    dh and dw (and a column sum for db), then one kernel that sums every row's statistics into
    the loss: nothing is zero-filled and nothing reduced per chunk."""
    compute_dtype = hidden.dtype if dtype is None else dtype
    h = hidden.to(compute_dtype).contiguous()  # (N, E)
    w = weight.to(compute_dtype).contiguous()  # (V, E)
    # (E, V): a CPU GEMM takes a transposed view slower, every chunk; cuBLAS does not.
    w_t = w.t() if w.is_cuda else w.t().contiguous()
    b = None if bias is None else bias.to(compute_dtype)
    tokens, vocab = h.shape[0], w.shape[0]
    stats = triton_common.new_output((tokens, 4), torch.float32, h.device)  # the kernel's STATS
    # Every row of dh is written by one chunk's GEMM; dw and db: fp32 sums over chunks.
    dh = torch.empty(h.shape if compute_grad else (0,), dtype=compute_dtype, device=h.device)
    dw = db = None
    step = chunk_rows(vocab, triton_common.use_gpu_tiles())
    for start in range(0, tokens, step):
        rows = slice(start, start + step)
        h_chunk = h[rows]
        z = torch.mm(h_chunk, w_t) if b is None else torch.addmm(b, h_chunk, w_t)  # (C, V)
        _triton_rows(z, target[rows], stats[rows], label_smoothing, ignore_index, compute_grad)
        if compute_grad:  # z now holds g
            torch.mm(z, w, out=dh[rows])
            dw = _fp32_sum(dw, z.t(), h_chunk)
            if b is not None:
                db = _fp32_sum(db, z)
    fp32 = dict(dtype=torch.float32, device=h.device)
    if dw is None:  # zero without tokens; empty when no gradient is asked for
        dw = torch.zeros(w.shape, **fp32) if compute_grad else torch.empty(0, **fp32)
    if db is None:
        db = (
            torch.zeros(vocab, **fp32) if compute_grad and b is not None else torch.empty(0, **fp32)
        )
    loss, sums = _sum_statistics(stats, mean)
    return loss, sums, triton_common.as_dtype(dh, hidden.dtype), dw, db


_SCALE_BLOCK, _SCALE_WARPS = 2048, 4  # elements per program of the backward: 16 per thread


def _scale_gradients(
    dloss, sums, dh, dw, db, mean, hidden_dtype, weight_dtype, bias_dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of hidden, weight and bias (empty without a bias): (dloss s) times the
    summed loss's, in fp32, cast to the parameters' dtypes."""
    # The interpreter's bf16 is wrong: fp32 copies in, fp32 gradients out, cast by torch.
    if triton_common.upcast_in_interpreter(dh.dtype):
        dh = dh.float()
    with_bias = bias_dtype is not None
    grad_h, grad_w = _gradient_buffer(dh, hidden_dtype), _gradient_buffer(dw, weight_dtype)
    grad_b = _gradient_buffer(db, bias_dtype) if with_bias else dw.new_empty(0)
    # Without a bias no program reaches db's branch: dw's buffers stand in for its pointers (an
    # empty tensor's is null).
    db_in, db_out, n_b = (db, grad_b, db.numel()) if with_bias else (dw, grad_w, 0)
    n_h, n_w = dh.numel(), dw.numel()
    cdiv = triton_common.cdiv
    programs = cdiv(n_h, _SCALE_BLOCK) + cdiv(n_w, _SCALE_BLOCK) + cdiv(n_b, _SCALE_BLOCK)
    _SCALE_GRADIENTS(
        dw.device,
        (programs, 1, 1),
        (dloss, sums, dh, grad_h, n_h, dw, grad_w, n_w, db_in, db_out, n_b),
        triton_common.launch_options(MEAN=mean, BLOCK=_SCALE_BLOCK, num_warps=_SCALE_WARPS),
    )
    as_dtype = triton_common.as_dtype
    return (
        as_dtype(grad_h, hidden_dtype),
        as_dtype(grad_w, weight_dtype),
        as_dtype(grad_b, bias_dtype or dw.dtype),
    )


def _gradient_buffer(summed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scaling kernel's output for ``summed``: ``dtype``, fp32 where the interpreter upcasts."""
    return triton_common.new_output(
        summed.shape, triton_common.kernel_output_dtype(dtype), summed.device
    )


def _fp32_sum(total, g, h=None):
    """total + (g @ h, or the column sums of g without h) in fp32; the first chunk's term
    when total is None."""
    if total is not None and h is not None and g.dtype == torch.float32:
        return total.addmm_(g, h)  # no temporary
    term = g.sum(0, dtype=torch.float32) if h is None else torch.mm(g, h)
    return term.float() if total is None else total.add_(term)
