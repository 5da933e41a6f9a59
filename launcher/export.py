"""Export a checkpoint as a plain Hugging Face model directory:

    python -m launcher.export --run-dir DIR [--checkpoint STEP|PATH] [--out DIR]

LoRA adapters are merged into the base weights; sharded full checkpoints (DeepSpeed ZeRO-3,
FSDP2/DCP) are consolidated on the CPU without a process group. Writes safetensors, config and
tokenizer, generates a short sample and prints one JSON line {"out", "checkpoint", "skipped", "sample"}.
The target is never anything but an empty directory or an earlier export: other contents are refused.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError

from backend.job.chat import EXPORT_DIR, EXPORT_MARKER
from backend.job.records import with_system
from launcher import checkpoint
from launcher.engines.base import load_full_state_dict, read_safetensors, saved_state



class ExportError(Exception):
    """A user-facing problem: no checkpoint, a missing base model, an unreadable shard, a taken target."""


def full_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """The full model weights of a full fine-tuning checkpoint, whatever engine wrote it."""
    state = read_safetensors(ckpt / "model")
    if state:
        return state
    if (ckpt / "engine").is_dir():
        from launcher.engines.zero import TAG, pickled_classes  # first: it imports deepspeed without mlflow

        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # zero_to_fp32 reads DeepSpeed's files with weights_only=False.
        with checkpoint.safe_torch_load(ckpt / TAG, pickled_classes()):
            return get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag=TAG)
    if (ckpt / "dcp").is_dir():
        from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner

        # dcp_to_torch_save's planner, limited to the weights (not the optimizer state), with our reader.
        state = {}
        checkpoint.dcp_read(state, ckpt / "dcp", planner=_EmptyStateDictLoadPlanner(keys={"model"}), no_dist=True)
        return state["model"]
    raise ExportError(f"{ckpt}: no model weights found (model/*.safetensors, engine/ or dcp/)")


def is_lora(ckpt: Path) -> bool:
    return (ckpt / "model" / "adapter_config.json").is_file()


def base_model(base: str, dtype: torch.dtype = torch.float32):
    """The job's `model` as it was before training, on the CPU."""
    from launcher.vision import auto_class

    try:
        return auto_class(base).from_pretrained(base, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise ExportError(f"base model '{base}' cannot be loaded ({exc})") from None


def trained_model(ckpt: Path, base: str, dtype: torch.dtype = torch.float32):
    """The trained model on the CPU: a LoRA checkpoint's adapters applied to the base (a peft model,
    not merged: `disable_adapter()` gives the base back), or a full checkpoint's weights."""
    model = base_model(base, dtype)
    if is_lora(ckpt):
        from peft import PeftModel

        try:
            return PeftModel.from_pretrained(model, ckpt / "model")
        except (OSError, ValueError, SafetensorError) as exc:  # an old marker checked nothing: a damaged file
            raise ExportError(f"{ckpt / 'model'}: the LoRA adapter cannot be read ({exc})") from None
    saved = read_safetensors(ckpt / "model")  # read once: a full model's weights are gigabytes
    state = {k: v.to(dtype) for k, v in (saved_state(model, ckpt / "model", saved) if saved
                                         else full_state_dict(ckpt)).items()}
    missing, unexpected = load_full_state_dict(model, state)
    if missing or unexpected:
        raise ExportError(f"{ckpt}: weights do not match {base} (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    return model


def merged_model(ckpt: Path, base: str):
    """The trained model, LoRA merged, on the CPU in float32."""
    model = trained_model(ckpt, base)
    return model.merge_and_unload() if is_lora(ckpt) else model


def sample_prompt(spec) -> str:
    """The first user turn of the training data, so the sample shows what was learned."""
    from launcher.data import DataError, Persona, parse_source, read_records, to_messages, to_pair

    try:
        persona = Persona.of(spec)
        record = persona.renamed(next(read_records(parse_source(spec.dataset[0]), 0, 1, spec.seed,
                                                   spec.max_record_bytes)))
        messages, text = (to_pair(record, persona)[0], None) if persona.pairs else to_messages(record, persona)
    except (DataError, StopIteration, IndexError):
        return "Hello"
    if messages is None:
        return text[:64]
    return next((m["content"] for m in messages if m["role"] == "user"), "Hello")


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 32, system: str | None = None) -> str:
    """The model's greedy answer to `prompt`, asked as in training (the job's system prompt first)."""
    messages = with_system([{"role": "user", "content": prompt}], system)
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=True) if tokenizer.chat_template else prompt
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def export(run_dir: Path, ref: str | None = None, out: Path | None = None) -> dict:
    from transformers import AutoTokenizer

    from backend.job.spec import load_spec

    run_dir = Path(run_dir)
    out = Path(out) if out else run_dir / EXPORT_DIR
    refuse_target(run_dir, out)
    try:
        found = checkpoint.resolve(run_dir, ref)
    except checkpoint.CheckpointError as exc:
        raise ExportError(str(exc)) from None
    ckpt = found.path
    if ckpt is None:
        raise ExportError(f"{run_dir}: no complete checkpoint to export")
    for reason in found.skipped:
        print(f"warning: skipped a damaged checkpoint: {reason}", file=sys.stderr)
    if not found.verified:
        print(f"warning: {ckpt / checkpoint.MARKER} has no checksums (an older format); exporting it unverified",
              file=sys.stderr)
    spec, problems = load_spec(ckpt / "job.yaml")
    if spec is None:
        raise ExportError(f"{ckpt / 'job.yaml'}: " + "; ".join(map(str, problems)))
    try:
        model = merged_model(ckpt, spec.model)
    except checkpoint.CheckpointError as exc:
        raise ExportError(str(exc)) from None
    tokenizer = AutoTokenizer.from_pretrained(ckpt / "tokenizer")
    base_dtype = getattr(model.config, "dtype", None) or torch.float32
    if isinstance(base_dtype, str):
        base_dtype = getattr(torch, base_dtype)
    try:
        write_export(out, lambda new: _save(model.to(base_dtype), tokenizer, new, ckpt, spec))
    except (OSError, SafetensorError) as exc:  # a full disk, a quota
        raise ExportError(f"{out}: writing the export failed ({exc})") from None
    prompt = sample_prompt(spec)
    sample = generate(model.float().eval(), tokenizer, prompt, system=spec.system)
    return {"out": str(out), "checkpoint": str(ckpt), "skipped": list(found.skipped), "prompt": prompt,
            "sample": sample, "lora_merged": is_lora(ckpt)}


def _save(model, tokenizer, new: Path, ckpt: Path, spec) -> None:
    from launcher.vision import save_image_processor

    model.save_pretrained(new, safe_serialization=True)
    tokenizer.save_pretrained(new)
    save_image_processor(spec.model, new, spec)
    (new / EXPORT_MARKER).write_text(json.dumps({"checkpoint": str(ckpt), "files": _files(new)}) + "\n")


def _files(root: Path) -> dict[str, int]:
    """Every file under `root` (relative path → size), links as links; the marker not among them."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if rel != EXPORT_MARKER:
                found[rel] = -1 if path.is_symlink() else path.stat().st_size
    return found


MARKER_MAX_BYTES = 1 << 20


def _not_written_by_export(out: Path) -> list[str] | None:
    """What in an earlier export its marker does not list, or lists at another size: files a user
    added or changed there. None when the marker cannot be read (or is of a version that listed
    nothing: then what was written is unknown)."""
    try:
        with open(out / EXPORT_MARKER, "rb") as f:
            written = json.loads(f.read(MARKER_MAX_BYTES + 1)[:MARKER_MAX_BYTES]).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(written, dict):
        return None
    return sorted(rel for rel, size in _files(out).items() if written.get(rel) != size)


def refuse_target(run_dir: Path, out: Path) -> None:
    """An ExportError for a target that an export must not take the place of: the run directory or
    one holding it, a path inside a checkpoint, or something already there that is not an empty
    directory or an earlier export (a directory holding EXPORT_MARKER)."""
    run, target = Path(run_dir).resolve(), Path(out).resolve()
    if target == run or target in run.parents:
        raise ExportError(f"{out}: is the run directory {run_dir} or holds it; export into a new directory "
                          f"(the default is {Path(run_dir) / 'export'})")
    if target.is_relative_to(run) and target.relative_to(run).parts[0].startswith("checkpoint-"):
        raise ExportError(f"{out}: is inside the checkpoint {run / target.relative_to(run).parts[0]}; "
                          "export into a directory outside the checkpoints")
    refuse_occupied(Path(out))


def refuse_occupied(out: Path) -> None:
    """An ExportError unless what is at `out` may be replaced: nothing, an empty directory, or an
    earlier export holding only what that export wrote."""
    if out.is_symlink():
        why = "is a symbolic link"
    elif out.is_dir() and (out / EXPORT_MARKER).is_file():
        extra = _not_written_by_export(out)
        if extra is None:
            why = (f"is an earlier export whose {EXPORT_MARKER} does not list the files it wrote (unreadable, or "
                   "from an older version): what else is in it cannot be told apart")
        elif extra:
            shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
            why = f"is an earlier export holding files it did not write or that changed since ({shown})"
        else:
            return
    elif not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    elif not out.is_dir():
        why = "exists and is not a directory"
    else:
        why = f"exists and is not an earlier export (it has files and no {EXPORT_MARKER})"
    raise ExportError(f"{out}: {why}; choose another --out, or move it away yourself")


def write_export(out: Path, save) -> None:
    """`save(new)` into a fresh directory beside `out`, then rename it to `out`. An earlier export at
    `out` is renamed aside first and removed only once the new one is in place; on failure only what
    this call created is removed. The temporary name is unique, so exports at once never share it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        new, replaced = staging / out.name, staging / "replaced"
        save(new)
        checkpoint.fsync_tree(new)
        refuse_occupied(out)  # again: something may have appeared there while the model was written
        earlier = out.is_dir() and any(out.iterdir())
        if earlier:
            os.rename(out, replaced)
        try:
            os.rename(new, out)  # also takes the place of an empty directory
        except OSError:
            if earlier:
                os.rename(replaced, out)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
    from launcher.leave import leave

    leave(main())
