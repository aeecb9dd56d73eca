"""Who may drive `reploy serve`, without Docker: the access rules (decide_access) over every
combination of method, path, Host, Origin, Sec-Fetch-Site, credentials and body, judged by an
oracle written from the rules of issues 11 and 21 (not from the code); the parsers at their
edges; the Host allowlist per listen address; token files and state directories; the one place
response headers pass; and the CLI's token, server and answer handling."""

from __future__ import annotations

import ast
import itertools
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import reploy_serve  # noqa: E402
from serve_harness import LoopbackSite, cli_error  # noqa: E402

TOKEN = "k" * 20 + "Q7-x_" + "z" * 18  # 43 characters, like a generated one
EXTRA_HOST = "reploy.proxy.test"
POLICY = reploy_serve.AccessPolicy(TOKEN, reploy_serve.allowed_hosts("127.0.0.1", (), (EXTRA_HOST,)))
SID = "0123456789abcdef"
ROUTE = "route"  #: the decision to serve the request


def decide(method: str, target: str, headers: list[tuple[str, str]],
           policy: reploy_serve.AccessPolicy = POLICY) -> Any:
    """The decision as the oracle states it: ROUTE, or the refusing status."""
    try:
        reploy_serve.decide_access(method, target, headers, policy)
    except reploy_serve.ServeError as e:
        return e.status
    return ROUTE


# -- the rules, over every combination --------------------------------------------------------
#
# The oracle below restates the issues' rules in order: a missing Host is malformed (400); a
# Host that is not one of the server's names is 421; paths outside /api/v1 need nothing (there
# is no login path: the login URL's token is in its fragment, which never reaches a server);
# under /api/v1 a foreign Origin or a cross-site/same-site Sec-Fetch-Site is 403; then a
# missing or wrong `Authorization: Bearer` 401 (the only credential: no cookie, and a token in
# the query string never counts), except on /api/v1/healthz, which needs none (seed 002: "No
# auth"); then a body that is not JSON 415.

METHODS = ("GET", "POST", "DELETE", "OPTIONS")
#: target -> its kind: "static", "api", "health" (the API path that needs no credential)
TARGETS = {
    "/": "static", "/app.js": "static", "/api/v1x": "static", "/api/v1/openapi.json": "api",
    "/api/v1": "api", "/api/v1/sessions": "api", "/api/v1/healthz": "health",
    "/api/v1/healthz/": "api", "/api/v1/healthz?x=1": "health", f"/api/v1/sessions/{SID}/stream?offset=0": "api",
    f"/api/v1/sessions?token={TOKEN}": "api", f"/login?token={TOKEN}": "static", "/login": "static",
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
    "cookie-is-the-token": ([("Cookie", f"reploy-8080={TOKEN}")], False),
    "cookie-named-token": ([("Cookie", f"a=1; token={TOKEN}; b=2")], False),
    "bearer-and-a-cookie": ([("Authorization", f"Bearer {TOKEN}"), ("Cookie", "reploy-8080=x")], True),
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
    if kind == "static":
        return ROUTE
    if origin not in (None, SAME) or site in ("same-site", "cross-site"):
        return 403
    if not CREDENTIALS[credential][1] and kind != "health":
        return 401
    if not BODIES[body][1]:
        return 415
    return ROUTE


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
    # The static shell needs no credentials, the API does, at any depth.
    ("/index.html", [("Host", "127.0.0.1:8080")], ROUTE),
    ("/api/v1/", [("Host", "127.0.0.1:8080")], 401),
    ("/api/v1/sessions/x/../../../app.js", [("Host", "127.0.0.1:8080")], 401),
    # A token in the query string is no credential, whatever it is called.
    (f"/api/v1/sessions?access_token={TOKEN}", [("Host", "127.0.0.1:8080")], 401),
    (f"/api/v1/sessions?token={TOKEN}", [("Host", "127.0.0.1:8080"),
                                         ("Authorization", "Bearer x")], 401),
    # Bearer takes the token after one scheme word; surrounding spaces do not matter.
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Authorization", f"  BEARER   {TOKEN} ")],
     ROUTE),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Authorization", f"Bearer {TOKEN} x")], 401),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Authorization", f"Token {TOKEN}")], 401),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Authorization", "Bearer \udcff" * 3)], 401),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"),
                          ("Authorization", "Bearer " + "é" * 43)], 401),
    # Header names are case-insensitive.
    ("/api/v1/sessions", [("HOST", "127.0.0.1:8080"), ("authorization", f"Bearer {TOKEN}")],
     ROUTE),
    ("/api/v1/sessions", [("host", "127.0.0.1:8080"), ("ORIGIN", "http://evil.example"), *GOOD], 403),
    # A same-origin page: default ports on either side, https through a TLS proxy.
    ("/api/v1/sessions", [("Host", "127.0.0.1"), ("Origin", "http://127.0.0.1:80"), *GOOD],
     ROUTE),
    ("/api/v1/sessions", [("Host", "127.0.0.1:80"), ("Origin", "http://127.0.0.1"), *GOOD],
     ROUTE),
    ("/api/v1/sessions", [("Host", EXTRA_HOST), ("Origin", f"https://{EXTRA_HOST}"), *GOOD],
     ROUTE),
    ("/api/v1/sessions", [("Host", EXTRA_HOST), ("Origin", f"https://{EXTRA_HOST}:443"), *GOOD],
     ROUTE),
    ("/api/v1/sessions", [("Host", "[::1]:8080"), ("Origin", "http://[::1]:8080"), *GOOD],
     ROUTE),
    # The scheme is not compared: no other page can be served on this server's own port.
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Origin", "https://127.0.0.1:8080"), *GOOD],
     ROUTE),
    ("/api/v1/sessions", [("Host", "127.0.0.1"), ("Origin", "https://127.0.0.1"), *GOOD],
     ROUTE),
    ("/api/v1/sessions", [("Host", "LOCALHOST:8080"), ("Origin", "http://localhost:8080"), *GOOD],
     ROUTE),
    # ... and every other page: another port, scheme, name, or a malformed Origin.
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Origin", "http://localhost:8080"), *GOOD], 403),
    ("/api/v1/sessions", [("Host", "127.0.0.1"), ("Origin", "https://127.0.0.1:80"), *GOOD], 403),
    ("/api/v1/sessions", [("Host", EXTRA_HOST), ("Origin", f"http://{EXTRA_HOST}:8443"), *GOOD], 403),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Origin", "ftp://127.0.0.1:8080"), *GOOD], 403),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Origin", "http://127.0.0.1:8080/"), *GOOD], 403),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Origin", "127.0.0.1:8080"), *GOOD], 403),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Origin", ""), *GOOD], 403),
    ("/api/v1/sessions", [("Host", "127.0.0.1:8080"), ("Sec-Fetch-Site", "Cross-Site"), *GOOD], 403),
    # No path logs in: /login is a static path (404), whatever its query.
    (f"/login?token={TOKEN}", [("Host", "127.0.0.1:8080")], ROUTE),
    (f"/login?token={TOKEN}", [("Host", "evil.example")], 421),
])
def test_edges(target: str, headers: list[tuple[str, str]], status: Any) -> None:
    assert decide("GET", target, headers) == status


def test_refusals_carry_their_headers_and_never_a_credential() -> None:
    try:
        reploy_serve.decide_access("GET", f"/api/v1/sessions?token={TOKEN}",
                                   [("Host", "127.0.0.1:8080"), ("Cookie", f"token={TOKEN}")], POLICY)
    except reploy_serve.Unauthorized as e:
        assert e.response_headers() == {"WWW-Authenticate": 'Bearer realm="reploy"'}
        assert "not accepted" in str(e) and TOKEN not in str(e)
    else:
        raise AssertionError("no 401")
    with pytest.raises(reploy_serve.Unauthorized) as info:
        reploy_serve.decide_access("GET", "/api/v1/sessions", [
            ("Host", "127.0.0.1:8080"), ("Authorization", f"Bearer {TOKEN[:-1]}")], POLICY)
    assert TOKEN[:-1] not in str(info.value)


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


def test_the_policy_keeps_its_secret_out_of_its_repr() -> None:
    assert TOKEN not in repr(POLICY)


# -- credentials are compared in constant time ------------------------------------------------
#
# How long a refusal takes is not measured (timing is bench's, and noisy); what is proved is
# the code's shape, read with ast: the credential a request presents and the server's own are
# used nowhere but as the arguments of same_secret, and same_secret is hmac.compare_digest.


def serve_functions() -> dict[str, ast.FunctionDef]:
    """reploy_serve.py's functions and methods (`name`, `Class.method`)."""
    tree = ast.parse((ROOT / "reploy_serve.py").read_text())
    found: dict[str, ast.FunctionDef] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            found.update((f"{node.name}.{item.name}", item) for item in node.body
                         if isinstance(item, ast.FunctionDef))
    return found


def is_authorization(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and str(node.value).lower() == "authorization"


def reads_authorization(function: ast.FunctionDef) -> bool:
    """Whether a function reads a request's Authorization header: the name is an argument of a
    call (`_single_header(headers, "authorization")`, `headers.get(...)`) or a subscript read
    (`headers["Authorization"]`); the client's own header, set in a dict, is not a read."""
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and any(map(is_authorization, node.args)):
            return True
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and is_authorization(node.slice):
            return True
    return False


def is_constant_time_call(node: ast.AST) -> bool:
    """`same_secret(...)` or `hmac.compare_digest(...)`."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (isinstance(func, ast.Name) and func.id == "same_secret") or (
        isinstance(func, ast.Attribute) and func.attr == "compare_digest"
        and isinstance(func.value, ast.Name) and func.value.id == "hmac")


def is_server_secret(node: ast.AST) -> bool:
    """An AccessPolicy's token: `policy.token`, `self.server.policy.token`."""
    if not (isinstance(node, ast.Attribute) and node.attr == "token"):
        return False
    owner = node.value
    return (isinstance(owner, ast.Name) and owner.id.endswith("policy")) or (
        isinstance(owner, ast.Attribute) and owner.attr.endswith("policy"))


def inside_constant_time_calls(function: ast.AST) -> set[int]:
    """The ids of every node within the arguments of a constant-time call in `function`."""
    inside: set[int] = set()
    for call in filter(is_constant_time_call, ast.walk(function)):
        for argument in call.args:
            inside.update(id(node) for node in ast.walk(argument))
    return inside


def bound_from(function: ast.FunctionDef, source: ast.AST) -> set[str]:
    """The names an assignment in `function` binds from an expression that holds `source`
    (a node) or reads one of the names bound so (one level: the assignments of a function
    that reads a header are few and straight)."""
    names: set[str] = set()

    def targets(assign: ast.Assign) -> set[str]:
        return {n.id for t in assign.targets for n in ast.walk(t) if isinstance(n, ast.Name)}

    for assign in (n for n in ast.walk(function) if isinstance(n, ast.Assign)):
        if any(node is source for node in ast.walk(assign.value)):
            names |= targets(assign)
    for assign in (n for n in ast.walk(function) if isinstance(n, ast.Assign)):
        if any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(assign.value)):
            names |= targets(assign)
    return names


def test_every_credential_comparison_goes_through_same_secret() -> None:
    functions = serve_functions()
    # same_secret is hmac.compare_digest of its two arguments, and compares nothing itself.
    same_secret = functions["same_secret"]
    [statement] = same_secret.body[1:] if ast.get_docstring(same_secret) else same_secret.body
    assert isinstance(statement, ast.Return) and is_constant_time_call(statement.value)
    assert isinstance(statement.value, ast.Call) and statement.value.func.attr == "compare_digest"
    parameters = {argument.arg for argument in same_secret.args.args}
    assert parameters == {n.id for argument in statement.value.args for n in ast.walk(argument)
                          if isinstance(n, ast.Name)}
    assert not any(isinstance(n, ast.Compare) for n in ast.walk(same_secret))
    # The server's credential is read in the whole file only as same_secret's argument.
    tree = ast.parse((ROOT / "reploy_serve.py").read_text())
    inside = inside_constant_time_calls(tree)
    secrets_read = [n for n in ast.walk(tree) if is_server_secret(n)]
    assert secrets_read and all(id(n) in inside for n in secrets_read), [
        f"line {n.lineno}" for n in secrets_read if id(n) not in inside]
    # Each function that reads the Authorization header uses what the request presents nowhere
    # but in that call: no ==, no `in`, no startswith, nothing else sees it.
    readers = [name for name, function in functions.items() if reads_authorization(function)]
    assert readers == ["decide_access"]  # a new reader must meet the same rule: add it here
    for name in readers:
        function = functions[name]
        inside = inside_constant_time_calls(function)
        calls = [n for n in ast.walk(function) if is_constant_time_call(n)]
        assert calls, f"{name} reads the Authorization header but never calls same_secret"
        [header_read] = [n for n in ast.walk(function) if is_authorization(n)]
        header_names = bound_from(function, header_read)
        presented = {n.id for call in calls for argument in call.args for n in ast.walk(argument)
                     if isinstance(n, ast.Name) and n.id in header_names}
        assert presented, f"{name}: same_secret is not given the header's credential"
        stray = [f"{n.id} on line {n.lineno}" for n in ast.walk(function)
                 if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in presented
                 and id(n) not in inside]
        assert stray == [], f"{name} uses the presented credential outside same_secret"


@pytest.mark.parametrize(("given", "expected", "same"), [
    (TOKEN, TOKEN, True),
    (TOKEN[:-1] + "y", TOKEN, False),  # the same length, the last character differs
    ("y" + TOKEN[1:], TOKEN, False),  # the first
    (TOKEN[:-1], TOKEN, False),  # a prefix
    (TOKEN + "z", TOKEN, False),  # longer
    ("", TOKEN, False),
    ("tökén-" + TOKEN[6:], TOKEN, False),  # non-ASCII, as a header decoded as Latin-1 gives it
    ("\udcff" + TOKEN[1:], TOKEN, False),  # a lone surrogate
    ("jeton-é" * 6, "jeton-é" * 6, True),  # non-ASCII on both sides compares by its bytes
])
def test_same_secret_answers_by_content(given: str, expected: str, same: bool) -> None:
    assert reploy_serve.same_secret(given, expected) is same


@pytest.mark.parametrize("credential", ["tökén", "\udcff" * 43, TOKEN[:-1] + "é", "ü" * 4000])
def test_a_non_ascii_credential_is_refused_as_wrong(credential: str) -> None:
    headers = [("Host", "127.0.0.1:8080"), ("Authorization", f"Bearer {credential}")]
    assert decide("GET", "/api/v1/sessions", headers) == 401


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
    assert schemes == {"bearer": {**schemes["bearer"], "type": "http", "scheme": "bearer"}}
    assert spec["security"] == [{"bearer": []}]
    statuses = {"401": reploy_serve.Unauthorized, "403": reploy_serve.Forbidden,
                "415": reploy_serve.UnsupportedMediaType, "421": reploy_serve.MisdirectedRequest}
    for code, error in statuses.items():
        assert str(error.status) == code
    for method, path, _ in reploy_serve.API_ROUTES:
        documented = spec["paths"][path][method.lower()]["responses"]
        wanted = {"401", "403", "421"} | ({"415"} if method == "POST" else set())
        assert wanted <= set(documented), (method, path)
    # Issue 21: every response carries the sandbox; every one of Reploy's own routes that asks a
    # session's agent documents the refused answer (502) and the full quota (507) (seed 002's
    # routes answer the spec's statuses, anything else 500).
    asks_the_agent = {("POST", "message"), ("POST", "interrupt"), ("POST", "relaunch"), ("POST", "resize"),
                      ("GET", "status"), ("POST", "exec"), ("GET", "list_files"), ("GET", "get_file"),
                      ("PUT", "put_file")}
    for method, path, handler in reploy_serve.API_ROUTES:
        responses = spec["paths"][path][method.lower()]["responses"]
        if (method, handler) in asks_the_agent:
            assert {"502", "507"} <= set(responses), (method, path)
        for code, response in responses.items():
            response = spec["components"]["responses"][response["$ref"].rpartition("/")[2]] \
                if "$ref" in response else response
            assert {"Content-Security-Policy", "X-Content-Type-Options"} <= set(response["headers"]), (
                method, path, code)
    download = spec["paths"]["/sessions/{id}/files/{path}"]["get"]["responses"]["200"]
    assert set(download["content"]) == {"application/octet-stream", "application/x-tar"}
    assert "Content-Disposition" in download["headers"]


# -- the one place response headers pass (issue 21, attack 1) ---------------------------------


class Sink:
    """What a handler writes its response to."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data

    def flush(self) -> None:
        pass


def response_handler() -> reploy_serve.ApiHandler:
    """An ApiHandler in the middle of answering a GET, writing to a Sink (no socket)."""
    handler = reploy_serve.ApiHandler.__new__(reploy_serve.ApiHandler)
    handler.request_version, handler.requestline, handler.command = "HTTP/1.1", "GET / HTTP/1.1", "GET"
    handler.client_address = ("127.0.0.1", 1)
    handler.wfile = Sink()
    return handler


@pytest.mark.parametrize(("name", "value"), [
    ("Content-Length", "5\r\nContent-Type: text/html"), ("Content-Length", "5\nX: y"),
    ("Content-Length", "5\rX: y"), ("X-Name", "a\x00b"), ("X-Name", "caf\u00e9"),
    ("Content-Type\r\nX-Injected", "1"), ("Bad Name", "1"), ("", "1"),
])
def test_no_header_can_carry_a_line_break_or_a_control_character(name: str, value: str) -> None:
    handler = response_handler()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/octet-stream")
    with pytest.raises(reploy_serve.UnsafeHeader) as refused:
        handler.send_header(name, value)
    assert refused.value.status == 500
    # The response begun is dropped, unsent; an error can be answered in its place.
    handler.send_json(refused.value.status, {"error": str(refused.value)})
    sent = handler.wfile.data
    assert sent.startswith(b"HTTP/1.1 500 ") and b"200" not in sent.split(b"\r\n")[0]
    assert b"application/octet-stream" not in sent and b"text/html" not in sent
    assert b"Content-Security-Policy: default-src 'none'; sandbox\r\n" in sent


def test_every_response_gets_the_sandbox_unless_it_names_its_own_policy() -> None:
    handler = response_handler()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/x-tar")
    handler.end_headers()
    handler.send_response(200)
    handler.send_header("Content-Security-Policy", reploy_serve.CONTENT_SECURITY_POLICY)
    handler.end_headers()
    first, second = handler.wfile.data.split(b"\r\n\r\n")[:2]
    assert b"Content-Security-Policy: default-src 'none'; sandbox" in first
    assert b"X-Content-Type-Options: nosniff" in first and b"X-Content-Type-Options: nosniff" in second
    assert second.count(b"Content-Security-Policy") == 1 and b"sandbox" not in second


# -- state directories and token files serve trusts (issue 21, attack 7) -----------------------


def serve_start(state_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """A serve start that fails before any Docker call: the workload dir is empty."""
    return run_reploy("serve", "--listen", "127.0.0.1:0", "--state-dir", str(state_dir),
                      "--workload-dir", str(state_dir.parent), *extra)


def foreign(path: Path) -> None:
    os.chown(path, os.geteuid() + 4242, os.getegid() + 4242)


@pytest.mark.parametrize(("arrange", "complaint"), [
    (lambda d: (d.mkdir(mode=0o700), foreign(d)), "the state directory {d} belongs to uid"),
    (lambda d: (d.mkdir(), d.chmod(0o777)), "the state directory {d} is writable by others (mode 0777)"),
    (lambda d: (d.mkdir(), d.chmod(0o770)), "the state directory {d} is writable by others (mode 0770)"),
    (lambda d: (d.mkdir(mode=0o700), (d / "sessions").mkdir(), foreign(d / "sessions")),
     "the sessions directory {d}/sessions belongs to uid"),
    (lambda d: (d.mkdir(mode=0o700), (d / "sessions").mkdir(), (d / "sessions").chmod(0o757)),
     "the sessions directory {d}/sessions is writable by others"),
    (lambda d: (d.mkdir(mode=0o700), (d.parent / "elsewhere").mkdir(), (d / "sessions").symlink_to(
        d.parent / "elsewhere")), "the sessions directory {d}/sessions is not a directory"),
    (lambda d: (d.mkdir(mode=0o700), (d / "token").write_text(TOKEN + "\n"), (d / "token").chmod(0o600),
                foreign(d / "token")), "the token file {d}/token belongs to uid"),
    (lambda d: (d.mkdir(mode=0o700), (d / "token").write_text(TOKEN + "\n"), (d / "token").chmod(0o622)),
     "the token file {d}/token is open to other users"),
])
def test_serve_refuses_a_state_dir_or_token_file_it_cannot_trust(
        tmp_path: Path, arrange: Any, complaint: str) -> None:
    state_dir = tmp_path / "state"
    arrange(state_dir)
    proc = serve_start(state_dir)
    assert proc.returncode == 1, proc.stderr
    assert complaint.format(d=state_dir) in proc.stderr.decode(), proc.stderr
    assert json.loads(proc.stdout)["ok"] is False and TOKEN.encode() not in proc.stdout + proc.stderr
    if "token file" in complaint:
        assert (state_dir / "token").read_text() == TOKEN + "\n"
    else:  # no secret was written where serve does not trust, and no store opened
        assert not (state_dir / "token").exists() and not (state_dir / "sessions.db").exists()


def test_a_missing_state_dir_is_made_private(tmp_path: Path) -> None:
    state_dir = tmp_path / "a" / "state"
    reploy_serve.prepare_state_dir(state_dir)
    for path in (state_dir, state_dir / "sessions"):
        facts = path.stat()
        assert (facts.st_uid, stat.S_IMODE(facts.st_mode) & 0o077) == (os.geteuid(), 0), path
    reploy_serve.prepare_state_dir(state_dir)  # and accepted as it is


# -- the session client: its token, its server, and whatever answers (attacks 6 and 9) ---------


def test_the_token_is_read_only_from_a_regular_file(tmp_path: Path, recorder: LoopbackSite) -> None:
    """A FIFO (the attack of issue 21: the CLI hung for ever) and a device fail at once."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    linked = tmp_path / "linked"
    real = tmp_path / "real"
    real.write_text(TOKEN + "\n")
    real.chmod(0o600)
    linked.symlink_to(real)
    for path, complaint in ((fifo, b"not a regular file"), (Path("/dev/zero"), b"not a regular file"),
                            (tmp_path, b"not a regular file")):
        proc = run_reploy("session", "list", "--server", recorder.url, "--token-file", str(path))
        assert (proc.returncode, proc.stdout) == (2, b"") and complaint in proc.stderr, proc.stderr
        with pytest.raises(reploy_serve.CredentialError, match="not a regular file"):
            reploy_serve.read_token(path)
    assert recorder.requests == []
    proc = run_reploy("session", "list", "--server", recorder.url, "--token-file", str(linked))
    assert proc.returncode == 0 and recorder.requests[-1]["Authorization"] == f"Bearer {TOKEN}"


def resolves_to_loopback(name: str) -> bool:
    import ipaddress
    import socket
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(name, 80))
    except OSError:
        return False


def test_plain_http_beyond_loopback_needs_the_users_word(recorder: LoopbackSite) -> None:
    """The token is the whole credential: over plain http to another machine it would cross
    the network in clear. Loopback (by address or `localhost`) and https need no flag."""
    import socket
    port = recorder.url.rpartition(":")[2]
    for server in ("http://192.0.2.1:8080", "http://[2001:db8::1]:8080", f"http://{socket.gethostname()}:{port}",
                   "http://127.0.0.1.nip.io:8080"):
        proc = run_reploy("session", "list", "--server", server, env={"REPLOY_TOKEN": TOKEN})
        assert (proc.returncode, proc.stdout) == (2, b""), (server, proc.stderr)
        assert b"--allow-plain-http" in proc.stderr and TOKEN.encode() not in proc.stderr
    proc = run_reploy("session", "list", env={"REPLOY_TOKEN": TOKEN, "REPLOY_SERVER": "http://192.0.2.1"})
    assert proc.returncode == 2 and b"--allow-plain-http" in proc.stderr
    for server in ("ftp://127.0.0.1", "http://", "http://u:p@127.0.0.1:1", "http://127.0.0.1:99999",
                   "http://127.0.0.1/x?token=1"):
        proc = run_reploy("session", "list", "--server", server, env={"REPLOY_TOKEN": TOKEN})
        assert proc.returncode == 2 and b"is not http(s)://HOST[:PORT]" in proc.stderr, server
    assert recorder.requests == []
    for server in (recorder.url, f"http://localhost:{port}"):
        assert run_reploy("session", "list", "--server", server, env={"REPLOY_TOKEN": TOKEN}).returncode == 0
    if resolves_to_loopback(socket.gethostname()):  # said so: the same machine by another name
        proc = run_reploy("session", "list", "--allow-plain-http", "--server",
                          f"http://{socket.gethostname()}:{port}", env={"REPLOY_TOKEN": TOKEN})
        assert proc.returncode == 0, proc.stderr


class OtherServer:
    """Some other server on the port `reploy session` talks to (attack 9), answering every
    method and path alike with `answer` = (status, content type, body), or streaming zeros for
    ever when the body is None; it records what it was sent."""

    def __init__(self, answer: tuple[int, str, Optional[bytes]],
                 pages: Optional[dict[str, tuple[int, str, bytes]]] = None) -> None:
        import http.server

        self.answer, self.pages = answer, pages or {}
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.hung_up = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def respond(self) -> None:
                outer.requests.append((self.command, self.path, dict(self.headers.items())))
                length = int(self.headers.get("Content-Length") or 0)
                while length > 0:
                    length -= len(self.rfile.read(min(length, 1 << 20)))
                status, content_type, body = outer.pages.get(self.path.partition("?")[0], outer.answer)
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                if body is not None:
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    while True:
                        self.wfile.write(b"\0" * (1 << 20))
                except OSError:
                    outer.hung_up.set()

            do_GET = do_POST = do_PUT = do_DELETE = respond

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("answer", [
    (200, "text/html", b"<html>not reploy</html>"), (404, "text/html", b"<h1>Not Found</h1>"),
    (500, "text/plain", b"oops"), (200, "application/json", b"[1, 2]"),
    (200, "application/json", b'{"unexpected": true}'), (403, "application/json", b'{"error": 5}'),
    (200, "application/json", b"\xff\xfe"), (200, "application/json", b'{"a": 1} {"b": 2}'),
])
def test_another_server_on_the_port_is_one_clear_error(tmp_path: Path, answer: tuple[int, str, bytes]) -> None:
    """Attack 9: whatever answers in serve's place, every command says so once and exits 1,
    never with a traceback."""
    other = OtherServer(answer)
    local = tmp_path / "local.txt"
    local.write_text("local\n")
    try:
        for command in (["list"], ["get", SID], ["message", SID, "hi"], ["exec", SID, "--raw", "--", "true"],
                        ["cp", f"{SID}:f.txt", str(tmp_path / "out")], ["cp", str(local), f"{SID}:f.txt"]):
            proc = run_reploy("session", command[0], "--server", other.url, *command[1:],
                              env={"REPLOY_TOKEN": TOKEN})
            assert proc.returncode == 1, (command, proc.stdout, proc.stderr)
            assert b"Traceback" not in proc.stderr, (command, proc.stderr)
            assert proc.stdout == b"", (command, proc.stdout)
            said = proc.stderr
            assert b"did not answer as reploy serve does" in said and said.count(b"\n") == 1, (command, said)
        assert not (tmp_path / "out").exists()
    finally:
        other.close()


def test_session_cp_stops_at_the_quota_serve_reports(tmp_path: Path) -> None:
    """Attack 6: a directory's tar that never ends. `session cp` spools at most the session's
    quota (here a serve older than the session's own `diskMib`: GET /server's) plus a tar's
    overhead, then stops, says so, and leaves nothing; a download that announces more is
    refused before anything is spooled."""
    quota = 1 << 20
    config = json.dumps({"limits": {"sessionDiskBytes": quota}}).encode()
    session = json.dumps({"id": SID, "name": "n", "state": "active"}).encode()
    entry = {"name": "d", "type": "directory", "size": 0, "mode": 0o755, "mtime": 0}
    listing = json.dumps({"root": "workspace", "path": "d", "entry": entry, "entries": [],
                          "truncated": False}).encode()
    other = OtherServer((200, "application/x-tar", None), {
        "/api/v1/server": (200, "application/json", config),
        f"/api/v1/sessions/{SID}": (200, "application/json", session),
        f"/api/v1/sessions/{SID}/list/d": (200, "application/json", listing)})
    out = tmp_path / "out"
    out.mkdir()
    limit = quota + reploy_serve.agent_role.MAX_ARCHIVE_ENTRIES * reploy_serve.TAR_BYTES_PER_ENTRY
    try:
        proc = run_reploy("session", "cp", f"{SID}:d", str(out), "--server", other.url,
                          env={"REPLOY_TOKEN": TOKEN})
        assert b"Traceback" not in proc.stderr
        assert cli_error(proc)["error"] == f"{SID}:d: the download exceeds {limit} bytes; nothing was kept"
        assert list(out.iterdir()) == []
        assert other.hung_up.wait(30)  # the CLI stopped reading
    finally:
        other.close()
    announced = OtherServer((200, "application/octet-stream", b""), {
        "/api/v1/server": (200, "application/json", config),
        f"/api/v1/sessions/{SID}": (200, "application/json", session),
        f"/api/v1/sessions/{SID}/list/f": (200, "application/json", listing.replace(b'"directory"', b'"file"'))})
    try:
        # The body is empty, but the header announces 1 TiB: refused before a byte is read.
        announced.pages[f"/api/v1/sessions/{SID}/files/f"] = (200, "application/octet-stream", b"")
        original = announced.server.RequestHandlerClass.send_header

        def send_header(handler: Any, name: str, value: str) -> None:
            original(handler, name, str(1 << 40) if name == "Content-Length" and handler.path.endswith("/files/f")
                     else value)
        announced.server.RequestHandlerClass.send_header = send_header  # type: ignore[method-assign]
        proc = run_reploy("session", "cp", f"{SID}:f", str(out), "--server", announced.url,
                          env={"REPLOY_TOKEN": TOKEN})
        assert "announces more than" in cli_error(proc)["error"]
        assert list(out.iterdir()) == []
    finally:
        announced.close()
