"""DistributedDataParallel: full replicas, gradients all-reduced in backward (in the compute dtype
unless the job asks for fp32)."""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from launcher import checkpoint
from launcher.engines.base import (TorchOptimizerEngine, autocast, checkpoint_part, evaluating, load_weights,
                                   make_optimizer, make_scheduler, reduce_dtype, save_pretrained)


def compress_hook(dtype: torch.dtype, backend: str):
    """torch's DDP hook that all-reduces the fp32 gradients in `dtype`, or None for fp32. Its bf16
    hook needs NCCL, so over gloo (CPU) bf16 jobs reduce in fp32."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if dtype == torch.float16:
        return default_hooks.fp16_compress_hook
    if dtype == torch.bfloat16 and backend == "nccl":
        return default_hooks.bf16_compress_hook
    return None


class DDPEngine(TorchOptimizerEngine):
    name = "ddp"
    reshards = True  # every rank holds the full model and optimizer state

    def __init__(self, model, spec, device: torch.device, total_steps: int):
        self.model, self.spec, self.device = model.to(device), spec, device
        # One rank has nothing to all-reduce: DDP would only add its buckets (and a second set while
        # it rebuilds them after the first step, which sets the peak memory). With several ranks,
        # gradients live in the buckets (no second copy).
        self.ddp = self.model if torch.distributed.get_world_size() == 1 else DistributedDataParallel(
            self.model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
        hook = compress_hook(reduce_dtype(spec), torch.distributed.get_backend())
        if hook and self.ddp is not self.model:
            self.ddp.register_comm_hook(None, hook)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.model, spec, device)
        self.scheduler = make_scheduler(self.optimizer, spec, total_steps)
        self.scaler = torch.amp.GradScaler(device.type) if spec.torch_dtype == "float16" else None
        self.accumulation = spec.gradient_accumulation_steps

    def forward_backward(self, batch: dict, sync: bool) -> torch.Tensor:
        with (nullcontext() if sync or self.ddp is self.model else self.ddp.no_sync()):
            with autocast(self.device, self.spec.torch_dtype):
                loss = self.ddp(**batch).loss
            scaled = loss / self.accumulation
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        return loss.detach()

    def forward_context(self):
        return autocast(self.device, self.spec.torch_dtype)

    def evaluate(self, batch: dict) -> torch.Tensor:
        with evaluating(self.model), autocast(self.device, self.spec.torch_dtype):
            return self.model(**batch).loss.detach()

    def save(self, path: Path, is_main: bool) -> None:
        if is_main:
            save_pretrained(self.model, path / "model")
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                        "scaler": self.scaler.state_dict() if self.scaler else None}, path / "optimizer.pt")

    def load(self, path: Path) -> None:
        optimizer = checkpoint_part(path, "optimizer.pt", self.name)
        load_weights(self.model, path / "model")
        state = checkpoint.read(optimizer, map_location=self.device)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
