"""Read a JSON file the user or the backend wrote, with errors that name the file (and line).

Stdlib only: the worker (launcher/) imports it too.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


def read_json(path: str | Path, what: str, error: Callable[[str], Exception] = ValueError, hint: str = "") -> Any:
    """The parsed content of `path`. Every failure raises `error(message)`: missing (with `hint`
    appended), unreadable, or not JSON (with the line)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{path}: {what} not found{hint}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot read {what}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{path}:{exc.lineno}: {what} is not valid JSON: {exc.msg}") from None
