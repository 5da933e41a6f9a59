"""Look of the studio: Gradio's default theme on system fonts only (no font or CDN request
leaves the machine), plus the few styles the layout needs."""
from __future__ import annotations

import gradio as gr

THEME = gr.themes.Default(
    primary_hue="orange",
    font=("ui-sans-serif", "system-ui", "Segoe UI", "Roboto", "sans-serif"),
    font_mono=("ui-monospace", "SFMono-Regular", "Consolas", "monospace"),
)

CSS = """
.field-error input, .field-error textarea, .field-error .wrap { border-color: #b91c1c !important; }
.field-error [data-testid="block-info"], .field-error .info { color: #b91c1c !important; font-weight: 600; }
.field-warning [data-testid="block-info"], .field-warning .info { color: #a16207 !important; }
.field-greyed [data-testid="block-info"], .field-greyed .info { color: #6b7280 !important; font-style: italic; }
.status-line { font-size: 0.95em; }
.problem-list ul { margin: 0; }
.cmd-preview textarea, .cmd-preview pre { font-size: 0.85em; }
.progress-outer { background: #e4e4e7; border-radius: 6px; height: 14px; width: 100%; overflow: hidden; }
.progress-inner { background: #f97316; height: 14px; }
table.preflight { border-collapse: collapse; font-size: 0.9em; }
table.preflight th, table.preflight td { border: 1px solid #d4d4d8; padding: 4px 8px; vertical-align: top; text-align: left; }
.prose table th, .prose table td { word-break: keep-all; overflow-wrap: normal; }
/* Dataframe headers break between words only, so a narrow column ("attempts") widens to its
   header instead of splitting it into fragments; Gradio sizes the columns after this applies. */
th.header-cell .header { word-break: keep-all !important; overflow-wrap: normal !important; white-space: nowrap; }
/* The Runs table's last column is a path: it breaks anywhere rather than widening the page. */
#runs-table td:last-child, #runs-table td:last-child * { word-break: break-all; white-space: normal; }
.problem-links ul { margin: 0.25em 0; }
.hidden-trigger { display: none !important; }
.data-preview pre.preview-sample { white-space: pre-wrap; font-size: 0.85em; margin: 0.2em 0 0.6em; }
.data-preview mark.loss { background: #fed7aa; color: inherit; }
.data-preview .preview-where { color: #6b7280; font-size: 0.85em; }
.data-preview .preview-error { color: #b91c1c; }
footer { display: none !important; }
"""
