"""report_to's trackers (TensorBoard, W&B offline, MLflow's file store, SwanLab offline), written from the database
while a run trains and read back with each tool's own reader; the checks before launch; a tracker
that fails, a cursor that is damaged, two processes writing one run's tracker."""
from __future__ import annotations

import json
import math
import importlib.util
from pathlib import Path

import pytest
from sqlmodel import create_engine

from backend.job import capabilities
from backend.job.spec import JobSpec
from backend.job.validate import validate
from backend.telemetry import trackers
from backend.telemetry.ingest import Ingestor
from backend.telemetry.trackers import Cursor, Reporter, RunInfo, new_points
from tracker_files import swanlab_finish_states, swanlab_scalars, wandb_history

T0 = 1_700_000_000.0


@pytest.fixture(autouse=True)
def offline_trackers(tmp_path, monkeypatch):
    """W&B offline with its state under the test's directory; MLflow at its default (the run's
    output directory), whatever this machine's environment says."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.setenv("SWANLAB_SAVE_DIR", str(tmp_path / "swanlab-home"))


def ingest(engine, attempts: list[tuple[int | None, list[tuple[int, float]]]], first_attempt: int = 1,
           gpu_samples: int = 0) -> None:
    """Train events of attempts as the agents deliver them (each attempt's `start` names the
    checkpoint it resumed from), then GPU samples on node-a."""
    ing = Ingestor(engine, autostart=False)
    offset = 1000 * first_attempt
    for attempt, (resumed_from, steps) in enumerate(attempts, start=first_attempt):
        for event in [{"type": "start", "time": T0 + offset, "resumed_from": resumed_from}] + [
                {"type": "train", "time": T0 + offset + s, "step": s, "loss": loss} for s, loss in steps]:
            offset += 1
            ing.on_agent_line("r1", "node-a", {"kind": "event", "file": "events/rank-0.jsonl", "offset": offset,
                                               "rank": 0, "data": event}, attempt=attempt)
    for i in range(gpu_samples):
        ing.on_agent_line("r1", "node-a", {"kind": "gpu", "t": T0 + 100 + i, "gpu": 0, "util_pct": 40.0 + i})
    ing.close()


def flat(pairs) -> list[float]:
    """pytest.approx compares flat sequences only (9.2 refuses nested ones)."""
    return [x for pair in pairs for x in pair]


def spec(tmp_path: Path, report_to: list[str], **extra) -> JobSpec:
    return JobSpec(model="m", dataset=["d.jsonl"], output_dir=str(tmp_path / "out"), report_to=report_to, **extra)


def run_info(tmp_path: Path, report_to: list[str], **extra) -> RunInfo:
    run_dir = tmp_path / "out" / "r1"
    run_dir.mkdir(parents=True, exist_ok=True)
    return RunInfo("r1", "demo", run_dir, spec(tmp_path, report_to, **extra))


def test_the_trackers_get_each_step_once_across_attempts_and_read_back(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    pytest.importorskip("swanlab")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    engine = create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    info = run_info(tmp_path, ["tensorboard", "wandb", "mlflow", "swanlab"], learning_rate=0.002)
    # Attempt 1 trained to step 5 (a NaN at 4) and failed; attempt 2 resumed from checkpoint 3.
    ingest(engine, [(None, [(1, 2.0), (2, 1.8), (3, 1.6), (4, math.nan), (5, 1.4)])])
    first = Reporter(engine, info)
    lines = first.push()
    assert [line.split(":")[0] for line in lines] == ["tensorboard", "wandb", "mlflow", "swanlab"], lines
    assert "offline run r1" in lines[1] and str(info.run_dir / "trackers" / "wandb") in lines[1]
    assert f"at {(tmp_path / 'out' / 'mlruns').resolve().as_uri()}" in lines[2]
    assert f"offline experiment in {info.run_dir / 'trackers' / 'swanlab'}" in lines[3]
    assert first.finish("failed") == []
    ingest(engine, [(3, [(4, 1.5), (5, 1.39), (6, 1.3), (7, 1.2)])], first_attempt=2)
    second = Reporter(engine, info)  # a new attempt (or a restarted studio) goes on from the cursors
    second.push()
    assert second.finish("succeeded") == []

    sent = [(1, 2.0), (2, 1.8), (3, 1.6), (5, 1.4), (6, 1.3), (7, 1.2)]  # NaN not sent, step 5 once (the first)
    acc = EventAccumulator(str(info.run_dir / "tensorboard"))
    acc.Reload()
    assert flat((e.step, e.value) for e in acc.Scalars("train/loss")) == pytest.approx(flat(sent))

    history = [row for row in wandb_history(info.run_dir) if "train/loss" in row]
    assert flat((row["train/step"], row["train/loss"]) for row in history) == pytest.approx(flat(sent))

    client = MlflowClient(tracking_uri=(tmp_path / "out" / "mlruns").resolve().as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("swift-studio").experiment_id])
    assert run.info.run_name == "demo" and run.data.tags["swift_studio.run_id"] == "r1"
    assert run.info.status == "FINISHED" and run.data.params["learning_rate"] == "0.002"
    metric = client.get_metric_history(run.info.run_id, "train/loss")
    assert flat(sorted((m.step, m.value) for m in metric)) == pytest.approx(flat(sent))

    # SwanLab offline: one experiment per attempt (an id continues only online), each step once in all
    assert flat(swanlab_scalars(info.run_dir, "train/loss")) == pytest.approx(flat(sent))
    assert swanlab_finish_states(info.run_dir) == ["RUN_STATE_CRASHED", "RUN_STATE_FINISHED"]


def test_points_are_read_in_slices_with_the_clock_series_from_the_first_sample(tmp_path, monkeypatch):
    engine = create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    ingest(engine, [(None, [(1, 2.0), (2, 1.9)])], gpu_samples=3)
    monkeypatch.setattr(trackers, "BATCH_ROWS", 2)
    cursor, seen = Cursor(), []
    while True:
        points, after = new_points(engine, "r1", cursor)
        if after.last_id == cursor.last_id:
            break
        seen += points
        cursor = after
    assert [(p.tag, p.step, p.value) for p in seen if p.step is not None] == [("train/loss", 1, 2.0),
                                                                              ("train/loss", 2, 1.9)]
    clock = [(p.tag, p.value) for p in seen if p.step is None]
    assert ("gpu/util_pct/node-a:0", 40.0) in clock and len([c for c in clock if c[0].startswith("gpu/")]) == 3
    assert cursor.t0 == min(p.t for p in seen) and cursor.steps["train/loss"] == 2


def test_a_failing_tracker_is_named_once_and_the_others_go_on(tmp_path):
    pytest.importorskip("mlflow")
    engine = create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    ingest(engine, [(None, [(1, 2.0)])])
    info = run_info(tmp_path, ["mlflow", "tensorboard"], mlflow_tracking_uri="nosuchscheme://tracker")
    reporter = Reporter(engine, info)
    [failed, tensorboard] = reporter.push()
    assert failed.startswith("mlflow: writing failed, not reporting to it for the rest of this attempt:"), failed
    assert tensorboard.startswith("tensorboard: writing to")
    assert reporter.push() == [] and reporter.finish("succeeded") == []
    assert list((info.run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_a_damaged_cursor_is_named_and_a_second_writer_is_refused(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    ingest(engine, [(None, [(1, 2.0)])])
    info = run_info(tmp_path, ["tensorboard"])
    (info.run_dir / "trackers").mkdir()
    cursor = info.run_dir / "trackers" / "tensorboard.json"
    cursor.write_text('{"last_id": "x"}')
    [line] = Reporter(engine, info).push()
    assert f"{cursor}: not a tracker cursor" in line and "remove it to send the run again" in line
    assert cursor.read_text() == '{"last_id": "x"}'  # left as it was
    cursor.unlink()

    holder = Reporter(engine, info)
    assert holder.push()[0].startswith("tensorboard: writing to")
    [line] = Reporter(engine, info).push()  # another process watching the same run
    assert "another studio or CLI process is writing this run's tracker" in line
    assert holder.finish("succeeded") == []
    assert json.loads(cursor.read_text())["steps"] == {"train/loss": 1}


def test_report_to_is_checked_before_launch(tmp_path, monkeypatch):
    assert set(capabilities.TRACKERS) == set(trackers.SINKS)

    def problems(**kw):
        return [(p.field, p.message) for p in validate(spec(tmp_path, **kw)) if p.field in ("report_to",
                                                                                              "mlflow_tracking_uri")]

    assert problems(report_to=["tensorboard"]) == []
    [(field, message)] = problems(report_to=["neptune"])
    assert field == "report_to" and "'neptune' is not a tracker swift-studio writes" in message
    assert "none" in problems(report_to=["none", "wandb"])[0][1]
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else found(name, *a))
    [(field, message)] = problems(report_to=["wandb"])
    assert message == ("'wandb' needs the wandb package where the studio runs (it writes the tracker from its "
                       "database): pip install 'swift-studio[wandb]'")
    [(field, message)] = problems(report_to=[], mlflow_tracking_uri="http://mlflow:5000")
    assert field == "mlflow_tracking_uri" and "report_to does not name mlflow" in message


def test_an_imported_report_to_keeps_the_trackers_written_here_and_notes_the_others():
    from backend.job.msswift import import_command

    result = import_command("swift sft --model m --dataset d.jsonl --report_to neptune swanlab wandb")
    assert result.spec["report_to"] == ["swanlab", "wandb"]
    assert ("--report_to neptune: dropped, not a tracker swift-studio writes (it writes tensorboard, wandb, mlflow, "
            "swanlab); the run's metrics stay in the studio") in result.notes
    assert import_command("swift sft --model m --dataset d.jsonl --report_to tensorboard").spec["report_to"] == [
        "tensorboard"]


def test_a_tracker_that_fails_to_start_leaves_no_process_behind(tmp_path, monkeypatch):
    pytest.importorskip("swanlab")
    import psutil

    monkeypatch.setenv("SWANLAB_MODE", "no-such-mode")
    engine = create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    ingest(engine, [(None, [(1, 2.0)])])
    reporter = Reporter(engine, run_info(tmp_path, ["swanlab"]))
    [line] = reporter.push()
    assert line.startswith("swanlab: writing failed, not reporting to it for the rest of this attempt:"), line
    children = [p for p in psutil.Process().children(recursive=True) if "swanlab_child" in " ".join(p.cmdline())]
    assert children == []
    assert reporter.finish("succeeded") == []
