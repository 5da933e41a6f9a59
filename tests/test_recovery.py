"""Automatic recovery's decisions (backend.runs.recovery, pure) and the attempts' timeline."""
from __future__ import annotations

from backend.job.cluster import Node
from backend.job.spec import JobSpec
from backend.runs.lifecycle import attempt_history, attempt_timeline
from backend.runs.recovery import NoRestart, Restart, decide
from backend.store.models import Attempt

A, B = (Node(host=h, slots=1, device="cpu") for h in ("a", "b"))
MEMBERS = [(A, "source venv/bin/activate"), (B, None)]


def spec(restarts: int = 2) -> JobSpec:
    return JobSpec(model="m", dataset=["d"], nnodes=2, max_restarts=restarts)


def attempt(number: int, cause: str | None = "killed", node: str | None = "b", automatic: bool = False,
            state: str = "failed") -> Attempt:
    return Attempt(run_id="r", number=number, state=state, cause=cause, failed_node=node, automatic=automatic,
                   resume_from="latest" if number > 1 else None, started_at=100.0 * number,
                   ended_at=100.0 * number + 50)


def test_recovery_is_off_unless_the_job_asks():
    assert decide(spec(0), [attempt(1)], MEMBERS, progressed=True) is None


def test_a_curable_failure_restarts_on_the_same_nodes():
    restart = decide(spec(), [attempt(1, "nccl_timeout")], MEMBERS, progressed=True)
    assert restart == Restart(1, tuple(MEMBERS), None)
    assert decide(spec(), [attempt(1, "hang", "a")], MEMBERS, progressed=True).nodes == tuple(MEMBERS)


def test_what_a_restart_cannot_cure_is_not_retried():
    for cause in ("out_of_memory", "data_error", "config_error", "diverged", "disk_full", "unknown", None):
        decision = decide(spec(), [attempt(1, cause)], MEMBERS, progressed=True)
        assert isinstance(decision, NoRestart) and "is not cured by a restart" in decision.why, cause


def test_a_node_that_failed_twice_is_left_out_and_the_budget_counts_since_the_users_start():
    history = [attempt(1), attempt(2, automatic=True)]
    assert decide(spec(), history, MEMBERS, progressed=True) == Restart(2, ((A, "source venv/bin/activate"),), "b")
    # another node each time: nobody is left out
    assert decide(spec(), [attempt(1, node="a"), attempt(2, automatic=True)], MEMBERS, progressed=True).left_out is None
    used = decide(spec(), [*history, attempt(3, automatic=True)], MEMBERS, progressed=True)
    assert isinstance(used, NoRestart) and "the 2 automatic restarts (max_restarts) are used up" == used.why
    # a manual resume starts a new budget (and forgets the failures before it)
    again = decide(spec(), [*history, attempt(3, automatic=True), attempt(4)], MEMBERS, progressed=True)
    assert again == Restart(1, tuple(MEMBERS), None)
    alone = decide(spec(), [attempt(1), attempt(2, automatic=True)], [(B, None)], progressed=True)
    assert isinstance(alone, NoRestart) and "no other node is left" in alone.why
    # on Slurm the partition, not the allocation, holds the other nodes: the node is named to exclude
    assert decide(spec(), [attempt(1), attempt(2, automatic=True)], None, progressed=True) == Restart(2, (), "b")


def test_a_restart_that_failed_before_its_first_step_is_not_repeated():
    decision = decide(spec(), [attempt(1, node="a"), attempt(2, automatic=True)], MEMBERS, progressed=False)
    assert isinstance(decision, NoRestart) and "before its first step" in decision.why
    # the user's own attempt may fail before a step (a node lost while loading): that one is retried
    assert isinstance(decide(spec(), [attempt(1)], MEMBERS, progressed=False), Restart)


def test_the_timeline_says_how_each_attempt_started_and_ended():
    lines = attempt_timeline([attempt(1), attempt(2, automatic=True), attempt(3, None, None, state="running")])
    assert lines[0].startswith("attempt 1 (launch, ") and lines[0].endswith("failed, killed on node b")
    assert lines[1].startswith("attempt 2 (automatic restart, ")
    assert lines[2].endswith(": running")


# -- end to end: two nodes over real OpenSSH servers (127.0.0.2, 127.0.0.3) -----------------------

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import psutil  # noqa: E402
import pytest  # noqa: E402
from sqlmodel import Session, select  # noqa: E402

from backend.job.cluster import Cluster  # noqa: E402
from backend.runs.manager import RunManager  # noqa: E402
from backend.store.telemetry_models import RunEvent  # noqa: E402
from studio.run_view import status_md  # noqa: E402
from worker import until  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cluster_run(sshd_nodes, tiny_model, tmp_path):
    """A manager on the two-node cluster and a job maker for it."""
    m = RunManager(f"sqlite:///{tmp_path / 'studio.db'}", known_hosts=sshd_nodes.known_hosts)

    def job(**over) -> JobSpec:
        return JobSpec(model=str(tiny_model), dataset=[str(ROOT / "assets" / "demo" / "train.jsonl")],
                       output_dir=str(tmp_path / "out"), nnodes=2, nproc_per_node=1, logging_steps=1, save_steps=3,
                       torch_dtype="float32", max_length=64, gradient_checkpointing=False,
                       env={"OMP_NUM_THREADS": "1"}, **over)

    yield m, Cluster(sshd_nodes.nodes()), sshd_nodes.setups(), job
    m.close()


def train_events(m: RunManager, run_id: str, attempt: int | None = None) -> list[dict]:
    m.sink.flush()
    with Session(m.engine) as s:
        q = select(RunEvent).where(RunEvent.run_id == run_id, RunEvent.type == "train")
        if attempt is not None:
            q = q.where(RunEvent.attempt == attempt)
        return [{**json.loads(r.data), "attempt": r.attempt} for r in s.exec(q).all()]


def wait_for(what: str, pred, m: RunManager, run_id: str, timeout: float = 120):
    """`pred()` once truthy; on time-out the run's state, attempts and notices say why not."""
    def state() -> str:
        run = m.run(run_id)
        return "\n".join([f"run {run.state} attempt {run.attempts}: {run.message}",
                          *attempt_timeline(m.attempts(run_id)), *m.notices(run_id)])

    return until(pred, timeout, every=0.2, name=what, why=state)


def first_step_of(m: RunManager, run_id: str, attempt: int) -> float | None:
    times = [e["time"] for e in train_events(m, run_id, attempt)]
    return min(times) if times else None


def workers_on(m: RunManager, run_id: str, node: str) -> list[psutil.Process]:
    """The training processes of the run's current attempt on `node` (every node is this machine)."""
    group = next(p for p in m.processes(run_id) if p.node == node)
    return [p for p in psutil.Process(group.pgid).children(recursive=True)
            if "launcher.train" in p.cmdline() and "torch.distributed.run" not in p.cmdline()]


@pytest.mark.e2e
def test_a_killed_node_is_restarted_then_left_out_after_its_second_failure(cluster_run, capsys):
    m, cluster, setups, job = cluster_run
    run_id = m.launch(job(max_steps=70, max_restarts=2), cluster, name="recovery", setups=setups)
    figures = []
    for attempt in (1, 2):
        wait_for(f"attempt {attempt}'s steps", lambda: len(train_events(m, run_id, attempt)) >= 4, m, run_id, 150)
        killed = time.time()
        for p in workers_on(m, run_id, "127.0.0.3"):
            os.kill(p.pid, signal.SIGKILL)
        wait_for(f"attempt {attempt + 1}", lambda: len(m.attempts(run_id)) > attempt, m, run_id, 60)
        failed = m.attempts(run_id)[attempt - 1]
        assert (failed.state, failed.cause, failed.failed_node) == ("failed", "killed", "127.0.0.3"), failed
        first = wait_for(f"attempt {attempt + 1}'s first step", lambda: first_step_of(m, run_id, attempt + 1),
                         m, run_id, 150)
        figures.append((failed.ended_at - killed, m.attempts(run_id)[attempt].started_at - killed, first - killed))
    run = m.wait(run_id, timeout=180)
    assert run.state == "succeeded", (run.state, run.message)
    first, second, third = m.attempts(run_id)
    assert (second.automatic, third.automatic) == (True, True) and second.resume_from == "latest"
    assert [n["host"] for n in json.loads(second.cluster_json)] == ["127.0.0.2", "127.0.0.3"]
    assert [n["host"] for n in json.loads(third.cluster_json)] == ["127.0.0.2"]  # left out after two failures
    assert spec_of_run(m, run_id).nnodes == 1
    notices = "\n".join(m.notices(run_id))
    assert "automatic restart 1 of 2 after killed on node 127.0.0.3" in notices
    assert "left out node 127.0.0.3 (it failed twice): re-planned on 1 node(s)" in notices
    # Each attempt went on from the newest checkpoint, and the last one reached max_steps.
    steps = {e["attempt"]: sorted(e["step"] for e in train_events(m, run_id, e["attempt"]))
             for e in train_events(m, run_id)}
    assert steps[2][0] > 1 and steps[3][0] > steps[2][0] and steps[3][-1] == 70, steps
    # `swift-studio status` (another process would read the same database) shows the timeline.
    from backend import cli

    assert cli.main(["status", run_id, "--db", str(m.engine.url)]) == 0
    status = capsys.readouterr().out
    assert "succeeded (attempt 3" in status
    assert "attempt 1 (launch, " in status and ": failed, killed on node 127.0.0.3" in status
    assert "attempt 3 (automatic restart, " in status and status.count("(automatic restart, ") == 2
    # the recovery decisions are stored, so a process that did not drive the run shows them
    assert "notice" in status and "automatic restart 2 of 2 after killed on node 127.0.0.3; left out" in status
    # The Monitor's head, as the studio renders it from the same database.
    monitor = status_md(m.run(run_id), m.progress(run_id), m.notices(run_id), m.layout(run_id),
                        attempts=attempt_history(m.attempts(run_id)))
    assert "attempt 2 (automatic restart, " in monitor and "left out node 127.0.0.3 (it failed twice)" in monitor
    with capsys.disabled():
        print("\n" + status + "\n\nMonitor:\n" + monitor)
        for n, (detected, restarted, stepped) in enumerate(figures, 1):
            print(f"\nrecovery kill {n}: failure recorded {detected:.1f} s after SIGKILL, next attempt started at "
                  f"{restarted:.1f} s, its first step at {stepped:.1f} s")


def spec_of_run(m: RunManager, run_id: str) -> JobSpec:
    from backend.runs.driver import spec_of

    return spec_of(m.run(run_id))


@pytest.mark.e2e
def test_a_hung_rank_is_stopped_and_the_run_restarted(cluster_run, capsys):
    """A rank stopped with SIGSTOP: its peer waits in the collective for ever (gloo's timeout is
    ddp_timeout, 30 minutes); the watch stops both within the job's hang limit and restarts."""
    m, cluster, setups, job = cluster_run
    run_id = m.launch(job(max_steps=50, max_restarts=1, hang_timeout_s=10), cluster, name="hang", setups=setups)
    wait_for("steps", lambda: len(train_events(m, run_id, 1)) >= 4, m, run_id, 150)
    [worker] = workers_on(m, run_id, "127.0.0.3")
    stopped = time.time()
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        wait_for("attempt 2", lambda: len(m.attempts(run_id)) > 1, m, run_id, 90)
    finally:
        if worker.is_running():
            os.kill(worker.pid, signal.SIGKILL)
    hung = m.attempts(run_id)[0]
    assert (hung.state, hung.cause) == ("failed", "hang"), hung
    assert "no training step for" in hung.message and "stopped its ranks" in hung.message, hung.message
    # gloo logs no step ahead on either rank: the stopped process names the rank and its node
    assert hung.failed_node == "127.0.0.3" and "hang (node 127.0.0.3, rank 1)" in hung.message, hung.message
    assert "has been stopped (SIGSTOP, a debugger or job control) for" in hung.message, hung.message
    # asked before the stop, the rank that still runs answers from its flight recorder
    assert "flight recorder: rank 0 waits in gloo:" in hung.message, hung.message
    assert "no flight recorder answer from rank 1" in hung.message, hung.message
    first = wait_for("attempt 2's first step", lambda: first_step_of(m, run_id, 2), m, run_id, 150)
    run = m.wait(run_id, timeout=150)
    assert run.state == "succeeded", (run.state, run.message)
    from backend import cli

    assert cli.main(["status", run_id, "--db", str(m.engine.url)]) == 0
    status = capsys.readouterr().out
    assert "attempt 1 (launch, " in status and ": failed, hang" in status and "no training step for" in status
    # The restart's startup is not a hang of the attempt that hung.
    assert all(a.t < m.attempts(run_id)[1].started_at for a in m.alerts(run_id) if a.rule == "hang"), status
    # The stop's own consequences on the other node (peer lost, rendezvous failed) are not alerts.
    assert [a.rule for a in m.alerts(run_id)] == ["hang"], status
    assert "flight recorder: rank 0 waits in gloo:" in m.alerts(run_id)[0].message, status  # the watch's diagnosis
    with capsys.disabled():
        print("\n" + status)
        print(f"\nhang: failure recorded {hung.ended_at - stopped:.1f} s after SIGSTOP (limit 10 s), next attempt "
              f"started at {m.attempts(run_id)[1].started_at - stopped:.1f} s, its first step at {first - stopped:.1f} s"
              f"\n{hung.message}")
