"""Multi30k task 1 (raw, cased, untokenized): where its files are, downloading them into the
cache on first use, and reading a split."""

from __future__ import annotations

import gzip
import os
import urllib.request
import zlib
from pathlib import Path

from fastnmt.data.files import write_atomically
from fastnmt.data.text import DataError, ParallelCorpus, read_parallel

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
