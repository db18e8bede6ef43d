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

This file holds the PyTorch reference (the fallback and the test oracle); fused kernels register
themselves as further backends of the same dispatch entry.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastnmt import _checks, dispatch

# ---------------------------------------------------------------------------------------------
# PyTorch reference: dropout, add and LayerNorm as three separate passes.
# ---------------------------------------------------------------------------------------------


def add_layer_norm_reference(x, residual, weight, bias, eps, dropout_p, residual_in_fp32):
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
# Argument checks and the registered op.
# ---------------------------------------------------------------------------------------------


def _prepare(
    x, residual=None, weight=None, bias=None, eps=1e-5, dropout_p=0.0, residual_in_fp32=False
):
    _checks.tensor("x", x, floating=True)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the normalized width)")
    if residual is not None:
        _checks.tensor("residual", residual, floating=True)
        _checks.shape("residual", residual, tuple(x.shape), "the shape of x")
        _checks.same_device("residual", residual, "x", x)
        expected = torch.float32 if residual_in_fp32 else x.dtype
        # Under autocast the residual stream stays fp32 while sublayer outputs are half.
        if residual.dtype != expected and not _checks.autocasting(x.device):
            raise TypeError(
                f"residual must have dtype {expected} (residual_in_fp32={residual_in_fp32}), "
                f"got {residual.dtype}"
            )
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None:
            _checks.tensor(name, param, floating=True)
            _checks.shape(name, param, (x.shape[-1],), "the last dimension of x")
            _checks.same_device(name, param, "x", x)
    prepared = dict(
        x=x,
        residual=residual,
        weight=weight,
        bias=bias,
        eps=_checks.positive("eps", eps),
        dropout_p=_checks.probability("dropout_p", dropout_p),
        residual_in_fp32=bool(residual_in_fp32),
    )
    return x.device, prepared


ADD_LAYER_NORM = dispatch.define("add_layer_norm", _prepare)
ADD_LAYER_NORM.register("reference")(add_layer_norm_reference)


def add_layer_norm(
    x, residual=None, weight=None, bias=None, eps=1e-5, dropout_p=0.0, residual_in_fp32=False
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

    Returns:
        y with x's dtype, and h (fp32 with ``residual_in_fp32``).
    """
    return ADD_LAYER_NORM(x, residual, weight, bias, eps, dropout_p, residual_in_fp32)
