"""Monitor tab: one run live. A gr.Timer reads only the points added since the last tick (the
backend's series cursor) into this browser session's SeriesBuffer and redraws the charts; a
reload starts with an empty buffer, so the first tick reads the whole history."""
from __future__ import annotations

import time
from typing import Any

import gradio as gr

from backend.telemetry import logclass
from studio.charts import (MAX_POINTS, MONITOR_SERIES, X_AXES, SeriesBuffer, figures, loss_figure, progress_html,
                           training_figures)
from studio.context import Studio
from studio.errors import user_message
from studio.run_view import (RESTARTABLE, RESUME_LABEL, alerts_md, overtaken_by_status, restart_button,
                             restart_message, run_picker, status_md, usage_line)

TICK_S = 2.0
# With no run, or a run that ended (it changes only when someone resumes it), the tab reads this often.
# Each tick costs the browser Gradio's per-event work whatever it redraws (bench/monitor_idle.py: an
# idle Monitor took 24% of a core at 2 s, 11-12% at 10 s).
IDLE_TICK_S = 10.0
# A run's last events (its final checkpoint, each rank's end) can land a few ticks after its state:
# the fast tick goes on this long after the run ended.
SETTLE_S = 20.0
LOG_TICK_S = 4.0
LOG_LINES = 60
FULL_LOG_LINES = 100_000
CHARTS = ("loss", "lr", "throughput", "preference", "experts", "stages", "util_heatmap", "util_lines", "memory", "power",
          "collective", "rank_memory")
TRAINING_CHARTS = ("loss", "lr", "throughput")
# States after which an action line ("Resuming …") has been overtaken by the status line above it.
SETTLED = ("running", "succeeded", "failed")
# Opening the log shows its newest lines (Gradio's autoscroll follows later updates only); after
# the frame that draws the new text, so that its height is known.
SCROLL_LOG_JS = """() => requestAnimationFrame(() => {
  const box = document.querySelector('#monitor-log textarea');
  if (box) box.scrollTop = box.scrollHeight;
})"""


STOP_OUTCOME_WAIT_S = 5.0


def until_found(what, timeout_s: float, every_s: float = 0.25):
    """`what()` once it is not None, polled until `timeout_s`; None after that."""
    end = time.monotonic() + timeout_s
    while True:
        found = what()
        if found is not None or time.monotonic() >= end:
            return found
        time.sleep(every_s)

def build() -> dict[str, Any]:
    c: dict[str, Any] = {}
    with gr.Row(equal_height=True):
        c["run"] = gr.Dropdown(label="Run", choices=[], scale=4, elem_id="monitor-run")
        c["refresh"] = gr.Button("↻ Runs", size="sm", scale=0, min_width=80)
        c["stop"] = gr.Button("■ Stop", size="sm", variant="stop", scale=1, elem_id="monitor-stop", interactive=False)
        c["resume"] = gr.Button(RESUME_LABEL, size="sm", scale=1, elem_id="monitor-resume", interactive=False)
        c["export"] = gr.Button("⇩ Export…", size="sm", scale=1, elem_id="monitor-export")
        c["full_log"] = gr.Button("Full log", size="sm", scale=1, elem_id="monitor-full-log")
    c["status"] = gr.Markdown(elem_id="monitor-status")
    c["log_full"] = gr.Textbox(label="Full log", lines=20, max_lines=60, interactive=False, visible=False,
                               elem_id="monitor-log-full")
    c["progress"] = gr.HTML(elem_id="monitor-progress")
    c["action"] = gr.Markdown(elem_id="monitor-action")
    with gr.Row():
        with gr.Column():
            c["loss"] = gr.Plot(elem_id="chart-loss", show_label=False)
            with gr.Row():
                c["smoothing"] = gr.Slider(0, 0.99, value=0.6, step=0.01, label="Loss smoothing (EMA weight)",
                                           elem_id="monitor-smoothing", scale=2)
                c["x_axis"] = gr.Radio(list(X_AXES), value=X_AXES[0], label="Training charts against",
                                       elem_id="monitor-x-axis", scale=1)
        c["lr"] = gr.Plot(elem_id="chart-lr", show_label=False)
    with gr.Row():
        c["throughput"] = gr.Plot(elem_id="chart-throughput", show_label=False)
        c["collective"] = gr.Plot(elem_id="chart-collective", show_label=False)
    c["preference"] = gr.Plot(elem_id="chart-preference", show_label=False, visible=False)
    c["experts"] = gr.Plot(elem_id="chart-experts", show_label=False, visible=False)
    c["stages"] = gr.Plot(elem_id="chart-stages", show_label=False, visible=False)
    c["util_heatmap"] = gr.Plot(elem_id="chart-util-heatmap", show_label=False)
    with gr.Row():
        c["util_lines"] = gr.Plot(elem_id="chart-util-lines", show_label=False)
        c["memory"] = gr.Plot(elem_id="chart-memory", show_label=False)
        c["power"] = gr.Plot(elem_id="chart-power", show_label=False)
    c["rank_memory"] = gr.Plot(elem_id="chart-rank-memory", show_label=False, visible=False)
    with gr.Accordion("Alerts", open=True):
        c["alerts"] = gr.Markdown("No alerts.", elem_id="monitor-alerts")
    with gr.Accordion("Logs", open=False) as c["logs"]:
        c["log_node"] = gr.Dropdown(label="Node", choices=[], elem_id="monitor-log-node")
        c["log"] = gr.Textbox(label="Log tail (live)", lines=12, max_lines=30, interactive=False, elem_id="monitor-log",
                              autoscroll=True)
    c["buffer"] = gr.State(SeriesBuffer())
    c["timer"] = gr.Timer(TICK_S, active=False)
    c["log_timer"] = gr.Timer(LOG_TICK_S, active=False)
    return c


def tick_interval(ended: bool, ended_at: float | None, now: float) -> float:
    """Seconds between the Monitor's reads of a run: fast until SETTLE_S after it ended."""
    return IDLE_TICK_S if ended and (ended_at is None or now - ended_at >= SETTLE_S) else TICK_S


def wire(c: dict[str, Any], studio: Studio, tabs: gr.Tabs, page: gr.Tab, export_run: gr.Dropdown) -> None:
    charts = [c[name] for name in CHARTS]

    def choices(selected: str | None = None) -> dict:
        from backend.runs.lifecycle import ACTIVE
        options, value = run_picker(studio.manager.runs(), selected, prefer=ACTIVE)
        return gr.update(choices=options, value=value)

    def on_refresh(current: str | None):
        try:
            return choices(current)
        except Exception as exc:  # noqa: BLE001 - shown on the page, logged on the server
            return gr.update(label=user_message("Listing runs", exc))

    def tick(run_id: str | None, buf: SeriesBuffer, smoothing: float, x_axis: str, action: str | None) -> dict:
        from backend.runs.lifecycle import ACTIVE, FINAL, attempt_history
        out: dict = {}
        if not run_id:
            out[c["status"]] = "No run yet: launch one from the Train tab."
            out.update({c[name]: value for name, value in buf.changes({"timer": IDLE_TICK_S}).items()})
            out[c["buffer"]] = buf
            return out
        shown: dict[str, Any] = {}  # what the page shows of the run: sent only where it changed
        try:
            manager = studio.manager
            run = manager.run(run_id)
            if buf.run_id != run_id:
                buf = SeriesBuffer(run_id=run_id)
                out[c["action"]] = ""  # it was about the run shown before
            result = manager.series(run_id, MONITOR_SERIES, since=buf.cursor, max_points=MAX_POINTS)
            changed = buf.apply(result.series, result.cursor, result.reset or buf.cursor is None)
            progress = manager.progress(run_id)
            shown["status"] = status_md(run, progress, manager.notices(run_id), manager.layout(run_id),
                                        usage_line(manager.usage(run_id), studio.gpu_hour_price()),
                                        attempt_history(manager.attempts(run_id)))
            if run.state != buf.state:  # the picker's labels and the buttons follow the state
                # Labels only: a tick that lands after the user picked another run must not put
                # this one back in the picker (it did, under load).
                out[c["run"]] = gr.update(choices=run_picker(manager.runs(), run_id, ACTIVE)[0])
                out[c["stop"]] = gr.update(interactive=run.state in ACTIVE)
                buf.state = run.state
            shown["timer"] = tick_interval(run.state in FINAL, run.ended_at, time.time())
            # On every tick, not only when the state changes: a tick may have read the page before the
            # line was written, and must not clear a line it did not see.
            if run.state in SETTLED and overtaken_by_status(action):
                out[c["action"]] = ""
            # Read on every tick of a stopped or failed run: its last checkpoint's event may land after the state.
            restart = restart_button(run.state, manager.checkpoints(run_id) if run.state in RESTARTABLE else [])
            if restart != buf.restart:
                out[c["resume"]] = gr.update(value=restart[0], interactive=restart[1])
                buf.restart = restart
            p = progress or {}
            shown["progress"] = progress_html(p.get("step"), p.get("max_steps"), p.get("eta_s"), run.state, p.get("data"))
            if changed:
                # an attempt's plan is made once: read until it has one, then again for the next attempt
                if buf.estimate is None or buf.estimate[0] != run.attempts or buf.estimate[1] is None:
                    buf.estimate = (run.attempts, manager.memory_estimate(run_id))
                figs = figures(buf, smoothing, x_axis, buf.estimate[1])
                hidden_when_empty = ("preference", "experts", "stages", "util_heatmap", "power", "rank_memory")
                shown.update({name: figs[name] for name in CHARTS if name not in hidden_when_empty})
                for name in hidden_when_empty:
                    shown[name] = gr.update(value=figs[name], visible=figs[name] is not None)
            shown["alerts"] = alerts_md(manager.alerts(run_id))
            out.update({c[name]: value for name, value in buf.changes(shown).items()})
        except Exception as exc:  # noqa: BLE001 - the page shows one line, the server log has the rest
            out[c["action"]] = user_message("Reading the run", exc)
        out[c["buffer"]] = buf
        return out

    tick_io = dict(fn=tick, inputs=[c["run"], c["buffer"], c["smoothing"], c["x_axis"], c["action"]],
                   outputs=[c["run"], c["status"], c["progress"], *charts, c["alerts"], c["stop"], c["resume"],
                            c["action"], c["timer"], c["buffer"]], show_progress="hidden",
                   # The events that read the run (timer, pick, tab opened, resume) read one at a time,
                   # in the order asked: Gradio runs different events at once, and a read of the run
                   # shown before the user's pick that ended after the pick's own drew that run under
                   # the new pick (a suite run). A read takes milliseconds; a long run's first, a second.
                   concurrency_id="monitor-tick", concurrency_limit=1)
    c["timer"].tick(trigger_mode="always_last", **tick_io)
    # Only the user's pick: handlers set the picker too (every page load, the launch), and reading
    # the run then would draw charts for a tab that may be hidden; opening the Monitor catches up.
    c["run"].input(**tick_io)
    # Only a browser showing the Monitor polls the run; opening the tab catches up at once rather
    # than a tick later. A tab's select event also fires when a handler switches tabs (the launch).
    page.select(lambda: gr.Timer(active=True), None, [c["timer"]]).then(**tick_io)
    # Any other tab stops the polling; read from `tabs` so that a tab added later is covered too.
    other_pages = [p for p in tabs.children if isinstance(p, gr.Tab) and p is not page]
    gr.on([p.select for p in other_pages], lambda: gr.Timer(active=False), None, [c["timer"]])
    c["refresh"].click(on_refresh, [c["run"]], [c["run"]])
    c["smoothing"].change(lambda buf, s, x: loss_figure(buf, s, x), [c["buffer"], c["smoothing"], c["x_axis"]],
                          [c["loss"]], show_progress="hidden", trigger_mode="always_last")
    c["x_axis"].change(lambda buf, s, x: tuple(training_figures(buf, s, x).values()),
                       [c["buffer"], c["smoothing"], c["x_axis"]], [c[name] for name in TRAINING_CHARTS],
                       show_progress="hidden", trigger_mode="always_last")

    def show_if_active(run_id: str | None):
        """A page load picks the latest active run: a reload of a page watching a run shows it
        again (the launch shows the Monitor itself, a user's pick happens on it)."""
        from backend.runs.lifecycle import ACTIVE
        try:
            active = bool(run_id) and studio.manager.run(run_id).state in ACTIVE
        except Exception:  # noqa: BLE001 - the tick that follows shows why the run cannot be read
            return gr.skip()
        return gr.update(selected="monitor") if active else gr.skip()

    c["run"].change(show_if_active, [c["run"]], [tabs], show_progress="hidden")

    def log_tick(run_id: str | None, log_node: str | None) -> tuple:
        if not run_id:
            return gr.skip(), gr.skip()
        try:
            manager = studio.manager
            nodes = manager.nodes_of(run_id)
            node = log_node if log_node in nodes else (nodes[0] if nodes else None)
            text = "\n".join(logclass.shown_tail(manager.log_tail(run_id, node, lines=LOG_LINES))) if node else ""
        except Exception as exc:  # noqa: BLE001
            return gr.skip(), user_message("Reading the log", exc)
        return gr.update(choices=nodes, value=node), text

    # Logs come over each node's shell: a slower timer, and only while the Logs section is open.
    log_io = dict(fn=log_tick, inputs=[c["run"], c["log_node"]], outputs=[c["log_node"], c["log"]],
                  show_progress="hidden")
    c["log_timer"].tick(trigger_mode="always_last", **log_io)
    c["logs"].expand(lambda: gr.Timer(active=True), None, [c["log_timer"]]).then(**log_io).then(None, js=SCROLL_LOG_JS)
    c["logs"].collapse(lambda: gr.Timer(active=False), None, [c["log_timer"]])
    c["log_node"].input(**log_io).then(None, js=SCROLL_LOG_JS)

    def on_stop(run_id: str | None) -> str:
        if not run_id:
            return "Pick a run first."
        try:
            since = time.time()
            run = studio.manager.stop(run_id)
            # The workers' own word on the checkpoint reaches the database a moment after they exit.
            outcome = until_found(lambda: studio.manager.stop_outcome(run_id, since), STOP_OUTCOME_WAIT_S)
        except Exception as exc:  # noqa: BLE001
            return user_message("Stop", exc)
        return f"Run `{run_id}` is {run.state}: " + (outcome or "its workers exited (their report on the checkpoint "
                                                                "has not arrived yet; Resume names the latest one)")

    def on_resume(run_id: str | None) -> str:
        if not run_id:
            return "Pick a run first."
        try:
            manager = studio.manager
            checkpoints = manager.checkpoints(run_id)
            manager.resume(run_id)
        except Exception as exc:  # noqa: BLE001
            return user_message("Resume", exc)
        return restart_message(run_id, checkpoints)

    def on_full_log(run_id: str | None, node: str | None) -> dict:
        """The whole torchrun log of a node: the one picked under Logs, else the failed one, else the first."""
        if not run_id:
            return gr.update(visible=True, value="Pick a run first.")
        try:
            manager = studio.manager
            run = manager.run(run_id)
            nodes = manager.nodes_of(run_id)
            node = node if node in nodes else (run.failed_node if run.failed_node in nodes else (nodes or [None])[0])
            if node is None:
                return gr.update(visible=True, value="This run has not started on any node yet.")
            text = "\n".join(manager.log_tail(run_id, node, lines=FULL_LOG_LINES))
        except Exception as exc:  # noqa: BLE001
            return gr.update(visible=True, value=user_message("Reading the log", exc))
        return gr.update(visible=True, value=text, label=f"Full log of {node}")

    c["stop"].click(on_stop, [c["run"]], [c["action"]])
    # A resumed run is active again: read it now, which also brings back the fast tick.
    c["resume"].click(on_resume, [c["run"]], [c["action"]]).then(**tick_io)
    c["full_log"].click(on_full_log, [c["run"], c["log_node"]], [c["log_full"]])
    c["export"].click(lambda run_id: (gr.update(selected="export"), choices(run_id)), [c["run"]], [tabs, export_run])
    c["choices"] = choices
