"""One owner per run: a second manager (the studio, `swift-studio status` / `runs`) leaves a run
that a live process drives alone, adopts it once that process is gone, and state changes are
compare-and-set in the database. Real `swift-studio` processes on one SQLite file, a local node
training the tiny model."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from backend.cluster import nodes
from backend.job.cluster import LOCAL_HOST, local_cluster
from backend.runs import lifecycle
from backend.runs.lifecycle import Owner, RunStore
from backend.runs.manager import RunManager
from backend.store.db import create_db_and_tables, make_engine
from backend.store.models import Run
from worker import ROOT, until

pytestmark = pytest.mark.e2e
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "backend.cli", *map(str, args)]


@pytest.fixture
def db(tmp_path):
    url = f"sqlite:///{tmp_path / 'studio.db'}"
    engine = make_engine(url)
    create_db_and_tables(engine)
    yield url, engine
    engine.dispose()


@pytest.fixture
def job(tmp_path, tiny_model):
    def write(max_steps: int, logging_steps: int = 1) -> str:
        path = tmp_path / f"job-{max_steps}.yaml"
        path.write_text(yaml.safe_dump(dict(
            model=str(tiny_model), dataset=[str(ROOT / "assets" / "demo" / "train.jsonl")],
            output_dir=str(tmp_path / "out"), nproc_per_node=1, max_steps=max_steps, save_steps=max_steps,
            logging_steps=logging_steps, torch_dtype="float32", max_length=64, gradient_checkpointing=False,
            env={"OMP_NUM_THREADS": "1"})))
        return str(path)
    return write


def test_status_runs_and_a_studio_leave_a_live_launch_alone(tmp_path, db, job):
    url, engine = db
    gate = tmp_path / "gate"
    # The node's setup line (a real inventory feature) holds the launch in `checking` until the
    # gate opens, so the second process surely meets it there.
    nodes.set_inventory(engine, local_cluster(), {LOCAL_HOST: f"while [ ! -e {gate} ]; do sleep 0.1; done"})
    store = RunStore(engine)
    launching = subprocess.Popen(cli("run", job(5), "--db", url), cwd=tmp_path, env=ENV, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        run = until(lambda: next((r for r in store.runs() if r.state == lifecycle.CHECKING), None))

        status = subprocess.run(cli("status", run.id, "--db", url), env=ENV, capture_output=True, text=True,
                                timeout=120)
        assert status.returncode == 0 and f"{run.id}: checking" in status.stdout, status.stdout + status.stderr
        listed = subprocess.run(cli("runs", "--db", url), env=ENV, capture_output=True, text=True, timeout=120)
        assert listed.returncode == 0 and "checking" in listed.stdout, listed.stdout + listed.stderr
        with RunManager(url) as studio:  # what the studio constructs: it re-attaches orphans only
            assert studio.run(run.id).state == lifecycle.CHECKING
        now = store.get(run.id)
        assert (now.state, now.cause, now.message) == (lifecycle.CHECKING, None, None)
        assert now.owner == run.owner and f":{launching.pid}:" in now.owner

        gate.touch()
        out, err = launching.communicate(timeout=300)
    finally:
        gate.touch()
        if launching.poll() is None:
            launching.kill()
    assert launching.returncode == 0, out + err
    assert f"{run.id}: succeeded" in out and "Traceback" not in err, out + err
    assert [a.state for a in store.attempts(run.id)] == [lifecycle.SUCCEEDED]


def test_a_run_whose_driver_was_killed_is_adopted_by_a_live_manager(tmp_path, db, job):
    url, engine = db
    store = RunStore(engine)
    driver = subprocess.Popen(cli("run", job(1000, logging_steps=10), "--db", url), cwd=tmp_path, env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with RunManager(url) as studio:
            run = until(lambda: next(iter(store.runs()), None))
            until(lambda: (studio.progress(run.id) or {}).get("step"), timeout=180)
            assert studio.run(run.id).state == lifecycle.RUNNING
            assert f":{driver.pid}:" in studio.run(run.id).owner  # driven by the CLI, not taken over
            driver.send_signal(signal.SIGKILL)
            driver.wait()
            # Its workers live on (own session); the studio finds the owner gone and takes over.
            until(lambda: studio.run(run.id).owner == studio.owner.id, timeout=lifecycle.OWNER_TIMEOUT_S + 5)
            # the claim lands first, the re-attach (and its notice) right after it
            until(lambda: any("re-attached" in n for n in studio.notices(run.id)), timeout=10)
            assert studio.run(run.id).state == lifecycle.RUNNING, "adopted after the run ended: not a mid-run test"
            done = studio.wait(run.id, timeout=300)
            assert done.state == lifecycle.SUCCEEDED, (done.message, done.log_tail)
            assert studio.progress(run.id)["step"] == 1000
    finally:
        if driver.poll() is None:
            driver.kill()


def test_an_owner_on_another_host_is_trusted_until_its_heartbeat_expires(tmp_path, db):
    url, engine = db
    store = RunStore(engine)
    elsewhere = Owner("other-host", os.getpid(), "feed")  # a live pid here means nothing for another host
    store.create(Run(id="r1", name="r1", spec_yaml="model: m\n", output_dir="/o", run_dir="/o/r1"))
    store.transition("r1", lifecycle.CHECKING, by=elsewhere)
    with RunManager(url):
        pass
    assert store.get("r1").state == lifecycle.CHECKING and store.get("r1").owner == elsewhere.id
    # The other host went quiet: past the bound its run is adopted (a launch nobody drives fails).
    store.heartbeat(elsewhere, time.time() - lifecycle.OWNER_TIMEOUT_S - 1)
    with RunManager(url) as m:
        run = m.run("r1")
    assert (run.state, run.cause) == (lifecycle.FAILED, "interrupted") and run.owner == m.owner.id


def test_close_ends_a_task_that_swallowed_its_cancellation(tmp_path, db):
    url, _ = db
    m = RunManager(url)

    async def stubborn():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass  # what asyncio.wait_for does when a cancellation meets its call's completion (Python < 3.12)
        await asyncio.sleep(3600)

    asyncio.run_coroutine_threadsafe(stubborn(), m._loop)
    time.sleep(0.2)
    started = time.monotonic()
    m.close()
    assert time.monotonic() - started < 10


# `swift-studio run`, killed the moment its nodes' workers started (before it could record them).
KILLED_AFTER_START = """\
import asyncio, os, signal, sys
from backend.cluster import launch
real = launch.start_all

async def start_all(*args, **kwargs):
    await real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)

launch.start_all = start_all
from backend.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_launch_killed_as_its_workers_start_is_adopted_not_killed(tmp_path, db, job):
    url, engine = db
    store = RunStore(engine)
    killed = subprocess.run([sys.executable, "-c", KILLED_AFTER_START, "run", job(40, logging_steps=10), "--db", url],
                            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    (run,) = store.runs()
    assert run.state == lifecycle.LAUNCHING
    with RunManager(url) as studio:  # it adopts the run: the workers found by their pid files, watched
        done = studio.wait(run.id, timeout=300)
        assert done.state == lifecycle.SUCCEEDED, (done.state, done.message, done.log_tail)
        assert studio.progress(run.id)["step"] == 40
        assert [p.pgid is not None for p in studio.processes(run.id)] == [True]
        assert any("adopted" in n for n in studio.notices(run.id)), studio.notices(run.id)
