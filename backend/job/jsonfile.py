"""Read a JSON file the user or the backend wrote, with errors that name the file (and line);
write one whole or not at all.

Stdlib only: the worker (launcher/) imports it too.
"""
from __future__ import annotations

import json
import os
import secrets
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


def write_json_atomic(path: str | Path, value: Any, mode: int = 0o644) -> None:
    """`value` as JSON in `path`, whole: written under a fresh hidden name beside it and renamed
    into place, so a reader sees the old file or the new one, never part of one. The temporary
    name is created exclusively without following a link (a link planted there is not written
    through), and removed when the write fails."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(value, f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
