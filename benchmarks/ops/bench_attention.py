"""``fastnmt.ops.attention`` on padded self-attention, against PyTorch's SDPA."""

import torch.nn.functional as F

from fastnmt.ops import attention


def test_attention(bench):
    case = bench.case
    q, k, v = (bench.randn(case.batch, case.heads, case.max_len, case.head_dim) for _ in range(3))
    if bench.impl == "torch":
        # SDPA takes padding as a bool mask, True = may attend, broadcast over heads and queries.
        allowed = ~case.key_padding_mask()[:, None, None, :]  # (B, 1, 1, L)

        def forward():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

        label = "F.scaled_dot_product_attention(attn_mask=)"
    else:
        key_lengths = case.key_lengths()
        bench.skip_unless_supported("attention", q, k, v, key_lengths=key_lengths)

        def forward():
            return attention(q, k, v, key_lengths=key_lengths)

        label = "fastnmt.ops.attention(key_lengths=)"
    flops = 4 * case.batch * case.heads * case.max_len**2 * case.head_dim  # QK^T and PV
    bench.run("attention", label, forward, forward_flops=flops)
