"""Real OpenSSH servers on loopback addresses (127.0.0.2, 127.0.0.3, ...) for cluster tests.

Each server has its own host key, accepts one client key, and listens only on its own address.
A known_hosts file with every server's key is written next to them. Servers are stopped by the
pid in their PidFile, never by name.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"
REPO = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    from backend.cluster.remote import free_port as pick

    return pick(host)


def keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


@dataclass
class SshServer:
    host: str
    port: int
    pid_file: Path
    host_pub: str

    def pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None


@dataclass
class SshdCluster:
    """Servers plus what a client needs: the key, known_hosts, and a setup line for the nodes."""

    root: Path
    servers: list[SshServer] = field(default_factory=list)
    extra_config: str = ""

    @property
    def key(self) -> Path:
        return self.root / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.root / "known_hosts"

    @property
    def setup(self) -> str:
        """The node setup line tests use: this interpreter first on PATH, the repo importable."""
        bindir = Path(sys.executable).parent
        return f"export PATH={bindir}:$PATH PYTHONPATH={REPO}"

    def nodes(self, user: str = "root") -> tuple:
        """The servers as cluster nodes: one CPU slot each, this interpreter, the cluster's key."""
        from backend.job.cluster import Node

        return tuple(Node(host=s.host, slots=1, ssh_port=s.port, ssh_user=user, ssh_key=str(self.key),
                          python=sys.executable, device="cpu") for s in self.servers)

    def setups(self) -> dict[str, str]:
        return {s.host: self.setup for s in self.servers}

    def cut_connections(self, stop_listeners: bool = False) -> int:
        """Kill every per-connection sshd process (as a network cut ends them), after stopping the
        listeners too when asked (the node is gone for good); returns how many were killed. With
        the listeners stopped, every process still holding the server end of a connection to one of
        the servers is killed too (one forked between the look and the kill): none outlives the cut."""
        import psutil

        ends = {(s.host, s.port) for s in self.servers}
        connections = []
        for server in self.servers:
            pid = server.pid()
            if pid is None:  # no pid file: the server is gone (psutil.Process(None) is this process)
                continue
            try:
                connections += [p for p in psutil.Process(pid).children(recursive=True)
                                if p.name().startswith("sshd")]
            except psutil.NoSuchProcess:
                continue
        if stop_listeners:
            self.stop()
        killed = 0
        for _ in range(50):
            for p in connections:
                try:
                    p.kill()
                    killed += 1
                except psutil.NoSuchProcess:
                    continue
            holders = {c.pid for c in psutil.net_connections(kind="tcp")
                       if stop_listeners and c.pid and c.status == psutil.CONN_ESTABLISHED and tuple(c.laddr) in ends}
            if not holders:
                return killed
            connections = [psutil.Process(pid) for pid in holders if psutil.pid_exists(pid)]
            time.sleep(0.02)
        raise RuntimeError(f"connections to {sorted(ends)} outlived the cut: pids {sorted(holders)}")

    def start(self, hosts: list[str]) -> None:
        if not Path(SSHD).exists():
            raise RuntimeError(f"{SSHD} is missing: install openssh-server (scripts/test.sh does)")
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        self.root.mkdir(parents=True, exist_ok=True)
        keygen(self.key)
        (self.root / "authorized_keys").write_text((self.root / "id_ed25519.pub").read_text())
        os.chmod(self.root / "authorized_keys", 0o600)
        known = []
        for host in hosts:
            server = self._start_one(host)
            self.servers.append(server)
            known.append(f"[{host}]:{server.port} {server.host_pub}")
        self.known_hosts.write_text("\n".join(known) + "\n")
        for server in self.servers:
            _wait_listening(server.host, server.port)

    def _start_one(self, host: str) -> SshServer:
        from backend.cluster.remote import HOST_ID_ENV  # each server a host of its own for admission

        hostkey = self.root / f"hostkey_{host}"
        keygen(hostkey)
        port = free_port(host)
        conf = self.root / f"sshd_{host}.conf"
        pid_file = self.root / f"sshd_{host}.pid"
        conf.write_text(
            f"ListenAddress {host}\nPort {port}\nHostKey {hostkey}\n"
            f"AuthorizedKeysFile {self.root / 'authorized_keys'}\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
            f"PidFile {pid_file}\nSetEnv {HOST_ID_ENV}={host}:{port}\nMaxStartups 100:30:200\nMaxSessions 50\nLogLevel ERROR\n{self.extra_config}")
        subprocess.run([SSHD, "-f", str(conf), "-E", str(self.root / f"sshd_{host}.log")], check=True)
        pub = (self.root / f"hostkey_{host}.pub").read_text().split()
        return SshServer(host, port, pid_file, f"{pub[0]} {pub[1]}")

    def stop(self) -> None:
        for server in self.servers:
            pid = server.pid()
            if pid:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        self.servers.clear()


def _wait_listening(host: str, port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"sshd on {host}:{port} did not start")


def start_cluster(root: Path, count: int, first: int = 2, extra_config: str = "") -> SshdCluster:
    cluster = SshdCluster(root, extra_config=extra_config)
    try:
        cluster.start([f"127.0.0.{first + i}" for i in range(count)])
    except BaseException:
        cluster.stop()
        raise
    return cluster
