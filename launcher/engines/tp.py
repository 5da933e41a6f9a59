"""Tensor and expert parallel: transformers' own TP and EP (the model's `base_model_tp_plan` and
`base_model_ep_plan`, DTensor shards, tokens sent to their experts by all-to-all) with its FSDP2
for the data-parallel dimension, loaded straight into the shards by `from_pretrained`
(`launcher.model.prepare` with `distributed_config`). Checkpoints are DCP, as FSDP2's: they reshard
onto any layout, and export consolidates them."""
from __future__ import annotations

import torch

import logging

from backend.job.capabilities import TransformersPlan, ep_model_problems, tied_under_tp_fsdp
from launcher.config import ConfigError
from launcher.engines.base import autocast, evaluating, make_optimizer, make_scheduler
from launcher.engines.fsdp import FSDPEngine


log = logging.getLogger(__name__)


def distributed_config(plan: TransformersPlan):
    from transformers.distributed import DistributedConfig

    return DistributedConfig(tp_size=plan.tp, fsdp_size=plan.fsdp, dp_replicate_size=plan.replicate,
                             ep_size=plan.ep)


class TPEngine(FSDPEngine):
    """The model arrives sharded; this adds the optimizer, autocast and gradient accumulation.
    Save and load are FSDP2's (DCP of DTensor state)."""

    name = "tp"
    reshards = True

    def __init__(self, model, spec, dist, total_steps: int, plan: TransformersPlan):
        text = model.config.get_text_config()
        tied = tied_under_tp_fsdp(plan, getattr(model.config, "tie_word_embeddings", False), text.vocab_size)
        if tied:
            raise ConfigError(f"fsdp: {tied}")
        if plan.ep > 1:
            self.name = "ep"
            _refuse_lora_on_experts(model, spec)
            if dist.is_main:
                log.info("expert parallel: EP=%d, %s", plan.ep, _experts_held(model))
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
        if plan.tp > 1 and not _sharded_layers(base):
            raise ConfigError(f"tensor_model_parallel_size: transformers' TP plan for {model.config.model_type} shards "
                              f"none of its layers (its plan: {getattr(text, 'base_model_tp_plan', None)}): every rank "
                              "would hold and compute the whole model; leave TP at 1")
        self._partial = _partial_over_tp(base) if plan.tp > 1 else []
        self._tp_group = base._device_mesh["tp"].get_group() if self._partial else None

    def forward_backward(self, batch: dict, sync: bool) -> torch.Tensor:
        if self._sync is not None:
            self._sync(sync)
        with autocast(self.device, self.spec.torch_dtype):
            loss = self.model(**batch).loss
        (loss / self.accumulation).backward()
        return loss.detach()

    def evaluate(self, batch: dict) -> torch.Tensor:
        with evaluating(self.model), autocast(self.device, self.spec.torch_dtype):
            return self.model(**batch).loss.detach()

    def step(self):
        if self._dp_group is not None:
            _average_grads(self.params, self._dp_group)
        if self._partial:
            _sum_grads(self._partial, self._tp_group)
        return super().step()


def _sharded_layers(base) -> bool:
    """Whether TP split any decoder layer's weights (a plan of the embedding alone splits none)."""
    from torch.distributed.tensor import DTensor, Shard

    return any(isinstance(p, DTensor) and any(isinstance(x, Shard) for x in p.placements)
               for name, p in base.named_parameters() if ".layers." in name)


# transformers 5.24's "replicated_with_grad_allreduce" (Qwen3's per-head q_norm and k_norm under TP)
# sums a norm's partial gradient over the TP ranks in a post-accumulate hook, which runs on every
# micro-batch: with gradient accumulation the earlier micro-batches' sums are summed again (pinned
# in tests/test_tensor_parallel.py). The hook is taken out before the first forward and the sum is
# made once per step instead.
ALL_REDUCE_HOOK = "ReplicatedWithGradAllReduce.install_forward.<locals>.tp_forward"


def _partial_over_tp(base) -> list:
    """The trainable parameters whose gradients each TP rank holds only its heads' part of; their
    modules get their own forward back (without transformers' per-micro-batch hook)."""
    out = []
    for module in base.modules():
        forward = module.__dict__.get("forward")
        if getattr(forward, "__qualname__", None) == ALL_REDUCE_HOOK:
            del module.forward
            out += [p for p in module.parameters(recurse=False) if p.requires_grad]
    return out


def _sum_grads(params: list, group) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    for p in params:
        if p.grad is not None:
            # FSDP2 shards these over the data-parallel ranks; a TP group's ranks hold the same shard.
            dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=group)


def _dp_group(base, plan: TransformersPlan):
    """The process group of this rank's data-parallel peers (the ranks that hold the same TP shard).
    The model's `_device_mesh` is transformers' (pp, fsdp, tp) slice, without the replicas' dimension:
    the whole mesh is its mesh manager's. A plan shards or replicates, never both (transformers_plan)."""
    return base._mesh_manager.get_mesh("fsdp" if plan.fsdp > 1 else "dp_replicate").get_group()


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


def _refuse_lora_on_experts(model, spec) -> None:
    """The validator refuses LoRA on the experts under EP from the model's config; a worker started
    without it finds peft's wrappers of the stacked expert weights here, before the first step fails."""
    wrapped = any(type(m).__name__ == "ParamWrapper" for m in model.modules())
    for problem in ep_model_problems(spec, is_moe=True, num_experts=0, tied=False, lora_on_experts=wrapped):
        raise ConfigError(str(problem))


def _experts_held(model) -> str:
    """How many experts' weights rank 0 holds, from the first MoE layer's stacked weights
    (transformers sets the module's `num_experts` to the local count; the config keeps the total)."""
    from torch.distributed.tensor import DTensor

    config = model.config
    total = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    for module in model.modules():
        weight = getattr(module, "gate_up_proj", None)
        if isinstance(weight, torch.nn.Parameter) and weight.ndim == 3:
            local = weight.to_local() if isinstance(weight, DTensor) else weight
            return f"rank 0 holds the weights of {local.shape[0]} of the {total} experts of each MoE layer"
    return "no stacked experts found"
