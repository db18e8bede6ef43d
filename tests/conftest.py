"""Test setup. Without a GPU, Triton kernels run in the Triton interpreter, which only works when
TRITON_INTERPRET=1 is set before the first ``import triton`` in the process: set it here, first."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import fastnmt
from tests.helpers import require_backend


@pytest.fixture(autouse=True)
def _seeded_and_auto_backend(monkeypatch):
    """Fresh seeded randomness per test, and no backend forced from the environment."""
    monkeypatch.delenv(fastnmt.dispatch.ENV_VAR, raising=False)
    torch.manual_seed(0)


@pytest.fixture(params=["triton", "cpp"])
def fused(request):
    """Each fused backend in turn, forced: Triton (interpreter on a CPU; output buffers start as
    NaN there, so an element a kernel fails to write shows) and the C++ kernels."""
    require_backend(request.param)
    with fastnmt.backend(request.param):
        yield request.param
