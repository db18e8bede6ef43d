"""fastnmt.export: a CTranslate2 model that translates as fastnmt does (the same greedy tokens,
the same teacher-forced log-probabilities in float32), and the command's one-line errors."""

import sys

import pytest
import torch

from fastnmt import export
from fastnmt.data import make_batch
from fastnmt.translator import Translator
from tests.helpers import tiny_checkpoint

ctranslate2 = pytest.importorskip("ctranslate2")

SENTENCES = [
    "A man in a blue shirt is standing on a ladder.",
    "Two dogs play in the snow.",
    "A",
    "A group of people are sitting at a table outside of a restaurant and eating.",
]
MAX_TOKENS = 12  # generated tokens, eos included

# Each exported layout: pre-norm ReLU (fastnmt's default), post-norm with GELU, SiLU with
# Marian's positions, no embedding scale and an output bias (imported Opus-MT models).
VARIANTS = {
    "prenorm-relu": {},
    "postnorm-gelu": {"prenorm": False, "activation": "gelu"},
    "marian-like": {
        "activation": "silu", "positions": "marian", "scale_embedding": False, "output_bias": True,
    },
}  # fmt: skip


@pytest.fixture(scope="module", params=VARIANTS)
def exported(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    path = tiny_checkpoint(folder / "run", seed=3, **VARIANTS[request.param])
    model_dir = export.export_ctranslate2(path, folder / "ct2", "float32")
    translator = Translator.from_checkpoint(path, precision="fp32", device="cpu")
    return translator, ctranslate2.Translator(str(model_dir), device="cpu", inter_threads=1)


def test_greedy_tokens_are_identical(exported):
    ours, theirs = exported
    expected = ours.translate_full(SENTENCES, beam=1, max_len_a=0, max_len_b=MAX_TOKENS)
    results = theirs.translate_batch(
        export.to_pieces(ours.vocab, SENTENCES),
        beam_size=1,
        max_decoding_length=MAX_TOKENS,
        **export.search_options(ours.vocab),
    )
    for translation, result in zip(expected, results, strict=True):
        assert ours.vocab.pieces(translation.candidates[0].tokens) == result.hypotheses[0]
    texts = export.from_pieces(ours.vocab, [r.hypotheses[0] for r in results])
    assert texts == [t.text for t in expected]


def test_teacher_forced_log_probs_match(exported):
    ours, theirs = exported
    vocab = ours.vocab
    targets = vocab.encode(["Ein Mann steht auf einer Leiter.", "Hunde.", "", "Leute essen."])
    batch = make_batch(vocab.encode(SENTENCES), targets, list(range(len(SENTENCES))))
    with torch.inference_mode():
        states = ours.model(batch.src, batch.src_lengths, batch.tgt_in)
        log_probs = ours.model.logits(states).log_softmax(-1)
        expected = log_probs.gather(-1, batch.tgt_out.unsqueeze(-1)).squeeze(-1)
    scored = theirs.score_batch(
        export.to_pieces(vocab, SENTENCES), [vocab.pieces(t) for t in targets]
    )
    for row, (target, result) in enumerate(zip(targets, scored, strict=True)):
        found = torch.tensor(result.log_probs)  # the target tokens, then eos
        assert found.shape == (len(target) + 1,)
        torch.testing.assert_close(found, expected[row, : len(target) + 1], atol=1e-4, rtol=0)


def test_quantized_export_loads_and_translates(tmp_path):
    path = tiny_checkpoint(tmp_path / "run")
    model_dir = export.export_ctranslate2(path, tmp_path / "int8", "int8")
    translator = ctranslate2.Translator(str(model_dir), device="cpu", compute_type="int8")
    vocab = Translator.from_checkpoint(path, precision="fp32", device="cpu").vocab
    result = translator.translate_batch(export.to_pieces(vocab, SENTENCES[:1]), beam_size=4)
    assert len(result[0].hypotheses[0]) > 0


def run_cli(args, capsys):
    code = export.main(args)
    return code, capsys.readouterr().err


def test_cli_writes_the_model_and_refuses_to_overwrite(tmp_path, capsys):
    path = tiny_checkpoint(tmp_path / "run")
    args = ["--checkpoint", str(path), "--format", "ctranslate2", "--output", str(tmp_path / "o")]
    assert run_cli(args, capsys)[0] == 0
    assert (tmp_path / "o" / "model.bin").exists()
    code, err = run_cli(args, capsys)
    assert code == 2 and err.startswith("error: --output") and err.count("\n") == 1
    assert run_cli([*args, "--force"], capsys)[0] == 0


def test_cli_bad_inputs_are_one_line_errors(tmp_path, capsys, monkeypatch):
    out = ["--format", "ctranslate2", "--output", str(tmp_path / "o")]
    code, err = run_cli(["--checkpoint", str(tmp_path / "missing"), *out], capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "marian"}')
    code, err = run_cli(["--checkpoint", str(hf), *out], capsys)
    assert code == 2 and "ct2-transformers-converter" in err and err.count("\n") == 1
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # as if not installed
    path = tiny_checkpoint(tmp_path / "run")
    code, err = run_cli(["--checkpoint", str(path), *out], capsys)
    assert code == 2 and 'pip install "fastnmt[ctranslate2]"' in err and err.count("\n") == 1
