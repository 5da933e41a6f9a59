"""A model's shape, read from its Hugging Face config.json, for validation and memory estimates.

Public API:
    ModelConfig                                    frozen dataclass of the shape
    find_model_config(model) -> ModelConfig | None  local dir / config.json / bundled name / HF or
                                                   ModelScope cache; None when nothing is found;
                                                   raises ModelConfigError when a file is found but unusable
    load_model_config(path) -> ModelConfig          one config.json (or directory holding it)
    bundled_configs() -> list[str]                  names under assets/model_configs
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.jsonfile import read_json

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED_DIR = ASSETS / "model_configs"
# Model types whose attention projections q/k/v carry a bias although config.json does not say so.
QKV_BIAS_TYPES = ("qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
NAME_SUFFIX = re.compile(r"(-(instruct|chat|base|it|hf|v\d+(\.\d+)*))+$")


class ModelConfigError(ValueError):
    """A config.json that exists but cannot be used (not JSON, or missing the shape keys)."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: int = 0
    """How many of the layers have an MoE block (the others a dense MLP)."""
    attention_bias: bool = False
    qk_norm: bool = False
    source: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    def attention_linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each attention projection of one layer."""
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h = self.hidden_size
        return {"q_proj": (h, q_out), "k_proj": (h, kv_out), "v_proj": (h, kv_out), "o_proj": (q_out, h)}

    def mlp_linears(self, intermediate: int) -> dict[str, tuple[int, int]]:
        h = self.hidden_size
        return {"gate_proj": (h, intermediate), "up_proj": (h, intermediate), "down_proj": (intermediate, h)}

    def layer_params(self, moe: bool) -> int:
        """Parameters of one decoder layer (dense MLP or MoE block)."""
        attn = sum(i * o for i, o in self.attention_linears().values())
        if self.attention_bias:
            attn += sum(o for name, (_, o) in self.attention_linears().items() if name != "o_proj")
        if self.qk_norm:
            attn += 2 * self.head_dim
        norms = 2 * self.hidden_size
        if not moe:
            return attn + norms + sum(i * o for i, o in self.mlp_linears(self.intermediate_size).values())
        expert = sum(i * o for i, o in self.mlp_linears(self.moe_intermediate_size).values())
        mlp = self.num_experts * expert + self.hidden_size * self.num_experts  # experts + router
        if self.shared_expert_intermediate_size:
            mlp += sum(i * o for i, o in self.mlp_linears(self.shared_expert_intermediate_size).values())
            mlp += self.hidden_size  # the shared expert's sigmoid gate
        return attn + norms + mlp

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def param_count(self) -> int:
        """Total parameters, as `sum(p.numel() for p in model.parameters())` counts them."""
        dense_layers = self.num_layers - self.moe_layers
        total = dense_layers * self.layer_params(False) + self.moe_layers * self.layer_params(True)
        total += self.embedding_params + self.hidden_size  # embeddings + final norm
        if not self.tie_word_embeddings:
            total += self.embedding_params
        return total

    def active_param_count(self) -> int:
        """Parameters one token passes through (MoE: only its experts_per_token experts)."""
        if not self.is_moe:
            return self.param_count()
        expert = sum(i * o for i, o in self.mlp_linears(self.moe_intermediate_size).values())
        return self.param_count() - self.moe_layers * (self.num_experts - self.experts_per_token) * expert

    def largest_layer_params(self) -> int:
        """Largest parameter count held by one module directly, as DeepSpeed's ZeRO-3 estimator
        counts it (`estimate_zero3_model_states_mem_needs_all_live`): usually the embedding, or for
        MoE models the experts block (transformers >= 5 keeps all experts of a layer in one module)."""
        candidates = [self.embedding_params, *(i * o for i, o in self.attention_linears().values())]
        if self.moe_layers < self.num_layers:
            candidates += [i * o for i, o in self.mlp_linears(self.intermediate_size).values()]
        if self.moe_layers:
            candidates.append(self.num_experts * sum(i * o for i, o in self.mlp_linears(self.moe_intermediate_size).values()))
        return max(candidates)


def _int(cfg: dict[str, Any], *keys: str, default: int | None = None) -> int:
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    if default is None:
        raise ModelConfigError(f"missing '{keys[0]}'")
    return default


def parse_model_config(cfg: dict[str, Any], source: str = "") -> ModelConfig:
    """Read the shape out of a config.json mapping (language-model part for multimodal configs)."""
    if not isinstance(cfg, dict):
        raise ModelConfigError("config.json is not a JSON object")
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings", cfg["text_config"].get("tie_word_embeddings"))}
    model_type = str(cfg.get("model_type", ""))
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
    heads = _int(cfg, "num_attention_heads", "n_head")
    layers = _int(cfg, "num_hidden_layers", "n_layer")
    experts = _int(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    intermediate = _int(cfg, "intermediate_size", "n_inner", default=4 * hidden)
    moe_layers = 0
    if experts > 1:
        step = _int(cfg, "decoder_sparse_step", default=1) or 1
        dense = set(cfg.get("mlp_only_layers") or [])
        first_dense = _int(cfg, "first_k_dense_replace", default=0)
        moe_layers = sum(1 for i in range(layers) if i not in dense and i >= first_dense and (i + 1) % step == 0)
    head_dim = cfg.get("head_dim")
    return ModelConfig(
        model_type=model_type,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_int(cfg, "num_key_value_heads", default=heads),
        head_dim=head_dim if isinstance(head_dim, int) and head_dim > 0 else hidden // heads,
        vocab_size=_int(cfg, "vocab_size"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_experts=experts,
        experts_per_token=_int(cfg, "num_experts_per_tok", default=0),
        moe_intermediate_size=_int(cfg, "moe_intermediate_size", default=intermediate) if experts > 1 else 0,
        shared_expert_intermediate_size=_int(cfg, "shared_expert_intermediate_size", default=0) if experts > 1 else 0,
        moe_layers=moe_layers,
        attention_bias=bool(cfg.get("attention_bias", model_type in QKV_BIAS_TYPES)),
        qk_norm=model_type in QK_NORM_TYPES,
        source=source,
    )


def load_model_config(path: str | Path) -> ModelConfig:
    """Load one config.json (or the config.json inside a directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    cfg = read_json(path, "model config", ModelConfigError)
    try:
        return parse_model_config(cfg, source=str(path))
    except ModelConfigError as exc:
        raise ModelConfigError(f"{path}: {exc}") from None


def bundled_configs() -> list[str]:
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.json"))


def bundled_name(model: str) -> str:
    """'meta-llama/Llama-3.1-8B-Instruct' -> 'llama3.1-8b' (the naming of assets/model_configs)."""
    key = model.rstrip("/").rsplit("/", 1)[-1].lower()
    key = NAME_SUFFIX.sub("", key.removeprefix("meta-"))
    return key.replace("llama-", "llama")


def _cached_config(model: str) -> Path | None:
    """config.json of a hub id already in the Hugging Face or ModelScope cache (no download)."""
    if model.count("/") != 1:
        return None
    org, name = model.split("/")
    hf_home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    hub = Path(os.environ.get("HF_HUB_CACHE", hf_home / "hub"))
    hits = sorted((hub / f"models--{org}--{name}" / "snapshots").glob("*/config.json"))
    ms_home = Path(os.environ.get("MODELSCOPE_CACHE", Path.home() / ".cache" / "modelscope" / "hub"))
    hits += [p for p in (ms_home / org / name / "config.json", ms_home / "models" / org / name / "config.json") if p.is_file()]
    return hits[-1] if hits else None


def find_model_config(model: str) -> ModelConfig | None:
    """The shape of `model`: a local directory (or config.json), a bundled config name or a hub id
    whose name matches one, or a hub id in the local cache. None when none of these exists."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file() or (path.is_file() and path.suffix == ".json"):
        return load_model_config(path)
    bundled = BUNDLED_DIR / f"{bundled_name(model)}.json"
    if bundled.is_file():
        return load_model_config(bundled)
    cached = _cached_config(model)
    return load_model_config(cached) if cached else None
