"""Preference training (`rlhf_type: dpo`): pair records in every format read alike, encoded with the
loss on the answers only; the loss, rewards and gradients of TRL's DPOTrainer for each loss type
(LoRA with the adapters off as the reference, full with a frozen copy); a real two-rank run that
learns the preference, resumes with the same losses and exports."""
from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest

from backend.job.capabilities import unsupported
from backend.job.records import DataError, Persona, Record, to_pair
from backend.job.spec import JobSpec
from backend.job.validate import validate
from launcher.data import IGNORE, Pair, encode
from worker import ROOT, build_tiny_model, events, losses, planned, preference_pairs, run_workers, write_run

PROMPT = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "What is 2 + 2?"}]
FORMATS = {
    "ms-swift": {"messages": PROMPT + [{"role": "assistant", "content": "4"}], "rejected_response": "5"},
    "trl": {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": "4"}],
            "rejected": [{"role": "assistant", "content": "5"}]},
    "whole conversations": {"chosen": PROMPT + [{"role": "assistant", "content": "4"}],
                            "rejected": PROMPT + [{"role": "assistant", "content": "5"}]},
    "llama-factory sharegpt": {"system": "Be exact.", "conversations": [{"from": "human", "value": "What is 2 + 2?"}],
                               "chosen": {"from": "gpt", "value": "4"}, "rejected": {"from": "gpt", "value": "5"}},
    "llama-factory alpaca": {"system": "Be exact.", "instruction": "What is 2 + 2?", "chosen": "4", "rejected": "5"},
}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ROOT / "assets" / "demo" / "model")


@pytest.mark.parametrize("name", FORMATS)
def test_every_pair_format_reads_as_the_same_prompt_and_answers(name):
    assert to_pair(Record("p.jsonl:1", FORMATS[name])) == (PROMPT, "4", "5")


@pytest.mark.parametrize("record,message", [
    ({"messages": PROMPT + [{"role": "assistant", "content": "4"}]}, "not a preference pair"),
    ({"prompt": "q", "chosen": "4", "rejected": "4"}, "the chosen and rejected answers are the same"),
    ({"prompt": "q", "chosen": "4", "rejected": " "}, "the rejected answer is empty"),
    ({"messages": PROMPT, "rejected_response": "5"}, "no assistant message"),
    ({"messages": PROMPT + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "And?"}],
      "rejected_response": "5"}, "must end with the chosen assistant answer"),
    ({"chosen": PROMPT + [{"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "5"}]},
     "differ only in their last answer"),
    ({"prompt": "q", "chosen": 4, "rejected": "5"}, "'chosen' must be text, a message or a list"),
    ({"messages": PROMPT + [{"role": "assistant", "content": "4"}], "rejected_response": "5", "images": ["a.png"]},
     r"a multimodal record \('images'\)"),
])
def test_a_record_that_is_no_pair_is_named(record, message):
    with pytest.raises(DataError, match=f"p.jsonl:3: .*{message}"):
        to_pair(Record("p.jsonl:3", record))


def test_a_pair_is_encoded_with_the_loss_on_its_answers_only(tokenizer):
    persona = Persona(name=("Swifty",), pairs=True)
    record = Record("p.jsonl:1", {"prompt": "Who are you?", "chosen": "I am {{NAME}}.", "rejected": "I am a cat."})
    pair = encode(record, tokenizer, 64, persona)
    assert isinstance(pair, Pair)
    for sample, answer in ((pair.chosen, "I am Swifty."), (pair.rejected, "I am a cat.")):
        prompt = sample.labels.index(next(label for label in sample.labels if label != IGNORE))
        assert tokenizer.decode([t for t, label in zip(sample.input_ids, sample.labels) if label != IGNORE]) \
            .startswith(answer)
        assert set(sample.labels[:prompt]) == {IGNORE}
    assert pair.chosen.input_ids[:prompt] == pair.rejected.input_ids[:prompt]  # one prompt, rendered once
    assert encode(record, tokenizer, prompt, persona) is None  # truncation leaves no answer: dropped


def test_sequence_log_probs_keep_no_float32_copy_of_the_logits():
    """Autograd keeps the (bfloat16) logits only; the gradient is log_softmax's."""
    import torch

    from launcher.preference import sequence_logps

    torch.manual_seed(0)
    logits = torch.randn(4, 33, 500, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 500, (4, 33))
    labels[:, :10] = IGNORE
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logps, tokens = sequence_logps(logits, labels)
    assert not [t for t in saved if t.dtype == torch.float32 and t.numel() >= 32 * 500]
    logps.sum().backward()
    plain = logits.detach().float().requires_grad_()
    shifted = labels[:, 1:]
    picked = plain[:, :-1].log_softmax(-1).gather(-1, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    expected = (picked * (shifted != IGNORE)).sum(-1)
    expected.sum().backward()
    assert torch.allclose(logps, expected, rtol=1e-5) and tokens.tolist() == [23] * 4
    assert torch.allclose(logits.grad.float(), plain.grad, atol=1e-2)


def test_preference_jobs_refuse_what_they_do_not_run(tmp_path):
    problems: dict[str, str] = {}
    for p in validate(JobSpec(
        model="m", dataset=[str(ROOT / "assets" / "demo" / "train.jsonl")], rlhf_type="dpo", packing=True,
            use_liger_kernel=True, context_parallel_size=2, nproc_per_node=2)):
        problems[p.field] = problems.get(p.field, "") + p.message + "\n"
    assert "turn packing off" in problems["packing"]
    flat: dict[tuple[str, str], str] = {}
    for p in unsupported(JobSpec(model="m", dataset=["d"], rlhf_type="dpo", padding_free=True, packing=True,
                                 pipeline_model_parallel_size=2)):
        flat[p.field, p.severity] = flat.get((p.field, p.severity), "") + p.message + "\n"
    assert "packing already puts samples end to end" in flat["padding_free", "error"]
    assert "not with pipeline_model_parallel_size > 1: a pipeline's stages hand on activations of one fixed shape" in \
        flat["padding_free", "error"]
    assert "quadratic in the micro-batch's tokens" in flat["padding_free", "warning"]
    # adapters: LoRA's; ref_adapters: LoRA DPO's, through the precomputed pass
    adapters = {p.field: p.message for p in unsupported(JobSpec(model="m", dataset=["d"], rlhf_type="dpo",
                                                                train_type="full", adapters=["a"], ref_adapters=["a"]))}
    assert "trained on with train_type lora" in adapters["adapters"] and "only dpo with train_type lora" in \
        adapters["ref_adapters"]
    unprecomputed = {p.field: p.message for p in unsupported(JobSpec(model="m", dataset=["d"], rlhf_type="dpo",
                                                                     ref_adapters=["a"]))}
    assert "turn precompute_ref_log_probs on" in unprecomputed["ref_adapters"]
    # Liger is refused with CP only; under DPO its kernels run, not its fused loss (test_liger_under_dpo_...)
    assert problems["use_liger_kernel"].startswith("not with context_parallel_size > 1") and \
        problems["use_liger_kernel"].count("\n") == 1
    # ring CP: LoRA, a frozen copy (sharded by FSDP2 and run through the ring too) or precomputed
    for extra in ({}, {"train_type": "full"}, {"train_type": "full", "precompute_ref_log_probs": True}):
        assert unsupported(JobSpec(model="m", dataset=["d"], rlhf_type="dpo", fsdp="full_shard",
                                   context_parallel_size=2, **extra)) == [], extra
    # the demo's SFT records are no pairs: named by file:line before launch
    assert "not a preference pair" in problems["dataset[0]"]
    # ref_model: full DPO only (as ms-swift); found; with the model's vocabulary
    demo = ROOT / "assets" / "demo" / "model"
    config = json.loads((demo / "config.json").read_text())
    wider = tmp_path / "wider"
    wider.mkdir()
    (wider / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    dpo = dict(model=str(demo), dataset=[str(ROOT / "assets" / "demo" / "train.jsonl")], rlhf_type="dpo")
    refused = {field: [p.message for p in validate(JobSpec(**dpo, **extra)) if p.field == "ref_model"]
               for field, extra in (("lora", dict(ref_model=str(demo))),
                                    ("missing", dict(train_type="full", ref_model=str(tmp_path / "nowhere"))),
                                    ("wider", dict(train_type="full", ref_model=str(wider))),
                                    ("same", dict(train_type="full", ref_model=str(demo))))}
    assert "only dpo with train_type full takes a reference model" in refused["lora"][0]
    assert refused["missing"] == [f"directory not found: {tmp_path / 'nowhere'}"]
    no_weights, vocabulary = refused["wider"]  # a config alone: the weights are missing too
    assert no_weights == f"{wider}: no weights (model.safetensors, model.safetensors.index.json or pytorch_model.bin)"
    assert vocabulary.startswith(f"its vocabulary of {config['vocab_size'] + 64} tokens is not the model's "
                                 f"{config['vocab_size']}: ")
    assert refused["same"] == []
    sp_ref = {p.field: p.message for p in unsupported(JobSpec(**dpo, train_type="full", ref_model=str(demo),
                                                              deepspeed="zero3", sequence_parallel_size=2))}
    assert "not with sequence_parallel_size > 1: Ulysses is set up for the model's attention" in sp_ref["ref_model"]
    # DeepSpeed's AutoTP is not transformers' TP: refused for preference training
    autotp = {p.field: p.message for p in validate(JobSpec(**dpo, deepspeed="zero2", nproc_per_node=2,
                                                           tensor_model_parallel_size=2)) if p.severity == "error"}
    assert "DeepSpeed's AutoTP is not combined with rlhf_type dpo" in autotp["tensor_model_parallel_size"]
    # expert parallel: as tensor parallel, no frozen copy of the EP-sharded model (LoRA, or precomputed)
    ep = lambda **kw: {p.field: p.message for p in unsupported(JobSpec(**dpo, fsdp="full_shard",  # noqa: E731
                                                                          expert_model_parallel_size=2, **kw))}
    assert ep() == {} and ep(train_type="full", precompute_ref_log_probs=True) == {}
    assert "expert parallel with full-parameter DPO takes the reference from precompute_ref_log_probs" in \
        ep(train_type="full")["expert_model_parallel_size"]
    # a supervised job names the preference-only fields it ignores
    sft = {p.field: p.message for p in validate(JobSpec(**{**dpo, "rlhf_type": None}, train_type="full",
                                                        ref_model=str(demo), precompute_ref_log_probs=True))}
    assert sft["ref_model"].startswith("ignored: only preference training") and "precompute_ref_log_probs" in sft
    # settings an algorithm does not use are warned, not silently dropped
    warned = {p.field: p.message for p in validate(JobSpec(
        model="m", dataset=["p.jsonl"], rlhf_type="orpo", loss_type="hinge", label_smoothing=0.1, cpo_alpha=0.5,
        precompute_ref_log_probs=True)) if p.severity == "warning"}
    assert {"loss_type", "label_smoothing", "cpo_alpha", "precompute_ref_log_probs"} <= set(warned)
    assert "orpo's loss is the chosen answers' NLL" in warned["cpo_alpha"] and "no reference" in \
        warned["precompute_ref_log_probs"]


# The batch the TRL comparisons train on: four conversational pairs, rejected answers of two lengths.
TRL_PAIRS = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
              "chosen": [{"role": "assistant", "content": f"{i} + {i} = {2 * i}"}],
              "rejected": [{"role": "assistant", "content": f"{i} + {i} = {2 * i + 1}, I think" * (1 + i % 2)}]}
             for i in range(4)]


def assert_same_as_trl(got, preference, ours, expected, metrics: dict, policy) -> None:
    """Our loss, the window's reward metrics and every trainable parameter's gradient equal TRL's."""
    import torch

    from launcher.preference import METRICS, PreferenceLoss

    means = PreferenceLoss.means(preference.take())
    assert got.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    for field in METRICS:
        assert means[field] == pytest.approx(metrics[field.replace("_", "/", 1)], rel=1e-4, abs=1e-5), field
    theirs = {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}
    mine = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    assert theirs.keys() == mine.keys() and any(g.abs().sum() > 0 for g in mine.values())
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-4, atol=1e-6, msg=name)


# padding_free: the pairs' rows end to end in one (ipo: the per-token mean needs each answer's own token count)
CASES = [("lora", dict(loss_type="sigmoid")), ("lora", dict(loss_type="sigmoid", rpo_alpha=0.5)),
         ("lora", dict(loss_type="hinge")), ("lora", dict(loss_type="ipo")),
         ("lora", dict(loss_type="robust", label_smoothing=0.2)), ("full", dict(loss_type="sigmoid")),
         ("lora", dict(loss_type="sigmoid", padding_free=True)), ("lora", dict(loss_type="ipo", padding_free=True)),
         ("full", dict(loss_type="sigmoid", padding_free=True))]


@pytest.mark.parametrize("train_type,loss", CASES, ids=[f"{t}-{'-'.join(map(str, c.values()))}" for t, c in CASES])
def test_loss_rewards_and_gradients_equal_trls(tmp_path, tiny_model, train_type, loss):
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from launcher.data import Sample, micro_batch, padded_row
    from launcher.preference import PreferenceLoss, Reference, install

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    torch.manual_seed(1)
    if train_type == "lora":  # TRL adds a new adapter; the reference is the model with it turned off
        policy, reference, lora = base, None, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    else:
        reference, policy, lora = base, copy.deepcopy(base), None
    loss_types = [loss["loss_type"]] + (["sft"] if loss.get("rpo_alpha") else [])
    trl = DPOTrainer(model=policy, ref_model=reference, peft_config=lora, processing_class=tokenizer,
                     train_dataset=Dataset.from_list(TRL_PAIRS),
                     args=DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, beta=0.3, report_to=[],
                                    use_cpu=True, bf16=False, max_length=64, loss_type=loss_types,
                                    loss_weights=[1.0, loss["rpo_alpha"]] if loss.get("rpo_alpha") else None,
                                    label_smoothing=loss.get("label_smoothing", 0.0), gradient_checkpointing=False))
    policy = trl.model
    with torch.no_grad():  # a policy that has moved off its reference: adapters (or weights) changed
        for name, p in policy.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.05 if "lora_B" in name else p + torch.randn_like(p) * 0.02)
    ours = copy.deepcopy(policy)
    batch = next(iter(trl.get_train_dataloader()))
    policy.train()
    expected = trl.compute_loss(trl.model, batch)
    expected.backward()
    metrics = {k: v[-1] for k, v in trl._metrics["train"].items()}

    spec = JobSpec(model="m", dataset=["p.jsonl"], rlhf_type="dpo", beta=0.3, train_type=train_type, **loss)
    preference = PreferenceLoss(spec)
    install(ours, preference)
    # the base, as loaded (TRL's reference), where the policy has moved off it
    ref = Reference(ours, train_type == "lora",
                    None if reference is None else copy.deepcopy(reference).requires_grad_(False).eval(),
                    flat=spec.padding_free)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "labels": batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE)}
    if spec.padding_free:  # TRL's padded rows (chosen, then rejected) end to end, as the worker's micro-batch
        rows = [padded_row(Sample(ids[kept].tolist(), labels[kept].tolist())) for ids, labels, kept in
                zip(inputs["input_ids"], inputs["labels"], batch["attention_mask"].bool())]
        inputs = micro_batch(rows, tokenizer.pad_token_id, False, 64, flat=True)[0]
        assert inputs["input_ids"].shape == (1, batch["attention_mask"].sum()) and "attention_mask" not in inputs
    ours.train()
    preference.expect(ref.logps(inputs))
    got = ours(**inputs).loss
    got.backward()
    assert_same_as_trl(got, preference, ours, expected, metrics, policy)


# (hinge with a small beta: the pairs' margins stay inside the hinge, so it has gradients)
REFERENCE_FREE = [("cpo", dict(loss_type="sigmoid")), ("cpo", dict(loss_type="hinge", cpo_alpha=0.0, beta=0.01)),
                  ("cpo", dict(loss_type="ipo", cpo_alpha=0.5, label_smoothing=0.0)),
                  ("simpo", dict(simpo_gamma=0.5, label_smoothing=0.1))]


@pytest.mark.parametrize("rlhf_type,loss", REFERENCE_FREE,
                         ids=[f"{t}-{'-'.join(map(str, c.values()))}" for t, c in REFERENCE_FREE])
def test_cpo_and_simpo_equal_trls_cpo_trainer(tmp_path, tiny_model, rlhf_type, loss):
    """CPO and SimPO (no reference model): the loss (with its NLL term), the rewards and the
    gradients of TRL's CPOTrainer, on its own batch."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    from launcher.preference import PreferenceLoss, install

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    torch.manual_seed(1)
    spec = JobSpec(model="m", dataset=["p.jsonl"], rlhf_type=rlhf_type, **loss)
    trl = CPOTrainer(model=base, processing_class=tokenizer, train_dataset=Dataset.from_list(TRL_PAIRS),
                     peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0),
                     args=CPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[], use_cpu=True,
                                    bf16=False, max_length=64, gradient_checkpointing=False,
                                    beta=spec.preference_beta, cpo_alpha=spec.cpo_alpha, simpo_gamma=spec.simpo_gamma,
                                    label_smoothing=spec.label_smoothing,
                                    loss_type="simpo" if rlhf_type == "simpo" else spec.loss_type))
    policy = trl.model
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ours = copy.deepcopy(policy)
    batch = next(iter(trl.get_train_dataloader()))
    policy.train()
    expected, metrics = trl.get_batch_loss_metrics(policy, batch)
    expected.backward()

    preference = PreferenceLoss(spec)
    install(ours, preference)
    both = trl.concatenated_inputs(batch, is_encoder_decoder=False, padding_value=trl.pad_token_id, device="cpu")
    ours.train()
    got = ours(input_ids=both["concatenated_input_ids"], attention_mask=both["concatenated_attention_mask"],
               labels=both["concatenated_labels"]).loss
    got.backward()
    assert_same_as_trl(got, preference, ours, expected, metrics, policy)


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo_equals_trls_orpo_trainer_as_ms_swift_runs_it(tmp_path, tiny_model, beta):
    """ORPO: the loss (the chosen answers' NLL less beta x the log-sigmoid of the log odds ratio of
    the mean token log-probs), the rewards and the gradients of TRL's ORPOTrainer, its NLL on the
    answer tokens as ms-swift runs it (swift/rlhf_trainers/rlhf_mixin.py hands TRL the labels as the
    tokens of that NLL; TRL alone would count the prompt's tokens too)."""
    from unittest import mock

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    from launcher.preference import PreferenceLoss, install

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    torch.manual_seed(1)
    spec = JobSpec(model="m", dataset=["p.jsonl"], rlhf_type="orpo", beta=beta)
    trl = ORPOTrainer(model=base, processing_class=tokenizer, train_dataset=Dataset.from_list(TRL_PAIRS),
                      peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0),
                      args=ORPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[], use_cpu=True,
                                      bf16=False, max_length=64, gradient_checkpointing=False, beta=spec.preference_beta))
    policy = trl.model
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ours = copy.deepcopy(policy)
    batch = next(iter(trl.get_train_dataloader()))
    both = trl.concatenated_inputs(batch, is_encoder_decoder=False, padding_value=trl.padding_value, device="cpu")
    policy.train()
    outputs = policy(input_ids=both["concatenated_input_ids"], attention_mask=both["concatenated_attention_mask"],
                     use_cache=False)
    # ms-swift's RLHFTrainerMixin.concatenated_forward: the forward done, TRL handed the labels as its input ids
    as_ms_swift = {**both, "concatenated_input_ids": both["concatenated_labels"]}
    with mock.patch.object(trl, "concatenated_inputs", lambda *a, **k: as_ms_swift), \
            mock.patch.object(type(policy), "__call__", lambda *a, **k: outputs):
        expected, metrics = trl.get_batch_loss_metrics(policy, batch)
    expected.backward()

    preference = PreferenceLoss(spec)
    install(ours, preference)
    ours.train()
    got = ours(input_ids=both["concatenated_input_ids"], attention_mask=both["concatenated_attention_mask"],
               labels=both["concatenated_labels"]).loss
    got.backward()
    assert_same_as_trl(got, preference, ours, expected, metrics, policy)


@pytest.mark.e2e
def test_a_dpo_run_learns_the_preference_resumes_exactly_and_exports(tmp_path, tiny_model):
    """Two ranks, DPO with LoRA (the adapters off as the reference) on DDP and on ZeRO-3, and full
    fine-tuning on FSDP2 (a frozen copy, sharded as the policy), on ZeRO-3 (partitioned) and on ZeRO-0 (whole), SimPO and ORPO
    (on ZeRO-2; none), LoRA DPO on streamed pairs: the reward accuracy rises above 0.9, ZeRO-3 trains
    DDP's and FSDP2's losses, ZeRO-0 FSDP2's, a resume (and a streamed run's resume) trains the same losses, the result
    exports."""
    data = preference_pairs(tmp_path / "pairs.jsonl", 64)
    common = dict(model=str(tiny_model), dataset=[data], rlhf_type="dpo", beta=0.5, max_length=48,
                  per_device_train_batch_size=4, gradient_accumulation_steps=1, logging_steps=1, save_steps=12,
                  torch_dtype="float32", lora_dropout=0.0, warmup_ratio=0.0)
    lora = write_run(tmp_path / "lora", **common, train_type="lora", learning_rate=1e-2, max_steps=24)
    full = write_run(tmp_path / "full", **common, train_type="full", learning_rate=1e-3, max_steps=6, fsdp="full_shard")
    zero3 = tmp_path / "zero3"  # the reference forward outside DeepSpeed's engine, its hooks gathering
    simpo = write_run(tmp_path / "simpo", **{**common, "rlhf_type": "simpo", "beta": None}, train_type="lora",
                      learning_rate=1e-2, max_steps=6)
    orpo = tmp_path / "orpo"  # on ZeRO-2, as ms-swift's ORPO example runs
    zero3_full = tmp_path / "zero3-full"  # the frozen reference partitioned by DeepSpeed as the policy
    # DeepSpeed's engine without a ZeRO optimizer (ZeRO-1 and 2 share the one ORPO runs), the reference whole
    zero0_full = tmp_path / "zero0-full"
    streamed = write_run(tmp_path / "streamed", **{**common, "save_steps": 2}, train_type="lora", learning_rate=1e-2,
                         max_steps=4, streaming=True)
    flat = write_run(tmp_path / "flat", **common, train_type="lora", learning_rate=1e-2, max_steps=2, padding_free=True,
                     fsdp="full_shard", split_dataset_ratio=0.25, eval_steps=2)
    flat_padded = write_run(tmp_path / "flat-padded", **common, train_type="lora", learning_rate=1e-2, max_steps=2,
                            fsdp="full_shard", split_dataset_ratio=0.25, eval_steps=2)
    procs = run_workers([dict(run_dir=lora), dict(run_dir=full), dict(run_dir=simpo), dict(run_dir=streamed),
                         dict(run_dir=flat), dict(run_dir=flat_padded),
                         planned(orpo, **{**common, "rlhf_type": "orpo", "beta": None}, train_type="lora",
                                 learning_rate=1e-2, max_steps=6, deepspeed="zero2", nproc_per_node=2),
                         planned(zero3, **common, train_type="lora", learning_rate=1e-2, max_steps=2,
                                 deepspeed="zero3", nproc_per_node=2),
                         planned(zero3_full, **common, train_type="full", learning_rate=1e-3, max_steps=2,
                                 deepspeed="zero3", nproc_per_node=2),
                         planned(zero0_full, **common, train_type="full", learning_rate=1e-3, max_steps=2,
                                 deepspeed="zero0", nproc_per_node=2)], 400)
    for proc in procs:
        assert proc.returncode == 0, proc.log[-4000:]
    zero3_full_log = procs[-2].log
    trained = {e["step"]: e for e in events(lora, 0, "train")}
    assert sorted(trained) == list(range(1, 25))
    assert trained[1]["rewards_accuracies"] < 0.9 and trained[1]["rewards_margins"] == pytest.approx(0, abs=0.05)
    assert sum(trained[s]["rewards_accuracies"] for s in (21, 22, 23, 24)) / 4 > 0.9  # each step 8 pairs
    assert trained[24]["rewards_margins"] > 0.8 and trained[24]["loss"] < 0.4
    # ZeRO-3 trains what DDP does (its first update at the same learning rate: a schedule of 2 steps
    # differs from one of 24 after it)
    assert sorted(losses(zero3)) == [1, 2]
    for step, value in losses(zero3).items():
        assert value == pytest.approx(trained[step]["loss"], rel=2e-4), step
    # padding_free (each micro-batch's pairs in one row, on FSDP2) trains and evaluates as the padded rows do
    padded = {e["step"]: e for e in events(flat_padded, 0, "train")}
    assert sorted(padded) == [1, 2]
    for event in events(flat, 0, "train"):
        for field in ("loss", "rewards_margins", "logps_chosen"):
            assert event[field] == pytest.approx(padded[event["step"]][field], rel=2e-4, abs=1e-6), field
    (flat_eval,), (padded_eval,) = events(flat, 0, "eval"), events(flat_padded, 0, "eval")
    assert flat_eval["tokens"] == padded_eval["tokens"] > 0  # the pairs evaluated
    assert flat_eval["eval_loss"] == pytest.approx(padded_eval["eval_loss"], rel=2e-4)
    # SimPO (no reference; ms-swift's beta 2.0): the length-normalised margin grows, the loss falls
    simpo_steps = events(simpo, 0, "train")
    assert [e["step"] for e in simpo_steps] == list(range(1, 7))
    assert simpo_steps[-1]["rewards_margins"] > simpo_steps[0]["rewards_margins"] and \
        simpo_steps[-1]["loss"] < simpo_steps[0]["loss"]
    # ORPO on ZeRO-2 (no reference; beta 0.1): its loss is mostly the chosen answers' NLL, which falls, and the
    # mean token log-prob of the chosen answers rises past the rejected ones'
    orpo_steps = events(orpo, 0, "train")
    assert [e["step"] for e in orpo_steps] == list(range(1, 7)) and orpo_steps[-1]["loss"] < orpo_steps[0]["loss"]
    assert orpo_steps[-1]["rewards_margins"] > orpo_steps[0]["rewards_margins"]
    # full fine-tuning's sharded reference is the base: its first step has no margin, later ones grow one
    first_full = events(full, 0, "train")
    assert first_full[0]["rewards_margins"] == pytest.approx(0, abs=1e-4)
    assert first_full[-1]["rewards_margins"] > 0.01
    # ZeRO-3's partitioned reference (half of it on each rank) trains FSDP2's first update
    held, whole = map(int, re.search(r"reference partitioned by ZeRO-3: (\d+) of its (\d+) parameters on this rank",
                                     zero3_full_log).groups())
    assert whole / 2 <= held < 0.6 * whole
    for run in (zero3_full, zero0_full):
        assert sorted(losses(run)) == [1, 2]
        for step, value in losses(run).items():
            assert value == pytest.approx(losses(full)[step], rel=2e-4), (run.name, step)

    resumed = write_run(tmp_path / "resumed", **common, train_type="lora", learning_rate=1e-2, max_steps=24)
    shutil.copytree(lora / "checkpoint-12", resumed / "checkpoint-12")
    # the streamed pairs resume at their position: steps 3-4 on the same pairs, with the same losses
    streamed_again = write_run(tmp_path / "streamed-again", **{**common, "save_steps": 2}, train_type="lora",
                               learning_rate=1e-2, max_steps=4, streaming=True)
    shutil.copytree(streamed / "checkpoint-2", streamed_again / "checkpoint-2")
    for proc in run_workers([dict(run_dir=resumed, resume="latest"), dict(run_dir=streamed_again, resume="latest")], 400):
        assert proc.returncode == 0, proc.log[-4000:]
    assert sorted(losses(streamed)) == [1, 2, 3, 4] and sorted(losses(streamed_again)) == [3, 4]
    for step, value in losses(streamed_again).items():
        assert value == pytest.approx(losses(streamed)[step], rel=2e-4), step
    assert events(streamed, 0, "train")[0]["rewards_margins"] == pytest.approx(0, abs=0.05)
    again = losses(resumed)
    assert sorted(again) == list(range(13, 25))
    for step, value in again.items():
        assert value == pytest.approx(trained[step]["loss"], rel=2e-4), step

    from launcher.export import export

    out = export(lora, None, tmp_path / "exported")
    assert (tmp_path / "exported" / "config.json").is_file() and out["out"]


@pytest.mark.e2e
def test_dpo_from_an_sft_adapter_measures_against_it(tmp_path, tiny_model):
    """ms-swift's `--adapters sft --ref_adapters sft`: DPO trains an SFT run's adapter further (its own
    rank, not lora_rank), against the model with that adapter merged in (its log-probs precomputed),
    so at the first step the policy is its reference: no reward. With `adapters` alone the reference
    is the model with the adapters off, and the SFT adapter already moves the rewards."""
    sft = write_run(tmp_path / "sft", model=str(tiny_model), dataset=[str(ROOT / "assets" / "demo" / "train.jsonl") + "#64"],
                    train_type="lora", lora_rank=8, max_length=48, per_device_train_batch_size=4, learning_rate=2e-2,
                    max_steps=4, save_steps=4, logging_steps=1, torch_dtype="float32", lora_dropout=0.0)
    for proc in run_workers([dict(run_dir=sft)], 300):
        assert proc.returncode == 0, proc.log[-4000:]
    adapter = str(sft / "checkpoint-4" / "model")
    common = dict(model=str(tiny_model), dataset=[preference_pairs(tmp_path / "pairs.jsonl", 16)], rlhf_type="dpo",
                  beta=0.5, max_length=48, per_device_train_batch_size=4, logging_steps=1, torch_dtype="float32",
                  train_type="lora", lora_rank=4, learning_rate=1e-2, max_steps=1, precompute_ref_log_probs=True,
                  adapters=[adapter], dataset_cache_dir=str(tmp_path / "cache"))
    against_sft = write_run(tmp_path / "against-sft", **common, ref_adapters=[adapter])
    against_base = write_run(tmp_path / "against-base", **common)
    for proc in run_workers([dict(run_dir=against_sft), dict(run_dir=against_base)], 300):
        assert proc.returncode == 0, proc.log[-4000:]
    first, = events(against_sft, 0, "train")
    assert first["rewards_chosen"] == pytest.approx(0, abs=1e-4) and first["rewards_margins"] == pytest.approx(0, abs=1e-4)
    assert first["loss"] == pytest.approx(0.6931, abs=1e-4)
    moved, = events(against_base, 0, "train")
    assert abs(moved["rewards_chosen"]) > 1e-2
    # the adapter trained on is the SFT run's (rank 8), and the reference tables are two, one per reference
    config = json.loads((against_sft / "checkpoint-1" / "model" / "adapter_config.json").read_text())
    assert config["r"] == 8
    assert len(list((tmp_path / "cache").rglob("reference-logps-*.npy"))) == 2


@pytest.mark.e2e
def test_precomputed_reference_log_probs_train_as_the_frozen_copy_does_and_are_kept(tmp_path, tiny_model):
    """precompute_ref_log_probs, full fine-tuning on two ranks: no frozen copy, the losses and eval
    losses of the run that holds one; the log-probs kept beside the tokenized data are read by a
    resume, and a damaged file is computed again from the base (before the checkpoint is loaded).
    A `ref_model` is loaded as the reference; precomputed log-probs are kept per reference model."""
    from launcher.preference import reference_file

    data = preference_pairs(tmp_path / "pairs.jsonl", 40)
    common = dict(model=str(tiny_model), dataset=[data], rlhf_type="dpo", beta=0.5, max_length=48, train_type="full",
                  per_device_train_batch_size=4, logging_steps=1, save_steps=2, max_steps=4, learning_rate=1e-3,
                  torch_dtype="float32", warmup_ratio=0.0, split_dataset_ratio=0.2, eval_steps=2)
    live = write_run(tmp_path / "live", **common)
    pre = write_run(tmp_path / "pre", **common, precompute_ref_log_probs=True)
    # ref_model: another model with the same vocabulary, loaded as the reference
    other = str(build_tiny_model(tmp_path / "llama", "llama"))
    live_other = write_run(tmp_path / "live-other", **common, ref_model=other)
    pre_other = write_run(tmp_path / "pre-other", **common, ref_model=other, precompute_ref_log_probs=True)
    for proc in run_workers([dict(run_dir=live_other), dict(run_dir=pre_other), dict(run_dir=live),
                             dict(run_dir=pre)], 400):
        assert proc.returncode == 0, proc.log[-4000:]
    precomputed = proc.log
    assert "reference log-probs of 32 pairs computed" in precomputed and "of 8 pairs computed" in precomputed
    assert sorted(losses(pre)) == [1, 2, 3, 4]
    for step, value in losses(live).items():
        assert losses(pre)[step] == pytest.approx(value, rel=1e-5), step
    assert events(pre, 0, "train")[0]["rewards_margins"] == pytest.approx(0, abs=1e-5)
    evals = {e["step"]: e["eval_loss"] for e in events(live, 0, "eval")}
    assert sorted(evals) == [2, 4] and all(e["eval_loss"] == pytest.approx(evals[e["step"]], rel=1e-5)
                                           for e in events(pre, 0, "eval"))
    first = events(live_other, 0, "train")[0]["rewards_margins"]
    assert abs(first) > 1e-3 and sorted(losses(live_other)) == [1, 2, 3, 4]  # the base is not its reference
    for step, value in losses(live_other).items():  # ref_model loaded for the pass alone
        assert losses(pre_other)[step] == pytest.approx(value, rel=1e-5), step
    kept = reference_file(next((tmp_path / ".tokenized").glob("*/reference-logps-*.npy")).parent, JobSpec(**common))
    assert kept.is_file() and reference_file(kept.parent, JobSpec(**common, ref_model=other)).is_file()

    # Resumed twice at once: with the kept file, and with a copy of the cache whose file is cut short
    # (as by a full disk under another tool)
    copy = tmp_path / "cache-copy"
    shutil.copytree(tmp_path / ".tokenized", copy)
    cut = copy / kept.parent.name / kept.name
    cut.write_bytes(cut.read_bytes()[:200])
    resumed = write_run(tmp_path / "resumed", **common, precompute_ref_log_probs=True)
    damaged = write_run(tmp_path / "damaged", **common, precompute_ref_log_probs=True, dataset_cache_dir=str(copy))
    for run in (resumed, damaged):
        shutil.copytree(pre / "checkpoint-2", run / "checkpoint-2")
    proc, again = run_workers([dict(run_dir=resumed, resume="latest"), dict(run_dir=damaged, resume="latest")], 400)
    assert proc.returncode == 0 and "reference log-probs read from" in proc.log, proc.log[-4000:]
    assert again.returncode == 0 and "not this entry's reference log-probs" in again.log, again.log[-4000:]
    assert "reference log-probs of 32 pairs computed" in again.log
    for run in (resumed, damaged):
        assert sorted(losses(run)) == [3, 4]
        for step, value in losses(run).items():
            assert value == pytest.approx(losses(pre)[step], rel=1e-5), (run.name, step)


def test_a_reference_table_that_is_not_ours_is_computed_again(tmp_path):
    """The kept reference log-probs are a cache read with np.load and no pickles: a file of another
    shape or dtype, an object array, a header claiming a huge shape or a cut-off file is ignored
    (all NaN: computed again); a good one round-trips."""
    import numpy as np

    from launcher.preference import load_reference_table, save_reference_table

    path = tmp_path / "reference-logps-x.npy"
    assert np.isnan(load_reference_table(path, 3)).all()  # none yet
    good = np.arange(6, dtype=np.float32).reshape(3, 2)
    save_reference_table(path, good)
    assert np.array_equal(load_reference_table(path, 3), good) and not list(tmp_path.glob(".tmp-*"))
    bad = [np.zeros((3, 2)), np.zeros((4, 2), np.float32), np.array([{"a": 1}] * 6, dtype=object).reshape(3, 2)]
    for table in bad:
        with open(path, "wb") as f:
            np.save(f, table, allow_pickle=True)
        assert np.isnan(load_reference_table(path, 3)).all(), table.dtype
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (100000000000, 2), }"
    path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + b"\x00" * 24)
    assert np.isnan(load_reference_table(path, 3)).all()
    save_reference_table(path, good)
    path.write_bytes(path.read_bytes()[:-4])
    assert np.isnan(load_reference_table(path, 3)).all()
    # a directory where the file would go: nothing written, training goes on
    path.unlink()
    path.mkdir()
    save_reference_table(path, good)
    assert path.is_dir() and not list(tmp_path.glob(".tmp-*"))


def test_precompute_runs_whole_forwards_and_keeps_the_real_pairs_in_order():
    """A pipeline computes a step's micro-batches in one forward: precompute hands them over that
    many at a time, the last group filled past the rank's pairs, and keeps each real pair's chosen
    and rejected log-probs in the plan's order."""
    import numpy as np
    import torch

    from launcher.data import Batches, Sample, one_per_row
    from launcher.preference import precompute

    pairs = [Pair(Sample([1, 10 + i, 3], [IGNORE, 10 + i, 3]), Sample([1, 20 + i, 4], [IGNORE, 20 + i, 4]))
             for i in range(5)]
    # every row max_length wide, as under PP (a pipeline's shapes are fixed)
    batches = Batches(lambda members: [pairs[m] for m in members], one_per_row(5), 2, 1, 1, 0, 0, False, 8, 8, pairs=True)
    groups = []

    def logps_of(group: list[dict]) -> list[torch.Tensor]:
        groups.append(len(group))
        assert all(batch["input_ids"].shape == (4, 8) for batch in group)
        return [batch["input_ids"].max(-1).values.float() for batch in group]  # a row's value: its largest token

    table = precompute(batches, 3, logps_of, 2, torch.device("cpu"))  # 3 micro-batches of 2 pairs, 2 per forward
    assert groups == [2, 2]
    assert table.tolist() == [[10 + i, 20 + i] for i in range(5)] and table.dtype == np.float32


def test_liger_under_dpo_patches_the_kernels_and_keeps_the_logits(monkeypatch):
    """use_liger_kernel with preference training: Liger's norms, rotary and SwiGLU, never its fused
    cross-entropy (which would compute the mean loss without the logits the DPO loss reads); under
    torch_compile, where only that loss would be applied, nothing (and validate says so)."""
    import importlib.machinery
    import sys
    import types

    from launcher.model import apply_liger

    calls = []
    liger, transformers_part = types.ModuleType("liger_kernel"), types.ModuleType("liger_kernel.transformers")
    liger.__spec__ = importlib.machinery.ModuleSpec("liger_kernel", None)
    transformers_part._apply_liger_kernel_to_instance = lambda model, **kwargs: calls.append(kwargs)
    monkeypatch.setitem(sys.modules, "liger_kernel", liger)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", transformers_part)
    apply_liger(object(), fused_loss=False)
    apply_liger(object(), compiled=True, fused_loss=False)
    apply_liger(object())
    assert calls == [dict(fused_linear_cross_entropy=False, cross_entropy=False), {}]
    warned = [p for p in validate(JobSpec(model="m", dataset=["p.jsonl"], rlhf_type="dpo", use_liger_kernel=True,
                                          torch_compile=True)) if p.field == "use_liger_kernel"]
    assert [p.severity for p in warned] == ["warning"] and "ignored: under torch_compile" in warned[0].message


def test_padding_free_pairs_are_one_row_of_answers_in_order():
    """padding_free: a micro-batch of pairs is one row, chosen answers then rejected ones (each half's
    filler between), positions restarting per sample; each run of labelled tokens is one answer, so
    the log-probs come out per answer in that order, and a filled micro-batch's precomputed
    reference log-probs hold no place for the filler."""
    import numpy as np
    import torch

    from launcher.data import Batches, Sample, one_per_row
    from launcher.preference import sequence_logps

    # prompts of 2 and 3 tokens, answers of 1-3 (labels on the answer only, as data.encode makes them)
    pairs = [Pair(Sample([1] * (2 + i % 2) + [10 + i] * (1 + i % 3), [IGNORE] * (2 + i % 2) + [10 + i] * (1 + i % 3)),
                  Sample([1] * (2 + i % 2) + [20 + i] * 2, [IGNORE] * (2 + i % 2) + [20 + i] * 2)) for i in range(3)]
    batches = Batches(lambda members: [pairs[m] for m in members], one_per_row(3), 4, 1, 1, 0, 0, False, 8, pairs=True,
                      flat=True)
    batches.reference = lambda members: np.array([[-m, -10 - m] for m in members], np.float32)
    batch, tokens, samples = batches.batch_of([0, 1, 2], fill=True)
    chosen = [t for p in pairs for t in p.chosen.input_ids]
    rejected = [t for p in pairs for t in p.rejected.input_ids]
    assert batch["input_ids"].tolist() == [chosen + [0] + rejected + [0]] and "attention_mask" not in batch
    assert batch["position_ids"].tolist() == [[i for p in pairs for i in range(len(p.chosen))] + [0]
                                              + [i for p in pairs for i in range(len(p.rejected))] + [0]]
    assert samples == 3 and tokens == len(chosen) + len(rejected) + 2
    assert batch["reference_logps"].tolist() == [0, -1, -2, -10, -11, -12]
    # uniform logits over a vocabulary of 32: every answer token's log-prob is -log 32
    logps, counts = sequence_logps(torch.zeros(1, batch["input_ids"].shape[1], 32), batch["labels"], flat=True)
    lengths = [len([t for t in p.chosen.labels if t != IGNORE]) for p in pairs] + \
        [len([t for t in p.rejected.labels if t != IGNORE]) for p in pairs]
    assert counts.tolist() == lengths
    torch.testing.assert_close(logps, -torch.tensor(lengths, dtype=torch.float32) * np.log(32))


def test_reference_log_probs_that_are_not_finite_are_named_not_kept():
    """Precomputed reference log-probs that overflowed (NaN or inf on any rank) stop the run with
    the rows and the dtype named, instead of NaN losses and a file computed again by every run."""
    import numpy as np

    from launcher.preference import nonfinite_message, nonfinite_pairs

    rank0 = (np.array([0, 2, 4]), np.array([[-3.0, -4.0], [np.nan, -1.0], [-2.0, -2.5]], dtype=np.float32))
    rank1 = (np.array([1, 3, 5]), np.array([[-1.0, -np.inf], [-1.0, -2.0], [-5.0, -6.0]], dtype=np.float32))
    assert nonfinite_pairs([rank0, rank1]) == [1, 2]
    assert nonfinite_pairs([(rank0[0], np.zeros((3, 2), np.float32))]) == []
    message = nonfinite_message(list(range(7)), 40, Path("/cache/entry"), JobSpec(model="m", dataset=["d"],
                                                                                   torch_dtype="float16"))
    assert "log-probs of 7 of 40 pairs are not finite (rows 0, 1, 2, 3, 4, ... of the tokenized data in " \
           "/cache/entry): it overflows on them in float16; train in bfloat16 or float32" in message
    bf16 = nonfinite_message([3], 40, Path("/e"), JobSpec(model="m", dataset=["d"], torch_dtype="bfloat16"))
    assert bf16.endswith("(rows 3 of the tokenized data in /e): in bfloat16; its weights may hold NaN or inf: check m")


def test_a_hub_models_reference_log_probs_are_kept_per_revision(tmp_path, monkeypatch):
    """A hub id's precomputed reference log-probs are keyed by the cached snapshot from_pretrained
    read: a new revision of the model (refs/main moved) is another file, not the old one's values;
    a name that is no hub id is keyed by itself."""
    import huggingface_hub.constants

    from launcher.preference import reference_file

    hub = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    repo = hub / "models--org--tiny"
    spec = JobSpec(model="org/tiny", dataset=["d"], rlhf_type="dpo", train_type="full", precompute_ref_log_probs=True)

    def revision(commit: str) -> Path:
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
        return reference_file(tmp_path, spec)

    first = revision("a" * 40)
    assert reference_file(tmp_path, spec) == first  # the same revision: the same file
    assert revision("b" * 40) != first
    assert reference_file(tmp_path, spec.model_copy(update={"model": "not a hub id!"})).name.startswith("reference-logps-")
    # a ref_model not cached yet: its config is fetched first, so the file is keyed by the revision it will load
    fetched = []

    def download(repo_id: str, filename: str) -> str:
        fetched.append((repo_id, filename))
        repo = hub / "models--org--other"  # as huggingface_hub leaves it: the snapshot and refs/main
        (repo / "snapshots" / ("c" * 40)).mkdir(parents=True)
        (repo / "snapshots" / ("c" * 40) / filename).write_text("{}")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("c" * 40)
        return str(repo / "snapshots" / ("c" * 40) / filename)

    monkeypatch.setattr("huggingface_hub.hf_hub_download", download)
    cold = spec.model_copy(update={"ref_model": "org/other"})
    keyed = reference_file(tmp_path, cold)
    assert fetched == [("org/other", "config.json")]
    assert reference_file(tmp_path, cold) == keyed and fetched == [("org/other", "config.json")]  # now cached


# The layout tests' jobs: three steps of DPO on a tiny model, every step logged.
LAYOUT_JOB = dict(rlhf_type="dpo", beta=0.5, max_length=48, logging_steps=1, save_steps=100, max_steps=3,
                  torch_dtype="float32", warmup_ratio=0.0, lora_dropout=0.0)
LAYOUT_KINDS = {"lora": dict(train_type="lora", learning_rate=1e-2), "full": dict(train_type="full", learning_rate=1e-3)}


def assert_layout_trains_alike(tmp_path, common: dict, jobs: dict, layout, fields=("loss", "rewards_margins",
                                                                                   "logps_chosen")) -> dict:
    """Each of `jobs` (kind -> spec fields) trained twice side by side, with `layout(1, kind)`'s fields
    and with `layout(2, kind)`'s: the second trains steps 1-3 with the first's `fields`, and its margins move.
    Each run tokenizes into a cache of its own, so each precomputes its reference log-probs in its
    layout. Returns the run directories by (kind, 1 or 2)."""
    runs = {(kind, n): tmp_path / f"{kind}-{n}" for kind in jobs for n in (1, 2)}
    for proc in run_workers([planned(run, **common, **jobs[kind], **layout(n, kind), dataset_cache_dir=str(run) + "-cache")
                             for (kind, n), run in runs.items()], 400):
        assert proc.returncode == 0, proc.log[-4000:]
    for (kind, n), run in runs.items():
        if jobs[kind].get("precompute_ref_log_probs"):
            assert re.search(r"reference log-probs of \d+ pairs computed", (run / "logs" / "local.log").read_text())
    for kind in jobs:
        base, other = (events(runs[kind, n], 0, "train") for n in (1, 2))
        assert [e["step"] for e in other] == [1, 2, 3]
        for a, b in zip(base, other):
            for field in fields:
                assert b[field] == pytest.approx(a[field], rel=1e-4, abs=1e-5), (kind, a["step"], field)
        assert other[-1]["rewards_margins"] != 0
    return runs


@pytest.mark.e2e
def test_dpo_under_tensor_parallel_by_data_parallel_trains_as_data_parallel(tmp_path, tiny_model):
    """transformers' TP=2 by two data-parallel replicas on four ranks (the head's output gathered in
    each TP pair) against DDP on two: DPO with LoRA (the reference is the adapters off; the adapters'
    gradients averaged over the replicas, which the engine once looked up in a mesh without them) and
    full DPO with precomputed reference log-probs train the same losses and rewards; full DPO with a
    live frozen copy under TP is refused by name."""
    common = dict(LAYOUT_JOB, model=str(tiny_model), dataset=[preference_pairs(tmp_path / "pairs.jsonl", 32)],
                  per_device_train_batch_size=4)
    jobs = {"lora": LAYOUT_KINDS["lora"], "full": dict(LAYOUT_KINDS["full"], precompute_ref_log_probs=True)}
    assert_layout_trains_alike(tmp_path, common, jobs,
                               lambda n, _: dict(nproc_per_node=2 * n, tensor_model_parallel_size=n))
    refused = {p.field: p.message for p in validate(JobSpec(**common, train_type="full", nproc_per_node=2,
                                                            tensor_model_parallel_size=2)) if p.severity == "error"}
    assert "tensor parallel with full-parameter DPO takes the reference from precompute_ref_log_probs" in \
        refused["tensor_model_parallel_size"]


@pytest.mark.e2e
def test_dpo_under_expert_parallel_trains_as_fsdp2(tmp_path):
    """transformers' EP=2 over FSDP2 on a tiny Qwen3-MoE (each rank routes its own pairs' tokens):
    DPO with LoRA on the attention and full DPO with precomputed reference log-probs train the
    losses and rewards of FSDP2 alone on the same two ranks."""
    moe = build_tiny_model(tmp_path / "moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[])
    common = dict(LAYOUT_JOB, model=str(moe), dataset=[preference_pairs(tmp_path / "pairs.jsonl", 32)],
                  fsdp="full_shard", per_device_train_batch_size=2, nproc_per_node=2)
    jobs = {"lora": dict(LAYOUT_KINDS["lora"], target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
            "full": dict(LAYOUT_KINDS["full"], precompute_ref_log_probs=True)}
    assert_layout_trains_alike(tmp_path, common, jobs, lambda n, _: dict(expert_model_parallel_size=n))


@pytest.mark.e2e
def test_dpo_under_ulysses_sequence_parallel_trains_as_one_rank(tmp_path, tiny_model):
    """DeepSpeed's Ulysses SP=2 on two ranks (each holds half of every row; the log-prob sums added
    over the group): DPO with LoRA on ZeRO-2 and full DPO on ZeRO-3 (its frozen copy partitioned and
    run through the same slices) train the losses, rewards and eval losses of one rank."""
    common = dict(LAYOUT_JOB, model=str(tiny_model), dataset=[preference_pairs(tmp_path / "pairs.jsonl", 40)],
                  per_device_train_batch_size=4, split_dataset_ratio=0.2, eval_steps=3)
    jobs = {"lora": dict(LAYOUT_KINDS["lora"], deepspeed="zero2"), "full": dict(LAYOUT_KINDS["full"], deepspeed="zero3")}
    runs = assert_layout_trains_alike(tmp_path, common, jobs,
                                      lambda n, _: dict(nproc_per_node=n, sequence_parallel_size=n),
                                      ("loss", "rewards_margins", "logps_chosen", "logps_rejected"))
    for kind in jobs:
        (eval_one,), (eval_sp,) = (events(runs[kind, n], 0, "eval") for n in (1, 2))
        assert eval_sp["eval_loss"] == pytest.approx(eval_one["eval_loss"], rel=1e-4)


@pytest.mark.e2e
def test_dpo_under_pipeline_parallel_trains_as_without(tmp_path):
    """A micro-batch's chosen and rejected rows go down the pipeline together; the loss is the last
    stage's. Two pipelines of PP=2 (each stage on FSDP2 over them) against two data-parallel ranks:
    DPO with LoRA, whose reference (the adapters off) is a forward-only pass of the step's
    micro-batches down the pipeline, on torch's 1F1B, and full DPO (FSDP2) with its reference
    log-probs precomputed by that pass before training, on 2 virtual stages a rank (interleaved),
    train the same losses, rewards and log-probs. Full DPO with a frozen copy under PP is refused
    by name."""
    llama = build_tiny_model(tmp_path / "llama", "llama", num_hidden_layers=4)
    common = dict(LAYOUT_JOB, model=str(llama), dataset=[preference_pairs(tmp_path / "pairs.jsonl", 32)],
                  per_device_train_batch_size=2, gradient_accumulation_steps=2)
    fields = ("loss", "rewards_margins", "logps_chosen", "logps_rejected")
    interleaved = dict(virtual_pipeline_model_parallel_size=2, pipeline_schedule="interleaved_1f1b")
    jobs = {"lora": LAYOUT_KINDS["lora"],
            "full": dict(LAYOUT_KINDS["full"], precompute_ref_log_probs=True, fsdp="full_shard")}
    layout = {1: dict(nproc_per_node=2), 2: dict(nproc_per_node=4, pipeline_model_parallel_size=2)}
    runs = assert_layout_trains_alike(tmp_path, common, jobs, lambda n, kind: {
        **layout[n], **(interleaved if (kind, n) == ("full", 2) else {})}, fields)
    assert re.search(r"reference log-probs of 32 pairs computed", (runs["full", 2] / "logs" / "local.log").read_text())
    refused = {p.field: p.message for p in validate(JobSpec(**common, nproc_per_node=2, pipeline_model_parallel_size=2,
                                                            train_type="full")) if p.severity == "error"}
    assert "pipeline parallel with full-parameter DPO takes the reference from precompute_ref_log_probs" in \
        refused["pipeline_model_parallel_size"]
