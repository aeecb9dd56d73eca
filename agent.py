#!/usr/bin/env python3
"""agent.py: Reploy's data-plane agent. One session directory, one workload, one control socket.

Role: runs inside each managed-session container (or directly on any Linux box) and owns exactly one session
directory DIR, its own files in DIR/agent (0700). Its peers: `reploy serve` (the control plane) talks to it only
through DIR/agent/control.sock; supervisors observe DIR/agent/events.jsonl; people and shell pipelines drive it with
`python3 agent.py call DIR VERB`.

It is the trust boundary of a managed session: run as root with --runtime-user, it starts everything of the
workload as that user, does all file work on the workspace and home in worker processes of that user, and treats
what those say as hostile input. The workload cannot signal, trace, impersonate or write to it.
Opt-in, `--listen HOST:PORT` serves the same protocol over TCP, for a trusted controller behind a private endpoint
grant (a controlled-session workload); nothing listens on the network unless asked.

Workloads:
  shell  one PTY running /bin/sh (configurable); raw writes, typed messages, Ctrl-C-like interrupt, relaunch.
  agent  a coding-agent CLI (Claude Code by default) run once per prompt through a bounded serial queue; its
         stream-json is projected to plain text, UTF-8 normalised, secrets redacted, output capped.

Beside the workload, for harnesses: `exec` runs a command in its own process session and reports how it ended, with
stdout and stderr apart; the file verbs move files and trees (as tar) in and out of the workspace or home, confined
by the runtime user's rights and by walking directory fds with O_NOFOLLOW. Both keep the socket's bounds: long work
is started, then long-polled.

Everything the workload prints goes to DIR/agent/output.log: append-only, addressed by byte offsets, kept across
agent restarts and checkpoint/restore, bounded by a cap that ends it with a marker line instead of losing bytes.

Theory of operation: one selector loop (Reactor) owns the control socket, the workload's PTY or pipes, the file
workers and every background job. Each connection carries one request line, parsed by one strict parser per verb
into frozen params, and gets one response line within the 5 s handler bound; work that takes longer is started and
then long-polled. Lifecycle facts go to the outbox (DIR/agent/events.jsonl) for supervisors.

Stdlib only: this file is copied unchanged into images that have nothing but python3 (Debian bookworm, 3.11).
The file reads top to bottom: constants, exceptions, types, pure cores (no I/O), I/O adapters (the runtime
identity, archives, confined files, file workers), workloads, the serve loop, the `call` client, `main()`.
"""

from __future__ import annotations

import argparse
import array
import base64
import codecs
import collections
import contextlib
import ctypes
import dataclasses
import enum
import errno
import fcntl
import io
import json
import os
import re
import select
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO, Callable, Iterable, Iterator, NoReturn, Optional, cast


class LazyModule:
    """A standard module imported at its first use, not at the agent's start: an idle shell
    session may never archive, upload or hash, and every module loaded stays resident for the
    session's life (bench/README.md, "an idle session's memory"). The first use puts the module
    itself in its place."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        module = __import__(self._name)
        globals()[self._name] = module
        return getattr(module, attribute)


if TYPE_CHECKING:
    import hashlib
    import secrets
    import shutil
    import tarfile
    import traceback
else:
    hashlib, secrets, shutil, tarfile, traceback = map(LazyModule, ("hashlib", "secrets", "shutil", "tarfile", "traceback"))

# ======================================================================================================================
# Constants
# ======================================================================================================================

#: Reploy's release: one value in all four role files (a test checks), named by the offline bundle.
__version__ = "0.1.0"

KIB = 1024
MIB = 1024 * KIB

#: DIR/agent: the agent's own files (the names below), mode 0700, out of the workload's reach.
AGENT_DIR_NAME = "agent"
SOCKET_NAME = "control.sock"  #: the control socket, DIR/agent/control.sock
LOG_NAME = "output.log"  #: the output log, DIR/agent/output.log
OUTBOX_NAME = "events.jsonl"  #: the lifecycle outbox, DIR/agent/events.jsonl
AGENT_STATE_NAME = "agent-state.json"  #: workload state that must survive restarts (the --continue flag)
CHECKPOINT_PREFIX = "checkpoint-"  #: DIR/agent/checkpoint-<id>.tar
SOCKET_MODE = 0o600
PRIVATE_DIR_MODE = 0o700
#: DIR itself: the runtime user passes through it to its workspace, and nobody but the agent may change it.
SESSION_DIR_MODE = 0o755

# Control socket
#: One request line, newline excluded: room for an exec's argv up to the kernel's ARG_MAX and its inline stdin as
#: base64 (serve checks its own lines against this before it sends them).
MAX_REQUEST_BYTES = 8 * MIB
CLIENT_IDLE_TIMEOUT_S = 5.0  #: a client must send its request line (and take its response) within this
HANDLER_TIMEOUT_S = 5.0  #: every request is answered within this, if need be with `timeout`
MAX_ID_CHARS = 256
RECV_BYTES = 64 * KIB
SPLICE_BYTES = 512 * KIB  #: one read of a relayed connection, into one buffer it reuses (ModelRelay)
MAX_ACCEPTS_PER_WAKEUP = 64  #: keeps one burst of clients from starving the PTY and pipes
LISTEN_BACKLOG = 128
CALL_TIMEOUT_S = HANDLER_TIMEOUT_S + 5.0  #: the `call` client outwaits the server's own bound

# read
MIN_READ_BYTES = 4  #: room for one whole UTF-8 code point
DEFAULT_READ_BYTES = 64 * KIB
MAX_READ_BYTES = 512 * KIB
MAX_READ_WAIT_MS = 4000  #: a long-poll ends before HANDLER_TIMEOUT_S would
#: read_fd: a window's bytes never cross the socket (its client preads them from the descriptor the answer carries),
#: so one may span the whole log; the client bounds what it takes with max_bytes.
MAX_LOG_WINDOW_BYTES = 2**63 - 1

# Queues (the agent's prompts and the shell's held messages share one bounded queue type)
MAX_PROMPT_BYTES = 1 * MIB
#: An agent prompt is one argv element of the agent command: Linux refuses one of MAX_ARG_STRLEN (128 KiB) or more,
#: so a longer prompt goes to the command's stdin instead.
MAX_ARGV_PROMPT_BYTES = 128 * KIB - 1
#: A message longer than one request line holds is sent as a draft in parts of at most this (UTF-8): escaped as JSON
#: (at most 6 bytes per byte) a part still fits the line.
MAX_MESSAGE_PART_BYTES = 128 * KIB
MAX_OPEN_DRAFTS = 4
DRAFT_IDLE_S = 60.0  #: a draft untouched this long is dropped
MAX_QUEUED_PROMPTS = 64
MAX_QUEUED_BYTES = 8 * MIB

# Shell workload
SHELL_TERM = "xterm-256color"
DEFAULT_COLUMNS = 80
DEFAULT_ROWS = 24
MAX_TERMINAL_SIDE = 65535
PTY_READ_BYTES = 64 * KIB
MAX_PTY_INPUT_BYTES = 4 * MIB  #: accepted for the PTY but not yet written to it
SHELL_POLL_S = 0.05  #: how often the foreground process group is sampled (no event reports its change)
SHELL_SETTLE_S = 0.05  #: the shell must look idle this long before a held message is typed
DEFAULT_SHELL_LOG_CAP_BYTES = 64 * MIB
MIN_LOG_CAP_BYTES = 1 * KIB  #: room for the cap marker line and some output
#: Reset to default in every process the agent spawns, whatever the agent itself inherited (see reset_child_signals).
SPAWN_DEFAULT_SIGNALS = (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGPIPE, signal.SIGHUP)

# Agent workload
DEFAULT_AGENT_ARGV = (
    "claude", "{continue}", "{model}", "--permission-mode", "auto", "-p", "--output-format", "stream-json",
    "--verbose", "--include-partial-messages", "--", "{prompt}",
)
PIPE_READ_BYTES = 64 * KIB
MAX_STREAM_LINE_BYTES = 8 * MIB  #: a stream-json line longer than this is skipped with a marker
DEFAULT_PER_RUN_CAP_BYTES = 16 * MIB
DEFAULT_CUMULATIVE_CAP_BYTES = 256 * MIB
DEFAULT_RUN_TIMEOUT_S = 3600.0
KILL_GRACE_S = 2.0  #: SIGTERM, then SIGKILL after this
PIPE_DRAIN_S = 2.0  #: after the command exits, its pipes get this long to reach EOF
MAX_HELD_STDERR_CHARS = 64 * KIB  #: stderr held back while stdout is mid-line; past this it goes out anyway
MIN_SECRET_CHARS = 4  #: shorter values would redact ordinary text
REDACTED = "[REDACTED]"

# Checkpoint / restore
ARCHIVE_FORMAT = "reploy-agent-checkpoint"
ARCHIVE_VERSION = 2
ARCHIVE_MANIFEST = "reploy-checkpoint.json"
ARCHIVE_LOG = "output.log"
ARCHIVE_TREES = ("workspace", "home")
#: What a checkpoint may hold besides its manifest (the `include` param; all by default). A session whose workspace
#: and log outlive its container (reploy serve keeps both on the session's disk) archives only the home.
ARCHIVE_PARTS = ("log",) + ARCHIVE_TREES
MAX_MANIFEST_BYTES = 64 * KIB
MAX_ARCHIVE_ENTRIES = 200_000
MAX_ARCHIVE_BYTES = 8 * 1024 * MIB
CHECKPOINT_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
REASON_RE = re.compile(r"[a-z][a-z_]{0,31}")  #: a `suspend` reason, as the outbox records it
COPY_CHUNK_BYTES = 1 * MIB
MAX_SPARSE_SEGMENTS = 4096  #: data segments a checkpoint's sparse member maps; past them the rest is stored whole

# exec: commands run beside the workload, each in its own process session
MAX_RUNNING_EXECS = 8  #: one more waits in the queue, started in order as running ones end
MAX_QUEUED_EXECS = 64  #: one more is refused with server_unavailable ("the exec queue is full")
MAX_DETACHED_EXECS = 32  #: detached commands alive at once (they never queue); one more is refused
#: $HOME/.reploy/detached: where a detached exec's stdout and stderr go, files of the runtime user named by its id
DETACHED_OUTPUT_DIR = (".reploy", "detached")
#: kill_command's passes over an exec's processes: each pass kills what the last one found, and what they forked or
#: orphaned meanwhile comes up in the next; a command forking faster than that is bounded by the pid limit.
KILL_PASSES = 64
PR_SET_CHILD_SUBREAPER = 36  #: prctl(2), linux/prctl.h
PR_CAPBSET_DROP = 24  #: prctl(2), linux/prctl.h
CAP_SETPCAP = 8  #: capability(7): what dropping a capability from the bounding set takes
MAX_CAPABILITIES = 64  #: capability numbers PR_CAPBSET_DROP is tried with; past the kernel's last one it says EINVAL
#: All of the agent's environment the file-worker zygote (and so every worker) gets: they run as the runtime user,
#: who may read their /proc/PID/environ, and need nothing of it (no --redact-env credentials, above all).
ZYGOTE_ENV_NAMES = ("PATH", "LANG", "LC_ALL")
MAX_FINISHED_EXECS = 64  #: finished results kept for exec_wait; the oldest goes first
FINISHED_EXEC_KEEP_S = 300.0  #: a finished result nobody released is dropped after this
MAX_EXEC_TIMEOUT_MS = 24 * 3600 * 1000  #: no timeout given: none (the command runs until it ends or is killed)
DEFAULT_EXEC_OUTPUT_CAP_BYTES = 1 * MIB  #: per stream; more is read and discarded, `truncated` says so
#: Per stream; past EXEC_HELD_BYTES it is spooled to an unnamed file in the agent's dir (the session's disk).
MAX_EXEC_OUTPUT_CAP_BYTES = 16 * MIB
EXEC_HELD_BYTES = 1 * MIB  #: per stream, held in memory; past it output is spooled (ExecOutput)
MAX_EXEC_ARGS_BYTES = 2 * MIB  #: argv and env, each: the kernel's ARG_MAX (more fails to start: `cannot run`)
#: Inline stdin travels inside the request line; more comes from a file (`stdin_path`: upload it first).
MAX_EXEC_STDIN_BYTES = 4 * MIB
MAX_EXEC_ENV_VARS = 256
EXEC_PAGE_BYTES = 256 * KIB  #: output per stream in one exec_wait answer: two pages stay under 1 MiB as base64
EXEC_DRAIN_POLL_S = 0.02  #: after an exec's command exits, how often what it left is looked for and killed
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
HANDLE_ID_RE = re.compile(r"[0-9a-f]{16}")  #: exec and transfer ids
SHA256_HEX_RE = re.compile(r"[0-9a-f]{64}")

# Files: paths below the workspace or home; their bytes pass as descriptors (TransferTable), never in a line
MAX_WRITE_PART_BYTES = 752 * KIB  #: a `write` part serve sends: its base64 and JSON stay under MAX_REQUEST_BYTES
MAX_TRANSFER_BYTES = 8 * 1024 * MIB  #: one upload (a file or a tar's content) or one downloaded tree
MIN_FREE_BYTES = 16 * MIB  #: an upload never leaves less than this free on the file system it fills
#: The agent's own spools (a checkpoint's archive) may use what the file system keeps for root, all but this:
#: room for the log and the outbox meanwhile.
MIN_FREE_RESERVED_BYTES = 1 * MIB
#: An event the workload can provoke (egress) is written only while the disk has its line and this much more free
#: beyond what is kept for root (the blocks a line may take besides its bytes): it never takes the reserve.
EVENT_ROOM_BYTES = 64 * KIB
MAX_OPEN_TRANSFERS = 16  #: uploads and downloads open at once
TRANSFER_IDLE_S = 60.0  #: an upload untouched (and its staging not grown) this long is closed; a tar pipe unread too
TRANSFER_WAIT_S = 4.0  #: how long upload_commit waits for a background job before answering
STAGING_POLL_S = 0.01  #: how often an upload's digest looks for more bytes while its client writes (StagingDigest)
TAR_PIPE_BYTES = 1 * MIB  #: the capacity asked for a directory download's pipe (the kernel may give less)
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
MAX_LIST_ENTRIES = 1000  #: per `list` answer (also bounded by LIST_PAGE_BYTES)
LIST_PAGE_BYTES = 512 * KIB
DEFAULT_FILE_MODE = 0o644
SANE_MODE_MASK = 0o755  #: uploaded modes keep read and execute bits; setuid, setgid, sticky and g/o write go
OUTGOING_MODE_MASK = 0o777  #: tar members going out (downloads, checkpoints) never carry setuid, setgid or sticky
STAGING_PREFIX = ".reploy-upload-"
CONTAINER_ROOT = Path("/")  #: where an absolute path starts (FileRoot.CONTAINER)  #: the spare name an upload is linked under beside its target, then renamed

# Privilege separation: the workload runs as the runtime user; file work on its trees is done by workers that are it
WORKER_PACKET_BYTES = 64 * KIB  #: one message between the agent and a file worker (SOCK_SEQPACKET)
MAX_WORKER_FDS = 1  #: file descriptors one message may carry
MAX_WORKER_MESSAGE_CHARS = 2000  #: an error message a worker sends, cut to this
CHILD_REPORT_BYTES = 2 * MAX_WORKER_MESSAGE_CHARS  #: the most read of what a child's preparation reports
#: A worker that says nothing for this long is given up (its socket closed): a tree walk sends as it goes, an
#: upload's commit only at its end, after extracting up to MAX_TRANSFER_BYTES.
WORKER_SILENCE_S = 600.0
WORKER_START_S = 5.0  #: handing a worker's socket to the zygote and hearing it took it; else it is replaced
#: The zygote ends once no operation has been open for this long (--file-worker-linger): an idle session then holds
#: no second interpreter (about 10 MiB), and the next operation starts a new one. Well under serve's --idle-after.
DEFAULT_FILE_WORKER_LINGER_S = 30.0
MAX_WORKER_JOBS = 32  #: file operations in flight at once; one more is refused with server_unavailable
MAX_HELD_EVENTS = 1024  #: outbox events a full disk refused, kept to write once it can


# ======================================================================================================================
# Exceptions, split by blame. Each carries the wire error code it becomes.
# ======================================================================================================================


class AgentError(Exception):
    """Root of everything this file raises on purpose."""

    code = "command_error"


class RequestError(AgentError):
    """The peer's fault: the request itself is wrong, whatever the session's state."""

    code = "invalid_request"

    def __init__(self, message: str, request_id: str = "") -> None:
        super().__init__(message)
        self.request_id = request_id


class CommandError(AgentError):
    """A valid request that the session's current state refuses, or that failed while carried out."""

    code = "command_error"


class UnavailableError(AgentError):
    """Transient: the session cannot take this now (queue full, admission closed, restoring, stopping)."""

    code = "server_unavailable"


class HandlerTimeout(AgentError):
    """The request could not be answered within HANDLER_TIMEOUT_S."""

    code = "timeout"


class ArchiveError(AgentError):
    """A checkpoint archive is malformed or hostile; nothing was changed."""

    code = "command_error"


class WorkerProtocolError(CommandError):
    """A file worker (the runtime user's, so possibly the workload's puppet) answered something the protocol does not
    allow; the operation fails, nothing else changes."""


class DiskFullError(AgentError):
    """The session's disk (or the file system the write goes to) cannot take the bytes: ENOSPC, or a check that
    would leave less than MIN_FREE_BYTES."""

    code = "disk_full"


class StartupError(AgentError):
    """The environment prevents serving: a live owner holds the socket, a path is unusable, a restore failed."""


class UsageError(AgentError):
    """Bad command-line arguments (exit 2)."""


# ======================================================================================================================
# Enums and frozen dataclasses
# ======================================================================================================================


class WorkloadKind(enum.Enum):
    SHELL = "shell"
    AGENT = "agent"


class Method(enum.Enum):
    MESSAGE = "message"
    INTERRUPT = "interrupt"
    RELAUNCH = "relaunch"
    STATUS = "status"
    READ = "read"
    READ_FD = "read_fd"
    WRITE = "write"
    RESIZE = "resize"
    CHECKPOINT = "checkpoint"
    RESTORE = "restore"
    SUSPEND = "suspend"
    EGRESS_NOTE = "egress_note"
    EXEC = "exec"
    EXEC_WAIT = "exec_wait"
    EXEC_KILL = "exec_kill"
    STAT = "stat"
    LIST = "list"
    UPLOAD = "upload"
    UPLOAD_COMMIT = "upload_commit"
    DOWNLOAD = "download"
    TRANSFER_CLOSE = "transfer_close"


#: The verbs whose answer carries a file descriptor (TransferTable, OutputLog.reader): a unix socket's client's only.
DESCRIPTOR_METHODS = frozenset({Method.UPLOAD, Method.DOWNLOAD, Method.READ_FD})


class FileRoot(enum.Enum):
    """Where a file verb's path starts: the workspace, the home, or the container's `/` (an absolute path; what the
    runtime user can reach there, the kernel decides, as it does for the workload)."""

    WORKSPACE = "workspace"
    HOME = "home"
    CONTAINER = "container"


class UploadKind(enum.Enum):
    FILE = "file"  # the bytes become one regular file at the path
    TAR = "tar"  # the bytes are a tar archive, extracted into the directory at the path


class TurnState(enum.Enum):
    IDLE = "idle"  # nothing running, nothing held
    IN_PROGRESS = "in_progress"  # a shell job or an agent run is executing
    WAITING = "waiting"  # nothing executing, but work is held or the workload cannot run (exited, restoring)


class Delivery(enum.Enum):
    DISPATCHED = "dispatched"
    QUEUED = "queued"
    DRAFTED = "drafted"  # a part of a long message, kept until its last part arrives


class Outcome(enum.Enum):
    COMPLETED = "completed"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


class EventKind(enum.Enum):
    SESSION_START = "session_start"
    SESSION_END = "session_end"
    TURN_START = "turn_start"
    TURN_END = "turn_end"
    RELAUNCH = "relaunch"
    CHECKPOINT = "checkpoint"
    RESTORE = "restore"
    SUSPEND = "suspend"
    EGRESS = "egress"


class EgressDecision(enum.Enum):
    """What serve's egress proxy did with one connection of the workload's (an `egress` event)."""

    ALLOWED = "allowed"
    REFUSED = "refused"


@dataclasses.dataclass(frozen=True)
class NoParams:
    """The params of a verb that takes none."""


@dataclasses.dataclass(frozen=True)
class MessageParams:
    """`message`: one part of a typed message."""

    text: str
    draft_id: Optional[str]  # the draft this part continues
    more: bool  # whether more parts follow (then the text is kept in a draft, not delivered)


@dataclasses.dataclass(frozen=True)
class ReadParams:
    offset_bytes: int
    max_bytes: int
    wait_ms: int


@dataclasses.dataclass(frozen=True)
class WriteParams:
    """`write`: raw bytes for the workload's input."""

    data: bytes


@dataclasses.dataclass(frozen=True)
class ResizeParams:
    """`resize`: the PTY's new size."""

    columns: int
    rows: int


@dataclasses.dataclass(frozen=True)
class CheckpointParams:
    """`checkpoint`: the archive's id and what goes in it."""

    checkpoint_id: str
    include: tuple[str, ...]  # of ARCHIVE_PARTS, in that order


@dataclasses.dataclass(frozen=True)
class RestoreParams:
    """`restore`: the archive to install, a path in DIR/agent."""

    path: str


@dataclasses.dataclass(frozen=True)
class SuspendParams:
    """`suspend`: why serve is about to pause the session."""

    reason: str


@dataclasses.dataclass(frozen=True)
class EgressNoteParams:
    """`egress_note`: one connection serve's egress proxy handled, for the outbox."""

    decision: EgressDecision
    host: Optional[str]  # None: the proxy could not read the request's host
    port: int
    reason: Optional[str]  # why it was refused, or why the proxy ended an allowed one (idle)
    bytes_up: int
    bytes_down: int
    count: Optional[int]  # a summary of this many refused connections, not noted one by one


@dataclasses.dataclass(frozen=True)
class Where:
    """A path a request named: where it starts and its components below that; () is the root itself."""

    root: FileRoot
    parts: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ExecParams:
    """`exec`: a command to run beside the workload, and its bounds."""

    argv: tuple[str, ...]
    cwd: Where  # relative: below the workspace; absolute: from the container's `/`
    env: tuple[tuple[str, str], ...]
    stdin: Optional[bytes]  # None: stdin_path, or /dev/null
    stdin_path: Optional[Where]  # a file the command reads as its stdin, opened as the runtime user
    timeout_ms: Optional[int]  # None: no timeout
    output_cap_bytes: int
    detach: bool  # started and left running: output to files (DETACHED_OUTPUT_DIR), killed with the session


@dataclasses.dataclass(frozen=True)
class ExecWaitParams:
    """`exec_wait`: a long-poll of one command's output and end."""

    exec_id: str
    wait_ms: int
    stdout_offset_bytes: int
    stderr_offset_bytes: int
    max_bytes: int
    release: bool


@dataclasses.dataclass(frozen=True)
class HandleParams:
    """exec_kill and transfer_close name what they end."""

    handle_id: str


@dataclasses.dataclass(frozen=True)
class PathParams:
    """`stat` and `download`: one path of the workspace or home."""

    root: FileRoot
    path: tuple[str, ...]  # components below the root; () is the root itself


@dataclasses.dataclass(frozen=True)
class ListParams:
    """`list`: one page of a directory's entries."""

    root: FileRoot
    path: tuple[str, ...]
    offset: int  # entries to skip, in name order
    limit: int


@dataclasses.dataclass(frozen=True)
class UploadParams:
    """`upload`: where a file or tree goes, and what it announces."""

    root: FileRoot
    path: tuple[str, ...]
    kind: UploadKind
    mode: Optional[int]  # kind file: the new file's mode (made sane); None: 0644
    size_bytes: Optional[int]  # announced total, checked against limits and free space up front


@dataclasses.dataclass(frozen=True)
class UploadCommitParams:
    """`upload_commit`: the staging to install, checked against its digest."""

    transfer_id: str
    sha256: Optional[str]  # when given, the staged bytes must have this digest


Params = (NoParams | MessageParams | ReadParams | WriteParams | ResizeParams | CheckpointParams | RestoreParams
          | SuspendParams | EgressNoteParams | ExecParams | ExecWaitParams | HandleParams | PathParams | ListParams
          | UploadParams | UploadCommitParams)


@dataclasses.dataclass(frozen=True)
class Request:
    """One request line, parsed: its id, verb and params."""

    request_id: str
    method: Method
    params: Params
    keep: bool = False  # the connection stays open for the client's next request once this one is answered


@dataclasses.dataclass(frozen=True)
class LogWindow:
    """What `read_fd` answers besides its descriptor: bytes [offset_bytes, next_offset_bytes) of the log are there,
    and never change (the log only grows), and the log's length then."""

    offset_bytes: int
    next_offset_bytes: int
    length_bytes: int
    reset: bool  # the requested offset was past the end; next_offset_bytes is the current length


@dataclasses.dataclass(frozen=True)
class LogSlice:
    """What `read` answers: the bytes at [offset_bytes, next_offset_bytes) and the log's length."""

    offset_bytes: int
    data: bytes
    next_offset_bytes: int
    length_bytes: int
    reset: bool  # the requested offset was past the end; next_offset_bytes is the current length


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The first member of a checkpoint archive: what it holds and for which workload. `log_bytes` is the log's
    length at the checkpoint, whether or not the archive holds the log."""

    checkpoint_id: str
    workload: WorkloadKind
    log_bytes: int
    continue_conversation: bool
    include: tuple[str, ...] = ARCHIVE_PARTS

    def to_json(self) -> bytes:
        return json.dumps({
            "format": ARCHIVE_FORMAT, "version": ARCHIVE_VERSION, "id": self.checkpoint_id,
            "workload": self.workload.value, "log_bytes": self.log_bytes, "continue": self.continue_conversation,
            "include": list(self.include),
        }).encode()

    @property
    def trees(self) -> tuple[str, ...]:
        return tuple(part for part in self.include if part in ARCHIVE_TREES)


@dataclasses.dataclass(frozen=True)
class Identity:
    """A uid:gid pair: the runtime user the workload runs as."""

    uid: int
    gid: int

    def __str__(self) -> str:
        return f"{self.uid}:{self.gid}"


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Everything `serve` was told; built once from the command line."""

    session_dir: Path
    workload: WorkloadKind
    shell: str = "/bin/sh"
    agent_argv: tuple[str, ...] = DEFAULT_AGENT_ARGV
    model: Optional[str] = None
    workspace: Optional[Path] = None  # default DIR/workspace
    home: Optional[Path] = None  # default DIR/home
    redact_env: tuple[str, ...] = ()
    run_timeout_s: float = DEFAULT_RUN_TIMEOUT_S
    per_run_cap_bytes: int = DEFAULT_PER_RUN_CAP_BYTES
    cumulative_cap_bytes: int = DEFAULT_CUMULATIVE_CAP_BYTES
    shell_log_cap_bytes: int = DEFAULT_SHELL_LOG_CAP_BYTES
    restore_path: Optional[Path] = None
    await_restore: bool = False
    listen: Optional[tuple[str, int]] = None  # --listen HOST:PORT: also serve the protocol over TCP
    #: --runtime-user: who the workload and the file workers run as; None when they run as the agent itself
    runtime_user: Optional[Identity] = None
    #: --model-relay PORT: relay 127.0.0.1:PORT to serve's credential proxy (see "The model relay")
    model_relay_port: Optional[int] = None
    #: --egress-relay PORT: relay 127.0.0.1:PORT to serve's egress proxy (the session's HTTP(S)_PROXY)
    egress_relay_port: Optional[int] = None
    file_worker_linger_s: float = DEFAULT_FILE_WORKER_LINGER_S

    @property
    def agent_dir(self) -> Path:
        """DIR/agent: the socket, log, outbox, state, checkpoints and download spools."""
        return self.session_dir / AGENT_DIR_NAME

    @property
    def workspace_dir(self) -> Path:
        return self.workspace or self.session_dir / "workspace"

    @property
    def home_dir(self) -> Path:
        return self.home or self.session_dir / "home"

    @property
    def trees(self) -> dict[str, Path]:
        """Archive tree name -> the directory it holds."""
        return {"workspace": self.workspace_dir, "home": self.home_dir}

    def root_dir(self, root: FileRoot) -> Path:
        """The directory a file verb's path (or an exec's cwd) starts from."""
        return {FileRoot.WORKSPACE: self.workspace_dir, FileRoot.HOME: self.home_dir,
                FileRoot.CONTAINER: CONTAINER_ROOT}[root]

    @property
    def log_cap_bytes(self) -> int:
        if self.workload is WorkloadKind.SHELL:
            return self.shell_log_cap_bytes
        return self.cumulative_cap_bytes


# ======================================================================================================================
# Strict JSON, the first parser any peer's bytes meet. The same section, word for word, is in
# agent.py, reploy_session_client.py and reploy_watchdog.py: each role file runs alone
# (tests/test_strict_json.py keeps the copies identical).
# ======================================================================================================================


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


# ======================================================================================================================
# Pure core: the request codec (framing, one validating parser, response encoding)
# ======================================================================================================================


class RequestFramer:
    """Collects one request line: at most MAX_REQUEST_BYTES, newline-terminated, nothing after (a kept connection's
    next request comes only once its answer is in: requests are never pipelined)."""

    def __init__(self, max_bytes: int = MAX_REQUEST_BYTES) -> None:
        self._max_bytes = max_bytes
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Optional[bytes]:
        """Returns the line (without its newline) once complete, else None; RequestError when it cannot be one."""
        scan_from = len(self._buffer)
        self._buffer += data
        newline = self._buffer.find(b"\n", scan_from)
        if newline < 0:
            if len(self._buffer) > self._max_bytes:
                raise RequestError(f"request line exceeds {self._max_bytes} bytes")
            return None
        if newline > self._max_bytes:
            raise RequestError(f"request line exceeds {self._max_bytes} bytes")
        if newline + 1 != len(self._buffer):
            raise RequestError("one request at a time: data follows the request line")
        return bytes(self._buffer[:newline])

    @property
    def empty(self) -> bool:
        return not self._buffer

    def eof(self) -> NoReturn:
        """The client closed its side before a newline."""
        if self._buffer:
            raise RequestError("request line must end with a newline")
        raise RequestError("empty request")


class _FieldKind(enum.Enum):
    TEXT = "text"  # non-empty string
    INT = "int"
    BOOL = "bool"
    BASE64 = "base64"  # string of standard base64 -> bytes; `high`, when set, bounds the decoded length
    CHECKPOINT_ID = "checkpoint_id"
    REASON = "reason"
    HANDLE = "handle"  # an exec or transfer id
    SHA256 = "sha256"  # 64 lowercase hex digits
    CHOICE = "choice"  # one value of the enum in `choices`
    PATH = "path"  # a path below a root -> its components (see parse_relative_path)
    WHERE = "where"  # a path below the workspace, or absolute -> Where (see parse_where)
    ARGV = "argv"  # non-empty array of strings -> tuple
    ENV = "env"  # object of variable name -> string -> tuple of pairs
    PARTS = "parts"  # non-empty array of distinct ARCHIVE_PARTS -> tuple in ARCHIVE_PARTS order


@dataclasses.dataclass(frozen=True)
class _Field:
    """One field of a verb's params: its wire name, attribute, kind and bounds."""

    wire_name: str
    attr: str
    kind: _FieldKind
    default: Any = None  # None: required (unless optional)
    low: int = 0
    high: int = 0
    optional: bool = False  # absent -> None
    choices: Optional[type[enum.Enum]] = None


#: The parameters each method accepts: the one table the parser reads. Unknown fields are rejected.
_PARAM_SCHEMAS: dict[Method, tuple[type, tuple[_Field, ...]]] = {
    Method.MESSAGE: (MessageParams, (
        _Field("text", "text", _FieldKind.TEXT),
        _Field("draft", "draft_id", _FieldKind.HANDLE, optional=True),
        _Field("more", "more", _FieldKind.BOOL, False),
    )),
    Method.INTERRUPT: (NoParams, ()),
    Method.RELAUNCH: (NoParams, ()),
    Method.STATUS: (NoParams, ()),
    Method.READ: (ReadParams, (
        _Field("offset", "offset_bytes", _FieldKind.INT, 0, 0, 2**63 - 1),
        _Field("max_bytes", "max_bytes", _FieldKind.INT, DEFAULT_READ_BYTES, MIN_READ_BYTES, MAX_READ_BYTES),
        _Field("wait_ms", "wait_ms", _FieldKind.INT, 0, 0, MAX_READ_WAIT_MS),
    )),
    Method.READ_FD: (ReadParams, (
        _Field("offset", "offset_bytes", _FieldKind.INT, 0, 0, 2**63 - 1),
        _Field("max_bytes", "max_bytes", _FieldKind.INT, MAX_LOG_WINDOW_BYTES, MIN_READ_BYTES, MAX_LOG_WINDOW_BYTES),
        _Field("wait_ms", "wait_ms", _FieldKind.INT, 0, 0, MAX_READ_WAIT_MS),
    )),
    Method.WRITE: (WriteParams, (_Field("data_b64", "data", _FieldKind.BASE64),)),
    Method.RESIZE: (ResizeParams, (
        _Field("columns", "columns", _FieldKind.INT, None, 1, MAX_TERMINAL_SIDE),
        _Field("rows", "rows", _FieldKind.INT, None, 1, MAX_TERMINAL_SIDE),
    )),
    Method.CHECKPOINT: (CheckpointParams, (
        _Field("id", "checkpoint_id", _FieldKind.CHECKPOINT_ID),
        _Field("include", "include", _FieldKind.PARTS, ARCHIVE_PARTS),
    )),
    Method.RESTORE: (RestoreParams, (_Field("path", "path", _FieldKind.TEXT),)),
    Method.SUSPEND: (SuspendParams, (_Field("reason", "reason", _FieldKind.REASON),)),
    Method.EGRESS_NOTE: (EgressNoteParams, (
        _Field("decision", "decision", _FieldKind.CHOICE, choices=EgressDecision),
        _Field("host", "host", _FieldKind.TEXT, optional=True),
        _Field("port", "port", _FieldKind.INT, 0, 0, 65535),
        _Field("reason", "reason", _FieldKind.TEXT, optional=True),
        _Field("bytes_up", "bytes_up", _FieldKind.INT, 0, 0, 2**63 - 1),
        _Field("bytes_down", "bytes_down", _FieldKind.INT, 0, 0, 2**63 - 1),
        _Field("count", "count", _FieldKind.INT, None, 1, 2**63 - 1, optional=True),
    )),
    Method.EXEC: (ExecParams, (
        _Field("argv", "argv", _FieldKind.ARGV),
        _Field("cwd", "cwd", _FieldKind.WHERE, Where(FileRoot.WORKSPACE, ())),
        _Field("env", "env", _FieldKind.ENV, ()),
        _Field("stdin_b64", "stdin", _FieldKind.BASE64, high=MAX_EXEC_STDIN_BYTES, optional=True),
        _Field("stdin_path", "stdin_path", _FieldKind.WHERE, optional=True),
        _Field("timeout_ms", "timeout_ms", _FieldKind.INT, None, 1, MAX_EXEC_TIMEOUT_MS, optional=True),
        _Field("output_cap_bytes", "output_cap_bytes", _FieldKind.INT, DEFAULT_EXEC_OUTPUT_CAP_BYTES, 0,
               MAX_EXEC_OUTPUT_CAP_BYTES),
        _Field("detach", "detach", _FieldKind.BOOL, False),
    )),
    Method.EXEC_WAIT: (ExecWaitParams, (
        _Field("exec_id", "exec_id", _FieldKind.HANDLE),
        _Field("wait_ms", "wait_ms", _FieldKind.INT, 0, 0, MAX_READ_WAIT_MS),
        _Field("stdout_offset", "stdout_offset_bytes", _FieldKind.INT, 0, 0, MAX_EXEC_OUTPUT_CAP_BYTES),
        _Field("stderr_offset", "stderr_offset_bytes", _FieldKind.INT, 0, 0, MAX_EXEC_OUTPUT_CAP_BYTES),
        _Field("max_bytes", "max_bytes", _FieldKind.INT, EXEC_PAGE_BYTES, 0, EXEC_PAGE_BYTES),
        _Field("release", "release", _FieldKind.BOOL, False),
    )),
    Method.EXEC_KILL: (HandleParams, (_Field("exec_id", "handle_id", _FieldKind.HANDLE),)),
    Method.STAT: (PathParams, (
        _Field("root", "root", _FieldKind.CHOICE, FileRoot.WORKSPACE, choices=FileRoot),
        _Field("path", "path", _FieldKind.PATH, ()),
    )),
    Method.LIST: (ListParams, (
        _Field("root", "root", _FieldKind.CHOICE, FileRoot.WORKSPACE, choices=FileRoot),
        _Field("path", "path", _FieldKind.PATH, ()),
        _Field("offset", "offset", _FieldKind.INT, 0, 0, 2**31 - 1),
        _Field("limit", "limit", _FieldKind.INT, MAX_LIST_ENTRIES, 1, MAX_LIST_ENTRIES),
    )),
    Method.UPLOAD: (UploadParams, (
        _Field("root", "root", _FieldKind.CHOICE, FileRoot.WORKSPACE, choices=FileRoot),
        _Field("path", "path", _FieldKind.PATH, ()),
        _Field("kind", "kind", _FieldKind.CHOICE, UploadKind.FILE, choices=UploadKind),
        _Field("mode", "mode", _FieldKind.INT, None, 0, 0o7777, optional=True),
        _Field("size", "size_bytes", _FieldKind.INT, None, 0, 2**63 - 1, optional=True),
    )),
    Method.UPLOAD_COMMIT: (UploadCommitParams, (
        _Field("transfer_id", "transfer_id", _FieldKind.HANDLE),
        _Field("sha256", "sha256", _FieldKind.SHA256, optional=True),
    )),
    Method.DOWNLOAD: (PathParams, (
        _Field("root", "root", _FieldKind.CHOICE, FileRoot.WORKSPACE, choices=FileRoot),
        _Field("path", "path", _FieldKind.PATH, ()),
    )),
    Method.TRANSFER_CLOSE: (HandleParams, (_Field("transfer_id", "handle_id", _FieldKind.HANDLE),)),
}


def _convert_field(field: _Field, value: Any) -> Any:
    """One parameter value, checked against its kind and range."""
    where = f"params.{field.wire_name}"
    if field.kind is _FieldKind.INT:
        if not isinstance(value, int) or isinstance(value, bool):
            raise RequestError(f"{where} must be an integer")
        if not field.low <= value <= field.high:
            raise RequestError(f"{where} must be between {field.low} and {field.high}")
        return value
    if field.kind is _FieldKind.BOOL:
        if not isinstance(value, bool):
            raise RequestError(f"{where} must be true or false")
        return value
    if field.kind is _FieldKind.ARGV:
        return _convert_argv(where, value)
    if field.kind is _FieldKind.ENV:
        return _convert_env(where, value)
    if field.kind is _FieldKind.PARTS:
        return _convert_parts(where, value)
    if not isinstance(value, str):
        raise RequestError(f"{where} must be a string")
    if field.kind is _FieldKind.TEXT:
        if not value:
            raise RequestError(f"{where} must not be empty")
        return value
    if field.kind is _FieldKind.PATH:
        return parse_relative_path(value, where)
    if field.kind is _FieldKind.WHERE:
        return parse_where(value, where)
    if field.kind is _FieldKind.CHOICE:
        assert field.choices is not None
        try:
            return field.choices(value)
        except ValueError:
            raise RequestError(f"{where} must be one of {', '.join(c.value for c in field.choices)}") from None
    patterns = {_FieldKind.CHECKPOINT_ID: CHECKPOINT_ID_RE, _FieldKind.REASON: REASON_RE,
                _FieldKind.HANDLE: HANDLE_ID_RE, _FieldKind.SHA256: SHA256_HEX_RE}
    if field.kind in patterns:
        if not patterns[field.kind].fullmatch(value):
            raise RequestError(f"{where} must match {patterns[field.kind].pattern}")
        return value
    try:
        data = base64.b64decode(value, validate=True)
    except ValueError as e:
        raise RequestError(f"{where} is not valid base64") from e
    if field.high and len(data) > field.high:
        raise RequestError(f"{where} decodes to {len(data)} bytes; the limit is {field.high}")
    return data


def _convert_argv(where: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(arg, str) for arg in value):
        raise RequestError(f"{where} must be a non-empty array of strings")
    if not value[0] or any("\0" in arg for arg in value):
        raise RequestError(f"{where}: the program must be named and no argument may hold a NUL")
    if sum(len(arg.encode("utf-8", "surrogatepass")) + 1 for arg in value) > MAX_EXEC_ARGS_BYTES:
        raise RequestError(f"too large: {where} exceeds {MAX_EXEC_ARGS_BYTES} bytes")
    return tuple(value)


def _convert_env(where: str, value: Any) -> tuple[tuple[str, str], ...]:
    """Extra variables for an exec; HOME is the session's and cannot be replaced."""
    if not isinstance(value, dict) or len(value) > MAX_EXEC_ENV_VARS:
        raise RequestError(f"{where} must be an object of at most {MAX_EXEC_ENV_VARS} variables")
    size_bytes = 0
    for name, text in value.items():
        if not ENV_NAME_RE.fullmatch(name) or name == "HOME":
            raise RequestError(f"{where}: {name!r} is not a variable name an exec may set (HOME is the session's)")
        if not isinstance(text, str) or "\0" in text:
            raise RequestError(f"{where}.{name} must be a string without NUL")
        size_bytes += len(name) + len(text.encode("utf-8", "surrogatepass")) + 2
    if size_bytes > MAX_EXEC_ARGS_BYTES:
        raise RequestError(f"too large: {where} exceeds {MAX_EXEC_ARGS_BYTES} bytes")
    return tuple(value.items())


def _convert_parts(where: str, value: Any) -> tuple[str, ...]:
    """What a checkpoint holds: some of ARCHIVE_PARTS, each once."""
    if (not isinstance(value, list) or not value or not all(isinstance(part, str) for part in value)
            or len(set(value)) != len(value) or not set(value) <= set(ARCHIVE_PARTS)):
        raise RequestError(f"{where} must be a non-empty array of distinct values of {', '.join(ARCHIVE_PARTS)}")
    return tuple(part for part in ARCHIVE_PARTS if part in value)


def _parse_params(method: Method, params: Any) -> Params:
    if not isinstance(params, dict):
        raise RequestError("params must be an object")
    cls, fields = _PARAM_SCHEMAS[method]
    unknown = sorted(set(params) - {field.wire_name for field in fields})
    if unknown:
        raise RequestError(f"unknown params for {method.value}: {', '.join(unknown)}")
    values = {}
    for field in fields:
        if field.wire_name in params:
            values[field.attr] = _convert_field(field, params[field.wire_name])
        elif field.default is None and not field.optional:
            raise RequestError(f"params.{field.wire_name} is required")
        else:
            values[field.attr] = field.default
    return cls(**values)


def parse_request(line: bytes) -> Request:
    """Validates one request line into a Request. RequestError carries the id when one could be read."""
    try:
        document = parse_strict_json(line, MAX_REQUEST_BYTES)
    except StrictJsonError as e:
        raise RequestError(f"request is not a JSON document: {e}") from None
    if not isinstance(document, dict):
        raise RequestError("request must be a JSON object")
    request_id = document.get("id")
    if not isinstance(request_id, str) or len(request_id) > MAX_ID_CHARS:
        raise RequestError(f"id must be a string of at most {MAX_ID_CHARS} characters")
    try:
        unknown = sorted(set(document) - {"id", "method", "params", "keep"})
        if unknown:
            raise RequestError(f"unknown request fields: {', '.join(unknown)}")
        keep = document.get("keep", False)
        if not isinstance(keep, bool):
            raise RequestError("keep must be true or false")
        method_name = document.get("method")
        if not isinstance(method_name, str):
            raise RequestError("method must be a string")
        try:
            method = Method(method_name)
        except ValueError:
            raise RequestError(f"unknown method {method_name!r}") from None
        return Request(request_id, method, _parse_params(method, document.get("params", {})), keep)
    except RequestError as e:
        raise RequestError(str(e), request_id) from e


def _encode_line(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def encode_result(request_id: str, method: Method, fields: dict[str, Any]) -> bytes:
    """A success response: the result is tagged with the method it answers."""
    return _encode_line({"id": request_id, "result": {"type": method.value, **fields}})


def encode_error(request_id: str, code: str, message: str) -> bytes:
    return _encode_line({"id": request_id, "error": {"code": code, "message": message}})


# ======================================================================================================================
# Pure core: text handling (UTF-8 boundaries, the normaliser, the redactor, the stream-json projector)
# ======================================================================================================================


def utf8_prefix(data: bytes, limit_bytes: int) -> bytes:
    """The longest prefix of at most limit_bytes that does not end inside a UTF-8 code point."""
    if len(data) <= limit_bytes:
        return data
    cut = limit_bytes
    # A code point is at most 4 bytes, so at most 3 continuation bytes need backing over.
    while cut > max(limit_bytes - 3, 0) and data[cut] & 0xC0 == 0x80:
        cut -= 1
    return data[:cut]


def is_utf8_boundary(data: bytes, offset_bytes: int) -> bool:
    return offset_bytes >= len(data) or data[offset_bytes] & 0xC0 != 0x80


class Utf8Normaliser:
    """Bytes in, valid text out: a code point split across reads is held, invalid bytes become U+FFFD."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        return self._decoder.decode(data)

    def finish(self) -> str:
        return self._decoder.decode(b"", final=True)


class Redactor:
    """Replaces secret values with [REDACTED] in a text stream, also when a secret is split across feeds.

    It holds back the longest tail that could still grow into a secret, so nothing it emits can later turn out to
    have been the start of one. finish() releases (and redacts) what is held.
    """

    def __init__(self, secrets: Iterable[str]) -> None:
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, self._secrets))) if self._secrets else None
        self._held = ""

    def feed(self, text: str) -> str:
        if self._pattern is None:
            return text
        buffer = self._held + text
        out = []
        position = 0
        while True:
            # From decided_end on, the text may still become (a longer) secret; a match starting before it is final.
            decided_end = len(buffer) - self._undecided_len(buffer[position:])
            match = self._pattern.search(buffer, position)
            if match is None or match.start() >= decided_end:
                break
            out.append(buffer[position:match.start()])
            out.append(REDACTED)
            position = match.end()
        out.append(buffer[position:decided_end])
        self._held = buffer[decided_end:]
        return "".join(out)

    def finish(self) -> str:
        held, self._held = self._held, ""
        return self._pattern.sub(REDACTED, held) if self._pattern else held

    def _undecided_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some secret."""
        return max(self._partial_suffix_len(text, secret) for secret in self._secrets)

    @staticmethod
    def _partial_suffix_len(text: str, secret: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of secret."""
        first = secret[0]
        start = max(len(text) - len(secret) + 1, 0)
        while (index := text.find(first, start)) >= 0:
            if secret.startswith(text[index:]):
                return len(text) - index
            start = index + 1
        return 0


class StreamJsonProjector:
    """Claude Code stream-json stdout in, the text a person reads out.

    Projected: the text of `content_block_start` text blocks and of `text_delta` deltas; a newline at
    `message_stop` when the text so far does not end with one; a `result` text only when nothing else was
    projected, or when the result is an error (`"is_error": true`, whatever its `subtype` says: the CLI says
    "success" there too), which `error_result` then records. Lines that are not JSON objects pass through as text.
    Other events are dropped.
    """

    def __init__(self, max_line_bytes: int = MAX_STREAM_LINE_BYTES) -> None:
        self._max_line_bytes = max_line_bytes
        self._buffer = bytearray()
        self._skipping = False  # inside an over-long line, dropping bytes until its newline
        self.projected_any = False
        self.error_result = False  # the command reported its turn as failed, whatever its exit status
        self._at_line_start = True

    def feed(self, data: bytes) -> str:
        out = []
        self._buffer += data
        while (newline := self._buffer.find(b"\n")) >= 0:
            line = bytes(self._buffer[:newline])
            del self._buffer[:newline + 1]
            if self._skipping:
                self._skipping = False
            else:
                out.append(self._project(line))
        if len(self._buffer) > self._max_line_bytes:
            self._buffer.clear()
            if not self._skipping:
                self._skipping = True
                out.append(self._put(f"\n[reploy: skipped a stream-json line over {self._max_line_bytes} bytes]\n"))
        return "".join(out)

    def finish(self) -> str:
        line = bytes(self._buffer)
        self._buffer.clear()
        return "" if self._skipping or not line else self._project(line)

    def _project(self, line: bytes) -> str:
        try:
            document = parse_strict_json(line, self._max_line_bytes)
        except StrictJsonError:  # not (strict) JSON, so plain text
            document = None
        if not isinstance(document, dict):
            return self._put(line.decode("utf-8", errors="replace") + "\n")
        event = document.get("event") if document.get("type") == "stream_event" else document
        if not isinstance(event, dict):
            return ""
        kind = event.get("type")
        if kind == "content_block_start":
            return self._put(_text_of(event.get("content_block"), "text", "text"))
        if kind == "content_block_delta":
            return self._put(_text_of(event.get("delta"), "text_delta", "text"))
        if kind == "message_stop" and self.projected_any and not self._at_line_start:
            return self._put("\n")
        if kind == "result" and (failed := document.get("is_error") is True):
            self.error_result = True
        if kind == "result" and (failed or not self.projected_any):
            text = document.get("result")
            if isinstance(text, str) and text:
                opening = "" if self._at_line_start else "\n"
                return self._put(opening + (text if text.endswith("\n") else text + "\n"))
        return ""

    def _put(self, text: str) -> str:
        if text:
            self.projected_any = True
            self._at_line_start = text.endswith("\n")
        return text


def _text_of(block: Any, block_type: str, key: str) -> str:
    if isinstance(block, dict) and block.get("type") == block_type and isinstance(block.get(key), str):
        return block[key]
    return ""


class TextPipe:
    """One output stream of a run: bytes -> text (normalised or projected) -> redacted text."""

    def __init__(self, decoder: Utf8Normaliser | StreamJsonProjector, redactor: Redactor) -> None:
        self._decoder = decoder
        self._redactor = redactor

    def feed(self, data: bytes) -> str:
        return self._redactor.feed(self._decoder.feed(data))

    def finish(self) -> str:
        return self._redactor.feed(self._decoder.finish()) + self._redactor.finish()


class LineMerger:
    """Merges a run's stdout and stderr text into one log without tearing lines.

    The two pipes have no order between them, so a diagnostic could land in the middle of a reply line. stdout (the
    reply, streamed as it comes) goes straight through; stderr goes out a whole line at a time, and only while the
    log stands at a line start. What stderr holds back is bounded: past MAX_HELD_STDERR_CHARS it goes out at once,
    after a line break. Each call is told whether the log stands at a line start, since others write to it too.
    """

    def __init__(self, max_held_chars: int = MAX_HELD_STDERR_CHARS) -> None:
        self._max_held_chars = max_held_chars
        self._held = ""  # stderr text not yet passed on

    def stdout(self, text: str, at_line_start: bool) -> str:
        if text:
            at_line_start = text.endswith("\n")
        return text + self._release(at_line_start, whole_lines_only=True)

    def stderr(self, text: str, at_line_start: bool) -> str:
        self._held += text
        return self._release(at_line_start, whole_lines_only=len(self._held) <= self._max_held_chars)

    def finish(self, at_line_start: bool) -> str:
        """Everything still held, once both pipes are done."""
        return self._release(at_line_start, whole_lines_only=False)

    def _release(self, at_line_start: bool, whole_lines_only: bool) -> str:
        if whole_lines_only and not at_line_start:
            return ""
        cut = self._held.rfind("\n") + 1 if whole_lines_only else len(self._held)
        if not cut:
            return ""
        out = ("" if at_line_start else "\n") + self._held[:cut]
        self._held = self._held[cut:]
        return out


# ======================================================================================================================
# Pure core: the bounded queue, the command template
# ======================================================================================================================


class PromptQueue:
    """FIFO of pending texts with three limits, each its own error: one item's size, the count, the total size."""

    def __init__(self, max_item_bytes: int = MAX_PROMPT_BYTES, max_items: int = MAX_QUEUED_PROMPTS,
                 max_total_bytes: int = MAX_QUEUED_BYTES) -> None:
        self._max_item_bytes = max_item_bytes
        self._max_items = max_items
        self._max_total_bytes = max_total_bytes
        self._items: collections.deque[str] = collections.deque()
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def push(self, text: str) -> None:
        size = len(text.encode())
        if size > self._max_item_bytes:
            raise RequestError(f"message is {size} bytes; the limit is {self._max_item_bytes}")
        if len(self._items) >= self._max_items:
            raise UnavailableError(f"queue is full: {self._max_items} messages are waiting")
        if self.total_bytes + size > self._max_total_bytes:
            raise UnavailableError(f"queue is full: queued messages would exceed {self._max_total_bytes} bytes")
        self._items.append(text)
        self.total_bytes += size

    def pop(self) -> str:
        text = self._items.popleft()
        self.total_bytes -= len(text.encode())
        return text


@dataclasses.dataclass
class _Draft:
    """A message's parts so far, until the last part delivers it."""

    parts: list[str]
    size_bytes: int
    touched_at: float


class MessageDrafts:
    """Long messages arriving in parts (each part its own request), at most MAX_OPEN_DRAFTS at once, each at most
    MAX_PROMPT_BYTES whole and dropped after DRAFT_IDLE_S untouched. The whole message is delivered by the caller."""

    def __init__(self, new_id: Callable[[], str], max_open: int = MAX_OPEN_DRAFTS,
                 max_bytes: int = MAX_PROMPT_BYTES) -> None:
        self._new_id = new_id
        self._max_open = max_open
        self._max_bytes = max_bytes
        self._drafts: dict[str, _Draft] = {}

    def add(self, draft_id: Optional[str], text: str, now: float) -> tuple[str, int]:
        """Appends a part (opening a draft when draft_id is None); returns the draft's id and size so far."""
        if draft_id is None:
            if len(self._drafts) >= self._max_open:
                raise UnavailableError(f"drafts are full: {self._max_open} long messages are being sent")
            draft_id = self._new_id()
            self._drafts[draft_id] = _Draft([], 0, now)
        draft = self._draft(draft_id)
        size = draft.size_bytes + len(text.encode())
        if size > self._max_bytes:
            del self._drafts[draft_id]
            raise RequestError(f"too large: a message is at most {self._max_bytes} bytes; the draft is dropped")
        draft.parts.append(text)
        draft.size_bytes, draft.touched_at = size, now
        return draft_id, size

    def take(self, draft_id: str, text: str) -> str:
        """The whole message, its last part appended; the draft is closed."""
        draft = self._draft(draft_id)
        del self._drafts[draft_id]
        if draft.size_bytes + len(text.encode()) > self._max_bytes:
            raise RequestError(f"too large: a message is at most {self._max_bytes} bytes; the draft is dropped")
        return "".join(draft.parts) + text

    def expire(self, now: float) -> None:
        for draft_id, draft in list(self._drafts.items()):
            if now - draft.touched_at >= DRAFT_IDLE_S:
                del self._drafts[draft_id]

    def next_deadline(self) -> Optional[float]:
        return min((d.touched_at + DRAFT_IDLE_S for d in self._drafts.values()), default=None)

    def _draft(self, draft_id: str) -> _Draft:
        try:
            return self._drafts[draft_id]
        except KeyError:
            raise CommandError(f"no such draft {draft_id} (a draft untouched for {DRAFT_IDLE_S:g} s is dropped)") \
                from None


def validate_command_template(argv: Iterable[str]) -> tuple[str, ...]:
    """Checks an agent argv template: `{prompt}` exactly once; `{continue}` and `{model}` at most once each."""
    argv = tuple(argv)
    if not argv or not all(isinstance(arg, str) for arg in argv):
        raise UsageError("the agent command must be a non-empty JSON array of strings")
    for placeholder, allowed in (("{prompt}", (1,)), ("{continue}", (0, 1)), ("{model}", (0, 1))):
        if argv.count(placeholder) not in allowed:
            raise UsageError(f"the agent command must hold {placeholder} {'exactly' if allowed == (1,) else 'at most'}"
                             " once, as a whole argument")
    return argv


def expand_command(template: tuple[str, ...], prompt: Optional[str], model: Optional[str], resume: bool) -> list[str]:
    """`{continue}` becomes --continue or nothing, `{model}` becomes --model M or nothing, `{prompt}` the prompt.

    A prompt that goes on stdin instead (None here: too long for one argument) leaves `{prompt}` out, and a `--`
    just before it, so the command sees no prompt argument (`claude -p` then reads its prompt from stdin)."""
    expansions = {
        "{continue}": ["--continue"] if resume else [],
        "{model}": ["--model", model] if model else [],
        "{prompt}": [prompt] if prompt is not None else [],
    }
    argv = []
    for index, arg in enumerate(template):
        if prompt is None and arg == "--" and template[index + 1:index + 2] == ("{prompt}",):
            continue
        argv += expansions.get(arg, [arg])
    return argv


# ======================================================================================================================
# Pure core: checkpoint archive rules (which members a restore accepts)
# ======================================================================================================================


def _archive_tree_of(name: str) -> Optional[str]:
    top = name.split("/", 1)[0]
    return top if top in ARCHIVE_TREES else None


def check_member_name(name: str, include: tuple[str, ...]) -> None:
    """Relative, normalised, no `..`, and one of the names an archive holding `include` may hold."""
    parts = name.split("/")
    if name.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise ArchiveError(f"unsafe member name {name!r}")
    if not (name == ARCHIVE_MANIFEST or (name == ARCHIVE_LOG and "log" in include)
            or _archive_tree_of(name) in include):
        raise ArchiveError(f"unexpected member {name!r}")


def symlink_stays_inside(name: str, target: str, symlinks: set[str]) -> bool:
    """True when the link `name -> target` resolves, lexically, inside its own tree without passing another link.

    Walking the target one component at a time and refusing any component that is itself a link makes the lexical
    answer the real one: `..` can only climb through real directories of the archive.
    """
    if not target or target.startswith("/") or "\0" in target:
        return False
    parts = name.split("/")[:-1]
    for component in target.split("/"):
        if component in ("", "."):
            continue
        if component == "..":
            if len(parts) <= 1:
                return False  # would leave the tree root
            parts.pop()
            continue
        parts.append(component)
        if "/".join(parts) in symlinks:
            return False
    return True


def check_archive_members(members: list[tarfile.TarInfo], include: tuple[str, ...],
                          max_entries: int = MAX_ARCHIVE_ENTRIES, max_bytes: int = MAX_ARCHIVE_BYTES) -> None:
    """Every rule a restore enforces before it writes anything: names (only the parts the manifest says the archive
    includes), types, links, counts and sizes."""
    if len(members) > max_entries:
        raise ArchiveError(f"archive has more than {max_entries} entries")
    names: set[str] = set()
    symlinks = {member.name for member in members if member.issym()}
    total_bytes = 0
    for member in members:
        check_member_name(member.name, include)
        if member.name in names:
            raise ArchiveError(f"duplicate member {member.name!r}")
        names.add(member.name)
        is_tree_root = member.name in ARCHIVE_TREES
        if member.name in (ARCHIVE_MANIFEST, ARCHIVE_LOG) and not member.isfile():
            raise ArchiveError(f"{member.name} must be a regular file")
        if not (member.isfile() or member.isdir() or (member.issym() and not is_tree_root)):
            raise ArchiveError(f"member {member.name!r} is not a regular file, directory or symlink")
        if member.issym() and not symlink_stays_inside(member.name, member.linkname, symlinks):
            raise ArchiveError(f"symlink {member.name!r} -> {member.linkname!r} escapes its tree")
        if symlinks and _below_symlink(member.name, symlinks):
            raise ArchiveError(f"member {member.name!r} lies below a symlink")
        total_bytes += member_data_bytes(member) if member.isfile() else 0
        if total_bytes > max_bytes:
            raise ArchiveError(f"archive content exceeds {max_bytes} bytes")
    for required in (ARCHIVE_MANIFEST,) + ((ARCHIVE_LOG,) if "log" in include else ()):
        if required not in names:
            raise ArchiveError(f"archive lacks {required}")


def _below_symlink(name: str, symlinks: set[str]) -> bool:
    """Whether a member lies below one of the archive's symlinks: each of its parents looked up, or each symlink
    tried as a prefix, whichever is fewer (a tree a thousand levels deep must not cost a thousand slices a member)."""
    if len(symlinks) < name.count("/"):
        return any(name.startswith(link + "/") for link in symlinks)
    cut = name.rfind("/")
    while cut > 0:
        if name[:cut] in symlinks:
            return True
        cut = name.rfind("/", 0, cut)
    return False


def member_data_bytes(member: tarfile.TarInfo) -> int:
    """The bytes a regular member writes: its size, or a sparse one's data segments, checked to be in order,
    apart and inside its size (a restore seeks to each)."""
    segments = sparse_segments(member)
    if segments is None:
        return member.size
    if len(segments) > MAX_SPARSE_SEGMENTS + 1:
        raise ArchiveError(f"sparse member {member.name!r} maps more than {MAX_SPARSE_SEGMENTS} segments")
    end = 0
    for offset, length in segments:
        if offset < end or length < 0 or offset + length > member.size:
            raise ArchiveError(f"sparse member {member.name!r} has a segment out of order or past its size")
        end = offset + length
    return sum(length for _, length in segments)


def sparse_segments(member: tarfile.TarInfo) -> Optional[list[tuple[int, int]]]:
    """A sparse member's (offset, length) data segments, as tarfile reads them; None for a
    member stored whole (typeshed types the attribute loosely)."""
    return cast(Optional[list[tuple[int, int]]], member.sparse)


def parse_manifest(data: bytes) -> Manifest:
    try:
        document = parse_strict_json(data, MAX_MANIFEST_BYTES)
    except StrictJsonError as e:
        raise ArchiveError(f"manifest is not JSON: {e}") from None
    expected = {"format", "version", "id", "workload", "log_bytes", "continue", "include"}
    if not isinstance(document, dict) or set(document) != expected:
        raise ArchiveError(f"manifest must hold exactly {sorted(expected)} (a {ARCHIVE_FORMAT} v{ARCHIVE_VERSION} "
                           "archive)")
    if document["format"] != ARCHIVE_FORMAT or document["version"] != ARCHIVE_VERSION:
        raise ArchiveError(f"not a {ARCHIVE_FORMAT} v{ARCHIVE_VERSION} archive")
    log_bytes, checkpoint_id = document["log_bytes"], document["id"]
    if not isinstance(log_bytes, int) or isinstance(log_bytes, bool) or log_bytes < 0:
        raise ArchiveError("manifest log_bytes must be a non-negative integer")
    if not isinstance(checkpoint_id, str) or not CHECKPOINT_ID_RE.fullmatch(checkpoint_id):
        raise ArchiveError("manifest id is invalid")
    if not isinstance(document["continue"], bool):
        raise ArchiveError("manifest continue must be a boolean")
    try:
        workload = WorkloadKind(document["workload"])
        include = _convert_parts("manifest include", document["include"])
    except ValueError:
        raise ArchiveError("manifest workload is invalid") from None
    except RequestError as e:
        raise ArchiveError(str(e)) from None
    return Manifest(checkpoint_id, workload, log_bytes, document["continue"], include)


# ======================================================================================================================
# Pure core: paths below a root, uploaded archives, how a command ended
# ======================================================================================================================


def parse_relative_path(text: str, where: str = "path") -> tuple[str, ...]:
    """A path below a root (the workspace or home) as its components; `""` and `"."` are the root itself.

    Absolute paths and `..` are refused outright: whether `..` stays inside depends on what the components are on
    disk, and the walk that follows (open_confined_dir) never resolves it. Empty and `.` components are dropped.
    """
    try:
        size_bytes = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise RequestError(f"{where} is not valid UTF-8") from None
    if "\0" in text or size_bytes > MAX_PATH_BYTES:
        raise RequestError(f"{where} must be at most {MAX_PATH_BYTES} bytes without NUL")
    if text.startswith("/"):
        raise RequestError(f"refused: {where} {text!r} is absolute; paths are relative to the workspace or home")
    parts = tuple(part for part in text.split("/") if part not in ("", "."))
    if ".." in parts:
        raise RequestError(f"refused: {where} {text!r} contains '..'")
    for part in parts:
        if len(part.encode("utf-8")) > MAX_NAME_BYTES:
            raise RequestError(f"{where}: the name {part[:40]!r}... is longer than {MAX_NAME_BYTES} bytes")
    return parts


def parse_where(text: str, where: str) -> Where:
    """A path relative to the workspace, or an absolute one, from the container's `/`; the same rules below either."""
    if text.startswith("/"):
        return Where(FileRoot.CONTAINER, parse_relative_path(text.lstrip("/"), where))
    return Where(FileRoot.WORKSPACE, parse_relative_path(text, where))


def sane_mode(mode: int, directory: bool) -> int:
    """The mode an uploaded file or directory gets: read and execute bits kept, the owner always able to manage it,
    no setuid, setgid, sticky or write for group and others."""
    return (mode & SANE_MODE_MASK) | (PRIVATE_DIR_MODE if directory else 0o600)


#: A stand-in first component, so that symlink_stays_inside (written for checkpoint trees, whose first component is
#: the tree's root) judges uploaded archives, whose members start at the extraction root.
_UPLOAD_TREE = "upload"


def _normalise_member_name(name: str) -> str:
    """Tools write `./a`, `a/` or `a`; all three name `a`. The root itself becomes ``."""
    while name.startswith("./"):
        name = name[2:]
    return "" if name in (".", "") else name.rstrip("/")


def vet_upload_members(members: list[tarfile.TarInfo], max_entries: int = MAX_ARCHIVE_ENTRIES,
                       max_bytes: int = MAX_TRANSFER_BYTES) -> list[tuple[str, tarfile.TarInfo]]:
    """Every rule an uploaded tar must meet before anything of it is written; the members to extract, by name.

    Refused: absolute names and `..`, duplicates, devices, FIFOs and other special members, symlinks that leave the
    archive's tree (or pass through another symlink), anything below a symlink or a file, hard links to anything but
    a regular file earlier in the same archive, more than max_entries members or max_bytes of content.
    """
    if len(members) > max_entries:
        raise ArchiveError(f"archive has more than {max_entries} entries")
    named: list[tuple[str, tarfile.TarInfo]] = []
    kinds: dict[str, str] = {}  # name -> file | directory | symlink
    for member in members:
        name = _normalise_member_name(member.name)
        parts = name.split("/")
        if member.name.startswith("/") or "\0" in name or (name and any(part in ("", ".", "..") for part in parts)):
            raise ArchiveError(f"refused: unsafe member name {member.name!r}")
        if not name:
            if not member.isdir():
                raise ArchiveError(f"refused: member {member.name!r} names the root but is not a directory")
            continue  # the root itself: it exists or is created
        if name in kinds:
            raise ArchiveError(f"refused: duplicate member {name!r}")
        if member.isfile() or member.islnk():
            kinds[name] = "file"
        elif member.isdir():
            kinds[name] = "directory"
        elif member.issym():
            kinds[name] = "symlink"
        else:
            raise ArchiveError(f"refused: member {name!r} is a device node, FIFO or other special file")
        named.append((name, member))
    symlinks = {f"{_UPLOAD_TREE}/{name}" for name, kind in kinds.items() if kind == "symlink"}
    earlier: set[str] = set()
    total_bytes = 0
    for name, member in named:
        parts = name.split("/")
        for depth in range(1, len(parts)):
            parent_kind = kinds.get("/".join(parts[:depth]), "directory")
            if parent_kind != "directory":
                raise ArchiveError(f"refused: member {name!r} lies below a {parent_kind}")
        if member.issym() and not symlink_stays_inside(f"{_UPLOAD_TREE}/{name}", member.linkname, symlinks):
            raise ArchiveError(f"refused: symlink {name!r} -> {member.linkname!r} leaves the archive's tree")
        if member.islnk():
            target = _normalise_member_name(member.linkname)
            if target not in earlier or kinds.get(target) != "file":
                raise ArchiveError(f"refused: hard link {name!r} -> {member.linkname!r} does not point at a regular "
                                   "file earlier in the archive")
        if member.isfile():  # at its full size, holes included (its sparse map checked all the same)
            total_bytes += max(member.size, member_data_bytes(member))
        if total_bytes > max_bytes:
            raise ArchiveError(f"too large: the archive's content exceeds {max_bytes} bytes")
        earlier.add(name)
    return named


def describe_exit(returncode: int) -> tuple[Optional[int], Optional[str]]:
    """Popen's return code as (exit code, signal name): exactly one of them is set."""
    if returncode >= 0:
        return returncode, None
    try:
        return None, signal.Signals(-returncode).name
    except ValueError:
        return None, f"SIG{-returncode}"


# ======================================================================================================================
# Pure core: what a file worker may answer. Workers run as the runtime user, which the workload can trace and
# impersonate: every answer is hostile input, parsed here, strictly, before the agent acts on it.
# ======================================================================================================================


class WorkerAnswer(enum.Enum):
    ENTRY = "entry"  # one item of a listing or of a tree walk (a walked regular file's fd rides along)
    DONE = "done"  # the last message: the operation's result (open_file and upload_open send an fd with it)
    ERROR = "error"  # the last message: the operation failed; {"code", "message"}


@dataclasses.dataclass(frozen=True)
class WorkerPacket:
    """One answer of a file worker, as received: its kind and fields."""

    kind: WorkerAnswer
    fields: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class WalkEntry:
    """One entry of a walked tree, as the worker describes it (a regular file's type and size come from its fd)."""

    name: str  # relative to the walked directory, "/"-separated; may hold surrogate escapes (bytes not UTF-8)
    kind: str  # file | directory | symlink
    mode: int
    mtime: int
    target: Optional[str]  # a symlink's


#: Error codes a worker may send, and what they become.
_WORKER_ERRORS: dict[str, type[AgentError]] = {
    RequestError.code: RequestError, CommandError.code: CommandError, DiskFullError.code: DiskFullError,
}
#: The types file_type() names.
_LISTED_TYPES = frozenset({"file", "directory", "symlink", "fifo", "socket", "char-device", "block-device",
                           "unknown"})
_WALKED_TYPES = frozenset({"file", "directory", "symlink"})
_CONTROL_CHARS_RE = re.compile(r"[\x00-\x1f\x7f]")
MAX_MTIME_S = 10 ** 12  #: further from 1970 than this (either way) is not a time a file system gives


def parse_worker_packet(data: bytes) -> WorkerPacket:
    """One message from a worker: a JSON object with exactly one key, a WorkerAnswer, whose value is an object."""
    try:
        document = parse_strict_json(data, WORKER_PACKET_BYTES)
    except StrictJsonError as e:
        raise WorkerProtocolError(f"the file worker sent a message that is not JSON: {e}") from None
    if not isinstance(document, dict) or len(document) != 1:
        raise WorkerProtocolError("the file worker sent a message that is not one {kind: fields} object")
    (kind_text, fields), = document.items()
    try:
        kind = WorkerAnswer(kind_text)
    except ValueError:
        raise WorkerProtocolError(f"the file worker sent an unknown message kind {kind_text[:40]!r}") from None
    if not isinstance(fields, dict):
        raise WorkerProtocolError(f"the file worker's {kind.value} is not an object")
    return WorkerPacket(kind, fields)


def worker_failure(fields: dict[str, Any]) -> AgentError:
    """The error a worker reported, as the agent's own: one of three codes, a message made printable and short."""
    require_fields(fields, {"code": str, "message": str}, "error")
    error_class = _WORKER_ERRORS.get(fields["code"])
    if error_class is None:
        return WorkerProtocolError(f"the file worker sent an unknown error code {fields['code'][:40]!r}")
    return error_class(_CONTROL_CHARS_RE.sub("\ufffd", fields["message"][:MAX_WORKER_MESSAGE_CHARS]))


#: A JSON number: what an mtime is.
NUMBER = (int, float)


def require_fields(fields: dict[str, Any], kinds: dict[str, Any], what: str,
                   optional: frozenset[str] = frozenset()) -> None:
    """Exactly these keys (those in `optional` may be missing), each of its JSON type (a bool is no number)."""
    missing = set(kinds) - set(fields) - optional
    unknown = set(fields) - set(kinds)
    if missing or unknown:
        raise WorkerProtocolError(f"the file worker's {what} has fields {sorted(fields)[:8]}, not {sorted(kinds)}")
    for key, value in fields.items():
        kind = kinds[key]
        if isinstance(value, bool) is not (kind is bool) or not isinstance(value, kind):
            raise WorkerProtocolError(f"the file worker's {what}.{key} is not of the right type")


def worker_count(value: int, what: str, high: int = 2 ** 63 - 1) -> int:
    if not 0 <= value <= high:
        raise WorkerProtocolError(f"the file worker's {what} is out of range")
    return value


def worker_mtime(value: float, what: str) -> float:
    if not -MAX_MTIME_S <= value <= MAX_MTIME_S:  # NaN too
        raise WorkerProtocolError(f"the file worker's {what}.mtime is not a time")
    return value


def check_listed_entry(value: Any, expected_name: Optional[str]) -> dict[str, Any]:
    """A `stat` or `list` entry from a worker, as entry_json makes it. With `expected_name` (a stat) the name must be
    the one asked for; without it (a listing) any single name but `.` and `..`."""
    if not isinstance(value, dict):
        raise WorkerProtocolError("the file worker's entry is not an object")
    fields = {"name": str, "type": str, "size": int, "mode": int, "mtime": NUMBER, "target": str}
    require_fields(value, fields, "entry", optional=frozenset({"target"}))
    name, kind = value["name"], value["type"]
    if expected_name is not None and name != expected_name:
        raise WorkerProtocolError(f"the file worker described {name[:80]!r}, not {expected_name[:80]!r}")
    if (not name or "/" in name or "\0" in name or name in (".", "..") and expected_name is None
            or len(name.encode("utf-8", "surrogatepass")) > 3 * MAX_NAME_BYTES):
        raise WorkerProtocolError(f"the file worker's entry name {name[:80]!r} is not a file name")
    if kind not in _LISTED_TYPES or ("target" in value) and kind != "symlink":
        raise WorkerProtocolError(f"the file worker's entry type {kind[:40]!r} is not one a file system has")
    if "target" in value and ("\0" in value["target"] or len(value["target"]) > 3 * MAX_PATH_BYTES):
        raise WorkerProtocolError("the file worker's symlink target is not one")
    worker_count(value["size"], "entry size")
    worker_count(value["mode"], "entry mode", 0o7777)
    worker_mtime(value["mtime"], "entry")
    return dict(value)


def check_member_path(text: str) -> str:
    """A walked entry's name: relative, "/"-separated, no empty, `.` or `..` component, no NUL; bytes that are not
    UTF-8 as surrogate escapes (what os.fsdecode makes), nothing else that is not text."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise WorkerProtocolError(f"the file worker's name {text[:80]!r} is not a file name") from None
    parts = text.split("/")
    if not text or b"\0" in raw or any(part in ("", ".", "..") for part in parts) or any(
            len(part.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES for part in parts):
        raise WorkerProtocolError(f"the file worker's name {text[:80]!r} is not a relative path")
    return text


def check_walk_entry(fields: dict[str, Any], with_fd: bool) -> WalkEntry:
    """One entry of a walk: a regular file comes with its fd, a directory or symlink without."""
    kinds = {"name": str, "type": str, "mode": int, "mtime": NUMBER, "target": str}
    require_fields(fields, kinds, "walk entry", optional=frozenset({"target"}))
    kind = fields["type"]
    if kind not in _WALKED_TYPES or ("target" in fields) != (kind == "symlink") or with_fd != (kind == "file"):
        raise WorkerProtocolError(f"the file worker's walk entry of type {kind[:40]!r} is not one a tree holds")
    target = fields.get("target")
    if target is not None and (not target or "\0" in target or len(target) > 3 * MAX_PATH_BYTES):
        raise WorkerProtocolError("the file worker's symlink target is not one")
    return WalkEntry(check_member_path(fields["name"]), kind, worker_count(fields["mode"], "walk mode", 0o7777),
                     int(worker_mtime(fields["mtime"], "walk entry")), target)


# ======================================================================================================================
# I/O adapters: the output log, the outbox, the agent state file
# ======================================================================================================================


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


#: What a write answers when the file system is full (or the writer's quota is).
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def _write_file_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        temporary.write_bytes(data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


class OutputLog:
    """DIR/agent/output.log: append-only, byte-addressed, on disk, bounded by a cap that ends it with a marker.

    Reads never consume. In text mode (the agent workload) everything appended is whole UTF-8, so every cursor
    this log issues falls on a code-point boundary; reads end on one and refuse to start inside one. Each append is
    whole or not at all: while the disk is full, output is counted and dropped, and the first append that fits
    again is preceded by a marker saying how many bytes were lost.
    """

    def __init__(self, path: Path, cap_bytes: int, text: bool) -> None:
        self.path = path
        self.cap_bytes = cap_bytes
        self.text = text
        newline = "\n" if text else "\r\n"
        self._cap_marker = (f"{newline}[reploy: output log reached its cap of {cap_bytes} bytes; "
                            f"later output is discarded]{newline}").encode()
        self._fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.length_bytes = os.fstat(self._fd).st_size
        tail = os.pread(self._fd, len(self._cap_marker), max(self.length_bytes - len(self._cap_marker), 0))
        self.capped = tail == self._cap_marker
        self._last_byte = tail[-1:]
        self.lost_bytes = 0  # dropped while the disk was full, not yet reported in the log

    def append(self, data: bytes) -> int:
        """Appends what fits under the cap (whole code points); returns how many bytes of data were kept."""
        if self.capped or not data:
            return 0
        if self.lost_bytes and not self._report_loss():
            self.lost_bytes += len(data)
            return 0
        room_bytes = self.cap_bytes - len(self._cap_marker) - self.length_bytes
        kept = utf8_prefix(data, max(room_bytes, 0))
        capped = len(kept) < len(data)
        if not self._write(kept + self._cap_marker if capped else kept):
            self.lost_bytes += len(data)
            return 0
        self.capped = capped
        return len(kept)

    @property
    def at_line_start(self) -> bool:
        return self._last_byte in (b"", b"\n")

    def _marker_line(self, text: str) -> bytes:
        newline = "\n" if self.text else "\r\n"
        return f"{'' if self.at_line_start else newline}[reploy: {text}]{newline}".encode()

    def append_marker(self, text: str) -> None:
        """A `[reploy: ...]` line of our own, starting on a fresh line."""
        self.append(self._marker_line(text))

    def _report_loss(self) -> bool:
        """The marker for output dropped on a full disk; False while it does not fit either. Where the cap leaves no
        room for it, the cap's own marker ends the log instead."""
        line = self._marker_line(f"{self.lost_bytes} bytes of output were lost: the session's disk was full")
        if self.length_bytes + len(line) + len(self._cap_marker) <= self.cap_bytes and not self._write(line):
            return False
        self.lost_bytes = 0
        return True

    def window(self, offset_bytes: int, max_bytes: int) -> LogWindow:
        """Where a read of at most max_bytes from offset_bytes falls, by the rules every read keeps: past the end,
        a reset to the length; in text mode, a start inside a code point refused and an end inside one backed over
        (only a few bytes around the two ends are looked at)."""
        if offset_bytes > self.length_bytes:
            return LogWindow(offset_bytes, self.length_bytes, self.length_bytes, True)
        end_bytes = min(offset_bytes + max_bytes, self.length_bytes)
        if self.text:
            if not is_utf8_boundary(os.pread(self._fd, 1, offset_bytes), 0):
                raise CommandError(f"offset {offset_bytes} is not on a UTF-8 boundary")
            if end_bytes < self.length_bytes:
                # A code point is at most 4 bytes: the 3 before the end and the one at it show whether it cuts one.
                probe_from = max(end_bytes - 3, offset_bytes)
                probe = os.pread(self._fd, end_bytes + 1 - probe_from, probe_from)
                end_bytes = probe_from + len(utf8_prefix(probe, end_bytes - probe_from))
        return LogWindow(offset_bytes, end_bytes, self.length_bytes, False)

    def read(self, offset_bytes: int, max_bytes: int) -> LogSlice:
        window = self.window(offset_bytes, max_bytes)
        data = os.pread(self._fd, window.next_offset_bytes - offset_bytes, offset_bytes) if not window.reset else b""
        return LogSlice(offset_bytes, data, window.next_offset_bytes, window.length_bytes, window.reset)

    def reader(self) -> int:
        """A new descriptor of the log, read-only and of its own open file description: it names the very inode this
        log appends to (reopened through /proc/self/fd, no path looked up), and gives no write access."""
        return os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _write(self, data: bytes) -> bool:
        """All of data, or (the disk full) none of it: a short write is cut back off the file."""
        if not append_whole(self._fd, data, self.length_bytes):
            return False
        self.length_bytes += len(data)
        self._last_byte = data[-1:]
        return True


def append_whole(fd: int, data: bytes, length_bytes: int) -> bool:
    """Appends data to a file of length_bytes opened O_APPEND; False when the disk is full, the file then cut back to
    length_bytes. Other errors raise."""
    try:
        _write_all(fd, data)
    except OSError as e:
        if e.errno not in DISK_FULL_ERRNOS:
            raise
        os.ftruncate(fd, length_bytes)
        return False
    return True


class Outbox:
    """DIR/agent/events.jsonl: lifecycle facts for supervisors, one JSON object per line, `seq` strictly increasing.

    It keeps the invariant "every turn_start gets exactly one turn_end, every session_start one session_end": what a
    crashed agent left open is closed by `reconcile()` at the next start. An event the full disk refuses is held (at
    most MAX_HELD_EVENTS, the oldest dropped past that) and written, in order, before the next one that fits.
    """

    def __init__(self, path: Path, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._seq = 0
        self._open_turns: set[int] = set()
        self._session_open = False
        self._held: collections.deque[bytes] = collections.deque(maxlen=MAX_HELD_EVENTS)
        ends_with_newline = True
        if path.exists():
            data = path.read_bytes()
            ends_with_newline = data.endswith(b"\n") or not data
            for line in data.splitlines():
                self._replay(line)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._length_bytes = os.fstat(self._fd).st_size
        if not ends_with_newline:
            self._held.append(b"\n")  # a torn last line from a crash stays on its own line
            self._write_held()

    def _replay(self, line: bytes) -> None:
        try:
            event = json.loads(line)
            seq, kind = event["seq"], EventKind(event["type"])
        except (ValueError, KeyError, TypeError):
            return  # a torn line: not a fact
        self._seq = max(self._seq, seq)
        if kind is EventKind.TURN_START:
            self._open_turns.add(seq)
        elif kind is EventKind.TURN_END:
            self._open_turns.discard(event.get("turn"))
        elif kind in (EventKind.SESSION_START, EventKind.SESSION_END):
            self._session_open = kind is EventKind.SESSION_START

    def reconcile(self) -> None:
        """Closes what a previous agent left open when it died."""
        self.end_open_turns(Outcome.FAILED, "agent_died")
        if self._session_open:
            self.emit(EventKind.SESSION_END, reason="agent_died")

    def emit(self, kind: EventKind, **fields: Any) -> int:
        self._seq += 1
        self._held.append(_encode_line({"seq": self._seq, "time": round(self._clock(), 3), "type": kind.value,
                                        **fields}))
        self._write_held()
        if kind in (EventKind.SESSION_START, EventKind.SESSION_END):
            self._session_open = kind is EventKind.SESSION_START
        return self._seq

    def emit_unreserved(self, kind: EventKind, **fields: Any) -> Optional[int]:
        """An event the workload can provoke: written only when it fits outside the blocks kept for root
        (EVENT_ROOM_BYTES), and nothing is held before it; else dropped (None). The reserve keeps this outbox and the
        log growing for the agent's own events, whatever the workload provokes."""
        line = _encode_line({"seq": self._seq + 1, "time": round(self._clock(), 3), "type": kind.value, **fields})
        if self._held or free_bytes(self._fd) < len(line) + EVENT_ROOM_BYTES:
            return None
        self._seq += 1
        self._held.append(line)
        self._write_held()
        return self._seq

    def _write_held(self) -> None:
        while self._held and append_whole(self._fd, self._held[0], self._length_bytes):
            self._length_bytes += len(self._held.popleft())

    def start_turn(self, **fields: Any) -> int:
        """Returns the turn id: the seq of its turn_start."""
        turn_id = self.emit(EventKind.TURN_START, **fields)
        self._open_turns.add(turn_id)
        return turn_id

    def end_turn(self, turn_id: int, outcome: Outcome, **fields: Any) -> None:
        if turn_id in self._open_turns:
            self._open_turns.discard(turn_id)
            self.emit(EventKind.TURN_END, turn=turn_id, outcome=outcome.value, **fields)

    def end_open_turns(self, outcome: Outcome, reason: str) -> None:
        for turn_id in sorted(self._open_turns):
            self.end_turn(turn_id, outcome, reason=reason)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class AgentState:
    """DIR/agent/agent-state.json: whether the agent command may be resumed with --continue (after a first success).
    When it cannot be written (a full disk) the fact is kept in memory, with a note on stderr."""

    def __init__(self, path: Path) -> None:
        self._path = path
        try:
            self.resume = json.loads(path.read_bytes()).get("continue") is True
        except (OSError, ValueError, AttributeError):
            self.resume = False

    def set_resume(self, resume: bool) -> None:
        if resume != self.resume:
            self.resume = resume
            try:
                _write_file_atomically(self._path, json.dumps({"continue": resume}).encode())
            except OSError as e:
                print(f"agent.py: cannot record {self._path.name}: {e.strerror}; an agent restarted before it is "
                      "written again may resume the conversation wrongly", file=sys.stderr)


# ======================================================================================================================
# I/O adapters: the control socket's ownership
# ======================================================================================================================


class OwnedSocket:
    """The listening socket at DIR/agent/control.sock, bound only after proving no live agent owns the path.

    A socket file whose connect is refused is stale and taken over (if it is ours); one that answers, or that we
    cannot probe, belongs to a live owner and makes us refuse to start; a non-socket file is never deleted. On
    close the path is removed only if it is still the very file we bound.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = self._bind()
        st = os.lstat(path)
        self._identity = (st.st_dev, st.st_ino)

    def _bind(self) -> socket.socket:
        for _ in range(2):  # a second pass covers a rival that took over the stale file between probe and bind
            self._clear_stale()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old_umask = os.umask(0o177)  # the socket is born 0600: no window where others may connect
            try:
                sock.bind(str(self.path))
            except OSError as e:
                sock.close()
                if e.errno == errno.EADDRINUSE:
                    continue
                raise StartupError(f"cannot bind {self.path}: {e.strerror}") from e
            finally:
                os.umask(old_umask)
            os.chmod(self.path, SOCKET_MODE)
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
            return sock
        raise StartupError(f"another agent is serving {self.path}")

    def _clear_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise StartupError(f"{self.path} exists and is not a socket; remove it if it is not needed")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.path))
        except ConnectionRefusedError:
            pass  # stale: nobody listens
        except FileNotFoundError:
            return
        except OSError as e:
            raise StartupError(f"cannot probe {self.path} ({e.strerror}); refusing to take it over") from e
        else:
            raise StartupError(f"another agent is serving {self.path}")
        finally:
            probe.close()
        if st.st_uid != os.getuid():
            raise StartupError(f"stale socket {self.path} belongs to uid {st.st_uid}; not ours to remove")
        os.unlink(self.path)

    def close(self) -> None:
        """Idempotent; unlinks the path only if it is still our socket."""
        if self.sock.fileno() < 0:
            return
        self.sock.close()
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._identity:
            os.unlink(self.path)


class TcpListener:
    """The opt-in TCP listener (`--listen HOST:PORT`): the same protocol, one request per connection.

    It has no authentication of its own: whoever reaches the port drives the session. It exists for a workload whose
    only peer is a trusted controller behind a private endpoint grant; the unix socket stays the default.
    """

    def __init__(self, host: str, port: int) -> None:
        try:
            family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                 flags=socket.AI_PASSIVE)[0]
        except socket.gaierror as e:
            raise StartupError(f"cannot resolve the --listen host {host!r}: {e.strerror}") from e
        self.sock = socket.socket(family, kind, proto)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(address)
            self.sock.listen(LISTEN_BACKLOG)
        except OSError as e:
            self.sock.close()
            raise StartupError(f"cannot listen on {format_listen_address(host, port)}: {e.strerror}") from e
        self.sock.setblocking(False)
        self.address = format_listen_address(*self.sock.getsockname()[:2])

    def close(self) -> None:
        """Idempotent."""
        self.sock.close()


def parse_listen_address(text: str) -> tuple[str, int]:
    """`HOST:PORT` (an IPv6 host in brackets, `[::]:7000`) -> (host, port); port 0 picks a free one."""
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise UsageError(f"--listen wants HOST:PORT with a port in 0..65535, not {text!r}")
    return host, int(port_text)


def format_listen_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ======================================================================================================================
# I/O adapters: process sessions
# ======================================================================================================================


@dataclasses.dataclass(frozen=True)
class ProcessFacts:
    """What /proc says of one process: its parent, group, session, and whether it is a zombie."""

    parent: int
    group: int
    session: int
    zombie: bool


def process_table() -> dict[int, ProcessFacts]:
    """Every process we can see, by pid (scanning /proc)."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process went away while we looked
        # After the command name: state ppid pgrp session ...
        table[int(entry.name)] = ProcessFacts(int(fields[1]), int(fields[2]), int(fields[3]), fields[0] == b"Z")
    return table


def session_process_groups(session_id: int) -> set[int]:
    """Every process group with a member in the given session: jobs, grandchildren and all."""
    return {facts.group for facts in process_table().values() if facts.session == session_id}


def command_processes(leader: int) -> dict[int, ProcessFacts]:
    """An exec's processes: its process session, and every descendant of those, so that a child which left the
    session with setsid() while its parent lives is found too."""
    table = process_table()
    found = {pid for pid, facts in table.items() if facts.session == leader}  # the leader's own session too
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, facts in table.items():
        children[facts.parent].append(pid)
    pending = list(found)
    while pending:
        for child in children[pending.pop()]:
            if child not in found:
                found.add(child)
                pending.append(child)
    return {pid: table[pid] for pid in found}


def kill_command(leader: int, leader_running: bool) -> bool:
    """SIGKILL to every process of an exec (see command_processes); True when any was still alive.

    A running leader is stopped first and killed last. Stopped, it can neither exit on its own (a shell whose child
    died first would exit 137, and the result would report an exit code for a killed command) nor fork; and being
    the exec's subreaper (spawn_exec), it takes in whatever a dying descendant orphans, so each pass finds those too,
    until only the leader is left. A leader that has exited (and was reaped) is never signalled: its pid may be
    another process's by now."""
    if leader_running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(leader, signal.SIGSTOP)
    alive = False
    for _ in range(KILL_PASSES):
        others = [pid for pid, facts in command_processes(leader).items() if pid != leader and not facts.zombie]
        if not others:
            break
        alive = True
        for pid in others:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if leader_running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(leader, signal.SIGKILL)
            alive = True
    return alive


def subreaper_setup() -> Optional[Callable[[], None]]:
    """What an exec's child runs before exec, besides spawn_in_workload's own steps: PR_SET_CHILD_SUBREAPER, which
    execve keeps, so that a descendant orphaned by its parent (a `(setsid cmd &)`) is re-parented to the command, not
    to the container's init, and kill_command can still find it. libc is looked up here, in the agent, not in the
    child."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def signal_session(session_id: int, signum: int) -> None:
    """Signals every process group of a session the workload leader created (start_new_session=True)."""
    for group in session_process_groups(session_id) | {session_id}:
        try:
            os.killpg(group, signum)
        except ProcessLookupError:
            pass


def reset_child_signals() -> None:
    """Runs in every spawned child before exec (shell, agent runs): the dispositions in SPAWN_DEFAULT_SIGNALS back to
    default and an empty signal mask. An ignored disposition and the mask survive exec, so an agent started with SIGINT
    ignored (`agent.py serve ... &` from a script) would otherwise hand that to every job, and `interrupt` would
    report success and do nothing."""
    for signum in SPAWN_DEFAULT_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


def _take_controlling_terminal() -> None:
    """Runs in the shell's child after setsid(): its stdin, the PTY slave, becomes its controlling terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


# ======================================================================================================================
# I/O adapters: the runtime identity. Run as root with --runtime-user, the agent keeps only what it needs to start the
# workload as that user and to signal it (CAP_SETUID, CAP_SETGID, CAP_KILL in a managed session's container); every
# process of the workload (the shell, each agent run, each exec) and every file worker drops to the runtime user
# before any code of its own runs, so none of them can signal, trace, impersonate or write to the agent. Run as an
# ordinary user without --runtime-user, the agent and its workload are one identity (no boundary between them).
# ======================================================================================================================


def runtime_switch(config: AgentConfig) -> Callable[[], None]:
    """What makes a child the runtime user, run first in it between fork and exec: no supplementary groups, then the
    gid, then an empty capability bounding set (so nothing it ever execs can regain SETUID, SETGID or KILL, whatever
    file capabilities or a missing no-new-privileges would allow; dropping takes CAP_SETPCAP, which the child still
    has as root), then the uid (real, effective and saved), which clears its capabilities. libc is looked up here, in
    the agent, not in the child. A no-op without a runtime user (the agent not root: its workload is itself)."""
    identity = config.runtime_user
    if identity is None or os.geteuid() != 0:
        return lambda: None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def switch() -> None:
        os.setgroups([])
        os.setresgid(identity.gid, identity.gid, identity.gid)
        for capability in range(MAX_CAPABILITIES):
            if prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
                code = ctypes.get_errno()
                if code == errno.EINVAL and capability:  # past the kernel's last capability: all dropped
                    break
                raise OSError(code, f"cannot drop capability {capability} from the bounding set: {os.strerror(code)}")
        os.setresuid(identity.uid, identity.uid, identity.uid)

    return switch


def require_bounding_set_drop(config: AgentConfig) -> None:
    """As root with a runtime user the agent needs CAP_SETPCAP, or runtime_switch could not empty the workload's
    bounding set: refuse to start rather than start a workload that keeps it."""
    if config.runtime_user is None or os.geteuid() != 0:
        return
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    if not int(fields.get("CapEff", "0").strip(), 16) & (1 << CAP_SETPCAP):
        raise StartupError("agent.py as root needs CAP_SETPCAP to empty the capability bounding set of the processes "
                           "it starts as the runtime user")


def workload_environment(config: AgentConfig, **extra: str) -> dict[str, str]:
    """The environment of the shell and of each exec: the agent's minus the --redact-env variables (credentials for
    the agent CLI's runs only, which get the whole of it), plus `extra`."""
    env = {name: value for name, value in os.environ.items() if name not in config.redact_env}
    env.update(extra)
    return env


def spawn_in_workload(config: AgentConfig, argv: list[str], cwd: Optional[Where] = None,
                      setup: Optional[Callable[[], None]] = None, **popen: Any) -> subprocess.Popen[bytes]:
    """Starts one process of the workload: its own process session, the runtime user, default signals
    (reset_child_signals), and as its working directory the workspace or `cwd` (below it, or from the container's
    `/`), reached as the runtime user without following a symlink (the agent itself may not enter the workspace). A
    failed walk (or an AgentError of `setup`) comes back through a close-on-exec pipe as the AgentError it was; a
    program that cannot be run raises OSError as Popen does."""
    errors_read, errors_write = os.pipe()
    become_runtime_user = runtime_switch(config)
    where = cwd or Where(FileRoot.WORKSPACE, ())

    def prepare() -> None:
        reset_child_signals()
        try:
            try:
                become_runtime_user()
            except OSError as e:
                raise CommandError(f"cannot become the runtime user: {e}") from e
            fd = open_confined_dir(config.root_dir(where.root), where.parts)
            os.fchdir(fd)
            os.close(fd)
            if setup is not None:
                setup()
        except AgentError as e:
            os.write(errors_write, _encode_line({"code": e.code, "message": str(e)[:MAX_WORKER_MESSAGE_CHARS]}))
            raise

    try:
        return subprocess.Popen(argv, start_new_session=True, preexec_fn=prepare, **popen)
    except subprocess.SubprocessError:
        os.close(errors_write)
        errors_write = -1
        raise child_setup_error(os.read(errors_read, CHILD_REPORT_BYTES)) from None
    finally:
        os.close(errors_read)
        if errors_write >= 0:
            os.close(errors_write)


def child_setup_error(report: bytes) -> AgentError:
    """What a child's preparation wrote before it gave up (see spawn_in_workload), as the error it was."""
    try:
        fields = parse_strict_json(report, CHILD_REPORT_BYTES)
    except StrictJsonError:  # the child runs as the runtime user, whom the workload can trace
        fields = None
    with contextlib.suppress(WorkerProtocolError):  # not an error report (worker_failure raises): the one below
        if isinstance(fields, dict) and not isinstance(error := worker_failure(fields), WorkerProtocolError):
            return error
    return CommandError("cannot start the process: its preparation as the runtime user failed")


@contextlib.contextmanager
def files_made_as(identity: Optional[Identity]) -> Iterator[None]:
    """Files this thread makes meanwhile belong to `identity` (setfsuid/setfsgid: this thread only, the agent's
    other rights unchanged). The shell's PTY is made so, as login(1) would: its terminal is its own."""
    if identity is None:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.setfsgid(identity.gid)
    libc.setfsuid(identity.uid)
    try:
        if libc.setfsuid(-1) != identity.uid:  # setfsuid reports no error, only the id now in force
            raise StartupError(f"cannot act as the runtime user {identity} (CAP_SETUID missing?)")
        yield
    finally:
        libc.setfsuid(os.geteuid())
        libc.setfsgid(os.getegid())


# ======================================================================================================================
# I/O adapters: checkpoint archives. The agent writes the manifest and the log, and checks a whole archive before a
# restore changes anything; the trees belong to the runtime user, so a file worker walks them for the archive and
# writes them back from it (restore_tree).
# ======================================================================================================================


def write_archive(destination: Path, manifest: Manifest, log_path: Path, walk_tree: Callable[[str], "Walk"],
                  measure_tree: Callable[[str, int], tuple[int, int]]) -> int:
    """Writes one checkpoint tar: the manifest, then what it includes: the first manifest.log_bytes of the log, and
    each tree as `walk_tree(name)` walks it (write_walked_entries, sparse files as their data). The archive is
    measured first, the trees by `measure_tree(name, entries left)`, and refused with nothing written when a restore
    could not take it (more than MAX_ARCHIVE_ENTRIES members) or its disk could not hold it and still keep
    MIN_FREE_RESERVED_BYTES for the agent's log and outbox (the spool's rule: it may use the blocks kept for root);
    the writing then stops at what was measured, so a tree that grew meanwhile fails the checkpoint instead of
    filling the disk. Returns the entries left out."""
    now = int(time.time())
    fixed = [_bytes_info(ARCHIVE_MANIFEST, len(manifest.to_json()), now)]
    if "log" in manifest.include:
        fixed.append(_bytes_info(ARCHIVE_LOG, manifest.log_bytes, now))
    for tree in manifest.trees:
        info = tarfile.TarInfo(tree)
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, PRIVATE_DIR_MODE, now
        fixed.append(info)
    entries, needed_bytes = len(fixed), sum(tar_member_bytes(info) for info in fixed)
    for tree in manifest.trees:
        tree_entries, tree_bytes = measure_tree(tree, MAX_ARCHIVE_ENTRIES - entries)
        entries, needed_bytes = entries + tree_entries, needed_bytes + tree_bytes
        if entries > MAX_ARCHIVE_ENTRIES:
            raise CommandError(f"too large: the checkpoint would hold more than {MAX_ARCHIVE_ENTRIES} entries, "
                               f"more than a restore takes (the {tree} has too many)")
    needed_bytes += 2 * tarfile.BLOCKSIZE  # the end of the archive, then padding to a whole record
    needed_bytes += -needed_bytes % tarfile.RECORDSIZE
    dir_fd = os.open(destination.parent, DIR_OPEN_FLAGS)
    try:
        require_free_space(dir_fd, needed_bytes, "the session's disk (a checkpoint)", reserved=True)
    finally:
        os.close(dir_fd)
    skipped = 0
    with open(destination, "wb") as raw, tarfile.open(fileobj=cast(BinaryIO, MeasuredSink(raw, needed_bytes)), mode="w",
                                                     format=tarfile.PAX_FORMAT) as archive:
        info, *rest = fixed
        archive.addfile(info, io.BytesIO(manifest.to_json()))
        if "log" in manifest.include:
            info, *rest = rest
            with open(log_path, "rb") as log_file:
                archive.addfile(info, log_file)
        written = len(fixed)
        for tree, info in zip(manifest.trees, rest):
            archive.addfile(info)
            walk = walk_tree(tree)
            try:
                members = ArchiveMembers(walk, f"{tree}/", sparse=True, max_entries=MAX_ARCHIVE_ENTRIES - written)
                for member, data in members:
                    archive.addfile(member, data)
                written, skipped = written + members.entries, skipped + members.left_out
            finally:
                walk.close()
    return skipped


class MeasuredSink:
    """A checkpoint's file, written no further than what was measured for it (write_archive)."""

    def __init__(self, raw: BinaryIO, limit_bytes: int) -> None:
        self._raw, self._limit_bytes, self._written_bytes = raw, limit_bytes, 0

    def write(self, data: bytes) -> int:
        if self._written_bytes + len(data) > self._limit_bytes:
            raise CommandError(f"the checkpoint outgrew the {self._limit_bytes} bytes measured for it (its trees "
                               "changed while it was written); retry")
        self._written_bytes += len(data)
        return self._raw.write(data)

    def tell(self) -> int:
        return self._written_bytes


def _bytes_info(name: str, size: int, mtime: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o600, mtime
    return info


def read_checked_archive(archive: tarfile.TarFile, workload: Optional[WorkloadKind] = None,
                         max_entries: int = MAX_ARCHIVE_ENTRIES,
                         max_bytes: int = MAX_ARCHIVE_BYTES) -> tuple[Manifest, list[tarfile.TarInfo]]:
    """An archive's manifest and members once every rule holds (check_archive_members, the manifest's own, the
    workload's when given, the log's size). Writes nothing."""
    members = archive.getmembers()
    if len(members) > max_entries:
        raise ArchiveError(f"archive has more than {max_entries} entries")
    manifest_member = next((m for m in members if m.name == ARCHIVE_MANIFEST), None)
    if manifest_member is None or not manifest_member.isfile():
        raise ArchiveError(f"archive lacks {ARCHIVE_MANIFEST}")
    if manifest_member.size > MAX_MANIFEST_BYTES:
        raise ArchiveError(f"manifest exceeds {MAX_MANIFEST_BYTES} bytes")
    manifest = parse_manifest(_read_member(archive, manifest_member))
    check_archive_members(members, manifest.include, max_entries, max_bytes)
    if workload is not None and manifest.workload is not workload:
        raise ArchiveError(f"archive is for the {manifest.workload.value} workload, not {workload.value}")
    log_member = next((m for m in members if m.name == ARCHIVE_LOG), None)
    if log_member is not None and log_member.size != manifest.log_bytes:
        raise ArchiveError("output.log size does not match the manifest")
    return manifest, members


def _read_member(archive: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    source = archive.extractfile(member)
    assert source is not None  # a regular file: checked by the caller
    return source.read(member.size)


def prepare_restore(config: AgentConfig, workers: "FileWorkers", archive_path: Path) -> tuple[Manifest, Optional[Path]]:
    """The restore's work, before the agent installs it (install_restore): the whole archive checked first (by the
    agent, which reads it as itself), so a refused one changes nothing; its log put aside in the agent's dir; then
    each tree it holds written into place by a worker as the runtime user (restore_tree). Returns the manifest and
    the log put aside (None when the archive leaves the log as it is)."""
    try:
        archive_file = open(archive_path, "rb")
    except OSError as e:
        raise ArchiveError(f"cannot open {archive_path}: {e.strerror}") from e
    staged_log: Optional[Path] = None
    try:
        with archive_file, tarfile.open(fileobj=archive_file, mode="r:") as archive:
            manifest, members = read_checked_archive(archive, config.workload)
            if "log" in manifest.include:
                staged_log = config.agent_dir / f".restore-{secrets.token_hex(8)}.log"
                source = archive.extractfile(next(m for m in members if m.name == ARCHIVE_LOG))
                assert source is not None
                with open(staged_log, "xb") as target:
                    shutil.copyfileobj(source, target, COPY_CHUNK_BYTES)
            elif _file_bytes(config.agent_dir / LOG_NAME) < manifest.log_bytes:
                raise ArchiveError("the archive leaves the output log as it is, but this session's log is shorter "
                                   f"than its {manifest.log_bytes} bytes: it is another session's archive")
            for tree in manifest.trees:
                workers.restore_tree(config.trees[tree], tree, archive_file.fileno())
        return manifest, staged_log
    except BaseException as e:
        if staged_log is not None:
            staged_log.unlink(missing_ok=True)
        if isinstance(e, (tarfile.TarError, EOFError, OSError)):
            raise ArchiveError(f"cannot restore {archive_path}: {e}") from e
        raise


def _file_bytes(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def install_restore(config: AgentConfig, manifest: Manifest, staged_log: Optional[Path]) -> None:
    """Puts the restored log (when the archive held it) and the continue flag in place."""
    try:
        if staged_log is not None:
            os.replace(staged_log, config.agent_dir / LOG_NAME)
        AgentState(config.agent_dir / AGENT_STATE_NAME).set_resume(manifest.continue_conversation)
    except OSError as e:
        raise CommandError(f"cannot install the restored state: {e}") from e


def restore_tree(archive_file: BinaryIO, root: Path, tree: str) -> None:
    """A worker's part of a restore: the archive's `tree` members replace what the directory `root` holds. The whole
    archive is checked again here; the members are extracted into a private directory inside the root (files
    O_EXCL|O_NOFOLLOW, symlinks last, modes made sane, as an uploaded tar's), then the root's old entries are moved
    into a trash directory beside it and the new ones take their place. The root itself stays (it may be a mount
    point, such as a container's tmpfs home, and only the agent may change the session directory)."""
    archive_file.seek(0)
    with tarfile.open(fileobj=archive_file, mode="r:") as archive:
        _, members = read_checked_archive(archive)
        planned = [(member.name[len(tree) + 1:], member) for member in members if member.name.startswith(tree + "/")]
        root_fd = open_root(root)
        staging, trash = (f".reploy-{kind}-{secrets.token_hex(8)}" for kind in ("restore", "old"))
        try:
            os.mkdir(staging, PRIVATE_DIR_MODE, dir_fd=root_fd)
            staging_fd = os.open(staging, DIR_OPEN_FLAGS, dir_fd=root_fd)
            try:
                _extract_members(archive, planned, staging_fd)
                os.mkdir(trash, PRIVATE_DIR_MODE, dir_fd=root_fd)
                for name in os.listdir(root_fd):
                    if name not in (staging, trash):
                        os.rename(name, f"{trash}/{name}", src_dir_fd=root_fd, dst_dir_fd=root_fd)
                for name in os.listdir(staging_fd):
                    os.rename(name, name, src_dir_fd=staging_fd, dst_dir_fd=root_fd)
            finally:
                os.close(staging_fd)
        finally:
            for name in (staging, trash):
                with contextlib.suppress(OSError):
                    remove_entry(root_fd, name)
            os.close(root_fd)


# ======================================================================================================================
# I/O adapters: confined files. Every path is walked one component at a time from the root's directory fd with
# O_NOFOLLOW, so no symlink is ever followed, wherever it points; nothing here trusts a string check alone.
# ======================================================================================================================

DIR_OPEN_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO never stalls us
FILE_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
CREATED_DIR_MODE = 0o755  #: directories an upload creates on its way


def shown_path(parts: Iterable[str]) -> str:
    return "/".join(parts) or "."


def _walk_error(error: OSError, parts: tuple[str, ...], dir_fd: int) -> AgentError:
    """What failed when opening parts[-1] in dir_fd without following it."""
    where = shown_path(parts)
    if error.errno in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW|O_DIRECTORY answers ENOTDIR for a symlink
        st = lstat_at(dir_fd, parts[-1]) if parts else None
        if error.errno == errno.ELOOP or (st is not None and stat.S_ISLNK(st.st_mode)):
            return RequestError(f"refused: {where} is a symlink; paths may not pass through symlinks")
    if error.errno == errno.ENOENT:
        return CommandError(f"no such file or directory: {where}")
    if error.errno == errno.ENOTDIR:
        return CommandError(f"not a directory: {where}")
    if error.errno in (errno.EACCES, errno.EPERM):
        return CommandError(f"permission denied: {where}")
    return CommandError(f"cannot open {where}: {error.strerror}")


def open_root(root: Path) -> int:
    """The root's own directory: configured, so trusted as given."""
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise CommandError(f"cannot open {root}: {e.strerror}") from e


def open_deepest_dir(root_fd: int, parts: tuple[str, ...]) -> tuple[int, int]:
    """(fd, depth): the deepest directory of root/parts that exists, reached without following a symlink, and how
    many components it covers. A symlink or a non-directory on the way is an error, a missing component is not."""
    fd = os.dup(root_fd)
    depth = 0
    try:
        for name in parts:
            try:
                next_fd = os.open(name, DIR_OPEN_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                break
            except OSError as e:
                raise _walk_error(e, parts[:depth + 1], fd) from e
            os.close(fd)
            fd, depth = next_fd, depth + 1
        return fd, depth
    except BaseException:
        os.close(fd)
        raise


def open_dir_below(root_fd: int, parts: tuple[str, ...], create: bool = False) -> int:
    """The directory root/parts, reached without following a symlink; with `create`, missing ones are made."""
    fd, depth = open_deepest_dir(root_fd, parts)
    try:
        while depth < len(parts):
            if not create:
                raise CommandError(f"no such file or directory: {shown_path(parts[:depth + 1])}")
            with contextlib.suppress(FileExistsError):  # made meanwhile: opened below like any other
                os.mkdir(parts[depth], CREATED_DIR_MODE, dir_fd=fd)
            try:
                next_fd = os.open(parts[depth], DIR_OPEN_FLAGS, dir_fd=fd)
            except OSError as e:
                raise _walk_error(e, parts[:depth + 1], fd) from e
            os.close(fd)
            fd, depth = next_fd, depth + 1
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_confined_dir(root: Path, parts: tuple[str, ...], create: bool = False) -> int:
    root_fd = open_root(root)
    try:
        return open_dir_below(root_fd, parts, create)
    finally:
        os.close(root_fd)


def lstat_at(dir_fd: int, name: str) -> Optional[os.stat_result]:
    """The entry `name` of a directory, not following it; None when it does not exist."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def connect_unix_at(dir_fd: int, name: str, timeout_s: float) -> socket.socket:
    """A connection to the unix socket `name` of a directory, never through a symlink.

    connect(2) follows symlinks, so a session that swapped its control.sock for a link would aim whoever connects at
    any socket of the host. Here the entry is opened O_PATH|O_NOFOLLOW, must be a socket on that fd, and is connected
    through /proc/self/fd/N, which names that very inode whatever the name points at meanwhile (and is short, however
    deep the directory). Anything else is OSError(ENOTSOCK) naming what it is.
    """
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISSOCK(mode):
            raise OSError(errno.ENOTSOCK, f"{name} is a {file_type(mode)}, not a socket")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(f"/proc/self/fd/{fd}")
        except BaseException:
            sock.close()
            raise
        return sock
    finally:
        os.close(fd)


def connect_control_socket(agent_dir: Path, timeout_s: float) -> socket.socket:
    """A connection to AGENT_DIR/control.sock, reached through the directory's descriptor (connect_unix_at)."""
    dir_fd = os.open(agent_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return connect_unix_at(dir_fd, SOCKET_NAME, timeout_s)
    finally:
        os.close(dir_fd)


_FILE_TYPES = ((stat.S_ISREG, "file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink"),
               (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "char-device"),
               (stat.S_ISBLK, "block-device"))


def file_type(mode: int) -> str:
    return next((name for test, name in _FILE_TYPES if test(mode)), "unknown")


def _wire_text(text: str) -> str:
    """A file name or link target for JSON: bytes that are not UTF-8 are shown as U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def entry_json(name: str, st: os.stat_result, dir_fd: int) -> dict[str, Any]:
    """One `stat` or `list` entry: name, type, size, mode (permission bits), mtime, and a symlink's target."""
    entry: dict[str, Any] = {"name": _wire_text(name), "type": file_type(st.st_mode), "size": st.st_size,
                             "mode": stat.S_IMODE(st.st_mode), "mtime": round(st.st_mtime, 3)}
    if stat.S_ISLNK(st.st_mode):
        with contextlib.suppress(OSError):
            entry["target"] = _wire_text(os.readlink(name, dir_fd=dir_fd))
    return entry


def stat_entry(root: Path, parts: tuple[str, ...]) -> dict[str, Any]:
    """The entry at root/parts, not following it if it is a symlink."""
    parent = open_confined_dir(root, parts[:-1])
    try:
        if not parts:
            return entry_json(".", os.fstat(parent), parent)
        st = lstat_at(parent, parts[-1])
        if st is None:
            raise CommandError(f"no such file or directory: {shown_path(parts)}")
        return entry_json(parts[-1], st, parent)
    finally:
        os.close(parent)


def open_regular_file(root: Path, parts: tuple[str, ...]) -> int:
    """The regular file root/parts, opened for reading (blocking) as whoever runs this, without following a link."""
    if not parts:
        raise CommandError(f"is a directory: {shown_path(parts)}")
    parent = open_confined_dir(root, parts[:-1])
    try:
        fd = os.open(parts[-1], FILE_READ_FLAGS, dir_fd=parent)
    except OSError as e:
        raise _walk_error(e, parts, parent) from e
    finally:
        os.close(parent)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # replaced since it was looked at, or never a file
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise CommandError(f"is a directory: {shown_path(parts)}")
        raise RequestError(f"refused: {shown_path(parts)} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def list_entries(root: Path, parts: tuple[str, ...], offset: int, limit: int) -> dict[str, Any]:
    """A page of a directory's entries in name order, bounded by count and by LIST_PAGE_BYTES of JSON."""
    dir_fd = open_confined_dir(root, parts)
    try:
        with os.scandir(dir_fd) as scan:
            names = sorted(entry.name for entry in scan)
        entries: list[dict[str, Any]] = []
        size_bytes = 0
        for name in names[offset:offset + limit]:
            st = lstat_at(dir_fd, name)
            if st is None:
                continue  # removed while we looked
            entry = entry_json(name, st, dir_fd)
            size_bytes += len(json.dumps(entry, ensure_ascii=False))
            if entries and size_bytes > LIST_PAGE_BYTES:
                break
            entries.append(entry)
        return {"entries": entries, "total": len(names), "next_offset": offset + len(entries)}
    finally:
        os.close(dir_fd)


def fd_identity(fd: int) -> tuple[int, int]:
    """What names one directory however it is reached: its device and inode."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


_Listing = list[tuple[str, bool, Any]]  #: (name, is a directory, what the walk yields of it), last name first


def _sorted_entries(dir_fd: int) -> _Listing:
    """A directory's entries with their lstat, in name order."""
    with os.scandir(dir_fd) as scan:
        named = sorted(((entry.name, entry.stat(follow_symlinks=False)) for entry in scan), reverse=True)
    return [(name, stat.S_ISDIR(st.st_mode), st) for name, st in named]


def _typed_entries(dir_fd: int) -> _Listing:
    """A directory's entries as the directory itself types them (no stat, no order): what counting needs."""
    with os.scandir(dir_fd) as scan:
        return [(entry.name, entry.is_dir(follow_symlinks=False), None) for entry in scan]


def _walk_below(dir_fd: int, listing: Callable[[int], _Listing],
                leave: Optional[Callable[[int, str], None]]) -> Iterator[tuple[str, int, str, Any]]:
    """walk_tree_fds's loop, with the listing of each directory as a parameter."""
    fd = os.dup(dir_fd)
    above: list[tuple[_Listing, str, str, tuple[int, int]]] = []
    try:
        pending, prefix = listing(fd), ""
        while pending or above:
            if not pending:
                pending, prefix, name, identity = above.pop()
                up = os.open("..", DIR_OPEN_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = up
                if fd_identity(fd) != identity:
                    raise OSError(errno.ESTALE, "a directory moved while its tree was walked")
                if leave is not None:
                    leave(fd, name)
                continue
            name, is_dir, payload = pending.pop()
            yield prefix + name, fd, name, payload
            if not is_dir:
                continue
            try:
                child = os.open(name, DIR_OPEN_FLAGS, dir_fd=fd)
            except OSError:
                continue  # replaced meanwhile by something that is not a directory: not followed
            try:
                entries = listing(child)
            except BaseException:
                os.close(child)
                raise
            above.append((pending, prefix, name, fd_identity(fd)))
            os.close(fd)
            fd, pending, prefix = child, entries, f"{prefix}{name}/"
    finally:
        os.close(fd)


def walk_tree_fds(dir_fd: int, leave: Optional[Callable[[int, str], None]] = None,
                  ) -> Iterator[tuple[str, int, str, os.stat_result]]:
    """(member name, parent fd, entry name, lstat) for everything below dir_fd, parents before children, in name
    order, never following a symlink. The parent fd stays open while the caller handles the entry; `leave(parent
    fd, name)` is called once a directory's entries are all handled (a removal's rmdir).

    A loop, not a recursion: a workload nests its trees as deep as it likes. It keeps one directory fd of its own
    open, going down by name and back up through '..', checked against the identity it recorded on the way down (a
    directory moved meanwhile ends the walk with ESTALE rather than let it wander outside the tree)."""
    return _walk_below(dir_fd, _sorted_entries, leave)


def count_entries(dir_fd: int, limit: int) -> int:
    """The entries below dir_fd, counted up to one past `limit` without a stat (so a tree too large to archive is
    refused at the speed of reading its directories)."""
    count = 0
    for _ in _walk_below(dir_fd, _typed_entries, None):
        count += 1
        if count > limit:
            break
    return count


def remove_entry(dir_fd: int, name: str) -> None:
    """Removes `name` from a directory, whatever it is, following no symlink: a directory with everything below it,
    by the walk's loop (shutil.rmtree recurses once per level in Python 3.11)."""
    if not stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = os.open(name, DIR_OPEN_FLAGS, dir_fd=dir_fd)
    try:
        for _, parent, entry, st in walk_tree_fds(fd, leave=lambda up, below: os.rmdir(below, dir_fd=up)):
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(entry, dir_fd=parent)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


class Walk:
    """A tree's entries as a tar needs them, parents before children: (entry, fd) pairs, a regular file's fd open on
    it (whoever takes the pair closes the fd); `skipped` counts what the walk itself left out once it is done."""

    skipped = 0

    def __iter__(self) -> Iterator[tuple[WalkEntry, Optional[int]]]:
        raise NotImplementedError

    def close(self) -> None:
        """Idempotent."""


class TreeWalk(Walk):
    """The walk of a directory this process may read (a worker's, or `reploy session cp`'s of a local directory), in
    name order, never following a symlink; sockets, FIFOs, devices and entries replaced meanwhile are skipped."""

    def __init__(self, dir_fd: int) -> None:
        self._dir_fd = dir_fd
        self.skipped = 0

    def __iter__(self) -> Iterator[tuple[WalkEntry, Optional[int]]]:
        for member, parent, name, st in walk_tree_fds(self._dir_fd):
            mode, mtime = stat.S_IMODE(st.st_mode), int(st.st_mtime)
            try:
                if stat.S_ISDIR(st.st_mode):
                    yield WalkEntry(member, "directory", mode, mtime, None), None
                elif stat.S_ISLNK(st.st_mode):
                    yield WalkEntry(member, "symlink", mode, mtime, os.readlink(name, dir_fd=parent)), None
                elif stat.S_ISREG(st.st_mode):
                    yield WalkEntry(member, "file", mode, mtime, None), os.open(name, FILE_READ_FLAGS, dir_fd=parent)
                else:
                    self.skipped += 1
            except OSError:
                self.skipped += 1  # replaced by something else or removed meanwhile


def data_segments(fd: int, st: os.stat_result) -> list[tuple[int, int]]:
    """(offset, length) of the parts of a regular file that hold data, by SEEK_DATA and SEEK_HOLE: a checkpoint
    stores a sparse file's data, not its holes. A file with no fewer blocks than its size is all data (no lseek);
    a file system that cannot say is too. At most MAX_SPARSE_SEGMENTS: the last runs to the end."""
    size = st.st_size
    if st.st_blocks * 512 >= size:
        return [(0, size)]
    segments: list[tuple[int, int]] = []
    offset = 0
    try:
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise
                break  # a hole runs to the end
            if start >= size:
                break
            end = size if len(segments) == MAX_SPARSE_SEGMENTS - 1 else min(os.lseek(fd, start, os.SEEK_HOLE), size)
            segments.append((start, end - start))
            offset = end
    except OSError:
        return [(0, size)]
    return segments


def sparse_map(segments: list[tuple[int, int]], size: int) -> bytes:
    """The data of a GNU sparse 1.0 member starts with its map: the count, then offset and length of each segment,
    one decimal number a line, padded to a tar block. A file ending in a hole ends with an empty segment at its
    size, as GNU tar writes it."""
    if not segments or sum(segments[-1]) < size:
        segments = segments + [(size, 0)]
    text = "".join(f"{offset}\n{length}\n" for offset, length in segments)
    data = f"{len(segments)}\n{text}".encode("ascii")
    return data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)


class FileData:
    """A regular file's bytes as a tar member carries them: whole, or (sparse) its map then its data segments."""

    def __init__(self, fd: int, name: str, size: int, segments: Optional[list[tuple[int, int]]]) -> None:
        self._fd, self._name = fd, name
        self._head = b"" if segments is None else sparse_map(segments, size)
        self._segments = [(0, size)] if segments is None else segments
        self.stored_bytes = len(self._head) + sum(length for _, length in self._segments)

    def read(self, limit: int = -1) -> bytes:
        """tarfile's copy reads exactly stored_bytes, in full pieces; a file that shrank meanwhile is an error,
        never short data."""
        limit = self.stored_bytes if limit < 0 else limit
        pieces = [self._head[:limit]]
        self._head = self._head[limit:]
        wanted = limit - len(pieces[0])
        while wanted and self._segments:
            offset, length = self._segments[0]
            piece = os.pread(self._fd, min(wanted, length, COPY_CHUNK_BYTES), offset) if length else b""
            if length and not piece:
                raise CommandError(f"{self._name[:200]} shrank while it was archived; retry")
            if len(piece) == length:
                self._segments.pop(0)
            else:
                self._segments[0] = (offset + len(piece), length - len(piece))
            pieces.append(piece)
            wanted -= len(piece)
        return b"".join(pieces)


class ArchiveMembers:
    """A walked tree as the tar members it becomes, each entry checked as the hostile input it may be (a worker's
    walk): a name not seen before, directly below a directory given before it (so nothing lies below a file or a
    symlink), at most `max_entries` entries and a tar of MAX_TRANSFER_BYTES (data and headers: serve takes no more of
    one download; a file that would pass it is refused, with the reason, before its bytes go). A regular file's size,
    mode and mtime come from fstat of its fd (which must show a regular file), its bytes from the fd; with `sparse`
    (checkpoints) a file with holes becomes a GNU sparse 1.0 member (PAX), holding its data segments only, which
    Python's tarfile reads back. Modes lose setuid, setgid and sticky. Symlinks go last, and only those that stay inside the tree
    without passing through another symlink. Each pair is (member, data or None); `left_out` counts, once the
    iteration is done, the entries left out, the walk's own included."""

    def __init__(self, walk: Walk, prefix: str = "", sparse: bool = False,
                 max_entries: int = MAX_ARCHIVE_ENTRIES) -> None:
        self._walk, self._prefix, self._sparse, self._max_entries = walk, prefix, sparse, max_entries
        self.entries = 0
        self.left_out = 0

    def __iter__(self) -> Iterator[tuple[tarfile.TarInfo, Optional[FileData]]]:
        kinds: dict[str, str] = {}
        symlinks: list[WalkEntry] = []
        tar_bytes = 2 * tarfile.BLOCKSIZE + tarfile.RECORDSIZE  # the end, and at most a record's padding

        def counted(info: tarfile.TarInfo) -> tarfile.TarInfo:
            nonlocal tar_bytes
            tar_bytes += tar_member_bytes(info)
            if tar_bytes > MAX_TRANSFER_BYTES:
                raise CommandError(f"too large: the tree's tar would be over {MAX_TRANSFER_BYTES} bytes (its files "
                                   "and their tar headers), more than one transfer carries")
            return info
        for entry, fd in self._walk:
            try:
                parent = entry.name.rpartition("/")[0]
                if entry.name in kinds or (parent and kinds.get(parent) != "directory"):
                    raise WorkerProtocolError(f"the walk's entry {entry.name[:80]!r} is not new or not below a "
                                              "directory")
                if len(kinds) >= self._max_entries:
                    raise CommandError(f"too large: the tree has more than {self._max_entries} entries")
                kinds[entry.name] = entry.kind
                info = tarfile.TarInfo(self._prefix + entry.name)
                info.mode, info.mtime = entry.mode & OUTGOING_MODE_MASK, entry.mtime
                if entry.kind == "symlink":
                    symlinks.append(entry)
                    continue
                if entry.kind == "directory":
                    info.type = tarfile.DIRTYPE
                    self.entries += 1
                    yield counted(info), None
                    continue
                assert fd is not None  # check_walk_entry: a file comes with its fd
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise WorkerProtocolError(f"the walk's file {entry.name[:80]!r} is not a regular file")
                data = file_member(info, fd, st, self._sparse)
                self.entries += 1
                yield counted(info), data
            finally:
                if fd is not None:
                    os.close(fd)
        links = {f"{_UPLOAD_TREE}/{entry.name}" for entry in symlinks}
        for entry in symlinks:
            assert entry.target is not None
            if not symlink_stays_inside(f"{_UPLOAD_TREE}/{entry.name}", entry.target, links):
                self.left_out += 1
                continue
            info = tarfile.TarInfo(self._prefix + entry.name)
            info.type, info.linkname, info.mode, info.mtime = tarfile.SYMTYPE, entry.target, 0o777, entry.mtime
            self.entries += 1
            yield counted(info), None
        self.left_out += self._walk.skipped


def write_walked_entries(archive: tarfile.TarFile, walk: Walk) -> int:
    """Writes a walked tree into a tar, files whole (ArchiveMembers). Returns the entries left out."""
    members = ArchiveMembers(walk)
    for info, data in members:
        archive.addfile(info, data)
    return members.left_out


def file_member(info: tarfile.TarInfo, fd: int, st: os.stat_result, sparse: bool) -> FileData:
    """A regular file's member completed from its fstat, and its data. With `sparse` (checkpoints), a file with
    holes becomes a GNU sparse 1.0 member (PAX) holding its data segments only, which Python's tarfile reads back."""
    segments = data_segments(fd, st) if sparse and st.st_size else None
    if segments is not None and sum(length for _, length in segments) == st.st_size:
        segments = None  # no hole: an ordinary member
    data = FileData(fd, info.name, st.st_size, segments)
    info.size, info.mode, info.mtime = data.stored_bytes, stat.S_IMODE(st.st_mode) & OUTGOING_MODE_MASK, \
        int(st.st_mtime)
    if segments is not None:
        info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": info.name,
                            "GNU.sparse.realsize": str(st.st_size)}
    return data


#: A member whose name and link fit ustar's fields as ASCII, with no PAX header of its own, is one header block.
_USTAR_NAME_BYTES = 100
_USTAR_NUMBER_LIMIT = 8 ** 11


def tar_member_bytes(info: tarfile.TarInfo) -> int:
    """What one member takes in a PAX tar as tarfile writes it: its headers and its data, padded to blocks."""
    data_bytes = info.size + (-info.size % tarfile.BLOCKSIZE)
    if (not info.pax_headers and info.name.isascii() and len(info.name) + info.isdir() <= _USTAR_NAME_BYTES
            and info.linkname.isascii() and len(info.linkname) <= _USTAR_NAME_BYTES
            and 0 <= info.mtime < _USTAR_NUMBER_LIMIT and info.size < _USTAR_NUMBER_LIMIT):
        return tarfile.BLOCKSIZE + data_bytes  # tobuf's answer, without building it for each of many entries
    return len(info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")) + data_bytes


def measure_tree(dir_fd: int, prefix: str, max_entries: int) -> tuple[int, int]:
    """(entries, bytes) the tree below dir_fd takes in a checkpoint, as ArchiveMembers would write it (sparse),
    from lstat alone but for files that may have holes, whose data segments are looked up: what the archive needs
    before a byte of it is written. A tree of more than max_entries is counted only that far (count_entries)."""
    entries = count_entries(dir_fd, max_entries)
    if entries > max_entries:
        return entries, 0
    entries = needed_bytes = 0
    for member, parent, name, st in walk_tree_fds(dir_fd):
        info = tarfile.TarInfo(prefix + member)
        info.mtime = int(st.st_mtime)
        if stat.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
        elif stat.S_ISLNK(st.st_mode):
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(name, dir_fd=parent)
        elif not stat.S_ISREG(st.st_mode):
            continue  # left out of the archive
        elif st.st_blocks * 512 < st.st_size:
            fd = os.open(name, FILE_READ_FLAGS, dir_fd=parent)
            try:
                file_member(info, fd, os.fstat(fd), sparse=True)
            finally:
                os.close(fd)
        else:
            info.size = st.st_size
        entries += 1
        if entries > max_entries:
            break  # grown since it was counted: too many, the caller says so
        needed_bytes += tar_member_bytes(info)
    return entries, needed_bytes


def write_tree_tar(dir_fd: int, fileobj: Any) -> int:
    """The tree below dir_fd as a tar stream (members relative to it): directories, regular files and symlinks that
    stay inside the tree. Returns how many entries were left out (sockets, FIFOs, devices, escaping symlinks)."""
    with tarfile.open(fileobj=fileobj, mode="w|", format=tarfile.PAX_FORMAT, bufsize=COPY_CHUNK_BYTES) as archive:
        return write_walked_entries(archive, TreeWalk(dir_fd))


def free_bytes(fd: int, reserved: bool = False) -> int:
    """The free space of fd's file system; with `reserved`, counting the blocks it keeps for root when we are root
    (ext4 keeps some: the workload, never root, cannot fill the session's disk so far that the agent's own files
    cannot grow)."""
    st = os.fstatvfs(fd)
    return (st.f_bfree if reserved and os.geteuid() == 0 else st.f_bavail) * st.f_frsize


def require_free_space(fd: int, needed_bytes: int, where: str, reserved: bool = False) -> None:
    """Refuses (disk_full) when writing needed_bytes would leave less than MIN_FREE_BYTES free where fd lives (with
    `reserved`, the agent's own spool: less than MIN_FREE_RESERVED_BYTES, counting what is kept for root)."""
    available = free_bytes(fd, reserved)
    kept_bytes = MIN_FREE_RESERVED_BYTES if reserved else MIN_FREE_BYTES
    if available - needed_bytes < kept_bytes:
        raise DiskFullError(f"not enough space in {where}: {available // MIB} MiB free, {needed_bytes // MIB} MiB "
                            f"needed and {kept_bytes // MIB} MiB kept free")


def install_staged_file(staged_fd: int, root: Path, parts: tuple[str, ...], mode: int, spare_name: str) -> None:
    """A worker's part of a file upload's commit: the staged bytes (an unnamed O_TMPFILE file in the root's tree, so
    on the same file system as any target below it) are linked under a spare name beside root/parts and renamed over
    it. Missing parent directories are made."""
    check_file_target(root, parts)
    parent = open_confined_dir(root, parts[:-1], create=True)
    try:
        os.fchmod(staged_fd, mode)
        # linkat through /proc (AT_SYMLINK_FOLLOW) names an unnamed file without CAP_DAC_READ_SEARCH.
        os.link(f"/proc/self/fd/{staged_fd}", spare_name, dst_dir_fd=parent, follow_symlinks=True)
        try:
            os.rename(spare_name, parts[-1], src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(spare_name, dir_fd=parent)
            raise
    finally:
        os.close(parent)


def check_file_target(root: Path, parts: tuple[str, ...]) -> None:
    """A file upload may create root/parts or replace a regular file there that the runtime user may write, nothing
    else. Writes nothing."""
    if not parts:
        raise RequestError("refused: a file upload needs a path below the root")
    root_fd = open_root(root)
    try:
        parent, depth = open_deepest_dir(root_fd, parts[:-1])
    finally:
        os.close(root_fd)
    try:
        st = lstat_at(parent, parts[-1]) if depth == len(parts) - 1 else None
        # Checked as the worker, the runtime user: an upload replaces the file, which only its writer may.
        writable = st is None or os.access(parts[-1], os.W_OK, dir_fd=parent, follow_symlinks=False)
    finally:
        os.close(parent)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise CommandError(f"is a directory: {shown_path(parts)}; upload a tar to fill a directory")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise CommandError(f"conflict: {shown_path(parts)} exists and is a {file_type(st.st_mode)}, not a regular "
                           "file")
    if st is not None and not writable:
        raise CommandError(f"permission denied: {shown_path(parts)} is not writable")


def check_tree_target(root: Path, parts: tuple[str, ...]) -> None:
    """A tar upload fills the directory root/parts (made if missing); a non-directory there refuses it."""
    root_fd = open_root(root)
    try:
        fd, _ = open_deepest_dir(root_fd, parts)
        os.close(fd)
    finally:
        os.close(root_fd)


def extract_upload(archive_file: BinaryIO, root: Path, parts: tuple[str, ...], staging_name: str, *,
                   max_bytes: int = MAX_TRANSFER_BYTES, compressed: bool = True) -> int:
    """Vets a tar (read from its start; compressed as tarfile reads it only when `compressed`, and holding at most
    max_bytes of content, sparse files counted at their full size), extracts it into a private directory beside the
    target, then merges that into the target directory root/parts (made if missing). A refused archive or a conflict
    writes nothing. Returns entries written."""
    root_fd = open_root(root)
    try:
        deepest, depth = open_deepest_dir(root_fd, parts)
    finally:
        os.close(root_fd)
    try:
        archive_file.seek(0)
        with tarfile.open(fileobj=archive_file, mode="r:*" if compressed else "r:") as archive:
            planned = vet_upload_members(archive.getmembers(), max_bytes=max_bytes)
            content_bytes = sum(member.size for _, member in planned if member.isfile())
            require_free_space(deepest, content_bytes, shown_path(parts))
            os.mkdir(staging_name, PRIVATE_DIR_MODE, dir_fd=deepest)
            try:
                staging = os.open(staging_name, DIR_OPEN_FLAGS, dir_fd=deepest)
                try:
                    _extract_members(archive, planned, staging)
                    if depth == len(parts):  # the target exists; a new one cannot conflict
                        _check_merge(staging, deepest, shown_path(parts))
                    target = open_dir_below(deepest, parts[depth:], create=True)
                    try:
                        _merge_into(staging, target)
                    finally:
                        os.close(target)
                finally:
                    os.close(staging)
            finally:
                with contextlib.suppress(OSError):
                    remove_entry(deepest, staging_name)
        return len(planned)
    except (tarfile.TarError, EOFError) as e:
        kind = "tar archive" if compressed else "uncompressed tar archive"
        raise ArchiveError(f"refused: not a readable {kind}: {e}") from e
    finally:
        os.close(deepest)


class _DirCursor:
    """The directories of an extraction, each opened one level below the last when the members come parents first
    (as an archive the agent wrote does): a tree nested a thousand levels deep costs an open a member, not an open
    a level a member. `open` answers an fd the cursor owns."""

    def __init__(self, base: int) -> None:
        self._base = base
        self._parts: tuple[str, ...] = ()
        self._fd: Optional[int] = None

    def open(self, parts: tuple[str, ...]) -> int:
        if self._fd is not None and parts == self._parts:
            return self._fd
        below = self._fd is not None and parts[:len(self._parts)] == self._parts
        start = self._fd if below and self._fd is not None else self._base
        fd = open_dir_below(start, parts[len(self._parts):] if below else parts, create=True)
        self.close()
        self._parts, self._fd = parts, fd
        return fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _extract_members(archive: tarfile.TarFile, planned: list[tuple[str, tarfile.TarInfo]], staging: int) -> None:
    """Writes vetted members into the empty private directory `staging`: files with O_EXCL|O_NOFOLLOW (a sparse
    one's holes left holes), hard links within it, symlinks last. Directory modes keep u+rwx (sane_mode), so each
    is set as its directory is reached."""
    cursor = _DirCursor(staging)
    try:
        for name, member in planned:
            parts = tuple(name.split("/"))
            if member.isdir():
                os.fchmod(cursor.open(parts), sane_mode(member.mode, directory=True))
            elif member.islnk():
                os.link(_normalise_member_name(member.linkname), parts[-1], src_dir_fd=staging,
                        dst_dir_fd=cursor.open(parts[:-1]), follow_symlinks=False)
            elif member.isfile():
                fd = os.open(parts[-1], FILE_CREATE_FLAGS, 0o600, dir_fd=cursor.open(parts[:-1]))
                with os.fdopen(fd, "wb") as target:
                    source = archive.extractfile(member)
                    assert source is not None  # vetted: a regular file
                    for offset, length in sparse_segments(member) or [(0, member.size)]:
                        source.seek(offset)
                        target.seek(offset)
                        _copy_exactly(source, target, length)
                    target.truncate(member.size)
                    os.fchmod(fd, sane_mode(member.mode, directory=False))
                    os.utime(fd, (member.mtime, member.mtime))
        for name, member in planned:
            if member.issym():
                parts = tuple(name.split("/"))
                os.symlink(member.linkname, parts[-1], dir_fd=cursor.open(parts[:-1]))
    finally:
        cursor.close()


def _copy_exactly(source: IO[bytes], target: BinaryIO, length: int) -> None:
    while length:
        piece = source.read(min(length, COPY_CHUNK_BYTES))
        if not piece:
            raise ArchiveError("a member's data ends early")
        target.write(piece)
        length -= len(piece)


def _check_merge(staged: int, target: int, shown: str) -> None:
    """Refuses, before anything moves, a staged entry that would replace a directory or fill a non-directory."""
    with os.scandir(staged) as scan:
        entries = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in scan]
    for name, is_dir in entries:
        existing = lstat_at(target, name)
        if existing is None:
            continue
        if is_dir != stat.S_ISDIR(existing.st_mode):
            raise CommandError(f"conflict: {shown}/{name} exists as a {file_type(existing.st_mode)}; the archive "
                               f"holds a {'directory' if is_dir else 'non-directory'} there")
        if is_dir:
            source = os.open(name, DIR_OPEN_FLAGS, dir_fd=staged)
            try:
                destination = os.open(name, DIR_OPEN_FLAGS, dir_fd=target)
            except BaseException:
                os.close(source)
                raise
            try:
                _check_merge(source, destination, f"{shown}/{name}")
            finally:
                os.close(source)
                os.close(destination)


def _merge_into(staged: int, target: int) -> None:
    """Moves every staged entry into the target directory: new names by rename, directories merged, files and
    symlinks replacing what was there."""
    with os.scandir(staged) as scan:
        entries = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in scan]
    for name, is_dir in entries:
        existing = lstat_at(target, name)
        if is_dir and existing is not None and stat.S_ISDIR(existing.st_mode):
            source = os.open(name, DIR_OPEN_FLAGS, dir_fd=staged)
            destination = os.open(name, DIR_OPEN_FLAGS, dir_fd=target)
            try:
                _merge_into(source, destination)
            finally:
                os.close(source)
                os.close(destination)
        else:
            os.rename(name, name, src_dir_fd=staged, dst_dir_fd=target)


# ======================================================================================================================
# I/O adapters: file workers. Every file operation on the workspace and the home (stat, list, the walks behind
# downloads and checkpoints, opening a file, staging, installing and extracting an upload, restoring a tree) runs in
# a worker process of the runtime user, so the kernel confines it as it confines the workload, and the agent never
# opens a path there. The agent makes a SOCK_SEQPACKET pair per operation, writes the request into its end and hands
# the other end to the zygote, which forks a worker to serve it and says so on the channel (a zygote killed after
# the hand-off was queued drops the socket unread: only its word shows a worker has it); answers come back one
# message each, file descriptors (a file to read, an upload's staging) attached with SCM_RIGHTS. The zygote
# (`agent.py zygote`) is started as the runtime user from a sealed in-memory copy of this file, so that user needs
# the interpreter, not access to wherever agent.py lies; it is started again when it is gone (the workload can kill
# it), and a hand-off it never answered goes to the new one. The workload can also trace a worker and make it answer
# anything: what workers say is parsed as hostile ("what a file worker may answer"), and what they can do is what
# the workload can do anyway.
# ======================================================================================================================


def _send_packet(sock: socket.socket, document: dict[str, Any], fds: Iterable[int] = ()) -> None:
    data = json.dumps(document, separators=(",", ":")).encode()  # ASCII: names that are not UTF-8 stay escapes
    if len(data) > WORKER_PACKET_BYTES:
        raise CommandError(f"a file worker message would exceed {WORKER_PACKET_BYTES} bytes")
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sock.sendmsg([data], ancillary)


def received_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The file descriptors a recvmsg's ancillary data carried (SCM_RIGHTS)."""
    return [fd for level, kind, payload in ancillary if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
            for fd in array.array("i", payload[:len(payload) - len(payload) % 4])]


def _receive_packet(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One message and the fds it carried (close-on-exec); (b"", []) at end of file. More than one message's
    bytes or MAX_WORKER_FDS fds is a protocol error, every fd received closed."""
    data, ancillary, flags, _ = sock.recvmsg(WORKER_PACKET_BYTES + 1, socket.CMSG_SPACE(MAX_WORKER_FDS * 4),
                                             socket.MSG_CMSG_CLOEXEC)
    fds = received_fds(ancillary)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) > WORKER_PACKET_BYTES or len(fds) > MAX_WORKER_FDS:
        for fd in fds:
            os.close(fd)
        raise WorkerProtocolError("a file worker message is too large or carries too many file descriptors")
    return data, fds


class WorkerStream:
    """The agent's end of one worker operation: each message parsed strictly and awaited with a deadline; an error
    message raises as the error it reports. A context manager: leaving it closes the socket, which also stops a
    worker still busy (its next send fails). An operation that never hears a word calls `on_silence` (the zygote
    may be stopped: FileWorkers replaces it)."""

    def __init__(self, sock: socket.socket, op: str, on_silence: Callable[[], None] = lambda: None,
                 on_close: Callable[[], None] = lambda: None) -> None:
        self._sock = sock
        self._op = op
        self._on_silence = on_silence
        self._on_close = on_close
        self._heard = False

    def receive(self, timeout_s: float) -> tuple[WorkerPacket, Optional[int]]:
        self._sock.settimeout(timeout_s)
        try:
            data, fds = _receive_packet(self._sock)
            self._heard = True
        except socket.timeout:
            if not self._heard:
                self._on_silence()
            raise CommandError(f"the file worker ({self._op}) said nothing for {timeout_s:g} s") from None
        except OSError as e:
            raise CommandError(f"the file worker ({self._op}) failed: {e.strerror}") from e
        try:
            if not data:
                raise CommandError(f"the file worker ({self._op}) ended without an answer")
            packet = parse_worker_packet(data)
            if packet.kind is WorkerAnswer.ERROR:
                raise worker_failure(packet.fields)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return packet, fds[0] if fds else None

    def final(self, timeout_s: float, kinds: dict[str, Any], with_fd: bool = False) -> tuple[dict[str, Any], Optional[int]]:
        """The one answer of an operation that sends only its result: `done` with exactly these fields, with an fd
        or without one as `with_fd` says."""
        packet, fd = self.receive(timeout_s)
        try:
            if packet.kind is not WorkerAnswer.DONE or (fd is not None) != with_fd:
                raise WorkerProtocolError(f"the file worker ({self._op}) answered out of turn")
            require_fields(packet.fields, kinds, f"{self._op} result")
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        return packet.fields, fd

    def close(self) -> None:
        if self._sock.fileno() >= 0:  # once: the operation is over for FileWorkers' count
            self._sock.close()
            self._on_close()

    def __enter__(self) -> "WorkerStream":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class WorkerWalk(Walk):
    """A worker's walk of a tree, as write_walked_entries takes it: every entry checked (check_walk_entry), at most
    MAX_ARCHIVE_ENTRIES of them, each within WORKER_SILENCE_S of the last."""

    def __init__(self, stream: WorkerStream) -> None:
        self._stream = stream
        self.skipped = 0

    def __iter__(self) -> Iterator[tuple[WalkEntry, Optional[int]]]:
        for _ in range(MAX_ARCHIVE_ENTRIES + 1):
            packet, fd = self._stream.receive(WORKER_SILENCE_S)
            try:
                if packet.kind is WorkerAnswer.DONE:
                    require_fields(packet.fields, {"skipped": int}, "walk result")
                    if fd is not None:
                        raise WorkerProtocolError("the file worker's walk result carries a file descriptor")
                    self.skipped = worker_count(packet.fields["skipped"], "walk's skipped count")
                    return
                entry = check_walk_entry(packet.fields, fd is not None)
            except BaseException:
                if fd is not None:
                    os.close(fd)
                raise
            yield entry, fd
        raise CommandError(f"too large: the tree has more than {MAX_ARCHIVE_ENTRIES} entries")

    def close(self) -> None:
        self._stream.close()


def zygote_linger_left(open_operations: int, last_closed: float, now: float, linger_s: float) -> Optional[float]:
    """How long the zygote may still idle before it is stopped (0: now), or None while an operation is open: its
    worker is the zygote's child, and stopping the zygote would kill it."""
    if open_operations:
        return None
    return max(last_closed + linger_s - now, 0.0)


class FileWorkers:
    """The runtime user's hands on the workspace and the home (see this section's comment). Thread-safe: background
    jobs call it. The zygote starts with the first operation (a session that never touches its files pays nothing,
    and a new session's prompt comes sooner) and ends once none has been open for the linger
    (zygote_linger_left); `close()` ends it and every worker it forked."""

    def __init__(self, config: AgentConfig) -> None:
        self._config = config
        self._lock = threading.Lock()
        self._source_fd = -1  # what the zygote runs, sealed at its start (own_code), closed with it: shared memory
        self._zygote: Optional[subprocess.Popen[bytes]] = None
        self._channel: Optional[socket.socket] = None
        self._suspect = False  # an operation heard nothing: the zygote may hang (stopped, traced)
        self._open = 0  # operations whose WorkerStream is open
        self._last_closed = 0.0  # time.monotonic() of the last one's close
        self._stopped = threading.Event()  # the zygote (this generation) is gone: its linger thread ends

    def _start_zygote(self) -> None:
        self._source_fd = sealed_copy(own_code(), "agent.py")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        become_runtime_user = runtime_switch(self._config)

        def prepare() -> None:
            become_runtime_user()
            reset_child_signals()

        try:
            self._zygote = subprocess.Popen(
                [sys.executable, "-I", "-S", f"/proc/self/fd/{self._source_fd}", "zygote"], stdin=theirs.fileno(),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(self._source_fd,), cwd="/",
                env={name: os.environ[name] for name in ZYGOTE_ENV_NAMES if name in os.environ},
                start_new_session=True, preexec_fn=prepare)
        except (OSError, subprocess.SubprocessError) as e:
            ours.close()
            os.close(self._source_fd)
            self._source_fd = -1
            raise CommandError(f"cannot start the file worker as the runtime user: {e}") from e
        finally:
            theirs.close()
        ours.settimeout(WORKER_START_S)
        self._channel = ours
        self._stopped = stopped = threading.Event()
        threading.Thread(target=self._linger, args=(stopped,), name="file-worker-linger", daemon=True).start()

    def _stop_zygote(self) -> None:
        self._stopped.set()
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._zygote is not None:
            signal_session(self._zygote.pid, signal.SIGKILL)  # the zygote and the workers it forked
            self._zygote.wait()
            self._zygote = None
        if self._source_fd >= 0:
            os.close(self._source_fd)
            self._source_fd = -1

    def _linger(self, stopped: threading.Event) -> None:
        """Stops the zygote once no operation has been open for the linger; ends with it however it ends."""
        linger_s = self._config.file_worker_linger_s
        while not stopped.is_set():
            with self._lock:
                if stopped.is_set():
                    return
                left = zygote_linger_left(self._open, self._last_closed, time.monotonic(), linger_s)
                if left == 0.0:
                    self._stop_zygote()
                    return
            stopped.wait(linger_s if left is None else left)

    def _closed_one(self) -> None:
        with self._lock:
            self._open -= 1
            self._last_closed = time.monotonic()

    def start(self, op: str, fds: Iterable[int] = (), **params: Any) -> WorkerStream:
        """Begins one operation: its request written, its socket handed to the zygote, which says a worker has
        it (a new zygote when the last is gone, did not say so within WORKER_START_S, or left an operation without
        a word)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            _send_packet(ours, {"op": op, **params}, fds)
            with self._lock:
                if self._suspect:
                    self._stop_zygote()
                    self._suspect = False
                for attempt in range(2):
                    try:
                        if self._channel is None:
                            self._start_zygote()
                        assert self._channel is not None
                        _send_packet(self._channel, {}, [theirs.fileno()])
                        self._hear_handed_off()
                        self._open += 1
                        break
                    except OSError as e:  # gone, killed with the hand-off queued, or silent (stopped, traced)
                        self._stop_zygote()
                        if attempt:
                            raise CommandError(f"the file worker does not start: {e}") from e
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return WorkerStream(ours, op, self._heard_nothing, self._closed_one)

    def _hear_handed_off(self) -> None:
        """The zygote's word that it forked a worker for the socket just sent: exactly an empty object, nothing
        attached. End of file raises as ConnectionResetError, a hostile answer as WorkerProtocolError, both
        after the zygote is stopped."""
        assert self._channel is not None
        try:
            data, fds = _receive_packet(self._channel)
            for fd in fds:
                os.close(fd)
            if not data and not fds:
                raise ConnectionResetError(errno.ECONNRESET, "the zygote ended before it took the socket")
            if data != b"{}" or fds:
                raise WorkerProtocolError("the file workers' zygote answered a hand-off with something else")
        except WorkerProtocolError:
            self._stop_zygote()
            raise

    def _heard_nothing(self) -> None:
        self._suspect = True

    def close(self) -> None:
        """Idempotent."""
        with self._lock:
            self._stop_zygote()

    # ---- the operations, each answer checked

    def stat(self, root: Path, parts: tuple[str, ...]) -> dict[str, Any]:
        with self.start("stat", root=str(root), path=list(parts)) as stream:
            fields, _ = stream.final(HANDLER_TIMEOUT_S, {"entry": dict})
        return check_listed_entry(fields["entry"], _wire_text(parts[-1]) if parts else ".")

    def list(self, root: Path, parts: tuple[str, ...], offset: int, limit: int) -> dict[str, Any]:
        """A page of a directory's entries: at most `limit` of them and LIST_PAGE_BYTES of JSON, whatever the worker
        sends (the answer must fit the agent's response line)."""
        entries: list[dict[str, Any]] = []
        size_bytes = 0
        with self.start("list", root=str(root), path=list(parts), offset=offset, limit=limit) as stream:
            for _ in range(limit + 1):
                packet, fd = stream.receive(HANDLER_TIMEOUT_S)
                if fd is not None:
                    os.close(fd)
                    raise WorkerProtocolError("the file worker's listing carries a file descriptor")
                if packet.kind is WorkerAnswer.DONE:
                    require_fields(packet.fields, {"entry": dict, "total": int}, "list result")
                    entry = check_listed_entry(packet.fields["entry"], _wire_text(parts[-1]) if parts else ".")
                    total = worker_count(packet.fields["total"], "listing's total")
                    return {"entry": entry, "entries": entries, "total": max(total, offset + len(entries)),
                            "next_offset": offset + len(entries)}
                require_fields(packet.fields, {"entry": dict}, "list entry")
                entry = check_listed_entry(packet.fields["entry"], None)
                size_bytes += len(json.dumps(entry, ensure_ascii=False))
                if len(entries) >= limit or (entries and size_bytes > LIST_PAGE_BYTES):
                    raise WorkerProtocolError("the file worker's listing is longer than a page")
                entries.append(entry)
        raise WorkerProtocolError("the file worker's listing is longer than a page")

    def open_download(self, root: Path, parts: tuple[str, ...]) -> tuple[dict[str, Any], Optional[int]]:
        """What a download starts from: a regular file's entry and an fd open on it, or a directory's entry alone
        (then walk it). Anything else is refused by the worker."""
        with self.start("download", root=str(root), path=list(parts)) as stream:
            packet, fd = stream.receive(HANDLER_TIMEOUT_S)
        try:
            if packet.kind is not WorkerAnswer.DONE:
                raise WorkerProtocolError("the file worker (download) answered out of turn")
            require_fields(packet.fields, {"entry": dict}, "download result")
            entry = check_listed_entry(packet.fields["entry"], _wire_text(parts[-1]) if parts else ".")
            if entry["type"] != ("file" if fd is not None else "directory") or (
                    fd is not None and not stat.S_ISREG(os.fstat(fd).st_mode)):
                raise WorkerProtocolError("the file worker opened something that is not what it described")
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        return entry, fd

    def walk(self, root: Path, parts: tuple[str, ...]) -> WorkerWalk:
        return WorkerWalk(self.start("walk", root=str(root), path=list(parts)))

    def measure(self, root: Path, prefix: str, max_entries: int) -> tuple[int, int]:
        """(entries, bytes) the tree at root takes in a checkpoint (measure_tree), by a worker's walk of it. Only
        the refusal before writing trusts it: the writing is bounded by it (MeasuredSink) and checks every entry."""
        with self.start("measure", root=str(root), prefix=prefix, max_entries=max_entries) as stream:
            fields, _ = stream.final(WORKER_SILENCE_S, {"entries": int, "bytes": int})
        return (worker_count(fields["entries"], "measured entries", max_entries + 1),
                worker_count(fields["bytes"], "measured bytes"))

    def upload_open(self, root: Path, parts: tuple[str, ...], kind: UploadKind) -> int:
        """An upload's staging: the target checked, then an unnamed file of the runtime user in the root's tree
        (O_TMPFILE), open for writing. It counts against the workload's space and vanishes with its last fd."""
        with self.start("upload_open", root=str(root), path=list(parts), kind=kind.value) as stream:
            _, fd = stream.final(HANDLER_TIMEOUT_S, {}, with_fd=True)
        assert fd is not None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size or fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
            os.close(fd)
            raise WorkerProtocolError("the file worker's staging is not an empty file open for writing")
        return fd

    def install(self, root: Path, parts: tuple[str, ...], mode: int, staged_fd: int, spare_name: str) -> None:
        with self.start("upload_install", [staged_fd], root=str(root), path=list(parts), mode=mode,
                        spare=spare_name) as stream:
            stream.final(WORKER_SILENCE_S, {})

    def extract(self, root: Path, parts: tuple[str, ...], staged_fd: int, spare_name: str) -> int:
        with self.start("upload_extract", [staged_fd], root=str(root), path=list(parts),
                        spare=spare_name) as stream:
            fields, _ = stream.final(WORKER_SILENCE_S, {"entries": int})
        return worker_count(fields["entries"], "extracted entries", MAX_ARCHIVE_ENTRIES)

    def restore_tree(self, root: Path, tree: str, archive_fd: int) -> None:
        with self.start("restore_tree", [archive_fd], root=str(root), tree=tree) as stream:
            stream.final(WORKER_SILENCE_S, {})


def own_code() -> bytes:
    """What the zygote runs: this module's bytecode when it was imported from a cache that
    matches its source (serve's, checked as the import checks it; the interpreter runs a file
    that starts with its magic number as bytecode), else the source, which it then compiles
    at the cost of the memory that compiling leaves (see "an idle session's memory" in
    bench/README.md)."""
    source = Path(__file__).read_bytes()
    cached = globals().get("__cached__")  # None when run as a script
    with contextlib.suppress(OSError):
        code = Path(cached).read_bytes() if isinstance(cached, str) else b""
        if code.startswith(bytecode_header(source)):
            return code
    return source


def bytecode_header(source: bytes) -> bytes:
    """How this interpreter's bytecode of `source`, checked against its hash, begins (PEP 552:
    magic number, flags, the source's hash); serve's compile_agent_bytecode writes such files."""
    import importlib.util
    checked_hash_flags = (0b11).to_bytes(4, "little")
    return importlib.util.MAGIC_NUMBER + checked_hash_flags + importlib.util.source_hash(source)


def sealed_copy(data: bytes, name: str) -> int:
    """An in-memory file holding data, sealed so that nobody can change it: any process given the fd may run it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        _write_all(fd, data)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd


# ---- the worker's side: the zygote and the operations, run as the runtime user


def zygote_main() -> int:
    """`agent.py zygote` (internal; see this section's comment): stdin is the agent's channel. Each message carries
    one socket, and a forked worker serves the operation waiting on it; the zygote ends when the agent does."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the workers
    channel = socket.socket(fileno=0)
    while True:
        try:
            data, fds = _receive_packet(channel)
        except WorkerProtocolError:
            continue
        if not data and not fds:
            return 0
        for fd in fds:
            if os.fork() == 0:
                channel.close()
                try:
                    serve_worker(fd)
                finally:
                    os._exit(0)
            os.close(fd)
        try:
            _send_packet(channel, {})  # FileWorkers._hear_handed_off
        except OSError:
            return 0


def serve_worker(fd: int) -> None:
    """One worker: one request from the agent, the operation, its answers."""
    sock = socket.socket(fileno=fd)
    received: list[int] = []
    try:
        data, received = _receive_packet(sock)
        request = json.loads(data)
        _WORKER_OPS[request.pop("op")](sock, request, received)
    except AgentError as e:
        _send_error(sock, e.code, str(e))
    except OSError as e:
        full = e.errno in DISK_FULL_ERRNOS
        denied = e.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
        _send_error(sock, DiskFullError.code if full else CommandError.code,
                    f"not enough space: {e.strerror}" if full else f"permission denied: {e}" if denied
                    else f"the file worker failed: {e}")
    except Exception as e:  # noqa: BLE001 - whatever went wrong is this one operation's answer
        _send_error(sock, CommandError.code, f"the file worker failed: {e!r}")


def _send_error(sock: socket.socket, code: str, message: str) -> None:
    with contextlib.suppress(OSError):  # the agent has gone: nobody to tell
        _send_packet(sock, {WorkerAnswer.ERROR.value: {"code": code, "message": message[:MAX_WORKER_MESSAGE_CHARS]}})


def _done(sock: socket.socket, fds: Iterable[int] = (), **fields: Any) -> None:
    _send_packet(sock, {WorkerAnswer.DONE.value: fields}, fds)


def _op_stat(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    _done(sock, entry=stat_entry(Path(request["root"]), tuple(request["path"])))


def _op_list(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    root, parts = Path(request["root"]), tuple(request["path"])
    entry = stat_entry(root, parts)
    if entry["type"] != "directory":  # as listing it would say, also when a directory takes its place meanwhile
        raise CommandError(f"not a directory: {shown_path(parts)}")
    page = list_entries(root, parts, request["offset"], request["limit"])
    for item in page["entries"]:
        _send_packet(sock, {WorkerAnswer.ENTRY.value: {"entry": item}})
    _done(sock, entry=entry, total=page["total"])


def _op_download(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    root, parts = Path(request["root"]), tuple(request["path"])
    entry = stat_entry(root, parts)
    if entry["type"] == "directory":
        _done(sock, entry=entry)
        return
    if entry["type"] != "file":
        raise RequestError(f"refused: {shown_path(parts)} is a {entry['type']}; only regular files and directories "
                           "can be downloaded")
    _done(sock, [open_regular_file(root, parts)], entry=entry)


def _op_walk(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    walk = TreeWalk(open_confined_dir(Path(request["root"]), tuple(request["path"])))  # closed when the worker ends
    for entry, fd in walk:
        fields: dict[str, Any] = {"name": entry.name, "type": entry.kind, "mode": entry.mode, "mtime": entry.mtime}
        if entry.target is not None:
            fields["target"] = entry.target
        try:
            _send_packet(sock, {WorkerAnswer.ENTRY.value: fields}, [fd] if fd is not None else [])
        finally:
            if fd is not None:
                os.close(fd)
    _done(sock, skipped=walk.skipped)


def _op_measure(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    entries, needed_bytes = measure_tree(open_root(Path(request["root"])), request["prefix"], request["max_entries"])
    _done(sock, entries=entries, bytes=needed_bytes)


def _op_upload_open(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    root, parts = Path(request["root"]), tuple(request["path"])
    if UploadKind(request["kind"]) is UploadKind.FILE:
        check_file_target(root, parts)
    else:
        check_tree_target(root, parts)
    # Staged in the deepest directory on the way that exists: on the file system the target lies on (the container's
    # `/` holds several), and one the runtime user may write, or the upload is refused now.
    root_fd = open_root(root)
    try:
        near_fd, _ = open_deepest_dir(root_fd, parts[:-1] if UploadKind(request["kind"]) is UploadKind.FILE else parts)
    finally:
        os.close(root_fd)
    try:
        staged = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=near_fd)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise CommandError(f"permission denied: {shown_path(parts)} cannot be written there") from e
        raise
    finally:
        os.close(near_fd)
    _done(sock, [staged])


def _op_upload_install(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    install_staged_file(fds[0], Path(request["root"]), tuple(request["path"]), request["mode"], request["spare"])
    _done(sock)


def _op_upload_extract(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    with os.fdopen(os.dup(fds[0]), "rb") as archive_file:
        entries = extract_upload(archive_file, Path(request["root"]), tuple(request["path"]), request["spare"])
    _done(sock, entries=entries)


def _op_restore_tree(sock: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    with os.fdopen(os.dup(fds[0]), "rb") as archive_file:
        restore_tree(archive_file, Path(request["root"]), request["tree"])
    _done(sock)


_WORKER_OPS: dict[str, Callable[[socket.socket, dict[str, Any], list[int]], None]] = {
    "stat": _op_stat, "list": _op_list, "download": _op_download, "walk": _op_walk, "measure": _op_measure,
    "upload_open": _op_upload_open,
    "upload_install": _op_upload_install, "upload_extract": _op_upload_extract, "restore_tree": _op_restore_tree,
}


# ======================================================================================================================
# Workloads: what runs in the session. The serve loop owns them; they own their processes and file descriptors.
# ======================================================================================================================


class Reactor:
    """The process's one selector: each file descriptor with the callback that handles its readiness."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()

    def watch(self, fd: int, events: int, callback: Callable[..., object]) -> None:
        try:
            self.selector.modify(fd, events, callback)
        except KeyError:
            self.selector.register(fd, events, callback)

    def unwatch(self, fd: int) -> None:
        try:
            self.selector.unregister(fd)
        except KeyError:
            pass

    def poll(self, timeout_s: Optional[float]) -> None:
        for key, mask in self.selector.select(timeout_s):
            current = self.selector.get_map().get(key.fd)
            if current is not None:  # an earlier callback of this batch may have unwatched it
                current.data(mask & current.events)

    def close(self) -> None:
        self.selector.close()


@dataclasses.dataclass(frozen=True)
class WorkloadContext:
    """What a workload may touch: its configuration, the reactor, the log, the outbox."""

    config: AgentConfig
    reactor: Reactor
    log: OutputLog
    outbox: Outbox


class Workload:
    """The interface the serve loop drives; both workloads hold their pending messages in one bounded queue."""

    kind: WorkloadKind

    def __init__(self, ctx: WorkloadContext) -> None:
        self._ctx = ctx
        self._queue = PromptQueue()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def queue_bytes(self) -> int:
        return self._queue.total_bytes

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def tick(self, now: float) -> None: ...
    def next_deadline(self, now: float) -> Optional[float]: ...
    def message(self, text: str, now: float) -> Delivery: raise NotImplementedError
    def interrupt(self, now: float) -> bool: raise NotImplementedError
    def relaunch(self, now: float) -> Optional[int]: ...
    def drained(self) -> bool: raise NotImplementedError
    def turn_state(self) -> TurnState: raise NotImplementedError
    def pid(self) -> Optional[int]: ...
    def status_fields(self) -> dict[str, Any]: raise NotImplementedError

    def busy(self) -> bool:
        """Working: a shell job in the foreground or an agent run executing, or messages held. What a supervisor
        must not freeze or checkpoint (an exited shell is not busy)."""
        return self.turn_state() is TurnState.IN_PROGRESS or bool(self._queue)


class ShellWorkload(Workload):
    """One PTY running the configured shell.

    Busy means the PTY's foreground process group is not the shell's. Nothing reports a change of foreground group,
    so tick() samples it every SHELL_POLL_S; that sampling also opens and closes turns. A message is typed as one
    line only when the shell is idle and has consumed our earlier input at least SHELL_SETTLE_S ago (a shell forks
    its job just after reading the line, and until then it still looks idle); otherwise it is held and typed, in
    order, once that is true again, so a job that reads stdin never swallows a queued command.
    """

    kind = WorkloadKind.SHELL

    def __init__(self, ctx: WorkloadContext) -> None:
        super().__init__(ctx)
        self.columns, self.rows = DEFAULT_COLUMNS, DEFAULT_ROWS
        self._proc: Optional[subprocess.Popen[bytes]] = None
        self._master = self._slave = -1  # we keep the slave open to measure the shell's unread input
        self._input = bytearray()  # accepted for the PTY, not yet written
        self._input_consumed_at: Optional[float] = -SHELL_SETTLE_S  # None while our input is unread
        self._turn: Optional[int] = None
        self._turn_interrupted = False
        self.exit_code: Optional[int] = None
        self._reaping: list[subprocess.Popen[bytes]] = []  # killed shells not yet waited for

    @property
    def running(self) -> bool:
        return self._proc is not None and self.exit_code is None

    def start(self) -> None:
        config = self._ctx.config
        with files_made_as(config.runtime_user):
            master, slave = os.openpty()
        self._set_size(master)
        env = workload_environment(config, TERM=SHELL_TERM, HOME=str(config.home_dir))
        try:
            proc = spawn_in_workload(config, [config.shell], setup=_take_controlling_terminal, stdin=slave,
                                     stdout=slave, stderr=slave, env=env)
        except (OSError, AgentError) as e:
            os.close(master)
            os.close(slave)
            raise CommandError(f"cannot start {config.shell}: {e}") from e
        os.set_blocking(master, False)
        self._proc, self._master, self._slave, self.exit_code = proc, master, slave, None
        self._input.clear()
        self._ctx.reactor.watch(master, selectors.EVENT_READ, self._on_master)

    def stop(self) -> None:
        self._kill("shutdown")
        for proc in self._reaping:
            proc.wait()
        self._reaping.clear()
        self._close_pty()

    def relaunch(self, now: float) -> Optional[int]:
        self._kill("relaunch")
        self._close_pty()
        self._ctx.log.append_marker("shell relaunched")
        self.start()
        self._ctx.outbox.emit(EventKind.RELAUNCH, workload=self.kind.value, pid=self.pid())
        return self.pid()

    def _kill(self, reason: str) -> None:
        if self.running:
            assert self._proc is not None
            signal_session(self._proc.pid, signal.SIGKILL)
            self._reaping.append(self._proc)
            self.exit_code = -signal.SIGKILL
            self._end_turn(Outcome.INTERRUPTED, reason)

    def _close_pty(self) -> None:
        for fd in (self._master, self._slave):
            if fd >= 0:
                self._ctx.reactor.unwatch(fd)
                os.close(fd)
        self._master = self._slave = -1

    # ---- the loop's side

    def tick(self, now: float) -> None:
        self._reaping = [proc for proc in self._reaping if proc.poll() is None]
        if self.running and self._proc is not None and self._proc.poll() is not None:
            self._on_exit(self._proc.returncode)
        job = self._foreground_job()
        if job is not None and self._turn is None:
            self._turn = self._ctx.outbox.start_turn(workload=self.kind.value)
            self._turn_interrupted = False
        elif job is None and self._turn is not None:
            self._end_turn(Outcome.INTERRUPTED if self._turn_interrupted else Outcome.COMPLETED, None)
        if self._input_consumed_at is None and self.running and not self._input and self._unread_input_bytes() == 0:
            self._input_consumed_at = now
        if self._queue and self._ready(now):
            self._type_line(self._queue.pop())

    def next_deadline(self, now: float) -> Optional[float]:
        return now + SHELL_POLL_S if self.running else None

    def _on_exit(self, code: int) -> None:
        assert self._proc is not None
        while self._read_output():
            pass  # what the shell printed last is part of the log
        self.exit_code = code
        signal_session(self._proc.pid, signal.SIGKILL)  # background jobs of the dead shell
        self._end_turn(Outcome.FAILED, "shell_exited")
        how = f"status {code}" if code >= 0 else f"signal {-code}"
        self._ctx.log.append_marker(f"shell exited with {how}; relaunch starts a new one")

    def _end_turn(self, outcome: Outcome, reason: Optional[str]) -> None:
        if self._turn is not None:
            self._ctx.outbox.end_turn(self._turn, outcome, reason=reason)
            self._turn = None

    def _on_master(self, mask: int) -> None:
        if mask & selectors.EVENT_READ:
            self._read_output()
        if mask & selectors.EVENT_WRITE:
            self._flush_input()

    def _read_output(self) -> bool:
        """One bounded read from the PTY into the log; False when nothing was there."""
        try:
            data = os.read(self._master, PTY_READ_BYTES)
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno != errno.EIO:  # EIO is the PTY's end of file
                raise
            data = b""
        if not data:
            self._ctx.reactor.unwatch(self._master)
            return False
        self._ctx.log.append(data)  # past the cap the bytes are read and dropped, so the shell never blocks
        return True

    def _flush_input(self) -> None:
        try:
            written = os.write(self._master, self._input) if self._input else 0
        except BlockingIOError:
            written = 0
        del self._input[:written]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if self._input else 0)
        self._ctx.reactor.watch(self._master, events, self._on_master)

    def _foreground_job(self) -> Optional[int]:
        """The foreground process group when it is not the shell's, else None."""
        if not self.running or self._proc is None:
            return None
        try:
            group = os.tcgetpgrp(self._master)
        except OSError:
            return None
        return None if group == self._proc.pid else group

    def _unread_input_bytes(self) -> int:
        return struct.unpack("i", fcntl.ioctl(self._slave, termios.FIONREAD, b"\0" * 4))[0]

    def _ready(self, now: float) -> bool:
        """Idle, and our last input consumed long enough ago that a job it started would be in the foreground."""
        consumed_at = self._input_consumed_at
        return (consumed_at is not None and now - consumed_at >= SHELL_SETTLE_S
                and self._foreground_job() is None and self.running)

    # ---- verbs

    def message(self, text: str, now: float) -> Delivery:
        if "\n" in text or "\r" in text:
            raise RequestError("a shell message must be one line")
        self._require_running()
        if not self._queue and self._ready(now):
            self._type_line(text)
            return Delivery.DISPATCHED
        self._queue.push(text)
        return Delivery.QUEUED

    def write(self, data: bytes) -> None:
        self._require_running()
        self._send_input(data)

    def interrupt(self, now: float) -> bool:
        job = self._foreground_job()
        if job is None:
            return False
        try:
            os.killpg(job, signal.SIGINT)
        except ProcessLookupError:
            return False
        self._turn_interrupted = True
        return True

    def resize(self, columns: int, rows: int) -> None:
        self.columns, self.rows = columns, rows
        if self._master >= 0:
            self._set_size(self._master)  # the kernel sends SIGWINCH to the foreground job

    def _set_size(self, fd: int) -> None:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", self.rows, self.columns, 0, 0))

    def _type_line(self, text: str) -> None:
        self._send_input(text.encode() + b"\r")  # Enter, as a keyboard sends it

    def _send_input(self, data: bytes) -> None:
        if len(self._input) + len(data) > MAX_PTY_INPUT_BYTES:
            raise UnavailableError(f"terminal input buffer is full ({MAX_PTY_INPUT_BYTES} bytes unread)")
        self._input += data
        self._input_consumed_at = None
        self._flush_input()

    def _require_running(self) -> None:
        if not self.running:
            raise CommandError("the shell has exited; relaunch starts a new one")

    # ---- status

    def drained(self) -> bool:
        return not self._queue and not self._input and self._foreground_job() is None

    def turn_state(self) -> TurnState:
        if self._foreground_job() is not None:
            return TurnState.IN_PROGRESS
        return TurnState.WAITING if self._queue or not self.running else TurnState.IDLE

    def pid(self) -> Optional[int]:
        return self._proc.pid if self.running and self._proc is not None else None

    def status_fields(self) -> dict[str, Any]:
        return {"running": self.running, "exit_code": self.exit_code, "columns": self.columns, "rows": self.rows}


def _secret_values(names: Iterable[str]) -> Iterator[str]:
    """The values to redact; unset or too-short ones are skipped with a note on stderr."""
    for name in names:
        value = os.environ.get(name, "")
        if len(value) >= MIN_SECRET_CHARS:
            yield value
        else:
            print(f"agent.py: not redacting {name}: unset or shorter than {MIN_SECRET_CHARS} characters",
                  file=sys.stderr)


@dataclasses.dataclass
class _Run:
    """One execution of the agent command for one prompt."""

    proc: subprocess.Popen[bytes]
    turn_id: int
    pipes: dict[int, TextPipe]  # open stdout/stderr fds -> their text pipeline
    projector: StreamJsonProjector  # stdout's: did the command report an error result?
    stderr_fd: int
    timeout_at: float
    merger: LineMerger = dataclasses.field(default_factory=LineMerger)
    emitted_bytes: int = 0
    capped: bool = False
    stop_reason: Optional[str] = None  # set once we decide to end it: interrupted, timeout, relaunch, shutdown
    kill_at: Optional[float] = None  # SIGKILL after SIGTERM's grace
    drain_until: Optional[float] = None  # set when the command has exited: its pipes' last chance to reach EOF


class AgentWorkload(Workload):
    """A coding-agent CLI run once per prompt by one serial worker, its output projected into the log.

    stdout is stream-json projected to text, stderr kept as text; both UTF-8 normalised and redacted before they
    reach the log. A run ends when its command has exited and its pipes are drained; the whole process session is
    killed then, so grandchildren never outlive their run.
    """

    kind = WorkloadKind.AGENT

    def __init__(self, ctx: WorkloadContext) -> None:
        super().__init__(ctx)
        self._state = AgentState(ctx.config.agent_dir / AGENT_STATE_NAME)
        self._secrets = tuple(_secret_values(ctx.config.redact_env))
        self._run: Optional[_Run] = None
        self._stopping = False

    def start(self) -> None:
        pass  # nothing runs until a prompt arrives

    def stop(self) -> None:
        self._stopping = True
        run = self._run
        if run is not None:
            run.stop_reason = run.stop_reason or "shutdown"
            signal_session(run.proc.pid, signal.SIGKILL)
            run.proc.wait()
            self._finish(run)

    # ---- verbs

    def message(self, text: str, now: float) -> Delivery:
        log = self._ctx.log
        if log.capped:
            raise CommandError(f"the cumulative output cap of {log.cap_bytes} bytes is reached; this session "
                               "takes no more messages")
        if "\0" in text:
            raise RequestError("params.text: an agent prompt cannot hold a NUL")  # it may become an argv element
        idle = self._run is None and not self._queue
        self._queue.push(text)
        self._start_next(now)
        return Delivery.DISPATCHED if idle else Delivery.QUEUED

    def interrupt(self, now: float) -> bool:
        if self._run is None:
            return False
        self._stop_run("interrupted", now)
        return True

    def relaunch(self, now: float) -> Optional[int]:
        """Ends the current run and forgets the conversation: the next prompt runs without --continue."""
        if self._run is not None:
            self._stop_run("relaunch", now)
        self._state.set_resume(False)
        self._ctx.log.append_marker("relaunched: the next prompt starts a new conversation")
        self._ctx.outbox.emit(EventKind.RELAUNCH, workload=self.kind.value)
        return None

    # ---- the loop's side

    def tick(self, now: float) -> None:
        run = self._run
        if run is None:
            return
        if run.stop_reason is None and now >= run.timeout_at:
            self._stop_run("timeout", now)
        if run.kill_at is not None and now >= run.kill_at:
            signal_session(run.proc.pid, signal.SIGKILL)
            run.kill_at = None
        if run.drain_until is None and run.proc.poll() is not None:
            signal_session(run.proc.pid, signal.SIGKILL)  # leftovers that would hold the pipes open
            run.drain_until = now + PIPE_DRAIN_S
        if run.drain_until is not None and (not run.pipes or now >= run.drain_until):
            self._finish(run)
            self._start_next(now)

    def next_deadline(self, now: float) -> Optional[float]:
        run = self._run
        if run is None:
            return None
        deadlines = [run.kill_at, run.drain_until, run.timeout_at if run.stop_reason is None else None]
        return min((d for d in deadlines if d is not None), default=None)

    def _start_next(self, now: float) -> None:
        config = self._ctx.config
        while self._run is None and self._queue and not self._stopping:
            prompt = self._queue.pop()
            turn_id = self._ctx.outbox.start_turn(workload=self.kind.value, prompt_bytes=len(prompt.encode()))
            on_stdin = len(prompt.encode()) > MAX_ARGV_PROMPT_BYTES
            argv = expand_command(config.agent_argv, None if on_stdin else prompt, config.model, self._state.resume)
            try:
                with prompt_input(config.agent_dir, prompt if on_stdin else None) as stdin:
                    proc = spawn_in_workload(config, argv, stdin=stdin, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, env=dict(os.environ, HOME=str(config.home_dir)))
            except (OSError, AgentError) as e:
                self._ctx.log.append_marker(f"cannot start the agent command: {e}")
                self._ctx.outbox.end_turn(turn_id, Outcome.FAILED, reason="spawn_failed")
                continue
            assert proc.stdout is not None and proc.stderr is not None
            projector = StreamJsonProjector()
            pipes = {
                proc.stdout.fileno(): TextPipe(projector, Redactor(self._secrets)),
                proc.stderr.fileno(): TextPipe(Utf8Normaliser(), Redactor(self._secrets)),
            }
            self._run = _Run(proc, turn_id, pipes, projector, proc.stderr.fileno(), now + config.run_timeout_s)
            for fd in pipes:
                os.set_blocking(fd, False)
                self._ctx.reactor.watch(fd, selectors.EVENT_READ, lambda mask, fd=fd: self._on_pipe(fd))

    def _on_pipe(self, fd: int) -> None:
        run = self._run
        assert run is not None
        try:
            data = os.read(fd, PIPE_READ_BYTES)
        except BlockingIOError:
            return
        if data:
            self._emit_from(run, fd, run.pipes[fd].feed(data))
        else:
            self._close_pipe(run, fd)

    def _close_pipe(self, run: _Run, fd: int) -> None:
        self._ctx.reactor.unwatch(fd)
        self._emit_from(run, fd, run.pipes.pop(fd).finish())

    def _emit_from(self, run: _Run, fd: int, text: str) -> None:
        at_line_start = self._ctx.log.at_line_start
        self._emit(run, run.merger.stderr(text, at_line_start) if fd == run.stderr_fd
                   else run.merger.stdout(text, at_line_start))

    def _emit(self, run: _Run, text: str) -> None:
        """Run output into the log, bounded by the per-run cap (the log itself enforces the cumulative one)."""
        if not text or run.capped:
            return
        data = text.encode()
        cap = self._ctx.config.per_run_cap_bytes
        if run.emitted_bytes + len(data) > cap:
            data = utf8_prefix(data, cap - run.emitted_bytes)
            run.capped = True
        run.emitted_bytes += len(data)
        self._ctx.log.append(data)
        if run.capped:
            self._ctx.log.append_marker(f"this run reached the per-run output cap of {cap} bytes; "
                                        "the rest of its output is discarded")

    def _stop_run(self, reason: str, now: float) -> None:
        run = self._run
        if run is not None and run.stop_reason is None:
            run.stop_reason = reason
            signal_session(run.proc.pid, signal.SIGTERM)
            run.kill_at = now + KILL_GRACE_S

    def _finish(self, run: _Run) -> None:
        for fd in list(run.pipes):
            self._close_pipe(run, fd)
        self._emit(run, run.merger.finish(self._ctx.log.at_line_start))
        for pipe in (run.proc.stdout, run.proc.stderr):
            if pipe is not None:
                pipe.close()
        code = run.proc.returncode
        if run.stop_reason == "timeout":
            outcome, note = Outcome.INTERRUPTED, f"interrupted: the run exceeded its {self._ctx.config.run_timeout_s:g} s timeout"
        elif run.stop_reason is not None:
            outcome, note = Outcome.INTERRUPTED, "interrupted"
        elif code != 0:
            outcome, note = Outcome.FAILED, f"the agent command exited with status {code}"
        elif run.projector.error_result:
            outcome, note = Outcome.FAILED, "the agent command reported an error result (is_error) and exited 0"
        else:
            outcome, note = Outcome.COMPLETED, None
            self._state.set_resume(True)
        if note:
            self._ctx.log.append_marker(note)
        self._ctx.outbox.end_turn(run.turn_id, outcome, exit_code=code, reason=run.stop_reason)
        self._run = None

    # ---- status

    def drained(self) -> bool:
        return self._run is None and not self._queue

    def turn_state(self) -> TurnState:
        if self._run is not None:
            return TurnState.IN_PROGRESS
        return TurnState.WAITING if self._queue else TurnState.IDLE

    def pid(self) -> Optional[int]:
        return self._run.proc.pid if self._run is not None else None

    @property
    def resume(self) -> bool:
        """Whether the next run gets --continue."""
        return self._state.resume

    def status_fields(self) -> dict[str, Any]:
        return {"continue": self.resume}


# ======================================================================================================================
# Harness verbs: commands run beside the workload (exec) and files moved in and out (transfers)
# ======================================================================================================================


@contextlib.contextmanager
def prompt_input(agent_dir: Path, prompt: Optional[str]) -> Iterator[int]:
    """The agent command's stdin: /dev/null, or the prompt in an unnamed file of the agent's own dir (a file, not a
    pipe, so a megabyte needs no writer beside the loop and the command reads it at its own pace)."""
    if prompt is None:
        yield subprocess.DEVNULL
        return
    # O_EXCL: an O_TMPFILE that can never be linked into a tree (linkat answers ENOENT, whoever asks); the command
    # gets it reopened read-only, so it can neither write the agent's file nor give it a name.
    written = os.open(agent_dir, os.O_TMPFILE | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    try:
        _write_all(written, prompt.encode())
        fd = os.open(f"/proc/self/fd/{written}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(written)
    try:
        yield fd
    finally:
        os.close(fd)


def detached_output_paths(config: AgentConfig, exec_id: str) -> tuple[Path, Path]:
    """Where a detached exec's stdout and stderr go (made by the command itself, as the runtime user)."""
    directory = config.home_dir.joinpath(*DETACHED_OUTPUT_DIR)
    return directory / f"{exec_id}.stdout", directory / f"{exec_id}.stderr"


def exec_setup(config: AgentConfig, params: ExecParams, exec_id: str) -> Callable[[], None]:
    """What an exec's child runs before exec, as the runtime user: subreaper_setup, then its stdin from
    `stdin_path` and, detached, its stdout and stderr into new files of DETACHED_OUTPUT_DIR; each reached without
    following a link, a failure reported as the AgentError it is (spawn_in_workload)."""
    subreaper = subreaper_setup()
    names = [path.name for path in detached_output_paths(config, exec_id)]

    def setup() -> None:
        if subreaper is not None:
            subreaper()
        if params.stdin_path is not None:
            fd = open_regular_file(config.root_dir(params.stdin_path.root), params.stdin_path.parts)
            os.dup2(fd, 0)
            os.close(fd)
        if params.detach:
            dir_fd = open_confined_dir(config.home_dir, DETACHED_OUTPUT_DIR, create=True)
            try:
                for target, name in enumerate(names, start=1):
                    fd = os.open(name, FILE_CREATE_FLAGS, 0o600, dir_fd=dir_fd)
                    os.dup2(fd, target)
                    os.close(fd)
            finally:
                os.close(dir_fd)
    return setup


def spawn_exec(config: AgentConfig, params: ExecParams, exec_id: str) -> subprocess.Popen[bytes]:
    """Starts one command as the workload does (spawn_in_workload), in the workspace, a directory below it or an
    absolute one, with the session's HOME and the agent's environment minus the redacted variables."""
    env = workload_environment(config, **dict(params.env), HOME=str(config.home_dir))
    piped = subprocess.DEVNULL if params.detach else subprocess.PIPE
    try:
        return spawn_in_workload(config, list(params.argv), params.cwd, setup=exec_setup(config, params, exec_id),
                                 env=env, stdin=subprocess.PIPE if params.stdin is not None else subprocess.DEVNULL,
                                 stdout=piped, stderr=piped)
    except OSError as e:
        raise CommandError(f"cannot run {params.argv[0]!r}: {e.strerror}") from e


class ExecOutput:
    """One output stream of an exec: kept up to its cap; later bytes are read and dropped, and `truncated` says so.
    The first EXEC_HELD_BYTES are held in memory, so ordinary output (an error on a full disk among it) never needs
    the disk; the rest is spooled to an unnamed file in the agent's dir (the session's disk), so eight execs at a
    16 MiB cap cost no more memory than that. What the disk cannot take is lost, and marked truncated."""

    def __init__(self, cap_bytes: int, spool_dir: Path) -> None:
        self.cap_bytes = cap_bytes
        self.size_bytes = 0
        self.truncated = False
        self._held = bytearray()
        self._spool_dir = spool_dir
        self._fd = -1

    def feed(self, chunk: bytes) -> None:
        room_bytes = self.cap_bytes - self.size_bytes
        if len(chunk) > room_bytes:
            self.truncated = True
            chunk = chunk[:max(room_bytes, 0)]
        held = chunk[:max(EXEC_HELD_BYTES - len(self._held), 0)]
        self._held += held
        self.size_bytes += len(held)
        rest = chunk[len(held):]
        if not rest:
            return
        try:
            if self._fd < 0:
                self._fd = os.open(self._spool_dir, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
            _write_all(self._fd, rest)
        except OSError:  # the session's disk is full: the rest is lost, and said so
            self.truncated = True
            self.cap_bytes = self.size_bytes
            return
        self.size_bytes += len(rest)

    def read(self, offset_bytes: int, max_bytes: int) -> bytes:
        end_bytes = min(offset_bytes + max_bytes, self.size_bytes)
        piece = bytes(self._held[offset_bytes:end_bytes])
        spooled_from = max(offset_bytes, len(self._held))
        if end_bytes > spooled_from:
            piece += os.pread(self._fd, end_bytes - spooled_from, spooled_from - len(self._held))
        return piece

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ExecProcess:
    """One command beside the workload: stdin fed from the request (or a file), stdout and stderr kept apart, an
    optional timeout. Made queued (no process yet: `launch` starts it) when MAX_RUNNING_EXECS already run.

    The command leads its own process session (and group). Its result is final once it has exited, its pipes are
    drained and nothing of it is left: when it exits, whatever it left running is killed (as after an agent run),
    and on timeout or exec_kill all of it is killed at once (see command_processes), so nothing of an exec outlives
    its result (a plain `nohup cmd &` included). A detached one has no pipes (its output goes to files) and is
    answered as soon as it started; it runs on, and is killed by exec_kill, its timeout, or the agent's end.
    """

    def __init__(self, exec_id: str, params: ExecParams, reactor: Reactor, spool_dir: Path, now: float) -> None:
        self.exec_id = exec_id
        self.params = params
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self._reactor = reactor
        self.queued_at = now
        self.started_at = now
        self.timeout_at: Optional[float] = None
        self.ended_at: Optional[float] = None  # the command itself exited
        self.drain_until: Optional[float] = None
        self.finished_at: Optional[float] = None  # the result is final
        self.start_error: Optional[AgentError] = None  # a queued command that could not be started
        self.timed_out = False
        self.killed = False
        cap_bytes = 0 if params.detach else params.output_cap_bytes
        self.stdout = ExecOutput(cap_bytes, spool_dir)
        self.stderr = ExecOutput(cap_bytes, spool_dir)
        self._pipes: dict[int, ExecOutput] = {}  # open until EOF
        self._stdin = memoryview(params.stdin or b"")

    def launch(self, proc: subprocess.Popen[bytes], now: float) -> None:
        """The command started: its pipes watched, its timeout running from now."""
        self.proc, self.started_at = proc, now
        if self.params.timeout_ms is not None:
            self.timeout_at = now + self.params.timeout_ms / 1000
        for pipe, output in ((proc.stdout, self.stdout), (proc.stderr, self.stderr)):
            if pipe is not None:
                fd = pipe.fileno()
                self._pipes[fd] = output
                os.set_blocking(fd, False)
                self._reactor.watch(fd, selectors.EVENT_READ, lambda mask, fd=fd: self._read(fd))
        if proc.stdin is not None:
            os.set_blocking(proc.stdin.fileno(), False)
            self._reactor.watch(proc.stdin.fileno(), selectors.EVENT_WRITE, lambda mask: self._feed_stdin())

    def fail_to_start(self, error: AgentError, now: float) -> None:
        """A queued command that could not be started: exec_wait answers with this error."""
        self.start_error = error
        self._finish(now)

    @property
    def running(self) -> bool:
        return self.finished_at is None

    @property
    def queued(self) -> bool:
        return self.proc is None and self.finished_at is None

    def _read(self, fd: int) -> bool:
        """One bounded read of a pipe; False when nothing more is there now."""
        try:
            data = os.read(fd, PIPE_READ_BYTES)
        except BlockingIOError:
            return False
        if data:
            self._pipes[fd].feed(data)
            return True
        self._reactor.unwatch(fd)
        del self._pipes[fd]
        return False

    def _feed_stdin(self) -> None:
        assert self.proc is not None
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            written = os.write(stdin.fileno(), self._stdin[:PIPE_READ_BYTES]) if self._stdin else 0
        except BlockingIOError:
            return
        except BrokenPipeError:
            written = len(self._stdin)  # the command stopped reading: the rest is dropped
        self._stdin = self._stdin[written:]
        if not self._stdin:
            self._close_stdin()

    def _close_stdin(self) -> None:
        stdin = self.proc.stdin if self.proc is not None else None
        if stdin is not None and not stdin.closed:
            self._reactor.unwatch(stdin.fileno())
            stdin.close()

    def kill(self, now: float) -> bool:
        """exec_kill: the whole session at once (a queued command is dropped). True when it was still running."""
        if self.ended_at is not None or self.finished_at is not None:
            return False
        self.killed = True
        if self.proc is None:
            self._finish(now)
        else:
            kill_command(self.proc.pid, leader_running=True)
        return True

    def tick(self, now: float) -> None:
        if self.finished_at is not None or self.proc is None:
            return
        if self.ended_at is None and self.proc.poll() is not None:
            self.ended_at, self.drain_until = now, now + PIPE_DRAIN_S
        elif self.ended_at is None and self.timeout_at is not None and now >= self.timeout_at and not self.timed_out:
            self.timed_out = True
            kill_command(self.proc.pid, leader_running=True)
        if self.ended_at is None:
            return
        # What the command left: killed on every pass until none is left, since a process forking while we
        # killed can leave a new one behind.
        alive = kill_command(self.proc.pid, leader_running=False)
        assert self.drain_until is not None
        if (not self._pipes and not alive) or now >= self.drain_until:
            self._finish(now)

    def next_deadline(self, now: float) -> Optional[float]:
        if self.finished_at is not None or self.proc is None:
            return None
        if self.ended_at is None:
            return self.timeout_at  # the command's exit wakes the loop through SIGCHLD
        return now + EXEC_DRAIN_POLL_S

    def _finish(self, now: float) -> None:
        for fd in list(self._pipes):
            while self._read(fd):
                pass
            if fd in self._pipes:  # a process that escaped the session still holds it: stop listening
                self._reactor.unwatch(fd)
                del self._pipes[fd]
        self._close_stdin()
        if self.proc is not None:
            for pipe in (self.proc.stdout, self.proc.stderr):
                if pipe is not None:
                    pipe.close()
        self.finished_at = now

    def stop(self, now: float) -> None:
        """Shutdown: the whole command killed, reaped, its pipes and spools closed."""
        if self.proc is not None and self.finished_at is None:
            kill_command(self.proc.pid, leader_running=self.ended_at is None)
            self.proc.wait()
        if self.finished_at is None:
            self._finish(now)
        self.close()

    def close(self) -> None:
        self.stdout.close()
        self.stderr.close()

    def result(self, now: float, params: ExecWaitParams) -> dict[str, Any]:
        if self.start_error is not None:
            raise self.start_error
        if self.running or self.proc is None:  # a queued one that was killed has no exit status of its own
            exit_code: Optional[int] = None
            signal_name: Optional[str] = None if self.running else "SIGKILL"
        else:
            exit_code, signal_name = describe_exit(self.proc.returncode)
        end = self.ended_at if self.ended_at is not None else now
        fields: dict[str, Any] = {
            "exec_id": self.exec_id, "running": self.running, "queued": self.queued,
            "pid": self.proc.pid if self.proc is not None else None, "exit_code": exit_code,
            "signal": signal_name, "timed_out": self.timed_out, "killed": self.killed,
            "duration_ms": round((end - self.started_at) * 1000, 3) if self.proc is not None else 0,
        }
        for name, output, offset in (("stdout", self.stdout, params.stdout_offset_bytes),
                                     ("stderr", self.stderr, params.stderr_offset_bytes)):
            if offset > output.size_bytes:
                raise RequestError(f"params.{name}_offset is past the {output.size_bytes} bytes kept")
            piece = output.read(offset, params.max_bytes)
            fields.update({f"{name}_b64": base64.b64encode(piece).decode("ascii"),
                           f"{name}_next_offset": offset + len(piece), f"{name}_bytes": output.size_bytes,
                           f"{name}_truncated": output.truncated})
        return fields


class ExecTable:
    """The execs of one agent: at most MAX_RUNNING_EXECS running at once, up to MAX_QUEUED_EXECS more waiting their
    turn in order, and up to MAX_DETACHED_EXECS detached ones besides; finished results are kept until released,
    for FINISHED_EXEC_KEEP_S, and at most MAX_FINISHED_EXECS of them (the oldest go first)."""

    def __init__(self, config: AgentConfig, reactor: Reactor) -> None:
        self._config = config
        self._reactor = reactor
        self._execs: dict[str, ExecProcess] = {}
        self._queue: collections.deque[ExecProcess] = collections.deque()

    def _count(self, detached: bool) -> int:
        return sum(1 for p in self._execs.values() if p.running and not p.queued and p.params.detach == detached)

    @property
    def running_count(self) -> int:
        return self._count(detached=False)

    @property
    def busy(self) -> bool:
        """An exec that is not detached runs or waits its turn."""
        return bool(self.running_count or self._queue)

    def start(self, params: ExecParams, now: float) -> ExecProcess:
        if params.detach and params.stdin is not None:
            raise RequestError("params.stdin_b64: a detached exec reads no request's stdin; use stdin_path")
        if params.stdin is not None and params.stdin_path is not None:
            raise RequestError("params.stdin_b64 and params.stdin_path: one stdin at most")
        if params.detach and self._count(detached=True) >= MAX_DETACHED_EXECS:
            raise UnavailableError(f"the detached execs are full: {MAX_DETACHED_EXECS} run; kill one")
        if not params.detach and len(self._queue) >= MAX_QUEUED_EXECS:
            raise UnavailableError(f"the exec queue is full: {MAX_RUNNING_EXECS} run, {MAX_QUEUED_EXECS} wait")
        process = ExecProcess(secrets.token_hex(8), params, self._reactor, self._config.agent_dir, now)
        try:
            if params.detach or (self.running_count < MAX_RUNNING_EXECS and not self._queue):
                process.launch(spawn_exec(self._config, params, process.exec_id), now)
            else:
                self._queue.append(process)
        except BaseException:
            process.close()
            raise
        self._execs[process.exec_id] = process
        return process

    def output_paths(self, process: ExecProcess) -> tuple[Path, Path]:
        return detached_output_paths(self._config, process.exec_id)

    def get(self, exec_id: str) -> ExecProcess:
        try:
            return self._execs[exec_id]
        except KeyError:
            raise CommandError(f"no such exec {exec_id} (a result is kept {FINISHED_EXEC_KEEP_S:g} s after its end, "
                               "until released)") from None

    def release(self, exec_id: str) -> None:
        process = self._execs.pop(exec_id, None)
        if process is not None:
            process.close()

    def _start_queued(self, now: float) -> None:
        """Queued commands started in order while there is room; one that was killed meanwhile is skipped."""
        while self._queue and (self.running_count < MAX_RUNNING_EXECS or not self._queue[0].running):
            process = self._queue.popleft()
            if not process.running:
                continue
            try:
                process.launch(spawn_exec(self._config, process.params, process.exec_id), now)
            except AgentError as e:
                process.fail_to_start(e, now)

    def tick(self, now: float) -> None:
        for process in list(self._execs.values()):
            process.tick(now)
        self._start_queued(now)
        finished = sorted((p for p in self._execs.values() if not p.running), key=lambda p: p.finished_at or 0.0)
        excess = len(finished) - MAX_FINISHED_EXECS
        for index, process in enumerate(finished):
            assert process.finished_at is not None
            if index < excess or now - process.finished_at >= FINISHED_EXEC_KEEP_S:
                self.release(process.exec_id)

    def next_deadline(self, now: float) -> Optional[float]:
        times = [p.next_deadline(now) if p.running else (p.finished_at or 0.0) + FINISHED_EXEC_KEEP_S
                 for p in self._execs.values()]
        return min((t for t in times if t is not None), default=None)

    def stop(self, now: float) -> None:
        for process in self._execs.values():
            process.stop(now)
        self._execs.clear()
        self._queue.clear()


class TarSink:
    """Where a downloaded tree's tar is written on its job's thread: the write end of a pipe whose read end went to
    the client with the `download` answer, so the bytes never pass through the agent's socket or its disk.
    Writing fails once the download is closed, when the reader is gone (EPIPE) or took nothing for
    TRANSFER_IDLE_S, and past MAX_TRANSFER_BYTES."""

    def __init__(self, fd: int) -> None:
        self.fd = fd  # non-blocking: a reader that stops cannot hold the job for longer than TRANSFER_IDLE_S
        self.written_bytes = 0
        self.cancelled = False

    def write(self, data: bytes) -> int:
        if self.written_bytes + len(data) > MAX_TRANSFER_BYTES:
            raise CommandError(f"too large: the tree's tar exceeds {MAX_TRANSFER_BYTES} bytes")
        view = memoryview(data)
        while view:
            if self.cancelled:
                raise CommandError("the download was closed")
            try:
                view = view[os.write(self.fd, view):]
            except BlockingIOError:
                if not select.select([], [self.fd], [], TRANSFER_IDLE_S)[1]:
                    raise CommandError(f"the download's reader took nothing for {TRANSFER_IDLE_S:g} s") from None
            except BrokenPipeError:
                raise CommandError("the download was closed") from None
        self.written_bytes += len(data)
        return len(data)


def as_agent_error(error: BaseException, what: str) -> AgentError:
    """A failure of background work as the request's error: ours as it is, a full disk as disk_full."""
    if isinstance(error, AgentError):
        return error
    if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
        return DiskFullError(f"not enough space: {what}: {error.strerror}")
    return CommandError(f"{what}: {error}")


class StagingDigest:
    """The size and sha256 of an upload's staging, computed on a job of its own while the client writes it, so
    that the commit waits only for the last bytes: run() reads its own fd of the staging from where it got to, and
    once finish() is called (the client has written all) reads to the end and returns (bytes, sha256). More than
    limit_bytes fails it; stop() (the upload is dropped) ends it."""

    def __init__(self, fd: int, limit_bytes: int) -> None:
        self._fd = fd  # its own: run() closes it
        self._limit_bytes = limit_bytes
        self._finishing = threading.Event()
        self._stopped = False

    def finish(self) -> None:
        self._finishing.set()

    def stop(self) -> None:
        self._stopped = True
        self._finishing.set()

    def run(self) -> tuple[int, str]:
        digest = hashlib.sha256()
        buffer = bytearray(COPY_CHUNK_BYTES)
        size_bytes = 0
        try:
            while not self._stopped:
                finishing = self._finishing.is_set()  # before the read: set, every byte is there to read
                count = os.preadv(self._fd, [buffer], size_bytes)
                if count:
                    size_bytes += count
                    if size_bytes > self._limit_bytes:
                        raise CommandError(f"too large: the upload would exceed {self._limit_bytes} bytes")
                    digest.update(memoryview(buffer)[:count])
                elif finishing:
                    return size_bytes, digest.hexdigest()
                else:
                    self._finishing.wait(STAGING_POLL_S)
            raise CommandError("the upload was closed")
        finally:
            os.close(self._fd)


@dataclasses.dataclass
class _Upload:
    """One upload in flight: its staging, the digest of what arrived, and its commit."""

    transfer_id: str
    params: UploadParams
    fd: int  # the staged bytes: an unnamed file of the runtime user in the root's tree (FileWorkers.upload_open)
    touched_at: float
    digest: StagingDigest
    digest_job: BackgroundJob  # StagingDigest.run: (bytes, sha256)
    staged_bytes: int = 0  # the staging's size when last looked at: growing, it counts as touched
    job: Optional[BackgroundJob] = None  # the commit: (entries, bytes, sha256)


@dataclasses.dataclass
class _Download:
    """A directory's tar being written into a pipe (a file's download leaves nothing here: its fd went out)."""

    transfer_id: str
    sink: TarSink
    job: BackgroundJob
    ended_at: Optional[float] = None  # when the job ended: kept TRANSFER_IDLE_S for the client's transfer_close


@dataclasses.dataclass(frozen=True)
class WithFd:
    """A result and the one file descriptor sent with it (SCM_RIGHTS); the agent closes its copy once sent."""

    fields: dict[str, Any]
    fd: int


class TransferTable:
    """Uploads and downloads in progress, at most MAX_OPEN_TRANSFERS (counting those being opened). Every step that
    touches the workspace or the home is a file worker's, on a background job (FileWorkers); the loop keeps the
    state. The bytes never cross the control socket: its client gets a descriptor and moves them itself.

    An upload's answer carries a descriptor of its staging, an unnamed file a worker made in the target's tree;
    the client writes the bytes into it while a job hashes what arrives (StagingDigest), then asks for the commit,
    whose job takes that digest once the last bytes are hashed (the sha256 the client sent must match; the size
    must be the one announced) and has a worker link the file into place, or
    vet a tar, extract it beside its target and merge it in. A refused upload writes nothing outside its staging,
    which vanishes with its last fd; one untouched for TRANSFER_IDLE_S, its staging not growing, is closed.
    A file's download answer carries the fd a worker opened without following links; a tree's, the read end of a
    pipe a job writes the tar into, from a worker's walk; transfer_close then says how that job ended.
    """

    def __init__(self, config: AgentConfig, workers: FileWorkers, start_job: Callable[..., BackgroundJob]) -> None:
        self._config = config
        self._workers = workers
        self._start_job = start_job
        self._uploads: dict[str, _Upload] = {}
        self._downloads: dict[str, _Download] = {}
        self._opening: list[BackgroundJob] = []  # transfers being opened: they count against MAX_OPEN_TRANSFERS

    def root(self, root: FileRoot) -> Path:
        return self._config.root_dir(root)

    def committing(self) -> bool:
        return any(upload.job is not None and not upload.job.finished for upload in self._uploads.values())

    def _require_room(self) -> None:
        self._opening = [job for job in self._opening if not job.finished]
        if len(self._uploads) + len(self._downloads) + len(self._opening) >= MAX_OPEN_TRANSFERS:
            raise UnavailableError(f"{MAX_OPEN_TRANSFERS} transfers are open; finish or close one")

    def _open(self, work: Callable[[], Any], discard: Callable[[Any], None],
              answer: Callable[[Any], WithFd]) -> PendingRequest:
        self._require_room()
        job = self._start_job(work, discard)
        self._opening.append(job)
        return _AwaitJob(job, answer, "cannot open the transfer")

    # ---- uploads

    def open_upload(self, params: UploadParams, now: float) -> PendingRequest:
        if params.kind is UploadKind.TAR and params.mode is not None:
            raise RequestError("params.mode is for file uploads; a tar's members carry their own modes")
        if params.size_bytes is not None and params.size_bytes > MAX_TRANSFER_BYTES:
            raise RequestError(f"too large: {params.size_bytes} bytes; an upload holds at most {MAX_TRANSFER_BYTES}")
        root = self.root(params.root)

        def opened(fd: int) -> WithFd:
            fds = [fd]  # closed if anything here fails; then the digest's job owns its own
            try:
                if params.size_bytes is not None:
                    require_free_space(fd, params.size_bytes, params.root.value)
                fds += [os.dup(fd), os.dup(fd)]
                digest = StagingDigest(fds[2], MAX_TRANSFER_BYTES if params.size_bytes is None
                                       else params.size_bytes)
                digest_job = self._start_job(digest.run, lambda _: None)
            except BaseException:
                for each in fds:
                    os.close(each)
                raise
            transfer_id = secrets.token_hex(8)
            self._uploads[transfer_id] = _Upload(transfer_id, params, fd, now, digest, digest_job)
            return WithFd({"transfer_id": transfer_id}, fds[1])

        return self._open(lambda: self._workers.upload_open(root, params.path, params.kind), os.close, opened)

    def _upload(self, transfer_id: str) -> _Upload:
        try:
            return self._uploads[transfer_id]
        except KeyError:
            raise CommandError(f"no such upload {transfer_id} (an upload untouched for {TRANSFER_IDLE_S:g} s is "
                               "closed)") from None

    def commit(self, params: UploadCommitParams, now: float) -> PendingRequest:
        upload = self._upload(params.transfer_id)
        upload.touched_at = now
        if upload.job is None:
            upload.job = self._start_job(self._commit_work(upload, params.sha256), lambda _: None)
        job = upload.job
        return _AwaitTransfer(lambda: job.finished, lambda: self._committed(upload),
                              lambda: {"transfer_id": upload.transfer_id, "done": False}, now)

    def _commit_work(self, upload: _Upload, sha256: Optional[str]) -> Callable[[], tuple[int, int, str]]:
        params, root = upload.params, self.root(upload.params.root)
        spare_name = f"{STAGING_PREFIX}{upload.transfer_id}"
        mode = sane_mode(DEFAULT_FILE_MODE if params.mode is None else params.mode, directory=False)
        upload.digest.finish()  # the client has written all it will
        digest_job = upload.digest_job

        def commit() -> tuple[int, int, str]:
            while not digest_job.finished:
                digest_job.join(HANDLER_TIMEOUT_S)
            if digest_job.error is not None:
                raise digest_job.error
            staged_bytes, digest = digest_job.result
            if params.size_bytes is not None and staged_bytes != params.size_bytes:
                raise CommandError(f"the upload announced {params.size_bytes} bytes but {staged_bytes} were staged")
            if sha256 is not None and sha256 != digest:
                raise CommandError("sha256 mismatch: the staged bytes differ from what was sent; nothing was written")
            if params.kind is UploadKind.FILE:
                self._workers.install(root, params.path, mode, upload.fd, spare_name)
                return 1, staged_bytes, digest  # entries written
            return self._workers.extract(root, params.path, upload.fd, spare_name), staged_bytes, digest
        return commit

    def _committed(self, upload: _Upload) -> dict[str, Any]:
        job = upload.job
        assert job is not None
        self._drop_upload(upload)
        if job.error is not None:
            raise as_agent_error(job.error, f"the upload to {upload.params.root.value} failed")
        entries, staged_bytes, digest = job.result
        return {"transfer_id": upload.transfer_id, "done": True, "root": upload.params.root.value,
                "path": shown_path(upload.params.path), "kind": upload.params.kind.value,
                "bytes": staged_bytes, "entries": entries, "sha256": digest}

    def _drop_upload(self, upload: _Upload) -> None:
        """Forgets an upload; its staging, never named unless committed, goes with its last fd."""
        self._uploads.pop(upload.transfer_id, None)
        upload.digest.stop()
        if upload.fd >= 0:
            os.close(upload.fd)
            upload.fd = -1

    # ---- downloads

    def open_download(self, params: PathParams, now: float) -> PendingRequest:
        root = self.root(params.root)

        def opened(described: tuple[dict[str, Any], Optional[int]]) -> WithFd:
            entry, fd = described
            if fd is not None:
                return WithFd({"kind": "file", "size": os.fstat(fd).st_size, "entry": entry}, fd)
            read_end, write_end = os.pipe2(os.O_CLOEXEC)
            try:
                with contextlib.suppress(OSError):  # past /proc/sys/fs/pipe-max-size: the default, only slower
                    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, TAR_PIPE_BYTES)
                os.set_blocking(write_end, False)
                sink = TarSink(write_end)
                job = self._start_job(lambda: pack_tree(lambda: self._workers.walk(root, params.path), sink),
                                      lambda _: None)
            except BaseException:
                os.close(read_end)
                os.close(write_end)
                raise
            transfer_id = secrets.token_hex(8)
            self._downloads[transfer_id] = _Download(transfer_id, sink, job)
            return WithFd({"transfer_id": transfer_id, "kind": "tar", "size": None, "entry": entry}, read_end)

        return self._open(lambda: self._workers.open_download(root, params.path),
                          lambda described: None if described[1] is None else os.close(described[1]), opened)

    # ---- closing

    def close(self, transfer_id: str) -> dict[str, Any] | PendingRequest:
        """transfer_close: an upload is dropped with its staged bytes; a tree's download is stopped if its tar is
        still being written, and answered once its job ended: with the job's error if the tar is not whole."""
        answer = {"transfer_id": transfer_id, "closed": True}
        download = self._downloads.pop(transfer_id, None)
        if download is not None:
            if not download.job.finished:
                download.sink.cancelled = True  # a tar left unread: its job stops at its next write
            return _AwaitJob(download.job, lambda _: answer, "the directory's tar is not whole")
        upload = self._upload(transfer_id)
        if upload.job is not None and not upload.job.finished:
            raise CommandError("the upload is being committed; ask upload_commit for its result")
        self._drop_upload(upload)
        return answer

    def tick(self, now: float) -> None:
        for transfer_id, download in list(self._downloads.items()):
            if download.job.finished and download.ended_at is None:
                download.ended_at = now
            if download.ended_at is not None and now - download.ended_at >= TRANSFER_IDLE_S:
                del self._downloads[transfer_id]
        for upload in list(self._uploads.values()):
            if upload.job is None and upload.fd >= 0:
                staged_bytes = os.fstat(upload.fd).st_size
                if staged_bytes != upload.staged_bytes:
                    upload.staged_bytes, upload.touched_at = staged_bytes, now
            if (upload.job is None or upload.job.finished) and now - upload.touched_at >= TRANSFER_IDLE_S:
                self._drop_upload(upload)

    def next_deadline(self) -> Optional[float]:
        times = [t + TRANSFER_IDLE_S for t in (*(upload.touched_at for upload in self._uploads.values()),
                                               *(d.ended_at for d in self._downloads.values() if d.ended_at))]
        return min(times, default=None)

    def close_all(self) -> None:
        """Shutdown: every transfer closed; a job still running gets HANDLER_TIMEOUT_S to notice."""
        for download in self._downloads.values():
            download.sink.cancelled = True
        jobs = [job for job in [u.job for u in self._uploads.values()] + [d.job for d in self._downloads.values()]
                if job]
        for job in jobs:
            job.join(HANDLER_TIMEOUT_S)
        for upload in list(self._uploads.values()):
            if upload.job is None or upload.job.finished:
                self._drop_upload(upload)


def pack_tree(open_walk: Callable[[], WorkerWalk], sink: TarSink) -> int:
    """A download's job: a worker's walk of the tree as a tar into its sink, whose pipe it closes at the end however
    it ends (the reader's end of file). Returns the entries left out."""
    try:
        walk = open_walk()
        try:
            with tarfile.open(fileobj=cast(BinaryIO, sink),  # a stream ("w|"): tarfile only writes and closes it
                              mode="w|", format=tarfile.PAX_FORMAT, bufsize=COPY_CHUNK_BYTES) as archive:
                return write_walked_entries(archive, walk)
        finally:
            walk.close()
    finally:
        os.close(sink.fd)


# ======================================================================================================================
# The serve loop: one selector for the PTY or pipes, the listening socket, the clients and a signal wakeup fd
# ======================================================================================================================


class BackgroundJob:
    """Work that would stall the loop (writing or extracting an archive) runs on a thread; the loop takes the result.

    The thread only computes into paths nobody else uses, then writes a 0 byte to the loop's wakeup fd. All state
    changes happen on the loop. A result nobody wants any more (its request timed out) goes to `discard`.
    """

    def __init__(self, work: Callable[[], Any], discard: Callable[[Any], None], wakeup_fd: int) -> None:
        self.result: Any = None
        self.error: Optional[BaseException] = None
        self.finished = False
        self.abandoned = False
        self._discard = discard
        self._thread = threading.Thread(target=self._run, args=(work, wakeup_fd), daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], Any], wakeup_fd: int) -> None:
        try:
            self.result = work()
        except BaseException as e:  # any failure belongs to the request that waits for it; the loop reports it
            self.error = e
        self.finished = True
        try:
            os.write(wakeup_fd, b"\0")
        except OSError:
            pass  # the wakeup buffer is full, so the loop is awake anyway

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def discard(self) -> None:
        """Cleans up a result nobody will use (a failed job left nothing to clean)."""
        if self.finished and self.error is None:
            self._discard(self.result)


class Connection:
    """One client: one request line in, one response line out, then closed; or, when the request asked to `keep`
    the connection, ready for the next request line (one at a time: a client sends it once the answer is in)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.framer = RequestFramer()
        self.deadline = deadline  # for the request line, then the handler bound, then the response write
        self.answered = 0  # responses sent whole on this connection
        self.request: Optional[Request] = None
        self.pending: Optional[PendingRequest] = None
        self.outgoing = b""
        self.outgoing_fd = -1  # sent with the response's first bytes (SCM_RIGHTS), then closed; or on closing


class PendingRequest:
    """A request the loop answers later: resolve() is asked after every pass until it returns result fields."""

    wake_at: Optional[float] = None  # a time resolve() must be asked at even if nothing happens

    def resolve(self, now: float) -> Optional[dict[str, Any] | WithFd]:
        raise NotImplementedError

    def abandon(self) -> str:
        """The handler bound passed: undo what must be undone and say why for the timeout error."""
        return f"no answer within {HANDLER_TIMEOUT_S:g} s"


class _LongPollRead(PendingRequest):
    """A `read` or `read_fd` at the log's end: answered once bytes come or its wait ends."""

    def __init__(self, server: AgentServer, params: ReadParams, now: float,
                 answer: Callable[[ReadParams], dict[str, Any] | WithFd]) -> None:
        self._server = server
        self._params = params
        self._answer = answer
        self.wake_at: float = now + params.wait_ms / 1000

    def resolve(self, now: float) -> Optional[dict[str, Any] | WithFd]:
        if self._server.log.length_bytes > self._params.offset_bytes or now >= self.wake_at:
            return self._answer(self._params)
        return None


class _Checkpoint(PendingRequest):
    """Admission closed; wait for the workload to drain; write the archive on a thread (the trees walked by workers);
    publish it atomically."""

    def __init__(self, server: AgentServer, workload: Workload, params: CheckpointParams) -> None:
        self._server = server
        self._workload = workload
        self._id = params.checkpoint_id
        self._include = params.include
        agent_dir = server.config.agent_dir
        self._destination = agent_dir / f"{CHECKPOINT_PREFIX}{self._id}.tar"
        self._temporary = agent_dir / f".{CHECKPOINT_PREFIX}{self._id}.tar.tmp"
        self._manifest: Optional[Manifest] = None
        self._job: Optional[BackgroundJob] = None
        server.admission_open = False

    def resolve(self, now: float) -> Optional[dict[str, Any]]:
        try:
            return self._advance()
        except BaseException:
            self._server.admission_open = True  # a failed checkpoint must not leave the session closed
            raise

    def _advance(self) -> Optional[dict[str, Any]]:
        server = self._server
        if self._job is None:
            if not (self._workload.drained() and server.harness_drained()):
                return None
            resume = isinstance(self._workload, AgentWorkload) and self._workload.resume
            manifest = Manifest(self._id, self._workload.kind, server.log.length_bytes, resume, self._include)
            log_path, trees, temporary, workers = server.log.path, server.config.trees, self._temporary, server.workers
            self._manifest = manifest
            self._job = server.start_job(
                lambda: write_archive(temporary, manifest, log_path, lambda tree: workers.walk(trees[tree], ()),
                                      lambda tree, entries: workers.measure(trees[tree], f"{tree}/", entries)),
                lambda _: temporary.unlink(missing_ok=True))
            return None
        if not self._job.finished:
            return None
        server.job = None
        if self._job.error is not None:
            self._temporary.unlink(missing_ok=True)
            raise as_agent_error(self._job.error, "checkpoint failed")
        assert self._manifest is not None
        os.replace(self._temporary, self._destination)
        server.outbox.emit(EventKind.CHECKPOINT, id=self._id, path=str(self._destination),
                           log_bytes=self._manifest.log_bytes)
        # Admission stays closed: work accepted now would be missing from the archive.
        return {"id": self._id, "path": str(self._destination), "bytes": self._destination.stat().st_size,
                "log_bytes": self._manifest.log_bytes, "skipped_entries": self._job.result}

    def abandon(self) -> str:
        self._server.admission_open = True
        if self._job is None:
            return f"checkpoint: the workload did not drain within {HANDLER_TIMEOUT_S:g} s; interrupt it and retry"
        self._job.abandoned = True
        return f"checkpoint: the archive was not written within {HANDLER_TIMEOUT_S:g} s"


class _Restore(PendingRequest):
    """Check the archive and write its trees on a thread (prepare_restore); install the log and state and start the
    workload on the loop."""

    def __init__(self, server: AgentServer, archive_path: Path) -> None:
        self._server = server
        config, workers = server.config, server.workers
        self._job = server.start_job(lambda: prepare_restore(config, workers, archive_path),
                                     lambda prepared: None if prepared[1] is None
                                     else prepared[1].unlink(missing_ok=True))

    def resolve(self, now: float) -> Optional[dict[str, Any]]:
        if not self._job.finished:
            return None
        self._server.job = None
        if self._job.error is not None:
            raise as_agent_error(self._job.error, "restore failed")
        manifest, staged_log = self._job.result
        install_restore(self._server.config, manifest, staged_log)
        self._server.start_session(restored=manifest)
        return {"id": manifest.checkpoint_id, "log_bytes": manifest.log_bytes}

    def abandon(self) -> str:
        self._job.abandoned = True
        return (f"restore: not done within {HANDLER_TIMEOUT_S:g} s; an archive that is refused changes nothing, but "
                "this one's trees may be partly in place: restore it again")


class _ExecWait(PendingRequest):
    """exec_wait: answers once the exec's result is final, or when its wait ends with the result so far."""

    def __init__(self, table: ExecTable, params: ExecWaitParams, now: float) -> None:
        self._table = table
        self._params = params
        self.wake_at: float = now + params.wait_ms / 1000

    def resolve(self, now: float) -> Optional[dict[str, Any]]:
        process = self._table.get(self._params.exec_id)
        if process.running and now < self.wake_at:
            return None
        fields = process.result(now, self._params)
        if self._params.release and not process.running and all(
                fields[f"{name}_next_offset"] == fields[f"{name}_bytes"] for name in ("stdout", "stderr")):
            self._table.release(process.exec_id)
        return fields


class _AwaitJob(PendingRequest):
    """Answers with answer(result) once a background job (a file worker's operation) is done; its failure is the
    request's error. Abandoned at the handler bound, the job's result is discarded when it comes (AgentServer)."""

    def __init__(self, job: BackgroundJob, answer: Callable[[Any], dict[str, Any] | WithFd], what: str) -> None:
        self._job = job
        self._answer = answer
        self._what = what

    def resolve(self, now: float) -> Optional[dict[str, Any] | WithFd]:
        if not self._job.finished:
            return None
        if self._job.error is not None:
            raise as_agent_error(self._job.error, self._what)
        return self._answer(self._job.result)

    def abandon(self) -> str:
        self._job.abandoned = True
        return super().abandon()


class _AwaitTransfer(PendingRequest):
    """Answers once `ready()` holds, or after TRANSFER_WAIT_S with `waiting()` (the client asks again)."""

    def __init__(self, ready: Callable[[], bool], answer: Callable[[], dict[str, Any]],
                 waiting: Callable[[], dict[str, Any]], now: float) -> None:
        self._ready = ready
        self._answer = answer
        self._waiting = waiting
        self.wake_at: float = now + TRANSFER_WAIT_S

    def resolve(self, now: float) -> Optional[dict[str, Any]]:
        if self._ready():
            return self._answer()
        return self._waiting() if now >= self.wake_at else None


class AgentServer:
    """Owns the session: socket, log, outbox, workload, clients. `run_once()` is one pass of the loop.

    Each pass, in order: wait for readiness or the nearest deadline; run the ready callbacks (PTY or pipes into the
    log, clients' request bytes, signals); let the workload advance (reap, sample, start queued work); answer
    pending requests whose condition now holds, or time them out; drop clients past their deadline.
    """

    def __init__(self, config: AgentConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._reactor = Reactor()
        self._connections: set[Connection] = set()
        self._workload: Optional[Workload] = None
        self.job: Optional[BackgroundJob] = None
        self.admission_open = False
        self._stop_reason = ""  # the signal that ended serving; empty while serving
        self._busy_seen_at = clock()  # when the workload was last seen busy (or the agent started)
        self._wakeup_read, self._wakeup_write = socket.socketpair()
        for end in (self._wakeup_read, self._wakeup_write):
            end.setblocking(False)
        self._handlers: dict[Method, Callable[[Any, float], dict[str, Any] | WithFd | PendingRequest]] = {
            Method.MESSAGE: self._message, Method.INTERRUPT: self._interrupt, Method.RELAUNCH: self._relaunch,
            Method.STATUS: self._status, Method.READ: self._read, Method.READ_FD: self._read_fd,
            Method.WRITE: self._write,
            Method.RESIZE: self._resize, Method.CHECKPOINT: self._checkpoint, Method.RESTORE: self._restore,
            Method.SUSPEND: self._suspend, Method.EGRESS_NOTE: self._egress_note,
            Method.EXEC: self._exec, Method.EXEC_WAIT: self._exec_wait, Method.EXEC_KILL: self._exec_kill,
            Method.STAT: self._stat, Method.LIST: self._list, Method.UPLOAD: self._upload,
            Method.UPLOAD_COMMIT: self._upload_commit, Method.DOWNLOAD: self._download,
            Method.TRANSFER_CLOSE: self._transfer_close,
        }
        self.execs = ExecTable(config, self._reactor)
        self.drafts = MessageDrafts(lambda: secrets.token_hex(8))
        self._file_jobs: list[BackgroundJob] = []  # file workers' operations in flight (at most MAX_WORKER_JOBS)
        self.workers = FileWorkers(config)
        try:
            self._listener = OwnedSocket(config.agent_dir / SOCKET_NAME)
        except BaseException:
            self.workers.close()
            raise
        self.tcp_listener: Optional[TcpListener] = None
        try:
            self.transfers = TransferTable(config, self.workers, self.start_file_job)
            if config.listen is not None:
                self.tcp_listener = TcpListener(*config.listen)
            self.outbox = Outbox(config.agent_dir / OUTBOX_NAME)
            self.outbox.reconcile()
            restored = None
            if config.restore_path is not None:
                restored, staged_log = prepare_restore(config, self.workers, config.restore_path)
                install_restore(config, restored, staged_log)
            self.log = self._open_log()
            if restored is not None or not config.await_restore:
                self.start_session(restored)
        except BaseException:
            self._listener.close()
            if self.tcp_listener is not None:
                self.tcp_listener.close()
            self.workers.close()
            raise
        # The transports are thin: each listener only accepts; every connection meets the same protocol core.
        listeners = [self._listener.sock] + ([self.tcp_listener.sock] if self.tcp_listener is not None else [])
        for listener in listeners:
            self._reactor.watch(listener.fileno(), selectors.EVENT_READ,
                                lambda mask, sock=listener: self._on_listener(sock, mask))
        self._reactor.watch(self._wakeup_read.fileno(), selectors.EVENT_READ, self._on_wakeup)

    def _open_log(self) -> OutputLog:
        return OutputLog(self.config.agent_dir / LOG_NAME, self.config.log_cap_bytes,
                         text=self.config.workload is WorkloadKind.AGENT)

    def start_session(self, restored: Optional[Manifest]) -> None:
        """Starts the workload; a log that already holds bytes gets a marker saying why they are there."""
        if restored is not None:
            self.log.close()
            self.log = self._open_log()
            self.outbox.emit(EventKind.RESTORE, id=restored.checkpoint_id, log_bytes=restored.log_bytes)
        if self.log.length_bytes:
            self.log.append_marker(f"restored from checkpoint {restored.checkpoint_id}" if restored
                                   else "agent restarted; earlier output is kept above")
        ctx = WorkloadContext(self.config, self._reactor, self.log, self.outbox)
        workload = ShellWorkload(ctx) if self.config.workload is WorkloadKind.SHELL else AgentWorkload(ctx)
        workload.start()
        self._workload = workload
        self.admission_open = True
        self.outbox.emit(EventKind.SESSION_START, workload=workload.kind.value, agent_pid=os.getpid(),
                         log_bytes=self.log.length_bytes)

    # ---- the loop

    def run(self) -> int:
        """Serves until SIGTERM, SIGINT or SIGHUP; then shuts down cleanly. Returns the exit code."""
        with self._signals():
            while not self._stop_reason:
                self.run_once()
        return 0

    def run_once(self) -> None:
        now = self._clock()
        wake_at = self._next_wake(now)
        self._reactor.poll(None if wake_at is None else max(wake_at - now, 0.0))
        now = self._clock()
        self._note_busy(now)  # before tick reaps what ended during the wait: it was busy until now
        if self._workload is not None:
            self._workload.tick(now)
        self._note_busy(now)
        self.execs.tick(now)
        self.transfers.tick(now)
        self.drafts.expire(now)
        if self.job is not None and self.job.finished and self.job.abandoned:
            self.job.discard()
            self.job = None
        for job in [job for job in self._file_jobs if job.finished]:
            self._file_jobs.remove(job)
            if job.abandoned:
                job.discard()
        for conn in list(self._connections):
            self._serve(conn, now)

    def _note_busy(self, now: float) -> bool:
        busy = (self._workload is not None and self._workload.busy()) or not self.harness_drained()
        if busy:
            self._busy_seen_at = now
        return busy

    def _next_wake(self, now: float) -> Optional[float]:
        times: list[Optional[float]] = [conn.deadline for conn in self._connections]
        times += [conn.pending.wake_at for conn in self._connections if conn.pending and conn.pending.wake_at]
        if self._workload is not None:
            times.append(self._workload.next_deadline(now))
        times += [self.execs.next_deadline(now), self.transfers.next_deadline(), self.drafts.next_deadline()]
        return min((t for t in times if t is not None), default=None)

    def _signals(self) -> "_SignalWakeup":
        return _SignalWakeup(self._wakeup_write.fileno(), (signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                                            signal.SIGCHLD))

    def _on_wakeup(self, mask: int) -> None:
        try:
            data = self._wakeup_read.recv(RECV_BYTES)
        except BlockingIOError:
            return
        # Signal numbers from the wakeup fd; 0 is a finished BackgroundJob; SIGCHLD needs only the pass itself.
        for number in data:
            if number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                self._stop_reason = signal.Signals(number).name

    def harness_drained(self) -> bool:
        """No exec runs and no upload is being committed: the workspace holds still for a checkpoint."""
        return not self.execs.busy and not self.transfers.committing()

    def start_job(self, work: Callable[[], Any], discard: Callable[[Any], None]) -> BackgroundJob:
        if self.job is not None:
            raise UnavailableError("a checkpoint or restore is still in progress")
        self.job = BackgroundJob(work, discard, self._wakeup_write.fileno())
        return self.job

    def start_file_job(self, work: Callable[[], Any], discard: Callable[[Any], None]) -> BackgroundJob:
        """A file worker's operation on a thread (it may wait up to WORKER_SILENCE_S on a worker); at most
        MAX_WORKER_JOBS at once. `discard` cleans up a result its request no longer wants."""
        if len(self._file_jobs) >= MAX_WORKER_JOBS:
            raise UnavailableError(f"{MAX_WORKER_JOBS} file operations are in flight; retry")
        job = BackgroundJob(work, discard, self._wakeup_write.fileno())
        self._file_jobs.append(job)
        return job

    def close(self) -> None:
        """Clean shutdown: pending requests answered, workload killed, session end recorded, socket removed."""
        for conn in list(self._connections):
            if conn.pending is not None and conn.request is not None:
                conn.outgoing = encode_error(conn.request.request_id, UnavailableError.code, "the agent is stopping")
                try:
                    conn.sock.send(conn.outgoing)
                except OSError:
                    pass
            self._close(conn)
        if self.job is not None:
            self.job.join(HANDLER_TIMEOUT_S)
            self.job.discard()
        self.execs.stop(self._clock())
        self.transfers.close_all()
        self.workers.close()
        for job in self._file_jobs:
            job.join(HANDLER_TIMEOUT_S)  # their workers are gone: they end at once
            if job.finished:
                job.discard()
        if self._workload is not None:
            self._workload.stop()
            self.outbox.end_open_turns(Outcome.INTERRUPTED, "shutdown")
            self.outbox.emit(EventKind.SESSION_END, reason=self._stop_reason or "stopped")
        self._listener.close()
        if self.tcp_listener is not None:
            self.tcp_listener.close()
        self.log.close()
        self.outbox.close()
        self._reactor.close()
        self._wakeup_read.close()
        self._wakeup_write.close()

    # ---- clients

    def _on_listener(self, listener: socket.socket, mask: int) -> None:
        for _ in range(MAX_ACCEPTS_PER_WAKEUP):
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, ConnectionAbortedError):
                return
            sock.setblocking(False)
            conn = Connection(sock, self._clock() + CLIENT_IDLE_TIMEOUT_S)
            self._connections.add(conn)
            self._reactor.watch(sock.fileno(), selectors.EVENT_READ, lambda mask, c=conn: self._on_client(c, mask))

    def _on_client(self, conn: Connection, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._send(conn)
            return
        try:
            data = conn.sock.recv(RECV_BYTES)
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        if not data and conn.answered and conn.framer.empty:
            self._close(conn)  # a kept connection its client is done with
            return
        try:
            line = conn.framer.feed(data) if data else conn.framer.eof()
        except RequestError as e:
            self._respond(conn, encode_error(e.request_id, e.code, str(e)))
            return
        if line is not None:
            self.handle_line(conn, line)

    def handle_line(self, conn: Connection, line: bytes) -> None:
        """The protocol core's entry: one request line in; the connection gets its response now or later."""
        now = self._clock()
        self._reactor.unwatch(conn.sock.fileno())
        conn.deadline = now + HANDLER_TIMEOUT_S
        try:
            conn.request = parse_request(line)
        except RequestError as e:
            self._respond(conn, encode_error(e.request_id, e.code, str(e)))
            return
        request = conn.request
        if request.method in DESCRIPTOR_METHODS and conn.sock.family != socket.AF_UNIX:
            self._respond(conn, encode_error(request.request_id, RequestError.code, (
                f"{request.method.value} answers with a file descriptor: only on the unix socket, not over TCP")))
            return
        self._settle(conn, lambda: self._handlers[request.method](request.params, now))

    def _serve(self, conn: Connection, now: float) -> None:
        pending = conn.pending
        if pending is not None:
            self._settle(conn, lambda: pending.resolve(now))
            if conn.pending is not None and now >= conn.deadline and conn.request is not None:
                self._respond(conn, encode_error(conn.request.request_id, HandlerTimeout.code, pending.abandon()))
        elif now >= conn.deadline:
            self._close(conn)  # silent, or not reading its response

    def _settle(self, conn: Connection, step: Callable[[], dict[str, Any] | WithFd | PendingRequest | None]) -> None:
        """Runs a handler step; answers with its result or error, or parks the request when it must wait."""
        assert conn.request is not None
        request = conn.request
        try:
            outcome = step()
        except AgentError as e:
            self._respond(conn, encode_error(request.request_id, e.code, str(e)))
            return
        except Exception as e:  # a bug in one handler must not end the session for every client; report it
            traceback.print_exc(file=sys.stderr)
            self._respond(conn, encode_error(request.request_id, CommandError.code, f"internal error: {e!r}"))
            return
        if isinstance(outcome, PendingRequest):
            conn.pending = outcome
        elif isinstance(outcome, WithFd):
            self._respond(conn, encode_result(request.request_id, request.method, outcome.fields), outcome.fd)
        elif outcome is not None:
            self._respond(conn, encode_result(request.request_id, request.method, outcome))

    def _respond(self, conn: Connection, response: bytes, fd: int = -1) -> None:
        conn.pending = None
        conn.outgoing = response
        conn.outgoing_fd = fd
        conn.deadline = self._clock() + CLIENT_IDLE_TIMEOUT_S
        self._send(conn)

    def _send(self, conn: Connection) -> None:
        try:
            if conn.outgoing_fd >= 0:
                rights = array.array("i", [conn.outgoing_fd]).tobytes()
                sent = conn.sock.sendmsg([conn.outgoing], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
                os.close(conn.outgoing_fd)  # the client holds it now
                conn.outgoing_fd = -1
            else:
                sent = conn.sock.send(conn.outgoing)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._close(conn)
            return
        conn.outgoing = conn.outgoing[sent:]
        if conn.outgoing:
            self._reactor.watch(conn.sock.fileno(), selectors.EVENT_WRITE, lambda mask: self._on_client(conn, mask))
        elif conn.request is not None and conn.request.keep:
            self._await_next_request(conn)
        else:
            self._close(conn)

    def _await_next_request(self, conn: Connection) -> None:
        """A kept connection after its answer: the next request line, under the same idle bound as a new client's."""
        conn.answered += 1
        conn.request = None
        conn.framer = RequestFramer()
        conn.deadline = self._clock() + CLIENT_IDLE_TIMEOUT_S
        self._reactor.watch(conn.sock.fileno(), selectors.EVENT_READ, lambda mask: self._on_client(conn, mask))

    def _close(self, conn: Connection) -> None:
        self._reactor.unwatch(conn.sock.fileno())
        conn.sock.close()
        if conn.outgoing_fd >= 0:  # never sent: nobody else has it
            os.close(conn.outgoing_fd)
            conn.outgoing_fd = -1
        self._connections.discard(conn)

    # ---- verbs

    def _workload_or_unavailable(self) -> Workload:
        if self._workload is None:
            raise UnavailableError("the agent is waiting for a restore")
        return self._workload

    def _admitting(self) -> Workload:
        workload = self._workload_or_unavailable()
        if not self.admission_open:
            raise UnavailableError("admission is closed by a checkpoint; restore the checkpoint in a new agent")
        return workload

    def _shell(self, method: Method) -> ShellWorkload:
        workload = self._workload_or_unavailable()
        if not isinstance(workload, ShellWorkload):
            raise CommandError(f"{method.value} is only for the shell workload")
        return workload

    def _message(self, params: MessageParams, now: float) -> dict[str, Any]:
        workload = self._admitting()
        if params.more:
            draft_id, size = self.drafts.add(params.draft_id, params.text, now)
            return {"delivery": Delivery.DRAFTED.value, "draft": draft_id, "draft_bytes": size,
                    "queue_depth": workload.queue_depth}
        text = params.text if params.draft_id is None else self.drafts.take(params.draft_id, params.text)
        delivery = workload.message(text, now)
        return {"delivery": delivery.value, "queue_depth": workload.queue_depth}

    def _interrupt(self, params: NoParams, now: float) -> dict[str, Any]:
        return {"cancelled": self._workload_or_unavailable().interrupt(now)}

    def _relaunch(self, params: NoParams, now: float) -> dict[str, Any]:
        return {"pid": self._admitting().relaunch(now)}

    def _status(self, params: NoParams, now: float) -> dict[str, Any]:
        workload = self._workload
        busy = self._note_busy(now)
        fields = {
            "workload": self.config.workload.value,
            "turn_state": (workload.turn_state() if workload else TurnState.WAITING).value,
            "busy": busy,
            "quiet_ms": 0 if busy else int((now - self._busy_seen_at) * 1000),
            "pid": workload.pid() if workload else None,
            "queue_depth": workload.queue_depth if workload else 0,
            "queue_bytes": workload.queue_bytes if workload else 0,
            "log_bytes": self.log.length_bytes,
            "log_capped": self.log.capped,
            "admission_open": self.admission_open,
            "awaiting_restore": workload is None,
        }
        return {**fields, **(workload.status_fields() if workload else {})}

    def _read(self, params: ReadParams, now: float) -> dict[str, Any] | PendingRequest:
        if params.wait_ms and params.offset_bytes == self.log.length_bytes:
            return _LongPollRead(self, params, now, self.read_result)
        return self.read_result(params)

    def _read_fd(self, params: ReadParams, now: float) -> WithFd | PendingRequest:
        if params.wait_ms and params.offset_bytes == self.log.length_bytes:
            return _LongPollRead(self, params, now, self.read_fd_result)
        return self.read_fd_result(params)

    def read_fd_result(self, params: ReadParams) -> WithFd:
        """`read` without the bytes: the window the same rules give, and a read-only descriptor of the log to
        pread it from (OutputLog.reader)."""
        window = self.log.window(params.offset_bytes, params.max_bytes)
        fields = {"offset": window.offset_bytes, "next_offset": window.next_offset_bytes,
                  "length": window.length_bytes, "reset": window.reset, "kind": "text" if self.log.text else "bytes"}
        return WithFd(fields, self.log.reader())

    def read_result(self, params: ReadParams) -> dict[str, Any]:
        piece = self.log.read(params.offset_bytes, params.max_bytes)
        fields: dict[str, Any] = {"offset": piece.offset_bytes, "next_offset": piece.next_offset_bytes,
                                  "length": piece.length_bytes, "reset": piece.reset}
        if self.log.text:
            fields["text"] = piece.data.decode("utf-8")
        else:
            fields["data_b64"] = base64.b64encode(piece.data).decode("ascii")
        return fields

    def _write(self, params: WriteParams, now: float) -> dict[str, Any]:
        shell = self._shell(Method.WRITE)
        self._admitting()
        shell.write(params.data)
        return {"bytes": len(params.data)}

    def _resize(self, params: ResizeParams, now: float) -> dict[str, Any]:
        self._shell(Method.RESIZE).resize(params.columns, params.rows)
        return {"columns": params.columns, "rows": params.rows}

    def _checkpoint(self, params: CheckpointParams, now: float) -> PendingRequest:
        workload = self._admitting()
        if self.job is not None:
            raise UnavailableError("a checkpoint or restore is still in progress")
        return _Checkpoint(self, workload, params)

    def _suspend(self, params: SuspendParams, now: float) -> dict[str, Any]:
        """The supervisor is about to freeze this process (docker pause) with work in flight: the outbox says so.
        Nothing else changes; the work goes on when the process is thawed."""
        workload = self._workload
        seq = self.outbox.emit(EventKind.SUSPEND, reason=params.reason,
                               turn_state=(workload.turn_state() if workload else TurnState.WAITING).value,
                               queue_depth=workload.queue_depth if workload else 0)
        return {"seq": seq}

    def _egress_note(self, params: EgressNoteParams, now: float) -> dict[str, Any]:
        """serve's egress proxy closed one of the workload's connections (or counted several refused ones): the
        outbox records what it decided, outside the disk's reserve (`seq` null when there was no room)."""
        fields = {"decision": params.decision.value, "host": params.host, "port": params.port,
                  "reason": params.reason, "bytes_up": params.bytes_up, "bytes_down": params.bytes_down,
                  "count": params.count}
        return {"seq": self.outbox.emit_unreserved(EventKind.EGRESS,
                                                   **{k: v for k, v in fields.items() if v is not None})}

    def _restore(self, params: RestoreParams, now: float) -> PendingRequest:
        if self._workload is not None:
            raise CommandError("restore needs a fresh agent started with --await-restore")
        path = Path(params.path)
        return _Restore(self, path if path.is_absolute() else self.config.agent_dir / path)

    # ---- harness verbs: exec and files (work for either workload, beside it)

    def _exec(self, params: ExecParams, now: float) -> dict[str, Any]:
        self._admitting()
        process = self.execs.start(params, now)
        answer: dict[str, Any] = {"exec_id": process.exec_id, "pid": process.proc.pid if process.proc else None,
                                  "queued": process.queued}
        if params.detach:
            answer["stdout_path"], answer["stderr_path"] = map(str, self.execs.output_paths(process))
        return answer

    def _exec_wait(self, params: ExecWaitParams, now: float) -> dict[str, Any] | PendingRequest:
        pending = _ExecWait(self.execs, params, now)
        answer = pending.resolve(now)
        return pending if answer is None else answer

    def _exec_kill(self, params: HandleParams, now: float) -> dict[str, Any]:
        return {"exec_id": params.handle_id, "killed": self.execs.get(params.handle_id).kill(now)}

    def _stat(self, params: PathParams, now: float) -> PendingRequest:
        self._workload_or_unavailable()
        root, workers = self.transfers.root(params.root), self.workers
        job = self.start_file_job(lambda: workers.stat(root, params.path), lambda _: None)
        return _AwaitJob(job, lambda entry: {"root": params.root.value, "path": shown_path(params.path),
                                             "entry": entry}, "stat failed")

    def _list(self, params: ListParams, now: float) -> PendingRequest:
        self._workload_or_unavailable()
        root, workers = self.transfers.root(params.root), self.workers
        job = self.start_file_job(lambda: workers.list(root, params.path, params.offset, params.limit),
                                  lambda _: None)
        return _AwaitJob(job, lambda page: {"root": params.root.value, "path": shown_path(params.path), **page},
                         "list failed")

    def _upload(self, params: UploadParams, now: float) -> PendingRequest:
        self._admitting()
        return self.transfers.open_upload(params, now)

    def _upload_commit(self, params: UploadCommitParams, now: float) -> PendingRequest:
        self._admitting()
        return self.transfers.commit(params, now)

    def _download(self, params: PathParams, now: float) -> PendingRequest:
        self._workload_or_unavailable()
        return self.transfers.open_download(params, now)

    def _transfer_close(self, params: HandleParams, now: float) -> dict[str, Any] | PendingRequest:
        return self.transfers.close(params.handle_id)


class _SignalWakeup:
    """Routes signals into the loop: Python-level no-op handlers plus set_wakeup_fd, restored on exit."""

    def __init__(self, wakeup_fd: int, signals: tuple[int, ...]) -> None:
        self._wakeup_fd = wakeup_fd
        self._signals = signals
        self._previous: dict[int, Any] = {}
        self._previous_fd = -1

    def __enter__(self) -> "_SignalWakeup":
        self._previous_fd = signal.set_wakeup_fd(self._wakeup_fd, warn_on_full_buffer=False)
        for number in self._signals:
            self._previous[number] = signal.signal(number, _note_signal)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        signal.set_wakeup_fd(self._previous_fd)


def _note_signal(signum: int, frame: object) -> None:
    """Does nothing: the wakeup fd already carried the signal number to the loop, which acts on it."""


# ======================================================================================================================
# The `call` client: one request, one JSON document on stdout
# ======================================================================================================================


def call(session_dir: Path, method: str, params: dict[str, Any], timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
    """Sends one request to DIR/agent/control.sock and returns the response document (or a synthetic error one);
    a file descriptor the answer carried is closed."""
    document, fds = call_with_fds(session_dir, method, params, timeout_s)
    for fd in fds:
        os.close(fd)
    return document


def call_with_fds(session_dir: Path, method: str, params: dict[str, Any],
                  timeout_s: float = CALL_TIMEOUT_S) -> tuple[dict[str, Any], list[int]]:
    """call, and the file descriptors the answer carried (close-on-exec; the caller closes them).

    The socket is reached with connect_unix_at (never through a symlink): without a runtime user the workload is
    the agent's own uid and can write DIR/agent."""
    request_id = f"call-{os.getpid()}"
    line = _encode_line({"id": request_id, "method": method, "params": params})
    socket_path = session_dir / AGENT_DIR_NAME / SOCKET_NAME
    try:
        connection = connect_control_socket(socket_path.parent, timeout_s)
        response = bytearray()
        fds: list[int] = []
        with connection as sock:
            sock.sendall(line)
            while not response.endswith(b"\n"):
                chunk, ancillary, _, _ = sock.recvmsg(RECV_BYTES, socket.CMSG_SPACE(MAX_WORKER_FDS * 4),
                                                      socket.MSG_CMSG_CLOEXEC)
                fds += received_fds(ancillary)
                if not chunk:
                    break
                response += chunk
        try:
            return json.loads(response), fds
        except ValueError:
            for fd in fds:
                os.close(fd)
            raise
    except (OSError, ValueError) as e:
        return {"id": request_id, "error": {"code": UnavailableError.code,
                                            "message": f"no response from {socket_path}: {e}"}}, []


# ======================================================================================================================
# The model relay: 127.0.0.1:PORT in the session's own network namespace -> DIR/agent/model.sock -> serve's proxy
# ======================================================================================================================

MODEL_SOCKET_NAME = "model.sock"  #: DIR/agent/model.sock: serve's credential proxy listens on it, on the host
EGRESS_SOCKET_NAME = "egress.sock"  #: DIR/agent/egress.sock: serve's egress proxy (the session's allow-list)
MAX_RELAYED_CONNECTIONS = 16  #: one more is closed at once; serve bounds its own concurrency per session too
RELAY_CONNECT_TIMEOUT_S = 5.0
#: A relayed connection in which no byte moved either way for this long is closed: past the longest silence serve's
#: proxies keep a connection through (300 s, the egress pipe's and the model upstream's idle bounds; a test checks),
#: so the relay closes only what serve has given up on, a workload that stopped reading among them.
RELAY_IDLE_TIMEOUT_S = 330.0


@dataclasses.dataclass(frozen=True)
class Spliced:
    """What splice copied each way, and whether it stopped because no byte moved either way for its idle bound (the
    egress proxy records that in the connection's event)."""

    one_to_other: int
    other_to_one: int
    idle: bool = False


class _Flow:
    """One way of a splice: what was read from `source` and is not yet sent to `sink`, at most SPLICE_BYTES, so a
    sink that stops reading stops the reads from its source, never the splice."""

    def __init__(self, source: socket.socket, sink: socket.socket,
                 taken: Optional[Callable[[memoryview], int]] = None) -> None:
        self.source, self.sink, self._taken = source, sink, taken
        self.pending = bytearray()
        self.reading = True  # until the source's end, or the first bytes `taken` refused
        self.done = False  # nothing more to read or send; the source's end passed on
        self._passes_end = False  # the source ended (not cut short by `taken`): the sink is told so
        self.copied = 0

    def events(self, sock: socket.socket) -> int:
        """What this way waits for on sock."""
        wanted = 0
        if sock is self.source and self.reading and len(self.pending) < SPLICE_BYTES:
            wanted |= selectors.EVENT_READ
        if sock is self.sink and self.pending:
            wanted |= selectors.EVENT_WRITE
        return wanted

    def pump(self, scratch: memoryview, readable: bool) -> bool:
        """One read that fits (when the source was seen readable) and one send of what is pending, neither waiting;
        whether anything moved (a byte, an end)."""
        moved = False
        if readable and self.reading and len(self.pending) < SPLICE_BYTES:
            with contextlib.suppress(BlockingIOError):
                got = self.source.recv_into(scratch, SPLICE_BYTES - len(self.pending))
                moved = True
                kept = got if self._taken is None or not got else self._taken(scratch[:got])
                self.pending += scratch[:kept]
                if kept < got or not got:
                    self.reading = False
                    self._passes_end = not got
        if self.pending:
            with contextlib.suppress(BlockingIOError):
                sent = self.sink.send(self.pending)
                del self.pending[:sent]
                self.copied += sent
                moved = moved or sent > 0
        if not self.reading and not self.pending and not self.done:
            self.done = True
            if self._passes_end:
                with contextlib.suppress(OSError):
                    self.sink.shutdown(socket.SHUT_WR)
        return moved


def splice(one: socket.socket, other: socket.socket, idle_timeout_s: Optional[float] = None,
           taken_from_one: Optional[Callable[[memoryview], int]] = None) -> Spliced:
    """Copies bytes both ways until both sides have ended theirs, either fails (a reset: the caller closes both), or
    no byte moved either way for idle_timeout_s; a half-close is passed on. No call waits on one side: the sockets
    are made non-blocking and each way holds at most SPLICE_BYTES, so the idle bound holds whatever either peer does
    (one that stops reading included). `taken_from_one`: of each piece `one` sends, how many bytes go on (a
    request's framing); from the first piece it cuts short, the rest is dropped and `one` is read no more."""
    flows = (_Flow(one, other, taken_from_one), _Flow(other, one))
    scratch = memoryview(bytearray(SPLICE_BYTES))
    watched = {one: 0, other: 0}
    idle = False
    try:
        for sock in watched:
            sock.setblocking(False)
        with selectors.DefaultSelector() as selector:
            moved_at = time.monotonic()
            while not all(flow.done for flow in flows):
                for sock, was in watched.items():
                    wanted = flows[0].events(sock) | flows[1].events(sock)
                    if wanted != was:
                        if not was:
                            selector.register(sock, wanted)
                        elif wanted:
                            selector.modify(sock, wanted)
                        else:
                            selector.unregister(sock)
                        watched[sock] = wanted
                wait_s = None if idle_timeout_s is None else moved_at + idle_timeout_s - time.monotonic()
                ready = selector.select(wait_s) if wait_s is None or wait_s > 0 else []
                if not ready:
                    idle = True
                    break
                readable = {key.fileobj for key, events in ready if events & selectors.EVENT_READ}
                if any([flow.pump(scratch, flow.source in readable) for flow in flows]):
                    moved_at = time.monotonic()
    except OSError:
        pass  # what was copied stands; nothing more can be
    return Spliced(flows[0].copied, flows[1].copied, idle)


class ModelRelay:
    """A byte pipe from loopback TCP (all a network-none session has) to DIR/agent/model.sock, one connection each.

    The workload's CLI reaches the model only through here; the credential lives in serve, beyond the socket, and
    the socket lies in DIR/agent (0700, root's), which the workload cannot enter. The relay adds, reads and keeps
    nothing: the proxy sees each connection as this session's (the socket it came in on says whose). The egress
    relay is a second (port, socket name) pair of this class: EGRESS_SOCKET_NAME, serve's egress proxy beyond it.
    """

    def __init__(self, agent_dir: Path, port: int, socket_name: str = MODEL_SOCKET_NAME) -> None:
        self._agent_dir = agent_dir
        self._socket_name = socket_name
        self._slots = threading.BoundedSemaphore(MAX_RELAYED_CONNECTIONS)
        try:
            self.sock = socket.create_server(("127.0.0.1", port), backlog=LISTEN_BACKLOG)
        except OSError as e:
            raise StartupError(f"cannot listen on 127.0.0.1:{port} for the relay to {socket_name}: "
                               f"{e.strerror}") from e
        threading.Thread(target=self._accept_loop, name=f"relay-{socket_name}", daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                client.close()
                continue
            threading.Thread(target=self._relay, args=(client,), name=f"relay-{self._socket_name}-conn",
                             daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        try:
            with client:
                # Each write on at once: a small one (an answer's head, its first event) would
                # otherwise wait for the CLI's ACK of the one before (Nagle's algorithm).
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                dir_fd = os.open(self._agent_dir, DIR_OPEN_FLAGS)
                try:
                    upstream = connect_unix_at(dir_fd, self._socket_name, RELAY_CONNECT_TIMEOUT_S)
                finally:
                    os.close(dir_fd)
                with upstream:
                    upstream.settimeout(None)
                    splice(client, upstream, RELAY_IDLE_TIMEOUT_S)
        except OSError:
            pass  # the CLI sees its connection end and reports it; the proxy logs its own side
        finally:
            self._slots.release()

    def close(self) -> None:
        """Stops accepting (shutdown wakes the blocked accept); relayed connections end with their peers."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


# ======================================================================================================================
# Command line
# ======================================================================================================================


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be a positive integer")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be a positive number")
    return value


def _identity(text: str) -> Identity:
    uid, sep, gid = text.partition(":")
    if not (sep and uid.isdigit() and gid.isdigit() and int(uid) < 2**32 - 1 and int(gid) < 2**32 - 1):
        raise argparse.ArgumentTypeError(f"{text!r} is not UID:GID (two numbers)")
    return Identity(int(uid), int(gid))


def _json_argv(text: str) -> tuple[str, ...]:
    try:
        return validate_command_template(json.loads(text))
    except (ValueError, TypeError, UsageError) as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agent.py", description="Reploy's data-plane agent (stdlib only).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run a session's workload and serve DIR/agent/control.sock")
    serve.add_argument("--session-dir", required=True, type=Path)
    serve.add_argument("--workload", required=True, choices=[kind.value for kind in WorkloadKind])
    serve.add_argument("--runtime-user", type=_identity, metavar="UID:GID",
                       help="run the workload and all its file work as this user (required when run as root)")
    serve.add_argument("--shell", default="/bin/sh", help="shell workload: the program on the PTY")
    serve.add_argument("--agent-command", type=_json_argv, default=DEFAULT_AGENT_ARGV,
                       help='agent workload: JSON argv template with "{prompt}", optional "{continue}", "{model}"')
    serve.add_argument("--model", help="agent workload: fills {model} as --model M")
    serve.add_argument("--workspace", type=Path, help="the workload's working directory (default DIR/workspace)")
    serve.add_argument("--home", type=Path, help="the workload's HOME (default DIR/home)")
    serve.add_argument("--redact-env", action="append", default=[], metavar="NAME",
                       help="agent workload: redact this environment variable's value from the output (repeatable)")
    serve.add_argument("--run-timeout", type=_positive_float, default=DEFAULT_RUN_TIMEOUT_S, metavar="SECONDS")
    serve.add_argument("--per-run-cap-bytes", type=_positive_int, default=DEFAULT_PER_RUN_CAP_BYTES)
    serve.add_argument("--cumulative-cap-bytes", type=_positive_int, default=DEFAULT_CUMULATIVE_CAP_BYTES)
    serve.add_argument("--shell-log-cap-bytes", type=_positive_int, default=DEFAULT_SHELL_LOG_CAP_BYTES)
    restore = serve.add_mutually_exclusive_group()
    restore.add_argument("--restore", type=Path, metavar="ARCHIVE", help="restore this checkpoint, then serve")
    restore.add_argument("--await-restore", action="store_true",
                         help="serve without a workload until a `restore` request installs a checkpoint")
    serve.add_argument("--listen", metavar="HOST:PORT",
                       help="also serve the protocol over TCP (no authentication: only behind a private endpoint "
                            "grant); port 0 picks a free one")
    serve.add_argument("--model-relay", type=_positive_int, metavar="PORT",
                       help="relay 127.0.0.1:PORT to DIR/agent/model.sock (serve's credential proxy)")
    serve.add_argument("--egress-relay", type=_positive_int, metavar="PORT",
                       help="relay 127.0.0.1:PORT to DIR/agent/egress.sock (serve's egress proxy)")
    serve.add_argument("--file-worker-linger", type=_positive_float, default=DEFAULT_FILE_WORKER_LINGER_S,
                       metavar="SECONDS", help="stop the file workers' zygote once no file operation has been open "
                                               "this long (default %(default)g)")
    client = commands.add_parser("call", help="send one request to DIR/agent/control.sock; print the JSON response")
    client.add_argument("session_dir", type=Path, metavar="DIR")
    client.add_argument("verb", choices=[method.value for method in Method])
    client.add_argument("params", nargs="?", default="{}", help="JSON object of params (default {})")
    relayed = commands.add_parser("relay", help="carry request lines from stdin to DIR/agent/control.sock, many at "
                                                "once, and their answer lines to stdout (an exec stream's agent channel)")
    relayed.add_argument("--session-dir", required=True, type=Path)
    return parser


def _config_from(args: argparse.Namespace) -> AgentConfig:
    session_dir = args.session_dir.absolute()
    config = AgentConfig(
        session_dir=session_dir, workload=WorkloadKind(args.workload), shell=args.shell,
        agent_argv=args.agent_command, model=args.model,
        workspace=args.workspace.absolute() if args.workspace else None,
        home=args.home.absolute() if args.home else None, redact_env=tuple(args.redact_env),
        run_timeout_s=args.run_timeout, per_run_cap_bytes=args.per_run_cap_bytes,
        cumulative_cap_bytes=args.cumulative_cap_bytes, shell_log_cap_bytes=args.shell_log_cap_bytes,
        restore_path=args.restore.absolute() if args.restore else None, await_restore=args.await_restore,
        listen=parse_listen_address(args.listen) if args.listen is not None else None,
        runtime_user=runtime_user_for(args.runtime_user, Identity(os.geteuid(), os.getegid())),
        model_relay_port=args.model_relay, egress_relay_port=args.egress_relay,
        file_worker_linger_s=args.file_worker_linger,
    )
    if config.log_cap_bytes < MIN_LOG_CAP_BYTES:
        raise UsageError(f"the output log cap must be at least {MIN_LOG_CAP_BYTES} bytes")
    for name, tree in config.trees.items():
        if session_dir.resolve().is_relative_to(tree.resolve()):
            raise UsageError(f"the {name} directory {tree} must not contain the session directory")
        if tree.resolve().is_relative_to(config.agent_dir.resolve()):
            raise UsageError(f"the {name} directory {tree} must not lie in the agent's own {config.agent_dir}")
    if len(str(config.agent_dir / SOCKET_NAME).encode()) > 107:
        raise UsageError(f"{config.agent_dir / SOCKET_NAME} is longer than a unix socket path may be (107 bytes)")
    return config


def runtime_user_for(requested: Optional[Identity], agent: Identity) -> Optional[Identity]:
    """Who the workload runs as: --runtime-user, which needs root and may not be root; required as root (a hostile
    workload must never run as root by accident); without it, not root, the agent's own identity (None)."""
    if requested is not None and requested.uid == 0:
        raise UsageError("--runtime-user: the workload may not run as root (uid 0)")
    if agent.uid == 0:
        if requested is None:
            raise UsageError("run as root, agent.py needs --runtime-user UID:GID: the workload never runs as root")
        return requested
    if requested is not None and requested != agent:
        raise UsageError(f"--runtime-user {requested}: only root can run the workload as another user "
                         f"(this is {agent})")
    return None


def require_private_dir(path: Path, mode_mask: int) -> None:
    """A directory the agent writes by name must be its own and open to no one else as mode_mask says (0o022: no
    one else may write it; 0o077: no one else may enter it). A directory another user could write would let them
    plant a symlink at one of those names and aim our writes at any file."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & mode_mask:
        others = "open to no one else" if mode_mask & 0o055 else "writable by no one else"
        raise StartupError(f"{path} must be a directory owned by uid {os.geteuid()} and {others} (it is uid "
                           f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})")


def require_out_of_reach(path: Path, identity: Identity) -> None:
    """Neither the session dir nor any directory above it may be the runtime user's, or writable by others without
    the sticky bit: else the workload could move the session dir away and put one of its own in its place."""
    for directory in (path, *path.parents):
        st = os.stat(directory)
        if st.st_uid == identity.uid or (st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX):
            raise StartupError(f"{directory} is within the runtime user {identity}'s reach (owner uid {st.st_uid}, "
                               f"mode {stat.S_IMODE(st.st_mode):04o}); the session dir must not be")


def prepare_session_dir(config: AgentConfig) -> None:
    """DIR (0755, ours, writable by no one else), DIR/agent (0700, ours), and the workspace and home, made if
    missing and handed to the runtime user; one that exists must already be the runtime user's."""
    config.session_dir.mkdir(mode=SESSION_DIR_MODE, parents=True, exist_ok=True)
    require_private_dir(config.session_dir, 0o022)
    config.agent_dir.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
    require_private_dir(config.agent_dir, 0o077)
    identity = config.runtime_user
    if identity is not None:
        require_out_of_reach(config.session_dir, identity)
    for name, directory in config.trees.items():
        try:
            directory.mkdir(mode=PRIVATE_DIR_MODE, parents=True)
            if identity is not None:
                os.chown(directory, identity.uid, identity.gid)
        except FileExistsError:
            pass
        except OSError as e:
            raise StartupError(f"cannot make the {name} directory {directory} for {identity}: {e.strerror}; make it, "
                               "owned by the runtime user") from e
        owner = directory.stat().st_uid
        if identity is not None and owner != identity.uid:
            raise StartupError(f"the {name} directory {directory} belongs to uid {owner}, not to the runtime user "
                               f"{identity}")


def serve(config: AgentConfig) -> int:
    """`agent.py serve`: prepare the session dir, serve until a signal, shut down cleanly."""
    prepare_session_dir(config)
    require_bounding_set_drop(config)
    relays = [ModelRelay(config.agent_dir, port, name) for port, name in (
        (config.model_relay_port, MODEL_SOCKET_NAME), (config.egress_relay_port, EGRESS_SOCKET_NAME)) if port]
    server = AgentServer(config)
    try:
        tcp = f" and tcp {server.tcp_listener.address}" if server.tcp_listener is not None else ""
        identity = f", runtime user {config.runtime_user}" if config.runtime_user is not None else ""
        print(f"agent.py: serving {config.agent_dir / SOCKET_NAME}{tcp} ({config.workload.value} workload{identity}, "
              f"pid {os.getpid()})", file=sys.stderr)
        return server.run()
    finally:
        server.close()
        for relay in relays:
            relay.close()


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["zygote"]:  # internal: FileWorkers starts it; not a user's command
        if not stat.S_ISSOCK(os.fstat(0).st_mode):
            print("agent.py zygote: started only by agent.py serve, with its channel as stdin", file=sys.stderr)
            return 2
        return zygote_main()
    args = _parser().parse_args(argv)
    if args.command == "call":
        try:
            params = json.loads(args.params)
        except ValueError as e:
            print(f"agent.py call: params are not JSON: {e}", file=sys.stderr)
            return 2
        if not isinstance(params, dict):
            print("agent.py call: params must be a JSON object", file=sys.stderr)
            return 2
        response = call(args.session_dir, args.verb, params)
        print(json.dumps(response))
        return 0 if "result" in response else 1
    if args.command == "relay":
        return StdioRelay(args.session_dir.absolute(), sys.stdin.buffer, sys.stdout.buffer).run()
    try:
        return serve(_config_from(args))
    except UsageError as e:
        print(f"agent.py serve: {e}", file=sys.stderr)
        return 2
    except AgentError as e:
        print(f"agent.py serve: {e}", file=sys.stderr)
        return 1


# ======================================================================================================================
# The stdio relay: `agent.py relay --session-dir DIR`, the control socket's protocol over stdin and stdout, for a
# control plane that reaches the session only through an exec stream (Kubernetes' pods/exec). Run as the agent's own
# user (root in a session Pod), beside `serve`; it holds no state of the session and is restarted by opening a new
# stream. It must never answer one request's line with another's bytes, nor let one slow request hold the others.
# ======================================================================================================================

#: Requests forwarded at once; the next line is read only when one of them is answered (stdin's flow control
#: then holds the sender back). Above the agent's own read long-polls of one session and its exec waits.
RELAY_MAX_IN_FLIGHT = 32


class StdioRelay:
    """Each request line read from stdin (its own "id" in it) goes to DIR/agent/control.sock on a connection of
    its own, in a thread of its own, so a long-poll `read` never holds a `status`; each answer line goes to stdout
    whole, as it completes, under one lock (lines never interleave; their order is the agent's). Verbs whose answer
    carries a descriptor (DESCRIPTOR_METHODS) cannot cross a stream and are refused here, as over TCP. A request
    that is not one is answered `invalid_request` with its id when one could be read; an agent that does not
    answer, `server_unavailable`. Ends at stdin's end, once the answers in flight are out."""

    def __init__(self, session_dir: Path, stdin: BinaryIO, stdout: BinaryIO,
                 max_in_flight: int = RELAY_MAX_IN_FLIGHT) -> None:
        self._agent_dir = session_dir / AGENT_DIR_NAME
        self._stdin = stdin
        self._stdout = stdout
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._write_lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._threads_lock = threading.Lock()

    def run(self) -> int:
        while True:
            line = self._stdin.readline(MAX_REQUEST_BYTES + 1)
            if not line:
                break
            if not line.endswith(b"\n"):
                self._answer(encode_error("", RequestError.code, f"request line exceeds {MAX_REQUEST_BYTES} bytes"
                                          if len(line) > MAX_REQUEST_BYTES else "request line must end with a newline"))
                while line and not line.endswith(b"\n"):  # the rest of that line is not a request of its own
                    line = self._stdin.readline(MAX_REQUEST_BYTES + 1)
                continue
            try:
                request = parse_request(line[:-1])
            except RequestError as e:
                self._answer(encode_error(e.request_id, e.code, str(e)))
                continue
            if request.method in DESCRIPTOR_METHODS:
                self._answer(encode_error(request.request_id, RequestError.code, f"{request.method.value} answers "
                                          "with a file descriptor, which cannot cross the relay's stream"))
                continue
            if request.keep:
                self._answer(encode_error(request.request_id, RequestError.code,
                                          "keep: the relay opens a connection of its own for each request"))
                continue
            self._slots.acquire()
            thread = threading.Thread(target=self._forward, args=(request.request_id, line), daemon=True)
            with self._threads_lock:
                self._threads.add(thread)
            thread.start()
        with self._threads_lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join()
        return 0

    def _forward(self, request_id: str, line: bytes) -> None:
        try:
            self._answer(self._exchange(request_id, line))
        finally:
            with self._threads_lock:
                self._threads.discard(threading.current_thread())
            self._slots.release()

    def _exchange(self, request_id: str, line: bytes) -> bytes:
        """The agent's answer line to one request, or a line that says why there is none."""
        try:
            sock = connect_control_socket(self._agent_dir, CALL_TIMEOUT_S)
            deadline = time.monotonic() + CALL_TIMEOUT_S
            answer = bytearray()
            with sock:
                sock.sendall(line)
                while not answer.endswith(b"\n") and len(answer) <= MAX_REQUEST_BYTES:
                    sock.settimeout(max(deadline - time.monotonic(), 0.001))
                    chunk = sock.recv(RECV_BYTES)
                    if not chunk:
                        break
                    answer += chunk
            newline = answer.find(b"\n")
            if newline < 0:
                raise OSError(errno.EPIPE, "the agent closed the connection without a whole answer, or sent one "
                                           f"longer than {MAX_REQUEST_BYTES} bytes")
            return bytes(answer[:newline + 1])
        except OSError as e:
            return encode_error(request_id, UnavailableError.code, f"no response from {self._agent_dir / SOCKET_NAME}: "
                                                                   f"{e.strerror or e}")

    def _answer(self, line: bytes) -> None:
        with self._write_lock:
            try:
                self._stdout.write(line)
                self._stdout.flush()
            except (BrokenPipeError, ValueError):
                pass  # the stream is gone: stdin ends next, and run() returns


if __name__ == "__main__":
    sys.exit(main())
