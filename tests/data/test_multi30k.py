"""fastnmt.data.multi30k: Multi30k from the local copy or the download cache.

Multi30k is found as the package finds it (tests/conftest.py: the shared local copy when present).
"""

import gzip

import pytest

from fastnmt.data import (
    DataError,
    load_multi30k,
    multi30k,
    multi30k_dir,
)
from tests.data.helpers import one_line_error, write
from tests.helpers import multi30k_file


def test_multi30k_val_from_the_local_copy(multi30k_path):
    corpus = load_multi30k("val", "en", "de", data_dir=multi30k_path)
    assert corpus.name == "multi30k/val"
    assert len(corpus.src) == len(corpus.tgt) == 1014
    with gzip.open(multi30k_path / "val.de.gz", "rt", encoding="utf-8") as f:
        assert corpus.tgt[0] == f.readline().rstrip("\n")


@pytest.mark.parametrize("tgt_lang", ["fr", "cs"])
def test_multi30k_other_languages(multi30k_path, tgt_lang):
    corpus = load_multi30k("test_2016_flickr", "en", tgt_lang, data_dir=multi30k_path)
    assert len(corpus.src) == len(corpus.tgt) == 1000


@pytest.mark.parametrize(("split", "lang"), [("dev", "en"), ("val", "es")])
def test_multi30k_unknown_split_or_language(multi30k_path, split, lang):
    with pytest.raises(DataError) as excinfo:
        load_multi30k(split, lang, "de", data_dir=multi30k_path)
    assert "choose from" in one_line_error(excinfo)


def test_multi30k_dir_priority(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("FASTNMT_DATA_DIR", raising=False)
    assert multi30k_dir() == tmp_path / "home/.cache/fastnmt/multi30k"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert multi30k_dir() == tmp_path / "xdg/fastnmt/multi30k"
    monkeypatch.setenv("FASTNMT_DATA_DIR", str(tmp_path / "env"))
    assert multi30k_dir() == tmp_path / "env"
    assert multi30k_dir(tmp_path / "arg") == tmp_path / "arg"


@pytest.fixture
def empty_cache(monkeypatch, tmp_path):
    """Multi30k resolved to an empty cache directory, downloading from the local copy."""
    local_copy = multi30k_file("val", "de").parent
    multi30k_file("val", "en")
    monkeypatch.delenv("FASTNMT_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(multi30k, "MULTI30K_URL", local_copy.as_uri() + "/{split}.{lang}.gz")
    return tmp_path / "cache/fastnmt/multi30k"


def test_multi30k_downloads_missing_files_into_the_cache(multi30k_path, empty_cache, monkeypatch):
    corpus = load_multi30k("val", "en", "de")
    assert len(corpus.src) == 1014
    assert sorted(p.name for p in empty_cache.iterdir()) == ["val.de.gz", "val.en.gz"]
    assert (empty_cache / "val.de.gz").read_bytes() == (multi30k_path / "val.de.gz").read_bytes()
    # Second use reads the cache: a now-broken URL does not matter.
    monkeypatch.setattr(multi30k, "MULTI30K_URL", "file:///nonexistent/{split}.{lang}.gz")
    assert load_multi30k("val", "en", "de").tgt == corpus.tgt


def test_failed_download_is_a_clear_error_and_leaves_nothing(empty_cache, monkeypatch):
    monkeypatch.setattr(multi30k, "MULTI30K_URL", "file:///nonexistent/{split}.{lang}.gz")
    with pytest.raises(DataError) as excinfo:
        load_multi30k("val", "en", "de")
    assert "could not download file:///nonexistent/val.en.gz" in one_line_error(excinfo)
    assert not empty_cache.exists() or not any(empty_cache.iterdir())


def test_garbled_download_is_not_cached(tmp_path):
    page = write(tmp_path / "error.html", "<html>rate limited</html>")
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(DataError) as excinfo:
        multi30k.download(page.as_uri(), cache / "val.en.gz")
    assert "could not download" in one_line_error(excinfo)
    assert not any(cache.iterdir())


def test_explicit_data_dir_is_never_downloaded_into(empty_cache, tmp_path):
    local_copy = tmp_path / "local"
    local_copy.mkdir()
    with pytest.raises(DataError) as excinfo:
        load_multi30k("val", "en", "de", data_dir=local_copy)
    assert str(local_copy / "val.en.gz") in one_line_error(excinfo)
    assert not any(local_copy.iterdir())
