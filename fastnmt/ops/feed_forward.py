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
  without dropout there is nothing to fuse, and the activation is aten's (in place where it has
  that form) with aten's autograd: fewer host steps than a Triton launch and a Python backward;
- fused GEMM: one Triton GEMM kernel (fp32 accumulator, grouped program order, block sizes by the
  rule of ``gemm_config``, no per-shape autotuning) runs every product; its epilogue adds the
  bias, and for ``a`` applies activation + dropout in the forward and ``* keep / (1-p) * act'(a)``
  on ``dz`` in the backward. Chosen by ``feed_forward_triton(..., fused_gemm=True)`` or, for every
  call, by the environment variable ``FASTNMT_FFN_FUSED_GEMM=1``.

The fused path saves one write and read of the (M, F) pre-activation but trades cuBLAS's GEMMs for
Triton's, so the default is the library path, the one that cannot be much slower than PyTorch's own
Linear layers. ``benchmarks/ops/bench_feed_forward.py`` (rows "fused GEMM" against "library GEMM",
forward and forward + backward, fp16 / bf16 / fp32) shows the shapes where the fused path is faster.

Saved for the backward (both paths): x, W1, W2, z (needed for dW2 anyway) and the dropout seed;
the mask is regenerated, never stored. ReLU needs nothing more: z != 0 exactly where a > 0 and
the element was kept, so da = [z != 0] dz / (1-p). GELU's and SiLU's a cannot be read back from
z (neither is one-to-one for a < 0, and dropout zeroes z), so they also store the pre-activation
a (one (M, F) tensor in the input dtype) rather than recomputing it, which would cost another
M*K*F GEMM in the backward (a third more backward FLOPs) to save M*F elements of memory.

The Triton kernels and their launchers are in ``fastnmt.ops.triton.feed_forward``, the C++ ones in
csrc/feed_forward.cpp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastnmt.ops import checks, dispatch, registration, settings
from fastnmt.ops.triton import common as triton_common
from fastnmt.ops.triton.feed_forward import (
    _launch_backward,
    _launch_forward,
    _saves_preactivation,
    library_feed_forward,
)

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}
# Other names the public API accepts, replaced before dispatch so that every backend knows one name
# per activation: Hugging Face's configs (Marian / Opus-MT) call SiLU "swish".
ACTIVATION_ALIASES = {"swish": "silu"}


# ---------------------------------------------------------------------------------------------
# PyTorch reference: Linear, activation, Dropout, Linear.
# ---------------------------------------------------------------------------------------------


def feed_forward_reference(x, w1, b1, w2, b2, activation, dropout_p, dropout_seed=None):
    """Its dropout draws from torch's generator (``dropout_seed`` keys the fused kernels')."""
    hidden = ACTIVATIONS[activation](F.linear(x, w1, b1))  # (..., F)
    if dropout_p > 0.0:
        hidden = F.dropout(hidden, p=dropout_p)
    return F.linear(hidden, w2, b2)  # (..., N)


_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# The path is a constant of a compiled graph.
@dispatch.assume_constant_result
def fused_gemm_requested() -> bool:
    """Whether ``FASTNMT_FFN_FUSED_GEMM=1`` (``fastnmt.ops.settings``, read at import) asks for
    the fused-GEMM path on every call."""
    return settings.ffn_fused_gemm


# ---------------------------------------------------------------------------------------------
# Registered ops (torch.library) with autograd.
# ---------------------------------------------------------------------------------------------


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
        if not fused_gemm and dropout_p == 0.0:
            return library_feed_forward(x, w1, b1, w2, b2, activation)
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
