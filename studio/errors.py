"""Turning a failed action into a message for the page: user mistakes and refused requests say
what to do; anything unexpected is logged with its traceback on the server and shown as one
line, never as a traceback in the browser."""
from __future__ import annotations

import logging

log = logging.getLogger("studio")


def user_message(action: str, exc: BaseException) -> str:
    from backend.runs.manager import RunError

    if isinstance(exc, (RunError, ValueError, KeyError, FileNotFoundError, TimeoutError)):
        return f"✖ {action} failed: {exc}"
    log.exception("%s failed", action)
    return (f"✖ {action} failed unexpectedly ({type(exc).__name__}: {exc}). "
            "The full traceback is in the studio's terminal log.")
