"""Node agent: samples the node's GPUs and host, tails the run's event files and torchrun log,
and writes everything as JSON lines to stdout (the SSH channel back to the backend).

    python -m backend.telemetry.agent --run-id RUN --run-dir DIR --node NODE [--interval 1.0] [--offsets JSON]

Kept small on purpose: imports only the standard library, psutil and (when present) NVML; never
torch. Line kinds are listed in docs/architecture.md ("Node agent"). It exits when the run's
processes on this node are gone (after a last read of the files), on SIGTERM/SIGINT, or when
stdout is closed.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil

from backend.job.flight import MAX_REQUEST_BYTES, dump_file, read_regular

GIB = 1024**3
RANK_FILE = re.compile(r"^rank-(\d+)\.jsonl$")
# psutil's process states the hang diagnosis names; any other state is `running`
RANK_STATES = {psutil.STATUS_STOPPED: "stopped", psutil.STATUS_TRACING_STOP: "stopped",
               psutil.STATUS_DISK_SLEEP: "disk_sleep", psutil.STATUS_ZOMBIE: "exited", psutil.STATUS_DEAD: "exited"}
PROC_SCAN_S = 2.0  # how often the run's processes (ranks, pids per GPU) are looked up
# NVML's PCIe reading samples a ~20 ms window and its process list takes milliseconds: NVML's slow
# calls, read every few seconds rather than every sample (the agent's cost: docs/benchmarks.md).
SLOW_READ_S = 5.0
HEARTBEAT_S = 5.0
MAX_READ_BYTES = 4 * 1024 * 1024  # per file and pass; the rest follows on the next pass
NVLINK_ALL_LINKS = 0xFFFFFFFF
FLIGHT_PREFIX = "/tmp/nccl_trace_rank_"  # PyTorch's default TORCH_NCCL_DEBUG_INFO_TEMP_FILE
MAX_FLIGHT_BYTES = 64 << 20  # a rank's dump: its recorder holds 2000 entries by default


# ---------------------------------------------------------------------------------------------
# GPU sampling


# (GPU index, NVML handle, sample time, the run's pids) -> a value, or a dict of named values
_Reader = Callable[[int, Any, float, set[int]], Any]


@dataclass
class _Metric:
    name: str
    read: _Reader
    period_s: float = 0.0
    """Read at most this often (0: every sample)."""


class GpuSampler:
    """NVML with handles opened once. Each (GPU, metric) that raises is switched off for good and
    reported once through `notices`, so an unsupported reading costs nothing after the first try."""

    def __init__(self, nvml: Any = None):
        self.notices: list[str] = []
        self.handles: list[Any] = []
        self.off: set[tuple[int, str]] = set()
        self._nv = None
        self._last_nvlink: dict[int, tuple[float, int, int]] = {}
        self._due: dict[tuple[int, str], float] = {}  # (GPU, metric) -> next read of a slow metric
        try:
            nv = nvml
            if nv is None:
                import pynvml as nv  # nvidia-ml-py; absent or without a driver on CPU machines
            nv.nvmlInit()
            self.handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
            self._nv = nv
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.notices.append(f"no GPU telemetry (NVML unavailable: {type(exc).__name__}: {exc}); sending host metrics only")
        self.metrics = self._metrics() if self._nv else []

    @property
    def count(self) -> int:
        return len(self.handles)

    def _metrics(self) -> list[_Metric]:
        nv = self._nv

        def of_handle(read: Callable[[Any], Any]) -> _Reader:
            return lambda _i, h, _now, _run_pids: read(h)

        def util(h):
            u = nv.nvmlDeviceGetUtilizationRates(h)
            return {"util_pct": float(u.gpu), "mem_util_pct": float(u.memory)}

        def mem(h):
            m = nv.nvmlDeviceGetMemoryInfo(h)
            return {"mem_used_gib": m.used / GIB, "mem_total_gib": m.total / GIB}

        def pcie(h):
            # KB/s over NVML's own ~20 ms window
            return {
                "pcie_tx_mib_s": nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES) / 1024,
                "pcie_rx_mib_s": nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES) / 1024,
            }

        return [
            _Metric("util", of_handle(util)),
            _Metric("mem", of_handle(mem)),
            _Metric("power_w", of_handle(lambda h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0)),
            _Metric("energy_j", of_handle(lambda h: nv.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0)),
            _Metric("temp_c", of_handle(lambda h: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)))),
            _Metric("sm_clock_mhz", of_handle(lambda h: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)))),
            _Metric("pcie", of_handle(pcie), SLOW_READ_S),
            _Metric("nvlink", self._nvlink),
            _Metric("procs", self._procs, SLOW_READ_S),
        ]

    def _nvlink(self, i: int, h: Any, now: float, _run_pids: set[int]) -> dict[str, float]:
        """Throughput since the previous sample of GPU i, from NVML's cumulative counters."""
        nv = self._nv
        ids = [(nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, NVLINK_ALL_LINKS),
               (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, NVLINK_ALL_LINKS)]
        vals = nv.nvmlDeviceGetFieldValues(h, ids)
        for v in vals:
            if v.nvmlReturn != 0:
                raise RuntimeError(f"NVLink field {v.fieldId} not available (NVML return {v.nvmlReturn})")
        tx, rx = int(vals[0].value.ullVal), int(vals[1].value.ullVal)  # cumulative KiB
        prev = self._last_nvlink.get(i)
        self._last_nvlink[i] = (now, tx, rx)
        if prev is None or now <= prev[0]:
            return {}
        dt = now - prev[0]
        return {"nvlink_tx_mib_s": (tx - prev[1]) / 1024 / dt, "nvlink_rx_mib_s": (rx - prev[2]) / 1024 / dt}

    def _procs(self, _i: int, h: Any, _now: float, run_pids: set[int]) -> dict[str, Any]:
        procs = self._nv.nvmlDeviceGetComputeRunningProcesses(h)
        ours = [p for p in procs if p.pid in run_pids]
        used = [p.usedGpuMemory for p in ours if isinstance(p.usedGpuMemory, int)]
        return {
            "run_pids": sorted(p.pid for p in ours),
            "run_procs_count": len(ours),
            "other_procs_count": len(procs) - len(ours),
            "run_mem_used_gib": sum(used) / GIB if used else None,
        }

    def sample(self, now: float, run_pids: set[int]) -> list[dict[str, Any]]:
        out = []
        for i, h in enumerate(self.handles):
            rec: dict[str, Any] = {"kind": "gpu", "t": now, "gpu": i}
            for m in self.metrics:
                if (i, m.name) in self.off or now < self._due.get((i, m.name), now):
                    continue
                if m.period_s:
                    self._due[(i, m.name)] = now + m.period_s
                try:
                    value = m.read(i, h, now, run_pids)
                except Exception as exc:
                    self.off.add((i, m.name))
                    self.notices.append(f"gpu {i}: {m.name} switched off after an error: {type(exc).__name__}: {exc}")
                    continue
                if isinstance(value, dict):
                    rec.update(value)
                else:
                    rec[m.name] = value
            out.append(rec)
        return out

    def close(self) -> None:
        if self._nv is not None:
            try:
                self._nv.nvmlShutdown()
            except Exception:
                pass


def host_sample(now: float) -> dict[str, Any]:
    vm = psutil.virtual_memory()
    return {
        "kind": "host",
        "t": now,
        "cpu_pct": psutil.cpu_percent(interval=None),  # since the previous call; primed at start
        "ram_used_gib": (vm.total - vm.available) / GIB,
        "ram_total_gib": vm.total / GIB,
    }


# ---------------------------------------------------------------------------------------------
# The run's processes on this node


@dataclass
class RunProcs:
    """The run's processes on this node: the torchrun process group named in `pids/<node>.pid`
    and all their descendants (torchrun starts each worker in a new session, so the group alone
    does not hold the workers)."""

    pid_file: Path
    gpus: bool = True
    """Whether the node has GPUs: without, a worker's LOCAL_RANK names no GPU."""
    pids: set[int] = field(default_factory=set)
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    flight_files: dict[int, Path] = field(default_factory=dict)  # rank -> where its flight recorder dumps
    environ_denied: bool = False
    _workers: set[int] = field(default_factory=set)  # pids whose environment named their rank

    def pgid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def scan(self) -> int | None:
        """Look the run's processes up again (one pass over the process table); returns the
        group read from the pid file, None while there is none."""
        pgid = self.pgid()
        if pgid is None:
            self.pids = set()
            return None
        roots: list[int] = []
        children: dict[int, list[int]] = {}
        for p in psutil.process_iter(["ppid"]):
            try:
                group = os.getpgid(p.pid)
            except (ProcessLookupError, PermissionError):
                continue
            if group == pgid:
                roots.append(p.pid)
            children.setdefault(p.info["ppid"], []).append(p.pid)
        # the group and its direct children: torchrun and its workers, not their dataloader
        # workers (which inherit RANK too)
        candidates = roots + [c for r in roots for c in children.get(r, ())]
        pids, todo = set(), list(roots)
        while todo:
            pid = todo.pop()
            if pid not in pids:
                pids.add(pid)
                todo += children.get(pid, ())
        self.pids = pids
        for pid in candidates:
            if pid in self._workers:
                continue
            try:
                env = psutil.Process(pid).environ()
            except psutil.AccessDenied:
                self.environ_denied = True
                continue
            except psutil.Error:
                continue
            if "RANK" not in env or "LOCAL_RANK" not in env:
                # Read again on the next pass: a worker caught between torchrun's fork and its exec
                # still has torchrun's environment. Passed over for good, it was never tailed: the
                # likely cause of a loaded suite run whose Slurm job stored rank 1's events, not rank 0's.
                continue
            try:
                rank, local = int(env["RANK"]), int(env["LOCAL_RANK"])
            except ValueError:
                continue
            self._workers.add(pid)
            self.ranks[rank] = {"rank": rank, "local_rank": local, "pid": pid, "gpu": _gpu_of(env, local, self.gpus)}
            # PyTorch's flight recorder writes `<prefix><rank>` on a collective timeout
            self.flight_files[rank] = Path(env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", FLIGHT_PREFIX) + str(rank))
        return pgid

    def rank_states(self) -> dict[int, str]:
        """Each local rank's process as the kernel has it: `stopped` (SIGSTOP, a debugger, job
        control), `disk_sleep` (uninterruptible I/O: a hung filesystem or device), `exited`, or
        `running` (on a CPU or asleep, waiting in a collective among others)."""
        states = {}
        for rank, r in self.ranks.items():
            try:
                status = psutil.Process(r["pid"]).status()
            except psutil.Error:
                status = psutil.STATUS_DEAD
            states[rank] = RANK_STATES.get(status, "running")
        return states

    def alive(self) -> bool:
        """True while a process of the group (as of the last scan) or a worker seen so far still
        runs; zombies do not count (a dead torchrun whose parent has not reaped it yet)."""
        for pid in self.pids | {r["pid"] for r in self.ranks.values()}:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    return True
            except psutil.Error:
                continue
        return False


class _PlainUnpickler(pickle.Unpickler):
    """Flight recorder dumps are dicts, lists, strings and numbers; nothing else is loaded."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a flight recorder dump")


def flight_record(path: Path, rank: int, t: float) -> dict[str, Any]:
    """The collective a rank was in when PyTorch's flight recorder dumped on a collective timeout
    (a pickle), as a `flight` line. The file is where the rank's environment says (/tmp by
    default, where anyone can plant a FIFO or a link): read as the requested dumps are."""
    dump = _PlainUnpickler(io.BytesIO(read_regular(path, MAX_FLIGHT_BYTES))).load()
    return {"kind": "flight", "t": t, "rank": rank, "file": str(path), **flight_summary([dump])}


def requested_flight_record(path: Path, rank: int, t: float) -> dict[str, Any]:
    """A rank's answer to the watch's request (`backend.job.flight`: JSON from `launcher.flight`),
    as a `flight` line marked `requested`, with the request it answers. A file that cannot be read
    (too large, not JSON, not a regular file) is still an answer, with its `error`."""
    rec: dict[str, Any] = {"kind": "flight", "t": t, "rank": rank, "file": str(path), "requested": True}
    try:
        answer = json.loads(read_regular(path, MAX_FLIGHT_BYTES))
        if not isinstance(answer, dict):
            raise ValueError("not a JSON object")
        dumps = answer.get("dumps") if isinstance(answer.get("dumps"), dict) else {}
        rec["request"] = str(answer.get("request", ""))[:MAX_REQUEST_BYTES]
        rec.update(flight_summary([d for d in dumps.values() if isinstance(d, dict)]))
        errors = [str(d["error"]) for d in dumps.values() if isinstance(d, dict) and d.get("error")]
    except (OSError, ValueError) as exc:
        errors = [f"{path}: {exc}"]
    if errors:
        rec["error"] = "; ".join(errors)[:500]
    return rec


def flight_summary(dumps: list[dict[str, Any]]) -> dict[str, Any]:
    """From a rank's recorder dumps: the oldest collective still in flight (not completed: NCCL's
    `state`; not retired: gloo's recorder keeps `state` at scheduled), else the newest; each
    process group's newest sequence number (a rank behind the others has not reached theirs); and
    the groups the rank is a member of (`pg_status`), so a rank outside a group is not taken for
    one that never entered its collective."""
    entries = [e for d in dumps for e in d.get("entries", []) if isinstance(e, dict)]
    groups = sorted({str(g) for d in dumps if isinstance(d.get("pg_status"), dict) for g in d["pg_status"]})

    def in_flight(e: dict[str, Any]) -> bool:
        return not e.get("retired", False) and e.get("state") != "completed"

    waiting = [e for e in entries if in_flight(e)]
    stuck = min(waiting, key=lambda e: e.get("time_created_ns") or 0) if waiting else (entries[-1] if entries else {})
    last_seq: dict[str, int] = {}
    for e in entries:
        pg, seq = _group(e.get("process_group")), e.get("collective_seq_id")
        if isinstance(seq, int) and not e.get("is_p2p") and seq > last_seq.get(pg, -1):
            last_seq[pg] = seq
    pg = stuck.get("process_group")
    p2p = bool(stuck.get("is_p2p"))
    return {"entries": len(entries), "collective": stuck.get("profiling_name"),
            "seq": stuck.get("p2p_seq_id" if p2p else "collective_seq_id"), "p2p": p2p,
            "state": stuck.get("state"), "in_flight": bool(waiting), "group": _group(pg),
            "process_group": list(pg) if isinstance(pg, (list, tuple)) else pg, "last_seq": last_seq,
            "groups": groups}


def _group(pg: Any) -> str:
    """A process group's name in a recorder entry (its (name, description) pair's first part)."""
    return str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(pg)


def _gpu_of(env: dict[str, str], local_rank: int, gpus: bool = True) -> int | None:
    """The physical GPU index a worker uses: its LOCAL_RANK-th entry of CUDA_VISIBLE_DEVICES, or
    LOCAL_RANK itself when that variable is unset on a node with GPUs (torch's cuda:LOCAL_RANK
    convention); None on a node without GPUs."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return local_rank if gpus else None
    parts = [p.strip() for p in visible.split(",") if p.strip()]
    if local_rank < len(parts) and parts[local_rank].isdigit():
        return int(parts[local_rank])
    return None


# ---------------------------------------------------------------------------------------------
# Tailing


class Tailer:
    """Reads complete lines appended to files after known byte offsets. A partial last line stays
    unread until its newline arrives, so a reported offset always ends a whole line."""

    def __init__(self, run_dir: Path, offsets: dict[str, int]):
        self.run_dir = run_dir
        self.offsets = dict(offsets)

    def read(self, rel: str) -> Iterator[tuple[int, bytes]]:
        path = self.run_dir / rel
        start = self.offsets.get(rel, 0)
        try:
            size = path.stat().st_size
        except OSError:
            return
        if size < start:  # truncated or replaced: start over rather than read garbage
            start = 0
        if size == start:
            return
        with open(path, "rb") as f:
            f.seek(start)
            chunk = f.read(min(size - start, MAX_READ_BYTES))
        end = chunk.rfind(b"\n")
        if end < 0:
            return
        pos = start
        for raw in chunk[: end + 1].splitlines(keepends=True):
            pos += len(raw)
            yield pos, raw.rstrip(b"\r\n")
        self.offsets[rel] = pos


def event_files(run_dir: Path) -> dict[int, str]:
    """rank -> relative path of every `events/rank-<N>.jsonl` present now."""
    found = {}
    try:
        for entry in os.scandir(run_dir / "events"):
            m = RANK_FILE.match(entry.name)
            if m:
                found[int(m.group(1))] = f"events/{entry.name}"
    except OSError:
        pass
    return found


# ---------------------------------------------------------------------------------------------
# The loop


class Agent:
    def __init__(self, run_id: str, run_dir: Path, node: str, interval: float, offsets: dict[str, int],
                 tail_interval: float = 0.25, start_timeout: float = 300.0, out=None, nvml: Any = None,
                 clock: Callable[[], float] = time.time):
        self.run_id, self.run_dir, self.node = run_id, run_dir, node
        self.interval, self.tail_interval, self.start_timeout = interval, tail_interval, start_timeout
        self.out = out or sys.stdout
        self.clock = clock
        self.gpus = GpuSampler(nvml)
        self.procs = RunProcs(run_dir / "pids" / f"{node}.pid", gpus=self.gpus.count > 0)
        self.tailer = Tailer(run_dir, offsets)
        self.log_file = f"logs/{node}.log"
        self.stop_reason: str | None = None
        self._sent_ranks: dict[int, dict[str, Any]] = {}
        self._sent_states: dict[int, str] = {}
        self._flights: dict[Path, float] = {}  # dump file -> its mtime when it was sent
        self.started = clock()
        psutil.cpu_percent(interval=None)

    # -- output
    def emit(self, records: list[dict[str, Any]]) -> None:
        if records:
            self.out.write("".join(json.dumps(r, separators=(",", ":"), allow_nan=True) + "\n" for r in records))
            self.out.flush()

    def _notices(self, now: float) -> list[dict[str, Any]]:
        recs = [{"kind": "notice", "t": now, "message": m} for m in self.gpus.notices]
        for m in self.gpus.notices:
            print(f"agent[{self.node}]: {m}", file=sys.stderr)
        self.gpus.notices.clear()
        return recs

    # -- pieces of one pass
    def tail_files(self, run_over: bool) -> list[dict[str, Any]]:
        recs: list[dict[str, Any]] = []
        files = event_files(self.run_dir)
        ranks = self._ranks_to_tail(files, run_over)
        for rank in sorted(ranks):
            rel = files[rank]
            for offset, raw in self.tailer.read(rel):
                try:
                    data = json.loads(raw)
                    if not isinstance(data, dict):
                        raise ValueError("not a JSON object")
                except ValueError as exc:
                    recs.append({"kind": "notice", "t": self.clock(),
                                 "message": f"{rel}: unreadable event line ending at byte {offset} skipped ({exc})"})
                    data = None
                recs.append({"kind": "event", "file": rel, "offset": offset, "rank": rank, "data": data})
        for offset, raw in self.tailer.read(self.log_file):
            recs.append({"kind": "log", "file": self.log_file, "offset": offset,
                         "line": raw.decode("utf-8", errors="replace")})
        return recs

    def _ranks_to_tail(self, files: dict[int, str], run_over: bool) -> set[int]:
        """This node's ranks when known (the run directory may be shared by every node); all
        ranks when they cannot be known: the run is over before its workers were seen, or their
        environment is not readable. The backend keeps one copy of a line either way."""
        if self.procs.ranks:
            return set(self.procs.ranks) & set(files)
        if run_over or self.procs.environ_denied:
            return set(files)
        return set()

    def flight_records(self, now: float) -> list[dict[str, Any]]:
        """A `flight` line for each flight recorder dump of a local rank written since we started:
        PyTorch's own on a collective timeout, and the rank's answer to the watch's request."""
        recs = []
        for rank, path in self.procs.flight_files.items():
            for file, read in ((path, flight_record), (self.run_dir / dump_file(rank), requested_flight_record)):
                try:
                    mtime = file.stat().st_mtime
                except OSError:
                    continue
                if mtime < self.started or self._flights.get(file) == mtime:
                    continue
                self._flights[file] = mtime
                try:
                    recs.append(read(file, rank, now))
                except Exception as exc:  # a partial or foreign file: say so once, keep going
                    recs.append({"kind": "notice", "t": now, "message": f"flight recorder dump {file} unreadable: {exc}"})
        return recs

    def rank_records(self, now: float) -> list[dict[str, Any]]:
        """A `ranks` line when the local ranks changed, a `rank_state` line when their process states did."""
        recs = []
        if self.procs.ranks != self._sent_ranks:
            self._sent_ranks = {k: dict(v) for k, v in self.procs.ranks.items()}
            recs.append({"kind": "ranks", "t": now, "ranks": [self.procs.ranks[r] for r in sorted(self.procs.ranks)]})
        states = self.procs.rank_states()
        if states != self._sent_states:
            self._sent_states = states
            recs.append({"kind": "rank_state", "t": now,
                         "ranks": [{"rank": r, "state": states[r]} for r in sorted(states)]})
        return recs

    # -- main loop
    def run(self) -> int:
        self.emit([{"kind": "hello", "t": self.started, "run_id": self.run_id, "node": self.node, "pid": os.getpid(),
                    "gpus": self.gpus.count, "interval_s": self.interval}] + self._notices(self.started))
        next_sample = next_scan = next_beat = self.started
        seen_group = False
        try:
            while self.stop_reason is None:
                now = self.clock()
                recs: list[dict[str, Any]] = []
                run_over = False
                if now >= next_scan:
                    pgid = self.procs.scan()
                    recs += self.rank_records(now) + self.flight_records(now)
                    if pgid is not None:
                        seen_group = True
                        run_over = not self.procs.alive()
                    elif now - self.started > self.start_timeout:
                        run_over = True
                        recs.append({"kind": "notice", "t": now, "message":
                                     f"no {self.procs.pid_file} after {self.start_timeout:.0f} s; the run did not start on this node"})
                    next_scan = now + PROC_SCAN_S
                if now >= next_sample:
                    recs += self.gpus.sample(now, self.procs.pids)
                    recs.append(host_sample(now))
                    recs += self._notices(now)
                    next_sample += self.interval
                    if next_sample < now:  # fell behind (suspended); don't burst to catch up
                        next_sample = now + self.interval
                if now >= next_beat:
                    recs.append({"kind": "heartbeat", "t": now})
                    next_beat = now + HEARTBEAT_S
                recs += self.tail_files(run_over)
                self.emit(recs)
                if run_over:
                    self.stop_reason = "run over" if seen_group else "run never started"
                    break
                time.sleep(max(0.0, min(next_sample, now + self.tail_interval) - self.clock()))
            # a last pass for lines written while stopping
            self.emit(self.tail_files(True) + [{"kind": "bye", "t": self.clock(), "reason": self.stop_reason}])
        except BrokenPipeError:
            # the SSH channel is gone; the backend restarts us from its acknowledged offsets
            try:
                sys.stdout = open(os.devnull, "w")
            except OSError:
                pass
            return 0
        finally:
            self.gpus.close()
        return 0

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason


def parse_offsets(text: str | None) -> dict[str, int]:
    if not text:
        return {}
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise SystemExit(f"--offsets: not valid JSON ({exc})")
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in data.items()):
        raise SystemExit('--offsets: expected a JSON object of file -> byte offset, e.g. {"events/rank-0.jsonl": 1234}')
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.telemetry.agent", description=__doc__.splitlines()[0])
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--node", required=True, help="node name as in logs/<node>.log and pids/<node>.pid")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between GPU/host samples (default 1)")
    ap.add_argument("--tail-interval", type=float, default=0.25, help="seconds between reads of the event files")
    ap.add_argument("--offsets", help="JSON object: run-dir-relative file -> byte offset to resume from")
    ap.add_argument("--start-timeout", type=float, default=300.0,
                    help="exit when pids/<node>.pid has not appeared after this many seconds")
    args = ap.parse_args(argv)
    if args.interval <= 0 or args.tail_interval <= 0:
        ap.error("--interval and --tail-interval must be greater than 0")
    if not args.run_dir.is_dir():
        ap.error(f"--run-dir: {args.run_dir} is not a directory")
    agent = Agent(args.run_id, args.run_dir.resolve(), args.node, args.interval, parse_offsets(args.offsets),
                  tail_interval=args.tail_interval, start_timeout=args.start_timeout)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: agent.request_stop(signal.Signals(signum).name))
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
