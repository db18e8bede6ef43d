"""The one module that imports Triton, so that ``import fastnmt`` works where Triton is absent.

Triton ships for Linux x86-64 (and aarch64 from some versions); on macOS, Windows or a machine
without it, the C++ and reference backends still run. When the import fails, ``triton`` and ``tl``
here are stand-ins that let the kernel modules beside this one (``fastnmt.ops.triton.<op>``)
define their kernels (``@triton.jit`` returns the function unchanged, ``tl.constexpr(x)`` is
``x``) but never launch them: the dispatcher gives the Triton backend the reason
``triton_status()``.
"""

from __future__ import annotations

from types import SimpleNamespace

try:
    import triton
    import triton.language as tl
    from triton import knobs
except ImportError as error:
    _STATUS = f"triton is not installed ({error})"

    def _jit(fn=None, **_options):
        return fn if fn is not None else (lambda f: f)

    triton = SimpleNamespace(jit=_jit)
    tl = SimpleNamespace(constexpr=lambda value: value)
    knobs = None
    TRITON_AVAILABLE = False
else:
    _STATUS = f"triton {triton.__version__} is installed"
    TRITON_AVAILABLE = True


def triton_status() -> str:
    """One line: whether Triton is importable, and if not, why."""
    return _STATUS


__all__ = ["TRITON_AVAILABLE", "knobs", "tl", "triton", "triton_status"]
