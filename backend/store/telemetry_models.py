"""Telemetry tables: metric samples, worker events, alerts, acknowledged offsets, rank placement.

Declarations only; `backend.telemetry.ingest.Ingestor` is the one writer. Metric names carry their unit
(`gpu/util_pct`, `gpu/mem_used_gib`, `train/loss`, `rank/collective_wait_s`). `gpu` and `rank` use
-1 for "not per GPU" / "not per rank" so that they can sit in indexes and GROUP BYs without NULLs.
`attempt` is the run's attempt whose agent delivered the row (NULL: recorded before attempts were);
a resume repeats steps past its checkpoint, and `backend.telemetry.query.current` hides the
earlier attempt's rows of those steps.
"""
from __future__ import annotations

from sqlalchemy import Column, Index, Text, UniqueConstraint
from sqlalchemy.engine import Engine
from sqlmodel import Field, SQLModel

from backend.store.db import create_tables

NO_INDEX = -1


class MetricSample(SQLModel, table=True):
    """One value of one series at one time. `res_s` is 0 for a raw sample; after downsampling it
    is the width of the bucket whose mean the row holds."""

    __tablename__ = "telemetry_sample"
    __table_args__ = (Index("ix_telemetry_sample_run_name_t", "run_id", "name", "t"),)

    id: int | None = Field(default=None, primary_key=True)
    run_id: str
    node: str
    gpu: int = NO_INDEX
    rank: int = NO_INDEX
    name: str
    t: float
    value: float | None = None  # None where the source value was NaN/inf or missing
    step: int | None = None
    res_s: float = 0.0
    attempt: int | None = None


class RunEvent(SQLModel, table=True):
    """One line of a worker's `events/rank-<N>.jsonl`, stored exactly once: (run, file, offset) is
    unique, where `offset` is the byte offset just after the line."""

    __tablename__ = "telemetry_event"
    __table_args__ = (
        UniqueConstraint("run_id", "file", "offset", name="uq_telemetry_event_line"),
        Index("ix_telemetry_event_run_t", "run_id", "t"),
        # the latest event of a type (progress), a run's starts (which steps a resume redid)
        Index("ix_telemetry_event_run_type_t", "run_id", "type", "t"),
    )

    id: int | None = Field(default=None, primary_key=True)
    run_id: str
    node: str
    rank: int = NO_INDEX
    file: str
    offset: int
    type: str
    t: float
    data: str = Field(sa_column=Column(Text, nullable=False))  # the event object as JSON
    step: int | None = None  # the event's `step`, where it has one
    attempt: int | None = None


class Alert(SQLModel, table=True):
    """A fired alert rule. `key` identifies the condition within the run, so a rule that keeps
    firing on the same condition updates `last_t`/`count` instead of adding rows."""

    __tablename__ = "telemetry_alert"
    __table_args__ = (UniqueConstraint("run_id", "key", name="uq_telemetry_alert_key"),)

    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(index=True)
    key: str
    rule: str
    severity: str  # "warning" | "error"
    t: float
    last_t: float
    count: int = 1
    message: str = Field(sa_column=Column(Text, nullable=False))
    node: str | None = None
    rank: int | None = None
    gpu: int | None = None
    detail: str | None = Field(default=None, sa_column=Column(Text))  # e.g. the log line


class IngestOffset(SQLModel, table=True):
    """Byte offset up to which a run file's lines are committed. Keyed by (run, file) rather than
    (run, node, file): event files may sit on a directory shared by all nodes, and then two
    agents deliver the same line; the first one wins. `node` is the node that delivered last."""

    __tablename__ = "telemetry_offset"

    run_id: str = Field(primary_key=True)
    file: str = Field(primary_key=True)  # relative to the run directory, e.g. events/rank-0.jsonl
    offset: int = 0
    node: str = ""


class RankPlacement(SQLModel, table=True):
    """Where a rank runs, as its node's agent saw it (worker environment), so alerts can name the
    node and GPU of a rank."""

    __tablename__ = "telemetry_rank"

    run_id: str = Field(primary_key=True)
    rank: int = Field(primary_key=True)
    node: str
    local_rank: int | None = None
    gpu: int | None = None
    pid: int | None = None


TELEMETRY_TABLES = [m.__table__ for m in (MetricSample, RunEvent, Alert, IngestOffset, RankPlacement)]


def create_telemetry_tables(engine: Engine) -> None:
    """Create the telemetry tables if missing and add the columns and indexes an older version
    lacked (idempotent; db.py may also create them)."""
    create_tables(engine, TELEMETRY_TABLES)
