"""Greedy and beam search on the KV-cache incremental decoder, batched across sentences.

Shapes: B sentences, of which A are still being searched; K beams per sentence; N = A*W hypothesis
rows, sentence-major (row a*W + w is hypothesis w of active sentence a), W = 1 at the first step
and K after it; V vocabulary; S source tokens.

A sentence's search runs at most ``max_lens[b]`` steps. A hypothesis ends with eos, or is kept
without it (truncated) when it reaches that limit, as greedy keeps it. Lengths count generated
tokens, eos included. Hypotheses are ranked by ``log_prob / LengthPenalty(length)``. pad and bos
are never generated. Sentences leave the batch as soon as their search is over, so the decoder
only computes for live hypotheses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fastnmt.model import Transformer, reorder_self_attention
from fastnmt.ops import log_softmax_topk

if TYPE_CHECKING:
    from fastnmt.shortlist import Shortlist


@dataclass(frozen=True)
class LengthPenalty:
    """The divisor of a hypothesis' log-probability. fairseq's ``lenpen``: length ** lenpen
    (0 ranks by raw log-probability, 1 by the per-token average, more favours longer output).
    GNMT's ``alpha`` (Wu et al. 2016), when given, replaces it: ((5 + length) / 6) ** alpha."""

    lenpen: float = 1.0
    alpha: float | None = None

    def __call__(self, length: int) -> float:
        if self.alpha is not None:
            return ((5 + length) / 6) ** self.alpha
        return length**self.lenpen


@dataclass
class Hypothesis:
    tokens: list[int]  # generated ids, without eos
    log_prob: float  # summed log-probabilities of the generated tokens, eos included if generated
    score: float  # log_prob / LengthPenalty(length): the ranking
    ended: bool  # eos generated (False: cut at the length limit)


class _Batch:
    """The sentences still being searched and everything the decoder keeps for them."""

    def __init__(
        self,
        model: Transformer,
        src,
        src_lengths,
        max_lens,
        incremental,
        eos,
        prefix,
        shortlist: Shortlist | None,
    ):
        cfg = model.cfg
        self.model = model
        self.memory = model.encode(src, src_lengths)  # (A, S, E)
        self.src_lengths = src_lengths  # (A,)
        self.max_lens = max_lens.to(src.device)  # (A,)
        self.sentences = torch.arange(src.shape[0], device=src.device)  # (A,) input positions
        steps = 1 + int(self.max_lens.max()) if len(max_lens) else 0  # start symbol + limit
        self.caches = model.new_caches(steps) if incremental else None
        self.cached = 0  # target positions already in the caches
        # One hypothesis per sentence: a beam search's K beams are one prefix until its first step.
        start = src.new_full((src.shape[0], 1), cfg.bos_id)
        forced = torch.tensor(prefix, dtype=src.dtype, device=src.device)
        self.history = torch.cat([start, forced.expand(start.shape[0], -1)], dim=1)  # (N, step + 1)
        # pad and the start symbol are never generated, unless the start symbol is eos (NLLB).
        banned = ({cfg.pad_id, cfg.bos_id} - {cfg.eos_id}) | (set() if eos else {cfg.eos_id})
        self.banned = torch.tensor(sorted(banned), device=src.device)
        # The ids the output layer scores (None: all): the shortlist's, with eos and the banned
        # ids, which stay in the normaliser as without a shortlist; banned becomes their columns.
        self.vocabulary = None if shortlist is None else self._shortlisted(shortlist, src)
        if self.vocabulary is not None:
            self.banned = torch.searchsorted(self.vocabulary, self.banned)
        self.output_layer = model.output_layer(self.vocabulary)  # once per search

    def _shortlisted(self, shortlist: Shortlist, src) -> torch.Tensor:
        """The shortlist's ids for ``src``, eos and the banned ids: sorted, unique."""
        ids = shortlist.vocabulary(src)
        eos = ids.new_tensor([self.model.cfg.eos_id])
        return torch.cat([ids, eos, self.banned.to(ids.dtype)]).unique()

    @property
    def size(self) -> int:
        return self.sentences.shape[0]

    def next_tokens(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most probable next tokens of every hypothesis: float32 log-probabilities and
        token ids, both (N, k), best first."""
        if self.caches is None:  # recompute the whole prefix: the baseline the cache is for
            states = self.model.decode(self.history, self.memory, self.src_lengths)
        else:  # the positions not yet cached: the start and any forced prefix, then one a step
            new = self.history[:, self.cached :]
            states = self.model.decode(
                new, self.memory, self.src_lengths, self.caches, start=self.cached
            )
            self.cached = self.history.shape[1]
        logits = self.output_layer(states[:, -1])  # (N, V), or (N, shortlisted)
        log_probs, ids = log_softmax_topk(logits, min(k, logits.shape[1]), self.banned)
        return log_probs, ids if self.vocabulary is None else self.vocabulary[ids]

    def keep_sentences(self, kept: torch.Tensor) -> None:
        """Keep active sentences ``kept`` (A',); ``advance`` then picks their rows."""
        if self.caches is None:  # else the cross-attention caches hold all the memory says
            self.memory = self.memory.index_select(0, kept)
        self.src_lengths = self.src_lengths.index_select(0, kept)
        self.max_lens = self.max_lens.index_select(0, kept)
        self.sentences = self.sentences.index_select(0, kept)
        for cache in self.caches or ():
            cache.cross_attn.reorder(kept)  # one entry per sentence, shared by its beams

    def advance(self, tokens: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Continue hypotheses ``rows`` (N',) of the previous step (None: every row, in place)
        with ``tokens`` (N',). The caller knows whether hypotheses moved: asking the tensors
        would sync the host."""
        if rows is not None:  # reorder the self-attention caches only when hypotheses moved
            self.history = self.history.index_select(0, rows)
            if self.caches:
                reorder_self_attention(self.caches, rows)
        self.history = torch.cat([self.history, tokens[:, None]], dim=1)


def _check(
    model, max_lens, src, src_lengths, beam: int = 1, nbest: int = 1, prefix: Sequence[int] = ()
) -> None:
    device = model.embedding.weight.device
    for name, tensor in (("src", src), ("src_lengths", src_lengths)):
        if tensor.device != device:
            raise ValueError(
                f"{name} must be on the model's device ({device}), got {tensor.device}"
            )
    check_arguments(max_lens, src, beam, nbest, prefix)


def check_arguments(max_lens, src, beam: int, nbest: int, prefix: Sequence[int]) -> None:
    """The search settings and length limits every search takes (one-line ValueErrors)."""
    if beam < 1:
        raise ValueError(f"beam must be at least 1, got {beam}")
    if not 1 <= nbest <= beam:
        raise ValueError(f"nbest must be between 1 and beam ({beam}), got {nbest}")
    shortest = len(prefix) + 1
    if max_lens.shape != src.shape[:1] or (max_lens.numel() and int(max_lens.min()) < shortest):
        raise ValueError(
            f"max_lens must be ({src.shape[0]},) lengths of at least {shortest} (the prefix and "
            f"a token), got {max_lens}"
        )


def _steps(max_lens: torch.Tensor, prefix: Sequence[int]) -> range:
    """The search's steps: the number of tokens generated before each (the prefix counts)."""
    return range(len(prefix), int(max_lens.max()) if max_lens.numel() else 0)


@torch.inference_mode()  # no autograd bookkeeping: part of the per-op cost of a decoding step
def greedy(
    model: Transformer,
    src: torch.Tensor,
    src_lengths: torch.Tensor,
    max_lens: torch.Tensor,
    *,
    penalty: LengthPenalty = LengthPenalty(),
    incremental: bool = True,
    eos: bool = True,
    prefix: Sequence[int] = (),
    shortlist: Shortlist | None = None,
) -> list[Hypothesis]:
    """The most probable next token at every step, for src (B, S) with lengths (B,); at most
    ``max_lens`` (B,) tokens each. ``incremental=False`` recomputes the whole prefix every step
    (no KV cache); ``eos=False`` never ends a hypothesis early (fixed-length benchmarks).
    ``prefix``: tokens forced after the start symbol (NLLB's target language), with
    log-probability 0, counted in the lengths and returned in the hypotheses' tokens, as
    transformers' ``forced_bos_token_id`` does. ``shortlist``: score only the words it lists
    for the batch's source tokens (``fastnmt.shortlist``)."""
    _check(model, max_lens, src, src_lengths, prefix=prefix)
    batch = _Batch(model, src, src_lengths, max_lens, incremental, eos, prefix, shortlist)
    log_probs = torch.zeros(batch.size, device=src.device)  # (A,)
    results: list[Hypothesis | None] = [None] * src.shape[0]
    for step in _steps(max_lens, prefix):
        best, tokens = (x[:, 0] for x in batch.next_tokens(1))  # (A,), (A,)
        log_probs += best
        done = (tokens == model.cfg.eos_id) | (batch.max_lens <= step + 1)  # (A,)
        rows = None
        if done.any():  # the step's one host sync
            ended = done.nonzero()[:, 0]
            generated = torch.cat([batch.history[ended, 1:], tokens[ended, None]], dim=1)
            finished = zip(
                batch.sentences[ended].tolist(),
                generated.tolist(),
                log_probs[ended].tolist(),
                strict=True,
            )
            for sentence, ids, log_prob in finished:
                results[sentence] = _hypothesis(ids, log_prob, model.cfg.eos_id, penalty)
            rows = (~done).nonzero()[:, 0]
            if not rows.numel():
                break
            batch.keep_sentences(rows)
            log_probs, tokens = log_probs[rows], tokens[rows]
        batch.advance(tokens, rows)
    return results


@torch.inference_mode()
def beam_search(
    model: Transformer,
    src: torch.Tensor,
    src_lengths: torch.Tensor,
    max_lens: torch.Tensor,
    *,
    beam: int,
    nbest: int = 1,
    penalty: LengthPenalty = LengthPenalty(),
    incremental: bool = True,
    eos: bool = True,
    prefix: Sequence[int] = (),
    shortlist: Shortlist | None = None,
) -> list[list[Hypothesis]]:
    """The ``nbest`` best hypotheses per sentence (best first) of a beam search of width
    ``beam``, arguments as ``greedy``'s.

    fairseq's algorithm: each step takes the 2K best continuations of a sentence's K beams; those
    ending in eos among the best K are finished, the best K others go on. A sentence is done with
    K finished hypotheses (the K best scores when more finish in one step, as in transformers'
    ``early_stopping=True``), or at its length limit, where its best K continuations are finished as
    they are. With K as large as the number of possible prefixes the search is exhaustive.
    """
    _check(model, max_lens, src, src_lengths, beam, nbest, prefix)
    k, eos_id = beam, model.cfg.eos_id
    # The first step scores one hypothesis per sentence (its K beams would all be the empty
    # prefix); its best K continuations become the K beams.
    batch = _Batch(model, src, src_lengths, max_lens, incremental, eos, prefix, shortlist)
    scores = torch.zeros((batch.size, 1), device=src.device)  # (A, W)
    finished: list[list[Hypothesis]] = [[] for _ in range(src.shape[0])]
    for step in _steps(max_lens, prefix):
        # A sentence's best 2K continuations are among its hypotheses' best 2K each.
        log_probs, next_ids = batch.next_tokens(2 * k)  # (N, C), C = 2K (or V if fewer)
        width, per_beam = scores.shape[1], log_probs.shape[1]
        top, index = _best(scores.view(-1, 1) + log_probs, batch.size, 2 * k)  # (A, 2K)
        first_row = torch.arange(0, batch.size * width, width, device=src.device)[:, None]
        origins = first_row + index // per_beam  # (A, 2K) the row each candidate continues
        tokens = next_ids.reshape(batch.size, width * per_beam).gather(1, index)  # next token
        ends = tokens == eos_id
        last = batch.max_lens <= step + 1  # (A,)
        finishing = (ends[:, :k] | last[:, None]) & (top[:, :k] > float("-inf"))  # (A, K)
        done = _finish(batch, finished, finishing, top, origins, tokens, k, eos_id, penalty)
        scores, pick = top.masked_fill(ends, float("-inf")).topk(k, dim=1)  # (A, K)
        rows, tokens = origins.gather(1, pick), tokens.gather(1, pick)  # (A, K)
        if done is not None:
            kept = (~done).nonzero()[:, 0]
            if not kept.numel():
                break
            batch.keep_sentences(kept)
            rows, tokens, scores = rows[kept], tokens[kept], scores[kept]
        batch.advance(tokens.view(-1), rows.view(-1))
    return [sorted(h, key=lambda h: h.score, reverse=True)[:nbest] for h in finished]


def _best(candidates, sentences: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n best of each sentence's candidates (N, C) -> scores and their columns in the
    sentence's (W*C,) candidates, (A, n) each, best first. Fewer than n candidates (a vocabulary
    smaller than 2K at the first step) are padded with -inf scores at the last real column."""
    candidates = candidates.reshape(sentences, -1)
    count = candidates.shape[1]
    if count >= n:
        return candidates.topk(n, dim=1)
    padded = torch.nn.functional.pad(candidates, (0, n - count), value=float("-inf"))
    top, index = padded.topk(n, dim=1)
    return top, index.clamp_(max=count - 1)


def _finish(batch, finished, finishing, top, origins, tokens, k, eos_id, penalty):
    """Record the hypotheses marked ``finishing`` (A, K) (the first K candidates of each active
    sentence, continuing rows ``origins``) that their sentence still has room for; the (A,) bool
    of sentences now done, or None when nothing finished."""
    if not finishing.any():  # the step's one host sync
        return None
    sentence, rank = finishing.nonzero(as_tuple=True)
    rows = origins[sentence, rank]
    generated = torch.cat([batch.history[rows, 1:], tokens[sentence, rank, None]], dim=1)
    ended = zip(
        batch.sentences[sentence].tolist(),
        generated.tolist(),
        top[sentence, rank].tolist(),
        strict=True,
    )
    grown = set()
    for index, ids, log_prob in ended:
        finished[index].append(_hypothesis(ids, log_prob, eos_id, penalty))
        grown.add(index)
    for index in grown:  # more than K finishing at once: the K best scores stay (as transformers)
        finished[index] = sorted(finished[index], key=lambda h: h.score, reverse=True)[:k]
    full = [len(finished[index]) >= k for index in batch.sentences.tolist()]
    last = batch.max_lens <= batch.history.shape[1]
    return torch.tensor(full, device=last.device) | last


def _hypothesis(ids: list[int], log_prob: float, eos_id: int, penalty) -> Hypothesis:
    """A finished hypothesis from its generated ids (ending with eos unless truncated)."""
    ended = eos_id in ids
    tokens = ids[: ids.index(eos_id)] if ended else ids
    return Hypothesis(tokens, log_prob, log_prob / penalty(len(ids)), ended)
