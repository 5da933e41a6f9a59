"""Cluster tab: the local machine by default; add / remove SSH nodes or load a hostfile; run
pre-flight and show its node x check table."""
from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import gradio as gr

from backend.cluster.slurm import SlurmTarget
from backend.job.cluster import Cluster, DEVICES, HostfileError, local_cluster, parse_hostfile_text
from studio.cluster_view import (NODE_COLUMNS, NODE_FORM_KEYS, SLURM_KEYS, cluster_summary, node_rows, preflight_html,
                                 put_node, remove_node, slurm_form, slurm_settings, slurm_summary)
from studio.context import Studio
from studio.errors import user_message
from studio.train_view import check_form, form_values, problems_md


def build() -> dict[str, Any]:
    c: dict[str, Any] = {}
    c["target"] = gr.Radio(TARGETS, value=SSH, label="Run on", elem_id="cluster-target",
                           info="The nodes below over SSH, or a Slurm partition: the job is submitted with sbatch "
                                "from this machine (a Slurm login node) and runs on the nodes Slurm allocates.")
    c["target_summary"] = gr.Markdown(elem_id="cluster-target-summary")
    c["summary"] = gr.Markdown(elem_id="cluster-summary")
    c["nodes"] = gr.Dataframe(headers=NODE_COLUMNS, interactive=False, label="Nodes",
                              elem_id="cluster-nodes", wrap=True)
    c["message"] = gr.Markdown(elem_id="cluster-message")
    with gr.Row():
        c["use_local"] = gr.Button("Use this machine only", size="sm")
        c["remove_host"] = gr.Dropdown(label="Node to remove", choices=[], scale=2, elem_id="cluster-remove-host")
        c["remove"] = gr.Button("Remove node", size="sm")
    with gr.Accordion("Add or change a node (SSH)", open=False):
        with gr.Row():
            c["host"] = gr.Textbox(label="Host · host", info="Name used in logs and the hostfile; an existing host is replaced.")
            c["slots"] = gr.Number(label="GPUs · slots", info="Worker processes on this node (its GPUs, or CPU slots).", value=1, precision=0)
            c["addr"] = gr.Textbox(label="Address · addr", info="Address the other nodes reach it at; empty = host.")
            c["device"] = gr.Dropdown(label="Device · device", choices=list(DEVICES), value="cuda")
        with gr.Row():
            c["ssh_user"] = gr.Textbox(label="SSH user · ssh_user", info="Empty = your user name.")
            c["ssh_port"] = gr.Number(label="SSH port · ssh_port", value=22, precision=0)
            c["ssh_key"] = gr.Textbox(label="SSH key file · ssh_key", info="Private key path; passwords are never stored.")
            c["python"] = gr.Textbox(label="Python · python", info="Interpreter on the node with swift-studio installed.", value="python3")
        c["setup"] = gr.Textbox(label="Setup line", elem_id="cluster-setup",
                                info="Shell run before every command on this node, e.g. 'source ~/venv/bin/activate' "
                                     f"or 'module load cuda'; empty = keep the node's line (see the table), "
                                     f"'{CLEAR_SETUP}' = none.")
        c["add"] = gr.Button("Add / update node", variant="secondary")
    with gr.Accordion("Hostfile", open=False):
        c["hostfile"] = gr.Textbox(label="Hostfile", lines=4, elem_id="cluster-hostfile",
                                   info="DeepSpeed format: 'node1 slots=8 addr=10.0.0.1 ssh_user=ubuntu ...', one node per line.")
        with gr.Row():
            c["apply_hostfile"] = gr.Button("Use this hostfile", size="sm")
            c["upload_hostfile"] = gr.UploadButton("Load hostfile…", size="sm", file_count="single")
    with gr.Accordion("Slurm partition", open=False, elem_id="cluster-slurm"):
        with gr.Row():
            c["slurm_partition"] = gr.Textbox(label="Partition · partition", elem_id="slurm-partition")
            c["slurm_gpus_per_node"] = gr.Number(label="GPUs per node · gpus_per_node", value=0, precision=0,
                                                 info="--gres=gpu:N; 0 = a CPU job", elem_id="slurm-gpus")
            c["slurm_cpus_per_task"] = gr.Number(label="CPUs per task · cpus_per_task", value=None, precision=0,
                                                 info="Empty = the job's nproc_per_node", elem_id="slurm-cpus")
            c["slurm_time_limit"] = gr.Textbox(label="Time limit · time_limit", elem_id="slurm-time",
                                               info="Minutes, HH:MM:SS or D-HH:MM:SS; empty = the partition's")
        with gr.Row():
            c["slurm_account"] = gr.Textbox(label="Account · account", info="Empty = your default account",
                                            elem_id="slurm-account")
            c["slurm_python"] = gr.Textbox(label="Python · python", value="python3", elem_id="slurm-python",
                                           info="Interpreter on the compute nodes with swift-studio installed")
            c["slurm_extra"] = gr.Textbox(label="More #SBATCH options · extra", lines=2, elem_id="slurm-extra",
                                          info="One per line, e.g. qos=high or --constraint=a100 (scheduling "
                                               "options only)")
        c["use_slurm"] = gr.Button("Use this partition", size="sm", elem_id="slurm-use")
    with gr.Row(equal_height=True):
        c["preflight"] = gr.Button("Run pre-flight", variant="primary", elem_id="cluster-preflight", scale=3)
        c["bandwidth"] = gr.Checkbox(label="Measure all-reduce bandwidth", value=False, scale=1,
                                     info="Starts a short torchrun across the nodes (a few seconds more).")
    c["preflight_report"] = gr.HTML(elem_id="preflight-report")
    c["price"] = gr.Number(label="Price per GPU-hour (optional, any currency)", minimum=0, elem_id="cluster-price",
                           info="The Monitor and the Runs table show each run's cost at this price.")
    return c


SSH, SLURM = "SSH nodes", "Slurm partition"
TARGETS = [SSH, SLURM]


def wire_preflight(c: dict[str, Any], studio: Studio, state: gr.State, slurm_state: gr.State,
                   form: dict[str, gr.components.Component]) -> None:
    """Pre-flight of the current cluster for the job on the Train tab; while that form has errors
    the job-specific checks (GPU count, output directory, interface) use the defaults. On a Slurm
    partition: what the login node can check (the partition exists and has nodes the job fits on)."""

    def on_preflight(data: dict):
        cluster, settings = data[state], data[slurm_state]
        view = check_form(form_values(form, data), cluster, settings)
        spec = view.spec if view.ok else None
        if settings is not None:
            yield from slurm_preflight(studio, spec, settings)
            return
        note = "" if spec else " The Train form has errors, so the job's own settings are not checked."
        yield f"<p>Pre-flight on {len(cluster.nodes)} node(s)… (login, clock, packages, GPUs, disk, network).{note}</p>"
        try:
            report = studio.manager.preflight(cluster, spec, bandwidth=bool(data[c["bandwidth"]]))
        except Exception as exc:  # noqa: BLE001 - one line on the page, the traceback in the server log
            yield f"<p>{html.escape(user_message('Pre-flight', exc))}</p>"
            return
        yield preflight_html(report)

    c["preflight"].click(on_preflight, {state, slurm_state, c["bandwidth"], *form.values()}, [c["preflight_report"]])


def slurm_preflight(studio: Studio, spec, settings: dict[str, Any]):
    """The partition check from the login node, as page updates; the checks on the nodes themselves
    run in the job (the pre-flight inside the allocation)."""
    target, problems = SlurmTarget.for_job(spec, **settings)
    if problems:
        yield "<p>✖ The Slurm settings have problems:</p><ul>" + "".join(
            f"<li><b>{html.escape(p.field)}</b>: {html.escape(p.message)}</li>" for p in problems) + "</ul>"
        return
    yield f"<p>Checking partition {html.escape(target.partition)} with sinfo…</p>"
    try:
        unfit = studio.manager.check_partition(target)
    except Exception as exc:  # noqa: BLE001 - one line on the page, the traceback in the server log
        yield f"<p>✖ {html.escape(user_message('The partition check', exc))}</p>"
        return
    if unfit:
        yield "<p>✖ " + "<br>".join(f"<b>{html.escape(p.field)}</b>: {html.escape(p.message)}" for p in unfit) + "</p>"
        return
    yield (f"<p id='slurm-preflight-ok'>✔ Partition <b>{html.escape(target.partition)}</b> has {target.nodes} node(s) "
           "this job fits on. The job checks its nodes itself when it starts, before any worker: versions, GPUs, "
           "disk, interfaces and a shared output directory, on every node of the allocation."
           + ("" if spec else " The Train form has errors, so the job's own node count is not checked.") + "</p>")


CLEAR_SETUP = "-"  # typed as a node's setup line: remove it


def put_in_inventory(studio: Studio, row: dict[str, Any], setup: str | None) -> tuple[Cluster, dict[str, str]]:
    """Add or change one node (the node form's `row` and setup line) in the inventory as stored
    now, not in a page's copy that another page or studio may have changed since; returns the
    cluster and its setup lines. An empty line keeps the node's, CLEAR_SETUP removes it. Raises
    HostfileError for a bad field, and where the inventory cannot be read, writing nothing."""
    new = put_node(studio.read_inventory()[0], row)
    host, line = str(row.get("host", "")).strip(), (setup or "").strip()
    return new, studio.save_cluster(new, {host: "" if line == CLEAR_SETUP else line} if line else None)


def show_cluster(cluster: Cluster, setups: dict[str, str], message: str = "") -> tuple:
    """Every view of the cluster, from the cluster (also the state itself) and its setup lines."""
    return (cluster, cluster_summary(cluster), node_rows(cluster, setups), cluster.to_hostfile(),
            gr.update(choices=[n.host for n in cluster.nodes], value=None), message)


def wire_slurm(c: dict[str, Any], studio: Studio, slurm_state: gr.State) -> None:
    """The target switch and the Slurm fields: the settings (None: the SSH nodes) go into
    `slurm_state`, which the Train tab checks and launches with, and are kept for the next visit."""
    fields = [c[f"slurm_{key}"] for key in SLURM_KEYS]
    outputs = [slurm_state, c["target"], c["target_summary"], c["message"]]

    def shown(settings: dict[str, Any] | None, message: str = "") -> tuple:
        summary = slurm_summary(settings) if settings else "**Target: the nodes below, over SSH**"
        return settings, SLURM if settings else SSH, summary, message

    def on_target(current: dict[str, Any] | None, choice: str, *values) -> tuple:
        if choice != SLURM:
            return saved(None, "Using the SSH nodes.")
        settings = slurm_settings(dict(zip(SLURM_KEYS, values)))
        _, problems = SlurmTarget.for_job(None, **settings)
        if problems:  # the target stays what it was
            return (gr.skip(), SLURM if current else SSH, gr.skip(), "**Slurm partition not used:**\n"
                    + "\n".join(f"- ✖ **{p.field}**: {p.message}" for p in problems))
        return saved(settings, f"Using Slurm partition `{settings['partition']}`.")

    def saved(settings: dict[str, Any] | None, message: str) -> tuple:
        try:
            studio.save_slurm_settings(settings)
        except OSError as exc:
            message += f" (not kept for the next visit: {exc})"
        return shown(settings, message)

    c["target"].input(on_target, [slurm_state, c["target"], *fields], outputs)
    c["use_slurm"].click(lambda current, *values: on_target(current, SLURM, *values), [slurm_state, *fields], outputs)

    def on_load() -> tuple:
        settings = studio.slurm_settings()
        return (*shown(settings)[:3], *(slurm_form(settings) if settings else [gr.skip()] * len(fields)))

    c["load_slurm"] = dict(fn=on_load, inputs=None, outputs=[slurm_state, c["target"], c["target_summary"], *fields])


def wire(c: dict[str, Any], studio: Studio, state: gr.State, slurm_state: gr.State) -> None:
    outputs = [state, c["summary"], c["nodes"], c["hostfile"], c["remove_host"], c["message"]]

    def show(cluster: Cluster, message: str = "") -> tuple:
        try:
            stored = studio.save_cluster(cluster)
        except Exception as exc:  # noqa: BLE001 - the cluster is still used on this page
            stored = {}
            message += f" (not saved in the node inventory: {user_message('Saving the nodes', exc)})"
        return show_cluster(cluster, stored, message)

    def refused(cluster: Cluster, message: str) -> tuple:
        return cluster, gr.skip(), gr.skip(), gr.skip(), gr.skip(), message

    def failed(cluster: Cluster, exc: HostfileError) -> tuple:
        return refused(cluster, "**Not applied:**\n" + problems_md(exc.problems))

    def on_add(cluster: Cluster, setup: str, *values) -> tuple:
        row = dict(zip(NODE_FORM_KEYS, values))
        try:
            new, lines = put_in_inventory(studio, row, setup)
        except HostfileError as exc:
            return failed(cluster, exc)
        except Exception as exc:  # noqa: BLE001 - nothing is written while the inventory is unknown
            return refused(cluster, f"Not saved: {user_message('The node inventory', exc)}")
        return show_cluster(new, lines, f"Node `{row['host'].strip()}` saved.")

    def on_remove(cluster: Cluster, host: str | None) -> tuple:
        if not host:
            return refused(cluster, "Pick the node to remove first.")
        try:
            return show(remove_node(studio.read_inventory()[0], host), f"Node `{host}` removed.")
        except HostfileError:
            return refused(cluster, "A cluster needs at least one node; add another before removing this one, "
                                    "or use this machine only.")
        except Exception as exc:  # noqa: BLE001 - nothing is written while the inventory is unknown
            return refused(cluster, f"Not removed: {user_message('The node inventory', exc)}")

    def on_hostfile(cluster: Cluster, text: str, source: str = "hostfile") -> tuple:
        try:
            return show(parse_hostfile_text(text or "", source=source), f"Loaded {source}.")
        except HostfileError as exc:
            return failed(cluster, exc)

    def on_upload(cluster: Cluster, file: str) -> tuple:
        path = Path(file)
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            return refused(cluster, f"Cannot read {path.name}: {exc}")
        return on_hostfile(cluster, text, source=path.name)

    c["add"].click(on_add, [state, c["setup"], *(c[k] for k in NODE_FORM_KEYS)], outputs)
    c["remove"].click(on_remove, [state, c["remove_host"]], outputs)
    c["apply_hostfile"].click(on_hostfile, [state, c["hostfile"]], outputs)
    c["upload_hostfile"].upload(on_upload, [state, c["upload_hostfile"]], outputs)
    c["use_local"].click(lambda: show(local_cluster(), "Using this machine."), None, outputs)
    def on_load() -> tuple:
        try:
            return show_cluster(*studio.read_inventory())
        except Exception as exc:  # noqa: BLE001 - the page still works on this machine
            why = user_message("Reading the node inventory", exc)
            return show_cluster(local_cluster(), {}, f"Showing this machine: {why}. Node edits are not saved until "
                                                     "it can be read.")

    c["on_load"] = on_load
    wire_slurm(c, studio, slurm_state)
    c["price"].input(studio.save_gpu_hour_price, [c["price"]], None)
    c["load_price"] = lambda: studio.gpu_hour_price()
    c["outputs"] = outputs
