"""The port from the first moment: the studio binds it before importing Gradio (seconds), so a
taken port is one line at once, and while the page is being built a small responder answers `/`
with a page that reloads itself when the studio is up. The same listening socket is then handed
to the web server: the port is never free for another process in between, and a connection
that arrives during the hand-over waits in the socket's backlog.

Standard library only (and studio.access): this runs before any third-party import.
"""
from __future__ import annotations

import errno
import select
import socket
import threading
from http.server import BaseHTTPRequestHandler

from studio.access import HostPolicy

# Every answer of the responder carries it: a client that waits for the studio (the page's own
# poll, tests/studio_server.py, bench/cold_start.py) waits until an answer comes without it.
STARTING_HEADER = "X-Swift-Studio-Starting"
BACKLOG = 2048  # uvicorn's default: what waits during the hand-over
REQUEST_TIMEOUT_S = 2.0  # a client that sends nothing (a browser's preconnect) holds one thread this long
MAX_CONNECTIONS = 16  # connections answered at once; more are closed unanswered

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>swift-studio</title>
<noscript><meta http-equiv="refresh" content="2"></noscript>
<style>body{font-family:system-ui,sans-serif;margin:4rem auto;max-width:36rem;color:#333}</style>
</head><body><h2>Starting swift-studio&hellip;</h2>
<p id="note">The page opens by itself in a few seconds.</p>
<script>
let unanswered = 0;
setInterval(async () => {
  try {
    const answer = await fetch("/", {cache: "no-store"});
    unanswered = 0;
    if (!answer.headers.has("%s")) location.reload();
  } catch (e) {  // the hand-over (a moment), or a studio that stopped while starting
    if (++unanswered == 20) document.getElementById("note").textContent =
      "swift-studio stopped while starting: its console says why. This page reloads once it runs again.";
  }
}, 500);
</script></body></html>
""" % STARTING_HEADER


class ListenError(OSError):
    """The studio's address cannot be bound; the message names it and what to do."""


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port, bound as uvicorn would bind it."""
    address = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    # Lets a restarted studio bind while the last one's connections are in TIME_WAIT; a port that
    # another process listens on is still refused.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ListenError(f"cannot serve on {host}:{port}: port {port} is in use (another swift-studio?); "
                              "pass --port to use another one") from None
        raise ListenError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    return sock


class StartupResponder:
    """Answers on `sock` until stop(): GET or HEAD `/` with PAGE, everything else with 503; a
    request that the studio's web guard would refuse (Host, Origin) with the guard's 403."""

    def __init__(self, sock: socket.socket, policy: HostPolicy):
        self.sock, self.policy = sock, policy
        # stop() writes a byte here: the accepting thread sleeps in select() without a timeout, so
        # it neither wakes up while Gradio imports nor delays the hand-over.
        self._wake, self._waker = socket.socketpair()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._thread = threading.Thread(target=self._accept, name="swift-studio-startup", daemon=True)

    def start(self) -> None:
        # Non-blocking, so that an accept() after a client gave up returns at once (asyncio, which
        # takes the socket over, wants it so too); accepted sockets block, with REQUEST_TIMEOUT_S.
        self.sock.setblocking(False)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting (answers under way finish on their own connections); the socket stays open."""
        if self._waker.fileno() < 0:
            return
        self._waker.send(b"x")
        if self._thread.is_alive():
            self._thread.join()
        self._wake.close()
        self._waker.close()

    def _accept(self) -> None:
        while True:
            ready = select.select([self.sock, self._wake], [], [])[0]
            if self._wake in ready:
                return
            try:
                conn, client = self.sock.accept()
            except OSError:  # the client went away before it was accepted
                continue
            if not self._slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._answer, args=(conn, client), daemon=True).start()

    def _answer(self, conn: socket.socket, client) -> None:
        try:
            with conn:
                _Handler(conn, client, self)
        except OSError:
            pass  # the client hung up
        finally:
            self._slots.release()


class _Handler(BaseHTTPRequestHandler):
    timeout = REQUEST_TIMEOUT_S
    server: StartupResponder

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(body=False)

    def _unavailable(self) -> None:
        self._answer(body=True, page=False)

    do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = _unavailable

    def _answer(self, body: bool, page: bool = True) -> None:
        path = self.path.split("?")[0]
        why = self.server.policy.request_refusal(self.headers.get_all("Host") or [],
                                                 self.headers.get_all("Origin") or [], path)
        if why:
            self._send(403, "text/plain", why + "\n", body)
        elif page and path == "/":
            self._send(200, "text/html", PAGE, body)
        else:
            self._send(503, "text/plain", "swift-studio is starting; try again in a moment.\n", body,
                       retry_after=True)

    def end_headers(self) -> None:
        # On every answer, http.server's own ones too (400, 414, 501 for an unknown method).
        self.send_header(STARTING_HEADER, "1")
        super().end_headers()

    def _send(self, status: int, kind: str, text: str, body: bool, retry_after: bool = False) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", f"{kind}; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        if retry_after:
            self.send_header("Retry-After", "1")
        self.send_header("Connection", "close")
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format, *args) -> None:  # noqa: A002 - http.server's signature
        pass  # a start-up page served is not worth a line on the console
