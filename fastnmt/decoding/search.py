"""Greedy and beam search on the KV-cache incremental decoder, batched across sentences.

Shapes: B sentences, of which A are still being searched; K beams per sentence; N = A*W hypothesis
rows, sentence-major (row a*W + w is hypothesis w of active sentence a), W = 1 at the first step
and K after it; V vocabulary; S source tokens.

A sentence's search runs at most ``max_lens[b]`` steps. A hypothesis ends with eos, or is kept
without it (truncated) when it reaches that limit, as greedy keeps it. Lengths count generated
tokens, eos included. Hypotheses are ranked by ``log_prob / LengthPenalty(length)``. pad and bos
are never generated. Sentences leave the batch as soon as their search is over, so the decoder
only computes for live hypotheses.

``sample`` draws instead of searching (greedy's loop, a sentence per sample). Every search takes
an ensemble (a list of models, each with its own caches) and ``Rules``: forced per-sentence
prefixes and banned repeated n-grams; what a step does with the logits is
``fastnmt.decoding.next_token``. The static search (``fastnmt.decoding.static_search``) runs the
same algorithm on fixed shapes, with ``Hypothesis``, ``LengthPenalty``, ``Rules``,
``check_arguments``, ``best_candidates`` and ``padded_rows`` from here.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fastnmt.decoding.next_token import (
    Sampling,
    ban_repeated_ngrams,
    candidates,
    check_no_repeat_ngram,
    drawn,
    force,
    resolve_seed,
    stream_keys,
    uniforms_at,
)
from fastnmt.model import Transformer, reorder_self_attention

if TYPE_CHECKING:
    from fastnmt.decoding.shortlist import Shortlist

# Called with a sentence's index in the batch and its final hypotheses (best first) as soon as its
# search is over, before the search returns: a server answers it while the others go on.
OnDone = Callable[[int, "list[Hypothesis]"], None]


@dataclass(frozen=True)
class LengthPenalty:
    """The divisor of a hypothesis' log-probability. fairseq's ``lenpen``: length ** lenpen
    (0 ranks by raw log-probability, 1 by the per-token average, more favours longer output).
    GNMT's ``alpha`` (Wu et al. 2016), when given, replaces it: ((5 + length) / 6) ** alpha."""

    lenpen: float = 1.0
    alpha: float | None = None

    def __post_init__(self):
        for name, value in (("lenpen", self.lenpen), ("alpha", self.alpha)):
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")

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

    @classmethod
    def from_generated(
        cls, ids: list[int], log_prob: float, eos_id: int, penalty: LengthPenalty
    ) -> Hypothesis:
        """A finished hypothesis from its generated ids (ending with eos unless truncated)."""
        ended = eos_id in ids
        tokens = ids[: ids.index(eos_id)] if ended else ids
        return cls(tokens, log_prob, log_prob / penalty(len(ids)), ended)


class _Member:
    """One model of the search (an ensemble has several): its encoder output, caches and output
    layer."""

    def __init__(self, model: Transformer, src, src_lengths, steps: int, incremental, vocabulary):
        self.model = model
        self.memory = model.encode(src, src_lengths)  # (A, S, E)
        self.caches = model.new_caches(steps) if incremental else None
        self.output_layer = model.output_layer(vocabulary)  # once per search
        # (rows, scales) of an int8 output layer (``fastnmt.quantize``): None for others
        self.unscaled_output = getattr(self.output_layer, "unscaled", None)

    def logits(self, history, cached: int, src_lengths, unscaled: bool = False):
        """(N, V) logits after ``history`` (N, step + 1), of which ``cached`` are cached, and
        None; ``unscaled``: from an output layer that hands over its rows unscaled
        (``fastnmt.quantize``'s int8 ones), those rows and their (N,) scales."""
        if self.caches is None:  # recompute the whole prefix: the baseline the cache is for
            states = self.model.decode(history, self.memory, src_lengths)
        else:  # the positions not yet cached: the start and any forced prefix, then one a step
            new = history[:, cached:]
            states = self.model.decode(new, self.memory, src_lengths, self.caches, start=cached)
        if unscaled and self.unscaled_output is not None:
            return self.unscaled_output(states[:, -1])
        return self.output_layer(states[:, -1]), None

    def keep_sentences(self, kept: torch.Tensor) -> None:
        if self.caches is None:  # else the cross-attention caches hold all the memory says
            self.memory = self.memory.index_select(0, kept)
        for cache in self.caches or ():
            cache.cross_attn.reorder(kept)  # one entry per sentence, shared by its beams

    def reorder(self, rows: torch.Tensor) -> None:
        if self.caches:
            reorder_self_attention(self.caches, rows)


@dataclass(frozen=True)
class Rules:
    """What a search forces or forbids beyond its scores: ``prefixes``, token ids each sentence's
    output must start with (after the shared ``prefix``), scored by the model (fairseq's
    ``prefix_tokens``); ``no_repeat_ngram`` N > 0: no n-gram of N tokens appears twice in an
    output (fairseq's ``--no-repeat-ngram-size``)."""

    prefixes: Sequence[Sequence[int]] | None = None
    no_repeat_ngram: int = 0


class _Batch:
    """The sentences still being searched and everything the decoder keeps for them."""

    def __init__(
        self,
        models: Sequence[Transformer],
        src,
        src_lengths,
        max_lens,
        incremental,
        eos,
        prefix,
        shortlist: Shortlist | None,
        rules: Rules = Rules(),
    ):
        cfg = models[0].cfg
        self.cfg, self.rules = cfg, rules
        self.src_lengths = src_lengths  # (A,)
        self.max_lens = max_lens.to(src.device)  # (A,)
        self.sentences = torch.arange(src.shape[0], device=src.device)  # (A,) input positions
        self.cached = 0  # target positions already in the caches
        self.shared = len(prefix)  # forced tokens after the start symbol, with log-probability 0
        # One hypothesis per sentence: a beam search's K beams are one prefix until its first step.
        start = src.new_full((src.shape[0], 1), cfg.bos_id)
        forced = torch.tensor(prefix, dtype=src.dtype, device=src.device)
        self.history = torch.cat([start, forced.expand(start.shape[0], -1)], dim=1)  # (N, step + 1)
        prefixes = [[]] * src.shape[0] if rules.prefixes is None else rules.prefixes
        self.forced, self.forced_lengths = padded_rows(prefixes, cfg.pad_id, src.device)
        # pad and the start symbol are never generated, unless the start symbol is eos (NLLB).
        banned = ({cfg.pad_id, cfg.bos_id} - {cfg.eos_id}) | (set() if eos else {cfg.eos_id})
        self.banned = torch.tensor(sorted(banned), device=src.device)
        # The ids the output layer scores (None: all): the shortlist's, with eos, the banned ids
        # and the forced prefixes', which stay in the normaliser as without a shortlist; banned
        # becomes their columns.
        self.vocabulary = None if shortlist is None else self._shortlisted(shortlist, src)
        # pad's column: banned anyway, it takes the writes that ban nothing (repeated n-grams)
        self.pad_column = cfg.pad_id
        if self.vocabulary is not None:
            self.pad_column = int(torch.searchsorted(self.vocabulary, cfg.pad_id))
            self.banned = torch.searchsorted(self.vocabulary, self.banned)
        steps = 1 + int(self.max_lens.max()) if len(max_lens) else 0  # start symbol + limit
        self.members = [
            _Member(m, src, src_lengths, steps, incremental, self.vocabulary) for m in models
        ]

    def _shortlisted(self, shortlist: Shortlist, src) -> torch.Tensor:
        """The shortlist's ids for ``src``, eos, the banned and the forced ids: sorted, unique."""
        ids = shortlist.vocabulary(src)
        eos = ids.new_tensor([self.cfg.eos_id])
        forced = self.forced.reshape(-1).to(ids.dtype)
        return torch.cat([ids, eos, self.banned.to(ids.dtype), forced]).unique()

    @property
    def size(self) -> int:
        return self.sentences.shape[0]

    def _columns(self, ids: torch.Tensor) -> torch.Tensor:
        """The output columns of token ``ids`` (the ids themselves without a shortlist)."""
        if self.vocabulary is None:
            return ids
        return torch.searchsorted(self.vocabulary, ids.contiguous())

    def next_tokens(self, k: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The k most probable next tokens of every hypothesis: float32 log-probabilities and
        token ids, both (N, k), best first; k None: every scored token, in id order (ids None
        when that is the whole vocabulary)."""
        rules = self._rules(self.history.shape[0])
        # One model's top k: its int8 output layer's row scales go to the row kernel.
        logits, scales = self._logits(unscaled=k is not None and not rules)
        vocab = logits[0].shape[1]
        found = candidates(
            logits, None if k is None else min(k, vocab), self.banned, rules=rules, scales=scales
        )
        log_probs, ids = found
        if self.vocabulary is None:
            return log_probs, ids
        return log_probs, self.vocabulary.expand(log_probs.shape) if ids is None else (
            self.vocabulary[ids]
        )

    def drawn(
        self, sampling: Sampling, uniforms: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every hypothesis' next token drawn by ``sampling`` with ``uniforms`` (N,): its
        float32 log-probability and token id, (N,) each (``next_token.drawn``)."""
        logits, _ = self._logits()
        rules = self._rules(len(logits[0]))
        log_probs, columns = drawn(logits, self.banned, sampling, uniforms, rules=rules)
        return log_probs, columns if self.vocabulary is None else self.vocabulary[columns]

    def _logits(self, unscaled: bool = False) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Each member's (N, V) logits of the step (the cache then holds the whole history),
        and None; ``unscaled`` (honoured for one model): its int8 output layer's unscaled rows
        and their (N,) scales (``_Member.logits``)."""
        unscaled = unscaled and len(self.members) == 1
        outputs = [
            m.logits(self.history, self.cached, self.src_lengths, unscaled) for m in self.members
        ]
        self.cached = self.history.shape[1]
        return [logits for logits, _ in outputs], outputs[0][1]

    def _rules(self, rows: int) -> list:
        """The step's masks of (N, V) log-probabilities."""
        rules = []
        width = rows // self.size  # hypotheses per sentence
        step = self.history.shape[1] - 1 - self.shared  # of the sentences' own prefixes
        if step < self.forced.shape[1]:
            forced = (self.forced_lengths > step).repeat_interleave(width)
            tokens = self._columns(self.forced[:, step].repeat_interleave(width))
            rules.append(lambda log_probs: force(log_probs, forced, tokens))
        if self.rules.no_repeat_ngram:
            generated = self._columns(self.history[:, 1:])
            size, harmless = self.rules.no_repeat_ngram, self.pad_column

            def no_repeats(log_probs):
                ban_repeated_ngrams(log_probs, generated, generated.shape[1], size, harmless)

            rules.append(no_repeats)
        return rules

    def keep_sentences(self, kept: torch.Tensor) -> None:
        """Keep active sentences ``kept`` (A',); ``advance`` then picks their rows."""
        self.src_lengths = self.src_lengths.index_select(0, kept)
        self.max_lens = self.max_lens.index_select(0, kept)
        self.sentences = self.sentences.index_select(0, kept)
        self.forced = self.forced.index_select(0, kept)
        self.forced_lengths = self.forced_lengths.index_select(0, kept)
        for member in self.members:
            member.keep_sentences(kept)

    def advance(self, tokens: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Continue hypotheses ``rows`` (N',) of the previous step (None: every row, in place)
        with ``tokens`` (N',). The caller knows whether hypotheses moved: asking the tensors
        would sync the host."""
        if rows is not None:  # reorder the self-attention caches only when hypotheses moved
            self.history = self.history.index_select(0, rows)
            for member in self.members:
                member.reorder(rows)
        self.history = torch.cat([self.history, tokens[:, None]], dim=1)


def padded_rows(rows: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, ...]:
    """Token rows as a (B, P) tensor padded with ``pad_id`` and their lengths (B,)."""
    host = torch.device("cpu")  # built on the host, copied once
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64, device=host)
    padded = torch.full((len(rows), int(lengths.max()) if len(rows) else 0), pad_id, device=host)
    for row, tokens in enumerate(rows):
        padded[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64, device=host)
    return padded.to(device), lengths.to(device)


Models = Transformer | Sequence[Transformer]


def _models(model: Models) -> list[Transformer]:
    """An ensemble's members (one model: itself), checked to share a vocabulary."""
    models = [model] if isinstance(model, Transformer) else list(model)
    if not models:
        raise ValueError("an ensemble needs at least one model")
    check_ensemble(models)
    return models


def check_ensemble(models: Sequence[Transformer]) -> None:
    """Members of an ensemble score the same vocabulary with the same special ids."""
    first = models[0].cfg
    special = ("vocab_size", "pad_id", "bos_id", "eos_id")
    for index, other in enumerate(models[1:], 2):
        differs = [f for f in special if getattr(other.cfg, f) != getattr(first, f)]
        if differs:
            raise ValueError(
                f"ensemble model {index} has another vocabulary than model 1 ({differs[0]}: "
                f"{getattr(other.cfg, differs[0])} against {getattr(first, differs[0])})"
            )


def _check(models, max_lens, src, src_lengths, beam, nbest, prefix, rules: Rules) -> None:
    for model in models:
        device = model.embedding.weight.device
        for name, tensor in (("src", src), ("src_lengths", src_lengths)):
            if tensor.device != device:
                raise ValueError(
                    f"{name} must be on the model's device ({device}), got {tensor.device}"
                )
    check_arguments(max_lens, src, beam, nbest, prefix, rules)


def check_arguments(
    max_lens, src, beam: int, nbest: int, prefix: Sequence[int], rules: Rules = Rules()
) -> None:
    """The search settings and length limits every search takes (one-line ValueErrors)."""
    if isinstance(beam, bool) or not isinstance(beam, numbers.Integral) or beam < 1:
        raise ValueError(f"beam must be an int >= 1, got {beam!r}")
    if not 1 <= nbest <= beam:
        raise ValueError(f"nbest must be between 1 and beam ({beam}), got {nbest}")
    check_no_repeat_ngram(rules.no_repeat_ngram)
    lengths = max_lens.cpu()  # one host copy: the check is on the host
    shortest = torch.full(src.shape[:1], len(prefix) + 1, device=lengths.device)
    if rules.prefixes is not None:
        if len(rules.prefixes) != src.shape[0]:
            raise ValueError(
                f"prefixes must hold one prefix per sentence ({src.shape[0]}), got "
                f"{len(rules.prefixes)}"
            )
        shortest += torch.tensor(
            [len(p) for p in rules.prefixes], dtype=torch.int64, device=lengths.device
        )
    if max_lens.shape != src.shape[:1] or bool((lengths < shortest).any()):
        raise ValueError(
            f"max_lens must be ({src.shape[0]},) lengths of at least the prefix and a token "
            f"({shortest.tolist()}), got {max_lens}"
        )


def _steps(max_lens: torch.Tensor, prefix: Sequence[int]) -> range:
    """The search's steps: the number of tokens generated before each (the prefix counts)."""
    return range(len(prefix), int(max_lens.max()) if max_lens.numel() else 0)


@torch.inference_mode()  # no autograd bookkeeping: part of the per-op cost of a decoding step
def greedy(
    model: Models,
    src: torch.Tensor,
    src_lengths: torch.Tensor,
    max_lens: torch.Tensor,
    *,
    penalty: LengthPenalty = LengthPenalty(),
    incremental: bool = True,
    eos: bool = True,
    prefix: Sequence[int] = (),
    shortlist: Shortlist | None = None,
    rules: Rules = Rules(),
    on_done: OnDone | None = None,
) -> list[Hypothesis]:
    """The most probable next token at every step, for src (B, S) with lengths (B,); at most
    ``max_lens`` (B,) tokens each. ``model``: a model, or the models of an ensemble (their
    probabilities averaged at every step, each with its own caches). ``incremental=False``
    recomputes the whole prefix every step (no KV cache); ``eos=False`` never ends a hypothesis
    early (fixed-length benchmarks). ``prefix``: tokens forced after the start symbol (NLLB's
    target language), with log-probability 0, counted in the lengths and returned in the
    hypotheses' tokens, as transformers' ``forced_bos_token_id`` does. ``shortlist``: score only
    the words it lists for the batch's source tokens (``fastnmt.shortlist``). ``rules``: forced
    per-sentence prefixes (scored) and banned repeated n-grams. ``on_done(sentence, [best])``:
    called as each sentence's search ends."""
    models = _models(model)
    _check(models, max_lens, src, src_lengths, 1, 1, prefix, rules)
    batch = _Batch(models, src, src_lengths, max_lens, incremental, eos, prefix, shortlist, rules)
    return _greedy(batch, max_lens, prefix, penalty, lambda step: batch.next_tokens(1), on_done)


@torch.inference_mode()
def sample(
    model: Models,
    src: torch.Tensor,
    src_lengths: torch.Tensor,
    max_lens: torch.Tensor,
    *,
    sampling: Sampling,
    streams: torch.Tensor | None = None,
    penalty: LengthPenalty = LengthPenalty(),
    incremental: bool = True,
    eos: bool = True,
    prefix: Sequence[int] = (),
    shortlist: Shortlist | None = None,
    rules: Rules = Rules(),
) -> list[list[Hypothesis]]:
    """``sampling.samples`` sampled outputs per sentence, best score first; arguments as
    ``greedy``'s. ``streams`` (B,) int64: each sentence's random stream (default: its row), so
    that a sentence draws the same samples in any batch (the translator passes input positions);
    ``sampling.seed`` None draws a seed from torch's generator."""
    models = _models(model)
    _check(models, max_lens, src, src_lengths, 1, 1, prefix, rules)
    sampling = resolve_seed(sampling)
    n = sampling.samples
    if streams is None:
        streams = torch.arange(src.shape[0], device=src.device)
    # Each sample is a sentence of its own: stream s * n + j.
    row_streams = streams.to(src.device)[:, None] * n + torch.arange(n, device=src.device)
    copies = dict(repeats=n, dim=0)
    expanded = [x.repeat_interleave(**copies) for x in (src, src_lengths, max_lens)]
    prefixes = None if rules.prefixes is None else [p for p in rules.prefixes for _ in range(n)]
    rules = Rules(prefixes, rules.no_repeat_ngram)
    batch = _Batch(models, *expanded, incremental, eos, prefix, shortlist, rules)
    seed = torch.tensor(sampling.seed, device=src.device)
    keys = stream_keys(seed, row_streams.reshape(-1))  # once: a step hashes only its number

    def draw(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        random = uniforms_at(keys.index_select(0, batch.sentences), step)
        log_probs, tokens = batch.drawn(sampling, random)
        return log_probs[:, None], tokens[:, None]

    found = _greedy(batch, expanded[2], prefix, penalty, draw, None)
    return [_best(found[i : i + n], n) for i in range(0, len(found), n)]


def _greedy(batch: _Batch, max_lens, prefix, penalty, choose, on_done) -> list[Hypothesis]:
    """One token a step per sentence, ``choose(step)`` giving each hypothesis' log-probability
    and token (A, 1) each, until eos or the length limit; ``on_done`` as ``greedy``'s."""
    eos_id = batch.cfg.eos_id
    log_probs = torch.zeros(batch.size, device=batch.max_lens.device)  # (A,)
    results: list[Hypothesis | None] = [None] * batch.size
    for step in _steps(max_lens, prefix):
        best, tokens = (x[:, 0] for x in choose(step))  # (A,), (A,)
        log_probs += best
        done = (tokens == eos_id) | (batch.max_lens <= step + 1)  # (A,)
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
                results[sentence] = Hypothesis.from_generated(ids, log_prob, eos_id, penalty)
                if on_done is not None:
                    on_done(sentence, [results[sentence]])
            rows = (~done).nonzero()[:, 0]
            if not rows.numel():
                break
            batch.keep_sentences(rows)
            log_probs, tokens = log_probs[rows], tokens[rows]
        batch.advance(tokens, rows)
    return results


@torch.inference_mode()
def beam_search(
    model: Models,
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
    rules: Rules = Rules(),
    on_done: OnDone | None = None,
) -> list[list[Hypothesis]]:
    """The ``nbest`` best hypotheses per sentence (best first) of a beam search of width
    ``beam``, arguments as ``greedy``'s (``on_done`` gets the n-best list).

    fairseq's algorithm: each step takes the 2K best continuations of a sentence's K beams; those
    ending in eos among the best K are finished, the best K others go on. A sentence is done with
    K finished hypotheses (the K best scores when more finish in one step, as in transformers'
    ``early_stopping=True``), or at its length limit, where its best K continuations are finished as
    they are. With K as large as the number of possible prefixes the search is exhaustive.
    """
    models = _models(model)
    _check(models, max_lens, src, src_lengths, beam, nbest, prefix, rules)
    k, eos_id = beam, models[0].cfg.eos_id
    # The first step scores one hypothesis per sentence (its K beams would all be the empty
    # prefix); its best K continuations become the K beams.
    batch = _Batch(models, src, src_lengths, max_lens, incremental, eos, prefix, shortlist, rules)
    scores = torch.zeros((batch.size, 1), device=src.device)  # (A, W)
    finished: list[list[Hypothesis]] = [[] for _ in range(src.shape[0])]
    for step in _steps(max_lens, prefix):
        # A sentence's best 2K continuations are among its hypotheses' best 2K each.
        log_probs, next_ids = batch.next_tokens(2 * k)  # (N, C), C = 2K (or V if fewer)
        width, per_beam = scores.shape[1], log_probs.shape[1]
        top, index = best_candidates(scores.view(-1, 1) + log_probs, batch.size, 2 * k)  # (A, 2K)
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
            if on_done is not None:
                for index in batch.sentences[done].tolist():
                    on_done(index, _best(finished[index], nbest))
            kept = (~done).nonzero()[:, 0]
            if not kept.numel():
                break
            batch.keep_sentences(kept)
            rows, tokens, scores = rows[kept], tokens[kept], scores[kept]
        batch.advance(tokens.view(-1), rows.view(-1))
    return [_best(h, nbest) for h in finished]


def _best(hypotheses: list[Hypothesis], n: int) -> list[Hypothesis]:
    return sorted(hypotheses, key=lambda h: h.score, reverse=True)[:n]


def best_candidates(candidates, sentences: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
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
        finished[index].append(Hypothesis.from_generated(ids, log_prob, eos_id, penalty))
        grown.add(index)
    for index in grown:  # more than K finishing at once: the K best scores stay (as transformers)
        finished[index] = _best(finished[index], k)
    full = [len(finished[index]) >= k for index in batch.sentences.tolist()]
    last = batch.max_lens <= batch.history.shape[1]
    return torch.tensor(full, device=last.device) | last
