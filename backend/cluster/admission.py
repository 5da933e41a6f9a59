"""Admission: a run starts only where its processes fit beside the runs already holding the nodes.

Pure: the manager passes the active attempts it read from the database and the ranks it found
running on each node. Attempts are ordered by their database id, which the database hands out one
at a time, so when two runs of one database are submitted at once (from two processes, even)
exactly the later one yields: each checks only the attempts recorded before its own, and both rows
exist before either check runs. What runs on a node counts too, whichever database (another
studio, a CLI with `--db`) or none still knows of it: the ranks carrying a run's tag.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
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


def busy_nodes(new: Holding, nodes: Iterable[Node], active: Iterable[Holding],
               running: Mapping[str, Mapping[str, int]] | None = None) -> list[tuple[Node, str]]:
    """Why `new` cannot start now: each of its nodes where the attempts recorded before it, or the
    ranks `running` there (node key → run id → ranks), already hold slots that leave too few for
    it, with a message naming those runs."""
    earlier = [h for h in active if h.attempt_id < new.attempt_id and h.run_id != new.run_id]
    out = []
    for node in nodes:
        key = node_key(node)
        wanted = new.processes.get(key, 0)
        held = {h.run_id: (h.processes[key], "") for h in earlier if h.processes.get(key)}
        for run_id, ranks in (running or {}).get(key, {}).items():
            if run_id != new.run_id and ranks > held.get(run_id, (0, ""))[0]:
                held[run_id] = (ranks, "" if run_id in held else " running there")
        used = sum(n for n, _ in held.values())
        if wanted and used + wanted > node.slots:
            unit = "GPUs" if node.device == "cuda" else "CPU cores"
            names = ", ".join(f"run {run_id} ({n}{where})" for run_id, (n, where) in held.items())
            out.append((node, f"{node.host} is busy: {names} hold {used} of its {node.slots} {unit}, and this job "
                              f"needs {wanted}; wait for them to finish, stop them, or lower nproc_per_node"))
    return out
