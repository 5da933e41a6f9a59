"""The studio's access rules (studio/access.py): which Host and Origin headers it answers, which
binds it refuses, the login rate limit and the credential-file warning. Pure, so seconds."""
from __future__ import annotations

import pytest

from studio.access import (AccessError, HostPolicy, LoginLimiter, api_route_refusal, auth_file_warning, check_bind,
                           parse_allowed_hosts, split_host)


def test_split_host_normalises_names_addresses_and_ports():
    assert split_host("LocalHost.:7860") == ("localhost", 7860)
    assert split_host("[::1]:7860") == ("::1", 7860)
    assert split_host("[0:0:0:0:0:0:0:1]") == ("::1", None)
    assert split_host("::1") == ("::1", None)  # --host ::1
    assert split_host("10.0.0.5") == ("10.0.0.5", None)
    for bad in ("", "a:b", "a:0", "a:70000", "[::1", "[::1]x", "evil.example/path", "user@host", "a b", "-x"):
        assert split_host(bad) is None, bad


def test_loopback_studio_answers_its_aliases_at_its_port_only():
    policy = HostPolicy.for_bind("127.0.0.1", 7860)
    for host in ("127.0.0.1:7860", "localhost:7860", "[::1]:7860", "LOCALHOST:7860"):
        assert policy.refusal(host, None) is None, host
        assert policy.refusal(host, f"http://{host}") is None, host
    assert policy.refusal("127.0.0.1:7860", "http://localhost:7860") is None
    why = policy.refusal("evil.example:7860", None)
    assert "Host 'evil.example:7860'" in why and "DNS rebinding" in why and "--allowed-hosts" in why
    assert policy.refusal("127.0.0.1:8000", None)      # another port: not this studio
    assert policy.refusal("127.0.0.1", None)           # no port means 80
    assert "no Host header" in policy.refusal(None, None)
    for origin in ("http://evil.example", "http://evil.example:7860", "http://localhost:8000", "null",
                   "file://", "http://localhost:7860/page", "http://user@localhost:7860", "ftp://localhost:7860"):
        why = policy.refusal("127.0.0.1:7860", origin)
        assert why and f"Origin {origin!r}" in why, origin


def test_port_80_accepts_a_host_without_port():
    policy = HostPolicy.for_bind("localhost", 80)
    assert policy.refusal("localhost", "http://localhost") is None
    assert policy.refusal("localhost:80", None) is None


def test_other_addresses_answer_their_own_name_and_the_listed_ones():
    policy = HostPolicy.for_bind("10.0.0.5", 7860, parse_allowed_hosts("studio.example.com, gpu1:9000"))
    assert policy.refusal("10.0.0.5:7860", "http://10.0.0.5:7860") is None
    assert policy.refusal("localhost:7860", None)  # not bound on loopback
    # A bare listed name: the studio's port, or none (what a reverse proxy on 80/443 forwards).
    assert policy.refusal("studio.example.com", "https://studio.example.com") is None
    assert policy.refusal("studio.example.com:7860", None) is None
    assert policy.refusal("studio.example.com:8443", None)
    assert policy.refusal("gpu1:9000", "http://gpu1:9000") is None
    assert policy.refusal("gpu1:7860", None)
    assert policy.refusal("10.0.0.5:7860", "https://evil.example")


def test_every_address_bind_answers_loopback_and_the_listed_names_only():
    policy = HostPolicy.for_bind("0.0.0.0", 7860, ("gpu1",))
    assert policy.refusal("localhost:7860", None) is None  # Gradio's own start-up check, SSH tunnels
    assert policy.refusal("gpu1:7860", None) is None
    assert policy.refusal("0.0.0.0:7860", None)
    assert policy.refusal("10.1.2.3:7860", None)


def test_allowed_hosts_parsing():
    assert parse_allowed_hosts(None) == ()
    assert parse_allowed_hosts(" A.example ,, 10.0.0.5:80,[::1]:7860,") == ("a.example", "10.0.0.5:80", "[::1]:7860")
    for bad in ("http://a.example", "a.example/x", "a:b"):
        with pytest.raises(AccessError, match="--allowed-hosts"):
            parse_allowed_hosts(bad)


def test_bind_rules():
    auth = [("a", "b")]
    check_bind("127.0.0.1", None)
    check_bind("localhost", None, ("localhost",))
    check_bind("10.0.0.5", auth)
    check_bind("0.0.0.0", auth, ("gpu1",))
    with pytest.raises(AccessError, match="without authentication"):
        check_bind("0.0.0.0", None, ("gpu1",))
    # Names other machines use would expose a loopback studio through a proxy: authentication first.
    with pytest.raises(AccessError, match="refusing --allowed-hosts studio.example.com without authentication"):
        check_bind("127.0.0.1", None, ("studio.example.com",))
    # Every address: the names must be listed (the safe choice over accepting any Host).
    for host in ("0.0.0.0", "::"):
        with pytest.raises(AccessError, match="--allowed-hosts myhost"):
            check_bind(host, auth)


def test_named_endpoint_routes_are_refused():
    for path in ("/gradio_api/call/on_hostfile", "/gradio_api/call/v2/on_add", "/gradio_api/run/predict",
                 "/gradio_api/api/on_add/", "//gradio_api//call/x", "/gradio_api/call"):
        assert "not a public API" in api_route_refusal(path), path
    for path in ("/", "/config", "/gradio_api/queue/join", "/gradio_api/queue/data", "/gradio_api/upload",
                 "/gradio_api/info", "/gradio_api/file=/tmp/x", "/gradio_api/caller"):
        assert api_route_refusal(path) is None, path


def test_login_limiter_cools_off_after_five_failures():
    limiter = LoginLimiter(max_failures=5, window_s=60, cooloff_s=60)
    for i in range(5):
        assert limiter.admit("10.0.0.9", 100.0 + i) == 0
    assert limiter.admit("10.0.0.9", 105.0) == 60          # the sixth: refused, cooling off
    assert limiter.admit("10.0.0.9", 150.0) == pytest.approx(15)
    assert limiter.admit("10.0.0.8", 150.0) == 0           # another address is not affected
    assert limiter.admit("10.0.0.9", 165.0) == 0           # cooled off: a fresh allowance
    assert limiter._blocked_until == {}


def test_login_limiter_forgives_a_success_and_old_failures():
    limiter = LoginLimiter(max_failures=5, window_s=60, cooloff_s=60)
    for i in range(4):
        limiter.admit("a", float(i))
    assert limiter.admit("a", 4.0) == 0  # the fifth attempt goes ahead; it succeeds
    limiter.succeeded("a")
    for i in range(5):
        assert limiter.admit("a", 5.0 + i) == 0
    # Failures older than the window no longer count, and take no memory.
    assert limiter.admit("a", 100.0) == 0
    assert limiter._failures == {"a": [100.0]}


def test_auth_file_warning():
    assert auth_file_warning("/x/auth", 0o100600) is None
    assert auth_file_warning("/x/auth", 0o100400) is None
    for mode in (0o100644, 0o100640, 0o100602):
        text = auth_file_warning("/x/auth", mode)
        assert f"mode {mode & 0o777:04o}" in text and "other users" in text and text.endswith("chmod 600 /x/auth")
