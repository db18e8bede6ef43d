"""fastnmt: fused attention, residual+LayerNorm and FFN kernels, and a translator built on them.

The names below load on first use (PEP 562), so that ``import fastnmt.client`` needs neither
PyTorch nor the kernels."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> (module, attribute in it; None: the module itself)
_PUBLIC = {
    "BACKENDS": ("fastnmt.ops.dispatch", "BACKENDS"),
    "BackendUnavailableError": ("fastnmt.ops.dispatch", "BackendUnavailableError"),
    "Translator": ("fastnmt.translator", "Translator"),
    "backend": ("fastnmt.ops.dispatch", "backend"),
    "environment": ("fastnmt.ops.settings", None),
    "explain": ("fastnmt.ops.dispatch", "explain"),
    "extension_available": ("fastnmt.ops.extension", "extension_available"),
    "extension_status": ("fastnmt.ops.extension", "extension_status"),
    "ops": ("fastnmt.ops", None),
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'fastnmt' has no attribute {name!r}")
    module_name, attribute = _PUBLIC[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
