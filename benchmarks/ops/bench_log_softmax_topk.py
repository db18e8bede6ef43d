"""``fastnmt.ops.log_softmax_topk`` (the k best log-probabilities of each row, some tokens banned)
against ``log_softmax`` over the whole row followed by ``topk``, at the sizes of a beam search
step: beam 4 over 64 or 256 sentences (256 or 1,024 rows), an 8,000-word vocabulary, the best 2K
= 8 of each row (and the best 1 of greedy search). Forward only: a decoding op has no backward."""

from dataclasses import dataclass

import pytest
import torch

from fastnmt.ops import log_softmax_topk

BANNED = (0, 1)  # pad and bos


@dataclass(frozen=True)
class StepCase:
    rows: int  # hypotheses of the step
    vocab: int
    k: int

    @property
    def id(self) -> str:
        return f"N{self.rows}-V{self.vocab}-k{self.k}"

    def info(self) -> dict:
        return {"rows": self.rows, "vocab": self.vocab, "k": self.k}

    @property
    def tokens(self) -> int:  # the rows a step decides on, what tokens/s counts here
        return self.rows


CASES = (StepCase(256, 8000, 8), StepCase(1024, 8000, 8), StepCase(1024, 8000, 1))


@pytest.fixture(params=CASES, ids=lambda case: case.id)
def case(request):  # overrides the attention-shaped cases of conftest.py
    return request.param


def test_log_softmax_topk(bench):
    if bench.backward:
        pytest.skip("log_softmax_topk has no backward (a decoding step)")
    case = bench.case
    logits = bench.randn(case.rows, case.vocab) * 4
    banned = torch.tensor(BANNED, device=logits.device)
    if bench.impl == "torch":

        def forward():
            scores = logits.float().index_fill(1, banned, float("-inf"))
            return scores.log_softmax(-1).topk(case.k, dim=-1).values

        label = "log_softmax(logits.float()).topk(k)"
    else:
        bench.skip_unless_supported("log_softmax_topk", logits, case.k, banned)

        def forward():
            return log_softmax_topk(logits, case.k, banned)[0]

        label = "fastnmt.ops.log_softmax_topk"
    # Reads the logits once: the least any implementation moves.
    bench.run(
        "log_softmax_topk", label, forward, forward_bytes=logits.numel() * logits.element_size()
    )
