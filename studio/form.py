"""The Train form as data: which JobSpec field sits in which group, drawn with which widget, and
the two conversions form values <-> spec mapping. Pure: no Gradio import, so it is unit-tested
directly and the layout module only has to draw what this describes.
"""
from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

from backend.job.capabilities import ATTN_IMPLS
from backend.job.spec import DEEPSPEED_PRESETS, FIELDS, JobSpec, Problem

Widget = Literal["text", "lines", "int", "float", "check", "choice", "env"]

# Group title, open by default, fields. Every JobSpec field appears exactly once (tested); a
# field added to the spec later and not placed here lands in "Advanced" (see below).
_PLACED: tuple[tuple[str, bool, tuple[str, ...]], ...] = (
    ("Model and data", True, ("model", "dataset", "max_length", "packing", "padding_free", "torch_dtype", "system", "model_name",
                              "model_author", "columns", "val_dataset", "split_dataset_ratio", "streaming",
                              "strict", "dataset_num_proc", "dataset_cache_dir")),
    ("Train type and LoRA", True, ("train_type", "lora_rank", "lora_alpha", "lora_dropout", "target_modules",
                                   "adapters")),
    ("Vision-language models", False, ("freeze_vit", "freeze_aligner", "freeze_llm", "vit_lr", "aligner_lr", "max_pixels",
                                       "video_max_pixels", "fps_max_frames", "video_segments")),
    ("Preference training (DPO, CPO, SimPO, ORPO)", False, ("rlhf_type", "beta", "loss_type", "label_smoothing", "rpo_alpha",
                                                      "cpo_alpha", "simpo_gamma", "ref_model",
                                                      "ref_adapters", "precompute_ref_log_probs")),
    ("Engine and parallelism", True, (
        "deepspeed", "fsdp", "nnodes", "nproc_per_node", "tensor_model_parallel_size",
        "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "pipeline_schedule",
        "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
        "sequence_parallel_size", "router_aux_loss_coef")),
    ("Hyper-parameters", True, (
        "learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
        "gradient_accumulation_steps", "warmup_ratio", "lr_scheduler_type", "weight_decay",
        "max_grad_norm")),
    ("Checkpoints, evaluation and logging", False, (
        "output_dir", "save_strategy", "save_steps", "save_total_limit", "eval_strategy", "eval_steps",
        "per_device_eval_batch_size", "early_stop_interval", "logging_steps", "report_to", "mlflow_tracking_uri",
        "resume_from_checkpoint")),
    ("Advanced", False, (
        "gradient_checkpointing", "use_liger_kernel", "tiled_mlp", "activation_cpu_offload", "torch_compile",
        "attn_impl", "grad_reduce_dtype", "seed", "ddp_timeout", "max_restarts", "hang_timeout_s",
        "hang_step_multiple", "max_record_mib", "env")),
)

_UNPLACED = tuple(f for f in FIELDS if f not in {n for _, _, names in _PLACED for n in names})
GROUPS = tuple((title, is_open, names + _UNPLACED if title == "Advanced" else names)
               for title, is_open, names in _PLACED)

# Fields whose choices are open-ended (a path, a new attention kernel) get a dropdown that also
# accepts typed values; the empty choice means "not set".
OPEN_CHOICES: dict[str, tuple[str, ...]] = {
    "deepspeed": ("", *DEEPSPEED_PRESETS),
    "fsdp": ("", "full_shard", "shard_grad_op", "full_shard offload", "shard_grad_op offload"),
    "attn_impl": ("", *ATTN_IMPLS),
}

TITLES = {
    "model": "Model", "dataset": "Dataset", "torch_dtype": "Compute dtype",
    "nproc_per_node": "Processes per node", "tensor_model_parallel_size": "Tensor parallel (TP)",
    "pipeline_model_parallel_size": "Pipeline parallel (PP)",
    "virtual_pipeline_model_parallel_size": "Virtual stages per PP rank", "pipeline_schedule": "Pipeline schedule", "context_parallel_size": "Context parallel (CP)",
    "expert_model_parallel_size": "Expert parallel (EP)", "expert_tensor_parallel_size": "Expert tensor parallel (ETP)",
    "sequence_parallel_size": "Sequence parallel (Ulysses)",
    "per_device_train_batch_size": "Micro-batch per GPU", "gradient_accumulation_steps": "Gradient accumulation",
    "lr_scheduler_type": "LR schedule", "use_liger_kernel": "Liger kernels", "attn_impl": "Attention kernel",
    "ddp_timeout": "Collective timeout (s)", "max_restarts": "Automatic restarts",
    "hang_timeout_s": "Hang after (s without a step)", "hang_step_multiple": "Hang after (x the step time)",
    "deepspeed": "DeepSpeed", "fsdp": "FSDP2", "env": "Environment",
    "grad_reduce_dtype": "Gradient reduce dtype", "tiled_mlp": "Tiled MLP (long context)",
    "activation_cpu_offload": "Offload checkpointed activations to CPU",
    "router_aux_loss_coef": "Router load-balancing loss weight (MoE)",
    "lora_rank": "LoRA rank", "lora_alpha": "LoRA alpha", "lora_dropout": "LoRA dropout",
    "val_dataset": "Validation data", "split_dataset_ratio": "Held out for validation",
    "eval_strategy": "Evaluation", "eval_steps": "Evaluate every N steps",
    "per_device_eval_batch_size": "Eval micro-batch per GPU", "early_stop_interval": "Early stop after N evals",
    "streaming": "Stream the data (no tokenizing first)", "strict": "Stop on a bad record (off: skip and count it)", "dataset_num_proc": "Tokenizing processes", "dataset_cache_dir": "Tokenized data cache",
    "rlhf_type": "Preference training", "beta": "Beta", "loss_type": "Preference loss", "label_smoothing": "Label smoothing",
    "rpo_alpha": "RPO alpha (DPO's NLL on chosen)", "cpo_alpha": "CPO alpha (NLL on chosen)", "simpo_gamma": "SimPO gamma",
    "ref_model": "Reference model (full DPO)", "precompute_ref_log_probs": "Precompute reference log-probs",
    "system": "System prompt", "model_name": "Model name ({{NAME}})", "model_author": "Model author ({{AUTHOR}})",
}
# Lists of names, which may hold spaces ('Xiao Huang'): one per line, never split at spaces.
WHOLE_LINES = ("model_name", "model_author")


@dataclass(frozen=True)
class FieldView:
    name: str
    widget: Widget
    label: str
    info: str
    choices: tuple[str, ...] = ()
    optional: bool = False


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(annotation))
    return annotation, False


def first_sentence(text: str) -> str:
    """A description's first sentence: the help under a field (the label already names the flag;
    the whole text is the spec's field description, in `swift-studio --help`-style docs)."""
    match = re.search(r"(?<!\.[a-z])(?<=[a-z0-9)'\]])\.(\s|$)", text)  # not the "g." of "e.g."
    return text[:match.start() + 1] if match else text


def field_view(name: str) -> FieldView:
    """How one spec field is drawn; label and help come from the spec so they never drift."""
    info = JobSpec.model_fields[name]
    annotation, optional = _strip_optional(info.annotation)
    origin = typing.get_origin(annotation)
    label = f"{TITLES.get(name, name.replace('_', ' ').capitalize())} · {name}"
    help_text = first_sentence(info.description)
    if name in OPEN_CHOICES:
        return FieldView(name, "choice", label, help_text, OPEN_CHOICES[name], True)
    if origin is Literal:  # an optional choice offers "" for not set
        return FieldView(name, "choice", label, help_text, ("",) * optional + tuple(typing.get_args(annotation)),
                         optional)
    if annotation is bool:
        return FieldView(name, "check", label, help_text)
    if annotation in (int, float):
        if optional:
            help_text = f"{help_text} 0 = not set."
        return FieldView(name, "int" if annotation is int else "float", label, help_text, optional=optional)
    if origin is dict:
        how = "One old=new per line." if name == "columns" else "One NAME=value per line."
        return FieldView(name, "env", label, f"{help_text} {how}")
    if origin is list:
        how = "One per line." if name in WHOLE_LINES else "One per line (or space separated)."
        return FieldView(name, "lines", label, f"{help_text} {how}")
    return FieldView(name, "text", label, help_text, optional=optional)


VIEWS: dict[str, FieldView] = {name: field_view(name) for _, _, names in GROUPS for name in names}


def pairs_from_text(field: str, text: str) -> tuple[dict[str, str], list[Problem]]:
    """A mapping field's box (`env`, `columns`): one NAME=value per line, `#` lines skipped."""
    env: dict[str, str] = {}
    problems: list[Problem] = []
    for number, line in enumerate((text or "").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if not sep:
            problems.append(Problem(field, f"line {number}: expected NAME=value, got {line!r}"))
            continue
        env[name.strip()] = value.strip()
    return env, problems


def form_to_data(values: dict[str, Any]) -> tuple[dict[str, Any], list[Problem]]:
    """Widget values (by field name) -> the mapping `parse_spec` takes, plus widget-level problems.

    Empty optional inputs become None and are left out, so the spec's defaults apply.
    """
    data: dict[str, Any] = {}
    problems: list[Problem] = []
    for name, value in values.items():
        view = VIEWS.get(name)
        if view is None:
            continue
        if view.widget == "env":
            data[name], env_problems = pairs_from_text(name, value)
            problems += env_problems
        elif view.widget == "lines" and name in WHOLE_LINES:
            data[name] = [line.strip() for line in str(value or "").splitlines() if line.strip()]
        elif view.widget == "lines":
            data[name] = [part for part in str(value or "").replace(",", " ").split() if part]
        elif view.widget in ("int", "float"):
            # Gradio shows an empty number as 0, so 0 is how an optional count is left unset.
            if value is None or value == "" or (view.optional and value == 0):
                if not view.optional:
                    problems.append(Problem(name, "required"))
                continue
            number = float(value)
            if view.widget == "int":
                if number != int(number):
                    problems.append(Problem(name, f"must be a whole number (got {value})"))
                    continue
                number = int(number)
            data[name] = number
        elif view.widget in ("text", "choice"):
            text = "" if value is None else str(value).strip()
            if text or not view.optional:
                data[name] = text
        else:
            data[name] = bool(value)
    return data, problems


def spec_to_form(spec: dict[str, Any]) -> dict[str, Any]:
    """A spec mapping (from a JobSpec, a preset or an imported command) -> widget values."""
    values: dict[str, Any] = {}
    for name, value in spec.items():
        view = VIEWS.get(name)
        if view is None:
            continue
        if view.widget == "env":
            values[name] = "\n".join(f"{k}={v}" for k, v in (value or {}).items())
        elif view.widget == "lines":
            values[name] = "\n".join(value or []) if isinstance(value, list) else str(value or "")
        elif value is None:
            values[name] = 0 if view.optional and view.widget in ("int", "float") else ("" if view.widget not in ("int", "float") else None)
        else:
            values[name] = value
    return values


def default_form() -> dict[str, Any]:
    """Widget values for a fresh form: the spec's defaults, with model and dataset empty."""
    defaults = {name: (f.get_default(call_default_factory=True) if not f.is_required() else None)
                for name, f in JobSpec.model_fields.items()}
    defaults["model"], defaults["dataset"] = "", []
    return spec_to_form(defaults)


def problems_by_field(problems: list[Problem]) -> tuple[dict[str, list[Problem]], list[Problem]]:
    """Split problems into those shown next to a form field and the rest (cluster, file, ...).

    Locations such as `dataset.0` (pydantic) or `dataset[0]` (validate) belong to their field.
    """
    by_field: dict[str, list[Problem]] = {}
    other: list[Problem] = []
    for problem in problems:
        head = re.split(r"[.\[]", problem.field, maxsplit=1)[0]
        if head in VIEWS:
            by_field.setdefault(head, []).append(problem)
        else:
            other.append(problem)
    return by_field, other
