"""Translating text with a trained model: ``Translator.from_checkpoint(path).translate(lines)``.

Sentences are encoded, truncated to what the model can take (with a warning naming the line),
sorted by length and packed into batches by tokens, searched (greedy for beam 1, else beam search;
``fastnmt.search``), decoded, and returned in input order. Empty lines translate to empty lines
without running the model.
"""

from __future__ import annotations

import contextlib
import copy
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastnmt import checkpoint
from fastnmt.checkpoint import CheckpointError
from fastnmt.data import DataError, Vocabulary, make_batch, vocabulary_from_bytes
from fastnmt.distributed import resolve_device
from fastnmt.model import AttentionRecord, ModelConfig, Transformer
from fastnmt.precision import fastest_dtype as fastest_dtype  # importable from here too
from fastnmt.precision import fastest_precision
from fastnmt.quantize import bf16_packing_supported, int8_supported, pack_bf16, quantize_int8
from fastnmt.search import Hypothesis, LengthPenalty, beam_search, greedy
from fastnmt.shortlist import Shortlist
from fastnmt.static_search import StaticSearches, graph_reasons

# The weights' dtype of each inference precision (None: fp32). int8: fp32 weights whose GEMMs
# run in int8 (fastnmt.quantize, CPUs).
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": None}


class TruncationWarning(UserWarning):
    """An input longer than the model's positions was cut to fit."""


def autocast(device: torch.device | str, dtype: torch.dtype | None):
    """Autocast to ``dtype`` on ``device``'s type, or nothing for full precision."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype)


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
    model = model.to(device, PRECISIONS[precision] or torch.float32).eval().requires_grad_(False)
    if precision == "int8":
        return quantize_int8(model)
    if precision == "bf16" and not bf16_packing_supported(device):  # same results, 1.4-1.8x GEMMs
        return pack_bf16(model)
    return model


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


class Translator:
    """A model and its vocabulary ready to translate.

    dtype: the weights' dtype for translating (bf16 is several times faster than fp32 on CPUs
    with AMX); a model in another dtype is translated by a converted copy, so weights are not cast
    again at every op as autocast would. None: the model's own. max_tokens bounds a batch's padded
    source tokens, max_sentences its sentences (times ``beam`` hypotheses each). shortlist: a
    ``fastnmt.shortlist.Shortlist`` or the path of one: each batch scores only the target words
    it lists for the batch's source tokens. static: search on fixed batch buckets with every
    decision on the device (``fastnmt.static_search``), captured as CUDA graphs on a GPU; None
    (auto): on CUDA without a shortlist, where it removes the host's per-step cost; the
    shrinking batches of ``fastnmt.search`` do less arithmetic, which a CPU prefers.
    """

    def __init__(
        self,
        model: Transformer,
        vocab: Vocabulary,
        *,
        device: torch.device | str = "cpu",
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
        if dtype is not None and model.embedding.weight.dtype != dtype:
            model = copy.deepcopy(model).to(dtype)
        self.model, self.vocab = model, vocab
        self.target_prefix: list[int] = list(getattr(vocab, "target_prefix", []))
        self.device = torch.device(device)
        self.max_tokens, self.max_sentences = max_tokens, max_sentences
        if isinstance(shortlist, (str, Path)):
            shortlist = Shortlist.load(shortlist, vocab)
        self.shortlist = shortlist
        graphs = not graph_reasons(self.device)
        if static is None:
            static = shortlist is None and graphs
        self.static = StaticSearches(model, capture=graphs) if static else None

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        *,
        device: torch.device | str | None = None,
        precision: str = "auto",
        **options,
    ) -> Translator:
        """Load a checkpoint directory (or a training output directory: its best checkpoint).
        Loading executes no code (safetensors, json). ``precision``: auto, fp32, bf16, fp16 or
        int8 (CPUs: fp32 weights, int8 GEMMs; ``fastnmt.quantize``).
        Raises CheckpointError (one line) for a missing, corrupt or incompatible checkpoint."""
        model, vocab = load_checkpoint(path)
        model = _inference_model(model, device, precision)
        return cls(model, vocab, device=model.embedding.weight.device, **options)

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
    def load(cls, path: str | Path, *, src_code=None, tgt_code=None, **options) -> Translator:
        """``from_pretrained`` for a Hugging Face checkpoint directory (its config.json names a
        ``model_type``), else ``from_checkpoint``; ``src_code``/``tgt_code`` are NLLB's
        language codes."""
        if is_pretrained_directory(path):
            return cls.from_pretrained(path, src_lang=src_code, tgt_lang=tgt_code, **options)
        if src_code or tgt_code:
            raise ValueError("language codes are for Hugging Face NLLB/M2M100 checkpoints")
        return cls.from_checkpoint(path, **options)

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
        attention: bool = False,
        incremental: bool = True,
        eos: bool = True,
        first_line: int = 1,
    ) -> list[Translation]:
        """Translations with their n-best candidates and scores, in input order.

        beam: 1 is greedy search. lenpen / alpha: the length penalty (``search.LengthPenalty``).
        A sentence of S source tokens (eos included) gets at most max_len_a * S + max_len_b
        target tokens (eos included). attention: also the attention probabilities of every layer
        and head for the best candidate. incremental=False recomputes the whole prefix every step
        and eos=False forces every output to its length limit (both for benchmarks). first_line:
        the line number of sentences[0] in warnings. ``sentences`` may be Translations with
        their ``source_tokens`` set (encoded once, by a caller that checked them), which are
        filled in and returned.
        """
        if max_len_a < 0 or max_len_b < 0 or max_len_a * 1 + max_len_b < 1:
            raise ValueError(
                f"max_len_a and max_len_b must be >= 0 with room for a token, got "
                f"{max_len_a}, {max_len_b}"
            )
        penalty = LengthPenalty(lenpen, alpha)
        translations = [
            text if isinstance(text, Translation) else self._encoded(text, first_line + i)
            for i, text in enumerate(sentences)
        ]
        todo = [i for i, t in enumerate(translations) if t.source.strip()]
        with self._inference():
            for indices in self._batches(todo, translations):
                batch = make_batch(
                    [translations[i].source_tokens for i in indices],
                    None,
                    indices,
                    pad_id=self.vocab.pad_id,
                    bos_id=self.vocab.bos_id,
                    eos_id=self.vocab.eos_id,
                )
                limit = (max_len_a * batch.src_lengths + max_len_b).long()
                shortest = len(self.target_prefix) + 1
                max_lens = limit.clamp(shortest, self.model.cfg.max_positions)
                inputs = (batch.src, batch.src_lengths, max_lens)
                search = dict(penalty=penalty, eos=eos, prefix=self.target_prefix)
                if self.static is not None and incremental:  # host tensors: it copies them in
                    found = self.static.search(*inputs, beam=beam, nbest=nbest, **search)
                else:
                    found = self._search(inputs, beam, nbest, incremental, search)
                for index, hypotheses in zip(indices, found, strict=True):
                    translations[index].candidates = self._candidates(hypotheses)
                if attention:
                    self.add_attention([translations[i] for i in indices])
        return translations

    def _search(self, inputs, beam: int, nbest: int, incremental: bool, search: dict):
        """``fastnmt.search``'s n-best lists for host tensors (src, src_lengths, max_lens)."""
        inputs = (self.model, *(x.to(self.device) for x in inputs))
        search = search | dict(incremental=incremental, shortlist=self.shortlist)
        if beam == 1 and nbest == 1:  # the same search; greedy skips beam bookkeeping
            return [[h] for h in greedy(*inputs, **search)]
        return beam_search(*inputs, beam=beam, nbest=nbest, **search)

    def _encoded(self, text: str, line: int) -> Translation:
        """``text`` encoded for the search, truncated to fit (with a warning)."""
        tokens = self.vocab.encode([text])[0] if text.strip() else []
        translation = Translation(text, tokens)
        if len(tokens) > self.max_source_tokens:
            warnings.warn(
                f"line {line}: {len(tokens)} subword tokens, truncated to the model's limit of "
                f"{self.max_source_tokens}",
                TruncationWarning,
                stacklevel=4,
            )
            translation.source_tokens = tokens[: self.max_source_tokens]
            translation.truncated = True
        return translation

    def _batches(self, todo: list[int], translations: list[Translation]) -> Iterator[list[int]]:
        """Runs of sentences of similar length (sorted), each within max_tokens padded source
        tokens and max_sentences sentences."""
        sizes = {i: len(translations[i].source_tokens) + 1 for i in todo}  # + eos
        batch: list[int] = []
        for index in sorted(todo, key=sizes.__getitem__):
            # Sorted by size: the sentence being added is the batch's longest.
            full = len(batch) >= self.max_sentences
            if batch and (full or (len(batch) + 1) * sizes[index] > self.max_tokens):
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
