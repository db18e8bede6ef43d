"""fastnmt.checkpoint: a crash at any filesystem operation of a save loses nothing, and a damaged
checkpoint_last is a one-line error naming the newest checkpoint that loads."""

import os
import random
import shutil
import types
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file

from fastnmt import checkpoint, train
from fastnmt.checkpoint import AVERAGE, BEST, LAST, Checkpoint, CheckpointError
from fastnmt.data import files
from tests.test_train import _arguments


class Crash(Exception):
    """A crash of the process at a chosen filesystem operation."""


class FaultyFilesystem:
    """Counts the filesystem operations ``fastnmt.checkpoint`` makes (through its ``os`` and
    ``shutil``, and those of ``fastnmt.data.files``, whose fsync and rename it uses) and raises
    Crash instead of making operation number ``crash_at``. What is on disk then is what a process
    killed at that moment leaves (files written before an fsync included, as they are in the page
    cache)."""

    OPERATIONS: ClassVar = {
        os: ("rename", "replace", "fsync", "symlink", "mkdir", "unlink"),
        shutil: ("rmtree",),
    }

    def __init__(self, crash_at: int | None = None):
        self.crash_at = crash_at
        self.count = 0

    def install(self, monkeypatch) -> None:
        for module, names in self.OPERATIONS.items():
            proxy = types.SimpleNamespace(**vars(module))
            for name in names:
                setattr(proxy, name, self._counted(getattr(module, name)))
            for user in (checkpoint, files):
                monkeypatch.setattr(user, module.__name__, proxy)

    def _counted(self, operation):
        def counted(*args, **kwargs):
            self.count += 1
            if self.count == self.crash_at:
                raise Crash(f"crash at operation {self.count} ({operation.__name__})")
            return operation(*args, **kwargs)

        return counted


def tiny(step: int, version: int = 0) -> Checkpoint:
    """A checkpoint whose contents tell its step and version."""
    value = float(step * 10 + version)
    state = {"progress": {"step": step}, "version": version}
    return Checkpoint({"w": torch.full((3,), value)}, {"step": step}, b"spm", state)


def value(path) -> float:
    return load_file(str(path / checkpoint.WEIGHTS))["w"][0].item()


def new_step(directory):
    """steps 1, 2 saved, best = 2; then step 3 (which prunes step 1)."""
    for step in (1, 2):
        checkpoint.save(directory, step, tiny(step), keep_last=2)
    checkpoint.point(directory, BEST, directory / "checkpoint_step2")
    return lambda: checkpoint.save(directory, 3, tiny(3), keep_last=2)


def same_step_again(directory):
    """steps 1, 2 saved, last = best = 2; then step 2 saved again (another version)."""
    for step in (1, 2):
        checkpoint.save(directory, step, tiny(step), keep_last=2)
    checkpoint.point(directory, BEST, directory / "checkpoint_step2")
    return lambda: checkpoint.save(directory, 2, tiny(2, version=1), keep_last=2)


def average_again(directory):
    """An average that best points to, replaced by another one."""
    checkpoint.save(directory, 1, tiny(1), keep_last=2)
    average = checkpoint.write(directory, AVERAGE, tiny(1, version=5))
    checkpoint.point(directory, BEST, average)

    def replace_average():
        checkpoint.point(directory, BEST, checkpoint.write(directory, AVERAGE, tiny(1, 6)))

    return replace_average


@pytest.mark.parametrize("scenario", [new_step, same_step_again, average_again])
def test_a_crash_at_any_operation_of_a_save_leaves_a_complete_checkpoint(
    scenario, tmp_path, monkeypatch
):
    before = None
    crash_at = 1
    while True:
        directory = tmp_path / f"crash{crash_at}"
        operation = scenario(directory)
        if before is None:
            before = {name: value(directory / name) for name in (LAST, BEST)}
        faulty = FaultyFilesystem(crash_at)
        with monkeypatch.context() as patch:
            faulty.install(patch)
            try:
                operation()
                crashed = False
            except Crash:
                crashed = True
        checkpoint.recover(directory)
        loaded = checkpoint.load_last(directory)  # never raises: nothing dangles
        assert loaded is not None
        after = {LAST: loaded.weights["w"][0].item(), BEST: value(directory / BEST)}
        for name, now in after.items():
            assert now == before[name] or now > before[name], (crash_at, name)
        for step in checkpoint.step_checkpoints(directory):
            checkpoint.load(step, with_trainer_state=True)
        assert not [p.name for p in directory.iterdir() if p.name.startswith(".")], crash_at
        if not crashed:  # every operation of the save has been crashed at once
            assert crash_at > 5
            assert after[LAST] > before[LAST] or after[BEST] > before[BEST]
            break
        crash_at += 1


def test_a_dangling_checkpoint_last_names_the_newest_checkpoint_that_loads(tmp_path):
    for step in (2, 4, 6):
        checkpoint.save(tmp_path, step, tiny(step), keep_last=3)
    (tmp_path / "checkpoint_step4" / checkpoint.STATE).write_bytes(b"truncated")
    shutil.rmtree(tmp_path / "checkpoint_step6")
    with pytest.raises(CheckpointError) as excinfo:
        checkpoint.load_last(tmp_path)
    message = str(excinfo.value)
    assert "\n" not in message
    assert message.startswith(f"{tmp_path / LAST} points to checkpoint_step6, which does not")
    assert f"the newest checkpoint that loads is {tmp_path / 'checkpoint_step2'}" in message


def test_an_unreadable_checkpoint_last_is_an_error_too(tmp_path):
    checkpoint.save(tmp_path, 3, tiny(3), keep_last=3)
    (tmp_path / "checkpoint_step3" / checkpoint.WEIGHTS).write_bytes(b"\0" * 5)
    with pytest.raises(CheckpointError) as excinfo:
        checkpoint.load_last(tmp_path)
    assert f"{tmp_path / LAST} cannot be loaded" in str(excinfo.value)
    assert "no other checkpoint there loads either" in str(excinfo.value)


def test_a_first_save_interrupted_before_its_link_is_adopted(tmp_path):
    checkpoint.write(tmp_path, "checkpoint_step5", tiny(5))  # crashed before point(LAST)
    assert checkpoint.load_last(tmp_path) is None
    checkpoint.recover(tmp_path)
    assert checkpoint.load_last(tmp_path).trainer_state["progress"]["step"] == 5


# --- the same faults in a training run ----------------------------------------------------------

STEPS = ("--max-steps", "4", "--save-interval", "1", "--average-last", "1")


def _train(corpus, output) -> int:
    return train.prepare(train.build_parser().parse_args(_arguments(corpus, output, *STEPS))).run()


def _final_weights(output) -> dict[str, torch.Tensor]:
    return load_file(str(output / LAST / checkpoint.WEIGHTS))


def test_training_crashed_during_a_save_resumes_to_the_uninterrupted_result(
    corpus, tmp_path, monkeypatch
):
    assert _train(corpus, tmp_path / "straight") == 0
    expected = _final_weights(tmp_path / "straight")
    counting = FaultyFilesystem()
    with monkeypatch.context() as patch:
        counting.install(patch)
        assert _train(corpus, tmp_path / "counted") == 0
    crash_at = random.randint(1, counting.count)  # fresh each run: over time, every point
    output = tmp_path / "crashed"
    with monkeypatch.context() as patch:
        FaultyFilesystem(crash_at).install(patch)
        with pytest.raises(Crash):
            _train(corpus, output)
    assert _train(corpus, output) == 0
    actual = _final_weights(output)
    for name in expected:
        assert torch.equal(actual[name], expected[name]), (crash_at, name)
