r"""Residual add + LayerNorm with dropout: ``y, h = add_layer_norm(x, residual, weight, ...)``.

Math, per row of width N (statistics in fp32):

    h    = residual + dropout(x)       dropout(x) = x * keep / (1 - p); no residual: h = dropout(x)
    mu   = mean(h),   var = mean((h - mu)^2),   rstd = 1 / sqrt(var + eps)
    xhat = (h - mu) * rstd
    y    = xhat * weight + bias

Backward, given dy and the gradient dh_out flowing into the returned h (pre-norm stacks use it):

    g    = dy * weight
    dh   = rstd * (g - mean(g) - xhat * mean(g * xhat)) + dh_out
    dx   = dh * keep / (1 - p),    dresidual = dh
    dweight = sum_rows dy * xhat,  dbias = sum_rows dy

Both Transformer layouts use it: post-norm ``x, _ = add_layer_norm(sublayer(x), x, ...)``,
pre-norm ``y, h = add_layer_norm(sublayer(y), h, ...)`` and then ``sublayer(y)``.

In int8 inference (``fastnmt.quantize``) a sublayer's last GEMM may hand over its output rows
unfinished, ``UnscaledRows``: x = values * scales[:, None] + bias, which
``add_unscaled_layer_norm`` (C++) finishes in its own pass over the rows, as it adds them.

The Triton kernels and their launchers are in ``fastnmt.ops.triton.add_layer_norm``, the C++ ones in
csrc/add_layer_norm.cpp.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fastnmt.ops import checks, dispatch, registration
from fastnmt.ops.triton import common as triton_common
from fastnmt.ops.triton.add_layer_norm import (
    MAX_WIDTH,
    _backward,
    _h_dtype,
    _launch_forward,
    _sums_dtype,
)

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# PyTorch reference: dropout, add and LayerNorm as three separate passes.
# ---------------------------------------------------------------------------------------------


def add_layer_norm_reference(
    x, residual, weight, bias, eps, dropout_p, residual_in_fp32, dropout_seed=None
):
    """Its dropout draws from torch's generator (``dropout_seed`` keys the fused kernels')."""
    h = F.dropout(x, p=dropout_p) if dropout_p > 0.0 else x
    if residual_in_fp32:
        h = h.float()
    if residual is not None:
        h = residual + h
    norm_weight = None if weight is None else weight.to(h.dtype)
    norm_bias = None if bias is None else bias.to(h.dtype)
    y = F.layer_norm(h, h.shape[-1:], norm_weight, norm_bias, eps)
    return y.to(x.dtype), h


# ---------------------------------------------------------------------------------------------
# Registered ops (torch.library) with autograd, the dispatch entry and the public function.
# ---------------------------------------------------------------------------------------------


@registration.triton_library_op("fastnmt::add_layer_norm_triton")
def _add_layer_norm_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    dropout_p: float,
    residual_in_fp32: bool,
    seed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h, mean, rstd); seed: ``triton_common.dropout_seed`` when dropout_p > 0."""
    return _launch_forward(x, residual, weight, bias, eps, dropout_p, residual_in_fp32, seed)


def _forward_fake(x, residual, weight, bias, eps, dropout_p, residual_in_fp32, seed):
    rows = x.numel() // x.shape[-1]
    statistics = x.new_empty(rows, dtype=torch.float32)
    h = x.new_empty(
        x.shape,
        dtype=_h_dtype(x.dtype, None if residual is None else residual.dtype, residual_in_fp32),
    )
    return x.new_empty(x.shape), h, statistics, torch.empty_like(statistics)


@registration.triton_library_op("fastnmt::add_layer_norm_triton_backward")
def _add_layer_norm_backward_op(
    dy: torch.Tensor,
    dh_out: torch.Tensor | None,
    h: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    seed: torch.Tensor | None,
    dropout_p: float,
    has_residual: bool,
    has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See ``_backward``."""
    return _backward(dy, dh_out, h, weight, mean, rstd, seed, dropout_p, has_residual, has_bias)


def _backward_fake(dy, dh_out, h, weight, mean, rstd, seed, dropout_p, has_residual, has_bias):
    dtype = _sums_dtype(None if weight is None else weight.dtype)
    dweight, dbias = (
        h.new_empty(h.shape[-1] if wanted else 0, dtype=dtype)
        for wanted in (weight is not None, has_bias)
    )
    dh = h.new_empty(h.shape if has_residual else (0,))
    return dy.new_empty(h.shape), dh, dweight, dbias


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, _, dropout_p, _, seed = inputs
    _, h, mean, rstd = output
    ctx.save_for_backward(h, weight, mean, rstd, seed)
    ctx.dropout_p = dropout_p
    ctx.x_dtype = x.dtype
    ctx.has_residual = residual is not None
    ctx.bias_dtype = None if bias is None else bias.dtype
    # Post-norm stacks drop h: no zero-filled gradient is materialised for it.
    ctx.set_materialize_grads(False)


def _make_backward(backward_op):
    """The autograd backward of a forward op whose backward op is ``backward_op`` (the Triton and
    C++ ops share their signatures)."""

    def backward(ctx, dy, dh_out, _dmean, _drstd):
        h, weight, mean, rstd, seed = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(h, dtype=ctx.x_dtype)
        dx, dh, dweight, dbias = backward_op(
            dy,
            dh_out,
            h,
            weight,
            mean,
            rstd,
            seed,
            ctx.dropout_p,
            ctx.has_residual,
            ctx.bias_dtype is not None,
        )
        return (
            dx,
            dh if ctx.has_residual else None,
            None if weight is None else dweight,  # in the weight's dtype already
            # the weight's dtype too (fp32 without a weight): a bias of its own dtype is cast
            None if ctx.bias_dtype is None else triton_common.as_dtype(dbias, ctx.bias_dtype),
            None,
            None,
            None,
            None,
        )

    return backward


def _argument_dtype_reasons(kernels: str, **tensors):
    for name, tensor in tensors.items():
        if tensor is not None and tensor.dtype not in _SUPPORTED_DTYPES:
            yield f"{name} has dtype {tensor.dtype}; the {kernels} kernels take fp32, fp16 and bf16"


def _triton_unsupported(x, residual, weight, bias, **_):
    yield from _argument_dtype_reasons("Triton", x=x, residual=residual, weight=weight, bias=bias)
    if x.shape[-1] > MAX_WIDTH:
        yield f"width {x.shape[-1]} > {MAX_WIDTH}: a row must fit one Triton tile"
    if x.numel() == 0:
        yield "x is empty"


def _running(_backend: str, forward):
    """The implementation of the op that calls ``forward`` with the forward op's arguments."""

    def implementation(x, residual, weight, bias, eps, dropout_p, residual_in_fp32, dropout_seed):
        seed = triton_common.chosen_seed(dropout_seed, dropout_p, x.device)
        y, h, _, _ = forward(x, residual, weight, bias, eps, dropout_p, residual_in_fp32, seed)
        return y, h

    return implementation


def _cpp_unsupported(x, residual, weight, bias, **_):
    yield from _argument_dtype_reasons("C++", x=x, residual=residual, weight=weight, bias=bias)


# ---------------------------------------------------------------------------------------------
# Argument checks and the registered op.
# ---------------------------------------------------------------------------------------------


def _prepare(
    x,
    residual=None,
    weight=None,
    bias=None,
    eps=1e-5,
    dropout_p=0.0,
    residual_in_fp32=False,
    dropout_seed=None,
):
    checks.tensor("x", x, floating=True)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the normalized width)")
    if residual is not None:
        checks.tensor("residual", residual, floating=True)
        checks.shape("residual", residual, tuple(x.shape), "the shape of x")
        checks.same_device("residual", residual, "x", x)
        expected = torch.float32 if residual_in_fp32 else x.dtype
        # Under autocast the residual stream stays fp32 while sublayer outputs are half.
        if residual.dtype != expected and not checks.autocasting(x.device):
            raise TypeError(
                f"residual must have dtype {expected} (residual_in_fp32={residual_in_fp32}), "
                f"got {residual.dtype}"
            )
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None:
            checks.tensor(name, param, floating=True)
            checks.shape(name, param, (x.shape[-1],), "the last dimension of x")
            checks.same_device(name, param, "x", x)
    prepared = dict(
        x=x,
        residual=residual,
        weight=weight,
        bias=bias,
        eps=checks.positive("eps", eps),
        dropout_p=checks.probability("dropout_p", dropout_p),
        residual_in_fp32=bool(residual_in_fp32),
        dropout_seed=checks.dropout_seed(dropout_seed, "x", x),
    )
    return x.device, prepared


ADD_LAYER_NORM = dispatch.define("add_layer_norm", _prepare)
ADD_LAYER_NORM.register("reference")(add_layer_norm_reference)
# The reference is PyTorch's built-ins already: the baseline fastnmt is measured against.
ADD_LAYER_NORM.register("torch")(add_layer_norm_reference)
# The Triton ops and the C++ ops (same signatures) share their fakes; the C++ ops' autograd is in
# C++ (csrc/add_layer_norm.cpp).
registration.register_kernels(
    ADD_LAYER_NORM,
    triton=((_add_layer_norm_op, _add_layer_norm_backward_op), (_launch_forward, _backward)),
    cpp=("add_layer_norm_cpp", "add_layer_norm_cpp_backward"),
    unsupported={"triton": _triton_unsupported, "cpp": _cpp_unsupported},
    running=_running,
    forward_fake=_forward_fake,
    backward_fake=_backward_fake,
    setup_context=_setup_context,
    make_backward=_make_backward,
    inference=functools.partial(_launch_forward, statistics=False),  # a C call, no frame
)


def add_layer_norm(
    x,
    residual=None,
    weight=None,
    bias=None,
    eps=1e-5,
    dropout_p=0.0,
    residual_in_fp32=False,
    dropout_seed=None,
):
    """``h = residual + dropout(x)``, ``y = LayerNorm(h)``; returns ``(y, h)``.

    Args:
        x: (..., N) the sublayer output.
        residual: same shape as x, or None (then h = dropout(x)); dtype of x, or fp32 with
            ``residual_in_fp32``.
        weight, bias: (N,) LayerNorm affine parameters, or None.
        eps: added to the variance.
        dropout_p: dropout on x before the add (pass 0.0 in evaluation).
        residual_in_fp32: keep h in fp32 (pre-norm stacks in half precision).
        dropout_seed: int64 (2,), one of ``fastnmt.ops.dropout_seeds``: the fused kernels'
            dropout mask is a function of it (the reference draws from torch's generator).
            Default: drawn for this call.

    Returns:
        y with x's dtype, and h (fp32 with ``residual_in_fp32``).
    """
    return ADD_LAYER_NORM(x, residual, weight, bias, eps, dropout_p, residual_in_fp32, dropout_seed)


class UnscaledRows(NamedTuple):
    """An int8 GEMM's output before its rows' scales and its bias (``fastnmt.quantize``): the
    layer's output is ``values * scales[..., None] + bias``; values (..., N), scales one per
    row of values, bias (N,) float32 or None."""

    values: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def reshape(self, *shape) -> UnscaledRows:
        """The same rows in another shape (the last dimension kept)."""
        return self._replace(values=self.values.reshape(*shape))


def add_unscaled_layer_norm(x: UnscaledRows, residual, weight, bias, eps=1e-5):
    """``add_layer_norm`` of an int8 GEMM's unfinished rows, in inference (C++, no dropout, no
    gradient): x is finished in the same pass over its rows as the add and the norm. Returns
    ``(y, h)`` shaped as x's values."""
    values = x.values
    y, h = torch.ops.fastnmt.add_layer_norm_unscaled_cpp(
        values.view(-1, values.shape[-1]), x.scales, x.bias, residual, weight, bias, eps
    )
    return y.view(values.shape), h.view(values.shape)
