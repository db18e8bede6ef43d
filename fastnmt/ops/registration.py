"""How an op's kernels join torch.library: a forward op and its backward op, with the fake
implementations ``torch.compile`` traces and the autograd that ties them. An op's Triton ops and
its C++ ops (csrc/) take the same arguments, so one set of functions registers both."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastnmt._extension import extension_available


def register_kernels(
    triton_ops: tuple,
    cpp_op_names: tuple[str, str],
    *,
    forward_fake: Callable,
    backward_fake: Callable,
    setup_context: Callable,
    make_backward: Callable,
) -> None:
    """Fakes and autograd for the (forward, backward) Triton ops and, when the extension is
    loaded, for the C++ ops ``fastnmt::<name>`` named in ``cpp_op_names``;
    ``make_backward(backward_op)`` is a forward op's backward."""
    pairs = [triton_ops]
    if extension_available():
        pairs.append(tuple(getattr(torch.ops.fastnmt, name).default for name in cpp_op_names))
    for forward_op, backward_op in pairs:
        torch.library.register_fake(forward_op)(forward_fake)
        torch.library.register_fake(backward_op)(backward_fake)
        torch.library.register_autograd(
            forward_op, make_backward(backward_op), setup_context=setup_context
        )
