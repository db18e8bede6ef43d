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
"""

from __future__ import annotations

import os

import torch

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"

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
