"""The port answers from the first moment: the start-up responder serves its page on `/` only,
refuses what the web guard refuses and everything else until the studio takes the same socket
over; a real studio process shows that page first, then the studio, on a port never free between."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from sshd import free_port
from studio.access import HostPolicy
from studio.startup import STARTING_HEADER, ListenError, StartupResponder, listen
from studio_server import REPO, studio_env

PAGE_TEXT = "Starting swift-studio"


@pytest.fixture
def responder():
    port = free_port()
    sock = listen("127.0.0.1", port)
    answering = StartupResponder(sock, HostPolicy.for_bind("127.0.0.1", port))
    answering.start()
    yield port
    answering.stop()
    sock.close()


def test_the_start_up_page_is_served_on_slash_only(responder):
    with httpx.Client(base_url=f"http://127.0.0.1:{responder}", timeout=10) as http:
        page = http.get("/")
        assert page.status_code == 200 and PAGE_TEXT in page.text and page.headers[STARTING_HEADER] == "1"
        assert page.headers["content-type"].startswith("text/html")
        assert http.head("/").status_code == 200
        for method, path in [("GET", "/config"), ("GET", "/gradio_api/info"), ("POST", "/gradio_api/queue/join"),
                             ("POST", "/"), ("POST", "/login"), ("GET", "/assets/index.js"), ("OPTIONS", "/"),
                             ("PUT", "/"), ("DELETE", "/")]:
            answer = http.request(method, path)
            assert answer.status_code == 503, (method, path)
            assert PAGE_TEXT not in answer.text and answer.headers[STARTING_HEADER] == "1"
        # http.server's own answers (an unknown method) carry the header too: a waiting client
        # never takes them for the studio.
        odd = http.request("BREW", "/")
        assert odd.status_code == 501 and odd.headers[STARTING_HEADER] == "1"


def test_the_start_up_page_refuses_what_the_guard_refuses(responder):
    with httpx.Client(base_url=f"http://127.0.0.1:{responder}", timeout=10) as http:
        assert http.get("/", headers={"Host": "evil.example"}).status_code == 403
        assert http.get("/", headers={"Origin": "http://evil.example"}).status_code == 403
        assert http.get("/gradio_api/run/predict").status_code == 403  # run-by-name, whatever the state
        assert http.get("/", headers={"Host": f"localhost:{responder}"}).status_code == 200


def test_a_taken_port_is_one_line_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ListenError) as caught:
            listen("127.0.0.1", port)
    assert str(caught.value) == (f"cannot serve on 127.0.0.1:{port}: port {port} is in use (another swift-studio?); "
                                 "pass --port to use another one")


# What `swift-studio` has imported when it binds the port: nothing heavy comes first.
BEFORE_BIND_PROBE = r"""
import json, sys
from backend.cli import build_parser
build_parser().parse_args(["studio"])
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules}
                        & {"gradio", "fastapi", "uvicorn", "pydantic", "yaml", "sqlalchemy", "sqlmodel", "asyncssh"})))
"""


def test_the_port_is_bound_before_any_heavy_import():
    out = subprocess.run([sys.executable, "-c", BEFORE_BIND_PROBE], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def port_is_taken(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def start_studio(tmp_path, port: int, **output) -> subprocess.Popen:
    """`swift-studio --port …` (the studio's options without the word `studio`, as `swift-studio`
    alone starts it) on `port` with its own database and run directory."""
    argv = [sys.executable, "-m", "backend.cli", "--port", str(port),
            "--db", f"sqlite:///{tmp_path / 'studio.db'}", "--output-dir", str(tmp_path / "runs")]
    return subprocess.Popen(argv, cwd=tmp_path, env=studio_env(tmp_path), **output)


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_the_studio_takes_over_the_port_of_its_start_up_page(tmp_path):
    port = free_port()
    log = tmp_path / "studio.log"
    with open(log, "wb") as out:
        proc = start_studio(tmp_path, port, stdout=out, stderr=subprocess.STDOUT)
    seen_start_page, free_after_bind = False, []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline:
                assert proc.poll() is None, log.read_text()[-3000:]
                try:
                    page = http.get("/")
                except httpx.TransportError:
                    assert not seen_start_page, "the port stopped answering after the start-up page"
                    time.sleep(0.05)
                    continue
                if STARTING_HEADER not in page.headers:
                    break
                seen_start_page = True
                assert page.status_code == 200 and PAGE_TEXT in page.text
                join = http.post("/gradio_api/queue/join", json={})
                # 503 from the start-up responder; the studio itself may have taken over in between.
                assert join.status_code == 503 or STARTING_HEADER not in join.headers
                if not port_is_taken(port):
                    free_after_bind.append(time.monotonic())
                time.sleep(0.05)
            else:
                pytest.fail(f"the studio did not take over port {port}:\n{log.read_text()[-3000:]}")
            assert seen_start_page, "the studio answered before any start-up page (it binds first)"
            assert free_after_bind == [], "the port was free for another process during the hand-over"
            assert page.status_code == 200 and PAGE_TEXT not in page.text
            config = http.get("/config")
            assert config.status_code == 200 and "components" in config.json()
            assert http.get("/", headers={"Host": "evil.example"}).status_code == 403
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_the_start_up_page_opens_the_studio_by_itself(tmp_path):
    """In a real browser: the page opened while the studio starts becomes the studio, no reload by hand."""
    from playwright.sync_api import expect, sync_playwright

    from studio_server import launch_browser

    port = free_port()
    proc = start_studio(tmp_path, port, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not port_is_taken(port):
            assert time.monotonic() < deadline and proc.poll() is None, "the studio did not bind its port"
            time.sleep(0.05)
        with sync_playwright() as playwright:
            browser = launch_browser(playwright)
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{port}/")
            expect(page.locator("h2").first).to_contain_text(PAGE_TEXT)
            expect(page.locator("#form-message")).to_contain_text("Loaded preset demo", timeout=120_000)
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
