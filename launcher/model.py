"""Model and tokenizer loading: transformers for the model, peft for LoRA."""
from __future__ import annotations

import importlib.util
import logging
import os

import torch

from backend.job.errors import UserError
from backend.job.modelfiles import model_dir_problems
from launcher.data import DEFAULT_CHAT_TEMPLATE
from launcher.longseq import enable_checkpointing, tile_mlps
from launcher.vision import auto_class, is_vision, lora_targets, vision_parts

log = logging.getLogger(__name__)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ModelError(UserError):
    """A user-fixable problem loading the model (bad path, missing files, unknown option)."""


def attn_implementation(requested: str | None) -> str:
    """SDPA by default; flash-attention 2 when asked for (or when installed and nothing was asked)."""
    has_flash = importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()
    if requested in (None, "", "auto"):
        return "flash_attention_2" if has_flash else "sdpa"
    if requested == "flash_attention_2" and not has_flash:
        raise ModelError("attn_impl: flash_attention_2 needs the flash-attn package and a CUDA GPU")
    return requested


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as exc:
        raise ModelError(f"model: cannot load a tokenizer from '{model}' ({exc})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        log.warning("the tokenizer of %s has no chat template; using ChatML", model)
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    return tokenizer


def load_model(spec, master_dtype: torch.dtype = torch.float32, distributed_config=None):
    """The causal LM in `master_dtype` (the engines keep fp32 master weights and run the compute
    dtype through autocast / their mixed-precision policy); with a transformers DistributedConfig,
    loaded straight into its TP (and FSDP2) shards."""
    requested = spec.attn_impl
    if spec.context_parallel_size > 1 and requested in (None, "", "auto"):
        requested = "sdpa"  # torch's ring attention replaces SDPA only
    kwargs = dict(dtype=master_dtype, attn_implementation=attn_implementation(requested))
    if distributed_config is not None:
        kwargs["distributed_config"] = distributed_config
    try:
        model = auto_class(spec.model).from_pretrained(spec.model, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelError(f"model: cannot load '{spec.model}' ({exc})") from None
    if spec.use_liger_kernel:
        apply_liger(model, compiled=spec.torch_compile, fused_loss=spec.rlhf_type is None)
    model.config.use_cache = False
    if getattr(model.config, "text_config", None) is not None:  # a vision-language model's language model reads its own
        model.config.text_config.use_cache = False
    if spec.router_aux_loss_coef > 0:
        if not hasattr(model, "router_aux_loss_coef"):
            raise ModelError(f"router_aux_loss_coef: {spec.model} has no router load-balancing loss (not a "
                             "mixture-of-experts model transformers gives one); set it to 0")
        # transformers' MoE models copy the weight from the config when built, and add the weighted
        # loss only when the config asks for router logits.
        model.router_aux_loss_coef = model.config.router_aux_loss_coef = spec.router_aux_loss_coef
        model.config.output_router_logits = True
    return model


def apply_liger(model, compiled: bool = False, fused_loss: bool = True) -> None:
    """Liger's kernels; under torch.compile only its fused linear cross-entropy: inductor fuses the
    norms, rotary and SwiGLU itself, and Liger's versions of those break graph capture. Without
    `fused_loss` (preference training, whose loss needs every answer's log-probs from the logits)
    its norms, rotary and SwiGLU only, the model's forward left to compute the logits."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise ModelError("use_liger_kernel: liger-kernel is not installed on this node (pip install liger-kernel)")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    kernels = dict(rope=False, rms_norm=False, swiglu=False, layer_norm=False, geglu=False) if compiled else {}
    if not fused_loss:
        if compiled:
            return
        kernels.update(fused_linear_cross_entropy=False, cross_entropy=False)
    _apply_liger_kernel_to_instance(model=model, **kernels)


def add_lora(model, spec):
    """LoRA adapters: new ones (lora_rank, target_modules) or the saved one `adapters` names, trainable.
    A vision-language model's are the linear layers of the parts that train (`lora_targets`: the
    language model, and the vision tower and aligner where freeze_vit / freeze_aligner are off)."""
    if spec.adapters:
        return load_adapter(model, spec.adapters[0], "adapters", trainable=True)
    from peft import LoraConfig, get_peft_model

    targets = "all-linear" if spec.target_modules == ["all-linear"] else spec.target_modules
    try:
        if is_vision(model.config):
            targets = lora_targets(model, spec, None if targets == "all-linear" else targets)
        config = LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha, lora_dropout=spec.lora_dropout,
                            target_modules=targets, task_type="CAUSAL_LM")
        model = get_peft_model(model, config)
    except ValueError as exc:
        raise ModelError(f"target_modules: {exc}") from None
    init_lora(model, spec.seed)
    return model


def load_adapter(model, path: str, field: str, trainable: bool):
    """A saved LoRA adapter on `model` (peft's PeftModel); a load failure names `field`."""
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(model, path, is_trainable=trainable)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:  # missing files, another base's shapes
        raise ModelError(f"{field}: cannot load the LoRA adapter {path} onto {model.config.name_or_path} "
                         f"({type(exc).__name__}: {str(exc)[:500]})") from None


def init_lora(model, seed: int) -> None:
    """Every lora_A initialised from a generator seeded by the job's seed and the adapter's name,
    in its global shape, then laid out as the layer's shards: the same adapters on any layout and
    engine. peft draws them from each rank's random stream, in the local shape on some TP layers,
    so a TP run did not start where the same job without TP starts. Also mends peft 0.21's TP-LoRA
    on transformers 5's DTensor TP: a rowwise layer's lora_A keeps the local width as
    `in_features`, which transformers' rowwise input hook reads as the full width (the forward
    failed with a reshape error). Both pinned in tests/test_tensor_parallel.py."""
    import math
    import zlib

    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, module in model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, torch.nn.ModuleDict):
            continue
        for adapter, linear in lora_a.items():
            if getattr(module.base_layer, "_hf_tp_plan", None) == "rowwise":
                linear.in_features = module.base_layer.in_features
            weight = linear.weight
            generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}.lora_A.{adapter}".encode()))
            full = torch.empty(weight.shape, dtype=torch.float32)
            # peft's default: kaiming-uniform with a = sqrt(5), as nn.Linear initialises itself.
            bound = 1 / math.sqrt(full.shape[1])
            full.uniform_(-bound, bound, generator=generator)
            with torch.no_grad():
                if isinstance(weight, DTensor):
                    weight.copy_(distribute_tensor(full.to(weight.dtype), weight.device_mesh, weight.placements))
                else:
                    weight.copy_(full.to(device=weight.device, dtype=weight.dtype))


def master_dtype(spec) -> torch.dtype:
    """fp32 master weights where the optimizer updates them; a LoRA base under DDP is frozen, so it
    is kept in the compute dtype (as ms-swift does): half the memory and no per-step weight casts.
    DeepSpeed and FSDP get fp32 and apply their own mixed-precision policy."""
    if spec.train_type == "lora" and not spec.deepspeed and not spec.fsdp:
        return DTYPES[spec.torch_dtype]
    return torch.float32


def freeze_parts(model, spec) -> None:
    """A vision-language model's vision tower, aligner and language model kept fixed as
    freeze_vit, freeze_aligner and freeze_llm say (full fine-tuning; LoRA trains its adapters only)."""
    if not is_vision(model.config):
        return
    vit, aligner, llm = vision_parts(model)
    for frozen, modules in ((spec.freeze_vit, vit), (spec.freeze_aligner, aligner), (spec.freeze_llm, llm)):
        if frozen:
            for module in modules:
                module.requires_grad_(False)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's repeated blocks, found by the class names transformers marks as not splittable."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def prepare(spec, distributed_config=None):
    """Tokenizer and the (LoRA-wrapped) model in training mode, gradient checkpointing (with
    offload), tiled MLPs and per-layer compilation when asked; `distributed_config` (transformers') shards it for TP."""
    if os.path.isdir(spec.model):  # named by file here; transformers' SafetensorError names none
        problems = model_dir_problems(spec.model)
        if problems:
            raise ModelError("model: " + "; ".join(problems))
    tokenizer = load_tokenizer(spec.model)
    model = load_model(spec, master_dtype(spec), distributed_config)
    if spec.gradient_checkpointing:
        enable_checkpointing(model, offload=spec.activation_cpu_offload)
    if spec.train_type == "lora":
        model = add_lora(model, spec)
    else:
        freeze_parts(model, spec)
    if spec.tiled_mlp:
        tile_mlps(decoder_layers(model), model.config.hidden_size)
    # from_pretrained returns eval mode: dropout (LoRA's too) would be off, and Liger's fused
    # cross-entropy would materialise the logits it exists to avoid.
    model.train()
    if spec.torch_compile:
        # One compiled graph serves every layer (same code, parameters passed as inputs).
        for layer in compiled_layers(model):
            layer.compile()
    return tokenizer, model


def compiled_layers(model) -> list[torch.nn.Module]:
    """The layers torch_compile compiles: the decoder layers; a vision-language model's language
    model's only, as its tower's blocks see another patch count and window layout every batch (a
    recompile each)."""
    layers = decoder_layers(model)
    if not is_vision(model.config):
        return layers
    language = {id(m) for m in vision_parts(model)[2][0].modules()}
    return [layer for layer in layers if id(layer) in language]


def matmul_params(config) -> int:
    """Parameters in the matmuls of one token's forward (embedding lookup excluded), as in the
    shared HF baseline, for MFU = 6·N + 12·L·h·T FLOPs per token."""
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    if getattr(config, "num_experts_per_tok", 0):
        from backend.job.modelcfg import parse_model_config

        # A token passes through its experts only: the config's count of active parameters, less
        # the embedding lookup (the output layer is a matmul, tied or not).
        moe = parse_model_config(config.to_dict())
        return moe.active_param_count() - moe.embedding_params * (1 if moe.tie_word_embeddings else 2) + h * vocab
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads  # Mistral-style configs hold None
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    per_layer = h * heads * head_dim * 2 + h * kv * 2 + 3 * h * config.intermediate_size
    return layers * per_layer + h * vocab


def flops_per_token(config, seq_len: int) -> float:
    return 6 * matmul_params(config) + 12 * config.num_hidden_layers * config.hidden_size * seq_len


# Dense bf16 peak per device, for MFU. Unknown devices (and CPUs) report MFU as null.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
               "A10": 125.0, "4090": 165.0}


def peak_flops() -> float | None:
    import os

    if os.environ.get("PEAK_TFLOPS"):
        return float(os.environ["PEAK_TFLOPS"]) * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, tflops in PEAK_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None
