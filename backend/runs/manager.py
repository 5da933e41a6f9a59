"""`RunManager`: the one object the UI and the CLI call.

It owns an asyncio loop on a background thread (all SSH work happens there) and offers plain,
blocking methods. Several managers (the studio, CLI commands, in other processes) share one
database; each active run is driven by one of them, its owner, which refreshes the run's heartbeat
every `lifecycle.HEARTBEAT_S`. On construction, and then with every heartbeat, a manager adopts
the active runs whose owner is gone (`lifecycle.owner_gone`): it asks their nodes whether the
workers still live and resumes watching them (or records how they ended while nobody was
watching). A run another live process drives is left to it. The attempts themselves are driven by
`backend.runs.driver.AttemptDriver`; this module is the blocking facade and the loop around it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import re
import secrets
import shlex
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, TimeoutError as FutureTimeoutError
from pathlib import Path

from backend.cluster import nodes, remote, ssh
from backend.cluster import launch as launch_ops
from backend.cluster.slurm import LOGIN as SLURM_LOGIN, SlurmTarget, check_partition
from backend.job.chat import EXPORT_DIR, EXPORT_MARKER
from backend.job.rundir import CHECKPOINT_MARKER
from backend.job.cluster import Cluster, Node
from backend.job.layout import Layout
from backend.job.spec import JobSpec, Problem, absolute_dir
from backend.job.validate import Assessment
from backend.runs import chat, lifecycle
from backend.runs.driver import (AttemptDriver, Planner, RunError, assesses, attempt_nodes, default_planner,
                                 slurm_target_of, spec_of)
from backend.runs.lifecycle import Failure, Owner, RunStore, TransitionError
from backend.runs.usage import Usage, usage_of, windows
from backend.store.db import create_db_and_tables, make_engine
from backend.store.models import NodeProcess, Run
from backend.telemetry.ingest import TelemetrySink

log = logging.getLogger(__name__)

EXPORT_TIMEOUT_S = 1800.0
CLOSE_TIMEOUT_S = 30.0


_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def make_run_id(name: str | None, taken: Callable[[str], bool]) -> str:
    """`YYYYmmdd-HHMMSS-<6 hex>`, or the user's name made safe (a suffix when taken): at most 64
    characters, starting with a letter or digit (a Slurm job name, a directory name)."""
    if name and name.strip():
        base = _SAFE_NAME.sub("-", name.strip()).strip("._-")[:64] or "run"
        candidate = base
        while taken(candidate):
            candidate = f"{base[:57]}-{secrets.token_hex(3)}"
        return candidate
    return time.strftime("%Y%m%d-%H%M%S-", time.gmtime()) + secrets.token_hex(3)


class RunManager:
    def __init__(self, db_url: str | None = None, known_hosts: str | Path | None = None,
                 planner: Planner | None = None, sink: TelemetrySink | None = None,
                 reattach: bool = True):
        self.engine = make_engine(db_url)
        create_db_and_tables(self.engine)
        self.store = RunStore(self.engine)
        self.owner = Owner.this_process()
        self.known_hosts = Path(known_hosts) if known_hosts else ssh.default_known_hosts()
        self.planner = planner or default_planner
        self.sink = sink if sink is not None else _default_sink(self.engine)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="swift-studio-control", daemon=True)
        self._thread.start()
        self.pool = nodes.Pool(self.known_hosts)
        self._tasks: dict[str, Future] = {}
        self._chats: dict[str, chat.ChatSession] = {}
        self._ended_chats: dict[str, str] = {}  # session id -> why it ended, for a later request
        self.driver = AttemptDriver(self.store, self.owner, self.pool, self.planner, self.sink, self.engine, self._spawn)
        self._closed = False
        asyncio.run_coroutine_threadsafe(self._heartbeat(adopt=reattach), self._loop)
        if reattach:
            self._call(self.driver.reattach_all())

    # -- plumbing ------------------------------------------------------------------------------
    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _iterate(self, items: AsyncIterator) -> Iterator:
        """An async iterator of the loop as a blocking one; leaving the loop early ends it there."""
        out: queue.Queue = queue.Queue()
        done = object()

        async def pump() -> None:
            try:
                async for item in items:
                    out.put((item, None))
                out.put((done, None))
            except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
                out.put((done, exc))

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while True:
                item, exc = out.get()
                if exc is not None:
                    raise exc
                if item is done:
                    return
                yield item
        finally:
            fut.cancel()

    def _spawn(self, run_id: str, coro) -> Future:
        fut = asyncio.run_coroutine_threadsafe(self._guarded(run_id, coro), self._loop)
        self._tasks[run_id] = fut
        return fut

    async def _guarded(self, run_id: str, coro) -> None:
        """A bug in the control code must not leave a run looking alive forever."""
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except TransitionError as exc:
            # Another process moved the run first (a stop, a manager that took it over): its
            # record stands, and this task has nothing left to drive.
            log.info("run %s: %s", run_id, exc)
        except Exception as exc:
            log.exception("run %s: control task failed", run_id)
            run = self.store.get(run_id)
            if run is not None and run.state not in lifecycle.FINAL:
                failure = Failure(None, None, "internal_error", f"swift-studio error: {type(exc).__name__}: {exc}")
                try:
                    self.store.transition(run_id, lifecycle.FAILED, failure, by=self.owner)
                except TransitionError as lost:
                    log.info("run %s: %s", run_id, lost)

    async def _heartbeat(self, adopt: bool) -> None:
        """Keep this manager's runs marked as driven; with `adopt`, take over orphaned runs."""
        while True:
            await asyncio.sleep(lifecycle.HEARTBEAT_S)
            try:
                self.store.heartbeat(self.owner, time.time())
                if adopt:
                    for run in self.driver.adopt_orphans():
                        self._spawn(run.id, self.driver.reattach(run))
            except Exception:  # a busy or unreachable database: beat again next time
                log.exception("heartbeat failed")

    def close(self) -> None:
        """Stop watching (runs keep running on their nodes; another manager re-attaches them)."""
        if self._closed:
            return
        self._closed = True

        async def shutdown() -> int:
            # First the chat workers: each is a model in a node's memory that nothing else ends.
            await asyncio.gather(*(s.close() for s in list(self._chats.values())), return_exceptions=True)
            loop = asyncio.get_running_loop()
            end = loop.time() + CLOSE_TIMEOUT_S
            while loop.time() < end:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
                if not tasks:
                    break
                for t in tasks:
                    t.cancel()
                # Cancel again whatever is still going: asyncio.wait_for swallows a cancellation
                # that arrives as its inner call completes (Python < 3.12), and the task goes on.
                await asyncio.wait(tasks, timeout=1.0)
            await self.pool.close()
            return len([t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()])

        try:
            left = self._call(shutdown(), timeout=CLOSE_TIMEOUT_S + 30)
        except FutureTimeoutError:
            left = -1
        if left:
            log.warning("control tasks did not end within %.0f s; they end with the process", CLOSE_TIMEOUT_S)
        try:
            # After the tasks: nothing of this manager drives the runs any more, and no agent
            # line arrives after the sink's last flush.
            self.store.release(self.owner)
            if hasattr(self.sink, "close"):
                self.sink.close()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self.engine.dispose()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- queries -------------------------------------------------------------------------------
    def runs(self) -> list[Run]:
        return self.store.runs()

    def run(self, run_id: str) -> Run:
        run = self.store.get(run_id)
        if run is None:
            raise RunError(f"no run {run_id!r}")
        return run

    def attempts(self, run_id: str):
        return self.store.attempts(run_id)

    def processes(self, run_id: str) -> list[NodeProcess]:
        attempt = self.store.current_attempt(run_id)
        return self.store.processes(attempt.id) if attempt else []

    def layout(self, run_id: str) -> Layout | None:
        """The parallel layout the current attempt was planned with; None before its plan."""
        attempt = self.store.current_attempt(run_id)
        found = json.loads(attempt.plan_json).get("layout") if attempt else None
        try:
            return Layout(**found) if found else None
        except TypeError:  # a plan stored by a version whose Layout had other fields
            return None

    def memory_estimate(self, run_id: str) -> dict | None:
        """The per-GPU memory estimate the current attempt was planned with (MemoryEstimate.to_dict);
        None before its plan or where it had none."""
        attempt = self.store.current_attempt(run_id)
        found = json.loads(attempt.plan_json).get("memory") if attempt else None
        return found if isinstance(found, dict) else None

    def notices(self, run_id: str, last: int = 20) -> list[str]:
        """The run's last notices, oldest first, each after its clock time: recovery decisions,
        Slurm jobs, the watch's connection notices (a node not answering, answering again)."""
        return [f"{time.strftime('%H:%M:%S', time.localtime(n.at))} {n.message}"
                for n in self.store.notices(run_id, last)]

    def wait(self, run_id: str, timeout: float | None = None, states: tuple[str, ...] = lifecycle.FINAL) -> Run:
        """Block until the run reaches one of `states` (default: finished); returns it."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            run = self.run(run_id)
            if run.state in states:
                return run
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"run {run_id} still {run.state} after {timeout:.0f} s")
            time.sleep(0.2)

    def settle(self, run_id: str, timeout: float = 15.0) -> Run:
        """After a re-attach: wait until the run's nodes have been asked once (or it ended). A run
        another process drives is as that process records it."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            run = self.run(run_id)
            watcher = self.driver.watchers.get(run_id)
            if (run.state not in lifecycle.ACTIVE or run.owner != self.owner.id
                    or (watcher is not None and watcher.first_pass.is_set())):
                return run
            time.sleep(0.1)
        return self.run(run_id)

    def nodes_of(self, run_id: str) -> list[str]:
        return [n.host for n, _ in attempt_nodes(self.store.current_attempt(run_id))]

    def _log_node(self, run_id: str, node: str | None):
        members = attempt_nodes(self.store.current_attempt(run_id))
        if not members:
            return None
        chosen = next((n for n, _ in members if n.host == node), None) if node else members[0][0]
        if chosen is None:
            raise RunError(f"run {run_id} has no node {node!r}; nodes: {', '.join(n.host for n, _ in members)}")
        return chosen

    def log_tail(self, run_id: str, node: str | None = None, lines: int = 100) -> list[str]:
        """The last lines of a node's torchrun log (the first node when none is named)."""
        run = self.run(run_id)
        chosen = self._log_node(run_id, node)
        if chosen is None:
            return []
        return self._call(launch_ops.log_tail(self.pool, chosen, run.run_dir, lines), timeout=60)

    def log_since(self, run_id: str, node: str | None = None, offset: int = 0) -> tuple[str, int]:
        """(text, next offset): what a node's log gained after byte `offset` (for following it)."""
        run = self.run(run_id)
        chosen = self._log_node(run_id, node)
        if chosen is None:
            return "", offset
        raw = self._call(launch_ops.log_since(self.pool, chosen, run.run_dir, offset), timeout=60)
        return raw.decode(errors="replace"), offset + len(raw)

    def series(self, run_id: str, names, since: int | None = None, max_points: int = 1000):
        """Metric series of a run (the ingestor's live tail over the stored history)."""
        return self.sink.series(run_id, names, since=since, max_points=max_points)

    def alerts(self, run_id: str):
        return self.sink.alerts(run_id)

    def progress(self, run_id: str) -> dict | None:
        """step, max_steps, eta_s, loss, tokens_per_s, epoch, t of the latest `train` event,
        resumed_from of the latest `start` event (all attempts; a resumed attempt's start sets
        the step back to its checkpoint), the latest `data` event (how the data is prepared) and
        the latest eval loss; None before the first event."""
        latest = self.sink.events(run_id, ("train", "start", "data", "eval"), limit=1)
        train, start, data, evaluated = (next(iter(latest[etype]), None) for etype in ("train", "start", "data", "eval"))
        if train is None and start is None and data is None:
            return None
        out = {"resumed_from": (start or {}).get("resumed_from"), "max_steps": (train or start or {}).get("max_steps"),
               "data": data, "eval_loss": (evaluated or {}).get("eval_loss")}
        if train:
            out.update({k: train.get(k) for k in ("step", "eta_s", "loss", "tokens_per_s", "epoch")})
            out["t"] = train.get("time")
        return out

    def checkpoints(self, run_id: str) -> list[tuple[int, str]]:
        """(step, path) of every checkpoint the workers reported, newest first (all attempts;
        not one past the checkpoint a later attempt resumed from: that attempt could not use it)."""
        seen: dict[int, str] = {}
        for event in self.sink.events(run_id, ("checkpoint",))["checkpoint"]:
            if isinstance(event.get("step"), int):
                seen.setdefault(event["step"], str(event.get("path")))
        return sorted(seen.items(), reverse=True)

    def checkpoint_eval_losses(self, run_id: str) -> dict[int, float]:
        """step -> eval loss of each reported checkpoint that was evaluated at its step."""
        out: dict[int, float] = {}
        for event in self.sink.events(run_id, ("checkpoint",))["checkpoint"]:
            loss = event.get("eval_loss")
            if isinstance(event.get("step"), int) and isinstance(loss, (int, float)):
                out.setdefault(event["step"], float(loss))
        return out

    def saved_checkpoints(self, run_id: str, node: Node | None = None, setup: str | None = None
                          ) -> list[tuple[int, str]]:
        """The reported checkpoints (`checkpoints`) still whole on `node` (default: the run's first
        node), their completion marker there: what Chat, Export and a resume can use now."""
        saved = self.checkpoints(run_id)
        if node is None:
            members = attempt_nodes(self.store.current_attempt(run_id))
            if not members:
                return []
            node, setup = members[0]
        if not saved:
            return []
        there = self._call(launch_ops.existing_files(self.pool, node, setup,
                                                     [f"{path}/{CHECKPOINT_MARKER}" for _, path in saved]))
        return [(step, path) for step, path in saved if f"{path}/{CHECKPOINT_MARKER}" in there]

    def usage(self, run_id: str) -> Usage:
        """GPU-hours, energy and tokens of all the run's attempts (backend.runs.usage)."""
        from backend.telemetry.query import energy_j, tokens_trained

        attempts, now = self.store.attempts(run_id), time.time()
        self.sink.flush()
        return usage_of(attempts, now, energy_j(self.engine, run_id, windows(attempts, now)),
                        tokens_trained(self.engine, run_id))

    def stop_outcome(self, run_id: str, since: float) -> str | None:
        """What the workers did with a stop requested at `since` (epoch seconds): the checkpoint they
        saved, or their note on why there is none; None until their `end` event has arrived."""
        for end in self.sink.events(run_id, ("end",), limit=1)["end"]:
            if end.get("status") != "stopped" or end.get("time", 0) < since:
                continue
            if end.get("error"):
                return end["error"]
            saved = self.checkpoints(run_id)
            if saved and saved[0][0] == end.get("step"):
                return f"saved {saved[0][1]} (step {saved[0][0]})"
            return f"stopped at step {end.get('step')} without a new checkpoint"
        return None

    # -- node inventory ------------------------------------------------------------------------
    def set_inventory(self, cluster: Cluster, setups: Mapping[str, str] | None = None) -> None:
        nodes.set_inventory(self.engine, cluster, setups)

    def node_inventory(self) -> tuple[Cluster, dict[str, str]] | None:
        return nodes.load_inventory(self.engine)

    def host_key_fingerprint(self, cluster: Cluster, host: str) -> str:
        node = _find_node(cluster, host)
        return self._call(ssh.host_key_fingerprint(nodes.address_of(node)), timeout=30)

    def trust_host(self, cluster: Cluster, host: str, expected_fingerprint: str | None = None) -> str:
        """Trust the node's current host key (an explicit choice, recorded in the database)."""
        node = _find_node(cluster, host)
        address = nodes.address_of(node)
        fingerprint = self._call(ssh.trust_host_key(address, self.known_hosts, expected_fingerprint), timeout=30)
        nodes.record_trust(self.engine, address, fingerprint, self.known_hosts)
        return fingerprint

    # -- pre-flight ----------------------------------------------------------------------------
    def preflight(self, cluster: Cluster, spec: JobSpec | None = None, setups: Mapping[str, str] | None = None,
                  bandwidth: bool = True):
        from backend.cluster import preflight
        setups = nodes.setups_for(self.engine, cluster, setups)
        return self._call(preflight.run_preflight(self.pool, cluster, spec, setups, bandwidth=bandwidth))

    def check_partition(self, target: SlurmTarget) -> list[Problem]:
        """Whether the target's partition exists and has nodes the job fits on (`sinfo`, from this
        machine); raises SlurmError where Slurm does not answer."""
        return self._call(check_partition(self.pool, SLURM_LOGIN, target))

    # -- launch / stop / resume / export -------------------------------------------------------
    def launch(self, spec: JobSpec, cluster: Cluster, name: str | None = None,
               setups: Mapping[str, str] | None = None, assessment: Assessment | None = None,
               slurm: SlurmTarget | None = None) -> str:
        """Create the run and start it in the background; returns the run id at once. `assessment`:
        the job's `backend.job.validate.assess` on this cluster where the caller has it (the Train
        form), so the launch does not read the model config and the DeepSpeed JSON again. `slurm`:
        submit it as a Slurm job on that target instead (`cluster` is `slurm.cluster()`)."""
        output_dir = absolute_dir(spec.output_dir)
        # A name another database's run has on disk here is taken too (the output directory is
        # mostly the nodes' shared storage, mounted here as well); the claim on the node decides.
        run_id = make_run_id(name, lambda rid: self.store.get(rid) is not None
                             or os.path.lexists(os.path.join(output_dir, rid)))
        spec = spec.model_copy(update={"output_dir": output_dir})
        run = Run(id=run_id, name=name or run_id, spec_yaml=spec.to_yaml(), output_dir=output_dir,
                  run_dir=f"{output_dir.rstrip('/')}/{run_id}", dir_claim=secrets.token_hex(16))
        self.store.create(run)
        setups = nodes.setups_for(self.engine, cluster, setups)
        if assessment is not None and not assesses(assessment, spec, cluster):
            assessment = None  # of another job or cluster: this one is assessed at the start
        self.driver.start_attempt(run_id, spec, cluster, setups, resume=None, assessment=assessment,
                                  slurm_target=slurm)
        return run_id

    def resume(self, run_id: str, cluster: Cluster | None = None, setups: Mapping[str, str] | None = None,
               from_scratch: bool = False) -> str:
        """A new attempt of a stopped or failed run from its latest complete checkpoint: on `cluster`,
        else where the last attempt ran (its nodes, or its Slurm target as a new job). A run that
        saved checkpoints none of which is there any more is refused (it would start again from
        step 0) unless `from_scratch`, which starts it from step 0 on purpose."""
        run = self.run(run_id)
        if run.state not in (lifecycle.STOPPED, lifecycle.FAILED):
            raise RunError(f"run {run_id} is {run.state}; only a stopped or failed run can be resumed")
        if not from_scratch:
            self._refuse_lost_checkpoints(run, cluster)
        members = attempt_nodes(self.store.current_attempt(run_id))
        target = slurm_target_of(self.store.current_attempt(run_id)) if cluster is None else None
        if target is not None:
            cluster, setups = target.cluster(), {}
        elif cluster is None:
            cluster = Cluster(nodes=tuple(n for n, _ in members), source="previous attempt")
            setups = {**{n.host: s for n, s in members if s}, **(setups or {})}
        else:
            setups = nodes.setups_for(self.engine, cluster, setups)
        try:
            self.driver.start_attempt(run_id, spec_of(run), cluster, dict(setups),
                                      resume=None if from_scratch else "latest", slurm_target=target)
        except TransitionError as exc:  # another process resumed it first
            raise RunError(str(exc)) from None
        if from_scratch:
            self.driver.notice(run_id, "resumed from scratch at the user's word: from step 0, not from a checkpoint")
        return run_id

    def _refuse_lost_checkpoints(self, run: Run, cluster: Cluster | None) -> None:
        """A RunError when the run's workers reported checkpoints and none of them is whole on the
        node that would resume now (the run directory deleted, moved or on another volume)."""
        saved = self.checkpoints(run.id)
        if not saved:
            return
        members = attempt_nodes(self.store.current_attempt(run.id))
        node, setup = ((cluster.nodes[0], None) if cluster is not None else members[0] if members
                       else (SLURM_LOGIN, None))
        try:
            whole = self.saved_checkpoints(run.id, node, setup)
        except ssh.NodeError as exc:
            raise RunError(f"cannot look for the run's checkpoints on {node.host}: {exc}") from None
        if not whole:
            step, path = saved[0]
            raise RunError(f"run {run.id} saved {len(saved)} checkpoint(s), the newest {path} (step {step}), and none "
                           f"of them is on {node.host} now (the run directory deleted or moved?): resuming would start "
                           "again from step 0. Put the checkpoints back, or resume from scratch (`swift-studio resume "
                           "--from-scratch`) to start from step 0 on purpose")

    def stop(self, run_id: str, wait: bool = True, grace_s: float = launch_ops.STOP_GRACE_S) -> Run:
        run = self.run(run_id)
        if run.state in lifecycle.FINAL:
            return run
        self.store.request_stop(run_id)
        fut = asyncio.run_coroutine_threadsafe(self.driver.stop(run_id, grace_s), self._loop)
        if wait:
            fut.result()
            return self.run(run_id)
        return run

    def export(self, run_id: str, checkpoint: str | None = None, out: str | None = None) -> dict:
        """Run the worker's export on the run's first node; returns its JSON result."""
        run = self.run(run_id)
        attempt = self.store.current_attempt(run_id)
        if attempt is None:
            raise RunError(f"run {run_id} never started; nothing to export")
        node, setup = attempt_nodes(attempt)[0]
        argv = [node.python, "-m", "launcher.export", "--run-dir", run.run_dir]
        if checkpoint:
            argv += ["--checkpoint", str(checkpoint)]
        if out:
            argv += ["--out", str(out)]
        res = self._call(self.pool.run(node, remote.run_in(None, run.run_dir, argv), setup,
                                       timeout=EXPORT_TIMEOUT_S))
        lines = [ln for ln in res.stdout.splitlines() if ln.strip().startswith("{")]
        if not res.ok or not lines:
            raise RunError(f"export on {node.host} failed (exit code {res.rc}): {res.first_error_line()}")
        return json.loads(lines[-1])

    # -- chat --------------------------------------------------------------------------------
    def exported(self, run_id: str) -> str | None:
        """`<run dir>/export` where it holds an export (launcher.export's default target), else None."""
        run = self.run(run_id)
        attempt = self.store.current_attempt(run_id)
        if attempt is None:
            return None
        node, setup = attempt_nodes(attempt)[0]
        path = f"{run.run_dir}/{EXPORT_DIR}"
        marker = f"{path}/{EXPORT_MARKER}"
        return path if self._call(launch_ops.existing_files(self.pool, node, setup, [marker])) else None

    def chat_open(self, run_id: str, source: str | None = None) -> tuple[str, dict]:
        """Start a chat worker on the run's first node with a checkpoint (a step, a path; None: the
        latest) or an export directory; returns (session id, the worker's ready line) once loaded."""
        run = self.run(run_id)
        if run.state not in lifecycle.FINAL:
            raise chat.ChatError(f"run {run_id} is {run.state}: a chat worker would load its model onto the GPUs "
                                 "the run trains on; chat once it has ended (or stop it)")
        attempt = self.store.current_attempt(run_id)
        if attempt is None:
            raise chat.ChatError(f"run {run_id} never started; it has no checkpoint to chat with")
        if not (source and source.startswith("/")) and not self.checkpoints(run_id):
            raise chat.ChatError(f"run {run_id} has no checkpoint yet, so there is no model to chat with (nothing "
                                 "was started); load it once the run has saved one")
        node, setup = attempt_nodes(attempt)[0]
        log_file = chat.log_path(run.run_dir, node.host)
        where = chat.Where(run_id, chat.source_label(source), node.host, log_file)
        command = chat.worker_command(node.python, run.run_dir, source, log_file, setup)

        async def start() -> chat.ChatSession:
            try:
                shell = await self.pool.shell(node)
            except ssh.NodeError as exc:
                raise chat.ChatError(f"{where}: cannot reach the node ({exc.reason})") from None
            # One worker per node: a model loaded again (a reload, another checkpoint) replaces the
            # last one instead of holding a second copy on the node's GPU until it is idle.
            await asyncio.gather(*(s.close() for s in list(self._chats.values()) if s.where.node == node.host),
                                 return_exceptions=True)

            async def stop_worker(pid: int) -> None:
                # Only a process that is still this run's chat worker (a pid can be reused).
                check = f"ps -o args= -p {int(pid)} | grep -qF -- {shlex.quote('launcher.chat --run-dir ' + run.run_dir)}"
                try:
                    await self.pool.run(node, f"{check} && kill -TERM {int(pid)}", timeout=30)
                except ssh.NodeError:
                    pass

            def ended(session: chat.ChatSession) -> None:
                self._chats.pop(session.id, None)
                self._ended_chats[session.id] = f"{session.where}: the chat session has ended ({session.ended})"

            try:
                session = await chat.ChatSession.start(shell, command, where, ended,
                                                       stop_worker=None if node.local else stop_worker)
            except ssh.NodeError as exc:
                raise chat.ChatError(f"{where}: cannot start the chat worker ({exc.reason})") from None
            self._chats[session.id] = session
            return session

        session = self._call(start())
        return session.id, {**session.ready, "node": node.host}

    def chat_reply(self, session_id: str, turns: Sequence[tuple[str, list[dict]]], max_new_tokens: int = 128,
                   temperature: float = 0.0, top_p: float = 1.0) -> Iterator[dict]:
        """The events of one exchange as they come: every (model, messages) answered at once, their
        `token` events interleaved and a `done` for each, each with `model`. A ChatError where the
        session has ended, the worker fails, or another exchange of the session is being answered."""
        session = self._chats.get(session_id)
        if session is None:
            why = self._ended_chats.get(session_id, "the chat session has ended")
            raise chat.ChatError(f"{why}; load the model again")
        return self._iterate(session.reply(turns, max_new_tokens, temperature, top_p))

    def chat_close(self, session_id: str) -> None:
        session = self._chats.get(session_id)
        if session is not None:
            self._call(session.close(), timeout=30)


def _find_node(cluster: Cluster, host: str):
    for node in cluster.nodes:
        if node.host == host:
            return node
    raise RunError(f"no node {host!r} in the cluster")


def _default_sink(engine) -> TelemetrySink:
    from backend.telemetry.ingest import Ingestor
    return Ingestor(engine)
