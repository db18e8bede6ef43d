"""fastnmt.data.corpus: length filtering, token arrays and their memory-mapped files."""

import pickle

import numpy as np
import pytest

from fastnmt.data import (
    DataError,
    EncodedCorpus,
    MappedFile,
    ParallelCorpus,
    TokenArray,
    corpus_stats,
    encode_corpus,
)
from tests.data.helpers import as_lists, one_line_error, random_sequences, write_mapped

# --- length filtering ---------------------------------------------------------------------------


def test_encode_corpus_filters_empty_long_and_unbalanced_pairs(vocab):
    short, longer = "A dog.", "A man in a blue shirt is standing on a ladder cleaning windows."
    short_len, longer_len = (len(ids) for ids in vocab.encode([short, longer]))
    corpus = ParallelCorpus(
        src=[short, "", short, longer, short],
        tgt=[short, short, "", longer, longer],
        name="toy",
    )
    # Boundaries: longer (+ eos) fits exactly, and longer/short is exactly the allowed ratio.
    encoded = encode_corpus(corpus, vocab, max_len=longer_len + 1, ratio=longer_len / short_len)
    assert encoded.dropped == 2  # the two pairs with an empty side
    assert as_lists(encoded.src) == vocab.encode([short, longer, short])
    encoded = encode_corpus(corpus, vocab, max_len=longer_len, ratio=longer_len / short_len - 0.01)
    assert encoded.dropped == 4  # also too long, and too unbalanced
    assert as_lists(encoded.src) == as_lists(encoded.tgt) == vocab.encode([short])


def test_every_pair_filtered_out(vocab):
    corpus = ParallelCorpus(["A dog runs in the park.", ""], ["Ein Hund rennt.", "x"], "toy")
    with pytest.raises(DataError) as excinfo:
        encode_corpus(corpus, vocab, max_len=3)
    message = one_line_error(excinfo)
    assert message.startswith("toy: every pair was filtered out")
    assert "1 empty" in message and "1 too long" in message


def test_corpus_stats():
    stats = corpus_stats(EncodedCorpus.from_lists([[5, 6], [7]], [[8], [9, 10, 11]], dropped=4))
    assert stats == {
        "pairs": 2,
        "dropped": 4,
        "src_tokens": 3,
        "tgt_tokens": 4,
        "max_src_len": 2,
        "max_tgt_len": 3,
    }


# --- token arrays and their files ---------------------------------------------------------------


def test_token_array_round_trip_and_gather():
    rng = np.random.default_rng()
    sequences = random_sequences(rng, int(rng.integers(1, 300)))
    tokens = TokenArray.from_lists(sequences)
    assert as_lists(tokens) == sequences
    rows = rng.permutation(len(sequences))[: int(rng.integers(1, len(sequences) + 1))]
    ids, lengths = tokens.gather(rows)
    assert ids.tolist() == [i for row in rows for i in sequences[row]]
    assert lengths.tolist() == [len(sequences[row]) for row in rows]
    assert as_lists(tokens.select(rows)) == [sequences[row] for row in rows]


def test_mapped_token_array_pickles_by_file_name_and_releases_its_pages(tmp_path):
    rng = np.random.default_rng()
    sequences = random_sequences(rng, 1001, longest=300)
    mapped = write_mapped(tmp_path, sequences)
    assert as_lists(mapped) == sequences
    pickled = pickle.dumps(mapped)
    assert len(pickled) < 1000  # the file names, not the data
    again = pickle.loads(pickled)
    mapped.release_pages()
    assert as_lists(again) == as_lists(mapped) == sequences  # pages read in again on demand


def test_mapped_file_of_the_wrong_size_is_a_one_line_error(tmp_path):
    (tmp_path / "ids").write_bytes(b"\0" * 7)
    with pytest.raises(DataError) as excinfo:
        MappedFile(tmp_path / "ids", "<u2", 4)
    assert one_line_error(excinfo) == f"{tmp_path / 'ids'}: 7 bytes, expected 8 (4 x uint16)"
