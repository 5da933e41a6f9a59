"""Real 2-process torchrun trainings on CPU (gloo) with every engine: the loss must fall, the
event lines and the checkpoint layout must follow docs/architecture.md."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from worker import ROOT, events, losses, run_planned, run_worker, write_run

pytestmark = pytest.mark.e2e
DATA = str(ROOT / "assets" / "demo" / "train.jsonl") + "#256"


def job(model, **extra) -> dict:
    base = dict(model=str(model), dataset=[DATA], max_length=64, per_device_train_batch_size=4,
                gradient_accumulation_steps=2, learning_rate=3e-3, max_steps=8, logging_steps=2, save_steps=4,
                save_total_limit=1, gradient_checkpointing=False, warmup_ratio=0.25)
    return {**base, **extra}


@pytest.mark.parametrize("name,extra", [
    ("ddp-lora-packed", dict(train_type="lora", torch_dtype="bfloat16", gradient_checkpointing=True, packing=True)),
    ("zero2-lora", dict(train_type="lora", deepspeed="zero2", torch_dtype="bfloat16", grad_reduce_dtype="float32")),
    ("zero3-full", dict(train_type="full", deepspeed="zero3", torch_dtype="bfloat16")),
    ("fsdp2-full", dict(train_type="full", fsdp="full_shard", torch_dtype="bfloat16")),
])
def test_engine_trains(tmp_path, tiny_model, name, extra):
    run = tmp_path / name
    if extra.get("deepspeed"):
        # Launched exactly as the backend does: planner argv/env, its job.yaml and ds_config.json.
        proc = run_planned(run, **job(tiny_model, nproc_per_node=2, **extra))
        assert (run / "ds_config.json").is_file() and (run / "plan.json").is_file()
        if extra.get("grad_reduce_dtype") == "float32":
            assert json.loads((run / "ds_config.json").read_text())["communication_data_type"] == "fp32"
    else:
        proc = run_worker(write_run(run, **job(tiny_model, **extra)))
    assert proc.returncode == 0, proc.log[-4000:]

    curve = losses(run)
    assert sorted(curve) == [2, 4, 6, 8]
    assert curve[8] < curve[2] - 0.05, curve

    start, = events(run, 0, "start")
    assert start["world_size"] == 2 and start["max_steps"] == 8 and start["resumed_from"] is None
    train = events(run, 0, "train")[-1]
    for key in ("epoch", "learning_rate", "grad_norm", "tokens_per_s", "samples_per_s", "step_time_s", "mfu",
                "mem_allocated_gib", "mem_peak_gib", "eta_s"):
        assert key in train
    assert train["tokens_per_s"] > 0 and train["grad_norm"] > 0
    for rank in (0, 1):
        timing = events(run, rank, "timing")
        assert [t["step"] for t in timing] == [2, 4, 6, 8] and all(t["rank"] == rank for t in timing)
        assert all(t["collective_wait_s"] >= 0 and t["step_time_s"] > 0 for t in timing)
    assert events(run, 0, "end")[-1] == {**events(run, 0, "end")[-1], "status": "succeeded", "step": 8, "error": None}

    # save_total_limit=1: checkpoint-4 was deleted once checkpoint-8 was complete.
    assert [e["step"] for e in events(run, 0, "checkpoint")] == [4, 8]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-8"]
    ckpt = run / "checkpoint-8"
    for file in ("complete", "job.yaml", "trainer_state.json", "rng-rank0.pt", "rng-rank1.pt", "tokenizer/tokenizer.json"):
        assert (ckpt / file).is_file(), file
    if extra["train_type"] == "lora":
        assert (ckpt / "model" / "adapter_model.safetensors").is_file()


MLFLOW_PROBE = """import json, sys
{imports}
import deepspeed.autotuning.autotuner as autotuner
seen = ["mlflow" in sys.modules, autotuner.has_mlflow]
import mlflow
print(json.dumps(seen + [mlflow.__name__]))
"""


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="the test extra installs mlflow")
def test_the_worker_imports_deepspeed_without_mlflow():
    """DeepSpeed's autotuner imports mlflow whenever it is installed, about 1 s of every DeepSpeed
    rank's start; launcher.engines.zero imports deepspeed with mlflow hidden, and mlflow imports
    after that as before. Were DeepSpeed's own import fixed, the first assertion would fail and
    mlflow_hidden could go."""
    def probe(imports: str) -> list:
        proc = subprocess.run([sys.executable, "-c", MLFLOW_PROBE.format(imports=imports)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    assert probe("import deepspeed") == [True, True, "mlflow"]
    assert probe("import launcher.engines.zero") == [False, False, "mlflow"]
