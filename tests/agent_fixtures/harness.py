"""Runs real `agent.py serve` processes for tests and cleans up everything they started.

Run as root (as on the project's machines), the agents run as root with `--runtime-user RUNTIME_USER`, as in a
managed session's container: the workload, exec and file work run as that user. Their interpreter is then the
system's python3 (PYTHON), which that user can run; the session dirs' parents are searchable by it.

Synchronisation is by real conditions with deadlines: the socket answering, `status` fields, long-poll `read`.
"""

from __future__ import annotations

import atexit
import base64
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import agent  # noqa: E402  (the module under test lives at the repository root)

AGENT_PY = ROOT / "agent.py"
AS_ROOT = os.geteuid() == 0
#: Who the workload runs as when the tests run as root: nobody:nogroup, whom nothing on the machine belongs to.
RUNTIME_UID = RUNTIME_GID = 65534
RUNTIME_USER = f"{RUNTIME_UID}:{RUNTIME_GID}"
#: The uid the workload's processes and files have.
WORKLOAD_UID = RUNTIME_UID if AS_ROOT else os.getuid()
#: The interpreter of the agents (and of the fake CLI they run): one the runtime user can run too, which an
#: interpreter under root's home is not.
PYTHON = (shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "python3") if AS_ROOT else sys.executable


def _reachable_fixtures() -> Path:
    """Where the runtime user reads this folder's scripts: a checkout may lie below a directory only root enters (a
    fresh clone in a mktemp dir), so as root they are copied into a directory of this test process's own (0755,
    removed at exit)."""
    here = Path(__file__).parent
    if not AS_ROOT:
        return here
    directory = Path(tempfile.mkdtemp(prefix="reploy-fixtures-"))
    directory.chmod(0o755)
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    for script in here.glob("*.py"):
        shutil.copyfile(script, directory / script.name)
        (directory / script.name).chmod(0o644)
    return directory


#: This folder, or the copy of its scripts the runtime user can read (see _reachable_fixtures).
REACHABLE_FIXTURES = _reachable_fixtures()
FAKE_CLAUDE = REACHABLE_FIXTURES / "fake_claude.py"
FAKE_AGENT_ARGV = json.dumps([PYTHON, str(FAKE_CLAUDE), "{continue}", "{model}", "--", "{prompt}"])
DEADLINE_S = 15.0


def wait_until(condition: Callable[[], Any], what: str, timeout_s: float = DEADLINE_S,
               poll_s: float = 0.02) -> Any:
    """Polls a real condition every poll_s until it holds; fails the test with `what` when the
    deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)


def zygote_pids(process: "AgentProcess") -> list[int]:
    """The agent's live file-worker zygotes (at most one), by their command line; one that has
    exited (a zombie until the agent reaps it, or gone) is not."""
    pids = []
    for child in psutil.Process(process.proc.pid).children():
        try:
            if "zygote" in child.cmdline():
                pids.append(child.pid)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return pids


def pid_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class AgentProcess:
    """One `agent.py serve` child, with helpers for calling its socket and reading its log."""

    def __init__(self, session_dir: Path, args: list[str], env: Optional[dict[str, str]] = None,
                 preexec_fn: Optional[Callable[[], None]] = None) -> None:
        self.session_dir = session_dir
        self.args = args
        self.stderr_path = session_dir.parent / f"{session_dir.name}.stderr"
        identity = ["--runtime-user", RUNTIME_USER] if AS_ROOT and "--runtime-user" not in args else []
        with open(self.stderr_path, "ab") as stderr:
            self.proc = subprocess.Popen(
                [PYTHON, str(AGENT_PY), "serve", "--session-dir", str(session_dir), *identity, *args],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                env={**os.environ, **(env or {})}, start_new_session=True, preexec_fn=preexec_fn)
        self._descendants: list[psutil.Process] = []

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_ready(self) -> "AgentProcess":
        def answers() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited with {self.proc.returncode}: {self.stderr}")
            return "result" in self.call("status")
        wait_until(answers, "the agent to answer status")
        return self

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        return agent.call(self.session_dir, method, params)

    def result(self, method: str, **params: Any) -> dict[str, Any]:
        response = self.call(method, **params)
        assert "result" in response, response
        assert response["result"]["type"] == method
        return response["result"]

    def error(self, method: str, **params: Any) -> dict[str, Any]:
        response = self.call(method, **params)
        assert "error" in response, response
        return response["error"]

    def status(self) -> dict[str, Any]:
        return self.result("status")

    def read_bytes(self, offset: int = 0) -> bytes:
        """Everything in the log from offset, as raw bytes."""
        out = bytearray()
        while True:
            piece = self.result("read", offset=offset + len(out), max_bytes=agent.MAX_READ_BYTES)
            data = piece_bytes(piece)
            if not data:
                return bytes(out)
            out += data

    def read_until(self, needle: bytes, timeout_s: float = DEADLINE_S) -> bytes:
        """Long-polls the log from 0 until it contains needle; returns everything read."""
        deadline = time.monotonic() + timeout_s
        out = bytearray()
        while needle not in out:
            if time.monotonic() > deadline:
                raise AssertionError(f"{needle!r} never appeared; log so far: {bytes(out)!r}")
            piece = self.result("read", offset=len(out), max_bytes=agent.MAX_READ_BYTES, wait_ms=1000)
            out += piece_bytes(piece)
        return bytes(out)

    @property
    def agent_dir(self) -> Path:
        return self.session_dir / agent.AGENT_DIR_NAME

    @property
    def workspace(self) -> Path:
        return self.session_dir / "workspace"

    def events(self) -> list[dict[str, Any]]:
        path = self.agent_dir / agent.OUTBOX_NAME
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_status(self, predicate: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        return wait_until(lambda: (lambda s: s if predicate(s) else None)(self.status()), what)

    def _remember_descendants(self) -> None:
        try:
            self._descendants += psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass

    def stop(self, timeout_s: float = DEADLINE_S) -> int:
        """SIGTERM and wait: the agent's own clean shutdown. Returns its exit code."""
        self._remember_descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def crash(self) -> None:
        """SIGKILL the agent and everything it started, as a container's death would."""
        self._remember_descendants()
        self.proc.kill()
        self.proc.wait()
        self._kill_descendants()

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            try:
                self.stop()
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._kill_descendants()

    def _kill_descendants(self) -> None:
        for process in self._descendants:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass


#: The dispositions agent.py must give back to default in every process it spawns.
SPAWN_RESET_SIGNALS = (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGPIPE, signal.SIGHUP)
#: Blocked in the hostile start below: a spawned process must begin with an empty mask.
BLOCKED_AT_START = (signal.SIGUSR1, signal.SIGALRM)


def hostile_start() -> None:
    """Runs in the agent's process before exec: what `agent.py serve ... &` from a non-interactive script gets (SIGINT
    and SIGQUIT ignored), and more: every signal agent.py must reset ignored, and some blocked."""
    for signum in SPAWN_RESET_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED_AT_START)


def signal_dispositions(pid: int) -> tuple[set[int], set[int]]:
    """(ignored, blocked) signal numbers of a live process, from /proc/PID/status."""
    fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if ":\t" in line)

    def numbers(mask_hex: str) -> set[int]:
        mask = int(mask_hex, 16)
        return {n for n in range(1, 65) if mask >> (n - 1) & 1}

    return numbers(fields["SigIgn"]), numbers(fields["SigBlk"])


def piece_bytes(piece: dict[str, Any]) -> bytes:
    """The bytes of a read result, whichever workload answered."""
    if "text" in piece:
        return piece["text"].encode()
    return base64.b64decode(piece["data_b64"])


def hand_over(*paths: Path) -> None:
    """Gives what a test made in a session's workspace or home (as root) to the runtime user, as if the workload had
    made it: the file work that reads or changes it runs as that user."""
    if not AS_ROOT:
        return
    for path in paths:
        os.lchown(path, RUNTIME_UID, RUNTIME_GID)
        if path.is_dir() and not path.is_symlink():
            for inner in path.rglob("*"):
                os.lchown(inner, RUNTIME_UID, RUNTIME_GID)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short temp dir: unix socket paths must stay under 108 bytes, and tmp_path can be longer. Searchable by all
    (0755), so the runtime user reaches the workspaces below it."""
    path = Path(tempfile.mkdtemp(prefix="ra-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_agent(short_dir: Path) -> Iterator[Callable[..., AgentProcess]]:
    """start_agent(*args, name="s", env=None, ready=True, preexec_fn=None) -> a running agent; all are cleaned up at
    teardown. preexec_fn runs in the agent's process before exec (e.g. to start it with signals ignored)."""
    started: list[AgentProcess] = []

    def start(*args: str, name: str = "s", env: Optional[dict[str, str]] = None, ready: bool = True,
              preexec_fn: Optional[Callable[[], None]] = None) -> AgentProcess:
        process = AgentProcess(short_dir / name, list(args), env, preexec_fn)
        started.append(process)
        return process.wait_ready() if ready else process

    yield start
    for process in started:
        process.cleanup()


def raw_exchange(session_dir: Path, payload: bytes, shutdown_write: bool = False,
                 timeout_s: float = DEADLINE_S) -> bytes:
    """Sends raw bytes to the control socket and returns everything received until the server closes."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    sock.connect(str(session_dir / agent.AGENT_DIR_NAME / agent.SOCKET_NAME))
    return exchange_on(sock, payload, shutdown_write)


def exchange_on(sock: socket.socket, payload: bytes, shutdown_write: bool = False) -> bytes:
    """Send on a connected socket (unix or TCP), then read until the agent closes; closes it."""
    with sock:
        sock.sendall(payload)
        if shutdown_write:
            sock.shutdown(socket.SHUT_WR)
        received = bytearray()
        while chunk := sock.recv(65536):
            received += chunk
        return bytes(received)


# ---------------------------------------------------------------------------------------------------------------------
# The harness verbs (exec, files) the way a client drives them: start, then long-poll; chunked transfers


def exec_start(process: AgentProcess, argv: list[str], **params: Any) -> str:
    return process.result("exec", argv=argv, **params)["exec_id"]


def exec_finish(process: AgentProcess, exec_id: str, timeout_s: float = DEADLINE_S) -> dict[str, Any]:
    """Long-polls an exec until its result is final and both streams are read; the last answer, with the
    whole of each stream as `stdout` and `stderr` bytes."""
    deadline = time.monotonic() + timeout_s
    out = {"stdout": bytearray(), "stderr": bytearray()}
    while True:
        assert time.monotonic() < deadline, f"exec {exec_id} did not finish"
        page = process.result("exec_wait", exec_id=exec_id, wait_ms=2000, release=True,
                              stdout_offset=len(out["stdout"]), stderr_offset=len(out["stderr"]))
        for name in out:
            out[name] += base64.b64decode(page[f"{name}_b64"])
        if not page["running"] and all(len(out[name]) == page[f"{name}_bytes"] for name in out):
            return {**page, "stdout": bytes(out["stdout"]), "stderr": bytes(out["stderr"])}


def run_exec(process: AgentProcess, argv: list[str], **params: Any) -> dict[str, Any]:
    return exec_finish(process, exec_start(process, argv, **params))


def open_upload(process: AgentProcess, path: str, **params: Any) -> tuple[dict[str, Any], Optional[int]]:
    """The `upload` response and the staging descriptor it carried (None with an error: it carries none)."""
    response, fds = agent.call_with_fds(process.session_dir, "upload", {"path": path, **params})
    assert len(fds) == ("result" in response), (response, fds)
    return response, fds[0] if fds else None


def upload_bytes(process: AgentProcess, path: str, data: bytes, kind: str = "file", **params: Any) -> dict[str, Any]:
    """One whole upload: the bytes written into the staging descriptor the answer carried, then committed; the
    response of the first call that failed, or the commit's result."""
    import hashlib

    opened, staging = open_upload(process, path, kind=kind, size=len(data), **params)
    if staging is None:
        return opened
    try:
        os.pwrite(staging, data, 0)
    finally:
        os.close(staging)
    while True:
        committed = process.call("upload_commit", transfer_id=opened["result"]["transfer_id"],
                                 sha256=hashlib.sha256(data).hexdigest())
        if "error" in committed or committed["result"]["done"]:
            return committed


def download_bytes(process: AgentProcess, path: str, **params: Any) -> tuple[dict[str, Any], bytes]:
    """A whole download: what `download` answered, and every byte, read from the descriptor it carried."""
    response, fds = agent.call_with_fds(process.session_dir, "download", {"path": path, **params})
    assert "result" in response and len(fds) == 1, response
    opened = response["result"]
    with os.fdopen(fds[0], "rb") as source:
        data = source.read()
    if opened["kind"] == "tar":
        process.result("transfer_close", transfer_id=opened["transfer_id"])
    return opened, data


def read_window(process: AgentProcess, **params: Any) -> tuple[dict[str, Any], bytes]:
    """One `read_fd`: what it answered, and its window's bytes, preads from the descriptor it carried (which must
    be open for reading only)."""
    response, fds = agent.call_with_fds(process.session_dir, "read_fd", params)
    assert "result" in response and len(fds) == 1, response
    window = response["result"]
    try:
        assert fcntl.fcntl(fds[0], fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        size = 0 if window["reset"] else window["next_offset"] - window["offset"]
        return window, os.pread(fds[0], size, window["offset"])
    finally:
        os.close(fds[0])


def tree_snapshot(root: Path) -> dict[str, tuple[str, bytes]]:
    """Every entry below root: relative name -> (kind, content or link target)."""
    found = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_symlink():
            found[name] = ("symlink", os.readlink(path).encode())
        elif path.is_dir():
            found[name] = ("dir", b"")
        else:
            found[name] = ("file", path.read_bytes())
    return found
