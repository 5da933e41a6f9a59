"""Watch one attempt that runs as a Slurm job, from the login node, until the job ends.

The job's state is Slurm's (`scontrol show job`, every `WATCH_INTERVAL_S`); the nodes' agents
write their lines into the shared run directory (`telemetry/attempt-<n>/restart-<k>/<node>.jsonl`),
which this reads from the offsets it reached and hands to the telemetry sink. Once the job has
ended, the cause of a failure comes from the same files as on SSH nodes: each node's exit code
(`pids/<node>.exit`), its ranks' end slots and its log tail (`backend.runs.watch.failure_from`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from backend.cluster import remote, slurm, ssh
from backend.cluster.launch import end_slots
from backend.cluster.nodes import Pool
from backend.job.cluster import Node
from backend.runs.lifecycle import Failure
from backend.runs.watch import CAUSE_LINES, TAIL_LINES, WATCH_INTERVAL_S, Outcome, choose_root, failure_from
from backend.telemetry import logclass
from backend.telemetry.ingest import TelemetrySink

log = logging.getLogger(__name__)

CONTROLLER_SILENT_S = 120.0   # slurmctld may pause (a restart, a busy scheduler); the job runs on meanwhile
READ_MAX = 1 << 20


@dataclass
class _Tail:
    """Where the reading of one agent file has got to."""

    offset: int = 0
    partial: bytes = b""


@dataclass
class SlurmWatcher:
    pool: Pool
    login: Node
    run_id: str
    run_dir: str
    job_id: str
    attempt: int
    stop_requested: Callable[[], bool]
    on_running: Callable[[list[str]], None]
    """Called once the job runs, with its hosts (the allocation)."""
    sink: TelemetrySink | None = None
    on_notice: Callable[[str], None] = lambda message: log.warning("%s", message)
    hosts: list[str] = field(default_factory=list)
    last: slurm.JobState | None = None
    _tails: dict[str, _Tail] = field(default_factory=dict)

    async def run(self) -> Outcome | None:
        """Watch until the job ends; None when a stop was requested (the stopper records it)."""
        silent_since: float | None = None
        restarts = 0
        while True:
            if self.stop_requested():
                return None
            try:
                state = await slurm.job_state(self.pool, self.login, self.job_id)
                silent_since = None
            except (slurm.SlurmError, ssh.NodeError) as exc:
                silent_since = silent_since or time.time()
                if time.time() - silent_since >= CONTROLLER_SILENT_S:
                    return Outcome("failed", Failure(None, None, logclass.NODE_UNREACHABLE,
                                                     f"Slurm does not answer about job {self.job_id}: {exc}"))
                await asyncio.sleep(WATCH_INTERVAL_S)
                continue
            if state is not None:
                self.last = state
                if state.requeued > restarts:
                    restarts = state.requeued
                    self.on_notice(f"Slurm requeued job {self.job_id} ({state.reason or state.state}); "
                                   "it resumes from the latest checkpoint")
                # A job that ended between two looks still ran on its nodes (NodeList is kept).
                if (state.running or state.final) and not self.hosts and state.nodes:
                    self.hosts = await slurm.hostnames(self.pool, self.login, state.nodes)
                    self.on_running(self.hosts)
            await self.read_telemetry()
            if state is None or state.final:
                if self.stop_requested():
                    return None
                return await self.outcome(state or self.last)
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def read_telemetry(self) -> None:
        """Hand the agents' new complete lines to the sink."""
        if self.sink is None:
            return
        base = f"{self.run_dir}/telemetry/attempt-{self.attempt}"
        res = await self.pool.run(self.login, f"cd {shlex.quote(base)} 2>/dev/null && ls -1d -- restart-*/*.jsonl "
                                              "2>/dev/null; true", None, timeout=15)
        for rel in sorted(res.stdout.split(), key=_restart_order):
            node = rel.split("/", 1)[1][: -len(".jsonl")]
            tail = self._tails.setdefault(rel, _Tail())
            while True:
                chunk = (await self.pool.run(self.login, remote.read_from(f"{base}/{rel}", tail.offset, READ_MAX),
                                             None, timeout=30)).raw
                tail.offset += len(chunk)
                data = tail.partial + chunk
                *lines, tail.partial = data.split(b"\n")
                for line in lines:
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(obj, dict):
                        self.sink.on_agent_line(self.run_id, node, obj, attempt=self.attempt)
                if len(chunk) < READ_MAX:
                    break

    async def outcome(self, state: slurm.JobState | None) -> Outcome:
        if state is not None and state.state == "COMPLETED" and state.exit_code == 0:
            return Outcome("succeeded")
        what = f"Slurm job {self.job_id} ended {state.state if state else 'unknown to Slurm'}"
        if state is not None and state.reason:
            what += f" ({state.reason})"
        candidates = []
        slots = await self._read(end_slots(self.pool, self.login, self.run_dir), [])
        for host in self.hosts:
            paths = remote.NodePaths(self.run_dir, host)
            probe = await self._read(self.pool.run(self.login, remote.probe(None, paths), None, timeout=15), None)
            try:
                _, code = remote.parse_probe(probe.stdout) if probe else (False, None)
            except ValueError:
                code = None
            if code == 0:
                continue
            pgid_text = await self._read(self.pool.run(self.login, f"cat -- {shlex.quote(paths.pid)} 2>/dev/null; true",
                                                       None, timeout=15), None)
            pgid = int(pgid_text.stdout.strip()) if pgid_text and pgid_text.stdout.strip().isdigit() else None
            if pgid is None and code is None:
                continue  # the node's workers never started (the batch script ended before)
            tail = await self._read(self.pool.run(self.login, remote.tail(paths.log, CAUSE_LINES), None, timeout=15), None)
            ends = [e for e in slots if e.get("node") == remote.node_file_name(host) and e.get("pgid") == pgid]
            cause, failure = failure_from(host, code, tail.stdout.splitlines() if tail else [], ends)
            candidates.append((cause, failure, 0.0))
        if candidates:
            root = choose_root(candidates)
            return Outcome("failed", Failure(root.node, root.exit_code, root.cause, f"{root.message}; {what}",
                                             root.log_tail))
        # No node's workers failed: the batch script did (the import check, exit 3) or Slurm ended
        # the job (time limit, node failure, preemption).
        out = await self._read(self.pool.run(self.login, remote.tail(f"{self.run_dir}/logs/slurm-{self.job_id}.out",
                                                                     TAIL_LINES), None, timeout=15), None)
        lines = out.stdout.splitlines() if out else []
        exit_code = state.exit_code if state else None
        cause = logclass.classify_tail(lines, exit_code)
        if exit_code == 3 and any(slurm.IMPORT_CHECK_FAILED in line for line in lines):
            cause = logclass.Cause(logclass.COMMAND_NOT_FOUND,
                                   f"slurm.python does not import the worker on a node of the allocation "
                                   f"(logs/slurm-{self.job_id}.out)")
        elif cause.kind == logclass.UNKNOWN and state is not None and state.state != "FAILED":
            cause = logclass.Cause(logclass.KILLED, what)
        return Outcome("failed", Failure(None, exit_code, cause.kind, f"{logclass.describe(cause)}; {what}",
                                         "\n".join(lines)))

    @staticmethod
    async def _read(coro, default):
        try:
            return await coro
        except ssh.NodeError:
            return default


def _restart_order(rel: str) -> tuple[int, str]:
    head, _, name = rel.partition("/")
    number = head.removeprefix("restart-")
    return (int(number) if number.isdigit() else 0, name)

