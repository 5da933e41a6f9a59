"""A real 2-rank CPU training job through the studio's Slurm path, on a real slurmctld + slurmd
(tests/slurmctl.py) on this machine: the CLI submits it, the RunManager watches it (state from
`scontrol`, telemetry from the agent step's file), a Slurm requeue resumes it from the checkpoint
written on the requeue's SIGTERM, a stop is `scancel` and the workers checkpoint on its SIGTERM,
and a resume (a new Slurm job) continues past that checkpoint to the end."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import slurmctl
from backend.cluster import remote
from backend.job.spec import JobSpec
from backend.runs import lifecycle
from backend.runs.manager import RunManager
from launcher import checkpoint
from worker import until

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    why = slurmctl.missing()
    if why:
        pytest.skip(why)
    cluster = slurmctl.start(tmp_path_factory.mktemp("slurm"))
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF", "PYTHONPATH")}
    # Slurm's tools find this cluster by SLURM_CONF; sbatch passes the environment on to the job,
    # whose workers import this checkout.
    os.environ["SLURM_CONF"] = str(cluster.conf)
    os.environ["PYTHONPATH"] = str(ROOT)
    yield cluster
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    cluster.stop()


SLOW_STEPS = {"gradient_accumulation_steps": 8}
"""For a run the test acts on while it trains (requeue, stop, kill, SIGSTOP): steps long enough that
it does not end first."""
RESTART_STEPS = 80
"""The restart test's steps: the second job must still train when it is stopped (on a quiet machine
the telemetry that says it stepped lags by up to ~30 steps); the third job trains the rest."""


def job(tmp_path: Path, model: Path, max_steps: int, save_steps: int, max_restarts: int = 0, **extra) -> JobSpec:
    return JobSpec(model=str(model), dataset=[str(ROOT / "assets" / "demo" / "train.jsonl")],
                   output_dir=str(tmp_path / "out"), nnodes=1, nproc_per_node=2, max_steps=max_steps,
                   save_steps=save_steps, max_restarts=max_restarts, logging_steps=1, torch_dtype="float32", max_length=64,
                   gradient_checkpointing=False, env={"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}, **extra)


def tagged(run_id: str) -> list[int]:
    out = subprocess.run(["bash", "-c", remote.tagged_pids(run_id)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def wait_for(what: str, check, timeout: float, why=None):
    return until(check, timeout, every=0.3, name=what, why=why)


def latest_event(run_dir: Path, etype: str) -> dict | None:
    """Rank 0's newest event of `etype` as the worker wrote it (the telemetry store gets it seconds
    later, by which time a short run may have finished)."""
    latest = None
    for line in (run_dir / "events" / "rank-0.jsonl").read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:  # a line being written
            continue
        if event.get("type") == etype:
            latest = event
    return latest


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backend.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_slurm_run_requeue_stop_and_resume(slurm_cluster, tiny_model, tmp_path):
    spec_path = tmp_path / "job.yaml"
    # Steps of 8 micro-batches: on a quiet machine 200 one-batch steps of the tiny model take about
    # 2 s, over before the requeue (seen: the requeued job resumed from step 200).
    spec_path.write_text(job(tmp_path, tiny_model, max_steps=200, save_steps=1000, **SLOW_STEPS).to_yaml())
    db = f"sqlite:///{tmp_path / 'studio.db'}"
    t0 = time.time()
    out = cli("run", str(spec_path), "--slurm-partition", "debug", "--name", "slurm-run", "--detach", "--db", db)
    assert out.returncode == 0 and "slurm-run: running" in out.stdout, out.stdout + out.stderr
    run_id, run_dir = "slurm-run", tmp_path / "out" / "slurm-run"
    script = (run_dir / "slurm" / "attempt-1.sbatch").read_text()
    assert "#SBATCH --job-name=swift-studio-slurm-run" in script and "#SBATCH --partition=debug" in script

    # The CLI that submitted it is gone; a manager adopts the run and watches the job Slurm still runs.
    m = RunManager(db)
    try:
        wait_for("the re-attach", lambda: any("re-attached to Slurm job" in n for n in m.notices(run_id)), 30)
        first = m.store.current_attempt(run_id)
        job_id = json.loads(first.slurm_json)["job_id"]
        assert job_id and m.nodes_of(run_id) == ["localhost"]
        # The agent's lines reach the store through the run directory: training progress is seen.
        def seen() -> str:
            log = run_dir / "logs" / "localhost.log"
            return (f"run {m.run(run_id).state}; progress {m.progress(run_id)}; event files "
                    f"{sorted(p.name for p in (run_dir / 'events').glob('*'))}; "
                    f"the workers' log ends {log.read_text()[-1500:] if log.exists() else None!r}")

        wait_for("step 4 in the telemetry", lambda: (m.progress(run_id) or {}).get("step", 0) >= 4, 60, why=seen)

        # Slurm's own recovery: a requeued job (as after a node failure) starts the script again,
        # which resumes from the checkpoint the workers wrote on the requeue's SIGTERM. Slurm holds a
        # requeued batch job for 120 s (BeginTime); the admin's `StartTime=now` releases it.
        slurm_cluster.run("scontrol", "requeue", job_id)
        # Requeued once its processes have ended (the checkpoint written): PENDING, held by BeginTime.
        wait_for("the requeue", lambda: "JobState=PENDING" in slurm_cluster.run("scontrol", "show", "job", "-o",
                                                                                  job_id).stdout, 60)
        slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        requeued = wait_for("the requeued job's resume",
                            lambda: (latest_event(run_dir, "start") or {}).get("resumed_from"), 60)
        wait_for("a step past the requeue", lambda: (latest_event(run_dir, "train") or {}).get("step", 0) > requeued,
                 60)
        assert m.run(run_id).state == lifecycle.RUNNING and m.run(run_id).attempts == 1
        # The allocation is read again after the requeue: the processes before it have ended.
        wait_for("the requeued allocation", lambda: sorted(p.state for p in m.processes(run_id)) == [
            "exited", "running"], 30)

        t_stop = time.time()
        stopped = m.stop(run_id)
        stop_s = time.time() - t_stop
        assert stopped.state == lifecycle.STOPPED, (stopped.state, stopped.message)
        assert any("requeued" in n for n in m.notices(run_id)), m.notices(run_id)
        state = slurm_cluster.run("scontrol", "show", "job", "-o", job_id).stdout
        assert "JobState=CANCELLED" in state, state
        # Slurm ended the job only once the workers had exited: nothing of the run is left.
        assert tagged(run_id) == []
        saved = checkpoint.latest(run_dir)
        assert saved is not None, "the workers saved no checkpoint on scancel's SIGTERM"
        step = int(saved.name.split("-")[1])
        assert requeued < step < 200
        ends = [json.loads(p.read_text()) for p in sorted((run_dir / "events").glob("rank-*.end"))]
        assert [e["status"] for e in ends] == ["stopped", "stopped"], ends
    finally:
        m.close()

    t_resume = time.time()
    out = cli("resume", run_id, "--db", db)
    assert out.returncode == 0 and f"{run_id}: succeeded" in out.stdout, out.stdout + out.stderr
    m = RunManager(db, reattach=False)
    try:
        second = m.store.current_attempt(run_id)
        assert second.number == 2 and json.loads(second.slurm_json)["job_id"] != job_id
        assert (run_dir / "slurm" / "attempt-2.sbatch").exists()
        progress = m.progress(run_id)
        assert progress["resumed_from"] == step and progress["step"] == 200, progress
        assert checkpoint.latest(run_dir).name == "checkpoint-200"
    finally:
        m.close()
    lines = [json.loads(x) for x in (run_dir / "telemetry/attempt-2/restart-0/localhost.jsonl").read_text().splitlines()]
    assert {"hello", "host", "event", "bye"} <= {x["kind"] for x in lines}
    print(f"submit→stop {t_stop - t0:.1f} s (stop {stop_s:.1f} s, checkpoint-{step}, requeue resumed from "
          f"{requeued}), resume→end {time.time() - t_resume:.1f} s")


def test_a_python_that_does_not_import_the_worker_fails_the_run_naming_it(slurm_cluster, tiny_model, tmp_path):
    """The pre-flight that needs the allocation (the import check on every node) fails the run
    before any worker starts, naming the field to fix."""
    from backend.cluster.slurm import SlurmTarget

    target = SlurmTarget(partition="debug", nodes=1, cpus_per_task=2, python="/nonexistent/bin/python3")
    m = RunManager(f"sqlite:///{tmp_path / 'studio.db'}")
    try:
        run_id = m.launch(job(tmp_path, tiny_model, max_steps=3, save_steps=3), target.cluster(), slurm=target)
        run = m.wait(run_id, timeout=60)
        assert (run.state, run.cause) == (lifecycle.FAILED, "command_not_found"), (run.state, run.message)
        assert "slurm.python" in run.message and "ended FAILED" in run.message, run.message
        assert list(Path(run.run_dir).glob("pids/*.pid")) == []  # no worker started
    finally:
        m.close()


def test_killed_and_hung_workers_are_restarted_as_new_slurm_jobs(slurm_cluster, tiny_model, tmp_path, capsys):
    """Automatic recovery (max_restarts) on Slurm: SIGKILLed workers fail the job, and the run goes
    on as a new job on the same target, from the newest checkpoint; then both ranks stopped with
    SIGSTOP make no step within the job's own hang limit: the job is cancelled as hung, naming
    both, and the run goes on as a third job. (One rank stopped would name its node, which failed
    before: the third job would exclude it, and this one-node partition has no other.)"""
    from backend.cluster.slurm import SlurmTarget

    target = SlurmTarget(partition="debug", nodes=1, cpus_per_task=2)
    m = RunManager(f"sqlite:///{tmp_path / 'studio.db'}")

    def workers() -> list[int]:
        return [pid for pid in tagged(run_id)
                if b"launcher.train" in Path(f"/proc/{pid}/cmdline").read_bytes()
                and b"torch.distributed.run" not in Path(f"/proc/{pid}/cmdline").read_bytes()]

    try:
        t0 = time.time()
        run_id = m.launch(job(tmp_path, tiny_model, max_steps=RESTART_STEPS, save_steps=10, max_restarts=2, hang_timeout_s=10,
                              **SLOW_STEPS),
                          target.cluster(), slurm=target)
        run_dir = Path(m.run(run_id).run_dir)
        wait_for("a checkpoint", lambda: checkpoint.latest(run_dir), 90)
        assert len(workers()) == 2, workers()
        t_kill = time.time()
        for pid in workers():
            os.kill(pid, signal.SIGKILL)
        wait_for("the automatic restart", lambda: len(m.attempts(run_id)) == 2, 60)
        print(f"\nkill → new Slurm job {time.time() - t_kill:.1f} s")

        def second_job_stepped() -> bool:
            progress = m.progress(run_id) or {}
            return (bool((latest_event(run_dir, "start") or {}).get("resumed_from")) and len(workers()) == 2
                    and progress.get("resumed_from") is not None and (progress.get("step") or 0) > progress["resumed_from"])

        wait_for("a step of the second job", second_job_stepped, 90)
        t_stop = time.time()
        for pid in workers():
            os.kill(pid, signal.SIGSTOP)
        wait_for("the hang restart", lambda: len(m.attempts(run_id)) == 3, 90)
        print(f"SIGSTOP → cancelled as hung, new Slurm job {time.time() - t_stop:.1f} s (limit 10 s)")
        done = m.wait(run_id, timeout=150)
        assert done.state == lifecycle.SUCCEEDED, (done.state, done.message)
        first, second, third = m.attempts(run_id)
        assert (first.state, first.cause) == ("failed", "killed"), (first.state, first.cause, first.message)
        assert (second.state, second.cause) == ("failed", "hang"), (second.state, second.cause, second.message)
        assert "cancelled Slurm job" in second.message, second.message
        assert all(re.search(f"rank {r}, node localhost(, GPU {r})? has been stopped", second.message) for r in (0, 1)), \
            second.message
        assert second.failed_node is None  # two halted ranks: neither is the one to blame
        jobs = [json.loads(a.slurm_json)["job_id"] for a in (first, second, third)]
        assert second.automatic and third.automatic and len(set(jobs)) == 3, jobs
        assert sum("a new Slurm job resuming" in n for n in m.notices(run_id)) == 2, m.notices(run_id)
        # scancel sends SIGCONT before SIGTERM: the stopped rank wakes and the workers may save a
        # checkpoint at the next step boundary (seen: the third job resumed from step 19).
        assert m.progress(run_id)["resumed_from"] >= 10 and m.progress(run_id)["step"] == RESTART_STEPS
        # The first step of each restarted job, from the workers' own events.
        lines = [json.loads(line) for line in (run_dir / "events" / "rank-0.jsonl").read_text().splitlines()]
        starts = [i for i, e in enumerate(lines) if e.get("type") == "start"]
        first_steps = [next(e["time"] for e in lines[i:] if e.get("type") == "train") for i in starts[1:]]
        print(f"kill → first step of the new job {first_steps[0] - t_kill:.1f} s; SIGSTOP → first step of the "
              f"third job {first_steps[1] - t_stop:.1f} s")
        print(f"kill → restart → hang → restart → end: {time.time() - t0:.1f} s")
        from backend import cli

        assert cli.main(["status", run_id, "--db", str(m.engine.url)]) == 0
        status = capsys.readouterr().out
        assert all(f"Slurm job {job_id}" in status for job_id in jobs), status
        assert ": failed, killed" in status and ": failed, hang" in status and "cancelled Slurm job" in status
        # A hang alert is the SIGSTOP's only: a new job's startup is not a hang of the killed job.
        assert all(a.t > t_stop for a in m.alerts(run_id) if a.rule == "hang"), status
        # ... and it is the finding the watch cancelled the job on
        [hang] = [a for a in m.alerts(run_id) if a.rule == "hang"]
        assert hang.message in second.message, status
        with capsys.disabled():
            print("\n" + status)
    finally:
        m.close()


def test_a_submission_cut_short_is_found_by_the_runs_name_and_cancelled(slurm_cluster, tiny_model, tmp_path):
    """The process that ran sbatch died before it recorded the job id: the manager that adopts the
    run finds the job by the run's job name, cancels it (no second job in the run directory) and
    fails the run as interrupted. A job of another name is left alone."""
    from backend.cluster.slurm import SlurmTarget
    from backend.runs.lifecycle import Owner
    from backend.store.models import Run

    db = f"sqlite:///{tmp_path / 'studio.db'}"
    spec = job(tmp_path, tiny_model, max_steps=10, save_steps=10)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    owner = Owner(socket.gethostname(), gone.pid, "cut")
    m = RunManager(db, reattach=False)
    try:
        m.store.create(Run(id="cut", name="cut", spec_yaml=spec.to_yaml(), output_dir=spec.output_dir,
                           run_dir=str(tmp_path / "out" / "cut")))
        m.store.transition("cut", lifecycle.CHECKING, by=owner)
        m.store.new_attempt("cut", [], None, slurm_json=json.dumps(
            {"target": SlurmTarget(partition="debug").to_dict(), "job_id": None}))
        m.store.transition("cut", lifecycle.LAUNCHING, by=owner)
    finally:
        m.close()
    submitted = [slurm_cluster.run("sbatch", "--parsable", f"--job-name={name}", "--output=/dev/null",
                                   "--wrap=sleep 120").stdout.strip() for name in ("swift-studio-cut", "other")]
    try:
        m = RunManager(db)  # adopts the run whose owner is gone
        try:
            run = m.wait("cut", timeout=60)
        finally:
            m.close()
        assert (run.state, run.cause) == ("failed", "interrupted") and "submitting" in run.message, run.message
        states = [slurm_cluster.run("scontrol", "show", "job", "-o", job_id).stdout for job_id in submitted]
        assert "JobState=CANCELLED" in states[0], states[0]
        assert "JobState=CANCELLED" not in states[1], states[1]
    finally:
        slurm_cluster.run("scancel", *submitted, check=False)


def test_the_studio_submits_to_a_slurm_partition(slurm_cluster, tmp_path, capsys):
    """In a real browser: the Cluster tab targets the partition (a bad name is refused at the field,
    an unknown partition by the pre-flight's sinfo), the Train tab previews the batch script, the
    launch submits it and the Monitor follows the job to its end; the target is kept on a reload."""
    pytest.importorskip("playwright")
    from playwright.sync_api import expect, sync_playwright

    from studio_server import Shots, launch_browser, open_studio, reload_studio, start_studio

    studio = start_studio(tmp_path / "studio")
    shot = Shots("slurm")
    try:
        with sync_playwright() as p:
            browser = launch_browser(p)
            page = open_studio(browser, studio.url)
            page.get_by_role("tab", name="Cluster").click()
            page.locator("#cluster-target").get_by_text("Slurm partition", exact=True).click()
            expect(page.locator("#cluster-message")).to_contain_text("slurm.partition", timeout=15000)
            expect(page.locator("#cluster-target input[value='SSH nodes']")).to_be_checked()
            page.locator("#cluster-slurm").get_by_text("Slurm partition", exact=True).click()  # the accordion

            page.locator("#slurm-partition textarea, #slurm-partition input").first.fill("nope")
            page.locator("#slurm-use").click()
            expect(page.locator("#cluster-target-summary")).to_contain_text("Slurm partition nope", timeout=15000)
            page.locator("#cluster-preflight").click()
            expect(page.locator("#preflight-report")).to_contain_text("'nope' does not exist", timeout=30000)
            shot(page, "unknown-partition")

            page.locator("#slurm-partition textarea, #slurm-partition input").first.fill("debug")
            page.locator("#slurm-use").click()
            expect(page.locator("#cluster-target-summary")).to_contain_text("Slurm partition debug", timeout=15000)
            page.locator("#cluster-preflight").click()
            expect(page.locator("#slurm-preflight-ok")).to_be_visible(timeout=30000)
            shot(page, "partition-fits")

            page.get_by_role("tab", name="Train").click()
            page.get_by_text("Checkpoints, evaluation and logging").click()
            for name, value in {"max_steps": "6", "save_steps": "3", "logging_steps": "1"}.items():
                page.locator(f"#f-{name} input").fill(value)
            commands = page.locator("#train-commands")
            expect(commands).to_contain_text("#SBATCH --partition=debug", timeout=15000)
            expect(commands).to_contain_text("srun", timeout=15000)
            shot(page, "batch-script")
            clicked = time.monotonic()
            page.locator("#launch").click()
            expect(page.locator("#launch-status")).to_contain_text("Launched run", timeout=60000)
            run_id = re.search(r"Launched run (\S+?)\.", page.locator("#launch-status").inner_text()).group(1)
            status = page.locator("#monitor-status")
            expect(status).to_contain_text("succeeded", timeout=180000)
            with capsys.disabled():
                print(f"\nstudio on Slurm: Launch clicked → the Monitor shows succeeded (6 steps) in "
                      f"{time.monotonic() - clicked:.1f} s")
            shot(page, "succeeded")
            run_dir = studio.output_dir / run_id
            assert list((run_dir / "slurm").glob("attempt-1.sbatch")), sorted(run_dir.iterdir())
            assert (run_dir / "checkpoint-6" / "complete").exists()

            reload_studio(page, "#SBATCH --partition=debug")  # the target is kept
            page.get_by_role("tab", name="Cluster").click()
            expect(page.locator("#cluster-target input[value='Slurm partition']")).to_be_checked(timeout=15000)
            browser.close()
    finally:
        studio.stop()
