"""Pure text and table builders for runs: status and failure panel, the runs table, the config
difference of two runs, the alert list. Inputs are the backend's records (Run, Alert, progress)."""
from __future__ import annotations

import html
import re
import time
from collections.abc import Collection, Sequence
from typing import Any

import yaml

from backend.job.layout import Layout
from backend.runs.usage import Usage
from backend.telemetry.logclass import HELP
from backend.runs.usage import format_duration
from studio.charts import NO_INDEX
from studio.errors import user_message
from studio.cluster_view import STATUS_MARK

STATE_MARK = {"created": "○", "checking": "◔", "launching": "◑", "running": "▶", "succeeded": "✔",
              "failed": "✖", "stopped": "■"}
# The states RunManager.resume takes (backend.runs.lifecycle STOPPED and FAILED; that module loads the
# database stack, which the page build leaves to the manager thread).
RESTARTABLE = ("stopped", "failed")
RESUME_LABEL = "▶ Resume from checkpoint"
RUN_AGAIN_LABEL = "▶ Run again"
RUN_COLUMNS = ["run", "status", "attempts", "started", "duration", "final loss", "eval loss", "tokens/s", "GPU-h",
               "kWh", "Wh/Mtok", "cost", "output"]


def run_title(run: Any) -> str:
    """A run as a user knows it: its name before its id, where it has a name of its own."""
    return f"{run.name} · {run.id}" if run.name and run.name != run.id else run.id


def run_choice(run: Any) -> tuple[str, str]:
    """(label, value) for a run picker."""
    return f"{STATE_MARK.get(run.state, '')} {run_title(run)} ({run.state})", run.id


def run_picker(runs: list[Any], selected: str | None = None, prefer: Collection[str] = ()
               ) -> tuple[list[tuple[str, str]], str | None]:
    """(choices, value) of a run picker: `selected` while it is listed, else the first run in a
    `prefer` state, else the first run."""
    if selected not in {r.id for r in runs}:
        preferred = [r for r in runs if r.state in prefer]
        selected = (preferred or runs)[0].id if runs else None
    return [run_choice(r) for r in runs], selected


def listed_runs(manager: Any, selected: str | None) -> tuple[list[tuple[str, str]], str | None, str | None]:
    """(choices, value, error) of a tab's run picker as the tab opens: the manager's runs, or the
    message saying why they cannot be listed."""
    try:
        runs = manager.runs()
    except Exception as exc:  # noqa: BLE001 - shown, the tab keeps what it showed
        return [], None, user_message("Listing runs", exc)
    return (*run_picker(runs, selected), None)


def duration_s(run: Any, now: float | None = None) -> float:
    end = run.ended_at or (now if now is not None else time.time())
    return max(0.0, end - run.created_at)


def usage_cells(usage: Usage | None, price: float | None) -> list[Any]:
    """GPU-h, kWh, Wh per 1M tokens and cost of a run, blank where not known (no GPU, no price)."""
    if usage is None:
        return ["", "", "", ""]
    wh = usage.wh_per_mtok
    cost = usage.cost(price)
    return [round(usage.gpu_hours, 3) if usage.gpu_hours else "", "" if usage.energy_kwh is None else round(usage.energy_kwh, 4),
            "" if wh is None else round(wh, 1), "" if cost is None else round(cost, 2)]


def usage_line(usage: Usage | None, price: float | None) -> str:
    """The Monitor's line of what the run used so far."""
    if usage is None:
        return ""
    if not usage.gpu_hours:
        return "Used: no GPU (CPU nodes): no GPU-hours, no GPU energy counter."
    parts = [f"{usage.gpu_hours:.2f} GPU-h"]
    if usage.energy_kwh is None:
        parts.append("energy not reported (no NVML energy counter)")
    else:
        wh = usage.wh_per_mtok
        parts.append(f"{usage.energy_kwh:.3f} kWh" + (f" ({wh:.1f} Wh per 1M tokens)" if wh is not None else ""))
    cost = usage.cost(price)
    if cost is not None:
        parts.append(f"cost {cost:.2f} at {price:g} per GPU-hour")
    return "Used: " + " · ".join(parts)


MESSAGE_CHARS = 600  # of a failed attempt's message in the timeline


def _plain(text: str) -> str:
    """Text shown as it is in Markdown, on one line: no emphasis, links, code, lists, headings or
    HTML from a log line or an exception's text."""
    return re.sub(r"([\\`*_\[\]<>#|~])", r"\\\1", " ".join(text.split()))


def status_md(run: Any, progress: dict | None, notices: list[str], layout: Layout | None = None,
              usage: str = "", attempts: Sequence[tuple[str, str | None]] = ()) -> str:
    """The Monitor's head: state, attempt, the layout of the ranks, elapsed time, and for a failure
    the classified cause, the node and the last log lines (never a traceback from the studio itself)."""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run.created_at))
    ranks = (f" · {layout.name()} = {layout.world} ranks ({layout.nnodes} node{'s' if layout.nnodes > 1 else ''} × "
             f"{layout.nproc_per_node})" if layout else "")
    lines = [f"**{STATE_MARK.get(run.state, '')} {run.state}** · run `{run.id}` · attempt {run.attempts}{ranks} · "
             f"started {started} · {format_duration(duration_s(run))}"]
    if usage:
        lines.append(usage)
    if progress and progress.get("resumed_from") is not None:
        lines.append(f"Resumed from the checkpoint of step {progress['resumed_from']}.")
    if run.cause or run.message:
        where = ", ".join(x for x in (f"node {run.failed_node}" if run.failed_node else "",
                                       f"exit code {run.exit_code}" if run.exit_code is not None else "") if x)
        cause = (run.cause or "unknown").replace("_", " ")
        if (run.message or "").startswith(cause):
            # The watch's own line (logclass.describe) already names the cause, node and rank.
            lines.append(f"\n**Cause:** {_plain(run.message)}")
        else:
            lines.append(f"\n**Cause: {cause}**{f' ({where})' if where else ''}: {_plain(run.message or '')}")
        if run.cause in HELP:
            lines.append(f"\nWhat to do: {HELP[run.cause]}")
        if run.log_tail:
            lines.append("\nLast log lines:\n```\n" + run.log_tail.strip()[-3000:] + "\n```")
    if len(attempts) > 1:  # the run's timeline (lifecycle.attempt_history), newest last
        lines.append("\n" + "  \n".join(line + (f"  \n&emsp;↳ {_plain(message[:MESSAGE_CHARS])}" if message else "")
                                         for line, message in attempts[-6:]))
    for notice in notices[-3:]:
        lines.append(f"\n_{_plain(notice)}_")
    return "\n".join(lines)


def restart_button(state: str, checkpoints: list[tuple[int, str]]) -> tuple[str, bool]:
    """(label, enabled) of the Monitor's resume button. A resume starts from the latest checkpoint,
    and from step 0 where there is none: that is running the job again, and the button says so."""
    if state not in RESTARTABLE:
        return RESUME_LABEL, False
    return (RESUME_LABEL if checkpoints else RUN_AGAIN_LABEL), True


RESUMING = "Resuming"


def restart_message(run_id: str, checkpoints: list[tuple[int, str]]) -> str:
    """What the resume button just started (checkpoints newest first, as RunManager lists them)."""
    if checkpoints:
        return f"{RESUMING} `{run_id}` from the checkpoint of step {checkpoints[0][0]}…"
    return (f"No checkpoint of `{run_id}` exists, so it cannot resume: running it again from step 0 "
            "as a new attempt…")


def overtaken_by_status(action: str | None) -> bool:
    """Whether an action line says only what the status line says once the new attempt has settled:
    a resume from a checkpoint ("Resumed from the checkpoint of step N" there). A run again from step
    0, which the status line does not mention, and a stop's report stay."""
    return bool(action) and action.startswith(RESUMING)


def run_rows(runs: list[Any], summaries: dict[str, dict], usages: dict[str, Usage] | None = None,
             price: float | None = None) -> list[list[Any]]:
    rows = []
    for run in runs:
        s = summaries.get(run.id, {})
        loss, eval_loss, tps = s.get("loss"), s.get("eval_loss"), s.get("tokens_per_s")
        rows.append([run_title(run), run.state, run.attempts,
                     time.strftime("%m-%d %H:%M", time.localtime(run.created_at)),
                     format_duration(duration_s(run)),
                     "" if loss is None else round(loss, 4), "" if eval_loss is None else round(eval_loss, 4),
                     "" if tps is None else round(tps, 1),
                     *usage_cells((usages or {}).get(run.id), price), run.run_dir])
    return rows


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}." if isinstance(value, dict) and value else f"{prefix}{key}"))
        return out
    return {prefix.rstrip("."): data}


def config_diff(yaml_a: str, yaml_b: str) -> list[list[str]]:
    """[field, value in A, value in B] for every field that differs (nested keys dotted)."""
    a, b = _flatten(yaml.safe_load(yaml_a) or {}), _flatten(yaml.safe_load(yaml_b) or {})
    rows = []
    for key in list(dict.fromkeys([*a, *b])):
        if a.get(key) != b.get(key):
            rows.append([key, _show(a.get(key, "—")), _show(b.get(key, "—"))])
    return rows


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value)


def alerts_md(alerts: list[Any]) -> str:
    if not alerts:
        return "No alerts."
    out = []
    for a in reversed(alerts[-50:]):
        when = time.strftime("%H:%M:%S", time.localtime(a.last_t))
        where = ", ".join(x for x in (a.node and f"node {a.node}",
                                      a.rank not in (None, NO_INDEX) and f"rank {a.rank}",
                                      a.gpu not in (None, NO_INDEX) and f"GPU {a.gpu}") if x)
        count = f" ×{a.count}" if a.count > 1 else ""
        out.append(f"- {STATUS_MARK.get(a.severity, '•')} {when} **{a.rule.replace('_', ' ')}**"
                   f"{f' ({where})' if where else ''}{count}: {html.escape(a.message)}")
    return "\n".join(out)


def checkpoint_choices(checkpoints: Sequence[tuple[int, str]], eval_losses: dict[int, float]) -> list[tuple[str, str]]:
    """A checkpoint picker's (label, step) choices, newest first, each with its eval loss where it was
    evaluated, the lowest marked best."""
    best = min(((loss, step) for step, loss in eval_losses.items() if step in dict(checkpoints)), default=None)
    out = []
    for step, path in checkpoints:
        loss = eval_losses.get(step)
        scored = f" · eval loss {loss:.4g}{' (best)' if best and best[1] == step else ''}" if loss is not None else ""
        out.append((f"step {step}{scored} · {path}", str(step)))
    return out
