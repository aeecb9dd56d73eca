#!/usr/bin/env python3
"""reploy: the host role of Reploy.

  reploy stage BLUEPRINT --dir DIR           validate a blueprint, make DIR a staging deployment
  reploy build --dir DIR                     build its image, record the new current generation
  reploy controlled-session run ... -- CMD   run one controlled session, print one JSON result

Peers:
  * the Docker Engine, through the Docker SDK (never the docker CLI);
  * reploy_session_client.py, which runs inside the controller container as the broker. It also
    holds the public stream codec and the private channel framing, which this file imports so
    both ends speak from one definition. It must sit beside this file.

Machine output is one JSON document on stdout; human text goes to stderr.

Reading order: constants, exceptions, value types, pure cores (durations, blueprints, the
lifecycle machine, the run result), Docker adapters, deployments, the controlled session, CLI.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import hashlib
import io
import json
import os
import queue
import re
import secrets
import selectors
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
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
import psutil
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

CLIENT_SOURCE = Path(wire.__file__).resolve()
WATCHDOG_SOURCE = Path(reploy_watchdog.__file__).resolve()
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
#: Output frames queued toward the controller before we stop reading the PTY.
CHANNEL_BULK_HIGH_WATER_BYTES = 4 * wire.TERMINAL_CHUNK_BYTES

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


class StartupFailure(ReployError):
    """The session could not reach ready."""


# ============================================================================================
# Pure core: durations
# ============================================================================================

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}


def parse_duration_ms(text: str) -> int:
    """'30s', '100ms', '5m', '1h', '1.5s' -> milliseconds. Raises ValueError."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration like 100ms, 30s, 5m or 1h")
    value = float(match.group(1)) * _UNIT_MS[match.group(2)]
    if value != int(value):
        raise ValueError(f"{text!r} is finer than a millisecond")
    return int(value)


def format_duration(ms: int) -> str:
    for unit in ("h", "m", "s"):
        if ms % _UNIT_MS[unit] == 0:
            return f"{ms // _UNIT_MS[unit]}{unit}"
    return f"{ms}ms"


# ============================================================================================
# Pure core: blueprints
# ============================================================================================

_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_QUALIFIED = re.compile(r"^[a-z0-9][a-z0-9-]*(\.[a-z0-9][a-z0-9-]*)+$")
_USER = re.compile(r"^(\d{1,10}):(\d{1,10})$")
_ENDPOINT_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
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
    if not _NAME.match(name):
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
    match = _USER.match(user)
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
        if not isinstance(name, str) or not _NAME.match(name):
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
        if not isinstance(name, str) or not _QUALIFIED.match(name):
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
        if not isinstance(service, str) or not _NAME.match(service) or not isinstance(spec, dict):
            raise BlueprintError(f"{path}: must be a named mapping")
        _only_keys(spec, path, {"endpoints"})
        for endpoint_id, decl in _field(spec, "endpoints", dict, False, {}, parent=path).items():
            epath = f"{path}.endpoints.{endpoint_id}"
            if not isinstance(endpoint_id, str) or not _ENDPOINT_ID.match(endpoint_id):
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
            "error": self.error,
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

    role: str  # "controller" | "workload"
    image_id: str
    command: tuple[str, ...]
    runtime: Runtime
    environment: dict[str, str]
    labels: dict[str, str]
    network: Optional[str]  # None: network none
    network_aliases: tuple[str, ...] = ()
    mounts: tuple[Mount, ...] = ()
    tty: bool = False
    hostname: Optional[str] = None
    init: bool = False

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
            network_mode=self.network or "none",
            pids_limit=self.runtime.pids,
            mem_limit=f"{self.runtime.memory_mib}m",
            memswap_limit=f"{self.runtime.memory_mib}m",
            ipc_mode="private",
            init=self.init,
            log_config={"type": "json-file", "config": {"max-size": "1m", "max-file": "1"}}
            if not self.tty else {"type": "none", "config": {}},
        )
        networking = None
        if self.network:
            networking = api.create_networking_config({
                self.network: api.create_endpoint_config(aliases=list(self.network_aliases))})
        return dict(
            image=self.image_id,
            command=list(self.command),
            user=self.runtime.user,
            environment=dict(self.environment),
            labels=dict(self.labels),
            host_config=host_config,
            networking_config=networking,
            tty=self.tty,
            stdin_open=self.tty,
            hostname=self.hostname,
            working_dir=CONTAINER_HOME if self.role == "controller" else None,
        )


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
        try:
            self.api.kill(container_id, signal=signame)
        except docker.errors.APIError as e:
            if e.status_code not in (404, 409):  # already gone or not running
                raise

    @_docker_call("read controller logs")
    def log_tail(self, container_id: str) -> bytes:
        data = self.api.logs(container_id, stdout=True, stderr=True)
        return data[-CONTROLLER_LOG_TAIL_BYTES:]

    @_docker_call("remove container")
    def remove_container(self, container_id: str) -> None:
        with contextlib.suppress(docker.errors.NotFound):
            self.api.remove_container(container_id, force=True, v=True)

    @_docker_call("create network")
    def create_network(self, name: str, labels: dict[str, str]) -> str:
        return self.api.create_network(
            name, driver="bridge", internal=True, labels=labels, check_duplicate=True)["Id"]

    @_docker_call("remove network")
    def remove_network(self, network_id: str) -> None:
        with contextlib.suppress(docker.errors.NotFound):
            self.api.remove_network(network_id)

    def wait_in_thread(self, container_id: str, report: Callable[[str, Any], None],
                       tag: str) -> threading.Thread:
        """Observe the container's exit without blocking the loop; report (tag, code | error)."""
        api = docker.APIClient(version=self.api.api_version, timeout=None,
                               **docker.utils.kwargs_from_env())

        def observe() -> None:
            try:
                reply = api.wait(container_id, timeout=None)
                # An exit caused by someone else removing the container is not the workload's
                # own exit: the session lost sight of it.
                try:
                    state = api.inspect_container(container_id)["State"]
                except docker.errors.NotFound:
                    state = {"Status": "removed"}
                if state.get("Status") in ("removing", "removed") or state.get("Dead"):
                    raise BackendError(f"the {tag} container was removed behind the session")
                report(tag, int(reply["StatusCode"]))
            except Exception as e:  # noqa: BLE001 - any failure here means observation is lost
                report(tag, e if isinstance(e, BackendError) else
                       BackendError(f"waiting on {tag}: {e}"))
            finally:
                api.close()

        thread = threading.Thread(target=observe, name=f"wait-{tag}", daemon=True)
        thread.start()
        return thread


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
    number: int
    image_id: str
    reference: str
    blueprint_digest: str
    built_at: float


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


def state_path(directory: Path) -> Path:
    return directory / STATE_DIRNAME / "state.json"


def load_deployment(directory: Path) -> Deployment:
    directory = directory.resolve()
    try:
        state = json.loads(state_path(directory).read_text())
    except FileNotFoundError:
        raise DeploymentError(f"{directory} is not a staging deployment (run reploy stage)") from None
    except (OSError, ValueError) as e:
        raise DeploymentError(f"{state_path(directory)}: unreadable state: {e}") from e
    if state.get("schema") != STATE_SCHEMA:
        raise DeploymentError(f"{state_path(directory)}: unknown state schema")
    blueprint, raw = load_blueprint_file(directory / BLUEPRINT_NAME)
    current = state.get("current_generation")
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
            state = json.loads(state_path(directory).read_text())
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
    """Build the staged context and record it as the new current generation, atomically."""
    deployment = load_deployment(directory)
    number = 1 + (deployment.current.number if deployment.current else 0)
    reference = f"reploy/{deployment.blueprint.name}:{deployment.deployment_id[:12]}-g{number}"
    image_id = backend.build(
        path=str(deployment.dir / CONTEXT_DIRNAME),
        dockerfile=deployment.blueprint.dockerfile,
        tag=reference,
        labels={LABEL_DEPLOYMENT: deployment.deployment_id, LABEL_GENERATION: str(number)},
    )
    generation = Generation(number, image_id, reference, deployment.blueprint_digest, time.time())
    state = json.loads(state_path(deployment.dir).read_text())
    state["current_generation"] = generation.__dict__
    reploy_watchdog.atomic_write_json(state_path(deployment.dir), state, mode=0o644)
    return {"schema": BUILD_SCHEMA, "ok": True, "error": None, "dir": str(deployment.dir),
            "deployment_id": deployment.deployment_id, "generation": generation.__dict__}


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
    """What admission decided: exact images, the controller argv, the granted endpoints."""

    run_id: str
    controller: Deployment
    workload: Deployment
    controller_argv: tuple[str, ...]
    endpoints: tuple[wire.Endpoint, ...]


def admit(options: RunOptions) -> SessionPlan:
    """Check everything that can be checked before touching Docker. Raises AdmissionError."""
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
    command, args = controller.blueprint.resolve_command(list(options.command))
    argv = controller.blueprint.executables[command.executable] + tuple(args)
    granted = []
    for endpoint_id in options.endpoints:
        decl = workload.blueprint.endpoints.get(endpoint_id)
        if decl is None:
            raise AdmissionError(f"endpoint {endpoint_id!r} is not declared by the workload")
        granted.append(wire.Endpoint(id=decl.id, scheme=decl.scheme, host="workload",
                                     port=decl.port))
    if (options.output_dir or options.output_file) and controller.blueprint.runtime.uid == 0:
        raise AdmissionError("--output-dir and --output-file need a non-root controller runtime")
    if options.output_file is not None:
        if not options.output_file.parent.is_dir():
            raise AdmissionError(f"--output-file: {options.output_file.parent} is not a directory")
        if os.path.lexists(options.output_file):
            raise AdmissionError(f"--output-file: {options.output_file} already exists")
    return SessionPlan(secrets.token_hex(16), controller, workload, argv, tuple(granted))


def ensure_controller_image(backend: DockerBackend, base_image_id: str,
                            runtime: Runtime) -> str:
    """The controller generation plus one layer holding the client, cached by both digests."""
    client_bytes = CLIENT_SOURCE.read_bytes()
    client_digest = hashlib.sha256(client_bytes).hexdigest()
    key = hashlib.sha256(f"{base_image_id}\n{client_digest}".encode()).hexdigest()[:32]
    reference = f"reploy/controller-derived:{key}"
    labels = backend.image_labels(reference)
    if labels and labels.get(LABEL_DERIVED_BASE) == base_image_id and labels.get(
            LABEL_CLIENT_DIGEST) == client_digest:
        return reference
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
    image_id = backend.build(fileobj=context, custom_context=True, tag=reference,
                             labels={LABEL_DERIVED_BASE: base_image_id,
                                     LABEL_CLIENT_DIGEST: client_digest})
    probe_python(backend, image_id, runtime)
    return reference


def probe_python(backend: DockerBackend, image_id: str, runtime: Runtime) -> None:
    """Say clearly when the controller image cannot run the client (it needs python3)."""
    spec = ContainerSpec(
        role="controller", image_id=image_id,
        command=("python3", "-c", "import json, selectors, socket, termios"),
        runtime=runtime, environment={"HOME": CONTAINER_HOME},
        labels={LABEL_ROLE: "python-probe"}, network=None)
    container_id = backend.create(spec)
    try:
        backend.start(container_id)
        code = backend.api.wait(container_id, timeout=60)["StatusCode"]
    except BackendError as e:
        code, detail = -1, str(e)
    else:
        detail = backend.log_tail(container_id).decode(errors="replace").strip()
    finally:
        backend.remove_container(container_id)
    if code != 0:
        backend.remove_image(image_id)
        raise AdmissionError(
            "the controller image must provide python3 with its standard library for "
            f"reploy-session-client; the probe failed ({detail or f'exit {code}'})")


# ============================================================================================
# The controlled session: the run
# ============================================================================================


class Notifier:
    """Wakes the selector loop from the wait threads: a queue plus a self-pipe byte."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.items: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()

    def report(self, tag: str, value: Any) -> None:
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
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def log(message: str) -> None:
    print(f"reploy: {message}", file=sys.stderr, flush=True)


@dataclass
class Owned:
    """What this run created and must remove, in every outcome."""

    containers: dict[str, str] = field(default_factory=dict)  # role -> container id
    labels: dict[str, dict[str, str]] = field(default_factory=dict)  # resource id -> labels
    network_id: Optional[str] = None
    channel_dir: Optional[Path] = None
    output_staging_dir: Optional[Path] = None


class Watchdog:
    """The host's end of reploy_watchdog.py.

    Armed before anything of the session exists; the manifest is rewritten (atomically) each
    time the session acquires something, so a host killed at any point leaves a true record.
    Disarmed only after the host's own cleanup.
    """

    def __init__(self, run_id: str, workload_dir: Path) -> None:
        self.manifest_path = reploy_watchdog.manifest_path_for(str(workload_dir), run_id)
        self.manifest = reploy_watchdog.Manifest(
            run_id=run_id, host=reploy_watchdog.process_identity(), watchdog="",
            containers={}, networks={}, paths=(),
            receipt_path=str(reploy_watchdog.receipt_path_for(str(workload_dir), run_id)))
        self.process: Optional[subprocess.Popen[bytes]] = None
        self.pipe_write_fd: Optional[int] = None

    def arm(self) -> None:
        self.record(self.manifest)
        read_fd, self.pipe_write_fd = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, str(WATCHDOG_SOURCE), "--manifest", str(self.manifest_path),
                 "--liveness-fd", str(read_fd), "--host", self.manifest.host],
                pass_fds=(read_fd,), start_new_session=True, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finally:
            os.close(read_fd)
        self.record(replace(self.manifest, watchdog=reploy_watchdog.process_identity(
            psutil.Process(self.process.pid))))

    def record(self, manifest: reploy_watchdog.Manifest) -> None:
        self.manifest = manifest
        reploy_watchdog.atomic_write_json(self.manifest_path, manifest.to_json())

    def record_owned(self, owned: Owned) -> None:
        self.record(replace(
            self.manifest,
            containers={cid: owned.labels[cid] for cid in owned.containers.values()},
            networks={owned.network_id: owned.labels[owned.network_id]}
            if owned.network_id else {},
            paths=tuple(str(p) for p in (owned.channel_dir, owned.output_staging_dir) if p)))

    def disarm(self) -> None:
        """Our own cleanup is done: tell the watchdog to go quietly, then forget the run."""
        if self.pipe_write_fd is not None:
            with contextlib.suppress(OSError):
                os.write(self.pipe_write_fd, reploy_watchdog.DISARM_BYTE)
            os.close(self.pipe_write_fd)
            self.pipe_write_fd = None
        if self.process is not None:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(FileNotFoundError):
            self.manifest_path.unlink()


class ControlledSession:
    """One run of `reploy controlled-session run`, from admission to the delivery tail.

    The phases are sequential code; waiting happens in `wait_until`, which runs one selector
    loop (channel, workload PTY, wait-thread notices, signals) until a condition holds or a
    deadline passes. The loop never decides the lifecycle on its own: it records facts
    (requests, EOFs, exits, signals) and latches causes through the LifecycleMachine.
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
        self.selector.register(self.notifier.read_fd, selectors.EVENT_READ, "notice")
        self.selector.register(wakeup.read_fd, selectors.EVENT_READ, "signal")
        self.signal_received: Optional[int] = None
        self.listener: Optional[socket.socket] = None
        self.channel: Optional[wire.FramedConnection] = None
        self.channel_lost: Optional[str] = None
        self.pty: Optional[socket.socket] = None
        self.pty_eof = False
        self.pty_input = bytearray()
        self.output_window = wire.DataWindow()
        self.attached = False
        self.complete_received = False
        self.ack_received = False
        self.workload_exit: Optional[int] = None
        self.exit_announced = False
        self.terminating_sent = False
        self.controller_exit: Optional[int] = None
        self.observation_lost: Optional[str] = None
        self.workload_started = False
        self.controller_started = False
        self.peer_cred: Optional[tuple[int, int, int]] = None

    # -- the whole run ----------------------------------------------------------------------

    def run(self) -> RunResult:
        """Every outcome, including our own bugs, ends in termination and the delivery tail."""
        startup_deadline = time.monotonic() + self.options.timeout_s("--startup-timeout")
        try:
            try:
                self.prepare()
                self.start(startup_deadline)
                self.wait_until(lambda: False)  # active: until a cause is latched
            except AdmissionError as e:
                self.result.error = f"plan rejected: {e}"
                self.latch(Cause.STARTUP_FAILURE, str(e))
            except (StartupFailure, BackendError, OSError) as e:
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

    def latch(self, cause: Cause, detail: str = "") -> None:
        if self.machine.phase is Phase.TERMINATED:
            return
        if self.machine.terminate(cause):
            log(f"terminating: {cause.value}{': ' + detail if detail else ''}")

    # -- preparing --------------------------------------------------------------------------

    def prepare(self) -> None:
        plan, backend = self.plan, self.backend
        backend.require_sandbox_support()
        for role, deployment in (("controller", plan.controller), ("workload", plan.workload)):
            assert deployment.current is not None
            if not backend.image_exists(deployment.current.image_id):
                raise StartupFailure(f"the {role} image {deployment.current.image_id} is gone")
        controller_runtime = plan.controller.blueprint.runtime
        controller_image = ensure_controller_image(
            backend, plan.controller.current.image_id, controller_runtime)  # type: ignore[union-attr]
        self.watchdog.arm()  # before anything the session owns exists
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
        network = None
        if plan.endpoints:
            network = f"reploy-{plan.run_id}"
            labels = self.labels("network")
            self.owned.network_id = backend.create_network(network, labels)
            self.owned.labels[self.owned.network_id] = labels
            self.watchdog.record_owned(self.owned)
        self.acquire_container(ContainerSpec(
            role="workload", image_id=plan.workload.current.image_id,  # type: ignore[union-attr]
            command=(WORKLOAD_SHELL,), runtime=plan.workload.blueprint.runtime,
            environment={"HOME": CONTAINER_HOME, "TERM": WORKLOAD_TERM},
            labels=self.labels("workload"), network=network, network_aliases=("workload",),
            tty=True, hostname="workload"))
        self.acquire_container(ContainerSpec(
            role="controller", image_id=controller_image, command=plan.controller_argv,
            runtime=controller_runtime, environment=environment,
            labels=self.labels("controller"), network=network, mounts=tuple(mounts),
            hostname="controller", init=True))

    def acquire_container(self, spec: ContainerSpec) -> None:
        container_id = self.backend.create(spec)
        self.owned.containers[spec.role] = container_id
        self.owned.labels[container_id] = spec.labels
        self.watchdog.record_owned(self.owned)

    def labels(self, role: str) -> dict[str, str]:
        """Every session container and network says whose it is, for the watchdog and for
        reconciliation after a crash that took the watchdog too."""
        deployment = self.plan.controller if role == "controller" else self.plan.workload
        labels = {LABEL_RUN: self.plan.run_id, LABEL_ROLE: role,
                  reploy_watchdog.LABEL_HOST: self.watchdog.manifest.host,
                  reploy_watchdog.LABEL_WATCHDOG: self.watchdog.manifest.watchdog,
                  reploy_watchdog.LABEL_WORKLOAD_DIR: str(self.plan.workload.dir)}
        if role != "network":
            labels[LABEL_DEPLOYMENT] = deployment.deployment_id
            labels[LABEL_GENERATION] = str(deployment.current.number)  # type: ignore[union-attr]
        return labels

    def open_channel(self, runtime: Runtime) -> None:
        """The private channel: a 0700 dir and a 0600 socket owned by the controller's uid:gid."""
        sessions = self.plan.workload.state_dir / "sessions"
        sessions.mkdir(parents=True, exist_ok=True)
        channel_dir = sessions / self.plan.run_id
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
        self.selector.register(listener, selectors.EVENT_READ, "listener")

    def prepare_outputs(self, runtime: Runtime) -> list[tuple[Mount, tuple[str, str]]]:
        """Mount the controller-only output destination, if one was requested."""
        options = self.options
        if options.output_dir is not None:
            options.output_dir.mkdir(parents=True, exist_ok=True)
            os.chown(options.output_dir, runtime.uid, runtime.gid)
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

    def start(self, deadline: float) -> None:
        backend, plan = self.backend, self.plan
        controller_id = self.owned.containers["controller"]
        backend.start(controller_id)
        self.controller_started = True
        backend.wait_in_thread(controller_id, self.notifier.report, "controller")
        if not self.wait_until(lambda: self.channel is not None, deadline):
            raise StartupFailure(self.startup_shortfall("the controller did not connect"))
        self.send_event(wire.Opened(
            operations=wire.OPERATIONS, endpoints=plan.endpoints,
            columns=self.options.columns, rows=self.options.rows,
            output_finalization_timeout_milliseconds=OUTPUT_FINALIZATION_TIMEOUT_MS))
        if not self.wait_until(lambda: self.attached, deadline):
            raise StartupFailure(self.startup_shortfall("no terminal attachment connected"))
        workload_id = self.owned.containers["workload"]
        self.pty = backend.attach_pty(workload_id)  # attach before start: no byte is missed
        self.selector.register(self.pty, selectors.EVENT_READ, "pty")
        backend.start(workload_id)
        self.workload_started = True
        backend.resize(workload_id, self.options.columns, self.options.rows)
        backend.wait_in_thread(workload_id, self.notifier.report, "workload")
        if self.machine.phase is not Phase.PREPARING:
            return
        self.machine.ready()
        self.send_event(wire.Ready())

    def startup_shortfall(self, what: str) -> str:
        if self.machine.cause is not None:
            return f"{what} before termination began ({self.machine.cause.value})"
        if self.channel_lost:
            return f"{what}: {self.channel_lost}"
        if self.controller_exit is not None:
            return f"{what}: the controller exited with code {self.controller_exit}"
        return f"{what} within the startup timeout"

    # -- the loop ---------------------------------------------------------------------------

    def wait_until(self, condition: Callable[[], bool], deadline: Optional[float] = None,
                   stop_on_latch: bool = True) -> bool:
        """Run the loop until condition() (True), the deadline, or (if stop_on_latch) a cause
        being latched (False). During startup a latched cause raises StartupFailure."""
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
            events = selectors.EVENT_READ | (
                selectors.EVENT_WRITE if self.channel.wants_write else 0)
            self.selector.modify(self.channel.sock, events, "channel")
        if self.pty is not None and not self.pty_eof:
            events = selectors.EVENT_WRITE if self.pty_input else 0
            if self.output_window.available_bytes > 0 and (
                    self.channel is None
                    or self.channel.pending_bulk_bytes < CHANNEL_BULK_HIGH_WATER_BYTES):
                events |= selectors.EVENT_READ
            self.watch_pty(events)
        for key, mask in self.selector.select(timeout):
            handler = getattr(self, f"on_{key.data}")
            handler(mask)

    def watch_pty(self, events: int) -> None:
        assert self.pty is not None
        try:
            key = self.selector.get_key(self.pty)
        except KeyError:
            key = None
        if not events:
            if key is not None:
                self.selector.unregister(self.pty)
        elif key is None:
            self.selector.register(self.pty, events, "pty")
        elif key.events != events:
            self.selector.modify(self.pty, events, "pty")

    def on_signal(self, _mask: int) -> None:
        for signum in self.wakeup.drain():
            if signum in EXIT_FOR_SIGNAL and self.signal_received is None:
                self.signal_received = signum
                log(f"received {signal.Signals(signum).name}; cancelling")
                self.latch(Cause.HOST_CANCEL, signal.Signals(signum).name)

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

    def announce_workload_exit(self) -> None:
        """workload-exit precedes terminating when it is the cause; otherwise it follows."""
        if (self.workload_exit is None or self.exit_announced or not self.machine.reached_ready
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
        runtime = self.plan.controller.blueprint.runtime
        if (uid, gid) != (runtime.uid, runtime.gid):
            log(f"refused a channel peer with uid:gid {uid}:{gid} (pid {pid})")
            conn.close()
            return
        self.peer_cred = (pid, uid, gid)
        self.close_listener()  # exactly one peer; the path is gone from now on
        self.channel = wire.FramedConnection(conn)
        self.selector.register(conn, selectors.EVENT_READ, "channel")

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
                for frame in channel.receive():
                    self.on_frame(frame)
                if channel.eof:
                    self.lose_channel("the controller closed the session channel")
        except wire.ProtocolError as e:
            self.lose_channel(f"channel protocol violation: {e.message}")
        except OSError as e:
            self.lose_channel(f"channel failed: {e}")

    def lose_channel(self, reason: str) -> None:
        if self.channel is None:
            return
        self.selector.unregister(self.channel.sock)
        self.channel.close()
        self.channel = None
        self.channel_lost = reason
        if self.machine.phase is Phase.PREPARING:
            self.latch(Cause.STARTUP_FAILURE, reason)
        else:
            self.latch(Cause.CONTROLLER_LOST, reason)

    def on_frame(self, frame: wire.Frame) -> None:
        if frame.kind is FrameKind.INPUT:
            if self.pty is not None and not self.pty_eof and self.machine.phase is Phase.ACTIVE:
                self.pty_input += frame.payload
            else:
                self.send_frame(wire.credit_frame(len(frame.payload)))  # dropped: refund it
        elif frame.kind is FrameKind.CREDIT:
            self.output_window.grant(frame)
        elif frame.kind is FrameKind.ATTACHED:
            frame.json()
            self.attached = True
        elif frame.kind is FrameKind.REQUEST:
            self.on_request(wire.decode_message(frame.payload + b"\n", wire.Direction.REQUEST))
        else:
            raise wire.FramingError(f"unexpected {frame.kind.name} frame from the controller")

    def on_request(self, request: wire.Message) -> None:
        if isinstance(request, wire.Resize):
            if self.machine.phase is Phase.ACTIVE:
                self.backend.resize(self.owned.containers["workload"], request.columns,
                                    request.rows)
        elif isinstance(request, wire.Terminate):
            if self.machine.phase is Phase.ACTIVE:
                self.latch(Cause.CONTROLLER_TERMINATE)
        elif isinstance(request, wire.Complete):
            self.complete_received = True
        elif isinstance(request, wire.AcknowledgeTerminated):
            self.ack_received = True

    def on_pty(self, mask: int) -> None:
        assert self.pty is not None
        if mask & selectors.EVENT_WRITE and self.pty_input:
            try:
                sent = self.pty.send(self.pty_input)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                sent = len(self.pty_input)  # the PTY is gone; the bytes have nowhere to go
            if sent:
                del self.pty_input[:sent]
                self.send_frame(wire.credit_frame(sent))
        if mask & selectors.EVENT_READ:
            want = min(self.output_window.available_bytes, wire.TERMINAL_CHUNK_BYTES)
            try:
                data = self.pty.recv(want)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self.pty_eof = True
                self.watch_pty(0)
                return
            self.output_window.take(len(data))
            self.send_frame(wire.encode_frame(FrameKind.OUTPUT, data), urgent=False)

    def send_frame(self, frame: bytes, urgent: bool = True) -> None:
        if self.channel is not None:
            self.channel.send(frame, urgent)

    def send_event(self, event: wire.Message) -> None:
        self.send_frame(wire.encode_frame(FrameKind.EVENT, wire.encode_compact(event.to_json())))

    # -- terminating ------------------------------------------------------------------------

    def terminate(self) -> None:
        """The termination sequence; each step is bounded and each outcome a separate fact."""
        machine = self.machine
        cause = machine.cause
        assert cause is not None
        began = time.monotonic()
        output_deadline = began + OUTPUT_FINALIZATION_TIMEOUT_MS / 1000.0
        if machine.reached_ready:
            self.send_event(wire.Terminating(cause=cause))
            self.terminating_sent = True
            self.announce_workload_exit()  # an exit seen before terminating went out
        self.stop_workload()
        output_status = self.finalize_output(output_deadline)
        controller_finalization = None
        if machine.reached_ready:
            controller_finalization = self.await_complete()
        if self.pty is not None:
            self.watch_pty(0)
            self.pty.close()
            self.pty = None
        workload_cleanup = self.remove_containers(("workload",))
        observation = Status.of("runtime_observation", "maintained")
        if self.observation_lost:
            observation = Status.of("runtime_observation", "lost", reason=self.observation_lost)
        workload_status = None
        if self.workload_exit is not None:
            workload_status = process_status(self.workload_exit)
        elif self.workload_started:
            workload_status = Status.of("process", "not-observed",
                                        reason=self.observation_lost or "exit was not observed")
        session_result = SessionResult(
            cause=cause,
            workload_status=workload_status,
            workload_output_finalization_status=output_status,
            runtime_observation_status=observation if self.workload_started else None,
            controller_finalization_status=controller_finalization,
            cleanup_status=workload_cleanup,
            recovery_action=RecoveryAction.NONE if workload_cleanup.kind == "succeeded"
            else RecoveryAction.RECONCILE,
        )
        machine.finish()
        self.result.session_result = session_result
        self.deliver_result(session_result)

    def stop_workload(self) -> None:
        """SIGTERM, the termination grace, then SIGKILL. A never-started workload is skipped."""
        if not self.workload_started or self.workload_exit is not None or self.observation_lost:
            return
        workload_id = self.owned.containers["workload"]
        grace_s = self.options.timeout_s("--termination-grace")
        try:
            self.backend.kill(workload_id, "SIGTERM")
            if self.wait_until(self.workload_gone, time.monotonic() + grace_s, stop_on_latch=False):
                return
            log(f"workload still running after the {format_duration(int(grace_s * 1000))} grace; "
                "sending SIGKILL")
            self.backend.kill(workload_id, "SIGKILL")
        except BackendError as e:
            log(f"could not signal the workload: {e}")
        self.wait_until(self.workload_gone,
                        time.monotonic() + self.options.timeout_s("--cleanup-timeout"),
                        stop_on_latch=False)

    def workload_gone(self) -> bool:
        return self.workload_exit is not None or self.observation_lost is not None

    def finalize_output(self, deadline: float) -> Optional[Status]:
        """Drain the PTY to EOF within the host-owned deadline; report drained or failed."""
        if self.pty is None:
            return None
        drained = self.wait_until(
            lambda: self.pty_eof and (self.channel is None or not self.channel.wants_write),
            deadline, stop_on_latch=False)
        if drained and self.channel is None and self.machine.reached_ready:
            drained = False
            reason = "the controller channel was lost before terminal output was delivered"
        elif drained:
            reason = ""
        elif not self.pty_eof:
            reason = (f"terminal output did not reach end of file within "
                      f"{OUTPUT_FINALIZATION_TIMEOUT_MS // 1000} s of termination")
        else:
            reason = "terminal output could not be delivered to the controller in time"
        status = {"status": "drained"} if drained else {"status": "failed", "reason": reason}
        self.send_frame(wire.encode_json_frame(FrameKind.OUTPUT_END, status), urgent=False)
        if self.machine.reached_ready:
            self.send_event(wire.WorkloadOutputsFinalized(**status))
        return (Status.of("output_finalization", "drained") if drained
                else failed("output_finalization", reason))

    def await_complete(self) -> Status:
        timeout_s = self.options.timeout_s("--controller-finalization-timeout")
        if self.wait_until(lambda: self.complete_received or self.channel is None,
                           time.monotonic() + timeout_s, stop_on_latch=False) \
                and self.complete_received:
            return Status.of("controller_finalization", "completed")
        if self.channel is None:
            return Status.of("controller_finalization", "not-completed",
                             reason="the controller was lost before completing finalization")
        return Status.of("controller_finalization", "finalization-timeout",
                         reason=f"no complete within {format_duration(int(timeout_s * 1000))}")

    def remove_containers(self, roles: tuple[str, ...]) -> Status:
        failures = []
        for role in roles:
            container_id = self.owned.containers.get(role)
            if container_id is None:
                continue
            try:
                self.backend.remove_container(container_id)
                del self.owned.containers[role]
            except BackendError as e:
                failures.append(str(e))
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

    def delivery_tail(self) -> None:
        """Close the channel, let the controller finish, then remove everything else."""
        if self.channel is not None:
            self.selector.unregister(self.channel.sock)
            self.channel.close()
            self.channel = None
        self.close_listener()
        failures: list[str] = []
        controller_id = self.owned.containers.get("controller")
        cleanup_s = self.options.timeout_s("--cleanup-timeout")
        if controller_id and self.controller_started:
            exited = self.wait_until(lambda: self.controller_exit is not None,
                                     time.monotonic() + cleanup_s / 2, stop_on_latch=False)
            if not exited:
                log("the controller is still running after the session; stopping it")
                with contextlib.suppress(BackendError):
                    self.backend.kill(controller_id, "SIGKILL")
                self.wait_until(lambda: self.controller_exit is not None,
                                time.monotonic() + cleanup_s / 2, stop_on_latch=False)
            if self.controller_exit is not None:
                self.result.controller_status = process_status(self.controller_exit)
            else:
                self.result.controller_status = Status.of(
                    "process", "not-observed", reason="the controller's exit was not observed")
            with contextlib.suppress(BackendError):
                tail = self.backend.log_tail(controller_id)
                if tail:
                    sys.stderr.write("reploy: controller output follows\n")
                    sys.stderr.write(tail.decode(errors="replace"))
                    sys.stderr.flush()
        for role in list(self.owned.containers):
            status = self.remove_containers((role,))
            if status.kind != "succeeded":
                failures.append(status.reason or role)
        if self.owned.network_id is not None:
            try:
                self.backend.remove_network(self.owned.network_id)
                self.owned.network_id = None
            except BackendError as e:
                failures.append(str(e))
        self.publish_output()
        for path in (self.owned.channel_dir, self.owned.output_staging_dir):
            if path is not None:
                try:
                    shutil.rmtree(path)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    failures.append(f"remove {path}: {e}")
        self.owned.channel_dir = self.owned.output_staging_dir = None
        self.result.delivery_tail_cleanup_status = (
            failed("cleanup", "; ".join(failures)) if failures else succeeded())
        self.result.delivery_tail_recovery_action = (
            RecoveryAction.RECONCILE if failures else RecoveryAction.NONE)
        if failures:
            log("cleanup left something behind; `reploy.py controlled-session cleanup` "
                "reconciles it")
        self.watchdog.disarm()
        self.notifier.close()
        self.selector.close()

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
        staged = staging / destination.name
        try:
            info = os.lstat(staged)
            if not stat.S_ISREG(info.st_mode):
                raise OSError(f"{staged.name} is not a regular file")
            os.link(staged, destination, follow_symlinks=False)  # fails if destination exists
            self.result.controller_output = Status.of("controller_output", "file-published")
        except OSError as e:
            self.result.error = f"publish controlled-session controller output: {e}"
            self.result.controller_output = Status.of(
                "controller_output", "failed", reason="controller output publication failed")


def reconcile(backend: DockerBackend, workload_dirs: list[Path]) -> list[dict[str, Any]]:
    """Clean up after sessions whose host and watchdog both died; every reploy operation that
    touches Docker does this first, so such leftovers never accumulate."""
    manifests = tuple(path for directory in workload_dirs for path in sorted(
        (directory.resolve() / STATE_DIRNAME / "watchdog").glob("*.json")))
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
    """Admission, then the session. Returns the result and the signal that cancelled it."""
    with wire.SignalWakeup((signal.SIGINT, signal.SIGTERM)) as wakeup:
        try:
            plan = admit(options)
        except AdmissionError as e:
            return RunResult(error=f"admission rejected: {e}"), None
        try:
            backend = DockerBackend()
            reconcile(backend, [plan.workload.dir, plan.controller.dir])
        except BackendError as e:
            return RunResult(error=f"admission rejected: {e}"), None
        session = ControlledSession(options, plan, backend, wakeup)
        return session.run(), session.signal_received


# ============================================================================================
# CLI
# ============================================================================================


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of exiting, so main() owns exit codes."""

    def error(self, message: str) -> Any:
        raise UsageError(message)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="reploy", description="Sandboxed, controllable sessions on Docker.")
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


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.buffer.write(wire.encode_compact(obj) + b"\n")
    sys.stdout.buffer.flush()


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
        elif command:
            raise UsageError("only controlled-session run takes arguments after --")
    except UsageError as e:
        print(f"reploy: usage error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if getattr(args, "action", None) == "run":
        result, signum = run_controlled_session(options)
        sys.stdout.buffer.write(result.encode())
        sys.stdout.buffer.flush()
        if signum is not None:
            return EXIT_FOR_SIGNAL[signum]
        return EXIT_OK if result.ok else EXIT_FAILED
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
            emit({"schema": CLEANUP_SCHEMA, "ok": all(r["cleanup_succeeded"] for r in receipts),
                  "error": None, "receipts": receipts})
    except ReployError as e:
        print(f"reploy: {args.command}: {e}", file=sys.stderr)
        emit({"schema": schema, "ok": False, "error": str(e)})
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
