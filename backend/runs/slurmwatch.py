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
from dataclasses import dataclass, field, replace

from backend.cluster import allocation, preflight, remote, slurm, ssh
from backend.cluster.launch import end_slots
from backend.cluster.nodes import Pool
from backend.job.cluster import Node
from backend.runs.lifecycle import Failure
from backend.runs.watch import (CAUSE_LINES, TAIL_LINES, WATCH_INTERVAL_S, Outcome, agent_record,
                                ask_flight_recorders, choose_root, ends_of, failure_from)
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
    """Called once the job runs, with its hosts (the allocation), and again after each requeue."""
    sink: TelemetrySink | None = None
    on_notice: Callable[[str], None] = lambda message: log.warning("%s", message)
    hosts: list[str] = field(default_factory=list)
    last: slurm.JobState | None = None
    first_pass: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once Slurm has answered about the job (or the watch ended): the state shown is current."""
    running_since: float | None = None
    """When this watch first saw the job run, or Slurm last requeued it: its hang limit counts from
    here until its first step."""
    _tails: dict[str, _Tail] | None = None
    """Where the reading of each agent file has got to; from the sink's committed offsets at first."""

    async def run(self) -> Outcome | None:
        """Watch until the job ends; None when a stop was requested (the stopper records it)."""
        try:
            return await self._watch()
        finally:
            self.first_pass.set()

    async def _watch(self) -> Outcome | None:
        silent_since: float | None = None
        restarts: int | None = None  # the requeues seen; a re-attached watch takes the earlier ones as seen
        looked = False  # whether this watch has read the job's nodes from Slurm (the stored ones may be old)
        while True:
            if self.stop_requested():
                return None
            try:
                state = await slurm.job_state(self.pool, self.login, self.job_id)
                silent_since = None
            except (slurm.SlurmError, ssh.NodeError) as exc:
                silent_since = silent_since or time.time()
                if time.time() - silent_since >= CONTROLLER_SILENT_S:
                    return await self._silent(exc)
                await asyncio.sleep(WATCH_INTERVAL_S)
                continue
            if state is not None:
                self.last = state
                self.first_pass.set()
                if restarts is None:
                    restarts = state.requeued
                elif state.requeued > restarts:
                    # Slurm may start it again on other nodes: they are read again once it runs.
                    restarts, self.running_since, self.hosts = state.requeued, None, []
                    self.on_notice(f"Slurm requeued job {self.job_id} ({state.reason or state.state}); "
                                   "it resumes from the latest checkpoint")
                # A job that ended between two looks still ran on its nodes (NodeList is kept). While a
                # requeued job completes, NodeList still names the nodes it is leaving.
                if (state.state == "RUNNING" or state.final) and state.nodes and not (looked and self.hosts):
                    hosts, looked = await slurm.hostnames(self.pool, self.login, state.nodes), True
                    if hosts != self.hosts:
                        self.hosts = hosts
                        self.on_running(hosts)
            await self._read_telemetry_guarded()
            if state is not None and state.state != "RUNNING":
                # Suspended (preempted, an admin's `scontrol suspend`), completing, pending: its ranks
                # cannot step; the hang limit counts again from when it runs.
                self.running_since = None
            elif state is not None and self.sink is not None:
                self.running_since = self.running_since or time.time()
                hung = self.sink.hang(self.run_id, self.running_since)
                outcome = await self._hung(hung) if hung is not None and not self.stop_requested() else None
                if outcome is not None:
                    return outcome
            if state is None or state.final:
                if self.stop_requested():
                    return None
                return await self.outcome(state or self.last)
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def _silent(self, exc: Exception) -> Outcome:
        """The controller has not answered for CONTROLLER_SILENT_S: the job may still run."""
        what = f"Slurm did not answer about job {self.job_id} for {CONTROLLER_SILENT_S:.0f} s ({exc})"
        return await self._cancelled(Failure(None, None, logclass.NODE_UNREACHABLE, what))

    async def _hung(self, finding) -> Outcome | None:
        """The ranks made no step within the job's hang limit (the same rule as on SSH nodes): the
        job is cancelled (none of its ranks can reach the step boundary a checkpoint needs). None: a
        step came while the ranks were asked, and the watch goes on."""
        finding = await ask_flight_recorders(self.pool, [(self.login, None)], self.run_dir, self.sink, self.run_id,
                                             self.running_since or time.time(), finding,
                                             read=self._read_telemetry_guarded)
        if finding is None:
            return None
        self.sink.stopping_hung(self.run_id, self.attempt, finding)
        cause = logclass.Cause(logclass.HANG, finding.message, finding.rank)
        return await self._cancelled(Failure(finding.node, None, logclass.HANG, logclass.describe(cause, finding.node)))

    async def _cancelled(self, failure: Failure) -> Outcome:
        """Cancel the job, then fail the attempt with `failure`. Only a job Slurm confirms ended
        keeps a cause a restart may cure: a new job must not share the run directory with a live
        one, so where the cancel fails the cause becomes one no restart follows."""
        try:
            await slurm.cancel(self.pool, self.login, self.job_id)
        except (slurm.SlurmError, ssh.NodeError) as again:
            return Outcome("failed", Failure(failure.node, None, logclass.UNKNOWN,
                                             f"{failure.message}, and cancelling it failed ({again}): it may still "
                                             f"run; check `squeue -j {self.job_id}` before resuming"))
        return Outcome("failed", replace(failure, message=f"{failure.message}; cancelled Slurm job {self.job_id}"))

    async def _read_telemetry_guarded(self) -> None:
        """The agents' lines, as on SSH nodes: a read or store failure is a notice, and the next
        round reads again from the offsets reached (the sink takes an event line once)."""
        try:
            await self.read_telemetry()
        except Exception as exc:  # noqa: BLE001 - the shell or the store failed; the job runs on
            log.exception("reading telemetry of job %s failed", self.job_id)
            self.on_notice(f"telemetry of Slurm job {self.job_id} could not be read or stored "
                           f"({type(exc).__name__}: {exc}); retrying")

    async def read_telemetry(self) -> None:
        """Hand the agents' new complete lines to the sink, each with where it was read (so a
        watch of the same job that starts again, after a re-attach, goes on from the offsets the
        sink committed and stores nothing twice)."""
        if self.sink is None:
            return
        files = f"telemetry/attempt-{self.attempt}/"
        if self._tails is None:
            self._tails = {name.removeprefix(files): _Tail(offset)
                           for name, offset in self.sink.read_offsets(self.run_id, files).items()}
        res = await self.pool.run(self.login, f"cd {shlex.quote(self.run_dir + '/' + files)} 2>/dev/null && "
                                              "ls -1d -- restart-*/*.jsonl 2>/dev/null; true", None, timeout=15)
        for rel in sorted(res.stdout.split(), key=_restart_order):
            node = rel.split("/", 1)[1][: -len(".jsonl")]
            tail = self._tails.setdefault(rel, _Tail())
            while True:
                chunk = (await self.pool.run(self.login, remote.read_from(f"{self.run_dir}/{files}{rel}", tail.offset,
                                                                          READ_MAX), None, timeout=30)).raw
                *lines, partial = (tail.partial + chunk).split(b"\n")
                end = tail.offset - len(tail.partial)
                for line in lines:
                    end += len(line) + 1
                    obj = agent_record(line)
                    if obj is not None:
                        self.sink.on_agent_line(self.run_id, node, obj, attempt=self.attempt, read=(files + rel, end))
                # Moved on only once the sink took every line of the chunk.
                tail.offset, tail.partial = tail.offset + len(chunk), partial
                if len(chunk) < READ_MAX:
                    break

    async def outcome(self, state: slurm.JobState | None) -> Outcome:
        if state is not None and state.state == "COMPLETED" and state.exit_code == 0:
            return Outcome("succeeded")
        what = f"Slurm job {self.job_id} ended {state.state if state else 'unknown to Slurm'}"
        if state is not None and state.reason:
            what += f" ({state.reason})"
        candidates = []
        codes = []
        slots = await self._read(end_slots(self.pool, self.login, self.run_dir), [])
        for host in self.hosts:
            paths = remote.NodePaths(self.run_dir, host)
            probe = await self._read(self.pool.run(self.login, remote.probe(None, paths), None, timeout=15), None)
            try:
                _, code = remote.parse_probe(probe.stdout) if probe else (False, None)
            except ValueError:
                code = None
            codes.append(code)
            if code == 0:
                continue
            pgid_text = await self._read(self.pool.run(self.login, f"cat -- {shlex.quote(paths.pid)} 2>/dev/null; true",
                                                       None, timeout=15), None)
            pgid = int(pgid_text.stdout.strip()) if pgid_text and pgid_text.stdout.strip().isdigit() else None
            if pgid is None and code is None:
                continue  # the node's workers never started (the batch script ended before)
            tail = await self._read(self.pool.run(self.login, remote.tail(paths.log, CAUSE_LINES), None, timeout=15), None)
            cause, failure = failure_from(host, code, tail.stdout.splitlines() if tail else [],
                                          ends_of(host, pgid, slots))
            candidates.append((cause, failure, 0.0))
        if state is None and codes and all(code == 0 for code in codes):
            # Slurm forgot the job (MinJobAge after its end, a studio down for long): every
            # node's workers exited 0, which is the outcome.
            return Outcome("succeeded")
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
        if exit_code == 3 and any(slurm.PREFLIGHT_FAILED in line for line in lines):
            cause = await self._preflight_cause(lines)
        elif exit_code == 3 and any(slurm.IMPORT_CHECK_FAILED in line for line in lines):
            cause = logclass.Cause(logclass.COMMAND_NOT_FOUND,
                                   f"slurm.python does not import the worker on a node of the allocation "
                                   f"(logs/slurm-{self.job_id}.out)")
        elif cause.kind == logclass.UNKNOWN and state is not None and state.state != "FAILED":
            cause = logclass.Cause(logclass.KILLED, what)
        return Outcome("failed", Failure(None, exit_code, cause.kind, f"{logclass.describe(cause)}; {what}",
                                         "\n".join(lines)))

    async def _preflight_cause(self, lines: list[str]) -> logclass.Cause:
        """What the pre-flight inside the allocation found (its report.json), each error with its
        node and fix; a missing package is a command not found, anything else the job's setup."""
        path = f"{allocation.report_dir(self.run_dir, self.attempt)}/report.json"
        out = await self._read(self.pool.run(self.login, f"cat -- {shlex.quote(path)} 2>/dev/null; true", None,
                                             timeout=15), None)
        try:
            errors = [r for r in json.loads(out.stdout)["results"] if r["status"] == "error"] if out else []
        except (ValueError, KeyError, TypeError):
            errors = []
        if not errors:  # the probe or the judge did not run (no python there, no swift-studio)
            return logclass.Cause(logclass.COMMAND_NOT_FOUND,
                                  f"the pre-flight could not run on the allocation (slurm.python, swift-studio "
                                  f"installed there?): {logclass.classify_tail(lines).summary} "
                                  f"(logs/slurm-{self.job_id}.out)")
        text = "; ".join(f"{r['node']} {r['check']}: {r['reason']}" + (f" (fix: {r['fix']})" if r.get("fix") else "")
                         for r in errors[:6])
        missing = any(r["check"] in preflight.PACKAGES or r["check"] == "python" for r in errors)
        return logclass.Cause(logclass.COMMAND_NOT_FOUND if missing else logclass.CONFIG_ERROR,
                              f"the pre-flight inside the allocation failed: {text} ({path})")

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

