#!/usr/bin/env python3
"""reploy: the host role of Reploy, and its command line.

  reploy stage BLUEPRINT --dir DIR           validate a blueprint, make DIR a staging deployment
  reploy build --dir DIR                     build its image, record the new current generation
  reploy controlled-session run ... -- CMD   run one controlled session, print one JSON result
  reploy controlled-session cleanup          remove what crashed sessions left behind
  reploy serve ... | reploy session ...      managed sessions: handed to reploy_serve.py

Peers:
  * the Docker Engine, through the Docker SDK (never the docker CLI);
  * reploy_session_client.py, which runs inside the controller container as the broker. It also
    holds the public stream codec and the private channel framing, which this file imports so
    both ends speak from one definition;
  * reploy_watchdog.py, the machine's one watchdog, which this file arms before a session's
    first container exists and whose reconciliation it reuses;
  * agent.py, for its rules on directories a container can write (used on the output staging
    directory);
  * reploy_serve.py, the managed-session control plane. It imports this file (the Docker
    adapter, deployments, durations); this file never imports it, and hands `serve` and
    `session` over to it by executing it.
All of them must sit beside this file.

Theory of operation. A controlled session is two containers made from two built deployments:
a trusted controller and a hostile workload, both created inert and sandboxed, the workload's
/bin/sh on a PTY the host attaches to through the Engine API. The host gives the controller a
private unix-socket channel, over which the broker (reploy-session-client) receives lifecycle
events and terminal bytes in separate frames; one lifecycle machine (preparing -> active ->
terminating -> terminated, first cause latched) decides every step, one selector loop moves
the bytes, and every phase becomes one fact of the single JSON result printed at the end.

Machine output is one JSON document on stdout; human text goes to stderr.

Reading order: the signal hold and the launch (which come before the imports: see there),
constants, exceptions, value types, pure cores (durations, blueprints, the lifecycle machine,
the run result), Docker adapters, deployments, directories a container can write, the
controlled session, CLI.
"""

from __future__ import annotations

import signal

#: SIGINT and SIGTERM are held (blocked) from this file's first statement when it runs as a
#: program (the installed command, which imports it, from run_command on), across the
#: re-execution below (exec keeps the mask and what is pending), until the run can answer them:
#: a controlled session's host releases them once its handlers are in place (HostSignals), so a
#: signal at any instant after valid parsing gets its one JSON result and 130/143; every other
#: command releases them once its command line is parsed.
HELD_SIGNALS = frozenset((signal.SIGINT, signal.SIGTERM))
#: The mask the process came with while they are held (the re-executed host is handed its
#: first process's one); None when nothing is held (this file imported as a module, until
#: run_command).
SIGNAL_MASK_BEFORE_HOLD = (signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
                           if __name__ == "__main__" else None)

import marshal  # noqa: E402  (after the hold: see there)
import os
import sys
from importlib.machinery import SourceFileLoader

# ============================================================================================
# Launch: before the imports, because it may replace this process
# ============================================================================================
#
# `serve` and `session` belong to the control plane's role file, which this one executes (same
# pid, same interpreter options) without importing it. A controlled session's host re-executes
# itself once to run as a module: CPython keeps a directly-run script's whole syntax tree until
# the script returns, and a session's host lives as long as its session.

#: The commands reploy_serve.py runs, and that file (beside this one).
CONTROL_PLANE_COMMANDS = ("serve", "session")
CONTROL_PLANE_FILE = "reploy_serve.py"
#: The command that lives as long as a session.
LONG_LIVED_COMMAND = ("controlled-session", "run")
#: The role files this one imports as it starts (they sit beside it). agent.py is not one:
#: only a session with --output-file needs it, at its end (container_path_rules).
SIBLING_MODULES = ("reploy_session_client", "reploy_watchdog")
#: What the re-executed interpreter runs, given this file's path, then a descriptor holding
#: the signal mask the first process came with and (module name, file, code) of each sibling
#: and of this file (marshal), then the command: the modules run in that order, this file's
#: last, as if imported, and this file's module is handed that mask.
MODULE_LAUNCHER = "\n".join((
    "import marshal, os, sys, types",
    "sys.argv[0] = sys.argv.pop(1)",  # this file, as when the script runs
    "sys.path[0] = os.path.dirname(sys.argv[0])",  # in place of -c's working directory
    "mask, modules = marshal.loads(open(int(sys.argv.pop(1)), 'rb').read())",
    "for name, path, code in modules:",
    "    module = sys.modules[name] = types.ModuleType(name)",
    "    module.__file__ = path",
    "    exec(code, module.__dict__)",
    "module.SIGNAL_MASK_BEFORE_HOLD = set(mask)",
    "module.run_command()",
))


def interpreter_options() -> Optional[list[str]]:
    """The options this interpreter was started with before the script's path (`-X dev`...),
    or None when it was not started on a script's path (-m, -c, runpy)."""
    original = getattr(sys, "orig_argv", [])
    options_end = len(original) - len(sys.argv)
    if options_end < 1 or original[options_end] != sys.argv[0]:
        return None
    return original[1:options_end]


def release_held_signals() -> None:
    """Give SIGINT and SIGTERM back the mask the process came with: what is pending arrives
    now (at the handlers in place by then). Nothing to do when nothing is held."""
    if SIGNAL_MASK_BEFORE_HOLD is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, SIGNAL_MASK_BEFORE_HOLD)


def hand_over_to_control_plane(arguments: list[str]) -> None:
    """`reploy serve|session ...` (the command line's `arguments`) becomes `reploy_serve.py
    serve|session ...` in this process."""
    if arguments[:1] and arguments[0] in CONTROL_PLANE_COMMANDS:
        control_plane = os.path.join(os.path.dirname(os.path.abspath(__file__)), CONTROL_PLANE_FILE)
        if not os.path.isfile(control_plane):
            print(f"reploy: {arguments[0]}: {control_plane} is missing; it must sit beside "
                  "reploy.py", file=sys.stderr)
            sys.exit(1)
        release_held_signals()  # the control plane keeps its own signals
        os.execv(sys.executable, [sys.executable, *(interpreter_options() or []), control_plane,
                                  *arguments])


def relaunch_as_module() -> None:
    """Re-execute `controlled-session run` (same pid, interpreter and options) with this file and
    its siblings run as modules from code compiled here, before anything heavy is imported.

    A module keeps no syntax tree. The compiling (or reading of cached bytecode) is done by
    this process, which exec replaces, so the process that lives on holds none of the
    compiler's leftovers either, even when nothing can be cached (PYTHONDONTWRITEBYTECODE).
    Costs one interpreter start. Run with -I, -P or PYTHONSAFEPATH (no working directory to
    replace on the module path), through -m or runpy, or without memfd_create, it runs as it is."""
    options = interpreter_options()
    if tuple(sys.argv[1:3]) != LONG_LIVED_COMMAND or options is None or getattr(
            sys.flags, "safe_path", False) or not hasattr(os, "memfd_create"):
        return
    script = os.path.abspath(sys.argv[0])
    try:
        modules = [(name, path, SourceFileLoader(name, path).get_code(name))
                   for name in SIBLING_MODULES
                   for path in [os.path.join(os.path.dirname(script), f"{name}.py")]]
    except (OSError, ImportError):
        return  # a sibling is missing or unreadable: the imports below say so as usual
    modules.append(("reploy", script, sys._getframe(1).f_code))  # the calling module's code
    compiled = os.memfd_create("reploy-code", 0)  # no close-on-exec: the launcher reads it
    with open(compiled, "wb", closefd=False) as code_file:
        code_file.write(marshal.dumps(([int(signum) for signum in SIGNAL_MASK_BEFORE_HOLD or ()],
                                       modules)))
    os.lseek(compiled, 0, os.SEEK_SET)
    os.set_inheritable(compiled, True)
    os.execv(sys.executable, [sys.executable, *options, "-c", MODULE_LAUNCHER, script,
                              str(compiled), *sys.argv[1:]])


if __name__ == "__main__" and sys.executable:
    hand_over_to_control_plane(sys.argv[1:])
    if __spec__ is None:
        relaunch_as_module()

import argparse
import base64
import collections
import contextlib
import enum
import errno
import functools
import hashlib
import importlib.util
import io
import json
import queue
import re
import secrets
import selectors
import shutil
import socket
import stat
import struct
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Optional, Union

import docker
import docker.errors
import docker.transport
import docker.types
import docker.utils
import requests.exceptions
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reploy_session_client as wire  # noqa: E402  (the shared codec; see the docstring)
import reploy_watchdog  # noqa: E402  (the cleanup role; the host reuses its reconciliation)
from reploy_session_client import (  # noqa: E402
    Cause, FrameKind, RecoveryAction, SessionResult, Status,
)

# ============================================================================================
# Constants
# ============================================================================================

#: Reploy's release: one value in all four role files (a test checks), named by the offline bundle.
__version__ = "0.1.0"

CLIENT_SOURCE = Path(wire.__file__).resolve()
#: The derived controller image installs under this prefix: the command, in a directory the
#: derived image puts first on PATH, ahead of the image's own PATH (or the Engine's default,
#: when it sets none), and the client module beside its bytecode.
CLIENT_PREFIX = "/usr/local"
CLIENT_DIR = f"{CLIENT_PREFIX}/bin"
CLIENT_INSTALL_PATH = f"{CLIENT_DIR}/reploy-session-client"
CLIENT_MODULE_DIR = f"{CLIENT_PREFIX}/lib/reploy"
CLIENT_MODULE_PATH = f"{CLIENT_MODULE_DIR}/{CLIENT_SOURCE.name}"
#: The installed command imports the client rather than running it as a script, because only
#: an import takes bytecode: the broker and `attach` both start before the workload may, and
#: compiling the client's source took each of them 8 ms on a quiet machine, about 60 under
#: load (the root is read-only, so nothing compiled in a session is ever kept).
CLIENT_LAUNCHER = (
    "#!/usr/bin/env python3\n"
    f'"""reploy-session-client: runs {CLIENT_MODULE_PATH} from its bytecode."""\n'
    "import sys\n"
    f"sys.path[0] = {CLIENT_MODULE_DIR!r}\n"
    f"import {CLIENT_SOURCE.stem}\n"
    f"{CLIENT_SOURCE.stem}.run_as_program()\n")
#: PEP 552's flags of bytecode an interpreter takes only for the very source beside it.
CHECKED_HASH_FLAGS = (0b11).to_bytes(4, "little")
ENGINE_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The derived controller image is the controller generation (FROM) plus these instructions:
#: one layer, the client (derived_layer_files), then its command first on PATH.
DERIVED_LAYER = (f"COPY install/ {CLIENT_PREFIX}/\n"
                 f'ENV PATH="{CLIENT_DIR}:${{PATH:-{ENGINE_DEFAULT_PATH}}}"\n')
#: The container-side HOME of both roles: a private tmpfs owned by the runtime uid:gid.
CONTAINER_HOME = "/mnt/reploy-home"
HOME_TMPFS_SIZE = "64m"
#: What a root supervisor (ContainerSpec.root_supervisor) keeps: to start the workload as the
#: runtime uid:gid (SETUID, SETGID), to empty the bounding set of what it starts so (SETPCAP),
#: and to signal it (KILL).
SUPERVISOR_CAPABILITIES = ("SETUID", "SETGID", "SETPCAP", "KILL")
#: Where the channel directory is bind-mounted (read-only) in the controller.
CHANNEL_MOUNT = "/run/reploy/session"
CHANNEL_SOCKET_NAME = "channel.sock"
#: Where controller outputs are mounted in the controller.
OUTPUT_DIR_MOUNT = "/mnt/reploy-output"
OUTPUT_FILE_MOUNT = "/mnt/reploy-output-file"
#: The workload's shell; always /bin/sh in the exact workload image.
WORKLOAD_SHELL = "/bin/sh"
WORKLOAD_TERM = "xterm-256color"
DEFAULT_COLUMNS, DEFAULT_ROWS = 80, 24
#: Host-owned, not a CLI option: output drain deadline from the start of termination.
OUTPUT_FINALIZATION_TIMEOUT_MS = 30_000
#: Default resource limits when a blueprint does not declare them.
DEFAULT_MEMORY_MIB = 512
DEFAULT_PIDS = 256
#: The least pids limit any container gets. The engine's `runc init` runs inside the
#: container's cgroup before the exec, and its Go threads count as pids: with a limit of 4, one
#: start in about a hundred under CPU load failed with "cannot start a stopped process".
MIN_PIDS = 16
#: Bytes of a controller container's log copied to the host's stderr at teardown.
CONTROLLER_LOG_TAIL_BYTES = 64 * 1024
#: What a failed build's error keeps of the failing step's own output: its last lines, at most
#: this many of them and this many bytes.
BUILD_TAIL_LINES = 20
BUILD_TAIL_BYTES = 4096
#: The python probe: a short-lived session container, made like the controller's, that runs the
#: installed client by name (`reploy-session-client probe`, its shebang and python3 found on the
#: image's PATH as the controller's would be) before a session is planned to use the image. It
#: proves the client runs there and that the engine gave it the sandbox asked for.
PROBE_ROLE = "python-probe"
PROBE_COMMAND = ("reploy-session-client", "probe")
PROBE_TIMEOUT_S = 60
#: The most of the probe's output read back (its report is one short line).
PROBE_OUTPUT_BYTES = 4096
#: What /proc/self/status must say in a session container: a seccomp filter (mode 2),
#: no-new-privileges, and no capability in any set (all are dropped).
PROBE_EXPECTED_STATUS = {"Seccomp": "2", "NoNewPrivs": "1",
                         **{name: "0" * 16 for name in ("CapInh", "CapPrm", "CapEff", "CapBnd",
                                                        "CapAmb")}}
#: What the controller image must provide for the client to run, in the words of a refusal.
CLIENT_NEEDS = ("the controller image must provide python3 (3.7 or later, with its standard "
                "library) on its PATH and /usr/bin/env, which reploy-session-client runs with")
#: Appended to the derived image's tag once its probe passed on an engine configured as this
#: one is (the tag names a digest of that configuration): only that tag is reused.
PROBED_TAG_SUFFIX = "-probed-"
#: How long the delivery tail waits for the broker to close its end of a channel we closed.
CHANNEL_CLOSE_S = 2.0
#: The notice tag prefix of ControlledSession.call_off_loop's calls.
CALL_TAG = "call:"
#: A read from the workload's PTY this large means it is writing in bulk (the Engine hands
#: output over in chunks of about 4 KiB): the PTY is then read again only after
#: OUTPUT_COALESCE_S, so a flood crosses to the attachment in frames of tens of KiB instead of
#: thousands of 4 KiB ones. Small output (an echo, a prompt) still goes at once, and so does
#: the next read after a full one (TERMINAL_CHUNK_BYTES): more is waiting already, and pausing
#: then capped a flood at one chunk per pause (64 MiB/s).
OUTPUT_BULK_READ_BYTES = 1024
OUTPUT_COALESCE_S = 0.001
#: A session without endpoint grants: each container has a network namespace of its own
#: holding nothing but `lo`.
NETWORK_NONE = "none"
#: A granted session's network namespace (only `lo`) is owned by a holder container that runs
#: nothing but a pause, as nobody, in the derived controller image (which has python3); the
#: workload and the controller join it, and the controller reaches the workload's ports at host
#: `workload` (127.0.0.1) over the shared loopback.
HOLDER_COMMAND = ("python3", "-S", "-c", "import signal; signal.pause()")
HOLDER_UID_GID = 65534
HOLDER_MEMORY_MIB = 32
HOLDER_PIDS = MIN_PIDS
HOLDER_HOSTNAME = "session"
WORKLOAD_HOST = "workload"

LABEL_RUN = reploy_watchdog.LABEL_RUN
LABEL_ROLE = "io.reploy.session.role"
LABEL_DEPLOYMENT = "io.reploy.deployment"
LABEL_GENERATION = "io.reploy.generation"
LABEL_DERIVED_BASE = "io.reploy.derived.base-image"
LABEL_CLIENT_DIGEST = "io.reploy.derived.client-digest"

#: Blueprints are read with PyYAML's safe loader, through libyaml when PyYAML was built with
#: it: the same documents, parsed some 20 times faster (a session reads four as it starts,
#: each deployment's staged and built blueprint: 15 ms in Python on this machine).
BLUEPRINT_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

STATE_SCHEMA = "reploy-deployment-state-v1"
STAGE_SCHEMA = "reploy-stage-result-v1"
CLEANUP_SCHEMA = "reploy-cleanup-result-v1"
BUILD_SCHEMA = "reploy-build-result-v1"
STATE_DIRNAME = ".reploy"
BLUEPRINT_NAME = "blueprint.yaml"
CONTEXT_DIRNAME = "context"
PRIVATE_ENV_NAME = ".env"

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_FOR_SIGNAL: dict[int, int] = {signal.SIGINT: 130, signal.SIGTERM: 143}


@dataclass(frozen=True)
class DurationOption:
    """One timeout option: its flag, default and accepted range, all in milliseconds."""

    flag: str
    default_ms: int
    min_ms: int
    max_ms: int


TIMEOUT_OPTIONS = (
    DurationOption("--startup-timeout", 30_000, 15_000, 300_000),
    DurationOption("--termination-grace", 5_000, 100, 60_000),
    DurationOption("--controller-finalization-timeout", 300_000, 1_000, 3_600_000),
    DurationOption("--result-acknowledgement-timeout", 10_000, 1_000, 60_000),
    DurationOption("--cleanup-timeout", 30_000, 1_000, 300_000),
)

# ============================================================================================
# Exceptions
# ============================================================================================


class ReployError(Exception):
    """Root of the host's errors."""


class UsageError(ReployError):
    """Bad command line: exit 2, message on stderr, nothing on stdout."""


class BlueprintError(ReployError):
    """A blueprint that does not validate; the message names the field."""


class DeploymentError(ReployError):
    """A staging directory that is missing, unbuilt or inconsistent."""


class AdmissionError(ReployError):
    """A controlled session that may not start as requested."""


class BackendError(ReployError):
    """The Docker Engine refused or failed; wraps the SDK's exception."""


class ImageGone(BackendError):
    """A container was asked of an image the Engine no longer has (removed since it was built)."""


class PlanRejected(ReployError):
    """The session cannot be planned from the built generations (an undeclared command or
    endpoint, a missing image, a controller image without python3): nothing of it ran."""


class StartupFailure(ReployError):
    """The session could not reach ready."""


class AttachmentRefused(ReployError):
    """What the broker handed over is not an attachment's connection."""


# ============================================================================================
# Pure core: durations
# ============================================================================================

_DURATION = re.compile(r"([0-9]{1,12})(?:\.([0-9]{1,9}))?(ms|s|m|h)", re.ASCII)
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}


def parse_duration_ms(text: str) -> int:
    """'30s', '100ms', '5m', '1h', '1.5s' -> milliseconds, computed exactly (no float
    rounding: '1.001s' is 1001 ms, '1.0001s' is refused). ASCII digits only, nothing around
    the duration, not even a newline. Raises ValueError."""
    match = _DURATION.fullmatch(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration like 100ms, 30s, 5m or 1h")
    whole, fraction, unit = match.groups()
    fraction = fraction or ""
    scaled = (int(whole) * 10 ** len(fraction) + int(fraction or "0")) * _UNIT_MS[unit]
    ms, remainder = divmod(scaled, 10 ** len(fraction))
    if remainder:
        raise ValueError(f"{text!r} is finer than a millisecond")
    return ms


def format_duration(ms: int) -> str:
    for unit in ("h", "m", "s"):
        if ms % _UNIT_MS[unit] == 0:
            return f"{ms // _UNIT_MS[unit]}{unit}"
    return f"{ms}ms"


def printable(text: str) -> str:
    """Text that may hold undecodable bytes of a path (surrogate escapes) as text JSON can
    carry: those bytes are shown as \\xNN."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def error_text(error: BaseException) -> str:
    """An error in words for a person: an OS error as its message and the path it concerns
    (`Permission denied: /x`), never Python's `[Errno 13] ...` rendering."""
    if isinstance(error, OSError) and error.strerror:
        paths = [os.fsdecode(name) for name in (error.filename, error.filename2)
                 if name is not None]
        return ": ".join([error.strerror, *paths])
    return str(error) or type(error).__name__


def printable_json(value: Any) -> Any:
    """A JSON value with every string printable()."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(key): printable_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [printable_json(item) for item in value]
    return value


# ============================================================================================
# Pure core: blueprints
# ============================================================================================

_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
_QUALIFIED = re.compile(r"[a-z0-9][a-z0-9-]*(\.[a-z0-9][a-z0-9-]*)+")
_USER = re.compile(r"([0-9]{1,10}):([0-9]{1,10})")
_ENDPOINT_ID = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
ENDPOINT_SCHEMES = ("http", "https", "tcp", "ws", "wss", "grpc")


@dataclass(frozen=True)
class Runtime:
    uid: int
    gid: int
    writable_paths: tuple[str, ...]
    memory_mib: int
    pids: int

    @property
    def user(self) -> str:
        return f"{self.uid}:{self.gid}"


@dataclass(frozen=True)
class Command:
    name: str
    executable: str
    native: bool
    trigger: tuple[str, ...]


@dataclass(frozen=True)
class EndpointDecl:
    id: str
    service: str
    scheme: str
    port: int


@dataclass(frozen=True)
class Blueprint:
    name: str
    context: str
    dockerfile: str
    runtime: Runtime
    commands: dict[str, Command]
    executables: dict[str, tuple[str, ...]]
    endpoints: dict[str, EndpointDecl]
    private_env: bool

    def resolve_command(self, argv: list[str]) -> tuple[Command, list[str]]:
        """The declared command whose trigger starts argv (longest wins), and the rest of argv."""
        best: Optional[Command] = None
        for command in self.commands.values():
            if tuple(argv[:len(command.trigger)]) == command.trigger and (
                    best is None or len(command.trigger) > len(best.trigger)):
                best = command
        if best is None:
            raise AdmissionError(
                f"{' '.join(argv[:1])!r} is not a command declared by the controller blueprint "
                f"(declared: {', '.join(sorted(self.commands)) or 'none'})")
        if not best.native:
            raise AdmissionError(f"command {best.name!r} is not declared native_command: true")
        return best, argv[len(best.trigger):]


def _field(obj: Any, path: str, kind: type, required: bool = True, default: Any = None,
           parent: str = "") -> Any:
    """Look up a dotted path in parsed YAML (below `parent`), checking its type; errors name
    the whole field."""
    name = f"{parent}.{path}" if parent else path
    current = obj
    for part in path.split("."):
        if not isinstance(current, dict) or part not in current:
            if required:
                raise BlueprintError(f"{name}: required field is missing")
            return default
        current = current[part]
    if kind is int and isinstance(current, bool) or not isinstance(current, kind):
        raise BlueprintError(f"{name}: must be {kind.__name__}, got {type(current).__name__}")
    return current


def _only_keys(obj: dict[str, Any], path: str, allowed: set[str]) -> None:
    unknown = set(obj) - allowed
    if unknown:
        raise BlueprintError(f"{path}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")


def parse_blueprint(doc: Any) -> Blueprint:
    """Validate a parsed YAML blueprint. Every error names the offending field."""
    if not isinstance(doc, dict):
        raise BlueprintError("blueprint: must be a mapping")
    _only_keys(doc, "blueprint", {"name", "build", "environment"})
    name = _field(doc, "name", str)
    if not _NAME.fullmatch(name):
        raise BlueprintError("name: lowercase letters, digits and '-', at most 63 characters")
    build = _field(doc, "build", dict, required=False, default={})
    _only_keys(build, "build", {"context", "dockerfile"})
    context = _field(doc, "build.context", str, required=False, default=".")
    dockerfile = _field(doc, "build.dockerfile", str, required=False, default="Dockerfile")
    for label, value in (("build.context", context), ("build.dockerfile", dockerfile)):
        if os.path.isabs(value) or ".." in Path(value).parts:
            raise BlueprintError(f"{label}: must be a relative path inside the blueprint's folder")
    env = _field(doc, "environment", dict)
    _only_keys(env, "environment",
               {"runtime", "commands", "executables", "workload", "private_env"})
    blueprint = Blueprint(
        name=name, context=context, dockerfile=dockerfile,
        runtime=_parse_runtime(doc),
        commands=_parse_commands(doc),
        executables=_parse_executables(doc),
        endpoints=_parse_endpoints(doc),
        private_env=bool(_field(doc, "environment.private_env", dict, required=False)),
    )
    for command in blueprint.commands.values():
        if command.executable not in blueprint.executables:
            raise BlueprintError(
                f"environment.commands.{command.name}.executable: "
                f"{command.executable!r} is not declared under environment.executables")
    return blueprint


def _parse_runtime(doc: Any) -> Runtime:
    runtime = _field(doc, "environment.runtime", dict)
    _only_keys(runtime, "environment.runtime", {"user", "writable_paths", "memory_mib", "pids"})
    user = _field(doc, "environment.runtime.user", str)
    match = _USER.fullmatch(user)
    if not match:
        raise BlueprintError("environment.runtime.user: must be numeric uid:gid, e.g. '1000:1000'")
    paths = _field(doc, "environment.runtime.writable_paths", list, required=False, default=[])
    for i, path in enumerate(paths):
        if not isinstance(path, str) or not path.startswith("/") or ".." in path.split("/") or (
                path.rstrip("/") in ("", CONTAINER_HOME, CHANNEL_MOUNT)):
            raise BlueprintError(f"environment.runtime.writable_paths[{i}]: absolute path required")
    memory = _field(doc, "environment.runtime.memory_mib", int, False, DEFAULT_MEMORY_MIB)
    pids = _field(doc, "environment.runtime.pids", int, False, DEFAULT_PIDS)
    if not 16 <= memory <= 65536:
        raise BlueprintError("environment.runtime.memory_mib: must be 16..65536")
    if not MIN_PIDS <= pids <= 65536:
        raise BlueprintError(f"environment.runtime.pids: must be {MIN_PIDS}..65536")
    return Runtime(int(match.group(1)), int(match.group(2)), tuple(paths), memory, pids)


def _parse_commands(doc: Any) -> dict[str, Command]:
    commands: dict[str, Command] = {}
    for name, spec in _field(doc, "environment.commands", dict, False, {}).items():
        path = f"environment.commands.{name}"
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise BlueprintError(f"{path}: command names are lowercase letters, digits and '-'")
        if not isinstance(spec, dict):
            raise BlueprintError(f"{path}: must be a mapping")
        _only_keys(spec, path, {"executable", "native_command", "trigger"})
        executable = _field(spec, "executable", str, parent=path)
        native = spec.get("native_command", False)
        if not isinstance(native, bool):
            raise BlueprintError(f"{path}.native_command: must be true or false")
        trigger = spec.get("trigger", [name])
        if not isinstance(trigger, list) or not trigger or not all(
                isinstance(t, str) and t for t in trigger):
            raise BlueprintError(f"{path}.trigger: must be a non-empty list of words")
        commands[name] = Command(name, executable, native, tuple(trigger))
    return commands


def _parse_executables(doc: Any) -> dict[str, tuple[str, ...]]:
    executables: dict[str, tuple[str, ...]] = {}
    for name, spec in _field(doc, "environment.executables", dict, False, {}).items():
        path = f"environment.executables.{name}"
        if not isinstance(name, str) or not _QUALIFIED.fullmatch(name):
            raise BlueprintError(f"{path}: executable profiles are qualified, e.g. controller.main")
        if not isinstance(spec, dict):
            raise BlueprintError(f"{path}: must be a mapping")
        _only_keys(spec, path, {"argv"})
        argv = spec.get("argv")
        if not isinstance(argv, list) or not argv or not all(
                isinstance(a, str) and a for a in argv):
            raise BlueprintError(f"{path}.argv: must be a non-empty list of strings")
        executables[name] = tuple(argv)
    return executables


def _parse_endpoints(doc: Any) -> dict[str, EndpointDecl]:
    endpoints: dict[str, EndpointDecl] = {}
    services = _field(doc, "environment.workload.services", dict, False, {})
    for service, spec in services.items():
        path = f"environment.workload.services.{service}"
        if not isinstance(service, str) or not _NAME.fullmatch(service) or not isinstance(spec, dict):
            raise BlueprintError(f"{path}: must be a named mapping")
        _only_keys(spec, path, {"endpoints"})
        for endpoint_id, decl in _field(spec, "endpoints", dict, False, {}, parent=path).items():
            epath = f"{path}.endpoints.{endpoint_id}"
            if not isinstance(endpoint_id, str) or not _ENDPOINT_ID.fullmatch(endpoint_id):
                raise BlueprintError(f"{epath}: endpoint ids are lowercase words")
            if not isinstance(decl, dict):
                raise BlueprintError(f"{epath}: must be a mapping with scheme and port")
            _only_keys(decl, epath, {"scheme", "port"})
            scheme = _field(decl, "scheme", str, parent=epath)
            port = _field(decl, "port", int, parent=epath)
            if scheme not in ENDPOINT_SCHEMES:
                raise BlueprintError(f"{epath}.scheme: one of {', '.join(ENDPOINT_SCHEMES)}")
            if not 1 <= port <= 65535:
                raise BlueprintError(f"{epath}.port: must be 1..65535")
            if endpoint_id in endpoints:
                raise BlueprintError(f"{epath}: endpoint id declared twice")
            endpoints[endpoint_id] = EndpointDecl(endpoint_id, service, scheme, port)
    return endpoints


# ============================================================================================
# Pure core: the lifecycle machine
# ============================================================================================


class Phase(enum.Enum):
    PREPARING = "preparing"
    ACTIVE = "active"
    TERMINATING = "terminating"
    TERMINATED = "terminated"


class Transition(enum.Enum):
    READY = "ready"
    TERMINATE = "terminate"
    FINISH = "finish"


#: Theory of operation. A session prepares (containers, channel, attachment), becomes active
#: when the workload runs and `ready` is sent, and terminates exactly once. TERMINATE may come
#: from any cause while preparing or active; the first cause is latched and later causes are
#: facts that change nothing (TERMINATING + TERMINATE stays put). FINISH follows the whole
#: termination sequence, after which nothing is legal.
LIFECYCLE_TABLE: dict[tuple[Phase, Transition], Phase] = {
    (Phase.PREPARING, Transition.READY): Phase.ACTIVE,
    (Phase.PREPARING, Transition.TERMINATE): Phase.TERMINATING,  # startup failure, cancel
    (Phase.ACTIVE, Transition.TERMINATE): Phase.TERMINATING,
    (Phase.TERMINATING, Transition.TERMINATE): Phase.TERMINATING,  # later causes: no effect
    (Phase.TERMINATING, Transition.FINISH): Phase.TERMINATED,
}


class LifecycleError(ReployError):
    """A transition the table does not allow: a bug in the caller, never peer input."""


def next_phase(phase: Phase, transition: Transition) -> Phase:
    """LIFECYCLE_TABLE's edge from `phase`; HostCore moves only along these."""
    try:
        return LIFECYCLE_TABLE[(phase, transition)]
    except KeyError:
        raise LifecycleError(f"{transition.value} is illegal in {phase.value}") from None


# ============================================================================================
# Pure core: the host result
# ============================================================================================

RESULT_KEYS = (
    "schema", "ok", "error", "session_result", "result_delivered", "result_acknowledged",
    "controller_status", "controller_output", "delivery_tail_cleanup_status",
    "delivery_tail_recovery_action",
)
OUTPUT_SUCCESS_KINDS = frozenset({"not-requested", "directory-retained", "file-published"})
#: How a failed publication of --output-file begins the run's error (upstream's words); that
#: error says what became of the output, so the summary does not repeat controller_output.
PUBLISH_ERROR = "publish controlled-session controller output: "


@dataclass
class RunResult:
    """Every separate fact of one run; None for phases that never produced a value."""

    error: Optional[str] = None
    session_result: Optional[SessionResult] = None
    result_delivered: Optional[bool] = None
    result_acknowledged: Optional[bool] = None
    controller_status: Optional[Status] = None
    controller_output: Optional[Status] = None
    delivery_tail_cleanup_status: Optional[Status] = None
    delivery_tail_recovery_action: Optional[RecoveryAction] = None
    #: The first SIGINT or SIGTERM that came before the result (its name), whatever it did:
    #: a failed run's exit code comes from it, and its error names it. Not printed as a field.
    received_signal: Optional[str] = None

    @property
    def ok(self) -> bool:
        """The seed's rule: a requested or clean end, and every phase succeeded."""
        return (
            self.error is None
            and self.session_result is not None
            and self.session_result.succeeded
            and self.result_delivered is True
            and self.result_acknowledged is True
            and self.controller_output is not None
            and self.controller_output.kind in OUTPUT_SUCCESS_KINDS
            and self.delivery_tail_cleanup_status is not None
            and self.delivery_tail_cleanup_status.kind == "succeeded"
            and self.delivery_tail_recovery_action is RecoveryAction.NONE
        )

    def failures(self) -> list[str]:
        """Each fact that keeps `ok` false, in words, the run's own error first. A fact the
        cause implies is not repeated (a lost controller's finalization is `lost`, a startup
        failure's `startup-failed`, a session that never became ready never finalized)."""
        parts = [self.error] if self.error else []
        session = self.session_result
        if session is not None:
            parts += session_failures(session, explained=self.error is not None)
        if self.result_delivered is False:
            parts.append("the result was not delivered to the controller")
        elif self.result_acknowledged is False:
            parts.append("the controller did not acknowledge the result")
        output = self.controller_output
        if output is not None and output.kind not in OUTPUT_SUCCESS_KINDS and not (
                self.error or "").startswith(PUBLISH_ERROR):
            parts.append(stated(f"controller output {output.kind}", output))
        tail = self.delivery_tail_cleanup_status
        if tail is not None and tail.kind != "succeeded":
            parts.append(stated("the delivery tail's cleanup failed", tail))
        if parts and self.received_signal and self.received_signal not in parts[0]:
            parts.append(f"received {self.received_signal}")  # it came as the run ended anyway
        return parts

    def summary(self) -> Optional[str]:
        """`error` as printed: None exactly when ok; otherwise one line of safe text (no
        control characters, at most MAX_SAFE_TEXT_BYTES) naming what made ok false."""
        if self.ok:
            return None
        parts = self.failures() or ["the run did not succeed"]
        return wire.safe_text(printable("; ".join(dict.fromkeys(parts))))

    def to_json(self) -> dict[str, Any]:
        def status(value: Optional[Status]) -> Optional[dict[str, Any]]:
            return None if value is None else value.to_json()

        return {
            "schema": wire.RUN_RESULT_SCHEMA,
            "ok": self.ok,
            "error": None if self.error is None else printable(self.error),
            "session_result": None if self.session_result is None else self.session_result.to_json(),
            "result_delivered": self.result_delivered,
            "result_acknowledged": self.result_acknowledged,
            "controller_status": status(self.controller_status),
            "controller_output": status(self.controller_output),
            "delivery_tail_cleanup_status": status(self.delivery_tail_cleanup_status),
            "delivery_tail_recovery_action": None if self.delivery_tail_recovery_action is None
            else self.delivery_tail_recovery_action.value,
        }

    def encode(self) -> bytes:
        return wire.encode_compact(self.to_json()) + b"\n"


def stated(what: str, status: Status) -> str:
    """`what`, followed by the status's reason when it has one."""
    return f"{what}: {status.reason}" if status.reason else what


def session_failures(session: SessionResult, explained: bool) -> list[str]:
    """The session result's facts that keep `ok` false, in words. `explained`: the run's error
    already says why a startup failure or a host cancellation ended it."""
    cause, parts = session.cause, []
    workload = session.workload_status
    finalization = session.controller_finalization_status
    if cause is Cause.WORKLOAD_EXIT:
        code = dict(workload.details).get("code")
        if workload.kind != "exited":
            parts.append(stated(f"the workload's status is {workload.kind}", workload))
        elif code != 0:
            parts.append(f"the workload exited with code {code}")
    elif cause is Cause.CONTROLLER_LOST:
        parts.append(stated("the controller was lost", finalization))
    elif cause is Cause.RUNTIME_OBSERVATION_LOST:
        parts.append(stated("the runtime observation was lost",
                            session.runtime_observation_status))
    elif cause in (Cause.STARTUP_FAILURE, Cause.HOST_CANCEL) and not explained:
        parts.append(stated(cause.value, finalization))
    output = session.workload_output_finalization_status
    if output.kind != "drained" and cause is not Cause.RUNTIME_OBSERVATION_LOST:
        parts.append(stated("terminal output finalization failed", output))
    implied = finalization.kind in ("startup-failed", "not-completed") or (
        cause is Cause.CONTROLLER_LOST)
    if finalization.kind != "completed" and not implied:
        parts.append(stated(f"controller finalization {finalization.kind}", finalization))
    if session.cleanup_status.kind != "succeeded":
        parts.append(stated("the workload's cleanup failed", session.cleanup_status))
    return parts


def process_status(exit_code: int) -> Status:
    return Status.of("process", "exited", code=exit_code)


def failed(family: str, reason: str) -> Status:
    """A failed status; a cleanup's text is its `message`, every other family's a `reason`."""
    if family == "cleanup":
        return Status.of(family, "failed", message=reason)
    return Status.of(family, "failed", reason=reason)


def succeeded() -> Status:
    return Status.of("cleanup", "succeeded")


# ============================================================================================
# Pure core: the controlled session's host
# ============================================================================================

# HostCore holds every rule of a controlled session's run, from planning to the delivery
# tail's last step: events in, actions out, one frozen HostState, no Docker, socket or
# clock. ControlledSession performs the actions and turns what it sees into events; a deadline
# it armed passes as a Deadline event, fed before anything seen in the same pass of its loop (a
# deadline is a barrier: what is first seen after it did not happen before it).


class Role(str, enum.Enum):
    """A session container, by what it is for."""

    PROBE = "python-probe"
    HOLDER = "holder"
    CONTROLLER = "controller"
    WORKLOAD = "workload"


class Timer(enum.Enum):
    """Each deadline the host keeps; HostCore says for how long (HostTimeouts)."""

    STARTUP = "startup"                  # --startup-timeout, from the end of planning
    GRACE = "grace"                      # --termination-grace: SIGTERM, then SIGKILL
    OUTPUT = "output"                    # the host-owned 30 s output barrier
    EXIT = "exit"                        # --cleanup-timeout for an exit after the drain
    FINALIZATION = "finalization"        # --controller-finalization-timeout
    CLEANUP = "cleanup"                  # --cleanup-timeout for the workload's removal
    ACKNOWLEDGEMENT = "acknowledgement"  # --result-acknowledgement-timeout
    TAIL = "tail"                        # --cleanup-timeout, the whole delivery tail
    CHANNEL_CLOSE = "channel-close"      # CHANNEL_CLOSE_S of the tail for channel and attachment
    CONTROLLER_STOP = "controller-stop"  # half the tail: the controller is then killed
    CONTROLLER_KILL = "controller-kill"  # three quarters of the tail


class Step(enum.Enum):
    """Where the host is in its run; STEP_TABLE says what each waits for."""

    PLANNING = "planning"
    PREPARING = "preparing"
    STARTING_HOLDER = "starting-holder"
    STARTING_CONTROLLER = "starting-controller"
    AWAITING_CHANNEL = "awaiting-channel"
    AWAITING_ATTACHMENT = "awaiting-attachment"
    STARTING_WORKLOAD = "starting-workload"
    ACTIVE = "active"
    DRAINING = "draining"
    AWAITING_EXIT = "awaiting-exit"
    FINALIZING = "finalizing"
    REMOVING_WORKLOAD = "removing-workload"
    DELIVERING = "delivering"
    AWAITING_ACKNOWLEDGEMENT = "awaiting-acknowledgement"
    CLOSING_CHANNEL = "closing-channel"
    FLUSHING_ATTACHMENT = "flushing-attachment"
    STOPPING_CONTROLLER = "stopping-controller"
    KILLING_CONTROLLER = "killing-controller"
    COPYING_LOG = "copying-log"
    REMOVING = "removing"
    REMOVING_HOLDER = "removing-holder"
    PUBLISHING = "publishing"
    REMOVING_PATHS = "removing-paths"
    DONE = "done"


@dataclass(frozen=True)
class StepRule:
    until: str  # what ends the step (HostCore.step_done decides it)
    timer: Optional[Timer] = None  # the deadline that ends it otherwise


#: The host's run, in order. Startup steps end early when a cause is latched (termination
#: begins); every later step runs in every outcome, each bounded by its timer. The public
#: phases (LIFECYCLE_TABLE) move alongside: READY at STARTING_WORKLOAD's end, TERMINATE at the
#: first cause, FINISH when the session result is fixed (before DELIVERING).
STEP_TABLE: dict[Step, StepRule] = {
    Step.PLANNING: StepRule("the executor's planning ends (Planned, PlanRejected)"),
    Step.PREPARING: StepRule("channel, outputs, holder and controller exist (Begin)"),
    Step.STARTING_HOLDER: StepRule("the holder runs", Timer.STARTUP),
    Step.STARTING_CONTROLLER: StepRule("the controller started, the workload created",
                                       Timer.STARTUP),
    Step.AWAITING_CHANNEL: StepRule("the controller connects the channel", Timer.STARTUP),
    Step.AWAITING_ATTACHMENT: StepRule("the attachment is handed over", Timer.STARTUP),
    Step.STARTING_WORKLOAD: StepRule("the workload runs", Timer.STARTUP),
    Step.ACTIVE: StepRule("a cause is latched"),
    Step.DRAINING: StepRule("output at end of file, delivered, and the workload gone",
                            Timer.OUTPUT),
    Step.AWAITING_EXIT: StepRule("the workload's exit is observed", Timer.EXIT),
    Step.FINALIZING: StepRule("complete, or the channel lost", Timer.FINALIZATION),
    Step.REMOVING_WORKLOAD: StepRule("the workload is removed", Timer.CLEANUP),
    Step.DELIVERING: StepRule("terminated is written out", Timer.ACKNOWLEDGEMENT),
    Step.AWAITING_ACKNOWLEDGEMENT: StepRule("acknowledge-terminated, or the channel lost",
                                            Timer.ACKNOWLEDGEMENT),
    Step.CLOSING_CHANNEL: StepRule("the broker closes its end", Timer.CHANNEL_CLOSE),
    Step.FLUSHING_ATTACHMENT: StepRule("the attachment has every byte", Timer.CHANNEL_CLOSE),
    Step.STOPPING_CONTROLLER: StepRule("the controller exits", Timer.CONTROLLER_STOP),
    Step.KILLING_CONTROLLER: StepRule("the killed controller exits", Timer.CONTROLLER_KILL),
    Step.COPYING_LOG: StepRule("the controller's log is copied", Timer.TAIL),
    Step.REMOVING: StepRule("every container but the holder is removed", Timer.TAIL),
    Step.REMOVING_HOLDER: StepRule("the holder is removed", Timer.TAIL),
    Step.PUBLISHING: StepRule("--output-file is published"),
    Step.REMOVING_PATHS: StepRule("the channel and staging directories are removed"),
    Step.DONE: StepRule("nothing: the run is over"),
}
STARTUP_STEPS = frozenset({Step.STARTING_HOLDER, Step.STARTING_CONTROLLER,
                           Step.AWAITING_CHANNEL, Step.AWAITING_ATTACHMENT,
                           Step.STARTING_WORKLOAD})
#: What a startup step that stopped short was doing, in the words of its error.
STARTUP_WHAT = {Step.AWAITING_CHANNEL: "the controller did not connect",
                Step.STARTING_CONTROLLER: "the controller did not connect",
                Step.AWAITING_ATTACHMENT: "no terminal attachment connected"}


class Channel(enum.Enum):
    AWAITED = "awaited"
    OPEN = "open"
    GONE = "gone"  # lost, or closed by the delivery tail


@dataclass(frozen=True)
class RelayFacts:
    """The terminal relay as last observed: the PTY at end of file, output lost (the
    attachment ended first), every byte read written to the attachment."""

    eof: bool = False
    lost: bool = False
    delivered: bool = True


@dataclass(frozen=True)
class HostTimeouts:
    """Every duration HostCore arms, in seconds."""

    startup_s: float
    grace_s: float
    finalization_s: float
    acknowledgement_s: float
    cleanup_s: float
    output_s: float = OUTPUT_FINALIZATION_TIMEOUT_MS / 1000.0

    @classmethod
    def of(cls, options: "RunOptions") -> "HostTimeouts":
        return cls(*(options.timeout_s(flag) for flag in (
            "--startup-timeout", "--termination-grace", "--controller-finalization-timeout",
            "--result-acknowledgement-timeout", "--cleanup-timeout")))

    def duration(self, timer: Timer) -> float:
        return {Timer.STARTUP: self.startup_s, Timer.GRACE: self.grace_s,
                Timer.OUTPUT: self.output_s, Timer.EXIT: self.cleanup_s,
                Timer.FINALIZATION: self.finalization_s, Timer.CLEANUP: self.cleanup_s,
                Timer.ACKNOWLEDGEMENT: self.acknowledgement_s, Timer.TAIL: self.cleanup_s,
                Timer.CHANNEL_CLOSE: min(self.cleanup_s, CHANNEL_CLOSE_S),
                Timer.CONTROLLER_STOP: self.cleanup_s / 2,
                Timer.CONTROLLER_KILL: self.cleanup_s * 3 / 4}[timer]


@dataclass(frozen=True)
class HostConfig:
    """What the plan fixes for the core: the grants it announces and what output was asked."""

    timeouts: HostTimeouts
    endpoints: tuple[wire.Endpoint, ...] = ()
    columns: int = DEFAULT_COLUMNS
    rows: int = DEFAULT_ROWS
    #: The requested output's status before the session touches it (requested_output_status).
    requested_output: Optional[Status] = None
    output_file: bool = False


# -- events ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Planned:
    """Planning succeeded: the startup timeout counts from now."""


@dataclass(frozen=True)
class PlanFailed:
    reason: str


@dataclass(frozen=True)
class OutputPrepared:
    """The controller's output destination is ready (status None: a staged file), or failed."""

    status: Optional[Status]
    staged: bool = False


@dataclass(frozen=True)
class Created:
    role: Role


@dataclass(frozen=True)
class Begin:
    """Preparation is done: the channel listens, the holder and controller exist."""


@dataclass(frozen=True)
class Started:
    role: Role


@dataclass(frozen=True)
class EngineFailed:
    """A step of preparation or startup failed (its text says which)."""

    reason: str
    role: Optional[Role] = None


@dataclass(frozen=True)
class ChannelConnected:
    pass


@dataclass(frozen=True)
class ChannelLost:
    reason: str


@dataclass(frozen=True)
class ChannelFlushed:
    """Every event sent so far is written out."""


@dataclass(frozen=True)
class Requested:
    request: wire.Message  # Resize, Terminate, Complete or AcknowledgeTerminated


@dataclass(frozen=True)
class Attached:
    pass


@dataclass(frozen=True)
class AttachmentRejected:
    reason: str


@dataclass(frozen=True)
class RelayObserved:
    facts: RelayFacts


@dataclass(frozen=True)
class WorkloadExited:
    code: int


@dataclass(frozen=True)
class ObservationLost:
    reason: str


@dataclass(frozen=True)
class ControllerExited:
    """The controller's exit (its code), or sight of it lost (code None)."""

    code: Optional[int]


@dataclass(frozen=True)
class ControllerLog:
    """The last line of the exited controller's log, for a startup failure's words."""

    last_line: str


@dataclass(frozen=True)
class HolderLost:
    how: str


@dataclass(frozen=True)
class Signalled:
    name: str


@dataclass(frozen=True)
class Deadline:
    timer: Timer


@dataclass(frozen=True)
class Removed:
    role: Role
    error: Optional[str] = None


@dataclass(frozen=True)
class LogCopied:
    pass


@dataclass(frozen=True)
class Published:
    error: Optional[str] = None


@dataclass(frozen=True)
class PathsRemoved:
    failures: tuple[str, ...] = ()


@dataclass(frozen=True)
class InternalError:
    text: str


HostEvent = Union[Planned, PlanFailed, OutputPrepared, Created, Begin, Started, EngineFailed,
                  ChannelConnected, ChannelLost, ChannelFlushed, Requested, Attached,
                  AttachmentRejected, RelayObserved, WorkloadExited, ObservationLost,
                  ControllerExited, ControllerLog, HolderLost, Signalled, Deadline, Removed,
                  LogCopied, Published, PathsRemoved, InternalError]


# -- actions -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Send:
    event: wire.Message


@dataclass(frozen=True)
class Start:
    """Start the role's container (the workload: and resize it, and watch it); Started or
    EngineFailed follows. Starting the controller also creates the workload (Created)."""

    role: Role


@dataclass(frozen=True)
class Kill:
    role: Role
    signame: str


@dataclass(frozen=True)
class Remove:
    roles: tuple[Role, ...]


@dataclass(frozen=True)
class Arm:
    timer: Timer
    seconds: float


@dataclass(frozen=True)
class Resize:
    columns: int
    rows: int


@dataclass(frozen=True)
class Log:
    message: str


@dataclass(frozen=True)
class Close:
    """Close one end: ClosePart names which."""

    part: "ClosePart"


class ClosePart(enum.Enum):
    PTY = "pty"                      # abandon the workload's stream
    CHANNEL_WRITE = "channel-write"  # end our side; the broker reads to the end
    CHANNEL = "channel"
    TERMINAL = "terminal"            # the attachment's connection
    LISTENER = "listener"


@dataclass(frozen=True)
class EndOutput:
    """The attachment's end of output, after its last byte."""

    status: Status


@dataclass(frozen=True)
class ReadControllerLog:
    pass


@dataclass(frozen=True)
class CopyControllerLog:
    pass


@dataclass(frozen=True)
class Publish:
    pass


@dataclass(frozen=True)
class RemovePaths:
    pass


@dataclass(frozen=True)
class Finish:
    """The run is over: print `result`; keep the manifest when something was left behind."""

    result: RunResult
    keep_manifest: bool


HostAction = Union[Send, Start, Kill, Remove, Arm, Resize, Log, Close, EndOutput,
                   ReadControllerLog, CopyControllerLog, Publish, RemovePaths, Finish]


@dataclass(frozen=True)
class HostState:
    """Everything the host knows of its run: the phase and step, the latched cause, and each
    separate fact (never inferred from another)."""

    phase: Phase = Phase.PREPARING
    step: Step = Step.PLANNING
    cause: Optional[Cause] = None
    cause_detail: str = ""
    error: Optional[str] = None
    reached_ready: bool = False
    armed: frozenset[Timer] = frozenset()
    expired: frozenset[Timer] = frozenset()
    owned: frozenset[Role] = frozenset()
    removing: frozenset[Role] = frozenset()
    removal_failures: tuple[str, ...] = ()
    #: The controller may be running (its start was asked for and did not fail): the tail
    #: stops it; and its start call returned.
    controller_started: bool = False
    controller_up: bool = False
    controller_exit: Optional[int] = None
    controller_gone: bool = False
    controller_log: Optional[str] = None
    workload_started: bool = False
    workload_exit: Optional[int] = None
    observation_lost: Optional[str] = None
    holder_lost: Optional[str] = None
    channel: Channel = Channel.AWAITED
    channel_lost: Optional[str] = None
    unflushed: bool = False
    attached: bool = False
    attachment_refused: Optional[str] = None
    complete: bool = False
    acknowledged: bool = False
    relay: RelayFacts = RelayFacts()
    #: The relay as last observed before the output barrier passed.
    seen: RelayFacts = RelayFacts()
    terminating_sent: bool = False
    exit_announced: bool = False
    finalization_announced: bool = False
    output_status: Optional[Status] = None
    workload_status: Optional[Status] = None
    finalization_status: Optional[Status] = None
    session_result: Optional[SessionResult] = None
    result_delivered: Optional[bool] = None
    result_acknowledged: Optional[bool] = None
    controller_status: Optional[Status] = None
    controller_output: Optional[Status] = None
    staged: bool = False
    log_copied: bool = False
    tail_failures: tuple[str, ...] = ()

    @property
    def workload_gone(self) -> bool:
        return self.workload_exit is not None or self.observation_lost is not None


class HostCore:
    """A controlled session's decisions: `handle(event)` returns the actions to perform, in
    order; `state` is the whole of what is known. Nothing follows Finish."""

    def __init__(self, config: HostConfig) -> None:
        self.config = config
        self.state = HostState()
        self.actions: list[HostAction] = []

    def handle(self, event: HostEvent) -> list[HostAction]:
        if self.state.step is Step.DONE:
            return []  # a late report (a call, a wait thread) after the result: nobody listens
        self.actions = []
        self.on(event)
        self.advance()
        return self.actions

    # -- small moves ---------------------------------------------------------------------------

    def set(self, **changes: Any) -> None:
        self.state = replace(self.state, **changes)

    def emit(self, *actions: HostAction) -> None:
        self.actions.extend(actions)

    def send(self, event: wire.Message) -> None:
        """An event for the controller, while there is a channel to carry it."""
        if self.state.channel is Channel.OPEN:
            self.set(unflushed=True)
            self.emit(Send(event))

    def arm(self, *timers: Timer) -> None:
        self.set(armed=self.state.armed | set(timers), expired=self.state.expired - set(timers))
        self.emit(*(Arm(timer, self.config.timeouts.duration(timer)) for timer in timers))

    def disarm(self, *timers: Timer) -> None:
        self.set(armed=self.state.armed - set(timers))

    def latch(self, cause: Cause, detail: str = "") -> bool:
        """Latch `cause` if none is latched yet (LIFECYCLE_TABLE's TERMINATE); True when this
        call latched it. Termination itself begins in advance()."""
        state = self.state
        if state.cause is not None or state.step in TAIL_STEPS:
            return False
        self.set(phase=next_phase(state.phase, Transition.TERMINATE), cause=cause,
                 cause_detail=detail)
        self.emit(Log(f"terminating: {cause.value}{': ' + detail if detail else ''}"))
        return True

    def fail_startup(self, reason: str) -> None:
        """A startup step failed: the run's error says so, unless another cause came first."""
        if self.state.cause in (None, Cause.STARTUP_FAILURE) and self.state.error is None:
            self.set(error=f"startup failed: {reason}")
        self.latch(Cause.STARTUP_FAILURE, reason)

    # -- events --------------------------------------------------------------------------------

    def on(self, event: HostEvent) -> None:
        HOST_EVENT_HANDLERS[type(event)](self, event)

    def on_deadline(self, event: Deadline) -> None:
        """A deadline that was armed passes: it ends its step (STEP_TABLE) in advance(); the
        grace's also sends SIGKILL."""
        state, timer = self.state, event.timer
        if timer not in state.armed:
            return  # disarmed meanwhile: stale
        self.set(armed=state.armed - {timer}, expired=state.expired | {timer})
        if timer is Timer.GRACE and not state.workload_gone:
            self.emit(Log(f"workload still running after the "
                          f"{format_duration(int(self.config.timeouts.grace_s * 1000))} grace; "
                          "sending SIGKILL"),
                      Kill(Role.WORKLOAD, "SIGKILL"))

    def on_planned(self, _event: Planned) -> None:
        if self.state.step is Step.PLANNING:
            self.set(step=Step.PREPARING)
            self.arm(Timer.STARTUP)

    def on_plan_failed(self, event: PlanFailed) -> None:
        if self.state.step is Step.PLANNING:  # not after a signal ended planning
            self.set(error=f"plan rejected: {event.reason}")
            self.begin_tail()

    def on_output_prepared(self, event: OutputPrepared) -> None:
        self.set(controller_output=event.status, staged=event.staged)

    def on_created(self, event: Created) -> None:
        self.set(owned=self.state.owned | {event.role})

    def on_begin(self, _event: Begin) -> None:
        if Role.HOLDER in self.state.owned:  # its namespace must exist before anything joins
            self.set(step=Step.STARTING_HOLDER)
            self.emit(Start(Role.HOLDER))
        else:
            self.start_controller()

    def on_engine_failed(self, event: EngineFailed) -> None:
        if event.role is Role.CONTROLLER:
            self.set(controller_started=False)
        if self.state.phase is Phase.PREPARING:
            self.fail_startup(event.reason)
        else:
            self.emit(Log(event.reason))

    def on_channel_connected(self, _event: ChannelConnected) -> None:
        """The host accepts one peer: a channel once lost is never open again."""
        if self.state.channel is not Channel.GONE:
            self.set(channel=Channel.OPEN)

    def on_channel_flushed(self, _event: ChannelFlushed) -> None:
        self.set(unflushed=False)

    def on_attached(self, _event: Attached) -> None:
        self.set(attached=True)

    def on_attachment_rejected(self, event: AttachmentRejected) -> None:
        reason = f"the terminal attachment was refused: {event.reason}"
        self.set(attachment_refused=reason)
        self.emit(Log(reason))
        if self.state.phase is Phase.PREPARING:
            self.latch(Cause.STARTUP_FAILURE, reason)

    def on_relay(self, event: RelayObserved) -> None:
        """The relay's facts; those seen before the output barrier decide the drain."""
        self.set(relay=event.facts)
        if Timer.OUTPUT not in self.state.expired:
            self.set(seen=event.facts)

    def on_workload_exited(self, event: WorkloadExited) -> None:
        if self.state.workload_exit is not None:
            return  # a container exits once: the first report is the fact
        self.set(workload_exit=event.code)
        self.latch(Cause.WORKLOAD_EXIT if self.state.reached_ready else Cause.STARTUP_FAILURE,
                   f"the workload exited with code {event.code}")
        self.announce_workload_exit()

    def on_observation_lost(self, event: ObservationLost) -> None:
        self.set(observation_lost=event.reason)
        self.latch(Cause.RUNTIME_OBSERVATION_LOST, event.reason)

    def on_controller_exited(self, event: ControllerExited) -> None:
        state = self.state
        self.set(controller_exit=event.code, controller_gone=True)
        if state.reached_ready:
            self.latch(Cause.CONTROLLER_LOST, "the controller container exited")
        elif state.phase is Phase.PREPARING and event.code is not None:
            self.emit(ReadControllerLog())  # its last line explains the failure (ControllerLog)
        else:
            self.latch(Cause.STARTUP_FAILURE, "the controller exited during startup")

    def on_controller_log(self, event: ControllerLog) -> None:
        self.set(controller_log=event.last_line)
        self.latch(Cause.STARTUP_FAILURE, "the controller exited during startup")

    def on_signal(self, event: Signalled) -> None:
        """SIGINT/SIGTERM cancel the session (host-cancel) if nothing else ended it first; a
        later one changes none of the termination's steps (main() still exits 130/143)."""
        if self.latch(Cause.HOST_CANCEL, f"received {event.name}"):
            self.set(error=f"cancelled by {event.name}")
        else:
            self.emit(Log(f"received {event.name}; the session is already ending"))

    def on_removed(self, event: Removed) -> None:
        """A removal reported; its failure counts where the core asked for it."""
        state = self.state
        asked = event.error is not None and event.role in state.removing
        self.set(owned=state.owned if event.error else state.owned - {event.role},
                 removing=state.removing - {event.role},
                 removal_failures=state.removal_failures + ((event.error,) if asked else ()))

    def on_log_copied(self, _event: LogCopied) -> None:
        self.set(log_copied=True)

    def on_paths_removed(self, event: PathsRemoved) -> None:
        if self.state.step is Step.REMOVING_PATHS:
            self.finish(self.state.tail_failures + event.failures)

    def on_internal_error(self, event: InternalError) -> None:
        """A bug in the host: it still cleans up and reports, skipping what it cannot trust."""
        state = self.state
        self.set(error=f"internal error: {event.text}")
        if state.step in TAIL_STEPS:
            return
        if state.cause is None:
            self.set(phase=next_phase(state.phase, Transition.TERMINATE),
                     cause=Cause.STARTUP_FAILURE)
        if state.session_result is not None:  # `terminated` was sent: its delivery and
            # acknowledgement are no longer waited for, so neither is claimed
            self.set(result_delivered=state.result_delivered is True, result_acknowledged=False)
        self.begin_tail()

    def on_started(self, event: Started) -> None:
        state, role = self.state, event.role
        if role is Role.HOLDER and state.step is Step.STARTING_HOLDER:
            self.start_controller()
        elif role is Role.CONTROLLER:
            self.set(controller_started=True, controller_up=True)
        elif role is Role.WORKLOAD:
            self.set(workload_started=True)
            if state.phase is Phase.PREPARING:
                self.set(phase=next_phase(Phase.PREPARING, Transition.READY),
                         reached_ready=True, step=Step.ACTIVE)
                self.disarm(Timer.STARTUP)
                self.send(wire.Ready())

    def on_channel_lost(self, event: ChannelLost) -> None:
        state, reason = self.state, event.reason
        if state.channel is not Channel.OPEN:
            return
        self.set(channel=Channel.GONE, channel_lost=reason, unflushed=False)
        if state.step in TAIL_STEPS:
            return  # the broker ended its side, as the delivery tail asked
        self.latch(Cause.STARTUP_FAILURE if state.phase is Phase.PREPARING
                   else Cause.CONTROLLER_LOST, reason)

    def on_request(self, event: Requested) -> None:
        """Resize and terminate only while active (repeats are idempotent); complete and the
        acknowledgement are facts whenever they come (the broker holds them to their turn)."""
        request = event.request
        active = self.state.phase is Phase.ACTIVE
        if isinstance(request, wire.Resize) and active:
            self.emit(Resize(request.columns, request.rows))
        elif isinstance(request, wire.Terminate) and active:
            self.latch(Cause.CONTROLLER_TERMINATE)
        elif isinstance(request, wire.Complete):
            self.set(complete=True)
        elif isinstance(request, wire.AcknowledgeTerminated):
            self.set(acknowledged=True)

    def on_holder_lost(self, event: HolderLost) -> None:
        """Before the session containers joined the holder's namespace, nothing can: a startup
        failure. After, the namespace lives on in them: a diagnostic, nothing more."""
        lost = f"the session's network namespace holder {event.how}"
        self.set(holder_lost=lost)
        if self.state.phase is Phase.PREPARING:
            self.latch(Cause.STARTUP_FAILURE, lost)
        elif self.state.phase is not Phase.TERMINATED:
            self.emit(Log(f"{lost}; the session's namespace lives on in its containers"))
            if not self.state.finalization_announced:
                self.send(wire.Diagnostic(code="namespace_holder_lost", message=lost))

    def announce_workload_exit(self) -> None:
        """workload-exit precedes terminating when it is the cause, otherwise follows it; never
        before ready, never after workload-outputs-finalized (the status was fixed then)."""
        state = self.state
        if state.workload_exit is None or state.exit_announced or state.finalization_announced:
            return
        if state.reached_ready and (state.cause is Cause.WORKLOAD_EXIT or state.terminating_sent):
            self.set(exit_announced=True)
            self.send(wire.WorkloadExit(status=process_status(state.workload_exit)))

    # -- the steps -------------------------------------------------------------------------------

    def advance(self) -> None:
        """Move through STEP_TABLE while steps end: by their condition, by their timer, or
        (startup and active) by a latched cause."""
        while True:
            step = self.state.step
            if self.state.cause is not None and (step in STARTUP_STEPS or step in (
                    Step.PLANNING, Step.PREPARING, Step.ACTIVE)):
                self.stop_short(step)
            elif self.step_done(step):
                self.next_step(step, timed_out=False)
            elif STEP_TABLE[step].timer in self.state.expired:
                self.next_step(step, timed_out=True)
            if self.state.step is step:
                return

    def step_done(self, step: Step) -> bool:
        state = self.state
        done = {
            Step.STARTING_CONTROLLER: state.controller_up and Role.WORKLOAD in state.owned,
            Step.AWAITING_CHANNEL: state.channel is Channel.OPEN,
            Step.AWAITING_ATTACHMENT: state.attached,
            Step.DRAINING: not state.workload_started or (
                state.seen.eof and state.seen.delivered and state.workload_gone),
            Step.AWAITING_EXIT: not state.workload_started or state.workload_gone,
            Step.FINALIZING: state.complete or state.channel is not Channel.OPEN,
            Step.REMOVING_WORKLOAD: Role.WORKLOAD not in state.removing,
            Step.DELIVERING: state.channel is not Channel.OPEN or not state.unflushed,
            Step.AWAITING_ACKNOWLEDGEMENT: state.acknowledged or state.channel is not Channel.OPEN,
            Step.CLOSING_CHANNEL: state.channel is not Channel.OPEN,
            Step.FLUSHING_ATTACHMENT: state.relay.delivered,
            Step.STOPPING_CONTROLLER: state.controller_gone,
            Step.KILLING_CONTROLLER: state.controller_gone,
            Step.COPYING_LOG: state.log_copied,
            Step.REMOVING: not state.removing,
            Step.REMOVING_HOLDER: not state.removing,
        }
        return done.get(step, False)

    def next_step(self, step: Step, timed_out: bool) -> None:
        if step in STARTUP_STEPS and timed_out:
            self.startup_timed_out(step)
        else:
            STEP_ENDS[step](self, timed_out)

    def startup_timed_out(self, step: Step) -> None:
        if step is Step.STARTING_CONTROLLER:  # it may still be starting: the tail stops it
            self.fail_startup("the controller did not start within the startup timeout")
        else:
            self.fail_startup(self.shortfall(STARTUP_WHAT.get(step, "startup")))
        self.begin_termination()

    def end_controller_start(self, _timed_out: bool) -> None:
        self.set(step=Step.AWAITING_CHANNEL)

    def end_channel_wait(self, _timed_out: bool) -> None:
        self.set(step=Step.AWAITING_ATTACHMENT)
        self.send(wire.Opened(
            operations=wire.OPERATIONS, endpoints=self.config.endpoints,
            columns=self.config.columns, rows=self.config.rows,
            output_finalization_timeout_milliseconds=OUTPUT_FINALIZATION_TIMEOUT_MS))

    def end_attachment_wait(self, _timed_out: bool) -> None:
        self.set(step=Step.STARTING_WORKLOAD)
        self.emit(Start(Role.WORKLOAD))

    def end_workload_removal(self, _timed_out: bool) -> None:
        self.end_session(self.cleanup_status(Role.WORKLOAD in self.state.removing))

    def end_delivery(self, timed_out: bool) -> None:
        delivered = not timed_out and self.state.channel is Channel.OPEN
        self.set(result_delivered=delivered, step=Step.AWAITING_ACKNOWLEDGEMENT)
        if not delivered:
            self.set(result_acknowledged=False)
            self.begin_tail()

    def end_acknowledgement(self, timed_out: bool) -> None:
        self.set(result_acknowledged=self.state.acknowledged and not timed_out)
        self.disarm(Timer.ACKNOWLEDGEMENT)
        self.begin_tail()

    def stop_short(self, step: Step) -> None:
        """A cause was latched before the session was active, or while it was."""
        if step in STARTUP_WHAT and self.state.cause is Cause.STARTUP_FAILURE:
            self.fail_startup(self.shortfall(STARTUP_WHAT[step]))
        if step is Step.PLANNING:
            self.begin_tail()
        else:
            self.begin_termination()

    def shortfall(self, what: str) -> str:
        """Why startup stopped short, in the words most useful to the user."""
        state = self.state
        if state.attachment_refused:
            return state.attachment_refused
        if state.holder_lost:
            return f"{what}: {state.holder_lost}"
        if state.controller_exit is not None:
            line = f" ({state.controller_log})" if state.controller_log else ""
            return f"{what}: the controller exited with code {state.controller_exit}{line}"
        if state.channel_lost:
            return f"{what}: {state.channel_lost}"
        if state.cause is not None:
            return f"{what} before termination began ({state.cause.value})"
        return f"{what} within the startup timeout"

    def start_controller(self) -> None:
        """The controller starts while the workload is created and attached to; the workload
        itself starts only once the attachment is connected."""
        self.set(step=Step.STARTING_CONTROLLER, controller_started=True)  # it may run from now
        self.emit(Start(Role.CONTROLLER))

    def begin_termination(self) -> None:
        """Terminating (after ready), SIGTERM with the grace armed, and the output barrier."""
        state = self.state
        self.disarm(Timer.STARTUP)
        self.set(step=Step.DRAINING)
        self.arm(Timer.OUTPUT)
        if state.reached_ready:
            assert state.cause is not None
            self.send(wire.Terminating(cause=state.cause))
            self.set(terminating_sent=True)
            self.announce_workload_exit()  # an exit seen before terminating went out
        if state.workload_started and not state.workload_gone:
            self.emit(Kill(Role.WORKLOAD, "SIGTERM"))
            self.arm(Timer.GRACE)

    def end_drain(self, _timed_out: bool) -> None:
        """The drain's outcome, from the relay as seen before the barrier. A workload that
        never started produced no output; output the attachment could not take fails it."""
        state, seen = self.state, self.state.seen
        self.disarm(Timer.OUTPUT)
        reason = None
        if state.observation_lost:
            reason = f"the runtime observation was lost: {state.observation_lost}"
        elif not state.workload_started:
            pass
        elif not seen.eof:
            reason = (f"terminal output did not reach end of file within "
                      f"{OUTPUT_FINALIZATION_TIMEOUT_MS // 1000} s of termination")
        elif seen.lost:
            reason = "the terminal attachment ended before it had all of the terminal output"
        elif not seen.delivered:
            reason = "terminal output could not be delivered to the attachment in time"
        if reason is None:
            self.set(output_status=Status.of("output_finalization", "drained"))
        else:
            self.set(output_status=failed("output_finalization", reason))
            self.emit(Close(ClosePart.PTY))  # abandon the rest, so the Engine finishes the exit
        self.set(step=Step.AWAITING_EXIT)
        if not self.step_done(Step.AWAITING_EXIT):
            self.arm(Timer.EXIT)

    def end_workload(self, timed_out: bool) -> None:
        """The workload's status is fixed and every workload fact sent; then finalization is
        announced, the workload removed while the controller finalizes."""
        state = self.state
        self.disarm(Timer.EXIT, Timer.GRACE)
        if state.workload_exit is not None:
            status = process_status(state.workload_exit)
        elif state.observation_lost:
            status = Status.of("process", "unavailable", reason=state.observation_lost)
        elif not state.workload_started:
            status = Status.of("process", "unavailable", reason="the workload never started")
        else:
            timeout = format_duration(int(self.config.timeouts.cleanup_s * 1000))
            status = Status.of("process", "unavailable",
                               reason=f"the workload's exit was not observed within {timeout}")
        self.set(workload_status=status)
        self.announce_workload_exit()
        output = state.output_status
        assert output is not None
        self.set(finalization_announced=True)
        self.emit(EndOutput(output))
        if state.reached_ready:
            self.send(wire.WorkloadOutputsFinalized(status=output.kind, reason=output.reason))
        self.emit(Close(ClosePart.PTY))
        self.arm(Timer.CLEANUP)
        self.remove(Role.WORKLOAD)
        self.set(step=Step.FINALIZING)
        finalization = self.finalization_without_complete()
        if finalization is not None:
            self.set(finalization_status=finalization, step=Step.REMOVING_WORKLOAD)
        else:
            self.arm(Timer.FINALIZATION)

    def finalization_without_complete(self) -> Optional[Status]:
        """The fact that stands in for `complete` in an ending that cannot have one."""
        state, reason = self.state, self.state.cause_detail
        if state.cause is Cause.STARTUP_FAILURE:
            return Status.of("controller_finalization", "startup-failed",
                             reason=reason or "the session did not become ready")
        if not state.reached_ready:
            return Status.of("controller_finalization", "not-completed",
                             reason=f"the session ended before it became ready ({reason})")
        if state.cause is Cause.CONTROLLER_LOST:
            return Status.of("controller_finalization", "lost", reason=reason)
        return None

    def end_finalization(self, timed_out: bool) -> None:
        state = self.state
        self.disarm(Timer.FINALIZATION)
        if state.complete and not timed_out:
            status = Status.of("controller_finalization", "completed")
        elif state.channel is not Channel.OPEN:
            status = Status.of("controller_finalization", "lost",
                               reason=state.channel_lost or "the controller channel was lost")
        else:
            timeout = format_duration(int(self.config.timeouts.finalization_s * 1000))
            status = Status.of("controller_finalization", "finalization-timeout",
                               reason=f"no complete within {timeout}")
        self.set(finalization_status=status, step=Step.REMOVING_WORKLOAD)

    def remove(self, *roles: Role) -> None:
        roles = tuple(role for role in roles if role in self.state.owned)
        if roles:
            self.set(removing=self.state.removing | set(roles))
            self.emit(Remove(roles))

    def cleanup_status(self, unfinished: bool) -> Status:
        """The removals' outcome: each failure reported, and what the deadline cut short."""
        state = self.state
        failures = list(state.removal_failures) + [
            f"remove the {role.value} container: not finished within the cleanup timeout"
            for role in sorted(state.removing, key=lambda r: r.value) if unfinished]
        self.set(removal_failures=(), removing=frozenset() if unfinished else state.removing)
        return failed("cleanup", "; ".join(failures)) if failures else succeeded()

    def end_session(self, cleanup: Status) -> None:
        """The session result is fixed (FINISH), then delivered."""
        state = self.state
        self.disarm(Timer.CLEANUP)
        assert state.cause is not None and state.workload_status is not None
        assert state.output_status is not None and state.finalization_status is not None
        observation = Status.of("runtime_observation", "maintained")
        if state.observation_lost:
            observation = Status.of("runtime_observation", "lost", reason=state.observation_lost)
        result = SessionResult(
            cause=state.cause, workload_status=state.workload_status,
            workload_output_finalization_status=state.output_status,
            runtime_observation_status=observation,
            controller_finalization_status=state.finalization_status, cleanup_status=cleanup,
            recovery_action=RecoveryAction.NONE if cleanup.kind == "succeeded"
            else RecoveryAction.RECONCILE_NEXT_OPERATION)
        self.set(phase=next_phase(Phase.TERMINATING, Transition.FINISH),
                 session_result=result, step=Step.DELIVERING)
        if state.channel is not Channel.OPEN:
            self.set(result_delivered=False, result_acknowledged=False)
            self.begin_tail()
            return
        self.send(wire.Terminated(result=result))
        self.arm(Timer.ACKNOWLEDGEMENT)

    # -- the delivery tail ---------------------------------------------------------------------

    def begin_tail(self) -> None:
        """Close the channel, let the controller finish, then remove everything else: the
        whole of it within --cleanup-timeout, its parts within their shares (Timer)."""
        if self.state.controller_output is None:
            self.set(controller_output=self.config.requested_output)
        self.disarm(*self.state.armed)
        self.arm(Timer.TAIL, Timer.CHANNEL_CLOSE, Timer.CONTROLLER_STOP, Timer.CONTROLLER_KILL)
        self.set(step=Step.CLOSING_CHANNEL)
        if self.state.channel is Channel.OPEN:
            self.emit(Close(ClosePart.CHANNEL_WRITE))

    def end_channel_close(self, _timed_out: bool) -> None:
        if self.state.channel is Channel.OPEN:
            self.set(channel=Channel.GONE)
        self.emit(Close(ClosePart.CHANNEL))
        self.set(step=Step.FLUSHING_ATTACHMENT)  # the attachment may still be reading

    def end_attachment_flush(self, _timed_out: bool) -> None:
        state = self.state
        self.emit(Close(ClosePart.TERMINAL), Close(ClosePart.LISTENER))
        stopping = state.controller_started and Role.CONTROLLER in state.owned
        self.set(step=Step.STOPPING_CONTROLLER if stopping else Step.COPYING_LOG,
                 log_copied=not stopping)

    def end_controller_stop(self, timed_out: bool) -> None:
        self.set(step=Step.KILLING_CONTROLLER)
        if timed_out:
            self.emit(Log("the controller is still running after the session; stopping it"),
                      Kill(Role.CONTROLLER, "SIGKILL"))

    def end_controller_kill(self, _timed_out: bool) -> None:
        status = Status.of("process", "unavailable",
                           reason="the controller's exit was not observed")
        if self.state.controller_exit is not None:
            status = process_status(self.state.controller_exit)
        self.set(controller_status=status, step=Step.COPYING_LOG)
        self.emit(CopyControllerLog())

    def end_log_copy(self, _timed_out: bool) -> None:
        self.set(step=Step.REMOVING)
        self.remove(*(role for role in self.state.owned if role is not Role.HOLDER))

    def end_removal(self, timed_out: bool) -> None:
        self.tail_cleanup(timed_out)
        self.set(step=Step.REMOVING_HOLDER)  # last: others joined its namespace
        self.remove(Role.HOLDER)

    def end_holder_removal(self, timed_out: bool) -> None:
        self.tail_cleanup(timed_out)
        self.publish()

    def tail_cleanup(self, timed_out: bool) -> None:
        status = self.cleanup_status(timed_out)
        if status.kind != "succeeded":
            self.set(tail_failures=self.state.tail_failures + (status.reason or "remove containers",))

    def publish(self) -> None:
        """--output-file is published only after controller finalization completed."""
        state = self.state
        self.set(step=Step.PUBLISHING)
        if not (self.config.output_file and state.staged):
            self.remove_paths()
            return
        session = state.session_result
        if session is not None and session.controller_finalization_status.kind == "completed":
            self.emit(Publish())
            return
        self.set(controller_output=Status.of(
            "controller_output", "file-discarded",
            reason="controller output file was discarded because controller finalization "
                   "did not complete"))
        self.remove_paths()

    def on_published(self, event: Published) -> None:
        error = event.error
        if error is None:
            self.set(controller_output=Status.of("controller_output", "file-published"))
        else:
            self.set(error=PUBLISH_ERROR + error, controller_output=Status.of(
                "controller_output", "failed", reason="controller output publication failed"))
        self.remove_paths()

    def remove_paths(self) -> None:
        self.set(step=Step.REMOVING_PATHS)
        self.emit(RemovePaths())

    def finish(self, failures: tuple[str, ...]) -> None:
        state = self.state
        result = RunResult(
            error=state.error, session_result=state.session_result,
            result_delivered=state.result_delivered,
            result_acknowledged=state.result_acknowledged,
            controller_status=state.controller_status, controller_output=state.controller_output)
        if state.session_result is not None:
            result.delivery_tail_cleanup_status = (
                failed("cleanup", "; ".join(failures)) if failures else succeeded())
            result.delivery_tail_recovery_action = (
                RecoveryAction.RECONCILE_NEXT_OPERATION if failures else RecoveryAction.NONE)
        elif failures:  # planning's probe: the result has no cleanup phase to report it in
            result.error = "; ".join(filter(None, (
                result.error, f"cleanup failed: {'; '.join(failures)}")))
        self.disarm(*state.armed)
        self.set(step=Step.DONE)
        self.emit(Finish(result, keep_manifest=bool(failures)))


TAIL_STEPS = frozenset({Step.CLOSING_CHANNEL, Step.FLUSHING_ATTACHMENT,
                        Step.STOPPING_CONTROLLER, Step.KILLING_CONTROLLER, Step.COPYING_LOG,
                        Step.REMOVING, Step.REMOVING_HOLDER, Step.PUBLISHING,
                        Step.REMOVING_PATHS, Step.DONE})
#: How each step ends (by its condition, or timed out by its timer): STEP_TABLE's other half.
#: PLANNING, PREPARING, STARTING_HOLDER, ACTIVE and the last steps end by an event instead.
STEP_ENDS: dict[Step, Callable[[HostCore, bool], None]] = {
    Step.STARTING_CONTROLLER: HostCore.end_controller_start,
    Step.AWAITING_CHANNEL: HostCore.end_channel_wait,
    Step.AWAITING_ATTACHMENT: HostCore.end_attachment_wait,
    Step.DRAINING: HostCore.end_drain,
    Step.AWAITING_EXIT: HostCore.end_workload,
    Step.FINALIZING: HostCore.end_finalization,
    Step.REMOVING_WORKLOAD: HostCore.end_workload_removal,
    Step.DELIVERING: HostCore.end_delivery,
    Step.AWAITING_ACKNOWLEDGEMENT: HostCore.end_acknowledgement,
    Step.CLOSING_CHANNEL: HostCore.end_channel_close,
    Step.FLUSHING_ATTACHMENT: HostCore.end_attachment_flush,
    Step.STOPPING_CONTROLLER: HostCore.end_controller_stop,
    Step.KILLING_CONTROLLER: HostCore.end_controller_kill,
    Step.COPYING_LOG: HostCore.end_log_copy,
    Step.REMOVING: HostCore.end_removal,
    Step.REMOVING_HOLDER: HostCore.end_holder_removal,
}
#: Each event's handler: one per event type, so an event the core does not know cannot be fed.
HOST_EVENT_HANDLERS: dict[type, Callable[[HostCore, Any], None]] = {
    Deadline: HostCore.on_deadline, Planned: HostCore.on_planned,
    PlanFailed: HostCore.on_plan_failed, OutputPrepared: HostCore.on_output_prepared,
    Created: HostCore.on_created, Begin: HostCore.on_begin, Started: HostCore.on_started,
    EngineFailed: HostCore.on_engine_failed, ChannelConnected: HostCore.on_channel_connected,
    ChannelLost: HostCore.on_channel_lost, ChannelFlushed: HostCore.on_channel_flushed,
    Requested: HostCore.on_request, Attached: HostCore.on_attached,
    AttachmentRejected: HostCore.on_attachment_rejected, RelayObserved: HostCore.on_relay,
    WorkloadExited: HostCore.on_workload_exited, ObservationLost: HostCore.on_observation_lost,
    ControllerExited: HostCore.on_controller_exited, ControllerLog: HostCore.on_controller_log,
    HolderLost: HostCore.on_holder_lost, Signalled: HostCore.on_signal,
    Removed: HostCore.on_removed, LogCopied: HostCore.on_log_copied,
    Published: HostCore.on_published, PathsRemoved: HostCore.on_paths_removed,
    InternalError: HostCore.on_internal_error,
}


# ============================================================================================
# Pure core: a build's progress
# ============================================================================================
#
# The engine answers a build with a stream of JSON chunks: `stream`, the builder's text (a
# `Step N/M : INSTRUCTION` line as each step begins, its own notes, and what the step's
# commands print); `status`, the pull of a base image; `aux`, the built image's id; and, when
# the build fails, `error`. Nearly every word of it is the Dockerfile author's or the base
# image's: it reaches a person only as safe text, a line at a time.

#: The line the builder writes as a step begins.
_BUILD_STEP = re.compile(r"Step [0-9]+/[0-9]+ : .*", re.DOTALL)
#: The builder's own notes among a step's lines (` ---> Running in ID`, ` ---> IMAGE`,
#: `Removing intermediate container ID`): not the step's output.
_BUILDER_NOTE = re.compile(r"( ---> |Removing intermediate container ).*", re.DOTALL)
#: The colour codes the builder wraps what a step writes to stderr in: its markup, dropped.
BUILDER_STDERR_MARKS = ("\x1b[91m", "\x1b[0m")
#: A longer line is shown in pieces of this many characters (safe text holds at least that many
#: ASCII ones): all of it is seen, and a line that never ends is never held whole.
SHOWN_LINE_CHARS = wire.MAX_SAFE_TEXT_BYTES


@dataclass
class BuildProgress:
    """A build's stream, fed chunk by chunk in order: the lines to show as they complete, and
    what a failure is told with (the step that ran and the last lines it printed)."""

    partial: str = ""
    step: Optional[str] = None
    step_output: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=BUILD_TAIL_LINES))
    image_id: Optional[str] = None
    error: Optional[str] = None

    def feed(self, chunk: Any) -> list[str]:
        """The lines `chunk` completes, as safe text."""
        if not isinstance(chunk, dict):
            return []
        shown: list[str] = []
        if isinstance(chunk.get("stream"), str):
            *lines, partial = (self.partial + chunk["stream"]).split("\n")
            held = len(partial) % SHOWN_LINE_CHARS  # of a line not ended yet, all but this
            lines.append(partial[:len(partial) - held])  # shows now, in whole pieces
            self.partial = partial[len(partial) - held:]
            shown += self._lines(lines)
        if isinstance(chunk.get("status"), str) and "progress" not in chunk:  # no bar updates
            shown += self._lines([" ".join(str(chunk[key]) for key in ("id", "status")
                                           if chunk.get(key))])
        aux = chunk.get("aux")
        if isinstance(aux, dict) and isinstance(aux.get("ID"), str):
            self.image_id = aux["ID"]
        if "error" in chunk:
            self.error = wire.safe_text(str(chunk["error"]))
        return shown

    def end(self) -> list[str]:
        """The last line, when the stream ended without its newline."""
        lines, self.partial = [self.partial], ""
        return self._lines(lines)

    def failure(self, error: str) -> str:
        """A failed build in words: where it failed, `error`, and the last lines the failing
        step printed (at most BUILD_TAIL_LINES lines and BUILD_TAIL_BYTES bytes)."""
        words = error if self.step is None else f"failed at {self.step}: {error}"
        tail: list[str] = []
        size = 0
        for line in reversed(self.step_output):
            size += len(line.encode()) + 3  # indented, on a line of its own
            if size > BUILD_TAIL_BYTES:
                break
            tail.insert(0, f"  {line}")
        return "\n".join([f"{words}; its last output:" if tail else words, *tail])

    def _lines(self, lines: list[str]) -> list[str]:
        """`lines` as shown: each in pieces of at most SHOWN_LINE_CHARS, blank ones left out."""
        shown = []
        for line in lines:
            for mark in BUILDER_STDERR_MARKS:
                line = line.replace(mark, "")
            for piece in (line[start:start + SHOWN_LINE_CHARS]
                          for start in range(0, len(line), SHOWN_LINE_CHARS)):
                if piece.strip():
                    shown.append(self._note(piece))
        return shown

    def _note(self, piece: str) -> str:
        """Keep track of the step a shown piece begins, or of the step's output it is."""
        text = wire.safe_text(piece)
        if _BUILD_STEP.fullmatch(piece):
            self.step = text
            self.step_output.clear()
        elif not _BUILDER_NOTE.fullmatch(piece):
            self.step_output.append(text)
        return text


def unshown(line: str) -> None:
    """Where a build's lines go when nobody is to see them (`build -q`, the derived image)."""


# ============================================================================================
# Docker adapter: sandboxed container specs (pure) and the engine calls
# ============================================================================================


@dataclass(frozen=True)
class Mount:
    host_path: str
    container_path: str
    read_only: bool


@dataclass(frozen=True)
class ContainerSpec:
    """Everything needed to create one sandboxed session container. Pure data."""

    role: str  # "controller" | "workload" | "holder" | "python-probe" | serve's "managed"
    image_id: str
    #: Exactly what runs: the image's own ENTRYPOINT and CMD never apply (create_kwargs).
    command: tuple[str, ...]
    runtime: Runtime
    environment: dict[str, str]
    labels: dict[str, str]
    #: NETWORK_NONE, or "container:<holder id>" to join a granted session's namespace (the
    #: Engine then refuses a hostname or extra hosts of the joining container's own).
    network_mode: str = NETWORK_NONE
    extra_hosts: tuple[tuple[str, str], ...] = ()  # (name, address) in /etc/hosts
    mounts: tuple[Mount, ...] = ()
    tty: bool = False
    hostname: Optional[str] = None
    init: bool = False
    #: The TTY's (columns, rows) at creation. The Engine API's HostConfig.ConsoleSize; Docker
    #: 20.10 stores it but leaves a Linux container's PTY at 0x0 until the first resize, so
    #: the host also resizes right after start (see ControlledSession.start).
    console_size: Optional[tuple[int, int]] = None
    #: The first process is a supervisor that starts the workload as the runtime uid:gid and
    #: must stay out of its reach (a managed session's agent.py, given --runtime-user): it runs
    #: as 0:0 keeping SUPERVISOR_CAPABILITIES and nothing else; HOME and the writable paths
    #: still belong to the runtime uid:gid.
    root_supervisor: bool = False
    #: Fair share among containers: a CPU bound (the Engine's NanoCpus, 1e9 per core) and a
    #: block-I/O weight (BlkioWeight, 10..1000); None leaves the Engine's defaults.
    nano_cpus: Optional[int] = None
    blkio_weight: Optional[int] = None

    def create_kwargs(self, api: docker.APIClient) -> dict[str, Any]:
        """The Engine API arguments. Every sandbox property is set here and nowhere else.

        The command is the container's whole entrypoint, with no arguments of the image's: the
        Engine fills in an image's ENTRYPOINT only when the request's is empty, and its CMD
        only then, so neither ever applies (an image with ENTRYPOINT ["python3", "app.py"]
        would otherwise run `python3 app.py /bin/sh`). Nor does its HEALTHCHECK, which would
        run commands of the image's in the container."""
        uid, gid = self.runtime.uid, self.runtime.gid
        # HOME is 0700 only on a fresh mount point: runc before 1.1.8 gives a tmpfs the mode of
        # a directory already there (opencontainers/runc#3911), so no working directory is
        # set, which the Engine would make at HOME (0755) before the mount.
        tmpfs = {CONTAINER_HOME: f"rw,nosuid,nodev,size={HOME_TMPFS_SIZE},mode=0700,uid={uid},gid={gid}"}
        for path in self.runtime.writable_paths:
            tmpfs[path] = f"rw,nosuid,nodev,size=256m,mode=0755,uid={uid},gid={gid}"
        host_config = api.create_host_config(
            read_only=True,
            cap_drop=["ALL"],
            cap_add=list(SUPERVISOR_CAPABILITIES) if self.root_supervisor else None,
            security_opt=["no-new-privileges:true"],
            privileged=False,
            tmpfs=tmpfs,
            binds={m.host_path: {"bind": m.container_path, "mode": "ro" if m.read_only else "rw"}
                   for m in self.mounts},
            network_mode=self.network_mode,
            extra_hosts=dict(self.extra_hosts) or None,
            pids_limit=self.runtime.pids,
            nano_cpus=self.nano_cpus,
            blkio_weight=self.blkio_weight,
            mem_limit=f"{self.runtime.memory_mib}m",
            memswap_limit=f"{self.runtime.memory_mib}m",
            ipc_mode="private",
            init=self.init,
            log_config=docker.types.LogConfig(type="json-file",
                                              config={"max-size": "1m", "max-file": "1"})
            if not self.tty else docker.types.LogConfig(type="none", config={}),
        )
        if self.console_size is not None:
            columns, rows = self.console_size
            host_config["ConsoleSize"] = [rows, columns]
        return dict(
            image=self.image_id,
            entrypoint=list(self.command),
            command=[],
            healthcheck={"Test": ["NONE"]},
            user="0:0" if self.root_supervisor else self.runtime.user,
            environment=dict(self.environment),
            labels=dict(self.labels),
            host_config=host_config,
            tty=self.tty,
            stdin_open=self.tty,
            hostname=self.hostname,
        )


def security_options(info: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The engine's /info SecurityOptions by name: `name=seccomp,profile=default` becomes
    {"seccomp": {"profile": "default"}}; an old engine's bare `seccomp` has no settings."""
    options: dict[str, dict[str, str]] = {}
    for entry in info.get("SecurityOptions") or []:
        fields_ = dict(part.partition("=")[::2] for part in str(entry).split(","))
        name = fields_.pop("name", None)
        options[name or str(entry)] = {} if name is None else fields_
    return options


def sandbox_refusal(info: dict[str, Any], local: bool, host_platform: str) -> Optional[str]:
    """Why an engine cannot hold the sandbox, or None: the host must be Linux and reach the
    engine through a local unix socket (the channel is a unix socket bind-mounted from this
    host, and its peer's credentials are checked); the engine must run Linux containers under
    a seccomp profile that filters (rootless or not). Pure: the engine's /info, how it is
    reached, the host's sys.platform."""
    if host_platform != "linux":
        return f"the host runs {host_platform}, not Linux"
    if not local:
        return ("it is not reached through a local unix socket (a remote engine cannot share "
                "this host's files and sockets)")
    os_type = info.get("OSType")
    if os_type != "linux":
        return f"it runs {os_type or 'unknown'} containers, not Linux ones"
    seccomp = security_options(info).get("seccomp")
    if seccomp is None:
        return "it has no seccomp support"
    if seccomp.get("profile") == "unconfined":
        return "its default seccomp profile is unconfined"
    return None


def kill_if_running(api: docker.APIClient, container_id: str, signame: str) -> None:
    """Signal a container; one that is gone (404) or no longer running (409) has nothing
    left to signal, which is what a kill wants: not an error."""
    try:
        api.kill(container_id, signal=signame)
    except docker.errors.APIError as e:
        if e.status_code not in (404, 409):
            raise


def remove_container_quietly(api: docker.APIClient, container_id: str) -> None:
    """Force-remove a container; one already gone is removed, one whose removal someone else
    started (409) is removed once that finishes."""
    try:
        api.remove_container(container_id, force=True, v=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as e:
        if e.status_code != 409:
            raise
        with contextlib.suppress(docker.errors.NotFound):
            api.wait(container_id, condition="removed")


#: Go's fs.FileMode bits in the Engine's path stat: a symlink, and every kind but a file.
GO_MODE_SYMLINK = 1 << 27
GO_MODE_TYPE = (1 << 31) | GO_MODE_SYMLINK | (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)


@dataclass(frozen=True)
class PathStat:
    """The Engine's X-Docker-Container-Path-Stat: base64 of a JSON object."""
    mode: int
    link_target: str

    @classmethod
    def parse(cls, header: str) -> "PathStat":
        try:
            document = json.loads(base64.b64decode(header, validate=True))
        except ValueError as e:  # binascii.Error and JSONDecodeError among them
            raise BackendError(f"the Engine's path stat is not base64 JSON: {e}") from e
        if not isinstance(document, dict):
            raise BackendError("the Engine's path stat is not an object")
        mode, target = document.get("mode"), document.get("linkTarget", "")
        if type(mode) is not int or not isinstance(target, str):
            raise BackendError("the Engine's path stat has no integer mode or string linkTarget")
        return cls(mode, target)


def _docker_call(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap SDK and transport failures in BackendError naming the operation."""

    def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return func(*args, **kwargs)
            except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
                raise BackendError(f"{what}: {e}") from e

        inner.__name__ = func.__name__
        inner.__doc__ = func.__doc__
        return inner

    return wrap


class DockerBackend:
    """The only code that talks to the Engine. The client is a seam for tests."""

    def __init__(self, client: Optional[docker.DockerClient] = None) -> None:
        try:
            self.client = client or docker.from_env(timeout=120)
            self.client.ping()
        except docker.errors.DockerException as e:
            raise BackendError(f"no Docker engine answers: {e}") from e
        self.api: docker.APIClient = self.client.api
        self.warned: set[str] = set()  # the Engine's warnings already logged (see create)

    @_docker_call("check the engine's sandbox support")
    def require_sandbox_support(self) -> str:
        """Fail closed when the engine cannot hold the sandbox (sandbox_refusal says why);
        otherwise a digest of what in its configuration the sandbox depends on, which keys
        the python probe's verdict (a reconfigured engine is probed again)."""
        info = self.client.info()
        adapter = self.api.get_adapter(self.api.base_url)
        refusal = sandbox_refusal(info, isinstance(adapter, docker.transport.UnixHTTPAdapter),
                                  sys.platform)
        if refusal is not None:
            raise BackendError(f"refusing this Docker engine: {refusal}")
        facts = [info.get(key) for key in ("ID", "ServerVersion", "KernelVersion", "OSType")]
        facts.append(sorted(info.get("SecurityOptions") or []))
        return hashlib.sha256(json.dumps(facts).encode()).hexdigest()

    @_docker_call("inspect image")
    def image_exists(self, image_id: str) -> bool:
        try:
            self.api.inspect_image(image_id)
            return True
        except docker.errors.ImageNotFound:
            return False

    @_docker_call("build image")
    def build(self, show: Callable[[str], None] = unshown, **kwargs: Any) -> str:
        """Build an image and return its id; each line of the build's output goes to `show`, as
        safe text, as it comes. A failure names the step and carries its last lines."""
        progress = BuildProgress()
        for chunk in self.api.build(rm=True, forcerm=True, pull=False, decode=True, **kwargs):
            for line in progress.feed(chunk):
                show(line)
        for line in progress.end():
            show(line)
        if progress.error is not None:
            raise BackendError(f"build image: {progress.failure(progress.error)}")
        if progress.image_id is None:
            raise BackendError("the engine built an image without an id")
        return progress.image_id

    @_docker_call("inspect image labels")
    def image_labels(self, reference: str) -> Optional[dict[str, str]]:
        try:
            return self.api.inspect_image(reference)["Config"].get("Labels") or {}
        except docker.errors.ImageNotFound:
            return None

    @_docker_call("tag image")
    def tag_image(self, image_id: str, reference: str) -> None:
        repository, tag = reference.rsplit(":", 1)
        self.api.tag(image_id, repository, tag, force=True)

    @_docker_call("remove image")
    def remove_image(self, reference: str) -> None:
        with contextlib.suppress(docker.errors.ImageNotFound):
            self.api.remove_image(reference, force=True)

    @_docker_call("create container")
    def create(self, spec: ContainerSpec) -> str:
        """The new container's id. What the Engine warns of (a bound it had to discard, such as
        a blkio weight its kernel cannot apply) goes to stderr, once per warning and process.
        An image the Engine does not have is ImageGone: callers need not ask first."""
        try:
            reply = self.api.create_container(**spec.create_kwargs(self.api))
        except docker.errors.ImageNotFound as e:
            raise ImageGone(f"create container: the Engine has no image {spec.image_id}") from e
        for warning in reply.get("Warnings") or []:
            if warning not in self.warned:
                self.warned.add(warning)
                log(f"the Docker engine warns: {warning}")
        return reply["Id"]

    @_docker_call("attach to the workload")
    def attach_pty(self, container_id: str) -> socket.socket:
        """The hijacked attach stream of a TTY container: the PTY itself, as a raw socket."""
        raw = self.api.attach_socket(
            container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
        sock = getattr(raw, "_sock", raw)
        sock.setblocking(False)
        # Keep the HTTP response alive with the socket; it owns the connection.
        return sock

    @_docker_call("check the workload's shell")
    def unexecutable(self, container_id: str, path: str) -> Optional[str]:
        """Why `path` cannot be the command of the created container, or None. Under the
        Engine's init a container starts whatever its command, and the init's failed exec is
        an exit like any other: this keeps seed 000's startup failure for an image without
        it. (A file that is there but still cannot run stays the init's exit 126 or 127.)"""
        stat = self.path_stat(container_id, path)
        if stat is not None and stat.mode & GO_MODE_SYMLINK:
            stat = self.path_stat(container_id, stat.link_target)
        if stat is None:
            return f"the image has no {path}"
        if stat.mode & GO_MODE_TYPE or not stat.mode & 0o111:
            return f"the image's {path} is not an executable file"
        return None

    def path_stat(self, container_id: str, path: str) -> Optional[PathStat]:
        """The Engine's stat of `path` in the container's filesystem (a symlink's target
        resolved inside it), or None when there is nothing there. The SDK has no HEAD call."""
        api = self.api
        reply = api.head(f"{api.base_url}/v{api.api_version}/containers/{container_id}/archive",
                         params={"path": path})
        if reply.status_code == 404:
            return None
        reply.raise_for_status()
        return PathStat.parse(reply.headers.get("X-Docker-Container-Path-Stat", ""))

    @_docker_call("start container")
    def start(self, container_id: str) -> None:
        self.api.start(container_id)

    @_docker_call("resize the workload PTY")
    def resize(self, container_id: str, columns: int, rows: int) -> None:
        self.api.resize(container_id, height=rows, width=columns)

    @_docker_call("signal container")
    def kill(self, container_id: str, signame: str) -> None:
        kill_if_running(self.api, container_id, signame)

    @_docker_call("read controller logs")
    def log_tail(self, container_id: str) -> bytes:
        data = self.api.logs(container_id, stdout=True, stderr=True)
        return data[-CONTROLLER_LOG_TAIL_BYTES:]

    @_docker_call("remove container")
    def remove_container(self, container_id: str) -> None:
        remove_container_quietly(self.api, container_id)

    @_docker_call("list containers")
    def list_containers(self, labels: list[str]) -> list[dict[str, Any]]:
        return self.api.containers(all=True, filters={"label": labels})

    @_docker_call("inspect container")
    def container_state(self, container_id: str) -> Optional[dict[str, Any]]:
        """The container's State, or None when it no longer exists."""
        try:
            return self.api.inspect_container(container_id)["State"]
        except docker.errors.NotFound:
            return None

    @_docker_call("pause container")
    def pause(self, container_id: str) -> None:
        self.api.pause(container_id)

    @_docker_call("unpause container")
    def unpause(self, container_id: str) -> None:
        """Idempotent: a container that is not paused, or gone, is left as it is."""
        try:
            self.api.unpause(container_id)
        except docker.errors.APIError as e:
            if e.status_code not in (404, 409, 500) or (
                    e.status_code == 500 and "not paused" not in str(e)):
                raise

    def in_thread(self, tag: str, call: Callable[[docker.APIClient], Any],
                  report: Callable[[str, Any], None]) -> threading.Thread:
        """Run a blocking Engine call off the loop, on its own connection; report (tag, value),
        the value being the call's result, or the ReployError it raised (any other failure
        becomes a BackendError)."""
        api = docker.APIClient(version=self.api.api_version,
                               timeout=None,  # type: ignore[arg-type]  # None: no timeout
                               **docker.utils.kwargs_from_env())

        def run() -> None:
            try:
                report(tag, call(api))
            except ReployError as e:  # a BackendError, or a verdict such as PlanRejected
                report(tag, e)
            except Exception as e:  # noqa: BLE001 - any failure is reported, never lost
                report(tag, BackendError(f"{tag}: {e}"))
            finally:
                api.close()

        thread = threading.Thread(target=run, name=tag, daemon=True)
        thread.start()
        return thread

    def wait_in_thread(self, container_id: str, report: Callable[[str, Any], None],
                       tag: str) -> threading.Thread:
        """Observe the container's exit without blocking the loop; report (tag, code | error)."""

        def observe(api: docker.APIClient) -> int:
            reply = api.wait(container_id, timeout=None)
            # An exit caused by someone else removing the container is not the container's
            # own exit: the session lost sight of it.
            try:
                state = api.inspect_container(container_id)["State"]
            except docker.errors.NotFound:
                state = {"Status": "removed"}
            if state.get("Status") in ("removing", "removed") or state.get("Dead"):
                raise BackendError(f"the {tag} container was removed behind the session")
            return int(reply["StatusCode"])

        return self.in_thread(tag, observe, report)


# ============================================================================================
# Deployments: stage and build
# ============================================================================================


def load_blueprint_file(path: Path) -> tuple[Blueprint, bytes]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise BlueprintError(f"{path}: {e.strerror}") from e
    try:
        doc = yaml.load(raw, Loader=BLUEPRINT_LOADER)
    except yaml.YAMLError as e:
        raise BlueprintError(f"{path}: not valid YAML: {e}") from e
    return parse_blueprint(doc), raw


@dataclass(frozen=True)
class Generation:
    """One build: its image and the exact blueprint it was built from.

    `blueprint_text` is that blueprint as recorded at build time (its sha256 is
    `blueprint_digest`). A session takes everything that grants or refuses authority from
    it (commands, executables, endpoints, the runtime: uid:gid, writable paths, limits; the
    private environment), never from the staging directory's current files, which may have
    changed since without a rebuild. State written before these were recorded has None here.
    """

    number: int
    image_id: str
    reference: str
    blueprint_digest: str
    built_at: float
    blueprint_text: Optional[str] = None
    #: Whether it was built with a private environment (a `.env` beside the blueprint, or
    #: environment.private_env); None in state written before Reploy recorded it.
    private_env: Optional[bool] = None


#: state.json: each key with the type its value must have (None: may also be null).
STATE_FIELDS: dict[str, tuple[type, ...]] = {
    "schema": (str,), "deployment_id": (str,), "current_generation": (dict, type(None)),
    "staged_blueprint_digest": (str,)}
GENERATION_FIELDS: dict[str, tuple[type, ...]] = {
    "number": (int,), "image_id": (str,), "reference": (str,), "blueprint_digest": (str,),
    "built_at": (int, float), "blueprint_text": (str,), "private_env": (bool,)}
_DEPLOYMENT_ID = re.compile(r"[0-9a-f]{32}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Deployment:
    """A staging directory: its blueprint, identity and current generation (if built)."""

    dir: Path
    deployment_id: str
    blueprint: Blueprint
    blueprint_digest: str
    current: Optional[Generation]

    @property
    def state_dir(self) -> Path:
        return self.dir / STATE_DIRNAME

    @property
    def has_private_env(self) -> bool:
        """Whether the current generation was built with a private environment; for one
        recorded before Reploy kept that (or none at all), what the staging directory holds."""
        if self.current is not None and self.current.private_env is not None:
            return self.current.private_env
        return self.blueprint.private_env or (self.dir / PRIVATE_ENV_NAME).exists()

    def built_blueprint(self) -> Blueprint:
        """The blueprint of the current generation, the authority for a session.

        A generation recorded before blueprints were kept with it is used only while the
        staged blueprint is provably the one it was built from (same digest)."""
        generation = self.current
        if generation is None:
            raise DeploymentError(f"{self.dir} has no built generation (run reploy build)")
        if generation.blueprint_text is None:
            if generation.blueprint_digest != self.blueprint_digest:
                raise DeploymentError(
                    f"{self.dir}: the current generation was built by an older reploy that did "
                    "not record its blueprint, and blueprint.yaml changed since; run reploy "
                    "build to record a generation of the current blueprint")
            return self.blueprint
        raw = generation.blueprint_text.encode()
        if hashlib.sha256(raw).hexdigest() != generation.blueprint_digest:
            raise DeploymentError(f"{state_path(self.dir)}: the recorded blueprint does not "
                                  "match its digest")
        try:
            return parse_blueprint(yaml.load(raw, Loader=BLUEPRINT_LOADER))
        except (yaml.YAMLError, BlueprintError) as e:
            raise DeploymentError(f"{state_path(self.dir)}: the recorded blueprint is "
                                  f"invalid: {e}") from e


def state_path(directory: Path) -> Path:
    return directory / STATE_DIRNAME / "state.json"


def _check_fields(obj: Any, fields_: dict[str, tuple[type, ...]], required: set[str],
                  where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise DeploymentError(f"{where}: must be a JSON object")
    unknown = set(obj) - set(fields_)
    if unknown:
        raise DeploymentError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    missing = required - set(obj)
    if missing:
        raise DeploymentError(f"{where}: missing key(s) {', '.join(sorted(missing))}")
    for key, value in obj.items():
        if not isinstance(value, fields_[key]) or (
                isinstance(value, bool) and bool not in fields_[key]):
            raise DeploymentError(f"{where}: {key} has the wrong type")
    return obj


def read_state(directory: Path) -> dict[str, Any]:
    """state.json, validated key by key; anything else is a DeploymentError naming the file."""
    path = state_path(directory)
    try:
        state = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise DeploymentError(f"{directory} is not a staging deployment (run reploy stage)") from None
    except (OSError, ValueError) as e:
        raise DeploymentError(f"{path}: unreadable state: {error_text(e)}") from e
    _check_fields(state, STATE_FIELDS, {"schema", "deployment_id", "current_generation"},
                  str(path))
    if state["schema"] != STATE_SCHEMA:
        raise DeploymentError(f"{path}: unknown state schema")
    if not _DEPLOYMENT_ID.fullmatch(state["deployment_id"]):
        raise DeploymentError(f"{path}: deployment_id is not 32 hex digits")
    generation = state["current_generation"]
    if generation is not None:
        _check_fields(generation, GENERATION_FIELDS,
                      set(GENERATION_FIELDS) - {"blueprint_text", "private_env"},
                      f"{path}: current_generation")
        if not _SHA256.fullmatch(generation["blueprint_digest"]):
            raise DeploymentError(f"{path}: current_generation.blueprint_digest is not a sha256")
    return state


def load_deployment(directory: Path) -> Deployment:
    directory = directory.resolve()
    state = read_state(directory)
    blueprint, raw = load_blueprint_file(directory / BLUEPRINT_NAME)
    current = state["current_generation"]
    return Deployment(
        dir=directory,
        deployment_id=state["deployment_id"],
        blueprint=blueprint,
        blueprint_digest=hashlib.sha256(raw).hexdigest(),
        current=Generation(**current) if current else None,
    )


def stage(blueprint_path: Path, directory: Path) -> dict[str, Any]:
    """Make `directory` a self-contained staging deployment of the blueprint.

    Re-staging into the same directory keeps its deployment id and generations; a directory
    that holds anything else is refused rather than overwritten.
    """
    blueprint, raw = load_blueprint_file(blueprint_path)
    source_dir = blueprint_path.resolve().parent
    context = (source_dir / blueprint.context).resolve()
    if not (context / blueprint.dockerfile).is_file():
        raise BlueprintError(f"build.dockerfile: {context / blueprint.dockerfile} does not exist")
    directory = directory.resolve()
    state: dict[str, Any] = {"schema": STATE_SCHEMA, "deployment_id": secrets.token_hex(16),
                             "current_generation": None}
    if directory.exists():
        if state_path(directory).exists():
            state = read_state(directory)
        elif any(directory.iterdir()):
            raise DeploymentError(f"{directory} exists, is not empty and is not a staging deployment")
    directory.mkdir(parents=True, exist_ok=True)
    staged_context = directory / CONTEXT_DIRNAME
    tmp_context = directory / f".{CONTEXT_DIRNAME}.{secrets.token_hex(4)}"
    shutil.copytree(context, tmp_context, symlinks=True,
                    ignore=shutil.ignore_patterns(STATE_DIRNAME, PRIVATE_ENV_NAME))
    if staged_context.exists():
        shutil.rmtree(staged_context)
    os.replace(tmp_context, staged_context)
    (directory / BLUEPRINT_NAME).write_bytes(raw)
    private_env = source_dir / PRIVATE_ENV_NAME
    if private_env.exists():
        shutil.copy2(private_env, directory / PRIVATE_ENV_NAME)
        os.chmod(directory / PRIVATE_ENV_NAME, 0o600)
    state["staged_blueprint_digest"] = hashlib.sha256(raw).hexdigest()
    reploy_watchdog.atomic_write_json(state_path(directory), state, mode=0o644)
    return {"schema": STAGE_SCHEMA, "ok": True, "error": None, "dir": str(directory),
            "deployment_id": state["deployment_id"], "name": blueprint.name,
            "blueprint_digest": state["staged_blueprint_digest"],
            "private_env": blueprint.private_env or private_env.exists()}


def build(directory: Path, backend: DockerBackend,
          show: Callable[[str], None] = unshown) -> dict[str, Any]:
    """Build the staged context and record it as the new current generation, atomically,
    together with the exact blueprint it was built from. The build's lines go to `show`."""
    deployment = load_deployment(directory)
    # One read: the text recorded with the generation is exactly the one that was built.
    blueprint, raw = load_blueprint_file(deployment.dir / BLUEPRINT_NAME)
    try:
        blueprint_text = raw.decode()
    except UnicodeDecodeError as e:
        raise BlueprintError(f"{deployment.dir / BLUEPRINT_NAME}: not UTF-8") from e
    number = 1 + (deployment.current.number if deployment.current else 0)
    reference = f"reploy/{blueprint.name}:{deployment.deployment_id[:12]}-g{number}"
    image_id = backend.build(
        show,
        path=str(deployment.dir / CONTEXT_DIRNAME),
        dockerfile=blueprint.dockerfile,
        tag=reference,
        labels={LABEL_DEPLOYMENT: deployment.deployment_id, LABEL_GENERATION: str(number)},
    )
    generation = Generation(number, image_id, reference, hashlib.sha256(raw).hexdigest(),
                            time.time(), blueprint_text, private_env=blueprint.private_env
                            or (deployment.dir / PRIVATE_ENV_NAME).exists())
    state = read_state(deployment.dir)
    state["current_generation"] = generation.__dict__
    reploy_watchdog.atomic_write_json(state_path(deployment.dir), state, mode=0o644)
    summary = {k: v for k, v in generation.__dict__.items() if k != "blueprint_text"}
    return {"schema": BUILD_SCHEMA, "ok": True, "error": None, "dir": str(deployment.dir),
            "deployment_id": deployment.deployment_id, "generation": summary}


# ============================================================================================
# Directories a container can write: how the host touches them
# ============================================================================================
#
# A managed session's directory is bind-mounted read-write into its container, where untrusted
# code runs as the runtime uid (and so is a controlled session's output staging dir, in its
# controller). Any entry there may, at any moment, be a symlink to any host path, a FIFO, a
# socket, or a directory where a file belongs. (A hard link cannot bring a host file in: link(2)
# across mounts fails with EXDEV, so only entries of the same directory can be linked.) The host,
# often root, touches such a directory only through these helpers:
#
#   - The directory is opened by a path the host owns (STATE/sessions/ID: its parent is ours, so
#     the container cannot rename it) with O_NOFOLLOW; each entry is then one name relative to
#     that fd, never a path string.
#   - A file is opened O_NOFOLLOW|O_NONBLOCK (a symlink is refused, a FIFO does not block the
#     open) and used only after fstat on that fd says it is a regular file.
#   - A socket is opened O_PATH|O_NOFOLLOW, checked on that fd and connected through
#     /proc/self/fd/N (agent.connect_unix_at): the very inode checked.
#   - Entries are removed without following them, trees fd by fd and without recursion.
#
# Whatever else a container leaves there fails that session's step with an error naming the
# entry; it never stops the host, and no byte behind a link is ever read.


def container_path_rules() -> ModuleType:
    """agent.py, whose rules for entries a container can write these helpers follow. Imported
    on first use, not as the host starts: compiling its 6,000 lines would sit on every
    session's way to `ready`, and only a session with --output-file ever publishes."""
    import agent
    return agent


class ContainerPathError(OSError):
    """An entry a container could write is not what the host expects (a symlink, a FIFO...)."""


def _not_expected(name: str, mode: int, expected: str) -> ContainerPathError:
    kind = container_path_rules().file_type(mode)
    return ContainerPathError(errno.EINVAL, f"{name} is a {kind}, not {expected}")


@contextlib.contextmanager
def opened_dir(path: Path) -> Iterator[int]:
    """The directory at `path` (whose own path the host owns), not followed if it is a link."""
    fd = os.open(path, container_path_rules().DIR_OPEN_FLAGS)
    try:
        yield fd
    finally:
        os.close(fd)


def open_regular_file(dir_fd: int, name: str) -> int:
    """`name` of a directory opened for reading, only when it is a regular file itself."""
    try:
        fd = os.open(name, container_path_rules().FILE_READ_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENXIO):  # a symlink; a socket
            raise
        st = container_path_rules().lstat_at(dir_fd, name)
        if st is None:
            raise
        raise _not_expected(name, st.st_mode, "a regular file") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_expected(name, mode, "a regular file")
    return fd


def regular_file_size(dir_fd: int, name: str) -> Optional[int]:
    """The size of the regular file `name` of a directory; None when there is no such entry."""
    st = container_path_rules().lstat_at(dir_fd, name)
    if st is None:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise _not_expected(name, st.st_mode, "a regular file")
    return st.st_size


def publish_regular_file(staging: Path, destination: Path) -> None:
    """Hard-links the regular file DESTINATION.name of a staging dir at DESTINATION, never
    clobbering (FileExistsError). The entry is checked on an fd, and the link kept only if it
    is that very inode: one swapped in between (by a controller that outlived its removal) is
    unlinked again."""
    with opened_dir(staging) as staging_fd:
        fd = open_regular_file(staging_fd, destination.name)
        try:
            os.link(destination.name, destination, src_dir_fd=staging_fd, follow_symlinks=False)
            linked = os.stat(destination, follow_symlinks=False)
            if (linked.st_dev, linked.st_ino) != reploy_watchdog.fd_identity(fd):
                os.unlink(destination)
                raise ContainerPathError(errno.ESTALE, f"{destination.name} changed while it was "
                                                       "published")
        finally:
            os.close(fd)


# ============================================================================================
# The controlled session: plan and admission
# ============================================================================================


@dataclass(frozen=True)
class RunOptions:
    controller_dir: Path
    workload_dir: Path
    endpoints: tuple[str, ...]
    columns: int
    rows: int
    output_file: Optional[Path]
    output_dir: Optional[Path]
    timeouts_ms: dict[str, int]
    command: tuple[str, ...]

    def timeout_s(self, flag: str) -> float:
        return self.timeouts_ms[flag] / 1000.0


@dataclass(frozen=True)
class SessionPlan:
    """What planning decided from the built generations: exact images, the controller argv,
    the granted endpoints, and the blueprints (of those generations) that authorise them."""

    run_id: str
    controller: Deployment
    workload: Deployment
    controller_blueprint: Blueprint
    workload_blueprint: Blueprint
    controller_argv: tuple[str, ...]
    endpoints: tuple[wire.Endpoint, ...]


def _require_utf8_path(flag: str, path: Optional[Path]) -> None:
    """Paths end up in labels, manifests and the JSON result, which carry only UTF-8."""
    if path is None:
        return
    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError:
        raise AdmissionError(f"{flag}: {printable(str(path))} is not a UTF-8 path") from None


def admit(options: RunOptions) -> tuple[Deployment, Deployment]:
    """Check the request itself, before anything is planned: the two deployment directories
    and the output destination. Raises AdmissionError."""
    for flag, path in (("--controller-dir", options.controller_dir),
                       ("--workload-dir", options.workload_dir),
                       ("--output-dir", options.output_dir),
                       ("--output-file", options.output_file)):
        _require_utf8_path(flag, path)
    try:
        controller = load_deployment(options.controller_dir)
        workload = load_deployment(options.workload_dir)
    except (DeploymentError, BlueprintError) as e:
        raise AdmissionError(str(e)) from e
    if controller.dir == workload.dir or controller.deployment_id == workload.deployment_id:
        raise AdmissionError("the controller and the workload resolve to the same deployment")
    for role, deployment in (("controller", controller), ("workload", workload)):
        if deployment.current is None:
            raise AdmissionError(f"the {role} deployment {deployment.dir} has no built generation "
                                 "(run reploy build)")
        if deployment.has_private_env:
            raise AdmissionError(f"the {role} deployment {deployment.dir} was built with a "
                                 "private environment; controlled sessions do not support it")
    if options.output_file is not None:
        parent = output_path_stat("--output-file", options.output_file.parent, follow=True)
        if parent is None or not stat.S_ISDIR(parent.st_mode):
            raise AdmissionError(f"--output-file: {options.output_file.parent} is not a directory")
        if output_path_stat("--output-file", options.output_file, follow=False) is not None:
            raise AdmissionError(f"--output-file: {options.output_file} already exists")
    if options.output_dir is not None:  # created at preparation, under its nearest existing path
        existing = next(path for path in (options.output_dir, *options.output_dir.parents)
                        if output_path_stat("--output-dir", path, follow=False) is not None)
        found = output_path_stat("--output-dir", existing, follow=True)
        if found is None or not stat.S_ISDIR(found.st_mode):
            raise AdmissionError(f"--output-dir: {existing} exists and is not a directory")
        if existing != options.output_dir and not os.access(existing, os.W_OK | os.X_OK):
            raise AdmissionError(f"--output-dir: cannot create {options.output_dir} in "
                                 f"{existing}: Permission denied")
    return controller, workload


def output_path_stat(flag: str, path: Path, follow: bool) -> Optional[os.stat_result]:
    """The status of an output path (or of the link itself), None when nothing is there;
    anything else, such as a parent this host may not search, refuses the request, naming
    the path (not `internal error: PermissionError`)."""
    try:
        return os.stat(path, follow_symlinks=follow)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise AdmissionError(f"{flag}: cannot reach {path}: {e.strerror or e}") from None


def writable_by(st: os.stat_result, uid: int, gid: int) -> bool:
    """Whether uid:gid may add entries to a directory with this owner and mode, by its
    permission bits (the class that applies: owner, group or other); ACLs and supplementary
    groups are not considered."""
    if st.st_uid == uid:
        return st.st_mode & 0o300 == 0o300
    if st.st_gid == gid:
        return st.st_mode & 0o030 == 0o030
    return st.st_mode & 0o003 == 0o003


def plan(options: RunOptions, controller: Deployment, workload: Deployment) -> SessionPlan:
    """Resolve the session from the current generations' own blueprints (never the staged
    blueprint.yaml, which may have changed without a rebuild). Raises PlanRejected."""
    try:
        controller_blueprint = controller.built_blueprint()
        workload_blueprint = workload.built_blueprint()
        command, args = controller_blueprint.resolve_command(list(options.command))
    except (DeploymentError, AdmissionError) as e:
        raise PlanRejected(str(e)) from e
    argv = controller_blueprint.executables[command.executable] + tuple(args)
    granted = []
    for endpoint_id in dict.fromkeys(options.endpoints):  # a repeated grant is one grant
        decl = workload_blueprint.endpoints.get(endpoint_id)
        if decl is None:
            raise PlanRejected(f"endpoint {endpoint_id!r} is not declared by the workload")
        granted.append(wire.Endpoint(id=decl.id, scheme=decl.scheme, host=WORKLOAD_HOST,
                                     port=decl.port))
    runtime = controller_blueprint.runtime
    if (options.output_dir or options.output_file) and runtime.uid == 0:
        raise PlanRejected("--output-dir and --output-file need a non-root controller runtime")
    if options.output_dir is not None:  # an existing one is used as it is, never re-owned
        try:
            found = os.stat(options.output_dir)
        except FileNotFoundError:
            found = None  # preparation creates it, the controller's
        except OSError as e:
            raise PlanRejected(f"--output-dir: cannot reach {options.output_dir}: "
                               f"{e.strerror or e}") from None
        if found is not None and not writable_by(found, runtime.uid, runtime.gid):
            raise PlanRejected(
                f"--output-dir: the controller's runtime {runtime.user} cannot write "
                f"{options.output_dir} (owner {found.st_uid}:{found.st_gid}, mode "
                f"{stat.S_IMODE(found.st_mode):04o}); Reploy never changes an existing "
                "directory's owner or mode")
    return SessionPlan(secrets.token_hex(16), controller, workload, controller_blueprint,
                       workload_blueprint, argv, tuple(granted))


def make_output_dir(path: Path, runtime: Runtime) -> None:
    """Create --output-dir for the controller (its runtime owns it), with any missing parent
    (the host's). One that exists is used as it is: never re-owned or re-moded (planning
    checked that the controller can write it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path)
    except FileExistsError:
        return
    os.chown(path, runtime.uid, runtime.gid, follow_symlinks=False)


def requested_output_status(options: RunOptions) -> Status:
    """controller_output for a session that never ran: what was requested, and its fate."""
    if options.output_dir is not None:
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(os.stat(options.output_dir).st_mode):
                return Status.of("controller_output", "directory-retained")
        return Status.of("controller_output", "failed",
                         reason="the session ended before the output directory was created")
    if options.output_file is not None:
        return Status.of("controller_output", "file-discarded",
                         reason="the session ended before the controller ran; nothing was "
                                "published")
    return Status.of("controller_output", "not-requested")


def derived_image_reference(base_image_id: str) -> tuple[str, str]:
    """The derived controller image's tag and the client digest it is keyed by (with the base
    image, how the image is derived, and the bytecode version this interpreter compiles)."""
    client_digest = hashlib.sha256(CLIENT_SOURCE.read_bytes()).hexdigest()
    recipe = f"{DERIVED_LAYER}\n{CLIENT_LAUNCHER}\n{importlib.util.MAGIC_NUMBER.hex()}"
    key = hashlib.sha256(f"{base_image_id}\n{client_digest}\n{recipe}".encode()
                         ).hexdigest()[:32]
    return f"reploy/controller-derived:{key}", client_digest


def probed_reference(base_image_id: str, sandbox_key: str) -> str:
    """The tag a derived image gets once its probe passed on an engine configured as the one
    `sandbox_key` (DockerBackend.require_sandbox_support) describes, by this probe."""
    key = hashlib.sha256(f"{sandbox_key}\n{PROBE_COMMAND}\n{PROBE_EXPECTED_STATUS}".encode())
    return derived_image_reference(base_image_id)[0] + PROBED_TAG_SUFFIX + key.hexdigest()[:16]


def probe_refusal(code: int, report: bytes, errors: bytes, runtime: Runtime) -> Optional[str]:
    """Why the probe refuses the controller image (or the engine), or None. `code`, `report`
    and `errors` are its exit code, stdout and stderr (tails)."""
    if code != 0:
        last = (errors.strip() or report.strip()).splitlines()[-1:]
        detail = f": {last[0].decode(errors='replace')}" if last else ""
        return f"{CLIENT_NEEDS}; the probe exited with code {code}{detail}"
    problem = probe_problem(report, runtime)
    return None if problem is None else \
        f"the probe of the controller image failed closed: {problem}"


def probe_problem(report: bytes, runtime: Runtime) -> Optional[str]:
    """What the probe's report (`reploy-session-client probe`'s line) shows to be other than
    asked for, or None: this release's client, the runtime uid:gid, a seccomp filter,
    no-new-privileges and no capability in any set. Anything unreadable fails closed."""
    try:
        line = report.strip().splitlines()[-1] if report.strip() else b""
        obj = wire.parse_strict_object(line, max_bytes=wire.MAX_LINE_BYTES)
    except wire.ProtocolError:
        return f"its report is unreadable ({printable(report[-200:].decode(errors='replace'))!r})"
    if obj.get("version") != __version__:
        return f"it reports version {obj.get('version')!r}, not {__version__}"
    if (obj.get("uid"), obj.get("gid")) != (runtime.uid, runtime.gid):
        return f"it runs as {obj.get('uid')}:{obj.get('gid')}, not as {runtime.user}"
    status = given if isinstance(given := obj.get("status"), dict) else {}
    wrong = [f"{name} is {status.get(name, 'missing')!r}, not {expected!r}"
             for name, expected in PROBE_EXPECTED_STATUS.items() if status.get(name) != expected]
    if wrong:
        return "the engine did not give it the sandbox asked for: " + ", ".join(wrong)
    return None


def derived_image_cached(backend: DockerBackend, base_image_id: str,
                         reference: Optional[str] = None) -> bool:
    """The derived image of this base and client exists under `reference` (by default its
    build tag; sessions ask for the tag it gets once its probe passed: probed_reference)."""
    build_reference, client_digest = derived_image_reference(base_image_id)
    labels = backend.image_labels(reference or build_reference)
    return bool(labels) and labels.get(LABEL_DERIVED_BASE) == base_image_id and labels.get(
        LABEL_CLIENT_DIGEST) == client_digest


def ensure_controller_image(backend: DockerBackend, base_image_id: str) -> str:
    """The derived controller image's reference, built now unless cached. (A session also
    probes a newly built one for python3: see ControlledSession.plan_images.)"""
    if not derived_image_cached(backend, base_image_id):
        build_derived_image(backend, base_image_id)
    return derived_image_reference(base_image_id)[0]


def client_bytecode(source: bytes) -> bytes:
    """The client's bytecode as this interpreter compiles it, checked against the source's
    hash (PEP 552): an interpreter of the same version takes it for exactly this source;
    any other looks for another name, or finds another magic number, and compiles the
    source as before."""
    code = compile(source, CLIENT_MODULE_PATH, "exec", dont_inherit=True)
    return (importlib.util.MAGIC_NUMBER + CHECKED_HASH_FLAGS
            + importlib.util.source_hash(source) + marshal.dumps(code))


def derived_layer_files() -> list[tuple[str, bytes, int]]:
    """(path under CLIENT_PREFIX, bytes, mode) of what the derived layer adds: the command,
    the client, and the client's bytecode under this interpreter's name for it."""
    source = CLIENT_SOURCE.read_bytes()
    module_dir = CLIENT_MODULE_DIR.removeprefix(f"{CLIENT_PREFIX}/")
    bytecode_name = f"{CLIENT_SOURCE.stem}.{sys.implementation.cache_tag}.pyc"
    return [(CLIENT_INSTALL_PATH.removeprefix(f"{CLIENT_PREFIX}/"), CLIENT_LAUNCHER.encode(),
             0o755),
            (f"{module_dir}/{CLIENT_SOURCE.name}", source, 0o644),
            (f"{module_dir}/__pycache__/{bytecode_name}", client_bytecode(source), 0o644)]


def build_derived_image(backend: DockerBackend, base_image_id: str) -> str:
    """The controller generation plus one layer holding the client, first on PATH; returns
    its image id."""
    reference, client_digest = derived_image_reference(base_image_id)
    dockerfile = f"FROM {base_image_id}\n{DERIVED_LAYER}".encode()
    files = [(f"install/{path}", data, mode) for path, data, mode in derived_layer_files()]
    directories = sorted({str(parent) for name, _, _ in files for parent in Path(name).parents
                          if parent != Path(".")})
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        for directory in directories:  # the layer's directories as any image has them
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, data, mode in [("Dockerfile", dockerfile, 0o644), *files]:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    context.seek(0)
    return backend.build(fileobj=context, custom_context=True, tag=reference,
                         labels={LABEL_DERIVED_BASE: base_image_id,
                                 LABEL_CLIENT_DIGEST: client_digest})


# ============================================================================================
# The controlled session: the run
# ============================================================================================


class Notifier:
    """Wakes the selector loop from the wait threads: a queue plus a self-pipe byte."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.items: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.closed = False

    def report(self, tag: str, value: Any) -> None:
        """From any thread; a call that outlives the session reports to nobody."""
        with self.lock:
            if self.closed:
                return
            self.items.put((tag, value))
            with contextlib.suppress(OSError):
                os.write(self.write_fd, b"\0")

    def drain(self) -> list[tuple[str, Any]]:
        with contextlib.suppress(BlockingIOError):
            os.read(self.read_fd, 4096)
        out = []
        while True:
            try:
                out.append(self.items.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        with self.lock:
            self.closed = True
            for fd in (self.read_fd, self.write_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)


class HostSignals(wire.SignalWakeup):
    """SIGINT and SIGTERM routed into the host's loop through a wakeup pipe, and remembered:
    the first one that came before the result decides a failed run's exit code (130, 143).

    A signal the process was started with ignored (a background job of a non-interactive
    shell starts with SIGINT ignored; `nohup` ignores SIGHUP) stays ignored for the whole run:
    the kernel discards it before the first statement, so answering it only after the
    handlers are in place would honour it at some instants and lose it at others."""

    def __init__(self) -> None:
        super().__init__(tuple(signum for signum in EXIT_FOR_SIGNAL
                               if signal.getsignal(signum) is not signal.SIG_IGN))
        self.first: Optional[int] = None

    def __enter__(self) -> "HostSignals":
        """Handlers first, then the held signals let through: one that came earlier (even
        before the re-execution) arrives at them now."""
        super().__enter__()
        release_held_signals()
        return self

    def __exit__(self, *exc: object) -> None:
        """Held again before the handlers go: the exit code was decided with the result."""
        if SIGNAL_MASK_BEFORE_HOLD is not None:
            signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
        super().__exit__(*exc)

    def drain(self) -> list[int]:
        signums = [signum for signum in super().drain() if signum in EXIT_FOR_SIGNAL]
        if signums and self.first is None:
            self.first = signums[0]
        return signums


def log(message: str) -> None:
    print(f"reploy: {message}", file=sys.stderr, flush=True)


@dataclass
class Owned:
    """What this run created and must remove, in every outcome."""

    containers: dict[str, str] = field(default_factory=dict)  # role -> container id
    labels: dict[str, dict[str, str]] = field(default_factory=dict)  # container id -> labels
    channel_dir: Optional[Path] = None
    output_staging_dir: Optional[Path] = None

    def remove_paths(self) -> tuple[str, ...]:
        """Remove the directories; what could not be removed stays named here, in words."""
        failures = []
        for attribute in ("channel_dir", "output_staging_dir"):
            path = getattr(self, attribute)
            try:
                if path is not None:
                    reploy_watchdog.remove_tree(path)
                setattr(self, attribute, None)
            except FileNotFoundError:
                setattr(self, attribute, None)
            except OSError as e:
                failures.append(f"remove {path}: {error_text(e)}")
        return tuple(failures)


class Watchdog:
    """The host's end of the machine's watchdog (reploy_watchdog.py).

    Armed before anything of the session exists; the manifest is rewritten (atomically) each
    time the session acquires something, so a host killed at any point leaves a true record.
    Disarmed only after the host's own cleanup. If the watchdog dies meanwhile, the session's
    loop sees its link end and re-arms its successor (on_watchdog).
    """

    def __init__(self, run_id: str, workload_dir: Path) -> None:
        self.manifest_path = reploy_watchdog.manifest_path_for(str(workload_dir), run_id)
        self.manifest = reploy_watchdog.Manifest(
            run_id=run_id, host=reploy_watchdog.process_identity(), watchdog="",
            containers={}, networks={}, paths=(),
            receipt_path=str(reploy_watchdog.receipt_path_for(str(workload_dir), run_id)))
        self.link: Optional[reploy_watchdog.WatchdogLink] = None

    def arm(self) -> reploy_watchdog.WatchdogLink:
        """Record the manifest, then arm the watchdog with it (starting the watchdog when none
        runs); its link. Raises reploy_watchdog.WatchdogUnavailable."""
        self.record(self.manifest)
        self.link = reploy_watchdog.arm(self.manifest.run_id, self.manifest_path)
        self.record(replace(self.manifest, watchdog=self.link.watchdog))
        return self.link

    def rearm(self) -> bool:
        """The watchdog is gone: arm its successor with the current manifest. Without one the
        session goes on unguarded, and says so: if this host dies too, the manifest stays for
        `controlled-session cleanup` (or the next reploy operation) to reconcile."""
        assert self.link is not None
        self.link.close()
        self.link = None
        try:
            self.arm()
            log("the watchdog went away; its successor now guards this session")
            return True
        except (reploy_watchdog.WatchdogUnavailable, OSError) as e:
            log(f"the watchdog went away and could not be replaced ({e}); this session goes on "
                "unguarded")
            return False

    def record(self, manifest: reploy_watchdog.Manifest) -> None:
        self.manifest = manifest
        reploy_watchdog.atomic_write_json(self.manifest_path, manifest.to_json())

    def record_owned(self, owned: Owned) -> None:
        self.record(replace(
            self.manifest,
            containers={cid: owned.labels[cid] for cid in owned.containers.values()},
            paths=tuple(str(p) for p in (owned.channel_dir, owned.output_staging_dir) if p)))

    def disarm(self, keep_manifest: bool = False) -> None:
        """Our own cleanup is done: tell the watchdog to forget the run, then forget it too.
        When something remains, the manifest stays, naming no watchdog (none is responsible
        any more), so reconciliation takes it over once this host has exited."""
        if self.link is not None:
            self.link.disarm()
            self.link = None
        if keep_manifest:
            self.record(replace(self.manifest, watchdog=""))
        else:
            with contextlib.suppress(FileNotFoundError):
                self.manifest_path.unlink()


def attachment_socket(descriptors: tuple[int, ...], uid: int, gid: int) -> socket.socket:
    """The attachment's connection the broker handed over, once it proves to be what one must
    be: exactly one descriptor, a connected unix stream socket whose peer runs as the
    controller's uid:gid. Raises AttachmentRefused, having closed every descriptor."""
    if len(descriptors) != 1:
        wire.close_descriptors(descriptors)
        raise AttachmentRefused(f"{len(descriptors)} descriptors instead of one")
    try:
        sock = socket.socket(fileno=descriptors[0])  # ENOTSOCK: it is not a socket at all
    except OSError as e:
        wire.close_descriptors(descriptors)
        raise AttachmentRefused("not a socket") from e
    try:
        problem = _attachment_problem(sock, uid, gid)
    except OSError as e:  # getpeername: ENOTCONN, nobody at the other end
        problem = f"not a connected socket ({e.strerror})"
    if problem is not None:
        sock.close()
        raise AttachmentRefused(problem)
    return sock


def _attachment_problem(sock: socket.socket, uid: int, gid: int) -> Optional[str]:
    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN) != socket.AF_UNIX:
        return "not a unix socket"
    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) != socket.SOCK_STREAM:
        return "not a stream socket"
    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        return "a listening socket, not a connection"
    sock.getpeername()
    _pid, peer_uid, peer_gid = struct.unpack("3i", sock.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if (peer_uid, peer_gid) != (uid, gid):
        return f"its peer runs as {peer_uid}:{peer_gid}, not as the controller's {uid}:{gid}"
    return None


class Interest:
    """What the selector loop waits for on each socket whose interest changes as it runs.
    `set` touches the selector only on a change: each change is a system call, and even
    asking the selector what it holds costs more than a keystroke's other work."""

    def __init__(self, selector: selectors.BaseSelector) -> None:
        self.selector = selector
        self.events: dict[socket.socket, int] = {}

    def set(self, sock: socket.socket, handler: Callable[[int], None], events: int) -> None:
        """handler(mask) runs when `sock` is ready for `events`; no events, no interest."""
        current = self.events.get(sock, 0)
        if events == current:
            return
        if not events:
            self.selector.unregister(sock)
            del self.events[sock]
            return
        if current:
            self.selector.modify(sock, events, handler)
        else:
            self.selector.register(sock, events, handler)
        self.events[sock] = events


class TerminalRelay:
    """Terminal bytes between the workload's PTY (the Engine's attach stream: raw bytes) and the
    attachment's own connection, which the broker handed over (frames): no broker hop, no
    Engine call. The session drives it from its selector loop, says when input and resizes
    may pass (`active`: from ready until termination begins) and does the resizing.

    Memory is bounded by what each side has queued: the PTY is read only while less than
    TERMINAL_QUEUE_BYTES of output waits for the attachment, the attachment only while less
    than that much input waits for the PTY; past it the kernel's socket buffers hold the
    writer back. Every write is tried at once, so a keystroke or an echo never waits for
    another pass of the loop; bulk output is coalesced (OUTPUT_COALESCE_S), which spares every
    process on the way a wakeup per Engine chunk. With no attachment left (it ended or
    failed), output is read and dropped, and noted as lost: the workload never stalls on a
    controller that went.
    """

    def __init__(self, interest: Interest, active: Callable[[], bool],
                 resize: Callable[[int, int], None]) -> None:
        self.interest = interest
        self.active = active
        self.resize = resize
        self.pty: Optional[socket.socket] = None
        self.pty_eof = False
        self.pty_input = bytearray()
        #: After a bulk read, when the PTY may be read again (time.monotonic()).
        self.read_after_s = 0.0
        #: set_interest held the PTY's read back for that: the loop must wake for it.
        self.read_held = False
        #: The attachment's connection: OUTPUT and OUTPUT_END out, INPUT and RESIZE in.
        self.terminal: Optional[wire.FramedConnection] = None
        self.attached = False
        #: Output the attachment never got (it ended first).
        self.output_lost = False
        #: The OUTPUT_END frame, once output finalization is decided.
        self.output_end: Optional[bytes] = None

    # -- the two ends -----------------------------------------------------------------------

    def open_pty(self, pty: socket.socket) -> None:
        """The Engine's attach stream of the workload (non-blocking)."""
        self.pty = pty

    def adopt(self, sock: socket.socket) -> None:
        """The attachment's connection, checked (attachment_socket) and ours from now on."""
        self.attached = True
        self.terminal = wire.FramedConnection(sock)
        if self.output_end is not None:  # output was finalized before the attachment came
            self.send_output_end()

    def set_interest(self) -> None:
        """What the loop waits for, from what is queued each way."""
        queue_bytes = wire.TERMINAL_QUEUE_BYTES
        if self.terminal is not None:
            self.interest.set(self.terminal.sock, self.on_terminal, (
                selectors.EVENT_READ if len(self.pty_input) < queue_bytes else 0) | (
                selectors.EVENT_WRITE if self.terminal.wants_write else 0))
        self.read_held = False
        if self.pty is not None and not self.pty_eof:
            events = selectors.EVENT_WRITE if self.pty_input else 0
            if self.terminal is None or self.terminal.pending_bulk_bytes < queue_bytes:
                if time.monotonic() >= self.read_after_s:
                    events |= selectors.EVENT_READ
                else:
                    self.read_held = True
            self.interest.set(self.pty, self.on_pty, events)

    def timeout(self, timeout: Optional[float]) -> Optional[float]:
        """The loop's select timeout, cut short to wake for the PTY read that set_interest
        held back (at once, if its time came meanwhile)."""
        if not self.read_held:
            return timeout
        wait_s = max(0.0, self.read_after_s - time.monotonic())
        return wait_s if timeout is None else min(timeout, wait_s)

    @property
    def delivered(self) -> bool:
        """Every byte read from the PTY is written to the attachment, or has nowhere to go."""
        return self.terminal is None or not self.terminal.wants_write

    def end_output(self, status: Status) -> None:
        """Output finalization is decided: the attachment gets its end of output after the
        last byte, then our side of its connection is closed (it reads to the end and goes)."""
        fields_ = {"status": status.kind, **({"reason": status.reason} if status.reason else {})}
        self.output_end = wire.encode_json_frame(FrameKind.OUTPUT_END, fields_)
        if self.terminal is not None:
            self.send_output_end()

    def close_pty(self) -> None:
        if self.pty is not None:
            self.interest.set(self.pty, self.on_pty, 0)
            self.pty.close()
            self.pty = None

    def close_terminal(self) -> None:
        if self.terminal is not None:
            self.interest.set(self.terminal.sock, self.on_terminal, 0)
            self.terminal.close()
            self.terminal = None

    # -- the workload's side ----------------------------------------------------------------

    def on_pty(self, mask: int) -> None:
        assert self.pty is not None
        if mask & selectors.EVENT_WRITE and self.pty_input:
            self.write_pty()
        if mask & selectors.EVENT_READ:
            try:
                data = self.pty.recv(wire.TERMINAL_CHUNK_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self.pty_eof = True
                self.interest.set(self.pty, self.on_pty, 0)
                return
            if OUTPUT_BULK_READ_BYTES <= len(data) < wire.TERMINAL_CHUNK_BYTES:
                self.read_after_s = time.monotonic() + OUTPUT_COALESCE_S
            self.send_output(data)

    def write_pty(self) -> None:
        """Queued input to the workload's PTY, as much as it takes now."""
        assert self.pty is not None
        try:
            sent = self.pty.send(self.pty_input)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            sent = len(self.pty_input)  # the PTY is gone; the bytes have nowhere to go
        del self.pty_input[:sent]

    # -- the attachment's side --------------------------------------------------------------

    def on_terminal(self, mask: int) -> None:
        terminal = self.terminal
        assert terminal is not None
        try:
            if mask & selectors.EVENT_WRITE:
                self.flush_terminal()
            if mask & selectors.EVENT_READ and self.terminal is not None:
                for frame in terminal.receive():
                    self.on_terminal_frame(frame)
                if terminal.eof:
                    self.lose_terminal("the attachment closed its connection")
        except wire.ProtocolError as e:
            self.lose_terminal(f"attachment protocol violation: {e.message}")
        except OSError as e:
            self.lose_terminal(f"attachment failed: {e}")

    def on_terminal_frame(self, frame: wire.Frame) -> None:
        """Input reaches the shell only while the session is active, as does a resize: the
        command line's size holds until ready, and once termination begins nothing changes."""
        if frame.kind is FrameKind.INPUT:
            if self.active() and self.pty is not None and not self.pty_eof:
                self.pty_input += frame.payload
                self.write_pty()
        elif frame.kind is FrameKind.RESIZE:
            try:
                size = frame.json()
                resize = wire.Resize(columns=size.get("columns", 0), rows=size.get("rows", 0))
            except wire.ProtocolError as e:
                log(f"ignoring the attachment's resize: {e.message}")
                return
            if self.active():
                self.resize(resize.columns, resize.rows)
        else:
            raise wire.FramingError(f"unexpected {frame.kind.name} frame from the attachment")

    def send_output(self, data: bytes) -> None:
        if self.terminal is None:
            self.output_lost = True
            return
        self.terminal.send(wire.encode_frame(FrameKind.OUTPUT, data), urgent=False)
        self.flush_terminal()

    def send_output_end(self) -> None:
        assert self.terminal is not None and self.output_end is not None
        self.terminal.send(self.output_end, urgent=False)
        self.flush_terminal()

    def flush_terminal(self) -> None:
        """Write what the kernel takes; once the end of output is written, end our side."""
        terminal = self.terminal
        assert terminal is not None
        try:
            terminal.flush()
            if self.output_end is not None and not terminal.wants_write:
                terminal.close_write()
        except OSError as e:
            self.lose_terminal(f"attachment write failed: {e}")

    def lose_terminal(self, reason: str) -> None:
        """The attachment's connection ended or failed: what it had yet to get is lost."""
        terminal = self.terminal
        if terminal is None:
            return
        if terminal.wants_write:
            self.output_lost = True
        if self.output_end is None:  # after its end of output, an ending is no news
            log(reason)
        self.close_terminal()


def session_labels(plan: SessionPlan, manifest: reploy_watchdog.Manifest,
                   role: str) -> dict[str, str]:
    """Every session container says whose it is, for the watchdog and for reconciliation
    after a crash that took the watchdog too."""
    deployment = plan.workload if role == "workload" else plan.controller
    labels = {LABEL_RUN: plan.run_id, LABEL_ROLE: role,
              reploy_watchdog.LABEL_HOST: manifest.host,
              reploy_watchdog.LABEL_WATCHDOG: manifest.watchdog,
              reploy_watchdog.LABEL_WORKLOAD_DIR: str(plan.workload.dir)}
    if role != "holder":  # the holder belongs to the session, not to a deployment
        labels[LABEL_DEPLOYMENT] = deployment.deployment_id
        labels[LABEL_GENERATION] = str(deployment.current.number)  # type: ignore[union-attr]
    return labels


def holder_spec(image: str, labels: dict[str, str]) -> ContainerSpec:
    """The owner of a granted session's network namespace: a pause, as nobody."""
    return ContainerSpec(
        role="holder", image_id=image, command=HOLDER_COMMAND,
        runtime=Runtime(HOLDER_UID_GID, HOLDER_UID_GID, (), HOLDER_MEMORY_MIB, HOLDER_PIDS),
        environment={}, labels=labels, extra_hosts=((WORKLOAD_HOST, "127.0.0.1"),),
        hostname=HOLDER_HOSTNAME)


def controller_spec(plan: SessionPlan, image: str, network_mode: str, channel_dir: Path,
                    outputs: list[tuple[Mount, tuple[str, str]]],
                    labels: dict[str, str]) -> ContainerSpec:
    """The controller: the channel (read-only) and its outputs mounted, nothing else."""
    mounts = [Mount(str(channel_dir), CHANNEL_MOUNT, read_only=True)]
    environment = {"HOME": CONTAINER_HOME,
                   wire.SESSION_SOCKET_ENV: f"{CHANNEL_MOUNT}/{CHANNEL_SOCKET_NAME}"}
    for mount, (name, value) in outputs:
        mounts.append(mount)
        environment[name] = value
    return ContainerSpec(
        role="controller", image_id=image, command=plan.controller_argv,
        runtime=plan.controller_blueprint.runtime, environment=environment, labels=labels,
        network_mode=network_mode, mounts=tuple(mounts),
        hostname="controller" if network_mode == NETWORK_NONE else None, init=True)


def workload_spec(plan: SessionPlan, options: RunOptions, network_mode: str,
                  labels: dict[str, str]) -> ContainerSpec:
    """The workload: /bin/sh on a TTY of the requested size in its exact image, under the
    Engine's init. As PID 1 the shell would adopt every orphan, and busybox ash, whose SIGCHLD
    handler has no SA_RESTART, drops a prompt whose write an orphan's SIGCHLD interrupts
    (issue 29: the recording example's prompt after `killall httpd`)."""
    return ContainerSpec(
        role="workload", image_id=plan.workload.current.image_id,  # type: ignore[union-attr]
        command=(WORKLOAD_SHELL,), runtime=plan.workload_blueprint.runtime,
        environment={"HOME": CONTAINER_HOME, "TERM": WORKLOAD_TERM}, labels=labels,
        network_mode=network_mode, tty=True,
        hostname=WORKLOAD_HOST if network_mode == NETWORK_NONE else None,
        console_size=(options.columns, options.rows), init=True)


def prepare_outputs(options: RunOptions, runtime: Runtime, owned: Owned, run_id: str,
                    feed: Callable[[HostEvent], None]) -> list[tuple[Mount, tuple[str, str]]]:
    """Mount the controller-only output destination, if one was requested; its status (or
    its staging, which `owned` keeps) goes to `feed`."""
    if options.output_dir is not None:
        try:
            make_output_dir(options.output_dir, runtime)
        except OSError as e:  # a startup failure; the requested output still has a fate
            feed(OutputPrepared(Status.of(
                "controller_output", "failed",
                reason=f"could not prepare the output directory: {error_text(e)}")))
            raise
        feed(OutputPrepared(Status.of("controller_output", "directory-retained")))
        return [(Mount(str(options.output_dir.resolve()), OUTPUT_DIR_MOUNT, False),
                 ("REPLOY_OUTPUT_DIR", OUTPUT_DIR_MOUNT))]
    if options.output_file is not None:
        staging = Path(tempfile.mkdtemp(prefix=f".reploy-output-{run_id[:8]}-",
                                        dir=options.output_file.parent))
        owned.output_staging_dir = staging
        feed(OutputPrepared(None, staged=True))
        os.chown(staging, runtime.uid, runtime.gid)
        os.chmod(staging, 0o700)
        return [(Mount(str(staging), OUTPUT_FILE_MOUNT, False),
                 ("REPLOY_OUTPUT_FILE", f"{OUTPUT_FILE_MOUNT}/{options.output_file.name}"))]
    feed(OutputPrepared(Status.of("controller_output", "not-requested")))
    return []


def last_log_line(backend: DockerBackend, container_id: str) -> str:
    """The last line of a container's log (bounded), or nothing when it cannot be read."""
    with contextlib.suppress(BackendError):
        lines = backend.log_tail(container_id).splitlines()
        return lines[-1].decode(errors="replace")[:300] if lines else ""
    return ""


def show_controller_log(tail: Any) -> None:
    """The controller's own output, for the user, on the host's stderr (bounded)."""
    if isinstance(tail, bytes) and tail:
        sys.stderr.write("reploy: controller output follows\n")
        sys.stderr.write(tail[-CONTROLLER_LOG_TAIL_BYTES:].decode(errors="replace"))
        sys.stderr.flush()


def plan_images(session: "ControlledSession") -> Optional[str]:
    """The Docker half of planning: the engine can hold the sandbox, both generations'
    images exist, the derived controller image (built if new) and, unless it already
    passed on an engine configured like this one, its probe. Every Engine call here runs
    off the loop, so a signal cancels promptly. Returns the controller image to run, or
    None when a signal cancelled planning. Raises PlanRejected."""
    plan, backend = session.plan, session.backend
    base_image = plan.controller.current.image_id  # type: ignore[union-attr]

    def check(_api: docker.APIClient) -> tuple[str, bool]:
        try:
            sandbox_key = backend.require_sandbox_support()
        except BackendError as e:
            raise PlanRejected(str(e)) from e
        for role, deployment in (("controller", plan.controller),
                                 ("workload", plan.workload)):
            image_id = deployment.current.image_id  # type: ignore[union-attr]
            if not backend.image_exists(image_id):
                raise PlanRejected(f"the {role} image {image_id} is gone (run reploy build)")
        probed = probed_reference(base_image, sandbox_key)
        return probed, derived_image_cached(backend, base_image, probed)

    checked = session.off_loop("check the engine and the images", check)
    if checked is None:
        return None
    probed, cached = checked
    if cached:
        return probed
    built = session.off_loop("build the controller image",
                          lambda _api: build_derived_image(backend, base_image))
    if built is None or not probe(session, built):
        return None  # cancelled: without the probed tag, the next session probes again
    backend.tag_image(built, probed)
    return probed

def probe(session: "ControlledSession", image_id: str) -> bool:
    """Run the installed client in a container made like the controller's (PROBE_COMMAND)
    and refuse the plan, saying why, when it cannot run or when the engine did not give it
    the sandbox asked for (probe_refusal). The probe is a session container like the
    others: labelled, in the watchdog's manifest, removed in every outcome. False when a
    signal cancelled it."""
    runtime = session.plan.controller_blueprint.runtime
    container_id = session.acquire_container(ContainerSpec(
        role=PROBE_ROLE, image_id=image_id, command=PROBE_COMMAND, runtime=runtime,
        environment={"HOME": CONTAINER_HOME}, labels=session.labels(PROBE_ROLE)))

    def run_probe(api: docker.APIClient) -> tuple[int, bytes, bytes]:
        try:
            api.start(container_id)
        except docker.errors.APIError as e:  # the Engine could not exec the client at all
            raise PlanRejected(f"{CLIENT_NEEDS}; the probe could not start: "
                               f"{e.explanation or e}") from e
        code = int(api.wait(container_id, timeout=PROBE_TIMEOUT_S)["StatusCode"])
        return (code, api.logs(container_id, stdout=True, stderr=False)[-PROBE_OUTPUT_BYTES:],
                api.logs(container_id, stdout=False, stderr=True)[-PROBE_OUTPUT_BYTES:])

    try:
        outcome: Optional[tuple[int, bytes, bytes]] = session.off_loop("run the python probe",
                                                                       run_probe)
        if outcome is None:
            return False  # cancelled: the delivery tail removes the probe
        refusal = probe_refusal(*outcome, runtime)
    except PlanRejected as e:
        refusal = str(e)
    removal = session.calls.begin("remove the python-probe container", lambda api: (
        remove_container_quietly(api, container_id)))
    deadline = time.monotonic() + session.options.timeout_s("--cleanup-timeout")
    removed = session.await_call(removal, deadline)
    if removed is not None and not isinstance(removed[0], BaseException):
        session.forget(Role.PROBE)
    if refusal is not None:
        with contextlib.suppress(BackendError):
            session.backend.remove_image(image_id)
        raise PlanRejected(refusal)
    if Role.PROBE.value in session.owned.containers:
        reason = removed[0] if removed else "not finished within the cleanup timeout"
        raise PlanRejected(f"the python probe could not be removed: {reason}")
    return True


class EngineCalls:
    """Blocking Engine calls, each in a thread so the loop goes on (signals, the channel): what
    one returns (or its BackendError) comes back to the loop through the notifier."""

    def __init__(self, backend: DockerBackend, notifier: Notifier) -> None:
        self.backend = backend
        self.notifier = notifier
        self.started = 0
        #: What calls without a handler reported, by tag; what to do when one reports.
        self.results: dict[str, Any] = {}
        self.handlers: dict[str, Callable[[Any], None]] = {}

    def begin(self, what: str, call: Callable[[docker.APIClient], Any],
              on_done: Optional[Callable[[Any], None]] = None) -> str:
        """Start the call; its tag. `on_done` gets its value on the loop as soon as it
        reports; without one, the value waits in `results`."""
        self.started += 1
        tag = f"{CALL_TAG}{self.started}"
        if on_done is not None:
            self.handlers[tag] = on_done

        def guarded(api: docker.APIClient) -> Any:
            try:
                return call(api)
            except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
                raise BackendError(f"{what}: {e}") from e

        self.backend.in_thread(tag, guarded, self.notifier.report)
        return tag

    def report(self, tag: str, value: Any) -> None:
        handler = self.handlers.pop(tag, None)
        if handler is None:
            self.results[tag] = value
        else:
            handler(value)


class ControllerChannel:
    """The host's end of the private channel: a listener that takes exactly one peer, of the
    controller's uid:gid, then the framed connection to that peer's broker. What arrives is
    fed to the core as events; the attachment's own connection goes to the relay."""

    def __init__(self, interest: Interest, relay: TerminalRelay,
                 feed: Callable[[HostEvent], None], refused: Callable[[], bool]) -> None:
        self.interest = interest
        self.relay = relay
        #: The controller's runtime: the one peer the channel and the attachment may have.
        self.runtime: Optional[Runtime] = None
        self.feed = feed
        #: Whether an attachment was refused already (the core knows).
        self.refused = refused
        self.listener: Optional[socket.socket] = None
        self.socket_path: Optional[Path] = None
        self.conn: Optional[wire.FramedConnection] = None
        #: A sent event may still be unwritten.
        self.unflushed = False

    def listen(self, channel_dir: Path, runtime: Runtime) -> None:
        """A 0600 socket owned by the controller's uid:gid in `channel_dir`."""
        self.runtime = runtime
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bind through /proc/self/fd so a deep workload dir cannot exceed sun_path's 108 bytes.
        dir_fd = os.open(channel_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            old_umask = os.umask(0o177)
            try:
                listener.bind(f"/proc/self/fd/{dir_fd}/{CHANNEL_SOCKET_NAME}")
            finally:
                os.umask(old_umask)
        finally:
            os.close(dir_fd)
        self.socket_path = channel_dir / CHANNEL_SOCKET_NAME
        os.chown(self.socket_path, self.runtime.uid, self.runtime.gid, follow_symlinks=False)
        os.chmod(self.socket_path, 0o600)
        listener.listen(1)
        listener.setblocking(False)
        self.listener = listener
        self.interest.set(listener, self.on_listener, selectors.EVENT_READ)

    def set_interest(self) -> None:
        if self.conn is not None:
            self.interest.set(self.conn.sock, self.on_channel, selectors.EVENT_READ | (
                selectors.EVENT_WRITE if self.conn.wants_write else 0))

    def flushed(self) -> bool:
        """True once, when every event sent is written out (or there is nowhere to write)."""
        if not self.unflushed or (self.conn is not None and self.conn.wants_write):
            return False
        self.unflushed = False
        return True

    def send(self, event: wire.Message) -> None:
        if self.conn is not None:
            self.conn.send(wire.encode_frame(FrameKind.EVENT,
                                             wire.encode_compact(event.to_json())))
            self.unflushed = True

    def close_write(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.close_write()

    def close(self) -> None:
        if self.conn is not None:
            self.interest.set(self.conn.sock, self.on_channel, 0)
            self.conn.close()
            self.conn = None

    def on_listener(self, _mask: int) -> None:
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        pid, uid, gid = struct.unpack("3i", conn.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        assert self.runtime is not None
        if (uid, gid) != (self.runtime.uid, self.runtime.gid):
            log(f"refused a channel peer with uid:gid {uid}:{gid} (pid {pid})")
            conn.close()
            return
        self.close_listener()  # exactly one peer; the path is gone from now on
        self.conn = wire.FramedConnection(conn, descriptor_kinds=frozenset({FrameKind.ATTACHED}))
        self.interest.set(conn, self.on_channel, selectors.EVENT_READ)
        self.feed(ChannelConnected())

    def close_listener(self) -> None:
        if self.listener is None:
            return
        self.interest.set(self.listener, self.on_listener, 0)
        self.listener.close()
        self.listener = None
        assert self.socket_path is not None
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    def on_channel(self, mask: int) -> None:
        conn = self.conn
        assert conn is not None
        try:
            if mask & selectors.EVENT_WRITE:
                conn.flush()
            if mask & selectors.EVENT_READ:
                frames = iter(conn.receive())
                try:
                    for frame in frames:
                        self.on_frame(frame)
                finally:  # frames a failure left unhandled keep no descriptor open
                    wire.close_descriptors(d for frame in frames for d in frame.descriptors)
                if conn.eof:
                    self.lose("the controller closed the session channel")
        except wire.ProtocolError as e:
            self.lose(f"channel protocol violation: {e.message}")
        except OSError as e:
            self.lose(f"channel failed: {error_text(e)}")

    def lose(self, reason: str) -> None:
        if self.conn is not None:
            self.close()
            self.feed(ChannelLost(reason))

    def on_frame(self, frame: wire.Frame) -> None:
        """A frame from the broker: the attachment's hand-over, or a public request."""
        if frame.kind is FrameKind.ATTACHED:
            self.adopt_attachment(frame)
        elif frame.kind is FrameKind.REQUEST:
            self.feed(Requested(wire.decode_message(frame.payload + b"\n",
                                                    wire.Direction.REQUEST)))
        else:
            raise wire.FramingError(f"unexpected {frame.kind.name} frame from the controller")

    def adopt_attachment(self, frame: wire.Frame) -> None:
        """The broker handed over the attachment's own connection: terminal bytes go straight
        between it and the engine from now on. A connection that is not what an attachment's
        must be is refused, and startup fails closed."""
        try:
            if self.relay.attached or self.refused():
                raise wire.FramingError("a second attachment was handed over")
            if frame.json() != {}:
                raise wire.FramingError("an ATTACHED frame carries an empty object")
        except wire.ProtocolError:
            wire.close_descriptors(frame.descriptors)
            raise
        assert self.runtime is not None
        try:
            sock = attachment_socket(frame.descriptors, self.runtime.uid, self.runtime.gid)
        except AttachmentRefused as e:
            self.feed(AttachmentRejected(str(e)))
            return
        self.relay.adopt(sock)
        self.feed(Attached())


class ControlledSession:
    """One run of `reploy controlled-session run`: HostCore decides, this performs.

    Planning (images, the derived controller image, the python probe) and preparation (the
    channel, the outputs, the holder and the controller) are sequential code, as is every
    action; everything else is the selector loop (the channel, the TerminalRelay's PTY and
    attachment, wait-thread notices, signals) turning what it sees into events. Events seen
    in one pass are fed after that pass, behind every deadline that passed meanwhile: what
    is first seen after a deadline did not happen before it (issue 23).
    """

    def __init__(self, options: RunOptions, plan: SessionPlan, backend: DockerBackend,
                 signals: HostSignals) -> None:
        self.options = options
        self.plan = plan
        self.backend = backend
        self.signals = signals
        self.core = HostCore(HostConfig(
            HostTimeouts.of(options), endpoints=plan.endpoints, columns=options.columns,
            rows=options.rows, requested_output=requested_output_status(options),
            output_file=options.output_file is not None))
        self.result: Optional[RunResult] = None
        self.owned = Owned()
        self.watchdog = Watchdog(plan.run_id, plan.workload.dir)
        self.notifier = Notifier()
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.notifier.read_fd, selectors.EVENT_READ, self.on_notice)
        self.selector.register(signals.read_fd, selectors.EVENT_READ, self.on_signal)
        #: When each armed deadline passes (time.monotonic()).
        self.due: dict[Timer, float] = {}
        #: Events not yet fed: a pass's, or an action's answers.
        self.events: list[HostEvent] = []
        self.feeding = False
        #: The relay's facts as last fed.
        self.relay_fed = RelayFacts()
        self.calls = EngineCalls(backend, self.notifier)
        self.workload_spec: Optional[ContainerSpec] = None
        #: Why the created workload's shell cannot start (see DockerBackend.unexecutable).
        self.shell_unexecutable: Optional[str] = None
        self.interest = Interest(self.selector)
        self.relay = TerminalRelay(self.interest, lambda: self.core.state.phase is Phase.ACTIVE,
                                   self.resize_workload)
        self.channel = ControllerChannel(self.interest, self.relay, self.feed,
                                         lambda: self.core.state.attachment_refused is not None)

    # -- the whole run ----------------------------------------------------------------------

    def run(self) -> RunResult:
        """Every outcome, including our own bugs, ends in the core's Finish."""
        try:
            link = self.watchdog.arm()  # before the first container of the session exists
        except (reploy_watchdog.WatchdogUnavailable, OSError) as e:
            return RunResult(error=f"plan rejected: the watchdog could not be armed: "
                                   f"{error_text(e)}",
                             controller_output=requested_output_status(self.options))
        self.selector.register(link, selectors.EVENT_READ, self.on_watchdog)
        try:
            self.plan_and_prepare()
            while self.result is None:
                self.loop_once()
        except Exception as e:  # noqa: BLE001 - a bug must still clean up and report
            log(f"internal error: {e!r}")
            self.events.clear()
            self.feeding = False
            self.feed(InternalError(repr(e)))
            while self.result is None:
                self.loop_once()
        finally:
            self.notifier.close()
            self.selector.close()
        return self.result

    def plan_and_prepare(self) -> None:
        """The startup timeout counts from the end of planning."""
        try:
            controller_image = plan_images(self)
        except (PlanRejected, BackendError, OSError) as e:
            self.feed(PlanFailed(error_text(e)))
            return
        if controller_image is None:
            return  # cancelled: the core is in its delivery tail already
        self.feed(Planned())
        try:
            self.workload_spec = self.prepare(controller_image)
        except (BackendError, OSError) as e:
            self.feed(EngineFailed(error_text(e)))
            return
        self.feed(Begin())

    # -- feeding the core and performing its actions -----------------------------------------

    def feed(self, event: HostEvent) -> None:
        """Hand `event` to the core and perform its answer, unless a pass or an action is
        being handled: then it waits its turn."""
        self.events.append(event)
        if not self.feeding:
            self.pump()

    def pump(self) -> None:
        """Feed every waiting event, each behind the deadlines that passed before it."""
        self.feeding = True
        try:
            self.observe()
            self.expire()
            while self.events:
                self.step(self.events.pop(0))
                self.observe()
                self.expire()
        finally:
            self.feeding = False

    def step(self, event: HostEvent) -> None:
        for action in self.core.handle(event):
            self.perform(action)
        armed = self.core.state.armed
        if len(armed) != len(self.due):
            self.due = {timer: at for timer, at in self.due.items() if timer in armed}

    def expire(self) -> None:
        now = time.monotonic()
        for timer, at in sorted(self.due.items(), key=lambda item: item[1]):
            if at <= now and self.due.get(timer) == at:
                del self.due[timer]
                self.step(Deadline(timer))

    def observe(self) -> None:
        """Facts the relay and channel hold rather than report: fed when they change (the
        relay's only once the session is no longer active, when its drain matters)."""
        if self.channel.flushed():
            self.events.append(ChannelFlushed())
        if self.core.state.phase is Phase.ACTIVE:
            return
        relay = self.relay
        facts = RelayFacts(relay.pty_eof, relay.output_lost, relay.delivered)
        if facts != self.relay_fed:
            self.relay_fed = facts
            self.events.append(RelayObserved(facts))

    def perform(self, action: HostAction) -> None:
        if isinstance(action, Send):
            self.channel.send(action.event)
        elif isinstance(action, Arm):
            self.due[action.timer] = time.monotonic() + action.seconds
        elif isinstance(action, Start):
            self.start(action.role)
        elif isinstance(action, Kill):
            self.kill(action.role, action.signame)
        elif isinstance(action, Remove):
            self.begin_removal(*action.roles)
        elif isinstance(action, Resize):
            self.resize_workload(action.columns, action.rows)
        elif isinstance(action, Log):
            log(action.message)
        elif isinstance(action, Close):
            self.close(action.part)
        elif isinstance(action, EndOutput):
            self.relay.end_output(action.status)
        elif isinstance(action, Finish):
            self.finish(action)
        else:
            self.perform_file_action(action)

    def perform_file_action(self, action: HostAction) -> None:
        if isinstance(action, ReadControllerLog):
            self.feed(ControllerLog(last_log_line(self.backend,
                                                  self.owned.containers["controller"])))
        elif isinstance(action, CopyControllerLog):
            controller_id = self.owned.containers["controller"]
            self.calls.begin("read the controller log", lambda api: api.logs(
                controller_id, stdout=True, stderr=True), self.controller_log_copied)
        elif isinstance(action, Publish):
            assert self.options.output_file is not None and self.owned.output_staging_dir
            try:
                publish_regular_file(self.owned.output_staging_dir, self.options.output_file)
                self.feed(Published())
            except OSError as e:
                self.feed(Published(error_text(e)))
        elif isinstance(action, RemovePaths):
            self.feed(PathsRemoved(self.owned.remove_paths()))

    def controller_log_copied(self, tail: Any) -> None:
        show_controller_log(tail)
        self.feed(LogCopied())

    def close(self, part: ClosePart) -> None:
        if part is ClosePart.PTY:
            self.relay.close_pty()
        elif part is ClosePart.TERMINAL:
            self.relay.close_terminal()
        elif part is ClosePart.LISTENER:
            self.channel.close_listener()
        elif part is ClosePart.CHANNEL_WRITE:
            self.channel.close_write()
        else:
            self.channel.close()

    def finish(self, action: Finish) -> None:
        if action.keep_manifest:
            # Keep a true manifest of what remains, for `controlled-session cleanup`.
            self.watchdog.record_owned(self.owned)
            log("cleanup left something behind; `reploy.py controlled-session cleanup "
                f"--workload-dir {self.plan.workload.dir}` reconciles it")
        if self.watchdog.link is not None:
            self.selector.unregister(self.watchdog.link)
        self.watchdog.disarm(keep_manifest=action.keep_manifest)
        self.result = action.result

    # -- planning ---------------------------------------------------------------------------

    def await_call(self, tag: str, deadline: Optional[float] = None) -> Optional[tuple[Any]]:
        """A planning call's (value,) once it reports; None when the deadline passed first or
        a signal ended planning."""
        results = self.calls.results
        while tag not in results and self.core.state.step is Step.PLANNING:
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                return None
            self.loop_once(timeout)
        return (results.pop(tag),) if tag in results else None

    def off_loop(self, what: str, call: Callable[[docker.APIClient], Any]) -> Any:
        """A planning call (the engine's checks, an image build, the probe) that a signal
        cancels promptly: its value, or None when cancelled. Raises its ReployError."""
        reported = self.await_call(self.calls.begin(what, call))
        if reported is not None and isinstance(reported[0], ReployError):
            raise reported[0]
        return None if reported is None else reported[0]

    # -- preparing --------------------------------------------------------------------------

    def prepare(self, controller_image: str) -> ContainerSpec:
        """The channel, the outputs, the holder and the controller; returns the workload's
        spec, which the controller's start creates while the controller starts."""
        plan = self.plan
        self.open_channel(plan.controller_blueprint.runtime)
        self.watchdog.record_owned(self.owned)
        outputs = prepare_outputs(self.options, plan.controller_blueprint.runtime, self.owned,
                                  plan.run_id, self.feed)
        self.watchdog.record_owned(self.owned)
        network_mode = NETWORK_NONE
        if plan.endpoints:
            holder_id = self.acquire_container(holder_spec(controller_image,
                                                           self.labels("holder")))
            network_mode = f"container:{holder_id}"
        assert self.owned.channel_dir is not None
        self.acquire_container(controller_spec(plan, controller_image, network_mode,
                                               self.owned.channel_dir, outputs,
                                               self.labels("controller")))
        return workload_spec(plan, self.options, network_mode, self.labels("workload"))

    def acquire_container(self, spec: ContainerSpec) -> str:
        container_id = self.backend.create(spec)
        self.owned.containers[spec.role] = container_id
        self.owned.labels[container_id] = spec.labels
        self.watchdog.record_owned(self.owned)
        self.feed(Created(Role(spec.role)))
        return container_id

    def forget(self, role: Role) -> None:
        """The role's container is removed: it leaves the watchdog's manifest at once."""
        self.owned.containers.pop(role.value, None)
        self.watchdog.record_owned(self.owned)
        self.feed(Removed(role))

    def labels(self, role: str) -> dict[str, str]:
        return session_labels(self.plan, self.watchdog.manifest, role)

    def open_channel(self, runtime: Runtime) -> None:
        """The private channel's 0700 directory, owned by the controller's uid:gid."""
        channel_dir = reploy_watchdog.channel_dir_for(str(self.plan.workload.dir), self.plan.run_id)
        channel_dir.parent.mkdir(parents=True, exist_ok=True)
        channel_dir.mkdir(mode=0o700)
        self.owned.channel_dir = channel_dir
        os.chown(channel_dir, runtime.uid, runtime.gid)
        self.channel.listen(channel_dir, runtime)

    # -- the engine's part ------------------------------------------------------------------

    def start(self, role: Role) -> None:
        """Start a container and watch it. The controller starts off the loop while the
        workload is created and attached to (before it starts: no byte is missed)."""
        backend, containers = self.backend, self.owned.containers
        try:
            if role is Role.CONTROLLER:
                controller_id = containers["controller"]

                def started(value: Any) -> None:
                    if isinstance(value, BackendError):
                        self.feed(EngineFailed(error_text(value), Role.CONTROLLER))
                        return
                    backend.wait_in_thread(controller_id, self.notifier.report, "controller")
                    self.feed(Started(Role.CONTROLLER))

                self.calls.begin("start the controller", lambda api: api.start(controller_id),
                                started)
                assert self.workload_spec is not None
                workload_id = self.acquire_container(self.workload_spec)
                self.relay.open_pty(backend.attach_pty(workload_id))
                self.shell_unexecutable = backend.unexecutable(workload_id, WORKLOAD_SHELL)
                return
            if role is Role.WORKLOAD and self.shell_unexecutable is not None:
                raise BackendError(f"start container: {self.shell_unexecutable}")
            backend.start(containers[role.value])
            backend.wait_in_thread(containers[role.value], self.notifier.report, role.value)
        except (BackendError, OSError) as e:  # (the controller's start: the workload's creation)
            self.feed(EngineFailed(error_text(e), Role.WORKLOAD if role is Role.CONTROLLER
                                   else role))
            return
        if role is Role.WORKLOAD:
            self.resize_workload(self.options.columns, self.options.rows)
        self.feed(Started(role))

    def kill(self, role: Role, signame: str) -> None:
        """SIGTERM at once; SIGKILL from a thread: the Engine answers it only once the
        container has exited, and the exit can wait for us to read the PTY stream."""
        container_id = self.owned.containers.get(role.value)
        if container_id is None:
            return
        if signame == "SIGTERM":
            try:
                self.backend.kill(container_id, signame)
            except BackendError as e:
                log(f"could not signal the {role.value}: {e}")
            return
        self.backend.in_thread("kill", lambda api: kill_if_running(api, container_id, signame),
                               self.notifier.report)

    def resize_workload(self, columns: int, rows: int) -> None:
        """A resize the session honours (a structured one, or the attachment's SIGWINCH)."""
        try:
            self.backend.resize(self.owned.containers["workload"], columns, rows)
        except BackendError as e:  # e.g. racing the workload's exit: not fatal
            log(f"could not resize the workload's terminal: {e}")

    def begin_removal(self, *roles: Role) -> None:
        """Remove these containers all at once, off the loop; each one removed leaves the
        watchdog's manifest at once, so it stays a true record however long nobody awaits."""
        for role in roles:
            container_id = self.owned.containers.get(role.value)
            if container_id is None:
                self.feed(Removed(role))
                continue

            def removed(value: Any, role: Role = role) -> None:
                if isinstance(value, BaseException):
                    self.feed(Removed(role, str(value)))
                else:
                    self.forget(role)

            self.calls.begin(f"remove the {role.value} container",
                             functools.partial(remove_container_quietly, container_id=container_id),
                             removed)

    # -- the loop ---------------------------------------------------------------------------

    def loop_once(self, timeout: Optional[float] = None) -> None:
        """One pass: set interest, select until the next deadline, handle what is ready, then
        feed what the pass saw (fed behind the deadlines that passed meanwhile)."""
        self.channel.set_interest()
        self.relay.set_interest()
        if self.due:
            next_s = max(0.0, min(self.due.values()) - time.monotonic())
            timeout = next_s if timeout is None else min(timeout, next_s)
        self.feeding = True  # what the pass sees waits for its end
        try:
            for key, mask in self.selector.select(self.relay.timeout(timeout)):
                key.data(mask)
        finally:
            self.feeding = False
        self.pump()

    def on_signal(self, _mask: int) -> None:
        for signum in self.signals.drain():
            self.feed(Signalled(signal.Signals(signum).name))

    def on_watchdog(self, _mask: int) -> None:
        """The watchdog never speaks after `armed`: its link turning readable means it died."""
        assert self.watchdog.link is not None
        self.selector.unregister(self.watchdog.link)
        if self.watchdog.rearm():
            self.selector.register(self.watchdog.link, selectors.EVENT_READ, self.on_watchdog)

    def on_notice(self, _mask: int) -> None:
        for tag, value in self.notifier.drain():
            if tag == "workload":
                self.feed(ObservationLost(str(value)) if isinstance(value, Exception)
                          else WorkloadExited(value))
            elif tag == "controller":
                if isinstance(value, Exception):
                    log(f"lost sight of the controller: {value}")
                self.feed(ControllerExited(value if isinstance(value, int) else None))
            elif tag == "holder":
                self.feed(HolderLost(f"exited with code {value}" if isinstance(value, int)
                                     else f"was lost: {value}"))
            elif tag == "kill" and isinstance(value, Exception):
                log(f"could not kill: {value}")
            elif tag.startswith(CALL_TAG):
                self.calls.report(tag, value)


def reconcile(backend: DockerBackend, workload_dirs: list[Path]) -> list[dict[str, Any]]:
    """Clean up after sessions whose host and watchdog both died; every reploy operation that
    touches Docker does this first, so such leftovers never accumulate."""
    manifests = tuple(path for directory in workload_dirs for path in sorted(
        reploy_watchdog.manifest_dir_for(str(directory.resolve())).glob("*.json")))
    try:
        receipts = reploy_watchdog.reconcile_orphans(backend.client, manifests)
    except (docker.errors.DockerException, OSError, ValueError) as e:
        raise BackendError(f"reconcile orphaned sessions: {error_text(e)}") from e
    for receipt in receipts:
        removed = receipt["removed"]
        log(f"reconciled crashed run {receipt['run_id']}: removed "
            f"{len(removed['containers'])} container(s), {len(removed['networks'])} network(s), "
            f"{len(removed['paths'])} path(s)")
    return receipts


def until_signalled(signals: HostSignals, work: Callable[[], Any]) -> Any:
    """work()'s value (or its exception), computed in a thread; None as soon as SIGINT or
    SIGTERM comes first. work() only reads files and asks the engine, but either may block
    without end (a FIFO where a state file belongs, a hung filesystem or engine): a signal
    abandons it where it is. It holds nothing the run must clean up, and the host exits
    without waiting for it (run_command)."""
    notifier = Notifier()

    def run() -> None:
        try:
            value: Any = work()
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it:
            value = e  # whatever it is, the caller must not wait for a report that never comes
        notifier.report("done", value)

    threading.Thread(target=run, name="prepare", daemon=True).start()
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(notifier.read_fd, selectors.EVENT_READ)
            selector.register(signals.read_fd, selectors.EVENT_READ)
            while True:
                if signals.drain():
                    return None
                for _tag, value in notifier.drain():
                    if isinstance(value, BaseException):
                        raise value
                    return value
                selector.select()
    finally:
        notifier.close()


def prepare_run(options: RunOptions) -> RunResult | tuple[SessionPlan, DockerBackend]:
    """Admission, planning from the deployments' files, then the engine (reconciling what
    crashed runs left): the session's plan and backend, or the result that refuses it."""
    try:
        controller, workload = admit(options)
    except AdmissionError as e:
        return RunResult(error=f"admission rejected: {e}")
    try:
        session_plan = plan(options, controller, workload)
    except PlanRejected as e:
        return RunResult(error=f"plan rejected: {e}",
                         controller_output=requested_output_status(options))
    try:
        backend = DockerBackend()
        reconcile(backend, [workload.dir, controller.dir])
    except BackendError as e:
        return RunResult(error=f"admission rejected: {e}")
    return session_plan, backend


def run_controlled_session(options: RunOptions, signals: HostSignals) -> RunResult:
    """Admission, planning, then the session. A signal before the session begins cancels it at
    once: nothing of it exists yet, and every other field of the result is null."""
    prepared = until_signalled(signals, lambda: prepare_run(options))
    if prepared is None:
        assert signals.first is not None  # until_signalled gives None only for a signal
        return RunResult(error=f"cancelled by {signal.Signals(signals.first).name}")
    if isinstance(prepared, RunResult):
        return prepared
    session_plan, backend = prepared
    return ControlledSession(options, session_plan, backend, signals).run()


def exit_code(result: RunResult, signum: Optional[int]) -> int:
    """0 exactly when ok; otherwise 130/143 when SIGINT/SIGTERM came before the result
    (whatever the run was doing then), else 1."""
    if result.ok:
        return EXIT_OK
    return EXIT_FOR_SIGNAL[signum] if signum is not None else EXIT_FAILED


# ============================================================================================
# CLI
# ============================================================================================


class StoreOnce(argparse.Action):
    """`store` for an option that takes one value: given twice, it is a usage error rather
    than the last one silently winning. What was given is noted on the namespace itself (one
    per parse), under GIVEN_ONCE."""

    GIVEN_ONCE = "_reploy_given_once"

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: Optional[str] = None) -> None:
        given = vars(namespace).setdefault(self.GIVEN_ONCE, set())
        if self.dest in given:
            parser.error(f"{option_string or self.dest} was given more than once")
        given.add(self.dest)
        setattr(namespace, self.dest, values)


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of exiting, so main() owns exit codes; that
    takes no abbreviated option (`--work` is not `--workload-dir`); and whose single-valued
    options may be given once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self.register("action", None, StoreOnce)
        self.register("action", "store", StoreOnce)

    def error(self, message: str) -> Any:
        raise UsageError(message)


_ASCII_NUMBER = re.compile(r"[0-9]{1,10}")


def ascii_number(text: str) -> int:
    """A command-line number: ASCII digits only (int() would also take `8_0`, ` 80`, `+80`
    and digits of other scripts)."""
    if not _ASCII_NUMBER.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number written in ASCII digits")
    return int(text)


def build_parser() -> ArgumentParser:
    """The command line. `serve` and `session` are here to be listed (help, invalid choices):
    main() hands them over to the control plane before anything is parsed."""
    parser = ArgumentParser(
        prog="reploy", description="Sandboxed, controllable sessions on Docker.",
        epilog="Managed sessions: `reploy serve --help` and `reploy session --help` (run by "
               f"{CONTROL_PLANE_FILE}).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser,
                                     metavar="COMMAND")
    p_stage = commands.add_parser("stage", help="validate a blueprint and stage a deployment")
    p_stage.add_argument("blueprint", type=Path, help="the blueprint file (YAML)")
    p_stage.add_argument("--dir", type=Path, required=True,
                         help="the staging directory, made or restaged in place (required)")
    p_build = commands.add_parser(
        "build", help="build a staged deployment's image: progress on stderr, the JSON "
                      "result on stdout")
    p_build.add_argument("--dir", type=Path, required=True,
                         help="the staged deployment's directory (required)")
    p_build.add_argument("-q", "--quiet", action="store_true",
                         help="do not show the build's progress on stderr (default: shown)")
    p_session = commands.add_parser("controlled-session",
                                    help="controlled sessions: `run` one, `cleanup` after crashes")
    session_commands = p_session.add_subparsers(dest="action", required=True,
                                                parser_class=ArgumentParser, metavar="ACTION")
    cleanup = session_commands.add_parser(
        "cleanup", help="remove what crashed sessions left behind (host and watchdog both dead)")
    cleanup.add_argument("--workload-dir", type=Path, action="append", default=[],
                         help="also read this deployment's session manifests, which catch runs "
                              "that died before creating anything (repeatable; default: none, "
                              "the engine's labelled leftovers only)")
    run = session_commands.add_parser(
        "run", help="run one controlled session and print its JSON result",
        usage="reploy controlled-session run --controller-dir DIR --workload-dir DIR "
        "[options] -- CONTROLLER_COMMAND [ARG ...]")
    run.add_argument("--controller-dir", type=Path, required=True, metavar="DIR",
                     help="the built controller deployment (required)")
    run.add_argument("--workload-dir", type=Path, required=True, metavar="DIR",
                     help="the built workload deployment (required)")
    run.add_argument("--endpoint", action="append", default=[], metavar="ID",
                     help="grant the controller this endpoint of the workload's blueprint "
                          "(repeatable; default: none, no network)")
    run.add_argument("--columns", type=ascii_number, metavar="N",
                     help=f"the terminal's width, with --rows ({wire.MIN_DIMENSION}.."
                          f"{wire.MAX_DIMENSION}; default {DEFAULT_COLUMNS})")
    run.add_argument("--rows", type=ascii_number, metavar="N",
                     help=f"the terminal's height, with --columns ({wire.MIN_DIMENSION}.."
                          f"{wire.MAX_DIMENSION}; default {DEFAULT_ROWS})")
    outputs = run.add_mutually_exclusive_group()
    outputs.add_argument("--output-file", type=Path, metavar="FILE",
                         help="publish the controller's output file here (default: none)")
    outputs.add_argument("--output-dir", type=Path, metavar="DIR",
                         help="publish the controller's output directory here (default: none)")
    for option in TIMEOUT_OPTIONS:
        run.add_argument(option.flag, metavar="DURATION",
                         help=f"default {format_duration(option.default_ms)} "
                              f"({format_duration(option.min_ms)}.."
                              f"{format_duration(option.max_ms)})")
    for name, what in (("serve", "run the managed-session control plane (REST API, web UI)"),
                       ("session", "drive managed sessions through a running serve")):
        commands.add_parser(name, add_help=False, help=f"{what}; `reploy {name} --help`")
    return parser


def parse_run_options(args: argparse.Namespace, command: list[str]) -> RunOptions:
    if not command:
        raise UsageError("missing the controller command after --")
    if (args.columns is None) != (args.rows is None):
        raise UsageError("--columns and --rows go together")
    columns = DEFAULT_COLUMNS if args.columns is None else args.columns
    rows = DEFAULT_ROWS if args.rows is None else args.rows
    for flag, value in (("--columns", columns), ("--rows", rows)):
        if not wire.MIN_DIMENSION <= value <= wire.MAX_DIMENSION:
            raise UsageError(f"{flag} must be from {wire.MIN_DIMENSION} to {wire.MAX_DIMENSION}")
    timeouts: dict[str, int] = {}
    for option in TIMEOUT_OPTIONS:
        text = getattr(args, option.flag[2:].replace("-", "_"))
        if text is None:
            timeouts[option.flag] = option.default_ms
            continue
        try:
            ms = parse_duration_ms(text)
        except ValueError as e:
            raise UsageError(f"{option.flag}: {e}") from None
        if not option.min_ms <= ms <= option.max_ms:
            raise UsageError(f"{option.flag}: {text} is outside "
                             f"{format_duration(option.min_ms)} through "
                             f"{format_duration(option.max_ms)}")
        timeouts[option.flag] = ms
    return RunOptions(
        controller_dir=args.controller_dir, workload_dir=args.workload_dir,
        endpoints=tuple(args.endpoint), columns=columns, rows=rows,
        output_file=args.output_file.absolute() if args.output_file else None,
        output_dir=args.output_dir.absolute() if args.output_dir else None,
        timeouts_ms=timeouts, command=tuple(command))


def emit(obj: dict[str, Any], to_stderr: bool = False) -> None:
    stream = sys.stderr if to_stderr else sys.stdout
    stream.buffer.write(wire.encode_compact(printable_json(obj)) + b"\n")
    stream.buffer.flush()


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    hand_over_to_control_plane(argv)  # before parsing: the parser only lists those commands
    argv, command = split_command(argv)
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "action", None) == "run":
            options = parse_run_options(args, command)
        elif command:
            raise UsageError("only controlled-session run takes arguments after --")
    except UsageError as e:
        print(f"reploy: usage error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if getattr(args, "action", None) == "run":
        with HostSignals() as signals:  # until the result is out: a signal never loses it
            try:
                result = run_controlled_session(options, signals)
            except Exception as e:  # noqa: BLE001 - after valid parsing, stdout is a result
                log(f"internal error: {e!r}")
                result = RunResult(error=f"internal error: {e!r}")
            signals.drain()
            if signals.first is not None:
                result.received_signal = signal.Signals(signals.first).name
            result.error = result.summary()
            sys.stdout.buffer.write(result.encode())
            sys.stdout.buffer.flush()
            return exit_code(result, signals.first)
    release_held_signals()  # these commands keep the interpreter's own signal handling
    schema = {"stage": STAGE_SCHEMA, "build": BUILD_SCHEMA}.get(args.command, CLEANUP_SCHEMA)
    try:
        if args.command == "stage":
            emit(stage(args.blueprint, args.dir))
        elif args.command == "build":
            backend = DockerBackend()
            reconcile(backend, [args.dir])
            emit(build(args.dir, backend, show=unshown if args.quiet else
                       functools.partial(print, file=sys.stderr, flush=True)))
        else:
            receipts = reconcile(DockerBackend(), args.workload_dir)
            cleaned = all(r["cleanup_succeeded"] for r in receipts)
            emit({"schema": CLEANUP_SCHEMA, "ok": cleaned, "error": None, "receipts": receipts})
            if not cleaned:  # what remains is named in the receipts; the caller must see it
                return EXIT_FAILED
    except ReployError as e:
        print(f"reploy: {args.command}: {e}", file=sys.stderr)
        emit({"schema": schema, "ok": False, "error": str(e)})
        return EXIT_FAILED
    return EXIT_OK


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the options, the command after the first `--`)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def run_as_process(main_function: Callable[[], int]) -> None:
    """A role's main() as a process: flush, then exit without the interpreter's teardown.
    Every session resource is released inside main(); what remains is interpreter teardown of
    the Docker SDK's modules, which would add tens of milliseconds to every command."""
    code = main_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_command() -> None:
    """The command line. `python3 reploy.py` comes here with the signals held and `serve` and
    `session` handed over already (its first statements); the installed `reploy` command
    (pyproject.toml's entry point) imports this module and starts here, so it gets both from
    here on: the hold, from before its command line is parsed, and the hand-over (main's)."""
    global SIGNAL_MASK_BEFORE_HOLD
    if SIGNAL_MASK_BEFORE_HOLD is None:
        SIGNAL_MASK_BEFORE_HOLD = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    run_as_process(main)


if __name__ == "__main__":
    run_command()
