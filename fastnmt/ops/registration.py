"""How an op's kernels join torch.library: a forward op and its backward op, with the fake
implementations ``torch.compile`` traces and the autograd that ties them. An op's Triton and C++
kernels take the same arguments, so one set of functions registers both."""

from __future__ import annotations

from collections.abc import Callable

import torch


def register_kernel_pair(
    forward_op,
    backward_op,
    *,
    forward_fake: Callable,
    backward_fake: Callable,
    setup_context: Callable,
    make_backward: Callable,
) -> None:
    """Fakes for both ops, and ``make_backward(backward_op)`` as the forward op's backward."""
    torch.library.register_fake(forward_op)(forward_fake)
    torch.library.register_fake(backward_op)(backward_fake)
    torch.library.register_autograd(
        forward_op, make_backward(backward_op), setup_context=setup_context
    )
