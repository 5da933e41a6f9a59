"""Two-node training over real OpenSSH servers on 127.0.0.2 / 127.0.0.3, through the RunManager.

One run goes through: launch → studio restart (re-attach) → stop (checkpoint, no process left)
→ resume → studio restart → completion with every step recorded. Another loses one node's
workers to SIGKILL and must fail within 30 s naming that node, leaving nothing behind.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
from sqlmodel import Session, select

from backend import cli
from backend.cluster import remote
from backend.job.cluster import Cluster
from backend.job.spec import JobSpec
from backend.runs.manager import RunManager, default_planner
from backend.store.telemetry_models import RunEvent
from launcher import checkpoint
from sshd import start_cluster
from worker import until

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def env(sshd_nodes, tiny_model, tmp_path):
    nodes, setups = sshd_nodes.nodes(), sshd_nodes.setups()

    def spec(max_steps: int, save_steps: int) -> JobSpec:
        return JobSpec(model=str(tiny_model), dataset=[str(ROOT / "assets" / "demo" / "train.jsonl")],
                       output_dir=str(tmp_path / "out"), nnodes=2, nproc_per_node=1, max_steps=max_steps,
                       save_steps=save_steps, logging_steps=1, torch_dtype="float32", max_length=64,
                       gradient_checkpointing=False, env={"OMP_NUM_THREADS": "1"})

    managers: list[RunManager] = []

    def manager() -> RunManager:
        m = RunManager(f"sqlite:///{tmp_path / 'studio.db'}", known_hosts=sshd_nodes.known_hosts)
        managers.append(m)
        return m

    yield Cluster(nodes), setups, spec, manager
    for m in managers:
        m.close()


def tagged(run_id: str) -> list[int]:
    """Pids on this machine (every loopback node is this machine) carrying the run's tag."""
    out = subprocess.run(["bash", "-c", remote.tagged_pids(run_id)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def agents(run_id: str) -> list[int]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "backend.telemetry.agent" in cmd and run_id in cmd:
            found.append(p.pid)
    return found


def train_steps(m: RunManager, run_id: str) -> list[int]:
    with Session(m.engine) as s:
        rows = s.exec(select(RunEvent).where(RunEvent.run_id == run_id, RunEvent.type == "train")).all()
    return sorted(json.loads(r.data)["step"] for r in rows)


def workers(m: RunManager, run_id: str, *nodes: str) -> list[psutil.Process]:
    """The training processes of the run on `nodes` (all when none is named). torchrun starts each
    worker in a session of its own: they are found as its children."""
    found = [p for proc in m.processes(run_id) if not nodes or proc.node in nodes
             for p in psutil.Process(proc.pgid).children(recursive=True)
             if "launcher.train" in p.cmdline() and "torch.distributed.run" not in p.cmdline()]
    assert found
    return found


def wait_step(m: RunManager, run_id: str, step: int, timeout: float = 120) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        m.sink.flush()
        steps = train_steps(m, run_id)
        if steps and steps[-1] >= step:
            return steps[-1]
        run = m.run(run_id)
        assert run.state in ("created", "checking", "launching", "running"), (run.state, run.message, run.log_tail)
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def term_pending(pid: int) -> bool:
    """Whether SIGTERM waits on the (stopped) process, sent to it or to its thread group."""
    masks = [int(line.split()[1], 16) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
             if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask & (1 << (signal.SIGTERM - 1)) for mask in masks)


def complete_checkpoints(run_dir: Path) -> list[int]:
    return [checkpoint.step_of(p) for p in checkpoint.complete_checkpoints(run_dir)]


def wait_gone(pred, timeout=15.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end and pred():
        time.sleep(0.2)
    return pred()


def test_run_restart_stop_resume_complete(env, sshd_nodes, capsys, monkeypatch):
    cluster, setups, spec_of, manager = env
    m = manager()
    max_steps = 120
    run_id = m.launch(spec_of(max_steps, save_steps=1000), cluster, name="e2e main", setups=setups)
    wait_step(m, run_id, 3, timeout=150)
    assert m.run(run_id).state == "running"
    procs = m.processes(run_id)
    assert [p.node for p in procs] == ["127.0.0.2", "127.0.0.3"] and all(p.pgid for p in procs)

    # The studio goes away mid-run; a new one re-attaches. The ranks are frozen meanwhile: the
    # run must still be mid-run when it is stopped (a close took long enough here, on 2 busy
    # cores, for all 120 steps to end first).
    frozen = workers(m, run_id)
    for p in frozen:
        p.send_signal(signal.SIGSTOP)
    m.close()
    m = manager()
    assert m.run(run_id).state == "running"
    assert any("re-attached" in n for n in m.notices(run_id))
    for p in frozen:
        p.send_signal(signal.SIGCONT)
    reached = wait_step(m, run_id, 8)

    # Stop: SIGTERM → the worker checkpoints → nothing of the run is left on either node. The ranks
    # are frozen until the stop's SIGTERM waits on them, so it lands mid-run however busy the cores.
    frozen = workers(m, run_id)
    for p in frozen:
        p.send_signal(signal.SIGSTOP)
    m.stop(run_id, wait=False)
    until(lambda: all(term_pending(p.pid) for p in frozen), timeout=60, every=0.05, name="the stop's SIGTERM")
    for p in frozen:
        p.send_signal(signal.SIGCONT)
    run = m.wait(run_id, timeout=120)
    assert run.state == "stopped", (run.message, run.log_tail)
    run_dir = Path(run.run_dir)
    checkpoints = complete_checkpoints(run_dir)
    assert checkpoints and checkpoints[-1] >= reached, checkpoints
    assert tagged(run_id) == []
    assert not wait_gone(lambda: agents(run_id)), agents(run_id)
    stopped_at = checkpoints[-1]
    assert stopped_at < max_steps

    # Resume from that checkpoint; restart the studio again mid-run; the run completes.
    m.resume(run_id)
    wait_step(m, run_id, stopped_at + 2)
    m.close()
    m = manager()
    run = m.wait(run_id, timeout=150)
    assert run.state == "succeeded", (run.message, run.log_tail)
    assert run.attempts == 2 and [a.state for a in m.attempts(run_id)] == ["stopped", "succeeded"]
    m.sink.flush()
    assert set(train_steps(m, run_id)) == set(range(1, max_steps + 1))
    with Session(m.engine) as s:
        starts = [json.loads(r.data) for r in s.exec(select(RunEvent).where(
            RunEvent.run_id == run_id, RunEvent.type == "start")).all()]
    assert sorted((st["resumed_from"] or 0) for st in starts) == [0, stopped_at]
    assert m.progress(run_id)["step"] == max_steps and m.progress(run_id)["resumed_from"] == stopped_at
    assert [step for step, _ in m.checkpoints(run_id)][-1] == stopped_at
    assert tagged(run_id) == []
    assert not wait_gone(lambda: agents(run_id)), agents(run_id)
    assert any(line.strip() for line in m.log_tail(run_id, node="127.0.0.3", lines=5))

    exported = m.export(run_id)
    assert Path(exported["out"]).is_dir() and isinstance(exported["sample"], str)

    # the CLI reads the same database
    db = str(m.engine.url)
    assert cli.main(["status", run_id, "--db", db]) == 0
    assert "succeeded (attempt 2" in capsys.readouterr().out
    monkeypatch.setenv("SWIFT_STUDIO_KNOWN_HOSTS", str(sshd_nodes.known_hosts))
    assert cli.main(["logs", run_id, "--node", "127.0.0.3", "--lines", "3", "--db", db]) == 0
    assert capsys.readouterr().out.strip()
    assert cli.main(["logs", run_id, "--node", "nope", "--db", db]) == 1
    assert "has no node 'nope'" in capsys.readouterr().err


def test_sigkill_of_one_node_fails_the_run_naming_it(env):
    cluster, setups, spec_of, manager = env
    m = manager()
    run_id = m.launch(spec_of(100_000, save_steps=100_000), cluster, name="e2e kill", setups=setups)
    wait_step(m, run_id, 2, timeout=150)
    victims = workers(m, run_id, "127.0.0.3")
    killed_at = time.monotonic()
    for p in victims:
        os.kill(p.pid, signal.SIGKILL)
    run = m.wait(run_id, timeout=30)
    took = time.monotonic() - killed_at
    assert run.state == "failed" and took <= 30, (run.state, took)
    assert run.failed_node == "127.0.0.3", (run.failed_node, run.message)
    assert run.cause == "killed", run.message
    assert "127.0.0.3" in run.message and run.log_tail
    # nothing of the run remains on either node
    assert tagged(run_id) == []
    assert not wait_gone(lambda: agents(run_id)), agents(run_id)


# A stand-in worker: the watch is what is tested. Each node's publishes its pid; one whose peer
# (the other node's) is gone says what a rank says when its peer's node dies, and exits 1.
STANDIN = """\
import os, sys, time
me = os.environ["SWIFT_STUDIO_NODE"]
open(f"standin-{me}.pid", "w").write(str(os.getpid()))
end = time.time() + 120
while time.time() < end:
    time.sleep(0.2)
    for name in os.listdir("."):
        if name.startswith("standin-") and name != f"standin-{me}.pid":
            pid = int(open(name).read() or 0)
            if pid and not os.path.exists(f"/proc/{pid}"):
                print("RuntimeError: [gloo] Connection closed by peer [127.0.0.4]:41000", file=sys.stderr)
                sys.exit(1)
"""


@pytest.fixture
def lonely_run(sshd_nodes, tmp_path):
    """A running two-node run of stand-in workers on 127.0.0.2 and a node of its own (127.0.0.4,
    whose SSH a test may cut): (manager, run id, the node's sshd, the database url)."""
    lonely = start_cluster(tmp_path / "ssh4", 1, first=4)
    nodes = (sshd_nodes.nodes()[0], *lonely.nodes())
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(sshd_nodes.known_hosts.read_text() + lonely.known_hosts.read_text())

    def planner(spec, cluster, req):
        real = default_planner(spec, cluster, req)
        nodes = tuple(replace(n, argv=(sys.executable, f"{req.run_dir}/standin.py")) for n in real.nodes)
        return replace(real, nodes=nodes, files={**real.files, "standin.py": STANDIN})

    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    m = RunManager(db, known_hosts=known_hosts, planner=planner)
    run_id = None
    try:
        spec = JobSpec(model=str(ROOT / "assets" / "demo" / "model"), dataset=[str(ROOT / "assets" / "demo" / "train.jsonl")],
                       output_dir=str(tmp_path / "out"), nnodes=2, nproc_per_node=1)
        run_id = m.launch(spec, Cluster(nodes), setups={n.host: sshd_nodes.setup for n in nodes})
        m.wait(run_id, timeout=60, states=("running", "failed"))
        assert m.run(run_id).state == "running", m.run(run_id).message
        yield m, run_id, lonely, db
    finally:
        m.close()
        for pid in tagged(run_id) if run_id else []:  # what the unreachable "node" left behind (it is this machine)
            os.kill(pid, signal.SIGKILL)
        lonely.stop()


def test_unreachable_node_is_reported_within_30_s(lonely_run):
    """A node whose SSH goes away (its workers still running) fails the run as unreachable."""
    m, run_id, lonely, _ = lonely_run
    # The node's SSH goes away: the server and its per-connection sshd processes (only those: the
    # shells under them see the connection close); the workers live on.
    cut = time.monotonic()
    lonely.cut_connections(stop_listeners=True)
    try:
        run = m.wait(run_id, timeout=40)
    except TimeoutError:  # what the watch saw of each node, and the sshd processes left
        import psutil
        watch = m.driver.watchers.get(run_id)
        seen = [(n.host, n.alive, n.last_seen - time.time(), n.unreachable_since, n.next_probe - time.time())
                for n in (watch.nodes if watch else [])]
        left = [(p.pid, p.name(), p.cmdline()) for p in psutil.process_iter() if p.name().startswith("sshd")]
        raise AssertionError(f"watch: {seen}; notices: {m.notices(run_id)}; sshd processes: {left}") from None
    took = time.monotonic() - cut
    assert run.state == "failed" and run.cause == "node_unreachable", (run.state, run.message)
    assert run.failed_node == "127.0.0.4" and took <= 30, (run.failed_node, took)
    assert "could not verify" in run.message  # the orphaned workers there are named, not hidden
    assert {p.node: p.state for p in m.processes(run_id)}["127.0.0.4"] == "unreachable"


def test_a_dead_node_is_blamed_not_the_node_that_lost_its_peer(lonely_run, tmp_path):
    """The node's SSH and workers die; the other node's workers then fail as peer lost at once,
    long before the dead node's silence reaches NODE_SILENT_S: the dead node is the cause."""
    m, run_id, lonely, _ = lonely_run
    lonely.cut_connections(stop_listeners=True)
    os.kill(int((Path(m.run(run_id).run_dir) / "standin-127.0.0.4.pid").read_text()), signal.SIGKILL)
    run = m.wait(run_id, timeout=40)
    assert run.state == "failed" and run.cause == "node_unreachable", (run.state, run.cause, run.message)
    assert run.failed_node == "127.0.0.4", (run.failed_node, run.message)
    assert {p.node: p.state for p in m.processes(run_id)} == {"127.0.0.2": "exited", "127.0.0.4": "unreachable"}


def test_a_detached_run_fails_on_a_silent_node_under_short_cli_calls(lonely_run, monkeypatch):
    """The run's watcher is gone (a `run --detach`); `status` calls, each a short process, re-attach
    in turn. The node's silence counts from the first call that met it, so one of them fails the
    run within 30 s; the re-attach notice is not repeated by every call."""
    m, run_id, lonely, db = lonely_run
    m.close()
    monkeypatch.setenv("SWIFT_STUDIO_KNOWN_HOSTS", str(Path(db.removeprefix("sqlite:///")).parent / "known_hosts"))
    cut = time.monotonic()
    lonely.cut_connections(stop_listeners=True)
    outputs = []
    while time.monotonic() - cut < 45:
        out = subprocess.run([sys.executable, "-m", "backend.cli", "status", run_id, "--db", db], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        outputs.append(out.stdout + out.stderr)
        if "failed" in out.stdout.splitlines()[0]:
            break
    took = time.monotonic() - cut
    assert "failed" in outputs[-1].splitlines()[0] and took <= 30, (took, outputs)
    assert "127.0.0.4" in outputs[-1] and "no answer over SSH" in outputs[-1], outputs[-1]
    assert any("node 127.0.0.4: unreachable" in o for o in outputs[:-1]), outputs
    assert outputs[-1].count("re-attached") == 1, outputs[-1]
