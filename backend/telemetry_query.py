"""Reading recorded telemetry from the database: series for charts (reduced to a point budget in
SQL) and alerts. Works in any process (studio, CLI) without an ingestor;
`Ingestor.series` adds the in-memory tail on top of this.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple

from sqlalchemy import Integer, and_, cast, func, or_, select
from sqlalchemy.engine import Connection, Engine

from backend.telemetry_models import Alert, MetricSample

S, A = MetricSample.__table__, Alert.__table__


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
    cond = [S.c.run_id == run_id, name_filter(names)]
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
    return out


def alerts(engine: Engine, run_id: str) -> list[Alert]:
    """A run's stored alerts, oldest first."""
    with engine.connect() as conn:
        rows = conn.execute(select(A).where(A.c.run_id == run_id).order_by(A.c.t, A.c.id)).mappings().all()
    return [Alert(**row) for row in rows]
