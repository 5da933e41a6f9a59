"""The chat worker's contract (launcher.chat, spoken to by backend.runs.chat): the models a request
may ask, its request line and its parse, the event lines; and where an export lives, which the
worker loads and the backend offers. Pure: both sides import it."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from backend.job.records import IMAGE_TAG, VIDEO_TAG

MODELS = ("base", "tuned")
ROLES = ("system", "user", "assistant")
MAX_NEW_TOKENS = 4096
MAX_TEMPERATURE = 5.0
EVENT_TYPES = ("ready", "token", "done", "error")

# A user message's images and videos: inline data: URIs only (a request never names a file on the
# node), each as many base64 characters as a 12 MiB image or a 24 MiB clip takes, a few to a conversation.
MAX_IMAGES = 4
MAX_IMAGE_CHARS = 16 << 20
MAX_VIDEOS = 2
MAX_VIDEO_CHARS = 32 << 20
MEDIA = {"images": ("data:image/", IMAGE_TAG, MAX_IMAGES, MAX_IMAGE_CHARS),
         "videos": ("data:video/", VIDEO_TAG, MAX_VIDEOS, MAX_VIDEO_CHARS)}
"""A message's media field: (its URIs' prefix, its tag, the most a conversation holds, the most base64
characters one takes)."""
EXPORT_MARKER = ".swift-studio-export"  # in every export: only a directory holding it is ever replaced
EXPORT_DIR = "export"  # launcher.export's default target, in the run directory


class ChatError(Exception):
    """A chat request or model the chat worker cannot serve; the message names the field or file.
    (Not a UserError: those are the training worker's, each with a cause in backend.telemetry.logclass.)"""


@dataclass(frozen=True)
class Request:
    """One exchange: each model's conversation (answered at once, side by side) and the sampling."""

    id: str
    turns: tuple[tuple[str, tuple[dict, ...]], ...]  # (model, messages), one per model
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0


def request_line(rid: str, turns: Sequence[tuple[str, list[dict]]], max_new_tokens: int, temperature: float,
                 top_p: float = 1.0) -> str:
    return json.dumps({"id": rid, "turns": [{"model": model, "messages": messages} for model, messages in turns],
                       "max_new_tokens": int(max_new_tokens), "temperature": float(temperature),
                       "top_p": float(top_p)}) + "\n"


def cancel_line(rid: str) -> str:
    """Ends request `rid`'s answer where it is (its asker went away: Clear, a closed page)."""
    return json.dumps({"cancel": rid}) + "\n"


def cancelled_id(line: str) -> str | None:
    """The request a cancel line names; None for any other line."""
    try:
        data = json.loads(line)
    except ValueError:
        return None
    rid = data.get("cancel") if isinstance(data, dict) and set(data) == {"cancel"} else None
    return str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None


def request_id(line: str) -> str | None:
    """The id of a request line however wrong the rest is, so its error reaches the one who asked."""
    try:
        rid = json.loads(line).get("id")
    except (ValueError, AttributeError):
        return None
    return str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None


def parse_request(line: str) -> Request:
    """A request line, or a ChatError naming the field that is wrong."""
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise ChatError(f"request: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ChatError("request: expected a JSON object")
    rid = data.get("id")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise ChatError("request.id: expected a string or an integer")
    turns = data.get("turns")
    if not isinstance(turns, list) or not turns or len(turns) > len(MODELS):
        raise ChatError(f"request.turns: expected a list of 1 to {len(MODELS)} {{'model', 'messages'}}")
    parsed = []
    for t, turn in enumerate(turns):
        where = f"request.turns[{t}]"
        if not isinstance(turn, dict) or turn.get("model") not in MODELS:
            raise ChatError(f"{where}.model: expected one of {', '.join(MODELS)}, got "
                            f"{turn.get('model') if isinstance(turn, dict) else turn!r}")
        if any(model == turn["model"] for model, _ in parsed):
            raise ChatError(f"{where}.model: {turn['model']} is asked twice")
        parsed.append((turn["model"], _messages(where, turn.get("messages"))))
    tokens = data.get("max_new_tokens", 128)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 1 <= tokens <= MAX_NEW_TOKENS:
        raise ChatError(f"request.max_new_tokens: expected an integer from 1 to {MAX_NEW_TOKENS}, got {tokens!r}")
    temperature = _number(data, "temperature", 0.0)
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise ChatError(f"request.temperature: expected a number from 0 (greedy) to {MAX_TEMPERATURE:g}, "
                        f"got {data['temperature']!r}")
    top_p = _number(data, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise ChatError(f"request.top_p: expected a number above 0 and at most 1, got {data['top_p']!r}")
    return Request(str(rid), tuple(parsed), tokens, temperature, top_p)


def _number(data: dict, name: str, default: float) -> float:
    value = data.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise ChatError(f"request.{name}: expected a number, got {value!r}")
    return float(value)


def _messages(where: str, messages) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"{where}.messages: expected a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ChatError(f"{where}.messages[{i}]: expected {{'role': {'|'.join(ROLES)}, 'content': text}}")
    if messages[-1]["role"] != "user":
        raise ChatError(f"{where}.messages[{len(messages) - 1}]: the last message must be the user's")
    parsed = tuple({"role": m["role"], "content": m["content"],
                    **{field: _media(f"{where}.messages[{i}]", m, field) for field in MEDIA if field in m}}
                   for i, m in enumerate(messages))
    for field, (_, _, most, _) in MEDIA.items():
        count = sum(len(m.get(field, ())) for m in parsed)
        if count > most:  # each is decoded for every answer: a conversation holds a few
            raise ChatError(f"{where}.messages: {count} {field}, more than the {most} a conversation may hold; "
                            "start a new one (Clear)")
    return parsed


def _media(where: str, message: dict, field: str) -> list[str]:
    """A user message's images or videos (`field`; ms-swift's records: one `<image>` or `<video>` tag
    in its text for each)."""
    prefix, tag, most, chars = MEDIA[field]
    media, kind = message[field], field[:-1]
    if message["role"] != "user":
        raise ChatError(f"{where}.{field}: only a user's message carries {field}")
    if not isinstance(media, list) or not 1 <= len(media) <= most:
        raise ChatError(f"{where}.{field}: expected a list of 1 to {most} {prefix.rstrip('/')} URIs")
    for j, uri in enumerate(media):
        if not isinstance(uri, str) or not uri.startswith(prefix) or ";base64," not in uri[:64]:
            raise ChatError(f"{where}.{field}[{j}]: expected a {prefix}...;base64, URI (a request names no file)")
        if len(uri) > chars:
            raise ChatError(f"{where}.{field}[{j}]: {len(uri) >> 20} MiB of base64, over the "
                            f"{chars >> 20} MiB a chat {kind} may take")
    tags = message["content"].count(tag)
    if tags != len(media):
        raise ChatError(f"{where}.content: {tags} {tag} tag(s) for {len(media)} {kind}(s); one tag marks "
                        f"where each {kind} goes")
    return list(media)


def parse_event(line: str) -> dict | None:
    """A worker event, or None for a line that is none (a library writing to stdout)."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if not isinstance(event, dict) or event.get("type") not in EVENT_TYPES:
        return None
    return event
