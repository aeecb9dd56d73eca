#!/usr/bin/env python3
"""reploy-session-client: the controller's side of a Reploy controlled session.

Role: runs inside the controller container, installed as /usr/local/bin/reploy-session-client.

  reploy-session-client client              the broker
  reploy-session-client attach --socket P   the byte-only terminal attachment
  reploy-session-client probe               its version and sandbox, for the host's check

Peers:
  * the host (reploy.py) over the private channel named by REPLOY_SESSION_SOCKET;
  * the controller program over stdin/stdout, speaking the public JSON Lines stream
    `reploy-controlled-session-client-v1`;
  * one `attach` process, which connects to the broker's private terminal socket. The broker
    hands that connection to the host over the channel (SCM_RIGHTS) and keeps no copy, so
    terminal bytes flow attach <-> host <-> engine with no broker hop.

This file is also the single home of the wire formats both sides share: the public stream codec
and the private channel framing. The host imports it (it must ship beside reploy.py anyway,
because the host installs it into every derived controller image), so there is one codec, not
two copies that could drift. Stdlib only: controller images may have nothing but python3.

Theory of operation. The broker connects to the host's channel, makes its private terminal
socket and emits `broker-ready`; it accepts exactly one `attach` within ATTACH_DEADLINE_S and
hands that connection to the host. From then on it is a relay of structured messages only: the
host's lifecycle events (frames the workload cannot forge, since terminal bytes never travel in
them) go out as JSON Lines, the controller's requests come in through one strict decoder and the
pure BrokerRules, which decide what is premature, duplicate or unauthorized. After `terminated`
it writes the acknowledgement and waits for the host to close the channel; nothing follows
`terminated` on the public stream. One selector loop per process; every fatal condition ends
it with a `client-error` (before `terminated`) and a non-zero exit.

Reading order: constants, exceptions, strict JSON, the public stream (types, codec, broker rules),
the private framing, then the I/O adapters (broker loop, attach loop) and the CLI.
"""

from __future__ import annotations

import array
import collections
import enum
import errno
import fcntl
import json
import os
import re
import selectors
import signal
import socket
import struct
import sys
import termios
import time
import tty
import unicodedata
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator, Optional

if TYPE_CHECKING:
    import argparse  # imported where it parses: see parse_command

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
#: The largest terminal chunk put in one frame or read in one call.
TERMINAL_CHUNK_BYTES = 64 * 1024
#: Terminal bytes a relay queues toward a slow peer before it stops reading their source. Past
#: it the kernel's socket buffers carry the backpressure on to the writer, so memory stays
#: bounded with no credit frames; lifecycle events travel on another connection altogether.
TERMINAL_QUEUE_BYTES = 4 * TERMINAL_CHUNK_BYTES
#: Descriptors one read makes room for: more than the one a hand-over carries, so extra ones
#: are seen and closed; more than this is refused whole (the kernel flags the truncation).
MAX_RECEIVED_DESCRIPTORS = 8
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
# Strict JSON, the first parser any peer's bytes meet. The same section, word for word, is in
# agent.py, reploy_session_client.py and reploy_watchdog.py: each role file runs alone
# (tests/test_strict_json.py keeps the copies identical).
# ============================================================================================


#: The deepest nesting of arrays and objects a peer may send. Every Reploy message is far
#: shallower; deeper input would otherwise end in the interpreter's recursion limit.
MAX_JSON_DEPTH = 32


class StrictJsonError(ValueError):
    """Bytes that are not exactly one strict JSON value. The caller says whose they were."""


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise StrictJsonError(f"duplicate field {key[:40]!r}")
        obj[key] = value
    return obj


def _json_constant(name: str) -> Any:
    raise StrictJsonError(f"non-standard JSON constant {name}")


def _json_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):  # 1e999: JSON can carry no infinity
        raise StrictJsonError(f"{text[:40]} is beyond a float's range")
    return value


_STRICT_JSON = json.JSONDecoder(object_pairs_hook=_json_pairs, parse_constant=_json_constant,
                                parse_float=_json_float)


def _json_depth(value: Any) -> int:
    """How deeply arrays and objects nest in a decoded value, up to one past MAX_JSON_DEPTH:
    level by level (a loop, not recursion: the value came from a peer)."""
    depth, level = 0, [value] if isinstance(value, (dict, list)) else []
    while level and depth <= MAX_JSON_DEPTH:
        depth += 1
        level = [child for item in level
                 for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, (dict, list))]
    return depth


def parse_strict_json(data: bytes, max_bytes: int) -> Any:
    """Exactly one JSON value in at most max_bytes of UTF-8 (JSON's whitespace around it
    allowed, as json.loads allows it), nested at most MAX_JSON_DEPTH deep, with no duplicate
    field, NaN or infinity. Anything else raises StrictJsonError and nothing else: every byte
    a peer sends meets this first."""
    if len(data) > max_bytes:
        raise StrictJsonError(f"more than {max_bytes} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StrictJsonError(f"invalid UTF-8 at byte {e.start}") from None
    try:
        value = _STRICT_JSON.decode(text)
    except StrictJsonError:
        raise
    except json.JSONDecodeError as e:
        raise StrictJsonError(f"malformed JSON: {e.msg} at {e.pos}") from None
    except RecursionError:
        raise StrictJsonError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # an integer past int()'s digit limit
        raise StrictJsonError(f"malformed JSON: {e}") from None
    if _json_depth(value) > MAX_JSON_DEPTH:
        raise StrictJsonError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    return value


# ============================================================================================
# Strict JSON objects: the messages of the stream, the channel and serve's API
# ============================================================================================

#: JSON's own whitespace, which a message may not carry around its object.
_JSON_SPACE = frozenset(b" \t\r\n")


def parse_strict_object(data: bytes, *, max_bytes: int,
                        writable: bool = True) -> dict[str, Any]:
    """Decode exactly one JSON object (parse_strict_json's rules, nothing around it) from at
    most max_bytes of UTF-8; anything else is a ProtocolError.
    `writable=False` skips checking that the object can be written back (no lone surrogate
    escape): a reader that checks each string it keeps saves encoding a large object twice."""
    if data and (data[0] in _JSON_SPACE or data[-1] in _JSON_SPACE):
        raise ProtocolError("invalid_request", "whitespace around the JSON object")
    try:
        obj = parse_strict_json(data, max_bytes)
    except StrictJsonError as e:
        raise ProtocolError("invalid_request", str(e)) from None
    if not isinstance(obj, dict):
        raise ProtocolError("invalid_request", "a message must be a JSON object")
    if not writable:
        return obj
    try:
        encode_compact(obj)  # a lone surrogate escape (\ud800) decodes but can never be written
    except UnicodeEncodeError as e:
        raise ProtocolError("invalid_request", "a string holds a lone surrogate escape") from e
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
_FieldRules = dict[str, tuple[Callable[[str, Any], Any], bool]]
_REASON: _FieldRules = {"reason": (_check_safe_text, True)}
_MAY_REASON: _FieldRules = {"reason": (_check_safe_text, False)}
STATUS_FAMILIES: dict[str, dict[str, _FieldRules]] = {
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
    obj = parse_strict_object(line[:-1], max_bytes=MAX_LINE_BYTES)
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
    the controller sends complete) the only event is terminated, and after terminated there is
    none, not even a client-error: a later failure is said on stderr and in the broker's exit
    code. resize is valid from ready
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
            "client-error": "terminated" not in seen,  # terminated is the last event
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

    @property
    def terminated(self) -> bool:
        """`terminated` was emitted: it is the stream's last event, whatever happens next."""
        return "terminated" in self.seen


# ============================================================================================
# The private framing (host <-> broker, host <-> attach)
# ============================================================================================


class FrameKind(enum.IntEnum):
    """One byte naming what a frame carries. Terminal bytes never share a frame with JSON.

    Two connections carry frames. The channel (host <-> broker) carries EVENT, REQUEST and
    ATTACHED; the terminal connection (host <-> attach), which the broker hands to the host
    inside ATTACHED, carries OUTPUT, OUTPUT_END, INPUT and RESIZE. Lifecycle events and
    terminal bytes never share a connection either, so no flood of output can delay an event.
    """

    EVENT = 1  # host -> broker: one public event object (JSON)
    REQUEST = 2  # broker -> host: one public request object (JSON)
    ATTACHED = 3  # broker -> host: {}, carrying the attachment's connection (SCM_RIGHTS)
    OUTPUT = 4  # host -> attach: workload terminal bytes
    OUTPUT_END = 5  # host -> attach: {"status": "drained"|"failed", "reason"?}
    INPUT = 6  # attach -> host: terminal input bytes
    RESIZE = 7  # attach -> host: {"columns": c, "rows": r} from SIGWINCH


_HEADER = struct.Struct(">IB")  # payload length, kind
_FRAME_KINDS = {kind.value: kind for kind in FrameKind}  # a dict lookup, not an enum call


@dataclass(frozen=True)
class Frame:
    kind: FrameKind
    payload: bytes
    #: Descriptors that arrived with the frame (see FramedConnection.receive). Whoever takes
    #: the frame owns them and closes what it does not keep.
    descriptors: tuple[int, ...] = ()

    def json(self) -> dict[str, Any]:
        """The payload of a structured frame, parsed strictly."""
        return parse_strict_object(self.payload, max_bytes=MAX_FRAME_PAYLOAD_BYTES)


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
        """The frames `data` completes. Each payload is copied once, and what is left of an
        incomplete frame is kept (the common case, whole frames and nothing left over, keeps
        nothing)."""
        if self._buffer:
            self._buffer += data
            buffer: bytes | bytearray = self._buffer
        else:
            buffer = data
        frames: list[Frame] = []
        start, size = 0, len(buffer)
        with memoryview(buffer) as view:
            while size - start >= _HEADER.size:
                length, kind = _HEADER.unpack_from(buffer, start)
                if length > MAX_FRAME_PAYLOAD_BYTES:
                    raise FramingError(f"frame of {length} bytes exceeds the bound")
                frame_kind = _FRAME_KINDS.get(kind)
                if frame_kind is None:
                    raise FramingError(f"unknown frame kind {kind}")
                end = start + _HEADER.size + length
                if size < end:
                    break
                frames.append(Frame(frame_kind, bytes(view[start + _HEADER.size:end])))
                start = end
        if buffer is self._buffer:
            del self._buffer[:start]
        elif start < size:
            self._buffer += data[start:]
        return frames

    @property
    def pending_bytes(self) -> int:
        return len(self._buffer)


# ============================================================================================
# I/O adapters: a non-blocking framed connection that can pass descriptors
# ============================================================================================

#: Ancillary room for MAX_RECEIVED_DESCRIPTORS descriptors in one read.
_DESCRIPTOR_SPACE = socket.CMSG_SPACE(MAX_RECEIVED_DESCRIPTORS * array.array("i").itemsize)
#: recvmsg's flags, as plain ints: these run for every frame, and enum flags are slow.
_CLOSE_ON_EXEC = int(socket.MSG_CMSG_CLOEXEC)
_TRUNCATED = int(socket.MSG_CTRUNC)


def close_descriptors(descriptors: Iterable[int]) -> None:
    """Close each one; one already closed is no error (cleanup paths may meet it twice)."""
    for descriptor in descriptors:
        try:
            os.close(descriptor)
        except OSError:
            pass


def received_descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """Every descriptor recvmsg installed, whatever else the ancillary data held."""
    descriptors = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            descriptors.frombytes(data[:len(data) - len(data) % descriptors.itemsize])
    return list(descriptors)


class FramedConnection:
    """A non-blocking unix stream socket carrying frames, with a priority lane for structured
    frames, and descriptors passed with frames (SCM_RIGHTS).

    `send` queues; `flush` writes what the kernel accepts. Structured frames jump ahead of
    queued terminal bytes (never ahead of a frame already partly written). `hand_over` queues a
    frame that carries descriptors: they are ours to close from then on, and are closed as soon
    as the kernel holds them.

    `receive` reads with MSG_CMSG_CLOEXEC. The kernel delivers descriptors with the bytes of the
    send that carried them and ends that read there, so each descriptor belongs to the frame
    holding the last byte read with it. A descriptor on a frame whose kind is not in
    `descriptor_kinds`, or that no frame claims, is closed and refused (FramingError): nothing
    received is ever left open by accident.
    """

    def __init__(self, sock: socket.socket,
                 descriptor_kinds: frozenset[FrameKind] = frozenset()) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.descriptor_kinds = descriptor_kinds
        self.decoder = FrameDecoder()
        self._urgent: collections.deque[tuple[bytes, tuple[int, ...]]] = collections.deque()
        self._bulk: collections.deque[bytes] = collections.deque()
        self.pending_bulk_bytes = 0
        self._current = memoryview(b"")
        self._current_descriptors: tuple[int, ...] = ()
        #: Received descriptors waiting for the frame they arrived inside to complete.
        self._unclaimed: list[int] = []
        self.eof = False
        self.reset = False  # the peer went away without a clean close
        self.write_closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, frame: bytes, urgent: bool = True) -> None:
        if urgent:
            self._urgent.append((frame, ()))
        else:
            self._bulk.append(frame)
            self.pending_bulk_bytes += len(frame)

    def hand_over(self, frame: bytes, descriptors: tuple[int, ...]) -> None:
        """Queue a structured frame carrying these descriptors, which we now own."""
        self._urgent.append((frame, descriptors))

    @property
    def wants_write(self) -> bool:
        return bool(self._current or self._urgent or self._bulk)

    def flush(self) -> None:
        """Write as much as the kernel accepts; raises OSError if the peer is gone."""
        while True:
            if not self._current:
                if self._urgent:
                    frame, self._current_descriptors = self._urgent.popleft()
                    self._current = memoryview(frame)
                elif self._bulk:
                    self._current = memoryview(self._bulk.popleft())
                    self.pending_bulk_bytes -= len(self._current)
                else:
                    return
            try:
                if self._current_descriptors:
                    sent = self.sock.sendmsg([self._current], [(
                        socket.SOL_SOCKET, socket.SCM_RIGHTS,
                        array.array("i", self._current_descriptors))])
                    close_descriptors(self._current_descriptors)  # the kernel holds them now
                    self._current_descriptors = ()
                else:
                    sent = self.sock.send(self._current)
            except (BlockingIOError, InterruptedError):
                return
            self._current = self._current[sent:]

    def close_write(self) -> None:
        """End our side of the stream (the peer reads to its end); we may go on reading."""
        if not self.write_closed:
            self.write_closed = True
            self.sock.shutdown(socket.SHUT_WR)

    def receive(self) -> list[Frame]:
        """Read what is available and return complete frames; sets `eof` on end of stream.
        Raises FramingError (having closed every descriptor it held) on a protocol violation."""
        try:
            data, ancillary, flags, _ = self.sock.recvmsg(
                TERMINAL_CHUNK_BYTES * 2, _DESCRIPTOR_SPACE, _CLOSE_ON_EXEC)
        except (BlockingIOError, InterruptedError):
            return []
        except ConnectionResetError:
            data, ancillary, flags = b"", [], 0
            self.reset = True
        received = received_descriptors(ancillary) if ancillary else []
        frames: list[Frame] = []
        try:
            if flags & _TRUNCATED:
                raise FramingError(
                    f"more than {MAX_RECEIVED_DESCRIPTORS} descriptors arrived in one read")
            if not data:
                self.eof = True
                if self.decoder.pending_bytes:
                    raise FramingError("channel closed inside a frame")
                if self._unclaimed or received:
                    raise FramingError("a descriptor arrived with no frame")
                return []
            frames = self.decoder.feed(data)
            if received or self._unclaimed:
                frames = self._claim(frames, received)
                received = []
            for frame in frames:
                if frame.descriptors and frame.kind not in self.descriptor_kinds:
                    raise FramingError(f"a descriptor arrived with a {frame.kind.name} frame")
        except FramingError:
            close_descriptors(received)
            close_descriptors(d for frame in frames for d in frame.descriptors)
            close_descriptors(self._unclaimed)
            self._unclaimed = []
            raise
        return frames

    def _claim(self, frames: list[Frame], received: list[int]) -> list[Frame]:
        """Give waiting descriptors to the first frame completed now (it holds the bytes they
        came with), and those of this read to the frame holding its last byte: the last one
        completed, or, when that frame is still incomplete, the next to complete."""
        if self._unclaimed and frames:
            frames[0] = replace(frames[0], descriptors=tuple(self._unclaimed))
            self._unclaimed = []
        if received:
            if frames and not self.decoder.pending_bytes:
                frames[-1] = replace(frames[-1],
                                     descriptors=frames[-1].descriptors + tuple(received))
            else:
                self._unclaimed += received
        return frames

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
        """Close the socket and every descriptor still held; idempotent."""
        try:
            self.sock.close()
        except OSError:
            pass
        close_descriptors(self._current_descriptors)
        close_descriptors(d for _, descriptors in self._urgent for d in descriptors)
        close_descriptors(self._unclaimed)
        self._current, self._current_descriptors, self._unclaimed = memoryview(b""), (), []
        self._urgent.clear()
        self._bulk.clear()
        self.pending_bulk_bytes = 0


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
    """The `client` mode: the public stream on the controller's stdin/stdout, the host channel
    and the one attachment. One selector loop; every fatal condition ends in BrokerExit.

    Terminal bytes never pass through the broker: it hands the attachment's connection to the
    host in an ATTACHED frame (SCM_RIGHTS) and closes its own copy at once, so they flow
    attach <-> host directly. The broker keeps everything else: broker-ready, the
    one-attachment rule and its deadline, the public stream's rules, events and requests.
    """

    def __init__(self, host: socket.socket, home: str, stdin_fd: int, stdout_fd: int,
                 attach_deadline_s: float = ATTACH_DEADLINE_S) -> None:
        self.host = FramedConnection(host)
        self.rules = BrokerRules()
        self.out = StdoutWriter(stdout_fd)
        self.stdin_fd = stdin_fd
        self.stdin_lines = LineReader()
        self.attach_deadline_s = attach_deadline_s
        # os.urandom, not secrets: the same bytes, without the imports every start would pay.
        self.dir = os.path.join(home, BROKER_DIR_PREFIX + os.urandom(16).hex())
        self.socket_path = os.path.join(self.dir, "terminal.sock")
        self.listener: Optional[socket.socket] = None
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
        self.host.close()
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
                self.selector.modify(self.host.sock, selectors.EVENT_READ | (
                    selectors.EVENT_WRITE if self.host.wants_write else 0), "host")
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
        if frame.kind is not FrameKind.EVENT:
            raise FramingError(f"unexpected {frame.kind.name} frame from the host")
        event = decode_message(frame.payload + b"\n", Direction.EVENT)
        self.rules.observe_event(event)
        self.emit(event)
        if self.rules.terminated:
            # The session is over: no attachment can matter now, and its deadline must not
            # end the broker while the controller acknowledges.
            self.close_listener()

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
                self._flush_host()

    def emit(self, event: Message) -> None:
        try:
            self.out.emit(event)
        except OSError as e:
            raise BrokerExit(1) from e

    def emit_error(self, error: ClientError) -> None:
        """A fatal failure: on stderr, and as a public client-error unless `terminated` was
        already emitted, after which the stream carries no event at all (the exit code says
        the broker failed)."""
        print(f"reploy-session-client: {error.code}: {error.message}", file=sys.stderr)
        if self.rules.terminated:
            return
        try:
            self.out.emit(error)
        except OSError:
            pass

    # -- the attachment ---------------------------------------------------------------------

    def _accept_attach(self) -> None:
        """The one attachment: its connection goes to the host, and none stays here."""
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        self.close_listener()  # exactly one attachment; no reconnect in v1
        self.host.hand_over(encode_json_frame(FrameKind.ATTACHED, {}), (conn.detach(),))
        self._flush_host()


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


def _attach_loop(conn: FramedConnection, stdin_fd: int, stdout_fd: int,  # noqa: C901 (one loop)
                 wakeup: SignalWakeup, is_tty: bool) -> int:
    """One selector loop: stdin and signals go to the host, its frames to stdout. Each frame
    is written at once (a keystroke never waits for another pass of the loop). Stdin is read
    only while less than TERMINAL_QUEUE_BYTES waits for the host, so a host that stops reading
    holds stdin back instead of growing our memory. A size goes only with SIGWINCH: until our
    terminal changes, the session's own size (--columns/--rows) holds."""

    def send(frame: bytes, urgent: bool = True) -> None:
        conn.send(frame, urgent)
        conn.flush()

    def send_size() -> None:
        size = terminal_size(stdin_fd) if is_tty else None
        if size is not None:
            send(encode_json_frame(FrameKind.RESIZE, {"columns": size[0], "rows": size[1]}))

    sel = selectors.DefaultSelector()
    conn_events = selectors.EVENT_READ
    sel.register(conn.sock, conn_events, "conn")
    sel.register(wakeup.read_fd, selectors.EVENT_READ, "signal")
    os.set_blocking(stdin_fd, True)
    stdin_open, stdin_watched = True, False
    try:
        while True:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.wants_write else 0)
            if events != conn_events:
                sel.modify(conn.sock, events, "conn")
                conn_events = events
            wanted = stdin_open and conn.pending_bulk_bytes < TERMINAL_QUEUE_BYTES
            if wanted != stdin_watched:
                if wanted:
                    sel.register(stdin_fd, selectors.EVENT_READ, "stdin")
                else:
                    sel.unregister(stdin_fd)
                stdin_watched = wanted
            for key, mask in sel.select():
                if key.data == "signal":
                    for signum in wakeup.drain():
                        if signum == signal.SIGWINCH:
                            send_size()
                        elif signum == signal.SIGINT:
                            send(encode_frame(FrameKind.INPUT, b"\x03"))  # Ctrl-C
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
                        send(encode_frame(FrameKind.INPUT, data), urgent=False)
                    else:
                        stdin_open = False
                else:
                    if mask & selectors.EVENT_WRITE:
                        conn.flush()
                    if mask & selectors.EVENT_READ:
                        outcome = _attach_receive(conn, stdout_fd)
                        if outcome is not None:
                            return outcome
    except OSError as e:
        print(f"reploy-session-client attach: {e}", file=sys.stderr)
        return 1
    finally:
        sel.close()


def _attach_receive(conn: FramedConnection, stdout_fd: int) -> Optional[int]:
    """Write received terminal bytes out; return an exit code when the stream ended."""
    try:
        frames = conn.receive()
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
            else:
                raise FramingError(f"unexpected {frame.kind.name} frame from the host")
    except ProtocolError as e:
        print(f"reploy-session-client attach: {e.message}", file=sys.stderr)
        return 1
    if conn.eof:
        print("reploy-session-client attach: the host closed the terminal connection before "
              "output was finalized", file=sys.stderr)
        return 1
    return None


# ============================================================================================
# The probe (`probe`): what the host checks before a controller image serves a session
# ============================================================================================

#: The lines of /proc/self/status that `probe` reports: the sandbox its process runs under.
PROBE_STATUS_FIELDS = ("Seccomp", "NoNewPrivs", "CapInh", "CapPrm", "CapEff", "CapBnd",
                       "CapAmb")


def run_probe(stdout_fd: int) -> int:
    """`reploy-session-client probe`: one JSON line saying that this client runs here (its
    version, as --version says it) and under which identity and sandbox (seccomp mode,
    no-new-privileges, the capability sets, from /proc/self/status). The host runs it in a
    container made like the controller's and refuses an image or an engine that shows
    anything else than what it asked for."""
    status: dict[str, str] = {}
    with open("/proc/self/status", encoding="ascii", errors="replace") as lines:
        for line in lines:
            name, _, value = line.partition(":")
            if name in PROBE_STATUS_FIELDS:
                status[name] = value.strip()
    write_all(stdout_fd, encode_compact({"version": __version__, "uid": os.getuid(),
                                         "gid": os.getgid(), "status": status}) + b"\n")
    return 0


# ============================================================================================
# CLI
# ============================================================================================


def build_parser() -> argparse.ArgumentParser:
    import argparse  # see parse_command

    parser = argparse.ArgumentParser(
        prog="reploy-session-client",
        description="The controller side of a Reploy controlled session.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    modes = parser.add_subparsers(dest="mode", required=True)
    modes.add_parser("client", help="run the broker: JSON Lines on stdin/stdout")
    attach = modes.add_parser("attach", help="attach terminal bytes to the broker's socket")
    attach.add_argument("--socket", required=True, help="terminal_socket from broker-ready")
    modes.add_parser("probe", help="print this client's version and the sandbox it runs under "
                                   "(what the host checks before a session)")
    return parser


def parse_command(argv: list[str]) -> tuple[str, Optional[str]]:
    """(mode, the attach socket or None). The command lines every session runs (`client`,
    `attach --socket PATH`) are taken as they are, without argparse: its import is a fifth of
    the client's start, which the broker and then attach each pay before the workload may
    start. Every other command line goes to build_parser, so help, --version, the probe and
    every usage error are argparse's, as before."""
    if argv == ["client"]:
        return "client", None
    if len(argv) == 3 and argv[:2] == ["attach", "--socket"] and argv[2][:1] not in ("", "-"):
        return "attach", argv[2]
    args = build_parser().parse_args(argv)
    return args.mode, getattr(args, "socket", None)


def main(argv: Optional[list[str]] = None) -> int:
    mode, socket_path = parse_command(sys.argv[1:] if argv is None else argv)
    if mode == "client":
        return run_client()
    if mode == "probe":
        return run_probe(sys.stdout.fileno())
    assert socket_path is not None
    return run_attach(socket_path, sys.stdin.fileno(), sys.stdout.fileno())


def run_as_program() -> None:
    """main() as the whole process: run as a script, or imported by the launcher a derived
    controller image installs (which finds this module's bytecode; a script's never is)."""
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything main() opened is closed and written; the interpreter's own teardown is all
    # that remains, and a session's end waits for it twice (attach's exit, the broker's).
    os._exit(exit_code)


if __name__ == "__main__":
    run_as_program()
