"""Reading the user's parallel text: two line-aligned files or one TSV file, plain or gzip,
UTF-8, whole or a chunk of pairs at a time (``PairReader``: a corpus of any size).

Every problem with the user's data raises :class:`DataError` with a one-line message naming the file
(and line where there is one), so the command line can print it and exit with status 2.
"""

from __future__ import annotations

import contextlib
import gzip
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path


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


GZIP_MAGIC = b"\x1f\x8b"
COUNTED_LINES = 20_000  # lines a count reads at a time


def unreadable(path: Path, error: OSError) -> DataError:
    """The one-line error of a file that cannot be opened or read."""
    if isinstance(error, FileNotFoundError):
        return DataError(f"{path}: file not found")
    return DataError(f"{path}: cannot read: {error.strerror or error}")


class InputFile:
    """An input file opened for reading, plain or gzip: gzip is recognised by its magic bytes, not
    by its name, so a misnamed file still reads correctly. A problem is a one-line DataError."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._raw = self.path.open("rb")
        except OSError as error:
            raise unreadable(self.path, error) from None
        self.gzipped = self._raw.read(2) == GZIP_MAGIC
        self._raw.seek(0)
        self._stream = gzip.GzipFile(fileobj=self._raw) if self.gzipped else self._raw

    def read(self) -> bytes:
        """The rest of the contents (decompressed)."""
        with self._reading():
            return self._stream.read()

    def lines(self, count: int) -> list[bytes]:
        """The next ``count`` lines (fewer at the end), split on "\\n" only, each with its
        terminator."""
        with self._reading():
            return list(islice(self._stream, count))

    @property
    def bytes_read(self) -> int:
        """How far into the file reading is: compressed bytes, for a gzip file."""
        return self._raw.tell()

    def close(self) -> None:
        self._raw.close()

    def __enter__(self) -> InputFile:
        return self

    def __exit__(self, *exception) -> None:
        self.close()

    @contextlib.contextmanager
    def _reading(self):
        try:
            yield
        except (OSError, EOFError, zlib.error) as error:
            if self.gzipped:
                raise DataError(f"{self.path}: not a valid gzip file ({error})") from None
            raise unreadable(self.path, error) from None


class LineChunks:
    """The lines of one input file as raw bytes without their terminator ("\\n", and a "\\r"
    before it), read a chunk at a time."""

    def __init__(self, path: Path):
        self.path = path
        self.count = 0  # lines read so far
        self.bytes_read = 0
        self._file = InputFile(path)

    def take(self, count: int) -> list[bytes]:
        lines = self._file.lines(count)
        self.count += len(lines)
        self.bytes_read = self._file.bytes_read  # compressed bytes, for a gzip file
        return [line.removesuffix(b"\n").removesuffix(b"\r") for line in lines]

    def count_rest(self) -> int:
        """Read to the end, counting (for the line-count mismatch message)."""
        while self.take(COUNTED_LINES):
            pass
        return self.count

    def close(self) -> None:
        self._file.close()


@dataclass
class PairChunk:
    """Consecutive pairs as raw lines: one list per input file."""

    paths: tuple[Path, ...]
    first_line: int  # line number of the first pair
    lines: tuple[list[bytes], ...]

    def __len__(self) -> int:
        return len(self.lines[0])

    def texts(self, rows=None) -> tuple[list[str], list[str]]:
        """Source and target sentences of the pairs ``rows`` (default all), decoded; a line that
        is not UTF-8, or a TSV line without exactly one tab, is a DataError naming its line."""
        rows = range(len(self)) if rows is None else rows
        if len(self.paths) == 2:
            return self._decoded(0, rows), self._decoded(1, rows)
        path = self.paths[0]
        pairs = [
            split_tsv_line(line, path, self.first_line + row)
            for row, line in zip(rows, self._decoded(0, rows), strict=True)
        ]
        return [source for source, _ in pairs], [target for _, target in pairs]

    def _decoded(self, side: int, rows) -> list[str]:
        lines, decoded = self.lines[side], []
        for row in rows:
            try:
                decoded.append(lines[row].decode("utf-8"))
            except UnicodeDecodeError as error:
                line_number = self.first_line + int(row)
                raise not_utf8(self.paths[side], line_number, lines[row][error.start]) from None
        return decoded


class PairReader:
    """Pairs read ``pairs`` at a time from two line-aligned files (source, target) or one TSV
    file, with the progress in input bytes: a corpus of any size, never whole in memory."""

    def __init__(self, paths: tuple[Path, ...], pairs: int):
        self.paths, self.pairs = paths, pairs
        self.files = [LineChunks(path) for path in paths]

    def chunks(self) -> Iterator[PairChunk]:
        first_line = 1
        try:
            while True:
                lines = tuple(file.take(self.pairs) for file in self.files)
                if len({len(side) for side in lines}) > 1:
                    self._mismatch()
                if not lines[0]:
                    break
                yield PairChunk(self.paths, first_line, lines)
                first_line += len(lines[0])
            for file in self.files:
                if not file.count:
                    raise DataError(f"{file.path}: file is empty")
        finally:
            for file in self.files:
                file.close()

    def _mismatch(self):
        """The error where the files' lengths part, both counted to their ends."""
        counts = [file.count_rest() for file in self.files]
        for file, count in zip(self.files, counts, strict=True):
            if not count:
                raise DataError(f"{file.path}: file is empty")
        src, tgt = self.paths
        raise DataError(
            f"line-count mismatch: {src} has {counts[0]} lines but {tgt} has {counts[1]}"
        )

    @property
    def bytes_read(self) -> int:
        return sum(file.bytes_read for file in self.files)


def read_lines(path: str | Path) -> list[str]:
    """The lines of a UTF-8 text file (plain or gzip), without line terminators.

    Lines are split on "\\n" only (a trailing "\\r" is dropped): ``str.splitlines`` would also split
    on characters such as U+2028 inside a sentence and silently misalign a parallel corpus.
    """
    path = Path(path)
    with InputFile(path) as file:
        data = file.read()
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
