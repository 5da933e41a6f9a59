"""What gradient checkpointing keeps with and without torch_compile: no torchrun, the worker's own
model preparation (launcher.model.prepare) under the DDP engine's autocast, a Llama-3.1-8B-wide
model with a few layers, LoRA r16 on every linear layer with Liger (the long-context rows of
bench/results/h200-long-context-8b.jsonl). A run is three forward+backward passes of one sequence
(the first compiles), each in a process of its own; each pass's peak above what was allocated
before it (the worker's reported peak is the highest since start, the compiling first step's
included), set against backend.job.memory's activation estimate for the same job. Layer counts and
lengths separate what every layer keeps from what one recomputed layer's backward adds.

    python bench/compile_memory.py --out compile-memory.jsonl          # GPU: 2 and 4 layers, 8K and 16K
    python bench/compile_memory.py --layers 32 --seqs 16384 --variants compiled,compiled-no-pointwise-autotune
    python bench/compile_memory.py --layers 8,16,32 --seqs 16384 --snapshot   # what is live at the peak
    python bench/compile_memory.py --smoke                             # CPU, a tiny shape
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from throughput import SHAPES, build_model_dir, job_spec  # noqa: E402

GIB = 1024 ** 3


VARIANTS = ("eager", "compiled", "compiled-no-pointwise-autotune")


def live_at_peak(trace: list[dict], top: int = 12) -> dict:
    """The blocks allocated at the highest point of one device's allocator trace (torch.cuda.memory's
    recorded history), summed by size and by the innermost Python frame that allocated them (none:
    autograd's engine thread, i.e. an eager backward op)."""
    live, total, peak, peak_at = {}, 0, -1, 0
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] == "free_completed" and live.pop(event["addr"], None) is not None:
            total -= event["size"]
        if total > peak:
            peak, peak_at = total, i
    live = {}
    for event in trace[:peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)

    def summed(key) -> dict:
        sums: dict[str, int] = {}
        for event in live.values():
            sums[key(event)] = sums.get(key(event), 0) + event["size"]
        ranked = sorted(sums.items(), key=lambda kv: -kv[1])[:top]
        return {k: round(v / GIB, 3) for k, v in ranked}

    def frame(event) -> str:
        frames = event.get("frames") or []
        if not frames:
            return "(no python frame)"
        f = frames[0]
        return f"{Path(f['filename']).name}:{f['line']}:{f['name']}"

    return dict(traced_peak_gib=round(peak / GIB, 3), blocks=len(live),
                by_size_mib=summed(lambda e: str(round(e["size"] / 2 ** 20))), by_frame=summed(frame))


def measure(model_dir: Path, shape: str, layers: int, seq: int, variant: str, snapshot: bool = False) -> dict:
    import torch

    compiled = variant != "eager"
    if variant == "compiled-no-pointwise-autotune":
        # inductor benchmarks a forward kernel's configs on clones of the buffers it writes in place
        # (unbudgeted outside backward graphs): is that what a first step's peak holds?
        import torch._inductor.config

        torch._inductor.config.triton.autotune_pointwise = False

    from backend.job.layout import compute_layout
    from backend.job.memory import estimate_memory
    from backend.job.modelcfg import parse_model_config
    from backend.job.spec import parse_spec
    from launcher.engines.base import autocast
    from launcher.model import prepare

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    fields = job_spec(model_dir, model_dir / "unused.jsonl", seq, 1, 3, lora=True, liger=cuda,
                      gradient_checkpointing=True, torch_compile=compiled, target_modules=["all-linear"])
    spec, problems = parse_spec(fields)
    assert spec is not None, problems
    config = {**SHAPES[shape], "num_hidden_layers": layers}
    estimate = estimate_memory(spec, parse_model_config(config, shape), compute_layout(spec))
    _, model = prepare(spec)
    model.to(device)
    ids = torch.randint(0, config["vocab_size"], (1, seq), device=device)
    row = dict(shape=shape, layers=layers, seq=seq, variant=variant,
               estimated_activations_gib=round(estimate.activations_gib, 3))
    peaks = []
    for step in range(3):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            if snapshot and step == 2:
                torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        with autocast(device, spec.torch_dtype):
            loss = model(input_ids=ids, labels=ids).loss
        if cuda:
            torch.cuda.synchronize()
            after_forward, forward_peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
            peaks.append(round((torch.cuda.max_memory_allocated() - before) / GIB, 3))
    if cuda and snapshot:
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        torch.cuda.memory._record_memory_history(enabled=None)
        row["live_at_last_peak"] = live_at_peak(trace)
    if cuda:
        row.update(before_gib=round(before / GIB, 3), kept_after_forward_gib=round((after_forward - before) / GIB, 3),
                   forward_peak_gib=round((forward_peak - before) / GIB, 3), peak_above_gib_by_step=peaks,
                   peak_above_bytes_per_token=round(peaks[-1] * GIB / seq))
    row["loss"] = round(loss.item(), 4)
    return row


def one_run(model_dir: Path, shape: str, layers: int, seq: int, variant: str, snapshot: bool) -> str:
    """One measurement in a process of its own (compiled graphs and the allocator's cache of one
    run must not count in the next); a failed run is a row with its error."""
    run = json.dumps(dict(model_dir=str(model_dir), shape=shape, layers=layers, seq=seq, variant=variant,
                          snapshot=snapshot))
    proc = subprocess.run([sys.executable, __file__, "--run", run], capture_output=True, text=True)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and rows:
        return rows[-1]
    return json.dumps(dict(shape=shape, layers=layers, seq=seq, variant=variant, error=proc.stderr[-2000:]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: the pipeline end to end")
    parser.add_argument("--layers", default="2,4")
    parser.add_argument("--seqs", default="8192,16384")
    parser.add_argument("--variants", default="eager,compiled", help=", ".join(VARIANTS) + "; each with checkpointing")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--snapshot", action="store_true",
                        help="the last pass's allocator history: what is live at its peak, by size and frame")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        run = json.loads(args.run)
        print(json.dumps(measure(Path(run.pop("model_dir")), **run)))
        return 0
    shape = "smoke" if args.smoke else "llama3.1-8b"
    seqs = [64] if args.smoke else [int(s) for s in args.seqs.split(",")]
    layers = [2] if args.smoke else [int(n) for n in args.layers.split(",")]
    variants = ["eager"] if args.smoke else args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)} (of {', '.join(VARIANTS)})")
    # a new file, written as each row comes (an earlier run's rows are not mixed in)
    with open(args.out or os.devnull, "w") as out, tempfile.TemporaryDirectory() as work:
        for n in layers:
            model_dir = build_model_dir(shape, Path(work) / f"model-{n}", "bfloat16", num_hidden_layers=n)
            for seq in seqs:
                for variant in variants:
                    line = one_run(model_dir, shape, n, seq, variant, args.snapshot)
                    print(line, flush=True)
                    out.write(line + "\n")
                    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
