"""Whether a local model directory holds whole weights and a tokenizer, before anything loads it.

A 0-byte or truncated `model.safetensors` passed validation and failed at launch with a
SafetensorError naming no file; a directory without a tokenizer trained on "0 sequences". A
safetensors header lists every tensor's byte range, so reading it (not the weights) tells a
truncated file. The standard library only, self-contained: pre-flight sends this module's source to
every node (backend/cluster/preflight.py), and the worker checks before it loads.
"""
from __future__ import annotations

import json
import os
import struct

MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on the header
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                   "vocab.txt")


def safetensors_problem(path: str) -> str | None:
    """None when the file's header parses and every tensor it lists lies within the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path}: {size} bytes, not a safetensors file (truncated or empty)"
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, MAX_HEADER_BYTES):
                return (f"{path}: not a safetensors file, or truncated: its header claims {length:,} bytes "
                        f"and the file has {size:,}")
            header = json.loads(f.read(length))
    except OSError as exc:
        return f"{path}: cannot read ({exc.strerror})"
    except (UnicodeDecodeError, ValueError):
        return f"{path}: not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return f"{path}: not a safetensors file (its header is not a table of tensors)"
    data = size - 8 - length
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            return f"{path}: corrupt safetensors header (tensor {name[:100]!r} has no valid byte range)"
        end = max(end, offsets[1])
    if end > data:
        return f"{path}: truncated: its tensors need {8 + length + end:,} bytes and the file has {size:,}"
    return None


def weight_files(model_dir: str) -> tuple[list[str], str | None]:
    """(the safetensors files the model loads from, or a problem): a single file or the shards
    its index names."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return [], f"{index}: not a safetensors index (no weight_map of tensor names to files)"
        outside = [s for s in shards if not isinstance(s, str) or os.path.basename(s) != s]
        if outside:
            return [], f"{index}: names a shard outside the model directory ({str(outside[0])[:200]!r})"
        return [os.path.join(model_dir, s) for s in shards], None
    if os.path.exists(single):
        return [single], None
    if any(os.path.exists(os.path.join(model_dir, n)) for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        return [], None  # a pickle checkpoint: transformers reads it with weights_only, nothing to check here
    return [], (f"{model_dir}: no weights (model.safetensors, model.safetensors.index.json or "
                "pytorch_model.bin)")


def model_dirs(spec) -> dict[str, str]:
    """The model and adapter paths a job (a JobSpec) loads, by field: `model`, full DPO's `ref_model`
    (whose tokenizer is not read), LoRA's `adapters[0]` and LoRA DPO's `ref_adapters[0]`
    (`dir_problems` checks each as what it is). Hub ids among them are no directories; callers keep
    the ones they can look at."""
    fields = {"model": spec.model}
    if spec.rlhf_type == "dpo" and spec.train_type == "full" and spec.ref_model:
        fields["ref_model"] = spec.ref_model
    if spec.train_type == "lora":
        fields.update({f"adapters[{i}]": path for i, path in enumerate(spec.adapters)})
        if spec.rlhf_type == "dpo":
            fields.update({f"ref_adapters[{i}]": path for i, path in enumerate(spec.ref_adapters)})
    return {field: os.path.expanduser(value) for field, value in fields.items()}


def is_adapter(field: str) -> bool:
    return field.split("[")[0] in ("adapters", "ref_adapters")


def dir_problems(field: str, path: str) -> list[str]:
    """Every problem of `field`'s local directory (`model_dirs`) that would fail its load."""
    return adapter_dir_problems(path) if is_adapter(field) else model_dir_problems(path, tokenizer=field == "model")


def with_adapter_settings(spec):
    """`spec` (a JobSpec) with the LoRA rank and targets of the saved adapter `adapters` names, where
    its adapter_config.json is readable here: they, not lora_rank and target_modules, are what trains."""
    if spec.train_type != "lora" or not spec.adapters:
        return spec
    try:
        with open(os.path.join(os.path.expanduser(spec.adapters[0]), "adapter_config.json"), encoding="utf-8") as f:
            config = json.load(f)
        rank, targets = int(config["r"]), config["target_modules"]
        targets = [targets] if isinstance(targets, str) else [str(t) for t in targets]
    except (OSError, ValueError, KeyError, TypeError):
        return spec  # adapter_dir_problems names what is wrong with it
    return spec.model_copy(update={"lora_rank": rank, "target_modules": targets,
                                   "lora_alpha": config.get("lora_alpha", spec.lora_alpha)})


def adapter_dir_problems(adapter_dir: str) -> list[str]:
    """A LoRA adapter directory (peft's layout): its adapter_config.json and whole weights."""
    config = os.path.join(adapter_dir, "adapter_config.json")
    problems = []
    try:
        with open(config, encoding="utf-8") as f:
            kind = json.load(f).get("peft_type")
        if kind != "LORA":
            problems.append(f"{config}: peft_type {kind!r}, not a LoRA adapter")
    except FileNotFoundError:
        problems.append(f"{adapter_dir}: no adapter_config.json (not a LoRA adapter; a run's checkpoint-N/model or "
                        "a LoRA export holds one)")
    except OSError as exc:
        problems.append(f"{config}: cannot read ({exc.strerror})")
    except (ValueError, AttributeError):
        problems.append(f"{config}: not a JSON table of peft settings")
    weights = os.path.join(adapter_dir, "adapter_model.safetensors")
    if os.path.exists(weights):
        problems.append(safetensors_problem(weights))
    elif not os.path.exists(os.path.join(adapter_dir, "adapter_model.bin")):
        problems.append(f"{adapter_dir}: no adapter weights (adapter_model.safetensors)")
    return [p for p in problems if p]


def model_dir_problems(model_dir: str, tokenizer: bool = True) -> list[str]:
    """Every problem of a local model directory that would fail the load, each naming its file.
    `tokenizer`: whether one is loaded from it (not for preference training's `ref_model`)."""
    files, problem = weight_files(model_dir)
    problems = [problem] if problem else []
    for path in files:
        if not os.path.isfile(path):
            problems.append(f"{path}: missing (the weights' index names it)")
        else:
            problems.append(safetensors_problem(path))
    if not tokenizer:
        return [p for p in problems if p]
    names = os.listdir(model_dir)
    tokenizer = [n for n in names if n in TOKENIZER_FILES or n.endswith(".tiktoken")]
    if not tokenizer:
        problems.append(f"{model_dir}: no tokenizer (none of {', '.join(TOKENIZER_FILES)} or a *.tiktoken file)")
    problems += [f"{os.path.join(model_dir, n)}: empty" for n in tokenizer
                 if os.path.isfile(os.path.join(model_dir, n)) and os.path.getsize(os.path.join(model_dir, n)) == 0]
    return [p for p in problems if p]
