"""Beam search as two fixed-shape programs over static caches: the decoder loop a CUDA graph
replays.

``fastnmt.decoding.search`` drops finished sentences, grows its caches and reads every step's
outcome on the host: the least arithmetic, the right thing on a CPU. On a GPU a step of a small
model is all host time (tens of launches and a host sync per step), which a CUDA graph removes if
the step keeps its shapes and decides everything on the device. So here every tensor has the shape
of a batch bucket: B sentence slots (unused ones are empty sentences), S source positions, K beams
(N = B*K hypothesis rows, sentence-major), T positions (the longest search):

- the self-attention caches have room for all T positions (``kv_cache.FixedKVCache``): a step
  writes its keys at a device position, attention masks the positions not yet written by key
  lengths, and the beams' reorder gathers one (N, T) table of cache rows shared by all layers;
- a sentence's finished hypotheses live in K slots, merged by score with each step's new ones
  (the K best stay, as ``search.beam_search`` keeps them); a sentence that is done stays in the
  batch with its slots frozen;
- the host asks whether every sentence is done every ``CHECK_EVERY`` steps (one sync), and
  reads the results once at the end.

The beam algorithm is ``search.beam_search``'s (greedy is K = 1, as there): the first step
starts from one live beam per sentence (the others at -inf), and the results are the same up
to the rounding of GEMMs over a different number of rows. Two programs per bucket: ``start``
(encode, project the cross-attention keys, feed the forced prefix, the first search step) and
``step``. On CUDA (``graph_reasons`` empty) each is captured once per bucket after eager warm-up
calls; all graphs share one memory pool, safe in any replay order because every tensor a
program allocates dies inside it (state, inputs and caches are allocated outside capture).
Elsewhere the same programs are called: that is how they are tested without a GPU.

Sampling (``search.sample``'s) runs in the same programs with K = samples rows per sentence that
never move: the seed and each row's random stream are device tensors loaded with the batch, and
the draws are keyed by the clock's device position, so a replayed step draws fresh numbers.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace

import torch

from fastnmt.cuda_graphs import Program, capture_on
from fastnmt.decoding.next_token import (
    Sampling,
    ban_repeated_ngrams,
    candidates,
    drawn,
    force,
    resolve_seed,
    uniforms,
)
from fastnmt.decoding.search import (
    Hypothesis,
    LengthPenalty,
    Rules,
    best_candidates,
    check_arguments,
    padded_rows,
)
from fastnmt.kv_cache import FixedKVCache, KVCache, StepClock
from fastnmt.model import LayerCache, Transformer

CHECK_EVERY = 4  # steps between the host's checks that every sentence is done
SOURCE_ROUNDING = 16  # bucket lengths (source positions, decoding steps) are multiples of this
PREFIX_ROUNDING = 8  # and the room for forced per-sentence prefixes, of this
WARMUP_CALLS = 2  # eager calls of each program before capture (allocation, autotuning)
# Searches (buckets x settings) a model keeps, each with its caches and graphs: a corpus needs a
# few; a server seeing every batch size and length could otherwise hold hundreds.
MAX_SEARCHES = 32

NEG_INF = float("-inf")


def graph_reasons(device: torch.device) -> list[str]:
    """Why the search's programs cannot be captured as CUDA graphs (empty: they can)."""
    return [] if device.type == "cuda" else [f"CUDA graphs need a CUDA device, got {device.type}"]


class StaticSearch:
    """One bucket's search state and programs: B slots, S source positions, K beams, T steps.

    Fill with ``load``, then ``run``; ``results`` reads the n-best of the first ``count`` slots."""

    def __init__(
        self,
        model: Transformer,
        bucket: tuple[int, int, int],
        *,
        beam: int,
        penalty: LengthPenalty,
        eos: bool,
        prefix: Sequence[int],
        sampling: Sampling | None = None,
        prefix_room: int = 0,
        no_repeat_ngram: int = 0,
    ):
        """``sampling`` (its seed unused: ``load`` takes one): ``sampling.samples`` independent
        samples per sentence instead of a beam search, as ``search.sample``. ``prefix_room``:
        the longest forced per-sentence prefix ``load`` may be given (``search.Rules``);
        ``no_repeat_ngram``: as the rules'."""
        cfg, device = model.cfg, model.embedding.weight.device
        sentences, source, steps = bucket
        self.model, self.sampling, self.no_repeat_ngram = model, sampling, no_repeat_ngram
        self.penalty, self.prefix = penalty, list(prefix)
        beam = beam if sampling is None else sampling.samples
        rows = sentences * beam

        def long(*size, fill=0):
            return torch.full(size, fill, dtype=torch.int64, device=device)

        # Inputs, copied in by ``load``.
        self.src, self.src_lengths = long(sentences, source, fill=cfg.pad_id), long(sentences)
        self.max_lens = long(sentences)
        self.forced = long(sentences, prefix_room, fill=cfg.pad_id)  # per-sentence prefixes
        self.forced_lengths = long(sentences)
        # Sampling's random numbers: a function of the seed, each row's stream and the step.
        self.seed, self.streams = long(1), long(rows)
        # Decoder state.
        self.clock = StepClock(rows, steps, device)
        self.caches = [
            LayerCache(FixedKVCache(self.clock), KVCache(static=True)) for _ in model.decoder
        ]
        self.memory = torch.zeros(
            sentences, source, cfg.d_model, device=device, dtype=model.embedding.weight.dtype
        )
        # Search state: the hypotheses (bos, then generated tokens) and their scores.
        self.history = long(rows, steps + 1, fill=cfg.pad_id)  # (N, 1 + T)
        self.scores = torch.zeros(sentences, beam, device=device)  # (B, K) log-probabilities
        self.done = torch.zeros(sentences, dtype=torch.bool, device=device)
        # Finished hypotheses: K slots per sentence, best first (-inf: empty).
        self.finished_scores = torch.zeros(sentences, beam, dtype=torch.float64, device=device)
        self.finished_log_probs = torch.zeros(sentences, beam, device=device)
        self.finished_tokens = long(sentences, beam, steps + 1)
        self.finished_lengths = long(sentences, beam)
        # Constants.
        self.start_tokens = torch.tensor([cfg.bos_id, *self.prefix], device=device)
        self.first_rows = torch.arange(0, rows, beam, device=device)[:, None]  # (B, 1)
        self.own_rows = torch.arange(rows, device=device).view(sentences, beam)  # (B, K)
        # The length penalty of a hypothesis of t + 1 tokens, in float64 as search's floats.
        self.penalties = torch.tensor(
            [penalty(t + 1) for t in range(steps)], dtype=torch.float64, device=device
        )
        banned = ({cfg.pad_id, cfg.bos_id} - {cfg.eos_id}) | (set() if eos else {cfg.eos_id})
        self.banned = torch.tensor(sorted(banned), device=device)
        self.candidates = min(2 * beam, cfg.vocab_size)  # per hypothesis and step
        self.start, self.step = Program(self._start), Program(self._step)

    # The programs: device work only, on the tensors above. ---------------------------------

    def _start(self) -> None:
        self._restart()
        memory = self.model.encode(self.src, self.src_lengths)  # (B, S, E)
        self.memory.copy_(memory)
        for cache in self.caches:  # projected again from this batch's memory
            cache.cross_attn.length = 0
        for position in range(len(self.prefix)):  # forced: decoded, never chosen
            self._decode(self.history[:, position : position + 1])
        self._step()

    def _restart(self) -> None:
        self.clock.restart()
        self.history.fill_(self.model.cfg.pad_id)
        self.history[:, : self.start_tokens.shape[0]] = self.start_tokens
        if self.sampling is None:  # one live beam per sentence: K copies of one prefix at first
            self.scores.fill_(NEG_INF)
            self.scores[:, 0] = 0.0
        else:  # K independent samples
            self.scores.zero_()
        self.done.zero_()
        self.finished_scores.fill_(NEG_INF)

    def _decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Decoder states (N, E) of ``tokens`` (N, 1) at the clock's position; advances it."""
        self.clock.begin()
        states = self.model.decode(
            tokens, self.memory, self.src_lengths, self.caches, start=self.clock.position
        )
        self.clock.end()
        return states[:, 0]

    def _step(self) -> None:
        """One search step: ``search.beam_search``'s (or ``search.sample``'s), on fixed
        shapes."""
        position = self.clock.position.clone()  # the step: tokens generated before it
        tokens_in = self.history.gather(1, position.expand(self.history.shape[0])[:, None])
        logits = self.model.logits(self._decode(tokens_in))
        if self.sampling is None:
            self._search_step(logits, position)
        else:
            self._sample_step(logits, position)

    def _rules(self, position: torch.Tensor) -> list:
        """The step's masks of (N, V) log-probabilities: the dynamic search's rules
        (``search.Rules``), at the device's position."""
        rules = []
        k = self.scores.shape[1]
        if self.forced.shape[1]:
            step = position - len(self.prefix)  # (1,) into the sentences' own prefixes
            column = step.clamp(max=self.forced.shape[1] - 1)
            tokens = self.forced.index_select(1, column)[:, 0].repeat_interleave(k)  # (N,)
            forced = (self.forced_lengths > step).repeat_interleave(k)
            rules.append(lambda log_probs: force(log_probs, forced, tokens))
        if self.no_repeat_ngram:
            generated, size = self.history[:, 1:], self.no_repeat_ngram
            pad = self.model.cfg.pad_id

            def no_repeats(log_probs):
                ban_repeated_ngrams(log_probs, generated, position, size, pad)

            rules.append(no_repeats)
        return rules

    def _search_step(self, logits: torch.Tensor, position: torch.Tensor) -> None:
        log_probs, ids = candidates(
            [logits], self.candidates, self.banned, rules=self._rules(position)
        )  # (N, C)
        sentences, k = self.scores.shape
        totals = self.scores.view(-1, 1) + log_probs  # (N, C) with each hypothesis' score
        top, index = best_candidates(totals, sentences, 2 * k)  # (B, 2K)
        origins = self.first_rows + index // self.candidates  # (B, 2K) rows continued
        tokens = ids.view(sentences, -1).gather(1, index)  # (B, 2K)
        ends = tokens == self.model.cfg.eos_id
        last = self.max_lens <= position + 1  # (B,)
        finishing = (ends[:, :k] | last[:, None]) & (top[:, :k] > NEG_INF)
        self._finish(finishing, top[:, :k], origins[:, :k], tokens[:, :k], position)
        alive, pick = top.masked_fill(ends, NEG_INF).topk(k, dim=1)  # (B, K)
        rows = origins.gather(1, pick).view(-1)  # (N,)
        self.history.copy_(self.history.index_select(0, rows))
        self.clock.reorder(rows)
        self._advance(alive, tokens.gather(1, pick), last, position)

    def _sample_step(self, logits: torch.Tensor, position: torch.Tensor) -> None:
        """Each row draws its next token (``next_token``): rows never move."""
        sentences, k = self.scores.shape
        random = uniforms(self.seed, self.streams, position)
        rules = self._rules(position)
        log_probs, tokens = drawn([logits], self.banned, self.sampling, random, rules=rules)
        tokens = tokens.view(sentences, k)
        top = self.scores + log_probs.view(sentences, k)  # (B, K)
        ends = tokens == self.model.cfg.eos_id
        last = self.max_lens <= position + 1  # (B,)
        self._finish((ends | last[:, None]) & (top > NEG_INF), top, self.own_rows, tokens, position)
        self._advance(top.masked_fill(ends, NEG_INF), tokens, last, position)

    def _advance(self, alive, tokens, last, position) -> None:
        """The step's outcome: the live hypotheses' scores (B, K) and next tokens (B, K) (after
        any reorder), and which sentences are done."""
        full = (self.finished_scores > NEG_INF).sum(dim=1) >= self.scores.shape[1]
        self.done |= full | last
        self.scores.copy_(alive)
        self.history.index_copy_(1, position + 1, tokens.reshape(-1, 1))

    def _finish(self, finishing, top, origins, tokens, position) -> None:
        """Merge the hypotheses ``finishing`` (B, K) with the finished slots: the K best scores
        stay, best first. A done sentence's slots are final."""
        finishing = finishing & ~self.done[:, None]
        sentences, k = finishing.shape
        score = top.double() / self.penalties.index_select(0, position)
        new_scores = score.masked_fill(~finishing, NEG_INF)
        hypotheses = self.history[origins]  # (B, K, 1 + T)
        hypotheses.index_copy_(2, position + 1, tokens[..., None])
        lengths = (position + 1).expand(sentences, k)
        scores, which = torch.cat([self.finished_scores, new_scores], dim=1).topk(k, dim=1)

        def merged(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            both = torch.cat([old, new], dim=1)
            index = which.view(*which.shape, *([1] * (both.dim() - 2)))
            return both.gather(1, index.expand(-1, -1, *both.shape[2:]))

        self.finished_log_probs.copy_(merged(self.finished_log_probs, top))
        self.finished_tokens.copy_(merged(self.finished_tokens, hypotheses))
        self.finished_lengths.copy_(merged(self.finished_lengths, lengths))
        self.finished_scores.copy_(scores)

    # The host's side. ------------------------------------------------------------------------

    def load(
        self,
        src: torch.Tensor,
        src_lengths: torch.Tensor,
        max_lens: torch.Tensor,
        streams: torch.Tensor | None = None,
        seed: int = 0,
        prefixes: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Copy a batch of at most B sentences, (b, s <= S), in; the other slots get empty
        sentences that finish at their first search step. Sampling: the sentences' random
        ``streams`` (b,) (default: their slots) and the ``seed``. ``prefixes``: each sentence's
        forced prefix, of at most ``prefix_room`` tokens."""
        count, length = src.shape
        self.forced.fill_(self.model.cfg.pad_id)
        self.forced_lengths.zero_()
        if prefixes:  # padded on the host: two copies in, however many sentences
            padded, lengths = padded_rows(prefixes, self.model.cfg.pad_id, self.forced.device)
            self.forced[: len(prefixes), : padded.shape[1]].copy_(padded)
            self.forced_lengths[: len(prefixes)].copy_(lengths)
        samples = self.scores.shape[1]
        slots = torch.arange(self.src.shape[0], device="cpu")  # host arithmetic, copied once
        if streams is not None:
            slots[:count] = streams
        rows = slots[:, None] * samples + torch.arange(samples, device="cpu")
        self.streams.copy_(rows.view(-1))
        self.seed.fill_(seed)
        self.src.fill_(self.model.cfg.pad_id)
        self.src[:count, :length].copy_(src, non_blocking=True)
        self.src_lengths.zero_()
        self.src_lengths[:count].copy_(src_lengths, non_blocking=True)
        self.max_lens.fill_(len(self.prefix) + 1)
        self.max_lens[:count].copy_(max_lens, non_blocking=True)

    def run(self, steps: int) -> None:
        """Search for ``steps`` steps at most (the longest max_lens), stopping early when every
        sentence is done."""
        self.start()
        for taken in range(len(self.prefix) + 1, steps):
            if (taken - len(self.prefix)) % CHECK_EVERY == 0 and bool(self.done.all()):
                return
            self.step()

    def results(self, count: int, nbest: int) -> list[list[Hypothesis]]:
        """The ``nbest`` best finished hypotheses of the first ``count`` slots, best first."""
        scores, log_probs, tokens, lengths = (
            x[:count].tolist()
            for x in (
                self.finished_scores,
                self.finished_log_probs,
                self.finished_tokens,
                self.finished_lengths,
            )
        )
        eos_id = self.model.cfg.eos_id
        found = []
        for slots in zip(scores, log_probs, tokens, lengths, strict=True):
            hypotheses = [
                Hypothesis.from_generated(ids[1 : 1 + length], log_prob, eos_id, self.penalty)
                for score, log_prob, ids, length in zip(*slots, strict=True)
                if score > NEG_INF
            ]
            found.append(sorted(hypotheses, key=lambda h: h.score, reverse=True)[:nbest])
        return found

    def capture(self, pool) -> None:
        """Warm up (allocating the caches, compiling kernels), then capture both programs, on
        the model's device."""
        capture_on(self.src.device, [self.start, self.step], pool, self._warm_up)

    def _warm_up(self) -> None:
        for _ in range(WARMUP_CALLS):
            self.start()
            self.step()


def _rounded(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class StaticSearches:
    """The static searches of one model: one per bucket and search setting, sharing one graph
    memory pool when captured (``capture``: CUDA). Batch sizes round up to
    a power of two, source lengths and steps to multiples of ``SOURCE_ROUNDING``, so a few
    buckets serve a whole corpus. The logits read the live output embedding (no transposed
    copy as ``Transformer.output_layer`` makes): a graph keeps the weights' addresses, so a
    model trained further is translated with its new weights."""

    def __init__(self, model: Transformer, *, capture: bool):
        self.model, self.capture = model, capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        # Least recently used first: past MAX_SEARCHES the first goes, with its graphs and caches.
        self.searches: OrderedDict[tuple, StaticSearch] = OrderedDict()

    @torch.inference_mode()
    def search(
        self,
        src: torch.Tensor,
        src_lengths: torch.Tensor,
        max_lens: torch.Tensor,
        *,
        beam: int,
        nbest: int = 1,
        penalty: LengthPenalty,
        eos: bool = True,
        prefix: Sequence[int] = (),
        sampling: Sampling | None = None,
        streams: torch.Tensor | None = None,
        rules: Rules | None = None,
    ) -> list[list[Hypothesis]]:
        """``search.beam_search``'s results for src (b, s) with lengths (b,) and max_lens (b,),
        host tensors (their copies in are the host's only work before the search); with
        ``sampling``, ``search.sample``'s for the sentences' ``streams`` (b,); ``rules`` as the
        searches'."""
        sampling, rules = resolve_seed(sampling), rules or Rules()
        width = beam if sampling is None else sampling.samples
        check_arguments(max_lens, src, width, nbest, prefix, rules)
        count, length = src.shape
        if not count:
            return []
        steps = int(max_lens.max())
        limit = self.model.cfg.max_positions
        bucket = (
            1 << (count - 1).bit_length(),
            min(_rounded(length, SOURCE_ROUNDING), limit),
            min(_rounded(steps, SOURCE_ROUNDING), limit),
        )
        unseeded = None if sampling is None else replace(sampling, seed=None)
        longest = max(map(len, rules.prefixes or [()]))
        room = _rounded(longest, PREFIX_ROUNDING)
        key = (bucket, beam, penalty, eos, tuple(prefix), unseeded, room, rules.no_repeat_ngram)
        search = self.searches.get(key)
        fresh = search is None
        if not fresh:
            self.searches.move_to_end(key)
        else:
            if len(self.searches) == MAX_SEARCHES:
                self.searches.popitem(last=False)
            search = StaticSearch(
                self.model,
                bucket,
                beam=beam,
                penalty=penalty,
                eos=eos,
                prefix=prefix,
                sampling=unseeded,
                prefix_room=room,
                no_repeat_ngram=rules.no_repeat_ngram,
            )
            self.searches[key] = search
        seed = 0 if sampling is None else sampling.seed
        search.load(src, src_lengths, max_lens, streams, seed, rules.prefixes)
        if fresh and self.capture:
            self._capture(search)
        search.run(steps)
        return search.results(count, nbest)

    def _capture(self, search: StaticSearch) -> None:
        try:
            search.capture(self.pool)
        except RuntimeError as error:  # the same programs, called
            search.start.graph = search.step.graph = None
            reason = str(error).splitlines()[0]
            warnings.warn(f"CUDA graph capture failed, decoding eagerly: {reason}", stacklevel=3)
