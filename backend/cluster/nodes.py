"""Nodes: the inventory in the database, and one reusable connection per node.

A node is a `backend.job.cluster.Node` plus an optional setup line (shell text the node's owner
writes, e.g. `source ~/venv/bin/activate`) that runs before every command on that node. The
local machine is reached with local subprocesses, every other node over SSH.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, select

from backend.cluster import remote, ssh
from backend.job.cluster import Cluster, Node, cluster_from_dicts
from backend.store.models import HostKeyTrust, NodeRecord

Setups = Mapping[str, str]   # host -> setup line


def address_of(node: Node) -> ssh.Address:
    return ssh.Address(host=node.host, port=node.ssh_port, user=node.ssh_user,
                       key_path=node.ssh_key, local=node.local)


# -- inventory ---------------------------------------------------------------------------------

_NODE_FIELDS = ("host", "slots", "addr", "ssh_user", "ssh_port", "ssh_key", "python", "device", "local", "gpu_mem_gib",
                "host_mem_gib")


def set_inventory(engine: Engine, cluster: Cluster, setups: Setups | None = None) -> None:
    """Make the cluster's nodes the inventory's, in its order. A node keeps its stored setup line
    unless `setups` names its host ("" clears it). Nodes left out stay as rows without a place
    (their setup lines serve `swift-studio run --hostfile` on them), and come back with them.
    Another process adding the same new host at the same moment makes this one write again over
    its row (host names are unique), rather than fail."""
    setups = setups or {}
    for last in (False, True):
        try:
            _write_inventory(engine, cluster, setups)
            return
        except IntegrityError:
            if last:
                raise


def _write_inventory(engine: Engine, cluster: Cluster, setups: Setups) -> None:
    with Session(engine) as s:
        rows = {r.host: r for r in s.exec(select(NodeRecord))}
        for host in rows.keys() - {n.host for n in cluster.nodes}:
            rows[host].position = None
            s.add(rows[host])
        for position, node in enumerate(cluster.nodes):
            row = rows.get(node.host) or NodeRecord(host=node.host)
            for key in _NODE_FIELDS:
                setattr(row, key, getattr(node, key))
            row.position = position
            if node.host in setups:
                row.setup = setups[node.host] or None
            s.add(row)
        s.commit()


def load_inventory(engine: Engine) -> tuple[Cluster, dict[str, str]] | None:
    """The inventory's cluster in its order, with the setup line of each of its hosts that has one;
    None while no node has a place in it (rows written before places existed have none)."""
    rows = sorted((r for r in inventory(engine) if r.position is not None), key=lambda r: (r.position, r.id))
    if not rows:
        return None
    nodes = [{key: getattr(r, key) for key in _NODE_FIELDS if getattr(r, key) is not None} for r in rows]
    return cluster_from_dicts(nodes, source="inventory"), {r.host: r.setup for r in rows if r.setup}


def inventory(engine: Engine) -> list[NodeRecord]:
    with Session(engine) as s:
        return list(s.exec(select(NodeRecord).order_by(NodeRecord.id)))


def setups_for(engine: Engine, cluster: Cluster, given: Setups | None = None) -> dict[str, str]:
    """Setup line per host: given ones first, else the inventory's."""
    stored = {r.host: r.setup for r in inventory(engine) if r.setup}
    result = {}
    for node in cluster.nodes:
        line = (given or {}).get(node.host) or stored.get(node.host)
        if line:
            result[node.host] = line
    return result


def record_trust(engine: Engine, address: ssh.Address, fingerprint: str, known_hosts: Path) -> None:
    with Session(engine) as s:
        s.add(HostKeyTrust(host=address.host, port=address.port, fingerprint=fingerprint,
                           known_hosts=str(known_hosts)))
        s.commit()


def node_to_dict(node: Node, setup: str | None) -> dict:
    return {**node.to_dict(), "setup": setup}


def node_from_dict(data: dict) -> tuple[Node, str | None]:
    data = dict(data)
    setup = data.pop("setup", None)
    known = {f.name for f in fields(Node)}
    cluster = cluster_from_dicts([{k: v for k, v in data.items() if k in known}], source="attempt")
    return cluster.nodes[0], setup


# -- connections -------------------------------------------------------------------------------


def _helper_command(node: Node, setup: str | None) -> str:
    return remote.with_setup(setup, remote.quote_argv([node.python, "-u", "-c", ssh.HELPER_PY]))


class Pool:
    """One shell per node, opened on first use and reopened after a drop."""

    def __init__(self, known_hosts: Path | None = None):
        self.known_hosts = known_hosts
        self._shells: dict[ssh.Address, ssh.Shell] = {}
        self._locks: dict[ssh.Address, asyncio.Lock] = {}

    async def shell(self, node: Node) -> ssh.Shell:
        address = address_of(node)
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            shell = self._shells.get(address)
            if shell is None or shell.closed:
                shell = await ssh.connect(address, self.known_hosts)
                self._shells[address] = shell
            return shell

    async def run(self, node: Node, command: str, setup: str | None = None, input: str | None = None,
                  timeout: float = ssh.COMMAND_TIMEOUT_S) -> ssh.Result:
        """Run shell text on the node after its setup line; a dropped connection is reopened once."""
        for attempt in (0, 1):
            shell = await self.shell(node)
            try:
                if isinstance(shell, ssh.SshShell):
                    helper = await shell.helper(node.python, _helper_command(node, setup), reuse_any=not setup)
                    if helper is not None:
                        return await helper.run(command, input=input, timeout=timeout)
                return await shell.run(remote.with_setup(setup, command), input=input, timeout=timeout)
            except ssh.Unreachable:
                await self.drop(node)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def check_python(self, node: Node, setup: str | None, timeout: float = 30.0) -> ssh.Result:
        """Whether the node's python runs after its setup line. Over SSH a started command helper
        (itself that python) is the proof, and later commands reuse it."""
        shell = await self.shell(node)
        if isinstance(shell, ssh.SshShell):
            helper = await shell.helper(node.python, _helper_command(node, setup))
            if helper is not None:
                return ssh.Result(0, "", "")
        return await shell.run(remote.with_setup(setup, remote.quote_argv([node.python, "-c", "import sys"])),
                               timeout=timeout)

    async def drop(self, node: Node) -> None:
        shell = self._shells.pop(address_of(node), None)
        if shell is not None:
            await shell.close()

    async def close(self) -> None:
        shells = list(self._shells.values())
        self._shells.clear()
        await asyncio.gather(*(s.close() for s in shells), return_exceptions=True)
