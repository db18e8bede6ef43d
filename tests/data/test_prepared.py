"""fastnmt.data.prepared: the prepared (binarized) corpus round-trips, its manifest notices
changed inputs and options, and bad input is a one-line error."""

import gzip
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from fastnmt.data import DataError, ParallelCorpus, Vocabulary, encode_corpus
from fastnmt.data import prepared as preparation
from fastnmt.data.prepared import Options, Source

VOCAB = 300


def random_pairs(corpus, rng: random.Random) -> tuple[list[str], list[str]]:
    """The 300 Multi30k pairs of the ``corpus`` fixture shuffled, plus pairs the filters drop."""
    src = (corpus / "train.en").read_text(encoding="utf-8").splitlines()
    tgt = (corpus / "train.de").read_text(encoding="utf-8").splitlines()
    pairs = list(zip(src, tgt, strict=True))
    rng.shuffle(pairs)
    pairs = pairs[: rng.randint(200, 300)]
    words = " ".join(src).split()
    for _ in range(rng.randint(3, 9)):
        pairs.insert(rng.randrange(len(pairs)), ("", "Leer."))  # empty
        long = " ".join(rng.choices(words, k=120))
        pairs.insert(rng.randrange(len(pairs)), (long, long))  # too long for max_len 100
        # length ratio: 40 tokens "a" against at most 3, whatever vocabulary the sample trains
        # (40 corpus words took from 40 to over 100 tokens: sometimes "too long" instead)
        pairs.insert(rng.randrange(len(pairs)), (" ".join(["a"] * 40), "Ja."))
    return [s for s, _ in pairs], [t for _, t in pairs]


def write_parallel(directory, src, tgt, *, gzip_target=False):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "train.en").write_text("".join(f"{s}\n" for s in src), encoding="utf-8")
    target = "".join(f"{t}\n" for t in tgt).encode("utf-8")
    name = "train.de.gz" if gzip_target else "train.de"
    (directory / name).write_bytes(gzip.compress(target) if gzip_target else target)
    return Source((directory / "train.en", directory / name), str(directory / "train"))


OPTIONS = Options(vocab_size=VOCAB, max_len=100)


@pytest.fixture
def text(corpus):
    return random_pairs(corpus, random.Random())


def test_round_trip_equals_encoding_in_memory(text, tmp_path, monkeypatch):
    monkeypatch.setattr(preparation, "CHUNK_PAIRS", random.choice([7, 13, 64]))  # many chunks
    source = write_parallel(tmp_path / "text", *text, gzip_target=True)
    prepared = preparation.prepare(source, tmp_path / "prepared", OPTIONS, workers=2)
    vocab = Vocabulary.train(text[0] + text[1], VOCAB, seed=1)
    assert prepared.vocab.to_bytes() == vocab.to_bytes()  # trained on every sentence, in order
    expected = encode_corpus(ParallelCorpus(*text, "text"), vocab, max_len=100)
    for side in ("src", "tgt"):
        got, want = getattr(prepared.corpus, side), getattr(expected, side)
        assert got.ids.dtype == np.uint16
        assert np.array_equal(got.ids, want.ids)
        assert np.array_equal(got.offsets, want.offsets)
        assert np.array_equal(got.lengths, want.lengths)
    manifest = prepared.manifest
    assert manifest["pairs"]["read"] == len(text[0])
    assert manifest["pairs"]["kept"] == len(expected)
    assert sum(manifest["pairs"]["dropped"].values()) == expected.dropped > 0
    assert all(manifest["pairs"]["dropped"].values())  # every reason occurred
    assert f"{len(expected):,} training pairs kept" in prepared.summary()


def test_no_thread_outlives_a_preparation_off_a_terminal(text, tmp_path):
    """The training process forks its data loader's workers after preparing, and a fork copies
    no other thread but any lock one holds: no thread of the preparation (tqdm's monitor, which
    even a disabled bar starts; its encoding workers' pool) may be alive then. In a fresh
    process, as a thread of an earlier test would hide one."""
    write_parallel(tmp_path / "text", *text)
    script = f"""
import sys, threading
from pathlib import Path
from fastnmt.data import prepared
d = Path(sys.argv[1])
source = prepared.Source((d / "train.en", d / "train.de"), str(d / "train"))
options = prepared.Options(vocab_size={VOCAB}, max_len=100)
prepared.prepare(source, d / "prepared", options, workers=2, progress=True)
print(*(thread.name for thread in threading.enumerate()))
"""
    command = [sys.executable, "-c", script, str(tmp_path / "text")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["MainThread"]


def test_tsv_gives_the_same_arrays(text, tmp_path):
    parallel = preparation.prepare(
        write_parallel(tmp_path / "text", *text), tmp_path / "a", OPTIONS, workers=1
    )
    tsv = tmp_path / "train.tsv"
    tsv.write_text("".join(f"{s}\t{t}\n" for s, t in zip(*text, strict=True)), encoding="utf-8")
    prepared = preparation.prepare(Source((tsv,), str(tsv)), tmp_path / "b", OPTIONS, workers=2)
    assert prepared.vocab.to_bytes() == parallel.vocab.to_bytes()
    assert np.array_equal(prepared.corpus.tgt.ids, parallel.corpus.tgt.ids)


def test_the_vocabulary_is_trained_on_a_seeded_sample(text, tmp_path, monkeypatch):
    seen = []
    real_train = Vocabulary.train

    def train(texts, *args, **kwargs):
        seen.append(list(texts))
        return real_train(texts, *args, **kwargs)

    monkeypatch.setattr(Vocabulary, "train", train)
    monkeypatch.setattr(preparation, "CHUNK_PAIRS", 11)
    source = write_parallel(tmp_path / "text", *text)
    options = Options(vocab_size=VOCAB, spm_sample=101, max_len=100)
    for name in ("a", "b"):
        preparation.prepare(source, tmp_path / name, options, workers=1)
    sample_src, sample_tgt = seen[0][:50], seen[0][50:]
    assert len(seen[0]) == 100 and seen[0] == seen[1]  # 101 // 2 pairs, the same both times
    pairs = set(zip(*text, strict=True))
    assert all(pair in pairs for pair in zip(sample_src, sample_tgt, strict=True))
    assert sample_src != text[0][:50]  # not just the first pairs


# --- reuse and invalidation ---------------------------------------------------------------------


@pytest.fixture
def prepared_once(text, tmp_path):
    source = write_parallel(tmp_path / "text", *text)
    directory = tmp_path / "prepared"
    preparation.prepare(source, directory, OPTIONS, workers=1)
    return source, directory


def _prepare_logging(source, directory, options=OPTIONS, **kwargs) -> str:
    lines = []
    preparation.prepare(source, directory, options, workers=1, log=lines.append, **kwargs)
    return lines[0]


def test_reused_when_nothing_changed_even_if_touched(prepared_once):
    source, directory = prepared_once
    manifest = (directory / "manifest.json").read_bytes()
    assert _prepare_logging(source, directory) == f"using the prepared data in {directory}"
    os.utime(source.paths[0])  # a new mtime, the same bytes: the hash decides
    assert _prepare_logging(source, directory).startswith("using")
    assert (directory / "manifest.json").read_bytes() == manifest


@pytest.mark.parametrize("edit", ["same size", "longer"])
def test_changed_input_is_prepared_again(prepared_once, edit):
    source, directory = prepared_once
    path = source.paths[1]
    data = bytearray(path.read_bytes())
    letters = [
        i for i in range(len(data) // 4, len(data)) if data[i] < 128 and chr(data[i]).isalpha()
    ]
    position = random.choice(letters)  # mid-file, an ASCII letter: the text stays valid
    data[position : position + 1] = b"Z" if data[position] != ord("Z") else b"Y"
    if edit == "longer":
        data[position:position] = b" und so weiter"
    path.write_bytes(data)
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 1_000_000))
    message = _prepare_logging(source, directory)
    assert message == f"preparing {source.name} in {directory} ({path.resolve()} changed)"


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        (Options(vocab_size=VOCAB, max_len=90), "other length filters"),
        (Options(vocab_size=VOCAB + 7, max_len=100), "other vocabulary options"),
        (Options(vocab_size=VOCAB, max_len=100, seed=2), "other vocabulary options"),
    ],
)
def test_other_options_prepare_again(prepared_once, options, reason):
    source, directory = prepared_once
    assert _prepare_logging(source, directory, options).endswith(f"(prepared with {reason})")


def test_a_given_vocabulary_is_used_and_matched(prepared_once, corpus):
    source, directory = prepared_once
    other = Vocabulary.train((corpus / "train.en").read_text().splitlines()[:100], 200).to_bytes()
    message = _prepare_logging(source, directory, vocabulary=other)
    assert message.endswith("(prepared with another vocabulary than the checkpoint's)")
    assert preparation.open_prepared(directory).vocab.to_bytes() == other
    assert _prepare_logging(source, directory, vocabulary=other).startswith("using")


def test_a_failed_preparation_keeps_the_previous_one(prepared_once, monkeypatch):
    source, directory = prepared_once
    before = {p.name: p.read_bytes() for p in directory.iterdir()}

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(preparation, "_encode", crash)
    with pytest.raises(KeyboardInterrupt):
        preparation.prepare(source, directory, Options(vocab_size=VOCAB, max_len=80), workers=1)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert [p.name for p in directory.parent.iterdir() if p.name.startswith(".")] == []


def test_another_ranks_check_refuses_stale_data(prepared_once):
    source, directory = prepared_once
    assert preparation.check_prepared(source, directory, OPTIONS, None).manifest["pairs"]
    with pytest.raises(DataError) as excinfo:
        preparation.check_prepared(source, directory, Options(vocab_size=VOCAB), None)
    assert "not the prepared data of this run (prepared with other length filters)" in str(
        excinfo.value
    )


def test_a_damaged_manifest_is_prepared_again_or_a_one_line_error(prepared_once):
    source, directory = prepared_once
    manifest = json.loads((directory / "manifest.json").read_text())
    del manifest["arrays"]["tgt.offsets"]
    del manifest[random.choice(["filters", "inputs", "vocabulary"])]
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError) as excinfo:
        preparation.open_prepared(directory)
    assert str(excinfo.value).startswith(f"{directory / 'manifest.json'}: damaged (")
    message = _prepare_logging(source, directory)
    assert message.endswith("(its manifest.json is damaged)")
    assert preparation.open_prepared(directory).manifest["pairs"]


def test_a_damaged_array_file_is_a_one_line_error(prepared_once):
    _, directory = prepared_once
    ids = directory / "train.tgt.ids"
    ids.write_bytes(ids.read_bytes()[:-2])
    with pytest.raises(DataError) as excinfo:
        preparation.open_prepared(directory)
    assert str(excinfo.value).startswith(f"{ids}: ")
    assert "\n" not in str(excinfo.value)


# --- bad input ----------------------------------------------------------------------------------


def _error(source, tmp_path, options=OPTIONS) -> str:
    with pytest.raises(DataError) as excinfo:
        preparation.prepare(source, tmp_path / "prepared", options, workers=2)
    message = str(excinfo.value)
    assert "\n" not in message
    assert not (tmp_path / "prepared").exists()
    return message


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(preparation, "CHUNK_PAIRS", 5)


def test_line_count_mismatch_counts_both_files(tmp_path, small_chunks):
    source = write_parallel(tmp_path, ["a"] * 23, ["b"] * 17)
    assert _error(source, tmp_path) == (
        f"line-count mismatch: {source.paths[0]} has 23 lines but {source.paths[1]} has 17"
    )


def test_a_non_utf8_line_in_a_later_chunk_is_named(tmp_path, small_chunks):
    source = write_parallel(tmp_path, ["A dog."] * 30, ["Ein Hund."] * 30)
    lines = source.paths[1].read_bytes().splitlines(keepends=True)
    lines[21] = b"caf\xe9\n"
    source.paths[1].write_bytes(b"".join(lines))
    assert _error(source, tmp_path) == f"{source.paths[1]}:22: not valid UTF-8 (byte 0xe9)"


def test_a_tsv_line_without_one_tab(tmp_path, small_chunks):
    tsv = tmp_path / "train.tsv"
    tsv.write_text("a\tb\n" * 12 + "no tab\n" + "c\td\n" * 3, encoding="utf-8")
    message = _error(Source((tsv,), str(tsv)), tmp_path)
    assert message == f"{tsv}:13: expected 'source<TAB>target' (one tab), found 0 tabs"


def test_an_empty_file(tmp_path):
    source = write_parallel(tmp_path, [], [])
    assert _error(source, tmp_path) == f"{source.paths[0]}: file is empty"


def test_every_pair_filtered_out(tmp_path):
    source = write_parallel(tmp_path, ["A dog runs.", ""], ["Ein Hund rennt.", "x"])
    message = _error(source, tmp_path, Options(vocab_size=VOCAB, max_len=3))
    assert message.startswith(f"{source.name}: every pair was filtered out: 1 empty, 1 too long")


def test_a_directory_that_is_not_prepared_data_is_left_alone(prepared_once, tmp_path):
    source, _ = prepared_once
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(DataError) as excinfo:
        preparation.prepare(source, tmp_path / "mine", OPTIONS)
    assert "not a prepared-data directory" in str(excinfo.value)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
