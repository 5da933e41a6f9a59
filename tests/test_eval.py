"""Evaluation during training: the eval loss of held-out or given validation data, every eval_steps
and at the end, as the token-weighted mean over every rank's share; kept with the checkpoints."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from backend.job.spec import JobSpec
from launcher.data import IGNORE, Batches, one_per_row
from launcher.tokenized import dataset_cache_dir, open_tokenized
from worker import ROOT, events, run_ok, write_run

pytestmark = pytest.mark.e2e
DATA = str(ROOT / "assets" / "demo" / "train.jsonl") + "#256"


def reference_eval_loss(spec: JobSpec, run_dir, model_dir, world: int) -> float:
    """The eval loss of `model_dir` as the worker defines it: each rank's held-out rows in order, as
    many micro-batches on every rank as the fewest any rank has, the mean over their predicted tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec.model)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    data = open_tokenized(spec, tokenizer, dataset_cache_dir(spec, run_dir))
    assert not data.built  # the worker's own entry
    held = data.held_out(spec.split_dataset_ratio, spec.seed)
    shards = [data.shard(rank, world, held)[0] for rank in range(world)]
    size = spec.per_device_eval_batch_size
    count = min(math.ceil(len(rows) / size) for rows in shards)
    total, tokens = 0.0, 0
    for rows in shards:
        batches = Batches(lambda m, rows=rows: data.samples(rows[m]), one_per_row(len(rows)), size, 1, 1, 0,
                          tokenizer.pad_token_id, False, spec.max_length)
        for batch, _, _ in batches.in_order(count):
            n = int((batch["labels"][:, 1:] != IGNORE).sum())
            with torch.no_grad():
                total += float(model(**batch).loss) * n
            tokens += n
    return total / tokens


@pytest.mark.parametrize("train_type", ["full", "lora"], ids=["fsdp2-full", "ddp-lora-dropout"])
def test_the_eval_loss_is_the_held_out_rows_mean_token_loss_of_the_model_at_that_step(tmp_path, tiny_model,
                                                                                       train_type):
    """On FSDP2 (full fine-tuning) and torch's DDP (LoRA, whose dropout evaluation turns off: the
    exported model has none)."""
    job = dict(model=str(tiny_model), dataset=[DATA], max_length=64, per_device_train_batch_size=4,
               per_device_eval_batch_size=3, learning_rate=3e-3, max_steps=8, logging_steps=3, save_steps=4,
               train_type=train_type, lora_dropout=0.2, torch_dtype="float32", gradient_checkpointing=False,
               split_dataset_ratio=0.1)
    run = write_run(tmp_path / "run", **job)
    run_ok(run)
    done = events(run, 0, "eval")
    assert [e["step"] for e in done] == [4, 8] and all(math.isfinite(e["eval_loss"]) for e in done)
    # An eval step is a logged step too (logging_steps 3 alone would log 3, 6 and 8).
    assert [e["step"] for e in events(run, 0, "train")] == [3, 4, 6, 8]
    # Each checkpoint carries the eval loss of its step; so does its trainer state.
    assert {e["step"]: e["eval_loss"] for e in events(run, 0, "checkpoint")} == {e["step"]: e["eval_loss"] for e in done}
    # The held-out rows are not trained on: the rank's shards leave them out.
    ready = [e for rank in (0, 1) for e in events(run, rank, "data") if e["phase"] == "ready"]
    assert sum(e["samples"] for e in ready) + sum(e["val_samples"] for e in ready) == 256
    assert sum(e["val_samples"] for e in ready) == 26
    spec = JobSpec(**job)
    from launcher.export import export

    exported = export(run, None, tmp_path / "export")["out"]  # the latest checkpoint: step 8
    expected = reference_eval_loss(spec, run, Path(exported), world=2)
    assert math.isclose(done[-1]["eval_loss"], expected, rel_tol=1e-4), (done[-1]["eval_loss"], expected)
