"""Pipeline parallel (torch.distributed.pipelining) on CPU with gloo: the rules, and the same job
with and without PP trains the same, resumes the same and exports the same model."""
from __future__ import annotations

import json

import pytest

from backend.job.capabilities import pp_problems, same_data_ranks, seq_multiple, unsupported, world_problems
from backend.job.spec import JobSpec
from worker import (EQUALITY_STEPS, assert_resumes_the_same, assert_same_export, equality_job, events, losses,
                    probe_ranks, run_worker, trained, trained_together, write_run)

STEPS = EQUALITY_STEPS


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
    assert errors(pipeline_model_parallel_size=2, gradient_accumulation_steps=2, fsdp="full_shard") == []
    assert errors(pipeline_model_parallel_size=2, gradient_accumulation_steps=2, fsdp="full_shard offload") == ["fsdp"]
    refused = errors(pipeline_model_parallel_size=2, gradient_accumulation_steps=2, deepspeed="zero1",
                     tensor_model_parallel_size=2, context_parallel_size=2, sequence_parallel_size=2,
                     expert_model_parallel_size=2, torch_dtype="float16", router_aux_loss_coef=0.01)
    assert refused == ["deepspeed", "tensor_model_parallel_size", "sequence_parallel_size", "context_parallel_size",
                       "expert_model_parallel_size", "router_aux_loss_coef", "torch_dtype"]
    assert "pipeline_model_parallel_size" not in [p.field for p in unsupported(
        spec(pipeline_model_parallel_size=2, gradient_accumulation_steps=2))]


def test_the_bubble_is_shown_and_the_layout_counts_the_pipeline():
    job = spec(pipeline_model_parallel_size=2, gradient_accumulation_steps=3, max_length=128)
    warning, = pp_problems(job)
    assert warning.severity == "warning" and "25%" in warning.message  # (2 - 1) / (3 + 2 - 1)
    assert same_data_ranks(job) == 2 and seq_multiple(job) == 128
    assert world_problems(job, 2) == world_problems(job, 4) == []  # one pipeline, or two data-parallel ones
    assert [p.field for p in world_problems(job, 3)] == ["pipeline_model_parallel_size"]


def test_layers_must_split_into_the_stages():
    from dataclasses import replace

    from backend.job.modelcfg import ModelConfig
    from backend.job.validate import _model_rules

    model = ModelConfig(model_type="llama", hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4,
                        num_kv_heads=2, head_dim=16, vocab_size=100, tie_word_embeddings=False)
    fields = lambda **over: [p.field for p in _model_rules(spec(**over), model, 4)]  # noqa: E731
    assert fields(pipeline_model_parallel_size=2) == fields(pipeline_model_parallel_size=3) == []
    assert fields(pipeline_model_parallel_size=4) == ["pipeline_model_parallel_size"]
    assert fields(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                  pipeline_schedule="interleaved_1f1b") == ["pipeline_model_parallel_size"]
    # A tied output layer would be a second copy on the last stage, updated apart from the embedding.
    tied = [p for p in _model_rules(spec(pipeline_model_parallel_size=2), replace(model, tie_word_embeddings=True), 4)]
    assert [p.field for p in tied] == ["pipeline_model_parallel_size"] and "tied" in tied[0].message


def test_a_window_shorter_than_the_rows_is_refused_in_a_pipeline():
    """A stage builds the full causal mask: Mistral's 4096-token window at max_length 8192 would
    train as full attention."""
    from backend.job.capabilities import pipeline_model_problems

    job = spec(pipeline_model_parallel_size=2, max_length=8192)
    window, = pipeline_model_problems(job, 4096, 0, ())
    assert window.field == "pipeline_model_parallel_size" and "sliding window of 4096 tokens" in window.message
    assert pipeline_model_problems(job.model_copy(update={"max_length": 4096}), 4096, 0, ()) == []
    assert [p.field for p in pipeline_model_problems(job, 0, 0, ("linear_attention",))] == ["pipeline_model_parallel_size"]
    assert pipeline_model_problems(spec(max_length=8192), 4096, 0, ("mamba",)) == []


def test_the_worker_refuses_a_tied_model_in_a_pipeline(tiny_model):
    """The demo model ties its embeddings; a worker started without the validator says so by name."""
    from transformers import AutoModelForCausalLM

    from launcher.config import ConfigError
    from launcher.engines.pp import refuse_tied

    with pytest.raises(ConfigError, match="pipeline_model_parallel_size: .*tied"):
        refuse_tied(AutoModelForCausalLM.from_pretrained(tiny_model))




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


def test_the_memory_estimate_counts_the_micro_batches_in_flight():
    """1F1B: the first stage keeps PP micro-batches' activations of its layers, the last one's and
    the logits; the worst of the two is the per-GPU figure."""
    from backend.job.layout import compute_layout
    from backend.job.memory import estimate_memory
    from backend.job.modelcfg import find_model_config

    model = find_model_config("qwen2.5-7b")

    def activations(**over):
        job = spec(model="Qwen/Qwen2.5-7B-Instruct", train_type="full", torch_dtype="bfloat16", max_length=4096,
                   use_liger_kernel=True, nproc_per_node=4, **over)
        return estimate_memory(job, model, compute_layout(job)).activations_gib

    one = activations(gradient_accumulation_steps=8)
    four = activations(pipeline_model_parallel_size=4, gradient_accumulation_steps=8)
    assert four == pytest.approx(one)  # a quarter of the layers, four micro-batches of them
    two = activations(pipeline_model_parallel_size=4, gradient_accumulation_steps=2)
    assert two == pytest.approx(one / 2)
    interleaved = activations(pipeline_model_parallel_size=4, gradient_accumulation_steps=8,
                              virtual_pipeline_model_parallel_size=2, pipeline_schedule="interleaved_1f1b")
    assert interleaved == pytest.approx(one * (1 + 3 / 8))


@pytest.mark.e2e
@pytest.mark.parametrize("train_type,extra,checkpointing", [
    ("full", {"fsdp": "full_shard"}, False),
    ("lora", {"virtual_pipeline_model_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b"}, True)],
    ids=["full-fsdp2-1f1b", "lora-replicated-interleaved-checkpointed"])
def test_pp2_by_dp2_on_four_ranks_trains_resumes_and_exports_like_data_parallel(tmp_path, four_layers, train_type, extra,
                                                                               checkpointing):
    """Two pipelines of two stages, each stage over the two pipelines by FSDP2 (sharded) or torch's
    DDP's layout on FSDP2 (LoRA, with gradient checkpointing in every stage), against the same job
    on two data-parallel ranks: the same global batch. (PP alone, without data parallel, trains in
    the split test below.)"""
    spec_fields = equality_job(four_layers, train_type=train_type, gradient_checkpointing=checkpointing)
    plain = trained(tmp_path, "plain", 2, **spec_fields)
    layout = {"pipeline_model_parallel_size": 2, **extra}
    pp = trained(tmp_path, "pp", 4, **spec_fields, **layout)
    assert_same_run(pp, plain)
    assert json.loads((pp / "checkpoint-10" / "trainer_state.json").read_text())["engine"] == "pp"
    timing = events(pp, 1, "timing")
    assert timing and all(e["pp_stages"] == ([1, 3] if "virtual_pipeline_model_parallel_size" in extra else [1])
                          and e["stage_compute_s"] > 0 for e in timing)

    assert_resumes_the_same(pp, write_run(tmp_path / "resumed", **spec_fields, **layout), 4, 10, STEPS)
    assert_same_export(pp, plain, tmp_path)


@pytest.mark.e2e
def test_torch_ddp_fails_under_a_pipeline_schedule(tmp_path):
    """Pins the engine behaviour behind DDP's layout on FSDP2 for LoRA pipelines (torch 2.13): a
    DistributedDataParallel stage fails DDP's bucket rebuild in the second step of a schedule (its
    reducer counts each parameter once per micro-batch). When this passes, torch's DDP can serve
    LoRA's replicated stages again."""
    outcomes, log = probe_ranks(tmp_path, 4, '''
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
pp_rank = mesh["pp"].get_local_rank()
stage = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
                                process_group=mesh["dp"].get_group())
schedule = Schedule1F1B(PipelineStage(stage, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group()), 2,
                        loss_fn=lambda out, target: (out - target).pow(2).mean())
x = torch.randn(4, 8)
try:
    for _ in range(2):
        schedule.step(*((x,) if pp_rank == 0 else ()), target=x if pp_rank == 1 else None)
    report("RAN")
except RuntimeError as exc:
    report(f"FAILED {'rebuilt parameter indices' in str(exc.__cause__ or exc)}")
''')
    assert "FAILED True" in outcomes and "RAN" not in outcomes, (outcomes, log[-3000:])


@pytest.mark.e2e
def test_a_schedule_calls_its_loss_once_more_at_its_first_step(tmp_path):
    """Pins the engine behaviour behind launcher/engines/pp.py's `_without_shape_inference` and its
    reference schedule (torch 2.13): a training schedule's first step infers the stages' shapes by a
    forward and backward of uninitialised activations, calling the loss once more than it has
    micro-batches, from `_backward_metadata_inference`; the others come from `_compute_loss`. A
    forward-only schedule without a loss, over stage objects of its own, between steps, makes the
    training schedule infer nothing again, and keeps its outputs until told to clear them (the
    reference pass empties the last stage's as its loss reads them, and torch reads no more of them)."""
    outcomes, log = probe_ranks(tmp_path, 2, '''
import sys
import torch, torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
module = torch.nn.Linear(8, 8)
callers = []
def loss(out, target):
    callers.append(sys._getframe(1).f_code.co_name)
    return (out - target).pow(2).mean()
train = Schedule1F1B(PipelineStage(module, rank, 2, torch.device("cpu")), 2, loss_fn=loss)
forward_only = PipelineStage(module, rank, 2, torch.device("cpu"))
def row_sums(out, target):
    sums = out.sum(-1)
    out.untyped_storage().resize_(0)
    return sums
evaluate = Schedule1F1B(forward_only, 2, loss_fn=row_sums)
x = torch.randn(4, 8)
steps, kept = [], []
for run in (train.step, evaluate.eval, train.step, evaluate.eval, train.step):
    callers.clear()
    sums = []
    with torch.no_grad() if run == evaluate.eval else torch.enable_grad():
        run(*((x,) if rank == 0 else ()), target=x if rank == 1 else None, losses=sums, return_outputs=False)
    steps.append(",".join(callers) or "-")
    if run == evaluate.eval:
        outputs = [cached[0][0] for cached in forward_only.fwd_cache.values()]
        kept.append(f"{len(outputs)}:{sum(o.untyped_storage().nbytes() for o in outputs)}")
        forward_only.clear_runtime_states()
        kept.append(str(len(forward_only.fwd_cache)))
        assert rank == 0 or [s.shape for s in sums] == [(2,), (2,)]
report(" ".join(steps) + " kept " + " ".join(kept))
''')
    real = "_compute_loss,_compute_loss"
    assert outcomes == ["- - - - - kept 2:128 0 2:128 0",  # the first stage's: 2 x (2 rows x 8 floats)
                        f"_backward_metadata_inference,{real} - {real} - {real} kept 2:0 0 2:0 0"], (outcomes, log[-3000:])


@pytest.mark.e2e
def test_a_pipeline_checkpoint_resumes_onto_another_split_and_only_into_a_pipeline(tmp_path, four_layers):
    """PP=2's checkpoint resumed on PP=4 (a layer per stage) trains on with the same losses (DCP
    reads each stage's keys wherever they were written); a job without PP refuses it by name."""
    spec_fields = equality_job(four_layers, train_type="full", gradient_accumulation_steps=4)
    two, plain = trained_together(tmp_path, ("pp2", 2, {**spec_fields, "pipeline_model_parallel_size": 2}),
                                  ("plain", 1, spec_fields))
    assert_same_run(two, plain)  # PP alone (1F1B, full fine-tuning) trains as one rank does
    assert_resumes_the_same(two, write_run(tmp_path / "pp4", **spec_fields, pipeline_model_parallel_size=4), 4, 10, STEPS)

    import shutil

    plain = write_run(tmp_path / "plain-resumed", **spec_fields)
    shutil.copytree(two / "checkpoint-10", plain / "checkpoint-10")
    proc = run_worker(plain, nproc=1, resume="latest")
    assert proc.returncode != 0
    assert "written by the pp engine and this job runs ddp: a pipeline's checkpoint resumes only with " \
           "pipeline_model_parallel_size > 1" in proc.log, proc.log[-3000:]
