"""What every engine offers the training loop, and the parts they share."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from launcher.config import ConfigError
from launcher.model import DTYPES
from launcher.vision import part_learning_rates


class Engine:
    """One optimizer step = `forward_backward` per micro-batch, then `step`.

    `save`/`load` are collective: every rank calls them with the same directory.
    """

    name = "engine"
    #: the Ulysses sequence-parallel group's sharding (launcher.engines.zero.UlyssesSP) where the
    #: engine runs one
    sp = None
    #: whether a checkpoint can be loaded with a different world size
    reshards = True
    #: how the optimizer state is keyed in its checkpoint: "nested" (torch's, per parameter group)
    #: or "flat" (per parameter, where ranks hold different parameters); the two do not load each other
    optimizer_state = "nested"
    #: whether this rank computes the loss (a pipeline's last stage does, its other stages do not)
    computes_loss = True
    #: how many micro-batches `reference_logps` takes at once (a pipeline's schedule: a step's)
    micro_batches_per_forward = 1

    def forward_backward(self, batch: dict, sync: bool) -> torch.Tensor:
        raise NotImplementedError

    def frozen(self, module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """`module`, a frozen copy of the model (preference training's reference), placed for this
        engine's forward: whole on this rank's device unless the engine shards it."""
        return module.to(device)

    @property
    def sequence_group(self):
        """The group whose ranks each hold a part of every row, where the engine runs one (Ulysses SP,
        ring CP: `.group`, `.size`, and `.sharded(batch)`, a context giving this rank's part): a
        preference loss adds its parts' log-prob sums over it, and another forward of the model
        (preference training's reference) runs on this rank's part through it."""
        return self.sp

    def forward_context(self):
        """The context the engine's forward runs in (DDP's autocast), for another forward of the
        same model to compute as it does (preference training's reference)."""
        return nullcontext()

    def reference_logps(self, reference, batches: list[dict]) -> list[torch.Tensor]:
        """Each micro-batch's reference log-probs (preference training's `Reference`), computed as
        this engine runs a forward: in its forward context, on this rank's part of each row."""
        return [reference.logps(batch, self.forward_context(), self.sequence_group) for batch in batches]

    def reference_done(self) -> None:
        """No more `reference_logps` this run (the precomputed ones are kept): what served them can go."""

    def evaluate(self, batch: dict) -> torch.Tensor:
        """The micro-batch's mean token loss, as `forward_backward` returns it, without gradients and
        with dropout off. Collective where the forward is (every rank calls it as often)."""
        raise ConfigError(f"eval_strategy: the {self.name} engine does not evaluate; set eval_strategy: no")

    def step(self) -> torch.Tensor | float:
        """Apply the accumulated gradients; returns the grad norm before clipping."""
        raise NotImplementedError

    def lr(self) -> float:
        raise NotImplementedError

    def timing_fields(self, steps: int) -> dict:
        """This rank's engine-specific fields of the `timing` event, over the window's `steps`."""
        return {}

    def save(self, path: Path, is_main: bool) -> None:
        raise NotImplementedError

    def load(self, path: Path) -> None:
        raise NotImplementedError


@contextmanager
def evaluating(module: torch.nn.Module):
    """No gradients and eval mode (dropout off, LoRA's too) for the duration; the mode restored after."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        module.train(was_training)


class TorchOptimizerEngine(Engine):
    """DDP and FSDP2: torch AdamW and LR schedule over `params`, clipping, optional fp16 scaler."""

    params: list
    optimizer: torch.optim.Optimizer
    scheduler: object
    spec: object
    scaler: torch.amp.GradScaler | None = None
    #: the ranks that each hold a part of the parameters outside any DTensor (a pipeline's stages):
    #: their norms are combined for the global one; None where every rank's norm is already global
    norm_group: object = None

    def step(self):
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = clip_grad_norm(self.params, self.spec.max_grad_norm, self.norm_group)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return norm

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]


def clip_grad_norm(params: list, max_norm: float | None, group=None) -> torch.Tensor:
    """The global gradient norm before clipping, clipped to `max_norm` (None or 0: no clipping).
    FSDP2's gradients are DTensors; under TP the replicated parameters (norms) keep plain
    gradients beside the DTensor ones, and under TP x FSDP2 they live on two meshes (fsdp, and
    fsdp x tp), which torch's clip_grad_norm_ refuses to mix: each mesh (and the plain ones) is
    reduced on its own, a DTensor norm over its whole mesh, and the parts combined; with `group`,
    also over those ranks' parts (each a pipeline stage's parameters)."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    parts = list(by_mesh.values())
    norms = [torch.nn.utils.get_total_norm([p.grad for p in part]) for part in parts]
    total = torch.linalg.vector_norm(torch.stack([(n.full_tensor() if isinstance(n, DTensor) else n).float()
                                                  for n in norms])) if norms else None
    if group is not None:
        import torch.distributed as dist

        squared = total.pow(2) if total is not None else torch.zeros((), device=params[0].device)
        dist.all_reduce(squared, group=group)
        total = squared.sqrt()
    if total is None:
        return torch.zeros(())
    if max_norm:
        for part in parts:
            torch.nn.utils.clip_grads_with_norm_(part, max_norm, total)
    return total.detach()


def checkpoint_part(path: Path, name: str, engine: str) -> Path:
    """`path / name`, which the engine's checkpoints hold; a clear error where another engine wrote
    the checkpoint (or torch's DDP did, before bf16/fp32 full fine-tuning moved to FSDP2)."""
    part = path / name
    if not part.exists():
        raise ConfigError(f"resume: {path} has no {name} ({engine} writes it): the checkpoint was written by another "
                          "engine; resume with the engine, train type and dtype that wrote it")
    return part


def autocast(device: torch.device, dtype_name: str):
    """Autocast for engines that keep fp32 parameters (DDP); nothing for fp32."""
    if dtype_name == "float32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype_name])


def reduce_dtype(spec) -> torch.dtype:
    """The dtype gradients travel in between ranks: the compute dtype unless the job asks for fp32."""
    return torch.float32 if spec.grad_reduce_dtype == "float32" else DTYPES[spec.torch_dtype]


def param_groups(model, spec) -> list[dict]:
    """Decay matrices, not biases and norms (the usual AdamW practice); a vision-language model's
    tower and aligner in groups of their own where vit_lr / aligner_lr set their rate. The job's
    learning_rate comes first where anything trains at it: the first group's rate is the one logged.
    A group holds DTensors or plain tensors, not both: CUDA's fused AdamW takes a group in one call and
    refuses a mix (LoRA under TP: the adapters of a sharded layer are DTensors on one side only)."""
    from torch.distributed.tensor import DTensor

    own_lr = part_learning_rates(model, spec)
    grouped: dict[tuple[float, bool, bool], list] = {(spec.learning_rate, True, False): []}
    for p in model.parameters():
        if p.requires_grad:
            grouped.setdefault((own_lr.get(id(p), spec.learning_rate), p.ndim >= 2, isinstance(p, DTensor)), []).append(p)
    return [{"params": params, "weight_decay": spec.weight_decay if decay else 0.0,
             **({"lr": lr} if lr != spec.learning_rate else {})}
            for (lr, decay, _), params in grouped.items() if params]


def make_optimizer(model, spec, device: torch.device):
    return torch.optim.AdamW(param_groups(model, spec), lr=spec.learning_rate, betas=(0.9, 0.999),
                             eps=1e-8, fused=device.type == "cuda")


def make_scheduler(optimizer, spec, total_steps: int):
    from transformers import get_scheduler

    warmup = int(round(spec.warmup_ratio * total_steps))
    return get_scheduler(spec.lr_scheduler_type, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)


def save_pretrained(model, path: Path, state_dict: dict | None = None) -> None:
    """LoRA: adapter_model.safetensors + adapter_config.json; full: model.safetensors + config."""
    model.save_pretrained(path, state_dict=state_dict, safe_serialization=True)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All `*.safetensors` files of a directory (one file or shards) as one state dict; empty when there are none."""
    from safetensors.torch import load_file

    state = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file))
    return state


def load_full_state_dict(model, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Load a full model's weights; returns the (missing, unexpected) keys that make it a mismatch.
    Tied output weights may be absent: they are saved once, as the input embedding."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    return [k for k in missing if k not in tied and not k.endswith("lm_head.weight")], unexpected


def load_weights(model, path: Path) -> None:
    """Inverse of `save_pretrained` into an already built (unsharded) model."""
    if (path / "adapter_model.safetensors").is_file():
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        result = set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors"))
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"{path}: adapter keys not in the model: {unexpected[:5]}")
        return
    missing, unexpected = load_full_state_dict(model, saved_state(model, path))
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})")


def saved_state(model, path: Path, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The weights `save_pretrained` wrote in `path`, named as `model` names them. transformers 5
    writes some models under their checkpoint names (Qwen-VL's `visual.*` and `model.layers.*` for
    `model.visual.*` and `model.language_model.layers.*`), which only from_pretrained maps back: where
    the file's names are not the model's, it is read that way (on the CPU, in the file's dtype).
    `state`: the files' weights where the caller has read them already."""
    state = read_safetensors(path) if state is None else state
    names = set(model.state_dict())
    if set(state) <= names:
        return state
    from launcher.vision import auto_class

    return auto_class(str(path)).from_pretrained(path, dtype="auto").state_dict()
