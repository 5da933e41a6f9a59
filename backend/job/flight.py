"""The flight recorder files of a run directory. PyTorch records every rank's collectives (its
flight recorder, on by default; `TORCH_FR_BUFFER_SIZE=0` in the job's env turns it off). On a hang
the watch writes `REQUEST` in the run directory of each node; every rank that can still run Python
answers with its recorder's entries in `dump_file(rank)` (`launcher.flight`), and the node agent
reads that into a `flight` line. A rank that does not answer is stopped, dead, or blocked where
Python cannot run (docs/telemetry.md)."""
from __future__ import annotations

import os
import stat
from pathlib import Path

REQUEST = "flight/request"
MAX_REQUEST_BYTES = 200


def dump_file(rank: int) -> str:
    return f"flight/rank-{rank}.json"


def read_regular(path: Path, limit: int) -> bytes:
    """At most `limit` bytes of a regular file, refusing links, FIFOs and devices: the run
    directory's files are read by the agent and the workers, and a crafted one must not make
    either block, flood its memory or read something else."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"larger than {limit >> 20} MiB" if limit >= 1 << 20 else f"larger than {limit} bytes")
    return data
