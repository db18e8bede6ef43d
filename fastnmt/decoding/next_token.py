"""How a decoding step turns the models' logits into next-token candidates: ensembles, banned
ids, forced target prefixes, repeated n-grams, temperature and sampling. Shared by the dynamic
search (``fastnmt.decoding.search``) and the static one (``fastnmt.decoding.static_search``).

Shapes: N hypothesis rows, V vocabulary (or shortlisted) columns, C candidates per row.

Log-probabilities are ``log_softmax(logits / temperature)`` over every column: banned ids, a
forced prefix's other tokens and repeated n-grams are never chosen but keep their share of the
normaliser, as pad and bos always have (fairseq does the same). An ensemble's are fairseq's
average of the members' probabilities, ``logsumexp_m(log p_m) - log M``.

Sampling draws one token per row with ``fastnmt.ops.sample_token`` (an inverse transform over
the top k, the nucleus or every token) from a uniform ``u`` per row, a counter-based hash of
(seed, stream, step), with a stream per sentence and sample: the same seed gives the same samples
whatever the batch a sentence is in, the backend or the search (dynamic or static), and a CUDA
graph that replays a step draws fresh numbers because its step counter lives on the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fastnmt.ops import log_softmax_topk, sample_token
from fastnmt.ops.sample_token import MIN_TEMPERATURE

NEG_INF = float("-inf")
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
        if not MIN_TEMPERATURE <= self.temperature < math.inf:
            raise ValueError(
                f"temperature must be >= {MIN_TEMPERATURE} (lower: greedy search), got "
                f"{self.temperature}"
            )
        if self.samples < 1:
            raise ValueError(f"samples must be at least 1, got {self.samples}")
        if self.seed is not None and not 0 <= self.seed < 1 << 63:
            raise ValueError(f"seed must be a non-negative 64-bit integer, got {self.seed}")

    @property
    def restriction(self) -> dict:
        """``sample_token``'s topk and topp arguments."""
        if self.method == "topp":
            return dict(topk=None, topp=self.topp)
        return dict(topk=self.topk, topp=None)


def resolve_seed(sampling: Sampling | None) -> Sampling | None:
    """``sampling`` with a seed: its own, or one drawn from torch's generator."""
    if sampling is None or sampling.seed is not None:
        return sampling
    seed = int(torch.randint(1 << 62, (), dtype=torch.int64, device="cpu"))
    return Sampling(**{**sampling.__dict__, "seed": seed})


def check_no_repeat_ngram(size: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"no_repeat_ngram must be a non-negative int, got {size!r}")


# ---------------------------------------------------------------------------------------------
# Random numbers: a counter-based hash, on the device.

_MASK = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B  # below 2**31: products of 32-bit values stay within int64


def _mix(x):
    """A 32-bit integer hash (a bijection with good avalanche) of int64 tensors, or of an int (the
    same value: the products stay within int64)."""
    x = x & _MASK
    x = ((x >> 16) ^ x) * _MULTIPLIER & _MASK
    x = ((x >> 16) ^ x) * _MULTIPLIER & _MASK
    return (x >> 16) ^ x


def stream_keys(seed: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The part of ``uniforms`` that no step changes, (N,) int64: a search computes it once."""
    x = _mix(_mix(seed) ^ (seed >> 32))
    return _mix(x ^ _mix(streams) ^ (streams >> 32))


def uniforms_at(keys: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """``uniforms`` from the streams' ``stream_keys`` (N,); an int step is hashed on the host
    (a Python int: no tensor op)."""
    x = _mix(keys + _mix(step))
    return (x >> 8).float() * 2.0**-24


def uniforms(seed: torch.Tensor, streams: torch.Tensor, step: int | torch.Tensor):
    """Uniform float32s in [0, 1) (N,), one per stream (N,) int64, a function of (seed, stream,
    step) only; ``seed`` an int64 tensor (1,) or (), ``step`` an int or an int64 device tensor."""
    return uniforms_at(stream_keys(seed, streams), step)


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
    rules: Sequence[Rule] = (),
    scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The k best next tokens of every row: fp32 log-probabilities and their columns, (N, k)
    each, best first; k None: every column in order (columns None). ``logits``: one (N, V)
    tensor per ensemble member; ``banned`` ids (n,) and the ``rules`` are never chosen;
    ``scales`` (N,) (one model): its logits are logits[0] times each row's scale (an int8 output
    layer's unscaled rows). Without rules, ``log_softmax_topk`` (an ensemble's logits stacked)
    never writes the (N, V) log-probabilities, nor the scaled logits."""
    if not rules and k is not None and k < logits[0].shape[1]:
        stacked = logits[0] if len(logits) == 1 else torch.stack(logits)
        return log_softmax_topk(stacked, k, banned, row_scales=scales)
    if scales is not None:
        logits = [logits[0].float() * scales[:, None]]
    log_probs = masked_log_probs(logits, banned, rules)
    return (log_probs, None) if k is None else log_probs.topk(k, dim=1)


def masked_log_probs(
    logits: Sequence[torch.Tensor],
    banned: torch.Tensor,
    rules: Sequence[Rule],
    temperature: float = 1.0,
) -> torch.Tensor:
    """(N, V) log-probabilities (``full_log_probs``) with the banned ids and the rules' tokens
    -inf."""
    log_probs = full_log_probs(logits, temperature).index_fill_(1, banned, NEG_INF)
    for rule in rules:
        rule(log_probs)
    return log_probs


def drawn(
    logits: Sequence[torch.Tensor],
    banned: torch.Tensor,
    sampling: Sampling,
    uniforms: torch.Tensor,
    *,
    rules: Sequence[Rule] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's drawn token: its log-probability (N,) fp32 and column (N,), by ``sampling``'s
    rule with ``uniforms`` (N,). One model without rules goes to ``sample_token`` whole (the
    log-probabilities are never written); an ensemble or rules first write the masked
    log-probabilities, from which ``sample_token`` draws (the draw depends only on
    differences within a row, so it is the same)."""
    if len(logits) == 1 and not rules:
        return sample_token(
            logits[0], uniforms, banned, temperature=sampling.temperature, **sampling.restriction
        )
    log_probs = masked_log_probs(logits, banned, rules, sampling.temperature)
    _, columns = sample_token(log_probs, uniforms, **sampling.restriction)
    return log_probs.gather(1, columns[:, None])[:, 0], columns


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
