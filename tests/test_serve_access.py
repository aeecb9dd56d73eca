"""Who may drive `reploy serve`, without Docker: the access rules (decide_access) over every
combination of method, path, Host, Origin, Sec-Fetch-Site, credentials and body, judged by an
oracle written from the rules of issue 11 (not from the code); the parsers at their edges; the
Host allowlist per listen address; token files; and the CLI's token and listen options."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reploy_serve  # noqa: E402
from reploy_serve import Access  # noqa: E402
from serve_harness import LoopbackSite  # noqa: E402

TOKEN = "k" * 20 + "Q7-x_" + "z" * 18  # 43 characters, like a generated one
EXTRA_HOST = "reploy.proxy.test"
POLICY = reploy_serve.AccessPolicy.for_server(TOKEN, 8080, reploy_serve.allowed_hosts(
    "127.0.0.1", (), (EXTRA_HOST,)))
SID = "0123456789abcdef"


def decide(method: str, target: str, headers: list[tuple[str, str]],
           policy: reploy_serve.AccessPolicy = POLICY) -> Any:
    """The decision as the oracle states it: an Access, or the refusing status."""
    try:
        return reploy_serve.decide_access(method, target, headers, policy)
    except reploy_serve.ServeError as e:
        return e.status


# -- the rules, over every combination --------------------------------------------------------
#
# The oracle below restates the rules in order: a missing Host is malformed (400); a
# Host that is not one of the server's names is 421; /login with the right token logs in
# (only GET: 405), with anything else 401; other paths outside /api/v1 need nothing; under
# /api/v1 a foreign Origin or a cross-site/same-site Sec-Fetch-Site is 403; then missing or
# wrong credentials 401 (an Authorization header alone decides when present; a token in the
# query string never counts); then a body that is not JSON 415.

METHODS = ("GET", "POST", "DELETE", "OPTIONS")
#: target -> its kind: "static", "api", "login-good", "login-bad"
TARGETS = {
    "/": "static", "/app.js": "static", "/api/v1x": "static", "/api/v1/openapi.json": "api",
    "/api/v1": "api", "/api/v1/sessions": "api", f"/api/v1/sessions/{SID}/stream?offset=0": "api",
    f"/api/v1/sessions?token={TOKEN}": "api",
    f"/login?token={TOKEN}": "login-good", "/login?token=" + TOKEN[:-1]: "login-bad",
    "/login": "login-bad", f"/login?token={TOKEN}&token={TOKEN}": "login-bad",
}
#: Host header -> whether it names this server (None: no Host header)
HOSTS = {
    "127.0.0.1:8080": True, "localhost:8080": True, "[::1]:8080": True, "127.0.0.1": True,
    "LocalHost:8080": True, EXTRA_HOST: True, "evil.example:8080": False,
    "localhost.:8080": False, "127.0.0.1.nip.io:8080": False, "[::2]:8080": False, None: False,
}
SAME = "same"  # the Origin a page of this very server sends: http:// + its Host
ORIGINS = (None, SAME, "http://127.0.0.1:9999", "null", "http://evil.example:8080")
SITES = (None, "same-origin", "none", "same-site", "cross-site")
#: name -> (headers, whether they authenticate)
CREDENTIALS = {
    "none": ([], False),
    "bearer": ([("Authorization", f"Bearer {TOKEN}")], True),
    "bearer-lowercase": ([("Authorization", f"bearer {TOKEN}")], True),
    "bearer-wrong": ([("Authorization", "Bearer " + TOKEN.upper())], False),
    "bearer-truncated": ([("Authorization", f"Bearer {TOKEN[:-1]}")], False),
    "bearer-longer": ([("Authorization", f"Bearer {TOKEN}x")], False),
    "bearer-empty": ([("Authorization", "Bearer")], False),
    "basic": ([("Authorization", "Basic " + TOKEN)], False),
    "cookie": ([("Cookie", f"{POLICY.cookie_name}={POLICY.cookie_value}")], True),
    "cookie-among-others": ([("Cookie", f"a=1; {POLICY.cookie_name}=x; "
                                        f"{POLICY.cookie_name}={POLICY.cookie_value}; b=2")], True),
    "cookie-is-the-token": ([("Cookie", f"{POLICY.cookie_name}={TOKEN}")], False),
    "cookie-of-another-port": ([("Cookie", f"reploy-9999={POLICY.cookie_value}")], False),
    "cookie-truncated": ([("Cookie", f"{POLICY.cookie_name}={POLICY.cookie_value[:-1]}")], False),
    "wrong-bearer-good-cookie": ([("Authorization", "Bearer nope"),
                                  ("Cookie", f"{POLICY.cookie_name}={POLICY.cookie_value}")], False),
}
#: name -> (headers, whether it is an acceptable body)
BODIES = {
    "none": ([], True),
    "json": ([("Content-Type", "application/json"), ("Content-Length", "2")], True),
    "json-utf8": ([("Content-Type", "application/json; charset=UTF-8"), ("Content-Length", "2")], True),
    "empty-text": ([("Content-Type", "text/plain"), ("Content-Length", "0")], True),
    "text": ([("Content-Type", "text/plain"), ("Content-Length", "2")], False),
    "form": ([("Content-Type", "application/x-www-form-urlencoded"), ("Content-Length", "2")], False),
    "multipart": ([("Content-Type", "multipart/form-data; boundary=x"), ("Content-Length", "2")], False),
    "untyped": ([("Content-Length", "2")], False),
    "json-latin1": ([("Content-Type", "application/json; charset=latin-1"), ("Content-Length", "2")], False),
    "chunked-text": ([("Content-Type", "text/plain"), ("Transfer-Encoding", "chunked")], False),
}


def oracle(method: str, kind: str, host: Optional[str], origin: Optional[str],
           site: Optional[str], credential: str, body: str) -> Any:
    if host is None:
        return 400
    if not HOSTS[host]:
        return 421
    if kind == "login-good":
        return Access.LOGIN if method == "GET" else 405
    if kind == "login-bad":
        return 401 if method == "GET" else 405
    if kind == "static":
        return Access.ROUTE
    if origin not in (None, SAME) or site in ("same-site", "cross-site"):
        return 403
    if not CREDENTIALS[credential][1]:
        return 401
    if not BODIES[body][1]:
        return 415
    return Access.ROUTE


def test_every_combination_follows_the_rules() -> None:
    checked = 0
    for method, (target, kind), (host, _), origin, site in itertools.product(
            METHODS, TARGETS.items(), HOSTS.items(), ORIGINS, SITES):
        for credential, body in itertools.product(CREDENTIALS, BODIES):
            headers = [("Host", host)] if host is not None else []
            if origin is not None:
                headers.append(("Origin", f"http://{host}" if origin == SAME else origin))
            if site is not None:
                headers.append(("Sec-Fetch-Site", site))
            headers += CREDENTIALS[credential][0] + BODIES[body][0]
            want = oracle(method, kind, host, origin, site, credential, body)
            assert decide(method, target, headers) == want, (method, target, headers)
            checked += 1
    assert checked == (len(METHODS) * len(TARGETS) * len(HOSTS) * len(ORIGINS) * len(SITES)
                       * len(CREDENTIALS) * len(BODIES))


# -- the edges --------------------------------------------------------------------------------

GOOD = [("Authorization", f"Bearer {TOKEN}")]


@pytest.mark.parametrize(("target", "headers", "status"), [
    # Only a path is a target: absolute-form (proxy requests) and * are malformed here.
    ("http://127.0.0.1:8080/api/v1/sessions", [("Host", "127.0.0.1:8080"), *GOOD], 400),
    ("*", [("Host", "127.0.0.1:8080"), *GOOD], 400),
    # One Host, one Origin, one Authorization.
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Host", "evil.example"), *GOOD], 400),
    ("/", [("Host", "127.0.0.1:8080"), ("Host", "127.0.0.1:8080")], 400),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Origin", "http://127.0.0.1:8080"),
                          ("Origin", "http://evil.example"), *GOOD], 400),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), *GOOD, *GOOD], 400),
    # Malformed Host headers.
    ("/", [("Host", "")], 400),
    ("/", [("Host", "127.0.0.1:")], 400),
    ("/", [("Host", "127.0.0.1:99999")], 400),
    ("/", [("Host", "127.0.0.1:0")], 400),
    ("/", [("Host", "::1")], 400),
    ("/", [("Host", "user@127.0.0.1")], 400),
    ("/", [("Host", "127.0.0.1/x")], 400),
    # The static shell and the login path need no credentials, the API does, at any depth.
    ("/index.html", [("Host", "127.0.0.1:8080")], Access.ROUTE),
    ("/api/v1/", [("Host", "127.0.0.1:8080")], 401),
    ("/api/v1/sessions/x/../../../app.js", [("Host", "127.0.0.1:8080")], 401),
    # A token in the query string is no credential, whatever it is called.
    (f"/api/v1/sessions?access_token={TOKEN}", [("Host", "127.0.0.1:8080")], 401),
    (f"/api/v1/sessions?token={TOKEN}", [("Host", "127.0.0.1:8080"),
                                         ("Authorization", "Bearer x")], 401),
    # Bearer takes the token after one scheme word; surrounding spaces do not matter.
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Authorization", f"  BEARER   {TOKEN} ")],
     Access.ROUTE),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Authorization", f"Bearer {TOKEN} x")], 401),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Authorization", f"Token {TOKEN}")], 401),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Authorization", "Bearer \udcff" * 3)], 401),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"),
                          ("Authorization", "Bearer " + "é" * 43)], 401),
    # Header names are case-insensitive.
    ("/api/v1/sessions", [("HOST", "127.0.0.1:8080"), ("authorization", f"Bearer {TOKEN}")],
     Access.ROUTE),
    ("/api/v1/sessions", [("host", "127.0.0.1:8080"), ("ORIGIN", "http://evil.example"), *GOOD], 403),
    # A same-origin page: default ports on either side, https through a TLS proxy.
    ("/api/v1/sessions", [("Host", "127.0.0.1"), ("Origin", "http://127.0.0.1:80"), *GOOD],
     Access.ROUTE),
    ("/api/v1/sessions", [("Host", "127.0.0.1:80"), ("Origin", "http://127.0.0.1"), *GOOD],
     Access.ROUTE),
    ("/api/v1/sessions", [("Host", EXTRA_HOST), ("Origin", f"https://{EXTRA_HOST}"), *GOOD],
     Access.ROUTE),
    ("/api/v1/sessions", [("Host", EXTRA_HOST), ("Origin", f"https://{EXTRA_HOST}:443"), *GOOD],
     Access.ROUTE),
    ("/api/v1/sessions", [("Host", "[::1]:8080"), ("Origin", "http://[::1]:8080"), *GOOD],
     Access.ROUTE),
    # The scheme is not compared: no other page can be served on this server's own port.
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Origin", "https://127.0.0.1:8080"), *GOOD],
     Access.ROUTE),
    ("/api/v1/sessions", [("Host", "127.0.0.1"), ("Origin", "https://127.0.0.1"), *GOOD],
     Access.ROUTE),
    ("/api/v1/sessions", [("Host", "LOCALHOST:8080"), ("Origin", "http://localhost:8080"), *GOOD],
     Access.ROUTE),
    # ... and every other page: another port, scheme, name, or a malformed Origin.
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Origin", "http://localhost:8080"), *GOOD], 403),
    ("/api/v1/sessions", [("Host", "127.0.0.1"), ("Origin", "https://127.0.0.1:80"), *GOOD], 403),
    ("/api/v1/sessions", [("Host", EXTRA_HOST), ("Origin", f"http://{EXTRA_HOST}:8443"), *GOOD], 403),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Origin", "ftp://127.0.0.1:8080"), *GOOD], 403),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Origin", "http://127.0.0.1:8080/"), *GOOD], 403),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Origin", "127.0.0.1:8080"), *GOOD], 403),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Origin", ""), *GOOD], 403),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Sec-Fetch-Site", "Cross-Site"), *GOOD], 403),
    # The login path answers GET only, with exactly one right token.
    (f"/login?token={TOKEN}&other=1", [("Host", "127.0.0.1:8080")], Access.LOGIN),
    (f"/login?token={TOKEN}%20", [("Host", "127.0.0.1:8080")], 401),
    ("/login?token=", [("Host", "127.0.0.1:8080")], 401),
    (f"/login/?token={TOKEN}", [("Host", "127.0.0.1:8080")], Access.ROUTE),  # a static 404
    (f"/login?token={TOKEN}", [("Host", "evil.example")], 421),
])
def test_edges(target: str, headers: list[tuple[str, str]], status: Any) -> None:
    assert decide("GET", target, headers) == status


def test_refusals_carry_their_headers_and_never_a_credential() -> None:
    try:
        reploy_serve.decide_access("GET", f"/api/v1/sessions?token={TOKEN}",
                             [("Host", "127.0.0.1:8080"), ("Cookie", f"{POLICY.cookie_name}=x")],
                             POLICY)
    except reploy_serve.Unauthorized as e:
        assert e.response_headers() == {"WWW-Authenticate": 'Bearer realm="reploy"'}
        assert "not accepted" in str(e) and TOKEN not in str(e)
    else:
        raise AssertionError("no 401")
    for target, headers in (("/login?token=" + TOKEN[:-1], [("Host", "127.0.0.1:8080")]),
                            ("/api/v1/sessions", [("Host", "127.0.0.1:8080"),
                                                  ("Authorization", f"Bearer {TOKEN[:-1]}")])):
        with pytest.raises(reploy_serve.Unauthorized) as info:
            reploy_serve.decide_access("GET", target, headers, POLICY)
        assert TOKEN[:-1] not in str(info.value) and POLICY.cookie_value not in str(info.value)
    with pytest.raises(reploy_serve.MethodNotAllowed) as refused:
        reploy_serve.decide_access("POST", f"/login?token={TOKEN}", [("Host", "127.0.0.1:8080")], POLICY)
    assert refused.value.response_headers() == {"Allow": "GET"}


def test_a_refused_body_names_the_types_its_route_takes() -> None:
    headers = [("Host", "127.0.0.1:8080"), ("Authorization", f"Bearer {TOKEN}"),
               ("Content-Type", "text/plain"), ("Content-Length", "1")]
    with pytest.raises(reploy_serve.UnsupportedMediaType) as upload:
        reploy_serve.decide_access("PUT", f"/api/v1/sessions/{SID}/files/a.txt", headers, POLICY)
    assert str(upload.value) == ("request bodies must be Content-Type: application/octet-stream"
                                 " or application/x-tar")
    with pytest.raises(reploy_serve.UnsupportedMediaType) as other:
        reploy_serve.decide_access("POST", f"/api/v1/sessions/{SID}/exec", headers, POLICY)
    assert str(other.value) == "request bodies must be Content-Type: application/json"


def test_a_foreign_host_is_named_but_bounded() -> None:
    with pytest.raises(reploy_serve.MisdirectedRequest) as info:
        reploy_serve.decide_access("GET", "/", [("Host", "evil.example:8080")], POLICY)
    assert "'evil.example:8080'" in str(info.value) and "--allow-host" in str(info.value)
    with pytest.raises(reploy_serve.MisdirectedRequest) as info:
        reploy_serve.decide_access("GET", "/", [("Host", "e" * 5000)], POLICY)
    assert len(str(info.value)) < 300


def test_the_policy_keeps_its_secrets_out_of_reprs_and_cookies() -> None:
    assert POLICY.cookie_name == "reploy-8080"
    assert TOKEN not in POLICY.cookie_value and len(POLICY.cookie_value) == 64
    assert POLICY.cookie_value == reploy_serve.AccessPolicy.for_server(TOKEN, 9, frozenset()).cookie_value
    assert POLICY.cookie_value != reploy_serve.AccessPolicy.for_server(TOKEN + "x", 8080,
                                                                 frozenset()).cookie_value
    assert TOKEN not in repr(POLICY) and POLICY.cookie_value not in repr(POLICY)


@pytest.mark.parametrize(("text", "split"), [
    ("127.0.0.1:8080", ("127.0.0.1", 8080)), ("LOCALHOST", ("localhost", None)),
    ("[::1]:1", ("::1", 1)), ("[::ffff:127.0.0.1]", ("::ffff:127.0.0.1", None)),
    ("reploy.proxy.test:65535", ("reploy.proxy.test", 65535)),
])
def test_host_headers_split(text: str, split: tuple[str, Optional[int]]) -> None:
    assert reploy_serve.split_authority(text) == split


# -- the Host allowlist per listen address ----------------------------------------------------

MACHINE = ("vm", "192.0.2.2", "fd00::2", "127.0.0.1", "::1")


@pytest.mark.parametrize(("listen", "extra", "allowed"), [
    ("127.0.0.1", (), {"localhost", "127.0.0.1", "::1"}),
    ("localhost", (), {"localhost", "127.0.0.1", "::1"}),
    ("::1", (), {"localhost", "127.0.0.1", "::1"}),
    ("127.0.0.5", ("Proxy.Test",), {"localhost", "127.0.0.1", "::1", "127.0.0.5", "proxy.test"}),
    ("0.0.0.0", (), {"localhost", "127.0.0.1", "::1", "vm", "192.0.2.2", "fd00::2"}),
    ("::", ("proxy.test",), {"localhost", "127.0.0.1", "::1", "vm", "192.0.2.2", "fd00::2",
                             "proxy.test"}),
    ("192.0.2.2", (), {"vm", "192.0.2.2", "fd00::2", "127.0.0.1", "::1"}),
])
def test_allowed_hosts_follow_the_listen_address(listen: str, extra: tuple[str, ...],
                                                 allowed: set[str]) -> None:
    machine = () if reploy_serve.is_loopback_listen(listen) else MACHINE
    assert reploy_serve.allowed_hosts(listen, machine, extra) == allowed


def test_only_loopback_listens_stay_on_the_machine() -> None:
    assert all(map(reploy_serve.is_loopback_listen, ("localhost", "127.0.0.1", "127.9.9.9", "::1")))
    assert not any(map(reploy_serve.is_loopback_listen, ("0.0.0.0", "::", "192.0.2.2", "fd00::2")))


# -- token files ------------------------------------------------------------------------------


def test_the_token_is_made_once_private_and_strong(tmp_path: Path) -> None:
    path = tmp_path / "token"
    token = reploy_serve.load_or_create_token(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert len(token) >= 43 and reploy_serve._TOKEN.fullmatch(token)  # 32 random bytes, URL-safe base64
    assert path.read_text() == token + "\n"
    assert reploy_serve.load_or_create_token(path) == token  # reused
    assert reploy_serve.load_or_create_token(tmp_path / "other") != token
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "token"]  # nothing left aside


def test_servers_starting_together_agree_on_one_token(tmp_path: Path) -> None:
    barrier = threading.Barrier(8)
    tokens: list[str] = []

    def start() -> None:
        barrier.wait()
        tokens.append(reploy_serve.load_or_create_token(tmp_path / "token"))

    threads = [threading.Thread(target=start) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(tokens) == 8 and len(set(tokens)) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["token"]


@pytest.mark.parametrize(("content", "mode", "complaint"), [
    (TOKEN + "\n", 0o644, "open to other users"),
    (TOKEN + "\n", 0o620, "open to other users"),
    ("", 0o600, "does not hold one token"),
    ("short-secret-value\n", 0o600, "does not hold one token"),
    (TOKEN + " " + TOKEN + "\n", 0o600, "does not hold one token"),
    (TOKEN + "\n" + TOKEN + "\n", 0o600, "does not hold one token"),
    ("x" * 5000, 0o600, "does not hold one token"),
])
def test_unusable_token_files_are_refused_without_quoting_them(
        tmp_path: Path, content: str, mode: int, complaint: str) -> None:
    path = tmp_path / "token"
    path.write_text(content)
    path.chmod(mode)
    with pytest.raises(reploy_serve.CredentialError) as info:
        reploy_serve.load_or_create_token(path)
    assert complaint in str(info.value)
    assert not content.strip() or content.strip()[:20] not in str(info.value)


def test_a_token_file_of_another_user_is_not_serves(tmp_path: Path) -> None:
    """A --token-file in a directory others can write: a file someone else planted there
    (private, well formed) would hand them the server."""
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    os.chown(path, os.geteuid() + 4242, -1)
    with pytest.raises(reploy_serve.CredentialError, match="belongs to uid") as info:
        reploy_serve.load_or_create_token(path)
    assert TOKEN[:20] not in str(info.value)
    os.chown(path, os.geteuid(), -1)
    assert reploy_serve.load_or_create_token(path) == TOKEN


def test_a_token_path_that_is_no_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(reploy_serve.CredentialError, match="not a regular file"):
        reploy_serve.read_token(tmp_path)
    with pytest.raises(reploy_serve.CredentialError, match="cannot read"):
        reploy_serve.read_token(tmp_path / "missing")
    with pytest.raises(reploy_serve.CredentialError, match="cannot make the token file"):
        reploy_serve.load_or_create_token(tmp_path / "missing" / "token")


# -- the CLI: serve's listen options, the session client's token ------------------------------


def run_reploy(*args: str, env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "reploy.py"), *args], capture_output=True,
                          timeout=60, env={**os.environ, **(env or {})})


@pytest.mark.parametrize(("extra", "complaint"), [
    (["--listen", "0.0.0.0:8080"], b"--allow-remote"),
    (["--listen", "[::]:8080"], b"--allow-remote"),
    (["--listen", "192.0.2.2:8080"], b"--allow-remote"),
    (["--listen", "example.com:8080", "--allow-remote"], b"not an IP address"),
    (["--allow-host", "*.example.com"], b"--allow-host"),
    (["--allow-host", "proxy.test:443"], b"--allow-host"),
    (["--allow-host", "http://proxy.test"], b"--allow-host"),
])
def test_serve_listen_usage_errors(extra: list[str], complaint: bytes, tmp_path: Path) -> None:
    proc = run_reploy("serve", "--state-dir", str(tmp_path), "--workload-dir", str(tmp_path), *extra)
    assert proc.returncode == 2 and proc.stdout == b"" and complaint in proc.stderr, proc.stderr
    assert not (tmp_path / "token").exists()


@pytest.fixture
def recorder() -> Iterator[LoopbackSite]:
    """A stand-in server whose session list is empty; it records what the client sent."""
    with LoopbackSite() as site:
        site.publish("/api/v1/sessions", "application/json", b'{"sessions": []}')
        yield site


def test_the_session_client_sends_the_token_it_is_given(recorder: LoopbackSite,
                                                       tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    other = TOKEN.replace("k", "m")
    token_file.write_text(other + "\n")
    token_file.chmod(0o600)
    unset = {k: v for k, v in os.environ.items() if k != "REPLOY_TOKEN"}
    runs = [
        subprocess.run([sys.executable, str(ROOT / "reploy.py"), "session", "list", "--server",
                        recorder.url], capture_output=True, timeout=60, env=unset),
        run_reploy("session", "list", "--server", recorder.url, env={"REPLOY_TOKEN": TOKEN}),
        run_reploy("session", "list", "--server", recorder.url, "--token-file", str(token_file),
                   env={"REPLOY_TOKEN": TOKEN}),
    ]
    assert [p.returncode for p in runs] == [0, 0, 0]
    assert [json.loads(p.stdout) for p in runs] == [{"sessions": []}] * 3
    assert [seen.get("Authorization") for seen in recorder.requests] == [
        None, f"Bearer {TOKEN}", f"Bearer {other}"]
    assert all(TOKEN not in p.stderr.decode() + p.stdout.decode() for p in runs)


@pytest.mark.parametrize(("args", "env", "complaint"), [
    ([], {"REPLOY_TOKEN": ""}, b"REPLOY_TOKEN"),
    ([], {"REPLOY_TOKEN": TOKEN + "\nX-Injected: 1"}, b"REPLOY_TOKEN"),
    ([], {"REPLOY_TOKEN": TOKEN + "\n"}, b"REPLOY_TOKEN"),
    ([], {"REPLOY_TOKEN": "short"}, b"REPLOY_TOKEN"),
    (["--token-file", "/nonexistent/token"], {}, b"cannot read"),
])
def test_the_session_client_refuses_unusable_tokens(args: list[str], env: dict[str, str],
                                                   complaint: bytes, recorder: LoopbackSite) -> None:
    proc = run_reploy("session", "list", "--server", recorder.url, *args, env=env)
    assert proc.returncode == 2 and proc.stdout == b"" and complaint in proc.stderr
    assert TOKEN.encode() not in proc.stderr
    assert recorder.requests == []  # nothing was sent


def test_openapi_documents_the_credentials_and_the_refusals() -> None:
    spec = json.loads((ROOT / "web/openapi.json").read_text())
    schemes = spec["components"]["securitySchemes"]
    assert schemes["bearer"] == {**schemes["bearer"], "type": "http", "scheme": "bearer"}
    assert (schemes["loginCookie"]["type"], schemes["loginCookie"]["in"]) == ("apiKey", "cookie")
    assert spec["security"] == [{"bearer": []}, {"loginCookie": []}]
    statuses = {"401": reploy_serve.Unauthorized, "403": reploy_serve.Forbidden,
                "415": reploy_serve.UnsupportedMediaType, "421": reploy_serve.MisdirectedRequest}
    for code, error in statuses.items():
        assert str(error.status) == code
    for method, path, _ in reploy_serve.API_ROUTES:
        documented = spec["paths"][path][method.lower()]["responses"]
        wanted = {"401", "403", "421"} | ({"415"} if method == "POST" else set())
        assert wanted <= set(documented), (method, path)
