"""``fastnmt.ops.feed_forward`` (Linear, ReLU, dropout, Linear) against the same nn modules."""

from torch import nn

from fastnmt.ops import feed_forward


def test_feed_forward(bench):
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

        label = "fastnmt.ops.feed_forward"
    flops = 2 * 2 * x.shape[0] * width * hidden  # two GEMMs of M x K x F
    bench.run("feed_forward", label, forward, forward_flops=flops)
