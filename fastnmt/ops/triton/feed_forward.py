"""The Triton kernels of ``fastnmt.ops.feed_forward`` (the math and the two paths are described
there) and their launchers: a GEMM with the bias, activation + dropout and activation-gradient
epilogues (the fused-GEMM path), the elementwise activation kernels of the library-GEMM path, and
the forward and backward of either path.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fastnmt.ops.triton import common as triton_common
from fastnmt.ops.triton import tl, triton
from fastnmt.ops.triton.add_layer_norm import apply_dropout


def _saves_preactivation(activation: str) -> bool:
    """Whether the backward reads the saved pre-activation a: ReLU's derivative shows in z."""
    return activation != "relu"


# ---------------------------------------------------------------------------------------------
# Triton kernels.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _activation(a, ACTIVATION: tl.constexpr):
    """act(a) for fp32 a: ReLU, SiLU a sigmoid(a) or GELU's erf form 0.5 a (1 + erf(a / sqrt 2))."""
    if ACTIVATION == "relu":
        return tl.maximum(a, 0.0)
    if ACTIVATION == "silu":
        return a * tl.sigmoid(a)
    return 0.5 * a * (1.0 + tl.erf(a * 0.7071067811865476))


@triton.jit
def _activation_derivative(a, ACTIVATION: tl.constexpr):
    """act'(a) for fp32 a: GELU's Phi(a) + a phi(a), or SiLU's s (1 + a (1 - s)), s = sigmoid(a)."""
    if ACTIVATION == "silu":
        s = tl.sigmoid(a)
        return s * (1.0 + a * (1.0 - s))
    cdf = 0.5 * (1.0 + tl.erf(a * 0.7071067811865476))
    pdf = tl.exp(-0.5 * a * a) * 0.3989422804014327  # 1 / sqrt(2 pi)
    return cdf + a * pdf


@triton.jit
def _activation_grad(
    dz, saved, SEED, element, dropout_p, ACTIVATION: tl.constexpr, HAS_DROPOUT: tl.constexpr
):
    """da from dz (fp32): ``saved`` is z for ReLU (z != 0 iff a > 0 and kept), else a."""
    if ACTIVATION == "relu":
        return tl.where(saved != 0.0, dz / (1.0 - dropout_p), 0.0)
    da = dz * _activation_derivative(saved, ACTIVATION)
    if HAS_DROPOUT:
        da = apply_dropout(da, SEED, element, dropout_p)
    return da


@triton.jit
def _matmul_kernel(
    A,  # (M, K) left operand, strides (stride_am, stride_ak)
    B,  # (K, N) right operand, strides (stride_bk, stride_bn): W^T of a Linear is a view
    C,  # (M, N) output, contiguous
    BIAS,  # (N,) added to every row (read when HAS_BIAS)
    SAVED,  # (M, N) contiguous: a written by the forward epilogue with SAVE_PREACTIVATION, or
    # z (ReLU) / a (GELU, SiLU) read by the "activation_grad" epilogue
    SEED,  # int64 (2,): philox seed and offset of the dropout mask (read when HAS_DROPOUT)
    M,  # rows of A and C
    N,  # columns of B and C
    K,  # the reduced dimension
    stride_am,  # A's row stride
    stride_ak,  # A's column stride (1 for x; M for a transposed gradient)
    stride_bk,  # B's row stride (1 for W^T, a view of W)
    stride_bn,  # B's column stride
    dropout_p,  # probability of dropping an element of act(a)
    EPILOGUE: tl.constexpr,  # "bias": C = AB (+ bias); "activation": C = dropout(act(AB + bias));
    # "activation_grad": C = AB * keep / (1-p) * act'(SAVED)
    ACTIVATION: tl.constexpr,  # "relu", "gelu" or "silu"
    HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    SAVE_PREACTIVATION: tl.constexpr,  # the "activation" epilogue also writes a to SAVED
    UPCAST: tl.constexpr,  # compute from fp32 copies of the loads (bf16 in the interpreter)
    INPUT_PRECISION: tl.constexpr,  # tl.dot's: "ieee", or "tf32" where torch allows it for fp32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,  # row tiles per group: programs of a group share B's columns in L2
):
    # Grouped order (Triton's matmul tutorial): consecutive programs walk down GROUP_M row tiles
    # before moving to the next column tile, so they reuse the same B tiles from L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_m
    pid_n = (pid % (GROUP_M * tiles_n)) // group_m

    row = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    column = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    a_tile = A + row[:, None].to(tl.int64) * stride_am + depth[None, :] * stride_ak
    b_tile = B + depth[:, None] * stride_bk + column[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        left = K - k * BLOCK_K
        a = tl.load(a_tile, mask=(row[:, None] < M) & (depth[None, :] < left), other=0.0)
        b = tl.load(b_tile, mask=(depth[:, None] < left) & (column[None, :] < N), other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_tile += BLOCK_K * stride_ak
        b_tile += BLOCK_K * stride_bk

    inside = (row[:, None] < M) & (column[None, :] < N)
    element = row[:, None].to(tl.int64) * N + column[None, :]  # also the dropout index
    if HAS_BIAS:
        acc += tl.load(BIAS + column, mask=column < N, other=0.0).to(tl.float32)[None, :]
    p = tl.cast(dropout_p, tl.float32)
    if EPILOGUE == "activation":
        if SAVE_PREACTIVATION:
            tl.store(SAVED + element, acc.to(SAVED.dtype.element_ty), mask=inside)
        acc = _activation(acc, ACTIVATION)
        if HAS_DROPOUT:
            acc = apply_dropout(acc, SEED, element, p)
    elif EPILOGUE == "activation_grad":
        saved = tl.load(SAVED + element, mask=inside, other=0.0).to(tl.float32)
        acc = _activation_grad(acc, saved, SEED, element, p, ACTIVATION, HAS_DROPOUT)
    tl.store(C + element, acc.to(C.dtype.element_ty), mask=inside)


@triton.jit
def _activation_forward_kernel(
    A,  # (M, F) pre-activation, contiguous
    Z,  # (M, F) output dropout(act(a)), contiguous
    SEED,  # int64 (2,): philox seed and offset of the dropout mask (read when HAS_DROPOUT)
    numel,  # M * F
    dropout_p,  # probability of dropping an element of act(a)
    ACTIVATION: tl.constexpr,  # "relu", "gelu" or "silu"
    HAS_DROPOUT: tl.constexpr,
    BLOCK: tl.constexpr,  # elements per program
):
    element = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # row * F + column
    inside = element < numel
    z = _activation(tl.load(A + element, mask=inside, other=0.0).to(tl.float32), ACTIVATION)
    if HAS_DROPOUT:
        z = apply_dropout(z, SEED, element, tl.cast(dropout_p, tl.float32))
    tl.store(Z + element, z.to(Z.dtype.element_ty), mask=inside)


@triton.jit
def _activation_backward_kernel(
    DZ,  # (M, F) gradient of z, contiguous
    SAVED,  # (M, F) z for ReLU, a for GELU and SiLU, contiguous
    DA,  # (M, F) output: gradient of the pre-activation a, contiguous
    SEED,  # int64 (2,): the forward's dropout seed and offset (read when HAS_DROPOUT)
    numel,  # M * F
    dropout_p,  # probability of dropping an element of act(a)
    ACTIVATION: tl.constexpr,  # "relu", "gelu" or "silu"
    HAS_DROPOUT: tl.constexpr,
    BLOCK: tl.constexpr,  # elements per program
):
    element = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # row * F + column
    inside = element < numel
    dz = tl.load(DZ + element, mask=inside, other=0.0).to(tl.float32)
    saved = tl.load(SAVED + element, mask=inside, other=0.0).to(tl.float32)
    p = tl.cast(dropout_p, tl.float32)
    da = _activation_grad(dz, saved, SEED, element, p, ACTIVATION, HAS_DROPOUT)
    tl.store(DA + element, da.to(DA.dtype.element_ty), mask=inside)


# ---------------------------------------------------------------------------------------------
# Launchers: block sizes by rule, and the choice of path.
# ---------------------------------------------------------------------------------------------

# Tile shapes for translation models' GEMMs (M = 1k-16k tokens, K and N = d_model 256-1024 or
# d_ff 1024-4096). Each holds at most 32 fp32 accumulator values per thread: the epilogue's philox
# dropout (four 32-bit lanes per element) and GELU keep several more values live per element, and
# 64 per thread (128 x 128 on 8 warps, 128 x 256, or 4 warps on 128 x 64) spill on sm_80/sm_90
# when the operands are not known to be 16-byte aligned (fastnmt.compile_check).
_GPU_CONFIGS = (
    triton_common.LaunchConfig(128, 64, 8, 3, block_k=64, group_m=8),  # many rows
    triton_common.LaunchConfig(64, 128, 8, 3, block_k=64, group_m=8),  # fewer rows, wide outputs
    triton_common.LaunchConfig(64, 64, 4, 3, block_k=64, group_m=8),  # fewer rows, narrow outputs
)
_TALL, _WIDE, _SMALL = _GPU_CONFIGS
# The interpreter's cost grows with the number of programs: one large tile.
_INTERPRETER_CONFIG = triton_common.LaunchConfig(128, 128, 4, 1, block_k=64, group_m=2)
_MANY_ROWS = 2048  # from here on, 128-row tiles still give 16 or more row blocks
_NARROW = 128  # outputs this narrow would leave half of a 128-column tile empty


def gemm_config(m: int, n: int) -> triton_common.LaunchConfig:
    """The GEMM kernel's launch configuration for an (m, n) output, by a fixed rule rather than
    autotuning: M changes with every token bucket and beam step, and autotuning would re-benchmark
    every new M. M in two buckets, then N:

    - m >= ``_MANY_ROWS`` (training batches, the weight gradients' d_ff rows): 128 x 64 tiles,
      which load fewer operand bytes per output element than 64 x 64 and still give 16+ row blocks;
    - fewer rows (decoding steps, small batches) and n > ``_NARROW``: 64 x 128, the same reuse
      with half as many rows of padding;
    - fewer rows and narrow outputs: 64 x 64.

    K does not enter: every tile steps through it 64 at a time. The thresholds rest on the
    configurations compiling without spills, not on GPU timings; benchmarks/ops/
    bench_feed_forward.py (fused GEMM rows) is where to check them.
    """
    if not triton_common.use_gpu_tiles():
        return _INTERPRETER_CONFIG
    if m >= _MANY_ROWS:
        return _TALL
    return _WIDE if n > _NARROW else _SMALL


def _programs(config: triton_common.LaunchConfig, m: int, n: int) -> int:
    cdiv = triton_common.cdiv
    return cdiv(m, config.block_m) * cdiv(n, config.block_n)


_GPU_ELEMENTWISE_BLOCK = 1024  # elements per program of the activation kernels
_INTERPRETER_ELEMENTWISE_BLOCK = 4096


def _elementwise_block() -> int:
    return (
        _GPU_ELEMENTWISE_BLOCK if triton_common.use_gpu_tiles() else _INTERPRETER_ELEMENTWISE_BLOCK
    )


def _output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A kernel's output buffer for ``dtype`` data (fp32 where the interpreter upcasts bf16)."""
    return triton_common.new_output(shape, triton_common.kernel_output_dtype(dtype), device)


@functools.lru_cache(maxsize=1024)
def _matmul_options(
    config, epilogue, activation, has_bias, has_dropout, save_preactivation, dtype, precision
) -> dict:
    return triton_common.launch_options(
        EPILOGUE=epilogue,
        ACTIVATION=activation,
        HAS_BIAS=has_bias,
        HAS_DROPOUT=has_dropout,
        SAVE_PREACTIVATION=save_preactivation,
        UPCAST=triton_common.upcast_in_interpreter(dtype),
        INPUT_PRECISION=precision,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


_MATMUL = triton_common.Launcher(_matmul_kernel)
_ACTIVATION_FORWARD = triton_common.Launcher(_activation_forward_kernel)
_ACTIVATION_BACKWARD = triton_common.Launcher(_activation_backward_kernel)


def _matmul_launch(
    a,
    b,
    bias=None,
    *,
    epilogue="bias",
    saved=None,
    seed=None,
    activation="relu",
    dropout_p=0.0,
    save_preactivation=False,
):
    """a (M, K) @ b (K, N) (+ bias) with ``_matmul_kernel``'s epilogue; any strides."""
    (m, k), n = a.shape, b.shape[1]
    c = _output((m, n), a.dtype, a.device)
    bias = None if bias is None else bias.contiguous()
    config = gemm_config(m, n)
    _MATMUL(
        a.device,
        (_programs(config, m, n), 1, 1),
        (a, b, c, bias, saved, seed, m, n, k, *a.stride(), *b.stride(), dropout_p),
        _matmul_options(
            config, epilogue, activation, bias is not None, dropout_p > 0.0, save_preactivation,
            a.dtype, triton_common.dot_precision(a.dtype),
        ),
    )  # fmt: skip
    return triton_common.as_dtype(c, a.dtype)


def _elementwise_launch(launcher, inputs, dtype, seed, activation, dropout_p):
    """Runs an activation kernel over contiguous (M, F) ``inputs``; returns its output."""
    out = _output(inputs[0].shape, dtype, inputs[0].device)
    numel, block = out.numel(), _elementwise_block()
    launcher(
        out.device,
        (triton_common.cdiv(numel, block), 1, 1),
        (*inputs, out, seed, numel, dropout_p),
        triton_common.launch_options(
            ACTIVATION=activation, HAS_DROPOUT=dropout_p > 0.0, BLOCK=block
        ),
    )
    return triton_common.as_dtype(out, dtype)


def _forward(x2, w1, b1, w2, b2, activation, dropout_p, seed, fused_gemm):
    """(y, z, a) for x2 (M, K); a is empty for ReLU, whose backward needs z only."""
    keep_a = _saves_preactivation(activation)
    if fused_gemm:
        a = _output((x2.shape[0], w1.shape[0]), x2.dtype, x2.device) if keep_a else None
        z = _matmul_launch(
            x2,
            w1.t(),
            b1,
            epilogue="activation",
            saved=a,
            seed=seed,
            activation=activation,
            dropout_p=dropout_p,
            save_preactivation=keep_a,
        )
        a = triton_common.as_dtype(a, x2.dtype) if keep_a else None
        y = _matmul_launch(z, w2.t(), b2)
    else:
        a = F.linear(x2, w1, b1).contiguous()
        z = _elementwise_launch(_ACTIVATION_FORWARD, (a,), x2.dtype, seed, activation, dropout_p)
        y = F.linear(z, w2, b2)
    return y, z, a if keep_a else x2.new_empty(0)


def _backward(dy2, x2, w1, w2, z, a, seed, activation, dropout_p, fused_gemm):
    """(dx, dW1, db1, dW2, db2) for flattened dy2 (M, N) and x2 (M, K)."""
    saved = a if _saves_preactivation(activation) else z
    if fused_gemm:
        da = _matmul_launch(
            dy2,
            w2,
            epilogue="activation_grad",
            saved=saved,
            seed=seed,
            activation=activation,
            dropout_p=dropout_p,
        )
        dw2, dw1, dx = (
            _matmul_launch(dy2.t(), z),
            _matmul_launch(da.t(), x2),
            _matmul_launch(da, w1),
        )
    else:
        dz = (dy2 @ w2).contiguous()
        da = _elementwise_launch(
            _ACTIVATION_BACKWARD, (dz, saved), dz.dtype, seed, activation, dropout_p
        )
        dw2, dw1, dx = dy2.t() @ z, da.t() @ x2, da @ w1
    return dx, dw1, da.sum(0), dw2, dy2.sum(0)


# ---------------------------------------------------------------------------------------------
# The launchers of the registered ops (fastnmt.ops.feed_forward): any leading dimensions.
# ---------------------------------------------------------------------------------------------


def _launch_forward(x, w1, b1, w2, b2, activation, dropout_p, seed, fused_gemm):
    """(y, z, a): z and a (GELU and SiLU; empty for ReLU) are kept for the backward."""
    y, z, a = _forward(
        x.reshape(-1, x.shape[-1]), w1, b1, w2, b2, activation, dropout_p, seed, fused_gemm
    )
    return y.view(*x.shape[:-1], w2.shape[0]), z, a


# aten's activations, in place where they have that form (autograd takes it: relu's backward
# reads its output, and silu_'s keeps its input).
_ATEN_ACTIVATIONS = {
    "relu": functools.partial(F.relu, inplace=True),
    "silu": functools.partial(F.silu, inplace=True),
    "gelu": F.gelu,
}


def library_feed_forward(x, w1, b1, w2, b2, activation):
    """The library path without dropout, which has nothing to fuse: two library GEMMs around
    aten's activation (one launch, no allocation where in place), with aten's own autograd. The
    Triton activation kernels compute the same, at the cost of a Triton launch each way and a
    backward in Python: in training without dropout and in decoding (a call per layer a step)
    they would only add host time."""
    return F.linear(_ATEN_ACTIVATIONS[activation](F.linear(x, w1, b1)), w2, b2)


def _launch_backward(dy, x, w1, w2, z, a, seed, activation, dropout_p, fused_gemm):
    """(dx, dW1, db1, dW2, db2)."""
    dx, dw1, db1, dw2, db2 = _backward(
        dy.reshape(-1, dy.shape[-1]),
        x.reshape(-1, x.shape[-1]),
        w1,
        w2,
        z,
        a,
        seed,
        activation,
        dropout_p,
        fused_gemm,
    )
    return dx.view(x.shape), dw1, db1, dw2, db2
