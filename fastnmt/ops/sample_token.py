r"""One token drawn from each row of softmax(logits / temperature), with some tokens banned and the
draw restricted to the top k or to the top-p nucleus: the row step of sampling.

``sample_token(logits, uniforms, banned, temperature=T, topk=k, topp=p)`` returns (log_probs,
tokens), both (N,): each row's drawn column and its log-probability ``log_softmax(logits / T)``
(every column in the normaliser, banned ones included, as ``log_softmax_topk``'s).

Math, for row i of z_i = logits_i / T (V,), the allowed columns A (all but ``banned``) and the
row's uniform u_i in [0, 1):

    candidates  top-k: the k columns of A of largest z, best first (ties to the lower column);
                top-p: the nucleus (Holtzman et al. 2020): A's columns best first (the same
                       order) up to the first whose running probability, normalised over A,
                       reaches p; drawn in column order (no row needs sorting);
                neither: every column in column order, banned ones with probability 0.
    q_c         = exp(z_c - max_c z_c) over the candidates c
    token       = the first candidate whose running sum of q passes u_i * sum q (inverse
                  transform: a draw from the candidates' softmax)

A sentence's uniforms come from a counter-based hash (``fastnmt.decoding.next_token``), so the
same uniforms draw the same tokens in any batch, on any backend (to rounding: a uniform within
rounding of a boundary between two candidates may pick either), captured or not. A row whose
allowed columns are all -inf draws an unspecified column, of log-probability -inf (NaN on the
reference where every logit is -inf).

Backends: C++ (csrc/sample_token.cpp: one read of each row; the normaliser, a top-k list and the
draw over a cached fp32 copy; top-p sorts no row: its nucleus ends within the best 4, or a band
of values where it ends is narrowed, 16 thresholds a vectorised pass, to a few columns) and the
reference (torch: log_softmax, a stable sort, cumsum), which also runs on a GPU and inside CUDA
graphs (no host sync).
"""

from __future__ import annotations

import math

import torch

from fastnmt.ops import checks, dispatch
from fastnmt.ops.extension import extension_available

NEG_INF = float("-inf")
# The lowest temperature: the kernels divide logits by T in float32, where below about 1e-38 the
# quotients overflow and the draw and its log-probability turn NaN. Far above that, so that
# (z - max z) / T stays finite for any logits a model makes (|z| < 1e30): 1e-6 is greedy search
# in all but ties within a millionth.
MIN_TEMPERATURE = 1e-6
_CPP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# PyTorch reference: the oracle of the tests.
# ---------------------------------------------------------------------------------------------


def inverse_transform(values: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The column (N,) of the first candidate whose running probability sum passes u times the
    row's total: a draw from softmax(values) (N, C). -inf candidates are never drawn: where
    rounding leaves u * total at the total, the last candidate that can be (0 when none can)."""
    probabilities = (values - values.amax(1, keepdim=True).clamp(min=-1e30)).exp()
    running = probabilities.cumsum(1)
    target = uniforms[:, None] * running[:, -1:]
    last = (probabilities > 0).cumsum(1).argmax(1)  # the first position of the highest count
    return torch.minimum((running <= target).sum(1), last)


def nucleus(sorted_values: torch.Tensor, topp: float) -> torch.Tensor:
    """``sorted_values`` (N, C), best first, with the candidates past the smallest prefix that
    holds ``topp`` of the row's probability set to -inf (the first is always kept). The
    probability is that of the tokens that may be drawn (as transformers' top-p): banned ones
    keep their share of the log-probabilities, not of the nucleus."""
    probabilities = (sorted_values - sorted_values.logsumexp(1, keepdim=True)).exp()
    before = probabilities.cumsum(1) - probabilities  # the mass of the better candidates
    return sorted_values.masked_fill(before >= topp, NEG_INF)


def sample_token_reference(logits, uniforms, banned, temperature, topk, topp):
    z = logits.float()
    z = z if temperature == 1.0 else z / temperature
    log_probs = z.log_softmax(-1)  # (N, V), banned columns in the normaliser
    allowed = log_probs if banned is None else log_probs.index_fill(1, banned.long(), NEG_INF)
    values, columns = allowed, None
    if topk is not None or topp is not None:
        # best first, ties to the lower column on every backend (not torch.topk's order)
        ordered, order = allowed.sort(dim=1, descending=True, stable=True)
        if topp is None:
            values, columns = ordered[:, :topk], order[:, :topk]
        else:  # the nucleus, back in column order
            outside = torch.zeros_like(allowed, dtype=torch.bool)
            outside.scatter_(1, order, nucleus(ordered, topp) == NEG_INF)
            values = allowed.masked_fill(outside, NEG_INF)
    drawn = inverse_transform(values, uniforms)[:, None]  # (N, 1)
    tokens = drawn if columns is None else columns.gather(1, drawn)
    return log_probs.gather(1, tokens)[:, 0], tokens[:, 0]


# ---------------------------------------------------------------------------------------------
# C++ launcher and dispatch.
# ---------------------------------------------------------------------------------------------

_NO_TOPP = 2.0  # the kernel's "no nucleus": above any p


def sample_token_cpp(logits, uniforms, banned, temperature, topk, topp):
    banned = logits.new_empty(0, dtype=torch.int64) if banned is None else banned.long()
    return torch.ops.fastnmt.sample_token_cpp(
        logits, uniforms, banned, temperature, topk or 0, _NO_TOPP if topp is None else topp
    )


def _cpp_unsupported(logits, **_):
    if logits.dtype not in _CPP_DTYPES:
        yield f"dtype {logits.dtype}: the C++ kernel runs {', '.join(map(str, _CPP_DTYPES))}"


if extension_available():

    @torch.library.register_fake("fastnmt::sample_token_cpp")
    def _cpp_fake(logits, uniforms, banned, temperature, topk, topp):
        rows = logits.shape[0]
        return logits.new_empty(rows, dtype=torch.float32), logits.new_empty(
            rows, dtype=torch.int64
        )


def _prepare(logits, uniforms, banned=None, temperature=1.0, topk=None, topp=None):
    checks.tensor("logits", logits, ndim=2, floating=True)
    checks.tensor("uniforms", uniforms, ndim=1, floating=True)
    checks.same_device("uniforms", uniforms, "logits", logits)
    if uniforms.shape[0] != logits.shape[0]:
        raise ValueError(
            f"uniforms must be (N,) = ({logits.shape[0]},) (logits' rows), "
            f"got {tuple(uniforms.shape)}"
        )
    if banned is not None:
        checks.tensor("banned", banned, ndim=1)
        if banned.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"banned must hold int64 or int32 token ids, got {banned.dtype}")
        checks.same_device("banned", banned, "logits", logits)
    if isinstance(temperature, bool) or not MIN_TEMPERATURE <= temperature < math.inf:
        raise ValueError(
            f"temperature must be a number >= {MIN_TEMPERATURE} (lower: greedy search), "
            f"got {temperature!r}"
        )
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
        raise ValueError(f"topk must be None or an int >= 1, got {topk!r}")
    if topp is not None and (isinstance(topp, bool) or not 0.0 < topp <= 1.0):
        raise ValueError(f"topp must be None or in (0, 1], got {topp!r}")
    if topk is not None and topp is not None:
        raise ValueError("topk and topp are two ways to sample: give at most one of them")
    if topk is not None and topk >= logits.shape[1]:
        topk = None  # every column: the same distribution, drawn in column order
    if topp == 1.0:
        topp = None  # likewise; a cumulative sum's rounding must not drop the least probable
    options = dict(temperature=float(temperature), topk=topk, topp=topp)
    return logits.device, dict(logits=logits, uniforms=uniforms, banned=banned, **options)


SAMPLE_TOKEN = dispatch.define("sample_token", _prepare)
SAMPLE_TOKEN.register("cpp", unsupported=_cpp_unsupported)(sample_token_cpp)
SAMPLE_TOKEN.register("reference")(sample_token_reference)
# The reference is PyTorch's built-ins already: the baseline fastnmt is measured against.
SAMPLE_TOKEN.register("torch")(sample_token_reference)


def sample_token(
    logits, uniforms, banned=None, *, temperature: float = 1.0, topk=None, topp=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token drawn from each row of softmax(logits / temperature).

    Args:
        logits: (N, V) floating scores.
        uniforms: (N,) floating numbers in [0, 1), one per row: the draw is a function of them.
        banned: optional int (n,) column ids never drawn (e.g. pad and bos); they stay in the
            softmax's normaliser. Ids must lie in [0, V).
        temperature: the logits are divided by it.
        topk: draw among the k most probable tokens (k >= V: among all of them).
        topp: draw among the nucleus, the fewest most probable tokens holding ``topp`` of the
            allowed probability. Neither: among every token.

    Returns:
        log_probs: (N,) fp32 log-probabilities of the drawn tokens under
            ``log_softmax(logits / temperature)``. tokens: (N,) int64 columns.
    """
    return SAMPLE_TOKEN(logits, uniforms, banned, temperature, topk, topp)
