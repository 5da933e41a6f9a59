"""Chat tab: load a run's checkpoint (LoRA applied) or its exported model in a chat worker on the
run's first node (RunManager.chat_open; the studio never loads a model), then send one message to
the base and the fine-tuned model side by side and watch both answers stream in."""
from __future__ import annotations

import base64
import contextlib
import itertools
import os
from typing import Any

import gradio as gr

from backend.job.chat import MAX_IMAGE_CHARS, MAX_VIDEO_CHARS
from backend.job.chat import MODELS as SIDES
from backend.job.records import IMAGE_TAG, MEDIA_TAGS, VIDEO_TAG
from studio.context import Studio
from studio.errors import user_message
from studio.run_view import checkpoint_choices, listed_runs

LATEST = "latest complete checkpoint"
NOT_LOADED = "No model loaded: pick a run and a checkpoint, then Load."
EMPTY_ANSWER = "*(no text: the model ended this answer without writing anything visible)*"


def source_choices(checkpoints: list[tuple[int, str]], exported: str | None,
                   eval_losses: dict[int, float] | None = None) -> list[tuple[str, str] | str]:
    """The Model dropdown: the latest checkpoint, each one by step (with its eval loss, the best
    marked), and the export where there is one."""
    steps = checkpoint_choices(checkpoints, eval_losses or {})
    return [LATEST, *steps, *([(f"exported model · {exported}", exported)] if exported else [])]


def status_line(ready: dict) -> str:
    """What is loaded, where, and how the base side and the prompts are made."""
    what = {"lora": "LoRA checkpoint", "full": "full fine-tuning checkpoint", "merged": "exported model"}.get(
        ready.get("kind"), ready.get("kind"))
    skipped = "".join(f"\n\n⚠ Passed over a damaged checkpoint: {why}" for why in ready.get("skipped") or [])
    return (f"✔ Loaded the {what} `{ready.get('path')}` on node **{ready.get('node')}** ({ready.get('device')}, "
            f"{ready.get('dtype')}, worker pid {ready.get('pid')}) in {ready.get('load_s')} s · base: "
            f"{ready.get('base_from')} · prompts: "
            f"{ready.get('template')} · {ready.get('max_positions')} positions"
            f"{' · takes images' if ready.get('images') else ''}"
            f"{' and videos' if ready.get('videos') else ''}"
            f"{' (upload one beside the message)' if ready.get('images') else ''}{skipped}")


def image_mime(path: str) -> str | None:
    """An image file's type by its header (PIL's), whatever its name says; None for no image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as opened:
            return Image.MIME.get(opened.format or "")
    except (UnidentifiedImageError, OSError):
        return None


# A video container's first bytes: (offset, magic, its type). The studio need not have a video reader
# installed (the chat worker's node reads the frames).
VIDEO_MAGIC = ((4, b"ftypqt", "video/quicktime"), (4, b"ftyp", "video/mp4"), (0, b"\x1aE\xdf\xa3", "video/webm"),
               (8, b"AVI ", "video/x-msvideo"))


def video_mime(path: str) -> str | None:
    """A video file's type by its container's header (MP4 and QuickTime, Matroska and WebM, AVI),
    whatever its name says; None for any other file."""
    with open(path, "rb") as f:
        head = f.read(16)
    return next((mime for at, magic, mime in VIDEO_MAGIC if head[at:at + len(magic)] == magic), None)


def inline(field: str, path: str, mime: str | None, most: int) -> str:
    """An upload as the data: URI the worker takes (its node need not see the studio's files); a
    ValueError names the field (`Image`, `Video`) and the file."""
    name = os.path.basename(path)
    if not mime:
        raise ValueError(f"{field}: {name} is not " + ("an image file PIL can read" if field == "Image" else
                                                       "a video file (MP4, QuickTime, Matroska, WebM or AVI)"))
    head = f"data:{mime};base64,"
    size = os.path.getsize(path)
    if len(head) + 4 * -(-size // 3) > most:
        raise ValueError(f"{field}: {name} is {size / (1 << 20):.1f} MiB, more than a chat {field.lower()} may take "
                         f"({(most - len(head)) * 3 // 4 >> 20} MiB)")
    with open(path, "rb") as f:
        return head + base64.b64encode(f.read()).decode()


def user_turn(message: str, image: str | None, video: str | None = None) -> dict:
    """The user's message as the chat worker takes it; an uploaded image and video (the uploads'
    paths) go inline before the text, each a data: URI, and are shown from their uploads ("shown",
    which never leaves the studio). A ValueError names the field."""
    turn: dict = {"role": "user", "content": message}
    if video:
        turn.update(content=VIDEO_TAG + turn["content"],
                    videos=[inline("Video", video, video_mime(video), MAX_VIDEO_CHARS)])
    if image:
        turn.update(content=IMAGE_TAG + turn["content"],
                    images=[inline("Image", image, image_mime(image), MAX_IMAGE_CHARS)])
    shown = [path for path in (image, video) if path]
    return {**turn, "shown": shown} if shown else turn


def sent(turn: dict) -> dict:
    """A turn as the worker gets it (without where the studio shows its uploads from)."""
    return {k: v for k, v in turn.items() if k != "shown"}


def on_screen(turns: list[dict], answering: bool = False) -> list[dict]:
    """A chatbot's turns as shown: a user's image and video, then the text; a finished answer with no
    visible text (the model ended it at once, or wrote only spaces and newlines) says so instead of an
    empty bubble; the history keeps what the model wrote. `answering`: the last turn is still streaming."""
    last, out = len(turns) - 1, []
    for i, turn in enumerate(turns):
        text = turn["content"]
        if turn.get("shown"):
            out += [{"role": "user", "content": {"path": path}} for path in turn["shown"]]
            for name, tag in MEDIA_TAGS.items():
                text = text.replace(tag, "", len(turn.get(name, ())))
            if not text.strip():
                continue
        elif turn["role"] == "assistant" and not text.strip() and not (answering and i == last):
            text = EMPTY_ANSWER
        out.append({"role": turn["role"], "content": text})
    return out


def answer_note(side: str, done: dict) -> str:
    label = "Base" if side == "base" else "Fine-tuned"
    note = f" ({done['note']})" if done.get("note") else ""
    return f"{label}: {done.get('tokens')} tokens in {done.get('seconds')} s{note}"


def build(studio: Studio) -> dict[str, Any]:
    c: dict[str, Any] = {}
    gr.Markdown("The same message goes to the base model and to the fine-tuned one; both answers stream in side "
                "by side. The model runs in a worker on the run's first node, with the chat template training used.")
    with gr.Row():
        c["run"] = gr.Dropdown(label="Run", choices=[], scale=3, elem_id="chat-run")
        c["source"] = gr.Dropdown(label="Model", choices=[LATEST], value=LATEST, scale=3, elem_id="chat-source")
        c["load"] = gr.Button("Load", variant="primary", scale=1, elem_id="chat-load")
    c["status"] = gr.Markdown(NOT_LOADED, elem_id="chat-status")
    with gr.Row():
        c["base"] = gr.Chatbot(label="Base model", height=360, elem_id="chat-base")
        c["tuned"] = gr.Chatbot(label="Fine-tuned", height=360, elem_id="chat-tuned")
    with gr.Row():
        # One line that grows: Enter sends, Shift+Enter starts a new line (Gradio's rule for lines=1).
        c["message"] = gr.Textbox(label="Message (Enter sends, Shift+Enter for a new line)", lines=1, max_lines=8,
                                  scale=5, elem_id="chat-message")
        c["send"] = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send")
        c["image"] = gr.Image(label="Image (vision-language models)", type="filepath", sources=["upload"], height=120,
                              scale=1, elem_id="chat-image")
        c["video"] = gr.Video(label="Video (models that read videos)", sources=["upload"], height=120, scale=1,
                              elem_id="chat-video")
    c["system"] = gr.Textbox(label="System prompt (both models; Load sets the job's own)", lines=1, max_lines=4,
                             elem_id="chat-system")
    with gr.Row():
        c["max_new_tokens"] = gr.Slider(1, 1024, value=128, step=1, label="Max new tokens",
                                        elem_id="chat-max-new-tokens")
        c["temperature"] = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature (0 = greedy)",
                                     elem_id="chat-temperature")
        c["top_p"] = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p (with temperature > 0)",
                               elem_id="chat-top-p")
        c["clear"] = gr.Button("Clear", elem_id="chat-clear")
    c["answers"] = gr.Markdown(elem_id="chat-answers")
    # The browser's session id. Gradio drops a closed page's state (and so closes its worker) only an
    # hour later; a model loaded on the same node replaces it sooner, and an idle one ends by itself.
    c["session"] = gr.State(None, delete_callback=lambda sid: sid and studio.manager.chat_close(sid))
    c["history"] = gr.State({"base": [], "tuned": []})  # plain {"role", "content"} turns of each side
    return c


def wire(c: dict[str, Any], studio: Studio, tab: gr.Tab) -> None:
    def on_open(current: str | None):
        options, value, error = listed_runs(studio.manager, current)
        return (gr.skip(), error) if error else (gr.update(choices=options, value=value), gr.skip())

    def on_run(run_id: str | None):
        if not run_id:
            return gr.update(choices=[LATEST], value=LATEST), gr.skip()
        try:
            steps, losses = studio.manager.saved_checkpoints(run_id), studio.manager.checkpoint_eval_losses(run_id)
        except Exception as exc:  # noqa: BLE001
            return gr.update(choices=[LATEST], value=LATEST), user_message(f"Listing the models of run {run_id}", exc)
        try:
            exported, note = studio.manager.exported(run_id), gr.skip()
        except Exception as exc:  # noqa: BLE001 - the checkpoints stay offered
            exported, note = None, user_message(f"Looking for the export of run {run_id}", exc)
        return gr.update(choices=source_choices(steps, exported, losses), value=LATEST), note

    def on_load(run_id: str | None, source: str | None, session: str | None):
        empty = {"base": [], "tuned": []}
        if not run_id:
            yield "Pick a run first.", session, empty, [], [], gr.skip()
            return
        if session:
            studio.manager.chat_close(session)
        what = "the latest checkpoint" if source in (None, LATEST) else f"`{source}`"
        yield f"Loading {what} of run `{run_id}` on its first node…", None, empty, [], [], gr.skip()
        try:
            session, ready = studio.manager.chat_open(run_id, None if source in (None, LATEST) else source)
        except Exception as exc:  # noqa: BLE001
            yield user_message(f"Loading {what} of run {run_id}", exc), None, empty, [], [], gr.skip()
            return
        yield status_line(ready), session, empty, [], [], ready.get("system") or ""

    def on_send(message: str, image: str | None, video: str | None, history: dict, session: str | None, system: str,
                max_new_tokens: float, temperature: float, top_p: float):
        untouched = (gr.skip(),) * 6  # the chatbots, the history, the message, the image and the video as they are
        if not session:
            yield *untouched, "Load a model first."
            return
        if not (message or "").strip() and not image and not video:
            yield *untouched, "Type a message first."
            return
        try:
            user = user_turn(message or "", image, video)
        except (ValueError, OSError) as exc:
            yield *untouched, user_message("Reading the upload", exc)
            return
        asked = {side: [*history[side], user] for side in SIDES}
        shown = {side: [*turns, {"role": "assistant", "content": ""}] for side, turns in asked.items()}
        notes: dict[str, str] = {}  # shown base first, whichever finishes first
        answering = set(SIDES)

        def screens():
            return tuple(on_screen(shown[side], side in answering) for side in ("base", "tuned"))

        yield *untouched, "Generating…"
        try:
            prefix = [{"role": "system", "content": system}] if (system or "").strip() else []
            events = studio.manager.chat_reply(session, [(side, prefix + [sent(t) for t in asked[side]])
                                                         for side in SIDES],
                                               int(max_new_tokens), float(temperature), float(top_p))
            # The first event before anything is shown: a refused exchange leaves the chatbots alone.
            # Closed with this answer (Clear cancels it): the worker then stops generating it.
            with contextlib.closing(events):
                for event in itertools.chain([next(events)], events):
                    side = event["model"]
                    if event["type"] == "token":
                        shown[side][-1] = {"role": "assistant", "content": shown[side][-1]["content"] + event["text"]}
                        yield *screens(), *untouched[:4], gr.skip()
                    else:
                        answering.discard(side)
                        notes[side] = answer_note(side, event)
                        yield *screens(), *untouched[:4], " · ".join(notes[s] for s in SIDES if s in notes)
        except Exception as exc:  # noqa: BLE001
            # The turn stays out of both histories (and off the chatbots), the message and the uploads
            # in their boxes: Send asks again.
            yield (*(on_screen(history[side]) for side in ("base", "tuned")), *untouched[:4],
                   user_message("Answering", exc))
            return
        answering.clear()
        yield *screens(), shown, "", None, None, " · ".join(notes[s] for s in SIDES if s in notes)

    def on_clear():
        return [], [], {"base": [], "tuned": []}, ""

    tab.select(on_open, [c["run"]], [c["run"], c["status"]])
    c["run"].change(on_run, [c["run"]], [c["source"], c["status"]])
    send = dict(fn=on_send, inputs=[c["message"], c["image"], c["video"], c["history"], c["session"], c["system"],
                                    c["max_new_tokens"], c["temperature"], c["top_p"]],
                outputs=[c["base"], c["tuned"], c["history"], c["message"], c["image"], c["video"], c["answers"]],
                trigger_mode="once")  # a second click while answering is dropped (the session refuses one too)
    sending = [c["send"].click(**send), c["message"].submit(**send)]
    # Clear and Load end an answer being streamed (the worker stops generating it) first.
    c["clear"].click(on_clear, None, [c["base"], c["tuned"], c["history"], c["answers"]], cancels=sending)
    c["load"].click(on_load, [c["run"], c["source"], c["session"]],
                    [c["status"], c["session"], c["history"], c["base"], c["tuned"], c["system"]], cancels=sending)
