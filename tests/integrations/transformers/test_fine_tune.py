"""Fine-tuning Marian models with ``python -m fastnmt.train --init-from`` and exporting to Marian
with ``python -m fastnmt.export --format huggingface``, on tiny models built here: the tokenizer
is transformers', the first step's loss is transformers' loss, a fastnmt model exported, fine-tuned
from the export and exported again translates as transformers' ``generate`` does."""

import gzip
import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
import transformers

import fastnmt
from fastnmt import checkpoint
from fastnmt.data import MarianVocabulary, Vocabulary
from fastnmt.export import main as export_main
from fastnmt.model import ModelConfig, Transformer
from fastnmt.train import main as train_main
from fastnmt.training import fine_tune
from tests.helpers import multi30k_file
from tests.integrations.transformers.models import marian_directory, nllb_directory

MAX_LEN = 48  # the tiny models have 64 positions
TRAIN_OPTIONS = [
    "--max-len", str(MAX_LEN), "--device", "cpu", "--precision", "fp32", "--no-progress",
    "--log-interval", "1", "--max-tokens", "100000", "--workers", "1",
]  # fmt: skip


def _pairs(split: str, count: int) -> list[tuple[str, str]]:
    """The first ``count`` Multi30k pairs short enough for the tiny models' positions."""
    sides = []
    for lang in ("en", "de"):
        with gzip.open(multi30k_file(split, lang), "rt", encoding="utf-8") as f:
            sides.append([line.strip() for line in f])
    return [(s, t) for s, t in zip(*sides, strict=True) if len(s) < 40 and len(t) < 40][:count]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fine-tune")


@pytest.fixture(scope="module")
def marian(folder):
    return marian_directory(folder)


@pytest.fixture(scope="module")
def data(folder):
    """train.tsv (60 pairs) and valid.tsv (8 pairs)."""
    for name, split, count in (("train", "train", 60), ("valid", "val", 8)):
        lines = "".join(f"{s}\t{t}\n" for s, t in _pairs(split, count))
        (folder / f"{name}.tsv").write_text(lines, encoding="utf-8")
    return folder


def _train(data, output, *extra: str) -> int:
    tsv = ["--train-tsv", str(data / "train.tsv"), "--valid-tsv", str(data / "valid.tsv")]
    return train_main([*tsv, *TRAIN_OPTIONS, "--output-dir", str(output), *extra])


def _export(model, output) -> int:
    arguments = ["--checkpoint", str(model), "--format", "huggingface", "--output", str(output)]
    return export_main(arguments)


def _error(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    return lines[-1] if lines and lines[-1].startswith("error:") else "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The tokenizer


def test_marian_vocabulary_encodes_and_decodes_as_marian_tokenizer(marian):
    tokenizer = transformers.MarianTokenizer.from_pretrained(marian)
    vocab = MarianVocabulary.from_directory(marian, bos_id=tokenizer.pad_token_id)
    pairs = _pairs("val", 200)
    sources = [s for s, _ in pairs] + [">>deu<< Two dogs.", ""]
    targets = [t for _, t in pairs]
    assert vocab.encode(sources) == [ids[:-1] for ids in tokenizer(sources)["input_ids"]]
    target_ids = tokenizer(text_target=targets)["input_ids"]
    assert vocab.encode_target(targets) == [ids[:-1] for ids in target_ids]
    assert vocab.decode(target_ids) == tokenizer.batch_decode(target_ids, skip_special_tokens=True)
    assert (vocab.pad_id, vocab.eos_id, vocab.bos_id) == (tokenizer.pad_token_id, 0, vocab.pad_id)
    again = MarianVocabulary.from_directory(marian, bos_id=tokenizer.pad_token_id)
    assert again.to_bytes() == vocab.to_bytes()  # prepared data compares it by hash
    assert MarianVocabulary.from_bytes(vocab.to_bytes()).encode(sources) == vocab.encode(sources)


# ---------------------------------------------------------------------------------------------
# Fine-tuning


def _logged_losses(output) -> list[float]:
    """The training loss of each logged step, in nats per target token."""
    records = [json.loads(line) for line in (output / "metrics.jsonl").open()]
    return [r["loss"] * math.log(2) for r in records if r["event"] == "train"]


def _hf_loss(directory, pairs) -> float:
    model = transformers.MarianMTModel.from_pretrained(directory, dtype=torch.float32)
    tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
    sources, targets = zip(*pairs, strict=True)
    batch = tokenizer(list(sources), text_target=list(targets), return_tensors="pt", padding=True)
    batch["labels"] = batch["labels"].masked_fill(batch["labels"] == tokenizer.pad_token_id, -100)
    with torch.no_grad():
        return model.train()(**batch).loss.item()


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-5), ("bf16", 1e-2)])
def test_first_step_loss_is_transformers_loss(marian, data, tmp_path, precision, tolerance):
    """One batch holds the whole corpus; without label smoothing both losses are the mean
    cross entropy of its target tokens (transformers in fp32 as the reference)."""
    options = ["--max-steps", "1", "--label-smoothing", "0", "--precision", precision]
    assert _train(data, tmp_path, "--init-from", str(marian), *options) == 0
    pairs = [line.split("\t") for line in (data / "train.tsv").read_text().splitlines()]
    expected = _hf_loss(marian, pairs)
    assert _logged_losses(tmp_path)[0] == pytest.approx(expected, rel=tolerance)


def test_fine_tuning_defaults_apply_unless_set(marian, data, tmp_path):
    assert _train(data, tmp_path / "default", "--init-from", str(marian), "--max-steps", "1") == 0
    assert _train(data, tmp_path / "set", "--init-from", str(marian), "--max-steps", "1",
                  "--lr", "1e-4", "--warmup", "7") == 0  # fmt: skip
    trained = {}
    for name in ("default", "set"):
        config = json.loads((tmp_path / name / "checkpoint_last" / "config.json").read_text())
        trained[name] = config["training"]
    assert (trained["default"]["lr"], trained["default"]["warmup"]) == (
        fine_tune.FINE_TUNE_LR,
        fine_tune.FINE_TUNE_WARMUP,
    )
    assert (trained["set"]["lr"], trained["set"]["warmup"]) == (1e-4, 7)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--d-model", "64"], "--d-model 64 contradicts --init-from's model (32)"),
        (["--encoder-layers", "3"], "--encoder-layers 3 contradicts"),
        (
            ["--preset", "tiny"],
            "--preset tiny contradicts --init-from's model (encoder_layers 3 in",
        ),
        (["--max-len", "100"], "--max-len 100 exceeds --init-from's model's 64 positions"),
    ],
)
def test_flags_that_contradict_the_model_are_one_line_errors(
    marian, data, tmp_path, capsys, flags, message
):
    assert _train(data, tmp_path, "--init-from", str(marian), *flags) == 2
    error = _error(capsys)
    assert message in error and "\n" not in error
    assert not (tmp_path / "prepared").exists()  # refused before any work


def test_init_from_what_is_no_model_to_start_from_is_a_one_line_error(
    marian, data, tmp_path, capsys
):
    without_vocabulary = tmp_path / "no-vocab"
    shutil.copytree(marian, without_vocabulary)
    (without_vocabulary / "vocab.json").unlink()
    cases = [
        (without_vocabulary, "vocab.json: file not found"),
        (tmp_path / "missing", "missing: not a directory"),
        (nllb_directory(tmp_path), "--init-from fine-tunes Marian (Opus-MT) models"),
        (data, "holds no checkpoint (no model.safetensors"),
    ]
    for directory, message in cases:
        assert _train(data, tmp_path / "run", "--init-from", str(directory)) == 2
        error = _error(capsys)
        assert message in error and "\n" not in error


# ---------------------------------------------------------------------------------------------
# Export and the round trip


def _fastnmt_checkpoint(directory, cfg: ModelConfig, vocab) -> None:
    """A checkpoint of a random ``Transformer(cfg)``, weights drawn wide enough that searches
    do not all emit one token (as tests.integrations.transformers.models does)."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2:
                parameter.normal_(0, 1.0 if name == "embedding.weight" else 0.3)
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    saved = checkpoint.Checkpoint(weights, {"model": cfg.to_dict()}, vocab.to_bytes(), None)
    checkpoint.write(directory.parent, directory.name, saved)


def _tiny_config(vocab, **options) -> ModelConfig:
    shape = dict(d_model=32, heads=4, d_ff=48, encoder_layers=2, decoder_layers=2)
    specials = dict(pad_id=vocab.pad_id, bos_id=vocab.bos_id, eos_id=vocab.eos_id)
    settings = dict(dropout=0.0, attention_dropout=0.0, max_positions=64, prenorm=False)
    return ModelConfig(vocab_size=len(vocab), **shape, **specials, **settings | options)


@pytest.fixture(scope="module")
def scratch(folder, data):
    """A post-norm fastnmt model with its own joint vocabulary and fastnmt's interleaved
    positions, as ``python -m fastnmt.train --postnorm`` makes."""
    pairs = [line.split("\t") for line in (data / "train.tsv").read_text().splitlines()]
    vocab = Vocabulary.train([text for pair in pairs for text in pair], vocab_size=150)
    _fastnmt_checkpoint(folder / "scratch", _tiny_config(vocab, activation="gelu"), vocab)
    return folder / "scratch"


def _assert_generate_matches(hf_directory, fastnmt_model) -> None:
    """transformers' beam 4 on the Marian directory gives fastnmt's beam 4 translations (same
    length penalty, at most 12 new tokens), token for token."""
    hf = transformers.MarianMTModel.from_pretrained(hf_directory).eval()
    tokenizer = transformers.MarianTokenizer.from_pretrained(hf_directory)
    sources = [s for s, _ in _pairs("test_2016_flickr", 6)]
    generated = hf.generate(
        **tokenizer(sources, return_tensors="pt", padding=True), num_beams=4, max_new_tokens=12
    )
    translator = fastnmt.Translator.from_checkpoint(fastnmt_model, precision="fp32")
    found = translator.translate_full(sources, beam=4, lenpen=1.0, max_len_a=0, max_len_b=12)
    pad, eos = hf.generation_config.pad_token_id, hf.config.eos_token_id
    expected_ids = [[i for i in row.tolist()[1:] if i != pad] for row in generated]
    found_ids = [t.candidates[0].tokens + [eos] * t.candidates[0].ended for t in found]
    assert found_ids == expected_ids
    assert [t.text for t in found] == tokenizer.batch_decode(generated, skip_special_tokens=True)
    assert len({tuple(ids) for ids in found_ids}) > 1  # the sentences differ: a real comparison


def test_exported_model_computes_the_fastnmt_models_logits(scratch, tmp_path):
    """Through the permutation of the residual features that turns fastnmt's interleaved
    positions into Marian's halves."""
    assert _export(scratch, tmp_path / "hf") == 0
    model, vocab = fastnmt.translator.load_checkpoint(scratch)
    hf = transformers.MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    src = torch.randint(4, len(vocab), (3, 9))
    src[:, -1] = vocab.eos_id
    tgt = torch.randint(4, len(vocab), (3, 7))
    tgt[:, 0] = vocab.bos_id
    model.eval()
    with torch.no_grad():
        lengths = torch.full((3,), 9)
        expected = model.logits(model.decode(tgt, model.encode(src, lengths), lengths))
        found = hf(input_ids=src, decoder_input_ids=tgt).logits
    torch.testing.assert_close(found, expected, rtol=1e-4, atol=1e-4)
    _assert_generate_matches(tmp_path / "hf", scratch)


def test_round_trip_export_fine_tune_export(scratch, data, tmp_path):
    """A fastnmt model exported to Marian, fine-tuned from the export, exported again: each
    export loads in transformers and translates as fastnmt does; the fine-tuned checkpoint keeps
    the export's tokenizer and resumes."""
    assert _export(scratch, tmp_path / "hf") == 0
    run = tmp_path / "run"
    assert _train(data, run, "--init-from", str(tmp_path / "hf"), "--max-steps", "2") == 0
    assert (run / "checkpoint_last" / "marian_vocabulary.zip").exists()
    assert _export(run, tmp_path / "hf-fine-tuned") == 0
    _assert_generate_matches(tmp_path / "hf-fine-tuned", run)
    for name in ("source.spm", "target.spm", "vocab.json"):
        assert (tmp_path / "hf-fine-tuned" / name).read_bytes() == (
            tmp_path / "hf" / name
        ).read_bytes()
    assert _train(data, run, "--init-from", str(tmp_path / "hf"), "--max-steps", "3") == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert [r["step"] for r in records if r["event"] == "train"] == [1, 2, 3]  # resumed at 2


def test_fine_tuning_a_fastnmt_checkpoint_needs_no_transformers(scratch, data, tmp_path):
    blocked = "import sys; sys.modules['transformers'] = None; "
    command = blocked + "from fastnmt.train import main; sys.exit(main(sys.argv[1:]))"
    tsv = ["--train-tsv", str(data / "train.tsv"), "--valid-tsv", str(data / "valid.tsv")]
    result = subprocess.run(
        [sys.executable, "-c", command, *tsv, *TRAIN_OPTIONS, "--output-dir", str(tmp_path),
         "--init-from", str(scratch), "--max-steps", "1"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "checkpoint_last" / "spm.model").exists()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"prenorm": True}, "Marian's layers are post-norm and this model is pre-norm"),
        ({"positions": "fairseq"}, "this model has fairseq's (M2M100/NLLB) positions"),
    ],
)
def test_export_of_what_marian_cannot_express_is_a_one_line_error(
    scratch, tmp_path, capsys, options, message
):
    vocab = fastnmt.translator.load_checkpoint(scratch)[1]
    _fastnmt_checkpoint(tmp_path / "model", _tiny_config(vocab, **options), vocab)
    assert _export(tmp_path / "model", tmp_path / "hf") == 2
    error = _error(capsys)
    assert message in error and "\n" not in error
    assert not (tmp_path / "hf").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # nothing half-written left


def test_export_options_are_checked(scratch, tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    assert _export(scratch, tmp_path / "hf") == 2
    assert "exists; pass --force to replace it" in _error(capsys)
    arguments = ["--checkpoint", str(scratch), "--format", "huggingface", "--quantization", "int8"]
    assert export_main([*arguments, "--output", str(tmp_path / "other")]) == 2
    assert "--quantization is for --format ctranslate2" in _error(capsys)
