"""Seed 002's API, checked against a real `reploy serve` with real sessions of both workload
types (the fake Claude CLI in tests/agent_fixtures stands in for the model), by the checker in
tests/session_platform_rules.py, which is written from the compatibility reference
(../shared/compat/session-platform-api.md) and not from reploy_serve.py.

Every request is what session-platform's own SPA sends through the issue's proxy: the SPA puts
`Content-Type: application/json` on every fetch (GET and DELETE too) and reads the stream like
an EventSource (no body, no Content-Type); the proxy adds the bearer token and a same-origin
`Origin`. Nothing else of Reploy's is used to judge an answer, except where a test says it
checks a rule of Reploy's own (the substitution of invalid shell bytes, README).

The happy path, then every failure the reference names for each route: 400 (bodies, values,
cursors), 404 (every {id} route), 409 (another lifecycle operation holds the session), 413 (the
8 MiB body, the 1 MiB prompt, before any restore), 422 (a stream of a snapshot) and 429 (a
full prompt queue).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse
from typing import Any, Callable, Iterator, Optional

import pytest

import session_platform_rules as spec
from serve_harness import (  # noqa: F401  (fixtures)
    DEADLINE_S, ServeProcess, in_thread, managed_workload, serve_factory, wait_until,
)

pytestmark = pytest.mark.docker
MISSING_IDS = ("0123456789abcdef", "no-such-session")


class SpaClient:
    """session-platform's SPA behind the issue's proxy, talking to one serve."""

    def __init__(self, server: ServeProcess) -> None:
        parsed = urllib.parse.urlsplit(server.ready["url"])
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.proxy_headers = {"Authorization": f"Bearer {server.ready['token']}",
                              "Origin": server.ready["url"]}

    def request(self, method: str, path: str, body: Optional[bytes] = None,
                headers: Optional[dict[str, str]] = None) -> tuple[int, dict[str, str], bytes]:
        """One fetch of /api/v1`path`: (status, headers, body)."""
        sent = {**self.proxy_headers, "Content-Type": "application/json", **(headers or {})}
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        try:
            conn.request(method, "/api/v1" + path, body=body, headers=sent)
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()

    def call(self, method: str, path: str, document: Any = None, want: int = 200) -> dict[str, Any]:
        """A JSON call answering `want`: its document, checked as JSON."""
        body = None if document is None else json.dumps(document).encode()
        status, headers, raw = self.request(method, path, body)
        assert status == want, f"{method} {path}: {status} {raw[:500]!r}"
        return spec.check_json(status, headers, raw)

    def refused(self, method: str, path: str, body: Optional[bytes], want: int,
                headers: Optional[dict[str, str]] = None) -> str:
        """An Error answer of status `want`, which the reference gives the route."""
        status, answer_headers, raw = self.request(method, path, body, headers)
        return spec.check_error(status, answer_headers, raw, want, spec.route_of(method, path))

    def create(self, **fields: Any) -> dict[str, Any]:
        return spec.check_session(self.call("POST", "/sessions", fields, 201))

    def get(self, sid: str) -> dict[str, Any]:
        return spec.check_session(self.call("GET", f"/sessions/{sid}"))

    def listed(self) -> list[dict[str, Any]]:
        return spec.check_session_list(self.call("GET", "/sessions"))

    def read(self, sid: str, offset: Optional[int] = None) -> dict[str, Any]:
        body = {} if offset is None else {"offset": offset}
        return spec.check_read_result(self.call("POST", f"/sessions/{sid}/read", body), offset or 0)

    def write(self, sid: str, payload: str) -> dict[str, Any]:
        return spec.check_write_result(self.call("POST", f"/sessions/{sid}/write", {"payload": payload}))

    def read_until(self, sid: str, needle: str) -> dict[str, Any]:
        return wait_until(lambda: (lambda r: r if needle in r["payload"] else None)(self.read(sid, 0)),
                          f"{needle!r} in the output of {sid}")

    def stream(self, sid: str, workload_type: str, offset: Optional[int] = None,
               last_event_id: Optional[str] = None) -> "Stream":
        return Stream(self, sid, workload_type, offset, last_event_id)


class Stream:
    """One stream read like the SPA's EventSource (no body, no Content-Type), every frame
    checked as it comes (spec.check_stream)."""

    def __init__(self, client: SpaClient, sid: str, workload_type: str, offset: Optional[int],
                 last_event_id: Optional[str]) -> None:
        self.workload_type = workload_type
        self.conn = http.client.HTTPConnection(client.host, client.port, timeout=DEADLINE_S)
        headers = dict(client.proxy_headers)
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        query = "" if offset is None else f"?offset={offset}"
        self.conn.request("GET", f"/api/v1/sessions/{sid}/stream{query}", headers=headers)
        self.response = self.conn.getresponse()
        self.status, self.headers = self.response.status, dict(self.response.getheaders())
        start = int(last_event_id) if last_event_id else (offset or 0)
        self.state = spec.StreamState(cursor=start)
        self.frames: list[spec.Frame] = []
        self.pending = b""
        self.ended = False

    def until(self, condition: Callable[["Stream"], bool], what: str,
              timeout_s: float = DEADLINE_S) -> "Stream":
        """Reads and checks frames until condition(self) holds; the stream ending first fails."""
        deadline = time.monotonic() + timeout_s
        while not condition(self):
            assert not self.ended, f"the stream ended before {what}"
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {what}"
            self.conn.sock.settimeout(left)
            chunk = self.response.read1(65536)
            if not chunk:
                self.ended = True
                continue
            frames, self.pending = spec.parse_sse(self.pending + chunk)
            spec.check_stream(frames, self.state, self.workload_type)
            self.frames += frames
        return self

    def events(self, kind: str) -> list[spec.Frame]:
        return [frame for frame in self.frames if frame.event == kind]

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def platform(serve_factory: Callable[..., ServeProcess]) -> Iterator[tuple[ServeProcess, SpaClient]]:
    server = serve_factory("--sse-keepalive", "300ms", "--default-model", "m-default",
                           "--models", '["m-default", "~vendor/m-two"]')
    yield server, SpaClient(server)


def shell_ready(client: SpaClient, sid: str) -> dict[str, Any]:
    return client.read_until(sid, "$ ")


# -- the happy path -------------------------------------------------------------------------------


def test_health_config_and_list(platform: tuple[ServeProcess, SpaClient], docker_engine: Any) -> None:
    _, client = platform
    spec.check_health(client.call("GET", "/healthz"))
    status, headers, raw = client.request("GET", "/config")
    config = spec.check_json(status, headers, raw)
    spec.check_runtime_config(config)
    assert {k.lower(): v for k, v in headers.items()}["cache-control"] == "no-store"
    assert config == {"claudeCode": {"defaultModel": "m-default", "models": ["m-default", "~vendor/m-two"]}}
    assert client.call("GET", "/sessions") == {"sessions": []}
    # A GET or DELETE with the SPA's Content-Type and an explicit empty body works too.
    status, headers, raw = client.request("GET", "/sessions", headers={"Content-Length": "0"})
    assert status == 200 and spec.check_session_list(spec.check_json(status, headers, raw)) == []


def test_create_get_list_and_delete_as_the_reference_has_them(
        platform: tuple[ServeProcess, SpaClient], docker_engine: Any) -> None:
    _, client = platform
    shell = client.create(name="  spa shell \t")
    assert (shell["name"], shell["workloadType"], shell["state"]) == ("spa shell", "shell", "active")
    default = client.create(name="agent", workloadType="claude-code")
    assert (default["workloadType"], default["model"]) == ("claude-code", "platform-default")
    pinned = client.create(name="pinned", workloadType="claude-code", model="~vendor/m-two")
    explicit = client.create(name="explicit", workloadType="claude-code", model="platform-default")
    unlisted = client.create(name="unlisted", workloadType="claude-code", model="not-in-the-catalog")
    assert (pinned["model"], explicit["model"], unlisted["model"]) == (
        "~vendor/m-two", "platform-default", "not-in-the-catalog")
    # get and list are passive: asked twice, nothing moved.
    assert client.get(shell["id"]) == client.get(shell["id"])
    listed = {session["id"]: session for session in client.listed()}
    assert set(listed) == {s["id"] for s in (shell, default, pinned, explicit, unlisted)}
    assert listed[shell["id"]]["lastAccess"] == client.get(shell["id"])["lastAccess"]
    # Delete: 204 and no body, in any state; then 404 everywhere.
    for session in (default, pinned, explicit, unlisted):
        status, _, raw = client.request("DELETE", f"/sessions/{session['id']}")
        assert (status, raw) == (204, b"")
    assert [s["id"] for s in client.listed()] == [shell["id"]]
    assert client.refused("GET", f"/sessions/{default['id']}", None, 404)
    assert client.refused("DELETE", f"/sessions/{default['id']}", None, 404)


def test_read_write_and_the_stream_of_a_shell(platform: tuple[ServeProcess, SpaClient],
                                              docker_engine: Any) -> None:
    _, client = platform
    sid = client.create(name="shell")["id"]
    shell_ready(client, sid)
    written = client.write(sid, "echo conf-$((6*7))\r")
    assert written["path"] == "active" and written["session"]["id"] == sid
    history = client.read_until(sid, "conf-42\r\n")
    assert history["path"] == "active" and history["session"]["state"] == "active"
    # No body, or white space, is {}: offset 0. An offset at or past the end: "" and the length.
    for body in (None, b"", b"  \n", b"{}"):
        status, headers, raw = client.request("POST", f"/sessions/{sid}/read", body)
        again = spec.check_read_result(spec.check_json(status, headers, raw), 0)
        assert again["payload"].startswith(history["payload"])
    length = client.read(sid, 0)["nextOffset"]
    for offset in (length, length + 1000, spec.INT64_MAX):
        page = client.read(sid, offset)
        assert (page["payload"], page["nextOffset"]) == ("", length)
    tail = client.read(sid, 5)
    assert tail["payload"] == client.read(sid, 0)["payload"][5:]

    # The stream: headers, `: connected`, Last-Event-ID over ?offset=, then live output.
    stream = client.stream(sid, "shell", offset=0, last_event_id="3")
    try:
        assert stream.status == 200
        spec.check_stream_headers(stream.headers)
        stream.until(lambda s: s.state.cursor >= length, "the history")
        assert stream.events("output")[0].data and json.loads(stream.events("output")[0].data[0])["offset"] == 3
        assert stream.state.received.decode()[:length - 3] == client.read(sid, 3)["payload"][:length - 3]
        client.write(sid, "echo live-$((2+3))\r")
        stream.until(lambda s: b"live-5\r\n" in s.state.received, "live output")
        stream.until(lambda s: any(f.comments == ["keepalive"] for f in s.frames), "a heartbeat")
    finally:
        stream.close()
    # An empty Last-Event-ID leaves ?offset= in charge.
    stream = client.stream(sid, "shell", offset=4, last_event_id="")
    try:
        stream.until(lambda s: bool(s.events("output")), "output from 4")
        assert json.loads(stream.events("output")[0].data[0])["offset"] == 4
    finally:
        stream.close()


def test_a_reset_keeps_the_stream_open_from_the_retained_length(
        platform: tuple[ServeProcess, SpaClient], docker_engine: Any) -> None:
    _, client = platform
    sid = client.create(name="reset")["id"]
    shell_ready(client, sid)
    length = client.read(sid, 0)["nextOffset"]
    stream = client.stream(sid, "shell", offset=length + 100)
    try:
        stream.until(lambda s: bool(s.state.resets), "the reset")
        [reset] = stream.events("reset")
        assert reset.id == str(length) and json.loads(reset.data[0]) == {"nextOffset": length}
        client.write(sid, "echo after-reset\r")
        stream.until(lambda s: b"after-reset" in s.state.received, "output after the reset")
        assert json.loads(stream.events("output")[0].data[0])["offset"] == length
    finally:
        stream.close()


def test_read_write_and_the_stream_of_claude_code(platform: tuple[ServeProcess, SpaClient],
                                                  docker_engine: Any) -> None:
    _, client = platform
    sid = client.create(name="agent", workloadType="claude-code")["id"]
    written = client.write(sid, "say héllo €uro 😀 done")
    assert written["path"] == "active"
    history = client.read_until(sid, "done")
    assert "héllo €uro 😀 done" in history["payload"]
    end = history["nextOffset"]
    stream = client.stream(sid, "claude-code", offset=0)
    try:
        stream.until(lambda s: s.state.cursor >= end, "the history")
        assert stream.state.received[:end].decode() == history["payload"]
        client.write(sid, "say ünïcödé streamed 🎉")
        stream.until(lambda s: "🎉".encode() in s.state.received, "the live answer")
    finally:
        stream.close()
    # Reconnecting from a cursor the client holds (the byte offset of "€"), by Last-Event-ID:
    # the stream goes on from there, every event still between code points.
    cut = len(history["payload"][:history["payload"].index("€")].encode())
    later = client.stream(sid, "claude-code", offset=0, last_event_id=str(cut))
    try:
        later.until(lambda s: s.state.cursor >= end, "the history from a cursor")
        assert later.state.received[:end - cut].decode() == history["payload"][history["payload"].index("€"):]
    finally:
        later.close()


def test_switch_snapshot_and_restore(platform: tuple[ServeProcess, SpaClient], docker_engine: Any) -> None:
    _, client = platform
    sid = client.create(name="lifecycle")["id"]
    shell_ready(client, sid)
    client.write(sid, "echo kept-$((3*3))\r")
    before = client.read_until(sid, "kept-9\r\n")["payload"]
    # switch of an active session: no change, lastAccess included.
    current = client.get(sid)
    switched = spec.check_session(client.call("POST", f"/sessions/{sid}/switch", {}))
    assert switched["state"] == "active" and switched["lastAccess"] == current["lastAccess"]
    # An open stream ends once the session's container is reclaimed.
    stream = client.stream(sid, "shell", offset=0)
    snapshot = spec.check_session(client.call("POST", f"/sessions/{sid}/snapshot", {}))
    try:
        stream.until(lambda s: s.ended, "the stream to end with the container")
    finally:
        stream.close()
    assert snapshot["state"] == "snapshot" and "pod" not in snapshot and snapshot["checkpoint"]["sizeBytes"] > 0
    # Again: idempotent, the same record. No body is {} too.
    status, headers, raw = client.request("POST", f"/sessions/{sid}/snapshot", None)
    assert spec.check_session(spec.check_json(status, headers, raw)) == snapshot
    assert client.get(sid) == snapshot
    client.refused("GET", f"/sessions/{sid}/stream", None, 422)
    # read restores; the history survives.
    restored = client.read(sid, 0)
    assert restored["path"] == "snapshot->restore->read" and restored["payload"].startswith(before)
    assert restored["session"]["state"] == "active" and "checkpoint" not in client.get(sid)
    # write of a snapshot restores too.
    client.call("POST", f"/sessions/{sid}/snapshot", {})
    written = client.write(sid, "echo again-$((4*4))\r")
    assert written["path"] == "snapshot->restore->write"
    assert client.read_until(sid, "again-16\r\n")["payload"].startswith(before)
    # switch of a snapshot restores into a new container.
    old_pod = client.get(sid)["pod"]
    client.call("POST", f"/sessions/{sid}/snapshot", {})
    back = spec.check_session(client.call("POST", f"/sessions/{sid}/switch", {}))
    assert back["state"] == "active" and back["pod"] != old_pod
    assert client.read(sid, 0)["payload"].startswith(before)


def test_idle_sessions_are_promoted_by_each_access(serve_factory: Callable[..., ServeProcess],
                                                  docker_engine: Any) -> None:
    server = serve_factory("--idle-after", "1s", "--snapshot-after", "1h")
    client = SpaClient(server)
    sid = client.create(name="idler")["id"]

    def idle() -> dict[str, Any]:
        return wait_until(lambda: (lambda s: s if s["state"] == "idle" else None)(client.get(sid)),
                          "the reaper to idle the session")

    shell_ready(client, sid)
    quiet = idle()
    # The stream is passive: an idle session streams and stays idle, lastAccess untouched.
    stream = client.stream(sid, "shell", offset=0)
    try:
        assert stream.status == 200
        stream.until(lambda s: s.state.cursor > 0, "the history of an idle session")
    finally:
        stream.close()
    assert client.get(sid) == quiet
    read = client.read(sid, 0)
    assert read["path"] == "idle->active->read" and read["session"]["state"] == "active"
    idle()
    written = client.write(sid, "")  # an empty payload is the access alone
    assert written["path"] == "idle->active->write" and written["session"]["state"] == "active"
    quiet = idle()
    switched = spec.check_session(client.call("POST", f"/sessions/{sid}/switch", {}))
    assert switched["state"] == "active"
    assert spec_time(switched["lastAccess"]) > spec_time(quiet["lastAccess"])


def spec_time(stamp: str) -> float:
    import datetime

    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


# -- payload text: its UTF-8 length is the cursor's advance, whatever the shell prints ---------------


def test_shell_output_that_is_not_utf8_keeps_the_length_rule(
        platform: tuple[ServeProcess, SpaClient], docker_engine: Any) -> None:
    """Invalid bytes, code points split across the agent's read pages (512 KiB each) and a read
    that ends inside a code point: the reference's rule holds for every read (the checker),
    and Reploy's own rule (README) decides the text: `?` for each invalid byte."""
    _, client = platform
    sid = client.create(name="bytes")["id"]
    shell_ready(client, sid)
    client.write(sid, "printf 'X\\377Y\\300\\200Z\\355\\240\\200W\\n'\r")
    assert "X?Y??Z???W\r\n" in client.read_until(sid, "W\r\n")["payload"]
    start = client.read(sid, 0)["nextOffset"]
    client.write(sid, "python3 -c \"import sys; sys.stdout.write('€' * 300000 + 'E' + 'ND')\"\r")
    page = client.read_until(sid, "€END")
    assert "€" * 300000 + "END" in page["payload"]
    run = len(page["payload"][:page["payload"].index("€" * 300000)].encode())  # the run's byte offset
    inside = client.read(sid, run + 1)  # a read that starts inside a code point
    assert inside["payload"].startswith("??" + "€" * 299999 + "END")
    assert client.read(sid, start)["payload"].count("€") == 300000 + 1  # the run and the echoed command

    # The output ends inside a code point: the read stops before it, the next one has it whole.
    stream = client.stream(sid, "shell", offset=client.read(sid, 0)["nextOffset"])
    try:
        client.write(sid, "stty -echo; printf 'A\\303'; read x; printf '\\251B\\n'; stty echo\r")
        stream.until(lambda s: s.state.received.endswith(b"A\xc3"), "the first byte of é")
        held = client.read(sid, 0)
        assert held["payload"].endswith("A") and held["nextOffset"] == stream.state.cursor - 1
        client.write(sid, "\r")
        stream.until(lambda s: b"B\r\n" in s.state.received, "the rest of é")
        rest = client.read(sid, held["nextOffset"])
        assert rest["payload"].startswith("éB\r\n")
    finally:
        stream.close()


# -- failure paths ------------------------------------------------------------------------------------


BAD_CREATES = [
    b"", b"   ", b"{", b"[]", b"null", b'"name"', b'{"name": "a"} {}', b'{"name": "a"}x',
    b'{"name": "a", "unknown": 1}', b'{"name": "a", "workload": "shell"}', b'{"name": "a", "deployment2": "x"}',
    b'{"name": 5}', b'{"name": null}', b'{"name": ""}', b'{"name": " \\t "}', b"{}",
    b'{"name": "a", "workloadType": "vm"}', b'{"name": "a", "workloadType": ""}', b'{"name": "a", "workloadType": null}',
    b'{"name": "a", "workloadType": 1}', b'{"name": "a", "workloadType": "agent"}',
    b'{"name": "a", "model": "m"}', b'{"name": "a", "workloadType": "shell", "model": "m"}',
    b'{"name": "a", "workloadType": "claude-code", "model": ""}',
    b'{"name": "a", "workloadType": "claude-code", "model": " m "}',
    b'{"name": "a", "workloadType": "claude-code", "model": "bad model"}',
    b'{"name": "a", "workloadType": "claude-code", "model": null}',
    b'{"name": "a", "workloadType": "claude-code", "model": "' + b"m" * 129 + b'"}',
]
BAD_READS = [b"{", b"[]", b'{"offset": -1}', b'{"offset": 1.5}', b'{"offset": "1"}', b'{"offset": null}',
             b'{"offset": 9223372036854775808}', b'{"offset": 0, "unknown": 1}', b'{"offset": 0} {}',
             b'{"offset": true}']
BAD_WRITES = [b"{", b"[]", b'{"payload": 1}', b'{"payload": null}', b'{"payload": "x"} {}',
              b'{"payload": "x", "unknown": 1}', b'{"data": "x"}']
BAD_EMPTY_BODIES = [b"{", b"[]", b'{"a": 1}', b'{"a": null}', b"{} {}", b"null"]
BAD_CURSORS = [("?offset=-1", None), ("?offset=x", None), ("?offset=1.5", None),
               ("?offset=9223372036854775808", None), ("", "-5"), ("", "x"), ("?offset=0", "1e3")]


def test_every_input_error_is_400(platform: tuple[ServeProcess, SpaClient], docker_engine: Any) -> None:
    _, client = platform
    sid = client.create(name="target")["id"]
    for body in BAD_CREATES:
        client.refused("POST", "/sessions", body, 400)
    assert [s["id"] for s in client.listed()] == [sid]  # nothing was provisioned
    for body in BAD_READS:
        client.refused("POST", f"/sessions/{sid}/read", body, 400)
    for body in BAD_WRITES:
        client.refused("POST", f"/sessions/{sid}/write", body, 400)
    for route in ("switch", "snapshot"):
        for body in BAD_EMPTY_BODIES:
            client.refused("POST", f"/sessions/{sid}/{route}", body, 400)
    # The cursor is checked before the session is looked up: 400 even for an unknown id.
    for target in (sid, MISSING_IDS[0]):
        for query, last_event_id in BAD_CURSORS:
            client.refused("GET", f"/sessions/{target}/stream{query}", None, 400,
                           headers={"Last-Event-ID": last_event_id} if last_event_id is not None else {})
    assert client.get(sid)["state"] == "active"


def test_every_id_route_answers_404_for_an_unknown_session(
        platform: tuple[ServeProcess, SpaClient], docker_engine: Any) -> None:
    _, client = platform
    for sid in MISSING_IDS:
        for method, route, body in (("GET", "", None), ("DELETE", "", None), ("GET", "/stream", None),
                                    ("POST", "/read", b'{"offset": 0}'), ("POST", "/write", b'{"payload": "x"}'),
                                    ("POST", "/switch", b"{}"), ("POST", "/snapshot", b"{}")):
            client.refused(method, f"/sessions/{sid}{route}", body, 404)


def test_bodies_over_8_mib_are_413(platform: tuple[ServeProcess, SpaClient], docker_engine: Any) -> None:
    """Declared by Content-Length and refused before the body is read."""
    server, client = platform
    sid = client.create(name="big")["id"]
    for path in ("/sessions", f"/sessions/{sid}/read", f"/sessions/{sid}/write",
                 f"/sessions/{sid}/switch", f"/sessions/{sid}/snapshot"):
        conn = http.client.HTTPConnection(client.host, client.port, timeout=60)
        try:
            conn.putrequest("POST", "/api/v1" + path)
            for name, value in {**client.proxy_headers, "Content-Type": "application/json",
                                "Content-Length": str(spec.MAX_BODY_BYTES + 1)}.items():
                conn.putheader(name, value)
            conn.endheaders()
            response = conn.getresponse()
            spec.check_error(response.status, dict(response.getheaders()), response.read(), 413,
                             spec.route_of("POST", path))
        finally:
            conn.close()
    # A body of exactly 8 MiB is taken: a shell write of it, typed into cat.
    shell_ready(client, sid)
    client.write(sid, "stty -echo; cat > /dev/null; stty echo; echo sun$((0))k\r")
    lines = (spec.MAX_BODY_BYTES - 200) // 1025  # each line's JSON: 1023 bytes and "\\n"
    payload = ("z" * 1023 + "\n") * lines
    fill = spec.MAX_BODY_BYTES - len(json.dumps({"payload": payload + "\n\x04"}).encode())
    body = json.dumps({"payload": payload + "z" * fill + "\n\x04"}).encode()
    assert len(body) == spec.MAX_BODY_BYTES
    status, headers, raw = client.request("POST", f"/sessions/{sid}/write", body)
    assert status == 200, raw[:300]
    spec.check_write_result(spec.check_json(status, headers, raw))
    client.read_until(sid, "sun0k")


def test_a_claude_code_prompt_over_1_mib_is_413_before_any_restore(
        platform: tuple[ServeProcess, SpaClient], docker_engine: Any) -> None:
    _, client = platform
    sid = client.create(name="prompt", workloadType="claude-code")["id"]
    snapshot = spec.check_session(client.call("POST", f"/sessions/{sid}/snapshot", {}))
    too_long = json.dumps({"payload": "é" * (spec.MAX_PROMPT_BYTES // 2) + "x"}).encode()
    client.refused("POST", f"/sessions/{sid}/write", too_long, 413)
    assert client.get(sid) == snapshot  # still a snapshot: nothing was restored
    # A stream of a snapshot: 422.
    client.refused("GET", f"/sessions/{sid}/stream", None, 422)
    # Exactly 1 MiB is one prompt.
    written = client.write(sid, "say " + "é" * ((spec.MAX_PROMPT_BYTES - 4) // 2))
    assert written["path"] == "snapshot->restore->write"


def test_a_full_prompt_queue_is_429(platform: tuple[ServeProcess, SpaClient], docker_engine: Any) -> None:
    _, client = platform
    sid = client.create(name="queue", workloadType="claude-code")["id"]
    client.write(sid, "hang")
    client.read_until(sid, "working")
    for _ in range(64):
        client.write(sid, "say later")
    client.refused("POST", f"/sessions/{sid}/write", b'{"payload": "one too many"}', 429)
    client.call("POST", f"/sessions/{sid}/interrupt", {})  # Reploy's route: the run ends


def test_another_lifecycle_operation_holding_the_session_is_409(
        platform: tuple[ServeProcess, SpaClient], docker_engine: Any) -> None:
    """Another control-plane process holds the session's lease (as a long snapshot does):
    delete, switch and snapshot answer 409 once they waited for it, and change nothing;
    get stays passive and answers at once."""
    import reploy_serve  # to act as that other process on the real store, not to judge
    import reploy_watchdog

    server, client = platform
    sid = client.create(name="held")["id"]
    store = reploy_serve.SessionStore(server.state_dir / "sessions.db")
    owner = f"{socket.gethostname()}/{reploy_watchdog.process_identity()}/conformance"
    assert store.acquire(sid, owner, time.time())
    try:
        calls = [in_thread(lambda m=method, r=route, b=body: client.request(m, f"/sessions/{sid}{r}", b))
                 for method, route, body in (("DELETE", "", None), ("POST", "/switch", b"{}"),
                                             ("POST", "/snapshot", b"{}"))]
        assert client.get(sid)["state"] == "active"
        for thread, box in calls:
            thread.join(timeout=120)
            status, headers, raw = box[0]
            spec.check_error(status, headers, raw, 409)  # each of the three routes may answer it
    finally:
        store.release(sid, owner)
        store.close()
    assert client.get(sid)["state"] == "active"
    status, _, raw = client.request("DELETE", f"/sessions/{sid}")
    assert (status, raw) == (204, b"")

