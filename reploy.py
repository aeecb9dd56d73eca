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

Reading order: the launch (which comes before the imports: see there), constants, exceptions,
value types, pure cores (durations, blueprints, the lifecycle machine, the run result), Docker
adapters, deployments, directories a container can write, the controlled session, CLI.
"""

from __future__ import annotations

import marshal
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
#: The role files this one imports as it starts (they sit beside it).
SIBLING_MODULES = ("reploy_session_client", "reploy_watchdog", "agent")
#: What the re-executed interpreter runs, given this file's path, then a descriptor holding
#: (module name, file, code) of each sibling and of this file (marshal), then the command:
#: the modules run in that order, this file's last, as if imported.
MODULE_LAUNCHER = "\n".join((
    "import marshal, os, sys, types",
    "sys.argv[0] = sys.argv.pop(1)",  # this file, as when the script runs
    "sys.path[0] = os.path.dirname(sys.argv[0])",  # in place of -c's working directory
    "for name, path, code in marshal.loads(open(int(sys.argv.pop(1)), 'rb').read()):",
    "    module = sys.modules[name] = types.ModuleType(name)",
    "    module.__file__ = path",
    "    exec(code, module.__dict__)",
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


def hand_over_to_control_plane() -> None:
    """`reploy serve|session ...` becomes `reploy_serve.py serve|session ...` in this process."""
    if sys.argv[1:2] and sys.argv[1] in CONTROL_PLANE_COMMANDS:
        control_plane = os.path.join(os.path.dirname(os.path.abspath(__file__)), CONTROL_PLANE_FILE)
        if not os.path.isfile(control_plane):
            print(f"reploy: {sys.argv[1]}: {control_plane} is missing; it must sit beside "
                  "reploy.py", file=sys.stderr)
            sys.exit(1)
        os.execv(sys.executable, [sys.executable, *(interpreter_options() or []), control_plane,
                                  *sys.argv[1:]])


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
        code_file.write(marshal.dumps(modules))
    os.lseek(compiled, 0, os.SEEK_SET)
    os.set_inheritable(compiled, True)
    os.execv(sys.executable, [sys.executable, *options, "-c", MODULE_LAUNCHER, script,
                              str(compiled), *sys.argv[1:]])


if __name__ == "__main__" and sys.executable:
    hand_over_to_control_plane()
    if __spec__ is None:
        relaunch_as_module()

import argparse
import contextlib
import enum
import errno
import hashlib
import io
import json
import queue
import re
import secrets
import selectors
import shutil
import signal
import socket
import stat
import struct
import tarfile
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import docker
import docker.errors
import docker.transport
import requests.exceptions
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reploy_session_client as wire  # noqa: E402  (the shared codec; see the docstring)
import reploy_watchdog  # noqa: E402  (the cleanup role; the host reuses its reconciliation)
import agent as agent_role  # noqa: E402  (the data-plane role; `session cp` reuses its archive rules)
from reploy_session_client import (  # noqa: E402
    Cause, FrameKind, RecoveryAction, SessionResult, Status,
)

# ============================================================================================
# Constants
# ============================================================================================

#: Reploy's release: one value in all four role files (a test checks), named by the offline bundle.
__version__ = "0.1.0"

CLIENT_SOURCE = Path(wire.__file__).resolve()
#: Where the client lands in the derived controller image: a directory the derived image puts
#: first on PATH, ahead of the image's own PATH (or the Engine's default, when it sets none).
CLIENT_DIR = "/usr/local/bin"
CLIENT_INSTALL_PATH = f"{CLIENT_DIR}/reploy-session-client"
ENGINE_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The derived controller image is the controller generation (FROM) plus these instructions:
#: one layer, the client.
DERIVED_LAYER = (f"COPY reploy-session-client {CLIENT_INSTALL_PATH}\n"
                 f'ENV PATH="{CLIENT_DIR}:${{PATH:-{ENGINE_DEFAULT_PATH}}}"\n')
#: The container-side HOME of both roles: a private tmpfs owned by the runtime uid:gid.
CONTAINER_HOME = "/mnt/reploy-home"
HOME_TMPFS_SIZE = "64m"
#: What a root supervisor (ContainerSpec.root_supervisor) keeps: to start the workload as the
#: runtime uid:gid (SETUID, SETGID) and to signal it (KILL).
SUPERVISOR_CAPABILITIES = ("SETUID", "SETGID", "KILL")
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
#: Bytes of a controller container's log copied to the host's stderr at teardown.
CONTROLLER_LOG_TAIL_BYTES = 64 * 1024
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
#: thousands of 4 KiB ones. Small output (an echo, a prompt) still goes at once.
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
HOLDER_PIDS = 4
HOLDER_HOSTNAME = "session"
WORKLOAD_HOST = "workload"

LABEL_RUN = reploy_watchdog.LABEL_RUN
LABEL_ROLE = "io.reploy.session.role"
LABEL_DEPLOYMENT = "io.reploy.deployment"
LABEL_GENERATION = "io.reploy.generation"
LABEL_DERIVED_BASE = "io.reploy.derived.base-image"
LABEL_CLIENT_DIGEST = "io.reploy.derived.client-digest"

STATE_SCHEMA = "reploy-deployment-state-v1"
STAGE_SCHEMA = "reploy-stage-result-v1"
CLEANUP_SCHEMA = "reploy-cleanup-result-v1"
BUILD_SCHEMA = "reploy-build-result-v1"
STATE_DIRNAME = ".reploy"
BLUEPRINT_NAME = "blueprint.yaml"
CONTEXT_DIRNAME = "context"
PRIVATE_ENV_NAME = ".env"

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_FOR_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


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
    if not 16 <= pids <= 65536:
        raise BlueprintError("environment.runtime.pids: must be 16..65536")
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


class LifecycleMachine:
    """Applies LIFECYCLE_TABLE and latches the first termination cause."""

    def __init__(self) -> None:
        self.phase = Phase.PREPARING
        self.cause: Optional[Cause] = None
        self.reached_ready = False

    def _apply(self, transition: Transition) -> None:
        try:
            self.phase = LIFECYCLE_TABLE[(self.phase, transition)]
        except KeyError:
            raise LifecycleError(f"{transition.value} is illegal in {self.phase.value}") from None

    def ready(self) -> None:
        self._apply(Transition.READY)  # PREPARING -> ACTIVE
        self.reached_ready = True

    def terminate(self, cause: Cause) -> bool:
        """Begin termination; True only for the call that latched the cause."""
        self._apply(Transition.TERMINATE)  # PREPARING|ACTIVE|TERMINATING -> TERMINATING
        if self.cause is not None:
            return False
        self.cause = cause
        return True

    def finish(self) -> None:
        self._apply(Transition.FINISH)  # TERMINATING -> TERMINATED


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
            mem_limit=f"{self.runtime.memory_mib}m",
            memswap_limit=f"{self.runtime.memory_mib}m",
            ipc_mode="private",
            init=self.init,
            log_config={"type": "json-file", "config": {"max-size": "1m", "max-file": "1"}}
            if not self.tty else {"type": "none", "config": {}},
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
    def build(self, **kwargs: Any) -> str:
        image, _logs = self.client.images.build(rm=True, forcerm=True, pull=False, **kwargs)
        return image.id

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
        return self.api.create_container(**spec.create_kwargs(self.api))["Id"]

    @_docker_call("attach to the workload")
    def attach_pty(self, container_id: str) -> socket.socket:
        """The hijacked attach stream of a TTY container: the PTY itself, as a raw socket."""
        raw = self.api.attach_socket(
            container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
        sock = getattr(raw, "_sock", raw)
        sock.setblocking(False)
        # Keep the HTTP response alive with the socket; it owns the connection.
        return sock

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
        api = docker.APIClient(version=self.api.api_version, timeout=None,
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
        doc = yaml.safe_load(raw)
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
            return parse_blueprint(yaml.safe_load(raw))
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
    state: dict[str, Any] = {"schema": STATE_SCHEMA, "deployment_id": uuid.uuid4().hex,
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


def build(directory: Path, backend: DockerBackend) -> dict[str, Any]:
    """Build the staged context and record it as the new current generation, atomically,
    together with the exact blueprint it was built from."""
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
#     /proc/self/fd/N (agent_role.connect_unix_at): the very inode checked.
#   - Entries are removed without following them, trees fd by fd and without recursion.
#
# Whatever else a container leaves there fails that session's step with an error naming the
# entry; it never stops the host, and no byte behind a link is ever read.


class ContainerPathError(OSError):
    """An entry a container could write is not what the host expects (a symlink, a FIFO...)."""


def _not_expected(name: str, mode: int, expected: str) -> ContainerPathError:
    return ContainerPathError(errno.EINVAL,
                              f"{name} is a {agent_role.file_type(mode)}, not {expected}")


@contextlib.contextmanager
def opened_dir(path: Path) -> Iterator[int]:
    """The directory at `path` (whose own path the host owns), not followed if it is a link."""
    fd = os.open(path, agent_role.DIR_OPEN_FLAGS)
    try:
        yield fd
    finally:
        os.close(fd)


def open_regular_file(dir_fd: int, name: str) -> int:
    """`name` of a directory opened for reading, only when it is a regular file itself."""
    try:
        fd = os.open(name, agent_role.FILE_READ_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENXIO):  # a symlink; a socket
            raise
        st = agent_role.lstat_at(dir_fd, name)
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
    st = agent_role.lstat_at(dir_fd, name)
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
    image, and how the image is derived)."""
    client_digest = hashlib.sha256(CLIENT_SOURCE.read_bytes()).hexdigest()
    key = hashlib.sha256(f"{base_image_id}\n{client_digest}\n{DERIVED_LAYER}".encode()
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
    status = obj.get("status") if isinstance(obj.get("status"), dict) else {}
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


def build_derived_image(backend: DockerBackend, base_image_id: str) -> str:
    """The controller generation plus one layer holding the client, first on PATH; returns
    its image id."""
    reference, client_digest = derived_image_reference(base_image_id)
    client_bytes = CLIENT_SOURCE.read_bytes()
    dockerfile = f"FROM {base_image_id}\n{DERIVED_LAYER}".encode()
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        for name, data, mode in (("Dockerfile", dockerfile, 0o644),
                                 ("reploy-session-client", client_bytes, 0o755)):
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
    the first one that came before the result decides a failed run's exit code (130, 143)."""

    def __init__(self) -> None:
        super().__init__(tuple(EXIT_FOR_SIGNAL))
        self.first: Optional[int] = None

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

    def arm(self) -> None:
        """Record the manifest, then arm the watchdog with it (starting the watchdog when none
        runs). Raises reploy_watchdog.WatchdogUnavailable."""
        self.record(self.manifest)
        self.link = reploy_watchdog.arm(self.manifest.run_id, self.manifest_path)
        self.record(replace(self.manifest, watchdog=self.link.watchdog))

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
            if len(data) >= OUTPUT_BULK_READ_BYTES:
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
                resize = wire.Resize(columns=size.get("columns"), rows=size.get("rows"))
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


class ControlledSession:
    """One run of `reploy controlled-session run`, from planning to the delivery tail.

    The phases are sequential code; waiting happens in `wait_until`, which runs one selector
    loop (the channel, the TerminalRelay's PTY and attachment, wait-thread notices, signals)
    until a condition holds or a deadline passes. The loop never decides the lifecycle on its
    own: it records facts (requests, EOFs, exits, signals) and latches causes through the
    LifecycleMachine.
    """

    def __init__(self, options: RunOptions, plan: SessionPlan, backend: DockerBackend,
                 signals: HostSignals) -> None:
        self.options = options
        self.plan = plan
        self.backend = backend
        self.signals = signals
        self.machine = LifecycleMachine()
        self.result = RunResult()
        self.owned = Owned()
        self.watchdog = Watchdog(plan.run_id, plan.workload.dir)
        self.notifier = Notifier()
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.notifier.read_fd, selectors.EVENT_READ, self.on_notice)
        self.selector.register(signals.read_fd, selectors.EVENT_READ, self.on_signal)
        #: The signal that cancelled the session (it latched host-cancel, or stopped planning).
        self.cancelled_by: Optional[int] = None
        #: Why the latched cause happened, in words (startup-failed and lost reasons use it).
        self.cause_detail = ""
        #: What off_loop() calls reported, by tag.
        self.call_results: dict[str, Any] = {}
        #: What to do on the loop the moment a call reports, by tag (see begin_call).
        self.call_handlers: dict[str, Callable[[Any], None]] = {}
        self.calls_started = 0
        self.listener: Optional[socket.socket] = None
        self.channel: Optional[wire.FramedConnection] = None
        self.channel_lost: Optional[str] = None
        self.interest = Interest(self.selector)
        self.relay = TerminalRelay(self.interest, lambda: self.machine.phase is Phase.ACTIVE,
                                   self.resize_workload)
        #: Why the handed-over attachment was refused, if it was.
        self.attachment_refused: Optional[str] = None
        self.complete_received = False
        self.ack_received = False
        self.workload_exit: Optional[int] = None
        #: The workload status the host reports, fixed before workload-outputs-finalized.
        self.workload_status: Optional[Status] = None
        self.exit_announced = False
        self.finalization_announced = False
        self.terminating_sent = False
        self.controller_exit: Optional[int] = None
        self.observation_lost: Optional[str] = None
        self.workload_started = False
        self.controller_started = False
        self.holder_lost: Optional[str] = None
        self.peer_cred: Optional[tuple[int, int, int]] = None

    # -- the whole run ----------------------------------------------------------------------

    def run(self) -> RunResult:
        """Every outcome, including our own bugs, ends in termination and the delivery tail.

        Planning (images, the derived controller image, the python probe) comes first, with
        the watchdog already armed; a plan that fails leaves nothing of the session and the
        result says only that. The startup timeout counts from the end of planning."""
        try:
            try:
                self.watchdog.arm()  # before the first container of the session exists
            except (reploy_watchdog.WatchdogUnavailable, OSError) as e:
                self.result.error = f"plan rejected: the watchdog could not be armed: " \
                                    f"{error_text(e)}"
                self.result.controller_output = requested_output_status(self.options)
                return self.result
            self.selector.register(self.watchdog.link, selectors.EVENT_READ, self.on_watchdog)
            try:
                controller_image = self.plan_images()
            except (PlanRejected, BackendError, OSError) as e:
                controller_image = None
                if self.cancelled_by is None:
                    self.result.error = f"plan rejected: {error_text(e)}"
            if controller_image is None:  # rejected, or cancelled while planning
                self.result.controller_output = requested_output_status(self.options)
                return self.result
            startup_deadline = time.monotonic() + self.options.timeout_s("--startup-timeout")
            try:
                workload = self.prepare(controller_image)
                self.start(workload, startup_deadline)
                self.wait_until(lambda: False)  # active: until a cause is latched
            except (StartupFailure, BackendError, OSError) as e:
                if self.machine.cause in (None, Cause.STARTUP_FAILURE):
                    self.result.error = f"startup failed: {error_text(e)}"
                self.latch(Cause.STARTUP_FAILURE, error_text(e))
            self.terminate()
        except Exception as e:  # noqa: BLE001 - a bug must still clean up and report
            log(f"internal error: {e!r}")
            self.result.error = f"internal error: {e!r}"
            if self.machine.cause is None:
                self.machine.terminate(Cause.STARTUP_FAILURE)
        finally:
            self.delivery_tail()
        return self.result

    def latch(self, cause: Cause, detail: str = "") -> bool:
        """Latch `cause` if none is latched yet; True when this call latched it."""
        if self.machine.phase is Phase.TERMINATED:
            return False
        if not self.machine.terminate(cause):
            return False
        self.cause_detail = detail
        log(f"terminating: {cause.value}{': ' + detail if detail else ''}")
        return True

    # -- planning ---------------------------------------------------------------------------

    def plan_images(self) -> Optional[str]:
        """The Docker half of planning: the engine can hold the sandbox, both generations'
        images exist, the derived controller image (built if new) and, unless it already
        passed on an engine configured like this one, its probe. Every Engine call here runs
        off the loop, so a signal cancels promptly. Returns the controller image to run, or
        None when a signal cancelled planning. Raises PlanRejected."""
        plan, backend = self.plan, self.backend
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

        checked = self.off_loop("check the engine and the images", check)
        if checked is None:
            return None
        probed, cached = checked
        if cached:
            return probed
        built = self.off_loop("build the controller image",
                              lambda _api: build_derived_image(backend, base_image))
        if built is None or not self.probe(built):
            return None  # cancelled: without the probed tag, the next session probes again
        backend.tag_image(built, probed)
        return probed

    def probe(self, image_id: str) -> bool:
        """Run the installed client in a container made like the controller's (PROBE_COMMAND)
        and refuse the plan, saying why, when it cannot run or when the engine did not give it
        the sandbox asked for (probe_refusal). The probe is a session container like the
        others: labelled, in the watchdog's manifest, removed in every outcome. False when a
        signal cancelled it."""
        runtime = self.plan.controller_blueprint.runtime
        container_id = self.acquire_container(ContainerSpec(
            role=PROBE_ROLE, image_id=image_id, command=PROBE_COMMAND, runtime=runtime,
            environment={"HOME": CONTAINER_HOME}, labels=self.labels(PROBE_ROLE)))

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
            outcome = self.off_loop("run the python probe", run_probe)
            if outcome is None:
                return False  # cancelled: the delivery tail removes the probe
            refusal = probe_refusal(*outcome, runtime)
        except PlanRejected as e:
            refusal = str(e)
        cleanup = self.await_removals(self.begin_removal(PROBE_ROLE), time.monotonic()
                                      + self.options.timeout_s("--cleanup-timeout"))
        if refusal is not None:
            with contextlib.suppress(BackendError):
                self.backend.remove_image(image_id)
            raise PlanRejected(refusal)
        if cleanup.kind != "succeeded":
            raise PlanRejected(f"the python probe could not be removed: {cleanup.reason}")
        return True

    def call_off_loop(self, what: str, call: Callable[[docker.APIClient], Any],
                      deadline: Optional[float], stop_on_latch: bool) -> tuple[bool, Any]:
        """Run a blocking Engine call in a thread while the loop goes on (signals, the
        channel). (True, its value or BackendError) once it returns; (False, None) when the
        deadline passed or (with stop_on_latch) a cause was latched first."""
        return self.await_call(self.begin_call(what, call), deadline, stop_on_latch)

    def begin_call(self, what: str, call: Callable[[docker.APIClient], Any],
                   on_done: Optional[Callable[[Any], None]] = None) -> str:
        """Start a blocking Engine call in a thread, so other work overlaps it; its tag, for
        await_call. `on_done` gets its value (or BackendError) on the loop as soon as it
        reports, awaited or not."""
        self.calls_started += 1
        tag = f"{CALL_TAG}{self.calls_started}"
        if on_done is not None:
            self.call_handlers[tag] = on_done

        def guarded(api: docker.APIClient) -> Any:
            try:
                return call(api)
            except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
                raise BackendError(f"{what}: {e}") from e

        self.backend.in_thread(tag, guarded, self.notifier.report)
        return tag

    def await_call(self, tag: str, deadline: Optional[float],
                   stop_on_latch: bool) -> tuple[bool, Any]:
        """The result of begin_call's call, as call_off_loop says."""
        if not self.wait_until(lambda: tag in self.call_results, deadline, stop_on_latch):
            return False, None
        return True, self.call_results.pop(tag)

    def off_loop(self, what: str, call: Callable[[docker.APIClient], Any]) -> Any:
        """A planning call (the engine's checks, an image build, the probe) that a signal
        cancels promptly: its value, or None when cancelled. Raises its ReployError."""
        finished, value = self.call_off_loop(what, call, None, stop_on_latch=True)
        if isinstance(value, ReployError):
            raise value
        return value if finished else None

    # -- preparing --------------------------------------------------------------------------

    def prepare(self, controller_image: str) -> ContainerSpec:
        """The channel, the outputs, the holder and the controller; returns the workload's
        spec, which start() creates while the controller starts."""
        plan = self.plan
        controller_runtime = plan.controller_blueprint.runtime
        self.open_channel(controller_runtime)
        self.watchdog.record_owned(self.owned)
        mounts = [Mount(str(self.owned.channel_dir), CHANNEL_MOUNT, read_only=True)]
        environment = {
            "HOME": CONTAINER_HOME,
            wire.SESSION_SOCKET_ENV: f"{CHANNEL_MOUNT}/{CHANNEL_SOCKET_NAME}",
        }
        mounts_env = self.prepare_outputs(controller_runtime)
        self.watchdog.record_owned(self.owned)
        for mount, (name, value) in mounts_env:
            mounts.append(mount)
            environment[name] = value
        network_mode = NETWORK_NONE
        if plan.endpoints:
            holder_id = self.acquire_container(ContainerSpec(
                role="holder", image_id=controller_image, command=HOLDER_COMMAND,
                runtime=Runtime(HOLDER_UID_GID, HOLDER_UID_GID, (), HOLDER_MEMORY_MIB,
                                HOLDER_PIDS),
                environment={}, labels=self.labels("holder"),
                extra_hosts=((WORKLOAD_HOST, "127.0.0.1"),), hostname=HOLDER_HOSTNAME))
            network_mode = f"container:{holder_id}"
        joined = network_mode != NETWORK_NONE
        self.acquire_container(ContainerSpec(
            role="controller", image_id=controller_image, command=plan.controller_argv,
            runtime=controller_runtime, environment=environment,
            labels=self.labels("controller"), network_mode=network_mode, mounts=tuple(mounts),
            hostname=None if joined else "controller", init=True))
        return ContainerSpec(
            role="workload", image_id=plan.workload.current.image_id,  # type: ignore[union-attr]
            command=(WORKLOAD_SHELL,), runtime=plan.workload_blueprint.runtime,
            environment={"HOME": CONTAINER_HOME, "TERM": WORKLOAD_TERM},
            labels=self.labels("workload"), network_mode=network_mode,
            tty=True, hostname=None if joined else WORKLOAD_HOST,
            console_size=(self.options.columns, self.options.rows))

    def acquire_container(self, spec: ContainerSpec) -> str:
        container_id = self.backend.create(spec)
        self.owned.containers[spec.role] = container_id
        self.owned.labels[container_id] = spec.labels
        self.watchdog.record_owned(self.owned)
        return container_id

    def labels(self, role: str) -> dict[str, str]:
        """Every session container says whose it is, for the watchdog and for reconciliation
        after a crash that took the watchdog too."""
        deployment = self.plan.workload if role == "workload" else self.plan.controller
        labels = {LABEL_RUN: self.plan.run_id, LABEL_ROLE: role,
                  reploy_watchdog.LABEL_HOST: self.watchdog.manifest.host,
                  reploy_watchdog.LABEL_WATCHDOG: self.watchdog.manifest.watchdog,
                  reploy_watchdog.LABEL_WORKLOAD_DIR: str(self.plan.workload.dir)}
        if role != "holder":  # the holder belongs to the session, not to a deployment
            labels[LABEL_DEPLOYMENT] = deployment.deployment_id
            labels[LABEL_GENERATION] = str(deployment.current.number)  # type: ignore[union-attr]
        return labels

    def open_channel(self, runtime: Runtime) -> None:
        """The private channel: a 0700 dir and a 0600 socket owned by the controller's uid:gid."""
        channel_dir = reploy_watchdog.channel_dir_for(str(self.plan.workload.dir), self.plan.run_id)
        channel_dir.parent.mkdir(parents=True, exist_ok=True)
        channel_dir.mkdir(mode=0o700)
        self.owned.channel_dir = channel_dir
        os.chown(channel_dir, runtime.uid, runtime.gid)
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
        socket_path = channel_dir / CHANNEL_SOCKET_NAME
        os.chown(socket_path, runtime.uid, runtime.gid, follow_symlinks=False)
        os.chmod(socket_path, 0o600)
        listener.listen(1)
        listener.setblocking(False)
        self.listener = listener
        self.selector.register(listener, selectors.EVENT_READ, self.on_listener)

    def prepare_outputs(self, runtime: Runtime) -> list[tuple[Mount, tuple[str, str]]]:
        """Mount the controller-only output destination, if one was requested."""
        options = self.options
        if options.output_dir is not None:
            try:
                make_output_dir(options.output_dir, runtime)
            except OSError as e:  # a startup failure; the requested output still has a fate
                self.result.controller_output = Status.of(
                    "controller_output", "failed",
                    reason=f"could not prepare the output directory: {error_text(e)}")
                raise
            self.result.controller_output = Status.of("controller_output", "directory-retained")
            return [(Mount(str(options.output_dir.resolve()), OUTPUT_DIR_MOUNT, False),
                     ("REPLOY_OUTPUT_DIR", OUTPUT_DIR_MOUNT))]
        if options.output_file is not None:
            staging = Path(tempfile.mkdtemp(prefix=f".reploy-output-{self.plan.run_id[:8]}-",
                                            dir=options.output_file.parent))
            os.chown(staging, runtime.uid, runtime.gid)
            os.chmod(staging, 0o700)
            self.owned.output_staging_dir = staging
            return [(Mount(str(staging), OUTPUT_FILE_MOUNT, False),
                     ("REPLOY_OUTPUT_FILE", f"{OUTPUT_FILE_MOUNT}/{options.output_file.name}"))]
        self.result.controller_output = Status.of("controller_output", "not-requested")
        return []

    # -- starting ---------------------------------------------------------------------------

    def start(self, workload: ContainerSpec, deadline: float) -> None:
        """Start the session, overlapping what may overlap: while the controller starts, the
        workload is created and attached to. The workload itself starts only once the
        attachment is connected: a controller that never attaches leaves no workload process
        behind."""
        backend, plan = self.backend, self.plan
        holder_id = self.owned.containers.get("holder")
        if holder_id is not None:  # its namespace must exist before anything joins it
            backend.start(holder_id)
            backend.wait_in_thread(holder_id, self.notifier.report, "holder")
        controller_id = self.owned.containers["controller"]
        controller_start = self.begin_call("start the controller",
                                           lambda api: api.start(controller_id))
        try:
            workload_id = self.acquire_container(workload)
            # Attached before it starts: no byte is missed.
            self.relay.open_pty(backend.attach_pty(workload_id))
        finally:
            self.await_controller_start(controller_start, deadline)
        backend.wait_in_thread(controller_id, self.notifier.report, "controller")
        if not self.wait_until(lambda: self.channel is not None, deadline):
            raise StartupFailure(self.startup_shortfall("the controller did not connect"))
        self.send_event(wire.Opened(
            operations=wire.OPERATIONS, endpoints=plan.endpoints,
            columns=self.options.columns, rows=self.options.rows,
            output_finalization_timeout_milliseconds=OUTPUT_FINALIZATION_TIMEOUT_MS))
        if not self.wait_until(lambda: self.relay.attached, deadline):
            raise StartupFailure(self.startup_shortfall("no terminal attachment connected"))
        backend.start(workload_id)
        self.workload_started = True
        backend.resize(workload_id, self.options.columns, self.options.rows)
        backend.wait_in_thread(workload_id, self.notifier.report, "workload")
        if self.machine.phase is not Phase.PREPARING:
            return
        self.machine.ready()
        self.send_event(wire.Ready())

    def await_controller_start(self, tag: str, deadline: float) -> None:
        """The controller's start call, begun in start(): it is not cut short (the controller
        may be running once it returns, and the delivery tail must know)."""
        finished, value = self.await_call(tag, deadline, stop_on_latch=False)
        if isinstance(value, BackendError):
            raise value
        self.controller_started = True  # or still starting, past the deadline: stop it later
        if not finished:
            raise StartupFailure("the controller did not start within the startup timeout")

    def startup_shortfall(self, what: str) -> str:
        """Why startup stopped short, in the words most useful to the user."""
        if self.attachment_refused:
            return self.attachment_refused
        if self.holder_lost:
            return f"{what}: {self.holder_lost}"
        if self.controller_exit is not None:
            last_line = ""
            with contextlib.suppress(BackendError):
                lines = self.backend.log_tail(self.owned.containers["controller"]).splitlines()
                last_line = lines[-1].decode(errors="replace")[:300] if lines else ""
            return (f"{what}: the controller exited with code {self.controller_exit}"
                    + (f" ({last_line})" if last_line else ""))
        if self.channel_lost:
            return f"{what}: {self.channel_lost}"
        if self.machine.cause is not None:
            return f"{what} before termination began ({self.machine.cause.value})"
        return f"{what} within the startup timeout"

    # -- the loop ---------------------------------------------------------------------------

    def wait_until(self, condition: Callable[[], bool], deadline: Optional[float] = None,
                   stop_on_latch: bool = True) -> bool:
        """Run the loop until condition() (True), the deadline, or (if stop_on_latch) a cause
        being latched (False): phases that must end on any cause wait with stop_on_latch.

        A deadline is a barrier: a condition seen to hold only once it passed did not hold in
        time (False), however the loop got there late (a host suspended and resumed, a slow
        pass), so what came after a deadline never counts as before it."""
        while True:
            if condition():
                return deadline is None or time.monotonic() <= deadline
            if stop_on_latch and self.machine.cause is not None:
                return False
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                return False
            self.loop_once(timeout)

    def loop_once(self, timeout: Optional[float]) -> None:
        """One pass, fixed order: set interest, select, then handle what is ready."""
        if self.channel is not None:
            self.interest.set(self.channel.sock, self.on_channel, selectors.EVENT_READ | (
                selectors.EVENT_WRITE if self.channel.wants_write else 0))
        self.relay.set_interest()
        for key, mask in self.selector.select(self.relay.timeout(timeout)):
            key.data(mask)

    def on_signal(self, _mask: int) -> None:
        """SIGINT/SIGTERM cancel the session (host-cancel), if nothing else ended it first;
        one that comes later changes none of the termination's steps, each bounded anyway
        (main() still exits 130/143 when the result is not ok)."""
        for signum in self.signals.drain():
            name = signal.Signals(signum).name
            if self.latch(Cause.HOST_CANCEL, f"received {name}"):
                self.cancelled_by = signum
                self.result.error = f"cancelled by {name}"
            else:
                log(f"received {name}; the session is already ending")

    def on_watchdog(self, _mask: int) -> None:
        """The watchdog never speaks after `armed`: its link turning readable means it died."""
        assert self.watchdog.link is not None
        self.selector.unregister(self.watchdog.link)
        if self.watchdog.rearm():
            self.selector.register(self.watchdog.link, selectors.EVENT_READ, self.on_watchdog)

    def on_notice(self, _mask: int) -> None:
        for tag, value in self.notifier.drain():
            if tag == "workload":
                if isinstance(value, Exception):
                    self.observation_lost = str(value)
                    self.latch(Cause.RUNTIME_OBSERVATION_LOST, str(value))
                else:
                    self.workload_exit = value
                    self.latch(Cause.WORKLOAD_EXIT if self.machine.reached_ready
                               else Cause.STARTUP_FAILURE, f"the workload exited with code {value}")
                    self.announce_workload_exit()
            elif tag == "controller":
                self.controller_exit = value if isinstance(value, int) else None
                if isinstance(value, Exception):
                    log(f"lost sight of the controller: {value}")
                if self.machine.reached_ready:
                    self.latch(Cause.CONTROLLER_LOST, "the controller container exited")
                elif self.machine.phase is Phase.PREPARING:
                    self.latch(Cause.STARTUP_FAILURE, "the controller exited during startup")
            elif tag == "holder":
                self.lose_holder(value)
            elif tag == "kill" and isinstance(value, Exception):
                log(f"could not kill the workload: {value}")
            elif tag.startswith(CALL_TAG):
                self.call_results[tag] = value
                handler = self.call_handlers.pop(tag, None)
                if handler is not None:
                    handler(value)

    def lose_holder(self, value: Any) -> None:
        """The holder of a granted session's network namespace exited or was removed.

        Before the session containers have joined its namespace there is nothing to join: a
        startup failure. Once they have, the namespace lives on in them (a network namespace
        lasts while any process is in it, and it holds nothing but `lo`), so the session and its
        isolation are unaffected: the controller hears a diagnostic, nothing is invented about
        the workload, and cleanup finds the holder gone."""
        how = (f"exited with code {value}" if isinstance(value, int) else f"was lost: {value}")
        self.holder_lost = f"the session's network namespace holder {how}"
        if self.machine.phase is Phase.PREPARING:
            self.latch(Cause.STARTUP_FAILURE, self.holder_lost)
        elif self.machine.phase is not Phase.TERMINATED:
            log(f"{self.holder_lost}; the session's namespace lives on in its containers")
            if not self.finalization_announced:
                self.send_event(wire.Diagnostic(code="namespace_holder_lost",
                                                message=self.holder_lost))

    def announce_workload_exit(self) -> None:
        """workload-exit precedes terminating when it is the cause; otherwise it follows. Never
        after workload-outputs-finalized: the workload status was fixed before it, and an exit
        seen later changes nothing the controller hears or the result says."""
        if (self.workload_exit is None or self.exit_announced or self.finalization_announced
                or not self.machine.reached_ready
                or not (self.machine.cause is Cause.WORKLOAD_EXIT or self.terminating_sent)):
            return
        self.exit_announced = True
        self.send_event(wire.WorkloadExit(status=process_status(self.workload_exit)))

    def on_listener(self, _mask: int) -> None:
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        pid, uid, gid = struct.unpack("3i", conn.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        runtime = self.plan.controller_blueprint.runtime
        if (uid, gid) != (runtime.uid, runtime.gid):
            log(f"refused a channel peer with uid:gid {uid}:{gid} (pid {pid})")
            conn.close()
            return
        self.peer_cred = (pid, uid, gid)
        self.close_listener()  # exactly one peer; the path is gone from now on
        self.channel = wire.FramedConnection(
            conn, descriptor_kinds=frozenset({FrameKind.ATTACHED}))
        self.interest.set(conn, self.on_channel, selectors.EVENT_READ)

    def close_listener(self) -> None:
        if self.listener is None:
            return
        self.selector.unregister(self.listener)
        self.listener.close()
        self.listener = None
        assert self.owned.channel_dir is not None
        with contextlib.suppress(FileNotFoundError):
            (self.owned.channel_dir / CHANNEL_SOCKET_NAME).unlink()

    def on_channel(self, mask: int) -> None:
        channel = self.channel
        assert channel is not None
        try:
            if mask & selectors.EVENT_WRITE:
                channel.flush()
            if mask & selectors.EVENT_READ:
                frames = iter(channel.receive())
                try:
                    for frame in frames:
                        self.on_frame(frame)
                finally:  # frames a failure left unhandled keep no descriptor open
                    wire.close_descriptors(d for frame in frames for d in frame.descriptors)
                if channel.eof:
                    self.lose_channel("the controller closed the session channel")
        except wire.ProtocolError as e:
            self.lose_channel(f"channel protocol violation: {e.message}")
        except OSError as e:
            self.lose_channel(f"channel failed: {error_text(e)}")

    def lose_channel(self, reason: str) -> None:
        if self.channel is None:
            return
        self.interest.set(self.channel.sock, self.on_channel, 0)
        self.channel.close()
        self.channel = None
        self.channel_lost = reason
        if self.machine.phase is Phase.PREPARING:
            self.latch(Cause.STARTUP_FAILURE, reason)
        else:
            self.latch(Cause.CONTROLLER_LOST, reason)

    def on_frame(self, frame: wire.Frame) -> None:
        """A frame from the broker: the attachment's hand-over, or a public request."""
        if frame.kind is FrameKind.ATTACHED:
            self.adopt_attachment(frame)
        elif frame.kind is FrameKind.REQUEST:
            self.on_request(wire.decode_message(frame.payload + b"\n", wire.Direction.REQUEST))
        else:
            raise wire.FramingError(f"unexpected {frame.kind.name} frame from the controller")

    def adopt_attachment(self, frame: wire.Frame) -> None:
        """The broker handed over the attachment's own connection: terminal bytes go straight
        between it and the engine from now on. A connection that is not what an attachment's
        must be is refused, and startup fails closed."""
        try:
            if self.relay.attached or self.attachment_refused:
                raise wire.FramingError("a second attachment was handed over")
            if frame.json() != {}:
                raise wire.FramingError("an ATTACHED frame carries an empty object")
        except wire.ProtocolError:
            wire.close_descriptors(frame.descriptors)
            raise
        runtime = self.plan.controller_blueprint.runtime
        try:
            sock = attachment_socket(frame.descriptors, runtime.uid, runtime.gid)
        except AttachmentRefused as e:
            self.attachment_refused = f"the terminal attachment was refused: {e}"
            log(self.attachment_refused)
            if self.machine.phase is Phase.PREPARING:
                self.latch(Cause.STARTUP_FAILURE, self.attachment_refused)
            return
        self.relay.adopt(sock)

    def on_request(self, request: wire.Message) -> None:
        if isinstance(request, wire.Resize):
            if self.machine.phase is Phase.ACTIVE:
                self.resize_workload(request.columns, request.rows)
        elif isinstance(request, wire.Terminate):
            if self.machine.phase is Phase.ACTIVE:
                self.latch(Cause.CONTROLLER_TERMINATE)
        elif isinstance(request, wire.Complete):
            self.complete_received = True
        elif isinstance(request, wire.AcknowledgeTerminated):
            self.ack_received = True

    def resize_workload(self, columns: int, rows: int) -> None:
        """A resize the session honours (a structured one, or the attachment's SIGWINCH)."""
        try:
            self.backend.resize(self.owned.containers["workload"], columns, rows)
        except BackendError as e:  # e.g. racing the workload's exit: not fatal
            log(f"could not resize the workload's terminal: {e}")

    def send_event(self, event: wire.Message) -> None:
        if self.channel is not None:
            self.channel.send(wire.encode_frame(FrameKind.EVENT,
                                                wire.encode_compact(event.to_json())))

    # -- terminating ------------------------------------------------------------------------

    def terminate(self) -> None:
        """The termination sequence; each step is bounded and each outcome a separate fact.

        Every workload fact goes out before workload-outputs-finalized: the drain's outcome
        is decided at its deadline, then the exit is awaited (a failed drain abandons the PTY
        so the Engine can finish it), announced if seen, and the workload status fixed; only
        then is finalization announced. After it the controller hears only `terminated`.
        The workload's removal runs while the controller finalizes; it ends before
        `terminated`, as the contract wants."""
        machine = self.machine
        cause = machine.cause
        assert cause is not None
        output_deadline = time.monotonic() + OUTPUT_FINALIZATION_TIMEOUT_MS / 1000.0
        if machine.reached_ready:
            self.send_event(wire.Terminating(cause=cause))
            self.terminating_sent = True
            self.announce_workload_exit()  # an exit seen before terminating went out
        self.stop_workload()
        output_status = self.finalize_output(output_deadline)
        self.await_workload_exit()
        self.workload_status = self.final_workload_status()
        self.announce_workload_exit()
        self.announce_outputs_finalized(output_status)
        self.relay.close_pty()
        cleanup_deadline = time.monotonic() + self.options.timeout_s("--cleanup-timeout")
        removal = self.begin_removal("workload")
        controller_finalization = self.controller_finalization()
        workload_cleanup = self.await_removals(removal, cleanup_deadline)
        observation = Status.of("runtime_observation", "maintained")
        if self.observation_lost:
            observation = Status.of("runtime_observation", "lost", reason=self.observation_lost)
        session_result = SessionResult(
            cause=cause,
            workload_status=self.workload_status,
            workload_output_finalization_status=output_status,
            runtime_observation_status=observation,
            controller_finalization_status=controller_finalization,
            cleanup_status=workload_cleanup,
            recovery_action=RecoveryAction.NONE if workload_cleanup.kind == "succeeded"
            else RecoveryAction.RECONCILE_NEXT_OPERATION,
        )
        machine.finish()
        self.result.session_result = session_result
        self.deliver_result(session_result)

    def stop_workload(self) -> None:
        """SIGTERM, the termination grace, then SIGKILL. A never-started workload is skipped.

        SIGKILL is sent from a thread: the Engine answers it only once the container has
        exited, and the exit can wait for us to read the PTY stream, so the loop must go on.
        """
        if not self.workload_started or self.workload_gone():
            return
        workload_id = self.owned.containers["workload"]
        grace_s = self.options.timeout_s("--termination-grace")
        try:
            self.backend.kill(workload_id, "SIGTERM")
        except BackendError as e:
            log(f"could not signal the workload: {e}")
        if self.wait_until(self.workload_gone, time.monotonic() + grace_s,
                           stop_on_latch=False) or self.workload_gone():  # (seen late: gone)
            return
        log(f"workload still running after the {format_duration(int(grace_s * 1000))} grace; "
            "sending SIGKILL")
        self.backend.in_thread("kill", lambda api: kill_if_running(api, workload_id, "SIGKILL"),
                               self.notifier.report)

    def await_workload_exit(self) -> None:
        """After output finalization (which may have had to abandon the PTY stream so the
        Engine could finish the exit), give the exit the cleanup timeout to be observed."""
        if self.workload_started:
            self.wait_until(self.workload_gone,
                            time.monotonic() + self.options.timeout_s("--cleanup-timeout"),
                            stop_on_latch=False)

    def final_workload_status(self) -> Status:
        """The workload's status as the host reports it: an observed exit, or why none was
        (never an invented code)."""
        if self.workload_exit is not None:
            return process_status(self.workload_exit)
        if self.observation_lost:
            return Status.of("process", "unavailable", reason=self.observation_lost)
        if not self.workload_started:
            return Status.of("process", "unavailable", reason="the workload never started")
        timeout = format_duration(self.options.timeouts_ms["--cleanup-timeout"])
        return Status.of("process", "unavailable",
                         reason=f"the workload's exit was not observed within {timeout}")

    def workload_gone(self) -> bool:
        return self.workload_exit is not None or self.observation_lost is not None

    def finalize_output(self, deadline: float) -> Status:
        """Drain the PTY to EOF within the host-owned deadline: drained or failed (decided
        here, announced by announce_outputs_finalized once the workload facts are out). A
        workload that never started produced no output: there is nothing left undelivered.
        Drained means the attachment got every byte: output it could not take fails it.

        The decision rests on the relay's state as last seen before the deadline (`seen`,
        taken only while the deadline has not passed): an end of file or a delivery observed
        later, after a host resumed past the deadline, is not a drain."""
        relay = self.relay
        seen = {"eof": False, "lost": False, "delivered": False}

        def drained() -> bool:
            if time.monotonic() <= deadline:
                seen.update(eof=relay.pty_eof, lost=relay.output_lost,
                            delivered=relay.delivered)
            # The exit is awaited too (it follows EOF closely), so workload-exit normally
            # precedes workload-outputs-finalized; EOF alone decides whether output drained.
            return seen["eof"] and seen["delivered"] and self.workload_gone()

        if self.workload_started:
            self.wait_until(drained, deadline, stop_on_latch=False)
        if self.observation_lost:
            reason = f"the runtime observation was lost: {self.observation_lost}"
        elif not self.workload_started:
            return Status.of("output_finalization", "drained")
        elif not seen["eof"]:
            reason = (f"terminal output did not reach end of file within "
                      f"{OUTPUT_FINALIZATION_TIMEOUT_MS // 1000} s of termination")
        elif seen["lost"]:
            reason = "the terminal attachment ended before it had all of the terminal output"
        elif not seen["delivered"]:
            reason = "terminal output could not be delivered to the attachment in time"
        else:
            return Status.of("output_finalization", "drained")
        relay.close_pty()  # abandon what is left, so the Engine can finish the exit
        return failed("output_finalization", reason)

    def announce_outputs_finalized(self, status: Status) -> None:
        """The attachment's end of output, then (after ready) the public event."""
        self.finalization_announced = True
        self.relay.end_output(status)
        if self.machine.reached_ready:
            self.send_event(wire.WorkloadOutputsFinalized(
                status=status.kind, reason=status.reason))

    def controller_finalization(self) -> Status:
        """Whether the controller finalized its artifacts: `complete` (after ready), or the
        fact that stands in for it in each other ending."""
        cause, reason = self.machine.cause, self.cause_detail
        if cause is Cause.STARTUP_FAILURE:
            return Status.of("controller_finalization", "startup-failed",
                             reason=reason or "the session did not become ready")
        if not self.machine.reached_ready:
            return Status.of("controller_finalization", "not-completed",
                             reason=f"the session ended before it became ready ({reason})")
        if cause is Cause.CONTROLLER_LOST:
            return Status.of("controller_finalization", "lost", reason=reason)
        timeout_s = self.options.timeout_s("--controller-finalization-timeout")
        if self.wait_until(lambda: self.complete_received or self.channel is None,
                           time.monotonic() + timeout_s, stop_on_latch=False) \
                and self.complete_received:
            return Status.of("controller_finalization", "completed")
        if self.channel is None:
            return Status.of("controller_finalization", "lost",
                             reason=self.channel_lost or "the controller channel was lost")
        return Status.of("controller_finalization", "finalization-timeout",
                         reason=f"no complete within {format_duration(int(timeout_s * 1000))}")

    def begin_removal(self, *roles: str) -> dict[str, str]:
        """Start removing these containers (the ones this run owns), all at once and off the
        loop; their call tags by role, for await_removals. Each one removed leaves the
        watchdog's manifest at once, so it stays a true record however long nobody awaits."""

        def forget(role: str) -> Callable[[Any], None]:
            def removed(value: Any) -> None:
                if not isinstance(value, BaseException):
                    del self.owned.containers[role]
                    self.watchdog.record_owned(self.owned)
            return removed

        return {role: self.begin_call(f"remove the {role} container",
                                      lambda api, cid=container_id: remove_container_quietly(
                                          api, cid), forget(role))
                for role in roles
                if (container_id := self.owned.containers.get(role)) is not None}

    def await_removals(self, removals: dict[str, str], deadline: float) -> Status:
        """The outcome of begin_removal's calls, none awaited past `deadline`."""
        failures = []
        for role, tag in removals.items():
            finished, value = self.await_call(tag, deadline, stop_on_latch=False)
            if not finished:
                failures.append(f"remove the {role} container: not finished within the cleanup "
                                "timeout")
            elif isinstance(value, BaseException):
                failures.append(str(value))
        return failed("cleanup", "; ".join(failures)) if failures else succeeded()

    def deliver_result(self, session_result: SessionResult) -> None:
        if self.channel is None:
            self.result.result_delivered = False
            self.result.result_acknowledged = False
            return
        self.send_event(wire.Terminated(result=session_result))
        ack_timeout_s = self.options.timeout_s("--result-acknowledgement-timeout")
        deadline = time.monotonic() + ack_timeout_s
        delivered = self.wait_until(
            lambda: self.channel is None or not self.channel.wants_write, deadline,
            stop_on_latch=False) and self.channel is not None
        self.result.result_delivered = delivered
        acknowledged = delivered and self.wait_until(
            lambda: self.ack_received or self.channel is None, deadline, stop_on_latch=False)
        self.result.result_acknowledged = bool(acknowledged and self.ack_received)

    # -- the delivery tail ------------------------------------------------------------------

    def close_channel(self, deadline: float) -> None:
        """Close the channel cleanly: end our side, let the broker see end of file and go,
        reading (and dropping) what it still sends until its end, then close."""
        channel = self.channel
        if channel is None:
            return
        with contextlib.suppress(OSError):
            channel.close_write()
        self.wait_until(lambda: self.channel is None or self.channel.eof, deadline,
                        stop_on_latch=False)
        if self.channel is not None:
            self.interest.set(self.channel.sock, self.on_channel, 0)
            self.channel.close()
            self.channel = None

    def delivery_tail(self) -> None:
        """Close the channel, let the controller finish, then remove everything else; the
        whole of it within --cleanup-timeout, Engine calls included."""
        cleanup_s = self.options.timeout_s("--cleanup-timeout")
        began = time.monotonic()
        deadline = began + cleanup_s
        self.close_channel(min(deadline, began + CHANNEL_CLOSE_S))
        # The attachment may still be reading its end of output: give it the same time.
        self.wait_until(lambda: self.relay.delivered, min(deadline, began + CHANNEL_CLOSE_S),
                        stop_on_latch=False)
        self.relay.close_terminal()
        self.close_listener()
        session_ran = self.result.session_result is not None
        failures: list[str] = []
        controller_id = self.owned.containers.get("controller")
        if controller_id and self.controller_started:
            exited = self.wait_until(lambda: self.controller_exit is not None,
                                     began + cleanup_s / 2, stop_on_latch=False)
            if not exited:
                log("the controller is still running after the session; stopping it")
                self.backend.in_thread(
                    "kill the controller",
                    lambda api: kill_if_running(api, controller_id, "SIGKILL"),
                    self.notifier.report)
                self.wait_until(lambda: self.controller_exit is not None,
                                began + cleanup_s * 3 / 4, stop_on_latch=False)
            if self.controller_exit is not None:
                self.result.controller_status = process_status(self.controller_exit)
            else:
                self.result.controller_status = Status.of(
                    "process", "unavailable", reason="the controller's exit was not observed")
            self.copy_controller_log(controller_id, deadline)
        # The holder goes last: it must outlive the containers that joined its namespace.
        for roles in ([role for role in self.owned.containers if role != "holder"], ["holder"]):
            status = self.await_removals(self.begin_removal(*roles), deadline)
            if status.kind != "succeeded":
                failures.append(status.reason or "remove containers")
        self.publish_output()
        for attribute in ("channel_dir", "output_staging_dir"):
            path = getattr(self.owned, attribute)
            try:
                if path is not None:
                    reploy_watchdog.remove_tree(path)
                setattr(self.owned, attribute, None)
            except FileNotFoundError:
                setattr(self.owned, attribute, None)
            except OSError as e:
                failures.append(f"remove {path}: {error_text(e)}")
        if session_ran:
            self.result.delivery_tail_cleanup_status = (
                failed("cleanup", "; ".join(failures)) if failures else succeeded())
            self.result.delivery_tail_recovery_action = (
                RecoveryAction.RECONCILE_NEXT_OPERATION if failures else RecoveryAction.NONE)
        elif failures:  # planning's probe: the result has no cleanup phase to report it in
            self.result.error = "; ".join(filter(None, (
                self.result.error, f"cleanup failed: {'; '.join(failures)}")))
        if failures:
            # Keep a true manifest of what remains, for `controlled-session cleanup`.
            self.watchdog.record_owned(self.owned)
            log("cleanup left something behind; `reploy.py controlled-session cleanup "
                f"--workload-dir {self.plan.workload.dir}` reconciles it")
        if self.watchdog.link is not None:
            self.selector.unregister(self.watchdog.link)
        self.watchdog.disarm(keep_manifest=bool(failures))
        self.notifier.close()
        self.selector.close()

    def copy_controller_log(self, controller_id: str, deadline: float) -> None:
        """The controller's own output, for the user, on the host's stderr (bounded)."""
        _, tail = self.call_off_loop(
            "read the controller log",
            lambda api: api.logs(controller_id, stdout=True, stderr=True), deadline,
            stop_on_latch=False)
        if isinstance(tail, bytes) and tail:
            sys.stderr.write("reploy: controller output follows\n")
            sys.stderr.write(tail[-CONTROLLER_LOG_TAIL_BYTES:].decode(errors="replace"))
            sys.stderr.flush()

    def publish_output(self) -> None:
        """--output-file: publish the staged regular file without clobbering, only after
        controller finalization completed; otherwise discard it."""
        destination, staging = self.options.output_file, self.owned.output_staging_dir
        if destination is None or staging is None:
            return
        session = self.result.session_result
        completed = session is not None and session.controller_finalization_status is not None \
            and session.controller_finalization_status.kind == "completed"
        if not completed:
            self.result.controller_output = Status.of(
                "controller_output", "file-discarded",
                reason="controller output file was discarded because controller finalization "
                       "did not complete")
            return
        try:
            publish_regular_file(staging, destination)
            self.result.controller_output = Status.of("controller_output", "file-published")
        except OSError as e:
            self.result.error = PUBLISH_ERROR + error_text(e)
            self.result.controller_output = Status.of(
                "controller_output", "failed", reason="controller output publication failed")


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
    parser = ArgumentParser(
        prog="reploy", description="Sandboxed, controllable sessions on Docker.",
        epilog="Managed sessions: `reploy serve --help` and `reploy session --help` (run by "
               f"{CONTROL_PLANE_FILE}).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    p_stage = commands.add_parser("stage", help="validate a blueprint and stage a deployment")
    p_stage.add_argument("blueprint", type=Path)
    p_stage.add_argument("--dir", type=Path, required=True)
    p_build = commands.add_parser("build", help="build a staged deployment's image")
    p_build.add_argument("--dir", type=Path, required=True)
    p_session = commands.add_parser("controlled-session", help="controlled sessions")
    session_commands = p_session.add_subparsers(dest="action", required=True,
                                                parser_class=ArgumentParser)
    cleanup = session_commands.add_parser(
        "cleanup", help="remove what crashed sessions left behind (host and watchdog both dead)")
    cleanup.add_argument("--workload-dir", type=Path, action="append", default=[],
                         help="also check this deployment's manifests (repeatable)")
    run = session_commands.add_parser(
        "run", usage="reploy controlled-session run --controller-dir DIR --workload-dir DIR "
        "[options] -- CONTROLLER_COMMAND [ARG ...]")
    run.add_argument("--controller-dir", type=Path, required=True)
    run.add_argument("--workload-dir", type=Path, required=True)
    run.add_argument("--endpoint", action="append", default=[], metavar="ID")
    run.add_argument("--columns", type=ascii_number)
    run.add_argument("--rows", type=ascii_number)
    outputs = run.add_mutually_exclusive_group()
    outputs.add_argument("--output-file", type=Path)
    outputs.add_argument("--output-dir", type=Path)
    for option in TIMEOUT_OPTIONS:
        run.add_argument(option.flag, metavar="DURATION",
                         help=f"default {format_duration(option.default_ms)}")
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
    argv, command = split_command(list(sys.argv[1:] if argv is None else argv))
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
    schema = {"stage": STAGE_SCHEMA, "build": BUILD_SCHEMA}.get(args.command, CLEANUP_SCHEMA)
    try:
        if args.command == "stage":
            emit(stage(args.blueprint, args.dir))
        elif args.command == "build":
            backend = DockerBackend()
            reconcile(backend, [args.dir])
            emit(build(args.dir, backend))
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
    run_as_process(main)


if __name__ == "__main__":
    run_command()
