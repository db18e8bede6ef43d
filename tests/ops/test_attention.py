"""fastnmt.ops.attention (reference backend) against an independent float64 oracle."""

import pytest
import torch

from fastnmt.ops import attention, attention_probabilities
from tests.helpers import assert_error_within, attention_oracle, random_lengths

SHAPES = [  # (B, H, Lq, Lk, D)
    (1, 1, 1, 1, 16),
    (2, 3, 7, 19, 48),
    (3, 2, 33, 33, 64),
    (2, 1, 1, 64, 80),
]


def _qkv(batch, heads, lq, lk, head_dim, dtype=torch.float32, requires_grad=False):
    make = lambda length: torch.randn(  # noqa: E731
        batch, heads, length, head_dim, dtype=dtype, requires_grad=requires_grad
    )
    return make(lq), make(lk), make(lk)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_float64_oracle(shape, causal, dtype):
    q, k, v = _qkv(*shape, dtype=dtype)
    lengths = random_lengths(shape[0], shape[3])
    out, lse = attention(q, k, v, key_lengths=lengths, causal=causal, return_lse=True)
    expected, expected_lse, _ = attention_oracle(q, k, v, key_lengths=lengths, causal=causal)
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)
    finite = torch.isfinite(expected_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], expected_lse[finite], atol=tolerance, rtol=0)


def test_gradcheck_with_padding_causal_and_empty_rows():
    q, k, v = _qkv(2, 2, 5, 6, 3, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([0, 4])
    function = lambda q, k, v: attention(q, k, v, key_lengths=lengths, causal=True)  # noqa: E731
    assert torch.autograd.gradcheck(function, (q, k, v))


def test_rows_that_see_no_key_give_zero_output_and_zero_grad():
    q, k, v = _qkv(3, 2, 4, 5, 8, requires_grad=True)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1] = True  # batch entry 1 has no keys at all
    out = attention(q, k, v, key_padding_mask=padding)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(out).all() and (out[1] == 0).all()
    for grad in (q.grad, k.grad, v.grad):
        assert torch.isfinite(grad).all() and (grad[1] == 0).all()


def test_key_padding_mask_equals_key_lengths():
    q, k, v = _qkv(4, 2, 6, 9, 16)
    lengths = random_lengths(4, 9)
    padding = torch.arange(9)[None, :] >= lengths[:, None]
    torch.testing.assert_close(
        attention(q, k, v, key_padding_mask=padding), attention(q, k, v, key_lengths=lengths)
    )


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_attn_mask(kind):
    q, k, v = _qkv(2, 3, 5, 7, 8)
    allowed = torch.rand(2, 1, 5, 7) > 0.4
    mask = allowed if kind == "bool" else torch.zeros(2, 1, 5, 7).masked_fill(~allowed, -torch.inf)
    expected, _, _ = attention_oracle(q, k, v, attn_mask=allowed)
    torch.testing.assert_close(
        attention(q, k, v, attn_mask=mask).double(), expected, atol=1e-5, rtol=1e-5
    )


def test_scale_and_value_dim_differ():
    q, k, _ = _qkv(2, 2, 3, 4, 8)
    v = torch.randn(2, 2, 4, 5)
    expected, _, _ = attention_oracle(q, k, v, scale=0.3)
    torch.testing.assert_close(
        attention(q, k, v, scale=0.3).double(), expected, atol=1e-5, rtol=1e-5
    )


def test_strided_inputs_need_no_copy():
    packed = torch.randn(2, 6, 3, 4, 16)  # (B, L, 3, H, D) as a fused QKV projection gives
    q, k, v = (packed[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    expected, _, _ = attention_oracle(q, k, v)
    torch.testing.assert_close(attention(q, k, v).double(), expected, atol=1e-5, rtol=1e-5)


def test_probabilities_match_oracle():
    q, k, _ = _qkv(2, 2, 4, 6, 8)
    lengths = torch.tensor([6, 0])
    _, _, expected = attention_oracle(q, k, k, key_lengths=lengths, causal=True)
    probs = attention_probabilities(q, k, key_lengths=lengths, causal=True)
    torch.testing.assert_close(probs.double(), expected, atol=1e-6, rtol=1e-6)


def test_error_rule_helper_can_fail():
    exact = torch.randn(100, dtype=torch.float64)
    plain_torch = exact.float()
    with pytest.raises(AssertionError):
        assert_error_within(exact.float() + 1e-3, plain_torch, exact, 2, 1e-6)
    assert_error_within(exact.float(), plain_torch, exact, 2, 1e-6)


class TestDropout:
    def test_keep_fraction_and_scaling(self):
        q, k, v = _qkv(4, 4, 64, 64, 16)
        v = torch.ones_like(v)  # each output element is then sum_j Pd_ij = kept mass / (1 - p)
        out = attention(q, torch.zeros_like(k), v, dropout_p=0.3)  # uniform P = 1/64
        kept_fraction = (out[..., 0] * 0.7).mean().item()
        assert abs(kept_fraction - 0.7) < 0.01

    def test_same_seed_same_output(self):
        q, k, v = _qkv(2, 2, 8, 8, 16)
        torch.manual_seed(5)
        first = attention(q, k, v, dropout_p=0.3)
        torch.manual_seed(5)
        assert torch.equal(first, attention(q, k, v, dropout_p=0.3))


BAD_INPUTS = [
    (dict(q=torch.randn(2, 3, 4)), ValueError, "q must have 4 dimensions"),
    (dict(q=torch.randint(0, 3, (1, 2, 3, 8))), TypeError, "q must have a floating dtype"),
    (dict(k=torch.randn(1, 3, 5, 8)), ValueError, "k must have shape"),
    (dict(k=torch.randn(1, 2, 5, 4)), ValueError, "k must have shape"),
    (dict(v=torch.randn(1, 2, 6, 8)), ValueError, "v must have shape"),
    (dict(v=torch.randn(1, 2, 5, 8, dtype=torch.float64)), TypeError, "v has dtype"),
    (dict(key_lengths=torch.tensor([6])), ValueError, r"key_lengths must lie in \[0, 5\]"),
    (dict(key_lengths=torch.tensor([-1])), ValueError, "key_lengths must lie in"),
    (dict(key_lengths=torch.tensor([1.0])), TypeError, "key_lengths must be int32 or int64"),
    (dict(key_lengths=torch.tensor([1, 2])), ValueError, "key_lengths must have shape"),
    (dict(key_lengths=[3]), TypeError, "key_lengths must be a torch.Tensor"),
    (
        dict(key_padding_mask=torch.zeros(1, 4, dtype=torch.bool)),
        ValueError,
        "key_padding_mask must have shape",
    ),
    (dict(key_padding_mask=torch.zeros(1, 5)), TypeError, "key_padding_mask must be a bool"),
    (
        dict(key_lengths=torch.tensor([1]), key_padding_mask=torch.zeros(1, 5, dtype=torch.bool)),
        ValueError,
        "not both",
    ),
    (dict(attn_mask=torch.zeros(4, 5, dtype=torch.bool)), ValueError, "attn_mask must broadcast"),
    (dict(attn_mask=torch.zeros(3, 5, dtype=torch.float64)), TypeError, "attn_mask has dtype"),
    (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p=-0.1), ValueError, "dropout_p must be in"),
    (dict(dropout_p="0.1"), TypeError, "dropout_p must be a float"),
    (dict(scale=0.0), ValueError, "scale must be a positive number"),
    (dict(causal=1), TypeError, "causal must be a bool"),
]


@pytest.mark.parametrize(("override", "error", "message"), BAD_INPUTS)
def test_bad_inputs_name_the_argument(override, error, message):
    arguments = dict(
        q=torch.randn(1, 2, 3, 8), k=torch.randn(1, 2, 5, 8), v=torch.randn(1, 2, 5, 8)
    )
    arguments.update(override)
    q, k, v = arguments.pop("q"), arguments.pop("k"), arguments.pop("v")
    with pytest.raises(error, match=message):
        attention(q, k, v, **arguments)


def test_mixed_devices_are_rejected():
    q = torch.randn(1, 1, 2, 4)
    k = torch.randn(1, 1, 2, 4, device="meta")
    with pytest.raises(ValueError, match="k is on meta but q is on cpu"):
        attention(q, k, k)
