"""Shared harness of the benchmarks: NMT-shaped cases, parametrized fixtures and the ``bench``
fixture that times a call, measures its peak memory and records everything in ``extra_info``.

The benchmark modules are imported with ``--import-mode=importlib`` and so cannot import each other
or a helper module; everything they share lives here, reached through fixtures. Every benchmark
takes the fixtures ``impl`` (a fastnmt backend, forced; with "torch" the benchmark calls the
PyTorch built-ins the op replaces itself), ``case`` (shape and padding), ``dtype`` and
``pass_name`` ("fwd" or "fwd+bwd").

Run: ``pytest benchmarks --benchmark-only`` (add ``--benchmark-json=FILE`` to keep extra_info).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import fastnmt
from fastnmt.devices import configure_process
from fastnmt.precision import cpu_features

# As the command-line tools, with the primitive cache of a translating process: the rows decode
# as `python -m fastnmt.translate` does (the training cap changes memory, not speed), and the
# server the load benchmark starts inherits it.
configure_process(decoding=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BATCH = 64  # sentences per batch
# Tokens in the longest sentence of the batch, and the share of the B * L positions that are
# padding; a GPU gets the fuller grid of MT lengths, a CPU a subset that runs in minutes.
ON_GPU = DEVICE.type == "cuda"
MAX_LENGTHS = (16, 32, 64, 128) if ON_GPU else (16, 64)
PADDING_RATIOS = (0.0, 0.25, 0.5) if ON_GPU else (0.0, 0.4)
WIDTHS = ((256, 4), (512, 8))  # (d_model, heads): Transformer-small and -base, head_dim 64
DROPOUT = 0.1
SEED = 0
# bf16 is the half type CPUs compute in (AVX512-BF16, AMX); fp16, common on GPUs, joins there.
DTYPES = (torch.float32, torch.bfloat16) + ((torch.float16,) if DEVICE.type == "cuda" else ())
PASSES = ("fwd", "fwd+bwd")
IMPLS = fastnmt.BACKENDS

# Rounds per benchmark: enough to fill TARGET_SECONDS, within [min rounds, MAX_ROUNDS]. Fixed
# round counts (pedantic mode) rather than pytest-benchmark's calibration, which would spend its
# full max_time (1 s) on every one of the ~250 CPU benchmarks.
TARGET_SECONDS = 0.3
MAX_ROUNDS = 1000
# Beside every row: which precision is fastest, and by how much, depends on these.
CPU_ISA = str(cpu_features())


def pytest_report_header() -> str:
    return f"CPU instruction sets: {CPU_ISA}"


@pytest.fixture(autouse=True)
def _cpu_isa(request) -> None:
    """Every benchmark row records the CPU's instruction sets (AMX, AVX512-BF16, VNNI, AVX2)."""
    if "benchmark" in request.fixturenames:
        request.getfixturevalue("benchmark").extra_info["cpu_isa"] = CPU_ISA


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    """The versions that decide the figures, beside pytest-benchmark's CPU and Python, for
    benchmarks/results.py to state with them."""
    versions = {"torch": torch.__version__, "fastnmt": fastnmt.__version__}
    for name in ("triton", "transformers", "ctranslate2"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    machine_info["fastnmt_versions"] = versions


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Interpreted Triton runs kernels in numpy on the CPU: its timings would mean nothing. Checked
    # after collection because tests/conftest.py sets TRITON_INTERPRET=1 on CPU-only machines
    # when it is imported, which a run of the whole repository does after this file.
    here = Path(__file__).parent
    benchmarks = any(item.path.is_relative_to(here) for item in items)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if benchmarks and interpreted and not config.getoption("benchmark_skip"):
        raise pytest.UsageError(
            "the benchmarks cannot run with TRITON_INTERPRET=1 (Triton's interpreter is a "
            "debugging tool, orders of magnitude slower than compiled kernels; tests/conftest.py "
            "sets it on machines without CUDA): run `pytest benchmarks` on its own with it unset, "
            "or pass --ignore=benchmarks or --benchmark-skip"
        )


# ---------------------------------------------------------------------------------------------
# Cases: batch shape and padding.
# ---------------------------------------------------------------------------------------------


def sentence_lengths(batch: int, max_len: int, padding: float, seed: int) -> tuple[int, ...]:
    """Random lengths in [1, max_len], one of them max_len (the batch is padded to its longest
    sentence), summing to exactly round((1 - padding) * batch * max_len) tokens."""
    rng = random.Random(seed)
    target = round((1.0 - padding) * batch * max_len)
    low = max(1, round((1.0 - 2.0 * padding) * max_len))  # uniform [low, max_len]: mean on target
    lengths = [max_len] + [rng.randint(low, max_len) for _ in range(batch - 1)]
    while sum(lengths) != target:  # nudge random sentences (not the longest) one token at a time
        i = rng.randrange(1, batch)
        step = 1 if sum(lengths) < target else -1
        if 1 <= lengths[i] + step <= max_len:
            lengths[i] += step
    return tuple(lengths)


@dataclass(frozen=True)
class Case:
    max_len: int
    padding: float
    d_model: int
    heads: int
    batch: int = BATCH

    @property
    def lengths(self) -> tuple[int, ...]:
        return sentence_lengths(self.batch, self.max_len, self.padding, SEED)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def tokens(self) -> int:
        """Real (non-pad) tokens: what a throughput should count."""
        return sum(self.lengths)

    @property
    def id(self) -> str:
        return f"L{self.max_len}-pad{round(100 * self.padding)}-d{self.d_model}h{self.heads}"

    def key_lengths(self) -> torch.Tensor:
        return torch.tensor(self.lengths, device=DEVICE)

    def key_padding_mask(self) -> torch.Tensor:
        """Bool (B, L), True = padding (nn.MultiheadAttention's convention)."""
        return torch.arange(self.max_len, device=DEVICE) >= self.key_lengths()[:, None]

    def info(self) -> dict:
        return {
            "batch": self.batch,
            "max_len": self.max_len,
            "padding_ratio": round(1.0 - self.tokens / (self.batch * self.max_len), 4),
            "d_model": self.d_model,
            "heads": self.heads,
        }


CASES = tuple(
    Case(max_len, padding, d_model, heads)
    for max_len in MAX_LENGTHS
    for padding in PADDING_RATIOS
    for d_model, heads in WIDTHS
)


@pytest.fixture(params=IMPLS)
def impl(request) -> str:
    return request.param


@pytest.fixture(params=CASES, ids=lambda case: case.id)
def case(request) -> Case:
    return request.param


@pytest.fixture(params=DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
def dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture(params=PASSES)
def pass_name(request) -> str:
    return request.param


# ---------------------------------------------------------------------------------------------
# Measuring one call.
# ---------------------------------------------------------------------------------------------


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def peak_memory_mb(call: Callable[[], None]) -> float:
    """Peak extra memory of one ``call()``: the most bytes allocated during the call on top of
    what was allocated before it (outputs, tensors saved for backward, temporaries, gradients;
    not the inputs). The caller frees earlier gradients first, so the call frees nothing older.
    """
    if DEVICE.type == "cuda":
        synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        call()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    return _cpu_peak_bytes(call) / 2**20


def _cpu_peak_bytes(call: Callable[[], None]) -> int:
    """CPU has no allocator statistics; the profiler records every allocation and free that goes
    through PyTorch's CPU allocator (buffers a library such as oneDNN allocates by itself are not
    seen). The running sum of those events in time order, at its highest, is the peak.

    The public event list is no good here: its "[memory]" rows are only the events that happened
    outside any op (in practice the frees), while allocations are folded into the ops' totals,
    which loses their order. The event tree keeps each allocation as its own timed node.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        pending.extend(node.children)
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
    running = peak = 0
    for _, size in sorted(events):
        running += size
        peak = max(peak, running)
    return peak


class Bench:
    """One benchmark: makes its inputs and times ``forward`` under its impl, case, dtype and pass.

    fwd: forward under ``torch.no_grad()`` (no autograd graph), so every row measures the same
    work. fwd+bwd: inputs and parameters require grad; the output is backpropagated with a fixed
    random gradient, and every gradient is set to None before each round so none accumulate.
    """

    dropout = DROPOUT  # of the residual+LayerNorm and feed-forward benchmarks

    def __init__(self, benchmark, min_rounds: int, impl, case: Case, dtype, pass_name: str):
        self.benchmark, self.min_rounds = benchmark, min_rounds
        self.impl, self.case, self.dtype, self.pass_name = impl, case, dtype, pass_name
        self.backward = pass_name == "fwd+bwd"
        self._leaves: list[torch.Tensor] = []
        self._grads: dict[torch.Size, torch.Tensor] = {}
        torch.manual_seed(SEED)

    # Inputs --------------------------------------------------------------------------------

    def tensor(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` on the benchmark's device and dtype, a leaf that requires grad in fwd+bwd."""
        leaf = value.to(DEVICE, self.dtype).requires_grad_(self.backward)
        self._leaves.append(leaf)
        return leaf

    def randn(self, *shape: int) -> torch.Tensor:
        return self.tensor(torch.randn(shape))

    def module(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` on the benchmark's device and dtype; its parameters are leaves."""
        module = module.to(DEVICE, self.dtype)
        self._leaves.extend(module.parameters())
        return module

    # Running ---------------------------------------------------------------------------------

    def skip_unless_supported(self, op_name: str, *args, **kwargs) -> None:
        """Skip a fastnmt backend that cannot run ``fastnmt.ops.<op_name>(*args, **kwargs)``,
        with dispatch's own reasons."""
        with fastnmt.backend("auto"):  # explain() must not trip over FASTNMT_BACKEND
            reasons = fastnmt.explain(op_name, *args, **kwargs)[self.impl]
        if reasons:
            pytest.skip(f"{self.impl} cannot run {op_name}: " + "; ".join(reasons))

    def run(
        self,
        op: str,
        label: str,
        forward: Callable[[], torch.Tensor],
        *,
        forward_flops: float = 0.0,
        forward_bytes: float = 0.0,
    ) -> None:
        """Time ``forward`` (which calls ``label``) and record the results in extra_info.

        ``forward_flops`` / ``forward_bytes``: the forward's arithmetic / minimal memory traffic,
        reported as TFLOP/s / GB/s; a backward counts as 2.5x the forward's FLOPs (FlashAttention's
        convention) and 1.5x its bytes (it reads the gradients besides the saved tensors)."""
        with fastnmt.backend(self.impl):
            step = self._step(forward)
            self._clear_grads()
            peak_mb = peak_memory_mb(step)  # untimed, as is _rounds' call: they are the warm-up
            rounds = self._rounds(step)
            self.benchmark.group = op
            self.benchmark.pedantic(step, setup=self._clear_grads, rounds=rounds)
        info = {"op": op, "backend": self.impl, "impl": label, "device": DEVICE.type}
        info.update(self.case.info())
        info.update({"dtype": str(self.dtype).removeprefix("torch."), "pass": self.pass_name})
        info.update(tokens=self.case.tokens, rounds=rounds, peak_mem_mb=round(peak_mb, 2))
        if self.benchmark.stats is not None:  # None under --benchmark-disable: a single call
            median = self.benchmark.stats.stats.median
            info["tokens_per_s"] = round(self.case.tokens / median)
            flops = forward_flops * (3.5 if self.backward else 1.0)
            traffic = forward_bytes * (2.5 if self.backward else 1.0)
            if flops:
                info["tflops"] = round(flops / median / 1e12, 4)
            if traffic:
                info["gb_per_s"] = round(traffic / median / 1e9, 2)
        self.benchmark.extra_info.update(info)

    def _step(self, forward: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def forward_only() -> None:
            with torch.no_grad():
                forward()
            synchronize()  # CUDA runs asynchronously: time the kernels, not their launch

        def forward_backward() -> None:
            out = forward()
            out.backward(self._grad_like(out))
            synchronize()

        return forward_backward if self.backward else forward_only

    def _grad_like(self, out: torch.Tensor) -> torch.Tensor:
        """A fixed random output gradient, made once (the first call is not timed)."""
        if out.shape not in self._grads:
            generator = torch.Generator().manual_seed(SEED)
            grad = torch.randn(out.shape, generator=generator)
            self._grads[out.shape] = grad.to(out.device, out.dtype)
        return self._grads[out.shape]

    def _clear_grads(self) -> None:
        for leaf in self._leaves:
            leaf.grad = None

    def _rounds(self, step: Callable[[], None]) -> int:
        """Rounds that fill about TARGET_SECONDS, judged from one (warm-up) call."""
        self._clear_grads()
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
        return max(self.min_rounds, min(MAX_ROUNDS, math.ceil(TARGET_SECONDS / seconds)))


@pytest.fixture
def bench(request, benchmark, impl, case, dtype, pass_name) -> Bench:
    min_rounds = request.config.getoption("benchmark_min_rounds")  # default 5
    return Bench(benchmark, min_rounds, impl, case, dtype, pass_name)


@pytest.fixture
def peak_memory() -> Callable[[Callable[[], None]], float]:
    """``peak_memory_mb`` for benchmark modules, which cannot import this one."""
    return peak_memory_mb
