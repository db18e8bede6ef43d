"""``fastnmt.ops.sample_token`` (one token drawn from each row, some tokens banned) against the
PyTorch reference (log_softmax over the whole row, a sort, cumsum), at the sizes of a sampling
step: 256 or 1,024 rows of an 8,000-word vocabulary, top-10, top-p 0.9 and unrestricted, over
rows as flat as a trained model's widest (logits of standard deviation 1.5: nuclei of thousands
of tokens). Forward only: a decoding op has no backward."""

from dataclasses import dataclass

import pytest
import torch

from fastnmt.ops import sample_token
from fastnmt.ops.sample_token import sample_token_reference

BANNED = (0, 1)  # pad and bos


@dataclass(frozen=True)
class StepCase:
    rows: int  # rows of the step
    vocab: int
    topk: int | None
    topp: float | None

    @property
    def id(self) -> str:
        return f"N{self.rows}-V{self.vocab}-topk{self.topk}-topp{self.topp}"

    def info(self) -> dict:
        return {"rows": self.rows, "vocab": self.vocab, "topk": self.topk, "topp": self.topp}

    @property
    def tokens(self) -> int:  # the rows a step draws for, what tokens/s counts here
        return self.rows


CASES = tuple(
    StepCase(rows, 8000, topk, topp)
    for rows in (256, 1024)
    for topk, topp in ((10, None), (None, 0.9), (None, None))
)


@pytest.fixture(params=CASES, ids=lambda case: case.id)
def case(request):  # overrides the attention-shaped cases of conftest.py
    return request.param


def test_sample_token(bench):
    if bench.backward:
        pytest.skip("sample_token has no backward (a decoding step)")
    case = bench.case
    logits = bench.randn(case.rows, case.vocab) * 1.5
    uniforms = torch.rand(case.rows, device=logits.device)
    banned = torch.tensor(BANNED, device=logits.device)
    restriction = dict(topk=case.topk, topp=case.topp)
    if bench.impl == "torch":

        def forward():
            return sample_token_reference(logits, uniforms, banned, 1.0, **restriction)[1]

        label = "log_softmax, sort, cumsum (the reference)"
    else:
        bench.skip_unless_supported("sample_token", logits, uniforms, banned, 1.0, **restriction)

        def forward():
            return sample_token(logits, uniforms, banned, **restriction)[1]

        label = "fastnmt.ops.sample_token"
    # Reads the logits once: the least any implementation moves.
    bench.run("sample_token", label, forward, forward_bytes=logits.numel() * logits.element_size())
