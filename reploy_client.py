#!/usr/bin/env python3
"""reploy_client: Reploy's managed sessions from Python, through a `reploy serve`'s API.

    import reploy_client
    client = reploy_client.Client("http://127.0.0.1:8080", token_file="STATE_DIR/token")
    with client.create(name="job") as s:            # the session is deleted on exit
        s.files.write("in.txt", b"hello\\n")
        result = s.exec(["wc", "-c", "in.txt"], timeout=30)
        print(result.exit_code, result.stdout)

Standard library only, and it never imports the Docker SDK: a harness (an eval, an agent
benchmark, an RL rollout) imports it without Reploy's host dependencies, and it runs copied
beside reploy_session_client.py (the project's one strict JSON parser). Directory copies
(`Session.copy_out`/`copy_in`, which `reploy session cp` runs) also take agent.py's archive
rules, imported only then.

Peers:
  * reploy_serve.py serves the API (web/openapi.json documents it); its `reploy session` verbs
    are a thin CLI over this client: one implementation of the calls, the token rules and the
    answer checks.
  * reploy_inspect.py, the Inspect AI sandbox provider, is a small file on top of this one.

Theory of operation. A Client holds the server's URL and token and a small pool of keep-alive
HTTP/1.1 connections (http.client): a call takes an idle connection or opens one, and gives it
back once the answer is read whole, so calls from several threads run in parallel on their
own connections and a serial caller reuses one. Every answer is checked before it is used:
something that is not a JSON object from reploy serve (another server on the port) is one
clear ReployError. An error answer becomes an exception from its machine-readable `code`
(when serve sends one) or its status and stable words: FileNotFoundError, PermissionError,
IsADirectoryError, NotADirectoryError and TimeoutError subclasses that are also ReployErrors,
else a ReployError(status, code, reason).

Reading order: constants, errors, the pure core (server URLs, tokens, paths, error mapping,
answer checks, SSE), the I/O adapters (token files, the connection pool), the session API.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import ipaddress
import os
import re
import secrets
import stat
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Optional

import reploy_session_client as wire

__version__ = "0.1.0"

# ============================================================================================
# Constants
# ============================================================================================

API_PREFIX = "/api/v1"
DEFAULT_SERVER = "http://127.0.0.1:8080"  #: serve's default --listen
SERVER_ENV = "REPLOY_SERVER"
TOKEN_ENV = "REPLOY_TOKEN"

TOKEN_RE = re.compile(r"[A-Za-z0-9._~+/=-]{32,512}")  #: what serve makes and accepts
MAX_TOKEN_FILE_BYTES = 4096
MAX_ANSWER_BYTES = 128 * 1024 * 1024  #: the most of one JSON answer read into memory
#: serve's bounds on an exec's output, per stream (agent.py's DEFAULT_ and MAX_EXEC_OUTPUT_CAP_BYTES):
#: the cap when none is asked for, and the most one may ask for.
DEFAULT_EXEC_OUTPUT_BYTES = 1024 * 1024
MAX_EXEC_OUTPUT_BYTES = 16 * 1024 * 1024
#: An exec answer beyond its two streams: how the command ended, the field names, JSON's quotes.
EXEC_ANSWER_OVERHEAD_BYTES = 64 * 1024
#: Files.read's default bound: a larger file is refused (too_large) unless the caller raises it.
DEFAULT_READ_LIMIT_BYTES = 64 * 1024 * 1024
MAX_MESSAGE_CHARS = 2000  #: a server's error message as shown, at most
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f-\x9f]")
TRANSFER_CHUNK_BYTES = 752 * 1024  #: reads and writes of a streamed HTTP body
CALL_TIMEOUT_S = 120.0  #: the socket timeout of a call that is not an exec or a transfer
TRANSFER_TIMEOUT_S = 600.0  #: a stall of this long ends an upload or a download
EXEC_GRACE_S = 60.0  #: beyond an exec's own timeout, for serve to answer
POOL_IDLE_MAX = 8  #: idle keep-alive connections kept per client (more may be open at once)
#: A call is tried again when nothing ran: its connection was refused, or reset before its
#: request was sent, or serve refused it with a Retry-After (429 at a bound, 503). At most this
#: many tries in all, and at most this long waited in all: a wait that would pass it is not
#: made, and the refusal is the answer.
RETRY_TRIES = 4
RETRY_BUDGET_S = 60.0
#: The first wait after a refused or reset connection; each next one is twice the last.
RETRY_FIRST_PAUSE_S = 0.25
RETRIED_STATUSES = frozenset((429, 503))
HOME_PREFIX = "~/"
#: An exec's stdin travels in its request up to this (agent.py's MAX_EXEC_STDIN_BYTES); more
#: is uploaded to a file first and named as the exec's stdinPath.
MAX_INLINE_STDIN_BYTES = 4 * 1024 * 1024
STDIN_FILE_PREFIX = ".reploy-stdin-"
MAX_SSE_LINE_BYTES = 1024 * 1024  #: serve's events carry 64 KiB of output, base64 in JSON
#: A line of a streamed exec answer, at most: one page of a stream (agent.py's EXEC_PAGE_BYTES,
#: 256 KiB) as base64 in JSON, how the command ended, or serve's error.
MAX_EXEC_LINE_BYTES = 512 * 1024
#: The fields of a streamed exec answer's last line: the whole answer's, but the streams.
EXEC_END_FIELDS = frozenset(("execId", "exitCode", "signal", "timedOut", "killed", "durationMs",
                             "stdoutTruncated", "stderrTruncated"))
#: The most `session cp` takes out of a session is its disk quota plus this much per tar entry
#: (headers and padding), and never more than one transfer.
TAR_BYTES_PER_ENTRY = 1024

# ============================================================================================
# Errors
# ============================================================================================


class ReployError(Exception):
    """A call that failed: `status` is the HTTP status (None when nothing answered, or when
    what answered is not reploy serve), `code` serve's machine-readable code (None when it
    sent none), `reason` the message shown."""

    def __init__(self, status: Optional[int], code: Optional[str], reason: str) -> None:
        super().__init__(reason)
        self.status, self.code, self.reason = status, code, reason

    @property
    def document(self) -> dict[str, Any]:
        """The error as `reploy session` prints it: {"error", "status"} (and "code")."""
        return {"error": self.reason, "status": self.status,
                **({"code": self.code} if self.code is not None else {})}


class CredentialError(ReployError):
    """A token file or $REPLOY_TOKEN that cannot be used; the message never quotes a token."""

    def __init__(self, reason: str) -> None:
        super().__init__(None, None, reason)


class ReployFileNotFoundError(ReployError, FileNotFoundError):
    """No such file or directory (or no such session)."""


class ReployPermissionError(ReployError, PermissionError):
    """The session's runtime user may not do this."""


class ReployIsADirectoryError(ReployError, IsADirectoryError):
    """A directory where a file was meant."""


class ReployNotADirectoryError(ReployError, NotADirectoryError):
    """A file where a directory was meant."""


class ReployTimeoutError(ReployError, TimeoutError):
    """Serve's wait on the session ran out (504), or no answer came in time."""


#: serve's error codes (and, for answers without one, the stable words of docs/agent.md's
#: "Errors of the harness verbs" and errno texts) -> the exception raised.
ERROR_CODES: dict[str, type[ReployError]] = {
    "not_found": ReployFileNotFoundError, "permission_denied": ReployPermissionError,
    "is_a_directory": ReployIsADirectoryError, "not_a_directory": ReployNotADirectoryError,
    "timeout": ReployTimeoutError,
}
_ERROR_WORDS: tuple[tuple[str, type[ReployError]], ...] = (
    ("no such file or directory", ReployFileNotFoundError),
    ("permission denied", ReployPermissionError),
    ("is a directory", ReployIsADirectoryError),
    ("not a directory", ReployNotADirectoryError),
)

# ============================================================================================
# The pure core
# ============================================================================================


def check_server(text: str, allow_plain_http: bool = False) -> str:
    """`text` if it is an http(s) URL of a host; ValueError otherwise, and for plain http
    beyond loopback unless allowed: the token would cross the network in clear."""
    try:
        url = urllib.parse.urlsplit(text)
        host = url.hostname if url.port != 0 else None  # .port raises for one that is not a port
    except ValueError:
        raise ValueError(f"--server: {text!r} is not http(s)://HOST[:PORT]") from None
    if url.scheme not in ("http", "https") or not host or url.username or url.query or url.fragment:
        raise ValueError(f"--server: {text!r} is not http(s)://HOST[:PORT]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if url.scheme == "http" and not loopback and not allow_plain_http:
        raise ValueError(f"--server {text}: plain http beyond loopback would send the token in "
                         "clear; use https (a TLS proxy in front of serve), or say "
                         "--allow-plain-http (allow_plain_http=True)")
    return text


def check_token(text: str, where: str) -> str:
    if not TOKEN_RE.fullmatch(text):
        raise CredentialError(f"{where} does not hold a token (e.g. export "
                              "REPLOY_TOKEN=$(cat STATE_DIR/token))")
    return text


def shown(text: str, limit_chars: int = MAX_MESSAGE_CHARS) -> str:
    """A message from elsewhere as Reploy passes it on: control characters shown as escapes,
    at most limit_chars."""
    text = CONTROL_CHARACTERS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return text if len(text) <= limit_chars else text[:limit_chars] + "..."


def file_target(path: str) -> tuple[str, str]:
    """(root, path below it) for a files path: `~/x` is home's, `/x` the container's (sent
    with its leading slash), anything else the workspace's. Pure."""
    if path == "~" or path.startswith(HOME_PREFIX):
        return "home", path[1:].lstrip("/")
    return "workspace", path


def file_route(kind: str, session_id: str, root: str, path: str,
               mode: Optional[int] = None, sha256: Optional[str] = None) -> str:
    """The API path of a files or list route. A leading slash (a container path) travels
    percent-encoded, so the route's own slashes stay the route's."""
    query = {"root": root} if root != "workspace" else {}
    if mode is not None:
        query["mode"] = f"{mode:04o}"
    if sha256 is not None:
        query["sha256"] = sha256
    quoted = ("%2F" + urllib.parse.quote(path[1:])) if path.startswith("/") else urllib.parse.quote(path)
    return (f"/sessions/{session_id}/{kind}/{quoted}"
            + (f"?{urllib.parse.urlencode(query)}" if query else ""))


def error_for(status: Optional[int], code: Optional[str], reason: str) -> ReployError:
    """The exception for an error answer: by its code, else by its stable words."""
    kind = ERROR_CODES.get(code or "")
    if kind is None:
        lowered = reason.lower()
        kind = next((k for words, k in _ERROR_WORDS if words in lowered), None)
    if kind is None:
        kind = ReployTimeoutError if status == 504 else ReployError
    return kind(status, code, reason)


class AnswerInvalid(ValueError):
    """A field of an answer that is not what serve sends."""


def field(document: Optional[dict[str, Any]], name: str, kind: Any,
          nullable: bool = False) -> Any:
    """One field of an answer the client acts on, of JSON type `kind` (bool is never an
    int). AnswerInvalid otherwise."""
    if document is None or name not in document:
        raise AnswerInvalid(f"{name} is missing")
    value = document[name]
    if value is None and nullable:
        return None
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise AnswerInvalid(f"{name} is not {getattr(kind, '__name__', kind)}")
    return value


def base64_field(document: dict[str, Any], name: str) -> bytes:
    try:
        return base64.b64decode(field(document, name, str), validate=True)
    except ValueError as e:
        raise AnswerInvalid(f"{name} is not base64") from e


@dataclass(frozen=True)
class ExecResult:
    """One command's end. `exit_code` is None when a signal ended it (`signal`); `truncated`
    says output past the cap was dropped from either stream."""

    exit_code: Optional[int]
    stdout: bytes
    stderr: bytes
    timed_out: bool
    truncated: bool
    signal: Optional[str] = None
    duration_ms: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def exec_answer_limit(max_output_bytes: Optional[int]) -> int:
    """The most an exec answer may be, given the output cap asked for (None: serve's default):
    each stream once, in the longer of its two forms (base64), and the rest. Pure."""
    cap = DEFAULT_EXEC_OUTPUT_BYTES if max_output_bytes is None else max_output_bytes
    return 2 * ((cap + 2) // 3 * 4) + EXEC_ANSWER_OVERHEAD_BYTES


def exec_stream(document: dict[str, Any], name: str) -> bytes:
    """One stream of an exec answer, in the form its `{name}Encoding` names: `text` (the bytes,
    UTF-8) or `base64`. An answer from an older serve, which sent both, has no such field and
    its exact bytes in base64."""
    encoding = field(document, f"{name}Encoding", str) if f"{name}Encoding" in document else "base64"
    if encoding == "text":
        try:
            return field(document, name, str).encode("utf-8")
        except UnicodeEncodeError:
            raise AnswerInvalid(f"{name} is not text") from None
    if encoding == "base64":
        return base64_field(document, f"{name}Base64")
    raise AnswerInvalid(f"{name}Encoding is neither text nor base64")


def exec_end(document: dict[str, Any], stdout: bytes, stderr: bytes, truncated: bool) -> ExecResult:
    """How a command ended, from an exec answer (whole, or a streamed one's last line),
    checked, with its output. Pure."""
    exit_code = field(document, "exitCode", int, nullable=True)
    if exit_code is not None and not 0 <= exit_code <= 255:
        raise AnswerInvalid("exitCode is not 0..255")
    signal_name = field(document, "signal", str, nullable=True)
    if signal_name is not None and not re.fullmatch(r"SIG[A-Z0-9]{1,12}", signal_name):
        raise AnswerInvalid("signal is not a signal name")
    return ExecResult(exit_code=exit_code, stdout=stdout, stderr=stderr,
                      timed_out=field(document, "timedOut", bool), truncated=truncated,
                      signal=signal_name,
                      duration_ms=float(field(document, "durationMs", (int, float))))


def parse_exec_result(document: dict[str, Any]) -> ExecResult:
    """POST exec's answer (ExecResult in web/openapi.json), checked. Pure."""
    return exec_end(document, exec_stream(document, "stdout"), exec_stream(document, "stderr"),
                    bool(document.get("stdoutTruncated") or document.get("stderrTruncated")))


@dataclass(frozen=True)
class ExecLine:
    """One line of a streamed exec answer (parse_exec_line): a piece of one stream's output
    (`stream`, `data`), how the command ended (`end`, without its output), or serve's error
    once the answer had begun (`error`)."""

    stream: Optional[str] = None
    data: bytes = b""
    end: Optional[ExecResult] = None
    error: Optional[ReployError] = None


def parse_exec_line(line: bytes) -> ExecLine:
    """One line of a streamed exec answer (application/x-ndjson), its newline included,
    checked as what a hostile session may have shaped: at most MAX_EXEC_LINE_BYTES, one strict
    JSON object (no duplicate key), exactly the fields of one kind of line, base64 that is
    base64. Pure."""
    if len(line) > MAX_EXEC_LINE_BYTES or not line.endswith(b"\n"):
        raise AnswerInvalid(f"a line of the exec stream is unended or longer than {MAX_EXEC_LINE_BYTES} bytes")
    try:
        document = wire.parse_strict_object(line[:-1], max_bytes=MAX_EXEC_LINE_BYTES)
    except wire.ProtocolError as e:
        raise AnswerInvalid(f"a line of the exec stream is not one JSON object: {e}") from None
    names = set(document)
    for stream in ("stdout", "stderr"):
        if names == {f"{stream}Base64"}:
            return ExecLine(stream=stream, data=base64_field(document, f"{stream}Base64"))
    if names == EXEC_END_FIELDS:
        truncated = field(document, "stdoutTruncated", bool) | field(document, "stderrTruncated", bool)
        return ExecLine(end=exec_end(document, b"", b"", truncated))
    if names in ({"error"}, {"error", "code"}):
        code = field(document, "code", str) if "code" in names else None
        return ExecLine(error=error_for(None, None if code is None else shown(code, 64),
                                        shown(field(document, "error", str))))
    raise AnswerInvalid("a line of the exec stream has other fields than one kind of line: "
                        + shown(", ".join(sorted(names)), 200))


def exec_body(argv: list[str], cwd: Optional[str], env: Optional[dict[str, str]],
              stdin: Optional[bytes], timeout_s: Optional[float],
              max_output_bytes: Optional[int], stdin_path: Optional[str] = None) -> dict[str, Any]:
    """The API's exec body. Pure. No timeout leaves serve's default (none, where serve has
    the harness API)."""
    if not argv or not all(isinstance(arg, str) for arg in argv):
        raise ValueError("exec: argv is a non-empty list of strings")
    body: dict[str, Any] = {"argv": list(argv)}
    if cwd:
        body["cwd"] = cwd
    if env:
        body["env"] = dict(env)
    if stdin is not None:
        body["stdinBase64"] = base64.b64encode(stdin).decode("ascii")
    if stdin_path is not None:
        body["stdinPath"] = stdin_path
    if timeout_s is not None:
        body["timeoutMs"] = max(1, int(timeout_s * 1000))
    if max_output_bytes is not None:
        body["maxOutputBytes"] = max_output_bytes
    return body


@dataclass(frozen=True)
class OutputChunk:
    """Bytes of a session's output log from `offset`; `next_offset` is where the next starts.
    `reset` says the cursor was ahead of the log (read again from 0)."""

    offset: int
    data: bytes
    next_offset: int
    reset: bool = False


def parse_sse_event(lines: list[str]) -> Optional[OutputChunk]:
    """One SSE event (its lines, without the blank one) as an OutputChunk; None for a comment
    or keepalive. Pure."""
    event, data = "message", ""
    for line in lines:
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            event = value
        elif name == "data":
            data += value
    if not data:
        return None
    try:
        document = wire.parse_strict_object(data.encode(), max_bytes=MAX_SSE_LINE_BYTES)
    except wire.ProtocolError as e:
        raise AnswerInvalid(f"a stream event is not one JSON object: {e}") from None
    if event == "reset":
        offset = field(document, "nextOffset", int)
        return OutputChunk(offset, b"", offset, reset=True)
    return OutputChunk(field(document, "offset", int), base64_field(document, "payloadBase64"),
                       field(document, "nextOffset", int))

# ============================================================================================
# I/O adapters: the token file, the connection pool
# ============================================================================================


def read_token(path: "os.PathLike[str] | str", must_own: bool = False, what: str = "token file",
               pattern: "re.Pattern[str]" = TOKEN_RE) -> str:
    """The token a token file holds (one line). CredentialError when the file cannot be read,
    is not a regular file (a FIFO or a device would hold the reader), is open to other users,
    belongs to another user (`must_own`: serve's own secret, which another user could
    otherwise plant where --token-file points), or holds anything else; the message never
    quotes the file. serve reads its --model-credential-file here too (`what`, `pattern`)."""
    try:  # non-blocking: a FIFO opens at once, and fstat then refuses it
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CredentialError(f"cannot read the {what} {path}: {e.strerror}") from None
    try:
        facts = os.fstat(fd)
        mode = facts.st_mode
        if not stat.S_ISREG(mode):
            raise CredentialError(f"the {what} {path} is not a regular file")
        if must_own and facts.st_uid != os.geteuid():
            raise CredentialError(f"the {what} {path} belongs to uid {facts.st_uid}, not to "
                                  "this user")
        if mode & 0o077:
            raise CredentialError(f"the {what} {path} is open to other users "
                                  f"(mode {stat.S_IMODE(mode):04o}); chmod 600 it")
        text = os.read(fd, MAX_TOKEN_FILE_BYTES + 1).decode("ascii", "replace")
    finally:
        os.close(fd)
    if not pattern.fullmatch(text.rstrip("\n")):
        low, high = re.findall(r"\d+", pattern.pattern.rpartition("{")[2])  # its {low,high}
        raise CredentialError(f"the {what} {path} does not hold one token ({low} to {high} of "
                              "A-Z a-z 0-9 . _ ~ + / = -, on one line)")
    return text.rstrip("\n")


def resolve_token(token: Optional[str], token_file: "os.PathLike[str] | str | None") -> Optional[str]:
    """The token to send: `token`, else `token_file`'s, else $REPLOY_TOKEN, else none."""
    if token is not None:
        return check_token(token, "the token given")
    if token_file is not None:
        return read_token(token_file)
    text = os.environ.get(TOKEN_ENV)
    return None if text is None else check_token(text, f"${TOKEN_ENV}")


class Connections:
    """Keep-alive HTTP/1.1 connections to one server. Not a thread per call: a call borrows
    an idle connection (or opens one) and gives it back once its answer is read whole; one
    that failed, or that the server will close, is dropped."""

    def __init__(self, server: str) -> None:
        url = urllib.parse.urlsplit(server)
        self.https = url.scheme == "https"
        self.host, self.port = url.hostname or "", url.port
        self.base = url.path.rstrip("/") + API_PREFIX
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def open(self, timeout_s: Optional[float]) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=timeout_s, blocksize=TRANSFER_CHUNK_BYTES)

    def borrow(self, timeout_s: Optional[float]) -> tuple[http.client.HTTPConnection, bool]:
        """(connection, reused)."""
        with self._lock:
            connection = self._idle.pop() if self._idle else None
        if connection is None:
            return self.open(timeout_s), False
        connection.timeout = timeout_s
        if connection.sock is not None:
            connection.sock.settimeout(timeout_s)
        return connection, True

    def give_back(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < POOL_IDLE_MAX:
                self._idle.append(connection)
                return
        connection.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes
    retry_after: Optional[str] = None  #: the Retry-After header, as sent


class RequestNotSent(Exception):
    """The connection was refused or reset before the request was sent: nothing ran."""


@dataclass(frozen=True)
class RetryPolicy:
    """When a call is tried again (see RETRY_TRIES). `RetryPolicy(tries=1)` never retries."""

    tries: int = RETRY_TRIES
    budget_s: float = RETRY_BUDGET_S

    def pause_s(self, tries_made: int, waited_s: float, retry_after: Optional[str]) -> Optional[float]:
        """How long to wait before the next try, or None: no next try. `retry_after` is a
        refusal's Retry-After (delay-seconds; a date or anything else is not retried), None
        for a request that was not sent."""
        if tries_made >= self.tries:
            return None
        if retry_after is None:
            pause = RETRY_FIRST_PAUSE_S * 2 ** (tries_made - 1)
        elif retry_after.isascii() and retry_after.isdigit() and len(retry_after) <= 6:
            pause = float(retry_after)
        else:
            return None
        return pause if waited_s + pause <= self.budget_s else None

# ============================================================================================
# The client
# ============================================================================================


class Client:
    """A `reploy serve` and its token. `server` defaults to $REPLOY_SERVER, else serve's
    default listen address; the token is `token`, else `token_file`'s (a regular file, 0600),
    else $REPLOY_TOKEN. Thread-safe; `close()` (or `with`) drops its connections."""

    def __init__(self, server: Optional[str] = None, token: Optional[str] = None,
                 token_file: "os.PathLike[str] | str | None" = None,
                 allow_plain_http: bool = False, retry: RetryPolicy = RetryPolicy()) -> None:
        self.server = check_server(server or os.environ.get(SERVER_ENV) or DEFAULT_SERVER,
                                   allow_plain_http)
        self.token = resolve_token(token, token_file)
        self.connections = Connections(self.server)
        self.retry = retry

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def close(self) -> None:
        self.connections.close()

    # -- HTTP ---------------------------------------------------------------------------

    def unexpected(self, status: Optional[int], why: str) -> ReployError:
        return ReployError(status, None, f"{self.server} did not answer as reploy serve does "
                                         f"({why}); is --server right?")

    def _headers(self, headers: Optional[dict[str, str]]) -> dict[str, str]:
        sent = dict(headers or {})
        if self.token is not None:
            sent["Authorization"] = f"Bearer {self.token}"
        return sent

    def request(self, method: str, path: str, body: Optional[bytes] = None,
                headers: Optional[dict[str, str]] = None,
                timeout_s: Optional[float] = CALL_TIMEOUT_S,
                max_answer_bytes: int = MAX_ANSWER_BYTES) -> Answer:
        """One call, its answer read whole (at most max_answer_bytes, and one byte more to
        tell a longer one), tried again while `self.retry` says so: only when nothing ran
        (RETRY_TRIES), so a create is never made twice."""
        waited_s = 0.0
        for tries_made in range(1, self.retry.tries + 1):
            try:
                answer = self._request_once(method, path, body, headers, timeout_s, max_answer_bytes)
            except RequestNotSent as e:
                pause_s = self.retry.pause_s(tries_made, waited_s, None)
                if pause_s is None:
                    raise ReployError(None, None, f"no answer from {self.server}: {e}") from None
            else:
                pause_s = (self.retry.pause_s(tries_made, waited_s, answer.retry_after)
                           if answer.status in RETRIED_STATUSES and answer.retry_after else None)
                if pause_s is None:
                    return answer
            time.sleep(pause_s)  # the server's own pace, or a backoff from a refused connection
            waited_s += pause_s
        raise AssertionError("unreachable: the last try returns or raises")

    def _request_once(self, method: str, path: str, body: Optional[bytes],
                      headers: Optional[dict[str, str]], timeout_s: Optional[float],
                      max_answer_bytes: int) -> Answer:
        """One call on a pooled connection, its answer read whole. A reused connection that
        the server had closed meanwhile (a stale keep-alive) is retried once on a new one:
        nothing was answered on it, so nothing ran."""
        target = self.connections.base + path
        for attempt in (1, 2):
            connection, reused = self.connections.borrow(timeout_s)
            try:
                try:
                    connection.request(method, target, body, self._headers(headers))
                except (ConnectionRefusedError, ConnectionResetError, BrokenPipeError) as e:
                    connection.close()
                    if reused and attempt == 1:
                        continue
                    raise RequestNotSent(str(e)) from None
                response = connection.getresponse()
                data = response.read(max_answer_bytes + 1)
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                connection.close()
                if reused and attempt == 1:
                    continue
                raise ReployError(None, None, f"no answer from {self.server}: {e}") from None
            except (OSError, http.client.HTTPException) as e:
                connection.close()
                if isinstance(e, TimeoutError):
                    raise ReployTimeoutError(None, "timeout", f"no answer from {self.server} "
                                             f"within {timeout_s} s") from None
                raise ReployError(None, None, f"no answer from {self.server}: {e}") from None
            if response.will_close or len(data) > max_answer_bytes:
                connection.close()
            else:
                self.connections.give_back(connection)
            return Answer(response.status, response.getheader("Content-Type", ""), data,
                          response.getheader("Retry-After"))
        raise AssertionError("unreachable")

    def document(self, answer: Answer, max_answer_bytes: int = MAX_ANSWER_BYTES) -> dict[str, Any]:
        """A JSON object answer, or ReployError."""
        if answer.content_type.partition(";")[0].strip().lower() != "application/json":
            content_type = shown(answer.content_type[:60]) or "none"
            raise self.unexpected(answer.status, f"HTTP {answer.status} with Content-Type {content_type}")
        if len(answer.body) > max_answer_bytes:
            raise self.unexpected(answer.status, f"an answer longer than {max_answer_bytes} bytes")
        try:
            return wire.parse_strict_object(answer.body, max_bytes=max_answer_bytes)
        except wire.ProtocolError as e:
            raise self.unexpected(answer.status, f"HTTP {answer.status}, {e}") from None

    def error(self, answer: Answer) -> ReployError:
        document = self.document(answer)
        if not isinstance(document.get("error"), str):
            return self.unexpected(answer.status, f"HTTP {answer.status} without an error message")
        reason = shown(document["error"])
        if answer.status == 401 and self.token is None:
            reason += " (this client sends $REPLOY_TOKEN or --token-file)"
        code = document.get("code")
        code = shown(code, 64) if isinstance(code, str) else None
        return error_for(answer.status, code, reason)

    def call(self, method: str, path: str, body: Optional[dict[str, Any]] = None,
             timeout_s: Optional[float] = CALL_TIMEOUT_S,
             max_answer_bytes: int = MAX_ANSWER_BYTES) -> Optional[dict[str, Any]]:
        """One JSON call: its answer's document (None for 204, a delete's), or the error."""
        data = wire.encode_compact(body) if body is not None else None
        answer = self.request(method, path, data, {"Content-Type": "application/json"}, timeout_s,
                              max_answer_bytes)
        if answer.status >= 400:
            raise self.error(answer)
        if answer.status == 204:
            return None
        return self.document(answer, max_answer_bytes)

    def checked(self, check: Callable[[], Any]) -> Any:
        """`check()`, with an AnswerInvalid as the one clear error about the server."""
        try:
            return check()
        except AnswerInvalid as e:
            raise self.unexpected(None, str(e)) from None

    def open_stream(self, method: str, path: str, headers: Optional[dict[str, str]] = None,
                    timeout_s: Optional[float] = TRANSFER_TIMEOUT_S,
                    body: Optional[bytes] = None) -> http.client.HTTPResponse:
        """A streamed answer (a download, SSE, a streamed exec) on a connection of its own,
        which closing the answer closes. An error status raises at once."""
        connection = self.connections.open(timeout_s)
        try:
            connection.request(method, self.connections.base + path, body, self._headers(headers))
            response = connection.getresponse()
        except (OSError, http.client.HTTPException) as e:
            connection.close()
            raise ReployError(None, None, f"no answer from {self.server}: {e}") from None
        if response.status >= 400:
            with response:
                data = response.read(MAX_ANSWER_BYTES + 1)
            connection.close()
            raise self.error(Answer(response.status, response.getheader("Content-Type", ""), data))
        return response

    def upload(self, path: str, source: BinaryIO, size_bytes: int, content_type: str,
               timeout_s: float = TRANSFER_TIMEOUT_S) -> dict[str, Any]:
        """PUT a streamed body and return the JSON answer, on a connection of its own. It
        still reads an answer the server sent before taking the whole body (a 507 or 413
        checked up front)."""
        connection = self.connections.open(timeout_s)
        headers = self._headers({"Content-Type": content_type, "Content-Length": str(size_bytes)})
        try:
            try:
                connection.request("PUT", self.connections.base + path, source, headers)
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused before the whole body was sent: its answer is waiting
            response = connection.getresponse()
            answer = Answer(response.status, response.getheader("Content-Type", ""),
                            response.read(MAX_ANSWER_BYTES + 1))
        except (OSError, http.client.HTTPException) as e:
            raise ReployError(None, None, f"no answer from {self.server}: {e}") from None
        finally:
            connection.close()
        if answer.status >= 400:
            raise self.error(answer)
        return self.document(answer)

    # -- sessions -----------------------------------------------------------------------

    def create(self, name: str = "reploy-client", workload_type: Optional[str] = None,
               deployment: Optional[str] = None, model: Optional[str] = None,
               labels: Optional[dict[str, str]] = None, ttl_seconds: Optional[int] = None,
               **extra: Any) -> "Session":
        """A new session (POST /sessions). `labels` find it again (sessions(labels=...)) and
        `ttl_seconds` has the reaper delete it once they pass, where serve takes them; `extra`
        are further fields of the create body in the API's spelling."""
        body: dict[str, Any] = {"name": name}
        for key, value in (("workloadType", workload_type), ("model", model),
                           ("deployment", deployment), ("labels", labels),
                           ("ttlSeconds", ttl_seconds)):
            if value is not None:
                body[key] = value
        body.update(extra)
        document = self.call("POST", "/sessions", body)
        return Session(self, self.checked(lambda: field(document, "id", str)), document)

    def session(self, session_id: str) -> "Session":
        """A handle on an existing session (no call is made)."""
        return Session(self, session_id, None)

    def sessions(self, labels: Optional[dict[str, str]] = None) -> list[dict[str, Any]]:
        """GET /sessions: the session objects, those carrying every label given."""
        query = urllib.parse.urlencode([("label", f"{k}={v}") for k, v in (labels or {}).items()])
        document = self.call("GET", "/sessions" + (f"?{query}" if query else ""))
        return self.checked(lambda: field(document, "sessions", list))

    def server_info(self) -> dict[str, Any]:
        """GET /server: workload types, deployments, the idle policy and the limits."""
        document = self.call("GET", "/server")
        assert document is not None
        return document


@contextlib.contextmanager
def naming(path: str) -> Iterator[None]:
    """A files call's error names the path it was asked for (the server names the first
    component it could not reach), as OSError's filename does."""
    try:
        yield
    except ReployError as e:
        if path in e.reason:
            raise
        raise type(e)(e.status, e.code, f"{path}: {e.reason}") from e


class Files:
    """A session's files. A path is the workspace's when relative, home's under `~/`, the
    container's when absolute (where serve takes it). The runtime user's permissions apply."""

    def __init__(self, session: "Session") -> None:
        self.session = session

    def read(self, path: str, limit_bytes: int = DEFAULT_READ_LIMIT_BYTES) -> bytes:
        """A regular file's bytes, read into memory: at most limit_bytes (by default
        DEFAULT_READ_LIMIT_BYTES; raise it for a larger file, or stream one with `reploy
        session cp`). A larger file is ReployError (code too_large), and the rest of it is
        never read: the download's connection is closed."""
        root, below = file_target(path)
        client = self.session.client
        with naming(path), client.open_stream("GET", file_route("files", self.session.id, root,
                                                                  below)) as response:
            if response.getheader("Content-Type", "").startswith("application/x-tar"):
                raise ReployIsADirectoryError(response.status, "is_a_directory",
                                              f"{path}: is a directory")
            announced = response.getheader("Content-Length")
            if announced is not None and announced.isdigit() and int(announced) > limit_bytes:
                raise ReployError(None, "too_large", f"{path}: {announced} bytes, more than "
                                  f"{limit_bytes} (Files.read's limit_bytes); nothing was read")
            try:
                data = response.read(limit_bytes + 1)
            except (OSError, http.client.HTTPException) as e:
                raise ReployError(response.status, None, f"{path}: the download ended early ({e!r})") from e
        if len(data) > limit_bytes:
            raise ReployError(None, "too_large", f"{path}: more than {limit_bytes} bytes (Files.read's "
                              "limit_bytes); the rest was not read")
        return data

    def write(self, path: str, data: "bytes | str", mode: Optional[int] = None) -> dict[str, Any]:
        """Makes or replaces one regular file (text is written as UTF-8); missing parent
        directories are made. The bytes are known up front, so their sha256 goes with them:
        the session commits the file only if what it staged has that digest."""
        import io

        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        return self.upload(path, io.BytesIO(raw), len(raw), mode=mode,
                           sha256=hashlib.sha256(raw).hexdigest())

    def upload(self, path: str, source: BinaryIO, size_bytes: int, tar: bool = False,
               mode: Optional[int] = None, sha256: Optional[str] = None) -> dict[str, Any]:
        """Streams `size_bytes` of `source` as one file, or (`tar`) as a tar merged into the
        directory at `path`; with `sha256`, committed only if the body has that digest."""
        root, below = file_target(path)
        with naming(path):
            return self.session.client.upload(
                file_route("files", self.session.id, root, below, mode, sha256), source, size_bytes,
                "application/x-tar" if tar else "application/octet-stream")

    def list(self, path: str = "") -> dict[str, Any]:
        """The entry at `path` and, for a directory, its entries (FileListing)."""
        root, below = file_target(path)
        with naming(path):
            document = self.session.client.call("GET", file_route("list", self.session.id, root, below))
        assert document is not None
        return document

    def entry(self, path: str) -> Optional[dict[str, Any]]:
        """The entry at `path` ({name, type, size, mode, mtime}), or None when there is none."""
        try:
            listing = self.list(path)
        except FileNotFoundError:
            return None
        return self.session.client.checked(lambda: checked_entry(field(listing, "entry", dict)))


def checked_entry(entry: dict[str, Any]) -> dict[str, Any]:
    field(entry, "type", str)
    mode = field(entry, "mode", int)
    if not 0 <= mode <= 0o7777:
        raise AnswerInvalid("entry mode is not a permission mode")
    return entry


class Session:
    """One managed session. As a context manager, it is deleted on exit."""

    def __init__(self, client: Client, session_id: str, document: Optional[dict[str, Any]]) -> None:
        self.client, self.id, self.document = client, session_id, document
        self.files = Files(self)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *_: Any) -> None:
        self.delete()

    def _call(self, method: str, verb: str = "", body: Optional[dict[str, Any]] = None,
              timeout_s: Optional[float] = CALL_TIMEOUT_S,
              max_answer_bytes: int = MAX_ANSWER_BYTES) -> Optional[dict[str, Any]]:
        return self.client.call(method, f"/sessions/{self.id}{verb}", body, timeout_s,
                                max_answer_bytes)

    def get(self) -> dict[str, Any]:
        document = self._call("GET")
        assert document is not None
        self.document = document
        return document

    def delete(self) -> None:
        """Deletes the session; one already gone is not an error."""
        try:
            self._call("DELETE")
        except ReployError as e:
            if e.status != 404:
                raise

    def exec(self, argv: list[str], cwd: Optional[str] = None, env: Optional[dict[str, str]] = None,
             stdin: "bytes | str | None" = None, timeout: Optional[float] = None,
             on_stdout: Optional[Callable[[bytes], None]] = None,
             on_stderr: Optional[Callable[[bytes], None]] = None,
             max_output_bytes: Optional[int] = None) -> ExecResult:
        """Runs argv (no shell unless you run one) as the runtime user, in the workspace or
        `cwd`, and answers once it ends. `timeout` in seconds (None: serve's default). Given
        either callback, serve streams the answer (`stream`) and each callback gets its
        stream's bytes, in this thread, as they come (in pieces of any size); the result
        holds them too. `max_output_bytes` caps each stream (None: serve's default, 1 MiB; at
        most 16 MiB), and the answer accepted is sized from it (exec_answer_limit). Closing
        the connection (a callback raising, too) kills the command."""
        data = stdin.encode("utf-8") if isinstance(stdin, str) else stdin
        timeout_s = None if timeout is None else timeout + EXEC_GRACE_S

        def run(inline: Optional[bytes], stdin_path: Optional[str] = None) -> ExecResult:
            body = exec_body(argv, cwd, env, inline, timeout, max_output_bytes, stdin_path)
            if on_stdout is not None or on_stderr is not None:
                return self._exec_streamed(body, timeout_s, max_output_bytes, on_stdout, on_stderr)
            document = self._call("POST", "/exec", body, timeout_s, exec_answer_limit(max_output_bytes))
            return self.client.checked(lambda: parse_exec_result(document or {}))

        if data is not None and len(data) > MAX_INLINE_STDIN_BYTES:
            return self._exec_from_file(data, lambda path: run(None, path))
        return run(data)

    def _exec_streamed(self, body: dict[str, Any], timeout_s: Optional[float],
                       max_output_bytes: Optional[int], on_stdout: Optional[Callable[[bytes], None]],
                       on_stderr: Optional[Callable[[bytes], None]]) -> ExecResult:
        """An exec answered as its command runs (serve's NDJSON lines, parse_exec_line): each
        piece of output to its callback as it comes, and kept up to the cap (more is serve's
        error), so that the result is the whole answer's."""
        callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        kept = {name: bytearray() for name in callbacks}
        cap = DEFAULT_EXEC_OUTPUT_BYTES if max_output_bytes is None else max_output_bytes
        response = self.client.open_stream(
            "POST", f"/sessions/{self.id}/exec", {"Content-Type": "application/json"}, timeout_s,
            wire.encode_compact({**body, "stream": True}))
        with response:
            content_type = response.getheader("Content-Type", "")
            if content_type.partition(";")[0].strip().lower() != "application/x-ndjson":
                raise self.client.unexpected(response.status, f"HTTP {response.status} with "
                                             f"Content-Type {shown(content_type[:60]) or 'none'}")
            while True:
                try:
                    raw = response.readline(MAX_EXEC_LINE_BYTES + 1)
                except TimeoutError:
                    raise ReployTimeoutError(None, "timeout", f"no answer from {self.client.server} "
                                             f"within {timeout_s} s") from None
                except (OSError, http.client.HTTPException) as e:
                    raise ReployError(None, None, f"the exec stream from {self.client.server} "
                                      f"broke: {e}") from None
                if not raw:
                    raise self.client.unexpected(response.status, "an exec stream that ended "
                                                 "before its command did")
                line = self.client.checked(lambda: parse_exec_line(raw))
                if line.error is not None:
                    raise line.error
                if line.end is not None:
                    return replace(line.end, stdout=bytes(kept["stdout"]), stderr=bytes(kept["stderr"]))
                assert line.stream is not None
                if len(kept[line.stream]) + len(line.data) > cap:
                    raise self.client.unexpected(None, f"more {line.stream} than the cap of {cap} bytes")
                kept[line.stream] += line.data
                callback = callbacks[line.stream]
                if callback is not None and line.data:
                    callback(line.data)

    def _exec_from_file(self, data: bytes, run: Callable[[str], ExecResult]) -> ExecResult:
        """An exec whose stdin is too large for its request: uploaded to a private file of
        the workspace first (0600), `run` with it as stdinPath, removed after."""
        path = STDIN_FILE_PREFIX + secrets.token_hex(8)
        self.files.write(path, data, mode=0o600)
        try:
            return run(path)
        finally:
            self._call("POST", "/exec", exec_body(["rm", "-f", "--", path], None, None, None,
                                                  EXEC_GRACE_S, None))

    def read(self, offset: int = 0, wait_ms: int = 0) -> OutputChunk:
        """The output log from `offset` to its end (a cursor past the end answers empty, with
        the log's length as next_offset); `wait_ms` waits at the end for more."""
        body = {"offset": offset, **({"waitMs": wait_ms} if wait_ms else {})}
        document = self._call("POST", "/read", body)
        return self.client.checked(lambda: OutputChunk(
            offset, base64_field(document or {}, "payloadBase64"),
            field(document, "nextOffset", int)))

    def stream(self, offset: int = 0) -> Iterator[OutputChunk]:
        """The output from `offset` on, as it comes (SSE), until the caller stops iterating or
        the session ends; a `reset` chunk says the cursor was ahead of the log."""
        response = self.client.open_stream("GET", f"/sessions/{self.id}/stream?offset={offset}",
                                           {"Accept": "text/event-stream"}, timeout_s=None)
        with response:
            lines: list[str] = []
            while raw := response.readline(MAX_SSE_LINE_BYTES):
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if line:
                    lines.append(line)
                    continue
                chunk = self.client.checked(lambda: parse_sse_event(lines))
                lines = []
                if chunk is not None:
                    yield chunk

    def write(self, text: str) -> dict[str, Any]:
        """Types `text` into the shell's PTY (or sends one prompt to an agent workload)."""
        document = self._call("POST", "/write", {"payload": text})
        assert document is not None
        return document

    def message(self, text: str) -> dict[str, Any]:
        """A prompt (agent) or one line (shell), queued while the workload is busy."""
        document = self._call("POST", "/message", {"text": text})
        assert document is not None
        return document

    def snapshot(self) -> dict[str, Any]:
        """Checkpoints the session and removes its container (any access restores it)."""
        document = self._call("POST", "/snapshot", {})
        assert document is not None
        return document

    def status(self) -> dict[str, Any]:
        document = self._call("GET", "/status")
        assert document is not None
        return document

    def interrupt(self) -> dict[str, Any]:
        document = self._call("POST", "/interrupt", {})
        assert document is not None
        return document

# ============================================================================================
# Copies in and out (`reploy session cp`)
# ============================================================================================


def copy_limit_bytes(session: Session) -> int:
    """The most `session cp` takes out of a session before it stops: the session's own disk
    quota (its `diskMib`; from a serve older than that, GET /server's limits.sessionDiskBytes),
    plus the tar's own overhead, and never more than the agent's bound on one download
    (MAX_TRANSFER_BYTES)."""
    import agent as agent_role

    def quota() -> Optional[int]:
        document = session.get()
        if "diskMib" in document:
            disk_mib = field(document, "diskMib", int)
            if disk_mib < 0:
                raise AnswerInvalid("the session's diskMib is negative")
            return disk_mib * 1024 * 1024
        limits = field(session.client.server_info(), "limits", dict)
        if "sessionDiskBytes" not in limits:
            return None
        value = field(limits, "sessionDiskBytes", int, nullable=True)
        if value is not None and value < 0:
            raise AnswerInvalid("limits sessionDiskBytes is negative")
        return value

    quota_bytes = session.client.checked(quota)
    if quota_bytes is None:
        return agent_role.MAX_TRANSFER_BYTES
    return min(quota_bytes + agent_role.MAX_ARCHIVE_ENTRIES * TAR_BYTES_PER_ENTRY,
               agent_role.MAX_TRANSFER_BYTES)


def copy_bounded(source: Any, sink: Any, limit_bytes: int, what: str) -> int:
    """Copies until the end of `source`; ReployError past limit_bytes (the caller removes what
    was written). Returns the bytes copied."""
    copied = 0
    while chunk := source.read(TRANSFER_CHUNK_BYTES):
        copied += len(chunk)
        if copied > limit_bytes:
            raise ReployError(None, "too_large", f"{what} exceeds {limit_bytes} bytes; nothing was kept")
        sink.write(chunk)
    return copied


#: What a download is, by the Content-Type serve sets from what the agent opened for it (a
#: file's bytes or a directory's tar), as `session cp` names it.
DOWNLOAD_KINDS = {"application/octet-stream": "file", "application/x-tar": "tree"}
KIND_NAMES = {"file": "a file", "tree": "a directory"}


def download_kind(content_type: str, source: str) -> str:
    """What a download carries, from its own response: never from an earlier listing, which
    the session may have made untrue since (a directory swapped with a file)."""
    kind = DOWNLOAD_KINDS.get(content_type.partition(";")[0].strip().lower())
    if kind is None:
        raise ReployError(None, None, f"{source}: the download is {shown(content_type[:60])!r}, "
                                      "neither a file nor a directory's tar")
    return kind


def receive_file(response: Any, target: Path, mode: int, limit_bytes: int, source: str) -> int:
    """A file's download, spooled beside `target` (at most limit_bytes) and renamed onto it
    with a sane `mode`; nothing is left on any error. Returns its size."""
    import agent as agent_role

    spool_fd, spool_name = tempfile.mkstemp(dir=target.parent, prefix=".reploy-cp-")
    try:
        with os.fdopen(spool_fd, "w+b") as spool:
            copied = copy_bounded(response, spool, limit_bytes, f"{source}: the download")
            os.fchmod(spool.fileno(), agent_role.sane_mode(mode, directory=False))
            spool.flush()
            os.replace(spool_name, target)
            return copied
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(spool_name)


def receive_tree(response: Any, target: Path, limit_bytes: int, source: str) -> int:
    """A directory's download: an uncompressed tar (nothing a session sends is decompressed),
    spooled beside `target` (at most limit_bytes), vetted whole like any untrusted archive
    (agent.py's rules, its members' sizes summed against limit_bytes, a sparse file at its full
    size) before its first byte is written, then merged in. Returns the entries written."""
    import agent as agent_role

    spool_fd, spool_name = tempfile.mkstemp(dir=target.parent, prefix=".reploy-cp-")
    try:
        with os.fdopen(spool_fd, "w+b") as spool:
            copy_bounded(response, spool, limit_bytes, f"{source}: the download")
            return agent_role.extract_upload(spool, target.parent, (target.name,),
                                             f"{Path(spool_name).name}.d", max_bytes=limit_bytes,
                                             compressed=False)
    except agent_role.AgentError as e:
        raise ReployError(None, None, f"{source}: {e}") from e
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(spool_name)


def copy_from_session(session: Session, root: str, path: str, local: str) -> dict[str, Any]:
    """Session -> here. A file is written under a temporary name and renamed; a directory comes
    as a tar, vetted and merged in (receive_tree), so a refused archive writes nothing. The
    kind is the download's own (download_kind); a listing that said otherwise means the session
    changed the path meanwhile, which is an error. What is spooled is bounded by
    copy_limit_bytes() and removed on any error, SIGINT or SIGTERM. `-` as `local` is stdout."""
    client = session.client
    entry = session.files.entry(path if root == "workspace" else f"~/{path}")
    source = f"{session.id}:{path}"
    if entry is None:
        raise ReployFileNotFoundError(404, "not_found", f"{source}: no such file or directory")
    listed = "tree" if entry["type"] == "directory" else "file"
    limit_bytes = copy_limit_bytes(session)
    try:
        with client.open_stream("GET", file_route("files", session.id, root, path)) as response:
            kind = download_kind(response.getheader("Content-Type", ""), source)
            if kind != listed:
                raise ReployError(None, None, f"{source} changed while it was copied: listed as "
                                              f"{KIND_NAMES[listed]}, downloaded as {KIND_NAMES[kind]}; "
                                              "nothing was written")
            announced = response.getheader("Content-Length")
            if announced is not None and (not announced.isdigit() or int(announced) > limit_bytes):
                raise ReployError(None, "too_large",
                                  f"{source}: the download announces more than {limit_bytes} bytes")
            if local == "-":
                copy_bounded(response, sys.stdout.buffer, limit_bytes, f"{source}: the download")
                sys.stdout.buffer.flush()
                return {"source": source, "destination": "-", "kind": kind}
            target = Path(local)
            if target.is_dir():
                target = target / (Path(path).name or root)
            if not target.parent.is_dir():
                raise ReployFileNotFoundError(None, "not_found", f"{target.parent}: no such directory")
            if kind == "file":
                return {"source": source, "destination": str(target), "kind": kind,
                        "bytes": receive_file(response, target, entry["mode"], limit_bytes, source)}
            return {"source": source, "destination": str(target), "kind": kind,
                    "entries": receive_tree(response, target, limit_bytes, source)}
    except http.client.HTTPException as e:  # a tar the server had to end short, say
        raise ReployError(None, None, f"{source}: the download ended early ({e!r})") from e


def copy_to_session(local: str, session: Session, root: str, path: str) -> dict[str, Any]:
    """Here -> session. A file is streamed as it is; a directory (or `-`, a tar on stdin) is
    spooled as a tar first, since an upload carries its Content-Length."""
    import agent as agent_role

    mode = None
    source: BinaryIO
    with tempfile.TemporaryFile(prefix="reploy-cp-") as spool:
        if local == "-":
            copy_bounded(sys.stdin.buffer, spool, agent_role.MAX_TRANSFER_BYTES, "the tar on stdin")
            source, kind = spool, "tree"
        else:
            local_path = Path(local)
            if local_path.is_dir():
                dir_fd = os.open(local_path, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    agent_role.write_tree_tar(dir_fd, spool)
                finally:
                    os.close(dir_fd)
                source, kind = spool, "tree"
            elif local_path.is_file():
                source, kind = open(local_path, "rb"), "file"
                mode = stat.S_IMODE(os.fstat(source.fileno()).st_mode)
            else:
                raise ReployFileNotFoundError(None, "not_found", f"{local}: no such file or directory")
            existing = session.files.entry(path if root == "workspace" else f"~/{path}")
            if existing is not None and existing["type"] == "directory":
                path = f"{path.rstrip('/')}/{local_path.resolve().name}".lstrip("/")
        with source:
            size_bytes = source.seek(0, os.SEEK_END)
            source.seek(0)
            content_type = "application/x-tar" if kind == "tree" else "application/octet-stream"
            result = session.client.upload(file_route("files", session.id, root, path, mode), source,
                                           size_bytes, content_type)
    return {"source": local, "destination": f"{session.id}:{path}", "kind": kind,
            "bytes": size_bytes, "result": result}
