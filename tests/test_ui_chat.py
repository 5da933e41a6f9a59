"""The Chat tab in a real browser against a real studio: a tiny LoRA run (DPO on preference pairs)
trained by the worker on this machine is loaded with its job's system prompt, one message (Enter sends it, Shift+Enter
writes a new line) is answered by the base and the fine-tuned model at once, and both answers are
shown in their chatbots; a run without a checkpoint is refused by name; a worker killed
between two messages is reported and loading again works; Clear ends an answer being streamed;
an image uploaded beside a message reaches a vision-language run's models and is shown;
stopping the studio ends its worker. The studio process never loads torch.
Screenshots: test-artifacts/ui/chat/."""
from __future__ import annotations

import os
import re
import signal

import psutil
import pytest

pytest.importorskip("playwright")
from playwright.sync_api import TimeoutError as PlaywrightTimeout, expect, sync_playwright  # noqa: E402

from backend.job.cluster import GpuInfo, local_cluster  # noqa: E402
from backend.job.spec import JobSpec  # noqa: E402
from backend.runs.manager import RunManager  # noqa: E402
from studio_server import Shots, launch_browser, open_studio, start_studio  # noqa: E402
from test_ui_flow import loaded_worker_libs  # noqa: E402
from worker import (ROOT, build_tiny_vl_model, colour_images, preference_pairs, unloadable_model, until,  # noqa: E402
                    write_video)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
ANSWER_MS = 120_000
def job(model, output_dir, **extra) -> JobSpec:
    return JobSpec(**{**dict(model=str(model), dataset=[str(ROOT / "assets" / "demo" / "train.jsonl") + "#128"],
                             output_dir=str(output_dir), nproc_per_node=1, max_steps=3, save_steps=3, logging_steps=3,
                             torch_dtype="float32", max_length=64, gradient_checkpointing=False,
                             per_device_train_batch_size=4, learning_rate=1e-2, lora_dropout=0.0,
                             env={"OMP_NUM_THREADS": "1"}), **extra})


@pytest.fixture(scope="module")
def studio_with_runs(tmp_path_factory, tiny_model):
    """A studio whose database holds a trained LoRA run (DPO) and a run that failed before its first
    checkpoint (both trained by the real worker, through a RunManager on the studio's database)."""
    root = tmp_path_factory.mktemp("chat-ui")
    broken = unloadable_model(tiny_model, root / "broken-model")
    with RunManager(f"sqlite:///{root / 'studio.db'}") as m:
        # A DPO run: the Chat tab serves a preference-trained checkpoint as it does a supervised one,
        # and its Monitor draws the rewards.
        lora = m.launch(job(tiny_model, root / "runs", train_type="lora", system="Answer briefly.", rlhf_type="dpo",
                            dataset=[preference_pairs(root / "pairs.jsonl", 32)]),
                        local_cluster(GpuInfo()), name="chat-lora")
        failed = m.launch(job(broken, root / "runs"), local_cluster(GpuInfo()), name="no-checkpoint")
        assert m.wait(failed, timeout=300).state == "failed"  # its core taken back: two ranks on two cores
        # A vision-language LoRA run (a tiny Qwen2.5-VL on pictures of coloured shapes)
        vl = m.launch(job(build_tiny_vl_model(root / "vl-model"), root / "runs", train_type="lora", max_length=96,
                          dataset=[colour_images(root / "vl-data", 8)], per_device_train_batch_size=2),
                      local_cluster(GpuInfo()), name="chat-vl")
        for run in (lora, vl):
            assert m.wait(run, timeout=300).state == "succeeded", m.run(run).message
    server = start_studio(root)
    yield server, lora, failed, vl, root / "vl-data" / "0.png"
    server.stop()


def pick(page, dropdown: str, name: str) -> None:
    page.locator(f"#{dropdown} input").click()
    page.get_by_role("option", name=re.compile(re.escape(name))).click()


def chat_workers(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True) if "launcher.chat" in p.cmdline()]


def send(page, message: str) -> None:
    page.locator("#chat-message textarea").fill(message)
    page.locator("#chat-send").click()


def test_chat_with_the_base_and_the_fine_tuned_model(studio_with_runs):
    studio, lora, failed, vl, picture = studio_with_runs
    shot = Shots("chat")
    with sync_playwright() as p:
        browser = launch_browser(p)
        page = open_studio(browser, studio.url)
        page.get_by_role("tab", name="Chat").click()

        # A run without a checkpoint: refused by name, no worker started.
        pick(page, "chat-run", failed)
        page.locator("#chat-load").click()
        expect(page.locator("#chat-status")).to_contain_text(f"run {failed} has no checkpoint yet", timeout=30_000)
        assert chat_workers(studio.proc.pid) == []
        shot(page, "no-checkpoint")

        # The trained run's latest checkpoint, LoRA applied, on this machine.
        pick(page, "chat-run", lora)
        expect(page.locator("#chat-source input")).to_have_value("latest complete checkpoint")
        page.locator("#chat-load").click()
        status = page.locator("#chat-status")
        expect(status).to_contain_text("Loaded the LoRA checkpoint", timeout=ANSWER_MS)
        expect(status).to_contain_text(f"{lora}/checkpoint-3")
        expect(status).to_contain_text("on node localhost (cpu, float32, worker pid ")
        expect(status).to_contain_text("base: the same model with its LoRA adapter disabled")
        expect(page.locator("#chat-system textarea")).to_have_value("Answer briefly.")  # the job's own
        # Sampling: the greedy answer of an untrained tiny model can be all newlines (nothing to see).
        page.locator("#chat-temperature input[type=number]").fill("1")
        page.locator("#chat-max-new-tokens input[type=number]").fill("48")
        page.locator("#chat-max-new-tokens input[type=number]").press("Tab")
        shot(page, "loaded")

        page.locator("#chat-top-p input[type=number]").fill("0.9")
        # Shift+Enter writes a new line; Enter sends.
        message = page.locator("#chat-message textarea")
        message.fill("What is 2 + 3?")
        message.press("Shift+Enter")
        message.type("Thanks.")
        expect(message).to_have_value("What is 2 + 3?\nThanks.")
        message.press("Enter")
        answers = page.locator("#chat-answers")
        expect(answers).to_contain_text(re.compile(r"Base: \d+ tokens in .* Fine-tuned: \d+ tokens in"),
                                        timeout=ANSWER_MS)
        for chatbot in ("chat-base", "chat-tuned"):
            expect(page.locator(f"#{chatbot} .message.user").last).to_contain_text("Thanks.")
            # The answer is shown: its text, or, where the sampled answer had none (a tiny model trained
            # for 3 steps may end it at once), a line that says so, never an empty bubble.
            # That it streams piece by piece is the manager's test (test_chat_e2e).
            expect(page.locator(f"#{chatbot} .message.bot").last).to_have_text(re.compile(r"\S"), timeout=30_000)
        assert page.locator("#chat-message textarea").input_value() == ""
        shot(page, "answered")

        # The worker dies between two messages: the next one says so, and loading again works.
        [worker] = chat_workers(studio.proc.pid)
        os.kill(worker.pid, signal.SIGKILL)
        send(page, "And 2 + 4?")
        expect(page.locator("#chat-answers")).to_contain_text(re.compile(r"chat worker (exited|is gone)"),
                                                              timeout=ANSWER_MS)
        expect(page.locator("#chat-answers")).to_contain_text("load the model again")
        expect(page.locator("#chat-answers")).to_contain_text(f"run {lora}")
        shot(page, "worker-died")
        page.locator("#chat-load").click()
        expect(status).not_to_contain_text(f"worker pid {worker.pid})", timeout=30_000)
        expect(status).to_contain_text("Loaded the LoRA checkpoint", timeout=ANSWER_MS)
        send(page, "And 2 + 4?")
        # Both answers stream at once and end in either order: the notes list both once both are done.
        expect(page.locator("#chat-answers")).to_contain_text(
            re.compile(r"Base: \d+ tokens in .* Fine-tuned: \d+ tokens in"), timeout=ANSWER_MS)
        expect(page.locator("#chat-tuned .message.user").last).to_contain_text("And 2 + 4?")
        shot(page, "loaded-again")

        # Clear while both answers are being generated: the exchange is cancelled (the worker is told
        # to stop generating it), nothing of it comes back, and the next message is answered alone.
        # The worker is paused until Clear is clicked, so the answer cannot finish first.
        tokens = page.locator("#chat-max-new-tokens input[type=number]")
        tokens.fill("400")
        tokens.press("Tab")
        [worker] = chat_workers(studio.proc.pid)
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            send(page, "Count to a hundred.")
            expect(page.locator("#chat-answers")).to_contain_text("Generating")
            page.locator("#chat-clear").click()
            expect(page.locator("#chat-tuned .message")).to_have_count(0)
            expect(page.locator("#chat-answers")).not_to_contain_text("Generating")
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        page.wait_for_timeout(3000)  # the 400 tokens take under a second here
        expect(page.locator("#chat-tuned .message")).to_have_count(0)
        expect(page.locator("#chat-base .message")).to_have_count(0)
        tokens.fill("8")
        tokens.press("Tab")
        send(page, "And 3 + 4?")
        expect(page.locator("#chat-answers")).to_contain_text(
            re.compile(r"Base: \d+ tokens in .* Fine-tuned: \d+ tokens in"), timeout=ANSWER_MS)
        for chatbot in ("chat-base", "chat-tuned"):
            expect(page.locator(f"#{chatbot} .message.user")).to_have_count(1)
            expect(page.locator(f"#{chatbot} .message.user")).to_contain_text("And 3 + 4?")

        # A vision-language run: an image uploaded beside the message is shown and reaches both models.
        pick(page, "chat-run", vl)
        page.locator("#chat-load").click()
        expect(status).to_contain_text("takes images and videos (upload one beside the message)", timeout=ANSWER_MS)
        expect(status).to_contain_text(f"{vl}/checkpoint-3")
        expect(page.locator("#chat-video input[type=file]")).to_have_count(1)  # a Qwen2.5-VL reads videos too
        page.locator("#chat-image input[type=file]").set_input_files(str(picture))
        expect(page.locator("#chat-image img")).to_have_count(1, timeout=30_000)
        send(page, "What colour is it?")
        expect(page.locator("#chat-answers")).to_contain_text(
            re.compile(r"Base: \d+ tokens in .* Fine-tuned: \d+ tokens in"), timeout=ANSWER_MS)
        for chatbot in ("chat-base", "chat-tuned"):
            # the message's image is drawn from the file the studio serves: late on a loaded machine
            expect(page.locator(f"#{chatbot} .message.user img")).to_have_count(1, timeout=30_000)
            expect(page.locator(f"#{chatbot} .message.user").last).to_contain_text("What colour is it?")
        # sent with the message: the box empties with the exchange's last update, which can come after the
        # notes above on a loaded machine (5 s were once too few in CI)
        expect(page.locator("#chat-image img")).to_have_count(0, timeout=30_000)
        shot(page, "image")

        page.locator("#chat-clear").click()
        expect(page.locator("#chat-tuned .message")).to_have_count(0)

        # A video uploaded beside a message goes to the worker inline. Where the worker's node can
        # build the model's video processor (torchvision matching torch) both models answer and the clip
        # is shown; where it cannot (CI's CPU torch), the answer names what to install, and the exchange
        # stays out of both conversations with the message and the video in their boxes.
        clip = write_video(picture.parent / "moving.mp4", (220, 30, 30))
        page.locator("#chat-video input[type=file]").set_input_files(str(clip))
        expect(page.locator("#chat-video video")).to_have_count(1, timeout=30_000)
        send(page, "Which colour moves?")
        answers = page.locator("#chat-answers")
        expect(answers).to_contain_text(re.compile(r"Fine-tuned: \d+ tokens in|Answering"), timeout=ANSWER_MS)
        if "Answering" in answers.inner_text():
            expect(answers).to_contain_text("the model's processor cannot be built here")
            expect(answers).to_contain_text("torchvision")
            expect(page.locator("#chat-tuned .message")).to_have_count(0)
            expect(page.locator("#chat-video video")).to_have_count(1)
        else:
            expect(page.locator("#chat-tuned .message.user video")).to_have_count(1, timeout=30_000)
        content = page.content()
        browser.close()
    assert "Traceback" not in content
    assert loaded_worker_libs(studio.proc.pid) == []
    # The studio's end is the end of its chat worker too (it reads the end of its stdin).
    [worker] = chat_workers(studio.proc.pid)
    studio.stop()
    until(lambda: not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE, timeout=30)


# Whether a chart's series are one point each, drawn as a marker that Plotly rendered (the loss's
# raw trace under its smoothed one may stay a line: the smoothed trace shows the point).
ONE_POINT_JS = """(id) => {
  const el = document.querySelector(`#${id} .js-plotly-plot`);
  if (!el || !el.data) return false;
  const traces = el.data.filter(t => (t.x || []).length);
  return traces.length > 0 && traces.every(t => t.x.length === 1)
    && traces.some(t => (t.mode || '').includes('markers'))
    && el.querySelectorAll('.scatterlayer .point').length > 0;
}"""


TRACES_JS = """(id) => {
  const el = document.querySelector(`#${id} .js-plotly-plot`);
  if (!el || !el.data) return 'no plot';
  return JSON.stringify(el.data.map(t => ({name: t.name, mode: t.mode, x: t.x})))
    + ` points drawn: ${el.querySelectorAll('.scatterlayer .point').length}`;
}"""


def test_a_series_of_one_point_is_drawn_as_its_marker(studio_with_runs):
    """The LoRA run (DPO) logged one step: its loss, learning rate, throughput and rewards each show
    that point as a marker (a line through one point draws nothing), its peak memory a bar. A studio of its own on the module's database:
    the chat test ends the module's studio."""
    shared, lora, *_ = studio_with_runs
    studio = start_studio(shared.root)
    try:
        with sync_playwright() as p:
            browser = launch_browser(p)
            page = open_studio(browser, studio.url)
            page.get_by_role("tab", name="Monitor").click()
            # The page's load puts the latest run in the picker; a pick made before that lands is
            # overwritten (seen in a suite run: the charts were the failed run's, empty).
            expect(page.locator("#monitor-run input")).to_have_value(re.compile("chat-vl"), timeout=60_000)
            pick(page, "monitor-run", lora)
            expect(page.locator("#monitor-run input")).to_have_value(re.compile("chat-lora"))
            # The charts below have one point in either run (the VL run too): the status says whose they are.
            expect(page.locator("#monitor-status")).to_contain_text(f"run {lora} ·", timeout=60_000)
            for chart in ("chart-loss", "chart-lr", "chart-throughput", "chart-preference"):
                try:
                    page.wait_for_function(ONE_POINT_JS, arg=chart, timeout=60_000)
                except PlaywrightTimeout:  # say what the page showed
                    raise AssertionError(f"{chart}: {page.evaluate(TRACES_JS, chart)}; picked: "
                                         f"{page.locator('#monitor-run input').input_value()!r}; status: "
                                         f"{page.locator('#monitor-status').inner_text()!r}; action: "
                                         f"{page.locator('#monitor-action').inner_text()!r}") from None
            # the rank's peak memory, a bar (on CPUs its resident set: no per-GPU estimate is drawn)
            rank_memory = page.locator("#chart-rank-memory")
            expect(rank_memory.locator(".barlayer .point")).to_have_count(1, timeout=60_000)
            expect(rank_memory).to_contain_text("Peak memory per rank")
            Shots("one-step-run")(page, "monitor")
            browser.close()
    finally:
        studio.stop()
