"""How an op's kernels join PyTorch: a forward and a backward kernel, tied by autograd twice.

- Traced (``torch.compile``, ``torch.func``, export): torch.library ops, with the fake
  implementations ``torch.compile`` traces and ``register_autograd``; graphs keep them opaque.
- Eager: a plain ``torch.autograd.Function`` calling the same kernels. torch.library's Python
  layers (the autograd kernel, pytree walks over the arguments, the dispatcher's Python
  implementation of a ``custom_op``) cost far more per call than a small kernel takes on a GPU;
  this path costs two Python calls each way.

Both share one ``setup_context`` and one backward, so they compute the same gradients. An op's
Triton ops and its C++ ops (csrc/) take the same arguments, so one set of functions serves both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastnmt import dispatch
from fastnmt._extension import extension_available, extension_status


def eager_function(name: str, forward: Callable, setup_context: Callable, backward: Callable):
    """``apply(*inputs)``: ``forward(*inputs)`` under autograd, with the op's ``setup_context``
    and ``backward`` (as given to ``register_autograd``). ``forward`` runs below the autograd
    dispatch key: a C++ op then skips its registered (Python) autograd kernel."""

    def run_forward(ctx, *inputs):
        with torch._C._AutoDispatchBelowAutograd():
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
    cpp_autograd_in_cpp: bool = False,
) -> None:
    """Registers ``op``'s Triton and C++ backends.

    ``triton`` is ((forward op, backward op), (forward launcher, backward launcher)): the
    torch.library ops call the launchers, the eager path calls them directly. ``cpp`` names the
    C++ ops ``fastnmt::<name>`` (forward, backward), registered when the extension is built.
    Each pair of ops gets the fakes, and autograd from ``setup_context`` and
    ``make_backward(backward op)``. ``running(backend, forward)`` is the implementation of the op
    (its prepared arguments) that calls ``forward`` with the forward op's arguments;
    ``unsupported[backend]`` its reasons. With ``cpp_autograd_in_cpp`` the C++ forward op
    registers its autograd in C++ (csrc/): it is then the eager and the traced path at once, and
    a CPU step never enters Python below the op call."""
    (triton_ops, triton_launchers) = triton
    kernels = {"triton": (triton_ops, triton_launchers)}
    if extension_available():
        cpp_ops = tuple(getattr(torch.ops.fastnmt, name).default for name in cpp)
        if cpp_autograd_in_cpp:
            for cpp_op, fake in zip(cpp_ops, (forward_fake, backward_fake), strict=True):
                torch.library.register_fake(cpp_op)(fake)
            op.register("cpp", unsupported["cpp"], traced=running("cpp", cpp_ops[0]))(
                running("cpp", cpp_ops[0])
            )
        else:
            kernels["cpp"] = (cpp_ops, cpp_ops)
    else:  # never chosen (the reason: extension_status()), but explained
        op.register("cpp", unsupported["cpp"])(extension_missing)
    for backend, ((forward_op, backward_op), (forward, backward)) in kernels.items():
        torch.library.register_fake(forward_op)(forward_fake)
        torch.library.register_fake(backward_op)(backward_fake)
        torch.library.register_autograd(
            forward_op, make_backward(backward_op), setup_context=setup_context
        )
        eager = eager_function(
            f"{op.name}_{backend}", forward, setup_context, make_backward(backward)
        )
        op.register(backend, unsupported[backend], traced=running(backend, forward_op))(
            running(backend, eager)
        )


def extension_missing(*_, **__):
    """The C++ implementation where the extension is not built: never chosen (the dispatcher
    gives the reason), never run."""
    raise RuntimeError(extension_status())
