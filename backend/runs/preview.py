"""The data preview of a job (`launcher/preview.py`'s docstring says what it holds), made by a
`python -m launcher.preview` process on this machine: the studio and the CLI never load a
tokenizer themselves (they stay torch-free), and it reads the files where they are read here."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from backend.job.spec import JobSpec

PREVIEW_TIMEOUT_S = 300.0


class PreviewError(Exception):
    """A preview that could not be made; the message says why (the job's model, a worker failure)."""


def data_preview(spec: JobSpec, timeout_s: float = PREVIEW_TIMEOUT_S) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run([sys.executable, "-m", "launcher.preview"], input=spec.to_yaml(), capture_output=True,
                              text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise PreviewError(f"the preview took longer than {timeout_s:g} s and was stopped") from None
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except json.JSONDecodeError:
        result = None
    if not isinstance(result, dict):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise PreviewError(f"the preview process failed (exit code {proc.returncode}): {last[:300]}")
    if "error" in result:
        raise PreviewError(str(result["error"]))
    return result
