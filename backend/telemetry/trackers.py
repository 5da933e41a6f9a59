"""The experiment trackers a job's `report_to` names, written from the database while the run trains:
TensorBoard event files, a Weights & Biases run, an MLflow run, a SwanLab experiment.

The workers stay tracker-free (nothing to install on the nodes, no keys there): a `Reporter` per
watched attempt sends the samples recorded since its last push every few seconds, and once more when
the attempt ends. Each studio run is one tracker run, its job as the config; what a tracker was sent
(the cursor) and its own run id are kept in `<run_dir>/trackers/<name>.json` on the studio's machine,
so a resume, an automatic restart or a restarted studio goes on where the last push ended.

Step series (`train/…`) are sent against the training step, clock series (GPU, host, rank waits)
against the seconds since the run's first sample. A resumed attempt repeats the steps after its
checkpoint: a tracker keeps the value of a step it was sent first (it cannot take one back), where
the studio's charts and exports show the later attempt's.
"""
from __future__ import annotations

import fcntl
import json
import logging
import math
import netrc
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from sqlalchemy import select
from sqlalchemy.engine import Engine

from backend.job.jsonfile import read_json, write_json_atomic
from backend.job.spec import JobSpec
from backend.store.telemetry_models import MetricSample
from backend.telemetry.export import series_tag

log = logging.getLogger(__name__)
S = MetricSample.__table__
PUSH_EVERY_S = 5.0
BATCH_ROWS = 20_000  # samples read per query: a run that was not pushed for hours is sent in slices
STEP_AXIS, CLOCK_AXIS = "train/step", "time/elapsed_s"


@dataclass(frozen=True)
class Point:
    tag: str
    t: float  # unix seconds
    step: int | None  # the training step; None for a clock series
    value: float


@dataclass
class Cursor:
    """What a tracker was sent: samples up to `last_id`, each step series up to its step in `steps`;
    `t0` is the clock series' zero; `state` the tracker's own (its run id)."""
    last_id: int = 0
    t0: float | None = None
    steps: dict[str, int] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> "Cursor":
        if not path.exists():
            return cls()
        raw = read_json(path, "tracker cursor", TrackerError)
        try:
            return cls(int(raw["last_id"]), None if raw.get("t0") is None else float(raw["t0"]),
                       {str(k): int(v) for k, v in raw.get("steps", {}).items()}, dict(raw.get("state", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise TrackerError(f"{path}: not a tracker cursor ({exc}); remove it to send the run again") from None

    def save(self, path: Path) -> None:
        write_json_atomic(path, {"last_id": self.last_id, "t0": self.t0, "steps": self.steps, "state": self.state})


class TrackerError(Exception):
    """A tracker that cannot be written; the message says which and why."""


def new_points(engine: Engine, run_id: str, cursor: Cursor) -> tuple[list[Point], Cursor]:
    """The run's raw samples recorded after `cursor`, as points to send, and the cursor past them.
    A step a series was already sent (a resumed attempt doing it again) and values that were NaN or
    missing are left out."""
    with engine.connect() as conn:
        rows = conn.execute(select(S.c.id, S.c.name, S.c.node, S.c.gpu, S.c.rank, S.c.t, S.c.step, S.c.value)
                            .where(S.c.run_id == run_id, S.c.id > cursor.last_id, S.c.res_s == 0)
                            .order_by(S.c.id).limit(BATCH_ROWS)).all()
    steps = dict(cursor.steps)
    t0 = cursor.t0
    points = []
    for _id, name, node, gpu, rank, t, step, value in rows:
        t0 = t if t0 is None else t0
        if value is None or not math.isfinite(value):
            continue
        tag = series_tag(name, node, gpu, rank)
        if step is not None:
            if step <= steps.get(tag, -1):
                continue
            steps[tag] = step
        points.append(Point(tag, t, step, value))
    last_id = rows[-1][0] if rows else cursor.last_id
    return points, Cursor(last_id, t0, steps, cursor.state)


def flat_config(spec: JobSpec) -> dict[str, Any]:
    """The job as a tracker's config: every field, lists and dicts as JSON text."""
    return {k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in spec.model_dump(mode="json").items()}


class Sink:
    """One tracker of one run. `open` starts or continues its run, `log` sends points (in order),
    `close` ends the tracker's run with the studio run's state (None: the run goes on)."""
    name = ""

    def open(self, cursor: Cursor) -> str:
        """Returns a line for the run's notices: where the tracker's run is."""
        raise NotImplementedError

    def log(self, points: list[Point], t0: float) -> None:
        raise NotImplementedError

    def close(self, final_state: str | None) -> None:
        raise NotImplementedError

    def abandon(self) -> None:
        """Let go of what `open` started after a failure (best effort; nothing more is sent)."""


@dataclass
class RunInfo:
    run_id: str
    name: str
    run_dir: Path
    spec: JobSpec


class TensorBoardSink(Sink):
    """Event files in `<run_dir>/tensorboard`, a new file each time a watch of an attempt starts
    (TensorBoard reads them all)."""
    name = "tensorboard"

    def __init__(self, run: RunInfo):
        self.logdir = run.run_dir / "tensorboard"
        self.writer = None

    def open(self, cursor: Cursor) -> str:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.logdir.mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(self.logdir))
        return f"tensorboard: writing to {self.logdir}"

    def log(self, points: list[Point], t0: float) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        for p in points:
            self.writer.add_event(Event(wall_time=p.t, step=p.step if p.step is not None else int(p.t - t0),
                                        summary=Summary(value=[Summary.Value(tag=p.tag, simple_value=p.value)])))
        self.writer.flush()

    def close(self, final_state: str | None) -> None:
        if self.writer is not None:
            self.writer.close()

    def abandon(self) -> None:
        self.close(None)


def wandb_mode() -> str:
    """WANDB_MODE where set; else online when this machine holds a W&B key (WANDB_API_KEY or a
    netrc entry for its host, as `wandb login` leaves), offline otherwise."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = re.sub(r"^https?://", "", os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).split("/")[0]
    try:
        return "online" if netrc.netrc().authenticators(host) else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


class WandbSink(Sink):
    """A W&B run whose id is the studio run's (so each attempt continues it), in the project
    WANDB_PROJECT (default swift-studio). Offline runs are written under `<run_dir>/trackers/wandb`
    for `wandb sync`. W&B's own system metrics are off: they would be the studio machine's."""
    name = "wandb"

    def __init__(self, run: RunInfo):
        self.info, self.run, self.axes = run, None, set()

    def open(self, cursor: Cursor) -> str:
        import wandb

        mode = wandb_mode()
        wid = cursor.state.get("wandb_id") or re.sub(r"[^A-Za-z0-9_-]", "-", self.info.run_id)[:64]
        cursor.state["wandb_id"] = wid
        where = self.info.run_dir / "trackers"
        where.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "swift-studio", entity=os.environ.get("WANDB_ENTITY") or None,
            id=wid, name=self.info.name, dir=str(where), config=flat_config(self.info.spec), mode=mode,
            resume="allow", reinit="create_new",
            settings=wandb.Settings(silent=True, console="off", save_code=False, disable_git=True,
                                    disable_job_creation=True, x_disable_stats=True, x_save_requirements=False))
        self.run.define_metric(STEP_AXIS, hidden=True)
        self.run.define_metric(CLOCK_AXIS, hidden=True)
        if mode == "offline":
            return f"wandb: offline run {wid} in {where / 'wandb'} (no W&B key on this machine; `wandb sync` uploads it)"
        return f"wandb: run {wid} in project {self.run.project} ({getattr(self.run, 'url', '') or mode})"

    def log(self, points: list[Point], t0: float) -> None:
        rows: dict[tuple[str, float], dict[str, float]] = {}
        for p in points:
            axis, x = (STEP_AXIS, p.step) if p.step is not None else (CLOCK_AXIS, round(p.t - t0, 1))
            if p.tag not in self.axes:
                self.run.define_metric(p.tag, step_metric=axis)
                self.axes.add(p.tag)
            rows.setdefault((axis, x), {})[p.tag] = p.value
        for (axis, x), values in rows.items():
            self.run.log({axis: x, **values})

    def close(self, final_state: str | None) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if final_state == "failed" else 0)

    def abandon(self) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1)


class MlflowSink(Sink):
    """An MLflow run tagged with the studio run's id, in the experiment MLFLOW_EXPERIMENT_NAME
    (default swift-studio), at the job's `mlflow_tracking_uri`, else $MLFLOW_TRACKING_URI, else
    the file store `<output_dir>/mlruns` (`mlflow ui --backend-store-uri` reads it)."""
    name = "mlflow"
    TAG = "swift_studio.run_id"
    STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}

    def __init__(self, run: RunInfo):
        self.info, self.client, self.mlflow_run = run, None, None
        self.uri = (run.spec.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                    or (run.run_dir.parent / "mlruns").resolve().as_uri())

    def open(self, cursor: Cursor) -> str:
        if "://" not in self.uri or self.uri.startswith("file:"):
            # MLflow 3 keeps its file store in maintenance mode and refuses it unless asked
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient(tracking_uri=self.uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "swift-studio"
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        run_id = cursor.state.get("mlflow_run_id")
        if not run_id:  # a push cut short after creating its run leaves it findable by the tag
            found = client.search_runs([experiment_id], f"tags.`{self.TAG}` = '{self.info.run_id}'", max_results=1)
            run_id = found[0].info.run_id if found else None
        if run_id:
            client.update_run(run_id, status="RUNNING")
        else:
            run_id = client.create_run(experiment_id, run_name=self.info.name, tags={self.TAG: self.info.run_id}).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in flat_config(self.info.spec).items()]
            for i in range(0, len(params), 100):
                client.log_batch(run_id, params=params[i:i + 100])
        cursor.state["mlflow_run_id"] = self.mlflow_run = run_id
        return f"mlflow: run {run_id} in experiment {name!r} at {self.uri}"

    def log(self, points: list[Point], t0: float) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(re.sub(r"[^\w\-. :/]", "_", p.tag), p.value, int(p.t * 1000),
                          p.step if p.step is not None else int(p.t - t0)) for p in points]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.mlflow_run, metrics=metrics[i:i + 1000])

    def close(self, final_state: str | None) -> None:
        if self.mlflow_run is not None and final_state in self.STATUS:
            self.client.set_terminated(self.mlflow_run, self.STATUS[final_state])


def swanlab_mode() -> str:
    """SWANLAB_MODE where set; else online when this machine holds a SwanLab key (SWANLAB_API_KEY),
    offline otherwise."""
    return os.environ.get("SWANLAB_MODE") or ("online" if os.environ.get("SWANLAB_API_KEY") else "offline")


class SwanlabSink(Sink):
    """A SwanLab experiment in the project SWANLAB_PROJECT (default swift-studio), written by a process
    of its own (`backend.telemetry.swanlab_child`: SwanLab holds one run per process). Offline
    experiments are written under `<run_dir>/trackers/swanlab` for `swanlab sync`; online, each
    attempt continues the experiment whose id is the studio run's. SwanLab's probes of the machine
    (hardware, monitor, requirements) are off: they would describe the studio's machine."""
    name = "swanlab"
    STATE = {"succeeded": "success", "failed": "crashed", "stopped": "aborted"}
    ANSWER_S = 120.0

    def __init__(self, run: RunInfo):
        self.info, self.proc = run, None
        self.where = run.run_dir / "trackers" / "swanlab"

    def _call(self, request: dict) -> dict:
        import select

        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            ready = select.select([self.proc.stdout], [], [], self.ANSWER_S)[0]
            line = self.proc.stdout.readline() if ready else b""
        except OSError:
            line, ready = b"", True
        if not line:
            self.proc.kill()
            what = "ended" if ready else f"did not answer within {self.ANSWER_S:g} s"
            raise TrackerError(f"swanlab's process {what} (its output: {self.where / 'process.log'})")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise TrackerError(str(answer.get("error"))[:500])
        return answer

    def open(self, cursor: Cursor) -> str:
        import subprocess
        import sys

        mode = swanlab_mode()
        sid = cursor.state.get("swanlab_id") or re.sub(r"[^a-z0-9]", "", self.info.run_id.lower())[-21:] or "run"
        cursor.state["swanlab_id"] = sid
        self.where.mkdir(parents=True, exist_ok=True)
        with open(self.where / "process.log", "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "backend.telemetry.swanlab_child"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out,
                                         cwd=self.where, start_new_session=True)
        kwargs = dict(project=os.environ.get("SWANLAB_PROJECT") or "swift-studio",
                      workspace=os.environ.get("SWANLAB_WORKSPACE") or None, name=self.info.name,
                      config=flat_config(self.info.spec), mode=mode, log_dir=str(self.where))
        if mode == "online":
            kwargs.update(id=sid, resume="allow")
        where = self._call({"op": "init", "kwargs": kwargs,
                            "probe": {"hardware": False, "monitor": False, "requirements": False}})["where"]
        if mode == "offline":
            return f"swanlab: offline experiment in {self.where} (no SwanLab key on this machine; `swanlab sync` uploads it)"
        return f"swanlab: {mode} experiment {sid} in project {kwargs['project']} ({where})"

    def log(self, points: list[Point], t0: float) -> None:
        self._call({"op": "log", "rows": [(p.tag, p.step if p.step is not None else int(p.t - t0), p.value)
                                          for p in points]})

    def abandon(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def close(self, final_state: str | None) -> None:
        if self.proc is None:
            return
        state = self.STATE.get(final_state, "aborted" if final_state else "success")
        try:
            self._call({"op": "finish", "state": state,
                        "error": f"the run {final_state}" if state == "crashed" else None})
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


SINKS: dict[str, Callable[[RunInfo], Sink]] = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "mlflow": MlflowSink,
                                               "swanlab": SwanlabSink}


class Reporter:
    """The trackers of one watched attempt. `push` and `finish` block (trackers do I/O): call them
    off the event loop; they serialise on a lock. Each returns lines for the run's notices; a
    tracker that fails is named once and dropped for the rest of the attempt, never failing the run."""

    def __init__(self, engine: Engine, run: RunInfo):
        self.engine, self.run = engine, run
        self.sinks = [SINKS[name](run) for name in dict.fromkeys(run.spec.report_to) if name in SINKS]
        self.cursors: dict[str, Cursor] = {}
        self.held: dict[str, int] = {}  # each tracker's lock file, held while this reporter writes it
        self.lock = threading.Lock()

    def _cursor_path(self, sink: Sink) -> Path:
        return self.run.run_dir / "trackers" / f"{sink.name}.json"

    def _hold(self, sink: Sink) -> None:
        """One writer per tracker of a run: two processes watching it (a studio and a CLI, each with
        its own database) would each send the same points."""
        fd = os.open(self.run.run_dir / "trackers" / f"{sink.name}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise TrackerError("another studio or CLI process is writing this run's tracker; it goes on "
                               "doing so") from None
        self.held[sink.name] = fd

    def _release(self) -> None:
        for fd in self.held.values():
            os.close(fd)
        self.held.clear()

    def _drop(self, sink: Sink, doing: str, exc: BaseException) -> str:
        self.sinks.remove(sink)
        try:
            sink.abandon()
        except Exception:  # noqa: BLE001 - it failed already; what matters is said below
            log.debug("run %s: abandoning %s failed", self.run.run_id, sink.name, exc_info=True)
        if sink.name in self.held:
            os.close(self.held.pop(sink.name))
        log.warning("run %s: %s %s failed", self.run.run_id, sink.name, doing, exc_info=exc)
        return (f"{sink.name}: {doing} failed, not reporting to it for the rest of this attempt: "
                f"{type(exc).__name__}: {str(exc)[:300]}")

    def push(self) -> list[str]:
        lines = []
        with self.lock:
            for sink in list(self.sinks):
                try:
                    if sink.name not in self.cursors:
                        path = self._cursor_path(sink)
                        path.parent.mkdir(parents=True, exist_ok=True)
                        self._hold(sink)
                        cursor = Cursor.load(path)
                        lines.append(sink.open(cursor))
                        self.cursors[sink.name] = cursor
                    cursor = self.cursors[sink.name]
                    while True:
                        points, after = new_points(self.engine, self.run.run_id, cursor)
                        if after.last_id == cursor.last_id:
                            break
                        if points:
                            sink.log(points, after.t0)
                        after.save(self._cursor_path(sink))
                        self.cursors[sink.name] = cursor = after
                except Exception as exc:  # noqa: BLE001 - any tracker's failure is reported, not raised
                    lines.append(self._drop(sink, "writing", exc))
        return lines

    def finish(self, final_state: str | None) -> list[str]:
        """The last push, then each tracker's run closed (with `final_state` when the run ended)."""
        lines = self.push()
        with self.lock:
            for sink in list(self.sinks):
                if sink.name in self.cursors:
                    try:
                        sink.close(final_state)
                    except Exception as exc:  # noqa: BLE001
                        lines.append(self._drop(sink, "closing", exc))
            self.sinks.clear()
            self._release()
        return lines
