"""Classify worker failures into causes (pure).

`classify_end` reads a rank's own report, its `end` event (`error_type`, `error`): the first
source of a cause. `classify_line` recognises one log line (reused by the alert rules), the
worker's `[rankN] error: <Type>: <message>` line included; `classify_tail` reads the end of a
node's torchrun log plus its exit code and names the most likely root cause when no rank
reported one (killed, or a worker of an older version). Causes that are usually consequences of
another node's failure (a peer connection lost, a collective timing out) rank below causes that
start a failure (a full disk, out of memory, bad data, a Python exception, a kill).
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
DISK_FULL = "disk_full"
DATA_ERROR = "data_error"
CONFIG_ERROR = "config_error"
MODEL_ERROR = "model_error"
CHECKPOINT_ERROR = "checkpoint_error"
DIVERGED = "diverged"
NODE_BUSY = "node_busy"  # refused before launch: the slots are held by an earlier run
HANG = "hang"  # no step progress for the job's hang limit: the watch stopped the ranks
UNKNOWN = "unknown"

# Higher = more likely the root cause when several nodes fail together. A rank's own user error
# outranks the kill torchrun then sends its peers.
PRIORITY = {
    DISK_FULL: 95, OUT_OF_MEMORY: 90, DATA_ERROR: 85, CONFIG_ERROR: 85, MODEL_ERROR: 85, CHECKPOINT_ERROR: 85,
    DIVERGED: 85, KILLED: 80, PYTHON_EXCEPTION: 70, COMMAND_NOT_FOUND: 65, NODE_UNREACHABLE: 60,
    NODE_BUSY: 50, HANG: 45, RENDEZVOUS_FAILED: 40, NCCL_TIMEOUT: 30, PEER_LOST: 20, UNKNOWN: 0,
}

# What a new attempt from the newest checkpoint can cure: the hardware or the network failed, not
# the job (a user error, out of memory, a diverged loss, a full disk fail the same way again).
RESTARTABLE = frozenset({KILLED, NODE_UNREACHABLE, PEER_LOST, NCCL_TIMEOUT, HANG, RENDEZVOUS_FAILED})

# The worker's user errors (subclasses of backend.job.errors.UserError, by class name): their message
# says what to fix.
USER_ERRORS = {"DataError": DATA_ERROR, "CacheError": CONFIG_ERROR, "ConfigError": CONFIG_ERROR, "ModelError": MODEL_ERROR, "Diverged": DIVERGED,
               "PeerFailed": PEER_LOST, "ReaderMissing": CONFIG_ERROR}  # a media reader to install where it runs

HELP = {
    OUT_OF_MEMORY: "out of memory: lower per_device_train_batch_size or max_length, enable gradient_checkpointing, or use a higher ZeRO stage",
    NCCL_TIMEOUT: "a collective timed out: a peer died or hangs, or the network interface is wrong (NCCL_SOCKET_IFNAME); ddp_timeout sets the limit",
    PYTHON_EXCEPTION: "a Python exception in a worker; see the log lines",
    KILLED: "the workers were killed by a signal (SIGKILL: the OOM killer or an operator)",
    NODE_UNREACHABLE: "the node stopped answering over SSH",
    PEER_LOST: "lost the connection to another node's workers (usually that node failed first)",
    RENDEZVOUS_FAILED: "torchrun's rendezvous failed: the master port is not reachable or another node never joined",
    COMMAND_NOT_FOUND: "a command or module is missing on the node: check the node's setup line (venv) and installed packages",
    DISK_FULL: "the disk is full: free space there (old checkpoints, save_total_limit) or point output_dir at a larger disk, then resume",
    DATA_ERROR: "fix or remove the named record (file:line) in the dataset, then launch again",
    CONFIG_ERROR: "fix the named field of the job, then launch again",
    MODEL_ERROR: "check the model path or id and the packages it needs on every node",
    CHECKPOINT_ERROR: "the checkpoint cannot be used as it is (the message names the file): resume from another one (resume_from_checkpoint) or start afresh",
    DIVERGED: "the loss became NaN/inf: lower learning_rate, use bfloat16 rather than float16, or check the data; resume from the last checkpoint",
    NODE_BUSY: "another run holds the node's GPUs or cores: wait for it to finish or stop it, then resume this run",
    HANG: "the ranks made no step within the job's hang limit (hang_timeout_s, hang_step_multiple) and were stopped: the named rank or collective is where it stuck; max_restarts restarts such runs automatically",
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
# A frame of a C++ backtrace that torch prints under a message (`frame #2: c10::DistNetworkError::
# DistNetworkError(...)`): it names the exception's constructor, not what went wrong. Before the
# rendezvous warning above, torchrun logs the store connection it lost with such a backtrace.
_CPP_FRAME = re.compile(r"^frame #\d+: ")
# The worker's own last line (launcher.train.error_line); older workers wrote no type for user errors.
_WORKER_LINE = re.compile(r"^\s*\[rank(\d+)\] error: (?:([A-Za-z_]\w*): )?(.*)$")
# A rank that stopped because another rank reported its own error first (launcher.trainer.PeerFailed).
_PEER_FAILED = re.compile(r"^\s*\[rank\d+\] error: PeerFailed: ")
# A ConfigError about a checkpoint (resume: ..., a file of checkpoint-<step>/) is a checkpoint problem.
_CHECKPOINT = re.compile(r"^resume:|checkpoint-\d+")
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")

# ENOSPC/EDQUOT as Python, torch.distributed.checkpoint (an OSError inside) and safetensors (Rust) word it.
_DISK_FULL = re.compile(r"No space left on device|\[Errno 28\]|Disk quota exceeded|\bENOSPC\b|StorageFull", re.I)

_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    (DISK_FULL, _DISK_FULL),
    (OUT_OF_MEMORY, re.compile(r"out of memory|OutOfMemoryError|can't allocate memory|\bMemoryError\b|Cannot allocate memory", re.I)),
    (NCCL_TIMEOUT, re.compile(r"Watchdog caught collective operation timeout|NCCL.*(timed out|timeout)|collective operation timeout|ProcessGroupGloo.*Timed out|\[Gloo\].*[Tt]imed out|Timed out waiting .* for (recv|send|connect)", re.I)),
    (PEER_LOST, re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe.*gloo|gloo.*(Connection refused|Broken pipe)|NCCL.*remote process exited|DistNetworkError", re.I)),
    (RENDEZVOUS_FAILED, re.compile(r"Rendezvous(Timeout|Connection|Closed)Error|rendezvous .*(timed out|failed)", re.I)),
    (COMMAND_NOT_FOUND, re.compile(r"command not found|No module named|No such file or directory: '?python", re.I)),
]



_CHILD_FAILED = re.compile(r"^torch\.distributed\.elastic\.multiprocessing\.errors\.ChildFailedError:")
_BORDER = re.compile(r"^=+\s*$")


def _traceback_start(lines: list[str], i: int) -> int:
    """Where the traceback that ends in the exception line `lines[i]` starts."""
    start = i
    while start > 0 and (lines[start - 1].startswith(" ") or lines[start - 1].startswith("Traceback (most recent")):
        start -= 1
        if lines[start].startswith("Traceback (most recent"):
            break
    return start


def shown_tail(lines: list[str]) -> list[str]:
    """A log's last lines as a user reads them for the cause (the full log keeps every line):
    torchrun's own traceback and its ChildFailedError summary (about 40 lines that repeat what the
    watch already says) become one line naming the first failed rank and its exit code, so the
    workers' lines stay in view; torchrun's traceback for the signal a stop sends it becomes one line."""
    out = list(lines)
    for i in reversed(range(len(out))):
        signal = _TORCHRUN_SIGNAL.search(out[i])
        if signal and int(signal.group(1)) in _STOP_SIGNALS:
            out[_traceback_start(out, i):i + 1] = [
                f"(torchrun ended on signal {signal.group(1)}, as a stop ends it; its traceback is in the full log)"]
            break
    for i in reversed(range(len(out))):
        if not _CHILD_FAILED.match(out[i]):
            continue
        start = _traceback_start(out, i)
        borders = [k for k in range(i + 1, len(out)) if _BORDER.match(out[k])][:2]
        end = borders[-1] + 1 if len(borders) == 2 else len(out)
        summary = out[i:end]
        root = next((k for k, line in enumerate(summary) if line.startswith("Root Cause")), 0)
        rank = next((m.group(1) for line in summary[root:] if (m := _ROOT_RANK.match(line))), "?")
        code = next((m.group(1) for line in summary[root:] if (m := _EXITCODE.match(line))), "?")
        out[start:end] = [f"(torchrun's failure summary: first failure rank {rank}, exit code {code})"]
        break
    return out


def classify_error(error_type: str | None, error: str, rank: int | None = None) -> Cause:
    """The cause of a rank's own error report: the exception's class name and its message."""
    summary = error.strip()[:500]
    if _DISK_FULL.search(error):
        return Cause(DISK_FULL, summary, rank)
    kind = USER_ERRORS.get(error_type or "")
    if kind == CONFIG_ERROR and _CHECKPOINT.search(error):
        kind = CHECKPOINT_ERROR
    if kind is None:
        # torch.distributed.checkpoint wraps what failed inside a save or load (an OOM stays an OOM).
        other = CHECKPOINT_ERROR if error_type == "CheckpointException" else PYTHON_EXCEPTION
        kind = next((k for k, pattern in _PATTERNS if pattern.search(error)), other)
    return Cause(kind, summary, rank)


def classify_end(event: dict) -> Cause | None:
    """The cause a rank's `end` event reports; None unless it failed."""
    if event.get("status") != "failed":
        return None
    rank = event.get("rank")
    return classify_error(event.get("error_type"), str(event.get("error") or "failed without a message"),
                          rank if isinstance(rank, int) else None)


def follows_another_rank(line: str) -> bool:
    """A rank's line saying it stopped for another rank's reported error: that one names the cause."""
    return bool(_PEER_FAILED.match(line))


def classify_line(line: str) -> Cause | None:
    """The cause one log line points at, or None for an ordinary line."""
    text = line.rstrip("\n")
    m = _WORKER_LINE.match(text)
    if m:
        rank, error_type, rest = int(m.group(1)), m.group(2), m.group(3)
        if error_type in USER_ERRORS:
            return classify_error(error_type, rest, rank)
        return classify_error(None, f"{error_type}: {rest}" if error_type else rest, rank)
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
    if _CPP_FRAME.match(body):
        return None
    for kind, pattern in _PATTERNS:
        if pattern.search(text):
            return Cause(kind, body[:300], rank=rank)
    m = _EXC.match(body)
    if m and m.group(2) not in ("KeyboardInterrupt",) and not m.group(2).startswith("ChildFailed"):
        return classify_error(m.group(2), body, rank)
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
        where.remove(f"rank {cause.rank}")
    return f"{head} ({', '.join(where)}): {cause.summary}" if where else f"{head}: {cause.summary}"
