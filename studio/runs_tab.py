"""Runs tab: every run with status, duration, final loss and throughput; the loss curves of
several runs on one chart; the config difference of two runs."""
from __future__ import annotations

from typing import Any

import gradio as gr

from studio.charts import STEP_SERIES, X_AXES, overlay_figure, run_curve
from studio.context import Studio
from studio.errors import user_message
from studio.run_view import RUN_COLUMNS, config_diff, run_choice, run_rows

OVERLAY_POINTS = 500



def build() -> dict[str, Any]:
    c: dict[str, Any] = {}
    with gr.Row():
        c["refresh"] = gr.Button("↻ Refresh", size="sm", scale=0, min_width=100, elem_id="runs-refresh")
        c["message"] = gr.Markdown(elem_id="runs-message")
    c["table"] = gr.Dataframe(headers=RUN_COLUMNS, interactive=False, wrap=True, elem_id="runs-table", label="Runs")
    with gr.Row():
        c["overlay_runs"] = gr.Dropdown(label="Overlay the loss of", choices=[], multiselect=True, elem_id="runs-overlay",
                                        scale=4)
        c["overlay_x"] = gr.Radio(list(X_AXES), value=X_AXES[0], label="against", elem_id="runs-overlay-x", scale=1)
    c["overlay"] = gr.Plot(elem_id="chart-overlay", show_label=False)
    with gr.Row():
        c["diff_a"] = gr.Dropdown(label="Compare run A", choices=[], elem_id="runs-diff-a")
        c["diff_b"] = gr.Dropdown(label="with run B", choices=[], elem_id="runs-diff-b")
    c["diff"] = gr.Dataframe(headers=["field", "A", "B"], interactive=False, wrap=True, elem_id="runs-diff",
                             label="Config difference")
    return c


def wire(c: dict[str, Any], studio: Studio, tab: gr.Tab) -> None:
    def on_refresh() -> tuple:
        try:
            manager = studio.manager
            runs = manager.runs()
            summaries = {r.id: manager.progress(r.id) or {} for r in runs}
            usages = {r.id: manager.usage(r.id) for r in runs}
        except Exception as exc:  # noqa: BLE001
            return gr.skip(), gr.skip(), gr.skip(), gr.skip(), user_message("Listing runs", exc)
        options = [run_choice(r) for r in runs]
        return (run_rows(runs, summaries, usages, studio.gpu_hour_price()), gr.update(choices=options), gr.update(choices=options),
                gr.update(choices=options), f"{len(runs)} run(s).")

    def on_overlay(run_ids: list[str] | None, x_axis: str):
        try:
            curves = {run_id: run_curve(studio.manager.series(run_id, ["train/loss", STEP_SERIES],
                                                              max_points=OVERLAY_POINTS).series)
                      for run_id in run_ids or []}
            return overlay_figure(curves, x_axis)
        except Exception as exc:  # noqa: BLE001
            gr.Warning(user_message("Overlay", exc))
            return gr.skip()

    def on_diff(a: str | None, b: str | None):
        if not a or not b:
            return []
        try:
            return config_diff(studio.manager.run(a).spec_yaml, studio.manager.run(b).spec_yaml) or [
                ["(no difference)", "", ""]]
        except Exception as exc:  # noqa: BLE001
            return [["error", user_message("Comparing", exc), ""]]

    outputs = [c["table"], c["overlay_runs"], c["diff_a"], c["diff_b"], c["message"]]
    c["refresh"].click(on_refresh, None, outputs)
    tab.select(on_refresh, None, outputs)
    gr.on([c["overlay_runs"].change, c["overlay_x"].change], on_overlay, [c["overlay_runs"], c["overlay_x"]],
          [c["overlay"]])
    gr.on([c["diff_a"].change, c["diff_b"].change], on_diff, [c["diff_a"], c["diff_b"]], [c["diff"]])
