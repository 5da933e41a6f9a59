"""Admission: nproc_per_node fits the node, and a run does not start on slots another run holds."""
from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest

from backend.cluster.admission import busy_nodes, holding
from backend.job.cluster import Cluster, GpuInfo, Node, local_cluster, parse_hostfile_text
from backend.job.spec import JobSpec
from backend.job.validate import errors, validate
from backend.runs.manager import RunManager
from worker import ROOT

GPU = Node(host="gpu-01", slots=8, device="cuda")
CPU = Node(host="cpu-01", slots=2, device="cpu")


def spec(**over) -> JobSpec:
    return JobSpec(**{"model": "Qwen/Qwen2.5-0.5B", "dataset": ["d"], **over})


def nproc_errors(job, cluster):
    return [p.message for p in errors(validate(job, cluster)) if p.field == "nproc_per_node"]


def test_nproc_above_gpus_or_cores_is_refused():
    gpus = parse_hostfile_text("gpu-01 slots=8\n")
    assert nproc_errors(spec(nproc_per_node=9), gpus) == ["9 processes per node, but gpu-01 has 8 slot(s) (GPUs)"]
    assert nproc_errors(spec(nproc_per_node=8), gpus) == []
    cpus = parse_hostfile_text("cpu-01 slots=2 device=cpu\n")
    assert nproc_errors(spec(nproc_per_node=100000), cpus) == [
        "100000 processes per node, but cpu-01 has 2 slot(s) (CPU cores)"]


def test_the_local_cpu_node_has_a_slot_per_usable_core():
    local = local_cluster(GpuInfo((), None))
    assert local.nodes[0].slots == len(os.sched_getaffinity(0))
    # The bundled demo's 2 ranks stay valid on a 2-core machine, without a warning.
    two_cores = Cluster(nodes=(replace(local.nodes[0], slots=2),), source="local")
    assert not [p for p in validate(spec(nproc_per_node=2), two_cores) if p.field == "nproc_per_node"]


def test_a_run_yields_to_the_runs_recorded_before_it():
    first = holding("run-a", 1, spec(nproc_per_node=6), [GPU])
    second = holding("run-b", 2, spec(nproc_per_node=4), [GPU])
    ((node, message),) = busy_nodes(second, [GPU], [first, second])
    assert node == GPU
    assert message == ("gpu-01 is busy: run run-a (6) hold 6 of its 8 GPUs, and this job needs 4; "
                               "wait for them to finish, stop them, or lower nproc_per_node")
    # The earlier one never yields to the later one: two submissions at once start exactly one.
    assert busy_nodes(first, [GPU], [first, second]) == []
    # Runs that fit side by side (4 + 4 of 8 GPUs) both start.
    assert busy_nodes(holding("run-c", 3, spec(nproc_per_node=4), [GPU]), [GPU],
                         [holding("run-a", 1, spec(nproc_per_node=4), [GPU])]) == []


def test_busy_counts_every_holder_and_only_shared_nodes():
    other = Node(host="cpu-02", slots=2, device="cpu", addr="10.0.0.9")
    holders = [holding("a", 1, spec(nproc_per_node=1), [CPU]), holding("b", 2, spec(nproc_per_node=1), [CPU]),
               holding("c", 3, spec(nproc_per_node=2), [other])]
    new = holding("d", 4, spec(nproc_per_node=1, nnodes=2), [CPU, other])
    messages = [message for _, message in busy_nodes(new, [CPU, other], holders)]
    assert messages == [
        "cpu-01 is busy: run a (1), run b (1) hold 2 of its 2 CPU cores, and this job needs 1; wait for them to "
        "finish, stop them, or lower nproc_per_node",
        "cpu-02 is busy: run c (2) hold 2 of its 2 CPU cores, and this job needs 1; wait for them to finish, stop "
        "them, or lower nproc_per_node"]
    # A resume of the same run does not count its own earlier attempt.
    assert busy_nodes(holding("a", 5, spec(nproc_per_node=2), [CPU]), [CPU], holders[:1]) == []


def test_ranks_running_on_a_node_count_whichever_database_started_them():
    known = holding("run-a", 1, spec(nproc_per_node=1), [CPU])
    new = holding("run-b", 2, spec(nproc_per_node=1), [CPU])
    # run-a is known and found running (counted once); run-x only runs there (another database).
    running = {"cpu-01": {"run-a": 1, "run-x": 1}}
    ((_, message),) = busy_nodes(new, [CPU], [known], running)
    assert message.startswith("cpu-01 is busy: run run-a (1), run run-x (1 running there) hold 2 of its 2 CPU cores")
    # A resume finds its own earlier ranks still exiting: they are its own, not another run's.
    assert busy_nodes(new, [CPU], [], {"cpu-01": {"run-b": 2}}) == []
    assert busy_nodes(new, [CPU], [], {"cpu-01": {"run-x": 1}}) == []


@pytest.mark.e2e
def test_runs_submitted_back_to_back_do_not_share_the_cores(tmp_path, tiny_model):
    """Runs at once on this machine: the first takes every core; the one after it in the same
    database is refused naming it, and so is one from a second database (another studio, a CLI
    with its own `--db`), which finds the first's ranks running on the node. Once the first has
    ended, the same job starts."""
    cluster = local_cluster(GpuInfo())
    cores = cluster.nodes[0].slots
    spec = JobSpec(model=str(tiny_model), dataset=[str(ROOT / "assets" / "demo" / "train.jsonl")],
                   output_dir=str(tmp_path / "out"), nproc_per_node=cores, max_steps=3000, save_strategy="no",
                   logging_steps=1, torch_dtype="float32", max_length=64, gradient_checkpointing=False,
                   env={"OMP_NUM_THREADS": "1"})
    busy = f"localhost is busy: run {{}} ({cores}{{}}) hold {cores} of its {cores} CPU cores"
    with RunManager(f"sqlite:///{tmp_path / 'studio.db'}") as m, \
            RunManager(f"sqlite:///{tmp_path / 'other.db'}") as other:
        first, second = (m.launch(spec, cluster, name=name) for name in ("first", "second"))
        try:
            run = m.wait(second, timeout=120)
            assert run.state == "failed" and run.cause == "node_busy", (run.state, run.cause, run.message)
            assert run.message.startswith(busy.format(first, "")), run.message
            assert run.failed_node == "localhost" and not m.processes(second)
            # The other database knows nothing of `first`: what runs on the node refuses its run.
            deadline = time.monotonic() + 120
            while not (m.progress(first) or {}).get("step") and time.monotonic() < deadline:  # its ranks train
                time.sleep(0.2)
            third = other.launch(spec.model_copy(update={"max_steps": 4}), cluster, name="third")
            run = other.wait(third, timeout=120)
            assert run.state == "failed" and run.cause == "node_busy", (run.state, run.cause, run.message)
            assert run.message.startswith(busy.format(first, " running there")), run.message
            assert not other.processes(third)
        finally:  # the first trains until stopped, whatever failed above
            assert m.stop(first).state == "stopped"
        assert other.wait(other.resume(third), timeout=240).state == "succeeded"
