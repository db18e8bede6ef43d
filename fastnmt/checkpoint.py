"""Checkpoints: one directory per save, written atomically, loadable without executing code.

A checkpoint directory holds
    model.safetensors    the weights
    config.json          model config, data and training arguments
    spm.model            the sentencepiece model
    trainer_state.pt     optimizer, step, epoch, position in the epoch, RNG states (tensors and
                         plain containers only: loads with ``torch.load(weights_only=True)``)

The output directory keeps immutable ``checkpoint_step{N}`` directories (each written under a
temporary name, then renamed into place) and the links ``checkpoint_last`` and ``checkpoint_best``
(replaced atomically with ``os.replace``), so a crash at any moment leaves the previous checkpoint
intact. ``checkpoint_average`` (weights averaged over the last step checkpoints, no trainer state)
is written the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

LAST, BEST, AVERAGE = "checkpoint_last", "checkpoint_best", "checkpoint_average"
WEIGHTS, CONFIG, SPM, STATE = "model.safetensors", "config.json", "spm.model", "trainer_state.pt"


class CheckpointError(ValueError):
    """A missing, corrupt or incompatible checkpoint; the message is one line."""


@dataclass
class Checkpoint:
    weights: dict[str, torch.Tensor]
    config: dict
    spm_model: bytes
    trainer_state: dict | None  # None when loaded for inference only


def save(output_dir: Path, step: int, checkpoint: Checkpoint, keep_last: int) -> Path:
    """Write ``checkpoint_step{step}``, point ``checkpoint_last`` at it, prune old steps."""
    final = write(output_dir, f"checkpoint_step{step}", checkpoint)
    point(output_dir, LAST, final)
    _prune(output_dir, keep_last)
    return final


def write(output_dir: Path, name: str, checkpoint: Checkpoint) -> Path:
    """Write the directory ``output_dir/name`` atomically (replacing one of that name)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / name
    temporary = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=output_dir))
    temporary.chmod(0o755)  # mkdtemp makes it private; a checkpoint is meant to be shared
    save_file(checkpoint.weights, str(temporary / WEIGHTS))
    (temporary / CONFIG).write_text(json.dumps(checkpoint.config, indent=2, sort_keys=True))
    (temporary / SPM).write_bytes(checkpoint.spm_model)
    torch.save(checkpoint.trainer_state, temporary / STATE)
    _fsync_directory(temporary)
    if final.exists():  # the same step saved again (e.g. after a resume): replace it
        shutil.rmtree(final)
    os.rename(temporary, final)
    return final


def point(output_dir: Path, link_name: str, target: Path) -> None:
    """Atomically make ``output_dir/link_name`` a relative link to ``target``."""
    temporary = output_dir / f".{link_name}.tmp"
    if temporary.is_symlink() or temporary.exists():
        temporary.unlink()
    temporary.symlink_to(target.name)
    os.replace(temporary, output_dir / link_name)
    _fsync_directory(output_dir)


def _prune(output_dir: Path, keep_last: int) -> None:
    """Delete step checkpoints beyond the newest ``keep_last``, never one a link points to."""
    linked = {
        (output_dir / name).resolve() for name in (LAST, BEST) if (output_dir / name).exists()
    }
    steps = step_checkpoints(output_dir)
    for old in steps[: max(0, len(steps) - keep_last)]:
        if old.resolve() not in linked:
            shutil.rmtree(old)


def step_checkpoints(output_dir: Path) -> list[Path]:
    """The ``checkpoint_step{N}`` directories, oldest first."""
    return sorted(output_dir.glob("checkpoint_step*"), key=lambda p: int(p.name[15:]))


def average_weights(paths: list[Path]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the weights of several checkpoints (computed in fp64)."""
    loaded = [load(path, with_trainer_state=False).weights for path in paths]
    return {
        name: torch.stack([weights[name].double() for weights in loaded]).mean(0).to(first.dtype)
        for name, first in loaded[0].items()
    }


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


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
        spm_model = (path / SPM).read_bytes()
        state = torch.load(path / STATE, weights_only=True) if with_trainer_state else None
    except (OSError, ValueError, RuntimeError, SafetensorError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"cannot load checkpoint {path}: {message}") from error
    return Checkpoint(weights, config, spm_model, state)
