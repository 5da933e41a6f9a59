"""The Train tab's data preview, drawn from `backend.runs.preview.data_preview`'s result (pure).
Every text in it comes from the user's files: it is escaped, never markup."""
from __future__ import annotations

import html
from pathlib import Path

import plotly.graph_objects as go


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}"


def preview_html(result: dict) -> str:
    """Per dataset: its record count, the lengths measured (truncated, dropped) and its first
    records as training sees them, the tokens that carry loss marked; then the fill packing reaches."""
    max_length = result["max_length"]
    parts = []
    for d in result["datasets"]:
        # a local file by its name; a hub id whole
        name = html.escape(Path(d["entry"]).name if d["entry"].startswith(("/", ".")) else d["entry"])
        if d["error"]:
            parts.append(f'<div class="preview-dataset"><b>{name}</b>: <span class="preview-error">'
                         f'{html.escape(d["error"])}</span></div>')
            continue
        count = "streamed, not counted:" if d["count"] is None else f'{d["count"]:,} records;'
        summary = (f'{count} of the first {d["measured"]:,}: {d["truncated"]:,} longer than max_length '
                   f'{max_length} (truncated), {d["dropped"]:,} dropped (no response token within max_length)')
        samples = []
        for s in d["samples"]:
            text = "".join(f'<mark class="loss">{html.escape(t)}</mark>' if trained else html.escape(t)
                           for t, trained in s["segments"])
            # thumbnails the preview made itself (data: URIs of PNGs); anything else is not shown
            thumbs = "".join(f'<img class="preview-image" alt="image {i + 1}" src="{html.escape(uri)}">'
                             for i, uri in enumerate(s.get("images") or []) if uri.startswith("data:image/png;base64,"))
            samples.append(f'<div class="preview-where">{html.escape(s["where"])} · {s["tokens"]} tokens</div>'
                           f'{thumbs}<pre class="preview-sample">{text}</pre>')
        parts.append(f'<div class="preview-dataset"><b>{name}</b>: {html.escape(summary)}{"".join(samples)}</div>')
    fill = (f'Rows of max_length {max_length}: one sample per row fills {_pct(result["row_fill"])} of them; packing '
            f'would fill {_pct(result["packed_fill"])} (packing is {"on" if result["packing"] else "off"}).')
    if result.get("padding_free"):
        fill += " padding_free: each micro-batch's samples are one row without padding."
    legend = '<mark class="loss">highlighted</mark>: the tokens that carry loss.'
    return f'<div class="data-preview"><p>{legend} {html.escape(fill)}</p>{"".join(parts)}</div>'


def mean_tokens(result: dict) -> float | None:
    """The mean tokens a sample trains with (each length cut at max_length) over every dataset the
    preview measured; None where it measured none."""
    lengths = [min(n, result["max_length"]) for d in result["datasets"] if not d["error"] for n in d["lengths"] or []]
    return sum(lengths) / len(lengths) if lengths else None


def lengths_figure(result: dict) -> go.Figure:
    """Each dataset's token lengths (before truncation) as a histogram, max_length marked."""
    fig = go.Figure()
    for d in result["datasets"]:
        if d["lengths"]:
            fig.add_trace(go.Histogram(x=d["lengths"], name=Path(d["entry"]).name, opacity=0.7, nbinsx=40))
    fig.add_vline(x=result["max_length"], line_dash="dash", annotation_text=f"max_length {result['max_length']}")
    fig.update_layout(barmode="overlay", height=260, margin=dict(l=40, r=10, t=30, b=40), title="Tokens per sample",
                      xaxis_title="tokens (before truncation)", yaxis_title="samples", legend=dict(orientation="h"))
    return fig
