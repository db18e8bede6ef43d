"""What ``--precision auto`` means on this machine, and why: ``choose_precision``.

Training and translation are decided separately, each for the model's shapes:
- a GPU: bf16 where it computes in it (compute capability 8.0 or later), else fp16 (bf16 is only
  emulated there);
- a CPU with AMX: bf16 (its tile units multiply bf16 several times faster than fp32);
- another CPU: the fastest of its candidates in a short GEMM calibration at the model's shapes.
  Training weighs fp32 against bf16 autocast (forward and backward, with autocast's casts) where
  the CPU has AVX512-BF16; translation weighs fp32, bf16 (packed weights) and int8 (fbgemm, or
  oneDNN between bf16 activations where the CPU has native bf16), the GEMMs ``fastnmt.quantize``
  runs. int8 is a candidate because it cost at most 0.3 BLEU against fp32 on test2016 in every
  measurement of the default model (beam 4: -0.07 on an AVX2 CPU, -0.01 and +0.11 on
  AVX512-BF16 ones; greedy: -0.29 and -0.01). A CPU with neither AVX512-BF16 nor AMX emulates
  bf16, so it is no candidate there.

A precision other than fp32 must be at least ``MARGIN`` times fp32's speed to be chosen: a short
calibration is noisy, and a tie should not give up precision. The calibration takes well under
a second, runs once per process and shape, and its result is kept in the user's cache directory
(``cache_path()``) per CPU model, ISA, thread count, torch version and shape, so it runs once per
machine. See docs/cpu-precision.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fastnmt.model import ModelConfig
from fastnmt.quantize import Bf16Linear, int8_activation_dtype, int8_linear, int8_supported

PURPOSES = ("training", "translation")
MARGIN = 1.1
# GEMM rows of the calibration: a slice of a training batch's tokens, and a decoding step of
# beam 4 over the Translator's default batch of 256 sentences. The row count decides the answer:
# on an AVX512-BF16 CPU without AMX, fbgemm's int8 GEMMs (fp32 activations) lead bf16's 1.1x at
# 128 rows and trail them 1.28x at 1,024, as beam-4 translations in the default batches do (bf16
# 1.35x).
# Past a few thousand words the output layer's speed per row no longer depends on the
# vocabulary's size.
ROWS = {"training": 256, "translation": 4 * 256}
MAX_VOCAB = 8192
TIMED_RUNS = 4
CACHE_FILE = "precision.json"

AUTO_HELP = {
    "training": "auto (default): a GPU's half precision; on a CPU, bf16 with AMX, else the faster "
    "of fp32 and bf16 autocast in a GEMM calibration at the model's shapes, cached "
    "(docs/cpu-precision.md)",
    "translation": "auto (default): a GPU's half precision; on a CPU, bf16 with AMX, else the "
    "fastest of fp32, bf16 and int8 in a GEMM calibration at the model's shapes, cached "
    "(docs/cpu-precision.md)",
}


@dataclass(frozen=True)
class CpuFeatures:
    """The instruction sets that decide a CPU's precision."""

    amx: bool
    avx512_bf16: bool
    avx512: bool
    vnni: bool
    avx2: bool

    @property
    def native_bf16(self) -> bool:
        return self.amx or self.avx512_bf16

    def __str__(self) -> str:
        names = {
            "AMX": self.amx,
            "AVX512-BF16": self.avx512_bf16,
            "AVX-512": self.avx512,
            "VNNI": self.vnni,
            "AVX2": self.avx2,
        }
        return " ".join(name for name, present in names.items() if present) or "no AVX2"


def cpu_features() -> CpuFeatures:
    """This CPU's features, from torch's cpuinfo queries (any OS; torch 2.x keeps them private,
    as the oneDNN query fastnmt.quantize uses)."""
    return CpuFeatures(
        amx=torch.cpu._is_amx_tile_supported(),
        avx512_bf16=torch.cpu._is_avx512_bf16_supported(),
        avx512=torch.cpu._is_avx512_supported(),
        vnni=torch.cpu._is_vnni_supported(),
        avx2=torch.cpu._is_avx2_supported(),
    )


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; a virtual machine may show a generic one,
    which is why the cache key also holds the features)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class PrecisionChoice:
    """A precision ``auto`` resolved to, and why."""

    precision: str  # fp32, bf16, fp16 or int8
    reason: str

    def __str__(self) -> str:
        return f"{self.precision} ({self.reason})"


@dataclass(frozen=True)
class GemmShapes:
    """The GEMM widths a model's layers run: the feed-forward's and the output layer's."""

    d_model: int
    d_ff: int
    vocab: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> GemmShapes:
        return cls(cfg.d_model, cfg.d_ff, min(cfg.vocab_size, MAX_VOCAB))

    def __str__(self) -> str:
        return f"d_model {self.d_model}, d_ff {self.d_ff}, vocab {self.vocab}"


def choose_precision(
    purpose: str, device: torch.device | str, cfg: ModelConfig | None = None
) -> PrecisionChoice:
    """What ``auto`` means for ``purpose`` (training or translation) of a model of ``cfg``'s
    shapes (default: the tiny preset's) on ``device``, and why."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}")
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) >= (8, 0):
            return PrecisionChoice("bf16", "this GPU computes in bf16 (compute capability 8.0+)")
        return PrecisionChoice("fp16", "this GPU predates bf16 (compute capability < 8.0)")
    if device.type != "cpu":
        return PrecisionChoice("fp32", f"no faster precision is known on {device.type}")
    return _cpu_choice(purpose, GemmShapes.of(cfg or ModelConfig()))


def _cpu_choice(purpose: str, shapes: GemmShapes) -> PrecisionChoice:
    features = cpu_features()
    if features.amx:
        return PrecisionChoice("bf16", "this CPU has AMX, whose bf16 GEMMs outrun fp32's")
    candidates = cpu_candidates(purpose, features)
    if len(candidates) == 1:
        return PrecisionChoice("fp32", f"{features}: no other {purpose} precision runs natively")
    key = f"{purpose} | {cpu_model()} | {features} | {torch.get_num_threads()} threads | torch "
    key += f"{torch.__version__} | {shapes} | {ROWS[purpose]} rows"
    if key not in _chosen:
        speeds = _cached_speeds(key, candidates)
        if speeds is None:
            seconds = calibrate(purpose, candidates, shapes)
            speeds = {name: seconds["fp32"] / s for name, s in seconds.items()}
            _store_speeds(key, speeds)
        _chosen[key] = _fastest(speeds, features)
    return _chosen[key]


# The choices of this process, by cache key: the calibration runs at most once per shape.
_chosen: dict[str, PrecisionChoice] = {}


def cpu_candidates(purpose: str, features: CpuFeatures) -> list[str]:
    """The precisions worth timing on a CPU of ``features`` (without AMX), fp32 first."""
    candidates = ["fp32"]
    if features.avx512_bf16 and torch.backends.mkldnn.is_available():
        candidates.append("bf16")
    if purpose == "translation" and not int8_supported("cpu"):
        candidates.append("int8")
    return candidates


def _fastest(speeds: dict[str, float], features: CpuFeatures) -> PrecisionChoice:
    """The fastest precision by ``speeds`` (relative to fp32), fp32 unless one beats MARGIN."""
    best = max(speeds, key=speeds.__getitem__)
    chosen = best if speeds[best] >= MARGIN else "fp32"
    measured = ", ".join(f"{name} {speeds[name]:.2f}x" for name in speeds if name != "fp32")
    return PrecisionChoice(
        chosen,
        f"{features}, no AMX: GEMMs at this model's shapes, speed vs fp32: {measured} "
        f"(another precision needs >= {MARGIN}x)",
    )


# ---------------------------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------------------------


def calibrate(purpose: str, candidates: list[str], shapes: GemmShapes) -> dict[str, float]:
    """Seconds of one run of ``purpose``'s GEMMs at ``shapes`` in each candidate precision (the
    best of TIMED_RUNS after a warm-up, which also builds oneDNN's kernels), on random weights and
    inputs drawn without touching torch's random stream."""
    build = _training_gemms if purpose == "training" else _translation_gemms
    with torch.random.fork_rng(devices=[]):  # the caller's random stream stays as it was
        runs = {precision: build(precision, shapes) for precision in candidates}
    for run in runs.values():
        run()
    seconds = dict.fromkeys(candidates, float("inf"))
    # In rounds, so that a busy spell of the machine falls on every candidate alike; the best
    # time of each leaves out the runs another process interrupted.
    for _ in range(TIMED_RUNS):
        for precision, run in runs.items():
            start = time.perf_counter()
            run()
            seconds[precision] = min(seconds[precision], time.perf_counter() - start)
    return seconds


def _feed_forward_weights(shapes: GemmShapes) -> tuple[nn.Linear, nn.Linear]:
    return nn.Linear(shapes.d_model, shapes.d_ff), nn.Linear(shapes.d_ff, shapes.d_model)


def _training_gemms(precision: str, shapes: GemmShapes) -> Callable[[], None]:
    """A feed-forward layer's forward and backward as the trainer runs it (bf16: autocast, which
    casts the fp32 weights at every step)."""
    first, second = _feed_forward_weights(shapes)
    x = torch.randn(ROWS["training"], shapes.d_model, requires_grad=True)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    def run() -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=precision == "bf16"):
            y = second(F.relu(first(x)))
        y.float().sum().backward()

    return run


def _translation_gemms(precision: str, shapes: GemmShapes) -> Callable[[], None]:
    """A decoding step's feed-forward layer and output layer in the GEMMs ``fastnmt.translator``
    runs for ``precision``."""
    first, second = _feed_forward_weights(shapes)
    output = nn.Linear(shapes.d_model, shapes.vocab, bias=False)
    if precision == "fp32":
        layers: list[Callable] = [nn.Sequential(first, nn.ReLU()), second, output]
        x = torch.randn(ROWS["translation"], shapes.d_model)
    else:
        dtype = int8_activation_dtype("cpu") if precision == "int8" else torch.bfloat16
        packed = int8_linear(dtype) if precision == "int8" else Bf16Linear
        layers = [
            packed.from_linear(layer.to(dtype), activation)
            for layer, activation in ((first, "relu"), (second, None), (output, None))
        ]
        x = torch.randn(ROWS["translation"], shapes.d_model, dtype=dtype)

    @torch.inference_mode()
    def run() -> None:
        h = x
        for layer in layers:
            h = layer(h)

    return run


# ---------------------------------------------------------------------------------------------
# Cache: {key: {precision: speed relative to fp32}} in one JSON file, replaced atomically.
# ---------------------------------------------------------------------------------------------


def cache_path() -> Path:
    """$XDG_CACHE_HOME/fastnmt/precision.json (~/.cache when XDG_CACHE_HOME is unset or not an
    absolute path, as the XDG specification says)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return root / "fastnmt" / CACHE_FILE


def _read_cache() -> dict:
    """The cache's entries; {} when it is missing or unreadable (it is then rewritten)."""
    try:
        entries = json.loads(cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _cached_speeds(key: str, candidates: list[str]) -> dict[str, float] | None:
    speeds = _read_cache().get(key)
    valid = (
        isinstance(speeds, dict)
        and list(speeds) == candidates
        and all(isinstance(s, (int, float)) and s > 0 for s in speeds.values())
    )
    return speeds if valid else None


def _store_speeds(key: str, speeds: dict[str, float]) -> None:
    """Add an entry; a cache that cannot be written costs a calibration next time, no error."""
    path = cache_path()
    entries = {**_read_cache(), key: speeds}
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=path.parent, prefix=f".{path.name}.", delete=False, encoding="utf-8"
        ) as file:
            temporary = file.name
            json.dump(entries, file, indent=1)
        os.replace(temporary, path)  # readers see the old file or the new one, never a part
    except OSError:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


# ---------------------------------------------------------------------------------------------
# The dtype / precision name forms the trainer and the translator take.
# ---------------------------------------------------------------------------------------------

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def fastest_dtype(device: torch.device | str, cfg: ModelConfig | None = None) -> torch.dtype | None:
    """The autocast dtype ``auto`` trains in (None: fp32); ``choose_precision`` says why."""
    return _DTYPES[choose_precision("training", device, cfg).precision]


def fastest_precision(device: torch.device | str, cfg: ModelConfig | None = None) -> str:
    """The precision ``auto`` translates in; ``choose_precision`` says why."""
    return choose_precision("translation", device, cfg).precision
