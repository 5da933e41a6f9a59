"""What the Train tab shows for a form state: per-field problems, the derived layout, the memory
estimate, the command preview, the YAML. Composes the backend's pure functions; no Gradio here,
so it is unit-tested without a browser.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from backend.cluster.slurm import SlurmTarget
from backend.job.advisor import VARIED, advise, hardware_of
from backend.job.capabilities import PARALLEL_FIELDS, Fix, engine_fixes, parallel_refusals
from backend.job.cluster import Cluster
from backend.job.layout import Layout
from backend.job.spec import JobSpec, Problem, parse_spec
from backend.job.validate import Assessment, assess
from studio.cluster_view import STATUS_MARK
from studio.commands import preview
from studio.form import GROUPS, VIEWS, form_to_data, problems_by_field


@dataclass
class TrainView:
    spec: JobSpec | None
    field_problems: dict[str, list[Problem]] = field(default_factory=dict)
    other_problems: list[Problem] = field(default_factory=list)
    layout_md: str = ""
    memory_md: str = ""
    commands: str = ""
    yaml_text: str = ""
    ds_json: str = ""
    greyed: dict[str, str] = field(default_factory=dict)
    """Parallel dimensions this cluster and engine cannot run, with the reason (the form greys them)."""
    assessment: Assessment | None = None
    """What all of the above was computed from, once; a launch of this form reuses it."""
    slurm: SlurmTarget | None = None
    """The Slurm target of this job, where the Cluster tab targets a partition."""
    fixes: list[Fix] = field(default_factory=list)
    """The refusals with one remedy (the engine a parallel dimension needs, ...): one click each."""

    @property
    def ok(self) -> bool:
        return self.spec is not None and not any(
            p.severity == "error" for ps in self.field_problems.values() for p in ps
        ) and not any(p.severity == "error" for p in self.other_problems)


def form_values(form: dict[str, Any], data: dict) -> dict[str, Any]:
    """The form's values by field name, from a handler's inputs (`form` maps field names to the
    components that are the keys of `data`)."""
    return {name: data[component] for name, component in form.items()}


def check_key(values: dict[str, Any], cluster: Cluster, slurm: dict[str, Any] | None = None) -> tuple:
    """What a check of the form reads: the spec mapping of the widget values, the cluster and the
    Slurm settings. The browser echoes a fill's values back as a change of every field; the same
    key means the same check, so the echo is not checked a second time."""
    data, problems = form_to_data(values)
    return data, problems, cluster, slurm


def check_form(values: dict[str, Any], cluster: Cluster, slurm: dict[str, Any] | None = None) -> TrainView:
    """Everything the Train tab derives from the form and the cluster, computed afresh on every
    edit. `slurm`: the Cluster tab's Slurm settings, where it targets a partition; the job is then
    checked on the allocation they describe, and the preview is the batch script."""
    data, problems = form_to_data(values)
    spec, spec_problems = parse_spec(data, source="form")
    problems += spec_problems
    view = TrainView(spec=None if problems else spec)
    if view.spec is not None and slurm is not None:
        view.slurm, slurm_problems = SlurmTarget.for_job(view.spec, **slurm)
        problems += slurm_problems
        if not slurm_problems:
            cluster = view.slurm.cluster()
    if view.spec is not None:
        view.assessment = assessed = assess(view.spec, cluster)
        problems += assessed.problems
        view.yaml_text = view.spec.to_yaml()
        view.greyed = greyed_dimensions(view.spec, assessed.layout, cluster)
        view.fixes = engine_fixes(view.spec)
        invalid = sorted({p.field for p in problems if p.severity == "error" and p.field in LAYOUT_FIELDS})
        if invalid:  # the ranks it would draw (and the memory divided among them) cannot run
            view.layout_md = f"**Layout**: ✖ none: fix {', '.join(f'`{f}`' for f in invalid)} first"
            view.memory_md = "**Memory per GPU**: not estimated for a layout that cannot run"
        else:
            view.layout_md = layout_md(assessed.layout)
            view.memory_md = memory_md(assessed)
        if not any(p.severity == "error" for p in problems):
            view.commands, ds_config = preview(assessed, view.slurm)
            view.ds_json = json.dumps(ds_config, indent=2) if ds_config else "// DeepSpeed is not used (deepspeed is empty)"
        else:
            view.commands = "# fix the problems marked on the form to see the launch commands"
    view.field_problems, view.other_problems = problems_by_field(problems)
    return view


LAYOUT_FIELDS = ("nnodes", "nproc_per_node", *PARALLEL_FIELDS)


def greyed_dimensions(spec: JobSpec, layout: Layout, cluster: Cluster) -> dict[str, str]:
    """The parallel dimensions left at 1 that cannot go above it here: one rank has nothing to split;
    otherwise what the worker refuses with this engine on these nodes (backend.job.capabilities)."""
    if layout.world == 1:
        return {name: "this job has one rank on this cluster: nothing to split (raise nproc_per_node or nnodes)"
                for name in PARALLEL_FIELDS if getattr(spec, name) == 1}
    return parallel_refusals(spec, cluster.devices(spec.nnodes))


def problems_md(problems: list[Problem]) -> str:
    if not problems:
        return ""
    return "\n".join(f"- {STATUS_MARK[p.severity]} **{p.field}**: {p.message}" for p in problems)


def field_link(name: str) -> str:
    """A link that scrolls the page to a form field (its component's elem_id is `f-<name>`)."""
    return f"[{VIEWS[name].label}](#f-{name})"


def problem_lines(view: TrainView, errors_only: bool = False) -> list[str]:
    """The form's problems as list items, errors first, in form order; a field's problem links to
    the field."""
    rows = [(p, name) for name in VIEWS for p in view.field_problems.get(name, [])]
    rows += [(p, None) for p in view.other_problems]
    if errors_only:
        rows = [(p, name) for p, name in rows if p.severity == "error"]
    rows.sort(key=lambda row: row[0].severity != "error")
    lines = []
    for p, name in rows:
        where = f"**{p.field}**" if name is None else field_link(name) + (f" `{p.field}`" if p.field != name else "")
        lines.append(f"- {STATUS_MARK[p.severity]} {where}: {p.message}")
    return lines


def fix_label(fix: Fix) -> str:
    """A fix button's text: what it sets."""
    return f"Fix: set {fix.text()}"


def fix_for_label(view: TrainView, label: str) -> Fix | None:
    """The fix a clicked button shows (`label`) among the form's fixes as checked now; None where the
    form has changed since the button was drawn, so a stale button applies nothing rather than
    whichever fix now sits in its place."""
    return next((fix for fix in view.fixes if fix_label(fix) == label), None)


def launch_refusal_md(view: TrainView) -> str:
    errors = problem_lines(view, errors_only=True)
    which = "this problem" if len(errors) == 1 else f"these {len(errors)} problems"
    return f"✖ **Not launched**: fix {which} first.\n\n" + "\n".join(errors)


def groups_with_errors(view: TrainView) -> list[str]:
    """Titles of the form groups holding a field with an error: a collapsed group hides its mark."""
    return [title for title, _, names in GROUPS
            if any(p.severity == "error" for name in names for p in view.field_problems.get(name, []))]


def layout_md(layout: Layout) -> str:
    """The derived layout as a one-row table: what the ranks will be."""
    head = "| nodes × procs | world | DP | TP | PP | CP | EP | SP |\n|---|---|---|---|---|---|---|---|\n"
    row = (f"| {layout.nnodes} × {layout.nproc_per_node} | {layout.world} | {layout.dp} | {layout.tp} | "
           f"{layout.pp} | {layout.cp} | {layout.ep} | {layout.sp} |")
    return "**Layout**\n\n" + head + row


def data_key(spec: JobSpec) -> str:
    """What a data preview of `spec` measured: the job but for the fields the advisor varies (the
    model, its tokenizer and template, the data, max_length and the rest stay)."""
    return json.dumps({k: v for k, v in spec.model_dump().items() if k not in VARIED}, sort_keys=True, default=str)


def advice_view(view: TrainView, tokens_per_sample: float | None = None) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """The layout advisor on the checked form: its summary and table (Markdown), and each row as
    (its label, the fields it sets); no rows while the form has errors or the model is unknown.
    `tokens_per_sample`: the data preview's mean sample length, where it previewed this data."""
    if view.spec is None or not view.ok or view.assessment is None:
        return "Fix the problems marked on the form first: the advisor starts from a job that validates.", []
    assessed = view.assessment
    if assessed.model is None:
        return f"No suggestions: the model's config is needed ({assessed.memory_note}).", []
    advice = advise(view.spec, assessed.model, assessed.cluster, hardware_of(assessed.cluster, view.spec.nnodes),
                    tokens_per_sample)
    lengths = (f"Samples of {tokens_per_sample:,.0f} tokens on average (the data preview's). " if tokens_per_sample
               and not view.spec.packing else f"Samples of max_length {view.spec.max_length} tokens"
               + (" (packed rows). " if view.spec.packing else "; preview the data for its own lengths. "))
    if not advice.rows:
        return lengths + advice.summary() + ". **No configuration fits**: lower max_length or the global batch, or add GPUs.", []
    table = ["| # | engine | ranks | predicted GiB per GPU | predicted tokens/s |", "|---|---|---|---|---|"]
    rows = []
    for rank, row in enumerate(advice.rows, 1):
        table.append(f"| {rank} | {row.engine} | {row.layout} | {row.memory_gib:.1f} | {row.tokens_per_s:,.0f} |")
        rows.append((f"{rank}. {row.engine} {row.layout}: {row.changes()}", row.fields))
    return lengths + advice.summary() + ".\n\n" + "\n".join(table), rows


def memory_md(assessed: Assessment) -> str:
    """The per-GPU memory estimate against the smallest GPU of the nodes in use."""
    est = assessed.memory
    if est is None:
        return f"**Memory per GPU**: {assessed.memory_note}"
    nodes = assessed.cluster.nodes[: assessed.spec.nnodes]
    cpu_only = all(n.device == "cpu" for n in nodes)
    gpu_mems = [n.gpu_mem_gib for n in nodes if n.gpu_mem_gib]
    if cpu_only:
        against = "CPU run: held in host memory"
    elif gpu_mems:
        limit = min(gpu_mems)
        share = est.total_gib / limit
        mark = "✖ does not fit" if share > 1 else ("⚠ tight" if share > 0.9 else "✔ fits")
        against = f"{mark}: {share:.0%} of {limit:.1f} GiB (smallest GPU in use)"
    else:
        against = "GPU memory of the nodes not known yet (run pre-flight)"
    rows = [("parameters", est.parameters_gib), ("gradients", est.gradients_gib),
            ("optimizer", est.optimizer_gib), ("activations", est.activations_gib), ("other", est.other_gib)]
    table = "| part | GiB |\n|---|---|\n" + "\n".join(f"| {name} | {value:.2f} |" for name, value in rows)
    if est.offloaded_gib:
        table += f"\n| offloaded to host | {est.offloaded_gib:.2f} |"
    notes = "".join(f"\n- {note}" for note in est.notes)
    return (f"**Memory per GPU: ~{est.total_gib:.2f} GiB** · {against}  \n"
            f"{est.trainable_params:,} of {est.total_params:,} parameters trained\n\n{table}{notes}")
