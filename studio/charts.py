"""Monitor charts as pure functions of series points (no Gradio, no database).

A `SeriesBuffer` per browser session keeps what the charts show: it takes only the new points of
each tick (`backend` series with a cursor) and thins itself so a day of data on 64 GPUs stays a
few thousand points per series. Figures are built from the buffer on every tick.
"""
from __future__ import annotations

import hashlib
import html

import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import plotly.graph_objects as go

from backend.runs.usage import format_duration

Point = tuple[float, float | None]
Stepped = tuple[float, float | None, float]
"""(step, value, t) of a training series' point."""
# backend.store.telemetry_models.NO_INDEX and backend.telemetry.query.STEP_SERIES, written out: those
# modules load SQLAlchemy, which the page build leaves to the manager thread so that the page
# answers sooner.
NO_INDEX = -1
STEP_SERIES = "train/step"

# The series the Monitor's charts draw, and only those: every tick reads them (names as
# backend.telemetry.ingest stores them; units in the name). train/eval_loss is drawn when a run logs it.
MONITOR_SERIES = (STEP_SERIES, "train/loss", "train/eval_loss", "train/learning_rate", "train/tokens_per_s",
                  "train/mfu", "gpu/util_pct", "gpu/mem_used_gib", "gpu/power_w", "host/cpu_pct",
                  "host/ram_used_gib", "rank/collective_wait_s", "rank/stage_compute_s", "rank/mem_peak_gib", "train/moe_aux_loss",
                  "train/moe_expert_tokens", "train/rewards_chosen", "train/rewards_rejected", "train/rewards_margins",
                  "train/rewards_accuracies")
MAX_POINTS = 1000
HEATMAP_COLUMNS = 120
CHART_HEIGHT = 280
# What the training charts (loss, learning rate, throughput) are drawn against; device charts are
# sampled on a clock and always use time.
X_AXES = ("step", "time")
# A point is of the step of the latest train event at or before it; the slack covers bucket
# means of the same events computed apart (the history reduces each series on its own).
STEP_SLACK_S = 1e-3
# A time axis never spans less than this, so a first point does not get millisecond ticks.
MIN_TIME_SPAN_S = 60.0
MIN_GAP_S = 30.0  # a system series' break (stop → resume) is at least this long; sampling is every few s


def downsample(points: list[Point], target: int) -> list[Point]:
    """Bucket means over equal index ranges, keeping the first and last points exactly.

    None values (NaN/inf at the source) are skipped inside a bucket; a bucket of only Nones
    stays None so a gap remains visible.
    """
    if len(points) <= target or target < 3:
        return list(points)
    inner = points[1:-1]
    size = len(inner) / (target - 2)
    out = [points[0]]
    for i in range(target - 2):
        bucket = inner[int(i * size): max(int((i + 1) * size), int(i * size) + 1)]
        values = [v for _, v in bucket if v is not None]
        t = sum(t for t, _ in bucket) / len(bucket)
        out.append((t, sum(values) / len(values) if values else None))
    out.append(points[-1])
    return out


@dataclass
class SeriesBuffer:
    """The points one browser session shows for one run, keyed as the backend keys them
    (`name`, `node`, `gpu`, `rank`)."""

    run_id: str | None = None
    cursor: int | None = None
    state: str | None = None
    """The run's state when last drawn."""
    restart: tuple[str, bool] | None = None
    """The Monitor's resume button (label, enabled) when last drawn."""
    estimate: tuple[int, dict | None] | None = None
    """(attempts, the memory estimate the latest of them was planned with): read once an attempt."""
    points: dict[tuple, list[Point]] = field(default_factory=dict)
    max_points: int = MAX_POINTS
    drawn: dict[str, str] = field(default_factory=dict)
    """A digest of what each output (status, charts, ...) shows, as last sent to this browser."""

    def changes(self, outputs: dict[str, Any]) -> dict[str, Any]:
        """The outputs whose content differs from what this browser shows (`drawn`), which they
        become: a tick re-sends none of the rest, so the page redraws only what changed (a Plotly
        chart sent again is drawn again from scratch)."""
        out = {}
        for name, value in outputs.items():
            digest = _digest(value)
            if self.drawn.get(name) != digest:
                self.drawn[name] = digest
                out[name] = value
        return out

    def apply(self, series: dict[Any, list[Point]], cursor: int, reset: bool) -> bool:
        """Merge one read; returns True when anything changed. `reset` replaces everything."""
        if reset:
            self.points = {}
        changed = reset
        for key, pts in series.items():
            if not pts:
                continue
            key = tuple(key)
            mine = self.points.setdefault(key, [])
            last_t = mine[-1][0] if mine else -math.inf
            new = [p for p in pts if p[0] > last_t]
            if new:
                mine.extend(new)
                changed = True
                if len(mine) > 2 * self.max_points:
                    self.points[key] = downsample(mine, self.max_points)
        self.cursor = cursor
        return changed

    def named(self, name: str) -> dict[tuple, list[Point]]:
        return {k: v for k, v in sorted(self.points.items()) if k[0] == name and v}

    def last(self, name: str) -> float | None:
        latest = max((pts[-1] for pts in self.named(name).values()), default=None, key=lambda p: p[0])
        return latest[1] if latest else None


def label(key: tuple) -> str:
    _, node, gpu, rank = key
    if gpu != NO_INDEX:
        return f"{node}:{gpu}"
    if rank != NO_INDEX:
        return f"rank {rank}"
    return node


def ema(values: list[float | None], weight: float) -> list[float | None]:
    """TensorBoard's debiased exponential moving average; weight 0 = raw values."""
    out: list[float | None] = []
    last, debias, n = 0.0, 0.0, 0
    for v in values:
        if v is None or not math.isfinite(v):
            out.append(None)
            continue
        last = last * weight + (1 - weight) * v
        n += 1
        debias = 1 - weight**n
        out.append(last / debias if debias else v)
    return out


def _clock_ms(times: list[float]) -> list[float]:
    """Unix times as milliseconds of local wall-clock time: Plotly draws numbers on a 'date' axis
    as UTC, and the page has no timezone library, so the studio's local offset is added here (taken
    once per series: a daylight-saving switch inside one series shifts its earlier part)."""
    offset = time.localtime(times[-1]).tm_gmtoff if times else 0
    return [(t + offset) * 1000 for t in times]


def _times(points: Iterable[Point]) -> list:
    return _clock_ms([t for t, _ in points])


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def stepped(series: Mapping[tuple, list[Point]], key: tuple) -> list[Stepped]:
    """(step, value, t) of each point of the training series `series[key]`: the step of the latest
    train event (STEP_SERIES of the same node and rank) at or before the point. Points before the
    first known step are left out."""
    steps = series.get((STEP_SERIES, key[1], NO_INDEX, key[3]), [])
    out: list[Stepped] = []
    j, step = 0, None
    for t, v in series.get(key, []):
        while j < len(steps) and steps[j][0] <= t + STEP_SLACK_S:
            step = steps[j][1]
            j += 1
        if step is not None:
            out.append((step, v, t))
    return out


def _figure(title: str, y_title: str, empty_note: str = "waiting for data", x_axis: str = "time") -> go.Figure:
    fig = go.Figure()
    xaxis = dict(type="linear", title="step", rangemode="tozero") if x_axis == "step" else dict(type="date")
    # uirevision keeps a zoom across ticks; a new x axis starts unzoomed.
    fig.update_layout(title=dict(text=title, font=dict(size=14)), height=CHART_HEIGHT,
                      margin=dict(l=50, r=20, t=40, b=35), legend=dict(orientation="h", y=-0.2),
                      yaxis_title=y_title, xaxis=xaxis, template="plotly_white",
                      uirevision=f"{title}:{x_axis}")
    fig.add_annotation(text=empty_note, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                       visible=True, name="empty", font=dict(color="#888"))
    return fig


def _done(fig: go.Figure) -> go.Figure:
    if not fig.data:  # no made-up axes (plotly's default dates are in the year 2000)
        fig.update_xaxes(visible=False)
        fig.update_yaxes(visible=False)
        return fig
    fig.update_annotations(visible=False, selector=dict(name="empty"))
    if fig.layout.xaxis.type == "date":
        xs = [x for trace in fig.data for x in (trace.x or ()) if x is not None]
        lo, hi = min(xs), max(xs)
        pad = (MIN_TIME_SPAN_S * 1000 - (hi - lo)) / 2
        if pad > 0:
            fig.update_xaxes(range=[lo - pad, hi + pad])
    return fig


def with_gaps(points: list[Point], min_gap_s: float = MIN_GAP_S) -> list[Point]:
    """The points with a None between two that lie further apart than the series' sampling explains
    (5 times its median interval, at least `min_gap_s`): a line breaks there (a stop and a resume,
    a node that did not report) instead of joining the two ends with a straight line."""
    if len(points) < 3:
        return points
    steps = sorted(b[0] - a[0] for a, b in zip(points, points[1:]))
    gap = max(min_gap_s, 5 * steps[len(steps) // 2])
    out = [points[0]]
    for a, b in zip(points, points[1:]):
        if b[0] - a[0] > gap:
            out.append(((a[0] + b[0]) / 2, None))
        out.append(b)
    return out


def _mode(count: int) -> str:
    """A line of one point draws nothing: it is drawn as its marker."""
    return "lines+markers" if count == 1 else "lines"


def lines(title: str, y_title: str, series: dict[tuple, list[Point]], empty_note: str = "waiting for data",
          y_range: tuple[float, float] | None = None) -> go.Figure:
    fig = _figure(title, y_title, empty_note)
    for key, pts in series.items():
        pts = with_gaps(pts)
        fig.add_scatter(x=_times(pts), y=[v for _, v in pts], mode=_mode(len(pts)), name=label(key))
    if y_range is not None:  # a percentage: a dip from 100 to 99.5 is not drawn as a fall to the floor
        fig.update_yaxes(range=list(y_range))
    return _done(fig)


def _train_trace(fig: go.Figure, rows: list[Stepped], x_axis: str, ys: list | None = None, **trace: Any) -> None:
    """One training series against the step (the time in the hover) or against time (the step in
    the hover)."""
    custom = [[clock(t), f"{s:g}"] for s, _, t in rows]
    if x_axis == "step":
        xs = [s for s, _, _ in rows]
        hover = "step %{x}<br>%{customdata[0]}<br>%{y:.4g}"
    else:
        xs = _clock_ms([t for _, _, t in rows])
        hover = "%{customdata[0]}<br>step %{customdata[1]}<br>%{y:.4g}"
    fig.add_scatter(x=xs, y=[v for _, v, _ in rows] if ys is None else ys, customdata=custom,
                    hovertemplate=hover + f"<extra>{trace.get('name', '')}</extra>", **trace)


def _train_rows(buf: SeriesBuffer, name: str) -> list[list[Stepped]]:
    return [rows for key in buf.named(name) if (rows := stepped(buf.points, key))]


def loss_figure(buf: SeriesBuffer, smoothing: float, x_axis: str = "step") -> go.Figure:
    fig = _figure("Loss", "loss", x_axis=x_axis)
    colour = "#f97316"
    for rows in _train_rows(buf, "train/loss"):
        ys = [v for _, v, _ in rows]
        if smoothing > 0:
            _train_trace(fig, rows, x_axis, mode="lines", name="train (raw)", opacity=0.3, line=dict(color=colour),
                         showlegend=False)
            ys = ema(ys, smoothing)
        _train_trace(fig, rows, x_axis, ys, mode="lines+markers" if len(rows) < 50 else "lines", name="train",
                     line=dict(color=colour), marker=dict(size=4))
    for rows in _train_rows(buf, "train/eval_loss"):
        _train_trace(fig, rows, x_axis, mode="lines+markers", name="eval", line=dict(color="#2563eb"),
                     marker=dict(size=6))
    return _done(fig)


def learning_rate_figure(buf: SeriesBuffer, x_axis: str = "step") -> go.Figure:
    fig = _figure("Learning rate", "lr", x_axis=x_axis)
    for rows in _train_rows(buf, "train/learning_rate"):
        _train_trace(fig, rows, x_axis, mode=_mode(len(rows)), name="lr")
    # Plotly's SI suffixes read 1e6 as "1M" and 3e-4 as "300µ": an exponent says what it is.
    fig.update_yaxes(exponentformat="e")
    return _done(fig)


def throughput_figure(buf: SeriesBuffer, x_axis: str = "step") -> go.Figure:
    fig = _figure("Throughput", "tokens/s", x_axis=x_axis)
    for rows in _train_rows(buf, "train/tokens_per_s"):
        _train_trace(fig, rows, x_axis, mode=_mode(len(rows)), name="tokens/s")
    for rows in _train_rows(buf, "train/mfu"):
        if any(v is not None for _, v, _ in rows):
            _train_trace(fig, rows, x_axis, [None if v is None else v * 100 for _, v, _ in rows], mode="lines",
                         name="MFU %", yaxis="y2")
            fig.update_layout(yaxis2=dict(title="MFU %", overlaying="y", side="right", rangemode="tozero"))
    return _done(fig)


def experts_figure(buf: SeriesBuffer, x_axis: str = "step") -> go.Figure | None:
    """A MoE model's routing: each expert's share of the routed tokens per logging window (the
    series' `gpu` index is the expert), and the router's load-balancing loss; None for dense models."""
    experts = {key[2]: rows for key in buf.named("train/moe_expert_tokens") if (rows := stepped(buf.points, key))}
    if not experts:
        return None
    fig = _figure("Experts: share of routed tokens", "share %", x_axis=x_axis)
    totals: dict[int, float] = {}
    for rows in experts.values():
        for step, value, _ in rows:
            totals[step] = totals.get(step, 0.0) + (value or 0.0)
    for expert, rows in sorted(experts.items()):
        shares = [100 * (v or 0.0) / totals[s] if totals.get(s) else None for s, v, _ in rows]
        _train_trace(fig, rows, x_axis, shares, mode="lines", name=f"expert {expert}")
    for rows in _train_rows(buf, "train/moe_aux_loss"):
        _train_trace(fig, rows, x_axis, mode="lines", name="load-balancing loss", yaxis="y2",
                     line=dict(color="#111827", dash="dot"))
        fig.update_layout(yaxis2=dict(title="aux loss", overlaying="y", side="right"))
    return _done(fig)


def preference_figure(buf: SeriesBuffer, x_axis: str = "step") -> go.Figure | None:
    """Preference training: the chosen and rejected answers' rewards (beta x their log-prob ratio
    to the reference), their margin, and the share of pairs whose chosen answer wins; None otherwise."""
    if not buf.named("train/rewards_margins"):
        return None
    fig = _figure("Preference: rewards and accuracy", "reward", x_axis=x_axis)
    for name, colour in (("chosen", "#16a34a"), ("rejected", "#dc2626"), ("margins", "#111827")):
        for rows in _train_rows(buf, f"train/rewards_{name}"):
            _train_trace(fig, rows, x_axis, mode=_mode(len(rows)), name=name, line=dict(color=colour))
    for rows in _train_rows(buf, "train/rewards_accuracies"):
        _train_trace(fig, rows, x_axis, [None if v is None else 100 * v for _, v, _ in rows], mode=_mode(len(rows)),
                     name="accuracy %", yaxis="y2", line=dict(color="#2563eb", dash="dot"))
        fig.update_layout(yaxis2=dict(title="accuracy %", overlaying="y", side="right", range=[0, 100]))
    return _done(fig)


def utilisation_series(buf: SeriesBuffer) -> tuple[str, dict[tuple, list[Point]]]:
    """GPU utilisation of every node×GPU; CPU utilisation per node where no GPU reports."""
    gpu = buf.named("gpu/util_pct")
    if gpu:
        return "GPU utilisation %", gpu
    return "CPU utilisation % (no GPU)", buf.named("host/cpu_pct")


def heatmap_grid(series: dict[tuple, list[Point]], columns: int = HEATMAP_COLUMNS
                 ) -> tuple[list[float], list[str], list[list[float | None]]]:
    """Resample every series onto one time grid of `columns` buckets (mean per bucket).

    Returns bucket centre times (seconds), row labels and z[row][column] (None = no sample).
    """
    times = [t for pts in series.values() for t, _ in pts]
    if not times:
        return [], [], []
    t0, t1 = min(times), max(times)
    columns = max(1, min(columns, len({round(t) for t in times})))
    width = (t1 - t0) / columns or 1.0
    centres = [t0 + (i + 0.5) * width for i in range(columns)]
    labels, z = [], []
    for key, pts in series.items():
        sums, counts = [0.0] * columns, [0] * columns
        for t, v in pts:
            if v is None:
                continue
            i = min(columns - 1, int((t - t0) / width))
            sums[i] += v
            counts[i] += 1
        labels.append(label(key))
        z.append([s / c if c else None for s, c in zip(sums, counts)])
    return centres, labels, z


def utilisation_heatmap(buf: SeriesBuffer) -> go.Figure | None:
    """Every device's utilisation over time, one row each; None for fewer than two devices (a
    single CPU node or GPU), whose one row says nothing the utilisation lines do not."""
    title, series = utilisation_series(buf)
    if len(series) < 2:
        return None
    centres, labels, z = heatmap_grid(series)
    fig = _figure(f"{title}: every device over time", "")
    fig.add_heatmap(x=_times((t, None) for t in centres), y=labels, z=z, zmin=0, zmax=100,
                    colorscale="YlOrRd", colorbar=dict(title="%", thickness=10))
    fig.update_layout(height=max(CHART_HEIGHT, 22 * len(labels) + 90))
    return _done(fig)


def training_figures(buf: SeriesBuffer, smoothing: float, x_axis: str = "step") -> dict[str, go.Figure]:
    """The Monitor's charts of the training series, by name."""
    return {"loss": loss_figure(buf, smoothing, x_axis), "lr": learning_rate_figure(buf, x_axis),
            "throughput": throughput_figure(buf, x_axis)}


def rank_memory_figure(buf: SeriesBuffer, estimate: dict | None) -> go.Figure | None:
    """Each rank's peak memory so far (the allocator's peak: torch's max_memory_allocated) against the
    memory estimate the run was planned with (`estimate`: MemoryEstimate.to_dict), less its CUDA
    context, which the allocator does not count. On CPUs the peak is the process's resident set,
    which the per-GPU estimate does not model: no estimate is drawn. None before any rank's peak."""
    peaks = {key[3]: pts[-1][1] for key, pts in buf.named("rank/mem_peak_gib").items()}
    if not peaks:
        return None
    on_gpu = bool(buf.named("gpu/mem_used_gib"))
    fig = _figure("Peak memory per rank: measured vs estimated (GiB)" if on_gpu else
                  "Peak memory per rank (process resident set, GiB; no GPU)", "GiB", x_axis="step")
    fig.update_layout(xaxis=dict(type="category", title=None))
    ranks = sorted(peaks)
    expected = (estimate["total_gib"] - estimate.get("other_gib", 0.0)) if on_gpu and estimate and \
        estimate.get("total_gib") else None
    off = [f"{(peaks[r] - expected) / expected:+.0%} of the estimate" if expected else "" for r in ranks]
    fig.add_bar(x=[f"rank {r}" for r in ranks], y=[peaks[r] for r in ranks], customdata=off, name="measured peak",
                hovertemplate="%{x}: %{y:.2f} GiB<br>%{customdata}<extra></extra>")
    if expected:
        fig.add_hline(y=expected, line_dash="dash", line_color="#d62728",
                      annotation_text=f"estimate {expected:.1f} GiB (a prediction; {estimate['total_gib']:.1f} "
                                      "with the CUDA context)", annotation_position="top left")
    return _done(fig)


def figures(buf: SeriesBuffer, smoothing: float, x_axis: str = "step",
            estimate: dict | None = None) -> dict[str, go.Figure | None]:
    """Every Monitor chart, by name (None: a chart with nothing to show, hidden). `estimate`: the
    memory estimate the run's current attempt was planned with."""
    util_title, util = utilisation_series(buf)
    mem = buf.named("gpu/mem_used_gib")
    mem_title = "GPU memory used (GiB)"
    if not mem:
        mem, mem_title = buf.named("host/ram_used_gib"), "Host memory used (GiB, no GPU)"
    return {
        **training_figures(buf, smoothing, x_axis),
        "experts": experts_figure(buf, x_axis),
        "preference": preference_figure(buf, x_axis),
        "util_heatmap": utilisation_heatmap(buf),
        "util_lines": lines(util_title, "%", util, y_range=(0, 100)),
        "memory": lines(mem_title, "GiB", mem),
        "rank_memory": rank_memory_figure(buf, estimate),
        # A run on CPUs only has no power to show: the panel is hidden, not left empty.
        "power": (None if buf.named("host/cpu_pct") and not buf.named("gpu/util_pct")
                  else lines("GPU power (W)", "W", buf.named("gpu/power_w"))),
        "collective": lines("Collective wait per rank (s per step)", "s", buf.named("rank/collective_wait_s")),
        "stages": stages_figure(buf),
    }


def stages_figure(buf) -> go.Figure | None:
    """A pipeline's stages (each rank's forward and backward compute per step, waits left out): the
    slowest stage sets the pipeline's pace. None for a job without pipeline stages."""
    stages = buf.named("rank/stage_compute_s")
    if not stages:
        return None
    return lines("Pipeline stage compute per rank (s per step)", "s", stages)


def run_curve(series: Mapping[tuple, list[Point]], name: str = "train/loss") -> list[Stepped]:
    """One run's training series `name` as (step, value, t) in time order, from a series read that
    includes STEP_SERIES."""
    return sorted((row for key in series if key[0] == name for row in stepped(series, key)), key=lambda r: r[2])


def overlay_figure(curves: dict[str, list[Stepped]], x_axis: str = "step") -> go.Figure:
    """Loss of several runs against the step, or against the minutes since each run's first
    logged step (the other in the hover)."""
    fig = _figure("Loss of the selected runs", "loss", empty_note="pick runs to compare", x_axis=x_axis)
    if x_axis == "time":  # runs started at different times: compare them by elapsed time
        fig.update_layout(xaxis=dict(type="linear", title="minutes since the first logged step", rangemode="tozero"))
    for run_id, rows in curves.items():
        if not rows:
            continue
        t0 = rows[0][2]
        elapsed = [(t - t0) / 60 for _, _, t in rows]
        custom = [[format_duration(m * 60), f"{s:g}"] for (s, _, _), m in zip(rows, elapsed)]
        if x_axis == "time":
            xs, hover = elapsed, "+%{customdata[0]}<br>step %{customdata[1]}<br>%{y:.4g}"
        else:
            xs, hover = [s for s, _, _ in rows], "step %{x}<br>+%{customdata[0]}<br>%{y:.4g}"
        fig.add_scatter(x=xs, y=[v for _, v, _ in rows], customdata=custom, mode="lines", name=run_id,
                        hovertemplate=hover + f"<extra>{run_id}</extra>")
    return _done(fig)


def progress_html(step: int | None, max_steps: int | None, eta_s: float | None, state: str,
                  data: dict | None = None) -> str:
    """A progress bar with step counts and ETA; plain HTML so it needs no script. Before the first
    step, what the latest `data` event says (a large dataset is tokenized for minutes)."""
    if not max_steps or max_steps <= 0 or step is None:
        return f"<div class='status-line'>{state}: {data_line(data) + '; ' if data else ''}waiting for the first step…</div>"
    share = max(0.0, min(1.0, step / max_steps))
    eta = f" · ETA {format_duration(eta_s)}" if eta_s and state == "running" else ""
    return (f"<div class='progress-outer' role='progressbar' aria-valuenow='{step}' aria-valuemax='{max_steps}'>"
            f"<div class='progress-inner' style='width:{share * 100:.1f}%'></div></div>"
            f"<div class='status-line' id='progress-text'>step {step} / {max_steps} ({share:.0%}){eta}"
            f"{skipped_html(data)}</div>")


def skipped_html(event: dict | None) -> str:
    """The records a run skipped (strict off), the first ones' reasons on hover; '' for none."""
    count = (event or {}).get("skipped") or 0
    if not isinstance(count, int) or count <= 0:
        return ""
    first = [str(m) for m in event.get("skipped_first") or []]
    return (f" · <span class='skipped-records' title='{html.escape(chr(10).join(first), quote=True)}'>"
            f"{count:,} record{'s' * (count != 1)} skipped (strict off)</span>")


def data_line(event: dict) -> str:
    """A worker's `data` event in words."""
    if event.get("phase") == "preparing":
        return f"tokenizing the dataset or waiting for its cache ({format_duration(event.get('elapsed_s') or 0)} so far)"
    if event.get("streaming"):
        return "data streamed: read and tokenized as the steps ask"
    how = "tokenized" if event.get("tokenized") else "read from the tokenized cache"
    return f"data {how} in {float(event.get('seconds') or 0):.1f} s{skipped_html(event)}"


def _digest(value: Any) -> str:
    """What an output shows, comparable between ticks: a figure by its JSON, an update by its fields."""
    if isinstance(value, dict):
        return repr(sorted((k, _digest(v)) for k, v in value.items()))
    to_json = getattr(value, "to_json", None)
    return hashlib.sha1((to_json() if callable(to_json) else repr(value)).encode()).hexdigest()
