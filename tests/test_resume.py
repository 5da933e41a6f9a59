"""Stop a real 2-process run with SIGTERM, resume it, and compare the losses with an
uninterrupted run of the same seed; resume FSDP2 and full DDP onto a different world size; DeepSpeed
refuses one clearly; a damaged newest checkpoint is passed over, naming the file."""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
import torch

from launcher import checkpoint
from worker import ROOT, events, kill_tree, losses, run_ok, run_worker, torchrun_argv, worker_env, write_run

pytestmark = pytest.mark.e2e
DATA = str(ROOT / "assets" / "demo" / "train.jsonl") + "#256"


def job(model, **extra) -> dict:
    base = dict(model=str(model), dataset=[DATA], max_length=64, per_device_train_batch_size=4, learning_rate=3e-3,
                max_steps=16, logging_steps=1, save_steps=1000, gradient_checkpointing=False, warmup_ratio=0.1,
                train_type="lora", lora_dropout=0.1, torch_dtype="float32")
    return {**base, **extra}


def stop_after(run_dir, step: int) -> int:
    """Start the worker, SIGTERM torchrun once rank 0 logged `step`; returns torchrun's exit code."""
    log = open(run_dir / "torchrun.log", "w")
    proc = subprocess.Popen(torchrun_argv(run_dir), cwd=ROOT, env=worker_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.time() + 120
        while not any(e["step"] >= step for e in events(run_dir, 0, "train")):
            assert proc.poll() is None and time.time() < deadline, (run_dir / "torchrun.log").read_text()[-3000:]
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGTERM)
        return proc.wait(timeout=60)
    finally:
        kill_tree(proc)
        log.close()


def test_sigterm_checkpoint_and_resume_match_uninterrupted_run(tmp_path, tiny_model):
    whole = write_run(tmp_path / "whole", **job(tiny_model))
    run_ok(whole)
    expected = losses(whole)

    cut = write_run(tmp_path / "cut", **job(tiny_model))
    stop_after(cut, 3)
    end, = events(cut, 0, "end")
    assert end["status"] == "stopped" and end["error"] is None
    k = end["step"]
    assert 3 <= k < 16, "the stop must land mid-run for this test to mean anything"
    assert [e["step"] for e in events(cut, 0, "checkpoint")] == [k]
    assert (cut / f"checkpoint-{k}" / "complete").is_file()

    # A half-written later checkpoint must be ignored by --resume latest.
    partial = cut / f"checkpoint-{k + 1}.tmp"
    shutil.copytree(cut / f"checkpoint-{k}", partial)
    (partial / "complete").unlink()
    proc = run_worker(cut, resume="latest")
    assert proc.returncode == 0, proc.log[-4000:]
    starts = events(cut, 0, "start")
    assert starts[-1]["resumed_from"] == k
    # One rank of the first run tokenized the data; the second run and its resume read that entry.
    assert sorted(e["tokenized"] for r in (0, 1) for e in events(whole, r, "data") if e["phase"] == "ready") == [False, True]
    reads = [e for r in (0, 1) for e in events(cut, r, "data") if e["phase"] == "ready"]
    assert len(reads) == 4 and not any(e["tokenized"] for e in reads)
    assert {e["cache"] for e in reads} == {e["cache"] for e in events(whole, 0, "data")}
    resumed = losses(cut)
    assert sorted(resumed) == list(range(1, 17))
    for step in range(k + 1, 17):
        assert math.isclose(resumed[step], expected[step], rel_tol=1e-4), (step, resumed[step], expected[step])

    # The same checkpoint under another engine: one clear line, not a loader's traceback.
    write_run(cut, **job(tiny_model, fsdp="full_shard"))
    proc = run_worker(cut, resume=str(cut / f"checkpoint-{k}"))
    assert proc.returncode != 0
    message = f"resume: {cut / f'checkpoint-{k}'} has no dcp/ (fsdp writes it)"
    assert message in proc.log, proc.log[-3000:]
    assert "Traceback" not in proc.log.split(message)[0]  # torchrun's own report of the exit may follow


@pytest.mark.parametrize("engine", [dict(fsdp="full_shard"), {}], ids=["fsdp", "ddp-full"])
def test_dcp_checkpoint_resumes_on_other_world_size(tmp_path, tiny_model, engine):
    """FSDP2, and DDP's full fine-tuning (FSDP2 with a replicate mesh), write DCP checkpoints."""
    run = write_run(tmp_path / "run", **job(tiny_model, train_type="full", max_steps=6, save_steps=3, logging_steps=3,
                                            **engine))
    run_ok(run)
    assert (run / "checkpoint-3" / "dcp").is_dir()
    state = json.loads((run / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["engine"] == ("fsdp" if engine else "ddp")
    shutil.rmtree(run / "checkpoint-6")
    proc = run_worker(run, nproc=1, resume=str(run / "checkpoint-3"))
    assert proc.returncode == 0, proc.log[-4000:]
    start = events(run, 0, "start")[-1]
    assert start == {**start, "resumed_from": 3, "world_size": 1}
    first, two_ranks, one_rank = [e["loss"] for e in events(run, 0, "train")]
    # Continues from the trained weights (not from scratch); the data order differs with one rank.
    assert one_rank < first - 0.1 and abs(one_rank - two_ranks) < 0.3, (first, two_ranks, one_rank)


def test_deepspeed_refuses_other_world_size(tmp_path, tiny_model):
    zero = write_run(tmp_path / "zero", **job(tiny_model, deepspeed="zero2", max_steps=2, save_steps=2, logging_steps=2))
    run_ok(zero)
    proc = run_worker(zero, nproc=1, resume="latest")
    assert proc.returncode != 0
    assert "written by 2 ranks and deepspeed cannot reshard it onto 1" in proc.log
    assert "Traceback" not in proc.log.split("written by 2 ranks")[0].splitlines()[-1]


def test_resume_latest_passes_over_a_damaged_checkpoint(tmp_path, tiny_model):
    run = write_run(tmp_path / "run", **job(tiny_model, max_steps=6, save_steps=3, logging_steps=3))
    run_ok(run, nproc=1)
    newest = run / "checkpoint-6"
    adapter, optimizer = newest / "model" / "adapter_model.safetensors", newest / "optimizer.pt"
    size = adapter.stat().st_size
    with open(adapter, "r+b") as f:
        f.truncate(size - 100)
    with open(optimizer, "r+b") as f:  # same size, other bytes
        f.seek(optimizer.stat().st_size // 2)
        f.write(b"\0" * 64)
    damage = f"checkpoint-6/model/adapter_model.safetensors: size {size - 100} != recorded {size}"

    proc = run_worker(run, nproc=1, resume=str(newest))  # named: never swapped for another
    assert proc.returncode == 1
    assert f"resume: checkpoint {newest} does not match what was saved: {damage}; checkpoint-6/optimizer.pt: sha256 " in proc.log

    proc = run_worker(run, nproc=1, resume="latest")
    assert proc.returncode == 0, proc.log[-4000:]
    start = events(run, 0, "start")[-1]
    assert start["resumed_from"] == 3
    skipped, = start["skipped_checkpoints"]
    assert skipped.startswith(f"{damage}; checkpoint-6/optimizer.pt: sha256 ")
    assert f"resume: skipped a damaged checkpoint: {damage}" in proc.log
    assert checkpoint.resolve(run, "6").verified  # saved again on the way


def test_checkpoint_of_the_previous_format_still_resumes(tmp_path, tiny_model):
    """Written before checksums and tensor-only RNG files: the marker holds the step alone and
    rng-rank0.pt numpy's own state tuple (an ndarray)."""
    run = write_run(tmp_path / "run", **job(tiny_model, max_steps=3, save_steps=3, logging_steps=3))
    run_ok(run, nproc=1)
    old = run / "checkpoint-3"
    (old / "complete").write_text("3\n")
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               old / "rng-rank0.pt")
    proc = run_worker(run, nproc=1, resume="latest")
    assert proc.returncode == 0, proc.log[-4000:]
    assert events(run, 0, "start")[-1]["resumed_from"] == 3
    assert f"resume: {old}/complete has no checksums (an older format); loading it unverified" in proc.log


def test_a_stop_keeps_to_its_budget():
    """The ranks skip a checkpoint that would not be written before the stop budget ends (torchrun
    would kill them part-way), and say so."""
    import signal as sig

    from launcher.trainer import StopSignal

    previous = sig.getsignal(sig.SIGTERM)
    try:
        stop = StopSignal(on_timeout=lambda: None, budget_s=30.0)
        assert not stop.too_late(100.0)  # no stop requested
        stop._handle(sig.SIGTERM, None)
        assert stop.requested and not stop.too_late(None) and not stop.too_late(5.0)
        assert stop.too_late(28.0)  # more than the 27 s left once 3 s are kept for leaving
    finally:
        sig.signal(sig.SIGTERM, previous)
