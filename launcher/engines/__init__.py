"""Engines: DDP, DeepSpeed ZeRO, FSDP2, tensor parallel, pipeline parallel. `build_engine` picks one from the job spec."""
from __future__ import annotations

from backend.job.capabilities import fsdp_plan, transformers_plan
from launcher.engines.base import Engine


def build_engine(model, spec, dist, total_steps: int, ds_config: dict | None) -> Engine:
    if spec.pipeline_model_parallel_size > 1:
        from launcher.engines.pp import PPEngine

        return PPEngine(model, spec, dist, total_steps)
    tp = transformers_plan(spec, dist.world_size)
    if tp:
        from launcher.engines.tp import TPEngine

        return TPEngine(model, spec, dist, total_steps, tp)
    if spec.deepspeed:
        from launcher.engines.zero import DeepSpeedEngine

        return DeepSpeedEngine(model, spec, dist, total_steps, ds_config)
    plan = fsdp_plan(spec)
    if plan:
        from launcher.engines.fsdp import FSDPEngine

        return FSDPEngine(model, spec, dist, total_steps, plan)
    from launcher.engines.ddp import DDPEngine

    return DDPEngine(model, spec, dist.device, total_steps)
