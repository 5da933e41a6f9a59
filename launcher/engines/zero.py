"""DeepSpeed ZeRO 0-3 (with CPU optimizer / parameter offload) through `deepspeed.initialize`, with
its AutoTP for tensor parallel (`tensor_parallel.autotp_size` in the config) and Ulysses sequence
parallel (DeepSpeed's ALST for HF models)."""
from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from backend.job.capabilities import autotp
from launcher import checkpoint
from launcher.engines.base import (Engine, checkpoint_part, evaluating, make_optimizer, make_scheduler, param_groups,
                                   save_pretrained)
from launcher.moe import balancing_weight, group_share

TAG = "engine"  # sub-directory of the checkpoint that holds DeepSpeed's own files
log = logging.getLogger(__name__)


@contextmanager
def mlflow_hidden():
    """`import mlflow` fails inside, as for a missing package; outside, it works as before.

    DeepSpeed's runtime config imports its autotuner, which imports mlflow whenever it is installed
    (deepspeed/autotuning/autotuner.py, for the autotuning launcher, which the worker never runs):
    0.96 s of `import deepspeed`'s 1.16 s on a 2-core machine, in every rank. The autotuner catches
    the failure (its `has_mlflow` is then False). Pinned by tests/test_worker_engines.py."""
    if "mlflow" in sys.modules:  # imported already: nothing to save
        yield
        return
    sys.modules["mlflow"] = None
    try:
        yield
    finally:
        if sys.modules.get("mlflow", ...) is None:
            del sys.modules["mlflow"]


with mlflow_hidden():
    import deepspeed


class DeepSpeedEngine(Engine):
    name = "deepspeed"
    # ZeRO partitions optimizer state by data-parallel rank; loading it onto another world size
    # needs DeepSpeed's universal-checkpoint conversion, which this worker does not run.
    reshards = False

    def __init__(self, model, spec, dist, total_steps: int, config: dict):
        self.spec = spec
        zero = config.get("zero_optimization", {})
        self.stage = int(zero.get("stage", 0))
        offloaded = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
        optimizer = None
        if "optimizer" not in config:
            if offloaded:  # DeepSpeed's CPU Adam does the offloaded step; it needs the config section
                config["optimizer"] = {"type": "AdamW", "params": {"lr": spec.learning_rate, "betas": [0.9, 0.999],
                                                                    "eps": 1e-8, "weight_decay": spec.weight_decay}}
            else:
                optimizer = make_optimizer(model, spec, dist.device)
        elif not offloaded and str(config["optimizer"].get("type", "")).lower() in ("adam", "adamw"):
            # DeepSpeed would JIT-compile its FusedAdam op (minutes, and a build lock that a killed
            # job leaves behind); torch's fused AdamW does the same maths. The user can opt back.
            config["optimizer"].setdefault("params", {}).setdefault("torch_adam", True)
        scheduler = None if "scheduler" in config else (lambda opt: make_scheduler(opt, spec, total_steps))
        self.module = model
        # What a frozen copy is initialised with (`frozen`): the engine's config without training state.
        self._frozen_config = {k: v for k, v in config.items() if k not in ("optimizer", "scheduler")}
        self.sp = UlyssesSP(model, spec) if spec.sequence_parallel_size > 1 else None
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=None if optimizer else param_groups(model, spec),
            optimizer=optimizer, lr_scheduler=scheduler, config=config, mpu=self.sp and self.sp.mpu)

    def forward_backward(self, batch: dict, sync: bool) -> torch.Tensor:
        # DeepSpeed counts micro-batches itself and steps (and syncs) at the accumulation boundary.
        if self.sp:
            loss, full_loss = self.sp.loss(self.engine, batch)
            # DeepSpeed sums an SP group's gradients below ZeRO-3 (the group shares one sample, so
            # the per-rank shares add up) but averages them at ZeRO-3, over data x sequence ranks.
            self.engine.backward(loss * self.sp.size if self.stage == 3 else loss)
        else:
            loss = full_loss = self.engine(**batch).loss
            self.engine.backward(loss)
        self.engine.step()
        return full_loss.detach()

    def frozen(self, module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """Under ZeRO-3, partitioned over the data-parallel ranks as the policy is (DeepSpeed's
        inference-only initialize, as TRL prepares a reference model): each rank keeps its part,
        gathered layer by layer for the forward. Below ZeRO-3, whole on this rank."""
        if self.stage < 3:
            return module.to(device)
        config = dict(self._frozen_config)
        config["zero_optimization"] = {k: v for k, v in config["zero_optimization"].items() if k != "offload_optimizer"}
        # With Ulysses the data-parallel ranks are world / SP: the batch sizes of the config say so.
        engine, _, _, _ = deepspeed.initialize(model=module, config=config, mpu=self.sp and self.sp.mpu)
        engine.eval()
        whole = sum(p.ds_numel for p in module.parameters())
        held = sum(p.ds_tensor.numel() for p in module.parameters())
        log.info("reference partitioned by ZeRO-3: %d of its %d parameters on this rank", held, whole)
        return engine

    def evaluate(self, batch: dict) -> torch.Tensor:
        with evaluating(self.engine):
            return (self.sp.loss(self.engine, batch)[1] if self.sp else self.engine(**batch).loss).detach()

    def step(self):
        norm = self.engine.get_global_grad_norm()
        return float("nan") if norm is None else norm

    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def save(self, path: Path, is_main: bool) -> None:
        self.engine.save_checkpoint(str(path), tag=TAG)
        lora = self.spec.train_type == "lora"
        if autotp(self.spec):
            # AutoTP's layers hold shards: DeepSpeed gathers them (every rank takes part) for rank 0.
            state = self.engine._consolidated_16bit_state_dict()
            if is_main:
                save_pretrained(self.module, path / "model", state_dict=state)
        elif lora or self.stage < 3:
            # Adapters are small: gather them (a no-op below ZeRO-3) and write them for export.
            # Full weights below ZeRO-3 are whole on every rank. Full ZeRO-3 weights stay sharded
            # in `engine/`; launcher.export consolidates them.
            params = [p for p in self.module.parameters() if p.requires_grad] if lora else []
            with _gathered(params, self.stage):
                if is_main:
                    save_pretrained(self.module, path / "model")
        elif is_main:
            self.module.config.save_pretrained(path / "model")

    def load(self, path: Path) -> None:
        checkpoint_part(path, f"{TAG}/", self.name)
        # DeepSpeed's checkpoint engine reads its files with weights_only=False.
        with checkpoint.safe_torch_load(path / TAG, pickled_classes()):
            load_path, _ = self.engine.load_checkpoint(str(path), tag=TAG, load_optimizer_states=True,
                                                       load_lr_scheduler_states=True)
        if load_path is None:  # DeepSpeed warns and loads nothing where its files are missing
            raise ValueError(f"{path}: no DeepSpeed state under '{TAG}/'")


class UlyssesSP:
    """DeepSpeed's Ulysses for HF models: its attention wrapper all-to-alls heads and sequence around
    the model's own attention, and each rank of an SP group (consecutive ranks, reading the same
    batches) runs its slice of every sequence through the rest of the model."""

    def __init__(self, model, spec):
        import torch.distributed as dist
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the worker's process group
        # The wrapper reshapes by a fixed number of rows: a preference micro-batch holds each pair twice,
        # a padding_free one is a single row.
        rows = 1 if spec.padding_free else spec.per_device_train_batch_size * (2 if spec.rlhf_type else 1)
        self.mpu = UlyssesSPAttentionHF.register_with_transformers(
            model, core_attn_implementation=model.config._attn_implementation,
            sequence_parallel_size=spec.sequence_parallel_size, micro_batch_size=rows, seq_length_is_variable=True)
        self.group = self.mpu.get_sequence_parallel_group()
        self.size, self.rank = self.mpu.get_sequence_parallel_world_size(), self.mpu.get_sequence_parallel_rank()
        self.balancing_weight = balancing_weight(model)

    def shard(self, batch: dict) -> tuple[dict, torch.Tensor]:
        """This rank's slice of a micro-batch, with labels shifted over the whole sequence first (the
        last token of a slice predicts the first of the next), and the group's count of predicted
        tokens. Ulysses drops the attention mask: rows are right-padded, so no real token sees a pad."""
        import torch.distributed as dist

        labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
        width = labels.shape[1] // self.size
        part = slice(width * self.rank, width * (self.rank + 1))
        local = {key: batch[key][:, part].contiguous() for key in ("input_ids", "position_ids")}
        local["labels"] = local["shift_labels"] = labels[:, part].contiguous()
        predicted = (local["labels"] != -100).sum()
        dist.all_reduce(predicted, group=self.group)
        return local, predicted

    @contextmanager
    def sharded(self, batch: dict):
        """`shard`'s slice, as `RingCP.sharded` gives its chunks: another forward of the model
        (preference training's reference) runs on it."""
        yield self.shard(batch)[0]

    def loss(self, engine, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's share of the micro-batch's mean token loss, the whole mean)."""
        import torch.distributed as dist

        local, predicted = self.shard(batch)
        # transformers' causal-LM loss with pre-shifted labels: sum over this slice / the group's tokens
        share = group_share(engine(**local, num_items_in_batch=predicted.clamp(min=1)), self.balancing_weight, self.size)
        full = share.detach().clone()
        dist.all_reduce(full, group=self.group)
        return share, full


def pickled_classes() -> list:
    """The DeepSpeed classes in its checkpoint files besides tensors and plain data, allowed when they
    are read with weights_only=True. Listed from real ZeRO-0 to ZeRO-3 files (fp32, bf16; full and
    LoRA) with torch.serialization.get_unsafe_globals_in_checkpoint; DynamicLossScaler, not seen on a
    CPU, is what `CreateLossScaler` puts in the same optimizer state for fp16."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def _gathered(params, stage: int):
    import contextlib

    if stage < 3 or not params:
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
