"""Chat sessions: one `python -m launcher.chat` worker per session, on the run's first node (where
the checkpoints live), spoken to over a `Stream` with stdin (JSON lines both ways; the protocol is
launcher/chat.py's docstring and docs/architecture.md, "Chat worker").

A session answers one exchange at a time (one message to the base and the fine-tuned model, both
answering at once); one asked while another is being answered is refused, so exchanges never mix. A session closes
itself after `IDLE_S` without a request and is closed with the manager, so no worker outlives the
studio (a worker whose stdin closes exits too, however the studio ended).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import shlex
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from backend.cluster import remote, ssh
from backend.job.chat import MODELS, cancel_line, parse_event, request_line
from backend.runs.driver import RunError

READY_TIMEOUT_S = 600.0  # loading a large model from a network disk onto a GPU
EVENT_TIMEOUT_S = 300.0  # between two events of one answer (the first token of a long prompt on a CPU)
LOCK_GRACE_S = 1.0       # how long a message waits for the previous exchange to let go of the session
IDLE_S = 900.0           # a session nobody spoke to for this long ends (its worker holds a GPU)


class ChatError(RunError):
    """A chat session that cannot start or answer; the message names the run, source and node."""


def worker_command(python: str, run_dir: str, source: str | None, log: str, setup: str | None) -> str:
    """Shell text starting the chat worker in the run directory, its stderr appended to `log`."""
    argv = [python, "-m", "launcher.chat", "--run-dir", run_dir, *(["--checkpoint", source] if source else [])]
    return remote.with_setup(setup, f"mkdir -p {shlex.quote(log.rsplit('/', 1)[0])} && "
                                    f"{remote.run_in(None, run_dir, argv)} 2>> {shlex.quote(log)}")


def source_label(source: str | None) -> str:
    if not source or source == "latest":
        return "the latest checkpoint"
    return f"checkpoint step {source}" if source.isdigit() else source


def log_path(run_dir: str, node: str) -> str:
    return f"{run_dir}/logs/chat-{remote.node_file_name(node)}.log"


@dataclass(frozen=True)
class Where:
    """What a session serves, for its messages."""

    run_id: str
    source: str
    node: str
    log: str

    def __str__(self) -> str:
        return f"run {self.run_id}, {self.source}, node {self.node}"


class ChatSession:
    """`stop_worker`, where given, ends the worker process itself when the session ends: closing an
    SSH channel reaches a worker only when it next reads or writes, and a hung one never does."""

    def __init__(self, where: Where, stream: ssh.Stream, ready: dict, on_close: Callable[["ChatSession"], None],
                 idle_s: float = IDLE_S, event_timeout_s: float = EVENT_TIMEOUT_S,
                 stop_worker: Callable[[int], Awaitable[None]] | None = None):
        self.id = secrets.token_hex(8)
        self.where, self.ready = where, ready
        self._stream = stream
        self._stop_worker = stop_worker
        # One reader owns the stream's lines: a reply whose reader goes away (a cancelled wait)
        # leaves them to the next, instead of ending the shared iterator.
        self._events: asyncio.Queue[dict | None] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read(aiter(stream)))
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._on_close = on_close
        self._event_timeout_s = event_timeout_s
        self.ended: str | None = None  # why the worker is gone, once it is
        self.last_used = time.monotonic()
        self._idle = asyncio.create_task(self._close_when_idle(idle_s))

    @classmethod
    async def start(cls, shell: ssh.Shell, command: str, where: Where, on_close: Callable[["ChatSession"], None],
                    ready_timeout_s: float = READY_TIMEOUT_S, **kw) -> "ChatSession":
        """Start the worker and wait for its ready line; a ChatError naming why it did not load."""
        stream = await shell.stream(command, stdin=True)
        lines = aiter(stream)
        try:
            event = await ssh.within(_next_event(lines), ready_timeout_s)
        except asyncio.TimeoutError:
            await stream.close()
            raise ChatError(f"{where}: the chat worker did not load the model within {ready_timeout_s:.0f} s "
                            f"(its log: {where.log})") from None
        except BaseException:
            await stream.close()
            raise
        if event is None or event["type"] != "ready":
            await stream.close()
            why = event["error"] if event else f"it exited while loading (its log: {where.log})"
            raise ChatError(f"{where}: {why}")
        return cls(where, stream, event, on_close, **kw)

    async def _read(self, lines: AsyncIterator[str]) -> None:
        try:
            while (event := await _next_event(lines)) is not None:
                await self._events.put(event)
        except (ssh.NodeError, OSError):
            pass
        finally:
            await self._events.put(None)

    async def reply(self, turns: Sequence[tuple[str, list[dict]]], max_new_tokens: int, temperature: float,
                    top_p: float = 1.0) -> AsyncIterator[dict]:
        """One exchange: every (model, messages) answered at once, the worker's token events of all
        models interleaved as they come and a done event for each, each with `model`. A ChatError
        for an error event, a worker that exited or went silent, and for an exchange asked while
        another is being answered (the two would interleave)."""
        for model, _ in turns:
            if model not in MODELS:
                raise ChatError(f"model: expected one of {', '.join(MODELS)}, got {model!r}")
        try:
            # A cancelled exchange (Clear) lets go within moments; one still answering does not.
            await asyncio.wait_for(self._lock.acquire(), LOCK_GRACE_S)
        except asyncio.TimeoutError:
            raise ChatError(f"{self.where}: the model is still answering the previous message; send again once it "
                            "has finished") from None
        try:
            if self.ended:
                raise ChatError(f"{self.where}: the chat worker has exited ({self.ended}); load the model again")
            self.last_used = time.monotonic()
            async for event in self._answer(turns, max_new_tokens, temperature, top_p):
                yield event
        finally:
            self.last_used = time.monotonic()
            self._lock.release()

    async def _answer(self, turns: Sequence[tuple[str, list[dict]]], max_new_tokens: int, temperature: float,
                      top_p: float) -> AsyncIterator[dict]:
        rid = str(next(self._ids))
        answering = {model for model, _ in turns}
        try:
            await self._stream.write(request_line(rid, turns, max_new_tokens, temperature, top_p))
            while answering:
                event = await asyncio.wait_for(self._events.get(), self._event_timeout_s)
                if event is None:
                    await self._end("it exited before its answer was complete")
                    raise ChatError(f"{self.where}: the chat worker exited before its answer was complete "
                                    f"(its log: {self.where.log}); load the model again")
                if event.get("id") is None and event["type"] == "error":
                    raise ChatError(f"{self.where}: {event['error']}")  # a request it could not even read
                if event.get("id") != rid:
                    continue  # the rest of an answer whose reader went away
                if event["type"] == "error":
                    raise ChatError(f"{self.where}: {event['error']}")
                yield event
                if event["type"] == "done":
                    answering.discard(event.get("model"))
        except asyncio.TimeoutError:
            await self._end(f"no answer within {self._event_timeout_s:.0f} s")
            raise ChatError(f"{self.where}: the chat worker sent nothing for {self._event_timeout_s:.0f} s; "
                            "it was stopped; load the model again") from None
        except ssh.NodeError as exc:
            await self._end(str(exc))
            raise ChatError(f"{self.where}: the chat worker is gone ({exc.reason}); load the model again") from None
        except (asyncio.CancelledError, GeneratorExit):
            # The asker went away (Clear, a closed page): the worker stops generating for nobody, so
            # the next message does not wait for the rest of this answer.
            if self.ended is None:
                with contextlib.suppress(Exception):
                    await ssh.within(self._stream.write(cancel_line(rid)), 10)
            raise

    async def close(self) -> None:
        await self._end("closed")

    async def _end(self, why: str) -> None:
        if self.ended is None:
            self.ended = why
            self._on_close(self)
            if self._stop_worker is not None and isinstance(self.ready.get("pid"), int):
                await self._stop_worker(self.ready["pid"])
            await self._stream.close()
            self._reader.cancel()
        if self._idle is not asyncio.current_task():
            self._idle.cancel()

    async def _close_when_idle(self, idle_s: float) -> None:
        while self.ended is None:
            left = self.last_used + idle_s - time.monotonic()
            if left <= 0 and not self._lock.locked():
                await self._end(f"idle for {idle_s:.0f} s")
                return
            await asyncio.sleep(max(left, 1.0))


async def _next_event(lines: AsyncIterator[str]) -> dict | None:
    """The next event line; None when the worker's output ended."""
    async for line in lines:
        event = parse_event(line)
        if event is not None:
            return event
    return None
