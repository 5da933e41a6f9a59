"""The chat worker's contract (launcher.chat, spoken to by backend.runs.chat): the models a request
may ask, its request line and its parse, the event lines; and where an export lives, which the
worker loads and the backend offers. Pure: both sides import it."""
from __future__ import annotations

import json
from dataclasses import dataclass

MODELS = ("base", "tuned")
ROLES = ("system", "user", "assistant")
MAX_NEW_TOKENS = 4096
MAX_TEMPERATURE = 5.0
EVENT_TYPES = ("ready", "token", "done", "error")

EXPORT_MARKER = ".swift-studio-export"  # in every export: only a directory holding it is ever replaced
EXPORT_DIR = "export"  # launcher.export's default target, in the run directory


class ChatError(Exception):
    """A chat request or model the chat worker cannot serve; the message names the field or file.
    (Not a UserError: those are the training worker's, each with a cause in backend.telemetry.logclass.)"""


@dataclass(frozen=True)
class Request:
    id: str
    model: str
    messages: tuple[dict, ...]
    max_new_tokens: int
    temperature: float


def request_line(rid: str, model: str, messages: list[dict], max_new_tokens: int, temperature: float) -> str:
    return json.dumps({"id": rid, "model": model, "messages": messages, "max_new_tokens": int(max_new_tokens),
                       "temperature": float(temperature)}) + "\n"


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
    if data.get("model") not in MODELS:
        raise ChatError(f"request.model: expected one of {', '.join(MODELS)}, got {data.get('model')!r}")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatError("request.messages: expected a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ChatError(f"request.messages[{i}]: expected {{'role': {'|'.join(ROLES)}, 'content': text}}")
    if messages[-1]["role"] != "user":
        raise ChatError(f"request.messages[{len(messages) - 1}]: the last message must be the user's")
    tokens = data.get("max_new_tokens", 128)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 1 <= tokens <= MAX_NEW_TOKENS:
        raise ChatError(f"request.max_new_tokens: expected an integer from 1 to {MAX_NEW_TOKENS}, got {tokens!r}")
    temperature = data.get("temperature", 0.0)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) \
            or not 0 <= temperature <= MAX_TEMPERATURE:
        raise ChatError(f"request.temperature: expected a number from 0 (greedy) to {MAX_TEMPERATURE:g}, "
                        f"got {temperature!r}")
    return Request(str(rid), data["model"], tuple({"role": m["role"], "content": m["content"]} for m in messages),
                   tokens, float(temperature))


def parse_event(line: str) -> dict | None:
    """A worker event, or None for a line that is none (a library writing to stdout)."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if not isinstance(event, dict) or event.get("type") not in EVENT_TYPES:
        return None
    return event
