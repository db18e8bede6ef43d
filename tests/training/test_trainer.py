"""The training loop: the loss, the schedule, a step without host syncs, Ctrl-C, the progress bar
and TensorBoard."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fastnmt import train
from fastnmt.model import ModelConfig, Transformer
from fastnmt.training import trainer
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


def test_inverse_sqrt_schedule_of_a_device_step_count():
    steps = torch.tensor([0.0, 1, 50, 100, 400], dtype=torch.float64)
    expected = [1e-5, 1e-5, 5e-4, 1e-3, 5e-4]  # step 0 is step 1's
    assert trainer.inverse_sqrt_lr(steps, 1e-3, 100).tolist() == pytest.approx(expected)
    assert trainer.inverse_sqrt_lr(steps, 1e-3, 0).tolist() == pytest.approx([1e-3] * 5)


@pytest.mark.parametrize("extra", [[], ["--shape-buckets", "3"]], ids=["eager", "bucketed"])
def test_a_training_step_makes_no_host_sync(corpus, tmp_path, extra):
    """Statistics stay on the device until a log line reads them, one sync per window."""
    run = train.prepare(train.build_parser().parse_args(_arguments(corpus, tmp_path, *extra)))
    batches = list(run.batches.iterate(epoch=1))
    run.train_step(batches[:1])  # the first step also builds the optimizer state
    with count_host_syncs(none_allowed=True) as syncs:
        run.train_step(batches[1:3])  # two micro-batches
    assert syncs.names == []
    with count_host_syncs() as syncs:
        run.report()
    assert syncs.names == ["tolist"]


# --- Ctrl-C ---------------------------------------------------------------------------------------

STEPS = ("--max-steps", "4", "--average-last", "1")


def _prepare(corpus, output, *extra):
    return train.prepare(train.build_parser().parse_args(_arguments(corpus, output, *extra)))


def _weights(output):
    return load_file(str(output / "checkpoint_last" / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    """The final weights of the run the interrupted ones must reproduce (dropout on)."""
    output = tmp_path_factory.mktemp("uninterrupted")
    assert _prepare(corpus, output, *STEPS).run() == 0
    return _weights(output)


def _interrupt_after(owner, name: str, at_step: int, run) -> None:
    """Send this process Ctrl-C (SIGINT) right after ``owner.name`` returns in step ``at_step``."""
    original = getattr(owner, name)

    def interrupted(*args, **kwargs):
        result = original(*args, **kwargs)
        if run.progress.step == at_step:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    setattr(owner, name, interrupted)


@pytest.fixture
def ctrl_c_raises():
    """Python's own SIGINT handler, as in a terminal: a process started in the background (``&``)
    inherits SIGINT ignored, and Ctrl-C then never reaches Python at all."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize(
    ("where", "saved_step"),
    [
        ("batch_loss", 2),  # after the forward pass (dropout drew from the RNG), before backward
        ("scaler.update", 3),  # in the middle of the optimizer update: deferred to its end
    ],
)
def test_ctrl_c_in_an_update_neither_replays_nor_drops_a_batch(
    corpus, tmp_path, uninterrupted, where, saved_step, ctrl_c_raises
):
    run = _prepare(corpus, tmp_path, *STEPS)
    owner = run.scaler if where.startswith("scaler") else run
    _interrupt_after(owner, where.rpartition(".")[2], 2, run)
    assert run.run() == 130
    state = torch.load(tmp_path / "checkpoint_last" / "trainer_state.pt", weights_only=True)
    assert state["progress"]["step"] == state["progress"]["batch_in_epoch"] == saved_step
    assert _prepare(corpus, tmp_path, *STEPS).run() == 0
    resumed = _weights(tmp_path)
    for name, expected in uninterrupted.items():
        assert torch.equal(resumed[name], expected), name


def test_interrupts_deferred_delivers_ctrl_c_after_the_block(ctrl_c_raises):
    done = []
    with pytest.raises(KeyboardInterrupt), trainer.interrupts_deferred():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # a signal arriving mid-block is held...
        done.append(True)
    assert done == [True]  # ...until the block has run
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# --- progress bar and TensorBoard ---------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_tqdm_bar_and_tensorboard_the_logged_scalars(
    corpus, tmp_path, monkeypatch
):
    monkeypatch.setattr(sys, "stderr", Terminal())
    board = tmp_path / "board"
    arguments = [*_arguments(corpus, tmp_path, *STEPS, "--tensorboard", str(board))]
    arguments.remove("--no-progress")
    assert train.prepare(train.build_parser().parse_args(arguments)).run() == 0
    shown = sys.stderr.getvalue()
    assert re.search(
        r"epoch 1: +\d+%\|.*\| *[1-4]/\d+ \[[0-9:]+<[0-9:?]+, .*(batch/s|s/batch)", shown
    )
    assert "\repoch 1 step 4 | loss" in shown  # a log line clears the bar, then shows again
    assert "\rvalidation after 4 steps" in shown
    events = EventAccumulator(str(board))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [event.step for event in loss] == [2, 4]  # --log-interval 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in records[:2]])
    assert [e.step for e in events.Scalars("valid/bleu")] == [4]


def test_without_a_terminal_the_log_is_plain_lines(tmp_path):
    stream = io.StringIO()
    log = trainer.Log(tmp_path, enabled=True, progress=True, stream=stream)
    log.bar(1, 3, 10, "step 3")
    log.line("epoch 1 step 3 | loss 5.0")
    log.close()
    assert stream.getvalue() == "epoch 1 step 3 | loss 5.0\n"


def test_fastnmt_imports_without_tensorboard():
    code = (
        "import sys; sys.modules['tensorboard'] = None; "
        "import fastnmt, fastnmt.train, fastnmt.training.trainer, fastnmt.preprocess; "
        "assert 'torch.utils.tensorboard' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
