"""fastnmt.ops.add_layer_norm (reference backend) against an independent float64 oracle."""

import pytest
import torch

from fastnmt.ops import add_layer_norm


def layer_norm_oracle(x, residual, weight, bias, eps):
    h = x.double() + (0 if residual is None else residual.double())
    centered = h - h.mean(-1, keepdim=True)
    variance = (centered**2).mean(-1, keepdim=True)
    return centered / torch.sqrt(variance + eps) * weight.double() + bias.double(), h


def _inputs(rows, width, dtype=torch.float32, requires_grad=False):
    make = lambda *shape: torch.randn(*shape, dtype=dtype, requires_grad=requires_grad)  # noqa: E731
    return make(rows, width), make(rows, width), make(width), make(width)


@pytest.mark.parametrize("rows", [1, 3, 129])
@pytest.mark.parametrize("width", [64, 100, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_float64_oracle(rows, width, dtype):
    x, residual, weight, bias = _inputs(rows, width, dtype)
    y, h = add_layer_norm(x, residual, weight, bias, eps=1e-5)
    expected_y, expected_h = layer_norm_oracle(x, residual, weight, bias, 1e-5)
    tolerance = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 8e-2}[dtype]
    assert y.dtype == dtype and h.dtype == dtype
    torch.testing.assert_close(y.double(), expected_y, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(h.double(), expected_h, atol=tolerance, rtol=tolerance)


def test_without_residual_and_residual_in_fp32():
    x, residual, weight, bias = _inputs(5, 32, torch.bfloat16)
    y, h = add_layer_norm(x, None, weight, bias)
    torch.testing.assert_close(h, x)
    y, h = add_layer_norm(x, residual.float(), weight, bias, residual_in_fp32=True)
    assert h.dtype == torch.float32 and y.dtype == torch.bfloat16
    torch.testing.assert_close(h.double(), x.double() + residual.float().double())


def test_gradcheck_through_both_outputs():
    x, residual, weight, bias = _inputs(3, 7, torch.float64, requires_grad=True)

    def both_outputs(x, residual, weight, bias):
        y, h = add_layer_norm(x, residual, weight, bias)
        return y, h * 0.5  # pre-norm stacks send gradient into h as well

    assert torch.autograd.gradcheck(both_outputs, (x, residual, weight, bias))


def test_prenorm_and_postnorm_stacks():
    """Pre-norm chains h into the next residual; post-norm feeds y back as the residual."""
    x, residual, weight, bias = _inputs(4, 16)
    y, h = add_layer_norm(x, residual, weight, bias)
    y2, _ = add_layer_norm(x * 2, h, weight, bias)
    expected, _ = layer_norm_oracle(x * 2, residual + x, weight, bias, 1e-5)
    torch.testing.assert_close(y2.double(), expected, atol=1e-5, rtol=1e-5)
    post, _ = add_layer_norm(x * 2, y, weight, bias)
    expected_post, _ = layer_norm_oracle(x * 2, y, weight, bias, 1e-5)
    torch.testing.assert_close(post.double(), expected_post, atol=1e-5, rtol=1e-5)


def test_dropout_keep_fraction_and_scaling():
    x = torch.ones(256, 1024)
    _, h = add_layer_norm(x, torch.zeros_like(x), dropout_p=0.2)
    kept = h != 0
    assert abs(kept.float().mean().item() - 0.8) < 0.01
    torch.testing.assert_close(h[kept], torch.full_like(h[kept], 1 / 0.8))


BAD_INPUTS = [
    (dict(x=torch.tensor(1.0)), ValueError, "x must have at least one dimension"),
    (dict(residual=torch.randn(2, 9)), ValueError, "residual must have shape"),
    (dict(residual=torch.randn(2, 8, dtype=torch.float64)), TypeError, "residual must have dtype"),
    (dict(weight=torch.randn(7)), ValueError, "weight must have shape"),
    (dict(bias=torch.randn(8, 1)), ValueError, "bias must have shape"),
    (dict(eps=0), ValueError, "eps must be a positive number"),
    (dict(dropout_p=1.5), ValueError, "dropout_p must be in"),
    (dict(x=torch.randint(0, 2, (2, 8))), TypeError, "x must have a floating dtype"),
]


@pytest.mark.parametrize(("override", "error", "message"), BAD_INPUTS)
def test_bad_inputs_name_the_argument(override, error, message):
    arguments = dict(x=torch.randn(2, 8), residual=torch.randn(2, 8), weight=torch.randn(8))
    arguments.update(override)
    with pytest.raises(error, match=message):
        add_layer_norm(**arguments)
