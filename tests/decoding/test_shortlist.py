"""fastnmt.decoding.shortlist and ``python -m fastnmt.shortlist``: the lists follow p(t | s) on a
hand-made corpus, a batch's vocabulary is their union, files round-trip and refuse other
vocabularies, the search and the Translator score only listed words (and a full list changes
nothing), and the CLI."""

import pytest
import torch

from fastnmt import shortlist
from fastnmt.data import DataError, EncodedCorpus, Vocabulary
from fastnmt.data.prepared import Options, Source, prepare
from fastnmt.decoding import shortlist as shortlists
from fastnmt.decoding.next_token import Sampling
from fastnmt.decoding.search import Rules, beam_search, greedy, sample
from fastnmt.decoding.shortlist import Shortlist
from fastnmt.quantize import quantize_int8
from fastnmt.translate import main as translate_main
from fastnmt.translator import Translator, load_checkpoint
from tests.helpers import tiny_checkpoint

# (source ids, target ids) pairs; 20 is the most frequent target (3 times).
PAIRS = [
    ([10, 11], [20, 21]),
    ([10], [20, 22]),
    ([10, 12], [20, 30]),
    ([11], [21, 40]),
    ([13, 13], [50, 50, 51]),  # repeats count once per pair
]
EXPECTED_LISTS = {  # per_token=2, frequent=1 (20): by p(t | s), ties to the lower id
    10: [21, 22],  # 21, 22, 30 once each in 3 pairs
    11: [21, 40],  # 21 in both of its pairs
    12: [30, -1],
    13: [50, 51],
}


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("checkpoint"))


@pytest.fixture(scope="module")
def vocab(checkpoint_dir) -> Vocabulary:
    return load_checkpoint(checkpoint_dir)[1]


def _corpus(pairs=PAIRS) -> EncodedCorpus:
    return EncodedCorpus.from_lists([s for s, _ in pairs], [t for _, t in pairs])


@pytest.mark.parametrize("chunk", [2, 2048])
def test_lists_follow_p_of_target_given_source(vocab, chunk, monkeypatch):
    monkeypatch.setattr(shortlists, "_PAIRS_PER_CHUNK", chunk)  # counts merged across chunks
    built = Shortlist.build(_corpus(), vocab, frequent=1, per_token=2)
    assert built.frequent.tolist() == [20]
    assert built.candidates.shape == (len(vocab), 2)
    for source in range(len(vocab)):
        assert built.candidates[source].tolist() == EXPECTED_LISTS.get(source, [-1, -1])


def test_a_sample_of_pairs_lists_only_what_the_sample_has(vocab):
    built = Shortlist.build(_corpus(), vocab, frequent=0, per_token=4, max_pairs=1, seed=3)
    listed = {(s, t) for s in range(len(vocab)) for t in built.candidates[s].tolist() if t >= 0}
    assert any(listed == {(s, t) for s in src for t in tgt} for src, tgt in PAIRS)


def test_a_batch_vocabulary_is_the_frequent_words_and_its_sources_lists(vocab):
    built = Shortlist.build(_corpus(), vocab, frequent=1, per_token=2)
    src = torch.tensor([[12, 13, 0], [12, 99, 0]])  # padding and an unlisted token too
    assert built.vocabulary(src).tolist() == [20, 30, 50, 51]


def test_file_round_trip_and_one_line_refusals(vocab, tmp_path):
    built = Shortlist.build(_corpus(), vocab, frequent=1, per_token=2)
    built.save(tmp_path / "list.st")
    loaded = Shortlist.load(tmp_path / "list.st", vocab)
    assert torch.equal(loaded.frequent, built.frequent)
    assert torch.equal(loaded.candidates, built.candidates)
    other = Vocabulary.train([f"word{i} other{i}" for i in range(300)] * 3, len(vocab))
    (tmp_path / "junk.st").write_bytes(b"not safetensors")
    for path, words, message in (
        (tmp_path / "missing.st", vocab, "No such file"),
        (tmp_path / "junk.st", vocab, "not a safetensors file"),
        (tmp_path / "list.st", other, "another vocabulary"),
    ):
        with pytest.raises(DataError, match=message) as raised:
            Shortlist.load(path, words)
        assert "\n" not in str(raised.value)


def _full(vocab) -> Shortlist:
    """A shortlist that lists every word."""
    everything = torch.arange(len(vocab))
    return Shortlist(everything, everything[:, None].clone(), shortlists._sha256(vocab))


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
@torch.no_grad()
def test_the_output_layer_of_a_vocabulary_is_those_columns(checkpoint_dir, int8):
    model = load_checkpoint(checkpoint_dir)[0].eval()
    if int8:
        quantize_int8(model)
    states = torch.randn(7, model.cfg.d_model)
    ids = torch.tensor([2, 5, 17, 40, 41])
    listed, full = model.output_layer(ids)(states), model.output_layer()(states)[:, ids]
    if int8:  # exact int32 sums, per-channel scales: the same numbers
        assert torch.equal(listed, full)
    else:  # a GEMM of other width may sum in another order
        torch.testing.assert_close(listed, full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("beam", [1, 3])
def test_search_scores_only_listed_words_and_a_full_list_changes_nothing(
    checkpoint_dir, vocab, beam
):
    model = load_checkpoint(checkpoint_dir)[0].eval()
    src = torch.tensor([[5, 9, 14, 2], [7, 30, 2, 0]])
    lengths, max_lens = torch.tensor([4, 3]), torch.tensor([6, 5])
    search = (lambda **o: greedy(model, src, lengths, max_lens, **o)) if beam == 1 else (
        lambda **o: beam_search(model, src, lengths, max_lens, beam=beam, nbest=beam, **o)
    )  # fmt: skip
    assert search(shortlist=_full(vocab)) == search()
    small = Shortlist(torch.tensor([4, 6]), torch.full((len(vocab), 1), 8), "")
    for found in search(shortlist=small):
        for hypothesis in found if beam > 1 else [found]:
            assert set(hypothesis.tokens) <= {4, 6, 8}


def test_translator_and_cli_take_a_shortlist_file(checkpoint_dir, vocab, tmp_path, capsys):
    _full(vocab).save(tmp_path / "full.st")
    plain = Translator.from_checkpoint(checkpoint_dir, precision="fp32")
    listed = Translator.from_checkpoint(
        checkpoint_dir, precision="fp32", shortlist=tmp_path / "full.st"
    )
    sentences = ["A dog runs.", "Two men."]
    assert listed.translate(sentences) == plain.translate(sentences)
    missing = ["--checkpoint", str(checkpoint_dir), "--shortlist", str(tmp_path / "no.st")]
    assert translate_main(missing) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "shortlist: No such file" in error[0]


def test_cli_builds_from_a_prepared_directory(corpus, tmp_path, capsys):
    source = Source((corpus / "train.en", corpus / "train.de"), str(corpus / "train"))
    options = Options(vocab_size=300)
    prepared = prepare(source, tmp_path / "prepared", options, workers=1)
    output = tmp_path / "list.st"
    argv = ["--prepared-dir", str(tmp_path / "prepared"), "--output", str(output)]
    assert shortlist.main([*argv, "--frequent", "20", "--per-token", "5"]) == 0
    loaded = Shortlist.load(output, prepared.vocab)
    assert loaded.frequent.shape == (20,) and loaded.candidates.shape == (300, 5)
    assert "20 frequent targets" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        shortlist.main(["--prepared-dir", str(tmp_path / "nothing"), "--output", str(output)])
    assert exited.value.code == 2
    assert "no prepared data" in capsys.readouterr().err


def test_sampling_prefixes_and_repeated_ngrams_with_a_shortlist(checkpoint_dir, vocab):
    """Forced prefixes join the batch's scored words; sampling draws only those; n-grams are
    banned by column."""
    model = load_checkpoint(checkpoint_dir)[0].eval()
    src = torch.tensor([[5, 9, 14, 2], [7, 30, 2, 0]])
    lengths, max_lens = torch.tensor([4, 3]), torch.tensor([8, 8])
    small = Shortlist(torch.tensor([4, 6]), torch.full((len(vocab), 1), 8), "")
    rules = Rules(prefixes=[[10, 11], [12]], no_repeat_ngram=1)
    found = sample(
        model, src, lengths, max_lens, sampling=Sampling(samples=3), shortlist=small, rules=rules
    )
    for hypotheses, prefix in zip(found, rules.prefixes, strict=True):
        for hypothesis in hypotheses:
            tokens = hypothesis.tokens
            listed = {4, 6, 8, 10, 11, 12}  # a batch's words: its lists' and its prefixes'
            assert tokens[: len(prefix)] == prefix and set(tokens[len(prefix) :]) <= listed
            assert len(set(tokens)) == len(tokens)
