"""A rank's answer to the watch's flight recorder request (`backend.job.flight`): a daemon thread,
because the main thread may be blocked inside a collective, where no signal handler of Python's
runs. PyTorch releases the GIL while a collective waits, so this thread can read the recorder."""
from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from backend.job.flight import MAX_REQUEST_BYTES, REQUEST, dump_file, read_regular
from backend.job.jsonfile import write_json_atomic

log = logging.getLogger(__name__)
POLL_S = 1.0


def recorder_dumps() -> dict[str, object]:
    """Each of PyTorch's flight recorders (the generic one, gloo's; NCCL's in a CUDA build) as
    parsed JSON, or the error that reading it raised."""
    import torch._C._distributed_c10d as c10d

    dumps: dict[str, object] = {}
    for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            dumps[name] = json.loads(dump(True, False))  # includeCollectives, onlyActive
        except Exception as exc:  # noqa: BLE001 - an engine change: reported in the file, not fatal
            dumps[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return dumps


def write_dump(run_dir: Path, rank: int, request: str = "") -> Path:
    """This rank's recorders, with the request they answer (the watch matches on it, not on clocks)."""
    path = run_dir / dump_file(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"rank": rank, "time": time.time(), "request": request, "dumps": recorder_dumps()}, 0o600)
    return path


def answer_requests(run_dir: Path, rank: int, poll_s: float = POLL_S) -> threading.Thread:
    """Write this rank's dump whenever the request file changes; a request made before this
    worker started (an earlier attempt's) is not answered."""
    request = Path(run_dir) / REQUEST

    def mtime() -> int | None:
        try:
            return request.stat().st_mtime_ns
        except OSError:
            return None

    def loop(seen: int | None) -> None:
        while True:
            time.sleep(poll_s)
            now = mtime()
            if now is None or now == seen:
                continue
            seen = now
            try:
                token = read_regular(request, MAX_REQUEST_BYTES).decode("utf-8", "replace").strip()
                write_dump(Path(run_dir), rank, token)
            except Exception as exc:  # noqa: BLE001 - a full disk must not end training
                log.warning("rank %d: flight recorder dump failed: %s", rank, exc)

    thread = threading.Thread(target=loop, args=(mtime(),), name="flight-recorder-dump", daemon=True)
    thread.start()
    return thread
