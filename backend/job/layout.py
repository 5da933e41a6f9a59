"""The parallel layout of a job on a cluster: plain integer arithmetic, no torch.

Public API:
    Layout                                          frozen dataclass
    compute_layout(spec, cluster=None) -> Layout     never raises; `validate` says whether it works
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from backend.job.cluster import Cluster
from backend.job.spec import JobSpec


@dataclass(frozen=True)
class Layout:
    nnodes: int
    nproc_per_node: int
    world: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    sp: int
    dp: int
    """Data-parallel size = world / (TP x PP x CP x SP): ranks that see different samples and
    over which ZeRO/FSDP shard. The experts have a grid of their own, ETP x EP x PP x expert-DP =
    world (Megatron's `initialize_model_parallel`), so EP need not divide DP."""

    def summary(self) -> str:
        degrees = " ".join(f"{name}={getattr(self, name.lower())}" for name in ("DP", "TP", "PP", "CP", "EP", "SP"))
        return f"{self.nnodes} node(s) x {self.nproc_per_node} proc = world {self.world}: {degrees}"

    def name(self) -> str:
        """The ranks as the product of their dimensions, DP×TP×SP×CP, with PP and EP where used."""
        dims = [("DP", self.dp), ("TP", self.tp), ("SP", self.sp), ("CP", self.cp)]
        dims += [(name, value) for name, value in (("PP", self.pp), ("EP", self.ep)) if value > 1]
        return "×".join(f"{name}{value}" for name, value in dims)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def resolve_nproc(spec: JobSpec, cluster: Cluster | None) -> int:
    """nproc_per_node, with None meaning every slot of the nodes in use (the smallest node's count)."""
    if spec.nproc_per_node is not None:
        return spec.nproc_per_node
    if cluster is None:
        return 1
    return min(node.slots for node in cluster.nodes[: spec.nnodes])


def compute_layout(spec: JobSpec, cluster: Cluster | None = None) -> Layout:
    nproc = resolve_nproc(spec, cluster)
    world = spec.nnodes * nproc
    tp, pp, cp = spec.tensor_model_parallel_size, spec.pipeline_model_parallel_size, spec.context_parallel_size
    sp, ep = spec.sequence_parallel_size, spec.expert_model_parallel_size
    return Layout(nnodes=spec.nnodes, nproc_per_node=nproc, world=world, tp=tp, pp=pp, cp=cp, ep=ep,
                  etp=spec.expert_tensor_parallel_size, sp=sp, dp=max(1, world // (tp * pp * cp * sp)))
