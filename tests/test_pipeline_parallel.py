"""Pipeline parallel (torch.distributed.pipelining) on CPU with gloo: the rules, and the same job
with and without PP trains the same, resumes the same and exports the same model."""
from __future__ import annotations

import json
import shutil

import pytest

from backend.job.capabilities import pipeline_world_problems, pp_problems, same_data_ranks, seq_multiple, unsupported, world_problems
from backend.job.spec import JobSpec
from worker import ROOT, assert_same_export, events, losses, run_ok, write_run

DATA = str(ROOT / "assets" / "demo" / "train.jsonl") + "#256"
STEPS = 20


def spec(**over) -> JobSpec:
    return JobSpec(**{"model": "m", "dataset": ["d"], "gradient_checkpointing": False, **over})


def errors(**over) -> list[str]:
    return [p.field for p in pp_problems(spec(**over)) if p.severity == "error"]


def test_pipeline_rules_name_their_fields():
    assert errors(pipeline_model_parallel_size=2, gradient_accumulation_steps=2) == []
    assert errors(pipeline_model_parallel_size=4, gradient_accumulation_steps=2) == ["gradient_accumulation_steps"]
    interleaved = dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                       pipeline_schedule="interleaved_1f1b")
    assert errors(**interleaved, gradient_accumulation_steps=4) == []
    assert errors(**interleaved, gradient_accumulation_steps=3) == ["gradient_accumulation_steps"]
    assert errors(pipeline_model_parallel_size=2, gradient_accumulation_steps=2,
                  virtual_pipeline_model_parallel_size=2) == ["virtual_pipeline_model_parallel_size"]
    assert errors(virtual_pipeline_model_parallel_size=2,
                  pipeline_schedule="interleaved_1f1b") == ["virtual_pipeline_model_parallel_size"]
    refused = errors(pipeline_model_parallel_size=2, gradient_accumulation_steps=2, deepspeed="zero1",
                     tensor_model_parallel_size=2, context_parallel_size=2, sequence_parallel_size=2,
                     gradient_checkpointing=True, torch_dtype="float16")
    assert refused == ["deepspeed", "tensor_model_parallel_size", "sequence_parallel_size", "context_parallel_size",
                       "gradient_checkpointing", "torch_dtype"]
    assert "pipeline_model_parallel_size" not in [p.field for p in unsupported(
        spec(pipeline_model_parallel_size=2, gradient_accumulation_steps=2))]


def test_the_bubble_is_shown_and_the_layout_counts_the_pipeline():
    job = spec(pipeline_model_parallel_size=2, gradient_accumulation_steps=3, max_length=128)
    warning, = pp_problems(job)
    assert warning.severity == "warning" and "25%" in warning.message  # (2 - 1) / (3 + 2 - 1)
    assert same_data_ranks(job) == 2 and seq_multiple(job) == 128
    assert world_problems(job, 2) == []
    assert [p.field for p in world_problems(job, 4)] == ["pipeline_model_parallel_size"]
    assert [p.field for p in pipeline_world_problems(job, 4)] == ["pipeline_model_parallel_size"]


def test_layers_must_split_into_the_stages():
    from backend.job.modelcfg import ModelConfig
    from backend.job.validate import _model_rules

    model = ModelConfig(model_type="llama", hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4,
                        num_kv_heads=2, head_dim=16, vocab_size=100, tie_word_embeddings=False)
    fields = lambda **over: [p.field for p in _model_rules(spec(**over), model)]  # noqa: E731
    assert fields(pipeline_model_parallel_size=2) == fields(pipeline_model_parallel_size=3) == []
    assert fields(pipeline_model_parallel_size=4) == ["pipeline_model_parallel_size"]
    assert fields(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                  pipeline_schedule="interleaved_1f1b") == ["pipeline_model_parallel_size"]


def job(model, **extra) -> dict:
    base = dict(model=str(model), dataset=[DATA], max_length=64, per_device_train_batch_size=4,
                gradient_accumulation_steps=2, learning_rate=2e-3, max_steps=STEPS, logging_steps=1, save_steps=10,
                gradient_checkpointing=False, warmup_ratio=0.1, torch_dtype="float32", lora_dropout=0.0)
    return {**base, **extra}


def trained(tmp_path, name, nproc, resume=None, **spec_fields):
    run = tmp_path / name
    if resume is None:
        write_run(run, **spec_fields)
    run_ok(run, nproc=nproc, resume=resume, timeout=400)
    return run


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    from worker import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("llama4"), "llama", num_hidden_layers=4)


def assert_same_run(pp, plain):
    a, b = losses(pp), losses(plain)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=2e-4), (step, a[step], b[step])
    assert a[STEPS] < a[1] - 0.05, a
    norms = {e["step"]: e["grad_norm"] for e in events(pp, 0, "train")}
    for e in events(plain, 0, "train"):
        assert norms[e["step"]] == pytest.approx(e["grad_norm"], rel=1e-3), e["step"]


@pytest.mark.e2e
@pytest.mark.parametrize("train_type,layout", [
    ("full", {"pipeline_model_parallel_size": 2}),
    ("lora", {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
              "pipeline_schedule": "interleaved_1f1b"})], ids=["full-1f1b", "lora-interleaved"])
def test_pp2_trains_resumes_and_exports_like_one_rank(tmp_path, four_layers, train_type, layout):
    spec_fields = job(four_layers, train_type=train_type)
    plain = trained(tmp_path, "plain", 1, **spec_fields)
    pp = trained(tmp_path, "pp", 2, **spec_fields, **layout)
    assert_same_run(pp, plain)
    assert json.loads((pp / "checkpoint-10" / "trainer_state.json").read_text())["engine"] == "pp"

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    write_run(resumed, **spec_fields, **layout)
    shutil.copytree(pp / "checkpoint-10", resumed / "checkpoint-10")
    run_ok(resumed, nproc=2, resume="latest", timeout=400)
    again = losses(resumed)
    assert sorted(again) == list(range(11, STEPS + 1))
    for step, value in again.items():
        assert value == pytest.approx(losses(pp)[step], rel=2e-4), step

    assert_same_export(pp, plain, tmp_path)
