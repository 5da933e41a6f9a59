"""What the worker refuses, shown before launch (backend.job.capabilities) and the bundled demo."""
from __future__ import annotations

import hashlib
import json
import os
import sys

import pytest
import yaml

from backend.job.capabilities import COMPILE_WITH_ZERO3, FsdpPlan, fsdp_plan, unsupported
from backend.job.demo import DEMO_DIR, demo_spec
from backend.job.spec import JobSpec, parse_spec
from worker import ROOT


def spec(**fields) -> JobSpec:
    return JobSpec(model="m", dataset=["d.jsonl"], **fields)


def fields_of(problems, severity="error"):
    return [p.field for p in problems if p.severity == severity]


def test_supported_jobs_pass():
    for job in (spec(), spec(deepspeed="zero3_offload", train_type="full"), spec(fsdp="full_shard offload"),
                spec(fsdp="shard_grad_op", torch_dtype="float32"), spec(deepspeed="/x/ds.json", torch_dtype="float16")):
        assert fields_of(unsupported(job)) == [], job


@pytest.mark.parametrize("fields,field,text", [
    (dict(tensor_model_parallel_size=2, deepspeed="zero2"), "deepspeed", "AutoTP trains full fine-tuning only"),
    (dict(expert_tensor_parallel_size=2), "expert_tensor_parallel_size", "not supported by this worker yet"),
    (dict(pipeline_model_parallel_size=2), "gradient_accumulation_steps", "cannot fill a pipeline"),
    (dict(context_parallel_size=2), "fsdp", "runs on FSDP2 (torch's context_parallel)"),
    (dict(expert_model_parallel_size=2), "fsdp", "spreads the experts over the ranks FSDP2 shards over"),
    (dict(sequence_parallel_size=2), "deepspeed", "runs on DeepSpeed's Ulysses"),
    (dict(deepspeed="zero2", fsdp="full_shard"), "fsdp", "either DeepSpeed or FSDP"),
    (dict(fsdp="hybrid"), "fsdp", "unknown FSDP option"),
    (dict(fsdp="full_shard shard_grad_op"), "fsdp", "exclude each other"),
    (dict(fsdp="full_shard", torch_dtype="float16"), "torch_dtype", "float16 with FSDP"),
    (dict(attn_impl="flex"), "attn_impl", "must be one of"),
])
def test_refused_combinations_name_their_field(fields, field, text):
    problems = unsupported(spec(**fields))
    assert field in fields_of(problems)
    assert text in next(p.message for p in problems if p.field == field)


def test_the_form_greys_what_this_engine_cannot_run():
    from backend.job.capabilities import parallel_refusals

    # What needs only another engine or more micro-batches is not greyed: the form offers the fix.
    plain = parallel_refusals(spec())
    assert not {"tensor_model_parallel_size", "sequence_parallel_size", "pipeline_model_parallel_size",
                "context_parallel_size", "expert_model_parallel_size"} & set(plain), plain
    assert "Ulysses" in parallel_refusals(spec(fsdp="full_shard", tensor_model_parallel_size=2))["sequence_parallel_size"]
    assert "DeepSpeed's engines do not run" in parallel_refusals(spec(deepspeed="zero1"))["pipeline_model_parallel_size"]
    zero = parallel_refusals(spec(deepspeed="zero2"))  # LoRA: AutoTP is for full fine-tuning
    assert "sequence_parallel_size" not in zero and "AutoTP" in zero["tensor_model_parallel_size"]
    assert "tensor_model_parallel_size" not in parallel_refusals(spec(deepspeed="zero2", train_type="full"))
    # A dimension already set is the field's error, not greyed; what it excludes is greyed.
    tp = parallel_refusals(spec(tensor_model_parallel_size=2))
    assert "tensor_model_parallel_size" not in tp and "sequence_parallel_size" in tp


def test_backend_stays_torch_free():
    code = "import sys, backend.job.capabilities, backend.job.demo; print('torch' in sys.modules)"
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_demo_spec_and_job_yaml():
    job = demo_spec(output_dir="out")
    assert job.model == str(DEMO_DIR / "model")
    assert job.dataset == [str(DEMO_DIR / "self_cognition.jsonl"), str(DEMO_DIR / "train.jsonl")]
    assert (DEMO_DIR / "model" / "model.safetensors").is_file() and all(map(os.path.isfile, job.dataset))
    assert unsupported(job) == []
    shipped, problems = parse_spec(yaml.safe_load((DEMO_DIR / "job.yaml").read_text()))
    assert problems == []
    assert shipped.model_dump(exclude={"model", "dataset", "output_dir"}) == job.model_dump(
        exclude={"model", "dataset", "output_dir"})
    size = sum(p.stat().st_size for p in DEMO_DIR.rglob("*") if p.is_file())
    assert size < 5 * 2**20


def test_demo_assets_are_what_the_script_builds(tmp_path):
    sys.path.insert(0, str(ROOT / "assets"))
    from build_demo import build

    build(tmp_path / "demo")
    for rel in ("train.jsonl", "self_cognition.jsonl", "model/model.safetensors", "model/tokenizer.json", "model/tokenizer_config.json",
                "model/config.json"):
        digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "demo" / rel, DEMO_DIR / rel)]
        assert digest[0] == digest[1], rel


@pytest.mark.parametrize("fields,message", [
    (dict(pipeline_model_parallel_size=2, gradient_checkpointing=False),
     "gradient_accumulation_steps: 1 micro-batches cannot fill a pipeline"),
    (dict(torch_dtype="float16"), "torch_dtype: float16 needs a GPU"),
    (dict(context_parallel_size=2, fsdp="full_shard"),
     "context_parallel_size: ring attention (torch's context_parallel) runs on CUDA GPUs only"),
    # A user JSON's stage is only known once it is read; the backend checks it too, before launch.
    (dict(deepspeed="zero3.json", torch_compile=True), f"torch_compile: {COMPILE_WITH_ZERO3}"),
])
def test_worker_refuses_at_start_with_the_field(tmp_path, tiny_model, fields, message):
    import subprocess

    from worker import free_port, worker_env, write_run

    if "deepspeed" in fields:
        (tmp_path / "zero3.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
        fields = {**fields, "deepspeed": str(tmp_path / "zero3.json")}
    run = write_run(tmp_path / "run", model=str(tiny_model), dataset=[str(DEMO_DIR / "train.jsonl")], **fields)
    env = {**worker_env(), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-m", "launcher.train", "--run-dir", str(run)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_fsdp_plan_names_the_engine_the_worker_builds():
    def plan(**kw):
        return fsdp_plan(JobSpec(model="m", dataset=["d.jsonl"], **kw))

    assert plan(train_type="full") == FsdpPlan(replicate=True, reshard_after_forward=False, offload=False)  # DDP
    assert plan(train_type="full", fsdp="full_shard offload") == FsdpPlan(False, True, True)
    assert plan(train_type="full", fsdp="shard_grad_op") == FsdpPlan(False, False, False)
    # torch's DDP (LoRA, float16) and DeepSpeed are not FSDP2
    assert plan(train_type="lora") is None and plan(train_type="full", torch_dtype="float16") is None
    assert plan(train_type="full", deepspeed="zero2") is None


@pytest.mark.parametrize("fields,sets", [
    ({"expert_model_parallel_size": 2}, "fsdp full_shard"),
    ({"expert_model_parallel_size": 2, "deepspeed": "zero2"}, "fsdp full_shard, deepspeed (none)"),
    ({"sequence_parallel_size": 2}, "deepspeed zero0"),
    ({"sequence_parallel_size": 2, "fsdp": "shard_grad_op"}, "deepspeed zero2, fsdp (none)"),
    ({"context_parallel_size": 2}, "fsdp full_shard"),
    ({"context_parallel_size": 2, "deepspeed": "zero3"}, "fsdp full_shard, deepspeed (none)"),
    ({"pipeline_model_parallel_size": 4}, "gradient_accumulation_steps 4"),
    ({"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
      "pipeline_schedule": "interleaved_1f1b", "gradient_accumulation_steps": 3}, "gradient_accumulation_steps 4"),
])
def test_a_refusal_with_one_remedy_has_a_fix_that_clears_it(fields, sets):
    from backend.job.capabilities import apply_fixes, engine_fixes

    job = spec(**fields)
    [fix] = engine_fixes(job)
    assert fix.text() == sets
    assert fix.field in fields_of(unsupported(job))
    fixed = apply_fixes(job, [fix])
    assert fields_of(unsupported(fixed)) == [] and engine_fixes(fixed) == []


def test_no_fix_where_the_user_must_choose():
    """EP beside SP (or CP) is refused with no fix: which to keep is the user's choice."""
    from backend.job.capabilities import engine_fixes

    assert engine_fixes(spec(expert_model_parallel_size=2, sequence_parallel_size=2)) == []
    assert engine_fixes(spec(sequence_parallel_size=2, tensor_model_parallel_size=2)) == []
    assert engine_fixes(spec(expert_model_parallel_size=2, fsdp="full_shard")) == []
