"""Import an ms-swift command line into a job spec (as a mapping; `parse_spec` checks it).

Public API:
    import_command(text) -> ImportResult             raises CommandError for text with no swift command
    ImportResult.spec / .ignored / .notes / .yaml_text(spec)

Understands what ms-swift's docs show: `VAR=value` prefixes (NPROC_PER_NODE, NNODES,
CUDA_VISIBLE_DEVICES, NCCL_*, ...), backslash-newlines, shell variables set on earlier lines and
`$(expr a / b)` arithmetic, `swift sft`, `megatron sft` (Megatron argument names mapped onto
ours), `torchrun [...] swift/cli/sft.py`, `python swift/cli/sft.py` and `deepspeed ... sft.py`.
Flags with no counterpart are listed in `ignored`, never dropped silently.
"""
from __future__ import annotations

import ast
import operator
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from backend.spec import FIELDS, JobSpec, canonical_key

LIST_FIELDS = ("dataset", "target_modules", "report_to")
ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
EXPR = re.compile(r"\$\(\s*expr\s+([^()]*)\)")
# Environment prefixes that describe the launch rather than the workers' environment.
LAUNCH_ENV = {"NPROC_PER_NODE": "nproc_per_node", "NNODES": "nnodes"}
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


class CommandError(ValueError):
    """Text that holds no ms-swift training command, or that the shell could not split."""


@dataclass
class ImportResult:
    spec: dict[str, Any] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    """Flags and variables with no swift-studio counterpart (shown to the user, kept in the YAML)."""
    notes: list[str] = field(default_factory=list)
    """Flags that were translated, approximately, into another field."""

    def yaml_text(self, spec: JobSpec) -> str:
        """The job YAML with what was translated or ignored as comments at the top."""
        header = [f"# imported: {n}" for n in self.notes] + [f"# ignored: {i}" for i in self.ignored]
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


def _split_launcher(tokens: list[str], result: ImportResult) -> tuple[str, list[str]]:
    """Find the swift command in `tokens`; returns (kind, the training arguments)."""
    if tokens[:2] in (["swift", "sft"], ["megatron", "sft"]):
        return tokens[0], tokens[2:]
    if tokens[:2] in (["swift", "pt"], ["megatron", "pt"], ["swift", "rlhf"], ["megatron", "rlhf"]):
        raise CommandError(f"'{' '.join(tokens[:2])}' is not supervised fine-tuning; swift-studio imports 'swift sft' and 'megatron sft'")
    script = next((i for i, t in enumerate(tokens) if t.endswith("cli/sft.py") or t.endswith("cli/megatron/sft.py")), None)
    if script is None:
        raise CommandError("no 'swift sft', 'megatron sft' or '.../swift/cli/sft.py' command found")
    launcher = _flags(tokens[1:script])
    for name, values in launcher:
        if name in TORCHRUN_LAYOUT and values:
            result.spec[TORCHRUN_LAYOUT[name]] = values[0]
        elif name in TORCHRUN_CLUSTER:
            result.notes.append(f"{tokens[0]} --{name}: set by the cluster (hostfile) and planner")
        elif name and name not in ("m",):
            result.ignored.append(f"{tokens[0]} --{name} {shlex.join(values)}".rstrip())
    kind = "megatron" if "megatron" in tokens[script] else "swift"
    return kind, tokens[script + 1:]


def _bool(values: list[str]) -> bool:
    return not values or values[0].lower() in TRUE_WORDS


def _megatron(name: str, values: list[str], result: ImportResult, pending: dict[str, str]) -> bool:
    """Megatron-SWIFT argument names; True when handled."""
    value = values[0] if values else ""
    simple = {"load": "model", "train_iters": "max_steps", "max_epochs": "num_train_epochs", "save": "output_dir",
              "save_interval": "save_steps", "log_interval": "logging_steps", "lr_warmup_fraction": "warmup_ratio"}
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

    kind, args = _split_launcher(command, result)
    for name, value in env.items():
        if name in LAUNCH_ENV:
            result.spec[LAUNCH_ENV[name]] = value
        elif name in CLUSTER_ENV:
            result.notes.append(f"{name}={value}: set by the cluster (hostfile) and planner")
        else:
            result.spec.setdefault("env", {})[name] = value
    pending: dict[str, str] = {}
    for name, values in _flags(args):
        if not name:
            result.ignored.append(f"stray argument {' '.join(values)}")
            continue
        flag = f"--{name} {shlex.join(values)}".rstrip()
        if kind == "megatron" and _megatron(name, values, result, pending):
            continue
        key = canonical_key(name)
        if name == "sft_type":
            key = "train_type"
        if key not in FIELDS or key in ("env",):
            result.ignored.append(flag)
            continue
        if key in LIST_FIELDS:
            result.spec[key] = values
        elif not values:
            result.spec[key] = True
        elif len(values) > 1:
            result.ignored.append(f"{flag} (one value expected)")
        elif key == "attn_impl":
            result.spec[key] = ATTN_NAMES.get(values[0], values[0])
        elif key == "deepspeed":
            result.spec[key] = DS_NAMES.get(values[0], values[0])
        else:
            result.spec[key] = values[0]
    _resolve_megatron(result, pending)
    return result


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _resolve_megatron(result: ImportResult, pending: dict[str, str]) -> None:
    """global_batch_size -> gradient_accumulation_steps; lr_warmup_iters -> warmup_ratio."""
    spec = result.spec
    if "global_batch_size" in pending:
        nproc = _int_or_none(spec.get("nproc_per_node", 1))
        sizes = [_int_or_none(spec.get(k, 1)) for k in ("nnodes", "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")]
        micro, total = _int_or_none(spec.get("per_device_train_batch_size", 1)), _int_or_none(pending["global_batch_size"])
        if None in (nproc, micro, total, *sizes):
            result.ignored.append(f"--global_batch_size {pending['global_batch_size']} (layout unknown)")
        else:
            nnodes, tp, pp, cp = sizes
            dp = max(1, nnodes * nproc // (tp * pp * cp))
            if total % (micro * dp):
                result.ignored.append(f"--global_batch_size {total}: not a multiple of micro-batch {micro} x DP {dp}")
            else:
                spec["gradient_accumulation_steps"] = total // (micro * dp)
                result.notes.append(f"--global_batch_size {total} -> gradient_accumulation_steps {total // (micro * dp)} (micro {micro} x DP {dp})")
    if "lr_warmup_iters" in pending:
        steps, warm = _int_or_none(spec.get("max_steps")), _int_or_none(pending["lr_warmup_iters"])
        if steps and warm is not None and steps > 0:
            spec["warmup_ratio"] = round(warm / steps, 6)
            result.notes.append(f"--lr_warmup_iters {warm} -> warmup_ratio {spec['warmup_ratio']}")
        else:
            result.ignored.append(f"--lr_warmup_iters {pending['lr_warmup_iters']} (needs --train_iters)")
