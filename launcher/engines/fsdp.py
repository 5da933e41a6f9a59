"""FSDP2 (`torch.distributed.fsdp.fully_shard`): each decoder layer and the root sharded over
all ranks; checkpoints through torch.distributed.checkpoint, so they reshard onto any world size.
With ring context parallel (`launcher.engines.cp`) the shards span the CP ranks too.

The same machinery runs DDP's layout for full fine-tuning (`FsdpPlan.replicate`): every rank holds
every parameter (shards of one rank, HSDP's replicate dimension over all ranks) and gradients are
all-reduced. Unlike torch's DistributedDataParallel under autocast, it computes with 16-bit copies
of the fp32 weights made once per micro-batch in one fused copy per layer, not a cast per weight
per use."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from backend.job.capabilities import CP, FsdpPlan
from launcher import checkpoint
from launcher.config import ConfigError
from launcher.engines.base import (TorchOptimizerEngine, checkpoint_part, evaluating, make_optimizer, make_scheduler,
                                   reduce_dtype, save_pretrained)
from launcher.model import DTYPES, decoder_layers

DCP_DIR = "dcp"


class FSDPEngine(TorchOptimizerEngine):
    name = "fsdp"
    reshards = True
    #: ring context parallel (launcher.engines.cp.RingCP) where the job runs it
    cp = None

    def __init__(self, model, spec, dist, total_steps: int, plan: FsdpPlan):
        self.spec = spec
        if plan.replicate:
            self.name = "ddp"
            mesh = init_device_mesh(dist.device.type, (dist.world_size, 1), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(dist.device.type, (dist.world_size,))
        kwargs = {"mesh": mesh, "reshard_after_forward": plan.reshard_after_forward}
        if spec.torch_dtype != "float32":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[spec.torch_dtype], reduce_dtype=reduce_dtype(spec))
        if plan.offload and dist.device.type == "cuda":
            kwargs["offload_policy"] = CPUOffloadPolicy()
        elif dist.device.type == "cuda":
            model.to(dist.device)
        layers = decoder_layers(model)
        if not layers:
            raise ValueError("fsdp: cannot find the decoder layers of this model (no _no_split_modules)")
        for i, layer in enumerate(layers):
            # Backward starts with the last layer: resharding it after forward would only gather it again.
            last = i == len(layers) - 1
            fully_shard(layer, **{**kwargs, "reshard_after_forward": plan.reshard_after_forward and not last})
        fully_shard(model, **kwargs)
        self._shard_kwargs = kwargs
        self.model = model
        self.optimizer = make_optimizer(model, spec, dist.device if "offload_policy" not in kwargs else torch.device("cpu"))
        self.scheduler = make_scheduler(self.optimizer, spec, total_steps)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.accumulation = spec.gradient_accumulation_steps
        if spec.context_parallel_size > 1:
            from launcher.engines.cp import RingCP

            self.cp = RingCP(model, spec, dist, layers)

    def frozen(self, module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """A frozen copy of the model (preference training's reference) sharded as the policy is:
        each rank keeps its shard, a layer is gathered for its forward and freed after it."""
        kwargs = {**self._shard_kwargs, "reshard_after_forward": True}
        if "offload_policy" not in kwargs:
            module.to(device)
        layers = decoder_layers(module)
        if self.cp:  # its attention is the ring's too: a ref_model the ring cannot run is refused
            from launcher.engines.cp import drop_masks, ring_refusals

            if refused := ring_refusals(module.config, self.spec):
                raise ConfigError("\n".join(f"ref_model: as the reference under {CP} > 1, {line}" for line in refused))
            drop_masks(layers)
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(module, **kwargs)
        return module

    @property
    def sequence_group(self):
        return self.cp

    def forward_backward(self, batch: dict, sync: bool) -> torch.Tensor:
        # Reduce-scatter only on the last micro-batch; earlier ones accumulate unsharded grads.
        self.model.set_requires_gradient_sync(sync)
        if self.cp:
            return self.cp.forward_backward(self.model, batch, 1 / self.accumulation)
        loss = self.model(**batch).loss
        (loss / self.accumulation).backward()
        return loss.detach()

    def evaluate(self, batch: dict) -> torch.Tensor:
        with evaluating(self.model):
            if self.cp:
                return self.cp.evaluate(self.model, batch)
            return self.model(**batch).loss.detach()

    def save(self, path: Path, is_main: bool) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path / DCP_DIR))
        if is_main:
            torch.save(self.scheduler.state_dict(), path / "scheduler.pt")
        if self.spec.train_type == "lora":
            # Adapters are small: gather only them (not the frozen base) for export; full weights stay sharded in
            # dcp/ and launcher.export consolidates them.
            full = get_model_state_dict(self.model, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))
            if is_main:
                save_pretrained(self.model, path / "model", state_dict=full)
        elif is_main:
            self.model.config.save_pretrained(path / "model")

    def load(self, path: Path) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        checkpoint.dcp_read(state, checkpoint_part(path, f"{DCP_DIR}/", self.name))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(checkpoint.read(path / "scheduler.pt"))

