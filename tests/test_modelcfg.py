"""Model shapes read from config.json against what transformers builds and what peft adapts."""
from __future__ import annotations

import json

import pytest

from backend.job.memory import trainable_params
from backend.job.modelcfg import (BUNDLED_DIR, MODEL_TYPE_DEFAULTS, ModelConfigError, bundled_configs, find_model_config,
                              load_model_config, parse_model_config)
from backend.job.spec import JobSpec

# Shapes of families no bundled file covers, as their config.json files spell them (scaled down
# where the real model is only a bigger copy of the same modules).
INLINE = {
    # deepseek-ai/DeepSeek-V2-Lite: MLA without the query LoRA (q_lora_rank null), two shared experts.
    "deepseek-v2-lite": {"model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
                         "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
                         "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
                         "num_experts_per_tok": 6, "first_k_dense_replace": 1, "q_lora_rank": None,
                         "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                         "vocab_size": 102400, "tie_word_embeddings": False, "topk_method": "greedy"},
    # Qwen/Qwen1.5-MoE-A2.7B layout (4 layers): shared expert with its sigmoid gate, q/k/v biases.
    "qwen2-moe-4l": {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
                     "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                     "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 16,
                     "num_experts": 60, "num_experts_per_tok": 4, "vocab_size": 151936, "tie_word_embeddings": False},
    # A Llama with every optional bias, the cases attention_bias/mlp_bias switch on.
    "llama-biases": {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 2,
                     "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000,
                     "attention_bias": True, "mlp_bias": True},
}


def config_dict(name: str) -> dict:
    return INLINE[name] if name in INLINE else json.loads((BUNDLED_DIR / f"{name}.json").read_text())


def meta_model(cfg: dict):
    """The model transformers builds from `cfg`, on the meta device (no memory, no download)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def language_model_params(model) -> int:
    """Parameters less a multimodal model's vision tower and projector (the estimate counts the
    language model; the vision tower is named in a note)."""
    skip = {id(p) for name in ("vision_tower", "multi_modal_projector") if hasattr(model.model, name)
            for p in getattr(model.model, name).parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


SHAPES = [*bundled_configs(), *INLINE]


@pytest.mark.parametrize("name", SHAPES)
def test_parameter_counts_match_transformers_on_meta(name):
    model = meta_model(config_dict(name))
    ours = parse_model_config(config_dict(name))
    expected = language_model_params(model)
    assert ours.param_count() == pytest.approx(expected, rel=0.02)
    assert ours.param_count() == expected  # exact, so a regression shows before it reaches 2%
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert ours.largest_layer_params() == largest
    assert ours.vision_tower == hasattr(model.model, "vision_tower")


def lora_job(**kw) -> JobSpec:
    return JobSpec(**{"model": "m", "dataset": ["d"], "train_type": "lora", "lora_rank": 8, **kw})


def peft_trainable(cfg: dict, targets) -> int:
    import torch
    from peft import LoraConfig, get_peft_model

    model = meta_model(cfg)
    with torch.device("meta"):
        peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=targets, task_type="CAUSAL_LM"))
    return sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


TEXT_ONLY = [name for name in SHAPES if "vision_config" not in config_dict(name)]


@pytest.mark.parametrize("name", TEXT_ONLY)
def test_all_linear_lora_counts_equal_peft(name):
    """peft's 'all-linear' adapts every nn.Linear but lm_head: fused qkv_proj/gate_up_proj once,
    MLA's down/up projections, shared experts (and Qwen2-MoE's gate); not routers or fused experts."""
    cfg = config_dict(name)
    assert trainable_params(lora_job(), parse_model_config(cfg)) == peft_trainable(cfg, "all-linear")


@pytest.mark.parametrize("name,targets", [("llama3.2-1b", ["q_proj", "v_proj"]), ("phi-3-mini-4k", ["qkv_proj"]),
                                          ("phi-4", ["o_proj", "gate_up_proj"]), ("deepseek-v2-lite", ["q_proj", "kv_b_proj"]),
                                          ("qwen2-moe-4l", ["gate_proj", "shared_expert_gate"]),
                                          ("qwen3-30b-a3b", ["gate_proj", "up_proj"]), ("mixtral-8x7b", ["o_proj", "down_proj"]),
                                          ("deepseek-v3", ["o_proj", "down_proj"])])
def test_named_lora_targets_equal_peft(name, targets):
    cfg = config_dict(name)
    assert trainable_params(lora_job(target_modules=targets), parse_model_config(cfg)) == peft_trainable(cfg, targets)


def test_defaults_table_is_transformers_defaults():
    """Every default the parser fills is the config class's own, and a constant (not derived from
    other keys, which a file may set differently)."""
    from transformers import AutoConfig

    for model_type, defaults in MODEL_TYPE_DEFAULTS.items():
        plain = AutoConfig.for_model(model_type)
        for key, value in defaults.items():
            assert getattr(plain, key) == value, (model_type, key)
        if "head_dim" in defaults:
            wider = AutoConfig.for_model(model_type, hidden_size=8192)
            assert wider.head_dim == defaults["head_dim"], model_type


def test_tied_embeddings_follow_the_model_type():
    """Gemma files leave tie_word_embeddings out and tie: counting an lm_head made Gemma-2-9B
    10% and Gemma-3-1B 30% larger than they are."""
    assert find_model_config("google/gemma-2-9b-it").param_count() == 9_241_705_984
    assert find_model_config("google/gemma-3-1b-it").param_count() == 999_885_952
    assert find_model_config("google/gemma-3-1b-it").tie_word_embeddings
    assert not parse_model_config({**INLINE["llama-biases"]}).tie_word_embeddings  # Llama does not tie


def test_nested_text_config_takes_transformers_defaults():
    """google/gemma-3-4b-it's text_config names no vocab_size, heads or head_dim."""
    model = find_model_config("google/gemma-3-4b-it")
    assert (model.vocab_size, model.num_heads, model.num_kv_heads, model.head_dim) == (262208, 8, 4, 256)
    assert model.tie_word_embeddings and model.qk_norm and model.vision_tower


def test_mla_and_shared_experts_are_counted():
    model = find_model_config("deepseek-ai/DeepSeek-V3")
    assert model.attention_params() == 187_107_328  # not 205M: MLA, not multi-head projections
    assert model.moe_layers == 58 and model.shared_expert_intermediate_size == 2048


def test_hub_ids_find_bundled_configs():
    names = {"deepseek-ai/DeepSeek-V3": "deepseek-v3", "deepseek-ai/DeepSeek-V3-0324": "deepseek-v3",
             "mistralai/Mistral-Nemo-Instruct-2407": "mistral-nemo", "microsoft/Phi-3-mini-4k-instruct": "phi-3-mini-4k",
             "microsoft/phi-4": "phi-4", "Qwen/Qwen3-32B": "qwen3-32b", "meta-llama/Llama-3.1-70B-Instruct": "llama3.1-70b",
             "google/gemma-2-9b-it": "gemma-2-9b", "mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral-8x7b"}
    for hub_id, name in names.items():
        assert find_model_config(hub_id).source == str(BUNDLED_DIR / f"{name}.json"), hub_id


def test_missing_shape_keys_name_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "unknown_arch", "hidden_size": 64, "num_attention_heads": 4,
                                "num_hidden_layers": 2}))
    with pytest.raises(ModelConfigError, match=rf"{path}: missing 'vocab_size'"):
        load_model_config(path)
