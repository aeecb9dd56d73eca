"""A strict client of seed 002's control-plane API, written for the tests from the compatibility
reference alone (../shared/compat/session-platform-api.md: session-platform's OpenAPI 0.3.0,
its handlers and its SPA), not from reploy_serve.py, which nothing here imports: a shared
misreading cannot make both sides agree on a wrong answer.

  check_json(status, headers, body)         a JSON answer: Content-Type, one object -> dict
  check_error(status, headers, body, want)  an Error answer of status `want`
  check_health(doc), check_runtime_config(doc), check_session_list(doc)
  check_session(doc)                        a Session: required fields, types, enums, the
                                            model/pod/checkpoint rules, no null anywhere
  check_read_result(doc, offset)            a ReadResult, and the text payload's length rule
  check_write_result(doc)                   a WriteResult
  check_stream_headers(headers)             the stream's response headers
  parse_sse(data) / check_stream(frames, start, workload_type)
                                            SSE framing: `: connected` first, output and reset
                                            events, cursors, base64 lengths, code points
  ERROR_STATUSES                            which failure statuses each route may answer

Each raises SpecViolation naming the rule. Stdlib only. Reploy's additions are allowed where
the reference allows extras (a Session, a ReadResult) and nowhere else.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

WORKLOAD_TYPES = ("shell", "claude-code")
STATES = ("active", "idle", "snapshot")
PLATFORM_DEFAULT = "platform-default"
MODEL = re.compile(r"~[A-Za-z0-9][A-Za-z0-9._:/-]{0,126}|[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
#: RFC 3339 date-time (format: date-time), the fraction optional and of any length.
DATE_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})")
#: What Go's strings.TrimSpace (the peer's trim of a name) removes: Unicode White_Space.
WHITE_SPACE = ("\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
               "\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
SESSION_REQUIRED = ("id", "name", "state", "workloadType", "createdAt", "lastAccess")
READ_PATHS = ("active", "idle->active->read", "snapshot->restore->read")
WRITE_PATHS = ("active", "idle->active->write", "snapshot->restore->write")
MAX_CHUNK_BYTES = 64 * 1024
MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_PROMPT_BYTES = 1024 * 1024
INT64_MAX = 2**63 - 1
#: Section 3 of the reference: the failure statuses each route may answer (500: "any other
#: failure", not in the spec but what the peer answers). The statuses a server adds before any
#: route (Reploy's 401, 403, 415, 421) are not the spec's and are not expected here.
ERROR_STATUSES = {
    "health": {500}, "getRuntimeConfig": {500}, "listSessions": {500},
    "createSession": {400, 413, 500}, "getSession": {404, 500},
    "deleteSession": {404, 409, 500}, "streamSessionOutput": {400, 404, 422, 500},
    "readSession": {400, 404, 413, 500}, "writeSession": {400, 404, 413, 429, 507, 500},
    "switchSession": {400, 404, 409, 413, 500}, "snapshotSession": {400, 404, 409, 413, 503, 500},
}


#: Section 1: each route (method, path below /api/v1 with {id}) and its operationId.
ROUTES = {("GET", "/healthz"): "health", ("GET", "/config"): "getRuntimeConfig",
          ("GET", "/sessions"): "listSessions", ("POST", "/sessions"): "createSession",
          ("GET", "/sessions/{id}"): "getSession", ("DELETE", "/sessions/{id}"): "deleteSession",
          ("GET", "/sessions/{id}/stream"): "streamSessionOutput",
          ("POST", "/sessions/{id}/read"): "readSession", ("POST", "/sessions/{id}/write"): "writeSession",
          ("POST", "/sessions/{id}/switch"): "switchSession",
          ("POST", "/sessions/{id}/snapshot"): "snapshotSession"}


def route_of(method: str, path: str) -> str:
    """The operationId of a request's path below /api/v1 (any id; a query ignored)."""
    parts = path.partition("?")[0].split("/")
    if len(parts) > 2 and parts[1] == "sessions":
        parts[2] = "{id}"
    operation = ROUTES.get((method, "/".join(parts)), "")
    _require(operation != "", f"{method} {path} is not one of the reference's routes")
    return operation


class SpecViolation(ValueError):
    """An answer a strict client of seed 002's API rejects."""


def _require(condition: bool, rule: str) -> None:
    if not condition:
        raise SpecViolation(rule)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _no_null(value: Any, where: str) -> None:
    """The peer rejects null on input and leaves empty fields out of its output."""
    _require(value is not None, f"{where}: null")
    if isinstance(value, dict):
        for key, item in value.items():
            _no_null(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _no_null(item, f"{where}[{index}]")


def _header(headers: dict[str, str], name: str) -> Optional[str]:
    return {key.lower(): value for key, value in headers.items()}.get(name.lower())


# -- JSON answers ---------------------------------------------------------------------------------


def check_json(status: int, headers: dict[str, str], body: bytes) -> dict[str, Any]:
    """JSON out: Content-Type application/json and exactly one JSON object."""
    media = (_header(headers, "content-type") or "").partition(";")[0].strip().lower()
    _require(media == "application/json", f"{status}: Content-Type {media!r}, not application/json")
    try:
        document = json.loads(body)
    except ValueError as e:
        raise SpecViolation(f"{status}: not one JSON value: {e}") from None
    _require(isinstance(document, dict), f"{status}: not a JSON object")
    return document


def check_error(status: int, headers: dict[str, str], body: bytes, want: int,
                route: Optional[str] = None) -> str:
    """An Error answer: the status wanted, {"error": string} (the peer always sends it); with
    `route` (an operationId), a status the reference gives that route."""
    _require(route is None or want in ERROR_STATUSES[route], f"{route} never answers {want}")
    _require(status == want, f"status {status}, wanted {want}: {body[:300]!r}")
    document = check_json(status, headers, body)
    _require(isinstance(document.get("error"), str) and document["error"] != "",
             f"{status}: an Error carries a non-empty string `error`")
    return document["error"]


def check_health(document: dict[str, Any]) -> None:
    _require(document == {"status": "ok"}, f"healthz: {document}")


def check_runtime_config(document: dict[str, Any]) -> None:
    """RuntimeConfig and ClaudeCodeConfig: both required fields, additionalProperties false."""
    _require(set(document) == {"claudeCode"}, f"RuntimeConfig holds only claudeCode: {sorted(document)}")
    claude_code = document["claudeCode"]
    _require(isinstance(claude_code, dict) and set(claude_code) == {"defaultModel", "models"},
             "ClaudeCodeConfig holds exactly defaultModel and models")
    default = claude_code["defaultModel"]
    _require(isinstance(default, str) and len(default) <= 128 and MODEL.fullmatch(default) is not None,
             f"defaultModel {default!r} matches the model pattern")
    models = claude_code["models"]
    _require(isinstance(models, list) and len(set(map(str, models))) == len(models), "models: unique")
    for model in models:
        _require(isinstance(model, str) and MODEL.fullmatch(model) is not None, f"models: {model!r}")
        _require(model != PLATFORM_DEFAULT, "models never holds platform-default")


def check_date_time(value: Any, where: str) -> None:
    _require(isinstance(value, str) and DATE_TIME.fullmatch(value) is not None,
             f"{where}: {value!r} is not an RFC 3339 date-time")


def check_session(document: Any) -> dict[str, Any]:
    """A Session. Extra fields are allowed (no additionalProperties: false), null never."""
    _require(isinstance(document, dict), "a Session is an object")
    _no_null(document, "Session")
    for name in SESSION_REQUIRED:
        _require(name in document, f"Session: {name} is required")
    for name in ("id", "name"):
        _require(isinstance(document[name], str) and document[name] != "", f"Session.{name}: a string")
    name = document["name"]
    _require(name == name.strip(WHITE_SPACE) and name.strip(WHITE_SPACE) != "",
             f"Session.name {name[:40]!r}: trimmed, not empty")
    _require(document["state"] in STATES, f"Session.state {document['state']!r} outside {STATES}")
    _require(document["workloadType"] in WORKLOAD_TYPES,
             f"Session.workloadType {document['workloadType']!r} outside {WORKLOAD_TYPES}")
    check_date_time(document["createdAt"], "Session.createdAt")
    check_date_time(document["lastAccess"], "Session.lastAccess")
    if document["workloadType"] == "claude-code":
        model = document.get("model")
        _require(isinstance(model, str) and MODEL.fullmatch(model) is not None,
                 f"a claude-code Session has its model (the id or platform-default): {model!r}")
    else:
        _require("model" not in document, "a shell Session has no model")
    if document["state"] == "snapshot":
        _require("pod" not in document, "a snapshot has no pod")
        check_checkpoint(document.get("checkpoint"))
    else:
        _require("checkpoint" not in document, "only a snapshot has a checkpoint")
        _require(isinstance(document.get("pod"), str) and document["pod"] != "",
                 f"an {document['state']} session has its pod")
    return document


def check_checkpoint(checkpoint: Any) -> None:
    """Checkpoint: the peer always sends ref, sizeBytes and createdAt; reclaimed optional."""
    _require(isinstance(checkpoint, dict), "a snapshot has a checkpoint object")
    _require(isinstance(checkpoint.get("ref"), str) and checkpoint["ref"] != "", "checkpoint.ref")
    _require(_is_int(checkpoint.get("sizeBytes")) and 0 <= checkpoint["sizeBytes"] <= INT64_MAX,
             "checkpoint.sizeBytes: int64")
    check_date_time(checkpoint.get("createdAt"), "checkpoint.createdAt")
    _require(isinstance(checkpoint.get("reclaimed", ""), str), "checkpoint.reclaimed: a string")


def check_session_list(document: dict[str, Any]) -> list[dict[str, Any]]:
    _require(set(document) == {"sessions"}, f"the list holds only sessions: {sorted(document)}")
    _require(isinstance(document["sessions"], list), "sessions: an array")
    return [check_session(session) for session in document["sessions"]]


def check_read_result(document: dict[str, Any], offset: int) -> dict[str, Any]:
    """ReadResult, all four fields (the peer always sends them). `payload` is text, and its
    UTF-8 byte length is the cursor's advance (the SPA checks this): nextOffset - offset, or,
    for an offset at or past the end, "" with nextOffset the current length."""
    for name in ("session", "path", "payload", "nextOffset"):
        _require(name in document, f"ReadResult: {name}")
    check_session(document["session"])
    _require(document["path"] in READ_PATHS, f"ReadResult.path {document['path']!r}")
    payload, next_offset = document["payload"], document["nextOffset"]
    _require(isinstance(payload, str), "ReadResult.payload: text")
    _require(_is_int(next_offset) and 0 <= next_offset <= INT64_MAX, "ReadResult.nextOffset: int64")
    if next_offset <= offset:
        _require(payload == "", f"at or past the end ({offset} >= {next_offset}) the payload is empty")
    else:
        size = len(payload.encode("utf-8"))
        _require(size == next_offset - offset,
                 f"payload is {size} bytes of UTF-8 but the cursor moved {next_offset - offset}")
    return document


def check_write_result(document: dict[str, Any]) -> dict[str, Any]:
    for name in ("session", "path"):
        _require(name in document, f"WriteResult: {name}")
    check_session(document["session"])
    _require(document["path"] in WRITE_PATHS, f"WriteResult.path {document['path']!r}")
    return document


# -- the stream --------------------------------------------------------------------------------------


def check_stream_headers(headers: dict[str, str]) -> None:
    media = (_header(headers, "content-type") or "").partition(";")[0].strip()
    _require(media == "text/event-stream", f"stream Content-Type {media!r}")
    _require(_header(headers, "cache-control") == "no-cache, no-transform",
             f"stream Cache-Control {_header(headers, 'cache-control')!r}")
    _require(_header(headers, "x-accel-buffering") == "no", "stream X-Accel-Buffering: no")
    _require(_header(headers, "x-content-type-options") == "nosniff", "stream nosniff")


@dataclass
class Frame:
    """One SSE frame: a block of comments, or an event (its fields)."""

    comments: list[str] = field(default_factory=list)
    event: Optional[str] = None
    id: Optional[str] = None
    data: list[str] = field(default_factory=list)


def parse_sse(data: bytes) -> tuple[list[Frame], bytes]:
    """The complete frames in `data` (text/event-stream: UTF-8, lines ending in CRLF, LF or
    CR, a blank line ending a frame), and what is left of an unfinished one."""
    text = data.decode("utf-8")
    frames: list[Frame] = []
    consumed = 0
    current = Frame()
    for match in re.finditer(r"([^\r\n]*)(\r\n|\r|\n)", text):
        line = match.group(1)
        if line == "":
            if current.comments or current.event or current.id is not None or current.data:
                frames.append(current)
            current = Frame()
            consumed = match.end()
            continue
        name, colon, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "":
            current.comments.append(value)
        elif name == "event":
            current.event = value
        elif name == "id":
            current.id = value
        elif name == "data":
            current.data.append(value)
        else:
            _require(name == "retry" and bool(colon) and value.isdigit(), f"an unknown SSE field {name!r}")
    return frames, text[consumed:].encode("utf-8")


@dataclass
class StreamState:
    """What a client following the stream knows: its cursor, the bytes it saw, the resets."""

    cursor: int
    received: bytearray = field(default_factory=bytearray)
    resets: list[int] = field(default_factory=list)
    frames: int = 0


def check_stream(frames: list[Frame], state: StreamState, workload_type: str) -> None:
    """Frames in order, continuing `state`. The first frame of a stream is the comment
    `: connected`; comments (heartbeats) carry no cursor; an output event's id is its
    nextOffset, its data exactly {offset, payloadBase64, nextOffset} with offset the cursor
    and the decoded bytes exactly nextOffset - offset (at most 64 KiB); a reset's id and
    data are the retained length, below the cursor, and the stream goes on from there.
    claude-code cursors fall between code points: every output decodes as UTF-8 whole."""
    for frame in frames:
        if state.frames == 0:
            _require(frame.comments == ["connected"] and frame.event is None and not frame.data,
                     "the first frame is the comment `: connected`")
        state.frames += 1
        if frame.event is None and not frame.data:
            _require(frame.id is None, "a heartbeat comment carries no cursor")
            continue
        _require(len(frame.data) == 1 and frame.id is not None, "an event has one data line and an id")
        data = json.loads(frame.data[0])
        if frame.event == "output":
            _require(set(data) == {"offset", "payloadBase64", "nextOffset"}, f"output data {sorted(data)}")
            offset, next_offset = data["offset"], data["nextOffset"]
            _require(_is_int(offset) and _is_int(next_offset), "output cursors are integers")
            _require(frame.id == str(next_offset), f"output id {frame.id} is its nextOffset {next_offset}")
            _require(offset == state.cursor, f"output from {offset}, the cursor is {state.cursor}")
            try:
                payload = base64.b64decode(data["payloadBase64"], validate=True)
            except (binascii.Error, TypeError):
                raise SpecViolation("payloadBase64 is not base64") from None
            _require(len(payload) == next_offset - offset > 0,
                     f"{len(payload)} bytes decoded for the range {offset}..{next_offset}")
            _require(len(payload) <= MAX_CHUNK_BYTES, f"an output chunk of {len(payload)} bytes")
            if workload_type == "claude-code":
                try:
                    payload.decode("utf-8")
                except UnicodeDecodeError:
                    raise SpecViolation(f"claude-code output {offset}..{next_offset} splits a code point") from None
            state.received += payload
            state.cursor = next_offset
        elif frame.event == "reset":
            _require(set(data) == {"nextOffset"} and _is_int(data["nextOffset"]), f"reset data {data}")
            _require(frame.id == str(data["nextOffset"]), "a reset's id is its nextOffset")
            _require(data["nextOffset"] < state.cursor, "a reset comes when the cursor is past the end")
            state.cursor = data["nextOffset"]
            state.resets.append(state.cursor)
        else:
            raise SpecViolation(f"an unknown event {frame.event!r}")
