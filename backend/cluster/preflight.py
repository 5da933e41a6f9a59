"""Pre-flight: every check on every node at once, before anything starts.

Round 1 (one command per node): login, the clock, package versions (read from files, nothing is
imported: torch alone takes seconds), GPUs through NVML, free disk, the network interface, a
token written into the output directory, and on the master a free port for the rendezvous.
Round 2: every node looks for every other node's token (shared storage) and connects to the
master's port while the master listens (reachability). Round 3, optional: an all-reduce through
torchrun across the nodes, reporting bus bandwidth.

Results are rows node × check → ok / warning / error, each with the reason and the fix.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Literal

from backend.cluster import launch, remote, ssh
from backend.cluster.nodes import Pool, address_of
from backend.job import modelfiles
from backend.job.modelfiles import is_adapter, model_dirs
from backend.job.cluster import Cluster, Node
from backend.job.spec import JobSpec, absolute_dir

Status = Literal["ok", "warning", "error", "skipped"]
CLOCK_SKEW_ERROR_S = 5.0
CLOCK_SKEW_WARN_S = 1.0
DISK_WARN_GIB = 20.0
DISK_ERROR_GIB = 2.0
GPU_BUSY_GIB = 1.0
PROBE_TIMEOUT_S = 30.0
REACH_TIMEOUT_S = 8.0
BANDWIDTH_TIMEOUT_S = 180.0
PACKAGES = ("torch", "deepspeed", "transformers", "peft")
CHECKS = ("ssh", "clock", "python", *PACKAGES, "cuda", "nccl", "gpus", "disk", "interface",
          "shared_dir", "model", "ref_model", "port", "bandwidth")
TOKEN_DIR = ".swift-studio-preflight"


@dataclass(frozen=True)
class CheckResult:
    node: str
    check: str
    status: Status
    reason: str
    fix: str = ""


@dataclass
class PreflightReport:
    results: list[CheckResult] = field(default_factory=list)
    bandwidth: dict | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.errors()

    def errors(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "error"]

    def warnings(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "warning"]

    def get(self, node: str, check: str) -> CheckResult | None:
        return next((r for r in self.results if r.node == node and r.check == check), None)

    def table(self) -> tuple[list[str], list[str], dict[tuple[str, str], CheckResult]]:
        """(node names, check names, cell per (node, check)) for a node × check grid."""
        nodes = list(dict.fromkeys(r.node for r in self.results))
        checks = [c for c in CHECKS if any(r.check == c for r in self.results)]
        return nodes, checks, {(r.node, r.check): r for r in self.results}

    def to_dict(self) -> dict:
        return {"ok": self.ok, "seconds": self.seconds, "bandwidth": self.bandwidth,
                "results": [asdict(r) for r in self.results]}

    def text(self) -> str:
        lines = []
        for r in self.results:
            if r.status == "ok" and r.check not in ("bandwidth",):
                continue
            fix = f" (fix: {r.fix})" if r.fix and r.status in ("error", "warning") else ""
            lines.append(f"{r.status.upper():7} {r.node:>15}  {r.check:<12} {r.reason}{fix}")
        oks = sum(1 for r in self.results if r.status == "ok")
        lines.append(f"{oks} checks ok, {len(self.warnings())} warnings, {len(self.errors())} errors "
                     f"in {self.seconds:.1f} s")
        return "\n".join(lines)


# The node side of round 1; runs with the node's python and its setup line. Reads versions from
# dist-info / version files of the module that *would* be imported (honours PYTHONPATH).
# backend.job.modelfiles rides along (standard library only) for the model directory's check.
PROBE_PY = inspect.getsource(modelfiles) + r'''
import glob, importlib.util, json, os, platform, re, shutil, socket, sys, time
p = json.loads(sys.argv[1])
out = {"time": time.time(), "python": platform.python_version(), "executable": sys.executable,
       "hostname": socket.gethostname(), "packages": {}}
def version(name):
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin:
        return None, None
    pkg = os.path.dirname(spec.origin)
    for meta in sorted(glob.glob(os.path.join(os.path.dirname(pkg), name + "-*.dist-info", "METADATA"))):
        for line in open(meta, errors="replace"):
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip(), pkg
    for f in ("version.py", "__init__.py"):
        try:
            m = re.search(r"^__version__\s*(?::\s*\w+\s*)?=\s*['\"]([^'\"]+)", open(os.path.join(pkg, f)).read(), re.M)
        except OSError:
            continue
        if m:
            return m.group(1), pkg
    return "unknown", pkg
for name in p["packages"]:
    v, where = version(name)
    out["packages"][name] = {"version": v, "path": where}
tv = out["packages"].get("torch", {}).get("path")
if tv:
    try:
        m = re.search(r"^cuda\s*(?::\s*[\w\[\]]+\s*)?=\s*['\"]([^'\"]+)", open(os.path.join(tv, "version.py")).read(), re.M)
        out["cuda"] = m.group(1) if m else None
    except OSError:
        out["cuda"] = None
nccl = glob.glob(os.path.join(os.path.dirname(tv or "/nonexistent"), "nvidia_nccl_cu*-*.dist-info"))
out["nccl"] = os.path.basename(nccl[0]).split("-")[1] if nccl else None
try:
    import pynvml
    pynvml.nvmlInit()
    gpus = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        name = pynvml.nvmlDeviceGetName(h)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        gpus.append({"name": name.decode() if isinstance(name, bytes) else name,
                     "used_gib": mem.used / 2**30, "total_gib": mem.total / 2**30})
    drv = pynvml.nvmlSystemGetDriverVersion()
    out["driver"] = drv.decode() if isinstance(drv, bytes) else drv
    out["gpus"] = gpus
except Exception as exc:
    out["gpus"] = []
    out["nvml_error"] = type(exc).__name__
d = p["output_dir"]
try:
    os.makedirs(os.path.join(d, p["token_dir"]), exist_ok=True)
    with open(os.path.join(d, p["token_dir"], p["token"]), "w") as f:
        f.write(p["token"])
    out["token_written"] = True
except OSError as exc:
    out["token_written"] = False
    out["token_error"] = str(exc)
probe = d
while probe and not os.path.exists(probe):
    probe = os.path.dirname(probe)
try:
    out["disk_free_gib"] = shutil.disk_usage(probe or "/").free / 2**30
except OSError:
    out["disk_free_gib"] = None
out["interfaces"] = [n for _, n in socket.if_nameindex()]
out["model_problems"] = {
    field: dir_problems(field, m) if os.path.isdir(m) else [m + ": no such directory on this node"]
    for field, m in (p.get("model_dirs") or {}).items()}
if p.get("pick_port"):
    s = socket.socket(); s.bind(("", 0)); out["picked_port"] = s.getsockname()[1]; s.close()
print(json.dumps(out))
'''

# Round 2: look for every node's token; the master listens on the port, the others connect.
REACH_PY = r'''
import json, os, socket, sys, time
p = json.loads(sys.argv[1])
d = os.path.join(p["output_dir"], p["token_dir"])
out = {"seen": [t for t in p["tokens"] if os.path.exists(os.path.join(d, t))]}
end = time.time() + p["timeout"]
if p["role"] == "master":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("", p["port"])); s.listen(64); s.settimeout(0.2)
    got = 0
    while got < p["peers"] and time.time() < end:
        try:
            c, _ = s.accept(); c.close(); got += 1
        except socket.timeout:
            pass
    s.close()
    out["accepted"] = got
    for t in p["tokens"]:
        try:
            os.remove(os.path.join(d, t))
        except OSError:
            pass
    try:
        os.rmdir(d)
    except OSError:
        pass
elif p["role"] == "peer":
    err = None
    while time.time() < end:
        try:
            socket.create_connection((p["addr"], p["port"]), timeout=2).close()
            out["connected"] = True
            break
        except OSError as exc:
            err = exc.strerror or str(exc)
            time.sleep(0.1)
    else:
        out["connected"] = False
        out["error"] = err
print(json.dumps(out))
'''


def _iface_ok(spec_value: str, interfaces: list[str]) -> bool:
    """NCCL_SOCKET_IFNAME semantics: comma list of prefixes, `=name` exact, `^x` excludes."""
    wanted = [w.strip() for w in spec_value.split(",") if w.strip()]
    include = [w for w in wanted if not w.startswith("^")]
    if not include:
        return True
    for w in include:
        if w.startswith("="):
            if w[1:] in interfaces:
                return True
        elif any(i.startswith(w) for i in interfaces):
            return True
    return False


class ProbeFailed(ssh.NodeError):
    """The node answered, but its python could not run the check."""

    kind = "python"


@dataclass
class _NodeProbe:
    node: Node
    setup: str | None
    data: dict | None = None
    error: ssh.NodeError | None = None
    rtt: tuple[float, float] = (0.0, 0.0)


def evaluate_round1(probes: list[_NodeProbe], spec: JobSpec | None, ifname: str | None) -> list[CheckResult]:
    """Pure: the round-1 rows from what every node reported."""
    rows: list[CheckResult] = []
    ok_probes = [p for p in probes if p.data]
    ref = ok_probes[0] if ok_probes else None
    nproc = spec.nproc_per_node if spec and spec.nproc_per_node else None
    for p in probes:
        host = p.node.host
        if p.error is not None:
            fix = {"unreachable": "check the host name/port and that sshd runs; firewalls",
                   "auth": "add your public key to the node's ~/.ssh/authorized_keys, or fix ssh_key",
                   "host_key": "verify the fingerprint, then trust the host key (swift-studio trust-host)",
                   }.get(p.error.kind, "check the node's setup line and python")
            rows.append(CheckResult(host, "ssh", "error", p.error.reason, fix))
            continue
        if p.data is None:
            continue
        d = p.data
        rows.append(CheckResult(host, "ssh", "ok", f"logged in ({d.get('hostname')})"))
        skew = clock_skew(d["time"], *p.rtt)
        status: Status = "error" if abs(skew) > CLOCK_SKEW_ERROR_S else "warning" if abs(skew) > CLOCK_SKEW_WARN_S else "ok"
        rows.append(CheckResult(host, "clock", status, f"{skew:+.2f} s against the studio (±{(p.rtt[1] - p.rtt[0]) / 2:.2f} s)",
                                "" if status == "ok" else "enable NTP (chrony/systemd-timesyncd) on every node"))
        rows.append(_same(host, "python", d["python"], ref.data["python"] if ref else None, ref.node.host if ref else "",
                          f"python {d['python']} ({d['executable']})", "use the same Python version on every node (node python= / setup line)"))
        for name in PACKAGES:
            info = d["packages"].get(name) or {}
            version = info.get("version")
            if version is None:
                rows.append(CheckResult(host, name, "error", f"{name} is not installed for {d['executable']}",
                                        f"pip install {name} (in the environment the node's setup line activates)"))
                continue
            ref_v = ((ref.data["packages"].get(name) or {}).get("version")) if ref else None
            rows.append(_same(host, name, version, ref_v, ref.node.host if ref else "",
                              f"{name} {version} from {info.get('path')}",
                              f"install {name}=={ref_v} here, or fix the node's setup line / PYTHONPATH"))
        gpu_node = p.node.device == "cuda"
        if gpu_node:
            rows.append(_same(host, "cuda", d.get("cuda"), ref.data.get("cuda") if ref else None, ref.node.host if ref else "",
                              f"torch built for CUDA {d.get('cuda')}", "install the same torch CUDA build on every node"))
            rows.append(_same(host, "nccl", d.get("nccl"), ref.data.get("nccl") if ref else None, ref.node.host if ref else "",
                              f"NCCL {d.get('nccl')}", "install the same nvidia-nccl package on every node"))
        rows.append(_gpus(host, d, gpu_node, nproc or (p.node.slots if gpu_node else None)))
        free = d.get("disk_free_gib")
        if free is None:
            rows.append(CheckResult(host, "disk", "warning", "free space unknown", ""))
        else:
            status = "error" if free < DISK_ERROR_GIB else "warning" if free < DISK_WARN_GIB else "ok"
            rows.append(CheckResult(host, "disk", status, f"{free:.1f} GiB free for the output directory",
                                    "" if status == "ok" else "free space or point output_dir at a larger volume"))
        if ifname:
            found = _iface_ok(ifname, d.get("interfaces", []))
            rows.append(CheckResult(host, "interface", "ok" if found else "error",
                                    f"NCCL_SOCKET_IFNAME={ifname} " + ("matches" if found else
                                    f"matches no interface (have: {', '.join(d.get('interfaces', []))})"),
                                    "" if found else "set NCCL_SOCKET_IFNAME (job env) to an interface every node has"))
        if not d.get("token_written"):
            rows.append(CheckResult(host, "shared_dir", "error", f"cannot write the output directory: {d.get('token_error')}",
                                    "create the output directory with write permission on every node"))
        for check, bad in d.get("model_problems", {}).items():
            whole = ("adapter config and weights" if is_adapter(check) else
                     "weights and tokenizer" if check == "model" else "weights")
            rows.append(CheckResult(host, check, "error" if bad else "ok",
                                    "; ".join(bad) if bad else f"{whole} whole in {model_dirs(spec)[check]}",
                                    f"copy the {check} directory whole to this node, or onto storage every node shares"
                                    if bad else ""))
    return rows


def node_model_dirs(spec: JobSpec | None) -> dict[str, str]:
    """The model directories each node must hold, by field: the absolute paths (a hub id or a
    relative path is not one the nodes can be asked about)."""
    return {field: path for field, path in model_dirs(spec).items() if os.path.isabs(path)} if spec else {}


def clock_skew(node_time: float, sent: float, received: float) -> float:
    """The smallest offset of the node's clock consistent with the round trip: a node reading its
    clock between `sent` and `received` (studio time) may be exactly in sync, however slow the
    answer."""
    if node_time < sent:
        return node_time - sent
    if node_time > received:
        return node_time - received
    return 0.0


def _same(host: str, check: str, value, ref_value, ref_host: str, text: str, fix: str) -> CheckResult:
    if ref_value is None or value == ref_value:
        return CheckResult(host, check, "ok", text)
    return CheckResult(host, check, "error", f"{text}; the master {ref_host} has {ref_value}", fix)


def _gpus(host: str, d: dict, gpu_node: bool, needed: int | None) -> CheckResult:
    gpus = d.get("gpus") or []
    if not gpu_node:
        return CheckResult(host, "gpus", "ok", f"CPU node (gloo); {len(gpus)} GPU(s) seen")
    if not gpus:
        return CheckResult(host, "gpus", "error", f"no GPU visible (NVML: {d.get('nvml_error', 'none found')})",
                           "install the NVIDIA driver, or mark the node device=cpu")
    names = sorted({g["name"] for g in gpus})
    busy = [f"GPU {i}: {g['used_gib']:.1f} GiB" for i, g in enumerate(gpus) if g["used_gib"] > GPU_BUSY_GIB]
    text = f"{len(gpus)}× {', '.join(names)}, driver {d.get('driver')}"
    if needed and len(gpus) < needed:
        return CheckResult(host, "gpus", "error", f"{text}: fewer than nproc_per_node={needed}",
                           "lower nproc_per_node or use nodes with more GPUs")
    if busy:
        return CheckResult(host, "gpus", "warning", f"{text}; memory already in use: {', '.join(busy)}",
                           "stop the processes holding GPU memory (nvidia-smi)")
    if len(names) > 1:
        return CheckResult(host, "gpus", "warning", f"{text}: mixed GPU models", "the slowest GPU sets the pace")
    return CheckResult(host, "gpus", "ok", text)


def allocation_params(output_dir: str, token: str, spec: JobSpec | None) -> dict:
    """PROBE_PY's parameters for a node of a Slurm allocation (no port: the script picks it)."""
    return {"packages": list(PACKAGES), "output_dir": output_dir, "token_dir": TOKEN_DIR, "token": token,
            "pick_port": False, "model_dirs": node_model_dirs(spec)}


def evaluate_allocation(found: Mapping[str, dict | None], spec: JobSpec, gpus_per_node: int) -> list[CheckResult]:
    """Pure: the pre-flight rows of a Slurm allocation from each node's PROBE_PY report (None: the
    node's report is not in the shared run directory). The same checks as on SSH nodes but login,
    the clock (srun started the probes, there is no round trip to measure) and the port."""
    device = "cuda" if gpus_per_node else "cpu"
    probes, rows = [], []
    for host, data in found.items():
        if data is None:
            rows.append(CheckResult(host, "shared_dir", "error", "its pre-flight report is not in the run directory "
                                    "as the allocation's first node sees it",
                                    "put output_dir on storage every node of the partition shares"))
            continue
        probes.append(_NodeProbe(Node(host=host, slots=gpus_per_node or spec.nproc_per_node or 1, device=device),
                                 None, data, rtt=(data["time"], data["time"])))
    rows += [r for r in evaluate_round1(probes, spec, spec.env.get("NCCL_SOCKET_IFNAME") or None)
             if r.check not in ("ssh", "clock")]
    return rows


async def _round1(pool: Pool, node: Node, setup: str | None, params: dict) -> _NodeProbe:
    probe = _NodeProbe(node, setup)
    try:
        sent = time.time()
        res = await pool.run(node, remote.quote_argv([node.python, "-c", PROBE_PY, json.dumps(params)]), setup,
                             timeout=PROBE_TIMEOUT_S)
        received = time.time()
    except ssh.NodeError as exc:
        probe.error = exc
        return probe
    if not res.ok:
        probe.error = ProbeFailed(address_of(node), f"{node.python} failed on the node: {res.first_error_line()}")
        return probe
    try:
        probe.data = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        probe.error = ProbeFailed(address_of(node), f"unreadable probe output: {res.first_error_line()}")
    probe.rtt = (sent, received)
    return probe


async def _reach(pool: Pool, node: Node, setup: str | None, params: dict) -> dict | None:
    try:
        res = await pool.run(node, remote.quote_argv([node.python, "-c", REACH_PY, json.dumps(params)]), setup,
                             timeout=REACH_TIMEOUT_S + 15)
        return json.loads(res.stdout.strip().splitlines()[-1]) if res.ok else {"error": res.first_error_line()}
    except (ssh.NodeError, ValueError, IndexError) as exc:
        return {"error": str(exc)}


async def run_preflight(pool: Pool, cluster: Cluster, spec: JobSpec | None = None,
                        setups: Mapping[str, str] | None = None, bandwidth: bool = True) -> PreflightReport:
    started = time.perf_counter()
    setups = setups or {}
    nodes = list(cluster.nodes[: spec.nnodes] if spec else cluster.nodes)
    output_dir = absolute_dir(spec.output_dir if spec else "output")
    run_token = secrets.token_hex(6)
    tokens = [f"{run_token}-{i}" for i in range(len(nodes))]
    probes = await asyncio.gather(*(
        _round1(pool, n, setups.get(n.host), {
            "packages": list(PACKAGES), "output_dir": output_dir, "token_dir": TOKEN_DIR, "token": tokens[i],
            "pick_port": i == 0, "model_dirs": node_model_dirs(spec)})
        for i, n in enumerate(nodes)))
    report = PreflightReport()
    report.results += evaluate_round1(probes, spec, (spec.env.get("NCCL_SOCKET_IFNAME") or None) if spec else None)
    master = probes[0]
    if master.data:
        report.results += await _round2(pool, probes, tokens, master.data["picked_port"], output_dir)
    else:
        for p in probes:
            if p.data:
                report.results.append(CheckResult(p.node.host, "port", "skipped", "the master did not answer"))
    if bandwidth:
        report.results += await _bandwidth(pool, probes, spec, report)
    # Nodes the job does not use are shown as such, not left out of the report without a word.
    report.results += [CheckResult(n.host, "ssh", "skipped", f"not checked: the job (nnodes: {len(nodes)}) runs on the "
                                                             f"first {len(nodes)} of the cluster's {len(cluster.nodes)} nodes")
                       for n in cluster.nodes[len(nodes):]]
    report.seconds = time.perf_counter() - started
    order = {c: i for i, c in enumerate(CHECKS)}
    node_order = {n.host: i for i, n in enumerate(cluster.nodes)}
    report.results.sort(key=lambda r: (node_order.get(r.node, 99), order.get(r.check, 99)))
    return report


async def _round2(pool: Pool, probes: list[_NodeProbe], tokens: list[str], port: int,
                  output_dir: str) -> list[CheckResult]:
    master = probes[0]
    addr = master.node.address
    peers = [p for p in probes[1:] if p.data]
    common = {"output_dir": output_dir, "token_dir": TOKEN_DIR, "tokens": tokens, "port": port,
              "addr": addr, "timeout": REACH_TIMEOUT_S}
    master_task = _reach(pool, master.node, master.setup, {**common, "role": "master", "peers": len(peers)})
    peer_tasks = [_reach(pool, p.node, p.setup, {**common, "role": "peer"}) for p in peers]
    results = await asyncio.gather(master_task, *peer_tasks)
    rows: list[CheckResult] = []
    written = {tokens[i]: p.node.host for i, p in enumerate(probes) if p.data and p.data.get("token_written")}
    host_port = f"{addr}:{port}"
    rows.append(CheckResult(master.node.host, "port", "ok", f"free port {port} found for the rendezvous"))
    for p, res in zip([master, *peers], results):
        host = p.node.host
        if "error" in res and "seen" not in res:
            rows.append(CheckResult(host, "shared_dir", "error", f"check failed: {res['error']}", ""))
            continue
        missing = [h for t, h in written.items() if t not in res.get("seen", [])]
        if len(probes) > 1 and p.data and p.data.get("token_written"):
            if missing:
                rows.append(CheckResult(host, "shared_dir", "error",
                                        f"{output_dir} is not shared: files written by {', '.join(missing)} are not visible here",
                                        "mount the same shared storage (NFS, Lustre, ...) at the output directory on every node"))
            else:
                rows.append(CheckResult(host, "shared_dir", "ok", f"{output_dir} is shared with every node"))
        elif p.data and p.data.get("token_written"):
            rows.append(CheckResult(host, "shared_dir", "ok", f"{output_dir} is writable (single node)"))
        if p is master:
            continue
        if res.get("connected"):
            rows.append(CheckResult(host, "port", "ok", f"reaches the master's rendezvous port {host_port}"))
        else:
            rows.append(CheckResult(host, "port", "error",
                                    f"cannot reach the master's rendezvous port {host_port} ({res.get('error')})",
                                    "open the port in the firewall between the nodes, or set the master's addr= to an address the nodes can reach"))
    return rows


async def _bandwidth(pool: Pool, probes: list[_NodeProbe], spec: JobSpec | None, report: PreflightReport) -> list[CheckResult]:
    master = probes[0]
    if report.errors() or any(p.data is None for p in probes):
        return [CheckResult(master.node.host, "bandwidth", "skipped", "skipped: fix the errors above first")]
    try:
        port = await launch.free_port(pool, master.node, master.setup)
    except ssh.NodeError as exc:
        return [CheckResult(master.node.host, "bandwidth", "error", f"could not pick a port: {exc}")]
    loopback = Cluster(tuple(p.node for p in probes)).all_loopback
    env = dict(spec.env) if spec else {}
    if loopback:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env.setdefault("OMP_NUM_THREADS", "1")
    run_id = f"preflight-{secrets.token_hex(4)}"
    n = len(probes)

    async def one(p: _NodeProbe, rank: int):
        nproc = 1
        argv = [p.node.python, "-m", "torch.distributed.run", "--nnodes", str(n), "--node_rank", str(rank),
                "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d", "--rdzv_endpoint",
                f"{master.node.address}:{port}", "--rdzv_id", run_id, "--max_restarts", "0"]
        if loopback:
            argv += ["--local_addr", p.node.address]
        argv += ["-m", "backend.cluster.bwtest"]
        return await pool.run(p.node, remote.run_in(None, None, argv, env), p.setup, timeout=BANDWIDTH_TIMEOUT_S)

    try:
        results = await asyncio.gather(*(one(p, r) for r, p in enumerate(probes)))
    except ssh.NodeError as exc:
        return [CheckResult(exc.address.host, "bandwidth", "error", f"all-reduce test failed: {exc.reason}")]
    bad = [(p, r) for p, r in zip(probes, results) if not r.ok]
    if bad:
        p, r = bad[0]
        return [CheckResult(p.node.host, "bandwidth", "error", f"all-reduce test failed: {r.first_error_line()}",
                            "check NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME and the firewall between nodes")]
    lines = [ln for ln in results[0].stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return [CheckResult(master.node.host, "bandwidth", "error", "all-reduce test printed no result")]
    data = json.loads(lines[-1])
    report.bandwidth = data
    return [CheckResult(master.node.host, "bandwidth", "ok",
                        f"all-reduce {data['size_mib']:.0f} MiB over {data['world_size']} ranks ({data['backend']}): "
                        f"bus bandwidth {data['busbw_gib_s']:.2f} GiB/s")]
