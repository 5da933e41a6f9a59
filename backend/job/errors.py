"""The base class of the errors a user can cause: a mistake in the job, its data, files or settings.

Part of the job contract (the worker and the control plane both import it). The message names the
field, file:line or rank and says what to fix; the worker reports such an error as one line,
`[rank<N>] error: <Class>: <message>`, never a traceback, and backend.telemetry.logclass files the class
name under its cause (tests/test_logclass.py checks that every subclass has one).
"""
from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix, named in the message."""
