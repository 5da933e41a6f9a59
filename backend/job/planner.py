"""Launch planner (pure): job spec + cluster -> per-node torchrun command lines, env and files.

Public API:
    NodePlan, Plan                                   frozen dataclasses; `Plan.to_dict()`, `Plan.summary()`
    plan(spec, cluster, run_id, run_dir, master_port=29500, resume=None, model_config=None,
         base_dir=None, assessment=None) -> Plan
        `run_dir` must be absolute. Relative local paths in the spec (model, dataset, DeepSpeed
        JSON, resume checkpoint) are made absolute against `base_dir` (default: the current
        directory) when they exist there. `model_config` adds the memory estimate;
        `assessment` (backend.job.validate.assess of the same spec and cluster) gives the model
        config, the DeepSpeed config as read and the memory estimate, so nothing is read twice.
        Raises PlanError when the spec does not fit the cluster (run `validate` first).
    DEFAULT_MASTER_PORT

The argv follows docs/architecture.md "Worker command line"; running a node's argv with its env,
from any directory, starts that node's workers.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backend.job.cluster import Cluster
from backend.job.dsconfig import ZeroSettings, build_ds_config
from backend.job.layout import Layout, compute_layout
from backend.job.memory import MemoryEstimate, estimate_memory
from backend.job.modelcfg import ModelConfig
from backend.job.modelfiles import with_adapter_settings
from backend.job.spec import JobSpec
from backend.job.validate import Assessment

DEFAULT_MASTER_PORT = 29500
# The environment every process of a run gets: the run it belongs to (its tag) and the node
# name it runs under (the workers write it into their end slot).
RUN_ID_ENV = "SWIFT_STUDIO_RUN_ID"
NODE_ENV = "SWIFT_STUDIO_NODE"
STOP_BUDGET_ENV = "SWIFT_STUDIO_STOP_BUDGET_S"
# The time a stop gives the workers, from the SIGTERM to their exit: reaching a step boundary and
# writing the checkpoint must fit in it. torchrun kills its workers 30 s after its own SIGTERM
# (torch.distributed.elastic's PContext.close), so that is the budget.
STOP_BUDGET_S = 30.0
LOOPBACK_IFNAME = "lo"
WORKER_MODULE = "launcher.train"
# The directory holding backend/ and launcher/: workers on the local machine import from it even
# when swift-studio is not pip-installed.
CODE_ROOT = str(Path(__file__).resolve().parents[2])


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class NodePlan:
    host: str
    address: str
    node_rank: int
    nproc_per_node: int
    argv: tuple[str, ...]
    env: dict[str, str]
    local: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "address": self.address, "node_rank": self.node_rank,
                "nproc_per_node": self.nproc_per_node, "argv": list(self.argv), "env": dict(self.env), "local": self.local}


@dataclass(frozen=True)
class Plan:
    run_id: str
    run_dir: str
    layout: Layout
    master_addr: str
    master_port: int
    backend: str
    nodes: tuple[NodePlan, ...]
    spec: JobSpec
    """The spec as the workers get it (nproc_per_node resolved, local paths absolute)."""
    ds_config: dict[str, Any] | None = None
    memory: MemoryEstimate | None = None
    files: dict[str, str] = field(default_factory=dict)
    """Run-directory files to write before launch: job.yaml, ds_config.json (DeepSpeed), plan.json."""

    def summary(self) -> str:
        engine = f"DeepSpeed {self.spec.deepspeed}" if self.spec.deepspeed else (f"FSDP {self.spec.fsdp}" if self.spec.fsdp else "DDP")
        text = f"{self.layout.summary()}; {engine}, {self.backend}; rendezvous {self.master_addr}:{self.master_port}"
        if self.ds_config:
            text += f"; train_batch_size {self.ds_config['train_batch_size']}"
        if self.memory:
            text += f"; {self.memory.summary()}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """Everything but `files` and the spec (plan.json; `swift-studio plan --json`)."""
        return {
            "run_id": self.run_id,
            "run_dir": self.run_dir,
            "layout": self.layout.to_dict(),
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "backend": self.backend,
            "nodes": [n.to_dict() for n in self.nodes],
            "ds_config": self.ds_config,
            "memory": self.memory.to_dict() if self.memory else None,
        }


def _absolute(value: str, base: Path) -> str:
    """`value` as an absolute path when it names something that exists under `base`; else as is."""
    raw, hash_, count = value.partition("#")  # ms-swift's 'file#N' sample count
    path = Path(raw).expanduser()
    if path.is_absolute():
        return str(path) + hash_ + count
    candidate = base / path
    if raw and candidate.exists():
        return str(candidate.resolve()) + hash_ + count
    return value


def resolve_paths(spec: JobSpec, base_dir: Path) -> JobSpec:
    """A copy of the spec whose local paths are absolute, so the worker finds them from any directory."""
    updates: dict[str, Any] = {
        "model": _absolute(spec.model, base_dir),
        "ref_model": spec.ref_model and _absolute(spec.ref_model, base_dir),
        "adapters": [_absolute(a, base_dir) for a in spec.adapters],
        "ref_adapters": [_absolute(a, base_dir) for a in spec.ref_adapters],
        "dataset": [_absolute(d, base_dir) for d in spec.dataset],
        "val_dataset": [_absolute(d, base_dir) for d in spec.val_dataset],
        "output_dir": str((base_dir / Path(spec.output_dir).expanduser()).resolve()),
    }
    if spec.deepspeed and not spec.deepspeed_preset:
        updates["deepspeed"] = _absolute(spec.deepspeed, base_dir)
    if spec.resume_from_checkpoint:
        updates["resume_from_checkpoint"] = _absolute(spec.resume_from_checkpoint, base_dir)
    if spec.dataset_cache_dir:
        updates["dataset_cache_dir"] = str((base_dir / Path(spec.dataset_cache_dir).expanduser()).resolve())
    return spec.model_copy(update=updates)


def worker_argv(python: str, layout: Layout, node_rank: int, endpoint: str, run_id: str, run_dir: str,
                local_addr: str | None, resume: str | None) -> list[str]:
    argv = [python, "-m", "torch.distributed.run",
            "--nnodes", str(layout.nnodes), "--node_rank", str(node_rank), "--nproc_per_node", str(layout.nproc_per_node),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", run_id, "--max_restarts", "0"]
    if local_addr:
        argv += ["--local_addr", local_addr]
    argv += ["-m", WORKER_MODULE, "--run-dir", run_dir]
    if resume:
        argv += ["--resume", resume]
    return argv


def plan(spec: JobSpec, cluster: Cluster, run_id: str, run_dir: str | Path, master_port: int = DEFAULT_MASTER_PORT,
         resume: str | None = None, model_config: ModelConfig | None = None, base_dir: str | Path | None = None,
         assessment: Assessment | None = None) -> Plan:
    run_dir = Path(run_dir)
    if not run_dir.is_absolute():
        raise PlanError(f"run directory must be an absolute path, got {run_dir}")
    if spec.nnodes > len(cluster.nodes):
        raise PlanError(f"nnodes: {spec.nnodes} nodes asked for, the cluster has {len(cluster.nodes)}")
    if not 1 <= master_port <= 65535:
        raise PlanError(f"master port must be 1-65535, got {master_port}")
    layout = compute_layout(spec, cluster)
    nodes = cluster.nodes[: spec.nnodes]
    worker_spec = resolve_paths(spec, Path(base_dir) if base_dir else Path.cwd()).model_copy(
        update={"nproc_per_node": layout.nproc_per_node})
    used = Cluster(nodes=tuple(nodes), source=cluster.source)
    loopback = used.all_loopback
    master_addr = nodes[0].address
    endpoint = f"{master_addr}:{master_port}"

    node_plans = []
    for rank, node in enumerate(nodes):
        env = {RUN_ID_ENV: run_id, "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
               STOP_BUDGET_ENV: f"{STOP_BUDGET_S:g}"}
        if loopback:
            # Every node is an address on this machine: keep gloo/NCCL on the loopback interface.
            env.update(GLOO_SOCKET_IFNAME=LOOPBACK_IFNAME, NCCL_SOCKET_IFNAME=LOOPBACK_IFNAME)
        if node.local:
            env["PYTHONPATH"] = CODE_ROOT
        env.update(spec.env)  # the user's NCCL_* and friends win over our defaults
        argv = worker_argv(node.python, layout, rank, endpoint, run_id, str(run_dir),
                           node.address if loopback else None, resume)
        node_plans.append(NodePlan(host=node.host, address=node.address, node_rank=rank,
                                   nproc_per_node=layout.nproc_per_node, argv=tuple(argv), env=env, local=node.local))

    if assessment is not None:
        model_config = assessment.model
    ds_config = None
    if spec.deepspeed:
        ds_config = build_ds_config(worker_spec, layout.dp, model_config.hidden_size if model_config else None,
                                    base=assessment.ds_config if assessment else None)
    if assessment is not None:
        memory = assessment.memory
    else:
        device = "cuda" if used.backend == "nccl" else "cpu"
        zero = ZeroSettings.of(ds_config) if ds_config else None
        memory = (estimate_memory(with_adapter_settings(worker_spec), model_config, layout, device, zero)
                  if model_config else None)
    result = Plan(run_id=run_id, run_dir=str(run_dir), layout=layout, master_addr=master_addr, master_port=master_port,
                  backend=used.backend, nodes=tuple(node_plans), spec=worker_spec, ds_config=ds_config, memory=memory)
    files = {"job.yaml": worker_spec.to_yaml(), "plan.json": json.dumps(result.to_dict(), indent=2) + "\n"}
    if ds_config is not None:
        files["ds_config.json"] = json.dumps(ds_config, indent=2) + "\n"
    result.files.update(files)
    return result

