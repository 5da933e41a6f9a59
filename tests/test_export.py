"""launcher.export: LoRA merged into the base, sharded full checkpoints consolidated; the result
loads with AutoModelForCausalLM and generates. The target is only ever an empty directory or an
earlier export; a damaged newest checkpoint is passed over."""
from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from worker import ROOT, run_ok, worker_env, write_run

pytestmark = pytest.mark.e2e
DATA = str(ROOT / "assets" / "demo" / "train.jsonl") + "#128"


def job(model, **extra) -> dict:
    base = dict(model=str(model), dataset=[DATA], max_length=64, per_device_train_batch_size=4, learning_rate=1e-2,
                max_steps=3, logging_steps=3, save_steps=3, gradient_checkpointing=False, torch_dtype="float32",
                lora_dropout=0.0)
    return {**base, **extra}


def export_proc(run_dir, *args, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.export", "--run-dir", str(run_dir), *args], cwd=ROOT,
                          env=worker_env(), capture_output=True, text=True, timeout=180, preexec_fn=preexec_fn)


def export(run_dir, *args) -> dict:
    proc = export_proc(run_dir, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0])


def export_here(capsys, run_dir, *args) -> dict:
    """The export CLI in this process (no interpreter start): its one JSON line."""
    from launcher.export import main

    code = main(["--run-dir", str(run_dir), *args])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    return json.loads(lines[0])


def export_refusal(capsys, run_dir, *args) -> str:
    from launcher.export import main

    code = main(["--run-dir", str(run_dir), *args])
    out, err = capsys.readouterr()
    assert code == 1 and out == "", (out, err[-3000:])
    return err


def export_error(run_dir, *args, preexec_fn=None) -> str:
    proc = export_proc(run_dir, *args, preexec_fn=preexec_fn)
    assert proc.returncode == 1 and proc.stdout == "", (proc.stdout, proc.stderr[-3000:])
    return proc.stderr


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model):
    """A LoRA run with checkpoints at steps 3 and 6."""
    run = write_run(tmp_path_factory.mktemp("lora") / "run", **job(tiny_model, train_type="lora", max_steps=6))
    run_ok(run)
    return run


def test_lora_merge_matches_peft_and_generates(lora_run, tiny_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = lora_run
    result = export(run, "--checkpoint", "3")
    out = run / "export"
    assert result["out"] == str(out) and result["checkpoint"] == str(run / "checkpoint-3")
    assert isinstance(result["sample"], str)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()

    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), run / "checkpoint-3" / "model").eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged_logits, peft_logits, base_logits = merged(ids).logits, peft(ids).logits, base(ids).logits
    assert torch.allclose(merged_logits, peft_logits, atol=1e-4)
    assert not torch.allclose(merged_logits, base_logits, atol=1e-3)  # the adapter did change the model

    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("What is 2 + 3?", return_tensors="pt")
    generated = merged.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] > prompt["input_ids"].shape[1]


@pytest.fixture(scope="module")
def ddp_full_weights(tmp_path_factory, tiny_model):
    """Full fine-tuning with DDP's layout (every rank holds every weight), exported: the reference below.
    It is written through DCP as FSDP2's is (shards of one rank instead of two), so the ZeRO-3 case is
    the one independent of that path."""
    root = tmp_path_factory.mktemp("ddp")
    run = write_run(root / "run", **job(tiny_model, train_type="full"))
    run_ok(run)
    from launcher.export import export as export_run

    assert export_run(run, None, root / "export")["checkpoint"] == str(run / "checkpoint-3")
    return load_file(root / "export" / "model.safetensors")


@pytest.mark.parametrize("engine,marker", [(dict(fsdp="full_shard"), "dcp"), (dict(deepspeed="zero3"), "engine")])
def test_sharded_full_checkpoint_consolidates_to_ddp_weights(tmp_path, tiny_model, ddp_full_weights, engine, marker,
                                                              capsys):
    run = write_run(tmp_path / "sharded", **job(tiny_model, train_type="full", **engine))
    run_ok(run)
    ckpt = run / "checkpoint-3"
    assert (ckpt / marker).is_dir() and not list((ckpt / "model").glob("*.safetensors"))  # really sharded
    result = export_here(capsys, run, "--out", str(tmp_path / "export"))
    assert result["checkpoint"] == str(ckpt)
    consolidated = load_file(tmp_path / "export" / "model.safetensors")
    reference = ddp_full_weights
    initial = load_file(tiny_model / "model.safetensors")
    assert set(consolidated) == set(reference)
    for key, value in reference.items():
        # ZeRO-3's reductions run in another order than DDP's: after 3 AdamW steps a weight is off by
        # up to ~1e-5 (Adam divides a tiny gradient by its own size); a consolidation that misplaced or
        # missed a shard would be off by the updates themselves (~1e-2).
        assert torch.allclose(consolidated[key], value, atol=5e-5), (key, (consolidated[key] - value).abs().max().item())
    assert any(not torch.equal(reference[k], initial[k]) for k in reference)


def test_export_without_checkpoint_is_a_clear_error(tmp_path, tiny_model, capsys):
    from launcher.export import main

    run = write_run(tmp_path / "empty", **job(tiny_model))
    assert main(["--run-dir", str(run)]) == 1
    assert f"{run}: no complete checkpoint to export" in capsys.readouterr().err
    assert main(["--run-dir", str(run), "--checkpoint", "7"]) == 1
    assert f"checkpoint {run / 'checkpoint-7'} does not exist" in capsys.readouterr().err


def test_export_refuses_a_target_it_did_not_write(lora_run, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    a_file = tmp_path / "file.txt"
    a_file.write_text("keep me too")
    before = sorted(p.relative_to(lora_run) for p in lora_run.rglob("*"))
    for target, why in [(other, "exists and is not an earlier export (it has files and no .swift-studio-export)"),
                        (a_file, "exists and is not a directory"),
                        (lora_run, f"is the run directory {lora_run} or holds it"),
                        (lora_run.parent, f"is the run directory {lora_run} or holds it"),
                        (lora_run / "checkpoint-3" / "model", f"is inside the checkpoint {lora_run / 'checkpoint-3'}")]:
        assert f"error: {target}: {why}" in export_refusal(capsys, lora_run, "--out", str(target))
    assert (other / "notes.txt").read_text() == "keep me" and a_file.read_text() == "keep me too"
    assert sorted(p.relative_to(lora_run) for p in lora_run.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "other"]


def test_export_replaces_its_own_earlier_export(lora_run, tmp_path, capsys):
    run = shutil.copytree(lora_run, tmp_path / "run")
    out = run / "export"
    first = export_here(capsys, run)
    assert first["out"] == str(out) and (out / ".swift-studio-export").is_file()
    # What a user added to the export, or changed in it, is never replaced away.
    (out / "notes.md").write_text("my notes")
    with open(out / "config.json", "a") as f:
        f.write("\n")
    assert (f"error: {out}: is an earlier export holding files it did not write or that changed since "
            "(config.json, notes.md)") in export_refusal(capsys, run, "--checkpoint", "3")
    assert (out / "notes.md").read_text() == "my notes"
    # A marker of an older version (no file list), or a crafted one, leaves what was written unknown.
    marker = (out / ".swift-studio-export").read_text()
    for crafted in ('{"checkpoint": "x"}\n', "[1, 2]\n", "not json\n"):
        (out / ".swift-studio-export").write_text(crafted)
        assert "does not list the files it wrote" in export_refusal(capsys, run, "--checkpoint", "3")
    (out / ".swift-studio-export").write_text(marker)
    (out / "notes.md").unlink()
    (out / "config.json").write_text((out / "config.json").read_text()[:-1])
    second = export_here(capsys, run, "--checkpoint", "3")
    assert second["checkpoint"] == str(run / "checkpoint-3")
    assert (out / "model.safetensors").is_file() and (out / ".swift-studio-export").is_file()
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(("checkpoint-", "events", "logs"))) == [
        "export", "job.yaml"]  # no temporary directory left beside it
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_here(capsys, run, "--out", str(empty))["out"] == str(empty) and (empty / "model.safetensors").is_file()


def test_failed_export_leaves_nothing_behind(lora_run, tmp_path):
    """A write that fails part-way (here: a file-size limit, as a full disk would) removes only
    what the export created."""
    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))  # model.safetensors is ~370 KB

    out = tmp_path / "out"
    stderr = export_error(lora_run, "--out", str(out), preexec_fn=small_files)
    assert f"error: {out}: writing the export failed (" in stderr, stderr[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_export_of_latest_passes_over_a_damaged_checkpoint(lora_run, tmp_path, capsys):
    run = shutil.copytree(lora_run, tmp_path / "run")
    adapter = run / "checkpoint-6" / "model" / "adapter_model.safetensors"
    size = adapter.stat().st_size
    with open(adapter, "r+b") as f:
        f.truncate(size - 100)
    damage = f"checkpoint-6/model/adapter_model.safetensors: size {size - 100} != recorded {size}"
    result = export_here(capsys, run, "--out", str(tmp_path / "out"))
    assert result["checkpoint"] == str(run / "checkpoint-3") and result["skipped"] == [damage]
    assert f"error: checkpoint {run / 'checkpoint-6'} does not match what was saved: {damage}" in export_refusal(
        capsys, run, "--checkpoint", "6", "--out", str(tmp_path / "out6"))
