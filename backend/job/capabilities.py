"""What the training worker (launcher/) can run: the combinations it refuses, as Problems.

Pure and torch-free, so the validator shows these on the form before launch; the worker calls it
again at start and refuses the same list.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from backend.job.spec import JobSpec, Problem

TP = "tensor_model_parallel_size"
SP = "sequence_parallel_size"
CP = "context_parallel_size"
PP = "pipeline_model_parallel_size"
VPP = "virtual_pipeline_model_parallel_size"
EP = "expert_model_parallel_size"
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


@dataclass(frozen=True)
class TransformersPlan:
    """Tensor and expert parallel through transformers' DistributedConfig (the model's own
    `base_model_tp_plan` and `base_model_ep_plan`), with its FSDP2 for the data-parallel dimension.
    transformers' mesh is (pp, dp_replicate, fsdp, tp) with TP innermost: ranks r and r+1 of one
    node share a TP group, the data-parallel rank is r // tp. The experts are laid out over the
    same fsdp x tp ranks, EP of them holding distinct experts (tokens sent to them by all-to-all),
    and each expert sharded over the fsdp x tp / EP ranks that hold it (`efsdp`)."""

    tp: int
    fsdp: int
    """Ranks the parameters are sharded over (fsdp full_shard), else 1."""
    replicate: int
    """Ranks holding the same (TP-sharded) parameters with gradients all-reduced (no fsdp), else 1."""
    ep: int = 1
    """Ranks holding distinct experts."""

    @property
    def dp(self) -> int:
        return self.fsdp * self.replicate


def same_data_ranks(spec: JobSpec) -> int:
    """Consecutive ranks that compute on the same batches (a TP group, a Ulysses SP group, a ring CP
    group, a pipeline): the data-parallel rank is rank // this, and their tokens count once."""
    return spec.tensor_model_parallel_size * spec.sequence_parallel_size * spec.context_parallel_size * spec.pipeline_model_parallel_size


def seq_multiple(spec: JobSpec) -> int:
    """What every row's width is padded to a multiple of: a Ulysses group splits each row into SP
    equal parts; ring CP into 2 x CP chunks, a head and a tail per rank (torch's load balancer), of
    a multiple of 32 tokens each: torch's ring over the memory-efficient SDPA kernel (float32's, and
    bf16's where flash cannot run) merges each step's log-sum-exp, which that kernel pads to 32
    rows, with the unpadded running one, and fails on other chunks (seen with torch 2.11 on an
    H200; tests/test_context_parallel.py). Under PP: max_length itself."""
    if spec.pipeline_model_parallel_size > 1:
        # A pipeline stage's shapes are fixed at its first step: every row is max_length wide.
        return spec.max_length
    cp = spec.context_parallel_size
    return spec.sequence_parallel_size * (2 * cp * 32 if cp > 1 else 1)


def tower_in_collectives(spec: JobSpec, zero_stage: int | None) -> bool:
    """Whether the ranks run a vision-language model's tower through collectives every micro-batch
    (FSDP2's and ZeRO-3's gathers; full fine-tuning without DeepSpeed runs on FSDP2, DDP's layout
    too): a micro-batch without an image skips the tower, and the other ranks wait in it."""
    return bool(spec.fsdp) or zero_stage == 3 or (spec.train_type == "full" and not spec.deepspeed)


def world_problems(spec: JobSpec, world: int) -> list[Problem]:
    """The worker's own check of its world size (the validator checks the layout before launch):
    TP x SP x CP x PP consecutive ranks form one group, so they must divide the ranks torchrun
    started; EP must divide them too."""
    group = same_data_ranks(spec)
    out = multi_rank_problems(spec, world)
    ep = spec.expert_model_parallel_size
    if ep > 1 and world % ep:
        out.append(Problem(EP, f"EP={ep} does not divide the {world} ranks this job was started with (transformers' "
                               "expert parallel: EP divides FSDP x TP)"))
    if world % group == 0:
        return out
    field = next(f for f in (PP, CP, SP, TP) if getattr(spec, f) > 1)
    return [Problem(field, f"TP x SP x CP x PP = {group} does not divide the {world} ranks this job was started with"), *out]


def transformers_plan(spec: JobSpec, world: int) -> TransformersPlan | None:
    """The layout of transformers' TP and EP for a job on `world` ranks; None without either, and
    with DeepSpeed, whose AutoTP shards the model itself (`autotp`)."""
    tp, ep = spec.tensor_model_parallel_size, spec.expert_model_parallel_size
    if (tp <= 1 and ep <= 1) or spec.deepspeed:
        return None
    dp = max(1, world // tp)
    if spec.fsdp:
        return TransformersPlan(tp, fsdp=dp, replicate=1, ep=ep)
    return TransformersPlan(tp, fsdp=1, replicate=dp, ep=ep)


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


def autotp(spec: JobSpec) -> int:
    """DeepSpeed AutoTP's degree (`tensor_parallel.autotp_size`): TP > 1 with DeepSpeed, else 0."""
    tp = spec.tensor_model_parallel_size
    return tp if spec.deepspeed and tp > 1 else 0


def zero_problems(spec: JobSpec, stage: int, offload: bool = False) -> list[Problem]:
    """What the worker refuses with a DeepSpeed config of this ZeRO stage (`offload`: optimizer or
    parameters off the GPU). A user JSON shows its stage only once read, so the backend (before
    launch) and the worker (its config) both ask here."""
    where = "" if spec.deepspeed_preset else f" ({spec.deepspeed} sets stage {stage})"
    out = []
    if spec.torch_compile and stage == 3:
        out.append(Problem("torch_compile", COMPILE_WITH_ZERO3 + where))
    if autotp(spec) and stage == 3:
        # DeepSpeed 0.19.8 checks the batch against two different world sizes under ZeRO-3 + AutoTP.
        out.append(Problem("deepspeed", f"ZeRO-3 with {TP} > 1: DeepSpeed's AutoTP trains with ZeRO-0, 1 or 2{where}; "
                                        "use zero1 or zero2"))
    if spec.tiled_mlp and stage == 3:
        out.append(Problem("tiled_mlp", "not with ZeRO-3: every tile would gather the MLP's weights again, a collective "
                                        "that ranks holding rows of other lengths call a different number of times; "
                                        f"use zero2 or zero1{where}"))
    if autotp(spec) and offload:
        out.append(Problem("deepspeed", f"offload with {TP} > 1 (DeepSpeed's AutoTP) is not tested; use zero1 or "
                                        "zero2 without offload"))
    return out


@dataclass(frozen=True)
class Fix:
    """A change of the job that answers a refusal with its one remedy (the engine a parallel
    dimension runs on here, the micro-batches a pipeline needs): the form offers it as one click and
    the ms-swift import applies it, each saying why."""

    field: str
    """The field whose refusal it answers."""
    changes: tuple[tuple[str, object], ...]
    """(field, new value) pairs; None empties a field."""
    why: str

    def text(self) -> str:
        """`fsdp full_shard, deepspeed (none)`: what the fix sets, in the job's words."""
        return ", ".join(f"{name} {'(none)' if value is None else value}" for name, value in self.changes)


# DeepSpeed's ZeRO stage nearest to an FSDP setting, and back (Ulysses runs on DeepSpeed, ring CP on FSDP2).
ZERO_FOR_FSDP = {"full_shard": "zero3", "shard_grad_op": "zero2"}
FSDP_FOR_ZERO = {"zero1": "shard_grad_op", "zero2": "shard_grad_op", "zero2_offload": "shard_grad_op offload",
                 "zero3_offload": "full_shard offload"}


def engine_fixes(spec: JobSpec) -> list[Fix]:
    """The engine settings a parallel dimension needs where the job leaves them out or picks another
    engine, and the micro-batches a pipeline needs: one Fix each, only where exactly one remedy
    exists (EP beside SP or CP, say, is refused with no fix: the user chooses which to keep)."""
    out = []
    words = set((spec.fsdp or "").replace(",", " ").split())
    ep, sp, cp = spec.expert_model_parallel_size, spec.sequence_parallel_size, spec.context_parallel_size
    tp = spec.tensor_model_parallel_size
    # EP, SP and CP exclude each other here: with two of them set, which to keep is the user's choice.
    only = [name for name, size in ((EP, ep), (SP, sp), (CP, cp)) if size > 1]
    if only == [EP] and (spec.deepspeed or words != {"full_shard"}):
        out.append(Fix("deepspeed" if spec.deepspeed else "fsdp",
                       (("fsdp", "full_shard"),) + ((("deepspeed", None),) if spec.deepspeed else ()),
                       f"{EP} > 1 runs on transformers' expert parallel over its FSDP2 (full_shard)"))
    if only == [SP] and tp == 1 and not spec.deepspeed:
        stage = ZERO_FOR_FSDP.get(next((w for w in words if w in ZERO_FOR_FSDP), ""), "zero0")
        if "offload" in words and stage in ("zero2", "zero3"):
            stage += "_offload"
        out.append(Fix("deepspeed", (("deepspeed", stage),) + ((("fsdp", None),) if spec.fsdp else ()),
                       f"{SP} > 1 runs on DeepSpeed's Ulysses here ({stage}: "
                       + ("the nearest ZeRO stage to the job's FSDP)" if spec.fsdp else
                          "DeepSpeed's plain data parallel, as ms-swift runs Ulysses under DDP)")))
    if only == [CP] and tp == 1 and (spec.deepspeed or not spec.fsdp):
        fsdp = FSDP_FOR_ZERO.get(spec.deepspeed or "", "full_shard")
        out.append(Fix("fsdp", (("fsdp", fsdp),) + ((("deepspeed", None),) if spec.deepspeed else ()),
                       f"{CP} > 1 runs on FSDP2 (torch's context_parallel)"))
    pp, m = spec.pipeline_model_parallel_size, spec.gradient_accumulation_steps
    if pp > 1:
        rounds = pp if spec.pipeline_schedule == "interleaved_1f1b" else 1
        need = max(pp, -(-m // rounds) * rounds)
        if need != m:
            out.append(Fix("gradient_accumulation_steps", (("gradient_accumulation_steps", need),),
                           f"a pipeline of PP={pp} stages needs at least {pp} micro-batches per step"
                           + (", a multiple of PP for the interleaved schedule" if rounds > 1 else "")))
        if spec.evaluates:
            out.append(Fix("eval_strategy", (("eval_strategy", "no"),),
                           f"evaluation does not run with {PP} > 1 here (torch's schedules run training steps only)"))
    return out


def apply_fixes(spec: JobSpec, fixes: list[Fix]) -> JobSpec:
    """`spec` with every fix's changes."""
    return spec.model_copy(update={name: value for fix in fixes for name, value in fix.changes})


def deepspeed_json_problems(config: dict, source: str, spec: JobSpec) -> list[Problem]:
    """What the worker refuses in a DeepSpeed JSON itself (`source`: the file it came from), beyond
    its stage. backend.job.dsconfig asks while reading the file, so the plan and the worker refuse too.
    The TP degree is the job's: a JSON that sets another one would train another layout."""
    tp = config.get("tensor_parallel")
    size = tp.get("autotp_size") if isinstance(tp, dict) else None
    if size in (None, 0, 1, autotp(spec)):
        return []
    return [Problem("deepspeed", f"{source}: tensor_parallel.autotp_size: {json.dumps(size)}, but the job's {TP} is "
                                 f"{spec.tensor_model_parallel_size}; set {TP} to {size} (DeepSpeed AutoTP with it), or "
                                 "remove autotp_size")]


def unsupported(spec: JobSpec) -> list[Problem]:
    problems: list[Problem] = []
    if spec.expert_tensor_parallel_size > 1:
        problems.append(Problem("expert_tensor_parallel_size", "not supported by this worker yet (it runs DDP, "
                                "DeepSpeed ZeRO, FSDP2, tensor, expert and pipeline parallel, Ulysses sequence "
                                "parallel and ring context parallel)"))
    problems += pp_problems(spec)
    problems += _tp_problems(spec)
    problems += _ep_problems(spec)
    problems += _sp_problems(spec)
    problems += _cp_problems(spec)
    problems += _long_sequence_problems(spec)
    problems += _preference_problems(spec)
    problems += padding_free_problems(spec)
    problems += _adapter_problems(spec)
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
    return problems


def _adapter_problems(spec: JobSpec) -> list[Problem]:
    """`adapters` (LoRA trained on from a saved adapter) and `ref_adapters` (LoRA DPO's reference:
    the model with an adapter merged in, for the precomputed log-probs' pass): where they apply."""
    out = []
    if spec.adapters and spec.train_type != "lora":
        out.append(Problem("adapters", "a LoRA adapter is trained on with train_type lora; leave it empty for full "
                                       "fine-tuning (or merge it into the model first: the Export tab)"))
    for dim in (TP, EP):
        if spec.adapters and getattr(spec, dim) > 1:
            out.append(Problem("adapters", f"not with {dim} > 1 (a saved adapter is not laid out as the shards' "
                                           "adapters yet); leave it empty or turn it off"))
    if not spec.ref_adapters:
        return out
    if spec.rlhf_type != "dpo" or spec.train_type != "lora":
        out.append(Problem("ref_adapters", "only dpo with train_type lora takes reference adapters (as in ms-swift): "
                                           "leave it empty"))
    elif not spec.precompute_ref_log_probs:
        out.append(Problem("ref_adapters", "the reference with its adapter merged in runs in the pass of "
                                           "precompute_ref_log_probs (no second set of adapters is held while "
                                           "training): turn precompute_ref_log_probs on"))
    for dim in (TP, EP, PP, SP):
        if getattr(spec, dim) > 1:
            out.append(Problem("ref_adapters", f"not with {dim} > 1 (a separate reference model is not run on its "
                                               "shards, stages or sequence groups; not tested): leave it empty"))
    return out


def padding_free_problems(spec: JobSpec) -> list[Problem]:
    """padding_free (a micro-batch's samples end to end in one row): what needs rows of one shape,
    or sees a row as one sequence, refused by name; what is not tested with it, too."""
    if not spec.padding_free:
        return []
    out = []
    if spec.packing:
        out.append(Problem("padding_free", "packing already puts samples end to end in rows of max_length: turn one off"))
    for dim, why in ((PP, "a pipeline's stages hand on activations of one fixed shape, and a flattened row's "
                          "length changes every micro-batch"),
                     (SP, "each answer's log-probs are summed over its run of the flattened row, which Ulysses "
                          "splits over its group" if spec.rlhf_type else ""),
                     (CP, "ring attention knows only the causal mask, so the samples of a row would attend to "
                          "each other"),
                     (TP, "not tested together yet"), (EP, "not tested together yet")):
        if getattr(spec, dim) > 1 and why:
            out.append(Problem("padding_free", f"not with {dim} > 1: {why}; turn padding_free off"))
    if spec.sequence_parallel_size > 1 and not spec.rlhf_type and spec.attn_impl not in FLASH_IMPLS:
        # as packing: Ulysses drops the mask, and only flash-attention reads the samples' bounds from the positions
        out.append(Problem("padding_free", f"padding_free with {SP} > 1 needs attn_impl flash_attention_2 or 3 "
                                           "(Ulysses drops the mask; sdpa and flex_attention would attend across the "
                                           "samples of a row); turn padding_free off or use flash-attention"))
    if spec.torch_compile:
        out.append(Problem("padding_free", "not with torch_compile (a new row length every micro-batch; not tested "
                                           "together); turn one off"))
    if spec.attn_impl not in (*FLASH_IMPLS, "flex_attention") and spec.sequence_parallel_size <= 1:
        impl = ("auto (sdpa where flash-attn is not installed)" if spec.attn_impl in (None, "", "auto")
                else spec.attn_impl)
        out.append(Problem("padding_free", f"with attn_impl {impl} attention over a flattened row is masked over the "
                                           "whole row, quadratic in the micro-batch's tokens; flash_attention_2 or 3 "
                                           "and flex_attention skip what lies between samples", severity="warning"))
    return out


def _preference_problems(spec: JobSpec) -> list[Problem]:
    """Preference runs where a rank holds whole sequences and whole logits: DDP, ZeRO, FSDP2,
    transformers' TP (its head's output is gathered on every TP rank) and EP (each rank routes its own
    sequences' tokens to the experts and back), pipeline parallel (a micro-batch's chosen and rejected
    rows go down the pipeline together, so the loss is the last stage's; the reference is a
    forward-only pass of the same schedule), where no frozen copy of the TP- or EP-sharded or split
    model is needed, DeepSpeed's Ulysses SP and ring CP (each row's log-prob sums added over the
    group that holds its parts; the reference's forward runs on the same parts)."""
    if spec.rlhf_type is None:
        return [Problem(field, "ignored: only preference training (rlhf_type dpo) has a reference model", "warning")
                for field in ("ref_model", "precompute_ref_log_probs") if getattr(spec, field)]
    problems = []
    if spec.tensor_model_parallel_size > 1 and spec.deepspeed:
        problems.append(Problem("tensor_model_parallel_size", f"DeepSpeed's AutoTP is not combined with rlhf_type "
                                f"{spec.rlhf_type}: its head's output is not shown to be whole on every rank; use "
                                "transformers' tensor parallel (no deepspeed) or DeepSpeed ZeRO without TP"))
    else:
        problems += [Problem(field, f"{name} with full-parameter DPO takes the reference from "
                             "precompute_ref_log_probs (the model itself, before training), not a separate reference "
                             "model: set precompute_ref_log_probs, leave ref_model empty, or train LoRA")
                     for field, name in (("tensor_model_parallel_size", "tensor parallel"),
                                         ("expert_model_parallel_size", "expert parallel"),
                                         ("pipeline_model_parallel_size", "pipeline parallel"))
                     if getattr(spec, field) > 1 and spec.rlhf_type == "dpo" and spec.train_type == "full" and (
                         spec.ref_model or not spec.precompute_ref_log_probs)]
    if spec.packing:
        problems.append(Problem("packing", f"rlhf_type {spec.rlhf_type} keeps each micro-batch's pairs together: "
                                           "turn packing off (padding_free puts them end to end without padding)"))
    if spec.streaming and spec.precompute_ref_log_probs and spec.rlhf_type == "dpo":
        problems.append(Problem("precompute_ref_log_probs", "a streamed dataset is read as training goes, so its "
                                                            "pairs cannot be gone through before: turn one of them off"))
    if spec.use_liger_kernel and spec.torch_compile:
        problems.append(Problem("use_liger_kernel", f"ignored: under torch_compile Liger gives only its fused "
                                                    f"cross-entropy, and rlhf_type {spec.rlhf_type} takes each answer's "
                                                    "log-probs from the logits", "warning"))
    if spec.rlhf_type not in ("dpo", "orpo") and spec.loss_type == "robust":
        problems.append(Problem("loss_type", f"robust is DPO's (it needs the reference); rlhf_type {spec.rlhf_type} "
                                             "takes sigmoid, hinge or ipo"))
    if spec.rlhf_type == "simpo" and spec.loss_type != "sigmoid":
        problems.append(Problem("loss_type", "ignored: simpo has its own loss (a sigmoid of the length-normalised "
                                             "margin less simpo_gamma)", "warning"))
    if spec.rlhf_type == "orpo":
        problems += [Problem(field, f"ignored: orpo's loss is the chosen answers' NLL less beta x the log-sigmoid of "
                                    f"the log odds ratio ({why})", "warning")
                     for field, why in (("loss_type", "it has no other"), ("label_smoothing", "no smoothing"),
                                        ("cpo_alpha", "the NLL's weight is 1"))
                     if getattr(spec, field) != JobSpec.model_fields[field].default]
    if spec.ref_model and spec.sequence_parallel_size > 1:
        problems.append(Problem("ref_model", "not with sequence_parallel_size > 1: Ulysses is set up for the model's "
                                             "attention (its heads and implementation), which another reference model "
                                             "need not share; leave it empty (the reference is then the model as "
                                             "loaded) or turn sequence parallel off"))
    if spec.ref_model and (spec.rlhf_type != "dpo" or spec.train_type != "full"):
        problems.append(Problem("ref_model", "only dpo with train_type full takes a reference model (as in ms-swift): "
                                             "LoRA's is the model with its adapters off, cpo, simpo and orpo have "
                                             "none; leave it empty"))
    if spec.rlhf_type != "dpo" and spec.precompute_ref_log_probs:
        problems.append(Problem("precompute_ref_log_probs", f"ignored: rlhf_type {spec.rlhf_type} has no reference "
                                                            "model", "warning"))
    if spec.rlhf_type != "dpo" and spec.rpo_alpha is not None:
        weight = "its NLL term has weight 1" if spec.rlhf_type == "orpo" else "cpo_alpha weighs its NLL term"
        problems.append(Problem("rpo_alpha", f"ignored with rlhf_type {spec.rlhf_type}: {weight}", "warning"))
    if spec.loss_type == "robust" and spec.label_smoothing == 0 and spec.rlhf_type != "orpo":
        problems.append(Problem("label_smoothing", "loss_type robust divides by 1 - 2 x label_smoothing and is plain "
                                                   "DPO at 0: give the share of mislabelled pairs", "warning"))
    return problems


# report_to's trackers and the package each needs where the studio runs (it writes them from its
# database; the workers stay tracker-free): `pip install 'swift-studio[<name>]'`.
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "swanlab": "swanlab"}


def tracker_problems(spec: JobSpec) -> list[Problem]:
    """report_to names only trackers the studio writes, each with its package installed here
    (checked where the studio or CLI assesses a job, never in the worker, which needs none)."""
    import importlib.util

    problems = []
    names = [s for s in spec.report_to if s != "none"]
    if "none" in spec.report_to and names:
        problems.append(Problem("report_to", f"'none' together with {names}: name the trackers or 'none', not both"))
    for name in dict.fromkeys(names):
        if name not in TRACKERS:
            problems.append(Problem("report_to", f"{name!r} is not a tracker swift-studio writes; use "
                                                 f"{', '.join(TRACKERS)} or none"))
        elif importlib.util.find_spec(TRACKERS[name]) is None:
            problems.append(Problem("report_to", f"{name!r} needs the {TRACKERS[name]} package where the studio runs "
                                                 f"(it writes the tracker from its database): pip install "
                                                 f"'swift-studio[{name}]'"))
    if spec.mlflow_tracking_uri is not None and "mlflow" not in names:
        problems.append(Problem("mlflow_tracking_uri", "set, but report_to does not name mlflow", "warning"))
    return problems

# transformers 5.24: under TP x FSDP2 a model with tied embeddings whose vocabulary does not divide
# evenly over the TP x FSDP ranks gets correct gradients but wrong updates; with a vocabulary that
# divides (Qwen2.5's 151936 over 4) and untied models it trains exactly as without TP
# (tests/test_tensor_parallel.py pins both sides).
def tied_under_tp_fsdp(plan: TransformersPlan | None, tied: bool, vocab_size: int) -> str | None:
    """Why transformers' TP x FSDP2 would train this model wrongly, or None."""
    if plan is None or plan.tp <= 1 or plan.fsdp <= 1 or not tied:
        return None
    shards = plan.tp * plan.fsdp
    if vocab_size % shards == 0:
        return None
    return (f"full_shard with {TP} > 1 trains a model with tied embeddings and a vocabulary of {vocab_size} "
            f"(not divisible by TP x FSDP = {shards} ranks) wrongly in transformers' TP x FSDP2 (the updates differ "
            "from the same job without TP); leave fsdp empty (TP with replicated data parallel), or pick a "
            f"layout whose TP x FSDP divides {vocab_size}")


def bubble_fraction(spec: JobSpec) -> float:
    """The share of a 1F1B step each pipeline rank idles: (PP - 1) / (m + PP - 1) for m micro-batches
    (interleaving divides the PP - 1 by the virtual stages)."""
    pp, m = spec.pipeline_model_parallel_size, spec.gradient_accumulation_steps
    return (pp - 1) / spec.virtual_pipeline_model_parallel_size / (m + pp - 1)


TIED_UNDER_PP = (f"{PP} > 1 with a model whose output layer is tied to its embedding: the two live on the first "
                 "and the last stage, and would be trained as two copies; untie them (tie_word_embeddings: false, "
                 "lm_head initialised from the embedding) or leave PP at 1")


def pp_problems(spec: JobSpec) -> list[Problem]:
    """Pipeline parallel (launcher/engines/pp.py, torch's schedules): the trainer's micro-batches of one
    step are the schedule's, and what it was not tested with is refused by name."""
    pp, virtual, m = spec.pipeline_model_parallel_size, spec.virtual_pipeline_model_parallel_size, spec.gradient_accumulation_steps
    out = []
    if virtual > 1 and spec.pipeline_schedule != "interleaved_1f1b":
        out.append(Problem(VPP, f"{virtual} virtual stages need pipeline_schedule interleaved_1f1b"))
    if pp <= 1:
        if virtual > 1:
            out.append(Problem(VPP, "virtual pipeline stages need pipeline_model_parallel_size > 1"))
        return out
    if m < pp:
        out.append(Problem("gradient_accumulation_steps", f"{m} micro-batches cannot fill a pipeline of PP={pp} "
                                                          f"stages: use at least {pp}"))
    elif spec.pipeline_schedule == "interleaved_1f1b" and m % pp:
        # torch's ScheduleInterleaved1F1B runs the micro-batches in rounds of PP.
        out.append(Problem("gradient_accumulation_steps", f"{m} micro-batches: the interleaved schedule needs a "
                                                          f"multiple of PP={pp}"))
    else:
        out.append(Problem("gradient_accumulation_steps", f"{m} micro-batches over PP={pp}: each rank idles about "
                                                          f"{bubble_fraction(spec):.0%} of a step (the pipeline "
                                                          "bubble); more micro-batches make it smaller", "warning"))
    if "offload" in (spec.fsdp or "").replace(",", " ").split():
        out.append(Problem("fsdp", f"offload with {PP} > 1 is not supported (a stage keeps its weights gathered "
                                   "through the step); use full_shard"))
    for field, why in (("deepspeed", "DeepSpeed's engines do not run torch's pipeline schedules"),
                       (TP, "tensor parallel beside a pipeline is not tested"),
                       (SP, "Ulysses sequence parallel beside a pipeline is not tested"),
                       (CP, "ring context parallel beside a pipeline is not tested"),
                       ("expert_model_parallel_size", "expert parallel beside a pipeline is not tested"),
                       ("torch_compile", "compiled stages are not tested"),
                       ("use_liger_kernel", "Liger's fused loss does not run on a pipeline's last stage"),
                       ("tiled_mlp", "not tested with pipeline stages"),
                       ("activation_cpu_offload", "not tested with pipeline stages")):
        value = getattr(spec, field)
        if value if isinstance(value, (bool, str)) or value is None else value > 1:
            out.append(Problem(field, f"not with {PP} > 1 ({why}); remove it"))
    if spec.router_aux_loss_coef > 0:
        out.append(Problem("router_aux_loss_coef", f"not with {PP} > 1: the last stage computes the loss from the "
                                                   "logits alone, without the routers' balancing term; set it to 0"))
    if spec.torch_dtype == "float16":
        out.append(Problem("torch_dtype", f"float16 with {PP} > 1 needs a grad scaler across stages; use bfloat16"))
    if spec.evaluates:
        out.append(Problem("eval_strategy", f"evaluation with {PP} > 1 is not supported here (the schedules run "
                                            "training steps only); set eval_strategy: no"))
    return out


def _untested_with(spec: JobSpec, dimension: str, compiled: str, liger: str) -> list[Problem]:
    """torch_compile and Liger, each refused with a parallel dimension above 1, and why."""
    return [Problem(field, f"not with {dimension} > 1 ({why}); turn it off")
            for field, why in (("torch_compile", compiled), ("use_liger_kernel", liger)) if getattr(spec, field)]


def _tp_problems(spec: JobSpec) -> list[Problem]:
    """Tensor parallel runs on transformers' DistributedConfig, or on DeepSpeed's AutoTP with a ZeRO
    stage; these engines and options do not compose with it (yet), each refused by name."""
    if spec.tensor_model_parallel_size <= 1:
        return []
    out = []
    if spec.deepspeed and spec.train_type == "lora":
        out.append(Problem("deepspeed", f"LoRA with {TP} > 1 runs on transformers' TP (peft's TP-LoRA); DeepSpeed's "
                                        "AutoTP trains full fine-tuning only: remove deepspeed"))
    words = set((spec.fsdp or "").replace(",", " ").split())
    if spec.train_type == "lora" and "full_shard" in words and not spec.deepspeed:
        # peft 0.21's TP-LoRA under transformers 5.24's FSDP2: the first forward fails with a shape
        # error in an adapted projection (seen with Qwen2 and Qwen3 on 4 CPU ranks).
        out.append(Problem("fsdp", f"LoRA with {TP} > 1 and full_shard fails in peft's TP-LoRA under transformers' "
                                   "FSDP2 (a shape error in the first step); leave fsdp empty (TP with replicated "
                                   "data parallel, which trains LoRA correctly)"))
    if words - {"full_shard"}:
        out.append(Problem("fsdp", f"with {TP} > 1 only 'full_shard' (transformers' FSDP2 under TP); "
                                   f"not {' '.join(sorted(words - {'full_shard'}))}"))
    out += _untested_with(spec, TP, compiled="compiling DTensor layers is not tested",
                          liger="Liger's kernels take plain tensors, not DTensor shards")
    if spec.torch_dtype == "float16":
        out.append(Problem("torch_dtype", f"float16 with {TP} > 1 is not supported (no sharded grad scaler); "
                                          "use bfloat16"))
    return out



def _ep_problems(spec: JobSpec) -> list[Problem]:
    """Expert parallel is transformers' (DistributedConfig ep_size, all-to-all token dispatch) over
    its FSDP2: the experts are spread over the ranks FSDP shards over, so EP needs them (EP = TP
    without FSDP, which transformers allows, is not tested). Its rules are transformers', not
    Megatron's: EP a multiple of TP and a divisor of FSDP x TP (the world-size half is
    `world_problems`'). What does not compose is refused by name; which models and LoRA targets it
    takes needs the model (`ep_model_problems`)."""
    ep, tp = spec.expert_model_parallel_size, spec.tensor_model_parallel_size
    if ep <= 1:
        return []
    out = []
    if spec.deepspeed:
        out.append(Problem("deepspeed", f"{EP} > 1 runs on transformers' expert parallel with FSDP2 (DeepSpeed's AutoEP "
                                        "fails at start with this transformers); remove deepspeed and set fsdp to "
                                        "full_shard"))
    else:
        words = set((spec.fsdp or "").replace(",", " ").split())
        if "full_shard" not in words:
            out.append(Problem("fsdp", f"{EP}={ep} spreads the experts over the ranks FSDP2 shards over: set fsdp to "
                                       "full_shard"))
        elif words - {"full_shard"}:
            out.append(Problem("fsdp", f"with {EP} > 1 only 'full_shard' (transformers' FSDP2 under EP); not "
                                       f"{' '.join(sorted(words - {'full_shard'}))}"))
    if ep % tp:
        out.append(Problem(EP, f"EP={ep} must be a multiple of {TP}={tp} (transformers' expert parallel: each TP "
                               "group holds whole experts)"))
    for dim in (SP, CP):
        if getattr(spec, dim) > 1:
            out.append(Problem(EP, f"not with {dim} > 1 (they do not compose in this worker); use one of them"))
    if spec.train_type == "full" and spec.torch_dtype == "float16":
        out.append(Problem("torch_dtype", f"float16 with {EP} > 1 is not supported (no sharded grad scaler); use "
                                          "bfloat16"))
    out += _untested_with(spec, EP, compiled="compiling the all-to-all dispatch is not tested",
                          liger="Liger's kernels are not tested on the dispatched experts")
    return out


def ep_model_problems(spec: JobSpec, is_moe: bool, num_experts: int, tied: bool, lora_on_experts: bool) -> list[Problem]:
    """EP's rules that need the model: a mixture of experts, experts % EP, untied embeddings (the
    tied case under transformers' FSDP2 is refused with TP already, and not tested with EP), and
    LoRA kept off the router and the experts: peft 0.21 wraps those stacked parameters in a
    ParamWrapper, which transformers' expert dispatch cannot read (`'ParamWrapper' object has no
    attribute 'weight'`, pinned in tests/test_expert_parallel.py)."""
    ep = spec.expert_model_parallel_size
    if ep <= 1:
        return []
    if not is_moe:
        return [Problem(EP, f"EP={ep} needs a mixture-of-experts model; {spec.model} is dense")]
    out = []
    if num_experts % ep:
        out.append(Problem(EP, f"the model's {num_experts} experts are not divisible by EP={ep}"))
    if tied and spec.fsdp:
        out.append(Problem("fsdp", f"{EP} > 1 with a model whose embeddings are tied is not tested under transformers' "
                                   "FSDP2 (with TP it trains them wrongly); untie them or leave EP at 1"))
    if lora_on_experts:
        out.append(Problem("target_modules", f"LoRA on the router and the experts ({', '.join(spec.target_modules)} "
                                             f"reaches them) does not run with {EP} > 1: peft wraps the stacked expert "
                                             "weights in a way transformers' expert dispatch cannot read; name the "
                                             "attention projections (q_proj k_proj v_proj o_proj) instead"))
    return out


FLASH_IMPLS = ("flash_attention_2", "flash_attention_3")


def _sp_problems(spec: JobSpec) -> list[Problem]:
    """Ulysses sequence parallel is DeepSpeed's ALST for HF models (launcher/engines/zero.py); what
    does not compose with it is refused by name."""
    if spec.sequence_parallel_size <= 1:
        return []
    out = []
    if not spec.deepspeed:
        out.append(Problem("deepspeed", f"{SP} > 1 runs on DeepSpeed's Ulysses (ALST): choose a ZeRO stage "
                                        "(zero0 to zero3) or a DeepSpeed JSON"))
    if spec.tensor_model_parallel_size > 1:
        out.append(Problem(SP, f"not with {TP} > 1 (transformers' TP and DeepSpeed's Ulysses do not compose "
                               "in this worker); use one of them"))
    if spec.attn_impl == "eager":
        out.append(Problem("attn_impl", f"eager attention needs a 4D mask that Ulysses ({SP} > 1) cannot "
                                        "split; use sdpa, flex_attention or flash_attention_2"))
    eval_size = spec.per_device_eval_batch_size
    if spec.evaluates and eval_size not in (None, spec.per_device_train_batch_size):
        out.append(Problem("per_device_eval_batch_size", f"{eval_size} with {SP} > 1: Ulysses is set up for one "
                                                         "micro-batch size; leave it empty (the training one)"))
    if spec.packing and spec.attn_impl not in FLASH_IMPLS:
        # DeepSpeed's Ulysses drops the attention mask; only flash-attention reads the sample
        # boundaries from the position ids, sdpa and flex would attend across packed samples.
        out.append(Problem("packing", f"packing with {SP} > 1 needs attn_impl flash_attention_2 or 3 (Ulysses "
                                      "drops the mask; sdpa and flex_attention would attend across the packed "
                                      "samples); turn packing off or use flash-attention"))
    out += _untested_with(spec, SP, compiled="compiling through Ulysses' all-to-all is not tested",
                          liger="Liger's fused loss is not wired to the sequence-sharded loss")
    return out


RING_ATTN_IMPLS = (None, "", "auto", "sdpa")
CP_NEEDS_CUDA = ("ring attention (torch's context_parallel) runs on CUDA GPUs only: torch has no ring rule for "
                 "the CPU attention kernel; use sequence_parallel_size (Ulysses, which runs on CPU too) or GPU nodes")


def _cp_problems(spec: JobSpec) -> list[Problem]:
    """Ring context parallel is torch's `context_parallel` over FSDP2 (launcher/engines/cp.py): it
    rewrites SDPA into ring attention with the causal mask only; what does not compose is refused by
    name. That it needs GPUs is the cluster's rule (`device_problems`)."""
    if spec.context_parallel_size <= 1:
        return []
    out = []
    if spec.deepspeed or not spec.fsdp:
        out.append(Problem("fsdp", f"{CP} > 1 runs on FSDP2 (torch's context_parallel): set fsdp to full_shard or "
                                   "shard_grad_op" + (" and remove deepspeed (DeepSpeed's long-context path is "
                                                      "sequence_parallel_size, Ulysses)" if spec.deepspeed else "")))
    for field in (TP, SP):
        if getattr(spec, field) > 1:
            out.append(Problem(CP, f"not with {field} > 1 (they do not compose in this worker); use one of them"))
    if spec.attn_impl not in RING_ATTN_IMPLS:
        out.append(Problem("attn_impl", f"{spec.attn_impl} with {CP} > 1: torch's ring attention replaces SDPA "
                                        "only; use sdpa"))
    if spec.packing:
        # The ring computes plain causal attention over the whole row: packed samples would see each other.
        out.append(Problem("packing", f"packing with {CP} > 1: ring attention knows only the causal mask, so packed "
                                      "samples would attend to each other; turn packing off (rows are padded at "
                                      "the end, which the causal mask keeps out of every real token's view)"))
    out += _untested_with(spec, CP, compiled="compiling the ring dispatch is not tested",
                          liger="Liger's fused loss is not wired to the sequence-sharded loss")
    return out


OFFLOAD_NEEDS_CUDA = ("offloads from GPU memory to pinned host memory: a CPU node's activations are in host memory "
                      "already; turn it off")


def device_problems(spec: JobSpec, devices: dict[str, str]) -> list[Problem]:
    """What needs GPUs, on the nodes' devices (`{host: "cuda" | "cpu"}`): ring CP and activation
    offload are refused where a node has no GPU."""
    cpu = [host for host, device in devices.items() if device != "cuda"]
    if not cpu:
        return []
    where = f"({', '.join(cpu)} {'is a CPU node' if len(cpu) == 1 else 'are CPU nodes'})"
    needs = [(CP, CP_NEEDS_CUDA)] if spec.context_parallel_size > 1 else []
    needs += [(OFFLOAD, OFFLOAD_NEEDS_CUDA)] if spec.activation_cpu_offload else []
    return [Problem(field, f"{why} {where}") for field, why in needs]


TILED, OFFLOAD = "tiled_mlp", "activation_cpu_offload"


def _long_sequence_problems(spec: JobSpec) -> list[Problem]:
    """The tiled MLP (DeepSpeed's TiledMLP) and activation offload (transformers' checkpointing with
    torch's save_on_cpu) with what they are not known to compose with, each refused by name; how
    many ranks they may run on is `world_problems`'."""
    out = []
    if spec.activation_cpu_offload and not spec.gradient_checkpointing:
        out.append(Problem(OFFLOAD, "offloads what gradient checkpointing saves: turn gradient_checkpointing on"))
    for field in (TILED, OFFLOAD):
        if not getattr(spec, field):
            continue
        for dim in (TP, CP):
            if getattr(spec, dim) > 1:
                out.append(Problem(field, f"not with {dim} > 1 (not tested together); turn one off"))
        if spec.torch_compile:
            out.append(Problem(field, "not with torch_compile (the compiled layers are not tested with it); turn one off"))
    return out


def multi_rank_problems(spec: JobSpec, world: int) -> list[Problem]:
    """Where the tiled MLP and activation offload run with more than one rank. TiledMLP computes its
    weights' gradients tile by tile in its own backward: DeepSpeed holds them back until the last
    tile (ZeRO-3 is `zero_problems`'), while torch's DDP takes each tile's part for the whole; FSDP2
    on several ranks is not tested. Offload was tested on one GPU only."""
    if world <= 1:
        return []
    out = []
    if spec.tiled_mlp and not spec.deepspeed:
        out.append(Problem(TILED, f"on {world} ranks runs with DeepSpeed ZeRO-0, 1 or 2 only (they reduce its "
                                  "gradients once all tiles are done; torch's DDP would reduce each tile's part, "
                                  "FSDP2 is not tested); on one GPU it runs with every engine"))
    if spec.activation_cpu_offload:
        out.append(Problem(OFFLOAD, f"runs on one GPU only (it was tested there; this job has {world} ranks)"))
    return out


def ring_model_problems(spec: JobSpec, sliding_window: int, attention_chunk: int,
                        other_mixers: tuple[str, ...]) -> list[Problem]:
    """Ring CP computes plain causal attention over the whole sequence and runs every other layer on
    each rank's head and tail chunks as if they were one piece (`backend.job.modelcfg.sequence_mixing`
    gives the arguments): a window or a chunk shorter than max_length would be trained as full
    attention, and a layer that mixes the sequence otherwise (linear attention, SSM) would be wrong."""
    if spec.context_parallel_size <= 1:
        return []
    out = []
    for kind, span in (("sliding window", sliding_window), ("attention chunk", attention_chunk)):
        if span and span < spec.max_length:
            out.append(Problem(CP, f"the model attends over a {kind} of {span} tokens, shorter than max_length "
                                   f"{spec.max_length}; ring attention has none and would train it as full attention: "
                                   f"use max_length <= {span}, or sequence_parallel_size"))
    if other_mixers:
        out.append(Problem(CP, f"the model has {', '.join(other_mixers)} layers, which mix the sequence outside "
                               "attention and cannot run on ring CP's chunks; use sequence_parallel_size"))
    return out


def pipeline_model_problems(spec: JobSpec, sliding_window: int, attention_chunk: int,
                            other_mixers: tuple[str, ...]) -> list[Problem]:
    """A pipeline stage builds the plain causal mask for its layers (launcher/engines/pp.py): a
    window or chunk shorter than max_length would be trained as full attention, and layers that
    mix the sequence otherwise (linear attention, SSM) are not run by a stage."""
    if spec.pipeline_model_parallel_size <= 1:
        return []
    out = [Problem(PP, f"the model attends over a {kind} of {span} tokens, shorter than max_length "
                       f"{spec.max_length}; a pipeline stage builds the full causal mask and would train it as full "
                       f"attention: use max_length <= {span}, or leave PP at 1")
           for kind, span in (("sliding window", sliding_window), ("attention chunk", attention_chunk))
           if span and span < spec.max_length]
    if other_mixers:
        out.append(Problem(PP, f"the model has {', '.join(other_mixers)} layers, which a pipeline stage does not run; "
                               "leave PP at 1"))
    return out


def ring_kernel_problems(spec: JobSpec, num_heads: int, num_kv_heads: int) -> list[Problem]:
    """torch's ring has rules for the flash, memory-efficient and cuDNN SDPA kernels, not for the
    math fallback. In float32 only the memory-efficient kernel runs, and it has no grouped-query
    attention, which transformers asks for when there is no mask: a GQA model would fall back."""
    if spec.context_parallel_size <= 1 or spec.torch_dtype != "float32" or num_kv_heads >= num_heads:
        return []
    return [Problem("torch_dtype", f"float32 with {CP} > 1 and this model's grouped-query attention ({num_heads} "
                                   f"heads, {num_kv_heads} key/value heads): the float32 SDPA kernel has no GQA and "
                                   "its math fallback no ring rule; use bfloat16")]


PARALLEL_FIELDS = (TP, SP, CP, "pipeline_model_parallel_size", "expert_model_parallel_size",
                   "expert_tensor_parallel_size")


def parallel_refusals(spec: JobSpec, devices: dict[str, str] | None = None) -> dict[str, str]:
    """Why the worker would refuse each parallel dimension (left at 1) above 1, with the rest of the
    job as it is and on the nodes' devices (`{host: "cuda" | "cpu"}`, as `device_problems`): the
    refusals that setting it to 2 adds, as the form greys it out. A refusal with a fix (the engine
    the dimension runs on, `engine_fixes`) does not grey it: the form offers the fix instead."""
    def refused(job: JobSpec) -> list[Problem]:
        return unsupported(job) + device_problems(job, devices or {})

    before = {(p.field, p.message) for p in refused(spec)}
    out = {}
    for field in PARALLEL_FIELDS:
        if getattr(spec, field) > 1:
            continue
        trial = spec.model_copy(update={field: 2})
        added = [p for p in refused(apply_fixes(trial, engine_fixes(trial)))
                 if p.severity == "error" and (p.field, p.message) not in before]
        if added:
            out[field] = "; ".join(p.message if p.field == field else f"{p.field}: {p.message}" for p in added)
    return out
