"""The one module that loads the compiled C++ CPU kernels, ``fastnmt._C`` (built from csrc/).

Importing ``fastnmt._C`` registers its ops with torch.library. When it is missing or cannot be
loaded, fastnmt keeps working on its other backends, warns once at import (unless the build was
skipped on purpose with FASTNMT_SKIP_EXTENSION=1), and ``extension_status()`` says why.
"""

import importlib
import os
import warnings

REBUILD_HINT = "rebuild it with `pip install --no-build-isolation -e .` (needs a C++ compiler)"


def _load():
    try:
        module = importlib.import_module("fastnmt._C")
    except ImportError as error:
        return None, f"fastnmt._C is not available ({error}); {REBUILD_HINT}"
    return module, f"fastnmt._C loaded from {module.__file__}"


_C, _STATUS = _load()
if _C is None and os.environ.get("FASTNMT_SKIP_EXTENSION") != "1":
    # pip hides the build's own warning; this one reaches the user (silenced by skipping the build).
    warnings.warn(
        _STATUS + "; CPU ops run on the slower reference path", RuntimeWarning, stacklevel=2
    )


def extension_available() -> bool:
    """Whether the compiled C++ kernels are loaded."""
    return _C is not None


def extension_status() -> str:
    """One line saying whether the C++ kernels are loaded, and if not, why and how to fix it."""
    return _STATUS
