"""Throughput of the swift-studio worker for the model shapes of the shared HF baseline
(../shared/bench/hf_baseline.py): models built from config with random weights, random tokens.

    python bench/throughput.py [--shapes qwen2.5-1.5b,llama3.2-1b] [--nproc 1] [--baseline PATH]
    python bench/throughput.py --smoke          # tiny model on CPU, checks the pipeline end to end

Each configuration runs the real worker (`torchrun -m launcher.train`) on a fresh run directory
and prints one JSON line: step time, tokens/s, MFU (full fine-tuning only, as the baseline) and
peak memory, read back from the worker's own event lines. With `--baseline`, the stock HF
Trainer baseline script runs in the same call and its lines are printed next to ours.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BASELINE = ROOT.parent / "shared" / "bench" / "hf_baseline.py"
# The shapes of hf_baseline.py (kept identical so the figures compare).
SHAPES = {
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768),
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                        max_position_embeddings=8192),
    "smoke": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=256),
}
# (shape, seq, micro-batch, lora, liger) as in the baseline's plan.
PLAN = [("qwen2.5-1.5b", 2048, 8, False, False), ("qwen2.5-1.5b", 2048, 8, False, True),
        ("qwen2.5-1.5b", 2048, 8, True, False), ("qwen2.5-1.5b", 2048, 8, True, True),
        ("llama3.2-1b", 4096, 4, False, False), ("llama3.2-1b", 4096, 4, False, True)]
SMOKE_PLAN = [("smoke", 64, 2, False, False), ("smoke", 64, 2, True, False)]


def build_model_dir(shape: str, out: Path, dtype: str) -> Path:
    """Random weights from the config plus a tokenizer (the demo's; the data is pre-tokenized)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.for_model(**SHAPES[shape])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(ROOT / "assets" / "demo" / "model").save_pretrained(out)
    return out


def write_tokens(path: Path, n: int, seq: int, vocab: int) -> None:
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"input_ids": [rng.randrange(vocab) for _ in range(seq)]}) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(work: Path, model_dir: Path, shape: str, seq: int, bsz: int, lora: bool, liger: bool, nproc: int,
               steps: int, warm: int, engine: dict, dtype: str) -> dict:
    run_dir = work / f"{shape}-{seq}x{bsz}-{'lora' if lora else 'full'}{'-liger' if liger else ''}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    data = run_dir / "tokens.jsonl"
    write_tokens(data, bsz * nproc * (steps + 1), seq, SHAPES[shape]["vocab_size"])
    spec = dict(model=str(model_dir), dataset=[str(data)], train_type="lora" if lora else "full", max_length=seq,
                per_device_train_batch_size=bsz, max_steps=steps, logging_steps=1, save_steps=10**9,
                learning_rate=1e-5, torch_dtype=dtype, gradient_checkpointing=False, use_liger_kernel=liger,
                lora_rank=16, lora_alpha=32, lora_dropout=0.0, **engine)
    (run_dir / "job.yaml").write_text(yaml.safe_dump(spec))
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
            "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--max_restarts", "0", "-m", "launcher.train",
            "--run-dir", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    result = dict(source="swift-studio", model=shape, seq=seq, bsz=bsz, lora=lora, liger=liger, nproc=nproc, **engine)
    events = [json.loads(line) for line in (run_dir / "events" / "rank-0.jsonl").read_text().splitlines()] \
        if (run_dir / "events" / "rank-0.jsonl").exists() else []
    train = [e for e in events if e["type"] == "train" and e["step"] > warm]
    if proc.returncode != 0 or not train:
        ended = [e for e in events if e["type"] == "end"]
        reason = ended[-1]["error"] if ended and ended[-1].get("error") else _first_error(proc.stdout + proc.stderr)
        return {**result, "error": reason}
    step_s = sum(e["step_time_s"] for e in train) / len(train)
    mfus = [e["mfu"] for e in train if e["mfu"] is not None]
    # The last checkpoint save (end of run) is outside the timed steps: step_time_s excludes it.
    return {**result, "step_s": round(step_s, 4), "tokens_per_s": round(bsz * seq * nproc / step_s),
            "mfu": round(sum(mfus) / len(mfus), 4) if mfus else None,
            "peak_mem_gib": round(max(e["mem_peak_gib"] for e in train), 2)}


def _first_error(output: str) -> str:
    """The worker's own error line (torchrun's summary at the end says only that a rank failed)."""
    lines = output.splitlines()
    hits = [i for i, line in enumerate(lines) if "error" in line.lower() or "Traceback" in line]
    return "\n".join(lines[hits[0]:hits[0] + 30])[-2000:] if hits else output[-2000:]


def run_baseline(script: Path) -> None:
    """The stock HF Trainer figures, in the same call (GPU only: the baseline needs CUDA)."""
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            print(json.dumps({"source": "hf_trainer", **json.loads(line)}), flush=True)
    if proc.returncode != 0:
        print(json.dumps({"source": "hf_trainer", "error": proc.stderr[-600:]}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, a few steps")
    parser.add_argument("--shapes", default=None, help="comma-separated subset of " + ", ".join(SHAPES))
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warm", type=int, default=4)
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--fsdp", default=None)
    parser.add_argument("--baseline", type=Path, nargs="?", const=DEFAULT_BASELINE, default=None,
                        help=f"also run the HF Trainer baseline (default script {DEFAULT_BASELINE})")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)

    plan = SMOKE_PLAN if args.smoke else PLAN
    if args.shapes:
        plan = [p for p in plan if p[0] in args.shapes.split(",")]
    steps, warm = (4, 1) if args.smoke else (args.steps, args.warm)
    dtype = "float32" if args.smoke else "bfloat16"
    engine = {k: v for k, v in (("deepspeed", args.deepspeed), ("fsdp", args.fsdp)) if v}
    work = args.workdir or Path(tempfile.mkdtemp(prefix="swift-bench-"))
    try:
        import torch

        print(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                          "torch": torch.__version__}), flush=True)
        models: dict[str, Path] = {}
        for shape, seq, bsz, lora, liger in plan:
            if shape not in models:
                models[shape] = build_model_dir(shape, work / f"model-{shape}", dtype)
            print(json.dumps(run_worker(work, models[shape], shape, seq, bsz, lora, liger, args.nproc, steps, warm,
                                        engine, dtype)), flush=True)
        if args.baseline and not args.smoke:
            run_baseline(args.baseline)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
