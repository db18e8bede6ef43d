"""Host cost of one Triton launch: ``kernel[grid](...)`` (Triton's ``JITFunction.run``) against
fastnmt's ``Launcher`` (``fastnmt/ops/triton/common.py``), on attention's forward kernel with the
arguments of a batch of 64 sentences of 32 tokens, 8 heads of 64, bf16 (37 arguments).

On a GPU both launch the compiled kernel for real (queued: the time per launch is the host's); on a
CPU Triton's own ``run()`` runs on a stand-in driver that answers as a GPU machine's, with a
compiled kernel whose launch does nothing, so both sides lack only the C launcher they share.
``extra_info``: both sides' µs per launch (medians of alternating samples) and their ratio.

Run: ``pytest benchmarks/bench_launch.py --benchmark-only``.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import pytest
import torch

from fastnmt.ops.triton import attention as attention_launchers
from fastnmt.ops.triton import common as triton_common
from fastnmt.ops.triton.attention_kernels import _attention_forward_kernel
from tests.helpers import StandInCompiled, StandInDriver

ON_GPU = torch.cuda.is_available()
SAMPLES, LAUNCHES_PER_SAMPLE = 15, 500


@pytest.fixture
def kernel(monkeypatch):
    """Attention's forward JITFunction: compiled on a GPU, else on the stand-in driver."""
    if ON_GPU:
        return _attention_forward_kernel
    from triton.runtime import jit

    monkeypatch.setattr(jit, "driver", StandInDriver())
    monkeypatch.setattr(triton_common, "INTERPRETER", False)
    monkeypatch.setattr(triton_common, "device_guard", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    stand_in = jit.JITFunction(_attention_forward_kernel.fn)
    compiled = StandInCompiled()  # its launch does nothing

    def compile_once(key, signature, device, *_):
        stand_in.device_caches[device][0][key] = compiled  # as Triton's cache keeps a kernel
        return compiled

    monkeypatch.setattr(stand_in, "_do_compile", compile_once)
    return stand_in


def _microseconds(launch) -> float:
    """Host time per launch: the GPU runs the queued kernels after the clock stops (500 launches
    fit in CUDA's launch queue, so none waits for a slot)."""
    start = time.perf_counter()
    for _ in range(LAUNCHES_PER_SAMPLE):
        launch()
    elapsed = time.perf_counter() - start
    if ON_GPU:
        torch.cuda.synchronize()
    return elapsed / LAUNCHES_PER_SAMPLE * 1e6


def test_launch_host_cost(benchmark, kernel):
    batch, heads, length, head_dim = 64, 8, 32, 64
    device = torch.device("cuda", torch.cuda.current_device()) if ON_GPU else torch.device("cpu")
    q, k, v, out = (
        torch.randn(batch, heads, length, head_dim, dtype=torch.bfloat16, device=device)
        for _ in range(4)
    )
    lse = torch.empty(batch, heads, length, device=device)
    lengths = torch.full((batch,), length, device=device)
    args = (
        q, k, v, out, lse, lengths, None, None, None,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), 0, 0, 0, 0,
        heads, length, length, head_dim, head_dim, head_dim**-0.5, 0.0,
    )  # fmt: skip
    config = attention_launchers.launch_config("forward", length, length, head_dim)
    options = attention_launchers._options(
        config, head_dim, head_dim, q.dtype, "ieee", False, True, False, False, False
    )
    grid = (batch * heads, triton_common.cdiv(length, config.block_m), 1)
    launcher = triton_common.Launcher(kernel)
    sides = {
        "triton": lambda: kernel[grid](*args, **options),
        "launcher": lambda: launcher(
            device if ON_GPU else torch.device("cuda", 0), grid, args, options
        ),
    }
    for launch in sides.values():  # compile, and the Launcher's first (Triton's) launch
        launch()
    samples = {side: [] for side in sides}
    for _ in range(SAMPLES):  # alternating, so that both see the same machine load
        for side, launch in sides.items():
            samples[side].append(_microseconds(launch))
    medians = {side: statistics.median(times) for side, times in samples.items()}
    benchmark.group = "host cost per Triton launch"
    benchmark.extra_info.update(
        device=torch.cuda.get_device_name() if ON_GPU else "cpu (stand-in driver)",
        triton_us=round(medians["triton"], 2),
        launcher_us=round(medians["launcher"], 2),
        ratio=round(medians["triton"] / medians["launcher"], 2),
    )
    benchmark.pedantic(sides["launcher"], rounds=LAUNCHES_PER_SAMPLE, warmup_rounds=0)
