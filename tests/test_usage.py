"""What a run used (backend.runs.usage, backend.telemetry.query.energy_j/tokens_trained) and how the
Monitor and the Runs table show it."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from sqlmodel import Session, create_engine

from backend.runs.usage import Usage, attempt_gpus, usage_of
from backend.store.telemetry_models import MetricSample, create_telemetry_tables
from backend.telemetry.query import energy_j, tokens_trained
from studio.run_view import usage_cells, usage_line

T0 = 1_700_000_000.0


def attempt(start, end, nodes, nproc, nnodes=None):
    layout = {"nnodes": nnodes or len(nodes), "nproc_per_node": nproc}
    return SimpleNamespace(started_at=start, ended_at=end, plan_json=json.dumps({"layout": layout}),
                           cluster_json=json.dumps([{"host": f"n{i}", "device": d} for i, d in enumerate(nodes)]))


def test_gpu_hours_count_the_gpus_each_attempt_held():
    two_nodes = attempt(T0, T0 + 1800, ["cuda", "cuda"], 8)        # 16 GPUs for half an hour
    resumed = attempt(T0 + 3600, None, ["cuda", "cuda", "cuda"], 8, nnodes=1)  # 8 GPUs, still running
    assert attempt_gpus(two_nodes) == 16 and attempt_gpus(resumed) == 8
    assert attempt_gpus(attempt(T0, T0 + 60, ["cpu"], 2)) == 0
    usage = usage_of([two_nodes, resumed], now=T0 + 3600 + 900, energy_j=7.2e6, tokens=4_000_000)
    assert usage.gpu_hours == pytest.approx(16 * 0.5 + 8 * 0.25)
    assert usage.energy_kwh == pytest.approx(2.0) and usage.wh_per_mtok == pytest.approx(500.0)
    assert usage.cost(2.5) == pytest.approx(25.0) and usage.cost(None) is None


@pytest.fixture
def engine(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    create_telemetry_tables(engine)
    return engine


def test_energy_is_the_counters_rise_within_each_attempt(engine):
    """Per GPU and attempt window: what the driver's counter rose by. Between attempts the GPU may
    serve someone else; a sample there is not counted."""
    rows = []
    for node, gpu, base in (("a", 0, 1e9), ("a", 1, 2e9), ("b", 0, 5e8)):
        rows += [MetricSample(run_id="r", node=node, gpu=gpu, name="gpu/energy_j", t=T0 + s, value=base + 100 * s)
                 for s in (0, 10, 20)]                                  # attempt 1: +2,000 J per GPU
        rows.append(MetricSample(run_id="r", node=node, gpu=gpu, name="gpu/energy_j", t=T0 + 500, value=base + 1e6))
        rows += [MetricSample(run_id="r", node=node, gpu=gpu, name="gpu/energy_j", t=T0 + s, value=base + 2e6 + 50 * s)
                 for s in (1000, 1020)]                                 # attempt 2: +1,000 J per GPU
    rows.append(MetricSample(run_id="other", node="a", gpu=0, name="gpu/energy_j", t=T0 + 10, value=9e9))
    rows += [MetricSample(run_id="r", node="a", name="train/tokens", t=T0 + i, value=1000.0, step=i) for i in range(1, 4)]
    with Session(engine) as s:
        s.add_all(rows)
        s.commit()
    assert energy_j(engine, "r", [(T0, T0 + 20), (T0 + 1000, T0 + 1020)]) == pytest.approx(3 * 2000 + 3 * 1000)
    assert energy_j(engine, "r", []) is None and energy_j(engine, "nothing", [(T0, T0 + 20)]) is None
    assert tokens_trained(engine, "r") == 3000


def test_the_monitor_and_runs_table_say_what_is_not_known():
    cpu = Usage(gpu_hours=0.0, energy_kwh=None, tokens=5000)
    assert usage_line(cpu, 2.0).startswith("Used: no GPU (CPU nodes)") and usage_cells(cpu, 2.0) == ["", "", "", ""]
    gpu = Usage(gpu_hours=4.0, energy_kwh=1.5, tokens=3_000_000)
    assert usage_line(gpu, 2.5) == "Used: 4.00 GPU-h · 1.500 kWh (500.0 Wh per 1M tokens) · cost 10.00 at 2.5 per GPU-hour"
    assert usage_cells(gpu, None) == [4.0, 1.5, 500.0, ""]
    assert "energy not reported" in usage_line(Usage(gpu_hours=1.0, energy_kwh=None, tokens=10), None)


def test_the_price_per_gpu_hour_is_kept(tmp_path):
    from studio.context import Studio

    studio = Studio(data_dir=tmp_path / "data", output_dir=tmp_path / "runs")
    assert studio.gpu_hour_price() is None
    studio.save_gpu_hour_price(2.75)
    assert Studio(data_dir=tmp_path / "data", output_dir=tmp_path / "runs").gpu_hour_price() == 2.75
    studio.save_gpu_hour_price(0)
    assert studio.gpu_hour_price() is None
    studio.settings_file.write_text("not json")
    assert studio.gpu_hour_price() is None


def test_the_workers_train_events_give_the_token_count(engine):
    """The worker's `train` event carries its window's tokens; the ingestor keeps them as the
    train/tokens series that tokens_trained sums."""
    from backend.telemetry.ingest import Ingestor

    ing = Ingestor(engine, autostart=False)
    for i, step in enumerate((5, 10, 15)):
        ing.feed("r", "a", json.dumps({"kind": "event", "file": "events/rank-0.jsonl", "offset": 100 * (i + 1), "rank": 0,
                                       "data": {"type": "train", "time": T0 + i, "step": step, "loss": 1.0,
                                                "tokens": 2048}}))
    ing.flush()
    assert tokens_trained(engine, "r") == 3 * 2048
    ing.close()
