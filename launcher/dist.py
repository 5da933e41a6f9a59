"""Process-group setup for a torchrun worker and the small CPU control channel.

The control channel is a gloo group over CPU tensors: the per-step stop-flag agreement and the
per-window statistics travel on it, so on GPUs none of them forces a device synchronisation.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    control: object  # gloo ProcessGroup
    same_data_ranks: int = 1
    """Consecutive ranks that compute on the same batches (a TP, Ulysses SP or ring CP group)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """Which data shard this rank reads (TP, SP and CP groups are consecutive ranks)."""
        return self.rank // self.same_data_ranks

    @property
    def dp_size(self) -> int:
        return self.world_size // self.same_data_ranks

    def all_reduce(self, values: list[float], op: str = "sum") -> tuple[list[float], float]:
        """Reduce a few host floats over the control group; returns (values, seconds waited)."""
        tensor = torch.tensor(values, dtype=torch.float64)
        started = time.perf_counter()
        dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                    "min": dist.ReduceOp.MIN}[op], group=self.control)
        return tensor.tolist(), time.perf_counter() - started

    def all_gather_object(self, obj) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def set_collective_timeout(self, seconds: float) -> None:
        """Every process group of this rank (the world, the control group, the engines' meshes)
        times out a collective issued from now on after `seconds`. torch has no public call to
        change a group's timeout after it is made; `_set_pg_timeout` is the private one torchtitan
        uses for the same purpose (tests/test_collective_timeout.py pins it)."""
        timeout = timedelta(seconds=seconds)
        for group in list(dist.distributed_c10d._world.pg_map):
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def init(timeout_s: int, same_data_ranks: int = 1) -> Dist:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
                                device_id=device if backend == "nccl" else None)
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s), group_desc="control")
    return Dist(rank, world, local_rank, device, control, same_data_ranks)


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
