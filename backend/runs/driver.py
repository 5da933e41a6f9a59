"""Driving a run's attempts on its nodes, on the run manager's event loop: the checks before
anything starts, the launch, the watch until the workers end, a stop, and the re-attach of runs
whose manager went away. Every state change goes through the run store's compare-and-set, so
several drivers (in other processes) can meet on one run. `backend.runs.manager.RunManager`
owns one and calls it from its blocking methods."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml
from sqlalchemy.engine import Engine

from backend.cluster import admission, nodes, slurm, ssh
from backend.cluster import launch as launch_ops
from backend.cluster.launch import NodeCommand, Started
from backend.job.cluster import Cluster, Node
from backend.cluster.preflight import DISK_ERROR_GIB
from backend.cluster.slurm import SlurmTarget
from backend.job.planner import DEFAULT_MASTER_PORT, Plan
from backend.job.spec import JobSpec
from backend.job.validate import Assessment, assess
from backend.runs import lifecycle, recovery
from backend.runs.lifecycle import Failure, Owner, RunStore, TransitionError
from backend.runs.slurmwatch import SlurmWatcher
from backend.runs.watch import AttemptWatcher, NodeWatch, Outcome
from backend.store.models import Attempt, NodeProcess, Run
from backend.telemetry import trackers
from backend.telemetry import logclass
from backend.telemetry.ingest import TelemetrySink

log = logging.getLogger(__name__)


class RunError(Exception):
    """A request the manager cannot carry out (unknown run, wrong state); the message says why."""


@dataclass(frozen=True)
class PlanRequest:
    run_id: str
    run_dir: str
    master_port: int
    resume: str | None          # None, "latest" or a checkpoint directory
    assessment: Assessment | None = None
    """The job's assessment on this cluster (model config, DeepSpeed config, memory estimate)."""


Planner = Callable[[JobSpec, Cluster, PlanRequest], Plan]


def default_planner(spec: JobSpec, cluster: Cluster, req: PlanRequest) -> Plan:
    """`backend.job.planner.plan` for a launch request, from the job's assessment."""
    from backend.job.planner import plan

    return plan(spec, cluster, req.run_id, req.run_dir, master_port=req.master_port, resume=req.resume,
                assessment=req.assessment)


class AttemptDriver:
    def __init__(self, store: RunStore, owner: Owner, pool: nodes.Pool, planner: Planner, sink: TelemetrySink,
                 engine: Engine, spawn: Callable[[str, Coroutine], object]):
        self.store, self.owner, self.pool, self.planner, self.sink, self.engine = store, owner, pool, planner, sink, engine
        self.spawn = spawn
        """Runs a coroutine of a run on the loop, failing the run where the coroutine raises."""
        self.watchers: dict[str, AttemptWatcher | SlurmWatcher] = {}

    def start_attempt(self, run_id: str, spec: JobSpec, cluster: Cluster, setups: dict[str, str],
                       resume: str | None, assessment: Assessment | None = None, automatic: bool = False,
                       slurm_target: SlurmTarget | None = None) -> None:
        """Record the new attempt (the run is `checking`, driven by this manager, when this
        returns), then start it: on the cluster's nodes, or as a Slurm job on `slurm_target`
        (then `cluster` is `slurm_target.cluster()`, the allocation as the planner sees it)."""
        self.store.transition(run_id, lifecycle.CHECKING, by=self.owner)
        if slurm_target is not None:
            # The nodes are the allocation's, known once the job runs (`_slurm_watch` records them).
            attempt = self.store.new_attempt(run_id, [], resume, automatic=automatic, slurm_json=json.dumps(
                {"target": slurm_target.to_dict(), "job_id": None}))
            self.spawn(run_id, self._slurm_attempt(run_id, attempt, spec, slurm_target, resume, assessment))
            return
        # The job runs on the first `nnodes` nodes of the cluster (validation reports too few).
        cluster = Cluster(nodes=cluster.nodes[:spec.nnodes], source=cluster.source)
        members = [nodes.node_to_dict(n, setups.get(n.host)) for n in cluster.nodes]
        attempt = self.store.new_attempt(run_id, members, resume, automatic=automatic)
        self.spawn(run_id, self._attempt(run_id, attempt, spec, cluster, setups, resume, assessment))

    async def _attempt(self, run_id: str, attempt: Attempt, spec: JobSpec, cluster: Cluster,
                       setups: dict[str, str], resume: str | None, assessment: Assessment | None) -> None:
        run = self.store.get(run_id)
        try:
            assessment = assessment or assess(spec, cluster)
            failure = await self._check(spec, cluster, setups, attempt, assessment)
            if failure:
                self.store.transition(run_id, lifecycle.FAILED, failure, by=self.owner)
                return
            if self._stop_requested(run_id):
                return
            self.store.transition(run_id, lifecycle.LAUNCHING, by=self.owner)
            master = cluster.nodes[0]
            port = await launch_ops.free_port(self.pool, master, setups.get(master.host))
            plan = self.planner(spec, cluster, PlanRequest(run_id, run.run_dir, port, resume, assessment))
            self.store.set_plan(attempt.id, json.dumps(plan.to_dict()))
            await launch_ops.write_files(self.pool, master, setups.get(master.host), run.run_dir, plan.files,
                                         claim=run.dir_claim or "", min_free_bytes=int(DISK_ERROR_GIB * 2**30))
            commands = [NodeCommand(n, list(p.argv), dict(p.env), setups.get(n.host))
                        for n, p in zip(cluster.nodes, plan.nodes)]
            # Recorded before they can run: a manager adopting a launch cut short here finds the
            # groups the nodes published (`reattach`) instead of guessing that nothing started.
            procs = [self.store.add_process(NodeProcess(run_id=run_id, attempt_id=attempt.id, node=n.host,
                                                        node_rank=rank)) for rank, n in enumerate(cluster.nodes)]
            started = await launch_ops.start_all(self.pool, commands, run_id, run.run_dir)
        except launch_ops.TooLittleSpace as exc:
            self.store.transition(run_id, lifecycle.FAILED, Failure(master.host, None, logclass.DISK_FULL, str(exc)),
                                  by=self.owner)
            return
        except (ssh.NodeError, ValueError, RunError) as exc:
            self.store.transition(run_id, lifecycle.FAILED,
                                  Failure(getattr(getattr(exc, "address", None), "host", None), None,
                                          getattr(exc, "kind", "launch_error"), f"launch failed: {exc}"), by=self.owner)
            return
        errors = [s for s in started if s.error]
        for proc, s in zip(procs, started):
            self.store.update_process(proc.id, pgid=s.pgid, state="running" if s.pgid else "failed")
        if errors:
            first = errors[0]
            self.store.transition(run_id, lifecycle.FAILED,
                                  Failure(first.node.host, None, "launch_error", f"could not start: {first.error}"),
                                  by=self.owner)
            return
        if self._stop_requested(run_id):
            # A stop arrived while starting: the stopper may have run before these groups existed.
            await launch_ops.stop_all(self.pool, started, run_id, run.run_dir, grace_s=launch_ops.STOP_GRACE_S,
                                      all_nodes=cluster.nodes)
            self.record_stop(run_id, None)
            return
        self.store.transition(run_id, lifecycle.RUNNING, by=self.owner)
        await self._watch(run_id, attempt, started)

    async def _slurm_attempt(self, run_id: str, attempt: Attempt, spec: JobSpec, target: SlurmTarget,
                             resume: str | None, assessment: Assessment | None) -> None:
        """Check, plan, write the run directory and the batch script, submit, then watch. Slurm
        admits the job (no slot bookkeeping here); the checks that need the nodes run in the job."""
        run = self.store.get(run_id)
        login = slurm.LOGIN
        cluster = target.cluster()
        try:
            assessment = assessment or assess(spec, cluster)
            errors = [*(p for p in assessment.problems if p.severity == "error"), *target.problems(),
                      *target.job_problems(spec)]
            if errors:
                self.store.transition(run_id, lifecycle.FAILED, Failure(
                    None, None, "invalid_job", "; ".join(str(p) for p in errors)), by=self.owner)
                return
            unfit = await slurm.check_partition(self.pool, login, target)
            if unfit:
                self.store.transition(run_id, lifecycle.FAILED, Failure(
                    None, None, "invalid_job", "; ".join(str(p) for p in unfit)), by=self.owner)
                return
            warning = await slurm.config_warning(self.pool, login)
            if warning:
                self.notice(run_id, warning)
            if self._stop_requested(run_id):
                return
            self.store.transition(run_id, lifecycle.LAUNCHING, by=self.owner)
            # The port is the allocation's (the script picks one free on its first node).
            plan = self.planner(spec, cluster, PlanRequest(run_id, run.run_dir, DEFAULT_MASTER_PORT, resume, assessment))
            self.store.set_plan(attempt.id, json.dumps(plan.to_dict()))
            # The agents start after the event lines earlier attempts' agents delivered.
            offsets = {f: o for f, o in self.sink.offsets(run_id, "").items() if f.startswith("events/")}
            script = slurm.sbatch_script(target, plan, run_id, attempt.number, offsets)
            path = slurm.script_file(attempt.number)
            await launch_ops.write_files(self.pool, login, None, run.run_dir, {**plan.files, path: script},
                                         claim=run.dir_claim or "")
            job_id = await slurm.submit(self.pool, login, run.run_dir, f"{run.run_dir}/{path}")
            self.store.update_attempt(attempt.id, slurm_json=json.dumps({"target": target.to_dict(), "job_id": job_id}))
            self.notice(run_id, f"submitted Slurm job {job_id} ({path})")
        except (ssh.NodeError, slurm.SlurmError, ValueError, RunError) as exc:
            self.store.transition(run_id, lifecycle.FAILED, Failure(None, None, "launch_error", f"launch failed: {exc}"),
                                  by=self.owner)
            return
        if self._stop_requested(run_id):
            # The stopper may have looked before the job id was recorded.
            await slurm.cancel(self.pool, login, job_id)
            self.record_stop(run_id, None)
            return
        await self._slurm_watch(run_id, attempt.id, target, job_id, [])

    async def _slurm_watch(self, run_id: str, attempt_id: int, target: SlurmTarget, job_id: str,
                           hosts: list[str]) -> None:
        run, attempt = self.store.get(run_id), next(a for a in self.store.attempts(run_id) if a.id == attempt_id)
        spec = spec_of(run)
        self.sink.watch_attempt(run_id, attempt.started_at, spec.hang_timeout_s, spec.hang_step_multiple)

        def on_running(allocated: list[str]) -> None:
            # The allocation's nodes, reached through the login node's shell: their files are in
            # the shared run directory (logs, pid and exit files, checkpoints).
            members = [nodes.node_to_dict(n, None) for n in slurm.allocation_nodes(target, allocated)]
            self.store.update_attempt(attempt_id, cluster_json=json.dumps(members))
            # After a requeue the batch script starts anew, maybe on other nodes: the processes of
            # the allocation before it have ended.
            for p in self.store.processes(attempt_id):
                if p.state == "running":
                    self.store.update_process(p.id, state="exited", ended_at=time.time())
            for rank, host in enumerate(allocated):
                self.store.add_process(NodeProcess(run_id=run_id, attempt_id=attempt_id, node=host, node_rank=rank,
                                                   state="running"))
            if self.store.get(run_id).state == lifecycle.LAUNCHING:
                try:
                    self.store.transition(run_id, lifecycle.RUNNING, by=self.owner)
                except TransitionError as exc:  # a stop recorded first
                    log.info("run %s: %s", run_id, exc)

        watcher = SlurmWatcher(self.pool, slurm.LOGIN, run_id, run.run_dir, job_id, attempt.number,
                               stop_requested=lambda: self._stop_requested(run_id), on_running=on_running,
                               sink=self.sink, on_notice=lambda m: self.notice(run_id, m), hosts=list(hosts))
        self.watchers[run_id] = watcher
        async with self._reporting(run_id):
            outcome = await watcher.run()
            if outcome is not None and self.store.get(run_id).state in (lifecycle.LAUNCHING, lifecycle.RUNNING):
                for p in self.store.processes(attempt_id):
                    self.store.update_process(p.id, state="exited", ended_at=time.time())
                try:
                    self.store.transition(run_id, outcome.state, outcome.failure, by=self.owner)
                except TransitionError as exc:  # a stop recorded first
                    log.info("run %s: %s", run_id, exc)
            await watcher.read_telemetry()
        if outcome is not None and outcome.state == lifecycle.FAILED:
            self._recover(run_id)

    async def _slurm_stop(self, run_id: str, attempt: Attempt) -> None:
        """`scancel` the attempt's job and wait until Slurm has ended it (SIGTERM: the workers
        checkpoint; SIGKILL after the cluster's KillWait)."""
        job_id = json.loads(attempt.slurm_json).get("job_id")
        failure = None
        if job_id:
            try:
                await slurm.cancel(self.pool, slurm.LOGIN, job_id)
            except (slurm.SlurmError, ssh.NodeError) as exc:
                failure = Failure(None, None, "stop_incomplete", f"stopped; cleanup incomplete: {exc}")
        for p in self.store.processes(attempt.id):
            self.store.update_process(p.id, state="exited", ended_at=time.time())
        self.record_stop(run_id, failure)

    async def _check(self, spec: JobSpec, cluster: Cluster, setups: Mapping[str, str],
                     attempt: Attempt, assessment: Assessment) -> Failure | None:
        """What must hold before anything starts: a valid layout (the assessment's), every node
        reachable, and slots that neither an earlier run of this database nor the ranks found
        running on the node (another studio's, a CLI's with its own `--db`) hold."""
        errors = [p for p in assessment.problems if p.severity == "error"]
        if errors:
            return Failure(None, None, "invalid_job", "; ".join(str(p) for p in errors))
        holdings = [admission.holding(run.id, other.id, spec_of(run), [n for n, _ in attempt_nodes(other)])
                    for run, other in self.store.active_attempts()]
        new = admission.holding(attempt.run_id, attempt.id, spec, cluster.nodes)
        busy = admission.busy_nodes(new, cluster.nodes, holdings)
        if busy:
            return Failure(busy[0][0].host, None, logclass.NODE_BUSY, "; ".join(message for _, message in busy))

        async def login(node):
            try:
                res = await self.pool.check_python(node, setups.get(node.host))
                if not res.ok:
                    return Failure(node.host, res.rc, logclass.COMMAND_NOT_FOUND,
                                   f"{node.host}: {node.python} does not run: {res.first_error_line()}")
                return await launch_ops.running_ranks(self.pool, node)
            except ssh.NodeError as exc:
                return Failure(node.host, None, exc.kind, str(exc))

        results = await asyncio.gather(*(login(n) for n in cluster.nodes))
        failure = next((r for r in results if isinstance(r, Failure)), None)
        if failure:
            return failure
        running = {admission.node_key(n): ranks for n, ranks in zip(cluster.nodes, results)}
        busy = admission.busy_nodes(new, cluster.nodes, holdings, running)
        if busy:
            return Failure(busy[0][0].host, None, logclass.NODE_BUSY, "; ".join(message for _, message in busy))
        return None

    def _stop_requested(self, run_id: str) -> bool:
        run = self.store.get(run_id)
        return bool(run and run.stop_requested)

    def notice(self, run_id: str, message: str) -> None:
        """Store a notice on the run. Best effort: the watches report a failing database through
        here too, and that report must not end the watch it comes from."""
        try:
            self.store.add_notice(run_id, message)
        except Exception:  # noqa: BLE001 - logged with the notice; the run goes on
            log.exception("run %s: notice not stored: %s", run_id, message)

    def notice_once(self, run_id: str, message: str, since: float) -> None:
        """A notice said once `since` then (each short CLI call of a detached run re-attaches it)."""
        if not any(n.message == message and n.at >= since for n in self.store.notices(run_id, last=50)):
            self.notice(run_id, message)

    async def _watch(self, run_id: str, attempt: Attempt, started: list[Started]) -> None:
        run = self.store.get(run_id)
        spec = spec_of(run)
        self.sink.watch_attempt(run_id, attempt.started_at, spec.hang_timeout_s, spec.hang_step_multiple)
        procs = {p.node: p for p in self.store.processes(attempt.id)}
        # A node's silence counts from when any watch first met it (a recorded deadline): a
        # watch that lives as long as one CLI call still declares a node lost.
        watched = [NodeWatch(s, procs[s.node.host].id, unreachable_since=procs[s.node.host].unreachable_since)
                   for s in started]

        def on_update(n: NodeWatch) -> None:
            self.store.update_process(n.proc_id, state=n.state, exit_code=n.exit_code, last_seen=n.last_seen,
                                      unreachable_since=n.unreachable_since, ended_at=None if n.alive else time.time())

        watcher = AttemptWatcher(self.pool, run_id, run.run_dir, watched,
                                 stop_requested=lambda: self._stop_requested(run_id), on_update=on_update,
                                 sink=self.sink, on_notice=lambda m: self.notice(run_id, m), attempt=attempt.number,
                                 started_at=attempt.started_at)
        self.watchers[run_id] = watcher
        async with self._reporting(run_id):
            outcome: Outcome | None = await watcher.run()
            # None: a stop was requested, and `_stop` records the end.
            if outcome is not None and self.store.get(run_id).state == lifecycle.RUNNING:
                try:
                    self.store.transition(run_id, outcome.state, outcome.failure, by=self.owner)
                except TransitionError as exc:  # a stop recorded first; the agents' last lines still count
                    log.info("run %s: %s", run_id, exc)
            await watcher.drain()
        if outcome is not None and outcome.state == lifecycle.FAILED:
            self._recover(run_id)

    def _recover(self, run_id: str) -> None:
        """Automatic recovery after a failed attempt (`backend.runs.recovery` decides): a new
        attempt from the newest checkpoint that verifies, on the same nodes or without one that
        failed twice (the job re-planned for the nodes left, if it still fits them); each decision
        is a notice on the run."""
        run = self.store.get(run_id)
        if run.state != lifecycle.FAILED or run.stop_requested:
            return
        spec, attempts = spec_of(run), self.store.attempts(run_id)
        target = slurm_target_of(attempts[-1])
        members = None if target is not None else attempt_nodes(attempts[-1])
        decision = recovery.decide(spec, attempts, members, self._progressed(run_id))
        if decision is None:
            return
        if isinstance(decision, recovery.NoRestart):
            self.notice(run_id, f"not restarted automatically: {decision.why}")
            return
        what = (run.cause or "failure").replace("_", " ") + (f" on node {run.failed_node}" if run.failed_node else "")
        if target is not None:
            # A new job on the same target; Slurm picks the nodes, so a node that failed twice is
            # excluded from the allocation rather than the job re-planned without it.
            if decision.left_out:
                target = target.excluding(decision.left_out)
                what += f"; excluded node {decision.left_out} (it failed twice)"
            self.notice(run_id, f"automatic restart {decision.number} of {spec.max_restarts} after {what}: "
                                "a new Slurm job resuming from the newest checkpoint")
            try:
                self.start_attempt(run_id, spec, target.cluster(), {}, resume="latest", automatic=True,
                                   slurm_target=target)
            except TransitionError as exc:  # a user resumed it first
                log.info("run %s: %s", run_id, exc)
            return
        cluster = Cluster(nodes=tuple(n for n, _ in decision.nodes), source="automatic restart")
        setups = {n.host: s for n, s in decision.nodes if s}
        if decision.left_out:
            spec = spec.model_copy(update={"nnodes": len(cluster.nodes)})
            problems = [p for p in assess(spec, cluster).problems if p.severity == "error"]
            if problems:
                self.notice(run_id, f"not restarted automatically: node {decision.left_out} failed twice, and without "
                                    f"it the job does not fit: {'; '.join(str(p) for p in problems)}")
                return
            self.store.set_spec(run_id, spec.to_yaml())
            what += f"; left out node {decision.left_out} (it failed twice): re-planned on {len(cluster.nodes)} node(s)"
        self.notice(run_id, f"automatic restart {decision.number} of {spec.max_restarts} after {what}: resuming from "
                            "the newest checkpoint")
        try:
            self.start_attempt(run_id, spec, cluster, setups, resume="latest", automatic=True)
        except TransitionError as exc:  # a user resumed it first
            log.info("run %s: %s", run_id, exc)

    def _progressed(self, run_id: str) -> bool:
        """Whether the attempt that just ended logged a training step (after its `start` event)."""
        latest = self.sink.events(run_id, ("train", "start"), limit=1)
        train, start = (next(iter(latest[etype]), None) for etype in ("train", "start"))
        return bool(train and (start is None or train.get("time", 0) >= start.get("time", 0)))

    @contextlib.asynccontextmanager
    async def _reporting(self, run_id: str):
        """The trackers the spec's `report_to` names, pushed every few seconds while the attempt is
        watched, then once more with the attempt's telemetry in, each closed with the run's end where
        it has one; what a user should know of them becomes a notice."""
        run = self.store.get(run_id)
        spec = spec_of(run)
        if not any(name in trackers.SINKS for name in spec.report_to):
            yield
            return
        reporter = trackers.Reporter(self.engine, trackers.RunInfo(run_id, run.name, Path(run.run_dir), spec))

        async def every_few_seconds() -> None:
            while True:
                await asyncio.sleep(trackers.PUSH_EVERY_S)
                for line in await asyncio.to_thread(reporter.push):
                    self.notice(run_id, line)

        task = asyncio.ensure_future(every_few_seconds())
        try:
            yield
        finally:
            task.cancel()
            state = self.store.get(run_id).state
            final = state if state in lifecycle.FINAL else (lifecycle.STOPPED if self._stop_requested(run_id) else None)
            for line in await asyncio.to_thread(reporter.finish, final):
                self.notice(run_id, line)

    async def stop(self, run_id: str, grace_s: float) -> None:
        run = self.store.get(run_id)
        attempt = self.store.current_attempt(run_id)
        if attempt is None or run.state in lifecycle.FINAL:
            return
        if attempt.slurm_json:
            await self._slurm_stop(run_id, attempt)
            return
        members, processes = attempt_nodes(attempt), self.store.processes(attempt.id)
        report = await launch_ops.stop_all(self.pool, recorded(members, processes), run_id,
                                           run.run_dir, grace_s=grace_s, all_nodes=[n for n, _ in members])
        for p in processes:
            self.store.update_process(p.id, state="exited" if p.node not in report.unreachable else "unreachable",
                                      ended_at=time.time())
        run = self.store.get(run_id)
        if run.state in lifecycle.FINAL:
            return
        failure = None
        if not report.clean:
            failure = Failure(next(iter(report.unreachable), None), None, "stop_incomplete",
                              f"stopped; cleanup incomplete: {report.detail()}")
        self.record_stop(run_id, failure)

    def record_stop(self, run_id: str, failure: Failure | None) -> None:
        """Record a requested stop. It is the user's word, so any process records it, not only the
        run's owner; a move that lands first (the owner recording how the workers ended, or
        moving on to launching) is kept and the stop recorded from there."""
        # Each lost race means the run moved on (checking → launching → running → an end).
        for _ in range(len(lifecycle.ACTIVE) + 1):
            if self.store.get(run_id).state in lifecycle.FINAL:
                return
            try:
                self.store.transition(run_id, lifecycle.STOPPED, failure)
                return
            except TransitionError as exc:
                log.info("run %s: %s", run_id, exc)

    def adopt_orphans(self) -> list[Run]:
        """Take over the active runs whose owner is gone; of several managers adopting one, the
        compare-and-set lets one win."""
        now, here = time.time(), self.owner.host
        return [self.store.get(run.id) for run in self.store.runs(states=lifecycle.ACTIVE)
                if run.owner != self.owner.id and lifecycle.owner_gone(run, now, here, lifecycle.pid_alive)
                and self.store.claim(run, self.owner, now)]

    async def reattach_all(self) -> None:
        for run in self.adopt_orphans():
            await self.reattach(run)

    async def reattach(self, run: Run) -> None:
        """Drive a run just adopted from a manager that went away."""
        attempt = self.store.current_attempt(run.id)
        if attempt is not None and attempt.slurm_json:
            await self._slurm_reattach(run, attempt)
            return
        members = attempt_nodes(attempt)
        processes = self.store.processes(attempt.id) if members else []
        if run.state == lifecycle.LAUNCHING and processes and all(p.pgid is None for p in processes):
            # Its manager went away while the nodes started: what started is in the pid files.
            processes = await self._adopt_start(run, attempt, members, processes)
            if processes is None:
                return
        elif run.state != lifecycle.RUNNING or not members:
            # Its manager went away while checking or launching, before any node started: clean up
            # whatever of the run may have started anyway and record it.
            if members:
                await launch_ops.stop_all(self.pool, recorded(members, processes), run.id,
                                          run.run_dir, grace_s=0, all_nodes=[n for n, _ in members])
            self._fail_interrupted(run, "starting")
            return
        if run.stop_requested:
            self.spawn(run.id, self.stop(run.id, launch_ops.STOP_GRACE_S))
            return
        self.notice_once(run.id, "re-attached: watched from here now (the process that watched it before has ended; "
                                 "the workers went on)", attempt.started_at)
        self.spawn(run.id, self._watch(run.id, attempt, recorded(members, processes)))

    async def _adopt_start(self, run: Run, attempt: Attempt, members: list[tuple[Node, str | None]],
                           processes: list[NodeProcess]) -> list[NodeProcess] | None:
        """A launch cut short after its processes were recorded: each node's group is read from the
        pid file its wrapper wrote. Started everywhere: recorded and running, to be watched (it may
        even have finished). Started on some nodes only: those are stopped (with the time to
        checkpoint) and the run fails as interrupted; None then."""
        async def group(node: Node, setup: str | None) -> int | None:
            try:
                return await launch_ops.started_group(self.pool, node, setup, run.run_dir)
            except ssh.NodeError:
                return None

        pgids = await asyncio.gather(*(group(n, setup) for n, setup in members))
        by_node = dict(zip((n.host for n, _ in members), pgids))
        for p in processes:
            self.store.update_process(p.id, pgid=by_node.get(p.node), state="running" if by_node.get(p.node) else "failed")
        processes = self.store.processes(attempt.id)
        if all(pgids):
            try:
                self.store.transition(run.id, lifecycle.RUNNING, by=self.owner)
            except TransitionError as exc:  # another process moved it first (a stop): its record stands
                log.info("run %s: %s", run.id, exc)
                return None
            self.notice(run.id, "adopted: the process launching it went away after its nodes had started")
            return processes
        await launch_ops.stop_all(self.pool, recorded(members, processes), run.id, run.run_dir,
                                  grace_s=launch_ops.STOP_GRACE_S, all_nodes=[n for n, _ in members])
        self._fail_interrupted(run, "starting")
        return None

    async def _slurm_reattach(self, run: Run, attempt: Attempt) -> None:
        """A submitted job goes on under Slurm whoever watched it: watch it again. One whose
        submission was cut short (no job id recorded) is failed as interrupted."""
        info = json.loads(attempt.slurm_json)
        if run.stop_requested:
            self.spawn(run.id, self.stop(run.id, launch_ops.STOP_GRACE_S))
            return
        if info.get("job_id") and run.state in (lifecycle.LAUNCHING, lifecycle.RUNNING):
            self.notice_once(run.id, f"re-attached to Slurm job {info['job_id']}: watched from here now (the process "
                                     "that watched it before has ended; the job went on)", attempt.started_at)
            hosts = [n.host for n, _ in attempt_nodes(attempt)]
            self.spawn(run.id, self._slurm_watch(run.id, attempt.id, SlurmTarget.from_dict(info["target"]),
                                                 info["job_id"], hosts))
            return
        # Its submission was cut short before the job id was recorded: a job sbatch did start
        # carries the run's name; it is cancelled, nothing else.
        try:
            for job_id in await slurm.jobs_named(self.pool, slurm.LOGIN, run.id):
                await slurm.cancel(self.pool, slurm.LOGIN, job_id)
        except (slurm.SlurmError, ssh.NodeError) as exc:
            self.notice(run.id, f"could not look for or cancel the run's Slurm job ({exc}): check `squeue --me`")
        self._fail_interrupted(run, "submitting")

    def _fail_interrupted(self, run: Run, doing: str) -> None:
        """The studio or CLI driving the run went away while it was `doing` that."""
        try:
            self.store.transition(run.id, lifecycle.FAILED, Failure(
                None, None, "interrupted", f"the studio or CLI {doing} it stopped while the run was {run.state}"),
                by=self.owner)
        except TransitionError as exc:
            log.info("run %s: %s", run.id, exc)


def slurm_target_of(attempt: Attempt | None) -> SlurmTarget | None:
    """The Slurm target an attempt ran on; None for an attempt on SSH or local nodes."""
    if attempt is None or not attempt.slurm_json:
        return None
    return SlurmTarget.from_dict(json.loads(attempt.slurm_json)["target"])


def attempt_nodes(attempt: Attempt | None) -> list[tuple[Node, str | None]]:
    """The attempt's nodes in rank order, each with its setup line."""
    return [nodes.node_from_dict(d) for d in json.loads(attempt.cluster_json)] if attempt else []


def recorded(members: list[tuple[Node, str | None]], procs: list[NodeProcess]) -> list[Started]:
    """The recorded processes of the attempt's nodes, as `launch` handles them."""
    by_host = {n.host: (n, s) for n, s in members}
    return [Started(*by_host[p.node], pgid=p.pgid) for p in procs if p.node in by_host]


def assesses(assessment: Assessment, spec: JobSpec, cluster: Cluster) -> bool:
    """Whether `assessment` is of this job (its output directory aside: launch makes it absolute) on this cluster."""
    return (assessment.cluster == cluster
            and assessment.spec == spec.model_copy(update={"output_dir": assessment.spec.output_dir}))


def spec_of(run: Run) -> JobSpec:
    return JobSpec.model_validate(yaml.safe_load(run.spec_yaml))
