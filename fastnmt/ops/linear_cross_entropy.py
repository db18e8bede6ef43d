r"""Output projection + label-smoothed cross entropy, never materialising the (tokens x V) logits.

``linear_cross_entropy(hidden, weight, bias, target, label_smoothing, ignore_index, reduction)``
equals ``F.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` and also returns the
summed nll, the number of correct argmax predictions and the number of counted tokens.

Math, for token i with hidden state h_i (E,), target t_i, vocabulary size V, smoothing eps:

    z_i    = W h_i + b                                   logits (V,)
    m_i    = max_v z_iv
    lse_i  = m_i + log sum_v exp(z_iv - m_i)
    nll_i  = lse_i - z_{i,t_i}
    loss_i = (1 - eps) nll_i + (eps / V) sum_v (lse_i - z_iv)
           = (1 - eps) nll_i + (eps / V) (V (lse_i - m_i) - sum_v (z_iv - m_i))
           (the last form has no cancellation between V lse_i and sum_v z_iv in fp32)

Tokens with t_i = ignore_index count for nothing. reduction="sum" adds loss_i; "mean" divides by
the number of counted tokens, and is defined as 0 when there are none (``F.cross_entropy`` gives
NaN there, which would poison a training run on an all-padding batch).

Gradient, with p_i = softmax(z_i) and s = 1 (sum) or 1 / counted tokens (mean):

    g_iv  = p_iv - eps / V - (1 - eps) [v = t_i]         the gradient of the summed loss, |g| <= 1
    dz_iv = s g_iv
    dh_i  = s sum_v g_iv W_v,     dW = s sum_i g_i h_i^T,     db = s sum_i g_i

The kernels form g and its products (the gradient of the summed loss) and the backward multiplies
them by (dloss s) in fp32 before casting to the gradients' dtypes. Forming s g in the kernel would
round it to the compute dtype first: in fp16, a mean over thousands of tokens puts s g below fp16's
normal range, and it underflows before a GradScaler's large dloss arrives in the backward (unfused
fp16 autocast computes the cross entropy's gradient in fp32, scaled by dloss s, then casts).

Chunking (Liger-Kernel's fused linear cross entropy, here for CPUs too): the tokens are processed
in chunks of about ``_CHUNK_ELEMENTS / V`` rows. For each chunk a library GEMM writes its logits,
a row kernel (Triton, or C++ in csrc/linear_cross_entropy.cpp) reads each row while it is in cache,
writes the loss statistics and overwrites the row with g, and two more GEMMs turn g into the
chunk's dh and its share of dW (accumulated in fp32). The loss is a scalar, so its gradient is
computed in the forward and the backward only scales it by dloss s: three GEMMs, as unfused, and
one chunk of logits alive at a time instead of logits, fp32 logits, log-probabilities and their
gradients over all tokens. s stays a device tensor (no host sync). reduction="none" needs each
token's gradient scaled separately, so it runs on the reference path.

On a GPU a chunk holds up to ``_GPU_CHUNK_ELEMENTS`` logits (a call of 4,096 tokens over 32k words
is one chunk): there a chunk costs kernel launches, which cost more host time than the GEMMs take
at training shapes. The row kernel writes each row's statistics into one buffer, reduced once
after the last chunk by a one-program kernel that also forms the loss, and the first chunk's dW
and db start the sums. The backward is one kernel that multiplies the three gradients by
(dloss s) and casts them. A forward + backward on one chunk is seven launches (eight when the
GEMMs' dtype differs from fp32; tests/ops/test_linear_cross_entropy.py counts them): the three
GEMMs of the unfused loss, the row kernel, db's column sum, the statistics and the scaling.

The Triton row kernel makes two passes over a row in BLOCK_V blocks: an online max / sum of
exponentials / sum / argmax, then the gradient.

Targets must lie in [0, V) or equal ignore_index. The op checks this only under
``FASTNMT_CHECK_VALUES=1`` (a host sync; callers check their batches on the CPU). Otherwise an
out-of-range target gives an undefined loss and gradient for its token, as ``F.cross_entropy`` on
CUDA does, but the Triton kernel reads no memory outside the row (the C++ kernel raises).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from fastnmt.ops import checks, dispatch, registration
from fastnmt.ops.extension import extension_available

# ---------------------------------------------------------------------------------------------
from fastnmt.ops.triton import common as triton_common
from fastnmt.ops.triton import tl, triton

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
# PyTorch reference: logits, one log-softmax over the whole vocabulary, and its gradient.
# ---------------------------------------------------------------------------------------------


class CrossEntropyOutput(NamedTuple):
    loss: torch.Tensor  # fp32 (fp64 for fp64 inputs) scalar (sum / mean), or per-token losses
    nll: torch.Tensor  # sum over counted tokens of -log p(target), fp64, no gradient
    correct: torch.Tensor  # counted tokens whose argmax logit is the target, fp64
    tokens: torch.Tensor  # counted tokens (target != ignore_index), fp64


def linear_cross_entropy_reference(
    hidden, weight, bias, target, label_smoothing, ignore_index, reduction
):
    hidden, target = _flat(hidden, target)
    logits = F.linear(hidden, weight, bias)  # (N, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp64 stays fp64
    log_probs = F.log_softmax(logits, dim=-1)
    counted = target != ignore_index
    gold = torch.where(counted, target, 0)
    nll = -log_probs.gather(1, gold[:, None]).squeeze(1) * counted
    smoothed = -log_probs.mean(dim=-1) * counted
    losses = (1.0 - label_smoothing) * nll + label_smoothing * smoothed
    tokens = counted.sum()
    if reduction == "sum":
        loss = losses.sum()
    elif reduction == "mean":
        loss = losses.sum() / tokens.clamp_min(1)
    else:
        loss = losses
    correct = ((logits.argmax(dim=-1) == target) & counted).sum()
    statistics = torch.stack([nll.detach().sum(), correct, tokens]).double()
    return loss, statistics


def linear_cross_entropy_torch(
    hidden, weight, bias, target, label_smoothing, ignore_index, reduction
):
    """``F.cross_entropy(F.linear(...))`` over fp32 logits: what a model written with PyTorch's
    built-ins runs (the baseline fastnmt is measured against); its statistics from the same
    logits, outside autograd."""
    hidden, target = _flat(hidden, target)
    logits = F.linear(hidden, weight, bias).float()  # (N, V)
    loss = F.cross_entropy(
        logits, target, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing,
    )  # fmt: skip
    with torch.no_grad():
        counted = target != ignore_index
        nll = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
        correct = ((logits.argmax(dim=-1) == target) & counted).sum()
        statistics = torch.stack([nll, correct, counted.sum()]).double()
    return loss, statistics


def _flat(hidden, target):
    """hidden as (N, E) and target as int64 (N,), N tokens."""
    return hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1).long()


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
_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def chunk_rows(vocab: int) -> int:
    """Tokens per chunk: about _CHUNK_ELEMENTS (_GPU_CHUNK_ELEMENTS) logits, a multiple of 16."""
    budget = _GPU_CHUNK_ELEMENTS if triton_common.use_gpu_tiles() else _CHUNK_ELEMENTS
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
    step = chunk_rows(vocab)
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


# ---------------------------------------------------------------------------------------------
# Registered ops (torch.library) with autograd, the dispatch entry and the public function.
# ---------------------------------------------------------------------------------------------


@registration.triton_library_op("fastnmt::linear_cross_entropy_triton")
def _triton_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    mean: bool,
    compute_grad: bool,
    dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, [nll, correct, tokens], dhidden, dweight, dbias): see ``_chunked``."""
    return _chunked(
        hidden,
        weight,
        bias,
        target,
        label_smoothing,
        ignore_index,
        mean,
        compute_grad,
        dtype,
    )


def _fake(hidden, weight, bias, target, label_smoothing, ignore_index, mean, compute_grad, dtype):
    def gradient_of(shape, dtype=torch.float32, wanted=compute_grad):
        return hidden.new_empty(shape if wanted else (0,), dtype=dtype)

    return (
        hidden.new_empty((), dtype=torch.float32),
        hidden.new_empty(3, dtype=torch.float64),
        gradient_of(hidden.shape, hidden.dtype),
        gradient_of(weight.shape),
        gradient_of((weight.shape[0],), wanted=compute_grad and bias is not None),
    )


def _setup_context(ctx, inputs, output):
    hidden, weight, bias = inputs[:3]
    ctx.mean, ctx.compute_grad = inputs[6], inputs[7]
    ctx.grad_dtypes = [hidden.dtype, weight.dtype, None if bias is None else bias.dtype]
    ctx.save_for_backward(*output[1:])
    # Only the loss has a gradient: the other outputs get no zero-filled ones to allocate.
    ctx.set_materialize_grads(False)


@registration.triton_library_op("fastnmt::linear_cross_entropy_triton_backward")
def _triton_backward_op(
    dloss: torch.Tensor,
    statistics: torch.Tensor,
    dh: torch.Tensor,
    dw: torch.Tensor,
    db: torch.Tensor,
    mean: bool,
    hidden_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    bias_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dhidden, dweight, dbias or empty): see ``_scale_gradients``."""
    return _scale_gradients(
        dloss, statistics, dh, dw, db, mean, hidden_dtype, weight_dtype, bias_dtype
    )


@torch.library.register_fake(_triton_backward_op)
def _backward_fake(dloss, statistics, dh, dw, db, mean, hidden_dtype, weight_dtype, bias_dtype):
    with_bias = bias_dtype is not None
    return (
        dh.new_empty(dh.shape, dtype=hidden_dtype),
        dw.new_empty(dw.shape, dtype=weight_dtype),
        db.new_empty(db.shape if with_bias else (0,), dtype=bias_dtype or torch.float32),
    )


def _make_backward(backward_op):
    """The autograd backward of the Triton forward, scaling on ``backward_op``."""

    def backward(ctx, dloss, _dstatistics, _dh, _dw, _db):
        if not ctx.compute_grad:
            raise RuntimeError("linear_cross_entropy ran with compute_grad=False: no gradient kept")
        if dloss is None:  # the loss was not used
            return (None,) * 9
        grad_h, grad_w, grad_b = backward_op(dloss, *ctx.saved_tensors, ctx.mean, *ctx.grad_dtypes)
        return grad_h, grad_w, (None if ctx.grad_dtypes[2] is None else grad_b), *(None,) * 6

    return backward


# The Triton op's autograd in Python; the C++ op (csrc/linear_cross_entropy.cpp: the same driver
# and the same backward, in C++) registers its own, so a CPU step never enters Python below the op
# call.
torch.library.register_fake(_triton_op)(_fake)
_triton_op.register_autograd(_make_backward(_triton_backward_op), setup_context=_setup_context)
_triton_eager = registration.eager_function(
    "linear_cross_entropy_triton", _chunked, _setup_context, _make_backward(_scale_gradients)
)
if extension_available():
    _cpp_op = torch.ops.fastnmt.linear_cross_entropy_cpp.default
    torch.library.register_fake(_cpp_op)(_fake)
else:
    _cpp_op = registration.extension_missing


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast runs GEMMs in on ``device``, or None outside autocast."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def _running(fused_op):
    """The implementation of the op on a fused registered op."""

    def implementation(hidden, weight, bias, target, label_smoothing, ignore_index, reduction):
        # Inline rather than helpers (_flat, _autocast_dtype): each is a Python call per op call;
        # and no reshape of a flat input: a view costs an autograd node (the trainer's are flat).
        if hidden.dim() != 2:
            hidden = hidden.reshape(-1, hidden.shape[-1])
        if target.dim() != 1 or target.dtype != torch.int64:
            target = target.reshape(-1).long()
        trained = hidden.requires_grad or weight.requires_grad
        needs_grad = torch.is_grad_enabled() and (
            trained or (bias is not None and bias.requires_grad)
        )
        device_type = hidden.device.type
        autocasting = torch.is_autocast_enabled(device_type)
        autocast_dtype = torch.get_autocast_dtype(device_type) if autocasting else None
        loss, statistics, *_ = fused_op(
            hidden,
            weight,
            bias,
            target,
            label_smoothing,
            ignore_index,
            reduction == "mean",
            needs_grad,
            autocast_dtype,
        )
        return loss, statistics

    return implementation


def _fused_unsupported(kernels: str):
    def unsupported(hidden, weight, bias, target, label_smoothing, ignore_index, reduction):
        if reduction == "none":
            yield (
                "reduction='none' needs each token's gradient scaled on its own; the fused "
                "kernels compute the gradient of a summed or mean loss in the forward"
            )
        dtype = _autocast_dtype(hidden.device) or hidden.dtype
        if dtype not in _SUPPORTED_DTYPES:
            yield f"hidden has dtype {dtype}; the {kernels} kernels take fp32, fp16 and bf16"

    return unsupported


def _prepare(
    hidden, weight, bias, target, label_smoothing=0.0, ignore_index=-100, reduction="mean"
):
    checks.tensor("hidden", hidden, floating=True)
    checks.tensor("weight", weight, ndim=2, floating=True)
    if hidden.dim() == 0 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden must have shape (..., {weight.shape[1]}) (weight is (V, E) = "
            f"{tuple(weight.shape)}), got {tuple(hidden.shape)}"
        )
    checks.same_device("weight", weight, "hidden", hidden)
    if not checks.autocasting(hidden.device):
        checks.same_dtype("weight", weight, "hidden", hidden)
    if bias is not None:
        checks.tensor("bias", bias, floating=True)
        checks.shape("bias", bias, (weight.shape[0],), "the vocabulary size, weight.shape[0]")
        checks.same_device("bias", bias, "hidden", hidden)
    checks.tensor("target", target)
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must hold int64 or int32 class indices, got {target.dtype}")
    checks.shape("target", target, tuple(hidden.shape[:-1]), "hidden's shape without E")
    checks.same_device("target", target, "hidden", hidden)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    _check_target_range(target.reshape(-1), weight.shape[0], ignore_index)
    prepared = dict(
        hidden=hidden,
        weight=weight,
        bias=bias,
        target=target,
        label_smoothing=checks.probability("label_smoothing", label_smoothing),
        ignore_index=ignore_index,
        reduction=reduction,
    )
    return hidden.device, prepared


def _check_target_range(target, vocab: int, ignore_index: int) -> None:
    """Class indices in [0, V) or ignore_index: a host sync, so only under
    FASTNMT_CHECK_VALUES=1 and outside tracing (the kernels stay memory-safe without it)."""
    if not checks.values_checked() or torch.compiler.is_compiling():
        return
    outside = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    if outside.any():
        position = int(outside.nonzero()[0, 0])
        raise ValueError(
            f"target must hold class indices in [0, {vocab}) or ignore_index ({ignore_index}); "
            f"got {int(target[position])} at flat position {position}"
        )


LINEAR_CROSS_ENTROPY = dispatch.define("linear_cross_entropy", _prepare)
LINEAR_CROSS_ENTROPY.register("reference")(linear_cross_entropy_reference)
LINEAR_CROSS_ENTROPY.register("torch")(linear_cross_entropy_torch)
LINEAR_CROSS_ENTROPY.register(
    "triton",
    _fused_unsupported("Triton"),
    traced=_running(_triton_op),
    inference=_running(_chunked),
)(_running(_triton_eager))
LINEAR_CROSS_ENTROPY.register("cpp", _fused_unsupported("C++"))(_running(_cpp_op))


def linear_cross_entropy(
    hidden, weight, bias, target, label_smoothing=0.0, ignore_index=-100, reduction="mean"
) -> CrossEntropyOutput:
    """Label-smoothed cross entropy of the logits ``hidden @ weight.T + bias``, without forming
    them for all tokens at once on the fused backends.

    Args:
        hidden: (..., E) states; under autocast, computed in the autocast dtype like ``F.linear``.
        weight: (V, E) output projection (e.g. a tied embedding), same dtype as hidden outside
            autocast. bias: (V,) or None.
        target: (...) int64/int32 class indices in [0, V), or ``ignore_index``.
        label_smoothing: eps in [0, 1), as in ``F.cross_entropy``.
        reduction: "mean" (over counted tokens; 0 when none), "sum", or "none" (per-token
            losses, shape of target; reference path).

    Returns:
        ``CrossEntropyOutput(loss, nll, correct, tokens)``: the loss, and for logging the summed
        nll, the number of correct argmax predictions and of counted tokens.
    """
    loss, statistics = LINEAR_CROSS_ENTROPY(
        hidden, weight, bias, target, label_smoothing, ignore_index, reduction
    )
    if reduction == "none":
        loss = loss.view(target.shape)
    return CrossEntropyOutput(loss, *statistics.detach().unbind())
