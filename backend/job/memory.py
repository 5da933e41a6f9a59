"""Per-GPU memory estimate of a job (pure arithmetic on the model's shape; no torch).

Public API:
    MemoryEstimate                                   GiB per GPU, broken down; `.to_dict()`
    estimate_memory(spec, model, layout=None, device="cuda", zero=None) -> MemoryEstimate
    trainable_params(spec, model) -> int

Model states follow what the worker's engines do (launcher/engines), in bytes per parameter with
bf16/fp16 compute and AdamW:
    DeepSpeed  weights 2, gradients 2 (16-bit) + 4 (fp32), optimizer 4 (fp32 master) + 8 (Adam):
               ZeRO-1 shards the fp32 gradients and the optimizer, ZeRO-2 all gradients, as
               DeepSpeed's ZeRO-2 estimator counts (2 + 18/N); the gradients come after the
               activations' peak (the 16-bit ones in backward, only with one micro-batch a step).
               ZeRO-3 holds 16/N between steps: weights 2, its 16-bit gradient partition 2
               (allocated at start), fp32 master 4, Adam 8. step() adds 6 bytes per element of one
               optimizer sub-group (sub_group_size elements of the rank's partition, flattened in
               16-bit, then copied to fp32) once backward has freed the activations, so they count
               once with those. Gathered layers add 4 x the largest layer. Measured on an H200
               (DeepSpeed 0.19.8; tests/test_memory.py MEASURED_ZERO3_H200): qwen2.5-0.5b held 18.2
               bytes per parameter between steps (16 + its reduce bucket) and 24.2 in step().
               DeepSpeed's estimator counts 18/N, neither of the two.
    FSDP2      fp32 weights 4, gradients 4, Adam 8, all sharded; two blocks gathered in 16-bit.
    DDP        full fine-tuning: FSDP2's with shards of one rank (compute-dtype copies kept through backward);
               LoRA and float16: fp32 weights 4 + autocast's 16-bit weight cache 2, gradients 4 +
               DDP bucket 4, Adam 8.
LoRA: only the adapters have gradients and optimizer states; they are counted where peft puts them
(on MoE models peft also adapts the router and the stacked experts). Offloaded states count in
`offloaded_gib` (host memory per GPU), not on the GPU. Sharding is over the ranks that hold the
same model slice: world / (TP x PP).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

from backend.job.capabilities import FsdpPlan, fsdp_plan
from backend.job.dsconfig import STAGE12_BUCKET, ZeroSettings, stage3_sizes, zero_settings
from backend.job.layout import Layout, compute_layout
from backend.job.modelcfg import VIDEO_FAMILIES, ModelConfig
from backend.job.spec import JobSpec

GIB = 2**30
CUDA_CONTEXT_BYTES = 0.75 * GIB  # CUDA context + cuBLAS/NCCL workspaces + allocator slack
# DeepSpeed docs: overlap_comm holds about 4.5 x the bucket sizes, in 16-bit, for both buckets.
OVERLAP_COMM_FACTOR = 4.5
# ZeRO-3's sub_group_size: the presets' value and DeepSpeed's default (a user JSON's is not read).
STAGE3_SUB_GROUP = 1_000_000_000
# peft on transformers >= 5 (peft/utils/transformers_weight_conversion.py; peft 0.21): for these MoE
# model types the names LoRA targeted on transformers 4's layout, the router `gate` and each
# expert's projections, are mapped onto the stacked parameters of transformers 5, and 'all-linear'
# includes them. A mapped name then targets no nn.Linear (a dense MLP's or shared expert's
# gate_proj is left alone); gate and up share gate_up_proj, at twice the rank. Qwen2-MoE itself is
# not mapped: its experts and router stay without adapters.
PEFT_EXPERT_NAMES = {
    "mixtral": {"gate": "router", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"},
    "qwen2_moe": {"gate": "router", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"},
}
PEFT_EXPERT_TYPES = {"mixtral": "mixtral", "qwen3_moe": "qwen2_moe", "deepseek_v2": "qwen2_moe", "deepseek_v3": "qwen2_moe"}


@dataclass(frozen=True)
class MemoryEstimate:
    parameters_gib: float
    gradients_gib: float
    optimizer_gib: float
    activations_gib: float
    other_gib: float
    offloaded_gib: float
    """Host (CPU/NVMe) memory per GPU for offloaded states and activations."""
    host_gib: float
    """The part of `offloaded_gib` in host memory (DeepSpeed's NVMe offload left out; a config
    offloading to both counts none of its states here)."""
    overlap_gib: float
    """Gradients allocated in backward (ZeRO-3: in step) while activations are freed: counted once in the total."""
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


class _Site(NamedTuple):
    """`count` matrices of (fan_in, fan_out) that peft gives a LoRA of `ranks` x lora_rank."""

    fan_in: int
    fan_out: int
    count: int
    ranks: int = 1
    linear: bool = True
    """An nn.Linear (peft's lora.Linear keeps a dropout copy of its input); False for a parameter
    peft wraps (lora.ParamWrapper, which takes no dropout): the router and the stacked experts."""
    attention: bool = False
    """One of the attention's linear layers (q, k, v, o)."""


def _lora_sites(spec: JobSpec, model: ModelConfig) -> list[_Site]:
    """Where peft puts adapters for `spec.target_modules` (leaf names, or 'all-linear': every
    nn.Linear but lm_head, and on the types of PEFT_EXPERT_TYPES the router and experts)."""
    linears = model.linear_modules()
    renamed = PEFT_EXPERT_NAMES.get(PEFT_EXPERT_TYPES.get(model.model_type, ""), {}) if model.is_moe else {}
    if "all-linear" in spec.target_modules:
        wanted = {name for name, _, _ in linears} | renamed.keys()
    else:
        wanted = set(spec.target_modules)
    attention = model.attention_linears()
    sites = [_Site(lin.fan_in, lin.fan_out, count, attention=name in attention)
             for name, lin, count in linears if name in wanted and name not in renamed]
    mapped = [renamed[name] for name in wanted if name in renamed]
    if "router" in mapped:
        sites.append(_Site(model.router().fan_in, model.router().fan_out, model.moe_layers, linear=False))
    for name, lin in model.expert_linears().items():
        # A stacked (experts, out, in) parameter gets lora_A (r x experts, in) and lora_B (out, r x experts).
        if name in mapped:
            sites.append(_Site(lin.fan_in, lin.fan_out, model.moe_layers, model.num_experts * mapped.count(name), linear=False))
    return sites


def adapts_stacked_params(spec: JobSpec, model: ModelConfig) -> bool:
    """Whether peft wraps stacked parameters (the router, the experts) for these LoRA targets."""
    return spec.train_type == "lora" and any(not s.linear for s in _lora_sites(spec, model))


def trainable_params(spec: JobSpec, model: ModelConfig) -> int:
    """Full fine-tuning: every parameter (a vision-language model's parts that freeze_vit,
    freeze_aligner and freeze_llm leave). LoRA: r x (in + out) per adapter, as peft builds them."""
    if spec.train_type == "full":
        return (0 if spec.freeze_llm and model.vision_tower else model.param_count()) + trainable_outside_llm(spec, model)
    return (sum(s.count * s.ranks * spec.lora_rank * (s.fan_in + s.fan_out) for s in _lora_sites(spec, model))
            + trainable_outside_llm(spec, model))


def trainable_outside_llm(spec: JobSpec, model: ModelConfig) -> int:
    """Of `trainable_params`, those of a vision tower and aligner: with them unfrozen, all of theirs
    under full fine-tuning; under LoRA the adapters on the tower blocks' linear layers (the aligner's
    few are left out)."""
    if spec.train_type != "full":
        shape = model.vision_shape
        if spec.freeze_vit or shape is None:
            return 0
        h, i = shape.width, shape.mlp_width
        # qkv (h -> 3h) or q, k and v, the projection, and the MLP's gate and up (h -> i) and down, or fc1 and fc2
        linears = (4 * h if shape.fused_qkv else 6 * h) + 2 * h + (3 if shape.gated else 2) * (h + i)
        return shape.layers * spec.lora_rank * linears
    return sum(count for count, frozen in ((model.vision_params, spec.freeze_vit),
                                           (model.aligner_params, spec.freeze_aligner)) if not frozen)


def _value_bytes(spec: JobSpec) -> int:
    """Bytes of one value in the compute dtype."""
    return 4 if spec.torch_dtype == "float32" else 2


def _norm_keeps(spec: JobSpec, fused: bool, trains: bool) -> int:
    """Values of its width an RMSNorm keeps for backward: a fused norm (Liger's; inductor's under
    torch_compile, which recomputes the casts), or any in float32, the residual itself; transformers'
    in 16 bits an fp32 copy (two values' bytes) and, where its weight `trains`, its normalised output."""
    if fused or _value_bytes(spec) == 4:
        return 1
    return 3 if trains else 2


def _casts_adapter_inputs(spec: JobSpec) -> bool:
    """LoRA's fp32 adapters on a 16-bit base under autocast (DDP and TP keep the base in the compute
    dtype, launcher.model.master_dtype); DeepSpeed and FSDP2 run adapters and base in one dtype."""
    return _value_bytes(spec) == 2 and not spec.deepspeed and not spec.fsdp


def _tower_activation_bytes(spec: JobSpec, model: ModelConfig) -> float:
    """What a vision tower keeps for backward for one micro-batch where it trains (a frozen tower's
    forward keeps nothing): each block as a decoder layer keeps its own (with nine values of the width
    for attention: its input, q, k, v, output and the copies its window attention makes; counted with
    saved-tensor hooks on Qwen2.5-VL's tower, tests/test_memory.py), the patches' pixels and the
    aligner's ~7 values of the width; freeze_vit with freeze_aligner off, the aligner's alone. A row's
    patches: one image of max_pixels, else as many as fill max_length with visual tokens."""
    shape = model.vision_shape
    if shape is None or (spec.freeze_vit and spec.freeze_aligner):
        return 0.0
    width = _value_bytes(spec)
    patches = shape.patches_per_token * spec.max_length
    if spec.max_pixels:
        patches = min(patches, spec.max_pixels // shape.patch_side ** 2)
    patches *= spec.per_device_train_batch_size
    h, aligner = shape.width, 7 * shape.width
    if spec.freeze_vit:
        return width * patches * aligner
    block = 2 * _norm_keeps(spec, fused=False, trains=spec.train_type == "full") * h + 9 * h + (4 if shape.gated else 2) * shape.mlp_width
    blocks = shape.layers * h + block if spec.gradient_checkpointing else shape.layers * block
    return width * patches * (blocks + shape.patch_values + aligner)


# Per token and vocabulary entry: the logits (compute dtype), their fp32 copy, log-softmax and its
# gradient. Measured on an H200 with transformers' loss (bench/memory_estimate.py): ~12 bytes.
LOGIT_BYTES = 12


def _activation_bytes(spec: JobSpec, model: ModelConfig, layout: Layout) -> tuple[float, float]:
    """Activations kept for backward for one micro-batch: (on one GPU, in its host memory)."""
    tokens = spec.per_device_train_batch_size * spec.max_length / (layout.cp * layout.sp)
    h = model.hidden_size
    kv = model.num_kv_heads * model.head_dim
    mlp_width = model.intermediate_size
    if model.is_moe:
        mlp_width = model.experts_per_token * model.moe_intermediate_size + model.shared_expert_intermediate_size
    width = _value_bytes(spec)
    q = model.num_heads * model.head_dim
    # Per token and layer, in values of the compute dtype, what autograd keeps (counted with saved-
    # tensor hooks on the CPU, tests/test_memory.py): each norm what `_norm_keeps` says. Attention:
    # its input, q, k, v and its output (o_proj's input is a view of it; SDPA/flash keep no s x s
    # matrix); the MLP's input; SwiGLU's gate and up and their product (down_proj's input), and
    # unfused also the activation.
    fused = spec.use_liger_kernel or spec.torch_compile
    norms = _norm_keeps(spec, fused, trains=spec.train_type == "full") * (
        model.norms_per_layer * h + ((q + kv) if model.qk_norm else 0))
    mlp = (3 if fused and not model.is_moe else 4) * mlp_width
    tile = 0.0
    if spec.tiled_mlp:
        # TiledMLP keeps its input and, in backward, that input's gradient (2h per token); the
        # SwiGLU intermediates exist for one tile of ~h tokens at a time (launcher.longseq.tile_count).
        mlp, tile = 2 * h, width * spec.per_device_train_batch_size * h * 4 * mlp_width / layout.tp
    per_layer = width * (norms + 2 * h + 2 * q + 2 * kv + mlp)
    if spec.train_type == "lora" and (spec.lora_dropout > 0 or _casts_adapter_inputs(spec)):
        # Each adapted layer keeps its own copy of its input (peft's dropout output, or the 16-bit
        # copy autocast makes of the fp32 copy peft makes for fp32 adapters), where the layers
        # reading one tensor (q, k, v; gate, up) would keep it once: the inputs above that only
        # the adapters keep (attention's, the MLP's, the SwiGLU product) are these copies. A tiled
        # MLP's adapters keep theirs for one tile.
        sites = [s for s in _lora_sites(spec, model) if s.linear and (s.attention or not spec.tiled_mlp)]
        copies = sum(s.fan_in * s.count for s in sites) / model.num_layers
        per_layer += width * max(0.0, copies - (h if spec.tiled_mlp else 2 * h + mlp_width))
    per_layer /= layout.tp
    # Under checkpointing, the backward of the recomputed layer holds its activations' gradients
    # beside them: ~7h per token for attention, norms and residual, ~2 x intermediate for the
    # SwiGLU (one tile's under TiledMLP). Fitted to LoRA on the Llama-3.1-8B shape at 16K-128K, with
    # and without tiling and offload, on an H200 (bench/results/h200-long-context-8b.jsonl).
    # A LoRA layer's 2 x intermediate are the SwiGLU's new gate and up gradients, or, with fp32
    # adapters, down_proj's adapter's fp32 input gradient. Liger's SwiGLU writes its gradients over
    # the inputs it saved, so LoRA with Liger and adapters in the compute dtype has neither: its
    # ZeRO-1/2/3 and FSDP2 rows at 8 x 8K were 5-12% high with them (bench/results/h100-advisor-5*).
    in_place_swiglu = spec.use_liger_kernel and not model.is_moe and spec.train_type == "lora" \
        and not _casts_adapter_inputs(spec)
    swiglu = 0 if spec.tiled_mlp or in_place_swiglu else 2 * mlp_width
    backward = tokens * width * (7 * h + swiglu) / layout.tp
    if spec.torch_compile and spec.train_type == "lora" and not spec.tiled_mlp and not model.is_moe:
        # inductor's backward of a LoRA-adapted dense layer holds five more values of the SwiGLU's
        # width and five fewer of the model's than eager's at its peak: the allocator's blocks live
        # there (bench/compile_memory.py --snapshot, bench/results/h100-compile-memory-3.jsonl; the
        # Llama-3.1-8B shape, 32 layers at 16K). Full fine-tuning's (a Llama-3.2-1B FSDP row is +4%
        # without this) and a MoE layer's are not measured.
        backward += tokens * width * 5 * (mlp_width - h) / layout.tp
    layers_here = model.num_layers / layout.pp
    inputs = tokens * layers_here * width * h  # what checkpointing keeps: each layer's input
    on_host = inputs if spec.gradient_checkpointing and spec.activation_cpu_offload else 0.0

    def kept(in_flight: float, logits: float = 0.0) -> float:
        if spec.gradient_checkpointing:
            # The loss's logits are freed before the last layer is recomputed: the peak is the
            # larger of the two beside the layers' inputs (a 3B LoRA row at 8K without Liger was 10% high
            # with their sum, bench/results/h100-advisor-5a.jsonl).
            return (inputs - on_host) * in_flight + max(logits, tokens * per_layer + tile + backward)
        return tokens * layers_here * per_layer * in_flight + tile + logits

    # Liger's fused linear-cross-entropy never materialises the logits. Under TP every rank holds
    # all of them: the TP plans gather lm_head's output for the loss (transformers' colwise_gather_output;
    # measured, bench/results/h200-layout-memory.jsonl).
    logits = 0.0 if spec.use_liger_kernel else tokens * model.vocab_size * LOGIT_BYTES
    if spec.rlhf_type:
        # A preference loss reads the logits (Liger's norms and SwiGLU only, no fused loss): kept in the
        # compute dtype with their gradient, and one row at a time has its float32 log-softmax
        # (forward) or softmax (backward) besides, with the kernels' float32 temporaries
        # (launcher.preference.TokenLogps): 16 bytes an entry of one row, fitted to the peaks of the
        # ten DPO runs of bench/results/h100-dpo-7.jsonl (seven within 1%; the log-softmax's 4 bytes
        # alone left the one-rank runs 3% low).
        logits = (tokens * 2 * width + spec.max_length / (layout.cp * layout.sp) * 16) * model.vocab_size
    if layout.pp == 1:
        return kept(1, logits), on_host
    # 1F1B: the first stage holds the activations of min(PP, micro-batches) micro-batches before its
    # first backward, the last stage one micro-batch and the logits; interleaving keeps Megatron's
    # factor 1 + (PP - 1) / (PP x virtual stages) more on the first (Narayanan et al., 2021).
    pp, virtual = layout.pp, spec.virtual_pipeline_model_parallel_size
    first = min(pp, spec.gradient_accumulation_steps) * (1 + (pp - 1) / (pp * virtual) if virtual > 1 else 1)
    return max(kept(first), kept(1, logits)), on_host * first


@dataclass(frozen=True)
class _Sizes:
    """Parameter counts on one GPU (after TP/PP/EP) and the sharding degree."""

    local: float
    trainable: float
    shard: int
    width: int
    """Bytes of one value in the compute dtype."""
    tp: int
    ep: int = 1


States = tuple[float, float, float, float, float, float, str]
"""Bytes on one GPU: parameters, gradients, optimizer, offloaded to host, buffers, the part of the
gradients first allocated while activations are being freed (in backward, or ZeRO-3's step); and a note."""


def _deepspeed_states(spec: JobSpec, model: ModelConfig, s: _Sizes, zero: ZeroSettings) -> States:
    """DeepSpeed casts the module to the compute dtype and keeps fp32 master weights (of the
    trainable parameters) in its optimizer: DeepSpeed's estimator multipliers, and ZeRO-3 as measured."""
    stage, n = zero.stage, s.shard
    n1, n2, n3 = (n if stage >= 1 else 1), (n if stage >= 2 else 1), (n if stage >= 3 else 1)
    mixed = s.width == 2
    gathered = 4 * model.largest_layer_params() / s.tp if stage == 3 else 0.0  # DeepSpeed: 4 bytes x largest layer
    params = s.width * s.local / n3 + gathered
    optim = (4 * mixed + 8) * s.trainable / n1
    if stage == 3:
        # The gradient partition in the compute dtype; step() flattens one sub-group of it and
        # converts that to fp32 (a no-op in fp32), after the activations are gone.
        transient = (s.width + 4 * mixed) * min(STAGE3_SUB_GROUP, s.trainable / n)
        grads = s.width * s.trainable / n + transient
    else:
        # 16-bit gradients (ZeRO-2: the rank's partition), filled in the first backward as its
        # activations are freed and kept through the step's later micro-batches; the fp32 gradient
        # partition, made in step() once the activations are gone (DeepSpeed 0.19's stage_1_and_2.py).
        fp32 = 4 * s.trainable / n1 if mixed else 0.0
        grads = 2 * s.trainable / n2 + fp32 if mixed else 4 * s.trainable / n2
        transient = grads if spec.gradient_accumulation_steps == 1 else fp32
    offloaded = 0.0
    if zero.offload_optimizer:
        offloaded, grads, optim, transient = grads + optim, 0.0, 0.0, 0.0
    if zero.offload_param and stage == 3:
        offloaded += params - gathered
        params = gathered
    if stage in (1, 2):
        buffers = OVERLAP_COMM_FACTOR * 2 * 2 * min(STAGE12_BUCKET, s.trainable)
    elif stage == 3:
        # The reduce bucket is allocated at start in the gradients' dtype (measured: 2 bytes per
        # element with bf16); prefetched parameters are gathered in the compute dtype.
        sizes = stage3_sizes(model.hidden_size)
        buffers = s.width * (sizes["stage3_prefetch_bucket_size"] + sizes["reduce_bucket_size"])
    else:
        buffers = 0.0
    where = "".join(f", {what} on {dev}" for what, dev in (("optimizer", zero.offload_optimizer), ("parameters", zero.offload_param)) if dev)
    return params, grads, optim, offloaded, buffers, transient, f"DeepSpeed ZeRO-{stage}, sharded over {n} ranks{where}"


def _gathered_layer(model: ModelConfig, s: _Sizes) -> float:
    """Parameters of one decoder layer on a rank once FSDP has gathered it: the dense part split over
    TP; the routed experts over EP (transformers' experts are not tensor-parallel)."""
    experts = model.routed_expert_params() if model.is_moe else 0
    return (model.layer_params(model.is_moe) - experts) / s.tp + experts / s.ep


def _fsdp_states(spec: JobSpec, model: ModelConfig, s: _Sizes, plan: FsdpPlan) -> States:
    """The worker's FSDP2: fp32 storage sharded, compute-dtype copies of one block (plus the
    prefetched one) gathered at a time; fp32 gradients reduce-scattered. DDP's layout on FSDP2
    (`plan.replicate`): shards of one rank, the compute-dtype copies kept from forward to backward."""
    if plan.replicate:
        s = replace(s, shard=1)
    gathered = 2 * s.width * _gathered_layer(model, s)
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


def _pipeline_states(spec: JobSpec, model: ModelConfig, s: _Sizes, dp: int) -> States:
    """launcher/engines/pp.py: one pipeline's stage is a plain module (DDP's states on one rank);
    over DP pipelines a stage is FSDP2, sharded with `fsdp` or in DDP's layout, its weights
    gathered through the step."""
    if dp == 1:
        return _ddp_states(spec, s, 1)
    plan = fsdp_plan(spec) or FsdpPlan(replicate=True, reshard_after_forward=False, offload=False)
    return _fsdp_states(spec, model, s, replace(plan, reshard_after_forward=False))


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
    trainable = trainable_params(spec, model)
    model_parallel = layout.tp * layout.pp
    # transformers' EP lays the experts over the same FSDP x TP ranks as the dense weights (EP groups
    # of whole experts, each sharded over the rest), so a rank stores 1/(TP x FSDP) of both; what EP
    # changes is what FSDP gathers for a layer: only the rank's own experts (`_Sizes.ep`). TP plans
    # cover the language model: a vision tower and aligner are whole on every TP rank.
    whole = model.vision_params + model.aligner_params
    whole_trainable = trainable_outside_llm(spec, model)
    total = model.param_count() + whole
    local = model.param_count() / model_parallel + whole
    shard = max(1, layout.world // model_parallel)
    sizes = _Sizes(local=local, trainable=(trainable - whole_trainable) / model_parallel + whole_trainable, shard=shard,
                   width=_value_bytes(spec), tp=layout.tp, ep=layout.ep)
    if spec.deepspeed:
        zero = zero or zero_settings(spec)
        states = _deepspeed_states(spec, model, sizes, zero)
    elif layout.pp > 1:
        states = _pipeline_states(spec, model, sizes, layout.dp)
    elif plan := fsdp_plan(spec):
        states = _fsdp_states(spec, model, sizes, plan)
    else:
        states = _ddp_states(spec, sizes, layout.world)
    params, grads, optim, offloaded, buckets, transient, note = states
    notes = [note]
    if spec.rlhf_type:
        # A micro-batch of pairs is twice as many sequences (chosen and rejected in one forward).
        spec = spec.model_copy(update={"per_device_train_batch_size": 2 * spec.per_device_train_batch_size})
        if spec.rlhf_type != "dpo":
            notes.append(f"{spec.rlhf_type}: no reference model; each pair is two sequences")
        elif spec.precompute_ref_log_probs and not (spec.ref_model or spec.ref_adapters):  # else held for the pass
            notes.append(f"{spec.rlhf_type}: the reference log-probs precomputed before training (no reference "
                         "model held); each pair is two sequences")
        elif spec.train_type == "full" or spec.ref_adapters:
            # FSDP2 and ZeRO-3 shard it as the policy (ZeRO-3 with parameter offload: on the host); else whole
            plan = None if spec.deepspeed else fsdp_plan(spec)
            sharded = zero.stage == 3 if spec.deepspeed else plan is not None and not plan.replicate
            on_host = bool(spec.deepspeed and sharded and zero.offload_param)
            reference = local * sizes.width / (sizes.shard if sharded else 1)
            if on_host:
                offloaded += reference
            else:
                params += reference
            where = "sharded as the policy" + (", on the host" if on_host else "") if sharded else "whole on every rank"
            what = "with ref_adapters merged in, held for the pass that precomputes its log-probs" \
                if spec.ref_adapters else ""
            notes.append(f"{spec.rlhf_type}: the reference is a frozen copy of the model{', ' + what if what else ''}, "
                         f"{where} ({reference / GIB:.1f} GiB); each pair is two sequences")
        else:
            notes.append(f"{spec.rlhf_type}: the reference is the model with its adapters off (no copy); each pair is "
                         "two sequences")
    if layout.tp > 1:
        notes.append(f"tensor parallel TP={layout.tp}: weights, gradients, optimizer states and most activations "
                     f"divided by {layout.tp}" + (" (the vision tower and aligner whole on every rank)" if whole else ""))
    if layout.ep > 1 and model.is_moe:
        notes.append(f"expert parallel EP={layout.ep}: each rank runs {model.num_experts // layout.ep} of the "
                     f"{model.num_experts} experts of a MoE layer and gathers only their weights; stored states are "
                     "sharded over all ranks with or without EP")
    if layout.sp > 1:
        notes.append(f"Ulysses SP={layout.sp}: each rank keeps the activations of 1/{layout.sp} of every sequence; "
                     "ZeRO shards over all ranks")
    if spec.train_type == "lora":
        notes.append(f"LoRA: {trainable / 1e6:.1f}M trainable of {total / 1e6:.0f}M parameters")
    if model.vision_tower and not model.vision_params:
        notes.append("the language model only: its vision tower is not counted (a family whose tower's size is "
                     "not known here)")
    elif model.vision_tower:
        trains = not (spec.freeze_vit and spec.freeze_aligner) and model.vision_shape is not None
        # a video's frames are bounded by max_length's visual tokens alone, more than an image of max_pixels
        videos = " (a sample's video may take more, up to visual tokens filling max_length: not counted)" \
            if spec.max_pixels and model.multimodal_type in VIDEO_FAMILIES else ""
        notes.append(f"vision tower {model.vision_params / 1e6:.0f}M and aligner {model.aligner_params / 1e6:.1f}M "
                     "parameters counted; images take their visual tokens of max_length" + (
                         f"; the {'aligner' if spec.freeze_vit else 'tower'}'s activations for "
                         + ("one image of max_pixels" + videos if spec.max_pixels else "visual tokens filling max_length")
                         + " a sample" if trains else " (a frozen tower keeps no activations)"))
    activations, activations_on_host = _activation_bytes(spec, model, layout)
    activations += _tower_activation_bytes(spec, model)  # whole on every TP rank, as its weights
    if spec.padding_free and spec.attn_impl not in ("flash_attention_2", "flash_attention_3", "flex_attention"):
        # transformers builds one boolean mask over the whole flattened row for sdpa and eager
        row = spec.per_device_train_batch_size * spec.max_length  # (pairs: already doubled above)
        activations += row * row
        notes.append(f"padding_free with attn_impl {spec.attn_impl or 'auto'}: a {row:,} x {row:,} attention mask of "
                     f"the flattened row ({row * row / GIB:.2f} GiB; none with flash-attention or flex_attention)")
    if activations_on_host:
        notes.append(f"activation offload: {activations_on_host / GIB:.1f} GiB of checkpointed layer inputs per GPU "
                     "in pinned host memory")
    return MemoryEstimate(
        overlap_gib=min(activations, transient) / GIB,
        parameters_gib=params / GIB,
        gradients_gib=grads / GIB,
        optimizer_gib=optim / GIB,
        activations_gib=activations / GIB,
        other_gib=((CUDA_CONTEXT_BYTES if device == "cuda" else 0.0) + buckets) / GIB,
        offloaded_gib=(offloaded + activations_on_host) / GIB,
        host_gib=((0.0 if spec.deepspeed and zero.uses_nvme else offloaded) + activations_on_host) / GIB,
        total_params=total,
        trainable_params=trainable,
        notes=tuple(notes),
    )
