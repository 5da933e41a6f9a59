"""Per-GPU memory estimate of a job (pure arithmetic on the model's shape; no torch).

Public API:
    MemoryEstimate                                   GiB per GPU, broken down; `.to_dict()`
    estimate_memory(spec, model, layout=None) -> MemoryEstimate
    trainable_params(spec, model) -> int

Accounting (bytes per parameter, mixed precision with bf16/fp16 compute, AdamW):
    parameters   2 (16-bit weights)              ZeRO-3 / FSDP: sharded, plus the gathered working set
    gradients    2 (16-bit) + 4 (fp32)            ZeRO-1 shards the fp32 part, ZeRO-2/3 both
    optimizer    4 (fp32 master) + 8 (Adam m, v)  sharded from ZeRO-1 on
These are the multipliers DeepSpeed's own estimators use (2 + 18/N for ZeRO-2; 4 x largest layer
+ 18/N for ZeRO-3). Offloaded states count in `offloaded_gib` (host memory per GPU), not on the GPU.
Sharding is over the ranks that hold the same model slice: world / (TP x PP).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from backend.dsconfig import STAGE12_BUCKET, ZeroSettings, zero_settings
from backend.layout import Layout, compute_layout
from backend.modelcfg import ModelConfig
from backend.spec import JobSpec

GIB = 2**30
CUDA_CONTEXT_BYTES = 0.75 * GIB  # CUDA context + cuBLAS/NCCL workspaces + allocator slack
# DeepSpeed docs: overlap_comm holds about 4.5 x the bucket sizes, in 16-bit, for both buckets.
OVERLAP_COMM_FACTOR = 4.5
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class MemoryEstimate:
    parameters_gib: float
    gradients_gib: float
    optimizer_gib: float
    activations_gib: float
    other_gib: float
    offloaded_gib: float
    """Host (CPU/NVMe) memory per GPU for offloaded states."""
    total_params: int
    trainable_params: int
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def model_states_gib(self) -> float:
        return self.parameters_gib + self.gradients_gib + self.optimizer_gib

    @property
    def total_gib(self) -> float:
        return self.model_states_gib + self.activations_gib + self.other_gib

    def to_dict(self) -> dict:
        data = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}
        data["notes"] = list(self.notes)
        data["model_states_gib"] = round(self.model_states_gib, 3)
        data["total_gib"] = round(self.total_gib, 3)
        return data

    def summary(self) -> str:
        return (f"~{self.total_gib:.1f} GiB per GPU (params {self.parameters_gib:.1f}, grads {self.gradients_gib:.1f}, "
                f"optimizer {self.optimizer_gib:.1f}, activations {self.activations_gib:.1f}, other {self.other_gib:.1f})")


def trainable_params(spec: JobSpec, model: ModelConfig) -> int:
    """Full fine-tuning: every parameter. LoRA: r x (in + out) per adapted linear layer."""
    if spec.train_type == "full":
        return model.param_count()
    wanted = set(ALL_LINEAR) if "all-linear" in spec.target_modules else set(spec.target_modules)
    total = 0
    dense_layers = model.num_layers - model.moe_layers
    for name, (fan_in, fan_out) in model.attention_linears().items():
        if name in wanted:
            total += model.num_layers * spec.lora_rank * (fan_in + fan_out)
    # Dense MLPs (and MoE shared experts) are nn.Linear; fused expert weights are not adapted by peft.
    mlps = [(dense_layers, model.intermediate_size)]
    if model.shared_expert_intermediate_size:
        mlps.append((model.moe_layers, model.shared_expert_intermediate_size))
    for layers, intermediate in mlps:
        for name, (fan_in, fan_out) in model.mlp_linears(intermediate).items():
            if name in wanted:
                total += layers * spec.lora_rank * (fan_in + fan_out)
    return total


def _activation_bytes(spec: JobSpec, model: ModelConfig, layout: Layout) -> float:
    """Activations kept for backward on one GPU for one micro-batch."""
    tokens = spec.per_device_train_batch_size * spec.max_length / (layout.cp * layout.sp)
    h = model.hidden_size
    kv = model.num_kv_heads * model.head_dim
    mlp_width = model.intermediate_size
    if model.is_moe:
        mlp_width = model.experts_per_token * model.moe_intermediate_size + model.shared_expert_intermediate_size
    width = 2 if spec.torch_dtype != "float32" else 4
    # Per token and layer: norms, residual, q/attn-out/o inputs (~6h), k and v, and the SwiGLU
    # gate/up/activation/product (4 x intermediate). SDPA/flash attention keep no s x s matrix.
    per_layer = width * (6 * h + 2 * kv + 4 * mlp_width) / layout.tp
    layers_here = model.num_layers / layout.pp
    if spec.gradient_checkpointing:
        kept = tokens * (layers_here * width * h + per_layer)  # layer inputs + one layer recomputed
    else:
        kept = tokens * layers_here * per_layer
    # Logits in compute dtype, their fp32 copy for the loss, and its gradient. Liger's fused
    # linear-cross-entropy never materialises them.
    logits = 0.0 if spec.use_liger_kernel else tokens * model.vocab_size * (width + 4 + width) / layout.tp
    return kept + logits


def _fsdp_mode(spec: JobSpec) -> tuple[bool, bool]:
    """(reshard after forward, offload) for the spec's fsdp words."""
    words = set((spec.fsdp or "").replace(",", " ").split())
    return "shard_grad_op" not in words, "offload" in words


def estimate_memory(spec: JobSpec, model: ModelConfig, layout: Layout | None = None) -> MemoryEstimate:
    """Estimated peak memory per GPU (GiB) with its parts; `layout` defaults to the spec alone."""
    layout = layout or compute_layout(spec)
    total = model.param_count()
    trainable = trainable_params(spec, model)
    expert_params = model.num_experts * model.moe_layers * sum(i * o for i, o in model.mlp_linears(model.moe_intermediate_size).values()) if model.is_moe else 0
    model_parallel = layout.tp * layout.pp
    local = (total - expert_params) / model_parallel + expert_params / (model_parallel * layout.ep)
    share = local / total
    frozen_local, train_local = (total - trainable) * share, trainable * share
    shard = max(1, layout.world // model_parallel)
    width = 4 if spec.torch_dtype == "float32" else 2
    master = 0 if spec.torch_dtype == "float32" else 4  # fp32 compute needs no separate master copy
    notes: list[str] = []

    zero = zero_settings(spec) if spec.deepspeed else None
    buckets = 0.0
    offloaded = 0.0
    if spec.fsdp:
        # FSDP2 keeps trainable weights sharded in fp32 and gathers 16-bit copies one block at a time.
        reshard, offload = _fsdp_mode(spec)
        gathered = 2 * width * model.layer_params(model.is_moe) / layout.tp  # current + prefetched block
        params = (width * frozen_local + 4 * train_local) / shard
        grads = 4 * train_local / shard
        optim = 8 * train_local / shard
        if offload:
            offloaded, params, grads, optim = params + grads + optim, 0.0, 0.0, 0.0
        params += gathered + (0 if reshard else width * local)
        notes.append("FSDP2: states sharded over %d ranks%s" % (shard, ", offloaded to CPU" if offload else ""))
    else:
        zero = zero or ZeroSettings(stage=0)
        stage = zero.stage
        n1, n2, n3 = (shard if stage >= 1 else 1), (shard if stage >= 2 else 1), (shard if stage >= 3 else 1)
        params = width * local / n3
        if stage == 3:
            params += 4 * model.largest_layer_params() / layout.tp  # DeepSpeed: 4 bytes x largest layer
        # 16-bit gradients until reduce-scattered (ZeRO-2), fp32 gradient partition (ZeRO-1).
        grads = 2 * train_local / n2 + 4 * train_local / n1 if master else 4 * train_local / n2
        optim = (master + 8) * train_local / n1
        if zero.offload_optimizer:
            offloaded += grads + optim
            grads = optim = 0.0
        if zero.offload_param and stage == 3:
            offloaded += width * local / n3
            params = 4 * model.largest_layer_params() / layout.tp
        if stage in (1, 2) and spec.deepspeed:
            buckets = OVERLAP_COMM_FACTOR * 2 * 2 * min(STAGE12_BUCKET, train_local)
        elif stage == 3:
            buckets = 2 * (model.hidden_size**2) * (2 + 4)  # prefetch (0.9 h^2, 16-bit) + reduce (h^2)
        if spec.deepspeed:
            notes.append(f"DeepSpeed ZeRO-{stage}, sharded over {shard} ranks" + (f", optimizer on {zero.offload_optimizer}" if zero.offload_optimizer else "") + (f", parameters on {zero.offload_param}" if zero.offload_param else ""))
        else:
            notes.append("DDP: every rank holds full model states")
    if spec.train_type == "lora":
        notes.append(f"LoRA: {trainable / 1e6:.1f}M trainable of {total / 1e6:.0f}M parameters")
    activations = _activation_bytes(spec, model, layout)
    return MemoryEstimate(
        parameters_gib=params / GIB,
        gradients_gib=grads / GIB,
        optimizer_gib=optim / GIB,
        activations_gib=activations / GIB,
        other_gib=(CUDA_CONTEXT_BYTES + buckets) / GIB,
        offloaded_gib=offloaded / GIB,
        total_params=total,
        trainable_params=trainable,
        notes=tuple(notes),
    )
