"""Host cost of one op call: each fused op's forward + backward on tiny tensors, whose kernels take
next to no time, against its PyTorch equivalent. What is left is the Python, dispatcher and
allocation work of a call, which at translation shapes on a GPU is most of an op's wall time (a
kernel takes tens of microseconds), and the same Python runs there.

Each row times fastnmt's auto backend and PyTorch alternately in one run (medians of
``SAMPLES`` batches of ``CALLS_PER_SAMPLE`` steps) and records in extra_info: ``ratio`` (fastnmt's
time / PyTorch's: the target is at most 1.2), both times in µs, and per step the Python function
calls and the aten ops dispatched. A step is ``forward().sum().backward()`` on both sides, or
in the ``forward, no grad`` rows the forward alone under ``torch.no_grad()`` (decoding and
validation: no autograd to record, see ``fastnmt.ops.dispatch``).

Without a GPU a second row per op takes the Triton path on CPU tensors with its launches stubbed
out (``path="triton, kernels stubbed"``): the host work a GPU call makes (checks, dispatch, Python
autograd, launch configuration, allocations) without the kernels or the interpreter. On a GPU the
auto row is that path, launches included.

Run: ``pytest benchmarks/ops/bench_dispatch.py --benchmark-only --benchmark-json=host.json``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fastnmt
from fastnmt import ops
from fastnmt.ops import dispatch
from fastnmt.ops.triton import common as triton_common
from tests.helpers import python_calls

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SAMPLES, CALLS_PER_SAMPLE = 15, 200


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, requires_grad=True)


def _calls() -> dict[str, tuple[Callable, Callable]]:
    """op -> (fastnmt's call, PyTorch's equivalent), each returning a tensor."""
    torch.manual_seed(0)
    q, k, v = _leaf(2, 2, 4, 8), _leaf(2, 2, 4, 8), _leaf(2, 2, 4, 8)
    lengths = torch.tensor([4, 3], device=DEVICE)
    visible = torch.arange(4, device=DEVICE) < lengths[:, None, None, None]  # (B, 1, 1, Lk)
    x, residual, weight, bias = _leaf(4, 16), _leaf(4, 16), _leaf(16), _leaf(16)
    w1, b1, w2, b2 = _leaf(32, 16), _leaf(32), _leaf(16, 32), _leaf(16)
    hidden, embedding = _leaf(8, 16), _leaf(50, 16)
    target = torch.randint(0, 50, (8,), device=DEVICE)
    return {
        "attention": (
            lambda: ops.attention(q, k, v, key_lengths=lengths),
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=visible),
        ),
        "add_layer_norm": (
            lambda: ops.add_layer_norm(x, residual, weight, bias)[0],
            lambda: F.layer_norm(x + residual, (16,), weight, bias),
        ),
        "feed_forward": (
            lambda: ops.feed_forward(x, w1, b1, w2, b2),
            lambda: F.linear(F.relu(F.linear(x, w1, b1)), w2, b2),
        ),
        "linear_cross_entropy": (
            lambda: ops.linear_cross_entropy(hidden, embedding, None, target).loss,
            lambda: F.cross_entropy(F.linear(hidden, embedding), target),
        ),
    }


TRAINING, INFERENCE = "fwd+bwd", "forward, no grad"


def _step(forward: Callable[[], torch.Tensor], mode: str) -> Callable[[], None]:
    def step() -> None:
        forward().sum().backward()

    def inference() -> None:
        with torch.no_grad():
            forward()

    return step if mode == TRAINING else inference


def _microseconds(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    for _ in range(CALLS_PER_SAMPLE):
        step()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / CALLS_PER_SAMPLE * 1e6


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _aten_ops(step: Callable[[], None]) -> int:
    with _AtenOps() as counter:
        step()
    return counter.count


STUBBED = "triton, kernels stubbed"
PATHS = ["auto"] if DEVICE.type == "cuda" else ["auto", STUBBED]


def _stub_the_triton_kernels(monkeypatch) -> None:
    """Triton chosen for CPU tensors, each launch a no-op (outputs stay uninitialised)."""
    monkeypatch.setitem(dispatch._DEVICE_REASONS, "triton", lambda device, forced: [])
    monkeypatch.setattr(triton_common.Launcher, "__call__", lambda *args: None)


@pytest.mark.parametrize("mode", [TRAINING, INFERENCE])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("op", list(_calls()))
def test_host_cost(benchmark, op, path, mode, monkeypatch):
    if path == STUBBED:
        _stub_the_triton_kernels(monkeypatch)
    with fastnmt.backend("triton" if path == STUBBED else "auto"):
        _measure(benchmark, op, path, mode)


def _measure(benchmark, op: str, path: str, mode: str) -> None:
    ours, theirs = (_step(forward, mode) for forward in _calls()[op])
    for step in (ours, theirs):  # warm-up: first-call caches, allocator
        for _ in range(20):
            step()
    samples = {"fastnmt": [], "torch": []}
    for _ in range(SAMPLES):  # alternating, so that both sides see the same machine load
        samples["fastnmt"].append(_microseconds(ours))
        samples["torch"].append(_microseconds(theirs))
    medians = {side: statistics.median(times) for side, times in samples.items()}
    benchmark.group = f"host cost per call, {mode}"
    benchmark.extra_info.update(
        op=op,
        path=path,
        mode=mode,
        device=DEVICE.type,
        fastnmt_us=round(medians["fastnmt"], 1),
        torch_us=round(medians["torch"], 1),
        ratio=round(medians["fastnmt"] / medians["torch"], 3),
        fastnmt_python_calls=python_calls(ours),
        torch_python_calls=python_calls(theirs),
        fastnmt_aten_ops=_aten_ops(ours),
        torch_aten_ops=_aten_ops(theirs),
    )
    benchmark.pedantic(ours, rounds=CALLS_PER_SAMPLE, warmup_rounds=0)
