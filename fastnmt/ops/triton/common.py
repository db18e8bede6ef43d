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
  regenerates the forward's mask exactly. ``dropout_seeds(count, device)``: ``count`` such pairs
  from one draw (Inductor's ``inductor_seeds``), for a model's training forward: one kernel
  rather than one per dropout op.
- ``device_guard(device)``: launches go to the current CUDA device, so a ``Launcher`` launches
  under this guard for its tensors' device when that is not the current one (``cuda:1``).
- ``dot_precision(dtype)``: the ``input_precision`` of ``tl.dot`` on ``dtype`` operands; fp32
  follows torch's own switch (``torch.backends.cuda.matmul.allow_tf32`` /
  ``torch.set_float32_matmul_precision``), as cuBLAS does for ``torch.matmul``.
- ``LaunchConfig`` and ``gpu_tiles()``: launchers pick block sizes by rules (no per-shape
  autotuning). On a GPU they always use the GPU rules; under the interpreter they use large
  interpreter blocks (its cost grows with the number of programs) unless a test asks for the GPU
  rules with ``with gpu_tiles():``, so every code path a GPU takes runs in CPU tests too.
- ``new_output``, ``new_output_like`` and ``as_dtype``: kernels' output buffers (poisoned under
  the interpreter, fp32 there for bf16: ``kernel_output_dtype``) and their final dtype.
- ``Launcher``: ``kernel[grid](*args, **options)`` without the per-launch work of Triton's
  ``JITFunction.run``, and ``launch_options(**options)``, the cached options it keys on, which
  also state ``COMPILE_OPTIONS``.
- ``cdiv`` and ``power_of_2_at_least``: host arithmetic for grids and blocks (triton's
  ``cdiv`` / ``next_power_of_2`` are constexpr functions, a wrapper call each, in 3.6 and 3.9).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import NamedTuple

import torch

from fastnmt.ops.triton import knobs, tl

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
_GPU_TILES: ContextVar[bool] = ContextVar("fastnmt_gpu_tiles", default=not INTERPRETER)

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


def dropout_seeds(count: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``count`` (seed, offset) pairs as ``dropout_seed`` draws them, from one draw: int64 (2,)
    views of one (count, 2) tensor, each a ``dropout_seed=`` of one fused op call."""
    return torch.randint(_SEED_BOUND, (count, 2), dtype=torch.int64, device=device).unbind()


def chosen_seed(given: torch.Tensor | None, dropout_p: float, device: torch.device):
    """The seed a fused op's kernels take: None without dropout, else the caller's ``given``
    seed, else one drawn for this call."""
    if dropout_p == 0.0:
        return None
    return dropout_seed(device) if given is None else given


class _Poison(dict):
    """dtype -> what an output buffer holds before a kernel writes it under the interpreter
    (tests): NaN or the largest integer, so that an element the kernel fails to write cannot pass
    for a result. Found once per dtype (a lookup, not a call: ``new_output`` is on the host path
    the tests count)."""

    def __missing__(self, dtype: torch.dtype):
        self[dtype] = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max
        return self[dtype]


_POISON = _Poison()


def new_output(shape, dtype: torch.dtype, device: torch.device, strides=None) -> torch.Tensor:
    """An output buffer for a kernel, contiguous unless ``strides`` are given (poisoned under
    the interpreter: ``_POISON``)."""
    if not INTERPRETER:
        if strides is not None:
            return torch.empty_strided(shape, strides, dtype=dtype, device=device)
        # The sizes as arguments: a third less parsing than a tuple (a 0-d shape has none).
        return torch.empty(*shape or ((),), dtype=dtype, device=device)
    if strides is None:
        return torch.full(shape, _POISON[dtype], dtype=dtype, device=device)
    return torch.empty_strided(shape, strides, dtype=dtype, device=device).fill_(_POISON[dtype])


def new_output_like(
    x: torch.Tensor, dtype: torch.dtype, memory_format=torch.preserve_format
) -> torch.Tensor:
    """An output buffer shaped as ``x``, dense in ``x``'s dimension order (``torch.empty_like``;
    ``memory_format=torch.contiguous_format``: contiguous), poisoned under the interpreter. Half
    the host time of ``torch.empty(shape, ...)``, which parses a shape and a device."""
    out = torch.empty_like(x, dtype=dtype, memory_format=memory_format)
    return out.fill_(_POISON[dtype]) if INTERPRETER else out


def as_dtype(output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A kernel's output in ``dtype``: itself, as always on a GPU, or cast from the fp32 buffer
    the interpreter computed bf16 in (a tenth of the host time of a ``.to`` that returns self)."""
    return output if output.dtype == dtype else output.to(dtype)


def device_guard(device: torch.device) -> contextlib.AbstractContextManager:
    """Makes ``device`` the current CUDA device for the launches inside (a no-op off CUDA)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input_precision: TF32 for fp32 operands where torch allows it for its own
    fp32 matmuls, else exact ("ieee"); half-precision operands ignore it."""
    allowed = dtype == torch.float32 and torch._C._get_float32_matmul_precision() != "highest"
    return "tf32" if allowed and not INTERPRETER else "ieee"


class LaunchConfig(NamedTuple):  # a tuple: hashed in C, as launchers' cache keys hash it
    """Block sizes and launch options of one kernel launch."""

    block_m: int  # rows per block (query rows, GEMM rows)
    block_n: int  # columns per block (keys, GEMM columns); 0 where unused
    num_warps: int
    num_stages: int
    block_k: int = 0  # the reduction block of a GEMM; 0 where unused
    group_m: int = 1  # GEMM: row blocks per group of the grouped program order

    @property
    def label(self) -> str:
        gemm = f" K{self.block_k} G{self.group_m}" if self.block_k else ""
        return f"M{self.block_m} N{self.block_n}{gemm} w{self.num_warps} s{self.num_stages}"


# use_gpu_tiles() -> bool: whether launchers pick the GPU's block sizes (always on a GPU; in
# tests, inside ``gpu_tiles()``) rather than the interpreter's. The ContextVar's own ``get``: on
# every launch's host path, where a Python function would add a frame.
use_gpu_tiles = _GPU_TILES.get


@contextlib.contextmanager
def gpu_tiles() -> Iterator[None]:
    """Launch with the GPU's block sizes under the interpreter too (tests)."""
    token = _GPU_TILES.set(True)
    try:
        yield
    finally:
        _GPU_TILES.reset(token)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Sizes under a trace with dynamic shapes (torch.compile, opcheck) are SymInts, which the cached
# launch choices cannot hash and bit operations cannot take: the two ways to make them ints.
def size_hint(n) -> int:
    """``n``, or a symbolic size's example value: for choices of speed alone (how many rows a
    block takes), which therefore add no guard and keep the size dynamic."""
    if n.__class__ is int:
        return n
    hint = n.node.hint  # None for a size known only at run time (data-dependent)
    return static_size(n) if hint is None else int(hint)


def static_size(n) -> int:
    """``n``, or a symbolic size specialized (a guard on its value): for sizes a block must
    cover (a row's width, a head dim), which a traced graph cannot leave open."""
    if n.__class__ is int:
        return n
    from torch.fx.experimental.symbolic_shapes import guard_int  # loaded by any trace

    return guard_int(n)


def power_of_2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


# Compile options every kernel states rather than inherits from Triton's defaults: FP fusion
# (a * b + c as one FMA) is on by default up to Triton 3.9, which warns that 3.10 turns it off.
# The kernels were written, checked on an H100 and timed with it on (an unfused multiply-add
# costs two instructions and one more rounding).
COMPILE_OPTIONS = {"enable_fp_fusion": True}


@functools.cache  # a few combinations of flags and block sizes per kernel
def _interned(items: tuple) -> dict:
    return {**COMPILE_OPTIONS, **dict(items)}


def launch_options(**options) -> dict:
    """The one dict of these constexprs and launch options (num_warps, ...), with
    ``COMPILE_OPTIONS`` unless given: a ``Launcher`` keys its compiled kernels by the dict's
    identity, a cheaper key than its contents."""
    return _interned(tuple(options.items()))


def _is_constexpr(parameter: inspect.Parameter) -> bool:
    # "tl.constexpr" where the kernel's module has ``from __future__ import annotations``
    return parameter.annotation is tl.constexpr or "constexpr" in str(parameter.annotation)


# A compiled kernel per specialization, and per argument values seen; past this many a Launcher
# starts afresh.
_MAX_COMPILED = 1024
_MAX_VALUES = 4096
_I32 = 2**31  # ints in [-2**31, 2**31) are i32 arguments, others i64, from 2**63 u64


def _picker(positions) -> Callable[[tuple], tuple]:
    """args -> the tuple of the arguments at ``positions`` (None: all), in one C call: a slice
    where they are consecutive (the cheapest; an ``itemgetter`` of one index would return the
    item itself), else an ``itemgetter`` of them."""
    if positions is None:
        return operator.itemgetter(slice(None))
    if not positions:
        return operator.itemgetter(slice(0))
    first, last = positions[0], positions[-1]
    if list(positions) == list(range(first, last + 1)):
        return operator.itemgetter(slice(first, last + 1))
    return operator.itemgetter(*positions)


class Launcher:
    """``launcher(device, grid, args, options)`` does what ``kernel[grid](*args, **options)``
    does, at a fraction of its host cost.

    Triton's ``JITFunction.run`` redoes on every launch what rarely changes: it binds the
    arguments to the signature, reads its knobs, asks the driver for the current device, formats
    a cache key from the options, checks the kernel's globals and builds launch metadata for
    hooks, tens of µs where a translation-sized kernel runs for a few. Like Inductor's launchers,
    a Launcher keeps each compiled kernel under what Triton specializes it on (each tensor's
    dtype and 16-byte alignment; each int's being 1, divisibility by 16 and width; the type of
    anything else), the device and the ``options`` dict (from ``launch_options``: by identity),
    launching the first call of a specialization through ``kernel[grid]`` (compiling if need be);
    later calls go straight to the compiled kernel (``CompiledKernel.run``, where
    ``JITFunction.run`` ends). ``grid`` is always (x, y, z).

    A call is first looked up by its values: its tensors by dtype and alignment, the other
    arguments (the sizes and strides, which a kernel's calls mostly repeat) as they are, picked
    in one C call where a key per argument costs a Python step each; a value decides its
    specialization, so this key is finer than Triton's. It assumes that a parameter takes one
    Python type (1, 1.0 and True are equal keys), as fastnmt's launches pass them. Values not
    seen yet are keyed by their specialization and kept under both keys.

    ``kernel[grid]`` serves every call under the interpreter, while Triton launch hooks are
    registered (a profiler's), and on a device other than the current one (under its guard).
    Tensors without data (``torch.compile`` tracing an op's ``triton_op`` body) make the launch a
    graph node instead (``wrap_triton``): noticed when keying them fails, so an eager call pays
    nothing for it.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        jitted = getattr(kernel, "fn", kernel)  # the function itself where triton is absent
        self._parameters = tuple(inspect.signature(jitted).parameters.values())
        # How many leading parameters may be passed positionally: those before the first
        # constexpr (a constexpr among args would be keyed by its specialization, not its value).
        self._positional = next(
            (i for i, p in enumerate(self._parameters) if _is_constexpr(p)), len(self._parameters)
        )
        # specialization key -> (the compiled kernel's launcher, function, packed metadata, the
        # values of the parameters after args, options: kept so that its id cannot be reused)
        self._compiled: dict[tuple, tuple] = {}
        self._by_values: dict[tuple, tuple] = {}  # values key -> the same entries
        # args -> (the arguments the values key takes as tensors, the others): the positions of
        # the tensors and Nones of the first compile; every argument until then.
        self._tensors, self._values = _picker(None), _picker(())
        self._positioned = False

    def __call__(self, device: torch.device, grid: tuple, args: tuple, options: dict) -> None:
        if INTERPRETER:
            self.kernel[grid](*args, **options)
            return
        index = device.index
        tensor = torch.Tensor
        try:
            key = (
                id(options),
                index,
                self._values(args),
                *[
                    (a.dtype, a.data_ptr() & 15) if isinstance(a, tensor) else a
                    for a in self._tensors(args)
                ],
            )
            compiled = self._by_values.get(key) or self._specialized(key, index, args, options)
        except RuntimeError:  # tensors without data: torch.compile tracing a triton_op's body
            self._traced(grid, args, options)
            return
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if (
            compiled is None
            or index != torch._C._cuda_getDevice()
            or getattr(enter, "calls", enter)  # Triton's HookChain, or a hook set directly
            or getattr(leave, "calls", leave)
        ):
            self._launch_and_keep(key, device, grid, args, options)
            return
        run, function, metadata, constexprs, _ = compiled
        stream = torch._C._cuda_getCurrentRawStream(index)
        run(*grid, stream, function, metadata, None, None, None, *args, *constexprs)

    @staticmethod
    def _specialization(index, args: tuple, options: dict) -> tuple:
        """The key of what Triton specializes a compiled kernel on (see the class)."""
        return (
            id(options),
            index,
            *[  # ints first (most arguments are), each by what Triton's specialization reads
                (a & 15 if a != 1 and -_I32 <= a < _I32 else (a >> 31, a & 15))
                if a.__class__ is int
                else (a.dtype, a.data_ptr() & 15)
                if isinstance(a, torch.Tensor)
                else a.__class__  # float, bool, None: specialized by type only
                for a in args
            ],
        )

    def _specialized(self, values_key, index, args, options) -> tuple | None:
        """The kernel compiled for the specialization of values not seen yet (None if none is),
        kept under their key too."""
        compiled = self._compiled.get(self._specialization(index, args, options))
        if compiled is not None:
            self._keep_values(values_key, compiled)
        return compiled

    def _keep_values(self, values_key, compiled: tuple) -> None:
        """``compiled`` under ``values_key``, unless a tensor is among the values it holds (a
        tensor hashes by identity: the key would never match again, and keep the tensor)."""
        if any(isinstance(a, torch.Tensor) for a in values_key[2]):
            return
        if len(self._by_values) >= _MAX_VALUES:
            self._by_values.clear()
        self._by_values[values_key] = compiled

    def _traced(self, grid, args, options) -> None:
        """The launch as a node of the graph being traced (``wrap_triton``), which Inductor
        compiles and fuses around. Compile options are Inductor's to choose."""
        from torch.library import wrap_triton

        launch = {k: v for k, v in options.items() if k not in COMPILE_OPTIONS}
        wrap_triton(self.kernel)[grid](*args, **launch)

    def _launch_and_keep(self, values_key, device, grid, args, options) -> None:
        assert len(args) <= self._positional, f"{self.kernel}: pass constexprs in options"
        with device_guard(device):
            compiled = self.kernel[grid](*args, **options)
        key = self._specialization(device.index, args, options)
        if key in self._compiled:  # a hooked or off-device launch keeps what it has
            return
        if len(self._compiled) >= _MAX_COMPILED:
            self._compiled.clear()
            self._by_values.clear()
        later = [  # every parameter after args, as JITFunction.run binds them
            options.get(p.name, p.default) for p in self._parameters[len(args) :]
        ]
        entry = (compiled.run, compiled.function, compiled.packed_metadata, tuple(later), options)
        self._compiled[key] = entry
        if not self._positioned:  # the first compile: where the tensors are
            tensors = [i for i, a in enumerate(args) if a is None or isinstance(a, torch.Tensor)]
            values = [i for i in range(len(args)) if i not in tensors]
            self._tensors, self._values = _picker(tensors), _picker(values)
            self._positioned = True
        else:
            self._keep_values(values_key, entry)
