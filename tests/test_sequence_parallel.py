"""Ulysses sequence parallel (DeepSpeed's ALST for HF models) on CPU with gloo: the same job with and
without SP trains the same (losses and gradient norms), resumes the same and exports the same model."""
from __future__ import annotations

import shutil

import pytest

from backend.job.capabilities import same_data_ranks, unsupported
from backend.job.spec import JobSpec
from launcher.data import Row, collate
from worker import (ROOT, assert_same_eval, assert_same_export, assert_timing_from_every_rank, events,
                    losses, run_ok, run_worker, trained_together, write_run)

DATA = str(ROOT / "assets" / "demo" / "train.jsonl") + "#128"
STEPS = 20


def spec(**over) -> JobSpec:
    return JobSpec(**{"model": "m", "dataset": ["d"], **over})


def test_what_sp_does_not_compose_with_is_refused_by_name():
    fields = lambda **kw: sorted(p.field for p in unsupported(spec(sequence_parallel_size=2, **kw)))  # noqa: E731
    assert fields(deepspeed="zero3") == []
    assert fields(deepspeed="zero1", train_type="lora") == []
    assert fields() == ["deepspeed"]
    assert fields(deepspeed="zero2", fsdp="full_shard") == ["fsdp"]
    assert fields(deepspeed="zero2", tensor_model_parallel_size=2) == ["deepspeed", "sequence_parallel_size"]
    assert fields(deepspeed="zero2", attn_impl="eager") == ["attn_impl"]
    # Ulysses drops the mask: packed samples stay apart only where flash-attention reads the positions.
    assert fields(deepspeed="zero2", packing=True) == ["packing"]
    assert fields(deepspeed="zero2", packing=True, attn_impl="flash_attention_2") == []
    assert fields(deepspeed="zero2", torch_compile=True, use_liger_kernel=True) == ["torch_compile", "use_liger_kernel"]
    # Evaluation keeps Ulysses' one micro-batch size (a short last eval micro-batch is filled up).
    assert fields(deepspeed="zero2", split_dataset_ratio=0.1, per_device_eval_batch_size=3) == ["per_device_eval_batch_size"]
    assert fields(deepspeed="zero2", split_dataset_ratio=0.1, per_device_eval_batch_size=1) == []


def test_an_sp_group_reads_one_data_shard():
    assert same_data_ranks(spec(sequence_parallel_size=4)) == 4
    assert same_data_ranks(spec(tensor_model_parallel_size=2)) == 2
    assert same_data_ranks(spec()) == 1


def test_rows_are_padded_to_split_evenly_over_the_group():
    rows = [Row([5, 6, 7], [-100, 6, 7], [0, 1, 2], 1), Row([5, 6, 7, 8, 9], [-100, 6, 7, 8, 9], [0, 1, 2, 3, 4], 1)]
    batch = collate(rows, pad_id=0, packed=False, multiple=4)
    assert batch["input_ids"].shape == (2, 8)
    assert batch["labels"][0].tolist() == [-100, 6, 7] + [-100] * 5
    assert collate(rows, pad_id=0, packed=False)["input_ids"].shape == (2, 5)


def job(model, **extra) -> dict:
    base = dict(model=str(model), dataset=[DATA], max_length=64, per_device_train_batch_size=2,
                gradient_accumulation_steps=2, learning_rate=2e-3, max_steps=STEPS, logging_steps=1, save_steps=10,
                gradient_checkpointing=False, warmup_ratio=0.1, torch_dtype="float32", lora_dropout=0.0,
                attn_impl="sdpa")
    return {**base, **extra}


def trained(run, nproc, resume=None, **spec_fields):
    if resume is None:
        write_run(run, **spec_fields)
    run_ok(run, nproc=nproc, resume=resume, timeout=400)
    return run


def assert_same_training(sp_run, plain_run, steps=range(1, STEPS + 1)):
    """Losses and gradient norms (before clipping) of every step, within fp32 noise."""
    a = {e["step"]: e for e in events(sp_run, 0, "train")}
    b = {e["step"]: e for e in events(plain_run, 0, "train")}
    assert sorted(a) == sorted(b) == list(steps)
    for step in a:
        for key in ("loss", "grad_norm"):
            assert a[step][key] == pytest.approx(b[step][key], rel=2e-4), (step, key, a[step][key], b[step][key])


@pytest.mark.e2e
def test_sp2_zero3_trains_resumes_and_exports_like_one_rank(tmp_path, tiny_model):
    """SP=2 on 2 ranks is one data-parallel rank: the same batches as one process. ZeRO-3 is where
    DeepSpeed averages (not sums) the SP group's gradients, which the engine corrects."""
    spec_fields = job(tiny_model, deepspeed="zero3")
    plain, sp = trained_together(tmp_path, ("plain", 1, spec_fields), ("sp", 2, {**spec_fields, "sequence_parallel_size": 2}))
    assert_same_training(sp, plain)
    assert losses(sp)[STEPS] < losses(sp)[1] - 0.05  # it learned something
    # Tokens and sequences count once per SP group, not once per rank.
    per_step = lambda run: sorted(e["samples_per_s"] * e["step_time_s"] for e in events(run, 0, "train"))[STEPS // 2]  # noqa: E731
    assert per_step(sp) == pytest.approx(per_step(plain), rel=0.05)
    assert "data: 128 sequences over 1 data-parallel ranks" in (sp / "logs" / "local.log").read_text()
    assert_timing_from_every_rank(sp, 2, range(1, STEPS + 1))

    # Resume the SP run from its step-10 checkpoint: steps 11..20 again, the same losses.
    resumed = write_run(tmp_path / "resumed", **spec_fields, sequence_parallel_size=2)
    shutil.copytree(sp / "checkpoint-10", resumed / "checkpoint-10")
    trained(resumed, 2, resume="latest")
    again = losses(resumed)
    assert sorted(again) == list(range(11, STEPS + 1))
    for step, value in again.items():
        assert value == pytest.approx(losses(sp)[step], rel=2e-4), step

    # DeepSpeed cannot move ZeRO state onto another SP layout: refused by name, nothing trained.
    other = write_run(tmp_path / "other", **spec_fields)
    shutil.copytree(sp / "checkpoint-10", other / "checkpoint-10")
    proc = run_worker(other, nproc=2, resume="latest", timeout=400)
    assert proc.returncode == 1
    assert "'sequence_parallel_size': 2" in proc.log and "resume with the layout it was written with" in proc.log

    assert_same_export(sp, plain, tmp_path)


@pytest.mark.e2e
def test_sp2_lora_zero2_matches_one_rank(tmp_path, tiny_model):
    """Below ZeRO-3 DeepSpeed sums the SP group's gradients: each rank's loss is its share."""
    spec_fields = job(tiny_model, deepspeed="zero2", train_type="lora", max_steps=8, split_dataset_ratio=0.09,
                      eval_steps=4)
    plain, sp = trained_together(tmp_path, ("plain", 1, spec_fields), ("sp", 2, {**spec_fields, "sequence_parallel_size": 2}))
    assert_same_training(sp, plain, steps=range(1, 9))
    # Evaluation too: the SP group's loss over the 23 held-out rows (the last micro-batch of 2 filled up).
    assert_same_eval(sp, plain, [4, 8])


@pytest.mark.e2e
def test_sp2_by_dp2_on_four_ranks_matches_data_parallel(tmp_path, tiny_model):
    """Four ranks as two SP groups: two data shards, the same global batch as two-rank DP."""
    spec_fields = job(tiny_model, deepspeed="zero1", max_steps=8)
    dp = trained(tmp_path / "dp", 2, **spec_fields)
    both = trained(tmp_path / "sp-dp", 4, **spec_fields, sequence_parallel_size=2)
    assert_same_training(both, dp, steps=range(1, 9))


def test_a_slice_groups_share_holds_the_balancing_term_once():
    """Ulysses SP and ring CP (GPU only) both take each rank's loss through `group_share`: the
    group's shares add up to the slices' mean balancing term, counted once, at the model's weight
    (none where transformers does not add the term)."""
    from types import SimpleNamespace

    import torch

    from launcher.moe import balancing_weight, group_share

    out = SimpleNamespace(loss=torch.tensor(3.1), aux_loss=torch.tensor(2.0))  # 0.1 x 2.0 of it the term
    assert float(group_share(out, 0.1, 2)) == pytest.approx(3.0)
    assert float(group_share(out, 0.1, 4)) == pytest.approx(2.95)
    assert float(group_share(out, 0.0, 2)) == pytest.approx(3.1)
    assert float(group_share(SimpleNamespace(loss=torch.tensor(3.1), aux_loss=None), 0.1, 2)) == pytest.approx(3.1)
    moe = SimpleNamespace(router_aux_loss_coef=0.1, config=SimpleNamespace(output_router_logits=True))
    assert balancing_weight(moe) == 0.1
    assert balancing_weight(SimpleNamespace(router_aux_loss_coef=0.1, config=SimpleNamespace())) == 0.0
    assert balancing_weight(SimpleNamespace(config=SimpleNamespace(output_router_logits=True))) == 0.0
    assert balancing_weight(torch.nn.Linear(2, 2)) == 0.0  # a module that is no transformers model


@pytest.mark.e2e
def test_sp2_counts_a_moe_routers_balancing_loss_once(tmp_path):
    """transformers adds router_aux_loss_coef x the routers' balancing loss of the tokens a forward
    saw: under SP each rank sees a slice, and the group's shares must hold it once (the mean of the
    slices'), not SP times. A balancing loss is a product of means over the tokens it sees, so the
    slices' mean is near the whole rows' (rel 1e-3 here, at a weight that makes it 2% of the loss)."""
    from worker import build_tiny_model

    moe = build_tiny_model(tmp_path / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[])
    spec_fields = job(moe, deepspeed="zero2", train_type="lora", max_steps=4, router_aux_loss_coef=0.1,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    plain, sp = trained_together(tmp_path, ("plain", 1, spec_fields), ("sp", 2, {**spec_fields, "sequence_parallel_size": 2}))
    a, b = ({e["step"]: e for e in events(run, 0, "train")} for run in (sp, plain))
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert a[step]["moe_aux_loss"] * 0.1 > 0.01 * b[step]["loss"]  # the term weighs in
        assert a[step]["loss"] == pytest.approx(b[step]["loss"], rel=1e-3), (step, a[step]["loss"], b[step]["loss"])
