"""fastnmt.data.vocabulary: the joint sentencepiece vocabulary."""

import pytest

from fastnmt.data import (
    DataError,
    Vocabulary,
    vocabulary,
)
from tests.data.helpers import one_line_error, write


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


def test_a_long_list_is_tokenized_as_each_of_its_texts(vocab, train_slice):
    """Lists past _THREADED go to sentencepiece in one threaded call, shorter ones a text at a
    time: the same ids and texts either way, in order, blank texts included."""
    sentences = [*train_slice.src[: vocabulary._THREADED + 37], "", "A dog."]
    assert len(sentences) > vocabulary._THREADED
    ids = vocab.encode(sentences)
    assert ids == [vocab.encode([sentence])[0] for sentence in sentences]
    assert ids[-2] == [] and vocab.encode([]) == []
    assert vocab.decode(ids) == [vocab.decode([sequence])[0] for sequence in ids]
    assert vocab.decode([]) == []


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
