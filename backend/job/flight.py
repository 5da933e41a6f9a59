"""The flight recorder files of a run directory. PyTorch records every rank's collectives (its
flight recorder, on by default; `TORCH_FR_BUFFER_SIZE=0` in the job's env turns it off). On a hang
the watch writes `REQUEST` in the run directory of each node; every rank that can still run Python
answers with its recorder's entries in `dump_file(rank)` (`launcher.flight`), and the node agent
reads that into a `flight` line. A rank that does not answer is stopped, dead, or blocked where
Python cannot run (docs/telemetry.md)."""
from __future__ import annotations

REQUEST = "flight/request"


def dump_file(rank: int) -> str:
    return f"flight/rank-{rank}.json"
