"""fastnmt.data.text: reading parallel files and TSV, plain or gzip, and bad input as one-line
errors."""

import gzip

import pytest

from fastnmt.data import (
    DataError,
    PairReader,
    read_parallel,
    read_parallel_prefix,
    read_tsv,
    text,
)
from tests.data.helpers import one_line_error, write

# --- reading files ------------------------------------------------------------------------------


def test_read_parallel_plain_and_gzip_agree(tmp_path):
    src_text = "A dog.\nTwo cats\u2028sleep.\r\nÜber alles.\n"  # U+2028 is not a line break
    tgt_text = "Ein Hund.\nZwei Katzen schlafen.\r\nVor allem.\n"
    plain = read_parallel(write(tmp_path / "a.en", src_text), write(tmp_path / "a.de", tgt_text))
    src_gz = write(tmp_path / "b.en.gz", src_text, gz=True)
    gzipped = read_parallel(src_gz, write(tmp_path / "b.de.gz", tgt_text, gz=True))
    assert plain.src == ["A dog.", "Two cats\u2028sleep.", "Über alles."]
    assert plain.tgt == ["Ein Hund.", "Zwei Katzen schlafen.", "Vor allem."]
    assert (gzipped.src, gzipped.tgt) == (plain.src, plain.tgt)


def test_read_parallel_keeps_empty_lines_and_a_missing_final_newline(tmp_path):
    corpus = read_parallel(
        write(tmp_path / "x.en", "one\n\nthree"), write(tmp_path / "x.de", "eins\nzwei\ndrei\n")
    )
    assert corpus.src == ["one", "", "three"]
    assert len(corpus.tgt) == 3


@pytest.mark.parametrize(
    ("src_name", "tgt_name"),
    [("train.en", "train.de"), ("train.en.gz", "train.de.gz"), ("train.src", "train.tgt.gz")],
)
def test_read_parallel_prefix_finds_both_naming_schemes(tmp_path, src_name, tgt_name):
    write(tmp_path / src_name, "Hello.\n", gz=src_name.endswith(".gz"))
    write(tmp_path / tgt_name, "Hallo.\n", gz=tgt_name.endswith(".gz"))
    corpus = read_parallel_prefix(str(tmp_path / "train"), "en", "de")
    assert (corpus.src, corpus.tgt) == (["Hello."], ["Hallo."])
    assert corpus.name == str(tmp_path / "train")


def test_read_parallel_prefix_prefers_the_language_suffix(tmp_path):
    write(tmp_path / "train.en", "language\n")
    write(tmp_path / "train.src", "role\n")
    write(tmp_path / "train.de", "Sprache\n")
    assert read_parallel_prefix(str(tmp_path / "train"), "en", "de").src == ["language"]


def test_read_parallel_prefix_names_what_it_tried(tmp_path):
    write(tmp_path / "train.en", "Hello.\n")
    with pytest.raises(DataError) as excinfo:
        read_parallel_prefix(str(tmp_path / "train"), "en", "de")
    message = one_line_error(excinfo)
    assert "train.de.gz" in message and "train.tgt" in message


def test_read_tsv(tmp_path):
    corpus = read_tsv(write(tmp_path / "pairs.tsv", "A dog.\tEin Hund.\n\tleer\n"))
    assert corpus.src == ["A dog.", ""]
    assert corpus.tgt == ["Ein Hund.", "leer"]
    assert corpus.name == str(tmp_path / "pairs.tsv")


# --- bad input ----------------------------------------------------------------------------------


def test_line_count_mismatch_names_both_files_and_counts(tmp_path):
    src = write(tmp_path / "train.en", "a\nb\nc\n")
    tgt = write(tmp_path / "train.de", "a\nb\n")
    with pytest.raises(DataError) as excinfo:
        read_parallel(src, tgt)
    message = one_line_error(excinfo)
    assert str(src) in message and str(tgt) in message
    assert "3" in message and "2" in message


@pytest.mark.parametrize("gz", [False, True])
def test_non_utf8_line_is_reported_with_its_line_number(tmp_path, gz):
    latin1 = "fine\nalso fine\nLatin-1 \xe9t\xe9\n".encode("latin-1")
    path = write(tmp_path / "bad.en", latin1, gz=gz)
    with pytest.raises(DataError) as excinfo:
        text.read_lines(path)
    assert one_line_error(excinfo).startswith(f"{path}:3:")


def test_missing_file(tmp_path):
    with pytest.raises(DataError) as excinfo:
        read_parallel(tmp_path / "nope.en", tmp_path / "nope.de")
    assert str(tmp_path / "nope.en") in one_line_error(excinfo)


@pytest.mark.parametrize("gz", [False, True])
def test_empty_file(tmp_path, gz):
    src = write(tmp_path / "train.en", "Hello.\n")
    tgt = write(tmp_path / "train.de", "", gz=gz)
    with pytest.raises(DataError) as excinfo:
        read_parallel(src, tgt)
    assert one_line_error(excinfo) == f"{tgt}: file is empty"


def test_corrupt_gzip(tmp_path):
    path = write(tmp_path / "train.en.gz", gzip.compress(b"Hello.\n" * 100)[:-20])
    with pytest.raises(DataError) as excinfo:
        text.read_lines(path)
    assert "gzip" in one_line_error(excinfo)


@pytest.mark.parametrize("bad_line", ["no tab at all", "one\ttwo\tthree"])
def test_tsv_line_without_exactly_one_tab(tmp_path, bad_line):
    path = write(tmp_path / "pairs.tsv", f"a\tb\n{bad_line}\nc\td\n")
    with pytest.raises(DataError) as excinfo:
        read_tsv(path)
    assert one_line_error(excinfo).startswith(f"{path}:2:")


def test_read_parallel_and_the_pair_reader_agree_on_line_ends(tmp_path):
    raw = "one\r\ntwo\u2028still two\n\nfour".encode()  # CRLF, U+2028, empty, no final newline
    (tmp_path / "x.en").write_bytes(raw)
    (tmp_path / "x.de").write_bytes(raw)
    chunk = next(PairReader((tmp_path / "x.en", tmp_path / "x.de"), 10).chunks())
    assert chunk.texts()[0] == read_parallel(tmp_path / "x.en", tmp_path / "x.de").src


def test_a_pair_reader_reads_chunks_in_order_with_their_first_lines(tmp_path):
    write(tmp_path / "x.en", "".join(f"s{i}\n" for i in range(7)))
    write(tmp_path / "x.de", "".join(f"t{i}\n" for i in range(7)))
    chunks = list(PairReader((tmp_path / "x.en", tmp_path / "x.de"), 3).chunks())
    assert [c.first_line for c in chunks] == [1, 4, 7]
    assert [c.texts() for c in chunks][1] == (["s3", "s4", "s5"], ["t3", "t4", "t5"])


@pytest.mark.parametrize(("src", "tgt", "message"), [
    ("a\nb\n", "a\n", "line-count mismatch: {src} has 2 lines but {tgt} has 1"),
    ("a\n", "a\nb\nc\n", "line-count mismatch: {src} has 1 lines but {tgt} has 3"),
    ("a\n", "", "{tgt}: file is empty"),
    ("", "", "{src}: file is empty"),
])  # fmt: skip
def test_a_pair_reader_names_an_empty_file_or_a_mismatch(tmp_path, src, tgt, message):
    paths = (tmp_path / "x.en", tmp_path / "x.de")
    write(paths[0], src)
    write(paths[1], tgt)
    with pytest.raises(DataError) as error:
        list(PairReader(paths, 1).chunks())
    assert str(error.value) == message.format(src=paths[0], tgt=paths[1])
