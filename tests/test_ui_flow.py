"""The whole studio flow in a real browser, on this machine, with the real worker:

open → invalid layout shows its field error → demo preset (shortened) → pre-flight and launch →
loss and utilisation charts gain points, the training charts against the step → reload mid-run
lands on the Monitor, charts complete → the log opens at its newest lines → stop → resume from
the checkpoint to the end → export, with the exported path, the prompt and the fine-tuned
demo's reply (it knows the name its job gave it) → the same question in Chat, the base beside
the fine-tuned → the Runs table and overlay. A run that fails before its first checkpoint offers to run again instead of a
resume. Screenshots of every step go to test-artifacts/ui/flow/ and ui/run-again/. Along the way:
no request leaves the studio's own address, no traceback reaches the page, and the studio process
never loads torch and stays small.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

pytest.importorskip("playwright")
from playwright.sync_api import expect, sync_playwright  # noqa: E402

from studio_server import REPO, Shots, foreign_requests, launch_browser, open_studio, start_studio  # noqa: E402
from worker import unloadable_model  # noqa: E402

# the full flow took 349 s in a CI run at load 7 on 2 cores
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

RUN_TIMEOUT_MS = 150_000
DEMO_TIMEOUT_MS = 240_000  # this test's 300 demo steps: about 20 s on two idle cores, more beside the suite's other worker
# The demo logging every step, with steps enough that it is still training when the test stops it
# (the demo's own 100 steps can end first: seen at load 4, 33 s after Launch), and a checkpoint every
# 20 steps (with one every 4, 75 in all, this test took 205 s in the suite).
# 300 steps: between step 22 and the stop taking effect the page can be slow under load while the
# ranks are not (a run of 150 steps once ended before the stop landed).
SHORT = {"max_steps": "300", "save_steps": "20", "logging_steps": "1"}
WORKER_LIBS = ("libtorch", "torch/_C", "transformers", "deepspeed")

EVAL_AT_JS = """(step) => {
  const el = document.querySelector('#chart-loss .js-plotly-plot');
  return !!el && !!el.data && el.data.some(t => t.name === 'eval' && t.x && t.x.includes(step));
}"""
POINTS_JS = """(id) => {
  const el = document.querySelector(`#${id} .js-plotly-plot`);
  if (!el || !el.data) return 0;
  return el.data.reduce((n, t) => n + (t.x ? t.x.length : 0), 0);
}"""


# The x axis of a chart and the x values of its last trace.
AXIS_JS = """(id) => {
  const el = document.querySelector(`#${id} .js-plotly-plot`);
  if (!el || !el.layout) return null;
  const trained = el.data.filter(t => t.name !== 'eval');  // the eval loss has points at its steps only
  const last = trained.length ? trained[trained.length - 1] : {x: []};
  return {type: el.layout.xaxis.type, title: el.layout.xaxis.title ? el.layout.xaxis.title.text : null,
          x: Array.from(last.x || [])};
}"""
# Whether a text box shows its last line (scrolled to the bottom).
AT_BOTTOM_JS = """(selector) => {
  const box = document.querySelector(selector);
  return box.scrollHeight > box.clientHeight && box.scrollTop + box.clientHeight >= box.scrollHeight - 2;
}"""
# The rendered height of each Runs table column header: one line each, or fragments of a word.
HEADER_HEIGHTS_JS = """() => Object.fromEntries([...document.querySelectorAll('#runs-table th.header-cell')]
  .map(th => [th.title, th.querySelector('.header').getBoundingClientRect().height]))"""


def points(page, chart: str) -> int:
    return page.evaluate(POINTS_JS, chart)


def axis(page, chart: str) -> dict:
    return page.evaluate(AXIS_JS, chart)


def what_happened(page, studio=None) -> str:
    """What the page and the run's files said, for a wait that ran out: the Monitor's status and
    action lines, then the tail of each log and event file of the studio's runs, and its own log."""
    parts = [f"{sel}: {page.locator(sel).inner_text()!r}" for sel in ("#monitor-status", "#monitor-action",
                                                                      "#monitor-progress")]
    if studio is not None:
        files = [*sorted(studio.output_dir.glob("*/logs/*.log")), *sorted(studio.output_dir.glob("*/events/*.jsonl")),
                 studio.log]
        for path in files:
            lines = [line[:300] for line in path.read_text(errors="replace").splitlines()[-15:]]
            parts.append(f"--- {path} (last {len(lines)} lines)\n" + "\n".join(lines))
    return "\n".join(parts)


def wait_points(page, chart: str, more_than: int, timeout_s: float = 120, studio=None) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = points(page, chart)
        if n > more_than:
            return n
        time.sleep(0.5)
    raise AssertionError(f"{chart} stayed at {points(page, chart)} points (wanted > {more_than})\n"
                         + what_happened(page, studio))


def step_shown(page) -> int:
    match = re.search(r"step (\d+) / (\d+)", page.locator("#monitor-progress").inner_text())
    return int(match.group(1)) if match else -1


def wait_step(page, at_least: int, timeout_s: float = 150, studio=None) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if step_shown(page) >= at_least:
            return step_shown(page)
        time.sleep(0.5)
    raise AssertionError(f"progress stayed at step {step_shown(page)} (wanted >= {at_least})\n"
                         + what_happened(page, studio))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def loaded_worker_libs(pid: int) -> list[str]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return [lib for lib in WORKER_LIBS if lib in maps]


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    server = start_studio(tmp_path_factory.mktemp("flow"))
    yield server
    server.stop()


def test_full_flow(studio):
    shot = Shots("flow")
    with sync_playwright() as p:
        browser = launch_browser(p)
        # 1. Opened on the Train tab with the demo preset loaded.
        page = open_studio(browser, studio.url)
        requests = page.requests
        shot(page, "opened-demo-preset")

        # 2. An invalid layout shows its error next to the field, and clears when fixed.
        tp = page.locator("#f-tensor_model_parallel_size")
        tp.locator("input").fill("3")  # world 2 is no multiple of TP 3
        expect(tp).to_have_class(re.compile("field-error"), timeout=15000)
        shot(page, "invalid-layout")
        tp.locator("input").fill("1")
        expect(tp).not_to_have_class(re.compile("field-error"), timeout=15000)

        # 3. Checkpoint and log often, train longer than the demo, then pre-flight and launch here.
        page.get_by_text("Checkpoints, evaluation and logging").click()
        for name, value in SHORT.items():
            page.locator(f"#f-{name} input").fill(value)
        expect(page.locator("#train-commands")).to_contain_text("--max_steps 300", timeout=15000)
        page.locator("#launch").click()
        expect(page.locator("#launch-status")).to_contain_text("Launched run", timeout=60000)
        run_id = re.search(r"Launched run (\S+?)\.", page.locator("#launch-status").inner_text()).group(1)
        expect(page.get_by_role("tab", name="Monitor")).to_have_attribute("aria-selected", "true")
        # The status names the layout the ranks were planned with, and what the run used.
        expect(page.locator("#monitor-status")).to_contain_text(re.compile(r"DP\d+×TP1×SP1×CP1 = \d+ ranks"),
                                                                timeout=30000)
        expect(page.locator("#monitor-status")).to_contain_text("Used: no GPU (CPU nodes)")
        shot(page, "launched")

        # 4. The loss and utilisation charts gain points while the run trains.
        first = wait_points(page, "chart-loss", 0, timeout_s=RUN_TIMEOUT_MS / 1000, studio=studio)
        util = wait_points(page, "chart-util-lines", 0, studio=studio)
        wait_points(page, "chart-loss", first, studio=studio)
        wait_points(page, "chart-util-lines", util, studio=studio)
        # One CPU node: its utilisation is drawn as a line; a heatmap of one row is not drawn.
        expect(page.locator("#chart-util-heatmap")).to_be_hidden()
        # Utilisation on 0-100 % (a 0.5 % dip is no fall to the floor); no power panel on a CPU-only run.
        assert page.evaluate("() => document.querySelector('#chart-util-lines .js-plotly-plot').layout.yaxis.range") \
            == [0, 100]
        expect(page.locator("#chart-power")).to_be_hidden()
        # The training charts are drawn against the step (logged every step), time is in the hover.
        loss_axis = axis(page, "chart-loss")
        assert loss_axis["type"] == "linear" and loss_axis["title"] == "step", loss_axis
        assert len(loss_axis["x"]) >= 2 and loss_axis["x"] == list(range(1, len(loss_axis["x"]) + 1)), loss_axis
        assert axis(page, "chart-lr")["title"] == "step"
        shot(page, "charts-live")
        page.locator("#monitor-x-axis").get_by_text("time").click()
        page.wait_for_function("() => document.querySelector('#chart-loss .js-plotly-plot').layout.xaxis.type === 'date'")
        shot(page, "charts-against-time")
        page.locator("#monitor-x-axis").get_by_text("step").click()
        page.wait_for_function("() => document.querySelector('#chart-loss .js-plotly-plot').layout.xaxis.type === 'linear'")
        rss_watching = rss_mib(studio.proc.pid)

        # 5. Reload mid-run: the page opens on the Monitor of the running run, charts complete.
        before = points(page, "chart-loss")
        page.reload()
        expect(page.get_by_role("tab", name="Monitor")).to_have_attribute("aria-selected", "true", timeout=30000)
        expect(page.locator("#monitor-run input")).to_have_value(re.compile(re.escape(run_id)), timeout=30000)
        assert wait_points(page, "chart-loss", before - 1, timeout_s=30, studio=studio) >= before
        shot(page, "reloaded")

        # 6. Stop once a checkpoint exists: the workers save one more and exit.
        wait_step(page, 22, studio=studio)
        # The demo holds 2% of its records out: their eval loss is drawn at step 20 (every save_steps).
        page.wait_for_function(EVAL_AT_JS, arg=20, timeout=30000)
        page.locator("#monitor-stop").click()
        expect(page.locator("#monitor-status")).to_contain_text("stopped", timeout=60000)
        expect(page.locator("#monitor-resume")).to_be_enabled(timeout=15000)
        run_dir = studio.output_dir / run_id
        complete = sorted(int(p.name.split("-")[1]) for p in run_dir.glob("checkpoint-*") if (p / "complete").exists())
        assert complete and complete[-1] >= 20, complete
        # The stop message is the workers' own account: the checkpoint they saved at the stop.
        expect(page.locator("#monitor-action")).to_contain_text(
            f"saved {run_dir / f'checkpoint-{complete[-1]}'} (step {complete[-1]})", timeout=15000)
        stopped_at = step_shown(page)
        assert 20 <= stopped_at < 300
        # The live log opens at its newest lines (by now more than the box shows).
        page.get_by_text("Logs", exact=True).click()
        expect(page.locator("#monitor-log textarea")).to_have_value(re.compile(r"step \d+/300"), timeout=30000)
        page.wait_for_function(AT_BOTTOM_JS, arg="#monitor-log textarea", timeout=10000)
        page.get_by_text("Logs", exact=True).click()
        page.locator("#monitor-full-log").click()
        expect(page.locator("#monitor-log-full textarea")).to_have_value(re.compile(r"\[rank0\].*step \d+"), timeout=30000)
        shot(page, "stopped")

        # 7. Resume continues from the latest complete checkpoint, not from step 0, to the end.
        expect(page.locator("#monitor-resume")).to_have_text("▶ Resume from checkpoint")
        page.locator("#monitor-resume").click()
        expect(page.locator("#monitor-action")).to_contain_text(f"from the checkpoint of step {complete[-1]}",
                                                                timeout=30000)  # a loaded machine queues it
        expect(page.locator("#monitor-status")).to_contain_text(
            f"Resumed from the checkpoint of step {complete[-1]}", timeout=RUN_TIMEOUT_MS)
        wait_step(page, max(stopped_at, complete[-1]) + 2, timeout_s=RUN_TIMEOUT_MS / 1000, studio=studio)
        assert points(page, "chart-loss") > before
        # Running again: the status line says so, the "Resuming …" line is gone.
        expect(page.locator("#monitor-status")).to_contain_text("running")
        expect(page.locator("#monitor-action")).not_to_contain_text("Resuming", timeout=10000)
        shot(page, "resumed")
        expect(page.locator("#monitor-status")).to_contain_text("succeeded", timeout=2 * DEMO_TIMEOUT_MS)
        expect(page.locator("#monitor-status")).to_contain_text("attempt 2")

        # 8. Export from the Monitor: the merged model's path and its answer to the first question of
        # the demo's data, which shows what fine-tuning taught it: the name the job gave it.
        page.locator("#monitor-export").click()
        expect(page.locator("#export-run input")).to_have_value(re.compile(re.escape(run_id)), timeout=15000)
        # Its checkpoints show their eval loss, the lowest marked best.
        page.locator("#export-checkpoint input").click()
        expect(page.get_by_role("option", name=re.compile(r"step \d+ · eval loss [\d.]+ \(best\)"))).to_have_count(1)
        page.get_by_role("option", name="latest complete checkpoint").click()
        page.locator("#export-go").click()
        expect(page.locator("#export-result")).to_contain_text("Exported checkpoint", timeout=RUN_TIMEOUT_MS)
        expect(page.locator("#export-result")).to_contain_text(str(studio.output_dir / run_id / "export"))
        assert (studio.output_dir / run_id / "export" / "config.json").is_file()
        expect(page.locator("#export-prompt textarea")).to_have_value("Who are you?")
        expect(page.locator("#export-sample textarea")).to_have_value(re.compile(r"\bI am Swifty\b"))
        shot(page, "exported")

        # The Chat tab puts the base's answer beside the fine-tuned one's: only the latter knows its name.
        page.get_by_role("tab", name="Chat").click()
        page.locator("#chat-run input").click()
        page.get_by_role("option", name=re.compile(re.escape(run_id))).click()
        # Only the checkpoints still on disk are offered (save_total_limit removed the others).
        page.locator("#chat-source input").click()
        offered = page.get_by_role("option").all_inner_texts()
        steps = sorted(int(m.group(1)) for text in offered if (m := re.match(r"step (\d+) ·", text)))
        on_disk = sorted(int(p.name.split("-")[1]) for p in run_dir.glob("checkpoint-*") if (p / "complete").exists())
        assert steps == on_disk and len(on_disk) == 2, (offered, on_disk)
        page.get_by_role("option", name="latest complete checkpoint").click()
        page.locator("#chat-load").click()
        expect(page.locator("#chat-status")).to_contain_text("Loaded the full fine-tuning checkpoint",
                                                             timeout=RUN_TIMEOUT_MS)
        page.locator("#chat-message textarea").fill("What is your name?")
        page.locator("#chat-send").click()
        expect(page.locator("#chat-answers")).to_contain_text(re.compile(r"Base: \d+ tokens .* Fine-tuned: \d+ tokens"),
                                                              timeout=RUN_TIMEOUT_MS)
        expect(page.locator("#chat-tuned .message.bot").last).to_contain_text("I am Swifty")
        expect(page.locator("#chat-base .message.bot").last).not_to_contain_text("Swifty")
        shot(page, "chat-demo")

        # 9. The Runs tab lists the run with its state and overlays its loss curve.
        page.get_by_role("tab", name="Runs").click()
        expect(page.locator("#runs-table")).to_contain_text(run_id, timeout=30000)
        expect(page.locator("#runs-table")).to_contain_text("succeeded")
        expect(page.locator("#runs-table")).to_contain_text("Wh/Mtok")  # GPU-h, kWh, Wh per 1M tokens, cost
        # Every column in view on a 1400 px page (the run directory wraps), the name not twice.
        table, box = page.evaluate("() => { const b = document.querySelector('#runs-table');"
                                   " return [b.querySelector('table').scrollWidth, b.clientWidth]; }")
        assert table <= box, (table, box)
        heights = page.evaluate(HEADER_HEIGHTS_JS)
        assert heights["attempts"] == heights["run"], heights  # one line, not "at/te/mp/ts"
        page.locator("#runs-overlay input").click()
        page.get_by_role("option", name=re.compile(re.escape(run_id))).click()
        wait_points(page, "chart-overlay", 0, timeout_s=30)
        overlay = axis(page, "chart-overlay")
        assert overlay["title"] == "step" and overlay["x"][:3] == [1, 2, 3], overlay
        shot(page, "runs")

        content = page.content()
        browser.close()

    assert "Traceback" not in content
    assert foreign_requests(requests, studio.url) == []
    assert loaded_worker_libs(studio.proc.pid) == []
    assert rss_watching < 350, f"studio resident {rss_watching:.0f} MiB while watching a run"
    print(f"studio: first HTTP answer {studio.startup_s:.1f} s, {rss_watching:.0f} MiB while watching a run")


def broken_model(where: Path) -> Path:
    """The demo model with weights that do not fit its config: the form's checks pass, the worker
    fails loading it, before any step or checkpoint."""
    return unloadable_model(REPO / "assets" / "demo" / "model", where / "broken-model")


def test_a_failed_run_without_a_checkpoint_offers_to_run_again(studio, tmp_path):
    shot = Shots("run-again")
    with sync_playwright() as p:
        browser = launch_browser(p)
        page = open_studio(browser, studio.url)
        page.locator("#f-model textarea, #f-model input").first.fill(str(broken_model(tmp_path)))
        page.locator("#f-nproc_per_node input").fill("1")  # one rank fails as two do, at half the start-up
        expect(page.locator("#train-commands")).to_contain_text("broken-model", timeout=15000)
        expect(page.locator("#train-commands")).to_contain_text("--nproc_per_node 1")
        page.locator("#launch").click()
        expect(page.locator("#launch-status")).to_contain_text("Launched run", timeout=60000)
        status = page.locator("#monitor-status")
        expect(status).to_contain_text("failed", timeout=RUN_TIMEOUT_MS)
        # Nothing to resume from: the button and its message say what it does instead.
        resume = page.locator("#monitor-resume")
        expect(resume).to_have_text("▶ Run again", timeout=15000)
        expect(resume).to_be_enabled()
        shot(page, "failed-no-checkpoint")
        resume.click()
        # The line comes once the new attempt is launched: at load 8 the studio's queue took over 60 s.
        expect(page.locator("#monitor-action")).to_contain_text(re.compile("No checkpoint .* from step 0"),
                                                                timeout=RUN_TIMEOUT_MS)
        expect(status).to_contain_text(re.compile(r"failed · run \S+ · attempt 2"), timeout=RUN_TIMEOUT_MS)
        expect(resume).to_have_text("▶ Run again")
        # the status line does not say that attempt 2 started from step 0: the line stays once it settles
        page.wait_for_timeout(3000)
        expect(page.locator("#monitor-action")).to_contain_text("No checkpoint")
        shot(page, "failed-again")
        content = page.content()
        browser.close()
    # The failure panel shows the worker's own last log lines (its traceback); none of the studio's.
    assert "failed unexpectedly" not in content
