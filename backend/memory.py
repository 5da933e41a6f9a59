"""Per-GPU memory estimate of a job (pure arithmetic on the model's shape; no torch).

Public API:
    MemoryEstimate                                   GiB per GPU, broken down; `.to_dict()`
    estimate_memory(spec, model, layout=None, device="cuda", zero=None) -> MemoryEstimate
    trainable_params(spec, model) -> int

Model states follow what the worker's engines do (launcher/engines), in bytes per parameter with
bf16/fp16 compute and AdamW:
    DeepSpeed  weights 2, gradients 2 (16-bit) + 4 (fp32), optimizer 4 (fp32 master) + 8 (Adam):
               ZeRO-1 shards the fp32 gradients and the optimizer, ZeRO-2 all gradients, ZeRO-3
               the weights too (plus 4 x the largest layer gathered). These are the multipliers of
               DeepSpeed's own estimators (2 + 18/N for ZeRO-2, 4 x largest layer + 18/N for ZeRO-3).
    FSDP2      fp32 weights 4, gradients 4, Adam 8, all sharded; two blocks gathered in 16-bit.
    DDP        full fine-tuning: FSDP2's with shards of one rank (compute-dtype copies kept through backward);
               LoRA and float16: fp32 weights 4 + autocast's 16-bit weight cache 2, gradients 4 +
               DDP bucket 4, Adam 8.
LoRA: only the adapters have gradients and optimizer states. Offloaded states count in
`offloaded_gib` (host memory per GPU), not on the GPU. Sharding is over the ranks that hold the
same model slice: world / (TP x PP).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from backend.capabilities import FsdpPlan, fsdp_plan
from backend.dsconfig import STAGE12_BUCKET, ZeroSettings, stage3_sizes, zero_settings
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
    overlap_gib: float
    """Gradients allocated in backward while activations are freed: counted once in the total."""
    total_params: int
    trainable_params: int
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def model_states_gib(self) -> float:
        return self.parameters_gib + self.gradients_gib + self.optimizer_gib

    @property
    def total_gib(self) -> float:
        """The estimated peak: the parts, less what gradients and activations share in time."""
        return self.model_states_gib + self.activations_gib + self.other_gib - self.overlap_gib

    def to_dict(self) -> dict:
        data = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}
        data["notes"] = list(self.notes)
        data["model_states_gib"] = round(self.model_states_gib, 3)
        data["total_gib"] = round(self.total_gib, 3)
        return data

    def summary(self) -> str:
        return (f"~{self.total_gib:.1f} GiB per GPU (params {self.parameters_gib:.1f}, grads {self.gradients_gib:.1f}, "
                f"optimizer {self.optimizer_gib:.1f}, activations {self.activations_gib:.1f}, other {self.other_gib:.1f})")


def _adapted_linears(spec: JobSpec, model: ModelConfig) -> list[tuple[int, int, int]]:
    """(fan_in, fan_out, how many) of the linear layers LoRA adapts."""
    wanted = set(ALL_LINEAR) if "all-linear" in spec.target_modules else set(spec.target_modules)
    out = [(i, o, model.num_layers) for name, (i, o) in model.attention_linears().items() if name in wanted]
    # Dense MLPs (and MoE shared experts) are nn.Linear; fused expert weights are not adapted by peft.
    mlps = [(model.num_layers - model.moe_layers, model.intermediate_size)]
    if model.shared_expert_intermediate_size:
        mlps.append((model.moe_layers, model.shared_expert_intermediate_size))
    for layers, intermediate in mlps:
        out += [(i, o, layers) for name, (i, o) in model.mlp_linears(intermediate).items() if name in wanted]
    return out


def trainable_params(spec: JobSpec, model: ModelConfig) -> int:
    """Full fine-tuning: every parameter. LoRA: r x (in + out) per adapted linear layer."""
    if spec.train_type == "full":
        return model.param_count()
    return sum(count * spec.lora_rank * (fan_in + fan_out) for fan_in, fan_out, count in _adapted_linears(spec, model))


# Per token and vocabulary entry: the logits (compute dtype), their fp32 copy, log-softmax and its
# gradient. Measured on an H200 with transformers' loss (bench/memory_estimate.py): ~12 bytes.
LOGIT_BYTES = 12


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
    per_layer = width * (6 * h + 2 * kv + 4 * mlp_width)
    if spec.train_type == "lora" and spec.lora_dropout > 0:
        # peft applies dropout to each adapted layer's input separately and keeps the copy.
        per_layer += width * sum(fan_in * count for fan_in, _, count in _adapted_linears(spec, model)) / model.num_layers
    per_layer /= layout.tp
    layers_here = model.num_layers / layout.pp
    if spec.gradient_checkpointing:
        kept = tokens * (layers_here * width * h + per_layer)  # layer inputs + one layer recomputed
    else:
        kept = tokens * layers_here * per_layer
    # Liger's fused linear-cross-entropy never materialises the logits.
    logits = 0.0 if spec.use_liger_kernel else tokens * model.vocab_size * LOGIT_BYTES / layout.tp
    return kept + logits


@dataclass(frozen=True)
class _Sizes:
    """Parameter counts on one GPU (after TP/PP/EP) and the sharding degree."""

    local: float
    trainable: float
    shard: int
    width: int
    """Bytes of one value in the compute dtype."""
    tp: int


States = tuple[float, float, float, float, float, float, str]
"""Bytes on one GPU: parameters, gradients, optimizer, offloaded to host, buffers, the part of the
gradients first allocated in backward (while activations are being freed); and a note."""


def _deepspeed_states(spec: JobSpec, model: ModelConfig, s: _Sizes, zero: ZeroSettings) -> States:
    """DeepSpeed casts the module to the compute dtype and keeps fp32 master weights (of the
    trainable parameters) in its optimizer: DeepSpeed's estimator multipliers."""
    stage, n = zero.stage, s.shard
    n1, n2, n3 = (n if stage >= 1 else 1), (n if stage >= 2 else 1), (n if stage >= 3 else 1)
    mixed = s.width == 2
    params = s.width * s.local / n3
    if stage == 3:
        params += 4 * model.largest_layer_params() / s.tp  # DeepSpeed: 4 bytes x largest layer
    # 16-bit gradients until reduce-scattered (ZeRO-2), fp32 gradient partition (ZeRO-1).
    grads = 2 * s.trainable / n2 + 4 * s.trainable / n1 if mixed else 4 * s.trainable / n2
    optim = (4 * mixed + 8) * s.trainable / n1
    offloaded = 0.0
    if zero.offload_optimizer:
        offloaded, grads, optim = grads + optim, 0.0, 0.0
    if zero.offload_param and stage == 3:
        offloaded += params - 4 * model.largest_layer_params() / s.tp
        params = 4 * model.largest_layer_params() / s.tp
    if stage in (1, 2):
        buffers = OVERLAP_COMM_FACTOR * 2 * 2 * min(STAGE12_BUCKET, s.trainable)
    elif stage == 3:
        sizes = stage3_sizes(model.hidden_size)  # prefetch (16-bit) + reduce (16-bit and fp32) buckets
        buffers = 2 * sizes["stage3_prefetch_bucket_size"] + (2 + 4) * sizes["reduce_bucket_size"]
    else:
        buffers = 0.0
    where = "".join(f", {what} on {dev}" for what, dev in (("optimizer", zero.offload_optimizer), ("parameters", zero.offload_param)) if dev)
    # DeepSpeed allocates its gradient partitions and buckets up front: no overlap with activations.
    return params, grads, optim, offloaded, buffers, 0.0, f"DeepSpeed ZeRO-{stage}, sharded over {n} ranks{where}"


def _fsdp_states(spec: JobSpec, model: ModelConfig, s: _Sizes, plan: FsdpPlan) -> States:
    """The worker's FSDP2: fp32 storage sharded, compute-dtype copies of one block (plus the
    prefetched one) gathered at a time; fp32 gradients reduce-scattered. DDP's layout on FSDP2
    (`plan.replicate`): shards of one rank, the compute-dtype copies kept from forward to backward."""
    if plan.replicate:
        s = replace(s, shard=1)
    gathered = 2 * s.width * model.layer_params(model.is_moe) / s.tp
    params, grads, optim = 4 * s.local / s.shard, 4 * s.trainable / s.shard, 8 * s.trainable / s.shard
    offloaded = 0.0
    if plan.offload:
        offloaded, params, grads, optim = params + grads + optim, 0.0, 0.0, 0.0
    params += gathered + (0 if plan.reshard_after_forward else s.width * s.local)
    transient = grads
    if spec.gradient_accumulation_steps > 1:
        grads += 4 * s.trainable  # micro-batches before the last accumulate unsharded gradients
    note = "DDP (on FSDP2): every rank holds the full model states" if plan.replicate else \
        f"FSDP2, sharded over {s.shard} ranks" + (", offloaded to CPU" if plan.offload else "")
    return params, grads, optim, offloaded, 0.0, transient, note


def _ddp_states(spec: JobSpec, s: _Sizes, world: int) -> States:
    """torch's DDP (LoRA, and full fine-tuning in float16; other full fine-tuning runs on FSDP2):
    fp32 weights, fp32 gradients (plus DDP's bucket copy), AdamW; a LoRA base
    is frozen and kept in the compute dtype (`launcher.model.master_dtype`). Autocast caches
    16-bit copies of trainable weights; without checkpointing backward keeps them."""
    weights = 4 * s.trainable + s.width * (s.local - s.trainable)  # frozen only with LoRA
    cached = s.width * s.trainable if s.width == 2 and not spec.gradient_checkpointing else 0.0
    grads = 4 * s.trainable * (2 if world > 1 else 1)
    # param.grad is allocated in backward; DDP's buckets (world > 1) exist from the start.
    return weights + cached, grads, 8 * s.trainable, 0.0, 0.0, 4 * s.trainable, "DDP: every rank holds the full model states"


def estimate_memory(spec: JobSpec, model: ModelConfig, layout: Layout | None = None,
                    device: str = "cuda", zero: ZeroSettings | None = None) -> MemoryEstimate:
    """Estimated peak memory per GPU (GiB) with its parts; `layout` defaults to the spec alone.
    `device="cpu"` (gloo ranks) leaves out the CUDA context and workspaces. `zero`: the job's
    DeepSpeed settings where the caller has them, so a user JSON is not read again."""
    layout = layout or compute_layout(spec)
    total = model.param_count()
    trainable = trainable_params(spec, model)
    expert_params = model.num_experts * model.moe_layers * sum(i * o for i, o in model.mlp_linears(model.moe_intermediate_size).values()) if model.is_moe else 0
    model_parallel = layout.tp * layout.pp
    local = (total - expert_params) / model_parallel + expert_params / (model_parallel * layout.ep)
    shard = max(1, layout.world // model_parallel)
    sizes = _Sizes(local=local, trainable=trainable * local / total, shard=shard,
                   width=4 if spec.torch_dtype == "float32" else 2, tp=layout.tp)
    if spec.deepspeed:
        states = _deepspeed_states(spec, model, sizes, zero or zero_settings(spec))
    elif plan := fsdp_plan(spec):
        states = _fsdp_states(spec, model, sizes, plan)
    else:
        states = _ddp_states(spec, sizes, layout.world)
    params, grads, optim, offloaded, buckets, transient, note = states
    notes = [note]
    if spec.train_type == "lora":
        notes.append(f"LoRA: {trainable / 1e6:.1f}M trainable of {total / 1e6:.0f}M parameters")
    activations = _activation_bytes(spec, model, layout)
    return MemoryEstimate(
        overlap_gib=min(activations, transient) / GIB,
        parameters_gib=params / GIB,
        gradients_gib=grads / GIB,
        optimizer_gib=optim / GIB,
        activations_gib=activations / GIB,
        other_gib=((CUDA_CONTEXT_BYTES if device == "cuda" else 0.0) + buckets) / GIB,
        offloaded_gib=offloaded / GIB,
        total_params=total,
        trainable_params=trainable,
        notes=tuple(notes),
    )
