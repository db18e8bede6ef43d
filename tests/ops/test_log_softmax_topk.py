"""fastnmt.ops.log_softmax_topk: both backends against log_softmax + a stable sort in float64
(the C++ kernel in the same order, ties included)."""

import math
import re

import pytest
import torch

import fastnmt
from fastnmt.ops import dispatch, log_softmax_topk
from tests.helpers import require_backend

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _oracle(logits, k, banned):
    """float64 log_softmax, then banned columns at -inf (they stay in the normaliser, as in
    fairseq and transformers); a row with none allowed: all -inf, not NaN. The first k of a
    stable descending sort."""
    z = logits.double().log_softmax(-1).index_fill(1, banned, float("-inf"))
    values, indices = z.sort(dim=-1, descending=True, stable=True)
    values = values[:, :k]
    return values.masked_fill(values.isnan(), float("-inf")), indices[:, :k]


@pytest.fixture
def cpp():
    require_backend("cpp")
    with fastnmt.backend("cpp"):
        yield


@pytest.mark.parametrize(
    ("rows", "vocab", "k"),
    [(1, 1, 1), (3, 17, 17), (5, 33, 4), (64, 8003, 1), (7, 8000, 8), (2, 100, 40)],
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_matches_the_float64_oracle(backend, dtype, rows, vocab, k):
    require_backend(backend)
    logits = (torch.randn(rows, vocab) * 4).to(dtype)
    banned = torch.tensor([0, min(2, vocab - 1)])
    with fastnmt.backend(backend):
        values, indices = log_softmax_topk(logits, k, banned)
    expected_values, expected_indices = _oracle(logits, k, banned)
    assert values.dtype == torch.float32 and indices.dtype == torch.int64
    assert values.shape == indices.shape == (rows, k)
    torch.testing.assert_close(values.double(), expected_values, rtol=1e-5, atol=1e-5)
    if backend == "cpp":  # ties to the lower column: exactly the stable sort's order
        torch.testing.assert_close(indices, expected_indices, rtol=0, atol=0)
    else:  # ties in torch.topk's order: each index holds its value
        chosen = logits.double().log_softmax(-1).index_fill(1, banned, float("-inf"))
        chosen = chosen.gather(1, indices)
        torch.testing.assert_close(
            chosen.nan_to_num(float("-inf"), neginf=float("-inf")),
            expected_values,
            rtol=1e-5,
            atol=1e-5,
        )


def _ensemble_oracle(logits, k, banned):
    """The members' float64 probabilities averaged, as log-probabilities; then ``_oracle``'s
    choice (every member normalised over every column, banned ones included)."""
    log_probs = logits.double().log_softmax(-1).nan_to_num(float("-inf"), neginf=float("-inf"))
    average = log_probs.logsumexp(0) - math.log(logits.shape[0])
    values, indices = average.index_fill(1, banned, float("-inf")).sort(-1, descending=True)
    return values[:, :k], indices[:, :k]


@pytest.mark.parametrize(("members", "rows", "vocab", "k"), [(2, 5, 33, 4), (3, 7, 8003, 8)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_an_ensemble_averages_its_members_probabilities(backend, dtype, members, rows, vocab, k):
    """Against float64: a member's row at -inf leaves the others' average (halved, as fairseq
    averages); a row no member can continue gives -inf."""
    require_backend(backend)
    logits = (torch.randn(members, rows, vocab) * 4).to(dtype)
    logits[0, 1] = float("-inf")
    logits[:, 2] = float("-inf")
    banned = torch.tensor([0, 2])
    with fastnmt.backend(backend):
        values, indices = log_softmax_topk(logits, k, banned)
    expected_values, expected_indices = _ensemble_oracle(logits, k, banned)
    assert values.shape == indices.shape == (rows, k) and values.dtype == torch.float32
    torch.testing.assert_close(values.double(), expected_values, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(values[2]).all()
    finite = torch.isfinite(expected_values)
    torch.testing.assert_close(indices[finite], expected_indices[finite], rtol=0, atol=0)


@pytest.mark.parametrize(("rows", "vocab", "k"), [(1, 1, 1), (5, 33, 4), (37, 8003, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_row_scales_are_applied_as_the_logits_are_read(backend, dtype, rows, vocab, k):
    """An int8 output layer's unscaled rows and their scales: as the scaled logits against
    float64, and on the C++ kernel, bit for bit as the logits scaled first in float32 (one
    rounding either way); a row of scale 0 is uniform."""
    require_backend(backend)
    logits = (torch.randn(rows, vocab) * 400).to(dtype)
    scales = torch.rand(rows) / 100
    scales[-1] = 0.0
    banned = torch.tensor([0, min(2, vocab - 1)])
    with fastnmt.backend(backend):
        values, indices = log_softmax_topk(logits, k, banned, row_scales=scales)
        scaled_first = log_softmax_topk(logits.float() * scales[:, None], k, banned)
    expected_values, expected_indices = _oracle(logits.double() * scales[:, None], k, banned)
    torch.testing.assert_close(values.double(), expected_values, rtol=1e-5, atol=1e-5)
    if backend == "cpp":
        torch.testing.assert_close((values, indices), scaled_first, rtol=0, atol=0)
        torch.testing.assert_close(indices, expected_indices, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("logits", "scales", "match"),
    [
        (torch.randn(3, 5), torch.ones(4), r"row_scales must be float32 \(N,\).*\(4,\)"),
        (torch.randn(3, 5), torch.ones(3).double(), "row_scales must be float32"),
        (torch.randn(2, 3, 5), torch.ones(3), "one model's"),
    ],
)
@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_bad_row_scales_are_named(backend, logits, scales, match):
    require_backend(backend)
    with fastnmt.backend(backend), pytest.raises(ValueError, match=match) as raised:
        log_softmax_topk(logits, 2, None, row_scales=scales)
    assert "\n" not in str(raised.value)


def test_ties_go_to_the_lower_column_first(cpp):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0] * 5])
    values, indices = log_softmax_topk(logits, 5)
    assert indices.tolist() == [[1, 2, 4, 7, 8]]
    assert torch.unique(values[0, :5]).numel() == 1


def test_banned_columns_come_last_with_minus_infinity(cpp):
    logits = torch.randn(4, 6)
    values, indices = log_softmax_topk(logits, 6, torch.tensor([5, 1]))
    assert set(indices[:, 4:].flatten().tolist()) == {1, 5}
    assert torch.isinf(values[:, 4:]).all() and torch.isfinite(values[:, :4]).all()
    # The banned columns keep their share of the normaliser: the allowed ones sum to the rest.
    allowed = 1 - logits.softmax(-1)[:, [1, 5]].sum(-1)
    torch.testing.assert_close(values[:, :4].exp().sum(-1), allowed)


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_a_row_with_nothing_allowed_gives_minus_infinity(backend):
    """All -inf, or finite only in banned columns: no token can be chosen."""
    require_backend(backend)
    logits = torch.randn(3, 3)
    logits[1] = float("-inf")
    logits[2, 1:] = float("-inf")
    with fastnmt.backend(backend):
        values, _ = log_softmax_topk(logits, 2, torch.tensor([0]))
    assert torch.isfinite(values[0]).all()
    assert torch.isneginf(values[1:]).all()


def test_non_contiguous_logits(cpp):
    logits = torch.randn(40, 6).t()  # (6, 40), column-major
    values, indices = log_softmax_topk(logits, 3)
    expected_values, expected_indices = _oracle(logits, 3, torch.empty(0, dtype=torch.int64))
    torch.testing.assert_close(indices, expected_indices, rtol=0, atol=0)
    torch.testing.assert_close(values.double(), expected_values, rtol=1e-5, atol=1e-5)


def test_the_cpp_kernel_is_chosen_on_a_cpu_and_a_reason_given_for_triton():
    require_backend("cpp")
    reasons = dispatch.explain("log_softmax_topk", torch.randn(2, 5), 2)
    assert reasons["chosen"] == "cpp"
    assert reasons["triton"]


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((torch.randn(5), 1), ValueError, r"logits must be \(N, V\) or an ensemble's"),
        ((torch.randint(0, 3, (2, 5)), 1), TypeError, "logits must have a floating dtype"),
        ((torch.randn(2, 5), 0), ValueError, r"k must be an int in \[1, 5\]"),
        ((torch.randn(2, 5), 6), ValueError, r"k must be an int in \[1, 5\]"),
        ((torch.randn(2, 5), 2.0), ValueError, "k must be an int"),
        ((torch.randn(2, 5), 2, torch.tensor([1.0])), TypeError, "banned must hold int64"),
        ((torch.randn(2, 5), 2, torch.tensor([[1]])), ValueError, "banned must have 1 dim"),
    ],
)
def test_bad_arguments_are_named(args, error, match):
    with pytest.raises(error, match=match):
        log_softmax_topk(*args)


@pytest.mark.parametrize("banned", [[5], [-1], [1, 2**40]])
@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_banned_range_checked_under_fastnmt_check_values(monkeypatch, backend, banned):
    require_backend(backend)
    monkeypatch.setenv("FASTNMT_CHECK_VALUES", "1")
    fastnmt.ops.settings.reload()
    message = r"banned must hold token ids in \[0, 5\), got " + re.escape(str(banned))
    with fastnmt.backend(backend), pytest.raises(ValueError, match=message) as raised:
        log_softmax_topk(torch.randn(2, 5), 2, torch.tensor(banned))
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("banned", [[5], [-1], [1, 2**40]])
def test_cpp_kernel_refuses_out_of_range_banned_ids_unchecked(cpp, banned):
    """No FASTNMT_CHECK_VALUES: the C++ kernel has the ids on the CPU and checks them itself
    rather than writing -inf outside the row."""
    with pytest.raises(RuntimeError, match=rf"banned id {banned[-1]} is outside \[0, 5\)"):
        log_softmax_topk(torch.randn(2, 5), 2, torch.tensor(banned))
