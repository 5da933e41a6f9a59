"""The command preview of the Train tab: each node's torchrun line (from backend.job.planner) and
the equivalent `swift sft` line, so a user can run the same job with ms-swift by hand.

`swift_command` is the inverse of `backend.job.msswift.import_command` (a unit test round-trips it).
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from backend.cluster.slurm import SlurmTarget, sbatch_script, script_file
from backend.job.msswift import ms_swift_defaults
from backend.job.planner import Plan, PlanError, plan
from backend.job.spec import JobSpec, absolute_dir
from backend.job.validate import Assessment

PREVIEW_RUN_ID = "RUN_ID"
# Fields ms-swift takes from the environment of `swift sft`, not as flags.
LAUNCH_ENV = {"nnodes": "NNODES", "nproc_per_node": "NPROC_PER_NODE"}
ALWAYS = ("model", "dataset", "train_type")
# ms-swift 4.x's flag names where they differ from the spec's (3.x spelled it --train_type).
FLAG_NAMES = {"train_type": "tuner_type"}


def _flag_values(value: Any) -> list[str]:
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, list):
        return [str(v) for v in value]
    return [str(value)]


def swift_command(spec: JobSpec, nproc_per_node: int | None = None, master_addr: str = "127.0.0.1",
                  master_port: int = 29500) -> str:
    """`swift sft` (`swift rlhf` for preference training) with every field that differs from what ms-swift takes when the flag is omitted
    (plus model, dataset and train type), launch sizes and `env` as environment prefixes, one flag
    per line. For several nodes it is node 0's line; the others differ only in NODE_RANK."""
    defaults = JobSpec.model_construct()
    env: dict[str, str] = dict(spec.env)
    nproc = nproc_per_node or spec.nproc_per_node
    # ms-swift's own defaults (epochs, learning rate, accumulation) for this train type and layout;
    # without NPROC_PER_NODE ms-swift runs one process.
    ms_swift = {name: value for name, (value, _) in ms_swift_defaults(spec.model_dump() | {"nproc_per_node": nproc or 1}).items()}
    if nproc and (nproc > 1 or spec.nnodes > 1):
        env["NPROC_PER_NODE"] = str(nproc)
    if spec.nnodes > 1:
        env.update(NNODES=str(spec.nnodes), NODE_RANK="0", MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    command = "swift rlhf" if spec.rlhf_type else "swift sft"
    lines = [" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + (" " if env else "") + command]
    for name in type(spec).model_fields:
        value = getattr(spec, name)
        if name == "env" or name in LAUNCH_ENV or value is None:
            continue
        if name not in ALWAYS and value == ms_swift.get(name, getattr(defaults, name, None)):
            continue
        if isinstance(value, list) and not value:
            continue
        lines.append(f"--{FLAG_NAMES.get(name, name)} " + " ".join(shlex.quote(v) for v in _flag_values(value)))
    return " \\\n    ".join(lines)


def node_lines(result: Plan) -> str:
    blocks = []
    for node in result.nodes:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in node.env.items())
        blocks.append(f"# node {node.node_rank}: {node.host} ({node.nproc_per_node} process(es))\n"
                      f"{env} \\\n    {shlex.join(node.argv)}")
    return "\n\n".join(blocks)


def preview(assessed: Assessment, slurm: SlurmTarget | None = None) -> tuple[str, dict | None]:
    """(command preview text, DeepSpeed config or None) for a valid spec on its cluster; on a
    Slurm target the batch script the launch submits."""
    spec, cluster = assessed.spec, assessed.cluster
    run_dir = Path(absolute_dir(spec.output_dir)) / PREVIEW_RUN_ID
    try:
        result = plan(spec, cluster, PREVIEW_RUN_ID, run_dir, assessment=assessed)
    except PlanError as exc:
        return f"# no launch plan: {exc}", None
    if slurm is not None:
        try:
            script = sbatch_script(slurm, result, PREVIEW_RUN_ID, attempt=1)
        except ValueError as exc:
            return f"# no batch script: {exc}", result.ds_config
        return (f"# {result.summary()}\n# {PREVIEW_RUN_ID} is chosen at launch; the launch writes this script to "
                f"{run_dir}/{script_file(1)} and submits it with sbatch --parsable.\n\n{script}"), result.ds_config
    others = " (node N: NODE_RANK=N)" if spec.nnodes > 1 else ""
    swift = swift_command(spec, result.layout.nproc_per_node, result.master_addr, result.master_port)
    text = (f"# {result.summary()}\n# {PREVIEW_RUN_ID} is chosen at launch.\n\n{node_lines(result)}\n\n"
            f"# The same job with ms-swift{others}:\n{swift}\n")
    return text, result.ds_config
