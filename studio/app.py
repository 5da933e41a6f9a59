"""Builds the studio page and serves it."""
from __future__ import annotations

import os
import sys
from typing import Callable

# Set before Gradio is imported: no analytics or version checks leave the machine.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Gradio imports IPython only for its notebook magic and does without it; not loading it saves
# about half a second of the cold start (inside a notebook IPython is already loaded and kept).
sys.modules.setdefault("IPython", None)

import gradio as gr  # noqa: E402

from studio import cluster_tab, export_tab, monitor_tab, runs_tab, train_tab  # noqa: E402
from studio.context import Studio  # noqa: E402
from studio.theme import CSS, THEME  # noqa: E402


def build_app(studio: Studio) -> gr.Blocks:
    with gr.Blocks(title="swift-studio", analytics_enabled=False) as app:
        # The cluster last used, so that a page load that shows it again changes no state (and
        # so does not check the Train form a second time).
        cluster_state = gr.State(studio.load_cluster())
        gr.Markdown("## swift-studio", elem_id="title")
        with gr.Tabs(elem_id="tabs", selected="train") as tabs:
            with gr.Tab("Cluster", id="cluster"):
                cluster = cluster_tab.build()
            with gr.Tab("Train", id="train"):
                train = train_tab.build(studio)
            with gr.Tab("Monitor", id="monitor") as monitor_page:
                monitor = monitor_tab.build()
            with gr.Tab("Runs", id="runs") as runs_page:
                runs = runs_tab.build()
            with gr.Tab("Export", id="export") as export_page:
                export = export_tab.build()
        cluster_tab.wire(cluster, studio, cluster_state)
        cluster_tab.wire_preflight(cluster, studio, cluster_state, train["form"])
        train_tab.wire(train, studio, cluster_state)
        monitor_tab.wire(monitor, studio, tabs, monitor_page, export["run"])
        train_tab.wire_launch(train, studio, cluster_state, tabs, monitor["run"], monitor["choices"])
        runs_tab.wire(runs, studio, runs_page)
        export_tab.wire(export, studio, export_page)

        # A page load (first visit or reload) lists the presets, fills the form with the demo
        # preset, then shows the cluster (a cluster changed since the build checks the filled form
        # again), and re-attaches the Monitor to the latest active run; its first tick reads the
        # whole history, so the charts are complete.
        app.load(**train["page_load"]).then(cluster["on_load"], None, cluster["outputs"])
        app.load(lambda: monitor["choices"](None), None, [monitor["run"]])
    return app


def serve(studio: Studio, *, host: str, port: int, auth: list[tuple[str, str]] | None,
          after_start: Callable[[], None] | None) -> None:
    """Build the page, listen, call `after_start()` (the page already answers), serve until
    interrupted."""
    app = build_app(studio)
    app.queue(default_concurrency_limit=4)
    app.launch(server_name=host, server_port=port, auth=auth, share=False, theme=THEME, css=CSS,
               footer_links=[], ssr_mode=False, pwa=False, mcp_server=False, show_error=False,
               prevent_thread_lock=True, quiet=True, enable_monitoring=False)
    if after_start is not None:
        after_start()
    try:
        app.block_thread()
    finally:
        app.close()
