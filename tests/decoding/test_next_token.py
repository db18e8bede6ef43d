"""Sampling against the distribution it must draw from (chi-square over a small vocabulary),
the counter-based random numbers, and the step rules (forced tokens, repeated n-grams,
ensembles) against direct computations."""

import pytest
import torch
from scipy.stats import chisquare

from fastnmt.decoding.next_token import (
    Sampling,
    ban_repeated_ngrams,
    candidates,
    drawn,
    force,
    full_log_probs,
    stream_keys,
    uniforms,
    uniforms_at,
)
from fastnmt.decoding.search import sample
from fastnmt.model import ModelConfig, Transformer
from tests.helpers import HostOps

# pad, bos, eos and nine words: every category gets hundreds of draws.
TWELVE = ModelConfig(
    vocab_size=12, d_model=32, heads=2, d_ff=64, encoder_layers=1, decoder_layers=1
)
DRAWS = 6000


def _first_step(temperature: float):
    """A random model, a random source and the log-probabilities of its first target token at
    ``temperature`` (pad and bos never drawn), by one full forward pass."""
    model = Transformer(TWELVE).eval()
    src = torch.randint(3, TWELVE.vocab_size, (1, 6))
    src[0, -1] = TWELVE.eos_id
    lengths = torch.tensor([6])
    with torch.no_grad():
        memory = model.encode(src, lengths)
        states = model.decode(torch.tensor([[TWELVE.bos_id]]), memory, lengths)
        log_probs = (model.logits(states[0, -1]) / temperature).log_softmax(-1)
    log_probs[[TWELVE.pad_id, TWELVE.bos_id]] = float("-inf")
    return model, src, lengths, log_probs


def _drawn_counts(model, src, lengths, sampling: Sampling) -> torch.Tensor:
    """How often each token was drawn first, over ``sampling.samples`` samples of one step."""
    [samples] = sample(model, src, lengths, torch.tensor([1]), sampling=sampling)
    first = [h.tokens[0] if h.tokens else TWELVE.eos_id for h in samples]
    return torch.bincount(torch.tensor(first), minlength=TWELVE.vocab_size)


def _chi_square_p(counts: torch.Tensor, log_probs: torch.Tensor, kept: torch.Tensor) -> float:
    """The chi-square test's p-value of ``counts`` drawn from softmax(log_probs) restricted to
    the ``kept`` tokens (none drawn outside them)."""
    assert (counts[~kept] == 0).all(), f"drew tokens outside the support: {counts}"
    probabilities = log_probs.double().exp()[kept]
    expected = probabilities / probabilities.sum() * counts.sum()
    return chisquare(counts[kept].double(), expected).pvalue


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.5])
@pytest.mark.parametrize("topk", [None, 1, 4])
def test_top_k_samples_follow_the_tempered_softmax_of_the_k_best(temperature, topk):
    model, src, lengths, log_probs = _first_step(temperature)
    sampling = Sampling("topk", topk=topk, temperature=temperature, samples=DRAWS, seed=7)
    counts = _drawn_counts(model, src, lengths, sampling)
    kept = torch.zeros_like(log_probs, dtype=torch.bool)
    kept[log_probs.topk(topk or TWELVE.vocab_size).indices] = True
    kept &= log_probs > float("-inf")
    if topk == 1:
        assert counts.argmax() == log_probs.argmax() and counts.max() == DRAWS
        return
    assert _chi_square_p(counts, log_probs, kept) > 1e-3
    if topk is not None:  # the test can fail: these draws are not from the whole softmax
        assert _chi_square_p(counts, log_probs, log_probs > float("-inf")) < 1e-6


@pytest.mark.parametrize("topp", [0.3, 0.75, 1.0])
def test_top_p_samples_follow_the_softmax_of_the_nucleus(topp):
    model, src, lengths, log_probs = _first_step(1.3)
    sampling = Sampling("topp", topp=topp, temperature=1.3, samples=DRAWS, seed=11)
    counts = _drawn_counts(model, src, lengths, sampling)
    probabilities, order = log_probs.softmax(0).sort(descending=True)  # of the allowed tokens
    nucleus = order[(probabilities.cumsum(0) - probabilities) < topp]  # smallest set >= topp
    kept = torch.zeros_like(log_probs, dtype=torch.bool)
    kept[nucleus] = True
    # pad and bos (probability 0) can fall inside at topp 1.0, where the float32 cumsum ends
    # below 1: they are never drawn, and an expected count of 0 makes the test's statistic NaN.
    kept &= log_probs > float("-inf")
    assert _chi_square_p(counts, log_probs, kept) > 1e-3
    if topp < 1.0:  # the test can fail: these draws are not from the whole softmax
        assert _chi_square_p(counts, log_probs, log_probs > float("-inf")) < 1e-6


@pytest.mark.parametrize("sampling", [Sampling("topk", topk=5), Sampling("topp", topp=0.8)])
def test_rules_and_ensembles_draw_from_the_written_log_probabilities_as_one_model_does(sampling):
    """One model without rules draws straight from its logits; with rules (here: masking
    nothing) or as an ensemble of itself, from the written log-probabilities. The draw depends
    only on differences within a row, so the tokens are the same, and so are their
    log-probabilities (the written ones, not renormalised over what the rules leave)."""
    rows, vocab, banned = 500, 300, torch.tensor([0, 1])
    logits = torch.randn(rows, vocab) * 3.0
    random = uniforms(torch.tensor(3), torch.arange(rows), 0)
    alone = drawn([logits], banned, sampling, random)
    for other in (
        drawn([logits], banned, sampling, random, rules=[lambda log_probs: None]),
        drawn([logits, logits], banned, sampling, random),
    ):
        assert (other[1] != alone[1]).float().mean() < 0.01  # a draw on a boundary may differ
        same = other[1] == alone[1]
        torch.testing.assert_close(other[0][same], alone[0][same], rtol=0, atol=1e-5)
    masked = drawn([logits], banned, sampling, random, rules=[lambda lp: lp[:, 2:100].fill_(-1e30)])
    assert (masked[1] >= 100).all()
    expected = logits.log_softmax(-1).gather(1, masked[1][:, None])[:, 0]
    torch.testing.assert_close(masked[0], expected, rtol=0, atol=1e-5)


def test_uniforms_are_uniform_and_a_function_of_seed_stream_and_step():
    seed, streams = torch.tensor(123), torch.arange(50_000)
    values = uniforms(seed, streams, 3)
    assert values.min() >= 0.0 and values.max() < 1.0
    histogram = torch.histc(values, bins=20, min=0.0, max=1.0)
    assert chisquare(histogram.double()).pvalue > 1e-3
    assert torch.equal(values[7:9], uniforms(seed, streams[7:9], 3))  # any batch
    assert torch.equal(values, uniforms(seed.reshape(1), streams, torch.tensor([3])))
    for other in (uniforms(seed + 1, streams, 3), uniforms(seed, streams, 4)):
        assert (other != values).float().mean() > 0.99
    # neighbouring streams and steps are not correlated
    pairs = torch.stack([values, uniforms(seed, streams + 1, 3), uniforms(seed, streams, 4)])
    assert torch.corrcoef(pairs).sub(torch.eye(3)).abs().max() < 0.02


def test_a_step_of_uniforms_from_stream_keys_hashes_only_the_step_number():
    seed, streams = torch.tensor(2**40 + 5), torch.randint(0, 2**40, (1000,))
    keys = stream_keys(seed, streams)
    for step in (0, 7, 1023):
        expected = uniforms(seed, streams, step)
        assert torch.equal(uniforms_at(keys, step), expected)
        assert torch.equal(uniforms_at(keys, torch.tensor(step)), expected)  # a device step
    with HostOps() as host:
        uniforms_at(keys, 7)
    # the keys' hash and the int step's on the host: one add, one _mix, the float conversion
    assert len(host.aten) <= 15, host.aten


def test_bad_sampling_values_are_one_line_errors():
    for settings, message in (
        (dict(method="beam"), "sampling must be topk or topp"),
        (dict(topk=0), "topk must be at least 1"),
        (dict(topp=0.0), r"topp must be in \(0, 1\]"),
        (dict(topp=1.01), r"topp must be in \(0, 1\]"),
        (dict(temperature=0.0), r"temperature must be >= 1e-06 \(lower: greedy search\)"),
        (dict(temperature=1e-40), "temperature must be >= 1e-06"),  # NaN draws in float32
        (dict(temperature=float("nan")), "temperature must be >= 1e-06"),
        (dict(samples=0), "samples must be at least 1"),
        (dict(seed=-1), "seed must be a non-negative"),
    ):
        with pytest.raises(ValueError, match=message):
            Sampling(**settings)


def test_forced_rows_keep_only_their_token_with_its_log_probability():
    log_probs = torch.randn(4, 9).log_softmax(-1)
    forced, tokens = torch.tensor([True, False, True, False]), torch.tensor([3, 5, 8, 0])
    expected = log_probs.clone()
    expected[[0, 2]] = float("-inf")
    expected[0, 3], expected[2, 8] = log_probs[0, 3], log_probs[2, 8]
    force(log_probs, forced, tokens)
    assert torch.equal(log_probs, expected)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_repeated_ngrams_are_banned_and_nothing_else(size):
    generated = torch.randint(3, 7, (16, 9))
    for length in (0, size - 1, 5, 9):
        log_probs = torch.zeros(16, 7)
        ban_repeated_ngrams(log_probs, generated, length, size, harmless=0)
        for row in range(16):
            seen = generated[row, :length].tolist()
            context = seen[len(seen) - size + 1 :] if size > 1 else []
            banned = {
                seen[i + size - 1]
                for i in range(len(seen) - size + 1)
                if size == 1 or (len(seen) >= size - 1 and seen[i : i + size - 1] == context)
            }
            got = {c for c in range(1, 7) if log_probs[row, c] == float("-inf")}
            assert got == banned, (row, length, seen)
        # a step a CUDA graph replays passes its length as a device tensor
        on_device = torch.zeros(16, 7)
        ban_repeated_ngrams(on_device, generated, torch.tensor([length]), size, harmless=0)
        assert torch.equal(on_device.isinf()[:, 1:], log_probs.isinf()[:, 1:])


def test_an_ensemble_averages_probabilities_and_ranks_as_fairseq():
    first, second = torch.randn(5, 30), torch.randn(5, 30)
    mixed = full_log_probs([first, second], temperature=1.0)
    expected = ((first.softmax(-1) + second.softmax(-1)) / 2).log()
    assert torch.allclose(mixed, expected, atol=1e-6)
    banned = torch.tensor([0, 1])
    values, ids = candidates([first, second], 4, banned)
    best = expected.index_fill(1, banned, float("-inf")).topk(4)
    assert torch.allclose(values, best.values) and torch.equal(ids, best.indices)
    alone = candidates([first], 4, banned)
    assert torch.equal(candidates([first, first], 4, banned)[1], alone[1])
