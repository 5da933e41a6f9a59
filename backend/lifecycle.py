"""The run state machine and its persistence.

created → checking → launching → running → succeeded / failed / stopped. A resume starts a new
attempt of the same run from stopped or failed (back to checking). Every change goes through
`transition`, which refuses moves the machine does not allow.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from backend.models import Attempt, NodeProcess, Run

CREATED, CHECKING, LAUNCHING, RUNNING = "created", "checking", "launching", "running"
SUCCEEDED, FAILED, STOPPED = "succeeded", "failed", "stopped"
ACTIVE = (CHECKING, LAUNCHING, RUNNING)
FINAL = (SUCCEEDED, FAILED, STOPPED)

TRANSITIONS: dict[str, tuple[str, ...]] = {
    CREATED: (CHECKING, FAILED, STOPPED),
    CHECKING: (LAUNCHING, FAILED, STOPPED),
    LAUNCHING: (RUNNING, FAILED, STOPPED),
    RUNNING: (SUCCEEDED, FAILED, STOPPED),
    # A resume is a new attempt of a finished run.
    FAILED: (CHECKING,),
    STOPPED: (CHECKING,),
    SUCCEEDED: (),
}


class TransitionError(Exception):
    pass


def check_transition(current: str, new: str) -> None:
    if new not in TRANSITIONS.get(current, ()):
        raise TransitionError(f"a run cannot go from {current} to {new}")


@dataclass(frozen=True)
class Failure:
    """Why an attempt failed, for the UI: the node, its exit code, the cause and the last lines."""

    node: str | None
    exit_code: int | None
    cause: str
    message: str
    log_tail: str = ""


Row = TypeVar("Row", Run, NodeProcess)


def _record(row: Run | Attempt, failure: Failure | None) -> None:
    """Store the failure's fields on a run or attempt; None clears them."""
    row.failed_node, row.exit_code, row.cause, row.message, row.log_tail = (
        (failure.node, failure.exit_code, failure.cause, failure.message, failure.log_tail) if failure
        else (None,) * 5)


class RunStore:
    """Short sessions per unit of work; safe to call from the control loop's thread."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def _insert(self, row: Row) -> Row:
        with Session(self.engine) as s:
            s.add(row)
            s.commit()
            s.refresh(row)
            return row

    def create(self, run: Run) -> Run:
        return self._insert(run)

    def get(self, run_id: str) -> Run | None:
        with Session(self.engine) as s:
            return s.get(Run, run_id)

    def runs(self, states: tuple[str, ...] | None = None) -> list[Run]:
        with Session(self.engine) as s:
            q = select(Run).order_by(Run.created_at.desc())
            if states:
                q = q.where(Run.state.in_(states))
            return list(s.exec(q))

    def transition(self, run_id: str, new: str, failure: Failure | None = None) -> Run:
        with Session(self.engine) as s:
            run = s.get(Run, run_id)
            if run is None:
                raise KeyError(run_id)
            check_transition(run.state, new)
            run.state = new
            run.updated_at = time.time()
            attempt = self._current_attempt(s, run)
            if new == CHECKING:
                run.ended_at = None
                run.stop_requested = False
                _record(run, None)
            if new in FINAL:
                run.ended_at = run.updated_at
            if failure:
                _record(run, failure)
            if attempt is not None and new != CHECKING:
                attempt.state = new
                if new in FINAL:
                    attempt.ended_at = run.updated_at
                if failure:
                    _record(attempt, failure)
                s.add(attempt)
            s.add(run)
            s.commit()
            s.refresh(run)
            return run

    def request_stop(self, run_id: str) -> None:
        with Session(self.engine) as s:
            run = s.get(Run, run_id)
            if run is not None:
                run.stop_requested = True
                s.add(run)
                s.commit()

    def new_attempt(self, run_id: str, nodes: list[dict], resume_from: str | None) -> Attempt:
        with Session(self.engine) as s:
            run = s.get(Run, run_id)
            if run is None:
                raise KeyError(run_id)
            run.attempts += 1
            attempt = Attempt(run_id=run_id, number=run.attempts, state=CHECKING,
                              resume_from=resume_from, cluster_json=json.dumps(nodes))
            s.add(run)
            s.add(attempt)
            s.commit()
            s.refresh(attempt)
            return attempt

    def current_attempt(self, run_id: str) -> Attempt | None:
        with Session(self.engine) as s:
            run = s.get(Run, run_id)
            return self._current_attempt(s, run) if run else None

    @staticmethod
    def _current_attempt(s: Session, run: Run) -> Attempt | None:
        return s.exec(select(Attempt).where(Attempt.run_id == run.id)
                      .order_by(Attempt.number.desc())).first()

    def attempts(self, run_id: str) -> list[Attempt]:
        with Session(self.engine) as s:
            return list(s.exec(select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number)))

    def set_plan(self, attempt_id: int, plan_json: str) -> None:
        with Session(self.engine) as s:
            attempt = s.get(Attempt, attempt_id)
            attempt.plan_json = plan_json
            s.add(attempt)
            s.commit()

    def add_process(self, proc: NodeProcess) -> NodeProcess:
        return self._insert(proc)

    def update_process(self, proc_id: int, **fields) -> None:
        with Session(self.engine) as s:
            proc = s.get(NodeProcess, proc_id)
            for key, value in fields.items():
                setattr(proc, key, value)
            s.add(proc)
            s.commit()

    def processes(self, attempt_id: int) -> list[NodeProcess]:
        with Session(self.engine) as s:
            return list(s.exec(select(NodeProcess).where(NodeProcess.attempt_id == attempt_id)
                               .order_by(NodeProcess.node_rank)))
