"""Checkpoint directories: atomic publication, verification, discovery, pruning and safe reading.

A checkpoint is written into `checkpoint-<step>.tmp`, every file fsynced, the `complete` marker
written last inside it, then the directory is renamed to `checkpoint-<step>`. Only a directory
with that exact name *and* the marker counts, so a crash at any point leaves nothing that looks
complete. The marker records the size and SHA-256 of every other file, so a file damaged after
the save is found before it is loaded. The run directory must be shared by all nodes (as the field
notes require).

Checkpoint files are read without running code from them: torch files with `weights_only=True`,
DCP's pickled `.metadata` through an unpickler that knows only DCP's metadata classes.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import pickle
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from backend.job.rundir import CHECKPOINT_MARKER as MARKER

_NAME = re.compile(r"^checkpoint-(\d+)$")
_CHUNK = 8 << 20
_torch_load = torch.load  # the real one, also while `safe_torch_load` has replaced torch.load


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, incomplete, damaged, unsafe to read); the message names the file."""


@dataclass(frozen=True)
class Resolved:
    path: Path | None
    #: newer complete checkpoints passed over because a file differs from the marker's record, with why
    skipped: tuple[str, ...] = ()
    #: False for a marker of the old format (the step number alone): nothing was checked
    verified: bool = True


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
    """The newest complete checkpoint, unverified (for messages; `resolve` picks what is loaded)."""
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def resolve(run_dir: Path, ref: str | int | None) -> Resolved:
    """`latest` / None → the newest complete checkpoint whose files match its marker (path None when
    there is no complete one); a step number or a path → that checkpoint, which must match.

    Raises CheckpointError naming the checkpoint and file when a named checkpoint is missing,
    incomplete or damaged, or when no complete checkpoint of the run matches its marker.
    """
    if ref is None or str(ref) == "latest":
        skipped = []
        for path in reversed(complete_checkpoints(run_dir)):
            found = problems(path)
            if not found:
                return Resolved(path, tuple(skipped), recorded(path) is not None)
            skipped.append("; ".join(found))
        if skipped:
            raise CheckpointError(f"no complete checkpoint in {run_dir} matches what was saved: " + "; ".join(skipped))
        return Resolved(None)
    text = str(ref)
    path = final_dir(run_dir, int(text)) if text.isdigit() else Path(text)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        raise CheckpointError(f"checkpoint {path} is incomplete (no '{MARKER}' marker); it was interrupted while saving")
    found = problems(path)
    if found:
        raise CheckpointError(f"checkpoint {path} does not match what was saved: " + "; ".join(found))
    return Resolved(path, verified=recorded(path) is not None)


def recorded(path: Path) -> dict[str, dict] | None:
    """{relative path: {"size", "sha256"}} from the marker; None for an old marker (the step number
    alone). Raises CheckpointError for a marker that is neither."""
    marker = Path(path) / MARKER
    text = marker.read_text()
    if text.strip().isdigit():
        return None
    try:
        return dict(json.loads(text)["files"])
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{marker}: not a checkpoint marker (expected the JSON that publish writes)") from None


def problems(path: Path) -> list[str]:
    """Each file of a complete checkpoint that differs from the marker's record, as
    '<checkpoint>/<file>: why'; [] when all match or nothing was recorded (an old marker)."""
    path = Path(path)
    try:
        files = recorded(path)
    except CheckpointError as exc:
        return [str(exc)]
    found, unhashed = [], []
    for rel, want in (files or {}).items():
        file, name = path / rel, f"{path.name}/{rel}"
        if not file.is_file():
            found.append(f"{name}: missing")
        elif (size := file.stat().st_size) != want["size"]:
            found.append(f"{name}: size {size} != recorded {want['size']}")
        else:
            unhashed.append((name, file, want["sha256"]))
    for (name, _, want), got in zip(unhashed, _sha256_all([file for _, file, _ in unhashed])):
        if got != want:
            found.append(f"{name}: sha256 {got[:12]}… != recorded {want[:12]}… (changed after the save)")
    return found


def manifest(root: Path) -> dict[str, dict]:
    """Size and SHA-256 of every file under `root` but the marker, by path relative to `root`."""
    root = Path(root)
    files = sorted(Path(d) / name for d, _, names in os.walk(root) for name in names)
    files = [f for f in files if f != root / MARKER]
    return {f.relative_to(root).as_posix(): {"size": f.stat().st_size, "sha256": digest}
            for f, digest in zip(files, _sha256_all(files))}


def write_marker(path: Path, step: int) -> None:
    """The `complete` marker of the files now in `path`, written and fsynced."""
    marker = Path(path) / MARKER
    marker.write_text(json.dumps({"step": step, "files": manifest(path)}, indent=1) + "\n")
    _fsync(marker)


def _sha256_all(files: list[Path]) -> list[str]:
    # hashlib releases the GIL while it hashes a large buffer, so threads hash several files at
    # once (a sharded checkpoint has one or more files per rank).
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        return list(pool.map(_sha256, files))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


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
    """fsync everything, write the marker (with every file's size and checksum) last, rename into
    place. Called once (rank 0) after every rank has finished writing its files into `tmp`."""
    fsync_tree(tmp)
    write_marker(tmp, step)
    final = final_dir(tmp.parent, step)
    if final.exists():  # a re-save of the same step after a resume: replace it as one rename
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(tmp.parent)
    return final


def prune(run_dir: Path, keep: int | None, protected: Path | None = None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond `keep`, but never `protected` (the best by eval
    loss, kept beside the newest ones); never touches incomplete ones."""
    if not keep:
        return []
    done = [path for path in complete_checkpoints(run_dir) if path != protected]
    if protected is not None and keep > 1:  # the best counts among the kept (with a limit of 1: best and newest)
        keep -= 1
    doomed = done[:-keep] if len(done) > keep else []
    for path in doomed:
        # Rename first so a crash mid-delete leaves a name that is never taken as complete.
        trash = path.with_name(path.name + ".deleting")
        os.rename(path, trash)
        shutil.rmtree(trash)
    return doomed


def best(run_dir: Path) -> Path | None:
    """The complete checkpoint with the lowest eval loss (its trainer_state.json's), None where no
    checkpoint was evaluated; the earliest among equals."""
    scored = []
    for path in complete_checkpoints(run_dir):
        try:
            loss = json.loads((path / "trainer_state.json").read_text()).get("eval_loss")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            scored.append((loss, step_of(path), path))
    return min(scored)[2] if scored else None


# ---- reading without running code -------------------------------------------------------------

def read(file, map_location=None, allowed=(), name=None, **kwargs):
    """`torch.load` of a checkpoint file (or stream) with weights_only=True: tensors and plain data,
    plus the `allowed` classes. Raises CheckpointError naming the file (`name` for a stream)."""
    name = name or file
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return _torch_load(file, map_location=map_location, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{name}: cannot be read safely ({_refusal(exc)})") from None
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        first = (str(exc).splitlines() or [""])[0].split(". ")[0]
        raise CheckpointError(f"{name}: cannot be read ({type(exc).__name__}: {first})") from None


def _refusal(exc: Exception) -> str:
    """What torch's weights_only unpickler refused: its message is a page of advice around that."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    else:  # the advice paragraph comes first
        text = text.split("\n\n", 1)[-1]
    return " ".join(text.split("Check the documentation")[0].split(". Please use")[0].split()).rstrip(".")


@contextlib.contextmanager
def safe_torch_load(where: Path, allowed=()):
    """Inside: every `torch.load` is `read` (weights_only=True, the `allowed` classes), whatever its
    caller asked for. For libraries that pass weights_only=False themselves: DeepSpeed's checkpoint
    engine and zero_to_fp32, DCP's non-tensor items. Streams are named `where` in errors."""
    def load(f, map_location=None, *, weights_only=None, **kwargs):
        return read(f, map_location, allowed, name=f if isinstance(f, (str, os.PathLike)) else where, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = _torch_load


# The globals a DCP `.metadata` pickle refers to (listed from real FSDP2 and DDP-layout checkpoints,
# fp32 and bf16, with a recording Unpickler): DCP's metadata records, torch.Size, dtypes, layouts.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_GLOBALS = {
    *((_DCP_METADATA, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                         "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                         "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"),  # where Python 3.13 defines it
}


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _DCP_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name} is not a DCP metadata class")


class SafeDcpReader(FileSystemReader):
    """DCP's file reader, except that `.metadata` (which FileSystemReader.read_metadata reads with a
    bare pickle.load) is unpickled with only DCP's metadata classes allowed. It is read here, before
    dcp.load, so a refusal is a CheckpointError naming the file rather than a rank's wrapped failure."""

    def __init__(self, path: Path):
        super().__init__(path)
        file = Path(path) / ".metadata"
        try:
            with open(file, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except _Refused as exc:
            raise CheckpointError(f"{file}: cannot be read safely ({exc})") from None
        except (pickle.UnpicklingError, OSError, EOFError, ValueError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{file}: cannot be read ({type(exc).__name__}: {exc})") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self._metadata = metadata

    # No **kwargs: DCP would otherwise fall back to per-rank metadata files after a failure.
    def read_metadata(self):
        return self._metadata


def dcp_read(state: dict, directory: Path, planner=None, no_dist: bool = False) -> None:
    """DCP load of `directory` into `state` (in place) without running code from its files. Calls the
    loader that dcp.load and dcp_to_torch_save share, because export's planner rebuilds an empty
    state dict, which dcp.load would not hand back."""
    reader = SafeDcpReader(directory)
    try:
        with safe_torch_load(directory):
            _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=no_dist)
    except CheckpointException as exc:  # DCP wraps each rank's exception; ours names the file
        ours = [failure for failure, _ in exc.failures.values() if isinstance(failure, CheckpointError)]
        if ours:
            raise ours[0] from None
        raise
