"""The studio as a real subprocess on a free port with its own DB, data and output dirs, and a
real browser (Debian's chromium through Playwright) that records every request the page makes.

Screenshots go to test-artifacts/ui/ (git-ignored) so CI keeps them.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from sshd import free_port
from studio.startup import STARTING_HEADER

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "test-artifacts" / "ui"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-dev-shm-usage"]
START_TIMEOUT_S = 60


@dataclass
class StudioProcess:
    proc: subprocess.Popen
    url: str
    root: Path
    log: Path
    startup_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def output_dir(self) -> Path:
        return self.root / "runs"

    def stop(self) -> None:
        """Ends the studio's process group (it owns it: started with a new session)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)


def studio_env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["XDG_DATA_HOME"] = str(root / "data")  # platformdirs' user data dir on Linux
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("SWIFT_STUDIO_AUTH", None)
    return env


def start_studio(root: Path, *args: str, port: int | None = None) -> StudioProcess:
    """`python -m backend.cli studio` with a temp DB and output dir; waits for the studio's HTTP 200
    (not the start-up page's)."""
    root.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log = root / "studio.log"
    argv = [sys.executable, "-m", "backend.cli", "studio", "--port", str(port),
            "--db", f"sqlite:///{root / 'studio.db'}", "--output-dir", str(root / "runs"), *args]
    started = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, cwd=root, env=studio_env(root), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    server = StudioProcess(proc, url, root, log)
    deadline = started + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"studio exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                # The start-up page answers 200 too, until the studio takes the port over.
                if response.status == 200 and STARTING_HEADER not in response.headers:
                    server.startup_s = time.monotonic() - started
                    return server
        except OSError:
            pass
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"studio did not answer within {START_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")


class Shots:
    """Numbered screenshots of one test: test-artifacts/ui/<test>/<nn>-<step>.png."""

    def __init__(self, name: str):
        self.dir = ARTIFACTS / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.count = 0

    def __call__(self, page, step: str, full_page: bool = True) -> Path:
        self.count += 1
        path = self.dir / f"{self.count:02d}-{step}.png"
        page.screenshot(path=str(path), full_page=full_page)
        return path


def launch_browser(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


def open_studio(browser, url: str):
    """A page on the studio, after its load events (demo preset, cluster, runs) have landed, so
    later typing is not overwritten by them. Timeouts allow for a 2-core machine under load."""
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    page.requests = record_requests(page)
    page.goto(url)
    expect(page.locator("#form-message")).to_contain_text("Loaded preset demo", timeout=60_000)
    expect(page.locator("#train-commands")).to_contain_text("torch.distributed.run", timeout=60_000)
    return page


def reload_studio(page, commands: str = "torch.distributed.run") -> None:
    """`page.reload()`, then open_studio's wait for the load events, the command preview showing
    `commands`: a click during them waited out its 60 s once on a loaded 2-core machine (element
    visible and stable, the click never dispatched)."""
    from playwright.sync_api import expect

    page.reload()
    expect(page.locator("#train-commands")).to_contain_text(commands, timeout=60_000)


def record_requests(page) -> list[str]:
    urls: list[str] = []
    page.on("request", lambda request: urls.append(request.url))
    return urls


def foreign_requests(urls: list[str], base_url: str) -> list[str]:
    """Requests to any origin other than the studio's own (data: and blob: URLs stay local)."""
    return [u for u in urls if not u.startswith(base_url) and not u.startswith(("data:", "blob:"))]
