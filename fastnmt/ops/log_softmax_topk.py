r"""The k best entries of each row of log_softmax(logits), with some tokens banned: the row step
of beam search and greedy decoding.

``log_softmax_topk(logits, k, banned)`` returns (values, indices), both (N, k), equal to
``log_softmax(logits).index_fill(1, banned, -inf).topk(k)``: banned tokens are never chosen but
stay in the normaliser, as in fairseq's and transformers' searches (whose scores, and so whose
beams, fastnmt's then reproduce; renormalising without them ranks hypotheses differently once a
banned token has probability mass). The C++ kernel breaks ties towards the lower column (a
stable descending sort's first k), the reference as ``torch.topk``.

Math, for row i of logits z_i (V,) and the allowed columns A (all but ``banned``):

    m_i   = max_v z_iv
    lse_i = m_i + log sum_v exp(z_iv - m_i)                       (every column, banned included)
    top_i = the k columns of A of largest z_iv (past |A|: banned ones, as -inf), ties to the lower
    out   = z_{i, top_i} - lse_i

log_softmax shifts a row by a constant, so its top k are the logits' top k and only k values
need the shift: no (N, V) log-probability tensor is written. Beam search then ranks the K*2K
candidates of a sentence (each beam's best 2K contain the sentence's best 2K) instead of its K*V.
A row whose allowed columns are all banned or -inf gives -inf values.

An ensemble's logits (M, N, V) average its members' probabilities at each column (fairseq's
rule), each member normalised over every column:

    out = log (1/M sum_m exp(z_{m,i,top_i} - lse_{m,i}))   top_i: the k largest of that average

so the members' log-probabilities are never written either.

``row_scales`` (N,) (one model's logits): the logits are z_i * row_scales[i], an int8 output
layer's rows as its GEMM wrote them (``fastnmt.quantize``'s ``unscaled``), scaled as they are
read: the (N, V) scaled logits are never written.

Banned ids must lie in [0, V). The op checks this only under ``FASTNMT_CHECK_VALUES=1`` (a host
sync per decoding step otherwise; the search bans fixed ids: pad, bos). Unchecked, a wrong id
still reads and writes nothing out of bounds: the C++ kernel checks the ids, which are on the CPU
with it, and raises; the reference's ``index_fill`` raises on a CPU and fails a device-side
assertion on a GPU.

Backends: C++ (csrc/log_softmax_topk.cpp: one read of each row, then max, sum of exponentials and
a top-k list over a cached fp32 copy) and the reference (torch). There is no Triton kernel: on a
GPU torch's topk and logsumexp are already fused kernels and this step is a small share of a
decoding step; the dispatcher runs the reference there.
"""

from __future__ import annotations

import math

import torch

from fastnmt.ops import checks, dispatch
from fastnmt.ops.extension import extension_available

_CPP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# ---------------------------------------------------------------------------------------------
# PyTorch reference: the oracle of the tests.
# ---------------------------------------------------------------------------------------------


def log_softmax_topk_reference(logits, k, banned, row_scales=None):
    z = logits.float()  # (N, V), or an ensemble's (M, N, V)
    if row_scales is not None:
        z = z * row_scales[:, None]
    lse = torch.logsumexp(z, dim=-1, keepdim=True)  # (..., N, 1), banned columns included
    if z.dim() == 3:  # the members' average probability, as log-probabilities (N, V)
        z = torch.where(lse > float("-inf"), z - lse, float("-inf"))
        z, lse = z.logsumexp(0), torch.tensor(math.log(z.shape[0]), device=z.device)
    if banned is not None:
        z = z.index_fill(1, banned.long(), float("-inf"))  # out of the choice only
    values, indices = z.topk(k, dim=-1)  # ties in torch.topk's order (a full sort: 20x slower)
    return torch.where(lse > float("-inf"), values - lse, float("-inf")), indices


# ---------------------------------------------------------------------------------------------
# C++ launcher and dispatch.
# ---------------------------------------------------------------------------------------------


def log_softmax_topk_cpp(logits, k, banned, row_scales=None):
    banned = logits.new_empty(0, dtype=torch.int64) if banned is None else banned.long()
    return torch.ops.fastnmt.log_softmax_topk_cpp(logits, k, banned, row_scales)


def _cpp_unsupported(logits, **_):
    if logits.dtype not in _CPP_DTYPES:
        yield f"dtype {logits.dtype}: the C++ kernel runs {', '.join(map(str, _CPP_DTYPES))}"


if extension_available():

    @torch.library.register_fake("fastnmt::log_softmax_topk_cpp")
    def _cpp_fake(logits, k, banned, row_scales=None):
        values = logits.new_empty((logits.shape[-2], k), dtype=torch.float32)
        return values, logits.new_empty((logits.shape[-2], k), dtype=torch.int64)


def _prepare(logits, k, banned=None, row_scales=None):
    checks.tensor("logits", logits, floating=True)
    if logits.dim() not in (2, 3):
        raise ValueError(
            f"logits must be (N, V) or an ensemble's (M, N, V), got shape {tuple(logits.shape)}"
        )
    vocab = logits.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
        raise ValueError(f"k must be an int in [1, {vocab}] (logits.shape[-1]), got {k!r}")
    if banned is not None:
        checks.tensor("banned", banned, ndim=1)
        if banned.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"banned must hold int64 or int32 token ids, got {banned.dtype}")
        checks.same_device("banned", banned, "logits", logits)
        _check_banned_range(banned, vocab)
    if row_scales is not None:
        checks.tensor("row_scales", row_scales, ndim=1)
        rows = logits.shape[0] if logits.dim() == 2 else None
        if row_scales.dtype != torch.float32 or row_scales.shape[0] != rows:
            raise ValueError(
                "row_scales must be float32 (N,) for one model's (N, V) logits, got "
                f"{row_scales.dtype} {tuple(row_scales.shape)} for logits {tuple(logits.shape)}"
            )
        checks.same_device("row_scales", row_scales, "logits", logits)
    return logits.device, dict(logits=logits, k=k, banned=banned, row_scales=row_scales)


def _check_banned_range(banned, vocab: int) -> None:
    """Token ids in [0, V): a host sync, so only under FASTNMT_CHECK_VALUES=1 and outside
    tracing (the kernels stay memory-safe without it)."""
    if not checks.values_checked() or torch.compiler.is_compiling():
        return
    if bool(((banned < 0) | (banned >= vocab)).any()):
        raise ValueError(f"banned must hold token ids in [0, {vocab}), got {banned.tolist()}")


LOG_SOFTMAX_TOPK = dispatch.define("log_softmax_topk", _prepare)
LOG_SOFTMAX_TOPK.register("cpp", unsupported=_cpp_unsupported)(log_softmax_topk_cpp)
LOG_SOFTMAX_TOPK.register("reference")(log_softmax_topk_reference)
# The reference is PyTorch's built-ins already: the baseline fastnmt is measured against.
LOG_SOFTMAX_TOPK.register("torch")(log_softmax_topk_reference)


def log_softmax_topk(
    logits, k: int, banned=None, row_scales=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest log-probabilities of each row and their columns, best first.

    Args:
        logits: (N, V) floating scores, or an ensemble's (M, N, V), whose members'
            probabilities are averaged.
        k: how many per row, 1 <= k <= V.
        banned: optional int (n,) column ids never chosen (e.g. pad and bos); they stay in the
            softmax's normaliser, as in fairseq's and transformers' beam search.
        row_scales: optional float32 (N,): the logits are ``logits * row_scales[:, None]``
            (an int8 output layer's unscaled rows), (N, V) logits only.

    Returns:
        values: (N, k) fp32 log-probabilities, descending (-inf for banned columns when k
            exceeds the allowed ones). indices: (N, k) int64 columns; ties go to the lower
            column on the C++ backend, in ``torch.topk``'s order on the reference.
    """
    return LOG_SOFTMAX_TOPK(logits, k, banned, row_scales)
