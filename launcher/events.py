"""Event lines (`<run_dir>/events/rank-<N>.jsonl`, contract in docs/architecture.md) and the
per-window step statistics behind them.

Timing without a device synchronisation per step: every step ends with the worker's control
all-reduce (stop flag, on a gloo group over CPU tensors, see `launcher.dist`). The host time a rank
spends inside that call is the time it waited for the slowest rank to reach the step boundary,
so a straggler shows the smallest `collective_wait_s` and the others the largest. Device-side
values (loss, grad norm) stay on the device and are read once per logging window.
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class EventWriter:
    """Appends one JSON object per line; the file is line-buffered so the node agent can tail it."""

    def __init__(self, run_dir: Path, rank: int):
        path = Path(run_dir) / "events" / f"rank-{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "a", buffering=1)
        self._lock = threading.Lock()  # the data heartbeat writes from a thread of its own

    def emit(self, type: str, **fields: Any) -> dict:
        event = {"type": type, "time": time.time(), **fields}
        line = json.dumps(event, allow_nan=False, default=_jsonable) + "\n"
        with self._lock:
            self._file.write(line)
        return event

    def close(self) -> None:
        self._file.close()


def _jsonable(value: Any) -> Any:
    return float(value) if hasattr(value, "__float__") else str(value)


def split_nonfinite(**values: float | None) -> tuple[dict[str, float | None], dict[str, str]]:
    """Events are strict JSON, which has no NaN: non-finite values become null, and the second
    dict names them (as text) for the alerts."""
    bad = {name: str(v) for name, v in values.items() if v is not None and not math.isfinite(v)}
    return {name: None if name in bad else v for name, v in values.items()}, bad


@dataclass
class Window:
    """Host timings of the steps since the last logging step. The trainer moves `started` forward
    by the time spent saving checkpoints, so throughput covers training only."""

    steps: int = 0
    step_time_s: float = 0.0
    collective_wait_s: float = 0.0
    data_wait_s: float = 0.0
    tokens: int = 0
    samples: int = 0
    started: float = field(default_factory=time.perf_counter)

    def add(self, step_time_s: float, collective_wait_s: float, data_wait_s: float, tokens: int, samples: int) -> None:
        self.steps += 1
        self.step_time_s += step_time_s
        self.collective_wait_s += collective_wait_s
        self.data_wait_s += data_wait_s
        self.tokens += tokens
        self.samples += samples

    def means(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {"step_time_s": self.step_time_s / n, "collective_wait_s": self.collective_wait_s / n,
                "data_wait_s": self.data_wait_s / n}


def eta_seconds(step: int, max_steps: int, mean_step_time_s: float) -> float:
    return max(max_steps - step, 0) * mean_step_time_s


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def memory_gib() -> tuple[float, float]:
    """(allocated, peak) GiB: the accelerator's allocator when there is one, else this process's RSS."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.memory_allocated() / 2**30, torch.cuda.max_memory_allocated() / 2**30
    import resource

    import psutil

    rss = psutil.Process(os.getpid()).memory_info().rss / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return rss, peak
