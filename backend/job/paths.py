"""What a path the user named really is, when it is not the regular file a reader expects.

Stdlib only: the worker (launcher/) imports it too. A FIFO blocks whoever opens it, /dev/zero
never ends, a directory or a link loop reads as "not found" through `Path.is_file()`: each is
named for what it is, before anything opens it.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe): reading it would wait for a writer"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_a_regular_file(path: str | Path) -> str | None:
    """None for a regular file (or a link to one); else what the path is, as a phrase that
    follows the path in a message: 'not found', 'is a directory', 'is a symbolic link loop', …"""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            return f"is a symbolic link to {os.readlink(path)}, which does not exist"
        return "not found"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symbolic link loop"
        return f"cannot be read ({exc.strerror})"
    if stat.S_ISREG(mode):
        return None
    return next((f"is {kind}" for test, kind in _KINDS if test(mode)), "is not a regular file")
