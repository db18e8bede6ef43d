"""The environment variables that steer fastnmt's ops, read when fastnmt is imported:

- ``FASTNMT_BACKEND``: force a backend for every op (``triton``, ``cpp``, ``reference``, ``auto``);
  ``fastnmt.backend()`` forces one inside a program;
- ``FASTNMT_CHECK_VALUES=1``: the ops also check tensor values (lengths, class indices, token ids
  in range), a host sync per call: debugging.

An op call reads them here rather than in ``os.environ``: a lookup there is three Python calls,
more than the rest of a cached dispatch. A program that changes them after importing fastnmt calls
``reload()``.
"""

from __future__ import annotations

import os

BACKEND = "FASTNMT_BACKEND"
CHECK_VALUES = "FASTNMT_CHECK_VALUES"

backend = "auto"  # checked where it is used: a bad value fails the op call, not the import
check_values = False


def reload() -> None:
    """Read the variables again from ``os.environ``."""
    global backend, check_values
    backend = os.environ.get(BACKEND, "auto")
    check_values = os.environ.get(CHECK_VALUES) == "1"


reload()
