"""``fastnmt.attention.MultiheadAttention`` against ``torch.nn.MultiheadAttention`` with the same
weights, on padded self-attention (batch_first, key_padding_mask, need_weights=False)."""

import torch
from torch import nn

from fastnmt.attention import MultiheadAttention


def test_multihead_attention(bench):
    case = bench.case
    torch_module = nn.MultiheadAttention(case.d_model, case.heads, batch_first=True)
    if bench.impl == "torch":
        module, label = torch_module, "torch.nn.MultiheadAttention"
    else:
        module = MultiheadAttention(case.d_model, case.heads, batch_first=True)
        module.load_state_dict(torch_module.state_dict())
        label = "fastnmt.attention.MultiheadAttention"
    # fwd is inference (eval, as a translator runs it): torch may take its fused fast path there.
    module = bench.module(module).train(bench.backward)
    x = bench.randn(case.batch, case.max_len, case.d_model)
    padding = case.key_padding_mask()
    if bench.impl != "torch":
        heads = torch.empty(case.batch, case.heads, case.max_len, case.head_dim).to(x)
        bench.skip_unless_supported("attention", heads, heads, heads, key_padding_mask=padding)

    def forward():
        return module(x, x, x, key_padding_mask=padding, need_weights=False)[0]

    bench.run("multihead_attention", label, forward)
