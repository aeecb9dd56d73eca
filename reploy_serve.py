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
generation, running agent.py (as root keeping SETUID, SETGID and KILL, the workload as the
deployment's runtime user) with the session's own disk bind-mounted; `serve` talks to the
agent only through the control socket on that disk and treats every answer as hostile input.
Every session record lives in SQLite under --state-dir, and every change of state is a
compare-and-swap under a lease, so several `serve` processes can share one state dir without
ever acting twice on one session. States: active -> idle (container paused) -> snapshot
(checkpoint archive kept, container removed); any access brings a session back. A reaper
thread applies the idle policy; an HTTP server thread per request does the rest. Only the
user drives it: a per-state-dir token, a Host allowlist, an Origin check and JSON-only bodies
(see "who may drive serve" below).

Machine output is one JSON document on stdout; human text goes to stderr.

Reading order: constants and errors, the session state machine (pure), the reaper's decision
(pure), the store (SQLite with compare-and-swap and leases), request bodies and responses
(pure), the SSE encoder (pure), who may drive serve (pure), the agent's control socket (client
side), the session disks, the Docker orchestration, the HTTP adapter, then `serve`, the
`session` client and the CLI.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import enum
import fcntl
import hashlib
import hmac
import http.server
import ipaddress
import json
import os
import re
import secrets
import select
import shutil
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Generator, Iterable, Iterator, Optional, Sequence

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import agent as agent_role  # noqa: E402  (the data plane; `session cp` reuses its archive rules)
import reploy_session_client as wire  # noqa: E402  (the strict JSON parser and encoder)
import reploy_watchdog  # noqa: E402  (process identities, link-safe removal)
from reploy import (  # noqa: E402  (the host role: Docker adapter, deployments, durations)
    CONTAINER_HOME, EXIT_FAILED, EXIT_FOR_SIGNAL, EXIT_OK, EXIT_USAGE, LABEL_DEPLOYMENT,
    LABEL_GENERATION, LABEL_ROLE, LABEL_RUN, ArgumentParser, BackendError, BlueprintError,
    ContainerPathError, ContainerSpec, Deployment, DeploymentError, DockerBackend, Mount,
    ReployError, Runtime, UsageError, _NAME, emit, format_duration, load_deployment, log,
    open_regular_file, opened_dir, parse_duration_ms, regular_file_size,
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
#: checkpoints, download spools) still grow when the workload has filled the rest.
SESSION_DISK_RESERVED_PERCENT = 5
#: What the host may hold for a session beyond its image's size: the host file system's own
#: blocks for the image file (extent tree). Documented in the README; tests measure it.
SESSION_DISK_MARGIN_MIB = 1
SESSION_DISK_TOOL_TIMEOUT_S = 120.0
#: mkfs.ext4, mount and umount run with this environment only.
SESSION_DISK_TOOL_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}

DEFAULT_LISTEN = "127.0.0.1:8080"
DEFAULT_IDLE_AFTER_MS = 15 * 60_000
DEFAULT_SNAPSHOT_AFTER_MS = 60 * 60_000
#: The bound on work the reaper respects: no access for this long, and a busy or watched session
#: is paused anyway (see decide_reap).
DEFAULT_MAX_BUSY_MS = 24 * 60 * 60_000
DEFAULT_SSE_KEEPALIVE_MS = 15_000
DEFAULT_MAX_SESSIONS = 64
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
#: The agent bounds every request at 5 s (docs/agent.md); we outwait it.
AGENT_CALL_TIMEOUT_S = 10.0
AGENT_MAX_RESPONSE_BYTES = 4 * 1024 * 1024
#: JSON bodies: the wire bound and how long a client may take to send one.
MAX_BODY_BYTES = 8 * 1024 * 1024
BODY_READ_TIMEOUT_S = 30.0
#: A message or an agent session's prompt, UTF-8 (the agent's own bound); longer than one agent
#: request line holds, it goes to the agent in parts of MAX_MESSAGE_PART_BYTES.
MAX_PAYLOAD_BYTES = agent_role.MAX_PROMPT_BYTES
MAX_MESSAGE_PART_BYTES = agent_role.MAX_MESSAGE_PART_BYTES
#: One shell write, decoded: it travels as base64 in the agent's one request line, as an upload
#: chunk does, so it is bounded as a chunk is (more answered 422 or 503 from the agent, not 413).
MAX_WRITE_BYTES = agent_role.MAX_TRANSFER_CHUNK_BYTES
#: `read`'s bounds are the agent's, which serves it.
MIN_READ_BYTES = agent_role.MIN_READ_BYTES
MAX_READ_BYTES = agent_role.MAX_READ_BYTES
DEFAULT_READ_BYTES = agent_role.DEFAULT_READ_BYTES
MAX_READ_WAIT_MS = agent_role.MAX_READ_WAIT_MS
#: One SSE output event carries at most this many payload bytes.
SSE_CHUNK_BYTES = 64 * 1024
#: How often an SSE stream looks at the output log's length.
SSE_POLL_S = 0.02
#: How long one SSE wake-up long-poll waits in the agent before the stream looks again.
SSE_LONG_POLL_MS = 1000
#: exec: the HTTP call answers once the command ends; meanwhile each agent long-poll waits this
#: long (under the agent's 5 s handler bound), and the client's connection is checked between.
EXEC_POLL_MS = 4000
#: The agent's exec and transfer bounds (docs/agent.md), which it alone defines: stdin travels
#: in one request line, output is kept per stream up to the cap, files move in chunks whose
#: base64 fits its 1 MiB request line.
DEFAULT_EXEC_TIMEOUT_MS = agent_role.DEFAULT_EXEC_TIMEOUT_MS
MAX_EXEC_TIMEOUT_MS = agent_role.MAX_EXEC_TIMEOUT_MS
MAX_EXEC_STDIN_BYTES = agent_role.MAX_EXEC_STDIN_BYTES
DEFAULT_EXEC_OUTPUT_BYTES = agent_role.DEFAULT_EXEC_OUTPUT_CAP_BYTES
MAX_EXEC_OUTPUT_BYTES = agent_role.MAX_EXEC_OUTPUT_CAP_BYTES
TRANSFER_CHUNK_BYTES = agent_role.MAX_TRANSFER_CHUNK_BYTES
MAX_UPLOAD_BYTES = agent_role.MAX_TRANSFER_BYTES
#: A listing answers at most this many entries (then `truncated`), gathered from at most this
#: much of the agent's JSON (as many entries with the longest names and link targets fit).
MAX_LIST_ENTRIES = 10_000
MAX_LIST_JSON_BYTES = 64 * 1024 * 1024
#: Routes whose body is raw bytes streamed to the agent, not JSON, and the content types each
#: accepts (the upload route: a file, or a tar to extract). Every other body is JSON.
RAW_BODY_ROUTES: dict[str, tuple[str, ...]] = {
    "put_file": ("application/octet-stream", "application/x-tar"),
}
_SESSION_ID = re.compile(r"[0-9a-f]{16}")
_SESSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._-]{0,63}")
#: Seed 002's model identifiers (an optional leading ~ for moving aliases).
_MODEL = re.compile(r"~[A-Za-z0-9][A-Za-z0-9._:/-]{0,126}|[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
#: Seed 002's alias for "the platform's default model": what GET /config shows when no default
#: is configured, and reserved: never a catalog entry, a --default-model or a session's model.
PLATFORM_DEFAULT_MODEL = "platform-default"
_ENV_NAME = agent_role.ENV_NAME_RE  #: what the agent accepts as a variable name
#: The credential of one state dir (see "who may drive serve"): STATE_DIR/token, mode 0600.
TOKEN_FILE_NAME = "token"
TOKEN_BYTES = 32
#: What a token may be: at least 32 characters (128 bits as hex), nothing that a header, a
#: cookie or a percent-encoded URL could not carry.
_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{32,512}")
MAX_TOKEN_FILE_BYTES = 4096
#: The browser's way in: GET /login?token=T sets the cookie and redirects to /.
LOGIN_PATH = "/login"
#: The cookie is named per port (cookies ignore ports) and holds a value derived from the token.
COOKIE_PREFIX = "reploy-"
COOKIE_CONTEXT = b"reploy-serve-cookie-v1"
#: The Host names a loopback listen answers for (lowercase, IPv6 without brackets).
LOOPBACK_HOST_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


class CredentialError(ReployError):
    """A token file or token that cannot be used (unreadable, open to others, malformed)."""


class ServeError(ReployError):
    """A managed-session request that failed; `status` is its HTTP status, the message its
    {"error": ...} text. Subclasses split the blame the way seed 002's error mapping does."""

    status = 500

    def response_headers(self) -> dict[str, str]:
        """Headers the error response must carry besides its JSON body."""
        return {}


class BadRequest(ServeError):
    """Malformed: not JSON, unknown fields, wrong types, trailing data."""

    status = 400


class SessionNotFound(ServeError):
    status = 404


class SessionConflict(ServeError):
    """The session's state refuses this now (busy with another operation, or a lost race)."""

    status = 409


class MethodNotAllowed(ServeError):
    status = 405

    def __init__(self, message: str, allowed: tuple[str, ...]) -> None:
        super().__init__(message)
        self.allowed = allowed

    def response_headers(self) -> dict[str, str]:
        return {"Allow": ", ".join(self.allowed)}


class PayloadTooLarge(ServeError):
    status = 413


class Unprocessable(ServeError):
    """Well-formed, but a value is out of range or does not fit the session."""

    status = 422


class TooManyRequests(ServeError):
    """A bounded queue is full, or the session limit is reached."""

    status = 429


class ServiceUnavailable(ServeError):
    """Docker or the agent cannot serve this right now."""

    status = 503


class InsufficientStorage(ServeError):
    status = 507


class Unauthorized(ServeError):
    """No credentials, or wrong ones (see "who may drive serve")."""

    status = 401

    def response_headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="reploy"'}


class Forbidden(ServeError):
    """A browser request from another origin or site."""

    status = 403


class PathNotFound(ServeError):
    """No such file or directory in a session's workspace or home."""

    status = 404


class UnsupportedMediaType(ServeError):
    status = 415


class MisdirectedRequest(ServeError):
    """A Host this server does not answer for: DNS rebinding, or a proxy not named with
    --allow-host."""

    status = 421


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
#: and deleting always rolls forward.
SESSION_TRANSITIONS: dict[tuple[SessionState, SessionEvent], SessionState] = {
    (SessionState.CREATING, SessionEvent.STARTED): SessionState.ACTIVE,
    (SessionState.CREATING, SessionEvent.ROLLBACK): SessionState.DELETING,
    (SessionState.ACTIVE, SessionEvent.PAUSED): SessionState.IDLE,
    (SessionState.IDLE, SessionEvent.RESUMED): SessionState.ACTIVE,
    (SessionState.ACTIVE, SessionEvent.CHECKPOINT): SessionState.SNAPSHOTTING,
    (SessionState.IDLE, SessionEvent.CHECKPOINT): SessionState.SNAPSHOTTING,
    (SessionState.SNAPSHOTTING, SessionEvent.CHECKPOINTED): SessionState.SNAPSHOT,
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

    def to_json(self) -> str:
        doc = {k: v for k, v in self.__dict__.items() if k != "runtime"}
        doc["runtime"] = {**self.runtime.__dict__, "writable_paths": list(self.runtime.writable_paths)}
        return json.dumps(doc, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "SessionSpec":
        doc = json.loads(text)
        runtime = doc.pop("runtime")
        runtime["writable_paths"] = tuple(runtime["writable_paths"])
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
    lease_owner: Optional[str] = None
    lease_expires: float = 0.0
    busy_at: Optional[float] = None  # when the workload was last known busy (the reaper's facts)
    idle_blocked_by: tuple[IdleBlock, ...] = ()  # as the reaper last found it; frozen while paused


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
#:   * an active session whose agent does not answer counts as not busy (the earlier rule).
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
    elif quiet_s >= policy.snapshot_after_s:
        action = ReapAction.SNAPSHOT
    elif record.state is SessionState.ACTIVE and quiet_s >= policy.idle_after_s:
        action = ReapAction.PAUSE
    else:
        action = ReapAction.KEEP
    return ReapDecision(action, blocked, busy_at, idle_since)


# ============================================================================================
# the store (SQLite, compare-and-swap, leases)
# ============================================================================================

_STORE_SCHEMA_VERSION = 2
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
_STORE_ADDED_COLUMNS = (("busy_at", "REAL"), ("idle_blocked_by", "TEXT NOT NULL DEFAULT ''"))
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
                   "lease_expires", "busy_at", "idle_blocked_by")


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
        self._local = threading.local()
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

        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(str(self.path), timeout=30, isolation_level=None,
                                 check_same_thread=True)
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA busy_timeout=30000")
            self._local.db = db
        try:
            yield db
        except sqlite3.Error as e:
            raise ServiceUnavailable(f"session store {self.path}: {e}") from e

    @staticmethod
    def _record(row: tuple[Any, ...]) -> SessionRecord:
        values = dict(zip(_RECORD_COLUMNS, row))
        values["spec"] = SessionSpec.from_json(values["spec"])
        values["state"] = SessionState(values["state"])
        values["idle_blocked_by"] = _blocks_from_text(values["idle_blocked_by"])
        return SessionRecord(**values)

    def insert(self, record: SessionRecord) -> None:
        values = {**record.__dict__, "spec": record.spec.to_json(), "state": record.state.value,
                  "idle_blocked_by": _blocks_to_text(record.idle_blocked_by)}
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
                "container_id = ?, archive = ?, snapshot_bytes = ?, busy_at = ?, "
                "idle_blocked_by = ? "
                "WHERE id = ? AND version = ? AND lease_owner = ? AND lease_expires > ?",
                (new.state.value, new.version, new.last_access, new.state_since,
                 new.container_id, new.archive, new.snapshot_bytes, new.busy_at,
                 _blocks_to_text(new.idle_blocked_by), old.id, old.version, owner, now))
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

    def touch(self, session_id: str, now: float) -> bool:
        """Record an access to an active session nobody is operating on. False: slow path."""
        with self._db() as db:
            cursor = db.execute(
                "UPDATE sessions SET last_access = ? WHERE id = ? AND state = ? AND "
                "(lease_owner IS NULL OR lease_expires <= ?)",
                (now, session_id, SessionState.ACTIVE.value, now))
        return cursor.rowcount == 1

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
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None


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

    kind: type
    required: bool = False
    minimum: Optional[int] = None
    maximum: Optional[int] = None
    pattern: Optional[re.Pattern[str]] = None  # the whole value must match (fullmatch)
    choices: tuple[str, ...] = ()
    reserved: tuple[str, ...] = ()  # values the pattern allows that are refused anyway


#: A model name, wherever one is given: a session's model, --default-model, a --models entry.
MODEL_RULE = FieldRule(str, pattern=_MODEL, reserved=(PLATFORM_DEFAULT_MODEL,))


#: Request bodies by operation. Unknown fields, wrong types and missing fields are 400; a value
#: of the right type that does not fit is 422.
BODY_RULES: dict[str, dict[str, FieldRule]] = {
    "create": {"name": FieldRule(str, True, pattern=_SESSION_NAME),
               "workload": FieldRule(str, True, choices=("shell", "agent")),
               "model": MODEL_RULE,
               "deployment": FieldRule(str, pattern=_NAME)},
    "read": {"offset": FieldRule(int, minimum=0, maximum=2**62),
             "maxBytes": FieldRule(int, minimum=MIN_READ_BYTES, maximum=MAX_READ_BYTES),
             "waitMs": FieldRule(int, minimum=0, maximum=MAX_READ_WAIT_MS)},
    "write": {"dataBase64": FieldRule(str, True)},
    "message": {"text": FieldRule(str, True)},
    "resize": {"columns": FieldRule(int, True, minimum=1, maximum=agent_role.MAX_TERMINAL_SIDE),
               "rows": FieldRule(int, True, minimum=1, maximum=agent_role.MAX_TERMINAL_SIDE)},
    "exec": {"argv": FieldRule(list, True), "cwd": FieldRule(str), "env": FieldRule(dict),
             "stdinBase64": FieldRule(str),
             "timeoutMs": FieldRule(int, minimum=1, maximum=MAX_EXEC_TIMEOUT_MS),
             "maxOutputBytes": FieldRule(int, minimum=0, maximum=MAX_EXEC_OUTPUT_BYTES)},
    "empty": {},
}
_JSON_KIND_NAMES = {int: "an integer", str: "a string", list: "an array", dict: "an object"}


def parse_body(raw: bytes, rules: dict[str, FieldRule]) -> dict[str, Any]:
    """Strict JSON object (the project's one strict parser, wire.parse_strict_object) ->
    validated fields. An empty body is {}."""
    if len(raw) > MAX_BODY_BYTES:
        raise PayloadTooLarge(f"the body exceeds {MAX_BODY_BYTES} bytes")
    if not raw.strip():
        doc: dict[str, Any] = {}
    else:
        try:
            doc = wire.parse_strict_object(raw.strip(b" \t\r\n"))  # JSON's own whitespace
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
    """One value against its rule: BadRequest for a wrong type, Unprocessable for a value that
    does not fit."""
    if isinstance(value, bool) or not isinstance(value, rule.kind):
        raise BadRequest(f"{name}: must be {_JSON_KIND_NAMES[rule.kind]}")
    if rule.minimum is not None and value < rule.minimum or (
            rule.maximum is not None and value > rule.maximum):
        raise Unprocessable(f"{name}: must be from {rule.minimum} to {rule.maximum}")
    if rule.pattern is not None and not rule.pattern.fullmatch(value):
        raise Unprocessable(f"{name}: {value[:80]!r} is not allowed")
    if rule.choices and value not in rule.choices:
        raise Unprocessable(f"{name}: must be one of {', '.join(rule.choices)}")
    if value in rule.reserved:
        raise Unprocessable(f"{name}: {value!r} is reserved")


def decode_payload(text: str, what: str, limit_bytes: int) -> bytes:
    """Base64 from a body, bounded after decoding."""
    try:
        data = base64.b64decode(text, validate=True)
    except ValueError:
        raise BadRequest(f"{what}: not base64") from None
    if len(data) > limit_bytes:
        raise PayloadTooLarge(f"{what}: more than {limit_bytes} bytes")
    return data


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
    checked here (400); what does not fit, the agent refuses (422)."""
    argv, env = fields["argv"], fields.get("env", {})
    if not argv or not all(isinstance(arg, str) for arg in argv):
        raise BadRequest("argv: must be a non-empty array of strings")
    if not all(isinstance(value, str) for value in env.values()):
        raise BadRequest("env: every value must be a string")
    params: dict[str, Any] = {
        "argv": argv, "cwd": fields.get("cwd", ""), "env": env,
        "timeout_ms": fields.get("timeoutMs", DEFAULT_EXEC_TIMEOUT_MS),
        "output_cap_bytes": fields.get("maxOutputBytes", DEFAULT_EXEC_OUTPUT_BYTES)}
    if "stdinBase64" in fields:
        try:
            stdin = base64.b64decode(fields["stdinBase64"], validate=True)
        except ValueError:
            raise BadRequest("stdinBase64: not base64") from None
        if len(stdin) > MAX_EXEC_STDIN_BYTES:
            raise PayloadTooLarge(f"stdinBase64: more than {MAX_EXEC_STDIN_BYTES} bytes; upload a "
                                  "file and redirect from it instead")
        params["stdin_b64"] = base64.b64encode(stdin).decode("ascii")
    return params


def exec_result_json(final: dict[str, Any], stdout: bytes, stderr: bytes) -> dict[str, Any]:
    """The API's exec result from the agent's last exec_wait answer and the collected output:
    how it ended (exitCode, or signal, or timedOut), each stream as text and exact base64."""
    document = {"execId": final["exec_id"], "exitCode": final["exit_code"],
                "signal": final["signal"], "timedOut": final["timed_out"],
                "killed": final["killed"], "durationMs": final["duration_ms"]}
    for name, data in (("stdout", stdout), ("stderr", stderr)):
        document[name] = data.decode("utf-8", "replace")
        document[f"{name}Base64"] = base64.b64encode(data).decode("ascii")
        document[f"{name}Truncated"] = final[f"{name}_truncated"]
    return document


def file_route_path(api_path: str) -> str:
    """The workspace path a files or list route (a path below /api/v1) names: what follows
    /sessions/ID/files/ (or /list/), percent-decoded; "" is the root."""
    parts = api_path.split("?", 1)[0].strip("/").split("/", 3)
    return urllib.parse.unquote(parts[3]) if len(parts) > 3 else ""


def file_query(query: str) -> tuple[str, Optional[int]]:
    """(root, mode) from a files route's query: ?root=workspace|home, ?mode=0755 (octal)."""
    params = urllib.parse.parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(params) - {"root", "mode"})
    if unknown:
        raise BadRequest(f"unknown query parameter(s): {', '.join(unknown)}")
    root = (params.get("root") or ["workspace"])[-1]
    if root not in ("workspace", "home"):
        raise Unprocessable("root: must be workspace or home")
    mode_text = (params.get("mode") or [None])[-1]
    if mode_text is not None and not re.fullmatch(r"0?[0-7]{1,4}", mode_text):
        raise Unprocessable("mode: an octal mode such as 0644")
    return root, None if mode_text is None else int(mode_text, 8)


def session_json(record: SessionRecord, idle_after_s: float, snapshot_after_s: float) -> dict[str, Any]:
    """A session as the API shows it. Nothing secret is in a record, so nothing leaks here. The
    countdowns run from the idle clock's start (decide_reap) and stop while something blocks it."""
    spec = record.spec
    idle_at = snapshot_at = None
    blocked = record.idle_blocked_by if record.state in (SessionState.ACTIVE, SessionState.IDLE) else ()
    idle_since = idle_clock_start(record.last_access, record.busy_at)
    if record.state is SessionState.ACTIVE and not blocked:
        idle_at = idle_since + idle_after_s
    if record.state in (SessionState.ACTIVE, SessionState.IDLE) and not blocked:
        snapshot_at = idle_since + snapshot_after_s
    return {"id": record.id, "name": record.name, "workload": spec.workload, "model": spec.model,
            "deployment": spec.deployment, "generation": spec.generation,
            "state": record.state.value, "version": record.version,
            "createdAt": record.created_at, "lastAccess": record.last_access,
            "stateSince": record.state_since, "idleAt": idle_at, "snapshotAt": snapshot_at,
            "idleBlockedBy": [block.value for block in blocked],
            "snapshotBytes": record.snapshot_bytes}


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


# ============================================================================================
# the SSE encoder (pure)
# ============================================================================================

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
    """The cursor is ahead of the log: read again from 0 (POST /read) and reconnect."""
    return f"id: {length_bytes}\nevent: reset\ndata: {{\"nextOffset\":{length_bytes}}}\n\n".encode()


def sse_cursor(last_event_id: Optional[str], query_offset: Optional[str]) -> int:
    """Where a stream starts: Last-Event-ID (a reconnect) wins over ?offset=; default 0."""
    for source, text in (("Last-Event-ID", last_event_id), ("offset", query_offset)):
        if text is None or text == "":
            continue
        if not re.fullmatch(r"[0-9]{1,18}", text):
            raise BadRequest(f"{source}: not a byte offset")
        return int(text)
    return 0


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
#      even for a client holding a stolen cookie.
#   2. The UI's static files need no credentials (they hold no data). GET /login?token=T with
#      the right token sets the browser's cookie and redirects to / (the adapter does that).
#   3. Under /api/v1, a browser request from elsewhere is refused (403): an Origin other than
#      this server's own, or Sec-Fetch-Site saying another site. Pages on another port of the
#      same loopback address are *same-site*, so the SameSite=Strict cookie reaches us from
#      them; this check is what stops them.
#   4. Then credentials (401): `Authorization: Bearer TOKEN`, which alone decides when present,
#      or the cookie. A token in an API query string is never one.
#   5. A body must be application/json (415): the only kinds a page can send across origins
#      without a preflight (forms, text/plain) are refused, and preflights get no CORS headers.
#      The one exception is the upload route (RAW_BODY_ROUTES), which takes raw bytes as
#      application/octet-stream or application/x-tar in a PUT, itself never preflight-free.
#
# Tokens and cookie values are compared in constant time. No message names a credential.


class Access(enum.Enum):
    """What the HTTP adapter does with a request that passed the checks."""

    ROUTE = "route"  # serve it: a static file, or an authenticated API call
    LOGIN = "login"  # /login with the right token: set the cookie, 303 to /


@dataclass(frozen=True)
class AccessPolicy:
    """One server's credentials and names. The cookie holds a value derived from the token, so
    the token itself never lives in the browser; its name carries the port, because cookies
    ignore ports and two servers on one machine must not overwrite each other's."""

    token: str = field(repr=False)
    cookie_name: str
    cookie_value: str = field(repr=False)
    allowed_hosts: frozenset[str]

    @classmethod
    def for_server(cls, token: str, port: int, allowed_hosts: frozenset[str]) -> "AccessPolicy":
        value = hmac.new(token.encode(), COOKIE_CONTEXT, hashlib.sha256).hexdigest()
        return cls(token, f"{COOKIE_PREFIX}{port}", value, allowed_hosts)


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


def _cookie_values(headers: Sequence[tuple[str, str]], name: str) -> list[str]:
    """Every value the Cookie headers give `name` (a page elsewhere on this host may have set
    another cookie of the same name: any one of them may be ours)."""
    values = []
    for key, header in headers:
        if key.lower() == "cookie":
            for pair in header.split(";"):
                cookie, separator, value = pair.strip().partition("=")
                if separator and cookie == name:
                    values.append(value)
    return values


def _is_json_media_type(content_type: Optional[str]) -> bool:
    media_type, _, parameters = (content_type or "").partition(";")
    return media_type.strip().lower() == "application/json" and parameters.strip().lower() in (
        "", "charset=utf-8", 'charset="utf-8"')


UNAUTHORIZED_MESSAGE = ("authentication required: send Authorization: Bearer TOKEN "
                        "(STATE_DIR/token), or open the login_url printed by `reploy serve`")


def decide_access(method: str, target: str, headers: Sequence[tuple[str, str]],
                  policy: AccessPolicy) -> Access:
    """Route or log in, or raise the ServeError that refuses the request (the rules above).
    `target` is the request target as sent (path and query); `headers` every header line."""
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
    if path == LOGIN_PATH:
        if method != "GET":
            raise MethodNotAllowed(f"{method} is not allowed here (allowed: GET)", ("GET",))
        tokens = urllib.parse.parse_qs(query, keep_blank_values=True).get("token", [])
        if len(tokens) != 1 or not same_secret(tokens[0], policy.token):
            raise Unauthorized("this login link's token is wrong; open the login_url printed "
                               "by `reploy serve`")
        return Access.LOGIN
    if not is_api_path(path):
        return Access.ROUTE
    origin = _single_header(headers, "origin")
    if origin is not None and not is_same_origin(origin, host_name, host_port):
        raise Forbidden("requests from another origin are refused")
    if (_single_header(headers, "sec-fetch-site") or "").lower() in ("cross-site", "same-site"):
        raise Forbidden("requests from another site are refused")
    authorization = _single_header(headers, "authorization")
    if authorization is not None:
        scheme, _, credential = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not same_secret(credential.strip(), policy.token):
            raise Unauthorized("wrong credentials: " + UNAUTHORIZED_MESSAGE)
    elif not any(same_secret(value, policy.cookie_value)
                 for value in _cookie_values(headers, policy.cookie_name)):
        in_url = "token" in urllib.parse.parse_qs(query, keep_blank_values=True)
        raise Unauthorized(UNAUTHORIZED_MESSAGE + (" (a token in an API URL is not accepted)"
                                                   if in_url else ""))
    has_body = (_single_header(headers, "content-length") or "0").strip() != "0" or (
        _single_header(headers, "transfer-encoding") is not None)
    content_type = _single_header(headers, "content-type")
    raw_types = _raw_body_types(method, path)
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if has_body and not (_is_json_media_type(content_type) or media_type in raw_types):
        raise UnsupportedMediaType("request bodies must be Content-Type: "
                                   + " or ".join(raw_types or ("application/json",)))
    return Access.ROUTE


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
# the agent's control socket (client side)
# ============================================================================================


class AgentCallError(ReployError):
    """The agent answered with an error (docs/agent.md codes), or did not answer at all
    (`transport` is then True and the code is server_unavailable)."""

    def __init__(self, code: str, message: str, transport: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.transport = transport


def agent_call(session_dir: Path, method: str, params: dict[str, Any],
               timeout_s: float = AGENT_CALL_TIMEOUT_S) -> dict[str, Any]:
    """One request on DIR/control.sock; the result, or AgentCallError. The session can write
    DIR and run its own server in the agent's place, so the socket is reached only as a socket
    (connect_unix_at: never through a symlink), the whole call has one deadline (a peer that
    trickles bytes cannot hold the caller, the reaper among them), and the answer must be a
    response object with an object inside."""
    line = wire.encode_compact({"id": "serve", "method": method, "params": params}) + b"\n"
    deadline = time.monotonic() + timeout_s
    response = bytearray()
    try:
        with opened_dir(session_dir) as dir_fd:
            connection = agent_role.connect_unix_at(dir_fd, SOCKET_NAME, timeout_s)
        with connection as sock:
            sock.sendall(line)
            while not response.endswith(b"\n") and len(response) < AGENT_MAX_RESPONSE_BYTES:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                chunk = sock.recv(256 * 1024)
                if not chunk:
                    break
                response += chunk
        doc = json.loads(response)
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep
        raise AgentCallError("server_unavailable", f"the session agent does not answer: {e}",
                             transport=True) from e
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        error = doc["error"]
        raise AgentCallError(str(error.get("code")), str(error.get("message")))
    if not (isinstance(doc, dict) and isinstance(doc.get("result"), dict)):
        raise AgentCallError("server_unavailable", "the session agent's answer is not a response")
    return doc["result"]


def serve_error_for(error: AgentCallError) -> ServeError:
    """The agent's blame-split codes, as HTTP statuses. The file and exec verbs name some
    failures in stable words (docs/agent.md, "Errors of the harness verbs"), mapped first."""
    message, text = f"agent: {error}", str(error)
    if error.code == "command_error" and text.startswith("no such file or directory"):
        return PathNotFound(message)
    if error.code == "disk_full" or text.startswith("not enough space"):
        return InsufficientStorage(message)
    if text.startswith("too large"):
        return PayloadTooLarge(message)
    if error.code == "invalid_request" or "UTF-8 boundary" in text or text.startswith(
            ("refused:", "cannot run")):
        return Unprocessable(message)
    if error.code == "command_error":
        return SessionConflict(message)
    if error.code == "server_unavailable" and "is full" in str(error):
        return TooManyRequests(message)
    return ServiceUnavailable(message)


def _camel_keys(result: dict[str, Any]) -> dict[str, Any]:
    return {re.sub(r"_([a-z])", lambda m: m.group(1).upper(), k): v
            for k, v in result.items() if k != "type"}


# ============================================================================================
# the session disks (an ext4 image per session, loop-mounted)
# ============================================================================================
#
# Theory of operation. Every byte a session can write on the host (its workspace; its agent's
# log, outbox, state, checkpoints and download spools) lies on a file system of its own: a
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


class SessionDiskError(ReployError):
    """A session's disk cannot be made, mounted or unmounted."""


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


def mounted_device(mount_point: Path, mountinfo: Optional[str] = None) -> Optional[str]:
    """The source of the file system mounted at exactly mount_point (the topmost one), from
    /proc/self/mountinfo; None when nothing is."""
    if mountinfo is None:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    device = None
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) > 4 and "-" in fields and _unescape_mountinfo(fields[4]) == str(mount_point):
            tail = fields[fields.index("-") + 1:]
            device = _unescape_mountinfo(tail[1]) if len(tail) > 1 else ""
    return device


def loop_backing_file(device: str) -> Optional[str]:
    """The file a loop device (/dev/loopN) is backed by, None for any other device."""
    match = re.fullmatch(r"/dev/(loop[0-9]+)", device)
    if match is None:
        return None
    try:
        return Path(f"/sys/block/{match.group(1)}/loop/backing_file").read_text().rstrip("\n")
    except OSError:
        return None


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
    """Unmounts mount_point if the image is mounted there (the loop device goes with it);
    SessionDiskError when it is busy."""
    with _locked_image(image):
        device = mounted_device(mount_point)
        if device is None:
            return
        if loop_backing_file(device) != str(image):
            raise SessionDiskError(f"{mount_point} has {device} mounted on it, not {image}")
        _run_disk_tool(["umount", str(mount_point)], f"unmount the session disk {mount_point}")


def make_session_disk(image: Path, mount_point: Path, size_mib: int, runtime: Runtime) -> None:
    """A new session's disk: a sparse image of size_mib, ext4 made on it, mounted, and laid out:
    the root root's and 0755, `agent/` root's and 0700, `workspace/` the runtime user's and 0700."""
    try:
        fd = os.open(image, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise SessionDiskError(f"cannot make the session's disk image {image}: {e.strerror}") from e
    try:
        os.ftruncate(fd, size_mib * 1024 * 1024)
    finally:
        os.close(fd)
    _run_disk_tool(["mkfs.ext4", "-q", "-F", "-L", "reploy-session", "-m", str(SESSION_DISK_RESERVED_PERCENT),
                    "-E", "lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0", str(image)],
                   f"make the file system of {image}")
    mount_session_disk(image, mount_point)
    os.chmod(mount_point, 0o755)
    (mount_point / "lost+found").rmdir()  # e2fsck makes it again if it ever needs one
    (mount_point / agent_role.AGENT_DIR_NAME).mkdir(mode=0o700)
    workspace = mount_point / "workspace"
    workspace.mkdir(mode=0o700)
    os.chown(workspace, runtime.uid, runtime.gid)


def remove_session_disk(image: Path, mount_point: Path) -> None:
    """Unmounts and removes a session's disk and its mount point; what is already gone is fine."""
    if os.path.lexists(image):
        unmount_session_disk(image, mount_point)
        image.unlink()
    with contextlib.suppress(FileNotFoundError):
        reploy_watchdog.remove_tree(mount_point)


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
    session_disk_mib: int = DEFAULT_SESSION_DISK_MIB

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

    def disk_image(self, session_id: str) -> Path:
        return self.disks_dir / f"{session_id}.img"

    @property
    def reap_interval_s(self) -> float:
        return max(0.2, min(self.idle_after_s / 4, 5.0))

    @property
    def reap_policy(self) -> ReapPolicy:
        return ReapPolicy(self.idle_after_s, self.snapshot_after_s, self.max_busy_s)


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


class SessionManager:
    """The control plane's orchestration: one container per session, the lifecycle under
    leases, recovery of what a dead `serve` left, and the reaper. The HTTP adapter and the
    tests call it; it never sees HTTP. The clock and the Docker backend are seams."""

    def __init__(self, config: ServeConfig, backend: DockerBackend,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.backend = backend
        self.clock = clock
        config.sessions_dir.mkdir(parents=True, exist_ok=True)
        config.disks_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(config.state_dir, 0o700)
        self.store = SessionStore(config.state_dir / "sessions.db")
        self.host = socket.gethostname()
        self.identity = reploy_watchdog.process_identity()
        self.stopping = threading.Event()

    # -- leases -----------------------------------------------------------------------------

    def _owner(self) -> str:
        return f"{self.host}/{self.identity}/{secrets.token_hex(4)}"

    def record(self, session_id: str) -> SessionRecord:
        record = self.store.get(session_id) if _SESSION_ID.fullmatch(session_id) else None
        if record is None:
            raise SessionNotFound(f"no session {session_id}")
        return record

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
        for container_id, _ in self._containers(session_id):
            if container_id != keep:
                self.backend.unpause(container_id)
                self.backend.remove_container(container_id)

    def _container_spec(self, record: SessionRecord, archive: Optional[str]) -> ContainerSpec:
        spec, config = record.spec, self.config
        command = ["python3", AGENT_MOUNT, "serve", "--session-dir", SESSION_MOUNT,
                   "--workload", spec.workload, "--home", CONTAINER_HOME,
                   "--runtime-user", spec.runtime.user]
        environment = {"HOME": CONTAINER_HOME, "LANG": "C.UTF-8"}
        if spec.workload == "agent":
            if config.agent_command:
                command += ["--agent-command", json.dumps(list(config.agent_command))]
            if spec.model:
                command += ["--model", spec.model]
            for name in config.agent_env:
                command += ["--redact-env", name]
                environment[name] = os.environ.get(name, "")
        if archive:
            command += ["--restore", f"{SESSION_MOUNT}/{agent_role.AGENT_DIR_NAME}/{archive}"]
        mounts = (Mount(str(AGENT_SOURCE), AGENT_MOUNT, read_only=True),
                  Mount(str(config.session_dir(record.id)), SESSION_MOUNT, read_only=False),
                  *config.extra_mounts)
        labels = {LABEL_RUN: record.id, LABEL_ROLE: MANAGED_ROLE,
                  LABEL_STATE_DIR: str(config.state_dir),
                  LABEL_DEPLOYMENT: spec.deployment_id, LABEL_GENERATION: str(spec.generation)}
        return ContainerSpec(role=MANAGED_ROLE, image_id=spec.image_id, command=tuple(command),
                             runtime=spec.runtime, environment=environment, labels=labels,
                             mounts=mounts, hostname="session", init=True, root_supervisor=True)

    def _mount_disk(self, session_id: str) -> None:
        try:
            mount_session_disk(self.config.disk_image(session_id), self.config.session_dir(session_id))
        except SessionDiskError as e:
            raise ServiceUnavailable(str(e)) from e

    def _launch(self, lease: Lease, archive: Optional[str]) -> None:
        """Create and start the session's container (its disk mounted first), record it, and
        wait for its agent."""
        self._mount_disk(lease.record.id)
        container_id = self.backend.create(self._container_spec(lease.record, archive))
        lease.update(container_id=container_id)
        self.backend.start(container_id)
        agent_dir = self.config.agent_dir(lease.record.id)
        deadline = time.monotonic() + AGENT_READY_TIMEOUT_S
        next_check = time.monotonic()
        while True:
            try:
                agent_call(agent_dir, "status", {}, timeout_s=AGENT_CALL_TIMEOUT_S)
                return
            except AgentCallError as e:
                if not e.transport:
                    raise ServiceUnavailable(f"the session agent refused to start: {e}") from e
            now = time.monotonic()
            if now >= next_check:
                lease.renew()
                state = self.backend.container_state(container_id)
                if state is None or state.get("Status") == "exited":
                    tail = self.backend.log_tail(container_id).decode(errors="replace").strip()
                    raise ServiceUnavailable(
                        "the session container exited before its agent answered (the image "
                        f"needs python3): {tail[-2000:] or 'no output'}")
                next_check = now + 0.5
            if now >= deadline:
                raise ServiceUnavailable(f"the session agent did not answer within "
                                         f"{AGENT_READY_TIMEOUT_S:.0f} s")
            self.stopping.wait(AGENT_READY_POLL_S)

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
            raise Unprocessable(f"deployment: {name!r} is not served here "
                                f"({', '.join(d.blueprint.name for d in found)})")
        if chosen.current is None:
            raise ServiceUnavailable(f"the deployment {chosen.blueprint.name} is not built")
        if chosen.has_private_env:
            raise ServiceUnavailable(f"the deployment {chosen.blueprint.name} configures a "
                                     "private environment; managed sessions do not support it")
        if chosen.blueprint.runtime.uid == 0:
            raise ServiceUnavailable(f"the deployment {chosen.blueprint.name} runs as root "
                                     "(environment.runtime.user 0:...); a managed session's "
                                     "workload runs as a non-root user")
        return chosen

    def deployment_names(self) -> list[str]:
        names = []
        for directory in self.config.workload_dirs:
            with contextlib.suppress(ReployError):
                names.append(load_deployment(directory).blueprint.name)
        return names

    # -- the lifecycle ----------------------------------------------------------------------

    def create(self, name: str, workload: str, model: Optional[str],
               deployment_name: Optional[str]) -> SessionRecord:
        if workload == "shell" and model is not None:
            raise Unprocessable("model: only agent sessions have a model")
        if self.store.count() >= self.config.max_sessions:
            raise TooManyRequests(f"this server holds at most {self.config.max_sessions} sessions")
        self._require_free_space()
        deployment = self._deployment(deployment_name)
        assert deployment.current is not None
        if not self.backend.image_exists(deployment.current.image_id):
            raise ServiceUnavailable(f"the image of {deployment.blueprint.name} is gone")
        spec = SessionSpec(
            workload=workload,
            model=(model or self.config.default_model) if workload == "agent" else None,
            deployment=deployment.blueprint.name, deployment_id=deployment.deployment_id,
            image_id=deployment.current.image_id, generation=deployment.current.number,
            runtime=deployment.blueprint.runtime)
        now, owner = self.clock(), self._owner()
        record = SessionRecord(id=secrets.token_hex(8), name=name, spec=spec,
                               state=SessionState.CREATING, version=1, created_at=now,
                               last_access=now, state_since=now, lease_owner=owner,
                               lease_expires=now + LEASE_TTL_S)
        self.store.insert(record)  # first, so a crash leaves a record that recovery rolls back
        lease = Lease(self, record, owner)
        try:
            make_session_disk(self.config.disk_image(record.id), self.config.session_dir(record.id),
                              self.config.session_disk_mib, spec.runtime)
            self._launch(lease, archive=None)
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
        seen here without a record has none."""
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
            if record.state is SessionState.DELETING:
                continue
            try:
                self._mount_disk(record.id)
            except ServeError as e:
                log(f"serve: session {record.id}: {e}")

    def delete(self, session_id: str) -> None:
        with self.leased(session_id) as lease:
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
            failure = (SessionConflict("the session is busy (work did not drain within the "
                                       "agent's bound); interrupt it and retry")
                       if e.code == "timeout" else serve_error_for(e))
        except BackendError as e:
            failure = ServiceUnavailable(str(e))
        except ServeError as e:  # the archive is refused
            failure = e
        if failure is not None:
            with contextlib.suppress(ServeError):  # written after all (the agent timed out late)
                archive_bytes = self._archive_bytes(record)
        if archive_bytes is None:
            lease.apply(SessionEvent.ROLLBACK, archive=None)
            raise failure or ServiceUnavailable("the session's container is gone; nothing to snapshot")
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
                           snapshot_bytes=archive_bytes)

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
        archive = lease.record.archive
        lease.apply(SessionEvent.RESTORE)
        try:
            self._remove_containers(lease.record.id)
            self._launch(lease, archive=archive)
        except BaseException:
            with contextlib.suppress(ReployError):  # else recovery finishes the undo
                self._remove_containers(lease.record.id)
                lease.apply(SessionEvent.ROLLBACK, container_id=None)
            raise
        record = lease.apply(SessionEvent.STARTED, archive=None, snapshot_bytes=None,
                             last_access=self.clock(), busy_at=None, idle_blocked_by=())
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
        """An access (read, write, message, switch, ...): an idle session is resumed and a
        snapshot restored, then last access is recorded."""
        while True:
            if _SESSION_ID.fullmatch(session_id) and self.store.touch(session_id, self.clock()):
                return self.record(session_id)
            with self.leased(session_id) as lease:
                if lease.record.state is SessionState.IDLE:
                    return self._resume(lease)
                if lease.record.state is SessionState.SNAPSHOT:
                    return self._restore(lease)
                if lease.record.state is SessionState.ACTIVE:
                    return lease.update(last_access=self.clock())

    def call(self, session_id: str, method: str, params: dict[str, Any],
             workloads: tuple[str, ...] = ("shell", "agent")) -> dict[str, Any]:
        """An access, then one agent request."""
        record = self.record(session_id)
        if record.spec.workload not in workloads:
            raise Unprocessable(f"{method} is for {' and '.join(workloads)} sessions")
        self.access(session_id)
        agent_dir = self.config.agent_dir(session_id)
        try:
            return agent_call(agent_dir, method, params)
        except AgentCallError as e:
            if not (e.transport and self._relaunch_if_lost(session_id)):
                raise serve_error_for(e) from e
        try:
            return agent_call(agent_dir, method, params)
        except AgentCallError as e:
            raise serve_error_for(e) from e

    def write(self, session_id: str, data: bytes) -> dict[str, Any]:
        """A shell's raw keystrokes; for an agent session (seed 002) the bytes are one prompt,
        UTF-8, answered exactly as `message` answers it."""
        if self.record(session_id).spec.workload == "agent":
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                raise Unprocessable("dataBase64: an agent session's prompt must be UTF-8") from None
            return self.message(session_id, text)
        if len(data) > MAX_WRITE_BYTES:
            raise PayloadTooLarge(f"dataBase64: a shell write is at most {MAX_WRITE_BYTES} bytes")
        return self.call(session_id, "write", {"data_b64": base64.b64encode(data).decode()})

    def message(self, session_id: str, text: str) -> dict[str, Any]:
        """One message (an agent's prompt, a shell's line), sent as the agent's draft in parts
        when one request line cannot hold it."""
        *leading, last = message_parts(text)
        draft: dict[str, str] = {}
        for part in leading:
            draft = {"draft": self.call(session_id, "message", {"text": part, "more": True, **draft})["draft"]}
        return self.call(session_id, "message", {"text": last, **draft})

    # -- the harness verbs: exec and files, each an access at every step ---------------------

    def exec(self, session_id: str, params: dict[str, Any],
             client_gone: Callable[[], bool]) -> dict[str, Any]:
        """Runs one command in the session's container and waits for its result. The agent
        answers within 5 s, so the wait is a chain of long-polls; between them a client that
        went away, or serve stopping, kills the command's whole process group."""
        exec_id = self.call(session_id, "exec", params)["exec_id"]
        output: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        try:
            while True:
                if client_gone() or self.stopping.is_set():
                    raise ServiceUnavailable("the client went away or serve is stopping; the "
                                             "command was killed")
                page = self.call(session_id, "exec_wait", {
                    "exec_id": exec_id, "wait_ms": EXEC_POLL_MS, "release": True,
                    "stdout_offset": len(output["stdout"]), "stderr_offset": len(output["stderr"])})
                for name, data in output.items():
                    data += base64.b64decode(page[f"{name}_b64"])
                    if len(data) > params["output_cap_bytes"]:  # a hostile agent's, unbounded
                        raise ServiceUnavailable("the session agent sent more output than the cap")
                if not page["running"] and all(len(data) == page[f"{name}_bytes"]
                                               for name, data in output.items()):
                    return exec_result_json(page, bytes(output["stdout"]), bytes(output["stderr"]))
        except BaseException:
            with contextlib.suppress(AgentCallError):
                agent_call(self.config.agent_dir(session_id), "exec_kill", {"exec_id": exec_id})
            raise

    def stat_file(self, session_id: str, root: str, path: str) -> dict[str, Any]:
        return self.call(session_id, "stat", {"root": root, "path": path})["entry"]

    def list_files(self, session_id: str, root: str, path: str) -> dict[str, Any]:
        """A path's entry and, for a directory, its entries (at most MAX_LIST_ENTRIES)."""
        entry = self.stat_file(session_id, root, path)
        entries: Optional[list[dict[str, Any]]] = None
        truncated = False
        if entry["type"] == "directory":
            entries = []
            listed_bytes = 0
            while True:
                page = self.call(session_id, "list", {"root": root, "path": path,
                                                      "offset": len(entries)})
                entries += page["entries"]
                listed_bytes += len(wire.encode_compact(page["entries"]))
                if listed_bytes > MAX_LIST_JSON_BYTES:  # only a hostile agent's pages grow so
                    raise ServiceUnavailable("the session agent's listing is too large")
                if not page["entries"] or len(entries) >= min(page["total"], MAX_LIST_ENTRIES):
                    break
            truncated = len(entries) < page["total"]
            entries = entries[:MAX_LIST_ENTRIES]
        return {"root": root, "path": path, "entry": entry, "entries": entries,
                "truncated": truncated}

    def upload(self, session_id: str, root: str, path: str, kind: str, mode: Optional[int],
               size_bytes: int, source: Any) -> dict[str, Any]:
        """Streams size_bytes from `source` into the session: staged by the agent chunk by
        chunk (never the whole body in memory here), then committed with its sha256. A refused
        or broken upload is closed and leaves nothing behind. One chunk is in flight while the
        next is read and encoded."""
        free = shutil.disk_usage(self.config.state_dir).free
        if free - size_bytes < self.config.min_free_bytes:
            raise InsufficientStorage(f"not enough space: {free // (1024 * 1024)} MiB free under "
                                      "the state dir")
        params: dict[str, Any] = {"root": root, "path": path, "kind": kind, "size": size_bytes}
        if mode is not None:
            params["mode"] = mode
        transfer_id = self.call(session_id, "upload", params)["transfer_id"]
        digest = hashlib.sha256()
        sent = 0
        try:
            with concurrent.futures.ThreadPoolExecutor(1, "upload") as sender:
                in_flight: Optional[concurrent.futures.Future[dict[str, Any]]] = None
                while sent < size_bytes:
                    chunk = source.read(min(TRANSFER_CHUNK_BYTES, size_bytes - sent))
                    if not chunk:
                        raise BadRequest(f"the body ended after {sent} of {size_bytes} bytes")
                    digest.update(chunk)
                    params = {"transfer_id": transfer_id, "offset": sent,
                              "data_b64": base64.b64encode(chunk).decode("ascii")}
                    if in_flight is not None:
                        in_flight.result()  # in order: the agent takes chunks at its length
                    in_flight = sender.submit(self.call, session_id, "upload_write", params)
                    sent += len(chunk)
                if in_flight is not None:
                    in_flight.result()
            while True:
                result = self.call(session_id, "upload_commit", {"transfer_id": transfer_id,
                                                                 "sha256": digest.hexdigest()})
                if result["done"]:
                    return _camel_keys(result)
        except BaseException:
            with contextlib.suppress(AgentCallError):
                agent_call(self.config.agent_dir(session_id), "transfer_close",
                           {"transfer_id": transfer_id})
            raise

    def download(self, session_id: str, root: str,
                 path: str) -> tuple[dict[str, Any], Generator[bytes, None, None]]:
        """Opens a file (or a directory, as a tar) for reading: its description, and its bytes
        chunk by chunk as the agent serves them."""
        opened = self.call(session_id, "download", {"root": root, "path": path})
        transfer_id = opened["transfer_id"]

        def read(offset: int) -> dict[str, Any]:
            return self.call(session_id, "download_read",
                             {"transfer_id": transfer_id, "offset": offset})

        def chunks() -> Generator[bytes, None, None]:
            """One read ahead: the next chunk is asked for while this one is sent."""
            try:
                with concurrent.futures.ThreadPoolExecutor(1, "download") as reader:
                    ahead = reader.submit(read, 0)
                    while True:
                        page = ahead.result()
                        if not page["eof"]:
                            ahead = reader.submit(read, page["next_offset"])
                        yield base64.b64decode(page["data_b64"])
                        if page["eof"]:
                            return
            finally:
                with contextlib.suppress(AgentCallError):
                    agent_call(self.config.agent_dir(session_id), "transfer_close",
                               {"transfer_id": transfer_id})

        return opened, chunks()

    def status(self, session_id: str) -> dict[str, Any]:
        """Passive: asks an active session's agent, never resumes or restores one."""
        record = self.record(session_id)
        agent_status = None
        if record.state is SessionState.ACTIVE:
            with contextlib.suppress(AgentCallError):
                agent_status = _camel_keys(agent_call(
                    self.config.agent_dir(session_id), "status", {}))
        return {"session": self.session_json(record), "agent": agent_status}

    def session_json(self, record: SessionRecord) -> dict[str, Any]:
        return session_json(record, self.config.idle_after_s, self.config.snapshot_after_s)

    def follow_output(self, record: SessionRecord, cursor: int, send: Callable[[bytes], None],
                      connected: Callable[[], bool] = lambda: True) -> None:
        """The SSE stream: tail the session's output log from `cursor` until the client goes,
        the session is deleted, or the cursor is ahead (reset). Passive: it reads the log file
        in the session dir, so it never resumes, restores or touches the session. While it is
        open the store holds a viewer row for it, which keeps the reaper away (decide_reap)."""
        viewer = secrets.token_hex(8)
        self.store.hold_viewer(viewer, record.id, self.clock())
        try:
            self._tail_output(record, cursor, send, connected, viewer)
        finally:
            self.store.drop_viewer(viewer)

    def _tail_output(self, record: SessionRecord, cursor: int, send: Callable[[bytes], None],
                     connected: Callable[[], bool], viewer: str) -> None:
        agent_dir = self.config.agent_dir(record.id)
        text = record.spec.workload == "agent"
        last_sent = renewed = time.monotonic()
        refused = woke = False
        while not self.stopping.is_set() and connected():
            if time.monotonic() - renewed >= VIEWER_RENEW_S:
                self.store.hold_viewer(viewer, record.id, self.clock())
                renewed = time.monotonic()
            try:
                length, data = self._read_output_log(agent_dir, cursor)
            except FileNotFoundError:
                if self.session_is_going(record.id):
                    return  # deleted: the log goes before its directory, so no reset for it
                length, data = 0, b""
            except OSError as e:  # the session put something else there: no bytes from it
                if not refused:
                    log(f"serve: session {record.id}: its output stream waits: {e}")
                refused = True
                length, data = cursor, b""
            if cursor > length:
                send(sse_reset(length))
                return
            if text:  # every cursor we issue for agent text is a code-point boundary
                data = utf8_complete_prefix(data)
            if data:
                send(sse_output(cursor, data))
                cursor += len(data)
                last_sent = time.monotonic()
                woke = False
                continue
            if time.monotonic() - last_sent >= self.config.sse_keepalive_s:
                send(SSE_KEEPALIVE)
                last_sent = time.monotonic()
            # A wake-up that brought no bytes (an agent answering at once) must not spin us.
            if woke:
                self.stopping.wait(SSE_POLL_S)
            woke = self.await_agent_output(agent_dir, cursor)
            if not woke:
                self.stopping.wait(SSE_POLL_S)

    def session_is_going(self, session_id: str) -> bool:
        """Deleted, or being deleted: a stream of it ends instead of resetting."""
        record = self.store.get(session_id)
        return record is None or record.state is SessionState.DELETING

    @staticmethod
    def _read_output_log(agent_dir: Path, cursor: int) -> tuple[int, bytes]:
        """(length, at most SSE_CHUNK_BYTES from `cursor`) of the agent's output.log, read only as
        the regular file it must be (see "Directories a container can write")."""
        with opened_dir(agent_dir) as dir_fd:
            fd = open_regular_file(dir_fd, OUTPUT_LOG_NAME)
        try:
            length = os.fstat(fd).st_size
            return length, os.pread(fd, min(max(length - cursor, 0), SSE_CHUNK_BYTES), cursor)
        finally:
            os.close(fd)

    @staticmethod
    def await_agent_output(agent_dir: Path, cursor: int) -> bool:
        """Sleep until the agent has bytes past `cursor` (or a second passed), so a stream
        learns of output at once instead of at its next file poll. The agent's `read` changes
        nothing, so the stream stays passive. False when no agent answers (a paused or
        snapshotted session): the caller falls back to polling the file."""
        try:
            agent_call(agent_dir, "read",
                       {"offset": cursor, "max_bytes": MIN_READ_BYTES, "wait_ms": SSE_LONG_POLL_MS},
                       timeout_s=SSE_LONG_POLL_MS / 1000 + 1.0)
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
        self.store.close()


# ============================================================================================
# the HTTP adapter (REST, SSE, the web UI's files)
# ============================================================================================

#: (method, path template under /api/v1, handler). web/openapi.json documents exactly these.
API_ROUTES: tuple[tuple[str, str, str], ...] = (
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
#: Routes whose last part is a path in the session's workspace (or home), slashes included.
FILE_ROUTE_PARTS = ("files", "list")
STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8", ".json": "application/json",
                ".svg": "image/svg+xml", "": "text/plain; charset=utf-8"}
CONTENT_SECURITY_POLICY = ("default-src 'self'; style-src 'self' 'unsafe-inline'; "
                           "img-src 'self' data:; object-src 'none'; frame-ancestors 'none'")


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


class ServeHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], manager: SessionManager,
                 static: dict[str, tuple[str, bytes]], token: str,
                 hosts: frozenset[str]) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, ApiHandler)
        self.manager = manager
        self.static = static
        self.policy = AccessPolicy.for_server(token, self.server_address[1], hosts)


class ApiHandler(http.server.BaseHTTPRequestHandler):
    """Thin: decide access (decide_access, before anything else), parse, call the
    SessionManager, encode. Every failure is {"error": "..."}; no response ever carries a CORS
    header."""

    server: ServeHTTPServer
    protocol_version = "HTTP/1.1"
    server_version = "reploy"
    timeout = BODY_READ_TIMEOUT_S  # a client that stalls mid-request is dropped

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
        self.send_json(code, {"error": message or http.HTTPStatus(code).phrase},
                       {"Connection": "close"})

    def end_headers(self) -> None:
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("X-Content-Type-Options", "nosniff")
        super().end_headers()

    @property
    def manager(self) -> SessionManager:
        return self.server.manager

    def dispatch(self, method: str) -> None:
        path, _, query = self.path.partition("?")
        try:
            try:
                access = decide_access(method, self.path, self.headers.items(), self.server.policy)
            except ServeError:
                self.close_connection = True  # its body, if any, is never read
                raise
            if access is Access.LOGIN:
                self.send_login()
                return
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
            self.send_json(e.status, {"error": str(e)}, e.response_headers())
        except BackendError as e:
            self.send_json(503, {"error": str(e)})
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - a bug answers 500 and keeps the server up
            log(f"serve: internal error on {method} {path}: {e!r}")
            self.send_json(500, {"error": "internal error"})

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
        return length

    def read_body(self) -> bytes:
        length = self.body_length(MAX_BODY_BYTES)
        return self.rfile.read(length) if length else b""

    def send_json(self, status: int, document: dict[str, Any],
                  headers: Optional[dict[str, str]] = None) -> None:
        data = wire.encode_compact(document)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":  # a HEAD answer is the headers alone
            self.wfile.write(data)

    def send_login(self) -> None:
        """The login path's answer: the cookie, and a redirect to a URL without the token
        (no-store and no-referrer keep the token out of caches and Referer headers)."""
        policy = self.server.policy
        self.send_response(303)
        self.send_header("Location", "/")
        self.send_header("Set-Cookie", f"{policy.cookie_name}={policy.cookie_value}; "
                                       "HttpOnly; SameSite=Strict; Path=/")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def serve_static(self, method: str, path: str) -> None:
        if path == "/api/v1/openapi.json":
            path = "/openapi.json"
        entry = self.server.static.get(path)
        if entry is None or method != "GET":
            self.send_json(404, {"error": f"not found: {path}"})
            return
        content_type, data = entry
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        self.end_headers()
        self.wfile.write(data)

    # -- API handlers: (session id, raw body, query) -> (status, document) -----------------

    def api_get_config(self, _sid: None, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        parse_body(body, BODY_RULES["empty"])
        config = self.manager.config
        models = {"defaultModel": config.default_model or PLATFORM_DEFAULT_MODEL,
                  "models": list(config.models)}
        return 200, {"workloads": ["shell", "agent"],
                     "deployments": self.manager.deployment_names(),
                     "agent": models, "claudeCode": models,  # seed 002 reads claudeCode
                     "idleAfterSeconds": config.idle_after_s,
                     "snapshotAfterSeconds": config.snapshot_after_s,
                     "maxBusySeconds": config.max_busy_s,
                     "limits": {"maxBodyBytes": MAX_BODY_BYTES,
                                "maxPayloadBytes": MAX_PAYLOAD_BYTES,
                                "maxReadBytes": MAX_READ_BYTES}}

    def api_create_session(self, _sid: None, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        fields = parse_body(body, BODY_RULES["create"])
        record = self.manager.create(fields["name"], fields["workload"], fields.get("model"),
                                     fields.get("deployment"))
        return 201, self.manager.session_json(record)

    def api_list_sessions(self, _sid: None, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        return 200, {"sessions": [self.manager.session_json(r) for r in self.manager.store.list()],
                     "now": self.manager.clock()}

    def api_get_session(self, sid: str, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        return 200, self.manager.session_json(self.manager.record(sid))

    def api_delete_session(self, sid: str, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        self.manager.delete(sid)
        return 200, {"id": sid, "deleted": True}

    def api_switch(self, sid: str, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        parse_body(body, BODY_RULES["empty"])
        return 200, self.manager.session_json(self.manager.access(sid))

    def api_snapshot(self, sid: str, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        parse_body(body, BODY_RULES["empty"])
        return 200, self.manager.session_json(self.manager.snapshot(sid))

    def api_read(self, sid: str, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        fields = parse_body(body, BODY_RULES["read"])
        result = self.manager.call(sid, "read", {
            "offset": fields.get("offset", 0), "max_bytes": fields.get("maxBytes", DEFAULT_READ_BYTES),
            "wait_ms": fields.get("waitMs", 0)})
        if "text" in result:
            payload = result["text"].encode()
        else:
            payload = base64.b64decode(result["data_b64"])
        document = {"offset": result["offset"], "nextOffset": result["next_offset"],
                    "length": result["length"], "reset": result["reset"],
                    "payloadBase64": base64.b64encode(payload).decode("ascii")}
        if "text" in result:
            document["text"] = result["text"]
        return 200, document

    def api_write(self, sid: str, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        fields = parse_body(body, BODY_RULES["write"])
        data = decode_payload(fields["dataBase64"], "dataBase64", MAX_PAYLOAD_BYTES)
        return 200, _camel_keys(self.manager.write(sid, data))

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

    def api_exec(self, sid: str, body: bytes, _query: str) -> tuple[int, dict[str, Any]]:
        params = exec_params(parse_body(body, BODY_RULES["exec"]))
        return 200, self.manager.exec(sid, params, self.client_gone)

    def api_list_files(self, sid: str, body: bytes, query: str) -> tuple[int, dict[str, Any]]:
        parse_body(body, BODY_RULES["empty"])
        root, mode = file_query(query)
        if mode is not None:
            raise BadRequest("mode: only for uploads")
        return 200, self.manager.list_files(sid, root, file_route_path(self.api_path))

    def api_put_file(self, sid: str, _body: bytes, query: str) -> tuple[int, dict[str, Any]]:
        """Raw bytes streamed in: application/octet-stream makes one file, application/x-tar is
        extracted into the directory at the path (made if missing, merged if not)."""
        root, mode = file_query(query)
        content_type = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if content_type not in RAW_BODY_ROUTES["put_file"]:
            self.close_connection = True
            raise UnsupportedMediaType(f"Content-Type must be one of "
                                       f"{', '.join(RAW_BODY_ROUTES['put_file'])}")
        size_bytes = self.body_length(MAX_UPLOAD_BYTES)
        kind = "tar" if content_type == "application/x-tar" else "file"
        try:
            result = self.manager.upload(sid, root, file_route_path(self.api_path), kind, mode,
                                         size_bytes, self.rfile)
        except BaseException:
            self.close_connection = True  # the rest of the body may still be on its way
            raise
        return 201, result

    def api_get_file(self, sid: str, body: bytes, query: str) -> None:
        """A file's bytes, or a directory as a tar (its entries relative to it), streamed."""
        parse_body(body, BODY_RULES["empty"])
        root, mode = file_query(query)
        if mode is not None:
            raise BadRequest("mode: only for uploads")
        path = file_route_path(self.api_path)
        opened, chunks = self.manager.download(sid, root, path)
        name = (path.rstrip("/").rpartition("/")[2] or root) + (".tar" if opened["kind"] == "tar" else "")
        self.send_response(200)
        self.send_header("Content-Type", "application/x-tar" if opened["kind"] == "tar"
                         else "application/octet-stream")
        if opened["size"] is not None:
            self.send_header("Content-Length", str(opened["size"]))
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.send_header("Content-Disposition",
                         f"attachment; filename*=UTF-8''{urllib.parse.quote(name)}")
        self.send_header("Cache-Control", "no-store")
        self.end_headers()  # adds nosniff, as on every answer
        try:
            for chunk in chunks:
                self.wfile.write(chunk)
        except (ReployError, OSError) as e:  # the headers are out: end the body short instead
            log(f"serve: download of {path!r} from session {sid} ended early: {e}")
            self.close_connection = True
        finally:
            chunks.close()  # the agent's transfer is closed now, not when this is collected

    def api_stream(self, sid: str, body: bytes, query: str) -> None:
        params = urllib.parse.parse_qs(query)
        cursor = sse_cursor(self.headers.get("Last-Event-ID"), (params.get("offset") or [None])[-1])
        record = self.manager.record(sid)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Connection", "close")
        self.send_header("X-Accel-Buffering", "no")
        self.end_headers()
        self.close_connection = True

        def send(data: bytes) -> None:
            self.wfile.write(data)
            self.wfile.flush()

        def connected() -> bool:  # a client that went away shows as readable at end of file
            readable, _, _ = select.select([self.connection], [], [], 0)
            return not readable or self.connection.recv(1, socket.MSG_PEEK) != b""

        send(b"retry: 1000\n\n")
        self.manager.follow_output(record, cursor, send, connected)


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
    return ServeAccess(host, int(port), tuple(names), token_file.absolute())


def read_token(path: Path, must_own: bool = False) -> str:
    """The token a token file holds (one line). CredentialError when the file cannot be read,
    is open to other users, belongs to another user (`must_own`: serve's own secret, which
    another user could otherwise plant where --token-file points), or holds anything else;
    the message never quotes the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise CredentialError(f"cannot read the token file {path}: {e.strerror}") from None
    try:
        facts = os.fstat(fd)
        mode = facts.st_mode
        if not stat.S_ISREG(mode):
            raise CredentialError(f"the token file {path} is not a regular file")
        if must_own and facts.st_uid != os.geteuid():
            raise CredentialError(f"the token file {path} belongs to uid {facts.st_uid}, not to "
                                  "this user")
        if mode & 0o077:
            raise CredentialError(f"the token file {path} is open to other users "
                                  f"(mode {stat.S_IMODE(mode):04o}); chmod 600 it")
        text = os.read(fd, MAX_TOKEN_FILE_BYTES + 1).decode("ascii", "replace")
    finally:
        os.close(fd)
    if not _TOKEN.fullmatch(text.rstrip("\n")):
        raise CredentialError(f"the token file {path} does not hold one token (32 to 512 of "
                              "A-Z a-z 0-9 . _ ~ + / = -, on one line)")
    return text.rstrip("\n")


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


def serve_config_from(args: argparse.Namespace) -> ServeConfig:
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
    state_dir = args.state_dir.absolute()
    return ServeConfig(
        state_dir=state_dir, workload_dirs=tuple(d.absolute() for d in args.workload_dir),
        idle_after_s=durations["idle_after"], snapshot_after_s=durations["snapshot_after"],
        max_busy_s=durations["max_busy"],
        agent_command=command, agent_env=tuple(args.agent_env), extra_mounts=tuple(mounts),
        default_model=args.default_model, models=models,
        sse_keepalive_s=durations["sse_keepalive"], max_sessions=args.max_sessions,
        min_free_bytes=args.min_free_mib * 1024 * 1024, session_disk_mib=args.session_disk_mib)


def run_serve(config: ServeConfig, access: ServeAccess) -> int:
    """`reploy serve`: API and UI on one port until SIGTERM or SIGINT. Sessions outlive it.
    The start line carries the token and the browser's login_url; stderr never does."""
    try:
        config.state_dir.mkdir(parents=True, exist_ok=True)
        token = load_or_create_token(access.token_file)
        hosts = allowed_hosts(access.host, () if is_loopback_listen(access.host)
                              else machine_names(), access.allow_hosts)
        backend = DockerBackend()
        backend.require_sandbox_support()
        manager = SessionManager(config, backend)
        probe_session_disks(config.disks_dir)
        manager.mount_disks()
        manager.reconcile()
        server = ServeHTTPServer((access.host, access.port), manager, load_static(WEB_DIR),
                                 token, hosts)
    except (ReployError, OSError) as e:
        print(f"reploy: serve: {e}", file=sys.stderr)
        emit({"schema": SERVE_SCHEMA, "ok": False, "error": str(e)})
        return EXIT_FAILED
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    bound_host, bound_port = server.server_address[:2]
    bound_host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(bound_host, bound_host)  # wildcards
    authority = f"[{bound_host}]" if ":" in bound_host else bound_host
    url = f"http://{authority}:{bound_port}"
    emit({"schema": SERVE_SCHEMA, "ok": True, "error": None, "url": url,
          "login_url": f"{url}{LOGIN_PATH}?token={urllib.parse.quote(token, safe='')}",
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


def client_request(args: argparse.Namespace) -> tuple[str, str, Optional[dict[str, Any]]]:
    """(method, path under /api/v1, body) for one `reploy session` action. Pure."""
    action, sid = args.session_action, getattr(args, "id", None)
    if action == "create":
        body: dict[str, Any] = {"name": args.name, "workload": args.workload}
        for key in ("model", "deployment"):
            if getattr(args, key) is not None:
                body[key] = getattr(args, key)
        return "POST", "/sessions", body
    if action == "list":
        return "GET", "/sessions", None
    if action in ("get", "delete"):
        return ("GET" if action == "get" else "DELETE"), f"/sessions/{sid}", None
    if action == "status":
        return "GET", f"/sessions/{sid}/status", None
    if action == "read":
        body = {"offset": args.offset, "maxBytes": args.max_bytes, "waitMs": args.wait_ms}
        return "POST", f"/sessions/{sid}/read", body
    if action == "write":
        data = sys.stdin.buffer.read() if args.data == "-" else args.data.encode()
        return "POST", f"/sessions/{sid}/write", {"dataBase64": base64.b64encode(data).decode()}
    if action == "message":
        return "POST", f"/sessions/{sid}/message", {"text": message_text(args.text)}
    if action == "exec":
        return "POST", f"/sessions/{sid}/exec", args.exec_body
    return "POST", f"/sessions/{sid}/{action}", {}


def message_text(argument: str) -> str:
    """The text of `session message`: the argument, or for `-` stdin (Linux bounds one argument
    below 128 KiB; a message may be 1 MiB)."""
    if argument != "-":
        return argument
    try:
        return sys.stdin.buffer.read().decode("utf-8").removesuffix("\n")
    except UnicodeDecodeError as e:
        raise UsageError(f"session message: stdin is not UTF-8 ({e.reason} at byte {e.start})") from None


def session_token(args: argparse.Namespace) -> Optional[str]:
    """The token `reploy session` sends: --token-file's, else $REPLOY_TOKEN, else none.
    UsageError when the one named is not a token."""
    try:
        if args.token_file is not None:
            return read_token(args.token_file)
    except CredentialError as e:
        raise UsageError(str(e)) from None
    text = os.environ.get("REPLOY_TOKEN")
    if text is not None and not _TOKEN.fullmatch(text):
        raise UsageError("$REPLOY_TOKEN does not hold a token (e.g. export "
                         "REPLOY_TOKEN=$(cat STATE_DIR/token))")
    return text


def exec_request_body(args: argparse.Namespace, command: list[str]) -> dict[str, Any]:
    """`session exec`'s options and command as the API's exec body (UsageError when they do
    not fit); with --stdin, this process's stdin becomes the command's."""
    if not command:
        raise UsageError("session exec: the command follows --")
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
    if args.stdin:
        data = sys.stdin.buffer.read(MAX_EXEC_STDIN_BYTES + 1)
        if len(data) > MAX_EXEC_STDIN_BYTES:
            raise UsageError(f"--stdin: more than {MAX_EXEC_STDIN_BYTES} bytes; upload a file and "
                             "redirect from it instead")
        body["stdinBase64"] = base64.b64encode(data).decode("ascii")
    return body


def raw_exec_exit_code(result: dict[str, Any]) -> int:
    """`session exec --raw`'s exit code, as a shell reports a command: its exit code, 128+N
    after signal N, 124 after the timeout (as timeout(1))."""
    if result["timedOut"]:
        return 124
    if result["exitCode"] is not None:
        return int(result["exitCode"])
    try:
        return 128 + signal.Signals[result["signal"]].value
    except KeyError:
        return 128


_COPY_OPERAND = re.compile(rf"({_SESSION_ID.pattern}):(.*)", re.DOTALL)


def parse_copy_operand(text: str) -> tuple[Optional[str], str, str]:
    """(session id, root, path) for `ID:PATH` (`ID:~/PATH` names home); (None, "", text) for a
    local path or `-`. Pure. Prefix a local name that looks like ID:PATH with ./"""
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


class ApiClient:
    """`reploy session`'s HTTP: the token as Bearer on every call, errors as ApiCallError with
    the server's {"error"} document and status (None when nothing answered)."""

    def __init__(self, server: Optional[str], token: Optional[str]) -> None:
        self.server = server or os.environ.get("REPLOY_SERVER") or f"http://{DEFAULT_LISTEN}"
        self.token = token

    def open(self, method: str, path: str, data: Any = None, headers: Optional[dict[str, str]] = None,
             timeout_s: float = 120) -> Any:
        import urllib.error
        import urllib.request

        headers = dict(headers or {})
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.server.rstrip("/") + API_PREFIX + path, data=data,
                                         method=method, headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=timeout_s)
        except urllib.error.HTTPError as e:
            try:
                document = json.loads(e.read())
            except ValueError:
                document = {"error": e.reason}
            if e.code == 401 and self.token is None:
                document["error"] = (f"{document.get('error')} "
                                     "(this client sends $REPLOY_TOKEN or --token-file)")
            raise ApiCallError({**document, "status": e.code}) from None
        except (urllib.error.URLError, OSError) as e:
            raise ApiCallError({"error": f"no answer from {self.server}: "
                                         f"{getattr(e, 'reason', e)}", "status": None}) from None

    def upload(self, path: str, source: Any, headers: dict[str, str], timeout_s: float) -> dict[str, Any]:
        """PUT a streamed body and return the JSON answer. Unlike urlopen, it still reads an
        answer the server sent before taking the whole body (a 507 or 413 checked up front)."""
        import http.client

        url = urllib.parse.urlsplit(self.server.rstrip("/") + API_PREFIX + path)
        connection_type = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        connection = connection_type(url.hostname, url.port, timeout=timeout_s,
                                     blocksize=TRANSFER_CHUNK_BYTES)
        if self.token is not None:
            headers = {**headers, "Authorization": f"Bearer {self.token}"}
        try:
            try:
                connection.request("PUT", url.path + (f"?{url.query}" if url.query else ""), source, headers)
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused before the whole body was sent: its answer is waiting
            response = connection.getresponse()
            status, raw = response.status, response.read()
        except (OSError, http.client.HTTPException) as e:
            raise ApiCallError({"error": f"no answer from {self.server}: {e}", "status": None}) from None
        finally:
            connection.close()
        try:
            document = json.loads(raw)
        except ValueError:
            document = {"error": f"HTTP {status}"}
        if status >= 400:
            raise ApiCallError({**document, "status": status})
        return document

    def json(self, method: str, path: str, body: Optional[dict[str, Any]] = None,
             timeout_s: float = 120) -> dict[str, Any]:
        data = wire.encode_compact(body) if body is not None else None
        with self.open(method, path, data, {"Content-Type": "application/json"}, timeout_s) as response:
            return json.loads(response.read())


class ApiCallError(ReployError):
    def __init__(self, document: dict[str, Any]) -> None:
        super().__init__(document["error"])
        self.document = document


def run_session_client(args: argparse.Namespace, token: Optional[str]) -> int:
    """`reploy session ACTION`: one API call, its JSON document on stdout; exit 1 on an error
    status (the document then carries `error` and `status`). `exec --raw` instead passes the
    command's output through and exits with its code; `cp` copies files (to `-`, stdout
    carries only the data and an error goes to stderr)."""
    client = ApiClient(args.server, token)
    raw = args.session_action == "exec" and args.raw
    # `cp ID:PATH -` streams the data itself to stdout: no summary line may follow it there.
    data_to_stdout = args.session_action == "cp" and args.copy_destination == (None, "", "-")
    try:
        if args.session_action == "cp":
            summary = copy_files(client, args.copy_source, args.copy_destination)
            if not data_to_stdout:
                emit(summary)
            return EXIT_OK
        method, path, body = client_request(args)
        timeout_s = body["timeoutMs"] / 1000 + 60 if args.session_action == "exec" else 120
        document = client.json(method, path, body, timeout_s)
    except ApiCallError as e:
        if not raw:
            emit(e.document, to_stderr=data_to_stdout)
            return EXIT_FAILED
        print(f"reploy: session exec: {e}", file=sys.stderr)
        return 126 if e.document["status"] == 422 else EXIT_FAILED  # 126: cannot run, as docker exec
    except UsageError as e:
        print(f"reploy: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (ReployError, OSError) as e:
        emit({"error": str(e), "status": None}, to_stderr=data_to_stdout)
        return EXIT_FAILED
    except KeyboardInterrupt:  # Ctrl-C: the dropped connection ends the exec or transfer in the session
        print(f"reploy: session {args.session_action}: interrupted", file=sys.stderr)
        return EXIT_FOR_SIGNAL[signal.SIGINT]
    if not raw:
        emit(document)
        return EXIT_OK
    sys.stdout.buffer.write(base64.b64decode(document["stdoutBase64"]))
    sys.stdout.buffer.flush()
    sys.stderr.buffer.write(base64.b64decode(document["stderrBase64"]))
    sys.stderr.buffer.flush()
    return raw_exec_exit_code(document)


def copy_files(client: ApiClient, source: tuple[Optional[str], str, str],
               destination: tuple[Optional[str], str, str]) -> dict[str, Any]:
    """`session cp`, like `docker cp`: files and directories either way; copying onto an
    existing directory puts the source inside it; `-` as the source is a tar on stdin, as the
    destination stdout (a file's bytes, a directory's tar)."""
    if source[0] is not None:
        session_id, root, path = source
        return copy_from_session(client, session_id, root, path, destination[2])
    assert destination[0] is not None
    session_id, root, path = destination
    return copy_to_session(client, source[2], session_id, root, path)


def _file_route(kind: str, session_id: str, root: str, path: str,
                mode: Optional[int] = None) -> str:
    query = {"root": root} if root != "workspace" else {}
    if mode is not None:
        query["mode"] = f"{mode:04o}"
    return (f"/sessions/{session_id}/{kind}/{urllib.parse.quote(path)}"
            + (f"?{urllib.parse.urlencode(query)}" if query else ""))


def _remote_entry(client: ApiClient, session_id: str, root: str,
                  path: str) -> Optional[dict[str, Any]]:
    """The entry at a session path, or None when there is none."""
    try:
        return client.json("GET", _file_route("list", session_id, root, path))["entry"]
    except ApiCallError as e:
        if e.document["status"] == 404 and "no such file" in str(e):
            return None
        raise


def copy_from_session(client: ApiClient, session_id: str, root: str, path: str,
                      local: str) -> dict[str, Any]:
    """Session -> here. A file is written under a temporary name and renamed; a directory comes
    as a tar, vetted like any untrusted archive (agent.py's rules) and merged in, so a refused
    archive writes nothing."""
    entry = _remote_entry(client, session_id, root, path)
    if entry is None:
        raise ReployError(f"{session_id}:{path}: no such file or directory")
    kind = "tree" if entry["type"] == "directory" else "file"
    source = f"{session_id}:{path}"
    with client.open("GET", _file_route("files", session_id, root, path), timeout_s=600) as response:
        if local == "-":
            shutil.copyfileobj(response, sys.stdout.buffer, TRANSFER_CHUNK_BYTES)
            sys.stdout.buffer.flush()
            return {"source": source, "destination": "-", "kind": kind}
        target = Path(local)
        if target.is_dir():
            target = target / (Path(path).name or root)
        if not target.parent.is_dir():
            raise ReployError(f"{target.parent}: no such directory")
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".reploy-cp-",
                                         delete=False) as spool:
            try:
                shutil.copyfileobj(response, spool, TRANSFER_CHUNK_BYTES)
                spool.flush()
                if kind == "file":
                    os.fchmod(spool.fileno(), agent_role.sane_mode(entry["mode"], directory=False))
                    os.replace(spool.name, target)
                    return {"source": source, "destination": str(target), "kind": kind,
                            "bytes": spool.tell()}
                entries = agent_role.extract_upload(spool, target.parent, (target.name,),
                                                    f"{Path(spool.name).name}.d")
            except agent_role.AgentError as e:
                raise ReployError(f"{source}: {e}") from e
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(spool.name)
    return {"source": source, "destination": str(target), "kind": kind, "entries": entries}


def copy_to_session(client: ApiClient, local: str, session_id: str, root: str,
                    path: str) -> dict[str, Any]:
    """Here -> session. A file is streamed as it is; a directory (or `-`, a tar on stdin) is
    spooled as a tar first, since an upload carries its Content-Length."""
    mode = None
    with tempfile.TemporaryFile(prefix="reploy-cp-") as spool:
        if local == "-":
            shutil.copyfileobj(sys.stdin.buffer, spool, TRANSFER_CHUNK_BYTES)
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
                raise ReployError(f"{local}: no such file or directory")
            existing = _remote_entry(client, session_id, root, path)
            if existing is not None and existing["type"] == "directory":
                path = f"{path.rstrip('/')}/{local_path.resolve().name}".lstrip("/")
        with source:
            size_bytes = source.seek(0, os.SEEK_END)
            source.seek(0)
            content_type = "application/x-tar" if kind == "tree" else "application/octet-stream"
            result = client.upload(_file_route("files", session_id, root, path, mode), source,
                                   {"Content-Type": content_type, "Content-Length": str(size_bytes)},
                                   timeout_s=600)
    return {"source": local, "destination": f"{session_id}:{path}", "kind": kind,
            "bytes": size_bytes, "result": result}


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
    serve.add_argument("--state-dir", type=Path, default=Path(".reploy-serve"))
    serve.add_argument("--workload-dir", type=Path, action="append", required=True,
                       help="a staged, built deployment whose image has python3 (repeatable)")
    serve.add_argument("--idle-after", default=format_duration(DEFAULT_IDLE_AFTER_MS),
                       metavar="DURATION")
    serve.add_argument("--snapshot-after", default=format_duration(DEFAULT_SNAPSHOT_AFTER_MS),
                       metavar="DURATION")
    serve.add_argument("--max-busy", default=format_duration(DEFAULT_MAX_BUSY_MS), metavar="DURATION",
                       help="a busy or watched session with no access this long is paused anyway")
    serve.add_argument("--agent-command", metavar="JSON",
                       help='agent workload argv template, e.g. ["claude", ..., "{prompt}"]')
    serve.add_argument("--agent-env", action="append", default=[], metavar="NAME",
                       help="pass this variable to agent sessions and redact its value (repeatable)")
    serve.add_argument("--mount", action="append", default=[], metavar="HOST:CONTAINER",
                       help="bind-mount a host path read-only into every session (repeatable)")
    serve.add_argument("--default-model")
    serve.add_argument("--models", metavar="JSON", help="the UI's model catalog, a JSON array")
    serve.add_argument("--sse-keepalive", default=format_duration(DEFAULT_SSE_KEEPALIVE_MS),
                       metavar="DURATION")
    serve.add_argument("--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS)
    serve.add_argument("--min-free-mib", type=int, default=DEFAULT_MIN_FREE_MIB)
    serve.add_argument("--session-disk-mib", type=int, default=DEFAULT_SESSION_DISK_MIB, metavar="MIB",
                       help="each session's disk quota: everything it writes on the host (default "
                            f"{DEFAULT_SESSION_DISK_MIB}, at least {MIN_SESSION_DISK_MIB}; needs root)")

    session = commands.add_parser("session", help="managed sessions through a serve's API")
    actions = session.add_subparsers(dest="session_action", required=True,
                                     parser_class=ArgumentParser)
    common = ArgumentParser(add_help=False)
    common.add_argument("--server", metavar="URL",
                        help=f"default $REPLOY_SERVER or http://{DEFAULT_LISTEN}")
    common.add_argument("--token-file", type=Path, metavar="FILE",
                        help="the server's token file (default: the token in $REPLOY_TOKEN)")
    create = actions.add_parser("create", parents=[common])
    create.add_argument("--name", required=True)
    create.add_argument("--workload", choices=("shell", "agent"), default="shell")
    create.add_argument("--model")
    create.add_argument("--deployment")
    actions.add_parser("list", parents=[common])
    for name in ("get", "status", "interrupt", "relaunch", "switch", "snapshot", "delete"):
        actions.add_parser(name, parents=[common]).add_argument("id")
    read = actions.add_parser("read", parents=[common])
    read.add_argument("id")
    read.add_argument("--offset", type=int, default=0)
    read.add_argument("--max-bytes", type=int, default=DEFAULT_READ_BYTES)
    read.add_argument("--wait-ms", type=int, default=0)
    write = actions.add_parser("write", parents=[common])
    write.add_argument("id")
    write.add_argument("data", help="the bytes to type (UTF-8); - reads them from stdin")
    message = actions.add_parser("message", parents=[common])
    message.add_argument("id")
    message.add_argument("text", help="a prompt (agent) or one line (shell); - reads it from stdin "
                         "(UTF-8, one trailing newline dropped), for texts an argument cannot hold")
    run = actions.add_parser(
        "exec", parents=[common], usage="reploy session exec ID [--cwd DIR] [--timeout 60s] "
        "[--env K=V] [--stdin] [--raw] -- CMD [ARG ...]",
        help="run a command in the session's container; one JSON result")
    run.add_argument("id")
    run.add_argument("--cwd", default="", help="relative to the workspace")
    run.add_argument("--timeout", default="60s", metavar="DURATION")
    run.add_argument("--env", action="append", default=[], metavar="K=V")
    run.add_argument("--stdin", action="store_true",
                     help=f"send this process's stdin (at most {MAX_EXEC_STDIN_BYTES} bytes)")
    run.add_argument("--raw", action="store_true",
                     help="pass stdout and stderr through and exit with the command's code")
    copy = actions.add_parser(
        "cp", parents=[common], usage="reploy session cp SRC DST",
        help="copy files or directories in or out: one side is ID:PATH (ID:~/PATH for home), "
             "the other a local path, or - (as SRC a tar on stdin, as DST stdout)")
    copy.add_argument("source")
    copy.add_argument("destination")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    try:
        args = build_parser().parse_args(argv)
        if command and not (args.command == "session" and args.session_action == "exec"):
            raise UsageError("only session exec takes arguments after --")
        if args.command == "serve":
            serve_config, serve_access = serve_config_from(args), serve_access_from(args)
        else:
            token = session_token(args)
            if args.session_action == "exec":
                args.exec_body = exec_request_body(args, command)
            elif args.session_action == "cp":
                args.copy_source = parse_copy_operand(args.source)
                args.copy_destination = parse_copy_operand(args.destination)
                if (args.copy_source[0] is None) == (args.copy_destination[0] is None):
                    raise UsageError("session cp: exactly one of SRC and DST is ID:PATH")
    except UsageError as e:
        print(f"reploy: usage error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "serve":
        return run_serve(serve_config, serve_access)
    return run_session_client(args, token)


def run_command() -> None:
    """main() as a process: flush, then exit without the interpreter's teardown."""
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


if __name__ == "__main__":
    run_command()
