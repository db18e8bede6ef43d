"""``fastnmt.ops.add_layer_norm`` (dropout, residual add, LayerNorm in one op) against the same
three steps written with PyTorch's functions."""

import torch
import torch.nn.functional as F

from fastnmt.ops import add_layer_norm


def test_add_layer_norm(bench):
    case = bench.case
    width, tokens = case.d_model, case.batch * case.max_len
    x, residual = bench.randn(tokens, width), bench.randn(tokens, width)
    weight = bench.tensor(1.0 + 0.1 * torch.randn(width))
    bias = bench.tensor(0.1 * torch.randn(width))
    if bench.impl == "torch":

        def forward():
            return F.layer_norm(residual + F.dropout(x, bench.dropout), (width,), weight, bias)

        label = "F.layer_norm(residual + F.dropout(x))"
    else:
        args = (x, residual, weight, bias)
        bench.skip_unless_supported("add_layer_norm", *args, dropout_p=bench.dropout)

        def forward():
            return add_layer_norm(*args, dropout_p=bench.dropout)[0]  # y; h is the residual

        label = "fastnmt.ops.add_layer_norm"
    # Reads x and the residual, writes y and h: the minimum a fused kernel moves.
    bench.run("add_layer_norm", label, forward, forward_bytes=4 * x.numel() * x.element_size())
