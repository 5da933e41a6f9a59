"""Start and stop a run's workers on its nodes (the planner decides what; this executes it).

Start: the run directory's files are written through the first node (the output directory is
shared storage), then every node's torchrun command starts in parallel, detached in its own
session and process group, with the run id in its environment and its group id in
`pids/<node>.pid`. Stop: SIGTERM to each node's group (the worker checkpoints), SIGKILL after a
grace period, then a check that no process carrying the run id is left on any node. Nothing is
ever killed by a name pattern.
"""
from __future__ import annotations

import asyncio
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from backend.cluster import remote, ssh
from backend.cluster.nodes import Pool, address_of
from backend.job.cluster import Node
from backend.job.planner import STOP_BUDGET_S

# SIGTERM → SIGKILL of a node's group: the workers' stop budget, then time for torchrun to see them
# exit (or kill them at the budget) and for the wrapper to record its exit code.
STOP_GRACE_S = STOP_BUDGET_S + 15.0
KILL_WAIT_S = 10.0       # after SIGKILL, until the group is gone
POLL_S = 0.5
@dataclass(frozen=True)
class NodeCommand:
    """What one node runs: the node, its setup line, torchrun's argv and the extra environment."""

    node: Node
    argv: Sequence[str]
    env: Mapping[str, str]
    setup: str | None = None


@dataclass
class Started:
    node: Node
    setup: str | None
    pgid: int | None = None
    error: str | None = None


@dataclass
class StopReport:
    """Per node: whether a process of the run was left after the stop (should be all False)."""

    leftovers: dict[str, list[int]] = field(default_factory=dict)
    unreachable: dict[str, str] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not any(self.leftovers.values()) and not self.unreachable

    def detail(self) -> str:
        """What kept the stop from being clean, one `host: why` per node."""
        return "; ".join([*(f"{h}: could not verify ({why})" for h, why in self.unreachable.items()),
                          *(f"{h}: pids {p} survived" for h, p in self.leftovers.items() if p)])


async def free_port(pool: Pool, node: Node, setup: str | None) -> int:
    """A TCP port free on the node now (for the rendezvous on the master)."""
    res = await pool.run(node, remote.quote_argv([node.python, "-c", remote.FREE_PORT_PY]), setup)
    if not res.ok or not res.stdout.strip().isdigit():
        raise ssh.NodeError(address_of(node), f"could not pick a free port with {node.python}: {res.first_error_line()}")
    return int(res.stdout.strip())


# Writes {relative path: text} from stdin into the run directory, each file atomically. The files
# hold the spec's env values (tokens, keys): 0600, and every directory it creates 0700, whatever
# the umask (the workers on every node run as the same user). Directories that exist are left alone.
CLAIM_FILE = ".swift-studio-run"

# argv: the run directory, then its claim token or nothing. With a token (an attempt starting) the
# directory is claimed first: made whole with its marker under a temporary name and renamed into
# place, which fails where the name exists (but as an empty directory); an existing directory is
# written into only while its marker holds the same token ("" for a run from before claims: no
# marker at all). Then the checkpoints the run's earlier attempts left unfinished
# (`checkpoint-<step>.tmp`, renamed only once complete) are removed: a full disk left one holding
# the space the next attempt's files need; and so are their group ids and exit codes (`pids/`): a
# pid file is then always this attempt's, which is how a launch cut short is found to have started
# (`started_group`). Then, given a minimum, the free space there is checked (exit 4 below it). A
# file that cannot be written leaves no temporary.
WRITE_FILES_PY = (
    "import json, os, re, secrets, shutil, sys\n"
    "def makedirs(path):\n"
    "    if not os.path.isdir(path):\n"
    "        makedirs(os.path.dirname(path))\n"
    "        try:\n"
    "            os.mkdir(path, 0o700)\n"
    "            os.chmod(path, 0o700)\n"
    "        except FileExistsError:\n"
    "            pass\n"
    "def marker(root):\n"
    "    try:\n"
    "        fd = os.open(os.path.join(root, CLAIM), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)\n"
    "    except FileNotFoundError:\n"
    "        return ''\n"
    "    except OSError as exc:\n"
    "        return '(unreadable: %s)' % exc.strerror\n"
    "    with os.fdopen(fd) as f:\n"
    "        return f.read(200).strip()\n"
    "def claim(root, token):\n"
    "    if not os.path.lexists(root):\n"
    "        makedirs(os.path.dirname(root))\n"
    "        temp = '%s.claim-%s' % (root, secrets.token_hex(4))\n"
    "        os.mkdir(temp, 0o700)\n"
    "        try:\n"
    "            with open(os.path.join(temp, CLAIM), 'x') as f:\n"
    "                f.write(token + '\\n')\n"
    "        except BaseException:\n"
    "            shutil.rmtree(temp)\n"
    "            raise\n"
    "        try:\n"
    "            os.rename(temp, root)\n"
    "            return\n"
    "        except OSError:  # another process claimed the name first\n"
    "            shutil.rmtree(temp)\n"
    "    if not os.path.isdir(root) or os.path.islink(root) or marker(root) != token:\n"
    "        print(json.dumps({'taken': marker(root) if os.path.isdir(root) else 'not a directory'}))\n"
    "        sys.exit(3)\n"
    "root = sys.argv[1]\n"
    "if len(sys.argv) > 2:\n"
    "    claim(root, sys.argv[2])\n"
    "    for entry in os.scandir(root):\n"
    "        if re.fullmatch(r'checkpoint-\\d+\\.tmp', entry.name) and entry.is_dir(follow_symlinks=False):\n"
    "            shutil.rmtree(entry.path)\n"
    "    pids = os.path.join(root, 'pids')\n"
    "    if os.path.isdir(pids) and not os.path.islink(pids):\n"
    "        for entry in os.scandir(pids):\n"
    "            if re.fullmatch(r'.+\\.(pid|exit)(\\.tmp)?', entry.name) and entry.is_file(follow_symlinks=False):\n"
    "                os.unlink(entry.path)\n"
    "    free = shutil.disk_usage(root).free\n"
    "    if len(sys.argv) > 3 and free < int(sys.argv[3]):\n"
    "        print(json.dumps({'free': free}))\n"
    "        sys.exit(4)\n"
    "for rel, text in json.load(sys.stdin).items():\n"
    "    path = os.path.join(root, rel)\n"
    "    makedirs(os.path.dirname(path))\n"
    "    try:\n"
    "        fd = os.open(path + '.tmp', os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)\n"
    "        os.fchmod(fd, 0o600)\n"
    "        with os.fdopen(fd, 'w') as f:\n"
    "            f.write(text)\n"
    "        os.replace(path + '.tmp', path)\n"
    "    except BaseException:\n"
    "        if os.path.exists(path + '.tmp'):\n"
    "            os.unlink(path + '.tmp')\n"
    "        raise\n"
).replace("CLAIM", repr(CLAIM_FILE))
CLAIM_TAKEN_EXIT = 3
TOO_LITTLE_SPACE_EXIT = 4


class RunDirTaken(ValueError):
    """The run directory exists and is not this run's: another run, studio or database chose the
    same output_dir and name."""


class TooLittleSpace(ValueError):
    """The run directory's volume has less free space than a run needs there."""


async def write_files(pool: Pool, node: Node, setup: str | None, run_dir: str, files: Mapping[str, str],
                      claim: str | None = None, min_free_bytes: int = 0) -> None:
    """Write the run directory's files (relative path → text) through one node, in one command;
    with `claim` (the run's token), claim the directory first and, with `min_free_bytes`, refuse
    (TooLittleSpace, nothing written) where less is free once its own temporaries are gone
    (WRITE_FILES_PY)."""
    for rel in files:
        if rel.startswith("/") or ".." in rel.split("/"):
            raise ValueError(f"plan file path must stay inside the run directory: {rel!r}")
    argv = [node.python, "-c", WRITE_FILES_PY, run_dir,
            *([claim, *([str(min_free_bytes)] if min_free_bytes else [])] if claim is not None else [])]
    res = await pool.run(node, remote.quote_argv(argv), setup, input=json.dumps(dict(files)))
    if res.rc == TOO_LITTLE_SPACE_EXIT:
        try:
            free = int(json.loads(res.stdout.strip().splitlines()[-1])["free"])
        except (ValueError, IndexError, KeyError, TypeError):
            free = 0
        raise TooLittleSpace(f"{node.host}: {free / 2**30:.2f} GiB free for the run directory {run_dir}, less than the "
                             f"{min_free_bytes / 2**30:g} GiB a run needs there (checkpoints, logs): it would fail when "
                             "it first saves. Free space there or point output_dir at a larger volume; nothing was "
                             "started")
    if res.rc == CLAIM_TAKEN_EXIT:
        try:
            held = json.loads(res.stdout.strip().splitlines()[-1])["taken"]
        except (ValueError, IndexError, KeyError, TypeError):
            held = "?"
        whose = {"not a directory": "it is not a directory",
                 "": f"no {CLAIM_FILE} marker in it: a directory some other program or an older run made"
                 }.get(held, f"its {CLAIM_FILE} marker is another run's")
        raise RunDirTaken(f"the run directory {run_dir} already exists on {node.host} and is not this run's "
                          f"({whose}); nothing in it was touched. Launch under another name or output_dir.")
    if not res.ok:
        raise ssh.NodeError(address_of(node), f"cannot write the run directory {run_dir}: {res.first_error_line()}")


_PGID = re.compile(r"^\s*(\d+)\s*$")


async def start_node(pool: Pool, cmd: NodeCommand, run_id: str, run_dir: str) -> Started:
    paths = remote.NodePaths(run_dir, cmd.node.host)
    text = remote.detached_start(cmd.argv, cmd.env, paths, run_id)
    try:
        res = await pool.run(cmd.node, text, cmd.setup, timeout=remote.PID_WAIT_S + ssh.COMMAND_TIMEOUT_S)
    except ssh.NodeError as exc:
        return Started(cmd.node, cmd.setup, error=str(exc))
    lines = res.stdout.strip().splitlines()
    m = _PGID.match(lines[-1]) if lines else None
    if not res.ok or not m:
        return Started(cmd.node, cmd.setup, error=f"{cmd.node.host}: start failed: {res.first_error_line()}")
    return Started(cmd.node, cmd.setup, pgid=int(m.group(1)))


async def start_all(pool: Pool, commands: Sequence[NodeCommand], run_id: str, run_dir: str) -> list[Started]:
    """Start every node at once; on any failure the ones that did start are stopped again."""
    started = list(await asyncio.gather(*(start_node(pool, c, run_id, run_dir) for c in commands)))
    if any(s.error for s in started):
        await stop_all(pool, [s for s in started if s.pgid], run_id, run_dir, grace_s=0)
    return started


async def existing_files(pool: Pool, node: Node, setup: str | None, paths: Sequence[str]) -> set[str]:
    """Which of `paths` are regular files on the node."""
    test = "for p in \"$@\"; do [ -f \"$p\" ] && printf '%s\\n' \"$p\"; done; true"
    res = await pool.run(node, remote.quote_argv(["sh", "-c", test, "swift-studio-files", *paths]), setup)
    if not res.ok:
        raise ssh.NodeError(address_of(node), f"cannot look for {len(paths)} files: {res.first_error_line()}")
    return set(res.stdout.splitlines()) & set(paths)


async def started_group(pool: Pool, node: Node, setup: str | None, run_dir: str) -> int | None:
    """The process group the node's wrapper published for this attempt (`pids/<node>.pid`; a new
    attempt's `write_files` removed the earlier ones), None where its start never ran."""
    res = await pool.run(node, remote.tail(remote.NodePaths(run_dir, node.host).pid, 1), setup)
    m = _PGID.match(res.stdout.strip())
    return int(m.group(1)) if m else None


async def probe(pool: Pool, node: Node, pgid: int | None, run_dir: str) -> tuple[bool, int | None]:
    """(workers alive, torchrun's exit code or None) on one node."""
    res = await pool.run(node, remote.probe(pgid, remote.NodePaths(run_dir, node.host)), None, timeout=10)
    try:
        return remote.parse_probe(res.stdout)
    except ValueError:
        raise ssh.NodeError(address_of(node), f"unexpected answer to a status check: {res.first_error_line()}") from None


async def _signal(pool: Pool, s: Started, signal: str) -> None:
    await pool.run(s.node, remote.signal_group(s.pgid, signal), None, timeout=10)


async def _tagged(pool: Pool, node: Node, run_id: str) -> list[int]:
    res = await pool.run(node, remote.tagged_pids(run_id), None, timeout=20)
    return [int(x) for x in res.stdout.split() if x.isdigit()]


async def running_ranks(pool: Pool, node: Node) -> dict[str, int]:
    """Run id → ranks of it running on `node`, whichever database started them (`remote.parse_ranks`)."""
    res = await pool.run(node, remote.running_ranks(), None, timeout=20)
    return remote.parse_ranks(res.stdout)


async def stop_all(pool: Pool, started: Sequence[Started], run_id: str, run_dir: str,
                   grace_s: float = STOP_GRACE_S, all_nodes: Sequence[Node] = ()) -> StopReport:
    """SIGTERM every group, SIGKILL what is left after `grace_s`, then verify nothing remains.

    `all_nodes` are checked for tagged leftovers too (e.g. a node whose start was not recorded).
    """
    report = StopReport()
    loop = asyncio.get_running_loop()

    async def gone_after(s: Started, signal: str, wait_s: float, poll_s: float) -> bool:
        await _signal(pool, s, signal)
        end = loop.time() + wait_s
        while loop.time() < end:
            alive, _ = await probe(pool, s.node, s.pgid, run_dir)
            if not alive:
                return True
            await asyncio.sleep(poll_s)
        return False

    async def one(s: Started) -> None:
        try:
            if not (grace_s > 0 and await gone_after(s, "TERM", grace_s, POLL_S)):
                await gone_after(s, "KILL", KILL_WAIT_S, POLL_S / 5)
        except ssh.NodeError as exc:
            report.unreachable[s.node.host] = exc.reason

    await asyncio.gather(*(one(s) for s in started if s.pgid))
    nodes = {n.host: n for n in [*(s.node for s in started), *all_nodes]}
    await asyncio.gather(*(_sweep(pool, node, run_id, report) for node in nodes.values()))
    return report


async def _sweep(pool: Pool, node: Node, run_id: str, report: StopReport) -> None:
    """Kill processes carrying this run's id that escaped their group; record any that survive."""
    try:
        pids = await _tagged(pool, node, run_id)
        if pids:
            await pool.run(node, remote.kill_pids(pids, "KILL"), None, timeout=10)
            await asyncio.sleep(0.2)
            pids = await _tagged(pool, node, run_id)
        report.leftovers[node.host] = pids
    except ssh.NodeError as exc:
        report.unreachable.setdefault(node.host, exc.reason)


async def log_since(pool: Pool, node: Node, run_dir: str, offset: int, max_bytes: int = 1 << 20) -> bytes:
    path = remote.NodePaths(run_dir, node.host).log
    res = await pool.run(node, remote.read_from(path, offset, max_bytes), None, timeout=30)
    return res.raw


async def log_tail(pool: Pool, node: Node, run_dir: str, lines: int = 40) -> list[str]:
    path = remote.NodePaths(run_dir, node.host).log
    res = await pool.run(node, remote.tail(path, lines), None, timeout=15)
    return res.stdout.splitlines()


async def end_slots(pool: Pool, node: Node, run_dir: str) -> list[dict]:
    """The `end` events in the ranks' slots (`events/rank-<N>.end`) the node can see: every rank's
    in a shared run directory. Read with the shell, not the agent: it works when the agent is
    down, and a slot survives a full disk where the log and the events file do not."""
    res = await pool.run(node, f"cat -- {shlex.quote(run_dir)}/events/rank-*.end 2>/dev/null; true", None, timeout=15)
    return parse_end_slots(res.stdout)


def parse_end_slots(text: str) -> list[dict]:
    """One JSON object per slot line; a slot still blank (the rank has not ended) or torn is skipped."""
    events = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("type") == "end":
            events.append(event)
    return events
