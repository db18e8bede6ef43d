"""The prepared (binarized) training corpus: the training text (two line-aligned files or a TSV
file, plain or gzip) read in chunks, the joint sentencepiece vocabulary trained on a sample of it,
both sides encoded on all cores and written to a prepared directory:

    manifest.json        what it was made from (input files with size, mtime and sha256; the
                         vocabulary options; the length filters) and what it holds (counts, arrays)
    spm.model            the sentencepiece model (given an Opus-MT model's tokenizer to encode with:
                         marian_vocabulary.zip, its files; ``fastnmt.data.MarianVocabulary``)
    train.{src,tgt}.ids      token ids of the kept pairs, concatenated (uint16 when the
                             vocabulary fits, else uint32), raw little-endian
    train.{src,tgt}.offsets  int64, pairs + 1: sequence i is ids[offsets[i]:offsets[i + 1]]
    train.{src,tgt}.lengths  ids per sequence (uint16, or uint32 for --max-len above 65,536)

Training memory-maps the arrays (``fastnmt.data.TokenArray``); it reads only the lengths to plan
its batches, so its memory does not grow with the corpus. ``prepare`` reuses a directory whose
manifest matches the source and options and (re)builds it otherwise; ``python -m
fastnmt.preprocess`` and ``python -m fastnmt.train`` call it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fastnmt.data.batches import seeded_generator
from fastnmt.data.corpus import (
    EncodedCorpus,
    MappedFile,
    TokenArray,
    count_dropped,
    filter_codes,
    nothing_kept,
)
from fastnmt.data.files import fsync_tree, swap_in
from fastnmt.data.text import DataError, PairChunk, PairReader, unreadable
from fastnmt.data.vocabulary import (
    Vocabulary,
    load_vocabulary,
    vocabulary_file,
    vocabulary_from_bytes,
)

FORMAT, VERSION = "fastnmt-prepared", 1
MANIFEST = "manifest.json"
SIDES, ARRAYS = ("src", "tgt"), ("ids", "offsets", "lengths")
CHUNK_PAIRS = 20_000  # pairs a worker encodes at a time
DEFAULT_SAMPLE = 2_000_000  # sentences the vocabulary is trained on, both sides together


@dataclass(frozen=True)
class Source:
    """A training corpus as text: two line-aligned files (source, target) or one TSV file."""

    paths: tuple[Path, ...]
    name: str  # for messages and logs

    @property
    def tsv(self) -> bool:
        return len(self.paths) == 1


@dataclass(frozen=True)
class Options:
    """How the corpus is prepared; a prepared directory is reused only with the same ones."""

    vocab_size: int = 8000
    spm_sample: int = DEFAULT_SAMPLE
    seed: int = 1
    max_len: int = 256
    ratio: float = 9.0

    def vocabulary_options(self) -> dict:
        return {"vocab_size": self.vocab_size, "spm_sample": self.spm_sample, "seed": self.seed}

    def filters(self) -> dict:
        return {"max_len": self.max_len, "ratio": self.ratio}


@dataclass
class Prepared:
    """An opened prepared directory."""

    directory: Path
    manifest: dict
    vocab: Vocabulary
    corpus: EncodedCorpus  # memory-mapped

    def summary(self) -> str:
        """The length-filtering line training logs."""
        pairs, filters = self.manifest["pairs"], self.manifest["filters"]
        dropped = pairs["dropped"]
        return (
            f"{self.manifest['name']}: {pairs['kept']:,} training pairs kept, "
            f"{sum(dropped.values()):,} filtered out ({dropped['empty']:,} empty, "
            f"{dropped['too long']:,} longer than {filters['max_len']} tokens, "
            f"{dropped['length ratio']:,} length ratio); vocabulary {len(self.vocab):,}"
        )


# ---------------------------------------------------------------------------------------------
# Reuse or rebuild


def prepare(
    source: Source,
    directory: Path,
    options: Options,
    *,
    vocabulary: bytes | None = None,
    workers: int | None = None,
    log: Callable[[str], None] = lambda line: None,
    progress: bool = False,
) -> Prepared:
    """The prepared data of ``source`` in ``directory``: reused when its manifest matches (same
    inputs, unchanged, same options; ``vocabulary`` when given, e.g. a resumed checkpoint's),
    otherwise (re)built there."""
    directory = Path(directory)
    stale = why_stale(directory, source, options, vocabulary)
    if stale is None:
        log(f"using the prepared data in {directory}")
    else:
        log(f"preparing {source.name} in {directory} ({stale})")
        _build(source, directory, options, vocabulary, workers or available_cores(), log, progress)
    return open_prepared(directory)


def check_prepared(
    source: Source, directory: Path, options: Options, vocabulary: bytes | None
) -> Prepared:
    """The prepared data another process (DDP rank 0) made: opened if it matches, never built."""
    stale = why_stale(Path(directory), source, options, vocabulary)
    if stale is not None:
        raise DataError(
            f"{directory}: not the prepared data of this run ({stale}); rank 0 prepares it there, "
            f"so --prepared-dir must be on a filesystem every node shares (or prepare it on every "
            f"node with python -m fastnmt.preprocess)"
        )
    return open_prepared(directory)


def available_cores() -> int:
    """The cores this process may run on (the default number of encoding workers)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def read_manifest(directory: Path) -> dict | None:
    """The manifest, or None when there is none or it cannot be read."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def why_stale(
    directory: Path, source: Source, options: Options, vocabulary: bytes | None
) -> str | None:
    """Why ``directory`` cannot be reused for this source and these options; None if it can.
    Cheap checks first; an input file's hash is read only when its mtime changed."""
    manifest = read_manifest(directory)
    if manifest is None:
        return "no prepared data there yet"
    if (manifest.get("format"), manifest.get("version")) != (FORMAT, VERSION):
        return "prepared by another version of fastnmt"
    try:
        return _difference(manifest, source, options, vocabulary)
    except (KeyError, TypeError):  # a manifest edited by hand, or cut short outside fastnmt
        return f"its {MANIFEST} is damaged"


def _difference(
    manifest: dict, source: Source, options: Options, vocabulary: bytes | None
) -> str | None:
    if [record["path"] for record in manifest["inputs"]] != [str(p) for p in _resolved(source)]:
        return "prepared from other input files"
    if manifest["filters"] != options.filters():
        return "prepared with other length filters"
    if vocabulary is not None:
        if manifest["vocabulary"]["sha256"] != _sha256(vocabulary):
            return "prepared with another vocabulary than the checkpoint's"
    elif manifest["vocabulary"]["trained_with"] != options.vocabulary_options():
        return "prepared with other vocabulary options"
    for record in manifest["inputs"]:
        if _changed(record):
            return f"{record['path']} changed"
    return None


def _resolved(source: Source) -> list[Path]:
    return [path.resolve() for path in source.paths]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _input_record(path: Path) -> dict:
    status = _stat(path)
    return {
        "path": str(path),
        "size": status.st_size,
        "mtime_ns": status.st_mtime_ns,
        "sha256": _file_sha256(path),
    }


def _stat(path: Path) -> os.stat_result:
    try:
        return path.stat()
    except OSError as error:
        raise unreadable(path, error) from None


def _changed(record: dict) -> bool:
    # Size and mtime first, as make, rsync and git decide: an edit that keeps both the size and
    # the nanosecond mtime takes a deliberate effort. When only the mtime moved (a `touch`, a
    # copy), the whole file is hashed: a hash of its first and last bytes would miss an edit in
    # the middle. SHA-256 reads ~1-2 GB/s (hashlib's SHA extensions), so the worst case for a
    # 10M-pair corpus (~1 GB) is a second or two, and a restart normally costs one stat per file.
    status = _stat(Path(record["path"]))
    if status.st_size != record["size"]:
        return True
    if status.st_mtime_ns == record["mtime_ns"]:
        return False
    return _file_sha256(Path(record["path"])) != record["sha256"]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(1 << 20)
    with path.open("rb") as f:
        while count := f.readinto(buffer):
            digest.update(memoryview(buffer)[:count])
    return digest.hexdigest()


def open_prepared(directory: Path) -> Prepared:
    """Map a prepared directory (a one-line DataError for a missing or damaged one)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        raise DataError(f"{directory}: no prepared data ({MANIFEST} missing or unreadable)")
    try:
        return _open(directory, manifest)
    except (KeyError, TypeError) as error:
        raise DataError(
            f"{directory / MANIFEST}: damaged ({error!r} is wrong or missing)"
        ) from None


def _open(directory: Path, manifest: dict) -> Prepared:
    path = directory / manifest["vocabulary"]["file"]
    vocab = load_vocabulary(path)
    if _sha256(vocab.to_bytes()) != manifest["vocabulary"]["sha256"]:
        raise DataError(f"{path}: not the vocabulary {MANIFEST} names")
    sides = []
    for side in SIDES:
        files = [
            MappedFile(directory / entry["file"], entry["dtype"], entry["count"])
            for entry in (manifest["arrays"][f"{side}.{kind}"] for kind in ARRAYS)
        ]
        sides.append(TokenArray.mapped(*files))
    dropped = sum(manifest["pairs"]["dropped"].values())
    return Prepared(directory, manifest, vocab, EncodedCorpus(*sides, dropped=dropped))


class _Progress:
    """Input bytes read over the passes of a preparation: a tqdm bar (rate, ETA) on a terminal,
    nothing otherwise (the log lines say when each pass ends). No bar is made when none is
    shown: any tqdm, a disabled one too, starts a monitor thread that outlives it, and the
    training process forks its data loader's workers later (a fork copies no other thread, but
    any lock one of them holds)."""

    def __init__(self, source: Source, passes: int, enabled: bool):
        self.pass_size = sum(_stat(path).st_size for path in source.paths)
        shown = enabled and sys.stderr.isatty()
        self.bar = (
            tqdm(total=passes * self.pass_size, unit="B", unit_scale=True, desc="preprocess")
            if shown
            else None
        )
        self.done = 0  # bytes of the passes already finished

    def update(self, reader: PairReader) -> None:
        if self.bar is not None:
            self.bar.update(self.done + reader.bytes_read - self.bar.n)

    def end_pass(self) -> None:
        self.done += self.pass_size

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------------
# Building


def _build(
    source: Source,
    directory: Path,
    options: Options,
    vocabulary: bytes | None,
    workers: int,
    log: Callable[[str], None],
    progress: bool,
) -> None:
    """Write the prepared directory under a temporary name beside it, then swap it in."""
    _check_replaceable(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    for leftover in directory.parent.glob(f".{directory.name}.*"):  # from an interrupted build
        shutil.rmtree(leftover, ignore_errors=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    temporary.chmod(0o755)  # mkdtemp makes it private; prepared data is meant to be shared
    bar = _Progress(source, passes=1 if vocabulary else 2, enabled=progress)
    try:
        inputs = [_input_record(path) for path in _resolved(source)]
        started = time.monotonic()
        if vocabulary is None:
            vocab = _train_vocabulary(source, options, bar)
            log(f"vocabulary of {len(vocab):,} trained in {time.monotonic() - started:.0f} s")
        else:
            vocab = vocabulary_from_bytes(vocabulary)
        (temporary / vocabulary_file(vocab.to_bytes())).write_bytes(vocab.to_bytes())
        started = time.monotonic()
        counts = _encode(source, vocab, options, workers, temporary, bar)
        log(f"{counts['pairs']['read']:,} pairs encoded in {time.monotonic() - started:.0f} s")
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "name": source.name,
            "inputs": inputs,
            "filters": options.filters(),
            "vocabulary": {
                "file": vocabulary_file(vocab.to_bytes()),
                "sha256": _sha256(vocab.to_bytes()),
                "size": len(vocab),
                "trained_with": None if vocabulary else options.vocabulary_options(),
            },
            **counts,
        }
        (temporary / MANIFEST).write_text(json.dumps(manifest, indent=2))
        fsync_tree(temporary)
        swap_in(temporary, directory)
    finally:
        bar.close()
        shutil.rmtree(temporary, ignore_errors=True)


def _check_replaceable(directory: Path) -> None:
    """Refuse to replace a directory that is not prepared data (a mistyped path)."""
    if directory.exists() and not directory.is_dir():
        raise DataError(f"{directory}: exists and is not a directory (--prepared-dir)")
    if directory.is_dir() and any(directory.iterdir()) and not (directory / MANIFEST).exists():
        raise DataError(
            f"{directory}: not a prepared-data directory (no {MANIFEST}) and not empty; "
            f"choose another --prepared-dir"
        )


def _train_vocabulary(source: Source, options: Options, bar: _Progress) -> Vocabulary:
    """sentencepiece trained on a uniform sample of the pairs (reservoir sampling, seeded): all of
    them, in order, when there are no more than ``spm_sample`` / 2."""
    capacity = max(1, options.spm_sample // 2)
    random = seeded_generator(f"fastnmt-spm-sample-{options.seed}")
    src_sample: list[str] = []
    tgt_sample: list[str] = []
    seen = 0
    reader = PairReader(source.paths, CHUNK_PAIRS)
    for chunk in reader.chunks():
        filling = min(len(chunk), max(0, capacity - seen))
        src, tgt = chunk.texts(range(filling))
        src_sample += src
        tgt_sample += tgt
        # Pair i (from 0) replaces sample slot j, drawn uniformly from 0..i, when j < capacity.
        later = np.arange(seen + filling, seen + len(chunk))
        slots = (random.random(len(later)) * (later + 1)).astype(np.int64)
        replacing = np.flatnonzero(slots < capacity)
        src, tgt = chunk.texts(filling + replacing)
        for slot, source_text, target_text in zip(slots[replacing], src, tgt, strict=True):
            src_sample[slot], tgt_sample[slot] = source_text, target_text
        seen += len(chunk)
        bar.update(reader)
    bar.end_pass()
    return Vocabulary.train(src_sample + tgt_sample, options.vocab_size, seed=options.seed)


def _encode(
    source: Source,
    vocab: Vocabulary,
    options: Options,
    workers: int,
    directory: Path,
    bar: _Progress,
) -> dict:
    """Encode and filter every pair, write the arrays into ``directory``; returns the manifest's
    counts and array descriptions."""
    id_type = np.dtype(np.uint16 if len(vocab) <= 1 << 16 else np.uint32).newbyteorder("<")
    length_type = np.dtype(np.uint16 if options.max_len <= 1 << 16 else np.uint32)
    types = (id_type, length_type.newbyteorder("<"))
    with contextlib.ExitStack() as files:
        ids_files = {
            side: files.enter_context((directory / f"train.{side}.ids").open("wb"))
            for side in SIDES
        }
        lengths, codes = _encode_chunks(source, vocab, options, types, workers, ids_files, bar)
    dropped = count_dropped(codes)
    if not len(lengths["src"]):
        raise nothing_kept(source.name, dropped, options.max_len, options.ratio)
    arrays = {}
    for side in SIDES:
        arrays.update(_write_index(directory, side, lengths[side], id_type))
    pairs = {"read": len(codes), "kept": len(lengths["src"]), "dropped": dropped}
    tokens = {side: arrays[f"{side}.ids"]["count"] for side in SIDES}
    return {"pairs": pairs, "tokens": tokens, "arrays": arrays}


def _encode_chunks(source, vocab, options, types, workers, ids_files, bar):
    """Encode the chunks in worker processes, appending the kept ids to ``ids_files`` as the
    chunks come back, in order; returns the kept pairs' lengths per side and every pair's filter
    code."""
    lengths: dict[str, list[np.ndarray]] = {side: [] for side in SIDES}
    codes = []

    def append(result) -> None:
        *sides, chunk_codes = result
        for side, tokens in zip(SIDES, sides, strict=True):
            tokens.ids.tofile(ids_files[side])
            lengths[side].append(tokens.lengths)
        codes.append(chunk_codes)

    reader = PairReader(source.paths, CHUNK_PAIRS)
    settings = (options.max_len, options.ratio, *types)
    pool = ProcessPoolExecutor(workers, initializer=_start_worker, initargs=(vocab.to_bytes(),))
    with pool:
        pending = deque()
        # A bounded number of chunks in flight: submitting them all would read the whole corpus
        # into memory ahead of the workers.
        for chunk in reader.chunks():
            pending.append(pool.submit(_encode_chunk, chunk, *settings))
            if len(pending) > 2 * workers:
                append(pending.popleft().result())
            bar.update(reader)
        while pending:
            append(pending.popleft().result())
    bar.end_pass()
    return {side: np.concatenate(lengths[side]) for side in SIDES}, np.concatenate(codes)


def _write_index(directory: Path, side: str, lengths: np.ndarray, id_type: np.dtype) -> dict:
    """Write a side's lengths and offsets; returns the manifest entries of its three arrays."""
    offsets = np.zeros(len(lengths) + 1, np.dtype("<i8"))
    np.cumsum(lengths, out=offsets[1:])
    lengths.tofile(directory / f"train.{side}.lengths")
    offsets.tofile(directory / f"train.{side}.offsets")
    return {
        f"{side}.{kind}": {"file": f"train.{side}.{kind}", "dtype": dtype.str, "count": count}
        for kind, dtype, count in (
            ("ids", id_type, int(offsets[-1])),
            ("offsets", offsets.dtype, len(offsets)),
            ("lengths", lengths.dtype, len(lengths)),
        )
    }


_worker_vocab: Vocabulary | None = None  # the vocabulary of this worker process


def _start_worker(model: bytes) -> None:
    global _worker_vocab
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    _worker_vocab = vocabulary_from_bytes(model)


def _encode_chunk(chunk: PairChunk, max_len, ratio, id_type, length_type):
    """(source TokenArray, target TokenArray, filter codes) of a chunk: the arrays hold the kept
    pairs only, in the file's types."""
    src_text, tgt_text = chunk.texts()
    src = TokenArray.from_lists(_worker_vocab.encode(src_text), id_type)
    tgt = TokenArray.from_lists(_worker_vocab.encode_target(tgt_text), id_type)
    codes = filter_codes(src.lengths, tgt.lengths, max_len, ratio)
    kept = np.flatnonzero(codes == 0)
    src, tgt = src.select(kept), tgt.select(kept)
    src.lengths, tgt.lengths = src.lengths.astype(length_type), tgt.lengths.astype(length_type)
    return src, tgt, codes
