"""Export a checkpoint as a plain Hugging Face model directory:

    python -m launcher.export --run-dir DIR [--checkpoint STEP|PATH] [--out DIR]

LoRA adapters are merged into the base weights; sharded full checkpoints (DeepSpeed ZeRO-3,
FSDP2/DCP) are consolidated on the CPU without a process group. Writes safetensors, config and
tokenizer, generates a short sample and prints one JSON line {"out", "checkpoint", "sample"}.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from launcher import checkpoint
from launcher.engines.base import load_full_state_dict, read_safetensors


class ExportError(Exception):
    """A user-facing problem: no checkpoint, a missing base model, an unreadable shard."""


def full_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """The full model weights of a full fine-tuning checkpoint, whatever engine wrote it."""
    state = read_safetensors(ckpt / "model")
    if state:
        return state
    if (ckpt / "engine").is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="engine")
    if (ckpt / "dcp").is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(ckpt / "dcp", Path(tmp) / "full.pt")
            return torch.load(Path(tmp) / "full.pt", weights_only=False)["model"]
    raise ExportError(f"{ckpt}: no model weights found (model/*.safetensors, engine/ or dcp/)")


def merged_model(ckpt: Path, base: str):
    """The trained model, LoRA merged, on the CPU in float32."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ExportError(f"base model '{base}' cannot be loaded ({exc})") from None
    if (ckpt / "model" / "adapter_config.json").is_file():
        from peft import PeftModel

        return PeftModel.from_pretrained(model, ckpt / "model").merge_and_unload()
    state = {k: v.float() for k, v in full_state_dict(ckpt).items()}
    missing, unexpected = load_full_state_dict(model, state)
    if missing or unexpected:
        raise ExportError(f"{ckpt}: weights do not match {base} (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    return model


def sample_prompt(spec) -> str:
    """The first user turn of the training data, so the sample shows what was learned."""
    from launcher.data import DataError, parse_source, read_records, to_messages

    try:
        record = next(read_records(parse_source(spec.dataset[0]), 0, 1, spec.seed))
        messages, text = to_messages(record)
    except (DataError, StopIteration, IndexError):
        return "Hello"
    if messages is None:
        return text[:64]
    return next((m["content"] for m in messages if m["role"] == "user"), "Hello")


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 32) -> str:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True) if tokenizer.chat_template else prompt
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def export(run_dir: Path, ref: str | None = None, out: Path | None = None) -> dict:
    from transformers import AutoTokenizer

    from backend.spec import load_spec

    try:
        ckpt = checkpoint.resolve(run_dir, ref)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    if ckpt is None:
        raise ExportError(f"{run_dir}: no complete checkpoint to export")
    spec, problems = load_spec(ckpt / "job.yaml")
    if spec is None:
        raise ExportError(f"{ckpt / 'job.yaml'}: " + "; ".join(map(str, problems)))
    model = merged_model(ckpt, spec.model)
    tokenizer = AutoTokenizer.from_pretrained(ckpt / "tokenizer")
    base_dtype = getattr(model.config, "dtype", None) or torch.float32
    if isinstance(base_dtype, str):
        base_dtype = getattr(torch, base_dtype)
    out = Path(out) if out else Path(run_dir) / "export"
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(base_dtype).save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    checkpoint.fsync_tree(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    sample = generate(model.float().eval(), tokenizer, sample_prompt(spec))
    return {"out": str(out), "checkpoint": str(ckpt), "sample": sample}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launcher.export", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--checkpoint", default=None, help="step number or checkpoint directory (default: latest)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: <run-dir>/export)")
    args = parser.parse_args(argv)
    try:
        # Libraries print progress to stdout; the contract keeps stdout to the one result line.
        with contextlib.redirect_stdout(sys.stderr):
            result = export(args.run_dir, args.checkpoint, args.out)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
