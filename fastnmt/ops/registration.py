"""How an op's kernels join PyTorch: a forward and a backward kernel, tied by autograd.

Triton kernels, twice:
- traced (``torch.compile``, ``torch.func``, export): torch.library ops, with the fake
  implementations ``torch.compile`` traces and ``register_autograd``; ``triton_op``s, so that
  ``torch.compile`` traces into them and its graphs hold their Triton kernels
  (``triton_library_op``);
- eager: a plain ``torch.autograd.Function`` calling the same launchers. torch.library's Python
  layers (the autograd kernel, pytree walks over the arguments, the dispatcher's Python
  implementation of a ``custom_op``) cost far more per call than a small kernel takes on a GPU;
  this path costs two Python calls each way;
- eager without autograd (decoding, validation: see ``dispatch``): the forward launcher itself.
Both share one ``setup_context`` and one backward, so they compute the same gradients.

C++ kernels: ops registered in csrc/ with their autograd in C++ (the same gradients), so one op
call serves eager and traced use, and a CPU step never enters Python below it. An op's Triton
ops and its C++ ops take the same arguments, so one set of fakes serves both.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from fastnmt.ops import dispatch
from fastnmt.ops.extension import extension_available, extension_status
from fastnmt.ops.triton.common import INTERPRETER


def triton_library_op(name: str) -> Callable:
    """Decorator: the torch.library op ``name`` over a function that calls Triton launchers.

    A ``triton_op``: ``torch.compile`` traces into it, so its kernels appear in the graph as
    Triton kernels (``Launcher`` launches them through ``wrap_triton`` there) and Inductor fuses
    around them, also inside ``mode="reduce-overhead"``'s CUDA graphs. Under the interpreter its
    kernels cannot be traced (``wrap_triton`` takes compiled kernels only): a ``custom_op``, which
    graphs keep opaque, as they keep the C++ ops."""
    if INTERPRETER:
        return torch.library.custom_op(name, mutates_args=())
    return lambda fn: torch.library.triton_op(name, _WithoutSource(fn), mutates_args=())


class _WithoutSource:
    """``fn`` as a callable whose source ``inspect`` cannot read.

    ``triton_op`` parses its function's source for kernels called through ``wrap_triton`` (a key
    for AOTAutograd's cache), importing ``torch._inductor``, and with it ``torch._dynamo``, to do
    so: over a second at every process's import. It never finds ours (``Launcher`` wraps them
    at trace time, and Inductor's own cache keys the traced kernels), and a callable without
    source ends the parse before that import."""

    def __init__(self, fn: Callable) -> None:
        self._fn = fn
        # What infer_schema reads: the signature, and the globals its annotations name.
        self.__name__, self.__globals__ = fn.__name__, fn.__globals__
        self.__signature__ = inspect.signature(fn)

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)


def eager_function(name: str, forward: Callable, setup_context: Callable, backward: Callable):
    """``apply(*inputs)``: ``forward(*inputs)`` (Python launchers) under autograd, with the op's
    ``setup_context`` and ``backward`` (as given to ``register_autograd``)."""

    def run_forward(ctx, *inputs):
        output = forward(*inputs)
        setup_context(ctx, inputs, output)
        return output

    function = type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(run_forward), "backward": staticmethod(backward)},
    )
    # Function.apply's Python wrapper handles torch.func transforms (which dispatch sends to the
    # traced path) and binds default arguments (these forwards have none): its C base is enough.
    return super(torch.autograd.Function, function).apply


def register_kernels(
    op: dispatch.Op,
    *,
    triton: tuple[tuple, tuple[Callable, Callable]],
    cpp: tuple[str, str],
    unsupported: dict[str, Callable],
    running: Callable[[str, Callable], Callable],
    forward_fake: Callable,
    backward_fake: Callable,
    setup_context: Callable,
    make_backward: Callable,
    inference: Callable | None = None,
) -> None:
    """Registers ``op``'s Triton and C++ backends.

    ``triton`` is ((forward op, backward op), (forward launcher, backward launcher)): the
    torch.library ops call the launchers, the eager path calls them directly. ``cpp`` names the
    C++ ops ``fastnmt::<name>`` (forward, backward), registered when the extension is built.
    Both pairs get the fakes; the Triton ops get autograd from ``setup_context`` and
    ``make_backward(backward op)``, the C++ forward op has its own, in C++ (csrc/: the same
    gradients), and is the eager and the traced path at once: a CPU step never enters Python
    below the op call. ``running(backend, forward)`` is the implementation of the op (its
    prepared arguments) that calls ``forward`` with the forward op's arguments;
    ``unsupported[backend]`` its reasons. ``inference`` replaces the forward launcher where
    autograd records nothing (it may skip what only a backward reads; default: the launcher)."""
    (forward_op, backward_op), (forward, backward) = triton
    torch.library.register_fake(forward_op)(forward_fake)
    torch.library.register_fake(backward_op)(backward_fake)
    torch.library.register_autograd(
        forward_op, make_backward(backward_op), setup_context=setup_context
    )
    eager = eager_function(f"{op.name}_triton", forward, setup_context, make_backward(backward))
    op.register(
        "triton",
        unsupported["triton"],
        traced=running("triton", forward_op),
        inference=running("triton", forward if inference is None else inference),
    )(running("triton", eager))
    if not extension_available():  # never chosen (the reason: extension_status()), but explained
        op.register("cpp", unsupported["cpp"])(extension_missing)
        return
    cpp_forward, cpp_backward = (getattr(torch.ops.fastnmt, name).default for name in cpp)
    torch.library.register_fake(cpp_forward)(forward_fake)
    torch.library.register_fake(cpp_backward)(backward_fake)
    implementation = running("cpp", cpp_forward)
    op.register("cpp", unsupported["cpp"], traced=implementation)(implementation)


def extension_missing(*_, **__):
    """The C++ implementation where the extension is not built: never chosen (the dispatcher
    gives the reason), never run."""
    raise RuntimeError(extension_status())
