"""fastnmt.data: reading corpora, Multi30k, the vocabulary, token arrays, length filtering and
batching.

Multi30k is found as the package finds it (tests/conftest.py: the shared local copy when present).
"""

import gzip
import pickle
import random

import numpy as np
import pytest
import torch

from fastnmt import data
from fastnmt.data import (
    Batch,
    DataError,
    EncodedCorpus,
    MappedFile,
    ParallelCorpus,
    TokenArray,
    TokenBatches,
    Vocabulary,
    corpus_stats,
    encode_corpus,
    load_multi30k,
    make_batch,
    multi30k_dir,
    pack_by_tokens,
    read_parallel,
    read_parallel_prefix,
    read_tsv,
)
from tests.helpers import multi30k_file

TRAIN_SLICE = 3000  # enough text for a meaningful vocabulary, quick to train on


@pytest.fixture(scope="module")
def multi30k_path():
    return multi30k_dir()


@pytest.fixture(scope="module")
def train_slice(multi30k_path):
    corpus = load_multi30k("train", "en", "de", data_dir=multi30k_path)
    return ParallelCorpus(corpus.src[:TRAIN_SLICE], corpus.tgt[:TRAIN_SLICE], "train slice")


@pytest.fixture(scope="module")
def vocab(train_slice):
    return Vocabulary.train(train_slice.src + train_slice.tgt, vocab_size=1000)


def write(path, text, *, gz=False):
    raw = text.encode("utf-8") if isinstance(text, str) else text
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


def one_line_error(excinfo):
    message = str(excinfo.value)
    assert "\n" not in message
    return message


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
        data.read_lines(path)
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
        data.read_lines(path)
    assert "gzip" in one_line_error(excinfo)


@pytest.mark.parametrize("bad_line", ["no tab at all", "one\ttwo\tthree"])
def test_tsv_line_without_exactly_one_tab(tmp_path, bad_line):
    path = write(tmp_path / "pairs.tsv", f"a\tb\n{bad_line}\nc\td\n")
    with pytest.raises(DataError) as excinfo:
        read_tsv(path)
    assert one_line_error(excinfo).startswith(f"{path}:2:")


# --- Multi30k -----------------------------------------------------------------------------------


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
    monkeypatch.setattr(data, "MULTI30K_URL", local_copy.as_uri() + "/{split}.{lang}.gz")
    return tmp_path / "cache/fastnmt/multi30k"


def test_multi30k_downloads_missing_files_into_the_cache(multi30k_path, empty_cache, monkeypatch):
    corpus = load_multi30k("val", "en", "de")
    assert len(corpus.src) == 1014
    assert sorted(p.name for p in empty_cache.iterdir()) == ["val.de.gz", "val.en.gz"]
    assert (empty_cache / "val.de.gz").read_bytes() == (multi30k_path / "val.de.gz").read_bytes()
    # Second use reads the cache: a now-broken URL does not matter.
    monkeypatch.setattr(data, "MULTI30K_URL", "file:///nonexistent/{split}.{lang}.gz")
    assert load_multi30k("val", "en", "de").tgt == corpus.tgt


def test_failed_download_is_a_clear_error_and_leaves_nothing(empty_cache, monkeypatch):
    monkeypatch.setattr(data, "MULTI30K_URL", "file:///nonexistent/{split}.{lang}.gz")
    with pytest.raises(DataError) as excinfo:
        load_multi30k("val", "en", "de")
    assert "could not download file:///nonexistent/val.en.gz" in one_line_error(excinfo)
    assert not empty_cache.exists() or not any(empty_cache.iterdir())


def test_garbled_download_is_not_cached(tmp_path):
    page = write(tmp_path / "error.html", "<html>rate limited</html>")
    cache = tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(DataError) as excinfo:
        data.download(page.as_uri(), cache / "val.en.gz")
    assert "could not download" in one_line_error(excinfo)
    assert not any(cache.iterdir())


def test_explicit_data_dir_is_never_downloaded_into(empty_cache, tmp_path):
    local_copy = tmp_path / "local"
    local_copy.mkdir()
    with pytest.raises(DataError) as excinfo:
        load_multi30k("val", "en", "de", data_dir=local_copy)
    assert str(local_copy / "val.en.gz") in one_line_error(excinfo)
    assert not any(local_copy.iterdir())


# --- vocabulary ---------------------------------------------------------------------------------


def test_special_ids(vocab):
    assert (vocab.pad_id, vocab.bos_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2, 3)
    assert vocab.pieces([0, 1, 2, 3]) == ["<pad>", "<s>", "</s>", "<unk>"]
    assert len(vocab) == 1000


def test_round_trip(vocab, train_slice):
    # sentencepiece collapses repeated spaces, so "normal" means single-spaced.
    sentences = [s for s in train_slice.src[:200] + train_slice.tgt[:200] if "  " not in s]
    ids = vocab.encode(sentences)
    assert all(3 not in sentence_ids for sentence_ids in ids)  # no <unk> on training text
    assert vocab.decode(ids) == sentences
    assert "".join(vocab.pieces(ids[0])).replace("▁", " ").strip() == sentences[0]


def test_decode_stops_at_eos_and_drops_pad_and_bos(vocab):
    dog = vocab.encode(["A dog runs."])[0]
    cat = vocab.encode(["A cat."])[0]
    raw = [[vocab.bos_id, *dog, vocab.eos_id, *cat, vocab.eos_id], [*cat, vocab.pad_id]]
    assert vocab.decode(raw) == ["A dog runs.", "A cat."]


def test_training_is_deterministic_and_serialises_exactly(vocab, train_slice, tmp_path):
    again = Vocabulary.train(train_slice.src + train_slice.tgt, vocab_size=1000)
    assert again.to_bytes() == vocab.to_bytes()
    restored = Vocabulary.from_bytes(vocab.to_bytes())
    assert restored.to_bytes() == vocab.to_bytes()
    assert restored.encode(train_slice.tgt[:50]) == vocab.encode(train_slice.tgt[:50])
    vocab.save(tmp_path / "spm.model")
    assert Vocabulary.load(tmp_path / "spm.model").to_bytes() == vocab.to_bytes()


def test_vocab_size_is_capped_by_the_data():
    tiny = Vocabulary.train(["a small text", "another small text"], vocab_size=8000)
    assert 4 < len(tiny) < 100
    assert tiny.decode(tiny.encode(["a small text"])) == ["a small text"]


@pytest.mark.parametrize("texts", [[], ["", ""]])
def test_no_text_to_train_on(texts):
    with pytest.raises(DataError):
        Vocabulary.train(texts)


def test_not_a_model(tmp_path):
    with pytest.raises(DataError) as excinfo:
        Vocabulary.load(write(tmp_path / "spm.model", "not a model"))
    assert str(tmp_path / "spm.model") in one_line_error(excinfo)


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


# --- batches ------------------------------------------------------------------------------------


def test_make_batch_pads_and_adds_bos_eos():
    batch = make_batch([[5, 6, 7], [8]], [[9], [10, 11]], [4, 0], pad_id=0, bos_id=1, eos_id=2)
    assert torch.equal(batch.src, torch.tensor([[5, 6, 7, 2], [8, 2, 0, 0]]))
    assert torch.equal(batch.src_lengths, torch.tensor([4, 2]))
    assert torch.equal(batch.tgt_in, torch.tensor([[1, 9, 0], [1, 10, 11]]))
    assert torch.equal(batch.tgt_out, torch.tensor([[9, 2, 0], [10, 11, 2]]))
    assert torch.equal(batch.tgt_lengths, torch.tensor([2, 3]))
    assert torch.equal(batch.indices, torch.tensor([4, 0]))
    assert batch.num_tgt_tokens == 5
    assert all(t.dtype == torch.int64 for t in (batch.src, batch.tgt_in, batch.src_lengths))


def test_make_batch_without_target_for_translation():
    batch = make_batch([[5], [6, 7]], None, [0, 1])
    assert batch.tgt_in.shape == batch.tgt_out.shape == (2, 0)
    assert batch.num_tgt_tokens == 0
    assert torch.equal(batch.src, torch.tensor([[5, 2, 0], [6, 7, 2]]))


def test_batch_to_moves_every_tensor():
    batch = make_batch([[5]], [[6]], [0])
    moved = batch.to("meta")
    assert isinstance(moved, Batch)
    assert all(t.device.type == "meta" for t in vars(moved).values())
    assert batch.src.device.type == "cpu"


def test_pack_by_tokens_counts_padding_and_keeps_order():
    sizes = np.array([2, 3, 3, 4, 9, 2])  # a pair larger than max_tokens gets a batch alone
    assert pack_by_tokens(sizes, max_tokens=8).tolist() == [0, 2, 4, 5, 6]


def greedy_packing(sizes, max_tokens):
    """The packing rule written pair by pair: add a pair while count x largest fits."""
    bounds, count, largest = [0], 0, 0
    for position, size in enumerate(sizes):
        if count and (count + 1) * max(largest, size) > max_tokens:
            bounds.append(position)
            count, largest = 0, 0
        count, largest = count + 1, max(largest, size)
    return [*bounds, len(sizes)]


@pytest.mark.parametrize("max_tokens", [7, 64, 1000])
def test_pack_by_tokens_equals_the_pair_by_pair_rule(max_tokens):
    rng = np.random.default_rng()
    sizes = np.sort(rng.integers(2, 90, size=int(rng.integers(1, 3000))))
    sizes[rng.random(len(sizes)) < 0.2] += rng.integers(0, 30)  # not quite sorted, as real data
    assert pack_by_tokens(sizes, max_tokens).tolist() == greedy_packing(sizes.tolist(), max_tokens)


OVER_LONG = 300  # longer than MAX_TOKENS below: must still be batched, alone
MAX_TOKENS = 256


def as_lists(tokens: TokenArray) -> list[list[int]]:
    return [tokens[i].tolist() for i in range(len(tokens))]


@pytest.fixture(scope="module")
def synthetic():
    rng = random.Random(0)
    src = [[rng.randrange(4, 90) for _ in range(rng.randint(1, 60))] for _ in range(499)]
    tgt = [[rng.randrange(4, 90) for _ in range(rng.randint(1, 60))] for _ in range(499)]
    return EncodedCorpus.from_lists([*src, [7] * OVER_LONG], [*tgt, [8] * 5], dropped=0)


def padded_size(batch):
    return batch.src.shape[0] * max(batch.src.shape[1], batch.tgt_in.shape[1])


def test_every_pair_once_per_epoch_within_max_tokens(synthetic):
    batches = TokenBatches(synthetic, MAX_TOKENS)
    seen = []
    for batch in batches.iterate(epoch=1):
        seen += batch.indices.tolist()
        if len(batch.indices) > 1:
            assert padded_size(batch) <= MAX_TOKENS
        else:
            assert padded_size(batch) <= MAX_TOKENS or batch.indices.tolist() == [499]
        for row, i in enumerate(batch.indices.tolist()):  # rows are the right pairs
            assert batch.src[row, : len(synthetic.src[i])].tolist() == synthetic.src[i].tolist()
            assert batch.tgt_out[row, : len(synthetic.tgt[i])].tolist() == synthetic.tgt[i].tolist()
    assert sorted(seen) == list(range(500))
    assert [499] in [batch.tolist() for batch in batches.epoch_batches(1)]
    assert len(batches) == len(batches.epoch_batches(1))


def test_batches_are_bucketed_by_length(synthetic):
    batches = TokenBatches(synthetic, MAX_TOKENS, shuffle=False).epoch_batches(1)
    src_lengths = [synthetic.src.lengths[i] for batch in batches for i in batch]
    assert src_lengths == sorted(src_lengths)
    assert len(batches) < 500 / 3  # packed, not one pair per batch


def epoch(batches: TokenBatches, number: int) -> list[list[int]]:
    return [batch.tolist() for batch in batches.epoch_batches(number)]


def test_epoch_order_is_deterministic_per_seed_and_epoch(synthetic):
    first = TokenBatches(synthetic, MAX_TOKENS, seed=1)
    assert epoch(first, 3) == epoch(TokenBatches(synthetic, MAX_TOKENS, seed=1), 3)
    assert epoch(first, 3) != epoch(first, 4)
    assert epoch(first, 3) != epoch(TokenBatches(synthetic, MAX_TOKENS, seed=2), 3)
    assert sorted(epoch(first, 3)) == sorted(epoch(first, 4))  # same batches


def test_two_ranks_share_the_epoch_with_equal_counts(synthetic):
    single = epoch(TokenBatches(synthetic, MAX_TOKENS), 2)
    ranks = [TokenBatches(synthetic, MAX_TOKENS, rank=r, world_size=2) for r in (0, 1)]
    rank0, rank1 = (epoch(r, 2) for r in ranks)
    assert len(rank0) == len(rank1) == len(ranks[0]) == len(ranks[1]) == (len(single) + 1) // 2
    interleaved = [batch for pair in zip(rank0, rank1, strict=True) for batch in pair]
    # The single-process order, padded to an even count by repeating its first batch.
    assert interleaved == (single + single[:1])[: len(interleaved)]
    assert len(interleaved) in (len(single), len(single) + 1)


def test_equal_lengths_are_grouped_by_the_seed_not_by_position():
    same_length = EncodedCorpus.from_lists([[7, 7]] * 40, [[8, 8]] * 40)
    seed1, seed2 = (
        epoch(TokenBatches(same_length, 30, seed=seed, shuffle=False), 1) for seed in (1, 2)
    )
    assert seed1 == epoch(TokenBatches(same_length, 30, seed=1, shuffle=False), 1)
    assert seed1 != seed2
    assert seed1[0] != list(range(10))


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_ranks_pad_an_uneven_epoch_by_repeating_batches(world_size):
    five_batches = EncodedCorpus.from_lists([[7] * 9] * 5, [[8] * 9] * 5)  # 10 tokens: one a batch
    single = epoch(TokenBatches(five_batches, 10), 1)
    ranks = [
        TokenBatches(five_batches, 10, rank=r, world_size=world_size) for r in range(world_size)
    ]
    steps = -(-5 // world_size)  # ceil: every rank runs the same number of steps
    assert [len(rank) for rank in ranks] == [steps] * world_size
    per_rank = [epoch(rank, 1) for rank in ranks]
    assert [len(batches) for batches in per_rank] == [steps] * world_size
    interleaved = [per_rank[r][step] for step in range(steps) for r in range(world_size)]
    assert interleaved == [single[i % 5] for i in range(steps * world_size)]


def test_resume_mid_epoch_yields_the_remaining_batches(synthetic):
    batches = TokenBatches(synthetic, MAX_TOKENS, rank=1, world_size=2)
    full = list(batches.iterate(epoch=5))
    resumed = list(batches.iterate(epoch=5, start=7))
    assert len(resumed) == len(full) - 7
    for expected, got in zip(full[7:], resumed, strict=True):
        assert vars(expected).keys() == vars(got).keys()
        assert all(torch.equal(vars(expected)[k], vars(got)[k]) for k in vars(expected))


def test_invalid_rank(synthetic):
    with pytest.raises(ValueError):
        TokenBatches(synthetic, MAX_TOKENS, rank=2, world_size=2)


def test_real_batches_decode_to_the_target_text(vocab, train_slice):
    pairs = ParallelCorpus(train_slice.src[:300], train_slice.tgt[:300], "slice")
    encoded = encode_corpus(pairs, vocab)
    assert encoded.dropped == 0
    batch = next(TokenBatches(encoded, 1024).iterate(epoch=1))
    expected = [" ".join(pairs.tgt[i].split()) for i in batch.indices.tolist()]
    assert vocab.decode(batch.tgt_out.tolist()) == expected
    assert vocab.decode(batch.tgt_in[:, 1:].tolist()) == expected  # bos, then the same text


# --- token arrays and their files ---------------------------------------------------------------


def random_sequences(rng, count, *, longest=40, vocab=9000):
    return [
        rng.integers(4, vocab, size=int(rng.integers(0, longest))).tolist() for _ in range(count)
    ]


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


def write_mapped(directory, sequences, dtype="<u2"):
    """A TokenArray's three files, as fastnmt.preprocess writes them, mapped back."""
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


def test_collate_from_arrays_equals_make_batch_from_lists():
    rng = np.random.default_rng()
    src = [[*s, 5] for s in random_sequences(rng, 37)]  # a source is never empty
    tgt = random_sequences(rng, 37)
    rows = rng.permutation(37)[:23]
    from_lists = make_batch([src[r] for r in rows], [tgt[r] for r in rows], rows.tolist())
    corpus = EncodedCorpus.from_lists(src, tgt)
    from_arrays = data.collate(corpus.src, corpus.tgt, rows, rows)
    for name, expected in vars(from_lists).items():
        assert torch.equal(getattr(from_arrays, name), expected), name
    width = from_lists.tgt_out.shape[1]
    positions = [r * width + c for r, row in enumerate(rows) for c in range(len(tgt[row]) + 1)]
    assert from_lists.tgt_positions.tolist() == positions


def test_a_worker_collates_the_same_batches_and_the_global_rng_is_untouched(synthetic):
    in_process = TokenBatches(synthetic, MAX_TOKENS, seed=3)
    worker = TokenBatches(synthetic, MAX_TOKENS, seed=3, workers=1)
    state = torch.get_rng_state()
    for first in (0, 5):  # a second pass of the same worker, resuming mid-epoch
        expected, got = list(in_process.iterate(2, first)), list(worker.iterate(2, first))
        assert len(expected) == len(got) == len(in_process) - first
        for a, b in zip(expected, got, strict=True):
            assert all(torch.equal(getattr(a, k), getattr(b, k)) for k in vars(a))
    assert torch.equal(torch.get_rng_state(), state)  # a DataLoader's seed comes from its own
    worker.close()


def test_batches_over_a_mapped_corpus_cover_it_once(synthetic, tmp_path):
    sides = []
    for side in ("src", "tgt"):
        (tmp_path / side).mkdir()
        sides.append(write_mapped(tmp_path / side, as_lists(getattr(synthetic, side))))
    mapped = EncodedCorpus(*sides, dropped=0)
    expected = epoch(TokenBatches(synthetic, MAX_TOKENS, seed=5, world_size=3, rank=2), 4)
    batches = TokenBatches(mapped, MAX_TOKENS, seed=5, world_size=3, rank=2, workers=1)
    assert epoch(batches, 4) == expected
    got = list(batches.iterate(4))
    assert [b.indices.tolist() for b in got] == expected
    for batch in got:
        for row, i in enumerate(batch.indices.tolist()):
            assert batch.src[row, : len(synthetic.src[i])].tolist() == synthetic.src[i].tolist()
