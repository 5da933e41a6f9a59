"""Engines: DDP, DeepSpeed ZeRO, FSDP2. `build_engine` picks one from the job spec."""
from __future__ import annotations

from backend.capabilities import fsdp_plan
from launcher.engines.base import Engine


def build_engine(model, spec, dist, total_steps: int, ds_config: dict | None) -> Engine:
    if spec.deepspeed:
        from launcher.engines.zero import DeepSpeedEngine

        return DeepSpeedEngine(model, spec, dist, total_steps, ds_config)
    plan = fsdp_plan(spec)
    if plan:
        from launcher.engines.fsdp import FSDPEngine

        return FSDPEngine(model, spec, dist, total_steps, plan)
    from launcher.engines.ddp import DDPEngine

    return DDPEngine(model, spec, dist.device, total_steps)
