"""Telemetry end to end: a real 2-node gloo run over real SSH (127.0.0.2 and 127.0.0.3, shared run
directory), its agents' samples and the workers' events arriving in the database, a live chart
cursor, and every SSH connection cut mid-run: each event row must still be present exactly once."""
from __future__ import annotations

import getpass
import json
import statistics
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from backend.job.cluster import Cluster
from backend.job.spec import parse_spec
from backend.runs.lifecycle import FINAL
from backend.runs.manager import RunManager
from backend.store.telemetry_models import MetricSample, RankPlacement, RunEvent
from worker import ROOT

pytestmark = pytest.mark.e2e
S, E, P = MetricSample.__table__, RunEvent.__table__, RankPlacement.__table__


def file_lines(run_dir, rel):
    """(offset after the line, event) for every line of a run file."""
    out, pos = [], 0
    for raw in (run_dir / rel).read_bytes().splitlines(keepends=True):
        pos += len(raw)
        out.append((pos, json.loads(raw)))
    return out


def test_agents_stream_a_real_run_and_survive_a_cut_connection(sshd_nodes, tmp_path):
    nodes = sshd_nodes.nodes(user=getpass.getuser())
    spec, problems = parse_spec(dict(
        model=str(ROOT / "assets/demo/model"), dataset=[str(ROOT / "assets/demo/train.jsonl") + "#64"],
        nnodes=2, nproc_per_node=1, max_length=64, per_device_train_batch_size=2, max_steps=60, logging_steps=1,
        save_steps=1000, gradient_checkpointing=False, torch_dtype="float32", output_dir=str(tmp_path / "out"),
        report_to=["tensorboard"], env={"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}))
    assert spec is not None, problems
    mgr = RunManager(db_url=f"sqlite:///{tmp_path / 'studio.db'}", known_hosts=sshd_nodes.known_hosts, reattach=False)
    try:
        run_id = mgr.launch(spec, Cluster(nodes=nodes, source="test"),
                            setups={s.host: sshd_nodes.setup for s in sshd_nodes.servers})

        # live: host samples reach the chart cursor within 1.5 s of being taken
        ages, cursor, deadline = [], None, time.time() + 120
        while len(ages) < 10 and time.time() < deadline:
            run = mgr.run(run_id)
            assert run.state not in FINAL, (run.state, run.message, run.log_tail)
            res = mgr.series(run_id, ["host/cpu_pct"], since=cursor)
            now = time.time()
            if cursor is not None:
                ages += [now - t for pts in res.series.values() for t, _ in pts]
            cursor = res.cursor
            time.sleep(0.1)
        assert len(ages) >= 10, f"no host samples arrived: {mgr.run(run_id)}, agents: {mgr.sink.nodes(run_id)}"
        assert statistics.quantiles(ages, n=20)[-1] < 1.5, sorted(ages)

        # wait for training to log, then cut every SSH connection of both nodes
        deadline = time.time() + 120
        while not mgr.series(run_id, ["train/loss"], since=0).series and time.time() < deadline:
            run = mgr.run(run_id)
            assert run.state not in FINAL, (run.state, run.message, run.log_tail)
            time.sleep(0.2)
        agents_before = {n: s.get("agent_pid") for n, s in mgr.sink.nodes(run_id).items()}
        assert len(agents_before) == 2
        assert sshd_nodes.cut_connections() >= 2
        with mgr.engine.connect() as conn:
            committed_at_cut = conn.execute(select(func.count()).where(E.c.run_id == run_id)).scalar()

        run = mgr.wait(run_id, timeout=240)
        assert run.state == "succeeded", (run.state, run.message, run.log_tail)
        # the watcher drains the agents' last lines after the end; wait for their `bye`
        deadline = time.time() + 30
        while time.time() < deadline and not all(s.get("ended") for s in mgr.sink.nodes(run_id).values()):
            time.sleep(0.2)
        status = mgr.sink.nodes(run_id)
        # report_to: tensorboard event files written from the recorded metrics once the run ended
        tb_dir = Path(run.run_dir) / "tensorboard"
        while time.time() < deadline and not list(tb_dir.rglob("events.out.tfevents.*")):
            time.sleep(0.2)
        assert list(tb_dir.rglob("events.out.tfevents.*")), (tb_dir, mgr.notices(run_id))
        assert all(s.get("ended") == "run over" for s in status.values()), status
        assert any(status[n]["agent_pid"] != pid for n, pid in agents_before.items()), "no agent was restarted"
        mgr.sink.flush()

        run_dir = tmp_path / "out" / run_id
        with mgr.engine.connect() as conn:
            rows = conn.execute(select(E.c.file, E.c.offset, E.c.type, E.c.node, E.c.rank)
                                .where(E.c.run_id == run_id)).all()
            placement = dict(conn.execute(select(P.c.rank, P.c.node).where(P.c.run_id == run_id)).all())
            loss_steps = conn.execute(select(S.c.step).where(S.c.run_id == run_id, S.c.name == "train/loss")).scalars().all()
            host_nodes = set(conn.execute(select(S.c.node).where(S.c.run_id == run_id, S.c.name == "host/ram_used_gib")
                                          .distinct()).scalars())
            wait_rows = conn.execute(select(func.count()).where(
                S.c.run_id == run_id, S.c.name == "rank/collective_wait_s")).scalar()
            peak_ranks = set(conn.execute(select(S.c.rank).where(
                S.c.run_id == run_id, S.c.name == "rank/mem_peak_gib").distinct()).scalars())

        expected = {(f"events/rank-{r}.jsonl", off) for r in (0, 1)
                    for off, _ in file_lines(run_dir, f"events/rank-{r}.jsonl")}
        assert len(rows) == len({(f, o) for f, o, *_ in rows}) == len(expected)
        assert committed_at_cut < len(expected)  # the restarted agents delivered the rest
        assert {(f, o) for f, o, *_ in rows} == expected
        train = [e for _, e in file_lines(run_dir, "events/rank-0.jsonl") if e["type"] == "train"]
        assert sorted(loss_steps) == [e["step"] for e in train] == list(range(1, 61))
        assert wait_rows == 2 * 60 and peak_ranks == {0, 1}
        # the run directory is shared, yet each rank is attributed to the node it ran on
        assert placement == {0: "127.0.0.2", 1: "127.0.0.3"} or placement == {0: "127.0.0.3", 1: "127.0.0.2"}
        assert all(node == placement[rank] for _, _, _, node, rank in rows)
        assert host_nodes == {"127.0.0.2", "127.0.0.3"}
        assert not [a for a in mgr.alerts(run_id) if a.severity == "error"]
    finally:
        mgr.close()
