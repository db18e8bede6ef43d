"""Helpers shared by the Triton backends of the ops (attention, add_layer_norm, feed_forward).

- ``INTERPRETER``: the kernels run through the Triton interpreter (``TRITON_INTERPRET=1``, tests
  on a CPU). It must be read from the environment, as Triton does, before launching anything.
- ``upcast_in_interpreter(dtype)``: the interpreter stores bf16 as raw 16-bit integers, so bf16
  arithmetic, ``tl.dot`` and fp32->bf16 casts are wrong there. Kernels take an ``UPCAST``
  constexpr that casts every load to fp32, and launchers give such kernels fp32 output buffers
  (cast to bf16 afterwards with torch, which rounds correctly).
- ``dropout_seed(device)``: the (seed, offset) pair of an in-kernel dropout mask, drawn from
  torch's generator of ``device`` (``torch.manual_seed`` makes runs reproducible) as an int64
  tensor of shape (2,), so that ``torch.compile`` traces the draw and the kernel reads it with
  two loads. A kernel derives each element's random number from (seed, offset, the element's
  index) only, e.g. ``tl.rand(seed, offset + e)``, never from its tiling, so a backward pass
  regenerates the forward's mask exactly.
- ``device_guard(device)``: launches go to the current CUDA device, so every launcher runs under
  this guard for its tensors' device (``cuda:1``, the ranks of a DDP job).
- ``dot_precision(dtype)``: the ``input_precision`` of ``tl.dot`` on ``dtype`` operands; fp32
  follows torch's own switch (``torch.backends.cuda.matmul.allow_tf32`` /
  ``torch.set_float32_matmul_precision``), as cuBLAS does for ``torch.matmul``.
- ``LaunchConfig`` and ``gpu_tiles()``: launchers pick block sizes by rules (no per-shape
  autotuning). On a GPU they always use the GPU rules; under the interpreter they use large
  interpreter blocks (its cost grows with the number of programs) unless a test asks for the GPU
  rules with ``with gpu_tiles():``, so every code path a GPU takes runs in CPU tests too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
_GPU_TILES: ContextVar[bool] = ContextVar("fastnmt_gpu_tiles", default=not INTERPRETER)

# Philox keys are 64-bit; the offset stays below 2**62 so offset + element index cannot overflow.
_SEED_BOUND = 2**62


def upcast_in_interpreter(dtype: torch.dtype) -> bool:
    """Whether a kernel on ``dtype`` inputs must compute from fp32 copies of its loads."""
    return INTERPRETER and dtype == torch.bfloat16


def kernel_output_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a kernel's output buffer for ``dtype`` inputs (fp32 where upcasting)."""
    return torch.float32 if upcast_in_interpreter(dtype) else dtype


def dropout_seed(device: torch.device) -> torch.Tensor:
    """int64 (2,) = (seed, offset) of one dropout mask, from torch's generator on ``device``."""
    return torch.randint(_SEED_BOUND, (2,), dtype=torch.int64, device=device)


def new_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer for a kernel. Under the interpreter (tests) it is poisoned, NaN or the
    largest integer, so that an element the kernel fails to write cannot pass for a result."""
    if not INTERPRETER:
        return torch.empty(shape, dtype=dtype, device=device)
    poison = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max
    return torch.full(shape, poison, dtype=dtype, device=device)


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Makes ``device`` the current CUDA device for the launches inside (a no-op off CUDA)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input_precision: TF32 for fp32 operands where torch allows it for its own
    fp32 matmuls, else exact ("ieee"); half-precision operands ignore it."""
    allowed = dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest"
    return "tf32" if allowed and not INTERPRETER else "ieee"


@dataclass(frozen=True)
class LaunchConfig:
    """Block sizes and launch options of one kernel launch."""

    block_m: int  # rows per block (query rows, GEMM rows)
    block_n: int  # columns per block (keys, GEMM columns); 0 where unused
    num_warps: int
    num_stages: int
    block_k: int = 0  # the reduction block of a GEMM; 0 where unused
    group_m: int = 1  # GEMM: row blocks per group of the grouped program order

    @property
    def label(self) -> str:
        gemm = f" K{self.block_k} G{self.group_m}" if self.block_k else ""
        return f"M{self.block_m} N{self.block_n}{gemm} w{self.num_warps} s{self.num_stages}"


def use_gpu_tiles() -> bool:
    """Whether launchers pick the GPU's block sizes (always on a GPU; in tests, inside
    ``gpu_tiles()``) rather than the interpreter's."""
    return _GPU_TILES.get()


@contextlib.contextmanager
def gpu_tiles() -> Iterator[None]:
    """Launch with the GPU's block sizes under the interpreter too (tests)."""
    token = _GPU_TILES.set(True)
    try:
        yield
    finally:
        _GPU_TILES.reset(token)
