"""Attacks on a real `reploy serve` (issues 11 and 21), from where a workstation is exposed:
pages in the user's own browser (headless Chromium, logged in, so its tab holds the token)
served from another loopback origin or reached through DNS rebinding, and a raw HTTP client
that plays the rebinding page or guesses credentials. Each test checks that nothing was
created, read or typed, and that the server itself refused (the status Chromium received), not
only the browser's CORS rules. Also: the login URL and where its token goes (issue 21's attack
3: a cookie reached every port of the host), the headers of every response, the token file and
the listen addresses.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from cdp import Browser
from serve_harness import (  # noqa: F401  (fixtures)
    cli_error,
    ROOT, Api, LoopbackSite, ServeProcess, log_in, managed_workload, serve_factory, start_browser,
    wait_until,
)

pytestmark = pytest.mark.docker
#: Chromium resolves this name to 127.0.0.1, as a rebinding DNS server would once the page ran.
REBOUND = "rebind.test"

#: What a hostile page tries against the server at TARGET, whose session SID it knows (the worst
#: case). Every result is what the page could see; `done` when all are settled.
ATTACK_PAGE = """<!doctype html><html><body><iframe name="sink"></iframe><script>
"use strict";
const target = TARGET, sid = SID, api = target + "/api/v1";
const results = {};
async function attempt(name, run) {
  try { results[name] = await run(); } catch (e) { results[name] = "error: " + e.name; }
}
const seen = async (r) => `${r.type}:${r.status}:${await r.text()}`;
(async () => {
  // The classic JSON CSRF: a text/plain form whose one field spells a JSON body.
  const form = document.createElement("form");
  Object.assign(form, { method: "POST", action: api + "/sessions", enctype: "text/plain", target: "sink" });
  const field = document.createElement("input");
  Object.assign(field, { name: '{"name":"pwn-form","x":"', value: '"}' });
  form.append(field);
  document.body.append(form);
  form.submit();
  const text = (body) => ({ method: "POST", mode: "no-cors", credentials: "include",
                            headers: { "Content-Type": "text/plain" }, body: JSON.stringify(body) });
  await attempt("create-text", async () => seen(await fetch(api + "/sessions", text({ name: "pwn-text" }))));
  await attempt("write-text", async () => seen(await fetch(`${api}/sessions/${sid}/write`, text({ payload: "echo pwned-by-page\\r" }))));
  await attempt("read-text", async () => seen(await fetch(`${api}/sessions/${sid}/read`, text({ offset: 0 }))));
  await attempt("create-json", async () => seen(await fetch(api + "/sessions", {
    method: "POST", credentials: "include", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ name: "pwn-json" }) })));
  await attempt("delete", async () => seen(await fetch(`${api}/sessions/${sid}`, { method: "DELETE", credentials: "include" })));
  await attempt("list", async () => seen(await fetch(api + "/sessions", { credentials: "include" })));
  await attempt("list-no-cors", async () => seen(await fetch(api + "/sessions", { credentials: "include", mode: "no-cors" })));
  await attempt("stream", () => new Promise((resolve) => {
    const source = new EventSource(`${api}/sessions/${sid}/stream?offset=0`, { withCredentials: true });
    const got = [];
    source.addEventListener("output", (event) => got.push(event.data));
    source.onerror = () => { source.close(); resolve(`closed after ${got.length} events ${got.join()}`); };
  }));
  window.results = results;
})();
</script></body></html>"""

EXPECTED_RESULTS = {
    "create-text": "opaque:0:", "write-text": "opaque:0:", "read-text": "opaque:0:",
    "create-json": "error: TypeError", "delete": "error: TypeError", "list": "error: TypeError",
    "list-no-cors": "opaque:0:", "stream": "closed after 0 events ",
}


@pytest.fixture
def attack_browser() -> Iterator[Browser]:
    instance = start_browser(f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1")
    yield instance
    instance.close()


@pytest.fixture
def hostile_site() -> Iterator[LoopbackSite]:
    """The hostile web site: another loopback origin (127.0.0.1, another port)."""
    with LoopbackSite() as site:
        yield site


def requests_to(browser: Browser, base_url: str) -> list[dict[str, Any]]:
    """What Chromium's network events say about each request to base_url: method, path, the
    status the server answered (None: the browser never got one), whether any credential went
    along (a cookie or an Authorization header), the response's header names, and the CORS
    error if any."""
    seen: dict[str, dict[str, Any]] = {}
    for event in browser.events:
        params = event["params"]
        entry = seen.setdefault(params.get("requestId", ""), {
            "status": None, "credential": False, "headers": [], "cors": None})
        if event["method"] == "Network.requestWillBeSent":
            entry["method"], entry["url"] = params["request"]["method"], params["request"]["url"]
        elif event["method"] == "Network.requestWillBeSentExtraInfo":
            sent = {name.lower() for name in params.get("headers", {})}
            entry["credential"] |= bool(params.get("associatedCookies")) or bool(
                {"cookie", "authorization"} & sent)
        elif event["method"] == "Network.responseReceivedExtraInfo":
            entry["status"] = params["statusCode"]
            entry["headers"] = [name.lower() for name in params["headers"]]
        elif event["method"] == "Network.loadingFailed":
            entry["cors"] = (params.get("corsErrorStatus") or {}).get("corsError")
    return [{**e, "path": e["url"][len(base_url):]} for e in seen.values()
            if e.get("url", "").startswith(base_url + "/")]


def session_ids(server: ServeProcess) -> list[str]:
    return [s["id"] for s in server.api.call("GET", "/sessions")["sessions"]]


def test_a_page_on_another_loopback_origin_gets_nothing(
        serve_factory: Callable[..., ServeProcess], attack_browser: Browser,
        hostile_site: LoopbackSite) -> None:
    server = serve_factory()
    base = server.ready["url"]
    sid, _ = server.api.shell_ran("victim", "echo secret-$((6*7))", b"secret-42\r\n$ ")
    log_in(attack_browser, server)  # the worst case: the user is logged in in this browser
    attack_browser.navigate("about:blank")  # the UI's own polling ends here
    attack_browser.wait_for("location.href === 'about:blank'", "a blank page")
    attack_browser.call("Network.enable")
    page = ATTACK_PAGE.replace("TARGET", json.dumps(base)).replace("SID", json.dumps(sid))
    attack_browser.navigate(hostile_site.publish("/", "text/html; charset=utf-8", page.encode()))
    results = attack_browser.wait_for("window.results", "the page's attacks")

    def settled() -> Any:  # 11 requests: 9 answered, 2 stopped at their preflight
        attempts = requests_to(attack_browser, base)
        return len(attempts) >= 11 and all(e["status"] or e["cors"] for e in attempts) and attempts

    attempts = wait_until(lambda: attack_browser.evaluate("true") and settled(), "every answer")

    # Nothing created, deleted or typed; the page saw nothing of the session.
    assert results == EXPECTED_RESULTS
    assert session_ids(server) == [sid]
    output = server.api.read_all(sid)
    assert b"secret-42" in output and b"pwned-by-page" not in output
    # The server refused every request itself; no credential went along with any (the token
    # lives in the UI's tab, for its origin alone); only the preflighted JSON POST and DELETE
    # never left the browser.
    assert {e["status"] for e in attempts} == {403, None}, attempts
    unsent = [e for e in attempts if e["status"] is None]
    assert sorted((e["method"], e["cors"]) for e in unsent) == [
        ("DELETE", "PreflightMissingAllowOriginHeader"), ("POST", "PreflightMissingAllowOriginHeader")]
    assert sorted(e["method"] for e in attempts if e["status"] == 403) == [
        "GET", "GET", "GET", "OPTIONS", "OPTIONS", "POST", "POST", "POST", "POST"]
    sent = [e for e in attempts if e["status"] and e["method"] != "OPTIONS"]  # preflights: none
    assert len(sent) == 7 and not any(e["credential"] for e in attempts), attempts
    assert not [h for e in attempts for h in e["headers"] if h.startswith("access-control-")]


def test_a_rebound_page_in_the_browser_gets_nothing(
        serve_factory: Callable[..., ServeProcess], attack_browser: Browser) -> None:
    server = serve_factory()
    sid = server.api.create("victim")["id"]
    log_in(attack_browser, server)
    # After rebinding, the attacker's page runs in the origin http://rebind.test:PORT, which now
    # resolves to the server: to the browser, every request below is same-origin.
    rebound = f"http://{REBOUND}:{server.api.port}"
    # The attacker's page would come from its own server before the rebinding; here the page is
    # serve's own 421 answer, whose sandbox would stop the page's scripts: CSP is lifted so it
    # stands in for the attacker's page (the server's refusals below are what is tested).
    attack_browser.call("Page.setBypassCSP", enabled=True)
    attack_browser.navigate(rebound + "/")
    attack_browser.wait_for(f"location.href === {json.dumps(rebound + '/')} && "
                            "document.readyState === 'complete'", "the rebound origin")
    # Not even the UI's files: the rebound page gets our error instead.
    assert "does not answer for Host" in attack_browser.evaluate("document.body.textContent")
    seen = attack_browser.evaluate(f"""(async () => {{
      const out = [];
      const sid = {json.dumps(sid)};
      for (const [path, init] of [["/api/v1/sessions", {{}}],
          [`/api/v1/sessions/${{sid}}/read`, {{ method: "POST", headers: {{ "Content-Type": "application/json" }}, body: "{{}}" }}],
          [`/api/v1/sessions/${{sid}}/write`, {{ method: "POST", headers: {{ "Content-Type": "application/json" }},
                                               body: JSON.stringify({{ payload: "echo pwned-by-rebinding\\r" }}) }}],
          ["/api/v1/sessions", {{ method: "POST", headers: {{ "Content-Type": "application/json" }},
                                   body: JSON.stringify({{ name: "pwn" }}) }}],
          ["/app.js", {{}}]]) {{
        const r = await fetch(path, init);
        out.push([r.status, await r.text()]);
      }}
      return out;
    }})()""")
    assert [status for status, _ in seen] == [421] * 5
    assert not any(sid in text or "sessions" in text for _, text in seen)
    assert session_ids(server) == [sid]
    assert b"pwned-by-rebinding" not in server.api.read_all(sid)


def test_the_browser_credential_stays_on_its_port(
        serve_factory: Callable[..., ServeProcess], attack_browser: Browser,
        hostile_site: LoopbackSite) -> None:
    """Attack 3: after login, a page on another port of the same loopback address (any local
    listener, which any page can bounce the browser to) received the login cookie, and the
    cookie drove the API. Now the token lives in the UI tab's sessionStorage, for serve's origin
    alone: that page gets no credential, reads nothing, and the address bar, the tab's history
    and the cookie jar never hold the token. Log out forgets it."""
    server = serve_factory()
    token, url = server.ready["token"], server.ready["url"]
    server.api.create("victim")
    assert urllib.parse.urlsplit(server.ready["login_url"]).fragment == "token=" + token
    log_in(attack_browser, server)
    history = [e["url"] for e in attack_browser.call("Page.getNavigationHistory")["entries"]]
    assert token not in json.dumps(history) and attack_browser.evaluate("location.href") == url + "/"
    assert attack_browser.evaluate("sessionStorage.getItem('reploy-token')") == token
    assert attack_browser.call("Storage.getCookies")["cookies"] == []
    # The UI sends it as a header, the stream included.
    attack_browser.navigate(url + "/#/")
    attack_browser.wait_for("document.querySelectorAll('tr[data-session]').length === 1", "the sessions")

    page = b"""<!doctype html><script>
      window.seen = [document.cookie, sessionStorage.length, localStorage.length];
    </script>"""
    attack_browser.navigate(hostile_site.publish("/bounced", "text/html", page))
    seen = attack_browser.wait_for("window.seen", "the other port's page")
    assert seen == ["", 0, 0]
    assert hostile_site.requests  # the page, and whatever else the browser asked there
    for request in hostile_site.requests:
        assert not {"cookie", "authorization"} & {name.lower() for name in request}, request
    assert token not in json.dumps(hostile_site.requests)

    # Back on serve's origin the tab is still logged in; log out forgets the token.
    attack_browser.navigate(url + "/#/")
    attack_browser.wait_for("document.querySelectorAll('tr[data-session]').length === 1", "the sessions again")
    attack_browser.evaluate("document.querySelector('[data-test=logout]').click()")
    attack_browser.wait_for("!!document.querySelector('[data-test=login-screen]')", "the login note")
    assert attack_browser.evaluate("sessionStorage.getItem('reploy-token')") is None
    attack_browser.navigate(url + "/#/new")
    attack_browser.wait_for("!!document.querySelector('[data-test=login-screen]')", "still logged out")


#: The headers every API response carries, whatever it is: nothing in it can run as a page.
SANDBOXED = {"content-security-policy": "default-src 'none'; sandbox", "x-content-type-options": "nosniff",
             "referrer-policy": "no-referrer"}


def test_every_response_is_sandboxed_and_never_sniffed(serve_factory: Callable[..., ServeProcess]) -> None:
    """Item 3 of issue 21: JSON answers and errors of every kind, the stream and downloads carry
    the sandbox; downloads are attachments of a binary type; the UI's own files keep theirs."""
    server = serve_factory()
    api, port = server.api, server.api.port
    sid = api.create("files")["id"]
    assert api.call("POST", f"/sessions/{sid}/exec", {"argv": ["sh", "-c", "mkdir d && echo hi > d/f.html"]})[
        "exitCode"] == 0
    seen = []
    for method, path, headers, body in (
            ("GET", "/api/v1/sessions", {}, None),
            ("GET", f"/api/v1/sessions/{sid}/files/d/f.html", {}, None),
            ("GET", f"/api/v1/sessions/{sid}/files/d", {}, None),
            ("GET", f"/api/v1/sessions/{sid}/list/d", {}, None),
            ("GET", "/api/v1/sessions/0123456789abcdef", {}, None),  # 404
            ("DELETE", "/api/v1/config", {}, None),  # 405
            ("POST", "/api/v1/sessions", {"Content-Type": "text/plain"}, b"x"),  # 415
            ("GET", "/api/v1/sessions", {"Origin": "http://evil.example"}, None),  # 403
            ("GET", "/api/v1/sessions", {"Host": f"evil.example:{port}"}, None),  # 421
            ("GET", "/login?token=x", {}, None)):  # 404: no such path
        status, response_headers, raw = api.request(method, path, body, headers=headers)
        seen.append((path, status))
        assert {k: response_headers.get(k) for k in SANDBOXED} == SANDBOXED, (path, status, response_headers)
        if "/files/" in path:
            kind = "application/x-tar" if path.endswith("/d") else "application/octet-stream"
            assert (status, response_headers["content-type"]) == (200, kind), path
            assert response_headers["content-disposition"].startswith("attachment; "), path
        else:
            assert response_headers["content-type"] == "application/json", (path, response_headers)
    assert [status for _, status in seen] == [200, 200, 200, 200, 404, 405, 415, 403, 421, 404]
    status, headers, _ = api.request("GET", "/api/v1/sessions", auth=False)
    assert status == 401 and {k: headers.get(k) for k in SANDBOXED} == SANDBOXED
    # The UI's own files: their own policy, scripts from this origin only.
    for path in ("/", "/app.js"):
        status, headers, _ = api.request("GET", path, auth=False)
        assert status == 200 and headers["content-security-policy"].startswith("default-src 'self'")
        assert headers["x-content-type-options"] == "nosniff"


# -- a raw HTTP client ------------------------------------------------------------------------


def test_the_issue_requests_are_refused(serve_factory: Callable[..., ServeProcess]) -> None:
    """The two requests of issue 11 (then 201 and 200), without and with valid credentials."""
    server = serve_factory()
    api, token, port = server.api, server.ready["token"], server.api.port
    body = b'{"name":"pwn"}'
    for auth in (False, True):
        status, _, raw = api.request("POST", "/api/v1/sessions", body, auth=auth, headers={
            "Content-Type": "text/plain", "Origin": "http://evil.example"})
        assert status == 403 and set(json.loads(raw)) == {"error", "code"}
        status, _, raw = api.request("GET", "/api/v1/sessions", auth=auth,
                                     headers={"Host": f"evil.example:{port}"})
        assert status == 421 and set(json.loads(raw)) == {"error", "code"}
    # Each check holds on its own: same origin but text/plain is 415; no Origin, no token 401.
    assert api.request("POST", "/api/v1/sessions", body, headers={"Content-Type": "text/plain"})[0] == 415
    assert api.request("POST", "/api/v1/sessions", body, auth=False)[0] == 401
    assert session_ids(server) == []
    assert token not in server.stderr


def test_dns_rebinding_with_and_without_the_token(serve_factory: Callable[..., ServeProcess]) -> None:
    server = serve_factory()
    api, token, port = server.api, server.ready["token"], server.api.port
    sid = api.create("victim")["id"]
    credentials = {"none": {}, "bearer": dict(api.auth_headers)}
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}",
                 f"localhost.:{port}", f"[::2]:{port}"):
        for name, headers in credentials.items():
            for method, path, body in (
                    ("GET", "/", None), ("GET", "/api/v1/sessions", None),
                    ("GET", f"/api/v1/sessions/{sid}/stream?offset=0", None),
                    ("POST", f"/api/v1/sessions/{sid}/read", b"{}"),
                    ("POST", f"/api/v1/sessions/{sid}/write",
                     json.dumps({"payload": "echo rebound\r"}).encode()),
                    ("DELETE", f"/api/v1/sessions/{sid}", None),
                    ("GET", "/login?token=" + token, None)):
                status, response_headers, raw = api.request(
                    method, path, body, auth=False, headers={**headers, "Host": host})
                assert status == 421, (host, name, method, path, status)
                assert sid not in raw.decode() and "set-cookie" not in response_headers
    assert session_ids(server) == [sid]
    assert b"rebound" not in api.read_all(sid)


def test_methods_without_a_route_meet_the_same_checks(
        serve_factory: Callable[..., ServeProcess]) -> None:
    """HEAD, TRACE, WebDAV's verbs: no route takes them, yet a foreign Host still gets 421,
    and every refusal is {"error": ...} (the stdlib's own answer is a 501 HTML page, sent
    before the Host is looked at)."""
    server = serve_factory()
    api, port = server.api, server.api.port
    for method in ("HEAD", "TRACE", "PROPFIND", "BREW"):
        for path in ("/", "/api/v1/sessions", "/login"):
            status, headers, raw = api.request(method, path, headers={"Host": f"evil.example:{port}"})
            assert status == 421, (method, path, status)
            assert headers["content-type"] == "application/json"
            if method != "HEAD":  # a HEAD answer has the headers only
                assert set(json.loads(raw)) == {"error", "code"}, raw
        assert api.request(method, "/api/v1/sessions", auth=False)[0] == 401, method
        assert api.request(method, "/api/v1/sessions", headers={
            "Origin": "http://evil.example"})[0] == 403, method
        status, headers, raw = api.request(method, "/api/v1/sessions")
        assert status == 405 and set(headers["allow"].split(", ")) == {"GET", "POST"}, (
            method, status, headers)
    # The connection stays usable after a HEAD: its answer carried no body.
    conn = http.client.HTTPConnection(api.host, port, timeout=60)
    try:
        for method in ("HEAD", "GET"):
            conn.request(method, "/api/v1/sessions", headers=api.auth_headers)
            response = conn.getresponse()
            assert (method, response.status) in (("HEAD", 405), ("GET", 200))
            assert (response.read() == b"") == (method == "HEAD")
    finally:
        conn.close()
    # What the stdlib refuses before any check can run (a header line over its 64 KiB) is JSON
    # too. The line ends where the stdlib stops reading, so no unread byte resets the answer.
    with socket.create_connection((api.host, port), timeout=60) as raw_client:
        raw_client.sendall(b"GET / HTTP/1.1\r\n" + b"X-Long: ".ljust(65537, b"a"))
        answer = b""
        while chunk := raw_client.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ") and b"Content-Type: application/json" in head
    assert set(json.loads(body)) == {"error", "code"}, answer


def test_credentials_login_and_headers(serve_factory: Callable[..., ServeProcess]) -> None:
    server = serve_factory()
    api, token, base = server.api, server.ready["token"], server.ready["url"]
    sid = api.create("mine")["id"]
    sessions = "/api/v1/sessions"

    def status(path: str = sessions, **headers: str) -> int:
        return api.request("GET", path, auth=False, headers=headers)[0]

    # Wrong, missing, truncated and misplaced tokens.
    assert status() == 401
    for wrong in (token[:-1], token[:16], token + "x", token.swapcase(), "", base64.b64encode(
            token.encode()).decode()):
        assert status(Authorization=f"Bearer {wrong}") == 401, wrong
    assert status(Authorization=f"Basic {token}") == 401
    assert status(Authorization=token) == 401
    assert status(f"{sessions}?token={token}") == 401
    assert status(f"/api/v1/sessions/{sid}/stream?token={token}") == 401
    for cookie in (f"reploy-{api.port}={token}", f"token={token}"):  # a cookie is never one
        assert status(Cookie=cookie) == 401
    assert status(Authorization=f"Bearer {token}") == 200
    status_code, headers, raw = api.request("GET", sessions, auth=False)
    assert headers["www-authenticate"].startswith("Bearer") and "login_url" in json.loads(raw)["error"]
    # There is no login path that sets anything: the login URL's token is in its fragment,
    # which the UI alone reads. A token in a query logs nothing in and sets no cookie.
    for method in ("GET", "POST"):
        code, headers, _ = api.request(method, f"/login?token={token}", auth=False)
        assert code in (404, 405) and "set-cookie" not in headers and "location" not in headers
    # The stream takes the Bearer header like every call (the UI reads it with fetch).
    conn = http.client.HTTPConnection(api.host, api.port, timeout=30)
    conn.request("GET", f"/api/v1/sessions/{sid}/stream?offset=0", headers=api.auth_headers)
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
    assert response.getheader("Content-Security-Policy") == "default-src 'none'; sandbox"
    conn.close()
    # The UI's shell loads without credentials; its data does not.
    for path in ("/", "/index.html", "/app.js", "/openapi.json"):
        assert status(path) == 200, path
    assert status("/api/v1/openapi.json") == 401
    # Bodies must be JSON, once authenticated.
    body = b'{"name": "typed"}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                         "application/json; charset=latin-1"):
        code, _, raw = api.request("POST", sessions, body, headers={"Content-Type": content_type})
        assert code == 415 and "application/json" in json.loads(raw)["error"], content_type
    # The UI's own requests pass: same Origin, same-origin fetch metadata.
    code, _, _ = api.request("POST", f"/api/v1/sessions/{sid}/read", b"{}", headers={
        "Origin": base, "Sec-Fetch-Site": "same-origin", "Content-Type": "application/json; charset=UTF-8"})
    assert code == 200
    # No response ever carries a CORS header, a preflight least of all.
    for method, headers in (("OPTIONS", {"Origin": "http://127.0.0.1:1",
                                         "Access-Control-Request-Method": "POST"}),
                            ("OPTIONS", {"Origin": base, "Access-Control-Request-Method": "POST"}),
                            ("GET", {"Origin": "http://127.0.0.1:1"}), ("GET", {"Origin": base})):
        code, response_headers, _ = api.request(method, sessions, headers=headers)
        assert code in (403, 405, 200), (method, headers, code)
        assert not [h for h in response_headers if h.startswith("access-control-")]
    assert session_ids(server) == [sid]
    assert token not in server.stderr


def test_the_token_file(serve_factory: Callable[..., ServeProcess], tmp_path: Path) -> None:
    server = serve_factory()
    token_file = server.state_dir / "token"
    assert server.ready["token"] == token_file.read_text().strip()
    assert oct(token_file.stat().st_mode & 0o777) == "0o600"
    assert server.ready["token_file"] == str(token_file)
    assert server.ready["login_url"] == (f"{server.ready['url']}/#token="
                                         + urllib.parse.quote(server.ready["token"], safe=""))
    sid = server.api.create("kept")["id"]
    server.stop()
    again = serve_factory(state_dir=server.state_dir)
    assert again.ready["token"] == server.ready["token"]  # reused by later starts
    assert [s["id"] for s in again.api.call("GET", "/sessions")["sessions"]] == [sid]
    # --token-file elsewhere; the CLI reads it with --token-file too.
    elsewhere = tmp_path / "secret" / "serve.token"
    elsewhere.parent.mkdir()
    other = serve_factory("--token-file", str(elsewhere))
    assert other.ready["token"] == elsewhere.read_text().strip() != server.ready["token"]
    assert not (other.state_dir / "token").exists()
    base = [sys.executable, str(ROOT / "reploy.py"), "session", "list", "--server", other.ready["url"]]
    env = {k: v for k, v in os.environ.items() if k != "REPLOY_TOKEN"}
    listed = subprocess.run([*base, "--token-file", str(elsewhere)], capture_output=True,
                            timeout=60, env=env)
    assert listed.returncode == 0 and json.loads(listed.stdout) == {"sessions": []}
    refused = subprocess.run(base, capture_output=True, timeout=60, env=env)
    document = cli_error(refused)
    assert document["status"] == 401 and "REPLOY_TOKEN" in document["error"]
    # A token file others can read stops the start, without printing the token.
    elsewhere.chmod(0o644)
    proc = subprocess.run([sys.executable, str(ROOT / "reploy.py"), "serve", "--listen", "127.0.0.1:0",
                           "--state-dir", str(tmp_path / "state"), "--workload-dir", str(tmp_path),
                           "--token-file", str(elsewhere)], capture_output=True, timeout=60)
    assert proc.returncode == 1 and b"chmod 600" in proc.stderr
    assert other.ready["token"].encode() not in proc.stdout + proc.stderr


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_listen_addresses_and_their_host_names(serve_factory: Callable[..., ServeProcess]) -> None:
    # --allow-host: a reverse proxy's name, with the https Origin its pages send.
    proxied = serve_factory("--allow-host", "reploy.proxy.test")
    api = proxied.api
    assert api.request("GET", "/api/v1/sessions", headers={"Host": "reploy.proxy.test"})[0] == 200
    assert api.request("POST", "/api/v1/sessions/0123456789abcdef/read", b"{}", headers={
        "Host": "reploy.proxy.test", "Origin": "https://reploy.proxy.test"})[0] == 404  # routed
    assert api.request("POST", "/api/v1/sessions/0123456789abcdef/read", b"{}", headers={
        "Host": "reploy.proxy.test", "Origin": "https://other.proxy.test"})[0] == 403
    assert api.request("GET", "/api/v1/sessions", headers={"Host": "other.proxy.test"})[0] == 421
    # A wildcard listen (it needs --allow-remote) answers for the machine's own names too; this
    # test talks to it over loopback only.
    wide = serve_factory("--listen", "0.0.0.0:0", "--allow-remote")
    assert wide.ready["url"].startswith("http://127.0.0.1:")
    for host in (socket.gethostname(), "localhost", "127.0.0.1"):
        assert wide.api.request("GET", "/api/v1/sessions", headers={"Host": host})[0] == 200, host
    assert wide.api.request("GET", "/api/v1/sessions", headers={"Host": "evil.example"})[0] == 421
    assert wide.api.request("GET", "/api/v1/sessions", auth=False)[0] == 401  # still the token
    if not ipv6_loopback():
        pytest.skip("this kernel has no IPv6 loopback")
    six = serve_factory("--listen", "[::1]:0")
    assert six.ready["url"].startswith("http://[::1]:")
    port = six.api.port
    for host in (f"[::1]:{port}", f"localhost:{port}", "[::1]"):
        assert six.api.request("GET", "/api/v1/sessions", headers={"Host": host})[0] == 200, host
    assert six.api.request("GET", "/api/v1/sessions", headers={"Host": f"[::2]:{port}"})[0] == 421
