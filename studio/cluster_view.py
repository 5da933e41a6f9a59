"""Pure helpers behind the Cluster tab: edit a node list and turn it into table rows.

Every edit goes through `backend.job.cluster.cluster_from_dicts`, so the tab accepts exactly what a
hostfile accepts and reports problems the same way (HostfileError naming the node and key).
"""
from __future__ import annotations

import html
import math
from typing import Any

from backend.job.cluster import Cluster, cluster_from_dicts

NODE_COLUMNS = ["host", "address", "slots", "device", "GPUs", "GPU memory (GiB)", "SSH", "python", "setup line"]
NODE_FORM_KEYS = ("host", "slots", "addr", "ssh_user", "ssh_port", "ssh_key", "python", "device")


def node_rows(cluster: Cluster, setups: dict[str, str] | None = None) -> list[list[Any]]:
    """The nodes table; `setups`: the inventory's setup line per host (run before every command there)."""
    rows = []
    for n in cluster.nodes:
        # SSH goes to the host name from this machine; `addr` is what the other nodes use for the rendezvous.
        ssh = "local (no SSH)" if n.local else f"{n.ssh_user + '@' if n.ssh_user else ''}{n.host}:{n.ssh_port}"
        gpus = ", ".join(n.gpu_names) if n.gpu_names else ("CPU slots" if n.device == "cpu" else "not probed")
        mem = round(n.gpu_mem_gib, 1) if n.gpu_mem_gib else ""
        rows.append([n.host, n.address, n.slots, n.device, gpus, mem, ssh, n.python, (setups or {}).get(n.host, "")])
    return rows


def put_node(cluster: Cluster, row: dict[str, Any]) -> Cluster:
    """Add a node, or replace the node with the same host (to change its slots, key, ...).

    Raises HostfileError naming the bad key. Empty form fields fall back to the node defaults.
    """
    clean = {k: v for k, v in row.items() if k in NODE_FORM_KEYS and v not in (None, "")}
    if isinstance(clean.get("slots"), float):
        clean["slots"] = int(clean["slots"]) if clean["slots"] == int(clean["slots"]) else clean["slots"]
    if isinstance(clean.get("ssh_port"), float):
        clean["ssh_port"] = int(clean["ssh_port"])
    host = str(clean.get("host", "")).strip()
    clean["host"] = host
    rows = [n.to_dict() for n in cluster.nodes if n.host != host]
    existing = next((n for n in cluster.nodes if n.host == host), None)
    if existing is not None and existing.local:
        # The studio's own machine keeps its discovered GPUs; only its slot count is editable.
        merged = existing.to_dict() | {"slots": clean.get("slots", existing.slots)}
    else:
        merged = clean
    index = next((i for i, n in enumerate(cluster.nodes) if n.host == host), len(rows))
    rows.insert(index, merged)
    return cluster_from_dicts(rows, source="nodes")


def remove_node(cluster: Cluster, host: str) -> Cluster:
    """The cluster without `host`. Raises HostfileError when that would leave no node."""
    rows = [n.to_dict() for n in cluster.nodes if n.host != host]
    return cluster_from_dicts(rows, source="nodes")


def cluster_summary(cluster: Cluster) -> str:
    slots = sum(n.slots for n in cluster.nodes)
    kind = "GPUs" if cluster.backend == "nccl" else "CPU slots (gloo)"
    where = "this machine" if cluster.is_local else f"{len(cluster.nodes)} node(s)"
    return f"**{where}** · {slots} {kind} in total · backend `{cluster.backend}`"


SLURM_KEYS = ("partition", "gpus_per_node", "cpus_per_task", "time_limit", "account", "python", "extra")
"""The Cluster tab's Slurm fields: `backend.cluster.slurm.SlurmTarget.for_job`'s arguments."""


def slurm_settings(values: dict[str, Any]) -> dict[str, Any]:
    """The Slurm fields (or settings as stored, which a hand edit may have changed) as given to
    `SlurmTarget.for_job`: only its keys, text stripped (empty = not set), whole numbers as int (a
    fraction is kept, for the target's own check to name), the extra options one per line."""
    out: dict[str, Any] = {}
    for key in SLURM_KEYS:
        value = values.get(key)
        if key == "extra":
            lines = value if isinstance(value, list) else str(value or "").splitlines()
            out[key] = [str(line).strip() for line in lines if str(line).strip()]
        elif key in ("gpus_per_node", "cpus_per_task"):
            whole = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                     and value == int(value))
            out[key] = int(value) if whole else (None if value in (None, "") else value)
        else:
            out[key] = str(value or "").strip() or None
    out["gpus_per_node"] = out["gpus_per_node"] or 0
    return out


def slurm_form(settings: dict[str, Any] | None) -> list[Any]:
    """The Slurm fields' values for stored settings (the inverse of `slurm_settings`)."""
    settings = settings or {}
    return [("\n".join(settings.get(k) or []) if k == "extra" else settings.get(k)) for k in SLURM_KEYS]


def slurm_summary(settings: dict[str, Any]) -> str:
    gpus = settings.get("gpus_per_node") or 0
    cpus = settings.get("cpus_per_task")
    per_node = f"{gpus} GPU(s)" if gpus else (f"{cpus} CPU(s)" if cpus else "the job's nproc_per_node in CPUs")
    return (f"**Slurm partition `{settings.get('partition') or '?'}`** · {per_node} per node · as many nodes as the "
            "job's nnodes · submitted with sbatch from this machine")


STATUS_MARK = {"ok": "✔", "warning": "⚠", "error": "✖", "skipped": "–"}
"""The mark of a check status or a problem / alert severity, wherever the studio shows one."""
PREFLIGHT_COLOUR = {"ok": "#dcfce7", "warning": "#fef9c3", "error": "#fee2e2", "skipped": "#f4f4f5"}


def preflight_html(report: Any) -> str:
    """The node × check grid of a backend.cluster.preflight.PreflightReport: one row per check, one
    column per node, each cell the status, the reason and (for problems) the fix."""
    nodes, checks, cells = report.table()
    head = "".join(f"<th>{html.escape(n)}</th>" for n in nodes)
    rows = []
    for check in checks:
        tds = []
        for node in nodes:
            r = cells.get((node, check))
            if r is None:
                tds.append("<td></td>")
                continue
            fix = f"<br><b>Fix:</b> {html.escape(r.fix)}" if r.fix and r.status in ("warning", "error") else ""
            tds.append(f"<td style='background:{PREFLIGHT_COLOUR.get(r.status, '#fff')}' data-status='{r.status}'>"
                       f"{STATUS_MARK.get(r.status, '')} {html.escape(r.reason)}{fix}</td>")
        rows.append(f"<tr><th>{html.escape(check)}</th>{''.join(tds)}</tr>")
    verdict = ("✔ all checks passed" if report.ok and not report.warnings()
               else f"{len(report.errors())} error(s), {len(report.warnings())} warning(s)")
    return (f"<div id='preflight-grid'><p><b>Pre-flight:</b> {verdict} in {report.seconds:.1f} s</p>"
            f"<table class='preflight'><tr><th>check</th>{head}</tr>{''.join(rows)}</table></div>")


def preflight_problems_md(report: Any) -> str:
    """The errors and warnings of a pre-flight report as a list: node, check, reason and fix."""
    lines = []
    for r in [*report.errors(), *report.warnings()]:
        fix = f" Fix: {r.fix}" if r.fix else ""
        lines.append(f"- {STATUS_MARK[r.status]} **{r.node}** · {r.check}: {r.reason}.{fix}")
    return "\n".join(lines)
