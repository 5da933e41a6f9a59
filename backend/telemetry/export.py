"""Export of a run's recorded metrics: CSV, JSON, and TensorBoard event files.

Rows are streamed from the database, so a week-long run exports without loading it whole. Each
step appears once: a resumed attempt's rows replace the earlier attempts' rows of the steps it did
again (`telemetry_query.current`).
TensorBoard files need the `tensorboard` package (not a dependency of swift-studio); without it
`ExportError` says how to get it.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import IO, Iterable, Iterator

from sqlalchemy import select
from sqlalchemy.engine import Engine

from backend.store.telemetry_models import MetricSample, NO_INDEX, RunEvent
from backend.telemetry import query

S, E = MetricSample.__table__, RunEvent.__table__
FORMATS = ("csv", "json", "tensorboard")
SERIES_COLUMNS = ("name", "node", "gpu", "rank", "t", "step", "value", "res_s")
CSV_COLUMNS = (*SERIES_COLUMNS, "attempt")
ALERT_COLUMNS = ("t", "last_t", "count", "rule", "severity", "node", "rank", "gpu", "message", "detail")


class ExportError(Exception):
    """An export that cannot be made (unknown run, missing tensorboard); the message says why."""


def _rows(engine: Engine, run_id: str, names: list[str] | None, columns=SERIES_COLUMNS) -> Iterator[tuple]:
    with engine.connect() as conn:
        cond = [S.c.run_id == run_id, query.current(conn, S, run_id)] + ([query.name_filter(names)] if names else [])
        stmt = (select(*(S.c[c] for c in columns)).where(*cond)
                .order_by(S.c.name, S.c.node, S.c.gpu, S.c.rank, S.c.t))
        yield from conn.execution_options(stream_results=True, yield_per=5000).execute(stmt)


def has_data(engine: Engine, run_id: str) -> bool:
    with engine.connect() as conn:
        return any(conn.execute(select(t.c.id).where(t.c.run_id == run_id).limit(1)).first() for t in (S, E))


def write_csv(engine: Engine, run_id: str, out: IO[str], names: list[str] | None = None) -> int:
    """One row per sample: name, node, gpu (-1: none), rank (-1: none), t (unix s), step, value,
    res_s (0: raw sample; else the width of the averaged bucket), attempt (the run's attempt that
    recorded it; of a step done again after a resume, only the later attempt's). Returns the row count."""
    w = csv.writer(out)
    w.writerow(CSV_COLUMNS)
    n = 0
    for row in _rows(engine, run_id, names, CSV_COLUMNS):
        w.writerow(["" if v is None else v for v in row])
        n += 1
    return n


def write_json(engine: Engine, run_id: str, out: IO[str], names: list[str] | None = None) -> int:
    """{"run_id", "series": [{"name", "node", "gpu", "rank", "points": [[t, step, value, res_s], ...]}],
    "alerts": [...]}; NaN never appears (such values are null). Returns the number of points."""
    out.write(json.dumps({"run_id": run_id})[:-1] + ', "series": [')
    n, current, first = 0, None, True
    for name, node, gpu, rank, t, step, value, res_s in _rows(engine, run_id, names):
        key = (name, node, gpu, rank)
        if key != current:
            if current is not None:
                out.write("]}")
            out.write(("" if first else ", ") + json.dumps({"name": name, "node": node, "gpu": gpu, "rank": rank})[:-1]
                      + ', "points": [')
            current, first, sep = key, False, ""
        out.write(sep + json.dumps([t, step, value, res_s]))
        sep = ", "
        n += 1
    if current is not None:
        out.write("]}")
    alerts = [{c: getattr(a, c) for c in ALERT_COLUMNS} for a in query.alerts(engine, run_id)]
    out.write('], "alerts": ' + json.dumps(alerts) + "}\n")
    return n


def write_tensorboard(engine: Engine, run_id: str, logdir: Path, names: list[str] | None = None) -> int:
    """Scalars in one event file under `logdir`: tag `<name>` for rank-0/run-wide series and
    `<name>/<node>:<gpu>` or `<name>/rank<N>` per GPU or rank. Step series use the training step;
    clock series use seconds since the run's first sample. Returns the number of scalars."""
    try:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:
        raise ExportError("TensorBoard export needs the 'tensorboard' package, which swift-studio does not "
                          "install: run `pip install tensorboard` and export again "
                          "(CSV and JSON exports need nothing extra)") from None
    logdir.mkdir(parents=True, exist_ok=True)
    writer = EventFileWriter(str(logdir))
    t0 = None
    n = 0
    try:
        for name, node, gpu, rank, t, step, value, _res in _rows(engine, run_id, names):
            if value is None or not math.isfinite(value):
                continue
            t0 = t if t0 is None else min(t0, t)
            writer.add_event(Event(wall_time=t, step=step if step is not None else int(t - t0),
                                   summary=Summary(value=[Summary.Value(tag=series_tag(name, node, gpu, rank),
                                                                        simple_value=value)])))
            n += 1
    finally:
        writer.close()
    return n


def series_tag(name: str, node: str, gpu: int, rank: int) -> str:
    """A series' name for TensorBoard and the trackers: `<name>` for a run-wide or rank-0 series,
    `<name>/<node>:<gpu>`, `<name>/rank<N>` or `<name>/<node>` per GPU, rank or host."""
    if gpu != NO_INDEX:
        return f"{name}/{node}:{gpu}"
    if name.startswith("rank/"):
        return f"{name}/rank{rank}"
    if name.startswith("host/"):
        return f"{name}/{node}"
    return name


def export(engine: Engine, run_id: str, fmt: str, out: Path | None = None,
           names: Iterable[str] | None = None) -> tuple[Path | None, int]:
    """Export a run in `fmt` to `out` (a file for csv/json, stdout when None; a directory for
    tensorboard, default `tensorboard-<run_id>`). Returns (where, how many values)."""
    names = list(names) if names else None
    if fmt not in FORMATS:
        raise ExportError(f"format: must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if not has_data(engine, run_id):
        raise ExportError(f"run {run_id}: no recorded metrics or events in the database")
    if fmt == "tensorboard":
        logdir = out or Path(f"tensorboard-{run_id}")
        return logdir, write_tensorboard(engine, run_id, logdir, names)
    write = write_csv if fmt == "csv" else write_json
    if out is None:
        import sys
        return None, write(engine, run_id, sys.stdout, names)
    with open(out, "w", newline="") as fh:
        return out, write(engine, run_id, fh, names)

