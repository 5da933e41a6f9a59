"""`swift-studio studio` (and `swift-studio` with no arguments): options and start-up.

Kept free of third-party imports but platformdirs, so `swift-studio --help` and the other
subcommands stay fast, and so the studio binds its port (studio/startup.py) before the seconds of
Gradio's import; the page is built only when the studio actually starts.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from pathlib import Path

import platformdirs

from studio.access import (AUTH_ENV, AccessError, HostPolicy, auth_file_warning, check_bind, load_auth,
                           parse_allowed_hosts)
from studio.startup import ListenError, StartupResponder, listen

DEFAULT_PORT = 7860
log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1); any other address needs --auth-file "
                             "or $SWIFT_STUDIO_AUTH=user:password")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--db", default=None,
                        help="SQLAlchemy database URL (default: SQLite in the user data dir, or $SWIFT_STUDIO_DB)")
    parser.add_argument("--output-dir", default=None,
                        help="directory for the runs of the demo preset and new forms (default: runs/ in the user data dir)")
    parser.add_argument("--auth-file", default=None,
                        help="file of 'user:password' lines (keep it chmod 600); the page asks for one, and "
                             "an address that fails 5 logins within 60 s waits 60 s")
    parser.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                        help="comma-separated names (or name:port) browsers reach the studio under besides --host, "
                             "e.g. the name a reverse proxy passes in Host:. Requests for any other Host, or sent "
                             "by another site's page (Origin), are refused with 403 (this stops DNS rebinding). "
                             "Needs authentication; required with --host 0.0.0.0 or ::")


def run(args: argparse.Namespace) -> int:
    """Start the studio and serve until interrupted; returns the exit code."""
    try:
        auth = load_auth(args.auth_file)
        # The password must not travel into the workers, agents and exports this process starts
        # on the local node (they inherit its environment).
        os.environ.pop(AUTH_ENV, None)
        allowed_hosts = parse_allowed_hosts(args.allowed_hosts)
        check_bind(args.host, auth, allowed_hosts)
    except AccessError as exc:
        print(f"swift-studio: {exc}", file=sys.stderr)
        return 2
    if args.auth_file:
        path = Path(args.auth_file).expanduser()
        warning = auth_file_warning(str(path), path.stat().st_mode)
        if warning:
            print(f"swift-studio: {warning}", file=sys.stderr, flush=True)
    try:
        sock = listen(args.host, args.port)
    except ListenError as exc:
        print(f"swift-studio: {exc}", file=sys.stderr)
        return 1
    policy = HostPolicy.for_bind(args.host, args.port, allowed_hosts)
    responder = StartupResponder(sock, policy)
    responder.start()
    studio = None
    try:
        data_dir = Path(platformdirs.user_data_dir("swift-studio"))
        # The data dir holds the database (run specs with their env values) and the cluster: the
        # owner's only when the studio creates it.
        if not data_dir.exists():
            data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(data_dir, 0o700)  # whatever the umask
        output_dir = Path(args.output_dir or data_dir / "runs").expanduser().resolve()
        # Seconds of imports (Gradio above all) while the start-up page answers.
        from studio.app import serve
        from studio.context import Studio

        studio = Studio(data_dir=data_dir, output_dir=output_dir)

        def start_manager() -> None:
            # The control plane (database, SSH, re-attaching to running runs) starts once the page
            # answers; handlers that need it wait for it.
            threading.Thread(target=_start_manager, args=(studio, args.db), name="swift-studio-manager",
                             daemon=True).start()
            print(f"swift-studio: http://{args.host}:{args.port}/  (runs in {output_dir})", flush=True)

        serve(studio, sock, host=args.host, port=args.port, policy=policy, auth=auth,
              before_serve=responder.stop, after_start=start_manager)
    except KeyboardInterrupt:
        pass
    except OSError as exc:  # the web server did not start
        print(f"swift-studio: {exc}", file=sys.stderr)
        return 1
    finally:
        responder.stop()
        sock.close()
        if studio is not None and studio.manager_future.done() and not studio.manager_future.exception():
            studio.manager.close()  # runs keep going on their nodes; the next start re-attaches
    return 0


def _start_manager(studio, db_url: str | None) -> None:
    try:
        from backend.runs.manager import RunManager

        studio.manager_future.set_result(RunManager(db_url))
    except BaseException as exc:  # every handler that needs it reports this instead of hanging
        log.exception("the run manager did not start")
        studio.manager_future.set_exception(exc)
