"""Training data: parallel text (Multi30k, parallel files, TSV), a joint sentencepiece vocabulary,
length filtering and token-bucketed batches.

Every problem with the user's data raises :class:`DataError` with a one-line message naming the file
(and line where there is one), so the command line can print it and exit with status 2.
"""

from __future__ import annotations

import gzip
import io
import math
import os
import random
import tempfile
import urllib.request
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path

import sentencepiece as spm
import torch


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
        bad_byte = data[error.start]
        raise DataError(f"{path}:{line_number}: not valid UTF-8 (byte 0x{bad_byte:02x})") from None
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


def _find_side(prefix: str, suffixes: tuple[str, str]) -> Path:
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
    src_path = _find_side(prefix, (src_lang, "src"))
    tgt_path = _find_side(prefix, (tgt_lang, "tgt"))
    return read_parallel(src_path, tgt_path, name=prefix)


def read_tsv(path: str | Path, name: str | None = None) -> ParallelCorpus:
    """A parallel corpus from one file (plain or gzip, UTF-8) with a "source<TAB>target" line per
    pair."""
    src, tgt = [], []
    for line_number, line in enumerate(read_lines(path), start=1):
        tabs = line.count("\t")
        if tabs != 1:
            raise DataError(
                f"{path}:{line_number}: expected 'source<TAB>target' (one tab), found {tabs} tabs"
            )
        source, target = line.split("\t")
        src.append(source)
        tgt.append(target)
    return ParallelCorpus(src, tgt, name if name is not None else str(path))


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


def _write_atomically(path: Path, data: bytes) -> None:
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
        _write_atomically(path, data)
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
        _write_atomically(Path(path), self._model)

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        path = Path(path)
        try:
            return cls.from_bytes(path.read_bytes())
        except FileNotFoundError:
            raise DataError(f"{path}: file not found") from None
        except DataError as error:
            raise DataError(f"{path}: {error}") from None

    def __len__(self) -> int:
        return self._processor.get_piece_size()

    # One sentence at a time: sentencepiece's list calls start a thread pool per call, which
    # costs ~100-180 us against ~5 us for encoding one short sentence (translating sentence by
    # sentence made that a visible share of decoding).

    def encode(self, sentences: list[str]) -> list[list[int]]:
        """Token ids per sentence, without bos/eos."""
        return [self._processor.encode(sentence, out_type=int) for sentence in sentences]

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


# ---------------------------------------------------------------------------------------------
# Encoding and length filtering


@dataclass
class EncodedCorpus:
    """Token ids per sentence, without bos/eos (batching adds them)."""

    src: list[list[int]]
    tgt: list[list[int]]
    dropped: int  # pairs removed by length filtering


def _filter_reason(src: list[int], tgt: list[int], max_len: int, ratio: float) -> str | None:
    if not src or not tgt:
        return "empty"
    if max(len(src), len(tgt)) + 1 > max_len:  # + 1: the eos every sequence gets
        return "too long"
    if max(len(src), len(tgt)) > ratio * min(len(src), len(tgt)):
        return "length ratio"
    return None


def encode_corpus(
    corpus: ParallelCorpus, vocab: Vocabulary, max_len: int = 256, ratio: float = 9.0
) -> EncodedCorpus:
    """Encode both sides and drop pairs unfit for training, as fairseq does: an empty side, a side
    longer than ``max_len`` tokens counting its eos, or one side more than ``ratio`` times as long
    as the other (usually a misalignment). Meant for training and validation loss; score BLEU on
    the unfiltered sentences so the reference set stays whole."""
    kept_src, kept_tgt = [], []
    dropped: dict[str, int] = {}
    for src, tgt in zip(vocab.encode(corpus.src), vocab.encode(corpus.tgt), strict=True):
        reason = _filter_reason(src, tgt, max_len, ratio)
        if reason is None:
            kept_src.append(src)
            kept_tgt.append(tgt)
        else:
            dropped[reason] = dropped.get(reason, 0) + 1
    if not kept_src:
        counts = ", ".join(f"{count} {reason}" for reason, count in dropped.items())
        raise DataError(
            f"{corpus.name}: every pair was filtered out: {counts}"
            f" (max_len={max_len} tokens, ratio={ratio})"
        )
    return EncodedCorpus(kept_src, kept_tgt, dropped=sum(dropped.values()))


def corpus_stats(corpus: EncodedCorpus) -> dict[str, int]:
    """Sizes for logging; token counts exclude bos/eos."""
    return {
        "pairs": len(corpus.src),
        "dropped": corpus.dropped,
        "src_tokens": sum(map(len, corpus.src)),
        "tgt_tokens": sum(map(len, corpus.tgt)),
        "max_src_len": max(map(len, corpus.src)),
        "max_tgt_len": max(map(len, corpus.tgt)),
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

    def to(self, device: torch.device | str) -> Batch:
        device = torch.device(device)

        def move(tensor):
            if device.type == "cuda":  # from pinned memory: the copy does not block the host
                return tensor.pin_memory().to(device, non_blocking=True)
            return tensor.to(device)

        return replace(self, **{f.name: move(getattr(self, f.name)) for f in fields(self)})


def _padded(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    width = max((len(row) for row in rows), default=0)
    return torch.tensor([row + [pad_id] * (width - len(row)) for row in rows], dtype=torch.int64)


def make_batch(
    src: list[list[int]],
    tgt: list[list[int]] | None,
    indices: list[int],
    *,
    pad_id: int = 0,
    bos_id: int = 1,
    eos_id: int = 2,
) -> Batch:
    """Collate id sequences (without bos/eos) into a Batch. ``tgt`` None is for translation: the
    target tensors are then empty (B, 0)."""
    src_rows = [[*ids, eos_id] for ids in src]
    if tgt is None:
        empty = torch.zeros(len(src), 0, dtype=torch.int64)
        tgt_in, tgt_out, tgt_lengths = empty, empty, torch.zeros(len(src), dtype=torch.int64)
    else:
        tgt_in = _padded([[bos_id, *ids] for ids in tgt], pad_id)
        tgt_out = _padded([[*ids, eos_id] for ids in tgt], pad_id)
        tgt_lengths = torch.tensor([len(ids) + 1 for ids in tgt], dtype=torch.int64)
    return Batch(
        src=_padded(src_rows, pad_id),
        src_lengths=torch.tensor([len(row) for row in src_rows], dtype=torch.int64),
        tgt_in=tgt_in,
        tgt_out=tgt_out,
        tgt_lengths=tgt_lengths,
        indices=torch.as_tensor(indices, dtype=torch.int64),
        tgt_positions=(tgt_out.reshape(-1) != pad_id).nonzero()[:, 0],
    )


def pack_by_tokens(order: list[int], sizes: list[int], max_tokens: int) -> list[list[int]]:
    """Split ``order`` into consecutive runs whose padded size (count x longest) fits max_tokens;
    a pair too long for any batch gets one of its own rather than being dropped."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in order:
        candidate_longest = max(longest, sizes[index])
        if current and (len(current) + 1) * candidate_longest > max_tokens:
            batches.append(current)
            current, candidate_longest = [], sizes[index]
        current.append(index)
        longest = candidate_longest
    if current:
        batches.append(current)
    return batches


class TokenBatches:
    """Token-bucketed batches over an EncodedCorpus, like fairseq's --max-tokens.

    Pairs are sorted by (source length, target length) with a seeded random tie-break and packed
    consecutively while batch size x longest sequence (bos/eos and padding counted, either side)
    stays within ``max_tokens``; similar lengths together waste little padding. The batches are
    fixed; their order is shuffled per epoch from (seed, epoch) alone, so any process can recreate
    any epoch (resume, DDP ranks) without shared state.

    With ``world_size`` W > 1, rank r takes batches r, r+W, r+2W, ... of the epoch's list. The list
    is first padded to a multiple of W by repeating its first batches (as DistributedSampler does),
    so every rank runs the same number of steps and no pair is skipped in any epoch.
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
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.corpus = corpus
        self.max_tokens = max_tokens
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self._special_ids = {"pad_id": pad_id, "bos_id": bos_id, "eos_id": eos_id}
        self.batches = self._build_batches()

    def _build_batches(self) -> list[list[int]]:
        src_sizes = [len(ids) + 1 for ids in self.corpus.src]  # + eos
        tgt_sizes = [len(ids) + 1 for ids in self.corpus.tgt]  # + bos (input) or eos (output)
        # A private generator: batching must not consume the global RNG the trainer checkpoints.
        order = list(range(len(src_sizes)))
        random.Random(f"fastnmt-order-{self.seed}").shuffle(order)
        order.sort(key=lambda i: (src_sizes[i], tgt_sizes[i]))  # stable: ties stay shuffled
        sizes = [max(pair) for pair in zip(src_sizes, tgt_sizes, strict=True)]
        return pack_by_tokens(order, sizes, self.max_tokens)

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return math.ceil(len(self.batches) / self.world_size)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches (corpus positions) for ``epoch``, in the order they are trained."""
        positions = list(range(len(self.batches)))
        if self.shuffle:
            random.Random(f"fastnmt-epoch-{self.seed}-{epoch}").shuffle(positions)
        padded_count = len(self) * self.world_size
        padded = [positions[i % len(positions)] for i in range(padded_count)]
        return [self.batches[p] for p in padded[self.rank :: self.world_size]]

    def iterate(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        """This rank's batches for ``epoch``, skipping the first ``start`` (resuming mid-epoch)."""
        for indices in self.epoch_batches(epoch)[start:]:
            src = [self.corpus.src[i] for i in indices]
            tgt = [self.corpus.tgt[i] for i in indices]
            yield make_batch(src, tgt, indices, **self._special_ids)
