"""Expert parallel (transformers' EP over its FSDP2, with TP) on CPU with gloo, and what a MoE
model's routers report: the same job with and without EP trains, resumes and exports the same
model; the routing series and the imbalance alert."""
from __future__ import annotations


import pytest
import torch

from backend.job.capabilities import TransformersPlan, transformers_plan, unsupported, world_problems
from backend.job.spec import JobSpec, parse_spec
from worker import (EQUALITY_STEPS, assert_resumes_the_same, assert_same_export, build_tiny_model, equality_job,
                    events, losses, probe_ranks, trained, trained_together, write_run)

STEPS = EQUALITY_STEPS
EP = "expert_model_parallel_size"
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def spec(**over) -> JobSpec:
    return JobSpec(**{"model": "m", "dataset": ["d"], **over})


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """A 2-layer Qwen3-MoE of 4 experts, 2 per token, every layer sparse (untied embeddings)."""
    return build_tiny_model(tmp_path_factory.mktemp("moe"), "qwen3_moe", num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[])


def test_the_plan_spreads_the_experts_over_the_fsdp_ranks():
    assert transformers_plan(spec(expert_model_parallel_size=2, fsdp="full_shard"), 2) == TransformersPlan(
        tp=1, fsdp=2, replicate=1, ep=2)
    assert transformers_plan(spec(expert_model_parallel_size=4, tensor_model_parallel_size=2, fsdp="full_shard"),
                             4) == TransformersPlan(tp=2, fsdp=2, replicate=1, ep=4)
    assert transformers_plan(spec(expert_model_parallel_size=2, deepspeed="zero2"), 2) is None


def test_what_ep_does_not_compose_with_is_refused_by_name():
    fields = lambda **kw: sorted(p.field for p in unsupported(spec(**{EP: 2, "train_type": "full", **kw})))  # noqa: E731
    assert fields(fsdp="full_shard") == []
    assert fields(fsdp="full_shard", tensor_model_parallel_size=2) == []
    assert fields() == ["fsdp"]  # the experts are spread over FSDP2's ranks
    assert fields(tensor_model_parallel_size=2) == ["fsdp"]  # EP = TP alone: not tested
    assert fields(fsdp="full_shard offload") == ["fsdp"]
    assert fields(deepspeed="zero2") == ["deepspeed"]
    assert fields(fsdp="full_shard", tensor_model_parallel_size=4) == [EP]  # EP a multiple of TP
    assert fields(fsdp="full_shard", torch_compile=True, use_liger_kernel=True) == ["torch_compile", "use_liger_kernel"]
    assert EP in fields(fsdp="full_shard", sequence_parallel_size=2)
    assert EP in fields(fsdp="full_shard", context_parallel_size=2)
    assert [p.field for p in world_problems(spec(**{EP: 4}, fsdp="full_shard"), 6)] == [EP]
    assert "expert_tensor_parallel_size" in [p.field for p in unsupported(spec(expert_tensor_parallel_size=2))]


def test_the_model_rules_name_the_experts_and_the_lora_targets(moe_model, tiny_model):
    from backend.job.cluster import parse_hostfile_text
    from backend.job.modelcfg import find_model_config
    from backend.job.validate import validate

    cluster = parse_hostfile_text("n0 slots=4 device=cpu\n")
    moe, dense = find_model_config(str(moe_model)), find_model_config(str(tiny_model))

    def problems(model, config, **kw):
        job = spec(model=str(model), nproc_per_node=4, fsdp="full_shard", lora_dropout=0.0, **kw)
        return {p.field: p.message for p in validate(job, cluster, config) if p.severity == "error"}

    assert problems(moe_model, moe, **{EP: 2}, target_modules=ATTENTION) == {}
    assert problems(moe_model, moe, **{EP: 4}, train_type="full") == {}
    assert "dense" in problems(tiny_model, dense, **{EP: 2}, train_type="full")[EP]
    eight = parse_hostfile_text("n0 slots=8 device=cpu\n")
    refused = [p.message for p in validate(spec(model=str(moe_model), nproc_per_node=8, fsdp="full_shard",
                                                train_type="full", **{EP: 8}), eight, moe) if p.field == EP]
    assert refused == ["the model's 4 experts are not divisible by EP=8"]
    # 'all-linear' reaches the router and the stacked experts, which peft wraps in a way EP cannot run.
    assert "q_proj k_proj v_proj o_proj" in problems(moe_model, moe, **{EP: 2})["target_modules"]


def test_the_worker_refuses_lora_on_the_experts_where_it_was_not_validated(moe_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from launcher.config import ConfigError
    from launcher.engines.tp import _refuse_lora_on_experts

    job = spec(model=str(moe_model), **{EP: 2}, fsdp="full_shard", lora_dropout=0.0)
    wrapped = get_peft_model(AutoModelForCausalLM.from_pretrained(moe_model),
                             LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    with pytest.raises(ConfigError, match="target_modules: LoRA on the router and the experts"):
        _refuse_lora_on_experts(wrapped, job)
    attention = get_peft_model(AutoModelForCausalLM.from_pretrained(moe_model),
                               LoraConfig(r=4, target_modules=ATTENTION, lora_dropout=0.0))
    _refuse_lora_on_experts(attention, job)


def test_ms_swift_spelling_of_the_aux_loss_weight():
    parsed, problems = parse_spec({"model": "m", "dataset": ["d"], "moe_aux_loss_coeff": 0.01})
    assert problems == [] and parsed.router_aux_loss_coef == 0.01
    assert parse_spec({"model": "m", "dataset": ["d"], "router_aux_loss_coef": -1})[0] is None


def test_the_router_meter_counts_every_routed_token_and_gives_the_models_aux_loss(moe_model):
    from transformers import AutoModelForCausalLM

    from launcher.moe import RouterMeter

    model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32)
    meter = RouterMeter(model)
    ids = torch.arange(3, 35).reshape(2, 16)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0  # padding is not routed work
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids)
    meter.start(batch)
    out = model(**batch, output_router_logits=True)
    out.loss.backward()  # a backward (and any recompute) adds nothing
    meter.finish()

    class OneRank:
        same_data_ranks = 1

        def all_reduce(self, values, op):
            return values, 0.0

    load = meter.take(OneRank())
    layers, top_k = 2, 2
    assert sum(load.expert_tokens) == int(mask.sum()) * top_k * layers
    assert load.aux_loss == pytest.approx(float(out.aux_loss), rel=1e-5)
    assert 1 / 4 <= load.max_expert_share <= 1
    assert meter.take(OneRank()) is None  # a new window: nothing routed yet


def test_a_router_collapsing_onto_one_expert_raises_an_alert():
    from backend.telemetry.alerts import AlertConfig, Window, expert_imbalance

    def window(*counts):
        return Window(now=100.0, running=True, train=[{"step": i + 1, "time": float(i), "moe_expert_tokens": list(c)}
                                                       for i, c in enumerate(counts)])

    even, collapsed = (25, 25, 25, 25), (85, 5, 5, 5)
    assert expert_imbalance(window(even, collapsed, collapsed, collapsed), AlertConfig()) != []
    finding, = expert_imbalance(window(collapsed, collapsed, collapsed), AlertConfig())
    assert finding.key == "expert_imbalance:0" and "expert 0 took 85%" in finding.message
    assert "router_aux_loss_coef" in finding.message
    assert expert_imbalance(window(collapsed, collapsed), AlertConfig()) == []  # too few windows
    assert expert_imbalance(window(collapsed, (5, 85, 5, 5), collapsed), AlertConfig()) == []  # not one expert
    assert expert_imbalance(window(*[(60, 20, 10, 10)] * 3), AlertConfig()) == []  # 2.4x an even share
    assert expert_imbalance(window(), AlertConfig()) == []


def test_the_monitor_draws_the_experts_only_for_a_moe_run():
    from studio.charts import NO_INDEX, STEP_SERIES, SeriesBuffer, experts_figure

    buf = SeriesBuffer()
    buf.points = {(STEP_SERIES, "n0", NO_INDEX, 0): [(1.0, 1.0), (2.0, 2.0)],
                  ("train/loss", "n0", NO_INDEX, 0): [(1.0, 5.0), (2.0, 4.0)]}
    assert experts_figure(buf) is None
    for expert, counts in enumerate(((30, 10), (10, 30))):
        buf.points[("train/moe_expert_tokens", "n0", expert, 0)] = [(1.0, counts[0]), (2.0, counts[1])]
    buf.points[("train/moe_aux_loss", "n0", NO_INDEX, 0)] = [(1.0, 1.1), (2.0, 1.05)]
    fig = experts_figure(buf)
    shares = {trace.name: list(trace.y) for trace in fig.data}
    assert shares["expert 0"] == [75.0, 25.0] and shares["expert 1"] == [25.0, 75.0]
    assert list(shares["load-balancing loss"]) == [1.1, 1.05]




def assert_same_training(a, b, steps=STEPS):
    """Losses, grad norms and the routing of every step equal (the same tokens go to the same experts)."""
    la, lb = losses(a), losses(b)
    assert sorted(la) == sorted(lb) == list(range(1, steps + 1))
    for step in la:
        assert la[step] == pytest.approx(lb[step], rel=2e-4), (step, la[step], lb[step])
    assert la[steps] < la[1] - 0.05, la  # it learned something
    ea, eb = events(a, 0, "train"), events(b, 0, "train")
    for x, y in zip(ea, eb):
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-3), x["step"]
        assert x["moe_aux_loss"] == pytest.approx(y["moe_aux_loss"], rel=1e-3), x["step"]
        assert x["moe_expert_tokens"] == y["moe_expert_tokens"], x["step"]


@pytest.mark.e2e
@pytest.mark.parametrize("train_type", ["full", "lora"])
def test_ep2_by_fsdp2_trains_resumes_and_exports_like_fsdp2(tmp_path, moe_model, train_type):
    """EP=2 over FSDP2's 2 ranks (each holds 2 of the 4 experts) against the same 2 ranks without EP;
    the load-balancing loss is in the training loss (router_aux_loss_coef 0.01). LoRA on attention."""
    targets = {"target_modules": ATTENTION} if train_type == "lora" else {}
    spec_fields = equality_job(moe_model, router_aux_loss_coef=0.01, train_type=train_type, fsdp="full_shard", **targets)
    plain, ep = trained_together(tmp_path, ("plain", 2, spec_fields), ("ep", 2, {**spec_fields, EP: 2}))
    assert_same_training(ep, plain)
    assert "expert parallel: EP=2, rank 0 holds the weights of 2 of the 4 experts" in (ep / "logs" / "local.log").read_text()
    train = events(ep, 0, "train")[-1]
    assert len(train["moe_expert_tokens"]) == 4 and 0.25 <= train["moe_max_expert_share"] <= 1

    # Resume the EP run from its step-10 checkpoint: steps 11..20 again, the same losses; and, since
    # DCP reshards, a full checkpoint on the same ranks without EP.
    without_ep = [(write_run(tmp_path / "without-ep", **spec_fields), 2)] if train_type == "full" else []
    assert_resumes_the_same(ep, write_run(tmp_path / "resumed", **spec_fields, **{EP: 2}), 2, 10, STEPS, *without_ep)
    assert_same_export(ep, plain, tmp_path)


@pytest.mark.e2e
def test_ep4_by_tp2_by_fsdp2_on_four_ranks_matches_data_parallel(tmp_path, moe_model):
    """TP2 x FSDP2 with EP=4 (each rank one whole expert) against 2-rank data parallel: the same
    global batch per step; its checkpoint resumes with the same losses."""
    spec_fields = equality_job(moe_model, router_aux_loss_coef=0.01, train_type="full", fsdp="full_shard")
    layout = {"tensor_model_parallel_size": 2, EP: 4}
    dp = trained(tmp_path, "dp", 2, **spec_fields)
    both = trained(tmp_path, "ep-tp", 4, **spec_fields, **layout)
    assert_same_training(both, dp, steps=STEPS)
    assert_resumes_the_same(both, write_run(tmp_path / "resumed", **spec_fields, **layout), 4, 10, STEPS)
    assert_same_export(both, dp, tmp_path)


@pytest.mark.e2e
def test_peft_lora_on_the_experts_fails_under_transformers_ep(tmp_path, moe_model):
    """Pins the engine behaviour behind the target_modules refusal (peft 0.21, transformers 5.24):
    LoRA with 'all-linear' (the router and the stacked experts) fails in the first step under EP.
    When this fails, they compose: lift the refusal."""
    outcomes, log = probe_ranks(tmp_path, 2, '''
import sys, torch, torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig
dist.init_process_group("gloo")
model = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32,
                                             distributed_config=DistributedConfig(fsdp_size=2, ep_size=2))
model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
ids = torch.arange(3, 35).reshape(2, 16)
try:
    model(input_ids=ids, labels=ids).loss.backward()
    report("RAN")
except Exception as exc:
    report(f"FAILED {type(exc).__name__}")
''', moe_model)
    assert len(outcomes) == 2 and all(o.startswith("FAILED") for o in outcomes), (outcomes, log[-3000:])


def test_mfu_counts_the_experts_a_token_passes_and_reads_configs_without_head_dim():
    """Mixtral's config holds head_dim None (which crashed the worker's FLOPs count); a token runs
    2 of its 4 experts: attention, 2 experts, the router and norms per layer, the head once."""
    from transformers import AutoConfig

    from launcher.model import matmul_params

    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=100)
    mixtral = AutoConfig.for_model("mixtral", num_local_experts=4, num_experts_per_tok=2, **sizes)
    assert mixtral.head_dim is None
    attention = 64 * 64 * 2 + 64 * 32 * 2
    per_layer = attention + 2 * 3 * 64 * 128 + 64 * 4 + 2 * 64
    assert matmul_params(mixtral) == 2 * per_layer + 64 + 64 * 100
    mistral = AutoConfig.for_model("mistral", head_dim=None, **sizes)
    assert matmul_params(mistral) == 2 * (attention + 3 * 64 * 128) + 64 * 100


def test_the_memory_estimate_gathers_only_the_ranks_experts():
    """Qwen3-30B-A3B (128 experts) on 8 ranks, FSDP2: stored states are 1/8 with or without EP; what
    FSDP gathers for a layer holds 128/EP experts."""
    from backend.job.layout import compute_layout
    from backend.job.memory import estimate_memory
    from backend.job.modelcfg import find_model_config

    model = find_model_config("Qwen/Qwen3-30B-A3B")
    assert model is not None and model.num_experts == 128

    def estimate(ep):
        job = spec(model="Qwen/Qwen3-30B-A3B", train_type="full", torch_dtype="bfloat16", fsdp="full_shard",
                   nproc_per_node=8, **{EP: ep})
        return estimate_memory(job, model, compute_layout(job))

    plain, ep8 = estimate(1), estimate(8)
    assert ep8.optimizer_gib == pytest.approx(plain.optimizer_gib) and ep8.gradients_gib == pytest.approx(plain.gradients_gib)
    experts = model.routed_expert_params()
    gathered_saving = 2 * 2 * experts * (1 - 1 / 8) / 2 ** 30  # two layers in flight, bf16
    assert plain.parameters_gib - ep8.parameters_gib == pytest.approx(gathered_saving, rel=1e-6)
    assert any("EP=8: each rank runs 16 of the 128 experts" in note for note in ep8.notes)


@pytest.mark.e2e
@pytest.mark.parametrize("family,sizes", [
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                   "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1, "mlp_only_layers": []})])
def test_ep2_trains_and_exports_other_moe_families_like_fsdp2(tmp_path, family, sizes):
    """Mixtral and Qwen2-MoE (a shared expert beside the routed ones) under EP=2 x FSDP2: losses,
    grad norms and routing of 20 steps, and the exported model, equal to FSDP2 without EP."""
    model = build_tiny_model(tmp_path / "model", family, **sizes)
    spec_fields = equality_job(model, router_aux_loss_coef=0.01, train_type="full", fsdp="full_shard")
    plain, ep = trained_together(tmp_path, ("plain", 2, spec_fields), ("ep", 2, {**spec_fields, EP: 2}))
    assert_same_training(ep, plain)
    assert_same_export(ep, plain, tmp_path)
