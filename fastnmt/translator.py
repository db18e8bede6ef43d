"""Translating text with a trained model: ``Translator.from_checkpoint(path).translate(lines)``.

Sentences are encoded, truncated to what the model can take (with a warning naming the line),
sorted by length and packed into batches by tokens, searched (greedy for beam 1, else beam search;
``fastnmt.decoding.search``), decoded, and returned in input order. Empty lines translate to empty
lines without running the model.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fastnmt import checkpoint
from fastnmt.attention import Packed
from fastnmt.checkpoint import CheckpointError
from fastnmt.data import DataError, TokenArray, Vocabulary, make_batch, vocabulary_from_bytes
from fastnmt.decoding.next_token import Sampling, check_no_repeat_ngram, resolve_seed
from fastnmt.decoding.search import (
    Hypothesis,
    LengthPenalty,
    OnDone,
    Rules,
    beam_search,
    check_ensemble,
    greedy,
    sample,
)
from fastnmt.decoding.shortlist import Shortlist
from fastnmt.decoding.static_search import StaticSearches, graph_reasons
from fastnmt.devices import keep_freed_memory, resolve_device
from fastnmt.model import AttentionRecord, ModelConfig, Transformer
from fastnmt.ops import linear_cross_entropy
from fastnmt.ops.linear_cross_entropy import per_token_losses
from fastnmt.precision import fastest_dtype as fastest_dtype  # importable from here too
from fastnmt.precision import fastest_precision
from fastnmt.quantize import (
    bf16_packing_supported,
    int8_activation_dtype,
    int8_supported,
    pack_bf16,
    quantize_int8,
)

# The weights' dtype of each inference precision (None: fp32). int8: weights whose GEMMs run in
# int8 (fastnmt.quantize, CPUs), the rest bf16 where the CPU has native bf16, else fp32
# (``int8_activation_dtype``).
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": None}


class TruncationWarning(UserWarning):
    """An input longer than the model's positions was cut to fit."""


def is_pretrained_directory(path: str | Path) -> bool:
    """A Hugging Face checkpoint (config.json with a model_type), not a fastnmt one."""
    config = Path(path) / "config.json"
    try:
        return "model_type" in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


def load_checkpoint(path: str | Path) -> tuple[Transformer, Vocabulary]:
    """The fp32 model (on the CPU, in train mode) and vocabulary of a checkpoint directory or
    training output directory (its best checkpoint); loading executes no code. Raises
    CheckpointError (one line) for a missing, corrupt or incompatible checkpoint."""
    resolved = checkpoint.resolve(Path(path))
    loaded = checkpoint.load(resolved, with_trainer_state=False)
    try:
        cfg = ModelConfig(**loaded.config["model"])
        model = Transformer(cfg)
        model.load_state_dict(loaded.weights)
        vocab = vocabulary_from_bytes(loaded.vocabulary)
    except (KeyError, TypeError, RuntimeError, DataError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        raise CheckpointError(f"cannot load checkpoint {resolved}: {reason}") from None
    if len(vocab) != cfg.vocab_size:
        raise CheckpointError(
            f"cannot load checkpoint {resolved}: the vocabulary has {len(vocab)} pieces, the "
            f"model {cfg.vocab_size}"
        )
    return model, vocab


def _inference_model(model: Transformer, device, precision: str) -> Transformer:
    """``model`` on ``device`` ("auto" when None) in ``precision`` for translating."""
    if precision != "auto" and precision not in PRECISIONS:
        choices = ", ".join(PRECISIONS)
        raise ValueError(f"precision must be auto, {choices}; got {precision!r}")
    device = resolve_device("auto" if device is None else str(device))
    precision = fastest_precision(device, model.cfg) if precision == "auto" else precision
    if precision == "int8" and (reasons := int8_supported(device)):
        raise ValueError(f"precision int8: {'; '.join(reasons)}")
    if precision == "int8":
        model = model.to(device, int8_activation_dtype(device)).eval().requires_grad_(False)
        return quantize_int8(model)
    model = model.to(device, PRECISIONS[precision] or torch.float32).eval().requires_grad_(False)
    if precision == "bf16" and not bf16_packing_supported(device):  # same results, 1.4-1.8x GEMMs
        return pack_bf16(model)
    return model


def _in_dtype(model: Transformer, dtype: torch.dtype | None) -> Transformer:
    """``model``, or a copy in ``dtype``."""
    if dtype is None or model.embedding.weight.dtype == dtype:
        return model
    return copy.deepcopy(model).to(dtype)


def _target_log_probs(model: Transformer, batch: PackedPairs, *, per_token: bool, prefix=0):
    """Teacher-forced log-probabilities of a batch's targets, its pairs packed (no work on
    padding): per target token (tokens,), or summed per sentence (B,): the nll of the fused loss
    without label smoothing, as the trainer computes it, per token (never the tokens x
    vocabulary log-probabilities on the C++ kernels); a model with a packed output layer
    (``fastnmt.quantize``) computes its logits with it, as in its searches. The first ``prefix``
    tokens of each target (a forced prefix) are conditioned on, not scored, as the search
    forces them."""
    states = model.forward_packed(batch.src, batch.sources, batch.tgt_in, batch.targets)
    targets = batch.tgt_out
    if prefix:
        scored = batch.targets.positions >= prefix
        states, targets = states[scored], targets[scored]
    pad = model.cfg.pad_id
    if model.packed_output is not None:  # the search's GEMM, its weight packed once
        vocab = model.cfg.vocab_size
        losses = per_token_losses(
            states, model.packed_output, vocab, targets, 0.0, pad, statistics=False
        )
        log_probs = -losses[0]
    else:
        weight, bias = model.embedding.weight, model.output_bias
        log_probs = -linear_cross_entropy(states, weight, bias, targets, 0.0, pad, "none").loss
    if per_token:
        return log_probs
    sentences = torch.arange(len(batch.tgt_lengths), device=log_probs.device)
    scored = (batch.tgt_lengths - prefix).to(log_probs.device)
    sentence_of_token = sentences.repeat_interleave(scored)
    return log_probs.new_zeros(len(sentences)).index_add_(0, sentence_of_token, log_probs)


@dataclass
class PackedPairs:
    """Source/target pairs packed end to end for teacher forcing, without padding
    (``Transformer.forward_packed``): each source and its eos, each target's bos and tokens
    (the decoder's inputs) and its tokens and eos (the outputs)."""

    src: torch.Tensor  # (N_s,)
    sources: Packed
    tgt_in: torch.Tensor  # (N_t,)
    tgt_out: torch.Tensor  # (N_t,)
    targets: Packed

    @property
    def tgt_lengths(self) -> torch.Tensor:  # (B,) each target's tokens + eos
        return self.targets.cu_seqlens.diff()

    @classmethod
    def of(cls, sources: TokenArray, targets: TokenArray, rows, vocab, device) -> PackedPairs:
        """Pairs ``rows`` (an index array) of ``sources`` and ``targets``, without their eos
        and bos: a few vectorized numpy passes, whatever the number of pairs."""
        src, src_lengths = sources.gather(rows)
        tgt, tgt_lengths = targets.gather(rows)
        tgt_starts = np.cumsum(tgt_lengths) - tgt_lengths

        def tensor(ids: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(ids).to(device)

        return cls(
            src=tensor(np.insert(src, np.cumsum(src_lengths), vocab.eos_id)),
            sources=Packed.of_lengths(src_lengths + 1, device),
            tgt_in=tensor(np.insert(tgt, tgt_starts, vocab.bos_id)),
            tgt_out=tensor(np.insert(tgt, tgt_starts + tgt_lengths, vocab.eos_id)),
            targets=Packed.of_lengths(tgt_lengths + 1, device),
        )


class _Finished:
    """A batch's translations as its search finishes them: each one's candidates set and handed
    to ``on_translated`` (if any) once, through ``on_done`` (given to the search only with
    ``on_translated``) as soon as its search is over."""

    def __init__(self, translations, indices: list[int], candidates, on_translated):
        self.translations, self.indices, self.candidates = translations, indices, candidates
        self.on_translated = on_translated
        self.handed_over: set[int] = set()  # positions in the batch

    def on_done(self, position: int, hypotheses: list[Hypothesis]) -> None:
        """The searches' ``on_done``."""
        self._set(position, hypotheses)
        self._hand_over(position)

    def _set(self, position: int, hypotheses: list[Hypothesis]) -> None:
        self.translations[self.indices[position]].candidates = self.candidates(hypotheses)

    def _hand_over(self, position: int) -> None:
        self.handed_over.add(position)
        index = self.indices[position]
        self.on_translated(index, self.translations[index])

    def fill(self, found: list[list[Hypothesis]]) -> None:
        """The candidates of the sentences not handed over yet, from the search's result."""
        for position, hypotheses in enumerate(found):
            if position not in self.handed_over:
                self._set(position, hypotheses)

    def hand_over_rest(self) -> None:
        if self.on_translated is not None:
            for position in range(len(self.indices)):
                if position not in self.handed_over:
                    self._hand_over(position)


@dataclass
class Candidate:
    """One translation of a sentence."""

    text: str
    tokens: list[int]  # target subword ids, without eos
    score: float  # log_prob / length penalty: the ranking
    log_prob: float  # summed token log-probabilities, eos included when generated
    ended: bool  # False when cut by the length limit before eos


@dataclass
class Translation:
    source: str
    source_tokens: list[int]  # subword ids given to the model (after truncation), without eos
    candidates: list[Candidate] = field(default_factory=list)  # n-best, best first
    truncated: bool = False
    # Of the best candidate, with attention=True: per layer (H, Lq, Lk) without padding. Queries
    # and keys are the tokens with eos: target rows are the generated tokens (+ eos; after a
    # forced target prefix), source columns the source tokens + eos.
    attention: AttentionRecord | None = None

    @property
    def text(self) -> str:
        return self.candidates[0].text if self.candidates else ""


@dataclass
class Score:
    """A source/target pair's log-probability under the model (teacher-forced)."""

    log_prob: float  # summed over the target tokens and eos
    tokens: int  # target subword tokens scored, eos included
    normalised: float  # log_prob / length penalty(tokens), the search's ranking score

    @property
    def per_token(self) -> float:
        return self.log_prob / self.tokens


def _check_texts(texts, name: str, kinds: tuple[type, ...] = (str,)) -> None:
    """TypeError unless ``texts`` is a sequence of ``kinds``: a single string would pass for a
    sequence of one-character sentences, each translated."""
    if isinstance(texts, str | bytes):
        raise TypeError(f"{name} must be a list of strings, got one {type(texts).__name__}")
    for i, text in enumerate(texts):
        if not isinstance(text, kinds):
            raise TypeError(f"{name}[{i}] must be a str, got {type(text).__name__}")


class Translator:
    """A model (or an ensemble of models sharing a vocabulary) and its vocabulary ready to
    translate and to score.

    device: where the batches go; None: the (first) model's, which the searches require.
    dtype: the weights' dtype for translating (bf16 is several times faster than fp32 on CPUs
    with AMX); a model in another dtype is translated by a converted copy, so weights are not cast
    again at every op as autocast would. None: the model's own. max_tokens bounds a batch's padded
    source tokens, max_sentences its sentences (times ``beam`` hypotheses each). shortlist: a
    ``fastnmt.shortlist.Shortlist`` or the path of one: each batch scores only the target words
    it lists for the batch's source tokens. static: search on fixed batch buckets with every
    decision on the device (``fastnmt.decoding.static_search``), captured as CUDA graphs on a GPU;
    None (auto): on CUDA without a shortlist, where it removes the host's per-step cost; the
    shrinking batches of ``fastnmt.decoding.search`` do less arithmetic, which a CPU prefers. An
    ensemble (``model`` a list) averages its members' probabilities at every step (fairseq's rule);
    it decodes with ``fastnmt.decoding.search`` (no static search). On a CPU, the process's malloc
    keeps freed memory for reuse (``fastnmt.devices.keep_freed_memory``, as the command-line tools
    do; glibc's ``MALLOC_*`` variables override it): otherwise every decoding step page-faults its
    logits and activations in afresh (beam 4 on test2016: 71,000 faults a run, against 3,400).
    """

    def __init__(
        self,
        model: Transformer | Sequence[Transformer],
        vocab: Vocabulary,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        max_tokens: int = 6000,
        max_sentences: int = 256,
        shortlist: Shortlist | str | Path | None = None,
        static: bool | None = None,
    ):
        """``vocab`` also gives the ``target_prefix`` every translation starts with, if it has
        one (NLLB's target language: ``PretrainedVocabulary``)."""
        if max_tokens < 1 or max_sentences < 1:
            raise ValueError(
                f"max_tokens and max_sentences must be positive, got {max_tokens}, {max_sentences}"
            )
        if static and shortlist is not None:
            raise ValueError("static search scores the whole vocabulary: no shortlist with it")
        models = [model] if isinstance(model, Transformer) else list(model)
        check_ensemble(models)
        if static and len(models) > 1:
            raise ValueError("static search runs one model: no ensemble with it")
        self.models = [_in_dtype(m, dtype) for m in models]
        self.model, self.vocab = self.models[0], vocab
        self.target_prefix: list[int] = list(getattr(vocab, "target_prefix", []))
        self.device = self.model.embedding.weight.device if device is None else torch.device(device)
        if self.device.type == "cpu":  # each step's logits and activations reused, not faulted in
            keep_freed_memory()
        self.max_tokens, self.max_sentences = max_tokens, max_sentences
        if isinstance(shortlist, (str, Path)):
            shortlist = Shortlist.load(shortlist, vocab)
        self.shortlist = shortlist
        graphs = not graph_reasons(self.device)
        if static is None:
            static = shortlist is None and graphs and len(models) == 1
        self.static = StaticSearches(self.model, capture=graphs) if static else None

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path | Sequence[str | Path],
        *,
        device: torch.device | str | None = None,
        precision: str = "auto",
        **options,
    ) -> Translator:
        """Load a checkpoint directory (or a training output directory: its best checkpoint),
        or several as an ensemble (the same vocabulary). Loading executes no code (safetensors,
        json). ``precision``: auto, fp32, bf16, fp16 or int8 (CPUs: fp32 weights, int8 GEMMs;
        ``fastnmt.quantize``). Raises CheckpointError (one line) for a missing, corrupt or
        incompatible checkpoint, or an ensemble's checkpoints with different vocabularies."""
        paths = [path] if isinstance(path, (str, Path)) else list(path)
        loaded = [load_checkpoint(p) for p in paths]
        vocab = loaded[0][1]
        for other, (_, other_vocab) in zip(paths[1:], loaded[1:], strict=True):
            if other_vocab.to_bytes() != vocab.to_bytes():
                raise CheckpointError(
                    f"checkpoint {other} has another vocabulary than {paths[0]}: an ensemble's "
                    "models must share one"
                )
        models = [_inference_model(model, device, precision) for model, _ in loaded]
        device = models[0].embedding.weight.device
        return cls(models if len(models) > 1 else models[0], vocab, device=device, **options)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        src_lang: str | None = None,
        tgt_lang: str | None = None,
        device: torch.device | str | None = None,
        precision: str = "auto",
        **options,
    ) -> Translator:
        """A Hugging Face Opus-MT (Marian) or NLLB/M2M100 checkpoint directory, run by fastnmt's
        model and search (needs ``fastnmt[transformers]``). NLLB needs ``src_lang`` and
        ``tgt_lang`` (e.g. eng_Latn, deu_Latn). Other options as ``from_checkpoint``."""
        from fastnmt.integrations.transformers.convert import load_pretrained

        model, vocab = load_pretrained(directory, src_lang=src_lang, tgt_lang=tgt_lang)
        model = _inference_model(model, device, precision)
        return cls(model, vocab, device=model.embedding.weight.device, **options)

    @classmethod
    def load(
        cls, path: str | Path | Sequence[str | Path], *, src_code=None, tgt_code=None, **options
    ) -> Translator:
        """``from_pretrained`` for a Hugging Face checkpoint directory (its config.json names a
        ``model_type``), else ``from_checkpoint`` (several paths: an ensemble);
        ``src_code``/``tgt_code`` are NLLB's language codes."""
        paths = [path] if isinstance(path, (str, Path)) else list(path)
        if len(paths) == 1 and is_pretrained_directory(paths[0]):
            return cls.from_pretrained(paths[0], src_lang=src_code, tgt_lang=tgt_code, **options)
        if any(map(is_pretrained_directory, paths)):
            raise ValueError("ensembles are of fastnmt checkpoints, not Hugging Face ones")
        if src_code or tgt_code:
            raise ValueError("language codes are for Hugging Face NLLB/M2M100 checkpoints")
        return cls.from_checkpoint(paths if len(paths) > 1 else paths[0], **options)

    @property
    def max_target_tokens(self) -> int:
        """The longest output the model generates, in subword tokens (eos included)."""
        return self.model.cfg.max_positions

    @property
    def max_source_tokens(self) -> int:
        """Subword tokens of a source sentence the model can take (the eos takes one more)."""
        return self.model.cfg.max_positions - 1

    def translate(self, sentences: list[str], **options) -> list[str]:
        """The best translation of each sentence, in input order; options as ``translate_full``."""
        return [t.text for t in self.translate_full(sentences, **options)]

    @torch.inference_mode()
    def translate_full(
        self,
        sentences: list[str] | list[Translation],
        *,
        beam: int = 4,
        nbest: int = 1,
        lenpen: float = 1.0,
        alpha: float | None = None,
        max_len_a: float = 1.2,
        max_len_b: int = 10,
        sampling: Sampling | None = None,
        prefix: Sequence[str | None] | None = None,
        no_repeat_ngram: int = 0,
        attention: bool = False,
        incremental: bool = True,
        eos: bool = True,
        first_line: int | Sequence[int] = 1,
        on_translated: Callable[[int, Translation], None] | None = None,
    ) -> list[Translation]:
        """Translations with their n-best candidates and scores, in input order.

        beam: 1 is greedy search. lenpen / alpha: the length penalty (``search.LengthPenalty``).
        A sentence of S source tokens (eos included) gets at most max_len_a * S + max_len_b
        target tokens (eos included). sampling: ``next_token.Sampling`` instead of search (beam
        unused; nbest up to its samples, which are the candidates); a sentence's samples depend
        on its seed and line number only, not on its batch.
        prefix: per sentence, text its translation must start with (None or "": none), scored
        by the model. no_repeat_ngram N > 0: no n-gram of N subword tokens twice in an output.
        attention: also the attention probabilities of every layer and head for the best
        candidate. incremental=False recomputes the whole prefix every step and eos=False forces
        every output to its length limit (both for benchmarks). first_line: the line number of
        sentences[0] (the others follow), or each sentence's, in warnings, errors and sampling's
        streams. ``sentences`` may be Translations with their
        ``source_tokens`` set (encoded once, by a caller that checked them), which are filled in
        and returned. on_translated(index, translation): called once per sentence as soon as its
        translation is final, before the call returns: where the search allows (greedy and beam
        search, without attention), while the rest of its batch is still searched.
        """
        _check_texts(sentences, "sentences", (str, Translation))
        room = max_len_a + max_len_b  # the limit of a one-token source (eos)
        if not (math.isfinite(max_len_a) and max_len_a >= 0 and max_len_b >= 0 and room >= 1):
            raise ValueError(
                f"max_len_a and max_len_b must be finite and >= 0 with room for a token, got "
                f"{max_len_a}, {max_len_b}"
            )
        if sampling is not None and not 1 <= nbest <= sampling.samples:
            raise ValueError(
                f"nbest must be between 1 and samples ({sampling.samples}), got {nbest}"
            )
        check_no_repeat_ngram(no_repeat_ngram)
        sampling = resolve_seed(sampling)  # one seed for the call: any batching draws the same
        search = dict(penalty=LengthPenalty(lenpen, alpha), eos=eos, prefix=self.target_prefix)
        lines = (
            list(range(first_line, first_line + len(sentences)))
            if isinstance(first_line, int)
            else list(first_line)
        )
        translations = self._encoded(sentences, lines)
        lengths = torch.tensor(  # + eos; host tensors, as the searches take them
            [len(t.source_tokens) + 1 for t in translations], device="cpu"
        )
        limit = (max_len_a * lengths + max_len_b).long()
        max_lens = limit.clamp(len(self.target_prefix) + 1, self.model.cfg.max_positions)
        todo = [i for i, t in enumerate(translations) if t.source.strip()]
        forced = self._prefixes(prefix, max_lens, todo, lines)
        if on_translated is not None:  # blank sentences are final already
            for index in sorted(set(range(len(translations))) - set(todo)):
                on_translated(index, translations[index])
        with self._inference():
            for indices in self._batches(todo, [len(t.source_tokens) for t in translations]):
                batch = make_batch(
                    [translations[i].source_tokens for i in indices],
                    None,
                    indices,
                    pad_id=self.vocab.pad_id,
                    bos_id=self.vocab.bos_id,
                    eos_id=self.vocab.eos_id,
                )
                inputs = (batch.src, batch.src_lengths, max_lens[indices])
                rules = Rules(forced and [forced[i] for i in indices], no_repeat_ngram)
                if sampling is not None:
                    streams = torch.tensor([lines[i] - 1 for i in indices], device="cpu")
                    search.update(sampling=sampling, streams=streams)
                finished = _Finished(translations, indices, self._candidates, on_translated)
                if self.static is not None and incremental:  # host tensors: it copies them in
                    found = self.static.search(
                        *inputs, beam=beam, nbest=nbest, rules=rules, **search
                    )
                else:
                    early = on_translated is not None and not attention  # attention: per batch
                    on_done = finished.on_done if early else None
                    found = self._search(inputs, beam, nbest, incremental, search, rules, on_done)
                finished.fill(found)
                if attention:
                    self.add_attention([translations[i] for i in indices])
                finished.hand_over_rest()
        return translations

    def _prefixes(self, prefix: Sequence[str | None] | None, max_lens, todo, lines: list[int]):
        """Each sentence's forced target prefix as subword ids (None: no prefixes), checked to
        leave room for a token within its length limit ``max_lens`` where it is translated (the
        indices ``todo``)."""
        if prefix is None:
            return None
        count = len(max_lens)
        if isinstance(prefix, str) or len(prefix) != count:
            given = "a string" if isinstance(prefix, str) else f"{len(prefix)}"
            raise ValueError(f"prefix must hold one text per sentence ({count}), got {given}")
        _check_texts(prefix, "prefix", (str, type(None)))
        texts = [text if text and text.strip() else "" for text in prefix]
        encoded = iter(self.vocab.encode_target([t for t in texts if t]))
        forced = [next(encoded) if text else [] for text in texts]
        room = (max_lens - len(self.target_prefix) - 1).tolist()  # tokens before the last
        for index in todo:
            if len(forced[index]) > room[index]:
                raise ValueError(
                    f"prefix of line {lines[index]}: {len(forced[index])} subword tokens, "
                    f"past the length limit of {room[index]} (max_len_a * source tokens + "
                    "max_len_b, eos included, less one)"
                )
        return forced

    def _search(self, inputs, beam: int, nbest: int, incremental: bool, search: dict, rules,
                on_done: OnDone | None):  # fmt: skip
        """``fastnmt.decoding.search``'s n-best lists for host tensors (src, src_lengths,
        max_lens); ``on_done`` as the searches take it (not sampling's: its n-best lists are
        complete at the end)."""
        models = self.models if len(self.models) > 1 else self.model
        inputs = (models, *(x.to(self.device) for x in inputs))
        search = search | dict(incremental=incremental, shortlist=self.shortlist, rules=rules)
        if "sampling" in search:
            return [h[:nbest] for h in sample(*inputs, **search)]
        if beam == 1 and nbest == 1:  # the same search; greedy skips beam bookkeeping
            return [[h] for h in greedy(*inputs, **search, on_done=on_done)]
        return beam_search(*inputs, beam=beam, nbest=nbest, **search, on_done=on_done)

    @torch.inference_mode()
    def score(
        self,
        sources: list[str],
        targets: list[str],
        *,
        lenpen: float = 1.0,
        alpha: float | None = None,
        first_line: int = 1,
    ) -> list[Score]:
        """Each source/target pair's log-probability under the model (an ensemble: fairseq's
        average of the members' probabilities at every token), teacher-forced in batches
        through the fused loss: the sum over the target's tokens and eos, and with ``lenpen`` /
        ``alpha`` the search's length-normalised score. Too long sides are truncated, with a
        warning naming the line (``first_line``: that of sources[0])."""
        _check_texts(sources, "sources")
        _check_texts(targets, "targets")
        if len(sources) != len(targets):
            raise ValueError(
                f"sources and targets must pair up, got {len(sources)} and {len(targets)}"
            )
        penalty = LengthPenalty(lenpen, alpha)
        lines = list(range(first_line, first_line + len(sources)))
        pairs = list(
            zip(
                self._encoded(sources, lines),
                self._encoded(targets, lines, target=True),
                strict=True,
            )
        )
        prefix = self.target_prefix  # the decoder's forced start: in the batch's size too
        sources = TokenArray.from_lists([s.source_tokens for s, _ in pairs])
        targets = TokenArray.from_lists([prefix + t.source_tokens for _, t in pairs])
        sizes = np.maximum(sources.lengths, targets.lengths).tolist()
        log_probs = torch.zeros(len(pairs), dtype=torch.float64, device="cpu")
        with self._inference():
            for indices in self._batches(list(range(len(pairs))), sizes):
                rows = np.asarray(indices)
                batch = PackedPairs.of(sources, targets, rows, self.vocab, self.device)
                log_probs[indices] = self._pair_log_probs(batch).double().cpu()
        counts = (targets.lengths - len(prefix) + 1).tolist()  # + eos
        divisors = {count: penalty(count) for count in set(counts)}  # a few dozen lengths
        return [
            Score(value, count, value / divisors[count])
            for value, count in zip(log_probs.tolist(), counts, strict=True)
        ]

    def _pair_log_probs(self, batch) -> torch.Tensor:
        """(B,) summed target log-probabilities of a batch of pairs, on the device."""
        prefix = len(self.target_prefix)
        if len(self.models) == 1:
            return _target_log_probs(self.model, batch, per_token=False, prefix=prefix)
        members = [_target_log_probs(m, batch, per_token=True, prefix=prefix) for m in self.models]
        mixed = torch.stack(members).logsumexp(0) - math.log(len(members))  # (tokens,)
        return torch.stack([s.sum() for s in mixed.split((batch.tgt_lengths - prefix).tolist())])

    def _encoded(self, texts: list, lines: list[int], target: bool = False) -> list[Translation]:
        """``texts`` encoded in one call (by the vocabulary's target side if ``target``), each
        truncated to fit the model, after the target prefix for a target (with a warning naming
        its line); items already a Translation are kept. Blank texts have no tokens."""
        todo = [text for text in texts if not isinstance(text, Translation) and text.strip()]
        encoded = iter((self.vocab.encode_target if target else self.vocab.encode)(todo))
        limit = self.max_source_tokens - (len(self.target_prefix) if target else 0)
        translations = []
        for text, line in zip(texts, lines, strict=True):
            if isinstance(text, Translation):
                translations.append(text)
                continue
            tokens = next(encoded) if text.strip() else []
            translations.append(Translation(text, tokens))
            if len(tokens) > limit:
                warnings.warn(
                    f"line {line}: {len(tokens)} subword tokens, truncated to the model's limit "
                    f"of {limit}",
                    TruncationWarning,
                    stacklevel=4,  # past the decorator: translate_full's or score's caller
                )
                translations[-1].source_tokens = tokens[:limit]
                translations[-1].truncated = True
        return translations

    def _batches(self, todo: list[int], lengths: list[int]) -> Iterator[list[int]]:
        """Runs of sentences of similar ``lengths`` (tokens without eos, by index; sorted),
        each within max_tokens padded tokens and max_sentences sentences."""
        batch: list[int] = []
        for index in sorted(todo, key=lengths.__getitem__):
            # Sorted by size: the sentence being added is the batch's longest (+ eos).
            full = len(batch) >= self.max_sentences
            if batch and (full or (len(batch) + 1) * (lengths[index] + 1) > self.max_tokens):
                yield batch
                batch = []
            batch.append(index)
        if batch:
            yield batch

    def _candidates(self, hypotheses: list[Hypothesis]) -> list[Candidate]:
        """Candidates without the forced target prefix (its log-probability is 0)."""
        forced = len(self.target_prefix)
        texts = self.vocab.decode([h.tokens[forced:] for h in hypotheses])
        return [
            Candidate(text, h.tokens[forced:], h.score, h.log_prob, h.ended)
            for text, h in zip(texts, hypotheses, strict=True)
        ]

    @torch.no_grad()
    def add_attention(self, translations: list[Translation]) -> None:
        """Set ``attention`` of translations that have candidates: the probabilities of every
        layer and head for the best candidate, from one teacher-forced pass over all of them
        (the probabilities the search saw)."""
        translations = [t for t in translations if t.candidates]
        if not translations:
            return
        best = [t.candidates[0] for t in translations]
        batch = make_batch(
            [t.source_tokens for t in translations],
            [self.target_prefix + c.tokens for c in best],
            list(range(len(translations))),
            pad_id=self.vocab.pad_id,
            bos_id=self.vocab.bos_id,
            eos_id=self.vocab.eos_id,
        ).to(self.device)
        record = AttentionRecord()
        with self._inference():
            memory = self.model.encode(batch.src, batch.src_lengths, record)
            self.model.decode(batch.tgt_in, memory, batch.src_lengths, record=record)
        for row, (translation, candidate) in enumerate(zip(translations, best, strict=True)):
            source = len(translation.source_tokens) + 1  # + eos
            target = len(self.target_prefix) + len(candidate.tokens) + candidate.ended

            def crop(weights, queries, keys, row=row):
                return [w[row, :, :queries, :keys].float().cpu() for w in weights]

            translation.attention = AttentionRecord(
                encoder=crop(record.encoder, source, source),
                decoder=crop(record.decoder, target, target),
                cross=crop(record.cross, target, source),
            )

    @contextlib.contextmanager
    def _inference(self):
        """Eval mode for the block; the model's mode is restored after it."""
        if not self.model.training:  # setting every module's mode is a tree walk per call
            yield
            return
        self.model.eval()
        try:
            yield
        finally:
            self.model.train()
