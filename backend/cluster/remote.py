"""Shell command text for nodes, built from argument lists (pure, no I/O).

Everything that reaches a remote shell goes through `shlex.quote`; only a node's own setup line
(written by the person who owns the node, e.g. `source ~/venv/bin/activate`) is passed as
shell text. Run names, paths and environment values are data: `$(...)`, backticks, `;` or
newlines inside them execute nothing.

Workers are started detached: `setsid` gives them their own session and process group (so they
outlive the SSH channel and can be signalled as one group), a small `sh` wrapper writes the
group id to `pids/<node>.pid` and, when torchrun exits, its exit code to `pids/<node>.exit`.
"""
from __future__ import annotations

import inspect
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from backend.job.planner import NODE_ENV, RUN_ID_ENV

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Safe file-name part for a node's logs and pid files (hosts, `localhost`, `gpu-01`, ...).
_UNSAFE_FILE_CHARS = re.compile(r"[^A-Za-z0-9._-]")


class UnsafeValue(ValueError):
    """An environment variable name or a value that cannot be sent to a shell safely."""


def free_port(host: str = "") -> int:
    """A TCP port free for a listener on `host` now, picked outside the kernel's ephemeral range
    where the node says what that is. A port from that range is also handed to outgoing connections
    (gloo's, ssh's, a store's clients): one picked there can be taken before the rendezvous binds it,
    and torchrun then waits out its 60 s as the client of a port nobody serves. Runs on the node
    (as FREE_PORT_PY): the standard library only."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        candidates = [p for p in range(20000, 65536) if not low <= p <= high]
    except (OSError, ValueError):
        candidates = []
    for port in random.sample(candidates, min(len(candidates), 64)) + [0]:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no TCP port is free on {host or 'this node'}")


FREE_PORT_PY = inspect.getsource(free_port) + "print(free_port())\n"


def node_file_name(name: str) -> str:
    """The name used for `logs/<node>.log` and `pids/<node>.pid`."""
    safe = _UNSAFE_FILE_CHARS.sub("_", name).strip("._") or "node"
    return safe


def quote_argv(argv: Sequence[str]) -> str:
    if not argv:
        raise UnsafeValue("empty command")
    return " ".join(shlex.quote(str(a)) for a in argv)


def check_env(env: Mapping[str, str]) -> None:
    for name, value in env.items():
        if not ENV_NAME.match(name):
            raise UnsafeValue(f"invalid environment variable name {name!r}")
        if "\x00" in str(value):
            raise UnsafeValue(f"environment variable {name} contains a NUL byte")


def env_argv(env: Mapping[str, str]) -> list[str]:
    """`env NAME=value ...` as an argument list (validated names), to prefix a command."""
    check_env(env)
    return ["env", *(f"{k}={v}" for k, v in env.items())] if env else []


def with_setup(setup: str | None, command: str) -> str:
    """Run `command` after the node's setup line (the setup's failure stops the command)."""
    if setup and setup.strip():
        # A subshell-free `{ ...; }` keeps `source`/`export` effects for the command.
        return "{ " + setup.strip().rstrip(";") + "\n} && " + command
    return command


@dataclass(frozen=True)
class NodePaths:
    """Where one node's files of one run live (all absolute)."""

    run_dir: str
    node: str

    @property
    def log(self) -> str:
        return f"{self.run_dir}/logs/{node_file_name(self.node)}.log"

    @property
    def pid(self) -> str:
        return f"{self.run_dir}/pids/{node_file_name(self.node)}.pid"

    @property
    def exit(self) -> str:
        return f"{self.run_dir}/pids/{node_file_name(self.node)}.exit"


# The detached wrapper. `$$` of this `sh` is the session and process-group leader (setsid). A
# trap with a handler (not an ignore, which exec would inherit) keeps the wrapper alive through
# the group's SIGTERM so it can record torchrun's exit code once the worker has checkpointed.
# The exit file's bytes are taken before torchrun starts and the code is written over them in
# place (`1<>` does not truncate), then renamed: a disk filled by the run still gets its code. It
# exits with torchrun's code, which is what a Slurm step running it reports.
WRAPPER = (
    'pidf=$1; exitf=$2; shift 2; echo $$ > "$pidf.tmp" && mv "$pidf.tmp" "$pidf"; '
    "printf '%-3s\\n' - > \"$exitf.tmp\"; "
    "trap : TERM INT HUP; "
    '"$@"; rc=$?; printf \'%-3s\\n\' $rc 1<> "$exitf.tmp" && mv "$exitf.tmp" "$exitf"; exit $rc'
)
PID_WAIT_S = 10.0


def detached_start(argv: Sequence[str], env: Mapping[str, str], paths: NodePaths, run_id: str) -> str:
    """Shell text that starts `argv` detached in `paths.run_dir` and prints its process-group id."""
    # The workers name their node in their end slot (launcher.train), as the control plane does.
    full_env = {**env, RUN_ID_ENV: run_id, NODE_ENV: node_file_name(paths.node)}
    start = quote_argv([
        "setsid", "sh", "-c", WRAPPER, "swift-studio-node", paths.pid, paths.exit,
        *env_argv(full_env), *argv,
    ])
    tries = int(PID_WAIT_S / 0.05)
    return (
        f"cd {shlex.quote(paths.run_dir)} && mkdir -p logs pids && "
        f"rm -f {shlex.quote(paths.pid)} {shlex.quote(paths.exit)} && "
        f"{{ {start} < /dev/null > {shlex.quote(paths.log)} 2>&1 & }} && "
        # Wait for the wrapper to publish its group id, then print it for the caller.
        f"i=0; while [ ! -s {shlex.quote(paths.pid)} ] && [ $i -lt {tries} ]; do sleep 0.05; i=$((i+1)); done; "
        f"cat {shlex.quote(paths.pid)}"
    )


def _valid_pgid(pgid: int) -> int:
    pgid = int(pgid)
    if pgid <= 1:
        # `kill -- -1` would signal every process of the user: never.
        raise UnsafeValue(f"refusing to signal process group {pgid}")
    return pgid


# Lists pids whose environment carries this run's tag: the processes of a run on this node.
_TAGGED = (
    'grep -lsxzF -- "$1" /proc/[0-9]*/environ 2>/dev/null | '
    "sed -n 's|^/proc/\\([0-9]*\\)/environ$|\\1|p'; true"
)


def tagged_pids(run_id: str) -> str:
    """Shell text printing the pids on a node whose environment has `SWIFT_STUDIO_RUN_ID=run_id`."""
    return quote_argv(["sh", "-c", _TAGGED, "swift-studio-tag", f"{RUN_ID_ENV}={run_id}"])


# Where several nodes share one process table but not their slots (containers in the host's PID
# namespace; the test suite's loopback nodes), each sets this to its own name, and a node counts
# only the ranks started under its own name.
HOST_ID_ENV = "SWIFT_STUDIO_HOST_ID"
# This shell's host id, then every process's run tag, local rank and host id from one grep over
# /proc: NUL-ended `/proc/<pid>/environ:NAME=value` records.
_RANKS = (
    f'printf "self=%s\\0" "${HOST_ID_ENV}"; '
    f"grep -HsazE -- '^({RUN_ID_ENV}|LOCAL_RANK|{HOST_ID_ENV})=' /proc/[0-9]*/environ; true"
)


def running_ranks() -> str:
    """Shell text listing the run tag, local rank and host id of every process on a node (`parse_ranks`)."""
    return quote_argv(["sh", "-c", _RANKS])


def parse_ranks(text: str) -> dict[str, int]:
    """Run id → how many ranks of it run on the node: distinct local ranks among the processes
    carrying its tag and this node's host id (a rank's children, its data loader workers, carry
    the same rank). Processes of other users are not readable and not counted."""
    records = text.split("\0")
    own = records[0].removeprefix("self=") if records and records[0].startswith("self=") else ""
    seen: dict[str, dict[str, str]] = {}
    for record in records[1:]:
        path, _, assignment = record.partition(":")
        name, eq, value = assignment.partition("=")
        if eq and path.startswith("/proc/"):
            seen.setdefault(path, {})[name] = value
    ranks: dict[str, set[str]] = {}
    for env in seen.values():
        if RUN_ID_ENV in env and "LOCAL_RANK" in env and env.get(HOST_ID_ENV, "") == own:
            ranks.setdefault(env[RUN_ID_ENV], set()).add(env["LOCAL_RANK"])
    return {run_id: len(found) for run_id, found in ranks.items()}


def signal_group(pgid: int, signal: str) -> str:
    """Signal a process group; succeeds whether or not the group still exists."""
    if signal not in ("TERM", "KILL", "INT"):
        raise UnsafeValue(f"unexpected signal {signal!r}")
    return f"kill -s {signal} -- -{_valid_pgid(pgid)} 2>/dev/null; true"


def kill_pids(pids: Sequence[int], signal: str = "KILL") -> str:
    if signal not in ("TERM", "KILL"):
        raise UnsafeValue(f"unexpected signal {signal!r}")
    ids = [str(_valid_pgid(p)) for p in pids]
    return f"kill -s {signal} {' '.join(ids)} 2>/dev/null; true" if ids else "true"


def probe(pgid: int | None, paths: NodePaths) -> str:
    """Shell text printing one line `alive=<0|1> exit=<code|->` for a node's workers."""
    alive = f"kill -0 -- -{_valid_pgid(pgid)} 2>/dev/null" if pgid else "false"
    ex = shlex.quote(paths.exit)
    return (f"if {alive}; then a=1; else a=0; fi; "
            f"if [ -s {ex} ]; then e=$(cat {ex}); else e=-; fi; echo \"alive=$a exit=$e\"")


def parse_probe(text: str) -> tuple[bool, int | None]:
    """(alive, exit code or None) from `probe` output; raises ValueError on anything else."""
    line = text.strip().splitlines()[-1] if text.strip() else ""
    m = re.fullmatch(r"alive=([01]) exit=(-|-?\d+)", line.strip())
    if not m:
        raise ValueError(f"unexpected probe output {text!r}")
    return m.group(1) == "1", (None if m.group(2) == "-" else int(m.group(2)))


def tail(path: str, lines: int) -> str:
    return f"tail -n {int(lines)} -- {shlex.quote(path)} 2>/dev/null; true"


def read_from(path: str, offset: int, max_bytes: int) -> str:
    """Shell text printing at most `max_bytes` of `path` starting at byte `offset` (nothing if absent)."""
    return (f"tail -c +{int(offset) + 1} -- {shlex.quote(path)} 2>/dev/null | head -c {int(max_bytes)}; true")


def run_in(setup: str | None, cwd: str | None, argv: Sequence[str],
           env: Mapping[str, str] | None = None) -> str:
    """A foreground command (after the setup line, in `cwd`), e.g. export or a check."""
    cmd = quote_argv([*env_argv(env or {}), *argv])
    if cwd:
        cmd = f"cd {shlex.quote(cwd)} && {cmd}"
    return with_setup(setup, cmd)
