"""Argument checks shared by the ops: each raises TypeError/ValueError naming the argument.

Checks of shapes, dtypes and devices are free; checks of tensor *values* (lengths, class indices,
token ids in range) read the tensor on the host, a device sync per call. The ops make them only
under ``FASTNMT_CHECK_VALUES=1`` (debugging); otherwise their callers check once per batch where
the data is still on the CPU (the trainer's batches, the translator's inputs), and the kernels
stay memory-safe for any value (out-of-range lengths are clamped to [0, L]).
"""

from __future__ import annotations

import numbers

import torch

from fastnmt.ops import settings


def tensor(name: str, value, *, ndim: int | None = None, floating: bool = False) -> torch.Tensor:
    """``value`` must be a tensor (of rank ``ndim``, of a floating dtype)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {value.dtype}")
    return value


def same_device(name: str, value: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    if value.device != like.device:
        raise ValueError(f"{name} is on {value.device} but {like_name} is on {like.device}")


def same_dtype(name: str, value: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    if value.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {value.dtype} but {like_name} has {like.dtype}")


def shape(name: str, value: torch.Tensor, expected: tuple[int, ...], meaning: str) -> None:
    if tuple(value.shape) != tuple(expected):
        raise ValueError(
            f"{name} must have shape {tuple(expected)} ({meaning}), got {tuple(value.shape)}"
        )


def probability(name: str, value) -> float:
    """A dropout probability: a real number in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1), got {type(value).__name__}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return float(value)


def dropout_seed(value, like_name: str, like: torch.Tensor) -> torch.Tensor | None:
    """A dropout seed given to an op, or None: an int64 (seed, offset) tensor of shape (2,) on
    ``like``'s device (``fastnmt.ops.dropout_seeds``)."""
    if value is None:
        return None
    tensor("dropout_seed", value, ndim=1)
    if value.dtype != torch.int64 or value.shape[0] != 2:
        raise ValueError(
            "dropout_seed must be an int64 tensor of shape (2,) (fastnmt.ops.dropout_seeds), "
            f"got {value.dtype} of shape {tuple(value.shape)}"
        )
    same_device("dropout_seed", value, like_name, like)
    return value


def positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


# Device type -> whether it has autocast. A dict read, not a call of
# torch.amp.is_autocast_available, on the common devices: torch.compile of torch 2.11 cannot trace
# that call (a graph break, an error under fullgraph=True).
_AUTOCAST_AVAILABLE = {kind: torch.amp.is_autocast_available(kind) for kind in ("cpu", "cuda")}


def autocasting(device: torch.device) -> bool:
    """Under autocast, activations and weights may legitimately differ in dtype. Devices without
    autocast (meta: shape-only runs of a model) never autocast; asking them raises."""
    available = _AUTOCAST_AVAILABLE.get(device.type)
    if available is None:
        available = _AUTOCAST_AVAILABLE[device.type] = torch.amp.is_autocast_available(device.type)
    return available and torch.is_autocast_enabled(device.type)


def values_checked() -> bool:
    """Whether ops check tensor values (a host sync each): ``FASTNMT_CHECK_VALUES=1``."""
    return settings.check_values
