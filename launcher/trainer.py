"""The training loop of one rank: data, engine, events, checkpoints, stop and failure handling."""
from __future__ import annotations

import json
import logging
import gc
import math
import os
import random
import shutil
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from backend.job.capabilities import seq_multiple, tower_in_collectives, transformers_plan
from backend.job.dsconfig import zero_settings
from backend.job.errors import UserError
from backend.job.limits import collective_timeout_s
from backend.job.planner import STOP_BUDGET_ENV, STOP_BUDGET_S
from backend.job.spec import JobSpec
from launcher import checkpoint, data
from launcher.config import ConfigError, load_ds_config
from launcher.dist import Dist
from launcher.engines import build_engine
from launcher.events import EventWriter, Window, eta_seconds, format_duration, split_nonfinite, memory_gib
from launcher.engines.tp import distributed_config
from launcher.model import DTYPES, ModelError, flops_per_token, peak_flops, prepare
from launcher.moe import RouterMeter
from launcher.preference import (PreferenceLoss, Reference, install, load_reference_table, nonfinite_message,
                                 nonfinite_pairs, precompute, reference_file, save_reference_table)
from launcher.stream import StreamBatches, load_position, open_stream, save_position
from launcher.tokenized import DataHeartbeat, Tokenized, dataset_cache_dir, open_tokenized
from launcher.vision import IMAGES, NO_MEDIA, VIDEOS, Images, is_vision

log = logging.getLogger("launcher")
NONFINITE_LIMIT = 3  # consecutive steps with a NaN/inf loss before the run is stopped
STOP_MARGIN_S = 3.0  # of the stop budget: for leaving the loop, the end event and the exit
TIMED_STEPS_MIN = 3  # steps measured before the collective timeout follows the step time
STEP_TIMES_KEPT = 100
EVAL_HEARTBEAT_S = 30.0  # an evaluation longer than this says it is still running, this often


class Diverged(UserError):
    """The loss was NaN/inf for NONFINITE_LIMIT consecutive steps."""


class PeerFailed(UserError):
    """Another rank failed with a user error before training; this one stopped with it."""


class Stopped(Exception):
    """SIGTERM: the worker should exit 143; the message says why no checkpoint was written, where
    none was."""


@dataclass
class Plan:
    steps_per_epoch: int
    max_steps: int


@dataclass
class Validation:
    batches: data.Batches
    count: int
    """Micro-batches each rank evaluates."""


class StopSignal:
    """Turns SIGTERM into a flag checked at the step boundary. The stop budget (the planner's, from
    the environment) bounds the rest: a watchdog ends the rank when no boundary comes in time, and
    `too_late` says when the checkpoint would not be written before the budget ends."""

    def __init__(self, on_timeout, budget_s: float):
        self.requested = False
        self.budget_s = budget_s
        self._on_timeout = on_timeout
        self._deadline = math.inf
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        if self.requested:
            return
        self.requested = True
        self._deadline = time.monotonic() + self.budget_s - STOP_MARGIN_S
        timer = threading.Timer(self.budget_s - STOP_MARGIN_S, self._on_timeout)
        timer.daemon = True
        timer.start()

    def too_late(self, save_s: float | None) -> bool:
        """A checkpoint taking `save_s` (the last one's time; None before the first) would not be
        complete before the budget ends."""
        return self.requested and save_s is not None and time.monotonic() + save_s > self._deadline


def _routing(load) -> dict:
    """A MoE window's fields of the `train` event."""
    return {"moe_aux_loss": load.aux_loss, "moe_max_expert_share": load.max_expert_share,
            "moe_expert_tokens": load.expert_tokens}


def best_eval(eval_losses: dict[int, float]) -> tuple[int, float]:
    """(step, eval loss) of the lowest finite eval loss (the earliest among equals); (-1, inf) for none."""
    loss, step = min(((loss, step) for step, loss in eval_losses.items() if math.isfinite(loss)),
                     default=(math.inf, -1))
    return step, loss


def early_stop_due(eval_losses: dict[int, float], interval: int | None) -> bool:
    """Whether the last `interval` evaluations all came after the best one (none was lower)."""
    best_step, _ = best_eval(eval_losses)
    return bool(interval) and sum(1 for step in eval_losses if step > best_step) >= interval


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Tensors and plain data only, so that the file loads with weights_only=True: numpy's key
    array travels as a tensor."""
    numpy_state = np.random.get_state(legacy=False)
    key = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
    state = {"python": random.getstate(), "numpy": {**numpy_state, "state": {**numpy_state["state"], "key": key}},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):  # tuples are numpy's own form, in files written before rng_state used tensors
        numpy_state = {**numpy_state, "state": {**numpy_state["state"],
                                                "key": numpy_state["state"]["key"].numpy().astype(np.uint32)}}
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def legacy_rng_classes() -> list:
    """What rng-rank*.pt files written before rng_state used tensors hold besides plain data: numpy's
    uint32 key array (rebuilt from raw bytes; no other class can be named by the file). The tuple
    form covers files pickled under numpy 1, whose module was numpy.core."""
    reconstruct = np._core.multiarray._reconstruct
    return [reconstruct, (reconstruct, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype,
            type(np.dtype(np.uint32))]


class Trainer:
    def __init__(self, run_dir: Path, spec: JobSpec, dist: Dist, resume: str | None):
        self.run_dir, self.spec, self.dist = Path(run_dir), spec, dist
        self.events = EventWriter(self.run_dir, dist.rank)
        self.resume_ref = resume
        self.skipped_checkpoints: list[str] = []  # newer checkpoints that resume passed over as damaged
        self.step = 0
        self.stop = StopSignal(self._stop_timed_out,
                               float(os.environ.get(STOP_BUDGET_ENV, STOP_BUDGET_S)))
        self.last_save_s: float | None = None
        self.step_times: deque[float] = deque(maxlen=STEP_TIMES_KEPT)
        self.collective_timeout_s = float(spec.ddp_timeout)
        self.stream_skipped = 0
        """This rank's streamed records skipped (strict off) when it last reported them in a `data` event."""

    # ---- setup ---------------------------------------------------------------------------

    def setup(self) -> None:
        spec = self.spec
        if spec.torch_dtype == "float16" and self.dist.device.type == "cpu":
            raise ConfigError("torch_dtype: float16 needs a GPU (CPUs have no fp16 autocast); use bfloat16 or float32")
        seed_everything(spec.seed)
        tp = transformers_plan(spec, self.dist.world_size)
        self.tokenizer, model = prepare(spec, distributed_config(tp) if tp else None)
        self.model_config = getattr(model, "config", None)
        # A vision-language model's image side: its images' token counts when tokenizing, pixels per micro-batch.
        self.images = Images.of(spec.model, self.model_config, spec) if is_vision(self.model_config) else None
        if self.images:
            self.images.bind(model)
        # the language model's (a vision-language model's FLOPs and buckets are counted on it: its tower is small)
        language = getattr(self.model_config, "text_config", None) or self.model_config
        self._pair_sources: list[tuple[data.Batches, Tokenized, np.ndarray]] = []  # made by _batches
        self.batches, self.plan, self.validation = self._load_data()
        self.eval_losses: dict[int, float] = {}  # step -> eval loss, this attempt's and the resumed checkpoints'
        ds_config = (load_ds_config(self.run_dir, spec, self.dist.dp_size, getattr(language, "hidden_size", None),
                                    self.plan.max_steps)
                     if spec.deepspeed else None)
        self.preference = self.reference = None
        if spec.rlhf_type:
            self.preference = PreferenceLoss(spec)
            install(model, self.preference)
        if spec.rlhf_type == "dpo":
            # The frozen copy is taken from the base as loaded, before the engine wraps and moves it.
            # Precomputed: the policy itself (still the base), or ref_model loaded for the pass only when it runs.
            self.reference = (Reference(model, spec.train_type == "lora", flat=spec.padding_free)
                              if spec.precompute_ref_log_probs
                              else Reference.of(model, spec, DTYPES[spec.torch_dtype]))
        self.engine = build_engine(model, spec, self.dist, self.plan.max_steps, ds_config)
        if self.preference:
            self.preference.sequence_group = self.engine.sequence_group
        if self.reference:
            self.reference.place(self.engine, self.dist.device)
        if self.reference and spec.precompute_ref_log_probs:
            self._precompute_reference(model)  # before a checkpoint is loaded: the policy is still the base
            self.reference = None
            self.engine.reference_done()
        self.routers = RouterMeter(model)
        # Different dropout masks per rank from here on (the weights were initialised identically),
        # but one per TP group: its ranks compute on the same activations and must agree. (SP and CP
        # ranks hold different tokens of a sequence.)
        seed_everything(spec.seed + 1000 * (self.dist.rank // spec.tensor_model_parallel_size))
        ckpt = self._resume_checkpoint()
        self.resumed_from = None
        if ckpt is not None:
            self._load(ckpt)
        self.flops_per_token = (flops_per_token(language, spec.max_length)
                                if spec.train_type == "full" and language else None)
        self.peak_flops = peak_flops()

    def _load_data(self) -> tuple["data.Batches | StreamBatches", Plan, "Validation | None"]:
        if self.spec.streaming:
            return self._stream_data()
        spec, d = self.spec, self.dist
        failure, shards = None, None
        try:
            with DataHeartbeat(self.events):
                cache = dataset_cache_dir(spec, self.run_dir)
                tokenized = open_tokenized(spec, self.tokenizer, cache, self.images)
                split = (tokenized.held_out(spec.split_dataset_ratio, spec.seed)
                         if spec.evaluates and not spec.val_dataset else None)
                train = self._shard(tokenized, None if split is None else ~split)
                val = None
                if spec.val_dataset and spec.evaluates:
                    val = self._shard(open_tokenized(spec.model_copy(update={"dataset": spec.val_dataset}),
                                                     self.tokenizer, cache, self.images))
                elif split is not None:
                    val = self._shard(tokenized, split)
            shards = (train, val)
            skipped = [tokenized] + ([val[0]] if val is not None and val[0].entry != tokenized.entry else [])
            self.events.emit("data", phase="ready", cache=str(tokenized.entry), tokenized=tokenized.built,
                             seconds=round(tokenized.seconds, 3), samples=len(train[1]), dropped=train[3],
                             val_samples=len(val[1]) if val else 0, skipped=sum(t.skipped for t in skipped),
                             skipped_first=[m for t in skipped for m in t.skipped_first])
            if d.is_main:
                for entry in skipped:
                    if entry.skipped:
                        log.warning("data: %d records skipped (strict is off), the first: %s", entry.skipped,
                                    "; ".join(entry.skipped_first))
        except data.DataError as exc:
            failure = exc
        self._stop_for_data_errors(failure, "found a bad record")
        (tokenized, mine, rows, dropped), val = shards
        if self.images is not None:
            self._refuse_mixed_images(tokenized, mine, "dataset", trains=True)
            if val is not None:  # evaluation runs the tower through the same collectives
                self._refuse_mixed_images(val[0], val[1], "val_dataset" if spec.val_dataset else "dataset", trains=False)
        # Ranks of one TP, SP or CP group read the same shard: count each shard once.
        (min_rows,), _ = d.all_reduce([len(rows)], "min")
        (total_rows, total_dropped), _ = d.all_reduce([len(rows) / d.same_data_ranks, dropped / d.same_data_ranks], "sum")
        per_epoch = data.steps_per_epoch(int(min_rows), spec.per_device_train_batch_size, spec.gradient_accumulation_steps)
        if per_epoch < 1:
            need = spec.per_device_train_batch_size * spec.gradient_accumulation_steps * d.dp_size
            skipped = (f"; {tokenized.skipped} records were skipped (strict is off), the first: "
                       f"{'; '.join(tokenized.skipped_first)}" if tokenized.skipped else "")
            raise data.DataError(f"dataset: {int(total_rows)} training sequences are fewer than one global batch "
                                 f"({need} = micro-batch × accumulation × {d.dp_size} data-parallel ranks){skipped}")
        if d.is_main:
            log.info("data: %d sequences over %d data-parallel ranks (%d samples dropped: no response left after "
                     "truncation to max_length=%d), %d steps per epoch; tokenized data in %s", total_rows, d.dp_size,
                     total_dropped, spec.max_length, per_epoch, tokenized.entry)
        plan = Plan(per_epoch, data.total_steps(spec.max_steps, spec.num_train_epochs, per_epoch))
        return (self._batches(tokenized, mine, rows, spec.per_device_train_batch_size, per_epoch), plan,
                self._validation(val))

    def _refuse_mixed_images(self, tokenized, mine, field: str, trains: bool) -> None:
        """Records with images beside records without, where a micro-batch without images would
        skip the vision tower that the other ranks run through collectives (FSDP2's and ZeRO-3's
        gathers, FSDP2's reduction of a trained tower's gradients) and hang them, or leave a training
        tower's gradients out of the reduction: refused by name. LoRA on DDP and ZeRO-0/1/2 with the
        tower and aligner frozen run them. Videos too: the model runs the tower once for a
        micro-batch's images and once for its videos, so on those engines every record must carry
        the same media (images, videos, or both)."""
        spec = self.spec
        zero = zero_settings(spec)
        sharded = tower_in_collectives(spec, zero.stage if zero else None)
        kinds = self.images.media_kinds(tokenized.table, mine)
        both = IMAGES + VIDEOS
        counts, _ = self.dist.all_reduce([float((kinds == k).sum()) for k in range(both + 1)], "sum")
        present = {k for k, count in enumerate(counts) if count}
        if len(present) < 2 or self.dist.world_size == 1:  # one rank waits for no other
            return
        media = "image or video" if present & {VIDEOS, both} else "image"
        without, with_media = int(counts[NO_MEDIA]), int(sum(counts) - counts[NO_MEDIA])
        if sharded and NO_MEDIA in present:
            raise data.DataError(f"{field}: {without} records have no {media} beside {with_media} that do: "
                                 "on this engine (FSDP2, ZeRO-3, or full fine-tuning's DDP layout, which runs on "
                                 f"FSDP2) a micro-batch without an {media} would leave the other ranks waiting in the "
                                 f"vision tower; give every record an {media}, or train LoRA on DDP or use ZeRO-0/1/2")
        if sharded:
            found = ", ".join(f"{int(counts[k])} with {name}" for k, name in (
                (IMAGES, "images only"), (VIDEOS, "videos only"), (both, "images and videos")) if counts[k])
            raise data.DataError(f"{field}: records with different media ({found}): on this engine (FSDP2, ZeRO-3, or "
                                 "full fine-tuning's DDP layout, which runs on FSDP2) the vision tower runs once for a "
                                 "micro-batch's images and once for its videos, and a micro-batch with one of them "
                                 "where another rank's has both would leave the ranks waiting in the tower; give every "
                                 "record the same media, or train LoRA on DDP or use ZeRO-0/1/2")
        if trains and NO_MEDIA in present and not (spec.freeze_vit and spec.freeze_aligner):
            raise data.DataError(f"{field}: {without} records have no {media} beside {with_media} that do: "
                                 "with the vision tower or aligner training (freeze_vit or freeze_aligner off), a "
                                 f"micro-batch without an {media} leaves their gradients out of the ranks' reduction; "
                                 f"give every record an {media}, or keep them frozen")

    def _stop_for_data_errors(self, failure: "data.DataError | None", what: str) -> None:
        """Every rank learns about any rank's data error, so all stop before training. The ranks
        read the same data, so they meet the same error: the lowest rank reports it, the others that
        they stopped for it (`what` it did); a rank with an error of its own reports that."""
        error = None if failure is None else str(failure)
        found = [(rank, e) for rank, e in enumerate(self.dist.all_gather_object(error)) if e]
        if error and (found[0][0] == self.dist.rank or error != found[0][1]):
            raise failure
        if found:
            raise PeerFailed(f"stopped: rank {found[0][0]} {what}: {found[0][1]}")

    def _stream_data(self) -> tuple[StreamBatches, Plan, "Validation | None"]:
        """The training data streamed (nothing read before step 1; a bad record stops the run when
        reached, or with strict off one that cannot be encoded is skipped and counted), the
        validation data through the tokenized cache as without streaming."""
        spec, d = self.spec, self.dist
        failure, val = None, None
        try:
            stream = open_stream(spec, self.tokenizer, d.dp_rank, d.dp_size, self.images)
            if spec.val_dataset and spec.evaluates:
                with DataHeartbeat(self.events):
                    val = self._shard(open_tokenized(spec.model_copy(update={"dataset": spec.val_dataset}),
                                                     self.tokenizer, dataset_cache_dir(spec, self.run_dir), self.images))
        except data.DataError as exc:
            failure = exc
        self._stop_for_data_errors(failure, "could not open the data")
        if self.images is not None and val is not None:  # evaluation runs the tower through the same collectives
            self._refuse_mixed_images(val[0], val[1], "val_dataset", trains=False)
        self.stream_ready = dict(phase="ready", streaming=True, val_samples=len(val[1]) if val else 0)
        """The `data` event of the stream, sent again with the records skipped so far where they grow (`_log`)."""
        self.events.emit("data", **self.stream_ready)
        if d.is_main:
            log.info("data: streamed over %d data-parallel ranks, %d steps (max_steps)", d.dp_size, spec.max_steps)
        batches = StreamBatches(stream, d.dp_size, spec.per_device_train_batch_size, spec.gradient_accumulation_steps,
                                self.tokenizer.pad_token_id, spec.packing, spec.max_length, seq_multiple(spec),
                                spec.padding_free)
        batches.media = self.images
        return batches, Plan(spec.max_steps, spec.max_steps), self._validation(val)

    def _precompute_reference(self, model: torch.nn.Module) -> None:
        """DPO's reference log-probs of every training and validation pair, computed in one pass
        where the tokenized cache does not hold them for this model yet, then handed to the loss
        with each micro-batch (`precompute_ref_log_probs`)."""
        d, spec, reference = self.dist, self.spec, self.reference
        for batches, tokenized, mine in self._pair_sources:
            # Rank 0 names the file for all (the model files' times differ between nodes' own copies);
            # a model directory it cannot read stops every rank, none waits in the collective below.
            named = None
            if d.is_main:
                try:
                    named = (str(reference_file(tokenized.entry, spec)), None)
                except OSError as exc:
                    field = "ref_model" if spec.ref_model else "ref_adapters" if spec.ref_adapters else "model"
                    named = (None, f"{field}: cannot read its files to key the precomputed reference log-probs ({exc})")
            path, error = d.all_gather_object(named)[0]
            if error:
                raise ModelError(error)
            path = Path(path)
            table = load_reference_table(path, tokenized.table.num_rows)
            (missing,), _ = d.all_reduce([float(not np.isfinite(table[mine]).all())], "max")
            if missing:
                started = time.perf_counter()
                if (spec.ref_model or spec.ref_adapters) and reference is self.reference:  # loaded now it is needed
                    reference = Reference.of(model, spec, DTYPES[spec.torch_dtype]).place(self.engine, d.device)
                (count,), _ = d.all_reduce([math.ceil(len(batches.plan) / batches.micro_batch)], "max")
                was_training = model.training
                model.eval()
                with DataHeartbeat(self.events):
                    computed = precompute(batches, int(count), partial(self.engine.reference_logps, reference),
                                          self.engine.micro_batches_per_forward, d.device)
                model.train(was_training)
                gathered = d.all_gather_object((mine, computed))
                # Kept, they would be computed again by every run, and train NaN losses in this one.
                if bad := nonfinite_pairs(gathered):
                    raise ModelError(nonfinite_message(bad, len(table), tokenized.entry, spec))
                for ids, values in gathered:
                    table[ids] = values
                if d.is_main:
                    save_reference_table(path, table)
                    log.info("reference log-probs of %d pairs computed in %.1f s, kept in %s",
                             sum(len(ids) for ids, _ in gathered) // d.same_data_ranks, time.perf_counter() - started,
                             path)
            elif d.is_main:
                log.info("reference log-probs read from %s", path)
            batches.reference = lambda members, table=table, mine=mine: table[mine[members]]
        if reference is not self.reference:  # the loaded reference model: freed before training takes the memory
            del reference
            gc.collect()
            if d.device.type == "cuda":
                torch.cuda.empty_cache()

    def _shard(self, tokenized, among=None) -> tuple:
        """(the data, this rank's rows of it, their row plan, how many of its records were dropped)."""
        mine, dropped = tokenized.shard(self.dist.dp_rank, self.dist.dp_size, among)
        rows = (data.pack_plan(tokenized.lengths(mine), self.spec.max_length) if self.spec.packing
                else data.one_per_row(len(mine)))
        return tokenized, mine, rows, dropped

    def _batches(self, tokenized, mine, rows, micro_batch: int, steps_per_epoch: int = 1) -> data.Batches:
        spec = self.spec
        batches = data.Batches(lambda members: tokenized.samples(mine[members]), rows, micro_batch,
                               spec.gradient_accumulation_steps, steps_per_epoch, spec.seed, self.tokenizer.pad_token_id,
                               spec.packing, spec.max_length, seq_multiple(spec), pairs=spec.rlhf_type is not None,
                               flat=spec.padding_free)
        batches.media = self.images
        self._pair_sources.append((batches, tokenized, mine))
        return batches

    def _validation(self, val: tuple | None) -> "Validation | None":
        """Every rank evaluates as many micro-batches: the fewest any rank's share makes."""
        if val is None:
            return None
        spec, d = self.spec, self.dist
        size = spec.per_device_eval_batch_size or spec.per_device_train_batch_size
        (count,), _ = d.all_reduce([math.ceil(len(val[2]) / size)], "min")
        if count < 1:
            raise data.DataError(f"{'val_dataset' if spec.val_dataset else 'split_dataset_ratio'}: too little "
                                 f"validation data for every one of the {d.dp_size} data-parallel ranks to have a "
                                 "sequence; give more, or a larger split_dataset_ratio")
        return Validation(self._batches(*val[:3], micro_batch=size), int(count))

    def _resume_checkpoint(self) -> Path | None:
        ref = self.resume_ref or self.spec.resume_from_checkpoint
        if ref is None:
            return None
        # Rank 0 alone reads and hashes the files (the run directory is shared); every rank takes its answer.
        found, error = None, None
        if self.dist.is_main:
            try:
                found = checkpoint.resolve(self.run_dir, ref)
            except checkpoint.CheckpointError as exc:
                error = str(exc)
        found, error = self.dist.all_gather_object((found, error))[0]
        if error:
            raise ConfigError(f"resume: {error}")
        self.skipped_checkpoints = list(found.skipped)
        if self.dist.is_main:
            for reason in found.skipped:
                log.warning("resume: skipped a damaged checkpoint: %s", reason)
            if found.path is None:
                log.info("resume: no complete checkpoint in %s; starting from step 0", self.run_dir)
            elif not found.verified:
                log.warning("resume: %s/%s has no checksums (an older format); loading it unverified",
                            found.path, checkpoint.MARKER)
        return found.path

    # ---- checkpoints ---------------------------------------------------------------------

    def _save(self) -> Path:
        d, step = self.dist, self.step
        tmp = checkpoint.tmp_dir(self.run_dir, step)
        if d.is_main:
            checkpoint.prepare(self.run_dir, step)
        d.barrier()
        self.engine.save(tmp, d.is_main)
        torch.save(rng_state(), tmp / f"rng-rank{d.rank}.pt")
        if self.spec.streaming:
            save_position(self.batches, step, tmp, d.rank)
        if d.is_main:
            self.tokenizer.save_pretrained(tmp / "tokenizer")
            shutil.copy(self.run_dir / "job.yaml", tmp / "job.yaml")
            state = {"step": step, "epoch": step / self.plan.steps_per_epoch, "steps_per_epoch": self.plan.steps_per_epoch,
                     "max_steps": self.plan.max_steps, "world_size": d.world_size, **self._layout(),
                     "engine": self.engine.name, "optimizer_state": self.engine.optimizer_state,
                     "train_type": self.spec.train_type, "base_model": self.spec.model,
                     "eval_loss": self.eval_losses.get(step),
                     "eval_losses": {str(k): v for k, v in self.eval_losses.items()}}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        d.barrier()
        final = checkpoint.final_dir(self.run_dir, step)
        if d.is_main:
            final = checkpoint.publish(tmp, step)
            for gone in checkpoint.prune(self.run_dir, self.spec.save_total_limit, checkpoint.best(self.run_dir)):
                log.info("deleted old checkpoint %s (save_total_limit=%s)", gone, self.spec.save_total_limit)
            evaluated = {"eval_loss": self.eval_losses[step]} if step in self.eval_losses else {}
            self.events.emit("checkpoint", step=step, path=str(final), **split_nonfinite(**evaluated)[0])
            log.info("saved %s", final)
        d.barrier()
        return final

    def _layout(self) -> dict[str, int]:
        return {field: getattr(self.spec, field)
                for field in ("tensor_model_parallel_size", "sequence_parallel_size", "context_parallel_size",
                              "expert_model_parallel_size", "pipeline_model_parallel_size",
                              "virtual_pipeline_model_parallel_size")}

    def _load(self, path: Path) -> None:
        state = json.loads((path / "trainer_state.json").read_text())
        if state["world_size"] != self.dist.world_size and not self.engine.reshards:
            raise ConfigError(f"resume: {path} was written by {state['world_size']} ranks and {self.engine.name} "
                              f"cannot reshard it onto {self.dist.world_size}; resume with the same number of GPUs")
        written = {field: state.get(field, 1) for field in self._layout()}  # absent in files from before TP/SP
        if written != self._layout() and not self.engine.reshards:
            raise ConfigError(f"resume: {path} was written with {written} and {self.engine.name} cannot reshard it "
                              f"onto {self._layout()}; resume with the layout it was written with")
        if state.get("optimizer_state", "nested") != self.engine.optimizer_state:
            # Only a pipeline keys its optimizer state per parameter.
            raise ConfigError(f"resume: {path} was written by the {state.get('engine')} engine and this job runs "
                              f"{self.engine.name}: a pipeline's checkpoint resumes only with "
                              "pipeline_model_parallel_size > 1, and only such a job resumes from one")
        if state["train_type"] != self.spec.train_type:
            raise ConfigError(f"resume: {path} is a {state['train_type']} checkpoint but train_type is {self.spec.train_type}")
        try:
            self.engine.load(path)
            rng = path / f"rng-rank{self.dist.rank}.pt"
            if rng.is_file():  # absent when the world size grew
                set_rng_state(checkpoint.read(rng, allowed=legacy_rng_classes()))
        except checkpoint.CheckpointError as exc:
            raise ConfigError(f"resume: {exc}") from None
        if self.spec.streaming:
            load_position(self.batches, state["step"], path, self.dist.rank)
        self.step = self.resumed_from = state["step"]
        self.eval_losses = {int(k): float(v) for k, v in (state.get("eval_losses") or {}).items()}
        if self.dist.is_main:
            log.info("resumed from %s at step %d", path, self.step)

    # ---- loop ----------------------------------------------------------------------------

    def train(self) -> None:
        d, spec, plan = self.dist, self.spec, self.plan
        if d.is_main:
            self.events.emit("start", world_size=d.world_size, max_steps=plan.max_steps, resumed_from=self.resumed_from,
                             skipped_checkpoints=self.skipped_checkpoints, attempt_pid=os.getpid())
        window, pending, nonfinite_run = Window(), [], 0
        window_losses: list[float] = []
        upcoming, data_wait = self._fetch(self.step) if self.step < plan.max_steps else ([], 0.0)
        if spec.streaming and d.all_reduce([float(upcoming is None)], "max")[0][0]:
            self._data_ended(upcoming is None)
        while self.step < plan.max_steps:
            started = time.perf_counter()
            micro, step_data_wait = upcoming, data_wait
            batches = self._with_references([batch for batch, _, _ in micro])
            losses = [self._forward_backward(batch, sync=i == len(batches) - 1) for i, batch in enumerate(batches)]
            if self.preference and self.preference.references:  # each loss takes its micro-batch's, in order
                raise RuntimeError(f"{len(self.preference.references)} micro-batches' reference log-probs were left "
                                   f"by the losses of step {self.step + 1}: the engine computed fewer losses")
            grad_norm = self.engine.step()
            pending.append((torch.stack(losses).float().mean(), grad_norm))
            self.step += 1
            # The next step's batches are collated while the device still runs this one (their
            # copies queue behind it), before anything below waits for the device.
            if self.step < plan.max_steps:
                upcoming, data_wait = self._fetch(self.step)
            # A stop is one decision of all ranks: to stop, and whether the checkpoint still fits.
            # A stream that ended or met a bad record on any rank ends the run, after a checkpoint.
            (stop_votes, late, ended), wait = d.all_reduce([float(self.stop.requested),
                                                            float(self.stop.too_late(self.last_save_s)),
                                                            float(upcoming is None)], "max")
            self.step_times.append(time.perf_counter() - started)
            window.add(self.step_times[-1], wait, step_data_wait, sum(m[1] for m in micro), sum(m[2] for m in micro))
            due_eval = self.validation is not None and (self.step % (spec.eval_steps or spec.save_steps) == 0
                                                        or self.step == plan.max_steps)
            # An eval step is logged too, so its eval loss is drawn at its own step.
            is_log = self.step % spec.logging_steps == 0 or self.step == plan.max_steps or due_eval
            if is_log or len(pending) >= NONFINITE_LIMIT:
                step_losses, norms = self._reduce_pending(pending)
                pending = []
                for loss in step_losses:
                    nonfinite_run = 0 if math.isfinite(loss) else nonfinite_run + 1
                if nonfinite_run >= NONFINITE_LIMIT:
                    raise Diverged(self._divergence_message(nonfinite_run))
                window_losses += step_losses
                self.last_grad_norm = norms[-1]
            if is_log:
                self._log(window, window_losses)
                window, window_losses = Window(), []
                self._follow_step_time()
            early = due_eval and self._evaluate()
            due = spec.save_strategy == "steps" and (self.step % spec.save_steps == 0 or self.step == plan.max_steps
                                                     or early)
            if stop_votes and late:
                # (every rank has saved as often: the vote is late only where the last save time is known)
                raise Stopped(self._no_checkpoint_message(f"a checkpoint takes about {self.last_save_s or 0:.0f} s, "
                                                          "more than is left of the"))
            if stop_votes or due or ended:
                saving = time.perf_counter()
                self._save_under_ddp_timeout()
                self.last_save_s = time.perf_counter() - saving
                # tokens/s and MFU measure training, not checkpoint writes.
                window.started += self.last_save_s
            if stop_votes:
                raise Stopped()
            if ended:
                self._data_ended(upcoming is None)
            if early:
                if d.is_main:
                    best_step, best_loss = best_eval(self.eval_losses)
                    log.info("early stop at step %d: no lower eval loss in the last %d evaluations (best %.4f at "
                             "step %d)", self.step, spec.early_stop_interval, best_loss, best_step)
                    self.events.emit("early_stop", step=self.step, best_step=best_step, best_eval_loss=best_loss)
                return

    def _data_ended(self, missing: bool) -> None:
        """Every rank stops where a rank's stream ended before max_steps or met a bad record
        (`missing`: this rank's next step has no data): the lowest such rank says which, the others
        that they stopped for it."""
        d = self.dist
        ends = d.all_gather_object((self.batches.error, self.batches.records, self.batches.dropped, missing))
        rank, (error, records, dropped, _) = next((r, end) for r, end in enumerate(ends) if end[0] or end[3])
        if rank != d.rank:
            raise PeerFailed(f"stopped: rank {rank} {'found a bad record' if error else 'ran out of data'}")
        if error:
            raise data.DataError(error)
        kept = f"; checkpoint-{self.step} keeps the steps trained" if self.step else ""
        raise data.DataError(f"dataset: the data ended at step {self.step} of max_steps={self.plan.max_steps}: "
                             f"data-parallel rank {d.dp_rank}'s share of {', '.join(self.spec.dataset)} has no more "
                             f"records for a step ({records} read, {dropped} of them with no response left within "
                             f"max_length){kept}; give more data or a lower max_steps")

    def _evaluate(self) -> bool:
        """The eval loss at this step, over every rank's validation share (an `eval` event, kept with
        the next checkpoint); True when early_stop_interval evaluations in a row found none lower
        than the best before them."""
        spec, d, val = self.spec, self.dist, self.validation
        started = beat = time.perf_counter()
        loss_sum, predicted = 0.0, 0
        for done, (batch, _, pairs) in enumerate(val.batches.in_order(val.count), 1):
            # the real pairs (a padding_free micro-batch is one row of them), or the predicted tokens
            count = pairs if self.preference else int((batch["labels"][:, 1:] != data.IGNORE).sum())
            loss = self.engine.evaluate(self._with_references([{k: v.to(d.device) for k, v in batch.items()}])[0])
            loss_sum, predicted = loss_sum + float(loss) * count, predicted + count
            if d.is_main and time.perf_counter() - beat > EVAL_HEARTBEAT_S:  # the hang watch sees it working
                self.events.emit("eval_progress", step=self.step, batches=done, of=val.count)
                beat = time.perf_counter()
        # An SP, CP or TP group's ranks add the same loss and count: the mean is unchanged.
        (loss_sum, predicted), _ = d.all_reduce([loss_sum, float(predicted)], "sum")
        self.eval_losses[self.step] = loss_sum / predicted if predicted else float("nan")
        if d.is_main:
            values, nonfinite = split_nonfinite(eval_loss=self.eval_losses[self.step])
            self.events.emit("eval", step=self.step, **values, nonfinite=nonfinite,
                             tokens=int(predicted), seconds=round(time.perf_counter() - started, 3))
            log.info("step %d eval loss %.4f (%d tokens, %.1f s)", self.step, self.eval_losses[self.step],
                     predicted, time.perf_counter() - started)
        return early_stop_due(self.eval_losses, spec.early_stop_interval)

    def _follow_step_time(self) -> None:
        """Set the collective timeout from the measured step time (backend.job.limits), where it
        moved by more than a tenth. Called right after the logging all-reduce, which every rank
        has passed: none is still waiting in a collective issued under the old limit."""
        if len(self.step_times) < TIMED_STEPS_MIN:
            return
        seconds = collective_timeout_s(self.spec, self.step_times)
        if abs(seconds - self.collective_timeout_s) <= 0.1 * self.collective_timeout_s:
            return
        self.dist.set_collective_timeout(seconds)
        self.collective_timeout_s = seconds
        if self.dist.is_main:
            step_s = float(np.median(self.step_times))
            self.events.emit("collective_timeout", step=self.step, timeout_s=seconds, step_time_s=step_s)
            log.info("collective timeout %.0f s (median step %.3g s; hang_timeout_s %g, hang_step_multiple %g, "
                     "ddp_timeout %d)", seconds, step_s, self.spec.hang_timeout_s, self.spec.hang_step_multiple,
                     self.spec.ddp_timeout)

    def _save_under_ddp_timeout(self) -> None:
        """A checkpoint's collectives (rank 0 writes while the others wait) get ddp_timeout, not
        the step-time limit."""
        tuned = self.collective_timeout_s != self.spec.ddp_timeout
        if tuned:
            self.dist.set_collective_timeout(self.spec.ddp_timeout)
        try:
            self._save()
        finally:
            if tuned:
                self.dist.set_collective_timeout(self.collective_timeout_s)

    def _with_references(self, batches: list[dict]) -> list[dict]:
        """Preference training: the micro-batches' reference log-probs (precomputed, or computed now
        as the engine computes a forward) queued for their losses, where this rank computes them."""
        if self.preference is None:
            return batches
        if "reference_logps" in batches[0]:
            batches = [dict(batch) for batch in batches]
            references = [batch.pop("reference_logps") for batch in batches]
        elif self.reference is not None:
            references = self.engine.reference_logps(self.reference, batches)
        else:  # an algorithm without a reference
            return batches
        if self.engine.computes_loss:
            for reference in references:
                self.preference.expect(reference)
        return batches

    def _forward_backward(self, batch: dict, sync: bool) -> torch.Tensor:
        if not self.routers.active:
            return self.engine.forward_backward(batch, sync)
        self.routers.start(batch)
        loss = self.engine.forward_backward(batch, sync)
        self.routers.finish()
        return loss

    def _fetch(self, step: int) -> tuple[list[tuple[dict, int, int]] | None, float]:
        """Micro-batches of `step` on the device, and the host seconds it took. On GPUs the host
        tensors are pinned so the copies are asynchronous (a pageable copy would wait for the
        device to finish the work queued before it)."""
        started = time.perf_counter()
        device = self.dist.device
        pin = device.type == "cuda"
        batches = self.batches.step(step)  # None: a stream that ended, or met a bad record
        micro = None if batches is None else [
            ({k: (v.pin_memory() if pin else v).to(device, non_blocking=True) for k, v in batch.items()}, tokens, samples)
            for batch, tokens, samples in batches]
        return micro, time.perf_counter() - started

    def _reduce_pending(self, pending) -> tuple[list[float], list[float]]:
        """Global mean loss per step and grad norms: one device→host copy for the whole window."""
        values = torch.stack([torch.stack([loss, torch.as_tensor(norm, dtype=torch.float32, device=loss.device).reshape(())])
                              for loss, norm in pending]).cpu()
        summed, _ = self.dist.all_reduce(values[:, 0].tolist(), "sum")
        return [v / self.dist.world_size for v in summed], values[:, 1].tolist()

    def _divergence_message(self, run: int) -> str:
        last = checkpoint.latest(self.run_dir)
        return (f"loss was NaN/inf for {run} consecutive steps (up to step {self.step}); stopping. "
                f"Last complete checkpoint: {last or 'none'}. Try a lower learning_rate, bfloat16 instead of float16, "
                f"or check the data")

    def _log(self, window: Window, losses: list[float]) -> None:
        d, plan = self.dist, self.plan
        means = window.means()
        elapsed = max(time.perf_counter() - window.started, 1e-9)
        # A TP, SP or CP group's ranks all process the same tokens (and stream the same records): count them once.
        streamed_skips = self.batches.skipped if self.spec.streaming else 0
        (tokens, samples, skipped), _ = d.all_reduce(
            [window.tokens / d.same_data_ranks, window.samples / d.same_data_ranks, streamed_skips / d.same_data_ranks],
            "sum")
        preference = PreferenceLoss.means(d.all_reduce(self.preference.take(), "sum")[0]) if self.preference else {}
        load = self.routers.take(d)
        allocated, peak = memory_gib()
        # every rank's peak: the Monitor sets them against the estimate (a pipeline's stages differ)
        self.events.emit("timing", rank=d.rank, step=self.step, **means, **self.engine.timing_fields(window.steps),
                         mem_peak_gib=peak)
        if streamed_skips != self.stream_skipped:
            # the rank that skipped says so: the count over the ranks, the reasons its own (the
            # Monitor shows the latest `data` event of any rank)
            self.stream_skipped = streamed_skips
            self.events.emit("data", **self.stream_ready, skipped=round(skipped), skipped_first=self.batches.skipped_first)
        if not d.is_main:
            return
        tokens_per_s = tokens / elapsed
        mfu = (self.flops_per_token * tokens_per_s / (self.peak_flops * d.world_size)
               if self.flops_per_token and self.peak_flops else None)
        loss = sum(losses) / len(losses) if losses else float("nan")
        eta = eta_seconds(self.step, plan.max_steps, means["step_time_s"])
        values, nonfinite = split_nonfinite(loss=loss, grad_norm=self.last_grad_norm)
        self.events.emit("train", step=self.step, epoch=self.step / plan.steps_per_epoch, **values,
                         learning_rate=self.engine.lr(),
                         tokens=round(tokens), tokens_per_s=tokens_per_s, samples_per_s=samples / elapsed,
                         step_time_s=means["step_time_s"],
                         mfu=mfu, mem_allocated_gib=allocated, mem_peak_gib=peak, max_steps=plan.max_steps, eta_s=eta,
                         nonfinite=nonfinite, **(_routing(load) if load else {}), **preference)
        log.info("step %d/%d loss %.4f lr %.3g grad_norm %.3g %.0f tok/s eta %s", self.step, plan.max_steps, loss,
                 self.engine.lr(), self.last_grad_norm, tokens_per_s, format_duration(eta))

    # ---- ending --------------------------------------------------------------------------

    def end(self, status: str, error: str | None) -> None:
        if self.dist.is_main:
            self.events.emit("end", status=status, step=self.step, error=error)
        self.events.close()

    def _no_checkpoint_message(self, why: str) -> str:
        last = checkpoint.latest(self.run_dir)
        return (f"stopped at step {self.step} without a checkpoint: {why} {self.stop.budget_s:.0f} s stop budget; "
                f"a resume starts from {last or 'step 0 (no complete checkpoint)'}")

    def _stop_timed_out(self) -> None:
        """SIGTERM could not be honoured at a step boundary within the stop budget (a long step or
        a peer that is gone): record it and leave without a checkpoint."""
        message = self._no_checkpoint_message("no step boundary came within the")
        log.error("%s", message)
        try:
            self.end("stopped", message)
        finally:
            os._exit(143)
