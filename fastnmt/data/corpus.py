"""Encoded corpora: token id sequences stored flat in numpy arrays (in memory, or memory-mapped
from prepared data), encoding a parallel corpus and filtering its pairs by length."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

from fastnmt.data.text import DataError, ParallelCorpus
from fastnmt.data.vocabulary import Vocabulary


class TokenArray:
    """Token id sequences stored flat, as numpy arrays: sequence i is
    ``ids[offsets[i]:offsets[i + 1]]`` and has ``lengths[i]`` ids (no bos/eos).

    In memory (``from_lists``) or memory-mapped from a prepared directory
    (``fastnmt.data.prepared``), where the ids are read lazily, a batch at a time. A mapped array
    pickles as its file names (a DataLoader worker started by spawn maps the files itself) and can
    give its pages back (``release_pages``), so reading a corpus does not grow the reader's
    resident memory.
    """

    def __init__(self, ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, files=()):
        self.ids, self.offsets, self.lengths = ids, offsets, lengths
        self._files = tuple(files)  # the MappedFiles behind ids, offsets, lengths, if mapped

    @classmethod
    def from_lists(cls, sequences: list[list[int]], dtype=np.int64) -> TokenArray:
        lengths = np.fromiter(map(len, sequences), np.int64, count=len(sequences))
        ids = np.fromiter(chain.from_iterable(sequences), dtype, count=int(lengths.sum()))
        return cls.from_flat(ids, lengths)

    @classmethod
    def from_flat(cls, ids: np.ndarray, lengths: np.ndarray) -> TokenArray:
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(ids, offsets, lengths)

    @classmethod
    def mapped(cls, ids: MappedFile, offsets: MappedFile, lengths: MappedFile) -> TokenArray:
        return cls(ids.array, offsets.array, lengths.array, files=(ids, offsets, lengths))

    def __reduce__(self):
        if self._files:
            return TokenArray.mapped, self._files
        return TokenArray, (self.ids, self.offsets, self.lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i] : self.offsets[i + 1]]

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids of sequences ``rows`` concatenated (int64) and their lengths: one vectorized
        read, however many sequences."""
        lengths = self.lengths[rows].astype(np.int64)
        starts_in_output = np.cumsum(lengths) - lengths
        positions = np.repeat(self.offsets[rows] - starts_in_output, lengths)
        positions += np.arange(len(positions))
        return self.ids[positions].astype(np.int64), lengths

    def select(self, rows: np.ndarray) -> TokenArray:
        """The sequences ``rows``, in memory, with this array's id type."""
        ids, lengths = self.gather(rows)
        return TokenArray.from_flat(ids.astype(self.ids.dtype), lengths)

    def release_pages(self) -> None:
        for file in self._files:
            file.release_pages()


class MappedFile:
    """A read-only memory map of a raw array file (``count`` values of ``dtype``)."""

    def __init__(self, path: str | Path, dtype: str, count: int):
        self.path, self.dtype, self.count = Path(path), np.dtype(dtype), count
        expected = count * self.dtype.itemsize
        try:
            with self.path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != expected or expected == 0:
                    raise DataError(
                        f"{self.path}: {size} bytes, expected {expected} ({count} x {self.dtype})"
                    )
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as error:
            raise DataError(f"{self.path}: cannot read: {error.strerror or error}") from None
        self.array = np.frombuffer(self._map, self.dtype, count)

    def __reduce__(self):
        return MappedFile, (self.path, self.dtype.str, self.count)

    def release_pages(self) -> None:
        """Drop this process's mapping of the pages read so far: they stay in the page cache,
        but no longer count in the resident memory of a process that reads the whole corpus
        over an epoch."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)


@dataclass
class EncodedCorpus:
    """Token ids per pair, without bos/eos (batching adds them)."""

    src: TokenArray
    tgt: TokenArray
    dropped: int  # pairs removed by length filtering

    @classmethod
    def from_lists(
        cls, src: list[list[int]], tgt: list[list[int]], dropped: int = 0
    ) -> EncodedCorpus:
        return cls(TokenArray.from_lists(src), TokenArray.from_lists(tgt), dropped)

    def __len__(self) -> int:
        return len(self.src)

    def release_pages(self) -> None:
        self.src.release_pages()
        self.tgt.release_pages()


# Why a pair is dropped, by precedence: code i + 1 of ``filter_codes`` is FILTER_REASONS[i].
FILTER_REASONS = ("empty", "too long", "length ratio")


def filter_codes(
    src_lengths: np.ndarray, tgt_lengths: np.ndarray, max_len: int, ratio: float
) -> np.ndarray:
    """Per pair, 0 when it is fit for training, else 1 + its index in FILTER_REASONS: an empty
    side, a side longer than ``max_len`` tokens counting its eos, or one side more than ``ratio``
    times as long as the other (usually a misalignment), as fairseq filters."""
    longest = np.maximum(src_lengths, tgt_lengths).astype(np.int64)
    shortest = np.minimum(src_lengths, tgt_lengths).astype(np.int64)
    codes = np.zeros(len(longest), np.int8)
    codes[longest > ratio * shortest] = 3
    codes[longest + 1 > max_len] = 2
    codes[shortest == 0] = 1
    return codes


def count_dropped(codes: np.ndarray) -> dict[str, int]:
    counts = np.bincount(codes, minlength=len(FILTER_REASONS) + 1)[1:]
    return {reason: int(count) for reason, count in zip(FILTER_REASONS, counts, strict=True)}


def nothing_kept(name: str, dropped: dict[str, int], max_len: int, ratio: float) -> DataError:
    counts = ", ".join(f"{count} {reason}" for reason, count in dropped.items() if count)
    return DataError(
        f"{name}: every pair was filtered out: {counts} (max_len={max_len} tokens, ratio={ratio})"
    )


def encode_corpus(
    corpus: ParallelCorpus, vocab: Vocabulary, max_len: int = 256, ratio: float = 9.0
) -> EncodedCorpus:
    """Encode both sides in memory and drop the pairs ``filter_codes`` rejects. Meant for
    validation loss (training data is prepared by ``fastnmt.data.prepared``); score BLEU on the
    unfiltered sentences so the reference set stays whole."""
    src = TokenArray.from_lists(vocab.encode(corpus.src))
    tgt = TokenArray.from_lists(vocab.encode_target(corpus.tgt))
    codes = filter_codes(src.lengths, tgt.lengths, max_len, ratio)
    dropped = count_dropped(codes)
    kept = np.flatnonzero(codes == 0)
    if not len(kept):
        raise nothing_kept(corpus.name, dropped, max_len, ratio)
    return EncodedCorpus(src.select(kept), tgt.select(kept), dropped=sum(dropped.values()))


def corpus_stats(corpus: EncodedCorpus) -> dict[str, int]:
    """Sizes for logging; token counts exclude bos/eos."""
    return {
        "pairs": len(corpus),
        "dropped": corpus.dropped,
        "src_tokens": int(corpus.src.lengths.sum()),
        "tgt_tokens": int(corpus.tgt.lengths.sum()),
        "max_src_len": int(corpus.src.lengths.max()),
        "max_tgt_len": int(corpus.tgt.lengths.max()),
    }
