"""The job spec: aliases, defaults, every user mistake as one named problem, YAML round trip."""
from __future__ import annotations

import os
import time

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


def test_every_float_field_refuses_inf_and_nan_by_name(tmp_path):
    """`learning_rate: .inf` passed `gt=0`, and the worker died writing its first metric as JSON."""
    floats = [name for name, field in JobSpec.model_fields.items() if field.annotation is float]
    assert {"learning_rate", "num_train_epochs", "weight_decay", "hang_timeout_s"} <= set(floats)
    for value in (float("inf"), float("-inf"), float("nan")):
        _, problems = parse_spec({"model": "m", "dataset": ["d"], **{name: value for name in floats}})
        assert sorted(p.field for p in problems) == sorted(floats)
        assert all("finite number" in p.message for p in problems), problems
    (tmp_path / "job.yaml").write_text("model: m\ndataset: d.jsonl\nlearning_rate: .inf\nwarmup_ratio: .nan\n")
    _, problems = load_spec(tmp_path / "job.yaml")
    assert [p.field for p in problems] == ["learning_rate", "warmup_ratio"]


def test_a_yaml_alias_bomb_is_refused_at_once_without_expanding_it(tmp_path):
    """Nine lines of anchors stand for 10^9 values: validate ran 58 s, took 8.6 GB and printed
    2.8 GB. The aliases' expansion is counted on the composed nodes, before anything is built."""
    lines = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]" for i in range(8)]
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\nmodel: m\ndataset: *i\n")
    started = time.monotonic()
    spec, problems = load_spec(tmp_path / "bomb.yaml")
    assert time.monotonic() - started < 2
    assert spec is None and [str(p) for p in problems] == [
        f"{tmp_path / 'bomb.yaml'}: its aliases expand to more than 100,000 values: not a job file "
        "(a job is a few dozen fields)"]
    # A cycle is no expansion to count for ever; a few anchors are a job like any other.
    (tmp_path / "cycle.yaml").write_text("model: m\ndataset: &d [x.jsonl, *d]\n")
    assert load_spec(tmp_path / "cycle.yaml")[0] is None
    (tmp_path / "anchors.yaml").write_text("model: m\ndataset: &d [x.jsonl]\nenv: {A: &v '1', B: *v}\n")
    spec, problems = load_spec(tmp_path / "anchors.yaml")
    assert problems == [] and spec.env == {"A": "1", "B": "1"}


def test_a_huge_value_or_file_is_echoed_in_a_few_hundred_characters(tmp_path):
    _, problems = parse_spec({"model": "m", "dataset": ["d"], "learning_rate": "x" * 10_000_000, "train_type": "y" * 10**6})
    by_field = {p.field: p.message for p in problems}
    assert sorted(by_field) == ["learning_rate", "train_type"]
    assert all(len(m) < 500 for m in by_field.values()) and "(10,000,002 characters)" in by_field["learning_rate"]
    (tmp_path / "big.yaml").write_text("model: m\ndataset: d\n" + "# padding\n" * 200_000)
    _, problems = load_spec(tmp_path / "big.yaml")
    assert [str(p) for p in problems] == [f"{tmp_path / 'big.yaml'}: larger than 1024 KiB: not a job file "
                                          "(a job is a few dozen fields)"]


def test_a_job_file_that_is_a_fifo_directory_device_or_link_loop_is_named(tmp_path):
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "dir.yaml").mkdir()
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
    found = {name: [p.message for p in load_spec(path)[1]]
             for name, path in [("fifo", tmp_path / "fifo.yaml"), ("dir", tmp_path / "dir.yaml"),
                                ("loop", tmp_path / "loop.yaml"), ("zero", "/dev/zero")]}
    assert found == {"fifo": ["is a FIFO (named pipe): reading it would wait for a writer, not a job file"],
                     "dir": ["is a directory, not a job file"], "loop": ["is a symbolic link loop, not a job file"],
                     "zero": ["is a character device, not a job file"]}
