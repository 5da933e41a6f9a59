"""Cross-field and cluster rules for a job: every problem at once, each naming its field.

Public API:
    validate(spec, cluster=None, model_config=None) -> list[Problem]
        cluster None = the local machine; model_config None = looked up from spec.model
        (local directory, bundled config, hub cache); errors have severity "error", risky but
        legal choices "warning". Includes `backend.capabilities.unsupported(spec)` (what the
        worker refuses).
    errors(problems) -> list[Problem]
"""
from __future__ import annotations

from pathlib import Path

from backend import capabilities
from backend.cluster import Cluster, local_cluster
from backend.dsconfig import DsConfigError, ZeroSettings, base_config, user_batch_conflicts
from backend.layout import Layout, compute_layout
from backend.memory import estimate_memory
from backend.modelcfg import ModelConfig, ModelConfigError, find_model_config
from backend.spec import JobSpec, Problem

LONG_SEQUENCE = 4096  # above this, activations without checkpointing dominate memory
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt")

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
    for node in nodes:
        if layout.nproc_per_node <= node.slots:
            continue
        message = f"{layout.nproc_per_node} processes per node, but {node.host} has {node.slots} slot(s)"
        if node.device == "cpu":
            # CPU ranks can share cores: slow but legal (the tests run 2 CPU ranks on one slot).
            out.append(_warn("nproc_per_node", f"{message}; CPU ranks will share cores"))
        else:
            out.append(Problem("nproc_per_node", f"{message} (GPUs)"))
    if spec.nproc_per_node is None and len({n.slots for n in nodes}) > 1:
        out.append(_warn("nproc_per_node", f"nodes have different slot counts; using {layout.nproc_per_node} per node"))
    if spec.tensor_model_parallel_size > layout.nproc_per_node or layout.nproc_per_node % spec.tensor_model_parallel_size:
        out.append(Problem(TP, f"TP={spec.tensor_model_parallel_size} must divide the {layout.nproc_per_node} processes of one node (a TP group must not cross nodes)"))
    return out


def _layout_rules(spec: JobSpec, layout: Layout) -> list[Problem]:
    out: list[Problem] = []
    tp, pp, cp, ep, sp = layout.tp, layout.pp, layout.cp, layout.ep, layout.sp
    if layout.world % (tp * pp * cp):
        out.append(Problem(TP, f"TP x PP x CP = {tp}x{pp}x{cp} = {tp * pp * cp} does not divide the world size {layout.world}"))
    elif layout.world % (tp * pp * cp * sp):
        out.append(Problem(SP, f"TP x PP x CP x SP = {tp * pp * cp * sp} does not divide the world size {layout.world}"))
    if layout.world % (tp * pp * ep):
        out.append(Problem(EP, f"TP x PP x EP = {tp}x{pp}x{ep} = {tp * pp * ep} does not divide the world size {layout.world}"))
    if cp > 1:
        if spec.max_length % cp:
            out.append(Problem("max_length", f"{spec.max_length} is not divisible by CP={cp}"))
        elif spec.max_length % (2 * cp):
            # Causal ring attention balances load by giving each rank a head and a tail chunk.
            out.append(Problem("max_length", f"{spec.max_length} is not divisible by 2 x CP = {2 * cp} (load-balanced causal ring attention)"))
    if sp > 1 and spec.max_length % sp:
        out.append(Problem("max_length", f"{spec.max_length} is not divisible by SP={sp} (Ulysses splits each sequence)"))
    return out


def _model_rules(spec: JobSpec, model: ModelConfig) -> list[Problem]:
    out: list[Problem] = []
    tp, pp, ep, sp = spec.tensor_model_parallel_size, spec.pipeline_model_parallel_size, spec.expert_model_parallel_size, spec.sequence_parallel_size
    if model.num_heads % tp:
        out.append(Problem(TP, f"the model's {model.num_heads} attention heads are not divisible by TP={tp}"))
    if model.num_kv_heads % tp:
        out.append(Problem(TP, f"the model's {model.num_kv_heads} key/value heads are not divisible by TP={tp}"))
    if sp > 1 and model.num_heads % (tp * sp):
        out.append(Problem(SP, f"the model's {model.num_heads} attention heads are not divisible by TP x SP = {tp * sp} (Ulysses splits heads)"))
    if model.num_layers % pp:
        out.append(Problem(PP, f"the model's {model.num_layers} layers are not divisible by PP={pp}"))
    if ep > 1 and not model.is_moe:
        out.append(Problem(EP, f"EP={ep} needs a mixture-of-experts model; {spec.model} is dense"))
    elif ep > 1 and model.num_experts % ep:
        out.append(Problem(EP, f"the model's {model.num_experts} experts are not divisible by EP={ep}"))
    return out


def _engine_rules(spec: JobSpec, layout: Layout, ds_config: dict | None) -> list[Problem]:
    """`ds_config`: the job's DeepSpeed config from `base_config`, None without (usable) DeepSpeed."""
    out: list[Problem] = []
    if spec.fsdp and spec.deepspeed:
        out.append(Problem("fsdp", "FSDP and DeepSpeed cannot both be used; choose one"))
    if spec.fsdp and layout.pp > 1:
        out.append(Problem("fsdp", "FSDP with pipeline parallelism is not supported; use PP with DeepSpeed ZeRO-0/1 or no engine"))
    if ds_config is None:
        return out
    zero = ZeroSettings.of(ds_config)
    if layout.pp > 1 and zero.stage >= 2:
        # DeepSpeed's PipelineEngine asserts ZeRO stage < 2; ZeRO-3 partitions the very layers PP places.
        out.append(Problem("deepspeed", f"ZeRO-{zero.stage} cannot be combined with pipeline parallelism (PP={layout.pp}); use ZeRO-1 or PP=1"))
    out += capabilities.zero_problems(spec, zero.stage)
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
    if spec.save_steps and spec.max_steps > 0 and spec.save_steps > spec.max_steps:
        out.append(_warn("save_steps", f"{spec.save_steps} > max_steps {spec.max_steps}: only the final checkpoint is saved"))
    return out


def _local_path_rules(spec: JobSpec) -> list[Problem]:
    """Files the job names on this machine must exist when the job runs here."""
    out: list[Problem] = []
    for i, item in enumerate(spec.dataset):
        path = Path(item.split("#", 1)[0]).expanduser()
        looks_local = path.is_absolute() or item.startswith(".") or path.suffix in DATA_SUFFIXES
        if looks_local and not path.exists():
            out.append(Problem(f"dataset[{i}]", f"file not found: {path}"))
    model = Path(spec.model).expanduser()
    if (model.is_absolute() or spec.model.startswith(".")) and not model.exists():
        out.append(Problem("model", f"directory not found: {model}"))
    return out


def validate(spec: JobSpec, cluster: Cluster | None = None, model_config: ModelConfig | None = None) -> list[Problem]:
    """Every problem of `spec` on `cluster`: errors first-class, warnings for risky but legal choices."""
    cluster = cluster or local_cluster()
    layout = compute_layout(spec, cluster)
    problems = _spec_rules(spec)
    problems += _cluster_rules(spec, cluster, layout)
    problems += _layout_rules(spec, layout)
    # A user JSON is read once here, for the engine rules and the memory estimate alike.
    try:
        ds_config = base_config(spec)
    except DsConfigError as exc:
        ds_config = None
        problems.append(Problem("deepspeed", str(exc)))
    problems += _engine_rules(spec, layout, ds_config)
    zero = ZeroSettings.of(ds_config) if ds_config else None
    if cluster.is_local:
        problems += _local_path_rules(spec)
    model = model_config
    if model is None:
        try:
            model = find_model_config(spec.model)
        except ModelConfigError as exc:
            problems.append(Problem("model", str(exc)))
    if model is not None:
        problems += _model_rules(spec, model)
        problems += _memory_rules(spec, cluster, layout, model, zero, problems)
    # What the worker refuses (FSDP words, parallel degrees it lacks). A field that already has an
    # error here keeps just that one line, so the user is not told twice about one value.
    failed = {p.field for p in errors(problems)}
    problems += [p for p in capabilities.unsupported(spec) if p.field not in failed]
    return problems


def _memory_rules(spec: JobSpec, cluster: Cluster, layout: Layout, model: ModelConfig, zero: ZeroSettings | None,
                  found: list[Problem]) -> list[Problem]:
    """Warn when the estimate exceeds the smallest known GPU (only where GPU memory is known)."""
    known = [n.gpu_mem_gib for n in cluster.nodes[: spec.nnodes] if n.device == "cuda" and n.gpu_mem_gib]
    if not known or errors(found):
        return []
    estimate = estimate_memory(spec, model, layout, zero=zero)
    if estimate.total_gib <= min(known):
        return []
    return [_warn("per_device_train_batch_size",
                  f"estimated {estimate.total_gib:.1f} GiB per GPU exceeds the {min(known):.1f} GiB available; "
                  "lower the micro-batch or max_length, turn on gradient_checkpointing, or shard more (ZeRO-2/3)")]
