"""Builds the studio page and serves it."""
from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from typing import Callable

# Set before Gradio is imported: no analytics or version checks leave the machine.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Gradio imports IPython only for its notebook magic and does without it; not loading it saves
# about half a second of the cold start (inside a notebook IPython is already loaded and kept).
sys.modules.setdefault("IPython", None)

import gradio as gr  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402

from studio import chat_tab, cluster_tab, export_tab, monitor_tab, runs_tab, train_tab  # noqa: E402
from studio.access import HostPolicy, LoginLimiter  # noqa: E402
from studio.context import Studio  # noqa: E402
from studio.theme import CSS, THEME  # noqa: E402

# The largest file the page takes (Gradio refuses a larger upload before it is stored): a chat video
# (backend.job.chat.MAX_VIDEO_CHARS of base64; an image takes less), a job YAML, a hostfile.
MAX_UPLOAD = "24mb"


def build_app(studio: Studio) -> gr.Blocks:
    with gr.Blocks(title="swift-studio", analytics_enabled=False) as app:
        # The cluster last used where the run manager is up already, so that a page load that shows
        # it again changes no state (and does not check the Train form a second time); the page is
        # built before the manager otherwise, and its load shows the inventory.
        cluster_state = gr.State(studio.load_cluster(wait=False)[0])
        # The Slurm partition the Cluster tab targets (its settings), None for the SSH nodes.
        slurm_state = gr.State(studio.slurm_settings())
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
            with gr.Tab("Chat", id="chat") as chat_page:
                chat = chat_tab.build(studio)
        cluster_tab.wire(cluster, studio, cluster_state, slurm_state)
        cluster_tab.wire_preflight(cluster, studio, cluster_state, slurm_state, train["form"])
        train_tab.wire(train, studio, cluster_state, slurm_state)
        monitor_tab.wire(monitor, studio, tabs, monitor_page, export["run"])
        train_tab.wire_launch(train, studio, cluster_state, slurm_state, tabs, monitor["run"], monitor["choices"])
        runs_tab.wire(runs, studio, runs_page)
        export_tab.wire(export, studio, export_page)
        chat_tab.wire(chat, studio, chat_page)

        # A page load (first visit or reload) lists the presets, fills the form with the demo
        # preset, then shows the cluster and the Slurm target, each changed one checking the filled
        # form again (a check sent before the fill had landed, of the empty form, once ended after
        # it: the preview stayed at "fix the problems"), and re-attaches the Monitor to the latest
        # active run; its first tick reads the whole history, so the charts are complete.
        app.load(**train["page_load"]).then(cluster["on_load"], None, cluster["outputs"]).then(**cluster["load_slurm"])
        app.load(cluster["load_price"], None, [cluster["price"]])
        app.load(lambda: monitor["choices"](None), None, [monitor["run"]])
    # Every handler belongs to the page: none is listed in the API info or offered to Gradio's
    # clients. Set here, once, so a listener added later cannot be public by default; the web
    # guard refuses the routes that run a handler by name anyway.
    for fn in app.fns.values():
        fn.api_visibility = "private"
    return app


class WebGuard:
    """The outermost layer of the web server. It refuses, before Gradio sees them: a Host that is
    not one of the studio's names (DNS rebinding), an Origin of another site (cross-site requests),
    the routes that run a handler by name, and login attempts past the rate limit."""

    def __init__(self, app, policy: HostPolicy, limiter: LoginLimiter | None):
        self.app, self.policy, self.limiter = app, policy, limiter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        values: dict[bytes, list[str]] = {}
        for key, value in scope["headers"]:
            values.setdefault(key.lower(), []).append(value.decode("latin-1"))
        why = self.policy.request_refusal(values.get(b"host", []), values.get(b"origin", []), scope["path"])
        if why:
            await _refuse(scope, send, 403, why)
            return
        if self.limiter is not None and scope["type"] == "http" and scope["method"] == "POST" \
                and scope["path"].rstrip("/") == "/login":
            await self._login(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _login(self, scope, receive, send) -> None:
        client = (scope.get("client") or ("unknown",))[0]
        wait = self.limiter.admit(client, time.monotonic())
        if wait:
            seconds = math.ceil(wait)
            await _refuse(scope, send, 429, f"swift-studio: too many failed logins from {client}; try again in "
                                            f"{seconds} s.", [(b"retry-after", str(seconds).encode())])
            return

        async def watch(message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 200:
                self.limiter.succeeded(client)
            await send(message)

        await self.app(scope, receive, watch)


async def _refuse(scope, send, status: int, text: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    if scope["type"] == "websocket":
        # Closing before the handshake is accepted makes the server answer HTTP 403.
        await send({"type": "websocket.close", "code": 1008, "reason": text[:120]})
        return
    body = (text + "\n").encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()),
                            (b"cache-control", b"no-store"), *headers]})
    await send({"type": "http.response.body", "body": body})


def serve(studio: Studio, sock: socket.socket, *, host: str, port: int, policy: HostPolicy,
          auth: list[tuple[str, str]] | None, before_serve: Callable[[], None],
          after_start: Callable[[], None] | None) -> None:
    """Build the page, call `before_serve()` (whatever answered on `sock` until then stops), serve
    on `sock` (bound and listening), call `after_start()` (the page already answers), serve until
    interrupted."""
    app = build_app(studio)
    app.queue(default_concurrency_limit=4)
    guard = Middleware(WebGuard, policy=policy, limiter=LoginLimiter() if auth else None)
    # Gradio is mounted under an app of our own so that the guard is the outermost layer: given to
    # launch() it would sit inside Gradio's CORS middleware, which answers preflights by itself.
    web = FastAPI(middleware=[guard], docs_url=None, redoc_url=None, openapi_url=None)
    gr.mount_gradio_app(web, app, path="/", server_name=host, server_port=port, auth=auth, footer_links=[],
                        ssr_mode=False, pwa=False, mcp_server=False, show_error=False, enable_monitoring=False,
                        theme=THEME, css=CSS, max_file_size=MAX_UPLOAD)
    # The login limit counts TCP peers: an X-Forwarded-For from a local client is not believed, or
    # it could name a new address for every guess. Open event streams would hold a graceful
    # shutdown forever. host and port only name the socket in uvicorn's messages.
    server = uvicorn.Server(uvicorn.Config(web, host=host.strip("[]"), port=port, log_level="warning",
                                           proxy_headers=False, timeout_graceful_shutdown=3))
    before_serve()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="swift-studio-web", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise OSError(f"the web server on {host}:{port} stopped before it started (the reason is printed above)")
        time.sleep(0.05)
    if after_start is not None:
        after_start()
    try:
        while thread.is_alive():
            thread.join(0.5)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
