"""User DeepSpeed JSONs of the kinds people bring (ms-swift, LLaMA-Factory, HF docs, DeepSpeedExamples):
every "auto" filled the way HF's integration fills it, or refused by key path before launch."""
from __future__ import annotations

import json

import pytest

from backend.job import dsconfig
from backend.job.cluster import parse_hostfile_text
from backend.job.dsconfig import DsConfigError, build_ds_config
from backend.job.modelcfg import find_model_config
from backend.job.spec import JobSpec
from backend.job.validate import errors, validate

GPU_NODE = parse_hostfile_text("n0 slots=8\n")
LLAMA8B = find_model_config("llama3.1-8b")

# ms-swift's swift/llm/ds_config/zero2.json as it shipped with optimizer and scheduler sections.
MS_SWIFT_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}

# The HF DeepSpeed docs' ZeRO-3 config (WarmupDecayLR, every optimizer and scheduler value "auto").
HF_DOCS_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_min_lr": "auto",
                                                      "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                          "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}

# LLaMA-Factory's examples/deepspeed/ds_z3_config.json: no optimizer, no scheduler.
LLAMA_FACTORY_Z3 = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "overlap_comm": False, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "comms_config": {"verbose": False},
    "monitor_config": {"enabled": True, "tag": "DeepSpeedMonitor", "csv_monitor": {"enabled": False}},
}

# ms-swift's swift/llm/ds_config/zero2_autotp.json (it ships autotp_size 1).
MS_SWIFT_ZERO2_AUTOTP = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": False,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "tensor_parallel": {"autotp_size": 1},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}

# A DeepSpeedExamples-style plain data-parallel config: no zero_optimization section at all.
NO_ZERO = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": 1.0, "steps_per_print": 10,
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.999], "eps": 1e-8}},
    "bf16": {"enabled": "auto"}, "wall_clock_breakdown": False,
}


def job(**kw) -> JobSpec:
    return JobSpec(**{"model": "meta-llama/Llama-3.1-8B-Instruct", "dataset": ["swift/self-cognition#500"],
                      "nproc_per_node": 8, **kw})


def write(tmp_path, config: dict, name: str = "ds.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(config, indent=4))
    return str(path)


def with_(config: dict, path: str, value) -> dict:
    """A deep copy of `config` with the dotted key `path` set to `value`."""
    config = json.loads(json.dumps(config))
    *parents, key = path.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[key] = value
    return config


def deepspeed_problems(spec: JobSpec) -> list[str]:
    """The error messages validate() puts on the `deepspeed` field."""
    return [p.message for p in errors(validate(spec, GPU_NODE, LLAMA8B)) if p.field == "deepspeed"]


def autos(node, path=""):
    if node == "auto":
        yield path
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from autos(value, f"{path}.{key}" if path else key)


def deepspeed_builds(config: dict):
    """What DeepSpeed's engine does with the optimizer and scheduler sections (engine.py
    _configure_basic_optimizer with torch_adam, _scheduler_from_config): build them."""
    import torch
    from deepspeed.runtime import lr_schedules

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], **config["optimizer"]["params"])
    scheduler = config.get("scheduler")
    return optimizer, scheduler and getattr(lr_schedules, scheduler["type"])(optimizer, **scheduler["params"])


# ---- "auto" in optimizer and scheduler params ---------------------------------------------------

@pytest.mark.parametrize("source", [MS_SWIFT_ZERO2, HF_DOCS_ZERO3], ids=["ms-swift-zero2", "hf-docs-zero3"])
def test_plan_fills_optimizer_and_scheduler_autos_from_the_job(tmp_path, source):
    spec = job(deepspeed=write(tmp_path, source), learning_rate=2e-5, weight_decay=0.01, warmup_ratio=0.1)
    config = build_ds_config(spec, 8, hidden_size=4096)
    assert config["optimizer"]["params"] == {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    if "warmup_max_lr" in source["scheduler"]["params"]:
        assert (config["scheduler"]["params"]["warmup_min_lr"], config["scheduler"]["params"]["warmup_max_lr"]) == (0, 2e-5)
    # Step counts are the worker's to fill (the data decides them); nothing else is left.
    assert sorted(autos(config)) == ["scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps"]
    assert deepspeed_problems(spec) == []


@pytest.mark.parametrize("source", [MS_SWIFT_ZERO2, HF_DOCS_ZERO3], ids=["ms-swift-zero2", "hf-docs-zero3"])
def test_worker_fills_the_scheduler_step_counts_and_deepspeed_builds_it(tmp_path, source):
    spec = job(deepspeed=write(tmp_path, source), learning_rate=2e-5, warmup_ratio=0.1)
    config = dsconfig.fill_steps(build_ds_config(spec, 8), spec, total_steps=500)
    assert (config["scheduler"]["params"]["total_num_steps"], config["scheduler"]["params"]["warmup_num_steps"]) == (500, 50)
    assert list(autos(config)) == []
    optimizer, scheduler = deepspeed_builds(config)
    assert scheduler.total_num_steps == 500 and scheduler.warmup_num_steps == 50
    # No warm-up asked: 1 step, as HF (DeepSpeed >= 0.19.6 refuses 0).
    no_warmup = job(deepspeed=spec.deepspeed, learning_rate=2e-5)
    assert dsconfig.fill_steps(build_ds_config(no_warmup, 8), no_warmup, 500)["scheduler"]["params"]["warmup_num_steps"] == 1


def test_explicit_step_counts_that_disagree_with_the_run_are_refused(tmp_path):
    """HF's fill_match on total_num_steps: before launch where max_steps gives the count, else at worker start."""
    path = write(tmp_path, with_(HF_DOCS_ZERO3, "scheduler.params.total_num_steps", 1000))
    assert deepspeed_problems(job(deepspeed=path, max_steps=1000)) == []
    problem, = deepspeed_problems(job(deepspeed=path, max_steps=300))
    assert problem.startswith(f"{path}: scheduler.params.total_num_steps: 1000") and "300" in problem
    epochs = job(deepspeed=path)
    assert deepspeed_problems(epochs) == []  # the steps are known only once the worker has read the data
    with pytest.raises(DsConfigError, match=r"scheduler\.params\.total_num_steps: 1000.*300 steps"):
        dsconfig.fill_steps(build_ds_config(epochs, 8), epochs, total_steps=300)


@pytest.mark.parametrize("key", ["zero_optimization.stage3_module_granularity_threshold",
                                 "scheduler.params.cos_min_ratio", "communication_data_type"])
def test_an_auto_that_nothing_fills_is_refused_by_its_path(tmp_path, key):
    path = write(tmp_path, with_(MS_SWIFT_ZERO2, key, "auto"))
    problem, = deepspeed_problems(job(deepspeed=path))
    assert problem.startswith(f'{path}: {key}: "auto"')
    with pytest.raises(DsConfigError, match=key):
        build_ds_config(job(deepspeed=path), 8)


# ---- fp16 and bf16 -------------------------------------------------------------------------------

def test_fp16_enabled_in_a_bf16_job_is_refused_before_launch(tmp_path):
    """DeepSpeed refuses both enabled at start; HF raises the mismatch before. So do we."""
    from deepspeed.runtime.config import DeepSpeedConfig

    path = write(tmp_path, with_(LLAMA_FACTORY_Z3, "fp16.enabled", True))
    problem, = deepspeed_problems(job(deepspeed=path, torch_dtype="bfloat16"))
    assert problem.startswith(f"{path}: fp16.enabled: true") and "torch_dtype is bfloat16" in problem
    with pytest.raises(DsConfigError, match="fp16.enabled"):
        build_ds_config(job(deepspeed=path, torch_dtype="bfloat16"), 8)
    # The same JSON in an fp16 job is what it says; DeepSpeed takes the config.
    config = build_ds_config(job(deepspeed=path, torch_dtype="float16"), 1)
    assert DeepSpeedConfig(config).float16_config.enabled and not config["bf16"]["enabled"]
    # bf16 switched off in a bf16 job: HF's mismatch too (DeepSpeed would train in fp32).
    off = write(tmp_path, with_(LLAMA_FACTORY_Z3, "bf16.enabled", False), "off.json")
    problem, = deepspeed_problems(job(deepspeed=off))
    assert problem.startswith(f"{off}: bf16.enabled: false") and "torch_dtype is bfloat16" in problem


# ---- optimizer values the JSON sets --------------------------------------------------------------

@pytest.mark.parametrize("key,value,field,job_value", [
    ("optimizer.params.lr", 1e-4, "learning_rate", 2e-5),
    ("optimizer.params.weight_decay", 0.0, "weight_decay", 0.1),
    ("scheduler.params.warmup_max_lr", 1e-4, "learning_rate", 2e-5),
    ("gradient_clipping", 1.0, "max_grad_norm", 0.5),
])
def test_a_json_value_that_differs_from_the_job_is_an_error_naming_both(tmp_path, key, value, field, job_value):
    """HF raises on these mismatches, so the JSONs people bring already agree or say "auto"."""
    path = write(tmp_path, with_(HF_DOCS_ZERO3, key, value))
    problem, = deepspeed_problems(job(deepspeed=path, **{field: job_value}))
    assert problem.startswith(f"{path}: {key}: {json.dumps(value)}") and f"{field} is {job_value}" in problem
    assert deepspeed_problems(job(deepspeed=path, **{field: value})) == []


def test_betas_and_eps_the_job_cannot_set_are_the_jsons(tmp_path):
    path = write(tmp_path, with_(with_(MS_SWIFT_ZERO2, "optimizer.params.betas", [0.9, 0.95]), "optimizer.params.eps", 1e-6))
    assert deepspeed_problems(job(deepspeed=path)) == []
    assert build_ds_config(job(deepspeed=path), 8)["optimizer"]["params"]["betas"] == [0.9, 0.95]


# ---- no zero_optimization ------------------------------------------------------------------------

def test_a_config_without_zero_optimization_runs_as_stage_0(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    spec = job(deepspeed=write(tmp_path, NO_ZERO), train_type="full")
    assert deepspeed_problems(spec) == []
    assert dsconfig.zero_settings(spec) == dsconfig.ZeroSettings(0)
    config = build_ds_config(spec, 1, hidden_size=4096)
    assert DeepSpeedConfig(config).zero_optimization_stage == 0 and config["optimizer"]["params"]["lr"] == spec.learning_rate
    # A section without a stage is stage 0 too (DeepSpeed's default); a bad stage names its key.
    assert dsconfig.zero_settings(job(deepspeed=write(tmp_path, {**NO_ZERO, "zero_optimization": {}}, "empty.json"))).stage == 0
    bad = write(tmp_path, {**NO_ZERO, "zero_optimization": {"stage": 4}}, "bad.json")
    problem, = deepspeed_problems(job(deepspeed=bad))
    assert problem.startswith(f"{bad}: zero_optimization.stage: must be 0, 1, 2 or 3")


# ---- AutoTP --------------------------------------------------------------------------------------

def test_a_json_autotp_size_must_be_the_jobs_tp(tmp_path):
    path = write(tmp_path, with_(MS_SWIFT_ZERO2_AUTOTP, "tensor_parallel.autotp_size", 2))
    problem, = deepspeed_problems(job(deepspeed=path))
    assert problem.startswith(f"{path}: tensor_parallel.autotp_size: 2, but the job's tensor_model_parallel_size is 1")
    assert deepspeed_problems(job(deepspeed=path, tensor_model_parallel_size=2, train_type="full")) == []
    # As ms-swift ships it (autotp_size 1: no TP) the file is fine.
    assert deepspeed_problems(job(deepspeed=write(tmp_path, MS_SWIFT_ZERO2_AUTOTP, "tp1.json"))) == []


# ---- a real DeepSpeed start ----------------------------------------------------------------------

@pytest.mark.e2e
def test_worker_trains_with_a_json_whose_optimizer_and_scheduler_are_auto(tmp_path, tiny_model):
    """ms-swift's zero2.json with its optimizer and scheduler sections, through the planner and torchrun."""
    from worker import ROOT, events, run_planned

    run = tmp_path / "run"
    proc = run_planned(run, model=str(tiny_model), dataset=[str(ROOT / "assets" / "demo" / "train.jsonl") + "#256"],
                       deepspeed=write(tmp_path, MS_SWIFT_ZERO2), nproc_per_node=2, train_type="lora",
                       torch_dtype="bfloat16", max_length=64, per_device_train_batch_size=4,
                       gradient_accumulation_steps=2, learning_rate=3e-3, max_steps=8, logging_steps=2,
                       save_steps=8, gradient_checkpointing=False, warmup_ratio=0.25)
    assert proc.returncode == 0, proc.log[-4000:]
    lrs = [e["learning_rate"] for e in events(run, 0, "train")]
    assert len(lrs) == 4 and all(0 < lr <= 3e-3 for lr in lrs) and lrs[-1] < max(lrs), lrs  # warm-up, then cosine
