"""Reading recorded telemetry from the database: series for charts (reduced to a point budget in
SQL) and alerts. Works in any process (studio, CLI) without an ingestor;
`Ingestor.series` adds the in-memory tail on top of this.

Each step once: a resumed attempt does again every step after the checkpoint it resumed from, so
the rows of those steps from earlier attempts are left out of every reading (`current`). They
stay in the database (what a failed attempt logged before it failed is worth keeping).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, NamedTuple

from sqlalchemy import Integer, Table, and_, cast, func, or_, select, true
from sqlalchemy.engine import Connection, Engine

from backend.store.telemetry_models import Alert, MetricSample, NO_INDEX, RunEvent

S, A, E = MetricSample.__table__, Alert.__table__, RunEvent.__table__
# The step of each `train` event, at the event's time, node and rank: charts draw the train/*
# series against it. Read from the event rows rather than stored as samples, so the exports keep
# one row per logged metric (each of which has its step in the `step` column already).
STEP_SERIES = "train/step"


class SeriesKey(NamedTuple):
    name: str
    node: str
    gpu: int
    rank: int


@dataclass
class SeriesResult:
    """Points per series in time order; pass `cursor` back as `since` to get only what is new.
    `reset` is True when `since` could not be honoured (too old for the live tail): the result is
    the full history, so redraw from it."""

    cursor: int
    series: dict[SeriesKey, list[tuple[float, float | None]]]
    reset: bool = False


def match(name: str, names: Iterable[str]) -> bool:
    return any(name == n or (n.endswith("*") and name.startswith(n[:-1])) for n in names)


def name_filter(names: list[str]):
    exact = [n for n in names if not n.endswith("*")]
    prefixes = [n[:-1] for n in names if n.endswith("*")]
    parts = ([S.c.name.in_(exact)] if exact else []) + [S.c.name.like(p + "%") for p in prefixes]
    return or_(*parts) if parts else and_(False)


def superseded(starts: Iterable[tuple[int | None, int | None]]) -> dict[int, int]:
    """{attempt: step}: that attempt's steps after `step` were done again by a later attempt.

    `starts` are (attempt, resumed_from) of a run's `start` events. A later attempt that resumed
    from checkpoint C redoes every step after C (from scratch, resumed_from None: every step), so
    an attempt's cut is the smallest resume point of all attempts after it. Attempt None (rows
    from before attempts were recorded) counts as 0."""
    resumed: dict[int, int] = {}
    for attempt, step in starts:
        a, s = attempt or 0, step if isinstance(step, int) else 0
        resumed[a] = min(resumed.get(a, s), s)
    cut: dict[int, int] = {}
    later: int | None = None
    for attempt in sorted(resumed, reverse=True):
        if later is not None:
            cut[attempt] = later
        later = resumed[attempt] if later is None else min(later, resumed[attempt])
    return cut


def current(conn: Connection, table: Table, run_id: str):
    """SQL condition on `table` (telemetry_sample or telemetry_event): the run's rows that are its
    history, i.e. no step of an attempt that a later attempt did again (see `superseded`)."""
    starts = conn.execute(select(E.c.attempt, E.c.data).where(E.c.run_id == run_id, E.c.type == "start")).all()
    cut = superseded((attempt, json.loads(data).get("resumed_from")) for attempt, data in starts)
    attempt = func.coalesce(table.c.attempt, 0)
    return and_(true(), *(or_(table.c.step.is_(None), attempt != a, table.c.step <= step) for a, step in cut.items()))


def bucket_of(conn: Connection, t, t0: float, width: float):
    """Integer bucket index of t (t >= t0) in buckets of `width` seconds, in the connection's SQL."""
    x = (t - t0) / width
    if conn.dialect.name == "sqlite":
        return cast(x, Integer)  # truncation is floor for x >= 0
    return func.floor(x)


def history(conn: Connection, run_id: str, names: list[str], max_points: int = 1000,
            start: float | None = None, end: float | None = None) -> dict[SeriesKey, list]:
    """Each matching series over [start, end], reduced in SQL to about `max_points` bucket means
    when it holds more, so a chart of 64 GPUs over a day stays a few thousand points."""
    cond = [S.c.run_id == run_id, name_filter(names), current(conn, S, run_id)]
    if start is not None:
        cond.append(S.c.t >= start)
    if end is not None:
        cond.append(S.c.t <= end)
    keys = S.c.node, S.c.gpu, S.c.rank
    spans: dict[str, tuple[float, float, int, int]] = {}  # name -> (t0, t1, points, series)
    for name, t0, t1, n in conn.execute(select(S.c.name, func.min(S.c.t), func.max(S.c.t), func.count())
                                        .where(*cond).group_by(S.c.name, *keys)):
        a, b, points, n_series = spans.get(name, (t0, t1, 0, 0))
        spans[name] = (min(a, t0), max(b, t1), points + n, n_series + 1)
    out: dict[SeriesKey, list] = {}
    for name, (t0, t1, n, n_series) in spans.items():
        ncond = cond + [S.c.name == name]
        if n / n_series <= max_points or t1 <= t0:
            rows = conn.execute(select(*keys, S.c.t, S.c.value).where(*ncond).order_by(S.c.t)).all()
        else:
            bucket = bucket_of(conn, S.c.t, t0, (t1 - t0) / max_points)
            rows = conn.execute(select(*keys, func.avg(S.c.t), func.avg(S.c.value)).where(*ncond)
                                .group_by(*keys, bucket).order_by(func.avg(S.c.t))).all()
        for node, gpu, rank, t, v in rows:
            out.setdefault(SeriesKey(name, node, gpu, rank), []).append((float(t), v))
    if match(STEP_SERIES, names):
        out.update(_steps(conn, run_id, max_points, start, end))
    return out


def _steps(conn: Connection, run_id: str, max_points: int, start: float | None, end: float | None
           ) -> dict[SeriesKey, list]:
    """The STEP_SERIES points, reduced like the train/* series: their rows are the same events at
    the same times, so the buckets line up with theirs."""
    cond = [E.c.run_id == run_id, E.c.type == "train", E.c.step.is_not(None), current(conn, E, run_id)]
    if start is not None:
        cond.append(E.c.t >= start)
    if end is not None:
        cond.append(E.c.t <= end)
    keys = E.c.node, E.c.rank
    spans = conn.execute(select(func.min(E.c.t), func.max(E.c.t), func.count()).where(*cond).group_by(*keys)).all()
    if not spans:
        return {}
    t0, t1, n = min(s[0] for s in spans), max(s[1] for s in spans), sum(s[2] for s in spans)
    if n / len(spans) <= max_points or t1 <= t0:
        rows = conn.execute(select(*keys, E.c.t, E.c.step).where(*cond).order_by(E.c.t)).all()
    else:
        bucket = bucket_of(conn, E.c.t, t0, (t1 - t0) / max_points)
        rows = conn.execute(select(*keys, func.avg(E.c.t), func.avg(E.c.step)).where(*cond)
                            .group_by(*keys, bucket).order_by(func.avg(E.c.t))).all()
    out: dict[SeriesKey, list] = {}
    for node, rank, t, step in rows:
        out.setdefault(SeriesKey(STEP_SERIES, node, NO_INDEX, rank), []).append((float(t), float(step)))
    return out


def events(engine: Engine, run_id: str, etypes: Iterable[str], limit: int | None = None) -> dict[str, list[dict]]:
    """The run's recorded events of each type, newest first, without those of steps that a later
    attempt did again."""
    with engine.connect() as conn:
        cond = current(conn, E, run_id)
        return {etype: [json.loads(data) for data in conn.execute(
            select(E.c.data).where(E.c.run_id == run_id, E.c.type == etype, cond)
            .order_by(E.c.t.desc(), E.c.id.desc()).limit(limit)).scalars()] for etype in etypes}


ENERGY_SERIES = "gpu/energy_j"


def energy_j(engine: Engine, run_id: str, windows: Iterable[tuple[float, float]]) -> float | None:
    """Joules the run's GPUs used: per attempt window (start, end) and GPU, how far NVML's total-energy
    counter (`gpu/energy_j`, since the driver loaded) rose; None where no GPU reported it. Samples
    older than an hour are minute means (Downsampling), so the first and last minute of a long run
    count a little short."""
    total, seen = 0.0, False
    with engine.connect() as conn:
        for start, end in windows:
            rows = conn.execute(select(func.min(S.c.value), func.max(S.c.value)).where(
                S.c.run_id == run_id, S.c.name == ENERGY_SERIES, S.c.t >= start, S.c.t <= end)
                .group_by(S.c.node, S.c.gpu)).all()
            for low, high in rows:
                if low is not None and high is not None:
                    total, seen = total + high - low, True
    return total if seen else None


def tokens_trained(engine: Engine, run_id: str) -> int:
    """Tokens the workers trained on over all attempts (a step a resume did again counts again: it
    was paid for): the sum of the `train/tokens` series, each point one logging window's count.
    Step series are never downsampled, so the sum is exact."""
    with engine.connect() as conn:
        total = conn.execute(select(func.sum(S.c.value)).where(S.c.run_id == run_id,
                                                               S.c.name == "train/tokens")).scalar()
    return int(total or 0)


def alerts(engine: Engine, run_id: str) -> list[Alert]:
    """A run's stored alerts, oldest first."""
    with engine.connect() as conn:
        rows = conn.execute(select(A).where(A.c.run_id == run_id).order_by(A.c.t, A.c.id)).mappings().all()
    return [Alert(**row) for row in rows]
