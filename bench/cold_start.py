"""Cold start of the studio: `swift-studio studio` as a subprocess on a free port with a fresh
home (so the default SQLite database and data dir are new), timed from the spawn to

* `first_200_s`: the first HTTP 200 on `/` (whatever page answers it);
* `studio_s`: the real studio, i.e. Gradio's `/config` answering 200 with the page's components;

with the studio process's resident memory and CPU seconds (user + system) at that moment and the
load average before the run.
One JSON line per run, then a summary line (min/median). Prints figures; asserts nothing.

    python bench/cold_start.py [--runs 5] [--importtime] [--top 10]

`--importtime` adds one run under `python -X importtime` and prints the import seconds of each
top-level package (the sum of its modules' own times, so nested imports are not counted twice).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120
POLL_S = 0.02
# The studio prints this line once it serves (studio/server.py). The run waits for it before asking
# for `/config`, so that the starting process answers no stream of requests while it imports: the
# start-up page would answer each of them, and the figure would be of the polling.
READY_LINE = b"swift-studio: http"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(port: int, importtime: bool) -> list[str]:
    """The installed `swift-studio` entry point where it is this checkout's, else the module."""
    if not importtime and shutil.which("swift-studio"):
        return ["swift-studio", "studio", "--port", str(port)]
    return [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "backend.cli", "studio",
            "--port", str(port)]


def status(url: str) -> tuple[int | None, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except OSError:
        return None, b""


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of the process so far: less shaken by other work than wall time."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def one_run(importtime: bool = False) -> tuple[dict, str]:
    """Start, wait for the real studio, stop; the figures and the process's stderr. Under
    `importtime` no request is sent until the studio prints its address: an import in a thread
    answering one would overlap the main thread's and garble `-X importtime`'s self times (and
    first_200_s is then the studio's)."""
    load = os.getloadavg()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="cold-start-") as home:
        env = {**os.environ, "HOME": home, "XDG_DATA_HOME": f"{home}/data", "PYTHONPATH": str(ROOT)}
        env.pop("SWIFT_STUDIO_AUTH", None)
        env.pop("SWIFT_STUDIO_DB", None)
        err, out = Path(home) / "stderr", Path(home) / "stdout"
        base = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        with open(err, "wb") as stderr, open(out, "wb") as stdout:
            proc = subprocess.Popen(command(port, importtime), cwd=home, env=env, stdout=stdout,
                                    stderr=stderr, start_new_session=True)
        first_200 = studio = rss = cpu = None
        try:
            while time.monotonic() - started < TIMEOUT_S and proc.poll() is None:
                ready = READY_LINE in out.read_bytes()
                if first_200 is None and (ready or not importtime) and status(f"{base}/")[0] == 200:
                    first_200 = time.monotonic() - started
                if ready and first_200 is not None:
                    code, body = status(f"{base}/config")
                    if code == 200 and b'"components"' in body:
                        studio = time.monotonic() - started
                        rss, cpu = rss_mib(proc.pid), cpu_s(proc.pid)
                        break
                time.sleep(POLL_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        text = err.read_text(errors="replace")
    figures = {"first_200_s": _round(first_200), "studio_s": _round(studio), "rss_mib": _round(rss, 1),
               "cpu_s": _round(cpu, 2), "load_avg": [round(x, 2) for x in load], "exit": proc.returncode if studio is None else None}
    return figures, text


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def import_breakdown(stderr: str) -> dict[str, float]:
    """Seconds per top-level package from `-X importtime` lines: `import time: self | cumulative | name`."""
    seconds: dict[str, float] = defaultdict(float)
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, _, name = (part.strip() for part in line[len("import time:"):].split("|"))
        seconds[name.split(".")[0]] += int(self_us) / 1e6
    return dict(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--importtime", action="store_true", help="also one run under -X importtime")
    parser.add_argument("--top", type=int, default=10, help="packages shown in the import breakdown")
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        figures, stderr = one_run()
        runs.append(figures)
        print(json.dumps({"run": i + 1, **figures}), flush=True)
        if figures["studio_s"] is None:
            print(stderr[-2000:], file=sys.stderr)
    summary: dict = {"runs": len(runs), "load_avg_end": [round(x, 2) for x in os.getloadavg()]}
    for key in ("first_200_s", "studio_s", "rss_mib", "cpu_s"):
        values = [r[key] for r in runs if r[key] is not None]
        if values:
            summary[key] = {"min": min(values), "median": round(statistics.median(values), 3), "max": max(values)}
    print(json.dumps({"summary": summary}), flush=True)
    if args.importtime:
        figures, stderr = one_run(importtime=True)
        packages = import_breakdown(stderr)
        top = sorted(packages.items(), key=lambda kv: -kv[1])[: args.top]
        ours = {name: round(packages.get(name, 0.0), 3) for name in ("backend", "studio")}
        print(json.dumps({"importtime_run": figures, "total_import_s": round(sum(packages.values()), 3),
                          "top": [[name, round(s, 3)] for name, s in top], "ours": ours}), flush=True)


if __name__ == "__main__":
    main()
