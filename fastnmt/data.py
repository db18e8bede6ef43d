"""Training data: parallel text (Multi30k, parallel files, TSV), a joint sentencepiece vocabulary,
length filtering and token-bucketed batches.

Every problem with the user's data raises :class:`DataError` with a one-line message naming the file
(and line where there is one), so the command line can print it and exit with status 2.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import mmap
import os
import random
import tempfile
import urllib.request
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields, replace
from itertools import chain
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
import torch.utils.data


class DataError(ValueError):
    """Bad user data; message is one line naming the file (and line)."""


@dataclass
class ParallelCorpus:
    """Sentence-aligned text: ``src[i]`` translates to ``tgt[i]``."""

    src: list[str]
    tgt: list[str]
    name: str  # for messages and logs, e.g. "multi30k/train" or a path


# ---------------------------------------------------------------------------------------------
# Reading text files


_GZIP_MAGIC = b"\x1f\x8b"


def _read_bytes(path: Path) -> bytes:
    """The file's contents, gunzipped when it is gzip (recognised by its magic bytes, not by its
    name, so a misnamed file still reads correctly)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except OSError as error:
        raise DataError(f"{path}: cannot read: {error.strerror or error}") from None
    if not data.startswith(_GZIP_MAGIC):
        return data
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as error:
        raise DataError(f"{path}: not a valid gzip file ({error})") from None


def read_lines(path: str | Path) -> list[str]:
    """The lines of a UTF-8 text file (plain or gzip), without line terminators.

    Lines are split on "\\n" only (a trailing "\\r" is dropped): ``str.splitlines`` would also split
    on characters such as U+2028 inside a sentence and silently misalign a parallel corpus.
    """
    path = Path(path)
    data = _read_bytes(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line_number = data.count(b"\n", 0, error.start) + 1
        raise not_utf8(path, line_number, data[error.start]) from None
    lines = text.split("\n")
    if lines[-1] == "":  # the terminator of the last line, not an empty sentence
        lines.pop()
    if not lines:
        raise DataError(f"{path}: file is empty")
    return [line.removesuffix("\r") for line in lines]


def read_parallel(
    src_path: str | Path, tgt_path: str | Path, name: str | None = None
) -> ParallelCorpus:
    """A parallel corpus from two line-aligned files (plain or gzip, UTF-8)."""
    src = read_lines(src_path)
    tgt = read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(
            f"line-count mismatch: {src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}"
        )
    return ParallelCorpus(src, tgt, name if name is not None else f"{src_path},{tgt_path}")


def find_side(prefix: str, suffixes: tuple[str, str]) -> Path:
    """The first existing file among PREFIX.SUFFIX and PREFIX.SUFFIX.gz, for each suffix in turn."""
    candidates = [Path(f"{prefix}.{suffix}{gz}") for suffix in suffixes for gz in ("", ".gz")]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise DataError(f"{prefix}: no file found, tried {', '.join(map(str, candidates))}")


def read_parallel_prefix(prefix: str, src_lang: str, tgt_lang: str) -> ParallelCorpus:
    """A parallel corpus from files named after a common prefix.

    Each side is the first of these that exists: PREFIX.LANG, PREFIX.LANG.gz, then PREFIX.src /
    PREFIX.tgt, PREFIX.src.gz / PREFIX.tgt.gz. So ``train`` with en->de reads train.en and train.de
    (fairseq / OpenNMT-py naming) or train.src and train.tgt.
    """
    src_path = find_side(prefix, (src_lang, "src"))
    tgt_path = find_side(prefix, (tgt_lang, "tgt"))
    return read_parallel(src_path, tgt_path, name=prefix)


def read_tsv(path: str | Path, name: str | None = None) -> ParallelCorpus:
    """A parallel corpus from one file (plain or gzip, UTF-8) with a "source<TAB>target" line per
    pair."""
    pairs = [split_tsv_line(line, path, n) for n, line in enumerate(read_lines(path), start=1)]
    src, tgt = map(list, zip(*pairs, strict=True))  # read_lines refuses an empty file
    return ParallelCorpus(src, tgt, name if name is not None else str(path))


def not_utf8(path: str | Path, line_number: int, bad_byte: int) -> DataError:
    return DataError(f"{path}:{line_number}: not valid UTF-8 (byte 0x{bad_byte:02x})")


def split_tsv_line(line: str, path: str | Path, line_number: int) -> tuple[str, str]:
    """(source, target) of a "source<TAB>target" line."""
    tabs = line.count("\t")
    if tabs != 1:
        raise DataError(
            f"{path}:{line_number}: expected 'source<TAB>target' (one tab), found {tabs} tabs"
        )
    source, target = line.split("\t")
    return source, target


# ---------------------------------------------------------------------------------------------
# Multi30k

MULTI30K_SPLITS = ("train", "val", "test_2016_flickr")
MULTI30K_LANGS = ("en", "de", "fr", "cs")
MULTI30K_URL = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/{split}.{lang}.gz"
DATA_DIR_ENV = "FASTNMT_DATA_DIR"


def _default_cache_dir() -> Path:
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "fastnmt" / "multi30k"


def multi30k_dir(data_dir: str | Path | None = None) -> Path:
    """Where the Multi30k files ({split}.{lang}.gz) are: ``data_dir``, else $FASTNMT_DATA_DIR, else
    the cache directory ~/.cache/fastnmt/multi30k ($XDG_CACHE_HOME respected)."""
    if data_dir is not None:
        return Path(data_dir)
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV])
    return _default_cache_dir()


def write_atomically(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same directory and a rename, so that a crash or a
    concurrent writer (several DDP ranks) never leaves a partial file at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        temp = Path(f.name)
        f.write(data)
    try:
        os.replace(temp, path)
    except OSError:
        temp.unlink(missing_ok=True)
        raise


def download(url: str, path: str | Path, *, timeout: float = 60.0) -> None:
    """Fetch a gzip file from ``url`` into ``path``; the file appears only once it is complete and
    decompresses, so an interrupted or garbled download is retried on the next run."""
    path = Path(path)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            data = response.read()
        gzip.decompress(data)  # an HTML error page or truncated body must not enter the cache
        write_atomically(path, data)
    except (OSError, EOFError, zlib.error) as error:
        reason = getattr(error, "reason", None) or error
        raise DataError(
            f"could not download {url} to {path}: {reason}"
            f" (or point ${DATA_DIR_ENV} at a local copy of the files)"
        ) from None


def _check_choice(kind: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise DataError(f"unknown Multi30k {kind} {value!r}: choose from {', '.join(choices)}")


def multi30k_file(split: str, lang: str, data_dir: str | Path | None = None) -> Path:
    """The path of one Multi30k file, downloaded into the cache on first use.

    A directory given explicitly (argument or $FASTNMT_DATA_DIR) is a local copy and is only read:
    a missing file there is an error rather than a download into the user's directory.
    """
    _check_choice("split", split, MULTI30K_SPLITS)
    _check_choice("language", lang, MULTI30K_LANGS)
    directory = multi30k_dir(data_dir)
    path = directory / f"{split}.{lang}.gz"
    if path.is_file():
        return path
    if directory != _default_cache_dir():
        raise DataError(f"{path}: file not found (Multi30k files are named {{split}}.{{lang}}.gz)")
    download(MULTI30K_URL.format(split=split, lang=lang), path)
    return path


def load_multi30k(
    split: str, src_lang: str, tgt_lang: str, data_dir: str | Path | None = None
) -> ParallelCorpus:
    """One split of Multi30k task 1 (raw, cased, untokenized) for a language pair."""
    src_path = multi30k_file(split, src_lang, data_dir)
    tgt_path = multi30k_file(split, tgt_lang, data_dir)
    return read_parallel(src_path, tgt_path, name=f"multi30k/{split}")


# ---------------------------------------------------------------------------------------------
# Vocabulary


class Vocabulary:
    """Joint sentencepiece model; ids: pad=0, bos=1, eos=2, unk=3."""

    def __init__(self, processor: spm.SentencePieceProcessor, model: bytes):
        self._processor = processor
        self._model = model
        self.pad_id = processor.pad_id()
        self.bos_id = processor.bos_id()
        self.eos_id = processor.eos_id()
        self.unk_id = processor.unk_id()
        self._specials = {self.pad_id, self.bos_id, self.eos_id}

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 8000, *, seed: int = 1) -> Vocabulary:
        """Train a BPE model on ``texts`` (source and target sentences together).

        BPE, as in the OpenNMT-py baseline this package is measured against (joint BPE 8k), so
        that vocabularies compare like for like. character_coverage 1.0 keeps every character of
        the training text (no <unk> on it). ``vocab_size`` is an upper bound: small data gets the
        vocabulary it supports instead of an error. Training uses all sentences in order, so the
        same texts give the same model byte for byte.
        """
        texts = list(texts)
        if not any(texts):
            raise DataError("cannot train a vocabulary: the training text is empty")
        # The seed matters only where sentencepiece samples; fixed anyway so no run depends on it.
        spm.set_random_generator_seed(seed)
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(texts),
                model_writer=model,
                model_type="bpe",
                vocab_size=vocab_size,
                hard_vocab_limit=False,
                character_coverage=1.0,
                input_sentence_size=0,
                shuffle_input_sentence=False,
                pad_id=0,
                bos_id=1,
                eos_id=2,
                unk_id=3,
                minloglevel=2,
            )
        except RuntimeError as error:
            # sentencepiece's message starts with its source location; keep the readable part.
            reason = str(error).splitlines()[0].rpartition("] ")[2].strip()
            raise DataError(f"cannot train a vocabulary of size {vocab_size}: {reason}") from None
        return cls.from_bytes(model.getvalue())

    @classmethod
    def from_bytes(cls, model: bytes) -> Vocabulary:
        processor = spm.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(model)
        except RuntimeError:
            raise DataError("not a sentencepiece model") from None
        if min(processor.pad_id(), processor.bos_id(), processor.eos_id()) < 0:
            # Batches need all three; a model trained elsewhere with the defaults has no pad.
            raise DataError("the sentencepiece model lacks a pad, bos or eos piece")
        return cls(processor, model)

    def to_bytes(self) -> bytes:
        return self._model

    def save(self, path: str | Path) -> None:
        """Write the .model file (atomically, as checkpoints are written)."""
        write_atomically(Path(path), self._model)

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        return _read_vocabulary(path, cls.from_bytes)

    def __len__(self) -> int:
        return self._processor.get_piece_size()

    # One sentence at a time: sentencepiece's list calls start a thread pool per call, which
    # costs ~100-180 us against ~5 us for encoding one short sentence (translating sentence by
    # sentence made that a visible share of decoding).

    def encode(self, sentences: list[str]) -> list[list[int]]:
        """Token ids per sentence, without bos/eos."""
        return [self._processor.encode(sentence, out_type=int) for sentence in sentences]

    def encode_target(self, sentences: list[str]) -> list[list[int]]:
        """Target-side ids: one joint model for both sides, so ``encode``'s."""
        return self.encode(sentences)

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Text per id sequence: everything from the first eos on is dropped, as are pad and bos,
        so raw decoder output can be passed in."""
        return [self._processor.decode(self._strip(sequence)) for sequence in ids]

    def _strip(self, ids: list[int]) -> list[int]:
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return [i for i in ids if i not in self._specials]

    def pieces(self, ids: list[int]) -> list[str]:
        """The subword string of each id, for attention plots."""
        return [self._processor.id_to_piece(i) for i in ids]


class MarianVocabulary:
    """An Opus-MT (Marian) checkpoint's tokenizer, without transformers: source text split by its
    source.spm, target text by its target.spm, pieces mapped to ids by the vocab.json both sides
    share, as transformers' ``MarianTokenizer`` does (a leading ``>>lang<<`` code of a
    multi-target model is one token; a piece vocab.json lacks is <unk>). The decoder starts from
    ``bos_id`` (Marian's: pad). Serialised (``to_bytes``) as a zip of the three files and the
    special ids, written byte-identically each time: prepared data and checkpoints compare it by
    hash."""

    FILES = ("source.spm", "target.spm", "vocab.json")
    SPECIALS = "specials.json"

    def __init__(self, files: dict[str, bytes], bos_id: int):
        self.files = {name: files[name] for name in self.FILES}
        self._source, self._target = (
            spm.SentencePieceProcessor(model_proto=files[name]) for name in self.FILES[:2]
        )
        self._ids: dict[str, int] = json.loads(files["vocab.json"])
        self.pad_id, self.eos_id, self.unk_id = map(self._special, ("<pad>", "</s>", "<unk>"))
        self.bos_id = bos_id
        self._pieces = {i: piece for piece, i in self._ids.items()}
        specials = {self.pad_id, self.bos_id, self.eos_id, self.unk_id}
        self._text_pieces = {i: p for i, p in self._pieces.items() if i not in specials}

    def _special(self, piece: str) -> int:
        if piece not in self._ids:
            raise DataError(f"vocab.json has no {piece} piece")
        return self._ids[piece]

    @classmethod
    def from_directory(cls, directory: str | Path, bos_id: int) -> MarianVocabulary:
        """The tokenizer files of a saved Marian checkpoint (``save_pretrained``'s layout)."""
        directory = Path(directory)
        if (directory / "target_vocab.json").exists():
            raise DataError(
                f"{directory}: separate source and target vocabularies are not supported "
                "(fastnmt's model shares one embedding)"
            )
        files = {}
        for name in cls.FILES:
            try:
                files[name] = (directory / name).read_bytes()
            except OSError:
                raise DataError(f"{directory / name}: file not found") from None
        return cls(files, bos_id)

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            specials = json.dumps({"bos_id": self.bos_id}).encode()
            for name, data in [*self.files.items(), (self.SPECIALS, specials)]:
                archive.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> MarianVocabulary:
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                files = {name: archive.read(name) for name in (*cls.FILES, cls.SPECIALS)}
            bos_id = json.loads(files[cls.SPECIALS])["bos_id"]
            return cls(files, bos_id)
        except (zipfile.BadZipFile, KeyError, ValueError, RuntimeError) as error:
            raise DataError(f"not a Marian tokenizer archive ({error})") from None

    def __len__(self) -> int:
        return max(self._ids.values()) + 1

    def _encode(self, processor, sentence: str) -> list[int]:
        code = []
        if sentence.startswith(">>") and (end := sentence.find("<<")) != -1:
            code, sentence = [sentence[: end + 2]], sentence[end + 2 :]
        pieces = code + processor.encode(sentence, out_type=str)
        return [self._ids.get(piece, self.unk_id) for piece in pieces]

    def encode(self, sentences: list[str]) -> list[list[int]]:
        """Source ids per sentence, without eos."""
        return [self._encode(self._source, sentence) for sentence in sentences]

    def encode_target(self, sentences: list[str]) -> list[list[int]]:
        """Target ids per sentence, without eos."""
        return [self._encode(self._target, sentence) for sentence in sentences]

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Target text per id sequence, up to its first eos, without special pieces (as
        ``MarianTokenizer.decode(skip_special_tokens=True)``)."""
        texts = []
        for sequence in ids:
            if self.eos_id in sequence:
                sequence = sequence[: sequence.index(self.eos_id)]
            pieces = [self._text_pieces[i] for i in sequence if i in self._text_pieces]
            texts.append(self._target.decode_pieces(pieces).replace("\u2581", " ").strip())
        return texts

    def pieces(self, ids: list[int]) -> list[str]:
        return [self._pieces.get(i, "<unk>") for i in ids]


_ZIP_MAGIC = b"PK\x03\x04"
# The file a vocabulary's bytes are saved as (checkpoints, prepared data): joint, Marian.
VOCABULARY_FILES = ("spm.model", "marian_vocabulary.zip")


def vocabulary_file(data: bytes) -> str:
    return VOCABULARY_FILES[data.startswith(_ZIP_MAGIC)]


def vocabulary_from_bytes(data: bytes) -> Vocabulary | MarianVocabulary:
    """The vocabulary ``to_bytes`` wrote: a joint sentencepiece model, or a Marian tokenizer."""
    if data.startswith(_ZIP_MAGIC):
        return MarianVocabulary.from_bytes(data)
    return Vocabulary.from_bytes(data)


def load_vocabulary(path: str | Path) -> Vocabulary | MarianVocabulary:
    """The vocabulary file a checkpoint or prepared directory holds, of either kind."""
    return _read_vocabulary(path, vocabulary_from_bytes)


def _read_vocabulary(path: str | Path, parse):
    path = Path(path)
    try:
        return parse(path.read_bytes())
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except DataError as error:
        raise DataError(f"{path}: {error}") from None


# ---------------------------------------------------------------------------------------------
# Token arrays, encoding and length filtering


class TokenArray:
    """Token id sequences stored flat, as numpy arrays: sequence i is
    ``ids[offsets[i]:offsets[i + 1]]`` and has ``lengths[i]`` ids (no bos/eos).

    In memory (``from_lists``) or memory-mapped from a prepared directory (``fastnmt.preprocess``),
    where the ids are read lazily, a batch at a time. A mapped array pickles as its file names (a
    DataLoader worker started by spawn maps the files itself) and can give its pages back
    (``release_pages``), so reading a corpus does not grow the reader's resident memory.
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
    validation loss (training data goes through ``fastnmt.preprocess``); score BLEU on the
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


# ---------------------------------------------------------------------------------------------
# Batches


@dataclass
class Batch:
    """Padded id tensors for one step; lengths count the eos."""

    src: torch.Tensor  # (B, S) int64, pad_id padded, each row ends with eos
    src_lengths: torch.Tensor  # (B,) int64
    tgt_in: torch.Tensor  # (B, T) bos + target (decoder input)
    tgt_out: torch.Tensor  # (B, T) target + eos (what the decoder must predict)
    tgt_lengths: torch.Tensor  # (B,) int64
    indices: torch.Tensor  # (B,) positions of these pairs in the corpus, to restore order
    # (tokens,) int64 flat positions of the non-pad targets in tgt_out.view(-1): the loss gathers
    # them without a boolean mask, whose size a GPU would have to report back (a host sync).
    tgt_positions: torch.Tensor

    @property
    def num_tgt_tokens(self) -> int:
        """Non-pad target tokens: the normaliser of the loss and the unit of throughput."""
        return self.tgt_positions.shape[0]

    def __reduce__(self):
        """Pickled as one buffer: a DataLoader worker sends each batch to the trainer in one
        copy, not one shared-memory segment per tensor (each costs about a millisecond)."""
        tensors = [getattr(self, f.name) for f in fields(self)]
        flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
        return _unpickle_batch, (flat.numpy().tobytes(), [tuple(t.shape) for t in tensors])

    def _map(self, function) -> Batch:
        return replace(self, **{f.name: function(getattr(self, f.name)) for f in fields(self)})

    def pin_memory(self) -> Batch:
        """Called by a DataLoader with ``pin_memory=True`` (in its pinning thread)."""
        return self._map(torch.Tensor.pin_memory)

    def to(self, device: torch.device | str) -> Batch:
        device = torch.device(device)

        def move(tensor):
            if device.type == "cuda":  # from pinned memory: the copy does not block the host
                return tensor.pin_memory().to(device, non_blocking=True)
            return tensor.to(device)

        return self._map(move)


def _unpickle_batch(data: bytes, shapes: list[tuple[int, ...]]) -> Batch:
    flat = torch.frombuffer(bytearray(data), dtype=torch.int64)
    parts = flat.split([math.prod(shape) for shape in shapes])
    return Batch(*(part.view(shape) for part, shape in zip(parts, shapes, strict=True)))


def _padded(
    ids: np.ndarray, lengths: np.ndarray, pad_id: int, *, first: int | None = None, last=None
) -> np.ndarray:
    """(B, width) int64 rows: ``first`` if given, the row's ids, ``last`` if given, then padding;
    ``ids`` holds the rows' ids concatenated."""
    lead = int(first is not None)
    width = int(lengths.max(initial=0)) + lead + int(last is not None)
    out = np.full((len(lengths), width), pad_id, np.int64)
    columns = np.arange(width)
    out[(columns >= lead) & (columns < lengths[:, None] + lead)] = ids  # row-major, like ids
    if first is not None:
        out[:, 0] = first
    if last is not None:
        out[np.arange(len(lengths)), lengths + lead] = last
    return out


def collate(
    src: TokenArray,
    tgt: TokenArray | None,
    rows: np.ndarray,
    indices: np.ndarray,
    *,
    pad_id: int = 0,
    bos_id: int = 1,
    eos_id: int = 2,
) -> Batch:
    """The Batch of sequences ``rows`` (``indices``: their positions, for restoring order). ``tgt``
    None is for translation: the target tensors are then empty (B, 0)."""
    src_ids, src_lengths = src.gather(rows)
    if tgt is None:
        tgt_in = tgt_out = np.zeros((len(rows), 0), np.int64)
        tgt_lengths = np.zeros(len(rows), np.int64)
    else:
        tgt_ids, lengths = tgt.gather(rows)
        tgt_in = _padded(tgt_ids, lengths, pad_id, first=bos_id)
        tgt_out = _padded(tgt_ids, lengths, pad_id, last=eos_id)
        tgt_lengths = lengths + 1
    targets = np.arange(tgt_out.shape[1]) < tgt_lengths[:, None]
    return Batch(
        src=torch.from_numpy(_padded(src_ids, src_lengths, pad_id, last=eos_id)),
        src_lengths=torch.from_numpy(src_lengths + 1),
        tgt_in=torch.from_numpy(tgt_in),
        tgt_out=torch.from_numpy(tgt_out),
        tgt_lengths=torch.from_numpy(tgt_lengths),
        indices=torch.from_numpy(np.asarray(indices, np.int64)),
        tgt_positions=torch.from_numpy(np.flatnonzero(targets)),
    )


def make_batch(
    src: list[list[int]],
    tgt: list[list[int]] | None,
    indices: list[int],
    *,
    pad_id: int = 0,
    bos_id: int = 1,
    eos_id: int = 2,
) -> Batch:
    """Collate id sequences (lists, without bos/eos) into a Batch. ``tgt`` None is for
    translation: the target tensors are then empty (B, 0)."""
    targets = None if tgt is None else TokenArray.from_lists(tgt)
    rows = np.arange(len(src))
    specials = {"pad_id": pad_id, "bos_id": bos_id, "eos_id": eos_id}
    return collate(TokenArray.from_lists(src), targets, rows, np.asarray(indices), **specials)


def pack_by_tokens(sizes: np.ndarray, max_tokens: int) -> np.ndarray:
    """Split a sequence of pair sizes into consecutive runs whose padded size (count x largest)
    fits ``max_tokens``, greedily; returns the run boundaries (0, ..., len(sizes)). A pair too long
    for any batch gets one of its own rather than being dropped.

    One numpy step per batch, not a Python step per pair: a batch starting at p holds at most
    max_tokens // sizes[p] pairs, and within that window the padded size of the first k pairs,
    k x running max, only grows with k, so the batch is the count of those that fit."""
    bounds = [0]
    start = 0
    while start < len(sizes):
        window = sizes[start : start + max(1, max_tokens // int(sizes[start]))]
        padded = np.arange(1, len(window) + 1) * np.maximum.accumulate(window)
        start += max(1, int(np.count_nonzero(padded <= max_tokens)))
        bounds.append(start)
    return np.asarray(bounds, np.int64)


def seeded_generator(label: str) -> np.random.Generator:
    """A numpy generator from a string (any --seed, negative too, makes a valid seed)."""
    return np.random.default_rng(int.from_bytes(hashlib.sha256(label.encode()).digest()[:8]))


class _Collator(torch.utils.data.Dataset):
    """What a DataLoader worker runs: the Batch of the pairs it is given, then the pages it read
    are released (see TokenArray)."""

    def __init__(self, corpus: EncodedCorpus, special_ids: dict[str, int]):
        self.corpus, self.special_ids = corpus, special_ids

    def __getitem__(self, rows: np.ndarray) -> Batch:
        batch = collate(self.corpus.src, self.corpus.tgt, rows, rows, **self.special_ids)
        self.corpus.release_pages()
        return batch


class _Batches(torch.utils.data.Sampler):
    """The DataLoader's sampler: the batches (pair positions) of the pass being iterated."""

    def __init__(self):
        self.batches: list[np.ndarray] = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class TokenBatches:
    """Token-bucketed batches over an EncodedCorpus, like fairseq's --max-tokens.

    Pairs are sorted by (source length, target length) with a seeded random tie-break and packed
    consecutively while batch size x longest sequence (bos/eos and padding counted, either side)
    stays within ``max_tokens``; similar lengths together waste little padding. The batches are
    fixed; their order is shuffled per epoch from (seed, epoch) alone, so any process can recreate
    any epoch (resume, DDP ranks) without shared state. All of it is numpy over the lengths
    array (no Python object per pair), so a corpus of millions of pairs is planned in seconds and
    held in a few bytes per pair.

    With ``world_size`` W > 1, rank r takes batches r, r+W, r+2W, ... of the epoch's list. The list
    is first padded to a multiple of W by repeating its first batches (as DistributedSampler does),
    so every rank runs the same number of steps and no pair is skipped in any epoch.

    ``iterate`` collates in ``workers`` DataLoader worker processes (0: in this process), which
    prefetch the next batches while the current one trains; ``pin_memory`` for a CUDA device.
    """

    def __init__(
        self,
        corpus: EncodedCorpus,
        max_tokens: int,
        *,
        seed: int = 1,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        pad_id: int = 0,
        bos_id: int = 1,
        eos_id: int = 2,
        workers: int = 0,
        pin_memory: bool = False,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.max_tokens = max_tokens
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.order, self.bounds = self._plan(corpus)
        corpus.release_pages()  # the lengths were read once, for the plan
        self._pass = _Batches()
        special_ids = {"pad_id": pad_id, "bos_id": bos_id, "eos_id": eos_id}
        self._loader = torch.utils.data.DataLoader(
            _Collator(corpus, special_ids),
            sampler=self._pass,
            batch_size=None,
            num_workers=workers,
            persistent_workers=workers > 0,  # one worker start per run, not per epoch
            pin_memory=pin_memory,
            # A private generator: a DataLoader draws a seed for its workers at every pass, which
            # must not consume the global RNG the trainer checkpoints (exact resume).
            generator=torch.Generator(),
        )

    def _plan(self, corpus: EncodedCorpus) -> tuple[np.ndarray, np.ndarray]:
        """The pairs in batch order and the batch boundaries in it."""
        src_sizes = corpus.src.lengths.astype(np.int32) + 1  # + eos
        tgt_sizes = corpus.tgt.lengths.astype(np.int32) + 1  # + bos (input) or eos (output)
        index_type = np.int32 if len(src_sizes) < 2**31 else np.int64
        order = np.arange(len(src_sizes), dtype=index_type)
        # A private generator: batching must not consume the global RNG the trainer checkpoints.
        seeded_generator(f"fastnmt-order-{self.seed}").shuffle(order)
        key = src_sizes[order].astype(np.int64) << 32 | tgt_sizes[order]
        order = order[np.argsort(key, kind="stable")]  # stable: ties stay shuffled
        del key
        sizes = np.maximum(src_sizes, tgt_sizes)[order]
        return order, pack_by_tokens(sizes, self.max_tokens)

    @property
    def num_batches(self) -> int:
        """Batches per epoch, all ranks together."""
        return len(self.bounds) - 1

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return math.ceil(self.num_batches / self.world_size)

    def batch(self, number: int) -> np.ndarray:
        """The corpus positions of batch ``number``."""
        return self.order[self.bounds[number] : self.bounds[number + 1]]

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches (corpus positions) for ``epoch``, in the order they are trained."""
        positions = list(range(self.num_batches))
        if self.shuffle:
            random.Random(f"fastnmt-epoch-{self.seed}-{epoch}").shuffle(positions)
        padded_count = len(self) * self.world_size
        padded = [positions[i % len(positions)] for i in range(padded_count)]
        return [self.batch(p) for p in padded[self.rank :: self.world_size]]

    def iterate(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """This rank's batches for ``epoch``, skipping the first ``start`` (resuming mid-epoch).
        One pass at a time: a new call ends the previous pass."""
        self._pass.batches = self.epoch_batches(epoch)[start:]
        return iter(self._loader)

    def close(self) -> None:
        """End the worker processes (also done when this object is garbage-collected)."""
        self._loader = None
