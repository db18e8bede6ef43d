"""fastnmt.precision: what ``auto`` chooses on each kind of CPU, the calibration's cache, and
what the command lines say about it."""

import inspect
import io
import json
import sys

import pytest
import torch

from fastnmt import evaluate, precision, train, translate
from fastnmt.model import preset
from fastnmt.precision import CpuFeatures, GemmShapes, choose_precision
from fastnmt.training.distributed import Distributed
from fastnmt.translator import Translator
from tests.helpers import tiny_checkpoint

AMX = CpuFeatures(amx=True, avx512_bf16=True, avx512=True, vnni=True, avx2=True)
AVX512_BF16 = CpuFeatures(amx=False, avx512_bf16=True, avx512=True, vnni=True, avx2=True)
AVX512 = CpuFeatures(amx=False, avx512_bf16=False, avx512=True, vnni=True, avx2=True)
AVX2 = CpuFeatures(amx=False, avx512_bf16=False, avx512=False, vnni=False, avx2=True)
# Seconds per calibration run as on an AVX512-BF16 CPU without AMX: bf16 1.66x slower than
# fp32, int8 1.6x faster.
ZEN4_SECONDS = {"fp32": 1.0, "bf16": 1.66, "int8": 0.625}


class FakeCalibration:
    """Stands in for ``precision.calibrate``: returns fixed seconds, records its calls."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds = seconds
        self.calls = []

    def __call__(self, purpose, candidates, shapes):
        self.calls.append((purpose, list(candidates), shapes))
        return {name: self.seconds[name] for name in candidates}


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """An empty user cache directory, and a process that has chosen nothing yet."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(precision, "_chosen", {})
    return tmp_path


@pytest.fixture
def cpu(monkeypatch, cache_home):
    """``cpu(features, seconds)``: this CPU as ``features``, the calibration faked (returned)."""

    def fake(features: CpuFeatures, seconds=ZEN4_SECONDS) -> FakeCalibration:
        calibration = FakeCalibration(seconds)
        monkeypatch.setattr(precision, "cpu_features", lambda: features)
        monkeypatch.setattr(precision, "calibrate", calibration)
        return calibration

    return fake


def _forget_this_process(monkeypatch):
    """A new process: the choices made so far are gone, the cache file stays."""
    monkeypatch.setattr(precision, "_chosen", {})


@pytest.mark.parametrize("purpose", precision.PURPOSES)
def test_amx_takes_bf16_without_measuring(cpu, purpose):
    calibration = cpu(AMX)
    choice = choose_precision(purpose, "cpu")
    assert choice.precision == "bf16" and "AMX" in choice.reason
    assert calibration.calls == []


def test_avx512_bf16_without_amx_trains_in_the_faster_fp32(cpu):
    calibration = cpu(AVX512_BF16)
    choice = choose_precision("training", "cpu", preset("tiny"))
    assert choice.precision == "fp32"
    assert calibration.calls == [("training", ["fp32", "bf16"], GemmShapes(256, 1024, 8000))]
    assert "no AMX" in choice.reason and "bf16 0.60x" in choice.reason


def test_avx512_bf16_without_amx_translates_in_the_fastest_of_three(cpu):
    calibration = cpu(AVX512_BF16)
    choice = choose_precision("translation", "cpu")
    assert choice.precision == "int8"
    assert calibration.calls[0][1] == ["fp32", "bf16", "int8"]
    assert "bf16 0.60x, int8 1.60x" in choice.reason


def test_bf16_where_it_is_measured_faster(cpu):
    cpu(AVX512_BF16, {"fp32": 1.0, "bf16": 0.5, "int8": 0.8})
    assert choose_precision("training", "cpu").precision == "bf16"
    assert choose_precision("translation", "cpu").precision == "bf16"


def test_a_lower_precision_must_win_by_the_margin(cpu):
    cpu(AVX512_BF16, {"fp32": 1.0, "bf16": 0.95, "int8": 0.95})
    choice = choose_precision("translation", "cpu")
    assert choice.precision == "fp32" and f">= {precision.MARGIN}x" in choice.reason


@pytest.mark.parametrize("features", [AVX512, AVX2], ids=["avx512-without-bf16", "avx2"])
def test_cpus_without_native_bf16_train_in_fp32_and_time_int8_for_translation(cpu, features):
    calibration = cpu(features)
    training = choose_precision("training", "cpu")
    assert training.precision == "fp32" and "no other training precision" in training.reason
    assert calibration.calls == []
    assert choose_precision("translation", "cpu").precision == "int8"
    assert [candidates for _, candidates, _ in calibration.calls] == [["fp32", "int8"]]


def test_gpus_take_their_half_precision_by_compute_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert choose_precision("translation", "cuda").precision == "fp16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert str(choose_precision("training", "cuda")).startswith("bf16 (this GPU computes in bf16")


def test_an_unknown_purpose_is_an_error_naming_it():
    with pytest.raises(ValueError, match="purpose must be one of training, translation"):
        choose_precision("inference", "cpu")


# ---------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------


def test_the_calibration_is_cached_per_machine_and_shape(cpu, monkeypatch):
    calibration = cpu(AVX512_BF16)
    first = choose_precision("translation", "cpu")
    assert choose_precision("translation", "cpu") == first  # this process: remembered
    _forget_this_process(monkeypatch)
    assert choose_precision("translation", "cpu") == first  # a new one: read from the cache
    assert len(calibration.calls) == 1
    entries = json.loads(precision.cache_path().read_text())
    (key,) = entries
    assert "translation" in key and torch.__version__ in key and "d_model 256" in key
    assert "1024 rows" in key  # an entry timed at another row count is measured again
    assert entries[key] == pytest.approx({"fp32": 1.0, "bf16": 1 / 1.66, "int8": 1.6})
    assert [p.name for p in precision.cache_path().parent.iterdir()] == ["precision.json"]


def test_another_shape_or_torch_version_is_measured_again(cpu, monkeypatch):
    calibration = cpu(AVX512_BF16)
    choose_precision("training", "cpu")
    choose_precision("training", "cpu", preset("tiny", d_model=512))
    _forget_this_process(monkeypatch)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    choose_precision("training", "cpu")
    assert len(calibration.calls) == 3
    assert len(json.loads(precision.cache_path().read_text())) == 3


@pytest.mark.parametrize(
    "content",
    ["{not json", "[1, 2]", '{"training | another": 1}', ""],
    ids=["not-json", "a-list", "a-foreign-entry", "empty"],
)
def test_a_corrupt_cache_is_ignored_and_rewritten(cpu, content):
    calibration = cpu(AVX512_BF16)
    path = precision.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(content)
    assert choose_precision("training", "cpu").precision == "fp32"
    assert len(calibration.calls) == 1
    assert len(json.loads(path.read_text())) >= 1


def test_a_cached_entry_of_other_candidates_is_measured_again(cpu, monkeypatch):
    calibration = cpu(AVX512_BF16)
    choose_precision("translation", "cpu")
    path = precision.cache_path()
    entries = json.loads(path.read_text())
    path.write_text(json.dumps({key: {"fp32": 1.0, "int8": "fast"} for key in entries}))
    _forget_this_process(monkeypatch)
    choose_precision("translation", "cpu")
    assert len(calibration.calls) == 2


def test_an_unwritable_cache_costs_a_calibration_not_an_error(cpu, cache_home):
    (cache_home / "fastnmt").write_text("a file where the cache directory should be")
    calibration = cpu(AVX512_BF16)
    assert choose_precision("training", "cpu").precision == "fp32"
    assert len(calibration.calls) == 1


def test_cache_path_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert precision.cache_path() == tmp_path / "fastnmt" / "precision.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert precision.cache_path() == tmp_path / ".cache" / "fastnmt" / "precision.json"


def test_translation_is_timed_at_beam_4_over_the_translators_default_batch():
    # The row count decides between bf16 and int8 (fastnmt.precision's ROWS).
    default = inspect.signature(Translator).parameters["max_sentences"].default
    assert precision.ROWS["translation"] == 4 * default


@pytest.mark.parametrize("purpose", precision.PURPOSES)
def test_the_real_calibration_times_every_candidate(purpose):
    candidates = precision.cpu_candidates(purpose, AVX512_BF16)
    shapes = GemmShapes(d_model=32, d_ff=64, vocab=100)
    state = torch.get_rng_state()
    seconds = precision.calibrate(purpose, candidates, shapes)
    assert list(seconds) == candidates and all(s > 0 for s in seconds.values())
    assert torch.equal(torch.get_rng_state(), state)  # seeded runs stay as they were


# ---------------------------------------------------------------------------------------------
# What the command lines say
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [train, translate, evaluate])
def test_help_says_how_auto_decides(module):
    text = " ".join(module.build_parser().format_help().split())
    assert "bf16 with AMX" in text and "GEMM calibration at the model's shapes" in text


def test_training_logs_what_auto_chose_and_why(cpu, corpus, tmp_path, capsys):
    calibration = cpu(AVX512_BF16)
    arguments = [
        "--train", str(corpus / "train"), "--valid", str(corpus / "val"), "--vocab-size", "300",
        "--d-model", "32", "--heads", "2", "--d-ff", "64", "--encoder-layers", "1",
        "--decoder-layers", "1", "--max-tokens", "400", "--max-steps", "1", "--no-progress",
        "--device", "cpu", "--output-dir", str(tmp_path), "--average-last", "1",
    ]  # fmt: skip
    assert train.main(arguments) == 0
    said = "precision fp32 (AVX512-BF16 AVX-512 VNNI AVX2, no AMX: GEMMs at this model's shapes"
    assert said in capsys.readouterr().err
    assert calibration.calls[0][2] == GemmShapes(32, 64, 300)


def test_a_precision_given_is_logged_as_given():
    world = Distributed.from_environment(torch.device("cpu"))
    given = train.resolve_precision("bf16", torch.device("cpu"), preset("tiny"), world)
    assert str(given) == "bf16 (given by --precision)"


@pytest.mark.parametrize("given", ["auto", "fp32"])
def test_translation_says_what_auto_chose_and_why(cpu, tmp_path, monkeypatch, capsys, given):
    cpu(AVX2)
    checkpoint_dir = tiny_checkpoint(tmp_path / "checkpoint")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"A dog.\n")))
    arguments = ["--checkpoint", str(checkpoint_dir), "--max-len-b", "2", "--precision", given]
    assert translate.main([*arguments, "--device", "cpu"]) == 0  # a GPU's auto is bf16
    said = "precision int8 (AVX2, no AMX: GEMMs at this model's shapes, speed vs fp32: int8 1.60x"
    assert (said in capsys.readouterr().err) == (given == "auto")
