"""The chat protocol's pure parts (requests, events, prompt fitting, the rendering training uses)
and the backend session against a stand-in worker on this machine: ready and load failures, a
worker that dies mid-answer or goes silent, an exchange asked during another, idle shutdown, a stream's stdin
over real SSH. The real worker and model: tests/test_chat_e2e.py."""
from __future__ import annotations

import asyncio
import json
import sys
import time

import psutil
import pytest

from backend.cluster import ssh
from backend.runs import chat
from worker import ROOT, until

FAKE_WORKER = r"""
import json, os, sys, time
mode = sys.argv[1]
def emit(**event):
    sys.stdout.write(json.dumps(event) + "\n"); sys.stdout.flush()
if mode == "silent":
    time.sleep(60)
if mode == "fail":
    emit(type="error", id=None, error="/runs/r/checkpoint-3/model/adapter_model.safetensors: cannot be read")
    sys.exit(1)
print("a library's progress line, not an event", flush=True)
emit(type="ready", pid=os.getpid(), kind="lora")
for line in sys.stdin:
    req = json.loads(line)
    if "cancel" in req:  # kept beside the script, so the test sees it arrived
        with open(os.path.join(os.path.dirname(__file__), "cancelled"), "a") as f:
            f.write(f"{req['cancel']}\n")
        continue
    if req["max_new_tokens"] > 100:  # the real worker's answer to a request it cannot read: no id
        emit(type="error", id=None, error="request.max_new_tokens: expected an integer from 1 to 100")
        continue
    models = [turn["model"] for turn in req["turns"]]
    for piece in ("one ", "two ", "three"):  # the models of a request answer at once
        for model in models:
            emit(type="token", id=req["id"], model=model, text=piece)
            if mode == "die":
                os._exit(3)
        time.sleep(0.05)
    for turn in req["turns"]:
        emit(type="done", id=req["id"], model=turn["model"], tokens=3, seconds=0.15,
             prompt_tokens=len(turn["messages"]), note=None)
"""


# ---- the worker's pure parts ---------------------------------------------------------------------


def test_a_request_line_of_the_backend_is_what_the_worker_parses():
    from backend.job.chat import Request, parse_request

    hi = [{"role": "user", "content": "hi"}]
    line = chat.request_line("7", [("base", hi), ("tuned", hi)], 16, 0.7, 0.9)
    assert parse_request(line) == Request("7", (("base", tuple(hi)), ("tuned", tuple(hi))), 16, 0.7, 0.9)


X = [{"role": "user", "content": "x"}]
VIDEO_URI = "data:video/mp4;base64,AAAAGGZ0eXBpc29t"


@pytest.mark.parametrize("change,field", [
    ({"id": True}, "request.id"),
    ({"turns": []}, "request.turns: expected a list of 1 to 2"),
    ({"turns": [{"model": "other", "messages": X}]}, "request.turns[0].model: expected one of base, tuned, got 'other'"),
    ({"turns": [{"model": "base", "messages": X}, {"model": "base", "messages": X}]},
     "request.turns[1].model: base is asked twice"),
    ({"turns": [{"model": "base", "messages": []}]}, "request.turns[0].messages: expected a non-empty list"),
    ({"turns": [{"model": "base", "messages": [{"role": "robot", "content": "x"}]}]}, "request.turns[0].messages[0]"),
    ({"turns": [{"model": "base", "messages": [*X, {"role": "assistant", "content": "y"}]}]},
     "request.turns[0].messages[1]: the last message must be the user's"),
    ({"max_new_tokens": 0}, "request.max_new_tokens: expected an integer from 1 to 4096, got 0"),
    ({"temperature": -1}, "request.temperature: expected a number from 0 (greedy) to 5, got -1"),
    ({"top_p": 0}, "request.top_p: expected a number above 0 and at most 1, got 0"),
    ({"top_p": "high"}, "request.top_p: expected a number, got 'high'"),
    ({"turns": [{"model": "base", "messages": [{**X[0], "content": "<video>", "videos": ["/data/clip.mp4"]}]}]},
     "request.turns[0].messages[0].videos[0]: expected a data:video/...;base64, URI (a request names no file)"),
    ({"turns": [{"model": "base", "messages": [{**X[0], "content": "<video>", "videos": [VIDEO_URI[:-1] + "x" * 40]}]}]},
     "request.turns[0].messages[0].videos[0]: 0 MiB of base64, over the 0 MiB a chat video may take"),
    ({"turns": [{"model": "base", "messages": [{**X[0], "videos": [VIDEO_URI]}]}]},
     "request.turns[0].messages[0].content: 0 <video> tag(s) for 1 video(s); one tag marks where each video goes"),
    ({"turns": [{"model": "base", "messages": [{"role": "user", "content": "<video><video>", "videos": [VIDEO_URI] * 2},
                                               {"role": "assistant", "content": "y"},
                                               {"role": "user", "content": "<video>", "videos": [VIDEO_URI]}]}]},
     "request.turns[0].messages: 3 videos, more than the 2 a conversation may hold"),
    ({"turns": [{"model": "base", "messages": [{"role": "assistant", "content": "<video>", "videos": [VIDEO_URI]}, *X]}]},
     "request.turns[0].messages[0].videos: only a user's message carries videos"),
])
def test_a_bad_request_is_refused_by_field(change, field, monkeypatch):
    from backend.job.chat import MEDIA, ChatError, parse_request

    # a video's base64 limited to the URI's length, so a longer one is over it
    monkeypatch.setitem(MEDIA, "videos", (*MEDIA["videos"][:3], len(VIDEO_URI)))
    good = {"id": 1, "turns": [{"model": "base", "messages": X}]}
    with pytest.raises(ChatError) as refused:
        parse_request(json.dumps({**good, **change}))
    assert str(refused.value).startswith(field), refused.value


def test_events_are_told_from_other_lines():
    assert chat.parse_event('{"type": "token", "id": "1", "text": "a"}\n') == {"type": "token", "id": "1", "text": "a"}
    assert chat.parse_event("Loading weights: 100%\n") is None
    assert chat.parse_event('{"type": "progress"}') is None
    assert chat.parse_event("[1, 2]") is None


def turns(*contents: str, system: str | None = None) -> tuple[dict, ...]:
    roles = ["user", "assistant"] * len(contents)
    found = tuple({"role": r, "content": c} for r, c in zip(roles, contents))
    return (({"role": "system", "content": system},) if system else ()) + found


def test_a_long_conversation_loses_its_oldest_turns_and_keeps_the_system_message():
    from launcher.chat import fit_prompt

    def to_ids(messages):  # one token per character, as a stand-in for a tokenizer
        return [ord(ch) for m in messages for ch in m["content"]]

    conversation = turns("aaaa", "bbbb", "cccc", system="S")
    assert fit_prompt(to_ids, conversation, 100) == (to_ids(conversation), 0)
    ids, dropped = fit_prompt(to_ids, conversation, 6)
    assert dropped == 2 and ids == to_ids(turns("cccc", system="S"))


def test_a_message_longer_than_the_model_takes_is_refused_by_name():
    from launcher.chat import ChatError, fit_prompt, prompt_room

    with pytest.raises(ChatError, match=r"^prompt: the last message alone is 9 tokens, more than the 4 "):
        fit_prompt(lambda ms: list(range(sum(len(m["content"]) for m in ms))), turns("x" * 9), prompt_room(12, 8))
    with pytest.raises(ChatError, match=r"^request.max_new_tokens: 512 leaves no room .* 512 positions"):
        prompt_room(512, 512)


@pytest.fixture(scope="module")
def demo_tokenizer():
    from launcher.model import load_tokenizer

    return load_tokenizer(str(ROOT / "assets" / "demo" / "model"))


def test_the_prompt_is_the_training_rendering_before_the_answer(demo_tokenizer):
    """What the chat worker sends the model is, token for token, what training put before the
    assistant's response (the tokens whose labels are ignored)."""
    from backend.job.records import Record
    from launcher.chat import fit_prompt
    from launcher.data import IGNORE, encode, render

    history = turns("What is 2 + 3?", "5", "And 2 + 4?", system="You add numbers.")
    record = Record("data.jsonl:1", {"messages": [*history, {"role": "assistant", "content": "6"}]})
    sample = encode(record, demo_tokenizer, 512)
    last_answer = max(i for i, label in enumerate(sample.labels) if label == IGNORE) + 1
    ids, dropped = fit_prompt(lambda ms: render(demo_tokenizer, ms, add_generation_prompt=True), history, 512)
    assert dropped == 0 and ids == sample.input_ids[:last_answer]


def test_the_template_is_named(tmp_path, demo_tokenizer):
    from launcher.chat import template_name
    from launcher.model import load_tokenizer

    demo_tokenizer.save_pretrained(tmp_path)
    for name in ("chat_template.jinja", "chat_template.json"):
        (tmp_path / name).unlink(missing_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    bare = load_tokenizer(str(tmp_path))  # as training loads it: ChatML where there is none
    assert template_name(bare) == "ChatML, as in training"
    bare.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert template_name(bare) == "the tokenizer's own chat template, as in training"


# ---- the session, against a stand-in worker ----------------------------------------------------------


WHERE = chat.Where("r1", "the latest checkpoint", "local", "/runs/r1/logs/chat-local.log")


def start(tmp_path, mode: str, **kw) -> chat.ChatSession:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    closed = kw.pop("closed", [])
    return chat.ChatSession.start(ssh.LocalShell(), f"{sys.executable} -u {script} {mode}", WHERE, closed.append, **kw)


async def collect(session: chat.ChatSession, model: str = "tuned", max_new_tokens: int = 8) -> list[dict]:
    return [e async for e in session.reply([(model, [{"role": "user", "content": "hi"}])], max_new_tokens, 0.0)]


def test_a_session_streams_tokens_and_then_the_done_line(tmp_path):
    async def go():
        closed: list = []
        session = await start(tmp_path, "ok", closed=closed)
        assert session.ready["kind"] == "lora"
        events = await collect(session)
        again = await collect(session, "base")
        pid = session.ready["pid"]
        await session.close()
        return events, again, closed == [session], pid

    events, again, closed, pid = asyncio.run(go())
    assert [e.get("text") for e in events] == ["one ", "two ", "three", None] and events[-1]["type"] == "done"
    assert [(e["id"], e["model"]) for e in again] == [("2", "base")] * 4
    assert closed
    until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, timeout=10)


def test_a_load_failure_is_the_workers_line_and_a_silent_worker_times_out(tmp_path):
    with pytest.raises(chat.ChatError, match=r"^run r1, the latest checkpoint, node local: /runs/r/checkpoint-3/model/"
                                             r"adapter_model.safetensors: cannot be read$"):
        asyncio.run(start(tmp_path, "fail"))
    started = time.monotonic()
    with pytest.raises(chat.ChatError, match=r"did not load the model within 1 s \(its log: /runs/r1/logs/chat-local"):
        asyncio.run(start(tmp_path, "silent", ready_timeout_s=1.0))
    assert time.monotonic() - started < 10


def test_a_worker_that_dies_mid_answer_is_reported_and_the_session_ends(tmp_path):
    async def go():
        closed: list = []
        session = await start(tmp_path, "die", closed=closed)
        got: list = []
        with pytest.raises(chat.ChatError, match=r"^run r1, the latest checkpoint, node local: the chat worker exited "
                                                 r"before its answer was complete .*; load the model again$"):
            async for event in session.reply([("tuned", [{"role": "user", "content": "hi"}])], 8, 0.0):
                got.append(event)
        with pytest.raises(chat.ChatError, match=r"the chat worker has exited \(it exited before its answer was complete\)"):
            await collect(session)
        return got, closed == [session]

    got, closed = asyncio.run(go())
    assert [e["text"] for e in got] == ["one "] and closed


def test_an_exchange_streams_both_models_and_one_asked_meanwhile_is_refused(tmp_path):
    async def go():
        session = await start(tmp_path, "ok")
        turns = [("base", [{"role": "user", "content": "hi"}]), ("tuned", [{"role": "user", "content": "hi"}])]
        first = session.reply(turns, 8, 0.0)
        got = [await anext(first)]
        with pytest.raises(chat.ChatError, match=r"node local: the model is still answering the previous message"):
            await collect(session)
        got += [e async for e in first]
        after = await collect(session)  # once it has finished, the next one is answered
        await session.close()
        return got, after

    got, after = asyncio.run(go())
    assert [(e["model"], e["id"], e["type"]) for e in got] == [
        *[("base", "1", "token"), ("tuned", "1", "token")] * 3, ("base", "1", "done"), ("tuned", "1", "done")]
    assert [e["id"] for e in after] == ["2"] * 4


def test_an_idle_session_ends_its_worker(tmp_path):
    async def go():
        session = await start(tmp_path, "ok", idle_s=0.5)
        await collect(session)
        await asyncio.sleep(2.5)
        return session

    session = asyncio.run(go())
    assert session.ended == "idle for 0 s"
    pid = session.ready["pid"]
    until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, timeout=10)


@pytest.mark.e2e
def test_a_stream_over_ssh_takes_lines_and_closing_it_ends_the_command(sshd_nodes, tmp_path):
    from backend.cluster.nodes import address_of

    node = sshd_nodes.nodes()[0]
    ended = tmp_path / "ended"

    async def go():
        shell = await ssh.connect(address_of(node), sshd_nodes.known_hosts)
        stream = await shell.stream(f"while read line; do echo \"got $line\"; done; touch {ended}",
                                    stdin=True)
        lines = aiter(stream)
        await stream.write("one")
        first = await asyncio.wait_for(anext(lines), 10)
        await stream.write("two\n")
        second = await asyncio.wait_for(anext(lines), 10)
        await stream.close()
        await shell.close()
        return first, second

    assert asyncio.run(go()) == ("got one\n", "got two\n")
    until(ended.exists, timeout=10)  # the loop read the end of its input and finished


# ---- the Chat tab's pure parts -------------------------------------------------------------------


def test_the_model_choices_and_the_status_line():
    from studio.chat_tab import LATEST, answer_note, source_choices, status_line

    assert source_choices([(6, "/r/checkpoint-6"), (3, "/r/checkpoint-3")], "/r/export") == [
        LATEST, ("step 6 · /r/checkpoint-6", "6"), ("step 3 · /r/checkpoint-3", "3"),
        ("exported model · /r/export", "/r/export")]
    assert source_choices([], None) == [LATEST]
    # Evaluated checkpoints show their eval loss, the lowest marked best (a pruned one is not counted).
    saved = [(9, "/r/checkpoint-9"), (6, "/r/checkpoint-6"), (3, "/r/checkpoint-3")]
    assert source_choices(saved, None, {9: 1.25, 6: 1.1234567, 1: 0.5}) == [
        LATEST, ("step 9 · eval loss 1.25 · /r/checkpoint-9", "9"),
        ("step 6 · eval loss 1.123 (best) · /r/checkpoint-6", "6"), ("step 3 · /r/checkpoint-3", "3")]
    ready = {"kind": "lora", "path": "/r/checkpoint-6", "node": "gpu-01", "device": "NVIDIA H200", "dtype": "bfloat16",
             "pid": 42, "load_s": 3.5, "base_from": "the same model with its LoRA adapter disabled",
             "template": "ChatML, as in training", "max_positions": 512, "skipped": ["checkpoint-9/x: missing"]}
    line = status_line(ready)
    assert line.startswith("✔ Loaded the LoRA checkpoint `/r/checkpoint-6` on node **gpu-01** (NVIDIA H200, bfloat16, "
                           "worker pid 42) in 3.5 s · base: the same model with its LoRA adapter disabled · prompts: "
                           "ChatML, as in training · 512 positions")
    assert line.endswith("⚠ Passed over a damaged checkpoint: checkpoint-9/x: missing")
    assert answer_note("tuned", {"tokens": 5, "seconds": 0.2, "note": "left out the 2 oldest message(s)"}) == (
        "Fine-tuned: 5 tokens in 0.2 s (left out the 2 oldest message(s))")


def test_an_answer_without_visible_text_says_so_once_it_is_finished():
    from studio.chat_tab import EMPTY_ANSWER, on_screen

    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\n \n"},
             {"role": "user", "content": "again"}, {"role": "assistant", "content": ""}]
    assert [t["content"] for t in on_screen(turns, answering=True)] == ["hi", EMPTY_ANSWER, "again", ""]
    assert [t["content"] for t in on_screen(turns)] == ["hi", EMPTY_ANSWER, "again", EMPTY_ANSWER]
    assert turns[1]["content"] == "\n \n"  # the history keeps what the model wrote
    assert on_screen([{"role": "user", "content": " "}]) == [{"role": "user", "content": " "}]


def test_an_uploaded_image_goes_to_the_worker_inline_and_is_shown_from_its_upload(tmp_path):
    import base64

    from backend.job.chat import parse_request, request_line
    from studio.chat_tab import on_screen, sent, user_turn

    from PIL import Image

    upload = tmp_path / "cat.png"
    Image.new("RGB", (8, 8), (200, 30, 30)).save(upload)
    turn = user_turn("What is it?", str(upload))
    assert turn["content"] == "<image>What is it?" and turn["shown"] == [str(upload)]
    assert turn["images"] == ["data:image/png;base64," + base64.b64encode(upload.read_bytes()).decode()]
    # the worker gets the image's bytes, never the studio's path; the contract takes the turn
    assert "shown" not in sent(turn) and str(upload) not in request_line("1", [("base", [sent(turn)])], 8, 0.0)
    assert parse_request(request_line("1", [("base", [sent(turn)])], 8, 0.0)).turns[0][1][0]["images"] == turn["images"]
    assert on_screen([turn, {"role": "assistant", "content": "a cat"}]) == [
        {"role": "user", "content": {"path": str(upload)}}, {"role": "user", "content": "What is it?"},
        {"role": "assistant", "content": "a cat"}]
    assert on_screen([user_turn("", str(upload))]) == [{"role": "user", "content": {"path": str(upload)}}]
    assert user_turn("hi", None) == {"role": "user", "content": "hi"}
    # a video beside it: its container's header says it is one (the studio reads no frames); both
    # inline, the image's tag first, both shown
    clip = tmp_path / "clip.upload"
    clip.write_bytes(b"\0\0\0\x18ftypisom" + bytes(64))
    both = user_turn("Same colour?", str(upload), str(clip))
    assert both["content"] == "<image><video>Same colour?" and both["shown"] == [str(upload), str(clip)]
    assert both["videos"] == ["data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode()]
    assert parse_request(request_line("1", [("base", [sent(both)])], 8, 0.0)).turns[0][1][0]["videos"] == both["videos"]
    assert on_screen([both]) == [{"role": "user", "content": {"path": str(upload)}},
                                 {"role": "user", "content": {"path": str(clip)}},
                                 {"role": "user", "content": "Same colour?"}]
    with pytest.raises(ValueError, match=r"^Video: cat.png is not a video file \(MP4, QuickTime, Matroska, WebM or AVI\)$"):
        user_turn("hi", None, str(upload))
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "drawing.svg").write_text("<svg xmlns='http://www.w3.org/2000/svg'/>")
    for name in ("notes.txt", "drawing.svg"):
        with pytest.raises(ValueError, match=rf"^Image: {name} is not an image file PIL can read$"):
            user_turn("hi", str(tmp_path / name))
    # the format is the header's, whatever the name says (an upload may have none)
    from PIL import Image

    Image.new("RGB", (4, 4)).save(tmp_path / "photo", format="JPEG")
    assert user_turn("", str(tmp_path / "photo"))["images"][0].startswith("data:image/jpeg;base64,")
    # the whole URI counts against the contract's limit
    import studio.chat_tab

    uri_chars = len(user_turn("", str(tmp_path / "photo"))["images"][0])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(studio.chat_tab, "MAX_IMAGE_CHARS", uri_chars - 1)
        with pytest.raises(ValueError, match=r"^Image: photo is 0.0 MiB, more than a chat image may take"):
            user_turn("", str(tmp_path / "photo"))
        patch.setattr(studio.chat_tab, "MAX_IMAGE_CHARS", uri_chars)
        assert user_turn("", str(tmp_path / "photo"))


def test_a_reader_that_goes_away_mid_answer_leaves_the_session_serving(tmp_path):
    """A cancelled wait (Gradio cancelling the event, a caller that stops reading) must not end the
    worker's line stream: the next exchange is answered, the rest of the abandoned one skipped."""
    async def go():
        session = await start(tmp_path, "ok")
        first = session.reply([("tuned", [{"role": "user", "content": "hi"}])], 8, 0.0)
        got = [await anext(first)]
        reading = asyncio.ensure_future(anext(first))
        await asyncio.sleep(0)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        await first.aclose()
        after = await collect(session)
        await session.close()
        return got, after, session.ended

    got, after, ended = asyncio.run(go())
    assert got[0]["text"] == "one "
    assert [e.get("text") for e in after] == ["one ", "two ", "three", None] and ended == "closed"


def test_a_reader_that_goes_away_tells_the_worker_to_stop_that_answer(tmp_path):
    """Clear in the Chat tab cancels the exchange being read (Gradio closes its generator): the
    session sends the worker a cancel line for that request, and a message sent at once after it
    is answered, not refused as one asked while another is answered."""
    async def go():
        session = await start(tmp_path, "ok")
        first = session.reply([("tuned", [{"role": "user", "content": "hi"}])], 8, 0.0)
        await anext(first)
        await first.aclose()
        after = await collect(session)
        await session.close()
        return after

    after = asyncio.run(go())
    assert [e["id"] for e in after] == ["2"] * 4 and (tmp_path / "cancelled").read_text() == "1\n"


def test_a_cancel_line_ends_the_answer_the_worker_is_generating(demo_tokenizer):
    """The real worker's serving loop with the demo model: lines are read while it answers, so a
    cancel line ends request 1 at its next token (its done event says so); request 2, read meanwhile,
    is then answered in full."""
    import threading

    from transformers import AutoModelForCausalLM

    from backend.job.chat import cancel_line, request_line
    from launcher.chat import Loaded, serve

    model = AutoModelForCausalLM.from_pretrained(ROOT / "assets" / "demo" / "model").eval()
    model.generation_config.eos_token_id = None  # only max_new_tokens or the cancel ends an answer
    loaded = Loaded(model, model, demo_tokenizer, torch_cpu(), {"max_positions": 512, "system": None})
    started, events = threading.Event(), []

    def emit(event: dict) -> None:
        events.append(event)
        if event["type"] == "token":
            started.set()

    def lines():
        ask = [("tuned", [{"role": "user", "content": "Convert 6 h to min."}])]
        yield request_line("1", ask, 400, 0.0)
        assert started.wait(60)
        yield cancel_line("1")
        yield request_line("2", ask, 5, 0.0)

    serve(loaded, lines(), emit)
    done = {e["id"]: e for e in events if e["type"] == "done"}
    assert done["1"]["cancelled"] is True and done["1"]["tokens"] < 400
    assert done["2"]["tokens"] == 5 and "cancelled" not in done["2"]


def torch_cpu():
    import torch

    return torch.device("cpu")


def test_an_error_about_an_unreadable_request_reaches_the_one_who_asked(tmp_path):
    async def go():
        session = await start(tmp_path, "ok", event_timeout_s=5.0)
        started = time.monotonic()
        with pytest.raises(chat.ChatError, match=r"node local: request.max_new_tokens: expected an integer"):
            await collect(session, max_new_tokens=500)
        waited = time.monotonic() - started
        after = await collect(session)
        await session.close()
        return waited, after

    waited, after = asyncio.run(go())
    assert waited < 3 and after[-1]["type"] == "done"


def test_the_worker_puts_the_id_on_the_error_of_a_request_it_cannot_read():
    from backend.job.chat import request_id

    assert request_id('{"id": 7, "max_new_tokens": 5000}') == "7"
    assert request_id('{"id": "a"}') == "a"
    assert request_id("not json") is None and request_id("[1]") is None and request_id('{"id": true}') is None


def test_a_trimmed_conversation_starts_with_the_users_turn():
    from launcher.chat import fit_prompt

    conversation = ({"role": "user", "content": "aaaa"}, {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "cc"})
    to_ids = lambda ms: list(range(sum(len(m["content"]) for m in ms)))  # noqa: E731
    # Leaving out only the first message would fit (3 tokens) but starts with the assistant.
    assert fit_prompt(to_ids, conversation, 3) == (to_ids(conversation[2:]), 2)


def test_answers_stop_at_the_end_of_the_templates_assistant_turn(demo_tokenizer):
    from launcher.chat import stops, turn_end

    class Model:
        generation_config = type("G", (), {"eos_token_id": None})()

    assert turn_end(demo_tokenizer) == "<|im_end|>"
    end_id = demo_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert stops(Model, demo_tokenizer)["eos_token_id"] == sorted({end_id, demo_tokenizer.eos_token_id})
    # A template whose turn end is plain text: generation stops on the text.
    template = demo_tokenizer.chat_template
    demo_tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}[END]{% endfor %}"
    try:
        assert turn_end(demo_tokenizer) == "[END]"
        assert stops(Model, demo_tokenizer)["stop_strings"] == ["[END]"]
    finally:
        demo_tokenizer.chat_template = template
