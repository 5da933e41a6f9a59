"""The cluster a job runs on: the local machine or the nodes of a DeepSpeed-style hostfile.

Public API (stable, other parts call it):
    Node, Cluster                                 frozen dataclasses
    parse_hostfile(path) -> Cluster                raises HostfileError (problems name file:line)
    parse_hostfile_text(text, source) -> Cluster   same, for text from the UI
    local_cluster() -> Cluster                     GPUs found with NVML; none = one slot per CPU core, gloo
    cluster_from_dicts(rows, source) -> Cluster    rows as stored by the UI/DB; raises HostfileError
    Cluster.to_dicts() / Cluster.to_hostfile()     the inverse of the two above

Hostfile format, a superset of DeepSpeed's (`deepspeed --hostfile` reads the same file, since it
ignores what follows `slots=N`):

    # comment
    node1 slots=8
    node2 slots=8 addr=10.0.0.2 ssh_user=ubuntu ssh_port=2222 ssh_key=~/.ssh/id_ed25519 python=/opt/venv/bin/python
    cpu-box slots=2 device=cpu
    node3 slots=8 gpu_mem_gib=80

Nothing here imports torch: the studio process stays small.
"""
from __future__ import annotations

import ipaddress
import os
import re
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from backend.job.spec import Problem

Device = Literal["cuda", "cpu"]
DEVICES = ("cuda", "cpu")
HOST_RE = re.compile(r"^[A-Za-z0-9_.:\-\[\]%@]+$")
# DeepSpeed's own pattern (launcher/runner.py `_parse_hostfile`): host, whitespace, slots=digits.
DS_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")
LOCAL_HOST = "localhost"
LOCAL_ADDR = "127.0.0.1"


class HostfileError(ValueError):
    """A hostfile (or node list) that cannot be used; `problems` name `file:line` or `nodes[i].key`."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


@dataclass(frozen=True)
class Node:
    """One machine. `slots` = worker processes it can take (its GPUs, or CPU slots)."""

    host: str
    slots: int
    addr: str | None = None
    """Address the other nodes use to reach this one (rendezvous); `host` when not set."""
    ssh_user: str | None = None
    ssh_port: int = 22
    ssh_key: str | None = None
    python: str = "python3"
    """Interpreter on that node that has swift-studio's worker installed."""
    device: Device = "cuda"
    local: bool = False
    """The machine the studio runs on, reached without SSH."""
    gpu_names: tuple[str, ...] = ()
    gpu_mem_gib: float | None = None
    """Memory of the smallest GPU (GiB), when known: NVML on the local machine, `gpu_mem_gib=` in a hostfile."""
    host_mem_gib: float | None = None
    """The node's host memory (GiB), when known: the local machine's, `host_mem_gib=` in a hostfile."""

    @property
    def address(self) -> str:
        return self.addr or self.host

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["gpu_names"] = list(self.gpu_names)
        return data


@dataclass(frozen=True)
class Cluster:
    nodes: tuple[Node, ...]
    source: str = "local"
    """Where it came from: 'local', a hostfile path, or 'nodes' for a list of dicts."""

    @property
    def backend(self) -> Literal["nccl", "gloo"]:
        """The torch.distributed backend every node can run."""
        return "nccl" if all(n.device == "cuda" for n in self.nodes) else "gloo"

    def devices(self, nnodes: int) -> dict[str, str]:
        """The device ("cuda" or "cpu") of each of the first `nnodes` nodes, by host."""
        return {n.host: n.device for n in self.nodes[:nnodes]}

    @property
    def is_local(self) -> bool:
        return len(self.nodes) == 1 and self.nodes[0].local

    @property
    def all_loopback(self) -> bool:
        return all(is_loopback(n.address) for n in self.nodes)

    def to_dicts(self) -> list[dict[str, Any]]:
        return [n.to_dict() for n in self.nodes]

    def to_hostfile(self) -> str:
        """Hostfile text that `parse_hostfile_text` reads back into the same nodes."""
        lines = []
        for n in self.nodes:
            words = [n.host, f"slots={n.slots}"]
            for key in HOSTFILE_KEYS:
                value = getattr(n, key)
                if value != NODE_DEFAULTS[key]:
                    words.append(f"{key}={value}")
            lines.append(" ".join(words))
        return "\n".join(lines) + "\n"


NODE_DEFAULTS = {f.name: f.default for f in fields(Node) if f.name not in ("host", "slots")}
# Keys a hostfile line may carry after slots=N (gpu_names/local are discovered, not written).
# gpu_mem_gib: GiB of the node's smallest GPU, host_mem_gib: GiB of its host memory, so validation
# can warn before an out-of-memory launch (found on the local machine only).
GIB_KEYS = {"gpu_mem_gib": "GiB per GPU", "host_mem_gib": "GiB of host memory"}
HOSTFILE_KEYS = ("addr", "ssh_user", "ssh_port", "ssh_key", "python", "device", *GIB_KEYS)


def is_loopback(address: str) -> bool:
    if address == LOCAL_HOST:
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def _check_value(key: str, value: str) -> tuple[Any, str | None]:
    """Convert one key=value word; returns (value, error message or None)."""
    if key == "ssh_port":
        if not value.isdigit() or not 1 <= int(value) <= 65535:
            return None, f"ssh_port must be a port number 1-65535, got {value!r}"
        return int(value), None
    if key in GIB_KEYS:
        try:
            gib = float(value)
        except ValueError:
            gib = 0.0
        if not 0 < gib < float("inf"):
            return None, f"{key} must be a positive number of {GIB_KEYS[key]}, got {value!r}"
        return gib, None
    if key == "device":
        if value not in DEVICES:
            return None, f"device must be one of {', '.join(DEVICES)}, got {value!r}"
        return value, None
    if key == "addr" and not HOST_RE.match(value):
        return None, f"addr is not a host name or address: {value!r}"
    if not value:
        return None, f"{key} is empty"
    return value, None


def parse_hostfile_text(text: str, source: str = "hostfile") -> Cluster:
    """Parse hostfile text; every problem is collected and raised at once as HostfileError."""
    problems: list[Problem] = []
    nodes: list[Node] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        where = f"{source}:{lineno}"
        if not line or line.startswith("#"):
            continue
        # A trailing '# comment' is fine (DeepSpeed's regex also ignores it).
        words = line.split("#", 1)[0].split()
        match = DS_LINE.match(line)
        if not match or len(words) < 2 or not re.fullmatch(r"slots=\d+", words[1]):
            problems.append(Problem(where, f"expected 'hostname slots=N [key=value ...]', got {line!r}"))
            continue
        host, slots = match.group(1), int(match.group(2))
        if not HOST_RE.match(host):
            problems.append(Problem(where, f"invalid host name {host!r}"))
            continue
        if slots < 1:
            problems.append(Problem(where, f"{host}: slots must be at least 1"))
        if host in seen:
            problems.append(Problem(where, f"duplicate host {host!r} (first on line {seen[host]})"))
            continue
        seen[host] = lineno
        extra: dict[str, Any] = {}
        for word in words[2:]:
            key, sep, value = word.partition("=")
            if not sep:
                problems.append(Problem(where, f"expected key=value after slots=N, got {word!r}"))
            elif key not in HOSTFILE_KEYS:
                problems.append(Problem(where, f"unknown key {key!r}; known: {', '.join(HOSTFILE_KEYS)}"))
            elif key in extra:
                problems.append(Problem(where, f"{key} given twice"))
            else:
                converted, error = _check_value(key, value)
                if error:
                    problems.append(Problem(where, error))
                else:
                    extra[key] = converted
        nodes.append(Node(host=host, slots=slots, **extra))
    if not nodes and not problems:
        problems.append(Problem(source, "no hosts: expected lines like 'node1 slots=8'"))
    if problems:
        raise HostfileError(problems)
    return Cluster(nodes=tuple(nodes), source=source)


def parse_hostfile(path: str | Path) -> Cluster:
    """Read a hostfile. Raises HostfileError naming the file (and line) for every problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise HostfileError([Problem(str(path), "hostfile not found")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HostfileError([Problem(str(path), f"cannot read hostfile: {exc}")]) from None
    return parse_hostfile_text(text, source=str(path))


def cluster_from_dicts(rows: list[dict[str, Any]], source: str = "nodes") -> Cluster:
    """Build a Cluster from stored rows (keys as in `Node`). Raises HostfileError naming `nodes[i].key`."""
    problems: list[Problem] = []
    nodes: list[Node] = []
    known = {f.name for f in fields(Node)}
    seen: set[str] = set()
    for i, row in enumerate(rows):
        where = f"{source}[{i}]"
        if not isinstance(row, dict):
            problems.append(Problem(where, f"expected a mapping, got {type(row).__name__}"))
            continue
        unknown = sorted(set(row) - known)
        if unknown:
            problems.append(Problem(where, f"unknown key(s): {', '.join(unknown)}"))
        host = str(row.get("host") or "").strip()
        if not host or not HOST_RE.match(host):
            problems.append(Problem(f"{where}.host", f"invalid host name {host!r}"))
            continue
        if host in seen:
            problems.append(Problem(f"{where}.host", f"duplicate host {host!r}"))
            continue
        seen.add(host)
        slots = row.get("slots")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            problems.append(Problem(f"{where}.slots", f"must be a whole number >= 1, got {slots!r}"))
            continue
        values: dict[str, Any] = {}
        for key in HOSTFILE_KEYS:
            value = row.get(key)
            if value is None or value == "" or value == NODE_DEFAULTS[key]:
                continue
            converted, error = _check_value(key, str(value))
            if error:
                problems.append(Problem(f"{where}.{key}", error))
            else:
                values[key] = converted
        if row.get("local") is not None:
            values["local"] = row["local"]
        if row.get("gpu_names"):
            values["gpu_names"] = tuple(row["gpu_names"])
        nodes.append(Node(host=host, slots=slots, **values))
    if not nodes and not problems:
        problems.append(Problem(source, "no nodes"))
    if problems:
        raise HostfileError(problems)
    return Cluster(nodes=tuple(nodes), source=source)


@dataclass(frozen=True)
class GpuInfo:
    names: tuple[str, ...] = field(default_factory=tuple)
    min_mem_gib: float | None = None


def _nvml_gpus() -> GpuInfo:
    """The local GPUs as NVML sees them; none when NVML or its driver library is missing."""
    import pynvml  # nvidia-ml-py: pure Python, loads libnvidia-ml only on nvmlInit

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return GpuInfo()
    try:
        names, mems = [], []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            names.append(name.decode() if isinstance(name, bytes) else name)
            mems.append(pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30)
        return GpuInfo(tuple(names), min(mems) if mems else None)
    finally:
        pynvml.nvmlShutdown()


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, as taskset or a container sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def host_memory_gib() -> float | None:
    """This machine's physical memory (GiB, to 0.01: the hostfile text shows it); None where the OS
    does not say."""
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 2)
    except (ValueError, OSError, AttributeError):
        return None


def local_cluster(gpus: GpuInfo | None = None) -> Cluster:
    """This machine as a one-node cluster: one slot per GPU, or one slot per CPU core this process
    may use (gloo) without GPUs.

    `CUDA_VISIBLE_DEVICES` is not applied here: NVML lists every GPU; the job's env chooses.
    """
    info = _nvml_gpus() if gpus is None else gpus
    common = dict(host=LOCAL_HOST, addr=LOCAL_ADDR, python=sys.executable, local=True, host_mem_gib=host_memory_gib())
    if info.names:
        node = Node(slots=len(info.names), device="cuda", gpu_names=info.names, gpu_mem_gib=info.min_mem_gib, **common)
    else:
        node = Node(slots=usable_cores(), device="cpu", **common)
    return Cluster(nodes=(node,), source="local")
