"""serve's client of the agent's control socket (reploy_serve.py: agent_call and the one parser
per answer family) against the real agent and against peers that are not one: a symlink in the
socket's place, answers that are not a response, a peer that trickles bytes, and every field of
every real answer made hostile. Real unix sockets and real agent.py processes, no Docker.

The hostile values are chosen from docs/agent.md's rules, not from the parsers: each one is out
of its field's documented type or range whatever the field is (a string holding CR LF and a
header, an object, an array, integers past 2**63 either way), and every entry name that is not
one path component is refused.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import reploy_serve
from agent_fixtures.harness import AgentProcess, DEADLINE_S, FAKE_AGENT_ARGV, agent
from agent_fixtures.harness import short_dir, start_agent  # noqa: F401  (fixtures)
from test_container_paths import CanarySocket, box, canary_socket  # noqa: F401,F811  (fixtures)


def test_agent_call_through_a_symlinked_control_socket_fails_and_never_connects(
        box: Path, canary_socket: CanarySocket) -> None:
    (box / "control.sock").symlink_to(canary_socket.path)
    with pytest.raises(reploy_serve.AgentCallError, match="control.sock is a symlink, not a socket") as raised:
        reploy_serve.agent_call(box, "status", {})
    assert raised.value.transport
    assert canary_socket.connections() == 0


# -- a launch's wait for its agent: the agent's directory changing wakes it -------------------

def test_a_directory_watch_wakes_its_waiter_until_the_agent_has_bound_its_socket(
        short_dir: Path, start_agent: Callable[..., AgentProcess]) -> None:
    agent_dir = short_dir / "s" / agent.AGENT_DIR_NAME
    agent_dir.mkdir(mode=0o700, parents=True)  # as serve lays out a new session's disk
    with reploy_serve.DirectoryWatch(agent_dir) as watch:
        assert watch.fd is not None
        assert not watch.wait(0)  # nothing changed yet
        start_agent("--workload", "shell", ready=False)
        while True:
            try:
                status = reploy_serve.agent_call(agent_dir, "status", {})
                break
            except reploy_serve.AgentCallError as e:
                assert e.transport, e
            # No socket yet, or one bound and not yet listening: the log and the outbox follow.
            assert watch.wait(DEADLINE_S), "the agent's start changed nothing more in its directory"
        assert status["workload"] == "shell"
    assert watch.fd is None
    watch.close()  # again: nothing happens


def test_where_no_watch_is_given_a_wait_reports_no_change(short_dir: Path) -> None:
    with reploy_serve.DirectoryWatch(short_dir / "missing") as watch:
        assert watch.fd is None
        assert not watch.wait(DEADLINE_S)  # only the poll's pause, then the caller looks itself


# -- the real agent's answers: every family parses, and only its documented fields pass -------

#: docs/agent.md's result fields per verb (besides `type`), as serve keeps them (base64 fields
#: decoded, under their names without _b64; `entry` parsed).
DOCUMENTED = {
    "status": {"workload", "turn_state", "busy", "quiet_ms", "pid", "queue_depth", "queue_bytes",
               "log_bytes", "log_capped", "admission_open", "awaiting_restore", "running",
               "exit_code", "columns", "rows", "continue"},
    "read": {"offset", "next_offset", "length", "reset", "data", "text"},
    "read_fd": {"offset", "next_offset", "length", "reset", "kind"},
    "write": {"bytes"}, "interrupt": {"cancelled"}, "relaunch": {"pid"}, "resize": {"columns", "rows"},
    "message": {"delivery", "queue_depth", "draft", "draft_bytes"},
    "checkpoint": {"id", "path", "bytes", "log_bytes", "skipped_entries"}, "suspend": {"seq"},
    "exec": {"exec_id", "pid", "queued", "stdout_path", "stderr_path"},
    "exec_wait": {"exec_id", "running", "queued", "pid", "exit_code", "signal", "timed_out", "killed", "duration_ms",
                  "stdout", "stdout_next_offset", "stdout_bytes", "stdout_truncated", "stderr",
                  "stderr_next_offset", "stderr_bytes", "stderr_truncated"},
    "exec_kill": {"exec_id", "killed"},
    "stat": {"root", "path", "entry"}, "list": {"root", "path", "entry", "entries", "total", "next_offset"},
    "upload": {"transfer_id"},
    "upload_commit": {"transfer_id", "done", "root", "path", "kind", "bytes", "entries", "sha256"},
    "download": {"transfer_id", "kind", "size", "entry"},
    "transfer_close": {"transfer_id", "closed"},
}


class Exchange:
    """One request to a real agent and its response line, as the agent sent it, and the file
    descriptor it carried (`fd`, the test's to close), if any."""

    def __init__(self, process: AgentProcess, method: str, **params: Any) -> None:
        self.method, self.params = method, params
        fds: list[int] = []
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(15)
            sock.connect(str(process.agent_dir / "control.sock"))
            sock.sendall(json.dumps({"id": "serve", "method": method, "params": params}).encode() + b"\n")
            line = b""
            while not line.endswith(b"\n"):
                chunk, ancillary, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(4 * 4))
                fds += agent.received_fds(ancillary)
                assert chunk, f"{method}: no answer"
                line += chunk
        assert len(fds) == (method in reploy_serve.ANSWER_DESCRIPTORS), (method, fds)
        self.fd = fds[0] if fds else None
        self.line = line
        self.response = json.loads(line)
        assert "result" in self.response, (method, params, self.response)

    @property
    def result(self) -> dict[str, Any]:
        return self.response["result"]

    def parse(self, result: Any = None) -> dict[str, Any]:
        document = self.response if result is None else {"id": "serve", "result": result}
        return reploy_serve.parse_agent_response(self.method, self.params,
                                                 json.dumps(document).encode() + b"\n")


def exchanges_until(process: AgentProcess, method: str, finished: Callable[[dict[str, Any]], bool],
                    **params: Any) -> list[Exchange]:
    """A verb asked again (exec_wait, upload_commit) until its result is `finished`."""
    seen = [Exchange(process, method, **params)]
    while not finished(seen[-1].result):
        seen.append(Exchange(process, method, **params))
    return seen


@pytest.fixture(scope="module")
def real_exchanges() -> Iterator[list[Exchange]]:
    """Every answer family, from a real shell agent and a real agent-workload agent."""
    base = Path(tempfile.mkdtemp(prefix="ra-"))
    base.chmod(0o755)  # the runtime user reaches the workspaces below it (harness.short_dir)
    shell = AgentProcess(base / "s", ["--workload", "shell"]).wait_ready()
    coder = AgentProcess(base / "a", ["--workload", "agent", "--agent-command", FAKE_AGENT_ARGV]).wait_ready()
    try:
        seen = [Exchange(shell, "status"), Exchange(coder, "status"),
                Exchange(shell, "write", data_b64=base64.b64encode(b"echo made-$((6*7))\r").decode())]
        shell.read_until(b"made-42")
        seen += [Exchange(shell, "read", offset=0, max_bytes=65536),
                 Exchange(shell, "read", offset=10**9),
                 Exchange(shell, "message", text="echo second"),
                 Exchange(shell, "resize", columns=100, rows=30),
                 Exchange(shell, "interrupt")]
        drafted = Exchange(shell, "message", text="echo dr", more=True)
        seen += [drafted, Exchange(shell, "message", text="afted", draft=drafted.result["draft"])]
        coder.result("message", text="say hello from the fake CLI")
        coder.read_until(b"hello from the fake CLI")
        seen += [Exchange(coder, "read", offset=0), Exchange(coder, "relaunch")]
        windows = [Exchange(shell, "read_fd", offset=0), Exchange(shell, "read_fd", offset=2, max_bytes=5),
                   Exchange(shell, "read_fd", offset=10**9), Exchange(coder, "read_fd", offset=0)]
        for window in windows:
            assert window.fd is not None
            os.close(window.fd)
        seen += windows
        started = Exchange(shell, "exec", argv=["sh", "-c", "mkdir -p d/e && echo out; echo err >&2"])
        seen += [started, *exchanges_until(shell, "exec_wait", lambda r: not r["running"],
                                           exec_id=started.result["exec_id"], wait_ms=2000)]
        sleeper = Exchange(shell, "exec", argv=["sleep", "30"])
        seen += [sleeper, Exchange(shell, "exec_kill", exec_id=sleeper.result["exec_id"])]
        data = b"uploaded bytes\n"
        opened = Exchange(shell, "upload", path="d/f.txt", kind="file", size=len(data))
        transfer = opened.result["transfer_id"]
        assert opened.fd is not None
        os.pwrite(opened.fd, data, 0)
        os.close(opened.fd)
        seen += [opened, *exchanges_until(shell, "upload_commit", lambda r: r["done"], transfer_id=transfer,
                                  sha256=hashlib.sha256(data).hexdigest())]
        seen += [Exchange(shell, "stat"), Exchange(shell, "stat", path="d/f.txt"),
                 Exchange(shell, "list"), Exchange(shell, "list", path="d", root="workspace")]
        for path in ("d/f.txt", "d"):
            download = Exchange(shell, "download", path=path)
            assert download.fd is not None
            with os.fdopen(download.fd, "rb") as source:
                assert source.read()
            seen.append(download)
        seen.append(Exchange(shell, "transfer_close", transfer_id=download.result["transfer_id"]))
        seen += [Exchange(shell, "suspend", reason="max_busy"), Exchange(shell, "checkpoint", id="v1")]
        yield seen
    finally:
        shell.cleanup()
        coder.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def test_every_answer_family_of_the_real_agent_parses(real_exchanges: list[Exchange]) -> None:
    assert {exchange.method for exchange in real_exchanges} == set(DOCUMENTED)
    for exchange in real_exchanges:
        parsed = exchange.parse()
        assert set(parsed) <= DOCUMENTED[exchange.method], (exchange.method, set(parsed))


def test_only_what_was_checked_is_passed_on(real_exchanges: list[Exchange]) -> None:
    for exchange in real_exchanges:
        extra = {**exchange.result, "injected": "<script>", "Content-Type": "text/html"}
        assert not {"injected", "Content-Type"} & set(exchange.parse(extra)), exchange.method


#: Out of range for every documented field, whatever its kind (a lone surrogate escape is
#: valid JSON that UTF-8 cannot hold).
HOSTILE_VALUES = ("5\r\nContent-Type: text/html\r\n\r\n<script>document.title='pwned'</script>" * 3,
                  "\udc80", {"nested": 1}, [1], 2**64, -2**64, 1e300)
#: Names that are not one path component, and so never a listed entry's.
HOSTILE_NAMES = ("..", ".", "", "../../0123456789abcdef/files/drop", "a/b", "a\x00b", "a\nb", "a\rb",
                 "\x1b]8;;http://x\x1b\\", "a\x7fb", "a\x85b", "x" * 256)


def mutations(document: dict[str, Any], where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(what, a copy of the result with one field, or one field of a nested entry, hostile)."""
    for name, value in document.items():
        if name == "type":
            continue
        for hostile in HOSTILE_VALUES:
            yield f"{where}{name}={str(hostile)[:20]!r}", {**document, name: hostile}
        if isinstance(value, dict):  # an entry
            for nested_what, nested in mutations(value, f"{where}{name}."):
                yield nested_what, {**document, name: nested}
        if isinstance(value, list) and value and isinstance(value[0], dict):  # entries
            for nested_what, nested in mutations(value[0], f"{where}{name}[0]."):
                yield nested_what, {**document, name: [nested, *value[1:]]}


def test_every_field_of_every_family_refuses_hostile_values(real_exchanges: list[Exchange]) -> None:
    checked = 0
    for exchange in real_exchanges:
        for what, hostile in mutations(exchange.result):
            with pytest.raises(reploy_serve.AnswerInvalid):
                exchange.parse(hostile)
                raise AssertionError(f"{exchange.method}: {what} was accepted")
            checked += 1
    assert checked > 500


def test_entry_names_are_one_path_component(real_exchanges: list[Exchange]) -> None:
    listing = next(e for e in real_exchanges if e.method == "list" and e.result["entries"])
    for name in HOSTILE_NAMES:
        entry = {**listing.result["entries"][0], "name": name}
        with pytest.raises(reploy_serve.AnswerInvalid, match="name"):
            listing.parse({**listing.result, "entries": [entry]})
    twice = listing.result["entries"][:1] * 2
    with pytest.raises(reploy_serve.AnswerInvalid, match="twice"):
        listing.parse({**listing.result, "entries": twice})
    # The entry a path names bears that path's name, the root's is ".".
    for exchange in (e for e in real_exchanges if e.method in ("stat", "download")):
        with pytest.raises(reploy_serve.AnswerInvalid, match="name"):
            exchange.parse({**exchange.result, "entry": {**exchange.result["entry"], "name": "other"}})


def test_what_the_request_fixes_must_be_answered(real_exchanges: list[Exchange]) -> None:
    """Offsets, ids, sizes and digests the request named, and the agreements within one
    answer (docs/agent.md): each broken alone is refused."""
    by_method: dict[str, list[Exchange]] = {}
    for exchange in real_exchanges:
        by_method.setdefault(exchange.method, []).append(exchange)
    read = next(e for e in by_method["read"] if not e.result["reset"] and "data_b64" in e.result)
    piece = base64.b64decode(read.result["data_b64"])
    window = next(e for e in by_method["read_fd"] if e.params.get("max_bytes") == 5)
    done = next(e for e in by_method["upload_commit"] if e.result["done"])
    final = next(e for e in by_method["exec_wait"] if not e.result["running"])
    broken = [
        (read, {"offset": read.result["offset"] + 1}),
        (read, {"next_offset": read.result["next_offset"] + 1}),
        (read, {"length": read.result["next_offset"] - 1}),
        (read, {"data_b64": base64.b64encode(piece + b"x").decode()}),
        (read, {"text": "both"}),
        (read, {"reset": True}),
        (window, {"offset": window.result["offset"] + 1}),
        (window, {"next_offset": window.result["offset"] - 1}),
        (window, {"next_offset": window.result["next_offset"] + 1}),  # past max_bytes
        (window, {"length": window.result["next_offset"] - 1}),
        (window, {"reset": True}),
        (by_method["write"][0], {"bytes": 10**6}),
        (by_method["resize"][0], {"columns": 101}),
        (by_method["message"][0], {"delivery": "drafted"}),
        (by_method["checkpoint"][0], {"id": "v2"}),
        (final, {"exec_id": "0" * 16}),
        (final, {"signal": "SIGKILL"}),
        (final, {"stdout_bytes": 0}),
        (final, {"running": True}),
        (by_method["exec_kill"][0], {"exec_id": "0" * 16}),
        (by_method["stat"][1], {"path": "other"}),
        (by_method["stat"][1], {"root": "home"}),
        (by_method["list"][0], {"next_offset": 10**6}),
        (done, {"sha256": "0" * 64}),
        (done, {"done": False}),
        (by_method["download"][0], {"kind": "tar"}),
        (by_method["download"][0], {"transfer_id": "0" * 16}),
        (by_method["download"][0], {"size": None}),
        (by_method["download"][1], {"size": 5}),
        (by_method["transfer_close"][0], {"transfer_id": "0" * 16}),
    ]
    for exchange, change in broken:
        with pytest.raises(reploy_serve.AnswerInvalid):
            exchange.parse({**exchange.result, **change})
            raise AssertionError(f"{exchange.method}: {change} was accepted")


# -- answers on the control socket: the container may serve its own ---------------------------


class FakeAgent:
    """A server on DIR/control.sock that answers each request with `answer`, or, when
    `trickle_bytes` is set, sends that many spaces one by one, a little apart, and records
    whether the client hung up before it was done."""

    def __init__(self, directory: Path, answer: bytes = b"", trickle_bytes: int = 0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(directory / "control.sock"))
        self.sock.listen(4)
        self.answer, self.trickle_bytes = answer, trickle_bytes
        self.hung_up_early = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        connection, _ = self.sock.accept()
        with connection:
            connection.recv(65536)
            if not self.trickle_bytes:
                try:
                    connection.sendall(self.answer)
                except OSError:  # the client hung up at its bound
                    self.hung_up_early.set()
                return
            for _ in range(self.trickle_bytes):
                try:
                    connection.sendall(b" ")
                except OSError:  # the client closed: it did not wait for the rest
                    self.hung_up_early.set()
                    return
                if self.stop.wait(0.05):
                    return

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self.sock.close()


STATUS = {"type": "status", "workload": "shell", "turn_state": "idle"}


@pytest.mark.parametrize("answer", [
    b"[]\n", b"5\n", b'"result"\n', b'{"id":"serve","result":[]}\n', b'{"id":"serve","result":null}\n',
    b'{"id":"serve","error":"boom"}\n', b'{"id":"serve"}\n', b"[" * 100_000 + b"\n", b"not json\n",
    b'{"id":"other","result":' + json.dumps(STATUS).encode() + b"}\n",
    b'{"id":"serve","result":' + json.dumps(STATUS).encode() + b',"error":{}}\n',
    b'{"id":"serve","id":"serve","result":' + json.dumps(STATUS).encode() + b"}\n",
    b'{"id":"serve","result":' + json.dumps({**STATUS, "type": "read"}).encode() + b"}\n",
    b'{"id":"serve","result":' + json.dumps({**STATUS, "quiet_ms": float("nan")}).encode() + b"}\n",
    b'{"id":"serve","result":{"type":"status","workload":"shell","turn_state":"\\ud800"}}\n',
    b'{"id":"serve","error":{"code":"pwned","message":"no"}}\n',
    b'{"id":"serve","error":{"code":"command_error","message":"no \\udc80"}}\n',
    b'{"id":"serve","error":{"code":"command_error","message":"no","x":1}}\n',
    b'{"id":"serve","result":' + json.dumps(STATUS).encode() + b"} trailing\n",
    b'{"id":"serve","result":' + json.dumps(STATUS).encode() + b"}\n" + b" " * 4,
])
def test_an_answer_that_is_not_a_response_is_an_invalid_answer(box: Path, answer: bytes) -> None:
    fake = FakeAgent(box, answer)
    try:
        with pytest.raises(reploy_serve.AgentCallError) as raised:
            reploy_serve.agent_call(box, "status", {})
        assert raised.value.code == reploy_serve.INVALID_ANSWER and not raised.value.transport
        assert "answer to status is invalid" in str(raised.value)
        assert reploy_serve.serve_error_for(raised.value).status == 502
    finally:
        fake.close()


def test_an_answer_past_the_bound_is_invalid_and_not_read_further(box: Path) -> None:
    fake = FakeAgent(box, b" " * (reploy_serve.AGENT_MAX_RESPONSE_BYTES + 2 * 1024 * 1024))
    try:
        with pytest.raises(reploy_serve.AgentCallError, match="longer than") as raised:
            reploy_serve.agent_call(box, "status", {})
        assert raised.value.code == reploy_serve.INVALID_ANSWER
        assert fake.hung_up_early.wait(30)
    finally:
        fake.close()


def test_a_peer_that_hangs_up_without_an_answer_is_no_agent(box: Path) -> None:
    fake = FakeAgent(box, b'{"id":"serve","res')
    try:
        with pytest.raises(reploy_serve.AgentCallError, match="hung up") as raised:
            reploy_serve.agent_call(box, "status", {})
        assert raised.value.transport and reploy_serve.serve_error_for(raised.value).status == 503
    finally:
        fake.close()


@pytest.mark.parametrize(("code", "status"), [
    ("command_error", 409), ("invalid_request", 422), ("timeout", 503), ("server_unavailable", 503),
    ("disk_full", 507),
])
def test_a_well_formed_error_answer_keeps_its_code(box: Path, code: str, status: int) -> None:
    fake = FakeAgent(box, json.dumps({"id": "serve", "error": {"code": code, "message": "no"}}).encode() + b"\n")
    try:
        with pytest.raises(reploy_serve.AgentCallError, match="no") as raised:
            reploy_serve.agent_call(box, "status", {})
        assert raised.value.code == code and not raised.value.transport
        assert reploy_serve.serve_error_for(raised.value).status == status
    finally:
        fake.close()


def test_an_error_message_is_passed_on_as_safe_text(box: Path) -> None:
    message = "no such file or directory: a\r\nSet-Cookie: x\x1b[31m" + "y" * 5000
    fake = FakeAgent(box, json.dumps({"id": "serve", "error": {"code": "command_error",
                                                               "message": message}}).encode() + b"\n")
    try:
        with pytest.raises(reploy_serve.AgentCallError) as raised:
            reploy_serve.agent_call(box, "stat", {"path": "a"})
        text = str(raised.value)
        assert not any(ord(c) < 0x20 for c in text) and "\\x0d\\x0aSet-Cookie: x\\x1b[31m" in text
        assert len(text) <= reploy_serve.MAX_AGENT_MESSAGE_CHARS + 3
        assert reploy_serve.serve_error_for(raised.value).status == 404  # its stable words still map
    finally:
        fake.close()


def test_a_trickling_peer_cannot_hold_a_call_past_its_deadline(box: Path) -> None:
    """Bytes keep coming, each well inside the per-read timeout: the call's one deadline ends it
    (and the peer sees the hang-up) long before the peer would have finished."""
    fake = FakeAgent(box, trickle_bytes=600)
    try:
        with pytest.raises(reploy_serve.AgentCallError, match="does not answer"):
            reploy_serve.agent_call(box, "status", {}, timeout_s=0.5)
        assert fake.hung_up_early.wait(30)
    finally:
        fake.close()


# -- the loops that wait on an agent ----------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Stopping:
    """threading.Event's two methods the wait uses; wait() records its timeout and advances
    the clock by it, as a real wait would."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.waits, self.stopped = clock, [], False

    def is_set(self) -> bool:
        return self.stopped

    def wait(self, timeout_s: float) -> bool:
        self.waits.append(timeout_s)
        self.clock.now += timeout_s
        return self.stopped


def test_a_wait_ends_at_its_deadline_when_the_client_goes_or_serve_stops() -> None:
    clock = Clock()
    stopping = Stopping(clock)
    gone = [False]
    wait = reploy_serve.AgentWait("the commit", clock() + 10, lambda: gone[0], stopping, clock)  # type: ignore[arg-type]
    wait.check()
    clock.now += 9.9
    wait.check()
    clock.now += 0.1
    with pytest.raises(reploy_serve.GatewayTimeout, match="did not finish the commit"):
        wait.check()
    wait.renew(5)
    wait.check()
    gone[0] = True
    with pytest.raises(reploy_serve.ClientGone):
        wait.check()
    gone[0], stopping.stopped = False, True
    with pytest.raises(reploy_serve.ServiceUnavailable, match="stopping"):
        wait.check()


def test_an_answer_that_brings_nothing_paces_the_next_poll() -> None:
    clock = Clock()
    stopping = Stopping(clock)
    wait = reploy_serve.AgentWait("x", clock() + 60, lambda: False, stopping, clock)  # type: ignore[arg-type]
    wait.check()
    clock.now += 0.05  # the agent answered "not yet" at once
    wait.not_yet()
    assert stopping.waits == [pytest.approx(reploy_serve.AGENT_POLL_MIN_S - 0.05)]
    wait.check()
    clock.now += 4.0  # a real long-poll: no wait added
    wait.not_yet()
    assert len(stopping.waits) == 1


# -- kept connections (AgentConnections): reused while young and quiet, replaced when closed ----


class KeepingFake:
    """A server on DIR/control.sock that takes every connection and answers each request line
    on it by the next step of `plan`: "answer" (a valid status answer, the connection kept
    open), "hang up" (closed unanswered, as an agent closing an idle client at that moment), or
    "answer, then a byte" (the answer, then, once `cue` is set, an unasked byte: `stray_sent`)."""

    def __init__(self, directory: Path, plan: list[str]) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(directory / "control.sock"))
        self.sock.listen(4)
        self.plan = list(plan)
        self.accepted = 0
        self.requests: list[dict[str, Any]] = []
        self.cue = threading.Event()
        self.stray_sent = threading.Event()
        self.open: list[socket.socket] = []
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while self.plan:
            try:
                connection, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.open.append(connection)
            for line in self.lines(connection):
                self.requests.append(json.loads(line))
                step = self.plan.pop(0)
                if step == "hang up":
                    connection.close()
                    break
                connection.sendall(b'{"id":"serve","result":' + json.dumps(STATUS).encode() + b"}\n")
                if step == "answer, then a byte":
                    self.cue.wait(30)
                    connection.sendall(b"{")
                    self.stray_sent.set()
                if not self.plan:
                    return

    @staticmethod
    def lines(connection: socket.socket) -> Iterator[bytes]:
        """Its request lines until the client closes it (unread bytes of ours in its buffer reset it)."""
        try:
            yield from connection.makefile("rb")
        except ConnectionResetError:
            return

    def close(self) -> None:
        self.cue.set()
        self.sock.close()
        self.thread.join(timeout=30)
        for connection in self.open:
            connection.close()


def test_kept_connections_carry_one_call_after_another_to_the_real_agent(
        start_agent: Callable[..., AgentProcess]) -> None:
    shell = start_agent("--workload", "shell")
    connections = reploy_serve.AgentConnections()
    try:
        kept = []
        for _ in range(3):
            assert reploy_serve.agent_exchange(shell.agent_dir, "status", {}, connections=connections)[0]["workload"] == "shell"
            identity = reploy_serve.socket_identity(shell.agent_dir)
            sock = connections.take(shell.agent_dir, identity)
            assert sock is not None and identity is not None
            kept.append(sock)
            connections.keep(shell.agent_dir, sock, identity)
        assert kept[0] is kept[1] is kept[2]  # one connection carried all three
    finally:
        connections.close()


def test_a_kept_connection_closed_under_a_call_is_replaced_once(box: Path) -> None:
    fake = KeepingFake(box, ["answer", "hang up", "answer"])
    connections = reploy_serve.AgentConnections()
    try:
        for _ in range(2):
            assert reploy_serve.agent_exchange(box, "status", {}, connections=connections)[0]["workload"] == "shell"
        assert fake.accepted == 2 and len(fake.requests) == 3
        assert all(request["keep"] is True for request in fake.requests)
    finally:
        connections.close()
        fake.close()


def test_a_kept_connection_with_an_unasked_byte_on_it_is_never_reused(box: Path) -> None:
    fake = KeepingFake(box, ["answer, then a byte", "answer"])
    connections = reploy_serve.AgentConnections()
    try:
        reploy_serve.agent_exchange(box, "status", {}, connections=connections)
        fake.cue.set()
        assert fake.stray_sent.wait(30)
        assert reploy_serve.agent_exchange(box, "status", {}, connections=connections)[0]["workload"] == "shell"
        assert fake.accepted == 2  # the second call went on a new connection, never reading the `{`
    finally:
        connections.close()
        fake.close()


def test_a_kept_connection_is_not_reused_once_another_socket_is_in_its_place(box: Path) -> None:
    """As a stand-in or a relaunched agent takes the path: serve talks to what is there now."""
    first = KeepingFake(box, ["answer"])
    connections = reploy_serve.AgentConnections()
    second = None
    try:
        reploy_serve.agent_exchange(box, "status", {}, connections=connections)
        (box / "control.sock").rename(box / "aside.sock")
        second = KeepingFake(box, ["answer"])
        reploy_serve.agent_exchange(box, "status", {}, connections=connections)
        assert (first.accepted, len(first.requests)) == (1, 1)
        assert (second.accepted, len(second.requests)) == (1, 1)
    finally:
        connections.close()
        first.close()
        if second is not None:
            second.close()


def test_a_call_without_kept_connections_asks_for_none(box: Path) -> None:
    fake = KeepingFake(box, ["answer"])
    try:
        reploy_serve.agent_exchange(box, "status", {})
        assert "keep" not in fake.requests[0]
    finally:
        fake.close()


def test_kept_connections_expire_and_are_bounded_per_session(tmp_path: Path) -> None:
    now = [0.0]
    connections = reploy_serve.AgentConnections(clock=lambda: now[0])
    pairs = [socket.socketpair() for _ in range(reploy_serve.AGENT_KEPT_PER_SESSION + 1)]
    try:
        for ours, _ in pairs:
            connections.keep(tmp_path, ours, (1, 2))
        assert pairs[-1][0].fileno() == -1  # one past the bound: closed, not kept
        taken = connections.take(tmp_path, (1, 2))
        assert taken is pairs[-2][0]
        connections.keep(tmp_path, taken, (1, 2))
        now[0] = reploy_serve.AGENT_KEPT_IDLE_S
        assert connections.take(tmp_path, (1, 2)) is None  # too old to trust the agent still holds them
        assert all(ours.fileno() == -1 for ours, _ in pairs)
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()
