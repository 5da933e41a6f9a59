"""Who may open the studio: loopback without a password; any other address only with
authentication configured. Pure, so the rules are unit-tested."""
from __future__ import annotations

import ipaddress
import os
from pathlib import Path

AUTH_ENV = "SWIFT_STUDIO_AUTH"
LOOPBACK_NAMES = ("localhost",)


class AccessError(ValueError):
    """A bind address or credential file the studio refuses, with what to do instead."""


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_credentials(text: str, source: str) -> list[tuple[str, str]]:
    """`user:password` pairs, one per line (blank lines and # comments skipped)."""
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, password = line.partition(":")
        if not sep or not user.strip() or not password:
            raise AccessError(f"{source}:{number}: expected 'user:password'")
        pairs.append((user.strip(), password))
    if not pairs:
        raise AccessError(f"{source}: no 'user:password' line")
    return pairs


def load_auth(auth_file: str | None, environ: dict[str, str] | None = None) -> list[tuple[str, str]] | None:
    """Credentials from --auth-file, else from $SWIFT_STUDIO_AUTH (`user:password`), else None."""
    environ = os.environ if environ is None else environ
    if auth_file:
        path = Path(auth_file).expanduser()
        try:
            return parse_credentials(path.read_text(), str(path))
        except (OSError, UnicodeDecodeError) as exc:
            raise AccessError(f"cannot read --auth-file {path}: {exc}") from None
    if environ.get(AUTH_ENV):
        return parse_credentials(environ[AUTH_ENV], f"${AUTH_ENV}")
    return None


def check_bind(host: str, auth: list[tuple[str, str]] | None) -> None:
    """Refuse a non-loopback address without authentication, saying how to configure it."""
    if is_loopback(host) or auth:
        return
    raise AccessError(
        f"refusing to serve on {host} without authentication: anyone who reaches that address could "
        f"launch jobs on your nodes. Either set {AUTH_ENV}=user:password, or pass --auth-file FILE with "
        "'user:password' lines, or keep the default 127.0.0.1 and open it from another machine through "
        "an SSH tunnel: ssh -L 7860:127.0.0.1:7860 <this host>")
