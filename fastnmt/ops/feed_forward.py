r"""Position-wise feed-forward block: ``feed_forward(x, w1, b1, w2, b2, activation, dropout_p)``.

Math, for x (M, K) (all leading dimensions flattened into M tokens), W1 (F, K), W2 (N, F):

    a = x W1^T + b1            (M, F)   pre-activation
    z = act(a) * keep / (1-p)  (M, F)   act = ReLU, GELU (erf form, as nn.GELU()) or SiLU
    y = z W2^T + b2            (M, N)

Backward, given dy:

    dW2 = dy^T z,  db2 = sum_rows dy,  dz = dy W2
    da  = dz * keep / (1-p) * act'(a)         ReLU: act' = [a > 0]; GELU: Phi(a) + a phi(a);
                                              SiLU: below
    dW1 = da^T x,  db1 = sum_rows da,  dx = da W1

SiLU (Hugging Face's "swish", which the public API accepts as an alias) is act(a) = a s(a) with
s = sigmoid(a) = 1 / (1 + e^-a). As s' = s (1 - s):

    act'(a) = s + a s (1 - s) = s (1 + a (1 - s))

Weights use ``nn.Linear``'s (out_features, in_features) layout so a module's parameters pass as
they are. The Triton backend has two paths:

- library GEMM (the default): ``torch.matmul``/``addmm`` for the products and one fused
  elementwise Triton kernel for activation + dropout (forward) and its derivative (backward);
  without a backward to come and without dropout (decoding), the activation is aten's, in
  place: there is nothing to fuse, and an aten call costs less host time than a Triton launch;
- fused GEMM: one Triton GEMM kernel (fp32 accumulator, grouped program order, block sizes by the
  rule of ``gemm_config``, no per-shape autotuning) runs every product; its epilogue adds the
  bias, and for ``a`` applies activation + dropout in the forward and ``* keep / (1-p) * act'(a)``
  on ``dz`` in the backward. Chosen by ``feed_forward_triton(..., fused_gemm=True)`` or, for every
  call, by the environment variable ``FASTNMT_FFN_FUSED_GEMM=1``.

The fused path saves one write and read of the (M, F) pre-activation but trades cuBLAS's GEMMs for
Triton's. Which wins has not been measured on a GPU yet, so the default is the library path, the
one that cannot be much slower than PyTorch's own Linear layers. The benchmark that decides it is
``benchmarks/ops/bench_feed_forward.py`` (rows "fused GEMM" against "library GEMM", forward and
forward + backward, fp16 / bf16 / fp32, on an A100 or H100); make the fused path the default at
the shapes where it is faster there.

Saved for the backward (both paths): x, W1, W2, z (needed for dW2 anyway) and the dropout seed;
the mask is regenerated, never stored. ReLU needs nothing more: z != 0 exactly where a > 0 and
the element was kept, so da = [z != 0] dz / (1-p). GELU's and SiLU's a cannot be read back from
z (neither is one-to-one for a < 0, and dropout zeroes z), so they also store the pre-activation
a (one (M, F) tensor in the input dtype) rather than recomputing it, which would cost another
M*K*F GEMM in the backward (a third more backward FLOPs) to save M*F elements of memory.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fastnmt.ops import checks, dispatch, registration, settings
from fastnmt.ops.add_layer_norm import apply_dropout
from fastnmt.ops.triton import common as triton_common
from fastnmt.ops.triton import tl, triton

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}
# Other names the public API accepts, replaced before dispatch so that every backend knows one name
# per activation: Hugging Face's configs (Marian / Opus-MT) call SiLU "swish".
ACTIVATION_ALIASES = {"swish": "silu"}


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
# PyTorch reference: Linear, activation, Dropout, Linear.
# ---------------------------------------------------------------------------------------------


def feed_forward_reference(x, w1, b1, w2, b2, activation, dropout_p, dropout_seed=None):
    """Its dropout draws from torch's generator (``dropout_seed`` keys the fused kernels')."""
    hidden = ACTIVATIONS[activation](F.linear(x, w1, b1))  # (..., F)
    if dropout_p > 0.0:
        hidden = F.dropout(hidden, p=dropout_p)
    return F.linear(hidden, w2, b2)  # (..., N)


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

    K does not enter: every tile steps through it 64 at a time. The thresholds rest on no GPU
    timing yet, only on the configurations compiling without spills; benchmarks/ops/
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


_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# The path is a constant of a compiled graph.
@torch.compiler.assume_constant_result
def fused_gemm_requested() -> bool:
    """Whether ``FASTNMT_FFN_FUSED_GEMM=1`` (``fastnmt.ops.settings``, read at import) asks for
    the fused-GEMM path on every call."""
    return settings.ffn_fused_gemm


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
# Registered ops (torch.library) with autograd.
# ---------------------------------------------------------------------------------------------


def _launch_forward(x, w1, b1, w2, b2, activation, dropout_p, seed, fused_gemm):
    """(y, z, a): z and a (GELU and SiLU; empty for ReLU) are kept for the backward."""
    y, z, a = _forward(
        x.reshape(-1, x.shape[-1]), w1, b1, w2, b2, activation, dropout_p, seed, fused_gemm
    )
    return y.view(*x.shape[:-1], w2.shape[0]), z, a


# Without a backward to come and without dropout the library path has nothing to fuse: aten's
# activation, in place where it has that form, is one launch and no allocation, less host time
# than a Triton launch of the elementwise kernel (decoding makes one such call per layer a step).
_INFERENCE_ACTIVATIONS = {
    "relu": functools.partial(F.relu, inplace=True),
    "silu": functools.partial(F.silu, inplace=True),
    "gelu": F.gelu,
}


def _launch_inference(x, w1, b1, w2, b2, activation, dropout_p, seed, fused_gemm):
    """(y,): the forward of a call autograd records nothing for (z and a are not kept)."""
    if fused_gemm or dropout_p > 0.0:
        return _launch_forward(x, w1, b1, w2, b2, activation, dropout_p, seed, fused_gemm)
    return (F.linear(_INFERENCE_ACTIVATIONS[activation](F.linear(x, w1, b1)), w2, b2),)


@registration.triton_library_op("fastnmt::feed_forward_triton")
def _feed_forward_op(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    activation: str,
    dropout_p: float,
    seed: torch.Tensor | None,
    fused_gemm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See ``_launch_forward``."""
    return _launch_forward(x, w1, b1, w2, b2, activation, dropout_p, seed, fused_gemm)


def _forward_fake(x, w1, b1, w2, b2, activation, dropout_p, seed, *path):
    tokens = x.numel() // x.shape[-1]
    z = x.new_empty(tokens, w1.shape[0])
    keep_a = _saves_preactivation(activation)
    a = x.new_empty(tokens, w1.shape[0]) if keep_a else x.new_empty(0)
    return x.new_empty(*x.shape[:-1], w2.shape[0]), z, a


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


@registration.triton_library_op("fastnmt::feed_forward_triton_backward")
def _feed_forward_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    seed: torch.Tensor | None,
    activation: str,
    dropout_p: float,
    fused_gemm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See ``_launch_backward``."""
    return _launch_backward(dy, x, w1, w2, z, a, seed, activation, dropout_p, fused_gemm)


def _backward_fake(dy, x, w1, w2, z, a, seed, activation, dropout_p, *path):
    return (
        x.new_empty(x.shape),
        w1.new_empty(w1.shape),
        w1.new_empty(w1.shape[0]),
        w2.new_empty(w2.shape),
        w2.new_empty(w2.shape[0]),
    )


def _setup_context(ctx, inputs, output):
    x, w1, b1, w2, b2, activation, dropout_p, seed, *path = inputs
    _, z, a = output
    ctx.save_for_backward(x, w1, w2, z, a, seed)
    ctx.activation, ctx.dropout_p = activation, dropout_p
    ctx.path = path  # the Triton ops' GEMM-path flag; the C++ ops have none
    ctx.has_bias = (b1 is not None, b2 is not None)
    # z and a are outputs only to be saved: they get no zero-filled (N, d_ff) gradients.
    ctx.set_materialize_grads(False)


def _make_backward(backward_op):
    """The autograd backward of a forward op whose backward op is ``backward_op`` (the Triton and
    C++ ops share their signatures but for the Triton ops' trailing GEMM-path flag)."""

    def backward(ctx, dy, _dz, _da):
        unused = [None] * (3 + len(ctx.path))  # activation, dropout_p, seed, path
        if dy is None:  # y was not used
            return None, None, None, None, None, *unused
        x, w1, w2, z, a, seed = ctx.saved_tensors
        dx, dw1, db1, dw2, db2 = backward_op(
            dy, x, w1, w2, z, a, seed, ctx.activation, ctx.dropout_p, *ctx.path
        )
        has_b1, has_b2 = ctx.has_bias
        return dx, dw1, db1 if has_b1 else None, dw2, db2 if has_b2 else None, *unused

    return backward


def _autocast_operands(x, w1, b1, w2, b2):
    """Under autocast, the operands in the autocast dtype, as ``F.linear`` would take them."""
    if not torch.is_autocast_enabled(x.device.type):
        return x, w1, b1, w2, b2
    dtype = torch.get_autocast_dtype(x.device.type)
    return tuple(None if t is None else t.to(dtype) for t in (x, w1, b1, w2, b2))


def _running(backend: str, forward):
    """The implementation of the op that calls ``forward`` with the forward op's arguments; on
    Triton, ``fused_gemm`` picks the path (None: the library GEMMs, unless
    ``FASTNMT_FFN_FUSED_GEMM=1``)."""
    takes_path = backend == "triton"

    def implementation(
        x, w1, b1, w2, b2, activation, dropout_p, dropout_seed=None, *, fused_gemm=None
    ):
        x, w1, b1, w2, b2 = _autocast_operands(x, w1, b1, w2, b2)
        seed = triton_common.chosen_seed(dropout_seed, dropout_p, x.device)
        if not takes_path:
            return forward(x, w1, b1, w2, b2, activation, dropout_p, seed)[0]
        if fused_gemm is None:
            fused_gemm = fused_gemm_requested()
        return forward(x, w1, b1, w2, b2, activation, dropout_p, seed, fused_gemm)[0]

    return implementation


def _dtype_reasons(kernels: str, x, w1, b1, w2, b2):
    dtype = _autocast_operands(x, w1, b1, w2, b2)[0].dtype
    if dtype not in _SUPPORTED_DTYPES:
        yield f"x has dtype {dtype}; the {kernels} kernels take fp32, fp16 and bf16"


def _triton_unsupported(x, w1, b1, w2, b2, **_):
    yield from _dtype_reasons("Triton", x, w1, b1, w2, b2)
    if x.numel() == 0:
        yield "x is empty"


def _cpp_unsupported(x, w1, b1, w2, b2, **_):
    yield from _dtype_reasons("C++", x, w1, b1, w2, b2)


# ---------------------------------------------------------------------------------------------
# Argument checks and the registered op.
# ---------------------------------------------------------------------------------------------


def _check_linear(prefix: str, weight, bias, in_features: int, in_name: str, like, like_name):
    checks.tensor(f"w{prefix}", weight, ndim=2, floating=True)
    if weight.shape[1] != in_features:
        raise ValueError(
            f"w{prefix} must have shape (out_features, {in_features}) to take {in_name}, got "
            f"{tuple(weight.shape)}"
        )
    checks.same_device(f"w{prefix}", weight, like_name, like)
    if bias is not None:
        checks.tensor(f"b{prefix}", bias, floating=True)
        checks.shape(f"b{prefix}", bias, (weight.shape[0],), f"w{prefix}'s out_features")
        checks.same_device(f"b{prefix}", bias, like_name, like)
    if not checks.autocasting(like.device):
        checks.same_dtype(f"w{prefix}", weight, like_name, like)
        if bias is not None:
            checks.same_dtype(f"b{prefix}", bias, like_name, like)


def _activation_name(activation) -> str:
    """The name the backends know ``activation`` by (an alias replaced)."""
    allowed = sorted([*ACTIVATIONS, *ACTIVATION_ALIASES])
    if activation not in allowed:
        raise ValueError(f"activation must be one of {allowed}, got {activation!r}")
    return ACTIVATION_ALIASES.get(activation, activation)


def _prepare(x, w1, b1, w2, b2, activation="relu", dropout_p=0.0, dropout_seed=None):
    checks.tensor("x", x, floating=True)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the features)")
    _check_linear("1", w1, b1, x.shape[-1], "x's last dimension", x, "x")
    _check_linear("2", w2, b2, w1.shape[0], "w1's out_features", x, "x")
    prepared = dict(
        x=x,
        w1=w1,
        b1=b1,
        w2=w2,
        b2=b2,
        activation=_activation_name(activation),
        dropout_p=checks.probability("dropout_p", dropout_p),
        dropout_seed=checks.dropout_seed(dropout_seed, "x", x),
    )
    return x.device, prepared


FEED_FORWARD = dispatch.define("feed_forward", _prepare)
FEED_FORWARD.register("reference")(feed_forward_reference)
# The reference is PyTorch's built-ins already: the baseline fastnmt is measured against.
FEED_FORWARD.register("torch")(feed_forward_reference)
# The Triton ops and the C++ ops (same signatures but for the Triton ops' trailing GEMM-path
# flag) share their fakes; the C++ ops' autograd is in C++ (csrc/feed_forward.cpp).
registration.register_kernels(
    FEED_FORWARD,
    triton=((_feed_forward_op, _feed_forward_backward_op), (_launch_forward, _launch_backward)),
    cpp=("feed_forward_cpp", "feed_forward_cpp_backward"),
    unsupported={"triton": _triton_unsupported, "cpp": _cpp_unsupported},
    running=_running,
    forward_fake=_forward_fake,
    backward_fake=_backward_fake,
    setup_context=_setup_context,
    make_backward=_make_backward,
    inference=_launch_inference,
)
feed_forward_triton = FEED_FORWARD.implementation("triton")  # tests pick the GEMM path with it


def feed_forward(x, w1, b1, w2, b2, activation="relu", dropout_p=0.0, dropout_seed=None):
    """``Linear(w1, b1) -> activation -> dropout -> Linear(w2, b2)`` on the last dimension of x.

    Args:
        x: (..., K).
        w1, b1: (F, K) and (F,) or None; w2, b2: (N, F) and (N,) or None (nn.Linear layout).
        activation: "relu", "gelu" or "silu" (also accepted as "swish", Hugging Face's name).
        dropout_p: dropout after the activation (pass 0.0 in evaluation).
        dropout_seed: int64 (2,), one of ``fastnmt.ops.dropout_seeds``: the fused kernels'
            dropout mask is a function of it (the reference draws from torch's generator).
            Default: drawn for this call.

    Returns:
        (..., N)
    """
    return FEED_FORWARD(x, w1, b1, w2, b2, activation, dropout_p, dropout_seed)
