"""DeepSpeed config builder (pure): a preset name or the user's JSON, with the batch fields filled.

Public API:
    ZeroSettings                                   stage and offload devices; ZeroSettings.of(config)
    base_config(spec) -> dict | None                the preset or the user's JSON, before batch sizes;
                                                   None when the job does not use DeepSpeed
    zero_settings(spec) -> ZeroSettings | None      None when the job does not use DeepSpeed
    load_user_config(path) -> dict                  raises DsConfigError naming the file (and line)
    batch_fields(spec, dp_size) -> dict             train_batch_size = micro x accumulation x dp_size
    build_ds_config(spec, dp_size, hidden_size=None) -> dict
    stage3_sizes(hidden_size) -> dict               what ZeRO-3's 'auto' bucket and threshold sizes become
    user_batch_conflicts(config, spec, dp_size) -> list[str]
Reading a user JSON (base_config, zero_settings, build_ds_config) raises DsConfigError when it is unusable.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.jsonfile import read_json
from backend.spec import JobSpec

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
        """The settings of a config from `base_config` (its stage already checked)."""
        zero = config["zero_optimization"]
        return cls(int(zero["stage"]), _device(zero.get("offload_optimizer")), _device(zero.get("offload_param")))


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
    """Read a user's DeepSpeed JSON and check it names a ZeRO stage."""
    path = Path(path).expanduser()
    data = read_json(path, "DeepSpeed config", DsConfigError,
                     hint=" (use zero0..zero3, zero2_offload, zero3_offload or a JSON path)")
    if not isinstance(data, dict):
        raise DsConfigError(f"{path}: DeepSpeed config must be a JSON object")
    zero = data.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise DsConfigError(f"{path}: DeepSpeed config needs zero_optimization.stage = 0, 1, 2 or 3 (got {stage!r})")
    return data


def base_config(spec: JobSpec) -> dict[str, Any] | None:
    """The config before batch sizes are filled: a preset or the user's JSON; None without DeepSpeed."""
    if spec.deepspeed is None:
        return None
    if spec.deepspeed_preset:
        return _preset(spec.deepspeed_preset)
    return load_user_config(spec.deepspeed)


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
    """The batch fields from the spec; DeepSpeed refuses a config where they do not multiply out."""
    return {
        "train_micro_batch_size_per_gpu": spec.per_device_train_batch_size,
        "gradient_accumulation_steps": spec.gradient_accumulation_steps,
        "train_batch_size": spec.per_device_train_batch_size * spec.gradient_accumulation_steps * dp_size,
    }


def stage3_sizes(hidden_size: int | None) -> dict[str, int]:
    """ZeRO-3's 'auto' sizes: HF's hidden-size rule where it gives more than DeepSpeed's defaults."""
    h2 = (hidden_size or 0) ** 2
    return {"reduce_bucket_size": max(h2, STAGE3_REDUCE_BUCKET),
            "stage3_prefetch_bucket_size": max(int(0.9 * h2), STAGE3_PREFETCH_BUCKET),
            "stage3_param_persistence_threshold": max(10 * (hidden_size or 0), STAGE3_PERSISTENCE)}


def build_ds_config(spec: JobSpec, dp_size: int, hidden_size: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config the workers load. The batch fields always come from the spec
    (validation warns where a user JSON disagrees); other 'auto' or missing values are filled."""
    config = copy.deepcopy(base_config(spec))
    if config is None:
        raise ValueError("the job does not use DeepSpeed")
    config.update(batch_fields(spec, dp_size))
    if _auto(config.get("gradient_clipping")):
        config["gradient_clipping"] = spec.max_grad_norm
    for key, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        section = config.setdefault(key, {})
        if _auto(section.get("enabled")):
            section["enabled"] = spec.torch_dtype == dtype
    if config["fp16"]["enabled"]:
        for key, value in (("loss_scale", 0), ("initial_scale_power", 16), ("loss_scale_window", 1000), ("hysteresis", 2), ("min_loss_scale", 1)):
            config["fp16"].setdefault(key, value)
    if spec.grad_reduce_dtype == "float32" and spec.torch_dtype != "float32":
        config.setdefault("communication_data_type", "fp32")
    zero = config["zero_optimization"]
    for key, value in stage3_sizes(hidden_size).items():
        if zero.get(key) == "auto":
            zero[key] = value
    config.setdefault("steps_per_print", 1_000_000_000)  # the worker logs; DeepSpeed's own prints are noise
    config.setdefault("wall_clock_breakdown", False)
    return config


def user_batch_conflicts(config: dict[str, Any], spec: JobSpec, dp_size: int) -> list[str]:
    """Batch fields `config` (from `base_config`) sets to numbers other than the spec implies
    (they are overwritten). Presets set none, so only a user JSON can conflict."""
    return [f"{key}={config[key]} (the job gives {value})" for key, value in batch_fields(spec, dp_size).items()
            if not _auto(config.get(key)) and config[key] != value]
