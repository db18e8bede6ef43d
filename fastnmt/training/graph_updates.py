"""Training updates over static tensors, replayed as CUDA graphs: the plan of graph training.

An eager training step costs far more host time than GPU time on small models (every op's
launch, every autograd node, the optimizer's Python), and a CUDA graph replays a captured
sequence of kernels for one launch. A graph fixes its tensors: their shapes and their memory.
So an update becomes:

- ``ShapeBuckets`` (``fastnmt/training/buckets.py``) cut each batch into pieces of a few fixed
shapes;
- one **piece program** per shape reads its batch from static input tensors (the host copies a
  piece in), runs forward + backward, accumulates the gradients into preallocated ``.grad``
  tensors and its loss statistics into a device accumulator;
- one **update program** sums gradients over ranks (an explicit all-reduce, as DDP's hooks do
  not replay), clips them, steps a capturable fused optimizer whose learning rate is a device
  tensor computed from a device step counter, zeroes the gradients in place and writes the
  update's statistics to a static tensor.

Nothing in a program reads a value back to the host, and every value that changes between
updates is a device tensor the host writes before a replay (``fill_``, ``copy_``), so a replay
makes the same update as calling the program. Dropout draws its seeds with ``torch.randint`` on
the device: a captured draw advances the generator at each replay (the same masks as eager
calls would draw, never a frozen one).

On CUDA (``capture_reasons`` empty) the programs are captured once each, after warm-up calls
on a side stream whose effect on the model, the optimizer, the update's own device state (its
step count, learning rate and accumulators) and the random state is undone
(``state_preserved``); every graph shares one memory pool, which is safe in any replay order
because no tensor allocated inside a program outlives it (inputs, gradients and accumulators
are allocated outside). Elsewhere (a CPU, loss scaling) the same programs are called: that is
how the plan runs and is tested on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from fastnmt.cuda_graphs import Program, capture_on
from fastnmt.data import Batch
from fastnmt.training.buckets import BatchShape, ShapeBuckets

# Fields of a piece copied into its program's static inputs (tgt_positions is the same for
# every piece of a shape: all its cells).
_INPUTS = ("src", "src_lengths", "tgt_in", "tgt_out")
# Eager calls before capture: the first builds the optimizer's state and autotunes, the rest let
# the caching allocator settle (PyTorch's whole-network capture example uses a few).
WARMUP_CALLS = 3


def capture_reasons(device: torch.device, loss_scaling: bool) -> list[str]:
    """Why the programs cannot be captured as CUDA graphs (empty: they can)."""
    reasons = []
    if device.type != "cuda":
        reasons.append(f"CUDA graphs need a CUDA device, got {device.type}")
    if loss_scaling:
        reasons.append("fp16 loss scaling decides on the host whether to step (use bf16)")
    return reasons


@contextlib.contextmanager
def state_preserved(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: tuple[torch.Tensor, ...] = (),
) -> Iterator[None]:
    """Undo what the calls inside do to the parameters, the optimizer's state, ``tensors`` (the
    update's other device state) and the random state of the model's device: warm-up calls
    before a capture run real updates. A state the optimizer creates inside (its first step) is
    zeroed after, which is a fresh state for Adam (zero moments, step 0)."""
    device = next(model.parameters()).device
    parameters = [p.detach().clone() for p in model.parameters()]
    states = {p: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    saved_tensors = [t.clone() for t in tensors]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        with torch.no_grad():
            for p, saved in zip(model.parameters(), parameters, strict=True):
                p.copy_(saved)
            for p, state in optimizer.state.items():
                for key, value in state.items():
                    if p in states:
                        value.copy_(states[p][key])
                    elif isinstance(value, torch.Tensor):
                        value.zero_()
            for tensor, saved in zip(tensors, saved_tensors, strict=True):
                tensor.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


def warm_up(
    programs: list[Program],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: tuple[torch.Tensor, ...],
) -> None:
    """WARMUP_CALLS calls of every program, whose effects are undone (``state_preserved``)."""
    with state_preserved(model, optimizer, tensors):
        for _ in range(WARMUP_CALLS):
            for program in programs:
                program()


def capture(
    programs: list[Program],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: tuple[torch.Tensor, ...],
    captured: Callable[[int], None] = lambda i: None,
) -> None:
    """Capture ``programs`` as CUDA graphs sharing one memory pool, after warm-up calls
    (``warm_up``; ``tensors``: the update's device state besides the model and the optimizer);
    ``captured(i)`` after the i-th. Raises RuntimeError (every program left a call) when one
    cannot be captured."""
    device = next(model.parameters()).device
    try:
        with state_preserved(model, optimizer, tensors):  # capture draws random offsets too
            capture_on(
                device,
                programs,
                torch.cuda.graph_pool_handle(),
                lambda: warm_up(programs, model, optimizer, tensors),
                captured,
            )
    except RuntimeError:
        for program in programs:
            program.graph = None
        raise


class HostStaging:
    """One shape's host buffer of a piece, through which pieces reach the program's inputs.

    A copy to a GPU is asynchronous only from pinned memory: from pageable memory the host
    waits for it. A loader's pinned batch loses its pinning when a piece is padded into fresh
    tensors, so each shape pads its pieces into one pinned buffer, reused. Before refilling it the
    host waits for the buffer's last copy out (an event), which lets the host run about one
    piece ahead of the GPU: a few pieces make an update, so that is all the overlap there is."""

    def __init__(self, buckets: ShapeBuckets, shape: BatchShape, device: torch.device):
        pinned = device.type == "cuda"
        self.buckets = buckets
        self.batch = buckets.empty(shape, "cpu", pin_memory=pinned)
        self.copied = torch.cuda.Event() if pinned else None

    def copy(self, batch: Batch, start: int, end: int, inputs: Batch) -> None:
        """Rows [start, end) of the host ``batch``, padded, into the device ``inputs``."""
        if self.copied is not None:
            self.copied.synchronize()  # its previous piece has left the buffer
        self.buckets.write(self.batch, batch, start, end, _INPUTS)
        for name in _INPUTS:
            getattr(inputs, name).copy_(getattr(self.batch, name), non_blocking=True)
        if self.copied is not None:
            self.copied.record()


class BucketedUpdates:
    """Updates over shape-bucketed pieces through the two kinds of program.

    ``piece(batch)`` runs forward + backward of one piece (scaling its loss by a device tensor
    the caller owns and adding its statistics to a device accumulator); ``update()`` is the
    update program; ``reduce(flat)`` sums the flat gradient over ranks in place (None: one
    rank); ``state``: the device tensors the programs read and write besides the model and the
    optimizer (step count, learning rate, accumulators), which warm-up calls must leave."""

    def __init__(
        self,
        model: torch.nn.Module,
        buckets: ShapeBuckets,
        piece: Callable[[Batch], None],
        update: Callable[[], None],
        reduce: Callable[[torch.Tensor], None] | None,
        device: torch.device,
        state: tuple[torch.Tensor, ...] = (),
    ):
        self.model, self.buckets, self.device, self.state = model, buckets, device, state
        self.gradients = self._static_gradients(model)
        self.inputs = {shape: buckets.empty(shape, device) for shape in buckets.shapes}
        self.staging = {shape: HostStaging(buckets, shape, device) for shape in buckets.shapes}
        self.pieces = {
            shape: Program(lambda batch=batch: piece(batch)) for shape, batch in self.inputs.items()
        }
        self.update = Program(self._reduced(update, reduce))
        self.programs = [*self.pieces.values(), self.update]
        self.captured_bytes = 0

    def _static_gradients(self, model: torch.nn.Module) -> torch.Tensor:
        """One flat buffer whose views are the parameters' ``.grad``: backward accumulates into
        them in place (a graph must not allocate them), and a rank sums them in one call."""
        parameters = [p for p in model.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in parameters}
        if len(dtypes) != 1:
            raise ValueError(f"graph training needs parameters of one dtype, got {dtypes}")
        flat = torch.zeros(
            sum(p.numel() for p in parameters), dtype=dtypes.pop(), device=self.device
        )
        offset = 0
        for p in parameters:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return flat

    def _reduced(self, update, reduce):
        if reduce is None:
            return update

        def reduced_update():
            reduce(self.gradients)
            update()

        return reduced_update

    def accumulate(self, batches: list[Batch]) -> None:
        """Forward + backward of ``batches`` (host tensors): each piece padded into its shape's
        host staging, copied into the program's inputs, and the program run. ``update()`` then
        applies them."""
        for batch in batches:
            shape, ranges = self.buckets.row_ranges(batch)
            inputs, staging, program = self.inputs[shape], self.staging[shape], self.pieces[shape]
            for start, end in ranges:
                staging.copy(batch, start, end, inputs)
                program()

    def capture(self, optimizer: torch.optim.Optimizer, report: Callable[[str], None]) -> None:
        """Capture every program as a CUDA graph (``capture``); on failure they stay calls."""
        started = time.monotonic()
        programs = self.programs
        before = torch.cuda.memory_reserved(self.device)
        try:
            capture(
                programs,
                self.model,
                optimizer,
                self.state,
                lambda i: report(f"captured CUDA graph {i + 1}/{len(programs)}"),
            )
        except RuntimeError as error:  # training goes on, as calls of the same programs
            report(f"CUDA graph capture failed, running eagerly: {str(error).splitlines()[0]}")
            return
        self.captured_bytes = torch.cuda.memory_reserved(self.device) - before
        report(
            f"captured {len(programs)} CUDA graphs ({len(self.pieces)} batch shapes + the "
            f"update) in {time.monotonic() - started:.1f} s; static memory "
            f"{self.captured_bytes / 2**20:,.0f} MiB"
        )
