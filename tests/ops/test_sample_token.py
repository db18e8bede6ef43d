"""fastnmt.ops.sample_token: both backends against a float64 oracle of the same draw (log_softmax,
the candidates best first by a stable sort, the nucleus, the inverse transform), token for token
wherever rounding cannot move the draw."""

import pytest
import torch

import fastnmt
from fastnmt.ops import sample_token
from tests.helpers import require_backend

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NEG_INF = float("-inf")
# Closer than this (relative to the candidates' total) to a boundary of the drawn candidate, or
# to the nucleus' edge, a float32 draw may pick the neighbour: such rows are not compared.
MARGIN = 1e-5


def _oracle(logits, uniforms, banned, temperature, topk, topp):
    """(tokens, ambiguous): the float64 draw, and the rows whose draw rounding may move: a
    uniform within MARGIN of a boundary of the drawn candidate, or a nucleus whose edge moved by
    MARGIN draws another token."""
    log_probs = (logits.double() / temperature).log_softmax(-1)
    allowed = log_probs.index_fill(1, banned, NEG_INF)
    if topk is None and topp is None:
        return _inverse_transform(allowed, torch.arange(logits.shape[1]), uniforms)
    values, columns = allowed.sort(dim=1, descending=True, stable=True)
    if topk is not None:
        return _inverse_transform(values[:, :topk], columns[:, :topk], uniforms)
    shares = (values - values.logsumexp(1, keepdim=True)).exp()
    before = shares.cumsum(1) - shares
    (tokens, ambiguous), (wider, _), (narrower, _) = (  # the nucleus, drawn in column order
        _inverse_transform(allowed.masked_fill(_unsorted(before >= edge, columns), NEG_INF),
                           torch.arange(logits.shape[1]), uniforms)
        for edge in (topp, topp + MARGIN, topp - MARGIN)
    )  # fmt: skip
    return tokens, ambiguous | (wider != tokens) | (narrower != tokens)


def _unsorted(mask, order):
    """``mask`` (N, V) of sorted columns ``order`` (N, V), back in column order."""
    return torch.zeros_like(mask).scatter_(1, order, mask)


def _inverse_transform(values, columns, uniforms):
    """(tokens, near): the float64 inverse transform over the candidates ``values`` (N, C) of
    ``columns`` (C,) or (N, C), and whether each row's uniform is within MARGIN of a boundary of
    the drawn candidate."""
    q = (values - values.amax(1, keepdim=True)).exp()
    q = q / q.sum(1, keepdim=True)
    running = q.cumsum(1)
    drawn = (running <= uniforms.double()[:, None]).sum(1, keepdim=True)
    high = running.gather(1, drawn)
    low = high - q.gather(1, drawn)
    near = (uniforms.double()[:, None] - torch.cat([low, high], 1)).abs().amin(1) < MARGIN
    return columns.expand_as(values).gather(1, drawn)[:, 0], near


def _logits(rows: int, vocab: int, dtype) -> torch.Tensor:
    """Peaked rows (a trained model's), flat ones (a nucleus of most of the vocabulary: past the
    C++ kernel's short list) and rows with a wide plateau, a banned column among the best."""
    logits = torch.randn(rows, vocab) * 4.0
    flat = torch.randperm(rows)[: rows // 4]
    logits[flat] = torch.randn(len(flat), vocab) * 0.1
    logits[flat[:2], : vocab // 3] += 3.0
    logits[:, 0] = logits.max(1).values  # banned, as probable as the best
    return logits.to(dtype)


MODES = [
    dict(topk=None, topp=None),
    dict(topk=1, topp=None),
    dict(topk=10, topp=None),
    dict(topk=None, topp=0.3),
    dict(topk=None, topp=0.9),
    dict(topk=None, topp=1.0),
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"topk{m['topk']}-topp{m['topp']}")
@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (3, 7), (40, 65), (200, 1000), (24, 8003)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_draws_what_the_float64_oracle_draws(backend, dtype, rows, vocab, mode):
    require_backend(backend)
    logits = _logits(rows, vocab, dtype)
    uniforms = torch.rand(rows)
    banned = torch.tensor([0, min(2, vocab - 1)]) if vocab > 2 else torch.tensor([], dtype=int)
    topk = None if mode["topk"] is None else min(mode["topk"], vocab)
    temperature = 0.8
    with fastnmt.backend(backend):
        log_probs, tokens = sample_token(
            logits, uniforms, banned, temperature=temperature, topk=topk, topp=mode["topp"]
        )
    assert log_probs.dtype == torch.float32 and tokens.dtype == torch.int64
    assert log_probs.shape == tokens.shape == (rows,)
    expected, ambiguous = _oracle(
        logits, uniforms, banned, temperature, topk if topk != vocab else None, mode["topp"]
    )
    clear = ~ambiguous
    assert clear.float().mean() > 0.8  # the comparison covers most rows
    assert torch.equal(tokens[clear], expected[clear])
    chosen = (logits.double() / temperature).log_softmax(-1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(log_probs.double(), chosen, rtol=1e-5, atol=1e-5)
    assert not torch.isin(tokens, banned).any()


def test_top_p_draws_inside_the_nucleus_and_flat_rows_reach_past_the_list(backend_cpp):
    """Flat rows hold nuclei of hundreds of tokens, far past the C++ kernel's short list: every
    draw inside its row's nucleus, and the draws spread over hundreds of tokens."""
    rows, vocab = 2000, 1000
    logits = torch.randn(rows, vocab) * 0.1
    uniforms = torch.rand(rows)
    _, tokens = sample_token(logits, uniforms, topp=0.9)
    shares, order = logits.softmax(-1).sort(dim=1, descending=True, stable=True)
    rank = order.argsort(1).gather(1, tokens[:, None])[:, 0]
    before = (shares.cumsum(1) - shares).gather(1, rank[:, None])[:, 0]
    assert (before < 0.9 + 1e-6).all()
    assert rank.max() > 500 and tokens.unique().numel() > 500


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_a_nucleus_of_p_1_is_the_whole_row(backend):
    """topp=1 draws exactly what unrestricted sampling draws: a cumulative sum that rounds to 1
    before the last column must not drop the least probable tokens of flat rows."""
    require_backend(backend)
    logits, uniforms = torch.randn(300, 1000) * 0.1, torch.rand(300)
    with fastnmt.backend(backend):
        whole = sample_token(logits, uniforms, temperature=0.8)
        nucleus = sample_token(logits, uniforms, temperature=0.8, topp=1.0)
    assert torch.equal(nucleus[1], whole[1]) and torch.equal(nucleus[0], whole[0])


def test_a_uniform_near_one_never_draws_an_impossible_token():
    """u * total can round to the total: the draw is then the last token that can be drawn,
    never a -inf one past it."""
    logits = torch.full((4, 50), NEG_INF)
    logits[:, :3] = torch.tensor([0.0, -1.0, -2.0])
    uniforms = torch.full((4,), 1.0 - 2.0**-24)
    for backend in ("cpp", "reference"):
        require_backend(backend)
        with fastnmt.backend(backend):
            for restriction in (dict(), dict(topk=10), dict(topp=1.0)):
                log_probs, tokens = sample_token(logits, uniforms, **restriction)
                assert (tokens == 2).all(), (backend, restriction, tokens)
                assert torch.isfinite(log_probs).all()


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_a_banned_column_far_more_probable_leaves_the_draw_to_the_best_allowed(backend):
    """bos far above every allowed logit, at a low temperature: the allowed probabilities
    underflow relative to it, yet the draw is the best allowed token, as greedy's."""
    require_backend(backend)
    logits = torch.randn(64, 50)
    logits[:, 1] += 100.0
    banned = torch.tensor([0, 1])
    best = logits.index_fill(1, banned, NEG_INF).argmax(1)
    with fastnmt.backend(backend):
        for restriction in (dict(), dict(topk=5), dict(topp=0.9)):
            log_probs, tokens = sample_token(
                logits, torch.rand(64), banned, temperature=1e-3, **restriction
            )
            assert torch.equal(tokens, best), restriction
            assert (log_probs < -1e4).all()


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_zero_rows_and_non_contiguous_logits(backend):
    require_backend(backend)
    with fastnmt.backend(backend):
        log_probs, tokens = sample_token(torch.randn(0, 9), torch.rand(0), topp=0.5)
        assert log_probs.shape == tokens.shape == (0,)
        wide = torch.randn(30, 200)
        uniforms = torch.rand(15)
        for restriction in (dict(), dict(topk=5), dict(topp=0.8)):
            strided = sample_token(wide[::2, ::2], uniforms, **restriction)
            dense = sample_token(wide[::2, ::2].contiguous(), uniforms, **restriction)
            assert torch.equal(strided[1], dense[1])


def test_the_cpp_kernel_is_chosen_on_a_cpu():
    require_backend("cpp")
    from fastnmt.ops.sample_token import SAMPLE_TOKEN

    reasons = SAMPLE_TOKEN.explain(torch.randn(2, 10), torch.rand(2), None, 1.0, None, 0.9)
    assert reasons["chosen"] == "cpp"
    reasons = SAMPLE_TOKEN.explain(torch.randn(2, 10).double(), torch.rand(2), None, 1.0, None, 0.9)
    assert reasons["chosen"] == "reference" and "float64" in " ".join(reasons["cpp"])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(uniforms=torch.rand(3)), ValueError, r"uniforms must be \(N,\) = \(2,\)"),
        (dict(topk=0), ValueError, "topk must be None or an int >= 1"),
        (dict(topp=0.0), ValueError, r"topp must be None or in \(0, 1\]"),
        (dict(topp=1.5), ValueError, r"topp must be None or in \(0, 1\]"),
        (dict(topk=3, topp=0.5), ValueError, "give at most one of them"),
        (dict(temperature=0.0), ValueError, "temperature must be a number >= 1e-06"),
        (dict(temperature=1e-320), ValueError, "temperature must be a number >= 1e-06"),
        (dict(banned=torch.tensor([0.0])), TypeError, "banned must hold int64 or int32"),
        (dict(logits=torch.randn(2, 3, 4)), ValueError, "logits"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    arguments = dict(logits=torch.randn(2, 10), uniforms=torch.rand(2)) | kwargs
    with pytest.raises(error, match=match):
        sample_token(
            arguments.pop("logits"), arguments.pop("uniforms"), arguments.pop("banned", None),
            **arguments,
        )  # fmt: skip


@pytest.fixture
def backend_cpp():
    require_backend("cpp")
    with fastnmt.backend("cpp"):
        yield
