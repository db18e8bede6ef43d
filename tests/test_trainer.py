"""The training loop: the loss, the schedule, and a step without host syncs."""

import pytest
import torch
import torch.nn.functional as F

from fastnmt import train, trainer
from fastnmt.model import ModelConfig, Transformer
from tests.helpers import count_host_syncs
from tests.test_train import _arguments


def test_label_smoothed_loss_matches_cross_entropy():
    model = Transformer(ModelConfig(vocab_size=30, d_model=8, heads=2, d_ff=16))
    states = torch.randn(2, 5, 8)
    targets = torch.randint(1, 30, (2, 5))
    targets[1, 3:] = 0
    positions = (targets.view(-1) != 0).nonzero()[:, 0]
    loss, nll, correct = trainer.label_smoothed_loss(model, states, targets, positions, 0.1)
    logits = model.logits(states).view(-1, 30)
    expected = F.cross_entropy(
        logits, targets.view(-1), ignore_index=0, label_smoothing=0.1, reduction="sum"
    )
    torch.testing.assert_close(loss, expected)
    kept = targets.view(-1) != 0
    torch.testing.assert_close(
        nll.float(), F.cross_entropy(logits[kept], targets.view(-1)[kept], reduction="sum")
    )
    assert correct == (logits[kept].argmax(-1) == targets.view(-1)[kept]).sum()


def test_inverse_sqrt_schedule():
    assert trainer.inverse_sqrt_lr(1, 1e-3, 100) == pytest.approx(1e-5)
    assert trainer.inverse_sqrt_lr(100, 1e-3, 100) == pytest.approx(1e-3)
    assert trainer.inverse_sqrt_lr(400, 1e-3, 100) == pytest.approx(5e-4)


def test_a_training_step_makes_no_host_sync(corpus, tmp_path):
    """Statistics stay on the device until a log line reads them, one sync per window."""
    run = train.prepare(train.build_parser().parse_args(_arguments(corpus, tmp_path)))
    batches = list(run.batches.iterate(epoch=1))
    run.train_step(batches[:1])  # the first step also builds the optimizer state
    with count_host_syncs(none_allowed=True) as syncs:
        run.train_step(batches[1:3])  # two micro-batches
    assert syncs.names == []
    with count_host_syncs() as syncs:
        run.report(lr=1e-3)
    assert syncs.names == ["tolist"]
