"""Checkpoint directories: atomic publication, verification against the marker, discovery,
pruning; and the NaN stop."""
from __future__ import annotations

import hashlib
import json

import pytest

from backend.telemetry import alerts
from launcher import checkpoint
from worker import ROOT, events, run_worker, write_run


def make(run_dir, step, complete=True):
    tmp = checkpoint.prepare(run_dir, step)
    (tmp / "weights.bin").write_bytes(b"x" * 10)
    return checkpoint.publish(tmp, step) if complete else tmp


def test_publish_is_rename_with_marker_last(tmp_path):
    tmp = checkpoint.prepare(tmp_path, 5)
    assert tmp.name == "checkpoint-5.tmp" and checkpoint.latest(tmp_path) is None
    (tmp / "weights.bin").write_bytes(b"123")
    final = checkpoint.publish(tmp, 5)
    assert final == tmp_path / "checkpoint-5" and not tmp.exists()
    assert (final / "weights.bin").read_bytes() == b"123"
    marker = json.loads((final / "complete").read_text())
    assert marker == {"step": 5, "files": {"weights.bin": {"size": 3, "sha256": hashlib.sha256(b"123").hexdigest()}}}
    assert checkpoint.latest(tmp_path) == final


def test_half_written_checkpoints_are_never_picked(tmp_path):
    make(tmp_path, 10)
    make(tmp_path, 20, complete=False)  # crashed while writing: still .tmp
    no_marker = tmp_path / "checkpoint-30"
    no_marker.mkdir()  # a directory of the right name without the marker
    assert checkpoint.latest(tmp_path) == tmp_path / "checkpoint-10"
    assert checkpoint.resolve(tmp_path, "latest").path == tmp_path / "checkpoint-10"
    with pytest.raises(checkpoint.CheckpointError, match="incomplete"):
        checkpoint.resolve(tmp_path, "30")
    with pytest.raises(checkpoint.CheckpointError, match="does not exist"):
        checkpoint.resolve(tmp_path, str(tmp_path / "checkpoint-40"))
    assert checkpoint.resolve(tmp_path, "10").path == tmp_path / "checkpoint-10"
    # A new save of step 20 replaces the leftover temporary directory.
    make(tmp_path, 20)
    assert checkpoint.latest(tmp_path) == tmp_path / "checkpoint-20"


def test_latest_passes_over_a_damaged_checkpoint_and_says_which_file(tmp_path):
    older, newest = make(tmp_path, 10), make(tmp_path, 20)
    assert checkpoint.resolve(tmp_path, "latest") == checkpoint.Resolved(newest)
    (newest / "weights.bin").write_bytes(b"x" * 4)  # truncated
    assert checkpoint.resolve(tmp_path, "latest") == checkpoint.Resolved(
        older, skipped=("checkpoint-20/weights.bin: size 4 != recorded 10",))
    (newest / "weights.bin").write_bytes(b"y" * 10)  # same size, other bytes
    found = checkpoint.resolve(tmp_path, None)
    assert found.path == older and found.skipped[0].startswith("checkpoint-20/weights.bin: sha256 ")
    # A checkpoint asked for by name is never swapped for another.
    with pytest.raises(checkpoint.CheckpointError, match=r"checkpoint-20 does not match what was saved: "
                                                         r"checkpoint-20/weights.bin: sha256 .* \(changed after the save\)"):
        checkpoint.resolve(tmp_path, "20")
    (older / "weights.bin").unlink()
    with pytest.raises(checkpoint.CheckpointError, match=r"no complete checkpoint in .* matches what was saved: "
                                                         r"checkpoint-20/weights.bin: sha256 .*; checkpoint-10/weights.bin: missing"):
        checkpoint.resolve(tmp_path, "latest")


def test_old_marker_without_checksums_is_still_used_unverified(tmp_path):
    old = make(tmp_path, 10)
    (old / "complete").write_text("10\n")  # the marker before checksums were recorded
    (old / "weights.bin").write_bytes(b"changed")
    assert checkpoint.resolve(tmp_path, "latest") == checkpoint.Resolved(old, verified=False)
    assert checkpoint.resolve(tmp_path, "10") == checkpoint.Resolved(old, verified=False)
    (old / "complete").write_text("garbage")
    with pytest.raises(checkpoint.CheckpointError, match=r"checkpoint-10/complete: not a checkpoint marker"):
        checkpoint.resolve(tmp_path, "10")


def test_prune_deletes_oldest_complete_only(tmp_path):
    for step in (5, 10, 15, 20):
        make(tmp_path, step)
    make(tmp_path, 25, complete=False)
    deleted = checkpoint.prune(tmp_path, keep=2)
    assert [p.name for p in deleted] == ["checkpoint-5", "checkpoint-10"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-15", "checkpoint-20", "checkpoint-25.tmp"]
    assert checkpoint.prune(tmp_path, keep=None) == []


def test_the_best_checkpoint_by_eval_loss_is_kept_beside_the_newest(tmp_path):
    def evaluated(step, loss):
        path = make(tmp_path, step)
        (path / "trainer_state.json").write_text(json.dumps({"step": step, "eval_loss": loss}))
    for step, loss in ((5, 2.0), (10, 1.2), (15, float("nan")), (20, 1.5)):
        evaluated(step, loss)
    make(tmp_path, 25)  # not evaluated: no eval_loss
    (tmp_path / "checkpoint-5" / "trainer_state.json").write_text("{broken")  # unreadable: not a candidate
    assert checkpoint.best(tmp_path).name == "checkpoint-10"
    deleted = checkpoint.prune(tmp_path, keep=2, protected=checkpoint.best(tmp_path))
    assert [p.name for p in deleted] == ["checkpoint-5", "checkpoint-15", "checkpoint-20"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-25"]
    evaluated(30, 1.3)  # a limit of 1 keeps the newest and the best
    assert [p.name for p in checkpoint.prune(tmp_path, keep=1, protected=checkpoint.best(tmp_path))] == ["checkpoint-25"]
    evaluated(35, 0.9)  # a new best: the old one is pruned like any other
    assert checkpoint.best(tmp_path).name == "checkpoint-35"
    assert [p.name for p in checkpoint.prune(tmp_path, keep=2, protected=checkpoint.best(tmp_path))] == ["checkpoint-10"]
    assert checkpoint.best(tmp_path / "none") is None


def test_early_stop_counts_the_evaluations_since_the_best():
    from launcher.trainer import best_eval, early_stop_due

    losses = {50: 1.4, 100: 1.1, 150: 1.2, 200: float("nan"), 250: 1.1}
    assert best_eval(losses) == (100, 1.1)  # the earliest of equals; NaN is never best
    assert not early_stop_due(losses, None) and not early_stop_due(losses, 4)
    assert early_stop_due(losses, 3) and early_stop_due(losses, 1)
    assert not early_stop_due({**losses, 300: 1.0}, 1) and best_eval({}) == (-1, float("inf"))


def nan_run(tmp_path, tiny_model, logging_steps: int):
    """A run of a model whose weights make every loss NaN."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "nan-model"
    shutil.copytree(tiny_model, broken)
    weights = load_file(broken / "model.safetensors")
    key = next(k for k in weights if "layers.1.mlp.down_proj" in k)
    weights[key] = torch.full_like(weights[key], float("nan"))
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    return write_run(tmp_path / "run", model=str(broken), dataset=[str(ROOT / "assets/demo/train.jsonl#64")],
                     max_length=32, max_steps=20, logging_steps=logging_steps, train_type="full", torch_dtype="float32")


@pytest.mark.e2e
def test_nan_loss_stops_the_run_with_a_clear_message(tmp_path, tiny_model):
    run = nan_run(tmp_path, tiny_model, logging_steps=10)
    proc = run_worker(run, nproc=1, timeout=180)
    assert proc.returncode == 1
    assert "loss was NaN/inf for 3 consecutive steps (up to step 3); stopping" in proc.log
    end, = events(run, 0, "end")
    assert end["status"] == "failed" and end["step"] == 3 and "NaN/inf" in end["error"]
    assert not list(run.glob("checkpoint-*"))  # a diverged state is not saved


@pytest.mark.e2e
def test_nan_loss_of_a_logged_step_is_named_in_its_event(tmp_path, tiny_model):
    run = nan_run(tmp_path, tiny_model, logging_steps=1)
    assert run_worker(run, nproc=1, timeout=180).returncode == 1
    logged = events(run, 0, "train")  # steps 1 and 2; step 3 is the third NaN and stops the run
    assert [e["step"] for e in logged] == [1, 2]
    assert all(e["loss"] is None and e["nonfinite"]["loss"] == "nan" for e in logged)
    window = alerts.Window(now=logged[-1]["time"], running=True, train=logged)
    assert [f.key for f in alerts.non_finite(window, alerts.AlertConfig())][:1] == ["non_finite:loss"]
