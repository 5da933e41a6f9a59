"""What an open studio tab costs the browser while nothing changes: the studio on a fresh database
(no run), Debian's chromium (Playwright) on one tab after another, and over a window on each:
Chrome's own main-thread accounting (CDP `Performance.getMetrics`), the events the page sent
(Gradio queue joins, by handler index) and the DOM's childList mutations by the nearest element id.

    python bench/monitor_idle.py                      # 15 s on the Monitor, then 15 s on the Train tab
    python bench/monitor_idle.py --seconds 30 --profile

One JSON line per tab: task, script and layout seconds in the window, the task seconds' share of one
core, the events and the mutated components. `--profile` adds the page's JavaScript CPU profile
over 5 more seconds on each tab: the most sampled call stacks, innermost frame first.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from studio.startup import STARTING_HEADER  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
TABS = ("Monitor", "Train")
METRICS = ("TaskDuration", "ScriptDuration", "LayoutDuration", "RecalcStyleDuration")

COUNT_MUTATIONS_JS = """() => {
  window.mutated = {};
  new MutationObserver(records => records.forEach(r => {
    const owner = r.target.closest ? r.target.closest('[id]') : null;
    const id = owner ? owner.id : '';
    window.mutated[id] = (window.mutated[id] || 0) + 1;
  })).observe(document.body, {childList: true, subtree: true});
}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_studio(root: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "XDG_DATA_HOME": str(root / "data"), "PYTHONPATH": str(REPO)}
    env.pop("SWIFT_STUDIO_AUTH", None)
    with open(root / "studio.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "backend.cli", "studio", "--port", str(port),
                                 "--db", f"sqlite:///{root / 'studio.db'}", "--output-dir", str(root / "runs")],
                                cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200 and STARTING_HEADER not in response.headers:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(f"the studio did not answer in 90 s:\n{(root / 'studio.log').read_text()[-2000:]}")


def metrics(cdp) -> dict[str, float]:
    return {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}


def frame(node: dict) -> str:
    f = node["callFrame"]
    return f"{f['functionName'] or '(anonymous)'}@{f['url'].rsplit('/', 1)[-1]}:{f['lineNumber']}"


def hot_stacks(cdp, seconds: float, top: int = 8, depth: int = 6) -> list[tuple[int, str]]:
    """The most sampled call stacks of the page's JavaScript over `seconds` (samples of about 1 ms)."""
    cdp.send("Profiler.enable")
    cdp.send("Profiler.start")
    time.sleep(seconds)
    profile = cdp.send("Profiler.stop")["profile"]
    nodes = {n["id"]: n for n in profile["nodes"]}
    parent = {child: n["id"] for n in profile["nodes"] for child in n.get("children", [])}
    stacks = collections.Counter()
    for sample in profile["samples"]:
        chain, node = [frame(nodes[sample])], sample
        while node in parent and len(chain) < depth:
            node = parent[node]
            chain.append(frame(nodes[node]))
        stacks[" < ".join(chain)] += 1
    return [(n, stack) for stack, n in stacks.most_common(top + 2) if not stack.startswith(("(idle)", "(program)"))][:top]


def measure(page, cdp, events: collections.Counter, seconds: float) -> dict:
    page.evaluate(COUNT_MUTATIONS_JS)
    events.clear()
    before = metrics(cdp)
    time.sleep(seconds)
    after = metrics(cdp)
    spent = {name: round(after[name] - before[name], 3) for name in METRICS}
    mutated = page.evaluate("() => window.mutated")
    return {"window_s": seconds, **spent, "core_share": round(spent["TaskDuration"] / seconds, 3),
            "events": dict(events), "mutated": dict(sorted(mutated.items(), key=lambda kv: -kv[1])[:15])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--profile", action="store_true", help="also the page's hottest JavaScript stacks")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="monitor-idle-") as tmp:
        proc, url = start_studio(Path(tmp))
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.set_default_timeout(90_000)
                events = collections.Counter()

                def on_request(request) -> None:
                    if request.method == "POST" and "queue/join" in request.url:
                        events[json.loads(request.post_data or "{}").get("fn_index")] += 1

                page.on("request", on_request)
                page.goto(url)
                page.locator("#train-commands").filter(has_text="torch.distributed.run").wait_for()
                cdp = page.context.new_cdp_session(page)
                cdp.send("Performance.enable")
                for tab in TABS:
                    page.get_by_role("tab", name=tab).click()
                    time.sleep(3)  # the tab's first events
                    line = {"tab": tab, **measure(page, cdp, events, args.seconds)}
                    if args.profile:
                        line["hot_stacks"] = hot_stacks(cdp, 5.0)
                    print(json.dumps(line), flush=True)
                browser.close()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)


if __name__ == "__main__":
    main()
