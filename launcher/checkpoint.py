"""Checkpoint directories: atomic publication, discovery and pruning.

A checkpoint is written into `checkpoint-<step>.tmp`, every file fsynced, the `complete` marker
written last inside it, then the directory is renamed to `checkpoint-<step>`. Only a directory
with that exact name *and* the marker counts, so a crash at any point leaves nothing that looks
complete. The run directory must be shared by all nodes (as the field notes require).
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

MARKER = "complete"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def tmp_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"checkpoint-{step}.tmp"


def final_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"checkpoint-{step}"


def is_complete(path: Path) -> bool:
    path = Path(path)
    return bool(_NAME.match(path.name)) and (path / MARKER).is_file()


def step_of(path: Path) -> int:
    match = _NAME.match(Path(path).name)
    if not match:
        raise ValueError(f"{path} is not a checkpoint directory (expected checkpoint-<step>)")
    return int(match.group(1))


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=step_of)


def latest(run_dir: Path) -> Path | None:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def resolve(run_dir: Path, ref: str | int | None) -> Path | None:
    """`latest` / None → newest complete one (or None); a step number or a path → that checkpoint.

    Raises ValueError with a user-facing message when a named checkpoint is missing or incomplete.
    """
    if ref is None or str(ref) == "latest":
        return latest(run_dir)
    text = str(ref)
    path = final_dir(run_dir, int(text)) if text.isdigit() else Path(text)
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        raise ValueError(f"checkpoint {path} is incomplete (no '{MARKER}' marker); it was interrupted while saving")
    return path


def fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            _fsync(Path(dirpath) / name)
        _fsync(Path(dirpath))


def _fsync(path: Path) -> None:
    """Files and directories alike (a directory's fsync makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare(run_dir: Path, step: int) -> Path:
    """Fresh temporary directory for `step` (a leftover from a crashed save is removed)."""
    tmp = tmp_dir(run_dir, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path, step: int) -> Path:
    """fsync everything, write the marker last, rename into place. Called once (rank 0) after
    every rank has finished writing its files into `tmp`."""
    fsync_tree(tmp)
    marker = tmp / MARKER
    marker.write_text(f"{step}\n")
    _fsync(marker)
    final = final_dir(tmp.parent, step)
    if final.exists():  # a re-save of the same step after a resume: replace it as one rename
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(tmp.parent)
    return final


def prune(run_dir: Path, keep: int | None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond `keep`; never touches incomplete ones."""
    if not keep:
        return []
    done = complete_checkpoints(run_dir)
    doomed = done[:-keep] if len(done) > keep else []
    for path in doomed:
        # Rename first so a crash mid-delete leaves a name that is never taken as complete.
        trash = path.with_name(path.name + ".deleting")
        os.rename(path, trash)
        shutil.rmtree(trash)
    return doomed
