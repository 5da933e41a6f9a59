"""A real one-node Slurm cluster on this machine (Debian's slurm-wlm + munge) for the Slurm tests.

munged runs as the munge user on a socket of its own in the cluster's directory (the system's
socket and daemons are left alone); slurmctld and slurmd listen on free ports, on localhost
only, with every state, spool, log and pid file in the same directory. Daemons are stopped by
the pids in their pid files, never by name. `SLURM_CONF` in `env()` points Slurm's client tools
at this cluster.
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sshd import free_port

MUNGED, SLURMCTLD, SLURMD = "/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd"
MUNGE_KEY = Path("/etc/munge/munge.key")
# The workers save a checkpoint on SIGTERM within the planner's stop budget (30 s); Slurm's
# SIGKILL must come after that (KillWait), not at its default 30 s.
KILL_WAIT_S = 45


def missing() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    absent = [b for b in (MUNGED, SLURMCTLD, SLURMD, shutil.which("sbatch") or "sbatch") if not os.path.exists(b)]
    if absent:
        return f"Slurm/munge not installed (missing {', '.join(absent)}; scripts/test.sh installs slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the Slurm test cluster runs slurmd as root (it starts jobs as their user)"
    return None


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    munge_socket: Path | None = None

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env(), capture_output=True, text=True, check=check, timeout=30)

    def pid_files(self) -> list[Path]:
        files = [self.root / "slurmd.pid", self.root / "slurmctld.pid"]
        return files + ([self.munge_socket.parent / "munged.pid"] if self.munge_socket else [])

    def stop(self) -> None:
        for pid_file in self.pid_files():
            pid = _read_pid(pid_file)
            if pid is None:
                continue
            _signal(pid, signal.SIGTERM)
            if not _gone(pid, 10):
                _signal(pid, signal.SIGKILL)
                _gone(pid, 5)
        if self.munge_socket:
            shutil.rmtree(self.munge_socket.parent, ignore_errors=True)


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 1 else None


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _gone(pid: int, timeout: float) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _munge() -> Path:
    """munged as the munge user on a socket in a new directory, with the system's key (made if absent)."""
    munge = pwd.getpwnam("munge")
    if not MUNGE_KEY.exists():
        MUNGE_KEY.parent.mkdir(mode=0o700, exist_ok=True)
        MUNGE_KEY.write_bytes(os.urandom(1024))
        os.chown(MUNGE_KEY.parent, munge.pw_uid, munge.pw_gid)
        os.chown(MUNGE_KEY, munge.pw_uid, munge.pw_gid)
        MUNGE_KEY.chmod(0o400)
    # Its own directory outside `root`: munged needs every directory above its socket searchable
    # by all, and pytest's temporary directories are private to root.
    d = Path(tempfile.mkdtemp(prefix="swift-studio-munge-"))
    d.chmod(0o755)
    os.chown(d, munge.pw_uid, munge.pw_gid)
    sock = d / "munge.sock"
    subprocess.run(["runuser", "-u", "munge", "--", MUNGED, f"--socket={sock}", f"--pid-file={d / 'munged.pid'}",
                    f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munged.seed'}"], check=True, timeout=30)
    return sock


CONF = """\
ClusterName=swiftstudio
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
KillWait={kill_wait}
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
MinJobAge=300
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def start(root: Path, timeout: float = 60.0) -> SlurmCluster:
    """Start munged, slurmctld and slurmd under `root`; returns once `sinfo` shows the node idle."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "state").mkdir()
    (root / "spool").mkdir()
    cluster = SlurmCluster(root=root, conf=root / "slurm.conf")
    try:
        cluster.munge_socket = _munge()
        memory_mib = max(1000, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20) // 2)
        cluster.conf.write_text(CONF.format(root=root, ctld_port=free_port(), slurmd_port=free_port(),
                                            munge_socket=cluster.munge_socket, kill_wait=KILL_WAIT_S,
                                            cpus=usable_cpus(), memory=memory_mib))
        env = cluster.env()
        subprocess.run([SLURMCTLD, "-f", str(cluster.conf)], env=env, check=True, timeout=30)
        subprocess.run([SLURMD, "-f", str(cluster.conf)], env=env, check=True, timeout=30)
        end, state = time.time() + timeout, ""
        while time.time() < end:
            out = cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False)
            state = out.stdout.strip()
            if state.rstrip("*") == "idle":
                return cluster
            time.sleep(0.5)
        logs = "\n".join((root / f).read_text()[-2000:] for f in ("slurmctld.log", "slurmd.log") if (root / f).exists())
        raise RuntimeError(f"the Slurm node is not idle after {timeout:.0f} s (sinfo: {state!r})\n{logs}")
    except BaseException:
        cluster.stop()
        raise
