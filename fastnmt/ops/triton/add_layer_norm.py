r"""The Triton kernels of ``fastnmt.ops.add_layer_norm`` (the math is there) and their launchers.

The kernels work on tiles of BLOCK_M rows x BLOCK_N >= N columns (a whole row per tile, so the
statistics need one pass); lanes past N load 0 and are excluded from mean and variance
(Liger #518). The dropout mask is never stored: keep = rand(seed, offset + row * N + column) >= p
is regenerated in the backward. The forward saves h (returned anyway), mean and rstd. The backward
keeps per-program fp32 partial sums of dweight/dbias over the rows it visits, and one more kernel
sums them over the programs in a fixed order, both at once: deterministic, no atomics, and a
forward + backward is three launches.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from fastnmt.ops.triton import common as triton_common
from fastnmt.ops.triton import tl, triton

# ---------------------------------------------------------------------------------------------
# Triton kernels.
# ---------------------------------------------------------------------------------------------


@triton.jit
def apply_dropout(values, SEED, element, dropout_p):
    """values * keep / (1 - p) with keep = rand(seed, offset + element) >= p (fp32 values)."""
    seed = tl.load(SEED)
    offset = tl.load(SEED + 1)
    keep = tl.rand(seed, offset + element) >= dropout_p
    return tl.where(keep, values / (1.0 - dropout_p), 0.0)


@triton.jit
def _add_layer_norm_forward_kernel(
    X,  # (rows, N) sublayer output, contiguous
    R,  # (rows, N) residual, contiguous (read when HAS_RESIDUAL)
    W,  # (N,) LayerNorm weight (read when HAS_WEIGHT)
    B,  # (N,) LayerNorm bias (read when HAS_BIAS)
    Y,  # (rows, N) output LN(h), contiguous
    H,  # (rows, N) output h = residual + dropout(x), contiguous
    MEAN,  # (rows,) fp32 output: mean of h, saved for the backward (when HAS_STATISTICS)
    RSTD,  # (rows,) fp32 output: 1 / sqrt(var + eps), saved for the backward (likewise)
    SEED,  # int64 (2,): philox seed and offset of the dropout mask (read when HAS_DROPOUT)
    rows,  # number of rows
    N,  # row width
    eps,  # added to the variance
    dropout_p,  # probability of dropping an element of x
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    HAS_STATISTICS: tl.constexpr,  # False without a backward to come (inference)
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_N: tl.constexpr,  # power of two >= N
):
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]  # (BLOCK_M, 1)
    column = tl.arange(0, BLOCK_N)[None, :]  # (1, BLOCK_N)
    inside = (row < rows) & (column < N)
    element = row.to(tl.int64) * N + column  # index of each element in the (rows, N) tensors
    h = tl.load(X + element, mask=inside, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        h = apply_dropout(h, SEED, element, tl.cast(dropout_p, tl.float32))
    if HAS_RESIDUAL:
        h += tl.load(R + element, mask=inside, other=0.0).to(tl.float32)
    h = h.to(H.dtype.element_ty)  # the rounding the returned h gets, for consistent statistics
    tl.store(H + element, h, mask=inside)
    h = h.to(tl.float32)
    mean = tl.sum(h, axis=1) / N  # (BLOCK_M,): lanes past N hold 0
    centered = tl.where(inside, h - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / N + tl.cast(eps, tl.float32))
    y = centered * rstd[:, None]
    if HAS_WEIGHT:
        y *= tl.load(W + column, mask=column < N, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + column, mask=column < N, other=0.0).to(tl.float32)
    tl.store(Y + element, y.to(Y.dtype.element_ty), mask=inside)
    if HAS_STATISTICS:
        row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(MEAN + row, mean, mask=row < rows)
        tl.store(RSTD + row, rstd, mask=row < rows)


@triton.jit
def _add_layer_norm_backward_kernel(
    DY,  # (rows, N) gradient of y, contiguous
    DH_OUT,  # (rows, N) gradient flowing into the returned h (read when HAS_DH_OUT)
    H,  # (rows, N) h saved by the forward
    W,  # (N,) LayerNorm weight (read when HAS_WEIGHT)
    MEAN,  # (rows,) fp32 mean of h
    RSTD,  # (rows,) fp32 1 / sqrt(var + eps)
    SEED,  # int64 (2,): the forward's dropout seed and offset (read when HAS_DROPOUT)
    DX,  # (rows, N) output: gradient of x
    DH,  # (rows, N) output: gradient of h = of the residual (written when HAS_RESIDUAL)
    DW_PARTIAL,  # (programs, N) fp32 output: this program's sum of dy * xhat (when HAS_WEIGHT)
    DB_PARTIAL,  # (programs, N) fp32 output: this program's sum of dy (when HAS_BIAS)
    rows,  # number of rows
    N,  # row width
    dropout_p,  # probability of dropping an element of x
    HAS_DH_OUT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_N: tl.constexpr,  # power of two >= N
):
    column = tl.arange(0, BLOCK_N)[None, :]  # (1, BLOCK_N)
    weight = tl.full((1, BLOCK_N), 1.0, tl.float32)
    if HAS_WEIGHT:
        weight = tl.load(W + column, mask=column < N, other=0.0).to(tl.float32)
    dweight = tl.zeros((BLOCK_N,), tl.float32)
    dbias = tl.zeros((BLOCK_N,), tl.float32)
    # Programs take every num_programs-th tile: a fixed grid, so a fixed summation order.
    for first_row in range(tl.program_id(0) * BLOCK_M, rows, tl.num_programs(0) * BLOCK_M):
        row = first_row + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
        inside = (row[:, None] < rows) & (column < N)
        element = row[:, None].to(tl.int64) * N + column
        dy = tl.load(DY + element, mask=inside, other=0.0).to(tl.float32)
        h = tl.load(H + element, mask=inside, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + row, mask=row < rows, other=0.0)
        rstd = tl.load(RSTD + row, mask=row < rows, other=0.0)
        xhat = tl.where(inside, (h - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * weight
        mean_g = tl.sum(g, axis=1) / N
        mean_g_xhat = tl.sum(g * xhat, axis=1) / N
        dh = (g - mean_g[:, None] - xhat * mean_g_xhat[:, None]) * rstd[:, None]
        if HAS_DH_OUT:
            dh += tl.load(DH_OUT + element, mask=inside, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            tl.store(DH + element, dh.to(DH.dtype.element_ty), mask=inside)
        if HAS_DROPOUT:
            dh = apply_dropout(dh, SEED, element, tl.cast(dropout_p, tl.float32))
        tl.store(DX + element, dh.to(DX.dtype.element_ty), mask=inside)
        if HAS_WEIGHT:
            dweight += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            dbias += tl.sum(dy, axis=0)
    partial = tl.program_id(0) * N + tl.arange(0, BLOCK_N)
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + partial, dweight, mask=tl.arange(0, BLOCK_N) < N)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + partial, dbias, mask=tl.arange(0, BLOCK_N) < N)


@triton.jit
def _sum_partials_kernel(
    DW_PARTIAL,  # (programs, N) fp32: the backward programs' sums of dy * xhat (when HAS_WEIGHT)
    DB_PARTIAL,  # (programs, N) fp32: their sums of dy (when HAS_BIAS)
    DW,  # (N,) output: dweight, in the weight's dtype (fp32 without a weight)
    DB,  # (N,) output: dbias, in the same dtype
    programs,  # rows of the partial sums
    N,  # row width
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_P: tl.constexpr,  # partial rows a step loads: few steps, not one load after another
    BLOCK: tl.constexpr,  # columns per program
):
    column = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)[None, :]  # (1, BLOCK)
    dweight = tl.zeros((BLOCK_P, BLOCK), tl.float32)
    dbias = tl.zeros((BLOCK_P, BLOCK), tl.float32)
    for first in range(0, programs, BLOCK_P):  # a fixed order: the same sums at every call
        program = first + tl.arange(0, BLOCK_P)[:, None]  # (BLOCK_P, 1)
        inside = (program < programs) & (column < N)
        if HAS_WEIGHT:
            dweight += tl.load(DW_PARTIAL + program * N + column, mask=inside, other=0.0)
        if HAS_BIAS:
            dbias += tl.load(DB_PARTIAL + program * N + column, mask=inside, other=0.0)
    column = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if HAS_WEIGHT:
        tl.store(DW + column, tl.sum(dweight, axis=0), mask=column < N)
    if HAS_BIAS:
        tl.store(DB + column, tl.sum(dbias, axis=0), mask=column < N)


# ---------------------------------------------------------------------------------------------
# Launchers.
# ---------------------------------------------------------------------------------------------

MAX_WIDTH = 4096  # one tile holds a whole row (16 values per thread); wider rows: another backend
_GPU_TILE = 4096  # elements per tile on a GPU: 8-16 fp32 values per thread and tensor
_INTERPRETER_TILE = 65536  # the interpreter's cost grows with the number of programs


def _tile(rows: int, width: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a (rows, width) problem: whole rows, as many as fit
    the tile (the GPU's, or in the interpreter outside ``gpu_tiles()`` its own)."""
    return _chosen_tile(*_hashable(rows, width), triton_common.use_gpu_tiles())


def _hashable(rows, width) -> tuple[int, int]:
    """(rows, width) as the cached launch plans key them: a trace's symbolic sizes (dynamic
    shapes) as ints, rows hinted (it chooses only a block's rows), width specialized."""
    if rows.__class__ is int and width.__class__ is int:
        return rows, width
    return triton_common.size_hint(rows), triton_common.static_size(width)


@functools.lru_cache(maxsize=4096)  # per call signature, as the dispatcher's decisions
def _chosen_tile(rows: int, width: int, gpu_tiles: bool) -> tuple[int, int, int]:
    block_n = triton_common.power_of_2_at_least(width)
    tile = _GPU_TILE if gpu_tiles else _INTERPRETER_TILE
    block_m = min(max(1, tile // block_n), triton_common.power_of_2_at_least(rows))
    num_warps = min(8, max(1, block_m * block_n // 512))
    return block_m, block_n, num_warps


_PROGRAMS_PER_SM = 4  # of the backward grid: each sums dweight over its tiles


@functools.cache  # one entry per device
def _most_backward_programs(device: torch.device) -> int:
    """Programs of the backward grid at most: a few per SM, each summing dweight over several
    tiles."""
    if device.type == "cuda":
        return _PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # the interpreter: still exercises a program visiting two tiles


def _h_dtype(x_dtype, residual_dtype, residual_in_fp32: bool) -> torch.dtype:
    """h's dtype, from x's and the residual's (None without one)."""
    if residual_in_fp32:
        return torch.float32
    if residual_dtype is None or residual_dtype == x_dtype:
        return x_dtype
    return torch.promote_types(x_dtype, residual_dtype)


def _tiled_options(rows: int, width: int, gpu: bool, **flags) -> tuple[int, dict]:
    """(BLOCK_M, launch options) of a row kernel: its flags and the (rows, width) tile."""
    block_m, block_n, num_warps = _chosen_tile(rows, width, gpu)
    options = triton_common.launch_options(
        **flags, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps
    )
    return block_m, options


# Launch plans: what a launch needs beyond its tensors, found once per call signature (the
# tensors' sizes, dtypes and which are given), so that a call's host work is the buffers and the
# launches. The grids are computed at each call: a trace's sizes may be symbolic.


class _ForwardPlan(NamedTuple):
    block_m: int
    options: dict  # the kernel's constexprs and launch options (launch_options)
    y_buffer: torch.dtype  # the output buffers' dtypes (kernel_output_dtype)
    h_dtype: torch.dtype
    h_buffer: torch.dtype
    cast: bool  # a buffer is not in its output's dtype (bf16 under the interpreter)


@functools.lru_cache(maxsize=4096)
def _forward_plan(
    rows, width, x_dtype, residual_dtype, residual_in_fp32, weight, bias, dropout, statistics, gpu
) -> _ForwardPlan:
    h_dtype = _h_dtype(x_dtype, residual_dtype, residual_in_fp32)
    y_buffer, h_buffer = map(triton_common.kernel_output_dtype, (x_dtype, h_dtype))
    block_m, options = _tiled_options(
        rows,
        width,
        gpu,
        HAS_RESIDUAL=residual_dtype is not None,
        HAS_WEIGHT=weight,
        HAS_BIAS=bias,
        HAS_DROPOUT=dropout,
        HAS_STATISTICS=statistics,
    )
    cast = (y_buffer, h_buffer) != (x_dtype, h_dtype)
    return _ForwardPlan(block_m, options, y_buffer, h_dtype, h_buffer, cast)


_FORWARD = triton_common.Launcher(_add_layer_norm_forward_kernel)
_BACKWARD = triton_common.Launcher(_add_layer_norm_backward_kernel)
_SUM_PARTIALS = triton_common.Launcher(_sum_partials_kernel)


def _launch_forward(
    x, residual, weight, bias, eps, dropout_p, residual_in_fp32, seed, statistics=True
):
    """(y, h, mean, rstd); mean and rstd are None unless ``statistics`` (a backward to come)."""
    # The kernels read and write dense rows of ``width``: any contiguous tensor is those rows.
    width = x.shape[-1]
    x = x.contiguous()
    rows = x.numel() // width
    plan = _forward_plan(
        *_hashable(rows, width),
        x.dtype,
        None if residual is None else residual.dtype,
        residual_in_fp32,
        weight is not None,
        bias is not None,
        dropout_p > 0.0,
        statistics,
        triton_common.use_gpu_tiles(),
    )
    like = triton_common.new_output_like
    y = like(x, plan.y_buffer, torch.contiguous_format)  # x's shape, dense rows
    h = like(x, plan.h_buffer, torch.contiguous_format)
    mean = rstd = None
    if statistics:
        mean = triton_common.new_output((rows,), torch.float32, x.device)
        rstd = triton_common.new_output((rows,), torch.float32, x.device)
    _FORWARD(
        x.device,
        (-(-rows // plan.block_m), 1, 1),
        (
            x,
            None if residual is None else residual.contiguous(),
            None if weight is None else weight.contiguous(),
            None if bias is None else bias.contiguous(),
            y,
            h,
            mean,
            rstd,
            seed,
            rows,
            width,
            eps,
            dropout_p,
        ),
        plan.options,
    )
    if plan.cast:
        y, h = triton_common.as_dtype(y, x.dtype), triton_common.as_dtype(h, plan.h_dtype)
    return y, h, mean, rstd


class _BackwardPlan(NamedTuple):
    block_m: int
    most_programs: int  # the grid's programs at most (_most_backward_programs)
    options: dict
    dx_buffer: torch.dtype
    dh_buffer: torch.dtype
    sums_dtype: torch.dtype  # dweight's and dbias's (_sums_dtype)
    cast: bool  # dx or dh is not in its output's dtype (bf16 under the interpreter)


@functools.lru_cache(maxsize=4096)
def _backward_plan(
    rows, width, dy_dtype, h_dtype, weight_dtype, dh_out, residual, bias, dropout, device, gpu
) -> _BackwardPlan:
    dx_buffer, dh_buffer = map(triton_common.kernel_output_dtype, (dy_dtype, h_dtype))
    block_m, options = _tiled_options(
        rows,
        width,
        gpu,
        HAS_DH_OUT=dh_out,
        HAS_RESIDUAL=residual,
        HAS_WEIGHT=weight_dtype is not None,
        HAS_BIAS=bias,
        HAS_DROPOUT=dropout,
    )
    sums_dtype = _sums_dtype(weight_dtype)
    cast = (dx_buffer, dh_buffer) != (dy_dtype, h_dtype)
    most_programs = _most_backward_programs(device)
    return _BackwardPlan(block_m, most_programs, options, dx_buffer, dh_buffer, sums_dtype, cast)


def _launch_backward(dy, dh_out, h, weight, mean, rstd, seed, dropout_p, has_residual, has_bias):
    width = h.shape[-1]
    rows = mean.shape[0]
    plan = _backward_plan(
        *_hashable(rows, width),
        dy.dtype,
        h.dtype,
        None if weight is None else weight.dtype,
        dh_out is not None,
        has_residual,
        has_bias,
        dropout_p > 0.0,
        h.device,
        triton_common.use_gpu_tiles(),
    )
    programs = min(-(-rows // plan.block_m), plan.most_programs)
    like, new = triton_common.new_output_like, triton_common.new_output
    dx = like(h, plan.dx_buffer, torch.contiguous_format)  # h's shape, dense rows
    dh = like(h, plan.dh_buffer, torch.contiguous_format) if has_residual else None
    dweight_partial = None if weight is None else new((programs, width), torch.float32, h.device)
    dbias_partial = new((programs, width), torch.float32, h.device) if has_bias else None
    _BACKWARD(
        h.device,
        (programs, 1, 1),
        (
            dy.contiguous(),  # dense rows, as in the forward
            None if dh_out is None else dh_out.contiguous(),
            h.contiguous(),
            None if weight is None else weight.contiguous(),
            mean,
            rstd,
            seed,
            dx,
            dh,
            dweight_partial,
            dbias_partial,
            rows,
            width,
            dropout_p,
        ),
        plan.options,
    )
    if plan.cast:
        dx = triton_common.as_dtype(dx, dy.dtype)
        dh = None if dh is None else triton_common.as_dtype(dh, h.dtype)
    dweight, dbias = _sum_partials(dweight_partial, dbias_partial, plan.sums_dtype)
    return dx, dh, dweight, dbias


# The partial sums' tiles: (rows, columns) a program loads at a time, 16 values per thread and
# tensor in 4 warps; a program per 32 columns (16 programs for a width of 512).
_SUM_TILE = (128, 32)


def _sums_dtype(weight_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of dweight and dbias: the weight's, so that autograd casts neither (a launch
    each on a GPU); fp32 without a weight (None)."""
    return torch.float32 if weight_dtype is None else weight_dtype


@functools.lru_cache(maxsize=64)
def _sums_plan(weight: bool, bias: bool, dtype: torch.dtype) -> tuple[dict, torch.dtype]:
    """(options, the sums' buffer dtype) of a launch of the partial sums' kernel."""
    options = triton_common.launch_options(
        HAS_WEIGHT=weight, HAS_BIAS=bias, BLOCK_P=_SUM_TILE[0], BLOCK=_SUM_TILE[1], num_warps=4
    )
    return options, triton_common.kernel_output_dtype(dtype)


def _sum_partials(dweight_partial, dbias_partial, dtype: torch.dtype):
    """(dweight, dbias) (N,) in ``dtype`` from the backward programs' fp32 partial sums (each
    None if there is no such parameter), in one launch."""
    partial = dweight_partial if dweight_partial is not None else dbias_partial
    if partial is None:
        return None, None
    programs, width = partial.shape
    options, buffer = _sums_plan(dweight_partial is not None, dbias_partial is not None, dtype)
    new = triton_common.new_output
    dweight = None if dweight_partial is None else new((width,), buffer, partial.device)
    dbias = None if dbias_partial is None else new((width,), buffer, partial.device)
    _SUM_PARTIALS(
        partial.device,
        (-(-width // _SUM_TILE[1]), 1, 1),
        (dweight_partial, dbias_partial, dweight, dbias, programs, width),
        options,
    )
    if buffer != dtype:  # bf16 under the interpreter
        dweight = None if dweight is None else dweight.to(dtype)
        dbias = None if dbias is None else dbias.to(dtype)
    return dweight, dbias


def _backward(dy, dh_out, h, weight, mean, rstd, seed, dropout_p, has_residual, has_bias):
    """(dx, dresidual, dweight, dbias), the sums in fp32 and returned in the weight's dtype (fp32
    without a weight); empty where there is no such input."""
    dx, dh, dweight, dbias = _launch_backward(
        dy, dh_out, h, weight, mean, rstd, seed, dropout_p, has_residual, has_bias
    )
    dtype = _sums_dtype(None if weight is None else weight.dtype)
    return (
        dx,
        h.new_empty(0) if dh is None else dh,
        h.new_empty(0, dtype=dtype) if dweight is None else dweight,
        h.new_empty(0, dtype=dtype) if dbias is None else dbias,
    )
