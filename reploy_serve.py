#!/usr/bin/env python3
"""reploy_serve: the control plane of Reploy's managed sessions (seed 002).

  reploy_serve.py serve --workload-dir DIR ...   REST API, SSE and web UI on one port
  reploy_serve.py session ACTION ...             one call to that API, one JSON document

`python3 reploy.py serve ...` and `python3 reploy.py session ...` run this file: the host hands
them over without importing it.

Peers:
  * reploy.py, the host role: this file imports its Docker adapter (DockerBackend, the sandboxed
    ContainerSpec), its deployments (load_deployment), its durations and its helpers for
    directories a container can write. The host never imports this file.
  * agent.py, the data-plane agent inside each session's container, reached only through its
    control socket (STATE/sessions/ID/agent/control.sock); `session cp` also reuses its archive
    rules (vetting, extraction, the tree writer).
  * mkfs.ext4, mount and umount, for each session's disk (see "the session disks").
  * reploy_session_client.py for the project's one strict JSON parser and compact encoder, and
    reploy_watchdog.py for process identities and link-safe removal.
  * web/, the UI's plain files, served from the same port; web/openapi.json documents the API.

Theory of operation. Each session is one container from a workload deployment's current
generation, running agent.py (as root keeping SETUID, SETGID, SETPCAP and KILL, the workload as the
deployment's runtime user) with the session's own disk bind-mounted; `serve` talks to the
agent only through the control socket on that disk and treats every answer as hostile input
(checked field by field before any of it reaches a response, a header or the UI; every wait
on an agent has a deadline and ends with its client).
Every session record lives in SQLite under --state-dir, and every change of state is a
compare-and-swap under a lease, so several `serve` processes can share one state dir without
ever acting twice on one session. States: active -> idle (container paused) -> snapshot
(checkpoint archive kept, container removed); any access brings a session back. A reaper
thread applies the idle policy; an HTTP server thread per request does the rest. Only the
user drives it: a per-state-dir token sent as Bearer (never a cookie), a Host allowlist, an
Origin check and JSON-only bodies (see "who may drive serve" below); every API response is
sandboxed so that nothing a session chose can run as a page in serve's origin.

Machine output is one JSON document on stdout; human text goes to stderr.

Reading order: constants and errors, the session state machine (pure), the reaper's decision
(pure), the store (SQLite with compare-and-swap and leases), request bodies and responses
(pure), the SSE encoder (pure), who may drive serve (pure), the agent's answers (pure: one
parser per answer family), the agent's control socket (client side), the session disks, the
Docker orchestration, the HTTP adapter, then `serve`, the `session` client and the CLI.
"""

from __future__ import annotations

import argparse
import base64
import codecs
import concurrent.futures
import contextlib
import ctypes
import datetime
import enum
import errno
import fcntl
import functools
import hmac
import http.client
import http.server
import importlib.util
import io
import ipaddress
import json
import math
import os
import py_compile
import re
import secrets
import select
import shutil
import signal
import socket
import sqlite3
import ssl
import stat
import subprocess
import sys
import termios
import threading
import time
import tty
import urllib.parse
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, Callable, Generator, Iterable, Iterator, Optional, Sequence, cast

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import agent as agent_role  # noqa: E402  (the data plane; `session cp` reuses its archive rules)
import reploy_client as client_role  # noqa: E402  (the Python client: `reploy session`, tokens)
import reploy_session_client as wire  # noqa: E402  (the strict JSON parser and encoder)
import reploy_watchdog  # noqa: E402  (process identities, link-safe removal)
from reploy import (  # noqa: E402  (the host role: Docker adapter, deployments, durations)
    CONTAINER_HOME, EXIT_FAILED, EXIT_FOR_SIGNAL, EXIT_OK, EXIT_USAGE, LABEL_DEPLOYMENT,
    LABEL_GENERATION, LABEL_ROLE, LABEL_RUN, ArgumentParser, BackendError, BlueprintError,
    ContainerPathError, ContainerSpec, Deployment, DeploymentError, DockerBackend, ImageGone, Mount,
    ReployError, Runtime, UsageError, _NAME, emit, format_duration, load_deployment, log,
    open_regular_file, opened_dir, parse_duration_ms, regular_file_size, run_as_process,
    split_command,
)

# ============================================================================================
# Constants and errors
# ============================================================================================

#: Reploy's release: one value in all five role files (a test checks), named by the offline bundle.
__version__ = "0.1.0"

SERVE_SCHEMA = "reploy-serve-v1"
API_PREFIX = "/api/v1"
WEB_DIR = Path(__file__).resolve().parent / "web"
AGENT_SOURCE = Path(__file__).resolve().parent / "agent.py"
#: Where agent.py (read-only) and the session directory (read-write) appear in a container.
AGENT_MOUNT = "/opt/reploy/agent.py"
#: agent.py's bytecode, compiled by serve (compile_agent_bytecode) into STATE/bytecode and
#: mounted read-only where the container's interpreter looks for it: the __pycache__ beside
#: AGENT_MOUNT. Compiling 6,000 lines at each start costs time and ~18 MiB of heap that the
#: interpreter keeps for the session's life.
AGENT_BYTECODE_MOUNT = "/opt/reploy/__pycache__"
#: How a session's container starts the agent: isolated (-I), without site (-S), and imported
#: as a module, not run as a script: only an import looks for bytecode.
AGENT_COMMAND = ("python3", "-I", "-S", "-c",
                 "import sys; sys.path.insert(0, '/opt/reploy'); import agent; sys.exit(agent.main())")
SESSION_MOUNT = "/mnt/reploy-session"
MANAGED_ROLE = "managed"
#: Names the state dir whose sessions a container belongs to, so each `serve` sweeps only its own.
LABEL_STATE_DIR = "io.reploy.serve.state-dir"
#: The agent's control socket and output log in its own dir, STATE/sessions/ID/agent (agent.py
#: names them; ServeConfig.agent_dir is where).
SOCKET_NAME = agent_role.SOCKET_NAME
OUTPUT_LOG_NAME = agent_role.LOG_NAME
#: What a snapshot's checkpoint archives: what the container's removal loses. The workspace
#: and the output log stay on the session's disk, so they are not archived twice.
SNAPSHOT_INCLUDES = ("home",)
#: Each session's disk: an ext4 image of --session-disk-mib (see "the session disks").
DEFAULT_SESSION_DISK_MIB = 2048
MIN_SESSION_DISK_MIB = 64
MAX_SESSION_DISK_MIB = 16 * 1024 * 1024
#: ext4 keeps this share of a session's disk for root: the agent's own files (log, outbox,
#: checkpoints) still grow when the workload has filled the rest.
SESSION_DISK_RESERVED_PERCENT = 5
#: What the host may hold for a session beyond its image's size: the host file system's own
#: blocks for the image file (extent tree). Documented in the README; tests measure it.
SESSION_DISK_MARGIN_MIB = 1
SESSION_DISK_TOOL_TIMEOUT_S = 120.0
#: Serializes admission (the free-space check and the new image) among the serves of a state dir.
ADMISSION_LOCK_NAME = ".admission.lock"
#: How long a removal waits for the kernel to let a disk's loop device go, looking this often.
LOOP_DETACH_TIMEOUT_S = 30.0
LOOP_DETACH_POLL_S = 0.01
#: How long an unmount refused as busy is tried again, this often. serve's own threads hold a
#: file of a session's disk for moments (the output follower's read of the log, a read's
#: descriptor, an agent call's directory), and one may be at it as a delete unmounts; the
#: follower, for one, learns of the delete only at its next state check (SSE_STATE_CHECK_S).
UNMOUNT_BUSY_TIMEOUT_S = 5.0
UNMOUNT_BUSY_POLL_S = 0.01
#: What umount says (LC_ALL=C) when the kernel refused it as busy (EBUSY).
UMOUNT_BUSY = "target is busy"
#: Test only: a serve started with this variable naming a DiskStep stops itself (SIGSTOP) when a
#: session's disk reaches that step, so a test can SIGKILL it exactly there (tests/test_disk_crashes.py).
DISK_STEP_STOP_ENV = "REPLOY_TEST_STOP_AT_DISK_STEP"
#: mkfs.ext4, mount and umount run with this environment only.
SESSION_DISK_TOOL_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}

DEFAULT_LISTEN = "127.0.0.1:8080"
DEFAULT_IDLE_AFTER_MS = 15 * 60_000
DEFAULT_SNAPSHOT_AFTER_MS = 60 * 60_000
#: The bound on work the reaper respects: no access for this long, and a busy or watched session
#: is paused anyway (see decide_reap).
DEFAULT_MAX_BUSY_MS = 24 * 60 * 60_000
#: A snapshot that failed leaves its session paused, and the reaper tries it again only after
#: --snapshot-after x 2^(failures - 1), at most this (snapshot_retry_after_s): each try writes
#: at most the archive the agent measured first (or nothing when it refused), so what retries
#: write shrinks by half every time they keep failing.
SNAPSHOT_RETRY_MAX_S = 24 * 3600.0
#: A failure's reason, as the record keeps it and the API shows it (lastFailure).
MAX_FAILURE_CHARS = 2000
DEFAULT_SSE_KEEPALIVE_MS = 15_000
DEFAULT_MAX_SESSIONS = 64
#: HTTP request threads kept waiting for a new connection once theirs ended (RequestThreads).
SPARE_REQUEST_THREADS = 8
#: Connections the kernel queues before serve accepts them (listen's backlog; the kernel caps
#: it at net.core.somaxconn). socketserver's 5 reset a burst of creates, each on its own
#: connection (an eval starting its samples): the accept loop takes them far faster than a
#: create is served, so a queue that holds a burst costs nothing.
LISTEN_BACKLOG = 1024
#: What a create refused at --max-sessions tells its client to wait (Retry-After): a session
#: ends when its user deletes it, so this is a polling pace, not a promise.
LIMIT_RETRY_AFTER_S = 30
DEFAULT_MIN_FREE_MIB = 64
#: A lease outlives any one lifecycle step; long waits renew it.
LEASE_TTL_S = 60.0
#: A stream's viewer row in the store: renewed this often while the stream is open, and gone
#: this long after its `serve` died without removing it.
VIEWER_RENEW_S = 10.0
VIEWER_TTL_S = 30.0
#: How long an access waits for another operation's lease before answering 409.
LEASE_WAIT_S = 45.0
LEASE_POLL_S = 0.025
#: From container start to the agent answering `status`.
AGENT_READY_TIMEOUT_S = 30.0
AGENT_READY_POLL_S = 0.02
#: While it waits, how often a launch renews its lease and looks whether the container exited;
#: first only this long after the start, so that a prompt agent costs no Engine call.
AGENT_READY_CHECK_S = 0.5
#: The agent bounds every request at 5 s (docs/agent.md); we outwait it.
AGENT_CALL_TIMEOUT_S = 10.0
#: A kept agent connection (AgentConnections) is reused only while idle for less than this: half
#: the agent's own bound on an idle client, so the agent never closes one as serve sends on it.
AGENT_KEPT_IDLE_S = agent_role.CLIENT_IDLE_TIMEOUT_S / 2
AGENT_KEPT_PER_SESSION = 4
AGENT_MAX_RESPONSE_BYTES = 4 * 1024 * 1024
#: JSON bodies: the wire bound and how long a client may take to send one.
MAX_BODY_BYTES = 8 * 1024 * 1024
#: The most of one API answer `reploy session` reads: the largest serve sends (an exec's two
#: 4 MiB streams as escaped text and base64, a listing of MAX_LIST_ENTRIES) fits.
MAX_ANSWER_BYTES = 128 * 1024 * 1024
BODY_READ_TIMEOUT_S = 30.0
#: A message or an agent session's prompt, UTF-8 (the agent's own bound); longer than one agent
#: request line holds, it goes to the agent in parts of MAX_MESSAGE_PART_BYTES.
MAX_PAYLOAD_BYTES = agent_role.MAX_PROMPT_BYTES
MAX_MESSAGE_PART_BYTES = agent_role.MAX_MESSAGE_PART_BYTES
#: A shell write has no bound of its own (seed 002: the body's 8 MiB); it reaches the agent in
#: parts of this many bytes, each travelling as base64 in the agent's one request line. A part
#: the terminal's input buffer cannot take yet is offered again until
#: the terminal has taken nothing for SHELL_INPUT_STALL_S.
MAX_WRITE_PART_BYTES = agent_role.MAX_WRITE_PART_BYTES
SHELL_INPUT_STALL_S = 10.0
SHELL_INPUT_POLL_S = 0.05
#: The agent's `read` is bounded per call (its bytes travel in its answer); `read` on the API
#: asks `read_fd` instead, whose window may span the log (serve preads it from the descriptor).
MIN_READ_BYTES = agent_role.MIN_READ_BYTES
MAX_READ_BYTES = agent_role.MAX_READ_BYTES
MAX_LOG_WINDOW_BYTES = agent_role.MAX_LOG_WINDOW_BYTES
MAX_READ_WAIT_MS = agent_role.MAX_READ_WAIT_MS
#: One API read answers everything from its offset to the log's end, and the agent bounds the
#: log by a cap (serve starts it with its defaults): so is one answer. An agent claiming a longer
#: log is refused.
LOG_CAP_BYTES = {"shell": agent_role.DEFAULT_SHELL_LOG_CAP_BYTES,
                 "agent": agent_role.DEFAULT_CUMULATIVE_CAP_BYTES}
#: Byte offsets are seed 002's int64.
MAX_OFFSET = 2**63 - 1
#: A text payload stands in this one byte for each byte of shell output that is not UTF-8, so
#: its UTF-8 length stays the cursor's advance (see text_payload).
SUBSTITUTE_CHAR = "?"
#: A read's answer is encoded and sent this many bytes of output at a time (a multiple of 3, so
#: base64 pieces join).
READ_SLICE_BYTES = 3 * 256 * 1024
#: One SSE output event carries at most this many payload bytes.
SSE_CHUNK_BYTES = 64 * 1024
#: How often a session's output follower looks at the log's length when no agent wakes it, and
#: at its session's state (it and its streams end once the session's container is gone:
#: deleted or snapshotted); a stream waiting for output looks at its client as often.
SSE_POLL_S = 0.02
SSE_STATE_CHECK_S = 1.0
#: After this many slices in a row (the log grew each time the follower looked), the follower
#: waits one SSE_POLL_S between slices, so a busy session's output goes out in fuller events.
SSE_BURST_EVENTS = 4
#: How long the follower's wake-up long-poll waits in the agent before it looks again.
SSE_LONG_POLL_MS = 1000

# Fair share (see "fair share" in README.md): what one session may take of the host's CPU and disk
# time, and of serve's stream readers.
#: Each session container's CPU bound (--session-cpus, the Engine's NanoCpus): a session that
#: burns every core it can gets this much, and the rest of a 2-core host stays for the others.
DEFAULT_SESSION_CPUS = 1.0
MIN_SESSION_CPUS = 0.01  #: the Engine's own smallest NanoCpus
#: Each session container's block-I/O weight (the Engine's BlkioWeight, 10..1000, its default
#: 500): sessions share the disk's time evenly among themselves and yield to the host's own
#: processes (serve's store). An engine whose kernel has no blkio weight discards it and says so.
SESSION_BLKIO_WEIGHT = 100
#: SSE readers one serve takes: of one session's stream, and of all streams. One more is 503.
DEFAULT_MAX_SESSION_READERS = 8
DEFAULT_MAX_READERS = 32
#: A stream reader that takes nothing for this long while its socket's buffer is full is dropped:
#: what it has not read is never held by serve, only by the kernel's send buffer, bounded here.
SSE_STALL_S = 10.0
SSE_SEND_BUFFER_BYTES = 256 * 1024
#: A session's output follower keeps at most this many of the log's newest bytes for its readers
#: (LogFanout); a reader further behind reads the log file its own way until it is back within.
FANOUT_WINDOW_BYTES = 1024 * 1024
#: A reader refused for the bounds is told to come back after this long.
READERS_RETRY_AFTER_S = 5
#: exec: the HTTP call answers once the command ends; meanwhile each agent long-poll waits this
#: long (under the agent's 5 s handler bound), and the client's connection is checked between.
EXEC_POLL_MS = 4000
#: exec with `stream`: each agent long-poll waits at most this long (the agent answers a
#: running command's output only when its wait ends), so output reaches the client within it.
EXEC_STREAM_POLL_MS = 250
#: Deadlines of the loops that wait on an agent (see "the harness verbs"): an exec's result is
#: awaited for its own timeout plus this (the agent kills it at its timeout); a listing's pages
#: for this long; an upload's commit for a base plus its size at a slow disk's rate; a
#: download's next byte, and an exec answer's turn and next page, for this long.
EXEC_END_GRACE_S = 30.0
LIST_TIMEOUT_S = 60.0
UPLOAD_COMMIT_BASE_S = 120.0
UPLOAD_COMMIT_MIN_BYTES_PER_S = 16 * 1024 * 1024
DOWNLOAD_STALL_S = 60.0
#: The least time between two polls of one loop when the previous one brought nothing (the
#: agent's own long-polls take up to 4 s; only a hostile agent answers "not yet" at once).
AGENT_POLL_MIN_S = 0.25
#: The agent's exec and transfer bounds (docs/agent.md), which it alone defines: stdin travels
#: in one request line, output is kept per stream up to the cap; files move through descriptors
#: the agent's answers carry (AnswerDescriptor), in pieces of COPY_CHUNK_BYTES.
MAX_EXEC_TIMEOUT_MS = agent_role.MAX_EXEC_TIMEOUT_MS
MAX_EXEC_STDIN_BYTES = agent_role.MAX_EXEC_STDIN_BYTES
DEFAULT_EXEC_OUTPUT_BYTES = agent_role.DEFAULT_EXEC_OUTPUT_CAP_BYTES
MAX_EXEC_OUTPUT_BYTES = agent_role.MAX_EXEC_OUTPUT_CAP_BYTES
COPY_CHUNK_BYTES = 4 * 1024 * 1024
#: Exec answers being sent, each holding one page of output at a time (its stream is read again
#: from the agent, page by page, as it is sent): at most this many for one session and in all;
#: more wait their turn. The agent runs 8 execs of a session at once.
MAX_EXEC_ANSWERS_PER_SESSION = 8
MAX_EXEC_ANSWERS = 32
#: The pipe an upload's body is spliced through, socket to staging (at most what
#: /proc/sys/fs/pipe-max-size allows; past it the default, only slower).
STAGING_PIPE_BYTES = 1024 * 1024
#: Room for this many descriptors on one answer: more is refused as surely as a second one.
MAX_ANSWER_FDS = 4
MAX_UPLOAD_BYTES = agent_role.MAX_TRANSFER_BYTES
#: Where a file route's path starts: `?root=`, or `container` for an absolute path (from the
#: session container's `/`, as its runtime user reaches it).
FILE_ROOTS = tuple(root.value for root in agent_role.FileRoot)
#: The agent's request line: serve refuses (413) what it would not take, before sending it.
AGENT_MAX_REQUEST_BYTES = agent_role.MAX_REQUEST_BYTES
#: What a tar adds to its files' bytes, at most, per entry (a header, and padding to 512).
TAR_BYTES_PER_ENTRY = client_role.TAR_BYTES_PER_ENTRY
#: A listing answers at most this many entries (then `truncated`); the answer parser bounds
#: each one (a name, a link target), so a listing's memory is bounded too.
MAX_LIST_ENTRIES = 10_000
#: Routes whose body is raw bytes streamed to the agent, not JSON, and the content types each
#: accepts (the upload route: a file, or a tar to extract). Every other body is JSON.
RAW_BODY_ROUTES: dict[str, tuple[str, ...]] = {
    "put_file": ("application/octet-stream", "application/x-tar"),
}
_SESSION_ID = re.compile(r"[0-9a-f]{16}")
#: What seed 002's server trims from a session's name: Unicode's White_Space, as Go's
#: strings.TrimSpace (the peer's) has it. A name is whatever is left, if anything is.
NAME_TRIM_CHARS = ("\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
                   "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
#: Seed 002's model identifiers (an optional leading ~ for moving aliases).
_MODEL = re.compile(r"~[A-Za-z0-9][A-Za-z0-9._:/-]{0,126}|[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
#: Seed 002's alias for "the platform's default model": a claude-code session created without a
#: model keeps it, and each start of its container resolves it to --default-model (or to the
#: agent CLI's own default). GET /config shows it when no default is configured; it is never a
#: catalog entry nor a --default-model.
PLATFORM_DEFAULT_MODEL = "platform-default"
#: Seed 002's workload types on the wire, and the agent's workload each one runs.
WORKLOAD_TYPES = {"shell": "shell", "claude-code": "agent"}
WIRE_WORKLOAD_TYPES = {workload: wire_name for wire_name, workload in WORKLOAD_TYPES.items()}
DEFAULT_WORKLOAD_TYPE = "shell"
_ENV_NAME = agent_role.ENV_NAME_RE  #: what the agent accepts as a variable name
#: Labels at create (`labels: {k: v}`), for a harness to find what it made (GET /sessions?label=k=v):
#: a key is a name such as `inspect.eval` or `io.example/run`, a value a short word of URL-safe
#: characters (no space, comma or `&`), so a filter needs no escaping beyond the URL's own.
_LABEL_KEY = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"[A-Za-z0-9._:@/+=-]{0,128}")
MAX_LABELS = 32
MAX_TTL_S = 30 * 24 * 3600  #: `ttlSeconds` at create: the reaper deletes the session when it passes
#: The credential of one state dir (see "who may drive serve"): STATE_DIR/token, mode 0600.
TOKEN_FILE_NAME = "token"
TOKEN_BYTES = 32
#: What a token may be: at least 32 characters (128 bits as hex), nothing that a header, a
#: cookie or a percent-encoded URL could not carry.
#: --model-credential-file: an API key or a gateway's token (the token file's alphabet).
_MODEL_CREDENTIAL = re.compile(r"[A-Za-z0-9._~+/=-]{8,512}")
#: The browser's way in: the UI at this fragment keeps the token in the tab's sessionStorage
#: (scoped to scheme, host and port) and clears the address bar. A fragment never reaches a
#: server or a Referer header; no credential ever lives in a cookie, which every port of a
#: host would receive.
LOGIN_FRAGMENT = "/#token="
_TOKEN = client_role.TOKEN_RE  #: what a token is (the client checks the ones it sends)
#: The Host names a loopback listen answers for (lowercase, IPv6 without brackets).
LOOPBACK_HOST_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


#: A token file or token that cannot be used (unreadable, open to others, malformed): the
#: client's, since serve and `reploy session` read token files by the same rules.
CredentialError = client_role.CredentialError


class ServeError(ReployError):
    """A managed-session request that failed; `status` is its HTTP status, the message its
    {"error": ..., "code": ...} text. Subclasses split the blame the way seed 002's error
    mapping does; `code` is Reploy's machine-readable word for the failure (ERROR_CODES), the
    class's own unless the raiser names a finer one (serve_error_for: `permission_denied`...)."""

    status = 500
    code = "internal"

    def __init__(self, message: str, code: Optional[str] = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    def response_headers(self) -> dict[str, str]:
        """Headers the error response must carry besides its JSON body."""
        return {}


class BadRequest(ServeError):
    """Malformed: not JSON, unknown fields, wrong types, trailing data."""

    status = 400
    code = "bad_request"


class SessionNotFound(ServeError):
    status = 404
    code = "not_found"


class SessionConflict(ServeError):
    """The session's state refuses this now (busy with another operation, or a lost race)."""

    status = 409
    code = "conflict"


class MethodNotAllowed(ServeError):
    status = 405
    code = "method_not_allowed"

    def __init__(self, message: str, allowed: tuple[str, ...]) -> None:
        super().__init__(message)
        self.allowed = allowed

    def response_headers(self) -> dict[str, str]:
        return {"Allow": ", ".join(self.allowed)}


class PayloadTooLarge(ServeError):
    status = 413
    code = "too_large"


class Unprocessable(ServeError):
    """Valid input the session cannot take: a stream of a session without a container, or
    (on Reploy's own routes) what the agent refuses, such as a path outside the workspace."""

    status = 422
    code = "unprocessable"


class TooManyRequests(ServeError):
    """A bounded queue is full, or the session limit is reached: try again later."""

    status = 429
    code = "too_many_requests"

    def response_headers(self) -> dict[str, str]:
        return {"Retry-After": str(LIMIT_RETRY_AFTER_S)}


class ServiceUnavailable(ServeError):
    """Docker or the agent cannot serve this right now."""

    status = 503
    code = "unavailable"


class TooManyReaders(ServiceUnavailable):
    """An output stream past a reader bound (reader_refusal); the limit is named in the message."""

    def response_headers(self) -> dict[str, str]:
        return {"Retry-After": str(READERS_RETRY_AFTER_S)}


class InsufficientStorage(ServeError):
    """No room: the state dir's file system, or the session's disk quota (the agent's
    `disk_full`)."""

    status = 507
    code = "disk_full"


class BadGateway(ServeError):
    """The session's agent gave an answer that is not one (see "the agent's answers")."""

    status = 502
    code = "bad_gateway"


class GatewayTimeout(ServeError):
    """The session's agent did not finish within the deadline of a loop that waits on it."""

    status = 504
    code = "gateway_timeout"


class UnsafeHeader(ServeError):
    """A response header that would not be one header line (serve's own bug: every value it
    sends is checked before)."""

    status = 500


class Unauthorized(ServeError):
    """No credentials, or wrong ones (see "who may drive serve")."""

    status = 401
    code = "unauthorized"

    def response_headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="reploy"'}


class Forbidden(ServeError):
    """A browser request from another origin or site."""

    status = 403
    code = "forbidden"


class PathNotFound(ServeError):
    """No such file or directory in a session's workspace or home."""

    status = 404
    code = "not_found"


class UnsupportedMediaType(ServeError):
    status = 415
    code = "unsupported_media_type"


class MisdirectedRequest(ServeError):
    """A Host this server does not answer for: DNS rebinding, or a proxy not named with
    --allow-host."""

    status = 421
    code = "misdirected"


# ============================================================================================
# the state machine (pure)
# ============================================================================================


class SessionState(enum.Enum):
    CREATING = "creating"
    ACTIVE = "active"
    IDLE = "idle"
    SNAPSHOTTING = "snapshotting"
    SNAPSHOT = "snapshot"
    RESTORING = "restoring"
    DELETING = "deleting"


class SessionEvent(enum.Enum):
    STARTED = "started"  # the agent answers in a fresh container
    PAUSED = "paused"  # docker pause: processes kept, CPU returned
    RESUMED = "resumed"  # docker unpause
    CHECKPOINT = "checkpoint"  # about to ask the agent for an archive
    CHECKPOINTED = "checkpointed"  # archive on disk, container removed
    SNAPSHOT_FAILED = "snapshot_failed"  # no archive: the container paused, the reason kept
    RESTORE = "restore"  # about to start a container that restores the archive
    RELAUNCHED = "relaunched"  # the container was lost; a fresh one serves the same session dir
    ROLLBACK = "rollback"  # the operation failed, or its `serve` died: undo it
    DELETE = "delete"


class IdleBlock(enum.Enum):
    """Why the reaper leaves a session as it is (the record's idleBlockedBy; see decide_reap)."""

    BUSY = "busy"  # the workload works: a foreground job, an agent run, queued prompts
    VIEWER = "viewer"  # a client holds the session's output stream open


#: Theory of operation. The stable states are active, idle and snapshot; a session leaves one
#: only under its lease, by a compare-and-swap on the record's version, and every long step
#: has its own transitional state recorded *before* the step starts. So a `serve` that dies at
#: any point leaves a record that says what was under way, and whoever next holds the lease
#: finishes or undoes it (SessionManager.recover): creating rolls back to nothing (the client
#: never got an answer), snapshotting rolls forward when the archive exists and back to active
#: when it does not, restoring rolls back to snapshot (the archive is kept until restored),
#: and deleting always rolls forward. A snapshot that fails while its `serve` lives leaves the
#: session idle (its container paused, never active to be retried at once), the reason and the
#: time of a retry recorded; a restore that fails leaves it a snapshot, the archive and the
#: reason kept (the record's failure fields, the API's lastFailure).
SESSION_TRANSITIONS: dict[tuple[SessionState, SessionEvent], SessionState] = {
    (SessionState.CREATING, SessionEvent.STARTED): SessionState.ACTIVE,
    (SessionState.CREATING, SessionEvent.ROLLBACK): SessionState.DELETING,
    (SessionState.ACTIVE, SessionEvent.PAUSED): SessionState.IDLE,
    (SessionState.IDLE, SessionEvent.RESUMED): SessionState.ACTIVE,
    (SessionState.ACTIVE, SessionEvent.CHECKPOINT): SessionState.SNAPSHOTTING,
    (SessionState.IDLE, SessionEvent.CHECKPOINT): SessionState.SNAPSHOTTING,
    (SessionState.SNAPSHOTTING, SessionEvent.CHECKPOINTED): SessionState.SNAPSHOT,
    (SessionState.SNAPSHOTTING, SessionEvent.SNAPSHOT_FAILED): SessionState.IDLE,
    (SessionState.SNAPSHOTTING, SessionEvent.ROLLBACK): SessionState.ACTIVE,
    (SessionState.SNAPSHOT, SessionEvent.RESTORE): SessionState.RESTORING,
    (SessionState.RESTORING, SessionEvent.STARTED): SessionState.ACTIVE,
    (SessionState.RESTORING, SessionEvent.ROLLBACK): SessionState.SNAPSHOT,
    (SessionState.ACTIVE, SessionEvent.RELAUNCHED): SessionState.ACTIVE,
    (SessionState.IDLE, SessionEvent.RELAUNCHED): SessionState.ACTIVE,
    (SessionState.ACTIVE, SessionEvent.DELETE): SessionState.DELETING,
    (SessionState.IDLE, SessionEvent.DELETE): SessionState.DELETING,
    (SessionState.SNAPSHOT, SessionEvent.DELETE): SessionState.DELETING,
    (SessionState.DELETING, SessionEvent.DELETE): SessionState.DELETING,
}
STABLE_STATES = frozenset({SessionState.ACTIVE, SessionState.IDLE, SessionState.SNAPSHOT})
#: What the API shows of a state: seed 002 knows only active, idle and snapshot. A step under way
#: shows as the state the session is in for a client until the step ends (a snapshot's container
#: runs until the archive is written; a restore's session has none until it answers), the step's
#: name in the session's `phase`. A session being created or deleted is not shown at all: seed
#: 002 stores a session only once its workload answers, and a deleted one is gone.
WIRE_STATES: dict[SessionState, tuple[SessionState, Optional[str]]] = {
    SessionState.ACTIVE: (SessionState.ACTIVE, None),
    SessionState.IDLE: (SessionState.IDLE, None),
    SessionState.SNAPSHOT: (SessionState.SNAPSHOT, None),
    SessionState.SNAPSHOTTING: (SessionState.ACTIVE, "snapshotting"),
    SessionState.RESTORING: (SessionState.SNAPSHOT, "restoring"),
}


class IllegalTransition(SessionConflict):
    """The table has no edge for this (state, event)."""


def next_session_state(state: SessionState, event: SessionEvent) -> SessionState:
    try:
        return SESSION_TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"a session in state {state.value} cannot take {event.value}") from None


@dataclass(frozen=True)
class SessionSpec:
    """What a session is, fixed at creation: the workload and the exact image and sandbox."""

    workload: str  # "shell" | "agent"
    model: Optional[str]
    deployment: str
    deployment_id: str
    image_id: str
    generation: int
    runtime: Runtime
    #: Its own CPU bound and disk size (create's `cpus`, `diskMib`). None only in a record from
    #: before they were stored: it has the server's (ServeConfig.resources).
    cpus: Optional[float] = None
    disk_mib: Optional[int] = None
    #: create's `egress`: the HOST:PORT entries (of --egress-allow) it may reach; () for none,
    #: as in a record from before egress existed.
    egress: tuple[str, ...] = ()

    def to_json(self) -> str:
        doc = {k: v for k, v in self.__dict__.items() if k != "runtime"}
        doc["runtime"] = {**self.runtime.__dict__, "writable_paths": list(self.runtime.writable_paths)}
        return json.dumps(doc, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "SessionSpec":
        doc = json.loads(text)
        runtime = doc.pop("runtime")
        runtime["writable_paths"] = tuple(runtime["writable_paths"])
        doc["egress"] = tuple(doc.get("egress", ()))
        return cls(runtime=Runtime(**runtime), **doc)


@dataclass(frozen=True)
class SessionRecord:
    """One row of the store. `version` grows by one with every change (compare-and-swap)."""

    id: str
    name: str
    spec: SessionSpec
    state: SessionState
    version: int
    created_at: float
    last_access: float
    state_since: float
    container_id: Optional[str] = None
    archive: Optional[str] = None  # checkpoint file name inside the session dir
    snapshot_bytes: Optional[int] = None
    checkpoint_at: Optional[float] = None  # when the current archive was made
    lease_owner: Optional[str] = None
    lease_expires: float = 0.0
    busy_at: Optional[float] = None  # when the workload was last known busy (the reaper's facts)
    idle_blocked_by: tuple[IdleBlock, ...] = ()  # as the reaper last found it; frozen while paused
    failed_step: Optional[str] = None  # "snapshot" | "restore": the last step that failed
    failure: Optional[str] = None  # why (at most MAX_FAILURE_CHARS)
    failed_at: Optional[float] = None
    snapshot_failures: int = 0  # in a row: the reaper's backoff grows with them
    snapshot_retry_at: Optional[float] = None  # the reaper snapshots it again no earlier
    labels: tuple[tuple[str, str], ...] = ()  # given at create, sorted by key
    expires_at: Optional[float] = None  # created_at + ttlSeconds; None: no time to live


def apply_session_event(record: SessionRecord, event: SessionEvent, now: float,
                        **changes: Any) -> SessionRecord:
    """The record after `event`: new state, version + 1, plus field changes. Pure; the store
    writes it only if the stored version is still `record.version`."""
    state = next_session_state(record.state, event)
    return replace(record, state=state, version=record.version + 1,
                   state_since=now if state is not record.state else record.state_since, **changes)


def lease_is_stale(owner: Optional[str], expires: float, now: float, host: str) -> bool:
    """A lease can be taken when nobody holds it, it expired, or its holder (a process on this
    host, named by reploy_watchdog.process_identity) is gone."""
    if owner is None or expires <= now:
        return True
    owner_host, _, rest = owner.partition("/")
    identity = rest.rpartition("/")[0]
    return owner_host == host and not reploy_watchdog.identity_alive(identity)


#: A step that succeeded clears what the last failure recorded.
_NO_FAILURE: dict[str, Any] = {"failed_step": None, "failure": None, "failed_at": None,
                               "snapshot_failures": 0, "snapshot_retry_at": None}


# ============================================================================================
# the reaper's decision (pure)
# ============================================================================================


class ReapAction(enum.Enum):
    KEEP = "keep"
    PAUSE = "pause"  # active -> idle: quiet for --idle-after
    FORCE_PAUSE = "force_pause"  # active -> idle although blocked: no access for --max-busy
    SNAPSHOT = "snapshot"  # active or idle -> snapshot: quiet for --snapshot-after


@dataclass(frozen=True)
class ReapPolicy:
    idle_after_s: float
    snapshot_after_s: float
    max_busy_s: float


@dataclass(frozen=True)
class WorkloadFacts:
    """What an active session's agent says about its workload (docs/agent.md, `status`)."""

    busy: bool
    quiet_s: Optional[float]  # since the workload was last busy; None: the agent does not say

    @classmethod
    def from_status(cls, status: dict[str, Any]) -> "WorkloadFacts":
        """An agent older than `busy` and `quiet_ms` (one started before an upgrade keeps its
        code until its container restarts) is busy by its turn state and queue, quiet unknown."""
        busy, quiet_ms = status.get("busy"), status.get("quiet_ms")
        if not isinstance(busy, bool):
            busy = status.get("turn_state") == "in_progress" or bool(status.get("queue_depth"))
        if isinstance(quiet_ms, bool) or not isinstance(quiet_ms, int):
            return cls(busy=busy, quiet_s=0.0 if busy else None)
        return cls(busy=busy, quiet_s=max(quiet_ms, 0) / 1000)


@dataclass(frozen=True)
class ReapDecision:
    action: ReapAction
    blocked_by: tuple[IdleBlock, ...]
    busy_at: Optional[float]  # the record keeps these two facts
    idle_since: float  # when the idle clock started


def snapshot_retry_after_s(failures: int, snapshot_after_s: float) -> float:
    """How long after its `failures`-th failure in a row a snapshot is tried again: doubling
    from --snapshot-after, at most SNAPSHOT_RETRY_MAX_S."""
    return min(snapshot_after_s * 2.0 ** min(failures - 1, 64), SNAPSHOT_RETRY_MAX_S)


def idle_clock_start(last_access: float, busy_at: Optional[float]) -> float:
    """Idle time runs from the later of the last access and the end of the last busy stretch."""
    return last_access if busy_at is None else max(last_access, busy_at)


#: Theory of operation. The reaper never freezes work in progress and never mistakes work for
#: idleness. Each pass it asks every active session's agent whether its workload is busy (a
#: foreground job, an agent run, queued prompts) and how long it has been quiet, and counts the
#: clients holding the session's stream open in any `serve` sharing the store. Then:
#:   * idle time runs from the later of the last access and the end of the last busy stretch;
#:   * a busy or watched session is neither paused nor snapshotted: idleBlockedBy says why;
#:   * the bound: an active session nobody accessed for --max-busy is paused even so (its agent
#:     first records a `suspend` event in its outbox): CPU is returned, processes are kept;
#:   * a paused session's agent is frozen and cannot be asked, so its busy-ness is what it was
#:     at the pause: not busy after an idle pause (by construction), busy after a --max-busy
#:     pause. A session frozen with work in flight is therefore never snapshotted (its work
#:     could not drain); it stays paused until an access resumes it. A viewer holds a paused
#:     session back from its snapshot too;
#:   * an active session whose agent does not answer counts as not busy (the earlier rule);
#:   * a session whose last snapshot failed is snapshotted again no earlier than its
#:     snapshot_retry_at (snapshot_retry_after_s): the reaper never loops on one (meanwhile an
#:     active one is paused as any other).
def decide_reap(record: SessionRecord, facts: Optional[WorkloadFacts], viewers: int, now: float,
                policy: ReapPolicy) -> ReapDecision:
    """What the reaper does with one session now, and why it holds back. Pure."""
    busy_at = record.busy_at
    if record.state is SessionState.ACTIVE:
        busy = facts is not None and facts.busy
        if facts is not None and facts.quiet_s is not None:
            busy_at = now - facts.quiet_s if busy_at is None else max(busy_at, now - facts.quiet_s)
    elif record.state is SessionState.IDLE:
        busy = IdleBlock.BUSY in record.idle_blocked_by
    else:
        return ReapDecision(ReapAction.KEEP, (), busy_at, record.last_access)
    blocked = ((IdleBlock.BUSY,) if busy else ()) + ((IdleBlock.VIEWER,) if viewers > 0 else ())
    idle_since = now if busy else idle_clock_start(record.last_access, busy_at)
    quiet_s = now - idle_since
    if blocked:
        forced = (record.state is SessionState.ACTIVE
                  and now - record.last_access >= policy.max_busy_s)
        action = ReapAction.FORCE_PAUSE if forced else ReapAction.KEEP
    elif quiet_s >= policy.snapshot_after_s and (record.snapshot_retry_at is None
                                                 or now >= record.snapshot_retry_at):
        action = ReapAction.SNAPSHOT
    elif record.state is SessionState.ACTIVE and quiet_s >= policy.idle_after_s:
        action = ReapAction.PAUSE
    else:
        action = ReapAction.KEEP
    return ReapDecision(action, blocked, busy_at, idle_since)


# ============================================================================================
# the store (SQLite, compare-and-swap, leases)
# ============================================================================================

_STORE_SCHEMA_VERSION = 5
_STORE_DDL = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    version INTEGER NOT NULL,
    created_at REAL NOT NULL,
    last_access REAL NOT NULL,
    state_since REAL NOT NULL,
    container_id TEXT,
    archive TEXT,
    snapshot_bytes INTEGER,
    lease_owner TEXT,
    lease_expires REAL NOT NULL DEFAULT 0
)"""
#: Columns added after schema 1, each added in place to an older store when it opens.
_STORE_ADDED_COLUMNS = (("busy_at", "REAL"), ("idle_blocked_by", "TEXT NOT NULL DEFAULT ''"),
                        ("checkpoint_at", "REAL"), ("failed_step", "TEXT"), ("failure", "TEXT"),
                        ("failed_at", "REAL"), ("snapshot_failures", "INTEGER NOT NULL DEFAULT 0"),
                        ("snapshot_retry_at", "REAL"), ("labels", "TEXT NOT NULL DEFAULT '[]'"),
                        ("expires_at", "REAL"))
#: Open connections a SessionStore keeps between statements: about the threads that use the
#: store at once (requests, the reaper, stream renewals); a busier moment opens more, closed after.
STORE_IDLE_CONNECTIONS = 8
#: One row per open SSE stream, in whichever `serve` holds it: the reaper of every `serve`
#: sharing the store counts them. A row expires unless its stream renews it.
_VIEWERS_DDL = """
CREATE TABLE IF NOT EXISTS viewers (
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    expires REAL NOT NULL
)"""
_RECORD_COLUMNS = ("id", "name", "spec", "state", "version", "created_at", "last_access",
                   "state_since", "container_id", "archive", "snapshot_bytes", "lease_owner",
                   "lease_expires", "busy_at", "idle_blocked_by", "checkpoint_at", "failed_step",
                   "failure", "failed_at", "snapshot_failures", "snapshot_retry_at", "labels",
                   "expires_at")


class SessionStore:
    """Session records in `STATE_DIR/sessions.db`, safe across threads and processes.

    Every write is one SQL statement whose WHERE clause is the whole precondition, so SQLite's
    own locking makes it atomic: `save` is a compare-and-swap on `version` fenced by the lease
    owner, `acquire` takes a lease only from nobody, from an expiry, or from the exact stale
    holder it saw, and `touch` refreshes last access only for an active session nobody holds.
    `observe` records the reaper's facts without a version: they are observations, not changes.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._idle: list[sqlite3.Connection] = []  # opened once, lent to one thread at a time
        self._idle_lock = threading.Lock()
        self._closed = False
        with self._db() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("BEGIN IMMEDIATE")  # two `serve` processes may open an old store at once
            try:
                db.execute(_STORE_DDL)
                db.execute(_VIEWERS_DDL)
                present = {row[1] for row in db.execute("PRAGMA table_info(sessions)")}
                for column, declaration in _STORE_ADDED_COLUMNS:
                    if column not in present:
                        db.execute(f"ALTER TABLE sessions ADD COLUMN {column} {declaration}")
                db.execute(f"PRAGMA user_version={_STORE_SCHEMA_VERSION}")
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    @contextlib.contextmanager
    def _db(self) -> Iterator["sqlite3.Connection"]:
        """A connection of this store's own, lent for one statement (or one explicit
        transaction) to the calling thread alone. Connections are kept for the next caller
        (at most STORE_IDLE_CONNECTIONS), so a request's thread, new per HTTP connection,
        does not open the database afresh."""
        with self._idle_lock:
            db = self._idle.pop() if self._idle else None
        if db is None:
            db = sqlite3.connect(str(self.path), timeout=30, isolation_level=None,
                                 check_same_thread=False)
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA busy_timeout=30000")
        try:
            yield db
        except sqlite3.Error as e:
            raise ServiceUnavailable(f"session store {self.path}: {e}") from e
        finally:
            with self._idle_lock:
                kept = not self._closed and not db.in_transaction and len(self._idle) < STORE_IDLE_CONNECTIONS
                if kept:
                    self._idle.append(db)
            if not kept:
                db.close()

    @staticmethod
    def _record(row: tuple[Any, ...]) -> SessionRecord:
        values = dict(zip(_RECORD_COLUMNS, row))
        values["spec"] = SessionSpec.from_json(values["spec"])
        values["state"] = SessionState(values["state"])
        values["idle_blocked_by"] = _blocks_from_text(values["idle_blocked_by"])
        values["labels"] = tuple((key, value) for key, value in json.loads(values["labels"]))
        return SessionRecord(**values)

    def insert(self, record: SessionRecord) -> None:
        values = {**record.__dict__, "spec": record.spec.to_json(), "state": record.state.value,
                  "idle_blocked_by": _blocks_to_text(record.idle_blocked_by),
                  "labels": json.dumps([list(pair) for pair in record.labels])}
        with self._db() as db:
            db.execute(f"INSERT INTO sessions ({', '.join(_RECORD_COLUMNS)}) VALUES "
                       f"({', '.join('?' * len(_RECORD_COLUMNS))})",
                       [values[c] for c in _RECORD_COLUMNS])

    def get(self, session_id: str) -> Optional[SessionRecord]:
        with self._db() as db:
            row = db.execute(f"SELECT {', '.join(_RECORD_COLUMNS)} FROM sessions WHERE id = ?",
                             (session_id,)).fetchone()
        return self._record(row) if row else None

    def list(self) -> list[SessionRecord]:
        with self._db() as db:
            rows = db.execute(f"SELECT {', '.join(_RECORD_COLUMNS)} FROM sessions "
                              "ORDER BY created_at, id").fetchall()
        return [self._record(row) for row in rows]

    def count(self) -> int:
        with self._db() as db:
            return int(db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0])

    def save(self, old: SessionRecord, new: SessionRecord, owner: str, now: float) -> SessionRecord:
        """Compare-and-swap: write `new` only if the row is still `old.version` and `owner`
        still holds a live lease on it."""
        with self._db() as db:
            cursor = db.execute(
                "UPDATE sessions SET state = ?, version = ?, last_access = ?, state_since = ?, "
                "container_id = ?, archive = ?, snapshot_bytes = ?, checkpoint_at = ?, "
                "busy_at = ?, idle_blocked_by = ?, failed_step = ?, failure = ?, failed_at = ?, "
                "snapshot_failures = ?, snapshot_retry_at = ? "
                "WHERE id = ? AND version = ? AND lease_owner = ? AND lease_expires > ?",
                (new.state.value, new.version, new.last_access, new.state_since,
                 new.container_id, new.archive, new.snapshot_bytes, new.checkpoint_at,
                 new.busy_at, _blocks_to_text(new.idle_blocked_by), new.failed_step, new.failure,
                 new.failed_at, new.snapshot_failures, new.snapshot_retry_at, old.id,
                 old.version, owner, now))
        if cursor.rowcount != 1:
            raise SessionConflict(f"session {old.id} changed under us (lost its lease or version)")
        return replace(new, lease_owner=owner)

    def acquire(self, session_id: str, owner: str, now: float,
                stale_owner: Optional[str] = None) -> bool:
        """Take the lease from nobody, from an expired holder, or from exactly `stale_owner`
        (a holder the caller found dead: see lease_is_stale)."""
        with self._db() as db:
            cursor = db.execute(
                "UPDATE sessions SET lease_owner = ?, lease_expires = ? WHERE id = ? AND "
                "(lease_owner IS NULL OR lease_expires <= ? OR lease_owner = ?)",
                (owner, now + LEASE_TTL_S, session_id, now, stale_owner))
        return cursor.rowcount == 1

    def renew(self, session_id: str, owner: str, now: float) -> None:
        with self._db() as db:
            cursor = db.execute("UPDATE sessions SET lease_expires = ? WHERE id = ? AND "
                                "lease_owner = ?", (now + LEASE_TTL_S, session_id, owner))
        if cursor.rowcount != 1:
            raise SessionConflict(f"session {session_id}: our lease was taken")

    def release(self, session_id: str, owner: str) -> None:
        with self._db() as db:
            db.execute("UPDATE sessions SET lease_owner = NULL, lease_expires = 0 "
                       "WHERE id = ? AND lease_owner = ?", (session_id, owner))

    def touch(self, session_id: str, now: float) -> Optional[SessionRecord]:
        """Record an access to an active session nobody is operating on: the record as that
        statement left it. None: slow path."""
        with self._db() as db:
            rows = db.execute(  # fetched whole: the statement, and so its write, ends here
                "UPDATE sessions SET last_access = ? WHERE id = ? AND state = ? AND "
                f"(lease_owner IS NULL OR lease_expires <= ?) RETURNING {', '.join(_RECORD_COLUMNS)}",
                (now, session_id, SessionState.ACTIVE.value, now)).fetchall()
        return self._record(rows[0]) if rows else None

    def observe(self, session_id: str, state: SessionState, busy_at: Optional[float],
                blocked_by: tuple[IdleBlock, ...]) -> None:
        """The reaper's facts about a session it saw in `state`; ignored if the state moved on."""
        with self._db() as db:
            db.execute("UPDATE sessions SET busy_at = ?, idle_blocked_by = ? WHERE id = ? AND state = ?",
                       (busy_at, _blocks_to_text(blocked_by), session_id, state.value))

    def hold_viewer(self, viewer_id: str, session_id: str, now: float) -> None:
        """Open or renew one stream's viewer row (and forget expired ones)."""
        with self._db() as db:
            db.execute("DELETE FROM viewers WHERE expires <= ?", (now,))
            db.execute("INSERT OR REPLACE INTO viewers (id, session_id, expires) VALUES (?, ?, ?)",
                       (viewer_id, session_id, now + VIEWER_TTL_S))

    def drop_viewer(self, viewer_id: str) -> None:
        with self._db() as db:
            db.execute("DELETE FROM viewers WHERE id = ?", (viewer_id,))

    def viewer_count(self, session_id: str, now: float) -> int:
        with self._db() as db:
            return int(db.execute("SELECT COUNT(*) FROM viewers WHERE session_id = ? AND expires > ?",
                                  (session_id, now)).fetchone()[0])

    def delete(self, session_id: str, owner: str) -> None:
        with self._db() as db:
            db.execute("DELETE FROM sessions WHERE id = ? AND lease_owner = ?", (session_id, owner))

    def close(self) -> None:
        """Closes the idle connections; one lent out is closed when it comes back."""
        with self._idle_lock:
            self._closed, idle, self._idle = True, self._idle, []
        for db in idle:
            db.close()


def _blocks_to_text(blocks: tuple[IdleBlock, ...]) -> str:
    return ",".join(block.value for block in blocks)


def _blocks_from_text(text: str) -> tuple[IdleBlock, ...]:
    return tuple(IdleBlock(value) for value in text.split(",") if value)


# ============================================================================================
# request bodies and responses (pure)
# ============================================================================================


@dataclass(frozen=True)
class FieldRule:
    """One JSON body field: its type, whether it is required, and what values fit."""

    kind: type  # float: any JSON number
    required: bool = False
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    pattern: Optional[re.Pattern[str]] = None  # the whole value must match (fullmatch)
    choices: tuple[str, ...] = ()
    reserved: tuple[str, ...] = ()  # values the pattern allows that are refused anyway


#: A session's model (seed 002: the pattern; `platform-default` included, as the alias it is).
SESSION_MODEL_RULE = FieldRule(str, pattern=_MODEL)
#: A model of the server's own: --default-model, a --models entry. The alias names no model.
MODEL_RULE = replace(SESSION_MODEL_RULE, reserved=(PLATFORM_DEFAULT_MODEL,))


#: Request bodies by operation. Every field is optional unless marked; an unknown field, a
#: missing one, a wrong JSON type (null included) and a value that does not fit are all 400,
#: as seed 002 has it. `deployment`, `labels`, `ttlSeconds`, `cpus`, `diskMib` and `egress`
#: (create) and `waitMs` (read) are Reploy's optional additions; the other routes are Reploy's
#: own. The server's own bounds on `cpus` and `diskMib` are session_resources', on `egress`
#: session_egress'.
BODY_RULES: dict[str, dict[str, FieldRule]] = {
    "create": {"name": FieldRule(str, True),
               "workloadType": FieldRule(str, choices=tuple(WORKLOAD_TYPES)),
               "model": SESSION_MODEL_RULE,
               "deployment": FieldRule(str, pattern=_NAME),
               "labels": FieldRule(dict),
               "ttlSeconds": FieldRule(int, minimum=1, maximum=MAX_TTL_S),
               "cpus": FieldRule(float, minimum=MIN_SESSION_CPUS),
               "diskMib": FieldRule(int, minimum=MIN_SESSION_DISK_MIB, maximum=MAX_SESSION_DISK_MIB),
               "egress": FieldRule(list)},
    "read": {"offset": FieldRule(int, minimum=0, maximum=MAX_OFFSET),
             "waitMs": FieldRule(int, minimum=0, maximum=MAX_READ_WAIT_MS)},
    "write": {"payload": FieldRule(str)},
    "message": {"text": FieldRule(str, True)},
    "resize": {"columns": FieldRule(int, True, minimum=1, maximum=agent_role.MAX_TERMINAL_SIDE),
               "rows": FieldRule(int, True, minimum=1, maximum=agent_role.MAX_TERMINAL_SIDE)},
    "exec": {"argv": FieldRule(list, True), "cwd": FieldRule(str), "env": FieldRule(dict),
             "stdinBase64": FieldRule(str), "stdinPath": FieldRule(str),
             "detach": FieldRule(bool), "stream": FieldRule(bool),
             "timeoutMs": FieldRule(int, minimum=1, maximum=MAX_EXEC_TIMEOUT_MS),
             "maxOutputBytes": FieldRule(int, minimum=0, maximum=MAX_EXEC_OUTPUT_BYTES),
             "user": FieldRule(str)},
    "empty": {},
}
_JSON_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", list: "an array",
                    dict: "an object", bool: "true or false"}


def parse_body(raw: bytes, rules: dict[str, FieldRule]) -> dict[str, Any]:
    """Strict JSON object (the project's one strict parser, wire.parse_strict_object) ->
    validated fields. An empty body is {}."""
    if len(raw) > MAX_BODY_BYTES:
        raise PayloadTooLarge(f"the body exceeds {MAX_BODY_BYTES} bytes")
    if not raw.strip():
        doc: dict[str, Any] = {}
    else:
        try:
            doc = wire.parse_strict_object(raw.strip(b" \t\r\n"),  # JSON's own whitespace
                                           max_bytes=MAX_BODY_BYTES)
        except wire.ProtocolError as e:
            raise BadRequest(f"the body: {e}") from None
    unknown = sorted(set(doc) - set(rules))
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(unknown)}")
    for name, rule in rules.items():
        if name in doc:
            check_field(name, doc[name], rule)
        elif rule.required:
            raise BadRequest(f"{name}: required")
    return doc


def check_field(name: str, value: Any, rule: FieldRule) -> None:
    """One value against its rule; BadRequest for what does not fit."""
    kinds = (int, float) if rule.kind is float else (rule.kind,)
    if isinstance(value, bool) != (rule.kind is bool) or not issubclass(type(value), kinds):  # keeps value Any
        raise BadRequest(f"{name}: must be {_JSON_KIND_NAMES[rule.kind]}")
    if rule.minimum is not None and value < rule.minimum or (
            rule.maximum is not None and value > rule.maximum):
        raise BadRequest(f"{name}: must be from {rule.minimum} to {rule.maximum}" if rule.maximum is not None
                         else f"{name}: must be at least {rule.minimum}")
    if rule.pattern is not None and not rule.pattern.fullmatch(value):
        raise BadRequest(f"{name}: {value[:80]!r} is not allowed")
    if rule.choices and value not in rule.choices:
        raise BadRequest(f"{name}: must be one of {', '.join(rule.choices)}")
    if value in rule.reserved:
        raise BadRequest(f"{name}: {value!r} is reserved")


@dataclass(frozen=True)
class CreateRequest:
    """A valid create body: the trimmed name, the agent's workload, the model (claude-code
    only: the one given, or the platform-default alias), the deployment (None: the first), the
    labels (parse_labels), the time to live (None: for ever), and the CPU bound and disk size
    (None: the server's; session_resources)."""

    name: str
    workload: str
    model: Optional[str]
    deployment: Optional[str]
    labels: tuple[tuple[str, str], ...] = ()
    ttl_s: Optional[int] = None
    cpus: Optional[float] = None
    disk_mib: Optional[int] = None
    egress: tuple[str, ...] = ()  # as given: session_egress checks them against the server's

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> "CreateRequest":
        """Seed 002's rules, all checked before anything is provisioned."""
        name = fields["name"].strip(NAME_TRIM_CHARS)
        if not name:
            raise BadRequest("name: must hold a character that is not white space")
        workload_type = fields.get("workloadType", DEFAULT_WORKLOAD_TYPE)
        workload = WORKLOAD_TYPES[workload_type]
        model = fields.get("model")
        if workload == "shell" and model is not None:
            raise BadRequest("model: only claude-code sessions have a model")
        if workload == "agent" and model is None:
            model = PLATFORM_DEFAULT_MODEL
        cpus = fields.get("cpus")
        egress = fields.get("egress", [])
        if not all(isinstance(entry, str) for entry in egress):
            raise BadRequest("egress: each entry must be a string HOST[:PORT]")
        return cls(name, workload, model, fields.get("deployment"),
                   parse_labels(fields.get("labels", {})), fields.get("ttlSeconds"),
                   None if cpus is None else float(cpus), fields.get("diskMib"), tuple(egress))


def session_resources(request: CreateRequest, max_cpus: float, max_disk_mib: int) -> tuple[float, int]:
    """A new session's (CPU bound, disk MiB): the ones asked for, never past the server's own
    (--session-cpus, --session-disk-mib), which are also the defaults; BadRequest past them.
    Pure: checked before anything is provisioned."""
    cpus = max_cpus if request.cpus is None else request.cpus
    disk_mib = max_disk_mib if request.disk_mib is None else request.disk_mib
    if cpus > max_cpus:
        raise BadRequest(f"cpus: must be at most {max_cpus:g}, this server's bound (--session-cpus)")
    if disk_mib > max_disk_mib:
        raise BadRequest(f"diskMib: must be at most {max_disk_mib}, this server's bound (--session-disk-mib)")
    return cpus, disk_mib


def _check_label(key: Any, value: Any, where: str) -> tuple[str, str]:
    if not isinstance(key, str) or not _LABEL_KEY.fullmatch(key):
        raise BadRequest(f"{where}: the key {str(key)[:80]!r} is not a label key ({_LABEL_KEY.pattern})")
    if not isinstance(value, str) or not _LABEL_VALUE.fullmatch(value):
        raise BadRequest(f"{where}.{key}: must be a string matching {_LABEL_VALUE.pattern}")
    return key, value


def parse_labels(document: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """A create's labels, checked (keys and values by _LABEL_KEY and _LABEL_VALUE, at most
    MAX_LABELS), in key order."""
    if len(document) > MAX_LABELS:
        raise BadRequest(f"labels: at most {MAX_LABELS}")
    return tuple(sorted(_check_label(key, value, "labels") for key, value in document.items()))


def label_filter(query: str) -> tuple[tuple[str, str], ...]:
    """GET /sessions' query: `label=k=v`, repeatable (every one must match); nothing else."""
    params = urllib.parse.parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(params) - {"label"})
    if unknown:
        raise BadRequest(f"unknown query parameter(s): {', '.join(unknown)}")
    wanted = []
    for text in params.get("label", []):
        key, equals, value = text.partition("=")
        if not equals:
            raise BadRequest(f"label: {text[:80]!r} is not KEY=VALUE")
        wanted.append(_check_label(key, value, "label"))
    return tuple(wanted)


def has_labels(record: "SessionRecord", wanted: tuple[tuple[str, str], ...]) -> bool:
    return set(wanted) <= set(record.labels)


def is_expired(record: "SessionRecord", now: float) -> bool:
    """Its time to live has passed: the reaper deletes it."""
    return record.expires_at is not None and now >= record.expires_at


def message_parts(text: str, part_bytes: int = MAX_MESSAGE_PART_BYTES) -> list[str]:
    """A message cut, between code points, into parts of at most part_bytes (UTF-8): each fits the
    agent's request line, which one message of up to MAX_PAYLOAD_BYTES does not."""
    data, parts = text.encode(), []
    while True:
        part = agent_role.utf8_prefix(data, part_bytes)
        parts.append(part.decode())
        data = data[len(part):]
        if not data:
            return parts


def exec_params(fields: dict[str, Any]) -> dict[str, Any]:
    """An exec body (parsed by BODY_RULES["exec"]) as the agent's `exec` params. Item types are
    checked here (400); what does not fit, the agent refuses (422). `stream` is serve's own
    (the answer's form), never the agent's."""
    argv, env = fields["argv"], fields.get("env", {})
    if "user" in fields:
        raise Unprocessable(f"user: every exec runs as the session's runtime user; it cannot run "
                            f"as {fields['user'][:64]!r} (root never)", "user_unsupported")
    if not argv or not all(isinstance(arg, str) for arg in argv):
        raise BadRequest("argv: must be a non-empty array of strings")
    if not all(isinstance(value, str) for value in env.values()):
        raise BadRequest("env: every value must be a string")
    if fields.get("stream") and fields.get("detach"):
        raise BadRequest("stream: a detached command's output goes to its files, not to the answer")
    params: dict[str, Any] = {
        "argv": argv, "cwd": fields.get("cwd", ""), "env": env,
        "output_cap_bytes": fields.get("maxOutputBytes", DEFAULT_EXEC_OUTPUT_BYTES),
        "detach": fields.get("detach", False)}
    if "timeoutMs" in fields:  # none given: no timeout
        params["timeout_ms"] = fields["timeoutMs"]
    if "stdinPath" in fields:
        params["stdin_path"] = fields["stdinPath"]
    if "stdinBase64" in fields:
        try:
            stdin = base64.b64decode(fields["stdinBase64"], validate=True)
        except ValueError:
            raise BadRequest("stdinBase64: not base64") from None
        if len(stdin) > MAX_EXEC_STDIN_BYTES:
            raise PayloadTooLarge(f"stdinBase64: more than {MAX_EXEC_STDIN_BYTES} bytes; upload a "
                                  "file and name it as stdinPath instead")
        params["stdin_b64"] = base64.b64encode(stdin).decode("ascii")
    return params


class OutputEncoding(enum.Enum):
    """How an exec answer carries one stream's bytes, exactly, in one form (`{stream}Encoding`):
    as JSON text (`stdout`) when they are UTF-8 and that text is no longer than their base64,
    else as base64 (`stdoutBase64`). Never both: an answer is at most its streams' base64."""

    TEXT = "text"
    BASE64 = "base64"


#: What encode_compact writes for a byte of UTF-8 text that JSON escapes: two characters for
#: these, six (\u00XX) for the other C0 controls.
_SHORT_ESCAPED = b'"\\\b\f\n\r\t'
_LONG_ESCAPED = bytes(byte for byte in range(0x20) if byte not in _SHORT_ESCAPED)


def base64_length(size_bytes: int) -> int:
    return (size_bytes + 2) // 3 * 4


class TextCost:
    """One stream's bytes, fed in order: how long their JSON text is (`text_bytes`), or None
    once they are not UTF-8. Pure."""

    def __init__(self) -> None:
        self.size_bytes = 0
        self.text_bytes: Optional[int] = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")()

    def feed(self, data: bytes, final: bool = False) -> None:
        self.size_bytes += len(data)
        if self.text_bytes is None:
            return
        try:
            self._decoder.decode(data, final)
        except UnicodeDecodeError:
            self.text_bytes = None
            return
        short = len(data) - len(data.translate(None, _SHORT_ESCAPED))
        long = len(data) - len(data.translate(None, _LONG_ESCAPED))
        self.text_bytes += len(data) + short + 5 * long

    def encoding(self) -> OutputEncoding:
        """The form the answer gives these bytes (OutputEncoding); ends the feed."""
        self.feed(b"", final=True)
        if self.text_bytes is not None and self.text_bytes <= base64_length(self.size_bytes):
            return OutputEncoding.TEXT
        return OutputEncoding.BASE64


@dataclass(frozen=True)
class ExecEnded:
    """An exec whose command ended: the agent's last exec_wait answer, each stream's size and
    the form its answer gives it, and its bytes when serve holds them (`held`: at most two of
    the agent's pages per stream, the agent's result released), else they are still the
    agent's."""

    exec_id: str
    final: dict[str, Any]
    sizes: dict[str, int]
    encodings: dict[str, OutputEncoding]
    held: Optional[dict[str, bytes]] = None


EXEC_STREAMS = ("stdout", "stderr")


def exec_result_head(final: dict[str, Any]) -> dict[str, Any]:
    """How the command ended (exitCode, or signal, or timedOut), from the agent's last exec_wait."""
    return {"execId": final["exec_id"], "exitCode": final["exit_code"], "signal": final["signal"],
            "timedOut": final["timed_out"], "killed": final["killed"],
            "durationMs": final["duration_ms"]}


def exec_stream_json(name: str, encoding: OutputEncoding, pages: Iterable[bytes],
                     truncated: bool, limit_bytes: int) -> Iterator[bytes]:
    """One stream of an exec answer in JSON pieces (`,"stdoutEncoding":...,"stdout":"...",
    "stdoutTruncated":...`), its bytes encoded page by page as they come: at most one page is
    in memory. BadGateway once the encoded bytes would pass limit_bytes (pages other than those
    the form was chosen for). Pure."""
    key = name if encoding is OutputEncoding.TEXT else f"{name}Base64"
    yield f',"{name}Encoding":"{encoding.value}","{key}":"'.encode()
    written = 0
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    held = b""  # base64: the bytes past the last multiple of 3, so that pieces join whole
    for page in pages:
        if encoding is OutputEncoding.TEXT:
            piece = json.dumps(decoder.decode(page), ensure_ascii=False)[1:-1].encode()
        else:
            data = held + page
            cut = len(data) - len(data) % 3
            piece, held = base64.b64encode(data[:cut]), data[cut:]
        written += len(piece)
        if written > limit_bytes:
            raise BadGateway(f"the session agent's {name} changed after its command ended")
        yield piece
    tail = (json.dumps(decoder.decode(b"", True), ensure_ascii=False)[1:-1].encode()
            if encoding is OutputEncoding.TEXT else base64.b64encode(held))
    if written + len(tail) > limit_bytes:
        raise BadGateway(f"the session agent's {name} changed after its command ended")
    yield tail + f'","{name}Truncated":{json.dumps(truncated)}'.encode()


def exec_result_json(ended: ExecEnded, pages: Callable[[str], Iterable[bytes]]) -> Iterator[bytes]:
    """The API's exec result (ExecResult in web/openapi.json) in pieces: how the command ended,
    then each stream once, in the form `ended` chose for it, from `pages(stream)`. Pure."""
    yield wire.encode_compact(exec_result_head(ended.final))[:-1]
    for name in EXEC_STREAMS:
        # Text was chosen for being no longer than base64: either form stays within it.
        yield from exec_stream_json(name, ended.encodings[name], pages(name),
                                    ended.final[f"{name}_truncated"],
                                    base64_length(ended.sizes[name]))
    yield b"}"


def exec_stream_line(document: dict[str, Any]) -> bytes:
    """One line of a streamed exec answer (application/x-ndjson). Pure."""
    return wire.encode_compact(document) + b"\n"


def exec_output_line(name: str, data: bytes) -> bytes:
    """A page of one stream's output, as a streamed exec answer carries it. Pure."""
    return exec_stream_line({f"{name}Base64": base64.b64encode(data).decode("ascii")})


def exec_end_line(final: dict[str, Any]) -> bytes:
    """A streamed exec answer's last line: how the command ended (exec_result_head) and
    whether each stream was truncated; the whole answer's fields but the streams. Pure."""
    return exec_stream_line({**exec_result_head(final),
                             **{f"{name}Truncated": final[f"{name}_truncated"] for name in EXEC_STREAMS}})


def file_route_path(api_path: str) -> str:
    """The workspace path a files or list route (a path below /api/v1) names: what follows
    /sessions/ID/files/ (or /list/), percent-decoded; "" is the root."""
    parts = api_path.split("?", 1)[0].strip("/").split("/", 3)
    return urllib.parse.unquote(parts[3]) if len(parts) > 3 else ""


@dataclass(frozen=True)
class FileQuery:
    """What a files route's path and query name: the root, the path below it, and for an
    upload only the mode to give the file and the sha256 its bytes must have (checked by the
    agent before it commits them)."""

    root: str
    path: str
    mode: Optional[int] = None
    sha256: Optional[str] = None

    def for_reading(self) -> FileQuery:
        """This query, refused if it carries what only an upload takes."""
        if self.mode is not None or self.sha256 is not None:
            raise BadRequest("mode, sha256: only for uploads")
        return self


def file_query(query: str, path: str) -> FileQuery:
    """A files route's path (file_route_path) and query: ?root=workspace|home|container,
    ?mode=0755 (octal), ?sha256=HEX (64 lower-case hex digits). An absolute path
    (`files//etc/x`, or `files/%2Fetc%2Fx`) starts at the container's `/`: its root is
    `container`."""
    params = urllib.parse.parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(params) - {"root", "mode", "sha256"})
    if unknown:
        raise BadRequest(f"unknown query parameter(s): {', '.join(unknown)}")
    given = params["root"][-1] if params.get("root") else None
    if given is not None and given not in FILE_ROOTS:
        raise BadRequest(f"root: must be one of {', '.join(FILE_ROOTS)}")
    root = "container" if path.startswith("/") else given or "workspace"
    if given not in (None, root):
        raise BadRequest(f"root: an absolute path starts at the container's /, not at {given}")
    mode_text = params["mode"][-1] if params.get("mode") else None
    if mode_text is not None and not re.fullmatch(r"0?[0-7]{1,4}", mode_text):
        raise BadRequest("mode: an octal mode such as 0644")
    sha256 = params["sha256"][-1] if params.get("sha256") else None
    if sha256 is not None and not _SHA256_HEX.fullmatch(sha256):
        raise BadRequest("sha256: 64 lower-case hex digits")
    return FileQuery(root, path.lstrip("/") if root == "container" else path,
                     None if mode_text is None else int(mode_text, 8), sha256)


def iso_time(seconds: float) -> str:
    """A Unix time as seed 002's date-time: RFC 3339 in UTC, microseconds, `Z`."""
    moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def is_shown(record: SessionRecord) -> bool:
    """Whether the API shows the session at all (WIRE_STATES: not while created or deleted)."""
    return record.state in WIRE_STATES


def has_container(record: SessionRecord) -> bool:
    """Whether the session has a container as a client sees it (seed 002's `pod`): active and
    idle on the wire; a restore's has none until it is done, and a deleted one none at all."""
    return record.state in (SessionState.ACTIVE, SessionState.IDLE, SessionState.SNAPSHOTTING)


def session_json(record: SessionRecord, idle_after_s: float, snapshot_after_s: float,
                 resources: tuple[float, int] = (DEFAULT_SESSION_CPUS, DEFAULT_SESSION_DISK_MIB)) -> dict[str, Any]:
    """A session as seed 002's Session has it, then Reploy's additions. No field is ever null:
    one that does not apply is left out. Nothing secret is in a record, so nothing leaks here.
    The countdowns run from the idle clock's start (decide_reap) and stop while something
    blocks it. `resources` are its (cpus, diskMib) (ServeConfig.resources)."""
    spec = record.spec
    state, phase = WIRE_STATES[record.state]
    document: dict[str, Any] = {"id": record.id, "name": record.name,
                                "workloadType": WIRE_WORKLOAD_TYPES[spec.workload],
                                "state": state.value}
    if spec.workload == "agent":  # a record from before the alias existed may hold none
        document["model"] = spec.model or PLATFORM_DEFAULT_MODEL
    if record.container_id and has_container(record):
        document["pod"] = record.container_id
    document["createdAt"] = iso_time(record.created_at)
    document["lastAccess"] = iso_time(record.last_access)
    if state is SessionState.SNAPSHOT and record.archive:
        document["checkpoint"] = {"ref": record.archive, "sizeBytes": record.snapshot_bytes or 0,
                                  "createdAt": iso_time(record.checkpoint_at or record.state_since)}
    document.update({"deployment": spec.deployment, "generation": spec.generation,
                     "version": record.version, "stateSince": iso_time(record.state_since)})
    if phase is not None:
        document["phase"] = phase
    document["labels"] = dict(record.labels)
    document["cpus"], document["diskMib"] = resources
    document["egress"] = list(spec.egress)
    if record.expires_at is not None:
        document["expiresAt"] = iso_time(record.expires_at)
    blocked = record.idle_blocked_by if record.state in (SessionState.ACTIVE, SessionState.IDLE) else ()
    document["idleBlockedBy"] = [block.value for block in blocked]
    idle_since = idle_clock_start(record.last_access, record.busy_at)
    if record.state is SessionState.ACTIVE and not blocked:
        document["idleAt"] = iso_time(idle_since + idle_after_s)
    if record.state in (SessionState.ACTIVE, SessionState.IDLE) and not blocked:
        document["snapshotAt"] = iso_time(max(idle_since + snapshot_after_s,
                                              record.snapshot_retry_at or 0.0))
    if record.failed_step is not None:
        failure: dict[str, Any] = {"step": record.failed_step, "reason": record.failure or "",
                                   "at": iso_time(record.failed_at or record.state_since)}
        if record.failed_step == "snapshot":
            failure["failures"] = record.snapshot_failures
            if record.snapshot_retry_at is not None:
                failure["retryAt"] = iso_time(record.snapshot_retry_at)
        document["lastFailure"] = failure
    return document


def access_path(branch: str, verb: str) -> str:
    """Seed 002's `path` of a read or write: the branch that served it."""
    return branch if branch == "active" else f"{branch}->{verb}"


def utf8_complete_prefix(data: bytes) -> bytes:
    """The longest prefix of `data` that does not end inside a UTF-8 code point."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return data
        if byte >= 0xC0:  # a lead byte: is its sequence complete?
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data if back >= need else data[:-back]
    return data


#: The second byte of a UTF-8 sequence is narrower after these lead bytes (no overlong forms,
#: no surrogates, nothing past U+10FFFF); after any other lead it is 0x80..0xBF, as is every
#: later continuation byte.
_UTF8_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def utf8_pending_bytes(data: bytes | bytearray) -> int:
    """How many bytes at the end of `data` begin a code point that later bytes can still
    complete (0 to 3): a valid lead byte and the valid continuation bytes after it, fewer than
    its sequence needs."""
    for back in range(1, min(3, len(data)) + 1):
        lead = data[-back]
        if 0x80 <= lead <= 0xBF:
            continue  # a continuation byte: its lead is further back
        need = (2 if 0xC2 <= lead <= 0xDF else 3 if 0xE0 <= lead <= 0xEF
                else 4 if 0xF0 <= lead <= 0xF4 else 0)
        if back >= need:
            return 0  # ASCII, an invalid lead, or a sequence with all its bytes
        low, high = _UTF8_SECOND_BYTE.get(lead, (0x80, 0xBF))
        return back if back == 1 or low <= data[-back + 1] <= high else 0
    return 0


_SUBSTITUTES = {0xDC80 + byte: SUBSTITUTE_CHAR for byte in range(128)}


def text_pieces(data: bytes | memoryview) -> Iterator[str]:
    """Output bytes as seed 002's text `payload`, a slice of at most READ_SLICE_BYTES at a
    time, whose UTF-8 length is exactly the bytes' length. The rule: every complete, valid UTF-8
    sequence is itself; every byte of an invalid one is SUBSTITUTE_CHAR, one byte for one byte.
    Give it the bytes up to text_cut: a code point they end inside of is the next read's. Agent
    (claude-code) output is valid UTF-8 whose cursors fall between code points, so for it the
    text is the bytes exactly."""
    # surrogateescape turns each byte of an invalid sequence into one lone surrogate, U+DC80+b;
    # the incremental decoder keeps a sequence cut between two slices whole.
    decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    for start in range(0, len(data), READ_SLICE_BYTES):
        end = start + READ_SLICE_BYTES
        yield decoder.decode(data[start:end], final=end >= len(data)).translate(_SUBSTITUTES)


def text_cut(data: bytes | bytearray) -> int:
    """Where a text payload of `data` ends: before a code point the bytes end inside of and
    later bytes can still complete (utf8_pending_bytes: at most 3, which the next read has)."""
    return len(data) - utf8_pending_bytes(data)


def text_payload(data: bytes) -> tuple[str, int]:
    """The whole text payload of `data` and the cursor's advance (text_pieces, text_cut)."""
    kept = text_cut(data)
    return "".join(text_pieces(data[:kept])), kept


def read_result_json(head: dict[str, Any], data: bytes | memoryview) -> Iterator[bytes]:
    """A ReadResult's JSON in pieces: `head` (session, path, nextOffset), then `payload`, the
    text of `data` (all of it: cut it with text_cut first), then Reploy's `payloadBase64`, the
    same bytes. A piece holds at most one slice, so an answer of the log's whole cap is never
    whole in memory."""
    yield wire.encode_compact(head)[:-1] + b',"payload":"'
    for piece in text_pieces(data):
        yield json.dumps(piece, ensure_ascii=False)[1:-1].encode()  # as encode_compact, unquoted
    yield b'","payloadBase64":"'
    for start in range(0, len(data), READ_SLICE_BYTES):  # a multiple of 3: pieces join whole
        yield base64.b64encode(data[start:start + READ_SLICE_BYTES])
    yield b'"}'


@dataclass(frozen=True)
class LogPage:
    """One agent `read_fd` answer's window, read: the bytes from `offset`, and the log's length
    then. `past_end`: the offset was beyond the log's length (no bytes)."""

    offset_bytes: int
    data: bytearray
    length_bytes: int
    past_end: bool

    @classmethod
    def from_window(cls, answer: dict[str, Any], fd: int, text: bool) -> "LogPage":
        """A `read_fd` answer parse_agent_result checked (its offset, its bounds, its
        consistency) and the descriptor it carried (check_descriptor: a regular file open
        read-only), as a page: the window's bytes, exactly (a file that holds fewer is a
        BadGateway), of the workload's kind (text: claude-code's output, valid UTF-8)."""
        if (answer["kind"] == "text") != text:
            raise BadGateway("the session agent's read_fd answer is not of its workload's kind")
        data = pread_exactly(fd, window_bytes(answer), answer["offset"])
        if text:
            require_utf8(data)
        return cls(answer["offset"], data, answer["length"], answer["reset"])


def window_bytes(answer: dict[str, Any]) -> int:
    """How many bytes a `read_fd` answer's window holds: none for a reset (its next_offset is
    the log's length, behind the offset)."""
    return 0 if answer["reset"] else answer["next_offset"] - answer["offset"]


def pread_exactly(fd: int, size_bytes: int, offset_bytes: int) -> bytearray:
    """size_bytes of fd from offset_bytes, read straight into one buffer; BadGateway when the
    file ends first (a descriptor an agent sent is hostile input: its file may be shorter than
    the window it came with)."""
    data = bytearray(size_bytes)
    view, done = memoryview(data), 0
    while done < size_bytes:
        got = os.preadv(fd, [view[done:]], offset_bytes + done)
        if not got:
            raise BadGateway(f"the session agent's log holds {done} of the {size_bytes} bytes "
                             "its answer promised")
        done += got
    return data


def require_utf8(data: bytearray) -> None:
    """BadGateway unless data is whole, valid UTF-8 (decoded a slice at a time, kept nowhere)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(data)
    try:
        for start in range(0, len(data), READ_SLICE_BYTES):
            end = start + READ_SLICE_BYTES
            decoder.decode(view[start:end], final=end >= len(data))
    except UnicodeDecodeError:
        raise BadGateway("the session agent's text log is not valid UTF-8") from None


# ============================================================================================
# the SSE encoder (pure)
# ============================================================================================

#: A stream's first frame, and its heartbeat while no output comes (seed 002's peer sends both).
SSE_CONNECTED = b": connected\n\n"
SSE_KEEPALIVE = b": keepalive\n\n"


def sse_output(offset_bytes: int, payload: bytes) -> bytes:
    """One `output` event: id = the next offset; the payload decodes to exactly
    nextOffset - offset bytes."""
    next_offset = offset_bytes + len(payload)
    data = wire.encode_compact({"offset": offset_bytes,
                                "payloadBase64": base64.b64encode(payload).decode("ascii"),
                                "nextOffset": next_offset}).decode()
    return f"id: {next_offset}\nevent: output\ndata: {data}\n\n".encode()


def sse_reset(length_bytes: int) -> bytes:
    """The cursor is ahead of the log: the client reads again from 0 (POST /read); the stream
    goes on from the log's length."""
    return f"id: {length_bytes}\nevent: reset\ndata: {{\"nextOffset\":{length_bytes}}}\n\n".encode()


def http_chunk(data: bytes, chunked: bool) -> bytes:
    """A piece of a body as it goes on the wire: one HTTP/1.1 chunk, or the bytes alone (a body
    that the closing connection ends). No bytes are no chunk (an empty one would end the body)."""
    return b"%x\r\n%s\r\n" % (len(data), data) if chunked and data else data


def reader_refusal(session_readers: int, all_readers: int, max_session_readers: int,
                   max_readers: int) -> Optional[str]:
    """Why one more reader of a session's stream is refused (None: it is taken), given the
    readers open now: the session's own bound first, then serve's."""
    if session_readers >= max_session_readers:
        return (f"too many readers: this session's output stream already has {session_readers}, "
                f"the most serve takes (--max-session-readers {max_session_readers}); close one, "
                "or read with POST /read")
    if all_readers >= max_readers:
        return (f"too many readers: serve already has {all_readers} output streams open, the "
                f"most it takes (--max-readers {max_readers}); close one, or read with POST /read")
    return None


def sse_cursor(last_event_id: Optional[str], query_offset: Optional[str]) -> int:
    """Where a stream starts: Last-Event-ID (a reconnect) wins over ?offset= when it is present
    and not empty; default 0. Each is seed 002's int64, at least 0."""
    for source, text in (("Last-Event-ID", last_event_id), ("offset", query_offset)):
        if text is None or text == "":
            continue
        if not re.fullmatch(r"[0-9]{1,19}", text) or int(text) > MAX_OFFSET:
            raise BadRequest(f"{source}: not a byte offset")
        return int(text)
    return 0


# ============================================================================================
# the output fan-out (pure): one follower of a session's log, many readers
# ============================================================================================


class FanoutStep(enum.Enum):
    """What a reader of a session's output does next (LogFanout.take)."""

    OUTPUT = "output"  # send `data`, the log's bytes from `offset`
    RESET = "reset"  # its cursor was ahead of the log: say so, and go on from `offset`
    BEHIND = "behind"  # its bytes are older than the window: read them from the log at `offset`
    WAIT = "wait"  # nothing for it yet: wait for the follower's wake-up
    DROPPED = "dropped"  # it took nothing for the stall bound while bytes waited for it
    ENDED = "ended"  # the session's container is gone: the stream ends


@dataclass(frozen=True)
class FanoutTake:
    step: FanoutStep
    offset: int = 0
    data: bytes = b""


@dataclass
class _Reader:
    cursor: int
    offered_at: float  # when it last came to take, or (caught up) when new bytes came for it


class LogFanout:
    """One session's output log as its follower saw it, and each reader's cursor. The follower
    reads each new slice of the log once (feed); readers take from the window of its newest
    bytes (at most `window_bytes`, kept only as far back as the slowest reader within it); a
    reader older than the window (a reconnect from far back, or a burst it could not keep up
    with) is told to read the file itself (BEHIND), so no reader waits for another and nothing
    grows without bound. A reader that has taken nothing for `stall_s` while bytes waited for it
    is dropped, as a stream's stalled socket is. `text`: claude-code output, whose cursors stay
    on code-point boundaries. No sockets, no threads, no clock of its own: `now` is fed in."""

    def __init__(self, window_bytes: int, chunk_bytes: int, stall_s: float, text: bool) -> None:
        self.window_bytes, self.chunk_bytes, self.stall_s, self.text = (
            window_bytes, chunk_bytes, stall_s, text)
        self.start = 0  # the window holds the log's bytes [start, end)
        self.window = bytearray()
        self.length: Optional[int] = None  # the log's length when the follower last looked
        self.ended = False
        self._readers: dict[int, _Reader] = {}
        self._dropped: set[int] = set()
        self._next_id = 0

    @property
    def end(self) -> int:
        return self.start + len(self.window)

    @property
    def readers(self) -> int:
        return len(self._readers)

    def next_read(self) -> Optional[int]:
        """Where the follower reads next; None before its first look (it starts at the log's end)."""
        return None if self.length is None else self.end

    def join(self, cursor: int, now: float) -> int:
        """A new reader at `cursor`; its id."""
        self._next_id += 1
        self._readers[self._next_id] = _Reader(cursor, now)
        return self._next_id

    def leave(self, reader: int) -> None:
        self._readers.pop(reader, None)
        self._dropped.discard(reader)

    def end_all(self) -> None:
        self.ended = True

    def feed(self, length: int, data: bytes, now: float) -> tuple[int, ...]:
        """The follower looked: the log is `length` long, and `data` are its bytes from
        next_read() (none on the first look). A log shorter than what was seen (replaced) starts
        the window again at its length. The readers dropped now."""
        if self.length is None or length < self.end:
            self.start, self.window = length, bytearray()
        else:
            for state in self._readers.values():
                if data and state.cursor >= self.end:  # caught up: the new bytes wait from now
                    state.offered_at = now
            self.window += data
        self.length = length
        dropped = tuple(reader for reader, state in self._readers.items()
                        if state.cursor < self.length and now - state.offered_at >= self.stall_s)
        for reader in dropped:
            del self._readers[reader]
        self._dropped.update(dropped)
        self._trim()
        return dropped

    def _trim(self) -> None:
        within = [state.cursor for state in self._readers.values()
                  if self.start <= state.cursor <= self.end]
        keep_from = max(min(within, default=self.end), self.end - self.window_bytes)
        if keep_from > self.start:
            del self.window[:keep_from - self.start]
            self.start = keep_from

    def next_step(self, reader: int) -> FanoutStep:
        """What take(reader) would do now, nothing changed: the follower pushes a reader's next
        OUTPUT itself and wakes a reader only for what it must do itself (never for WAIT). An
        OUTPUT of claude-code text that holds no whole code point yet is taken as WAIT."""
        if reader in self._dropped:
            return FanoutStep.DROPPED
        if self.ended:
            return FanoutStep.ENDED
        cursor = self._readers[reader].cursor
        if self.length is None or cursor == self.end or self.end < cursor <= self.length:
            return FanoutStep.WAIT
        if cursor > self.length:
            return FanoutStep.RESET
        return FanoutStep.BEHIND if cursor < self.start else FanoutStep.OUTPUT

    def take(self, reader: int, now: float) -> FanoutTake:
        """What `reader` does next: at most chunk_bytes from its cursor, which moves past them."""
        step = self.next_step(reader)
        if step in (FanoutStep.DROPPED, FanoutStep.ENDED):
            return FanoutTake(step)
        state = self._readers[reader]
        state.offered_at = now  # it came to take: not stalled
        if step is FanoutStep.WAIT:
            return FanoutTake(step)
        if step is FanoutStep.RESET:
            state.cursor = self.length or 0
            return FanoutTake(step, state.cursor)
        if step is FanoutStep.BEHIND:
            return FanoutTake(step, state.cursor)
        at = state.cursor - self.start
        return self._advance(state, bytes(self.window[at:at + self.chunk_bytes]), now)

    def read_behind(self, reader: int, data: bytes, now: float) -> FanoutTake:
        """What `reader` sends of `data`, the log's bytes from its cursor that it read itself
        (BEHIND): no further than the log's length as the follower saw it (a cursor past that
        would be reset); WAIT when they hold no whole code point yet."""
        if reader in self._dropped:
            return FanoutTake(FanoutStep.DROPPED)
        state = self._readers[reader]
        seen = (self.length or 0) - state.cursor
        return self._advance(state, data[:max(min(self.chunk_bytes, seen), 0)], now)

    def _advance(self, state: _Reader, data: bytes, now: float) -> FanoutTake:
        if self.text:  # every cursor we issue for agent text is a code-point boundary
            data = utf8_complete_prefix(data)
        if not data:
            return FanoutTake(FanoutStep.WAIT)
        offset, state.cursor, state.offered_at = state.cursor, state.cursor + len(data), now
        return FanoutTake(FanoutStep.OUTPUT, offset, data)


# ============================================================================================
# who may drive serve (pure)
# ============================================================================================
#
# `serve` runs on the user's own machine while the user browses the web, so any page could
# send it requests, and a page that rebinds its DNS name to 127.0.0.1 could even read the
# answers. Every request is therefore decided here, from its method, target and headers and
# the server's policy alone, before any route runs and before its body is read:
#
#   1. Host must name this server: one of the listen address's own names, or --allow-host
#      (421 otherwise). A rebound page still sends its own name, so this stops DNS rebinding,
#      even for a client holding a stolen token.
#   2. The UI's static files need no credentials (they hold no data). The browser's login URL
#      carries the token in its fragment (LOGIN_FRAGMENT), which only the UI reads.
#   3. Under /api/v1, a browser request from elsewhere is refused (403): an Origin other than
#      this server's own, or Sec-Fetch-Site saying another site (pages on another port of the
#      same loopback address are *same-site*).
#   4. Then credentials (401): `Authorization: Bearer TOKEN`, the only kind there is: no
#      cookie, and a token in an API query string is never one. A browser attaches nothing
#      by itself, so a page elsewhere cannot borrow the user's credential; only the UI, from
#      its own tab's sessionStorage, sends it.
#   5. A body must be application/json (415): the only kinds a page can send across origins
#      without a preflight (forms, text/plain) are refused, and preflights get no CORS headers.
#      The one exception is the upload route (RAW_BODY_ROUTES), which takes raw bytes as
#      application/octet-stream or application/x-tar in a PUT, itself never preflight-free.
#
# Tokens are compared in constant time. No message names a credential.


@dataclass(frozen=True)
class AccessPolicy:
    """One server's credential and names."""

    token: str = field(repr=False)
    allowed_hosts: frozenset[str]


def is_loopback_listen(host: str) -> bool:
    """Whether a --listen host (an IP address or `localhost`) stays on this machine."""
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


def allowed_hosts(listen_host: str, machine_names: Iterable[str],
                  extra: Iterable[str]) -> frozenset[str]:
    """The Host names (lowercase, IPv6 without brackets) a server on `listen_host` answers
    for: the loopback names for a loopback listen; for any other address that address and the
    machine's own names and addresses (`machine_names`), plus the loopback names when it is a
    wildcard (0.0.0.0, ::) that includes loopback; and every --allow-host in `extra`."""
    if is_loopback_listen(listen_host):
        own = set(LOOPBACK_HOST_NAMES) | ({listen_host} if listen_host != "localhost" else set())
    else:
        address = ipaddress.ip_address(listen_host)
        own = {name.lower() for name in machine_names}
        own |= set(LOOPBACK_HOST_NAMES) if address.is_unspecified else {str(address)}
    return frozenset(own | {name.lower() for name in extra})


_AUTHORITY = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^\[\]:/@?#\s]+)(?::([0-9]{1,5}))?")
DEFAULT_PORTS = {"http": 80, "https": 443}


def split_authority(text: str) -> tuple[str, Optional[int]]:
    """A Host header's (name, port): the name lowercase, IPv6 without brackets, the port None
    when absent. BadRequest when it is not `name[:port]`."""
    match = _AUTHORITY.fullmatch(text)
    if not match or (match.group(2) is not None and not 0 < int(match.group(2)) <= 65535):
        raise BadRequest("the Host header is not NAME[:PORT]")
    port = None if match.group(2) is None else int(match.group(2))
    return match.group(1).strip("[]").lower(), port


def is_same_origin(origin: str, host_name: str, host_port: Optional[int]) -> bool:
    """Whether an Origin header names the server the Host header names (http or https, which a
    TLS proxy in front adds; default ports filled in on both sides)."""
    scheme, separator, authority = origin.partition("://")
    if not separator or scheme not in DEFAULT_PORTS:
        return False  # includes "null": sandboxed frames, file: pages
    try:
        name, port = split_authority(authority)
    except BadRequest:
        return False
    default = DEFAULT_PORTS[scheme]
    return name == host_name and (port or default) == (host_port or default)


def is_api_path(path: str) -> bool:
    """Whether a request path belongs to the API (and needs credentials)."""
    return path == API_PREFIX or path.startswith(API_PREFIX + "/")


def same_secret(given: str, expected: str) -> bool:
    """Constant-time comparison of a presented credential with ours."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode())


def _single_header(headers: Sequence[tuple[str, str]], name: str) -> Optional[str]:
    values = [value for key, value in headers if key.lower() == name]
    if len(values) > 1:
        raise BadRequest(f"more than one {name} header")
    return values[0] if values else None


def _is_json_media_type(content_type: Optional[str]) -> bool:
    media_type, _, parameters = (content_type or "").partition(";")
    return media_type.strip().lower() == "application/json" and parameters.strip().lower() in (
        "", "charset=utf-8", 'charset="utf-8"')


#: The one API path that needs no credential (seed 002: "No auth").
HEALTH_PATH = API_PREFIX + "/healthz"
UNAUTHORIZED_MESSAGE = ("authentication required: send Authorization: Bearer TOKEN "
                        "(STATE_DIR/token), or open the login_url printed by `reploy serve`")


def decide_access(method: str, target: str, headers: Sequence[tuple[str, str]],
                  policy: AccessPolicy) -> None:
    """Returns when the request may be routed, else raises the ServeError that refuses it (the
    rules above). `target` is the request target as sent (path and query); `headers` every
    header line."""
    if not target.startswith("/"):
        raise BadRequest("the request target must be a path (this server is not a proxy)")
    host = _single_header(headers, "host")
    if host is None:
        raise BadRequest("a Host header is required")
    host_name, host_port = split_authority(host)
    if host_name not in policy.allowed_hosts:
        raise MisdirectedRequest(f"this server does not answer for Host {host[:100]!r} "
                                 "(a reverse proxy's name needs --allow-host)")
    path, _, query = target.partition("?")
    if not is_api_path(path):
        return
    origin = _single_header(headers, "origin")
    if origin is not None and not is_same_origin(origin, host_name, host_port):
        raise Forbidden("requests from another origin are refused")
    if (_single_header(headers, "sec-fetch-site") or "").lower() in ("cross-site", "same-site"):
        raise Forbidden("requests from another site are refused")
    authorization = _single_header(headers, "authorization")
    if path == HEALTH_PATH:
        pass  # no credential: it holds no secret, and probes and load balancers call it
    elif authorization is None:
        in_url = "token" in urllib.parse.parse_qs(query, keep_blank_values=True)
        raise Unauthorized(UNAUTHORIZED_MESSAGE + (" (a token in an API URL is not accepted)"
                                                   if in_url else ""))
    else:
        scheme, _, credential = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not same_secret(credential.strip(), policy.token):
            raise Unauthorized("wrong credentials: " + UNAUTHORIZED_MESSAGE)
    has_body = (_single_header(headers, "content-length") or "0").strip() != "0" or (
        _single_header(headers, "transfer-encoding") is not None)
    content_type = _single_header(headers, "content-type")
    raw_types = _raw_body_types(method, path)
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if has_body and not (_is_json_media_type(content_type) or media_type in raw_types):
        raise UnsupportedMediaType("request bodies must be Content-Type: "
                                   + " or ".join(raw_types or ("application/json",)))


def _raw_body_types(method: str, path: str) -> tuple[str, ...]:
    """The content types of raw bytes the request's route takes (RAW_BODY_ROUTES: the upload
    route), else none. Those are not CORS-safelisted, and PUT never is, so a page elsewhere
    still cannot send them without a preflight, which gets no CORS answer."""
    try:
        handler, _ = match_route(method, path[len(API_PREFIX):])
    except ServeError:
        return ()
    return RAW_BODY_ROUTES.get(handler, ())


# ============================================================================================
# the agent's answers (pure)
# ============================================================================================
#
# Every answer of every agent is hostile input: the session's workload may have found a way to
# answer in its agent's place, and a broken agent is no better. So each answer family (one per
# verb of docs/agent.md) has one strict parser here, and nothing else reads an answer. A parser
# checks the type, range or enum of every field serve uses, checks what the request fixes (the
# offset asked for, the id it named, the bytes it sent), decodes base64 once, and returns a new
# dict holding only what it checked: a field it does not know is never passed on. Names of
# directory entries are single path components (no `/`, NUL or control character, not `.` or
# `..`), since the UI builds URLs from them. An answer that fails is an AgentCallError with the
# code INVALID_ANSWER, which fails that one request with 502 and changes nothing else.


class AnswerInvalid(ValueError):
    """One field of an answer does not fit its rule (the message says which, never its value)."""


#: The error codes an agent may answer with (docs/agent.md), plus `disk_full`: its session's
#: disk quota is used up.
AGENT_ERROR_CODES = frozenset({"invalid_request", "command_error", "timeout", "server_unavailable",
                               "disk_full"})
#: serve's own code for an answer that is not one: never an agent's (those are checked above).
INVALID_ANSWER = "invalid_answer"
#: The longest agent error message passed on (longer ones are cut, and marked so).
MAX_AGENT_MESSAGE_CHARS = client_role.MAX_MESSAGE_CHARS
MAX_FILE_SIZE_BYTES = 2**63 - 1
MAX_PID = 2**22  # Linux's pid_max ceiling
_HANDLE_ID = agent_role.HANDLE_ID_RE  #: exec and transfer ids
_SHA256_HEX = agent_role.SHA256_HEX_RE
_SIGNAL_NAME = re.compile(r"SIG[A-Z0-9]{1,12}")
#: C0 and C1 controls and DEL: never in an entry name, a link target or a path serve passes on.
_CONTROL_CHARACTERS = client_role.CONTROL_CHARACTERS
ENTRY_TYPES = ("file", "directory", "symlink", "fifo", "socket", "char-device", "block-device",
               "unknown")
Check = Callable[[Any], Any]


def _integer(low: int, high: int) -> Check:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise AnswerInvalid(f"is not an integer from {low} to {high}")
        return value
    return check


def _number(low: float, high: float) -> Check:
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise AnswerInvalid(f"is not a number from {low:g} to {high:g}")
        return value
    return check


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise AnswerInvalid("is not true or false")
    return value


def _one_of(*choices: str) -> Check:
    def check(value: Any) -> str:
        if value not in choices or not isinstance(value, str):
            raise AnswerInvalid(f"is not one of {', '.join(choices)}")
        return value
    return check


def _matching(pattern: re.Pattern[str]) -> Check:
    def check(value: Any) -> str:
        if not isinstance(value, str) or not pattern.fullmatch(value):
            raise AnswerInvalid(f"does not match {pattern.pattern}")
        return value
    return check


def _nullable(inner: Check) -> Check:
    def check(value: Any) -> Any:
        return None if value is None else inner(value)
    return check


def _text(max_bytes: int) -> Check:
    """Any text (terminal output is what it is) that UTF-8 can hold (no lone surrogate escape),
    bounded."""
    def check(value: Any) -> str:
        try:
            size_bytes = len(value.encode("utf-8")) if isinstance(value, str) else max_bytes + 1
        except UnicodeEncodeError:
            raise AnswerInvalid("holds a lone surrogate escape") from None
        if size_bytes > max_bytes:
            raise AnswerInvalid(f"is not a string of at most {max_bytes} bytes")
        return value
    return check


def _plain_text(max_bytes: int) -> Check:
    """Text without NUL or any control character (a path, a link target), bounded."""
    bounded = _text(max_bytes)

    def check(value: Any) -> str:
        if _CONTROL_CHARACTERS.search(bounded(value)):
            raise AnswerInvalid("holds a control character")
        return value
    return check


def _base64(max_bytes: int) -> Check:
    """Base64 of at most max_bytes: the decoded bytes are what serve keeps."""
    def check(value: Any) -> bytes:
        if not isinstance(value, str) or len(value) > 4 * -(-max_bytes // 3):
            raise AnswerInvalid(f"is not base64 of at most {max_bytes} bytes")
        try:
            data = base64.b64decode(value, validate=True)
        except ValueError:
            raise AnswerInvalid("is not base64") from None
        if len(data) > max_bytes:
            raise AnswerInvalid(f"is not base64 of at most {max_bytes} bytes")
        return data
    return check


def is_entry_name(name: Any) -> bool:
    """A directory entry's name as the UI may put it in a URL: one path component."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and not _CONTROL_CHARACTERS.search(name)
            and len(name.encode("utf-8", "surrogatepass")) <= agent_role.MAX_NAME_BYTES)


@dataclass(frozen=True)
class AnswerField:
    """One field of an answer: its wire name, its check, whether it must be there, and the name
    serve keeps it under (base64 fields are kept decoded, under a name without _b64)."""

    name: str
    check: Check
    required: bool = True
    keep_as: Optional[str] = None


def _parse_fields(document: Any, fields: Sequence[AnswerField], where: str) -> dict[str, Any]:
    """The checked fields of one JSON object, and nothing else of it."""
    if not isinstance(document, dict):
        raise AnswerInvalid(f"{where} is not an object")
    parsed: dict[str, Any] = {}
    for rule in fields:
        if rule.name not in document:
            if rule.required:
                raise AnswerInvalid(f"{where}.{rule.name} is missing")
            continue
        try:
            parsed[rule.keep_as or rule.name] = rule.check(document[rule.name])
        except AnswerInvalid as e:
            raise AnswerInvalid(f"{where}.{rule.name} {e}") from None
    return parsed


_ENTRY_FIELDS = (
    AnswerField("name", _text(agent_role.MAX_NAME_BYTES)),  # checked per use: see below
    AnswerField("type", _one_of(*ENTRY_TYPES)),
    AnswerField("size", _integer(0, MAX_FILE_SIZE_BYTES)),
    AnswerField("mode", _integer(0, 0o7777)),
    AnswerField("mtime", _number(-2.0**40, 2.0**40)),
    AnswerField("target", _plain_text(agent_role.MAX_PATH_BYTES), required=False),
)


def parse_entry(document: Any, where: str, name: Optional[str] = None) -> dict[str, Any]:
    """A `stat` or `list` entry. A listed entry's name is one path component; the entry a path
    names (`name` given) bears that path's last component, or `.` for the root."""
    entry = _parse_fields(document, _ENTRY_FIELDS, where)
    if name is None and not is_entry_name(entry["name"]):
        raise AnswerInvalid(f"{where}.name is not one path component (no /, NUL or control "
                            "character, not . or ..)")
    if name is not None and entry["name"] != name:
        raise AnswerInvalid(f"{where}.name is not the name of the path asked for")
    if "target" in entry and entry["type"] != "symlink":
        raise AnswerInvalid(f"{where}.target is only for a symlink")
    return entry


def _entries(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or len(value) > agent_role.MAX_LIST_ENTRIES:
        raise AnswerInvalid(f"is not an array of at most {agent_role.MAX_LIST_ENTRIES} entries")
    entries = [parse_entry(item, f"[{index}]") for index, item in enumerate(value)]
    if len({entry["name"] for entry in entries}) != len(entries):
        raise AnswerInvalid("names one entry twice")
    return entries


def _path_parts(params: dict[str, Any]) -> tuple[str, ...]:
    """The components of the path a request named, as the agent reads them."""
    return agent_role.parse_relative_path(params.get("path", ""))


def _named_entry(params: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """An answer's `entry` for the path the request named (the root's is `.`)."""
    parts = _path_parts(params)
    return parse_entry(answer.get("entry"), "entry", parts[-1] if parts else ".")


def _require(condition: bool, reason: str) -> None:
    if not condition:
        raise AnswerInvalid(reason)


_COUNT = _integer(0, 2**62)
_OFFSET = _integer(0, MAX_OFFSET)
_SIDE = _integer(1, agent_role.MAX_TERMINAL_SIDE)
_PID = _integer(1, MAX_PID)
_ROOT = _one_of(*FILE_ROOTS)

#: The fields of each verb's result (docs/agent.md), besides `type`. Optional fields are the
#: ones a workload kind, a state, or an older agent may leave out.
ANSWER_FIELDS: dict[str, tuple[AnswerField, ...]] = {
    "status": (
        AnswerField("workload", _one_of("shell", "agent")),
        AnswerField("turn_state", _one_of("idle", "in_progress", "waiting")),
        AnswerField("busy", _boolean, required=False),
        AnswerField("quiet_ms", _COUNT, required=False),
        AnswerField("pid", _nullable(_PID), required=False),
        AnswerField("queue_depth", _COUNT, required=False),
        AnswerField("queue_bytes", _COUNT, required=False),
        AnswerField("log_bytes", _COUNT, required=False),
        AnswerField("log_capped", _boolean, required=False),
        AnswerField("admission_open", _boolean, required=False),
        AnswerField("awaiting_restore", _boolean, required=False),
        AnswerField("running", _boolean, required=False),
        AnswerField("exit_code", _nullable(_integer(-255, 255)), required=False),
        AnswerField("columns", _SIDE, required=False),
        AnswerField("rows", _SIDE, required=False),
        AnswerField("continue", _boolean, required=False)),
    "read": (
        AnswerField("offset", _OFFSET), AnswerField("next_offset", _OFFSET),
        AnswerField("length", _OFFSET), AnswerField("reset", _boolean),
        AnswerField("data_b64", _base64(MAX_READ_BYTES), required=False, keep_as="data"),
        AnswerField("text", _text(MAX_READ_BYTES), required=False)),
    "read_fd": (
        AnswerField("offset", _OFFSET), AnswerField("next_offset", _OFFSET),
        AnswerField("length", _OFFSET), AnswerField("reset", _boolean),
        AnswerField("kind", _one_of("text", "bytes"))),
    "write": (AnswerField("bytes", _COUNT),),
    "message": (
        AnswerField("delivery", _one_of("dispatched", "queued", "drafted")),
        AnswerField("queue_depth", _COUNT),
        AnswerField("draft", _matching(_HANDLE_ID), required=False),
        AnswerField("draft_bytes", _COUNT, required=False)),
    "interrupt": (AnswerField("cancelled", _boolean),),
    "relaunch": (AnswerField("pid", _nullable(_PID)),),
    "resize": (AnswerField("columns", _SIDE), AnswerField("rows", _SIDE)),
    "checkpoint": (
        AnswerField("id", _matching(agent_role.CHECKPOINT_ID_RE)),
        AnswerField("path", _plain_text(agent_role.MAX_PATH_BYTES)), AnswerField("bytes", _COUNT),
        AnswerField("log_bytes", _COUNT),
        AnswerField("skipped_entries", _COUNT)),
    "suspend": (AnswerField("seq", _COUNT),),
    "egress_note": (AnswerField("seq", _nullable(_COUNT)),),  # null: no room beyond the reserve
    "exec": (AnswerField("exec_id", _matching(_HANDLE_ID)), AnswerField("pid", _nullable(_PID)),
             AnswerField("queued", _boolean, required=False),
             AnswerField("stdout_path", _plain_text(agent_role.MAX_PATH_BYTES), required=False),
             AnswerField("stderr_path", _plain_text(agent_role.MAX_PATH_BYTES), required=False)),
    "exec_wait": (
        AnswerField("exec_id", _matching(_HANDLE_ID)), AnswerField("running", _boolean),
        AnswerField("queued", _boolean, required=False),
        AnswerField("pid", _nullable(_PID)), AnswerField("exit_code", _nullable(_integer(0, 255))),
        AnswerField("signal", _nullable(_matching(_SIGNAL_NAME))),
        AnswerField("timed_out", _boolean), AnswerField("killed", _boolean),
        AnswerField("duration_ms", _number(0, 2.0**53)),
        *(field for stream in ("stdout", "stderr") for field in (
            AnswerField(f"{stream}_b64", _base64(agent_role.EXEC_PAGE_BYTES), keep_as=stream),
            AnswerField(f"{stream}_next_offset", _integer(0, MAX_EXEC_OUTPUT_BYTES)),
            AnswerField(f"{stream}_bytes", _integer(0, MAX_EXEC_OUTPUT_BYTES)),
            AnswerField(f"{stream}_truncated", _boolean)))),
    "exec_kill": (AnswerField("exec_id", _matching(_HANDLE_ID)), AnswerField("killed", _boolean)),
    "stat": (AnswerField("root", _ROOT), AnswerField("path", _plain_text(agent_role.MAX_PATH_BYTES))),
    "list": (AnswerField("root", _ROOT), AnswerField("path", _plain_text(agent_role.MAX_PATH_BYTES)),
             AnswerField("entries", _entries), AnswerField("total", _COUNT),
             AnswerField("next_offset", _COUNT)),
    "upload": (AnswerField("transfer_id", _matching(_HANDLE_ID)),),
    "upload_commit": (
        AnswerField("transfer_id", _matching(_HANDLE_ID)), AnswerField("done", _boolean),
        AnswerField("root", _ROOT, required=False),
        AnswerField("path", _plain_text(agent_role.MAX_PATH_BYTES), required=False),
        AnswerField("kind", _one_of("file", "tar"), required=False),
        AnswerField("bytes", _integer(0, MAX_UPLOAD_BYTES), required=False),
        AnswerField("entries", _integer(0, agent_role.MAX_ARCHIVE_ENTRIES), required=False),
        AnswerField("sha256", _matching(_SHA256_HEX), required=False)),
    "download": (AnswerField("transfer_id", _matching(_HANDLE_ID), required=False),
                 AnswerField("kind", _one_of("file", "tar")),
                 AnswerField("size", _nullable(_integer(0, MAX_UPLOAD_BYTES)))),
    "transfer_close": (AnswerField("transfer_id", _matching(_HANDLE_ID)),
                       AnswerField("closed", _boolean)),
}


def _check_read_window(method: str, params: dict[str, Any], answer: dict[str, Any],
                       size_bytes: int, default_max_bytes: int) -> None:
    """read and read_fd: a window of size_bytes at the offset asked for, no longer than asked,
    within the log; or a reset, empty, pointing at the log's end."""
    _require(answer["offset"] == params.get("offset", 0), f"{method}: offset is not the one asked for")
    _require(0 <= size_bytes <= params.get("max_bytes", default_max_bytes),
             f"{method}: more bytes than asked for")
    if answer["reset"]:
        _require(not size_bytes and answer["next_offset"] == answer["length"] < answer["offset"],
                 f"{method}: a reset carries no bytes and points at the log's end")
    else:
        _require(answer["next_offset"] == answer["offset"] + size_bytes <= answer["length"],
                 f"{method}: next_offset is not offset plus the bytes, within the log")


def _check_read(params: dict[str, Any], answer: dict[str, Any], raw: dict[str, Any]) -> None:
    _require(("data" in answer) != ("text" in answer), "read: exactly one of data_b64 and text")
    payload = answer["data"] if "data" in answer else answer["text"].encode("utf-8")
    _check_read_window("read", params, answer, len(payload), agent_role.DEFAULT_READ_BYTES)


def _check_read_fd(params: dict[str, Any], answer: dict[str, Any], raw: dict[str, Any]) -> None:
    _check_read_window("read_fd", params, answer, window_bytes(answer), MAX_LOG_WINDOW_BYTES)


def _base64_bytes(text: str) -> int:
    """How many bytes a valid base64 text (one we sent) decodes to, without decoding it."""
    return len(text) // 4 * 3 - text[-2:].count("=")


def _check_write(params: dict[str, Any], answer: dict[str, Any], raw: dict[str, Any]) -> None:
    _require(answer["bytes"] == _base64_bytes(params["data_b64"]),
             "write: bytes is not the number sent")


def _check_message(params: dict[str, Any], answer: dict[str, Any], raw: dict[str, Any]) -> None:
    drafted = answer["delivery"] == "drafted"
    _require(drafted == bool(params.get("more")), "message: drafted exactly when more is sent")
    _require(drafted == ("draft" in answer) == ("draft_bytes" in answer),
             "message: a draft answer carries its draft and draft_bytes")
    _require(not (drafted and "draft" in params) or answer["draft"] == params["draft"],
             "message: the draft is not the one named")


def _check_resize(params: dict[str, Any], answer: dict[str, Any], raw: dict[str, Any]) -> None:
    _require((answer["columns"], answer["rows"]) == (params["columns"], params["rows"]),
             "resize: not the size asked for")


def _check_checkpoint(params: dict[str, Any], answer: dict[str, Any], raw: dict[str, Any]) -> None:
    _require(answer["id"] == params["id"], "checkpoint: not the id asked for")


def _check_exec_wait(params: dict[str, Any], answer: dict[str, Any], raw: dict[str, Any]) -> None:
    _require(answer["exec_id"] == params["exec_id"], "exec_wait: not the exec asked for")
    if answer["running"]:
        _require(answer["exit_code"] is None and answer["signal"] is None,
                 "exec_wait: a running command has no exit code or signal")
    else:
        _require((answer["exit_code"] is None) != (answer["signal"] is None),
                 "exec_wait: an ended command has an exit code or a signal, not both")
    for stream in ("stdout", "stderr"):
        start = params.get(f"{stream}_offset", 0)
        _require(answer[f"{stream}_next_offset"] == start + len(answer[stream])
                 <= answer[f"{stream}_bytes"],
                 f"exec_wait: {stream}_next_offset is not the offset plus the bytes, within "
                 "the total")


def _check_exec_kill(params: dict[str, Any], answer: dict[str, Any], raw: dict[str, Any]) -> None:
    _require(answer["exec_id"] == params["exec_id"], "exec_kill: not the exec asked for")


def _check_path_answer(params: dict[str, Any], answer: dict[str, Any], raw: dict[str, Any]) -> None:
    """stat and list: the root and path asked for, and the entry the path names."""
    parts = _path_parts(params)
    _require(answer["root"] == params.get("root", "workspace") and
             answer["path"] == agent_role.shown_path(parts), "not the root and path asked for")
    answer["entry"] = _named_entry(params, raw)


def _check_list(params: dict[str, Any], answer: dict[str, Any], raw: dict[str, Any]) -> None:
    _check_path_answer(params, answer, raw)
    _require(answer["entry"]["type"] == "directory" or not answer["entries"],
             "list: only a directory has entries")
    _require(answer["next_offset"] == params.get("offset", 0) + len(answer["entries"]),
             "list: next_offset is not the offset plus the entries")


def _check_transfer(params: dict[str, Any], answer: dict[str, Any], raw: dict[str, Any]) -> None:
    _require(answer["transfer_id"] == params["transfer_id"], "not the transfer asked for")


def _check_upload_commit(params: dict[str, Any], answer: dict[str, Any], raw: dict[str, Any]) -> None:
    _check_transfer(params, answer, raw)
    facts = ("root", "path", "kind", "bytes", "entries", "sha256")
    _require(all(name in answer for name in facts) if answer["done"]
             else not any(name in answer for name in facts),
             "upload_commit: a done answer has its result, and only a done one")
    _require(not answer["done"] or answer["sha256"] == params.get("sha256", answer["sha256"]),
             "upload_commit: not the sha256 sent")


def _check_download(params: dict[str, Any], answer: dict[str, Any], raw: dict[str, Any]) -> None:
    answer["entry"] = _named_entry(params, raw)
    wanted = {"file": "file", "tar": "directory"}[answer["kind"]]
    _require(answer["entry"]["type"] == wanted, "download: the kind does not fit the entry")
    _require((answer["size"] is None) == (answer["kind"] == "tar") == ("transfer_id" in answer),
             "download: a file has a size, a tar has none and a transfer id")


#: What each answer must agree on with its request, or within itself, beyond its fields' rules.
ANSWER_CHECKS: dict[str, Callable[[dict[str, Any], dict[str, Any], dict[str, Any]], None]] = {
    "read": _check_read, "read_fd": _check_read_fd, "write": _check_write, "message": _check_message,
    "resize": _check_resize, "checkpoint": _check_checkpoint, "exec_wait": _check_exec_wait,
    "exec_kill": _check_exec_kill, "stat": _check_path_answer, "list": _check_list,
    "upload_commit": _check_upload_commit, "download": _check_download,
    "transfer_close": _check_transfer,
}


class AnswerDescriptor(enum.Enum):
    """What the one file descriptor on an answer must be (SCM_RIGHTS: the bytes of a file never
    cross the control socket): serve moves bytes through it only once fstat and its open mode
    agree, and never more than the answer declared or the API allows."""

    FILE_TO_READ = "a regular file open for reading"
    LOG_TO_READ = "a regular file open for reading only"
    STAGING = "an empty regular file open for writing"
    TAR_PIPE = "the read end of a pipe"


#: The verbs whose result carries exactly one descriptor, and the kind its result says it is;
#: every other answer (and every error) carries none.
ANSWER_DESCRIPTORS: dict[str, Callable[[dict[str, Any]], AnswerDescriptor]] = {
    "upload": lambda answer: AnswerDescriptor.STAGING,
    "read_fd": lambda answer: AnswerDescriptor.LOG_TO_READ,
    "download": lambda answer: (AnswerDescriptor.FILE_TO_READ if answer["kind"] == "file"
                                else AnswerDescriptor.TAR_PIPE),
}


def check_descriptor(fd: int, kind: AnswerDescriptor) -> None:
    """AnswerInvalid unless fd is what `kind` says (a socket, a directory, a device never is).
    A staging is never a memfd: what serve writes into one would be memory charged to serve,
    bounded by nothing but the upload's size."""
    st = os.fstat(fd)
    access = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    fits = {
        AnswerDescriptor.FILE_TO_READ: stat.S_ISREG(st.st_mode) and access in (os.O_RDONLY, os.O_RDWR),
        AnswerDescriptor.LOG_TO_READ: stat.S_ISREG(st.st_mode) and access == os.O_RDONLY,
        AnswerDescriptor.STAGING: (stat.S_ISREG(st.st_mode) and st.st_size == 0
                                   and access in (os.O_WRONLY, os.O_RDWR)
                                   and not os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")),
        AnswerDescriptor.TAR_PIPE: stat.S_ISFIFO(st.st_mode) and access == os.O_RDONLY,
    }[kind]
    _require(fits, f"the file descriptor sent is not {kind.value}")


def parse_agent_result(method: str, params: dict[str, Any], result: Any) -> dict[str, Any]:
    """A result of `method` asked with `params`: the checked fields only. AnswerInvalid says why
    it is not one."""
    _require(isinstance(result, dict) and result.get("type") == method,
             f"the result is not an object of type {method}")
    answer = _parse_fields(result, ANSWER_FIELDS[method], method)
    if method in ANSWER_CHECKS:
        ANSWER_CHECKS[method](params, answer, result)
    return answer


#: An agent's error message as serve passes it on (to a client, to its own log), and any text
#: from a sandbox in serve's log (SessionLog): control characters shown as escapes, cut.
safe_message = client_role.shown


def parse_agent_response(method: str, params: dict[str, Any], line: bytes) -> dict[str, Any]:
    """One response line of the agent: the checked result, or the agent's own error as
    AgentCallError (a code of AGENT_ERROR_CODES, a safe message). AnswerInvalid when it is
    neither."""
    try:
        # Every string kept is checked to be writable by its field's rule (_text, patterns).
        document = wire.parse_strict_object(line.removesuffix(b"\n"), writable=False,
                                            max_bytes=AGENT_MAX_RESPONSE_BYTES)
    except wire.ProtocolError as e:
        raise AnswerInvalid(f"the answer is not one JSON object ({e})") from None
    _require(document.get("id") == "serve" and set(document) in ({"id", "result"}, {"id", "error"}),
             "the answer is not {id, result} or {id, error} for this request")
    if "error" in document:
        error = document["error"]
        _require(isinstance(error, dict) and set(error) == {"code", "message"}
                 and error["code"] in AGENT_ERROR_CODES, "the error is not {code, message} with a "
                 "documented code")
        try:
            message = _text(AGENT_MAX_RESPONSE_BYTES)(error["message"])
        except AnswerInvalid as e:
            raise AnswerInvalid(f"error.message {e}") from None
        raise AgentCallError(error["code"], safe_message(message))
    return parse_agent_result(method, params, document["result"])


# ============================================================================================
# the agent's control socket (client side)
# ============================================================================================


class AgentCallError(ReployError):
    """The agent answered with an error (docs/agent.md codes), gave an answer that is not one
    (code INVALID_ANSWER), or did not answer at all (`transport` is then True and the code is
    server_unavailable)."""

    def __init__(self, code: str, message: str, transport: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.transport = transport


def agent_call(agent_dir: Path, method: str, params: dict[str, Any],
               timeout_s: float = AGENT_CALL_TIMEOUT_S) -> dict[str, Any]:
    """One request of a verb whose answer carries no descriptor (agent_exchange)."""
    assert method not in ANSWER_DESCRIPTORS, method
    return agent_exchange(agent_dir, method, params, timeout_s)[0]


def agent_exchange(agent_dir: Path, method: str, params: dict[str, Any],
                   timeout_s: float = AGENT_CALL_TIMEOUT_S,
                   connections: Optional["AgentConnections"] = None) -> tuple[dict[str, Any], Optional[int]]:
    """One request on AGENT_DIR/control.sock (ServeConfig.agent_dir); its checked result
    (parse_agent_response) and, for a verb of ANSWER_DESCRIPTORS, the one file descriptor it
    carried, checked (the caller closes it); or AgentCallError, every descriptor received closed.
    The workload cannot reach that directory, but serve does not rely on it (the agent itself may
    be compromised): the socket is reached only as a socket (connect_unix_at: never through a
    symlink), the whole call has one deadline (a peer that trickles bytes cannot hold the caller,
    the reaper among them), and the answer is bounded and parsed as hostile input.
    `connections`: the request asks the agent to keep the connection (docs/agent.md, `keep`),
    and goes on one of theirs when one is idle and was made to the socket the directory holds
    now; a connection kept is one whose answer was whole and valid. A kept connection the agent
    had closed before answering anything (its idle bound, a new container) is replaced by a new
    one, once."""
    keep = {"keep": True} if connections is not None else {}
    line = wire.encode_compact({"id": "serve", "method": method, "params": params, **keep}) + b"\n"
    if len(line) > AGENT_MAX_REQUEST_BYTES + 1:
        raise AgentCallError("invalid_request", f"too large: the {method} request encodes to "
                             f"{len(line) - 1} bytes; the session agent takes at most "
                             f"{AGENT_MAX_REQUEST_BYTES} (pass big input as a file)")
    deadline = time.monotonic() + timeout_s
    response = bytearray()
    fds: list[int] = []
    sock = identity = None
    try:
        try:
            if connections is not None:
                identity = socket_identity(agent_dir)
                sock = connections.take(agent_dir, identity)
            fds_cut = False
            if sock is not None:
                try:
                    fds_cut = _agent_round_trip(sock, line, deadline, response, fds)
                except ConnectionError:
                    pass  # as a hang-up: nothing was answered
                if not response:
                    sock.close()
                    sock = None
            if sock is None:
                with opened_dir(agent_dir) as dir_fd:
                    identity = _socket_identity_at(dir_fd)  # before: a socket swapped since is not kept
                    sock = agent_role.connect_unix_at(dir_fd, SOCKET_NAME, timeout_s)
                fds_cut = _agent_round_trip(sock, line, deadline, response, fds)
        except OSError as e:
            raise AgentCallError("server_unavailable", f"the session agent does not answer: {e}",
                                 transport=True) from e
        answer, newline, rest = bytes(response).partition(b"\n")
        if not newline and len(response) <= AGENT_MAX_RESPONSE_BYTES:
            raise AgentCallError("server_unavailable", "the session agent hung up before it "
                                 "answered", transport=True)
        try:
            _require(len(answer) < AGENT_MAX_RESPONSE_BYTES,
                     f"the answer is longer than {AGENT_MAX_RESPONSE_BYTES} bytes")
            _require(not rest, "bytes follow the answer's line")
            result = parse_agent_response(method, params, answer)
            expected = 1 if method in ANSWER_DESCRIPTORS else 0
            _require(len(fds) == expected and not fds_cut,
                     f"the answer carries {'more than ' * fds_cut}{len(fds)} file descriptors; "
                     f"{method} answers with {expected}")
            if expected:
                check_descriptor(fds[0], ANSWER_DESCRIPTORS[method](result))
        except AnswerInvalid as e:
            raise AgentCallError(INVALID_ANSWER, f"the session agent's answer to {method} is "
                                                 f"invalid: {e}") from None
        if connections is not None and identity is not None:
            connections.keep(agent_dir, sock, identity)
            sock = None
        return result, fds[0] if fds else None
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        if sock is not None:
            sock.close()


def socket_identity(agent_dir: Path) -> Optional[tuple[int, int]]:
    """(device, inode) of the entry at AGENT_DIR/control.sock now, not followed; None when
    there is none (or no directory)."""
    try:
        with opened_dir(agent_dir) as dir_fd:
            return _socket_identity_at(dir_fd)
    except OSError:
        return None


def _socket_identity_at(dir_fd: int) -> tuple[int, int]:
    entry = os.stat(SOCKET_NAME, dir_fd=dir_fd, follow_symlinks=False)
    return entry.st_dev, entry.st_ino


def _agent_round_trip(sock: socket.socket, line: bytes, deadline: float, response: bytearray,
                      fds: list[int]) -> bool:
    """Sends `line` and gathers the answer into `response` (and its descriptors into `fds`)
    until its newline, a hang-up or past AGENT_MAX_RESPONSE_BYTES; whether descriptors were cut
    (more than MAX_ANSWER_FDS: the kernel closed the rest)."""
    fds_cut = False
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    sock.sendall(line)
    while len(response) <= AGENT_MAX_RESPONSE_BYTES:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        chunk, ancillary, flags, _ = sock.recvmsg(
            256 * 1024, socket.CMSG_SPACE(MAX_ANSWER_FDS * 4), socket.MSG_CMSG_CLOEXEC)
        fds += agent_role.received_fds(ancillary)
        fds_cut = fds_cut or bool(flags & socket.MSG_CTRUNC)
        response += chunk
        if not chunk or b"\n" in chunk:
            break
    return fds_cut


class AgentConnections:
    """Kept connections to session agents (docs/agent.md, `keep`), idle, by agent dir; each is
    lent to one call at a time. A call on one spares the connect and the agent's accept: the
    write path's and the output follower's long-polls. One is taken only while the directory
    still holds the socket it was made to (`identity`: a relaunched agent's, or anything put in
    its place, is talked to afresh, as without kept connections), while it is younger than
    AGENT_KEPT_IDLE_S (well inside the agent's own idle bound, so the agent does not close it as
    serve sends) and quiet: a byte or a hang-up waiting on it closes it instead (a hostile agent
    cannot slip a reply in ahead of a request). At most AGENT_KEPT_PER_SESSION a session; `drop`
    closes a session's once its container is gone."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: each with the identity of the socket it was made to, and when it was kept
        self._idle: dict[Path, list[tuple[socket.socket, tuple[int, int], float]]] = {}
        self._lock = threading.Lock()

    def take(self, agent_dir: Path, identity: Optional[tuple[int, int]]) -> Optional[socket.socket]:
        """A kept connection to the socket `identity` names (socket_identity: the one there now)."""
        while True:
            with self._lock:
                kept = self._idle.get(agent_dir)
                if not kept:
                    return None
                sock, made_to, since = kept.pop()
                if not kept:
                    del self._idle[agent_dir]
            if made_to == identity and self._clock() - since < AGENT_KEPT_IDLE_S and is_quiet(sock):
                return sock
            sock.close()

    def keep(self, agent_dir: Path, sock: socket.socket, identity: tuple[int, int]) -> None:
        with self._lock:
            kept = self._idle.setdefault(agent_dir, [])
            if len(kept) < AGENT_KEPT_PER_SESSION:
                kept.append((sock, identity, self._clock()))
                return
        sock.close()

    def drop(self, agent_dir: Path) -> None:
        with self._lock:
            kept = self._idle.pop(agent_dir, [])
        for sock, _, _ in kept:
            sock.close()

    def close(self) -> None:
        with self._lock:
            every, self._idle = list(self._idle.values()), {}
        for kept in every:
            for sock, _, _ in kept:
                sock.close()


def is_quiet(sock: Any) -> bool:
    """Nothing to read on an idle connection, and no hang-up: the peer waits for a request.
    A kept connection that is readable holds its peer's close, or bytes nobody asked for, and
    is closed instead of reused. poll, not select: a serve with many sessions has fds past
    select's 1024."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return not poller.poll(0)


#: The stable words an agent's file and exec errors start with (docs/agent.md, "Errors of the
#: harness verbs"), in the order they are tried: the status and `code` each becomes.
AGENT_ERROR_WORDS: tuple[tuple[str, type[ServeError], str], ...] = (
    ("no such file or directory", PathNotFound, "not_found"),
    ("permission denied", Forbidden, "permission_denied"),
    ("is a directory", SessionConflict, "is_a_directory"),
    ("not a directory", SessionConflict, "not_a_directory"),
    ("not enough space", InsufficientStorage, "disk_full"),
    ("too large", PayloadTooLarge, "too_large"),
    ("refused:", Unprocessable, "path_refused"),
    ("cannot run", Unprocessable, "cannot_run"),
    ("conflict:", SessionConflict, "conflict"),
    ("sha256 mismatch", Unprocessable, "unprocessable"),
)
#: Every `code` an error answer may carry (web/openapi.json lists the same).
ERROR_CODES = ("bad_request", "not_found", "conflict", "method_not_allowed", "too_large",
               "unprocessable", "too_many_requests", "unavailable", "disk_full", "bad_gateway",
               "gateway_timeout", "unauthorized", "forbidden", "unsupported_media_type",
               "misdirected", "internal", "permission_denied", "is_a_directory",
               "not_a_directory", "path_refused", "cannot_run", "user_unsupported")


def serve_error_for(error: AgentCallError) -> ServeError:
    """The agent's blame-split codes, as HTTP statuses. The file and exec verbs name some
    failures in stable words (AGENT_ERROR_WORDS), mapped first, each to its own `code`."""
    message, text = f"agent: {error}", str(error)
    if error.code == INVALID_ANSWER:
        return BadGateway(text)
    if error.code == "disk_full":
        return InsufficientStorage(message)
    if error.code in ("invalid_request", "command_error"):
        for words, error_class, code in AGENT_ERROR_WORDS:
            if text.startswith(words):
                return error_class(message, code)
    if "cumulative output cap" in text:
        return InsufficientStorage(message)  # seed 002's output quota
    if error.code == "invalid_request" or "UTF-8 boundary" in text:
        return Unprocessable(message)
    if error.code == "command_error":
        return SessionConflict(message)
    if error.code == "server_unavailable" and "is full" in str(error):
        return TooManyRequests(message)
    return ServiceUnavailable(message)


class DirectoryWatch:
    """Wakes its waiter when an entry of one directory is made, written or changed (inotify),
    so a launch learns that its agent bound the control socket the moment it did, rather than
    at the next tick of a poll. What changed is not read: the waiter looks for itself. Where
    the kernel gives no watch (fs.inotify.max_user_instances reached, or no such directory),
    wait() only sleeps up to AGENT_READY_POLL_S: the poll this replaces. A context manager;
    close() is idempotent."""

    #: inotify(7): IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE, on a
    #: directory only (IN_ONLYDIR), never through a link (IN_DONT_FOLLOW).
    EVENTS = 0x002 | 0x004 | 0x008 | 0x080 | 0x100 | 0x01000000 | 0x02000000
    #: One read takes this much of the queue at most; what is left wakes the next wait.
    READ_BYTES = 64 * 1024

    def __init__(self, directory: Path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd >= 0 and libc.inotify_add_watch(fd, os.fsencode(directory), self.EVENTS) < 0:
            os.close(fd)
            fd = -1
        self.fd: Optional[int] = fd if fd >= 0 else None

    def wait(self, timeout_s: float) -> bool:
        """Until the directory changes (True; the news taken) or timeout_s passes (False)."""
        if self.fd is None:
            time.sleep(min(max(timeout_s, 0.0), AGENT_READY_POLL_S))
            return False
        if not select.select([self.fd], [], [], max(timeout_s, 0.0))[0]:
            return False
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, self.READ_BYTES)
        return True

    def close(self) -> None:
        """The instance goes away off the caller's path: the kernel frees one only after a grace
        period of its own (some 16 ms), which a launch need not wait out."""
        if self.fd is not None:
            threading.Thread(target=os.close, args=(self.fd,), name="inotify-close", daemon=True).start()
            self.fd = None

    def __enter__(self) -> "DirectoryWatch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ClientGone(ReployError):
    """The HTTP client closed its connection while serve waited on the agent for it."""


class ReaderDropped(ReployError):
    """An output stream's reader took nothing for SSE_STALL_S while bytes waited for it."""


class AgentWait:
    """One serve loop that waits on an agent (see "the harness verbs"). check(), before each
    poll, raises when the client went away, serve is stopping or the deadline passed;
    not_yet(), after an answer that brought nothing, waits out the rest of AGENT_POLL_MIN_S
    since that poll. The clock is a seam."""

    def __init__(self, what: str, deadline: float, client_gone: Callable[[], bool],
                 stopping: threading.Event, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.deadline = deadline
        self.client_gone = client_gone
        self.stopping = stopping
        self.clock = clock
        self.polled_at = clock()

    def renew(self, timeout_s: float) -> None:
        """Progress: the deadline starts again from now."""
        self.deadline = self.clock() + timeout_s

    def check(self) -> None:
        if self.client_gone():
            raise ClientGone(f"the client went away; serve stopped waiting for {self.what}")
        if self.stopping.is_set():
            raise ServiceUnavailable(f"serve is stopping; it stopped waiting for {self.what}")
        if self.clock() >= self.deadline:
            raise GatewayTimeout(f"the session agent did not finish {self.what} in time")
        self.polled_at = self.clock()

    def not_yet(self) -> None:
        rest_s = self.polled_at + AGENT_POLL_MIN_S - self.clock()
        if rest_s > 0:
            self.stopping.wait(rest_s)


class SessionTally:
    """How much of something each session holds (streams, answers, bytes), and all sessions
    together; a session holding none has no entry. Not thread-safe: its owner's lock guards it."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}
        self.total = 0

    def of(self, session_id: str) -> int:
        return self._held.get(session_id, 0)

    def add(self, session_id: str, amount: int = 1) -> None:
        self._held[session_id] = self.of(session_id) + amount
        self.total += amount

    def remove(self, session_id: str, amount: int = 1) -> None:
        self.total -= amount
        if left := self._held.pop(session_id) - amount:
            self._held[session_id] = left


class AnswerSlots:
    """Answers being sent that each hold a bounded piece of memory (exec answers, a page at a
    time): at most `per_session` of one session and `total` in all. hold() waits its turn
    under an AgentWait (the client, serve's stop and the deadline end the wait)."""

    def __init__(self, per_session: int, total: int) -> None:
        self.per_session, self.total = per_session, total
        self._held = SessionTally()
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def hold(self, session_id: str, wait: AgentWait) -> Iterator[None]:
        with self._changed:
            while self._held.of(session_id) >= self.per_session or self._held.total >= self.total:
                wait.check()
                self._changed.wait(AGENT_POLL_MIN_S)
            self._held.add(session_id)
        try:
            yield
        finally:
            with self._changed:
                self._held.remove(session_id)
                self._changed.notify_all()


def stage_body(source: Any, fd: int, size_bytes: int) -> None:
    """Moves size_bytes of an upload's body from `source` (the connection's buffered reader)
    into its staging (fd) without copying them through Python: what the reader has buffered
    already is written, the rest spliced from its socket through a pipe into the staging. The
    one sha256 is the agent's, of what was staged (upload_commit). A body that ends early or
    stalls for BODY_READ_TIMEOUT_S is the client's error (400), a full disk the session's
    (507)."""
    buffered = memoryview(source.peek(0)[:size_bytes] if size_bytes else b"")
    source.read(len(buffered))
    staged = _pwrite_all(fd, buffered, 0)
    connection = source.fileno()
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):
            fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, STAGING_PIPE_BYTES)
        readable = select.poll()
        readable.register(connection, select.POLLIN)
        while staged < size_bytes:
            try:  # non-blocking: the connection has a timeout, so its fd is non-blocking anyway
                count = os.splice(connection, write_end, min(STAGING_PIPE_BYTES, size_bytes - staged),
                                  flags=os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK)
            except BlockingIOError:
                if not readable.poll(BODY_READ_TIMEOUT_S * 1000):
                    raise BadRequest(f"the body stalled after {staged} of {size_bytes} bytes") from None
                continue
            if not count:
                raise BadRequest(f"the body ended after {staged} of {size_bytes} bytes")
            staged += _splice_all(read_end, fd, count, staged)
    finally:
        os.close(read_end)
        os.close(write_end)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> int:
    """Writes view at offset in the staging; how many bytes (all of them)."""
    written = 0
    while written < len(view):
        with _staging_errors():
            written += os.pwrite(fd, view[written:], offset + written)
    return written


def _splice_all(pipe_fd: int, fd: int, count: int, offset: int) -> int:
    """Moves count bytes waiting in the pipe into the staging at offset; how many (all)."""
    moved = 0
    while moved < count:
        with _staging_errors():
            moved += os.splice(pipe_fd, fd, count - moved, offset_dst=offset + moved,
                               flags=os.SPLICE_F_MOVE)
    return moved


@contextlib.contextmanager
def _staging_errors() -> Generator[None, None, None]:
    """A failed write into the staging as the API's error: a full disk is the session's (507)."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise InsufficientStorage(f"not enough space: the session's disk: {e.strerror}") from e
        raise ServiceUnavailable(f"cannot stage the upload: {e.strerror}") from e


def _camel_keys(result: dict[str, Any]) -> dict[str, Any]:
    return {re.sub(r"_([a-z])", lambda m: m.group(1).upper(), k): v for k, v in result.items()}

# ============================================================================================
# the session disks (an ext4 image per session, loop-mounted)
# ============================================================================================
#
# Theory of operation. Every byte a session can write on the host (its workspace; its agent's
# log, outbox, state and checkpoints) lies on a file system of its own: a
# sparse ext4 image of --session-disk-mib in STATE_DIR/disks, loop-mounted nosuid,nodev at
# STATE_DIR/sessions/ID, which its container gets at /mnt/reploy-session. A workload writing
# past it gets ENOSPC, and the host holds at most the image's size plus
# SESSION_DISK_MARGIN_MIB for it. The image's root is root's (0755), `agent/` root's (0700),
# `workspace/` the runtime user's (0700); ext4 keeps SESSION_DISK_RESERVED_PERCENT of it for
# root, so the agent's own files can grow when the workload has filled the rest. A disk is
# mounted from the session's creation to its deletion; serve mounts every disk again when it
# starts (after a reboot, or when someone unmounted one), and `_launch` makes sure before a
# container starts. An exclusive flock on the image keeps two serves from mounting it twice.
# Mounting needs root: serve refuses to start when it cannot mount a probe disk.
#
# Admission. The images are sparse, so the host must still have room for what each may yet
# write: a new disk is admitted (under ADMISSION_LOCK_NAME, its image made before the lock is let
# go) only when the state dir's free space, less the unwritten part of every image there, less
# --min-free-mib kept for serve's store and logs, holds the new quota (admission_refusal). What
# sessions write then only turns promised space into used space: no session can fill the host,
# and the store stays writable.
#
# Identity. The kernel names mounts and loop backing files by canonical paths: serve resolves
# its state dir once at start (SessionManager), so a state dir reached through a symlink
# matches. An image is unlinked only once no loop device is attached to it, and a mount point
# removed only once nothing is mounted on it; a start repairs what a crash left (mount_disks).


class SessionDiskError(ReployError):
    """A session's disk cannot be made, mounted or unmounted."""


class DiskStep(enum.Enum):
    """The points of a disk's life a crash may fall between (see DISK_STEP_STOP_ENV)."""

    IMAGE_MADE = "image_made"  # the image file, no file system on it yet
    FS_MADE = "fs_made"  # ext4 on it, not mounted
    MOUNTED = "mounted"  # mounted and laid out, no container yet
    REMOVING = "removing"  # the session's containers gone, its disk still mounted
    UNMOUNTED = "unmounted"  # unmounted, the image still there
    IMAGE_REMOVED = "image_removed"  # the image gone, its mount point still there


def _reached(step: DiskStep, image: Path) -> None:
    """Test only (DISK_STEP_STOP_ENV): a session's disk at `step` stops this serve there."""
    if os.environ.get(DISK_STEP_STOP_ENV) == step.value and _SESSION_ID.fullmatch(image.stem):
        os.kill(os.getpid(), signal.SIGSTOP)


def admission_refusal(free: int, promised: int, disks: int, reserve: int, quota: int) -> Optional[str]:
    """Why the host cannot promise a new disk of `quota` bytes (plus SESSION_DISK_MARGIN_MIB),
    or None: `free` bytes free, `promised` of them still owed to `disks` images, `reserve`
    kept for serve itself. Pure."""
    if free - promised - reserve >= quota + (SESSION_DISK_MARGIN_MIB << 20):
        return None
    mib = 1024 * 1024
    return (f"no room for another session's {quota // mib} MiB disk: the state dir's file system "
            f"has {free // mib} MiB free, {promised // mib} MiB of it promised to the {disks} "
            f"session disks there, and {reserve // mib} MiB kept for serve's store and logs "
            "(--min-free-mib)")


def disk_promises(disks_dir: Path) -> tuple[int, int]:
    """(images in disks_dir, bytes they may still take from the host): each one's size plus
    SESSION_DISK_MARGIN_MIB, less what it holds already."""
    disks = promised = 0
    for image in disks_dir.glob("*.img"):
        try:
            facts = image.lstat()
        except FileNotFoundError:
            continue
        disks += 1
        promised += max(0, facts.st_size + (SESSION_DISK_MARGIN_MIB << 20) - facts.st_blocks * 512)
    return disks, promised


@contextlib.contextmanager
def admission_lock(disks_dir: Path) -> Iterator[None]:
    """Held from the free-space check to the new image: two creates cannot promise one space."""
    fd = os.open(disks_dir / ADMISSION_LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _run_disk_tool(argv: list[str], what: str) -> None:
    try:
        done = subprocess.run(argv, env=SESSION_DISK_TOOL_ENV, stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=SESSION_DISK_TOOL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SessionDiskError(f"{what}: {e}") from e
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).decode(errors="replace").strip()[-500:]
        raise SessionDiskError(f"{what}: {argv[0]} exited with {done.returncode}: {detail}")


def _unescape_mountinfo(text: str) -> str:
    """A mountinfo path: space, tab, newline and backslash are octal escapes there."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), text)


def mount_table(mountinfo: Optional[str] = None) -> list[tuple[str, str]]:
    """(mount point, source) of every mount, in /proc/self/mountinfo's order (the last of one
    point is its topmost)."""
    if mountinfo is None:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    table = []
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) > 4 and "-" in fields:
            tail = fields[fields.index("-") + 1:]
            table.append((_unescape_mountinfo(fields[4]),
                          _unescape_mountinfo(tail[1]) if len(tail) > 1 else ""))
    return table


def mounted_device(mount_point: Path, mountinfo: Optional[str] = None) -> Optional[str]:
    """The source of the file system mounted at exactly mount_point (the topmost one); None
    when nothing is."""
    sources = [source for point, source in mount_table(mountinfo) if point == str(mount_point)]
    return sources[-1] if sources else None


def loop_devices() -> list[tuple[str, str]]:
    """(/dev/loopN, its backing file as the kernel names it: canonical, " (deleted)" once
    unlinked) of every attached loop device."""
    devices = []
    for backing in sorted(Path("/sys/block").glob("loop*/loop/backing_file")):
        with contextlib.suppress(OSError):
            devices.append((f"/dev/{backing.parent.parent.name}", backing.read_text().rstrip("\n")))
    return devices


def loop_backing_file(device: str) -> Optional[str]:
    """The file a loop device (/dev/loopN) is backed by, None for any other device."""
    return next((backing for loop, backing in loop_devices() if loop == device), None)


@contextlib.contextmanager
def _locked_image(image: Path) -> Iterator[None]:
    """The session disk image, held under an exclusive flock (serves sharing a state dir)."""
    try:
        fd = os.open(image, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SessionDiskError(f"the session's disk image {image} is missing") from None
    except OSError as e:
        raise SessionDiskError(f"cannot open the session's disk image {image}: {e.strerror}") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SessionDiskError(f"the session's disk image {image} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def mount_session_disk(image: Path, mount_point: Path) -> None:
    """Mounts the image at mount_point unless it is mounted there already. Something else
    mounted there is refused, never stacked over."""
    with _locked_image(image):
        device = mounted_device(mount_point)
        if device is not None:
            if loop_backing_file(device) != str(image):
                raise SessionDiskError(f"{mount_point} has {device} mounted on it, not {image}")
            return
        mount_point.mkdir(mode=0o700, exist_ok=True)
        _run_disk_tool(["mount", "-t", "ext4", "-o", "loop,nosuid,nodev,noinit_itable,discard",
                        str(image), str(mount_point)], f"mount the session disk {image}")


def unmount_session_disk(image: Path, mount_point: Path) -> None:
    """Unmounts mount_point if the image is mounted there (the loop device goes with it). A
    refusal as busy is tried again for UNMOUNT_BUSY_TIMEOUT_S (a holder of a moment lets go);
    SessionDiskError when it stays busy."""
    with _locked_image(image):
        device = mounted_device(mount_point)
        if device is None:
            return
        if loop_backing_file(device) != str(image):
            raise SessionDiskError(f"{mount_point} has {device} mounted on it, not {image}")
        deadline = time.monotonic() + UNMOUNT_BUSY_TIMEOUT_S
        while True:
            try:
                _run_disk_tool(["umount", str(mount_point)], f"unmount the session disk {mount_point}")
                return
            except SessionDiskError as e:
                if UMOUNT_BUSY not in str(e) or time.monotonic() >= deadline:
                    raise
            time.sleep(UNMOUNT_BUSY_POLL_S)


def make_session_image(image: Path, size_bytes: int) -> None:
    """The sparse image file of a new disk (see admission for the space it is promised)."""
    try:
        fd = os.open(image, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise SessionDiskError(f"cannot make the session's disk image {image}: {e.strerror}") from e
    try:
        os.ftruncate(fd, size_bytes)
    finally:
        os.close(fd)
    _reached(DiskStep.IMAGE_MADE, image)


def format_session_disk(image: Path, mount_point: Path, runtime: Runtime) -> None:
    """ext4 made on a new image, mounted, and laid out: the root root's and 0755, `agent/`
    root's and 0700, `workspace/` the runtime user's and 0700."""
    _run_disk_tool(["mkfs.ext4", "-q", "-F", "-L", "reploy-session", "-m", str(SESSION_DISK_RESERVED_PERCENT),
                    "-E", "lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0", str(image)],
                   f"make the file system of {image}")
    _reached(DiskStep.FS_MADE, image)
    mount_session_disk(image, mount_point)
    os.chmod(mount_point, 0o755)
    (mount_point / "lost+found").rmdir()  # e2fsck makes it again if it ever needs one
    (mount_point / agent_role.AGENT_DIR_NAME).mkdir(mode=0o700)
    workspace = mount_point / "workspace"
    workspace.mkdir(mode=0o700)
    os.chown(workspace, runtime.uid, runtime.gid)
    _reached(DiskStep.MOUNTED, image)


def make_session_disk(image: Path, mount_point: Path, size_mib: int, runtime: Runtime) -> None:
    """A new disk of size_mib, made, mounted and laid out (format_session_disk)."""
    make_session_image(image, size_mib * 1024 * 1024)
    format_session_disk(image, mount_point, runtime)


def _detach_unmounted_loops(image: Path) -> None:
    """Waits until no loop device holds the image: the kernel lets one go after its unmount
    (autoclear) at its own pace, and one a crash left with nothing mounted from it is detached
    here. A loop device still mounted anywhere is a SessionDiskError, as is one that outlives
    LOOP_DETACH_TIMEOUT_S."""
    deadline = time.monotonic() + LOOP_DETACH_TIMEOUT_S
    detached: set[str] = set()
    while attached := [loop for loop, backing in loop_devices() if backing == str(image)]:
        table = mount_table()
        for device in attached:
            points = [point for point, source in table if source == device]
            if points:
                raise SessionDiskError(f"the disk image {image} is still mounted at {', '.join(points)}; "
                                       "it is kept")
            if device not in detached:
                detached.add(device)
                with contextlib.suppress(SessionDiskError):  # one being let go already refuses
                    _run_disk_tool(["losetup", "-d", device], f"detach {device} from {image}")
        if time.monotonic() >= deadline:
            raise SessionDiskError(f"the disk image {image} is still attached to {', '.join(attached)}; "
                                   "it is kept")
        time.sleep(LOOP_DETACH_POLL_S)


def remove_session_disk(image: Path, mount_point: Path) -> None:
    """Unmounts and removes a session's disk and its mount point; what is already gone is fine.
    Nothing still attached is removed: the image only once no loop device holds it, the mount
    point only once nothing is mounted on it (else SessionDiskError, and both stay)."""
    _reached(DiskStep.REMOVING, image)
    if os.path.lexists(image):
        unmount_session_disk(image, mount_point)
        _reached(DiskStep.UNMOUNTED, image)
        _detach_unmounted_loops(image)
        image.unlink()
        _reached(DiskStep.IMAGE_REMOVED, image)
    device = mounted_device(mount_point)
    if device is not None:
        raise SessionDiskError(f"{mount_point} has {device} mounted on it; it is kept")
    with contextlib.suppress(FileNotFoundError):
        reploy_watchdog.remove_tree(mount_point)


def sweep_lost_disks(disks_dir: Path) -> None:
    """Serve's start: what a crash or an older serve left that no session can use, removed: loop
    devices on unlinked images of disks_dir (unmounted, detached) and the probe disks of serves
    that are gone."""
    table = mount_table()
    for device, backing in loop_devices():
        path, deleted = backing.removesuffix(" (deleted)"), backing.endswith(" (deleted)")
        if deleted and Path(path).parent == disks_dir:
            log(f"serve: detaching {device}, left on the removed disk image {path}")
            with contextlib.suppress(SessionDiskError):
                for point in [point for point, source in table if source == device][::-1]:
                    _run_disk_tool(["umount", point], f"unmount {point}")
                _run_disk_tool(["losetup", "-d", device], f"detach {device}")
    for probe in {path.name.removesuffix(".img") for path in disks_dir.glob(".probe-*")}:
        pid = probe.removeprefix(".probe-")
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            with contextlib.suppress(SessionDiskError, OSError):
                remove_session_disk(disks_dir / f"{probe}.img", disks_dir / probe)


def probe_session_disks(disks_dir: Path) -> None:
    """Serve's start: a small disk made, mounted, unmounted and removed, or a clear reason why
    sessions could not have one."""
    if os.geteuid() != 0:
        raise SessionDiskError("reploy serve mounts a disk image for each session (the session's "
                               "quota, --session-disk-mib) and needs root to do so")
    name = f".probe-{os.getpid()}"
    image, mount_point = disks_dir / f"{name}.img", disks_dir / name
    try:
        make_session_disk(image, mount_point, MIN_SESSION_DISK_MIB, Runtime(0, 0, (), 0, 0))
    except SessionDiskError as e:
        raise SessionDiskError(f"cannot mount session disks here: {e}") from e
    finally:
        with contextlib.suppress(SessionDiskError, OSError):
            remove_session_disk(image, mount_point)




# ============================================================================================
# Docker orchestration
# ============================================================================================


@dataclass(frozen=True)
class ServeConfig:
    """Everything `reploy serve` was told, checked once."""

    state_dir: Path
    workload_dirs: tuple[Path, ...]
    idle_after_s: float = DEFAULT_IDLE_AFTER_MS / 1000
    snapshot_after_s: float = DEFAULT_SNAPSHOT_AFTER_MS / 1000
    max_busy_s: float = DEFAULT_MAX_BUSY_MS / 1000
    agent_command: Optional[tuple[str, ...]] = None
    agent_env: tuple[str, ...] = ()  # names only: values are read from our environment at launch
    extra_mounts: tuple[Mount, ...] = ()
    default_model: Optional[str] = None
    models: tuple[str, ...] = ()
    sse_keepalive_s: float = DEFAULT_SSE_KEEPALIVE_MS / 1000
    max_sessions: int = DEFAULT_MAX_SESSIONS
    min_free_bytes: int = DEFAULT_MIN_FREE_MIB * 1024 * 1024
    #: Each session's disk quota (see "the session disks"), reported in GET /server: the default
    #: and the bound of a create's `diskMib`. `session cp` bounds what it takes out of a session
    #: by the session's own (its `diskMib`).
    session_disk_mib: int = DEFAULT_SESSION_DISK_MIB
    #: Fair share: each session container's CPU bound (the default and the bound of a create's
    #: `cpus`), and the stream readers this serve takes.
    session_cpus: float = DEFAULT_SESSION_CPUS
    max_session_readers: int = DEFAULT_MAX_SESSION_READERS
    max_readers: int = DEFAULT_MAX_READERS
    #: --model-upstream (see "the model proxy"); the credential is never part of the config
    model_upstream: Optional[ModelUpstream] = None
    #: --egress-allow: what a create's `egress` may list (see "the egress proxy")
    egress_allow: tuple[EgressEntry, ...] = ()

    @property
    def sessions_dir(self) -> Path:
        return self.state_dir / "sessions"

    def session_dir(self, session_id: str) -> Path:
        """Where the session's disk is mounted, and what its container has at SESSION_MOUNT."""
        return self.sessions_dir / session_id

    def agent_dir(self, session_id: str) -> Path:
        """The agent's own files: its control socket, output log, outbox and checkpoint archives.
        Every access to those goes through here (and, the session being hostile, through
        directory fds without following links)."""
        return self.session_dir(session_id) / agent_role.AGENT_DIR_NAME

    @property
    def disks_dir(self) -> Path:
        return self.state_dir / "disks"

    @property
    def bytecode_dir(self) -> Path:
        return self.state_dir / "bytecode"

    def disk_image(self, session_id: str) -> Path:
        return self.disks_dir / f"{session_id}.img"

    def resources(self, spec: SessionSpec) -> tuple[float, int]:
        """A session's (CPU bound, disk MiB): its own, or this server's where its record is
        older than them."""
        return (self.session_cpus if spec.cpus is None else spec.cpus,
                self.session_disk_mib if spec.disk_mib is None else spec.disk_mib)

    @property
    def reap_interval_s(self) -> float:
        return max(0.2, min(self.idle_after_s / 4, 5.0))

    @property
    def reap_policy(self) -> ReapPolicy:
        return ReapPolicy(self.idle_after_s, self.snapshot_after_s, self.max_busy_s)


class StateDirError(ReployError):
    """A state directory (or its sessions directory) that serve cannot trust."""


def prepare_state_dir(state_dir: Path) -> None:
    """STATE_DIR and STATE_DIR/sessions, made (0700) when missing. Each must be a directory of
    this user that no one else may write: another user who could would swap sessions.db (a
    record with another image or mount) or a session's directory, or plant links where serve
    writes. The state dir may be reached through a symlink of the user's; its sessions
    directory may not be one. StateDirError says which and why; the state dir is kept 0700."""
    for path, what, follow in ((state_dir, "state directory", True),
                               (state_dir / "sessions", "sessions directory", False)):
        try:
            path.mkdir(mode=0o700, parents=follow)
        except FileExistsError:
            pass
        except OSError as e:
            raise StateDirError(f"cannot make the {what} {path}: {e.strerror}") from None
        facts = os.stat(path) if follow else os.lstat(path)
        if not stat.S_ISDIR(facts.st_mode):
            raise StateDirError(f"the {what} {path} is not a directory")
        if facts.st_uid != os.geteuid():
            raise StateDirError(f"the {what} {path} belongs to uid {facts.st_uid}, not to this "
                                f"user (uid {os.geteuid()}); use a directory of your own")
        if facts.st_mode & 0o022:
            raise StateDirError(f"the {what} {path} is writable by others (mode "
                                f"{stat.S_IMODE(facts.st_mode):04o}); chmod go-w it, or use "
                                "another")
    os.chmod(state_dir, 0o700)


class Lease:
    """This process's hold on one session: every change goes through `apply` (a transition)
    or `update` (same state), each a compare-and-swap fenced by the lease."""

    def __init__(self, manager: "SessionManager", record: SessionRecord, owner: str) -> None:
        self.manager = manager
        self.record = record
        self.owner = owner

    def apply(self, event: SessionEvent, **changes: Any) -> SessionRecord:
        now = self.manager.clock()
        self.record = self.manager.store.save(
            self.record, apply_session_event(self.record, event, now, **changes), self.owner, now)
        return self.record

    def update(self, **changes: Any) -> SessionRecord:
        now = self.manager.clock()
        new = replace(self.record, version=self.record.version + 1, **changes)
        self.record = self.manager.store.save(self.record, new, self.owner, now)
        return self.record

    def renew(self) -> None:
        self.manager.store.renew(self.record.id, self.owner, self.manager.clock())


class OutputStream:
    """One SSE stream's connection, written by two threads in turn: the session's follower
    pushes each new output event to it without blocking, so one thread sends to every stream of
    a session rather than waking a thread per stream; the stream's own thread sends the rest
    (its first event, keep-alives, resets, bytes from behind the window) and whatever a push
    could not send at once, before anything of its own. Whoever holds `lock` takes the reader's
    next bytes and sends them in one step, so the two never send out of the log's order. Each
    piece is framed by `frame` (the HTTP chunk), whoever sends it."""

    def __init__(self, sock: socket.socket, frame: Callable[[bytes], bytes]) -> None:
        if sock.gettimeout() is None or os.get_blocking(sock.fileno()):
            raise ValueError("an output stream's socket needs a timeout (its descriptor non-blocking)")
        self._sock, self._frame = sock, frame
        self.lock = threading.RLock()  # the stream's thread holds it across a take and its send
        self.woken = threading.Event()  # set by the follower: the stream's thread must take
        self.last_sent = time.monotonic()
        self._unsent = b""  # a push's rest, sent first by the stream's thread

    def push(self, event: bytes) -> bool:
        """The follower's send, `lock` held: what the socket takes of the event now; False
        when some is left for the stream's thread (a full socket, a client gone: its own send
        then waits out the stall bound or fails)."""
        data = self._frame(event)
        with contextlib.suppress(OSError):  # BlockingIOError, or a reset the next send raises
            data = data[os.write(self._sock.fileno(), data):]  # never blocks: see __init__
            self.last_sent = time.monotonic()
        self._unsent = data
        return not data

    @property
    def has_unsent(self) -> bool:
        """A push left some of its event: the stream's thread sends that rest before anything
        else goes out, so no further push may (nor may anything pile up behind it)."""
        return bool(self._unsent)

    def settle(self) -> None:
        """Waits out a push begun before the stream left its follower: only then may its socket
        close (a write to a closed descriptor's number could land in whatever reused it)."""
        with self.lock:
            pass

    def send(self, event: bytes) -> None:
        """The stream thread's send: a push's rest, then `event` (b"": the rest alone), within
        the socket's timeout (socket.timeout when the client takes nothing that long)."""
        with self.lock:
            data = self._unsent + self._frame(event)
            if data:
                self._sock.sendall(data)
                self._unsent = b""
                self.last_sent = time.monotonic()


class OutputFollower:
    """One session's output follower (a thread of SessionManager's) and the fan-out of what it
    reads to the session's readers: `changed` guards `fanout` and `streams`; `deliver` pushes
    what the follower saw to the streams and wakes whoever must act on it (a look that found
    nothing wakes nobody)."""

    def __init__(self, session_id: str, text: bool) -> None:
        self.session_id = session_id
        self.fanout = LogFanout(FANOUT_WINDOW_BYTES, SSE_CHUNK_BYTES, SSE_STALL_S, text)
        self.changed = threading.Condition()
        self.streams: dict[int, OutputStream] = {}  # the SSE streams among the readers
        self._last_event: tuple[int, bytes, bytes] = (-1, b"", b"")  # offset, payload, event

    def output_event(self, offset: int, data: bytes) -> bytes:
        """sse_output of a slice, encoded once for the readers that take the same one."""
        with self.changed:
            last_offset, last_data, event = self._last_event
            if (last_offset, last_data) != (offset, data):
                event = sse_output(offset, data)
                self._last_event = (offset, data, event)
            return event

    def deliver(self, now: float) -> None:
        """After the follower saw something new: each stream with an OUTPUT next and its socket
        free gets that event pushed; a stream with more to take after it, or anything else to
        do, is woken; so are the reads waiting on `changed`."""
        pushes: list[tuple[OutputStream, bytes, bool]] = []
        woken: list[OutputStream] = []
        with self.changed:
            for reader, stream in self.streams.items():
                step = self.fanout.next_step(reader)
                if step is FanoutStep.WAIT:
                    continue
                # Only this thread pushes, so a rest seen gone here stays gone.
                if (step is FanoutStep.OUTPUT and not stream.has_unsent
                        and stream.lock.acquire(blocking=False)):
                    take = self.fanout.take(reader, now)
                    if take.step is FanoutStep.OUTPUT:
                        more = self.fanout.next_step(reader) is not FanoutStep.WAIT
                        pushes.append((stream, self.output_event(take.offset, take.data), more))
                    else:  # text with no whole code point yet: nothing to do
                        stream.lock.release()
                    continue  # a push's lock is released once the push is done
                # Its thread takes for itself: a step of its own, a take under way (its lock is
                # held), or the rest of its last push to send first.
                woken.append(stream)
            self.changed.notify_all()
        for stream, event, more in pushes:
            try:
                if not stream.push(event) or more:
                    woken.append(stream)
            finally:
                stream.lock.release()
        for stream in woken:
            stream.woken.set()

    def end(self) -> None:
        """The session's container is gone, or nobody reads: every reader ends."""
        with self.changed:
            self.fanout.end_all()
            self.changed.notify_all()
            for stream in self.streams.values():
                stream.woken.set()


def compile_agent_bytecode(directory: Path) -> None:
    """agent.py's bytecode into `directory` (AGENT_BYTECODE_MOUNT in every session), replaced
    whole. Hash-checked: a session's interpreter takes it only for the very agent.py mounted
    beside it, and looks for it only under its own version's name (agent.cpython-311.pyc);
    otherwise it compiles the source, as it did before. It is serve's own product, mounted
    read-only and owned by root: the workload can read it, never change it."""
    directory.mkdir(mode=0o755, exist_ok=True)
    target = directory / Path(importlib.util.cache_from_source(str(AGENT_SOURCE))).name
    header = agent_role.bytecode_header(AGENT_SOURCE.read_bytes())
    with contextlib.suppress(FileNotFoundError), target.open("rb") as existing:
        if existing.read(len(header)) == header:
            return  # compiled already, from this very source
    staged = directory / f".{target.name}.{os.getpid()}.{threading.get_ident()}"
    try:
        py_compile.compile(str(AGENT_SOURCE), cfile=str(staged), doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
        staged.chmod(0o644)
        os.replace(staged, target)
    finally:
        staged.unlink(missing_ok=True)


def agent_mounts(bytecode_dir: Path) -> tuple[Mount, Mount]:
    """agent.py and its bytecode, both read-only, as a session's container has them."""
    return (Mount(str(AGENT_SOURCE), AGENT_MOUNT, read_only=True),
            Mount(str(bytecode_dir), AGENT_BYTECODE_MOUNT, read_only=True))


class SessionManager:
    """The control plane's orchestration: one container per session, the lifecycle under
    leases, recovery of what a dead `serve` left, and the reaper. The HTTP adapter and the
    tests call it; it never sees HTTP. The clock and the Docker backend are seams."""

    def __init__(self, config: ServeConfig, backend: DockerBackend,
                 clock: Callable[[], float] = time.time) -> None:
        self.backend = backend
        self.clock = clock
        prepare_state_dir(config.state_dir)
        # Once, here: the kernel names mounts and loop devices by canonical paths (a state dir
        # reached through a symlink must match them), and so do container labels from now on.
        self.config = config = replace(config, state_dir=config.state_dir.resolve(strict=True))
        config.disks_dir.mkdir(mode=0o700, exist_ok=True)
        compile_agent_bytecode(config.bytecode_dir)
        self.store = SessionStore(config.state_dir / "sessions.db")
        self.host = socket.gethostname()
        self.identity = reploy_watchdog.process_identity()
        self.stopping = threading.Event()
        self._readers = SessionTally()  # open output streams per session, in this serve
        self._readers_lock = threading.Lock()  # guards _readers and _followers
        self._followers: dict[str, OutputFollower] = {}
        #: the agent long-polls on output logs: all of them, and the most of one session's at once
        self._agent_waits = {"total": 0, "peak": 0}
        self._agent_waits_open: dict[str, int] = {}
        #: kept connections to the agents, for the hot paths: a session's calls and its follower
        self.agent_connections = AgentConnections()
        self.exec_answers = AnswerSlots(MAX_EXEC_ANSWERS_PER_SESSION, MAX_EXEC_ANSWERS)
        #: streamed exec answers, held while their command runs: apart, so that long ones never
        #: keep whole answers waiting
        self.exec_streams = AnswerSlots(MAX_EXEC_ANSWERS_PER_SESSION, MAX_EXEC_ANSWERS)
        #: set by run_serve when --model-upstream is given (see "the model proxy")
        self.model_proxy: Optional[ModelProxy] = None
        #: the sessions created with `egress` (see "the egress proxy")
        self.egress_proxy = EgressProxy(self._note_egress)

    # -- leases -----------------------------------------------------------------------------

    def _owner(self) -> str:
        return f"{self.host}/{self.identity}/{secrets.token_hex(4)}"

    def record(self, session_id: str) -> SessionRecord:
        record = self.store.get(session_id) if _SESSION_ID.fullmatch(session_id) else None
        if record is None:
            raise SessionNotFound(f"no session {session_id}")
        return record

    def shown_record(self, session_id: str) -> SessionRecord:
        """The record as the API shows sessions (is_shown): one being created or deleted is
        not found."""
        record = self.record(session_id)
        if not is_shown(record):
            raise SessionNotFound(f"no session {session_id}")
        return record

    def shown_records(self) -> list[SessionRecord]:
        return [record for record in self.store.list() if is_shown(record)]

    @contextlib.contextmanager
    def leased(self, session_id: str, wait_s: float = LEASE_WAIT_S) -> Iterator[Lease]:
        """Hold the session's lease (waiting up to wait_s for another holder), finishing or
        undoing first whatever a dead holder left under way."""
        owner = self._owner()
        deadline = time.monotonic() + wait_s
        while True:
            record = self.record(session_id)
            now = self.clock()
            if lease_is_stale(record.lease_owner, record.lease_expires, now, self.host) and (
                    self.store.acquire(session_id, owner, now, stale_owner=record.lease_owner)):
                break
            if time.monotonic() >= deadline or self.stopping.is_set():
                raise SessionConflict(f"session {session_id} is busy ({record.state.value})")
            self.stopping.wait(LEASE_POLL_S)
        try:
            lease = Lease(self, self.record(session_id), owner)
            if lease.record.state not in STABLE_STATES:
                self.recover(lease)
            yield lease
        finally:
            self.store.release(session_id, owner)

    def recover(self, lease: Lease) -> None:
        """Finish or undo the step a dead `serve` left under way (see SESSION_TRANSITIONS)."""
        record = lease.record
        log(f"serve: recovering session {record.id} left {record.state.value}")
        if record.state is SessionState.CREATING:
            lease.apply(SessionEvent.ROLLBACK)
            self._finish_delete(lease)
        elif record.state is SessionState.SNAPSHOTTING:
            with contextlib.suppress(ServeError):  # no archive: rolled back to active
                self._finish_snapshot(lease, ask=False)
        elif record.state is SessionState.RESTORING:
            self._remove_containers(record.id)
            lease.apply(SessionEvent.ROLLBACK, container_id=None)
        elif record.state is SessionState.DELETING:
            self._finish_delete(lease)
        if self.store.get(record.id) is None:
            raise SessionNotFound(f"no session {record.id}")

    # -- Docker -----------------------------------------------------------------------------

    def _containers(self, session_id: Optional[str] = None) -> list[tuple[str, str]]:
        """(container id, session id) of this state dir's session containers."""
        labels = [f"{LABEL_STATE_DIR}={self.config.state_dir}", f"{LABEL_ROLE}={MANAGED_ROLE}"]
        if session_id:
            labels.append(f"{LABEL_RUN}={session_id}")
        return [(c["Id"], (c.get("Labels") or {}).get(LABEL_RUN, ""))
                for c in self.backend.list_containers(labels)]

    def _remove_containers(self, session_id: str, keep: Optional[str] = None) -> None:
        if keep is None and self.model_proxy is not None:
            self.model_proxy.close_session(session_id)
        if keep is None:
            self.egress_proxy.close_session(session_id)
        for container_id, _ in self._containers(session_id):
            if container_id != keep:
                self.backend.unpause(container_id)
                self.backend.remove_container(container_id)
        self.agent_connections.drop(self.config.agent_dir(session_id))

    def _container_spec(self, record: SessionRecord, archive: Optional[str]) -> ContainerSpec:
        spec, config = record.spec, self.config
        command = [*AGENT_COMMAND, "serve", "--session-dir", SESSION_MOUNT,
                   "--workload", spec.workload, "--home", CONTAINER_HOME,
                   "--runtime-user", spec.runtime.user]
        environment = {"HOME": CONTAINER_HOME, "LANG": "C.UTF-8"}
        if spec.workload == "agent":
            if config.agent_command:
                command += ["--agent-command", json.dumps(list(config.agent_command))]
            # Seed 002: the platform-default alias is resolved at every start of the container.
            model = (config.default_model if spec.model in (None, PLATFORM_DEFAULT_MODEL)
                     else spec.model)
            if model:
                command += ["--model", model]
            for name in config.agent_env:
                command += ["--redact-env", name]
                environment[name] = os.environ.get(name, "")
            if self.model_proxy is not None:
                command += ["--model-relay", str(MODEL_RELAY_PORT)]
                environment.update(MODEL_CLI_ENVIRONMENT)
        if spec.egress:
            command += ["--egress-relay", str(EGRESS_RELAY_PORT)]
            environment.update(EGRESS_ENVIRONMENT)
        if archive:
            command += ["--restore", f"{SESSION_MOUNT}/{agent_role.AGENT_DIR_NAME}/{archive}"]
        mounts = (*agent_mounts(config.bytecode_dir),
                  Mount(str(config.session_dir(record.id)), SESSION_MOUNT, read_only=False),
                  *config.extra_mounts)
        labels = {LABEL_RUN: record.id, LABEL_ROLE: MANAGED_ROLE,
                  LABEL_STATE_DIR: str(config.state_dir),
                  LABEL_DEPLOYMENT: spec.deployment_id, LABEL_GENERATION: str(spec.generation)}
        return ContainerSpec(role=MANAGED_ROLE, image_id=spec.image_id, command=tuple(command),
                             runtime=spec.runtime, environment=environment, labels=labels,
                             mounts=mounts, hostname="session", init=True, root_supervisor=True,
                             nano_cpus=round(config.resources(spec)[0] * 1e9),
                             blkio_weight=SESSION_BLKIO_WEIGHT)

    def _mount_disk(self, session_id: str) -> None:
        try:
            mount_session_disk(self.config.disk_image(session_id), self.config.session_dir(session_id))
        except SessionDiskError as e:
            raise ServiceUnavailable(str(e)) from e

    def _listen_for_model(self, record: SessionRecord) -> None:
        """A claude-code session's DIR/agent/model.sock, when serve has a --model-upstream."""
        if self.model_proxy is not None and record.spec.workload == "agent":
            self.model_proxy.listen(record.id, self.config.agent_dir(record.id))

    def _listen_for_egress(self, record: SessionRecord) -> None:
        """A session's DIR/agent/egress.sock, when its create listed hosts in `egress`: those
        of them this serve's --egress-allow still holds (the operator's list bounds every
        session, also one created under an earlier list)."""
        if record.spec.egress:
            entries = tuple(map(parse_egress_entry, record.spec.egress))
            kept = tuple(entry for entry in entries if entry in self.config.egress_allow)
            if kept != entries:
                log(f"serve: session {record.id}: egress to "
                    f"{', '.join(str(e) for e in entries if e not in kept)} is refused: no longer "
                    "on --egress-allow")
            self.egress_proxy.listen(record.id, self.config.agent_dir(record.id), kept)

    def _note_egress(self, session_id: str, note: EgressNote) -> None:
        """The egress proxy's note of one connection, as an `egress` event in the session's
        outbox: the agent is the outbox's one writer, so serve asks it to write the event."""
        params: dict[str, Any] = {"decision": note.decision.value, "port": note.port,
                                  "bytes_up": note.bytes_up, "bytes_down": note.bytes_down}
        if note.host:
            params["host"] = note.host
        if note.reason:
            params["reason"] = note.reason[:MAX_FAILURE_CHARS]
        if note.count != 1:
            params["count"] = note.count
        try:
            agent_call(self.config.agent_dir(session_id), "egress_note", params,
                       timeout_s=AGENT_CALL_TIMEOUT_S)
        except AgentCallError as e:
            log(f"serve: session {session_id}: the egress event is not recorded: {e}")

    def _launch(self, lease: Lease, archive: Optional[str],
                make_disk: Optional[Callable[[], None]] = None) -> None:
        """Create and start the session's container (its disk mounted first, its workspace
        given back to the runtime user), record it, and wait for its agent. A new session's
        disk is `make_disk`'s, made and mounted while the Engine creates the container: it
        is started only once both are done (its bind mount takes what is mounted then)."""
        spec = self._container_spec(lease.record, archive)
        if make_disk is None:
            self._mount_disk(lease.record.id)
            self._repair_workspace(lease.record)
            container_id = self._create_container(lease.record, spec)
        else:
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="session-disk") as pool:
                disk = pool.submit(make_disk)
                container_id = self._create_container(lease.record, spec)  # on failure the pool waits for the disk
            disk.result()  # a container without its disk is removed by label (_undo_create)
        self._listen_for_model(lease.record)
        self._listen_for_egress(lease.record)
        lease.update(container_id=container_id)
        agent_dir = self.config.agent_dir(lease.record.id)
        with DirectoryWatch(agent_dir) as watch:  # before the start: the agent's bind is not missed
            self.backend.start(container_id)
            self._await_agent(lease, container_id, agent_dir, watch)

    def _create_container(self, record: SessionRecord, spec: ContainerSpec) -> str:
        """The session's container, created; an image removed since its deployment was built
        is this server's fault (503), said as such."""
        try:
            return self.backend.create(spec)
        except ImageGone as e:
            raise ServiceUnavailable(f"the image of {record.spec.deployment} is gone") from e

    def _await_agent(self, lease: Lease, container_id: str, agent_dir: Path, watch: DirectoryWatch) -> None:
        """Until the just started agent answers `status`. While its control socket is missing,
        the next change of its directory is the earliest it can answer (the bind makes the
        socket, the log and outbox follow); a socket that refused or hung up (bound, not yet
        listening; an agent that is restarting) is asked again after AGENT_READY_POLL_S."""
        deadline = time.monotonic() + AGENT_READY_TIMEOUT_S
        next_check = time.monotonic() + AGENT_READY_CHECK_S
        while True:
            try:
                agent_call(agent_dir, "status", {}, timeout_s=AGENT_CALL_TIMEOUT_S)
                return
            except AgentCallError as e:
                if not e.transport:
                    raise ServiceUnavailable(f"the session agent refused to start: {e}") from e
                socket_missing = isinstance(e.__cause__, FileNotFoundError)
            now = time.monotonic()
            if now >= next_check:
                lease.renew()
                state = self.backend.container_state(container_id)
                if state is None or state.get("Status") == "exited":
                    tail = self.backend.log_tail(container_id).decode(errors="replace").strip()
                    hint = "" if "agent.py serve:" in tail else " (the image needs python3)"
                    raise ServiceUnavailable(  # the agent's own refusal (a restore's) says why
                        f"the session container exited before its agent answered{hint}: "
                        f"{tail[-2000:] or 'no output'}")
                next_check = now + AGENT_READY_CHECK_S
            if now >= deadline:
                raise ServiceUnavailable(f"the session agent did not answer within "
                                         f"{AGENT_READY_TIMEOUT_S:.0f} s")
            watch.wait(min(next_check, deadline) - now if socket_missing else AGENT_READY_POLL_S)

    def _admit(self, disk_bytes: int) -> None:
        """A new disk of `disk_bytes` is promised only what the host can still give (see "the
        session disks"); the caller holds admission_lock."""
        disks, promised = disk_promises(self.config.disks_dir)
        refusal = admission_refusal(shutil.disk_usage(self.config.disks_dir).free, promised, disks,
                                    self.config.min_free_bytes, disk_bytes)
        if refusal is not None:
            raise InsufficientStorage(refusal)

    def _repair_workspace(self, record: SessionRecord) -> None:
        """The workload owns its workspace and may take its own access to it away (chmod 000):
        the agent, root without CAP_DAC_OVERRIDE or CAP_FOWNER in the container, could then
        neither start the shell in it nor restore. So before every launch, as the host's root,
        the workspace gets back the runtime user as owner and u+rwx; it is reached without
        following a link (the session dir is root's: the workload cannot replace it)."""
        runtime = record.spec.runtime
        try:
            with opened_dir(self.config.session_dir(record.id)) as session_fd:
                fd = os.open("workspace", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                             | os.O_CLOEXEC, dir_fd=session_fd)
                try:
                    st = os.fstat(fd)
                    if (st.st_uid, st.st_gid) != (runtime.uid, runtime.gid):
                        os.fchown(fd, runtime.uid, runtime.gid)
                    if stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
                        os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o700)
                finally:
                    os.close(fd)
        except OSError as e:
            raise ServiceUnavailable(f"the session's workspace cannot be given back to its "
                                     f"user: {e}") from e

    def _require_free_space(self) -> None:
        free = shutil.disk_usage(self.config.state_dir).free
        if free < self.config.min_free_bytes:
            raise InsufficientStorage(f"only {free // (1024 * 1024)} MiB free under the state dir")

    def _deployment(self, name: Optional[str]) -> Deployment:
        found = []
        for directory in self.config.workload_dirs:
            try:
                found.append(load_deployment(directory))
            except (DeploymentError, BlueprintError) as e:
                raise ServiceUnavailable(f"workload deployment {directory}: {e}") from e
        chosen = next((d for d in found if name is None or d.blueprint.name == name), None)
        if chosen is None:
            raise BadRequest(f"deployment: {name!r} is not served here "
                             f"({', '.join(d.blueprint.name for d in found)})")
        if chosen.current is None:
            raise ServiceUnavailable(f"the deployment {chosen.blueprint.name} is not built")
        if chosen.has_private_env:
            raise ServiceUnavailable(f"the deployment {chosen.blueprint.name} configures a "
                                     "private environment; managed sessions do not support it")
        return chosen

    def require_built_deployments(self) -> None:
        """Refuses to serve a workload directory that is not a built deployment: every create
        would fail, so serve does not start, and says how to build it."""
        for directory in self.config.workload_dirs:
            try:
                deployment = load_deployment(directory)
            except (DeploymentError, BlueprintError) as e:
                raise ReployError(f"--workload-dir {directory}: {e}") from None
            if deployment.current is None:
                raise ReployError(f"the workload deployment {deployment.blueprint.name} in "
                                  f"{directory} is not built: run `reploy build --dir {directory}`")

    def deployment_names(self) -> list[str]:
        names = []
        for directory in self.config.workload_dirs:
            with contextlib.suppress(ReployError):
                names.append(load_deployment(directory).blueprint.name)
        return names

    # -- the lifecycle ----------------------------------------------------------------------

    def create(self, request: CreateRequest) -> SessionRecord:
        cpus, disk_mib = session_resources(request, self.config.session_cpus, self.config.session_disk_mib)
        egress = session_egress(request.egress, self.config.egress_allow)
        deployment = self._deployment(request.deployment)  # an unknown one is the client's 400
        if self.store.count() >= self.config.max_sessions:
            raise TooManyRequests(f"the session limit is reached: this server holds at most "
                                  f"{self.config.max_sessions} sessions (--max-sessions); delete one, "
                                  "or try again later")
        assert deployment.current is not None  # its image is looked for by the container's create
        try:  # the sandbox of the generation that is run, never the staged blueprint's
            runtime = deployment.built_blueprint().runtime
        except DeploymentError as e:
            raise ServiceUnavailable(f"workload deployment {deployment.dir}: {e}") from e
        if runtime.uid == 0:
            raise ServiceUnavailable(f"the deployment {deployment.blueprint.name} runs as root "
                                     "(environment.runtime.user 0:...); a managed session's "
                                     "workload runs as a non-root user")
        spec = SessionSpec(
            workload=request.workload, model=request.model,
            deployment=deployment.blueprint.name, deployment_id=deployment.deployment_id,
            image_id=deployment.current.image_id, generation=deployment.current.number,
            runtime=runtime, cpus=cpus, disk_mib=disk_mib, egress=egress)
        now, owner = self.clock(), self._owner()
        record = SessionRecord(id=secrets.token_hex(8), name=request.name, spec=spec,
                               state=SessionState.CREATING, version=1, created_at=now,
                               last_access=now, state_since=now, lease_owner=owner,
                               lease_expires=now + LEASE_TTL_S, labels=request.labels,
                               expires_at=None if request.ttl_s is None else now + request.ttl_s)
        self.store.insert(record)  # first, so a crash leaves a record that recovery rolls back
        lease = Lease(self, record, owner)
        image = self.config.disk_image(record.id)
        try:
            with admission_lock(self.config.disks_dir):
                self._admit(disk_mib * 1024 * 1024)
                make_session_image(image, disk_mib * 1024 * 1024)
            self._launch(lease, archive=None, make_disk=functools.partial(
                format_session_disk, image, self.config.session_dir(record.id), spec.runtime))
            return lease.apply(SessionEvent.STARTED)
        except SessionDiskError as e:
            self._undo_create(lease)
            raise ServiceUnavailable(str(e)) from e
        except BaseException:
            self._undo_create(lease)
            raise
        finally:
            self.store.release(record.id, owner)

    def _undo_create(self, lease: Lease) -> None:
        with contextlib.suppress(ReployError, OSError):  # else recovery finishes the undo
            lease.apply(SessionEvent.ROLLBACK)
            self._finish_delete(lease)

    def _finish_delete(self, lease: Lease) -> None:
        """The containers, then the disk (unmounted, its image and mount point removed), then
        the record."""
        session_id = lease.record.id
        self._remove_containers(session_id)
        try:
            remove_session_disk(self.config.disk_image(session_id), self.config.session_dir(session_id))
        except (SessionDiskError, OSError) as e:
            raise ServiceUnavailable(f"remove the session's disk: {e}") from e
        self.store.delete(session_id, lease.owner)

    def mount_disks(self) -> None:
        """Serve's start: every session's disk mounted again (after a reboot, or an unmount
        behind our back); a disk no record owns (a store lost or replaced) swept: unmounted and
        removed. A disk that cannot be mounted is logged; that session's next launch says why.
        The images are listed before the records: a record is made before its image, so an image
        seen here without a record has none. A session being created or deleted is left to
        reconcile, which finishes or undoes it; what no session can use is swept first. Disks
        that promise more than the host holds (an older serve's) are logged."""
        sweep_lost_disks(self.config.disks_dir)
        images = [image for image in self.config.disks_dir.glob("*.img")
                  if _SESSION_ID.fullmatch(image.stem)]
        records = {record.id: record for record in self.store.list()}
        for image in images:
            if image.stem not in records:
                log(f"serve: removing the disk of unknown session {image.stem}")
                try:
                    remove_session_disk(image, self.config.session_dir(image.stem))
                except (SessionDiskError, OSError) as e:
                    log(f"serve: the disk of unknown session {image.stem} stays: {e}")
        for record in records.values():
            if record.state in (SessionState.CREATING, SessionState.DELETING):
                continue
            try:
                self._mount_disk(record.id)
                self._listen_for_model(record)
                self._listen_for_egress(record)
            except (ServeError, OSError) as e:
                log(f"serve: session {record.id}: {e}")
        disks, promised = disk_promises(self.config.disks_dir)
        free = shutil.disk_usage(self.config.disks_dir).free
        if free - promised < self.config.min_free_bytes:  # disks an older serve overcommitted
            log(f"serve: the {disks} session disks here may still take {promised >> 20} MiB, and "
                f"{free >> 20} MiB are free: less than --min-free-mib "
                f"({self.config.min_free_bytes >> 20} MiB) would be left; every create is refused "
                "(507) until enough sessions are deleted")

    def delete(self, session_id: str, wait_s: float = LEASE_WAIT_S) -> None:
        with self.leased(session_id, wait_s) as lease:
            lease.apply(SessionEvent.DELETE)
            self._finish_delete(lease)

    def _pause(self, lease: Lease, decision: ReapDecision) -> SessionRecord:
        """Freeze the container; the record keeps the facts it was paused with (decide_reap)."""
        container_id = lease.record.container_id
        if container_id is None:
            raise SessionConflict("the session has no container")
        if decision.action is ReapAction.FORCE_PAUSE:
            blocked = ", ".join(block.value for block in decision.blocked_by)
            log(f"serve: reaper: session {lease.record.id} stayed {blocked} with no access for "
                f"{format_duration(round(self.config.max_busy_s * 1000))}; pausing it anyway")
            with contextlib.suppress(AgentCallError):  # the outbox note must not hold the pause up
                agent_call(self.config.agent_dir(lease.record.id), "suspend", {"reason": "max_busy"})
        self.backend.pause(container_id)
        try:
            return lease.apply(SessionEvent.PAUSED, busy_at=decision.busy_at,
                               idle_blocked_by=decision.blocked_by)
        except ReployError:
            self.backend.unpause(container_id)
            raise

    def _resume(self, lease: Lease) -> SessionRecord:
        if lease.record.container_id:
            self.backend.unpause(lease.record.container_id)
        return lease.apply(SessionEvent.RESUMED, last_access=self.clock())

    def snapshot(self, session_id: str) -> SessionRecord:
        with self.leased(session_id) as lease:
            if lease.record.state is SessionState.SNAPSHOT:
                return lease.record
            return self._snapshot(lease)

    def _snapshot(self, lease: Lease) -> SessionRecord:
        """active or idle -> snapshot, into the agent's checkpoint-<id>.tar, the id naming the
        record's next version so each snapshot has an archive of its own."""
        self._require_free_space()
        lease.apply(SessionEvent.CHECKPOINT,
                    archive=f"{agent_role.CHECKPOINT_PREFIX}v{lease.record.version + 1}.tar")
        return self._finish_snapshot(lease)

    def _finish_snapshot(self, lease: Lease, ask: bool = True) -> SessionRecord:
        """Snapshotting, from wherever it stands. A checkpoint already in flight (one a dead
        `serve` asked for) is awaited first; then, if `ask`, we ask for one. With the archive
        the container is removed; without it the session goes back to active and this raises.
        The archive is measured again once the container is gone and nothing can change it."""
        record = lease.record
        assert record.archive is not None
        agent_dir = self.config.agent_dir(record.id)
        failure: Optional[ServeError] = None
        undrained = False
        archive_bytes: Optional[int] = None
        try:
            if self._archive_bytes(record) is None and record.container_id:
                self.backend.unpause(record.container_id)
                self._await_checkpoint_in_flight(lease)
                if ask and self._archive_bytes(record) is None:
                    checkpoint_id = record.archive[len(agent_role.CHECKPOINT_PREFIX):-len(".tar")]
                    agent_call(agent_dir, "checkpoint", {"id": checkpoint_id,
                                                         "include": list(SNAPSHOT_INCLUDES)})
            archive_bytes = self._archive_bytes(record)
        except AgentCallError as e:
            undrained = e.code == "timeout"
            failure = (SessionConflict("the session is busy (work did not drain within the "
                                       f"agent's bound); interrupt it and retry: {e}")
                       if undrained else serve_error_for(e))
        except BackendError as e:
            failure = ServiceUnavailable(str(e))
        except ServeError as e:  # the archive is refused
            failure = e
        if failure is not None:
            with contextlib.suppress(ServeError):  # written after all (the agent timed out late)
                archive_bytes = self._archive_bytes(record)
        if archive_bytes is None and failure is None:  # no container, or a dead serve's step
            lease.apply(SessionEvent.ROLLBACK, archive=None)
            raise ServiceUnavailable("the session's container is gone; nothing to snapshot")
        if archive_bytes is None:
            assert failure is not None
            self._snapshot_failed(lease, failure, busy=undrained)
            raise failure
        self._remove_containers(record.id)
        try:
            archive_bytes = self._archive_bytes(record)
            if archive_bytes is None:
                raise ServiceUnavailable("the session's checkpoint archive vanished")
        except ServeError:
            lease.apply(SessionEvent.ROLLBACK, archive=None, container_id=None)
            raise
        self._remove_old_archives(record)
        return lease.apply(SessionEvent.CHECKPOINTED, container_id=None,
                           snapshot_bytes=archive_bytes, checkpoint_at=self.clock(),
                           **_NO_FAILURE)

    def _snapshot_failed(self, lease: Lease, failure: ServeError, busy: bool) -> None:
        """No archive: the session is paused, not active (so nothing retries it at once), with
        why and when the reaper may try again (snapshot_retry_after_s); a container that cannot
        be paused (gone meanwhile) goes back to active, the reason kept, for a fresh container
        to serve it at the next access. `busy`: work did not drain, so the reaper leaves it be
        (as after a --max-busy pause) until an access."""
        record, now = lease.record, self.clock()
        failures = record.snapshot_failures + 1
        retry_at = now + snapshot_retry_after_s(failures, self.config.snapshot_after_s)
        facts = {"archive": None, "failed_step": "snapshot", "failed_at": now,
                 "failure": str(failure)[:MAX_FAILURE_CHARS], "snapshot_failures": failures,
                 "snapshot_retry_at": retry_at}
        log(f"serve: session {record.id}: snapshot {failures} in a row failed, next no earlier "
            f"than {iso_time(retry_at)}: {failure}")
        container_id = record.container_id
        state = self.backend.container_state(container_id) if container_id else None
        if container_id and state is not None and state.get("Running"):
            with contextlib.suppress(BackendError):
                self.backend.pause(container_id)
                lease.apply(SessionEvent.SNAPSHOT_FAILED, busy_at=now if busy else record.busy_at,
                            idle_blocked_by=(IdleBlock.BUSY,) if busy else (), **facts)
                return
        lease.apply(SessionEvent.ROLLBACK, **facts)

    def _archive_bytes(self, record: SessionRecord) -> Optional[int]:
        """The size of the session's checkpoint archive, None while there is none. The session
        can write where the agent writes it: anything there but a regular file (a symlink to
        a host file, say) is refused, never followed nor measured."""
        assert record.archive is not None
        try:
            with opened_dir(self.config.agent_dir(record.id)) as dir_fd:
                return regular_file_size(dir_fd, record.archive)
        except ContainerPathError as e:
            raise SessionConflict(f"the session's checkpoint archive is refused: {e}") from e
        except OSError as e:
            raise ServiceUnavailable(f"the session directory: {e}") from e

    def _remove_old_archives(self, record: SessionRecord) -> None:
        """Every checkpoint-*.tar but the current one, whatever it is (the session may have
        put a directory there); a failure is logged, the snapshot stands."""
        try:
            with opened_dir(self.config.agent_dir(record.id)) as dir_fd:
                for name in os.listdir(dir_fd):
                    if (name.startswith(agent_role.CHECKPOINT_PREFIX) and name.endswith(".tar")
                            and name != record.archive):
                        reploy_watchdog.remove_entry(dir_fd, name)
        except OSError as e:
            log(f"serve: session {record.id}: old checkpoint archives stay: {e}")

    def _await_checkpoint_in_flight(self, lease: Lease) -> None:
        """While the agent's admission is closed and no archive exists, a checkpoint is still
        draining; it ends (archive written, or admission reopened) within the agent's bound."""
        agent_dir = self.config.agent_dir(lease.record.id)
        deadline = time.monotonic() + AGENT_CALL_TIMEOUT_S
        while self._archive_bytes(lease.record) is None and time.monotonic() < deadline:
            if agent_call(agent_dir, "status", {}).get("admission_open") is not False:
                return
            lease.renew()
            self.stopping.wait(AGENT_READY_POLL_S)

    def _restore(self, lease: Lease) -> SessionRecord:
        """snapshot -> active. A restore that fails leaves the snapshot as it was, its archive
        kept, and says why (lastFailure), in its answer and in the session's status."""
        archive = lease.record.archive
        lease.apply(SessionEvent.RESTORE)
        try:
            self._remove_containers(lease.record.id)
            self._launch(lease, archive=archive)
        except BaseException as e:
            with contextlib.suppress(ReployError):  # else recovery finishes the undo
                self._remove_containers(lease.record.id)
                lease.apply(SessionEvent.ROLLBACK, container_id=None, failed_step="restore",
                            failure=str(e)[:MAX_FAILURE_CHARS] or type(e).__name__,
                            failed_at=self.clock())
            raise
        record = lease.apply(SessionEvent.STARTED, archive=None, snapshot_bytes=None,
                             checkpoint_at=None, last_access=self.clock(), busy_at=None,
                             idle_blocked_by=(), **_NO_FAILURE)
        if archive:  # the session dir holds the restored state now
            with contextlib.suppress(OSError), opened_dir(self.config.agent_dir(record.id)) as fd:
                reploy_watchdog.remove_entry(fd, archive)
        return record

    def _relaunch_if_lost(self, session_id: str) -> bool:
        """After an agent gave no answer: resume a session the reaper paused meanwhile, or
        start a fresh container for one whose container is gone (the log and workspace live
        in the session dir). True when the caller should try again."""
        with self.leased(session_id) as lease:
            record = lease.record
            if record.state is SessionState.IDLE:
                self._resume(lease)
                return True
            if record.state is not SessionState.ACTIVE:
                return True
            state = self.backend.container_state(record.container_id) if record.container_id else None
            if state is not None and state.get("Running") and not state.get("Paused"):
                return False
            log(f"serve: session {session_id}: its container is gone; starting a fresh one")
            self._remove_containers(session_id)
            self._launch(lease, archive=None)
            lease.apply(SessionEvent.RELAUNCHED, last_access=self.clock())
            return True

    # -- access -----------------------------------------------------------------------------

    def access(self, session_id: str) -> SessionRecord:
        """An access (read, write, message, exec, ...): an idle session is resumed and a
        snapshot restored, then last access is recorded."""
        return self.access_branch(session_id)[0]

    def access_branch(self, session_id: str, shown_only: bool = False) -> tuple[SessionRecord, str]:
        """An access, and the branch that served it as seed 002's `path` names it: `active`,
        `idle->active` or `snapshot->restore`. An active session nobody operates on costs one
        statement. `shown_only`: a session the API does not show (being created or deleted) is
        not found, rather than waited for."""
        while True:
            touched = self.store.touch(session_id, self.clock()) if _SESSION_ID.fullmatch(session_id) else None
            if touched is not None:
                return touched, "active"
            if shown_only:
                self.shown_record(session_id)
            with self.leased(session_id) as lease:
                if lease.record.state is SessionState.IDLE:
                    return self._resume(lease), "idle->active"
                if lease.record.state is SessionState.SNAPSHOT:
                    return self._restore(lease), "snapshot->restore"
                if lease.record.state is SessionState.ACTIVE:
                    return lease.update(last_access=self.clock()), "active"

    def switch(self, session_id: str) -> SessionRecord:
        """Seed 002's switch: an active session is left as it is, its last access too; an idle
        one is resumed and a snapshot restored (each an access)."""
        record = self.shown_record(session_id)
        if record.state is SessionState.ACTIVE and lease_is_stale(
                record.lease_owner, record.lease_expires, self.clock(), self.host):
            return record
        with self.leased(session_id) as lease:
            if lease.record.state is SessionState.IDLE:
                return self._resume(lease)
            if lease.record.state is SessionState.SNAPSHOT:
                return self._restore(lease)
            return lease.record

    def call(self, session_id: str, method: str, params: dict[str, Any],
             workloads: tuple[str, ...] = ("shell", "agent")) -> dict[str, Any]:
        """An access, then one agent request."""
        return self.exchange(session_id, method, params, workloads)[0]

    def exchange(self, session_id: str, method: str, params: dict[str, Any],
                 workloads: tuple[str, ...] = ("shell", "agent")) -> tuple[dict[str, Any], Optional[int]]:
        """call, and the descriptor its answer carried (agent_exchange; the caller closes it)."""
        record = self.record(session_id)
        if record.spec.workload not in workloads:
            raise Unprocessable(f"{method} is for {' and '.join(workloads)} sessions")
        self.access(session_id)
        return self._exchange(session_id, method, params)

    def _ask(self, session_id: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
        return self._exchange(session_id, method, params)[0]

    def _exchange(self, session_id: str, method: str,
                  params: dict[str, Any]) -> tuple[dict[str, Any], Optional[int]]:
        """One agent request of a session just accessed; asked again once when its container
        was lost and a fresh one started (_relaunch_if_lost)."""
        agent_dir = self.config.agent_dir(session_id)
        try:
            return agent_exchange(agent_dir, method, params, connections=self.agent_connections)
        except AgentCallError as e:
            if not (e.transport and self._relaunch_if_lost(session_id)):
                raise serve_error_for(e) from e
        try:
            return agent_exchange(agent_dir, method, params, connections=self.agent_connections)
        except AgentCallError as e:
            raise serve_error_for(e) from e

    def read(self, session_id: str, offset_bytes: int,
             wait_ms: int) -> tuple[SessionRecord, str, bytearray, int]:
        """Seed 002's read, an access: (record, branch, the log's bytes from offset_bytes, the
        cursor after them). They run to the log's length as the first agent window gave it (from
        0: the whole history), and an honest agent's log is at most LOG_CAP_BYTES, so one
        `read_fd` window holds them all (serve preads them from its descriptor; a later one
        only if the agent cut the first short). An offset past the log's end gives no bytes and
        the log's length. `wait_ms`: a read at the end waits that long for bytes."""
        record, branch = self.access_branch(session_id)
        text = record.spec.workload == "agent"
        cap_bytes = LOG_CAP_BYTES[record.spec.workload]
        data, cursor, end_bytes = bytearray(), offset_bytes, None
        while end_bytes is None or cursor < end_bytes:
            params = {"offset": cursor, "max_bytes": cap_bytes, "wait_ms": 0}
            try:
                page = self._read_window(session_id, params, text)
            except Unprocessable as e:  # claude-code output: an offset inside a code point
                raise BadRequest(f"offset: {e}") from e
            if end_bytes is None and wait_ms and not page.data and not page.past_end:
                # At the end: wait for the session's follower to see more, then read once more.
                self._await_output(record, cursor, wait_ms / 1000)
                wait_ms = 0
                continue
            if page.past_end and end_bytes is None:
                return record, branch, data, page.length_bytes
            if end_bytes is None:
                end_bytes = page.length_bytes
                if end_bytes > cap_bytes:
                    raise ServiceUnavailable("the session agent's log is longer than its cap")
            elif not page.data:  # an honest log only grows
                raise ServiceUnavailable("the session's output log shrank while it was read")
            if data:
                data += page.data
            else:
                data = page.data  # the one window, as read: no copy
            cursor += len(page.data)
        return record, branch, data, cursor

    def _read_window(self, session_id: str, params: dict[str, Any], text: bool) -> LogPage:
        """One `read_fd` of a session just accessed, its window read from the descriptor."""
        answer, fd = self._exchange(session_id, "read_fd", params)
        assert fd is not None
        try:
            return LogPage.from_window(answer, fd, text)
        finally:
            os.close(fd)

    def write(self, session_id: str, payload: str) -> tuple[SessionRecord, str]:
        """Seed 002's write, an access: (record, branch). A shell's payload goes to its
        terminal as UTF-8 bytes; a claude-code session's is one prompt, refused before any
        restore when it is over MAX_PAYLOAD_BYTES. An empty payload is the access alone."""
        data = payload.encode()
        if len(data) > MAX_PAYLOAD_BYTES and self.shown_record(session_id).spec.workload == "agent":
            raise PayloadTooLarge(f"payload: a claude-code prompt is at most {MAX_PAYLOAD_BYTES} "
                                  "bytes of UTF-8")
        record, branch = self.access_branch(session_id, shown_only=True)
        workload = record.spec.workload
        try:
            if data and workload == "agent":
                self._deliver(session_id, payload)
            elif data:
                self._type(session_id, data)
        except Unprocessable as e:  # the agent refused the payload (say, a NUL in a prompt)
            raise BadRequest(f"payload: {e}") from e
        return record, branch

    def _type(self, session_id: str, data: bytes) -> None:
        """A shell's input, in parts of MAX_WRITE_PART_BYTES. A part the terminal's input
        buffer cannot take yet is offered again, until the terminal has taken nothing for
        SHELL_INPUT_STALL_S (then 429, saying how much it took)."""
        sent, progress_at = 0, time.monotonic()
        while sent < len(data):
            part = data[sent:sent + MAX_WRITE_PART_BYTES]
            try:
                self._ask(session_id, "write", {"data_b64": base64.b64encode(part).decode("ascii")})
            except TooManyRequests as e:
                if time.monotonic() - progress_at >= SHELL_INPUT_STALL_S or self.stopping.is_set():
                    raise TooManyRequests(f"the terminal took {sent} of {len(data)} bytes and no "
                                          f"more for {SHELL_INPUT_STALL_S:.0f} s: {e}") from e
                self.stopping.wait(SHELL_INPUT_POLL_S)
                continue
            sent += len(part)
            progress_at = time.monotonic()

    def message(self, session_id: str, text: str) -> dict[str, Any]:
        """One message (an agent's prompt, a shell's line), an access."""
        self.access(session_id)
        return self._deliver(session_id, text)

    def _deliver(self, session_id: str, text: str) -> dict[str, Any]:
        """A message to the agent, sent as its draft in parts when one request line cannot
        hold it."""
        *leading, last = message_parts(text)
        draft: dict[str, str] = {}
        for part in leading:
            draft = {"draft": self._ask(session_id, "message", {"text": part, "more": True, **draft})["draft"]}
        return self._ask(session_id, "message", {"text": last, **draft})

    # -- the harness verbs: exec and files -------------------------------------------------
    #
    # Each starts with an access (self.call), then waits on the agent in a loop of polls (exec
    # output, list pages, an upload's commit, a tar's pipe). Every such loop runs
    # under an AgentWait: a deadline, the client's presence and serve's own stop, and a least
    # interval between polls that answered "not yet", so an agent answering that at once, for
    # ever, can neither pin the thread nor make it spin.

    def _poll(self, session_id: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """One more agent request within an operation already under way (an exec, a transfer, a
        listing's next page): unlike _ask, never a fresh container, where it would not exist."""
        try:
            return agent_call(self.config.agent_dir(session_id), method, params)
        except AgentCallError as e:
            raise serve_error_for(e) from e

    def _wait(self, what: str, timeout_s: float, client_gone: Callable[[], bool]) -> "AgentWait":
        return AgentWait(what, time.monotonic() + timeout_s, client_gone, self.stopping)

    def exec(self, session_id: str, params: dict[str, Any],
             client_gone: Callable[[], bool]) -> "dict[str, Any] | ExecEnded":
        """Runs one command in the session's container and waits for its end (_exec_pages).
        The output stays the agent's: each page is only measured (TextCost) for the form its
        answer gives it, and exec_answer() reads it again as it sends it. A detached command
        is answered once started: its pid and output files."""
        started = self.call(session_id, "exec", params)
        exec_id = started["exec_id"]
        if params["detach"]:
            if started["pid"] is None or "stdout_path" not in started or "stderr_path" not in started:
                raise BadGateway("the session agent's detached exec has no pid or output files")
            return {"execId": exec_id, "detached": True, "pid": started["pid"],
                    "stdoutPath": started["stdout_path"], "stderrPath": started["stderr_path"]}
        costs = {name: TextCost() for name in EXEC_STREAMS}
        # Output of at most a page per stream so far is held, and the agent asked to release
        # its result should this answer be the end: a small output is answered from here.
        held: Optional[dict[str, bytearray]] = {name: bytearray() for name in EXEC_STREAMS}
        for page, last in self._exec_pages(session_id, exec_id, params, self._exec_wait(params, exec_id, client_gone),
                                           EXEC_POLL_MS, lambda: held is not None):
            for name, cost in costs.items():
                cost.feed(page[name])
                if held is not None:
                    held[name] += page[name]
            if last:
                return ExecEnded(exec_id, page, {n: c.size_bytes for n, c in costs.items()},
                                 {n: c.encoding() for n, c in costs.items()},
                                 None if held is None else {n: bytes(d) for n, d in held.items()})
            if held is not None and any(len(data) > agent_role.EXEC_PAGE_BYTES for data in held.values()):
                held = None
        raise AssertionError("unreachable: _exec_pages ends with its last page")

    def _exec_wait(self, params: dict[str, Any], exec_id: str, client_gone: Callable[[], bool]) -> "AgentWait":
        """The wait on a command: its own timeout plus EXEC_END_GRACE_S (the agent kills it at
        its timeout; no timeout: none)."""
        return self._wait(f"the command {exec_id}", self._exec_timeout_s(params), client_gone)

    @staticmethod
    def _exec_timeout_s(params: dict[str, Any]) -> float:
        return params["timeout_ms"] / 1000 + EXEC_END_GRACE_S if "timeout_ms" in params else math.inf

    def _exec_pages(self, session_id: str, exec_id: str, params: dict[str, Any], wait: "AgentWait",
                    poll_ms: int, release: Callable[[], bool]
                    ) -> Generator[tuple[dict[str, Any], bool], None, None]:
        """The agent's exec_wait answers for a started command, each with whether it is the last
        (the command ended, every byte delivered), each stream from where the previous page
        ended. The agent answers within 5 s, so this is a chain of long-polls of poll_ms; a
        client that went away, serve stopping, the wait's deadline, a page past the output
        cap (a hostile agent's) or the caller's leaving before the last page kills the
        command's whole process group. A command queued behind the agent's running ones has
        its wait start again at every poll. `release()` is asked before each poll: whether
        the agent may free its result with the last page."""
        offsets = {name: 0 for name in EXEC_STREAMS}
        last, behind = False, False
        try:
            while True:
                wait.check()
                page = self._poll(session_id, "exec_wait", {
                    "exec_id": exec_id, "wait_ms": 0 if behind else poll_ms, "release": release(),
                    **{f"{name}_offset": offset for name, offset in offsets.items()}})
                if page.get("queued"):
                    wait.renew(self._exec_timeout_s(params))
                for name in EXEC_STREAMS:
                    offsets[name] += len(page[name])
                    if page[f"{name}_bytes"] > params["output_cap_bytes"]:  # a hostile agent's
                        raise BadGateway("the session agent sent more output than the cap")
                last = not page["running"] and all(offset == page[f"{name}_bytes"]
                                                   for name, offset in offsets.items())
                # A full page with more behind it: the next is asked for at once.
                behind = bool(page["stdout"] or page["stderr"]) and any(
                    offset < page[f"{name}_bytes"] for name, offset in offsets.items())
                yield page, last
                if not behind:
                    wait.not_yet()
        except BaseException:
            if not last:
                self._kill_exec(session_id, exec_id)
            raise

    def _kill_exec(self, session_id: str, exec_id: str) -> None:
        """The command's whole process group killed, if the agent still answers."""
        with contextlib.suppress(AgentCallError):
            agent_call(self.config.agent_dir(session_id), "exec_kill", {"exec_id": exec_id})

    def exec_stream(self, session_id: str, params: dict[str, Any],
                    client_gone: Callable[[], bool]) -> Generator[bytes, None, None]:
        """A command's streamed answer (`stream`): NDJSON lines, each page of output as the
        agent gives it (exec_output_line), then how it ended (exec_end_line). Its first item,
        b"", comes once the command has started, so what fails before (a slot not had in
        time, a command that cannot run) is an ordinary error answer. One of the session's
        stream slots is held throughout (AnswerSlots: a page at a time, for as long as the
        command runs); closing the generator before its end kills the command."""
        wait = self._wait("a free exec stream", self._exec_timeout_s(params), client_gone)
        with self.exec_streams.hold(session_id, wait):
            exec_id = self.call(session_id, "exec", params)["exec_id"]
            try:
                yield b""
            except BaseException:
                self._kill_exec(session_id, exec_id)
                raise
            pages = self._exec_pages(session_id, exec_id, params,
                                     self._exec_wait(params, exec_id, client_gone),
                                     EXEC_STREAM_POLL_MS, lambda: True)
            with contextlib.closing(pages):
                for page, last in pages:
                    for name in EXEC_STREAMS:
                        if page[name]:
                            yield exec_output_line(name, page[name])
                    if last:
                        yield exec_end_line(page)
                        return

    def exec_answer(self, session_id: str, ended: ExecEnded,
                    client_gone: Callable[[], bool]) -> Generator[bytes, None, None]:
        """An ended exec's answer in JSON pieces (exec_result_json), each stream read again
        from the agent a page at a time as it is sent, under one of the session's exec answer
        slots (AnswerSlots). The agent's result is released at the end, whether the answer
        went out whole or not."""
        wait = self._wait(f"the output of the command {ended.exec_id}", DOWNLOAD_STALL_S, client_gone)

        def pages(name: str) -> Iterator[bytes]:
            if ended.held is not None:
                yield ended.held[name]
                return
            offsets = dict(ended.sizes)  # the other stream is read already
            offsets[name] = 0
            while offsets[name] < ended.sizes[name]:
                wait.check()
                page = self._poll(session_id, "exec_wait", {
                    "exec_id": ended.exec_id, **{f"{n}_offset": o for n, o in offsets.items()}})
                if page["running"] or page[f"{name}_bytes"] != ended.sizes[name] or not page[name]:
                    raise BadGateway(f"the session agent's {name} changed after its command ended")
                wait.renew(DOWNLOAD_STALL_S)
                offsets[name] += len(page[name])
                yield page[name]

        try:
            with self.exec_answers.hold(session_id, wait):
                yield from exec_result_json(ended, pages)
        finally:
            if ended.held is None:  # the agent's result, read to its end or not: released
                with contextlib.suppress(AgentCallError):
                    agent_call(self.config.agent_dir(session_id), "exec_wait", {
                        "exec_id": ended.exec_id, "max_bytes": 0, "release": True,
                        **{f"{n}_offset": size for n, size in ended.sizes.items()}})

    def stat_file(self, session_id: str, root: str, path: str) -> dict[str, Any]:
        return self.call(session_id, "stat", {"root": root, "path": path})["entry"]

    def list_files(self, session_id: str, root: str, path: str,
                   client_gone: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """A path's entry and, for a directory, its entries (at most MAX_LIST_ENTRIES)."""
        entry = self.stat_file(session_id, root, path)
        entries: Optional[list[dict[str, Any]]] = None
        truncated = False
        if entry["type"] == "directory":
            wait = self._wait(f"the listing of {path or root}", LIST_TIMEOUT_S, client_gone)
            entries = []
            names: set[str] = set()
            while True:
                wait.check()
                page = self._poll(session_id, "list", {"root": root, "path": path,
                                                      "offset": len(entries)})
                names.update(item["name"] for item in page["entries"])
                entries += page["entries"]
                if len(names) != len(entries):
                    raise BadGateway("the session agent's listing names one entry twice")
                if not page["entries"] or len(entries) >= min(page["total"], MAX_LIST_ENTRIES):
                    break
            truncated = len(entries) < page["total"]
            entries = entries[:MAX_LIST_ENTRIES]
        return {"root": root, "path": path, "entry": entry, "entries": entries,
                "truncated": truncated}

    def upload(self, session_id: str, asked: FileQuery, kind: str, size_bytes: int, source: Any,
               client_gone: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """Streams size_bytes from `source` into the session: spliced straight into the staging
        file whose descriptor the agent's `upload` answer carried (never the whole body in
        memory, never through the control socket), then committed; the agent measures and
        hashes what was staged and commits it only if it is the size announced and, given
        ?sha256=, has that digest (a commit answer of another digest is the agent's fault). A
        refused or broken upload is closed and leaves nothing behind. The commit is awaited
        until its deadline (UPLOAD_COMMIT_*) while the client is there; a client that left stops
        the wait, not the commit."""
        free = shutil.disk_usage(self.config.state_dir).free
        if free - size_bytes < self.config.min_free_bytes:
            raise InsufficientStorage(f"not enough space: {free // (1024 * 1024)} MiB free under "
                                      "the state dir")
        root, path = asked.root, asked.path
        params: dict[str, Any] = {"root": root, "path": path, "kind": kind, "size": size_bytes}
        if asked.mode is not None:
            params["mode"] = asked.mode
        opened, staging = self.exchange(session_id, "upload", params)
        assert staging is not None
        transfer_id = opened["transfer_id"]
        try:
            try:
                stage_body(source, staging, size_bytes)
            finally:
                os.close(staging)
            wait = self._wait(f"the commit of {path or root}",
                              UPLOAD_COMMIT_BASE_S + size_bytes / UPLOAD_COMMIT_MIN_BYTES_PER_S,
                              client_gone)
            commit: dict[str, Any] = {"transfer_id": transfer_id}
            if asked.sha256 is not None:
                commit["sha256"] = asked.sha256
            while True:
                wait.check()
                result = self._poll(session_id, "upload_commit", commit)
                if result["done"]:
                    if (result["root"], result["kind"], result["bytes"]) != (root, kind, size_bytes):
                        raise BadGateway("the session agent's commit is not of this upload")
                    return _camel_keys(result)
                wait.not_yet()
        except BaseException:
            with contextlib.suppress(AgentCallError):
                agent_call(self.config.agent_dir(session_id), "transfer_close",
                           {"transfer_id": transfer_id})
            raise

    def download(self, session_id: str, root: str, path: str) -> tuple[dict[str, Any], int]:
        """Opens a file (or a directory, as a tar) for reading: its description and the
        descriptor its bytes come from (checked: a regular file, or a tar pipe's read end); the
        caller closes it. A file's bytes are sent with sendfile up to its announced size; a
        tar's with tar_pieces."""
        opened, fd = self.exchange(session_id, "download", {"root": root, "path": path})
        assert fd is not None
        return opened, fd

    def tar_pieces(self, session_id: str, transfer_id: str, pipe_fd: int,
                   client_gone: Callable[[], bool] = lambda: False) -> Generator[bytes, None, None]:
        """A directory's tar as the agent writes it into the pipe (pipe_fd, closed at the end):
        pieces of at most COPY_CHUNK_BYTES, MAX_UPLOAD_BYTES in all (the agent's own bound), each
        within DOWNLOAD_STALL_S (GatewayTimeout) while the client is there. At the pipe's end
        the agent's transfer_close says whether the tar is whole: its error raises, so the body
        ends short. Stopped early, the agent's job is stopped too."""
        wait = self._wait(f"the download of a directory of session {session_id}",
                          DOWNLOAD_STALL_S, client_gone)
        received = 0
        ended = False
        try:
            while True:
                wait.check()
                if not select.select([pipe_fd], [], [], AGENT_POLL_MIN_S)[0]:
                    continue
                piece = os.read(pipe_fd, COPY_CHUNK_BYTES)
                if not piece:
                    break
                received += len(piece)
                if received > MAX_UPLOAD_BYTES:  # the agent refuses such a tree itself, with its reason
                    raise BadGateway(f"the directory's tar grew past {MAX_UPLOAD_BYTES} bytes, the most one "
                                     "download carries; it is cut here")
                wait.renew(DOWNLOAD_STALL_S)
                yield piece
            ended = True
            self._poll(session_id, "transfer_close", {"transfer_id": transfer_id})
        finally:
            os.close(pipe_fd)
            if not ended:
                with contextlib.suppress(AgentCallError):
                    agent_call(self.config.agent_dir(session_id), "transfer_close",
                               {"transfer_id": transfer_id})

    def status(self, session_id: str) -> dict[str, Any]:
        """Passive: asks an active session's agent, never resumes or restores one."""
        record = self.shown_record(session_id)
        agent_status = None
        if record.state is SessionState.ACTIVE:
            try:
                agent_status = _camel_keys(agent_call(
                    self.config.agent_dir(session_id), "status", {}))
            except AgentCallError as e:  # no answer, or a refusal: no status; a bad one: 502
                if e.code == INVALID_ANSWER:
                    raise serve_error_for(e) from e
        return {"session": self.session_json(record), "agent": agent_status}

    def session_json(self, record: SessionRecord) -> dict[str, Any]:
        return session_json(record, self.config.idle_after_s, self.config.snapshot_after_s,
                            self.config.resources(record.spec))

    @contextlib.contextmanager
    def stream_reader(self, session_id: str) -> Iterator[None]:
        """One output stream's place among this serve's readers, held while it is open: past a
        bound (reader_refusal) the stream is refused before it starts."""
        with self._readers_lock:
            refusal = reader_refusal(self._readers.of(session_id), self._readers.total,
                                     self.config.max_session_readers, self.config.max_readers)
            if refusal:
                raise TooManyReaders(refusal)
            self._readers.add(session_id)
        try:
            yield
        finally:
            with self._readers_lock:
                self._readers.remove(session_id)

    def follow_output(self, record: SessionRecord, cursor: int, stream: OutputStream,
                      connected: Callable[[], bool] = lambda: True) -> None:
        """The SSE stream: the session's output from `cursor` until the client goes or the
        session's container does (deleted, snapshotted). A cursor ahead of the log gets a
        `reset`, and the stream goes on from the log's length. Passive: it takes what the
        session's follower read of the log file, so it never resumes, restores or touches the
        session. While it is open the store holds a viewer row for it, which keeps the reaper
        away (decide_reap). ReaderDropped: it took nothing for SSE_STALL_S."""
        viewer = secrets.token_hex(8)
        self.store.hold_viewer(viewer, record.id, self.clock())
        follower, reader = self._join_follower(record, cursor, stream)
        try:
            self._tail_output(record, follower, reader, stream, connected, viewer)
        finally:
            self._leave_follower(follower, reader)
            self.store.drop_viewer(viewer)
        stream.send(b"")  # what the follower's last push left

    def _tail_output(self, record: SessionRecord, follower: OutputFollower, reader: int,
                     stream: OutputStream, connected: Callable[[], bool], viewer: str) -> None:
        """The stream's own thread: it takes what the follower did not push (OutputFollower.deliver)."""
        agent_dir = self.config.agent_dir(record.id)
        renewed = time.monotonic()
        while not self.stopping.is_set() and connected():
            if time.monotonic() - renewed >= VIEWER_RENEW_S:
                self.store.hold_viewer(viewer, record.id, self.clock())
                renewed = time.monotonic()
            stream.woken.clear()  # before the take: a wake-up after it is not lost
            with stream.lock:  # no push between the take and its send (OutputStream)
                take = self._take_for_stream(follower, reader, agent_dir)
                if take.step is FanoutStep.DROPPED:
                    raise ReaderDropped(f"it took nothing for {SSE_STALL_S:.0f} s")
                if take.step is FanoutStep.ENDED:
                    return
                if take.step is FanoutStep.OUTPUT:
                    stream.send(follower.output_event(take.offset, take.data))
                    continue
                if take.step is FanoutStep.RESET:
                    stream.send(sse_reset(take.offset))
                    continue
                keepalive_in = stream.last_sent + self.config.sse_keepalive_s - time.monotonic()
                stream.send(SSE_KEEPALIVE if keepalive_in <= 0 else b"")  # b"": a push's rest
            # WAIT, or behind with nothing whole yet: until the follower wakes it
            stream.woken.wait(max(min(keepalive_in, SSE_STATE_CHECK_S), 0.0))

    def _take_for_stream(self, follower: OutputFollower, reader: int, agent_dir: Path) -> FanoutTake:
        """A stream's next step; bytes older than the follower's window are read here."""
        with follower.changed:
            take = follower.fanout.take(reader, time.monotonic())
        if take.step is not FanoutStep.BEHIND:
            return take
        try:
            data = self._read_output_log(agent_dir, take.offset)[1]
        except OSError:
            data = b""  # the follower says what the log is now
        with follower.changed:
            return follower.fanout.read_behind(reader, data, time.monotonic())

    def _await_output(self, record: SessionRecord, cursor: int, timeout_s: float) -> None:
        """A waiting read's wait at `cursor`, the log's end: until the session's follower sees
        the log past it, the follower ends, or `timeout_s` passed."""
        follower, reader = self._join_follower(record, cursor)
        try:
            with follower.changed:
                follower.changed.wait_for(
                    lambda: follower.fanout.ended or (follower.fanout.length or 0) > cursor, timeout_s)
        finally:
            self._leave_follower(follower, reader)

    def _join_follower(self, record: SessionRecord, cursor: int,
                       stream: Optional[OutputStream] = None) -> tuple[OutputFollower, int]:
        """A reader of the session's output at `cursor` (a stream's, or a waiting read's), and
        its follower, started for the first."""
        with self._readers_lock:
            follower = self._followers.get(record.id)
            if follower is None:
                follower = self._followers[record.id] = OutputFollower(
                    record.id, record.spec.workload == "agent")
                threading.Thread(target=self._follow, args=(follower,), daemon=True,
                                 name=f"follower-{record.id}").start()
            with follower.changed:
                reader = follower.fanout.join(cursor, time.monotonic())
                if stream is not None:
                    follower.streams[reader] = stream
                return follower, reader

    def _leave_follower(self, follower: OutputFollower, reader: int) -> None:
        with follower.changed:
            follower.fanout.leave(reader)
            stream = follower.streams.pop(reader, None)
        if stream is not None:
            stream.settle()  # the follower pushes no more to it, and no push is under way

    def _stop_follower(self, follower: OutputFollower, end: bool) -> bool:
        """Whether the follower stops now: when `end` (its session's container is gone) or no
        reader is left. Either way a new reader starts a new follower."""
        with self._readers_lock, follower.changed:
            if not (end or self.stopping.is_set() or not follower.fanout.readers):
                return False
            if self._followers.get(follower.session_id) is follower:
                del self._followers[follower.session_id]
            follower.end()
            return True

    def _follow(self, follower: OutputFollower) -> None:
        """The session's one follower: reads each new slice of the output log once, for every
        reader, and sleeps in one agent long-poll between (the agent's wake-up reaches serve
        once per change, however many read)."""
        try:
            self._follow_log(follower)
        finally:  # however it ended (a store error too), its readers end with it
            self._stop_follower(follower, end=True)

    def _follow_log(self, follower: OutputFollower) -> None:
        session_id = follower.session_id
        agent_dir = self.config.agent_dir(session_id)
        checked = time.monotonic()
        refused = woke = False
        in_a_row = 0  # slices read without the follower catching up with the log
        while not self._stop_follower(follower, end=False):
            if time.monotonic() - checked >= SSE_STATE_CHECK_S:
                if not self.stream_goes_on(session_id):
                    return
                checked = time.monotonic()
            try:
                length, data = self._read_output_log(agent_dir, follower.fanout.next_read())
            except FileNotFoundError:
                if not self.stream_goes_on(session_id):
                    return  # deleted: the log goes before its directory, so no reset for it
                length, data = 0, b""
            except OSError as e:  # the session put something else there: no bytes from it
                if not refused:
                    log(f"serve: session {session_id}: its output follower waits: {e}")
                refused = True
                self.stopping.wait(SSE_POLL_S)
                continue
            with follower.changed:
                seen = follower.fanout.length
                dropped = follower.fanout.feed(length, data, time.monotonic())
                end = follower.fanout.end
            if data or dropped or length != seen:  # a look that found nothing wakes nobody
                follower.deliver(time.monotonic())
            if data:
                woke = False
                in_a_row += 1
                # Output that keeps flowing gathers for one poll between slices, rather than
                # costing a log read and an event per write of the workload (fair share: a
                # busy session); a reply's first slices go out at once.
                if in_a_row >= SSE_BURST_EVENTS and len(data) < SSE_CHUNK_BYTES:
                    self.stopping.wait(SSE_POLL_S)
                continue
            in_a_row = 0
            # A wake-up that brought no bytes (an agent answering at once) must not spin us.
            if woke:
                self.stopping.wait(SSE_POLL_S)
            woke = self._await_agent_output(session_id, agent_dir, end)
            if not woke:
                self.stopping.wait(SSE_POLL_S)

    def agent_wait_stats(self) -> dict[str, int]:
        """The output followers open, the agent long-polls they made, and the most one session
        had at once (GET /server's `outputFollowing`: one per session, however many read)."""
        with self._readers_lock:
            return {"followers": len(self._followers), "agentWaits": self._agent_waits["total"],
                    "mostAgentWaitsAtOnce": self._agent_waits["peak"]}

    def _await_agent_output(self, session_id: str, agent_dir: Path, cursor: int) -> bool:
        with self._readers_lock:
            self._agent_waits_open[session_id] = open_now = self._agent_waits_open.get(session_id, 0) + 1
            self._agent_waits["total"] += 1
            self._agent_waits["peak"] = max(self._agent_waits["peak"], open_now)
        try:
            return self.await_agent_output(agent_dir, cursor)
        finally:
            with self._readers_lock:
                self._agent_waits_open[session_id] -= 1
                if not self._agent_waits_open[session_id]:
                    del self._agent_waits_open[session_id]

    def stream_goes_on(self, session_id: str) -> bool:
        """Whether a stream of the session goes on: not once its container is gone for a
        client (seed 002: a reclaimed pod ends it), nor once it is deleted or being deleted."""
        record = self.store.get(session_id)
        return record is not None and has_container(record)

    @staticmethod
    def _read_output_log(agent_dir: Path, cursor: Optional[int]) -> tuple[int, bytes]:
        """(length, at most SSE_CHUNK_BYTES from `cursor`; from None, none) of the agent's
        output.log, read only as the regular file it must be (see "Directories a container can
        write"). The one place serve reads the log's bytes for its readers."""
        with opened_dir(agent_dir) as dir_fd:
            fd = open_regular_file(dir_fd, OUTPUT_LOG_NAME)
        try:
            length = os.fstat(fd).st_size
            at = length if cursor is None else cursor
            return length, os.pread(fd, min(max(length - at, 0), SSE_CHUNK_BYTES), at)
        finally:
            os.close(fd)

    def await_agent_output(self, agent_dir: Path, cursor: int) -> bool:
        """Sleep until the agent has bytes past `cursor` (or a second passed), so a follower
        learns of output at once instead of at its next file poll; on a kept connection, so
        each wake-up costs no connect. The agent's `read` changes nothing, so the follower stays
        passive. False when no agent answers (a paused or snapshotted session): the caller falls
        back to polling the file."""
        try:
            agent_exchange(agent_dir, "read",
                           {"offset": cursor, "max_bytes": MIN_READ_BYTES, "wait_ms": SSE_LONG_POLL_MS},
                           timeout_s=SSE_LONG_POLL_MS / 1000 + 1.0, connections=self.agent_connections)
            return True
        except AgentCallError:
            return False

    # -- reconciliation and the reaper ------------------------------------------------------

    def reconcile(self) -> None:
        """Remove containers no record owns, and finish or undo what dead holders left. Safe
        beside other live `serve` processes: live leases are never touched."""
        containers = self._containers()  # before the records: see create()'s ordering
        records = {r.id: r for r in self.store.list()}
        now = self.clock()
        for container_id, session_id in containers:
            if session_id not in records:
                log(f"serve: removing container {container_id[:12]} of unknown session {session_id}")
                self.backend.unpause(container_id)
                self.backend.remove_container(container_id)
        for record in records.values():
            if not lease_is_stale(record.lease_owner, record.lease_expires, now, self.host):
                continue
            strays = [cid for cid, sid in containers if sid == record.id and cid != record.container_id]
            if record.state in STABLE_STATES and not strays:
                continue
            try:
                with contextlib.suppress(ServeError), self.leased(record.id, wait_s=0) as lease:
                    self._remove_containers(record.id, keep=lease.record.container_id)
            except Exception as e:  # noqa: BLE001 - as in reap_once: one session, not all
                log(f"serve: reconcile: session {record.id}: {e!r}")

    def reap_once(self) -> None:
        """Apply the idle policy once (decide_reap): gather each session's facts and record
        them; act on a due session under its lease, after deciding again there."""
        for record in self.store.list():
            if self.stopping.is_set():
                return
            if record.state in STABLE_STATES and is_expired(record, self.clock()):
                self._expire(record)
                continue
            if record.state not in (SessionState.ACTIVE, SessionState.IDLE):
                continue
            try:
                if self._reap_decision(record).action is ReapAction.KEEP:
                    continue
                with self.leased(record.id, wait_s=0) as lease:
                    decision = self._reap_decision(lease.record)
                    if decision.action is ReapAction.SNAPSHOT:
                        self._snapshot(lease)
                    elif decision.action in (ReapAction.PAUSE, ReapAction.FORCE_PAUSE):
                        self._pause(lease, decision)
            except (ServeError, BackendError) as e:
                log(f"serve: reaper: session {record.id}: {e}")
            except Exception as e:  # noqa: BLE001 - a session is hostile data (its agent's
                # answers, its files): whatever it makes us trip over costs that session's
                # step, never the one reaper of every session
                log(f"serve: reaper: session {record.id}: {e!r}")

    def _expire(self, record: SessionRecord) -> None:
        """A session past its time to live, deleted as DELETE would (a holder of its lease
        keeps it until the next pass)."""
        try:
            self.delete(record.id, wait_s=0)
            log(f"serve: reaper: session {record.id} deleted: its time to live passed")
        except (ServeError, BackendError) as e:
            log(f"serve: reaper: session {record.id}: {e}")

    def _reap_decision(self, record: SessionRecord) -> ReapDecision:
        """Gather the facts decide_reap needs (an active session's agent status, the viewers in
        every `serve` on this store), decide, and record the facts when they changed."""
        facts = None
        if record.state is SessionState.ACTIVE:
            with contextlib.suppress(AgentCallError):  # no answer: not busy (see decide_reap)
                facts = WorkloadFacts.from_status(
                    agent_call(self.config.agent_dir(record.id), "status", {}))
        now = self.clock()
        decision = decide_reap(record, facts, self.store.viewer_count(record.id, now), now,
                               self.config.reap_policy)
        if (decision.busy_at, decision.blocked_by) != (record.busy_at, record.idle_blocked_by):
            self.store.observe(record.id, record.state, decision.busy_at, decision.blocked_by)
        return decision

    def run_reaper(self) -> None:
        while not self.stopping.wait(self.config.reap_interval_s):
            try:
                self.reconcile()
                self.reap_once()
            except (ReployError, OSError) as e:
                log(f"serve: reaper: {e}")

    def close(self) -> None:
        self.stopping.set()
        if self.model_proxy is not None:
            self.model_proxy.close()
        self.egress_proxy.close()
        self.agent_connections.close()
        self.store.close()


# ============================================================================================
# what a session can make serve log: its proxies' lines, counted
# ============================================================================================
# A workload decides how often serve's proxies refuse it, and what their refusals quote (its
# request line, its target). Each proxy's lines about a session go through a SessionLog: in
# each window of LOG_WINDOW_S, the first LINES_PER_WINDOW are logged (the egress proxy also
# records those refusals as events), the rest only counted, and a window that counted any ends
# in one summary line (and one event). Every line's text from the sandbox is escaped (no control
# character reaches the log raw: safe_message) and cut to MAX_LOGGED_CHARS. So a session makes
# serve log at most LINES_PER_WINDOW + 1 lines of bounded length per window and kind, however
# fast it sends.

LINES_PER_WINDOW = 5
LOG_WINDOW_S = 60.0
MAX_LOGGED_CHARS = 400  #: of one line's text from the sandbox, once escaped


class Tallied(enum.Enum):
    ONE_BY_ONE = "one by one"  # logged (and recorded) on its own
    COUNTED = "counted"  # only counted: its window's summary says how many


@dataclass(frozen=True)
class LogSummary:
    """A window of a session's that ended with lines only counted: how many, and the last."""

    session_id: str
    count: int
    window_s: float
    last: str


@dataclass
class _Window:
    start: float
    seen: int = 0
    last: str = ""


class LogTally:
    """Pure: which of a session's lines are logged one by one (the first `per_window` of each
    window of window_s, a window starting at the first line after the last one ended), and
    the summaries of windows that ended with lines only counted."""

    def __init__(self, per_window: int = LINES_PER_WINDOW, window_s: float = LOG_WINDOW_S) -> None:
        self.per_window, self.window_s = per_window, window_s
        self._windows: dict[str, _Window] = {}
        self._finished: list[LogSummary] = []

    def line(self, session_id: str, text: str, now: float) -> Tallied:
        window = self._windows.get(session_id)
        if window is not None and now >= window.start + self.window_s:
            self._finish(session_id)
            window = None
        if window is None:
            window = self._windows[session_id] = _Window(now)
        window.seen += 1
        if window.seen <= self.per_window:
            return Tallied.ONE_BY_ONE
        window.last = text
        return Tallied.COUNTED

    def ended(self, now: float) -> list[LogSummary]:
        """The summaries of the windows over by now (each once), oldest first."""
        for session_id, window in list(self._windows.items()):
            if now >= window.start + self.window_s:
                self._finish(session_id)
        finished, self._finished = self._finished, []
        return finished

    def end_session(self, session_id: str) -> list[LogSummary]:
        """The session's window ends now (its socket closed): what is due, its own included."""
        if session_id in self._windows:
            self._finish(session_id)
        finished, self._finished = self._finished, []
        return finished

    def _finish(self, session_id: str) -> None:
        window = self._windows.pop(session_id)
        if window.seen > self.per_window:
            self._finished.append(LogSummary(session_id, window.seen - self.per_window,
                                             self.window_s, window.last))


class SessionLog:
    """One kind of line about sessions in serve's log (LogTally's rule), each text escaped and
    cut; the summaries are logged (and handed to `summarized`) when their window ends, by a
    thread of its own, so a burst's count is never held back until the next line."""

    def __init__(self, kind: str, summarized: Callable[[LogSummary], None] = lambda summary: None,
                 window_s: float = LOG_WINDOW_S) -> None:
        self._kind = kind
        self._summarized = summarized
        self._tally = LogTally(window_s=window_s)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._summarize_ended, name=f"log-{kind}", daemon=True).start()

    def line(self, session_id: str, text: str) -> bool:
        """Logs `text` (from the sandbox or built from what it sent) as a line of the session's,
        or counts it; whether it was logged one by one."""
        text = safe_message(text, MAX_LOGGED_CHARS)
        with self._lock:
            tallied = self._tally.line(session_id, text, time.monotonic())
            due = self._tally.ended(time.monotonic())
        if tallied is Tallied.ONE_BY_ONE:
            log(f"serve: session {session_id}: {text}")
        self._summarize(due)
        return tallied is Tallied.ONE_BY_ONE

    def end_session(self, session_id: str) -> None:
        with self._lock:
            due = self._tally.end_session(session_id)
        self._summarize(due)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            due = self._tally.ended(math.inf)
        self._summarize(due)

    def _summarize_ended(self) -> None:
        while not self._closed.wait(self._tally.window_s / 4):
            with self._lock:
                due = self._tally.ended(time.monotonic())
            self._summarize(due)

    def _summarize(self, summaries: Iterable[LogSummary]) -> None:
        for summary in summaries:
            log(f"serve: session {summary.session_id}: {summary.count} more {self._kind} lines in "
                f"{summary.window_s:.3g} s, not logged one by one; the last: {summary.last}")
            self._summarized(summary)


# ============================================================================================
# the model proxy: the credential for claude-code sessions, held here and nowhere else
# ============================================================================================
# A claude-code session's CLI gets ANTHROPIC_BASE_URL=http://127.0.0.1:MODEL_RELAY_PORT and a
# placeholder token. In the container the agent (root) relays each connection to that port
# to DIR/agent/model.sock (agent.py's ModelRelay); serve listens there, on the host, one
# socket per session, and forwards what this section allows to the one --model-upstream with
# the real credential. The proxy runs as threads of serve, not as a process of its own:
# serve already holds the session disks (where the sockets live) and its own token, starts
# and stops with the sessions it serves, and a second process would need the credential
# handed over and a supervisor of its own. The socket a connection arrives on names its
# session; nothing the sandbox sends is trusted to say so.

MODEL_RELAY_PORT = 8137  #: in each session's own network namespace (network none: loopback only)
MODEL_PLACEHOLDER = "reploy-model-proxy-placeholder"  #: the CLI's token: not a secret, replaced
MODEL_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})  #: POST only
MODEL_AUTH_HEADERS = {"x-api-key": "x-api-key", "bearer": "authorization"}  #: --model-auth
MAX_MODEL_HEAD_BYTES = 64 * 1024  #: the request line and headers from the sandbox
MAX_MODEL_BODY_BYTES = 32 * 1024 * 1024  #: one request body (a long conversation)
MAX_MODEL_RESPONSE_BYTES = 64 * 1024 * 1024  #: raw upstream body bytes of one response
MAX_MODEL_REQUESTS = 4  #: in flight per session, from a whole head on; one more is answered 429
#: The request bodies the proxy holds at once, by their Content-Length, taken before a byte of
#: a body is read and given back once it has gone upstream (ModelBodyRoom): a session's (429
#: past it), and all sessions' (503 past it). Two of the largest bodies a session, eight serve.
MAX_MODEL_SESSION_BODIES_BYTES = 2 * MAX_MODEL_BODY_BYTES
MAX_MODEL_BODIES_BYTES = 8 * MAX_MODEL_BODY_BYTES
#: The whole request, head and body, arrives within this of its connection, else 408: a
#: request trickled a byte at a time gets no new bound per read.
MODEL_REQUEST_DEADLINE_S = 30.0
MODEL_CLIENT_TIMEOUT_S = 30.0  #: the client takes what the proxy sends it within this
MODEL_CONNECT_TIMEOUT_S = 15.0  #: to the upstream, TLS included
MODEL_IDLE_TIMEOUT_S = 300.0  #: the upstream's silence between two reads
MODEL_RESPONSE_TIMEOUT_S = 1800.0  #: one whole response
MODEL_READ_BYTES = 64 * 1024  #: one read of a request from the relay
#: One read of the upstream: what has arrived of the answer, decrypted, up to this; a read never
#: waits for more than some, so a slow answer still goes out delta by delta (BatchedTLSSocket).
#: 512 KiB, not 256: the proxy's CPU per 32 MiB answer went from 22-25 ms to 16-21 ms
#: (bench/README.md, "Reads of 512 KiB").
MODEL_BATCH_BYTES = 512 * 1024
#: The send buffer of a connection from the relay: a batch goes out in one send, not two with a
#: wait for the reader between (the default, about 200 KiB, holds less than one). Kernel memory
#: a reader that stops can pin: this, doubled by the kernel and capped by wmem_max, times
#: MAX_MODEL_REQUESTS a session, for at most MODEL_CLIENT_TIMEOUT_S.
MODEL_SEND_BUFFER_BYTES = 2 * MODEL_BATCH_BYTES
MODEL_POOL_SIZE = 4  #: idle upstream connections kept open, per serve (it has one upstream)
MODEL_POOL_IDLE_S = 20.0  #: an idle upstream connection is closed after this
_REDACTED_BYTES = agent_role.REDACTED.encode()
#: What a claude-code session's container gets (none of it secret). CLAUDE_CODE_MAX_RETRIES:
#: the CLI retries a failed request 10 times over about 3 minutes by default, each attempt
#: bounded here already (MODEL_CONNECT_TIMEOUT_S); 2 retries ride out a brief upstream hiccup
#: and a turn against an unreachable upstream ends in seconds, with the error in the log.
MODEL_CLI_ENVIRONMENT = {"ANTHROPIC_BASE_URL": f"http://127.0.0.1:{MODEL_RELAY_PORT}",
                         "ANTHROPIC_AUTH_TOKEN": MODEL_PLACEHOLDER,
                         "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                         "CLAUDE_CODE_MAX_RETRIES": "2"}
#: The sandbox's request headers forwarded upstream, by name and by prefix: what the Messages
#: API reads. Every other one is dropped (an allow-list: credentials, hop-by-hop framing,
#: X-Forwarded-*, Forwarded, X-Original-URL, names no list of ours foresaw); the proxy sets
#: Host, Content-Length, the credential and Accept-Encoding: identity (http.client's own).
_MODEL_FORWARDED_REQUEST = frozenset({"content-type", "accept", "user-agent"})
_MODEL_FORWARDED_REQUEST_PREFIXES = ("anthropic-",)
#: The upstream's headers the CLI gets (redacted); the proxy frames the body itself.
_MODEL_KEPT_RESPONSE = frozenset({"content-type", "request-id", "x-request-id", "retry-after",
                                  "x-should-retry"})
_MODEL_KEPT_RESPONSE_PREFIXES = ("anthropic-",)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_MODEL_QUERY = re.compile(r"[A-Za-z0-9._~=&%+-]*")


class ModelRefusal(Exception):
    """A request the proxy answers itself: the status, the Messages API's error type, why."""

    def __init__(self, status: int, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.kind, self.reason = status, kind, reason


@dataclass(frozen=True)
class ModelUpstream:
    """--model-upstream and its options (never the credential, which only ModelProxy holds)."""

    host: str
    port: int
    base_path: str  # a gateway's prefix, "" for the API's own root
    ca_file: Optional[Path] = None
    auth: str = "x-api-key"  # a key of MODEL_AUTH_HEADERS


@dataclass(frozen=True)
class ModelRequest:
    """One request from the sandbox, as the proxy forwards it."""

    path: str
    query: str
    headers: tuple[tuple[str, str], ...]  # those forwarded, in order
    body_bytes: int


def parse_model_upstream(url: str, ca_file: Optional[Path], auth: str) -> ModelUpstream:
    """--model-upstream: https://HOST[:PORT][/PREFIX], nothing else (UsageError)."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port or 443
    except ValueError:
        raise UsageError(f"--model-upstream: {url!r} has a bad port") from None
    if parts.scheme != "https" or not parts.hostname or parts.username or parts.password \
            or parts.query or parts.fragment:
        raise UsageError(f"--model-upstream: {url!r} is not https://HOST[:PORT][/PREFIX] "
                         "(https only, no user, query or fragment)")
    if ca_file is not None and not ca_file.is_file():
        raise UsageError(f"--model-upstream-ca: {ca_file} is not a file")
    return ModelUpstream(parts.hostname, port, parts.path.rstrip("/"),
                         ca_file.absolute() if ca_file else None, auth)


def parse_model_request(head: bytes, body_limit: int = MAX_MODEL_BODY_BYTES) -> ModelRequest:
    """The request line and headers (CRLF CRLF excluded) -> what is forwarded, or ModelRefusal.
    Only POST to the Messages API's own paths, in origin form (no absolute URI, no CONNECT),
    with a Content-Length body; of its headers only those _MODEL_FORWARDED_REQUEST allows."""
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        raise ModelRefusal(400, "invalid_request_error", "the request head is not ASCII") from None
    line, *header_lines = text.split("\r\n")
    method, _, rest = line.partition(" ")
    target, _, version = rest.partition(" ")
    if version not in ("HTTP/1.1", "HTTP/1.0") or not target:
        raise ModelRefusal(400, "invalid_request_error", "not an HTTP/1.1 request line")
    if not target.startswith("/"):
        raise ModelRefusal(403, "permission_error", "the proxy takes origin-form targets only "
                           "(no absolute URI, no CONNECT): it forwards to its one upstream")
    path, _, query = target.partition("?")
    if method != "POST" or path not in MODEL_PATHS:
        raise ModelRefusal(403, "permission_error", f"{method} {path} is not forwarded: the "
                           f"proxy forwards POST {', '.join(sorted(MODEL_PATHS))} only")
    if not _MODEL_QUERY.fullmatch(query):
        raise ModelRefusal(400, "invalid_request_error", "the query holds characters a query "
                           "of the Messages API never does")
    headers, length = [], None
    for header_line in header_lines:
        name, colon, value = header_line.partition(":")
        if not colon or not _HEADER_NAME.fullmatch(name) or any(c in value for c in "\r\n\0"):
            raise ModelRefusal(400, "invalid_request_error", "a malformed header line")
        lowered, value = name.lower(), value.strip()
        if lowered == "transfer-encoding":
            raise ModelRefusal(411, "invalid_request_error", "send the body with Content-Length")
        if lowered == "content-length":
            if length is not None or not value.isdigit():
                raise ModelRefusal(400, "invalid_request_error", "one decimal Content-Length")
            length = int(value)
        elif lowered in _MODEL_FORWARDED_REQUEST or lowered.startswith(_MODEL_FORWARDED_REQUEST_PREFIXES):
            headers.append((name, value))
    if length is None:
        raise ModelRefusal(411, "invalid_request_error", "a body needs Content-Length")
    if length > body_limit:
        raise ModelRefusal(413, "request_too_large", f"the body is over {body_limit} bytes")
    return ModelRequest(path, query, tuple(headers), length)


def model_error_body(kind: str, message: str) -> bytes:
    """The Messages API's own error shape, which the CLI reports as it would the API's."""
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


def model_error_response(status: int, kind: str, message: str) -> bytes:
    body = model_error_body(kind, message)
    reason = http.client.responses.get(status, "Error")
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def model_sse_error(message: str) -> bytes:
    """The terminal event of a stream the proxy ends (the cap, the time bound)."""
    return b"event: error\ndata: " + model_error_body("api_error", message) + b"\n\n"


def kept_response_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(name, value) for name, value in headers
            if name.lower() in _MODEL_KEPT_RESPONSE
            or name.lower().startswith(_MODEL_KEPT_RESPONSE_PREFIXES)]


def coding_refusal(headers: Iterable[tuple[str, str]]) -> Optional[str]:
    """Why an upstream answer cannot be forwarded redacted, None if it can. The redaction finds
    the credential in the body's bytes as they arrive, so those bytes must be the body itself:
    a Transfer-Encoding of none or exactly `chunked` (which http.client takes off, comparing
    the same way), a Content-Encoding of none or identity. A coded body (gzip, a list such as
    `gzip, chunked` that http.client leaves on) would carry an echoed credential through unseen."""
    transfer = [value.lower() for name, value in headers if name.lower() == "transfer-encoding"]
    if transfer not in ([], ["chunked"]):
        return "the model upstream framed its answer other than as chunked, which cannot be redacted"
    if any(coding.strip().lower() != "identity" for name, value in headers
           if name.lower() == "content-encoding" for coding in value.split(",")):
        return "the model upstream sent an encoded body, which cannot be redacted"
    return None


class ModelBodyRoom:
    """Room for request bodies in bytes of their Content-Length: each session's within
    session_bytes, all sessions' within total_bytes. Taken once a request's head is whole,
    before a byte of its body is read, so a body that does not fit is refused unread
    (ModelRefusal: 429 past the session's bound, 503 past serve's); given back once the body
    has gone upstream. It bounds what the proxy buffers, not what it lets through."""

    def __init__(self, session_bytes: int = MAX_MODEL_SESSION_BODIES_BYTES,
                 total_bytes: int = MAX_MODEL_BODIES_BYTES) -> None:
        self._session_bytes, self._total_bytes = session_bytes, total_bytes
        self._held = SessionTally()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def holding(self, session_id: str, size: int) -> Iterator[None]:
        with self._lock:
            held = self._held.of(session_id)
            if held + size > self._session_bytes:
                raise ModelRefusal(429, "rate_limit_error", f"this session's model requests "
                                   f"under way hold {held} bytes of body; {size} more is over "
                                   f"its {self._session_bytes}")
            if self._held.total + size > self._total_bytes:
                raise ModelRefusal(503, "overloaded_error", f"the proxy holds {self._held.total} "
                                   f"bytes of model request bodies; {size} more is over its "
                                   f"{self._total_bytes}")
            self._held.add(session_id, size)
        try:
            yield
        finally:
            with self._lock:
                self._held.remove(session_id, size)


class BytesRedactor:
    """The credential replaced with [REDACTED] in a byte stream, also when it is split across
    upstream reads: the longest tail that could still grow into it is held for the next read
    (agent.Redactor's rule). One secret and bytes throughout (bytes.find, no decoding, one
    join per read): it runs on every chunk of every answer, so it costs little per byte."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode("ascii")  # _MODEL_CREDENTIAL: ASCII only
        #: Its proper prefixes by their last byte: a read whose tail could grow into the
        #: credential ends in one of them, so one dict lookup clears most reads.
        self._prefixes: dict[int, tuple[bytes, ...]] = {}
        for length in range(1, len(self._secret)):
            last = self._secret[length - 1]
            self._prefixes[last] = (*self._prefixes.get(last, ()), self._secret[:length])
        self._held = b""

    def feed(self, data: bytes) -> bytes:
        buffer = self._held + data if self._held else data
        secret, position = self._secret, 0
        if buffer.find(secret) < 0 and not (buffer and buffer.endswith(self._prefixes.get(buffer[-1], ()))):
            self._held = b""  # most reads: nothing to replace or hold, passed on as they are
            return buffer
        out: list[bytes] = []
        while (found := buffer.find(secret, position)) >= 0:
            out += (buffer[position:found], _REDACTED_BYTES)
            position = found + len(secret)
        decided = len(buffer) - self._undecided_len(buffer, position)
        out.append(buffer[position:decided])
        self._held = buffer[decided:]
        return b"".join(out)

    def finish(self) -> bytes:
        held, self._held = self._held, b""
        return held  # shorter than the credential: nothing to replace

    def whole(self, data: bytes) -> bytes:
        """One complete piece (a header value), with nothing held after it."""
        return self.feed(data) + self.finish()

    def _undecided_len(self, buffer: bytes, start: int) -> int:
        """The longest suffix of buffer[start:] that is a proper prefix of the credential."""
        secret = self._secret
        start = max(len(buffer) - len(secret) + 1, start)
        while (index := buffer.find(secret[:1], start)) >= 0:
            if secret.startswith(buffer[index:]):
                return len(buffer) - index
            start = index + 1
        return 0


def last_event_end(data: bytes) -> int:
    """Where the last whole SSE event of data ends (just past its blank line), 0 if none does.
    The CRLF search starts where an end later than the LF one's could begin: one scan of the
    read each, not two."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n", max(lf - 1, 0))
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


class WholeEvents:
    """Passes an SSE stream on in whole events only (up to a blank line), holding the tail:
    a stream the proxy cuts short (the cap, a failure) then ends on an event boundary, and
    its terminal error event parses as one."""

    def __init__(self) -> None:
        self._held = b""

    def feed(self, data: bytes) -> tuple[bytes, memoryview]:
        """The whole events held and in data, as two pieces to send in turn (send_pieces): the
        tail held from before and a view of data, not copied. A blank line across the two ends
        within data's first 3 bytes, so an end found in data past them is the last one; only
        a read with none (a small one, or one inside a long event) is joined to the tail."""
        end = last_event_end(data)
        if end < len(b"\r\n\r\n"):
            data, self._held = self._held + data, b""
            end = last_event_end(data)
        held, self._held = self._held, data[end:]
        return held, memoryview(data)[:end]

    def finish(self) -> bytes:
        held, self._held = self._held, b""
        return held


def keeps_connection(read_to_end: bool, server_closes: bool) -> bool:
    """Whether an upstream connection goes back to the pool after an answer: only once that
    answer was read to its end (no byte of it left to be taken for the next one's) and the
    upstream did not say it closes (Connection: close, HTTP/1.0, a body the close ends)."""
    return read_to_end and not server_closes


def retries_on_fresh(reused: bool, body_sent: bool, error: BaseException) -> bool:
    """Whether a request that failed is sent again, once, on a new connection: only if it
    went out whole on a pooled connection and the upstream ended that connection before the
    answer's status line (http.client's RemoteDisconnected, a reset, a TLS end): an upstream
    closing an idle connection as this request was sent. Nothing reached the CLI then."""
    return reused and body_sent and isinstance(error, (ConnectionResetError, ssl.SSLEOFError))


class IdleUpstreams:
    """Idle TLS connections to the one upstream, at most MODEL_POOL_SIZE: a request takes one
    (no two requests share one), puts it back only when keeps_connection says so, and those
    idle MODEL_POOL_IDLE_S are closed. One pool per serve, not per session: a connection that
    was read to its end carries nothing of the request before it (the credential is serve's,
    not the session's), so a session's first request gets a warm one too. The clock is the
    caller's (`now`, time.monotonic)."""

    def __init__(self, size: int = MODEL_POOL_SIZE, idle_s: float = MODEL_POOL_IDLE_S) -> None:
        self._size, self._idle_s = size, idle_s
        self._idle: list[tuple[float, http.client.HTTPConnection]] = []  # oldest first
        self._lock = threading.Lock()
        self._closed = False  # then what a request puts back is closed at once

    def take(self, now: float) -> Optional[http.client.HTTPConnection]:
        """The most recently idle one within its bound (the likeliest still open), or None."""
        self.close_expired(now)
        with self._lock:
            return self._idle.pop()[1] if self._idle else None

    def put(self, connection: http.client.HTTPConnection, now: float) -> None:
        with self._lock:
            self._idle.append((now, connection))
            cut = len(self._idle) if self._closed else max(0, len(self._idle) - self._size)
            surplus, self._idle = self._idle[:cut], self._idle[cut:]
        for _, extra in surplus:
            extra.close()

    def close_expired(self, now: float) -> None:
        with self._lock:
            expired = [c for since, c in self._idle if now - since >= self._idle_s]
            self._idle = [(since, c) for since, c in self._idle if now - since < self._idle_s]
        for connection in expired:
            connection.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.close_expired(math.inf)


# -- the upstream's TLS, read in batches ----------------------------------------------------

class BatchedTLSSocket:
    """The client end of a TLS connection, as much of a socket as http.client uses (sendall,
    makefile, timeouts, close), over ssl.MemoryBIO. ssl.SSLSocket makes two system calls per
    TLS record (at most 16 KiB: OpenSSL reads its header, then its body), and http.client then
    hands on one record per read; here one read of the socket takes up to MODEL_BATCH_BYTES and
    a read returns every record that has arrived, so the proxy redacts and forwards a 32 MiB
    answer in about 65 passes, not 2,000. The certificate and name are checked as by
    wrap_socket (the same context, server_hostname). Timeouts are the TCP socket's."""

    def __init__(self, raw: socket.socket, context: ssl.SSLContext, hostname: str) -> None:
        self._raw = raw
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_hostname=hostname)
        self._arrived = bytearray(MODEL_BATCH_BYTES)
        self._files = 0  # open makefile()s: the TCP socket closes once they and we are closed
        self._closed = False
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._send_pending()
                if not self._receive():
                    raise ConnectionResetError("the upstream closed the connection in the TLS handshake") from None
        self._send_pending()

    def _send_pending(self) -> None:
        if self._outgoing.pending:
            self._raw.sendall(self._outgoing.read())

    def _receive(self) -> bool:
        """One read of the TCP socket into the TLS object (waiting, within the timeout);
        False at its end."""
        got = self._raw.recv_into(self._arrived)
        if not got:
            self._incoming.write_eof()
            return False
        self._incoming.write(memoryview(self._arrived)[:got])
        return True

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        """A batch at a time into the memory BIO, each sent before the next: a 32 MiB request
        body is never held a second time, encrypted whole."""
        with memoryview(data) as view:
            for start in range(0, len(view), MODEL_BATCH_BYTES):
                self._tls.write(view[start:start + MODEL_BATCH_BYTES])
                self._send_pending()

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        """What has arrived, decrypted, up to the buffer's size; waits only while none has.
        0 at the end (a TLS close, or an end without one: as SSLSocket's suppress_ragged_eofs)."""
        view = memoryview(buffer).cast("B")[:nbytes or None]
        filled = 0
        while filled < len(view):
            try:
                got = cast(int, self._tls.read(len(view) - filled, view[filled:]))  # into a buffer: a count
            except ssl.SSLWantReadError:
                self._send_pending()  # what reading made the TLS object answer (a key update)
                if filled or self._incoming.eof:
                    break  # what has arrived goes out now; or the end, after all it held
                self._receive()
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                break
            if not got:
                break
            filled += got
        return filled

    def makefile(self, mode: str = "rb", buffering: Optional[int] = None) -> io.BufferedReader:
        assert mode == "rb", mode  # all http.client asks for
        self._files += 1
        return io.BufferedReader(_BatchedTLSReader(self), MODEL_BATCH_BYTES)

    def pending(self) -> int:
        """Bytes of the upstream's already here: decrypted, or still in the TLS object."""
        return self._tls.pending() + self._incoming.pending

    def fileno(self) -> int:
        return self._raw.fileno()

    def settimeout(self, timeout: Optional[float]) -> None:
        self._raw.settimeout(timeout)

    def gettimeout(self) -> Optional[float]:
        return self._raw.gettimeout()

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self._raw.setsockopt(level, option, value)

    def close(self) -> None:
        self._closed = True
        if not self._files:
            self._raw.close()

    def _file_closed(self) -> None:
        self._files -= 1
        if self._closed and not self._files:
            self._raw.close()


class _BatchedTLSReader(io.RawIOBase):
    """makefile()'s raw stream: an answer http.client keeps reading after it let go of the
    connection (Connection: close) keeps the TCP socket open until it is closed too."""

    def __init__(self, sock: BatchedTLSSocket) -> None:
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._sock.recv_into(buffer)

    def close(self) -> None:
        if not self.closed:
            self._sock._file_closed()
        super().close()


class UpstreamConnection(http.client.HTTPConnection):
    """http.client to the upstream over BatchedTLSSocket."""

    def __init__(self, host: str, port: int, context: ssl.SSLContext, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.tls_context = context

    def connect(self) -> None:
        super().connect()  # TCP, within the timeout, TCP_NODELAY
        self.sock = BatchedTLSSocket(self.sock, self.tls_context, self.host)


# -- the proxy's I/O: per-session sockets on the host, one thread per connection ------------

def idle_intact(connection: http.client.HTTPConnection) -> bool:
    """An idle upstream connection is taken as open when is_quiet, and nothing of the upstream's
    is already in its TLS buffers."""
    sock = connection.sock
    if sock is None or (isinstance(sock, (ssl.SSLSocket, BatchedTLSSocket)) and sock.pending()):
        return False
    return is_quiet(sock)


def send_pieces(conn: socket.socket, pieces: Iterable[bytes | memoryview]) -> None:
    """All the pieces, in order, with one gather write (sendmsg) while they fit: no join of
    them into one copy first. Within the socket's timeout as a whole, as sendall: a client
    that takes the answer a trickle at a time gets no new timeout per trickle."""
    views = [memoryview(piece) for piece in pieces if len(piece)]
    timeout = conn.gettimeout()
    deadline = time.monotonic() + (math.inf if timeout is None else timeout)
    try:
        while views:
            sent = conn.sendmsg(views)
            while views and sent >= len(views[0]):
                sent -= len(views.pop(0))
            if views:  # the client's buffer is full: the rest within what is left of the timeout
                views[0] = views[0][sent:]
                if (left := deadline - time.monotonic()) <= 0:
                    raise TimeoutError("the client did not take the answer in time")
                if timeout is not None:
                    conn.settimeout(left)
    finally:
        if conn.gettimeout() != timeout:
            conn.settimeout(timeout)


class ModelRequestReader:
    """One request from the relay as it arrives, its head and then its body, all of it within
    one deadline from the connection (ModelRefusal 408 past it): a request trickled a byte at a
    time gets no new bound per read. The body is read into one buffer of its Content-Length,
    taken in full only once a head asked for it (ModelProxy._serve): linear, no growing copy."""

    def __init__(self, conn: socket.socket, deadline_s: float) -> None:
        self._conn, self._deadline_s = conn, deadline_s
        self._deadline = time.monotonic() + deadline_s
        self._early = b""  # what came with the head past its end: the body's start

    def head(self) -> ModelRequest:
        """The request line and headers, bounded in size (431) and parsed (parse_model_request)."""
        data, scratch, end = bytearray(), bytearray(MODEL_READ_BYTES), -1
        while end < 0:
            searched = max(len(data) - 3, 0)  # a CRLF CRLF across two reads is found too
            data += memoryview(scratch)[:self._receive_into(scratch)]
            end = data.find(b"\r\n\r\n", searched)
            if (end if end >= 0 else len(data)) > MAX_MODEL_HEAD_BYTES:
                raise ModelRefusal(431, "invalid_request_error",
                                   f"the request head is over {MAX_MODEL_HEAD_BYTES} bytes")
        self._early = bytes(data[end + 4:])
        return parse_model_request(bytes(data[:end]))

    def body(self, length: int) -> bytearray:
        """The body of a head that said `length` (anything past it is never read)."""
        body = bytearray(length)
        with memoryview(body) as view:
            filled = min(len(self._early), length)
            view[:filled] = self._early[:filled]
            while filled < length:
                filled += self._receive_into(view[filled:])
        return body

    def drop_rest(self) -> None:
        """After a refusal: what the client still sends (a body the refusal came before) is
        read and dropped until it closes, within MAX_MODEL_BODY_BYTES and what is left of the
        deadline; a close with its body unread would break the client's pipe before it read
        the refusal."""
        self._conn.shutdown(socket.SHUT_WR)
        scratch, drained = bytearray(MODEL_READ_BYTES), 0
        with contextlib.suppress(ModelRefusal, ConnectionError):  # the deadline, the close
            while drained <= MAX_MODEL_BODY_BYTES:
                drained += self._receive_into(scratch)

    def _receive_into(self, buffer: bytearray | memoryview) -> int:
        """One read, waiting at most what is left of the deadline; ConnectionError at the
        client's end. The socket's own timeout is left as it was (the answer's)."""
        timeout = self._conn.gettimeout()
        try:
            if (left := self._deadline - time.monotonic()) <= 0:
                raise TimeoutError
            self._conn.settimeout(left)
            got = self._conn.recv_into(buffer)
        except TimeoutError:
            raise ModelRefusal(408, "timeout_error", "the request did not arrive whole within "
                               f"{self._deadline_s:g} s of its connection") from None
        finally:
            self._conn.settimeout(timeout)
        if not got:
            raise ConnectionError("the client left before its request was whole")
        return got


def read_model_credential(path: Path) -> str:
    """--model-credential-file, refused as the token file is (read_token)."""
    return read_token(path, must_own=True, what="model credential file", pattern=_MODEL_CREDENTIAL)


def bind_agent_socket(agent_dir: Path, name: str) -> socket.socket:
    """A listening unix socket at agent_dir/name (an old one replaced), root's and 0600, bound
    through the directory's fd: short however deep the state dir, and never through a link."""
    dir_fd = os.open(agent_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(f"/proc/self/fd/{dir_fd}/{name}")
            os.chmod(name, 0o600, dir_fd=dir_fd)
            sock.listen(agent_role.LISTEN_BACKLOG)
        except BaseException:
            sock.close()
            raise
    finally:
        os.close(dir_fd)
    return sock


class SessionSockets:
    """Each session's listening socket of one kind in DIR/agent (bind_agent_socket), with an
    accept thread that hands every connection to a `serve(conn, slots)` thread of its own; the
    session's `slots` bound what it may have under way at once."""

    def __init__(self, socket_name: str, max_at_once: int, kind: str) -> None:
        self.socket_name, self.max_at_once, self.kind = socket_name, max_at_once, kind
        self._listeners: dict[str, socket.socket] = {}
        self._lock = threading.Lock()

    def listen(self, session_id: str, agent_dir: Path,
               serve: Callable[[socket.socket, threading.BoundedSemaphore], None]) -> None:
        """(Re)binds agent_dir/socket_name for the session; the socket stays root's and 0600
        (DIR/agent is 0700 root's)."""
        self.close_session(session_id)
        sock = bind_agent_socket(agent_dir, self.socket_name)
        with self._lock:
            self._listeners[session_id] = sock
        slots = threading.BoundedSemaphore(self.max_at_once)
        threading.Thread(target=self._accept_loop, args=(session_id, sock, slots, serve),
                         name=f"{self.kind}-{session_id}", daemon=True).start()

    def close_session(self, session_id: str) -> None:
        """Stops listening for the session (before its disk is unmounted: a bound socket pins
        the mount); connections under way finish on their own threads."""
        with self._lock:
            sock = self._listeners.pop(session_id, None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        for session_id in list(self._listeners):
            self.close_session(session_id)

    def _accept_loop(self, session_id: str, sock: socket.socket, slots: threading.BoundedSemaphore,
                     serve: Callable[[socket.socket, threading.BoundedSemaphore], None]) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=serve, args=(conn, slots), name=f"{self.kind}-{session_id}-conn",
                             daemon=True).start()


class ModelProxy:
    """The host side: DIR/agent/model.sock of each claude-code session, forwarded to the one
    upstream with the credential (see the section's head)."""

    def __init__(self, upstream: ModelUpstream, credential: str,
                 request_deadline_s: float = MODEL_REQUEST_DEADLINE_S) -> None:
        self.upstream = upstream
        self._credential = credential
        self._request_deadline_s = request_deadline_s
        self._bodies = ModelBodyRoom()
        self._tls = ssl.create_default_context(cafile=str(upstream.ca_file) if upstream.ca_file
                                               else None)
        if upstream.ca_file:  # the system's roots too: a CA file adds trust, never replaces it
            self._tls.load_default_certs()
        self._sockets = SessionSockets(agent_role.MODEL_SOCKET_NAME, MAX_MODEL_REQUESTS, "model")
        self._log = SessionLog("model proxy")
        self._pool = IdleUpstreams()
        self._closed = threading.Event()
        threading.Thread(target=self._reap_idle, name="model-pool", daemon=True).start()

    def listen(self, session_id: str, agent_dir: Path) -> None:
        """(Re)binds agent_dir/model.sock for the session."""
        self._sockets.listen(session_id, agent_dir, functools.partial(self._serve, session_id))

    def close_session(self, session_id: str) -> None:
        self._sockets.close_session(session_id)
        self._log.end_session(session_id)

    def close(self) -> None:
        self._sockets.close()
        self._log.close()
        self._closed.set()
        self._pool.close()

    def _reap_idle(self) -> None:
        while not self._closed.wait(MODEL_POOL_IDLE_S / 4):
            self._pool.close_expired(time.monotonic())

    def _serve(self, session_id: str, conn: socket.socket,
               slots: threading.BoundedSemaphore) -> None:
        """One request: its head, then a slot of the session's and room for its body (either
        refused before a byte of the body is read), then its body, all within one deadline
        (ModelRequestReader); refused or forwarded. A head still arriving holds neither: a
        slot is held from a whole head to the answer's end. Connections themselves are
        bounded by the session's relay (agent.MAX_RELAYED_CONNECTIONS)."""
        admitted = False
        with conn:
            try:
                conn.settimeout(MODEL_CLIENT_TIMEOUT_S)
                reader = ModelRequestReader(conn, self._request_deadline_s)
                try:
                    request = reader.head()
                    if not (admitted := slots.acquire(blocking=False)):
                        raise ModelRefusal(429, "rate_limit_error", f"this session has "
                                           f"{MAX_MODEL_REQUESTS} model requests under way")
                    with self._bodies.holding(session_id, request.body_bytes):  # until sent
                        sent = self._send(session_id, conn, request, reader.body(request.body_bytes))
                except ModelRefusal as e:
                    self._log.line(session_id, f"model request refused: {e.reason}")
                    conn.sendall(model_error_response(e.status, e.kind, e.reason))
                    if admitted:  # a refused request holds no slot while its client finishes
                        slots.release()
                        admitted = False
                    reader.drop_rest()
                    return
                if sent is not None:
                    self._answer(conn, *sent)
            except OSError as e:
                self._log.line(session_id, f"model request ended: {e}")
            finally:
                if admitted:
                    slots.release()

    def _send(self, session_id: str, conn: socket.socket, request: ModelRequest,
              body: bytearray) -> Optional[tuple[http.client.HTTPConnection, http.client.HTTPResponse]]:
        """Sends the request upstream with the credential; the connection and the answer's
        head, or None once an upstream failure was answered (502 and 504 in the API's error
        shape). The body is the caller's to let go of as this returns."""
        upstream = self.upstream
        target = upstream.base_path + request.path + (f"?{request.query}" if request.query else "")
        header_name = MODEL_AUTH_HEADERS[upstream.auth]
        value = self._credential if upstream.auth == "x-api-key" else f"Bearer {self._credential}"
        headers = dict(request.headers)
        headers[header_name] = value
        try:
            return self._exchange(target, body, headers)
        except TimeoutError:
            conn.sendall(model_error_response(504, "timeout_error", "the model upstream did "
                                              "not answer in time"))
        except (OSError, http.client.HTTPException) as e:
            self._log.line(session_id, f"model upstream: {e}")
            conn.sendall(model_error_response(502, "api_error", "the model upstream cannot "
                                              f"be reached: {type(e).__name__}"))
        return None

    def _answer(self, conn: socket.socket, client: http.client.HTTPConnection,
                response: http.client.HTTPResponse) -> None:
        """The answer back as it arrives (redacted, capped, bounded in time), unless redaction
        cannot see its bytes (coding_refusal) or it is a redirect: 502. Once the answer has
        begun, an SSE error event ends it."""
        deadline = time.monotonic() + MODEL_RESPONSE_TIMEOUT_S
        read_to_end = False
        try:
            if 300 <= response.status < 400:
                conn.sendall(model_error_response(502, "api_error", "the model upstream answered "
                                                  "a redirect; the proxy follows none"))
                return
            if (refusal := coding_refusal(response.getheaders())) is not None:
                conn.sendall(model_error_response(502, "api_error", refusal))
                return
            redactor = BytesRedactor(self._credential)
            head = [f"HTTP/1.1 {response.status} {response.reason}"]
            head += [f"{name}: {redactor.whole(value.encode('latin-1')).decode('latin-1')}"
                     for name, value in kept_response_headers(response.getheaders())]
            conn.sendall(("\r\n".join(head + ["connection: close", "", ""])).encode("latin-1"))
            stream = "text/event-stream" in response.getheader("content-type", "")
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MODEL_SEND_BUFFER_BYTES)
            read_to_end = self._stream(response, conn, redactor, deadline, stream)
        finally:
            response.close()  # read to its end, it may still be open (a Content-Length body)
            if keeps_connection(read_to_end, response.will_close or client.sock is None):
                self._pool.put(client, time.monotonic())
            else:
                client.close()

    def _exchange(self, target: str, body: bytearray, headers: dict[str, str]
                  ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """The request sent and its answer's head read, on an idle pooled connection if one
        is open, else on a new one (retries_on_fresh: once more on a new one)."""
        while (client := self._pool.take(time.monotonic())) is not None and not idle_intact(client):
            client.close()
        reused = client is not None
        if client is not None and client.sock is not None:
            client.sock.settimeout(MODEL_CONNECT_TIMEOUT_S)  # as a new connection's send is
        while True:
            if client is None:
                client = UpstreamConnection(self.upstream.host, self.upstream.port, self._tls,
                                            MODEL_CONNECT_TIMEOUT_S)
            body_sent = False
            try:
                client.request("POST", target, body=body, headers=headers)
                body_sent = True
                assert client.sock is not None
                client.sock.settimeout(MODEL_IDLE_TIMEOUT_S)
                return client, client.getresponse()
            except (OSError, http.client.HTTPException) as e:
                client.close()
                if not retries_on_fresh(reused, body_sent, e):
                    raise
                client, reused = None, False

    @staticmethod
    def _stream(response: http.client.HTTPResponse, conn: socket.socket,
                redactor: BytesRedactor, deadline: float, sse: bool) -> bool:
        """The answer's body to the CLI; whether it was read to its end."""
        total = 0
        failure = None
        events = WholeEvents() if sse else None
        while True:
            try:
                chunk = response.read1(MODEL_BATCH_BYTES)
            except TimeoutError:
                failure = f"the model upstream fell silent for {MODEL_IDLE_TIMEOUT_S:.0f} s"
                break
            except (OSError, http.client.HTTPException) as e:
                failure = f"the model upstream's answer broke off: {type(e).__name__}"
                break
            if not chunk:
                break
            total += len(chunk)
            if total > MAX_MODEL_RESPONSE_BYTES:
                failure = (f"the model upstream's answer is over {MAX_MODEL_RESPONSE_BYTES} bytes "
                           "(the proxy's cap); it is cut here")
                break
            if time.monotonic() > deadline:
                failure = f"the answer took over {MODEL_RESPONSE_TIMEOUT_S:.0f} s; it is cut here"
                break
            safe = redactor.feed(chunk)
            send_pieces(conn, events.feed(safe) if events else (safe,))
        tail = redactor.finish()
        if events is None:
            conn.sendall(tail)
        elif failure is None:
            send_pieces(conn, (*events.feed(tail), events.finish()))
        else:  # the cut event's start is dropped, so the error is an event of its own
            send_pieces(conn, (*events.feed(tail), model_sse_error(failure)))
        return failure is None


# ============================================================================================
# the egress proxy: the hosts a session may reach, and nothing else
# ============================================================================================
# A session created with `egress` (entries of serve's --egress-allow) gets HTTP(S)_PROXY =
# http://127.0.0.1:EGRESS_RELAY_PORT; in the container the agent (root) relays each connection
# to that port to DIR/agent/egress.sock (agent.py's ModelRelay, the second pair), and serve
# listens there, on the host, one socket per session, as it does for the model proxy and for
# the same reasons. Each connection carries one proxy request: CONNECT host:port (then a byte
# pipe, TLS end to end) or an absolute-form http:// request, forwarded in origin form with
# `connection: close` (one request per connection; a client's next request opens a new one).
# serve resolves the name itself, checks every address it got (decide_egress), and connects to
# the checked addresses, one after the other until one answers (connect_upstream): no second
# lookup, so a name cannot resolve elsewhere in between.

EGRESS_RELAY_PORT = 8138  #: in each session's own network namespace, beside MODEL_RELAY_PORT
DEFAULT_EGRESS_PORT = 443
MAX_EGRESS_ENTRIES = 64  #: --egress-allow entries, and so a session's `egress`
MAX_EGRESS_HEAD_BYTES = 16 * 1024  #: a proxy request's line and headers
MAX_CHUNK_LINE_BYTES = 4096  #: a forwarded chunked body's size line (with extensions), or trailer line
MAX_EGRESS_CONNECTIONS = 8  #: open per session; one more is answered 429
EGRESS_CLIENT_TIMEOUT_S = 30.0  #: the sandbox sends its whole request head within this
EGRESS_RESOLVE_TIMEOUT_S = 10.0  #: the listed name's lookup (getaddrinfo has no bound of its own)
EGRESS_CONNECT_TIMEOUT_S = 10.0  #: the name's lookup aside, to one of the upstream's addresses
EGRESS_CONNECT_TOTAL_S = 30.0  #: to all of them, one after the other: three that never answer
EGRESS_IDLE_TIMEOUT_S = 300.0  #: no byte moved either way (agent.splice): the pipe is closed
EGRESS_PROXY_URL = f"http://127.0.0.1:{EGRESS_RELAY_PORT}"
#: What a session with egress gets in its environment (shell, agent, exec): clients that
#: honour the variables go through the proxy, loopback stays the session's own.
EGRESS_ENVIRONMENT = {**{name: EGRESS_PROXY_URL for name in (
    "HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy")},
    **{name: "localhost,127.0.0.1,::1" for name in ("NO_PROXY", "no_proxy")}}
#: Hop-by-hop headers (RFC 9110 7.6.1), and `host` (the URI's replaces it): never forwarded
#: upstream, nor any proxy-* one. The body's framing (content-length, transfer-encoding) is
#: kept: the body is piped on as it came.
_EGRESS_DROPPED_REQUEST = frozenset({"connection", "keep-alive", "te", "trailer", "upgrade",
                                     "host"})
_DNS_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")
_EGRESS_PATH = re.compile(r'/[!"$-~]*')  #: an origin-form target: visible ASCII but `#`
#: Address ranges no name may resolve to (each refused unless the entry is that IP literal),
#: the first that holds an address naming why. The host's own addresses are refused too
#: (host_addresses), whatever their range.
EGRESS_REFUSED_RANGES: tuple[tuple[str, ipaddress.IPv4Network | ipaddress.IPv6Network], ...] = tuple(
    (what, ipaddress.ip_network(network)) for what, network in (
        ("metadata", "169.254.169.254/32"), ("metadata", "fd00:ec2::254/128"),
        ("unspecified", "0.0.0.0/8"), ("unspecified", "::/128"),
        ("loopback", "127.0.0.0/8"), ("loopback", "::1/128"),
        ("link-local", "169.254.0.0/16"), ("link-local", "fe80::/10"),
        ("private", "10.0.0.0/8"), ("private", "172.16.0.0/12"), ("private", "192.168.0.0/16"),
        ("private (ULA)", "fc00::/7"), ("CGNAT", "100.64.0.0/10"),
        ("multicast", "224.0.0.0/4"), ("multicast", "ff00::/8"),
        ("reserved", "240.0.0.0/4"), ("IETF protocol assignments", "192.0.0.0/24"),
        ("benchmarking", "198.18.0.0/15"), ("benchmarking", "2001:2::/48"),
        ("site-local", "fec0::/10"), ("documentation", "192.0.2.0/24"),
        ("documentation", "198.51.100.0/24"), ("documentation", "203.0.113.0/24"),
        ("documentation", "2001:db8::/32"), ("documentation", "3fff::/20"),
        ("discard-only", "100::/64"), ("NAT64 (local use)", "64:ff9b:1::/48")))
#: IPv6 prefixes whose last 32 bits are an IPv4 address: NAT64's well-known one, IPv4-mapped,
#: IPv4-translated (SIIT) and IPv4-compatible.
_IPV4_IN_LAST_32 = tuple(ipaddress.ip_network(prefix) for prefix in (
    "64:ff9b::/96", "::ffff:0:0/96", "::ffff:0:0:0/96", "::/96"))


@dataclass(frozen=True)
class EgressTimeouts:
    """The proxy's time bounds (the constants above; a test passes small ones to see each one
    hold)."""

    head_s: float = EGRESS_CLIENT_TIMEOUT_S
    resolve_s: float = EGRESS_RESOLVE_TIMEOUT_S
    connect_s: float = EGRESS_CONNECT_TIMEOUT_S
    connect_total_s: float = EGRESS_CONNECT_TOTAL_S
    idle_s: float = EGRESS_IDLE_TIMEOUT_S


class EgressRefusal(Exception):
    """A proxy request answered by the proxy itself: the status and why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


@dataclass(frozen=True)
class EgressEntry:
    """One HOST:PORT of an allow-list: a DNS name in lower case, or an IP literal."""

    host: str
    port: int

    @property
    def is_ip_literal(self) -> bool:
        """canonical_host leaves no name that parses as an address."""
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class ProxyKind(enum.Enum):
    CONNECT = "connect"  # CONNECT host:port, then a byte pipe
    FORWARD = "forward"  # an absolute-form http:// request, forwarded in origin form


@dataclass(frozen=True)
class ProxyRequest:
    """One proxy request head from the sandbox, as parse_proxy_head read it."""

    kind: ProxyKind
    host: str  # as canonical_host has it
    port: int
    head: bytes = b""  # FORWARD: the head to send upstream (origin form, `connection: close`)
    body_bytes: Optional[int] = 0  # FORWARD: its content-length (none: 0), or None: chunked


@dataclass(frozen=True)
class Allowed:
    addresses: tuple[str, ...]  # the checked addresses, in the order they are tried


@dataclass(frozen=True)
class ConnectFailure:
    """One address the proxy tried and did not reach: no answer within bound_s (error None),
    or connect's error."""

    address: str
    bound_s: float
    error: Optional[str] = None


@dataclass(frozen=True)
class Refused:
    reason: str


def canonical_host(text: str) -> str:
    """A host as the allow-list compares it: an IP literal in its compressed form (IPv6 without
    brackets), a DNS name in lower case; ValueError for anything else. A name whose last label
    is all digits is refused: resolvers read some ("127.1", "0x7f.1") as addresses."""
    literal = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    with contextlib.suppress(ValueError):
        address = ipaddress.ip_address(literal)
        if isinstance(address, ipaddress.IPv6Address) and address.scope_id:
            raise ValueError(f"{text!r}: a scoped address")
        if (literal != text) != (address.version == 6):
            raise ValueError(f"{text!r}: an IPv6 address, and only one, goes in brackets")
        return str(address)
    name = text.lower()
    labels = name.split(".")
    if literal != text or len(name) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels) \
            or labels[-1].isdigit() or labels[-1].startswith("0x"):
        raise ValueError(f"{text!r} is not a DNS name or an IP literal")
    return name


def parse_authority(text: str, default_port: Optional[int]) -> tuple[str, int]:
    """HOST[:PORT] (an IPv6 literal in brackets) -> (canonical host, port); ValueError."""
    host, port_text = text, ""
    if text.startswith("["):
        host, bracket, rest = text.partition("]")
        host += bracket
        if not bracket or rest and not rest.startswith(":"):
            raise ValueError(f"{text!r} is not HOST[:PORT]")
        port_text = rest[1:]
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    elif ":" in text:
        raise ValueError(f"{text!r}: put an IPv6 address in brackets, [ADDRESS]:PORT")
    if port_text or text.endswith(":"):
        if not port_text.isdigit() or not port_text.isascii() or len(port_text) > 5 \
                or not 1 <= int(port_text) <= 65535:
            raise ValueError(f"{text!r}: the port must be a number from 1 to 65535")
        port = int(port_text)
    elif default_port is None:
        raise ValueError(f"{text!r} has no port")
    else:
        port = default_port
    return canonical_host(host), port


def parse_egress_entry(text: str) -> EgressEntry:
    """--egress-allow and each entry of a session's `egress`: HOST[:PORT], PORT 443 if left out."""
    host, port = parse_authority(text, DEFAULT_EGRESS_PORT)
    return EgressEntry(host, port)


def parse_egress_allow(texts: Sequence[str]) -> tuple[EgressEntry, ...]:
    """--egress-allow, each entry checked (UsageError); repeats are one entry."""
    if len(texts) > MAX_EGRESS_ENTRIES:
        raise UsageError(f"--egress-allow: at most {MAX_EGRESS_ENTRIES} entries")
    entries: list[EgressEntry] = []
    for text in texts:
        try:
            entry = parse_egress_entry(text)
        except ValueError as e:
            raise UsageError(f"--egress-allow: {e}") from None
        if entry not in entries:
            entries.append(entry)
    return tuple(entries)


def session_egress(given: Sequence[str], allowed: Sequence[EgressEntry]) -> tuple[str, ...]:
    """A create's `egress` (HOST[:PORT] each) -> the entries as stored, each one of the server's
    --egress-allow; BadRequest otherwise. Pure: checked before anything is provisioned."""
    entries: list[EgressEntry] = []
    for item in given:
        try:
            entry = parse_egress_entry(item)
        except ValueError as e:
            raise BadRequest(f"egress: {e}") from None
        if entry not in allowed:
            raise BadRequest(f"egress: {entry} is not on this server's --egress-allow list"
                             + (f" ({', '.join(map(str, allowed))})" if allowed else " (it has none)"))
        if entry in entries:
            raise BadRequest(f"egress: {entry} is given twice")
        entries.append(entry)
    return tuple(map(str, entries))


def address_forms(address: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, ...]:
    """The address, and each IPv4 address an IPv6 one carries (_IPV4_IN_LAST_32, 6to4's,
    Teredo's server and client): a packet to the one may reach the other."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    forms: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        if any(ip in prefix for prefix in _IPV4_IN_LAST_32):
            forms.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if ip.sixtofour is not None:
            forms.append(ip.sixtofour)
        if ip.teredo is not None:
            forms.extend(ip.teredo)
    return tuple(forms)


def refused_range(address: str, own: frozenset[str] = frozenset()) -> Optional[str]:
    """Why a name may not lead to this address (EGRESS_REFUSED_RANGES, or one of `own`, the
    host's addresses), or None; an IPv6 form of an IPv4 address is checked as that address
    too (address_forms)."""
    for form in address_forms(address):
        for what, network in EGRESS_REFUSED_RANGES:
            if form.version == network.version and form in network:
                return what
        if str(form) in own:
            return "serve host's"
    return None


def host_addresses() -> frozenset[str]:
    """Every address of this host's interfaces now (they come and go: a bridge, a VPN), as
    ipaddress writes them."""
    return frozenset(str(ipaddress.ip_address(entry.address.split("%", 1)[0]))
                     for entries in psutil.net_if_addrs().values() for entry in entries
                     if entry.family in (socket.AF_INET, socket.AF_INET6))


def connect_order(addresses: Sequence[str]) -> tuple[str, ...]:
    """The order a name's addresses are tried in: each once, IPv6 and IPv4 taking turns, the
    resolver's first family first (as RFC 8305 has it: a family this host cannot reach costs
    one attempt at a time, not the whole of EGRESS_CONNECT_TOTAL_S)."""
    unique = list(dict.fromkeys(addresses))
    if not unique:
        return ()
    first_is_v6 = ":" in unique[0]
    first = [address for address in unique if (":" in address) == first_is_v6]
    other = [address for address in unique if (":" in address) != first_is_v6]
    turns = [first[i:i + 1] + other[i:i + 1] for i in range(max(len(first), len(other)))]
    return tuple(address for turn in turns for address in turn)


def decide_egress(allowed: Sequence[EgressEntry], host: str, port: int,
                  addresses: Sequence[str], own: frozenset[str] = frozenset()) -> Allowed | Refused:
    """Whether a proxy request to host:port (canonical_host) may go out, and to which addresses,
    given what the name resolved to and the host's own addresses: only a listed entry; an IP
    literal entry to that very address, whatever its range; a name to every address it resolved
    to, in connect_order, and only when none of them is refused (refused_range: a name that
    mixes the two is trusted with neither, so a refused address is never tried)."""
    entry = EgressEntry(host, port)
    if entry not in allowed:
        return Refused(f"{entry} is not on this session's egress list")
    if entry.is_ip_literal:
        return Allowed((host,))
    if not addresses:
        return Refused(f"{host} does not resolve")
    for address in addresses:
        what = refused_range(address, own)
        if what is not None:
            return Refused(f"{host} resolves to {address}, a {what} address; list that address "
                           "itself to allow it")
    return Allowed(connect_order(addresses))


def unreached_refusal(entry: EgressEntry, failures: Sequence[ConnectFailure], untried: int,
                      total_s: float) -> EgressRefusal:
    """No address of the entry connected: 504 when time ran out for any (one did not answer, or
    the overall bound left some untried), 502 when each one failed at once; the reason names
    each address's failure."""
    timed_out = untried > 0 or any(failure.error is None for failure in failures)
    parts = [f"{failure.address} did not answer in {failure.bound_s:.3g} s" if failure.error is None
             else f"{failure.address}: {failure.error}" for failure in failures]
    if untried:
        parts.append(f"{untried} more not tried within {total_s:.3g} s in all")
    return EgressRefusal(504 if timed_out else 502, f"{entry} cannot be reached: {'; '.join(parts)}")


def _header_fields(lines: Sequence[str]) -> list[tuple[str, str]]:
    fields = []
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon or not _HEADER_NAME.fullmatch(name) or any(c in value for c in "\r\n\0"):
            raise EgressRefusal(400, "a malformed header line (no folding, token names only)")
        fields.append((name, value.strip(" \t")))
    return fields


def parse_proxy_head(head: bytes) -> ProxyRequest:
    """The request line and headers (CRLF CRLF excluded) -> ProxyRequest, or EgressRefusal.
    CONNECT HOST:PORT, or an absolute-form http:// request of any method; https:// in absolute
    form, origin-form targets, userinfo and fragments are refused. A forwarded request loses
    its hop-by-hop and proxy-* headers, gets the URI's host as `host` and `connection: close`."""
    if len(head) > MAX_EGRESS_HEAD_BYTES:
        raise EgressRefusal(431, f"the request head is over {MAX_EGRESS_HEAD_BYTES} bytes")
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        raise EgressRefusal(400, "the request head is not ASCII") from None
    line, *header_lines = text.split("\r\n")
    parts = line.split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0") \
            or not _HEADER_NAME.fullmatch(parts[0]) or not parts[1]:
        raise EgressRefusal(400, "not an HTTP/1.1 request line")
    method, target, version = parts
    fields = _header_fields(header_lines)
    if method == "CONNECT":
        try:
            host, port = parse_authority(target, None)
        except ValueError as e:
            raise EgressRefusal(400, f"CONNECT needs HOST:PORT: {e}") from None
        return ProxyRequest(ProxyKind.CONNECT, host, port)
    scheme, sep, rest = target.partition("://")
    if not sep or scheme.lower() != "http":
        raise EgressRefusal(400, "the proxy takes CONNECT HOST:PORT (https) or an absolute "
                            "http:// URI (plain http), nothing else")
    authority, slash, path = rest.partition("/")
    path = slash + path if slash else "/"
    if "@" in authority or not _EGRESS_PATH.fullmatch(path):
        raise EgressRefusal(400, "the URI holds userinfo, a fragment or characters a URI "
                            "never does")
    try:
        host, port = parse_authority(authority, 80)
    except ValueError as e:
        raise EgressRefusal(400, f"the URI's host: {e}") from None
    lengths = [value for name, value in fields if name.lower() == "content-length"]
    codings = [value for name, value in fields if name.lower() == "transfer-encoding"]
    chunked = bool(codings)
    if (chunked and lengths) or len(lengths) > 1 or not all(v.isdigit() for v in lengths):
        raise EgressRefusal(400, "the body's framing is ambiguous (one decimal content-length, "
                            "or transfer-encoding, not both)")
    if chunked and [coding.lower() for coding in codings] != ["chunked"]:
        raise EgressRefusal(400, "a request body's transfer-encoding may be `chunked` only")
    named_hop = {token.strip().lower() for name, value in fields if name.lower() == "connection"
                 for token in value.split(",")} - {"content-length", "transfer-encoding"}
    kept = [(name, value) for name, value in fields
            if name.lower() not in _EGRESS_DROPPED_REQUEST | named_hop
            and not name.lower().startswith("proxy-")]
    authority_out = str(EgressEntry(host, port)) if port != 80 else (
        f"[{host}]" if ":" in host else host)
    lines = [f"{method} {path} {version}", f"host: {authority_out}",
             *(f"{name}: {value}" for name, value in kept), "connection: close", "", ""]
    return ProxyRequest(ProxyKind.FORWARD, host, port, "\r\n".join(lines).encode("ascii"),
                        None if chunked else int(lengths[0]) if lengths else 0)


class _BodyPart(enum.Enum):
    DATA = "data"  # `left` more bytes of the body, or of the chunk
    SIZE = "size"  # a chunk's size line
    CHUNK_END = "chunk end"  # the CRLF after a chunk's data
    TRAILER = "trailer"  # trailer lines, up to an empty one
    ENDED = "ended"  # the body is whole (or its framing broke): nothing more is taken


class ForwardedBody:
    """Pure: how much of what the sandbox sends after a forwarded request's head is that
    request's body, by its framing (content-length bytes; chunked up to the last chunk and its
    trailer): one request per connection, so what follows (a pipelined second request, which
    would reach the upstream unchecked) is not forwarded. A chunked framing that breaks (a bad
    size line, one over MAX_CHUNK_LINE_BYTES) ends the body where it broke."""

    def __init__(self, body_bytes: Optional[int]) -> None:
        self._chunked = body_bytes is None
        self._left = body_bytes or 0
        self._part = _BodyPart.SIZE if self._chunked else _BodyPart.DATA if self._left else _BodyPart.ENDED
        self._line = bytearray()

    def take(self, data: bytes | memoryview) -> int:
        """How many of data's first bytes belong to the body (the rest, if any, do not)."""
        taken = 0
        while taken < len(data) and self._part is not _BodyPart.ENDED:
            if self._part is _BodyPart.DATA:
                step = min(self._left, len(data) - taken)
                taken, self._left = taken + step, self._left - step
                if not self._left:
                    self._part = _BodyPart.CHUNK_END if self._chunked else _BodyPart.ENDED
                continue
            self._line.append(data[taken])
            taken += 1
            if len(self._line) > MAX_CHUNK_LINE_BYTES:
                self._part = _BodyPart.ENDED
            elif self._line.endswith(b"\r\n"):
                self._end_line(bytes(self._line[:-2]))
                self._line.clear()
        return taken

    def _end_line(self, line: bytes) -> None:
        if self._part is _BodyPart.SIZE:
            size = line.split(b";", 1)[0].strip(b" \t")
            if not size or len(size) > 16 or any(c not in b"0123456789abcdefABCDEF" for c in size):
                self._part = _BodyPart.ENDED
            elif int(size, 16):
                self._part, self._left = _BodyPart.DATA, int(size, 16)
            else:
                self._part = _BodyPart.TRAILER
        elif self._part is _BodyPart.CHUNK_END:
            self._part = _BodyPart.SIZE if not line else _BodyPart.ENDED
        elif not line:  # TRAILER: the empty line ends it
            self._part = _BodyPart.ENDED


def egress_refusal_response(status: int, reason: str) -> bytes:
    body = f"reploy egress proxy: {reason}\n".encode()
    phrase = http.client.responses.get(status, "Error")
    return (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


@dataclass(frozen=True)
class EgressNote:
    """What the session's events record of one proxy connection, at its close."""

    decision: agent_role.EgressDecision
    host: str
    port: int
    reason: str = ""  # why it was refused, or why the proxy closed an allowed one (idle)
    bytes_up: int = 0  # from the sandbox to the upstream
    bytes_down: int = 0
    count: int = 1  # more than 1: a window's refusals not noted one by one (SessionLog)


# -- the proxy's I/O: per-session sockets on the host, one thread per connection ------------

def read_proxy_head(conn: socket.socket, timeout_s: float) -> tuple[ProxyRequest, bytes]:
    """The head from the relay, bounded in size (431) and in time, the whole head within
    timeout_s (408: a client that trickles its bytes holds a connection no longer than one that
    sends none), and what came after it (the start of a body, or of a TLS handshake)."""
    deadline = time.monotonic() + timeout_s
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            if len(data) > MAX_EGRESS_HEAD_BYTES:
                raise EgressRefusal(431, f"the request head is over {MAX_EGRESS_HEAD_BYTES} bytes")
            remaining_s = deadline - time.monotonic()
            try:
                if remaining_s <= 0:
                    raise TimeoutError
                conn.settimeout(remaining_s)
                chunk = conn.recv(agent_role.RECV_BYTES)
            except TimeoutError:
                raise EgressRefusal(408, "the request head did not come whole within "
                                    f"{timeout_s:.3g} s") from None
            if not chunk:
                raise ConnectionError("the client left before its request head was whole")
            data += chunk
    finally:
        conn.settimeout(timeout_s)  # the proxy's answer gets a whole bound, not what is left
    head, _, rest = data.partition(b"\r\n\r\n")
    return parse_proxy_head(head), rest


def resolve(host: str, port: int) -> tuple[str, ...]:
    """Every address the name resolves to (once: the proxy connects to one of these)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return ()
    return tuple(dict.fromkeys(str(info[4][0]) for info in infos))


def resolve_within(resolver: Callable[[str, int], tuple[str, ...]], entry: EgressEntry,
                   timeout_s: float) -> tuple[str, ...]:
    """resolver's answer for the entry, or a 504 once timeout_s passed without one. The lookup
    runs in a thread of its own, which a resolver that hangs keeps until the system's resolver
    gives up; the connection does not wait for it."""
    answer: list[tuple[str, ...]] = []
    lookup = threading.Thread(target=lambda: answer.append(resolver(entry.host, entry.port)),
                              name="egress-resolve", daemon=True)
    lookup.start()
    lookup.join(timeout_s)
    if lookup.is_alive():
        raise EgressRefusal(504, f"{entry.host} did not resolve within {timeout_s:.3g} s")
    return answer[0] if answer else ()  # a resolver that failed: no address, refused as such


def connect_upstream(entry: EgressEntry, addresses: Sequence[str],
                     timeouts: EgressTimeouts) -> socket.socket:
    """The first of the checked addresses, tried in order, that connects within the connect
    bound, all of them within the overall one; when none does, unreached_refusal's 502/504."""
    deadline = time.monotonic() + timeouts.connect_total_s
    failures: list[ConnectFailure] = []
    for address in addresses:
        bound_s = min(timeouts.connect_s, deadline - time.monotonic())
        if bound_s <= 0:
            break
        try:
            return socket.create_connection((address, entry.port), bound_s)
        except TimeoutError:
            failures.append(ConnectFailure(address, bound_s))
        except OSError as e:
            failures.append(ConnectFailure(address, bound_s, e.strerror or type(e).__name__))
    raise unreached_refusal(entry, failures, len(addresses) - len(failures), timeouts.connect_total_s)


class EgressProxy:
    """The host side: DIR/agent/egress.sock of each session with egress (see the section's
    head). `note` records each connection's EgressNote in the session's events: each allowed
    one, and refused ones as the session's log of refusals has them (SessionLog: one by one,
    then a window's count in one note)."""

    def __init__(self, note: Callable[[str, EgressNote], None],
                 resolver: Callable[[str, int], tuple[str, ...]] = resolve,
                 timeouts: EgressTimeouts = EgressTimeouts(), log_window_s: float = LOG_WINDOW_S) -> None:
        self._note = note
        self._resolve = resolver
        self._timeouts = timeouts
        self._sockets = SessionSockets(agent_role.EGRESS_SOCKET_NAME, MAX_EGRESS_CONNECTIONS, "egress")
        self._refusals = SessionLog("egress refusal", self._note_refusals, log_window_s)
        self._log = SessionLog("egress", window_s=log_window_s)

    def listen(self, session_id: str, agent_dir: Path, allowed: tuple[EgressEntry, ...]) -> None:
        """(Re)binds agent_dir/egress.sock for the session, with its allow-list."""
        self._sockets.listen(session_id, agent_dir, functools.partial(self._serve, session_id,
                                                                      allowed=allowed))

    def close_session(self, session_id: str) -> None:
        """Stops listening (before the disk is unmounted); open pipes end on their own."""
        self._sockets.close_session(session_id)
        self._refusals.end_session(session_id)
        self._log.end_session(session_id)

    def close(self) -> None:
        self._sockets.close()
        self._refusals.close()
        self._log.close()

    def _serve(self, session_id: str, conn: socket.socket, slots: threading.BoundedSemaphore,
               allowed: tuple[EgressEntry, ...]) -> None:
        """One proxy request: read, decided, refused (403 and why) or piped; noted at close."""
        admitted = slots.acquire(blocking=False)
        request: Optional[ProxyRequest] = None
        try:
            with conn:
                try:
                    request, rest = read_proxy_head(conn, self._timeouts.head_s)
                    if not admitted:
                        raise EgressRefusal(429, f"this session has {MAX_EGRESS_CONNECTIONS} "
                                            "egress connections open")
                    entry = EgressEntry(request.host, request.port)
                    # Only a listed name is looked up: an unlisted one never reaches a resolver.
                    looked_up = entry in allowed and not entry.is_ip_literal
                    addresses = (resolve_within(self._resolve, entry, self._timeouts.resolve_s)
                                 if looked_up else ())
                    decision = decide_egress(allowed, entry.host, entry.port, addresses,
                                             host_addresses() if looked_up else frozenset())
                    if isinstance(decision, Refused):
                        raise EgressRefusal(403, decision.reason)
                    note = self._pipe(conn, request, decision.addresses, rest)
                except EgressRefusal as e:
                    note = EgressNote(agent_role.EgressDecision.REFUSED, request.host if request else "",
                                      request.port if request else 0, e.reason)
                    with contextlib.suppress(OSError):
                        conn.sendall(egress_refusal_response(e.status, e.reason))
                self._record(session_id, note)
        except OSError as e:
            self._log.line(session_id, f"egress connection ended: {e}")
        finally:
            if admitted:
                slots.release()

    def _pipe(self, conn: socket.socket, request: ProxyRequest, addresses: tuple[str, ...],
              rest: bytes) -> EgressNote:
        """Connects to one of the checked addresses (502/504 when none answers) and pipes both
        ways; a pipe idle past its bound is closed, and its note says so."""
        upstream = connect_upstream(EgressEntry(request.host, request.port), addresses, self._timeouts)
        body = ForwardedBody(request.body_bytes) if request.kind is ProxyKind.FORWARD else None
        with upstream:
            if body is None:
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                first = rest
            else:  # only this request's body goes on: one request per connection
                first = request.head + rest[:body.take(rest)]
            upstream.sendall(first)
            conn.settimeout(None)
            upstream.settimeout(None)
            spliced = agent_role.splice(conn, upstream, self._timeouts.idle_s,
                                        body.take if body is not None else None)
        idle = (f"closed after {self._timeouts.idle_s:.3g} s in which no byte moved either way"
                if spliced.idle else "")
        return EgressNote(agent_role.EgressDecision.ALLOWED, request.host, request.port, reason=idle,
                          bytes_up=len(first) + spliced.one_to_other, bytes_down=spliced.other_to_one)

    def _record(self, session_id: str, note: EgressNote) -> None:
        """Logs the connection's note and records it: an allowed one always (its bytes are the
        session's to account), a refused one when the log of refusals takes it one by one."""
        allowed = note.decision is agent_role.EgressDecision.ALLOWED
        counts = f" ({note.bytes_up} bytes up, {note.bytes_down} down)" if allowed else ""
        line = (f"egress {note.decision.value} {note.host}:{note.port}" + counts
                + (f": {note.reason}" if note.reason else ""))
        if (self._log if allowed else self._refusals).line(session_id, line) or allowed:
            self._note(session_id, note)

    def _note_refusals(self, summary: LogSummary) -> None:
        self._note(summary.session_id, EgressNote(
            agent_role.EgressDecision.REFUSED, "", 0, count=summary.count,
            reason=f"{summary.count} more connections refused in {summary.window_s:.3g} s, not "
                   f"noted one by one; the last: {summary.last}"))


# ============================================================================================
# the HTTP adapter (REST, SSE, the web UI's files)
# ============================================================================================

#: (method, path template under /api/v1, handler). web/openapi.json documents exactly these:
#: seed 002's routes first, then Reploy's own.
API_ROUTES: tuple[tuple[str, str, str], ...] = (
    ("GET", "/healthz", "healthz"),
    ("GET", "/config", "get_config"),
    ("POST", "/sessions", "create_session"),
    ("GET", "/sessions", "list_sessions"),
    ("GET", "/sessions/{id}", "get_session"),
    ("DELETE", "/sessions/{id}", "delete_session"),
    ("POST", "/sessions/{id}/read", "read"),
    ("POST", "/sessions/{id}/write", "write"),
    ("GET", "/sessions/{id}/stream", "stream"),
    ("POST", "/sessions/{id}/switch", "switch"),
    ("POST", "/sessions/{id}/snapshot", "snapshot"),
    ("GET", "/server", "get_server"),
    ("POST", "/sessions/{id}/message", "message"),
    ("POST", "/sessions/{id}/interrupt", "interrupt"),
    ("POST", "/sessions/{id}/relaunch", "relaunch"),
    ("POST", "/sessions/{id}/resize", "resize"),
    ("GET", "/sessions/{id}/status", "status"),
    ("POST", "/sessions/{id}/exec", "exec"),
    ("GET", "/sessions/{id}/list/{path}", "list_files"),
    ("GET", "/sessions/{id}/files/{path}", "get_file"),
    ("PUT", "/sessions/{id}/files/{path}", "put_file"),
)
#: The failure statuses seed 002's spec gives each of its routes, and create's two limits
#: (429 at --max-sessions, 507 when the host cannot hold another disk: see README). On these
#: routes every other failure is a 500, as the peer answers it (spec_statuses); Reploy's own
#: routes keep theirs.
#: The refusals before any route runs (401, 403, 415, 421: "who may drive serve"), an unknown
#: path or method (404, 405) and a body over the bound (413) are the same on every route.
SPEC_ERROR_STATUSES: dict[str, frozenset[int]] = {
    "healthz": frozenset(), "get_config": frozenset(), "list_sessions": frozenset({400}),
    "create_session": frozenset({400, 413, 429, 507}), "get_session": frozenset({404}),
    "delete_session": frozenset({404, 409}), "stream": frozenset({400, 404, 422, 503}),
    "read": frozenset({400, 404, 413}), "write": frozenset({400, 404, 413, 429, 507}),
    "switch": frozenset({400, 404, 409, 413}), "snapshot": frozenset({400, 404, 409, 413}),
}
#: Routes whose last part is a path in the session's workspace (or home), slashes included.
FILE_ROUTE_PARTS = ("files", "list")
STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8", ".json": "application/json",
                ".svg": "image/svg+xml", "": "text/plain; charset=utf-8"}
#: The UI's own files: scripts and styles from here only.
CONTENT_SECURITY_POLICY = ("default-src 'self'; style-src 'self' 'unsafe-inline'; "
                           "img-src 'self' data:; object-src 'none'; frame-ancestors 'none'")
#: Every other response (the API's JSON, downloads, the stream, every error): nothing may load
#: and, opened as a page, it runs in a sandbox with an origin of its own, so even bytes a
#: session chose can never act in this server's origin.
API_CONTENT_SECURITY_POLICY = "default-src 'none'; sandbox"
#: What a response header's name and value may hold (RFC 9110: a token; visible ASCII, spaces
#: and tabs).
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")


def match_route(method: str, path: str) -> tuple[str, Optional[str]]:
    """(handler name, session id) for an API path below /api/v1. Pure."""
    parts = path.strip("/").split("/")
    session_id = None
    if len(parts) >= 2 and parts[0] == "sessions":
        session_id, parts[1] = parts[1], "{id}"
        if not _SESSION_ID.fullmatch(session_id):
            raise SessionNotFound(f"no session {session_id}")
        if len(parts) >= 3 and parts[2] in FILE_ROUTE_PARTS:
            parts[3:] = ["{path}"]  # file_route_path() reads it
    template = "/" + "/".join(parts)
    handlers = {m: h for m, t, h in API_ROUTES if t == template}
    if not handlers:
        raise SessionNotFound(f"no such API path: {path}")
    if method not in handlers:
        raise MethodNotAllowed(f"{method} is not allowed here (allowed: {', '.join(handlers)})",
                               tuple(handlers))
    return handlers[method], session_id


def spec_statuses(handler: Callable[..., Any]) -> Callable[..., Any]:
    """An api_ method of one of seed 002's routes: a failure whose status the spec does not
    give the route (SPEC_ERROR_STATUSES) is answered 500, its message kept."""
    allowed = SPEC_ERROR_STATUSES[handler.__name__[len("api_"):]]

    @functools.wraps(handler)
    def answer(*args: Any) -> Any:
        try:
            return handler(*args)
        except ServeError as e:
            if e.status in allowed:
                raise
            raise ServeError(str(e)) from e
        except BackendError as e:
            raise ServeError(str(e)) from e
    return answer


def load_static(web_dir: Path) -> dict[str, tuple[str, bytes]]:
    """The web UI's files, read once: URL path -> (content type, bytes). Serving only what is
    in this map means no request path ever reaches the file system."""
    files: dict[str, tuple[str, bytes]] = {}
    if web_dir.is_dir():
        for path in sorted(web_dir.rglob("*")):
            if path.is_file() and not path.name.startswith("."):
                url = "/" + path.relative_to(web_dir).as_posix()
                files[url] = (STATIC_TYPES.get(path.suffix, "application/octet-stream"),
                              path.read_bytes())
    if "/index.html" in files:
        files["/"] = files["/index.html"]
    return files


class RequestThreads:
    """The threads that serve the HTTP connections, one a connection: a new connection goes to
    a thread that waits for one (its last connection ended) when there is one, else to a new
    thread. Starting a thread cost the accept loop more than anything else it does per
    connection, and a client on a new connection waited for it; a hand-over to a waiting thread
    is one lock's release. At most `spare` wait; the rest end with their connection."""

    def __init__(self, serve: Callable[[Any, Any], None], spare: int) -> None:
        self._serve = serve
        self._spare = spare
        self._lock = threading.Lock()
        self._waiting: list[_HandOver] = []
        self._closed = False

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def run(self, request: Any, address: Any) -> None:
        with self._lock:
            waiting = self._waiting.pop() if self._waiting else None
        if waiting is None:
            threading.Thread(target=self._work, args=(request, address), daemon=True,
                             name="request").start()
        else:
            waiting.give((request, address))

    def _work(self, request: Any, address: Any) -> None:
        while True:
            self._serve(request, address)
            hand_over = _HandOver()
            with self._lock:
                if self._closed or len(self._waiting) >= self._spare:
                    return
                self._waiting.append(hand_over)
            connection = hand_over.take()
            if connection is None:  # closed while it waited
                return
            request, address = connection

    def close(self) -> None:
        """The waiting threads end; a connection still served ends its thread with it."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = self._waiting, []
        for hand_over in waiting:
            hand_over.give(None)


class _HandOver:
    """One connection (or None: end) passed from the accept loop to one waiting thread."""

    def __init__(self) -> None:
        self._given = threading.Lock()
        self._given.acquire()
        self._connection: Optional[tuple[Any, Any]] = None

    def give(self, connection: Optional[tuple[Any, Any]]) -> None:
        self._connection = connection
        self._given.release()

    def take(self) -> Optional[tuple[Any, Any]]:
        self._given.acquire()
        return self._connection


class ServeHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple[str, int], manager: SessionManager,
                 static: dict[str, tuple[str, bytes]], token: str,
                 hosts: frozenset[str]) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        # Before the bind: a bind that fails closes the server, and closing ends these.
        self.request_threads = RequestThreads(self.process_request_thread, SPARE_REQUEST_THREADS)
        super().__init__(address, ApiHandler)
        self.manager = manager
        self.static = static
        self.policy = AccessPolicy(token, hosts)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.request_threads.run(request, client_address)

    def server_close(self) -> None:
        self.request_threads.close()
        super().server_close()


class ApiHandler(http.server.BaseHTTPRequestHandler):
    """Thin: decide access (decide_access, before anything else), parse, call the
    SessionManager, encode. Every failure is {"error": "...", "code": "..."}; no response ever
    carries a CORS header. `Expect: 100-continue` is answered only once access and the route
    are decided (send_continue), so a refused request never has its body sent."""

    server: ServeHTTPServer
    protocol_version = "HTTP/1.1"
    #: Each answer leaves in as few sends as it can, and none waits for the peer's ACK of the
    #: last (with Nagle, a kept-alive connection's answer stalled for the peer's delayed ACK).
    disable_nagle_algorithm = True
    server_version = "reploy"
    timeout = BODY_READ_TIMEOUT_S  # a client that stalls mid-request is dropped
    expecting_continue = False  # this request sent `Expect: 100-continue`, not yet answered

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # request lines would only repeat what the client knows; errors are logged

    def __getattr__(self, name: str) -> Callable[[], None]:
        """do_METHOD for every method, so each request meets decide_access first: GET, POST,
        PUT, DELETE, a CORS preflight (OPTIONS, refused like any foreign request) and also the
        ones no route takes (HEAD, TRACE...), which the stdlib would answer 501 before the Host
        check, and which end as 404 or 405 here."""
        if not name.startswith("do_"):
            raise AttributeError(name)
        return lambda: self.dispatch(name[len("do_"):])

    def send_error(self, code: int, message: Optional[str] = None,
                   explain: Optional[str] = None) -> None:
        """The stdlib's own refusals (a request line or headers it cannot parse, before any
        check can run) in the API's shape, on a connection that then closes."""
        self.close_connection = True
        self.send_json(code, {"error": message or http.HTTPStatus(code).phrase,
                              "code": PayloadTooLarge.code if code in (413, 414, 431)
                              else BadRequest.code},
                       {"Connection": "close"})

    def handle_expect_100(self) -> bool:
        """The stdlib would send 100 Continue at once, before any check: deferred instead to
        the moment the body is about to be read (send_continue)."""
        self.expecting_continue = True
        return True

    def send_continue(self) -> None:
        """The interim 100 Continue a client that sent `Expect: 100-continue` waits for, once
        access and the route are decided and the body is about to be read."""
        if self.expecting_continue:
            self.expecting_continue = False
            self.wfile.write(b"%s 100 Continue\r\n\r\n" % self.protocol_version.encode("ascii"))
            self.wfile.flush()

    def send_response(self, code: int, message: Optional[str] = None) -> None:
        if self.expecting_continue:
            self.close_connection = True  # refused before its body was asked for: never read
        self.header_names: set[str] = set()
        super().send_response(code, message)

    def send_header(self, keyword: str, value: str) -> None:
        """The one place every response header passes: a name or value that would not be one
        header line (a CR or LF ends it early, and what follows writes headers or a body of its
        own) drops the response begun so far, unsent, and raises UnsafeHeader."""
        if not _HEADER_NAME.fullmatch(keyword) or not _HEADER_VALUE.fullmatch(str(value)):
            self._headers_buffer: list[bytes] = []
            raise UnsafeHeader(f"a response header {keyword[:40]!r} would hold a control "
                               "character; nothing of that response was sent")
        self.header_names.add(keyword.lower())
        super().send_header(keyword, value)

    def end_headers(self, body: bytes = b"") -> None:
        """Every response: no Referer leaves the UI, nothing is sniffed into another type, and
        anything but the UI's own files (which name their policy) can never run as a page.
        A `body` known by now leaves with the headers, in one send."""
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("X-Content-Type-Options", "nosniff")
        if "content-security-policy" not in self.header_names:
            self.send_header("Content-Security-Policy", API_CONTENT_SECURITY_POLICY)
        if self.request_version == "HTTP/0.9":  # which gets no headers (the stdlib's rule)
            self.wfile.write(body)
            return
        self._headers_buffer.extend((b"\r\n", body))
        self.flush_headers()

    @property
    def manager(self) -> SessionManager:
        return self.server.manager

    def dispatch(self, method: str) -> None:
        path, _, query = self.path.partition("?")
        try:
            try:
                decide_access(method, self.path, self.headers.items(), self.server.policy)
            except ServeError:
                self.close_connection = True  # its body, if any, is never read
                raise
            if path == API_PREFIX + "/openapi.json" or not is_api_path(path):
                self.read_body()
                self.serve_static(method, path)
                return
            handler, session_id = match_route(method, path[len(API_PREFIX):])
            # A raw body is streamed by its handler; every other body is read whole (bounded).
            body = b"" if handler in RAW_BODY_ROUTES else self.read_body()
            result = getattr(self, "api_" + handler)(session_id, body, query)
            if result is not None:
                self.send_json(*result)
        except ServeError as e:
            self.send_json(e.status, {"error": str(e), "code": e.code}, e.response_headers())
        except BackendError as e:
            self.send_json(503, {"error": str(e), "code": ServiceUnavailable.code})
        except (BrokenPipeError, ConnectionResetError, socket.timeout, ClientGone):
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - a bug answers 500 and keeps the server up
            log(f"serve: internal error on {method} {path}: {e!r}")
            self.send_json(500, {"error": "internal error", "code": ServeError.code})

    def body_length(self, max_bytes: int) -> int:
        """The body's Content-Length (0 when absent), refused before any byte is read when it
        is chunked, not a number or over max_bytes."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise BadRequest("chunked bodies are not accepted; send Content-Length")
        text = self.headers.get("Content-Length", "0")
        if not text.isdigit():
            self.close_connection = True
            raise BadRequest("Content-Length is not a number")
        length = int(text)
        if length > max_bytes:
            self.close_connection = True
            raise PayloadTooLarge(f"the body exceeds {max_bytes} bytes")
        if length:
            self.send_continue()
        return length

    def read_body(self) -> bytes:
        length = self.body_length(MAX_BODY_BYTES)
        return self.rfile.read(length) if length else b""

    def send_json(self, status: int, document: dict[str, Any],
                  headers: Optional[dict[str, str]] = None) -> None:
        self.send_json_bytes(status, wire.encode_compact(document), headers)

    def send_json_bytes(self, status: int, data: bytes,
                        headers: Optional[dict[str, str]] = None) -> None:
        """A JSON answer already encoded, with its length, in one send."""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers(data if self.command != "HEAD" else b"")  # a HEAD answer: headers alone

    def send_unsized_headers(self) -> bool:
        """The framing header of a body whose length is not known up front, then the end of the
        headers: chunked on HTTP/1.1 (a body that ends without its last chunk is then visibly
        incomplete to the client), else ended by closing the connection. True when chunked;
        write the body with write_piece and end it with end_pieces."""
        chunked = self.request_version == "HTTP/1.1"
        self.send_header("Transfer-Encoding" if chunked else "Connection",
                         "chunked" if chunked else "close")
        self.end_headers()
        self.close_connection = self.close_connection or not chunked
        return chunked

    def write_piece(self, data: bytes, chunked: bool) -> None:
        if data:
            self.wfile.write(http_chunk(data, chunked))

    def end_pieces(self, chunked: bool) -> None:
        if chunked:
            self.wfile.write(b"0\r\n\r\n")

    def send_json_pieces(self, status: int, pieces: Iterator[bytes], what: str = "an answer") -> None:
        """A JSON answer sent piece by piece as it is encoded. A failure before the first
        piece is an error answer; past it, the headers are out and the body ends short
        (chunked: without its last chunk, which any HTTP client reports as incomplete)."""
        try:
            first = next(pieces, b"")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Cache-Control", "no-store")
            chunked = self.send_unsized_headers()
            try:
                self.write_piece(first, chunked)
                for piece in pieces:
                    self.write_piece(piece, chunked)
                self.end_pieces(chunked)
            except (ReployError, OSError) as e:
                log(f"serve: {what} ended early: {e}")
                self.close_connection = True
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                close()  # a generator's own cleanup runs now, not when it is collected

    def send_lines(self, lines: Generator[bytes, None, None], what: str) -> None:
        """An NDJSON answer (application/x-ndjson), each line sent as it comes. What fails
        before the first (which may be b"") is an ordinary error answer; past it, serve's error
        is one last line `{"error", "code"}` and the body still ends whole. A client that went
        away gets nothing more, and the generator is closed: its own cleanup runs now."""
        try:
            first = next(lines)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.send_header("Cache-Control", "no-store")
            chunked = self.send_unsized_headers()
            try:
                self.write_piece(first, chunked)
                try:
                    for line in lines:
                        self.write_piece(line, chunked)
                except ServeError as e:
                    self.write_piece(exec_stream_line({"error": str(e), "code": e.code}), chunked)
                self.end_pieces(chunked)
            except (ReployError, OSError) as e:
                log(f"serve: {what} ended early: {e}")
                self.close_connection = True
        finally:
            lines.close()

    def serve_static(self, method: str, path: str) -> None:
        if path == "/api/v1/openapi.json":
            path = "/openapi.json"
        entry = self.server.static.get(path)
        if entry is None or method != "GET":
            self.send_json(404, {"error": f"not found: {path}", "code": PathNotFound.code})
            return
        content_type, data = entry
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        self.end_headers(data)

    # -- API handlers: (session id, raw body, query) -> (status, document) -----------------

    # seed 002's routes (spec_statuses: only the spec's failure statuses, else 500)

    @spec_statuses
    def api_healthz(self, _sid: None, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        return 200, {"status": "ok"}

    @spec_statuses
    def api_get_config(self, _sid: None, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        config = self.manager.config
        return 200, {"claudeCode": {"defaultModel": config.default_model or PLATFORM_DEFAULT_MODEL,
                                    "models": list(config.models)}}

    @spec_statuses
    def api_create_session(self, _sid: None, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        if not body.strip():
            raise BadRequest("a create needs a body: {\"name\": ...}")
        request = CreateRequest.from_fields(parse_body(body, BODY_RULES["create"]))
        return 201, self.manager.session_json(self.manager.create(request))

    @spec_statuses
    def api_list_sessions(self, _sid: None, body: bytes, query: str) -> tuple[int, dict[str, Any]]:
        wanted = label_filter(query)
        return 200, {"sessions": [self.manager.session_json(r) for r in self.manager.shown_records()
                                  if has_labels(r, wanted)]}

    @spec_statuses
    def api_get_session(self, sid: str, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        return 200, self.manager.session_json(self.manager.shown_record(sid))

    @spec_statuses
    def api_delete_session(self, sid: str, body: bytes, _query: str) -> None:
        """204 and no body (seed 002)."""
        self.manager.shown_record(sid)
        self.manager.delete(sid)
        self.send_response(204)
        self.send_header("Cache-Control", "no-store")
        self.end_headers()

    @spec_statuses
    def api_switch(self, sid: str, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        parse_body(body, BODY_RULES["empty"])
        return 200, self.manager.session_json(self.manager.switch(sid))

    @spec_statuses
    def api_snapshot(self, sid: str, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        parse_body(body, BODY_RULES["empty"])
        self.manager.shown_record(sid)
        return 200, self.manager.session_json(self.manager.snapshot(sid))

    @spec_statuses
    def api_read(self, sid: str, body: bytes, _query: str) -> None:
        """Seed 002's ReadResult, plus payloadBase64: the same bytes exactly (read_result_json),
        sent as it is encoded."""
        fields = parse_body(body, BODY_RULES["read"])
        offset = fields.get("offset", 0)
        record, branch, data, end = self.manager.read(sid, offset, fields.get("waitMs", 0))
        kept = text_cut(data)
        head = {"session": self.manager.session_json(record), "path": access_path(branch, "read"),
                "nextOffset": offset + kept if data else end}
        self.send_json_pieces(200, read_result_json(head, memoryview(data)[:kept]))

    @spec_statuses
    def api_write(self, sid: str, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        fields = parse_body(body, BODY_RULES["write"])
        record, branch = self.manager.write(sid, fields.get("payload", ""))
        return 200, {"session": self.manager.session_json(record),
                     "path": access_path(branch, "write")}

    # Reploy's own routes

    def api_get_server(self, _sid: None, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        """What the UI needs besides seed 002's /config (which holds nothing else)."""
        config = self.manager.config
        return 200, {"workloadTypes": list(WORKLOAD_TYPES),
                     "deployments": self.manager.deployment_names(),
                     "idleAfterSeconds": config.idle_after_s,
                     "snapshotAfterSeconds": config.snapshot_after_s,
                     "maxBusySeconds": config.max_busy_s,
                     "egressAllow": list(map(str, config.egress_allow)),
                     "limits": {"maxBodyBytes": MAX_BODY_BYTES, "maxPromptBytes": MAX_PAYLOAD_BYTES,
                                "sessionDiskBytes": config.session_disk_mib * 1024 * 1024},
                     "outputFollowing": self.manager.agent_wait_stats()}

    def api_message(self, sid: str, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        fields = parse_body(body, BODY_RULES["message"])
        if len(fields["text"].encode()) > MAX_PAYLOAD_BYTES:  # parse_body refused lone surrogates
            raise PayloadTooLarge(f"text: more than {MAX_PAYLOAD_BYTES} bytes")
        return 200, _camel_keys(self.manager.message(sid, fields["text"]))

    def api_interrupt(self, sid: str, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        parse_body(body, BODY_RULES["empty"])
        return 200, _camel_keys(self.manager.call(sid, "interrupt", {}))

    def api_relaunch(self, sid: str, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        parse_body(body, BODY_RULES["empty"])
        return 200, _camel_keys(self.manager.call(sid, "relaunch", {}))

    def api_resize(self, sid: str, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        fields = parse_body(body, BODY_RULES["resize"])
        return 200, _camel_keys(self.manager.call(sid, "resize", fields, workloads=("shell",)))

    def api_status(self, sid: str, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        return 200, self.manager.status(sid)

    @property
    def api_path(self) -> str:
        return self.path.partition("?")[0][len(API_PREFIX):]

    def client_gone(self) -> bool:
        """True once the client closed its side: its socket reads as end of file."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def api_exec(self, sid: str, body: bytes, _query: str) -> Optional[tuple[int, dict[str, Any]]]:
        """A detached exec's answer, or an ended one's, sent as it is read from the agent; with
        `stream`, the output as it comes (send_lines)."""
        fields = parse_body(body, BODY_RULES["exec"])
        params = exec_params(fields)
        if fields.get("stream"):
            self.send_lines(self.manager.exec_stream(sid, params, self.client_gone),
                            f"the exec stream of session {sid}")
            return None
        ended = self.manager.exec(sid, params, self.client_gone)
        if isinstance(ended, dict):
            return 200, ended
        pieces = self.manager.exec_answer(sid, ended, self.client_gone)
        if ended.held is not None:  # a small output, serve's already: one body of known length
            self.send_json_bytes(200, b"".join(pieces))
        else:
            self.send_json_pieces(200, pieces, f"the exec answer of session {sid}")
        return None

    def api_list_files(self, sid: str, body: bytes, query: str) -> tuple[int, dict[str, Any]]:
        parse_body(body, BODY_RULES["empty"])
        asked = file_query(query, file_route_path(self.api_path)).for_reading()
        return 200, self.manager.list_files(sid, asked.root, asked.path, self.client_gone)

    def api_put_file(self, sid: str, _body: bytes, query: str) -> tuple[int, dict[str, Any]]:
        """Raw bytes streamed in: application/octet-stream makes one file, application/x-tar is
        extracted into the directory at the path (made if missing, merged if not)."""
        asked = file_query(query, file_route_path(self.api_path))
        content_type = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if content_type not in RAW_BODY_ROUTES["put_file"]:
            self.close_connection = True
            raise UnsupportedMediaType(f"Content-Type must be one of "
                                       f"{', '.join(RAW_BODY_ROUTES['put_file'])}")
        size_bytes = self.body_length(MAX_UPLOAD_BYTES)
        kind = "tar" if content_type == "application/x-tar" else "file"
        try:
            result = self.manager.upload(sid, asked, kind, size_bytes, self.rfile,
                                         self.client_gone)
        except BaseException:
            self.close_connection = True  # the rest of the body may still be on its way
            raise
        return 201, result

    def api_get_file(self, sid: str, body: bytes, query: str) -> None:
        """A file's bytes, or a directory as a tar (its entries relative to it), streamed."""
        parse_body(body, BODY_RULES["empty"])
        asked = file_query(query, file_route_path(self.api_path)).for_reading()
        root, path = asked.root, asked.path
        opened, fd = self.manager.download(sid, root, path)
        name = path.rstrip("/").rpartition("/")[2] or root
        if opened["kind"] == "tar":  # the pieces own the pipe: read, then closed
            self.send_tar(sid, name, self.manager.tar_pieces(sid, opened["transfer_id"], fd,
                                                             self.client_gone))
            return
        try:
            self.send_file(name, opened["size"], fd)
        finally:
            os.close(fd)

    def send_download_headers(self, name: str, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Disposition",
                         f"attachment; filename*=UTF-8''{urllib.parse.quote(name)}")
        self.send_header("Cache-Control", "no-store")

    def send_file(self, name: str, size_bytes: int, fd: int) -> None:
        """A file's bytes from the descriptor the agent's worker opened, by sendfile: exactly
        the size announced (Content-Length), or a body that ends short when the file shrank."""
        self.send_download_headers(name, "application/octet-stream")
        self.send_header("Content-Length", str(size_bytes))
        self.end_headers()  # adds nosniff and the sandbox, as on every answer
        try:
            with os.fdopen(os.dup(fd), "rb", buffering=0) as source:
                sent = self.connection.sendfile(source, 0, size_bytes) if size_bytes else 0
        except OSError as e:
            sent, reason = -1, str(e)
        else:
            reason = f"the file ended after {sent} of its {size_bytes} bytes"
        if sent != size_bytes:
            log(f"serve: download of {name!r} ended early: {reason}")
            self.close_connection = True

    def send_tar(self, sid: str, name: str, pieces: Generator[bytes, None, None]) -> None:
        """A directory's tar, made while it is sent: a failure past the first piece (the
        session's disk filling up, say) can only end it short: chunked, it ends without its last
        chunk, which any HTTP client reports as an incomplete transfer."""
        try:
            first = next(pieces, b"")  # before the headers: a tar refused at once is still an error
            self.send_download_headers(f"{name}.tar", "application/x-tar")
            chunked = self.send_unsized_headers()
            try:
                self.write_piece(first, chunked)
                for piece in pieces:
                    self.write_piece(piece, chunked)
                self.end_pieces(chunked)
            except (ReployError, OSError) as e:  # the headers are out: end the body short instead
                log(f"serve: download of {name!r} from session {sid} ended early: {e}")
                self.close_connection = True
        finally:
            pieces.close()  # the agent's job is stopped now, not when this is collected

    @spec_statuses
    def api_stream(self, sid: str, body: bytes, query: str) -> None:
        """Seed 002's stream: the cursor is checked first (400), then the session (404), which
        must have a container (422). The body is chunked (HTTP/1.1) and ends with the stream."""
        params = urllib.parse.parse_qs(query)
        cursor = sse_cursor(self.headers.get("Last-Event-ID"),
                            params["offset"][-1] if params.get("offset") else None)
        record = self.manager.shown_record(sid)
        if not has_container(record):
            raise Unprocessable("the session is a snapshot and has no container to stream from: "
                                "read, write or switch restores it")
        with self.manager.stream_reader(record.id):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache, no-transform")
            self.send_header("X-Accel-Buffering", "no")
            chunked = self.send_unsized_headers()
            self.close_connection = True
            # A reader that cannot keep up is dropped, never buffered: what it has not taken
            # waits only in this bounded send buffer, and a write it blocks for SSE_STALL_S ends it.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SSE_SEND_BUFFER_BYTES)
            self.connection.settimeout(SSE_STALL_S)

            stream = OutputStream(self.connection, functools.partial(http_chunk, chunked=chunked))

            def connected() -> bool:  # a client that went away shows as readable at end of file
                readable, _, _ = select.select([self.connection], [], [], 0)
                return not readable or self.connection.recv(1, socket.MSG_PEEK) != b""

            try:
                stream.send(SSE_CONNECTED)
                self.manager.follow_output(record, cursor, stream, connected)
                self.end_pieces(chunked)
            except (socket.timeout, ReaderDropped):
                log(f"serve: dropped a reader of session {sid}'s output stream: it took nothing "
                    f"for {SSE_STALL_S:.0f} s")


# ============================================================================================
# `reploy serve` and the `reploy session` client
# ============================================================================================


@dataclass(frozen=True)
class ServeAccess:
    """Where `serve` listens and who may reach it, checked once ("who may drive serve")."""

    host: str  # an IP address, or localhost
    port: int
    allow_hosts: tuple[str, ...]
    token_file: Path
    model_credential_file: Optional[Path] = None  # --model-credential-file, read at the start


_HOST_NAME = re.compile(r"(?=.{1,253}\Z)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
                        r"(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")


def serve_access_from(args: argparse.Namespace) -> ServeAccess:
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"--listen: {args.listen!r} is not HOST:PORT")
    host = host.strip("[]")
    if host != "localhost":
        try:
            host = str(ipaddress.ip_address(host))
        except ValueError:
            raise UsageError(f"--listen: {host!r} is not an IP address or localhost") from None
    if not is_loopback_listen(host) and not args.allow_remote:
        raise UsageError(f"--listen {args.listen} reaches beyond this machine: add --allow-remote "
                         "(and serve it behind a TLS reverse proxy; see the README)")
    names = []
    for text in args.allow_host:
        try:
            name = str(ipaddress.ip_address(text.strip("[]")))
        except ValueError:
            name = text.lower()
            if not _HOST_NAME.fullmatch(name):
                raise UsageError(f"--allow-host: {text!r} is not a host name or IP address "
                                 "(no port, no wildcard)") from None
        names.append(name)
    token_file = args.token_file or args.state_dir / TOKEN_FILE_NAME
    credential = args.model_credential_file
    return ServeAccess(host, int(port), tuple(names), token_file.absolute(),
                       credential.absolute() if credential else None)


#: The one reader of token files (regular files only, opened O_NONBLOCK then fstat-checked).
read_token = client_role.read_token


def load_or_create_token(path: Path) -> str:
    """STATE_DIR/token (or --token-file): made at the first start from TOKEN_BYTES random
    bytes, mode 0600, and reused after. Servers starting together agree: the file is written
    aside and linked into place, and only the first link wins."""
    if not os.path.lexists(path):
        aside = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise CredentialError(f"cannot make the token file {path}: {e.strerror}") from None
        try:
            with os.fdopen(fd, "w") as file:
                file.write(secrets.token_urlsafe(TOKEN_BYTES) + "\n")
                file.flush()
                os.fsync(file.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)
        finally:
            aside.unlink(missing_ok=True)
    return read_token(path, must_own=True)


def machine_names() -> list[str]:
    """This machine's host name and interface addresses: what a listen beyond loopback
    answers for, besides --allow-host."""
    names = [socket.gethostname()]
    for addresses in psutil.net_if_addrs().values():
        names += [address.address.partition("%")[0] for address in addresses
                  if address.family in (socket.AF_INET, socket.AF_INET6)]
    return names


def serve_config_from(args: argparse.Namespace) -> ServeConfig:  # noqa: C901 (a check per option)
    durations = {}
    for flag in ("idle_after", "snapshot_after", "max_busy", "sse_keepalive"):
        try:
            durations[flag] = parse_duration_ms(getattr(args, flag)) / 1000
        except ValueError as e:
            raise UsageError(f"--{flag.replace('_', '-')}: {e}") from None
        if durations[flag] < 0.1:
            raise UsageError(f"--{flag.replace('_', '-')}: at least 100ms")
    if durations["max_busy"] < durations["idle_after"]:
        raise UsageError("--max-busy: at least --idle-after")
    command = None
    if args.agent_command is not None:
        try:
            command = json.loads(args.agent_command)
        except ValueError as e:
            raise UsageError(f"--agent-command: not JSON: {e}") from None
        if not (isinstance(command, list) and command and all(isinstance(a, str) for a in command)
                and command.count("{prompt}") == 1):
            raise UsageError('--agent-command: a JSON array of strings with "{prompt}" once')
        command = tuple(command)
    for name in args.agent_env:
        if not _ENV_NAME.fullmatch(name):
            raise UsageError(f"--agent-env: {name!r} is not a variable name")
        if name not in os.environ:
            raise UsageError(f"--agent-env: {name} is not set in this environment")
    mounts = []
    for text in args.mount:
        host, _, target = text.partition(":")
        if not Path(host).exists() or not target.startswith("/") or target.rstrip("/") in (
                "", SESSION_MOUNT, CONTAINER_HOME) or target.startswith("/opt/reploy"):
            raise UsageError(f"--mount: {text!r} must be EXISTING_HOST_PATH:/container/path")
        mounts.append(Mount(str(Path(host).resolve()), target, read_only=True))
    models: tuple[str, ...] = ()
    try:
        if args.models:  # seed 002: missing, empty or [] keeps the free-text model field
            catalog = json.loads(args.models)
            if not isinstance(catalog, list):
                raise BadRequest("a JSON array of model names")
            for model in catalog:
                check_field("an entry", model, MODEL_RULE)
            if len(set(catalog)) != len(catalog):
                raise BadRequest("duplicate entries")
            models = tuple(catalog)
    except (ValueError, ServeError) as e:
        raise UsageError(f"--models: {e}") from None
    if args.default_model is not None:
        try:
            check_field("--default-model", args.default_model, MODEL_RULE)
        except ServeError as e:
            raise UsageError(str(e)) from None
    if not MIN_SESSION_DISK_MIB <= args.session_disk_mib <= MAX_SESSION_DISK_MIB:
        raise UsageError(f"--session-disk-mib: from {MIN_SESSION_DISK_MIB} to {MAX_SESSION_DISK_MIB}")
    session_cpus = args.session_cpus
    host_cpus = os.cpu_count() or 1
    if not MIN_SESSION_CPUS <= session_cpus <= host_cpus:  # NaN fails too
        raise UsageError(f"--session-cpus: from {MIN_SESSION_CPUS} to {host_cpus} (this host's cores)")
    for flag in ("max_session_readers", "max_readers"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')}: at least 1")
    state_dir = args.state_dir.absolute()
    if (args.model_upstream is None) != (args.model_credential_file is None):
        raise UsageError("--model-upstream and --model-credential-file go together")
    if args.model_upstream is None and args.model_upstream_ca is not None:
        raise UsageError("--model-upstream-ca needs --model-upstream")
    model_upstream = (None if args.model_upstream is None else
                      parse_model_upstream(args.model_upstream, args.model_upstream_ca,
                                           args.model_auth))
    return ServeConfig(
        state_dir=state_dir, workload_dirs=tuple(d.absolute() for d in args.workload_dir),
        idle_after_s=durations["idle_after"], snapshot_after_s=durations["snapshot_after"],
        max_busy_s=durations["max_busy"],
        agent_command=command, agent_env=tuple(args.agent_env), extra_mounts=tuple(mounts),
        default_model=args.default_model, models=models,
        sse_keepalive_s=durations["sse_keepalive"], max_sessions=args.max_sessions,
        min_free_bytes=args.min_free_mib * 1024 * 1024, session_disk_mib=args.session_disk_mib,
        session_cpus=session_cpus, max_session_readers=args.max_session_readers,
        max_readers=args.max_readers, model_upstream=model_upstream,
        egress_allow=parse_egress_allow(args.egress_allow))


def run_serve(config: ServeConfig, access: ServeAccess) -> int:
    """`reploy serve`: API and UI on one port until SIGTERM or SIGINT. Sessions outlive it.
    The start line carries the token and the browser's login_url; stderr never does."""
    try:
        prepare_state_dir(config.state_dir)  # before the token is written into it
        token = load_or_create_token(access.token_file)
        hosts = allowed_hosts(access.host, () if is_loopback_listen(access.host)
                              else machine_names(), access.allow_hosts)
        backend = DockerBackend()
        backend.require_sandbox_support()
        manager = SessionManager(config, backend)
        manager.require_built_deployments()
        config = manager.config  # its state dir canonical
        if config.model_upstream is not None:
            assert access.model_credential_file is not None  # serve_config_from checked
            manager.model_proxy = ModelProxy(config.model_upstream,
                                             read_model_credential(access.model_credential_file))
        probe_session_disks(config.disks_dir)
        manager.mount_disks()
        manager.reconcile()
        try:
            server = ServeHTTPServer((access.host, access.port), manager, load_static(WEB_DIR),
                                     token, hosts)
        except OSError as e:
            raise ReployError(f"cannot listen on {access.host}:{access.port}: "
                              f"{e.strerror or e}") from None
    except (ReployError, client_role.ReployError, OSError) as e:
        print(f"reploy: serve: {e}", file=sys.stderr)
        emit({"schema": SERVE_SCHEMA, "ok": False, "error": str(e)})
        return EXIT_FAILED
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    bound_host, bound_port = server.server_address[:2]
    bound_host = str(bound_host)
    bound_host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(bound_host, bound_host)  # wildcards
    authority = f"[{bound_host}]" if ":" in bound_host else bound_host
    url = f"http://{authority}:{bound_port}"
    emit({"schema": SERVE_SCHEMA, "ok": True, "error": None, "url": url,
          "login_url": f"{url}{LOGIN_FRAGMENT}{urllib.parse.quote(token, safe='')}",
          "token": token, "token_file": str(access.token_file),
          "state_dir": str(config.state_dir), "pid": os.getpid()})
    log(f"serving the API and UI on {url}; browsers log in through login_url (stdout), "
        f"programs send Authorization: Bearer with the token in {access.token_file}")
    threads = [threading.Thread(target=server.serve_forever, name="http", daemon=True),
               threading.Thread(target=manager.run_reaper, name="reaper", daemon=True)]
    for thread in threads:
        thread.start()
    while not stop.wait(1.0):
        pass
    manager.stopping.set()
    server.shutdown()
    server.server_close()
    threads[1].join(timeout=AGENT_CALL_TIMEOUT_S + 5)
    manager.close()
    return EXIT_OK


#: What the answer of each `reploy session` action holds at least (web/openapi.json), in one of
#: its shapes: an answer without it came from something else than serve.
SESSION_ANSWER_KEYS: dict[str, tuple[tuple[str, ...], ...]] = {
    **{action: (("id", "state"),) for action in ("create", "get", "switch", "snapshot")},
    "list": (("sessions",),), "delete": (("id", "deleted"),), "status": (("session", "agent"),),
    "read": (("session", "nextOffset", "payload"),), "write": (("session", "path"),),
    "message": (("delivery", "queueDepth"),), "interrupt": (("cancelled",),), "relaunch": (("pid",),),
    "exec": (("exitCode", "signal", "timedOut", "stdoutEncoding", "stderrEncoding"),
             ("execId", "detached", "pid")),
}
ID_HELP = "the session: its id, its unique name or a unique prefix of its id"
#: The verbs whose ID argument may also be a unique session name or id prefix (resolve_session).
SESSION_ID_ACTIONS = ("get", "status", "interrupt", "relaunch", "switch", "snapshot", "delete",
                      "read", "write", "message", "exec", "shell")


def client_request(args: argparse.Namespace) -> tuple[str, str, Optional[dict[str, Any]]]:
    """(method, path under /api/v1, body) for one `reploy session` action. Pure."""
    action, sid = args.session_action, getattr(args, "id", None)
    if action == "create":
        body: dict[str, Any] = {"name": args.name}
        for key, value in (("workloadType", args.workload_type), ("model", args.model),
                           ("deployment", args.deployment), ("ttlSeconds", ttl_seconds_argument(args.ttl)),
                           ("cpus", args.cpus), ("diskMib", args.disk_mib)):
            if value is not None:
                body[key] = value
        if args.label:
            body["labels"] = dict(label_argument(text) for text in args.label)
        if args.egress:
            body["egress"] = list(args.egress)
        return "POST", "/sessions", body
    if action == "list":
        query = urllib.parse.urlencode([("label", "=".join(label_argument(text))) for text in args.label])
        return "GET", "/sessions" + (f"?{query}" if query else ""), None
    if action in ("get", "delete"):
        return ("GET" if action == "get" else "DELETE"), f"/sessions/{sid}", None
    if action == "status":
        return "GET", f"/sessions/{sid}/status", None
    if action == "read":
        body = {"offset": args.offset, **({"waitMs": args.wait_ms} if args.wait_ms else {})}
        return "POST", f"/sessions/{sid}/read", body
    if action == "write":
        return "POST", f"/sessions/{sid}/write", {"payload": text_argument(args.data, "write", False)}
    if action == "message":
        return "POST", f"/sessions/{sid}/message", {"text": text_argument(args.text, "message", True)}
    if action == "exec":
        return "POST", f"/sessions/{sid}/exec", args.exec_body
    return "POST", f"/sessions/{sid}/{action}", {}


def ttl_seconds_argument(text: Optional[str]) -> Optional[int]:
    """`session create --ttl DURATION` as the API's ttlSeconds (whole seconds, at least 1)."""
    if text is None:
        return None
    try:
        ms = parse_duration_ms(text)
    except ValueError as e:
        raise UsageError(f"--ttl: {e}") from None
    if ms < 1000 or ms % 1000:
        raise UsageError(f"--ttl: {text!r} is not a whole number of seconds, at least 1s")
    return ms // 1000


def match_session(reference: str, sessions: Sequence[tuple[str, str]]) -> str:
    """The session id a `reploy session` argument names, given (id, name) of every session:
    an id as it is; else the one session of that name; else the one whose id starts with it.
    Pure. A ReployError (exit 1) when none or several match."""
    if _SESSION_ID.fullmatch(reference):
        return reference
    named = [sid for sid, name in sessions if name == reference]
    prefixed = ([sid for sid, _ in sessions if sid.startswith(reference)]
                if re.fullmatch(r"[0-9a-f]{1,15}", reference) else [])
    for found, what in ((named, "sessions are named"), (prefixed, "session ids start with")):
        if len(found) == 1:
            return found[0]
        if found:
            raise client_role.ReployError(None, "ambiguous", f"{len(found)} {what} "
                                          f"'{client_role.shown(reference, 80)}' ({', '.join(found[:4])}"
                                          f"{', ...' if len(found) > 4 else ''}): give an id")
    raise client_role.ReployFileNotFoundError(None, "not_found", "no session has the id, the name "
                                              f"or an id starting with '{client_role.shown(reference, 80)}'")


def resolve_session(client: client_role.Client, reference: str) -> str:
    """match_session against the server's sessions (listed only when `reference` is no id)."""
    if _SESSION_ID.fullmatch(reference):
        return reference
    listed = client.sessions()
    return match_session(reference, [(str(s.get("id")), str(s.get("name"))) for s in listed
                                     if isinstance(s, dict)])


#: `session list`'s table on a terminal: (heading, the session's field, width).
LIST_COLUMNS = (("ID", "id", 16), ("NAME", "name", 24), ("TYPE", "workloadType", 11),
                ("STATE", "state", 8), ("CPUS", "cpus", 4), ("DISK", "diskMib", 7),
                ("LABELS", "labels", 0))


def session_table(sessions: Sequence[Any]) -> str:
    """`session list` for a person: one row a session, every value made showable (a name or
    label is the user's text, never a terminal control). Pure."""
    def cell(session: dict[str, Any], key: str) -> str:
        value = session.get(key)
        if key == "labels" and isinstance(value, dict):
            value = ",".join(f"{k}={v}" for k, v in sorted(value.items()))
        elif key == "diskMib" and isinstance(value, int):
            value = f"{value}M"
        return client_role.shown("" if value is None else str(value), 200)

    rows = [[heading for heading, _, _ in LIST_COLUMNS]]
    rows += [[cell(s, key) for _, key, _ in LIST_COLUMNS] for s in sessions if isinstance(s, dict)]
    return "\n".join("  ".join(value.ljust(width) if width else value
                               for value, (_, _, width) in zip(row, LIST_COLUMNS)).rstrip()
                     for row in rows) + "\n"


def label_argument(text: str) -> tuple[str, str]:
    """One --label KEY=VALUE (serve checks the key and value themselves)."""
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise UsageError(f"--label: {text[:80]!r} is not KEY=VALUE")
    return key, value


def text_argument(argument: str, action: str, drop_newline: bool) -> str:
    """The text of `session write` or `message`: the argument, or for `-` stdin, which must be
    UTF-8 (Linux bounds one argument below 128 KiB; a prompt may be 1 MiB). A message drops one
    trailing newline; a write keeps every byte, as typing would."""
    if argument != "-":
        return argument
    try:
        text = sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"session {action}: stdin is not UTF-8 ({e.reason} at byte {e.start})") from None
    return text.removesuffix("\n") if drop_newline else text


def session_server(args: argparse.Namespace) -> str:
    """The server `reploy session` talks to: --server, else $REPLOY_SERVER, else the default
    listen address, checked by the client (reploy_client.check_server); UsageError if not."""
    text = args.server or os.environ.get(client_role.SERVER_ENV) or f"http://{DEFAULT_LISTEN}"
    try:
        return client_role.check_server(text, args.allow_plain_http)
    except ValueError as e:
        raise UsageError(str(e)) from None


def session_token(args: argparse.Namespace) -> Optional[str]:
    """The token `reploy session` sends: --token-file's, else $REPLOY_TOKEN, else none.
    UsageError when the one named is not a token."""
    try:
        return client_role.resolve_token(None, args.token_file)
    except CredentialError as e:
        raise UsageError(str(e)) from None


def exec_request_body(args: argparse.Namespace, command: list[str]) -> dict[str, Any]:
    """`session exec`'s options and command as the API's exec body (UsageError when they do
    not fit): the argv after `--`, or one command line run by `sh -c`; with --stdin, this
    process's stdin becomes the command's."""
    if args.command_line is not None and command:
        raise UsageError("session exec: give one command line or an argv after --, not both")
    if args.command_line is not None:
        command = ["sh", "-c", args.command_line]
    if not command:
        raise UsageError("session exec: no command: `exec ID 'CMD ARGS'` (run by sh -c) or "
                         "`exec ID -- CMD ARGS`")
    try:
        timeout_ms = parse_duration_ms(args.timeout)
    except ValueError as e:
        raise UsageError(f"--timeout: {e}") from None
    if not 1 <= timeout_ms <= MAX_EXEC_TIMEOUT_MS:
        raise UsageError(f"--timeout: from 1ms to {format_duration(MAX_EXEC_TIMEOUT_MS)}")
    body: dict[str, Any] = {"argv": command, "timeoutMs": timeout_ms}
    if args.cwd:
        body["cwd"] = args.cwd
    env = {}
    for pair in args.env:
        name, sep, value = pair.partition("=")
        if not sep or not _ENV_NAME.fullmatch(name):
            raise UsageError(f"--env: {pair!r} is not NAME=VALUE")
        env[name] = value
    if env:
        body["env"] = env
    if args.detach:
        if args.raw or args.stdin:
            raise UsageError("session exec: --detach takes neither --raw nor --stdin")
        body["detach"] = True
    if args.stdin:
        data = sys.stdin.buffer.read(MAX_EXEC_STDIN_BYTES + 1)
        if len(data) > MAX_EXEC_STDIN_BYTES:
            raise UsageError(f"--stdin: more than {MAX_EXEC_STDIN_BYTES} bytes; upload a file and "
                             "redirect from it instead")
        body["stdinBase64"] = base64.b64encode(data).decode("ascii")
    return body


#: `session cp`'s REF:PATH: REF a session's id, id prefix or name (without a slash or colon).
_COPY_OPERAND = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*):(.*)", re.DOTALL)


def parse_copy_operand(text: str) -> tuple[Optional[str], str, str]:
    """(session reference, root, path) for `REF:PATH` (`REF:~/PATH` names home); (None, "",
    text) for a local path or `-`. Pure. Prefix a local name that looks like REF:PATH with ./"""
    match = _COPY_OPERAND.fullmatch(text)
    if match is None:
        return None, "", text
    session_id, path = match.groups()
    root = "workspace"
    if path == "~" or path.startswith("~/"):
        root, path = "home", path[1:].lstrip("/")
    if path.startswith("/"):
        raise UsageError(f"{text}: a session path is relative to its workspace (or ~/ for home)")
    return session_id, root, path


class Terminated(BaseException):
    """SIGTERM while `reploy session` runs: raised like KeyboardInterrupt (so every `finally`
    runs: a spool is removed, a connection dropped), never caught as an error."""


def _raise_terminated(signum: int, _frame: Any) -> None:
    raise Terminated(signum)


def run_session_client(args: argparse.Namespace, token: Optional[str]) -> int:
    """`reploy session ACTION`: one call through reploy_client, its JSON document on stdout
    (`list` on a terminal: a table, unless --json). An error is one line on stderr, with serve's
    status and code, stdout empty, exit 1 (so `id=$(reploy session create ...)` is empty when
    it failed). `exec --raw` instead passes the command's output through as it comes and exits
    with its code; `shell` is a terminal on the session; `cp` copies files (to `-`, stdout carries only
    the data). An ID may be a session's id, its unique name or a unique id prefix. SIGINT and
    SIGTERM end it with 128+N once what it was writing is removed."""
    client = client_role.Client(args.server_url, token, allow_plain_http=True)  # checked above
    action = args.session_action
    raw = action == "exec" and args.raw
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        with client:
            if action in SESSION_ID_ACTIONS:
                args.id = resolve_session(client, args.id)
            if action == "shell":
                return run_terminal(client.session(args.id))
            if action == "cp":
                source, destination = args.copy_source, args.copy_destination
                if source[0] is not None:
                    source = (resolve_session(client, source[0]), *source[1:])
                else:
                    destination = (resolve_session(client, destination[0]), *destination[1:])
                summary = copy_files(client, source, destination)
                if destination != (None, "", "-"):  # else stdout carries the data alone
                    emit(summary)
                return EXIT_OK
            method, path, body = client_request(args)
            if raw:
                assert body is not None  # an exec always has one
                result = client.session(args.id).exec(
                    body["argv"], body.get("cwd"), body.get("env"),
                    base64.b64decode(body["stdinBase64"]) if "stdinBase64" in body else None,
                    body["timeoutMs"] / 1000,
                    on_stdout=functools.partial(write_through, sys.stdout.buffer),
                    on_stderr=functools.partial(write_through, sys.stderr.buffer))
            else:
                timeout_s, max_answer_bytes = 120.0, client_role.MAX_ANSWER_BYTES
                if body is not None and args.session_action == "exec":
                    timeout_s = body["timeoutMs"] / 1000 + 60
                    max_answer_bytes = client_role.exec_answer_limit(body.get("maxOutputBytes"))
                document = client.call(method, path, body, timeout_s, max_answer_bytes)
                if document is None and args.session_action == "delete":  # its 204
                    document = {"id": args.id, "deleted": True}
                shapes = SESSION_ANSWER_KEYS[args.session_action]
                if document is None or not any(all(key in document for key in shape) for shape in shapes):
                    raise client.unexpected(None, f"an answer without {' and '.join(shapes[0])}")
    except client_role.ReployError as e:
        said = ", ".join(str(part) for part in (e.status and f"HTTP {e.status}", e.code) if part)
        print(f"reploy: session {action}: {e.reason}" + (f" ({said})" if said else ""),
              file=sys.stderr)
        return 126 if raw and e.status == 422 else EXIT_FAILED  # 126: cannot run, as docker exec
    except UsageError as e:
        print(f"reploy: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (ReployError, OSError) as e:
        print(f"reploy: session {action}: {e}", file=sys.stderr)
        return EXIT_FAILED
    except (KeyboardInterrupt, Terminated) as e:  # the dropped connection ends the exec or transfer
        signum = signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM
        what = "interrupted" if signum == signal.SIGINT else "terminated"
        print(f"reploy: session {action}: {what}", file=sys.stderr)
        return EXIT_FOR_SIGNAL[signum]
    if not raw:
        assert document is not None  # checked against its shapes above
        if action == "list" and not args.json and sys.stdout.isatty():
            sys.stdout.write(session_table(document["sessions"]))
        else:
            emit(document)
        return EXIT_OK
    return raw_exec_exit_code(result)


def write_through(sink: BinaryIO, data: bytes) -> None:
    """`session exec --raw`'s output, passed on as it comes."""
    sink.write(data)
    sink.flush()


#: `session shell`: the key that leaves the terminal (Ctrl-], as telnet), and the most of the
#: user's typing sent in one write.
DETACH_KEY = b"\x1d"
TERMINAL_READ_BYTES = 4096


def run_terminal(session: client_role.Session) -> int:
    """`reploy session shell ID`: the user's terminal on the session's PTY, as `docker exec
    -it` or `docker attach` give one. Raw mode: every key (Ctrl-C included) goes to the
    session as typed; SIGWINCH resizes the session's terminal; output is the session's log from
    the moment of attaching, as it comes (SSE). Ctrl-] leaves (exit 0), and so does the end of
    the session's stream. Stdin and stdout must be a terminal."""
    stdin_fd, stdout_fd = sys.stdin.fileno(), sys.stdout.fileno()
    if not (os.isatty(stdin_fd) and os.isatty(stdout_fd)):
        raise UsageError("session shell: stdin and stdout must be a terminal "
                         "(in a pipe: session write and session read)")
    start = session.read(2**62).next_offset  # the end of the log: what comes from now on
    # Never closed here: the output thread may still write to it as the process ends.
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)

    def wake(why: bytes) -> None:
        with contextlib.suppress(OSError):
            os.write(wake_write, why)

    def follow() -> None:
        try:
            for chunk in session.stream(start):
                os.write(stdout_fd, chunk.data)
        except (client_role.ReployError, OSError):
            pass
        wake(b"e")  # the stream ended: so does the terminal

    def resize() -> None:
        columns, rows = os.get_terminal_size(stdout_fd)
        with contextlib.suppress(client_role.ReployError):
            session.client.call("POST", f"/sessions/{session.id}/resize",
                                {"columns": columns, "rows": rows})

    print(f"reploy: attached to session {session.id}; Ctrl-] leaves", file=sys.stderr, flush=True)
    saved = termios.tcgetattr(stdin_fd)
    previous = signal.signal(signal.SIGWINCH, lambda *_: wake(b"w"))
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    try:
        tty.setraw(stdin_fd)
        resize()
        threading.Thread(target=follow, name="terminal-output", daemon=True).start()
        while True:
            ready, _, _ = select.select([stdin_fd, wake_read], [], [])
            if wake_read in ready:
                woken = os.read(wake_read, 64)
                if b"e" in woken:
                    return EXIT_OK
                resize()
            if stdin_fd in ready:
                typed = os.read(stdin_fd, TERMINAL_READ_BYTES)
                before, detach, _ = typed.partition(DETACH_KEY)
                text = decoder.decode(before, final=bool(detach) or not typed)
                if text:
                    session.write(text)
                if detach or not typed:
                    return EXIT_OK
    finally:
        termios.tcsetattr(stdin_fd, termios.TCSADRAIN, saved)
        signal.signal(signal.SIGWINCH, previous)
        print("\r", file=sys.stderr, flush=True)


def raw_exec_exit_code(result: client_role.ExecResult) -> int:
    """`session exec --raw`'s exit code, as a shell reports a command: its exit code, 128+N
    after signal N, 124 after the timeout (as timeout(1))."""
    if result.timed_out:
        return 124
    if result.exit_code is not None:
        return result.exit_code
    try:
        return 128 + signal.Signals[result.signal or ""].value
    except KeyError:
        return 128


def copy_files(client: client_role.Client, source: tuple[Optional[str], str, str],
               destination: tuple[Optional[str], str, str]) -> dict[str, Any]:
    """`session cp`, like `docker cp`: files and directories either way; copying onto an
    existing directory puts the source inside it; `-` as the source is a tar on stdin, as the
    destination stdout (a file's bytes, a directory's tar). The copies are the client's."""
    session_id, root, path = source
    if session_id is not None:
        return client_role.copy_from_session(client.session(session_id), root, path, destination[2])
    session_id, root, path = destination
    assert session_id is not None
    return client_role.copy_to_session(source[2], client.session(session_id), root, path)


# ============================================================================================
# CLI
# ============================================================================================


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="reploy", description="Managed sessions: the control plane "
                            "(serve) and its client (session).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    serve = commands.add_parser("serve", help="serve managed sessions: REST API, SSE and web UI")
    serve.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                       help="IP address or localhost; beyond loopback needs --allow-remote")
    serve.add_argument("--allow-remote", action="store_true",
                       help="allow a --listen address beyond loopback (put TLS in front)")
    serve.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                       help="also answer for this Host name, e.g. a reverse proxy's (repeatable)")
    serve.add_argument("--token-file", type=Path, metavar="FILE",
                       help="the token's file (default STATE_DIR/token; made 0600 if missing)")
    serve.add_argument("--state-dir", type=Path, default=Path(".reploy-serve"), metavar="DIR",
                       help="the sessions' records, disks and the token (default .reploy-serve)")
    serve.add_argument("--workload-dir", type=Path, action="append", required=True,
                       help="a staged, built deployment whose image has python3 (repeatable)")
    serve.add_argument("--idle-after", default=format_duration(DEFAULT_IDLE_AFTER_MS),
                       metavar="DURATION", help="a session with no access this long is paused "
                       f"(default {format_duration(DEFAULT_IDLE_AFTER_MS)})")
    serve.add_argument("--snapshot-after", default=format_duration(DEFAULT_SNAPSHOT_AFTER_MS),
                       metavar="DURATION", help="an idle session this long without access is "
                       "snapshotted and its container removed "
                       f"(default {format_duration(DEFAULT_SNAPSHOT_AFTER_MS)})")
    serve.add_argument("--max-busy", default=format_duration(DEFAULT_MAX_BUSY_MS), metavar="DURATION",
                       help="a busy or watched session with no access this long is paused anyway "
                            f"(default {format_duration(DEFAULT_MAX_BUSY_MS)})")
    serve.add_argument("--agent-command", metavar="JSON",
                       help='agent workload argv template, e.g. ["claude", ..., "{prompt}"]')
    serve.add_argument("--agent-env", action="append", default=[], metavar="NAME",
                       help="pass this variable to agent sessions and redact its value (repeatable)")
    serve.add_argument("--mount", action="append", default=[], metavar="HOST:CONTAINER",
                       help="bind-mount a host path read-only into every session (repeatable)")
    serve.add_argument("--default-model", metavar="MODEL",
                       help="claude-code sessions created without a model get this one "
                            "(default: the CLI's own)")
    serve.add_argument("--models", metavar="JSON", help="the UI's model catalog, a JSON array")
    serve.add_argument("--sse-keepalive", default=format_duration(DEFAULT_SSE_KEEPALIVE_MS),
                       metavar="DURATION", help="a comment on a quiet output stream this often "
                       f"(default {format_duration(DEFAULT_SSE_KEEPALIVE_MS)})")
    serve.add_argument("--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS, metavar="N",
                       help=f"sessions this serve holds; more creates: 429 (default {DEFAULT_MAX_SESSIONS})")
    serve.add_argument("--min-free-mib", type=int, default=DEFAULT_MIN_FREE_MIB, metavar="MIB",
                       help="kept free on the state dir's file system for serve's store and logs, beyond "
                            f"what the session disks may still take (default {DEFAULT_MIN_FREE_MIB})")
    serve.add_argument("--egress-allow", action="append", default=[], metavar="HOST[:PORT]",
                       help="a host sessions may reach through serve's egress proxy when their create "
                            "lists it in `egress` (repeatable; PORT 443 if left out; a DNS name or an IP "
                            "literal, IPv6 in brackets)")
    serve.add_argument("--model-upstream", metavar="URL",
                       help="claude-code sessions reach this Messages API (https://HOST[:PORT]"
                            "[/PREFIX]) through serve's credential proxy")
    serve.add_argument("--model-upstream-ca", type=Path, metavar="FILE",
                       help="also trust this CA (PEM) for --model-upstream")
    serve.add_argument("--model-credential-file", type=Path, metavar="FILE",
                       help="the upstream's credential (one line, a 0600 file of serve's user)")
    serve.add_argument("--model-auth", choices=tuple(MODEL_AUTH_HEADERS), default="x-api-key",
                       help="how the upstream takes the credential: x-api-key (Anthropic's API) "
                            "or bearer (Authorization: Bearer, as some gateways want)")
    serve.add_argument("--session-disk-mib", type=int, default=DEFAULT_SESSION_DISK_MIB, metavar="MIB",
                       help="each session's disk quota: everything it writes on the host (default "
                            f"{DEFAULT_SESSION_DISK_MIB}, at least {MIN_SESSION_DISK_MIB}; needs root)")
    serve.add_argument("--session-cpus", type=float, default=DEFAULT_SESSION_CPUS, metavar="CPUS",
                       help="each session container's CPU bound, in cores (default "
                            f"{DEFAULT_SESSION_CPUS}, from {MIN_SESSION_CPUS} to this host's cores)")
    serve.add_argument("--max-session-readers", type=int, default=DEFAULT_MAX_SESSION_READERS,
                       metavar="N", help="output streams of one session this serve holds open "
                                         f"(default {DEFAULT_MAX_SESSION_READERS}; more: 503)")
    serve.add_argument("--max-readers", type=int, default=DEFAULT_MAX_READERS, metavar="N",
                       help="output streams this serve holds open in all "
                            f"(default {DEFAULT_MAX_READERS}; more: 503)")

    session = commands.add_parser(
        "session", help="managed sessions through a serve's API (one JSON document each)",
        description="One call to a `reploy serve` per command; its JSON answer on stdout, an "
                    "error as one line on stderr (exit 1). ID is a session's id, its unique "
                    "name or a unique prefix of its id.")
    actions = session.add_subparsers(dest="session_action", required=True, metavar="ACTION",
                                     parser_class=ArgumentParser)
    common = ArgumentParser(add_help=False)
    common.add_argument("--server", metavar="URL",
                        help=f"default $REPLOY_SERVER or http://{DEFAULT_LISTEN}")
    common.add_argument("--token-file", type=Path, metavar="FILE",
                        help="the server's token file (default: the token in $REPLOY_TOKEN)")
    common.add_argument("--allow-plain-http", action="store_true",
                        help="send the token over plain http to a server beyond loopback")
    create = actions.add_parser("create", parents=[common], help="a new session; its JSON")
    create.add_argument("--name", required=True, help="a name to show, and to address it by")
    create.add_argument("--workload-type", choices=tuple(WORKLOAD_TYPES),
                        help=f"default {DEFAULT_WORKLOAD_TYPE}")
    create.add_argument("--model", help="claude-code only (default: the server's default model)")
    create.add_argument("--deployment", help="one of the server's workload deployments, by its "
                                             "blueprint name (default: the first)")
    create.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                        help="a label to find the session by (`session list --label`; repeatable)")
    create.add_argument("--ttl", metavar="DURATION", dest="ttl",
                        help="the reaper deletes the session this long after its creation, e.g. "
                             "90m or 2h (default: never)")
    create.add_argument("--cpus", type=float,
                        help="the session's CPU bound in cores (default: the server's --session-cpus)")
    create.add_argument("--disk-mib", type=int, metavar="MIB",
                        help="the session's disk quota (default: the server's --session-disk-mib)")
    create.add_argument("--egress", action="append", default=[], metavar="HOST[:PORT]",
                        help="a host the session may reach, one of serve's --egress-allow (repeatable)")
    listing = actions.add_parser("list", parents=[common],
                                 help="the sessions: a table on a terminal, else JSON")
    listing.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                         help="only sessions carrying this label (repeatable: every one)")
    listing.add_argument("--json", action="store_true", help="JSON on a terminal too")
    for name, said in (("get", "the session's JSON"), ("status", "the agent's view: turn, queue, output"),
                       ("interrupt", "Ctrl-C to the foreground job (shell) or the running prompt"),
                       ("relaunch", "start the workload anew (the output log is kept)"),
                       ("switch", "bring an idle or snapshotted session back"),
                       ("snapshot", "checkpoint the session and give its container back"),
                       ("delete", "delete the session and everything of it")):
        actions.add_parser(name, parents=[common], help=said).add_argument("id", metavar="ID", help=ID_HELP)
    read = actions.add_parser("read", parents=[common], help="the output log from an offset")
    read.add_argument("id", metavar="ID", help=ID_HELP)
    read.add_argument("--offset", type=int, default=0, help="from this byte offset to the end (default 0)")
    read.add_argument("--wait-ms", type=int, default=0,
                      help="at the end of the output, wait this long for more (default 0)")
    write = actions.add_parser("write", parents=[common], help="type text into the session")
    write.add_argument("id", metavar="ID", help=ID_HELP)
    write.add_argument("data", help="the text to type (shell) or one prompt (claude-code); - reads "
                       "it from stdin (UTF-8)")
    message = actions.add_parser("message", parents=[common],
                                 help="one line (shell) or prompt (claude-code), queued while busy")
    message.add_argument("id", metavar="ID", help=ID_HELP)
    message.add_argument("text", help="a prompt (agent) or one line (shell); - reads it from stdin "
                         "(UTF-8, one trailing newline dropped), for texts an argument cannot hold")
    run = actions.add_parser(
        "exec", parents=[common], usage="reploy session exec ID [--cwd DIR] [--timeout 60s] "
        "[--env K=V] [--stdin] [--raw | --detach] ('CMD ARGS' | -- CMD [ARG ...])",
        help="run a command in the session's container; one JSON result",
        description="Runs a command as the session's user: one command line (run by sh -c) or "
                    "an argv after --. Options go before the command.")
    run.add_argument("id", metavar="ID", help=ID_HELP)
    run.add_argument("command_line", nargs="?", metavar="'CMD ARGS'",
                     help="a shell command line, run by sh -c (or give an argv after --)")
    run.add_argument("--cwd", default="", help="relative to the workspace (default: the workspace)")
    run.add_argument("--timeout", default="60s", metavar="DURATION",
                     help="the command is killed after this long (default 60s)")
    run.add_argument("--env", action="append", default=[], metavar="K=V",
                     help="a variable of the command's environment (repeatable)")
    run.add_argument("--stdin", action="store_true",
                     help=f"send this process's stdin (at most {MAX_EXEC_STDIN_BYTES} bytes)")
    run.add_argument("--raw", action="store_true",
                     help="pass stdout and stderr through and exit with the command's code")
    run.add_argument("--detach", action="store_true",
                     help="answer once started: its pid and the files its output goes to")
    shell = actions.add_parser("shell", parents=[common],
                               help="your terminal on the session's shell (Ctrl-] leaves)")
    shell.add_argument("id", metavar="ID", help=ID_HELP)
    copy = actions.add_parser(
        "cp", parents=[common], usage="reploy session cp SRC DST",
        help="copy files or directories in or out: one side is ID:PATH (ID:~/PATH for home), "
             "the other a local path, or - (as SRC a tar on stdin, as DST stdout)")
    copy.add_argument("source", help="ID:PATH, a local path, or - (a tar on stdin)")
    copy.add_argument("destination", help="ID:PATH, a local path, or - (stdout)")
    return parser


def is_exec_command_line(args: argparse.Namespace, extras: list[str]) -> bool:
    """Whether what argparse left over is `session exec`'s one command line, given after an
    option (`exec ID --raw 'CMD'`: argparse fills an optional positional only before options)."""
    return (args.command == "session" and args.session_action == "exec" and args.command_line is None
            and len(extras) == 1 and not extras[0].startswith("-"))


def main(argv: Optional[list[str]] = None) -> int:
    argv, command = split_command(list(sys.argv[1:] if argv is None else argv))
    try:
        args, extras = build_parser().parse_known_args(argv)
        if extras and is_exec_command_line(args, extras):
            args.command_line = extras[0]  # after an option: argparse takes no positional there
        elif extras:
            raise UsageError(f"unrecognized arguments: {' '.join(extras)}")
        if command and not (args.command == "session" and args.session_action == "exec"):
            raise UsageError("only session exec takes arguments after --")
        if args.command == "serve":
            serve_config, serve_access = serve_config_from(args), serve_access_from(args)
        else:
            args.server_url = session_server(args)
            token = session_token(args)
            if args.session_action == "exec":
                args.exec_body = exec_request_body(args, command)
            elif args.session_action == "cp":
                args.copy_source = parse_copy_operand(args.source)
                args.copy_destination = parse_copy_operand(args.destination)
                if (args.copy_source[0] is None) == (args.copy_destination[0] is None):
                    raise UsageError("session cp: exactly one of SRC and DST is ID:PATH")
    except UsageError as e:
        hint = ""
        if argv[:2] == ["session", "exec"] and "unrecognized arguments" in str(e):
            hint = ("; a command's own options go after --: `exec ID -- CMD -x`, or quote the "
                    "command line: `exec ID 'CMD -x'`")
        print(f"reploy: usage error: {e}{hint}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "serve":
        return run_serve(serve_config, serve_access)
    return run_session_client(args, token)


def run_command() -> None:
    run_as_process(main)


if __name__ == "__main__":
    run_command()
