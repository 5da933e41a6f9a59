"""Every validation rule: one case that breaks it, one that passes it."""
from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from backend.job.cluster import GpuInfo, local_cluster, parse_hostfile_text
from backend.job.modelcfg import find_model_config
from backend.job.spec import JobSpec, Problem
from backend.job.validate import assess, errors, validate

GPU_NODES = "n0 slots=8\nn1 slots=8\n"
DEMO_MODEL = Path(__file__).resolve().parent.parent / "assets" / "demo" / "model"
QWEN7B = find_model_config("qwen2.5-7b")      # 28 heads, 4 KV heads, 28 layers
LLAMA8B = find_model_config("llama3.1-8b")    # 32 heads, 8 KV heads, 32 layers
QWEN3_MOE = find_model_config("qwen3-30b-a3b")  # 128 experts


def job(**kw) -> JobSpec:
    # No LoRA dropout: the MoE rows would otherwise all meet the dropout rule (tested on its own).
    return JobSpec(**{"model": "Qwen/Qwen2.5-7B-Instruct", "dataset": ["swift/self-cognition#500"], "lora_dropout": 0.0,
                      **kw})


def check(spec, cluster=None, model=LLAMA8B, layout_only=True) -> list[Problem]:
    """Problems of `spec`; `layout_only` drops what the worker itself refuses (capabilities)."""
    from backend.job import capabilities

    cluster = cluster or parse_hostfile_text(GPU_NODES)
    found = validate(spec, cluster, model)
    if layout_only:
        worker = {(p.field, p.message) for p in capabilities.unsupported(spec)}
        found = [p for p in found if (p.field, p.message) not in worker and "beside a pipeline" not in p.message]
    return found


def fields(problems, severity="error") -> list[str]:
    return sorted({p.field for p in problems if p.severity == severity})


# (name, failing spec kwargs, field named, passing spec kwargs)
RULES = [
    ("nnodes more than nodes", dict(nnodes=3, nproc_per_node=8), "nnodes", dict(nnodes=2, nproc_per_node=8)),
    ("nproc over slots", dict(nnodes=2, nproc_per_node=16), "nproc_per_node", dict(nnodes=2, nproc_per_node=8)),
    # TP=2 divides the 12 ranks; PP=4 with it does not: the PP field is marked.
    ("TPxPPxCP divides world", dict(nnodes=2, nproc_per_node=6, tensor_model_parallel_size=2, pipeline_model_parallel_size=4),
     "pipeline_model_parallel_size", dict(nnodes=2, nproc_per_node=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=4)),
    ("ETPxEPxPP divides world", dict(nnodes=1, nproc_per_node=6, expert_model_parallel_size=4), "expert_model_parallel_size",
     dict(nnodes=1, nproc_per_node=8, expert_model_parallel_size=4)),
    ("SP divides world", dict(nnodes=1, nproc_per_node=6, sequence_parallel_size=4, max_length=4096), "sequence_parallel_size",
     dict(nnodes=1, nproc_per_node=8, sequence_parallel_size=4, max_length=4096)),
    ("max_length divisible by CP", dict(nnodes=1, nproc_per_node=8, context_parallel_size=4, max_length=4098), "max_length",
     dict(nnodes=1, nproc_per_node=8, context_parallel_size=4, max_length=4096)),
    ("max_length divisible by SP", dict(nnodes=1, nproc_per_node=8, sequence_parallel_size=8, max_length=4100), "max_length",
     dict(nnodes=1, nproc_per_node=8, sequence_parallel_size=8, max_length=4104)),
    ("TP inside one node", dict(nnodes=2, nproc_per_node=4, tensor_model_parallel_size=8), "tensor_model_parallel_size",
     dict(nnodes=2, nproc_per_node=8, tensor_model_parallel_size=8)),
    ("TP divides the node", dict(nnodes=1, nproc_per_node=6, tensor_model_parallel_size=4, pipeline_model_parallel_size=3),
     "tensor_model_parallel_size", dict(nnodes=1, nproc_per_node=8, tensor_model_parallel_size=4, pipeline_model_parallel_size=2)),
    ("ZeRO-3 with PP", dict(nproc_per_node=8, deepspeed="zero3", pipeline_model_parallel_size=2), "deepspeed",
     dict(nproc_per_node=2, deepspeed="zero1", pipeline_model_parallel_size=2)),
    ("FSDP and DeepSpeed", dict(nproc_per_node=8, deepspeed="zero2", fsdp="full_shard"), "fsdp",
     dict(nproc_per_node=8, fsdp="full_shard")),
    ("FSDP with PP", dict(nproc_per_node=8, fsdp="full_shard", pipeline_model_parallel_size=2), "fsdp",
     dict(nproc_per_node=2, pipeline_model_parallel_size=2)),
    ("max_steps not 0", dict(max_steps=0), "max_steps", dict(max_steps=10)),
]


@pytest.mark.parametrize("name,bad,field,good", RULES, ids=[r[0] for r in RULES])
def test_rule(name, bad, field, good):
    moe = "expert_model_parallel_size" in bad
    model = QWEN3_MOE if moe else LLAMA8B  # EP needs an MoE model, and LoRA kept off its experts
    extra = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]) if moe else {}
    assert field in fields(check(job(**bad, **extra), model=model)), name
    assert fields(check(job(**good, **extra), model=model)) == [], name


# (name, failing kwargs, model, field, message fragment, passing kwargs, model for the passing case)
MIXTRAL = find_model_config("mixtral-8x7b")  # 8 experts
MODEL_RULES = [
    ("heads divisible by TP", dict(tensor_model_parallel_size=8), QWEN7B, "tensor_model_parallel_size", "28 attention heads",
     dict(tensor_model_parallel_size=4), QWEN7B),
    ("KV heads split or replicated by TP", dict(tensor_model_parallel_size=14), QWEN7B, "tensor_model_parallel_size",
     "4 key/value heads and TP=14: one must divide the other", dict(tensor_model_parallel_size=4), QWEN7B),
    ("heads divisible by TP x SP", dict(sequence_parallel_size=8), QWEN7B, "sequence_parallel_size", "TP x SP = 8",
     dict(sequence_parallel_size=4), QWEN7B),
    ("KV heads split or replicated by SP", dict(sequence_parallel_size=4), replace(LLAMA8B, num_heads=24, num_kv_heads=6),
     "sequence_parallel_size", "6 key/value heads and SP=4: one must divide the other", dict(sequence_parallel_size=2),
     replace(LLAMA8B, num_heads=24, num_kv_heads=6)),
    ("layers divisible by PP", dict(pipeline_model_parallel_size=8), QWEN7B, "pipeline_model_parallel_size", "28 layers",
     dict(pipeline_model_parallel_size=4), QWEN7B),
    ("experts divisible by EP", dict(expert_model_parallel_size=16, nnodes=2, train_type="full"), MIXTRAL, "expert_model_parallel_size",
     "8 experts are not divisible by EP=16", dict(expert_model_parallel_size=16, nnodes=2, train_type="full"), QWEN3_MOE),
    ("EP only for MoE", dict(expert_model_parallel_size=8), LLAMA8B, "expert_model_parallel_size", "needs a mixture-of-experts",
     dict(expert_model_parallel_size=8, train_type="full"), MIXTRAL),
]


@pytest.mark.parametrize("name,bad,model,field,fragment,good,good_model", MODEL_RULES, ids=[r[0] for r in MODEL_RULES])
def test_model_rule(name, bad, model, field, fragment, good, good_model):
    found = errors(check(job(**{"nproc_per_node": 8, **bad}), model=model))
    assert {p.field for p in found} == {field} and any(fragment in p.message for p in found), name
    assert fields(check(job(**{"nproc_per_node": 8, **good}), model=good_model)) == [], name


def test_kv_heads_are_replicated_when_tp_is_a_multiple_of_them():
    """Megatron's rule: TP16 on Llama-3.1-70B-shaped attention (64 heads, 8 KV) and TP8 on Qwen3-30B-A3B
    (32 heads, 4 KV) are legal; the KV heads are replicated."""
    sixteen = parse_hostfile_text("n0 slots=16\n")
    assert fields(check(job(nproc_per_node=16, tensor_model_parallel_size=16), cluster=sixteen,
                        model=replace(LLAMA8B, num_heads=64))) == []
    assert fields(check(job(nproc_per_node=8, tensor_model_parallel_size=8), model=QWEN3_MOE)) == []


def test_max_length_past_the_trained_context_warns():
    qwen3 = find_model_config("qwen3-32b")  # 40960 positions, no rope scaling
    (warning,) = [p for p in check(job(nproc_per_node=8, max_length=65536), model=qwen3) if p.field == "max_length"]
    assert warning.severity == "warning"
    assert warning.message.startswith("65536 is above the model's max_position_embeddings (40960): positions past it")
    assert not [p for p in check(job(nproc_per_node=8, max_length=40960), model=qwen3) if p.field == "max_length"]
    (scaled,) = [p for p in check(job(nproc_per_node=8, max_length=262144), model=LLAMA8B) if p.field == "max_length"]
    assert "scales rope (llama3)" in scaled.message


def test_lora_dropout_on_stacked_experts_is_refused():
    """peft wraps the router and the stacked expert weights of transformers 5's MoE models in a
    ParamWrapper, which refuses dropout: the default LoRA job would fail as the model is built."""
    (problem,) = errors(check(job(nproc_per_node=8, lora_dropout=0.05), model=QWEN3_MOE))
    assert problem.field == "lora_dropout" and "router and stacked experts" in problem.message
    assert errors(check(job(nproc_per_node=8, lora_dropout=0.05, target_modules=["q_proj", "v_proj"]), model=QWEN3_MOE)) == []
    assert errors(check(job(nproc_per_node=8, lora_dropout=0.05), model=LLAMA8B)) == []


def test_peft_refuses_dropout_on_stacked_experts():
    """Pins the engine behaviour the rule above exists for (peft 0.21, transformers 5)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                            num_experts_per_tok=2, head_dim=16)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="(?i)dropout"):
        get_peft_model(model, LoraConfig(r=2, target_modules="all-linear", lora_dropout=0.05))
    with torch.device("meta"):
        get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=2, target_modules="all-linear", lora_dropout=0.0))


def test_the_expert_grid_is_megatrons():
    """ms-swift's Qwen3-235B example, TP4 x EP8 on 8 GPUs with expert-TP 1: legal, since the experts'
    grid (ETP x EP x PP) is carved out of the world apart from TP. ETP4 x EP8 is not."""
    one_node = parse_hostfile_text("n0 slots=8\n")
    legal = job(nproc_per_node=8, tensor_model_parallel_size=4, expert_model_parallel_size=8, train_type="full")
    assert fields(check(legal, cluster=one_node, model=QWEN3_MOE)) == []
    wide = job(nproc_per_node=8, tensor_model_parallel_size=4, expert_model_parallel_size=8, expert_tensor_parallel_size=4,
               train_type="full")
    (problem,) = errors(check(wide, cluster=one_node, model=QWEN3_MOE))
    assert problem.field == "expert_model_parallel_size"
    assert problem.message == ("ETP x EP x PP = 4x8x1 = 32 does not divide the world size 8 (the experts' grid: "
                               "Megatron's world % (ETP x EP x PP) == 0)")


def write_ds(tmp_path, config) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config) if not isinstance(config, str) else config)
    return str(path)


def test_parameter_offload_needs_zero3(tmp_path):
    bad = write_ds(tmp_path, {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert any("parameter offload needs ZeRO-3" in p.message for p in check(job(deepspeed=bad, nproc_per_node=8)))
    assert errors(check(job(deepspeed="zero3_offload", nproc_per_node=8))) == []


def test_nvme_offload_needs_zero3_and_bf16(tmp_path):
    nvme2 = write_ds(tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}})
    assert any("NVMe offload needs ZeRO-3" in p.message for p in check(job(deepspeed=nvme2, nproc_per_node=8)))
    nvme3 = write_ds(tmp_path, {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}})
    assert fields(check(job(deepspeed=nvme3, nproc_per_node=8, torch_dtype="float16"))) == ["torch_dtype"]
    assert fields(check(job(deepspeed=nvme3, nproc_per_node=8))) == []


@pytest.mark.parametrize("content,message", [
    (None, "DeepSpeed config not found"),
    ('{"zero_optimization": {"stage": 2,}}', "ds.json:1: DeepSpeed config is not valid JSON"),
    ('{"zero_optimization": {"stage": 4}}', "zero_optimization.stage: must be 0, 1, 2 or 3"),
    ('[1, 2]', "must be a JSON object"),
])
def test_user_deepspeed_json_must_parse_and_have_a_valid_stage(tmp_path, content, message):
    path = write_ds(tmp_path, content) if content else str(tmp_path / "absent.json")
    problems = check(job(deepspeed=path, nproc_per_node=8))
    assert [p.field for p in errors(problems)] == ["deepspeed"] and message in errors(problems)[0].message


def test_user_deepspeed_json_that_works(tmp_path):
    path = write_ds(tmp_path, {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"})
    assert check(job(deepspeed=path, nproc_per_node=8, nnodes=2, output_dir="/shared/out")) == []


def test_user_deepspeed_json_batch_conflict_is_a_warning(tmp_path):
    path = write_ds(tmp_path, {"zero_optimization": {"stage": 2}, "train_batch_size": 64})
    problems = check(job(deepspeed=path, nproc_per_node=8, nnodes=2))
    assert errors(problems) == []
    assert any("train_batch_size=64 (the job gives 16)" in p.message for p in problems)


def test_torch_compile_refused_with_zero3_from_a_user_json(tmp_path):
    """A JSON's stage shows only once it is read; the message names the file."""
    stage3 = write_ds(tmp_path, {"zero_optimization": {"stage": 3}})
    problems = check(job(deepspeed=stage3, nproc_per_node=8, torch_compile=True))
    assert fields(problems) == ["torch_compile"] and "not with ZeRO-3" in errors(problems)[0].message
    assert f"({stage3} sets stage 3)" in errors(problems)[0].message
    assert fields(check(job(deepspeed=stage3, nproc_per_node=8))) == []
    stage2 = write_ds(tmp_path, {"zero_optimization": {"stage": 2}})
    assert fields(check(job(deepspeed=stage2, nproc_per_node=8, torch_compile=True))) == []


def test_torch_compile_with_a_zero3_preset_is_reported_once():
    problems = validate(job(deepspeed="zero3", nproc_per_node=8, torch_compile=True), parse_hostfile_text(GPU_NODES), LLAMA8B)
    assert [p.field for p in errors(problems)] == ["torch_compile"]


def test_user_deepspeed_json_is_read_once(tmp_path, monkeypatch):
    """Engine rules, batch conflicts and the memory estimate share one read of the file."""
    from backend.job import dsconfig

    path = write_ds(tmp_path, {"zero_optimization": {"stage": 3}, "train_batch_size": 64})
    reads = []
    monkeypatch.setattr(dsconfig, "load_user_config", lambda p, load=dsconfig.load_user_config: reads.append(p) or load(p))
    spec = job(deepspeed=path, nproc_per_node=1, train_type="full", max_length=4096)
    problems = check(spec, cluster=local_cluster(GpuInfo(("RTX 4090",), 24.0)), model=QWEN7B)
    assert has_warning(problems, "deepspeed", "train_batch_size=64")
    assert has_warning(problems, "per_device_train_batch_size", "exceeds")  # the estimate ran too
    assert reads == [path]


WARNINGS = [
    ("ZeRO-3 across nodes", dict(deepspeed="zero3"), dict(deepspeed="zero2"), "deepspeed", "ZeRO-3 across nodes"),
    ("no checkpointing with long sequences", dict(gradient_checkpointing=False, max_length=8192),
     dict(gradient_checkpointing=False, max_length=2048), "gradient_checkpointing", "off with max_length"),
    ("both offloads", dict(deepspeed="zero3_offload"), dict(deepspeed="zero3"), "deepspeed", "host RAM"),
    ("fp16", dict(torch_dtype="float16"), dict(torch_dtype="bfloat16"), "torch_dtype", "loss scaling"),
    ("unused hostfile nodes", dict(nnodes=1), dict(nnodes=2), "nnodes", "not used: n1"),
    ("save_steps past the end", dict(max_steps=10, save_steps=100), dict(max_steps=10, save_steps=5), "save_steps", "final checkpoint"),
    ("a learning rate that diverges", dict(learning_rate=1e6), dict(learning_rate=1e-3), "learning_rate",
     "1e+06 is far above fine-tuning's usual range"),
    ("a relative output_dir on several nodes", dict(output_dir="out"), dict(output_dir="/shared/out"), "output_dir",
     "'out' is relative: on 2 nodes it is"),
    ("a relative dataset_cache_dir on several nodes", dict(dataset_cache_dir="cache"),
     dict(dataset_cache_dir="/shared/cache"), "dataset_cache_dir", "'cache' is relative: on 2 nodes it is"),
]


def has_warning(problems, field, fragment) -> bool:
    return any(p.severity == "warning" and p.field == field and fragment in p.message for p in problems)


@pytest.mark.parametrize("name,risky,fine,field,fragment", WARNINGS, ids=[w[0] for w in WARNINGS])
def test_warning(name, risky, fine, field, fragment):
    risky_problems = check(job(**{"nproc_per_node": 8, "nnodes": 2, **risky}))
    assert errors(risky_problems) == [] and has_warning(risky_problems, field, fragment), name
    assert not has_warning(check(job(**{"nproc_per_node": 8, "nnodes": 2, **fine})), field, fragment), name


def test_oversubscribing_cpu_cores_or_gpus_is_an_error():
    cpu = local_cluster(GpuInfo())
    cores = cpu.nodes[0].slots
    model = find_model_config("assets/demo/model")
    assert errors(check(job(nproc_per_node=cores, train_type="lora"), cluster=cpu, model=model)) == []
    problems = check(job(nproc_per_node=cores + 1, train_type="lora"), cluster=cpu, model=model)
    assert "nproc_per_node" in fields(problems, "error")
    gpu = local_cluster(GpuInfo(("A100",), 80.0))
    assert "nproc_per_node" in fields(check(job(nproc_per_node=2), cluster=gpu))


def test_multi_node_needs_a_cluster():
    assert "nnodes" in fields(check(job(nnodes=2, nproc_per_node=1), cluster=local_cluster(GpuInfo(("A100",), 80.0))))


def test_memory_warning_when_the_estimate_exceeds_the_gpu():
    small = local_cluster(GpuInfo(("RTX 4090",), 24.0))
    big = local_cluster(GpuInfo(("H200",), 139.8))
    spec = job(train_type="full", max_length=4096, gradient_checkpointing=True)
    assert "per_device_train_batch_size" in fields(check(spec, cluster=small, model=QWEN7B), "warning")
    lora = job(train_type="lora", max_length=2048)
    assert "per_device_train_batch_size" not in fields(check(lora, cluster=big, model=QWEN7B), "warning")


def test_local_files_must_exist(tmp_path):
    cluster = local_cluster(GpuInfo(("A100",), 80.0))
    missing = job(model=str(tmp_path / "no-model"), dataset=[str(tmp_path / "train.jsonl")])
    assert fields(check(missing, cluster=cluster)) == ["dataset[0]", "model"]
    (tmp_path / "train.jsonl").write_text('{"text": "a record"}\n')
    (tmp_path / "no-model").mkdir()  # a directory, but with nothing to load
    assert [p.message for p in check(missing, cluster=cluster) if p.severity == "error"] == [
        f"{tmp_path / 'no-model'}: no weights (model.safetensors, model.safetensors.index.json or pytorch_model.bin)",
        f"{tmp_path / 'no-model'}: no tokenizer (none of tokenizer.json, tokenizer.model, spiece.model, "
        "sentencepiece.bpe.model, vocab.json, vocab.txt or a *.tiktoken file)"]
    (tmp_path / "no-model").rmdir()
    shutil.copytree(DEMO_MODEL, tmp_path / "no-model")
    assert fields(check(missing, cluster=cluster)) == []
    # The tokenized-data cache must be a directory, or not exist yet (the worker makes it).
    assert fields(check(missing.model_copy(update={"dataset_cache_dir": str(tmp_path / "cache")}), cluster=cluster)) == []
    taken = missing.model_copy(update={"dataset_cache_dir": str(tmp_path / "train.jsonl")})
    assert [p.message for p in errors(check(taken, cluster=cluster))] == [f"{tmp_path / 'train.jsonl'} is not a directory"]


def test_broken_model_config_names_the_model_field(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    problems = validate(job(model=str(tmp_path)), parse_hostfile_text(GPU_NODES))
    assert {p.field for p in errors(problems)} == {"model"}
    assert any("config.json:1: model config is not valid JSON" in p.message for p in errors(problems))


def test_model_config_found_from_the_spec():
    """No model_config argument: the bundled Qwen2.5-7B shape is found from the hub id."""
    problems = validate(job(tensor_model_parallel_size=8, nproc_per_node=8), parse_hostfile_text(GPU_NODES))
    assert any("28 attention heads" in p.message for p in problems)


def test_every_problem_at_once():
    spec = job(nnodes=3, nproc_per_node=16, tensor_model_parallel_size=3, deepspeed="zero3", pipeline_model_parallel_size=2,
               context_parallel_size=2, max_length=1001)
    assert fields(check(spec)) == ["deepspeed", "max_length", "nnodes", "nproc_per_node", "tensor_model_parallel_size"]


def test_worker_capabilities_are_included():
    """One micro-batch is legal for the layout but the worker's pipeline refuses it; validate passes that on."""
    problems = validate(job(nproc_per_node=2, pipeline_model_parallel_size=2), parse_hostfile_text(GPU_NODES), LLAMA8B)
    assert any(p.field == "gradient_accumulation_steps" and "cannot fill a pipeline" in p.message for p in problems)



def model_problems(model: Path) -> list[str]:
    spec = job(model=str(model), dataset=[str(DEMO_MODEL.parent / "train.jsonl")], nproc_per_node=1)
    return [p.message for p in errors(validate(spec, local_cluster(GpuInfo()))) if p.field == "model"]


def test_broken_model_directories_are_named_by_file(tmp_path):
    """A 0-byte or truncated model.safetensors validated `ok` and failed at launch with a
    SafetensorError naming no file; a missing tokenizer trained on "0 training sequences"."""
    def copy(name: str) -> Path:
        return Path(shutil.copytree(DEMO_MODEL, tmp_path / name))

    assert model_problems(DEMO_MODEL) == []
    weights = copy("empty") / "model.safetensors"
    weights.write_bytes(b"")
    assert model_problems(weights.parent) == [f"{weights}: 0 bytes, not a safetensors file (truncated or empty)"]
    weights = copy("truncated") / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size - 100)
    assert model_problems(weights.parent) == [
        f"{weights}: truncated: its tensors need {size:,} bytes and the file has {size - 100:,}"]
    weights = copy("cut-in-header") / "model.safetensors"
    os.truncate(weights, 200)
    assert model_problems(weights.parent) == [
        f"{weights}: not a safetensors file, or truncated: its header claims {struct.unpack('<Q', weights.read_bytes()[:8])[0]:,} "
        "bytes and the file has 200"]
    weights = copy("garbage") / "model.safetensors"
    weights.write_bytes(struct.pack("<Q", 12) + b"not json!!!!" + b"\0" * 64)
    assert model_problems(weights.parent) == [f"{weights}: not a safetensors file (its header is not JSON)"]

    no_tokenizer = copy("no-tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    assert model_problems(no_tokenizer) == [f"{no_tokenizer}: no tokenizer (none of tokenizer.json, tokenizer.model, "
                                            "spiece.model, sentencepiece.bpe.model, vocab.json, vocab.txt or a "
                                            "*.tiktoken file)"]
    no_weights = copy("no-weights")
    (no_weights / "model.safetensors").unlink()
    assert model_problems(no_weights) == [
        f"{no_weights}: no weights (model.safetensors, model.safetensors.index.json or pytorch_model.bin)"]

    # Full DPO's reference model: its weights are checked by file as the model's; no tokenizer is read from it.
    def ref_model_problems(ref: Path) -> list[str]:
        spec = job(model=str(DEMO_MODEL), dataset=[str(DEMO_MODEL.parent / "train.jsonl")], nproc_per_node=1,
                   rlhf_type="dpo", train_type="full", ref_model=str(ref))
        return [p.message for p in errors(validate(spec, local_cluster(GpuInfo()))) if p.field == "ref_model"]

    assert ref_model_problems(weights.parent) == [f"{weights}: not a safetensors file (its header is not JSON)"]
    assert ref_model_problems(no_tokenizer) == []


def test_adapter_directories_are_checked_as_adapters_by_file(tmp_path):
    """`adapters` / `ref_adapters` name LoRA adapters: a directory without adapter_config.json (a
    model, or a run directory instead of its checkpoint-N/model), another peft method, truncated
    weights, or nothing at all are named before launch, by field and file."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes((DEMO_MODEL / "model.safetensors").read_bytes()[:4096])

    def problems(**fields) -> dict[str, list[str]]:
        spec = job(model=str(DEMO_MODEL), dataset=[str(DEMO_MODEL.parent / "train.jsonl")], nproc_per_node=1, **fields)
        out: dict[str, list[str]] = {}
        for p in errors(validate(spec, local_cluster(GpuInfo()))):
            out.setdefault(p.field, []).append(p.message)
        return out

    truncated = problems(adapters=[str(adapter)])["adapters[0]"]
    assert len(truncated) == 1 and truncated[0].startswith(f"{weights}: ")
    assert problems(adapters=[str(DEMO_MODEL)])["adapters[0]"] == [
        f"{DEMO_MODEL}: no adapter_config.json (not a LoRA adapter; a run's checkpoint-N/model or a LoRA export holds "
        "one)", f"{DEMO_MODEL}: no adapter weights (adapter_model.safetensors)"]
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    weights.unlink()
    assert problems(rlhf_type="dpo", precompute_ref_log_probs=True, ref_adapters=[str(adapter)]).get("ref_adapters[0]") == [
        f"{adapter / 'adapter_config.json'}: peft_type 'IA3', not a LoRA adapter",
        f"{adapter}: no adapter weights (adapter_model.safetensors)"]
    assert problems(adapters=[str(tmp_path / "nowhere")])["adapters[0]"] == [
        f"directory not found: {tmp_path / 'nowhere'}"]
    # the memory estimate counts the saved adapter's rank and targets, not lora_rank's and target_modules'
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 64, "target_modules": ["q_proj"]}))
    trained = [assess(job(model=str(DEMO_MODEL), dataset=["d.jsonl"], nproc_per_node=1, adapters=a),
                      local_cluster(GpuInfo())).memory.trainable_params for a in ([], [str(adapter)])]
    config = json.loads((DEMO_MODEL / "config.json").read_text())
    q_out = config["num_attention_heads"] * config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    assert trained[1] == config["num_hidden_layers"] * 64 * (config["hidden_size"] + q_out) != trained[0]


def test_a_sharded_models_index_is_followed_and_kept_inside_the_directory(tmp_path):
    model = Path(shutil.copytree(DEMO_MODEL, tmp_path / "sharded"))
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    assert model_problems(model) == [f"{model / 'model-00002-of-00002.safetensors'}: missing (the weights' index names it)"]
    index["weight_map"]["b"] = "../../etc/passwd"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    assert model_problems(model) == [
        f"{model / 'model.safetensors.index.json'}: names a shard outside the model directory ('../../etc/passwd')"]
    index["weight_map"].pop("b")
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    assert model_problems(model) == []
