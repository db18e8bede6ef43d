"""fastnmt: fused attention, residual+LayerNorm and FFN kernels, and a translator built on them."""

from fastnmt import environment, ops
from fastnmt._extension import extension_available, extension_status
from fastnmt.dispatch import BACKENDS, BackendUnavailableError, backend, explain
from fastnmt.translator import Translator

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "Translator",
    "backend",
    "environment",
    "explain",
    "extension_available",
    "extension_status",
    "ops",
]
