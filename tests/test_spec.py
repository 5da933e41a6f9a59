"""The job spec: aliases, defaults, every user mistake as one named problem, YAML round trip."""
from __future__ import annotations

from backend.job.spec import JobSpec, dump_spec, load_spec, parse_spec


def test_minimal_spec_gets_defaults():
    spec, problems = parse_spec({"model": "Qwen/Qwen2.5-0.5B", "dataset": "a.jsonl"})
    assert problems == []
    assert spec.dataset == ["a.jsonl"]
    assert spec.train_type == "lora" and spec.nnodes == 1 and spec.nproc_per_node is None
    assert spec.target_modules == ["all-linear"]


def test_aliases_map_to_canonical_fields():
    spec, problems = parse_spec({"model": "m", "dataset": ["d"], "tp_size": 2, "pp_size": 2, "cp_size": 2, "ep_size": 2,
                                 "ulysses_size": 2, "lr": 3e-5, "micro_batch_size": 4, "--lora-r": 16})
    assert problems == []
    assert (spec.tensor_model_parallel_size, spec.pipeline_model_parallel_size, spec.context_parallel_size,
            spec.expert_model_parallel_size, spec.sequence_parallel_size) == (2, 2, 2, 2, 2)
    assert spec.learning_rate == 3e-5 and spec.per_device_train_batch_size == 4 and spec.lora_rank == 16


def test_unknown_key_suggests_the_close_field():
    spec, problems = parse_spec({"model": "m", "dataset": ["d"], "lora_rnak": 8})
    assert spec is None
    assert [str(p) for p in problems] == ["lora_rnak: unknown field (did you mean 'lora_rank'?)"]


def test_wrong_types_and_ranges_name_each_field():
    _, problems = parse_spec({"model": "m", "dataset": ["d"], "nnodes": 0, "learning_rate": "fast", "train_type": "qlora"})
    fields = sorted(p.field for p in problems)
    assert fields == ["learning_rate", "nnodes", "train_type"]
    assert all(p.severity == "error" for p in problems)


def test_missing_required_fields():
    _, problems = parse_spec({"train_type": "full"})
    assert {(p.field, p.message) for p in problems} == {("model", "required"), ("dataset", "required")}


def test_alias_and_field_both_given():
    _, problems = parse_spec({"model": "m", "dataset": ["d"], "tp": 2, "tensor_model_parallel_size": 2})
    assert [p.field for p in problems] == ["tensor_model_parallel_size"]


def test_bad_env_name():
    _, problems = parse_spec({"model": "m", "dataset": ["d"], "env": {"NCCL DEBUG": "INFO"}})
    assert problems[0].field == "env" and "NCCL DEBUG" in problems[0].message


def test_yaml_round_trip(tmp_path):
    spec = JobSpec(model="m", dataset=["a.jsonl", "b.jsonl#100"], deepspeed="zero3", env={"NCCL_DEBUG": "INFO"})
    dump_spec(spec, tmp_path / "job.yaml")
    back, problems = load_spec(tmp_path / "job.yaml")
    assert problems == [] and back == spec


def test_missing_empty_and_broken_yaml(tmp_path):
    _, problems = load_spec(tmp_path / "nope.yaml")
    assert problems[0].field.endswith("nope.yaml") and "not found" in problems[0].message
    (tmp_path / "empty.yaml").write_text("")
    _, problems = load_spec(tmp_path / "empty.yaml")
    assert "empty" in problems[0].message
    (tmp_path / "bad.yaml").write_text("model: m\ndataset: [a\nlr: 1\n")
    _, problems = load_spec(tmp_path / "bad.yaml")
    assert problems[0].field.startswith(str(tmp_path / "bad.yaml") + ":") and "invalid YAML" in problems[0].message
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    _, problems = load_spec(tmp_path / "list.yaml")
    assert "expected a mapping" in problems[0].message


def test_true_means_what_hf_means_or_is_refused_by_name():
    """`fsdp: true` is FSDP's default sharding and `resume_from_checkpoint: true` the latest
    checkpoint, as in HF's arguments; `deepspeed: true` or `attn_impl: true` names nothing."""
    spec, problems = parse_spec({"model": "m", "dataset": ["d"], "fsdp": True, "resume_from_checkpoint": True})
    assert problems == [] and (spec.fsdp, spec.resume_from_checkpoint) == ("full_shard", "latest")
    spec, problems = parse_spec({"model": "m", "dataset": ["d"], "deepspeed": True, "attn_impl": True})
    assert spec is None and [p.field for p in problems] == ["deepspeed", "attn_impl"]
    assert "a preset (zero0" in problems[0].message
