"""Ingest: batched writes, exactly-once events across reconnects and restarts, the live tail,
view downsampling, compaction of old samples, alerts stored once, each step once after a resume."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlmodel import create_engine

from backend.store.telemetry_models import MetricSample, RunEvent
from backend.telemetry import alerts as rules
from backend.telemetry import ingest
from backend.telemetry.agent import Tailer
from backend.telemetry.ingest import AGENT_SILENT_S, Downsampling, Ingestor
from backend.telemetry.query import SeriesKey

S, E = MetricSample.__table__, RunEvent.__table__
T0 = 1_700_000_000.0


@pytest.fixture
def engine(tmp_path):
    # a file database: the flusher thread and the test read through different connections
    return create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}", connect_args={"check_same_thread": False})


def count(engine, table, *where) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(table).where(*where)).scalar()


def gpu_line(t, gpu, util=50.0, used=10.0, total=80.0):
    return json.dumps({"kind": "gpu", "t": t, "gpu": gpu, "util_pct": util, "mem_used_gib": used,
                       "mem_total_gib": total, "power_w": 300.0, "run_pids": [1, 2]})


def write_events(path: Path, events) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


def agent_lines(run_dir: Path, offsets: dict[str, int], files=("events/rank-0.jsonl", "events/rank-1.jsonl")):
    """What an agent started with these offsets sends for the files (the agent's own reader)."""
    tailer = Tailer(run_dir, offsets)
    out = []
    for rel in files:
        for offset, raw in tailer.read(rel):
            out.append(json.dumps({"kind": "event", "file": rel, "offset": offset, "rank": int(rel[-7]),
                                   "data": json.loads(raw)}))
    return out


@pytest.mark.parametrize("paramstyle", ["qmark", "named"])  # SQLite's fast path, and the Core path others use
def test_samples_are_buffered_and_written_in_one_batch(tmp_path, paramstyle):
    engine = create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}", paramstyle=paramstyle)
    ing = Ingestor(engine, autostart=False)
    for i in range(50):
        for g in range(8):
            ing.feed("r", "node-a", gpu_line(T0 + i, g))
    assert count(engine, S) == 0  # nothing touches the database while feeding
    written = ing.flush()
    assert written == 50 * 8 * 4  # util, mem used, mem total, power per GPU line
    assert count(engine, S, S.c.name == "gpu/util_pct") == 400
    assert count(engine, S, S.c.name == "gpu/run_pids") == 0  # not a metric
    assert ing.stats["flushes"] == 1 and ing.flush() == 0


def test_background_thread_writes_within_a_second(engine):
    ing = Ingestor(engine, flush_interval_s=0.1)
    try:
        ing.feed("r", "a", json.dumps({"kind": "host", "t": T0, "cpu_pct": 12.5, "ram_used_gib": 3.0,
                                       "ram_total_gib": 16.0}))
        import time
        deadline = time.time() + 2
        while count(engine, S) < 3 and time.time() < deadline:
            time.sleep(0.05)
        assert count(engine, S, S.c.name == "host/cpu_pct", S.c.value == 12.5) == 1
    finally:
        ing.close()


def test_bad_lines_are_counted_not_raised(engine):
    ing = Ingestor(engine, autostart=False)
    for line in ["not json", "[1, 2]", json.dumps({"kind": "gpu"}), json.dumps({"no": "kind"}), ""]:
        ing.feed("r", "a", line)
    assert ing.stats["bad_lines"] == 5
    ing.flush()
    assert count(engine, S) == 0


def test_an_eval_event_is_the_eval_loss_series_at_its_step_and_progress_for_the_hang_rule(engine):
    ing = Ingestor(engine, autostart=False)
    lines = [{"type": "start", "time": T0}, {"type": "train", "time": T0 + 5, "step": 5, "loss": 2.0},
             {"type": "eval_progress", "time": T0 + 9, "step": 5, "batches": 3, "of": 9},
             {"type": "eval", "time": T0 + 20, "step": 5, "eval_loss": 1.5, "tokens": 900}]
    for offset, data in enumerate(lines, 1):
        ing.feed("r", "a", json.dumps({"kind": "event", "file": "events/rank-0.jsonl", "offset": offset, "rank": 0,
                                       "data": data}))
    ing.flush()
    with engine.connect() as conn:
        rows = conn.execute(select(S.c.step, S.c.value, S.c.t).where(S.c.name == "train/eval_loss")).all()
    assert [tuple(r) for r in rows] == [(5, 1.5, T0 + 20)]
    assert ing.window("r", now=T0 + 30).evaluated == (T0 + 20, 5)


def test_reconnect_neither_loses_nor_duplicates_events(engine, tmp_path):
    run = tmp_path / "run"
    ev0 = [{"type": "start", "time": T0, "world_size": 2, "max_steps": 40}] + [
        {"type": "train", "time": T0 + s, "step": s, "loss": 2.0 / s, "tokens_per_s": 100.0} for s in range(1, 21)]
    ev1 = [{"type": "timing", "time": T0 + s, "rank": 1, "step": s, "step_time_s": 1.0, "collective_wait_s": 0.2,
            "data_wait_s": 0.01} for s in range(1, 21)]
    write_events(run / "events/rank-0.jsonl", ev0[:11])
    write_events(run / "events/rank-1.jsonl", ev1[:10])

    ing = Ingestor(engine, autostart=False)
    first = agent_lines(run, ing.offsets("r", "a"))
    for line in first[:8]:
        ing.feed("r", "a", line)
    ing.flush()
    for line in first[8:]:  # delivered, not yet written when the channel drops
        ing.feed("r", "a", line)

    # more lines are written while disconnected; the new agent starts from the offsets
    write_events(run / "events/rank-0.jsonl", ev0[11:])
    write_events(run / "events/rank-1.jsonl", ev1[10:])
    offsets = ing.offsets("r", "a")
    assert offsets["events/rank-0.jsonl"] == (run / "events/rank-0.jsonl").stat().st_size - sum(
        len(json.dumps(e)) + 1 for e in ev0[11:])
    for line in agent_lines(run, offsets):
        ing.feed("r", "a", line)
    # a stale agent (started from offsets read earlier) repeats lines: they are dropped
    for line in agent_lines(run, {}):
        ing.feed("r", "a", line)
    ing.flush()

    assert count(engine, E) == len(ev0) + len(ev1)
    assert count(engine, S, S.c.name == "train/loss") == 20
    assert count(engine, S, S.c.name == "rank/collective_wait_s", S.c.rank == 1) == 20
    with engine.connect() as conn:
        steps = sorted(conn.execute(select(S.c.step).where(S.c.name == "train/loss")).scalars())
    assert steps == list(range(1, 21))
    assert ing.stats["duplicates"] == len(ev0) + len(ev1)

    # a backend restart: a new ingestor on the same database, the agent resends everything
    again = Ingestor(engine, autostart=False)
    for line in agent_lines(run, {}):
        again.feed("r", "b", line)
    again.flush()
    assert count(engine, E) == len(ev0) + len(ev1)
    assert again.offsets("r", "a") == offsets | {
        "events/rank-0.jsonl": (run / "events/rank-0.jsonl").stat().st_size,
        "events/rank-1.jsonl": (run / "events/rank-1.jsonl").stat().st_size}


def test_offsets_cover_events_and_only_the_nodes_own_log(engine):
    ing = Ingestor(engine, autostart=False)
    ing.feed("r", "a", json.dumps({"kind": "log", "file": "logs/a.log", "offset": 10, "line": "hi"}))
    ing.feed("r", "b", json.dumps({"kind": "log", "file": "logs/b.log", "offset": 7, "line": "hi"}))
    ing.feed("r", "b", json.dumps({"kind": "event", "file": "events/rank-1.jsonl", "offset": 50, "rank": 1,
                                   "data": None}))  # an unreadable line: the offset still moves
    assert ing.offsets("r", "a") == {"logs/a.log": 10, "events/rank-1.jsonl": 50}
    assert ing.offsets("r", "b") == {"logs/b.log": 7, "events/rank-1.jsonl": 50}
    assert count(engine, E) == 0


def test_event_node_follows_rank_placement(engine):
    ing = Ingestor(engine, autostart=False)
    ing.feed("r", "b", json.dumps({"kind": "ranks", "t": T0, "ranks": [{"rank": 1, "local_rank": 0, "pid": 9,
                                                                         "gpu": 0}]}))
    # node a's agent delivers rank 1's line from a shared directory: it is still node b's rank
    ing.feed("r", "a", json.dumps({"kind": "event", "file": "events/rank-1.jsonl", "offset": 20, "rank": 1,
                                   "data": {"type": "timing", "time": T0, "rank": 1, "step": 1,
                                            "step_time_s": 1.0}}))
    ing.flush()
    with engine.connect() as conn:
        assert conn.execute(select(E.c.node)).scalar() == "b"
        assert conn.execute(select(S.c.node).where(S.c.name == "rank/step_time_s")).scalar() == "b"


def test_since_cursor_returns_only_new_points_from_memory(engine):
    ing = Ingestor(engine, autostart=False)
    for i in range(10):
        ing.feed("r", "a", gpu_line(T0 + i, 0, util=float(i)))
    full = ing.series("r", ["gpu/util_pct"])
    key = SeriesKey("gpu/util_pct", "a", 0, -1)
    assert [v for _, v in full.series[key]] == [float(i) for i in range(10)]
    ing.feed("r", "a", gpu_line(T0 + 10, 0, util=10.0))
    ing.feed("r", "a", gpu_line(T0 + 10, 1, util=11.0))
    # the database must not be read for this: drop the table's rows to prove it
    with engine.begin() as conn:
        conn.execute(S.delete())
    new = ing.series("r", ["gpu/util_pct"], since=full.cursor)
    assert new.series == {key: [(T0 + 10, 10.0)], SeriesKey("gpu/util_pct", "a", 1, -1): [(T0 + 10, 11.0)]}
    assert not new.reset
    assert ing.series("r", ["gpu/*"], since=new.cursor).series == {}


def test_since_too_old_for_the_tail_returns_full_history_with_reset(engine):
    now = [T0]
    ing = Ingestor(engine, autostart=False, tail_s=5, clock=lambda: now[0])
    ing.feed("r", "a", gpu_line(T0, 0))
    cursor = ing.series("r", ["gpu/util_pct"]).cursor
    for i in range(1, 20):
        ing.feed("r", "a", gpu_line(T0 + i, 0))
    now[0] = T0 + 20
    ing._tick_tail()
    res = ing.series("r", ["gpu/util_pct"], since=cursor)
    assert res.reset and len(res.series[SeriesKey("gpu/util_pct", "a", 0, -1)]) == 20
    # a cursor from before a backend restart (a browser tab that stayed open) also resets
    restarted = Ingestor(engine, autostart=False)
    assert restarted.series("r", ["gpu/util_pct"], since=res.cursor).reset
    res = restarted.series("r", ["gpu/util_pct"], since=res.cursor)
    assert res.reset and len(res.series[SeriesKey("gpu/util_pct", "a", 0, -1)]) == 20


def test_history_is_reduced_to_the_point_budget_with_true_means(engine):
    ing = Ingestor(engine, autostart=False)
    n = 64 * 600  # 64 GPUs, 10 minutes at 1 Hz
    for i in range(600):
        for g in range(64):
            ing.on_agent_line("r", f"n{g // 8}", {"kind": "gpu", "t": T0 + i, "gpu": g % 8,
                                                  "util_pct": 10.0 * (i % 2) + g})
    ing.flush()
    assert count(engine, S) == n
    res = ing.series("r", ["gpu/util_pct"], max_points=60)
    assert len(res.series) == 64
    for key, pts in res.series.items():
        g = int(key.node[1:]) * 8 + key.gpu
        assert 55 <= len(pts) <= 61
        # ~10 s buckets of a series alternating g and g+10: means near g+5, not samples
        assert all(abs(v - (g + 5)) <= 0.6 for _, v in pts[:-1])
        assert pts == sorted(pts) and T0 <= pts[0][0] and pts[-1][0] <= T0 + 599


def test_compaction_keeps_recent_raw_and_averages_older(engine):
    ds = Downsampling(raw_s=3600, mid_bucket_s=60, old_after_s=86400, old_bucket_s=600)
    ing = Ingestor(engine, autostart=False, downsampling=ds)
    span, t0 = 2 * 3600, 1_699_999_800.0  # t0 on a 10-minute boundary
    for i in range(span):
        ing.on_agent_line("r", "a", {"kind": "gpu", "t": t0 + i, "gpu": 0, "util_pct": float(i % 60)})
        # a reading that was NaN in one sample of each minute must not pull the mean down
        ing.on_agent_line("r", "a", {"kind": "gpu", "t": t0 + i, "gpu": 1, "power_w": math.nan if i % 60 == 7 else 100.0})
    ing.on_agent_line("r", "a", {"kind": "event", "file": "events/rank-0.jsonl", "offset": 10, "rank": 0,
                                 "data": {"type": "train", "time": T0, "step": 1, "loss": 2.0}})
    ing.flush()
    now = t0 + span
    removed = ing.compact("r", now)
    raw = count(engine, S, S.c.name == "gpu/util_pct", S.c.res_s == 0)
    mid = count(engine, S, S.c.name == "gpu/util_pct", S.c.res_s == 60)
    assert raw == 3600 and mid == 60 and removed == 2 * (3600 - 60)  # two series
    with engine.connect() as conn:
        means = set(conn.execute(select(S.c.value).where(S.c.res_s == 60)).scalars())
        assert min(conn.execute(select(S.c.t).where(S.c.res_s == 0, S.c.name == "gpu/util_pct")).scalars()) >= now - 3600
    assert means == {29.5, 100.0}
    assert count(engine, S, S.c.name == "train/loss") == 1  # step series are never averaged
    assert ing.compact("r", now) == 0  # idempotent
    # a day later the minute means become 10-minute means
    ing.compact("r", now + 86400 + 3600)
    assert count(engine, S, S.c.name == "gpu/util_pct", S.c.res_s == 600) == 12
    assert count(engine, S, S.c.name == "gpu/util_pct", S.c.res_s == 60) == 0


def test_log_alerts_are_stored_once_per_condition(engine):
    ing = Ingestor(engine, autostart=False)
    for i, line in enumerate(["[rank1]: torch.OutOfMemoryError: CUDA out of memory.", "ordinary line",
                              "[rank1]: torch.OutOfMemoryError: CUDA out of memory. again"]):
        ing.feed("r", "a", json.dumps({"kind": "log", "file": "logs/a.log", "offset": 10 * (i + 1), "line": line}))
    [alert] = ing.alerts("r")
    assert alert.rule == "log" and alert.node == "a" and alert.rank == 1 and alert.count == 2
    assert "OutOfMemoryError" in alert.detail


def test_the_lines_a_hang_stop_makes_the_other_ranks_log_raise_no_alert(engine):
    """A watch stops attempt 2 as hung: the survivors' 'peer lost' and 'rendezvous failed' lines
    are the stop's, kept in the log; the same lines of the next attempt still alert."""
    ing = Ingestor(engine, autostart=False)
    lines = ["RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:32683: Connection reset by peer",
             "The node 'a_1_0' has failed to send a keep-alive heartbeat to the rendezvous 'r' due to an error of "
             "type RendezvousConnectionError."]

    def log(offset: int, line: str, attempt: int) -> None:
        ing.feed("r", "a", json.dumps({"kind": "log", "file": "logs/a.log", "offset": offset, "line": line}), attempt)

    ing.stopping_hung("r", 2, rules.Finding("hang", "hang:7", "error", T0, "no training step for 11 s"))
    for i, line in enumerate(lines):
        log(10 * (i + 1), line, 2)
    ing.flush()
    assert [a.rule for a in ing.alerts("r")] == ["hang"]  # the watch's finding, and nothing of the stop's
    for i, line in enumerate(lines):
        log(10 * (i + 1), line, 3)
    ing.flush()
    assert sorted(a.rule for a in ing.alerts("r")) == ["hang", "log", "log"]


def test_the_watchs_hang_diagnosis_replaces_the_alert_the_rules_raised_first(engine):
    """The rules raise the hang alert a round before the watch has the ranks' flight recorder
    answers; the watch's fuller finding becomes that alert, and a watch that wins the race
    records it at all."""
    ing = Ingestor(engine, autostart=False)
    first = rules.Finding("hang", "hang:7", "error", T0, "no training step for 11 s (last logged step 7)")
    ing._add_finding("r", ing._run("r"), first)
    ing.flush()
    full = replace(first, t=T0 + 4, message=first.message + "; flight recorder: rank 0 waits in gloo:all_reduce #3",
                   node="b", rank=1)
    ing.stopping_hung("r", 1, full)
    ing.stopping_hung("q", 1, full)  # no alert raised before the watch's
    ing.flush()
    [alert] = ing.alerts("r")
    assert (alert.message, alert.node, alert.rank, alert.count, alert.t) == (full.message, "b", 1, 2, T0)
    assert [a.message for a in ing.alerts("q")] == [full.message]


def test_a_rank_state_counts_from_the_agent_line_that_first_reported_it(engine):
    ing = Ingestor(engine, autostart=False)

    def states(t: float, **by_rank: str) -> None:
        ranks = [{"rank": int(r[1:]), "state": v} for r, v in by_rank.items()]
        ing.feed("r", "b", json.dumps({"kind": "rank_state", "t": t, "ranks": ranks}))

    states(T0, r1="running")
    states(T0 + 4, r1="stopped")
    states(T0 + 6, r1="stopped")  # a repeat (a new agent after a reconnect) keeps the first time
    assert ing.window("r", now=T0 + 10).rank_states == {1: ("stopped", T0 + 4)}
    states(T0 + 8, r1="running")
    assert ing.window("r", now=T0 + 10).rank_states == {1: ("running", T0 + 8)}
    ing.feed("r", "b", json.dumps({"kind": "rank_state", "t": T0 + 9, "ranks": [{"state": "x"}]}))  # no rank
    assert ing.stats["bad_lines"] == 1 and ing.window("r", now=T0 + 10).rank_states == {1: ("running", T0 + 8)}


def test_a_flight_request_is_awaited_from_the_running_ranks_of_the_watched_attempt(engine):
    ing = Ingestor(engine, autostart=False)
    ing.watch_attempt("r", T0, 10, 5)

    def line(node: str, rec: dict) -> None:
        ing.feed("r", node, json.dumps(rec))

    line("a", {"kind": "rank_state", "t": T0 - 50, "ranks": [{"rank": 2, "state": "running"}]})  # an earlier attempt's
    line("a", {"kind": "rank_state", "t": T0 + 1, "ranks": [{"rank": 0, "state": "running"}]})
    line("b", {"kind": "rank_state", "t": T0 + 1, "ranks": [{"rank": 1, "state": "stopped"}]})  # cannot answer
    assert ing.awaiting_flight("r", "req-2")
    answer = {"kind": "flight", "t": T0 + 21, "rank": 0, "requested": True, "collective": "gloo:all_reduce", "seq": 3}
    line("a", {**answer, "request": "req-1"})  # an earlier request's answer (whatever the node's clock says)
    assert ing.awaiting_flight("r", "req-2")
    line("a", {**answer, "request": "req-2"})
    assert not ing.awaiting_flight("r", "req-2") and ing.window("r").flight_request == "req-2"
    ing.flush()
    assert ing.alerts("r") == []  # an answer is the hang alert's to report, not an alert of its own


def test_a_state_held_since_an_earlier_attempt_counts_from_the_watched_attempts_first_line(engine):
    ing = Ingestor(engine, autostart=False)
    ing.feed("r", "b", json.dumps({"kind": "rank_state", "t": T0 - 100, "ranks": [{"rank": 1, "state": "disk_sleep"}]}))
    ing.watch_attempt("r", T0, 10, 5)
    ing.feed("r", "b", json.dumps({"kind": "rank_state", "t": T0 + 2, "ranks": [{"rank": 1, "state": "disk_sleep"}]}))
    assert ing.window("r").rank_states == {1: ("disk_sleep", T0 + 2)} and ing.window("r").attempt_t == T0


def test_rules_run_on_ingested_series_and_a_nonfinite_loss_alerts(engine):
    ing = Ingestor(engine, autostart=False)
    cursor = ing.series("r", ["train/loss"]).cursor
    ev = [{"type": "start", "time": T0}, {"type": "train", "time": T0 + 1, "step": 1, "loss": 2.0},
          {"type": "train", "time": T0 + 2, "step": 2, "loss": None, "nonfinite": {"loss": "nan"}}]
    for i, e in enumerate(ev):
        ing.feed("r", "a", json.dumps({"kind": "event", "file": "events/rank-0.jsonl", "offset": i + 1,
                                       "rank": 0, "data": e}))
    # the live tail holds NaN as the database does: as no value
    assert ing.series("r", ["train/loss"], since=cursor).series == {
        SeriesKey("train/loss", "a", -1, 0): [(T0 + 1, 2.0), (T0 + 2, None)]}
    for i in range(5):
        ing.feed("r", "a", gpu_line(T0 + i, 0, used=79.5, total=80.0))
    ing.evaluate("r", now=T0 + 5)
    ing.evaluate("r", now=T0 + 7)  # the same conditions again: no new rows
    alerts = {a.rule: a for a in ing.alerts("r")}
    assert set(alerts) == {"non_finite", "gpu_memory"}
    assert alerts["gpu_memory"].count == 2 and alerts["gpu_memory"].last_t == T0 + 4
    with engine.connect() as conn:  # NaN is stored as NULL, not as a number
        assert conn.execute(select(S.c.value).where(S.c.name == "train/loss", S.c.step == 2)).scalar_one() is None
    # a restarted backend remembers which alerts exist and that the run started; it counts as
    # running again once an agent reconnects
    again = Ingestor(engine, autostart=False)
    again.evaluate("r", now=T0 + 9)
    assert len(again.alerts("r")) == 2
    assert not again.window("r").running
    again.feed("r", "a", json.dumps({"kind": "heartbeat", "t": T0 + 10}))
    assert again.window("r").running


def test_a_run_whose_agents_are_gone_is_not_a_hang(engine):
    now = [T0]
    ing = Ingestor(engine, autostart=False, clock=lambda: now[0])
    ing.feed("r", "a", json.dumps({"kind": "event", "file": "events/rank-0.jsonl", "offset": 1, "rank": 0,
                                   "data": {"type": "start", "time": T0}}))
    ing.feed("r", "a", json.dumps({"kind": "event", "file": "events/rank-0.jsonl", "offset": 2, "rank": 0,
                                   "data": {"type": "train", "time": T0 + 1, "step": 1, "loss": 1.0}}))
    now[0] = T0 + 1000
    ing.feed("r", "a", json.dumps({"kind": "heartbeat", "t": now[0]}))  # processes alive, no step: a hang
    assert [f.rule for f in ing.evaluate("r")] == ["hang"]
    ing.feed("r", "a", json.dumps({"kind": "bye", "t": now[0], "reason": "run over"}))  # killed, no end event
    assert ing.evaluate("r") == []
    now[0] += 10
    ing.feed("r", "a", json.dumps({"kind": "hello", "t": now[0], "gpus": 0}))  # e.g. a re-attach
    now[0] += AGENT_SILENT_S + 1  # ... but nothing heard since
    assert ing.evaluate("r") == []


def test_an_automatic_restarts_startup_is_not_a_hang_of_the_attempt_that_failed(engine):
    """Killed at step 14 (no end event); the watch follows the next attempt, whose workers are
    still starting (its agent is up, no `start` event yet): the 10 s limit counts from the last
    step only within an attempt, and until its first step the startup limit applies."""
    now = [T0]
    ing = Ingestor(engine, autostart=False, clock=lambda: now[0])

    def event(offset: int, **data):
        ing.feed("r", "a", json.dumps({"kind": "event", "file": "events/rank-0.jsonl", "offset": offset, "rank": 0,
                                       "data": {"time": now[0], **data}}))

    ing.watch_attempt("r", T0, hang_s=10, multiple=5)
    event(1, type="start")
    for step in range(1, 15):
        now[0] += 0.5
        event(1 + step, type="train", step=step, loss=1.0)
    ing.watch_attempt("r", now[0] + 1, hang_s=10, multiple=5)  # the kill, then the restart
    now[0] += 12
    ing.feed("r", "a", json.dumps({"kind": "heartbeat", "t": now[0]}))
    assert ing.evaluate("r") == [] and ing.hang("r", T0) is None
    now[0] += 900  # past the startup limit with no step of the new attempt: that is a hang
    ing.feed("r", "a", json.dumps({"kind": "heartbeat", "t": now[0]}))
    [found] = ing.evaluate("r")
    assert found.rule == "hang" and "since the start (no step logged yet)" in found.message


def test_a_failed_flush_keeps_the_batch(engine, monkeypatch):
    ing = Ingestor(engine, autostart=False)
    ing.feed("r", "a", json.dumps({"kind": "event", "file": "events/rank-0.jsonl", "offset": 5, "rank": 0,
                                   "data": {"type": "start", "time": T0}}))
    real_begin = engine.begin

    def broken():
        raise RuntimeError("database is locked")

    monkeypatch.setattr(engine, "begin", broken)
    assert ing.flush() == 0 and ing.stats["flush_errors"] == 1
    monkeypatch.setattr(engine, "begin", real_begin)
    assert ing.flush() == 1
    assert count(engine, E) == 1 and ing.offsets("r", "a") == {"events/rank-0.jsonl": 5}


def test_a_watchdog_log_line_is_named_by_the_hang_alert(engine):
    ing = Ingestor(engine, autostart=False)
    ing.feed("r", "a", json.dumps({"kind": "event", "file": "events/rank-0.jsonl", "offset": 1, "rank": 0,
                                   "data": {"type": "start", "time": T0}}))
    ing.feed("r", "b", json.dumps({"kind": "log", "file": "logs/b.log", "offset": 100, "line":
                                   "[rank1]:[E ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation "
                                   "timeout: WorkNCCL(SeqNum=9, OpType=ALLGATHER, Timeout(ms)=1800000) ran for 1800042 ms"}))
    [hang] = [f for f in ing.evaluate("r", now=T0 + 2000) if f.rule == "hang"]
    assert "last collective reported stuck: ALLGATHER (timeout 1800 s) on node b" in hang.message


def test_flight_dump_is_stored_and_named_by_the_hang_alert(engine):
    ing = Ingestor(engine, autostart=False)
    ing.feed("r", "a", json.dumps({"kind": "event", "file": "events/rank-0.jsonl", "offset": 1, "rank": 0,
                                   "data": {"type": "start", "time": T0}}))
    ing.feed("r", "b", json.dumps({"kind": "ranks", "t": T0, "ranks": [{"rank": 1, "local_rank": 0, "pid": 5,
                                                                         "gpu": 2}]}))
    ing.feed("r", "b", json.dumps({"kind": "flight", "t": T0 + 50, "rank": 1, "file": "/tmp/nccl_trace_rank_1",
                                   "collective": "nccl:all_reduce", "seq": 7, "state": "started"}))
    ing.evaluate("r", now=T0 + 2000)
    alerts = {a.rule: a for a in ing.alerts("r")}
    assert alerts["collective_stuck"].node == "b" and alerts["collective_stuck"].gpu == 2
    assert "last collective reported stuck: rank 1, node b, GPU 2: nccl:all_reduce #7 (started)" in alerts["hang"].message


@pytest.mark.parametrize("upsert", ["on_conflict", "portable"])
def test_two_ingestors_on_one_database_store_each_line_once(engine, tmp_path, monkeypatch, upsert):
    """A second process (the CLI re-attaching while the studio runs) feeds the same run: the
    database, not one process's memory, decides what is new. `portable` is the path for
    databases without ON CONFLICT."""
    if upsert == "portable":
        monkeypatch.setattr(ingest, "_dialect_insert", lambda conn, table: None)
    run = tmp_path / "run"
    write_events(run / "events/rank-0.jsonl", [{"type": "start", "time": T0}] + [
        {"type": "train", "time": T0 + s, "step": s, "loss": 1.0} for s in range(1, 6)])
    oom = json.dumps({"kind": "log", "file": "logs/a.log", "offset": 30, "line": "torch.OutOfMemoryError: CUDA out of memory"})
    first, second = Ingestor(engine, autostart=False), Ingestor(engine, autostart=False)
    first.window("r"), second.window("r")  # both load the run's state before either writes
    for ing in (first, second, first):
        for line in agent_lines(run, {}, files=("events/rank-0.jsonl",)) + [oom]:
            ing.feed("r", "a", line)
        ing.feed("r", "a", json.dumps({"kind": "ranks", "t": T0, "ranks": [{"rank": 0, "local_rank": 0, "pid": 1,
                                                                             "gpu": 0}]}))
        ing.flush()
    assert first.stats["flush_errors"] == second.stats["flush_errors"] == 0
    assert count(engine, E) == 6 and count(engine, S, S.c.name == "train/loss") == 5
    [alert] = first.alerts("r")
    assert alert.count == 2  # found by both processes, stored once
    assert second.stats["duplicates"] == 6  # dropped by the database, not by its memory
    assert first.offsets("r", "a") == {"events/rank-0.jsonl": (run / "events/rank-0.jsonl").stat().st_size,
                                       "logs/a.log": 30}


def test_a_restarted_attempts_log_lines_are_read_from_its_start(engine):
    """Each attempt's launch writes the node's log anew, so its offsets start again at 0: the
    failure lines of attempt 2 must not be taken for attempt 1's (dropped as seen), and the agent
    of attempt 2 starts at the offset attempt 2 reached, not attempt 1's. A line read from a Slurm
    agent's file is taken once by where it was read (a requeue writes the log anew, same attempt)."""
    ing = Ingestor(engine, autostart=False)
    for offset in range(100, 600, 100):
        ing.on_agent_line("r", "a", {"kind": "log", "file": "logs/a.log", "offset": offset, "line": "step"}, attempt=1)
    oom = {"kind": "log", "file": "logs/a.log", "offset": 60, "line": "torch.OutOfMemoryError: CUDA out of memory"}
    ing.on_agent_line("r", "a", oom, attempt=2)
    ing.flush()
    assert [a.key for a in ing.alerts("r")] == ["log:a:out_of_memory:"]
    assert ing.offsets("r", "a", attempt=2) == {"logs/a.log": 60} and ing.offsets("r", "a", attempt=1) == {
        "logs/a.log": 500}
    assert ing.offsets("r", "a", attempt=3) == {}  # a new attempt's agent reads its log from the start
    nccl = {"kind": "log", "file": "logs/a.log", "offset": 40, "line": "[Rank 1] Watchdog caught collective operation "
            "timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out."}
    for restart, read_at in ((0, 700), (1, 90), (1, 90)):  # the same line of restart 1 read twice
        ing.on_agent_line("r", "a", nccl, attempt=3, read=(f"telemetry/attempt-3/restart-{restart}/a.jsonl", read_at))
    ing.flush()
    [nccl_alert] = [a for a in ing.alerts("r") if a.key != "log:a:out_of_memory:"]
    assert nccl_alert.count == 2


class Attempt:
    """What one attempt's agent sends for rank 0's event file: the file grows across attempts."""

    def __init__(self, ing: Ingestor, number: int, offset: int = 0):
        self.ing, self.number, self.offset = ing, number, offset

    def send(self, event: dict, rank: int = 0) -> None:
        self.offset += 100
        self.ing.feed("r", "a", json.dumps({"kind": "event", "file": f"events/rank-{rank}.jsonl", "offset": self.offset,
                                            "rank": rank, "data": event}), attempt=self.number)

    def steps(self, steps, loss: float, t0: float) -> None:
        for s in steps:
            self.send({"type": "train", "time": t0 + s, "step": s, "loss": loss})
            self.send({"type": "timing", "time": t0 + s, "rank": 0, "step": s, "step_time_s": loss})
            if s % 20 == 0:
                self.send({"type": "checkpoint", "time": t0 + s, "step": s, "path": f"/r/checkpoint-{s}"})
        self.ing.feed("r", "a", gpu_line(t0 + max(steps), 0), attempt=self.number)


def loss_points(ing, cursor=None):
    res = ing.series("r", ["train/loss", "rank/step_time_s"], since=cursor)
    return res, {k.name: v for k, v in res.series.items()}


def test_a_resumed_attempt_replaces_the_steps_it_did_again(engine):
    """Attempt 1 logs steps 1-50 (checkpoints at 20 and 40) and fails; attempt 2 resumes from 40.
    Steps 41-50 show once, with attempt 2's values; attempt 1's rows stay in the database."""
    ing = Ingestor(engine, autostart=False)
    first = Attempt(ing, 1)
    first.send({"type": "start", "time": T0, "resumed_from": None, "max_steps": 60})
    first.steps(range(1, 51), loss=1.0, t0=T0)
    cursor = ing.series("r", ["train/loss"]).cursor  # a chart drawn while attempt 1 ran

    second = Attempt(ing, 2, first.offset)
    second.send({"type": "start", "time": T0 + 1000, "resumed_from": 40, "max_steps": 60})
    res, points = loss_points(ing, cursor)
    assert res.reset  # the chart holds steps 41-50 of attempt 1: it redraws
    assert [v for _, v in points["train/loss"]] == [1.0] * 40
    assert loss_points(ing, res.cursor)[0].reset is False  # once
    second.steps(range(41, 61), loss=2.0, t0=T0 + 1000)
    points = loss_points(ing)[1]
    for name in ("train/loss", "rank/step_time_s"):
        assert [v for _, v in points[name]] == [1.0] * 40 + [2.0] * 20, name
    assert count(engine, S, S.c.name == "train/loss") == 70  # nothing deleted
    assert count(engine, S, S.c.name == "gpu/util_pct") == 2  # clock series are not per step

    # A third attempt from checkpoint 20 (say 40 was lost with its disk) redoes attempt 2's steps too.
    third = Attempt(ing, 3, second.offset)
    third.send({"type": "start", "time": T0 + 2000, "resumed_from": 20, "max_steps": 60})
    third.steps(range(21, 31), loss=3.0, t0=T0 + 2000)
    assert [v for _, v in loss_points(ing)[1]["train/loss"]] == [1.0] * 20 + [3.0] * 10


@pytest.mark.parametrize("starts,cut", [
    ([(1, None)], {}),
    ([(1, None), (2, 40), (3, 60)], {1: 40, 2: 60}),
    ([(1, None), (2, 40), (3, 20)], {1: 20, 2: 20}),
    ([(1, None), (2, None)], {1: 0}),                 # started again from scratch: every step redone
    ([(None, None), (None, 30), (1, 30)], {0: 30}),   # rows from before attempts were recorded
])
def test_superseded_steps(starts, cut):
    from backend.telemetry.query import superseded
    assert superseded(starts) == cut
