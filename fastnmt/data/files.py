"""Writing files so that a crash or a concurrent writer never leaves a partial one: a file
written under a temporary name and renamed, a directory fsynced and swapped in. Used by
vocabularies, the Multi30k cache, shortlists, prepared data and checkpoints."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same directory and a rename, so that a crash or a
    concurrent writer (several DDP ranks) never leaves a partial file at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        temp = Path(f.name)
        f.write(data)
    try:
        os.replace(temp, path)
    except OSError:
        temp.unlink(missing_ok=True)
        raise


def fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def rename_durably(source: Path, target: Path) -> None:
    """Rename, and make the rename itself durable."""
    os.rename(source, target)
    fsync(target.parent)


def fsync_tree(directory: Path) -> None:
    """fsync every file, then the directory: a directory that carries its final name is complete
    on disk."""
    for path in (*directory.iterdir(), directory):
        fsync(path)


def swap_in(temporary: Path, directory: Path) -> None:
    """Give ``temporary`` the name ``directory``; an old one is moved aside first and deleted
    after (a crash in between leaves no directory: the next run builds it again)."""
    aside = None
    if directory.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        os.rename(directory, aside / "old")
    rename_durably(temporary, directory)
    if aside is not None:
        shutil.rmtree(aside)
