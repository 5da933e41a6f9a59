"""What a mixture-of-experts model's routers did: the tokens each expert got and the model's own
load-balancing loss, per logging window, whatever engine trains the model.

The routers (transformers' `*TopKRouter` modules: Mixtral, Qwen2-MoE, Qwen3-MoE) return
(logits, scores, expert indices); a forward hook on each keeps them for the micro-batch. The
auxiliary loss is the model's own `load_balancing_loss_func` over those logits, so the series is
the term `router_aux_loss_coef` weighs, whether or not the job adds it to the loss.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch


def balancing_weight(model) -> float:
    """The weight transformers gives the routers' balancing loss inside `model`'s loss (0: not added;
    launcher/model.py sets it where the job asks for the term)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    adds = getattr(getattr(base, "config", None), "output_router_logits", False)
    return getattr(base, "router_aux_loss_coef", 0.0) if adds else 0.0


def group_share(out, weight: float, group_size: int) -> torch.Tensor:
    """`out.loss` of one rank of a group that holds a slice of every sequence (Ulysses SP, ring CP),
    whose shares are added up: transformers put the whole balancing term of the slice's tokens into
    each rank's loss, which the sum would count group_size times; a share keeps 1/group_size of it,
    so the group holds the mean of its slices' terms once."""
    if weight and getattr(out, "aux_loss", None) is not None:
        return out.loss - weight * out.aux_loss * (1 - 1 / group_size)
    return out.loss


@dataclass(frozen=True)
class ExpertLoad:
    """One window's routing, summed over the ranks (each token counted once)."""

    aux_loss: float
    """Mean of the micro-batches' load-balancing losses."""
    expert_tokens: list[int]
    """Routed tokens per expert, over all MoE layers (a token counts once per expert it is sent to)."""

    @property
    def max_expert_share(self) -> float:
        """The busiest expert's share of the routed tokens (1 / experts when balanced)."""
        total = sum(self.expert_tokens)
        return max(self.expert_tokens) / total if total else 0.0


class RouterMeter:
    def __init__(self, model):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = base.config
        self.num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
        self.top_k = getattr(config, "num_experts_per_tok", 0)
        self._aux_fn = _model_function(base, "load_balancing_loss_func")
        self._routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        for index, router in enumerate(self._routers):
            router.register_forward_hook(self._hook(index))
        self._logits: dict[int, torch.Tensor] = {}
        self._mask: torch.Tensor | None = None
        self._recording = False
        self._aux_sum = self._counts = None
        self._micro = 0

    @property
    def active(self) -> bool:
        return bool(self._routers) and self.num_experts > 0 and self.top_k > 0 and self._aux_fn is not None

    def _hook(self, index: int):
        def keep(module, args, output):
            # The first call of a micro-batch is its forward; checkpointing's recompute calls again.
            if self._recording and index not in self._logits and isinstance(output, tuple) and len(output) == 3:
                logits = output[0].detach()
                # Under TP the router is replicated: its DTensor output holds every row on every rank.
                self._logits[index] = logits.to_local() if hasattr(logits, "to_local") else logits
        return keep

    def start(self, batch: dict) -> None:
        self._logits, self._recording = {}, True
        self._mask = batch.get("attention_mask")

    def finish(self) -> None:
        """Adds the micro-batch's routing to the window (on the device: nothing waits for it)."""
        self._recording = False
        if not self._logits:
            return
        logits = tuple(self._logits[i] for i in sorted(self._logits))
        rows = logits[0].shape[0]
        mask = self._mask if self._mask is not None and self._mask.numel() == rows else None
        with torch.no_grad():
            aux = torch.as_tensor(self._aux_fn(logits, self.num_experts, self.top_k, mask), dtype=torch.float32,
                                  device=logits[0].device)
            weights = None if mask is None else mask.reshape(-1, 1).expand(rows, self.top_k).reshape(-1).float()
            counts = sum(torch.bincount(torch.topk(layer, self.top_k, dim=-1).indices.reshape(-1),
                                        weights=weights, minlength=self.num_experts).float() for layer in logits)
        self._aux_sum = aux if self._aux_sum is None else self._aux_sum + aux
        self._counts = counts if self._counts is None else self._counts + counts
        self._micro += 1
        self._logits = {}

    def take(self, dist) -> ExpertLoad | None:
        """The window's routing over all ranks (collective: every rank calls it), then a new window."""
        if not self.active:
            return None
        local = [0.0] * (self.num_experts + 2)
        if self._micro:
            local = [float(self._aux_sum), float(self._micro), *self._counts.cpu().tolist()]
        summed, _ = dist.all_reduce(local, "sum")
        self._aux_sum = self._counts = None
        self._micro = 0
        aux_sum, micro, *counts = summed
        if not micro:
            return None
        # The ranks of one TP group route the same tokens.
        return ExpertLoad(aux_sum / micro, [round(c / dist.same_data_ranks) for c in counts])


def _model_function(model, name: str):
    """A function of the model's modeling module; FSDP2 puts the model under a class of its own
    (`FSDPQwen3MoeForCausalLM`), so the module is looked up along the class's bases."""
    for cls in type(model).__mro__:
        found = getattr(sys.modules.get(cls.__module__), name, None)
        if found is not None:
            return found
    return None
