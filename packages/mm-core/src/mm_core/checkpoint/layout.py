"""On-disk layout: ``<save>/step_<N>/`` DCP folders and a ``latest`` marker written last, atomically.

A checkpoint is first written to ``<save>/.step_<N>.partial/``; only when every rank has finished does
rank 0 rename it to ``step_<N>`` and then replace ``latest``. A save that dies midway leaves a
``.partial`` folder that is never loaded, and ``latest`` still names the previous good checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from mm_core.errors import CheckpointError

LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f".step_{step}.partial"


def is_checkpoint(path: Path) -> bool:
    """A complete DCP folder has its ``.metadata`` file (written last by DCP)."""
    return (path / ".metadata").is_file()


def read_latest(root: Path) -> Path | None:
    """The checkpoint ``latest`` names, or None when there is no marker."""
    marker = root / LATEST
    if not marker.is_file():
        return None
    name = marker.read_text(encoding="utf-8").strip()
    path = root / name
    if not is_checkpoint(path):
        raise CheckpointError(f"{marker} names {name!r}, but {path} is not a complete checkpoint")
    return path


def write_latest(root: Path, step: int) -> None:
    """Point ``latest`` at ``step_<N>`` with an atomic replace (the marker is never half-written)."""
    tmp = root / f".{LATEST}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"step_{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finalize(root: Path, step: int) -> Path:
    """Rename the finished ``.partial`` folder to ``step_<N>`` (replacing an older one), update ``latest``."""
    src, dst = partial_dir(root, step), step_dir(root, step)
    if dst.exists():
        trash = root / f".step_{step}.old"
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(dst, trash)
        os.replace(src, dst)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(src, dst)
    _fsync_dir(root)
    write_latest(root, step)
    return dst


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete ``step_<N>`` folders under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and is_checkpoint(child):
            found.append((int(m.group(1)), child))
    return sorted(found)


def prune(root: Path, keep: int | None) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (never the one ``latest`` names)."""
    if not keep:
        return []
    latest = read_latest(root)
    ckpts = list_checkpoints(root)
    removed = []
    for _, path in ckpts[: max(0, len(ckpts) - keep)]:
        if latest is not None and path.resolve() == latest.resolve():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def resolve_load_path(load: str, save: str | None) -> Path | None:
    """Where ``training.load`` points: a step folder, a save root with ``latest``, or ``auto``.

    ``auto`` resumes from ``training.save``'s newest complete checkpoint, or returns None (fresh start).
    """
    if load == "auto":
        if not save:
            raise CheckpointError("training.load: auto needs training.save (the folder to resume from)")
        root = Path(save)
        latest = read_latest(root) if (root / LATEST).exists() else None
        if latest is None:
            ckpts = list_checkpoints(root)
            latest = ckpts[-1][1] if ckpts else None
        return latest
    path = Path(load)
    if is_checkpoint(path):
        return path
    if (path / LATEST).is_file():
        return read_latest(path)
    if path.is_dir() and (ckpts := list_checkpoints(path)):
        return ckpts[-1][1]
    raise CheckpointError(
        f"training.load: {str(path)!r} is neither a checkpoint folder (step_<N> with .metadata) nor a save "
        "folder with a 'latest' marker"
    )
