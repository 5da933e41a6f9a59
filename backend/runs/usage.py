"""What a run used: the GPU-hours of its attempts and the energy its GPUs drew, per token trained.

Pure: the manager reads the attempts and the telemetry (`backend.telemetry.query.energy_j`,
`tokens_trained`) and passes them in.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

J_PER_KWH = 3.6e6


@dataclass(frozen=True)
class Usage:
    gpu_hours: float
    """Σ over attempts of (end − start) × the GPUs the attempt's ranks held; 0 on CPU nodes."""
    energy_kwh: float | None
    """What NVML's energy counters of those GPUs rose by; None where none reported one."""
    tokens: int

    @property
    def wh_per_mtok(self) -> float | None:
        if self.energy_kwh is None or not self.tokens:
            return None
        return self.energy_kwh * 1000 / (self.tokens / 1e6)

    def cost(self, price_per_gpu_hour: float | None) -> float | None:
        return None if not price_per_gpu_hour or not self.gpu_hours else self.gpu_hours * price_per_gpu_hour


def attempt_gpus(attempt: Any) -> int:
    """GPUs an attempt's ranks held: its planned processes per node on each CUDA node it used."""
    layout = json.loads(attempt.plan_json or "{}").get("layout") or {}
    nodes = json.loads(attempt.cluster_json or "[]")[: layout.get("nnodes", 0)]
    return layout.get("nproc_per_node", 0) * sum(1 for n in nodes if n.get("device", "cuda") == "cuda")


def windows(attempts: Iterable[Any], now: float) -> list[tuple[float, float]]:
    """(start, end) of each attempt; a running one ends now."""
    return [(a.started_at, a.ended_at or now) for a in attempts]


def usage_of(attempts: list[Any], now: float, energy_j: float | None, tokens: int) -> Usage:
    hours = sum((end - start) / 3600 * attempt_gpus(a) for a, (start, end) in zip(attempts, windows(attempts, now)))
    return Usage(gpu_hours=hours, energy_kwh=None if energy_j is None else energy_j / J_PER_KWH, tokens=tokens)


def format_duration(seconds: float | None) -> str:
    """`45s`, `3m 05s`, `1h 02m` (the studio's and the CLI's one way to say a duration)."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "–"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"
