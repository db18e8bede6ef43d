"""Test setup. Without a GPU, Triton kernels run in the Triton interpreter, which only works when
TRITON_INTERPRET=1 is set before the first ``import triton`` in the process: set it here, first."""

import gc
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import fastnmt
from tests.helpers import TRITON_DEVICE, require_backend, small_corpus

# Multi30k: the shared local copy beside the repository when there is one (CI: no download),
# else whatever the package finds ($FASTNMT_DATA_DIR, or its download cache).
_SHARED_MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"
if _SHARED_MULTI30K.is_dir():
    os.environ.setdefault("FASTNMT_DATA_DIR", str(_SHARED_MULTI30K))


# $FASTNMT_FAILURES_FILE: each failing test's id and the tail of its traceback, appended the
# moment it fails; $FASTNMT_DURATIONS_FILE: each test's seconds (setup, call and teardown) and id,
# appended the moment it ends (tools/gpu-check: a run its time limit cuts keeps both). With
# pytest-xdist the controller writes them, from the reports the workers send it.
FAILURES_FILE = "FASTNMT_FAILURES_FILE"
DURATIONS_FILE = "FASTNMT_DURATIONS_FILE"
FAILURE_LINES = 40
_xdist_worker = False
_seconds: dict[str, float] = {}  # per test id, its phases' seconds so far


def pytest_configure(config):
    global _xdist_worker
    _xdist_worker = hasattr(config, "workerinput")


def pytest_runtest_logreport(report):
    if _xdist_worker:
        return
    _log_failure(report)
    _log_duration(report)


def _log_failure(report):
    path = os.environ.get(FAILURES_FILE)
    if not path or not report.failed:
        return
    kind = "FAILED" if report.when == "call" else f"ERROR at {report.when}"
    tail = "".join(line + "\n" for line in report.longreprtext.splitlines()[-FAILURE_LINES:])
    _append(path, f"{kind} {report.nodeid}\n\n```\n{tail}```\n\n")


def _log_duration(report):
    path = os.environ.get(DURATIONS_FILE)
    if not path:
        return
    seconds = _seconds.pop(report.nodeid, 0.0) + report.duration
    if report.when == "teardown":
        _append(path, f"{seconds:.2f} {report.nodeid}\n")
    else:
        _seconds[report.nodeid] = seconds


def _append(path: str, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()


@pytest.fixture(autouse=True)
def _seeded_and_auto_backend(monkeypatch):
    """Fresh seeded randomness per test, no backend forced from the environment (which
    fastnmt reads at import and on ``environment.reload()``: tests that set a variable reload),
    and no object left frozen out of the garbage collector's reach."""
    monkeypatch.delenv(fastnmt.ops.settings.BACKEND, raising=False)
    monkeypatch.delenv(fastnmt.ops.settings.FFN_FUSED_GEMM, raising=False)
    fastnmt.ops.settings.reload()
    torch.manual_seed(0)
    yield
    monkeypatch.undo()
    fastnmt.ops.settings.reload()
    gc.unfreeze()  # what a command run in process froze (fastnmt.cli.load_translator)


@pytest.fixture(params=["triton", "cpp"])
def fused(request):
    """Each fused backend in turn, forced: Triton (compiled on a GPU; the interpreter on a CPU,
    where output buffers start as NaN, so an element a kernel fails to write shows) and the C++
    kernels. Tensors go on ``device_of(fused)`` (tests.helpers)."""
    require_backend(request.param)
    with fastnmt.backend(request.param):
        yield request.param


@pytest.fixture
def triton_device():
    """The device Triton tests put their tensors on: CUDA when present, else the CPU
    (interpreter)."""
    return TRITON_DEVICE


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """300 training and 20 validation pairs of Multi30k en-de as PREFIX.{en,de} files."""
    return small_corpus(tmp_path_factory.mktemp("corpus"))
