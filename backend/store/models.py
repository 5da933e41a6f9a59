"""Control-plane tables: runs, their attempts and notices, the node inventory and the processes on nodes."""
from __future__ import annotations

import time

from sqlmodel import Field, SQLModel


class FailureColumns(SQLModel):
    """Why an attempt failed (a run copies its failing attempt's): which node, exit code,
    classified cause, message and last log lines."""

    failed_node: str | None = None
    exit_code: int | None = None
    cause: str | None = None
    message: str | None = None
    log_tail: str | None = None


class Run(FailureColumns, table=True):
    """One training job. State follows `backend.runs.lifecycle`; a resume adds an `Attempt`."""

    id: str = Field(primary_key=True)
    name: str
    state: str = Field(default="created", index=True)
    spec_yaml: str
    output_dir: str
    run_dir: str
    # The token in the run directory's claim marker (backend.cluster.launch.CLAIM_FILE): the
    # directory is this run's only while the marker holds it. None: a run from before claims.
    dir_claim: str | None = None
    attempts: int = 0
    stop_requested: bool = False
    # The manager driving the run (`lifecycle.Owner.id`: host, pid, token) and when it last said
    # so; a manager takes over only a run whose owner is gone (`lifecycle.owner_gone`).
    owner: str | None = None
    heartbeat_at: float | None = None
    created_at: float = Field(default_factory=time.time)
    updated_at: float = Field(default_factory=time.time)
    ended_at: float | None = None


class Attempt(FailureColumns, table=True):
    """One launch of a run on a set of nodes (the first launch or a resume)."""

    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="run.id", index=True)
    number: int
    state: str = "created"
    resume_from: str | None = None
    automatic: bool = False    # started by automatic recovery (backend.runs.recovery), not by a user
    cluster_json: str = "[]"   # the nodes (address, slots, setup) this attempt ran on
    plan_json: str = "{}"
    slurm_json: str | None = None  # a Slurm attempt: {"target": SlurmTarget.to_dict(), "job_id": id or null}
    started_at: float = Field(default_factory=time.time)
    ended_at: float | None = None


class RunNotice(SQLModel, table=True):
    """What the process driving a run told about it (an automatic restart and why, a Slurm job
    submitted, a node not answering): stored, so that every process shows it, not only that one."""

    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="run.id", index=True)
    at: float = Field(default_factory=time.time)
    message: str


class NodeProcess(SQLModel, table=True):
    """The torchrun process group of one attempt on one node."""

    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="run.id", index=True)
    attempt_id: int = Field(foreign_key="attempt.id", index=True)
    node: str
    node_rank: int
    pgid: int | None = None
    state: str = "starting"    # starting / running / exited / unreachable / gone
    exit_code: int | None = None
    started_at: float = Field(default_factory=time.time)
    ended_at: float | None = None
    last_seen: float | None = None
    # When the node first did not answer, kept until it answers again: a watch that starts later
    # (another CLI call, a studio restarted) counts the node's silence from here, not from itself.
    unreachable_since: float | None = None


class NodeRecord(SQLModel, table=True):
    """A node of the inventory, the one list of nodes (the studio's Cluster tab, `backend.cluster.nodes`):
    `backend.job.cluster.Node` fields plus the node's setup line. No passwords: keys by path."""

    __tablename__ = "node"
    id: int | None = Field(default=None, primary_key=True)
    host: str = Field(unique=True, index=True)
    slots: int = 1
    addr: str | None = None
    ssh_user: str | None = None
    ssh_port: int = 22
    ssh_key: str | None = None
    python: str = "python3"
    device: str = "cuda"
    local: bool = False
    gpu_mem_gib: float | None = None
    host_mem_gib: float | None = None
    setup: str | None = None
    position: int | None = None
    """The node's place in the cluster (the first is the rendezvous node); rows from before it by id."""
    created_at: float = Field(default_factory=time.time)


class HostKeyTrust(SQLModel, table=True):
    """An explicit decision to trust a node's host key (who trusted what, when, and where)."""

    id: int | None = Field(default=None, primary_key=True)
    host: str
    port: int
    fingerprint: str
    known_hosts: str
    trusted_at: float = Field(default_factory=time.time)
