"""reploy_kube: the Kubernetes adapter of Reploy's control plane (`reploy serve --backend kubernetes`).

Who runs it: `reploy serve`, and only when started with `--backend kubernetes` (reploy_serve.py imports this
file then, never otherwise: the Docker backend and `make demo` neither load nor need it). It runs on the host or
as a Pod with its own service account.

What it may touch: the apiserver named by a kubeconfig or by the Pod's own service account, and only there the
namespace it is given: Pods, pods/exec, ConfigMaps and NetworkPolicies it made (docs/kubernetes-backend.md has
the Role). It never shells out (no kubectl), never skips TLS verification, never runs a credential plugin, and
never opens a port into a sandbox: each session's agent is reached through the apiserver's `pods/exec`, over one
long-lived WebSocket stream per session that runs `agent.py relay` (AgentChannel).

Why a file of its own: it is one engine's adapter (seed 002's `adapter/k8s`), with its own protocols (the
apiserver's REST and Status objects, RFC 6455, the v4.channel.k8s.io exec channels), its own trust rules (what a
kubeconfig may ask for) and its own failure modes; serve's session rules stay in reploy_serve.py and drive this
through a narrow interface. Stdlib only (PyYAML for kubeconfig files, which the host already depends on): the
role stays auditable, and the real apiserver the tests run against proves it correct.

Everything that comes back from a session (its agent's answers, the relay's lines, an exec's output) is hostile
input: bounded, parsed strictly, never passed on unchecked. The apiserver's own answers are bounded and parsed
strictly too, and their messages made safe text before they reach an exception.

Contents, in reading order:
  constants and errors
  types (enums and frozen dataclasses)
  pure core: kubeconfig and in-cluster configuration
  pure core: API paths and Status objects
  pure core: the WebSocket codec (RFC 6455) and the exec channels (v4.channel.k8s.io)
  pure core: the session Pod, the agent's ConfigMap, the sessions' NetworkPolicy
  I/O: credentials and TLS
  I/O: the REST client
  I/O: the exec stream (one selector thread per WebSocket)
  I/O: the agent channel (many agent requests over one exec)
"""

from __future__ import annotations

import base64
import enum
import hashlib
import http.client
import itertools
import os
import re
import selectors
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import yaml

import reploy_session_client as wire  # the project's one strict JSON parser and compact encoder
from reploy import (CONTAINER_HOME, HOME_TMPFS_SIZE, LABEL_ROLE, LABEL_RUN,  # the host role's sandbox facts
                    SUPERVISOR_CAPABILITIES, Runtime)

# ======================================================================================================================
# Constants and errors
# ======================================================================================================================

KIB = 1024
MIB = 1024 * KIB

#: Labels of everything this adapter makes: which serve made it (a serve sweeps only its own).
LABEL_SERVE = "io.reploy.serve"
#: The role label's value on a session's Pod (reploy.LABEL_ROLE), as on a Docker session's container.
MANAGED_ROLE = "managed"

#: A service account's files and the environment a Pod is given, for the in-cluster configuration.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_HOST_ENV = "KUBERNETES_SERVICE_HOST"
SERVICE_PORT_ENV = "KUBERNETES_SERVICE_PORT"
#: A bound service-account token is rotated by the kubelet (hourly by default): read again this often.
TOKEN_REREAD_S = 60.0

#: Whole-call deadline of one REST request (connect, TLS, request, answer): a trickling apiserver cannot hold serve.
API_DEADLINE_S = 30.0
#: The most of one REST answer read: a list of every session Pod of a busy serve fits.
API_MAX_RESPONSE_BYTES = 32 * MIB
#: The most of a handshake answer's head (status line and headers) read.
MAX_HANDSHAKE_BYTES = 16 * KIB
#: One WebSocket message (all its fragments) at most: the kubelet sends an exec's output in pieces far smaller;
#: lines longer than this span several messages and are bounded by their reader.
MAX_MESSAGE_BYTES = 4 * MIB
#: The most an exec stream holds unsent for its writers before they wait.
MAX_OUTBOUND_BYTES = 16 * MIB
#: One read of a stream's socket, and one write.
IO_CHUNK_BYTES = 64 * KIB
#: What the apiserver's exec answers for its channels (v4: a Status on the error channel carries the exit code).
EXEC_SUBPROTOCOL = "v4.channel.k8s.io"
#: RFC 6455's GUID, joined to Sec-WebSocket-Key to make Sec-WebSocket-Accept.
WEBSOCKET_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
#: Shown of an error answer that is not a Status: its first bytes.
STATUS_TEXT_BYTES = 512
#: Kept of an exec's stderr, for a diagnostic: its last bytes.
STDERR_TAIL_BYTES = 4 * KIB
#: One stdin message of an exec given input.
STDIN_PIECE_BYTES = 256 * KIB
#: A closing stream waits this long for the peer's close frame.
CLOSE_WAIT_S = 2.0

#: One answer line of the agent (reploy_serve's AGENT_MAX_RESPONSE_BYTES; the agent's exec pages stay under it).
AGENT_MAX_RESPONSE_BYTES = 4 * MIB
#: One request line to the agent (agent.MAX_REQUEST_BYTES), newline excluded.
AGENT_MAX_REQUEST_BYTES = 8 * MIB
#: Opening a session's agent channel: the exec's handshake through the apiserver and kubelet.
CHANNEL_OPEN_DEADLINE_S = 30.0
#: A call's default deadline: the agent answers every request within 5 s (docs/agent.md); we outwait it.
AGENT_CALL_TIMEOUT_S = 10.0

#: The session Pod: names of its parts.
POD_NAME_PREFIX = "reploy-session-"
AGENT_CONTAINER = "agent"
LAYOUT_CONTAINER = "layout"
#: Where the agent's ConfigMap (agent.py and its bytecode) appears: AGENT_MOUNT's directory in reploy_serve.py.
AGENT_FILES_MOUNT = "/opt/reploy"
#: A Docker session's HOME is a tmpfs of HOME_TMPFS_SIZE ("64m"); a Pod's is a Memory emptyDir of the same size.
HOME_SIZE_LIMIT = HOME_TMPFS_SIZE.removesuffix("m") + "Mi"
#: Each of the runtime's writable paths: a Memory emptyDir, as reploy.ContainerSpec's tmpfs of 256m.
WRITABLE_PATH_SIZE_LIMIT = "256Mi"
#: What the layout init container keeps: to hand the session's directories to the runtime user and set their modes.
LAYOUT_CAPABILITIES = ("CHOWN", "FOWNER")
#: The agent's session directory and its own directory (agent.SESSION_DIR_MODE, agent.PRIVATE_DIR_MODE): the agent
#: refuses an emptyDir's 0777.
SESSION_DIR_MODE = 0o755
PRIVATE_DIR_MODE = 0o700
#: How long a deleted session Pod's processes have after SIGTERM.
TERMINATION_GRACE_S = 5
#: Kubernetes' bounds on names and label values.
MAX_NAME_CHARS = 63
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_CONFIG_MAP_KEY = re.compile(r"[-._a-zA-Z0-9]+")


class KubeError(Exception):
    """Root of this adapter's errors."""


class KubeConfigError(KubeError):
    """The configuration (a kubeconfig, the in-cluster files) cannot be used as given: the operator's to fix."""


class KubeTransportError(KubeError):
    """The apiserver was not reached, did not answer within the deadline, or answered something that is not a
    Kubernetes answer. Trying again may help."""


class KubeApiError(KubeError):
    """The apiserver refused a request: its Status's code, reason and message (safe text)."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code = code
        self.reason = reason
        self.message = message


class KubeNotFound(KubeApiError):
    """404 NotFound."""


class KubeAlreadyExists(KubeApiError):
    """409 AlreadyExists: a create of a name that is taken."""


class KubeConflict(KubeApiError):
    """409 Conflict: a replace at a stale resourceVersion (compare-and-swap lost); read again and decide again."""


class WebSocketError(KubeError):
    """The WebSocket peer broke RFC 6455 or the exec protocol: the stream cannot go on."""


class AgentChannelError(KubeError):
    """An agent call over a session's channel failed. `retryable`: the call may not have reached the agent (the
    stream dropped or could not be opened); the next call opens a new stream. Not retryable: the agent or its relay
    answered something that is not an answer, or the call's deadline passed."""

    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


# ======================================================================================================================
# Types
# ======================================================================================================================


class Resource(enum.Enum):
    """The API resources this adapter uses: (API group path, resource name)."""

    PODS = ("/api/v1", "pods")
    CONFIG_MAPS = ("/api/v1", "configmaps")
    NETWORK_POLICIES = ("/apis/networking.k8s.io/v1", "networkpolicies")
    LEASES = ("/apis/coordination.k8s.io/v1", "leases")


class PullPolicy(enum.Enum):
    """A session image pulled from a registry when missing (IfNotPresent), or pre-loaded on every node (Never:
    `scripts/kube-cluster.sh load`; a Pod on a node without it fails instead of pulling)."""

    IF_NOT_PRESENT = "IfNotPresent"
    NEVER = "Never"


class Opcode(enum.IntEnum):
    """RFC 6455 frame opcodes."""

    CONTINUATION = 0x0
    TEXT = 0x1
    BINARY = 0x2
    CLOSE = 0x8
    PING = 0x9
    PONG = 0xA

    @property
    def is_control(self) -> bool:
        return self >= Opcode.CLOSE


class Channel(enum.IntEnum):
    """v4.channel.k8s.io: the first byte of each binary message names its stream."""

    STDIN = 0
    STDOUT = 1
    STDERR = 2
    ERROR = 3  # one metav1.Status when the command ended: Success, or Failure with its exit code
    RESIZE = 4


class CloseCode(enum.IntEnum):
    """The close codes this adapter sends (RFC 6455 7.4.1). A peer that breaks the protocol gets no close frame:
    its connection is dropped."""

    NORMAL = 1000


#: Codes that may appear in a close frame: RFC 6455's defined ones (1004, 1005, 1006 and 1015 never travel) and
#: the ranges for libraries and applications.
_SENDABLE_CLOSE_CODES = frozenset({1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014})


@dataclass(frozen=True)
class WebSocketMessage:
    """One whole WebSocket message (its fragments joined) or control frame."""

    opcode: Opcode
    payload: bytes


@dataclass(frozen=True)
class CloseReason:
    """A close frame's payload: no code (an empty payload), or a code and a UTF-8 reason."""

    code: Optional[int]
    reason: str = ""


@dataclass(frozen=True)
class ExecEnd:
    """How an exec's command ended, from the v4 error channel: exit_code 0 on Success; otherwise the code the
    Status's ExitCode cause names, or None with the message when it failed without one (the command could not
    start, the container is gone)."""

    exit_code: Optional[int]
    message: str


#: A credential or CA as the configuration gives it: the bytes themselves, or a file to read when connecting.
Source = Union[bytes, Path]


@dataclass(frozen=True)
class ClusterAccess:
    """How to reach one apiserver, and as whom: verified TLS with a CA, then a client certificate or a bearer
    token (its value, or a file read again as it rotates). `namespace` is the configuration's default, if any."""

    server: str  # https://host:port
    ca: Source
    tls_server_name: Optional[str] = None
    client_certificate: Optional[Source] = None
    client_key: Optional[Source] = None
    token: Optional[str] = None
    token_file: Optional[Path] = None
    namespace: Optional[str] = None

    @property
    def host_port(self) -> tuple[str, int]:
        url = urllib.parse.urlsplit(self.server)
        return url.hostname or "", url.port or 443

    @property
    def base_path(self) -> str:
        return urllib.parse.urlsplit(self.server).path.rstrip("/")


@dataclass(frozen=True)
class SessionPodSpec:
    """One session's Pod, as the backend-neutral session logic asks for it. `command` is the agent's whole command
    (`... agent.py serve --session-dir SESSION --workload ... --runtime-user UID:GID ...`), built by serve as for a
    Docker container; `session_mount` is the --session-dir it names, `home_mount` its --home."""

    session_id: str
    serve_id: str
    image: str
    pull_policy: PullPolicy
    command: tuple[str, ...]
    environment: tuple[tuple[str, str], ...]
    runtime: Runtime
    cpu_millis: int
    session_disk_mib: int
    agent_config_map: str
    session_mount: str
    home_mount: str = CONTAINER_HOME
    extra_labels: tuple[tuple[str, str], ...] = ()


# ======================================================================================================================
# Pure core: kubeconfig and in-cluster configuration
# ======================================================================================================================

#: What a kubeconfig's cluster and user entries may hold. Anything else is refused, not ignored: an unknown way to
#: authenticate, silently skipped, would connect as someone else (or as nobody).
_CLUSTER_KEYS = frozenset({"server", "certificate-authority", "certificate-authority-data", "tls-server-name",
                           "insecure-skip-tls-verify", "extensions"})
_USER_KEYS = frozenset({"client-certificate", "client-certificate-data", "client-key", "client-key-data", "token",
                        "tokenFile", "extensions"})
#: Refused with their own reason: credential plugins run programs on serve's host; impersonation, basic auth and a
#: proxy are not something serve should inherit from a user's kubeconfig.
_REFUSED_USER_KEYS = {"exec": "an exec credential plugin", "auth-provider": "an auth-provider plugin",
                      "username": "basic authentication", "password": "basic authentication",
                      "as": "impersonation", "as-groups": "impersonation", "as-uid": "impersonation",
                      "as-user-extra": "impersonation"}


def _entry(doc: Mapping[str, Any], kind: str, name: Any) -> Mapping[str, Any]:
    """The `kind` (cluster, context, user) entry named `name` in a kubeconfig's list of them."""
    entries = doc.get(f"{kind}s") or []
    if not isinstance(entries, list):
        raise KubeConfigError(f"kubeconfig: {kind}s is not a list")
    found = [e for e in entries if isinstance(e, dict) and e.get("name") == name]
    if len(found) != 1 or not isinstance(found[0].get(kind), dict):
        raise KubeConfigError(f"kubeconfig: no single {kind} named {name!r}")
    return found[0][kind]


def _source(entry: Mapping[str, Any], key: str, base_dir: Path, what: str) -> Optional[Source]:
    """`KEY-data` (base64) or `KEY` (a file, relative to the kubeconfig's directory), never both."""
    data, path = entry.get(f"{key}-data"), entry.get(key)
    if data is not None and path is not None:
        raise KubeConfigError(f"kubeconfig: {what} gives both {key} and {key}-data")
    if data is not None:
        try:
            return base64.b64decode(str(data), validate=True)
        except ValueError as e:
            raise KubeConfigError(f"kubeconfig: {what}'s {key}-data is not base64") from e
    if path is not None:
        if not isinstance(path, str) or not path:
            raise KubeConfigError(f"kubeconfig: {what}'s {key} is not a file name")
        return base_dir / path
    return None


def _https_server(server: Any, what: str) -> str:
    url = urllib.parse.urlsplit(str(server)) if isinstance(server, str) else None
    if url is None or url.scheme != "https" or not url.hostname or url.query or url.fragment:
        raise KubeConfigError(f"{what}: server {server!r} is not an https:// URL (plain HTTP is refused)")
    try:
        url.port
    except ValueError as e:
        raise KubeConfigError(f"{what}: server {server!r} has no valid port") from e
    return str(server).rstrip("/")


def parse_kubeconfig(doc: Any, base_dir: Path, context_name: Optional[str] = None) -> ClusterAccess:
    """The access a kubeconfig document gives through its current context (or `context_name`). Pure: files it
    names are not read here (relative ones are resolved against base_dir, the kubeconfig's directory).

    Strict: TLS is always verified against a CA (insecure-skip-tls-verify is refused; a cluster without a CA is
    refused, as serve never trusts the host's public CAs for a cluster), and the user is a client certificate and
    key or a bearer token: credential plugins (exec, auth-provider), basic auth and impersonation are refused."""
    if not isinstance(doc, dict):
        raise KubeConfigError("kubeconfig: not a YAML mapping")
    name = context_name or doc.get("current-context")
    if not name:
        raise KubeConfigError("kubeconfig: no current-context (and none named)")
    context = _entry(doc, "context", name)
    cluster = _entry(doc, "cluster", context.get("cluster"))
    user = _entry(doc, "user", context.get("user"))
    what = f"kubeconfig context {name!r}"
    unknown = sorted(set(cluster) - _CLUSTER_KEYS)
    if unknown:
        raise KubeConfigError(f"{what}: the cluster has fields serve does not take: {', '.join(unknown)}")
    if cluster.get("insecure-skip-tls-verify"):
        raise KubeConfigError(f"{what}: insecure-skip-tls-verify is refused: serve verifies the apiserver")
    ca = _source(cluster, "certificate-authority", base_dir, what)
    if ca is None:
        raise KubeConfigError(f"{what}: the cluster names no certificate-authority(-data)")
    for key in sorted(set(user) - _USER_KEYS):
        reason = _REFUSED_USER_KEYS.get(key)
        raise KubeConfigError(f"{what}: the user's {key} is refused" + (
            f" ({reason}: give serve a client certificate or a token)" if reason else " (a field serve does not take)"))
    certificate = _source(user, "client-certificate", base_dir, what)
    client_key = _source(user, "client-key", base_dir, what)
    token, token_file = user.get("token"), user.get("tokenFile")
    if (certificate is None) != (client_key is None):
        raise KubeConfigError(f"{what}: a client certificate needs its key, and a key its certificate")
    if token is not None and token_file is not None:
        raise KubeConfigError(f"{what}: the user gives both token and tokenFile")
    if certificate is None and token is None and token_file is None:
        raise KubeConfigError(f"{what}: the user has no client certificate and no token")
    if token is not None and (not isinstance(token, str) or not token or "\n" in token):
        raise KubeConfigError(f"{what}: the user's token is not one line of text")
    namespace = context.get("namespace")
    server_name = cluster.get("tls-server-name")
    return ClusterAccess(
        server=_https_server(cluster.get("server"), what), ca=ca,
        tls_server_name=str(server_name) if server_name else None,
        client_certificate=certificate, client_key=client_key, token=token,
        token_file=base_dir / token_file if isinstance(token_file, str) and token_file else None,
        namespace=str(namespace) if namespace else None)


def in_cluster_access(environment: Mapping[str, str], account_dir: Path = SERVICE_ACCOUNT_DIR,
                      namespace: Optional[str] = None) -> ClusterAccess:
    """The access of the Pod serve runs in: the apiserver's service address from the environment the kubelet
    sets, its service account's CA and token (a file: the kubelet rotates it) and namespace. Pure but for the
    namespace file, read when `namespace` is not given."""
    host, port = environment.get(SERVICE_HOST_ENV), environment.get(SERVICE_PORT_ENV)
    if not host or not port or not port.isdigit():
        raise KubeConfigError(f"not in a cluster: {SERVICE_HOST_ENV} and {SERVICE_PORT_ENV} are not both set")
    if namespace is None:
        try:
            namespace = (account_dir / "namespace").read_text().strip()
        except OSError as e:
            raise KubeConfigError(f"in-cluster: cannot read {account_dir / 'namespace'}: {e.strerror}") from e
    address = f"[{host}]" if ":" in host else host
    return ClusterAccess(server=f"https://{address}:{int(port)}", ca=account_dir / "ca.crt",
                         token_file=account_dir / "token", namespace=namespace)


# ======================================================================================================================
# Pure core: API paths and Status objects
# ======================================================================================================================


def require_name(name: str, what: str = "name") -> str:
    """A DNS-1123 label (Pods, ConfigMaps, namespaces as this adapter names them): lowercase, at most 63."""
    if len(name) > MAX_NAME_CHARS or not _DNS_LABEL.fullmatch(name):
        raise ValueError(f"{what} {name!r} is not a DNS label (a-z, 0-9, '-', at most {MAX_NAME_CHARS})")
    return name


def require_label_value(value: str, what: str) -> str:
    if len(value) > MAX_NAME_CHARS or not _LABEL_VALUE.fullmatch(value):
        raise ValueError(f"{what} {value!r} is not a label value (A-Z, a-z, 0-9, '-_.', at most {MAX_NAME_CHARS})")
    return value


def resource_path(resource: Resource, namespace: str, name: Optional[str] = None,
                  subresource: Optional[str] = None) -> str:
    """/api/v1/namespaces/NS/pods[/NAME[/SUBRESOURCE]], and the like for the other resources."""
    group, plural = resource.value
    path = f"{group}/namespaces/{require_name(namespace, 'namespace')}/{plural}"
    if name is not None:
        path += f"/{require_name(name)}"
    if subresource is not None:
        path += f"/{subresource}"
    return path


def label_selector(labels: Mapping[str, str]) -> str:
    """An equality selector (k=v,k2=v2) of checked label values."""
    return ",".join(f"{key}={require_label_value(value, key)}" for key, value in labels.items())


def json_object(data: bytes, max_bytes: int) -> dict[str, Any]:
    """One JSON object, parsed strictly (wire.parse_strict_object), with the whitespace JSON allows around it taken
    off first: Go's JSON encoder, the apiserver's, ends every document with a newline."""
    return wire.parse_strict_object(data.strip(b" \t\r\n"), max_bytes=max_bytes, writable=False)


_ERRORS_BY_REASON: dict[str, type[KubeApiError]] = {
    "NotFound": KubeNotFound, "AlreadyExists": KubeAlreadyExists, "Conflict": KubeConflict}


def status_error(http_status: int, body: bytes) -> KubeApiError:
    """The exception an apiserver's refusal stands for: its Status object (kind Status) when the body is one, else
    the HTTP status and the first bytes of the body. Reason and message are made safe text: a message may quote what
    a client sent."""
    reason, message, code = "", "", http_status
    try:
        status = json_object(body, API_MAX_RESPONSE_BYTES)
    except wire.ProtocolError:
        status = {}
    if status.get("kind") == "Status":
        reason = status["reason"] if isinstance(status.get("reason"), str) else ""
        message = status["message"] if isinstance(status.get("message"), str) else ""
        if isinstance(status.get("code"), int) and 100 <= status["code"] <= 599:
            code = status["code"]
    else:  # a plain text answer (the kubelet's, passed on for an exec): its first bytes say why
        message = body[:STATUS_TEXT_BYTES].decode("utf-8", "replace")
    cls = _ERRORS_BY_REASON.get(reason, KubeApiError)
    return cls(code, wire.safe_text(reason or http.client.responses.get(code, "Error")),
               wire.safe_text(message or "an empty answer"))


def exec_end(payload: bytes) -> ExecEnd:
    """The v4 error channel's Status: Success (exit 0), or Failure whose details.causes hold an ExitCode (the
    command's non-zero exit), or Failure without one (it never ran, or the stream broke). WebSocketError when the
    payload is not a Status."""
    try:
        status = json_object(payload, MAX_MESSAGE_BYTES)
    except wire.ProtocolError as e:
        raise WebSocketError(f"the exec's status is not JSON: {e}") from None
    if status.get("status") == "Success":
        return ExecEnd(0, "")
    if status.get("status") != "Failure":
        raise WebSocketError("the exec's status is neither Success nor Failure")
    message = wire.safe_text(status["message"]) if isinstance(status.get("message"), str) else "failed"
    details = status["details"] if isinstance(status.get("details"), dict) else {}
    causes = details["causes"] if isinstance(details.get("causes"), list) else []
    for cause in causes:
        if isinstance(cause, dict) and cause.get("reason") == "ExitCode":
            text = cause.get("message")
            if isinstance(text, str) and text.isdigit() and int(text) <= 255:
                return ExecEnd(int(text), message)
            raise WebSocketError("the exec's ExitCode cause is not a number of 0..255")
    return ExecEnd(None, message)


def exec_query(command: Sequence[str], container: str, stdin: bool) -> str:
    """The pods/exec query: the argv (one `command` each), the container, which streams; never a TTY."""
    pairs = [("command", part) for part in command]
    pairs += [("container", container), ("stdin", "true" if stdin else "false"), ("stdout", "true"),
              ("stderr", "true"), ("tty", "false")]
    return urllib.parse.urlencode(pairs)


# ======================================================================================================================
# Pure core: the WebSocket codec (RFC 6455) and the exec channels (v4.channel.k8s.io)
# ======================================================================================================================


def websocket_accept(key: str) -> str:
    """Sec-WebSocket-Accept for a Sec-WebSocket-Key: base64(SHA-1(key + GUID))."""
    return base64.b64encode(hashlib.sha1((key + WEBSOCKET_GUID).encode()).digest()).decode()


def handshake_request(host: str, target: str, key: str, headers: Mapping[str, str]) -> bytes:
    """The client's opening handshake (RFC 6455 4.1), asking for the v4 exec channels."""
    lines = [f"GET {target} HTTP/1.1", f"Host: {host}", "Upgrade: websocket", "Connection: Upgrade",
             f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13", f"Sec-WebSocket-Protocol: {EXEC_SUBPROTOCOL}",
             *(f"{name}: {value}" for name, value in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def parse_response_head(head: bytes) -> tuple[int, str, dict[str, str]]:
    """An HTTP/1.1 answer's head (status line and headers, without the blank line): its code, its reason phrase and
    its headers by lowercase name."""
    status_line, _, header_text = head.decode("latin-1").partition("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
        raise WebSocketError(f"handshake answer has no HTTP status line: {wire.safe_text(status_line)}")
    headers: dict[str, str] = {}
    for line in header_text.split("\r\n") if header_text else ():
        name, colon, value = line.partition(":")
        if not colon:
            raise WebSocketError("handshake answer has a header line without a colon")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), wire.safe_text(parts[2] if len(parts) > 2 else ""), headers


def check_handshake_response(head: bytes, key: str) -> None:
    """The server's answer head accepts this very handshake: 101, Upgrade websocket, Connection upgrade, the Accept
    that answers our key, and the v4 subprotocol. A refusal is KubeApiError (ExecStream reads its Status from the
    body that follows); anything else WebSocketError."""
    code, reason, headers = parse_response_head(head)
    if code != 101:
        raise KubeApiError(code, reason, "the exec was refused")
    if headers.get("upgrade", "").lower() != "websocket" or "upgrade" not in headers.get("connection", "").lower():
        raise WebSocketError("handshake answer is 101 but not an upgrade to websocket")
    if headers.get("sec-websocket-accept") != websocket_accept(key):
        raise WebSocketError("handshake answer's Sec-WebSocket-Accept does not answer our key")
    if headers.get("sec-websocket-protocol") != EXEC_SUBPROTOCOL:
        raise WebSocketError(f"the server did not agree to {EXEC_SUBPROTOCOL}")


def mask_payload(payload: bytes, mask_key: bytes) -> bytes:
    """XOR with the 4-byte key, repeated (RFC 6455 5.3); its own inverse. One big-integer XOR: a 4 MiB line is
    masked in milliseconds, where a byte loop would take a second."""
    n = len(payload)
    if not n:
        return b""
    key = (mask_key * (n // 4 + 1))[:n]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(n, "big")


def encode_frame(opcode: Opcode, payload: bytes, mask_key: Optional[bytes], fin: bool = True) -> bytes:
    """One frame: a client's is masked (mask_key, 4 random bytes); a server's (for tests) has none. The length in
    the fewest bytes RFC 6455 allows. Control frames are final and at most 125 bytes."""
    if opcode.is_control and (len(payload) > 125 or not fin):
        raise ValueError("a control frame is final and carries at most 125 bytes")
    head = bytearray([(0x80 if fin else 0) | opcode])
    mask_bit = 0x80 if mask_key is not None else 0
    n = len(payload)
    if n <= 125:
        head.append(mask_bit | n)
    elif n <= 0xFFFF:
        head.append(mask_bit | 126)
        head += n.to_bytes(2, "big")
    else:
        head.append(mask_bit | 127)
        head += n.to_bytes(8, "big")
    if mask_key is None:
        return bytes(head) + payload
    if len(mask_key) != 4:
        raise ValueError("a mask key is 4 bytes")
    return bytes(head) + mask_key + mask_payload(payload, mask_key)


def encode_close(code: int, reason: str = "") -> bytes:
    """A close frame's payload."""
    data = code.to_bytes(2, "big") + reason.encode()
    if code not in _SENDABLE_CLOSE_CODES and not 3000 <= code <= 4999 or len(data) > 125:
        raise ValueError(f"close code {code} cannot be sent, or the reason is too long")
    return data


def decode_close(payload: bytes) -> CloseReason:
    """A close frame's payload, checked: empty, or a code that may travel and a UTF-8 reason."""
    if not payload:
        return CloseReason(None)
    if len(payload) == 1:
        raise WebSocketError("a close frame's payload of one byte")
    code = int.from_bytes(payload[:2], "big")
    if code not in _SENDABLE_CLOSE_CODES and not 3000 <= code <= 4999:
        raise WebSocketError(f"close code {code} may not travel")
    try:
        return CloseReason(code, payload[2:].decode("utf-8"))
    except UnicodeDecodeError:
        raise WebSocketError("a close frame's reason is not UTF-8") from None


class FrameDecoder:
    """Bytes in, whole messages and control frames out (sans I/O). A fragmented message is joined; control frames
    may arrive between its fragments and are given at once. Strict, as a client must be with a server: a masked
    frame, a reserved bit (no extension is negotiated), an unknown opcode, a continuation with nothing to continue,
    a new message before the last one ended, a control frame that is long or fragmented, a length not in its
    fewest bytes, and a message over max_message_bytes (checked from the declared length, before its bytes are
    held) are WebSocketError; the decoder is then broken and refuses more.

    `masked`: what the peer's frames must be (False for a server's; True to decode a client's, as tests do)."""

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES, masked: bool = False) -> None:
        self._max = max_message_bytes
        self._masked = masked
        self._buffer = bytearray()
        self._fragments: Optional[tuple[Opcode, bytearray]] = None
        self._broken = False

    def feed(self, data: bytes) -> list[WebSocketMessage]:
        if self._broken:
            raise WebSocketError("the stream already broke the protocol")
        self._buffer += data
        messages: list[WebSocketMessage] = []
        try:
            while (frame := self._next_frame()) is not None:
                message = self._assemble(*frame)
                if message is not None:
                    messages.append(message)
        except WebSocketError:
            self._broken = True
            raise
        return messages

    def _next_frame(self) -> Optional[tuple[bool, Opcode, bytes]]:
        buf = self._buffer
        if len(buf) < 2:
            return None
        first, second = buf[0], buf[1]
        if first & 0x70:
            raise WebSocketError("a reserved bit is set (no extension was negotiated)")
        try:
            opcode = Opcode(first & 0x0F)
        except ValueError:
            raise WebSocketError(f"unknown opcode {first & 0x0F}") from None
        fin = bool(first & 0x80)
        if bool(second & 0x80) != self._masked:
            raise WebSocketError("a server's frame is masked" if not self._masked else "a client's frame is unmasked")
        length, offset = second & 0x7F, 2
        if length == 126:
            if len(buf) < 4:
                return None
            length, offset = int.from_bytes(buf[2:4], "big"), 4
            if length <= 125:
                raise WebSocketError("a length not in its fewest bytes")
        elif length == 127:
            if len(buf) < 10:
                return None
            length, offset = int.from_bytes(buf[2:10], "big"), 10
            if length >> 63:
                raise WebSocketError("a 64-bit length with its top bit set")
            if length <= 0xFFFF:
                raise WebSocketError("a length not in its fewest bytes")
        if opcode.is_control and (length > 125 or not fin):
            raise WebSocketError("a control frame that is fragmented or longer than 125 bytes")
        held = len(self._fragments[1]) if self._fragments is not None and not opcode.is_control else 0
        if held + length > self._max:
            raise WebSocketError(f"a message longer than {self._max} bytes")
        mask_key = b""
        if self._masked:
            if len(buf) < offset + 4:
                return None
            mask_key, offset = bytes(buf[offset:offset + 4]), offset + 4
        if len(buf) < offset + length:
            return None
        payload = bytes(buf[offset:offset + length])
        del buf[:offset + length]
        return fin, opcode, mask_payload(payload, mask_key) if mask_key else payload

    def _assemble(self, fin: bool, opcode: Opcode, payload: bytes) -> Optional[WebSocketMessage]:
        if opcode.is_control:
            if opcode is Opcode.CLOSE:
                decode_close(payload)  # refuses a close frame that is not one
            return WebSocketMessage(opcode, payload)
        if opcode is Opcode.CONTINUATION:
            if self._fragments is None:
                raise WebSocketError("a continuation frame with no message to continue")
            self._fragments[1].extend(payload)
        else:
            if self._fragments is not None:
                raise WebSocketError("a new message before the fragmented one ended")
            self._fragments = (opcode, bytearray(payload))
        if not fin:
            return None
        first_opcode, data = self._fragments
        self._fragments = None
        if first_opcode is Opcode.TEXT:
            try:
                bytes(data).decode("utf-8")
            except UnicodeDecodeError:
                raise WebSocketError("a text message that is not UTF-8") from None
        return WebSocketMessage(first_opcode, bytes(data))


def channel_message(channel: Channel, data: bytes) -> bytes:
    """A v4 binary message's payload for a channel: its number, then the bytes."""
    return bytes([channel]) + data


def split_channel(message: WebSocketMessage) -> tuple[Channel, bytes]:
    """A v4 message's channel and bytes. The server sends binary messages only; channel numbers beyond RESIZE are
    refused."""
    if message.opcode is not Opcode.BINARY or not message.payload:
        raise WebSocketError("an exec message that is not binary, or empty")
    try:
        return Channel(message.payload[0]), message.payload[1:]
    except ValueError:
        raise WebSocketError(f"an exec message on unknown channel {message.payload[0]}") from None


class LineSplitter:
    """A byte stream cut into newline-ended lines of at most max_bytes (newline excluded); a longer one is
    WebSocketError before it is held whole."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        scan_from = len(self._buffer)
        self._buffer += data
        lines: list[bytes] = []
        start = 0
        while (newline := self._buffer.find(b"\n", max(start, scan_from))) >= 0:
            if newline - start > self._max:
                raise WebSocketError(f"a line longer than {self._max} bytes")
            lines.append(bytes(self._buffer[start:newline]))
            start = newline + 1
        del self._buffer[:start]
        if len(self._buffer) > self._max:
            raise WebSocketError(f"a line longer than {self._max} bytes")
        return lines


# ======================================================================================================================
# Pure core: the session Pod, the agent's ConfigMap, the sessions' NetworkPolicy
# ======================================================================================================================


def session_pod_name(session_id: str) -> str:
    return require_name(POD_NAME_PREFIX + session_id, "session Pod name")


def session_labels(serve_id: str, session_id: Optional[str] = None) -> dict[str, str]:
    """What every session Pod of a serve carries; with a session id, that one session's."""
    labels = {LABEL_SERVE: require_label_value(serve_id, LABEL_SERVE), LABEL_ROLE: MANAGED_ROLE}
    if session_id is not None:
        labels[LABEL_RUN] = require_label_value(session_id, LABEL_RUN)
    return labels


def agent_config_map_name(files: Mapping[str, bytes]) -> str:
    """Named by its content: a new agent.py is a new ConfigMap, and a running Pod keeps the one it started with."""
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
    return f"reploy-agent-{digest.hexdigest()[:16]}"


def _config_map_key(path: str) -> str:
    key = path.replace("/", "..")  # a key holds no '/'; its item gives the path back
    if not _CONFIG_MAP_KEY.fullmatch(key) or PurePosixPath(path).is_absolute() or ".." in PurePosixPath(path).parts:
        raise ValueError(f"{path!r} cannot be a file of the agent's ConfigMap")
    return key


def agent_config_map(files: Mapping[str, bytes], serve_id: str) -> dict[str, Any]:
    """The ConfigMap that brings agent.py (and its bytecode) into every session Pod, immutable (the kubelet then
    stops watching it). Without a registry of our own this is how the agent reaches a Pod whatever its image:
    Docker bind-mounts the same files read-only. Keys are the relative paths ('/' written '..'); text goes in
    data, the rest in binaryData."""
    data: dict[str, str] = {}
    binary: dict[str, str] = {}
    for path, content in sorted(files.items()):
        try:
            data[_config_map_key(path)] = content.decode("utf-8")
        except UnicodeDecodeError:
            binary[_config_map_key(path)] = base64.b64encode(content).decode()
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": agent_config_map_name(files), "labels": {LABEL_SERVE: serve_id}},
            "immutable": True, "data": data, "binaryData": binary}


def config_map_items(config_map: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The volume items that put each key of an agent ConfigMap at its path, read-only for everyone."""
    keys = sorted([*config_map.get("data", {}), *config_map.get("binaryData", {})])
    return [{"key": key, "path": key.replace("..", "/"), "mode": 0o444} for key in keys]


def _security_context(user: int, capabilities: Sequence[str]) -> dict[str, Any]:
    """A container's whole sandbox, nothing left to a default: its uid and gid, read-only root, no privilege to
    gain (no_new_privs), every capability dropped but the named ones, the runtime's default seccomp filter."""
    return {"runAsUser": user, "runAsGroup": user, "runAsNonRoot": user != 0, "privileged": False,
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": list(capabilities)},
            "seccompProfile": {"type": "RuntimeDefault"}}


#: The layout init container's program (python3 is in every session image: the agent needs it). It gives the
#: volumes what the agent demands before the agent starts: the session dir root's 0755, its agent/ root's 0700, its
#: workspace/ the runtime user's 0700, HOME the runtime user's 0700, each writable path the runtime user's 0755.
LAYOUT_PROGRAM = """\
import os, sys
uid, gid, session, home, *writable = sys.argv[1:]
uid, gid = int(uid), int(gid)
os.chmod(session, 0o755)
os.mkdir(session + "/agent", 0o700)
os.chmod(session + "/agent", 0o700)
os.mkdir(session + "/workspace", 0o700)
os.chmod(session + "/workspace", 0o700)
os.chown(session + "/workspace", uid, gid)
os.chmod(home, 0o700)
os.chown(home, uid, gid)
for path in writable:
    os.chmod(path, 0o755)
    os.chown(path, uid, gid)
"""


def _volume_name(index: int) -> str:
    return f"writable-{index}"


def session_pod(spec: SessionPodSpec, config_map: Mapping[str, Any]) -> dict[str, Any]:
    """One session's Pod: the Docker backend's sandbox written out whole as its security context.

    The agent runs as root keeping SUPERVISOR_CAPABILITIES and starts the workload as the runtime user (as in
    Docker); an init container keeping only CHOWN and FOWNER lays the volumes out first (an emptyDir is 0777, and
    the agent refuses that). No service account token, no service links, no host namespaces, seccomp RuntimeDefault
    (1.20 leaves a Pod unconfined without it), limits equal to requests, HOME and the writable paths in memory,
    the session disk an emptyDir with a size limit, the pause process as init. `restartPolicy: Never`: a session whose agent died is recovered
    by serve (snapshot and restore), never restarted silently over its state."""
    runtime = spec.runtime
    resources = {"cpu": f"{spec.cpu_millis}m", "memory": f"{runtime.memory_mib}Mi"}
    limits = {"limits": dict(resources), "requests": dict(resources)}
    mounts: list[dict[str, Any]] = [{"name": "agent-files", "mountPath": AGENT_FILES_MOUNT, "readOnly": True},
              {"name": "session", "mountPath": spec.session_mount},
              {"name": "home", "mountPath": spec.home_mount}]
    mounts += [{"name": _volume_name(i), "mountPath": path} for i, path in enumerate(runtime.writable_paths)]
    volumes: list[dict[str, Any]] = [
        {"name": "agent-files", "configMap": {"name": config_map["metadata"]["name"], "defaultMode": 0o444,
                                              "items": config_map_items(config_map)}},
        {"name": "session", "emptyDir": {"sizeLimit": f"{spec.session_disk_mib}Mi"}},
        {"name": "home", "emptyDir": {"medium": "Memory", "sizeLimit": HOME_SIZE_LIMIT}}]
    volumes += [{"name": _volume_name(i), "emptyDir": {"medium": "Memory", "sizeLimit": WRITABLE_PATH_SIZE_LIMIT}}
                for i in range(len(runtime.writable_paths))]
    layout = {
        "name": LAYOUT_CONTAINER, "image": spec.image, "imagePullPolicy": spec.pull_policy.value,
        "command": ["python3", "-I", "-S", "-c", LAYOUT_PROGRAM, str(runtime.uid), str(runtime.gid),
                    spec.session_mount, spec.home_mount, *runtime.writable_paths],
        "resources": limits, "securityContext": _security_context(0, LAYOUT_CAPABILITIES),
        "volumeMounts": [m for m in mounts if m["name"] != "agent-files"],
        "terminationMessagePolicy": "FallbackToLogsOnError"}
    agent = {
        "name": AGENT_CONTAINER, "image": spec.image, "imagePullPolicy": spec.pull_policy.value,
        "command": list(spec.command), "env": [{"name": k, "value": v} for k, v in spec.environment],
        "resources": limits, "securityContext": _security_context(0, SUPERVISOR_CAPABILITIES),
        "volumeMounts": mounts, "stdin": False, "tty": False,
        "terminationMessagePolicy": "FallbackToLogsOnError"}
    labels = {**dict(spec.extra_labels), **session_labels(spec.serve_id, spec.session_id)}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": session_pod_name(spec.session_id), "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "hostNetwork": False, "hostPID": False, "hostIPC": False,
            # The Pod's pause process is then PID 1 of its containers, and reaps what the workload orphans, as
            # docker-init does for a Docker session: the agent as PID 1 would keep them as zombies, and 1.20 has
            # no per-Pod pids limit to bound them (tests/test_kube_session.py counts them).
            "shareProcessNamespace": True,
            "hostname": "session",
            "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "initContainers": [layout],
            "containers": [agent],
            "volumes": volumes,
        },
    }


def sessions_network_policy(serve_id: str) -> dict[str, Any]:
    """Default deny, both ways, for every session Pod of a serve: no policy rule lets anything in or out. Enforced
    only by a network plugin that implements NetworkPolicy; a cluster without one (this project's test cluster has
    no CNI) accepts it and enforces nothing (docs/kubernetes-backend.md)."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"reploy-sessions-{hashlib.sha256(serve_id.encode()).hexdigest()[:16]}",
                         "labels": {LABEL_SERVE: serve_id}},
            "spec": {"podSelector": {"matchLabels": session_labels(serve_id)},
                     "policyTypes": ["Ingress", "Egress"], "ingress": [], "egress": []}}


#: Waiting reasons a container does not leave by itself: an image that is not there (or may not be pulled), a spec
#: the runtime refuses. A launch waiting for Running stops at once on one of them.
STUCK_REASONS = frozenset({"ErrImageNeverPull", "ErrImagePull", "ImagePullBackOff", "InvalidImageName",
                           "CreateContainerConfigError", "CreateContainerError", "RunContainerError"})


def pod_ready(status: Mapping[str, Any]) -> bool:
    """A Pod's status says it runs and every container of it is ready (the agent has started)."""
    containers = status.get("containerStatuses")
    return (status.get("phase") == "Running" and isinstance(containers, list) and bool(containers)
            and all(isinstance(c, dict) and c.get("ready") is True for c in containers))


def pod_failure(status: Mapping[str, Any]) -> Optional[str]:
    """Why a session Pod will never run, as safe text, or None while it may: it ended (phase Failed or Succeeded: its
    agent exited), a container of it terminated, or one waits for what never comes (STUCK_REASONS)."""
    if status.get("phase") in ("Failed", "Succeeded"):
        return wire.safe_text(f"the Pod ended ({status['phase']}): {status.get('reason', '')} "
                              f"{status.get('message', '')}")
    for kind in ("initContainerStatuses", "containerStatuses"):
        for container in status.get(kind) or []:
            state = container.get("state") if isinstance(container, dict) else None
            if not isinstance(state, dict):
                continue
            name = container.get("name", "?")
            waiting, terminated = state.get("waiting"), state.get("terminated")
            if isinstance(waiting, dict) and waiting.get("reason") in STUCK_REASONS:
                return wire.safe_text(f"container {name}: {waiting['reason']}: {waiting.get('message', '')}")
            if isinstance(terminated, dict) and (kind == "containerStatuses" or terminated.get("exitCode") != 0):
                return wire.safe_text(f"container {name} exited {terminated.get('exitCode')}: "
                                      f"{terminated.get('reason', '')} {terminated.get('message', '')}")
    return None


def relay_command(agent_command: Sequence[str], session_mount: str) -> tuple[str, ...]:
    """The exec that carries a session's agent channel: the agent's own command line with the `relay` verb."""
    return (*agent_command, "relay", "--session-dir", session_mount)


# ======================================================================================================================
# I/O: credentials and TLS
# ======================================================================================================================


def load_kubeconfig(path: Path, context_name: Optional[str] = None) -> ClusterAccess:
    """A kubeconfig file's access (parse_kubeconfig), with relative file names taken from its directory."""
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise KubeConfigError(f"cannot read kubeconfig {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise KubeConfigError(f"kubeconfig {path} is not YAML: {e}") from e
    return parse_kubeconfig(doc, path.resolve().parent, context_name)


def _read_source(source: Source, what: str) -> bytes:
    if isinstance(source, bytes):
        return source
    try:
        return source.read_bytes()
    except OSError as e:
        raise KubeConfigError(f"cannot read the {what} {source}: {e.strerror}") from e


def tls_context(access: ClusterAccess) -> ssl.SSLContext:
    """TLS verified against the cluster's CA only (never the host's public CAs), with the client certificate when
    the access has one. Certificate data from a kubeconfig is loaded through a memfd: it never touches a disk."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_verify_locations(cadata=_read_source(access.ca, "CA").decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError, ValueError) as e:
        raise KubeConfigError(f"the cluster's CA is not PEM certificates: {e}") from e
    if access.client_certificate is not None and access.client_key is not None:
        pem = _read_source(access.client_certificate, "client certificate") + b"\n" + \
            _read_source(access.client_key, "client key")
        fd = os.memfd_create("reploy-kube-client", os.MFD_CLOEXEC)
        try:
            os.write(fd, pem)
            context.load_cert_chain(f"/proc/self/fd/{fd}")
        except ssl.SSLError as e:
            raise KubeConfigError(f"the client certificate or key cannot be used: {e}") from e
        finally:
            os.close(fd)
    return context


class BearerToken:
    """The Authorization header of an access with a token: the kubeconfig's, or a file read again every
    TOKEN_REREAD_S (a service account's is rotated by the kubelet)."""

    def __init__(self, access: ClusterAccess, clock: Callable[[], float] = time.monotonic) -> None:
        self._access = access
        self._clock = clock
        self._lock = threading.Lock()
        self._value: Optional[str] = access.token
        self._read_at = -TOKEN_REREAD_S

    def headers(self) -> dict[str, str]:
        if self._access.token_file is None:
            return {"Authorization": f"Bearer {self._value}"} if self._value else {}
        with self._lock:
            now = self._clock()
            if now - self._read_at >= TOKEN_REREAD_S:
                token = _read_source(self._access.token_file, "token file").decode("utf-8", "replace").strip()
                if not token or "\n" in token or "\r" in token:
                    raise KubeConfigError(f"the token file {self._access.token_file} does not hold one token")
                self._value, self._read_at = token, now
            return {"Authorization": f"Bearer {self._value}"}


def _connect(access: ClusterAccess, context: ssl.SSLContext, deadline: float) -> ssl.SSLSocket:
    """A verified TLS connection to the apiserver, made within the deadline."""
    host, port = access.host_port
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise KubeTransportError(f"{access.server}: the deadline passed before connecting")
    try:
        raw = socket.create_connection((host, port), timeout=remaining)
    except OSError as e:
        raise KubeTransportError(f"cannot connect to {access.server}: {e}") from e
    try:
        raw.settimeout(max(deadline - time.monotonic(), 0.001))
        return context.wrap_socket(raw, server_hostname=access.tls_server_name or host)
    except (OSError, ssl.SSLError) as e:
        raw.close()
        raise KubeTransportError(f"TLS with {access.server} failed: {e}") from e


class _Deadline:
    """Shuts a socket down when the whole call's deadline passes, whatever it waits for then (a trickling peer's
    every byte would renew a per-read timeout)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._timer = threading.Timer(max(deadline - time.monotonic(), 0.0), self._expire, (sock,))
        self._timer.daemon = True
        self.expired = False

    def _expire(self, sock: socket.socket) -> None:
        self.expired = True
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed: the call ended as the timer fired

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._timer.cancel()


# ======================================================================================================================
# I/O: the REST client
# ======================================================================================================================


class KubeApi:
    """The apiserver's REST API over CA-verified TLS, as the access's user. One connection per request (serve's
    REST calls are rare: a create, a delete, a list of its own Pods; the hot path is the agent channel). Every call
    has one deadline for all of it; an answer is bounded and parsed strictly; a refusal is a KubeApiError subclass
    by its Status's reason."""

    def __init__(self, access: ClusterAccess, deadline_s: float = API_DEADLINE_S) -> None:
        self.access = access
        self.deadline_s = deadline_s
        self.context = tls_context(access)
        self.token = BearerToken(access)

    def headers(self) -> dict[str, str]:
        return self.token.headers() if self.access.token is not None or self.access.token_file is not None else {}

    def connect(self, deadline: float) -> ssl.SSLSocket:
        return _connect(self.access, self.context, deadline)

    def request(self, method: str, path: str, body: Optional[Mapping[str, Any]] = None,
                query: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
        """One request; the answer's JSON object. KubeApiError when refused, KubeTransportError when not answered."""
        deadline = time.monotonic() + self.deadline_s
        target = self.access.base_path + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = wire.encode_compact(dict(body)) if body is not None else None
        host, port = self.access.host_port
        sock = self.connect(deadline)
        connection = http.client.HTTPConnection(host, port)
        connection.sock = sock
        try:
            with _Deadline(sock, deadline) as timer:
                try:
                    headers = {"Accept": "application/json", **self.headers()}
                    if data is not None:
                        headers["Content-Type"] = "application/json"
                    connection.request(method, target, body=data, headers=headers)
                    answer = connection.getresponse()
                    declared = answer.getheader("Content-Length")
                    if declared is not None and (not declared.isdigit() or int(declared) > API_MAX_RESPONSE_BYTES):
                        raise KubeTransportError(f"{method} {path}: an answer of {declared!r} bytes is refused")
                    raw = answer.read(API_MAX_RESPONSE_BYTES + 1)
                except (OSError, http.client.HTTPException) as e:
                    why = "the deadline passed" if timer.expired else str(e)
                    raise KubeTransportError(f"{method} {path}: {why}") from e
                if timer.expired:  # a read cut short by the deadline ends as if the answer ended there
                    raise KubeTransportError(f"{method} {path}: the deadline passed")
        finally:
            connection.close()
        if declared is not None and len(raw) != int(declared):
            raise KubeTransportError(f"{method} {path}: the answer ended after {len(raw)} of {declared} bytes")
        if len(raw) > API_MAX_RESPONSE_BYTES:
            raise KubeTransportError(f"{method} {path}: the answer is longer than {API_MAX_RESPONSE_BYTES} bytes")
        if not 200 <= answer.status < 300:
            raise status_error(answer.status, raw)
        try:
            return json_object(raw, API_MAX_RESPONSE_BYTES)
        except wire.ProtocolError as e:
            raise KubeTransportError(f"{method} {path}: the answer is not one JSON object ({e})") from None

    def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any]:
        return self.request("GET", resource_path(resource, namespace, name))

    def list(self, resource: Resource, namespace: str, labels: Optional[Mapping[str, str]] = None) -> list[Any]:
        query = {"labelSelector": label_selector(labels)} if labels else None
        answer = self.request("GET", resource_path(resource, namespace), query=query)
        items = answer.get("items")
        if not isinstance(items, list):
            raise KubeTransportError(f"the list of {resource.value[1]} has no items")
        return items

    def create(self, resource: Resource, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("POST", resource_path(resource, namespace), body)

    def replace(self, resource: Resource, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """PUT of a whole object at the resourceVersion its metadata carries: compare-and-swap. KubeConflict when
        someone changed it since that version."""
        metadata = body.get("metadata") or {}
        if not metadata.get("resourceVersion"):
            raise ValueError("a replace needs metadata.resourceVersion (it is a compare-and-swap)")
        return self.request("PUT", resource_path(resource, namespace, metadata.get("name")), body)

    def delete(self, resource: Resource, namespace: str, name: str,
               grace_period_s: Optional[int] = None) -> dict[str, Any]:
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background",
                **({"gracePeriodSeconds": grace_period_s} if grace_period_s is not None else {})}
        return self.request("DELETE", resource_path(resource, namespace, name), body)


# ======================================================================================================================
# I/O: the exec stream (one selector thread per WebSocket)
# ======================================================================================================================


class ExecStream:
    """One pods/exec over WebSocket (v4.channel.k8s.io). One thread owns the TLS socket and does all its reads and
    writes (OpenSSL allows no concurrent use of one connection): writers queue frames and wake it; it answers
    pings, joins fragments and hands each channel's bytes to `on_data(channel, bytes)`, then `on_end(ExecEnd or
    None, error or None)` exactly once when the stream ends (the command's end, a close, a broken peer, close()).

    Kubernetes 1.20's WebSocket exec cannot half-close stdin (a v5.channel.k8s.io feature): a command that reads
    stdin to its end never sees it. Commands run here therefore use self-delimited input (agent.py relay reads
    request lines) or none."""

    def __init__(self, api: KubeApi, namespace: str, pod: str, container: str, command: Sequence[str],
                 on_data: Callable[[Channel, bytes], None], on_end: Callable[[Optional[ExecEnd], Optional[str]], None],
                 stdin: bool = True, open_deadline_s: float = CHANNEL_OPEN_DEADLINE_S) -> None:
        self._on_data = on_data
        self._on_end = on_end
        self._decoder = FrameDecoder()
        self._outbound = bytearray()
        self._sending: Optional[bytes] = None  # a chunk OpenSSL asked us to offer again, as it was
        self._lock = threading.Condition()
        self._closing = False
        self._ended = False
        self._finished = False  # the loop's own: the peer closed, or the command's Status came
        self._end: Optional[ExecEnd] = None
        self._wake_r, self._wake_w = socket.socketpair()
        deadline = time.monotonic() + open_deadline_s
        target = (api.access.base_path + resource_path(Resource.PODS, namespace, pod, "exec") + "?" +
                  exec_query(command, container, stdin))
        sock = api.connect(deadline)
        try:
            with _Deadline(sock, deadline) as timer:
                try:
                    leftover = self._handshake(api, sock, target)
                except (OSError, ssl.SSLError) as e:
                    why = "the deadline passed" if timer.expired else str(e)
                    raise KubeTransportError(f"exec in {pod}: {why}") from e
            sock.setblocking(False)
        except BaseException:
            sock.close()
            self._wake_r.close()
            self._wake_w.close()
            raise
        self._sock = sock
        self._thread = threading.Thread(target=self._run, args=(leftover,), name=f"exec-{pod}", daemon=True)
        self._thread.start()

    @staticmethod
    def _handshake(api: KubeApi, sock: ssl.SSLSocket, target: str) -> bytes:
        key = base64.b64encode(os.urandom(16)).decode()
        host, port = api.access.host_port
        sock.sendall(handshake_request(f"{host}:{port}", target, key, api.headers()))
        head = bytearray()
        while (end := head.find(b"\r\n\r\n")) < 0:
            if len(head) > MAX_HANDSHAKE_BYTES:
                raise WebSocketError(f"the handshake answer's head is longer than {MAX_HANDSHAKE_BYTES} bytes")
            chunk = sock.recv(IO_CHUNK_BYTES)
            if not chunk:
                raise KubeTransportError("the apiserver closed the exec before answering its handshake")
            head += chunk
        code, _, headers = parse_response_head(bytes(head[:end]))
        if code != 101:  # the apiserver's Status says why: the body after the head, bounded
            body = bytearray(head[end + 4:])
            length = headers.get("content-length", "")
            wanted = min(int(length), MAX_HANDSHAKE_BYTES) if length.isdigit() else MAX_HANDSHAKE_BYTES
            while len(body) < wanted and (chunk := sock.recv(IO_CHUNK_BYTES)):
                body += chunk
            raise status_error(code, bytes(body[:wanted]))
        check_handshake_response(bytes(head[:end]), key)
        return bytes(head[end + 4:])

    # -- writers (any thread) -------------------------------------------------------------------------------------

    def send(self, channel: Channel, data: bytes, deadline: float) -> None:
        """Queues one message on a channel; waits while MAX_OUTBOUND_BYTES are unsent, until the deadline
        (KubeTransportError then). WebSocketError once the stream ended."""
        frame = encode_frame(Opcode.BINARY, channel_message(channel, data), os.urandom(4))
        self._queue(frame, deadline)

    def _queue(self, frame: bytes, deadline: float) -> None:
        with self._lock:
            while len(self._outbound) > MAX_OUTBOUND_BYTES and not self._ended:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise KubeTransportError("the exec stream takes no more input (its peer reads too slowly)")
                self._lock.wait(remaining)
            if self._ended or self._closing:
                raise WebSocketError("the exec stream has ended")
            self._outbound += frame
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # the loop has ended and closed its end: nothing to wake

    def close(self) -> None:
        """Ends the stream (a close frame, then the socket) and waits for its thread; idempotent."""
        with self._lock:
            if not self._closing and not self._ended:
                self._closing = True
                self._outbound += encode_frame(Opcode.CLOSE, encode_close(CloseCode.NORMAL), os.urandom(4))
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(CLOSE_WAIT_S + 1.0)

    @property
    def ended(self) -> bool:
        return self._ended

    # -- the stream's own thread ----------------------------------------------------------------------------------

    def _run(self, leftover: bytes) -> None:
        error: Optional[str] = None
        selector = selectors.DefaultSelector()
        try:
            selector.register(self._wake_r, selectors.EVENT_READ)
            selector.register(self._sock, selectors.EVENT_READ)
            close_by: Optional[float] = None
            if leftover:
                self._handle(leftover)
            while not self._finished:
                with self._lock:
                    wants_write = bool(self._outbound) or self._sending is not None
                    if self._closing and close_by is None:
                        close_by = time.monotonic() + CLOSE_WAIT_S
                timeout = None if close_by is None else close_by - time.monotonic()
                if timeout is not None and timeout <= 0:
                    break  # we closed, and the peer did not answer our close in time
                selector.modify(self._sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if wants_write else 0))
                for key, _ in selector.select(timeout):
                    if key.fileobj is self._wake_r:
                        self._wake_r.recv(IO_CHUNK_BYTES)
                if wants_write:
                    self._write_some()
                self._read_some()
        except (WebSocketError, OSError, ssl.SSLError) as e:
            error = wire.safe_text(str(e))
        finally:
            selector.close()
            with self._lock:
                self._ended = True
                self._lock.notify_all()
            self._sock.close()
            self._wake_r.close()
            self._wake_w.close()
            self._on_end(self._end, error)

    def _write_some(self) -> None:
        while True:
            with self._lock:
                if self._sending is None:
                    if not self._outbound:
                        return
                    self._sending = bytes(self._outbound[:IO_CHUNK_BYTES])
                    del self._outbound[:IO_CHUNK_BYTES]
                    self._lock.notify_all()
                chunk = self._sending
            try:
                sent = self._sock.send(chunk)
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError):
                return  # offered again, as it was, when the socket can take it
            with self._lock:
                self._sending = chunk[sent:] or None

    def _read_some(self) -> None:
        """Reads what the socket has, and what OpenSSL holds decrypted, until it would block or the stream ends."""
        while not self._finished:
            try:
                data = self._sock.recv(IO_CHUNK_BYTES)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                return
            if not data:
                self._finished = True  # the peer closed the connection without a close frame
                return
            self._handle(data)

    def _handle(self, data: bytes) -> None:
        for message in self._decoder.feed(data):
            if message.opcode is Opcode.PING:
                with self._lock:
                    self._outbound += encode_frame(Opcode.PONG, message.payload, os.urandom(4))
            elif message.opcode is Opcode.CLOSE:
                with self._lock:
                    if not self._closing:  # echo its code, as RFC 6455 asks, then stop
                        self._closing = True
                        self._sending = None
                        self._outbound[:] = encode_frame(Opcode.CLOSE, message.payload[:2], os.urandom(4))
                self._write_some()
                self._finished = True
                return
            elif message.opcode is not Opcode.PONG:
                channel, payload = split_channel(message)
                if channel is Channel.ERROR:
                    self._end = exec_end(payload)
                    self._finished = True  # the command ended; the kubelet closes the stream next
                    return
                if payload:  # an empty message only announces its channel
                    self._on_data(channel, payload)


def exec_run(api: KubeApi, namespace: str, pod: str, container: str, command: Sequence[str],
             stdout: Callable[[bytes], None], stdin: Optional[Iterable[bytes]] = None,
             max_stdout_bytes: int = AGENT_MAX_RESPONSE_BYTES,
             deadline_s: float = CHANNEL_OPEN_DEADLINE_S) -> tuple[Optional[ExecEnd], bytes]:
    """One command run to its end through one exec: its stdout handed to `stdout` piece by piece as it comes (from
    the stream's thread; at most max_stdout_bytes, more ends the exec with WebSocketError), its stderr (at most
    AGENT_MAX_RESPONSE_BYTES) and how it ended. `stdin`: the pieces of its input. 1.20 cannot close an exec's stdin,
    so a command given input must know where its input ends (a byte count, as RECEIVE_PROGRAM), never wait for EOF."""
    deadline = time.monotonic() + deadline_s
    err = bytearray()
    received = [0]
    done = threading.Event()
    result: list[tuple[Optional[ExecEnd], Optional[str]]] = []
    overflow: list[str] = []

    def on_data(channel: Channel, data: bytes) -> None:
        if channel is Channel.STDOUT:
            received[0] += len(data)
            if received[0] > max_stdout_bytes:
                overflow.append(f"more output than {max_stdout_bytes} bytes")
                done.set()
            else:
                stdout(data)
        elif len(err) + len(data) > AGENT_MAX_RESPONSE_BYTES:
            overflow.append(f"more stderr than {AGENT_MAX_RESPONSE_BYTES} bytes")
            done.set()
        else:
            err.extend(data)

    def on_end(end: Optional[ExecEnd], error: Optional[str]) -> None:
        result.append((end, error))
        done.set()

    stream = ExecStream(api, namespace, pod, container, command, on_data, on_end, stdin=stdin is not None,
                        open_deadline_s=deadline_s)
    try:
        for piece in stdin or ():
            for start in range(0, len(piece), STDIN_PIECE_BYTES):
                if done.is_set():
                    break  # it ended (or overflowed) before taking all its input
                stream.send(Channel.STDIN, piece[start:start + STDIN_PIECE_BYTES], deadline)
        if not done.wait(max(deadline - time.monotonic(), 0)):
            raise KubeTransportError(f"exec in {pod}: no end within {deadline_s} s")
    except WebSocketError:
        done.wait(max(deadline - time.monotonic(), 0))  # the stream ended as we sent: its end says why
    finally:
        stream.close()
    if overflow:
        raise WebSocketError(f"exec in {pod}: {overflow[0]}")
    if not result:
        raise KubeTransportError(f"exec in {pod}: no end within {deadline_s} s")
    end, error = result[0]
    if error is not None:
        raise WebSocketError(f"exec in {pod}: {error}")
    return end, bytes(err)


def exec_once(api: KubeApi, namespace: str, pod: str, container: str, command: Sequence[str],
              deadline_s: float = CHANNEL_OPEN_DEADLINE_S,
              max_output_bytes: int = AGENT_MAX_RESPONSE_BYTES) -> tuple[Optional[ExecEnd], bytes, bytes]:
    """One command, no stdin, run to its end: how it ended, its stdout and stderr (each at most max_output_bytes).
    The simple path: one exec (one apiserver round trip and one kubelet stream) per command."""
    out = bytearray()
    end, err = exec_run(api, namespace, pod, container, command, out.extend, max_stdout_bytes=max_output_bytes,
                        deadline_s=deadline_s)
    return end, bytes(out), err


#: Writes exactly SIZE bytes of stdin to a new file (never through a link, never over one there), then exits: an
#: exec's stdin never ends in 1.20, so the count is what ends it. python3 is in every session image.
RECEIVE_PROGRAM = """\
import os, sys
size, path = int(sys.argv[1]), sys.argv[2]
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
while size:
    data = sys.stdin.buffer.read1(min(size, 1 << 20))
    if not data:
        sys.exit("stdin ended early")
    size -= len(data)
    while data:
        data = data[os.write(fd, data):]
os.fsync(fd)
os.close(fd)
"""
#: Writes a file to stdout, never through a link.
SEND_PROGRAM = """\
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
while data := os.read(fd, 1 << 20):
    sys.stdout.buffer.write(data)
"""
_AGENT_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def agent_file_path(session_mount: str, name: str) -> str:
    """A file in the session's agent dir (DIR/agent: root's, 0700, out of the workload's reach), where checkpoint
    archives live. Files are copied only there: the container's root writing into a tree the workload owns could be
    led anywhere by a link it planted."""
    if not _AGENT_FILE_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a file name of the agent's dir")
    return f"{session_mount}/agent/{name}"


def copy_in(api: KubeApi, namespace: str, pod: str, session_mount: str, name: str, pieces: Iterable[bytes],
            size: int, deadline_s: float) -> None:
    """`size` bytes from pieces into a new file of the session's agent dir (a checkpoint to restore from), through
    one exec of RECEIVE_PROGRAM as the container's root. KubeError when it did not end with the file whole."""
    command = ("python3", "-I", "-S", "-c", RECEIVE_PROGRAM, str(size), agent_file_path(session_mount, name))
    end, err = exec_run(api, namespace, pod, AGENT_CONTAINER, command, lambda _: None, stdin=pieces,
                        max_stdout_bytes=0, deadline_s=deadline_s)
    if end is None or end.exit_code != 0:
        raise KubeError(f"copy into {pod}: {end.message if end else 'no end'}: "
                        f"{wire.safe_text(err.decode('utf-8', 'replace'))}")


def copy_out(api: KubeApi, namespace: str, pod: str, session_mount: str, name: str, sink: Callable[[bytes], None],
             max_bytes: int, deadline_s: float) -> None:
    """A file of the session's agent dir (a checkpoint archive) to sink, piece by piece, at most max_bytes."""
    command = ("python3", "-I", "-S", "-c", SEND_PROGRAM, agent_file_path(session_mount, name))
    end, err = exec_run(api, namespace, pod, AGENT_CONTAINER, command, sink, max_stdout_bytes=max_bytes,
                        deadline_s=deadline_s)
    if end is None or end.exit_code != 0:
        raise KubeError(f"copy out of {pod}: {end.message if end else 'no end'}: "
                        f"{wire.safe_text(err.decode('utf-8', 'replace'))}")


# ======================================================================================================================
# I/O: the agent channel (many agent requests over one exec)
# ======================================================================================================================


@dataclass
class _Pending:
    """A call waiting for its answer."""

    done: threading.Event = field(default_factory=threading.Event)
    document: Optional[dict[str, Any]] = None
    error: Optional[AgentChannelError] = None


class AgentChannel:
    """A session's agent, reached through one long-lived exec of `agent.py relay` (relay_command): each call is one
    request line with an id of its own on the relay's stdin, answered by one line with that id on its stdout, in
    whatever order the agent finishes them (a long-poll read does not hold a status). Thread-safe: any number of
    callers share the stream.

    The stream is opened at the first call and again at the first call after it dropped; calls in flight when it
    drops fail retryable (they may or may not have reached the agent). Every line from the relay is hostile input:
    bounded (AGENT_MAX_RESPONSE_BYTES), one strict JSON object, its id one we sent and still wait for; a line that
    is not one breaks the stream (its calls fail, not retryable: a relay that sends garbage is not trusted to be
    right next time either, but the next call opens a fresh one). An answer for a call that gave up is dropped."""

    def __init__(self, api: KubeApi, namespace: str, pod: str, command: Sequence[str],
                 container: str = AGENT_CONTAINER, open_deadline_s: float = CHANNEL_OPEN_DEADLINE_S) -> None:
        self._api = api
        self._namespace = namespace
        self._pod = pod
        self._command = tuple(command)
        self._container = container
        self._open_deadline_s = open_deadline_s
        self._lock = threading.Lock()
        self._open_lock = threading.Lock()  # one opening at a time; callers behind it then share the stream
        self._stream: Optional[ExecStream] = None
        self._generation = 0
        self._pending: dict[str, tuple[int, _Pending]] = {}
        self._ids = itertools.count(1)
        self._stderr_tail = bytearray()
        self._splitter = LineSplitter(AGENT_MAX_RESPONSE_BYTES)
        self._closed = False
        #: streams opened so far (the first and every re-open), for tests and the bench
        self.opened = 0

    def call(self, method: str, params: Mapping[str, Any], timeout_s: float = AGENT_CALL_TIMEOUT_S) -> dict[str, Any]:
        """One agent request: its answer document ({id, result} or {id, error}, parsed strictly, id matched; the
        caller checks the rest as it does any agent answer). AgentChannelError when there is none."""
        deadline = time.monotonic() + timeout_s
        request_id = f"k{next(self._ids)}"
        line = wire.encode_compact({"id": request_id, "method": method, "params": dict(params)}) + b"\n"
        if len(line) > AGENT_MAX_REQUEST_BYTES + 1:
            raise AgentChannelError(f"the {method} request is longer than {AGENT_MAX_REQUEST_BYTES} bytes", False)
        stream, generation = self._ensure_open(deadline)
        pending = _Pending()
        with self._lock:
            self._pending[request_id] = (generation, pending)
        try:
            try:
                stream.send(Channel.STDIN, line, deadline)
            except (WebSocketError, KubeTransportError) as e:
                raise AgentChannelError(f"the agent channel of {self._pod} dropped: {e}", True) from e
            if not pending.done.wait(max(deadline - time.monotonic(), 0)):
                raise AgentChannelError(f"{method}: no answer from the agent of {self._pod} within {timeout_s} s",
                                        False)
            if pending.document is None:
                raise pending.error or AgentChannelError(f"{method}: no answer from the agent of {self._pod}", True)
            return pending.document
        finally:
            with self._lock:
                self._pending.pop(request_id, None)

    def close(self) -> None:
        """Ends the stream (the relay sees its stdin close and exits); calls in flight fail. Idempotent."""
        with self._lock:
            self._closed = True
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    @property
    def in_flight(self) -> int:
        """Calls waiting for their answers now."""
        with self._lock:
            return len(self._pending)

    @property
    def connected(self) -> bool:
        """Whether a stream is open now (the next call opens one when not)."""
        with self._lock:
            return self._stream is not None and not self._stream.ended

    @property
    def stderr_tail(self) -> str:
        """The relay's last words on stderr, as safe text (for a diagnostic)."""
        with self._lock:
            return wire.safe_text(bytes(self._stderr_tail).decode("utf-8", "replace"))

    def _ensure_open(self, deadline: float) -> tuple[ExecStream, int]:
        with self._open_lock:
            with self._lock:
                if self._closed:
                    raise AgentChannelError("the agent channel is closed", False)
                if self._stream is not None and not self._stream.ended:
                    return self._stream, self._generation
                self._generation += 1
                generation = self._generation
                self._splitter = LineSplitter(AGENT_MAX_RESPONSE_BYTES)
            try:
                stream = ExecStream(
                    self._api, self._namespace, self._pod, self._container, self._command,
                    on_data=lambda channel, data: self._on_data(generation, channel, data),
                    on_end=lambda end, error: self._on_end(generation, end, error),
                    open_deadline_s=min(self._open_deadline_s, max(deadline - time.monotonic(), 0.001)))
            except (KubeError, OSError) as e:
                raise AgentChannelError(f"cannot open the agent channel of {self._pod}: {e}", True) from e
            with self._lock:
                self._stream = stream
                self.opened += 1
            return stream, generation

    def _on_data(self, generation: int, channel: Channel, data: bytes) -> None:
        if channel is Channel.STDERR:
            with self._lock:
                self._stderr_tail += data
                del self._stderr_tail[:-STDERR_TAIL_BYTES]
            return
        if channel is not Channel.STDOUT:
            return
        try:
            lines = self._splitter.feed(data)
            answers = []
            for line in lines:
                document = wire.parse_strict_object(line, max_bytes=AGENT_MAX_RESPONSE_BYTES, writable=False)
                request_id = document.get("id")
                if not isinstance(request_id, str):
                    raise WebSocketError("an answer line without a string id")
                answers.append((request_id, document))
        except (WebSocketError, wire.ProtocolError) as e:
            self._fail(generation, AgentChannelError(f"the relay of {self._pod} sent a line that is not an "
                                                     f"answer: {wire.safe_text(str(e))}", False), drop_stream=True)
            return
        with self._lock:
            for request_id, document in answers:
                entry = self._pending.get(request_id)
                if entry is not None and entry[0] == generation and not entry[1].done.is_set():
                    entry[1].document = document
                    entry[1].done.set()

    def _on_end(self, generation: int, end: Optional[ExecEnd], error: Optional[str]) -> None:
        why = error or (f"the relay ended (exit {end.exit_code})" if end is not None and end.exit_code is not None
                        else f"the relay ended ({end.message})" if end is not None else "the stream closed")
        self._fail(generation, AgentChannelError(f"the agent channel of {self._pod} dropped: {why}", True),
                   drop_stream=False)

    def _fail(self, generation: int, error: AgentChannelError, drop_stream: bool) -> None:
        """Every call of that stream fails with `error`; the stream is forgotten (and closed when it broke the
        protocol), so the next call opens a new one."""
        with self._lock:
            for entry_generation, pending in self._pending.values():
                if entry_generation == generation and not pending.done.is_set():
                    pending.error = error
                    pending.done.set()
            stream = self._stream if self._generation == generation else None
            if stream is not None:
                self._stream = None
        if stream is not None and drop_stream:
            threading.Thread(target=stream.close, daemon=True).start()  # not from its own thread's callback
