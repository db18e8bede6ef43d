"""CUDA graphs of functions over static tensors: ``Program`` (called, or replayed once captured)
and ``capture_on`` (warm up on a side stream, then capture in a shared memory pool), used by the
training updates (``fastnmt.training.graph_updates``) and the static search
(``fastnmt.decoding.static_search``)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def workspace_allowances() -> frozenset[int] | None:
    """What a capture may leave allocated: nothing, or the workspace cuBLAS and cuBLASLt each
    allocate for a stream at its first GEMM and keep (PyTorch's own leak check frees them
    before it compares). Exact sizes: a leak of another size is still one. None where this
    torch does not say its workspace sizes (no check)."""
    getters = ("_cuda_getCublasWorkspaceSize", "_cuda_getCublasLtWorkspaceSize")
    if not all(hasattr(torch._C, name) for name in getters):
        return None
    cublas, cublas_lt = (getattr(torch._C, name)() for name in getters)
    return frozenset({0, cublas, cublas_lt, cublas + cublas_lt})


class Program:
    """A function of no arguments over static tensors: called, or replayed once captured."""

    def __init__(self, function: Callable[[], None]):
        self.function = function
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.function()

    def capture(self, pool) -> None:
        """Capture the function as a CUDA graph in the memory ``pool`` it shares with others.

        The capture mode is the capturing thread's own: the default, global mode fails any CUDA
        call another thread makes meanwhile that is unsafe during a capture, such as a loader
        thread pinning a batch. Graphs sharing a pool may replay in any order only if nothing a
        program allocates outlives it, so a capture that leaves more memory allocated than it
        found raises (bar the cuBLAS workspaces a capture's first GEMM on its stream allocates
        and keeps: ``workspace_allowances``)."""
        device = torch.cuda.current_device()
        allocated = torch.cuda.memory_allocated(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            self.function()
        kept = torch.cuda.memory_allocated(device) - allocated
        allowed = workspace_allowances()
        if allowed is not None and kept not in allowed:
            raise RuntimeError(
                f"{kept} bytes allocated while capturing {self.function} outlive it: graphs "
                "sharing a memory pool would overwrite them"
            )
        self.graph = graph


def capture_on(
    device: torch.device,
    programs: list[Program],
    pool,
    warm_up: Callable[[], None],
    captured: Callable[[int], None] = lambda i: None,
) -> None:
    """``warm_up()`` on a side stream of ``device`` (never the current device's, which may be
    another GPU's), then capture ``programs`` there in the memory ``pool``; ``captured(i)``
    after the i-th."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            warm_up()
        torch.cuda.current_stream(device).wait_stream(side)
        for i, program in enumerate(programs):
            program.capture(pool)
            captured(i)
        torch.cuda.synchronize(device)
