"""Automatic recovery: whether a failed attempt is restarted from the newest checkpoint, and on
which nodes. Pure: the driver passes the run's attempts (the failed one last) and what the failed
attempt achieved; it re-plans, checks and starts what this decides.

A restart is tried only for causes a new attempt can cure (`logclass.RESTARTABLE`), within the
job's `max_restarts` since the last launch or manual resume, and not after a restarted attempt that
failed again before making a step (the restart did not cure it). A node that failed twice is left
out when other nodes remain; whether the job still fits them is the validator's call."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from backend.job.cluster import Node
from backend.job.spec import JobSpec
from backend.store.models import Attempt
from backend.telemetry import logclass

NODE_FAILURES_TO_LEAVE_OUT = 2


@dataclass(frozen=True)
class Restart:
    number: int
    """This restart's number since the last launch or manual resume (1 = the first)."""
    nodes: tuple[tuple[Node, str | None], ...]
    """The next attempt's nodes with their setup lines, in rank order (none: the scheduler's to pick)."""
    left_out: str | None = None
    """The node left out for failing twice, if one was."""


@dataclass(frozen=True)
class NoRestart:
    why: str


def decide(spec: JobSpec, attempts: list[Attempt], members: list[tuple[Node, str | None]] | None,
           progressed: bool) -> Restart | NoRestart | None:
    """What to do after the last of `attempts` failed on `members`; `progressed`: whether it logged a
    training step. None where recovery is off for the job. `members` None: a scheduler (Slurm)
    picks the next attempt's nodes, so a node that failed twice is only named (to exclude), and
    whether enough nodes remain is the partition's to say when the job is submitted."""
    if spec.max_restarts <= 0 or not attempts:
        return None
    failed = attempts[-1]
    cause = failed.cause or logclass.UNKNOWN
    if cause not in logclass.RESTARTABLE:
        return NoRestart(f"{cause.replace('_', ' ')} is not cured by a restart")
    chain = _since_last_user_start(attempts)
    used = sum(a.automatic for a in chain)
    if used >= spec.max_restarts:
        return NoRestart(f"the {spec.max_restarts} automatic restart{'s' if spec.max_restarts > 1 else ''} "
                         "(max_restarts) are used up")
    if failed.automatic and not progressed:
        return NoRestart("the restarted attempt failed again before its first step: a restart does not cure it")
    failures = Counter(a.failed_node for a in chain if a.failed_node and (a.cause or "") in logclass.RESTARTABLE)
    left_out = failed.failed_node if failures[failed.failed_node] >= NODE_FAILURES_TO_LEAVE_OUT else None
    if members is None:
        return Restart(used + 1, (), left_out)
    nodes = tuple((n, s) for n, s in members if n.host != left_out)
    if not nodes:
        return NoRestart(f"node {left_out} failed {failures[left_out]} times and no other node is left")
    return Restart(used + 1, nodes, left_out)


def _since_last_user_start(attempts: list[Attempt]) -> list[Attempt]:
    """The attempts from the last one a user started (launch or resume) on."""
    users = [i for i, a in enumerate(attempts) if not a.automatic]
    return attempts[users[-1]:] if users else attempts
