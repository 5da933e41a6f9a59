"""Where one training step of our worker spends its GPU time: runs the worker's own Trainer in
this process (one rank) on a benchmark shape and prints torch.profiler's kernel table for a few
steps after warm-up. Under `torchrun --nproc_per_node N` every rank trains and rank 0 prints.

    python bench/profile_step.py --shape llama3.2-1b --seq 4096 --bsz 4 --set torch_compile=true \\
        [--set fsdp=full_shard] [--rows 30] [--trace trace.json]
    python bench/profile_step.py --shape qwen2.5-1.5b --seq 1024 --bsz 8 --pairs --set deepspeed=zero3
                                                # a DPO step on bench/dpo.py's pairs and job
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.throughput import SHAPES, build_model_dir, free_port, write_run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3.2-1b", choices=SHAPES)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--bsz", type=int, default=4)
    parser.add_argument("--warm", type=int, default=4)
    parser.add_argument("--active", type=int, default=3)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="job field, value parsed as YAML (repeatable)")
    parser.add_argument("--pairs", action="store_true", help="a DPO job on bench/dpo.py's pairs (full fine-tuning "
                        "unless --set train_type=lora)")
    parser.add_argument("--trace", type=Path, default=None, help="also write a Chrome trace here")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="swift-profile-"))
    try:
        return profile_in(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def profile_in(work: Path, args) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from launcher import dist
    from launcher.config import load_job
    from launcher.trainer import Trainer

    if torch.cuda.is_available():  # before the model build, or under torchrun every rank opens a context on cuda:0
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # Each rank builds the same model and data (fixed seeds) in its own temp dir.
    model_dir = build_model_dir(args.shape, work / "model", "bfloat16")
    steps = args.warm + args.active
    samples = args.bsz * int(os.environ.get("WORLD_SIZE", 1)) * (steps + 1)  # the sampler splits them over the ranks
    fields = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    if args.pairs:
        from bench.dpo import our_job, write_pairs

        run_dir = work / "run"
        run_dir.mkdir()
        write_pairs(run_dir / "pairs.jsonl", samples, args.seq)
        spec = our_job(model_dir, run_dir / "pairs.jsonl", args.seq, args.bsz, steps, False, "bfloat16", **fields)
        (run_dir / "job.yaml").write_text(yaml.safe_dump(spec))
    else:
        run_dir = write_run(work / "run", model_dir, args.shape, args.seq, args.bsz, steps, samples, **fields)
    os.environ.setdefault("MASTER_PORT", str(free_port()))

    trainer = Trainer(run_dir, load_job(run_dir), dist.init(600), None)
    trainer.setup()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=0, warmup=args.warm, active=args.active, repeat=1)) as prof:
        engine_step = trainer.engine.step

        step_ends: list[float] = []

        def step_and_mark():
            norm = engine_step()
            prof.step()
            step_ends.append(time.perf_counter())
            return norm

        trainer.engine.step = step_and_mark
        step_ends.append(time.perf_counter())  # the first profiled step's start when there is no warm-up
        trainer.train()
    sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    if trainer.dist.rank == 0:  # under torchrun, rank 0 speaks for all
        print(json.dumps({"shape": args.shape, "seq": args.seq, "bsz": args.bsz, "set": args.set,
                          "world_size": trainer.dist.world_size, "pairs": args.pairs,
                          # profiled steps, so slower than unprofiled; against the table's device total
                          "active_step_s": round((step_ends[-1] - step_ends[-1 - args.active]) / args.active, 4)}))
        print(prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=90), flush=True)
    if args.trace and trainer.dist.rank == 0:
        prof.export_chrome_trace(str(args.trace))
    trainer.end("succeeded", None)
    dist.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
