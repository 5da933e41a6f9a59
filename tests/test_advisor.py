"""The layout advisor (backend.job.advisor): every row it gives is a job the validator accepts, keeps
the job's global batch and fits the GPU by the estimate; rows are ranked by the cost model, whose
parts each answer to what they model; `swift-studio plan --advise` prints the same, as predictions."""
from __future__ import annotations

import json
import re
import sys
from dataclasses import replace

import pytest
import yaml

from backend.cli import main
from backend.job.advisor import Hardware, _step_seconds, advise
from backend.job.cluster import parse_hostfile_text
from backend.job.layout import compute_layout
from backend.job.modelcfg import parse_model_config
from backend.job.spec import JobSpec
from backend.job.validate import assess, errors
from worker import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from throughput import SHAPES  # noqa: E402

DATA = [str(ROOT / "assets" / "demo" / "train.jsonl")]


def shape(name: str):
    return parse_model_config(SHAPES[name], name)


def job(**fields) -> JobSpec:
    return JobSpec(**{"model": str(ROOT / "assets" / "demo" / "model"), "dataset": DATA, **fields})


def global_batch(spec: JobSpec, cluster) -> int:
    return spec.per_device_train_batch_size * spec.gradient_accumulation_steps * compute_layout(spec, cluster).dp


@pytest.mark.parametrize("name,fields,hosts", [
    ("llama3.2-1b", dict(train_type="full", max_length=4096, per_device_train_batch_size=2, gradient_accumulation_steps=4,
                         nproc_per_node=8), "n1 slots=8 gpu_mem_gib=80\n"),
    ("llama3.1-8b", dict(train_type="full", max_length=4096, per_device_train_batch_size=1, gradient_accumulation_steps=8,
                         nnodes=2, nproc_per_node=8), "n1 slots=8 gpu_mem_gib=80\nn2 slots=8 gpu_mem_gib=80\n"),
])
def test_every_row_is_a_valid_job_that_keeps_the_global_batch_and_fits(name, fields, hosts):
    model, cluster, spec = shape(name), parse_hostfile_text(hosts), job(**fields)
    advice = advise(spec, model, cluster, Hardware(gpu_mem_gib=80), top=50)
    assert advice.rows and advice.considered > len(advice.rows) + advice.too_big
    speeds = [row.tokens_per_s for row in advice.rows]
    assert speeds == sorted(speeds, reverse=True)
    for row in advice.rows:
        applied = spec.model_copy(update=row.fields)
        assessed = assess(applied, cluster, model)
        assert errors(assessed.problems) == [], (row.fields, errors(assessed.problems))
        assert global_batch(applied, cluster) == global_batch(spec, cluster)
        assert assessed.memory.total_gib == pytest.approx(row.memory_gib) and row.memory_gib <= 80 * 0.9
        assert compute_layout(applied, cluster).tp <= 8  # within a node
        assert all(key.startswith("predicted") for key in row.to_dict() if key not in ("engine", "layout", "fields"))


def test_a_refusal_that_depends_on_the_micro_batch_does_not_end_the_search_of_its_layout():
    """Under SP the eval micro-batch must be the training one: refused at micro-batch 8, SP is still
    advised at the micro-batch of 1 that per_device_eval_batch_size asks for."""
    spec = job(train_type="full", max_length=4096, per_device_train_batch_size=1, gradient_accumulation_steps=8,
               nproc_per_node=8, split_dataset_ratio=0.1, per_device_eval_batch_size=1)
    cluster = parse_hostfile_text("n1 slots=8 gpu_mem_gib=80\n")
    rows = advise(spec, shape("llama3.2-1b"), cluster, Hardware(gpu_mem_gib=80), top=500).rows
    sequence_parallel = [r for r in rows if r.fields.get("sequence_parallel_size", 1) > 1]
    assert sequence_parallel and all(r.fields.get("per_device_train_batch_size", 1) == 1 for r in sequence_parallel)


def test_only_offload_fits_a_large_model_and_a_job_that_fits_nowhere_has_no_rows():
    spec = job(train_type="full", max_length=8192, per_device_train_batch_size=1, nproc_per_node=1)
    advice = advise(spec, shape("llama3.1-8b"), parse_hostfile_text("n1 slots=1 gpu_mem_gib=24\n"),
                    Hardware(gpu_mem_gib=24), top=50)
    assert advice.rows and {row.engine for row in advice.rows} == {"ZeRO-3 + offload"}
    assert all(row.parts["offload"] > 0 for row in advice.rows)
    advice = advise(spec, shape("llama3.1-8b"), parse_hostfile_text("n1 slots=1 gpu_mem_gib=4\n"), Hardware(gpu_mem_gib=4))
    assert advice.rows == [] and advice.too_big > 0


def test_long_sequences_on_small_gpus_are_advised_to_split_or_recompute_them():
    spec = job(train_type="lora", max_length=32768, per_device_train_batch_size=1, gradient_accumulation_steps=8,
               nproc_per_node=8, gradient_checkpointing=False)
    cluster = parse_hostfile_text("n1 slots=8 gpu_mem_gib=40\n")
    advice = advise(spec, shape("llama3.1-8b"), cluster, Hardware(gpu_mem_gib=40), top=20)
    assert advice.rows
    for row in advice.rows:
        layout = compute_layout(spec.model_copy(update=row.fields), cluster)
        assert row.fields.get("gradient_checkpointing") or layout.sp * layout.cp > 1, row.fields


def test_on_one_gpu_with_room_the_engine_measured_fastest_comes_first():
    """One rank has no traffic: what orders the engines is their measured speed (ENGINE_EFFICIENCY,
    LoRA's own), not the memory they save; ZeRO-3 is advised only below the engines that ran faster."""
    spec = job(train_type="full", max_length=2048, per_device_train_batch_size=1, gradient_accumulation_steps=16,
               nproc_per_node=1)
    advice = advise(spec, shape("qwen2.5-1.5b"), parse_hostfile_text("n1 slots=1 gpu_mem_gib=141\n"),
                    Hardware(gpu_mem_gib=141), top=50)
    assert advice.rows[0].engine == "DDP"
    first = {}
    for row in advice.rows:
        first.setdefault(row.engine, row)
    assert first["ZeRO-3"].tokens_per_s < first["DDP"].tokens_per_s * 0.6 < first["FSDP2"].tokens_per_s
    # LoRA ran faster on FSDP2 than on DDP (LORA_ENGINE_EFFICIENCY): it comes first there
    lora = advise(spec.model_copy(update={"train_type": "lora"}), shape("qwen2.5-1.5b"),
                  parse_hostfile_text("n1 slots=1 gpu_mem_gib=141\n"), Hardware(gpu_mem_gib=141), top=50)
    assert lora.rows[0].engine == "FSDP2"


def parts(spec: JobSpec, hosts: str = "n1 slots=8\n", **hardware) -> dict[str, float]:
    cluster = parse_hostfile_text(hosts)
    layout = compute_layout(spec, cluster)
    return _step_seconds(spec, shape("llama3.2-1b"), layout, replace(Hardware(), **hardware), spec.max_length,
                         global_batch(spec, cluster))


def test_each_part_of_the_cost_model_answers_to_what_it_models():
    base = job(train_type="full", max_length=4096, per_device_train_batch_size=2, gradient_accumulation_steps=4,
               nproc_per_node=8, gradient_checkpointing=False)
    plain = parts(base)
    assert plain["model_parallel"] == plain["bubble"] == plain["offload"] == 0 and plain["data_parallel"] > 0
    # LoRA has no weight gradients: less compute, and almost nothing to reduce
    lora = parts(base.model_copy(update={"train_type": "lora"}))
    assert lora["compute"] < plain["compute"] * 0.75 and lora["data_parallel"] < plain["data_parallel"] / 50
    # checkpointing recomputes the forward; Liger is faster
    assert parts(base.model_copy(update={"gradient_checkpointing": True}))["compute"] > plain["compute"] * 1.25
    assert parts(base.model_copy(update={"use_liger_kernel": True}))["compute"] < plain["compute"]
    # ZeRO-3 gathers the parameters every micro-batch, and its hooks slow the compute on any world;
    # offload crosses PCIe
    zero3 = parts(base.model_copy(update={"deepspeed": "zero3"}))
    assert zero3["data_parallel"] > plain["data_parallel"] * 2 and zero3["compute"] > plain["compute"] * 1.5
    assert parts(base.model_copy(update={"deepspeed": "zero3_offload"}))["offload"] > 0
    # TP pays per layer; the pipeline's bubble is (PP - 1) / micro-batches of the busy time
    assert parts(base.model_copy(update={"tensor_model_parallel_size": 2}))["model_parallel"] > 0
    pipe = parts(base.model_copy(update={"pipeline_model_parallel_size": 2}))
    assert pipe["bubble"] == pytest.approx((pipe["compute"] + pipe["model_parallel"]) / 4)
    # the same world over two nodes reduces at the slower bandwidth between them
    two = parts(base.model_copy(update={"nnodes": 2, "nproc_per_node": 4}), "n1 slots=4\nn2 slots=4\n",
                inter_gib_s=10.0)
    assert two["data_parallel"] > plain["data_parallel"] * 10
    # the Ulysses all-to-all spans nodes when the sequence group is larger than a node
    sp = base.model_copy(update={"deepspeed": "zero2", "sequence_parallel_size": 8, "nnodes": 2, "nproc_per_node": 4})
    assert parts(sp, "n1 slots=4\nn2 slots=4\n", inter_gib_s=10.0)["model_parallel"] > \
        parts(sp, "n1 slots=4\nn2 slots=4\n", inter_gib_s=1000.0)["model_parallel"] * 10


def test_a_mixture_of_experts_is_advised_ep_degrees_that_gather_only_the_ranks_experts():
    moe, cluster = shape("qwen3-moe-3b"), parse_hostfile_text("n1 slots=8 gpu_mem_gib=80\n")
    base = job(train_type="full", max_length=4096, per_device_train_batch_size=2, gradient_accumulation_steps=2,
               nproc_per_node=8, fsdp="full_shard")
    rows = advise(base, moe, cluster, Hardware(gpu_mem_gib=80), top=500).rows
    expert_rows = [r for r in rows if r.fields.get("expert_model_parallel_size", 1) > 1]
    assert {r.fields["expert_model_parallel_size"] for r in expert_rows} == {2, 4, 8}  # of the 64 experts
    for row in expert_rows:
        assert errors(assess(base.model_copy(update=row.fields), cluster, moe).problems) == []

    def of(spec: JobSpec) -> dict[str, float]:
        return _step_seconds(spec, moe, compute_layout(spec, cluster), Hardware(), spec.max_length,
                             global_batch(spec, cluster))

    one, eight = of(base), of(base.model_copy(update={"expert_model_parallel_size": 8}))
    # FSDP2 gathers an eighth of the experts, and the tokens cross to them and back
    assert eight["data_parallel"] < one["data_parallel"] * 0.75
    assert one["model_parallel"] == 0 < eight["model_parallel"]


def test_plan_advise_prints_the_ranked_predictions(tmp_path, capsys):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(
        {"model": "Qwen/Qwen2.5-0.5B-Instruct", "dataset": ["swift/self-cognition#500"], "nproc_per_node": 4,
         "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "train_type": "full", "max_length": 2048}))
    (tmp_path / "hosts").write_text("n1 slots=4 gpu_mem_gib=24\n")
    argv = ["plan", str(tmp_path / "job.yaml"), "--hostfile", str(tmp_path / "hosts"), "--advise", "--top", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "predictions of the cost model, not measurements" in out and "over 24 GiB" in out
    assert [line.split(".")[0] for line in out.splitlines()[1:]] == ["1", "2", "3"]
    assert main(argv + ["--json", "--gpu-mem-gib", "16"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"]["gpu_mem_gib"] == 16 and len(data["rows"]) == 3
    assert all(row["predicted_memory_gib"] <= 16 * 0.9 for row in data["rows"])
    # a model whose config cannot be read is named, not advised on
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"model": "org/unknown-model", "dataset": ["swift/self-cognition"]}))
    assert main(argv) == 1
    assert "the advisor needs it" in capsys.readouterr().err


def test_the_train_tab_shows_the_advice_for_a_form_that_validates_and_none_for_one_that_does_not():
    from studio.form import default_form, spec_to_form
    from studio.train_view import advice_view, check_form

    cluster = parse_hostfile_text("n1 slots=4 gpu_mem_gib=24\n")
    values = default_form() | spec_to_form({"model": "Qwen/Qwen2.5-0.5B-Instruct", "dataset": DATA, "nproc_per_node": 4,
                                            "train_type": "full", "max_length": 2048})
    text, rows = advice_view(check_form(values, cluster))
    assert "predictions of the cost model, not measurements" in text and "over 24 GiB" in text
    assert [label.split(".")[0] for label, _ in rows] == ["1", "2", "3", "4", "5"]
    assert text.count("\n|") == 1 + 1 + 5  # header, rule, rows
    applied = check_form(values | spec_to_form(rows[0][1]), cluster)
    assert applied.ok
    text, rows = advice_view(check_form(values, parse_hostfile_text("n1 slots=4 gpu_mem_gib=1\n")))
    assert rows == [] and "**No configuration fits**" in text
    assert "preview the data for its own lengths" in text
    # the data preview's mean length: the predictions are for samples that long
    full, _ = advice_view(check_form(values, cluster))
    shorter, rows_short = advice_view(check_form(values, cluster), 300.0)
    assert shorter.startswith("Samples of 300 tokens on average (the data preview's)") and rows_short
    table = [line.split(" | ") for line in full.splitlines() if line.startswith("| 1 ")]
    table_short = [line.split(" | ") for line in shorter.splitlines() if line.startswith("| 1 ")]
    assert table[0][4] != table_short[0][4]  # predicted tokens/s of row 1
    text, rows = advice_view(check_form(values | {"learning_rate": -1}, cluster))
    assert rows == [] and text.startswith("Fix the problems marked on the form first")


def test_the_mean_sample_length_is_of_what_trains_and_skips_datasets_the_preview_could_not_read():
    from studio.preview_view import mean_tokens

    result = {"max_length": 2048, "datasets": [{"error": None, "lengths": [100, 5000]},
                                               {"error": "x.jsonl:3: bad", "lengths": [1]}, {"error": None, "lengths": []}]}
    assert mean_tokens(result) == (100 + 2048) / 2
    assert mean_tokens({"max_length": 8, "datasets": [{"error": None, "lengths": None}]}) is None


def test_the_benchmark_merges_a_jobs_rows_from_calls_on_one_machine_only(tmp_path):
    """bench/advisor.py --rows splits a job over device calls; --merge judges the pick over all of them
    and refuses what would make the verdict wrong: another machine, a row twice, a call cut short."""
    from advisor import merged

    where = {"host": "gpu-7", "device": "NVIDIA H100 80GB HBM3"}

    def row(rank: int, tokens_per_s: float) -> dict:
        return {"job": "j", "rank": rank, **where, "engine": "DDP", "fields": {},
                "predicted_tokens_per_s": 100 - rank, "tokens_per_s": tokens_per_s}

    def job_line(**changed) -> dict:
        return {"target": "j", "job": "j", **where, "enumerated": 3, "summary": "3 considered", **changed}

    def write(name: str, *lines: dict):
        (tmp_path / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
        return tmp_path / name

    first = write("a.jsonl", row(0, 90.0), row(1, 100.0), job_line())
    rest = write("b.jsonl", row(2, 50.0), job_line())
    [line] = merged([first, rest])
    assert (line["rows"], line["ratio"], line["best"]["rank"], line["met"]) == ([0, 1, 2], 0.9, 1, True)
    assert line["rank_correlation"] == 0.5 and line["host"] == "gpu-7"

    elsewhere = write("c.jsonl", {**row(2, 50.0), "host": "gpu-8"})  # a call cut short on another machine
    with pytest.raises(ValueError, match=r"c.jsonl:1: host 'gpu-8', but .*a.jsonl:1 has 'gpu-7'"):
        merged([first, elsewhere])
    with pytest.raises(ValueError, match=r"b.jsonl:1: row 2 of j again \(first at .*b.jsonl:1\)"):
        merged([first, rest, rest])
    beyond = write("e.jsonl", row(3, 50.0), job_line())  # a row the job does not have
    with pytest.raises(ValueError, match=r"e.jsonl:1: row 3 of j, which has rows 0-2"):
        merged([first, beyond])
    crafted = write("f.jsonl", {"job": "j", "rank": "0"})
    with pytest.raises(ValueError, match=r"f.jsonl:1: not a line of bench/advisor.py"):
        merged([crafted])
    cut_short = write("d.jsonl", row(2, 50.0))
    with pytest.raises(ValueError, match="j: row lines without the job's line \\(no call of it finished\\)"):
        merged([cut_short])


def test_the_benchmark_refuses_bad_row_slices_and_a_merge_written_over_its_input(tmp_path, capsys, monkeypatch):
    import argparse

    from advisor import main as bench_main
    from advisor import row_list

    assert row_list("12:24") == list(range(12, 24))
    assert row_list("0,7:9,12,8") == [0, 7, 8, 12]
    for bad in ("3:1", "2:2", "-1:4", "a:b", "1,,2", "-3", "0,4:"):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(bad))):
            row_list(bad)
    kept = tmp_path / "a.jsonl"
    kept.write_text('{"job": "j", "rank": 0}\n')
    (tmp_path / "hard.jsonl").hardlink_to(kept)
    (tmp_path / "soft.jsonl").symlink_to(kept)
    for out in (kept, tmp_path / "hard.jsonl", tmp_path / "soft.jsonl"):
        monkeypatch.setattr(sys, "argv", ["advisor.py", "--merge", str(kept), "--out", str(out)])
        with pytest.raises(SystemExit):
            bench_main()
        assert "is one of the files --merge reads" in capsys.readouterr().err, out
        assert kept.read_text() == '{"job": "j", "rank": 0}\n'
