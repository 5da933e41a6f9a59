"""Who may open the studio: loopback without a password; any other address only with
authentication configured; only under the names it was started for (a web page elsewhere must not
drive it: DNS rebinding, cross-site requests); a bounded rate of failed logins. Pure, so the rules
are unit-tested."""
from __future__ import annotations

import ipaddress
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

AUTH_ENV = "SWIFT_STUDIO_AUTH"
LOOPBACK_NAMES = ("localhost",)
# What a browser on this machine may put in Host: for a studio bound on loopback (or on every
# address, which includes loopback; Gradio's own start-up check uses "localhost" there).
LOOPBACK_ALIASES = ("localhost", "127.0.0.1", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::")
# Gradio's routes that run a handler by name. The page itself only uses queue/join, so these are
# refused outright: api_visibility="private" hides a handler but still lets them run it.
NAMED_ENDPOINT = re.compile(r"^/gradio_api/(call|run|api)(/|$)")
_NAME = re.compile(r"^[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?$")

LOGIN_MAX_FAILURES = 5
LOGIN_WINDOW_S = 60.0
LOGIN_COOLOFF_S = 60.0


class AccessError(ValueError):
    """A bind address or credential file the studio refuses, with what to do instead."""


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    return host.strip("[]") in WILDCARD_HOSTS


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


def auth_file_warning(path: str, mode: int) -> str | None:
    """A warning when the credential file (with this st_mode) is open to other users."""
    if not mode & 0o077:
        return None
    return (f"warning: --auth-file {path} is accessible to other users (mode {stat.S_IMODE(mode):04o}): anyone on "
            f"this machine can read the studio's passwords. Fix: chmod 600 {path}")


def parse_allowed_hosts(text: str | None) -> tuple[str, ...]:
    """The --allowed-hosts list: comma-separated `name` or `name:port` entries, normalised."""
    entries = []
    for raw in (text or "").split(","):
        if not raw.strip():
            continue
        parsed = split_host(raw)
        if parsed is None:
            raise AccessError(f"--allowed-hosts: {raw.strip()!r} is not a host name or name:port "
                              "(no scheme or path, e.g. studio.example.com or 10.0.0.5:7860)")
        name, port = parsed
        shown = f"[{name}]" if ":" in name else name
        entries.append(shown if port is None else f"{shown}:{port}")
    return tuple(entries)


def check_bind(host: str, auth: list[tuple[str, str]] | None, allowed_hosts: tuple[str, ...] = ()) -> None:
    """Refuse a non-loopback address without authentication, and an address on every interface
    without the names it is reached under, saying how to configure it."""
    if not is_loopback(host) and not auth:
        raise AccessError(
            f"refusing to serve on {host} without authentication: anyone who reaches that address could "
            f"launch jobs on your nodes. Either set {AUTH_ENV}=user:password, or pass --auth-file FILE with "
            "'user:password' lines, or keep the default 127.0.0.1 and open it from another machine through "
            "an SSH tunnel: ssh -L 7860:127.0.0.1:7860 <this host>")
    foreign = [h for h in allowed_hosts if not is_loopback(split_host(h)[0])]
    if foreign and not auth:
        raise AccessError(
            f"refusing --allowed-hosts {','.join(foreign)} without authentication: those names reach the studio "
            f"from other machines (e.g. through a reverse proxy). Set {AUTH_ENV}=user:password or pass "
            "--auth-file FILE")
    if is_wildcard(host) and not allowed_hosts:
        raise AccessError(
            f"--host {host} accepts connections on every address, so list the names and addresses browsers "
            "use to reach it: --allowed-hosts myhost.example.com,10.0.0.5 (requests for any other name are "
            "refused, which stops DNS-rebinding pages). Or bind one address: --host 10.0.0.5")


def split_host(value: str) -> tuple[str, int | None] | None:
    """`name[:port]` (IPv6 in brackets) as (normalised name, port or None); None if malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        name, rest = value[1:end], value[end + 1:]
        if end < 0 or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else None
    elif value.count(":") > 1:  # a bare IPv6 address (--host ::1), never a Host header
        name, port_text = value, None
    else:
        name, _, port_text = value.partition(":")
        port_text = port_text if ":" in value else None
    name = name.rstrip(".")
    try:
        name = str(ipaddress.ip_address(name))
    except ValueError:
        if not _NAME.match(name):
            return None
    if port_text is None:
        return name, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return None
    return name, int(port_text)


@dataclass(frozen=True)
class HostPolicy:
    """The (name, port) pairs the studio answers under, in Host and Origin headers alike. A port of
    None is a header without one (the scheme's default port, e.g. a reverse proxy on 443)."""

    allowed: frozenset[tuple[str, int | None]]

    @classmethod
    def for_bind(cls, host: str, port: int, allowed_hosts: tuple[str, ...] = ()) -> HostPolicy:
        bound = split_host(host)
        names = {bound[0]} if bound and not is_wildcard(host) else set()
        if is_loopback(host) or is_wildcard(host):
            names.update(LOOPBACK_ALIASES)
        pairs = {(n, p) for n in names for p in ((port, None) if port == 80 else (port,))}
        for entry in allowed_hosts:
            name, entry_port = split_host(entry)
            # A bare name: the studio's own port, or none at all (what a proxy on 80/443 forwards).
            pairs.update({(name, entry_port)} if entry_port is not None else {(name, port), (name, None)})
        return cls(frozenset(pairs))

    def request_refusal(self, hosts: list[str], origins: list[str], path: str) -> str | None:
        """Why a request is refused whatever else it carries (its Host and Origin header values,
        its path); None when it may go on. The web guard and the start-up responder both ask."""
        if len(hosts) > 1 or len(origins) > 1:
            return "swift-studio refused this request: it has more than one Host or Origin header."
        return self.refusal(hosts[0] if hosts else None, origins[0] if origins else None) or api_route_refusal(path)

    def refusal(self, host: str | None, origin: str | None) -> str | None:
        """Why a request with these Host and Origin headers is refused; None when it is served."""
        if host is None:
            return "swift-studio refused this request: it has no Host header."
        if split_host(host) not in self.allowed:
            return (f"swift-studio refused this request: Host {host!r} is not a name of this studio (a page "
                    "elsewhere may be pointing its own name at it: DNS rebinding). Open the studio at the address "
                    "it printed, or start it with --allowed-hosts naming this host.")
        if origin is not None and _origin_host(origin) not in self.allowed:
            return (f"swift-studio refused this request: Origin {origin!r} is another site's page, and the "
                    "studio answers only its own page.")
        return None


def _origin_host(origin: str) -> tuple[str, int | None] | None:
    """An Origin header as (name, port); None for `null` and anything that is not http(s)://host[:port]."""
    try:
        parts = urlsplit(origin.strip())
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or parts.path or parts.query or "@" in parts.netloc:
        return None
    return split_host(parts.netloc)


def api_route_refusal(path: str) -> str | None:
    """Why a request for this path is refused whatever its headers: the handlers are the page's, not an API."""
    if NAMED_ENDPOINT.match(re.sub("/+", "/", path)):
        return "swift-studio refused this request: the studio's handlers are not a public API."
    return None


@dataclass
class LoginLimiter:
    """Login attempts per client address. Each attempt counts as a failure until it succeeds, so
    parallel guesses are counted too; after `max_failures` within `window_s` the address is refused
    for `cooloff_s`. Used from the server's event loop only (no lock)."""

    max_failures: int = LOGIN_MAX_FAILURES
    window_s: float = LOGIN_WINDOW_S
    cooloff_s: float = LOGIN_COOLOFF_S
    _failures: dict[str, list[float]] = field(default_factory=dict)
    _blocked_until: dict[str, float] = field(default_factory=dict)

    def admit(self, client: str, now: float) -> float:
        """0 when this attempt may go ahead (recorded), else the seconds until the address may try again."""
        self._forget(now)
        if client in self._blocked_until:
            return self._blocked_until[client] - now
        recent = self._failures.setdefault(client, [])
        if len(recent) >= self.max_failures:
            del self._failures[client]
            self._blocked_until[client] = now + self.cooloff_s
            return self.cooloff_s
        recent.append(now)
        return 0.0

    def succeeded(self, client: str) -> None:
        self._failures.pop(client, None)

    def _forget(self, now: float) -> None:
        """Drop what has expired, so addresses that stopped trying take no memory."""
        for client, until in list(self._blocked_until.items()):
            if until <= now:
                del self._blocked_until[client]
        for client, times in list(self._failures.items()):
            times[:] = [t for t in times if now - t < self.window_s]
            if not times:
                del self._failures[client]
