"""Train tab: the job spec as a grouped form, checked live, with layout, memory, commands,
presets, import and launch."""
from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import gradio as gr
import yaml

from backend.job.capabilities import PARALLEL_FIELDS as PARALLEL, apply_fixes
from backend.job.cluster import Cluster
from backend.job.msswift import CommandError, import_command
from backend.job.spec import parse_spec
from backend.runs.preview import PreviewError, data_preview
from studio.cluster_view import STATUS_MARK, preflight_problems_md
from studio.context import Studio
from studio.errors import user_message
from studio.form import GROUPS, VIEWS, FieldView, default_form, spec_to_form
from studio.preview_view import lengths_figure, mean_tokens, preview_html
from studio.train_view import (TrainView, advice_view, check_form, data_key, check_key, fix_for_label, fix_label, form_values,
                                groups_with_errors, launch_refusal_md, problem_lines, problems_md)


# Presses #form-check after each edit the user makes in a form field (elem_id f-<name>), once
# the component has taken the new value (the next frame).
WATCH_EDITS_JS = """() => {
  if (window.swiftStudioWatchesEdits) return;
  window.swiftStudioWatchesEdits = true;
  document.addEventListener("input", (event) => {
    if (!event.target.closest || !event.target.closest("[id^='f-']")) return;
    requestAnimationFrame(() => document.getElementById("form-check")?.click());
  }, true);
}"""


LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_dropout", "target_modules")
PREFERENCE_FIELDS = ("beta", "loss_type", "label_smoothing", "rpo_alpha", "cpo_alpha", "simpo_gamma", "ref_model",
                     "precompute_ref_log_probs")
MAX_FIXES = 3  # EP, SP and CP exclude each other: at most one engine fix, a pipeline's micro-batches and its evaluation

def _widget(view: FieldView, value: Any) -> gr.components.Component:
    common = dict(label=view.label, info=view.info, value=value, elem_id=f"f-{view.name}")
    if view.widget == "check":
        return gr.Checkbox(**common)
    if view.widget == "choice":
        return gr.Dropdown(choices=list(view.choices), allow_custom_value=view.optional, **common)
    if view.widget == "int":
        return gr.Number(precision=0, **common)
    if view.widget == "float":
        return gr.Number(**common)
    if view.widget in ("lines", "env"):
        return gr.Textbox(lines=2, max_lines=8, **common)
    return gr.Textbox(lines=1, **common)


def build(studio: Studio) -> dict[str, Any]:
    """Draws the tab; returns its components by name (the spec fields under `form`)."""
    values = default_form()
    form: dict[str, gr.components.Component] = {}
    groups: dict[str, gr.Accordion] = {}
    # The check_key of the form state last checked in this browser session.
    c: dict[str, Any] = {"form": form, "groups": groups, "checked": gr.State(None)}
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            with gr.Row(equal_height=True):
                c["preset"] = gr.Dropdown(label="Preset", choices=studio.preset_names(), value="demo",
                                          allow_custom_value=False, scale=2, elem_id="preset-name",
                                          info="'demo' trains the bundled tiny model on CPU in about a minute.")
                c["load_preset"] = gr.Button("Load preset", size="sm", elem_id="load-preset")
                c["save_name"] = gr.Textbox(label="Save as", placeholder="my-preset", scale=2, elem_id="save-name")
                c["save_preset"] = gr.Button("Save preset", size="sm", elem_id="save-preset")
                c["upload_yaml"] = gr.UploadButton("Open job YAML…", size="sm", file_types=[".yaml", ".yml"])
            with gr.Accordion("Import ms-swift command", open=False):
                c["import_text"] = gr.Textbox(label="swift sft command line", lines=3, elem_id="import-text",
                                              placeholder="swift sft --model Qwen/Qwen2.5-0.5B-Instruct --dataset data.jsonl --train_type lora ...")
                c["import"] = gr.Button("Fill the form from this command", size="sm", elem_id="import-button")
            c["form_message"] = gr.Markdown(elem_id="form-message")
            for title, is_open, names in GROUPS:
                with gr.Accordion(title, open=is_open) as groups[title]:
                    with gr.Row():
                        for name in names:
                            with gr.Column(min_width=220):
                                form[name] = _widget(VIEWS[name], values[name])
            with gr.Accordion("Data preview", open=False, elem_id="data-preview-group"):
                c["preview"] = gr.Button("Preview the data as training reads it", size="sm", elem_id="data-preview-go")
                c["preview_html"] = gr.HTML(elem_id="data-preview")
                c["preview_lengths"] = gr.Plot(visible=False, elem_id="data-preview-lengths")
        with gr.Column(scale=2):
            c["problems"] = gr.Markdown(elem_classes=["problem-list", "problem-links"], elem_id="train-problems")
            # The form's refusals that have one remedy, one button each (TrainView.fixes).
            with gr.Column():
                c["fixes"] = [gr.Button(visible=False, size="sm", elem_id=f"fix-{i}") for i in range(MAX_FIXES)]
            c["layout"] = gr.Markdown(elem_id="train-layout")
            c["memory"] = gr.Markdown(elem_id="train-memory")
            with gr.Accordion("Layout advisor", open=False, elem_id="advisor-group"):
                c["advise"] = gr.Button("Suggest layouts that fit, fastest predicted first", size="sm", elem_id="advise-go")
                c["advice"] = gr.Markdown(elem_id="advice")
                c["advice_pick"] = gr.Radio(choices=[], label="Layout to apply", visible=False, elem_id="advice-pick")
                c["advice_apply"] = gr.Button("Apply it to the form", size="sm", visible=False, elem_id="advice-apply")
                # The suggested rows and the form state they were suggested for.
                c["advice_rows"] = gr.State(None)
                # The last preview's mean sample length and the job, less what the advisor varies, it measured.
                c["preview_tokens"] = gr.State(None)
            with gr.Row():
                c["run_name"] = gr.Textbox(label="Run name", placeholder="optional", scale=2, elem_id="run-name")
                c["launch"] = gr.Button("Pre-flight and launch", variant="primary", elem_id="launch", scale=2)
            c["launch_status"] = gr.Markdown(elem_id="launch-status", elem_classes=["problem-links"])
            # Whether the launch status is a refusal: it then follows the form (render).
            c["refused"] = gr.State(False)
            c["check"] = gr.Button("Check the form", elem_id="form-check", elem_classes=["hidden-trigger"])
            with gr.Tabs():
                with gr.Tab("Commands"):
                    c["commands"] = gr.Code(label="Per-node torchrun and the equivalent swift sft", language="shell",
                                            interactive=False, elem_id="train-commands", elem_classes=["cmd-preview"])
                with gr.Tab("YAML"):
                    c["yaml"] = gr.Code(label="Job YAML", language="yaml", interactive=False, elem_id="train-yaml")
                with gr.Tab("DeepSpeed JSON"):
                    c["ds_json"] = gr.Code(label="DeepSpeed config (batch sizes filled in)", language="json",
                                           interactive=False, elem_id="train-ds-json")
    return c


def wire(c: dict[str, Any], studio: Studio, cluster_state: gr.State, slurm_state: gr.State) -> None:
    form: dict[str, gr.components.Component] = c["form"]
    view_outputs = [*form.values(), c["problems"], *c["fixes"], c["layout"], c["memory"], c["commands"], c["yaml"],
                    c["ds_json"], *c["groups"].values(), c["checked"], c["launch_status"], c["refused"]]

    def render(view: TrainView, key: tuple, values: dict[str, Any] | None = None, open_errors: bool = False,
               refused: bool = False) -> dict:
        """The view's updates for the form state `key`; with `values` they also set the form, so a
        fill is one response. `open_errors` opens the groups whose fields it marks red; `refused`:
        the launch status is the last Launch's refusal, which then lists the form's errors now."""
        updates: dict = {c["checked"]: key}
        for name, component in form.items():
            problems = view.field_problems.get(name, [])
            if problems:
                text = "; ".join(f"{STATUS_MARK[p.severity]} {p.message}" for p in problems)
                error = any(p.severity == "error" for p in problems)
                update = dict(info=text, elem_classes=["field-error" if error else "field-warning"])
            elif name in view.greyed:
                update = dict(info=f"Stays at 1 here: {view.greyed[name]}", elem_classes=["field-greyed"])
            else:
                update = dict(info=VIEWS[name].info, elem_classes=[])
            if name in PARALLEL:
                update["interactive"] = name not in view.greyed
            if name in LORA_FIELDS:  # they say nothing of a full fine-tuning
                update["visible"] = view.spec is None or view.spec.train_type != "full"
            if name in PREFERENCE_FIELDS:  # nor these of supervised fine-tuning
                update["visible"] = view.spec is None or view.spec.rlhf_type is not None
            if values is not None:
                update["value"] = values[name]
            updates[component] = gr.update(**update)
        updates[c["problems"]] = "\n".join(problem_lines(view))
        for i, button in enumerate(c["fixes"]):
            fix = view.fixes[i] if i < len(view.fixes) else None
            updates[button] = (gr.update(visible=True, value=fix_label(fix)) if fix else gr.update(visible=False))
        if open_errors:
            updates.update({c["groups"][title]: gr.update(open=True) for title in groups_with_errors(view)})
        updates[c["layout"]] = view.layout_md
        updates[c["memory"]] = view.memory_md
        updates[c["commands"]] = view.commands
        updates[c["yaml"]] = view.yaml_text
        updates[c["ds_json"]] = view.ds_json
        if refused:  # a refusal of the form as it was would contradict the problems listed above it
            updates[c["launch_status"]] = (launch_refusal_md(view) if not view.ok
                                           else "✔ The problems the last Launch named are fixed: launch again.")
        return updates

    def on_edit(data: dict) -> dict:
        values, cluster, slurm = form_values(form, data), data[cluster_state], data[slurm_state]
        key = check_key(values, cluster, slurm)
        if key == data[c["checked"]]:
            return {c["checked"]: gr.skip()}  # (an empty dict would read as one output value)
        return render(check_form(values, cluster, slurm), key, refused=data[c["refused"]])

    inputs = {*form.values(), cluster_state, slurm_state, c["refused"]}
    # Gradio's `input` of a Textbox follows keystrokes only: a paste, a drop or the browser's
    # autofill do not send it. Its `change` does, but also follows every value a fill sets, one
    # field at a time, each time with the other fields not yet filled. The browser's own `input`
    # event is the user's edit however it was made (a value set by a handler sends none): the
    # page presses the hidden check button on it. A keystroke sends both; on_edit skips a form
    # state already checked, so each state is checked once.
    gr.on([comp.input for comp in form.values()] + [c["check"].click, cluster_state.change, slurm_state.change], on_edit,
          inputs={*inputs, c["checked"]}, outputs=view_outputs, show_progress="hidden", trigger_mode="always_last",
          # one check at a time, in the order asked (Gradio runs events at once): the cluster's and the
          # Slurm target's changes on a page load each check the form, the later with both states
          concurrency_id="train-check", concurrency_limit=1)
    gr.on(None, None, js=WATCH_EDITS_JS)  # on page load

    def fill(spec: dict[str, Any], cluster: Cluster, slurm: dict | None, message: str, refused: bool) -> dict:
        values = default_form() | spec_to_form(spec)
        return (render(check_form(values, cluster, slurm), check_key(values, cluster, slurm), values, open_errors=True,
                       refused=refused) | {c["form_message"]: message})

    fill_outputs = [*view_outputs, c["form_message"]]

    def not_filled(message: str) -> dict:
        return {c["form_message"]: message}

    def on_load_preset(name: str | None, cluster: Cluster, slurm: dict | None, refused: bool = False) -> dict:
        if not name:
            return not_filled("Pick a preset first.")
        try:
            spec, problems = studio.load_preset(name)
        except Exception as exc:  # noqa: BLE001 - e.g. the bundled demo is missing from this install
            return not_filled(user_message(f"Loading preset {name}", exc))
        if spec is None:
            return not_filled(f"Preset **{name}** not loaded:\n" + problems_md(problems))
        return fill(spec, cluster, slurm, f"Loaded preset **{name}**.", refused)

    def on_save_preset(name: str, data: dict) -> tuple:
        view = check_form(form_values(form, data), data[cluster_state], data[slurm_state])
        if view.spec is None:
            return gr.skip(), "✖ Not saved: fix these first.\n\n" + "\n".join(problem_lines(view, errors_only=True))
        try:
            path = studio.save_preset(name, view.spec)
        except ValueError as exc:
            return gr.skip(), str(exc)
        return gr.update(choices=studio.preset_names(), value=path.stem), f"Saved preset **{path.stem}** to `{path}`."

    def on_upload_yaml(file: str, cluster: Cluster, slurm: dict | None, refused: bool) -> dict:
        path = Path(file)
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            return not_filled(f"Cannot read `{path.name}`: {exc}")
        spec, problems = parse_spec(data, source=path.name)
        if spec is None:
            return not_filled(f"`{path.name}` not loaded:\n" + problems_md(problems))
        return fill(spec.model_dump(), cluster, slurm, f"Loaded `{path.name}`.", refused)

    def on_import(text: str, cluster: Cluster, slurm: dict | None, refused: bool) -> dict:
        try:
            result = import_command(text or "")
        except CommandError as exc:
            return not_filled(f"Command not imported: {exc}")
        spec, problems = result.parse()
        if spec is None:
            return not_filled("Command not imported:\n" + problems_md(problems))
        notes = ([f"- translated: {n}" for n in result.notes] + [f"- ignored (no counterpart): `{i}`" for i in result.ignored]
                 + [f"- ms-swift default: {d}" for d in result.defaults])
        return fill(spec.model_dump(), cluster, slurm,
                    "Filled the form from the command." + ("\n\n" + "\n".join(notes) if notes else ""), refused)

    def on_fix(label: str, data: dict) -> dict:
        """Apply the fix the clicked button shows, if the form as checked now still offers it."""
        values, cluster, slurm = form_values(form, data), data[cluster_state], data[slurm_state]
        view = check_form(values, cluster, slurm)
        fix = fix_for_label(view, label) if view.spec is not None else None
        if fix is None:
            return not_filled(f"Nothing applied: the form changed since '{label}' was offered; see the problems above.")
        fixed = apply_fixes(view.spec, [fix])
        return fill(fixed.model_dump(), cluster, slurm, f"Set {fix.text()}: {fix.why}.", data[c["refused"]])

    for button in c["fixes"]:
        button.click(lambda data, b=button: on_fix(data[b], data), {button, *inputs}, fill_outputs)

    def on_advise(data: dict) -> dict:
        values, cluster, slurm = form_values(form, data), data[cluster_state], data[slurm_state]
        view = check_form(values, cluster, slurm)
        measured = data[c["preview_tokens"]]
        same = view.spec is not None and measured is not None and measured["data"] == data_key(view.spec)
        text, rows = advice_view(view, measured["mean"] if same else None)
        labels = [label for label, _ in rows]
        return {c["advice"]: text, c["advice_rows"]: {"rows": rows, "key": check_key(values, cluster, slurm)},
                c["advice_pick"]: gr.update(choices=labels, value=labels[0] if labels else None, visible=bool(rows)),
                c["advice_apply"]: gr.update(visible=bool(rows))}

    def on_apply_advice(data: dict) -> dict:
        """The picked row's fields onto the form, if it is still the form they were suggested for
        (a row keeps that form's global batch)."""
        values, cluster, slurm = form_values(form, data), data[cluster_state], data[slurm_state]
        suggested = data[c["advice_rows"]] or {"rows": [], "key": None}
        fields = dict((label, f) for label, f in suggested["rows"]).get(data[c["advice_pick"]])
        view = check_form(values, cluster, slurm)
        if fields is None or view.spec is None or suggested["key"] != check_key(values, cluster, slurm):
            return not_filled("Nothing applied: the form changed since these layouts were suggested (or none was "
                              "picked); suggest again.")
        changes = ", ".join(f"{k} {v}" for k, v in fields.items() if v is not None)
        return fill(view.spec.model_dump() | fields, data[cluster_state], data[slurm_state],
                    f"Applied layout {data[c['advice_pick']]}: {changes}. Its speed and memory are predictions.",
                    data[c["refused"]])

    c["advise"].click(on_advise, {c["preview_tokens"], *inputs},
                      [c["advice"], c["advice_rows"], c["advice_pick"], c["advice_apply"]])
    c["advice_apply"].click(on_apply_advice, {c["advice_pick"], c["advice_rows"], *inputs}, fill_outputs)
    c["load_preset"].click(on_load_preset, [c["preset"], cluster_state, slurm_state, c["refused"]], fill_outputs)
    c["upload_yaml"].upload(on_upload_yaml, [c["upload_yaml"], cluster_state, slurm_state, c["refused"]], fill_outputs)
    c["import"].click(on_import, [c["import_text"], cluster_state, slurm_state, c["refused"]], fill_outputs)
    save_inputs = {c["save_name"], *inputs}
    c["save_preset"].click(lambda data: on_save_preset(data[c["save_name"]], data), save_inputs,
                           [c["preset"], c["form_message"]])

    def on_page_load(cluster: Cluster, slurm: dict | None) -> dict:
        # Presets saved since the page was built (here or in another browser) are offered too.
        return on_load_preset("demo", cluster, slurm) | {c["preset"]: gr.update(choices=studio.preset_names())}

    def on_preview(data: dict) -> tuple:
        """The form's data as the worker would tokenize it (a process of its own: the studio loads
        no tokenizer), or why not."""
        view = check_form(form_values(form, data), data[cluster_state], data[slurm_state])
        if view.spec is None:
            return "✖ No preview: fix these first.<br>" + "<br>".join(
                html.escape(line) for line in problem_lines(view, errors_only=True)), gr.update(visible=False), None
        try:
            result = data_preview(view.spec)
        except PreviewError as exc:
            return f"✖ No preview: {html.escape(str(exc))}", gr.update(visible=False), None
        measured = {"data": data_key(view.spec), "mean": mean_tokens(result)}
        return (preview_html(result), gr.update(value=lengths_figure(result), visible=True),
                measured if measured["mean"] else None)

    c["preview"].click(on_preview, inputs, [c["preview_html"], c["preview_lengths"], c["preview_tokens"]])
    c["page_load"] = dict(fn=on_page_load, inputs=[cluster_state, slurm_state], outputs=[c["preset"], *fill_outputs])
    c["render"], c["view_outputs"] = render, view_outputs


def wire_launch(c: dict[str, Any], studio: Studio, cluster_state: gr.State, slurm_state: gr.State, tabs: gr.Tabs,
                monitor_run: gr.Dropdown, run_choices) -> None:
    """Launch: the form must be valid, pre-flight must pass, then the run starts and the page
    moves to the Monitor tab on it. Each stage shows while it runs. On a Slurm partition the
    pre-flight is the partition check, and the launch submits the batch script the preview shows."""
    form: dict[str, gr.components.Component] = c["form"]

    def on_launch(data: dict):
        values, cluster, slurm = form_values(form, data), data[cluster_state], data[slurm_state]
        view = check_form(values, cluster, slurm)
        if not view.ok:
            # Listed here, at the button, each linking to its field, with the fields marked.
            yield c["render"](view, check_key(values, cluster, slurm), open_errors=True, refused=True) | {c["refused"]: True}
            return
        name = (data[c["run_name"]] or "").strip() or None
        if view.slurm is not None:
            yield from submit(view, name)
            return
        yield {c["launch_status"]: f"Pre-flight on {len(cluster.nodes[: view.spec.nnodes])} node(s)…", c["refused"]: False}
        try:
            report = studio.manager.preflight(cluster, view.spec, bandwidth=False)
            if not report.ok:
                yield {c["launch_status"]: "✖ Not launched: pre-flight found errors.\n\n" + preflight_problems_md(report)}
                return
            yield {c["launch_status"]: f"Pre-flight passed in {report.seconds:.1f} s. Launching…"}
            run_id = studio.manager.launch(view.spec, cluster, name=name, assessment=view.assessment)
        except Exception as exc:  # noqa: BLE001 - one line on the page, the traceback in the server log
            yield {c["launch_status"]: user_message("Launch", exc)}
            return
        yield launched(run_id)

    def submit(view, name: str | None):
        target = view.slurm
        yield {c["launch_status"]: f"Checking Slurm partition `{target.partition}`…", c["refused"]: False}
        try:
            unfit = studio.manager.check_partition(target)
            if unfit:
                yield {c["launch_status"]: "✖ Not submitted:\n\n" + problems_md(unfit)}
                return
            yield {c["launch_status"]: f"Partition `{target.partition}` fits the job. Submitting…"}
            run_id = studio.manager.launch(view.spec, target.cluster(), name=name, assessment=view.assessment,
                                           slurm=target)
        except Exception as exc:  # noqa: BLE001 - one line on the page, the traceback in the server log
            yield {c["launch_status"]: user_message("Submitting to Slurm", exc)}
            return
        yield launched(run_id)

    def launched(run_id: str) -> dict:
        return {c["launch_status"]: f"✔ Launched run `{run_id}`.", tabs: gr.update(selected="monitor"),
                monitor_run: run_choices(run_id)}

    c["launch"].click(on_launch, {*form.values(), cluster_state, slurm_state, c["run_name"]},
                      [tabs, monitor_run, *c["view_outputs"]])
