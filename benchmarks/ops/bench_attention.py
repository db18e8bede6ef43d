"""``fastnmt.ops.attention`` on padded self-attention, and ``attention_varlen`` on the same
sequences packed without padding, against PyTorch's SDPA on the padded batch."""

import torch
import torch.nn.functional as F

from fastnmt.ops import attention, attention_varlen


def _sdpa(case, q, k, v):
    """SDPA takes padding as a bool mask, True = may attend, broadcast over heads and queries."""
    allowed = ~case.key_padding_mask()[:, None, None, :]  # (B, 1, 1, L)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def _flops(case) -> int:
    return 4 * case.batch * case.heads * case.max_len**2 * case.head_dim  # QK^T and PV


def test_attention(bench):
    case = bench.case
    q, k, v = (bench.randn(case.batch, case.heads, case.max_len, case.head_dim) for _ in range(3))
    if bench.impl == "torch":
        forward, label = _sdpa(case, q, k, v), "F.scaled_dot_product_attention(attn_mask=)"
    else:
        key_lengths = case.key_lengths()
        bench.skip_unless_supported("attention", q, k, v, key_lengths=key_lengths)

        def forward():
            return attention(q, k, v, key_lengths=key_lengths)

        label = "fastnmt.ops.attention(key_lengths=)"
    bench.run("attention", label, forward, forward_flops=_flops(case))


def test_attention_varlen(bench):
    """The padded batch's FLOPs are the reference, so a packed call's TFLOP/s is the padded
    work it stands in for."""
    case = bench.case
    if bench.impl == "torch":
        q, k, v = (bench.randn(case.batch, case.heads, case.max_len, case.head_dim) for _ in "qkv")
        forward, label = _sdpa(case, q, k, v), "F.scaled_dot_product_attention(attn_mask=)"
    else:
        q, k, v = (bench.randn(case.tokens, case.heads, case.head_dim) for _ in "qkv")
        cu_seqlens = torch.tensor([0, *case.lengths], device=q.device).cumsum(0)
        packed = (cu_seqlens, cu_seqlens, case.max_len, case.max_len)
        bench.skip_unless_supported("attention_varlen", q, k, v, *packed)

        def forward():
            return attention_varlen(q, k, v, *packed)

        label = "fastnmt.ops.attention_varlen"
    bench.run("attention_varlen", label, forward, forward_flops=_flops(case))
