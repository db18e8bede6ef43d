"""fastnmt.ops.attention against an independent float64 oracle: the reference backend, then the
Triton backend, forced, on ``TRITON_DEVICE`` (compiled on a GPU; without one in the Triton
interpreter, which tests/conftest.py sets up), then the C++ backend on CPU tensors."""

import functools
import importlib

import pytest
import torch

from fastnmt.ops import attention, attention_probabilities, attention_varlen, dispatch, settings
from fastnmt.ops.triton import common as triton_common
from fastnmt.ops.triton.common import LaunchConfig, dropout_seed, gpu_tiles, use_gpu_tiles
from tests.helpers import (
    TRITON_DEVICE,
    HostOps,
    assert_error_within,
    attention_oracle,
    device_of,
    host_python_calls,
    opcheck,
    random_lengths,
    require_backend,
)

attention_module = importlib.import_module("fastnmt.ops.attention")
triton_module = importlib.import_module("fastnmt.ops.triton.attention")

FP32, FP16, BF16, FP64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
FP32_EPS = torch.finfo(FP32).eps  # the spacing of fp32 values at 1: rounding of a probability


SHAPES = [  # (B, H, Lq, Lk, D)
    (1, 1, 1, 1, 16),
    (2, 3, 7, 19, 48),
    (3, 2, 33, 33, 64),
    (2, 1, 1, 64, 80),
]


def _qkv(
    batch, heads, lq, lk, head_dim, dtype=FP32, requires_grad=False, device="cpu", value_dim=None
):
    """Random q, k, v; v's head dim is ``value_dim`` (default: ``head_dim``)."""

    def make(length, width):
        return torch.randn(
            batch, heads, length, width, dtype=dtype, device=device, requires_grad=requires_grad
        )

    return make(lq, head_dim), make(lk, head_dim), make(lk, value_dim or head_dim)


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


def test_keys_past_the_key_lengths_are_never_read(fused):
    """A decoding cache past its filled length holds whatever its memory held: NaN there must
    change nothing, forward or backward (a Triton tile that loaded it once multiplied the NaN by
    a zero probability, and static beam search on an H100 lost whole hypotheses)."""
    device = device_of(fused)
    q, k, v = _qkv(2, 2, 5, 40, 16, device=device)
    lengths = torch.tensor([7, 33], device=device)
    hidden = torch.arange(40, device=device)[None, None, :, None] >= lengths[:, None, None, None]
    results = []
    for fill in (0.0, float("nan")):
        leaves = [x.masked_fill(hidden, fill).requires_grad_() for x in (k, v)]
        query = q.clone().requires_grad_()
        out = attention(query, *leaves, key_lengths=lengths, causal=False)
        out.backward(torch.ones_like(out))
        results.append([out, query.grad, *(leaf.grad.masked_fill(hidden, 0) for leaf in leaves)])
    for with_zeros, with_nan in zip(*results, strict=True):
        assert torch.equal(with_zeros, with_nan)


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
def test_bad_inputs_name_the_argument(override, error, message, monkeypatch):
    monkeypatch.setenv("FASTNMT_CHECK_VALUES", "1")  # key_lengths' range is checked too
    settings.reload()
    arguments = dict(
        q=torch.randn(1, 2, 3, 8), k=torch.randn(1, 2, 5, 8), v=torch.randn(1, 2, 5, 8)
    )
    arguments.update(override)
    q, k, v = arguments.pop("q"), arguments.pop("k"), arguments.pop("v")
    with pytest.raises(error, match=message):
        attention(q, k, v, **arguments)


def test_out_of_range_key_lengths_raise_one_line_under_value_checks(monkeypatch):
    monkeypatch.setenv("FASTNMT_CHECK_VALUES", "1")
    settings.reload()
    q, k, v = _qkv(2, 1, 3, 5, 8)
    with pytest.raises(ValueError) as raised:
        attention(q, k, v, key_lengths=torch.tensor([-1, 8]))
    assert (
        str(raised.value)
        == "key_lengths must lie in [0, 5] (the key length), got values in [-1, 8]"
    )


def test_key_lengths_are_not_read_without_value_checks(monkeypatch):
    """Reading them would sync a GPU with the host at every call."""

    def host_read(*_):
        raise AssertionError("key_lengths read on the host")

    monkeypatch.setattr(torch, "aminmax", host_read)
    q, k, v = _qkv(2, 1, 3, 5, 8)
    attention(q, k, v, key_lengths=torch.tensor([2, 5]))
    monkeypatch.setenv("FASTNMT_CHECK_VALUES", "1")
    settings.reload()
    with pytest.raises(AssertionError, match="read on the host"):
        attention(q, k, v, key_lengths=torch.tensor([2, 5]))


def test_mixed_devices_are_rejected():
    q = torch.randn(1, 1, 2, 4)
    k = torch.randn(1, 1, 2, 4, device="meta")
    with pytest.raises(ValueError, match="k is on meta but q is on cpu"):
        attention(q, k, k)


# ---------------------------------------------------------------------------------------------
# Triton backend, on TRITON_DEVICE: compiled on a GPU, else in the interpreter. Small B * H, one
# large block per sequence in the interpreter (see launch_config) but for the GPU tilings below,
# and a pairwise selection of the matrix rather than its full product, to stay within minutes.
# ---------------------------------------------------------------------------------------------

# Allowed absolute error on top of FlashAttention's rule, per dtype.
ATOL = {FP32: 1e-5, FP16: 5e-4, BF16: 5e-3}

TRITON_CASES = [  # B, H, Lq, Lk, D, causal, masks, dtype, dropout_p
    (1, 1, 1, 1, 16, False, "none", FP32, 0.0),
    (2, 3, 7, 19, 48, True, "lengths", FP16, 0.0),
    (2, 2, 33, 33, 64, True, "lengths", FP32, 0.3),  # self-attention
    (1, 1, 33, 64, 80, False, "none", FP16, 0.3),
    (3, 1, 7, 64, 128, True, "padding", FP32, 0.0),
    (3, 2, 1, 19, 64, False, "lengths", BF16, 0.0),  # a decoding step against a cache
    (1, 2, 33, 19, 16, True, "none", BF16, 0.3),  # Lq > Lk
    (3, 1, 7, 1, 80, False, "lengths", FP16, 0.0),  # Lk = 1: lengths 1 and 0
    (1, 1, 33, 64, 128, True, "padding", FP16, 0.3),
    (3, 2, 4, 64, 96, False, "padding", FP32, 0.3),  # beam search step, Lq = 4
    (2, 2, 33, 33, 48, False, "lengths", BF16, 0.3),
]


def _masks(kind: str, batch: int, lk: int, device="cpu") -> dict:
    """No mask, lengths including full, 0 and 1, or a bool padding mask that is not a suffix."""
    if kind == "none":
        return {}
    lengths = torch.tensor([lk, 0, 1], device=device)[:batch]
    if kind == "lengths":
        return dict(key_lengths=lengths)
    padding = torch.rand(batch, lk, device=device) < 0.3
    padding[0] = False
    padding[1:2] = True  # batch entry 1 sees no key
    return dict(key_padding_mask=padding)


def _oracle(q, k, v, keep, dropout_p, key_lengths=None, key_padding_mask=None, causal=False):
    """float64 attention given the dropout keep mask: the independent oracle's probabilities,
    computed on the CPU (differentiably) and returned on the inputs' device."""
    device = q.device
    q, k, v = (x.cpu() for x in (q, k, v))
    allowed = None if key_padding_mask is None else ~key_padding_mask.cpu()[:, None, None, :]
    lengths = None if key_lengths is None else key_lengths.cpu()
    _, lse, probs = attention_oracle(q, k, v, key_lengths=lengths, causal=causal, attn_mask=allowed)
    if keep is not None:
        probs = probs * keep.cpu() / (1 - dropout_p)
    return (probs @ v.double()).to(device), lse.to(device)


def _plain_torch(q, k, v, keep, dropout_p, causal=False, **masks):
    """The unfused computation in the inputs' dtype given the keep mask (the error baseline)."""
    probs = attention_probabilities(q, k, causal=causal, **masks)
    if keep is not None:
        probs = probs * keep.to(probs.dtype) / (1 - dropout_p)
    return probs @ v, None


def _forced(backend, q, k, v, dropout_p, causal=False, **masks):
    with dispatch.backend(backend):
        return attention(q, k, v, causal=causal, dropout_p=dropout_p, return_lse=True, **masks)


_triton = functools.partial(_forced, "triton")


def _with_grads(function, inputs, grad_out, *args, **kwargs):
    """function's (out, lse) and the gradients of (out * grad_out).sum() for q, k, v."""
    inputs = [x.detach().requires_grad_() for x in inputs]
    out, lse = function(*inputs, *args, **kwargs)
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
    return out.detach(), lse, grads


def _oracle_with_grads(inputs, grad_out, *args, **kwargs):
    """``_with_grads`` of the oracle from float64 leaves: gradients not rounded to the inputs'
    dtype (a sum that lands on a rounding tie would otherwise read as an ulp of error)."""
    return _with_grads(_oracle, [x.double() for x in inputs], grad_out, *args, **kwargs)


def _keep_mask_writer(backend):
    """(seed, shape, dropout_p) -> the bool keep mask that ``backend``'s kernels draw."""
    if backend == "triton":
        return triton_module.dropout_keep_mask
    return lambda seed, shape, p: torch.ops.fastnmt.attention_cpp_dropout_mask(seed, *shape, p)


def _kernel_keep_mask(backend, generator_seed, device, shape, dropout_p):
    """The mask of the ``backend`` call on ``device`` made after
    ``torch.manual_seed(generator_seed)``: both backends' first random draw is their seed (see
    ``dropout_keep_mask``)."""
    if dropout_p == 0.0:
        return None
    torch.manual_seed(generator_seed)
    seed = dropout_seed(device)
    return _keep_mask_writer(backend)(seed, shape, dropout_p)


def _check_case(
    backend, batch, heads, lq, lk, head_dim, causal, masks, dtype, dropout_p, value_dim=None
):
    """``backend`` forced against the float64 oracle given the kernel's own dropout mask, with
    FlashAttention's error rule against plain PyTorch in the same dtype."""
    device = device_of(backend)
    q, k, v = _qkv(batch, heads, lq, lk, head_dim, dtype, device=device, value_dim=value_dim)
    grad_out = torch.randn(batch, heads, lq, v.shape[-1], dtype=dtype, device=device)
    masks = _masks(masks, batch, lk, device)
    generator_seed = int(torch.randint(2**31, ()))  # fresh per case, replayed for the mask
    torch.manual_seed(generator_seed)
    run = functools.partial(_forced, backend)
    out, lse, grads = _with_grads(run, (q, k, v), grad_out, dropout_p, causal, **masks)
    keep = _kernel_keep_mask(backend, generator_seed, device, (batch, heads, lq, lk), dropout_p)
    expected, expected_lse, expected_grads = _oracle_with_grads(
        (q, k, v), grad_out, keep, dropout_p, causal=causal, **masks
    )
    _, _, plain_grads = _with_grads(
        _plain_torch, (q, k, v), grad_out, keep, dropout_p, causal=causal, **masks
    )
    plain = _plain_torch(q, k, v, keep, dropout_p, causal=causal, **masks)[0]
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert_error_within(out, plain, expected, 2, ATOL[dtype])
    named = zip(("dq", "dk", "dv"), grads, plain_grads, expected_grads, strict=True)
    for name, grad, plain_grad, expected_grad in named:
        assert_error_within(grad, plain_grad, expected_grad, 3, ATOL[dtype], name)
    finite = torch.isfinite(expected_lse)
    assert lse.dtype == torch.float32 and torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], expected_lse[finite], atol=1e-4, rtol=1e-4)


_check_triton_case = functools.partial(_check_case, "triton")


@pytest.mark.parametrize(
    "case", TRITON_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c)
)
def test_triton_matches_float64_oracle(case):
    _check_triton_case(*case)


def _plain_with_lse(q, k, v, key_lengths, causal=False):
    """``_plain_torch`` with its LSE, in the inputs' dtype (no dropout)."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    hidden = torch.arange(k.shape[2], device=q.device) >= key_lengths[:, None, None, None]
    if causal:
        hidden = hidden | torch.ones_like(scores, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


@pytest.mark.parametrize("loss", ["weighted", "summed"])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_gradients_through_the_lse_match_float64_oracle(fused, dtype, loss):
    """A loss on the LSE as well as the output sends lse's gradient g into the backward: dS_ij
    gains P_ij g_i (the Triton dQ kernel folds it into delta). "summed": g reaches the backward
    as autograd's expanded ones (stride 0)."""
    device = device_of(fused)
    q, k, v = _qkv(2, 3, 37, 45, 16, dtype, device=device)
    lengths = torch.tensor([45, 6], device=device)
    grad_out = torch.randn(2, 3, 37, 16, device=device)
    weights = torch.randn(2, 3, 37, device=device) if loss == "weighted" else 1.0

    def grads(function, inputs):
        inputs = [x.detach().requires_grad_() for x in inputs]
        out, lse = function(*inputs)
        total = (out * grad_out.to(out.dtype)).sum() + (lse * weights).sum()
        return torch.autograd.grad(total, inputs)

    masks = dict(key_lengths=lengths, causal=True)
    got = grads(lambda *qkv: _forced(fused, *qkv, 0.0, **masks), (q, k, v))
    float64 = [x.double() for x in (q, k, v)]
    expected = grads(lambda *qkv: _oracle(*qkv, None, 0.0, **masks), float64)
    plain = grads(lambda *qkv: _plain_with_lse(*qkv, **masks), (q, k, v))
    for name, *triple in zip(("dq", "dk", "dv"), got, plain, expected, strict=True):
        assert_error_within(*triple, 3, ATOL[dtype], name)


def test_triton_with_many_blocks_per_sequence(monkeypatch):
    """Small blocks exercise the online softmax across key blocks, the causal loop bounds and
    the skipped padding blocks; the dropout mask does not depend on the tiling."""
    case = (2, 1, 33, 64, 48, True, "lengths", FP32, 0.3)
    q, k, v = _qkv(*case[:5], device=TRITON_DEVICE)
    masks = _masks("lengths", 2, 64, TRITON_DEVICE)
    torch.manual_seed(7)
    one_block = _triton(q, k, v, 0.3, True, **masks)[0]
    small = LaunchConfig(16, 16, 4, 1)
    monkeypatch.setattr(triton_module, "launch_config", lambda *_: small)
    _check_triton_case(*case)
    torch.manual_seed(7)
    many_blocks = _triton(q, k, v, 0.3, True, **masks)[0]
    torch.testing.assert_close(many_blocks, one_block, atol=1e-6, rtol=1e-6)


def test_triton_strided_inputs_and_output_gradient():
    # (B, L, 3, H, D) as a fused QKV projection gives
    packed = torch.randn(2, 9, 3, 2, 48, device=TRITON_DEVICE)
    q, k, v = (packed[:, :, i].transpose(1, 2) for i in range(3))
    grad_out = torch.randn(2, 9, 2, 48, device=TRITON_DEVICE).transpose(1, 2)
    lengths = torch.tensor([9, 4], device=TRITON_DEVICE)
    out, _, grads = _with_grads(_triton, (q, k, v), grad_out, 0.0, key_lengths=lengths)
    expected, _, expected_grads = _oracle_with_grads(
        (q, k, v), grad_out, None, 0.0, key_lengths=lengths
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad.double(), expected_grad, atol=1e-5, rtol=1e-5)


def test_triton_probabilities_from_lse():
    q, k, v = _qkv(2, 3, 7, 19, 48, device=TRITON_DEVICE)
    lengths = torch.tensor([19, 0], device=TRITON_DEVICE)
    _, lse = _triton(q, k, v, 0.0, True, key_lengths=lengths)
    probs = attention_probabilities(q, k, key_lengths=lengths, causal=True, lse=lse)
    q, k, v = (x.cpu() for x in (q, k, v))
    _, _, expected = attention_oracle(q, k, v, key_lengths=lengths.cpu(), causal=True)
    torch.testing.assert_close(probs.cpu().double(), expected, atol=1e-6, rtol=1e-6)


def test_probabilities_from_an_lse_are_exact_to_fp32_rounding(fused):
    """P recomputed from the kernel's lse is the softmax of the same scores to fp32 rounding,
    also where the lse carries more rounding (shifted by a few of its ulps, as another summation
    order or a larger score gives): an lse error is a factor on the whole row, which P must not
    inherit. Cross-attention at MultiheadAttention(64, 4)'s head shape with lengths [17, 5, 1],
    scores a few times the unit scale."""
    device = device_of(fused)
    q, k, v = (3 * x for x in _qkv(3, 4, 11, 17, 16, device=device))
    lengths = torch.tensor([17, 5, 1], device=device)
    _, lse = attention(q, k, v, key_lengths=lengths, return_lse=True)
    softmax = attention_probabilities(q, k, key_lengths=lengths)  # no lse: torch.softmax
    lse_ulp = torch.nextafter(lse, torch.full_like(lse, float("inf"))) - lse
    for given in (lse, lse + 4 * lse_ulp, lse - 4 * lse_ulp):
        probs = attention_probabilities(q, k, key_lengths=lengths, lse=given)
        torch.testing.assert_close(probs, softmax, atol=2 * FP32_EPS, rtol=0)


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        (dict(attn_mask=torch.ones(1, 1, 3, 5, dtype=torch.bool)), "attn_mask"),
        (dict(q=torch.randn(1, 2, 3, 8, dtype=torch.float64)), "dtype torch.float64"),
        (dict(v=torch.randn(1, 2, 5, 160)), "head dim 160 > 128"),
    ],
)
def test_triton_steps_aside_with_a_reason(override, reason):
    arguments = dict(
        q=torch.randn(1, 2, 3, 8), k=torch.randn(1, 2, 5, 8), v=torch.randn(1, 2, 5, 8)
    )
    arguments.update(override)
    if arguments["q"].dtype == torch.float64:
        arguments["k"], arguments["v"] = arguments["k"].double(), arguments["v"].double()
    arguments = {name: x.to(TRITON_DEVICE) for name, x in arguments.items()}
    q, k, v = arguments.pop("q"), arguments.pop("k"), arguments.pop("v")
    assert dispatch.explain("attention", q, k, v, **arguments)["chosen"] != "triton"
    with dispatch.backend("triton"), pytest.raises(dispatch.BackendUnavailableError, match=reason):
        attention(q, k, v, **arguments)


def test_forced_triton_runs_every_mask_kind():
    q, k, v = _qkv(2, 2, 3, 5, 16, device=TRITON_DEVICE)
    padding = torch.tensor([[False, True, False, False, True]] * 2, device=TRITON_DEVICE)
    with dispatch.backend("triton"):
        explained = dispatch.explain("attention", q, k, v, causal=True, key_padding_mask=padding)
    assert explained["chosen"] == "triton" and explained["triton"] == []


def test_triton_launches_for_the_inputs_device(monkeypatch):
    """Every launch names its inputs' device to its Launcher, which launches there whatever the
    current device (tests/ops/triton/test_common.py), so tensors on cuda:1 run on cuda:1."""
    devices = []
    launch = triton_common.Launcher.__call__

    def recording(launcher, device, *args):
        devices.append(device)
        return launch(launcher, device, *args)

    monkeypatch.setattr(triton_common.Launcher, "__call__", recording)
    q, k, v = _qkv(1, 1, 3, 5, 16, requires_grad=True, device=TRITON_DEVICE)
    out = _triton(q, k, v, 0.3)[0]
    out.backward(torch.randn_like(out))
    triton_module.dropout_keep_mask(dropout_seed(q.device), (1, 1, 3, 5), 0.3)
    launches = ["forward", "dQ", "dK/dV", "dropout mask"]
    assert devices == [q.device] * len(launches)


TRITON_KERNELS = ("_FORWARD", "_DQ", "_DKDV")  # their Launchers, in launch order


def test_triton_forward_and_backward_are_three_launches_and_their_outputs():
    """On a GPU a call's wall time is its host work: with inputs the kernels take as they are,
    forward + backward launch three kernels (dQ's computes delta for dK/dV's), and the only aten
    ops allocate their outputs (no copies, casts, or a zero-filled gradient for the unused
    LSE)."""
    q, k, v = _qkv(2, 2, 5, 7, 16, requires_grad=True, device=TRITON_DEVICE)
    lengths = torch.tensor([7, 3], device=TRITON_DEVICE)
    with dispatch.backend("triton"):
        grad = torch.randn_like(attention(q, k, v, key_lengths=lengths))  # the choice is cached
        with HostOps(triton_module, TRITON_KERNELS) as host:
            attention(q, k, v, key_lengths=lengths).backward(grad)
    assert host.launches == list(TRITON_KERNELS)
    # full: the interpreter's outputs start as NaN; detach: autograd's own bookkeeping of saved
    # and accumulated tensors, which SDPA's calls show too.
    # empty_strided: the output, (B, Lq, H, Dv) in memory; empty_like: the gradients, laid out
    # as the inputs (+ fill_ in the interpreter).
    allocations = {"empty", "full", "empty_strided", "empty_like"}
    assert set(host.aten) <= allocations | {"fill_", "detach"}, host.aten
    # (out, lse), (delta, dq, dk, dv):
    assert sum(name in allocations for name in host.aten) == 2 + 4


class _ThroughTriton:
    """Stands in for a Launcher's kernel, counting the launches that go through
    ``kernel[grid]`` (Triton's JITFunction.run on a GPU) in ``counted``."""

    def __init__(self, kernel, counted: list):
        self.kernel, self.counted = kernel, counted

    def __getitem__(self, grid):
        self.counted.append(grid)
        return self.kernel[grid]


def test_a_repeated_call_launches_the_compiled_kernels_directly_on_a_gpu(monkeypatch):
    """Compiled (a GPU): after a signature's first call, each launch goes straight to the
    compiled kernel, none through Triton's JITFunction.run; the interpreter takes kernel[grid]
    for each of the four."""
    counted = []
    for name in TRITON_KERNELS:
        launcher = getattr(triton_module, name)
        monkeypatch.setattr(launcher, "kernel", _ThroughTriton(launcher.kernel, counted))
    q, k, v = _qkv(2, 3, 9, 11, 24, requires_grad=True, device=TRITON_DEVICE)
    with dispatch.backend("triton"):
        for _ in range(2):
            counted.clear()
            attention(q, k, v, causal=True).sum().backward()
    assert len(counted) == (0 if TRITON_DEVICE.type == "cuda" else len(TRITON_KERNELS))


def test_the_host_work_of_a_triton_call_is_a_few_dozen_python_calls(monkeypatch):
    """Forward + backward on the Triton path with the launches taken out (through kernel[grid],
    two Python calls each): the dispatcher's cached decision, the autograd.Function, the launch
    plans cached per signature and four Launcher calls. SDPA's forward + backward makes 14 (the
    ``sum`` and ``backward`` of the step are most of them). The bound holds the launch plans'
    caching and the grids computed without triton's constexpr-function ``cdiv``, which alone
    would more than double the count."""
    q, k, v = _qkv(2, 2, 4, 8, 8, requires_grad=True, device=TRITON_DEVICE)
    lengths = torch.tensor([8, 3], device=TRITON_DEVICE)
    step = lambda: attention(q, k, v, key_lengths=lengths).sum().backward()  # noqa: E731
    assert host_python_calls(monkeypatch, triton_module, TRITON_KERNELS, step) <= 70


def test_the_host_work_of_a_triton_varlen_call_is_the_padded_one_and_its_views(monkeypatch):
    """Forward + backward over packed sequences with the launches taken out: the padded call's
    path (the bound above) plus the batch views of the packed operands and gradients (two Python
    calls each), no unpacking."""
    q, k, v = (torch.randn(12, 2, 8, requires_grad=True, device=TRITON_DEVICE) for _ in "qkv")
    cu_seqlens = torch.tensor([0, 4, 12], device=TRITON_DEVICE)

    def step():
        attention_varlen(q, k, v, cu_seqlens, cu_seqlens, 8, 8, causal=True).sum().backward()

    with dispatch.backend("triton"):
        assert host_python_calls(monkeypatch, triton_module, TRITON_KERNELS, step) <= 86


def test_opcheck_forward_and_backward_ops():
    # strided, as MultiheadAttention's heads
    q = torch.randn(2, 5, 2, 16, device=TRITON_DEVICE).transpose(1, 2)
    _, k, v = _qkv(2, 2, 5, 7, 16, device=TRITON_DEVICE)
    lengths = torch.tensor([7, 2], device=TRITON_DEVICE)
    padding = torch.rand(2, 7, device=TRITON_DEVICE) < 0.3
    seed = dropout_seed(q.device)
    forward = (q.requires_grad_(), k, v, lengths, padding, seed, True, 0.3, 0.25, None)
    opcheck(torch.ops.fastnmt.attention_forward.default, forward)
    out, lse = torch.ops.fastnmt.attention_forward(*forward)
    backward = (torch.randn_like(out), torch.randn_like(lse), q.detach(), k, v, out.detach())
    backward += (lse.detach(), lengths, padding, seed, True, 0.3, 0.25)
    opcheck(torch.ops.fastnmt.attention_backward.default, backward)


# ---------------------------------------------------------------------------------------------
# The GPU's tilings, run in the interpreter too (``gpu_tiles()``): every launch configuration of
# every kernel, from _GPU_CONFIGS, so that a config added there is tested without more code.
# ---------------------------------------------------------------------------------------------

_GPU_CONFIGS = triton_module._GPU_CONFIGS
# (Lq, Lk) that fall in each length bucket: Lq != Lk, not powers of two.
BUCKET_LENGTHS = {"decode": (3, 37), "short": (45, 70), "mid": (130, 77), "long": (21, 300)}


def _gpu_config_cases():
    """(kernel, bucket, widest head dim, config, the next narrower widest of the bucket or 0)."""
    cases = []
    for kernel, buckets in _GPU_CONFIGS.items():
        for bucket, configs in buckets.items():
            narrower = 0
            for widest, config in configs.items():
                cases.append((kernel, bucket, widest, config, narrower))
                narrower = widest
    return cases


GPU_CONFIG_CASES = _gpu_config_cases()


def _gpu_case_id(case):
    kernel, bucket, widest, config, _ = case
    return f"{kernel}-{bucket}-D<={widest}-{config.label.replace(' ', '_')}"


def _recorded_launch_configs(monkeypatch) -> dict:
    """kernel -> the config its launcher last asked launch_config for."""
    chosen = {}
    choose = triton_module.launch_config

    def recording(kernel, *args):
        chosen[kernel] = choose(kernel, *args)
        return chosen[kernel]

    monkeypatch.setattr(triton_module, "launch_config", recording)
    return chosen


def test_launch_config_buckets_by_lengths_and_widest_head_dim():
    choose = triton_module.launch_config
    forward, dq = _GPU_CONFIGS["forward"], _GPU_CONFIGS["dq"]
    with gpu_tiles():
        assert choose("forward", 16, 1000, 128) == forward["decode"][128]
        assert choose("forward", 17, 256, 64) == forward["short"][64]
        assert choose("forward", 17, 256, 65) == forward["short"][128]
        assert choose("forward", 257, 17, 64) == forward["long"][64]
        assert choose("forward", 17, 257, 65) == forward["long"][128]
        assert choose("dq", 300, 300, 64) == dq["long"][64]
        # A bucket a kernel lacks, or lacks a config for the head dim in, falls back to "short".
        assert choose("dq", 300, 300, 65) == dq["short"][128]
        assert choose("dkdv", 1, 300, 65) == _GPU_CONFIGS["dkdv"]["short"][128]
        # Over 128 keys or queries, "mid" before "short"; over 256, "long" before both.
        dkdv = _GPU_CONFIGS["dkdv"]
        assert choose("dkdv", 128, 128, 64) == dkdv["short"][64]
        assert choose("dkdv", 100, 129, 64) == choose("dkdv", 300, 300, 64) == dkdv["mid"][64]
        assert choose("dkdv", 200, 200, 65) == dkdv["short"][128]
    # Outside gpu_tiles(), the interpreter picks its own blocks (a GPU always takes its rules).
    assert (choose("forward", 17, 257, 65) == forward["long"][128]) == use_gpu_tiles()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", GPU_CONFIG_CASES, ids=_gpu_case_id)
def test_triton_gpu_tiling_matches_float64_oracle(case, causal, monkeypatch):
    """Each config on the shape that selects it (head dims just under its widest, v narrower
    than q and k), forward and backward, with the masks and dtypes varied across configs."""
    kernel, bucket, widest, config, narrower = case
    lq, lk = BUCKET_LENGTHS[bucket]
    head_dim = widest - (widest - narrower) // 8  # in (narrower, widest], as value_dim
    value_dim = (narrower + widest) // 2 + 1
    variant = GPU_CONFIG_CASES.index(case) + causal
    masks, dtype = ("lengths", "padding")[variant % 2], (FP16, BF16, FP32)[variant % 3]
    chosen = _recorded_launch_configs(monkeypatch)
    with gpu_tiles():
        _check_triton_case(3, 1, lq, lk, head_dim, causal, masks, dtype, 0.0, value_dim)
    assert chosen[kernel] == config


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_gpu_tiling_bf16_with_an_odd_value_dim(causal):
    """bf16, D 112, Dv 65, lengths (full, none, one key), 45 queries over 70 keys: a dK/dV kernel
    that transposes dS in registers (tl.trans of a dot's result, which triton 3.4 to 3.7.0
    miscompile on Hopper) gets dK wrong here on an H100 (0.40 off where 0.017 is allowed) while
    dQ and dV stay right. The kernel's tiles have the keys along their rows instead, and
    compile_check rejects any kernel that transposes a dot's result."""
    with gpu_tiles():
        _check_triton_case(3, 1, 45, 70, 112, causal, "lengths", BF16, 0.0, 65)


def test_triton_gpu_tiling_with_dropout(monkeypatch):
    """The dropout mask under the long forward and dQ tilings (BLOCK_M 128) and dK/dV's (32)."""
    chosen = _recorded_launch_configs(monkeypatch)
    with gpu_tiles():
        _check_triton_case(2, 1, *BUCKET_LENGTHS["long"], 40, False, "lengths", FP16, 0.3)
    assert chosen["forward"] == _GPU_CONFIGS["forward"]["long"][64]
    assert chosen["dq"] == _GPU_CONFIGS["dq"]["long"][64]


# ---------------------------------------------------------------------------------------------
# C++ backend (csrc/attention.cpp, in fastnmt._C). Fast enough for a wide selection of the edge
# matrix. Without the extension these tests fail, unless FASTNMT_SKIP_EXTENSION=1 says it was
# skipped on purpose.
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def cpp_extension():
    require_backend("cpp")


CPP_CASES = [  # B, H, Lq, Lk, D, causal, masks, dtype, dropout_p
    (1, 1, 1, 1, 16, False, "none", FP32, 0.0),
    (1, 1, 1, 1, 128, True, "none", BF16, 0.3),
    (3, 2, 1, 19, 64, False, "lengths", FP32, 0.0),  # a decoding step against a cache
    (3, 2, 1, 64, 80, True, "padding", BF16, 0.3),
    (3, 1, 7, 1, 48, False, "lengths", FP32, 0.3),  # Lk = 1: lengths 1 and 0
    (2, 3, 7, 19, 48, True, "lengths", BF16, 0.0),
    (3, 2, 7, 19, 16, False, "padding", FP32, 0.3),
    (1, 1, 7, 64, 128, False, "none", FP32, 0.0),
    (2, 2, 33, 33, 64, True, "lengths", FP32, 0.3),  # self-attention
    (3, 2, 33, 33, 64, False, "padding", BF16, 0.3),
    (1, 2, 33, 19, 16, True, "none", BF16, 0.0),  # Lq > Lk
    (3, 1, 33, 64, 80, True, "padding", FP32, 0.0),
    (1, 1, 33, 64, 128, False, "lengths", BF16, 0.3),
    (2, 2, 33, 1, 48, True, "padding", FP32, 0.0),
    (3, 4, 70, 130, 64, True, "lengths", FP32, 0.3),  # several query blocks, Lk > one block
    (2, 2, 70, 70, 80, False, "padding", BF16, 0.0),
    # Up to 8 queries take the decoding path (dot products in place of panels): its edges.
    (3, 2, 4, 21, 20, False, "lengths", BF16, 0.0),  # beam step, D not a multiple of 16
    (2, 2, 8, 40, 64, True, "padding", BF16, 0.3),
    (2, 2, 9, 40, 64, True, "lengths", FP32, 0.3),
]


@pytest.mark.usefixtures("cpp_extension")
class TestCpp:
    @pytest.mark.parametrize(
        "case", CPP_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c)
    )
    def test_matches_float64_oracle(self, case):
        _check_case("cpp", *case)

    # Up to 8 queries: head dims with and without bounds checks (q/k and v whole vectors and
    # equal, or not), up to 16 vectors wide, and wider ones, which take the panel kernel.
    @pytest.mark.parametrize("head_dim, value_dim", [(64, 40), (96, 96), (200, 136), (300, 64)])
    @pytest.mark.parametrize("dtype", [FP32, BF16])
    def test_few_queries_head_dims(self, head_dim, value_dim, dtype):
        _check_case("cpp", 3, 2, 4, 21, head_dim, False, "lengths", dtype, 0.0, value_dim)

    def test_chosen_for_cpu_tensors(self):
        q, k, v = _qkv(2, 2, 3, 5, 16)
        lengths = torch.tensor([5, 2])
        explained = dispatch.explain("attention", q, k, v, key_lengths=lengths, causal=True)
        assert explained["chosen"] == "cpp" and explained["cpp"] == []

    @pytest.mark.parametrize(
        ("override", "reason"),
        [
            (dict(attn_mask=torch.ones(1, 1, 3, 5, dtype=torch.bool)), "attn_mask"),
            (dict(dtype=torch.float64), "dtype torch.float64"),
        ],
    )
    def test_steps_aside_with_a_reason(self, override, reason):
        dtype = override.pop("dtype", torch.float32)
        q, k, v = (torch.randn(1, 2, length, 8, dtype=dtype) for length in (3, 5, 5))
        assert dispatch.explain("attention", q, k, v, **override)["chosen"] == "reference"
        with dispatch.backend("cpp"), pytest.raises(dispatch.BackendUnavailableError, match=reason):
            attention(q, k, v, **override)

    @pytest.mark.parametrize("dtype", [FP32, BF16])
    def test_strided_inputs_and_output_gradient(self, dtype):
        packed = torch.randn(2, 9, 3, 2, 48, dtype=dtype)  # (B, L, 3, H, D): a fused projection
        q, k, v = (packed[:, :, i].transpose(1, 2) for i in range(3))
        grad_out = torch.randn(2, 9, 2, 48, dtype=dtype).transpose(1, 2)
        lengths = torch.tensor([9, 4])
        cpp = functools.partial(_forced, "cpp")
        out, _, grads = _with_grads(cpp, (q, k, v), grad_out, 0.0, key_lengths=lengths)
        contiguous = [x.contiguous() for x in (q, k, v)]
        expected, _, expected_grads = _with_grads(
            cpp, contiguous, grad_out.contiguous(), 0.0, key_lengths=lengths
        )
        assert torch.equal(out, expected)
        for grad, expected_grad in zip(grads, expected_grads, strict=True):
            assert torch.equal(grad, expected_grad)

    @pytest.mark.parametrize("head_dim", [64, 40])
    @pytest.mark.parametrize("causal", [False, True])
    @pytest.mark.parametrize("dtype", [FP32, BF16])
    def test_a_short_sentence_gets_the_same_bits_alone_and_padded_among_longer_ones(
        self, dtype, causal, head_dim
    ):
        """A sentence of up to 8 keys is attended by the few-queries rows whatever the padded
        query count (the panel kernel sums in another order): its self-attention alone and in
        a batch padded to 23 (and 70: two query blocks) gives the same bits, so int8 and bf16
        translations do not depend on a sentence's batch mates."""
        for lq in (23, 70):
            q, k, v = _qkv(4, 2, lq, lq, head_dim, dtype)
            lengths = torch.tensor([7, lq, 1, 8])
            batched = _forced("cpp", q, k, v, 0.0, causal, key_lengths=lengths)
            for b, length in enumerate(lengths.tolist()):
                alone_inputs = (x[b : b + 1, :, :length] for x in (q, k, v))
                alone = _forced("cpp", *alone_inputs, 0.0, causal, key_lengths=lengths[b : b + 1])
                assert torch.equal(batched[0][b : b + 1, :, :length], alone[0]), (lq, b)
                assert torch.equal(batched[1][b : b + 1, :, :length], alone[1]), (lq, b)

    @pytest.mark.parametrize(
        "lq, lk, head_dim, value_dim, causal",
        [(20, 20, 64, 64, False), (33, 19, 64, 48, False), (70, 21, 32, 20, True)],
    )
    def test_bf16_rows_read_in_place_give_the_bits_of_fp32_panels(
        self, lq, lk, head_dim, value_dim, causal
    ):
        """bf16 q and k rows of whole 32-bit words feed the bf16 products in place; rows at odd
        offsets are converted to fp32 panels first. The operands are the same, so the bits are."""
        q, k, v = _qkv(3, 2, lq, lk, head_dim, BF16, value_dim=value_dim)

        def at_odd_offsets(x):  # the same values, each row starting mid-word
            padded = torch.empty(*x.shape[:-1], x.shape[-1] + 1, dtype=x.dtype)
            padded[..., 1:] = x
            return padded[..., 1:]

        lengths = torch.tensor([lk, lk // 2, 1])
        in_place = _forced("cpp", q, k, v, 0.0, causal, key_lengths=lengths)
        odd = [at_odd_offsets(x) for x in (q, k, v)]
        assert odd[0].stride(2) % 2 == 1
        through_panels = _forced("cpp", *odd, 0.0, causal, key_lengths=lengths)
        for got, expected in zip(in_place, through_panels, strict=True):
            assert torch.equal(got, expected)

    def test_results_do_not_depend_on_the_thread_count(self):
        q, k, v = _qkv(3, 5, 70, 70, 48)
        grad_out = torch.randn(3, 5, 70, 48)
        masks = _masks("padding", 3, 70)
        threads = torch.get_num_threads()
        results = []
        try:
            for count in (1, 2):
                torch.set_num_threads(count)
                torch.manual_seed(3)
                cpp = functools.partial(_forced, "cpp")
                results.append(_with_grads(cpp, (q, k, v), grad_out, 0.3, True, **masks))
        finally:
            torch.set_num_threads(threads)
        (out1, lse1, grads1), (out2, lse2, grads2) = results
        assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
        assert all(torch.equal(a, b) for a, b in zip(grads1, grads2, strict=True))

    def test_opcheck_forward_and_backward_ops(self):
        q = torch.randn(2, 5, 2, 16).transpose(1, 2)  # strided, as MultiheadAttention's heads
        _, k, v = _qkv(2, 2, 5, 7, 16)
        lengths = torch.tensor([7, 2])
        padding = torch.rand(2, 7) < 0.3
        # The Triton ops' arguments, in their order; no seed without dropout.
        with_dropout = ((lengths, None), dropout_seed(q.device), 0.3)
        for masks, seed, dropout_p in (with_dropout, ((None, padding), None, 0.0)):
            forward = (q.requires_grad_(), k, v, *masks, seed, True, dropout_p, 0.25, None)
            torch.library.opcheck(torch.ops.fastnmt.attention_cpp.default, forward)
            out, lse = torch.ops.fastnmt.attention_cpp(*forward)
            backward = (torch.randn_like(out), torch.randn_like(lse), q.detach(), k, v)
            backward += (out.detach(), lse.detach(), *masks, seed, True, dropout_p, 0.25)
            torch.library.opcheck(torch.ops.fastnmt.attention_cpp_backward.default, backward)


# ---------------------------------------------------------------------------------------------
# Both fused backends (the ``fused`` fixture forces each in turn).
# ---------------------------------------------------------------------------------------------


def test_fused_gradient_through_lse(fused):
    device = device_of(fused)
    q, k, v = (x.requires_grad_() for x in _qkv(2, 2, 7, 19, 16, device=device))
    lengths = torch.tensor([19, 5], device=device)
    upstream = torch.randn(2, 2, 7, 16, device=device), torch.randn(2, 2, 7, device=device)
    out, lse = _forced(fused, q, k, v, 0.0, True, key_lengths=lengths)
    grads = torch.autograd.grad((out, lse), (q, k, v), upstream)
    expected_out, expected_lse = _oracle(q, k, v, None, 0.0, key_lengths=lengths, causal=True)
    upstream64 = tuple(u.double() for u in upstream)
    expected = torch.autograd.grad((expected_out, expected_lse), (q, k, v), upstream64)
    for grad, expected_grad in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad, expected_grad, atol=1e-5, rtol=1e-5)


def test_fused_outputs_lie_heads_inner_so_joining_the_heads_is_a_view(fused):
    """(B, H, Lq, Dv) outputs lie (B, Lq, H, Dv) in memory, as FlashAttention's: the
    ``transpose(1, 2).reshape(B, Lq, H * Dv)`` before an output projection (fastnmt's module,
    transformers' attention layers) is a view, not a copy of every output."""
    device = device_of(fused)
    q, k, v = _qkv(2, 3, 5, 7, 16, requires_grad=True, device=device)
    out = attention(q, k, v, key_lengths=torch.tensor([7, 2], device=device))
    assert out.shape == (2, 3, 5, 16) and out.transpose(1, 2).is_contiguous()
    joined = out.transpose(1, 2).reshape(2, 5, 48)
    assert joined._is_view() and joined.data_ptr() == out.data_ptr()
    joined.backward(torch.randn_like(joined))  # a (B, Lq, E)-contiguous gradient, read in place
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def test_fused_gradients_are_laid_out_as_their_dense_inputs(fused):
    """As SDPA's: the gradient of ``proj(h).view(B, L, H, D).transpose(1, 2)`` reaches the
    projection's (B, L, H * D) output as a view (in transformers' layers a contiguous gradient
    cost a copy per projection); a non-dense input (a chunk of a fused qkv) gets a gradient
    dense in its dimension order (here contiguous), not one with its gaps."""
    device = device_of(fused)
    projected = torch.randn(2, 5, 3, 16, device=device, requires_grad=True)  # (B, L, H, D)
    fused_qkv = torch.randn(2, 3, 5, 48, device=device, requires_grad=True)
    q = projected.transpose(1, 2)  # dense, heads outside positions
    k, v = fused_qkv[..., :16], fused_qkv[..., 16:32]  # not dense
    out = attention(q, k, v, key_lengths=torch.tensor([5, 2], device=device))
    upstream = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), upstream)
    assert dq.stride() == q.stride() and dk.is_contiguous() and dv.is_contiguous()
    inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    lengths = torch.tensor([5, 2], device=device)
    expected = torch.autograd.grad(
        _oracle(*inputs, None, 0.0, key_lengths=lengths)[0], inputs, upstream.double()
    )
    for grad, expected_grad in zip((dq, dk, dv), expected, strict=True):
        torch.testing.assert_close(grad, expected_grad.float(), atol=1e-5, rtol=1e-5)


def test_fused_rows_that_see_no_key_give_zero_output_and_zero_grad(fused):
    device = device_of(fused)
    q, k, v = _qkv(3, 2, 4, 5, 16, requires_grad=True, device=device)
    padding = torch.zeros(3, 5, dtype=torch.bool, device=device)
    padding[1] = True
    out, lse = _forced(fused, q, k, v, 0.3, key_padding_mask=padding)
    out.backward(torch.randn_like(out))
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()
    for grad in (q.grad, k.grad, v.grad):
        assert torch.isfinite(grad).all() and (grad[1] == 0).all()


@pytest.mark.parametrize("backend", ["reference", "triton", "cpp"])
def test_out_of_range_key_lengths_are_clamped(backend):
    """Every backend reads a length below 0 as 0 (no key: zero output and gradients) and one
    past Lk as Lk, without reading out of bounds."""
    require_backend(backend)
    device = device_of(backend)
    lq, lk = 6, 11
    q, k, v = _qkv(3, 2, lq, lk, 24, device=device)
    grad_out = torch.randn(3, 2, lq, 24, device=device)
    lengths = torch.tensor([-1, lk + 3, 4], device=device)
    run = functools.partial(_forced, backend)
    out, lse, grads = _with_grads(run, (q, k, v), grad_out, 0.0, True, key_lengths=lengths)
    clamped = torch.tensor([0, lk, 4], device=device)
    expected, expected_lse, expected_grads = _oracle_with_grads(
        (q, k, v), grad_out, None, 0.0, causal=True, key_lengths=clamped
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.isneginf(lse[0]).all() and torch.isfinite(lse[1:]).all()
    torch.testing.assert_close(lse[1:].double(), expected_lse[1:], atol=1e-5, rtol=1e-5)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad.double(), expected_grad, atol=1e-5, rtol=1e-5)
        assert (grad[0] == 0).all()


class TestFusedDropout:
    def test_keep_fraction_and_seed_dependence(self, fused):
        shape, p = (4, 4, 64, 64), 0.3
        keep_mask = _keep_mask_writer(fused)
        seed = dropout_seed(device_of(fused))
        keep = keep_mask(seed, shape, p)
        assert abs(keep.float().mean().item() - (1 - p)) < 0.01
        assert torch.equal(keep_mask(seed, shape, p), keep)
        other = keep_mask(dropout_seed(seed.device), shape, p)
        assert abs((other == keep).float().mean().item() - (p**2 + (1 - p) ** 2)) < 0.01

    def test_output_keeps_one_minus_p_of_the_mass(self, fused):
        q, k, v = _qkv(4, 4, 64, 64, 16, device=device_of(fused))
        out = _forced(fused, q, torch.zeros_like(k), torch.ones_like(v), 0.3)[0]  # P = 1/64
        assert abs((out[..., 0] * 0.7).mean().item() - 0.7) < 0.01

    def test_same_seed_same_output(self, fused):
        q, k, v = _qkv(2, 2, 8, 8, 16, device=device_of(fused))
        torch.manual_seed(5)
        first = _forced(fused, q, k, v, 0.3)[0]
        second = _forced(fused, q, k, v, 0.3)[0]
        torch.manual_seed(5)
        assert torch.equal(first, _forced(fused, q, k, v, 0.3)[0])
        assert not torch.equal(first, second)


# ---------------------------------------------------------------------------------------------
# cache_rows: keys and values read through a decoding cache's rows, on every backend.
# ---------------------------------------------------------------------------------------------

CACHE_ROWS_CASES = [  # P (stored entries), B, Lq, Lk, D
    (5, 3, 1, 7, 16),  # one decoding step, more entries stored than read
    (2, 6, 4, 9, 24),  # entries shared by several batch entries (beams of one sentence)
    (4, 4, 11, 1, 16),  # Lk = 1; Lq past the C++ few-queries path
    (3, 2, 70, 37, 16),  # several query and key blocks
]


def _cache_rows_inputs(case, device, dtype=FP32):
    entries, batch, lq, lk, head_dim = case
    q = torch.randn(batch, 2, lq, head_dim, device=device, dtype=dtype)
    # k and v stored position-major, as KVCache stores a self-attention cache
    k, v = (
        torch.randn(lk, entries, 2, head_dim, device=device, dtype=dtype).permute(1, 2, 0, 3)
        for _ in range(2)
    )
    # a column slice of a wider table, as KVCache passes the rows of its filled positions
    rows = torch.randint(0, entries, (batch, lk + 5), device=device)[:, :lk]
    lengths = random_lengths(batch, lk).to(device)
    return q, k, v, rows, lengths


def test_gather_cache_rows_picks_each_key_from_its_entry():
    k = torch.randn(3, 2, 4, 5)
    rows = torch.tensor([[2, 0, 0, 1], [1, 1, 2, 2]])
    gathered = attention_module.gather_cache_rows(k, rows)
    assert gathered.shape == (2, 2, 4, 5)
    for b in range(2):
        for j in range(4):
            assert torch.equal(gathered[b, :, j], k[rows[b, j], :, j])


@pytest.mark.parametrize("backend", ["reference", "triton", "cpp"])
@pytest.mark.parametrize("case", CACHE_ROWS_CASES, ids=str)
@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_cache_rows_equal_attention_over_the_gathered_keys(backend, case, dtype):
    """Reading through cache rows is the same computation as on the gathered batch: the same
    backend gives the same bits, and both stay within the error rule of the float64 oracle."""
    require_backend(backend)
    device = device_of(backend)
    q, k, v, rows, lengths = _cache_rows_inputs(case, device, dtype)
    gather = attention_module.gather_cache_rows
    with dispatch.backend(backend):
        out = attention(q, k, v, key_lengths=lengths, causal=True, cache_rows=rows)
        expected = attention(q, gather(k, rows), gather(v, rows), key_lengths=lengths, causal=True)
    assert torch.equal(out, expected)
    oracle, _, _ = attention_oracle(
        q, gather(k, rows), gather(v, rows), key_lengths=lengths, causal=True
    )
    plain, _ = _plain_torch(
        q, gather(k, rows), gather(v, rows), None, 0.0, True, key_lengths=lengths
    )
    assert_error_within(out, plain, oracle, factor=2, atol=ATOL[dtype])


def test_cpp_reads_strided_cache_rows_in_place(cpp_extension):
    """Decoding passes a column slice of the cache's table at every step: no copy of it."""
    q, k, v, rows, lengths = _cache_rows_inputs(CACHE_ROWS_CASES[0], "cpu")
    assert not rows.is_contiguous()
    with dispatch.backend("cpp"), torch.profiler.profile() as profile:
        attention(q, k, v, key_lengths=lengths, causal=True, cache_rows=rows)
    copies = [e.name for e in profile.events() if e.name in ("aten::clone", "aten::copy_")]
    assert not copies, copies


CACHE_ROWS_ERRORS = [
    (dict(cache_rows=torch.zeros(3, 7)), TypeError, "cache_rows must be int32 or int64"),
    (dict(cache_rows=torch.zeros(3, 6, dtype=torch.long)), ValueError, "cache_rows"),
    (dict(cache_rows=torch.zeros(7, dtype=torch.long)), ValueError, "cache_rows"),
]


@pytest.mark.parametrize(("override", "error", "message"), CACHE_ROWS_ERRORS)
def test_bad_cache_rows_name_the_argument(override, error, message):
    q, k, v, _, _ = _cache_rows_inputs(CACHE_ROWS_CASES[0], "cpu")
    with pytest.raises(error, match=message) as raised:
        attention(q, k, v, **override)
    assert "\n" not in str(raised.value)


def test_cache_rows_refuse_gradients():
    q, k, v, rows, _ = _cache_rows_inputs(CACHE_ROWS_CASES[0], "cpu")
    with pytest.raises(ValueError, match="cache_rows is for decoding"):
        attention(q.requires_grad_(), k, v, cache_rows=rows)


@pytest.mark.parametrize("backend", ["reference", "cpp"])
def test_cache_rows_out_of_range_raise(backend, monkeypatch):
    """The C++ kernel checks every entry; the reference under FASTNMT_CHECK_VALUES=1."""
    require_backend(backend)
    if backend == "reference":
        monkeypatch.setenv("FASTNMT_CHECK_VALUES", "1")
        settings.reload()
    q, k, v, rows, _ = _cache_rows_inputs(CACHE_ROWS_CASES[0], "cpu")
    rows[1, 2] = k.shape[0]
    with dispatch.backend(backend), pytest.raises((ValueError, RuntimeError)) as raised:
        attention(q, k, v, cache_rows=rows)
    assert "cache_rows must lie in [0, 5)" in str(raised.value)


def test_opcheck_with_cache_rows(fused):
    q, k, v, rows, lengths = _cache_rows_inputs(CACHE_ROWS_CASES[1], device_of(fused))
    op = {"triton": torch.ops.fastnmt.attention_forward, "cpp": torch.ops.fastnmt.attention_cpp}
    forward = (q, k, v, lengths, None, None, False, 0.0, 0.25, rows)
    torch.library.opcheck(op[fused].default, forward, test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------
# Packed sequences (attention_varlen): each sequence against the float64 oracle alone.
# ---------------------------------------------------------------------------------------------

VARLEN_CASES = [  # (query lengths, key lengths), head dim, value dim
    (([1], [1]), 16, 16),
    (([3, 0, 9, 1], [5, 2, 9, 0]), 16, 16),  # an empty sequence; queries that see no key
    (([7, 8, 2], [7, 8, 2]), 64, 40),  # up to 8 queries: the decoding path's rows
    (([70, 13, 130], [70, 20, 5]), 64, 64),  # several query blocks; Lq != Lk
    (([33, 19], [19, 33]), 80, 80),  # head dims of no whole vectors
]


def _packed(lengths, heads, width, dtype, generator):
    return torch.randn(sum(lengths), heads, width, generator=generator).to(dtype)


def _cu_seqlens(lengths, dtype=torch.int64):
    return torch.tensor([0, *lengths], dtype=dtype).cumsum(0).to(dtype)


def _varlen_inputs(case, dtype, seed, device="cpu"):
    (query_lengths, key_lengths), head_dim, value_dim = case
    generator = torch.Generator().manual_seed(seed)
    q = _packed(query_lengths, 2, head_dim, dtype, generator)
    k = _packed(key_lengths, 2, head_dim, dtype, generator)
    v = _packed(key_lengths, 2, value_dim, dtype, generator)
    inputs = (q, k, v, _cu_seqlens(query_lengths), _cu_seqlens(key_lengths))
    return [x.to(device) for x in inputs]


def _each_sequence(q, k, v, cu_q, cu_k):
    """(q, k, v) of each sequence as a batch of one (1, H, L, D)."""
    for b in range(len(cu_q) - 1):
        rows = [x[start:end].transpose(0, 1)[None] for x, start, end in (
            (q, cu_q[b], cu_q[b + 1]), (k, cu_k[b], cu_k[b + 1]), (v, cu_k[b], cu_k[b + 1]),
        )]  # fmt: skip
        yield rows


def _dropped(probs, keep, b, dropout_p):
    """Sequence b's probabilities (1, H, Lq, Lk) after dropout with the kernels' keep mask (B, H,
    max Lq, max Lk), or as they are without one."""
    if keep is None:
        return probs
    _, _, lq, lk = probs.shape
    return probs * keep[b : b + 1, :, :lq, :lk].to(probs.dtype) / (1 - dropout_p)


def _varlen_oracle(q, k, v, cu_q, cu_k, causal, keep=None, dropout_p=0.0):
    """float64 out (total_q, H, Dv) and lse (H, total_q), sequence by sequence (with dropout:
    the kernels' keep mask)."""
    outs, lses = [], []
    for b, (q_b, k_b, v_b) in enumerate(_each_sequence(q, k, v, cu_q, cu_k)):
        if not k_b.shape[2]:  # no key: zeros, lse -inf
            outs.append(q_b.new_zeros(q_b.shape[2], q_b.shape[1], v_b.shape[3], dtype=FP64))
            lses.append(torch.full(q_b.shape[1:3], float("-inf"), dtype=FP64, device=q.device))
            continue
        _, lse, probs = attention_oracle(q_b, k_b, v_b, causal=causal)
        outs.append((_dropped(probs, keep, b, dropout_p) @ v_b.double())[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def _varlen_plain(q, k, v, cu_q, cu_k, causal, keep=None, dropout_p=0.0):
    """Plain PyTorch in the inputs' dtype, sequence by sequence (the error baseline)."""
    outs = []
    for b, (q_b, k_b, v_b) in enumerate(_each_sequence(q, k, v, cu_q, cu_k)):
        probs = attention_probabilities(q_b, k_b, causal=causal)  # (1, H, Lq, Lk)
        outs.append((_dropped(probs, keep, b, dropout_p) @ v_b)[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.fixture
def poisoned_outputs():
    """Fresh outputs (at::empty / torch.empty) hold NaN: an element a kernel never writes shows."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)


@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("backend", ["cpp", "triton", "reference"])
@pytest.mark.parametrize("case", VARLEN_CASES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_varlen_matches_float64_oracle(backend, case, causal, dtype):
    require_backend(backend)
    seed = int(torch.randint(2**31, ()))
    q, k, v, cu_q, cu_k = _varlen_inputs(case, dtype, seed, device_of(backend))
    longest_q, longest_k = (max(lengths) for lengths in case[0])
    with dispatch.backend(backend):
        out, lse = attention_varlen(
            q, k, v, cu_q, cu_k, longest_q, longest_k, causal=causal, return_lse=True
        )
    expected, expected_lse = _varlen_oracle(q, k, v, cu_q, cu_k, causal)
    assert out.shape == expected.shape and out.dtype == dtype
    assert_error_within(out, _varlen_plain(q, k, v, cu_q, cu_k, causal), expected, 2, ATOL[dtype])
    finite = torch.isfinite(expected_lse)
    assert lse.shape == (2, len(q)) and torch.equal(torch.isfinite(lse), finite)
    tolerance = 1e-4 if dtype == FP32 else 2e-2  # the reference's bf16 scores are rounded
    torch.testing.assert_close(lse.double()[finite], expected_lse[finite], atol=tolerance, rtol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_varlen_with_gpu_tiles_matches_float64_oracle(causal):
    """A GPU's blocks (64 queries, 32 to 64 keys): sequences of several blocks, and programs past
    a short sequence's queries or keys (the grid covers the longest), which must write nothing
    of another sequence's: output and gradients against the oracle."""
    inputs = _varlen_inputs(VARLEN_CASES[3], FP32, 2, TRITON_DEVICE)
    q, k, v, cu_q, cu_k = (x.requires_grad_() if x.is_floating_point() else x for x in inputs)
    with gpu_tiles(), dispatch.backend("triton"):
        out, lse = attention_varlen(q, k, v, cu_q, cu_k, 130, 70, causal=causal, return_lse=True)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    doubles = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected, expected_lse = _varlen_oracle(*doubles, cu_q, cu_k, causal)
    expected_grads = torch.autograd.grad(expected, doubles, torch.ones_like(expected))
    plain = _varlen_plain(q.detach(), k.detach(), v.detach(), cu_q, cu_k, causal)
    assert_error_within(out, plain, expected, 2, ATOL[FP32])
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-4)
    for grad, oracle in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad.double(), oracle, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_varlen_dropout_draws_the_padded_kernels_mask(backend, dtype):
    """keep_ij of sequence b's query i and key j is the padded kernels' (b, i, j) draw with the
    longest lengths: output and gradients against the float64 oracle given that mask."""
    require_backend(backend)
    device, p = device_of(backend), 0.3
    case = VARLEN_CASES[3]
    inputs = _varlen_inputs(case, dtype, int(torch.randint(2**31, ())), device)
    q, k, v, cu_q, cu_k = inputs
    longest_q, longest_k = (max(lengths) for lengths in case[0])
    grad_out = torch.randn(len(q), 2, v.shape[2], dtype=dtype, device=device)
    generator_seed = int(torch.randint(2**31, ()))
    torch.manual_seed(generator_seed)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with dispatch.backend(backend):
        out = attention_varlen(*leaves, cu_q, cu_k, longest_q, longest_k, causal=True, dropout_p=p)
    grads = torch.autograd.grad(out, leaves, grad_out)
    shape = (len(cu_q) - 1, 2, longest_q, longest_k)
    keep = _kernel_keep_mask(backend, generator_seed, device, shape, p)
    assert not keep.all()

    def with_grads(function, inputs):
        leaves = [x.detach().requires_grad_() for x in inputs]
        result = function(*leaves, cu_q, cu_k, True, keep, p)
        result = result[0] if isinstance(result, tuple) else result
        return result, torch.autograd.grad(result, leaves, grad_out.to(result.dtype))

    expected, expected_grads = with_grads(_varlen_oracle, [x.double() for x in (q, k, v)])
    plain, plain_grads = with_grads(_varlen_plain, (q, k, v))
    assert_error_within(out.detach(), plain, expected, 2, ATOL[dtype])
    named = zip(("dq", "dk", "dv"), grads, plain_grads, expected_grads, strict=True)
    for name, grad, plain_grad, expected_grad in named:
        assert_error_within(grad, plain_grad, expected_grad, 3, ATOL[dtype], name)


def test_varlen_equals_the_padded_batch():
    """The C++ kernel gives each sequence what ``attention`` gives it in a padded batch with key
    lengths (the same kernels, reading rows through cu_seqlens)."""
    require_backend("cpp")
    q, k, v, cu_q, cu_k = _varlen_inputs(VARLEN_CASES[3], BF16, 0)
    out = attention_varlen(q, k, v, cu_q, cu_k, 130, 70)
    for b, (q_b, k_b, v_b) in enumerate(_each_sequence(q, k, v, cu_q, cu_k)):
        alone = attention(q_b, k_b, v_b)[0].transpose(0, 1)
        assert torch.equal(out[cu_q[b] : cu_q[b + 1]], alone)


@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("backend", ["cpp", "triton", "reference"])
@pytest.mark.parametrize("case", VARLEN_CASES[1:], ids=str)
@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_varlen_gradients_match_float64_oracle(backend, case, dtype):
    """FlashAttention's rule for dq, dk, dv (3x plain PyTorch's error), causal, with the
    gradient flowing through the LSE too (weighted)."""
    require_backend(backend)
    seed = int(torch.randint(2**31, ()))
    q, k, v, cu_q, cu_k = _varlen_inputs(case, dtype, seed, device_of(backend))
    longest_q, longest_k = (max(lengths) for lengths in case[0])
    grad_out = torch.randn(len(q), 2, v.shape[2], dtype=dtype, device=q.device)
    lse_weights = torch.rand(2, len(q), device=q.device)

    def loss(out, lse):
        finite = torch.isfinite(lse)  # a row that sees no key has lse -inf and no gradient
        return (out.double() * grad_out.double()).sum() + (lse.double() * lse_weights)[finite].sum()

    def grads(function, inputs):
        leaves = [x.detach().requires_grad_() for x in inputs]
        return torch.autograd.grad(loss(*function(*leaves)), leaves)

    def fused(q, k, v):
        with dispatch.backend(backend):
            return attention_varlen(
                q, k, v, cu_q, cu_k, longest_q, longest_k, causal=True, return_lse=True
            )

    def plain(q, k, v):  # the same-dtype baseline's LSE: the oracle's, from these inputs
        return _varlen_plain(q, k, v, cu_q, cu_k, True), _varlen_oracle(q, k, v, cu_q, cu_k, True)[
            1
        ]

    got = grads(fused, (q, k, v))
    expected = grads(
        lambda *x: _varlen_oracle(*x, cu_q, cu_k, True), [x.double() for x in (q, k, v)]
    )
    baseline = grads(plain, (q, k, v))
    for name, *tensors in zip(("dq", "dk", "dv"), got, baseline, expected, strict=True):
        assert tensors[0].dtype == dtype
        assert_error_within(*tensors, 3, ATOL[dtype], name)


def test_varlen_takes_int32_cu_seqlens_and_strided_inputs():
    require_backend("cpp")
    (query_lengths, _), *_ = VARLEN_CASES[1]
    packed = torch.randn(13, 3, 2, 16)  # (total, 3, H, D): a fused qkv projection
    q, k, v = packed.unbind(1)
    cu = _cu_seqlens(query_lengths, torch.int32)
    out = attention_varlen(q, k, v, cu, cu, 9, 9, causal=True)
    expected = attention_varlen(
        q.contiguous(), k.contiguous(), v.contiguous(), cu.long(), cu.long(), 9, 9, causal=True
    )
    assert torch.equal(out, expected)


VARLEN_ERRORS = [
    (dict(q=torch.randn(1, 4, 2, 8)), ValueError, "q must have 3 dimensions"),
    (dict(k=torch.randn(5, 3, 8)), ValueError, r"k must have shape \(5, 2, 8\)"),
    (dict(v=torch.randn(4, 2, 8)), ValueError, r"v must have shape \(5, 2, 8\)"),
    (dict(v=torch.randn(5, 2, 8, dtype=torch.float64)), TypeError, "v has dtype"),
    (dict(cu_seqlens_q=torch.tensor([0.0, 3.0])), ValueError, "cu_seqlens_q must be int32"),
    (dict(cu_seqlens_k=torch.tensor([0, 2, 5])), ValueError, "must both be"),
    (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be an int >= 0"),
    (dict(max_seqlen_k=True), ValueError, "max_seqlen_k must be an int >= 0"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_seed=torch.tensor([1])), ValueError, "dropout_seed must be an int64 tensor"),
    (dict(cu_seqlens_q=torch.tensor([0, 2])), ValueError, r"cu_seqlens_q must run from 0 to 3"),
    (dict(max_seqlen_k=4), ValueError, r"cu_seqlens_k must give lengths in \[0, max_seqlen_k"),
]


@pytest.mark.parametrize(("override", "error", "message"), VARLEN_ERRORS)
def test_varlen_bad_inputs_name_the_argument(override, error, message, monkeypatch):
    monkeypatch.setenv("FASTNMT_CHECK_VALUES", "1")  # cu_seqlens' values are checked too
    settings.reload()
    arguments = dict(
        q=torch.randn(3, 2, 8), k=torch.randn(5, 2, 8), v=torch.randn(5, 2, 8),
        cu_seqlens_q=torch.tensor([0, 3]), cu_seqlens_k=torch.tensor([0, 5]), max_seqlen_q=3,
        max_seqlen_k=5,
    )  # fmt: skip
    arguments.update(override)
    keywords = {name: arguments.pop(name) for name in ("causal", "dropout_p", "dropout_seed")
                if name in arguments}  # fmt: skip
    with pytest.raises(error, match=message):
        attention_varlen(*arguments.values(), **keywords)


def test_cpp_varlen_checks_cu_seqlens_without_value_checks():
    """On the CPU reading them is free: the kernel never reads through unchecked offsets."""
    require_backend("cpp")
    q = torch.randn(3, 2, 8)
    with pytest.raises(RuntimeError, match="cu_seqlens_k must run from 0 to 3"):
        attention_varlen(q, q, q, torch.tensor([0, 3]), torch.tensor([0, 4]), 3, 4)
    with pytest.raises(
        RuntimeError, match=r"cu_seqlens_q must give lengths in \[0, max_seqlen_q = 2\]"
    ):
        attention_varlen(q, q, q, torch.tensor([0, 3]), torch.tensor([0, 3]), 2, 3)


@pytest.mark.parametrize("backend", ["triton", "cpp"])
def test_opcheck_varlen_ops(backend):
    """Their fakes and schemas (torch.compile traces a packed model through them)."""
    require_backend(backend)
    q, k, v, cu_q, cu_k = _varlen_inputs(VARLEN_CASES[1], FP32, 3, device_of(backend))
    seed = dropout_seed(q.device)
    forward = (q.requires_grad_(), k, v, cu_q, cu_k, 9, 9, seed, True, 0.3, 0.25)
    ops = {
        "triton": ("attention_varlen_forward", "attention_varlen_backward"),
        "cpp": ("attention_varlen_cpp", "attention_varlen_cpp_backward"),
    }[backend]
    forward_op, backward_op = (getattr(torch.ops.fastnmt, name).default for name in ops)
    opcheck(forward_op, forward)
    out, lse = forward_op(*forward)
    backward = (torch.randn_like(out), torch.randn_like(lse), q.detach(), k, v, out.detach())
    opcheck(backward_op, (*backward, lse.detach(), *forward[3:]))
