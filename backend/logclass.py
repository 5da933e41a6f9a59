"""Classify worker log lines into failure causes (pure).

`classify_line` recognises one line (reused by the alert rules); `classify_tail` reads the end of
a node's torchrun log plus its exit code and names the most likely root cause. Causes that are
usually consequences of another node's failure (a peer connection lost, a collective timing
out) rank below causes that start a failure (out of memory, a Python exception, a kill).
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

OUT_OF_MEMORY = "out_of_memory"
NCCL_TIMEOUT = "nccl_timeout"
PYTHON_EXCEPTION = "python_exception"
KILLED = "killed"
NODE_UNREACHABLE = "node_unreachable"
PEER_LOST = "peer_lost"
RENDEZVOUS_FAILED = "rendezvous_failed"
COMMAND_NOT_FOUND = "command_not_found"
UNKNOWN = "unknown"

# Higher = more likely the root cause when several nodes fail together.
PRIORITY = {
    OUT_OF_MEMORY: 90, KILLED: 80, PYTHON_EXCEPTION: 70, COMMAND_NOT_FOUND: 65, NODE_UNREACHABLE: 60,
    RENDEZVOUS_FAILED: 40, NCCL_TIMEOUT: 30, PEER_LOST: 20, UNKNOWN: 0,
}

HELP = {
    OUT_OF_MEMORY: "out of memory: lower per_device_train_batch_size or max_length, enable gradient_checkpointing, or use a higher ZeRO stage",
    NCCL_TIMEOUT: "a collective timed out: a peer died or hangs, or the network interface is wrong (NCCL_SOCKET_IFNAME); ddp_timeout sets the limit",
    PYTHON_EXCEPTION: "a Python exception in a worker; see the log lines",
    KILLED: "the workers were killed by a signal (SIGKILL: the OOM killer or an operator)",
    NODE_UNREACHABLE: "the node stopped answering over SSH",
    PEER_LOST: "lost the connection to another node's workers (usually that node failed first)",
    RENDEZVOUS_FAILED: "torchrun's rendezvous failed: the master port is not reachable or another node never joined",
    COMMAND_NOT_FOUND: "a command or module is missing on the node: check the node's setup line (venv) and installed packages",
    UNKNOWN: "the workers exited with an error",
}


@dataclass(frozen=True)
class Cause:
    kind: str
    summary: str
    rank: int | None = None

    @property
    def priority(self) -> int:
        return PRIORITY.get(self.kind, 0)


_RANK_PREFIX = re.compile(r"^\s*\[(?:default)?rank(\d+)\]:\s?")
_EXC = re.compile(r"^((?:[A-Za-z_][\w]*\.)*([A-Z]\w*(?:Error|Exception|Interrupt)))(?::\s*(.*))?$")
_SIGNAL = re.compile(r"Signal (\d+) \((SIG\w+)\) received by PID (\d+)")
# torchrun's own report of a signal it was sent (a stop, a scheduler's preemption): SIGTERM/SIGINT
# are how runs are stopped, not an error in the training code.
_TORCHRUN_SIGNAL = re.compile(r"SignalException: Process \d+ got signal: (\d+)")
_STOP_SIGNALS = (2, 15)
# torchrun's warning when a node leaves after its workers ended and the node holding the
# rendezvous store has already gone: a race at the end of a run, not a failure (exit codes decide).
_RENDEZVOUS_SHUTDOWN = re.compile(r"has failed to shutdown the rendezvous")
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")

_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    (OUT_OF_MEMORY, re.compile(r"out of memory|OutOfMemoryError|can't allocate memory|\bMemoryError\b|Cannot allocate memory", re.I)),
    (NCCL_TIMEOUT, re.compile(r"Watchdog caught collective operation timeout|NCCL.*(timed out|timeout)|collective operation timeout|ProcessGroupGloo.*Timed out|\[Gloo\].*[Tt]imed out|Timed out waiting .* for (recv|send|connect)", re.I)),
    (PEER_LOST, re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe.*gloo|gloo.*(Connection refused|Broken pipe)|NCCL.*remote process exited|DistNetworkError", re.I)),
    (RENDEZVOUS_FAILED, re.compile(r"Rendezvous(Timeout|Connection|Closed)Error|rendezvous .*(timed out|failed)", re.I)),
    (COMMAND_NOT_FOUND, re.compile(r"command not found|No module named|No such file or directory: '?python", re.I)),
]


def classify_line(line: str) -> Cause | None:
    """The cause one log line points at, or None for an ordinary line."""
    text = line.rstrip("\n")
    if _RENDEZVOUS_SHUTDOWN.search(text):
        return None
    m = _TORCHRUN_SIGNAL.search(text)
    if m:
        sig = int(m.group(1))
        return None if sig in _STOP_SIGNALS else Cause(KILLED, f"torchrun received signal {sig}")
    m = _SIGNAL.search(text)
    if m:
        return Cause(KILLED, f"{m.group(2)} received by PID {m.group(3)}")
    m = _RANK_PREFIX.match(text)
    rank = int(m.group(1)) if m else None
    body = (text[m.end():] if m else text).strip()
    for kind, pattern in _PATTERNS:
        if pattern.search(text):
            return Cause(kind, body[:300], rank=rank)
    m = _EXC.match(body)
    if m and m.group(2) not in ("KeyboardInterrupt",) and not m.group(2).startswith("ChildFailed"):
        return Cause(PYTHON_EXCEPTION, body[:300], rank=rank)
    return None


def classify_tail(lines: Iterable[str], exit_code: int | None = None) -> Cause:
    """The most likely root cause from a node's last log lines and torchrun's exit code."""
    lines = list(lines)
    best: Cause | None = None
    root_rank: int | None = None
    for line in lines:
        m = _ROOT_RANK.match(line)
        if m:
            root_rank = int(m.group(1))
        m = _EXITCODE.match(line)
        if m and int(m.group(1)) < 0 and best is None:
            sig = -int(m.group(1))
            best = Cause(KILLED, f"worker killed by signal {sig}", rank=root_rank)
        cause = classify_line(line)
        # Keep the strongest cause; among equals the last one (the final exception line of a
        # traceback is its message, not a frame).
        if cause and (best is None or cause.priority >= best.priority):
            best = cause
    if best is None:
        if exit_code is not None and exit_code >= 128:
            sig = exit_code - 128
            return Cause(KILLED, f"torchrun ended by signal {sig} (exit code {exit_code})")
        return Cause(UNKNOWN, f"exit code {exit_code}" if exit_code is not None else "no exit code recorded")
    if best.rank is None and root_rank is not None:
        best = Cause(best.kind, best.summary, rank=root_rank)
    return best


def describe(cause: Cause, node: str | None = None, exit_code: int | None = None) -> str:
    """One line for the UI: what failed, where, and what to do."""
    where = []
    if node:
        where.append(f"node {node}")
    if cause.rank is not None:
        where.append(f"rank {cause.rank}")
    if exit_code is not None:
        where.append(f"exit code {exit_code}")
    head = cause.kind.replace("_", " ")
    if cause.kind == PYTHON_EXCEPTION and cause.rank is not None:
        head = f"Python exception in rank {cause.rank}"
    return f"{head} ({', '.join(where)}): {cause.summary}" if where else f"{head}: {cause.summary}"
