"""Helpers of the fastnmt.data tests."""

import gzip

import numpy as np

from fastnmt.data import MappedFile, TokenArray


def write(path, text, *, gz=False):
    raw = text.encode("utf-8") if isinstance(text, str) else text
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


def one_line_error(excinfo):
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def as_lists(tokens: TokenArray) -> list[list[int]]:
    return [tokens[i].tolist() for i in range(len(tokens))]


def random_sequences(rng, count, *, longest=40, vocab=9000):
    return [
        rng.integers(4, vocab, size=int(rng.integers(0, longest))).tolist() for _ in range(count)
    ]


def write_mapped(directory, sequences, dtype="<u2"):
    """A TokenArray's three files, as fastnmt.data.prepared writes them, mapped back."""
    tokens = TokenArray.from_lists(sequences, np.dtype(dtype))
    files = []
    for kind, array in (
        ("ids", tokens.ids),
        ("offsets", tokens.offsets),
        ("lengths", tokens.lengths),
    ):
        array.tofile(directory / kind)
        files.append(MappedFile(directory / kind, array.dtype.str, len(array)))
    return TokenArray.mapped(*files)
