"""Monitor helpers without a browser: the per-session series buffer, downsampling, figures built
from series points, the run status and config diff texts, the access rules."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from studio.access import AccessError, check_bind, load_auth
from studio.charts import (SeriesBuffer, downsample, ema, figures, heatmap_grid, overlay_figure, progress_html)
from studio.run_view import alerts_md, config_diff, status_md

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
               key("train/loss", rank=0): [(1.0, 5.0), (2.0, 4.0)],
               key("rank/collective_wait_s", rank=1): [(1.0, 0.01)]}, cursor=1, reset=True)
    figs = figures(buf, smoothing=0.0)
    assert "CPU utilisation" in figs["util_lines"].layout.title.text
    assert "Host memory" in figs["memory"].layout.title.text
    assert list(figs["loss"].data[0].y) == [5.0, 4.0]
    assert figs["collective"].data[0].name == "rank 1"
    assert not figs["power"].data and figs["power"].layout.xaxis.visible is False


def test_overlay_aligns_runs_at_their_start():
    fig = overlay_figure({"a": [(100.0, 3.0), (160.0, 2.0)], "b": [(5000.0, 3.5)]})
    assert list(fig.data[0].x) == [0.0, 1.0] and list(fig.data[1].x) == [0.0]


def test_progress_bar_and_eta():
    assert "waiting" in progress_html(None, None, None, "running")
    text = progress_html(30, 120, 95.0, "running")
    assert "step 30 / 120 (25%)" in text and "ETA 1m 35s" in text and "width:25.0%" in text


def run(**kw):
    base = dict(id="r1", name="r1", state="failed", attempts=2, created_at=1000.0, ended_at=1090.0, cause="out_of_memory",
                failed_node="gpu2", exit_code=1, message="CUDA out of memory on rank 3", log_tail="line a\nline b")
    return SimpleNamespace(**(base | kw))


def test_failure_status_names_cause_node_and_last_lines():
    text = status_md(run(), {"resumed_from": 40}, ["12:00:00 re-attached after a studio restart"])
    assert "**Cause: out of memory** (node gpu2, exit code 1)" in text
    assert "What to do:" in text and "line b" in text and "Resumed from the checkpoint of step 40" in text
    assert "attempt 2" in text and "1m 30s" in text and "re-attached" in text


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
    check_bind("0.0.0.0", [("a", "b")])
    creds = tmp_path / "auth"
    creds.write_text("# users\nalice:s3cret:with:colons\n")
    assert load_auth(str(creds), {}) == [("alice", "s3cret:with:colons")]
    assert load_auth(None, {"SWIFT_STUDIO_AUTH": "bob:pw"}) == [("bob", "pw")]
    assert load_auth(None, {}) is None
    creds.write_text("nobody\n")
    with pytest.raises(AccessError, match=r"auth:1: expected 'user:password'"):
        load_auth(str(creds), {})
