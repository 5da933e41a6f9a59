"""Builds the studio page and serves it."""
from __future__ import annotations

import os
import sys

# Set before Gradio is imported: no analytics or version checks leave the machine.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Gradio imports IPython only for its notebook magic and does without it; not loading it saves
# about half a second of the cold start (inside a notebook IPython is already loaded and kept).
sys.modules.setdefault("IPython", None)

import gradio as gr  # noqa: E402

from backend.cluster import local_cluster  # noqa: E402
from studio import cluster_tab, train_tab  # noqa: E402
from studio.context import Studio  # noqa: E402
from studio.theme import CSS, THEME  # noqa: E402


def build_app(studio: Studio) -> gr.Blocks:
    with gr.Blocks(title="swift-studio", analytics_enabled=False) as app:
        cluster_state = gr.State(local_cluster())
        with gr.Row():
            gr.Markdown("## swift-studio", elem_id="title")
        with gr.Tabs(elem_id="tabs") as tabs:
            with gr.Tab("Cluster", id="cluster"):
                cluster = cluster_tab.build()
            with gr.Tab("Train", id="train"):
                train = train_tab.build(studio)
        cluster_tab.wire(cluster, cluster_state)
        train_tab.wire(train, studio, cluster_state)
        app.load(cluster["show"], [cluster_state],
                 [cluster_state, cluster["summary"], cluster["nodes"], cluster["hostfile"],
                  cluster["remove_host"], cluster["message"]])
        del tabs
    return app


def serve(studio: Studio, host: str = "127.0.0.1", port: int = 7860,
          auth: list[tuple[str, str]] | None = None, block: bool = True) -> gr.Blocks:
    app = build_app(studio)
    app.queue(default_concurrency_limit=4)
    app.launch(server_name=host, server_port=port, auth=auth, share=False, theme=THEME, css=CSS,
               footer_links=[], ssr_mode=False, pwa=False, mcp_server=False, show_error=False,
               prevent_thread_lock=not block, quiet=True, enable_monitoring=False)
    return app
