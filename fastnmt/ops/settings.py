"""The environment variables that steer fastnmt's ops, read when fastnmt is imported:

- ``FASTNMT_BACKEND``: force a backend for every op (``triton``, ``cpp``, ``reference``, ``auto``);
  ``fastnmt.backend()`` forces one inside a program;
- ``FASTNMT_CHECK_VALUES=1``: the ops also check tensor values (lengths, class indices, token ids
  in range), a host sync per call: debugging;
- ``FASTNMT_FFN_FUSED_GEMM=1``: feed_forward's Triton backend runs its GEMMs as Triton kernels
  with the activation and dropout fused into them, rather than the library's (cuBLAS).

An op call reads them here rather than in ``os.environ``: a lookup there is three Python calls,
more than the rest of a cached dispatch. A program that changes them after importing fastnmt calls
``reload()``.
"""

from __future__ import annotations

import os

BACKEND = "FASTNMT_BACKEND"
CHECK_VALUES = "FASTNMT_CHECK_VALUES"
FFN_FUSED_GEMM = "FASTNMT_FFN_FUSED_GEMM"

backend = "auto"  # checked where it is used: a bad value fails the op call, not the import
check_values = False
ffn_fused_gemm = False


def reload() -> None:
    """Read the variables again from ``os.environ``."""
    global backend, check_values, ffn_fused_gemm
    backend = os.environ.get(BACKEND, "auto")
    check_values = os.environ.get(CHECK_VALUES) == "1"
    ffn_fused_gemm = os.environ.get(FFN_FUSED_GEMM) == "1"


reload()
