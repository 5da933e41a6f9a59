"""Preference training (`rlhf_type`): DPO's loss family, CPO, SimPO and ORPO on chosen/rejected pairs.

A micro-batch holds its pairs' chosen rows first, then their rejected rows (one forward for both,
as TRL's concatenated forward). The loss is installed as the policy model's loss function
(transformers' `loss_function`), so every engine keeps calling `model(**batch).loss`; the
reference log-probs of the micro-batch (DPO) are computed just before, without gradients: the
policy with its LoRA adapters turned off, or a frozen copy of the base model taken before
training. CPO, SimPO and ORPO need no reference. The arithmetic is TRL's DPOTrainer's, CPOTrainer's
and ORPOTrainer's (ORPO's NLL on the answer tokens, as ms-swift runs it; tests/test_preference.py
compares loss, rewards and gradients with them)."""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import secrets
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from launcher.data import IGNORE

log = logging.getLogger(__name__)

METRICS = ("rewards_chosen", "rewards_rejected", "rewards_margins", "rewards_accuracies", "logps_chosen",
           "logps_rejected")
"""The `train` event's preference fields: means over the logging window's pairs (rewards are
beta x the log-prob ratio to the reference, summed over each answer's tokens)."""


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, shifted: bool = False,
                   flat: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed log-prob of its labelled tokens (the answer) and how many there are.
    `shifted`: labels[i] is what logits[i] predicts (a Ulysses slice's labels, shifted over the whole row).
    `flat` (padding_free): the rows hold answers end to end, each a run of labelled tokens between
    unlabelled ones (its prompt, or the first token of the next sample); each run's sums, in order."""
    if not shifted:  # the last position predicts nothing: the logits stay whole, their gradient too
        labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    mask = labels != IGNORE
    token_logps = TokenLogps.apply(logits, torch.where(mask, labels, 0)) * mask
    if not flat:
        return token_logps.sum(-1), mask.sum(-1)
    starts = mask & ~F.pad(mask[:, :-1], (1, 0), value=False)
    runs = (starts.flatten().cumsum(0) - 1).view_as(mask)[mask]
    count = int(starts.sum())  # waits for the device, as flash-attention's varlen lengths do
    return (token_logps.new_zeros(count).index_add(0, runs, token_logps[mask]),
            torch.bincount(runs, minlength=count))


class TokenLogps(torch.autograd.Function):
    """Each position's float32 log-prob of its label, from 16-bit logits (rows x tokens x vocabulary)
    one row at a time: the float32 log-softmax of a row lives only while its labels' entries are
    picked, and backward computes the row's softmax again, writing its gradient straight into the
    logits' dtype. So autograd keeps the logits alone, not a float32 copy (for a micro-batch of 16
    1024-token rows and a 152K vocabulary that copy was 10 GiB), and a row takes a log-softmax
    forward and a softmax and a product backward: a float32 logsumexp per row, checkpointed, took
    ~140 ms of three precomputed DPO steps' 889 ms of device time, where TRL's bf16 log-softmax took
    30 (bench/results/h100-dpo-precompute-profile-*.txt)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        picked = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
        for row, (row_logits, row_labels) in enumerate(zip(logits, labels)):
            picked[row] = torch.log_softmax(row_logits, -1, dtype=torch.float32).gather(-1, row_labels[:, None])[:, 0]
        ctx.save_for_backward(logits, labels)
        return picked

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # d log p(label) / d logits = onehot(label) - softmax(logits)
        logits, labels = ctx.saved_tensors
        out = torch.empty_like(logits)
        for row, (row_logits, row_labels) in enumerate(zip(logits, labels)):
            probs = torch.softmax(row_logits, -1, dtype=torch.float32)
            scale = grad[row, :, None].float()
            at_label = (1 - probs.gather(-1, row_labels[:, None])) * scale
            torch.mul(probs, -scale, out=out[row])
            out[row].scatter_(-1, row_labels[:, None], at_label.to(out.dtype))
        return out, None


def group_logps(logits: torch.Tensor, shift_labels: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logps` of whole rows from a Ulysses group's slices: each rank's sums added over the
    group (through autograd: each slice's tokens get the whole row's gradient)."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_fn

    logps, tokens = sequence_logps(logits, shift_labels, shifted=True)
    dist.all_reduce(tokens, group=group)
    return (dist_fn.all_reduce(logps, group=group) if logps.requires_grad else _summed(logps, group)), tokens


def _summed(values: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(values, group=group)
    return values


def preference_losses(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
                      chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, spec) -> torch.Tensor:
    """Each pair's DPO loss for `spec.loss_type` (TRL's formulas; sigmoid with label_smoothing is cDPO)."""
    beta, smoothing = spec.preference_beta, spec.label_smoothing
    delta = (chosen - ref_chosen) - (rejected - ref_rejected)
    if spec.loss_type == "sigmoid":
        return -(1 - smoothing) * F.logsigmoid(beta * delta) - smoothing * F.logsigmoid(-beta * delta)
    if spec.loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if spec.loss_type == "ipo":  # per-token averaged log-ratios, as TRL (and the IPO authors) do
        per_token = ((chosen - ref_chosen) / chosen_tokens.clamp(min=1)
                     - (rejected - ref_rejected) / rejected_tokens.clamp(min=1))
        return (per_token - 1 / (2 * beta)) ** 2
    if spec.loss_type == "robust":
        return ((-(1 - smoothing) * F.logsigmoid(beta * delta) + smoothing * F.logsigmoid(-beta * delta))
                / (1 - 2 * smoothing))
    raise ValueError(f"loss_type {spec.loss_type}")


def reference_free_losses(chosen: torch.Tensor, rejected: torch.Tensor, spec) -> torch.Tensor:
    """Each pair's CPO, SimPO or ORPO loss on the policy's own log-probs (TRL's CPOTrainer and
    ORPOTrainer; SimPO's, ORPO's and IPO's per token): no reference model."""
    beta, smoothing = spec.preference_beta, spec.label_smoothing
    delta = chosen - rejected
    if spec.rlhf_type == "orpo":  # the log odds ratio, odds = p / (1 - p) of the mean token probability
        return -beta * F.logsigmoid(delta - (log1mexp(chosen) - log1mexp(rejected)))
    if spec.rlhf_type == "simpo":
        delta = delta - spec.simpo_gamma / beta
    if spec.rlhf_type == "simpo" or spec.loss_type == "sigmoid":
        return -(1 - smoothing) * F.logsigmoid(beta * delta) - smoothing * F.logsigmoid(-beta * delta)
    if spec.loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if spec.loss_type == "ipo":
        return (delta - 1 / (2 * beta)) ** 2
    raise ValueError(f"loss_type {spec.loss_type} with rlhf_type {spec.rlhf_type}")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -log 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def per_token(spec) -> bool:
    """Whether the algorithm compares answers by their mean token log-prob (SimPO, ORPO, CPO's IPO), not their sum."""
    return spec.rlhf_type in ("simpo", "orpo") or (spec.rlhf_type == "cpo" and spec.loss_type == "ipo")


class PreferenceLoss:
    """The policy's loss function during preference training. `expect` queues each micro-batch's
    reference log-probs (chosen rows, then rejected) before its loss is computed, oldest first (a
    pipeline's schedule computes the losses of a step's micro-batches after all were handed in);
    `totals` adds up what the logging window's pairs did."""

    def __init__(self, spec):
        self.spec = spec
        self.references: list[torch.Tensor] = []
        self.totals: torch.Tensor | None = None
        # the engine's `sequence_group` (Ulysses SP, ring CP): each rank holds a part of every row
        self.sequence_group = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, shift_labels: torch.Tensor | None = None,
                 **_) -> torch.Tensor:
        spec = self.spec
        group = self.sequence_group
        if group is None:
            logps, tokens = sequence_logps(logits, labels, flat=spec.padding_free)
            if len(logps) % 2:  # padding_free: a row's answers are told apart by their runs of labels alone
                raise RuntimeError(f"padding_free: {len(logps)} answers in a micro-batch of pairs; each pair's answer "
                                   "should be one run of labelled tokens")
        else:
            logps, tokens = group_logps(logits, shift_labels, group.group)
        chosen, rejected = logps.chunk(2)
        chosen_tokens, rejected_tokens = tokens.chunk(2)
        # Rows that only fill a micro-batch to its size (evaluation's last one) carry no labels.
        real = chosen_tokens > 0
        # The chosen answers' mean token NLL: DPO's rpo_alpha term (TRL's "sft" loss), CPO's, SimPO's and ORPO's own.
        nll = -chosen[real].sum() / chosen_tokens[real].sum()
        if spec.rlhf_type == "dpo":
            if not self.references:
                raise RuntimeError("the preference loss was called without the micro-batch's reference log-probs")
            ref_chosen, ref_rejected = self.references.pop(0).to(logps.device).chunk(2)
            losses = preference_losses(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens, spec)
            weight = spec.rpo_alpha
        else:
            if per_token(spec):
                chosen, rejected = chosen / chosen_tokens.clamp(min=1), rejected / rejected_tokens.clamp(min=1)
            ref_chosen = ref_rejected = torch.zeros_like(chosen)
            losses = reference_free_losses(chosen, rejected, spec)
            weight = 1.0 if spec.rlhf_type == "orpo" else spec.cpo_alpha or None
        loss = losses[real].mean() + (weight * nll if weight is not None else 0)
        if group is not None:
            # Every rank of the group holds the whole loss; the engine adds up the ranks' shares.
            loss = loss / group.size
        if not torch.is_grad_enabled():  # an evaluation: its loss is reported on its own
            return loss
        with torch.no_grad():
            beta = spec.preference_beta
            rewards_chosen, rewards_rejected = beta * (chosen - ref_chosen)[real], beta * (rejected - ref_rejected)[real]
            # Summed on the device: reading them here would wait for the device every micro-batch.
            sums = torch.stack([real.sum().float(), rewards_chosen.sum(), rewards_rejected.sum(),
                                (rewards_chosen - rewards_rejected).sum(), (rewards_chosen > rewards_rejected).sum().float(),
                                chosen[real].sum(), rejected[real].sum()]).double()
            self.totals = sums if self.totals is None else self.totals + sums
        return loss

    def expect(self, reference_logps: torch.Tensor) -> None:
        """The reference log-probs of the next micro-batch whose loss is computed."""
        self.references.append(reference_logps)

    def take(self) -> list[float]:
        """The window's sums (pairs, then METRICS), cleared: all-reduced, then `means`."""
        totals, self.totals = self.totals, None
        return totals.tolist() if totals is not None else [0.0] * (1 + len(METRICS))

    @staticmethod
    def means(sums: list[float]) -> dict[str, float]:
        pairs, *values = sums
        return {key: value / pairs for key, value in zip(METRICS, values)} if pairs else {}


class Reference:
    """The reference model's log-probs of a micro-batch: the policy with its adapters off (LoRA),
    else a frozen copy of the base model as loaded (taken before the engine wraps the policy, so a
    resume compares against the base, not against the resumed weights), placed by the engine:
    sharded as the policy under FSDP2 and ZeRO-3, whole on each rank under DDP's layout and ZeRO-0/1/2.
    `frozen`: full fine-tuning's reference model where it is not the policy itself (which it is
    while the log-probs are precomputed, before any step or checkpoint: `Reference.of`)."""

    def __init__(self, policy: torch.nn.Module, lora: bool, frozen: torch.nn.Module | None = None, flat: bool = False):
        self.policy, self.lora, self.frozen = policy, lora, frozen
        self.flat = flat  # padding_free micro-batches: one row of answers end to end

    @classmethod
    def of(cls, policy: torch.nn.Module, spec, dtype: torch.dtype) -> "Reference":
        """DPO's reference for `spec`: LoRA's adapters off, or the model as loaded with `ref_adapters`
        merged in; full fine-tuning's `ref_model` loaded in `dtype` (its vocabulary checked against
        the policy's), else a copy of the base as loaded."""
        if spec.ref_adapters:
            from launcher.model import load_adapter, load_model

            merged = load_adapter(load_model(spec, dtype), spec.ref_adapters[0], "ref_adapters", trainable=False)
            return cls(policy, lora=False, frozen=merged.merge_and_unload().requires_grad_(False).eval(),
                       flat=spec.padding_free)
        if spec.train_type == "lora":
            return cls(policy, lora=True, flat=spec.padding_free)
        if spec.ref_model:
            from launcher.model import ModelError, load_model

            try:
                frozen = load_model(spec.model_copy(update={"model": spec.ref_model}), dtype)
            except ModelError as exc:  # it names `model`, the field it was loaded through
                raise ModelError(f"ref_model: {str(exc).removeprefix('model: ')}") from None
            if frozen.config.vocab_size != policy.config.vocab_size:
                raise ModelError(f"ref_model: {spec.ref_model} has a vocabulary of {frozen.config.vocab_size} tokens, "
                                 f"{spec.model} one of {policy.config.vocab_size}: DPO compares both models' log-probs "
                                 "of the same tokens")
        else:
            frozen = copy.deepcopy(policy).to(dtype)
        return cls(policy, lora=False, frozen=frozen.requires_grad_(False).eval(), flat=spec.padding_free)

    def place(self, engine, device: torch.device) -> "Reference":
        """The frozen copy placed as `engine` places a model (FSDP2 shards it as the policy)."""
        if self.frozen is not None:
            self.frozen = engine.frozen(self.frozen, device)
        return self

    def adapters_off(self):
        """The context in which the policy computes as the reference (LoRA: its adapters off)."""
        return self.policy.disable_adapter() if self.lora else nullcontext()

    @torch.no_grad()
    def logps(self, batch: dict, context=None, group=None) -> torch.Tensor:
        """`context`: the engine's forward context (`Engine.forward_context`), so the reference
        computes as the policy's forward does; `group`: the engine's `sequence_group` (Ulysses SP,
        ring CP), whose ranks each run their part of every row."""
        with group.sharded(batch) if group is not None else nullcontext(batch) as part:
            inputs = {k: v for k, v in part.items() if k not in ("labels", "shift_labels")}
            with context or nullcontext(), self.adapters_off():
                logits = (self.policy if self.frozen is None else self.frozen)(**inputs, use_cache=False).logits
            if group is None:
                return sequence_logps(logits, part["labels"], flat=self.flat)[0]
            return group_logps(logits, part["shift_labels"], group.group)[0]


# ---- precomputed reference log-probs (precompute_ref_log_probs) ------------------------------------


def reference_file(entry: Path, spec) -> Path:
    """Where an entry of the tokenized cache keeps its pairs' reference log-probs under this job's
    reference: its model as loaded (`ref_model`, else the model: a local directory's files by name,
    size and time; a hub id's revision and the files of its snapshot), `ref_adapters`' files and the
    compute dtype."""
    source = spec.ref_model or spec.model
    model, revision = _loaded_from(source)
    key = {"model": source, "files": _files(model), "dtype": spec.torch_dtype,
           **({"revision": revision} if revision else {}),
           **({"ref_adapters": [(a, _files(Path(a).expanduser())) for a in spec.ref_adapters]}
              if spec.ref_adapters else {})}
    return entry / f"reference-logps-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.npy"


def _files(directory: Path) -> list[tuple[str, int, int]]:
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir() if p.is_file()) \
        if directory.is_dir() else []


def _loaded_from(source: str) -> tuple[Path, str | None]:
    """The directory `source` is loaded from, and a hub id's revision: a local directory itself; a
    hub id's snapshot in the Hugging Face cache that `from_pretrained` resolves (refs/main; its
    config fetched first where a `ref_model` is not loaded yet), so a new revision of the model is
    another file, not the old revision's log-probs. A name that resolves to neither keys by itself."""
    model = Path(source).expanduser()
    if model.is_dir():
        return model, None
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        cached = try_to_load_from_cache(source, "config.json")
        config = Path(cached if isinstance(cached, str) else hf_hub_download(source, "config.json"))
    except Exception:  # not a hub id (huggingface_hub validates it), offline, or not there
        return model, None
    return config.parent, config.parent.name


def load_reference_table(path: Path, pairs: int) -> np.ndarray:
    """(pairs, 2) float32 of the entry's rows (chosen, rejected), NaN where none was computed. A
    missing file is all NaN; so is a damaged or foreign one (logged): it is a cache. Its .npy header
    is read and checked before its data (so a header claiming a huge shape allocates nothing), and
    the data taken as plain float32 bytes: nothing in the file is unpickled or run."""
    empty = np.full((pairs, 2), np.nan, dtype=np.float32)
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran_order, dtype = header(f)
            if (shape, fortran_order, dtype) != ((pairs, 2), False, np.dtype("<f4")):
                raise ValueError(f"{dtype} {shape}, expected float32 ({pairs}, 2)")
            data = f.read(pairs * 8 + 1)
        if len(data) != pairs * 8:
            raise ValueError(f"{len(data)} bytes of data for {pairs} pairs")
    except FileNotFoundError:
        return empty
    except (OSError, ValueError) as exc:
        log.warning("%s: not this entry's reference log-probs (%s); they are computed again", path, exc)
        return empty
    return np.frombuffer(data, dtype="<f4").reshape(pairs, 2).copy()


def save_reference_table(path: Path, table: np.ndarray) -> None:
    """Written whole or not at all (a temporary file renamed over it); a failure (a full disk) is
    logged: training goes on with the values in memory, a later run computes them again."""
    tmp = path.with_name(f".tmp-{path.name}-{secrets.token_hex(8)}")  # another node's writer has its own
    try:
        with open(tmp, "wb") as f:
            np.save(f, table, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        log.warning("%s: cannot keep the reference log-probs (%s); a later run computes them again", path, exc)


def nonfinite_pairs(gathered: list[tuple[np.ndarray, np.ndarray]]) -> list[int]:
    """The rows of the tokenized data whose computed reference log-probs (chosen or rejected) are
    not finite, from every rank's (rows, values)."""
    return sorted({int(row) for rows, values in gathered for row in rows[~np.isfinite(values).all(-1)]})


def nonfinite_message(rows: list[int], pairs: int, entry: Path, spec) -> str:
    shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
    why = ("it overflows on them in float16; train in bfloat16 or float32, or leave those pairs out"
           if spec.torch_dtype == "float16" else
           f"in {spec.torch_dtype}; its weights may hold NaN or inf: check {spec.ref_model or spec.model}")
    return (f"precompute_ref_log_probs: the reference model's log-probs of {len(rows)} of {pairs} pairs are not "
            f"finite (rows {shown} of the tokenized data in {entry}): {why}")


@torch.no_grad()
def precompute(batches, count: int, logps_of, together: int, device: torch.device) -> np.ndarray:
    """This rank's pairs' reference log-probs in the order of its plan, (pairs, 2): chosen, rejected.
    `logps_of(micro_batches)`: theirs as the engine computes the reference (`Engine.reference_logps`),
    `together` micro-batches at a time. `count` micro-batches, the most any rank has, rounded up to a
    multiple of `together`: the engines' forwards are collective (ZeRO-3 and FSDP2 gather the weights,
    a pipeline's stages hand activations on), so every rank runs as many, its last ones filled."""
    pairs, size, out = len(batches.plan), batches.micro_batch, []
    count = -(-count // together) * together
    micro = iter(batches.in_order(count))
    for first in range(0, count, together):
        group = [{key: value.to(device) for key, value in next(micro)[0].items()} for _ in range(together)]
        for k, logps in enumerate(logps_of(group), first):
            logps = logps.float().cpu()
            real = max(0, min(size, pairs - k * size))
            half = logps.shape[0] // 2  # chosen rows then rejected rows, each half filled to the micro-batch
            out.append(torch.stack([logps[:real], logps[half:half + real]], dim=1))
    return torch.cat(out).numpy() if out else np.zeros((0, 2), np.float32)


def install(policy: torch.nn.Module, loss: PreferenceLoss) -> None:
    """Make `loss` the loss function of the transformers model inside `policy` (a peft model wraps it)."""
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    base.loss_function = loss
