"""Watch one attempt's node processes until the run ends.

Every `WATCH_INTERVAL_S` each node is asked whether its torchrun group is alive and, once it
ended, for its exit code (`pids/<node>.exit`). A failed node stops the others (no orphans left
holding GPUs); a node that does not answer is retried with backoff and reported as unreachable
once it has been silent for `NODE_SILENT_S`. Next to the workers the node agent streams telemetry
over its own SSH channel; a dropped channel is reopened from the acknowledged offsets, so
training never depends on the connection.
"""
from __future__ import annotations

import asyncio
import json
import logging
import shlex
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

import asyncssh

from backend.cluster import launch, remote, ssh
from backend.cluster.launch import Started
from backend.cluster.nodes import Pool
from backend.job import flight
from backend.job.cluster import Node
from backend.runs.lifecycle import Failure
from backend.telemetry import logclass
from backend.telemetry.ingest import TelemetrySink

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 2.0
NODE_SILENT_S = 15.0         # + one interval and a probe timeout stays within the 30 s promise
PROBE_TIMEOUT_S = 8.0
SETTLE_S = 1.5               # after a first failure, let the others' exits land before choosing the cause
FAIL_STOP_GRACE_S = 10.0     # the other nodes after a failure (a checkpoint may not be possible)
HANG_STOP_GRACE_S = 3.0      # a hung run: no rank can reach the step boundary a checkpoint needs
FLIGHT_WAIT_S = 8.0          # a hung run, before its stop: for every rank to answer the flight recorder request
TAIL_LINES = 40
CAUSE_LINES = 200            # of the log, read for a cause when no rank reported one (torchrun's summary is ~45)
AGENT_RETRY_MAX_S = 8.0
AGENT_DRAIN_S = 15.0         # after the workers end, time for the agents' last lines


@dataclass
class NodeWatch:
    started: Started
    proc_id: int | None = None
    last_seen: float = field(default_factory=time.time)
    alive: bool = True
    exit_code: int | None = None
    next_probe: float = 0.0
    backoff: float = WATCH_INTERVAL_S
    unreachable_since: float | None = None

    @property
    def host(self) -> str:
        return self.started.node.host

    @property
    def done(self) -> bool:
        return not self.alive

    @property
    def state(self) -> str:
        """As the run's process records show it: running / unreachable / exited."""
        if not self.alive:
            return "exited"
        return "running" if self.unreachable_since is None else "unreachable"


@dataclass
class Outcome:
    state: str                      # succeeded / failed / stopped
    failure: Failure | None = None


def failure_from(node: str, exit_code: int | None, tail: list[str],
                 ends: Sequence[dict] = ()) -> tuple[logclass.Cause, Failure]:
    """A node's failure: from its ranks' own reports (`ends`, their `end` events) when one
    failed, the strongest and then the earliest; else from its log tail and exit code."""
    reported = [(c, e) for e in ends if (c := logclass.classify_end(e))]
    if reported:
        cause = max(reported, key=lambda ce: (ce[0].priority, -_number(ce[1].get("time"))))[0]
        # The worker's message is the text; the exit code (the UI shows it) would only repeat it.
        message = logclass.describe(cause, node)
    else:
        cause = logclass.classify_tail(tail, exit_code)
        if exit_code is None and cause.kind == logclass.UNKNOWN:
            cause = logclass.Cause(logclass.KILLED, "the node's torchrun ended without an exit code (killed)")
        message = logclass.describe(cause, node, exit_code)
    return cause, Failure(node, exit_code, cause.kind, message, "\n".join(logclass.shown_tail(tail)[-TAIL_LINES:]))


def ends_of(host: str, pgid: int | None, slots: list[dict]) -> list[dict]:
    """The slots this attempt's ranks on `host` wrote: same torchrun group, same node name (a
    shared run directory holds every node's, and an earlier attempt's until overwritten)."""
    name = remote.node_file_name(host)
    return [e for e in slots if e.get("pgid") == pgid and e.get("node") in (name, None)]


def agent_record(line: str | bytes) -> dict | None:
    """One line of a node agent's output as the sink takes it; None for anything else (a
    shell's or a library's stray output on the same stream)."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


async def ask_flight_recorders(pool: Pool, shells: Sequence[tuple[Node, str | None]], run_dir: str,
                               sink: TelemetrySink, run_id: str, started_at: float, finding,
                               read: Callable[[], Awaitable[None]] | None = None):
    """Before a hung attempt is stopped: ask every rank for its flight recorder (the request file
    of `backend.job.flight`, written through each shell into the run directory, each write within
    PROBE_TIMEOUT_S: a node may be the hung part), wait until each rank that can answer has (at
    most FLIGHT_WAIT_S), and return the hang rule's finding again, now naming the collective the
    ranks wait in and the rank they wait for; None if a step came meanwhile (not hung after all).
    Where no request could be written, the finding as it was. `read` brings the agents' lines in,
    where no task streams them (a Slurm job's agents write files)."""
    request = f"{run_id}@{time.time():.6f}"

    async def write(node: Node, setup: str | None) -> None:
        await ssh.within(launch.write_files(pool, node, setup, run_dir, {flight.REQUEST: request + "\n"}),
                         PROBE_TIMEOUT_S)

    written = await asyncio.gather(*(write(node, setup) for node, setup in shells), return_exceptions=True)
    if all(isinstance(w, BaseException) for w in written):
        return finding
    asked = time.time()
    while time.time() - asked < FLIGHT_WAIT_S and sink.awaiting_flight(run_id, request):
        await asyncio.sleep(0.5)
        if read is not None:
            await read()
    return sink.hang(run_id, started_at)


def choose_root(failures: list[tuple[logclass.Cause, Failure, float]]) -> Failure:
    """The failure most likely to be the cause: strongest cause first, then earliest."""
    return max(failures, key=lambda f: (f[0].priority, -f[2]))[1]


class AttemptWatcher:
    def __init__(self, pool: Pool, run_id: str, run_dir: str, nodes: list[NodeWatch],
                 stop_requested: Callable[[], bool], on_update: Callable[[NodeWatch], None],
                 sink: TelemetrySink | None = None, on_notice: Callable[[str], None] | None = None,
                 attempt: int | None = None, started_at: float | None = None):
        """`sink` takes the agents' lines (offsets let a new agent continue without gaps), each with
        `attempt`, so the steps a resumed attempt does again replace the earlier attempt's."""
        self.pool, self.run_id, self.run_dir, self.nodes = pool, run_id, run_dir, nodes
        self.attempt = attempt
        self.stop_requested = stop_requested
        self.on_update = on_update
        self.on_notice = on_notice or (lambda msg: log.warning("%s: %s", run_id, msg))
        self.sink = sink
        self._agents: list[asyncio.Task] = []
        self._ended = asyncio.Event()
        # The attempt's start: its hang limit counts from here until its first step.
        self.started_at = started_at or time.time()
        # Set once every node has been asked (or the attempt ended): the state shown is current.
        self.first_pass = asyncio.Event()

    async def run(self) -> Outcome | None:
        """Watch until the attempt ends; None when a stop was requested (the stopper finishes it)."""
        if self.sink is not None:
            self._agents = [asyncio.create_task(self._agent(n)) for n in self.nodes]
        try:
            return await self._watch()
        finally:
            self.first_pass.set()
            self._ended.set()

    async def drain(self) -> None:
        """After the outcome is recorded: let the agents send their last lines, then end them."""
        if self._agents:
            await asyncio.wait(self._agents, timeout=AGENT_DRAIN_S)
            for task in self._agents:
                task.cancel()
            await asyncio.gather(*self._agents, return_exceptions=True)

    async def _watch(self) -> Outcome | None:
        while True:
            if self.stop_requested():
                return None
            now = time.time()
            due = [n for n in self.nodes if not n.done and now >= n.next_probe]
            await asyncio.gather(*(self._probe(n) for n in due))
            if self.stop_requested():
                return None
            now = time.time()
            lost = [n for n in self.nodes if n.unreachable_since is not None
                    and now - n.unreachable_since >= NODE_SILENT_S]
            failed = [n for n in self.nodes if n.done and n.exit_code != 0]
            if lost or failed:
                return await self._fail(lost, failed)
            if all(n.done for n in self.nodes):
                return Outcome("succeeded")
            hung = self.sink.hang(self.run_id, self.started_at) if self.sink is not None else None
            outcome = await self._hung(hung) if hung is not None else None
            if outcome is not None:
                return outcome
            self.first_pass.set()
            next_probe = min(n.next_probe for n in self.nodes if not n.done)
            await asyncio.sleep(max(0.05, next_probe - time.time()))

    async def _probe(self, n: NodeWatch) -> None:
        asked = time.time()
        try:
            alive, code = await ssh.within(launch.probe(self.pool, n.started.node, n.started.pgid, self.run_dir),
                                           PROBE_TIMEOUT_S)
        except (ssh.NodeError, asyncio.TimeoutError) as exc:
            if isinstance(exc, ssh.Unreachable):
                # A slow answer keeps the connection (keepalives find dead ones); a lost one is reopened.
                await self.pool.drop(n.started.node)
            if n.unreachable_since is None:
                n.unreachable_since = asked
                self.on_notice(f"node {n.host} is not answering ({_why(exc)}); retrying")
                self.on_update(n)
            n.backoff = min(n.backoff * 2, 8.0)
            # Never back off past the moment the node must be declared lost.
            n.next_probe = min(time.time() + n.backoff, n.unreachable_since + NODE_SILENT_S)
            return
        changed = (n.alive, n.exit_code) != (alive, code) or n.unreachable_since is not None
        if n.unreachable_since is not None:
            self.on_notice(f"node {n.host} answers again after {time.time() - n.unreachable_since:.0f} s")
        n.unreachable_since = None
        n.backoff = WATCH_INTERVAL_S
        n.last_seen = time.time()
        n.next_probe = n.last_seen + WATCH_INTERVAL_S
        n.alive, n.exit_code = alive, code
        if not alive and code is None:
            # The group is gone without its wrapper writing an exit code: killed (or the file
            # is on storage not yet visible); give the file one more look.
            await asyncio.sleep(0.3)
            try:
                _, n.exit_code = await launch.probe(self.pool, n.started.node, n.started.pgid, self.run_dir)
            except ssh.NodeError:
                pass
        if changed:
            self.on_update(n)

    async def _fail(self, lost: list[NodeWatch], failed: list[NodeWatch]) -> Outcome:
        # Let the consequences land (the other nodes' exits) so the root cause can be told apart.
        await asyncio.sleep(SETTLE_S)
        pending = [n for n in self.nodes if not n.done and n not in lost]
        await asyncio.gather(*(self._probe(n) for n in pending))
        # A node that stopped answering is a cause whether or not its silence has reached
        # NODE_SILENT_S yet: the others' "peer lost" is what its death looks like from them.
        lost = [n for n in self.nodes if not n.done and n.unreachable_since is not None]
        failed = [n for n in self.nodes if n.done and n.exit_code != 0]
        reads = await asyncio.gather(*(self._read_failure(n) for n in failed))
        slots = [e for _, ends in reads for e in ends]
        candidates = []
        for n, (tail, _) in zip(failed, reads):
            cause, failure = failure_from(n.host, n.exit_code, tail, ends_of(n.host, n.started.pgid, slots))
            candidates.append((cause, failure, n.last_seen))
        for n in lost:
            cause = logclass.Cause(logclass.NODE_UNREACHABLE,
                                   f"no answer over SSH for {time.time() - (n.unreachable_since or n.last_seen):.0f} s")
            candidates.append((cause, Failure(n.host, None, cause.kind, logclass.describe(cause, n.host), ""), n.last_seen))
        # Stop whatever is still running anywhere; a lost node is tried too (it may answer again).
        return await self._stopped_with(choose_root(candidates), FAIL_STOP_GRACE_S)

    async def _hung(self, finding) -> Outcome | None:
        """The ranks made no step within the job's hang limit: stop them all (SIGTERM lets them
        log; none can reach the step boundary a checkpoint needs, so SIGKILL follows soon) and fail
        the attempt with the hang rule's diagnosis, which names the rank and collective where it
        can. None: a step came while the ranks were asked, and the watch goes on."""
        finding = await ask_flight_recorders(self.pool, [(n.started.node, n.started.setup) for n in self.nodes],
                                             self.run_dir, self.sink, self.run_id, self.started_at, finding)
        if finding is None:
            return None
        self.sink.stopping_hung(self.run_id, self.attempt, finding)
        cause = logclass.Cause(logclass.HANG, finding.message, finding.rank)
        return await self._stopped_with(Failure(finding.node, None, logclass.HANG, logclass.describe(cause, finding.node)),
                                        HANG_STOP_GRACE_S, timed=True)

    async def _stopped_with(self, failure: Failure, grace_s: float, timed: bool = False) -> Outcome:
        """The attempt failed with `failure`: stop every node's group (SIGKILL after `grace_s`); the
        failure says what the cleanup could not verify and, `timed`, how long the stop took."""
        started = time.time()
        report = await launch.stop_all(self.pool, [n.started for n in self.nodes if n.started.pgid], self.run_id,
                                       self.run_dir, grace_s=grace_s)
        for n in self.nodes:
            if n.alive and n.host not in report.unreachable:
                n.alive = False
                self.on_update(n)
            elif n.alive and n.unreachable_since is None:
                n.unreachable_since = time.time()
                self.on_update(n)
        message = failure.message
        if timed:
            message += f"; stopped its ranks in {time.time() - started:.0f} s"
        if not report.clean:
            message += f" [cleanup: {report.detail()}]"
        return Outcome("failed", replace(failure, message=message))

    async def _read_failure(self, n: NodeWatch) -> tuple[list[str], list[dict]]:
        """(log tail, end slots) as the node sees them; what cannot be read is empty."""
        async def read(coro):
            try:
                return await coro
            except ssh.NodeError:
                return []

        node = n.started.node
        tail, slots = await asyncio.gather(read(launch.log_tail(self.pool, node, self.run_dir, CAUSE_LINES)),
                                           read(launch.end_slots(self.pool, node, self.run_dir)))
        return tail, slots

    async def _agent(self, n: NodeWatch) -> None:
        """Keep one agent streaming from the node for as long as the attempt runs."""
        node, name = n.started.node, remote.node_file_name(n.host)
        delay = 0.5
        last_try = False
        sink_failing = False
        while True:
            stream = None
            try:
                offsets = self.sink.offsets(self.run_id, name, self.attempt)
                argv = [node.python, "-m", "backend.telemetry.agent", "--run-id", self.run_id,
                        "--run-dir", self.run_dir, "--node", name, "--offsets", json.dumps(offsets)]
                shell = await self.pool.shell(node)
                errlog = f"{self.run_dir}/logs/agent-{name}.log"
                command = f"{remote.quote_argv(argv)} 2>> {shlex.quote(errlog)}"
                stream = await shell.stream(remote.with_setup(n.started.setup, command))
                async for line in stream:
                    obj = agent_record(line)
                    if obj is None:
                        continue
                    self.sink.on_agent_line(self.run_id, name, obj, attempt=self.attempt)
                    delay = 0.5
                    if sink_failing:
                        sink_failing = False
                        self.on_notice(f"telemetry from {n.host} is stored again")
                    if obj.get("kind") == "bye":
                        return
            except (ssh.NodeError, OSError, asyncssh.Error) as exc:
                log.info("agent stream from %s ended: %s", n.host, exc)
            except Exception as exc:  # noqa: BLE001 - the store failed (a locked or full database)
                # Telemetry must not end for the rest of the run on one failed write while the
                # workers go on training: a new agent starts from the offsets the store committed.
                log.exception("storing telemetry from %s failed", n.host)
                if not sink_failing:
                    sink_failing = True
                    self.on_notice(f"telemetry from {n.host} could not be stored ({type(exc).__name__}: {exc}); "
                                   "retrying")
            finally:
                if stream is not None:
                    await stream.close()
            if self._ended.is_set():
                if last_try or n.unreachable_since is not None:
                    return
                # The attempt is over but this stream ended without its final lines: one more
                # agent reads what is left (it exits at once, the workers being gone).
                last_try = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, AGENT_RETRY_MAX_S)


def _why(exc: BaseException) -> str:
    if isinstance(exc, ssh.NodeError):
        return exc.reason
    return "no answer within %.0f s" % PROBE_TIMEOUT_S
