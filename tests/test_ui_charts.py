"""Monitor helpers without a browser: the per-session series buffer, downsampling, figures built
from series points, the run status and config diff texts, the access rules."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from studio.access import AccessError, check_bind, load_auth
from studio.charts import (STEP_SERIES, SeriesBuffer, downsample, ema, figures, heatmap_grid, overlay_figure,
                           progress_html, run_curve, stepped, with_gaps)
from studio.run_view import (RESUME_LABEL, RUN_AGAIN_LABEL, alerts_md, config_diff, overtaken_by_status,
                             restart_button, restart_message, status_md)

NO = -1


def key(name, node="n1", gpu=NO, rank=NO):
    return (name, node, gpu, rank)


def test_buffer_takes_only_new_points_and_resets():
    buf = SeriesBuffer(run_id="r")
    assert buf.apply({key("train/loss", rank=0): [(1.0, 3.0), (2.0, 2.5)]}, cursor=10, reset=True)
    # The same points again (an overlapping read) change nothing.
    assert not buf.apply({key("train/loss", rank=0): [(2.0, 2.5)]}, cursor=11, reset=False)
    assert buf.apply({key("train/loss", rank=0): [(3.0, 2.0)]}, cursor=12, reset=False)
    assert buf.named("train/loss")[key("train/loss", rank=0)] == [(1.0, 3.0), (2.0, 2.5), (3.0, 2.0)]
    assert buf.cursor == 12 and buf.last("train/loss") == 2.0
    buf.apply({key("train/loss", rank=0): [(9.0, 1.0)]}, cursor=20, reset=True)
    assert buf.named("train/loss")[key("train/loss", rank=0)] == [(9.0, 1.0)]


def test_buffer_stays_bounded_for_a_day_of_64_gpus():
    buf = SeriesBuffer(max_points=500)
    day = [(float(t), float(t % 100)) for t in range(0, 86400, 10)]
    series = {key("gpu/util_pct", f"node{n // 8}", gpu=n % 8): day for n in range(64)}
    buf.apply(series, cursor=1, reset=True)
    assert all(len(pts) <= 1000 for pts in buf.points.values())
    figs = figures(buf, smoothing=0.6)
    heat = figs["util_heatmap"].data[0]
    assert len(heat.y) == 64 and len(heat.x) <= 120
    assert len(figs["util_lines"].data) == 64


def test_downsample_keeps_ends_and_means():
    pts = [(float(i), float(i)) for i in range(1001)]
    out = downsample(pts, 102)
    assert len(out) == 102 and out[0] == pts[0] and out[-1] == pts[-1]
    assert all(a[0] < b[0] for a, b in zip(out, out[1:]))
    gap = downsample([(float(i), None) for i in range(100)] + [(100.0, 1.0)], 10)
    assert gap[1][1] is None


def test_ema_debiased_and_skips_gaps():
    assert ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    assert ema([1.0, None, 3.0], 0.0) == [1.0, None, 3.0]
    assert ema([1.0, float("nan")], 0.5)[1] is None


def test_heatmap_grid_buckets_every_series():
    series = {key("gpu/util_pct", gpu=0): [(0.0, 0.0), (10.0, 100.0)],
              key("gpu/util_pct", gpu=1): [(0.0, 50.0)]}
    times, labels, z = heatmap_grid(series, columns=2)
    assert labels == ["n1:0", "n1:1"] and len(times) == 2
    assert z[0] == [0.0, 100.0] and z[1] == [50.0, None]


def test_figures_fall_back_to_cpu_and_host_memory_without_gpus():
    buf = SeriesBuffer()
    buf.apply({key("host/cpu_pct"): [(1.0, 90.0), (2.0, 95.0)], key("host/ram_used_gib"): [(1.0, 3.0)],
               key(STEP_SERIES, rank=0): [(1.0, 5.0), (2.0, 10.0)],
               key("train/loss", rank=0): [(1.0, 5.0), (2.0, 4.0)],
               key("rank/collective_wait_s", rank=1): [(1.0, 0.01)]}, cursor=1, reset=True)
    figs = figures(buf, smoothing=0.0)
    assert "CPU utilisation" in figs["util_lines"].layout.title.text
    assert "Host memory" in figs["memory"].layout.title.text
    assert list(figs["loss"].data[0].y) == [5.0, 4.0]
    assert figs["collective"].data[0].name == "rank 1"
    assert figs["power"] is None  # a CPU-only run has no power panel to leave empty
    assert list(figs["util_lines"].layout.yaxis.range) == [0, 100]  # 95 % is drawn near the top, not at a floor
    assert figs["memory"].data[0].mode == "lines+markers"  # one point: its marker, not an invisible line
    # One CPU node: its utilisation is a line; a heatmap of one row is not drawn.
    assert figs["util_heatmap"] is None and len(figs["util_lines"].data) == 1
    assert figs["stages"] is None  # no pipeline
    buf.apply({key("rank/stage_compute_s", rank=r): [(1.0, 0.5 + r)] for r in range(2)}, cursor=3, reset=False)
    stages = figures(buf, smoothing=0.0)["stages"]
    assert "Pipeline stage compute" in stages.layout.title.text and [t.name for t in stages.data] == ["rank 0", "rank 1"]
    buf.apply({key("host/cpu_pct", "n2"): [(1.0, 50.0)]}, cursor=2, reset=False)
    assert list(figures(buf, smoothing=0.0)["util_heatmap"].data[0].y) == ["n1", "n2"]


def test_a_series_breaks_where_it_was_not_sampled_and_a_learning_rate_axis_has_exponents():
    """Host memory across a stop and resume was one straight line from the stop to the resume; a
    diverging run's learning rate axis read 0.996966M."""
    pts = [(float(t), 1.0) for t in range(0, 10, 2)] + [(float(t), 2.0) for t in range(600, 610, 2)]
    gapped = with_gaps(pts)
    assert [v for _, v in gapped].count(None) == 1 and gapped[5] == (304.0, None)
    assert with_gaps(pts[:5]) == pts[:5]  # regular sampling: no break
    buf = SeriesBuffer()
    buf.apply({key("host/ram_used_gib"): pts, key(STEP_SERIES, rank=0): [(1.0, 1.0)],
               key("train/learning_rate", rank=0): [(1.0, 996966.0)]}, cursor=1, reset=True)
    figs = figures(buf, smoothing=0.0)
    assert None in figs["memory"].data[0].y
    assert figs["lr"].layout.yaxis.exponentformat == "e" and figs["lr"].data[0].mode == "lines+markers"


def test_training_charts_are_drawn_against_the_step_with_the_time_in_the_hover():
    buf = SeriesBuffer()
    buf.apply({key(STEP_SERIES, rank=0): [(100.0, 5.0), (160.0, 10.0), (220.0, 15.0)],
               key("train/loss", rank=0): [(100.0, 3.0), (160.0, 2.5), (220.0, 2.0)],
               key("train/learning_rate", rank=0): [(100.0, 1e-3), (160.0, 2e-3), (220.0, 3e-3)],
               key("train/tokens_per_s", rank=0): [(160.0, 400.0)],
               # an evaluation logged a little after the train event of its step
               key("train/eval_loss", rank=0): [(161.5, 2.7)]}, cursor=1, reset=True)
    figs = figures(buf, smoothing=0.0)
    loss = figs["loss"]
    assert loss.layout.xaxis.type == "linear" and loss.layout.xaxis.title.text == "step"
    train, evaluation = loss.data
    assert list(train.x) == [5.0, 10.0, 15.0] and list(train.y) == [3.0, 2.5, 2.0]
    assert (evaluation.name, list(evaluation.x), list(evaluation.y)) == ("eval", [10.0], [2.7])
    assert "%{customdata[0]}" in train.hovertemplate and len(train.customdata[0][0]) == len("12:34:56")
    assert list(figs["lr"].data[0].x) == [5.0, 10.0, 15.0] and list(figs["throughput"].data[0].x) == [10.0]
    # Against time instead: a date axis, the step in the hover.
    by_time = figures(buf, smoothing=0.0, x_axis="time")["loss"]
    assert by_time.layout.xaxis.type == "date" and "step %{customdata[1]}" in by_time.data[0].hovertemplate
    assert [row[1] for row in by_time.data[0].customdata] == ["5", "10", "15"]


def test_a_preference_run_gets_its_rewards_chart_and_an_sft_run_none():
    buf = SeriesBuffer()
    steps = {key(STEP_SERIES, rank=0): [(100.0, 1.0), (160.0, 2.0)], key("train/loss", rank=0): [(100.0, 0.69), (160.0, 0.5)]}
    buf.apply(steps, cursor=1, reset=True)
    assert figures(buf, smoothing=0.0)["preference"] is None
    buf.apply({**steps, key("train/rewards_chosen", rank=0): [(100.0, 0.0), (160.0, 0.3)],
               key("train/rewards_rejected", rank=0): [(100.0, 0.0), (160.0, -0.2)],
               key("train/rewards_margins", rank=0): [(100.0, 0.0), (160.0, 0.5)],
               key("train/rewards_accuracies", rank=0): [(100.0, 0.0), (160.0, 0.75)]}, cursor=2, reset=True)
    figure = figures(buf, smoothing=0.0)["preference"]
    traces = {t.name: t for t in figure.data}
    assert list(traces) == ["chosen", "rejected", "margins", "accuracy %"]
    assert list(traces["margins"].x) == [1.0, 2.0] and list(traces["accuracy %"].y) == [0.0, 75.0]
    assert traces["accuracy %"].yaxis == "y2" and list(figure.layout.yaxis2.range) == [0, 100]


def test_each_ranks_peak_memory_is_set_against_the_estimate_less_its_cuda_context():
    buf = SeriesBuffer()
    assert figures(buf, smoothing=0.0, estimate={"total_gib": 31.0, "other_gib": 1.0})["rank_memory"] is None
    peaks = {key("rank/mem_peak_gib", rank=0): [(100.0, 20.0), (160.0, 33.0)],
             key("rank/mem_peak_gib", rank=1): [(100.0, 18.0), (160.0, 27.0)],
             key("gpu/mem_used_gib", gpu=0): [(100.0, 40.0)]}
    buf.apply(peaks, cursor=1, reset=True)
    figure = figures(buf, smoothing=0.0, estimate={"total_gib": 31.0, "other_gib": 1.0})["rank_memory"]
    bars = figure.data[0]
    assert list(bars.x) == ["rank 0", "rank 1"] and list(bars.y) == [33.0, 27.0]  # each rank's latest peak
    assert list(bars.customdata) == ["+10% of the estimate", "-10% of the estimate"]
    line = figure.layout.shapes[0]
    assert line.y0 == line.y1 == 30.0 and "prediction" in figure.layout.annotations[-1].text
    # on CPUs the peak is the process's resident set, which the per-GPU estimate does not model
    del buf.points[key("gpu/mem_used_gib", gpu=0)]
    figure = figures(buf, smoothing=0.0, estimate={"total_gib": 31.0, "other_gib": 1.0})["rank_memory"]
    assert not figure.layout.shapes and "no GPU" in figure.layout.title.text


def test_a_first_point_on_a_time_axis_spans_a_minute_not_milliseconds():
    buf = SeriesBuffer()
    buf.apply({key("host/cpu_pct"): [(1000.0, 50.0)]}, cursor=1, reset=True)
    lo, hi = figures(buf, smoothing=0.0)["util_lines"].layout.xaxis.range
    assert hi - lo == pytest.approx(60_000)


def test_points_take_the_step_of_the_latest_train_event_at_or_before_them():
    series = {key(STEP_SERIES, rank=0): [(10.0, 1.0), (20.0, 2.0)],
              key("train/loss", rank=0): [(5.0, 9.0), (10.0, 3.0), (15.0, 2.0), (20.0000001, 1.0)],
              key("train/loss", "n2", rank=0): [(10.0, 3.0)]}
    assert stepped(series, key("train/loss", rank=0)) == [(1.0, 3.0, 10.0), (1.0, 2.0, 15.0), (2.0, 1.0, 20.0000001)]
    assert stepped(series, key("train/loss", "n2", rank=0)) == []  # no step series of that node


def test_ingested_series_carry_the_step_each_step_once_after_a_resume():
    """The step series from the ingestor (history and live tail) through to the Runs overlay."""
    from sqlmodel import create_engine

    from backend.telemetry.ingest import Ingestor

    ing = Ingestor(create_engine("sqlite://"), autostart=False)
    offset = iter(range(1, 1000))

    def event(attempt, data):
        ing.on_agent_line("r", "n1", {"kind": "event", "file": "events/rank-0.jsonl", "offset": next(offset),
                                      "rank": 0, "data": data}, attempt=attempt)

    event(1, {"type": "start", "time": 0.0, "resumed_from": None})
    for step in range(1, 11):
        event(1, {"type": "train", "time": float(step), "step": step, "loss": 10.0 - step})
    event(2, {"type": "start", "time": 50.0, "resumed_from": 5})
    for step in range(6, 9):  # attempt 2 redid steps 6..8 from the checkpoint of step 5
        event(2, {"type": "train", "time": 50.0 + step, "step": step, "loss": 1.0})
    ing.flush()
    names = ["train/loss", STEP_SERIES]
    full = ing.series("r", names)
    curve = run_curve(full.series)
    assert [(s, v) for s, v, _ in curve] == [(float(s), 10.0 - s) for s in range(1, 6)] + [(6.0, 1.0), (7.0, 1.0),
                                                                                          (8.0, 1.0)]
    event(2, {"type": "train", "time": 59.0, "step": 9, "loss": 0.5})
    live = ing.series("r", names, since=full.cursor)
    assert not live.reset and [(s, v) for s, v, _ in run_curve(live.series)] == [(9.0, 0.5)]
    # Reduced to a point budget, the steps are bucket means next to the loss means of the same events.
    reduced = run_curve(ing.series("r", names, max_points=3).series)
    assert len(reduced) <= 6 and all(1.0 <= s <= 9.0 for s, _, _ in reduced)


def test_overlay_draws_runs_against_the_step_or_the_minutes_since_their_start():
    curves = {"a": [(5.0, 3.0, 100.0), (10.0, 2.0, 160.0)], "b": [(5.0, 3.5, 5000.0)]}
    fig = overlay_figure(curves)
    assert list(fig.data[0].x) == [5.0, 10.0] and list(fig.data[1].x) == [5.0]
    assert fig.layout.xaxis.title.text == "step" and fig.data[0].customdata[1][0] == "1m 00s"
    by_time = overlay_figure(curves, x_axis="time")
    assert list(by_time.data[0].x) == [0.0, 1.0] and list(by_time.data[1].x) == [0.0]
    assert by_time.data[0].customdata[1][1] == "10"


def test_resume_button_says_run_again_without_a_checkpoint():
    assert restart_button("failed", [(40, "/r/checkpoint-40")]) == (RESUME_LABEL, True)
    assert restart_button("failed", []) == (RUN_AGAIN_LABEL, True)
    assert restart_button("running", []) == (RESUME_LABEL, False)
    assert "step 40" in restart_message("r1", [(40, "/r/checkpoint-40"), (20, "/r/checkpoint-20")])
    assert "No checkpoint" in restart_message("r1", []) and "step 0" in restart_message("r1", [])
    # the status line names a resumed checkpoint, not a run again from step 0: only that line stays
    assert overtaken_by_status(restart_message("r1", [(4, "p")])) and not overtaken_by_status(restart_message("r1", []))
    assert not overtaken_by_status(None) and not overtaken_by_status("")


def test_progress_bar_and_eta():
    assert "waiting" in progress_html(None, None, None, "running")
    assert "running: tokenizing the dataset or waiting for its cache (2m 05s so far); waiting" in progress_html(
        None, None, None, "running", {"type": "data", "phase": "preparing", "elapsed_s": 125.0})
    assert "data read from the tokenized cache in 0.3 s" in progress_html(
        None, 100, None, "running", {"phase": "ready", "tokenized": False, "seconds": 0.31})
    assert "data streamed: read and tokenized as the steps ask" in progress_html(
        None, 100, None, "running", {"phase": "ready", "streaming": True})
    text = progress_html(30, 120, 95.0, "running")
    assert "step 30 / 120 (25%)" in text and "ETA 1m 35s" in text and "width:25.0%" in text and "skipped" not in text
    # records a strict-off run skipped stay in view while it trains; their reasons (the data's own
    # text: file names, a record's fields) are escaped
    crafted = {"phase": "ready", "seconds": 1.0, "skipped": 1234,
               "skipped_first": ["a.jsonl:3: image x'><script>alert(1)</script>.png not found", "a.jsonl:9: no messages"]}
    text = progress_html(30, 120, 95.0, "running", crafted)
    assert "1,234 records skipped (strict off)" in text and "<script>" not in text
    assert "a.jsonl:3: image x&#x27;&gt;&lt;script&gt;alert(1)&lt;/script&gt;.png not found\na.jsonl:9" in text
    assert "1,234 records skipped" in progress_html(None, 120, None, "running", crafted)
    assert "skipped" not in progress_html(30, 120, 95.0, "running", {**crafted, "skipped": "9; <b>"})


def run(**kw):
    base = dict(id="r1", name="r1", state="failed", attempts=2, created_at=1000.0, ended_at=1090.0, cause="out_of_memory",
                failed_node="gpu2", exit_code=1, message="CUDA out of memory on rank 3", log_tail="line a\nline b")
    return SimpleNamespace(**(base | kw))


def test_failure_status_names_cause_node_and_last_lines():
    text = status_md(run(), {"resumed_from": 40}, ["12:00:00 re-attached after a studio restart"])
    assert "**Cause: out of memory** (node gpu2, exit code 1)" in text
    assert "What to do:" in text and "line b" in text and "Resumed from the checkpoint of step 40" in text
    assert "attempt 2" in text and "1m 30s" in text and "re-attached" in text


def test_the_status_names_the_layout_of_the_ranks():
    from backend.job.layout import compute_layout
    from backend.job.spec import JobSpec

    spec = JobSpec(model="m", dataset=["d"], nnodes=2, nproc_per_node=4, sequence_parallel_size=2, deepspeed="zero3")
    text = status_md(run(), None, [], compute_layout(spec))
    assert "attempt 2 · DP4×TP1×SP2×CP1 = 8 ranks (2 nodes × 4)" in text
    tp = JobSpec(model="m", dataset=["d"], nproc_per_node=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert compute_layout(tp).name() == "DP2×TP2×SP1×CP1×PP2"


def test_the_status_lists_the_attempts_of_a_restarted_run():
    timeline = [("attempt 1 (launch, 10:00:00–10:05:00): failed, hang on node b",
                 "hang (node b, rank 1): no step for 11 s; flight recorder: rank 0 waits in gloo:all_reduce #3 <x>"),
                ("attempt 2 (automatic restart, 10:05:01–…): running", None)]
    text = status_md(run(), None, ["10:05:01 automatic restart 1 of 2 after killed on node b"], attempts=timeline)
    assert ("attempt 1 (launch, 10:00:00–10:05:00): failed, hang on node b  \n&emsp;↳ hang (node b, rank 1): no step "
            "for 11 s; flight recorder: rank 0 waits in gloo:all\\_reduce \\#3 \\<x\\>  \nattempt 2 (automatic restart") in text
    assert "_10:05:01 automatic restart 1 of 2 after killed on node b_" in text
    assert "attempt 1 (launch" not in status_md(run(), None, [], attempts=timeline[:1])  # one attempt: no timeline


def test_a_worker_error_is_shown_once_with_what_to_do_for_its_cause():
    message = "data error (node localhost, rank 1): /d/train.jsonl:7: unknown record format with fields ['foo']"
    text = status_md(run(cause="data_error", failed_node="localhost", message=message, log_tail=""), None, [])
    # shown as it is: the brackets are escaped, so no Markdown link can be made of a record
    assert "**Cause:** data error (node localhost, rank 1): /d/train.jsonl:7: unknown record format with fields \\['foo'\\]" in text
    assert text.count("data error") == 1
    crafted = status_md(run(cause="data_error", message="bad [click](http://x) <img src=x>\n# heading"), None, [])
    assert "bad \\[click\\](http://x) \\<img src=x\\> \\# heading" in crafted  # inert text, one line
    assert "What to do: fix or remove the named record (file:line)" in text


def test_config_diff_lists_only_changed_fields():
    a = "model: m\nlearning_rate: 0.0001\ndataset: [a.jsonl]\nenv: {}\n"
    b = "model: m\nlearning_rate: 0.0003\ndataset: [a.jsonl, b.jsonl]\nenv: {NCCL_DEBUG: INFO}\n"
    rows = config_diff(a, b)
    assert rows == [["learning_rate", "0.0001", "0.0003"], ["dataset", "a.jsonl", "a.jsonl, b.jsonl"],
                    ["env.NCCL_DEBUG", "—", "INFO"]]


def test_alerts_newest_first_with_place():
    alert = SimpleNamespace(severity="warning", last_t=0.0, rule="low_utilisation", node="n1", rank=2, gpu=-1,
                            count=3, message="GPU utilisation < 60% <b>")
    text = alerts_md([alert])
    assert "low utilisation** (node n1, rank 2) ×3" in text and "&lt;b&gt;" in text
    assert alerts_md([]) == "No alerts."


def test_access_rules(tmp_path):
    check_bind("127.0.0.1", None)
    check_bind("localhost", None)
    with pytest.raises(AccessError, match="SWIFT_STUDIO_AUTH"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", [("a", "b")], ("gpu1",))
    creds = tmp_path / "auth"
    creds.write_text("# users\nalice:s3cret:with:colons\n")
    assert load_auth(str(creds), {}) == [("alice", "s3cret:with:colons")]
    assert load_auth(None, {"SWIFT_STUDIO_AUTH": "bob:pw"}) == [("bob", "pw")]
    assert load_auth(None, {}) is None
    creds.write_text("nobody\n")
    with pytest.raises(AccessError, match=r"auth:1: expected 'user:password'"):
        load_auth(str(creds), {})


def test_a_tick_resends_only_what_changed():
    """The Monitor's tick: an output whose content this browser already shows is not sent again
    (each chart sent is drawn from scratch), an output that changed is, as is all of it for a new
    buffer (a reload, another run)."""
    import plotly.graph_objects as go

    buf = SeriesBuffer(run_id="r")
    fig = lambda ys: go.Figure(go.Scatter(x=list(range(len(ys))), y=ys))  # noqa: E731
    first = {"status": "running", "loss": fig([1.0, 0.9]), "power": {"__type__": "update", "value": None,
                                                                      "visible": False}}
    assert buf.changes(first) == first
    assert buf.changes({"status": "running", "loss": fig([1.0, 0.9]), "power": dict(first["power"])}) == {}
    again = buf.changes({"status": "running", "loss": fig([1.0, 0.9, 0.8]),
                         "power": {"__type__": "update", "value": fig([5.0]), "visible": True}})
    assert set(again) == {"loss", "power"}
    assert set(SeriesBuffer(run_id="r").changes(first)) == {"status", "loss", "power"}


def test_the_monitor_reads_an_ended_run_slowly_once_its_last_events_had_time_to_land():
    """A run that is checking, launching or running is read every TICK_S; one that ended is read
    every IDLE_TICK_S once SETTLE_S have passed since it ended (its final checkpoint's event can land
    after its state). An ended run without an end time (written before there was one) is idle."""
    from studio.monitor_tab import IDLE_TICK_S, SETTLE_S, TICK_S, tick_interval

    assert IDLE_TICK_S > TICK_S
    assert tick_interval(False, None, 1000.0) == TICK_S
    assert tick_interval(False, 10.0, 1000.0) == TICK_S  # a resumed run's old end time is cleared, but may linger
    assert tick_interval(True, 1000.0 - SETTLE_S + 1, 1000.0) == TICK_S
    assert tick_interval(True, 1000.0 - SETTLE_S, 1000.0) == IDLE_TICK_S
    assert tick_interval(True, None, 1000.0) == IDLE_TICK_S


def test_a_pages_reads_of_the_run_end_in_the_order_asked(tmp_path):
    """The Monitor reads its run on the timer, the user's pick, the tab's opening and a resume: one
    group of one at a time, in the queue's order, so a read of the run shown before a pick cannot
    end after the pick's own and draw that run under it (Gradio runs different events at once: a
    suite run showed the page's first run under the picked one)."""
    from studio.app import build_app
    from studio.context import Studio

    app = build_app(Studio(tmp_path, tmp_path / "runs"))
    reads = [fn for fn in app.fns.values() if fn.name == "tick"]
    assert sorted(trigger for fn in reads for _, trigger in fn.targets) == ["input", "then", "then", "tick"]
    assert {(fn.concurrency_id, fn.concurrency_limit) for fn in reads} == {("monitor-tick", 1)}
