"""How a decoding step turns the models' logits into next-token candidates: ensembles, banned
ids, forced target prefixes, repeated n-grams, temperature and sampling. Shared by the dynamic
search (``fastnmt.decoding.search``) and the static one (``fastnmt.decoding.static_search``).

Shapes: N hypothesis rows, V vocabulary (or shortlisted) columns, C candidates per row.

Log-probabilities are ``log_softmax(logits / temperature)`` over every column: banned ids, a
forced prefix's other tokens and repeated n-grams are never chosen but keep their share of the
normaliser, as pad and bos always have (fairseq does the same). An ensemble's are fairseq's
average of the members' probabilities, ``logsumexp_m(log p_m) - log M``.

Sampling draws one token per row by inverse transform: the row's candidate probabilities summed
in order, and the first whose running sum passes ``u`` times the total. ``u`` comes from a
counter-based hash of (seed, stream, step), with a stream per sentence and sample: the same seed
gives the same samples whatever the batch a sentence is in, the backend or the search (dynamic or
static), and a CUDA graph that replays a step draws fresh numbers because its step counter lives
on the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fastnmt.ops import log_softmax_topk

NEG_INF = float("-inf")
# Top-p first looks for its nucleus among the best this many tokens (the fused top-k, no sort):
# a trained model's nucleus is almost always there; only a row whose nucleus is not is sorted.
NUCLEUS_CANDIDATES = 64
# A row whose nucleus is wider takes torch's top-k of this many (a partial sort, 4x cheaper than
# sorting 8,000 columns); wider still, all of them.
WIDE_NUCLEUS_CANDIDATES = 1024
SAMPLING_METHODS = ("topk", "topp")


@dataclass(frozen=True)
class Sampling:
    """Sampling instead of search: ``method`` "topk" draws from the ``topk`` most probable
    tokens (None: the whole vocabulary, unrestricted), "topp" from the smallest set of most
    probable tokens holding ``topp`` of the probability (the nucleus, Holtzman et al. 2020), of
    ``softmax(logits / temperature)``; ``samples`` independent ones per sentence. ``seed``: the
    same seed gives the same samples; None draws one from torch's generator per call."""

    method: str = "topk"
    topk: int | None = None
    topp: float = 0.9
    temperature: float = 1.0
    seed: int | None = None
    samples: int = 1

    def __post_init__(self):
        if self.method not in SAMPLING_METHODS:
            raise ValueError(f"sampling must be topk or topp, got {self.method!r}")
        if self.topk is not None and (isinstance(self.topk, bool) or self.topk < 1):
            raise ValueError(f"topk must be at least 1, got {self.topk}")
        if not 0.0 < self.topp <= 1.0:
            raise ValueError(f"topp must be in (0, 1], got {self.topp}")
        if not 0.0 < self.temperature < math.inf:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        if self.samples < 1:
            raise ValueError(f"samples must be at least 1, got {self.samples}")
        if self.seed is not None and not 0 <= self.seed < 1 << 63:
            raise ValueError(f"seed must be a non-negative 64-bit integer, got {self.seed}")

    def candidates(self, vocab: int) -> int | None:
        """How many best candidates a row's draw needs, sorted (None: all columns, in order)."""
        if self.method == "topp":
            return vocab
        return None if self.topk is None or self.topk >= vocab else self.topk

    def draw(self, values: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """The column (N,) of ``values`` (N, C) (``candidates``' log-probabilities) each row
        draws with its uniform (N,)."""
        if self.method == "topp":
            values = nucleus(values, self.topp)
        return inverse_transform(values, uniforms)


def resolve_seed(sampling: Sampling | None) -> Sampling | None:
    """``sampling`` with a seed: its own, or one drawn from torch's generator."""
    if sampling is None or sampling.seed is not None:
        return sampling
    seed = int(torch.randint(1 << 62, (), dtype=torch.int64))
    return Sampling(**{**sampling.__dict__, "seed": seed})


def check_no_repeat_ngram(size: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"no_repeat_ngram must be a non-negative int, got {size!r}")


# ---------------------------------------------------------------------------------------------
# Random numbers: a counter-based hash, on the device.

_MASK = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B  # below 2**31: products of 32-bit values stay within int64


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (a bijection with good avalanche) of int64 tensors."""
    x = x & _MASK
    x = ((x >> 16) ^ x) * _MULTIPLIER & _MASK
    x = ((x >> 16) ^ x) * _MULTIPLIER & _MASK
    return (x >> 16) ^ x


def uniforms(seed: torch.Tensor, streams: torch.Tensor, step: int | torch.Tensor):
    """Uniform float32s in [0, 1) (N,), one per stream (N,) int64, a function of (seed, stream,
    step) only; ``seed`` an int64 tensor (1,) or (), ``step`` an int or an int64 device tensor."""
    x = _mix(_mix(seed) ^ (seed >> 32))
    x = _mix(x ^ _mix(streams) ^ (streams >> 32))
    x = _mix(x + _mix(torch.as_tensor(step, device=streams.device)))
    return (x >> 8).float() * 2.0**-24


def inverse_transform(values: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The column (N,) of the first candidate whose running probability sum passes u times the
    row's total: a draw from softmax(values) (N, C); -inf candidates are never drawn."""
    probabilities = (values - values.amax(1, keepdim=True).clamp(min=-1e30)).exp()
    running = probabilities.cumsum(1)
    target = uniforms[:, None] * running[:, -1:]
    return (running <= target).sum(1).clamp_(max=values.shape[1] - 1)


def nucleus(sorted_values: torch.Tensor, topp: float) -> torch.Tensor:
    """``sorted_values`` (N, C), best first, with the candidates past the smallest prefix that
    holds ``topp`` of the row's probability set to -inf (the first is always kept). The
    probability is that of the tokens that may be drawn (as transformers' top-p): banned ones
    keep their share of the log-probabilities, not of the nucleus."""
    probabilities = (sorted_values - sorted_values.logsumexp(1, keepdim=True)).exp()
    before = probabilities.cumsum(1) - probabilities  # the mass of the better candidates
    return sorted_values.masked_fill(before >= topp, NEG_INF)


# ---------------------------------------------------------------------------------------------
# Candidates of a step.

Rule = Callable[[torch.Tensor], None]  # masks (N, V) log-probabilities in place


def full_log_probs(logits: Sequence[torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """(N, V) fp32 log-probabilities of one model's logits, or an ensemble's average of
    probabilities, at ``temperature``."""
    members = [(z.float() / temperature).log_softmax(-1) for z in logits]
    if len(members) == 1:
        return members[0]
    return torch.stack(members).logsumexp(0) - math.log(len(members))


def candidates(
    logits: Sequence[torch.Tensor],
    k: int | None,
    banned: torch.Tensor,
    *,
    temperature: float = 1.0,
    rules: Sequence[Rule] = (),
    topp: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The k best next tokens of every row: fp32 log-probabilities and their columns, (N, k)
    each, best first; k None: every column in order (columns None). ``logits``: one (N, V)
    tensor per ensemble member; ``banned`` ids (n,) and the ``rules`` are never chosen. Without
    rules, ``log_softmax_topk`` (an ensemble's logits stacked) never writes the (N, V)
    log-probabilities, where k is a part of the vocabulary: every column (top-p's sorted nucleus)
    is a sort of the log-probabilities, which the fused op's top-k list is not made for.

    ``topp`` (k the whole vocabulary, for ``nucleus``): the best candidates that hold every
    row's nucleus (``_nucleus_candidates``) and, as one last column, the log of the allowed
    probability past them (``nucleus`` then normalises by the same allowed probability and masks
    that last column, so the draw is the sorted vocabulary's). Finding the rows to sort reads
    them back to the host: not for a captured search."""
    if not rules and k is not None and k < logits[0].shape[1]:
        stacked = logits[0] if len(logits) == 1 else torch.stack(logits)
        scaled = stacked if temperature == 1.0 else stacked.float() / temperature
        return log_softmax_topk(scaled, k, banned)
    if topp is not None and len(logits) == 1 and not rules:
        found = _nucleus_candidates(logits[0], topp, banned, temperature)
        if found is not None:
            return found
    log_probs = full_log_probs(logits, temperature).index_fill_(1, banned, NEG_INF)
    for rule in rules:
        rule(log_probs)
    return (log_probs, None) if k is None else log_probs.topk(k, dim=1)


def _nucleus_candidates(logits: torch.Tensor, topp: float, banned, temperature: float):
    """``candidates``' top-p: (N, C + 1) log-probabilities, best first, holding every row's
    nucleus, then the log of the allowed probability past them, with their columns (the last
    one's is any: it is never drawn); None where the vocabulary is no wider than the shortcut.
    The best NUCLEUS_CANDIDATES come from the fused top-k; only the rows whose nucleus reaches
    past them are sorted, and C is the widest nucleus among them (one column of margin)."""
    if logits.shape[1] <= NUCLEUS_CANDIDATES + 1:
        return None
    scaled = logits if temperature == 1.0 else logits.float() / temperature
    values, ids = log_softmax_topk(scaled, NUCLEUS_CANDIDATES, banned)
    log_normaliser = scaled.gather(1, ids[:, :1]).float() - values[:, :1]  # (N, 1)
    banned_mass = (scaled.index_select(1, banned).float() - log_normaliser).exp().sum(1)
    allowed = 1.0 - banned_mass  # (N,)
    # A row on the boundary (to rounding) counts as wide: it is sorted, with a margin.
    wide = (values.exp().sum(1) < topp * allowed + 1e-6).nonzero()[:, 0]
    if len(wide):
        values, ids = _widened(values, ids, scaled, wide, topp * allowed[wide, None], banned)
    rest = (allowed - values.exp().sum(1)).clamp(min=0.0).log()[:, None]
    return torch.cat([values, rest], 1), torch.cat([ids, ids[:, :1]], 1)


def _widened(values, ids, scaled, wide, mass, banned):
    """``values`` and ``ids`` (N, C) widened to hold the nucleus of each ``wide`` row (its
    probability ``mass`` (W, 1)), whose candidates are the best of its log-probabilities
    (``candidates``' order: torch's top-k); the other rows padded with -inf (column 0)."""
    log_probs = scaled.index_select(0, wide).float().log_softmax(1).index_fill_(1, banned, NEG_INF)
    best, order = log_probs.topk(min(WIDE_NUCLEUS_CANDIDATES, log_probs.shape[1]), 1)
    wider = (best.exp().sum(1) < mass[:, 0] + 1e-6).nonzero()[:, 0]
    if len(wider):  # every column, for the rows whose nucleus is wider still
        all_values, all_order = log_probs.index_select(0, wider).topk(log_probs.shape[1], 1)
        best, order = _padded_to(best, all_values.shape[1]), _padded_to(order, all_order.shape[1])
        best[wider], order[wider] = all_values, all_order
    probabilities = best.exp()
    before = probabilities.cumsum(1) - probabilities
    needed = int((before < mass).sum(1).max()) + 1
    width = max(values.shape[1], min(needed, scaled.shape[1]))
    wider_values = _padded_to(values, width)
    wider_ids = _padded_to(ids, width)
    wider_values[wide], wider_ids[wide] = _padded_to(best, width)[:, :width], order[:, :width]
    return wider_values, wider_ids


def _padded_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """(N, C) as (N, max(C, width)): log-probabilities padded with -inf, ids with 0."""
    if x.shape[1] >= width:
        return x
    padding = NEG_INF if x.is_floating_point() else 0
    return torch.cat([x, x.new_full((x.shape[0], width - x.shape[1]), padding)], 1)


def force(log_probs: torch.Tensor, forced: torch.Tensor, tokens: torch.Tensor) -> None:
    """Rows ``forced`` (N,) bool may only continue with their ``tokens`` (N,) columns, which
    keep their log-probabilities."""
    kept = log_probs.gather(1, tokens[:, None])
    log_probs.masked_fill_(forced[:, None], NEG_INF).scatter_(1, tokens[:, None], kept)


def ban_repeated_ngrams(
    log_probs: torch.Tensor,
    generated: torch.Tensor,
    length: int | torch.Tensor,
    size: int,
    harmless: int,
) -> None:
    """Ban, in every row of (N, V) log-probabilities, each token that would repeat an n-gram of
    ``size`` tokens of the row's ``generated`` (N, L) columns, of which the first ``length`` (an
    int, or a device tensor (1,) for a step a CUDA graph replays) are written. ``harmless``: a
    column that is banned anyway (pad), which takes the rows' writes that ban nothing."""
    context = size - 1
    if generated.shape[1] < size:
        return
    device = generated.device
    length = torch.as_tensor(length, device=device).reshape(1)
    windows = generated.unfold(1, size, 1)  # (N, W, size): W = L - size + 1 n-grams
    complete = torch.arange(context, generated.shape[1], device=device) < length  # (W,)
    columns = (length - context).clamp(min=0) + torch.arange(context, device=device)
    last = generated.index_select(1, columns)  # (N, context): how an n-gram ending now starts
    match = (windows[..., :context] == last[:, None, :]).all(-1) & complete & (length >= context)
    banned = torch.where(match, windows[..., context], harmless)  # (N, W)
    log_probs.scatter_(1, banned, NEG_INF)
