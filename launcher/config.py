"""Reads what the backend put in the run directory: `job.yaml` and, for DeepSpeed, `ds_config.json`."""
from __future__ import annotations

from pathlib import Path

from backend.job.capabilities import device_problems, unsupported, world_problems, zero_problems
from backend.job.errors import UserError
from backend.job.jsonfile import read_json
from backend.job.spec import JobSpec, load_spec


class ConfigError(UserError):
    """The job cannot run as specified; the message lists every problem by field."""


def load_job(run_dir: Path) -> JobSpec:
    spec, problems = load_spec(Path(run_dir) / "job.yaml")
    if spec is None:
        raise ConfigError("invalid job spec:\n" + "\n".join(f"  {p}" for p in problems))
    import os
    import socket

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    refused = [p for p in unsupported(spec) + device_problems(spec, {socket.gethostname(): device})
               + world_problems(spec, int(os.environ.get("WORLD_SIZE", 1))) if p.severity == "error"]
    if refused:
        raise ConfigError("this worker cannot run the job:\n" + "\n".join(f"  {p}" for p in refused))
    return spec


def load_ds_config(run_dir: Path, spec: JobSpec, dp_size: int, hidden_size: int | None, total_steps: int) -> dict:
    """The DeepSpeed config: the run directory's ds_config.json (written by the backend), else built
    here from the preset or the user's JSON by the backend's own builder. The batch fields are set
    from the spec and the actual world size either way, so DeepSpeed's batch check always holds, and
    the scheduler's "auto" step counts from the run's `total_steps` (known once the data is read)."""
    from backend.job.dsconfig import DsConfigError, ZeroSettings, batch_fields, build_ds_config, fill_steps

    path = Path(run_dir) / "ds_config.json"
    try:
        if path.is_file():
            config = read_json(path, "DeepSpeed config", ConfigError)
            config.update(batch_fields(spec, dp_size))
        else:
            config = build_ds_config(spec, dp_size, hidden_size)
        config = fill_steps(config, spec, total_steps)
    except DsConfigError as exc:
        raise ConfigError(f"deepspeed: {exc}") from None
    # The backend refuses these before launch too; this guards workers started without it.
    zero = ZeroSettings.of(config)
    refused = zero_problems(spec, zero.stage, bool(zero.offload_optimizer or zero.offload_param))
    if refused:
        raise ConfigError("\n".join(str(p) for p in refused))
    return config
