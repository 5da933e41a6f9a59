"""Import an ms-swift command line into a job spec (as a mapping; `parse_spec` checks it).

Public API:
    import_command(text) -> ImportResult             raises CommandError for text with no swift command
    ImportResult.spec / .ignored / .notes / .defaults / .problems / .parse() / .yaml_text(spec)
    ms_swift_defaults(values, kind="swift") -> {field: (value, why)}

Understands what ms-swift's docs show: `VAR=value` prefixes (NPROC_PER_NODE, NNODES,
CUDA_VISIBLE_DEVICES, NCCL_*, ...), backslash-newlines, shell variables set on earlier lines and
`$(expr a / b)` arithmetic, `swift sft`, `megatron sft` (Megatron argument names mapped onto
ours), `torchrun [...] swift/cli/sft.py`, `python swift/cli/sft.py` and `deepspeed ... sft.py`.
Flags with no counterpart are listed in `ignored`, never dropped silently.

An omitted flag means ms-swift's default, not swift-studio's: where the two differ the import fills
in ms-swift's value and says so in `defaults` (swift/cli/main.py, swift/arguments/, the trainer
mixin and swift/megatron/arguments/megatron_args.py of ms-swift 3.12 and 4.x agree on these).
"""
from __future__ import annotations

import ast
import math
import operator
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from backend.job import capabilities
from backend.job.memory import adapts_stacked_params
from backend.job.modelcfg import find_model_config
from backend.job.spec import FIELDS, JobSpec, Problem, canonical_key, parse_spec

SCRIPTS = ("cli/sft.py", "cli/megatron/sft.py", "cli/rlhf.py", "cli/megatron/rlhf.py")
RLHF_FIELDS = ("rlhf_type", "beta", "loss_type", "label_smoothing", "rpo_alpha", "cpo_alpha", "simpo_gamma",
               "ref_model", "ref_adapters", "precompute_ref_log_probs")
RLHF_TYPES = ("dpo", "cpo", "simpo", "orpo")
"""Job fields only a `swift rlhf` command sets (`swift sft`'s own --loss_type is another thing)."""
LIST_FIELDS = ("dataset", "target_modules", "report_to", "model_name", "model_author", "adapters", "ref_adapters")
ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
EXPR = re.compile(r"\$\(\s*expr\s+([^()]*)\)")
# Environment prefixes that describe the launch rather than the workers' environment.
LAUNCH_ENV = {"NPROC_PER_NODE": "nproc_per_node", "NNODES": "nnodes"}
TEMPLATE_ENV = {"MAX_PIXELS": "max_pixels", "VIDEO_MAX_PIXELS": "video_max_pixels", "FPS_MAX_FRAMES": "fps_max_frames",
                "VIDEO_SEGMENTS": "video_segments"}
"""Environment variables ms-swift's Qwen-VL templates read (its examples set them) and the job's fields."""
TEMPLATE_ENV_UNHONOURED = ("MIN_PIXELS", "VIDEO_MIN_PIXELS", "VIDEO_TOTAL_PIXELS", "FPS", "FPS_MIN_FRAMES")
"""The others they read: the worker keeps the model's processor's minimums and samples 2 frames a second."""
CLUSTER_ENV = ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
TORCHRUN_LAYOUT = {"nproc_per_node": "nproc_per_node", "nproc-per-node": "nproc_per_node", "nnodes": "nnodes"}
TORCHRUN_CLUSTER = ("node_rank", "node-rank", "master_addr", "master-addr", "master_port", "master-port",
                    "rdzv_endpoint", "rdzv-endpoint", "rdzv_backend", "rdzv-backend", "rdzv_id", "rdzv-id",
                    "max_restarts", "max-restarts", "hostfile", "include", "exclude", "num_nodes", "num_gpus")
ATTN_NAMES = {"flash_attn": "flash_attention_2", "flash_attention_2": "flash_attention_2", "flash_attention_3": "flash_attention_3",
              "sdpa": "sdpa", "eager": "eager", "flash": "flash_attention_2"}
# ms-swift's older DeepSpeed names.
DS_NAMES = {"default-zero2": "zero2", "default-zero3": "zero3", "zero2-offload": "zero2_offload", "zero3-offload": "zero3_offload"}
TRUE_WORDS = ("true", "1", "yes")
# The Hugging Face trainer's (and Megatron's) mixed-precision switches: swift-studio's torch_dtype.
HALF_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
# ms-swift 4.x calls it --tuner_type, 3.x --train_type, 2.x --sft_type: one field, whichever is used.
TRAIN_TYPE_FLAGS = ("tuner_type", "train_type", "sft_type")
# Free text, where '$USD' is the user's own text and not a variable left unset.
TEXT_FIELDS = ("system", "model_name", "model_author")
# swift-studio trains these; ms-swift's other tuners (adalora, longlora, vera, boft, reft, ...) are refused by name.
TRAIN_TYPES = ("lora", "full")
# Flags that only a mixture-of-experts model takes: with one, the model is MoE even when its config is not at hand.
MOE_FLAG = re.compile(r"^(moe_|expert_|router_aux_loss_coef$|num_experts)")
# ms-swift's trainer derives gradient accumulation from a global batch of 16 (swift/trainers/arguments.py),
# Megatron-SWIFT's --global_batch_size defaults to 16 as well.
MS_SWIFT_GLOBAL_BATCH = 16


class CommandError(ValueError):
    """Text that holds no ms-swift training command, or that the shell could not split."""


@dataclass
class ImportResult:
    spec: dict[str, Any] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    """Flags and variables with no swift-studio counterpart (shown to the user, kept in the YAML)."""
    notes: list[str] = field(default_factory=list)
    """Flags that were translated, approximately, into another field."""
    defaults: list[str] = field(default_factory=list)
    """Omitted flags whose ms-swift default differs from swift-studio's: filled in, or (no way to
    fill it) what differs."""
    problems: list[Problem] = field(default_factory=list)
    """What ms-swift itself would refuse, each naming its flag(s); no job comes of the command."""

    def parse(self, source: str = "command") -> tuple[JobSpec | None, list[Problem]]:
        """`parse_spec` of the imported fields, with the import's own problems first: every
        problem at once."""
        spec, problems = parse_spec(self.spec, source=source)
        return (None if self.problems else spec), self.problems + problems

    def yaml_text(self, spec: JobSpec) -> str:
        """The job YAML with what was translated, ignored or defaulted as comments at the top."""
        header = ([f"# imported: {n}" for n in self.notes] + [f"# ignored: {i}" for i in self.ignored]
                  + [f"# ms-swift default: {d}" for d in self.defaults])
        return "\n".join(header + [spec.to_yaml()]) if header else spec.to_yaml()


def _expr(text: str) -> str:
    """Evaluate `expr`'s integer arithmetic (the docs use `$(expr 32 / $nproc_per_node / $nnodes)`)."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.left), ev(node.right))
        raise CommandError(f"cannot evaluate $(expr {text})")

    try:
        tree = ast.parse(text.replace("\\*", "*").replace("/", "//"), mode="eval")
        return str(ev(tree.body))
    except (SyntaxError, ZeroDivisionError):
        raise CommandError(f"cannot evaluate $(expr {text})") from None


def _substitute(text: str, variables: dict[str, str]) -> str:
    text = VAR.sub(lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), text)
    return EXPR.sub(lambda m: _expr(m.group(1)), text)


def _statements(text: str) -> list[str]:
    joined = re.sub(r"\\\r?\n", " ", text)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def _flags(tokens: list[str]) -> list[tuple[str, list[str]]]:
    """`--a 1 --b x y --c` -> [('a', ['1']), ('b', ['x', 'y']), ('c', [])]."""
    out: list[tuple[str, list[str]]] = []
    for token in tokens:
        if token.startswith("--") and len(token) > 2:
            name, eq, value = token[2:].partition("=")
            out.append((name, [value] if eq else []))
        elif out:
            out[-1][1].append(token)
        else:
            out.append(("", [token]))
    return out


def _split_launcher(tokens: list[str], result: ImportResult) -> tuple[str, str, list[str], bool]:
    """Find the swift command in `tokens`; returns (launcher, kind, the training arguments, whether
    it is preference training: `rlhf`), where launcher is the program that was run ('swift',
    'megatron', 'torchrun', 'python', 'deepspeed', ...)."""
    if tokens[:1] in (["swift"], ["megatron"]) and tokens[1:2] in (["sft"], ["rlhf"]):
        return tokens[0], tokens[0], tokens[2:], tokens[1] == "rlhf"
    if tokens[:2] in (["swift", "pt"], ["megatron", "pt"]):
        raise CommandError(f"'{' '.join(tokens[:2])}' is pre-training; swift-studio imports 'swift sft', 'swift rlhf', "
                           "'megatron sft' and 'megatron rlhf'")
    script = next((i for i, t in enumerate(tokens) if t.endswith(SCRIPTS)), None)
    if script is None:
        raise CommandError("no 'swift sft', 'swift rlhf', 'megatron sft', 'megatron rlhf' or '.../swift/cli/sft.py' "
                           "command found")
    launcher = _flags(tokens[1:script])
    for name, values in launcher:
        if name in TORCHRUN_LAYOUT and values:
            result.spec[TORCHRUN_LAYOUT[name]] = values[0]
        elif name in TORCHRUN_CLUSTER:
            result.notes.append(f"{tokens[0]} --{name}: set by the cluster (hostfile) and planner")
        elif name and name not in ("m",):
            result.ignored.append(f"{tokens[0]} --{name} {shlex.join(values)}".rstrip())
    kind = "megatron" if "megatron" in tokens[script] else "swift"
    return tokens[0].rsplit("/", 1)[-1], kind, tokens[script + 1:], tokens[script].endswith("rlhf.py")


def _bool(values: list[str]) -> bool:
    return not values or values[0].lower() in TRUE_WORDS


def _megatron(name: str, values: list[str], result: ImportResult, pending: dict[str, str]) -> bool:
    """Megatron-SWIFT argument names; True when handled."""
    value = values[0] if values else ""
    simple = {"load": "model", "train_iters": "max_steps", "max_epochs": "num_train_epochs", "save": "output_dir",
              "save_interval": "save_steps", "log_interval": "logging_steps", "lr_warmup_fraction": "warmup_ratio",
              "clip_grad": "max_grad_norm", "lr_decay_style": "lr_scheduler_type"}
    if name in simple:
        result.spec[simple[name]] = value
        if name == "load":
            result.notes.append(f"--load {value}: the Hugging Face model directory is what swift-studio trains from (not an mcore checkpoint)")
    elif name in ("global_batch_size", "lr_warmup_iters"):
        pending[name] = value  # needs the layout / step count, resolved at the end
    elif name == "recompute_granularity":
        result.spec["gradient_checkpointing"] = value != "none"
        result.notes.append(f"--recompute_granularity {value} -> gradient_checkpointing {value != 'none'}")
    elif name in ("use_flash_attn", "attention_backend"):
        if name == "attention_backend" and value in ATTN_NAMES or name == "use_flash_attn" and _bool(values):
            result.spec["attn_impl"] = "flash_attention_2"
    elif name == "sequence_parallel":
        result.notes.append("--sequence_parallel: Megatron sequence parallelism rides on TP (no separate setting)")
    else:
        return False
    return True


def import_command(text: str) -> ImportResult:
    result = ImportResult()
    variables: dict[str, str] = {}
    command: list[str] | None = None
    env: dict[str, str] = {}
    for statement in _statements(text):
        try:
            tokens = shlex.split(_substitute(statement, variables))
        except ValueError as exc:
            raise CommandError(f"cannot split the command line: {exc}") from None
        assigns = []
        while tokens and (m := ASSIGN.match(tokens[0])):
            assigns.append((m.group(1), m.group(2)))
            tokens.pop(0)
        if not tokens:  # a line of plain shell variables, e.g. nproc_per_node=4
            variables.update(assigns)
            continue
        if tokens[0] == "export":
            variables.update(t.split("=", 1) for t in tokens[1:] if "=" in t)
            env.update(t.split("=", 1) for t in tokens[1:] if "=" in t)
            continue
        if command is not None:
            result.ignored.append(f"second command: {statement[:60]}")
            continue
        command = tokens
        env.update(assigns)
    if command is None:
        raise CommandError("no 'swift sft', 'megatron sft' or '.../swift/cli/sft.py' command found")

    launcher, kind, args, rlhf = _split_launcher(command, result)
    for name, value in env.items():
        if name in LAUNCH_ENV and _unset(name, value, result):
            continue
        if name in LAUNCH_ENV:
            result.spec[LAUNCH_ENV[name]] = value
        elif name in CLUSTER_ENV:
            result.notes.append(f"{name}={value}: set by the cluster (hostfile) and planner")
        elif name in TEMPLATE_ENV and value.isdigit():
            result.spec[TEMPLATE_ENV[name]] = value
            result.notes.append(f"{name}={value} -> {TEMPLATE_ENV[name]}"
                                + (" (a --max_pixels flag takes precedence)" if name == "MAX_PIXELS" else ""))
        elif name in TEMPLATE_ENV_UNHONOURED:
            result.ignored.append(f"{name}={value}: ms-swift's Qwen-VL templates read it; the worker keeps the model "
                                  "processor's minimums and samples 2 frames a second")
        else:
            result.spec.setdefault("env", {})[name] = value
    pending: dict[str, str] = {}
    train_types: dict[str, str] = {}
    seen: set[str] = set()
    simpo_loss = False
    for name, values in _flags(args):
        if not name:
            result.ignored.append(f"stray argument {' '.join(values)}")
            continue
        flag = f"--{name} {shlex.join(values)}".rstrip()
        seen.add(canonical_key(name))
        if canonical_key(name) not in TEXT_FIELDS and any(_unset(f"--{name}", value, result) for value in values):
            continue
        if kind == "megatron" and _megatron(name, values, result, pending):
            continue
        if name in HALF_DTYPES:
            if _bool(values) or not values:
                result.spec["torch_dtype"] = HALF_DTYPES[name]
                result.notes.append(f"{flag} -> torch_dtype {HALF_DTYPES[name]}")
            else:
                result.notes.append(f"{flag}: the precision is torch_dtype's (the model's own unless set)")
            continue
        key = "train_type" if name in TRAIN_TYPE_FLAGS else canonical_key(name)
        if key not in FIELDS or key in ("env",) or (key in RLHF_FIELDS and not rlhf):
            result.ignored.append(flag)
            continue
        if key == "rlhf_type" and (len(values) != 1 or values[0] not in RLHF_TYPES):
            result.problems.append(Problem(f"--{name}", f"{shlex.join(values)} is not supported: swift-studio trains "
                                                        "'dpo', 'cpo', 'simpo' and 'orpo' (ms-swift's kto, rm, ppo, "
                                                        "grpo and gkd are not available here)"))
            continue
        if key == "loss_type" and values == ["simpo"]:  # ms-swift's simpo is cpo with this loss
            result.notes.append(f"{flag} -> rlhf_type simpo")
            simpo_loss = True
            continue
        if key == "loss_type" and len(values) > 1:  # ms-swift mixes DPO losses (MPO)
            result.problems.append(Problem(f"--{name}", f"{shlex.join(values)}: one loss type (sigmoid, hinge, ipo "
                                                        "or robust); mixed losses are not available here"))
            continue
        if key in LIST_FIELDS:
            result.spec[key] = values
        elif not values:
            result.spec[key] = True
        elif len(values) > 1:
            result.ignored.append(f"{flag} (one value expected)")
        elif key == "train_type":
            train_types[name] = values[0]
        elif key == "save_total_limit":
            _save_total_limit(values[0], kind, result)
        elif key == "attn_impl":
            result.spec[key] = ATTN_NAMES.get(values[0], values[0])
        elif key == "deepspeed":
            result.spec[key] = DS_NAMES.get(values[0], values[0])
        else:
            result.spec[key] = values[0]
    if len(set(train_types.values())) > 1:
        result.problems.append(Problem(", ".join(f"--{n}" for n in train_types),
                                       f"disagree ({', '.join(f'{n} {v}' for n, v in train_types.items())}): "
                                       "--tuner_type is ms-swift 4.x's name for 3.x's --train_type; give one"))
    elif train_types:
        name, value = next(iter(train_types.items()))
        if value in TRAIN_TYPES:
            result.spec["train_type"] = value
        else:
            result.problems.append(Problem(f"--{name}", f"{value} is not supported: swift-studio trains 'lora' (with "
                                                        "--lora_rank/--lora_alpha) and 'full'; ms-swift's other "
                                                        "tuners are not available here"))
    if simpo_loss:
        result.spec["rlhf_type"] = "simpo"
    if rlhf and "rlhf_type" not in result.spec and not any(p.field.startswith("--rlhf_type") for p in result.problems):
        result.spec["rlhf_type"] = "dpo"
        result.defaults.append("rlhf_type dpo: ms-swift's default (swift/arguments/rlhf_args.py)")
    _one_process(launcher, kind, env, result)
    if kind == "megatron":
        _resolve_megatron(result, pending)
    _fill_defaults(kind, seen, result)
    _trackers(result)
    _choose_engines(result, moe=any(MOE_FLAG.match(name) for name in seen))
    return result


def _trackers(result: ImportResult) -> None:
    """--report_to keeps the trackers swift-studio writes; another (neptune, clearml, …) is dropped
    with a note: the run's metrics stay in the studio's database and charts."""
    value = result.spec.get("report_to")
    if not value:
        return
    names = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    dropped = [n for n in names if n not in capabilities.TRACKERS and n != "none"]
    if dropped:
        result.spec["report_to"] = [n for n in names if n not in dropped]
        result.notes.append(f"--report_to {' '.join(dropped)}: dropped, not a tracker swift-studio writes (it writes "
                            f"{', '.join(capabilities.TRACKERS)}); the run's metrics stay in the studio")


def _choose_engines(result: ImportResult, moe: bool) -> None:
    """What a job that ms-swift runs needs to run here, chosen for the user with a note each: the
    engine a parallel dimension runs on (capabilities.engine_fixes: EP on FSDP2, Ulysses on DeepSpeed,
    ring CP on FSDP2; ms-swift's Megatron and its DDP Ulysses need none), and no LoRA dropout where
    LoRA reaches a mixture of experts' stacked weights (peft refuses it there). `moe`: the command
    has MoE-only flags (the model's config may not be at hand)."""
    spec, problems = parse_spec(result.spec)
    if spec is None:
        return  # the import's parse reports them
    fixes = capabilities.engine_fixes(spec)
    for fix in fixes:
        for name, value in fix.changes:
            if value is None:
                result.spec.pop(name, None)
            else:
                result.spec[name] = value
        result.notes.append(f"{fix.text()}: chosen for you, {fix.why}")
    spec = capabilities.apply_fixes(spec, fixes)
    clashes = [p for p in capabilities.padding_free_problems(spec) if p.severity == "error"]
    if clashes:  # ms-swift runs these padded; padding_free only changes the speed
        result.spec.pop("padding_free")
        result.notes.append(f"--padding_free dropped ({clashes[0].message.removesuffix('; turn padding_free off')}): "
                            "it changes only the speed, not what is trained")
        spec = spec.model_copy(update={"padding_free": False})
    if spec.train_type != "lora" or spec.lora_dropout == 0:
        return
    model = find_model_config(spec.model)
    stacked = adapts_stacked_params(spec, model) if model else moe and "all-linear" in spec.target_modules
    if stacked:
        result.spec["lora_dropout"] = 0
        result.notes.append(f"lora_dropout 0 (was {spec.lora_dropout}): LoRA on the router and stacked experts of a "
                            "mixture of experts takes no dropout in peft")


def _unset(where: str, value: str, result: ImportResult) -> bool:
    """Whether `value` still holds a shell variable the pasted text does not set (a launching
    platform's, such as DLC's NNODES=$WORLD_SIZE): a problem naming it, not a literal '$X' value."""
    left = VAR.search(value)
    if left:
        result.problems.append(Problem(where, f"{value}: ${left.group(1) or left.group(2)} is not set in the pasted "
                                              "text (a variable of the platform that runs the script, such as DLC's "
                                              "WORLD_SIZE and RANK?); put its value in"))
    return bool(left)


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _on(value: Any) -> bool:
    """A flag's value as ms-swift reads it: --deepspeed zero2 and --use_liger_kernel true are on."""
    return value is True or isinstance(value, str) and value.strip().lower() not in ("", "none", "false", "0", "no")


def _save_total_limit(value: str, kind: str, result: ImportResult) -> None:
    limit = _int_or_none(value)
    if kind == "megatron" and limit is not None and limit < 2:
        result.problems.append(Problem("--save_total_limit", f"{value}: megatron sft refuses fewer than 2 "
                                                             "(ms-swift: 'save_total_limit must be greater than or equal to 2')"))
    elif limit is not None and limit <= 0:
        # The Hugging Face trainer and ms-swift's own rotation keep every checkpoint for a limit <= 0.
        result.notes.append(f"--save_total_limit {value}: no limit (every checkpoint kept, as in ms-swift)")
    else:
        result.spec["save_total_limit"] = value


def _one_process(launcher: str, kind: str, env: dict[str, str], result: ImportResult) -> None:
    """How many processes a node runs when the command names no count, and what ms-swift does with
    the GPUs each process sees (swift/cli/main.py use_torchrun; swift/utils/env.py is_mp)."""
    spec = result.spec
    if "nproc_per_node" not in spec:
        if launcher == "deepspeed":
            return  # DeepSpeed's launcher takes every visible GPU, as an empty nproc_per_node does
        if launcher in ("swift", "megatron"):
            why = ("NNODES without NPROC_PER_NODE: torchrun's default of one process per node" if "NNODES" in env
                   else "no NPROC_PER_NODE or NNODES: ms-swift runs one process, without torchrun")
        else:
            why = f"{launcher} without --nproc_per_node runs one process"
        spec["nproc_per_node"] = 1
        result.defaults.append(f"nproc_per_node 1 ({why}; swift-studio's empty value would start one per GPU)")
        if kind == "swift" and "CUDA_VISIBLE_DEVICES" not in env:
            result.notes.append("no CUDA_VISIBLE_DEVICES: on a machine with several GPUs ms-swift spreads this one "
                                "process's model over all of them (device_map); swift-studio trains it on one GPU")
    # Megatron places one rank per GPU; only swift sft turns spare visible GPUs into a device_map.
    nproc, visible = _int_or_none(spec["nproc_per_node"]), env.get("CUDA_VISIBLE_DEVICES")
    if kind != "swift" or visible is None or nproc is None or nproc < 1 or env.get("SWIFT_SINGLE_DEVICE_MODE") == "1":
        return
    gpus = len([d for d in visible.split(",") if d.strip()])
    per_process, rest = divmod(gpus, nproc)
    if rest:
        result.problems.append(Problem("CUDA_VISIBLE_DEVICES", f"{visible}: {gpus} GPU(s) do not divide among NPROC_PER_NODE="
                                                               f"{nproc} process(es), which ms-swift requires"))
    elif per_process > 1:
        refused = [f"--{k}" for k in ("deepspeed", "fsdp", "use_liger_kernel") if _on(spec.get(k))]
        where = f"{visible} with {nproc} process(es): ms-swift spreads each process's model over {per_process} GPUs (device_map)"
        if refused:
            result.problems.append(Problem("CUDA_VISIBLE_DEVICES", f"{where}, which it refuses with {', '.join(refused)}; "
                                                                   f"NPROC_PER_NODE={gpus} trains data-parallel"))
        else:
            result.notes.append(f"CUDA_VISIBLE_DEVICES={where}; swift-studio gives each process one GPU "
                                f"(nproc_per_node {gpus} trains data-parallel on all of them)")


def ms_swift_defaults(values: Mapping[str, Any], kind: str = "swift") -> dict[str, tuple[Any, str]]:
    """ms-swift's value, and why, for each field whose ms-swift default differs from swift-studio's,
    given the fields that are set (`values`, as command-line text or typed: train type, batch size,
    nnodes, nproc_per_node, max_steps). `kind` 'megatron' is megatron sft, whose gradient
    accumulation follows --global_batch_size instead (the import's `_resolve_megatron`)."""
    out: dict[str, tuple[Any, str]] = {}
    train_type = values.get("train_type") or ("full" if kind == "megatron" else "lora")
    if kind == "megatron":
        out["train_type"] = ("full", "megatron sft trains every parameter unless --tuner_type says otherwise")
    out["learning_rate"] = (1e-5, "ms-swift's default for full fine-tuning") if train_type == "full" else \
        (1e-4, "ms-swift's default for LoRA and the other tuners")
    out["strict"] = (False, "ms-swift skips a record it cannot encode (swift/arguments/base_args/data_args.py)")
    if kind != "swift":
        return out
    steps = _int_or_none(values.get("max_steps", -1))
    if steps is not None and steps <= 0:  # max_steps > 0 overrides the epochs in the trainer
        out["num_train_epochs"] = (3.0, "the Hugging Face trainer's default")
    batch, nproc, nnodes = (_int_or_none(values.get(k, 1)) for k in ("per_device_train_batch_size", "nproc_per_node", "nnodes"))
    if batch and nproc and nnodes and min(batch, nproc, nnodes) > 0:
        world = nproc * nnodes
        out["gradient_accumulation_steps"] = (max(1, math.ceil(MS_SWIFT_GLOBAL_BATCH / batch / world)),
                                              f"ceil({MS_SWIFT_GLOBAL_BATCH} / (batch {batch} x world {world}))")
    return out


# Omitted flags whose ms-swift default the import cannot give: (field or flag, ms-swift's value).
UNFILLED = (
    ("max_length", f"the model's max_model_len from its config.json (not read here; swift-studio's "
                   f"{JobSpec.model_fields['max_length'].default} kept)"),
    ("torch_dtype", f"the model's config.json dtype (not read here; swift-studio's {JobSpec.model_fields['torch_dtype'].default} kept)"),
    ("adam_beta2", "0.95 in ms-swift's AdamW (swift-studio's worker uses 0.999 and has no field for it)"),
)


def _fill_defaults(kind: str, seen: set[str], result: ImportResult) -> None:
    for name, (value, why) in ms_swift_defaults(result.spec, kind).items():
        if name not in result.spec and value != JobSpec.model_fields[name].default:
            result.spec[name] = value
            result.defaults.append(f"{name} {value} ({why}; swift-studio's is {JobSpec.model_fields[name].default})")
    result.defaults += [f"{name}: {what}" for name, what in UNFILLED if name not in seen]


def _resolve_megatron(result: ImportResult, pending: dict[str, str]) -> None:
    """global_batch_size (16 when omitted) -> gradient_accumulation_steps; lr_warmup_iters ->
    warmup_ratio; the epochs, when given, decide the step count as they do in Megatron-SWIFT."""
    spec = result.spec
    total_text = pending.get("global_batch_size", str(MS_SWIFT_GLOBAL_BATCH))
    nproc = _int_or_none(spec.get("nproc_per_node"))
    sizes = [_int_or_none(spec.get(k, 1))
             for k in ("nnodes", "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")]
    micro, total = _int_or_none(spec.get("per_device_train_batch_size", 1)), _int_or_none(total_text)
    if None in (nproc, micro, total, *sizes) or 0 in (micro, *sizes):
        if "global_batch_size" in pending:  # parse_spec names the value that is not a size
            result.ignored.append(f"--global_batch_size {total_text} (layout unknown)")
    else:
        nnodes, tp, pp, cp = sizes
        world = nnodes * nproc
        dp = max(1, world // (tp * pp * cp))
        how = f"global batch {total} / (micro {micro} x DP {dp}), DP = world {world} / (TP {tp} x PP {pp} x CP {cp})"
        if total % (micro * dp) or total < micro * dp:
            result.problems.append(Problem("--global_batch_size", f"{how} is not a whole number of micro-batches, which Megatron refuses"))
        else:
            spec["gradient_accumulation_steps"] = accumulation = total // (micro * dp)
            if "global_batch_size" in pending:
                result.notes.append(f"--global_batch_size {total} -> gradient_accumulation_steps {accumulation} ({how})")
            else:
                result.defaults.append(f"gradient_accumulation_steps {accumulation} (--global_batch_size defaults to "
                                       f"{MS_SWIFT_GLOBAL_BATCH}: {how})")
    if "num_train_epochs" in spec and "max_steps" in spec:
        result.notes.append(f"--train_iters {spec.pop('max_steps')} dropped: Megatron-SWIFT recomputes train_iters from the epochs")
    elif "num_train_epochs" not in spec and "max_steps" not in spec:
        result.problems.append(Problem("--train_iters", "megatron sft needs --train_iters or --num_train_epochs (3.x: --max_epochs)"))
    if "lr_warmup_iters" in pending:
        steps, warm = _int_or_none(spec.get("max_steps")), _int_or_none(pending["lr_warmup_iters"])
        if steps and warm is not None and steps > 0:
            spec["warmup_ratio"] = round(warm / steps, 6)
            result.notes.append(f"--lr_warmup_iters {warm} -> warmup_ratio {spec['warmup_ratio']}")
        else:
            result.ignored.append(f"--lr_warmup_iters {pending['lr_warmup_iters']} (needs --train_iters)")
