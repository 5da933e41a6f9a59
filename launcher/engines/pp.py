"""Pipeline parallel on torch.distributed.pipelining: the decoder layers split into PP x virtual
stages of consecutive layers, each rank keeping only its stages' (looped: rank r holds stages r,
r + PP, ...); the first stage keeps the embeddings, the last the norm, the head and the loss.

The model stays the HF (or peft) module with the other stages' parts removed, so its state-dict
keys are the HF ones: checkpoints are DCP of each rank's own keys, and export reads their union as
one full model. The trainer's micro-batches of one step are the schedule's micro-batches.

With more ranks than stages, each pipeline is a group of PP consecutive ranks (the trainer's
data-parallel rank is rank // PP) and a stage is replicated over the DP pipelines the torchtitan
way: FSDP2 on each of its decoder layers and on the stage (sharded with `fsdp`, else DDP's layout
on FSDP2), which torch's schedules know how to accumulate and reduce once per step."""
from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

from backend.job.capabilities import PP, TIED_UNDER_PP, FsdpPlan, fsdp_plan, pipeline_model_problems
from backend.job.modelcfg import sequence_mixing
from launcher import checkpoint
from launcher.config import ConfigError
from launcher.engines.base import (TorchOptimizerEngine, autocast, checkpoint_part, make_optimizer, make_scheduler,
                                   reduce_dtype)
from launcher.model import DTYPES

DCP_DIR = "dcp"
# Per-parameter optimizer keys: each rank holds other parameters, so the param_groups lists differ.
STATE_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class _Stage(nn.Module):
    """One stage's forward, as the HF decoder model runs it. Every stage recomputes the causal mask
    and the rotary embeddings from the position ids (passed to every stage as keyword arguments),
    so only the hidden states travel between ranks."""

    def __init__(self, base, layers: list[nn.Module], first: bool, last: bool):
        super().__init__()
        inner = base.model
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(layers)
        self.norm = inner.norm if last else None
        self.lm_head = base.lm_head if last else None
        self.rotary_emb = inner.rotary_emb
        self.config = base.config

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        if self.embed_tokens is not None:
            hidden = self.embed_tokens(hidden)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                  cache=None, position_ids=position_ids)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                           position_ids=position_ids)
        if self.lm_head is None:
            return hidden
        return self.lm_head(self.norm(hidden))


STAGE_INPUTS = ("position_ids", "attention_mask")
"""The keyword inputs every stage takes (`_Stage.forward`)."""


class PPEngine(TorchOptimizerEngine):
    name = "pp"
    #: DCP keeps each stage's HF keys with their global shapes: every rank reads its own stages'
    #: keys, so a checkpoint resumes onto another PP split or DP degree
    reshards = True
    optimizer_state = "flat"  # STATE_OPTIONS

    def __init__(self, model, spec, dist, total_steps: int):
        self.spec, self.dist, self.model = spec, dist, model
        pp, virtual = spec.pipeline_model_parallel_size, spec.virtual_pipeline_model_parallel_size
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        refuse_tied(base)
        refused = pipeline_model_problems(spec, *sequence_mixing(base.config.to_dict()))
        if refused:
            raise ConfigError("\n".join(str(p) for p in refused))
        dp = dist.world_size // pp
        # rank = dp_rank * PP + pp_rank: a pipeline's ranks are consecutive, as the trainer's data split expects
        mesh = init_device_mesh(dist.device.type, (dp, 1, pp), mesh_dim_names=("dp", "shard", "pp"))
        self.pp_rank, self.pp_group = mesh["pp"].get_local_rank(), mesh["pp"].get_group()
        layers = list(base.model.layers)
        per_stage = len(layers) // (pp * virtual)
        self.stage_ids = [v * pp + self.pp_rank for v in range(virtual)]
        n_stages = pp * virtual
        owned = {i for s in self.stage_ids for i in range(s * per_stage, (s + 1) * per_stage)}
        stages = [_Stage(base, layers[s * per_stage:(s + 1) * per_stage], s == 0, s == n_stages - 1)
                  for s in self.stage_ids]
        # A ModuleDict keyed by the layer index keeps the HF names (model.layers.<i>.…) of the kept layers.
        base.model.layers = nn.ModuleDict({str(i): layers[i] for i in sorted(owned)})
        if 0 not in self.stage_ids:
            base.model.embed_tokens = None
        if n_stages - 1 not in self.stage_ids:
            base.model.norm = None
            base.lm_head = None
        model.to(dist.device)
        self.is_last = n_stages - 1 in self.stage_ids
        # Autocast where no FSDP2 policy casts the weights: one pipeline (several run on FSDP2).
        self.autocast = spec.torch_dtype != "float32" and dp == 1
        if dp > 1:
            stages = self._replicate(stages, mesh, spec)
        pipeline = [PipelineStage(stage, s, n_stages, dist.device, group=self.pp_group)
                    for stage, s in zip(stages, self.stage_ids)]
        self.clock = StageClock(pipeline, dist.device)
        self.accumulation = self.micro_batches_per_forward = spec.gradient_accumulation_steps
        self.computes_loss = self.is_last
        self.schedule = self._schedule(pipeline, _without_shape_inference(_loss(base)))
        self._stages, self._reference_schedule, self._reference_stages = stages, None, None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(model, spec, dist.device)
        self.scheduler = make_scheduler(self.optimizer, spec, total_steps)
        # Each stage's squared norm summed over its pipeline (a DTensor's already over its DP
        # shards): clipping and the reported norm are the unsplit model's.
        self.norm_group = self.pp_group
        self._buffer: list[dict] = []
        self._losses: list[torch.Tensor] = []

    def _schedule(self, pipeline: list[PipelineStage], loss_fn=None):
        if self.spec.pipeline_schedule == "interleaved_1f1b":
            return ScheduleInterleaved1F1B(pipeline, self.accumulation, loss_fn=loss_fn)
        return Schedule1F1B(pipeline[0], self.accumulation, loss_fn=loss_fn)

    def _replicate(self, stages: list[nn.Module], mesh, spec) -> list[nn.Module]:
        """Each stage over the DP pipelines on FSDP2: sharded with `fsdp`, else DDP's layout (LoRA
        too: torch's DistributedDataParallel fails its bucket rebuild under a schedule's several
        forwards per step, tests/test_pipeline_parallel.py). A stage keeps its gathered weights
        through the step (torchtitan's choice under PP): resharding after each forward would gather
        them again for every micro-batch."""
        plan = fsdp_plan(spec) or FsdpPlan(replicate=True, reshard_after_forward=False, offload=False)
        kwargs = {"mesh": mesh["dp", "shard"] if plan.replicate else mesh["dp"], "reshard_after_forward": False}
        if spec.torch_dtype != "float32":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[spec.torch_dtype],
                                                       reduce_dtype=reduce_dtype(spec))
        for stage in stages:
            for layer in stage.layers:
                fully_shard(layer, **kwargs)
            fully_shard(stage, **kwargs)
        return stages

    def timing_fields(self, steps: int) -> dict:
        """This rank's stages and their compute per step (forward and backward, waits left out)
        since the last call: the stage that takes longest holds the whole pipeline back."""
        return {"pp_stages": self.stage_ids, "stage_compute_s": self.clock.take() / max(steps, 1)}

    def forward_backward(self, batch: dict, sync: bool) -> torch.Tensor:
        """The schedule runs once per step, over all its micro-batches, on the last call. The loss
        returned for each earlier micro-batch is filled in place then: the trainer stacks them only
        after the last call."""
        self._buffer.append(batch)
        loss = torch.zeros((), device=self.dist.device)
        self._losses.append(loss)
        if not sync:
            return loss
        args, kwargs, labels = self._inputs(self._buffer, STAGE_INPUTS)
        losses: list[torch.Tensor] = []
        with self._autocast():
            # The last stage keeps no logits for the caller: only what the loss function makes of them.
            self.schedule.step(*args, target=labels if self.is_last else None, losses=losses, return_outputs=False,
                               **kwargs)
        # Every rank reports its pipeline's loss: the trainer averages the losses of all ranks.
        values = self._from_last_stage(torch.stack([x.detach().float() for x in losses]) if self.is_last else None,
                                       (len(self._buffer),))
        for out, value in zip(self._losses, values):
            out.copy_(value)
        self._buffer, self._losses = [], []
        return loss

    @torch.no_grad()
    def reference_logps(self, reference, batches: list[dict]) -> list[torch.Tensor]:
        """A step's micro-batches' reference log-probs by one forward-only pass down the pipeline
        (the policy with its adapters off, or, precomputing before training, as it is), each row's
        sum computed on the last stage and sent to the pipeline's other ranks. The pass has its own
        stage objects and schedule over the same modules: switching one schedule between eval and
        training makes torch infer every stage's shapes again, by a forward and backward each time.
        torch keeps each micro-batch's stage outputs for a backward that an eval never runs: the
        last stage's logits are freed as soon as their sums are taken (their storage emptied;
        tests/test_pipeline_parallel.py pins that torch reads no more of them), the rest when the
        pass ends."""
        if reference.frozen is not None:
            raise ConfigError(f"{PP}: a pipeline does not hold a frozen reference model: train LoRA or set "
                              "precompute_ref_log_probs (and no ref_model)")
        if self._reference_schedule is None:
            from launcher.preference import sequence_logps

            n_stages = self.spec.pipeline_model_parallel_size * self.spec.virtual_pipeline_model_parallel_size
            pipeline = [PipelineStage(stage, s, n_stages, self.dist.device, group=self.pp_group)
                        for stage, s in zip(self._stages, self.stage_ids)]
            self.clock.watch(pipeline)
            def row_sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
                sums = sequence_logps(logits, labels)[0]
                # torch keeps this output (the stage's cache entry) but reads no more of its data
                logits.untyped_storage().resize_(0)
                return sums

            self._reference_schedule, self._reference_stages = self._schedule(pipeline, row_sums), pipeline
        args, kwargs, labels = self._inputs(batches, STAGE_INPUTS)
        sums: list[torch.Tensor] = []
        with reference.adapters_off(), self._autocast():
            self._reference_schedule.eval(*args, target=labels if self.is_last else None, losses=sums,
                                          return_outputs=False, **kwargs)
        for stage in self._reference_stages:  # each micro-batch's outputs, kept for a backward that never comes
            stage.clear_runtime_states()
        rows = labels.shape[0] // len(batches)
        return list(self._from_last_stage(torch.stack(sums).float() if self.is_last else None, (len(batches), rows)))

    def reference_done(self) -> None:
        self._reference_schedule = self._reference_stages = None  # their buffers, for a pass that is over

    def _inputs(self, batches: list[dict], names: tuple[str, ...]) -> tuple[tuple, dict, torch.Tensor]:
        """The schedule's arguments for `batches`, one per schedule micro-batch: the first stage's
        input ids, every stage's keyword inputs `names`, and the labels."""
        whole = {k: torch.cat([b[k] for b in batches]).to(self.dist.device) for k in batches[0]}
        args = (whole["input_ids"],) if self.pp_rank == 0 else ()
        return args, {k: whole[k] for k in names if k in whole}, whole["labels"]

    def _autocast(self):
        return autocast(self.dist.device, self.spec.torch_dtype) if self.autocast else nullcontext()

    def _from_last_stage(self, values: torch.Tensor | None, shape: tuple) -> torch.Tensor:
        """The last stage's `values` on every rank of its pipeline (None elsewhere: received)."""
        if values is None:
            values = torch.zeros(shape, device=self.dist.device)
        tdist.broadcast(values, group=self.pp_group, group_src=self.spec.pipeline_model_parallel_size - 1)
        return values

    def save(self, path: Path, is_main: bool) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=STATE_OPTIONS)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path / DCP_DIR))
        if is_main:
            torch.save(self.scheduler.state_dict(), path / "scheduler.pt")
        if self.spec.train_type == "lora":
            # The adapters are small: rank 0 gathers every stage's for export (as FSDP's engine does).
            from peft import get_peft_model_state_dict

            mine = {k: _full(v).detach().cpu() for k, v in get_peft_model_state_dict(self.model).items()}
            parts = [None] * self.dist.world_size
            tdist.all_gather_object(parts, mine, group=self.dist.control)
            if is_main:
                full = {k: v for part in parts for k, v in part.items()}
                _save_adapters(self.model, path / "model", full)
        elif is_main:
            self.model.config.save_pretrained(path / "model")

    def load(self, path: Path) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=STATE_OPTIONS)
        state = {"model": model_state, "optim": optim_state}
        checkpoint.dcp_read(state, checkpoint_part(path, f"{DCP_DIR}/", self.name))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=STATE_OPTIONS)
        self.scheduler.load_state_dict(checkpoint.read(path / "scheduler.pt"))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter whole: a stage's FSDP2 shards are gathered (every rank of its DP group calls this)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class StageClock:
    """The compute time of a rank's stages: each forward and backward of a micro-batch timed on the
    device (CUDA events, read when the window is logged, after the loss has been read anyway), or
    on the host on CPUs. Waiting for the neighbours' activations falls outside these calls."""

    def __init__(self, stages: list[PipelineStage], device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list = []
        self.host_s = 0.0
        self.watch(stages)

    def watch(self, stages: list[PipelineStage]) -> None:
        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, call):
        def timed(*args, **kwargs):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = call(*args, **kwargs)
                end.record()
                self.pending.append((start, end))
                return out
            started = time.perf_counter()
            out = call(*args, **kwargs)
            self.host_s += time.perf_counter() - started
            return out

        return timed

    def take(self) -> float:
        """Seconds of compute since the last take."""
        if self.pending:
            self.pending[-1][1].synchronize()
        total = self.host_s + sum(start.elapsed_time(end) for start, end in self.pending) / 1000
        self.pending, self.host_s = [], 0.0
        return total


def refuse_tied(model) -> None:
    """The validator refuses a tied model from its config; a worker started without it stops here."""
    if getattr(model.config, "tie_word_embeddings", False):
        raise ConfigError(f"{PP}: {TIED_UNDER_PP}")


def _loss(base):
    """The HF model's own causal-LM loss (shifted labels, mean over the micro-batch's non-ignored
    tokens), as `model(**batch).loss` computes it; the schedule divides each by the micro-batches."""
    vocab = base.config.vocab_size

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return base.loss_function(logits=logits, labels=labels, vocab_size=vocab)

    return loss


def _without_shape_inference(loss):
    """`loss` for a training schedule, whose first step infers the stages' shapes by a forward and
    backward of uninitialised activations, calling the loss from `_backward_metadata_inference`
    (torch 2.13; tests/test_pipeline_parallel.py pins it): that call gets a stand-in of the logits'
    shape. It is no micro-batch's: preference training's loss would count it and take a
    micro-batch's reference log-probs."""

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if sys._getframe(1).f_code.co_name == "_backward_metadata_inference":
            return logits.float().sum() * 0
        return loss(logits, labels)

    return loss_fn


def _save_adapters(model, out: Path, state: dict[str, torch.Tensor]) -> None:
    """peft's adapter files from the gathered adapters of all stages."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    model.peft_config["default"].save_pretrained(out)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "adapter_model.safetensors", metadata={"format": "pt"})
