"""A model's shape, read from its Hugging Face config.json, for validation and memory estimates.

Public API:
    ModelConfig                                    frozen dataclass of the shape
    Linear                                         (fan_in, fan_out, bias) of one projection
    find_model_config(model) -> ModelConfig | None  local dir / config.json / bundled name / HF or
                                                   ModelScope cache; None when nothing is found;
                                                   raises ModelConfigError when a file is found but unusable
    load_model_config(path) -> ModelConfig          one config.json (or directory holding it)
    parse_model_config(cfg, source="") -> ModelConfig  a config.json already read
    bundled_configs() -> list[str]                  names under assets/model_configs
    MODEL_TYPE_DEFAULTS                             transformers' defaults filled in for absent keys

Counts follow what transformers >= 5 builds (tests/test_modelcfg.py builds every bundled shape on
the meta device): multi-head latent attention (DeepSeek-V2/V3), fused qkv_proj/gate_up_proj (Phi-3),
the four norms of a Gemma-2/3 layer, shared experts, and embeddings tied where the model type ties them.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from backend.job.jsonfile import read_json

ASSETS = Path(__file__).resolve().parents[2] / "assets"
BUNDLED_DIR = ASSETS / "model_configs"
# Model types whose attention projections q/k/v carry a bias although config.json does not say so.
VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v", "internvl")
"""The vision-language model types the worker trains: their image placeholder is one token repeated
per visual token, placed by the model's multimodal rope from the image's patch grid (Qwen's, and
GLM-4V's, which transformers builds on Qwen2-VL's), or as text between an image's start and end
tokens, a fixed count per tile of the image (InternVL's, transformers' `-hf` checkpoints)."""
TILED_FAMILIES = ("internvl",)
"""Of VISION_FAMILIES, those whose images are cut into tiles, each a fixed number of visual tokens
between the image's start and end tokens, placed as text (no multimodal rope)."""
VIDEO_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl")
"""Of VISION_FAMILIES, those the worker trains on videos: Qwen's, a video the placeholder tokens of its
sampled frames' patches, two frames a temporal patch, laid out by the model's processor (Qwen3-VL's: a
`<t seconds>` text before each temporal patch) and placed by the multimodal rope from its grid;
InternVL's, each sampled frame an image of one tile after a `FrameN: ` text. GLM-4V's processor puts
its own frame tokens: not done yet."""
TP_UNPLANNED_FAMILIES = ("qwen3_vl",)
"""Of VISION_FAMILIES, those whose language model transformers 5.24 gives a TP plan of its embedding
alone: under TP every rank would hold and compute every decoder layer."""
QKV_BIAS_TYPES = ("qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl", "qwen2_vl_text", "qwen2_5_vl_text", "glm4v_text")
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text", "qwen3_vl_text")
# Gemma-2/3 and GLM-4V layers norm before and after both attention and the MLP.
FOUR_NORM_TYPES = ("gemma2", "gemma3_text", "glm4v_text")
# One qkv_proj and one gate_up_proj per layer instead of q/k/v and gate/up.
FUSED_TYPES = ("phi3",)
# One gate_up_proj per layer, q/k/v apart.
FUSED_MLP_TYPES = ("glm4v_text",)
# Hub-name endings that do not change the shape: 'Mistral-Nemo-Instruct-2407' is 'mistral-nemo'.
NAME_SUFFIX = re.compile(r"-(instruct|chat|base|it|hf|v\d+(\.\d+)*|\d{4})$")

# transformers' config-class defaults for the shape keys that real config.json files leave out
# (Gemma-3's text_config names no vocab_size or heads; no Gemma file says it ties its embeddings;
# DeepSeek's attention keys where a file omits them). Only constants: a default that transformers
# derives from other keys (Llama's head_dim = hidden / heads) is derived here too. Checked against
# transformers.AutoConfig.for_model(model_type) in tests/test_modelcfg.py.
MODEL_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "tie_word_embeddings": False},
    "mistral": {"vocab_size": 32000, "tie_word_embeddings": False},
    "mixtral": {"vocab_size": 32000, "tie_word_embeddings": False},
    "qwen2": {"vocab_size": 151936, "tie_word_embeddings": False},
    "qwen2_moe": {"vocab_size": 151936, "tie_word_embeddings": False},
    "qwen3": {"vocab_size": 151936, "tie_word_embeddings": False},
    "qwen3_moe": {"vocab_size": 151936, "tie_word_embeddings": False},
    "phi3": {"vocab_size": 32064, "tie_word_embeddings": False},
    "gemma": {"vocab_size": 256000, "tie_word_embeddings": True, "head_dim": 256},
    "gemma2": {"vocab_size": 256000, "tie_word_embeddings": True, "head_dim": 256},
    "gemma3_text": {"vocab_size": 262208, "tie_word_embeddings": True, "head_dim": 256,
                    "num_attention_heads": 8, "num_key_value_heads": 4},
    "gemma3": {"tie_word_embeddings": True},
    "deepseek_v2": {"vocab_size": 102400, "tie_word_embeddings": False, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_shared_experts": 2,
                    "first_k_dense_replace": 0},
    "deepseek_v3": {"vocab_size": 129280, "tie_word_embeddings": False, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_shared_experts": 1,
                    "first_k_dense_replace": 3},
}


class ModelConfigError(ValueError):
    """A config.json that exists but cannot be used (not JSON, or missing the shape keys)."""


class Linear(NamedTuple):
    fan_in: int
    fan_out: int
    bias: bool = False

    @property
    def params(self) -> int:
        return self.fan_in * self.fan_out + (self.fan_out if self.bias else 0)


@dataclass(frozen=True)
class VisionShape:
    """What a vision tower keeps for backward per patch, where it trains (backend.job.memory)."""

    width: int
    layers: int
    mlp_width: int
    gated: bool
    """A SwiGLU MLP (gate, up, down); else two matrices (fc1, fc2)."""
    fused_qkv: bool
    """q, k and v in one linear layer (InternVL's are three)."""
    patch_values: int
    """Pixel values of one patch (channels x temporal patch x patch side squared)."""
    patch_side: int
    patches_per_token: int
    """Patches merged into one of the language model's visual tokens."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    """Width of one query/key head (MLA: the no-position part plus the rotary part)."""
    vocab_size: int
    tie_word_embeddings: bool
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    """Qwen2-MoE's sigmoid gate (an nn.Linear to one output) on the shared expert; DeepSeek has none."""
    moe_layers: int = 0
    """How many of the layers have an MoE block (the others a dense MLP)."""
    attention_bias: bool = False
    """Bias on the input projections (q/k/v; MLA: q_a and kv_a)."""
    output_bias: bool = False
    """Bias on o_proj (Qwen2's q/k/v biases come without one)."""
    mlp_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    fused_projections: bool = False
    fused_mlp: bool = False
    """gate and up in one gate_up_proj (fused_projections: q/k/v in one qkv_proj too)."""
    q_lora_rank: int = 0
    """MLA's query down-projection width; 0 for a plain q_proj."""
    kv_lora_rank: int = 0
    """MLA's compressed key/value width; 0 for ordinary attention."""
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    vision_tower: bool = False
    """A multimodal config: the counts here are its language model's (the tower is not counted)."""
    multimodal_type: str = ""
    """A multimodal config's own model_type (model_type is its language model's)."""
    vision_params: int = 0
    """The vision tower's parameters (a Qwen-VL family's; 0 where the config's family is not known)."""
    aligner_params: int = 0
    """The aligner's (the patch mergers into the language model)."""
    vision_shape: VisionShape | None = None
    """The tower's shape for its activations (None where the family is not known)."""
    max_position_embeddings: int = 0
    """The longest context the model was trained for; 0 when the config does not say."""
    rope_scaling: str = ""
    """The config's rope scaling type (yarn, linear, dynamic, llama3, ...), empty without."""
    sliding_window: int = 0
    """The attention window of the layers that have one (`sequence_mixing`); 0 when none do."""
    attention_chunk: int = 0
    """The chunk of chunked-attention layers (Llama 4); 0 when none has one."""
    other_mixers: tuple[str, ...] = ()
    """Layer kinds that mix the sequence other than by attention (linear attention, SSM, ...)."""
    source: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    def attention_linears(self) -> dict[str, Linear]:
        """The attention projections of one layer, named as the model names them."""
        h, heads = self.hidden_size, self.num_heads
        if self.kv_lora_rank:
            q = {"q_proj": Linear(h, heads * self.head_dim)} if not self.q_lora_rank else {
                "q_a_proj": Linear(h, self.q_lora_rank, self.attention_bias),
                "q_b_proj": Linear(self.q_lora_rank, heads * self.head_dim)}
            nope = self.head_dim - self.qk_rope_head_dim
            return {**q,
                    "kv_a_proj_with_mqa": Linear(h, self.kv_lora_rank + self.qk_rope_head_dim, self.attention_bias),
                    "kv_b_proj": Linear(self.kv_lora_rank, heads * (nope + self.v_head_dim)),
                    "o_proj": Linear(heads * self.v_head_dim, h, self.output_bias)}
        q_out, kv_out = heads * self.head_dim, self.num_kv_heads * self.head_dim
        o = Linear(q_out, h, self.output_bias)
        if self.fused_projections:
            return {"qkv_proj": Linear(h, q_out + 2 * kv_out, self.attention_bias), "o_proj": o}
        return {"q_proj": Linear(h, q_out, self.attention_bias), "k_proj": Linear(h, kv_out, self.attention_bias),
                "v_proj": Linear(h, kv_out, self.attention_bias), "o_proj": o}

    def mlp_linears(self, intermediate: int) -> dict[str, Linear]:
        h, bias = self.hidden_size, self.mlp_bias
        if self.fused_projections or self.fused_mlp:
            return {"gate_up_proj": Linear(h, 2 * intermediate, bias), "down_proj": Linear(intermediate, h, bias)}
        return {"gate_proj": Linear(h, intermediate, bias), "up_proj": Linear(h, intermediate, bias),
                "down_proj": Linear(intermediate, h, bias)}

    def expert_linears(self) -> dict[str, Linear]:
        """One routed expert's projections: transformers >= 5 stacks them over the experts into
        two parameters of the layer's experts module, gate_up_proj and down_proj."""
        h, i = self.hidden_size, self.moe_intermediate_size
        return {"gate_up_proj": Linear(h, 2 * i), "down_proj": Linear(i, h)}

    def router(self) -> Linear:
        return Linear(self.hidden_size, self.num_experts)

    def attention_params(self) -> int:
        """One layer's attention: projections, and the q/k norms (MLA: its two latent norms)."""
        norms = 2 * self.head_dim if self.qk_norm else 0
        if self.kv_lora_rank:
            norms += self.q_lora_rank + self.kv_lora_rank
        return sum(lin.params for lin in self.attention_linears().values()) + norms

    def routed_expert_params(self) -> int:
        """All routed experts of one MoE layer."""
        return self.num_experts * sum(lin.params for lin in self.expert_linears().values())

    def linear_modules(self) -> list[tuple[str, Linear, int]]:
        """Every nn.Linear of the decoder layers, with how many the model holds: all but lm_head
        (routers and stacked experts are parameters of other modules, not nn.Linear)."""
        out = [(name, lin, self.num_layers) for name, lin in self.attention_linears().items()]
        dense = self.num_layers - self.moe_layers
        if dense:
            out += [(name, lin, dense) for name, lin in self.mlp_linears(self.intermediate_size).items()]
        if self.shared_expert_intermediate_size:
            out += [(name, lin, self.moe_layers) for name, lin in self.mlp_linears(self.shared_expert_intermediate_size).items()]
        if self.shared_expert_gate:
            out.append(("shared_expert_gate", Linear(self.hidden_size, 1), self.moe_layers))
        return out

    def layer_params(self, moe: bool) -> int:
        """Parameters of one decoder layer (dense MLP or MoE block)."""
        common = self.attention_params() + self.norms_per_layer * self.hidden_size
        if not moe:
            return common + sum(lin.params for lin in self.mlp_linears(self.intermediate_size).values())
        mlp = self.routed_expert_params() + self.router().params
        if self.shared_expert_intermediate_size:
            mlp += sum(lin.params for lin in self.mlp_linears(self.shared_expert_intermediate_size).values())
        if self.shared_expert_gate:
            mlp += self.hidden_size
        return common + mlp

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
        expert = sum(lin.params for lin in self.expert_linears().values())
        return self.param_count() - self.moe_layers * (self.num_experts - self.experts_per_token) * expert

    def largest_layer_params(self) -> int:
        """Largest parameter count held by one module directly, as DeepSpeed's ZeRO-3 estimator
        counts it (`estimate_zero3_model_states_mem_needs_all_live`): usually the embedding, or for
        MoE models the experts block (transformers >= 5 keeps all experts of a layer in one module)."""
        candidates = [self.embedding_params, *(lin.params for _, lin, _ in self.linear_modules())]
        if self.moe_layers:
            candidates += [self.routed_expert_params(), self.router().params]
        return max(candidates)


def _int(cfg: dict[str, Any], *keys: str, default: int | None = None) -> int:
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    if default is None:
        raise ModelConfigError(f"missing '{keys[0]}'")
    return default


def _with_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's keys (a multimodal config's text_config), transformers' defaults for
    the model type filled in where a key is absent (a key set to null stays null)."""
    text = cfg.get("text_config")
    if isinstance(text, dict):
        # transformers ties on the outer config (its class default when the key is absent); files
        # from before v5 kept the key in text_config, which the outer classes still honour.
        outer = cfg.get("tie_word_embeddings", MODEL_TYPE_DEFAULTS.get(cfg.get("model_type"), {}).get("tie_word_embeddings"))
        inner = text.get("tie_word_embeddings", MODEL_TYPE_DEFAULTS.get(text.get("model_type"), {}).get("tie_word_embeddings"))
        tied = None if outer is None and inner is None else bool(outer) or bool(inner)
        cfg = {**text, "tie_word_embeddings": tied, "vision_config": cfg.get("vision_config")}
    return {**MODEL_TYPE_DEFAULTS.get(cfg.get("model_type"), {}), **cfg}


def vision_tower_params(family: str, vision: dict[str, Any], outer: dict[str, Any] | None = None) -> tuple[int, int]:
    """(vision tower, aligner) parameters of a Qwen-VL family's, GLM-4V's or InternVL's
    vision_config (InternVL's aligner reads the `outer` config too), as transformers builds the
    modules (tests/test_vision.py counts the built ones); (0, 0) for other families."""
    if family == "glm4v":
        return _glm4v_tower_params(vision)
    if family == "internvl":
        return _internvl_tower_params(vision, outer or {})
    try:
        if family == "qwen2_vl":  # LayerNorms with biases, a 2-matrix MLP of mlp_ratio
            h, depth, ratio = int(vision["embed_dim"]), int(vision["depth"]), float(vision.get("mlp_ratio", 4))
            i, out = int(h * ratio), int(vision["hidden_size"])
            norms, mlp, bias = 4 * h, 2 * h * i + i + h, False
        elif family in ("qwen2_5_vl", "qwen3_vl"):
            h, depth, i = int(vision["hidden_size"]), int(vision["depth"]), int(vision["intermediate_size"])
            out = int(vision["out_hidden_size"])
            if family == "qwen2_5_vl":  # RMSNorms, a SwiGLU MLP
                norms, mlp, bias = 2 * h, 3 * h * i + 2 * i + h, False
            else:  # LayerNorms, a 2-matrix MLP, a biased patch embedding
                norms, mlp, bias = 4 * h, 2 * h * i + i + h, True
        else:
            return 0, 0
        patch, temporal = int(vision.get("patch_size", 14)), int(vision.get("temporal_patch_size", 2))
        channels = int(vision.get("in_chans", vision.get("in_channels", 3)))
        merged = h * int(vision.get("spatial_merge_size", 2)) ** 2
    except (KeyError, TypeError, ValueError):
        return 0, 0
    tower = channels * temporal * patch * patch * h + (h if bias else 0)
    tower += depth * (norms + 3 * h * h + 3 * h + h * h + h + mlp)
    merger = merged * merged + merged + merged * out + out
    if family == "qwen2_5_vl":
        aligner = h + merger
    else:
        aligner = 2 * h + merger
    if family == "qwen3_vl":
        tower += int(vision.get("num_position_embeddings", 0)) * h
        aligner += len(vision.get("deepstack_visual_indexes") or []) * (2 * merged + merger)
    return tower, aligner


def vision_tower_shape(family: str, vision: dict[str, Any], outer: dict[str, Any] | None = None) -> VisionShape | None:
    """The tower's VisionShape from a vision_config of a family vision_tower_params reads; None else."""
    try:
        if family == "internvl":
            h, layers, i = int(vision["hidden_size"]), int(vision["num_hidden_layers"]), int(vision["intermediate_size"])
            patch = vision.get("patch_size", 14)
            side = int(patch[0] if isinstance(patch, (list, tuple)) else patch)
            merge, temporal, gated = int(1 / float((outer or {}).get("downsample_ratio", 0.5))), 1, False
        elif family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v"):
            layers, side = int(vision["depth"]), int(vision.get("patch_size", 14))
            if family == "qwen2_vl":
                h = int(vision["embed_dim"])
                i = int(h * float(vision.get("mlp_ratio", 4)))
            else:  # GLM-4V's blocks' SwiGLU is out_hidden_size wide
                h = int(vision["hidden_size"])
                i = int(vision["out_hidden_size"] if family == "glm4v" else vision["intermediate_size"])
            merge, temporal = int(vision.get("spatial_merge_size", 2)), int(vision.get("temporal_patch_size", 2))
            gated = family in ("qwen2_5_vl", "glm4v")
        else:
            return None
        channels = int(vision.get("in_chans", vision.get("in_channels", vision.get("num_channels", 3))))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if min(h, layers, i, side, merge, temporal, channels) <= 0:  # a crafted or broken config: no shape to count
        return None
    return VisionShape(width=h, layers=layers, mlp_width=i, gated=gated, fused_qkv=family != "internvl",
                       patch_values=channels * temporal * side * side, patch_side=side, patches_per_token=merge * merge)


def _glm4v_tower_params(vision: dict[str, Any]) -> tuple[int, int]:
    """GLM-4V's tower (a position embedding per patch of image_size, a biased patch embedding,
    blocks of RMSNorms, a qkv and a bias-free projection and SwiGLU MLP out_hidden_size wide, a
    biased downsampling convolution of the merged patches) and its aligner (the patch merger: a
    projection, a LayerNorm and a SwiGLU MLP intermediate_size wide, bias-free)."""
    try:
        h, depth, i = int(vision["hidden_size"]), int(vision["depth"]), int(vision["intermediate_size"])
        out, patch = int(vision["out_hidden_size"]), int(vision.get("patch_size", 14))
        merge, temporal = int(vision.get("spatial_merge_size", 2)), int(vision.get("temporal_patch_size", 2))
        channels, positions = int(vision.get("in_channels", 3)), (int(vision.get("image_size", 336)) // patch) ** 2
        qkv_bias = 3 * h if vision.get("attention_bias") else 0
    except (KeyError, TypeError, ValueError):
        return 0, 0
    block = 2 * h + 3 * h * h + qkv_bias + h * h + 3 * h * out
    tower = positions * h + channels * temporal * patch * patch * h + h + depth * block + 2 * h + h * out * merge ** 2 + out
    return tower, out * out + 2 * out + 3 * out * i


def _internvl_tower_params(vision: dict[str, Any], outer: dict[str, Any]) -> tuple[int, int]:
    """InternVL's tower (a class token, a biased patch embedding, a position embedding per patch of
    image_size and the class token's, layers of q/k/v (biased with attention_bias), a biased
    projection, q/k norms with use_qk_norm, a biased 2-matrix MLP, two norms of norm_type and two
    layer scales; a final LayerNorm unless use_mean_pooling) and its projector (a LayerNorm and two
    biased linear layers from the pixel-shuffled features to the language model's width)."""
    try:
        h, depth, i = int(vision["hidden_size"]), int(vision["num_hidden_layers"]), int(vision["intermediate_size"])
        side, patch = (int(v[0] if isinstance(v, (list, tuple)) else v)
                       for v in (vision.get("image_size", 448), vision.get("patch_size", 14)))
        channels = int(vision.get("num_channels", 3))
        shuffled = h * int(1 / float(outer.get("downsample_ratio", 0.5))) ** 2
        text = int(outer["text_config"]["hidden_size"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0, 0
    norm = 2 * h if vision.get("norm_type", "layer_norm") == "layer_norm" else h
    layer = (3 * h * h + (3 * h if vision.get("attention_bias") else 0) + h * h + h
             + (2 * h if vision.get("use_qk_norm") else 0) + 2 * h * i + i + h + 2 * norm + 2 * h)
    tower = (h + channels * patch * patch * h + h + depth * layer
             + (h if vision.get("use_mask_token") else 0)
             + ((side // patch) ** 2 + 1) * h * bool(vision.get("use_absolute_position_embeddings", True))
             + (0 if vision.get("use_mean_pooling", True) else 2 * h))
    return tower, 2 * shuffled + shuffled * text + text + text * text + text


def parse_model_config(cfg: dict[str, Any], source: str = "") -> ModelConfig:
    """Read the shape out of a config.json mapping (language-model part for multimodal configs)."""
    if not isinstance(cfg, dict):
        raise ModelConfigError("config.json is not a JSON object")
    outer_type = str(cfg.get("model_type", "")) if isinstance(cfg.get("vision_config"), dict) else ""
    vision, aligner = vision_tower_params(outer_type, cfg.get("vision_config") or {}, cfg)
    shape = vision_tower_shape(outer_type, cfg.get("vision_config") or {}, cfg)
    cfg = _with_defaults(cfg)
    model_type = str(cfg.get("model_type", ""))
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
    heads = _int(cfg, "num_attention_heads", "n_head")
    layers = _int(cfg, "num_hidden_layers", "n_layer")
    experts = _int(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    intermediate = _int(cfg, "intermediate_size", "n_inner", default=4 * hidden)
    moe_layers, moe_intermediate, shared = 0, 0, 0
    if experts > 1:
        step = _int(cfg, "decoder_sparse_step", default=1) or 1
        dense = set(cfg.get("mlp_only_layers") or [])
        first_dense = _int(cfg, "first_k_dense_replace", default=0)
        moe_layers = sum(1 for i in range(layers) if i not in dense and i >= first_dense and (i + 1) % step == 0)
        moe_intermediate = _int(cfg, "moe_intermediate_size", default=intermediate)
        # Qwen2-MoE names the shared expert's width; DeepSeek counts shared experts of the routed width.
        shared = _int(cfg, "shared_expert_intermediate_size", default=moe_intermediate * _int(cfg, "n_shared_experts", default=0))
    kv_lora = _int(cfg, "kv_lora_rank", default=0)
    head_dim = cfg.get("head_dim")
    if kv_lora:
        head_dim = _int(cfg, "qk_nope_head_dim") + _int(cfg, "qk_rope_head_dim")
    elif not (isinstance(head_dim, int) and head_dim > 0):
        head_dim = hidden // heads
    qkv_bias = bool(cfg.get("attention_bias", model_type in QKV_BIAS_TYPES))
    return ModelConfig(
        model_type=model_type,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_int(cfg, "num_key_value_heads", default=heads),
        head_dim=head_dim,
        vocab_size=_int(cfg, "vocab_size"),
        # A model type transformers' defaults are not known for: untied, the larger estimate.
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        num_experts=experts,
        experts_per_token=_int(cfg, "num_experts_per_tok", default=0),
        moe_intermediate_size=moe_intermediate,
        shared_expert_intermediate_size=shared,
        shared_expert_gate=bool(shared) and "shared_expert_intermediate_size" in cfg,
        moe_layers=moe_layers,
        attention_bias=qkv_bias,
        output_bias=qkv_bias and model_type not in QKV_BIAS_TYPES,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type in QK_NORM_TYPES,
        norms_per_layer=4 if model_type in FOUR_NORM_TYPES else 2,
        fused_projections=model_type in FUSED_TYPES,
        fused_mlp=model_type in FUSED_MLP_TYPES,
        q_lora_rank=_int(cfg, "q_lora_rank", default=0) if kv_lora else 0,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", default=0) if kv_lora else 0,
        v_head_dim=_int(cfg, "v_head_dim") if kv_lora else 0,
        vision_tower=isinstance(cfg.get("vision_config"), dict),
        multimodal_type=outer_type,
        vision_params=vision,
        aligner_params=aligner,
        vision_shape=shape,
        max_position_embeddings=_int(cfg, "max_position_embeddings", "n_positions", "max_sequence_length", default=0),
        rope_scaling=_rope_scaling(cfg),
        **dict(zip(("sliding_window", "attention_chunk", "other_mixers"), sequence_mixing(cfg))),
        source=source,
    )


# Model types whose layers mix the sequence by state-space, recurrent or linear-attention blocks
# beside (or instead of) attention, where the config names no layer_types for them.
HYBRID_TYPES = {"jamba": "mamba", "falcon_h1": "mamba", "bamba": "mamba", "zamba": "mamba", "zamba2": "mamba",
                "nemotron_h": "mamba", "granitemoehybrid": "mamba", "mamba": "mamba", "mamba2": "mamba",
                "falcon_mamba": "mamba", "rwkv": "rwkv", "recurrent_gemma": "recurrent", "lfm2": "conv",
                "qwen3_next": "linear_attention", "minimax": "linear_attention"}


def sequence_mixing(cfg: dict[str, Any]) -> tuple[int, int, tuple[str, ...]]:
    """How the config's layers mix the sequence: (the window of its sliding-window layers, the chunk
    of its chunked-attention layers, the other kinds of layer: linear attention, mamba, ...), 0 and
    () where there are none. `layer_types` where the config lists them (transformers 5), else Qwen2's
    `use_sliding_window` switch, else a set `sliding_window` applies to every layer (Mistral). The
    worker asks the same of the model's live config."""
    def positive(key: str) -> int:
        value = cfg.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    window, chunk = positive("sliding_window"), positive("attention_chunk_size")
    types = cfg.get("layer_types")
    if isinstance(types, list):
        kinds = set(map(str, types))
        others = kinds - {"full_attention", "sliding_attention", "chunked_attention"}
        return (window if "sliding_attention" in kinds else 0, chunk if "chunked_attention" in kinds else 0,
                tuple(sorted(others)))
    others = (HYBRID_TYPES[cfg.get("model_type")],) if cfg.get("model_type") in HYBRID_TYPES else ()
    if "use_sliding_window" in cfg:
        window = window if cfg["use_sliding_window"] else 0
    return window, chunk, others


def _rope_scaling(cfg: dict[str, Any]) -> str:
    """transformers 4 writes `rope_scaling`, 5 `rope_parameters`; 'default' is no scaling."""
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key)
        if isinstance(value, dict):
            kind = str(value.get("rope_type") or value.get("type") or "")
            if kind and kind != "default":
                return kind
    return ""


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


def bundled_names(model: str) -> list[str]:
    """Names a hub id may have under assets/model_configs, the full name first, then with one more
    suffix removed each: 'mistralai/Mistral-Nemo-Instruct-2407' -> 'mistral-nemo-instruct-2407',
    'mistral-nemo-instruct', 'mistral-nemo'. The full name comes first so 'DeepSeek-V3' is not taken
    for a version suffix of 'deepseek'."""
    key = model.rstrip("/").rsplit("/", 1)[-1].lower().removeprefix("meta-").replace("llama-", "llama")
    names = [key]
    while (shorter := NAME_SUFFIX.sub("", names[-1])) != names[-1]:
        names.append(shorter)
    return names


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
    for name in bundled_names(model):
        if (BUNDLED_DIR / f"{name}.json").is_file():
            return load_model_config(BUNDLED_DIR / f"{name}.json")
    cached = _cached_config(model)
    return load_model_config(cached) if cached else None
