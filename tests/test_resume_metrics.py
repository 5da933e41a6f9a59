"""A run killed some steps after a checkpoint and resumed from it does those steps again; its
metrics (series, CSV export, progress, checkpoints) show each step once, the resumed attempt's, and
the trackers its job reports to (TensorBoard, W&B offline, MLflow's file store, SwanLab offline) hold
each step once.
A real local run of the tiny model through the RunManager."""
from __future__ import annotations

import csv
import os
import re
import shutil
import signal
from pathlib import Path

import psutil
import pytest
from sqlalchemy import func, select

from backend import cli
from backend.job.cluster import GpuInfo, local_cluster
from backend.job.spec import JobSpec
from backend.runs.manager import RunError, RunManager
from backend.store.telemetry_models import MetricSample
from tracker_files import swanlab_scalars, wandb_history
from worker import ROOT, events, until

pytestmark = pytest.mark.e2e
S = MetricSample.__table__
MAX_STEPS, SAVE_STEPS = 40, 10


def kill_workers(pgid: int) -> None:
    """SIGKILL the training processes (torchrun starts each in a session of its own, under it)."""
    for p in psutil.Process(pgid).children(recursive=True):
        cmd = p.cmdline()
        if "launcher.train" in cmd and "torch.distributed.run" not in cmd:
            os.kill(p.pid, signal.SIGKILL)


def test_a_resumed_run_shows_each_step_once(tmp_path, tiny_model, capsys, monkeypatch):
    url = f"sqlite:///{tmp_path / 'studio.db'}"
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_SAVE_DIR", str(tmp_path / "swanlab-home"))
    spec = JobSpec(model=str(tiny_model), dataset=[str(ROOT / "assets" / "demo" / "train.jsonl")],
                   output_dir=str(tmp_path / "out"), nproc_per_node=1, max_steps=MAX_STEPS, save_steps=SAVE_STEPS,
                   logging_steps=1, torch_dtype="float32", max_length=64, gradient_checkpointing=False,
                   env={"OMP_NUM_THREADS": "1"}, report_to=["tensorboard", "wandb", "mlflow", "swanlab"])
    with RunManager(url) as m:
        run_id = m.launch(spec, local_cluster(GpuInfo()))
        run_dir = Path(m.run(run_id).run_dir)
        until(lambda: any(e["step"] > SAVE_STEPS + 2 for e in events(run_dir, 0, "train")), every=0.005)
        [proc] = m.processes(run_id)
        kill_workers(proc.pgid)
        failed = m.wait(run_id, timeout=60)
        assert failed.state == "failed", (failed.state, failed.message)
        reached = max(e["step"] for e in events(run_dir, 0, "train"))
        # Where the kill lands depends on the machine's load (the poll above and the kill race the
        # steps): anywhere after the first checkpoint and before the end does.
        assert SAVE_STEPS < reached < MAX_STEPS, "the kill must land after a checkpoint and before the end"
        kept = m.saved_checkpoints(run_id)
        saved = kept[0][0]
        assert saved >= SAVE_STEPS and reached - saved < SAVE_STEPS + 1, (kept, reached)

        # Its checkpoints gone (the run directory moved, deleted): a resume would start from step 0,
        # so it is refused unless asked for in those words.
        for step, _ in kept:
            (run_dir / f"checkpoint-{step}").rename(run_dir / f"moved-away-{step}")
        with pytest.raises(RunError, match=rf"run {run_id} saved {len(m.checkpoints(run_id))} checkpoint\(s\), the "
                                           rf"newest {run_dir}/checkpoint-\d+ \(step \d+\), and none of them is on "
                                           "localhost now"):
            m.resume(run_id)
        assert cli.main(["resume", run_id, "--db", url]) == 1
        assert "--from-scratch" in capsys.readouterr().err
        assert m.run(run_id).state == "failed" and len(m.attempts(run_id)) == 1
        for step, _ in kept:
            (run_dir / f"moved-away-{step}").rename(run_dir / f"checkpoint-{step}")

        # An attached `swift-studio resume` streams the new attempt's log as `run` does, to the end.
        assert cli.main(["resume", run_id, "--db", url]) == 0
        resumed = capsys.readouterr().out
        assert f"resumed {run_id} (attempt 2) on localhost; Ctrl-C leaves it running" in resumed, resumed
        assert "resumed from" in resumed and f"{run_id}: succeeded (attempt 2" in resumed, resumed
        done = m.wait(run_id, timeout=300)
        assert done.state == "succeeded", (done.message, done.log_tail)
        until(lambda: (m.progress(run_id) or {}).get("step") == MAX_STEPS, timeout=30)
        # `status` and `runs` say how far it got and its loss; `export` says what it wrote, in words.
        assert cli.main(["status", run_id, "--db", url]) == 0
        assert re.search(rf"\n  step {MAX_STEPS}/{MAX_STEPS}, loss [0-9.]+, [0-9]+ tokens/s", capsys.readouterr().out)
        assert cli.main(["runs", "--db", url]) == 0
        assert re.search(rf"{run_id} +succeeded +attempt 2 .* step {MAX_STEPS} +loss [0-9.]+", capsys.readouterr().out)
        assert cli.main(["export", run_id, "--db", url]) == 0
        exported = capsys.readouterr().out
        assert exported.startswith(f"exported {run_dir}/checkpoint-{MAX_STEPS} to {run_dir}/export (safetensors"), exported
        assert "its answer:" in exported

        # What the run's history is: attempt 1 up to its checkpoint, then attempt 2 (which
        # resumed from it). Losses would match either way (a resume is exact): times tell them apart.
        lines = events(run_dir, 0)
        second = max(i for i, e in enumerate(lines) if e["type"] == "start")
        assert lines[second]["resumed_from"] == saved
        train = [(i, (e["time"], e["step"], e["loss"])) for i, e in enumerate(lines) if e["type"] == "train"]
        history = [point for i, point in train if i > second or point[1] <= saved]
        assert [s for _, s, _ in history] == list(range(1, MAX_STEPS + 1))

        [points] = m.series(run_id, ["train/loss"]).series.values()
        # pytest.approx compares flat sequences only (9.2 refuses nested ones)
        assert [x for point in points for x in point] == pytest.approx([x for t, _, loss in history for x in (t, loss)])

        out = tmp_path / "metrics.csv"
        assert cli.main(["metrics", run_id, "--db", url, "--names", "train/loss", "--out", str(out)]) == 0
        rows = [(float(r["t"]), int(r["step"]), float(r["value"])) for r in csv.DictReader(out.open())]
        assert [x for row in rows for x in row] == pytest.approx([x for point in history for x in point])
        attempts = [(int(r["step"]), int(r["attempt"])) for r in csv.DictReader(out.open())]
        assert attempts == [(step, 1 if step <= saved else 2) for step in range(1, MAX_STEPS + 1)]

        progress = m.progress(run_id)
        assert (progress["step"], progress["resumed_from"]) == (MAX_STEPS, saved)
        notices = "\n".join(m.notices(run_id, last=100))
        assert f"wandb: offline run {run_id} in {run_dir / 'trackers' / 'wandb'}" in notices, notices
        assert "not reporting to it" not in notices, notices
        every = list(range(MAX_STEPS, 0, -SAVE_STEPS))
        assert [step for step, _ in m.checkpoints(run_id)] == every
        # One removed (save_total_limit, a user): the lists Chat, Export and a resume offer leave it out.
        shutil.rmtree(run_dir / "checkpoint-20")
        assert [step for step, _ in m.saved_checkpoints(run_id)] == [step for step in every if step != 20]
        with m.engine.connect() as conn:  # the failed attempt's steps are kept, only not shown
            stored = conn.execute(select(func.count()).where(S.c.run_id == run_id, S.c.name == "train/loss")).scalar()
        assert stored == MAX_STEPS + reached - saved

    # The trackers: each step once with the worker's loss (the first attempt's, where the second
    # did a step again: a resume is exact, so the values agree), each read with its tool's own reader.
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    expected = [x for _, step, loss in history for x in (step, loss)]
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [x for e in acc.Scalars("train/loss") for x in (e.step, e.value)] == pytest.approx(expected)
    logged = [row for row in wandb_history(run_dir) if "train/loss" in row]
    assert [x for row in logged for x in (row["train/step"], row["train/loss"])] == pytest.approx(expected)
    client = MlflowClient(tracking_uri=(tmp_path / "out" / "mlruns").as_uri())
    [tracked] = client.search_runs([client.get_experiment_by_name("swift-studio").experiment_id])
    assert tracked.data.tags["swift_studio.run_id"] == run_id and tracked.info.status == "FINISHED"
    metric = sorted((m.step, m.value) for m in client.get_metric_history(tracked.info.run_id, "train/loss"))
    assert [x for point in metric for x in point] == pytest.approx(expected)
    assert [x for point in sorted(swanlab_scalars(run_dir, "train/loss")) for x in point] == pytest.approx(expected)
