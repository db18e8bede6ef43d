"""Translator: loading, batching and order, empty lines, n-best, truncation, attention."""

import copy
import json
import warnings

import numpy as np
import pytest
import torch

import fastnmt
from fastnmt.checkpoint import CheckpointError
from fastnmt.data import TokenArray, make_batch
from fastnmt.decoding.next_token import Sampling
from fastnmt.decoding.search import LengthPenalty, beam_search
from fastnmt.training.trainer import label_smoothed_loss
from fastnmt.translator import (
    PackedPairs,
    Translator,
    TruncationWarning,
    fastest_dtype,
    fastest_precision,
)
from tests.helpers import tiny_checkpoint

SENTENCES = [
    "A man is walking his dog.",
    "",
    "Two children play football in the park near a big red house.",
    "   ",
    "Dogs.",
    "A woman sings.",
]


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("checkpoint"))


@pytest.fixture(scope="module")
def translator(checkpoint_dir):
    return Translator.from_checkpoint(checkpoint_dir, precision="fp32")


def test_order_and_batching_do_not_change_translations(translator):
    together = translator.translate(SENTENCES, beam=2, max_len_a=0.5, max_len_b=3)
    translator.max_sentences = 1
    try:
        alone = translator.translate(SENTENCES, beam=2, max_len_a=0.5, max_len_b=3)
    finally:
        translator.max_sentences = 256
    reversed_order = translator.translate(SENTENCES[::-1], beam=2, max_len_a=0.5, max_len_b=3)
    assert together == alone == reversed_order[::-1]
    assert len(together) == len(SENTENCES)
    assert together[1] == together[3] == ""  # empty and blank lines give empty lines
    assert all(together[i] for i in (0, 2, 4, 5)), "a random model still says something"


def test_a_model_in_training_mode_is_translated_in_eval_mode_and_given_back(translator):
    """Dropout off while translating (the same translations as in eval mode); the mode each
    module had is restored, and a model already in eval mode is left as it is."""
    expected = translator.translate(SENTENCES, beam=2)
    model = translator.model
    try:
        model.train()
        assert translator.translate(SENTENCES, beam=2) == expected
        assert all(m.training for m in model.modules())
    finally:
        model.eval()
    translator.translate(SENTENCES[:1], beam=1)
    assert not any(m.training for m in model.modules())


def test_greedy_is_beam_1_of_the_search(translator):
    greedy_texts = translator.translate(SENTENCES, beam=1)
    [beam_1] = translator.translate_full([SENTENCES[0]], beam=1, nbest=1)
    assert beam_1.text == greedy_texts[0]
    # nbest=1 with beam 1 takes greedy's code path; beam_search(beam=1) must agree with it.
    tokens = translator.vocab.encode([SENTENCES[0]])[0] + [translator.vocab.eos_id]
    on_device = dict(device=translator.device)  # the model's: CUDA where there is one
    found = beam_search(
        translator.model,
        torch.tensor([tokens], **on_device),
        torch.tensor([len(tokens)], **on_device),
        torch.tensor([int(1.2 * len(tokens) + 10)]),
        beam=1,
        penalty=LengthPenalty(),
    )
    assert found[0][0].tokens == beam_1.candidates[0].tokens


def test_nbest_is_ordered_by_score_with_its_length_penalty(translator):
    [translation] = translator.translate_full([SENTENCES[0]], beam=5, nbest=5, lenpen=0.5)
    scores = [c.score for c in translation.candidates]
    assert len(scores) == 5 and scores == sorted(scores, reverse=True)
    assert len({tuple(c.tokens) for c in translation.candidates}) == 5
    for candidate in translation.candidates:
        length = len(candidate.tokens) + candidate.ended
        assert candidate.score == pytest.approx(candidate.log_prob / length**0.5)
        assert candidate.text == translator.vocab.decode([candidate.tokens])[0]
    assert translation.text == translation.candidates[0].text


@pytest.mark.parametrize(
    "options",
    [dict(beam=2, nbest=2), dict(beam=1), dict(sampling=Sampling(seed=1)), dict(attention=True)],
    ids=["beam", "greedy", "sampling", "attention"],
)
def test_each_translation_is_handed_over_once_and_final(translator, options):
    """on_translated gets every sentence once, blank ones included, already as the call returns
    it (a copy taken when handed over equals it)."""
    handed = {}

    def on_translated(index, translation):
        assert index not in handed
        handed[index] = copy.deepcopy(translation)

    found = translator.translate_full(SENTENCES, on_translated=on_translated, **options)
    assert sorted(handed) == list(range(len(SENTENCES)))
    assert [handed[i].candidates for i in range(len(found))] == [t.candidates for t in found]
    if "attention" in options:
        assert all(handed[i].attention is not None for i in (0, 2, 4, 5))


def test_length_limit_follows_max_len_a_and_b(translator):
    [translation] = translator.translate_full([SENTENCES[2]], beam=2, max_len_a=0, max_len_b=3)
    assert all(len(c.tokens) + c.ended <= 3 for c in translation.candidates)
    for a, b in ((0, 0), (float("nan"), 10), (float("inf"), 10), (-1.0, 10)):
        with pytest.raises(ValueError, match="max_len_a and max_len_b must be finite and >= 0"):
            translator.translate(["x"], max_len_a=a, max_len_b=b)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda t: t.translate("A dog runs."), "sentences must be a list of strings, got one str"),
        (lambda t: t.translate(["A dog.", None]), r"sentences\[1\] must be a str, got NoneType"),
        (lambda t: t.translate([b"A dog."]), r"sentences\[0\] must be a str, got bytes"),
        (lambda t: t.score("A dog.", "Hund."), "sources must be a list of strings, got one str"),
        (lambda t: t.score(["A dog."], [5]), r"targets\[0\] must be a str, got int"),
        (lambda t: t.translate(["A dog."], prefix=[3]), r"prefix\[0\] must be a str, got int"),
    ],
)
def test_texts_that_are_no_list_of_strings_are_refused(translator, call, message):
    """A single string would pass for a list of one-character sentences, each translated."""
    with pytest.raises(TypeError, match=message):
        call(translator)


def test_long_input_is_truncated_with_a_warning_naming_the_line(tmp_path):
    short = Translator.from_checkpoint(tiny_checkpoint(tmp_path, max_positions=6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        translations = short.translate_full(["Dogs.", SENTENCES[2]], first_line=10)
    [warning] = caught
    assert warning.category is TruncationWarning
    assert str(warning.message).startswith("line 11: ")
    assert warning.filename == __file__  # where translate_full was called
    assert "truncated to the model's limit of 5" in str(warning.message)
    assert translations[1].truncated and len(translations[1].source_tokens) == 5
    assert not translations[0].truncated


def test_missing_and_corrupt_checkpoints_are_one_line_errors(checkpoint_dir, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Translator.from_checkpoint(tmp_path / "nowhere")
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "spm.model"):
        (broken / name).write_bytes((checkpoint_dir / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError) as error:
        Translator.from_checkpoint(broken)
    assert "\n" not in str(error.value)
    (broken / "model.safetensors").write_bytes((checkpoint_dir / "model.safetensors").read_bytes())
    config = json.loads((checkpoint_dir / "config.json").read_text())
    config["model"]["d_model"] = 64
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as error:
        Translator.from_checkpoint(broken)
    assert "\n" not in str(error.value) and "cannot load checkpoint" in str(error.value)


def test_attention_is_a_distribution_and_the_same_on_both_paths(translator):
    texts = [SENTENCES[0], SENTENCES[4]]
    [fused, short] = translator.translate_full(texts, beam=2, attention=True)
    with fastnmt.backend("reference"):
        [reference, _] = translator.translate_full(texts, beam=2, attention=True)
    cfg = translator.model.cfg
    source = len(fused.source_tokens) + 1
    target = len(fused.candidates[0].tokens) + fused.candidates[0].ended
    assert [w.shape for w in fused.attention.cross] == [(cfg.heads, target, source)]
    assert [w.shape for w in fused.attention.encoder] == [(cfg.heads, source, source)]
    assert [w.shape for w in fused.attention.decoder] == [(cfg.heads, target, target)]
    for weights in (*fused.attention.cross, *fused.attention.encoder, *fused.attention.decoder):
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:2]))
    assert torch.all(fused.attention.decoder[0].triu(1) == 0), "causal: no attention ahead"
    assert short.attention.cross[0].shape[-1] == len(short.source_tokens) + 1  # no padding
    torch.testing.assert_close(fused.attention.cross[0], reference.attention.cross[0])
    assert translator.translate_full(texts)[0].attention is None  # only on request


def test_a_translator_takes_its_model_s_device_unless_told(translator):
    """The searches refuse batches off the model's device: a model moved to a GPU (here: meta)
    translates there without ``device=``."""
    model = copy.deepcopy(translator.model).to("meta")
    assert Translator(model, translator.vocab, static=False).device.type == "meta"
    assert Translator(model, translator.vocab, device="cpu", static=False).device.type == "cpu"


def test_a_cpu_translator_keeps_freed_memory_for_its_steps(translator, monkeypatch):
    """On a CPU (only), malloc keeps freed blocks: decoding's per-step tensors are not
    page-faulted in afresh at every step."""
    calls = []
    monkeypatch.setattr("fastnmt.translator.keep_freed_memory", lambda: calls.append(1))
    Translator(translator.model, translator.vocab, static=False)
    assert calls == [1]
    model = copy.deepcopy(translator.model).to("meta")
    Translator(model, translator.vocab, static=False)
    assert calls == [1]


@pytest.mark.parametrize(
    ("capability", "expected"), [((7, 5), torch.float16), ((8, 0), torch.bfloat16)]
)
def test_auto_precision_takes_bf16_only_on_gpus_that_compute_in_it(
    monkeypatch, capability, expected
):
    """Turing (7.5) reports bf16 as supported (emulated): fp16 with loss scaling there."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert fastest_dtype("cuda") == expected


def test_auto_inference_precision_on_gpus_is_their_half_precision(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert fastest_precision("cuda") == "bf16"


# Sampling, prefixes, repeated n-grams, ensembles, scoring. -----------------------------------

TRITON_OPS = ("attention", "add_layer_norm", "feed_forward", "linear_cross_entropy")


def _candidate_texts(translations) -> list[list[str]]:
    return [[c.text for c in t.candidates] for t in translations]


def test_a_seed_samples_the_same_on_every_backend_batch_size_and_search(translator):
    sampling = Sampling("topk", topk=20, samples=2, seed=2024)
    options = dict(sampling=sampling, nbest=2, max_len_b=6)
    expected = _candidate_texts(translator.translate_full(SENTENCES, **options))
    assert len({tuple(c) for c in expected if c}) > 1, "a test of nothing: all alike"
    static = Translator(translator.model, translator.vocab, static=True)
    translator.max_sentences = 1
    try:
        fused = "triton" if translator.device.type == "cuda" else "cpp"
        for backend in (fused, "reference"):
            # log_softmax_topk and sample_token have no Triton kernel: forced, triton runs the rest
            ops = TRITON_OPS if backend == "triton" else None
            with fastnmt.backend(backend, ops=ops):
                for searcher in (translator, static):
                    got = searcher.translate_full(SENTENCES, **options)
                    assert _candidate_texts(got) == expected, (backend, searcher.static)
    finally:
        translator.max_sentences = 256
    # a sentence's samples depend on its line number, not on its neighbours
    shifted = translator.translate_full(SENTENCES[2:], first_line=3, **options)
    assert _candidate_texts(shifted) == expected[2:]
    unseeded = dict(options, sampling=Sampling("topk", topk=20, samples=2))
    torch.manual_seed(1)
    first = _candidate_texts(translator.translate_full(SENTENCES, **unseeded))
    torch.manual_seed(1)
    assert _candidate_texts(translator.translate_full(SENTENCES, **unseeded)) == first
    assert _candidate_texts(translator.translate_full(SENTENCES, **unseeded)) != first
    with pytest.raises(ValueError, match=r"nbest must be between 1 and samples \(2\)"):
        translator.translate(SENTENCES, sampling=sampling, nbest=3)


def test_a_prefix_is_reproduced_exactly(translator):
    prefixes = ["Ein Mann", None, "Zwei Kinder spielen", "", "Hunde", "Eine Frau singt"]
    for options in (dict(beam=1), dict(beam=3), dict(sampling=Sampling(seed=3))):
        translations = translator.translate_full(SENTENCES, prefix=prefixes, **options)
        for translation, prefix in zip(translations, prefixes, strict=True):
            if translation.source.strip() and prefix:
                assert translation.text.startswith(prefix), (translation.text, prefix)
                forced = translator.vocab.encode([prefix])[0]
                assert translation.candidates[0].tokens[: len(forced)] == forced
    # line 2 is blank (not translated, so its prefix is not checked); line 3's is too long
    too_long = [None, "Ein Mann geht mit seinem Hund", "Zwei Kinder spielen im Park", *[None] * 3]
    with pytest.raises(ValueError, match=r"prefix of line 3: \d+ subword tokens, past the le"):
        translator.translate(SENTENCES, prefix=too_long, max_len_a=0, max_len_b=4)
    with pytest.raises(ValueError, match=r"one text per sentence \(6\), got 2"):
        translator.translate(SENTENCES, prefix=prefixes[:2])


def test_no_repeat_ngram_bans_repeated_ngrams_of_subwords(translator):
    for options in (dict(beam=1), dict(beam=3, nbest=3), dict(sampling=Sampling(samples=2))):
        found = translator.translate_full(SENTENCES, no_repeat_ngram=2, max_len_b=30, **options)
        for translation in found:
            for candidate in translation.candidates:
                bigrams = list(zip(candidate.tokens, candidate.tokens[1:], strict=False))
                assert len(bigrams) == len(set(bigrams)), candidate.tokens
    with pytest.raises(ValueError, match="no_repeat_ngram must be a non-negative int"):
        translator.translate(SENTENCES, no_repeat_ngram=-1)


def test_a_model_ensembled_with_itself_translates_as_it_does_alone(checkpoint_dir, translator):
    ensemble = Translator.from_checkpoint([checkpoint_dir, checkpoint_dir], precision="fp32")
    assert len(ensemble.models) == 2 and ensemble.static is None
    for options in (dict(beam=1), dict(beam=4, nbest=2)):
        assert _candidate_texts(ensemble.translate_full(SENTENCES, **options)) == (
            _candidate_texts(translator.translate_full(SENTENCES, **options))
        )
    with pytest.raises(ValueError, match="no ensemble"):
        Translator(ensemble.models, ensemble.vocab, static=True)


def test_checkpoints_with_different_vocabularies_do_not_ensemble(checkpoint_dir, tmp_path):
    other = tiny_checkpoint(tmp_path, pieces=280)
    with pytest.raises(CheckpointError, match="has another vocabulary than"):
        Translator.from_checkpoint([checkpoint_dir, other], precision="fp32")


TARGETS = ["Ein Mann geht mit seinem Hund.", "", "Zwei Kinder.", "", "Hunde.", "Eine Frau."]


def test_a_pair_s_score_is_minus_the_trainer_s_summed_loss_without_smoothing(translator):
    scores = translator.score(SENTENCES, TARGETS, lenpen=0.5)
    model, vocab = translator.model, translator.vocab
    for source, target, score in zip(SENTENCES, TARGETS, scores, strict=True):
        src, tgt = vocab.encode([source])[0], vocab.encode([target])[0]
        batch = make_batch([src], [tgt], [0], pad_id=0, bos_id=1, eos_id=2).to(translator.device)
        with torch.no_grad():
            states = model(batch.src, batch.src_lengths, batch.tgt_in)
            loss, _, _ = label_smoothed_loss(model, states, batch.tgt_out, batch.tgt_positions, 0.0)
        assert score.log_prob == pytest.approx(-loss.item(), abs=1e-4)
        assert score.tokens == len(tgt) + 1
        assert score.per_token == pytest.approx(score.log_prob / score.tokens)
        assert score.normalised == pytest.approx(score.log_prob / score.tokens**0.5)
    translator.max_sentences = 2
    try:
        with fastnmt.backend("reference"):
            again = translator.score(SENTENCES, TARGETS, lenpen=0.5)
    finally:
        translator.max_sentences = 256
    assert [s.log_prob for s in again] == pytest.approx([s.log_prob for s in scores], abs=1e-4)
    with pytest.raises(ValueError, match="sources and targets must pair up, got 6 and 5"):
        translator.score(SENTENCES, TARGETS[:5])


def test_a_forced_prefix_is_conditioned_on_and_not_scored(translator, monkeypatch):
    """Scoring packs its pairs; the padded model's log-probabilities past the prefix agree."""
    prefix = [5, 6]
    monkeypatch.setattr(translator, "target_prefix", prefix)
    scores = translator.score(SENTENCES, TARGETS)
    model, vocab = translator.model, translator.vocab
    for source, target, score in zip(SENTENCES, TARGETS, scores, strict=True):
        src, tgt = vocab.encode([source])[0], prefix + vocab.encode([target])[0]
        batch = make_batch([src], [tgt], [0], pad_id=0, bos_id=1, eos_id=2).to(translator.device)
        with torch.no_grad():
            states = model(batch.src, batch.src_lengths, batch.tgt_in)
            log_probs = model.logits(states).log_softmax(-1)[0]  # (T, V)
        gold = log_probs.gather(1, batch.tgt_out[0][:, None])[:, 0]
        assert score.log_prob == pytest.approx(gold[len(prefix) :].sum().item(), abs=1e-4)
        assert score.tokens == len(tgt) - len(prefix) + 1


def test_a_packed_model_scores_through_its_packed_output_layer(translator, monkeypatch):
    """A model with a packed output layer (fastnmt.quantize) scores with the GEMM its searches
    use, whose weight oneDNN reordered once, not with F.linear on the embedding (which reorders
    the weight at every chunk); the scores are the same."""
    expected = [s.log_prob for s in translator.score(SENTENCES, TARGETS)]
    model, rows = translator.model, []

    def packed_output(states):
        rows.append(len(states))
        return torch.nn.functional.linear(states, model.embedding.weight, model.output_bias)

    monkeypatch.setattr(model, "packed_output", packed_output)
    scores = [s.log_prob for s in translator.score(SENTENCES, TARGETS)]
    assert sum(rows) == sum(len(translator.vocab.encode([t])[0]) + 1 for t in TARGETS)
    assert scores == pytest.approx(expected, abs=1e-5)


def test_the_search_s_log_probability_is_the_pair_s_score(checkpoint_dir, translator):
    [found] = translator.translate_full([SENTENCES[0]], beam=1, max_len_b=5)
    candidate = found.candidates[0]
    ensemble = Translator.from_checkpoint([checkpoint_dir, checkpoint_dir], precision="fp32")
    for scorer in (translator, ensemble):
        pair = [TokenArray.from_lists([t]) for t in (found.source_tokens, candidate.tokens)]
        batch = PackedPairs.of(*pair, np.arange(1), scorer.vocab, scorer.device)
        with torch.no_grad():
            [log_prob] = scorer._pair_log_probs(batch).tolist()
        if candidate.ended:
            assert log_prob == pytest.approx(candidate.log_prob, abs=1e-4)
        else:  # the search stopped before eos: the score adds eos' log-probability
            assert log_prob < candidate.log_prob
