"""A run directory is claimed on disk: made whole with its marker and renamed into place, written
into again only by the run whose token the marker holds. Two studios (or a CLI with --db) with the
same output_dir and run name both trained into `out/<name>` and failed on each other's checkpoints;
a fresh database with `--name same` trained inside an existing run's directory."""
from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from backend.cluster import launch
from backend.cluster.nodes import Pool
from backend.job.cluster import GpuInfo, local_cluster
from backend.job.spec import JobSpec
from backend.runs.manager import RunManager
from worker import ROOT

DATA = str(ROOT / "assets" / "demo" / "train.jsonl") + "#32"


def write(run_dir: Path, files: dict, claim: str | None) -> None:
    async def go():
        pool = Pool(None)
        try:
            await launch.write_files(pool, local_cluster(GpuInfo()).nodes[0], None, str(run_dir), files, claim=claim)
        finally:
            await pool.close()
    asyncio.run(go())


def test_processes_claiming_one_directory_at_once_leave_one_owner(tmp_path):
    run_dir = tmp_path / "out" / "same"
    procs = [subprocess.Popen([sys.executable, "-c", launch.WRITE_FILES_PY, str(run_dir), f"token-{i}"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(6)]
    for i, p in enumerate(procs):
        p.stdin.write(json.dumps({"job.yaml": f"writer {i}\n"}))
        p.stdin.close()
    codes = [p.wait(timeout=60) for p in procs]
    [winner] = [i for i, code in enumerate(codes) if code == 0]
    assert sorted(codes) == [0] + [launch.CLAIM_TAKEN_EXIT] * 5
    assert (run_dir / launch.CLAIM_FILE).read_text() == f"token-{winner}\n"
    assert (run_dir / "job.yaml").read_text() == f"writer {winner}\n"
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["same"]  # no temporary left behind


def test_a_directory_that_is_not_this_runs_is_refused_and_left_as_it_was(tmp_path):
    theirs = tmp_path / "out" / "theirs"
    write(theirs, {"job.yaml": "theirs\n"}, claim="their-token")
    with pytest.raises(launch.RunDirTaken, match=rf"the run directory {theirs} already exists on localhost and is "
                                                 r"not this run's \(its \.swift-studio-run marker is another run's\)"):
        write(theirs, {"job.yaml": "mine\n"}, claim="my-token")
    assert (theirs / "job.yaml").read_text() == "theirs\n"
    write(theirs, {"job.yaml": "theirs again\n"}, claim="their-token")  # its own run: a resume, a restart
    assert (theirs / "job.yaml").read_text() == "theirs again\n"

    user = tmp_path / "out" / "user-dir"
    user.mkdir()
    (user / "notes.txt").write_text("keep")
    with pytest.raises(launch.RunDirTaken, match="no .swift-studio-run marker in it"):
        write(user, {"job.yaml": "mine\n"}, claim="my-token")
    write(user, {"job.yaml": "old run\n"}, claim="")  # a run from before claims resumes in its directory
    assert sorted(p.name for p in user.iterdir()) == ["job.yaml", "notes.txt"]

    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "out" / "link").symlink_to(target)
    with pytest.raises(launch.RunDirTaken, match="not this run's"):
        write(tmp_path / "out" / "link", {"job.yaml": "mine\n"}, claim="my-token")
    assert list(target.iterdir()) == []


def fingerprint(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.e2e
def test_two_databases_launching_one_name_at_once_and_a_third_later(tmp_path, tiny_model):
    spec = JobSpec(model=str(tiny_model), dataset=[DATA], output_dir=str(tmp_path / "out"), nproc_per_node=1,
                   max_steps=2, save_steps=2, logging_steps=1, torch_dtype="float32", max_length=32,
                   gradient_checkpointing=False, env={"OMP_NUM_THREADS": "1"})
    cluster = local_cluster(GpuInfo())
    with RunManager(f"sqlite:///{tmp_path / 'a.db'}") as a, RunManager(f"sqlite:///{tmp_path / 'b.db'}") as b:
        ids = a.launch(spec, cluster, name="same"), b.launch(spec, cluster, name="same")
        assert ids == ("same", "same")
        runs = a.wait("same", timeout=300), b.wait("same", timeout=300)
    [won] = [r for r in runs if r.state == "succeeded"]
    [lost] = [r for r in runs if r.state == "failed"]
    assert lost.message.startswith(f"launch failed: the run directory {tmp_path / 'out' / 'same'} already exists"), lost.message
    assert (tmp_path / "out" / "same" / launch.CLAIM_FILE).read_text() == won.dir_claim + "\n"
    before = fingerprint(tmp_path / "out" / "same")
    assert "checkpoint-2/model/adapter_model.safetensors" in before

    with RunManager(f"sqlite:///{tmp_path / 'c.db'}") as c:
        third = c.launch(spec, cluster, name="same")
        assert third.startswith("same-") and c.wait(third, timeout=300).state == "succeeded"
    assert fingerprint(tmp_path / "out" / "same") == before
