#!/usr/bin/env python3
"""reploy-session-client: the controller's side of a Reploy controlled session.

Role: runs inside the controller container, installed as /usr/local/bin/reploy-session-client.

  reploy-session-client client              the broker
  reploy-session-client attach --socket P   the byte-only terminal attachment

Peers:
  * the host (reploy.py) over the private channel named by REPLOY_SESSION_SOCKET;
  * the controller program over stdin/stdout, speaking the public JSON Lines stream
    `reploy-controlled-session-client-v1`;
  * one `attach` process over the broker's private terminal socket.

This file is also the single home of the wire formats both sides share: the public stream codec
and the private channel framing. The host imports it (it must ship beside reploy.py anyway,
because the host installs it into every derived controller image), so there is one codec, not
two copies that could drift. Stdlib only: controller images may have nothing but python3.

Reading order: constants, exceptions, strict JSON, the public stream (types, codec, broker rules),
the private framing, then the I/O adapters (broker loop, attach loop) and the CLI.
"""

from __future__ import annotations

import argparse
import enum
import errno
import fcntl
import json
import os
import re
import secrets
import selectors
import signal
import socket
import struct
import sys
import termios
import time
import tty
import unicodedata
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Iterator, Optional

# ============================================================================================
# Constants
# ============================================================================================

#: Reploy's release: one value in all four role files (a test checks), named by the offline bundle.
__version__ = "0.1.0"

#: The public stream's schema; a future incompatible stream must use another.
CLIENT_SCHEMA = "reploy-controlled-session-client-v1"
#: The host result's schema (reploy.py prints it; the codec for its statuses lives here).
RUN_RESULT_SCHEMA = "reploy-controlled-session-run-result-v1"
#: One public stream line, newline included.
MAX_LINE_BYTES = 1024 * 1024
#: One private frame's payload (structured or terminal bytes).
MAX_FRAME_PAYLOAD_BYTES = 1024 * 1024
#: The fixed broker deadline for the attachment to connect after broker-ready.
ATTACH_DEADLINE_S = 10.0
#: Terminal bytes a sender may have in flight before the receiver grants more credit.
DATA_WINDOW_BYTES = 1024 * 1024
#: The largest terminal chunk put in one frame or read in one call.
TERMINAL_CHUNK_BYTES = 64 * 1024
#: Terminal dimensions accepted anywhere (columns and rows alike).
MIN_DIMENSION, MAX_DIMENSION = 1, 65535
#: Every reason and message on the public stream and in the host result is safe text this long
#: at most (UTF-8 bytes).
MAX_SAFE_TEXT_BYTES = 512
#: The operations a v1 session grants, in the order `opened` lists them.
OPERATIONS = ("input", "resize", "terminate", "complete")
#: Environment variable naming the controller-private channel socket.
SESSION_SOCKET_ENV = "REPLOY_SESSION_SOCKET"
#: Prefix of the broker's private directory under $HOME.
BROKER_DIR_PREFIX = "reploy-controlled-session-"
#: How long an exiting broker may spend delivering frames it already queued for the host.
EXIT_FLUSH_DEADLINE_S = 2.0

# ============================================================================================
# Exceptions, split by who is at fault
# ============================================================================================


class ReployClientError(Exception):
    """Root of this module's errors."""


class ProtocolError(ReployClientError):
    """The peer sent something the contract forbids. `code` is a public machine code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class FramingError(ProtocolError):
    """The private channel carried a malformed frame: the channel is unusable from here on."""

    def __init__(self, message: str) -> None:
        super().__init__("channel_protocol_error", message)


# ============================================================================================
# Strict JSON: one object, no duplicates, no trailing data, no NaN
# ============================================================================================


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ProtocolError("invalid_request", f"duplicate field {key!r}")
        obj[key] = value
    return obj


def _reject_constant(name: str) -> Any:
    raise ProtocolError("invalid_request", f"non-standard JSON constant {name}")


_STRICT_DECODER = json.JSONDecoder(
    object_pairs_hook=_reject_duplicate_keys, parse_constant=_reject_constant
)


def parse_strict_object(data: bytes) -> dict[str, Any]:
    """Decode exactly one JSON object from UTF-8 bytes; anything else is a ProtocolError."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError("invalid_request", f"invalid UTF-8 at byte {e.start}") from e
    try:
        obj, end = _STRICT_DECODER.raw_decode(text)
    except json.JSONDecodeError as e:
        raise ProtocolError("invalid_request", f"malformed JSON: {e.msg} at {e.pos}") from e
    except (ValueError, RecursionError) as e:  # an integer past int()'s digit limit; deep nesting
        raise ProtocolError("invalid_request", f"malformed JSON: {e}") from e
    if end != len(text):
        raise ProtocolError("invalid_request", "trailing data after the JSON object")
    if not isinstance(obj, dict):
        raise ProtocolError("invalid_request", "a message must be a JSON object")
    try:
        encode_compact(obj)  # a lone surrogate escape (\ud800) decodes but can never be written
    except UnicodeEncodeError as e:
        raise ProtocolError("invalid_request", "a string holds a lone surrogate escape") from e
    except ValueError as e:  # 1e999 decodes as infinity, which JSON cannot carry
        raise ProtocolError("invalid_request", f"malformed JSON: {e}") from e
    return obj


def encode_compact(obj: dict[str, Any]) -> bytes:
    """The one JSON encoding Reploy writes: compact, UTF-8, key order as given."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


# ============================================================================================
# The public stream: value types
# ============================================================================================


class Cause(str, enum.Enum):
    """The first termination cause; the host latches exactly one per session."""

    CONTROLLER_TERMINATE = "controller-terminate"
    WORKLOAD_EXIT = "workload-exit"
    HOST_CANCEL = "host-cancel"
    CONTROLLER_LOST = "controller-lost"
    RUNTIME_OBSERVATION_LOST = "runtime-observation-lost"
    STARTUP_FAILURE = "startup-failure"


class RecoveryAction(str, enum.Enum):
    """What a failed cleanup asks of the operator or of Reploy."""

    NONE = "none"
    #: Run the cleanup again (`reploy controlled-session cleanup`).
    RETRY_CLEANUP = "retry-cleanup"
    #: Something the session owned may remain; the next reploy operation that touches Docker
    #: reconciles it (each one does so first).
    RECONCILE_NEXT_OPERATION = "reconcile-next-operation"


#: Recovery actions a failed cleanup may carry; a succeeded one carries NONE.
CLEANUP_FAILURE_ACTIONS = frozenset({RecoveryAction.RETRY_CLEANUP,
                                     RecoveryAction.RECONCILE_NEXT_OPERATION})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_string(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ProtocolError("invalid_request", f"{name} must be a string")
    return value


def _raise_invalid(message: str) -> Any:
    raise ProtocolError("invalid_request", message)


#: diagnostic.code and client-error.code: an open enum of lowercase snake_case machine codes.
_PROTOCOL_CODE = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*")
MAX_PROTOCOL_CODE_BYTES = 63


def _unsafe_character(char: str) -> bool:
    return unicodedata.category(char) in ("Cc", "Cf", "Cs")


def _check_safe_text(name: str, value: Any) -> str:
    """The contract's safe text: non-empty, at most 512 UTF-8 bytes, no leading or trailing
    whitespace, no control or format characters."""
    _check_string(name, value)
    if (not value or value.strip() != value or any(map(_unsafe_character, value))
            or len(value.encode("utf-8", "surrogatepass")) > MAX_SAFE_TEXT_BYTES):
        raise ProtocolError("invalid_request", f"{name} must be safe text")
    return value


def safe_text(text: str) -> str:
    """Make any text (an engine error, an OS message) safe text: control and format characters
    become spaces, runs of whitespace one space, the ends trimmed, the length cut at a
    character boundary. Reasons and messages Reploy writes all pass through here."""
    cleaned = " ".join("".join(" " if _unsafe_character(c) else c for c in text).split())
    data = (cleaned or "unspecified").encode("utf-8", "replace")
    if len(data) > MAX_SAFE_TEXT_BYTES:
        data = data[:MAX_SAFE_TEXT_BYTES - len(_ELLIPSIS)].decode("utf-8", "ignore").rstrip() \
            .encode() + _ELLIPSIS
    return data.decode("utf-8")


_ELLIPSIS = "\u2026".encode()


def _check_dimension(name: str, value: Any) -> int:
    if not _is_int(value) or not MIN_DIMENSION <= value <= MAX_DIMENSION:
        raise ProtocolError(
            "invalid_request", f"{name} must be an integer from {MIN_DIMENSION} to {MAX_DIMENSION}"
        )
    return value


def _check_code(name: str, value: Any) -> int:
    if not _is_int(value):
        raise ProtocolError("invalid_request", f"{name} must be an integer")
    return value


#: Each status family: kind -> its fields in wire order, each with its checker and whether it
#: is required. A status is `{"kind": ..., <fields>}`; nothing else is accepted. These are the
#: contract's rules: `unknown` carries nothing, `exited` an integer code, the other process
#: kinds no code; drained, maintained, succeeded and the good output kinds carry no text;
#: failed finalization and cleanup require it (cleanup's text is called `message`).
_REASON = {"reason": (_check_safe_text, True)}
_MAY_REASON = {"reason": (_check_safe_text, False)}
STATUS_FAMILIES: dict[str, dict[str, dict[str, tuple[Callable[[str, Any], Any], bool]]]] = {
    "process": {
        "unknown": {},
        "exited": {"code": (_check_code, True), **_MAY_REASON},
        "terminated": _MAY_REASON,
        "unavailable": _MAY_REASON,
    },
    "output_finalization": {"drained": {}, "failed": _REASON},
    "runtime_observation": {"maintained": {}, "lost": _MAY_REASON},
    "controller_finalization": {
        "completed": _MAY_REASON,
        "lost": _MAY_REASON,
        "finalization-timeout": _MAY_REASON,
        "not-completed": _MAY_REASON,
        "startup-failed": _MAY_REASON,
    },
    "cleanup": {"succeeded": {}, "failed": {"message": (_check_safe_text, True)}},
    "controller_output": {
        "not-requested": {},
        "directory-retained": {},
        "file-published": {},
        "file-discarded": _REASON,
        "failed": _REASON,
    },
}
#: The fields that hold human text: a producer's text is made safe before it is checked.
_TEXT_FIELDS = ("reason", "message")


@dataclass(frozen=True)
class Status:
    """One tagged status such as {"kind":"exited","code":0}; valid for its family by construction."""

    family: str
    kind: str
    details: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        kinds = STATUS_FAMILIES[self.family]
        if self.kind not in kinds:
            raise ProtocolError("invalid_request", f"unknown {self.family} status kind {self.kind!r}")
        allowed = kinds[self.kind]
        names = tuple(name for name, _ in self.details)
        if names != tuple(n for n in allowed if n in names) or not all(
                n in names for n, (_, required) in allowed.items() if required):
            raise ProtocolError("invalid_request", f"{self.family} status {self.kind!r} fields")
        for name, value in self.details:
            allowed[name][0](name, value)

    @classmethod
    def of(cls, family: str, kind: str, **details: Any) -> "Status":
        """A status Reploy reports; its text fields are made safe text first."""
        order = STATUS_FAMILIES[family].get(kind, {})
        if not set(details) <= set(order):
            raise ProtocolError("invalid_request", f"{family} status {kind!r} fields")
        return cls(family, kind, tuple(
            (name, safe_text(details[name]) if name in _TEXT_FIELDS else details[name])
            for name in order if name in details))

    @classmethod
    def parse(cls, family: str, obj: Any) -> "Status":
        if not isinstance(obj, dict) or "kind" not in obj:
            raise ProtocolError("invalid_request", f"a {family} status must be an object with kind")
        kind = obj["kind"]
        kinds = STATUS_FAMILIES[family]
        if not isinstance(kind, str) or kind not in kinds:
            raise ProtocolError("invalid_request", f"unknown {family} status kind {kind!r}")
        if not set(obj) - {"kind"} <= set(kinds[kind]):
            raise ProtocolError("invalid_request", f"{family} status {kind!r} has wrong fields")
        return cls(family, kind, tuple((name, obj[name]) for name in kinds[kind] if name in obj))

    @property
    def reason(self) -> Optional[str]:
        details = dict(self.details)
        return details.get("reason", details.get("message"))

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, **dict(self.details)}


@dataclass(frozen=True)
class Endpoint:
    id: str
    scheme: str
    host: str
    port: int

    def __post_init__(self) -> None:
        for name in ("id", "scheme", "host"):
            _check_string(name, getattr(self, name))
        if not _is_int(self.port) or not 1 <= self.port <= 65535:
            raise ProtocolError("invalid_request", "endpoint port must be 1..65535")

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "scheme": self.scheme, "host": self.host, "port": self.port}


#: The session result's fields, in wire order, with the status family of each (None: not a status).
SESSION_RESULT_FIELDS: tuple[tuple[str, Optional[str]], ...] = (
    ("cause", None),
    ("workload_status", "process"),
    ("workload_output_finalization_status", "output_finalization"),
    ("runtime_observation_status", "runtime_observation"),
    ("controller_finalization_status", "controller_finalization"),
    ("cleanup_status", "cleanup"),
    ("recovery_action", None),
)


@dataclass(frozen=True)
class SessionResult:
    """The authoritative result carried by `terminated` (and the host result's session_result).

    Every one of the seven fields is a value in every cause, and the facts agree with the cause
    as the contract requires: workload-exit names a known workload status, controller-lost a
    `lost` controller finalization, startup-failure a `startup-failed` one, a lost runtime
    observation a failed output finalization; a failed cleanup names its recovery action.
    """

    cause: Cause
    workload_status: Status
    workload_output_finalization_status: Status
    runtime_observation_status: Status
    controller_finalization_status: Status
    cleanup_status: Status
    recovery_action: RecoveryAction

    def __post_init__(self) -> None:
        for name, family in SESSION_RESULT_FIELDS:
            value = getattr(self, name)
            if family is not None and (not isinstance(value, Status) or value.family != family):
                raise ProtocolError("invalid_request", f"{name} must be a {family} status")
        for rule, holds in self._cause_rules():
            if not holds:
                raise ProtocolError("invalid_request", f"session result: {rule}")

    def _cause_rules(self) -> Iterator[tuple[str, bool]]:
        cause = self.cause
        yield ("workload-exit needs a known workload status",
               cause is not Cause.WORKLOAD_EXIT or self.workload_status.kind != "unknown")
        yield ("controller-lost needs controller finalization lost",
               cause is not Cause.CONTROLLER_LOST
               or self.controller_finalization_status.kind == "lost")
        yield ("startup-failure needs controller finalization startup-failed",
               cause is not Cause.STARTUP_FAILURE
               or self.controller_finalization_status.kind == "startup-failed")
        yield ("runtime-observation-lost needs observation lost and output finalization failed",
               cause is not Cause.RUNTIME_OBSERVATION_LOST
               or (self.runtime_observation_status.kind == "lost"
                   and self.workload_output_finalization_status.kind == "failed"))
        yield ("cleanup and recovery action disagree",
               cleanup_agrees(self.cleanup_status, self.recovery_action))

    @classmethod
    def parse(cls, obj: Any) -> "SessionResult":
        if not isinstance(obj, dict) or set(obj) != {name for name, _ in SESSION_RESULT_FIELDS}:
            raise ProtocolError("invalid_request", "terminated.result has wrong fields")
        try:
            cause = Cause(obj["cause"])
            recovery = RecoveryAction(obj["recovery_action"])
        except ValueError as e:
            raise ProtocolError("invalid_request", str(e)) from e
        statuses = {name: Status.parse(family, obj[name])
                    for name, family in SESSION_RESULT_FIELDS if family is not None}
        return cls(cause=cause, recovery_action=recovery, **statuses)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, family in SESSION_RESULT_FIELDS:
            value = getattr(self, name)
            out[name] = value.value if family is None else value.to_json()
        return out

    @property
    def succeeded(self) -> bool:
        """The session half of the seed's `ok` rule (the host adds delivery and outputs)."""
        cause_ok = self.cause is Cause.CONTROLLER_TERMINATE or (
            self.cause is Cause.WORKLOAD_EXIT
            and self.workload_status.kind == "exited"
            and dict(self.workload_status.details)["code"] == 0
        )
        kinds = (
            (self.workload_output_finalization_status, "drained"),
            (self.runtime_observation_status, "maintained"),
            (self.controller_finalization_status, "completed"),
            (self.cleanup_status, "succeeded"),
        )
        return (
            cause_ok
            and all(status.kind == kind for status, kind in kinds)
            and self.recovery_action is RecoveryAction.NONE
        )


def cleanup_agrees(status: Status, action: RecoveryAction) -> bool:
    """A succeeded cleanup needs no recovery; a failed one names how to recover."""
    if status.kind == "succeeded":
        return action is RecoveryAction.NONE
    return action in CLEANUP_FAILURE_ACTIONS


# ============================================================================================
# The public stream: messages
# ============================================================================================


class Direction(enum.Enum):
    EVENT = "event"  # broker -> controller
    REQUEST = "request"  # controller -> broker


@dataclass(frozen=True)
class Message:
    """Base of every public stream message. Subclasses declare TYPE, DIRECTION and fields."""

    TYPE: ClassVar[str]
    DIRECTION: ClassVar[Direction]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": CLIENT_SCHEMA, "type": self.TYPE}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.metadata.get("omit_if_none"):
                continue
            out[f.name] = _to_json_value(value)
        return out

    def encode(self) -> bytes:
        """One public stream line, newline included."""
        line = encode_compact(self.to_json()) + b"\n"
        if len(line) > MAX_LINE_BYTES:
            raise ProtocolError("line_too_long", f"{self.TYPE} line exceeds {MAX_LINE_BYTES} bytes")
        return line


def _to_json_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (Status, SessionResult, Endpoint)):
        return value.to_json()
    if isinstance(value, tuple):
        return [_to_json_value(v) for v in value]
    return value


# --- events ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BrokerReady(Message):
    TYPE = "broker-ready"
    DIRECTION = Direction.EVENT
    terminal_socket: str

    def __post_init__(self) -> None:
        _check_string("terminal_socket", self.terminal_socket)


@dataclass(frozen=True)
class Opened(Message):
    TYPE = "opened"
    DIRECTION = Direction.EVENT
    operations: tuple[str, ...]
    endpoints: tuple[Endpoint, ...]
    columns: int
    rows: int
    output_finalization_timeout_milliseconds: int

    def __post_init__(self) -> None:
        if not isinstance(self.operations, tuple) or not all(
            op in OPERATIONS for op in self.operations
        ) or len(set(self.operations)) != len(self.operations):
            raise ProtocolError("invalid_request", "opened.operations must name known operations")
        if not all(isinstance(e, Endpoint) for e in self.endpoints):
            raise ProtocolError("invalid_request", "opened.endpoints must be endpoints")
        _check_dimension("columns", self.columns)
        _check_dimension("rows", self.rows)
        if not _is_int(self.output_finalization_timeout_milliseconds) or (
            self.output_finalization_timeout_milliseconds <= 0
        ):
            raise ProtocolError("invalid_request", "output finalization timeout must be positive")


@dataclass(frozen=True)
class Ready(Message):
    TYPE = "ready"
    DIRECTION = Direction.EVENT


@dataclass(frozen=True)
class WorkloadExit(Message):
    TYPE = "workload-exit"
    DIRECTION = Direction.EVENT
    status: Status

    def __post_init__(self) -> None:
        if not isinstance(self.status, Status) or self.status.family != "process":
            raise ProtocolError("invalid_request", "workload-exit.status must be a process status")
        if self.status.kind == "unknown":
            raise ProtocolError("invalid_request", "workload-exit reports a known status")


@dataclass(frozen=True)
class Terminating(Message):
    TYPE = "terminating"
    DIRECTION = Direction.EVENT
    cause: Cause


@dataclass(frozen=True)
class CodedEvent(Message):
    """An open machine code plus a human message (diagnostic, client-error). Consumers must
    treat an unknown well-formed code as a generic one."""

    code: str
    message: str

    def __post_init__(self) -> None:
        if not isinstance(self.code, str) or not _PROTOCOL_CODE.fullmatch(self.code) or len(
                self.code) > MAX_PROTOCOL_CODE_BYTES:
            raise ProtocolError("invalid_request", "code must be a snake_case machine code")
        _check_safe_text("message", self.message)


@dataclass(frozen=True)
class Diagnostic(CodedEvent):
    TYPE = "diagnostic"
    DIRECTION = Direction.EVENT


@dataclass(frozen=True)
class WorkloadOutputsFinalized(Message):
    TYPE = "workload-outputs-finalized"
    DIRECTION = Direction.EVENT
    status: str
    reason: Optional[str] = field(default=None, metadata={"omit_if_none": True})

    def __post_init__(self) -> None:
        if self.status == "drained" and self.reason is None:
            return
        if self.status == "failed" and self.reason is not None:
            _check_safe_text("reason", self.reason)
            return
        raise ProtocolError("invalid_request", "outputs-finalized: drained, or failed with reason")


@dataclass(frozen=True)
class Terminated(Message):
    TYPE = "terminated"
    DIRECTION = Direction.EVENT
    result: SessionResult


@dataclass(frozen=True)
class ClientError(CodedEvent):
    TYPE = "client-error"
    DIRECTION = Direction.EVENT


# --- requests -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resize(Message):
    TYPE = "resize"
    DIRECTION = Direction.REQUEST
    columns: int
    rows: int

    def __post_init__(self) -> None:
        _check_dimension("columns", self.columns)
        _check_dimension("rows", self.rows)


@dataclass(frozen=True)
class Terminate(Message):
    TYPE = "terminate"
    DIRECTION = Direction.REQUEST


@dataclass(frozen=True)
class Complete(Message):
    TYPE = "complete"
    DIRECTION = Direction.REQUEST


@dataclass(frozen=True)
class AcknowledgeTerminated(Message):
    TYPE = "acknowledge-terminated"
    DIRECTION = Direction.REQUEST


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        BrokerReady, Opened, Ready, WorkloadExit, Terminating, Diagnostic,
        WorkloadOutputsFinalized, Terminated, ClientError,
        Resize, Terminate, Complete, AcknowledgeTerminated,
    )
}

#: How each field's JSON value becomes its Python value, by (message type, field name).
_FIELD_PARSERS: dict[str, Callable[[Any], Any]] = {
    "opened.operations": lambda v: tuple(v) if isinstance(v, list) else _raise_invalid(
        "operations must be a list"),
    "opened.endpoints": lambda v: tuple(_parse_endpoint(e) for e in v) if isinstance(
        v, list) else _raise_invalid("endpoints must be a list"),
    "workload-exit.status": lambda v: Status.parse("process", v),
    "terminating.cause": lambda v: _parse_enum(Cause, v),
    "terminated.result": SessionResult.parse,
}


def _parse_enum(kind: type[enum.Enum], value: Any) -> Any:
    try:
        return kind(value)
    except ValueError as e:
        raise ProtocolError("invalid_request", f"unknown {kind.__name__} {value!r}") from e


def _parse_endpoint(obj: Any) -> Endpoint:
    if not isinstance(obj, dict) or set(obj) != {"id", "scheme", "host", "port"}:
        raise ProtocolError("invalid_request", "an endpoint has exactly id, scheme, host, port")
    return Endpoint(**obj)


def decode_message(line: bytes, direction: Direction) -> Message:
    """Parse one public stream line (newline included) strictly, for the given direction.

    Raises ProtocolError with a public code for every rule of the v1 contract: line length,
    newline termination, UTF-8, JSON syntax, duplicate/unknown/missing fields, schema, type.
    """
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError("line_too_long", f"line exceeds {MAX_LINE_BYTES} bytes")
    if not line.endswith(b"\n"):
        raise ProtocolError("invalid_request", "a message must end with a newline")
    obj = parse_strict_object(line[:-1])
    if obj.get("schema") != CLIENT_SCHEMA:
        raise ProtocolError("unsupported_schema", f"schema must be {CLIENT_SCHEMA!r}")
    kind = obj.get("type")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None or cls.DIRECTION is not direction:
        raise ProtocolError("unknown_type", f"unknown {direction.value} type {kind!r}")
    expected = [f.name for f in fields(cls)]
    required = {f.name for f in fields(cls) if not f.metadata.get("omit_if_none")}
    present = set(obj) - {"schema", "type"}
    unknown = present - set(expected)
    if unknown:
        raise ProtocolError("invalid_request", f"unknown field(s) {sorted(unknown)} in {kind}")
    missing = required - present
    if missing:
        raise ProtocolError("invalid_request", f"missing field(s) {sorted(missing)} in {kind}")
    nulls = sorted(name for name in present - required if obj[name] is None)
    if nulls:
        raise ProtocolError("invalid_request", f"absent optional field(s) {nulls} sent as null")
    values = {
        name: _FIELD_PARSERS.get(f"{kind}.{name}", lambda v: v)(obj[name])
        for name in expected
        if name in obj
    }
    try:
        return cls(**values)
    except TypeError as e:
        raise ProtocolError("invalid_request", f"bad fields in {kind}: {e}") from e


# ============================================================================================
# The broker's rules (pure): which events may come, which requests are allowed
# ============================================================================================


class RequestVerdict(enum.Enum):
    FORWARD = "forward"  # send it to the host
    IGNORE = "ignore"  # idempotent repeat: valid, but nothing to do


class BrokerRules:
    """The lifecycle of the public stream, seen from the broker.

    Theory of operation: host events arrive in lifecycle order. broker-ready (emitted locally)
    comes first, then opened, then ready or a startup-failure terminated. workload-exit may come
    before terminating (cause workload-exit) or after it. complete is allowed once, only after
    both terminating and workload-outputs-finalized; acknowledge-terminated once, only after
    terminated. Every workload fact comes before workload-outputs-finalized: after it (when
    the controller sends complete) the only event is terminated. resize is valid from ready
    until termination begins; later resizes are a benign
    race and ignored. terminate is valid from ready on and idempotent. Anything else is fatal.
    """

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.sent: set[str] = set()

    # -- events from the host (trusted, but order is still checked) --------------------------

    def observe_event(self, event: Message) -> None:
        kind = event.TYPE
        seen = self.seen
        allowed = {
            "broker-ready": "broker-ready" not in seen,
            "opened": "broker-ready" in seen and "opened" not in seen,
            "ready": "opened" in seen and not seen & {"ready", "terminating", "terminated"},
            "workload-exit": "ready" in seen
            and not seen & {"workload-exit", "workload-outputs-finalized", "terminated"},
            "terminating": "ready" in seen and not seen & {"terminating", "terminated"},
            "diagnostic": "broker-ready" in seen
            and not seen & {"workload-outputs-finalized", "terminated"},
            "workload-outputs-finalized": "terminating" in seen
            and not seen & {"workload-outputs-finalized", "terminated"},
            "terminated": "opened" in seen and "terminated" not in seen
            and ("ready" not in seen or "workload-outputs-finalized" in seen),
            "client-error": True,
        }[kind]
        if not allowed:
            raise ProtocolError("host_protocol_error", f"host event {kind} out of lifecycle order")
        if kind == "terminating" and isinstance(event, Terminating):
            # workload-exit precedes terminating exactly when it is the cause.
            if (event.cause is Cause.WORKLOAD_EXIT) != ("workload-exit" in seen):
                raise ProtocolError("host_protocol_error",
                                    "workload-exit precedes terminating only as its cause")
        seen.add(kind)

    # -- requests from the controller -------------------------------------------------------

    def check_request(self, request: Message) -> RequestVerdict:
        kind, seen = request.TYPE, self.seen
        terminating = bool(seen & {"terminating", "terminated"})
        if kind == "resize":
            if "ready" not in seen:
                raise ProtocolError("premature_request", "resize before ready")
            return RequestVerdict.IGNORE if terminating else RequestVerdict.FORWARD
        if kind == "terminate":
            if "ready" not in seen:
                raise ProtocolError("premature_request", "terminate before ready")
            if terminating or "terminate" in self.sent:
                return RequestVerdict.IGNORE
        elif kind == "complete":
            if "complete" in self.sent:
                raise ProtocolError("duplicate_request", "complete was already sent")
            if not {"terminating", "workload-outputs-finalized"} <= seen:
                raise ProtocolError(
                    "premature_request", "complete before terminating and outputs-finalized"
                )
            if "terminated" in seen:
                raise ProtocolError("unauthorized_request", "complete after terminated")
        elif kind == "acknowledge-terminated":
            if "acknowledge-terminated" in self.sent:
                raise ProtocolError("duplicate_request", "acknowledge-terminated was already sent")
            if "terminated" not in seen:
                raise ProtocolError("premature_request", "acknowledge-terminated before terminated")
        self.sent.add(kind)
        return RequestVerdict.FORWARD

    @property
    def acknowledged(self) -> bool:
        return "acknowledge-terminated" in self.sent


# ============================================================================================
# The private framing (host <-> broker, broker <-> attach)
# ============================================================================================


class FrameKind(enum.IntEnum):
    """One byte naming what a frame carries. Terminal bytes never share a frame with JSON."""

    EVENT = 1  # host -> broker: one public event object (JSON)
    OUTPUT = 2  # host -> broker -> attach: workload terminal bytes
    OUTPUT_END = 3  # host -> broker -> attach: {"status": "drained"|"failed", "reason"?}
    REQUEST = 4  # broker -> host: one public request object (JSON)
    INPUT = 5  # attach -> broker -> host: terminal input bytes
    CREDIT = 6  # either way: {"bytes": n}, more room for the peer's terminal bytes
    ATTACHED = 7  # broker -> host: {} the attachment is connected; the workload may start
    RESIZE = 8  # attach -> broker: {"columns": c, "rows": r} from SIGWINCH


STRUCTURED_FRAMES = frozenset(
    {FrameKind.EVENT, FrameKind.OUTPUT_END, FrameKind.REQUEST, FrameKind.CREDIT,
     FrameKind.ATTACHED, FrameKind.RESIZE}
)
_HEADER = struct.Struct(">IB")  # payload length, kind


@dataclass(frozen=True)
class Frame:
    kind: FrameKind
    payload: bytes

    def json(self) -> dict[str, Any]:
        """The payload of a structured frame, parsed strictly."""
        return parse_strict_object(self.payload)


def encode_frame(kind: FrameKind, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_FRAME_PAYLOAD_BYTES:
        raise FramingError(f"frame payload of {len(payload)} bytes exceeds the bound")
    return _HEADER.pack(len(payload), kind) + payload


def encode_json_frame(kind: FrameKind, obj: dict[str, Any]) -> bytes:
    return encode_frame(kind, encode_compact(obj))


class FrameDecoder:
    """Feed bytes, get frames. Sans-IO: the caller owns the socket."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        self._buffer += data
        frames: list[Frame] = []
        while len(self._buffer) >= _HEADER.size:
            length, kind = _HEADER.unpack_from(self._buffer)
            if length > MAX_FRAME_PAYLOAD_BYTES:
                raise FramingError(f"frame of {length} bytes exceeds the bound")
            try:
                frame_kind = FrameKind(kind)
            except ValueError as e:
                raise FramingError(f"unknown frame kind {kind}") from e
            end = _HEADER.size + length
            if len(self._buffer) < end:
                break
            frames.append(Frame(frame_kind, bytes(self._buffer[_HEADER.size:end])))
            del self._buffer[:end]
        return frames

    @property
    def pending_bytes(self) -> int:
        return len(self._buffer)


def chunks(data: bytes, size: int = TERMINAL_CHUNK_BYTES) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start:start + size]


class DataWindow:
    """Credit-based flow control for terminal bytes, one direction.

    The sender may have at most DATA_WINDOW_BYTES unacknowledged; the receiver grants credit
    after it has passed bytes on. Structured frames are never held back by it, which is how
    lifecycle events keep priority over a flood of output.
    """

    def __init__(self, window_bytes: int = DATA_WINDOW_BYTES) -> None:
        self.available_bytes = window_bytes

    def take(self, wanted_bytes: int) -> int:
        granted = min(wanted_bytes, self.available_bytes)
        self.available_bytes -= granted
        return granted

    def grant(self, frame: Frame) -> None:
        count = frame.json().get("bytes")
        if not _is_int(count) or count <= 0 or count > DATA_WINDOW_BYTES:
            raise FramingError("credit must be a positive byte count within the window")
        self.available_bytes += count
        if self.available_bytes > DATA_WINDOW_BYTES:
            raise FramingError("credit beyond the window")


def credit_frame(count_bytes: int) -> bytes:
    return encode_json_frame(FrameKind.CREDIT, {"bytes": count_bytes})


# ============================================================================================
# I/O adapters: a non-blocking framed connection
# ============================================================================================


class FramedConnection:
    """A non-blocking stream socket carrying frames, with a priority lane for structured frames.

    `send` queues; `flush` writes what the kernel accepts. Structured frames jump ahead of
    queued terminal bytes (never ahead of a frame already partly written).
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.decoder = FrameDecoder()
        self._urgent: list[bytes] = []
        self._bulk: list[bytes] = []
        self.pending_bulk_bytes = 0
        self._current = memoryview(b"")
        self.eof = False
        self.reset = False  # the peer went away without a clean close
        self.write_closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, frame: bytes, urgent: bool = True) -> None:
        if urgent:
            self._urgent.append(frame)
        else:
            self._bulk.append(frame)
            self.pending_bulk_bytes += len(frame)

    @property
    def wants_write(self) -> bool:
        return bool(self._current or self._urgent or self._bulk)

    def flush(self) -> None:
        """Write as much as the kernel accepts; raises OSError if the peer is gone."""
        while True:
            if not self._current:
                if self._urgent:
                    self._current = memoryview(self._urgent.pop(0))
                elif self._bulk:
                    self._current = memoryview(self._bulk.pop(0))
                    self.pending_bulk_bytes -= len(self._current)
                else:
                    return
            try:
                sent = self.sock.send(self._current)
            except (BlockingIOError, InterruptedError):
                return
            self._current = self._current[sent:]

    def receive(self) -> list[Frame]:
        """Read what is available and return complete frames; sets `eof` on end of stream."""
        try:
            data = self.sock.recv(TERMINAL_CHUNK_BYTES * 2)
        except (BlockingIOError, InterruptedError):
            return []
        except ConnectionResetError:
            data = b""
            self.reset = True
        if not data:
            self.eof = True
            if self.decoder.pending_bytes:
                raise FramingError("channel closed inside a frame")
            return []
        return self.decoder.feed(data)

    def drain_blocking(self, deadline: float) -> bool:
        """Flush everything before `deadline`; True if all was written."""
        while self.wants_write:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with selectors.DefaultSelector() as sel:
                sel.register(self.sock, selectors.EVENT_WRITE)
                if sel.select(remaining):
                    self.flush()
        return True

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# ============================================================================================
# The broker (`client`)
# ============================================================================================


class StdoutWriter:
    """Public events to the controller: whole lines, in order, flushed at once."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def emit(self, event: Message) -> None:
        write_all(self.fd, event.encode())


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except InterruptedError:
            continue
        except BlockingIOError:
            wait_writable(fd)
            continue
        view = view[written:]


def wait_writable(fd: int) -> None:
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_WRITE)
        sel.select()


class LineReader:
    """Splits a byte stream into newline-terminated lines, refusing any line over the bound."""

    def __init__(self, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self._buffer = bytearray()
        self._max = max_line_bytes

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        lines: list[bytes] = []
        while True:
            cut = self._buffer.find(b"\n")
            if cut < 0:
                if len(self._buffer) >= self._max:
                    raise ProtocolError("line_too_long", f"line exceeds {self._max} bytes")
                return lines
            if cut + 1 > self._max:
                raise ProtocolError("line_too_long", f"line exceeds {self._max} bytes")
            lines.append(bytes(self._buffer[:cut + 1]))
            del self._buffer[:cut + 1]

    @property
    def partial(self) -> bool:
        return bool(self._buffer)


class BrokerExit(Exception):
    """Ends the broker loop with an exit code (and maybe a public client-error)."""

    def __init__(self, code: int, error: Optional[ClientError] = None) -> None:
        super().__init__(error.message if error else f"exit {code}")
        self.code = code
        self.error = error


class Broker:
    """The `client` mode: relays between the host channel, the controller's stdin/stdout and
    one attachment. One selector loop; every fatal condition ends in BrokerExit.

    Terminal bytes are flow-controlled both ways (DataWindow): output is credited back to the
    host only once it is queued toward the attachment, input is read from the attachment only
    while the host has granted room. Structured frames are never held back.
    """

    def __init__(self, host: socket.socket, home: str, stdin_fd: int, stdout_fd: int,
                 attach_deadline_s: float = ATTACH_DEADLINE_S) -> None:
        self.host = FramedConnection(host)
        self.rules = BrokerRules()
        self.out = StdoutWriter(stdout_fd)
        self.stdin_fd = stdin_fd
        self.stdin_lines = LineReader()
        self.attach_deadline_s = attach_deadline_s
        self.dir = os.path.join(home, BROKER_DIR_PREFIX + secrets.token_hex(16))
        self.socket_path = os.path.join(self.dir, "terminal.sock")
        self.listener: Optional[socket.socket] = None
        self.attach: Optional[FramedConnection] = None
        self.attach_events = 0  # what the selector watches on the attachment (0: unregistered)
        self.attach_gone = False
        self.output_to_attach = bytearray()  # from the host, not yet framed for the attachment
        self.output_end: Optional[bytes] = None  # the host's OUTPUT_END payload, once sent
        self.input_to_host = bytearray()  # from the attachment, waiting for host credit
        self.input_window = DataWindow()  # our room for INPUT frames toward the host
        self.selector = selectors.DefaultSelector()

    # -- setup and teardown -----------------------------------------------------------------

    def open_terminal_socket(self) -> None:
        os.mkdir(self.dir, 0o700)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            listener.bind(self.socket_path)
        finally:
            os.umask(old_umask)
        listener.listen(1)
        listener.setblocking(False)
        self.listener = listener

    def close_listener(self) -> None:
        if self.listener is not None:
            self.selector.unregister(self.listener)
            self.listener.close()
            self.listener = None
            _unlink_quietly(self.socket_path)

    def cleanup(self) -> None:
        try:  # a request validated before a fatal line was consumed: it still reaches the host
            self.host.drain_blocking(time.monotonic() + EXIT_FLUSH_DEADLINE_S)
        except OSError:
            pass  # the host is gone; there is nobody left to deliver to
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        _unlink_quietly(self.socket_path)
        try:
            os.rmdir(self.dir)
        except OSError:
            pass
        for conn in (self.attach, self.host):
            if conn is not None:
                conn.close()
        self.selector.close()

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        try:
            self.open_terminal_socket()
            broker_ready = BrokerReady(terminal_socket=self.socket_path)
            self.rules.observe_event(broker_ready)
            self.emit(broker_ready)
            attach_deadline = time.monotonic() + self.attach_deadline_s
            assert self.listener is not None
            self.selector.register(self.listener, selectors.EVENT_READ, "listener")
            self.selector.register(self.stdin_fd, selectors.EVENT_READ, "stdin")
            self.selector.register(self.host.sock, selectors.EVENT_READ, "host")
            while True:
                self._pump()
                timeout = None
                if self.listener is not None:
                    timeout = attach_deadline - time.monotonic()
                    if timeout <= 0:
                        raise BrokerExit(1, ClientError(
                            code="attach_timeout",
                            message=f"no attachment connected within {self.attach_deadline_s:g} s",
                        ))
                for key, mask in self.selector.select(timeout):
                    self._dispatch(key.data, mask)
        except BrokerExit as done:
            if done.error is not None:
                self.emit_error(done.error)
            return done.code
        except ProtocolError as e:
            self.emit_error(ClientError(code=e.code, message=safe_text(e.message)))
            return 1
        finally:
            self.cleanup()

    def _dispatch(self, what: str, mask: int) -> None:
        if what == "listener":
            self._accept_attach()
        elif what == "stdin":
            self._read_stdin()
        elif what == "host":
            if mask & selectors.EVENT_WRITE:
                self._flush_host()
            if mask & selectors.EVENT_READ:
                self._read_host()
        elif what == "attach":
            if mask & selectors.EVENT_WRITE:
                self._flush_attach()
            if mask & selectors.EVENT_READ and not self.attach_gone:
                self._read_attach()

    def _pump(self) -> None:
        """Move queued terminal bytes as far as credit allows, then set selector interest."""
        while self.input_to_host:
            granted = self.input_window.take(min(len(self.input_to_host), TERMINAL_CHUNK_BYTES))
            if not granted:
                break
            self.host.send(encode_frame(FrameKind.INPUT, bytes(self.input_to_host[:granted])),
                           urgent=False)
            del self.input_to_host[:granted]
        attach = self.attach
        if attach is not None and not self.attach_gone:
            while self.output_to_attach and attach.pending_bulk_bytes < 4 * TERMINAL_CHUNK_BYTES:
                piece = bytes(self.output_to_attach[:TERMINAL_CHUNK_BYTES])
                del self.output_to_attach[:len(piece)]
                attach.send(encode_frame(FrameKind.OUTPUT, piece), urgent=False)
                self.host.send(credit_frame(len(piece)))
            if not self.output_to_attach and self.output_end is not None and (
                    not attach.write_closed):
                attach.send(encode_frame(FrameKind.OUTPUT_END, self.output_end), urgent=False)
                attach.write_closed = True
            events = selectors.EVENT_WRITE if attach.wants_write else 0
            if len(self.input_to_host) < DATA_WINDOW_BYTES:
                events |= selectors.EVENT_READ
            self._watch_attach(events)
        self.selector.modify(self.host.sock, selectors.EVENT_READ | (
            selectors.EVENT_WRITE if self.host.wants_write else 0), "host")

    def _watch_attach(self, events: int) -> None:
        assert self.attach is not None
        if events == self.attach_events:
            return
        if not events:
            self.selector.unregister(self.attach.sock)
        elif not self.attach_events:
            self.selector.register(self.attach.sock, events, "attach")
        else:
            self.selector.modify(self.attach.sock, events, "attach")
        self.attach_events = events

    # -- host side --------------------------------------------------------------------------

    def _flush_host(self) -> None:
        try:
            self.host.flush()
        except OSError as e:  # even after our acknowledgement: it may not have reached the host
            raise BrokerExit(1, ClientError(
                code="host_channel_lost", message=safe_text(f"host channel write failed: {e}"))) from e

    def _read_host(self) -> None:
        for frame in self.host.receive():
            self._on_host_frame(frame)
        if self.host.eof:
            if self.rules.acknowledged and not self.host.wants_write and not self.host.reset:
                raise BrokerExit(0)  # the acknowledgement was written, then a clean close
            if self.rules.acknowledged:
                raise BrokerExit(1, ClientError(
                    code="host_channel_lost",
                    message="the host channel did not close cleanly after the acknowledgement"))
            raise BrokerExit(1, ClientError(
                code="host_channel_lost", message="the host closed the session channel early"))

    def _on_host_frame(self, frame: Frame) -> None:
        if frame.kind is FrameKind.EVENT:
            event = decode_message(frame.payload + b"\n", Direction.EVENT)
            self.rules.observe_event(event)
            self.emit(event)
        elif frame.kind is FrameKind.OUTPUT:
            if self.attach_gone:
                self.host.send(credit_frame(len(frame.payload)))  # nobody left to show it to
            else:
                self.output_to_attach += frame.payload
        elif frame.kind is FrameKind.OUTPUT_END:
            frame.json()
            self.output_end = frame.payload
        elif frame.kind is FrameKind.CREDIT:
            self.input_window.grant(frame)
        else:
            raise FramingError(f"unexpected {frame.kind.name} frame from the host")

    # -- controller side --------------------------------------------------------------------

    def _read_stdin(self) -> None:
        try:
            data = os.read(self.stdin_fd, TERMINAL_CHUNK_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            self.selector.unregister(self.stdin_fd)
            if self.stdin_lines.partial:
                raise ProtocolError("invalid_request", "stdin ended inside a request line")
            if not self.rules.acknowledged:
                raise BrokerExit(1, ClientError(
                    code="controller_stream_closed",
                    message="the controller closed stdin before acknowledging terminated"))
            return
        for line in self.stdin_lines.feed(data):
            request = decode_message(line, Direction.REQUEST)
            if self.rules.check_request(request) is RequestVerdict.FORWARD:
                self.host.send(encode_frame(FrameKind.REQUEST, encode_compact(request.to_json())))

    def emit(self, event: Message) -> None:
        try:
            self.out.emit(event)
        except OSError as e:
            raise BrokerExit(1) from e

    def emit_error(self, error: ClientError) -> None:
        print(f"reploy-session-client: {error.code}: {error.message}", file=sys.stderr)
        try:
            self.out.emit(error)
        except OSError:
            pass

    # -- attachment side --------------------------------------------------------------------

    def _accept_attach(self) -> None:
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        self.close_listener()  # exactly one attachment; no reconnect in v1
        self.attach = FramedConnection(conn)
        self.host.send(encode_json_frame(FrameKind.ATTACHED, {}))

    def _read_attach(self) -> None:
        assert self.attach is not None
        try:
            frames = self.attach.receive()
        except FramingError as e:
            self._lose_attach(str(e))
            return
        for frame in frames:
            if frame.kind is FrameKind.INPUT:
                self.input_to_host += frame.payload
            elif frame.kind is FrameKind.RESIZE:
                self._forward_attach_resize(frame)
            else:
                self._lose_attach(f"unexpected {frame.kind.name} frame from the attachment")
                return
        if self.attach.eof:
            self._lose_attach(None)

    def _forward_attach_resize(self, frame: Frame) -> None:
        """SIGWINCH from the attachment. The CLI's size wins until ready; after termination
        begins there is nothing left to resize."""
        try:
            obj = frame.json()
            resize = Resize(columns=obj.get("columns"), rows=obj.get("rows"))
        except ProtocolError as e:
            print(f"reploy-session-client: ignoring attachment resize: {e.message}",
                  file=sys.stderr)
            return
        if "ready" in self.rules.seen and not self.rules.seen & {"terminating", "terminated"}:
            self.host.send(encode_frame(FrameKind.REQUEST, encode_compact(resize.to_json())))

    def _flush_attach(self) -> None:
        assert self.attach is not None
        try:
            self.attach.flush()
        except OSError as e:
            self._lose_attach(f"attachment write failed: {e}")

    def _lose_attach(self, reason: Optional[str]) -> None:
        """The attachment ended. Its unsent output is released so the host never stalls."""
        if self.attach is None or self.attach_gone:
            return
        self._watch_attach(0)
        self.attach_gone = True
        self.attach.close()
        released = len(self.output_to_attach)
        if released:
            self.host.send(credit_frame(min(released, DATA_WINDOW_BYTES)))
            self.output_to_attach.clear()
        if reason is not None:
            print(f"reploy-session-client: attachment lost: {reason}", file=sys.stderr)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def run_client() -> int:
    """`reploy-session-client client`."""
    path = os.environ.get(SESSION_SOCKET_ENV)
    stdout = StdoutWriter(sys.stdout.fileno())
    home = os.environ.get("HOME")
    if not path or not home:
        missing = SESSION_SOCKET_ENV if not path else "HOME"
        stdout.emit(ClientError(code="no_session", message=f"{missing} is not set"))
        print(f"reploy-session-client: {missing} is not set", file=sys.stderr)
        return 1
    host = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        host.connect(path)
    except OSError as e:
        host.close()
        stdout.emit(ClientError(code="host_unavailable",
                                message=safe_text(f"cannot connect: {e.strerror}")))
        print(f"reploy-session-client: cannot connect to {path}: {e}", file=sys.stderr)
        return 1
    broker = Broker(host, home, sys.stdin.fileno(), sys.stdout.fileno())
    return broker.run()


# ============================================================================================
# The attachment (`attach --socket PATH`)
# ============================================================================================


def terminal_size(fd: int) -> Optional[tuple[int, int]]:
    """(columns, rows) of the terminal on fd, or None when it has no usable size."""
    try:
        rows, columns, _, _ = struct.unpack(
            "HHHH", fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        return None
    if rows == 0 or columns == 0:
        return None
    return columns, rows


class RawMode:
    """Puts a TTY in raw mode and restores it on exit, whatever happens."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.saved: Optional[list[Any]] = None

    def __enter__(self) -> "RawMode":
        self.saved = termios.tcgetattr(self.fd)
        tty.setraw(self.fd, termios.TCSANOW)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            termios.tcsetattr(self.fd, termios.TCSAFLUSH, self.saved)


class SignalWakeup:
    """Routes signals into the selector loop through a wakeup pipe; handlers only record."""

    def __init__(self, signums: tuple[int, ...]) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self.signums = signums
        self.previous: dict[int, Any] = {}
        self.previous_fd = -1

    def __enter__(self) -> "SignalWakeup":
        self.previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        for signum in self.signums:
            self.previous[signum] = signal.signal(signum, lambda *_: None)
        return self

    def drain(self) -> list[int]:
        try:
            return list(os.read(self.read_fd, 256))
        except BlockingIOError:
            return []

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self.previous_fd)
        os.close(self.read_fd)
        os.close(self.write_fd)


def run_attach(socket_path: str, stdin_fd: int, stdout_fd: int) -> int:
    """`reploy-session-client attach`: terminal bytes only. 0 once output drained, else 1."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_path)
    except OSError as e:
        sock.close()
        print(f"reploy-session-client attach: cannot connect to {socket_path}: {e}",
              file=sys.stderr)
        return 1
    is_tty = os.isatty(stdin_fd)
    conn = FramedConnection(sock)
    signums = (signal.SIGWINCH, signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    try:
        with SignalWakeup(signums) as wakeup:
            if is_tty:
                with RawMode(stdin_fd):
                    return _attach_loop(conn, stdin_fd, stdout_fd, wakeup, is_tty)
            return _attach_loop(conn, stdin_fd, stdout_fd, wakeup, is_tty)
    finally:
        conn.close()


def _attach_loop(conn: FramedConnection, stdin_fd: int, stdout_fd: int,
                 wakeup: SignalWakeup, is_tty: bool) -> int:
    def send_size() -> None:
        size = terminal_size(stdin_fd) if is_tty else None
        if size is not None:
            conn.send(encode_json_frame(FrameKind.RESIZE, {"columns": size[0], "rows": size[1]}))

    send_size()
    sel = selectors.DefaultSelector()
    sel.register(conn.sock, selectors.EVENT_READ, "conn")
    sel.register(wakeup.read_fd, selectors.EVENT_READ, "signal")
    stdin_registered = True
    os.set_blocking(stdin_fd, True)
    sel.register(stdin_fd, selectors.EVENT_READ, "stdin")
    try:
        while True:
            sel.modify(conn.sock, selectors.EVENT_READ | (
                selectors.EVENT_WRITE if conn.wants_write else 0), "conn")
            for key, mask in sel.select():
                if key.data == "signal":
                    for signum in wakeup.drain():
                        if signum == signal.SIGWINCH:
                            send_size()
                        elif signum == signal.SIGINT:
                            conn.send(encode_frame(FrameKind.INPUT, b"\x03"))  # Ctrl-C
                        else:
                            return 1
                elif key.data == "stdin":
                    try:
                        data = os.read(stdin_fd, TERMINAL_CHUNK_BYTES)
                    except OSError as e:
                        if e.errno not in (errno.EIO, errno.EBADF):
                            raise
                        data = b""
                    if data:
                        conn.send(encode_frame(FrameKind.INPUT, data), urgent=False)
                    elif stdin_registered:
                        sel.unregister(stdin_fd)
                        stdin_registered = False
                else:
                    if mask & selectors.EVENT_WRITE:
                        conn.flush()
                    if mask & selectors.EVENT_READ:
                        outcome = _attach_receive(conn, stdout_fd)
                        if outcome is not None:
                            return outcome
            # Hold stdin while output-bound frames pile up: the broker's window bounds us.
            if stdin_registered and conn.pending_bulk_bytes > DATA_WINDOW_BYTES:
                sel.unregister(stdin_fd)
                stdin_registered = False
    except OSError as e:
        print(f"reploy-session-client attach: {e}", file=sys.stderr)
        return 1
    finally:
        sel.close()


def _attach_receive(conn: FramedConnection, stdout_fd: int) -> Optional[int]:
    """Write received terminal bytes out; return an exit code when the stream ended."""
    try:
        frames = conn.receive()
    except FramingError as e:
        print(f"reploy-session-client attach: {e.message}", file=sys.stderr)
        return 1
    for frame in frames:
        if frame.kind is FrameKind.OUTPUT:
            write_all(stdout_fd, frame.payload)
        elif frame.kind is FrameKind.OUTPUT_END:
            status = frame.json()
            if status.get("status") == "drained":
                return 0
            print(f"reploy-session-client attach: terminal output finalization failed: "
                  f"{status.get('reason', 'unknown')}", file=sys.stderr)
            return 1
    if conn.eof:
        print("reploy-session-client attach: the broker closed before output was finalized",
              file=sys.stderr)
        return 1
    return None


# ============================================================================================
# CLI
# ============================================================================================


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reploy-session-client",
        description="The controller side of a Reploy controlled session.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    modes = parser.add_subparsers(dest="mode", required=True)
    modes.add_parser("client", help="run the broker: JSON Lines on stdin/stdout")
    attach = modes.add_parser("attach", help="attach terminal bytes to the broker's socket")
    attach.add_argument("--socket", required=True, help="terminal_socket from broker-ready")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.mode == "client":
        return run_client()
    return run_attach(args.socket, sys.stdin.fileno(), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
