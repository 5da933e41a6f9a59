"""Checkpoint files are read without running code from them: a crafted pickle in place of any file
that resume or export reads is refused with a message naming it, and its payload never runs."""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from launcher import checkpoint
from worker import ROOT, run_worker, run_workers, worker_env, write_run

pytestmark = pytest.mark.e2e
DATA = str(ROOT / "assets" / "demo" / "train.jsonl") + "#64"


class RunsCommand:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def craft(path, marker) -> None:
    """A file of the right name whose loading runs the payload: a torch file, or DCP's raw pickle."""
    if path.name == ".metadata":
        path.write_bytes(pickle.dumps(RunsCommand(marker)))
    else:
        torch.save({"state": RunsCommand(marker)}, path)


def tampered(run, tmp_path, rel: str, remove: str | None = None):
    """A copy of `run` with a crafted file at `rel` (and `remove` deleted). The marker is rewritten in
    its old form, which records no checksums: whoever can write the file can rewrite the marker."""
    copy = shutil.copytree(run, tmp_path / "run")
    ckpt = copy / "checkpoint-2"
    if remove:
        (ckpt / remove).unlink()
    marker = tmp_path / "payload-ran"
    craft(ckpt / rel, marker)
    (ckpt / checkpoint.MARKER).write_text("2\n")
    return copy, ckpt / rel, marker


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model):
    """One-rank checkpoints at step 2 of each engine's format: torch DDP (LoRA: optimizer.pt), DCP
    (full fine-tuning in fp32 on FSDP2's machinery: dcp/ + scheduler.pt) and DeepSpeed ZeRO-2 (engine/)."""
    root = tmp_path_factory.mktemp("safety")
    base = dict(model=str(tiny_model), dataset=[DATA], max_length=32, per_device_train_batch_size=4, max_steps=2,
                save_steps=2, logging_steps=2, gradient_checkpointing=False, torch_dtype="float32")
    made = {name: write_run(root / name, **base, **extra)
            for name, extra in [("lora", dict(train_type="lora")), ("full", dict(train_type="full")),
                                ("zero2", dict(train_type="full", deepspeed="zero2"))]}
    for proc in run_workers([dict(run_dir=run, nproc=1) for run in made.values()]):
        assert proc.returncode == 0, proc.log[-3000:]
    return made


def test_only_the_checkpoint_module_unpickles():
    """Every file the worker and export read goes through launcher.checkpoint (weights_only, the
    restricted DCP unpickler, or safe_torch_load around DeepSpeed's own loads), so one crafted file
    per reading path below covers the rest."""
    import re

    found = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "launcher").rglob("*.py"))
             if path.name != "checkpoint.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"\b(torch\.load|pickle\.loads?|Unpickler)\b", line.split("#")[0])]
    assert found == []


# One file per reading path: the trainer's RNG state, torch DDP's optimizer, DCP (FSDP2, TP) and
# DeepSpeed's engine files (its model states are read the same way, by export below).
@pytest.mark.parametrize("name,rel", [
    ("lora", "rng-rank0.pt"),
    ("lora", "optimizer.pt"),
    ("full", "dcp/.metadata"),
    ("zero2", "engine/zero_pp_rank_0_mp_rank_00_optim_states.pt"),
])
def test_resume_refuses_a_crafted_file(runs, tmp_path, name, rel):
    run, crafted, marker = tampered(runs[name], tmp_path, rel)
    proc = run_worker(run, nproc=1, resume="latest")
    assert not marker.exists(), "the crafted pickle ran its command"
    assert proc.returncode != 0
    assert f"resume: {crafted}: cannot be read safely (" in proc.log, proc.log[-3000:]


@pytest.mark.parametrize("name,rel,remove", [
    ("full", "dcp/.metadata", None),
    # Without model/*.safetensors the weights are consolidated from engine/ by zero_to_fp32.
    ("zero2", "engine/mp_rank_00_model_states.pt", "model/model.safetensors"),
])
def test_export_refuses_a_crafted_file(runs, tmp_path, name, rel, remove):
    run, crafted, marker = tampered(runs[name], tmp_path, rel, remove)
    proc = subprocess.run([sys.executable, "-m", "launcher.export", "--run-dir", str(run)], cwd=ROOT, env=worker_env(),
                          capture_output=True, text=True, timeout=180)
    assert not marker.exists(), "the crafted pickle ran its command"
    assert proc.returncode == 1 and proc.stdout == ""
    assert f"error: {crafted}: cannot be read safely (" in proc.stderr, proc.stderr[-3000:]


def test_crafted_dcp_item_is_refused(tmp_path):
    """DCP stores non-tensor values (the optimizer's param_groups) as pickled items inside its shards."""
    dcp.save({"lr": 0.5, "weight": torch.ones(3, dtype=torch.bfloat16)}, checkpoint_id=str(tmp_path / "good"), no_dist=True)
    state = {"lr": 0.1, "weight": torch.zeros(3, dtype=torch.bfloat16)}
    checkpoint.dcp_read(state, tmp_path / "good", no_dist=True)
    assert state["lr"] == 0.5 and state["weight"].tolist() == [1, 1, 1]
    marker = tmp_path / "payload-ran"
    dcp.save({"lr": RunsCommand(marker), "weight": torch.ones(3)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with pytest.raises(checkpoint.CheckpointError, match=f"{tmp_path / 'dcp'}: cannot be read safely"):
        checkpoint.dcp_read({"lr": 0.1, "weight": torch.zeros(3)}, tmp_path / "dcp", no_dist=True)
    assert not marker.exists()


def test_deepspeed_files_load_with_exactly_the_allowed_classes(runs, tmp_path):
    """Pins the DeepSpeed workaround: its optimizer state needs the listed classes (and no others);
    with them a real ZeRO-2 checkpoint resumes."""
    from launcher.engines.zero import pickled_classes

    optim = runs["zero2"] / "checkpoint-2" / "engine" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with pytest.raises(checkpoint.CheckpointError, match="LossScaler was not an allowed global"):
        checkpoint.read(optim)
    state = checkpoint.read(optim, allowed=pickled_classes())
    assert state["optimizer_state_dict"]["zero_stage"] == 2
    copy = shutil.copytree(runs["zero2"], tmp_path / "run")
    proc = run_worker(copy, nproc=1, resume="latest")
    assert proc.returncode == 0, proc.log[-3000:]
    assert "resumed from" in proc.log
