"""Tensor parallel: transformers' own TP (the model's `base_model_tp_plan`, DTensor shards) with its
FSDP2 for the data-parallel dimension, loaded straight into the shards by `from_pretrained`
(`launcher.model.prepare` with `distributed_config`). Checkpoints are DCP, as FSDP2's: they reshard
onto any layout, and export consolidates them."""
from __future__ import annotations

import torch

from backend.job.capabilities import TIED_UNDER_TP_FSDP, TpPlan
from launcher.config import ConfigError
from launcher.engines.base import autocast, make_optimizer, make_scheduler
from launcher.engines.fsdp import FSDPEngine


def distributed_config(plan: TpPlan):
    from transformers.distributed import DistributedConfig

    return DistributedConfig(tp_size=plan.tp, fsdp_size=plan.fsdp, dp_replicate_size=plan.replicate)


class TPEngine(FSDPEngine):
    """The model arrives sharded; this adds the optimizer, autocast and gradient accumulation.
    Save and load are FSDP2's (DCP of DTensor state)."""

    name = "tp"
    reshards = True

    def __init__(self, model, spec, dist, total_steps: int, plan: TpPlan):
        if plan.fsdp > 1 and getattr(model.config, "tie_word_embeddings", False):
            raise ConfigError(f"fsdp: {TIED_UNDER_TP_FSDP}")
        self.spec, self.device, self.plan = spec, dist.device, plan
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(model, spec, dist.device)
        self.scheduler = make_scheduler(self.optimizer, spec, total_steps)
        self.accumulation = spec.gradient_accumulation_steps
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        # transformers applies FSDP2 (fully_shard) to the model it loads when the data-parallel
        # dimension has several ranks; it reduces the gradients of the parameters it wrapped.
        self._sync = getattr(base, "set_requires_gradient_sync", None)
        # LoRA adapters come after that wrapping: FSDP2 does not know them, so their (small)
        # gradients are averaged over the data-parallel ranks here.
        self._dp_group = _dp_group(base, plan) if spec.train_type == "lora" and plan.dp > 1 else None

    def forward_backward(self, batch: dict, sync: bool) -> torch.Tensor:
        if self._sync is not None:
            self._sync(sync)
        with autocast(self.device, self.spec.torch_dtype):
            loss = self.model(**batch).loss
        (loss / self.accumulation).backward()
        return loss.detach()

    def step(self):
        if self._dp_group is not None:
            _average_grads(self.params, self._dp_group)
        return super().step()


def _dp_group(base, plan: TpPlan):
    """The process group of this rank's data-parallel peers (the ranks that hold the same TP shard)."""
    mesh = base._device_mesh
    return mesh["fsdp" if plan.fsdp > 1 else "dp_replicate"].get_group()


def _average_grads(params: list, group) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    if not grads:
        return
    # One flat all-reduce for all adapters: they are small, the calls are what costs.
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)  # a sum: gloo has no average
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
