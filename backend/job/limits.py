"""The time limits a job's settings imply, shared by the control plane and the worker: how long a
run may go without a step before it is hung (the hang alert and the watch that stops it), and how
long one collective may wait once the step time is known (the worker's process groups)."""
from __future__ import annotations

import statistics
from collections.abc import Sequence

from backend.job.spec import JobSpec

COLLECTIVE_HANG_FACTOR = 2.0
COLLECTIVE_MARGIN_S = 30.0
"""A collective times out at twice the hang limit and at least 30 s after it: where the
studio watches the run, its hang watch (which names the stuck rank) stops the run first; where
nothing watches (a detached CLI run, a closed studio, a Slurm job), the ranks still end
themselves in minutes, not after ddp_timeout."""


def hang_limit_s(floor_s: float, multiple: float, intervals_s: Sequence[float]) -> float:
    """Seconds without a step after which a run is hung: `multiple` x the median of the recent
    `intervals_s` between steps, and never less than `floor_s` (the job's `hang_timeout_s`)."""
    intervals = [t for t in intervals_s if t > 0]
    return max(floor_s, multiple * statistics.median(intervals)) if intervals else floor_s


def collective_timeout_s(spec: JobSpec, step_times_s: Sequence[float]) -> float:
    """The collective timeout for a job whose recent steps took `step_times_s`: from the hang
    limit over the time between two logged steps (what the control plane measures), never more
    than the job's `ddp_timeout`, which also holds before the first steps and around checkpoints."""
    limit = hang_limit_s(spec.hang_timeout_s, spec.hang_step_multiple, [t * spec.logging_steps for t in step_times_s])
    return float(min(spec.ddp_timeout, max(COLLECTIVE_HANG_FACTOR * limit, limit + COLLECTIVE_MARGIN_S)))
