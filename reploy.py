#!/usr/bin/env python3
"""reploy: the host role of Reploy.

  reploy stage BLUEPRINT --dir DIR           validate a blueprint, make DIR a staging deployment
  reploy build --dir DIR                     build its image, record the new current generation
  reploy controlled-session run ... -- CMD   run one controlled session, print one JSON result
  reploy serve --workload-dir DIR ...        managed sessions: REST API, SSE and web UI on one port
  reploy session ACTION ...                  one call to that API, one JSON document

Peers:
  * the Docker Engine, through the Docker SDK (never the docker CLI);
  * reploy_session_client.py, which runs inside the controller container as the broker. It also
    holds the public stream codec and the private channel framing, which this file imports so
    both ends speak from one definition. It must sit beside this file.
  * agent.py, the data-plane agent in each managed-session container, reached only through its
    control socket; `session cp` also reuses its archive rules (vetting, extraction, the tree
    writer), so it must sit beside this file too.

Machine output is one JSON document on stdout; human text goes to stderr.

Reading order: the launch (which comes before the imports: a long-lived command re-executes
itself as a module first), constants, exceptions, value types, pure cores (durations,
blueprints, the lifecycle machine, the run result), Docker adapters, deployments, the
controlled session, CLI.
"""

from __future__ import annotations

import marshal
import os
import sys
from importlib.machinery import SourceFileLoader

# ============================================================================================
# Launch: a long-lived command runs as a module, not as this script
# ============================================================================================

#: The commands that live as long as a session or a server.
LONG_LIVED_COMMANDS = (("controlled-session", "run"), ("serve",))
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


def relaunch_as_module() -> None:
    """Re-execute a long-lived command (same pid, interpreter and options) with this file and
    its siblings run as modules from code compiled here, before anything heavy is imported.

    CPython keeps a script's whole syntax tree until the script returns: about 11 MiB for
    this file, for the whole life of a session's host. Code run as a module keeps no tree.
    The compiling (or reading of cached bytecode) is done by this process, which exec
    replaces, so the process that lives on holds none of the compiler's leftovers either,
    even when nothing can be cached (PYTHONDONTWRITEBYTECODE). Costs one interpreter start.
    Run with -I, -P or PYTHONSAFEPATH (no working directory to replace on the module path),
    through -m or runpy, or without memfd_create, it runs as it is."""
    command = tuple(sys.argv[1:3])
    if not any(command[:len(c)] == c for c in LONG_LIVED_COMMANDS) or not sys.executable:
        return
    original = getattr(sys, "orig_argv", [])
    options_end = len(original) - len(sys.argv)
    if options_end < 1 or original[options_end] != sys.argv[0] or getattr(
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
    os.execv(sys.executable, [sys.executable, *original[1:options_end], "-c", MODULE_LAUNCHER,
                              script, str(compiled), *sys.argv[1:]])


if __name__ == "__main__" and __spec__ is None:
    relaunch_as_module()

import argparse
import base64
import concurrent.futures
import contextlib
import enum
import errno
import hashlib
import hmac
import http.server
import ipaddress
import io
import json
import queue
import re
import secrets
import select
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
import urllib.parse
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Generator, Iterable, Iterator, Optional, Sequence

import docker
import docker.errors
import psutil
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
#: Where the client lands in the derived controller image.
CLIENT_INSTALL_PATH = "/usr/local/bin/reploy-session-client"
#: The container-side HOME of both roles: a private tmpfs owned by the runtime uid:gid.
CONTAINER_HOME = "/mnt/reploy-home"
HOME_TMPFS_SIZE = "64m"
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
#: The python probe: a short-lived session container that proves the derived controller image
#: can run the client, before the session is planned to use it.
PROBE_ROLE = "python-probe"
#: Appended to the derived image's tag once its python probe passed: only that tag is reused.
PROBED_TAG_SUFFIX = "-probed"
PYTHON_PROBE_COMMAND = ("python3", "-c", "import json, selectors, socket, termios")
PYTHON_PROBE_TIMEOUT_S = 60
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
#: nothing but a pause, as nobody, in the derived controller image (which has python3; the
#: pause is its entrypoint, so none of the image's runs); the workload and the controller join
#: it, and the controller reaches the workload's ports at host `workload` (127.0.0.1) over the
#: shared loopback.
HOLDER_ENTRYPOINT = ("python3", "-S", "-c", "import signal; signal.pause()")
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

    role: str  # "controller" | "workload" | "holder"
    image_id: str
    command: tuple[str, ...]
    runtime: Runtime
    environment: dict[str, str]
    labels: dict[str, str]
    #: NETWORK_NONE, or "container:<holder id>" to join a granted session's namespace (the
    #: Engine then refuses a hostname or extra hosts of the joining container's own).
    network_mode: str = NETWORK_NONE
    extra_hosts: tuple[tuple[str, str], ...] = ()  # (name, address) in /etc/hosts
    #: Replaces the image's ENTRYPOINT (and with it its CMD) when set.
    entrypoint: tuple[str, ...] = ()
    mounts: tuple[Mount, ...] = ()
    tty: bool = False
    hostname: Optional[str] = None
    init: bool = False
    #: The TTY's (columns, rows) at creation. The Engine API's HostConfig.ConsoleSize; Docker
    #: 20.10 stores it but leaves a Linux container's PTY at 0x0 until the first resize, so
    #: the host also resizes right after start (see ControlledSession.start).
    console_size: Optional[tuple[int, int]] = None

    def create_kwargs(self, api: docker.APIClient) -> dict[str, Any]:
        """The Engine API arguments. Every sandbox property is set here and nowhere else."""
        uid, gid = self.runtime.uid, self.runtime.gid
        tmpfs = {CONTAINER_HOME: f"rw,nosuid,nodev,size={HOME_TMPFS_SIZE},mode=0700,uid={uid},gid={gid}"}
        for path in self.runtime.writable_paths:
            tmpfs[path] = f"rw,nosuid,nodev,size=256m,mode=0755,uid={uid},gid={gid}"
        host_config = api.create_host_config(
            read_only=True,
            cap_drop=["ALL"],
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
            command=list(self.command),
            entrypoint=list(self.entrypoint) or None,
            user=self.runtime.user,
            environment=dict(self.environment),
            labels=dict(self.labels),
            host_config=host_config,
            tty=self.tty,
            stdin_open=self.tty,
            hostname=self.hostname,
            working_dir=CONTAINER_HOME if self.role == "controller" else None,
        )


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
    def require_sandbox_support(self) -> None:
        """Fail closed when the engine cannot give us seccomp."""
        options = " ".join(self.client.info().get("SecurityOptions") or [])
        if "seccomp" not in options:
            raise BackendError("the Docker engine has no seccomp support; refusing to run")

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
        the value being the call's result or a BackendError."""
        api = docker.APIClient(version=self.api.api_version, timeout=None,
                               **docker.utils.kwargs_from_env())

        def run() -> None:
            try:
                report(tag, call(api))
            except BackendError as e:
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
    `blueprint_digest`). A session takes its authority (commands, endpoints, runtime uid:gid)
    from it, never from the staging directory's current blueprint.yaml, which may have changed
    since without a rebuild. State written before it was recorded has None here.
    """

    number: int
    image_id: str
    reference: str
    blueprint_digest: str
    built_at: float
    blueprint_text: Optional[str] = None


#: state.json: each key with the type its value must have (None: may also be null).
STATE_FIELDS: dict[str, tuple[type, ...]] = {
    "schema": (str,), "deployment_id": (str,), "current_generation": (dict, type(None)),
    "staged_blueprint_digest": (str,)}
GENERATION_FIELDS: dict[str, tuple[type, ...]] = {
    "number": (int,), "image_id": (str,), "reference": (str,), "blueprint_digest": (str,),
    "built_at": (int, float), "blueprint_text": (str,)}
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
        if not isinstance(value, fields_[key]) or isinstance(value, bool):
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
        raise DeploymentError(f"{path}: unreadable state: {e}") from e
    _check_fields(state, STATE_FIELDS, {"schema", "deployment_id", "current_generation"},
                  str(path))
    if state["schema"] != STATE_SCHEMA:
        raise DeploymentError(f"{path}: unknown state schema")
    if not _DEPLOYMENT_ID.fullmatch(state["deployment_id"]):
        raise DeploymentError(f"{path}: deployment_id is not 32 hex digits")
    generation = state["current_generation"]
    if generation is not None:
        _check_fields(generation, GENERATION_FIELDS, set(GENERATION_FIELDS) - {"blueprint_text"},
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
                            time.time(), blueprint_text)
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
            raise AdmissionError(f"the {role} deployment {deployment.dir} configures a private "
                                 "environment; controlled sessions do not support it")
    if options.output_file is not None:
        if not options.output_file.parent.is_dir():
            raise AdmissionError(f"--output-file: {options.output_file.parent} is not a directory")
        if os.path.lexists(options.output_file):
            raise AdmissionError(f"--output-file: {options.output_file} already exists")
    if options.output_dir is not None:  # created at preparation, under its nearest existing path
        existing = next(path for path in (options.output_dir, *options.output_dir.parents)
                        if os.path.lexists(path))
        if not existing.is_dir():
            raise AdmissionError(f"--output-dir: {existing} exists and is not a directory")
    return controller, workload


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
    if (options.output_dir or options.output_file) and controller_blueprint.runtime.uid == 0:
        raise PlanRejected("--output-dir and --output-file need a non-root controller runtime")
    return SessionPlan(secrets.token_hex(16), controller, workload, controller_blueprint,
                       workload_blueprint, argv, tuple(granted))


def requested_output_status(options: RunOptions) -> Status:
    """controller_output for a session that never ran: what was requested, and its fate."""
    if options.output_dir is not None:
        if options.output_dir.is_dir():
            return Status.of("controller_output", "directory-retained")
        return Status.of("controller_output", "failed",
                         reason="the session ended before the output directory was created")
    if options.output_file is not None:
        return Status.of("controller_output", "file-discarded",
                         reason="the session ended before the controller ran; nothing was "
                                "published")
    return Status.of("controller_output", "not-requested")


def derived_image_reference(base_image_id: str) -> tuple[str, str]:
    """The derived controller image's tag and the client digest it is keyed by."""
    client_digest = hashlib.sha256(CLIENT_SOURCE.read_bytes()).hexdigest()
    key = hashlib.sha256(f"{base_image_id}\n{client_digest}".encode()).hexdigest()[:32]
    return f"reploy/controller-derived:{key}", client_digest


def derived_image_cached(backend: DockerBackend, base_image_id: str,
                         reference: Optional[str] = None) -> bool:
    """The derived image of this base and client exists under `reference` (by default its
    build tag; sessions ask for the tag it gets once its python probe passed)."""
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
    """The controller generation plus one layer holding the client; returns its image id."""
    reference, client_digest = derived_image_reference(base_image_id)
    client_bytes = CLIENT_SOURCE.read_bytes()
    dockerfile = (f"FROM {base_image_id}\n"
                  f"COPY reploy-session-client {CLIENT_INSTALL_PATH}\n").encode()
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
                 wakeup: wire.SignalWakeup) -> None:
        self.options = options
        self.plan = plan
        self.backend = backend
        self.wakeup = wakeup
        self.machine = LifecycleMachine()
        self.result = RunResult()
        self.owned = Owned()
        self.watchdog = Watchdog(plan.run_id, plan.workload.dir)
        self.notifier = Notifier()
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.notifier.read_fd, selectors.EVENT_READ, self.on_notice)
        self.selector.register(wakeup.read_fd, selectors.EVENT_READ, self.on_signal)
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
                self.result.error = f"plan rejected: the watchdog could not be armed: {e}"
                self.result.controller_output = requested_output_status(self.options)
                return self.result
            self.selector.register(self.watchdog.link, selectors.EVENT_READ, self.on_watchdog)
            try:
                controller_image = self.plan_images()
            except (PlanRejected, BackendError, OSError) as e:
                controller_image = None
                if self.cancelled_by is None:
                    self.result.error = f"plan rejected: {e}"
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
                    self.result.error = f"startup failed: {e}"
                self.latch(Cause.STARTUP_FAILURE, str(e))
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
        """The Docker half of planning: the sandbox, both generations' images, the derived
        controller image and, when it is new, the python probe. Returns the controller image
        to run, or None when a signal cancelled planning. Raises PlanRejected."""
        plan, backend = self.plan, self.backend
        backend.require_sandbox_support()
        for role, deployment in (("controller", plan.controller), ("workload", plan.workload)):
            assert deployment.current is not None
            if not backend.image_exists(deployment.current.image_id):
                raise PlanRejected(f"the {role} image {deployment.current.image_id} is gone "
                                   "(run reploy build)")
        base_image = plan.controller.current.image_id  # type: ignore[union-attr]
        probed = derived_image_reference(base_image)[0] + PROBED_TAG_SUFFIX
        if derived_image_cached(backend, base_image, probed):
            return probed
        built = self.off_loop("build the controller image",
                              lambda _api: build_derived_image(backend, base_image))
        if built is None or not self.probe_python(built):
            return None  # cancelled: without the probed tag, the next session probes again
        backend.tag_image(built, probed)
        return probed

    def probe_python(self, image_id: str) -> bool:
        """Say clearly when the controller image cannot run the client (it needs python3).
        The probe is a session container like the others: labelled, in the watchdog's
        manifest, removed in every outcome. False when a signal cancelled it."""
        self.acquire_container(ContainerSpec(
            role=PROBE_ROLE, image_id=image_id, command=PYTHON_PROBE_COMMAND,
            runtime=self.plan.controller_blueprint.runtime,
            environment={"HOME": CONTAINER_HOME}, labels=self.labels(PROBE_ROLE)))
        container_id = self.owned.containers[PROBE_ROLE]

        def run_probe(api: docker.APIClient) -> int:
            api.start(container_id)
            return int(api.wait(container_id, timeout=PYTHON_PROBE_TIMEOUT_S)["StatusCode"])

        try:
            code = self.off_loop("run the python probe", run_probe)
        except BackendError as e:
            code, detail = -1, str(e)
        else:
            detail = ""
            if code is not None:
                with contextlib.suppress(BackendError):
                    detail = self.backend.log_tail(container_id).decode(errors="replace").strip()
        if code is None:
            return False  # cancelled: the delivery tail removes the probe
        cleanup = self.await_removals(self.begin_removal(PROBE_ROLE), time.monotonic()
                                      + self.options.timeout_s("--cleanup-timeout"))
        if code != 0:
            with contextlib.suppress(BackendError):
                self.backend.remove_image(image_id)
            raise PlanRejected(
                "the controller image must provide python3 with its standard library for "
                f"reploy-session-client; the probe failed ({detail or f'exit {code}'})")
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
        """A slow planning call (an image build, the probe) that a signal cancels promptly:
        its value, or None when cancelled. Raises its BackendError."""
        finished, value = self.call_off_loop(what, call, None, stop_on_latch=True)
        if isinstance(value, BackendError):
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
                role="holder", image_id=controller_image, command=(),
                entrypoint=HOLDER_ENTRYPOINT,
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
                options.output_dir.mkdir(parents=True, exist_ok=True)
                os.chown(options.output_dir, runtime.uid, runtime.gid)
            except OSError as e:  # a startup failure; the requested output still has a fate
                self.result.controller_output = Status.of(
                    "controller_output", "failed",
                    reason=f"could not prepare the output directory: {e.strerror or e}")
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
        being latched (False): phases that must end on any cause wait with stop_on_latch."""
        while True:
            if condition():
                return True
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
        """SIGINT/SIGTERM cancel the session, if nothing else ended it first: only then does
        the host exit 130/143 (a later signal changes nothing; cleanup is bounded anyway)."""
        for signum in self.wakeup.drain():
            if signum not in EXIT_FOR_SIGNAL:
                continue
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
            self.lose_channel(f"channel failed: {e}")

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
        if self.wait_until(self.workload_gone, time.monotonic() + grace_s, stop_on_latch=False):
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
        Drained means the attachment got every byte: output it could not take fails it."""
        relay = self.relay
        if self.workload_started:
            # The exit is awaited too (it follows EOF closely), so workload-exit normally
            # precedes workload-outputs-finalized; EOF alone decides whether output drained.
            self.wait_until(lambda: relay.pty_eof and self.workload_gone() and relay.delivered,
                            deadline, stop_on_latch=False)
        if self.observation_lost:
            reason = f"the runtime observation was lost: {self.observation_lost}"
        elif not self.workload_started:
            return Status.of("output_finalization", "drained")
        elif not relay.pty_eof:
            reason = (f"terminal output did not reach end of file within "
                      f"{OUTPUT_FINALIZATION_TIMEOUT_MS // 1000} s of termination")
        elif relay.output_lost:
            reason = "the terminal attachment ended before it had all of the terminal output"
        elif not relay.delivered:
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
                failures.append(f"remove {path}: {e}")
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
            self.result.error = f"publish controlled-session controller output: {e}"
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
        raise BackendError(f"reconcile orphaned sessions: {e}") from e
    for receipt in receipts:
        removed = receipt["removed"]
        log(f"reconciled crashed run {receipt['run_id']}: removed "
            f"{len(removed['containers'])} container(s), {len(removed['networks'])} network(s), "
            f"{len(removed['paths'])} path(s)")
    return receipts


def run_controlled_session(options: RunOptions) -> tuple[RunResult, Optional[int]]:
    """Admission, planning, then the session. Returns the result and the signal that
    cancelled it (None unless a signal did)."""
    with wire.SignalWakeup((signal.SIGINT, signal.SIGTERM)) as wakeup:
        try:
            controller, workload = admit(options)
        except AdmissionError as e:
            return RunResult(error=f"admission rejected: {e}"), None
        try:
            session_plan = plan(options, controller, workload)
        except PlanRejected as e:
            return RunResult(error=f"plan rejected: {e}",
                             controller_output=requested_output_status(options)), None
        signum = next((s for s in wakeup.drain() if s in EXIT_FOR_SIGNAL), None)
        if signum is not None:  # admission and planning read files only: they ran to the end
            return RunResult(error=f"cancelled by {signal.Signals(signum).name}",
                             controller_output=requested_output_status(options)), signum
        try:
            backend = DockerBackend()
            reconcile(backend, [workload.dir, controller.dir])
        except BackendError as e:
            return RunResult(error=f"admission rejected: {e}"), None
        session = ControlledSession(options, session_plan, backend, wakeup)
        return session.run(), session.cancelled_by


# ============================================================================================
# Managed sessions: constants and errors
# ============================================================================================
#
# `reploy serve` is the control plane of seed 002 on one Docker host. Each session is one
# container from a workload deployment's current generation, running agent.py (docs/agent.md)
# with the session directory bind-mounted; the control plane talks to the agent only through
# DIR/control.sock, and keeps every session record in SQLite under --state-dir so that several
# `serve` processes can share one state dir without ever acting twice on one session.
#
# Reading order: the state machine (pure), the store (SQLite with compare-and-swap and
# leases), request bodies, the SSE encoder and the access rules (pure), the Docker
# orchestration, the HTTP adapter, then `serve` and the `session` client in the CLI section.

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
#: The agent's control socket and output log in a session directory (agent.py names them).
SOCKET_NAME = agent_role.SOCKET_NAME
OUTPUT_LOG_NAME = agent_role.LOG_NAME

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
# Managed sessions: the state machine (pure)
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
# Managed sessions: the reaper's decision (pure)
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
# Managed sessions: the store (SQLite, compare-and-swap, leases)
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
        import sqlite3  # only `serve` keeps a store: a session's host does without the library

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
# Managed sessions: request bodies and responses (pure)
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
# Managed sessions: the SSE encoder (pure)
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
# Managed sessions: who may drive serve (pure)
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
# Managed sessions: the agent's control socket (client side)
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
    if text.startswith("not enough space"):
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
# Managed sessions: Docker orchestration
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

    @property
    def sessions_dir(self) -> Path:
        return self.state_dir / "sessions"

    def session_dir(self, session_id: str) -> Path:
        return self.sessions_dir / session_id

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
                   "--workload", spec.workload, "--home", CONTAINER_HOME]
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
            command += ["--restore", f"{SESSION_MOUNT}/{archive}"]
        mounts = (Mount(str(AGENT_SOURCE), AGENT_MOUNT, read_only=True),
                  Mount(str(config.session_dir(record.id)), SESSION_MOUNT, read_only=False),
                  *config.extra_mounts)
        labels = {LABEL_RUN: record.id, LABEL_ROLE: MANAGED_ROLE,
                  LABEL_STATE_DIR: str(config.state_dir),
                  LABEL_DEPLOYMENT: spec.deployment_id, LABEL_GENERATION: str(spec.generation)}
        return ContainerSpec(role=MANAGED_ROLE, image_id=spec.image_id, command=tuple(command),
                             runtime=spec.runtime, environment=environment, labels=labels,
                             mounts=mounts, hostname="session", init=True)

    def _launch(self, lease: Lease, archive: Optional[str]) -> None:
        """Create and start the session's container, record it, and wait for its agent."""
        container_id = self.backend.create(self._container_spec(lease.record, archive))
        lease.update(container_id=container_id)
        self.backend.start(container_id)
        session_dir = self.config.session_dir(lease.record.id)
        deadline = time.monotonic() + AGENT_READY_TIMEOUT_S
        next_check = time.monotonic()
        while True:
            try:
                agent_call(session_dir, "status", {}, timeout_s=AGENT_CALL_TIMEOUT_S)
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
            session_dir = self.config.session_dir(record.id)
            session_dir.mkdir(mode=0o700)
            os.chown(session_dir, spec.runtime.uid, spec.runtime.gid)
            self._launch(lease, archive=None)
            return lease.apply(SessionEvent.STARTED)
        except BaseException:
            with contextlib.suppress(ReployError, OSError):  # else recovery finishes the undo
                lease.apply(SessionEvent.ROLLBACK)
                self._finish_delete(lease)
            raise
        finally:
            self.store.release(record.id, owner)

    def _finish_delete(self, lease: Lease) -> None:
        session_id = lease.record.id
        self._remove_containers(session_id)
        try:
            reploy_watchdog.remove_tree(self.config.session_dir(session_id))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise ServiceUnavailable(f"remove the session directory: {e}") from e
        self.store.delete(session_id, lease.owner)

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
                agent_call(self.config.session_dir(lease.record.id), "suspend", {"reason": "max_busy"})
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
        session_dir = self.config.session_dir(record.id)
        failure: Optional[ServeError] = None
        archive_bytes: Optional[int] = None
        try:
            if self._archive_bytes(record) is None and record.container_id:
                self.backend.unpause(record.container_id)
                self._await_checkpoint_in_flight(lease)
                if ask and self._archive_bytes(record) is None:
                    checkpoint_id = record.archive[len(agent_role.CHECKPOINT_PREFIX):-len(".tar")]
                    agent_call(session_dir, "checkpoint", {"id": checkpoint_id})
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
            with opened_dir(self.config.session_dir(record.id)) as dir_fd:
                return regular_file_size(dir_fd, record.archive)
        except ContainerPathError as e:
            raise SessionConflict(f"the session's checkpoint archive is refused: {e}") from e
        except OSError as e:
            raise ServiceUnavailable(f"the session directory: {e}") from e

    def _remove_old_archives(self, record: SessionRecord) -> None:
        """Every checkpoint-*.tar but the current one, whatever it is (the session may have
        put a directory there); a failure is logged, the snapshot stands."""
        try:
            with opened_dir(self.config.session_dir(record.id)) as dir_fd:
                for name in os.listdir(dir_fd):
                    if (name.startswith(agent_role.CHECKPOINT_PREFIX) and name.endswith(".tar")
                            and name != record.archive):
                        reploy_watchdog.remove_entry(dir_fd, name)
        except OSError as e:
            log(f"serve: session {record.id}: old checkpoint archives stay: {e}")

    def _await_checkpoint_in_flight(self, lease: Lease) -> None:
        """While the agent's admission is closed and no archive exists, a checkpoint is still
        draining; it ends (archive written, or admission reopened) within the agent's bound."""
        session_dir = self.config.session_dir(lease.record.id)
        deadline = time.monotonic() + AGENT_CALL_TIMEOUT_S
        while self._archive_bytes(lease.record) is None and time.monotonic() < deadline:
            if agent_call(session_dir, "status", {}).get("admission_open") is not False:
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
            with contextlib.suppress(OSError), opened_dir(self.config.session_dir(record.id)) as fd:
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
        session_dir = self.config.session_dir(session_id)
        try:
            return agent_call(session_dir, method, params)
        except AgentCallError as e:
            if not (e.transport and self._relaunch_if_lost(session_id)):
                raise serve_error_for(e) from e
        try:
            return agent_call(session_dir, method, params)
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
                agent_call(self.config.session_dir(session_id), "exec_kill", {"exec_id": exec_id})
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
                agent_call(self.config.session_dir(session_id), "transfer_close",
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
                    agent_call(self.config.session_dir(session_id), "transfer_close",
                               {"transfer_id": transfer_id})

        return opened, chunks()

    def status(self, session_id: str) -> dict[str, Any]:
        """Passive: asks an active session's agent, never resumes or restores one."""
        record = self.record(session_id)
        agent_status = None
        if record.state is SessionState.ACTIVE:
            with contextlib.suppress(AgentCallError):
                agent_status = _camel_keys(agent_call(
                    self.config.session_dir(session_id), "status", {}))
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
        session_dir = self.config.session_dir(record.id)
        text = record.spec.workload == "agent"
        last_sent = renewed = time.monotonic()
        refused = woke = False
        while not self.stopping.is_set() and connected():
            if time.monotonic() - renewed >= VIEWER_RENEW_S:
                self.store.hold_viewer(viewer, record.id, self.clock())
                renewed = time.monotonic()
            try:
                length, data = self._read_output_log(session_dir, cursor)
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
            woke = self.await_agent_output(session_dir, cursor)
            if not woke:
                self.stopping.wait(SSE_POLL_S)

    def session_is_going(self, session_id: str) -> bool:
        """Deleted, or being deleted: a stream of it ends instead of resetting."""
        record = self.store.get(session_id)
        return record is None or record.state is SessionState.DELETING

    @staticmethod
    def _read_output_log(session_dir: Path, cursor: int) -> tuple[int, bytes]:
        """(length, at most SSE_CHUNK_BYTES from `cursor`) of DIR/output.log, read only as the
        regular file it must be (see "Directories a container can write")."""
        with opened_dir(session_dir) as dir_fd:
            fd = open_regular_file(dir_fd, OUTPUT_LOG_NAME)
        try:
            length = os.fstat(fd).st_size
            return length, os.pread(fd, min(max(length - cursor, 0), SSE_CHUNK_BYTES), cursor)
        finally:
            os.close(fd)

    @staticmethod
    def await_agent_output(session_dir: Path, cursor: int) -> bool:
        """Sleep until the agent has bytes past `cursor` (or a second passed), so a stream
        learns of output at once instead of at its next file poll. The agent's `read` changes
        nothing, so the stream stays passive. False when no agent answers (a paused or
        snapshotted session): the caller falls back to polling the file."""
        try:
            agent_call(session_dir, "read",
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
                    agent_call(self.config.session_dir(record.id), "status", {}))
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
# Managed sessions: the HTTP adapter (REST, SSE, the web UI's files)
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
# Managed sessions: `reploy serve` and the `reploy session` client
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
    state_dir = args.state_dir.absolute()
    return ServeConfig(
        state_dir=state_dir, workload_dirs=tuple(d.absolute() for d in args.workload_dir),
        idle_after_s=durations["idle_after"], snapshot_after_s=durations["snapshot_after"],
        max_busy_s=durations["max_busy"],
        agent_command=command, agent_env=tuple(args.agent_env), extra_mounts=tuple(mounts),
        default_model=args.default_model, models=models,
        sse_keepalive_s=durations["sse_keepalive"], max_sessions=args.max_sessions,
        min_free_bytes=args.min_free_mib * 1024 * 1024)


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
                entries = agent_role.extract_upload(Path(spool.name), target.parent,
                                                    (target.name,), f"{Path(spool.name).name}.d")
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


def add_serve_parsers(commands: Any) -> None:
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


# ============================================================================================
# CLI
# ============================================================================================


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of exiting, so main() owns exit codes."""

    def error(self, message: str) -> Any:
        raise UsageError(message)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="reploy", description="Sandboxed, controllable sessions on Docker.")
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
    run.add_argument("--columns", type=int)
    run.add_argument("--rows", type=int)
    outputs = run.add_mutually_exclusive_group()
    outputs.add_argument("--output-file", type=Path)
    outputs.add_argument("--output-dir", type=Path)
    for option in TIMEOUT_OPTIONS:
        run.add_argument(option.flag, default=format_duration(option.default_ms),
                         metavar="DURATION")
    add_serve_parsers(commands)
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
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "action", None) == "run":
            options = parse_run_options(args, command)
        elif args.command == "serve" and not command:
            serve_config, serve_access = serve_config_from(args), serve_access_from(args)
        elif args.command == "session" and (not command or args.session_action == "exec"):
            token = session_token(args)
            if args.session_action == "exec":
                args.exec_body = exec_request_body(args, command)
            elif args.session_action == "cp":
                args.copy_source = parse_copy_operand(args.source)
                args.copy_destination = parse_copy_operand(args.destination)
                if (args.copy_source[0] is None) == (args.copy_destination[0] is None):
                    raise UsageError("session cp: exactly one of SRC and DST is ID:PATH")
        elif command:
            raise UsageError("only controlled-session run and session exec take arguments "
                             "after --")
    except UsageError as e:
        print(f"reploy: usage error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if getattr(args, "action", None) == "run":
        try:
            result, signum = run_controlled_session(options)
        except Exception as e:  # noqa: BLE001 - after valid parsing, stdout is always a result
            log(f"internal error: {e!r}")
            result, signum = RunResult(error=f"internal error: {e!r}"), None
        sys.stdout.buffer.write(result.encode())
        sys.stdout.buffer.flush()
        if signum is not None:
            return EXIT_FOR_SIGNAL[signum]
        return EXIT_OK if result.ok else EXIT_FAILED
    if args.command == "serve":
        return run_serve(serve_config, serve_access)
    if args.command == "session":
        return run_session_client(args, token)
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


def run_command() -> None:
    """main() as a process: flush, then exit without the interpreter's teardown."""
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Every session resource is released inside main(); what remains is interpreter teardown
    # of the Docker SDK's modules, which would add tens of milliseconds to every command.
    os._exit(exit_code)


if __name__ == "__main__":
    run_command()
