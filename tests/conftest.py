"""Test setup. Without a GPU, Triton kernels run in the Triton interpreter, which only works when
TRITON_INTERPRET=1 is set before the first ``import triton`` in the process: set it here, first."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import fastnmt


@pytest.fixture(autouse=True)
def _seeded_and_auto_backend(monkeypatch):
    """Fresh seeded randomness per test, and no backend forced from the environment."""
    monkeypatch.delenv(fastnmt.dispatch.ENV_VAR, raising=False)
    torch.manual_seed(0)
