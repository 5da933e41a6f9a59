"""Admission: a run starts only where its processes fit beside the runs already holding the nodes.

Pure: the manager passes the active attempts it read from the database. Attempts are ordered by
their database id, which the database hands out one at a time, so when two runs are submitted at
once (from two processes, even) exactly the later one yields: each checks only the attempts
recorded before its own, and both rows exist before either check runs.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from backend.job.cluster import Cluster, Node
from backend.job.layout import resolve_nproc
from backend.job.spec import JobSpec


@dataclass(frozen=True)
class Holding:
    """The processes one active attempt runs (or is about to run) on each node."""

    run_id: str
    attempt_id: int
    processes: dict[str, int]  # node address → processes


def node_key(node: Node) -> str:
    """A node is the address it is reached at (the local node's is 127.0.0.1)."""
    return node.address


def holding(run_id: str, attempt_id: int, spec: JobSpec, nodes: Iterable[Node]) -> Holding:
    nodes = tuple(nodes)
    nproc = resolve_nproc(spec, Cluster(nodes=nodes, source="attempt"))
    return Holding(run_id, attempt_id, {node_key(n): nproc for n in nodes[: spec.nnodes]})


def busy_nodes(new: Holding, nodes: Iterable[Node], active: Iterable[Holding]) -> list[tuple[Node, str]]:
    """Why `new` cannot start now: each of its nodes where the attempts recorded before it already
    hold slots that leave too few for it, with a message naming those runs."""
    earlier = [h for h in active if h.attempt_id < new.attempt_id and h.run_id != new.run_id]
    out = []
    for node in nodes:
        key = node_key(node)
        wanted = new.processes.get(key, 0)
        holders = [(h.run_id, h.processes[key]) for h in earlier if h.processes.get(key)]
        used = sum(n for _, n in holders)
        if wanted and used + wanted > node.slots:
            unit = "GPUs" if node.device == "cuda" else "CPU cores"
            names = ", ".join(f"run {run_id} ({n})" for run_id, n in holders)
            out.append((node, f"{node.host} is busy: {names} hold {used} of its {node.slots} {unit}, and this job "
                              f"needs {wanted}; wait for them to finish, stop them, or lower nproc_per_node"))
    return out
