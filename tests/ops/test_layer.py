"""A Transformer layer's non-attention part built from add_layer_norm + feed_forward: forced onto
Triton (compiled on a GPU, the interpreter on a CPU) it matches the same layer on the reference
backend, outputs and every parameter gradient, in fp32 without dropout, under FlashAttention's
error rule."""

import importlib
import math

import pytest
import torch

import fastnmt
from fastnmt.ops import add_layer_norm, feed_forward
from tests.helpers import TRITON_DEVICE, assert_error_within

feed_forward_module = importlib.import_module("fastnmt.ops.feed_forward")

D_MODEL, D_FF = 40, 100  # neither a multiple of the kernels' blocks


def _parameters(dtype):
    """Two feed-forward sublayers ("a" GELU, "b" ReLU) and three LayerNorms, nn.Linear layout."""
    parameters = {}
    for name in ("a", "b"):
        parameters[f"{name}.w1"] = torch.randn(D_FF, D_MODEL) / math.sqrt(D_MODEL)
        parameters[f"{name}.b1"] = torch.randn(D_FF) * 0.1
        parameters[f"{name}.w2"] = torch.randn(D_MODEL, D_FF) / math.sqrt(D_FF)
        parameters[f"{name}.b2"] = torch.randn(D_MODEL) * 0.1
    for index in range(3):
        parameters[f"norm{index}.weight"] = 1 + 0.1 * torch.randn(D_MODEL)
        parameters[f"norm{index}.bias"] = 0.1 * torch.randn(D_MODEL)
    return {name: value.to(TRITON_DEVICE, dtype) for name, value in parameters.items()}


def _layer(x, p, prenorm):
    def sublayer(name, activation, inputs):
        weights = (p[f"{name}.{w}"] for w in ("w1", "b1", "w2", "b2"))
        return feed_forward(inputs, *weights, activation)

    def norm(index):
        return p[f"norm{index}.weight"], p[f"norm{index}.bias"]

    if prenorm:  # h carries the residual stream; the last add_layer_norm is the final norm
        y, h = add_layer_norm(x, None, *norm(0))
        y, h = add_layer_norm(sublayer("a", "gelu", y), h, *norm(1))
        return add_layer_norm(sublayer("b", "relu", y), h, *norm(2))[0]
    x = add_layer_norm(sublayer("a", "gelu", x), x, *norm(0))[0]
    return add_layer_norm(sublayer("b", "relu", x), x, *norm(1))[0]


def _run(backend, x, parameters, prenorm, dy):
    leaves = {name: value.detach().requires_grad_() for name, value in parameters.items()}
    with fastnmt.backend(backend):
        out = _layer(x, leaves, prenorm)
    (out.double() * dy).sum().backward()
    return out, {name: leaf.grad for name, leaf in leaves.items() if leaf.grad is not None}


@pytest.mark.parametrize(("prenorm", "fused_gemm"), [(True, True), (False, False)])
def test_triton_layer_matches_reference(monkeypatch, prenorm, fused_gemm):
    monkeypatch.setenv(fastnmt.ops.settings.FFN_FUSED_GEMM, "1" if fused_gemm else "0")
    fastnmt.ops.settings.reload()
    x = torch.randn(2, 7, D_MODEL, device=TRITON_DEVICE)
    parameters = _parameters(torch.float32)
    dy = torch.randn(2, 7, D_MODEL, dtype=torch.float64, device=TRITON_DEVICE)
    double = {name: value.double() for name, value in parameters.items()}
    oracle, oracle_grads = _run("reference", x.double(), double, prenorm, dy)
    same_dtype, torch_grads = _run("reference", x, parameters, prenorm, dy)
    got, grads = _run("triton", x, parameters, prenorm, dy)
    assert_error_within(got, same_dtype, oracle, 2, 1e-5)
    assert grads.keys() == oracle_grads.keys() and len(grads) == (14 if prenorm else 12)
    for name, grad in grads.items():
        assert_error_within(grad, torch_grads[name], oracle_grads[name], 3, 1e-5)
