"""Chooses which backend runs each op call: ``triton``, ``cpp`` or ``reference``.

Every op registers one implementation per backend together with a function that lists the reasons
that implementation cannot run a given call (an empty list means it can), in the spirit of
xformers' ``not_supported_reasons()``. A call runs on the first backend, in ``BACKENDS`` order, with
no reasons against it; ``reference`` runs everything, so a call always has a backend.

A backend can be forced with the environment variable ``FASTNMT_BACKEND`` (read at import, see
``fastnmt.ops.settings``) or, taking precedence, the
``backend()`` context manager, for every op or only for some (``backend("reference",
ops=["linear_cross_entropy"])``: A/B comparisons of one op inside a whole model). Forcing a
backend that cannot run the call raises ``BackendUnavailableError`` with the reasons: a forced
backend never falls back silently.
``explain()`` returns, for a call, every backend's reasons. Under ``torch.compile`` the backend is
chosen when the graph is traced and stays part of it: force a backend before compiling.

The host cost of a call is what decides an op's speed at translation shapes (a GPU kernel takes
tens of microseconds), so the choice is cached per call signature: the forced backends, grad and
autocast modes, and each argument (a tensor by shape, strides, dtype, device and requires_grad;
anything else by value). A call whose signature was seen skips the argument checks and the
reasons: a dict lookup, then the implementation. Reasons and checks read nothing else, so a cached
choice is the one ``explain()`` gives. Inside ``torch.autograd.forward_ad.dual_level()`` every
call is decided afresh: a tensor carrying a tangent is a reason against the fused backends, whose
kernels have no forward-mode derivative, so the reference ops run it (forcing one raises).

Each backend may register three implementations: the eager one, an inference one for eager
calls that autograd has nothing to record for (grad disabled, or no tensor argument requiring
grad: both are in the call signature, so this too is decided once), and a traced one for
``torch.compile``, ``torch.func`` transforms and export. Triton's eager one calls its kernels
through a plain ``torch.autograd.Function``, the leanest path into them with a backward; its
inference one calls the kernels' launchers directly (no Function, no saved context: a decoding
step makes dozens of such calls); its traced one the torch.library ops, with fakes (``triton_op``s
whose kernels graphs hold). The C++ ops carry their autograd in C++ and serve all three
(``ops/registration.py``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar

import torch
from torch.autograd import forward_ad

from fastnmt.ops import settings
from fastnmt.ops.extension import extension_available, extension_status
from fastnmt.ops.triton import TRITON_AVAILABLE, triton_status

# "torch" runs each op as PyTorch's built-ins (SDPA, F.layer_norm, F.linear, F.cross_entropy):
# the baseline a model written without fastnmt runs. After "reference", which runs everything,
# it is never chosen by itself, only forced (benchmarks, ``--backend torch``).
BACKENDS = ("triton", "cpp", "reference", "torch")
ENV_VAR = settings.BACKEND
_AUTO = "auto"
# Distinct call signatures remembered per op: bucketed MT batches and decoding lengths give a few
# hundred; past this many the cache starts afresh rather than growing without bound.
_MAX_DECISIONS = 4096

# The active backend() blocks, innermost last: (backend name, op names or None for every op).
_forced: ContextVar[tuple[tuple[str, frozenset[str] | None], ...]] = ContextVar(
    "fastnmt_forced_backends", default=()
)


class BackendUnavailableError(RuntimeError):
    """A forced backend cannot run the call it was forced onto."""


def _check_backend_name(name: str, source: str) -> str:
    if name not in (*BACKENDS, _AUTO):
        raise ValueError(f"{source} must be one of {(*BACKENDS, _AUTO)}, got {name!r}")
    return name


@contextlib.contextmanager
def backend(name: str, ops: Iterable[str] | None = None) -> Iterator[None]:
    """Force the fastnmt ops called inside the block onto backend ``name`` ("auto" to choose):
    every op, or only those named in ``ops`` (others keep what an outer block or the environment
    says)."""
    _check_backend_name(name, "backend()'s name")
    if ops is not None:
        ops = frozenset([ops] if isinstance(ops, str) else ops)
        if unknown := ops - OPS.keys():
            raise ValueError(f"backend()'s ops must be among {sorted(OPS)}, got {sorted(unknown)}")
    token = _forced.set((*_forced.get(), (name, ops)))
    try:
        yield
    finally:
        _forced.reset(token)


def ops_with(name: str) -> frozenset[str]:
    """The ops that have a ``name`` backend, the ones a command's ``--backend name`` forces: an
    op without one (no Triton kernel of ``log_softmax_topk``) keeps choosing among its own."""
    return frozenset(op for op, definition in OPS.items() if name in definition._implementations)


def assume_constant_result(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result`` without its ``import torch._dynamo``, over a
    second of the start of every process that imports fastnmt (most never compile): the mark is
    the attribute dynamo reads when it traces ``fn``, the one torch's decorator sets
    (tests/ops/test_dispatch.py compares them)."""
    fn._dynamo_marked_constant = True
    return fn


# torch.compile cannot trace a ContextVar; the forced backend is a constant of the compiled graph.
@assume_constant_result
def forced_backend(op_name: str) -> str | None:
    """The backend forced for op ``op_name`` by ``backend()`` or ``FASTNMT_BACKEND``, or None
    when choosing freely."""
    name = next(
        (name for name, ops in reversed(_forced.get()) if ops is None or op_name in ops),
        None,
    )
    if name is None:
        name = _check_backend_name(settings.backend, ENV_VAR)
    return None if name == _AUTO else name


def _triton_device_reasons(device: torch.device, forced: bool) -> list[str]:
    if not TRITON_AVAILABLE:
        return [triton_status()]
    if device.type == "cuda":
        return []
    if os.environ.get("TRITON_INTERPRET") != "1":
        return [
            f"tensors are on {device.type}; triton runs CUDA tensors (or, forced, CPU "
            "tensors with TRITON_INTERPRET=1)"
        ]
    # The interpreter is a test path, far slower than any other backend: never chosen by itself.
    return [] if forced else ["the Triton interpreter runs CPU tensors only when triton is forced"]


def _cpp_device_reasons(device: torch.device, forced: bool) -> list[str]:
    if device.type != "cpu":
        return [f"tensors are on {device.type}; the C++ kernels run CPU tensors"]
    return [] if extension_available() else [extension_status()]


_DEVICE_REASONS: dict[str, Callable[[torch.device, bool], list[str]]] = {
    "triton": _triton_device_reasons,
    "cpp": _cpp_device_reasons,
    "reference": lambda device, forced: [],
    "torch": lambda device, forced: [],
}
FUSED = ("triton", "cpp")  # backends whose kernels have a backward but no forward-mode AD (jvp)


def _dual_level_active() -> bool:
    """Inside ``torch.autograd.forward_ad.dual_level()``, where tensors may carry tangents."""
    return forward_ad._current_level >= 0


def _tangent_reasons(prepared: dict) -> list[str]:
    for name, value in prepared.items():
        if isinstance(value, torch.Tensor) and forward_ad.unpack_dual(value).tangent is not None:
            return [
                f"{name} carries a forward-mode AD tangent; the fused kernels have no jvp (the "
                "reference ops do)"
            ]
    return []


def _tracing() -> bool:
    """Under torch.compile, export or a torch.func transform: the traced implementations run."""
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()


UnsupportedFn = Callable[..., Iterable[str]]
PrepareFn = Callable[..., tuple[torch.device, dict]]


class Op:
    """One op's implementations, keyed by backend, each with the reasons it cannot run a call.

    ``prepare`` takes the op's public arguments, validates them (raising ValueError/TypeError that
    name the argument) and returns the device and the keyword arguments every implementation takes:
    the tensors as given, the other arguments normalized (defaults filled in), in ``prepare``'s
    parameter order. The implementations take them positionally in that order, as keywords too.
    The public function calls the op with every argument positionally: the cached path.
    """

    def __init__(self, name: str, prepare: PrepareFn):
        self.name = name
        self.prepare = prepare
        self._names = tuple(inspect.signature(prepare).parameters)
        self._arity = len(self._names)
        self._implementations: dict[str, tuple[Callable, UnsupportedFn | None]] = {}
        self._traced: dict[str, Callable] = {}
        self._inference: dict[str, Callable] = {}
        # call signature -> (implementation, (position, value) of the arguments prepare normalized)
        self._decisions: dict[tuple, tuple[Callable, tuple]] = {}

    def register(
        self,
        backend_name: str,
        unsupported: UnsupportedFn | None = None,
        *,
        traced: Callable | None = None,
        inference: Callable | None = None,
    ):
        """Decorator: ``fn(**prepared)`` implements this op on ``backend_name``;
        ``unsupported(**prepared)`` yields the reasons it cannot run a call (besides the backend's
        device requirements); ``traced`` replaces ``fn`` under tracing, ``inference`` in eager
        calls without autograd (``needs_autograd``); both default to ``fn``."""
        _check_backend_name(backend_name, "register()'s backend_name")

        def decorate(fn: Callable) -> Callable:
            self._implementations[backend_name] = (fn, unsupported)
            self._traced[backend_name] = fn if traced is None else traced
            self._inference[backend_name] = fn if inference is None else inference
            self._decisions.clear()
            return fn

        return decorate

    def implementation(self, backend_name: str, *, autograd: bool = True) -> Callable:
        """The eager implementation registered for ``backend_name``: the one that records a
        backward, or with ``autograd=False`` the one for calls that need none."""
        if autograd:
            return self._implementations[backend_name][0]
        return self._inference[backend_name]

    def _reasons(self, device: torch.device, prepared: dict, forced: str | None) -> dict:
        found = {}
        for name in BACKENDS:
            if name not in self._implementations:
                found[name] = [f"fastnmt has no {name} implementation of {self.name} yet"]
                continue
            _, unsupported = self._implementations[name]
            found[name] = _DEVICE_REASONS[name](device, forced == name)
            if not found[name] and name in FUSED and _dual_level_active():
                found[name] = _tangent_reasons(prepared)
            if not found[name] and unsupported is not None:
                found[name] = list(unsupported(**prepared))
        return found

    def _choose(self, device: torch.device, prepared: dict) -> str:
        forced = forced_backend(self.name)
        reasons = self._reasons(device, prepared, forced)
        if forced is None:
            return next(name for name in BACKENDS if not reasons[name])
        if reasons[forced]:
            raise BackendUnavailableError(
                f"backend {forced!r} was forced but cannot run {self.name}: "
                + "; ".join(reasons[forced])
            )
        return forced

    def explain(self, *args, **kwargs) -> dict[str, list[str]]:
        """For each backend, the reasons it cannot run this call (empty: it can), plus the
        chosen backend under the key "chosen"."""
        device, prepared = self.prepare(*args, **kwargs)
        reasons: dict = self._reasons(device, prepared, forced_backend(self.name))
        reasons["chosen"] = self._choose(device, prepared)
        return reasons

    def __call__(self, *args, **kwargs):
        if (  # value checks run at every call; _tracing() inlined: a Python call less
            kwargs
            or len(args) != self._arity
            or settings.check_values
            or torch.compiler.is_compiling()
            or torch._C._are_functorch_transforms_active()
            or forward_ad._current_level >= 0  # tangents are not in the signature
        ):
            return self._call_uncached(args, kwargs)
        key = [_forced.get(), settings.backend, torch.is_grad_enabled()]
        append, tensor = key.append, torch.Tensor
        for value in args:  # inline: a helper per argument would cost a Python call each
            if isinstance(value, tensor):
                append(value.shape)
                append(value.stride())
                append(value.dtype)
                append(value.device)
                append(value.requires_grad)
            else:  # with its type: 1, 1.0 and True are equal keys, and not all are accepted
                append(type(value))
                append(value)
        if torch._C._is_any_autocast_enabled():
            device_type = args[0].device.type
            append(torch.is_autocast_enabled(device_type))
            append(torch.get_autocast_dtype(device_type))
        key = tuple(key)
        try:
            decision = self._decisions.get(key)
        except TypeError:  # an unhashable argument: decide afresh
            return self._call_uncached(args, kwargs)
        if decision is None:
            decision = self._decide(key, args)
        implementation, normalized = decision
        if normalized:  # the arguments prepare() replaced (e.g. scale=None by its value)
            args = list(args)
            for position, value in normalized:
                args[position] = value
        return implementation(*args)

    def _decide(self, key: tuple, args: tuple) -> tuple[Callable, tuple]:
        device, prepared = self.prepare(*args)
        implementation = self.implementation(
            self._choose(device, prepared), autograd=needs_autograd(args)
        )
        normalized = []
        for position, (name, value) in enumerate(prepared.items()):
            assert name == self._names[position], f"{self.name}: prepare's keys in its order"
            if value is args[position]:
                continue
            # The cached path passes the tensors the call gives: prepare may not replace them.
            assert not isinstance(value, torch.Tensor), f"{self.name}: prepare replaced {name}"
            normalized.append((position, value))
        if len(self._decisions) >= _MAX_DECISIONS:
            self._decisions.clear()
        self._decisions[key] = implementation, tuple(normalized)
        return self._decisions[key]

    def _call_uncached(self, args: tuple, kwargs: dict):
        device, prepared = self.prepare(*args, **kwargs)
        name = self._choose(device, prepared)
        if _tracing():
            return self._traced[name](**prepared)
        implementation = self.implementation(name, autograd=needs_autograd(prepared.values()))
        return implementation(**prepared)


def needs_autograd(arguments: Iterable) -> bool:
    """Whether autograd records a call on these arguments: grad is enabled and a tensor among
    them requires grad (a call signature holds both, so a cached choice follows it)."""
    return torch.is_grad_enabled() and any(
        isinstance(value, torch.Tensor) and value.requires_grad for value in arguments
    )


OPS: dict[str, Op] = {}


def define(name: str, prepare: PrepareFn) -> Op:
    """Create the dispatch entry of op ``name``; see ``Op``."""
    if name in OPS:
        raise ValueError(f"op {name!r} is already defined")
    OPS[name] = Op(name, prepare)
    return OPS[name]


def explain(op_name: str, *args, **kwargs) -> dict:
    """Why each backend can or cannot run ``fastnmt.ops.<op_name>(*args, **kwargs)``, and which
    one would run it, e.g. ``explain("attention", q, k, v, key_lengths=lengths)``."""
    if op_name not in OPS:
        raise ValueError(f"op_name must be one of {sorted(OPS)}, got {op_name!r}")
    return OPS[op_name].explain(*args, **kwargs)
