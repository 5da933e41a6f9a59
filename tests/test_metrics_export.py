"""Metric export (CSV, JSON, TensorBoard) and the `alerts` / `metrics` CLI subcommands."""
from __future__ import annotations

import builtins
import csv
import io
import json
import math

import pytest
from sqlmodel import create_engine

from backend import cli
from backend.telemetry.export import ExportError, export, write_csv, write_json, write_tensorboard
from backend.telemetry.ingest import Ingestor

T0 = 1_700_000_000.0


@pytest.fixture
def recorded(tmp_path):
    """A database with one run: 2 GPUs x 3 samples, 3 train steps (one NaN loss), an OOM log line."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    engine = create_engine(url)
    ing = Ingestor(engine, autostart=False)
    for i in range(3):
        for g in range(2):
            ing.on_agent_line("r1", "node-a", {"kind": "gpu", "t": T0 + i, "gpu": g, "util_pct": 50.0 + g})
    for s, loss in ((1, 2.0), (2, math.nan), (3, 1.5)):
        ing.on_agent_line("r1", "node-a", {"kind": "event", "file": "events/rank-0.jsonl", "offset": s, "rank": 0,
                                           "data": {"type": "train", "time": T0 + s, "step": s, "loss": loss}})
    ing.on_agent_line("r1", "node-a", {"kind": "log", "file": "logs/node-a.log", "offset": 9,
                                       "line": "[rank0]: torch.OutOfMemoryError: CUDA out of memory."})
    ing.close()
    return engine, url


def test_csv_has_one_row_per_sample_with_units_in_names(recorded):
    engine, _ = recorded
    buf = io.StringIO()
    assert write_csv(engine, "r1", buf) == 6 + 3
    rows = list(csv.DictReader(io.StringIO(buf.getvalue())))
    util = [r for r in rows if r["name"] == "gpu/util_pct"]
    assert len(util) == 6 and {r["gpu"] for r in util} == {"0", "1"} and util[0]["rank"] == "-1"
    loss = [r for r in rows if r["name"] == "train/loss"]
    assert [(r["step"], r["value"]) for r in loss] == [("1", "2.0"), ("2", ""), ("3", "1.5")]


def test_json_is_valid_grouped_by_series_and_has_the_alerts(recorded):
    engine, _ = recorded
    buf = io.StringIO()
    assert write_json(engine, "r1", buf, names=["train/*"]) == 3
    doc = json.loads(buf.getvalue())  # strict: NaN would not parse in most readers
    assert "NaN" not in buf.getvalue()
    [series] = doc["series"]
    assert series["name"] == "train/loss" and [p[1:3] for p in series["points"]] == [[1, 2.0], [2, None], [3, 1.5]]
    [alert] = doc["alerts"]
    assert alert["rule"] == "log" and "OutOfMemoryError" in alert["detail"]


def test_unknown_run_and_bad_format_are_clear_errors(recorded):
    engine, _ = recorded
    with pytest.raises(ExportError, match="run nope: no recorded metrics"):
        export(engine, "nope", "csv")
    with pytest.raises(ExportError, match="format: must be one of csv, json, tensorboard"):
        export(engine, "r1", "xlsx")


def test_tensorboard_without_the_package_says_how_to_get_it(recorded, tmp_path, monkeypatch):
    engine, _ = recorded
    real_import = builtins.__import__

    def no_tensorboard(name, *a, **kw):
        if name.startswith("tensorboard"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ExportError, match="pip install tensorboard"):
        write_tensorboard(engine, "r1", tmp_path / "tb")


def test_tensorboard_files_read_back(recorded, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    engine, _ = recorded
    assert write_tensorboard(engine, "r1", tmp_path / "tb") == 6 + 2  # NaN skipped
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == {"gpu/util_pct/node-a:0", "gpu/util_pct/node-a:1", "train/loss"}
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.0), (3, 1.5)]
    assert [e.step for e in acc.Scalars("gpu/util_pct/node-a:1")] == [0, 1, 2]


def test_cli_alerts_and_metrics(recorded, tmp_path, capsys):
    _, url = recorded
    assert cli.main(["alerts", "r1", "--db", url]) == 0
    out = capsys.readouterr().out
    assert "ERROR" in out and "out of memory" in out and "[rank0]: torch.OutOfMemoryError" in out
    assert cli.main(["alerts", "r1", "--db", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["rule"] == "log"

    out_file = tmp_path / "m.csv"
    assert cli.main(["metrics", "r1", "--db", url, "--format", "csv", "--out", str(out_file)]) == 0
    assert "wrote 9 values" in capsys.readouterr().err
    assert out_file.read_text().splitlines()[0] == "name,node,gpu,rank,t,step,value,res_s,attempt"
    assert cli.main(["metrics", "r1", "--db", url, "--format", "json", "--names", "gpu/*"]) == 0
    assert len(json.loads(capsys.readouterr().out)["series"]) == 2

    assert cli.main(["metrics", "missing-run", "--db", url]) == 1
    err = capsys.readouterr().err
    assert "no telemetry recorded for run 'missing-run'" in err and "Traceback" not in err


def test_a_resumed_run_exports_each_step_once(tmp_path):
    """Attempt 1 logged steps 1-5 and failed; attempt 2 resumed from checkpoint 3 and logged 4-6."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    engine = create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    ing = Ingestor(engine, autostart=False)
    offset = 0
    for attempt, resumed_from, steps, loss in ((1, None, range(1, 6), 1.0), (2, 3, range(4, 7), 2.0)):
        for event in [{"type": "start", "time": T0 + 100 * attempt, "resumed_from": resumed_from}] + [
                {"type": "train", "time": T0 + 100 * attempt + s, "step": s, "loss": loss} for s in steps]:
            offset += 50
            ing.on_agent_line("r1", "node-a", {"kind": "event", "file": "events/rank-0.jsonl", "offset": offset,
                                               "rank": 0, "data": event}, attempt=attempt)
    ing.close()
    expected = [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0), (6, 2.0)]

    buf = io.StringIO()
    assert write_csv(engine, "r1", buf) == 6
    assert [(int(r["step"]), float(r["value"])) for r in csv.DictReader(io.StringIO(buf.getvalue()))] == expected
    buf = io.StringIO()
    write_json(engine, "r1", buf)
    [series] = json.loads(buf.getvalue())["series"]
    assert [(p[1], p[2]) for p in series["points"]] == expected
    write_tensorboard(engine, "r1", tmp_path / "tb")
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == expected
