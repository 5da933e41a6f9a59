"""What the training worker (launcher/) can run: the combinations it refuses, as Problems.

Pure and torch-free, so the validator shows these on the form before launch; the worker calls it
again at start and refuses the same list.
"""
from __future__ import annotations

from dataclasses import dataclass

from backend.spec import JobSpec, Problem

FSDP_WORDS = ("full_shard", "shard_grad_op", "offload")
ATTN_IMPLS = ("sdpa", "flex_attention", "eager", "flash_attention_2", "flash_attention_3", "auto")
COMPILE_WITH_ZERO3 = ("not with ZeRO-3 (its parameter hooks break graph capture); use FSDP with torch_compile, "
                      "or turn it off")


@dataclass(frozen=True)
class FsdpPlan:
    """How the worker uses FSDP2's machinery (launcher/engines/fsdp.py)."""

    replicate: bool
    """DDP's layout: every rank holds every parameter (shards of one rank), gradients all-reduced."""
    reshard_after_forward: bool
    offload: bool


def fsdp_plan(spec: JobSpec) -> FsdpPlan | None:
    """The FSDP2 settings of a job, or None where the worker runs DeepSpeed or torch's DDP. Full
    fine-tuning without DeepSpeed or FSDP runs DDP's layout on FSDP2; torch's
    DistributedDataParallel stays for LoRA (a frozen 16-bit base needs no fp32 master copy) and
    float16 (its gradient scaler)."""
    if spec.fsdp:
        words = set(spec.fsdp.replace(",", " ").split())
        return FsdpPlan(False, "shard_grad_op" not in words, "offload" in words)
    if not spec.deepspeed and spec.train_type == "full" and spec.torch_dtype != "float16":
        # with one-rank shards there is nothing to re-gather for backward
        return FsdpPlan(True, reshard_after_forward=False, offload=False)
    return None


def zero_problems(spec: JobSpec, stage: int) -> list[Problem]:
    """What the worker refuses with a DeepSpeed config of this ZeRO stage. A user JSON shows its
    stage only once read, so the backend (before launch) and the worker (its config) both ask here."""
    if spec.torch_compile and stage == 3:
        where = "" if spec.deepspeed_preset else f" ({spec.deepspeed} sets stage 3)"
        return [Problem("torch_compile", COMPILE_WITH_ZERO3 + where)]
    return []


def unsupported(spec: JobSpec) -> list[Problem]:
    problems: list[Problem] = []
    for field in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                  "expert_model_parallel_size", "sequence_parallel_size"):
        if getattr(spec, field) > 1:
            problems.append(Problem(field, "not supported by this worker (data parallel only: DDP, DeepSpeed ZeRO, "
                                           "FSDP2); set it to 1"))
    if spec.deepspeed and spec.fsdp:
        problems.append(Problem("fsdp", "choose either DeepSpeed or FSDP, not both"))
    if spec.fsdp:
        words = spec.fsdp.replace(",", " ").split()
        bad = [w for w in words if w not in FSDP_WORDS]
        if bad or not words:
            problems.append(Problem("fsdp", f"unknown FSDP option(s) {bad}; use 'full_shard' or 'shard_grad_op', "
                                            "optionally with 'offload'"))
        if "full_shard" in words and "shard_grad_op" in words:
            problems.append(Problem("fsdp", "'full_shard' and 'shard_grad_op' exclude each other"))
        if spec.torch_dtype == "float16":
            problems.append(Problem("torch_dtype", "float16 with FSDP is not supported (it needs a sharded grad "
                                                   "scaler); use bfloat16"))
    if spec.attn_impl and spec.attn_impl not in ATTN_IMPLS:
        problems.append(Problem("attn_impl", f"must be one of {', '.join(ATTN_IMPLS)}"))
    unknown_sinks = [s for s in spec.report_to if s not in ("none", "tensorboard")]
    if unknown_sinks:
        problems.append(Problem("report_to", f"{unknown_sinks} not supported (only 'tensorboard', written from the "
                                             "recorded metrics when the run ends); metrics go to the run's event "
                                             "files and the studio", "warning"))
    return problems
