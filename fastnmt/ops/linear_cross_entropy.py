r"""Output projection + label-smoothed cross entropy, never materialising the (tokens x V) logits.

``linear_cross_entropy(hidden, weight, bias, target, label_smoothing, ignore_index, reduction)``
equals ``F.cross_entropy(F.linear(hidden, weight, bias), target, ...)`` and also returns the
summed nll, the number of correct argmax predictions and the number of counted tokens.

Math, for token i with hidden state h_i (E,), target t_i, vocabulary size V, smoothing eps:

    z_i    = W h_i + b                                   logits (V,)
    m_i    = max_v z_iv
    lse_i  = m_i + log sum_v exp(z_iv - m_i)
    nll_i  = lse_i - z_{i,t_i}
    loss_i = (1 - eps) nll_i + (eps / V) sum_v (lse_i - z_iv)
           = (1 - eps) nll_i + (eps / V) (V (lse_i - m_i) - sum_v (z_iv - m_i))
           (the last form has no cancellation between V lse_i and sum_v z_iv in fp32)

Tokens with t_i = ignore_index count for nothing. reduction="sum" adds loss_i; "mean" divides by
the number of counted tokens, and is defined as 0 when there are none (``F.cross_entropy`` gives
NaN there, which would poison a training run on an all-padding batch).

Gradient, with p_i = softmax(z_i) and s = 1 (sum) or 1 / counted tokens (mean):

    g_iv  = p_iv - eps / V - (1 - eps) [v = t_i]         the gradient of the summed loss, |g| <= 1
    dz_iv = s g_iv
    dh_i  = s sum_v g_iv W_v,     dW = s sum_i g_i h_i^T,     db = s sum_i g_i

The kernels form g and its products (the gradient of the summed loss) and the backward multiplies
them by (dloss s) in fp32 before casting to the gradients' dtypes. Forming s g in the kernel would
round it to the compute dtype first: in fp16, a mean over thousands of tokens puts s g below fp16's
normal range, and it underflows before a GradScaler's large dloss arrives in the backward (unfused
fp16 autocast computes the cross entropy's gradient in fp32, scaled by dloss s, then casts).

Chunking (Liger-Kernel's fused linear cross entropy, here for CPUs too): the tokens are processed
in chunks of about ``_CHUNK_ELEMENTS / V`` rows. For each chunk a library GEMM writes its logits,
a row kernel (Triton, or C++ in csrc/linear_cross_entropy.cpp) reads each row while it is in cache,
writes the loss statistics and overwrites the row with g, and two more GEMMs turn g into the
chunk's dh and its share of dW (accumulated in fp32). The loss is a scalar, so its gradient is
computed in the forward and the backward only scales it by dloss s: three GEMMs, as unfused, and
one chunk of logits alive at a time instead of logits, fp32 logits, log-probabilities and their
gradients over all tokens. s stays a device tensor (no host sync). reduction="none" with
gradients needs each token's gradient scaled separately, so it runs on the reference path;
without (scoring), the C++ backend returns its row kernel's per-token losses, chunk by chunk.

On a GPU a chunk holds up to ``_GPU_CHUNK_ELEMENTS`` logits (a call of 4,096 tokens over 32k words
is one chunk): there a chunk costs kernel launches, which cost more host time than the GEMMs take
at training shapes. The row kernel writes each row's statistics into one buffer, reduced once
after the last chunk by a one-program kernel that also forms the loss, and the first chunk's dW
and db start the sums. The backward is one kernel that multiplies the three gradients by
(dloss s) and casts them. A forward + backward on one chunk is seven launches (eight when the
GEMMs' dtype differs from fp32; tests/ops/test_linear_cross_entropy.py counts them): the three
GEMMs of the unfused loss, the row kernel, db's column sum, the statistics and the scaling.

Targets must lie in [0, V) or equal ignore_index. The op checks this only under
``FASTNMT_CHECK_VALUES=1`` (a host sync; callers check their batches on the CPU). Otherwise an
out-of-range target gives an undefined loss and gradient for its token, as ``F.cross_entropy`` on
CUDA does, but the Triton kernel reads no memory outside the row (the C++ kernel raises).

The chunked driver of the Triton row kernel and its launchers are in
``fastnmt.ops.triton.linear_cross_entropy`` (``_CHUNK_ELEMENTS`` and ``_GPU_CHUNK_ELEMENTS``
included), the C++ driver in csrc/linear_cross_entropy.cpp.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fastnmt.ops import checks, dispatch, registration
from fastnmt.ops.extension import extension_available
from fastnmt.ops.triton.linear_cross_entropy import _chunked, _scale_gradients

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# PyTorch reference: logits, one log-softmax over the whole vocabulary, and its gradient.
# ---------------------------------------------------------------------------------------------


class CrossEntropyOutput(NamedTuple):
    loss: torch.Tensor  # fp32 (fp64 for fp64 inputs) scalar (sum / mean), or per-token losses
    nll: torch.Tensor  # sum over counted tokens of -log p(target), fp64, no gradient
    correct: torch.Tensor  # counted tokens whose argmax logit is the target, fp64
    tokens: torch.Tensor  # counted tokens (target != ignore_index), fp64


def linear_cross_entropy_reference(
    hidden, weight, bias, target, label_smoothing, ignore_index, reduction
):
    hidden, target = _flat(hidden, target)
    return _cross_entropy_reference(
        F.linear(hidden, weight, bias), target, label_smoothing, ignore_index, reduction
    )


def _cross_entropy_reference(logits, target, label_smoothing, ignore_index, reduction):
    """The reference's loss and statistics of (N, V) logits."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp64 stays fp64
    log_probs = F.log_softmax(logits, dim=-1)
    counted = target != ignore_index
    gold = torch.where(counted, target, 0)
    nll = -log_probs.gather(1, gold[:, None]).squeeze(1) * counted
    smoothed = -log_probs.mean(dim=-1) * counted
    losses = (1.0 - label_smoothing) * nll + label_smoothing * smoothed
    tokens = counted.sum()
    if reduction == "sum":
        loss = losses.sum()
    elif reduction == "mean":
        loss = losses.sum() / tokens.clamp_min(1)
    else:
        loss = losses
    correct = ((logits.argmax(dim=-1) == target) & counted).sum()
    statistics = torch.stack([nll.detach().sum(), correct, tokens]).double()
    return loss, statistics


def linear_cross_entropy_torch(
    hidden, weight, bias, target, label_smoothing, ignore_index, reduction
):
    """``F.cross_entropy(F.linear(...))`` over fp32 logits: what a model written with PyTorch's
    built-ins runs (the baseline fastnmt is measured against); its statistics from the same
    logits, outside autograd."""
    hidden, target = _flat(hidden, target)
    logits = F.linear(hidden, weight, bias).float()  # (N, V)
    loss = F.cross_entropy(
        logits, target, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing,
    )  # fmt: skip
    with torch.no_grad():
        counted = target != ignore_index
        nll = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
        correct = ((logits.argmax(dim=-1) == target) & counted).sum()
        statistics = torch.stack([nll, correct, counted.sum()]).double()
    return loss, statistics


def _flat(hidden, target):
    """hidden as (N, E) and target as int64 (N,), N tokens."""
    return hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1).long()


# ---------------------------------------------------------------------------------------------
# Registered ops (torch.library) with autograd, the dispatch entry and the public function.
# ---------------------------------------------------------------------------------------------


@registration.triton_library_op("fastnmt::linear_cross_entropy_triton")
def _triton_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    mean: bool,
    compute_grad: bool,
    dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, [nll, correct, tokens], dhidden, dweight, dbias): see ``_chunked``."""
    return _chunked(
        hidden,
        weight,
        bias,
        target,
        label_smoothing,
        ignore_index,
        mean,
        compute_grad,
        dtype,
    )


def _fake(hidden, weight, bias, target, label_smoothing, ignore_index, mean, compute_grad, dtype):
    def gradient_of(shape, dtype=torch.float32, wanted=compute_grad):
        return hidden.new_empty(shape if wanted else (0,), dtype=dtype)

    return (
        hidden.new_empty((), dtype=torch.float32),
        hidden.new_empty(3, dtype=torch.float64),
        gradient_of(hidden.shape, hidden.dtype),
        gradient_of(weight.shape),
        gradient_of((weight.shape[0],), wanted=compute_grad and bias is not None),
    )


def _setup_context(ctx, inputs, output):
    hidden, weight, bias = inputs[:3]
    ctx.mean, ctx.compute_grad = inputs[6], inputs[7]
    ctx.grad_dtypes = [hidden.dtype, weight.dtype, None if bias is None else bias.dtype]
    ctx.save_for_backward(*output[1:])
    # Only the loss has a gradient: the other outputs get no zero-filled ones to allocate.
    ctx.set_materialize_grads(False)


@registration.triton_library_op("fastnmt::linear_cross_entropy_triton_backward")
def _triton_backward_op(
    dloss: torch.Tensor,
    statistics: torch.Tensor,
    dh: torch.Tensor,
    dw: torch.Tensor,
    db: torch.Tensor,
    mean: bool,
    hidden_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    bias_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dhidden, dweight, dbias or empty): see ``_scale_gradients``."""
    return _scale_gradients(
        dloss, statistics, dh, dw, db, mean, hidden_dtype, weight_dtype, bias_dtype
    )


@torch.library.register_fake(_triton_backward_op)
def _backward_fake(dloss, statistics, dh, dw, db, mean, hidden_dtype, weight_dtype, bias_dtype):
    with_bias = bias_dtype is not None
    return (
        dh.new_empty(dh.shape, dtype=hidden_dtype),
        dw.new_empty(dw.shape, dtype=weight_dtype),
        db.new_empty(db.shape if with_bias else (0,), dtype=bias_dtype or torch.float32),
    )


def _make_backward(backward_op):
    """The autograd backward of the Triton forward, scaling on ``backward_op``."""

    def backward(ctx, dloss, _dstatistics, _dh, _dw, _db):
        if not ctx.compute_grad:
            raise RuntimeError("linear_cross_entropy ran with compute_grad=False: no gradient kept")
        if dloss is None:  # the loss was not used
            return (None,) * 9
        grad_h, grad_w, grad_b = backward_op(dloss, *ctx.saved_tensors, ctx.mean, *ctx.grad_dtypes)
        return grad_h, grad_w, (None if ctx.grad_dtypes[2] is None else grad_b), *(None,) * 6

    return backward


# The Triton op's autograd in Python; the C++ op (csrc/linear_cross_entropy.cpp: the same driver
# and the same backward, in C++) registers its own, so a CPU step never enters Python below the op
# call.
torch.library.register_fake(_triton_op)(_fake)
_triton_op.register_autograd(_make_backward(_triton_backward_op), setup_context=_setup_context)
_triton_eager = registration.eager_function(
    "linear_cross_entropy_triton", _chunked, _setup_context, _make_backward(_scale_gradients)
)
if extension_available():
    _cpp_op = torch.ops.fastnmt.linear_cross_entropy_cpp.default
    torch.library.register_fake(_cpp_op)(_fake)
else:
    _cpp_op = registration.extension_missing


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast runs GEMMs in on ``device``, or None outside autocast."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def _running(fused_op):
    """The implementation of the op on a fused registered op."""

    def implementation(hidden, weight, bias, target, label_smoothing, ignore_index, reduction):
        # Inline rather than helpers (_flat, _autocast_dtype): each is a Python call per op call;
        # and no reshape of a flat input: a view costs an autograd node (the trainer's are flat).
        if hidden.dim() != 2:
            hidden = hidden.reshape(-1, hidden.shape[-1])
        if target.dim() != 1 or target.dtype != torch.int64:
            target = target.reshape(-1).long()
        trained = hidden.requires_grad or weight.requires_grad
        needs_grad = torch.is_grad_enabled() and (
            trained or (bias is not None and bias.requires_grad)
        )
        device_type = hidden.device.type
        autocasting = torch.is_autocast_enabled(device_type)
        autocast_dtype = torch.get_autocast_dtype(device_type) if autocasting else None
        loss, statistics, *_ = fused_op(
            hidden,
            weight,
            bias,
            target,
            label_smoothing,
            ignore_index,
            reduction == "mean",
            needs_grad,
            autocast_dtype,
        )
        return loss, statistics

    return implementation


def _per_token_cpp(hidden, weight, bias, target, label_smoothing, ignore_index):
    """reduction='none' without gradients: ``per_token_losses`` of ``F.linear``'s logits, in the
    dtype the fused op computes them in."""
    hidden, target = _flat(hidden, target)
    dtype = _autocast_dtype(hidden.device) or hidden.dtype
    h, w = hidden.to(dtype), weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    linear = functools.partial(F.linear, weight=w, bias=b)
    return per_token_losses(h, linear, w.shape[0], target, label_smoothing, ignore_index)


# Scoring's chunks on a CPU: about 2M logits (4 MB in bf16), which stay in a core's caches from
# the GEMM that writes them to the row kernel that reads them, and at least 256 tokens, below
# which a chunk's GEMM reads the whole output layer for little work. Whole multiples of 64 rows,
# which packed GEMMs run unpadded.
_SCORING_CHUNK_ELEMENTS = 1 << 21
_SCORING_MIN_ROWS = 256


def _scoring_chunk_rows(vocab_size: int) -> int:
    return max(_SCORING_MIN_ROWS, _SCORING_CHUNK_ELEMENTS // max(vocab_size, 1) // 64 * 64)


@torch.no_grad()
def per_token_losses(
    hidden, output_layer, vocab_size, target, label_smoothing=0.0, ignore_index=-100,
    statistics=True,
):  # fmt: skip
    """Each token's loss (N,) of the logits ``output_layer(hidden)`` (N, E) -> (N, V), without
    gradients, chunk by chunk (no (N, V) tensor beyond a chunk's; the C++ row kernel turns a
    chunk's logits into losses while they are in a CPU's caches), and the statistics
    ``linear_cross_entropy`` returns (nll, correct, tokens). ``output_layer`` is any GEMM, such
    as ``fastnmt.quantize``'s packed ones, whose weight oneDNN reordered once (``F.linear`` on a
    CPU reorders it at every call: about a sixth of a 1,000-row chunk's time on an AMX CPU). One
    with an ``unscaled`` method (``fastnmt.quantize``'s int8 layers) hands over its output rows
    and their scales, which the row kernel applies as it reads them. ``statistics=False``
    (scoring, without label smoothing): the losses only, the statistics None, and one pass
    over each row of logits rather than two (no argmax to find: 1.3x as fast a row)."""
    if not extension_available():
        logits = output_layer(hidden)
        losses, stats = _cross_entropy_reference(
            logits, target, label_smoothing, ignore_index, "none"
        )
        return losses, (stats if statistics else None)
    loss_only = not statistics and label_smoothing == 0.0
    step = _scoring_chunk_rows(vocab_size)
    gemm = getattr(output_layer, "unscaled", lambda x: (output_layer(x), None))
    rows = [hidden.new_zeros((0, 3), dtype=torch.float32)]  # per token: loss, nll, correct
    for start in range(0, hidden.shape[0], step):
        logits, scales = gemm(hidden[start : start + step])
        chunk = target[start : start + step]
        rows.append(
            torch.ops.fastnmt.cross_entropy_rows_cpp(
                logits, chunk, label_smoothing, ignore_index, False, scales, loss_only
            )
        )
    stats = torch.cat(rows)
    if not statistics:
        return stats[:, 0], None
    counted = (target != ignore_index).sum(dtype=torch.float64)
    return stats[:, 0], torch.cat([stats[:, 1:].sum(0, dtype=torch.float64), counted[None]])


_PER_TOKEN_GRADIENTS = (
    "reduction='none' needs each token's gradient scaled on its own; the fused kernels compute "
    "the gradient of a summed or mean loss in the forward"
)


def _fused_unsupported(kernels: str, per_token_inference: bool = False):
    """The fused backends' reasons; ``per_token_inference``: reduction='none' runs where no
    gradient is needed."""

    def unsupported(hidden, weight, bias, target, label_smoothing, ignore_index, reduction):
        if reduction == "none" and not per_token_inference:
            yield _PER_TOKEN_GRADIENTS
        elif reduction == "none" and dispatch.needs_autograd((hidden, weight, bias)):
            yield _PER_TOKEN_GRADIENTS + " (without gradients the C++ kernel gives them)"
        dtype = _autocast_dtype(hidden.device) or hidden.dtype
        if dtype not in _SUPPORTED_DTYPES:
            yield f"hidden has dtype {dtype}; the {kernels} kernels take fp32, fp16 and bf16"

    return unsupported


def _prepare(
    hidden, weight, bias, target, label_smoothing=0.0, ignore_index=-100, reduction="mean"
):
    checks.tensor("hidden", hidden, floating=True)
    checks.tensor("weight", weight, ndim=2, floating=True)
    if hidden.dim() == 0 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden must have shape (..., {weight.shape[1]}) (weight is (V, E) = "
            f"{tuple(weight.shape)}), got {tuple(hidden.shape)}"
        )
    checks.same_device("weight", weight, "hidden", hidden)
    if not checks.autocasting(hidden.device):
        checks.same_dtype("weight", weight, "hidden", hidden)
    if bias is not None:
        checks.tensor("bias", bias, floating=True)
        checks.shape("bias", bias, (weight.shape[0],), "the vocabulary size, weight.shape[0]")
        checks.same_device("bias", bias, "hidden", hidden)
    checks.tensor("target", target)
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must hold int64 or int32 class indices, got {target.dtype}")
    checks.shape("target", target, tuple(hidden.shape[:-1]), "hidden's shape without E")
    checks.same_device("target", target, "hidden", hidden)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    _check_target_range(target.reshape(-1), weight.shape[0], ignore_index)
    prepared = dict(
        hidden=hidden,
        weight=weight,
        bias=bias,
        target=target,
        label_smoothing=checks.probability("label_smoothing", label_smoothing),
        ignore_index=ignore_index,
        reduction=reduction,
    )
    return hidden.device, prepared


def _check_target_range(target, vocab: int, ignore_index: int) -> None:
    """Class indices in [0, V) or ignore_index: a host sync, so only under
    FASTNMT_CHECK_VALUES=1 and outside tracing (the kernels stay memory-safe without it)."""
    if not checks.values_checked() or torch.compiler.is_compiling():
        return
    outside = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    if outside.any():
        position = int(outside.nonzero()[0, 0])
        raise ValueError(
            f"target must hold class indices in [0, {vocab}) or ignore_index ({ignore_index}); "
            f"got {int(target[position])} at flat position {position}"
        )


LINEAR_CROSS_ENTROPY = dispatch.define("linear_cross_entropy", _prepare)
LINEAR_CROSS_ENTROPY.register("reference")(linear_cross_entropy_reference)
LINEAR_CROSS_ENTROPY.register("torch")(linear_cross_entropy_torch)
LINEAR_CROSS_ENTROPY.register(
    "triton",
    _fused_unsupported("Triton"),
    traced=_running(_triton_op),
    inference=_running(_chunked),
)(_running(_triton_eager))


def _cpp_inference(hidden, weight, bias, target, label_smoothing, ignore_index, reduction):
    if reduction == "none":
        return _per_token_cpp(hidden, weight, bias, target, label_smoothing, ignore_index)
    return _fused_cpp(hidden, weight, bias, target, label_smoothing, ignore_index, reduction)


_fused_cpp = _running(_cpp_op)
LINEAR_CROSS_ENTROPY.register(
    "cpp", _fused_unsupported("C++", per_token_inference=True), inference=_cpp_inference
)(_fused_cpp)


def linear_cross_entropy(
    hidden, weight, bias, target, label_smoothing=0.0, ignore_index=-100, reduction="mean"
) -> CrossEntropyOutput:
    """Label-smoothed cross entropy of the logits ``hidden @ weight.T + bias``, without forming
    them for all tokens at once on the fused backends.

    Args:
        hidden: (..., E) states; under autocast, computed in the autocast dtype like ``F.linear``.
        weight: (V, E) output projection (e.g. a tied embedding), same dtype as hidden outside
            autocast. bias: (V,) or None.
        target: (...) int64/int32 class indices in [0, V), or ``ignore_index``.
        label_smoothing: eps in [0, 1), as in ``F.cross_entropy``.
        reduction: "mean" (over counted tokens; 0 when none), "sum", or "none" (per-token
            losses, shape of target: on the C++ kernels without gradients, else the
            reference).

    Returns:
        ``CrossEntropyOutput(loss, nll, correct, tokens)``: the loss, and for logging the summed
        nll, the number of correct argmax predictions and of counted tokens.
    """
    loss, statistics = LINEAR_CROSS_ENTROPY(
        hidden, weight, bias, target, label_smoothing, ignore_index, reduction
    )
    if reduction == "none":
        loss = loss.view(target.shape)
    return CrossEntropyOutput(loss, *statistics.detach().unbind())
