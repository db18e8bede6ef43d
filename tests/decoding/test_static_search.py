"""The static search against ``fastnmt.decoding.search``: the same hypotheses from fixed-shape
programs, buckets reused across batches, no host sync inside a step, the translator's choice, and
(on a GPU) captured graphs replaying what calls compute."""

from dataclasses import replace

import pytest
import torch

from fastnmt.decoding import static_search
from fastnmt.decoding.next_token import Sampling
from fastnmt.decoding.search import LengthPenalty, Rules, beam_search, sample
from fastnmt.decoding.static_search import CHECK_EVERY, StaticSearches, graph_reasons
from fastnmt.model import ModelConfig, Transformer
from fastnmt.translator import Translator
from tests.helpers import count_host_syncs, tiny_checkpoint
from tests.test_translator import SENTENCES

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _model(vocab_size: int, prenorm: bool = True) -> Transformer:
    cfg = ModelConfig(
        vocab_size=vocab_size, d_model=32, heads=2, d_ff=64, encoder_layers=1,
        decoder_layers=2, prenorm=prenorm,
    )  # fmt: skip
    model = Transformer(cfg).eval()
    with torch.no_grad():  # larger logits than at initialisation: peaked, varied choices
        model.embedding.weight.mul_(4.0)
    return model.to(DEVICE)


def _batch(cfg: ModelConfig, count: int, shortest: int = 1):
    """Host tensors: random sources ending with eos, their lengths, random length limits."""
    lengths = torch.randint(1, 12, (count,))
    src = torch.full((count, int(lengths.max())), cfg.pad_id)
    for row, length in enumerate(lengths.tolist()):
        src[row, : length - 1] = torch.randint(3, cfg.vocab_size, (length - 1,))
        src[row, length - 1] = cfg.eos_id
    return src, lengths, torch.randint(shortest, 20, (count,))


def _same(found, expected) -> None:
    """Hypotheses equal token for token, scores up to GEMM rounding over other batch shapes."""
    assert len(found) == len(expected)
    for got, want in zip(found, expected, strict=True):
        assert [h.tokens for h in got] == [h.tokens for h in want]
        assert [h.ended for h in got] == [h.ended for h in want]
        assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-4)


def _reference(model, src, lengths, max_lens, **options):
    device = model.embedding.weight.device
    return beam_search(model, src.to(device), lengths.to(device), max_lens, **options)


SETTINGS = {
    "greedy": dict(beam=1),
    "beam 4 n-best 4": dict(beam=4, nbest=4),
    "two words": dict(vocab_size=5, beam=3, nbest=3),  # ties and early ends galore
    "prefix, GNMT penalty": dict(beam=2, nbest=2, prefix=(7,), penalty=LengthPenalty(alpha=0.6)),
    "no eos, raw scores": dict(beam=3, eos=False, penalty=LengthPenalty(0.0)),
    "post-norm": dict(prenorm=False, beam=5, nbest=2),
    "no repeated bigrams": dict(beam=3, nbest=3, rules=Rules(no_repeat_ngram=2)),
    "greedy, no repeated words": dict(beam=1, rules=Rules(no_repeat_ngram=1)),
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_hypotheses_equal_the_beam_search(setting):
    options = dict(SETTINGS[setting])
    model = _model(options.pop("vocab_size", 50), options.pop("prenorm", True))
    options.setdefault("penalty", LengthPenalty())
    searches = StaticSearches(model, capture=False)
    for count in (1, 7, 3):  # buckets of 1, 8 and 4 slots
        batch = _batch(model.cfg, count, shortest=len(options.get("prefix", ())) + 1)
        _same(searches.search(*batch, **options), _reference(model, *batch, **options))


@pytest.mark.parametrize("beam", [1, 3])
def test_forced_prefixes_give_what_the_beam_search_gives(beam):
    """Per-sentence prefixes of different lengths (some none) in buckets of 8 and 4 slots, after
    a shared forced prefix, with repeated trigrams banned."""
    model = _model(50)
    searches = StaticSearches(model, capture=False)
    for count in (7, 3):
        lengths = torch.randint(0, 4, (count,)).tolist()
        prefixes = [torch.randint(3, 50, (n,)).tolist() for n in lengths]
        src, src_lengths, _ = _batch(model.cfg, count)
        max_lens = torch.tensor(lengths) + torch.randint(2, 12, (count,))
        options = dict(
            beam=beam, nbest=beam, prefix=(7,), penalty=LengthPenalty(),
            rules=Rules(prefixes=prefixes, no_repeat_ngram=3),
        )  # fmt: skip
        found = searches.search(src, src_lengths, max_lens, **options)
        _same(found, _reference(model, src, src_lengths, max_lens, **options))
        for hypotheses, prefix in zip(found, prefixes, strict=True):
            assert all(h.tokens[1 : 1 + len(prefix)] == prefix for h in hypotheses)
    for search in searches.searches.values():  # the rules are device work too
        with torch.inference_mode(), count_host_syncs(none_allowed=True) as syncs:
            search.step()
        assert syncs.names == []


def test_a_bucket_serves_every_batch_that_fits_it():
    """One bucket's state is reset for each batch: batches of 5, 8 and 6 sentences (one bucket
    of 8) give what separate searches give."""
    model = _model(50)
    searches = StaticSearches(model, capture=False)
    for count in (5, 8, 6):
        batch = _batch(model.cfg, count)
        _same(searches.search(*batch, beam=3, penalty=LengthPenalty()), _reference(
            model, *batch, beam=3
        ))  # fmt: skip
    assert len(searches.searches) == 1


def test_a_step_makes_no_host_sync_and_a_search_one_every_few_steps():
    model = _model(50)
    searches = StaticSearches(model, capture=False)
    src, lengths, _ = _batch(model.cfg, 4)
    max_lens = torch.full((4,), 17)
    # eos banned: no sentence ends early, every check finds work left
    searches.search(src, lengths, max_lens, beam=2, eos=False, penalty=LengthPenalty())
    [search] = searches.searches.values()
    with torch.inference_mode(), count_host_syncs(none_allowed=True) as syncs:
        search.step()
    assert syncs.names == []
    with torch.inference_mode(), count_host_syncs() as syncs:
        search.run(17)
    checks = len(range(CHECK_EVERY, 17, CHECK_EVERY))  # before steps 4, 8, 12 and 16
    assert syncs.names == ["__bool__"] * checks


def test_arguments_are_checked_and_an_empty_batch_is_no_work():
    model = _model(50)
    searches = StaticSearches(model, capture=False)
    src, lengths, max_lens = _batch(model.cfg, 2)
    with pytest.raises(ValueError, match="nbest must be between 1 and beam"):
        searches.search(src, lengths, max_lens, beam=2, nbest=3, penalty=LengthPenalty())
    empty = torch.zeros(0, 0, dtype=torch.long)
    none = torch.zeros(0, dtype=torch.long)
    assert searches.search(empty, none, none, beam=2, penalty=LengthPenalty()) == []


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("checkpoint"))


def test_the_translator_searches_statically_on_cuda_and_gives_the_same_translations(
    checkpoint_dir,
):
    dynamic = Translator.from_checkpoint(checkpoint_dir, precision="fp32", static=False)
    static = Translator.from_checkpoint(checkpoint_dir, precision="fp32", static=True)
    auto = Translator.from_checkpoint(checkpoint_dir, precision="fp32")
    assert (auto.static is not None) == (auto.device.type == "cuda")
    for options in (dict(beam=1), dict(beam=4, nbest=2, max_len_a=0.5)):
        want = dynamic.translate_full(SENTENCES, **options)
        got = static.translate_full(SENTENCES, **options)
        assert [[c.text for c in t.candidates] for t in got] == [
            [c.text for c in t.candidates] for t in want
        ]
    with pytest.raises(ValueError, match="no shortlist"):
        Translator(dynamic.model, dynamic.vocab, static=True, shortlist=object())


def test_captured_graphs_replay_what_calls_compute():
    """On CUDA each bucket's two programs are captured and replay the calls' results; elsewhere
    the reason capture is refused names the device."""
    if DEVICE.type != "cuda":
        assert graph_reasons(DEVICE) == ["CUDA graphs need a CUDA device, got cpu"]
        return
    model = _model(50)
    called, captured = StaticSearches(model, capture=False), StaticSearches(model, capture=True)
    for count in (6, 3, 8):
        batch = _batch(model.cfg, count)
        options = dict(beam=4, nbest=2, penalty=LengthPenalty())
        _same(captured.search(*batch, **options), called.search(*batch, **options))
    assert all(s.step.graph is not None for s in captured.searches.values())


def test_searches_are_bounded_least_recently_used_first(monkeypatch):
    """A model keeps at most MAX_SEARCHES buckets (their caches and graphs); a search used
    again is kept over older ones, and one dropped is rebuilt with the same results."""
    monkeypatch.setattr(static_search, "MAX_SEARCHES", 2)
    model = _model(vocab_size=23)
    searches = StaticSearches(model, capture=False)
    options = dict(beam=2, penalty=LengthPenalty())
    batches = {count: _batch(model.cfg, count) for count in (1, 2, 3)}  # buckets of 1, 2, 4
    first = searches.search(*batches[1], **options)
    searches.search(*batches[2], **options)
    kept = searches.searches[next(iter(searches.searches))]
    searches.search(*batches[1], **options)  # used again: now the most recent
    searches.search(*batches[3], **options)  # drops bucket 2, the least recently used
    assert [key[0][0] for key in searches.searches] == [1, 4]
    assert searches.searches[next(iter(searches.searches))] is kept
    _same(searches.search(*batches[1], **options), first)


SAMPLINGS = {
    "unrestricted": Sampling(samples=3),
    "top 5, hot": Sampling("topk", topk=5, temperature=2.0, samples=2),
    "nucleus 0.8": Sampling("topp", topp=0.8, temperature=1.5),
}


@pytest.mark.parametrize("setting", SAMPLINGS)
def test_samples_equal_the_dynamic_search_s(setting):
    """Seeded, the static search draws what ``search.sample`` draws for the same streams, in a
    bucket reused by batches of 5, 8 and 3 sentences."""
    model = _model(50)
    searches = StaticSearches(model, capture=False)
    for count, seed in ((5, 1), (8, 2), (3, 3)):
        src, lengths, max_lens = _batch(model.cfg, count)
        streams = torch.randperm(100)[:count]  # the sentences' lines in some input
        sampling = replace(SAMPLINGS[setting], seed=seed)
        options = dict(sampling=sampling, streams=streams, penalty=LengthPenalty())
        n = sampling.samples
        expected = sample(model, src.to(DEVICE), lengths.to(DEVICE), max_lens, **options)
        _same(searches.search(src, lengths, max_lens, beam=1, nbest=n, **options), expected)
    assert all(s.sampling.seed is None for s in searches.searches.values())  # serve any seed


def test_a_replayed_sampling_step_draws_afresh_without_a_host_sync():
    """The random numbers are a function of device tensors the programs advance: each step of
    one bucket draws new ones, and each unseeded search too."""
    model = _model(50)
    with torch.no_grad():  # back to the initial, flat distributions: varied draws
        model.embedding.weight.div_(4.0)
    searches = StaticSearches(model, capture=False)
    src, lengths, _ = _batch(model.cfg, 4)
    max_lens = torch.full((4,), 17)
    options = dict(beam=1, nbest=2, penalty=LengthPenalty(), eos=False)
    hot = Sampling(samples=2)
    runs = [searches.search(src, lengths, max_lens, sampling=hot, **options) for _ in range(2)]
    assert [[h.tokens for h in s] for s in runs[0]] != [[h.tokens for h in s] for s in runs[1]]
    [search] = searches.searches.values()
    with torch.inference_mode(), count_host_syncs(none_allowed=True) as syncs:
        search.step()
    assert syncs.names == []
    drawn = search.history[0, 1:17].tolist()  # a row's 16 steps, each a fresh number
    assert len(set(drawn)) > 3, "the same token drawn at every step"


def test_sampling_replays_in_captured_graphs_as_called():
    """On CUDA captured sampling replays what calls draw; elsewhere capture is refused with
    the device as its reason."""
    if DEVICE.type != "cuda":
        assert graph_reasons(DEVICE) == ["CUDA graphs need a CUDA device, got cpu"]
        return
    model = _model(50)
    called, captured = StaticSearches(model, capture=False), StaticSearches(model, capture=True)
    for count, seed in ((6, 1), (3, 2), (8, 3)):
        batch = _batch(model.cfg, count)
        options = dict(beam=1, nbest=2, penalty=LengthPenalty())
        sampling = Sampling("topk", topk=8, samples=2, seed=seed)
        _same(
            captured.search(*batch, sampling=sampling, **options),
            called.search(*batch, sampling=sampling, **options),
        )
    assert all(s.step.graph is not None for s in captured.searches.values())
