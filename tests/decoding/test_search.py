"""Greedy and beam search against independent oracles: the argmax of full recomputation, and the
exhaustive enumeration of every output over a two-word vocabulary."""

import itertools
import math

import pytest
import torch

import fastnmt
from fastnmt.decoding.next_token import Sampling
from fastnmt.decoding.search import LengthPenalty, Rules, beam_search, greedy, sample
from fastnmt.model import ModelConfig, Transformer
from fastnmt.ops.sample_token import MIN_TEMPERATURE
from tests.helpers import TRITON_DEVICE, HostOps, count_host_syncs, require_backend

SMALL = ModelConfig(vocab_size=50, d_model=32, heads=2, d_ff=64, encoder_layers=1, decoder_layers=1)
# pad, bos, eos and two words: few enough outputs to enumerate them all.
TWO_WORDS = ModelConfig(
    vocab_size=5, d_model=32, heads=2, d_ff=64, encoder_layers=1, decoder_layers=2
)
WORDS = (3, 4)


def _model(cfg: ModelConfig) -> Transformer:
    model = Transformer(cfg).eval()
    with torch.no_grad():  # larger logits than at initialisation: peaked, varied choices
        model.embedding.weight.mul_(4.0)
    return model


def _sources(cfg: ModelConfig, lengths=(7, 3, 5, 1)):
    """A padded batch of random source sentences, each ending with eos."""
    src = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, length in enumerate(lengths):
        src[row, : length - 1] = torch.randint(3, cfg.vocab_size, (length - 1,))
        src[row, length - 1] = cfg.eos_id
    return src, torch.tensor(lengths)


@torch.no_grad()
def _log_probs(model, src, src_lengths, row: int, prefixes: list[list[int]]) -> torch.Tensor:
    """(P, L + 1, V) next-token log-probabilities after bos + each prefix of each of the P
    ``prefixes`` (right-padded to L tokens) for sentence ``row``, by one full forward pass (no
    cache); pad and bos are never chosen but stay in the normaliser, as in the searches (and
    fairseq's and transformers')."""
    cfg = model.cfg
    memory = model.encode(src[row : row + 1], src_lengths[row : row + 1])
    width = max(map(len, prefixes))
    tgt_in = torch.tensor([[cfg.bos_id, *p] + [cfg.pad_id] * (width - len(p)) for p in prefixes])
    states = model.decode(tgt_in, memory, src_lengths[row : row + 1])  # K = P rows per sentence
    log_probs = model.logits(states).log_softmax(-1)
    log_probs[..., [cfg.pad_id, cfg.bos_id]] = float("-inf")
    return log_probs


def _sequence_log_probs(model, src, src_lengths, row: int, outputs) -> list[float]:
    log_probs = _log_probs(model, src, src_lengths, row, [ids[:-1] for ids in outputs])
    return [
        sum(log_probs[i, t, token].item() for t, token in enumerate(ids))
        for i, ids in enumerate(outputs)
    ]


def _all_outputs(max_len: int, eos_id: int) -> list[list[int]]:
    """Every output of at most max_len tokens: words then eos, or max_len words (truncated)."""
    ended = [[*w, eos_id] for n in range(max_len) for w in itertools.product(WORDS, repeat=n)]
    return ended + [list(w) for w in itertools.product(WORDS, repeat=max_len)]


def _brute_force(model, src, src_lengths, row, max_len, penalty) -> list[tuple[list[int], float]]:
    """(tokens without eos, score) of every possible output, best first."""
    outputs = _all_outputs(max_len, model.cfg.eos_id)
    log_probs = _sequence_log_probs(model, src, src_lengths, row, outputs)
    scored = [
        ([t for t in ids if t != model.cfg.eos_id], log_prob / penalty(len(ids)))
        for ids, log_prob in zip(outputs, log_probs, strict=True)
    ]
    return sorted(scored, key=lambda item: item[1], reverse=True)


def test_greedy_equals_argmax_of_full_recomputation_and_beam_1():
    model = _model(SMALL)
    src, src_lengths = _sources(SMALL)
    max_lens = torch.tensor([6, 6, 3, 6])
    hypotheses = greedy(model, src, src_lengths, max_lens)
    for row, hypothesis in enumerate(hypotheses):
        prefix = []
        while len(prefix) < max_lens[row] and SMALL.eos_id not in prefix:
            log_probs = _log_probs(model, src, src_lengths, row, [prefix])
            prefix.append(log_probs[0, -1].argmax().item())
        assert hypothesis.tokens == [t for t in prefix if t != SMALL.eos_id]
        [log_prob] = _sequence_log_probs(model, src, src_lengths, row, [prefix])
        assert hypothesis.log_prob == pytest.approx(log_prob, abs=1e-4)
    assert {len(h.tokens) for h in hypotheses} != {0}, "a test of nothing: all outputs empty"
    beam_1 = beam_search(model, src, src_lengths, max_lens, beam=1)
    assert [b[0].tokens for b in beam_1] == [h.tokens for h in hypotheses]
    assert [b[0].score for b in beam_1] == pytest.approx([h.score for h in hypotheses], abs=1e-5)


PENALTIES = [LengthPenalty(0.0), LengthPenalty(1.0), LengthPenalty(2.0), LengthPenalty(alpha=0.6)]


@pytest.mark.parametrize("penalty", PENALTIES)
def test_wide_beam_finds_every_output_in_brute_force_order(penalty):
    """With a beam as wide as the number of outputs (31 of at most 4 tokens over 2 words), beam
    search is exhaustive: its n-best list is the brute-force ranking, scores included."""
    model = _model(TWO_WORDS)
    src, src_lengths = _sources(TWO_WORDS, lengths=(4, 2))
    max_len = 4
    nbest = beam_search(
        model, src, src_lengths, torch.tensor([max_len] * 2), beam=32, nbest=31, penalty=penalty
    )
    for row, hypotheses in enumerate(nbest):
        expected = _brute_force(model, src, src_lengths, row, max_len, penalty)
        assert [h.tokens for h in hypotheses] == [tokens for tokens, _ in expected]
        assert [h.score for h in hypotheses] == pytest.approx([s for _, s in expected], abs=1e-4)


def test_narrow_beam_scores_its_outputs_exactly_and_ranks_them():
    model = _model(TWO_WORDS)
    src, src_lengths = _sources(TWO_WORDS, lengths=(4,))
    penalty = LengthPenalty(1.0)
    hypotheses = beam_search(model, src, src_lengths, torch.tensor([5]), beam=3, nbest=3)[0]
    best = _brute_force(model, src, src_lengths, 0, 5, penalty)[0][1]
    scores = [h.score for h in hypotheses]
    assert scores == sorted(scores, reverse=True) and scores[0] <= best + 1e-5
    for h in hypotheses:
        ids = h.tokens + ([TWO_WORDS.eos_id] if len(h.tokens) < 5 else [])
        [log_prob] = _sequence_log_probs(model, src, src_lengths, 0, [ids])
        assert h.log_prob == pytest.approx(log_prob, abs=1e-4)
        assert h.score == pytest.approx(log_prob / penalty(len(ids)), abs=1e-4)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("name", ["lenpen", "alpha"])
def test_a_length_penalty_is_a_finite_number(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a finite number, got {value}"):
        LengthPenalty(**{name: value})


def test_length_penalty_formulas_and_effect():
    assert LengthPenalty(0.0)(7) == 1.0 and LengthPenalty(1.0)(7) == 7.0
    assert LengthPenalty(0.5)(4) == 2.0
    assert LengthPenalty(alpha=1.0)(7) == pytest.approx(2.0)  # (5 + 7) / 6
    model = _model(TWO_WORDS)
    src, src_lengths = _sources(TWO_WORDS, lengths=(4,))
    lengths = []
    for lenpen in (0.0, 5.0):
        found = beam_search(
            model, src, src_lengths, torch.tensor([6]), beam=8, penalty=LengthPenalty(lenpen)
        )
        lengths.append(len(found[0][0].tokens))
    assert lengths[0] < lengths[1], "a larger lenpen must favour a longer output here"


@pytest.mark.parametrize("beam", [1, 3])
def test_batched_search_equals_one_sentence_at_a_time(beam):
    model = _model(SMALL)
    src, src_lengths = _sources(SMALL)
    max_lens = torch.tensor([8, 2, 5, 8])
    batched = beam_search(model, src, src_lengths, max_lens, beam=beam, nbest=beam)
    for row in range(src.shape[0]):
        one = slice(row, row + 1)
        alone = beam_search(
            model, src[one, : src_lengths[row]], src_lengths[one], max_lens[one], beam=beam,
            nbest=beam,
        )[0]  # fmt: skip
        assert [h.tokens for h in batched[row]] == [h.tokens for h in alone]
        assert [h.score for h in batched[row]] == pytest.approx([h.score for h in alone], abs=1e-4)


@pytest.mark.parametrize("beam", [1, 4])
def test_recomputing_the_prefix_equals_the_kv_cache(beam):
    model = _model(SMALL)
    src, src_lengths = _sources(SMALL)
    max_lens = torch.tensor([9, 4, 6, 9])
    cached = beam_search(model, src, src_lengths, max_lens, beam=beam, nbest=beam)
    recomputed = beam_search(
        model, src, src_lengths, max_lens, beam=beam, nbest=beam, incremental=False
    )
    assert [[h.tokens for h in n] for n in cached] == [[h.tokens for h in n] for n in recomputed]
    g_cached = greedy(model, src, src_lengths, max_lens)
    g_recomputed = greedy(model, src, src_lengths, max_lens, incremental=False)
    assert [h.tokens for h in g_cached] == [h.tokens for h in g_recomputed]


def test_without_eos_every_output_has_its_full_length():
    model = _model(SMALL)
    src, src_lengths = _sources(SMALL)
    max_lens = torch.tensor([5, 2, 7, 1])
    for hypotheses in (
        greedy(model, src, src_lengths, max_lens, eos=False),
        [n[0] for n in beam_search(model, src, src_lengths, max_lens, beam=2, eos=False)],
    ):
        assert [len(h.tokens) for h in hypotheses] == max_lens.tolist()


@pytest.mark.parametrize("beam", [1, 3])
def test_each_sentence_is_handed_over_once_as_soon_as_its_search_ends(beam):
    """on_done gets each sentence's final n-best list once, in the order their searches end
    (the shortest length limit first, eos banned), the lists the search returns."""
    model = _model(SMALL)
    src, src_lengths = _sources(SMALL)
    max_lens = torch.tensor([9, 2, 5, 1])
    handed = []

    def on_done(sentence, hypotheses):
        handed.append((sentence, hypotheses))

    if beam == 1:
        found = [[h] for h in greedy(model, src, src_lengths, max_lens, eos=False, on_done=on_done)]
    else:
        found = beam_search(
            model, src, src_lengths, max_lens, beam=beam, nbest=2, eos=False, on_done=on_done
        )
    assert [sentence for sentence, _ in handed] == [3, 1, 2, 0]
    assert dict(handed) == dict(enumerate(found))


def test_beams_share_one_cross_attention_entry_per_sentence():
    """decode with K rows per sentence and per-sentence memory == memory repeated per row."""
    model = _model(SMALL)
    src, src_lengths = _sources(SMALL)
    memory = model.encode(src, src_lengths)
    tgt = torch.randint(3, SMALL.vocab_size, (src.shape[0] * 3, 4))
    shared = model.decode(tgt, memory, src_lengths)
    repeated = model.decode(
        tgt, memory.repeat_interleave(3, 0), src_lengths.repeat_interleave(3, 0)
    )
    torch.testing.assert_close(shared, repeated, atol=1e-5, rtol=1e-5)


def test_the_first_beam_search_step_scores_one_hypothesis_per_sentence(monkeypatch):
    """Its K beams are the same empty prefix: one row each, then K (the results are the
    exhaustive and one-at-a-time searches' above)."""
    model = _model(SMALL)
    src, src_lengths = _sources(SMALL)
    scored_rows = []
    output_layer = model.output_layer

    def counting_output_layer(vocabulary=None):
        layer = output_layer(vocabulary)
        return lambda states: scored_rows.append(states.shape[0]) or layer(states)

    monkeypatch.setattr(model, "output_layer", counting_output_layer)
    beam_search(model, src, src_lengths, torch.full((4,), 5), beam=3, eos=False)
    assert scored_rows == [4, 12, 12, 12, 12]


def test_bad_arguments_are_named():
    model = _model(SMALL)
    src, src_lengths = _sources(SMALL)
    max_lens = torch.tensor([3] * 4)
    for beam in (0, 1.5, True):
        with pytest.raises(ValueError, match=f"beam must be an int >= 1, got {beam!r}"):
            beam_search(model, src, src_lengths, max_lens, beam=beam)
    with pytest.raises(ValueError, match="nbest must be between 1 and beam"):
        beam_search(model, src, src_lengths, max_lens, beam=2, nbest=3)
    with pytest.raises(ValueError, match="max_lens must be"):
        greedy(model, src, src_lengths, torch.tensor([3, 0, 1, 1]))
    with pytest.raises(ValueError, match=r"src must be on the model's device \(cpu\), got meta"):
        greedy(model, src.to("meta"), src_lengths, max_lens)


@pytest.mark.parametrize("layers", [1, 3])
def test_a_beam_search_step_dispatches_a_bounded_number_of_ops(layers):
    """The host work of a decoding step, which eager decoding on a GPU is made of (each op not a
    view is a launch there): aten ops per step of a beam-3 search (steps 6-12, nothing finishing)
    on the C++ kernels, fp32. The layers' self-attention caches share their rows, so a step
    writes and gathers them once, not once per layer."""
    require_backend("cpp")
    cfg = ModelConfig(
        vocab_size=50, d_model=32, heads=2, d_ff=64, encoder_layers=1, decoder_layers=layers
    )
    model = _model(cfg)
    src, src_lengths = _sources(cfg)
    counts = []
    for steps in (6, 12):
        max_lens = torch.full((src.shape[0],), steps)
        with fastnmt.backend("cpp"), HostOps() as host:
            beam_search(model, src, src_lengths, max_lens, beam=3, eos=False)
        counts.append(len(host.aten))
    assert (counts[1] - counts[0]) / 6 <= 44 + 36 * layers, counts


@pytest.mark.parametrize("beam", [1, 4])
def test_a_decoding_step_syncs_the_host_once(beam):
    """Each step's only sync is the check for finished sentences: a search of 9 steps makes 5
    more than one of 4 (eos banned, so nothing finishes before the last step)."""
    model = _model(SMALL).to(TRITON_DEVICE)
    src, src_lengths = (t.to(TRITON_DEVICE) for t in _sources(SMALL))
    counts = []
    for steps in (4, 9):
        max_lens = torch.full((src.shape[0],), steps)
        with count_host_syncs() as syncs:
            if beam == 1:
                greedy(model, src, src_lengths, max_lens, eos=False)
            else:
                beam_search(model, src, src_lengths, max_lens, beam=beam, eos=False)
        counts.append(len(syncs.names))
    assert counts[1] - counts[0] == 5, counts


# Sampling, prefixes, repeated n-grams, ensembles. -------------------------------------------


def _tokens(found) -> list:
    return [[h.tokens for h in hypotheses] for hypotheses in found]


def test_sampling_towards_zero_temperature_is_greedy():
    model = _model(SMALL)
    src, src_lengths = _sources(SMALL)
    max_lens = torch.tensor([6, 9, 3, 6])
    expected = [[h.tokens] for h in greedy(model, src, src_lengths, max_lens)]
    for method, temperature in itertools.product(("topk", "topp"), (1e-4, MIN_TEMPERATURE)):
        cold = Sampling(method, temperature=temperature, samples=3)
        found = sample(model, src, src_lengths, max_lens, sampling=cold)
        assert [sorted({tuple(t) for t in s}) for s in _tokens(found)] == [
            [tuple(e[0])] for e in expected
        ]
        # the lowest temperature keeps log-probabilities finite (they go into JSON answers)
        assert all(math.isfinite(h.log_prob) for s in found for h in s)


def test_a_seed_draws_the_same_samples_in_any_batch_and_its_stream_others():
    model = _model(SMALL)
    src, src_lengths = _sources(SMALL)
    max_lens = torch.full((4,), 8)
    sampling = Sampling("topk", topk=10, temperature=1.5, samples=2, seed=42)
    together = _tokens(sample(model, src, src_lengths, max_lens, sampling=sampling))
    for row in range(4):
        alone = sample(
            model, src[row : row + 1], src_lengths[row : row + 1], max_lens[row : row + 1],
            sampling=sampling, streams=torch.tensor([row]),
        )  # fmt: skip
        assert _tokens(alone) == together[row : row + 1]
    reseeded = Sampling("topk", topk=10, temperature=1.5, samples=2, seed=43)
    assert _tokens(sample(model, src, src_lengths, max_lens, sampling=reseeded)) != together
    assert len({tuple(map(tuple, s)) for s in together}) > 1, "a test of nothing: all alike"


def test_a_forced_prefix_is_reproduced_and_scored():
    model = _model(SMALL)
    src, src_lengths = _sources(SMALL)
    prefixes = [[5, 6, 7], [], [9], [10, 11]]
    max_lens = torch.tensor([8, 6, 4, 3])
    rules = Rules(prefixes=prefixes)
    for found in (
        [[h] for h in greedy(model, src, src_lengths, max_lens, rules=rules)],
        beam_search(model, src, src_lengths, max_lens, beam=3, nbest=3, rules=rules),
        sample(model, src, src_lengths, max_lens, sampling=Sampling(samples=2), rules=rules),
    ):
        for row, hypotheses in enumerate(found):
            for h in hypotheses:
                assert h.tokens[: len(prefixes[row])] == prefixes[row]
                ids = h.tokens + [SMALL.eos_id] * h.ended
                [log_prob] = _sequence_log_probs(model, src, src_lengths, row, [ids])
                assert h.log_prob == pytest.approx(log_prob, abs=1e-4)
    with pytest.raises(ValueError, match="at least the prefix and a token"):
        greedy(model, src, src_lengths, torch.tensor([3, 6, 4, 3]), rules=rules)
    with pytest.raises(ValueError, match="one prefix per sentence"):
        greedy(model, src, src_lengths, max_lens, rules=Rules(prefixes=prefixes[:2]))


def _repeats(tokens: list[int], size: int) -> bool:
    ngrams = [tuple(tokens[i : i + size]) for i in range(len(tokens) - size + 1)]
    return len(ngrams) != len(set(ngrams))


@pytest.mark.parametrize("size", [1, 2, 3])
def test_no_ngram_repeats_under_no_repeat_ngram(size):
    model = _model(SMALL)
    src, src_lengths = _sources(SMALL)
    max_lens = torch.full((4,), 12)
    plain = _tokens(beam_search(model, src, src_lengths, max_lens, beam=2))
    assert any(_repeats(t, size) for s in plain for t in s), "a test of nothing: no repeats"
    rules = Rules(no_repeat_ngram=size)
    for found in (
        [[h] for h in greedy(model, src, src_lengths, max_lens, rules=rules)],
        beam_search(model, src, src_lengths, max_lens, beam=3, nbest=3, rules=rules),
        sample(model, src, src_lengths, max_lens, sampling=Sampling(samples=3), rules=rules),
    ):
        for hypotheses in found:
            assert hypotheses and not any(_repeats(h.tokens, size) for h in hypotheses)


def test_a_model_ensembled_with_itself_searches_as_it_does_alone():
    model = _model(SMALL)
    src, src_lengths = _sources(SMALL)
    max_lens = torch.tensor([6, 9, 3, 6])
    for search in (
        lambda m: [[h] for h in greedy(m, src, src_lengths, max_lens)],
        lambda m: beam_search(m, src, src_lengths, max_lens, beam=4, nbest=4),
    ):
        alone, twice = search(model), search([model, model])
        assert _tokens(alone) == _tokens(twice)
        for a, b in zip(alone, twice, strict=True):
            assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-5)


def test_an_ensemble_averages_its_members_probabilities():
    """Two different models: each step's scores are the log of their probabilities' mean."""
    first, second = _model(SMALL), _model(SMALL)
    src, src_lengths = _sources(SMALL)
    max_lens = torch.tensor([5, 5, 5, 5])
    [[found]] = beam_search([first, second], src[:1], src_lengths[:1], max_lens[:1], beam=2)
    ids = found.tokens + [SMALL.eos_id] * found.ended
    members = [_log_probs(m, src, src_lengths, 0, [ids[:-1]])[0] for m in (first, second)]
    mixed = torch.stack(members).logsumexp(0) - torch.log(torch.tensor(2.0))
    expected = sum(mixed[t, token].item() for t, token in enumerate(ids))
    assert found.log_prob == pytest.approx(expected, abs=1e-4)
    other = ModelConfig(**{**SMALL.to_dict(), "vocab_size": 51})
    with pytest.raises(ValueError, match="ensemble model 2 has another vocabulary"):
        greedy([first, _model(other)], src, src_lengths, max_lens)


def test_a_sampling_step_syncs_the_host_once():
    model = _model(SMALL)
    src, src_lengths = _sources(SMALL)
    counts = []
    for steps in (4, 9):
        max_lens = torch.full((src.shape[0],), steps)
        sampling = Sampling("topk", topk=5, samples=2, seed=1)
        with count_host_syncs() as syncs:
            sample(model, src, src_lengths, max_lens, sampling=sampling, eos=False)
        counts.append(len(syncs.names))
    assert counts[1] - counts[0] == 5, counts
