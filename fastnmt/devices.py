"""Devices: which one a process uses (``resolve_device``), autocast to a precision on it, and the
process-wide settings the command-line tools apply before they compute anything."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

import torch

# oneDNN (through ideep) keeps a compiled GEMM primitive per distinct shape, 1,024 by default. A
# translation trainer meets new shapes with every token bucket and decoder step, and the caches
# grow without bound in practice (5.2 GB of RSS over a 25-minute CPU training run); 64 entries
# cost no speed there. Decoding is another matter: its GEMMs take every number of live
# hypotheses as it falls, hundreds of shapes in turn, and with 64 entries it rebuilds primitives
# all the time (beam-4 decoding about a third slower), so a process that only translates keeps
# the default. Both variables are read when the first primitive is created, so setting them at
# the start of a process is early enough.
TRAINING_PRIMITIVE_CACHE_CAPACITY = "64"
DECODING_PRIMITIVE_CACHE_CAPACITY = "1024"

# glibc's malloc serves blocks from 128 KB up (raised adaptively to at most 32 MB) with mmap and
# gives them back on free, and trims the heap top past 128 KB: every step of decoding or training
# then page-faults its large tensors in afresh (zeroed by the kernel). The settings below cut
# the system time of beam-4 decoding by more than half (a third of the page faults). The cost is
# that freed memory stays with the process for reuse, as PyTorch's CUDA caching allocator does
# on a GPU.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MALLOC_SETTINGS = {
    _M_MMAP_THRESHOLD: 32 << 20,  # glibc's maximum: blocks below it come from the heap
    _M_TRIM_THRESHOLD: 1 << 30,  # keep up to 1 GB of free heap top
    _M_TOP_PAD: 64 << 20,  # grow the heap in 64 MB steps
}
_MALLOC_ENV_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def limit_primitive_caches(capacity: str = TRAINING_PRIMITIVE_CACHE_CAPACITY) -> None:
    """Cap oneDNN's primitive caches, unless the environment already sets them."""
    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        os.environ.setdefault(name, capacity)


def keep_freed_memory() -> bool:
    """On glibc, let malloc keep freed blocks for reuse instead of returning them to the kernel
    (unless the environment sets glibc's own MALLOC_* tuning). Returns whether it applied."""
    if not sys.platform.startswith("linux") or any(v in os.environ for v in _MALLOC_ENV_VARS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # absent from other C libraries (e.g. musl)
    except (OSError, AttributeError):
        return False
    return all(mallopt(option, value) == 1 for option, value in _MALLOC_SETTINGS.items())


def configure_process(decoding: bool = False) -> None:
    """The settings above, for a process that trains (or, ``decoding``, only translates)."""
    limit_primitive_caches(
        DECODING_PRIMITIVE_CACHE_CAPACITY if decoding else TRAINING_PRIMITIVE_CACHE_CAPACITY
    )
    keep_freed_memory()


def resolve_device(requested: str = "auto") -> torch.device:
    """The device of this process: ``requested`` ("auto", "cpu", "cuda" or "cuda:N"); "auto" and
    a bare "cuda" take ``cuda:$LOCAL_RANK`` (torchrun's one GPU per process) when CUDA is
    available. Raises ValueError naming ``--device``."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {requested!r}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {requested!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {requested}: no CUDA device is available")
    index = local_rank if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"--device {requested}: cuda:{index} does not exist "
            f"({torch.cuda.device_count()} CUDA devices)"
        )
    return torch.device("cuda", index)


def autocast(device: torch.device | str, dtype: torch.dtype | None):
    """Autocast to ``dtype`` on ``device``'s type, or nothing for full precision."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype)
