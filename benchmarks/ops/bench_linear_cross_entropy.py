"""``fastnmt.ops.linear_cross_entropy`` (output projection + label-smoothed cross entropy, chunked)
against ``F.cross_entropy(F.linear(...))``, at the sizes of a translation batch's loss."""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from fastnmt.ops import linear_cross_entropy

SMOOTHING = 0.1


@dataclass(frozen=True)
class LossCase:
    tokens: int  # target tokens of a batch (rows of the logits)
    vocab: int
    d_model: int

    @property
    def id(self) -> str:
        return f"N{self.tokens}-V{self.vocab}-d{self.d_model}"

    def info(self) -> dict:
        return {"tokens": self.tokens, "vocab": self.vocab, "d_model": self.d_model}


CASES = (
    LossCase(4096, 8000, 256),  # the tiny preset's batch (the reference point)
    LossCase(4096, 32000, 512),
    LossCase(16384, 8000, 512),
)


@pytest.fixture(params=CASES, ids=lambda case: case.id)
def case(request):  # overrides the attention-shaped cases of conftest.py
    return request.param


def test_linear_cross_entropy(bench):
    case = bench.case
    hidden = bench.randn(case.tokens, case.d_model)
    weight = bench.tensor(torch.randn(case.vocab, case.d_model) * case.d_model**-0.5)
    target = torch.randint(0, case.vocab, (case.tokens,), device=hidden.device)
    if bench.impl == "torch":

        def forward():
            logits = F.linear(hidden, weight)
            return F.cross_entropy(logits.float(), target, label_smoothing=SMOOTHING)

        label = "F.cross_entropy(F.linear(hidden, weight))"
    else:
        bench.skip_unless_supported("linear_cross_entropy", hidden, weight, None, target)

        def forward():
            return linear_cross_entropy(hidden, weight, None, target, SMOOTHING).loss

        label = "fastnmt.ops.linear_cross_entropy"
    flops = 2 * case.tokens * case.vocab * case.d_model  # the logits GEMM; backward: two more
    bench.run("linear_cross_entropy", label, forward, forward_flops=flops)
