"""Per-rank peak memory of the parallel layouts (ring CP, Ulysses SP, TP) against
backend.job.memory's estimate for the same job. Ranks beyond the machine's GPUs share GPU 0, each
told it is its own host (NCCL_HOSTID), so a 2-rank layout's per-rank share is measured on one GPU:
each process's peak is its own allocator's, which sharing does not change (speed it does: none is
reported). One JSON line per layout.

    python bench/layout_memory.py --shape llama3.2-1b --seq 16384 --steps 4
"""
from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import ROOT, build_model_dir, estimated_gib, run_error, torchrun_argv, write_run  # noqa: E402

# name: (ranks, spec fields); each parallel one beside the one-rank job of the engine it runs on (tp2: fsdp).
LAYOUTS = {
    "fsdp": (1, dict(fsdp="full_shard")),
    "fsdp-cp2": (2, dict(fsdp="full_shard", context_parallel_size=2)),
    "zero2": (1, dict(deepspeed="zero2")),
    "zero2-sp2": (2, dict(deepspeed="zero2", sequence_parallel_size=2)),
    "tp2": (2, dict(tensor_model_parallel_size=2)),
}


def gpu0_wrapper(work: Path) -> Path:
    """A script torchrun starts instead of the worker: the rank on GPU 0, as its own NCCL host."""
    wrapper = work / "rank-on-gpu0.sh"
    wrapper.write_text(f"#!/bin/sh\nexport NCCL_HOSTID=rank$RANK CUDA_VISIBLE_DEVICES=0 LOCAL_RANK=0\n"
                       f"exec {sys.executable} -m launcher.train \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return wrapper


def shared_gpu_argv(nproc: int, run_dir: Path, wrapper: Path) -> tuple[list[str], dict]:
    import torch

    argv = torchrun_argv(nproc, "-m", "launcher.train", "--run-dir", str(run_dir))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if torch.cuda.device_count() >= nproc:
        return argv, env
    module = argv.index("-m", argv.index("--max_restarts"))
    # Ranks sharing a GPU each keep their allocator's cached blocks: with fixed segments rank 0 of a
    # 2-rank full ZeRO-3 DPO held 42.95 GiB for a 31.3 GiB peak and the pair did not fit an H100
    # (bench/results/h100-dpo-3.jsonl); expandable segments return them.
    return (argv[:module] + ["--no-python", str(wrapper)] + argv[module + 2:],
            {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", **env, "NCCL_SOCKET_IFNAME": "lo",
             "NCCL_IB_DISABLE": "1"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3.2-1b")
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="layout-memory-"))
    wrapper = gpu0_wrapper(work)
    model = build_model_dir(args.shape, work / "model", "bfloat16")
    for name in args.layouts.split(","):
        nproc, fields = LAYOUTS[name]
        run_dir = write_run(work / name, model, args.shape, args.seq, 1, args.steps, args.steps + 1, liger=False,
                            gradient_checkpointing=True, **fields)
        argv, env = shared_gpu_argv(nproc, run_dir, wrapper)
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
        events = [json.loads(line) for line in (run_dir / "events" / "rank-0.jsonl").read_text().splitlines()] \
            if (run_dir / "events" / "rank-0.jsonl").exists() else []
        train = [e for e in events if e["type"] == "train"]
        row = dict(layout=name, ranks=nproc, shape=args.shape, seq=args.seq, **fields)
        if proc.returncode or not train:
            row["error"] = run_error(run_dir, proc.stdout + proc.stderr)
        else:
            measured = max(e["mem_peak_gib"] for e in train)
            estimate = estimated_gib(run_dir, args.shape, nproc)
            row.update(peak_gib_rank0=round(measured, 2), estimate_gib=estimate,
                       estimate_vs_measured=round(estimate / measured - 1, 3))
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
