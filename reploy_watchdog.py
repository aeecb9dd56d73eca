#!/usr/bin/env python3
"""reploy_watchdog: cleans up after Reploy hosts that died abruptly.

Role: one detached process per machine and user, serving every live controlled session of that
user. The first host that needs it starts it (`reploy_watchdog.py serve`) in a session of its
own, so no host's terminal signals reach it; it exits once no session has needed it for
LINGER_S. Exactly one runs per runtime directory: it holds an exclusive lock on a file there for
its whole life, and only the lock's holder binds the socket.

Peers:
  * each host, over one unix stream connection in the user's private runtime directory
    (runtime_dir(): $REPLOY_WATCHDOG_DIR, else <tmp>/reploy-<uid>, mode 0700), kept open for
    the whole session: `arm` names the run and its manifest and is answered `armed` once the
    watchdog stands guard; `disarm` means "I cleaned up myself, forget the run"; the connection
    ending without a disarm means the host died. The host is the connection's peer
    (SO_PEERCRED), named by pid and create time, which is also re-checked every
    HOST_CHECK_INTERVAL_S, so a reused pid cannot pass for a live host;
  * the manifest each host keeps current (atomically replaced) naming exactly what its session
    owns: container and network ids with their labels, the paths to remove, and where the
    incident receipt goes. It is the durable record: when the host and the watchdog both died,
    reconciliation works from it (and from labels);
  * `reploy_watchdog.py clean`, one short-lived process per dead host's run: it imports the
    Docker SDK (the watchdog never does: it spends its life waiting) and talks to the Engine
    with the Docker environment of the host that armed the run.

A cleanup removes exactly what the manifest names (after checking each resource's run label,
never by name alone), sweeps anything else carrying the run's label, removes the listed paths,
verifies absence and writes a fixed-field JSON incident receipt (mode 0600). reploy.py arms
through `arm` and reuses `reconcile_orphans` for runs whose host and watchdog both died.

Reading order: constants, types, the protocol (codec and per-run state, no I/O), manifests and
identities, cleanup, the runtime directory, the watchdog process, the host's end, CLI.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import enum
import errno
import fcntl
import json
import os
import re
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

# The Docker SDK is imported only by the cleanup code, which runs in `clean` processes (and in
# reploy.py's reconciliation): the watchdog itself would double its memory for nothing.

# ============================================================================================
# Constants
# ============================================================================================

#: Reploy's release: one value in all four role files (a test checks), named by the offline bundle.
__version__ = "0.1.0"

MANIFEST_SCHEMA = "reploy-watchdog-manifest-v1"
RECEIPT_SCHEMA = "reploy-incident-receipt-v1"
#: The host <-> watchdog protocol. Its name is in the socket's and the lock's file names, so
#: hosts of a release speaking another version meet a watchdog of their own.
PROTOCOL = "reploy-watchdog-v1"
LABEL_RUN = "io.reploy.session.live-run"
#: "pid:start ticks" of the host and of its watchdog, on every session container and network,
#: so orphans can be recognised by label alone once both processes are gone.
LABEL_HOST = "io.reploy.session.host"
LABEL_WATCHDOG = "io.reploy.session.watchdog"
#: How removal opens a directory of a tree a container could write: never through a symlink.
DIR_OPEN_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: The workload deployment directory, where the manifest and the receipts live.
LABEL_WORKLOAD_DIR = "io.reploy.session.workload-dir"
#: Names the runtime directory (absolute) instead of <tmp>/reploy-<uid>: tests and benchmarks
#: point their hosts at a watchdog of their own with it.
RUNTIME_DIR_ENV = "REPLOY_WATCHDOG_DIR"
SOCKET_NAME = f"{PROTOCOL}.sock"
LOCK_NAME = f"{PROTOCOL}.lock"
#: One protocol message (a JSON line, newline included).
MAX_MESSAGE_BYTES = 16 * 1024
#: Bounds on an arm's Docker environment (the DOCKER_* variables the host's SDK reads).
MAX_DOCKER_ENV_ENTRIES = 32
MAX_DOCKER_ENV_VALUE_CHARS = 4096
MAX_REFUSAL_CHARS = 1024
MAX_PATH_CHARS = 4096
#: How often each armed host's process is re-checked while its connection stays open.
HOST_CHECK_INTERVAL_S = 1.0
#: How long the watchdog outlives its last session, so back-to-back sessions share one.
LINGER_S = 3.0
#: The host's bound on arming: connecting, starting a watchdog when none answers, the answer.
ARM_TIMEOUT_S = 20.0
LISTEN_BACKLOG = 64
#: `serve` exits with this when another watchdog holds the lock (serving, or on its way out).
EXIT_BUSY = 3
#: Docker calls made while cleaning up must not hang forever.
DOCKER_TIMEOUT_S = 30
RUN_ID = re.compile(r"[0-9a-f]{32}")
IDENTITY = re.compile(r"[0-9]{1,10}:[0-9]{1,12}(\.[0-9]{1,20})?")
DOCKER_ENV_NAME = re.compile(r"DOCKER_[A-Z0-9_]{1,64}")
#: Bytes of a failed `serve`'s stderr repeated in the host's error.
STDERR_TAIL_BYTES = 2000

# ============================================================================================
# Types
# ============================================================================================


class ProtocolError(ValueError):
    """A peer sent what the protocol does not allow (the message says what)."""


class WatchdogUnavailable(Exception):
    """The host could not arm a watchdog; the message says why."""


class MessageType(enum.Enum):
    ARM = "arm"  # host -> watchdog: guard this run
    DISARM = "disarm"  # host -> watchdog: the host cleaned up itself; forget the run
    ARMED = "armed"  # watchdog -> host: on guard (names the watchdog process)
    REFUSED = "refused"  # watchdog -> host: not armed, and why; the watchdog hangs up


def _check_run_id(run_id: Any) -> None:
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        raise ProtocolError("run_id must be 32 lowercase hex digits")


@dataclass(frozen=True)
class Arm:
    run_id: str
    manifest: str  # the absolute path manifest_path_for() gives this run
    docker_env: tuple[tuple[str, str], ...]  # sorted (name, value) pairs

    def __post_init__(self) -> None:
        _check_run_id(self.run_id)
        path = self.manifest
        if not isinstance(path, str) or len(path) > MAX_PATH_CHARS or "\0" in path or (
                not os.path.isabs(path) or os.path.normpath(path) != path):
            raise ProtocolError("manifest must be a normalised absolute path")
        if Path(path).parts[-3:] != (".reploy", "watchdog", f"{self.run_id}.json") or len(
                Path(path).parts) < 5:
            raise ProtocolError("manifest must be WORKLOAD_DIR/.reploy/watchdog/RUN_ID.json")
        if not isinstance(self.docker_env, tuple) or len(self.docker_env) > MAX_DOCKER_ENV_ENTRIES:
            raise ProtocolError(f"docker_env holds at most {MAX_DOCKER_ENV_ENTRIES} variables")
        for name, value in self.docker_env:
            if not isinstance(name, str) or not DOCKER_ENV_NAME.fullmatch(name):
                raise ProtocolError("docker_env names are DOCKER_* variables")
            if not isinstance(value, str) or len(value) > MAX_DOCKER_ENV_VALUE_CHARS or (
                    "\0" in value):
                raise ProtocolError(f"docker_env values are strings of at most "
                                    f"{MAX_DOCKER_ENV_VALUE_CHARS} characters")

    @property
    def manifest_path(self) -> Path:
        return Path(self.manifest)


@dataclass(frozen=True)
class Disarm:
    run_id: str

    def __post_init__(self) -> None:
        _check_run_id(self.run_id)


@dataclass(frozen=True)
class Armed:
    run_id: str
    watchdog: str  # process_identity() of the watchdog

    def __post_init__(self) -> None:
        _check_run_id(self.run_id)
        if not isinstance(self.watchdog, str) or not IDENTITY.fullmatch(self.watchdog):
            raise ProtocolError("watchdog must be a process identity, pid:start ticks")


@dataclass(frozen=True)
class Refused:
    message: str

    def __post_init__(self) -> None:
        if not isinstance(self.message, str) or not 0 < len(self.message) <= MAX_REFUSAL_CHARS:
            raise ProtocolError(f"message must be 1 to {MAX_REFUSAL_CHARS} characters")


Message = Union[Arm, Disarm, Armed, Refused]
MESSAGE_CLASSES: dict[MessageType, type[Message]] = {
    MessageType.ARM: Arm, MessageType.DISARM: Disarm,
    MessageType.ARMED: Armed, MessageType.REFUSED: Refused,
}
HOST_MESSAGES = frozenset({MessageType.ARM, MessageType.DISARM})
WATCHDOG_MESSAGES = frozenset({MessageType.ARMED, MessageType.REFUSED})

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
# The protocol: JSON lines, one validating parser, per-run state (no I/O below this point
# until "Manifests")
# ============================================================================================


def encode(message: Message) -> bytes:
    """One message as a compact JSON line."""
    kind = next(k for k, cls in MESSAGE_CLASSES.items() if isinstance(message, cls))
    fields_ = {name: getattr(message, name) for name in message.__dataclass_fields__}
    if isinstance(message, Arm):
        fields_["docker_env"] = dict(message.docker_env)
    line = json.dumps({"type": kind.value, **fields_}, separators=(",", ":")).encode() + b"\n"
    if len(line) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"a message is at most {MAX_MESSAGE_BYTES} bytes")
    return line


def decode(line: bytes, allowed: frozenset[MessageType]) -> Message:
    """The one parser: a JSON object line of a type in `allowed`, with exactly its fields."""
    try:
        obj = parse_strict_json(line, MAX_MESSAGE_BYTES)
    except StrictJsonError as e:
        raise ProtocolError(f"a message must be one JSON object: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("a message must be a JSON object")
    try:
        kind = MessageType(obj.pop("type", None))
    except ValueError as e:
        raise ProtocolError("unknown or missing message type") from e
    if kind not in allowed:
        raise ProtocolError(f"{kind.value!r} is not sent by this peer")
    cls = MESSAGE_CLASSES[kind]
    if set(obj) != set(cls.__dataclass_fields__):
        raise ProtocolError(f"{kind.value} takes exactly {sorted(cls.__dataclass_fields__)}")
    if kind is MessageType.ARM:
        if not isinstance(obj["docker_env"], dict):
            raise ProtocolError("docker_env must be an object")
        obj["docker_env"] = tuple(sorted(obj["docker_env"].items()))
    return cls(**obj)


class LineBuffer:
    """Bytes in, complete lines out; a line longer than MAX_MESSAGE_BYTES is an error, and
    what is left unterminated at the end of the stream is dropped (a half-written message
    means nothing)."""

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        *lines, self.pending = (self.pending + data).split(b"\n")
        if len(self.pending) >= MAX_MESSAGE_BYTES or any(
                len(line) >= MAX_MESSAGE_BYTES for line in lines):
            raise ProtocolError(f"a message is at most {MAX_MESSAGE_BYTES} bytes")
        return lines


class RunPhase(enum.Enum):
    ARMED = "armed"  # its host's connection is open
    DETACHED = "detached"  # its connection broke the protocol: the host's process alone is watched
    CLEANING = "cleaning"  # its host died: a `clean` process runs


class RunEvent(enum.Enum):
    ARM = "arm"
    DISARM = "disarm"
    CONNECTION_ENDED = "connection-ended"
    PROTOCOL_VIOLATION = "protocol-violation"
    HOST_GONE = "host-gone"
    CLEANED = "cleaned"


#: A run's life in the watchdog. A run is armed by its host's connection and forgotten when
#: the host disarms it. The connection ending without a disarm is the host's death: cleanup
#: starts at once. A connection that breaks the protocol is hung up on, but its run stays
#: guarded by the host's process identity (DETACHED) until that host arms it again over a new
#: connection or dies. The host's process disappearing while armed or detached (checked every
#: HOST_CHECK_INTERVAL_S) is a death too. None stands for "not known here".
RUN_TRANSITIONS: dict[tuple[Optional[RunPhase], RunEvent], Optional[RunPhase]] = {
    (None, RunEvent.ARM): RunPhase.ARMED,
    (RunPhase.DETACHED, RunEvent.ARM): RunPhase.ARMED,
    (RunPhase.ARMED, RunEvent.DISARM): None,
    (RunPhase.ARMED, RunEvent.CONNECTION_ENDED): RunPhase.CLEANING,
    (RunPhase.ARMED, RunEvent.PROTOCOL_VIOLATION): RunPhase.DETACHED,
    (RunPhase.ARMED, RunEvent.HOST_GONE): RunPhase.CLEANING,
    (RunPhase.DETACHED, RunEvent.HOST_GONE): RunPhase.CLEANING,
    (RunPhase.CLEANING, RunEvent.CLEANED): None,
}


def next_phase(phase: Optional[RunPhase], event: RunEvent) -> Optional[RunPhase]:
    """Apply one transition of RUN_TRANSITIONS; anything else is a bug of the caller."""
    try:
        return RUN_TRANSITIONS[(phase, event)]
    except KeyError:
        raise RuntimeError(f"no transition from {phase} on {event.value}") from None


@dataclass
class Run:
    """One guarded run."""

    run_id: str
    manifest: Path
    host: str  # the host's process identity
    docker_env: tuple[tuple[str, str], ...]
    phase: RunPhase
    connection: Optional[int]  # the connection guarding it while ARMED
    #: The last check found the host gone while its connection was still open (see check_hosts).
    gone_at_last_check: bool = False


@dataclass
class Connection:
    """One host connection: who is on the other end, and the run it armed."""

    peer: str  # the peer's process identity, from SO_PEERCRED
    buffer: LineBuffer = field(default_factory=LineBuffer)
    run_id: Optional[str] = None
    disarmed: bool = False


@dataclass(frozen=True)
class Reply:
    connection: int
    message: Message


@dataclass(frozen=True)
class Hangup:
    """Close the connection; the core has already forgotten it."""

    connection: int


@dataclass(frozen=True)
class Clean:
    """The run's host died: clean up after it."""

    run_id: str
    manifest: Path
    trigger: str
    docker_env: tuple[tuple[str, str], ...]


Action = Union[Reply, Hangup, Clean]


class WatchdogCore:
    """Every connection and run of the watchdog: events in, actions out, no I/O.

    `read_manifest` is the seam to the disk: an arm is accepted only when its manifest reads
    as a manifest of that run naming the connection's peer as its host.
    """

    def __init__(self, identity: str, read_manifest: Callable[[Path], "Manifest"]) -> None:
        self.identity = identity
        self.read_manifest = read_manifest
        self.connections: dict[int, Connection] = {}
        self.runs: dict[str, Run] = {}

    @property
    def idle(self) -> bool:
        """No connection, no run: nothing would be lost if the watchdog went away."""
        return not self.connections and not self.runs

    def transition(self, run: Run, event: RunEvent) -> None:
        phase = next_phase(run.phase, event)
        if phase is None:
            del self.runs[run.run_id]
        else:
            run.phase = phase

    def connected(self, connection: int, peer: str) -> None:
        self.connections[connection] = Connection(peer)

    def received(self, connection: int, data: bytes) -> list[Action]:
        state = self.connections[connection]
        actions: list[Action] = []
        try:
            for line in state.buffer.feed(data):
                actions += self.handle(connection, state, decode(line, HOST_MESSAGES))
                if connection not in self.connections:
                    break
        except ProtocolError as e:
            actions += self.violation(connection, str(e))
        return actions

    def handle(self, connection: int, state: Connection, message: Message) -> list[Action]:
        if isinstance(message, Arm):
            if state.run_id is not None or state.disarmed:
                raise ProtocolError("one arm per connection")
            return self.arm(connection, state, message)
        assert isinstance(message, Disarm)
        if state.run_id != message.run_id or state.disarmed:
            raise ProtocolError("disarm names no run this connection armed")
        self.transition(self.runs[message.run_id], RunEvent.DISARM)
        state.disarmed = True
        return []

    def arm(self, connection: int, state: Connection, message: Arm) -> list[Action]:
        run = self.runs.get(message.run_id)
        if run is not None and (run.phase is not RunPhase.DETACHED or run.host != state.peer):
            return self.refuse(connection, f"run {message.run_id} is already {run.phase.value}")
        try:
            manifest = self.read_manifest(message.manifest_path)
        except (OSError, ValueError) as e:
            return self.refuse(connection, f"unreadable manifest: {e}")
        if manifest.run_id != message.run_id or manifest.host != state.peer:
            return self.refuse(connection, "the manifest names another run or another host")
        phase = next_phase(run.phase if run else None, RunEvent.ARM)
        assert phase is not None
        run = Run(message.run_id, message.manifest_path, state.peer, message.docker_env, phase,
                  connection)
        self.runs[run.run_id] = run
        state.run_id = run.run_id
        return [Reply(connection, Armed(run.run_id, self.identity))]

    def refuse(self, connection: int, reason: str) -> list[Action]:
        """A well-formed arm that cannot be accepted: say why and hang up; nothing changes."""
        del self.connections[connection]
        return [Reply(connection, Refused(reason[:MAX_REFUSAL_CHARS])), Hangup(connection)]

    def violation(self, connection: int, reason: str) -> list[Action]:
        state = self.connections.pop(connection)
        run = self.runs.get(state.run_id or "")
        if run is not None and run.connection == connection and not state.disarmed:
            self.transition(run, RunEvent.PROTOCOL_VIOLATION)
            run.connection = None
        return [Reply(connection, Refused(reason[:MAX_REFUSAL_CHARS])), Hangup(connection)]

    def closed(self, connection: int) -> list[Action]:
        """The connection ended (end of file, or an error reading it)."""
        state = self.connections.pop(connection)
        run = self.runs.get(state.run_id or "")
        if run is None or run.connection != connection or state.disarmed:
            return []  # never armed (a half-written arm included), or disarmed first
        self.transition(run, RunEvent.CONNECTION_ENDED)
        run.connection = None
        return [Clean(run.run_id, run.manifest, "host-exited", run.docker_env)]

    def check_hosts(self, alive: Callable[[str], bool]) -> list[Action]:
        """Runs whose host's process is gone although no connection end said so.

        A host that dies with its connection open is given one more check: its end of file
        can still be on its way (the kernel closes a dying process's sockets when its last
        thread exits, after the leader is already a zombie; or it arrived after this pass's
        read), and it says host-exited, the truer cause. A connection still open a check later
        is held by something else (a child that inherited it), and the host is gone for good."""
        actions: list[Action] = []
        for run in list(self.runs.values()):
            if run.phase is RunPhase.CLEANING:
                continue
            if alive(run.host):
                run.gone_at_last_check = False
                continue
            if run.connection is not None and not run.gone_at_last_check:
                run.gone_at_last_check = True
                continue
            if run.connection is not None:
                self.connections.pop(run.connection, None)
                actions.append(Hangup(run.connection))
                run.connection = None
            self.transition(run, RunEvent.HOST_GONE)
            actions.append(Clean(run.run_id, run.manifest, "host-process-gone", run.docker_env))
        return actions

    def cleaned(self, run_id: str) -> None:
        self.transition(self.runs[run_id], RunEvent.CLEANED)


# ============================================================================================
# Manifests and process identities
# ============================================================================================


def _is_labels(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _is_owned(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and _is_labels(v) for k, v in value.items())


@dataclass(frozen=True)
class Manifest:
    """What one session owns. Written by the host, read by the watchdog (on arm and when
    acting) and by reconciliation."""

    run_id: str
    host: str  # process identity "pid:start ticks"
    watchdog: str  # likewise; "" while no watchdog is responsible for the run
    containers: dict[str, dict[str, str]]  # container id -> labels
    #: network id -> labels. Hosts no longer create networks (a granted session's namespace is
    #: held by a container), but runs of earlier hosts on the same machine still name theirs,
    #: and one manifest format keeps old and new hosts reconciling each other's orphans.
    networks: dict[str, dict[str, str]]
    paths: tuple[str, ...]
    receipt_path: str

    @classmethod
    def load(cls, path: Path) -> "Manifest":
        """Raises OSError, or ValueError for anything but a manifest of this exact format (an
        unknown or older one, a torn one), so no reader ever acts on a guess."""
        try:
            obj = json.loads(path.read_bytes())
        except ValueError as e:
            raise ValueError(f"{path}: not a watchdog manifest ({e})") from e
        fields_ = ("schema", "run_id", "host", "watchdog", "containers", "networks", "paths",
                   "receipt_path")
        if not isinstance(obj, dict) or obj.get("schema") != MANIFEST_SCHEMA or set(
                obj) != set(fields_):
            raise ValueError(f"{path}: not a {MANIFEST_SCHEMA} manifest")
        if not (all(isinstance(obj[k], str) for k in ("run_id", "host", "watchdog",
                                                      "receipt_path"))
                and _is_owned(obj["containers"]) and _is_owned(obj["networks"])
                and isinstance(obj["paths"], list)
                and all(isinstance(p, str) for p in obj["paths"])):
            raise ValueError(f"{path}: a {MANIFEST_SCHEMA} manifest with fields of wrong types")
        del obj["schema"]
        obj["paths"] = tuple(obj["paths"])
        return cls(**obj)

    def to_json(self) -> dict[str, Any]:
        return {"schema": MANIFEST_SCHEMA, "run_id": self.run_id, "host": self.host,
                "watchdog": self.watchdog, "containers": self.containers,
                "networks": self.networks, "paths": list(self.paths),
                "receipt_path": self.receipt_path}

    @property
    def abandoned(self) -> bool:
        """Neither the host nor its watchdog is alive to act on this manifest."""
        return not identity_alive(self.host) and not identity_alive(self.watchdog)


@dataclass
class CleanupReport:
    removed_containers: list[str] = field(default_factory=list)
    removed_networks: list[str] = field(default_factory=list)
    removed_paths: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def atomic_write_json(path: Path, obj: dict[str, Any], mode: int = 0o600) -> None:
    """Write JSON so a reader sees the old file or the new one, never a torn one.

    reploy.py writes deployment state with this too: one implementation of the rename dance.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def process_start(pid: int) -> Optional[tuple[int, str]]:
    """(start time in clock ticks since boot, state letter) of a process, from /proc/PID/stat;
    None when there is none. Ticks since boot, not a wall-clock time: a create time (psutil's,
    say) adds the boot time, which a process reads once and the kernel recomputes from the wall
    clock, so two processes could name one process by times a second apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            fields = stat_file.read().rpartition(b")")[2].split()
        return int(fields[19]), fields[0].decode("ascii", "replace")  # stat(5): fields 22 and 3
    except (OSError, IndexError, ValueError):
        return None


class ProcessGone(Exception):
    """The process to name has no /proc entry (it exited, or never was)."""


def process_identity(pid: Optional[int] = None) -> str:
    """'pid:start ticks' of a process (this one by default): what a label or manifest stores
    to name one process exactly. Raises ProcessGone."""
    pid = os.getpid() if pid is None else pid
    start = process_start(pid)
    if start is None:
        raise ProcessGone(pid)
    return f"{pid}:{start[0]}"


def identity_alive(identity: str) -> bool:
    """True while the process named by a process_identity() string exists (a zombie does not)."""
    pid, _, ticks = identity.partition(":")
    if not (pid.isdigit() and ticks.isdigit()):
        return False
    start = process_start(int(pid))
    return start is not None and start[0] == int(ticks) and start[1] != "Z"


def manifest_dir_for(workload_dir: str) -> Path:
    return Path(workload_dir) / ".reploy" / "watchdog"


def manifest_path_for(workload_dir: str, run_id: str) -> Path:
    return manifest_dir_for(workload_dir) / f"{run_id}.json"


def receipt_path_for(workload_dir: str, run_id: str) -> Path:
    return Path(workload_dir) / ".reploy" / "incidents" / f"{run_id}.json"


def channel_dir_for(workload_dir: str, run_id: str) -> Path:
    return Path(workload_dir) / ".reploy" / "sessions" / run_id


# ============================================================================================
# Cleanup
# ============================================================================================


def remove_tree(path: Path) -> None:
    """rm -r PATH (see remove_entry), PATH's parent being the host's; FileNotFoundError when
    there is nothing there."""
    parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        remove_entry(parent, path.name)
    finally:
        os.close(parent)


def remove_entry(dir_fd: int, name: str) -> None:
    """Removes `name` from a directory, whatever it is, following no symlink: a directory with
    everything below it. shutil.rmtree is fd-based too, but (Python 3.11) recurses once per
    level: a tree a container nests a few thousand levels deep made it raise RecursionError,
    and that session could never be deleted. Here the walk is a loop that keeps one fd open;
    it climbs back through '..', checked against the identity it recorded on the way down."""
    if not stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = os.open(name, DIR_OPEN_FLAGS, dir_fd=dir_fd)
    above: list[tuple[str, list[str], tuple[int, int]]] = []  # (name, parent's rest, parent's id)
    try:
        pending = _unlink_non_directories(fd)
        while pending or above:
            if pending:
                below = pending.pop()
                above.append((below, pending, fd_identity(fd)))
                child = os.open(below, DIR_OPEN_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
                pending = _unlink_non_directories(fd)
                continue
            below, pending, parent = above.pop()
            up = os.open("..", DIR_OPEN_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = up
            if fd_identity(fd) != parent:
                raise OSError(errno.ESTALE, f"{name}: a directory moved during removal")
            os.rmdir(below, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def _unlink_non_directories(dir_fd: int) -> list[str]:
    """Unlinks every entry of a directory that is not a directory; returns the directories."""
    with os.scandir(dir_fd) as scan:
        entries = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in scan]
    for name, is_dir in entries:
        if not is_dir:
            os.unlink(name, dir_fd=dir_fd)
    return [name for name, is_dir in entries if is_dir]


def fd_identity(fd: int) -> tuple[int, int]:
    """What names one file however it is reached: its device and inode."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def remove_owned(manifest: Manifest, client: Any) -> CleanupReport:
    """Remove what the manifest names and anything else labelled with its run; verify."""
    import docker.errors
    report = CleanupReport()
    api = client.api
    wanted = {LABEL_RUN: manifest.run_id}
    swept = {c["Id"] for c in api.containers(all=True, filters={"label": f"{LABEL_RUN}={manifest.run_id}"})}
    for container_id in list(manifest.containers) + sorted(swept - set(manifest.containers)):
        try:
            labels = api.inspect_container(container_id)["Config"].get("Labels") or {}
        except docker.errors.NotFound:
            continue
        if any(labels.get(k) != v for k, v in wanted.items()):
            report.errors.append(f"container {container_id} does not carry this run's label; kept")
            continue
        try:
            api.remove_container(container_id, force=True, v=True)
            report.removed_containers.append(container_id)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            report.errors.append(f"remove container {container_id}: {e}")
    swept_networks = {n["Id"] for n in api.networks(filters={"label": f"{LABEL_RUN}={manifest.run_id}"})}
    for network_id in list(manifest.networks) + sorted(swept_networks - set(manifest.networks)):
        try:
            labels = api.inspect_network(network_id).get("Labels") or {}
        except docker.errors.NotFound:
            continue
        if labels.get(LABEL_RUN) != manifest.run_id:
            report.errors.append(f"network {network_id} does not carry this run's label; kept")
            continue
        try:
            api.remove_network(network_id)
            report.removed_networks.append(network_id)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            report.errors.append(f"remove network {network_id}: {e}")
    for path in manifest.paths:
        if os.path.lexists(path):
            try:
                remove_tree(Path(path))
                report.removed_paths.append(path)
            except OSError as e:
                report.errors.append(f"remove {path}: {e}")
    # Verify absence: a cleanup is only a success when nothing of the run remains.
    if api.containers(all=True, filters={"label": f"{LABEL_RUN}={manifest.run_id}"}):
        report.errors.append("containers of this run remain after cleanup")
    if api.networks(filters={"label": f"{LABEL_RUN}={manifest.run_id}"}):
        report.errors.append("networks of this run remain after cleanup")
    report.errors.extend(f"{p} remains after cleanup" for p in manifest.paths if os.path.lexists(p))
    return report


def reconcile_manifest(manifest: Manifest, manifest_path: Path, trigger: str,
                       notes: tuple[str, ...] = ()) -> dict[str, Any]:
    """Act on one manifest: clean up, write the receipt, and drop the manifest, or, when
    something could not be removed, leave one naming only what remains, for the next
    reconciliation. Returns the receipt; `notes` are errors found before cleaning (they make
    it a failed cleanup)."""
    import docker

    try:
        client = docker.from_env(timeout=DOCKER_TIMEOUT_S)
        try:
            report = remove_owned(manifest, client)
        finally:
            client.close()
    except Exception as e:  # noqa: BLE001 - an unreachable engine still gets its receipt
        report = CleanupReport(errors=[f"the Docker engine failed: {e}"])
        for path in manifest.paths:  # what needs no engine is still cleaned up
            with contextlib.suppress(OSError):
                remove_tree(Path(path))
                report.removed_paths.append(path)
    errors = [*notes, *report.errors]
    receipt = {
        "schema": RECEIPT_SCHEMA,
        "run_id": manifest.run_id,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "trigger": trigger,
        "host": manifest.host,
        "removed": {"containers": report.removed_containers,
                    "networks": report.removed_networks,
                    "paths": report.removed_paths},
        "cleanup_succeeded": not errors,
        "errors": errors,
    }
    atomic_write_json(Path(manifest.receipt_path), receipt)
    if errors:
        atomic_write_json(manifest_path, replace(
            manifest, watchdog="",
            containers={k: v for k, v in manifest.containers.items()
                        if k not in report.removed_containers},
            networks={k: v for k, v in manifest.networks.items()
                      if k not in report.removed_networks},
            paths=tuple(p for p in manifest.paths if p not in report.removed_paths)).to_json())
    else:
        with contextlib.suppress(FileNotFoundError):
            manifest_path.unlink()
    return receipt


def reconcile_orphans(client: Any, extra_manifests: tuple[Path, ...] = ()) -> list[dict[str, Any]]:
    """Clean up runs whose host and watchdog are both gone (a crash that took both).

    Runs are found by label and through `extra_manifests` (the manifests of deployments the
    caller is about to use, which also catch runs that died before creating anything). A run's
    manifest is used when it still exists, else one is rebuilt from the labels. A manifest that
    does not read as one of this format is left alone. Returns the receipts written.
    """
    runs: dict[str, dict[str, dict[str, dict[str, str]]]] = {}
    for kind, listing in (("containers", client.api.containers(all=True, filters={"label": LABEL_RUN})),
                          ("networks", client.api.networks(filters={"label": LABEL_RUN}))):
        for item in listing:
            labels = item.get("Labels") or {}
            run = runs.setdefault(labels[LABEL_RUN], {"containers": {}, "networks": {}})
            run[kind][item["Id"]] = labels
    for run_id, owned in sorted(runs.items()):
        labels = next(iter({**owned["containers"], **owned["networks"]}.values()))
        workload_dir = labels.get(LABEL_WORKLOAD_DIR)
        if not workload_dir:
            continue  # not a session resource of ours: no place for a receipt
        manifest = Manifest(
            run_id=run_id, host=labels.get(LABEL_HOST, ""),
            watchdog=labels.get(LABEL_WATCHDOG, ""), containers=owned["containers"],
            networks=owned["networks"], paths=(str(channel_dir_for(workload_dir, run_id)),),
            receipt_path=str(receipt_path_for(workload_dir, run_id)))
        path = manifest_path_for(workload_dir, run_id)
        if manifest.abandoned and not path.exists():
            atomic_write_json(path, manifest.to_json())
    receipts = []
    for path in sorted({manifest_path_for(labels.get(LABEL_WORKLOAD_DIR, ""), run_id)
                        for run_id, owned in runs.items()
                        for labels in [*owned["containers"].values(), *owned["networks"].values()]
                        if labels.get(LABEL_WORKLOAD_DIR)} | set(extra_manifests)):
        try:
            manifest = Manifest.load(path)
        except (OSError, ValueError):
            continue  # gone, or not ours to act on, and no reason to stop the others
        if manifest.abandoned:
            receipts.append(reconcile_manifest(manifest, path, "reconciled"))
    return receipts


def clean(manifest_path: Path, run_id: str, trigger: str) -> int:
    """`reploy_watchdog.py clean`: the cleanup after one dead host's run. A manifest that no
    longer reads as this run's (an unknown format, damage) still gets its run swept by label
    and a receipt saying so."""
    notes: tuple[str, ...] = ()
    try:
        manifest = Manifest.load(manifest_path)
        if manifest.run_id != run_id:
            raise ValueError(f"{manifest_path}: a manifest of run {manifest.run_id}")
    except FileNotFoundError:
        return 0  # the host, or a reconciliation, finished with the run meanwhile
    except (OSError, ValueError) as e:
        workload_dir = str(manifest_path.parents[2])
        notes = (f"the manifest was unreadable, so only the run's label guided cleanup: {e}",)
        manifest = Manifest(run_id=run_id, host="", watchdog="", containers={}, networks={},
                            paths=(str(channel_dir_for(workload_dir, run_id)),),
                            receipt_path=str(receipt_path_for(workload_dir, run_id)))
    receipt = reconcile_manifest(manifest, manifest_path, trigger, notes)
    return 0 if receipt["cleanup_succeeded"] else 1


# ============================================================================================
# The runtime directory: where hosts meet the watchdog
# ============================================================================================


def runtime_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """$REPLOY_WATCHDOG_DIR (absolute), else <tmp>/reploy-<uid>: one per user, so each uid
    running Reploy has a watchdog of its own that only it can reach."""
    named = environ.get(RUNTIME_DIR_ENV)
    if named:
        if not os.path.isabs(named):
            raise WatchdogUnavailable(f"{RUNTIME_DIR_ENV} must be an absolute path: {named!r}")
        return Path(named)
    return Path(tempfile.gettempdir()) / f"reploy-{os.getuid()}"


def open_runtime_dir(path: Path) -> int:
    """The runtime directory as a directory descriptor, created 0700 when missing. Refused
    unless it is a directory (not a symlink) of this uid that nobody else may enter: anyone who
    could enter it could stand in for the watchdog."""
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        dir_fd = os.open(path, DIR_OPEN_FLAGS)
    except OSError as e:
        raise WatchdogUnavailable(f"runtime directory {path}: {e.strerror}") from e
    info = os.fstat(dir_fd)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        os.close(dir_fd)
        raise WatchdogUnavailable(
            f"runtime directory {path} must belong to uid {os.getuid()} with mode 0700 "
            f"(it has uid {info.st_uid}, mode {info.st_mode & 0o777:o})")
    return dir_fd


def socket_path(dir_fd: int) -> str:
    """The socket's path through /proc/self/fd, so a deep runtime directory cannot exceed
    sun_path's 108 bytes."""
    return f"/proc/self/fd/{dir_fd}/{SOCKET_NAME}"


def peer_identity(sock: socket.socket) -> Optional[str]:
    """The process identity of a connected peer of this uid, else None."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        return None
    try:
        return process_identity(pid)
    except ProcessGone:
        return None


# ============================================================================================
# The watchdog process
# ============================================================================================


class WatchdogProcess:
    """One selector loop: the listener, every host connection, and a check of hosts and
    cleanup processes each HOST_CHECK_INTERVAL_S. It returns once idle for LINGER_S."""

    def __init__(self, listener: socket.socket, clock: Callable[[], float] = time.monotonic) -> None:
        self.listener = listener
        self.clock = clock
        self.core = WatchdogCore(process_identity(), Manifest.load)
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, None)
        self.sockets: dict[int, socket.socket] = {}
        self.cleaners: dict[str, subprocess.Popen[bytes]] = {}

    def run(self) -> None:
        next_check = self.clock() + HOST_CHECK_INTERVAL_S
        idle_since = self.clock()
        while True:
            now = self.clock()
            timeout = next_check - now
            if self.core.idle:
                timeout = min(timeout, idle_since + LINGER_S - now)
            for key, _ in self.selector.select(max(timeout, 0)):
                if key.data is None:
                    self.accept()
                else:
                    self.read(key.data)
            now = self.clock()
            if now >= next_check:
                self.apply(self.core.check_hosts(identity_alive))
                self.reap()
                next_check = now + HOST_CHECK_INTERVAL_S
            if not self.core.idle:
                idle_since = now
            elif now - idle_since >= LINGER_S:
                return

    def accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        peer = peer_identity(sock)
        if peer is None:
            sock.close()
            return
        sock.setblocking(False)
        connection = sock.fileno()
        self.sockets[connection] = sock
        self.core.connected(connection, peer)
        self.selector.register(sock, selectors.EVENT_READ, connection)

    def read(self, connection: int) -> None:
        sock = self.sockets.get(connection)
        if sock is None:
            return  # hung up on earlier in this pass
        try:
            data = sock.recv(MAX_MESSAGE_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.apply(self.core.received(connection, data))
        else:
            self.apply(self.core.closed(connection))
            self.hang_up(connection)

    def apply(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Reply):
                try:  # one short line on a fresh connection: it fits in the socket buffer
                    self.sockets[action.connection].send(encode(action.message))
                except OSError:
                    pass  # the peer is gone; its end of file says so next
            elif isinstance(action, Hangup):
                self.hang_up(action.connection)
            else:
                self.start_cleaner(action)

    def hang_up(self, connection: int) -> None:
        sock = self.sockets.pop(connection, None)
        if sock is not None:
            self.selector.unregister(sock)
            sock.close()

    def start_cleaner(self, action: Clean) -> None:
        """A `clean` process with the Docker environment of the host that armed the run."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
        env.update(action.docker_env)
        try:
            self.cleaners[action.run_id] = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "clean", "--manifest",
                 str(action.manifest), "--run-id", action.run_id, "--trigger", action.trigger],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
        except OSError:
            # The manifest stays behind: the next reploy operation reconciles the run.
            self.core.cleaned(action.run_id)

    def reap(self) -> None:
        for run_id, process in list(self.cleaners.items()):
            if process.poll() is not None:
                del self.cleaners[run_id]
                self.core.cleaned(run_id)


def serve(runtime: Path) -> int:
    """`reploy_watchdog.py serve`: become this runtime directory's watchdog, unless one is.

    The lock decides who: only its holder removes a stale socket and binds. Once the socket
    listens, the process forks; the parent exits 0 (so the host that started it knows it can
    connect) and the child, in a session of its own, is the watchdog. EXIT_BUSY when another
    process holds the lock."""
    dir_fd = open_runtime_dir(runtime)
    lock_fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                      dir_fd=dir_fd)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return EXIT_BUSY
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SOCKET_NAME, dir_fd=dir_fd)  # a dead watchdog's: we hold the lock now
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path(dir_fd))
    listener.listen(LISTEN_BACKLOG)
    listener.setblocking(False)
    if os.fork() != 0:
        os._exit(0)  # the starter's part is done: the socket listens
    os.setsid()
    os.chdir("/")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    try:
        WatchdogProcess(listener).run()
    finally:
        # Hosts arriving from here on find no socket and start the next watchdog, which waits
        # for our lock; one that connected just now is hung up on unanswered and retries.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SOCKET_NAME, dir_fd=dir_fd)
        listener.close()
    return 0


# ============================================================================================
# The host's end
# ============================================================================================


class WatchdogLink:
    """A host's armed connection to the watchdog. The watchdog never speaks after `armed`,
    so the link turning readable means it is gone (see ControlledSession.on_watchdog)."""

    def __init__(self, sock: socket.socket, run_id: str, watchdog: str) -> None:
        self.sock = sock
        self.run_id = run_id
        self.watchdog = watchdog  # the watchdog's process identity

    def fileno(self) -> int:
        return self.sock.fileno()

    def disarm(self) -> None:
        """Tell the watchdog the host cleaned up itself, and close. A watchdog already gone
        has nothing to forget."""
        with contextlib.suppress(OSError):
            self.sock.sendall(encode(Disarm(self.run_id)))
        self.close()

    def close(self) -> None:
        self.sock.close()


def arm(run_id: str, manifest: Path, environ: Mapping[str, str] = os.environ) -> WatchdogLink:
    """Arm this user's watchdog for one run whose manifest is already written, starting the
    watchdog when none answers. Raises WatchdogUnavailable."""
    runtime = runtime_dir(environ)
    docker_env = tuple(sorted((k, v) for k, v in environ.items() if k.startswith("DOCKER_")))
    try:
        request = encode(Arm(run_id, str(manifest), docker_env))
    except ProtocolError as e:
        raise WatchdogUnavailable(f"this run cannot be armed: {e}") from e
    deadline = time.monotonic() + ARM_TIMEOUT_S
    dir_fd = open_runtime_dir(runtime)
    try:
        while time.monotonic() < deadline:
            sock = connect(dir_fd)
            if sock is None:
                start_watchdog(runtime, deadline)
                continue
            reply = exchange(sock, request, deadline)
            if isinstance(reply, Armed) and reply.run_id == run_id:
                sock.settimeout(None)
                return WatchdogLink(sock, run_id, reply.watchdog)
            sock.close()
            if isinstance(reply, Refused):
                raise WatchdogUnavailable(f"the watchdog refused to arm: {reply.message}")
            if isinstance(reply, Armed):
                raise WatchdogUnavailable(f"the watchdog armed another run, {reply.run_id}")
            # No answer: that watchdog was on its way out; the next one will answer.
    finally:
        os.close(dir_fd)
    raise WatchdogUnavailable(f"no watchdog answered within {ARM_TIMEOUT_S:.0f} s in {runtime}")


def connect(dir_fd: int) -> Optional[socket.socket]:
    """A connection to the watchdog, or None when none listens."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_path(dir_fd))
        return sock
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except OSError as e:
        sock.close()
        raise WatchdogUnavailable(f"connect to the watchdog: {e}") from e


def exchange(sock: socket.socket, request: bytes, deadline: float) -> Optional[Message]:
    """Send the arm, read the one-line answer; None when the watchdog hung up unanswered."""
    buffer = LineBuffer()
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(request)
        while True:
            data = sock.recv(MAX_MESSAGE_BYTES)
            if not data:
                return None
            lines = buffer.feed(data)
            if lines:
                if len(lines) > 1 or buffer.pending:
                    raise ProtocolError("the watchdog said more than one answer")
                return decode(lines[0], WATCHDOG_MESSAGES)
    except ConnectionError:
        return None
    except socket.timeout as e:
        raise WatchdogUnavailable(f"the watchdog did not answer within {ARM_TIMEOUT_S:.0f} s") from e
    except ProtocolError as e:
        raise WatchdogUnavailable(f"the watchdog broke its protocol: {e}") from e


def start_watchdog(runtime: Path, deadline: float) -> None:
    """Run `reploy_watchdog.py serve`, detached: it returns once a watchdog listens (this one,
    or one that already held the lock)."""
    try:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "serve", "--runtime-dir", str(runtime)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True)
    except OSError as e:
        raise WatchdogUnavailable(f"start the watchdog: {e}") from e
    try:
        _, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 0.001))
    except subprocess.TimeoutExpired as e:
        proc.kill()
        proc.wait()
        raise WatchdogUnavailable(f"the watchdog did not start within {ARM_TIMEOUT_S:.0f} s") from e
    if proc.returncode not in (0, EXIT_BUSY):
        raise WatchdogUnavailable(
            f"the watchdog did not start (exit {proc.returncode}): "
            f"{stderr[-STDERR_TAIL_BYTES:].decode(errors='replace').strip()}")


# ============================================================================================
# CLI
# ============================================================================================


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="reploy_watchdog")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    p_serve = commands.add_parser("serve", help="be this runtime directory's watchdog")
    p_serve.add_argument("--runtime-dir", type=Path, required=True)
    p_clean = commands.add_parser("clean", help="clean up after one dead host's run")
    p_clean.add_argument("--manifest", type=Path, required=True)
    p_clean.add_argument("--run-id", required=True)
    p_clean.add_argument("--trigger", required=True)
    args = parser.parse_args(argv)
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_IGN)
    if args.command == "clean":
        return clean(args.manifest, args.run_id, args.trigger)
    try:
        return serve(args.runtime_dir)
    except (WatchdogUnavailable, OSError) as e:
        print(f"reploy_watchdog: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # everything is cleaned up in main(); skip the interpreter's slow teardown
