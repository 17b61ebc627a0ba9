"""Writes that survive a crash: the bytes reach the disk before the rename that publishes them.

A rename is atomic, but without an fsync the kernel may write the rename to disk before the data it
points at: after a power loss the new name holds an empty or partial file and the old one is gone.
So a file is fsynced before it is renamed into place, and its directory after, so the rename itself
persists. Checkpoints, calibration, history, configs and releases are written this way.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: str | os.PathLike) -> None:
    """Persist a directory's entries (a rename or a new file in it)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """Persist every file under `root` and the directories holding them (deepest first), `root` too."""
    root = Path(root)
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                continue
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(dirpath)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Replace `path` with `text` (UTF-8) atomically and durably: a crash leaves the old file or the
    new one, whole. The temporary file is named per process, so two writers never share one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
