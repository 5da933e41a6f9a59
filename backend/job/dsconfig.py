"""DeepSpeed config builder (pure): a preset name or the user's JSON, with every "auto" filled.

Public API:
    ZeroSettings                                   stage and offload devices; ZeroSettings.of(config)
    base_config(spec) -> dict | None                the preset or the user's JSON, before anything is filled;
                                                   None when the job does not use DeepSpeed
    zero_settings(spec) -> ZeroSettings | None      None when the job does not use DeepSpeed
    load_user_config(path) -> dict                  raises DsConfigError naming the file (and line)
    batch_fields(spec, dp_size) -> dict             train_batch_size = micro x accumulation x dp_size
    build_ds_config(spec, dp_size, hidden_size=None) -> dict
                                                   what the plan writes: every "auto" filled but the
                                                   scheduler's step counts
    fill_steps(config, spec, total_steps) -> dict   the worker's part: the scheduler's step counts
    stage3_sizes(hidden_size) -> dict               what ZeRO-3's 'auto' bucket and threshold sizes become
    user_batch_conflicts(config, spec, dp_size) -> list[str]
Reading a user JSON (base_config, zero_settings, build_ds_config) raises DsConfigError when it is
unusable: every problem at once, one line each naming the file and the key path.

"auto" means what it means to HF's integration (transformers/integrations/deepspeed.py):
- the plan fills, from the job (HF's trainer_config_process): the batch fields, gradient_clipping
  (max_grad_norm), optimizer.params lr / weight_decay, betas / eps (the worker's AdamW: 0.9, 0.999,
  1e-8), scheduler.params warmup_min_lr (0) / warmup_max_lr (learning_rate), fp16/bf16.enabled
  (torch_dtype), and the ZeRO bucket sizes (stage3_sizes);
- the worker fills, once the data gives the run's length (HF's trainer_config_finalize):
  scheduler.params total_num_steps and warmup_num_steps (warmup_ratio x steps, at least 1);
- any other "auto" is refused.
A value the JSON sets where HF demands a match (fill_match) must equal the job's: HF raises, so the
JSONs users bring already agree or say "auto", and either silent winner would leave job.yaml
describing another run than DeepSpeed trains. The batch fields are the exception: the job's win,
with a warning (user_batch_conflicts). betas and eps, which the job cannot set, are the JSON's.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from backend.job import capabilities
from backend.job.jsonfile import read_json
from backend.job.spec import JobSpec

# ms-swift's bundled zero2.json uses 2e8-element buckets: small enough for 24 GiB cards, large
# enough to keep NCCL busy.
STAGE12_BUCKET = 200_000_000
# ZeRO-3's DeepSpeed defaults. HF's 'auto' values scale with hidden^2 and are far smaller below
# ~7.5k hidden (a 2.1M-element prefetch for a 1.5B model: the next layer is barely prefetched).
# With them our ZeRO-3 ran at 0.88x the HF Trainer on DeepSpeed's defaults; with the defaults,
# 0.98-1.10x across four device calls (two H200s, docs/benchmarks.md).
STAGE3_REDUCE_BUCKET = 500_000_000
STAGE3_PREFETCH_BUCKET = 50_000_000
STAGE3_PERSISTENCE = 100_000
# The worker's AdamW (launcher/engines/base.py make_optimizer): what "auto" betas and eps become.
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


class DsConfigError(ValueError):
    """A DeepSpeed JSON the job cannot use; the message names the file (and line)."""


@dataclass(frozen=True)
class ZeroSettings:
    stage: int
    offload_optimizer: str | None = None
    """'cpu' or 'nvme' when the optimizer states live off the GPU."""
    offload_param: str | None = None

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.offload_optimizer, self.offload_param)

    @classmethod
    def of(cls, config: dict[str, Any]) -> ZeroSettings:
        """The settings of a config from `base_config` (its stage already checked; none is stage 0)."""
        zero = config.get("zero_optimization", {})
        return cls(int(zero.get("stage", 0)), _device(zero.get("offload_optimizer")), _device(zero.get("offload_param")))


def _preset(name: str) -> dict[str, Any]:
    stage = int(name[4])
    zero: dict[str, Any] = {"stage": stage}
    if stage in (1, 2):
        zero.update(
            allgather_partitions=True,
            allgather_bucket_size=STAGE12_BUCKET,
            reduce_scatter=True,
            reduce_bucket_size=STAGE12_BUCKET,
            overlap_comm=True,
            contiguous_gradients=True,
        )
    if stage == 3:
        zero.update(
            overlap_comm=True,
            contiguous_gradients=True,
            sub_group_size=1_000_000_000,
            reduce_bucket_size="auto",
            stage3_prefetch_bucket_size="auto",
            stage3_param_persistence_threshold="auto",
            stage3_max_live_parameters=1_000_000_000,
            stage3_max_reuse_distance=1_000_000_000,
            stage3_gather_16bit_weights_on_model_save=True,
        )
    if name.endswith("_offload"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"zero_optimization": zero}


def load_user_config(path: str | Path) -> dict[str, Any]:
    """Read a user's DeepSpeed JSON and check its ZeRO stage (none, as for DeepSpeed, is stage 0)."""
    path = Path(path).expanduser()
    data = read_json(path, "DeepSpeed config", DsConfigError,
                     hint=" (use zero0..zero3, zero2_offload, zero3_offload or a JSON path)")
    if not isinstance(data, dict):
        raise DsConfigError(f"{path}: DeepSpeed config must be a JSON object")
    zero = data.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise DsConfigError(f"{path}: zero_optimization: must be an object (got {json.dumps(zero)})")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise DsConfigError(f"{path}: zero_optimization.stage: must be 0, 1, 2 or 3 (got {json.dumps(stage)})")
    return data


def base_config(spec: JobSpec) -> dict[str, Any] | None:
    """The config before anything is filled: a preset or the user's JSON, checked against the job;
    None without DeepSpeed."""
    if spec.deepspeed is None:
        return None
    if spec.deepspeed_preset:
        return _preset(spec.deepspeed_preset)
    config = load_user_config(spec.deepspeed)
    problems = _problems(config, spec, str(Path(spec.deepspeed).expanduser()))
    if problems:
        raise DsConfigError("\n".join(problems))
    return config


class _Fill(NamedTuple):
    value: Any
    """What replaces "auto"."""
    job: str | None = None
    """How the job states the value, where an explicit value in the JSON must equal it (HF's
    fill_match); None where the JSON's own value stands (HF's fill_only, or nothing in the job)."""


def _job_values(spec: JobSpec) -> dict[str, _Fill]:
    """What the plan fills, by key path (HF's trainer_config_process)."""
    lr = f"the job's learning_rate is {spec.learning_rate}"
    dtype = f"the job's torch_dtype is {spec.torch_dtype}"
    return {
        "gradient_clipping": _Fill(spec.max_grad_norm, f"the job's max_grad_norm is {spec.max_grad_norm}"),
        "optimizer.params.lr": _Fill(spec.learning_rate, lr),
        "optimizer.params.weight_decay": _Fill(spec.weight_decay, f"the job's weight_decay is {spec.weight_decay}"),
        "optimizer.params.betas": _Fill(list(ADAM_BETAS)),
        "optimizer.params.eps": _Fill(ADAM_EPS),
        "scheduler.params.warmup_min_lr": _Fill(0),
        "scheduler.params.warmup_max_lr": _Fill(spec.learning_rate, lr),
        "fp16.enabled": _Fill(spec.torch_dtype == "float16", dtype),
        "bf16.enabled": _Fill(spec.torch_dtype == "bfloat16", dtype),
    }


def _step_values(spec: JobSpec, total_steps: int) -> dict[str, _Fill]:
    """What the worker fills once the run's length is known (HF's trainer_config_finalize). Warm-up
    rounds as the worker's own schedule does (make_scheduler) and is at least 1, as HF keeps it:
    DeepSpeed >= 0.19.6 refuses 0."""
    warmup = max(1, int(round(spec.warmup_ratio * total_steps)))
    return {"scheduler.params.total_num_steps": _Fill(total_steps, f"the run has {total_steps} steps"),
            "scheduler.params.warmup_num_steps": _Fill(warmup, f"the job warms up for {warmup} step(s) (warmup_ratio "
                                                               f"{spec.warmup_ratio} x {total_steps} steps, at least 1)")}


def _node(config: dict[str, Any], path: str) -> tuple[dict[str, Any] | None, str]:
    """The object that holds the dotted key `path`, and the key; None where a parent is missing."""
    *parents, key = path.split(".")
    node: Any = config
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), key


def _autos(node: Any, path: str = "") -> Iterator[str]:
    """The key path of every "auto" in a JSON tree."""
    if node == "auto":
        yield path
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _autos(value, f"{path}.{key}" if path else key)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _autos(value, f"{path}[{i}]")


def _fill(config: dict[str, Any], values: dict[str, _Fill]) -> None:
    for path, fill in values.items():
        node, key = _node(config, path)
        if node is not None and node.get(key) == "auto":
            node[key] = copy.deepcopy(fill.value)


def _mismatches(config: dict[str, Any], values: dict[str, _Fill], source: str) -> list[str]:
    out = []
    for path, fill in values.items():
        node, key = _node(config, path)
        given = None if node is None else node.get(key)
        if fill.job and given not in (None, "auto") and given != fill.value:
            out.append(f'{source}: {path}: {json.dumps(given)}, but {fill.job}; set it to "auto" (the job\'s value) '
                       "or make the two agree")
    return out


def _problems(config: dict[str, Any], spec: JobSpec, source: str) -> list[str]:
    """What stops a user JSON (the file `source`) from running this job, one line each."""
    values = _job_values(spec)
    filled = {*batch_fields(spec, 1), *values, *_step_values(spec, 1),
              *(f"zero_optimization.{key}" for key in stage3_sizes(None))}
    out = [f'{source}: {path}: "auto" is not filled by anything in the job (nor by HF\'s integration); give it a value'
           for path in _autos(config) if path not in filled]
    if spec.max_steps > 0:  # the run's length is known before launch
        values |= _step_values(spec, spec.max_steps)
    out += _mismatches(config, values, source)
    return out + [p.message for p in capabilities.deepspeed_json_problems(config, source, spec)]


def _device(section: Any) -> str | None:
    if isinstance(section, dict) and section.get("device") in ("cpu", "nvme"):
        return section["device"]
    return None


def zero_settings(spec: JobSpec) -> ZeroSettings | None:
    config = base_config(spec)
    return None if config is None else ZeroSettings.of(config)


def _auto(value: Any) -> bool:
    return value is None or value == "auto"


def batch_fields(spec: JobSpec, dp_size: int) -> dict[str, int]:
    """The batch fields from the spec; DeepSpeed refuses a config where they do not multiply out.
    Under AutoTP (ZeRO-0..2) DeepSpeed 0.19.8 checks them against every rank, the TP ranks too,
    although a TP group trains on one batch (tests/test_tensor_parallel.py pins it)."""
    counted = dp_size * (capabilities.autotp(spec) or 1)
    return {
        "train_micro_batch_size_per_gpu": spec.per_device_train_batch_size,
        "gradient_accumulation_steps": spec.gradient_accumulation_steps,
        "train_batch_size": spec.per_device_train_batch_size * spec.gradient_accumulation_steps * counted,
    }


def stage3_sizes(hidden_size: int | None) -> dict[str, int]:
    """ZeRO-3's 'auto' sizes: HF's hidden-size rule where it gives more than DeepSpeed's defaults."""
    h2 = (hidden_size or 0) ** 2
    return {"reduce_bucket_size": max(h2, STAGE3_REDUCE_BUCKET),
            "stage3_prefetch_bucket_size": max(int(0.9 * h2), STAGE3_PREFETCH_BUCKET),
            "stage3_param_persistence_threshold": max(10 * (hidden_size or 0), STAGE3_PERSISTENCE)}


def build_ds_config(spec: JobSpec, dp_size: int, hidden_size: int | None = None,
                    base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed config the plan writes. The batch fields always come from the spec (validation
    warns where a user JSON disagrees); every other "auto" is filled from the job but the
    scheduler's step counts, which the worker fills (`fill_steps`) once it has read the data.
    `base`: `base_config(spec)` where the caller has read it already."""
    config = copy.deepcopy(base if base is not None else base_config(spec))
    if config is None:
        raise ValueError("the job does not use DeepSpeed")
    config.update(batch_fields(spec, dp_size))
    if capabilities.autotp(spec):
        config.setdefault("tensor_parallel", {})["autotp_size"] = capabilities.autotp(spec)
    # Left out, DeepSpeed would not clip and would train in fp32, whatever the job says.
    config.setdefault("gradient_clipping", "auto")
    for key in ("bf16", "fp16"):
        config.setdefault(key, {}).setdefault("enabled", "auto")
    _fill(config, _job_values(spec))
    _fill(config, {f"zero_optimization.{key}": _Fill(value) for key, value in stage3_sizes(hidden_size).items()})
    if config["fp16"]["enabled"]:
        for key, value in (("loss_scale", 0), ("initial_scale_power", 16), ("loss_scale_window", 1000), ("hysteresis", 2), ("min_loss_scale", 1)):
            config["fp16"].setdefault(key, value)
    if spec.grad_reduce_dtype == "float32" and spec.torch_dtype != "float32":
        config.setdefault("communication_data_type", "fp32")
    config.setdefault("steps_per_print", 1_000_000_000)  # the worker logs; DeepSpeed's own prints are noise
    config.setdefault("wall_clock_breakdown", False)
    return config


def fill_steps(config: dict[str, Any], spec: JobSpec, total_steps: int) -> dict[str, Any]:
    """A copy of the plan's `config` with the scheduler's "auto" step counts filled for a run of
    `total_steps` optimizer steps. Raises DsConfigError naming the user's JSON where it sets a count
    the run disagrees with (checked before launch only where max_steps gives the length)."""
    config = copy.deepcopy(config)
    steps = _step_values(spec, total_steps)
    _fill(config, steps)
    problems = _mismatches(config, steps, str(spec.deepspeed))
    if problems:
        raise DsConfigError("\n".join(problems))
    return config


def user_batch_conflicts(config: dict[str, Any], spec: JobSpec, dp_size: int) -> list[str]:
    """Batch fields `config` (from `base_config`) sets to numbers other than the spec implies
    (they are overwritten). Presets set none, so only a user JSON can conflict."""
    return [f"{key}={config[key]} (the job gives {value})" for key, value in batch_fields(spec, dp_size).items()
            if not _auto(config.get(key)) and config[key] != value]
