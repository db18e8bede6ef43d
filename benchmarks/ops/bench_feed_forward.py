"""``fastnmt.ops.feed_forward`` (Linear, ReLU, dropout, Linear) against the same nn modules.

The Triton backend runs twice: on its default path (library GEMMs around one fused elementwise
kernel) and on the fused-GEMM path (``FASTNMT_FFN_FUSED_GEMM=1``: Triton GEMMs with the bias,
activation and dropout in their epilogues). Which is faster on a GPU decides the default of
``fastnmt.ops.feed_forward``: compare the rows "fused GEMM" and "library GEMM"."""

import pytest
from torch import nn

from fastnmt.ops import feed_forward, settings


@pytest.mark.parametrize("gemm", ["library", "fused"])
def test_feed_forward(bench, monkeypatch, gemm):
    if gemm == "fused" and bench.impl != "triton":
        pytest.skip("only the Triton backend has a fused-GEMM path")
    monkeypatch.setattr(settings, "ffn_fused_gemm", gemm == "fused")  # FASTNMT_FFN_FUSED_GEMM
    case = bench.case
    width, hidden = case.d_model, 4 * case.d_model
    x = bench.randn(case.batch * case.max_len, width)
    ffn = bench.module(
        nn.Sequential(
            nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(bench.dropout), nn.Linear(hidden, width)
        )
    )
    if bench.impl == "torch":

        def forward():
            return ffn(x)

        label = "nn.Linear, nn.ReLU, nn.Dropout, nn.Linear"
    else:
        first, last = ffn[0], ffn[3]
        args = (x, first.weight, first.bias, last.weight, last.bias, "relu", bench.dropout)
        bench.skip_unless_supported("feed_forward", *args)

        def forward():
            return feed_forward(*args)

        label = "fastnmt.ops.feed_forward" + (f" ({gemm} GEMM)" if bench.impl == "triton" else "")
    flops = 2 * 2 * x.shape[0] * width * hidden  # two GEMMs of M x K x F
    bench.run("feed_forward", label, forward, forward_flops=flops)
