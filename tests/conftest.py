"""Test setup. Without a GPU, Triton kernels run in the Triton interpreter, which only works when
TRITON_INTERPRET=1 is set before the first ``import triton`` in the process: set it here, first."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import fastnmt
from tests.helpers import TRITON_DEVICE, require_backend


@pytest.fixture(autouse=True)
def _seeded_and_auto_backend(monkeypatch):
    """Fresh seeded randomness per test, and no backend forced from the environment."""
    monkeypatch.delenv(fastnmt.dispatch.ENV_VAR, raising=False)
    torch.manual_seed(0)


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
