"""Tensor parallel (transformers' TP, with its FSDP2 for data parallel) on CPU with gloo: the same
job with and without TP trains the same, resumes the same and exports the same model."""
from __future__ import annotations

import re


import pytest
import torch

from backend.job.capabilities import TransformersPlan, transformers_plan, unsupported
from backend.job.spec import JobSpec
from worker import (EQUALITY_STEPS, assert_resumes_the_same, assert_same_eval, assert_same_export,
                    assert_timing_from_every_rank, equality_job, events, losses, run_worker, torchrun, trained,
                    trained_together, write_run)

STEPS = EQUALITY_STEPS


def spec(**over) -> JobSpec:
    return JobSpec(**{"model": "m", "dataset": ["d"], **over})


def test_tp_plan_puts_the_data_parallel_ranks_beside_tp():
    assert transformers_plan(spec(), 8) is None
    assert transformers_plan(spec(tensor_model_parallel_size=2), 8) == TransformersPlan(tp=2, fsdp=1, replicate=4)
    assert transformers_plan(spec(tensor_model_parallel_size=4, fsdp="full_shard"), 8) == TransformersPlan(tp=4, fsdp=2, replicate=1)
    assert transformers_plan(spec(tensor_model_parallel_size=2), 2).dp == 1
    assert transformers_plan(spec(tensor_model_parallel_size=2, deepspeed="zero2"), 8) is None  # AutoTP shards it


def test_autotp_is_refused_where_deepspeed_does_not_run_it():
    from backend.job.capabilities import zero_problems
    from backend.job.dsconfig import build_ds_config

    full = spec(tensor_model_parallel_size=2, deepspeed="zero2", train_type="full")
    config = build_ds_config(full, dp_size=4)
    # micro-batch 1 x accumulation 1 x 4 data-parallel ranks x 2 TP ranks (DeepSpeed's count)
    assert config["tensor_parallel"] == {"autotp_size": 2} and config["train_batch_size"] == 1 * 1 * 4 * 2
    assert [p.field for p in zero_problems(full, 3)] == ["deepspeed"]
    assert [p.field for p in zero_problems(full, 2, offload=True)] == ["deepspeed"]
    assert zero_problems(full, 2) == [] and zero_problems(spec(deepspeed="zero3"), 3) == []


def test_what_tp_does_not_compose_with_is_refused_by_name():
    fields = lambda **kw: sorted(p.field for p in unsupported(spec(tensor_model_parallel_size=2, **kw)))  # noqa: E731
    assert fields() == []
    assert fields(fsdp="full_shard", train_type="full") == []
    # peft's TP-LoRA fails under transformers' FSDP2 (capabilities._tp_problems says how).
    assert fields(fsdp="full_shard", train_type="lora") == ["fsdp"]
    assert fields(deepspeed="zero2", train_type="full") == []  # DeepSpeed's AutoTP
    assert fields(deepspeed="zero2", train_type="lora") == ["deepspeed"]
    assert fields(fsdp="shard_grad_op") == ["fsdp"]
    assert fields(torch_compile=True, use_liger_kernel=True) == ["torch_compile", "use_liger_kernel"]
    assert fields(torch_dtype="float16") == ["torch_dtype"]




def assert_same_curve(a, b, rel=2e-4):
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=rel), (step, a[step], b[step])
    assert a[STEPS] < a[1] - 0.05, a  # it learned something


@pytest.mark.e2e
@pytest.mark.parametrize("family,train_type,engine", [("llama", "full", {}), ("mistral", "lora", {}),
                                                      ("qwen2", "full", {"deepspeed": "zero1"})],
                         ids=["llama-full", "mistral-lora", "qwen2-autotp-zero1"])
def test_tp2_trains_resumes_and_exports_like_one_rank(tmp_path, tiny_model, tiny_families, family, train_type, engine):
    """transformers' TP (full, LoRA), and DeepSpeed's AutoTP where the job uses DeepSpeed. AutoTP's
    batch check counts the TP ranks as data-parallel (backend.job.dsconfig.batch_fields): were that
    fixed in DeepSpeed, the AutoTP run would fail at start. Each on another model family's TP plan."""
    model = tiny_model if family == "qwen2" else tiny_families[family]
    spec_fields = equality_job(model, train_type=train_type, **engine)
    plain, tp = trained_together(tmp_path, ("plain", 1, spec_fields),
                                 ("tp", 2, {**spec_fields, "tensor_model_parallel_size": 2}))
    assert_same_curve(losses(tp), losses(plain))
    # Gradients: the global norm before clipping, every step.
    norms = {e["step"]: e["grad_norm"] for e in events(tp, 0, "train")}
    for e in events(plain, 0, "train"):
        assert norms[e["step"]] == pytest.approx(e["grad_norm"], rel=1e-3), e["step"]
    # Tokens and sequences are counted once, not once per TP rank (a window is one step here).
    per_step = lambda run: sorted(e["tokens_per_s"] * e["step_time_s"] for e in events(run, 0, "train"))[STEPS // 2]  # noqa: E731
    assert per_step(tp) == pytest.approx(per_step(plain), rel=0.4)
    assert "data: 256 sequences over 1 data-parallel ranks" in (tp / "logs" / "local.log").read_text()
    start, = events(tp, 0, "start")
    assert start["world_size"] == 2
    assert_timing_from_every_rank(tp, 2, range(1, STEPS + 1))

    # Resume the TP run from its step-10 checkpoint: steps 11..20 again, the same losses.
    # DCP reshards: a full TP2 checkpoint resumes on one rank without TP, the same losses again.
    # (LoRA without TP runs on torch's DDP, whose checkpoints are another format: refused by name.)
    onto_one = [(write_run(tmp_path / "onto-one", **spec_fields), 1)] if train_type == "full" and not engine else []
    assert_resumes_the_same(tp, write_run(tmp_path / "resumed", **spec_fields, tensor_model_parallel_size=2), 2, 10,
                            STEPS, *onto_one)

    assert_same_export(tp, plain, tmp_path)


@pytest.mark.e2e
def test_autotp2_by_dp2_on_four_ranks_matches_data_parallel(tmp_path, tiny_model):
    spec_fields = equality_job(tiny_model, train_type="full", deepspeed="zero2", max_steps=8)
    dp = trained(tmp_path, "dp", 2, **spec_fields)
    both = trained(tmp_path, "autotp-dp", 4, **spec_fields, tensor_model_parallel_size=2)
    a, b = losses(both), losses(dp)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=2e-4), (step, a[step], b[step])


@pytest.fixture(scope="module")
def untied_model(tiny_model, tmp_path_factory):
    """The tiny model with its output layer untied from the embedding (a copy of the same values)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("untied")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(out)
    return out


@pytest.mark.e2e
def test_tp2_with_fsdp2_on_four_ranks_matches_data_parallel(tmp_path, tiny_families):
    """TP2 x FSDP2 (4 ranks) against 2-rank data parallel: the same global batch per step (Qwen3,
    untied)."""
    spec_fields = equality_job(tiny_families["qwen3"], train_type="full", split_dataset_ratio=0.1)
    dp = trained(tmp_path, "dp", 2, **spec_fields)
    both = trained(tmp_path, "tp-fsdp", 4, **spec_fields, tensor_model_parallel_size=2, fsdp="full_shard")
    assert_same_curve(losses(both), losses(dp))
    assert_same_eval(both, dp, [10, 20], rel=1e-3)  # every save_steps and at the end
    # Qwen3's per-head q_norm and k_norm too (launcher.engines.tp.ALL_REDUCE_HOOK): the loss barely shows them.
    assert_same_export(both, dp, tmp_path)


def test_tied_embeddings_under_tp_and_fsdp_are_refused_where_the_vocabulary_does_not_divide():
    from dataclasses import replace

    from backend.job.cluster import parse_hostfile_text
    from backend.job.modelcfg import find_model_config
    from backend.job.validate import validate

    tied = find_model_config("qwen2.5-0.5b")  # ties its embeddings; 151936 = 4 x 37984
    cluster = parse_hostfile_text("n0 slots=4\n")

    def fsdp_problems(model, **fields):
        job = spec(model="Qwen/Qwen2.5-0.5B", train_type="full", nproc_per_node=4, tensor_model_parallel_size=2, **fields)
        return [p.message for p in validate(job, cluster, model) if p.field == "fsdp"]

    assert fsdp_problems(tied, fsdp="full_shard") == []
    odd = replace(tied, vocab_size=151937)
    assert fsdp_problems(odd, fsdp="full_shard") == [
        "full_shard with tensor_model_parallel_size > 1 trains a model with tied embeddings and a vocabulary of "
        "151937 (not divisible by TP x FSDP = 4 ranks) wrongly in transformers' TP x FSDP2 (the updates differ from "
        "the same job without TP); leave fsdp empty (TP with replicated data parallel), or pick a layout whose TP x "
        "FSDP divides 151937"]
    assert fsdp_problems(odd) == []  # TP with replicated data parallel


@pytest.fixture(scope="module")
def odd_vocab_model(tmp_path_factory):
    """The tiny model's shape with tied embeddings and a vocabulary of 303, which 4 ranks do not divide."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from worker import TINY

    out = tmp_path_factory.mktemp("odd-vocab")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=303, tie_word_embeddings=True, eos_token_id=2, pad_token_id=0, bos_token_id=None,
                         **TINY)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


@pytest.mark.e2e
def test_transformers_tp_fsdp_updates_tied_embeddings_wrongly(tmp_path, tiny_model, untied_model, odd_vocab_model):
    """Pins the engine bug behind the refusal above (transformers 5.24): the same two AdamW steps
    on TP2 x FSDP2 (4 ranks) and on one process end apart for the tied model whose vocabulary (303)
    4 ranks do not divide, together for the tied one whose vocabulary (384) they do and for an
    untied one. When the first stops failing, transformers has fixed it: lift the refusal."""
    script = tmp_path / "steps.py"
    script.write_text('''
import sys, torch, torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig
dist.init_process_group("gloo")
ids = torch.arange(3, 35).reshape(2, 16)
def trained(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model(input_ids=ids, labels=ids).loss.item()
for path in sys.argv[1:]:
    sharded = trained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                           distributed_config=DistributedConfig(tp_size=2, fsdp_size=2)))
    if dist.get_rank() == 0:
        plain = trained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
        print("LOSSES", sharded, plain, flush=True)
''')
    proc = run_worker(tmp_path, argv=torchrun(4, str(script), str(odd_vocab_model), str(tiny_model), str(untied_model)))
    # (found anywhere in a line: a rank's print can follow another's progress bar)
    odd, even, untied = [tuple(map(float, pair)) for pair in re.findall(r"LOSSES (\S+) (\S+)", proc.log)]
    assert abs(odd[0] - odd[1]) > 1e-2, odd
    assert even[0] == pytest.approx(even[1], rel=1e-5), even
    assert untied[0] == pytest.approx(untied[1], rel=1e-5), untied


@pytest.mark.e2e
def test_peft_tp_lora_needs_the_workarounds(tmp_path, tiny_model):
    """Pins the peft 0.21 / transformers 5 behaviour launcher.model.init_lora works around: without
    it a rowwise layer's lora_A keeps the local width, and TP2 LoRA fails in the first forward."""
    script = tmp_path / "probe.py"
    script.write_text(f'''
import torch, torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig
from peft import LoraConfig, get_peft_model
dist.init_process_group("gloo")
model = AutoModelForCausalLM.from_pretrained({str(tiny_model)!r}, dtype=torch.float32,
                                             distributed_config=DistributedConfig(tp_size=2))
model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
o_proj = model.base_model.model.model.layers[0].self_attn.o_proj
assert o_proj.lora_A["default"].in_features == o_proj.base_layer.in_features // 2, "peft fixed it: drop the workaround"
ids = torch.arange(3, 19).reshape(1, 16)
try:
    model(input_ids=ids)
except RuntimeError as exc:
    assert "invalid for input of size" in str(exc)
    print("FAILS AS PINNED")
''')
    proc = run_worker(tmp_path, argv=torchrun(2, str(script)))
    assert "FAILS AS PINNED" in proc.log, proc.log[-3000:]


@pytest.mark.e2e
def test_transformers_sums_partial_norm_gradients_again_on_every_micro_batch(tmp_path, tiny_families):
    """Pins the transformers 5.24 behaviour launcher.engines.tp works around: under TP, Qwen3's
    q_norm gradient is summed over the TP ranks after every backward, so with two micro-batches the
    first one's sum is summed again; one backward is right. When this fails, transformers has fixed
    it: drop ALL_REDUCE_HOOK's workaround."""
    script = tmp_path / "grads.py"
    script.write_text('''
import sys, torch, torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig
dist.init_process_group("gloo")
batches = [torch.arange(3, 35).reshape(2, 16), torch.arange(40, 72).reshape(2, 16)]
def q_norm_grad(model, micro):
    for ids in batches[:micro]:
        model(input_ids=ids, labels=ids).loss.backward()
    return model.model.layers[0].self_attn.q_norm.weight.grad.clone()
for micro in (1, 2):
    tp = q_norm_grad(AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32,
                                                          distributed_config=DistributedConfig(tp_size=2)), micro)
    plain = q_norm_grad(AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32), micro)
    if dist.get_rank() == 0:
        print("GRADS", micro, torch.allclose(tp, plain, rtol=1e-4, atol=1e-6), flush=True)
''')
    proc = run_worker(tmp_path, argv=torchrun(2, str(script), str(tiny_families["qwen3"])))
    # A rank's line can follow another's progress bar on one line of the shared log.
    outcomes = [list(m) for m in re.findall(r"GRADS (\d) (True|False)", proc.log)]
    assert outcomes == [["1", "True"], ["2", "False"]], proc.log[-3000:]
