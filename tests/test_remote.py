"""Remote command building: quoting, env names, detached start, pid files; hostile values execute nothing."""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.cluster import remote
from backend.cluster.launch import NodeCommand, probe, start_all, stop_all
from backend.cluster.nodes import Pool
from backend.job.cluster import Node

# Names of the variables these tests send: a prefix no caller's environment has (VIRTUAL_ENV, say),
# so what a child reports under it is what the test sent and nothing else.
ENV_PREFIX = f"SWIFT_STUDIO_TEST_{secrets.token_hex(4).upper()}_"
HOSTILE = ["$(touch {m}/dollar)", "`touch {m}/backtick`", "x; touch {m}/semicolon", "a\ntouch {m}/newline",
           "' ; touch {m}/quote ; '", "\" && touch {m}/dq && \"", "| touch {m}/pipe", "> {m}/redirect"]


def hostile(marker_dir: Path) -> list[str]:
    return [h.format(m=marker_dir) for h in HOSTILE]


def test_quote_argv_round_trips_through_a_shell(tmp_path):
    values = hostile(tmp_path)
    out = subprocess.run(["bash", "-c", remote.quote_argv(["printf", "%s\\0", *values])], capture_output=True, text=True)
    assert out.stdout.split("\0")[:-1] == values
    assert list(tmp_path.iterdir()) == []


def test_the_rendezvous_port_is_free_and_outside_the_ephemeral_range():
    """Run as the nodes run it (a script for their python): an outgoing connection can take a port of
    the ephemeral range before torchrun binds it, a listener only one that is free now."""
    import socket

    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = {int(subprocess.run([sys.executable, "-c", remote.FREE_PORT_PY], capture_output=True, text=True,
                                check=True).stdout) for _ in range(3)}
    for port in ports:
        assert not low <= port <= high and port >= 20000
        with socket.socket() as s:
            s.bind(("", port))


@pytest.mark.parametrize("name", ["1X", "A-B", "A B", "A;B", "$(id)", "", "A=B"])
def test_invalid_env_names_are_refused(name):
    with pytest.raises(remote.UnsafeValue, match="invalid environment variable name"):
        remote.env_argv({name: "x"})


def test_env_values_are_data(tmp_path):
    env = {f"{ENV_PREFIX}{i}": v for i, v in enumerate(hostile(tmp_path))}
    cmd = remote.quote_argv([*remote.env_argv(env), sys.executable, "-c",
                             "import os, sys, json; print(json.dumps({k: v for k, v in os.environ.items() "
                             "if k.startswith(sys.argv[1])}))", ENV_PREFIX])
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == env
    assert list(tmp_path.iterdir()) == []


def test_nul_in_env_value_is_refused():
    with pytest.raises(remote.UnsafeValue, match="NUL"):
        remote.env_argv({"A": "x\x00y"})


@pytest.mark.parametrize("pgid", [0, 1, -5])
def test_never_signals_process_group_zero_or_one(pgid):
    with pytest.raises(remote.UnsafeValue):
        remote.signal_group(pgid, "TERM")
    with pytest.raises(remote.UnsafeValue):
        remote.kill_pids([pgid])


def test_signal_names_are_a_fixed_set():
    with pytest.raises(remote.UnsafeValue):
        remote.signal_group(1234, "TERM; rm -rf /")
    assert remote.signal_group(1234, "KILL") == "kill -s KILL -- -1234 2>/dev/null; true"


def test_node_file_names_are_safe():
    assert remote.node_file_name("127.0.0.2") == "127.0.0.2"
    assert remote.node_file_name("gpu-01.example.org") == "gpu-01.example.org"
    assert remote.node_file_name("../../etc/x;$(id)") == "etc_x___id"
    assert "/" not in remote.node_file_name("a/b")


def test_parse_probe():
    assert remote.parse_probe("alive=1 exit=-\n") == (True, None)
    assert remote.parse_probe("motd line\nalive=0 exit=143\n") == (False, 143)
    with pytest.raises(ValueError):
        remote.parse_probe("bash: kill: command not found")


def test_setup_line_runs_first_and_its_failure_stops_the_command(tmp_path):
    ok = remote.with_setup("export GREETING=hello", "echo $GREETING")
    assert subprocess.run(["bash", "-c", ok], capture_output=True, text=True).stdout.strip() == "hello"
    marker = tmp_path / "ran"
    bad = remote.with_setup("false", f"touch {shlex.quote(str(marker))}")
    assert subprocess.run(["bash", "-c", bad]).returncode != 0
    assert not marker.exists()


STANDIN = (
    "import json, os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
    f"print(json.dumps({{'argv': sys.argv[1:], 'env': {{k: v for k, v in os.environ.items() if k.startswith({ENV_PREFIX!r})}},"
    " 'cwd': os.getcwd(), 'pgid': os.getpgid(0), 'sid': os.getsid(0)}), flush=True)\n"
    "time.sleep(60)\n"
)


def _hostile_launch(tmp_path: Path, nodes: list[Node], setup: str | None, known_hosts: Path | None = None):
    """Start a stand-in worker with hostile run dir, argv and env values on every node; stop it."""
    markers = tmp_path / "markers"
    markers.mkdir()
    values = hostile(markers)
    # A path component cannot hold '/', so these markers are relative: looked for in every cwd used.
    run_dir = tmp_path / "run $(touch pwned-dollar); `touch pwned-backtick`; touch pwned-semicolon"
    run_dir.mkdir()
    (run_dir / "standin.py").write_text(STANDIN)
    env = {f"{ENV_PREFIX}{i}": v for i, v in enumerate(values)}

    async def go(pool: Pool):
        cmds = [NodeCommand(n, [sys.executable, str(run_dir / "standin.py"), *values], env, setup) for n in nodes]
        started = await start_all(pool, cmds, "run-$(touch x)", str(run_dir))
        assert all(s.pgid and not s.error for s in started), started
        await asyncio.sleep(1.5)
        states = [await probe(pool, s.node, s.pgid, str(run_dir)) for s in started]
        report = await stop_all(pool, started, "run-$(touch x)", str(run_dir), grace_s=10)
        after = [await probe(pool, s.node, s.pgid, str(run_dir)) for s in started]
        await pool.close()
        return started, states, report, after

    started, states, report, after = asyncio.run(go(Pool(known_hosts)))
    return markers, values, env, run_dir, started, states, report, after


def _check(markers, values, env, run_dir, started, states, report, after):
    assert list(markers.iterdir()) == [], "a hostile value executed"
    for where in (run_dir, run_dir.parent, Path.home(), Path.cwd()):
        assert not list(where.glob("pwned-*")), f"a hostile run directory name executed in {where}"
    assert all(alive for alive, _ in states)
    assert report.clean, report
    assert after and all(not alive for alive, _ in after)
    assert all(code == 143 for _, code in after)  # the stand-in saw SIGTERM and the wrapper recorded it
    for s in started:
        name = remote.node_file_name(s.node.host)
        assert int((run_dir / "pids" / f"{name}.pid").read_text()) == s.pgid
        seen = json.loads((run_dir / "logs" / f"{name}.log").read_text().splitlines()[0])
        assert seen["argv"] == values and seen["env"] == env
        assert seen["cwd"] == str(run_dir)
        # its own session and process group, led by the wrapper whose id is in the pid file
        assert seen["pgid"] == seen["sid"] == s.pgid


def test_hostile_values_execute_nothing_on_the_local_machine(tmp_path):
    node = Node(host="localhost", slots=1, local=True, python=sys.executable, device="cpu")
    _check(*_hostile_launch(tmp_path, [node], None))


@pytest.mark.e2e
def test_hostile_values_execute_nothing_over_ssh(tmp_path, sshd_nodes):
    nodes = list(sshd_nodes.nodes())
    _check(*_hostile_launch(tmp_path, nodes, sshd_nodes.setup, sshd_nodes.known_hosts))


def test_workers_outlive_the_starting_shell(tmp_path):
    """Detached: the start command returns at once, the worker keeps running in its own session."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cmd = remote.detached_start(["sleep", "30"], {}, remote.NodePaths(str(run_dir), "n"), "rid")
    t = time.monotonic()
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=20)
    assert time.monotonic() - t < 5
    pgid = int(out.stdout.strip())
    try:
        os.killpg(pgid, 0)  # still alive after the shell exited
        assert os.getsid(pgid) == pgid
    finally:
        os.killpg(pgid, 9)


def test_running_ranks_are_counted_per_run_rank_and_host_id():
    """`/proc/*/environ` records: a rank's children (same local rank) count once, the torchrun agent
    (no local rank) not at all, nor ranks started under another host id or without a tag."""
    from backend.cluster.remote import parse_ranks

    def proc(pid, **env):
        return "".join(f"/proc/{pid}/environ:{k}={v}\0" for k, v in env.items())

    tag, host = "SWIFT_STUDIO_RUN_ID", "SWIFT_STUDIO_HOST_ID"
    text = ("self=\0" + proc(10, **{tag: "a"}) + proc(11, **{tag: "a", "LOCAL_RANK": "0"})
            + proc(12, **{tag: "a", "LOCAL_RANK": "0"}) + proc(13, **{tag: "a", "LOCAL_RANK": "1"})
            + proc(14, **{tag: "b", "LOCAL_RANK": "0", host: "box-2"}) + proc(15, LOCAL_RANK="0"))
    assert parse_ranks(text) == {"a": 2}
    assert parse_ranks(text.replace("self=", "self=box-2", 1)) == {"b": 1}
    assert parse_ranks("") == {}
