"""The launchers of ``fastnmt.ops.attention``'s Triton kernels (``attention_kernels``): launch
configurations, output buffers and grids.
"""

from __future__ import annotations

import functools

import torch

from fastnmt.ops.triton.attention_kernels import (
    _attention_backward_dkdv_kernel,
    _attention_backward_dq_kernel,
    _attention_forward_kernel,
    _dropout_keep_kernel,
)
from fastnmt.ops.triton.common import (
    LaunchConfig,
    Launcher,
    as_dtype,
    cdiv,
    dot_precision,
    kernel_output_dtype,
    launch_options,
    new_output,
    new_output_like,
    power_of_2_at_least,
    size_hint,
    static_size,
    upcast_in_interpreter,
    use_gpu_tiles,
)

MAX_HEAD_DIM = 128
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# A documented heuristic rather than triton.autotune: MT batches change shape every step, and
# autotuning each new shape would cost more than it saves. Keyed on buckets of (Lq, Lk):
# - "decode": Lq <= 16, incremental decoding and beam search against a KV cache (forward only):
#   16-row query blocks, so a step of 1-4 queries does not compute 64 rows of padding;
# - "short": lengths up to 256, the sentences of machine translation: 64-row tiles, so that small
#   batches still give enough programs to fill the GPU ("mid": the part of them over 128);
# - "long": longer sequences: 128-row query blocks with 8 warps, as FlashAttention-2;
# and on the head dim: each bucket maps the widest head dim a config serves to the config (the
# first that fits is used; a bucket a kernel lacks falls back to "short"). Wide heads need
# narrower key blocks or more warps to stay in registers: every config below compiles without
# spills with every mask feature and dropout on (python -m fastnmt.compile_check), under triton
# 3.6 and 3.9 (3.6 allocates registers less tightly: key blocks twice as wide spill there).
_GPU_CONFIGS = {
    "forward": {
        "decode": {128: LaunchConfig(16, 32, 4, 2)},
        "short": {64: LaunchConfig(64, 32, 4, 2), 128: LaunchConfig(64, 32, 8, 2)},
        "long": {64: LaunchConfig(128, 64, 8, 3), 128: LaunchConfig(64, 32, 8, 2)},
    },
    # dK/dV's tiles have the keys along their rows: 64 of them, wgmma's tile; 128 from 129 keys
    # on (bf16 at L 256, head dim 64, on an H200: 0.232 ms against 0.261 forward + backward; 32
    # query rows with them spill on sm_80).
    "dkdv": {
        "mid": {64: LaunchConfig(16, 128, 8, 2)},
        "short": {64: LaunchConfig(32, 64, 8, 2), 128: LaunchConfig(16, 64, 8, 2)},
    },
    "dq": {
        "short": {64: LaunchConfig(64, 32, 4, 2), 128: LaunchConfig(64, 16, 8, 2)},
        "long": {64: LaunchConfig(128, 32, 8, 2)},
    },
}
_KEEP_CONFIG = LaunchConfig(64, 64, 4, 1)  # of the dropout-mask kernel (tests, debugging)


def _interpreter_block(length: int) -> int:
    """The interpreter's cost grows with the number of blocks: one block per sequence up to 128."""
    return min(128, max(16, power_of_2_at_least(length)))


def _length_buckets(lq: int, lk: int) -> list[str]:
    """The buckets of (lq, lk), most specific first."""
    longest = max(lq, lk)
    return (
        ["decode"] * (lq <= 16) + ["long"] * (longest > 256) + ["mid"] * (longest > 128) + ["short"]
    )


def launch_config(kernel: str, lq: int, lk: int, head_dim: int) -> LaunchConfig:
    """Block sizes of ``kernel`` ("forward", "dkdv" or "dq") for lengths lq, lk and the
    larger of the q/k and v head dims."""
    try:
        return _chosen_config(kernel, lq, lk, head_dim, use_gpu_tiles())
    except TypeError:  # symbolic sizes, unhashable: a trace with dynamic shapes
        hinted = (size_hint(lq), size_hint(lk), static_size(head_dim))
        return _chosen_config(kernel, *hinted, use_gpu_tiles())


@functools.lru_cache(maxsize=4096)  # per call signature, as the dispatcher's decisions
def _chosen_config(kernel: str, lq: int, lk: int, head_dim: int, gpu_tiles: bool) -> LaunchConfig:
    if not gpu_tiles:
        return LaunchConfig(_interpreter_block(lq), _interpreter_block(lk), 4, 1)
    for bucket in _length_buckets(lq, lk):
        for widest, config in _GPU_CONFIGS[kernel].get(bucket, {}).items():
            if head_dim <= widest:
                return config
    raise AssertionError(f"no {kernel} config for head dim {head_dim}")  # > MAX_HEAD_DIM


def _head_block(head_dim: int) -> int:
    """Head dims are padded to a power of two (>= 16, the smallest tl.dot) and masked."""
    return max(16, power_of_2_at_least(head_dim))


@functools.lru_cache(maxsize=1024)
def _options(
    config: LaunchConfig,
    head_dim: int,
    value_dim: int,
    dtype: torch.dtype,
    precision: str,
    causal: bool,
    has_lengths: bool,
    has_padding: bool,
    dropout: bool,
    **flags: bool,  # a kernel's own: the forward's HAS_CACHE_ROWS and VARLEN, dQ's HAS_GRAD_LSE
) -> dict:
    """The constexprs and launch options of the forward, dK/dV and dQ kernels."""
    return launch_options(
        **flags,
        CAUSAL=causal,
        HAS_LENGTHS=has_lengths,
        HAS_PADDING=has_padding,
        DROPOUT=dropout,
        UPCAST=upcast_in_interpreter(dtype),
        DOT_PRECISION=precision,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=_head_block(head_dim),
        BLOCK_DV=_head_block(value_dim),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _padding_view(key_padding_mask):
    """The bool mask as uint8 (same bytes, no copy) and its strides: Triton loads bytes."""
    if key_padding_mask is None:
        return None, (0, 0)
    padding = key_padding_mask.view(torch.uint8)
    return padding, padding.stride()


def _new_attention_output(shape, dtype, device) -> torch.Tensor:
    """An empty (B, H, Lq, Dv) output lying (B, Lq, H, Dv) in memory, as FlashAttention's: joining
    the heads to (B, Lq, H * Dv) for the output projection is then a view, not a copy (the
    kernels write through strides). The C++ op allocates the same."""
    _, heads, lq, value_dim = shape
    strides = (lq * heads * value_dim, value_dim, heads * value_dim, 1)
    return new_output(shape, dtype, device, strides)


_FORWARD = Launcher(_attention_forward_kernel)
_DKDV = Launcher(_attention_backward_dkdv_kernel)
_DQ = Launcher(_attention_backward_dq_kernel)
_KEEP = Launcher(_dropout_keep_kernel)


def _launch_forward(
    q, k, v, key_lengths, key_padding_mask, seed, causal, dropout_p, scale, cache_rows
):
    batch, heads, lq, head_dim = q.shape
    lk, value_dim = k.shape[2], v.shape[3]
    if head_dim.__class__ is not int:  # a trace with dynamic shapes: blocks need fixed dims
        head_dim, value_dim = static_size(head_dim), static_size(value_dim)
    out = _new_attention_output(
        (batch, heads, lq, value_dim), kernel_output_dtype(q.dtype), q.device
    )
    lse = new_output((batch, heads, lq), torch.float32, q.device)
    padding, padding_strides = _padding_view(key_padding_mask)
    config = launch_config("forward", lq, lk, max(head_dim, value_dim))
    options = _options(
        config, head_dim, value_dim, q.dtype, dot_precision(q.dtype), causal,
        key_lengths is not None, padding is not None, seed is not None,
        HAS_CACHE_ROWS=cache_rows is not None, VARLEN=False,
    )  # fmt: skip
    _FORWARD(
        q.device,
        (batch * heads, cdiv(lq, config.block_m), 1),
        (
            q, k, v, out, lse, key_lengths, padding, seed, cache_rows, None, None,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *padding_strides,
            *(cache_rows.stride() if cache_rows is not None else (0, 0)),
            heads, lq, lk, head_dim, value_dim, scale, dropout_p, 0,
        ),
        options,
    )  # fmt: skip
    return as_dtype(out, q.dtype), lse


def _launch_forward_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed, causal, dropout_p,
    scale,
):  # fmt: skip
    """The forward kernel over packed sequences (``attention_varlen``): q (total_q, H, D), k
    (total_k, H, D), v (total_k, H, Dv) -> out (total_q, H, Dv), lse (H, total_q); one program
    per (sequence, head, block of the longest sequence's queries), those past a sequence's own
    queries reading nothing. Dropout draws keep_ij as the padded kernels do, with Lk the longest
    sequence's (``dropout_keep_mask(seed, (B, H, max_seqlen_q, max_seqlen_k), p)``)."""
    total_q, heads, head_dim = q.shape
    value_dim, batch = v.shape[2], cu_seqlens_q.shape[0] - 1
    if head_dim.__class__ is not int:  # a trace with dynamic shapes: blocks need fixed dims
        head_dim, value_dim = static_size(head_dim), static_size(value_dim)
    out = new_output((total_q, heads, value_dim), kernel_output_dtype(q.dtype), q.device)
    lse = new_output((heads, total_q), torch.float32, q.device)
    config = launch_config("forward", max_seqlen_q, max_seqlen_k, max(head_dim, value_dim))
    blocks = cdiv(max_seqlen_q, config.block_m)
    if batch and blocks:  # a grid of no program is no launch
        options = _options(
            config, head_dim, value_dim, q.dtype, dot_precision(q.dtype), causal, False, False,
            seed is not None, HAS_CACHE_ROWS=False, VARLEN=True,
        )  # fmt: skip
        _FORWARD(
            q.device,
            (batch * heads, blocks, 1),
            (
                q, k, v, out, lse, None, None, seed, None, cu_seqlens_q, cu_seqlens_k,
                *_packed_strides(q), *_packed_strides(k), *_packed_strides(v),
                *_packed_strides(out), 0, 0, 0, 0,
                heads, max_seqlen_q, max_seqlen_k, head_dim, value_dim, scale, dropout_p, total_q,
            ),
            options,
        )  # fmt: skip
    return as_dtype(out, q.dtype), lse


def _packed_strides(x: torch.Tensor) -> tuple[int, int, int, int]:
    """A packed (total, H, D) tensor's strides in the kernels' (b, h, row, d) order: rows start
    at each sequence's offset, so b steps nothing."""
    return 0, x.stride(1), x.stride(0), x.stride(2)


def _launch_backward(
    grad_out, grad_lse, q, k, v, out, lse, key_lengths, key_padding_mask, seed, causal, dropout_p,
    scale,
):  # fmt: skip
    batch, _, lq, _ = q.shape
    # Dense in each input's dimension order (torch.empty_like, as SDPA's): the gradient of
    # proj(h).view(B, L, H, D).transpose(1, 2) then reaches proj's output without a copy.
    grad_dtype = kernel_output_dtype(q.dtype)
    grads = (
        new_output_like(q, grad_dtype),
        new_output_like(k, grad_dtype),
        new_output_like(v, grad_dtype),
    )
    padding, padding_strides = _padding_view(key_padding_mask)
    if grad_lse is not None:  # rare (a caller that used the LSE): read as (B, H, Lq) rows
        grad_lse = grad_lse.contiguous()
    _backward_kernels(
        (grad_out, grad_lse, q, k, v, out, lse), grads, (key_lengths, padding, seed, None, None),
        padding_strides, (batch, lq, k.shape[2], 0), causal, dropout_p, scale,
    )  # fmt: skip
    return grads if grad_dtype == q.dtype else _in_dtypes(grads, (q, k, v))


def _launch_backward_varlen(
    grad_out, grad_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, seed, causal, dropout_p, scale,
):  # fmt: skip
    """``_launch_backward`` over packed sequences (``_launch_forward_varlen``'s)."""
    grad_dtype = kernel_output_dtype(q.dtype)
    grads = (
        new_output_like(q, grad_dtype),
        new_output_like(k, grad_dtype),
        new_output_like(v, grad_dtype),
    )
    if grad_lse is not None:  # (H, total_q) rows
        grad_lse = grad_lse.contiguous()
    batch = cu_seqlens_q.shape[0] - 1
    if batch and max_seqlen_q and max_seqlen_k:
        operands = (
            _as_batch(grad_out), grad_lse, _as_batch(q), _as_batch(k), _as_batch(v),
            _as_batch(out), lse,
        )  # fmt: skip
        _backward_kernels(
            operands, (_as_batch(grads[0]), _as_batch(grads[1]), _as_batch(grads[2])),
            (None, None, seed, cu_seqlens_q, cu_seqlens_k), (0, 0),
            (batch, max_seqlen_q, max_seqlen_k, q.shape[0]), causal, dropout_p, scale,
        )  # fmt: skip
    else:  # no program: every gradient is 0
        for grad in grads:
            grad.zero_()
    return grads if grad_dtype == q.dtype else _in_dtypes(grads, (q, k, v))


def _as_batch(x: torch.Tensor) -> torch.Tensor:
    """A packed (total, H, D) tensor as the kernels' (B, H, L, D) operand: one batch entry of
    all its rows, with ``_packed_strides``."""
    total, heads, width = x.shape
    return x.as_strided((1, heads, total, width), _packed_strides(x), x.storage_offset())


def _in_dtypes(grads, inputs):
    """The gradients in their inputs' dtypes (the kernels write fp16 and bf16 ones as such)."""
    pairs = zip(grads, inputs, strict=True)
    return tuple(g if g.dtype == x.dtype else g.to(x.dtype) for g, x in pairs)


def _backward_kernels(
    tensors, grads, pointers, padding_strides, sizes, causal, dropout_p, scale
):  # fmt: skip
    """dQ's kernel (which writes delta), then dK/dV's. ``tensors``: (grad_out, grad_lse, q, k, v,
    out, lse), 4-D (B, H, L, D) operands but the LSEs; ``grads``: dq, dk, dv, as q, k, v;
    ``pointers``: key_lengths, padding, seed, cu_seqlens_q, cu_seqlens_k; ``sizes``: (B, Lq,
    Lk, total_q): the longest lengths, and the packed queries when packed (else 0)."""
    grad_out, grad_lse, q, k, v, out, lse = tensors
    grad_q, grad_k, grad_v = grads
    batch, lq, lk, total_q = sizes
    heads, head_dim, value_dim = q.shape[1], q.shape[3], v.shape[3]
    if head_dim.__class__ is not int:  # a trace with dynamic shapes: blocks need fixed dims
        head_dim, value_dim = static_size(head_dim), static_size(value_dim)
    delta = new_output(lse.shape, torch.float32, q.device)  # dQ's, for dK/dV; rows as the LSE's
    key_lengths, padding, seed, cu_seqlens_q, _ = pointers
    shared = (
        *pointers,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *padding_strides,
        heads, lq, lk, head_dim, value_dim, scale, dropout_p, total_q,
    )  # fmt: skip
    flags = (
        q.dtype, dot_precision(q.dtype), causal, key_lengths is not None, padding is not None,
        seed is not None,
    )  # fmt: skip
    varlen = cu_seqlens_q is not None
    config = launch_config("dq", lq, lk, max(head_dim, value_dim))
    _DQ(
        q.device,
        (batch * heads, cdiv(lq, config.block_m), 1),
        (
            q, k, v, grad_out, lse, delta, grad_q, out, grad_lse,
            *grad_q.stride(), *out.stride(), *shared,
        ),
        _options(
            config, head_dim, value_dim, *flags, HAS_GRAD_LSE=grad_lse is not None, VARLEN=varlen
        ),
    )  # fmt: skip
    key_grads = (grad_k, grad_v, *grad_k.stride(), *grad_v.stride())
    config = launch_config("dkdv", lq, lk, max(head_dim, value_dim))
    _DKDV(
        q.device,
        (batch * heads, cdiv(lk, config.block_n), 1),
        (q, k, v, grad_out, lse, delta, *key_grads, *shared),
        _options(config, head_dim, value_dim, *flags, VARLEN=varlen),
    )


def dropout_keep_mask(seed: torch.Tensor, shape: tuple[int, int, int, int], dropout_p: float):
    """Bool (B, H, Lq, Lk) keep_ij that the Triton kernels apply for ``seed`` (the
    ``dropout_seed`` given to ``attention``, or the one it draws), written out by a kernel that
    shares their ``_dropout_keep``.

    Without a ``dropout_seed``, the Triton backend draws its seed with
    ``triton_common.dropout_seed(q.device)`` as its first random draw, so ``torch.manual_seed(s)``
    before both gives the mask of an ``attention`` call (tests use this to check outputs and
    gradients against the reference given the kernel's own mask).
    """
    batch, heads, lq, lk = shape
    keep = new_output(shape, torch.uint8, seed.device)
    config = _KEEP_CONFIG
    grid = (batch * heads, cdiv(lq, config.block_m), cdiv(lk, config.block_n))
    _KEEP(
        seed.device,
        grid,
        (keep, seed, lq, lk, dropout_p),
        launch_options(
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps,
            num_stages=config.num_stages,
        ),
    )  # fmt: skip
    return keep.bool()
