"""The run state machine and its persistence.

created → checking → launching → running → succeeded / failed / stopped. A resume starts a new
attempt of the same run from stopped or failed (back to checking). Every change goes through
`transition`, which refuses moves the machine does not allow and is a compare-and-set in the
database: several processes (the studio, CLI commands) share it, and a move made from a state
that another process has changed meanwhile is refused, never written over the other's.

Each active run has one owner, the manager that drives it; it refreshes `heartbeat_at` every
HEARTBEAT_S. Another manager takes a run over (`claim`) only once `owner_gone` says so.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy import update
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from backend.store.models import Attempt, NodeProcess, Run, RunNotice

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


HEARTBEAT_S = 2.0
# Five missed beats: the control loop can stall for seconds (SQLite's busy wait, a slow planner),
# and taking a run from a live owner is far worse than adopting an orphan a little late.
OWNER_TIMEOUT_S = 5 * HEARTBEAT_S

R, A = Run.__table__, Attempt.__table__


class TransitionError(Exception):
    """A move the state machine does not allow, or one that lost a race with another process."""


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


def attempt_timeline(attempts: list[Attempt]) -> list[str]:
    """One line per attempt, oldest first: how it started (launch, resume, automatic restart), when,
    how it ended and why; what the Monitor and `swift-studio status` show of a run's attempts."""
    def clock(t: float | None) -> str:
        return time.strftime("%H:%M:%S", time.localtime(t)) if t else "…"

    lines = []
    for a in attempts:
        how = ("automatic restart" if a.automatic else "resume" if a.resume_from else "launch")
        job_id = json.loads(a.slurm_json).get("job_id") if a.slurm_json else None
        if job_id:
            how += f", Slurm job {job_id}"
        line = f"attempt {a.number} ({how}, {clock(a.started_at)}–{clock(a.ended_at)}): {a.state}"
        if a.cause:
            where = f" on node {a.failed_node}" if a.failed_node else ""
            line += f", {a.cause.replace('_', ' ')}{where}"
        lines.append(line)
    return lines


def attempt_history(attempts: list[Attempt]) -> list[tuple[str, str | None]]:
    """`attempt_timeline`'s lines, each with its failed attempt's message (the diagnosis: which
    node, rank and collective), as `swift-studio status` and the Monitor show them."""
    return [(line, a.message if a.state == FAILED and a.message else None)
            for a, line in zip(attempts, attempt_timeline(attempts))]


@dataclass(frozen=True)
class Owner:
    """A manager: its host, its process and a token (one process may hold several managers)."""

    host: str
    pid: int
    token: str

    @property
    def id(self) -> str:
        return f"{self.host}:{self.pid}:{self.token}"

    @classmethod
    def parse(cls, owner_id: str) -> "Owner":
        host, pid, token = owner_id.rsplit(":", 2)
        return cls(host, int(pid), token)

    @classmethod
    def this_process(cls) -> "Owner":
        return cls(socket.gethostname(), os.getpid(), secrets.token_hex(4))


def owner_gone(run: Run, now: float, here: str, pid_alive: Callable[[int], bool]) -> bool:
    """Whether nobody drives the run: no owner, no heartbeat for OWNER_TIMEOUT_S, or an owner on
    this host whose process has ended (known at once, without waiting for the heartbeat)."""
    if run.owner is None or run.heartbeat_at is None or now - run.heartbeat_at > OWNER_TIMEOUT_S:
        return True
    owner = Owner.parse(run.owner)
    return owner.host == here and not pid_alive(owner.pid)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


Row = TypeVar("Row", Run, NodeProcess)


def _failure_values(failure: Failure | None) -> dict:
    """The failure's columns of a run or attempt; None clears them."""
    values = ((failure.node, failure.exit_code, failure.cause, failure.message, failure.log_tail) if failure
              else (None,) * 5)
    return dict(zip(("failed_node", "exit_code", "cause", "message", "log_tail"), values))


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

    def transition(self, run_id: str, new: str, failure: Failure | None = None, by: Owner | None = None) -> Run:
        """Move the run from the state it is in now to `new`, if no other process moves it first
        (and, with `by`, only while `by` still owns it); a lost race raises TransitionError and
        changes nothing. CHECKING starts an attempt, and `by` becomes the run's owner."""
        run = self.get(run_id)
        if run is None:
            raise KeyError(run_id)
        check_transition(run.state, new)
        now = time.time()
        # the attempt's part; a new attempt's row is added after this (`new_attempt`)
        attempt = {"state": new, **({"ended_at": now} if new in FINAL else {}),
                   **(_failure_values(failure) if failure else {})}
        changes = {**attempt, "updated_at": now}
        cond = [R.c.id == run_id, R.c.state == run.state]
        if new == CHECKING:
            changes.update(ended_at=None, stop_requested=False, **_failure_values(None))
            if by is not None:
                changes.update(owner=by.id, heartbeat_at=now)
        elif by is not None:
            cond.append(R.c.owner == by.id)
        with self.engine.begin() as conn:
            won = conn.execute(update(R).where(*cond).values(changes)).rowcount == 1
            if won and new != CHECKING:
                conn.execute(update(A).where(A.c.run_id == run_id, A.c.number == run.attempts).values(attempt))
        if not won:
            now_run = self.get(run_id)
            who = f", driven by {now_run.owner}" if now_run.owner and now_run.owner != getattr(by, "id", None) else ""
            raise TransitionError(f"run {run_id} changed while moving it from {run.state} to {new}: it is "
                                  f"{now_run.state}{who} now; left as it is")
        return self.get(run_id)

    def claim(self, run: Run, by: Owner, now: float) -> bool:
        """Take over a run whose owner is gone, if it is still as `run` shows it (state, owner,
        heartbeat): of two managers adopting it, one wins."""
        cond = [R.c.id == run.id, R.c.state == run.state, R.c.owner.is_not_distinct_from(run.owner),
                R.c.heartbeat_at.is_not_distinct_from(run.heartbeat_at)]
        with self.engine.begin() as conn:
            return conn.execute(update(R).where(*cond).values(owner=by.id, heartbeat_at=now)).rowcount == 1

    def heartbeat(self, by: Owner, now: float) -> None:
        """`by` still drives its active runs."""
        with self.engine.begin() as conn:
            conn.execute(update(R).where(R.c.owner == by.id, R.c.state.in_(ACTIVE)).values(heartbeat_at=now))

    def release(self, by: Owner) -> None:
        """`by` stops driving its active runs (they keep running on their nodes): another manager
        may adopt them at once instead of waiting for the heartbeat to expire."""
        with self.engine.begin() as conn:
            conn.execute(update(R).where(R.c.owner == by.id, R.c.state.in_(ACTIVE))
                         .values(owner=None, heartbeat_at=None))

    def request_stop(self, run_id: str) -> None:
        with Session(self.engine) as s:
            run = s.get(Run, run_id)
            if run is not None:
                run.stop_requested = True
                s.add(run)
                s.commit()

    def new_attempt(self, run_id: str, nodes: list[dict], resume_from: str | None, automatic: bool = False,
                    slurm_json: str | None = None) -> Attempt:
        with Session(self.engine) as s:
            run = s.get(Run, run_id)
            if run is None:
                raise KeyError(run_id)
            run.attempts += 1
            attempt = Attempt(run_id=run_id, number=run.attempts, state=CHECKING,
                              resume_from=resume_from, automatic=automatic, cluster_json=json.dumps(nodes),
                              slurm_json=slurm_json)
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

    def active_attempts(self) -> list[tuple[Run, Attempt]]:
        """The current attempt of every run that is checking, launching or running."""
        with Session(self.engine) as s:
            active = s.exec(select(Run).where(Run.state.in_(ACTIVE))).all()
            return [(run, attempt) for run in active if (attempt := self._current_attempt(s, run)) is not None]

    def attempts(self, run_id: str) -> list[Attempt]:
        with Session(self.engine) as s:
            return list(s.exec(select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number)))

    def set_spec(self, run_id: str, spec_yaml: str) -> None:
        """The job as its later attempts run it (automatic recovery re-planned it without a node)."""
        with self.engine.begin() as conn:
            conn.execute(update(R).where(R.c.id == run_id).values(spec_yaml=spec_yaml, updated_at=time.time()))

    def set_plan(self, attempt_id: int, plan_json: str) -> None:
        self.update_attempt(attempt_id, plan_json=plan_json)

    def update_attempt(self, attempt_id: int, **fields) -> None:
        with Session(self.engine) as s:
            attempt = s.get(Attempt, attempt_id)
            for key, value in fields.items():
                setattr(attempt, key, value)
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

    def add_notice(self, run_id: str, message: str) -> None:
        self._insert(RunNotice(run_id=run_id, message=message))

    def notices(self, run_id: str, last: int) -> list[RunNotice]:
        """The run's `last` notices, oldest first."""
        with Session(self.engine) as s:
            newest = s.exec(select(RunNotice).where(RunNotice.run_id == run_id)
                            .order_by(RunNotice.id.desc()).limit(last))
            return list(reversed(list(newest)))
