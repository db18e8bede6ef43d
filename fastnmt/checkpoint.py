"""Checkpoints: one directory per save, written atomically and durably, loadable without executing
code.

A checkpoint directory holds
    model.safetensors    the weights
    config.json          model config, data and training arguments
    spm.model            the sentencepiece model (a model fine-tuned from an Opus-MT checkpoint:
                         marian_vocabulary.zip, its tokenizer files; ``fastnmt.data``)
    trainer_state.pt     optimizer, step, epoch, position in the epoch, RNG states (tensors and
                         plain containers only: loads with ``torch.load(weights_only=True)``)

The output directory keeps ``checkpoint_step{N}`` directories and the links ``checkpoint_last``
and ``checkpoint_best`` (replaced atomically with ``os.replace``); ``checkpoint_average`` (weights
averaged over the last step checkpoints, no trainer state) is written like a step.

How a crash at any moment loses nothing (``tests/test_checkpoint.py`` crashes every save at each
of its filesystem operations):
- a directory is written as ``.NAME.new``, every file and the directory fsynced, then renamed to
  NAME and the output directory fsynced: NAME is always complete;
- a NAME that exists already (the same step saved again; the average recomputed) is first renamed
  to ``.NAME.old``, and deleted only after the new one is in place. A link to NAME dangles only
  between those two renames, and ``recover`` (run before a training run reads its checkpoints)
  completes an interrupted replacement: ``.NAME.new`` was durable before ``.NAME.old`` existed;
- old step checkpoints are pruned by renaming them to ``.NAME.deleted`` first, so a half-deleted
  directory never carries a checkpoint's name;
- a first save interrupted after its directory got its name but before ``checkpoint_last``
  existed is adopted by ``recover``.
A link that dangles or a checkpoint that cannot be read for any other reason (a disk error, a
hand-deleted directory) is a one-line error naming it and the newest checkpoint that loads.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fastnmt.data import VOCABULARY_FILES, vocabulary_file
from fastnmt.data.files import fsync, rename_durably

LAST, BEST, AVERAGE = "checkpoint_last", "checkpoint_best", "checkpoint_average"
WEIGHTS, CONFIG, STATE = "model.safetensors", "config.json", "trainer_state.pt"
STEP_PREFIX = "checkpoint_step"
# Suffixes of the hidden names a save works under (see the module docstring).
NEW, OLD, DELETED, LINK_TEMPORARY = ".new", ".old", ".deleted", ".tmp"


class CheckpointError(ValueError):
    """A missing, corrupt or incompatible checkpoint; the message is one line."""


@dataclass
class Checkpoint:
    weights: dict[str, torch.Tensor]
    config: dict
    vocabulary: bytes  # ``fastnmt.data.vocabulary_from_bytes`` reads it
    trainer_state: dict | None  # None when loaded for inference only


def save(output_dir: Path, step: int, checkpoint: Checkpoint, keep_last: int) -> Path:
    """Write ``checkpoint_step{step}``, point ``checkpoint_last`` at it, prune old steps."""
    final = write(output_dir, f"{STEP_PREFIX}{step}", checkpoint)
    point(output_dir, LAST, final)
    _prune(output_dir, keep_last)
    return final


def write(output_dir: Path, name: str, checkpoint: Checkpoint) -> Path:
    """Write the directory ``output_dir/name`` atomically and durably, replacing one of that
    name only once the new one is complete on disk."""
    output_dir.mkdir(parents=True, exist_ok=True)
    _recover_name(output_dir, name)
    final, new, old = _names(output_dir, name)
    new.mkdir()
    new.chmod(0o755)
    _write_file(new / WEIGHTS, lambda path: save_file(checkpoint.weights, str(path)))
    _write_file(new / CONFIG, lambda path: path.write_text(_json(checkpoint.config)))
    vocabulary = new / vocabulary_file(checkpoint.vocabulary)
    _write_file(vocabulary, lambda path: path.write_bytes(checkpoint.vocabulary))
    _write_file(new / STATE, lambda path: torch.save(checkpoint.trainer_state, path))
    fsync(new)
    if final.exists():  # the same name saved again: keep the old one until the new one is in
        rename_durably(final, old)
    rename_durably(new, final)
    _remove(old)
    return final


def _names(output_dir: Path, name: str) -> tuple[Path, Path, Path]:
    """The directory NAME and the hidden names its replacement works under: .NAME.new, .NAME.old."""
    return output_dir / name, output_dir / f".{name}{NEW}", output_dir / f".{name}{OLD}"


def _json(config: dict) -> str:
    return json.dumps(config, indent=2, sort_keys=True)


def _write_file(path: Path, writer: Callable[[Path], object]) -> None:
    writer(path)
    fsync(path)


def _remove(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)


def point(output_dir: Path, link_name: str, target: Path) -> None:
    """Atomically make ``output_dir/link_name`` a relative link to ``target``."""
    temporary = output_dir / f".{link_name}{LINK_TEMPORARY}"
    if temporary.is_symlink() or temporary.exists():
        temporary.unlink()
    temporary.symlink_to(target.name)
    os.replace(temporary, output_dir / link_name)
    fsync(output_dir)


def _prune(output_dir: Path, keep_last: int) -> None:
    """Delete step checkpoints beyond the newest ``keep_last``, never one a link points to."""
    linked = {
        (output_dir / name).resolve() for name in (LAST, BEST) if (output_dir / name).exists()
    }
    steps = step_checkpoints(output_dir)
    for old in steps[: max(0, len(steps) - keep_last)]:
        if old.resolve() not in linked:
            deleted = output_dir / f".{old.name}{DELETED}"
            rename_durably(old, deleted)
            shutil.rmtree(deleted)


def recover(output_dir: Path) -> None:
    """Complete or undo what an interrupted save left in ``output_dir`` (see the module
    docstring); afterwards no link dangles because of a crash."""
    if not output_dir.is_dir():
        return
    for hidden in list(output_dir.glob(".*")):
        if hidden.name.endswith(LINK_TEMPORARY) and hidden.is_symlink():
            hidden.unlink()  # a link never renamed into place
        for suffix in (NEW, OLD, DELETED):
            if hidden.name.endswith(suffix) and hidden.is_dir():
                _recover_name(output_dir, hidden.name[1 : -len(suffix)])
    steps = step_checkpoints(output_dir)
    if steps and not os.path.lexists(output_dir / LAST):
        point(output_dir, LAST, steps[-1])


def _recover_name(output_dir: Path, name: str) -> None:
    final, new, old = _names(output_dir, name)
    if old.exists() and not final.exists():
        # Interrupted between renaming the old one aside and the new one in: the new one was
        # complete and fsynced before the old one was moved.
        rename_durably(new if new.exists() else old, final)
    _remove(old)
    _remove(new)  # a write that never finished
    _remove(output_dir / f".{name}{DELETED}")


def step_checkpoints(output_dir: Path) -> list[Path]:
    """The ``checkpoint_step{N}`` directories, oldest first."""
    steps = [p for p in output_dir.glob(f"{STEP_PREFIX}*") if p.name[len(STEP_PREFIX) :].isdigit()]
    return sorted(steps, key=lambda p: int(p.name[len(STEP_PREFIX) :]))


def average_weights(paths: list[Path]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the weights of several checkpoints (computed in fp64)."""
    loaded = [load(path, with_trainer_state=False).weights for path in paths]
    return {
        name: torch.stack([weights[name].double() for weights in loaded]).mean(0).to(first.dtype)
        for name, first in loaded[0].items()
    }


def resolve(path: Path) -> Path:
    """A checkpoint directory from itself or from an output directory (its ``checkpoint_best``,
    else ``checkpoint_last``)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if (path / WEIGHTS).exists():
        return path
    for name in (BEST, LAST):
        if (path / name / WEIGHTS).exists():
            return (path / name).resolve()
    raise CheckpointError(f"{path} holds no checkpoint (no {WEIGHTS}, {BEST} or {LAST})")


def load(path: Path, *, with_trainer_state: bool) -> Checkpoint:
    """Load a checkpoint directory; corrupt or missing parts raise a one-line CheckpointError."""
    path = Path(path)
    try:
        weights = load_file(str(path / WEIGHTS))
        config = json.loads((path / CONFIG).read_text())
        vocabulary = _vocabulary_path(path).read_bytes()
        state = torch.load(path / STATE, weights_only=True) if with_trainer_state else None
    # Parsers of damaged files raise what they meet (the weights-only unpickler an IndexError on
    # a truncated file): whatever it is, the checkpoint does not load.
    except Exception as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"cannot load checkpoint {path}: {message}") from error
    return Checkpoint(weights, config, vocabulary, state)


def _vocabulary_path(path: Path) -> Path:
    present = [path / name for name in VOCABULARY_FILES if (path / name).exists()]
    return present[0] if present else path / VOCABULARY_FILES[0]  # reading it names the file


def load_last(output_dir: Path) -> Checkpoint | None:
    """The checkpoint ``checkpoint_last`` points to, with its trainer state; None when the output
    directory holds none. Never silently None for a link that dangles or a checkpoint that does
    not load: that is a CheckpointError naming it and the newest checkpoint that loads."""
    last = output_dir / LAST
    if not os.path.lexists(last):
        return None
    if not last.exists():
        problem = f"points to {os.readlink(last)}, which does not exist"
    else:
        try:
            return load(last, with_trainer_state=True)
        except CheckpointError as error:
            problem = f"cannot be loaded ({str(error).removeprefix('cannot load checkpoint ')})"
    newest = newest_loadable(output_dir)
    if newest is None:
        advice = "no other checkpoint there loads either; train into another --output-dir"
    else:
        advice = (
            f"the newest checkpoint that loads is {newest}; to continue from it: "
            f"ln -sfn {newest.name} {last}"
        )
    raise CheckpointError(f"{last} {problem}; {advice}")


def newest_loadable(output_dir: Path) -> Path | None:
    for path in reversed(step_checkpoints(output_dir)):
        try:
            load(path, with_trainer_state=True)
        except CheckpointError:
            continue
        return path
    return None
