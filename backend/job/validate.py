"""Cross-field and cluster rules for a job: every problem at once, each naming its field.

Public API:
    assess(spec, cluster=None, model_config=None) -> Assessment
        Everything a job on a cluster is judged by, computed once: the problems, the layout, the
        model config (or why there is none), the DeepSpeed config as read, the memory estimate.
        The form shows it, the planner and a launch reuse it. cluster None = the local machine;
        model_config None = looked up from spec.model (local directory, bundled config, hub cache).
    validate(spec, cluster=None, model_config=None) -> list[Problem]
        `assess(...).problems`: errors have severity "error", risky but legal choices "warning".
        Includes `backend.job.capabilities.unsupported(spec)` (what the worker refuses).
    errors(problems) -> list[Problem]
"""
from __future__ import annotations

import functools
import os

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.job import capabilities, records
from backend.job.cluster import Cluster, local_cluster
from backend.job.dsconfig import DsConfigError, ZeroSettings, base_config, user_batch_conflicts
from backend.job.layout import Layout, compute_layout
from backend.job.memory import MemoryEstimate, adapts_stacked_params, estimate_memory
from backend.job.modelcfg import (TILED_FAMILIES, TP_UNPLANNED_FAMILIES, VIDEO_FAMILIES, VISION_FAMILIES, ModelConfig,
                                  ModelConfigError, find_model_config)
from backend.job.modelfiles import dir_problems, model_dirs, with_adapter_settings
from backend.job.spec import JobSpec, Problem, absolute_dir

LONG_SEQUENCE = 4096  # above this, activations without checkpointing dominate memory
HIGH_LEARNING_RATE = 0.1  # fine-tuning uses ~1e-5 (full) to ~1e-3 (LoRA); this far above, the loss diverges

TP, PP, CP = "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"
EP, SP = "expert_model_parallel_size", "sequence_parallel_size"


def errors(problems: list[Problem]) -> list[Problem]:
    return [p for p in problems if p.severity == "error"]


def _warn(field: str, message: str) -> Problem:
    return Problem(field, message, "warning")


def _cluster_rules(spec: JobSpec, cluster: Cluster, layout: Layout) -> list[Problem]:
    out: list[Problem] = []
    nodes = cluster.nodes[: spec.nnodes]
    if spec.nnodes > 1 and cluster.is_local:
        out.append(Problem("nnodes", f"{spec.nnodes} nodes asked for, but no cluster was given: use a hostfile (--hostfile) or a node list"))
    elif spec.nnodes > len(cluster.nodes):
        out.append(Problem("nnodes", f"{spec.nnodes} nodes asked for, the cluster ({cluster.source}) has {len(cluster.nodes)}"))
    elif spec.nnodes < len(cluster.nodes):
        unused = ", ".join(n.host for n in cluster.nodes[spec.nnodes:])
        out.append(_warn("nnodes", f"uses the first {spec.nnodes} of {len(cluster.nodes)} nodes; not used: {unused}"))
    if spec.nnodes > 1 and spec.dataset_cache_dir and not os.path.isabs(os.path.expanduser(spec.dataset_cache_dir)):
        out.append(_warn("dataset_cache_dir", f"{spec.dataset_cache_dir!r} is relative: on {spec.nnodes} nodes it is "
                                              f"{absolute_dir(spec.dataset_cache_dir)} on every node, which must be one "
                                              "shared directory (one node tokenizes, the others read); give the shared path"))
    if spec.nnodes > 1 and not os.path.isabs(os.path.expanduser(spec.output_dir)):
        out.append(_warn("output_dir", f"{spec.output_dir!r} is relative: on {spec.nnodes} nodes it is "
                                       f"{absolute_dir(spec.output_dir)} on every node, which must be one shared "
                                       "directory (checkpoints, logs); give the shared path"))
    for node in nodes:
        # torchrun starts nproc_per_node ranks on every node: more than its GPUs leaves ranks without
        # a device, more than a CPU node's cores makes every rank wait on the others.
        if layout.nproc_per_node > node.slots:
            unit = "GPUs" if node.device == "cuda" else "CPU cores"
            out.append(Problem("nproc_per_node", f"{layout.nproc_per_node} processes per node, but {node.host} has "
                                                 f"{node.slots} slot(s) ({unit})"))
    out += capabilities.device_problems(spec, cluster.devices(spec.nnodes))
    if spec.nproc_per_node is None and len({n.slots for n in nodes}) > 1:
        out.append(_warn("nproc_per_node", f"nodes have different slot counts; using {layout.nproc_per_node} per node"))
    if spec.tensor_model_parallel_size > layout.nproc_per_node or layout.nproc_per_node % spec.tensor_model_parallel_size:
        out.append(Problem(TP, f"TP={spec.tensor_model_parallel_size} must divide the {layout.nproc_per_node} processes of one node (a TP group must not cross nodes)"))
    return out


def _layout_rules(spec: JobSpec, layout: Layout) -> list[Problem]:
    out: list[Problem] = []
    out += capabilities.multi_rank_problems(spec, layout.world)
    tp, pp, cp, ep, sp = layout.tp, layout.pp, layout.cp, layout.ep, layout.sp
    if layout.world % (tp * pp * cp):
        # The form marks the dimension that breaks it: TP, else PP, else CP.
        field = TP if layout.world % tp else (PP if layout.world % (tp * pp) else CP)
        out.append(Problem(field, f"TP x PP x CP = {tp}x{pp}x{cp} = {tp * pp * cp} does not divide the world size {layout.world}"))
    elif layout.world % (tp * pp * cp * sp):
        out.append(Problem(SP, f"TP x PP x CP x SP = {tp * pp * cp * sp} does not divide the world size {layout.world}"))
    etp = layout.etp
    if layout.world % (etp * ep * pp):
        # Megatron builds the experts' grid (ETP x EP x PP x expert-DP) apart from the dense one.
        out.append(Problem(EP, f"ETP x EP x PP = {etp}x{ep}x{pp} = {etp * ep * pp} does not divide the world size "
                               f"{layout.world} (the experts' grid: Megatron's world % (ETP x EP x PP) == 0)"))
    # Megatron's rule; the worker pads every row to its head and tail chunks (capabilities.seq_multiple).
    if cp > 1 and spec.max_length % cp:
        out.append(Problem("max_length", f"{spec.max_length} is not divisible by CP={cp}"))
    if sp > 1 and spec.max_length % sp:
        out.append(Problem("max_length", f"{spec.max_length} is not divisible by SP={sp} (Ulysses splits each sequence)"))
    return out


def _model_rules(spec: JobSpec, model: ModelConfig, world: int) -> list[Problem]:
    out: list[Problem] = []
    tp, pp, sp = spec.tensor_model_parallel_size, spec.pipeline_model_parallel_size, spec.sequence_parallel_size
    if model.num_heads % tp:
        out.append(Problem(TP, f"the model's {model.num_heads} attention heads are not divisible by TP={tp}"))
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        # Megatron's TransformerConfig: query groups are split over TP, or replicated when TP is a
        # multiple of them.
        out.append(Problem(TP, f"the model's {model.num_kv_heads} key/value heads and TP={tp}: one must divide "
                               f"the other (KV heads are split over TP, or replicated when TP is a multiple)"))
    if sp > 1 and model.num_heads % (tp * sp):
        out.append(Problem(SP, f"the model's {model.num_heads} attention heads are not divisible by TP x SP = {tp * sp} (Ulysses splits heads)"))
    if sp > 1 and model.num_kv_heads % sp and sp % model.num_kv_heads:
        # DeepSpeed's Ulysses splits the KV heads over the group, or replicates them when SP is a multiple.
        out.append(Problem(SP, f"the model's {model.num_kv_heads} key/value heads and SP={sp}: one must divide the "
                               "other (Ulysses splits KV heads over SP, or replicates them when SP is a multiple)"))
    out += capabilities.ring_model_problems(spec, model.sliding_window, model.attention_chunk, model.other_mixers)
    out += capabilities.pipeline_model_problems(spec, model.sliding_window, model.attention_chunk, model.other_mixers)
    out += capabilities.ring_kernel_problems(spec, model.num_heads, model.num_kv_heads)
    if spec.tiled_mlp and model.is_moe:
        out.append(Problem("tiled_mlp", "the model is a mixture of experts: its routed MLP blocks are not tiled by this "
                                        "worker; turn tiled_mlp off"))
    stages = pp * spec.virtual_pipeline_model_parallel_size
    if model.num_layers % stages:
        out.append(Problem(PP, f"the model's {model.num_layers} layers are not divisible by PP x virtual stages = {stages}"))
    if pp > 1 and model.tie_word_embeddings:
        out.append(Problem(PP, capabilities.TIED_UNDER_PP))
    tied = capabilities.tied_under_tp_fsdp(capabilities.transformers_plan(spec, world), model.tie_word_embeddings,
                                           model.vocab_size)
    if tied:
        out.append(Problem("fsdp", tied))
    if model.max_position_embeddings and spec.max_length > model.max_position_embeddings:
        scaled = (f"its config scales rope ({model.rope_scaling}), so this may work, but quality past the trained "
                  "length is not guaranteed" if model.rope_scaling else
                  "positions past it were never trained; add rope scaling to the model config or lower max_length")
        out.append(_warn("max_length", f"{spec.max_length} is above the model's max_position_embeddings "
                                       f"({model.max_position_embeddings}): {scaled}"))
    if spec.lora_dropout > 0 and adapts_stacked_params(spec, model):
        # peft's ParamWrapper (LoRA on a stacked parameter) refuses dropout when the model is built.
        out.append(Problem("lora_dropout", f"LoRA on {model.model_type}'s router and stacked experts (which "
                                           f"{', '.join(spec.target_modules)} reaches) takes no dropout in peft: set "
                                           "lora_dropout to 0, or name attention targets only"))
    out += capabilities.ep_model_problems(spec, model.is_moe, model.num_experts, model.tie_word_embeddings,
                                          adapts_stacked_params(spec, model))
    if spec.ref_model and spec.rlhf_type == "dpo":
        try:
            reference = find_model_config(spec.ref_model)
        except ModelConfigError as exc:
            out.append(Problem("ref_model", str(exc)))
        else:
            if reference is not None and reference.vocab_size != model.vocab_size:
                out.append(Problem("ref_model", f"its vocabulary of {reference.vocab_size} tokens is not the model's "
                                                f"{model.vocab_size}: DPO compares both models' log-probs of the same "
                                                "tokens; give a reference with the model's tokenizer"))
            if reference is not None:  # under ring CP the reference runs through the ring as the model does
                out += [Problem("ref_model", f"as the reference under {CP} > 1, {p.field}: {p.message}") for p in
                        capabilities.ring_model_problems(spec, reference.sliding_window, reference.attention_chunk,
                                                         reference.other_mixers)
                        + capabilities.ring_kernel_problems(spec, reference.num_heads, reference.num_kv_heads)]
    return out


def _engine_rules(spec: JobSpec, layout: Layout, ds_config: dict | None) -> list[Problem]:
    """`ds_config`: the job's DeepSpeed config from `base_config`, None without (usable) DeepSpeed."""
    out: list[Problem] = []
    if spec.fsdp and spec.deepspeed:
        out.append(Problem("fsdp", "FSDP and DeepSpeed cannot both be used; choose one"))
    if spec.fsdp and layout.pp > 1:
        out.append(Problem("fsdp", "FSDP with pipeline parallelism is not supported; leave fsdp and deepspeed empty with PP"))
    if ds_config is None:
        return out
    zero = ZeroSettings.of(ds_config)
    if layout.pp > 1 and zero.stage >= 2:
        # DeepSpeed's PipelineEngine asserts ZeRO stage < 2; ZeRO-3 partitions the very layers PP places.
        out.append(Problem("deepspeed", f"ZeRO-{zero.stage} cannot be combined with pipeline parallelism (PP={layout.pp}); use ZeRO-1 or PP=1"))
    out += capabilities.zero_problems(spec, zero.stage, bool(zero.offload_optimizer or zero.offload_param))
    if zero.offload_param and zero.stage != 3:
        out.append(Problem("deepspeed", f"parameter offload needs ZeRO-3 (the config has stage {zero.stage})"))
    if zero.uses_nvme and zero.stage != 3:
        out.append(Problem("deepspeed", f"NVMe offload needs ZeRO-3 (the config has stage {zero.stage})"))
    if zero.uses_nvme and spec.torch_dtype != "bfloat16":
        out.append(Problem("torch_dtype", f"NVMe offload needs bfloat16, not {spec.torch_dtype}"))
    if zero.offload_optimizer and zero.offload_param:
        out.append(_warn("deepspeed", "optimizer and parameter offload together need about 18 bytes per parameter of host RAM on every node"))
    if zero.stage == 3 and spec.nnodes > 1:
        out.append(_warn("deepspeed", "ZeRO-3 across nodes gathers every layer over the network each step; on slower than ~100 Gb/s links prefer ZeRO-2"))
    for conflict in user_batch_conflicts(ds_config, spec, layout.dp):
        out.append(_warn("deepspeed", f"the DeepSpeed JSON sets {conflict}; the job's value is used"))
    return out


def _spec_rules(spec: JobSpec) -> list[Problem]:
    out: list[Problem] = []
    if spec.max_steps == 0 or spec.max_steps < -1:
        out.append(Problem("max_steps", f"must be -1 (use num_train_epochs) or a positive number, got {spec.max_steps}"))
    if not spec.dataset:
        out.append(Problem("dataset", "at least one dataset is required"))
    if spec.train_type == "lora" and not spec.target_modules:
        out.append(Problem("target_modules", "LoRA needs at least one target module (e.g. all-linear)"))
    if not spec.gradient_checkpointing and spec.max_length > LONG_SEQUENCE:
        out.append(_warn("gradient_checkpointing", f"off with max_length {spec.max_length}: activations grow with every layer; turn it on unless memory is plentiful"))
    if spec.torch_dtype == "float16":
        out.append(_warn("torch_dtype", "float16 training needs loss scaling and may overflow; prefer bfloat16 on GPUs that have it"))
    if spec.learning_rate >= HIGH_LEARNING_RATE:
        out.append(_warn("learning_rate", f"{spec.learning_rate:g} is far above fine-tuning's usual range (about 1e-5 "
                                          "for full, 1e-4 to 1e-3 for LoRA): the loss will likely diverge"))
    if spec.save_steps and spec.max_steps > 0 and spec.save_steps > spec.max_steps:
        out.append(_warn("save_steps", f"{spec.save_steps} > max_steps {spec.max_steps}: only the final checkpoint is saved"))
    return out


def _local_path_rules(spec: JobSpec) -> list[Problem]:
    """Files the job names on this machine must exist when the job runs here."""
    out: list[Problem] = []
    for field, i, item in _data_entries(spec):
        try:
            source = records.parse_source(item)
        except records.DataError:
            continue  # reported by _dataset_rules
        path = Path(source.name).expanduser()
        looks_local = path.is_absolute() or source.name.startswith(".") or source.is_local
        if looks_local and not os.path.lexists(path):  # a link that leads nowhere: records.sample_problems
            out.append(Problem(f"{field}[{i}]", f"file not found: {path}{_read_from(path)}"))
    named = [("model", spec.model), ("ref_model", spec.ref_model)] + [
        (f"{field}[{i}]", value) for field in ("adapters", "ref_adapters") for i, value in enumerate(getattr(spec, field))]
    for field, value in named:
        model = Path(value or "").expanduser()
        if value and (model.is_absolute() or value.startswith(".")) and not model.exists():
            out.append(Problem(field, f"directory not found: {model}{_read_from(model)}"))
    cache = Path(spec.dataset_cache_dir or "").expanduser()
    if spec.dataset_cache_dir and os.path.lexists(cache) and not cache.is_dir():
        out.append(Problem("dataset_cache_dir", f"{cache} is not a directory{_read_from(cache)}"))
    return out


def _data_entries(spec: JobSpec) -> list[tuple[str, int, str]]:
    """(field, index, entry) of every training and validation dataset entry."""
    return [(field, i, item) for field in ("dataset", "val_dataset") for i, item in enumerate(getattr(spec, field))]


def _read_from(path: Path) -> str:
    """Where a relative path was looked for: one a job file's directory does not hold is read from
    the current directory (as ms-swift reads them), which is not always the one the user had in mind."""
    return "" if path.is_absolute() else f" (a relative path is read from the job file's directory, else from the current directory, {Path.cwd()})"


def _model_file_rules(spec: JobSpec) -> list[Problem]:
    """Weights (and the tokenizer) of the model directories this machine can read (the nodes'
    shared storage is usually mounted here too; pre-flight checks every node's copy)."""
    out = []
    for field, path in model_dirs(spec).items():
        path = Path(path)
        if not path.is_dir():
            continue
        try:
            signature = tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path)))
        except OSError as exc:
            out.append(Problem(field, f"{path}: cannot read ({exc.strerror})"))
            continue
        out += [Problem(field, message) for message in _dir_problems(field, str(path), signature)]
    return out


@functools.lru_cache(maxsize=16)
def _dir_problems(field: str, path: str, signature: tuple) -> tuple[str, ...]:
    """Cached per directory version: the studio assesses the form on every edit."""
    return tuple(dir_problems(field, path))


VIDEO_FIELDS = ("video_max_pixels", "fps_max_frames", "video_segments")
_SPLIT_ROWS = ("each rank would hold a slice of every row, while the model places each image's features in that "
               "image's tokens across the whole row")


def _vision_rules(spec: JobSpec, model: ModelConfig, zero_stage: int | None = None) -> list[Problem]:
    """A vision-language model on what its training has been run with: DDP, DeepSpeed ZeRO and FSDP2,
    LoRA or full fine-tuning of the parts freeze_vit / freeze_aligner / freeze_llm leave;
    the rest refused by name. A text model names the vision fields it ignores."""
    if not model.vision_tower:
        return [_warn(field, "ignored: the model is not a vision-language model")
                for field in ("max_pixels", *VIDEO_FIELDS, "freeze_llm", "vit_lr", "aligner_lr")
                if getattr(spec, field)]
    if model.multimodal_type not in VISION_FAMILIES:
        return [Problem("model", f"{model.multimodal_type or 'this'} vision-language model: the worker trains "
                                 f"{', '.join(VISION_FAMILIES)} so far (their images' token layout)")]
    out = [Problem(field, f"not with a vision-language model yet: {why}; turn it off") for field, why in (
        (capabilities.PP, "its stages split the language model only"),
        (capabilities.CP, _SPLIT_ROWS), (capabilities.SP, _SPLIT_ROWS),
        (capabilities.EP, "none of the vision-language families it trains has experts"),
        ("use_liger_kernel", "its kernels have not run with one (liger-kernel 0.8.5's Qwen2.5-VL patch fails to import "
                             "under transformers 5.24)"), ("tiled_mlp", "not run with one yet"))
        if _set(getattr(spec, field))]
    if spec.streaming and spec.nnodes * spec.nproc_per_node > 1 and (
            capabilities.tower_in_collectives(spec, zero_stage) or not (spec.freeze_vit and spec.freeze_aligner)):
        # a stream's records are not read before launch: one micro-batch without an image cannot be ruled out
        out.append(Problem("streaming", "with a vision-language model on several ranks only where a micro-batch "
                                        "without an image is safe: LoRA on DDP or ZeRO-0/1/2, full fine-tuning on "
                                        "ZeRO-0/1/2, with freeze_vit and freeze_aligner on (FSDP2, ZeRO-3 and full "
                                        "fine-tuning's DDP layout would leave the other ranks waiting in the vision "
                                        "tower; a training tower's gradients would miss the reduction)"))
    if _set(spec.tensor_model_parallel_size) and model.multimodal_type in TP_UNPLANNED_FAMILIES:
        out.append(Problem(capabilities.TP, f"transformers' TP plan for {model.multimodal_type} shards its embedding alone: "
                                            "every rank would hold and compute every layer; leave TP at 1"))
    if spec.max_pixels and model.multimodal_type in TILED_FAMILIES:
        out.append(Problem("max_pixels", f"{model.multimodal_type}'s image processor cuts images into tiles of a fixed "
                                         "size; it takes no pixel bound (its max_patches caps the tiles): leave it empty"))
    if model.multimodal_type not in VIDEO_FAMILIES:
        out += [_warn(field, f"ignored: the worker reads videos with {', '.join(VIDEO_FAMILIES)} only, not "
                             f"{model.multimodal_type} (its records' videos are refused)")
                for field in VIDEO_FIELDS if getattr(spec, field)]
    elif model.multimodal_type in TILED_FAMILIES:
        out += [_warn(field, f"ignored: {model.multimodal_type} reads video_segments frames of a video, each one tile")
                for field in ("video_max_pixels", "fps_max_frames") if getattr(spec, field)]
    elif spec.video_segments:
        out.append(_warn("video_segments", f"ignored: {model.multimodal_type} samples a video's frames at 2 a second "
                                           "(fps_max_frames bounds them); video_segments is InternVL's"))
    if spec.freeze_vit and spec.freeze_aligner and spec.freeze_llm:
        out.append(Problem("freeze_llm", "with freeze_vit and freeze_aligner too, nothing trains"))
    out += [Problem(field, f"the {part} is frozen ({freeze}): turn {freeze} off to train it at this rate, or leave "
                           f"{field} empty") for field, freeze, part in (("vit_lr", "freeze_vit", "vision tower"),
                                                                     ("aligner_lr", "freeze_aligner", "aligner"))
            if getattr(spec, field) is not None and getattr(spec, freeze)]
    return out


def _set(value) -> bool:
    """A switch that is on, a choice that is made, or a parallel degree above 1."""
    return value > 1 if isinstance(value, int) and not isinstance(value, bool) else bool(value)


def _dataset_rules(spec: JobSpec, images: bool = False, tiled: bool = False, videos: bool = False) -> list[Problem]:
    """A bounded sample of every dataset file this machine can read (the cluster's shared storage
    usually is mounted here too), so a bad record shows before launch instead of after it.
    `images`: the model is a vision-language model (its records may carry images); `tiled`: one that
    cuts them into tiles; `videos`: one that reads videos too."""
    persona = records.Persona.of(spec, images, tiled, videos)
    out = []
    for field, i, item in _data_entries(spec):
        found = records.sampled(item, spec.max_record_bytes, persona)
        # a file none of whose checked records is usable is not data to skip in
        stops = spec.strict or found.all_bad
        out += [Problem(f"{field}[{i}]", message) for message in (found.all() if stops else found.file)]
        if not stops and found.records:
            out.append(_warn(f"{field}[{i}]", "strict is off: records like these are skipped and counted: "
                                              + "; ".join(found.records)))
    if spec.streaming:
        out += _streaming_rules(spec)
    if spec.val_dataset and spec.split_dataset_ratio > 0:
        out.append(_warn("split_dataset_ratio", "ignored: val_dataset is given, and it is the validation data"))
    if (spec.val_dataset or spec.split_dataset_ratio > 0) and spec.eval_strategy == "no":
        out.append(_warn("eval_strategy", "'no': the validation data is not evaluated"))
    return out


def _streaming_rules(spec: JobSpec) -> list[Problem]:
    out = []
    if spec.max_steps <= 0:
        out.append(Problem("max_steps", "streaming reads the data as it trains, without counting it first: give "
                                        "max_steps, the steps to train (num_train_epochs cannot be turned into steps)"))
    if spec.split_dataset_ratio > 0 and not spec.val_dataset:
        out.append(Problem("split_dataset_ratio", "a stream is not held in hand to split records off: give val_dataset "
                                                  "for validation with streaming"))
    if spec.dataset_num_proc > 1:
        out.append(_warn("dataset_num_proc", "ignored with streaming: each rank tokenizes the records it reads as it trains"))
    for i, entry in enumerate(spec.dataset):
        try:
            whole = Path(records.parse_source(entry).name).suffix.lower() == ".json"
        except records.DataError:
            continue  # reported by the sample check
        if whole:
            out.append(_warn(f"dataset[{i}]", "a JSON file is one list, read whole even when streamed; JSON lines "
                                              "(.jsonl) and parquet are read as training goes"))
    return out


@dataclass(frozen=True)
class Assessment:
    spec: JobSpec
    cluster: Cluster
    layout: Layout
    problems: list[Problem]
    model: ModelConfig | None
    ds_config: dict[str, Any] | None
    """The DeepSpeed preset or user JSON as read (nothing filled), None without DeepSpeed or when unreadable."""
    memory: MemoryEstimate | None
    memory_note: str
    """Why there is no memory estimate, or no model config ("" when there is one)."""

    @property
    def ok(self) -> bool:
        return not errors(self.problems)


def assess(spec: JobSpec, cluster: Cluster | None = None, model_config: ModelConfig | None = None) -> Assessment:
    """Every problem of `spec` on `cluster` (errors first-class, warnings for risky but legal
    choices) and what they were found with; each file (model config, DeepSpeed JSON) read once."""
    cluster = cluster or local_cluster()
    layout = compute_layout(spec, cluster)
    problems = _spec_rules(spec)
    problems += capabilities.tracker_problems(spec)
    problems += _cluster_rules(spec, cluster, layout)
    problems += _layout_rules(spec, layout)
    ds_config, ds_error = None, ""
    try:
        ds_config = base_config(spec)
    except DsConfigError as exc:
        ds_error = str(exc)
        problems.append(Problem("deepspeed", ds_error))
    problems += _engine_rules(spec, layout, ds_config)
    if cluster.is_local:
        problems += _local_path_rules(spec)
    problems += _model_file_rules(spec)
    model, memory_note = model_config, ""
    if model is None:
        try:
            model = find_model_config(spec.model)
        except ModelConfigError as exc:
            problems.append(Problem("model", str(exc)))
            memory_note = f"cannot read the model's config.json: {exc}"
        else:
            if model is None:
                memory_note = (f"unknown; no config.json found for `{spec.model}` (a local directory, a bundled config "
                              "or the hub cache).")
    # a model whose config cannot be read here may read images: the worker, which loads it, decides
    problems += _dataset_rules(spec, model is None or model.vision_tower,
                               model is not None and model.multimodal_type in TILED_FAMILIES,
                               model is None or model.multimodal_type in VIDEO_FAMILIES)
    memory = None
    if model is not None:
        trained = with_adapter_settings(spec)  # a saved adapter's rank and targets are what trains
        problems += _model_rules(trained, model, layout.world)
        problems += _vision_rules(spec, model, ZeroSettings.of(ds_config).stage if ds_config else None)
        if ds_error:
            memory_note = f"not estimated: {ds_error}"
        else:
            # The planner's rule: a job with a CPU node runs gloo, its ranks without CUDA.
            device = "cuda" if set(cluster.devices(spec.nnodes).values()) == {"cuda"} else "cpu"
            memory = estimate_memory(trained, model, layout, device, ZeroSettings.of(ds_config) if ds_config else None)
            problems += _memory_rules(spec, cluster, layout, memory, problems)
    # What the worker refuses (FSDP words, parallel degrees it lacks). A field that already has an
    # error here keeps just that one line, so the user is not told twice about one value.
    failed = {p.field for p in errors(problems)}
    problems += [p for p in capabilities.unsupported(spec)
                 if p.field not in failed]
    return Assessment(spec, cluster, layout, problems, model, ds_config, memory, memory_note)


def validate(spec: JobSpec, cluster: Cluster | None = None, model_config: ModelConfig | None = None) -> list[Problem]:
    """Every problem of `spec` on `cluster` (`assess`'s)."""
    return assess(spec, cluster, model_config).problems


def _memory_rules(spec: JobSpec, cluster: Cluster, layout: Layout, estimate: MemoryEstimate,
                  found: list[Problem]) -> list[Problem]:
    """Warn when the estimate exceeds the smallest known GPU (NVML's on the local machine, a
    hostfile's `gpu_mem_gib=` on other nodes), or what a node's ranks offload exceeds its host memory
    (this machine's, a hostfile's `host_mem_gib=`); no warning where the memory is not known."""
    if errors(found):
        return []
    out = []
    nodes = cluster.nodes[: spec.nnodes]
    known = [n for n in nodes if n.device == "cuda" and n.gpu_mem_gib]
    smallest = min(known, key=lambda n: n.gpu_mem_gib) if known else None
    if smallest and estimate.total_gib > smallest.gpu_mem_gib:
        out.append(_warn("per_device_train_batch_size",
                         f"estimated {estimate.total_gib:.1f} GiB per GPU exceeds the {smallest.gpu_mem_gib:.1f} GiB of "
                         f"{smallest.host}'s GPUs; lower the micro-batch or max_length, turn on gradient_checkpointing, "
                         "shard more (ZeRO-2/3, FSDP) or offload"))
    ranks = layout.nproc_per_node
    hosts = [n for n in nodes if n.host_mem_gib and estimate.host_gib * ranks > n.host_mem_gib]
    if hosts:
        field = "activation_cpu_offload" if spec.activation_cpu_offload else ("deepspeed" if spec.deepspeed else "fsdp")
        short = ", ".join(f"{n.host_mem_gib:.1f} GiB of {n.host}" for n in hosts)
        out.append(_warn(field, f"estimated {estimate.host_gib * ranks:.1f} GiB offloaded to host memory on each "
                                f"node ({ranks} rank(s) x {estimate.host_gib:.1f} GiB) exceeds the {short}; lower "
                                "max_length or the micro-batch, or offload less"))
    return out
