"""Lexical vocabulary shortlists (Marian's ``--shortlist``, CTranslate2's vocabulary map): a
decoding batch scores only the target words its source sentences make likely, so the output
layer's GEMM and the top-k run over a few thousand words instead of the whole vocabulary.

Built from a prepared training corpus (``fastnmt.preprocess``; ``fastnmt.train`` leaves one in
OUTPUT/prepared). For source token s and target token t, with c(s) the pairs whose source has s
and c(s, t) those whose target also has t,

    p(t | s) = c(s, t) / c(s),

a shortlist keeps the ``frequent`` most frequent target tokens (always scored) and, for each
source token, the ``per_token`` other targets of highest p(t | s) (ties to the lower id). A
batch's vocabulary is the frequent tokens plus the lists of every source token in the batch. The
search normalizes the softmax over that vocabulary (as Marian does), so scores move slightly and
a translation can only use listed words: check BLEU with and without (docs/translation.md has
the numbers).

    python -m fastnmt.shortlist --prepared-dir runs/multi30k/prepared --output shortlist.st
    python -m fastnmt.translate --checkpoint runs/multi30k --shortlist shortlist.st
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from fastnmt.data import DataError, EncodedCorpus, Vocabulary, write_atomically

FORMAT = "fastnmt-shortlist"
_PAIRS_PER_CHUNK = 2048  # pairs whose (source, target) token products are counted at once


@dataclass(frozen=True)
class Shortlist:
    frequent: torch.Tensor  # (F,) int64 target ids always scored
    candidates: torch.Tensor  # (V, per_token) int64 targets per source id, -1 past its list
    vocabulary_sha256: str  # of the sentencepiece model the ids belong to

    def vocabulary(self, src: torch.Tensor) -> torch.Tensor:
        """The sorted target ids to score for a batch of source ids ``src`` (any shape)."""
        listed = self.candidates[src.unique().cpu()].flatten()
        return torch.cat([self.frequent, listed[listed >= 0]]).unique().to(src.device)

    @classmethod
    def build(
        cls,
        corpus: EncodedCorpus,
        vocab: Vocabulary,
        *,
        frequent: int = 200,
        per_token: int = 50,
        max_pairs: int = 1_000_000,
        seed: int = 1,
    ) -> Shortlist:
        """Count co-occurrences in ``corpus`` (ids of ``vocab``; a uniform sample of
        ``max_pairs`` pairs when it has more) and keep the lists the module docstring says."""
        if frequent < 0 or per_token < 1 or max_pairs < 1:
            raise ValueError(
                f"frequent must be >= 0, per_token and max_pairs >= 1, got {frequent}, "
                f"{per_token}, {max_pairs}"
            )
        pairs = np.arange(len(corpus))
        if len(pairs) > max_pairs:
            pairs = np.sort(np.random.default_rng(seed).choice(pairs, max_pairs, replace=False))
        size = len(vocab)
        keys, counts, source_counts, target_counts = _cooccurrences(corpus, pairs, size)
        top = np.argsort(-target_counts, kind="stable")[:frequent]
        table = _best_per_source(keys, counts, source_counts, top, size, per_token)
        return cls(torch.from_numpy(top), torch.from_numpy(table), _sha256(vocab))

    def save(self, path: str | Path) -> None:
        """One safetensors file, written atomically."""
        tensors = {"frequent": self.frequent, "candidates": self.candidates}
        metadata = {"format": FORMAT, "vocabulary_sha256": self.vocabulary_sha256}
        write_atomically(Path(path), save(tensors, metadata))

    @classmethod
    def load(cls, path: str | Path, vocab: Vocabulary) -> Shortlist:
        """Read a shortlist for a model with vocabulary ``vocab``; DataError (one line) for a
        missing or damaged file or one built for another vocabulary."""
        try:
            with safe_open(path, "pt") as opened:
                metadata = opened.metadata() or {}
                tensors = [opened.get_tensor(name) for name in ("frequent", "candidates")]
        except (OSError, SafetensorError) as error:
            if isinstance(error, SafetensorError):
                raise DataError(f"shortlist {path}: not a safetensors file") from None
            raise DataError(f"shortlist: {str(error).splitlines()[0]}") from None
        if metadata.get("format") != FORMAT or tensors[1].shape[0] != len(vocab):
            raise DataError(f"shortlist {path}: not a fastnmt shortlist for {len(vocab)} words")
        if metadata.get("vocabulary_sha256") != _sha256(vocab):
            raise DataError(f"shortlist {path}: built for another vocabulary than the model's")
        return cls(*tensors, metadata["vocabulary_sha256"])


def _sha256(vocab: Vocabulary) -> str:
    return hashlib.sha256(vocab.to_bytes()).hexdigest()


def _cooccurrences(corpus: EncodedCorpus, pairs: np.ndarray, size: int):
    """Over ``pairs``: the distinct keys s * size + t of co-occurring (source s, target t) and
    their pair counts c(s, t); the pair counts c(s) of every source token; and how often each
    target token occurs (which ones are frequent)."""
    keys, counts = np.empty(0, np.int64), np.empty(0, np.int64)
    source_counts, target_counts = np.zeros(size, np.int64), np.zeros(size, np.int64)
    for start in range(0, len(pairs), _PAIRS_PER_CHUNK):
        chunk = pairs[start : start + _PAIRS_PER_CHUNK]
        sources, source_lengths = corpus.src.gather(chunk)
        targets, target_lengths = corpus.tgt.gather(chunk)
        target_counts += np.bincount(targets, minlength=size)
        pair_of_source = np.repeat(np.arange(len(chunk)), source_lengths)
        source_counts += np.bincount(
            np.unique(pair_of_source * size + sources) % size, minlength=size
        )
        # every (source token, target token) product of each pair, once per pair
        products = target_lengths[pair_of_source]
        target_starts = np.cumsum(target_lengths) - target_lengths
        within = np.arange(products.sum()) - np.repeat(np.cumsum(products) - products, products)
        product_targets = targets[np.repeat(target_starts[pair_of_source], products) + within]
        product_pairs = np.repeat(pair_of_source, products)
        in_pair = (
            product_pairs * size * size + np.repeat(sources, products) * size + product_targets
        )
        keys, inverse = np.unique(
            np.concatenate([keys, np.unique(in_pair) % (size * size)]), return_inverse=True
        )
        counts = np.bincount(
            inverse, weights=np.concatenate([counts, np.ones(len(inverse) - len(counts))])
        )
    return keys, counts.astype(np.int64), source_counts, target_counts


def _best_per_source(keys, counts, source_counts, frequent, size: int, per_token: int):
    """(size, per_token) int64: each source token's targets by p(t | s), best first and frequent
    ones left out, padded with -1."""
    sources, targets = keys // size, keys % size
    listed = ~np.isin(targets, frequent)
    sources, targets, counts = sources[listed], targets[listed], counts[listed]
    order = np.lexsort((targets, -counts / source_counts[sources], sources))
    sources, targets = sources[order], targets[order]
    rank = np.arange(len(sources)) - np.searchsorted(sources, sources)  # within its source
    kept = rank < per_token
    table = np.full((size, per_token), -1, np.int64)
    table[sources[kept], rank[kept]] = targets[kept]
    return table
