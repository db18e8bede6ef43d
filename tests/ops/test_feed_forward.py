"""fastnmt.ops.feed_forward (reference backend) against an independent float64 oracle."""

import math

import pytest
import torch

from fastnmt.ops import feed_forward


def feed_forward_oracle(x, w1, b1, w2, b2, activation):
    a = x.double() @ w1.double().T + b1.double()
    gelu = a * 0.5 * (1 + torch.erf(a / math.sqrt(2)))
    z = a.clamp_min(0) if activation == "relu" else gelu
    return z @ w2.double().T + b2.double()


def _inputs(tokens, d_model, d_ff, dtype=torch.float32, requires_grad=False):
    make = lambda *shape: (torch.randn(*shape, dtype=dtype) / math.sqrt(shape[-1])).requires_grad_(  # noqa: E731
        requires_grad
    )
    return (
        make(tokens, d_model),
        make(d_ff, d_model),
        make(d_ff),
        make(d_model, d_ff),
        make(d_model),
    )


@pytest.mark.parametrize(
    ("tokens", "d_model", "d_ff"), [(1, 16, 64), (37, 40, 100), (129, 64, 256)]
)
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_oracle(tokens, d_model, d_ff, activation, dtype):
    x, w1, b1, w2, b2 = _inputs(tokens, d_model, d_ff, dtype)
    y = feed_forward(x, w1, b1, w2, b2, activation)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(
        y.double(),
        feed_forward_oracle(x, w1, b1, w2, b2, activation),
        atol=tolerance,
        rtol=tolerance,
    )


def test_leading_dimensions_and_no_bias():
    x, w1, _, w2, _ = _inputs(6, 8, 12)
    y = feed_forward(x.view(2, 3, 8), w1, None, w2, None)
    expected = feed_forward_oracle(x, w1, torch.zeros(12), w2, torch.zeros(8), "relu")
    torch.testing.assert_close(y.reshape(6, 8).double(), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_gradcheck(activation):
    inputs = _inputs(4, 5, 7, torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: feed_forward(*a, activation), inputs)


def test_dropout_keep_fraction():
    x = torch.ones(512, 4)
    w1, w2 = torch.ones(256, 4), torch.eye(256)[:, :256]
    hidden = feed_forward(x, w1, None, w2, None, "relu", dropout_p=0.2)  # z itself (W2 = I)
    kept = hidden != 0
    assert abs(kept.float().mean().item() - 0.8) < 0.01
    torch.testing.assert_close(hidden[kept], torch.full_like(hidden[kept], 4 / 0.8))


BAD_INPUTS = [
    (dict(w1=torch.randn(12, 9)), ValueError, r"w1 must have shape \(out_features, 8\)"),
    (dict(b1=torch.randn(11)), ValueError, "b1 must have shape"),
    (dict(w2=torch.randn(8, 11)), ValueError, r"w2 must have shape \(out_features, 12\)"),
    (dict(w2=torch.randn(8, 12, dtype=torch.float64)), TypeError, "w2 has dtype"),
    (dict(activation="tanh"), ValueError, "activation must be one of"),
    (dict(dropout_p=1), ValueError, "dropout_p must be in"),
    (dict(x=torch.tensor(2.0)), ValueError, "x must have at least one dimension"),
]


@pytest.mark.parametrize(("override", "error", "message"), BAD_INPUTS)
def test_bad_inputs_name_the_argument(override, error, message):
    x, w1, b1, w2, b2 = _inputs(3, 8, 12)
    arguments = dict(x=x, w1=w1, b1=b1, w2=w2, b2=b2)
    arguments.update(override)
    with pytest.raises(error, match=message):
        feed_forward(**arguments)
