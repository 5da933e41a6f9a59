"""Layout advisor (pure): the configurations of a job that the validator accepts and whose memory
estimate fits the GPUs, ranked by a cost model, the fastest predicted first. Every figure it gives
is a prediction (the cost model's and backend.job.memory's), never a measurement.

Public API:
    Hardware(gpu_mem_gib, peak_tflops, intra_gib_s, inter_gib_s)      what the cost model runs on
    Row                                       one configuration: the job fields it sets and its predictions
    Advice(rows, considered, refused, too_big, hardware)      .summary(): the counts, said to be predictions
    hardware_of(cluster, nnodes, **given) -> Hardware         the nodes' GPU memory unless given
    advise(spec, model, cluster=None, hardware=None, tokens_per_sample=None, margin=0.10, top=5) -> Advice

What it varies, keeping the job's global batch (micro-batch x accumulation x data-parallel ranks),
its nodes and processes per node: the engine (DDP, ZeRO-1/2/3, FSDP2, ZeRO-3 with CPU offload),
TP (within a node), PP, Ulysses SP and ring CP degrees whose product divides the world, EP for a
mixture of experts (multiples of TP dividing the world and the experts), the micro-batch (powers
of two) with the accumulation that keeps the global batch, gradient checkpointing, and Liger's
kernels where the validator allows them. The rest of the job (LoRA or full, max_length, packing,
torch_compile) is the user's.

The cost model (`_step_seconds`), per optimizer step:
  compute   tokens x FLOPs per token / (world x peak x MFU), plus MICRO_BATCH_S a micro-batch.
            FLOPs per token: 6 x the matmul parameters (4 x for LoRA: no weight gradients) + 12 x
            layers x hidden x sequence for attention; checkpointing adds a forward (2 x params + 4 x
            layers x hidden x sequence). MFU is BASE_MFU (from bench/results' H200 runs of the worker), times
            the engine's ENGINE_EFFICIENCY (LoRA: LORA_ENGINE_EFFICIENCY), times LIGER_SPEEDUP with Liger
            in full fine-tuning, times
            how full a micro-batch's tokens keep the GPU (HALF_TOKENS).
  data parallel  the trainable gradients' all-reduce (ZeRO-2: reduce-scatter + all-gather, the
            same bytes) over the ranks that are not TP or PP peers (DP x SP x CP), at the bandwidth
            between them, OVERLAP of it hidden behind the backward; ZeRO-3 and FSDP2 gather the
            parameters over the same ranks twice per micro-batch (forward and backward) on top:
            every stored one (all the experts), under EP only the rank's 1/EP of the routed experts.
  TP        4 all-reduces of a micro-batch's activations per layer (2 forward, 2 backward), within a
            node, not hidden.
  SP / CP   Ulysses: 8 all-to-alls of the activations per layer; ring: the keys and values passed
            CP - 1 times per layer, forward and backward, not hidden; between nodes when the
            TP x SP x CP group is larger than a node.
  EP        each MoE layer sends every routed copy of a token (experts per token of them) to its
            expert and back, forward and backward (4 all-to-alls), (EP - 1) / EP of it to other
            ranks, not hidden; between nodes when EP is larger than a node.
  PP        the 1F1B bubble (capabilities.bubble_fraction): the busy time over 1 - the idle share.
  offload   the optimizer states across PCIe (PCIE_GIB_S) both ways each step.
Bandwidth is `intra_gib_s` between GPUs of a node and `inter_gib_s` between nodes (the pre-flight's
measured bus bandwidth, where the user gives it).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from backend.job.capabilities import bubble_fraction
from backend.job.cluster import Cluster
from backend.job.layout import Layout, compute_layout
from backend.job.memory import trainable_params
from backend.job.modelcfg import ModelConfig
from backend.job.spec import JobSpec
from backend.job.validate import assess, errors

# name: the job fields that select the engine (the others reset).
ENGINES: dict[str, dict[str, Any]] = {
    "DDP": {},
    "ZeRO-1": {"deepspeed": "zero1"},
    "ZeRO-2": {"deepspeed": "zero2"},
    "ZeRO-3": {"deepspeed": "zero3"},
    "FSDP2": {"fsdp": "full_shard"},
    "ZeRO-3 + offload": {"deepspeed": "zero3_offload"},
}
ENGINE_EFFICIENCY = {"DDP": 1.0, "ZeRO-1": 0.90, "ZeRO-2": 0.90, "ZeRO-3": 0.53, "FSDP2": 0.99, "ZeRO-3 + offload": 0.53}
"""The worker's tokens/s on each engine over its tokens/s on DDP: full fine-tuning of the Qwen2.5-1.5B
shape at 2048 tokens on two H200s, medians of bench/results/h200x2-suite-3..6.jsonl (DDP 93,993,
ZeRO-2 84,336, FSDP2 full_shard 92,733, ZeRO-3 50,253; ZeRO-3 runs uncompiled, the others compiled).
What sets them apart is each engine's own work (DeepSpeed's hooks around every module under ZeRO-3),
not traffic: two ranks over NVLink are a few per cent of those steps by the model below. ZeRO-1 is
taken as ZeRO-2 (DeepSpeed's same optimizer code; not measured apart), offload as ZeRO-3 with its
PCIe traffic on top."""
LORA_ENGINE_EFFICIENCY = {**ENGINE_EFFICIENCY, "FSDP2": 1.10, "ZeRO-1": 0.97, "ZeRO-2": 0.97, "ZeRO-3": 0.43,
                          "ZeRO-3 + offload": 0.43}
"""LoRA's, on one H100 (the Qwen2.5-1.5B shape at 4096 tokens, 4 a micro-batch, Liger), over DDP's:
FSDP2 ran LoRA faster than DDP, 1.17x in one call (43,700 tokens/s against 37,448;
bench/results/h100-lora-engines.jsonl) and 1.03x in another (38,261 against 37,304;
h100-lora-engines-2.jsonl), so the mean of the two; the Llama-3.2-3B shape at 8192 ran it 1.13x with
Liger, 1.08x without (h100-advisor-1.jsonl). Why is not established. ZeRO-1 36,185 and ZeRO-2 36,080
(0.97x), ZeRO-3 15,988 (0.43x), in the second call; offload as ZeRO-3 with its PCIe traffic on top.
Not from the held-out 3B job (h100-advisor-5*.jsonl: ZeRO-1/2 1.16x DDP's speed, ZeRO-3 0.51x)."""
LIGER_SPEEDUP = 1.15
"""Liger's fused kernels in full fine-tuning: 1.15-1.20x the tokens/s of the same stock HF run without
(../shared/bench/hf_baseline_h200.jsonl); LoRA ran as fast without them there, so LoRA gets none
(at 8192 tokens Liger made LoRA 1.3x faster, h100-advisor-1.jsonl: not modelled yet)."""
BASE_MFU = 0.44 / LIGER_SPEEDUP
"""The worker's model FLOPs utilisation without Liger or compile: with Liger, eager, full fine-tuning
of the Qwen2.5-1.5B and Llama-3.2-1B shapes on one H200 measured 0.42-0.47
(bench/results/h200-suite-1/2.jsonl, h200x2-suite-4/5.jsonl), divided by LIGER_SPEEDUP."""
FULL_TOKENS = 16384
"""Tokens in a micro-batch of those runs (8 x 2048, 4 x 4096): BASE_MFU is for micro-batches this size."""
HALF_TOKENS = 1024
"""An assumption, not yet measured: a micro-batch of this many tokens runs at half the MFU of a very
large one (kernels fill with tokens); MFU scales as t / (t + HALF_TOKENS), 1 at FULL_TOKENS."""
MICRO_BATCH_S = 0.005
"""Fixed cost of a micro-batch (launches, the Python loop), an assumption."""
OVERLAP = 0.5
"""The share of the data-parallel traffic hidden behind the backward (DDP's buckets, ZeRO's overlap_comm)."""
PCIE_GIB_S = 20.0
BATCH_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "per_device_eval_batch_size")
"""Fields whose refusal may depend on the micro-batch (the rest refuse an engine or degrees whatever it is)."""
VARIED = ("deepspeed", "fsdp", "tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel_size",
          "context_parallel_size", "expert_model_parallel_size", "per_device_train_batch_size",
          "gradient_accumulation_steps", "gradient_checkpointing", "use_liger_kernel")
"""The job fields a row may set; the others are the user's."""
BYTES = 2  # bf16 activations, gradients and gathered parameters


@dataclass(frozen=True)
class Hardware:
    gpu_mem_gib: float = 80.0
    peak_tflops: float = 989.0
    """Dense bf16 peak per GPU (H100/H200)."""
    intra_gib_s: float = 300.0
    """Bus bandwidth between the GPUs of one node (NVLink; the x2-x8 H100 machines measured 329-361 GB/s)."""
    inter_gib_s: float = 20.0
    """Bus bandwidth between nodes (give the pre-flight's measured figure)."""


@dataclass(frozen=True)
class Row:
    engine: str
    layout: str
    """Its ranks as Layout.name gives them (DP×TP×SP×CP, PP where used)."""
    fields: dict[str, Any]
    """The job fields this row sets; applying them to the job gives the configuration."""
    memory_gib: float
    """Predicted per-GPU peak (backend.job.memory's estimate, the CUDA context included)."""
    tokens_per_s: float
    """Predicted, by the cost model."""
    step_s: float
    parts: dict[str, float] = field(default_factory=dict)
    """The step's predicted seconds by part: compute, data_parallel, model_parallel, bubble, offload."""

    def changes(self) -> str:
        """The fields it sets, as `name=value` words (None: the field cleared)."""
        return " ".join(f"{k}={v}" for k, v in self.fields.items() if v is not None) or "(the job as it is)"

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "layout": self.layout, "fields": self.fields,
                "predicted_memory_gib": round(self.memory_gib, 2), "predicted_tokens_per_s": round(self.tokens_per_s),
                "predicted_step_s": round(self.step_s, 4), "predicted_parts_s": {k: round(v, 4) for k, v in self.parts.items()}}


@dataclass(frozen=True)
class Advice:
    rows: list[Row]
    """The fitting configurations, fastest predicted first (at most `top`)."""
    considered: int
    refused: dict[str, int]
    """Configurations the validator refused, counted by the field it named first."""
    too_big: int
    """Valid configurations whose estimate does not fit the GPU with the margin."""
    hardware: Hardware

    def summary(self) -> str:
        refused = ", ".join(f"{k} {v}" for k, v in self.refused.items()) or "none"
        return (f"{self.considered} configurations considered: {sum(self.refused.values())} refused by validation "
                f"({refused}), {self.too_big} over {self.hardware.gpu_mem_gib:.0f} GiB less the margin; "
                "predictions of the cost model, not measurements")


def hardware_of(cluster: Cluster, nnodes: int, **given: float | None) -> Hardware:
    """Hardware's defaults, the smallest GPU memory the job's nodes report, then what is `given`
    (Hardware's field names; None: not given)."""
    known = [node.gpu_mem_gib for node in cluster.nodes[:nnodes] if node.gpu_mem_gib]
    found = {"gpu_mem_gib": min(known)} if known else {}
    return Hardware(**{**found, **{k: v for k, v in given.items() if v}})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidates(layout: Layout, global_batch: int, liger_choices: tuple[bool, ...], experts: int):
    """(engine, the fields of a configuration but its micro-batch, its (micro-batch, accumulation)
    choices, largest first) for every engine, degree, checkpointing and Liger setting whose ranks
    divide the world and whose data-parallel ranks divide the global batch; EP degrees (multiples
    of TP that divide the world and the `experts`) for a mixture of experts, 1 otherwise."""
    world, per_node = layout.world, layout.nproc_per_node
    for tp, pp, sp, cp in itertools.product(_divisors(per_node), _divisors(world), _divisors(world), _divisors(world)):
        if world % (tp * pp * sp * cp) or (sp > 1 and cp > 1):
            continue
        dp = world // (tp * pp * sp * cp)
        if global_batch % dp:
            continue
        per_rank = global_batch // dp
        micro = [(m, per_rank // m) for m in (2 ** k for k in range(per_rank.bit_length())) if per_rank % m == 0][::-1]
        eps = [ep for ep in _divisors(world) if ep % tp == 0 and experts % ep == 0] if experts else [1]
        for ep, (engine, engine_fields), checkpointing, liger in itertools.product(
                eps, ENGINES.items(), (False, True), liger_choices):
            yield engine, {"deepspeed": None, "fsdp": None, **engine_fields, "tensor_model_parallel_size": tp,
                           "pipeline_model_parallel_size": pp, "sequence_parallel_size": sp, "context_parallel_size": cp,
                           "expert_model_parallel_size": ep, "gradient_checkpointing": checkpointing,
                           "use_liger_kernel": liger}, micro


def advise(spec: JobSpec, model: ModelConfig, cluster: Cluster | None = None, hardware: Hardware | None = None,
           tokens_per_sample: float | None = None, margin: float = 0.10, top: int = 5) -> Advice:
    """`tokens_per_sample`: the data's mean sample length (the data preview's); max_length where not
    given or with packing (rows are filled)."""
    hardware = hardware or Hardware()
    layout = compute_layout(spec, cluster)
    global_batch = spec.per_device_train_batch_size * spec.gradient_accumulation_steps * layout.dp
    tokens = spec.max_length if spec.packing or not tokens_per_sample else min(tokens_per_sample, spec.max_length)
    rows, refused, too_big, considered = [], {}, 0, 0
    for engine, common, micro_choices in _candidates(layout, global_batch, (False, True),
                                                     model.num_experts if model.is_moe else 0):
        for micro, accumulation in micro_choices:
            fields = {**common, "per_device_train_batch_size": micro, "gradient_accumulation_steps": accumulation}
            considered += 1
            candidate = spec.model_copy(update={**fields, "nproc_per_node": layout.nproc_per_node})
            assessed = assess(candidate, cluster, model)
            found = errors(assessed.problems)
            if found:
                refused[found[0].field] = refused.get(found[0].field, 0) + 1
                if found[0].field not in BATCH_FIELDS:
                    break  # the engine or degrees are refused: so are they with any micro-batch
                continue
            memory = assessed.memory.total_gib if assessed.memory else None
            if memory is None or memory > hardware.gpu_mem_gib * (1 - margin):
                too_big += 1
                continue
            here = compute_layout(candidate, cluster)
            parts = _step_seconds(candidate, model, here, hardware, tokens, global_batch)
            step = sum(parts.values())
            shown = {k: v for k, v in fields.items() if v != getattr(spec, k) or k in ("deepspeed", "fsdp")}
            rows.append(Row(engine, here.name(), shown, memory, global_batch * tokens / step, step, parts))
            if here.pp == 1:
                # Without a pipeline a larger micro-batch is never predicted slower (fuller kernels,
                # fewer micro-batches and gathers): the smaller ones need not be tried.
                break
    rows.sort(key=lambda r: (-r.tokens_per_s, r.memory_gib))
    return Advice(rows[:top], considered, dict(sorted(refused.items(), key=lambda kv: -kv[1])), too_big, hardware)


def engine_of(spec: JobSpec) -> str:
    """The ENGINES name of a configuration `advise` made (its engine fields are one of ENGINES')."""
    return next(name for name, fields in ENGINES.items()
                if (spec.deepspeed, spec.fsdp) == (fields.get("deepspeed"), fields.get("fsdp")))


def matmul_params(model: ModelConfig) -> int:
    """Parameters a token passes through in matrix products (the input embedding is a lookup; a
    tied output layer is a product all the same): what FLOPs per token count."""
    h = model.hidden_size
    return model.active_param_count() - model.embedding_params * (1 if model.tie_word_embeddings else 2) + h * model.vocab_size


def _step_seconds(spec: JobSpec, model: ModelConfig, layout: Layout, hw: Hardware, tokens: float,
                  global_batch: int) -> dict[str, float]:
    """The cost model of the module docstring: predicted seconds of one optimizer step, by part."""
    params, h, layers = matmul_params(model), model.hidden_size, model.num_layers
    attention = 12 * layers * h * tokens
    per_token = (4 if spec.train_type == "lora" else 6) * params + attention
    if spec.gradient_checkpointing:
        per_token += 2 * params + attention / 3
    micro_tokens = spec.per_device_train_batch_size * tokens / (layout.sp * layout.cp)
    # not above the measured MFU: larger micro-batches than the benchmarks' are not extrapolated
    fill = min(1.0, (micro_tokens / (micro_tokens + HALF_TOKENS)) / (FULL_TOKENS / (FULL_TOKENS + HALF_TOKENS)))
    liger = LIGER_SPEEDUP if spec.use_liger_kernel and spec.train_type == "full" else 1.0
    engines = LORA_ENGINE_EFFICIENCY if spec.train_type == "lora" else ENGINE_EFFICIENCY
    mfu = BASE_MFU * engines[engine_of(spec)] * liger * fill
    step_tokens = global_batch * tokens
    compute = (step_tokens * per_token / (layout.world * hw.peak_tflops * 1e12 * mfu)
               + MICRO_BATCH_S * spec.gradient_accumulation_steps)
    # Gradients are reduced, and ZeRO-3 / FSDP2 shard the parameters, over every rank that is not a
    # TP or PP peer: the data-parallel ranks and the SP or CP ranks of each sequence.
    group = layout.dp * layout.sp * layout.cp
    per_node = max(1, layout.nproc_per_node // layout.tp)
    group_gib_s = hw.inter_gib_s if group > per_node else hw.intra_gib_s
    # a TP or PP rank holds 1/(TP x PP) of the parameters and their gradients
    trainable = trainable_params(spec, model) / (layout.tp * layout.pp)
    ring = 2 * (group - 1) / group
    data_parallel = ring * trainable * BYTES / (group_gib_s * 2**30) * (1 - OVERLAP)
    sharded = spec.fsdp or (spec.deepspeed or "").startswith("zero3")
    if sharded and group > 1:  # every micro-batch gathers the parameters forward and backward
        # every stored parameter (all the experts, which transformers does not split over TP);
        # under EP a rank gathers only its own experts
        routed = model.routed_expert_params() * model.moe_layers if model.is_moe else 0  # (per layer)
        stored = ((model.param_count() - routed) / layout.tp + routed / layout.ep) / layout.pp
        data_parallel += 2 * (group - 1) / group * stored * BYTES * \
            spec.gradient_accumulation_steps / (group_gib_s * 2**30) * (1 - OVERLAP)
    micro_activations = spec.per_device_train_batch_size * tokens * h * BYTES
    micro_batches = spec.gradient_accumulation_steps
    tp_bytes = 4 * 2 * (layout.tp - 1) / layout.tp * micro_activations * layers / layout.pp
    sequence_bytes = 8 * (layout.sp - 1) / layout.sp * micro_activations / layout.sp * layers / layout.pp
    if layout.cp > 1:
        kv_bytes = spec.per_device_train_batch_size * tokens / layout.cp * 2 * model.num_kv_heads * model.head_dim * BYTES
        sequence_bytes += 2 * (layout.cp - 1) * kv_bytes * layers / layout.pp
    sequence_gib_s = hw.inter_gib_s if layout.tp * layout.sp * layout.cp > layout.nproc_per_node else hw.intra_gib_s
    expert_bytes = (4 * (layout.ep - 1) / layout.ep * micro_activations * model.experts_per_token * model.moe_layers
                    / layout.pp if model.is_moe else 0.0)
    expert_gib_s = hw.inter_gib_s if layout.ep > layout.nproc_per_node else hw.intra_gib_s
    model_parallel = micro_batches * (tp_bytes / (hw.intra_gib_s * 2**30) + sequence_bytes / (sequence_gib_s * 2**30)
                                      + expert_bytes / (expert_gib_s * 2**30))
    busy = compute + model_parallel
    idle = bubble_fraction(spec)
    bubble = busy * idle / (1 - idle)
    offload = (2 * trainable * 12 / (PCIE_GIB_S * 2**30)) if "offload" in (spec.deepspeed or "") + (spec.fsdp or "") else 0.0
    return {"compute": compute, "data_parallel": data_parallel, "model_parallel": model_parallel, "bubble": bubble,
            "offload": offload}
