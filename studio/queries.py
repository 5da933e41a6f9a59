"""Run progress and checkpoints from the stored worker events (latest `train`, `start` and
`checkpoint` events of a run).

Stopgap until the facade offers them: `RunManager` has no progress or checkpoint list yet (proposed in
docs/architecture.md as `progress(run_id)` and `checkpoints(run_id)`); this reads the telemetry table the
ingestor writes, read-only, and moves into backend/ when those methods land.
"""
from __future__ import annotations

import json
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Engine

from backend.telemetry_models import RunEvent

E = RunEvent.__table__


def _latest(conn, run_id: str, etype: str) -> dict[str, Any] | None:
    row = conn.execute(select(E.c.data).where(E.c.run_id == run_id, E.c.type == etype)
                       .order_by(E.c.t.desc(), E.c.id.desc()).limit(1)).first()
    return json.loads(row[0]) if row else None


def progress(engine: Engine, run_id: str) -> dict[str, Any] | None:
    """step, max_steps, eta_s, loss, tokens_per_s of the latest train event; resumed_from of the
    latest start event. None before the first event."""
    with engine.connect() as conn:
        train = _latest(conn, run_id, "train")
        start = _latest(conn, run_id, "start")
    if train is None and start is None:
        return None
    out: dict[str, Any] = {"resumed_from": (start or {}).get("resumed_from"),
                           "max_steps": (train or start or {}).get("max_steps")}
    if train:
        out.update({k: train.get(k) for k in ("step", "eta_s", "loss", "tokens_per_s", "epoch")})
        out["t"] = train.get("time")
    return out


def checkpoints(engine: Engine, run_id: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint event of the run, newest first (all attempts)."""
    with engine.connect() as conn:
        rows = conn.execute(select(E.c.data).where(E.c.run_id == run_id, E.c.type == "checkpoint")
                            .order_by(E.c.t.desc())).all()
    seen: dict[int, str] = {}
    for (data,) in rows:
        event = json.loads(data)
        if isinstance(event.get("step"), int):
            seen.setdefault(event["step"], str(event.get("path")))
    return sorted(seen.items(), reverse=True)
