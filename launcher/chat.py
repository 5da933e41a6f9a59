"""Chat with a trained model and with its base, side by side:

    python -m launcher.chat --run-dir DIR [--checkpoint latest|STEP|PATH]

PATH is a checkpoint directory or an export directory (one holding the export marker). The model
is loaded once (CUDA in bf16 when there is a GPU, else the CPU in fp32); then each JSON line on
stdin is one request, answered one at a time, and every line on stdout is one JSON event. The
worker exits when stdin closes. The lines (docs/architecture.md, "Chat worker"):

    out {"type": "ready", "source", "path", "kind", "base", "base_from", "device", "dtype", "template",
         "max_positions", "load_s", "pid", "skipped", "system", "images", "videos"}
    in  {"id", "turns": [{"model": "base"|"tuned", "messages": [{"role", "content", "images"?, "videos"?}, ...]},
         ...], "max_new_tokens", "temperature", "top_p"}
        (a user message's "images": data:image URIs, one `<image>` tag in its content for each; "videos":
        data:video URIs, one `<video>` tag each; a vision-language model only, videos one that reads them)
    out {"type": "token", "id", "model", "text"} ... and for each model {"type": "done", "id", "model", "tokens",
         "seconds", "prompt_tokens", "note"}; the models of one request answer at once, their events interleaved
    out {"type": "error", "id" (null for a load failure or a line that is no request), "error"}
    in  {"cancel": id}: that request's answer ends where it is (read while it is being answered);
        its done events say "cancelled": true

Prompts are rendered exactly as training renders a conversation before an assistant turn
(`launcher.data.render` with the generation prompt, the job's `system` prompt first where the
conversation has none), so a fine-tuned model sees its own format.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from backend.job.chat import EXPORT_MARKER, ChatError, Request, cancelled_id, parse_request, request_id
from backend.job.errors import UserError
from backend.job.records import IMAGE_TAG, MEDIA_TAGS, VIDEO_TAG, DataError, with_system
from launcher import checkpoint
from launcher.data import DEFAULT_CHAT_TEMPLATE, IGNORE, expand_media, render
from launcher.export import ExportError, base_model, is_lora, trained_model

# ---- requests and prompts (pure) ----------------------------------------------------------------


def fit_prompt(to_ids: Callable[[list[dict]], list[int]], messages: tuple[dict, ...], room: int
               ) -> tuple[list[int], int]:
    """(token ids, how many of the oldest messages were left out) of the longest ending of the
    conversation that fits in `room` tokens; a leading system message is kept. A ChatError when
    even the last user message alone does not fit."""
    system = list(messages[:1]) if messages[0]["role"] == "system" else []
    turns = list(messages[len(system):])
    for dropped in range(len(turns)):
        if turns[dropped]["role"] != "user":
            continue  # a conversation resumes with the user's turn: templates that alternate roles require it
        ids = to_ids(system + turns[dropped:])
        if len(ids) <= room:
            return ids, dropped
    raise ChatError(f"prompt: the last message alone is {len(ids)} tokens, more than the {room} the model has "
                    "room for (its positions less max_new_tokens); shorten it or lower max new tokens")


class Clips:
    """A chat's inline videos as files, which the video reader opens: each written once, named by its
    content's hash, in a directory of this worker's own that `close` removes; the CLIPS_KEPT last
    used are kept (a long session sends more)."""

    def __init__(self):
        self.root: str | None = None
        self.kept: list[str] = []

    def path(self, uri: str) -> str:
        import base64
        import binascii
        import hashlib
        import tempfile

        try:
            raw = base64.b64decode(uri.split(",", 1)[1], validate=True)
        except (binascii.Error, ValueError):
            raise ChatError("videos: a video's data: URI is not base64") from None
        if self.root is None:
            self.root = tempfile.mkdtemp(prefix="swift-studio-chat-")
        path = os.path.join(self.root, hashlib.sha256(raw).hexdigest())
        if path in self.kept:
            self.kept.remove(path)
        else:
            with open(path + ".part", "wb") as f:
                f.write(raw)
            os.replace(path + ".part", path)
        self.kept.append(path)
        while len(self.kept) > CLIPS_KEPT:
            os.remove(self.kept.pop(0))
        return path

    def close(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


CLIPS_KEPT = 8


def message_media(message: dict, clips: Clips) -> list[str]:
    """A message's images (data: URIs) and videos (their clips' paths) in the order of their tags."""
    queues = {IMAGE_TAG: iter(message.get("images", ())),
              VIDEO_TAG: iter([clips.path(uri) for uri in message.get("videos", ())])}
    tags = [tag for name, tag in MEDIA_TAGS.items() if message.get(name)]
    return [next(queues[tag]) for tag in re.findall("|".join(map(re.escape, tags)), message["content"])] if tags else []


def prompt_ids(tokenizer, images, messages: list[dict], clips: Clips) -> list[int]:
    """A conversation's prompt ids as training renders it; a vision-language model's images and videos
    (`images`: its `launcher.vision.Images`; `clips`: where inline videos are written) as their
    placeholder tokens."""
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    if not any(m.get("images") or m.get("videos") for m in messages):
        return render(tokenizer, plain, add_generation_prompt=True)
    if images is None:
        raise ChatError("images: the loaded model takes no images (not a vision-language model, or its "
                        "image processor could not be read)")
    if any(m.get("videos") for m in messages) and images.video_token_id is None:
        raise ChatError("videos: the loaded model reads no videos (images only)")
    from launcher.vision import with_image_parts

    # Only a message that carries images or videos has its tags made parts: "<image>" written in any
    # other message (an answer about the tag, a system prompt) stays text.
    ids = render(tokenizer, [with_image_parts([p], videos=bool(m.get("videos")))[0] if m.get("images") or m.get("videos")
                             else p for m, p in zip(messages, plain)], add_generation_prompt=True)
    try:
        for image in (image for m in messages for image in m.get("images", ())):
            image_size(image)
        media = [path for m in messages for path in message_media(m, clips)]
        return expand_media("chat message", ids, [IGNORE] * len(ids), media, images)[0]
    except DataError as exc:  # an image PIL cannot read, or too large; a video PyAV cannot read
        raise ChatError(str(exc)) from None


# A chat image's pixels before the processor scales it down (a 7000 x 7000 photo; PIL itself only
# warns below 179 megapixels, and decoding one that size takes gigabytes).
MAX_CHAT_PIXELS = 50_000_000


def image_size(image: str) -> tuple[int, int]:
    """The size an inline image's header gives; a DataError for one past MAX_CHAT_PIXELS (before its
    pixels are decoded)."""
    from backend.job.records import open_image, shown_image

    with open_image("chat message", image) as opened:
        width, height = opened.size
    if width * height > MAX_CHAT_PIXELS:
        raise DataError(f"chat message: image {shown_image(image)} is {width} x {height} pixels, more than the "
                        f"{MAX_CHAT_PIXELS // 1_000_000} million a chat image may have; scale it down")
    return width, height


def prompt_room(max_positions: int | None, max_new_tokens: int) -> int:
    """Tokens a prompt may take so that prompt + answer fit the model's positions."""
    if max_positions is None:
        return sys.maxsize
    if max_new_tokens >= max_positions:
        raise ChatError(f"request.max_new_tokens: {max_new_tokens} leaves no room for a prompt in the model's "
                        f"{max_positions} positions (max_position_embeddings)")
    return max_positions - max_new_tokens


def template_name(tokenizer) -> str:
    """Which chat template renders the prompts: the one training used (`launcher.model.load_tokenizer`
    gives a tokenizer without one ChatML; a checkpoint's tokenizer was saved with it)."""
    if getattr(tokenizer, "chat_template", None) in (None, "", DEFAULT_CHAT_TEMPLATE):
        return "ChatML, as in training"
    return "the tokenizer's own chat template, as in training"


# ---- loading --------------------------------------------------------------------------------------


@dataclass
class Loaded:
    tuned: torch.nn.Module
    base: torch.nn.Module | None  # None: the tuned model with its LoRA adapter disabled
    tokenizer: object
    device: torch.device
    info: dict
    images: object = None  # a vision-language model's `launcher.vision.Images`
    clips: Clips = field(default_factory=Clips)

    @property
    def adapted_vision(self) -> bool:
        """Whether a LoRA model has adapters in its vision tower or aligner."""
        if self.base is not None or self.images is None:
            return False
        from launcher.vision import vision_parts

        vit, aligner, _ = vision_parts(self.tuned)
        return any("lora_" in name for part in vit + aligner for name, _ in part.named_parameters())

    def model(self, which: str):
        """The separate module answering as `which` (a LoRA checkpoint's base is its own rows of a
        batch with the adapter off: `answer`)."""
        return self.base if which == "base" and self.base is not None else self.tuned


def device_and_dtype() -> tuple[torch.device, torch.dtype]:
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.device("cpu"), torch.float32


def run_spec(where: Path):
    from backend.job.spec import load_spec

    spec, problems = load_spec(where / "job.yaml")
    if spec is None:
        raise ChatError(f"{where / 'job.yaml'}: " + "; ".join(map(str, problems)))
    return spec


def load(run_dir: Path, ref: str | None) -> Loaded:
    """The fine-tuned model of a checkpoint or export and the base to compare it with."""
    from launcher.model import load_tokenizer
    from launcher.vision import Images, is_vision

    started = time.monotonic()
    device, dtype = device_and_dtype()
    path = Path(ref) if ref and not str(ref).isdigit() and ref != "latest" else None
    skipped: tuple[str, ...] = ()
    if path is not None and (path / EXPORT_MARKER).is_file():
        spec = run_spec(run_dir)
        tuned = _from_export(path, dtype)
        base = base_model(spec.model, dtype)
        tokenizer_dir, source, kind = path, "export", "merged"
    else:
        try:
            found = checkpoint.resolve(run_dir, ref)
        except checkpoint.CheckpointError as exc:
            raise ChatError(str(exc)) from None
        if found.path is None:
            raise ChatError(f"{run_dir}: no complete checkpoint to chat with (the run has not saved one yet)")
        path, skipped = found.path, found.skipped
        spec = run_spec(path)
        tuned = trained_model(path, spec.model, dtype)
        lora = is_lora(path)
        base = None if lora else base_model(spec.model, dtype)
        tokenizer_dir, source, kind = path / "tokenizer", "checkpoint", "lora" if lora else "full"
    tokenizer = load_tokenizer(str(tokenizer_dir))  # ChatML where it has no template, as training did
    images = None
    if is_vision(tuned.config):  # an export holds its image processor; a checkpoint's is its base's
        try:
            images = Images(str(path), tuned.config) if source == "export" else Images.of(spec.model, tuned.config, spec)
        except (OSError, ValueError, UserError):  # no image processor beside it: text chat still works
            images = None
    for model in (tuned, base):
        if model is not None:
            model.to(device).eval()
    # a vision-language model's is its language model's
    max_positions = getattr(getattr(tuned.config, "text_config", None) or tuned.config, "max_position_embeddings", None)
    info = {"source": source, "path": str(path), "kind": kind, "base": spec.model,
            "base_from": "the same model with its LoRA adapter disabled" if base is None else spec.model,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": str(dtype).removeprefix("torch."), "template": template_name(tokenizer),
            "max_positions": max_positions, "load_s": round(time.monotonic() - started, 2), "pid": os.getpid(),
            "skipped": list(skipped), "system": spec.system, "images": images is not None,
            "videos": images is not None and images.video_token_id is not None}
    return Loaded(tuned, base, tokenizer, device, info, images)


def _from_export(path: Path, dtype: torch.dtype):
    from safetensors import SafetensorError

    from launcher.vision import auto_class

    try:
        return auto_class(str(path)).from_pretrained(path, dtype=dtype, use_safetensors=True)
    except (OSError, ValueError, SafetensorError) as exc:
        files = ", ".join(sorted(p.name for p in path.glob("*.safetensors"))) or "no *.safetensors"
        raise ChatError(f"{path}: the exported model cannot be loaded ({files}: {exc})") from None


# ---- answering ------------------------------------------------------------------------------------


def answer(loaded: Loaded, request: Request, emit: Callable[[dict], None],
           cancelled: Callable[[], bool] = lambda: False) -> None:
    """Each model's token events as it generates them, all models at once, then its done event.
    A LoRA checkpoint answers as one batch whose base rows run with the adapter off (peft's
    `adapter_names`); separate base and tuned models each generate on a thread of their own.
    Generation ends at the next token once `cancelled()` says so."""
    tokenizer = loaded.tokenizer
    room = prompt_room(loaded.info["max_positions"], request.max_new_tokens)
    prompts, pictures = [], []
    for model, messages in request.turns:  # both models are asked as training asked
        asked = tuple(with_system(messages, loaded.info["system"]))
        ids, dropped = fit_prompt(lambda conversation: prompt_ids(tokenizer, loaded.images, conversation, loaded.clips),
                                  asked, room)
        prompts.append((ids, dropped))
        kept = asked[dropped + (asked[0]["role"] == "system"):]  # the media of the messages left out go too
        pictures.append([path for m in kept for path in message_media(m, loaded.clips)])
    models = [model for model, _ in request.turns]
    started = time.monotonic()

    def on_text(row: int, text: str) -> None:
        emit({"type": "token", "id": request.id, "model": models[row], "text": text})

    def on_end(row: int, tokens: int) -> None:
        ids, dropped = prompts[row]
        note = (f"left out the {dropped} oldest message(s): the conversation is longer than the {room} tokens "
                "the model has room for" if dropped else None)
        emit({"type": "done", "id": request.id, "model": models[row], "tokens": tokens,
              "seconds": round(time.monotonic() - started, 3), "prompt_tokens": len(ids), "note": note,
              **({"cancelled": True} if cancelled() else {})})

    rows = [ids for ids, _ in prompts]

    def media(of: list[int]) -> dict:
        """The pixels of rows `of`'s images and videos, in row order, as the model takes them."""
        try:
            shown = [found for row in of for found in loaded.images.media("chat message", rows[row], pictures[row])] \
                if loaded.images is not None else []
            return loaded.images.pixels(shown, "chat message") if shown else {}
        except DataError as exc:
            raise ChatError(str(exc)) from None

    if loaded.base is None and loaded.adapted_vision and any(pictures):
        # peft's per-row adapters take one row per prompt, and a tower takes its patches as rows:
        # with adapters in the tower, each model answers alone, the base with the adapter off
        for row, model in enumerate(models):
            with loaded.tuned.disable_adapter() if model == "base" else contextlib.nullcontext():
                generate_rows(loaded.tuned, tokenizer, [rows[row]], request, loaded.device,
                              lambda _, text: on_text(row, text), lambda _, tokens: on_end(row, tokens), cancelled,
                              media=media([row]), images=loaded.images)
        return
    if loaded.base is None:
        adapter = loaded.tuned.active_adapter
        generate_rows(loaded.tuned, tokenizer, rows, request, loaded.device, on_text, on_end, cancelled,
                      adapter_names=["__base__" if model == "base" else adapter for model in models],
                      media=media(list(range(len(rows)))), images=loaded.images)
        return
    errors: list[BaseException] = []

    def work(row: int) -> None:
        try:
            generate_rows(loaded.model(models[row]), tokenizer, [rows[row]], request, loaded.device,
                          lambda _, text: on_text(row, text), lambda _, tokens: on_end(row, tokens), cancelled,
                          media=media([row]), images=loaded.images)
        except BaseException as exc:  # noqa: BLE001 - raised again below, on the serving thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(row,), name=f"generate-{model}", daemon=True)
               for row, model in enumerate(models)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


class RowStreamer:
    """generate()'s new tokens of each row of a batch, decoded as they come (generate's streamer
    interface): `on_text(row, text)` for each new piece of text, `on_end(row, tokens)` once per row
    when it has ended (an end token, or the end of generate)."""

    def __init__(self, tokenizer, rows: int, end_ids: set[int], on_text, on_end):
        self.tokenizer, self.end_ids, self.on_text, self.on_end = tokenizer, end_ids, on_text, on_end
        self.ids: list[list[int]] = [[] for _ in range(rows)]
        self.sent = [0] * rows
        self.ended = [False] * rows
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate hands the prompt over first
            self.prompt_seen = True
            return
        for row, token in enumerate(value.reshape(len(self.ids), -1)[:, -1].tolist()):
            if self.ended[row]:
                continue  # generate pads a finished row
            self.ids[row].append(token)
            if token in self.end_ids:
                self._end(row)
            else:
                self._flush(row, final=False)

    def end(self) -> None:
        for row in range(len(self.ids)):
            if not self.ended[row]:
                self._end(row)

    def _flush(self, row: int, final: bool) -> None:
        text = self.tokenizer.decode(self.ids[row], skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return  # a character whose bytes are not all generated yet
        if len(text) > self.sent[row]:
            self.on_text(row, text[self.sent[row]:])
            self.sent[row] = len(text)

    def _end(self, row: int) -> None:
        self._flush(row, final=True)
        self.ended[row] = True
        self.on_end(row, len(self.ids[row]))


class Cancelled(StoppingCriteria):
    """generate() ends every row at the next token once `cancelled()` says so."""

    def __init__(self, cancelled: Callable[[], bool]):
        self.cancelled = cancelled

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.cancelled(), dtype=torch.bool, device=input_ids.device)


def generate_rows(model, tokenizer, rows: list[list[int]], request: Request, device: torch.device,
                  on_text: Callable[[int, str], None], on_end: Callable[[int, int], None],
                  cancelled: Callable[[], bool], adapter_names: list[str] | None = None, media: dict | None = None,
                  images=None) -> None:
    """`model.generate` over the prompts `rows` (left-padded into one batch), each row's text and
    end handed over as they come (`RowStreamer`), until `cancelled()`. `media`: the rows' images'
    pixel inputs, with what the model takes beside them (`images`, launcher.vision.Images: the
    token types of Qwen's placeholders), as in training."""
    width = max(map(len, rows))
    # Without a pad token, the end token pads (as transformers does): a real token never ends a row.
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in rows], device=device)
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows], device=device)
    sampling = dict(do_sample=True, temperature=request.temperature, top_p=request.top_p) \
        if request.temperature > 0 else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    stopping = stops(model, tokenizer)
    # A row's pad token ends it too: generate pads the rows that have finished.
    streamer = RowStreamer(tokenizer, len(rows), {*stopping["eos_token_id"], pad}, on_text, on_end)
    if media:
        media = {**{k: v.to(device) for k, v in media.items()}, **images.inputs(input_ids)}
    with torch.no_grad():
        model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=request.max_new_tokens, **(media or {}),
                       streamer=streamer, pad_token_id=pad, **stopping, **sampling,
                       stopping_criteria=StoppingCriteriaList([Cancelled(cancelled)]),
                       **({"adapter_names": adapter_names} if adapter_names else {}))


def turn_end(tokenizer) -> str:
    """What the chat template writes after an assistant's answer (ChatML's `<|im_end|>`, Llama 3's
    `<|eot_id|>`), which ends a generated answer; empty where it writes nothing."""
    marker = "\u2063answer\u2063"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}],
                                             tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses this probe (jinja's own errors): no end text
        return ""
    return text.split(marker, 1)[1].strip() if marker in text else ""


def stops(model, tokenizer) -> dict:
    """generate()'s stopping arguments: the model's own end tokens and the tokenizer's, and the end
    of an assistant turn in the template (as a token where it is one, else as text), so an answer
    does not run on into turns the model invents."""
    configured = model.generation_config.eos_token_id
    ids = set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    ids.add(tokenizer.eos_token_id)
    end = turn_end(tokenizer)
    end_id = tokenizer.convert_tokens_to_ids(end) if end else None
    if end_id is not None and end_id != tokenizer.unk_token_id:
        ids.add(end_id)
        end = ""
    return {"eos_token_id": sorted(i for i in ids if i is not None),
            **({"stop_strings": [end], "tokenizer": tokenizer} if end else {})}


def serve(loaded: Loaded, lines: Iterable[str], emit: Callable[[dict], None]) -> None:
    """Answer each request line in turn; a failed request is reported and the next one served. The
    lines are read on a thread of their own, so a cancel line reaches the answer it ends."""
    requests: queue.Queue[str | None] = queue.Queue()
    cancelled: set[str] = set()

    def read() -> None:
        try:
            for line in lines:
                rid = cancelled_id(line)
                if rid is not None:
                    cancelled.add(rid)
                elif line.strip():
                    requests.put(line)
        finally:
            requests.put(None)

    threading.Thread(target=read, name="requests", daemon=True).start()
    while (line := requests.get()) is not None:
        rid = request_id(line)
        try:
            answer(loaded, parse_request(line), emit, lambda: rid in cancelled)
        except ChatError as exc:
            emit({"type": "error", "id": rid, "error": str(exc)})
        except Exception as exc:  # noqa: BLE001 - out of memory, a library's refusal: the worker serves on
            emit({"type": "error", "id": rid, "error": f"{type(exc).__name__}: {exc}"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launcher.chat", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--checkpoint", default=None,
                        help="step number, checkpoint directory or export directory (default: latest)")
    args = parser.parse_args(argv)
    out = sys.stdout
    lock = threading.Lock()

    def emit(event: dict) -> None:
        with lock:
            out.write(json.dumps({**event, "time": time.time()}) + "\n")
            out.flush()

    # Libraries print progress to stdout; the contract keeps stdout to the event lines.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            loaded = load(args.run_dir, args.checkpoint)
        except (ChatError, ExportError, checkpoint.CheckpointError, UserError) as exc:
            emit({"type": "error", "id": None, "error": str(exc)})
            return 1
        except Exception as exc:  # noqa: BLE001 - a load failure is one line naming the cause, as the contract says
            emit({"type": "error", "id": None, "error": f"loading {args.checkpoint or 'latest'} of {args.run_dir} "
                                                       f"failed: {type(exc).__name__}: {exc}"})
            return 1
        emit({"type": "ready", **loaded.info})
        try:
            serve(loaded, sys.stdin, emit)
        except BrokenPipeError:  # the studio went away mid-answer
            return 0
        finally:
            loaded.clips.close()
    return 0


if __name__ == "__main__":
    from launcher.leave import leave

    leave(main())
