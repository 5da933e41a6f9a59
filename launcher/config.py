"""Reads what the backend put in the run directory: `job.yaml` and, for DeepSpeed, `ds_config.json`."""
from __future__ import annotations

import json
from pathlib import Path

from backend.capabilities import unsupported
from backend.spec import JobSpec, load_spec


class ConfigError(Exception):
    """The job cannot run as specified; the message lists every problem by field."""


def load_job(run_dir: Path) -> JobSpec:
    spec, problems = load_spec(Path(run_dir) / "job.yaml")
    errors = [p for p in problems if p.severity == "error"]
    if spec is None or errors:
        raise ConfigError("invalid job spec:\n" + "\n".join(f"  {p}" for p in errors or problems))
    refused = [p for p in unsupported(spec) if p.severity == "error"]
    if refused:
        raise ConfigError("this worker cannot run the job:\n" + "\n".join(f"  {p}" for p in refused))
    return spec


def load_ds_config(run_dir: Path, spec: JobSpec, dp_size: int, hidden_size: int | None) -> dict:
    """The DeepSpeed config: the run directory's ds_config.json (written by the backend), else built
    here from the preset or the user's JSON by the backend's own builder. The batch fields are set
    from the spec and the actual world size either way, so DeepSpeed's batch check always holds."""
    from backend.dsconfig import DsConfigError, build_ds_config

    path = Path(run_dir) / "ds_config.json"
    try:
        if path.is_file():
            config = json.loads(path.read_text())
        else:
            config = build_ds_config(spec, dp_size, hidden_size)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    except DsConfigError as exc:
        raise ConfigError(f"deepspeed: {exc}") from None
    config["train_micro_batch_size_per_gpu"] = spec.per_device_train_batch_size
    config["gradient_accumulation_steps"] = spec.gradient_accumulation_steps
    config["train_batch_size"] = spec.per_device_train_batch_size * spec.gradient_accumulation_steps * dp_size
    return config
