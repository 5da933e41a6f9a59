"""Ring context parallel: torch's `context_parallel` (what accelerate's `cp_size` wraps) over FSDP2.
The ranks of a CP group (consecutive ranks, reading the same batches) each keep two chunks of every
sequence, a head and a tail (torch's load balancer), and torch rewrites SDPA into ring attention
around them; the rest of the model runs on the local chunks. The parameters are FSDP2's over all
ranks, so checkpoints are the plain FSDP2 ones and reshard onto any layout."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from backend.job.capabilities import CP, ring_kernel_problems, ring_model_problems
from backend.job.modelcfg import sequence_mixing
from launcher.config import ConfigError
from launcher.moe import balancing_weight, group_share


class RingCP:
    def __init__(self, model, spec, dist, layers: list):
        """`layers`: the model's decoder layers (`launcher.model.decoder_layers`, found before
        fully_shard renames their classes)."""
        from torch.distributed.device_mesh import init_device_mesh

        if refused := ring_refusals(model.config, spec):
            raise ConfigError("\n".join(refused))
        size = spec.context_parallel_size
        # The CP dimension innermost: a group is consecutive ranks (backend.job.capabilities.same_data_ranks).
        self.mesh = init_device_mesh(dist.device.type, (dist.world_size // size, size), mesh_dim_names=("dp", CP))[CP]
        drop_masks(layers)

    @property
    def group(self):
        return self.mesh.get_group()

    @property
    def size(self) -> int:
        return self.mesh.size()

    def sharded(self, batch: dict):
        """`ring_sharded` over this group: another forward of the model (preference training's
        reference) runs inside, on this rank's chunks."""
        return ring_sharded(self.mesh, batch)

    def forward_backward(self, model, batch: dict, scale: float) -> torch.Tensor:
        return ring_forward_backward(model, batch, self.mesh, scale)

    def evaluate(self, model, batch: dict) -> torch.Tensor:
        return ring_forward_backward(model, batch, self.mesh, None)


def ring_refusals(config, spec) -> list[str]:
    """Why torch's ring cannot run a model of this transformers `config` for the job ("field:
    message" lines): a window, chunk or other sequence mixer; grouped-query heads in float32; an
    attention that is not SDPA (the ring replaces SDPA only)."""
    heads = config.num_attention_heads
    refused = [f"{p.field}: {p.message}" for p in
               ring_model_problems(spec, *sequence_mixing(config.to_dict()))
               + ring_kernel_problems(spec, heads, getattr(config, "num_key_value_heads", None) or heads)]
    if config._attn_implementation != "sdpa":
        refused.append(f"attn_impl: {config._attn_implementation} with {CP} > 1: ring attention replaces SDPA only")
    return refused


@contextmanager
def ring_sharded(mesh, batch: dict):
    """This rank's chunks of a micro-batch (input_ids, position_ids, and its labels shifted over the
    whole rows first: a chunk's last token predicts the next chunk's first), as the forward inside
    the context sees them; torch's `context_parallel` makes SDPA the ring's within it (a backward
    too)."""
    from torch.distributed.tensor.experimental import context_parallel

    labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:].contiguous()
    ids, positions = batch["input_ids"].clone(), batch["position_ids"].clone()
    buffers = [ids, labels, positions]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
        yield {"input_ids": ids, "position_ids": positions, "labels": labels, "shift_labels": labels}


def ring_forward_backward(model, batch: dict, mesh, scale: float | None) -> torch.Tensor:
    """Forward and backward of this rank's chunks of a micro-batch under torch's `context_parallel`
    over `mesh` (the CP group), `scale` times its share of the loss (None: forward only, for
    evaluation); returns the micro-batch's whole mean token loss. The share is the sum of the
    chunk's token losses over the group's count of predicted tokens, so the group's shares add up to
    the mean; FSDP2 averages gradients over all ranks, DP x CP, hence the factor CP. A preference
    loss makes its shares itself (`launcher.preference.PreferenceLoss`, over `RingCP.group`)."""
    import torch.distributed as dist

    # of the whole rows (every rank of the group has them), after the shift
    predicted = (batch["labels"][:, 1:] != -100).sum().clamp(min=1)
    with ring_sharded(mesh, batch) as local:  # sharded in place; backward runs inside too
        share = group_share(model(**local, num_items_in_batch=predicted), balancing_weight(model), mesh.size())
        if scale is not None:
            (share * mesh.size() * scale).backward()
    full = share.detach().clone()
    dist.all_reduce(full, group=mesh.get_group())
    return full


def drop_masks(layers: list) -> None:
    """Ring attention takes no mask, only causality (torch refuses SDPA with one): transformers
    builds one from the chunks' position ids (they jump from the head to the tail chunk, which it
    reads as packed samples), so every attention module is called with none and `is_causal` instead,
    as accelerate does. Rows are right-padded, so the causal mask alone keeps pads out of view."""
    def hook(module, args, kwargs):
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = None
            kwargs["is_causal"] = True
        return args, kwargs

    without = [i for i, layer in enumerate(layers) if not hasattr(layer, "self_attn")]
    if not layers or without:
        raise ConfigError(f"{CP}: decoder layers {without[:5]} of this model have no self-attention module (they mix "
                          "the sequence otherwise), which ring CP cannot split; use sequence_parallel_size")
    for layer in layers:
        layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
