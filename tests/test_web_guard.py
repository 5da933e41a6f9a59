"""A web page elsewhere cannot drive the studio: a real studio process answers forged Host and
Origin headers with 403 on every route (DNS rebinding, cross-site requests), runs no handler by
name, lists none in its API, and cools off an address that keeps failing to log in."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from urllib.parse import urlsplit

import httpx
import pytest

from sshd import free_port
from studio_server import REPO, start_studio, studio_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

EVIL_HOSTFILE = "evil slots=1 python=/tmp/evil"
# The routes the page uses and the ones a script would try; each one behind the guard.
ROUTES = [("GET", "/"), ("GET", "/config"), ("GET", "/gradio_api/info"), ("POST", "/gradio_api/queue/join"),
          ("GET", "/gradio_api/queue/data?session_hash=x"), ("POST", "/gradio_api/call/on_hostfile"),
          ("POST", "/gradio_api/run/predict"), ("POST", "/gradio_api/upload"), ("GET", "/gradio_api/file=/etc/hostname"),
          ("GET", "/gradio_api/heartbeat/x"), ("POST", "/login"), ("GET", "/theme.css"), ("GET", "/assets/index.js"),
          ("HEAD", "/"), ("OPTIONS", "/gradio_api/queue/join")]
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
WEBSOCKET = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
             "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    server = start_studio(tmp_path_factory.mktemp("guard"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def auth_studio(tmp_path_factory):
    root = tmp_path_factory.mktemp("guard-auth")
    auth = root / "auth"
    auth.write_text("alice:s3cret\n")
    auth.chmod(0o600)
    server = start_studio(root, "--auth-file", str(auth), "--allowed-hosts", "studio.example")
    yield server
    server.stop()


def port_of(server) -> int:
    return urlsplit(server.url).port


def client(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=30)


def inventory_pythons(server) -> list[str]:
    """The interpreters of the studio's node inventory (its database)."""
    import sqlite3

    path = server.root / "studio.db"
    if not path.exists():
        return []  # opened read-only: connecting must not make the studio's database an empty file
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'node'").fetchall():
            return []  # the run manager has not made its tables yet
        return [row[0] for row in db.execute("SELECT python FROM node")]


def test_a_foreign_host_is_refused_on_every_route(studio):
    port = port_of(studio)
    with client(studio) as http:
        for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}"):
            for method, path in ROUTES:
                r = http.request(method, path, headers={"Host": host, "Origin": f"http://{host}", **PREFLIGHT})
                assert r.status_code == 403, (host, method, path, r.status_code)
                assert "access-control-allow-origin" not in r.headers, (host, method, path)
                if method != "HEAD":
                    assert f"Host '{host}'" in r.text and "DNS rebinding" in r.text, (host, path, r.text)
        r = http.get("/", headers={"Host": f"evil.example:{port}", **WEBSOCKET})
        assert r.status_code == 403
        r = http.get("/", headers={"Host": f"127.0.0.1:{port}", "Origin": "http://evil.example", **WEBSOCKET})
        assert r.status_code == 403


def test_a_foreign_origin_is_refused_without_a_cors_answer(studio):
    port = port_of(studio)
    with client(studio) as http:
        for origin in ("http://evil.example", f"http://evil.example:{port}", "null", f"http://localhost:{port + 1}",
                       f"https://127.0.0.1:{port}.evil.example"):
            for method, path in ROUTES:
                r = http.request(method, path, headers={"Host": f"127.0.0.1:{port}", "Origin": origin, **PREFLIGHT})
                assert r.status_code == 403, (origin, method, path, r.status_code)
                assert "access-control-allow-origin" not in r.headers, (origin, method, path)
                if method != "HEAD":
                    assert f"Origin '{origin}'" in r.text, (origin, path, r.text)


def test_the_studio_answers_under_its_own_names(studio):
    port = port_of(studio)
    with client(studio) as http:
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
            for origin in (None, f"http://{host}", f"http://127.0.0.1:{port}"):
                headers = {"Host": host, **({"Origin": origin} if origin else {})}
                for path in ("/", "/config", "/theme.css"):
                    r = http.get(path, headers=headers)
                    assert r.status_code == 200, (host, origin, path, r.status_code, r.text[:200])
        # The page's own preflight still gets Gradio's CORS answer.
        r = http.options("/gradio_api/queue/join", headers={"Host": f"localhost:{port}",
                                                              "Origin": f"http://localhost:{port}", **PREFLIGHT})
        assert r.status_code == 200


def test_an_upload_over_the_limit_is_refused_before_it_is_stored(studio):
    from studio.app import MAX_UPLOAD

    port = port_of(studio)
    headers = {"Host": f"127.0.0.1:{port}", "Origin": f"http://127.0.0.1:{port}"}
    with client(studio) as http:
        small = http.post("/gradio_api/upload", headers=headers, files={"files": ("a.png", b"\x89PNG" * 10)})
        assert small.status_code == 200, small.text[:300]
        over = (int(MAX_UPLOAD.removesuffix("mb")) + 1) << 20  # a MiB past the page's limit
        big = http.post("/gradio_api/upload", headers=headers, files={"files": ("b.png", b"\0" * over)})
        assert big.status_code == 413, (big.status_code, big.text[:300])


def test_no_handler_is_listed_in_the_api(tmp_path, studio):
    from studio.app import build_app
    from studio.context import Studio

    app = build_app(Studio(tmp_path, tmp_path / "runs"))
    assert app.fns, "the page has handlers"
    assert [fn.name for fn in app.fns.values() if fn.api_visibility != "private"] == []
    assert app.get_api_info(all_endpoints=True) == {"named_endpoints": {}, "unnamed_endpoints": {}}
    with client(studio) as http:
        info = http.get("/gradio_api/info", params={"all_endpoints": "true"}).json()
        assert info["named_endpoints"] == {} and info["unnamed_endpoints"] == {}
        config = http.get("/config").json()
        assert {d["api_visibility"] for d in config["dependencies"]} == {"private"}


def _join(http, port: int, fn_index: int, session: str, headers: dict) -> httpx.Response:
    body = {"data": [None, EVIL_HOSTFILE], "fn_index": fn_index, "session_hash": session, "event_data": None,
            "trigger_id": None}
    return http.post("/gradio_api/queue/join", json=body, headers={"Host": f"127.0.0.1:{port}", **headers})


def test_a_page_elsewhere_cannot_write_the_cluster(studio):
    """The issue's attack: a hostfile with python=/tmp/evil posted to the page's own route by a page
    of another site (rebinding its name to 127.0.0.1, or cross-site), or by name through the API."""
    port = port_of(studio)
    with client(studio) as http:
        deps = http.get("/config").json()["dependencies"]
        fn_index = next(d["id"] for d in deps if d["api_name"] == "on_hostfile")
        r = _join(http, port, fn_index, "rebinding", {"Host": f"evil.example:{port}",
                                                     "Origin": f"http://evil.example:{port}"})
        assert r.status_code == 403
        r = _join(http, port, fn_index, "crosssite", {"Origin": "http://evil.example"})
        assert r.status_code == 403
        r = http.post("/gradio_api/call/on_hostfile", json={"data": [EVIL_HOSTFILE]})
        assert r.status_code == 403 and "not a public API" in r.text
        r = http.post("/gradio_api/run/on_hostfile", json={"data": [None, EVIL_HOSTFILE]})
        assert r.status_code == 403
        assert "/tmp/evil" not in inventory_pythons(studio)

        # The same request from the studio's own page is served: the refusals above were the guard's.
        r = _join(http, port, fn_index, "own-page", {"Origin": f"http://127.0.0.1:{port}"})
        assert r.status_code == 200, r.text
        with http.stream("GET", "/gradio_api/queue/data", params={"session_hash": "own-page"}) as events:
            for line in events.iter_lines():
                if line.startswith("data:") and json.loads(line[5:]).get("msg") == "process_completed":
                    break
    assert "/tmp/evil" in inventory_pythons(studio)


def test_listed_names_are_served_and_others_refused(auth_studio):
    port = port_of(auth_studio)
    with client(auth_studio) as http:
        for host in (f"studio.example:{port}", "studio.example", f"127.0.0.1:{port}"):
            r = http.get("/", headers={"Host": host, "Origin": "http://studio.example"})
            assert r.status_code == 200, (host, r.status_code, r.text[:200])
        assert http.get("/", headers={"Host": f"other.example:{port}"}).status_code == 403
        assert http.get("/", headers={"Origin": "http://other.example"}).status_code == 403
    assert "chmod 600" not in auth_studio.log.read_text()  # its auth file is 0600


def test_failed_logins_cool_off(auth_studio):
    good, bad = {"username": "alice", "password": "s3cret"}, {"username": "alice", "password": "guess"}
    with client(auth_studio) as http:
        assert http.post("/login", data=good).status_code == 200
        for _ in range(4):
            assert http.post("/login", data=bad).status_code == 400
        assert http.post("/login", data=good).status_code == 200  # unaffected, and forgives those four
        for _ in range(5):
            assert http.post("/login", data=bad).status_code == 400
        r = http.post("/login", data=good)
        assert r.status_code == 429, r.text
        assert "too many failed logins from 127.0.0.1" in r.text and 0 < int(r.headers["retry-after"]) <= 60
        # A forwarded-for header names no new address to guess from.
        assert http.post("/login", data=good, headers={"X-Forwarded-For": "10.9.9.9"}).status_code == 429
        assert http.get("/").status_code == 200  # only logins wait


def test_every_address_bind_needs_the_names_it_is_reached_under(tmp_path):
    env = {**studio_env(tmp_path), "SWIFT_STUDIO_AUTH": "alice:s3cret"}
    out = subprocess.run([sys.executable, "-m", "backend.cli", "studio", "--host", "0.0.0.0", "--port", str(free_port())],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--allowed-hosts myhost.example.com" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "backend.cli", "studio", "--help"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=30)
    assert "--allowed-hosts" in out.stdout and "DNS rebinding" in " ".join(out.stdout.split())


def test_a_taken_port_is_reported_without_a_traceback(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "backend.cli", "studio", "--port", str(port),
                              "--db", f"sqlite:///{tmp_path / 'studio.db'}"],
                             cwd=REPO, env=studio_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    # One line, naming the port and what to do (the port is bound before Gradio is imported).
    assert out.stderr.strip().splitlines() == [
        f"swift-studio: cannot serve on 127.0.0.1:{port}: port {port} is in use (another swift-studio?); "
        "pass --port to use another one"]
