"""Connections to nodes: asyncssh for remote hosts, local subprocesses for this machine.

Both kinds give the same small `Shell` interface (`run`, `stream`, `close`) so launch, watch and
pre-flight never care where a node is. Host keys are verified against known_hosts; an unknown or
changed key is a `HostKeyError`, and trusting a new key is a separate, explicit call
(`trust_host_key`). Keys are referenced by path; there is no password option at all.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import asyncssh

CONNECT_TIMEOUT_S = 5.0      # TCP connect to the node's sshd
LOGIN_TIMEOUT_S = 10.0       # SSH handshake, host-key check and key authentication
COMMAND_TIMEOUT_S = 60.0     # default for one remote command
KEEPALIVE_INTERVAL_S = 5.0   # SSH-level keepalives on idle connections ...
KEEPALIVE_COUNT_MAX = 3      # ... a connection is dead after this many go unanswered
KNOWN_HOSTS_ENV = "SWIFT_STUDIO_KNOWN_HOSTS"


T = TypeVar("T")


async def within(work: Awaitable[T], timeout_s: float) -> T:
    """`asyncio.wait_for(work, timeout_s)` for work on a node's shell, whose own failure is taken
    also when the caller is cancelled meanwhile. Python 3.10 and 3.11's wait_for cancels the work
    and leaves what it then raises (a shell closed under it: Unreachable) unread, and asyncio logs
    it with its traceback when the task is collected. Python 3.11 prints a traceback by parsing
    source: collected during an `ast.parse`, that parse inside a parse raised SystemError in a CI
    run (cpython gh-106905)."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return await asyncio.wait_for(task, timeout_s)


def default_known_hosts() -> Path:
    return Path(os.environ.get(KNOWN_HOSTS_ENV) or Path.home() / ".ssh" / "known_hosts")


@dataclass(frozen=True)
class Address:
    """How to reach a node. `host` "local" (or `local=True`) means this machine, no SSH."""

    host: str
    port: int = 22
    user: str | None = None
    key_path: str | None = None
    local: bool = False

    @property
    def label(self) -> str:
        return "local" if self.local else (f"{self.host}:{self.port}" if self.port != 22 else self.host)


class NodeError(Exception):
    """A node could not be reached or used; the message is one line naming the node."""

    kind = "error"

    def __init__(self, address: Address, message: str):
        self.address = address
        self.reason = message
        super().__init__(f"{address.label}: {message}")


class Unreachable(NodeError):
    kind = "unreachable"


class AuthFailed(NodeError):
    kind = "auth"


class HostKeyError(NodeError):
    kind = "host_key"


class CommandTimeout(NodeError):
    kind = "timeout"


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str
    raw: bytes = b""   # stdout as bytes (byte offsets into remote files)

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def first_error_line(self) -> str:
        lines = [ln for ln in (self.stderr or self.stdout).strip().splitlines() if ln.strip()]
        return lines[-1].strip() if lines else f"exit code {self.rc}"


class Stream:
    """A long-running command whose stdout is read line by line (the node agent); started with
    `stdin=True` it also takes lines on its stdin (the chat worker). Closing it ends the command."""

    def __init__(self, address: Address, lines: AsyncIterator[str], closer, writer=None):
        self._address = address
        self._lines = lines
        self._closer = closer
        self._writer = writer

    def __aiter__(self) -> AsyncIterator[str]:
        return self._lines

    async def write(self, line: str) -> None:
        """One line to the command's stdin; a NodeError when the command no longer reads it."""
        if self._writer is None:
            raise ValueError("this stream was started without stdin")
        try:
            await self._writer(line if line.endswith("\n") else line + "\n")
        except (OSError, asyncssh.Error) as exc:  # BrokenPipeError, ConnectionResetError: it exited
            raise NodeError(self._address, f"the command's input is closed (it has exited): {_reason(exc)}") from None

    async def close(self) -> None:
        await self._closer()


class Shell:
    address: Address

    async def run(self, command: str, input: str | None = None,
                  timeout: float = COMMAND_TIMEOUT_S) -> Result:
        raise NotImplementedError

    async def stream(self, command: str, stdin: bool = False) -> Stream:
        """`command` running until the Stream is closed; its stdout as lines, its stdin open with `stdin`."""
        raise NotImplementedError

    async def close(self) -> None:
        return None

    @property
    def closed(self) -> bool:
        return False


class LocalShell(Shell):
    """This machine: commands run under bash as local subprocesses."""

    def __init__(self, address: Address | None = None):
        self.address = address or Address("localhost", local=True)

    async def run(self, command: str, input: str | None = None,
                  timeout: float = COMMAND_TIMEOUT_S) -> Result:
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", command, stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(input.encode() if input is not None else None), timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise CommandTimeout(self.address, f"command did not finish within {timeout:.0f} s") from None
        return Result(proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"), out)

    async def stream(self, command: str, stdin: bool = False) -> Stream:
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", command, stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, start_new_session=True)

        async def lines():
            assert proc.stdout is not None
            async for raw in proc.stdout:
                yield raw.decode(errors="replace")

        async def close():
            if proc.returncode is None:
                try:
                    os.killpg(proc.pid, 15)
                except ProcessLookupError:
                    pass
                try:
                    await asyncio.wait_for(proc.wait(), 5)
                except asyncio.TimeoutError:
                    os.killpg(proc.pid, 9)
                    await proc.wait()

        async def write(line: str) -> None:
            assert proc.stdin is not None
            proc.stdin.write(line.encode())
            await proc.stdin.drain()

        return Stream(self.address, lines(), close, write if stdin else None)


# The node side of `Helper`: runs commands sent as JSON lines on stdin, replies with JSON lines.
# One per connection and setup line, so a command costs a fork of bash instead of an SSH session
# plus the user's shell start-up files (which can take longer than the command itself).
HELPER_PY = r"""
import base64, json, os, subprocess, sys, threading
lock = threading.Lock()
shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
def reply(obj):
    with lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()
def serve(req):
    data = req.get("in")
    try:
        p = subprocess.run([shell, "-c", req["cmd"]], input=None if data is None else base64.b64decode(data),
                           stdin=subprocess.DEVNULL if data is None else None,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=req["timeout"])
        reply({"id": req["id"], "rc": p.returncode, "out": base64.b64encode(p.stdout).decode(),
               "err": base64.b64encode(p.stderr).decode()})
    except subprocess.TimeoutExpired:
        reply({"id": req["id"], "timeout": True})
    except Exception as exc:
        reply({"id": req["id"], "rc": 127, "out": "", "err": base64.b64encode(repr(exc).encode()).decode()})
reply({"ready": os.getpid()})
workers = []
for line in sys.stdin:
    workers.append(threading.Thread(target=serve, args=(json.loads(line),), daemon=True))
    workers[-1].start()
    workers = [w for w in workers if w.is_alive()]
for w in workers:
    w.join()
"""
HELPER_START_S = 30.0


class Helper:
    """Client side of HELPER_PY over one SSH channel; requests run concurrently."""

    def __init__(self, address: Address, proc: asyncssh.SSHClientProcess):
        self.address = address
        self._proc = proc
        self._pending: dict[int, asyncio.Future] = {}
        self._next = 0
        self._reader: asyncio.Task | None = None

    @classmethod
    async def start(cls, conn: asyncssh.SSHClientConnection, address: Address, command: str) -> "Helper":
        proc = await conn.create_process(command, encoding="utf-8", stderr=asyncssh.DEVNULL)
        helper = cls(address, proc)
        line = await asyncio.wait_for(proc.stdout.readline(), HELPER_START_S)
        if not line.startswith('{"ready"'):
            proc.close()
            raise NodeError(address, "could not start the command helper")
        helper._reader = asyncio.create_task(helper._read())
        return helper

    async def _read(self) -> None:
        try:
            async for line in self._proc.stdout:
                try:
                    reply = json.loads(line)
                except ValueError:
                    continue
                fut = self._pending.pop(reply.get("id"), None)
                if fut is not None and not fut.done():
                    fut.set_result(reply)
        except (asyncssh.Error, OSError):
            pass
        finally:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(Unreachable(self.address, "connection lost"))
            self._pending.clear()

    @property
    def closed(self) -> bool:
        return self._reader is None or self._reader.done()

    async def run(self, command: str, input: str | None = None, timeout: float = COMMAND_TIMEOUT_S) -> Result:
        if self.closed:
            raise Unreachable(self.address, "connection lost")
        self._next += 1
        rid = self._next
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        req = {"id": rid, "cmd": command, "timeout": timeout,
               "in": None if input is None else base64.b64encode(input.encode()).decode()}
        try:
            self._proc.stdin.write(json.dumps(req) + "\n")
            reply = await asyncio.wait_for(fut, timeout + 5)
        except asyncio.TimeoutError:
            self._pending.pop(rid, None)
            raise CommandTimeout(self.address, f"command did not finish within {timeout:.0f} s") from None
        except (asyncssh.Error, OSError, BrokenPipeError) as exc:
            self._pending.pop(rid, None)
            raise Unreachable(self.address, f"connection lost: {_reason(exc)}") from None
        if reply.get("timeout"):
            raise CommandTimeout(self.address, f"command did not finish within {timeout:.0f} s")
        out, err = base64.b64decode(reply["out"]), base64.b64decode(reply["err"])
        return Result(reply["rc"], out.decode(errors="replace"), err.decode(errors="replace"), out)

    def close(self) -> None:
        self._proc.close()


class SshShell(Shell):
    def __init__(self, address: Address, conn: asyncssh.SSHClientConnection):
        self.address = address
        self._conn = conn
        self._helpers: dict[tuple[str, str | None], Helper | None] = {}
        self._helper_lock = asyncio.Lock()

    async def helper(self, python: str, setup_command: str, reuse_any: bool = False) -> Helper | None:
        """A command helper started with `setup_command` (None when it cannot start: callers fall
        back to one SSH session per command). `reuse_any`: any live helper of this connection will
        do (commands that need no setup line)."""
        key = (python, setup_command)
        async with self._helper_lock:
            if reuse_any:
                live = [h for h in self._helpers.values() if h is not None and not h.closed]
                if live:
                    return live[0]
            if key in self._helpers:
                cached = self._helpers[key]
                if cached is None or not cached.closed:
                    return cached
            try:
                helper = await Helper.start(self._conn, self.address, setup_command)
            except (NodeError, asyncio.TimeoutError, asyncssh.Error, OSError, AssertionError):
                # (asyncssh asserts when the connection closes while a channel opens)
                helper = None
            self._helpers[key] = helper
            return helper

    async def run(self, command: str, input: str | None = None,
                  timeout: float = COMMAND_TIMEOUT_S) -> Result:
        try:
            res = await self._conn.run(command, input=input.encode() if input is not None else None,
                                       timeout=timeout, check=False, encoding=None)
        except asyncssh.TimeoutError:
            raise CommandTimeout(self.address, f"command did not finish within {timeout:.0f} s") from None
        except (asyncssh.Error, OSError, AssertionError) as exc:
            raise Unreachable(self.address, f"connection lost: {_reason(exc)}") from None
        rc = res.exit_status if res.exit_status is not None else 255
        raw = res.stdout if isinstance(res.stdout, bytes) else _text(res.stdout).encode()
        return Result(rc, _text(res.stdout), _text(res.stderr), raw)

    async def stream(self, command: str, stdin: bool = False) -> Stream:
        try:
            proc = await self._conn.create_process(command, stdin=asyncssh.PIPE if stdin else asyncssh.DEVNULL,
                                                   stderr=asyncssh.DEVNULL)
        except (asyncssh.Error, OSError, AssertionError) as exc:
            raise Unreachable(self.address, f"connection lost: {_reason(exc)}") from None

        async def lines():
            async for line in proc.stdout:
                yield line

        async def close():
            # Closing the channel hangs up the remote command: the agent writes into a closed pipe
            # (SIGPIPE), the chat worker reads the end of its stdin; both exit.
            proc.close()
            try:
                await asyncio.wait_for(proc.wait_closed(), 5)
            except (asyncio.TimeoutError, asyncssh.Error, OSError):
                pass

        async def write(line: str) -> None:
            proc.stdin.write(line)
            await proc.stdin.drain()

        return Stream(self.address, lines(), close, write if stdin else None)

    async def close(self) -> None:
        for helper in self._helpers.values():
            if helper is not None:
                helper.close()
        self._conn.close()
        try:
            await asyncio.wait_for(self._conn.wait_closed(), 5)
        except (asyncio.TimeoutError, OSError, asyncssh.Error):
            pass

    @property
    def closed(self) -> bool:
        return self._conn.is_closed()


def _text(value) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _known_host_pattern(address: Address) -> str:
    return address.host if address.port == 22 else f"[{address.host}]:{address.port}"


def _has_known_key(known_hosts: Path, address: Address) -> bool:
    if not known_hosts.exists():
        return False
    try:
        trusted, _, _, _, _, _, _ = asyncssh.read_known_hosts(str(known_hosts)).match(
            address.host, "", address.port)
    except (asyncssh.Error, ValueError, OSError):
        return False
    return bool(trusted)


async def _tcp_connect(address: Address) -> socket.socket:
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM), CONNECT_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError) as exc:
        raise Unreachable(address, f"cannot resolve host name ({_reason(exc)})") from None
    last: BaseException | None = None
    for family, kind, proto, _, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, sockaddr), CONNECT_TIMEOUT_S)
            return sock
        except asyncio.TimeoutError:
            sock.close()
            last = TimeoutError(f"no answer within {CONNECT_TIMEOUT_S:.0f} s")
        except OSError as exc:
            sock.close()
            last = exc
    if isinstance(last, OSError) and last.errno:
        reason = os.strerror(last.errno).lower()
    else:
        reason = _reason(last or OSError())
    raise Unreachable(address, f"cannot connect to port {address.port} ({reason})")


async def connect(address: Address, known_hosts: Path | None = None) -> Shell:
    """A shell on the node, or one of the `NodeError`s with a one-line reason."""
    if address.local:
        return LocalShell(address)
    known_hosts = known_hosts or default_known_hosts()
    if address.key_path and not Path(address.key_path).expanduser().is_file():
        raise AuthFailed(address, f"private key file not found: {address.key_path}")
    sock = await _tcp_connect(address)
    options = dict(
        username=address.user or None,
        known_hosts=str(known_hosts) if known_hosts.exists() else asyncssh.import_known_hosts(""),
        preferred_auth="publickey",
        password=None,
        kbdint_auth=False,
        password_auth=False,
        keepalive_interval=KEEPALIVE_INTERVAL_S,
        keepalive_count_max=KEEPALIVE_COUNT_MAX,
        connect_timeout=LOGIN_TIMEOUT_S,
    )
    if address.key_path:
        options.update(client_keys=[str(Path(address.key_path).expanduser())], agent_path=None)
    try:
        conn = await asyncio.wait_for(
            asyncssh.connect(address.host, address.port, sock=sock, **options), LOGIN_TIMEOUT_S)
    except asyncio.TimeoutError:
        sock.close()
        raise Unreachable(address, f"SSH login did not complete within {LOGIN_TIMEOUT_S:.0f} s") from None
    except asyncssh.HostKeyNotVerifiable:
        sock.close()
        if _has_known_key(known_hosts, address):
            raise HostKeyError(address, f"host key CHANGED since it was trusted in {known_hosts}; "
                                        "if the node was reinstalled, remove its old line and trust it again") from None
        raise HostKeyError(address, f"host key unknown (not in {known_hosts}); trust it explicitly "
                                    "(swift-studio trust-host) after checking its fingerprint") from None
    except asyncssh.PermissionDenied:
        sock.close()
        who = f"user {address.user}" if address.user else "the current user"
        key = f"key {address.key_path}" if address.key_path else "the default keys"
        raise AuthFailed(address, f"permission denied (publickey) for {who} with {key}") from None
    except (asyncssh.Error, OSError) as exc:
        sock.close()
        raise Unreachable(address, f"SSH connection failed: {_reason(exc)}") from None
    return SshShell(address, conn)


async def host_key_fingerprint(address: Address) -> str:
    """The SHA256 fingerprint the node presents now (for the user to compare before trusting)."""
    key = await _fetch_host_key(address)
    return key.get_fingerprint("sha256")


async def _fetch_host_key(address: Address) -> asyncssh.SSHKey:
    sock = await _tcp_connect(address)
    try:
        key = await asyncio.wait_for(
            asyncssh.get_server_host_key(address.host, address.port, sock=sock), LOGIN_TIMEOUT_S)
    except (asyncio.TimeoutError, asyncssh.Error, OSError) as exc:
        raise Unreachable(address, f"could not read the host key: {_reason(exc)}") from None
    finally:
        sock.close()
    if key is None:
        raise Unreachable(address, "the server sent no host key")
    return key


async def trust_host_key(address: Address, known_hosts: Path | None = None,
                         expected_fingerprint: str | None = None) -> str:
    """Append the node's current host key to known_hosts; returns its fingerprint.

    With `expected_fingerprint`, refuses when the presented key differs (the user compared it).
    """
    known_hosts = known_hosts or default_known_hosts()
    key = await _fetch_host_key(address)
    fingerprint = key.get_fingerprint("sha256")
    if expected_fingerprint and expected_fingerprint != fingerprint:
        raise HostKeyError(address, f"presented key {fingerprint} is not the expected {expected_fingerprint}")
    known_hosts.parent.mkdir(parents=True, exist_ok=True)
    line = f"{_known_host_pattern(address)} {key.export_public_key('openssh').decode().strip()}\n"
    with open(known_hosts, "a") as fh:
        fh.write(line)
    return fingerprint
