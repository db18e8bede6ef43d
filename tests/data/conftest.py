"""Fixtures of the fastnmt.data tests: Multi30k found as the package finds it (tests/conftest.py:
the shared local copy when present) and a vocabulary trained on a slice of it, once per session."""

import pytest

from fastnmt.data import ParallelCorpus, Vocabulary, load_multi30k, multi30k_dir

TRAIN_SLICE = 3000  # enough text for a meaningful vocabulary, quick to train on


@pytest.fixture(scope="session")
def multi30k_path():
    return multi30k_dir()


@pytest.fixture(scope="session")
def train_slice(multi30k_path):
    corpus = load_multi30k("train", "en", "de", data_dir=multi30k_path)
    return ParallelCorpus(corpus.src[:TRAIN_SLICE], corpus.tgt[:TRAIN_SLICE], "train slice")


@pytest.fixture(scope="session")
def vocab(train_slice):
    return Vocabulary.train(train_slice.src + train_slice.tgt, vocab_size=1000)
