"""All-reduce bandwidth test, run by pre-flight under torchrun on every node:

    python -m torch.distributed.run ... -m backend.cluster.bwtest --size-mib 16 --iters 5

Rank 0 prints one JSON line: `{"world_size", "size_mib", "time_s", "algbw_gib_s", "busbw_gib_s",
"backend"}`. Bus bandwidth follows nccl-tests: algbw × 2(n−1)/n for an all-reduce. torch is
imported inside `main` only: backend/ modules never import it at module level.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def bus_bandwidth(size_bytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algorithm bandwidth, bus bandwidth) in GiB/s for one all-reduce of `size_bytes`."""
    alg = size_bytes / seconds / 2**30
    return alg, alg * 2 * (world - 1) / world


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.cluster.bwtest")
    ap.add_argument("--size-mib", type=float, default=16.0)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)

    import os

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    device = torch.device("cuda") if cuda else torch.device("cpu")
    numel = int(args.size_mib * 2**20 / 4)
    x = torch.ones(numel, dtype=torch.float32, device=device)
    dist.all_reduce(x)  # warm-up: connections and buffers
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(x)
    if cuda:
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / args.iters
    world = dist.get_world_size()
    worst = torch.tensor([elapsed], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    elapsed = float(worst.item())
    if dist.get_rank() == 0:
        alg, bus = bus_bandwidth(numel * 4, elapsed, world)
        print(json.dumps({"world_size": world, "size_mib": args.size_mib, "time_s": elapsed,
                          "algbw_gib_s": alg, "busbw_gib_s": bus, "backend": backend}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
