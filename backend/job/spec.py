"""The job spec: one typed object for a training job, YAML in and out.

Field names follow ms-swift (`swift sft --help`) so the form, the YAML and the command line
read the same. Parsing never raises for user mistakes: it returns every problem at once, each
naming its field (and, for YAML, the file).
"""
from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from backend.job.paths import not_a_regular_file
from backend.job.records import DataError, parse_source

DEEPSPEED_PRESETS = ("zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
TORCH_DTYPES = ("bfloat16", "float16", "float32")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Spellings used across ms-swift's docs (Megatron-SWIFT, DeepSpeed, Ulysses pages) and common
# shorthands; all map onto one canonical field.
ALIASES: dict[str, str] = {
    "tp_size": "tensor_model_parallel_size",
    "tp": "tensor_model_parallel_size",
    "tp_degree": "tensor_model_parallel_size",
    "tensor_parallel_size": "tensor_model_parallel_size",
    "pp_size": "pipeline_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "pp_degree": "pipeline_model_parallel_size",
    "pipeline_parallel_size": "pipeline_model_parallel_size",
    "cp_size": "context_parallel_size",
    "cp": "context_parallel_size",
    "cp_degree": "context_parallel_size",
    "ep_size": "expert_model_parallel_size",
    "ep": "expert_model_parallel_size",
    "ep_degree": "expert_model_parallel_size",
    "expert_parallel_size": "expert_model_parallel_size",
    "etp_size": "expert_tensor_parallel_size",
    "moe_aux_loss_coeff": "router_aux_loss_coef",
    "sp_size": "sequence_parallel_size",
    "ulysses_size": "sequence_parallel_size",
    "model_id_or_path": "model",
    "model_name_or_path": "model",
    "datasets": "dataset",
    "batch_size": "per_device_train_batch_size",
    "micro_batch_size": "per_device_train_batch_size",
    "lr": "learning_rate",
    "lora_r": "lora_rank",
    "dtype": "torch_dtype",
    "max_len": "max_length",
    "lora_target_modules": "target_modules",
}


def absolute_dir(path: str) -> str:
    """A directory as the workers must see it: relative paths resolve where the studio runs."""
    return str(Path(path).expanduser().absolute())


@dataclass(frozen=True)
class Problem:
    """One thing wrong (or risky) with a job, named by the field that holds it."""

    field: str
    message: str
    severity: Literal["error", "warning"] = "error"

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


TRUE_MEANS = {"fsdp": "full_shard", "resume_from_checkpoint": "latest"}
TRUE_IS_NOT = {"deepspeed": "a preset (zero0 ... zero3, zero2_offload, zero3_offload) or a DeepSpeed JSON path",
               "attn_impl": "an attention implementation (sdpa, flex_attention, flash_attention_2, ...)"}


class JobSpec(BaseModel):
    """A fine-tuning job. Every field but `model` and `dataset` has a default a beginner can keep."""

    # allow_inf_nan: `learning_rate: .inf` passed `gt=0` and the worker died writing its first
    # metric as JSON; every float field takes finite numbers only.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)

    model: str = Field(description="Local model directory or hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct).")
    dataset: list[str] = Field(description="Data files (.jsonl/.json/.parquet/.csv) or hub ids; 'name#N' takes N samples.")
    train_type: Literal["lora", "full"] = Field("lora", description="LoRA adapters (peft) or full fine-tuning.")

    # Preference training (swift rlhf)
    rlhf_type: Literal["dpo", "cpo", "simpo", "orpo"] | None = Field(None, description="Preference training on chosen/rejected pairs (swift rlhf --rlhf_type): 'dpo' against a reference model (the base: LoRA with its adapters off, full a frozen copy); 'cpo', 'simpo' and 'orpo' (odds ratio plus the chosen answers' NLL) without one; empty: supervised fine-tuning.")
    beta: float | None = Field(None, gt=0, description="How strongly the loss separates chosen from rejected (DPO: how far the policy may move from the reference); empty: ms-swift's default for the algorithm, 0.1 for dpo, cpo and orpo, 2.0 for simpo.")
    loss_type: Literal["sigmoid", "hinge", "ipo", "robust"] = Field("sigmoid", description="The loss on the reward margin: sigmoid (DPO), hinge (SLiC), ipo (IPO, per-token averaged), robust (rDPO, with label_smoothing; dpo only); simpo has its own.")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="The share of pairs taken as wrongly labelled (cDPO with sigmoid, rDPO with robust).")
    rpo_alpha: float | None = Field(None, ge=0, description="dpo: adds rpo_alpha x the chosen answers' mean token NLL to the loss (RPO); empty: none.")
    cpo_alpha: float = Field(1.0, ge=0, description="cpo and simpo: the weight of the chosen answers' mean token NLL in the loss (ms-swift's default 1).")
    simpo_gamma: float = Field(1.0, description="simpo: the target reward margin (ms-swift's default 1).")
    ref_model: str | None = Field(None, description="dpo with full fine-tuning: the reference model (local directory or hub id) with the model's vocabulary; empty: the model as loaded (ms-swift's default).")
    ref_adapters: list[str] = Field(default_factory=list, max_length=1, description="dpo with LoRA: the reference is the model with this LoRA adapter merged in (a run's checkpoint-N/model or a LoRA export), not with its adapters off; with adapters naming the same SFT adapter, DPO measures against the SFT model. Needs precompute_ref_log_probs.")
    precompute_ref_log_probs: bool = Field(False, description="dpo: every pair's reference log-probs computed in one pass before training and kept beside the tokenized data, so training holds no reference model (no frozen copy for full fine-tuning) and runs no reference forward; resumes and later runs reuse them.")

    # Engine
    deepspeed: str | None = Field(None, description="zero0..zero3, zero2_offload, zero3_offload, or a path to a DeepSpeed JSON.")
    fsdp: str | None = Field(None, description="FSDP2 (torch fully_shard): 'full_shard', 'shard_grad_op', add 'offload' for CPU offload. Empty (and no DeepSpeed) = DDP, whose bf16/fp32 full fine-tuning also runs on FSDP2 (whole model on every GPU); both are the fastest engines measured for bf16 full fine-tuning.")

    # Layout
    nnodes: int = Field(1, ge=1, description="Number of nodes.")
    nproc_per_node: int | None = Field(None, ge=1, description="Worker processes per node; empty = every GPU of the node (1 on CPU).")
    tensor_model_parallel_size: int = Field(1, ge=1, description="Tensor-parallel degree (TP); a TP group stays inside one node.")
    pipeline_model_parallel_size: int = Field(1, ge=1, description="Pipeline-parallel degree (PP): the decoder layers split into consecutive stages, one pipeline rank each (torch.distributed.pipelining); the micro-batches of one step (gradient_accumulation_steps) flow through it.")
    virtual_pipeline_model_parallel_size: int = Field(1, ge=1, description="Stages per pipeline rank (Megatron's virtual pipeline): above 1 needs pipeline_schedule interleaved_1f1b.")
    pipeline_schedule: Literal["1F1B", "interleaved_1f1b"] = Field("1F1B", description="Pipeline schedule: torch's Schedule1F1B or ScheduleInterleaved1F1B (virtual stages).")
    context_parallel_size: int = Field(1, ge=1, description="Context-parallel degree (CP): each sequence split over CP ranks.")
    expert_model_parallel_size: int = Field(1, ge=1, description="Expert-parallel degree (EP), MoE models only.")
    expert_tensor_parallel_size: int = Field(1, ge=1, description="Tensor-parallel degree inside the experts (ETP; ms-swift's default 1): the experts' grid ETP x EP x PP is carved out of the world independently of TP x CP, as Megatron does.")
    sequence_parallel_size: int = Field(1, ge=1, description="Ulysses sequence-parallel degree.")
    router_aux_loss_coef: float = Field(0.0, ge=0, description="MoE models: the weight of the router's load-balancing loss added to the training loss (ms-swift's field); 0 leaves the model config as it is (transformers adds the config's weight only where it sets output_router_logits). The loss and each expert's tokens are recorded either way.")

    # Data and batch
    max_length: int = Field(2048, ge=8, description="Longest sequence in tokens; longer samples are truncated.")
    per_device_train_batch_size: int = Field(1, ge=1, description="Micro-batch per GPU.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    packing: bool = Field(False, description="Pack several samples per sequence (attention kept within each sample).")
    padding_free: bool = Field(False, description="Each micro-batch's samples (a preference job's chosen, then rejected answers) end to end in one row, with no padding; position ids restart at each sample, so none attends to another (ms-swift's padding_free). With flash_attention_2/3 each sample's attention is its own (flex_attention skips the blocks between samples); with sdpa or eager a mask over the whole row is built (quadratic in the micro-batch's tokens).")
    system: str | None = Field(None, description="Default system prompt, given to every conversation that has none of its own and to the chat (ms-swift's --system).")
    model_name: list[str] = Field(default_factory=list, max_length=2, description="The model's name, filled in where the data says {{NAME}} (ms-swift's self-cognition data); two names = the one for Chinese text, then the one for other text.")
    model_author: list[str] = Field(default_factory=list, max_length=2, description="The model's author, filled in where the data says {{AUTHOR}}; two = Chinese, then other text.")
    max_record_mib: float = Field(16.0, gt=0, le=4096, description="Largest dataset record (one JSON line) in MiB: a longer line is refused naming its file:line, before launch and by the reader, without being read whole.")
    strict: bool = Field(True, description="A record the worker cannot use (fields missing, an image missing, damaged or too large, image tags that do not match its images) stops the run naming its file:line; off: it is skipped and counted (ms-swift's --strict, off there by default). A line that is not JSON stops the run either way.")
    streaming: bool = Field(False, description="Read the datasets as training goes (ms-swift's --streaming): nothing counted or cached first, so data larger than memory or disk trains; read once, in file order, each data-parallel rank every n-th record; needs max_steps; a resume continues at the next record.")
    dataset_num_proc: int = Field(1, ge=1, le=256, description="Processes that tokenize the dataset. It is tokenized once per dataset, tokenizer and max_length into dataset_cache_dir; later runs and resumes read it from there.")
    columns: dict[str, str] = Field(default_factory=dict, description="Dataset columns renamed before a record's format is read, e.g. {\"instruction\": \"query\", \"output\": \"response\"} (ms-swift's --columns; JSON text or a mapping).")
    val_dataset: list[str] = Field(default_factory=list, description="Validation data files or hub ids (as dataset; 'name#N' takes N samples), evaluated every eval_steps.")
    split_dataset_ratio: float = Field(0.0, ge=0, lt=1, description="Share of the training records held out for validation (seeded), when val_dataset is empty.")
    eval_strategy: Literal["steps", "no"] = Field("steps", description="'steps': with validation data, the eval loss every eval_steps and at the end; 'no': never.")
    eval_steps: int | None = Field(None, ge=1, description="Evaluate every N steps; empty: every save_steps.")
    per_device_eval_batch_size: int | None = Field(None, ge=1, description="Evaluation micro-batch per GPU; empty: per_device_train_batch_size.")
    early_stop_interval: int | None = Field(None, ge=1, description="End the run after N evaluations in a row without a lower eval loss (the best checkpoint is kept); empty: never.")
    dataset_cache_dir: str | None = Field(None, description="Directory for tokenized datasets (Arrow), shared by the runs with the same inputs; empty: .tokenized beside the run directories, in output_dir. On several nodes it must be one shared directory.")

    @property
    def max_record_bytes(self) -> int:
        return int(self.max_record_mib * 2**20)

    @property
    def preference_beta(self) -> float:
        """`beta`, or ms-swift's default for the preference algorithm (swift/arguments/rlhf_args.py)."""
        return self.beta if self.beta is not None else 2.0 if self.rlhf_type == "simpo" else 0.1

    @property
    def evaluates(self) -> bool:
        """Whether the job computes an eval loss: validation data given or split off, and not turned off."""
        return self.eval_strategy == "steps" and bool(self.val_dataset or self.split_dataset_ratio > 0)

    # Optimisation
    learning_rate: float = Field(1e-4, gt=0, description="Peak learning rate.")
    num_train_epochs: float = Field(1.0, gt=0, description="Epochs over the dataset (ignored when max_steps > 0).")
    max_steps: int = Field(-1, description="Total optimizer steps; -1 = from num_train_epochs.")
    warmup_ratio: float = Field(0.0, ge=0, le=1, description="Share of steps with linear warm-up.")
    lr_scheduler_type: Literal["cosine", "linear", "constant"] = Field("cosine", description="Learning-rate schedule after warm-up.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping norm (0 = off).")
    torch_dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="Compute dtype.")
    grad_reduce_dtype: Literal["compute", "float32"] = Field("compute", description="Dtype of the gradient all-reduce / reduce-scatter between ranks: 'compute' = the compute dtype (half the traffic of fp32; DeepSpeed's and accelerate's default), 'float32' = exact sums (many ranks, or when the loss curve is noisier than on one GPU). LoRA under DDP over gloo (CPU) reduces in fp32.")
    gradient_checkpointing: bool = Field(True, description="Recompute activations in backward to save memory.")
    use_liger_kernel: bool = Field(False, description="Liger fused kernels (when liger-kernel is installed); its fused linear cross-entropy tiles the loss over the sequence, so the logits are never whole.")
    tiled_mlp: bool = Field(False, description="Run each decoder layer's MLP over the sequence in tiles of about hidden_size tokens (DeepSpeed's TiledMLP, from Arctic Long Sequence Training): its intermediate activations are never whole, for the longest contexts; the MLP is computed once more in backward.")
    activation_cpu_offload: bool = Field(False, description="Keep the layer inputs that gradient checkpointing saves in pinned host memory instead of on the GPU (transformers' activation checkpointing with offload, torch's save_on_cpu): frees layers x tokens x hidden_size of GPU memory at the cost of a copy each way; GPU nodes only.")
    torch_compile: bool = Field(False, description="Compile each decoder layer with torch.compile (faster steps after a one-off compile).")
    attn_impl: str | None = Field(None, description="Attention implementation: sdpa (default), flex_attention (block-sparse masks: packed samples skip each other's blocks), flash_attention_2, eager.")
    seed: int = Field(42, description="Random seed.")

    # LoRA
    lora_rank: int = Field(8, ge=1, description="LoRA rank r.")
    lora_alpha: int = Field(32, ge=1, description="LoRA alpha (scale = alpha / r).")
    lora_dropout: float = Field(0.05, ge=0, lt=1, description="LoRA dropout.")
    freeze_vit: bool = Field(True, description="Vision-language models: keep the vision tower's weights fixed (ms-swift's default); LoRA adapts the language model only.")
    freeze_aligner: bool = Field(True, description="Vision-language models: keep the aligner (the merger from the vision tower into the language model) fixed.")
    freeze_llm: bool = Field(False, description="Vision-language models, full fine-tuning: keep the language model fixed (train the vision side only).")
    vit_lr: float | None = Field(None, gt=0, description="Vision-language models with freeze_vit off: the vision tower's learning rate (its adapters' with LoRA; ms-swift's --vit_lr); empty: learning_rate.")
    aligner_lr: float | None = Field(None, gt=0, description="Vision-language models with freeze_aligner off: the aligner's learning rate (its adapters' with LoRA; ms-swift's --aligner_lr); empty: learning_rate.")
    max_pixels: int | None = Field(None, ge=28 * 28, description="Vision-language models: images with more pixels are scaled down to this many (ms-swift's --max_pixels; a 448x448 image is 200704); empty: the model's image processor's limit.")
    video_max_pixels: int | None = Field(None, ge=28 * 28, description="Qwen2-VL, Qwen2.5-VL and Qwen3-VL videos: a video's frames with more pixels are scaled down to this many (ms-swift's VIDEO_MAX_PIXELS); empty: ms-swift's default for Qwen2-VL and Qwen2.5-VL, 602112 (768x28x28), Qwen3-VL's own cap of 768 tokens a frame (786432).")
    fps_max_frames: int | None = Field(None, ge=2, description="Qwen2-VL, Qwen2.5-VL and Qwen3-VL videos: at most this many frames of a video, sampled evenly at 2 a second (ms-swift's FPS_MAX_FRAMES, FPS 2); empty: the model's video processor's limit (768 for Qwen's).")
    video_segments: int | None = Field(None, ge=1, description="InternVL videos: this many frames of a video, the middle one of each of as many equal segments, each frame one tile (ms-swift's VIDEO_SEGMENTS); a shorter video gives each of its frames; empty: ms-swift's default, 8.")
    adapters: list[str] = Field(default_factory=list, max_length=1, description="LoRA: train this saved adapter further (a directory with adapter_config.json: a run's checkpoint-N/model or a LoRA export); its rank, alpha and target modules are the adapter's, not lora_rank's and target_modules'.")
    target_modules: list[str] = Field(default_factory=lambda: ["all-linear"], description="Modules that get adapters; 'all-linear' = every linear layer but the head.")

    # Checkpoints and logging
    output_dir: str = Field("output", description="Directory that holds the run directories.")
    save_strategy: Literal["steps", "no"] = Field("steps", description="'steps': checkpoint every save_steps and at the end; 'no': never (benchmarks).")
    save_steps: int = Field(500, ge=1, description="Save a checkpoint every N steps (and at the end).")
    save_total_limit: int | None = Field(None, ge=1, description="Keep at most N complete checkpoints.")
    logging_steps: int = Field(5, ge=1, description="Log loss and speed every N steps.")
    report_to: list[str] = Field(default_factory=list, description="Experiment trackers the studio writes the run's "
                                 "metrics to while it trains: tensorboard, wandb, mlflow, swanlab (each needs its "
                                 "package where the studio runs).")
    mlflow_tracking_uri: str | None = Field(None, description="MLflow tracking server or store for report_to mlflow "
                                            "(default: $MLFLOW_TRACKING_URI where the studio runs, else a file "
                                            "store <output_dir>/mlruns).")
    resume_from_checkpoint: str | None = Field(None, description="Checkpoint directory to resume from.")

    # Runtime
    ddp_timeout: int = Field(1800, ge=1, description="Collective timeout in seconds at the start and around "
                             "checkpoints; once steps are measured it follows the step time (twice the hang "
                             "limit, at least 30 s over it) and never exceeds this.")
    max_restarts: int = Field(0, ge=0, le=100, description="Automatic restarts from the newest checkpoint after a "
                              "failure a restart can cure (a killed rank, a lost node, a collective timeout, a hang); "
                              "0: off. A node that fails twice is left out when the job fits the others.")
    hang_timeout_s: float = Field(300.0, ge=5, description="A run with no training step for this long (or "
                                  "hang_step_multiple x the usual time between logged steps, if longer) is hung: "
                                  "its ranks are stopped and, within max_restarts, restarted.")
    hang_step_multiple: float = Field(5.0, ge=1, description="See hang_timeout_s.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the workers (NCCL_*, ...).")

    @field_validator("dataset", "val_dataset", "target_modules", "report_to", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part for part in value.replace(",", " ").split() if part]
        return value

    @field_validator("columns", mode="before")
    @classmethod
    def _columns_from_json(cls, value: Any) -> Any:
        # ms-swift takes --columns as JSON text
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON object of old: new column names ({exc.msg} at character {exc.pos})") from None
            if not isinstance(value, dict):
                raise ValueError("must be a JSON object of old: new column names")
        return value

    @field_validator("columns")
    @classmethod
    def _columns_distinct(cls, value: dict[str, str]) -> dict[str, str]:
        if any(not k.strip() or not v.strip() for k, v in value.items()):
            raise ValueError("a column name must not be empty")
        targets = [v for v in value.values()]
        twice = sorted({v for v in targets if targets.count(v) > 1})
        if twice:
            raise ValueError(f"two columns renamed to {twice[0]!r}")
        return value

    @field_validator("model_name", "model_author", mode="before")
    @classmethod
    def _one_name_or_two(cls, value: Any) -> Any:
        # A name may hold spaces ('Xiao Huang'): a single string is one name, never split.
        return [value] if isinstance(value, str) else value

    @field_validator("model_name", "model_author")
    @classmethod
    def _names_not_blank(cls, value: list[str]) -> list[str]:
        names = [name.strip() for name in value]
        if not all(names):
            raise ValueError("a name must not be empty")
        return names

    @field_validator("system", mode="before")
    @classmethod
    def _blank_system_is_none(cls, value: Any) -> Any:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("env", mode="before")
    @classmethod
    def _env_values_as_text(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): str(v) for k, v in value.items()}
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        bad = [name for name in value if not ENV_NAME.match(name)]
        if bad:
            raise ValueError(f"invalid environment variable name(s): {', '.join(map(repr, bad))}")
        return value

    @field_validator("deepspeed", "fsdp", "attn_impl", "resume_from_checkpoint", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any, info: ValidationInfo) -> Any:
        if value is False or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
            return None
        if value is True:
            # What `true` means where HF's arguments take it: FSDP's default sharding, the latest
            # checkpoint; elsewhere it names nothing.
            if info.field_name in TRUE_MEANS:
                return TRUE_MEANS[info.field_name]
            raise ValueError("true names nothing here: give " + TRUE_IS_NOT[info.field_name])
        return value

    @property
    def deepspeed_preset(self) -> str | None:
        """The preset name when `deepspeed` is one, else None (a path or no DeepSpeed)."""
        return self.deepspeed if self.deepspeed in DEEPSPEED_PRESETS else None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(), sort_keys=False)


FIELDS = tuple(JobSpec.model_fields)


def canonical_key(key: str) -> str:
    key = key.strip().lstrip("-").replace("-", "_")
    return ALIASES.get(key, key)


def suggest(key: str, choices: tuple[str, ...] | list[str] = FIELDS) -> str:
    close = difflib.get_close_matches(key, list(choices) + list(ALIASES), n=1, cutoff=0.6)
    return f" (did you mean '{canonical_key(close[0])}'?)" if close else ""


def parse_spec(data: Any, source: str = "job") -> tuple[JobSpec | None, list[Problem]]:
    """Build a JobSpec from a mapping; returns (spec or None, every problem found)."""
    if not isinstance(data, dict):
        return None, [Problem(source, f"expected a mapping of fields, got {type(data).__name__}")]
    problems: list[Problem] = []
    values: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = canonical_key(str(raw_key))
        if key not in FIELDS:
            problems.append(Problem(str(raw_key), f"unknown field{suggest(key)}"))
        elif key in values:
            problems.append(Problem(key, f"given twice (as '{raw_key}' and an alias)"))
        else:
            values[key] = value
    try:
        spec = JobSpec(**values)
    except ValidationError as exc:
        for err in exc.errors():
            loc = ".".join(str(part) for part in err["loc"]) or source
            problems.append(Problem(loc, _pydantic_message(err)))
        return None, problems
    return (None if problems else spec), problems


def echo(value: Any, limit: int = 200) -> str:
    """A user's value quoted in a message, cut to `limit` characters: a crafted file can hold a
    value of gigabytes, and the message must stay readable."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


def _pydantic_message(err: dict[str, Any]) -> str:
    kind, msg = err["type"], err["msg"]
    if kind == "missing":
        return "required"
    if kind == "literal_error":
        return msg.replace("Input should be", "must be one of")
    if kind == "value_error":
        return echo(msg.removeprefix("Value error, "), 400)[1:-1]
    return f"{msg[0].lower()}{msg[1:]} (got {echo(err.get('input'))})"


MAX_JOB_FILE_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000


def _expanded_size(node: yaml.Node, limit: int) -> int:
    """How many values the YAML node stands for once its aliases are expanded, counted up to just
    over `limit`: aliases share one node, so ten lines can stand for 10^9 values (the "billion
    laughs"), which the checks below would walk one by one."""
    sizes: dict[int, int] = {}

    def size(n: yaml.Node) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        sizes[id(n)] = limit + 1  # a node reached again while being counted is a cycle
        if isinstance(n, yaml.SequenceNode):
            total = 1 + sum(min(size(child), limit + 1) for child in n.value)
        elif isinstance(n, yaml.MappingNode):
            total = 1 + sum(min(size(k), limit + 1) + min(size(v), limit + 1) for k, v in n.value)
        else:
            total = 1
        sizes[id(n)] = min(total, limit + 1)
        return sizes[id(n)]

    return size(node)


def load_spec(path: str | Path) -> tuple[JobSpec | None, list[Problem]]:
    """Read a job YAML file. File-level problems name the file (and line for YAML syntax errors)."""
    path = Path(path)
    problem = not_a_regular_file(path)
    if problem == "not found":
        return None, [Problem(str(path), "file not found")]
    if problem:
        return None, [Problem(str(path), f"{problem}, not a job file")]
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_JOB_FILE_BYTES + 1)
        text = raw.decode()
    except FileNotFoundError:
        return None, [Problem(str(path), "file not found")]
    except (OSError, UnicodeDecodeError) as exc:
        return None, [Problem(str(path), f"cannot read: {exc}")]
    if len(raw) > MAX_JOB_FILE_BYTES:
        return None, [Problem(str(path), f"larger than {MAX_JOB_FILE_BYTES // 1024} KiB: not a job file "
                                         "(a job is a few dozen fields)")]
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None and _expanded_size(node, MAX_YAML_VALUES) > MAX_YAML_VALUES:
            return None, [Problem(str(path), f"its aliases expand to more than {MAX_YAML_VALUES:,} values: "
                                             "not a job file (a job is a few dozen fields)")]
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        reason = getattr(exc, "problem", None) or str(exc)
        return None, [Problem(where, f"invalid YAML: {reason}")]
    if data is None:
        return None, [Problem(str(path), "file is empty; it needs at least 'model' and 'dataset'")]
    spec, problems = parse_spec(data, source=str(path))
    return (spec and anchored(spec, path.parent)), problems


def anchored(spec: JobSpec, base: Path) -> JobSpec:
    """The spec with its relative input paths (models, data, DeepSpeed JSON, checkpoint) read from
    `base`, the job file's directory, where they exist there, so a job file works from any directory.
    Any other value stays as written: a hub id, a path meant from the current directory (ms-swift's
    reading), and the outputs (output_dir, dataset_cache_dir), which go where the job is run."""
    def anchor(value: str | None) -> str | None:
        if not value or os.path.isabs(os.path.expanduser(value)):
            return value
        candidate = Path(base, value).absolute()
        return os.path.normpath(candidate) if os.path.lexists(candidate) else value

    def anchor_entry(entry: str) -> str:
        try:
            name = parse_source(entry).name
        except DataError:
            return entry  # the validator names it
        return anchor(name) + entry[len(name):]

    resume = spec.resume_from_checkpoint
    return spec.model_copy(update=dict(
        model=anchor(spec.model), ref_model=anchor(spec.ref_model), adapters=[anchor(a) for a in spec.adapters],
        ref_adapters=[anchor(a) for a in spec.ref_adapters],
        deepspeed=spec.deepspeed if spec.deepspeed_preset else anchor(spec.deepspeed),
        resume_from_checkpoint=resume if resume == "latest" or (resume or "").isdigit() else anchor(resume),
        dataset=[anchor_entry(e) for e in spec.dataset], val_dataset=[anchor_entry(e) for e in spec.val_dataset]))


def dump_spec(spec: JobSpec, path: str | Path) -> None:
    Path(path).write_text(spec.to_yaml())
