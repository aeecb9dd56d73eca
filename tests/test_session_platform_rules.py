"""The test-side checker of seed 002's API (tests/session_platform_rules.py) against answers
built from the compatibility reference's own examples, and against one violation per rule, so
a checker that accepts everything cannot pass. No server, no Docker."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any, Callable

import pytest

import session_platform_rules as spec
from session_platform_rules import SpecViolation

SHELL = {"id": "s-1", "name": "demo", "workloadType": "shell", "state": "active", "pod": "pod-1",
         "createdAt": "2025-01-02T03:04:05.123456789Z", "lastAccess": "2025-01-02T03:04:06Z"}
CLAUDE = {**SHELL, "workloadType": "claude-code", "model": "platform-default"}
SNAPSHOT = {**{k: v for k, v in SHELL.items() if k != "pod"}, "state": "snapshot",
            "checkpoint": {"ref": "ckpt", "sizeBytes": 10, "createdAt": "2025-01-02T03:04:07+02:00"}}
JSON = {"Content-Type": "application/json"}


def with_changes(document: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A copy with fields changed; a value of ... removes the field."""
    changed = copy.deepcopy(document)
    for key, value in changes.items():
        if value is ...:
            changed.pop(key, None)
        else:
            changed[key] = value
    return changed


@pytest.mark.parametrize("document", [
    SHELL, CLAUDE, SNAPSHOT, {**CLAUDE, "model": "~vendor/m:1"}, {**SHELL, "state": "idle"},
    {**SHELL, "deployment": "extra fields are allowed", "phase": "snapshotting"},
    {**SNAPSHOT, "checkpoint": {**SNAPSHOT["checkpoint"], "reclaimed": "pod-1"}},
])
def test_sessions_the_reference_allows(document: dict[str, Any]) -> None:
    assert spec.check_session(document) == document


@pytest.mark.parametrize(("document", "rule"), [
    (with_changes(SHELL, id=...), "id is required"),
    (with_changes(SHELL, workloadType=...), "workloadType is required"),
    (with_changes(SHELL, createdAt=...), "createdAt is required"),
    (with_changes(SHELL, workloadType="agent"), "outside"),
    (with_changes(SHELL, state="creating"), "outside"),
    (with_changes(SHELL, state="snapshotting"), "outside"),
    (with_changes(SHELL, createdAt=1700000000.5), "RFC 3339"),
    (with_changes(SHELL, lastAccess="2025-01-02 03:04:05"), "RFC 3339"),
    (with_changes(SHELL, model=None), "null"),
    (with_changes(SHELL, model="m"), "a shell Session has no model"),
    (with_changes(CLAUDE, model=...), "its model"),
    (with_changes(CLAUDE, model="bad model"), "its model"),
    (with_changes(SHELL, pod=...), "has its pod"),
    (with_changes(SHELL, checkpoint=SNAPSHOT["checkpoint"]), "only a snapshot"),
    (with_changes(SNAPSHOT, pod="pod-1"), "a snapshot has no pod"),
    (with_changes(SNAPSHOT, checkpoint=...), "checkpoint object"),
    (with_changes(SNAPSHOT, checkpoint={"ref": "c", "sizeBytes": "10", "createdAt": "2025-01-02T03:04:05Z"}),
     "sizeBytes"),
    (with_changes(SNAPSHOT, checkpoint={"ref": "c", "sizeBytes": 1, "createdAt": 5}), "RFC 3339"),
    (with_changes(SHELL, name=" demo"), "trimmed"),
    (with_changes(SHELL, name="demo\u3000"), "trimmed"),
    (with_changes(SHELL, idleAt=None), "null"),  # an extra field is never null either
    (with_changes(SHELL, idleBlockedBy=[None]), "null"),
])
def test_sessions_the_reference_refuses(document: dict[str, Any], rule: str) -> None:
    with pytest.raises(SpecViolation, match=rule):
        spec.check_session(document)


def test_lists_and_configs() -> None:
    assert spec.check_session_list({"sessions": [SHELL, SNAPSHOT]}) == [SHELL, SNAPSHOT]
    for bad in ({"sessions": [], "now": 1}, {}, {"sessions": {}}, {"sessions": [with_changes(SHELL, id=...)]}):
        with pytest.raises(SpecViolation):
            spec.check_session_list(bad)
    spec.check_runtime_config({"claudeCode": {"defaultModel": "platform-default", "models": []}})
    spec.check_runtime_config({"claudeCode": {"defaultModel": "~a/b", "models": ["a", "~c/d"]}})
    for bad in ({"claudeCode": {"defaultModel": "m", "models": []}, "workloads": []},
                {"claudeCode": {"defaultModel": "m", "models": [], "agent": 1}},
                {"claudeCode": {"defaultModel": "m"}},
                {"claudeCode": {"defaultModel": "m", "models": ["a", "a"]}},
                {"claudeCode": {"defaultModel": "m", "models": ["platform-default"]}},
                {"claudeCode": {"defaultModel": "m" * 129, "models": []}},
                {"claudeCode": {"defaultModel": " m", "models": []}}):
        with pytest.raises(SpecViolation):
            spec.check_runtime_config(bad)
    spec.check_health({"status": "ok"})
    with pytest.raises(SpecViolation):
        spec.check_health({"status": "ok", "now": 1})


def test_read_results_hold_the_length_rule() -> None:
    read = {"session": SHELL, "path": "active", "payload": "café", "nextOffset": 15}
    assert spec.check_read_result(read, 10) == read
    spec.check_read_result({**read, "payload": "", "nextOffset": 7}, 10)  # past the end
    spec.check_read_result({**read, "payload": "", "nextOffset": 10}, 10)  # at the end
    spec.check_read_result({**read, "path": "snapshot->restore->read", "payloadBase64": "extra"}, 10)
    for bad in ({**read, "nextOffset": 14},  # 4 characters, 5 bytes of UTF-8
                {**read, "payload": "x", "nextOffset": 7},  # text past the end
                {**read, "path": "idle->active->write"}, {**read, "nextOffset": "15"},
                {**read, "payload": base64.b64encode("café".encode()).decode()},  # base64 is not the text
                with_changes(read, session=...), with_changes(read, payload=...),
                {**read, "session": with_changes(SHELL, state="restoring")}):
        with pytest.raises(SpecViolation):
            spec.check_read_result(bad, 10)
    spec.check_write_result({"session": CLAUDE, "path": "idle->active->write"})
    for bad in ({"session": CLAUDE}, {"session": CLAUDE, "path": "active->read"},
                {"session": with_changes(CLAUDE, model=None), "path": "active"}):
        with pytest.raises(SpecViolation):
            spec.check_write_result(bad)


def test_json_and_error_answers() -> None:
    assert spec.check_json(200, {"content-type": "application/json; charset=utf-8"}, b'{"a": 1}') == {"a": 1}
    assert spec.check_error(404, JSON, b'{"error": "session not found"}', 404, "getSession")
    for status, headers, body, want, route in (
            (404, JSON, b'{"error": "x"}', 400, None),  # another status
            (400, {"Content-Type": "text/plain"}, b'{"error": "x"}', 400, None),
            (400, JSON, b'{"message": "x"}', 400, None), (400, JSON, b'{"error": ""}', 400, None),
            (400, JSON, b"[]", 400, None), (400, JSON, b"not json", 400, None),
            (422, JSON, b'{"error": "x"}', 422, "createSession"),  # the peer never uses 422 for input
            (503, JSON, b'{"error": "x"}', 503, "writeSession")):
        with pytest.raises(SpecViolation):
            spec.check_error(status, headers, body, want, route)
    assert spec.route_of("POST", "/sessions/anything/read") == "readSession"
    assert spec.route_of("GET", "/sessions/x/stream?offset=1") == "streamSessionOutput"
    with pytest.raises(SpecViolation):
        spec.route_of("POST", "/sessions/x/message")


def test_stream_headers() -> None:
    good = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache, no-transform",
            "X-Accel-Buffering": "no", "X-Content-Type-Options": "nosniff"}
    spec.check_stream_headers(good)
    for name, value in (("Cache-Control", "no-store"), ("X-Accel-Buffering", None),
                        ("Content-Type", "application/json"), ("X-Content-Type-Options", None)):
        headers = {k: v for k, v in good.items() if k != name}
        if value is not None:
            headers[name] = value
        with pytest.raises(SpecViolation):
            spec.check_stream_headers(headers)


def output(offset: int, payload: bytes) -> bytes:
    data = json.dumps({"offset": offset, "payloadBase64": base64.b64encode(payload).decode(),
                       "nextOffset": offset + len(payload)})
    return f"id: {offset + len(payload)}\nevent: output\ndata: {data}\n\n".encode()


def run(data: bytes, start: int = 0, workload_type: str = "shell") -> spec.StreamState:
    frames, rest = spec.parse_sse(data)
    assert rest == b""
    state = spec.StreamState(cursor=start)
    spec.check_stream(frames, state, workload_type)
    return state


def test_streams_the_reference_allows() -> None:
    state = run(b": connected\n\n" + output(0, b"ab") + b": keepalive\n\n" + output(2, "é".encode()))
    assert (bytes(state.received), state.cursor) == (b"ab" + "é".encode(), 4)
    state = run(b": connected\r\n\r\nid: 3\r\nevent: reset\r\ndata: {\"nextOffset\":3}\r\n\r\n" + output(3, b"x"),
                start=9)
    assert (state.resets, state.cursor) == ([3], 4)
    frames, rest = spec.parse_sse(b": connected\n\nid: 1\nevent: out")
    assert len(frames) == 1 and rest == b"id: 1\nevent: out"


@pytest.mark.parametrize(("data", "start", "workload_type"), [
    (output(0, b"a"), 0, "shell"),  # the first frame is not `: connected`
    (b"retry: 1000\n\n" + output(0, b"a"), 0, "shell"),
    (b": connected\n\n" + output(1, b"a"), 0, "shell"),  # not from the cursor
    (b": connected\n\n" + output(0, b"a").replace(b"id: 1", b"id: 2"), 0, "shell"),  # id is not nextOffset
    (b": connected\n\n" + output(0, b"abc").replace(b'"nextOffset": 3', b'"nextOffset": 2'), 0, "shell"),
    (b": connected\n\n" + output(0, b"x" * (64 * 1024 + 1)), 0, "shell"),  # a chunk over 64 KiB
    (b": connected\n\n" + output(0, "é".encode()[:1]), 0, "claude-code"),  # splits a code point
    (b": connected\n\nid: 5\nevent: reset\ndata: {\"nextOffset\":5}\n\n", 2, "shell"),  # not past the end
    (b": connected\n\nid: 4\nevent: reset\ndata: {\"nextOffset\":5}\n\n", 9, "shell"),
    (b": connected\n\nid: 3\n: keepalive\n\n", 0, "shell"),  # a heartbeat with a cursor
    (b": connected\n\nevent: other\nid: 1\ndata: {}\n\n", 0, "shell"),
    (b": connected\n\nbogus: 1\n\n", 0, "shell"),
])
def test_streams_the_reference_refuses(data: bytes, start: int, workload_type: str) -> None:
    with pytest.raises(SpecViolation):
        run(data, start, workload_type)


def test_each_route_has_the_statuses_of_section_3() -> None:
    check: Callable[[str], set[int]] = spec.ERROR_STATUSES.__getitem__
    assert set(spec.ERROR_STATUSES) == set(spec.ROUTES.values())
    assert check("streamSessionOutput") == {400, 404, 422, 500}
    assert all(422 not in check(route) for route in spec.ERROR_STATUSES if route != "streamSessionOutput")
    assert {route for route in spec.ERROR_STATUSES if 409 in check(route)} == {
        "deleteSession", "switchSession", "snapshotSession"}
    assert {route for route in spec.ERROR_STATUSES if 429 in check(route) or 507 in check(route)} == {
        "writeSession"}
