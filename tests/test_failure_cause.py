"""A failed run names what its workers reported: real torchrun runs through the RunManager, on
the local node and on two real SSH nodes (127.0.0.2, 127.0.0.3) sharing the run directory; a
full disk is a real tmpfs that the first checkpoint fills."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.cluster import remote
from backend.cluster.preflight import DISK_ERROR_GIB
from backend.job import records
from backend.job.cluster import Cluster, LOCAL_ADDR, LOCAL_HOST, Node
from backend.job.spec import JobSpec
from backend.runs.manager import RunManager
from worker import ROOT, events, until

LOCAL = Cluster(nodes=(Node(host=LOCAL_HOST, addr=LOCAL_ADDR, slots=2, python=sys.executable, local=True,
                            device="cpu"),), source="test")


def job(tiny_model: Path, out: Path, **fields) -> JobSpec:
    base = dict(model=str(tiny_model), dataset=[str(ROOT / "assets" / "demo" / "train.jsonl") + "#64"],
                output_dir=str(out), nnodes=1, nproc_per_node=2, max_length=32, max_steps=4, save_steps=2,
                logging_steps=1, torch_dtype="float32", gradient_checkpointing=False, env={"OMP_NUM_THREADS": "1"})
    return JobSpec(**{**base, **fields})


@pytest.fixture
def manager(tmp_path):
    managers = []

    def make(known_hosts: Path | None = None) -> RunManager:
        managers.append(RunManager(f"sqlite:///{tmp_path / 'studio.db'}", known_hosts=known_hosts or tmp_path / "kh"))
        return managers[-1]

    yield make
    for m in managers:
        m.close()


@contextlib.contextmanager
def tmpfs(where: Path, size: str):
    where.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {res.stderr.strip()}")
    yield where
    subprocess.run(["umount", "--lazy", str(where)], check=True)  # lazy: a failed test's run may still write there


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs: room for the run's files and logs, not for a checkpoint of the tiny model."""
    with tmpfs(tmp_path / "small-disk", "256k") as where:
        yield where


@pytest.fixture
def filling_disk(tmp_path):
    """A tmpfs with the room a launch asks for (preflight.DISK_ERROR_GIB); `fill()` then leaves
    256 KiB of it, as a disk that other writers fill while the run trains."""
    with tmpfs(tmp_path / "filling-disk", str(int(DISK_ERROR_GIB * 2**30) + (4 << 20))) as where:
        def fill() -> None:
            with open(where / "filler", "wb") as f:
                for _ in range(50):  # the run writes beside it: what is free changes while it is taken
                    if (free := shutil.disk_usage(where).free) <= 256 << 10:
                        return
                    with contextlib.suppress(OSError):
                        os.posix_fallocate(f.fileno(), f.seek(0, os.SEEK_END), free - (256 << 10))
            raise AssertionError(f"{where} did not fill up: {shutil.disk_usage(where).free} bytes free")

        yield where, fill


def test_exit_code_survives_a_full_disk(small_disk):
    """The wrapper's last write, torchrun's exit code, lands after the command filled the disk."""
    paths = remote.NodePaths(str(small_disk), "n1")
    fill = f"cat /dev/zero > {small_disk}/fill 2>/dev/null; exit 3"
    out = subprocess.run(["bash", "-c", remote.detached_start(["sh", "-c", fill], {}, paths, "rid")],
                         capture_output=True, text=True, timeout=30)
    pgid = int(out.stdout)

    def probe() -> tuple[bool, int | None]:
        answer = subprocess.run(["bash", "-c", remote.probe(pgid, paths)], capture_output=True, text=True)
        return remote.parse_probe(answer.stdout)

    try:
        end = time.monotonic() + 20
        while probe()[0] and time.monotonic() < end:
            time.sleep(0.1)
        alive, code = probe()
    finally:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert shutil.disk_usage(small_disk).free == 0
    assert (alive, code) == (False, 3)


@pytest.mark.e2e
def test_bad_record_names_file_line_rank_and_node(manager, tiny_model, tmp_path):
    rows = (ROOT / "assets" / "demo" / "train.jsonl").read_text().splitlines()
    rows[706] = json.dumps({"foo": 1})  # line 707: record 706
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(rows) + "\n")
    # Past the records the validator samples before launch (a bad line 7 never reaches a worker).
    assert records.sample_problems(str(data), JobSpec(model="m", dataset=["d"]).max_record_bytes) == []
    m = manager()
    run = m.wait(m.launch(job(tiny_model, tmp_path / "out", dataset=[str(data)]), LOCAL), timeout=180)
    assert (run.state, run.cause) == ("failed", "data_error"), (run.cause, run.message, run.log_tail)
    assert run.failed_node == LOCAL_HOST and run.exit_code == 1
    # the worker's own message, once, after where it happened
    # one tokenization, one error: the lowest rank reports it, rank 1 only stopped for it (whichever built it)
    assert run.message.startswith(f"data error (node {LOCAL_HOST}, rank 0): {data}:707: unknown record format "
                                  "with fields ['foo']"), run.message
    assert "DataError" not in run.message and "exit code" not in run.message


@pytest.mark.e2e
def test_damaged_checkpoint_is_named_on_resume(manager, tiny_model, tmp_path):
    m = manager()
    run = m.wait(m.launch(job(tiny_model, tmp_path / "out", max_steps=2), LOCAL), timeout=180)
    assert run.state == "succeeded", (run.message, run.log_tail)
    ckpt = Path(run.run_dir) / "checkpoint-2"
    damaged = ckpt / "optimizer.pt"
    damaged.write_bytes(damaged.read_bytes()[:100])

    run = m.wait(m.launch(job(tiny_model, tmp_path / "out", resume_from_checkpoint=str(ckpt)), LOCAL), timeout=180)
    assert (run.state, run.cause) == ("failed", "checkpoint_error"), (run.cause, run.message, run.log_tail)
    assert run.message.startswith(f"checkpoint error (node {LOCAL_HOST}, rank "), run.message
    assert "checkpoint-2/optimizer.pt" in run.message, run.message


@pytest.mark.e2e
def test_a_launch_where_the_disk_is_nearly_full_is_refused_before_anything_starts(manager, tiny_model, small_disk):
    """Pre-flight calls less than DISK_ERROR_GIB free an error; a launch there is refused, naming
    the node, the directory and the space, before a worker starts."""
    m = manager()
    run = m.wait(m.launch(job(tiny_model, small_disk), LOCAL), timeout=60)
    assert (run.state, run.cause, run.failed_node) == ("failed", "disk_full", LOCAL_HOST), run.message
    assert run.message.startswith(f"{LOCAL_HOST}: 0.00 GiB free for the run directory {run.run_dir}, less than the "
                                  f"{DISK_ERROR_GIB:g} GiB a run needs there"), run.message
    assert "nothing was started" in run.message
    assert [p.pgid for p in m.processes(run.id)] == [] and not (Path(run.run_dir) / "logs").exists()


def test_full_disk_is_named_with_path_and_node_and_keeps_the_exit_code(manager, tiny_model, filling_disk):
    disk, fill = filling_disk
    m = manager()
    # Full fine-tuning: its checkpoint (weights and Adam's states, >1 MiB) cannot fit the 256 KiB
    # fill() leaves; a LoRA checkpoint of the tiny model (~300 KB) nearly did, and once did.
    run_id = m.launch(job(tiny_model, disk, max_steps=200, save_steps=100, train_type="full"), LOCAL)
    until(lambda: events(Path(m.run(run_id).run_dir), 0, "train") or m.run(run_id).state in ("failed", "succeeded"),
          timeout=120, every=0.01)
    fill()
    run = m.wait(run_id, timeout=180)
    assert (run.state, run.cause) == ("failed", "disk_full"), (run.cause, run.message, run.log_tail)
    assert run.message.startswith(f"disk full (node {LOCAL_HOST}, rank "), run.message
    assert re.search(rf"No space left on device: {re.escape(run.run_dir)} \([0-9.]+ [KMG]?i?B free of 2\.0 GiB\)",
                     run.message), run.message
    # the wrapper's exit file, written over bytes taken at the start, survived the full disk
    assert run.exit_code == 1
    # What the full disk left (an unfinished checkpoint, where the disk filled while one was
    # written) the resume's attempt removes (before, the job file could not be written and
    # job.yaml.tmp was left behind); then it finds too little space for a run and starts nothing.
    m.resume(run.id)
    again = m.wait(run.id, timeout=180)
    assert (again.state, again.cause, again.attempts) == ("failed", "disk_full", 2), (again.message, again.log_tail)
    assert again.message.startswith(f"{LOCAL_HOST}: 0.00 GiB free for the run directory {run.run_dir}"), again.message
    assert list(Path(run.run_dir).glob("*.tmp")) == []


@pytest.mark.e2e
def test_an_error_on_one_node_only_names_that_node_and_rank(manager, tiny_model, tmp_path, sshd_nodes):
    """Rank 1 alone cannot read its RNG state; rank 0, on the other node, loses its peer."""
    cluster = Cluster(nodes=sshd_nodes.nodes(), source="test")
    m = manager(sshd_nodes.known_hosts)
    spec = job(tiny_model, tmp_path / "out", nnodes=2, nproc_per_node=1, max_steps=3, save_steps=3)
    run = m.wait(m.launch(spec, cluster, setups=sshd_nodes.setups()), timeout=240)
    assert run.state == "succeeded", (run.message, run.log_tail)
    ckpt = Path(run.run_dir) / "checkpoint-3"
    (ckpt / "rng-rank1.pt").write_bytes(b"not a torch file")
    (ckpt / "complete").write_text("3\n")  # a marker of the older format, without checksums: loaded unverified

    resumed = spec.model_copy(update={"max_steps": 6, "resume_from_checkpoint": str(ckpt)})
    run = m.wait(m.launch(resumed, cluster, setups=sshd_nodes.setups()), timeout=240)
    run_dir = Path(run.run_dir)
    assert (run.state, run.cause) == ("failed", "checkpoint_error"), (run.cause, run.message, run.log_tail)
    # where rank 1 ran this attempt: the node whose log has its error line
    rank1 = [n.host for n in cluster.nodes
             if "[rank1] error:" in (run_dir / "logs" / f"{remote.node_file_name(n.host)}.log").read_text()]
    assert rank1 and run.failed_node == rank1[0], (run.failed_node, rank1, run.message)
    assert run.message.startswith(f"checkpoint error (node {rank1[0]}, rank 1): "), run.message
    assert f"{ckpt}/rng-rank1.pt" in run.message, run.message
