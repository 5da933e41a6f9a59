"""Worker entry point, started by torchrun on every node:

    python -m torch.distributed.run ... -m launcher.train --run-dir <abs run dir> [--resume latest|<ckpt dir>]

Exit codes: 0 done, 1 failed (the error is in the log, the rank's `end` event and its end slot),
143 stopped by SIGTERM.
"""
from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

from backend.job.errors import UserError
from backend.job.planner import NODE_ENV
from launcher.leave import leave

SLOT_BYTES = 4096
# A write that failed without saying why (torch.save reports "unexpected pos ...") on a file system
# with less than this left is a full disk.
DISK_FULL_BYTES = 1 << 20
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class EndSlot:
    """`events/rank-<N>.end`: room for this rank's `end` event, taken at start. The last words of
    a rank must survive a full disk, where the log and the events file can no longer grow: the
    slot is written in place, into bytes the file system has already given it."""

    def __init__(self, run_dir: Path, rank: int):
        path = Path(run_dir) / "events" / f"rank-{rank}.end"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self._fd, slot_bytes(None))
        # Delayed allocation would leave the blocks to be found at the first flush: take them now.
        os.fsync(self._fd)

    def write(self, event: dict) -> None:
        os.pwrite(self._fd, slot_bytes(event), 0)


def slot_bytes(event: dict | None) -> bytes:
    """One JSON line padded with spaces to SLOT_BYTES (only spaces: not ended yet); a long error is
    shortened to fit."""
    text = b""
    if event is not None:
        event = dict(event)
        text = json.dumps(event, ensure_ascii=False, default=str).encode()
        while len(text) >= SLOT_BYTES and len(event.get("error") or "") > 64:
            event["error"] = event["error"][:len(event["error"]) // 2] + " …"
            text = json.dumps(event, ensure_ascii=False, default=str).encode()
    return text[:SLOT_BYTES - 1].ljust(SLOT_BYTES - 1) + b"\n"


def error_report(exc: BaseException, run_dir: Path, rank: int) -> tuple[str, str]:
    """(error_type, error) of a failed rank: the exception's class name and the message to show.
    User errors already say what to fix; a full disk is named with the path and the space left
    whatever the exception that met it; torch.distributed.checkpoint's wrapper, the same on every
    rank, is unwrapped to this rank's own failure (else the first)."""
    kind = type(exc).__name__
    if isinstance(exc, UserError):
        return kind, str(exc)
    inner = _checkpoint_failure(exc, rank)
    if inner:
        on, error = inner
        shown = f"{type(error).__name__}: {error}" + ("" if on == rank else f" (on rank {on})")
    else:
        shown = f"{kind}: {exc}"
    nospace = next((e for e in _causes(exc) if _is_no_space(e)), None)
    try:
        usage = shutil.disk_usage(run_dir)
    except OSError:
        usage = None
    if nospace is not None or (usage is not None and usage.free < DISK_FULL_BYTES):
        where = getattr(nospace, "filename", None) or run_dir
        space = f" ({_size(usage.free)} free of {_size(usage.total)})" if usage else ""
        return kind, f"No space left on device: {where}{space}; {_first_line(shown)}"
    return kind, shown


def _causes(exc: BaseException):
    """The exception, what it was raised from or during, and the per-rank failures of a
    CheckpointException, depth first."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] for f in failures.values() if isinstance(f, tuple) and f]
        todo += [e.__context__, e.__cause__]


def _is_no_space(e: BaseException) -> bool:
    return (isinstance(e, OSError) and e.errno in _NO_SPACE) or "No space left on device" in str(e)


def _checkpoint_failure(exc: BaseException, rank: int) -> tuple[int, BaseException] | None:
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        on = rank if rank in failures else min(failures)
        return on, failures[on][0]
    return None


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    exp = min(int(math.log(n, 1024)), 3)
    return f"{n / 1024 ** exp:.1f} {('KiB', 'MiB', 'GiB')[exp - 1]}"


def error_line(rank: int, exc: BaseException, error: str) -> str:
    """The log line of a failed rank. A user error's message does not name its type; the line
    does (`[rank1] error: DataError: ...`), so the log alone still tells bad data from a crash."""
    return f"[rank{rank}] error: {type(exc).__name__ + ': ' if isinstance(exc, UserError) else ''}{error}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launcher.train", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--resume", default=None, help="'latest' or a checkpoint directory")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    slot = EndSlot(args.run_dir, rank)
    # The node and its torchrun group (pids/<node>.pid) tell the control plane which attempt on
    # which node wrote the slot, also when all nodes share the run directory.
    where = {"rank": rank, "node": os.environ.get(NODE_ENV), "pgid": os.getpgid(os.getppid())}

    from backend.job.capabilities import same_data_ranks
    from launcher import dist, flight
    from launcher.config import load_job
    from launcher.trainer import Stopped, Trainer

    def end(events, status: str, step: int, exc: BaseException | None = None, note: str | None = None) -> None:
        error_type, error = error_report(exc, args.run_dir, rank) if exc is not None else (None, note)
        event = {"status": status, "step": step, "error": error, "error_type": error_type, **where}
        slot.write({"type": "end", "time": time.time(), **event})
        # The log and the events file may be on the disk that just filled up: the slot has it all.
        try:
            if exc is not None:
                if not isinstance(exc, UserError):
                    traceback.print_exception(exc)
                print(error_line(rank, exc, error), file=sys.stderr, flush=True)
            if events is not None:
                events.emit("end", **event)
                events.close()
        except OSError:
            pass

    try:
        spec = load_job(args.run_dir)
    except Exception as exc:  # nothing started yet: report and leave
        end(None, "failed", 0, exc)
        return 1
    ctx = dist.init(spec.ddp_timeout, same_data_ranks=same_data_ranks(spec))
    flight.answer_requests(Path(args.run_dir), ctx.rank)
    logging.basicConfig(level=logging.INFO if ctx.is_main else logging.WARNING,
                        format=f"[rank{ctx.rank}] %(asctime)s %(levelname)s %(message)s", stream=sys.stdout, force=True)
    trainer = Trainer(args.run_dir, spec, ctx, args.resume)
    code = 0
    try:
        trainer.setup()
        trainer.train()
        end(trainer.events, "succeeded", trainer.step)
    except Stopped as stopped:
        end(trainer.events, "stopped", trainer.step, note=str(stopped) or None)
        if str(stopped):
            print(f"[rank{rank}] {stopped}", file=sys.stderr, flush=True)
        code = 143
    except BaseException as exc:
        # torch.distributed.checkpoint's CheckpointException is a BaseException.
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        end(trainer.events, "failed", trainer.step, exc)
        code = 1
    finally:
        try:
            sys.stdout.flush()
        except OSError:
            pass
    if code == 0:
        dist.close()
    # On failure skip destroy_process_group: it can block on peers that are gone; torchrun
    # takes the remaining ranks down when this one exits non-zero.
    return code


if __name__ == "__main__":
    leave(main())
