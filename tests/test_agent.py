"""The node agent on this CPU machine: host samples, rank discovery, event tailing from offsets,
switch-off of a failing metric, NVML absence, and how it ends."""
from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import sqlalchemy.exc

from backend.cluster.launch import Started
from backend.cluster.nodes import Pool
from backend.job.cluster import Node
from backend.runs.watch import AttemptWatcher, NodeWatch
from backend.store.db import make_engine
from backend.telemetry.agent import (MAX_FLIGHT_BYTES, SLOW_READ_S, GpuSampler, RunProcs, Tailer, _gpu_of,
                                    flight_record, requested_flight_record)
from backend.telemetry.ingest import Ingestor
from worker import until

REPO = Path(__file__).resolve().parent.parent

# Stands in for torchrun: its own process group (written to pids/<node>.pid), one worker in a
# new session with the environment torchrun gives workers, both gone after `life` seconds.
FAKE_TORCHRUN = r"""
import os, subprocess, sys, time
pid_file, life = sys.argv[1], float(sys.argv[2])
env = dict(os.environ, RANK="1", LOCAL_RANK="0", CUDA_VISIBLE_DEVICES="3",
           TORCH_NCCL_DEBUG_INFO_TEMP_FILE=os.path.join(os.path.dirname(os.path.dirname(pid_file)), "fr_rank_"))
# the worker starts a dataloader-like child that inherits RANK: it must not be taken for the rank
child = ("import signal, subprocess, sys, time\n"
         "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
         "signal.signal(signal.SIGTERM, lambda *a: (c.kill(), c.wait(), sys.exit(0)))\n"
         "time.sleep(120)")
worker = subprocess.Popen([sys.executable, "-c", child], env=env, start_new_session=True)
with open(pid_file + ".tmp", "w") as f:
    f.write(str(os.getpgid(0)))
os.replace(pid_file + ".tmp", pid_file)
time.sleep(life)
worker.terminate(); worker.wait()
"""


# What PyTorch's flight recorder pickles on a collective timeout (the fields the agent reads).
FLIGHT_DUMP = {"version": "2.10", "pg_config": {}, "entries": [
    {"collective_seq_id": 40, "profiling_name": "nccl:all_reduce", "state": "completed", "process_group": ("0", "default_pg")},
    {"collective_seq_id": 41, "profiling_name": "nccl:all_reduce", "state": "started", "process_group": ("0", "default_pg")},
    {"collective_seq_id": 42, "profiling_name": "nccl:broadcast", "state": "scheduled", "process_group": ("0", "default_pg")},
]}


def make_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    for d in ("events", "logs", "pids"):
        (run / d).mkdir(parents=True)
    return run


def start_torchrun(run: Path, node: str, life: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", FAKE_TORCHRUN, str(run / "pids" / f"{node}.pid"), str(life)],
                            start_new_session=True)
    deadline = time.time() + 10
    while not (run / "pids" / f"{node}.pid").exists():
        assert time.time() < deadline, "fake torchrun did not start"
        time.sleep(0.05)
    return proc


def stop_group(proc: subprocess.Popen) -> None:
    """Kill the fake torchrun's group and its worker (own session), by their ids."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        kids = []
    for p in kids:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def agent_cmd(run: Path, node: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "backend.telemetry.agent", "--run-id", "r1", "--run-dir", str(run), "--node", node,
            "--interval", "0.2", "--tail-interval", "0.1", *extra]


def lines_of(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def by_kind(recs: list[dict], kind: str) -> list[dict]:
    return [r for r in recs if r["kind"] == kind]


def test_agent_streams_host_samples_and_local_rank_events_from_offsets(tmp_path):
    run = make_run(tmp_path)
    mine, other = run / "events/rank-1.jsonl", run / "events/rank-0.jsonl"
    first = json.dumps({"type": "timing", "rank": 1, "step": 1, "time": 1.0, "step_time_s": 0.5}) + "\n"
    second = json.dumps({"type": "timing", "rank": 1, "step": 2, "time": 2.0, "step_time_s": 0.5}) + "\n"
    mine.write_text(first + second)
    other.write_text(json.dumps({"type": "start", "time": 1.0}) + "\n")  # another node's rank
    (run / "logs/n1.log").write_text("starting\n")
    group = start_torchrun(run, "n1", life=3.0)
    try:
        agent = subprocess.Popen(agent_cmd(run, "n1", "--offsets", json.dumps({"events/rank-1.jsonl": len(first)})),
                                 cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)
        rss_mib = psutil.Process(agent.pid).memory_info().rss / 2**20
        [worker_pid] = [c.pid for c in psutil.Process(group.pid).children()]
        with open(mine, "a") as f:  # a line arriving in two writes is sent once, whole
            f.write('{"type": "timing", "rank": 1, "step": 3, ')
            f.flush()
            time.sleep(0.5)
            f.write('"time": 3.0, "step_time_s": 0.5}\n')
        with open(run / "logs/n1.log", "a") as f:
            f.write("[rank1]: RuntimeError: boom\n")
        (run / "fr_rank_1").write_bytes(pickle.dumps(FLIGHT_DUMP))  # the rank's flight recorder dumps
        out, err = agent.communicate(timeout=30)
    finally:
        stop_group(group)
    assert agent.returncode == 0, err
    recs = lines_of(out)
    hello = recs[0]
    assert hello["kind"] == "hello" and hello["gpus"] == 0 and hello["node"] == "n1"
    assert any("NVML unavailable" in n["message"] for n in by_kind(recs, "notice"))
    hosts = by_kind(recs, "host")
    assert len(hosts) >= 8  # ~3 s at 5 Hz
    assert all(0 <= h["cpu_pct"] <= 100 * os.cpu_count() and 0 < h["ram_used_gib"] < h["ram_total_gib"] for h in hosts)
    assert [h["t"] for h in hosts] == sorted(h["t"] for h in hosts)
    [ranks] = by_kind(recs, "ranks")
    assert [r["pid"] for r in ranks["ranks"]] == [worker_pid]
    assert ranks["ranks"][0]["rank"] == 1 and ranks["ranks"][0]["local_rank"] == 0 and ranks["ranks"][0]["gpu"] == 3
    events = by_kind(recs, "event")
    assert [e["data"]["step"] for e in events] == [2, 3]  # from the offset; only this node's rank
    assert all(e["file"] == "events/rank-1.jsonl" and e["rank"] == 1 for e in events)
    assert events[-1]["offset"] == mine.stat().st_size
    assert events[0]["offset"] == len(first) + len(second)
    assert [r["line"] for r in by_kind(recs, "log")] == ["starting", "[rank1]: RuntimeError: boom"]
    assert by_kind(recs, "log")[-1]["offset"] == (run / "logs/n1.log").stat().st_size
    assert by_kind(recs, "heartbeat")
    [flight] = by_kind(recs, "flight")
    assert (flight["rank"], flight["collective"], flight["seq"], flight["state"]) == (1, "nccl:all_reduce", 41, "started")
    assert recs[-1]["kind"] == "bye" and recs[-1]["reason"] == "run over"
    assert rss_mib < 80, f"agent uses {rss_mib:.0f} MiB"


def test_a_stopped_rank_is_reported_when_stopped_and_again_when_it_goes_on(tmp_path):
    """The hang diagnosis names a rank whose process the kernel holds (SIGSTOP here; D state
    the same way): the agent sends a `rank_state` line on each change, not on every scan."""
    run = make_run(tmp_path)
    group = start_torchrun(run, "n1", life=60)
    agent = subprocess.Popen(agent_cmd(run, "n1"), cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        def next_state(timeout: float = 15) -> list[dict]:
            deadline = time.time() + timeout
            while time.time() < deadline:
                rec = json.loads(agent.stdout.readline())
                if rec["kind"] == "rank_state":
                    return rec["ranks"]
            raise AssertionError("no rank_state line")

        assert next_state() == [{"rank": 1, "state": "running"}]
        [worker] = psutil.Process(group.pid).children()
        worker.suspend()  # SIGSTOP
        assert next_state() == [{"rank": 1, "state": "stopped"}]
        worker.resume()
        assert next_state() == [{"rank": 1, "state": "running"}]
        agent.send_signal(signal.SIGTERM)
        rest = lines_of(agent.communicate(timeout=10)[0])
    finally:
        agent.kill()
        stop_group(group)
    assert by_kind(rest, "rank_state") == []  # nothing changed after that


# torchrun's part: fork a worker that holds off its exec until the file argv[1] exists (a loaded
# machine can stall a child there), then exec it with the rank in its environment.
SLOW_EXEC = r"""
import os, sys, time
child = os.fork()
if child == 0:
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)"],
              {**os.environ, "RANK": "0", "LOCAL_RANK": "0"})
os.waitpid(child, 0)
"""


def test_a_worker_seen_before_its_exec_is_found_once_it_has_its_rank(tmp_path):
    """Between torchrun's fork and the worker's exec, the worker's process has torchrun's
    environment, without RANK: a scan then must not pass it over for the rest of the run."""
    go = tmp_path / "exec-now"
    group = subprocess.Popen([sys.executable, "-c", SLOW_EXEC, str(go)], start_new_session=True)
    try:
        pid_file = tmp_path / "n1.pid"
        pid_file.write_text(f"{group.pid}\n")
        procs = RunProcs(pid_file, gpus=False)
        worker = until(lambda: psutil.Process(group.pid).children(), 10)[0]
        procs.scan()
        assert procs.ranks == {} and worker.pid in procs.pids  # not exec'd yet: no rank to read
        go.touch()
        until(lambda: "RANK" in worker.environ(), 15)
        procs.scan()
        assert procs.ranks == {0: {"rank": 0, "local_rank": 0, "pid": worker.pid, "gpu": None}}
    finally:
        stop_group(group)


def test_a_workers_gpu_is_named_only_where_the_node_has_gpus():
    assert _gpu_of({"CUDA_VISIBLE_DEVICES": "2,5"}, 1) == 5 and _gpu_of({"CUDA_VISIBLE_DEVICES": "2,5"}, 1, gpus=False) == 5
    assert _gpu_of({}, 1) == 1  # torch's cuda:LOCAL_RANK
    assert _gpu_of({}, 1, gpus=False) is None  # a CPU node: no "GPU 1" in an alert


def test_agent_never_imports_torch():
    code = "import sys, backend.telemetry.agent; print(sorted(m for m in ('torch', 'sqlalchemy', 'pydantic') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_sigterm_ends_the_agent_with_a_last_read(tmp_path):
    run = make_run(tmp_path)
    group = start_torchrun(run, "n1", life=60)
    try:
        agent = subprocess.Popen(agent_cmd(run, "n1"), cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert json.loads(agent.stdout.readline())["kind"] == "hello"
        (run / "logs/n1.log").write_text("last words\n")
        agent.send_signal(signal.SIGTERM)
        out, _ = agent.communicate(timeout=10)
    finally:
        stop_group(group)
    recs = lines_of(out)
    assert agent.returncode == 0
    assert recs[-1] == {"kind": "bye", "t": recs[-1]["t"], "reason": "SIGTERM"}
    assert [r["line"] for r in by_kind(recs, "log")] == ["last words"]


def test_closed_stdout_ends_the_agent(tmp_path):
    run = make_run(tmp_path)
    group = start_torchrun(run, "n1", life=60)
    try:
        agent = subprocess.Popen(agent_cmd(run, "n1"), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        agent.stdout.readline()
        agent.stdout.close()  # the SSH channel is gone
        assert agent.wait(timeout=10) == 0
    finally:
        stop_group(group)


def test_no_pid_file_means_the_run_never_started_here(tmp_path):
    run = make_run(tmp_path)
    (run / "events/rank-0.jsonl").write_text(json.dumps({"type": "start", "time": 1.0}) + "\n")
    out = subprocess.run(agent_cmd(run, "n1", "--start-timeout", "0.5"), cwd=REPO, capture_output=True, text=True,
                         timeout=20).stdout
    recs = lines_of(out)
    assert recs[-1]["reason"] == "run never started"
    assert any("pids/n1.pid" in n["message"] for n in by_kind(recs, "notice"))
    # with no workers to tell which ranks are local, every rank file is read
    assert [e["data"]["type"] for e in by_kind(recs, "event")] == ["start"]


def test_user_errors_get_one_clear_message(tmp_path):
    bad = subprocess.run(agent_cmd(tmp_path / "missing", "n1"), cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "--run-dir" in bad.stderr and "Traceback" not in bad.stderr
    run = make_run(tmp_path)
    bad = subprocess.run(agent_cmd(run, "n1", "--offsets", "{oops"), cwd=REPO, capture_output=True, text=True)
    assert bad.returncode != 0 and "--offsets" in bad.stderr and "Traceback" not in bad.stderr


# -- GPU sampling without a GPU --------------------------------------------------------------------

class FakeNvml:
    """The subset of pynvml the sampler calls; `power_fails` makes power readings raise."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139

    class NVMLError_NotSupported(Exception):
        pass

    def __init__(self, gpus=2, power_fails_on=(1,)):
        self.gpus, self.power_fails_on = gpus, set(power_fails_on)
        self.calls: dict[str, int] = {}
        self.nvlink_kib = 0

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i):
        self._count("handle")
        return i

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=70 + h, memory=30)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=40 * 2**30, total=80 * 2**30)

    def nvmlDeviceGetPowerUsage(self, h):
        self._count(f"power{h}")
        if h in self.power_fails_on:
            raise self.NVMLError_NotSupported("Not Supported")
        return 350_000

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        return 7_000_000

    def nvmlDeviceGetTemperature(self, h, kind):
        return 61

    def nvmlDeviceGetClockInfo(self, h, kind):
        return 1980

    def nvmlDeviceGetPcieThroughput(self, h, kind):
        return 2048

    def nvmlDeviceGetFieldValues(self, h, ids):
        self.nvlink_kib += 1024 * 100
        return [SimpleNamespace(nvmlReturn=0, fieldId=f, value=SimpleNamespace(ullVal=self.nvlink_kib))
                for f, _scope in ids]

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=100 + h, usedGpuMemory=2 * 2**30), SimpleNamespace(pid=999, usedGpuMemory=None)]


def test_a_failing_metric_is_switched_off_once():
    nv = FakeNvml(gpus=2, power_fails_on={1})
    sampler = GpuSampler(nv)
    assert sampler.count == 2 and nv.calls["handle"] == 2
    first = sampler.sample(100.0, run_pids={100, 101})
    assert first[0]["power_w"] == 350.0 and "power_w" not in first[1]
    assert first[1]["util_pct"] == 71.0 and first[1]["mem_used_gib"] == 40.0  # the rest still works
    assert len(sampler.notices) == 1 and "gpu 1: power_w switched off" in sampler.notices[0]
    for k in range(5):
        sampler.sample(101.0 + k, run_pids={100, 101})
    assert nv.calls["power1"] == 1 and nv.calls["power0"] == 6  # never retried on GPU 1
    assert len(sampler.notices) == 1
    assert nv.calls["handle"] == 2  # handles opened once


def test_gpu_sample_fields_and_units():
    nv = FakeNvml(gpus=1, power_fails_on=())
    sampler = GpuSampler(nv)
    sampler.sample(10.0, run_pids={100})
    [s] = sampler.sample(12.0, run_pids={100})
    assert s["kind"] == "gpu" and s["gpu"] == 0 and s["t"] == 12.0
    assert s["energy_j"] == 7000.0 and s["temp_c"] == 61.0 and s["sm_clock_mhz"] == 1980.0
    # the fake counter grows by 100 MiB per read, and reads were 2 s apart
    assert s["nvlink_tx_mib_s"] == pytest.approx(50.0) and s["nvlink_rx_mib_s"] == pytest.approx(50.0)
    assert "pcie_tx_mib_s" not in s and "run_pids" not in s  # the slow readings: every SLOW_READ_S
    [s] = sampler.sample(10.0 + SLOW_READ_S, run_pids={100})
    assert s["pcie_tx_mib_s"] == 2.0 and s["mem_total_gib"] == 80.0
    assert s["run_pids"] == [100] and s["run_procs_count"] == 1 and s["other_procs_count"] == 1
    assert s["run_mem_used_gib"] == 2.0


def test_no_nvml_means_host_only():
    class Missing:
        def nvmlInit(self):
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    sampler = GpuSampler(Missing())
    assert sampler.count == 0 and sampler.sample(1.0, set()) == []
    assert "NVML unavailable" in sampler.notices[0]
    real = GpuSampler()  # this machine's pynvml finds no driver
    assert real.count == 0 and real.sample(1.0, set()) == []


# -- the file reader -----------------------------------------------------------------------------

def test_tailer_reads_whole_lines_and_restarts_a_replaced_file(tmp_path):
    p = tmp_path / "f.jsonl"
    p.write_bytes(b'{"a": 1}\n{"b":')
    t = Tailer(tmp_path, {})
    assert list(t.read("f.jsonl")) == [(9, b'{"a": 1}')]
    assert list(t.read("f.jsonl")) == []
    with open(p, "ab") as f:
        f.write(b' 2}\r\n')
    assert list(t.read("f.jsonl")) == [(len(p.read_bytes()), b'{"b": 2}')]
    p.write_bytes(b"x\n")  # replaced by a shorter file: read from its start
    assert list(t.read("f.jsonl")) == [(2, b"x")]
    assert list(t.read("missing.jsonl")) == []


# -- flight recorder dumps ---------------------------------------------------------------------------

def test_flight_record_names_the_collective_not_completed(tmp_path):
    path = tmp_path / "nccl_trace_rank_3"
    path.write_bytes(pickle.dumps(FLIGHT_DUMP))
    rec = flight_record(path, 3, 5.0)
    assert rec == {"kind": "flight", "t": 5.0, "rank": 3, "file": str(path), "entries": 3, "in_flight": True,
                   "collective": "nccl:all_reduce", "seq": 41, "state": "started", "group": "0",
                   "process_group": ["0", "default_pg"], "last_seq": {"0": 42}, "p2p": False, "groups": []}
    done = {**FLIGHT_DUMP, "entries": FLIGHT_DUMP["entries"][:1]}
    path.write_bytes(pickle.dumps(done))
    assert flight_record(path, 3, 5.0)["seq"] == 40  # all completed: the newest


def test_a_requested_dump_names_the_collective_in_flight_from_gloos_retired_flag(tmp_path):
    """launcher.flight's file: gloo's recorder keeps every entry `scheduled`; the one a rank waits
    in is the one not retired (as a real dump of a rank blocked in its third all_reduce shows)."""
    entry = {"profiling_name": "gloo:all_reduce", "state": "scheduled", "process_group": ["0", "default_pg"]}
    entries = [{**entry, "collective_seq_id": n, "retired": n < 3, "time_created_ns": n} for n in (1, 2, 3)]
    path = tmp_path / "rank-0.json"
    path.write_text(json.dumps({"rank": 0, "request": "r1@5", "dumps": {"_dump_fr_trace_json": {"entries": entries,
                                                                                      "pg_status": {"0": {}}},
                                                     "_dump_nccl_trace_json": {"error": "RuntimeError: no NCCL"}}}))
    rec = requested_flight_record(path, 0, 9.0)
    assert rec["requested"] and (rec["collective"], rec["seq"], rec["in_flight"]) == ("gloo:all_reduce", 3, True)
    assert rec["last_seq"] == {"0": 3} and rec["error"] == "RuntimeError: no NCCL"
    assert rec["request"] == "r1@5" and rec["groups"] == ["0"]
    path.write_text(json.dumps({"dumps": {"_dump_fr_trace_json": {"entries": entries[:2]}}}))
    assert (requested_flight_record(path, 0, 9.0)["in_flight"], requested_flight_record(path, 0, 9.0)["seq"]) == (False, 2)
    # A crafted file is an answer with an error: not read whole, not followed, never blocking.
    with open(path, "wb") as f:
        f.truncate(MAX_FLIGHT_BYTES + 1)
    assert "larger than 64 MiB" in requested_flight_record(path, 0, 9.0)["error"]
    path.unlink()
    os.mkfifo(path)  # would block a plain open() for ever
    assert "not a regular file" in requested_flight_record(path, 0, 9.0)["error"]
    path.unlink()
    path.symlink_to("/dev/zero")
    bad = requested_flight_record(path, 0, 9.0)
    assert bad["requested"] and "error" in bad and "entries" not in bad
    path.unlink()
    path.write_text("[1, 2]")
    assert "not a JSON object" in requested_flight_record(path, 0, 9.0)["error"]


def test_a_point_to_point_op_in_flight_is_numbered_by_its_own_sequence():
    from backend.telemetry.agent import flight_summary

    pg = ["3", "pp"]
    entries = [{"collective_seq_id": 8, "p2p_seq_id": 0, "is_p2p": False, "profiling_name": "nccl:all_reduce",
                "state": "completed", "process_group": pg},
               {"collective_seq_id": 8, "p2p_seq_id": 5, "is_p2p": True, "profiling_name": "nccl:send 1->2",
                "state": "started", "process_group": pg}]
    rec = flight_summary([{"entries": entries}])
    assert (rec["collective"], rec["seq"], rec["p2p"], rec["last_seq"]) == ("nccl:send 1->2", 5, True, {"3": 8})


def test_flight_record_loads_nothing_but_plain_data(tmp_path):
    from collections import OrderedDict

    path = tmp_path / "nccl_trace_rank_0"
    path.write_bytes(pickle.dumps(OrderedDict(entries=[])))  # needs a class lookup: refused
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        flight_record(path, 0, 1.0)


def test_a_fifo_or_link_planted_at_the_nccl_dump_path_neither_blocks_nor_is_followed(tmp_path):
    """TORCH_NCCL_DEBUG_INFO_TEMP_FILE defaults to /tmp, where anyone can plant a file under a
    rank's dump name: the agent reads it as the requested dumps, and the caller makes the error a
    notice."""
    path = tmp_path / "nccl_trace_rank_0"
    os.mkfifo(path)  # a plain open() would block the agent for ever
    with pytest.raises(ValueError, match="not a regular file"):
        flight_record(path, 0, 1.0)
    path.unlink()
    target = tmp_path / "elsewhere"
    target.write_bytes(pickle.dumps(FLIGHT_DUMP))
    path.symlink_to(target)
    with pytest.raises(OSError):
        flight_record(path, 0, 1.0)
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(MAX_FLIGHT_BYTES + 1)
    with pytest.raises(ValueError, match="larger than 64 MiB"):
        flight_record(path, 0, 1.0)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU and NVML")
def test_a_real_gpu_reports_the_energy_its_work_draws(tmp_path):
    """The node agent's sampler on a real GPU: NVML's energy counter rises while the GPU multiplies
    matrices, by about the power it reports times the time; energy_j turns the samples into joules."""
    import time

    import torch

    from sqlmodel import Session, create_engine

    from backend.store.telemetry_models import MetricSample, create_telemetry_tables
    from backend.telemetry.query import energy_j

    sampler = GpuSampler()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.time()
    first = sampler.sample(t0, set())[0]
    powers = []
    while time.time() - t0 < 5:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
        powers.append(sampler.sample(time.time(), set())[0]["power_w"])
    t1 = time.time()
    last = sampler.sample(t1, set())[0]
    sampler.close()
    drawn = last["energy_j"] - first["energy_j"]
    mean_power = sum(powers) / len(powers)
    print(f"energy {drawn:.0f} J over {t1 - t0:.1f} s, mean power {mean_power:.0f} W")
    assert drawn > 0 and 0.5 < drawn / (mean_power * (t1 - t0)) < 2
    engine = create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    create_telemetry_tables(engine)
    with Session(engine) as s:
        for t, rec in ((t0, first), (t1, last)):
            s.add(MetricSample(run_id="gpu", node="local", gpu=0, name="gpu/energy_j", t=t, value=rec["energy_j"]))
        s.commit()
    assert energy_j(engine, "gpu", [(t0, t1)]) == pytest.approx(drawn)


class StoreFailingOnce:
    """An ingestor whose first event line fails to be stored, as a locked or full database would."""

    def __init__(self, inner):
        self.inner, self.failed = inner, False

    def offsets(self, run_id, node, attempt=None):
        return self.inner.offsets(run_id, node, attempt)

    def on_agent_line(self, run_id, node, rec, attempt=None):
        if rec.get("kind") == "event" and not self.failed:
            self.failed = True
            raise sqlalchemy.exc.OperationalError("INSERT INTO events", {}, Exception("database is locked"))
        self.inner.on_agent_line(run_id, node, rec, attempt)


def test_a_failed_store_write_restarts_the_agent_from_the_stored_offsets(tmp_path):
    """One failed write must not end a run's telemetry while it trains on: a new agent continues
    from what the store committed, every step is stored once, and the notices say so."""
    run = make_run(tmp_path)
    (run / "events/rank-1.jsonl").write_text("".join(
        json.dumps({"type": "timing", "rank": 1, "step": s, "time": float(s), "step_time_s": 0.5}) + "\n"
        for s in (1, 2, 3)))
    ingest = Ingestor(make_engine(f"sqlite:///{tmp_path / 'studio.db'}"))
    group = start_torchrun(run, "localhost", life=4.0)
    notices: list[str] = []
    node = NodeWatch(Started(Node(host="localhost", slots=1, device="cpu", local=True, python=sys.executable), None,
                             pgid=group.pid))
    watcher = AttemptWatcher(Pool(), "r1", str(run), [node], stop_requested=lambda: False,
                             on_update=lambda n: None, sink=StoreFailingOnce(ingest), on_notice=notices.append)
    try:
        asyncio.run(asyncio.wait_for(watcher._agent(node), timeout=60))
    finally:
        stop_group(group)
    steps = [e["step"] for e in ingest.events("r1", ["timing"])["timing"]]
    ingest.close()
    assert sorted(steps) == [1, 2, 3]
    assert any("could not be stored (OperationalError" in n for n in notices), notices
    assert notices[-1] == "telemetry from localhost is stored again"
