"""The broker (`client` mode) over real unix sockets and pipes, with the real attach; no Docker.

The test plays the host on one end of a socketpair, speaking the private framing, and the
controller on the broker's stdin/stdout pipes. Broker.run() runs in a thread. The broker hands
the attachment's connection to the host (SCM_RIGHTS) and keeps no copy: the test, as the host,
then talks to the attachment over that very connection, with no broker in between.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterator, Optional

import pytest

from reploy_session_client import (
    ATTACH_DEADLINE_S, SESSION_SOCKET_ENV, TERMINAL_CHUNK_BYTES, AcknowledgeTerminated, Broker,
    BrokerReady, Cause, ClientError, Complete, Diagnostic, Direction, Frame, FrameKind, Message,
    Opened, Ready, RecoveryAction, Resize, SessionResult, Status, Terminate, Terminated,
    Terminating, WorkloadExit, WorkloadOutputsFinalized, decode_message, encode_json_frame,
)
from test_attach import CLIENT, AttachProcess, collect_input
from test_broker_rules import TERMINATED as STARTUP_FAILURE_TERMINATED
from test_framing import WAIT_S, FramePeer, closed_at_the_other_end

OPENED = Opened(operations=("input", "resize", "terminate", "complete"), endpoints=(),
                columns=80, rows=24, output_finalization_timeout_milliseconds=30000)
EXIT_0 = WorkloadExit(status=Status.of("process", "exited", code=0))
DRAINED = WorkloadOutputsFinalized(status="drained")
FINAL_RESULT = SessionResult(
    cause=Cause.WORKLOAD_EXIT, workload_status=Status.of("process", "exited", code=0),
    workload_output_finalization_status=Status.of("output_finalization", "drained"),
    runtime_observation_status=Status.of("runtime_observation", "maintained"),
    controller_finalization_status=Status.of("controller_finalization", "completed"),
    cleanup_status=Status.of("cleanup", "succeeded"), recovery_action=RecoveryAction.NONE)
#: The events after ready, up to outputs-finalized, of a session that ends by workload exit.
TO_FINALIZED = [EXIT_0, Terminating(cause=Cause.WORKLOAD_EXIT), DRAINED]


class BrokerHarness:
    """A Broker in a thread, with the test as its host (a socketpair) and its controller (pipes)."""

    def __init__(self, attach_deadline_s: float = ATTACH_DEADLINE_S) -> None:
        self.home = tempfile.mkdtemp(prefix="rb-")  # unix socket paths must stay short
        host_end, broker_end = socket.socketpair()
        self.host = FramePeer(host_end)
        self.stdin_r, self.stdin_w = os.pipe()
        self.stdout_r, self.stdout_w = os.pipe()
        self.open_fds = {self.stdin_r, self.stdin_w, self.stdout_r, self.stdout_w}
        self.stdout_buffer = b""
        self.attachments: list[FramePeer] = []  # test-driven attachments: their own ends
        self.terminals: list[FramePeer] = []  # the host's ends, as the broker handed them over
        self.processes: list[AttachProcess] = []
        self.broker = Broker(broker_end, self.home, self.stdin_r, self.stdout_w,
                             attach_deadline_s=attach_deadline_s)
        self.exit_code: Optional[int] = None
        self.crash: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.exit_code = self.broker.run()
        except BaseException as e:  # noqa: BLE001 - reported by finish(), not lost in a thread
            self.crash = e

    # -- the controller's side: stdin and stdout ----------------------------------------------

    def next_line(self) -> bytes:
        deadline = time.monotonic() + WAIT_S
        while b"\n" not in self.stdout_buffer:
            remaining = deadline - time.monotonic()
            assert remaining > 0 and select.select([self.stdout_r], [], [], remaining)[0], (
                "the broker wrote no line in time")
            data = os.read(self.stdout_r, 1 << 16)
            assert data, "the broker's stdout ended"
            self.stdout_buffer += data
        line, _, self.stdout_buffer = self.stdout_buffer.partition(b"\n")
        return line + b"\n"

    def next_event(self) -> Message:
        return decode_message(self.next_line(), Direction.EVENT)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.stdin_w, view):]

    def close_stdin(self) -> None:
        self._close_fd(self.stdin_w)

    def broker_ready(self) -> str:
        event = self.next_event()
        assert isinstance(event, BrokerReady)
        return event.terminal_socket

    # -- the host's side ----------------------------------------------------------------------

    def host_frame(self) -> Frame:
        """The next frame from the broker."""
        return self.host.next_frame()

    def send_events(self, *events: Message) -> None:
        """Host events reach the controller in order, byte for byte."""
        for event in events:
            self.host.send_event(event)
        for event in events:
            assert self.next_line() == event.encode()

    def expect_request(self, request: Message) -> None:
        frame = self.host_frame()
        assert (frame.kind, frame.payload) == (FrameKind.REQUEST, request.encode()[:-1])

    def expect_attached(self) -> FramePeer:
        """ATTACHED, carrying exactly one descriptor: the attachment's connection, a connected
        unix stream socket. Returns the host's end of it."""
        frame = self.host_frame()
        assert (frame.kind, frame.payload) == (FrameKind.ATTACHED, b"{}")
        assert len(self.host.descriptors) == 1, self.host.descriptors
        sock = socket.socket(fileno=self.host.descriptors.pop())
        assert (sock.family, sock.type) == (socket.AF_UNIX, socket.SOCK_STREAM)
        self.terminals.append(FramePeer(sock))
        return self.terminals[-1]

    # -- attachments ------------------------------------------------------------------------

    def attach_raw(self, path: str) -> tuple[FramePeer, FramePeer]:
        """A test-driven attachment: (its own end, the host's end the broker handed over)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        self.attachments.append(FramePeer(sock))
        return self.attachments[-1], self.expect_attached()

    def attach_process(self, path: str) -> tuple[AttachProcess, FramePeer]:
        """The real `attach --socket PATH`, in pipe mode, and the host's end of it."""
        self.processes.append(AttachProcess(path))
        return self.processes[-1], self.expect_attached()

    def up_to_ready(self) -> tuple[FramePeer, FramePeer]:
        """broker-ready, a raw attachment, opened, ready."""
        ends = self.attach_raw(self.broker_ready())
        self.send_events(OPENED, Ready())
        return ends

    # -- the end ----------------------------------------------------------------------------

    def finish(self) -> int:
        """Wait for run() to return; its exit code."""
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the broker did not exit"
        assert self.crash is None, f"the broker crashed: {self.crash!r}"
        assert self.exit_code is not None
        return self.exit_code

    def rest_of_stdout(self) -> bytes:
        self.finish()
        self._close_fd(self.stdout_w)
        while data := os.read(self.stdout_r, 1 << 16):
            self.stdout_buffer += data
        rest, self.stdout_buffer = self.stdout_buffer, b""
        return rest

    def expect_fatal(self, code: str) -> list[Frame]:
        """A client-error with this code, exit 1, the host channel closed; what the host got."""
        event = self.next_event()
        assert isinstance(event, ClientError) and event.code == code, event
        assert self.finish() == 1
        frames = self.host.read_until_eof()
        assert not os.path.exists(self.broker.dir)
        return frames

    def expect_silent_failure(self, code: str, capsys: pytest.CaptureFixture[str]) -> None:
        """A failure after `terminated`: exit 1, its code on stderr, nothing on the stream
        (terminated stays its last event)."""
        assert self.finish() == 1
        assert self.rest_of_stdout() == b""
        assert f"reploy-session-client: {code}: " in capsys.readouterr().err

    def _close_fd(self, fd: int) -> None:
        if fd in self.open_fds:
            self.open_fds.discard(fd)
            os.close(fd)

    def close(self) -> None:
        self.host.close()  # the broker ends on host EOF if it has not yet
        self.close_stdin()
        self.thread.join(WAIT_S)
        for process in self.processes:
            process.close()
        for peer in self.attachments + self.terminals:
            peer.close()
        for fd in list(self.open_fds):
            self._close_fd(fd)
        shutil.rmtree(self.home)
        assert not self.thread.is_alive(), "the broker did not exit"


@pytest.fixture
def harness() -> Iterator[BrokerHarness]:
    harness = BrokerHarness()
    yield harness
    harness.close()


# --------------------------------------------------------------------------------------------
# The whole session
# --------------------------------------------------------------------------------------------


def send_output(terminal: FramePeer, data: bytes) -> None:
    """Terminal bytes as the host sends them: OUTPUT frames, straight to the attachment."""
    for start in range(0, len(data), TERMINAL_CHUNK_BYTES):
        terminal.send(FrameKind.OUTPUT, data[start:start + TERMINAL_CHUNK_BYTES])


def test_full_session_through_the_real_attach(harness: BrokerHarness) -> None:
    path = harness.broker_ready()
    directory = os.path.dirname(path)
    assert re.fullmatch(re.escape(harness.home) + r"/reploy-controlled-session-[0-9a-f]{32}"
                        r"/terminal\.sock", path)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600

    attach, terminal = harness.attach_process(path)
    harness.send_events(OPENED, Ready(),
                        Diagnostic(code="future_code", message="café 端末 \"q\" \\"))

    # Output in order, including several MiB: more than every buffer on the way holds, so
    # the kernel's backpressure (no credit frames) paces the host.
    small = b"$ ls\r\n\x1b[1mbold\x1b[0m\r\n"
    big = bytes(n % 253 for n in range(5 * 1024 * 1024 // 2 + 17))
    send_output(terminal, small)
    assert attach.wait_output(len(small)) == small
    send_output(terminal, big)

    typed = b"echo typed\r\x03\x04"
    attach.write(typed)
    assert collect_input(terminal, len(typed)) == typed

    harness.send_events(*TO_FINALIZED[:2])
    terminal.send_json(FrameKind.OUTPUT_END, {"status": "drained"})
    harness.send_events(TO_FINALIZED[2])
    assert attach.finish() == 0
    assert attach.output == small + big

    harness.write(Complete().encode())
    harness.expect_request(Complete())
    harness.send_events(Terminated(result=FINAL_RESULT))
    harness.write(AcknowledgeTerminated().encode())
    harness.expect_request(AcknowledgeTerminated())
    harness.host.close()

    assert harness.finish() == 0
    assert harness.rest_of_stdout() == b""  # nothing after terminated, no client-error
    assert not os.path.exists(directory)


def test_startup_failure_is_acknowledged_without_complete(harness: BrokerHarness) -> None:
    harness.attach_raw(harness.broker_ready())
    harness.send_events(OPENED, STARTUP_FAILURE_TERMINATED)
    harness.write(AcknowledgeTerminated().encode())
    harness.expect_request(AcknowledgeTerminated())
    harness.host.close()
    assert harness.finish() == 0


def test_no_clean_exit_when_the_acknowledgement_cannot_reach_the_host(
        harness: BrokerHarness, capsys: pytest.CaptureFixture[str]) -> None:
    """The host stops reading before the acknowledgement is written: sending it fails, and
    that is not a clean end (exit 0 needs the acknowledgement written, then a clean close)."""
    harness.up_to_ready()
    harness.send_events(*TO_FINALIZED)
    harness.write(Complete().encode())
    harness.expect_request(Complete())
    harness.send_events(Terminated(result=FINAL_RESULT))
    harness.host.sock.shutdown(socket.SHUT_RD)  # no end of file for the broker: a write fails
    harness.write(AcknowledgeTerminated().encode())
    harness.expect_silent_failure("host_channel_lost", capsys)


def test_stdin_may_close_after_the_acknowledgement(harness: BrokerHarness) -> None:
    harness.up_to_ready()
    harness.send_events(*TO_FINALIZED)
    harness.write(Complete().encode())
    harness.expect_request(Complete())  # stdin and the host are separate streams: wait
    harness.send_events(Terminated(result=FINAL_RESULT))
    harness.write(AcknowledgeTerminated().encode())
    harness.close_stdin()
    harness.expect_request(AcknowledgeTerminated())
    harness.host.close()
    assert harness.finish() == 0


# --------------------------------------------------------------------------------------------
# The attachment
# --------------------------------------------------------------------------------------------


def test_no_attachment_within_the_deadline_is_attach_timeout() -> None:
    harness = BrokerHarness(attach_deadline_s=0.3)
    try:
        path = harness.broker_ready()
        assert harness.expect_fatal("attach_timeout") == []  # never ATTACHED
        assert harness.host.descriptors == []
        assert not os.path.exists(path)
    finally:
        harness.close()


def test_only_one_attachment_is_accepted(harness: BrokerHarness) -> None:
    path = harness.broker_ready()
    first, terminal = harness.attach_raw(path)
    second = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with second, pytest.raises((FileNotFoundError, ConnectionRefusedError)):
        second.connect(path)
    terminal.send(FrameKind.OUTPUT, b"still the first")
    frame = first.next_frame()
    assert (frame.kind, frame.payload) == (FrameKind.OUTPUT, b"still the first")


def test_the_broker_keeps_no_copy_of_the_attachment(harness: BrokerHarness) -> None:
    """Once handed over, the connection is the host's alone: when the host closes its end,
    the attachment sees the end at once, with the broker still running."""
    attach, terminal = harness.attach_process(harness.broker_ready())
    harness.send_events(OPENED, Ready())
    send_output(terminal, b"last words")
    terminal.close()
    assert attach.finish() == 1
    assert attach.output == b"last words"
    assert "closed the terminal connection before output was finalized" in attach.stderr()
    assert harness.thread.is_alive()  # the broker is still there, minding the stream
    harness.send_events(Terminating(cause=Cause.CONTROLLER_TERMINATE))


def test_terminal_frames_never_pass_through_the_broker(harness: BrokerHarness) -> None:
    """Input and resizes go from the attachment to the host over the handed-over connection,
    before ready and after; the channel carries only what the controller requests. (The host
    judges them: test_terminal_relay.py.)"""
    attachment, terminal = harness.attach_raw(harness.broker_ready())
    attachment.send_json(FrameKind.RESIZE, {"columns": 10, "rows": 10})
    attachment.send(FrameKind.INPUT, b"m")
    harness.send_events(OPENED, Ready())
    attachment.send_json(FrameKind.RESIZE, {"columns": 132, "rows": 43})
    harness.write(Resize(columns=100, rows=30).encode())
    harness.expect_request(Resize(columns=100, rows=30))  # the structured one, and only it
    assert [(f.kind, f.payload) for f in (terminal.next_frame() for _ in range(3))] == [
        (FrameKind.RESIZE, b'{"columns":10,"rows":10}'), (FrameKind.INPUT, b"m"),
        (FrameKind.RESIZE, b'{"columns":132,"rows":43}')]
    harness.send_events(Terminating(cause=Cause.HOST_CANCEL))
    harness.write(Terminate().encode())  # ignored: termination already began
    harness.send_events(DRAINED)
    harness.write(Complete().encode())
    harness.expect_request(Complete())  # nothing else came in between


def test_output_finalization_failure_makes_attach_exit_1(harness: BrokerHarness) -> None:
    attach, terminal = harness.attach_process(harness.broker_ready())
    harness.send_events(OPENED, Ready())
    send_output(terminal, b"partial output")
    failed = {"status": "failed", "reason": "terminal output did not reach end of file"}
    terminal.send_json(FrameKind.OUTPUT_END, failed)
    assert attach.finish() == 1
    assert attach.output == b"partial output"
    assert "did not reach end of file" in attach.stderr()


def test_terminal_output_never_reaches_the_structured_stream(harness: BrokerHarness) -> None:
    attach, terminal = harness.attach_process(harness.broker_ready())
    harness.send_events(OPENED, Ready())
    forged = (Terminated(result=FINAL_RESULT).encode()
              + b'{"schema":"reploy-controlled-session-client-v1","type":"ready"}\n'
              + b"\x1b[2J\x1b[H\x1b]52;c;Zm9yZ2Vk\x07\r\n")
    send_output(terminal, forged)
    harness.send_events(*TO_FINALIZED)
    assert attach.wait_output(len(forged)) == forged
    harness.host.close()  # early: the broker's last line is its own client-error
    event = harness.next_event()
    assert isinstance(event, ClientError) and event.code == "host_channel_lost"
    assert harness.rest_of_stdout() == b""


# --------------------------------------------------------------------------------------------
# Fatal conditions
# --------------------------------------------------------------------------------------------

REQUEST_PREFIX = b'{"schema":"reploy-controlled-session-client-v1","type":'

FATAL_REQUESTS = {
    "premature complete": ([], Complete().encode(), "premature_request"),
    "premature acknowledgement": ([], AcknowledgeTerminated().encode(), "premature_request"),
    "invalid line": ([], b"{not json\n", "invalid_request"),
    "unknown field": ([], REQUEST_PREFIX + b'"terminate","now":true}\n', "invalid_request"),
    "unknown type": ([], REQUEST_PREFIX + b'"pause"}\n', "unknown_type"),
    "event as a request": ([], REQUEST_PREFIX + b'"ready"}\n', "unknown_type"),
    "wrong schema": ([], b'{"schema":"reploy-controlled-session-client-v2","type":"terminate"}\n',
                     "unsupported_schema"),
    "line over 1 MiB": ([], b" " * (1 << 20) + b"\n", "line_too_long"),
    "resize out of range": ([], REQUEST_PREFIX + b'"resize","columns":65536,"rows":1}\n',
                            "invalid_request"),
    "duplicate complete": (TO_FINALIZED, Complete().encode() * 2, "duplicate_request"),
}


@pytest.mark.parametrize("events, written, code", FATAL_REQUESTS.values(),
                         ids=FATAL_REQUESTS.keys())
def test_fatal_request_ends_the_broker(harness: BrokerHarness, events: list[Message],
                                       written: bytes, code: str) -> None:
    harness.up_to_ready()
    harness.send_events(*events)
    harness.write(written)
    frames = harness.expect_fatal(code)
    forwarded = [f.payload for f in frames if f.kind is FrameKind.REQUEST]
    assert forwarded == ([b'{"schema":"reploy-controlled-session-client-v1","type":"complete"}']
                         if code == "duplicate_request" else [])


def test_complete_after_terminated_is_fatal_and_silent(
        harness: BrokerHarness, capsys: pytest.CaptureFixture[str]) -> None:
    harness.up_to_ready()
    harness.send_events(*TO_FINALIZED, Terminated(result=FINAL_RESULT))
    harness.write(Complete().encode())
    harness.expect_silent_failure("unauthorized_request", capsys)
    assert harness.host.read_until_eof() == []


def test_duplicate_acknowledgement_is_fatal_after_the_first_is_forwarded(
        harness: BrokerHarness, capsys: pytest.CaptureFixture[str]) -> None:
    harness.up_to_ready()
    harness.send_events(*TO_FINALIZED)
    harness.write(Complete().encode())
    harness.expect_request(Complete())
    harness.send_events(Terminated(result=FINAL_RESULT))
    harness.write(AcknowledgeTerminated().encode() * 2)
    harness.expect_silent_failure("duplicate_request", capsys)
    frames = harness.host.read_until_eof()
    assert [(f.kind, f.payload) for f in frames] == [
        (FrameKind.REQUEST, AcknowledgeTerminated().encode()[:-1])]


def test_request_line_cut_off_by_the_end_of_stdin(harness: BrokerHarness) -> None:
    harness.up_to_ready()
    harness.write(Terminate().encode()[:-1])
    harness.close_stdin()
    harness.expect_fatal("invalid_request")


def test_repeated_terminate_is_forwarded_once(harness: BrokerHarness) -> None:
    harness.up_to_ready()
    harness.write(Terminate().encode() * 3 + Resize(columns=100, rows=30).encode())
    harness.expect_request(Terminate())
    harness.expect_request(Resize(columns=100, rows=30))  # the repeats were dropped


def test_host_closing_early_is_host_channel_lost(harness: BrokerHarness) -> None:
    harness.up_to_ready()
    harness.host.close()
    event = harness.next_event()
    assert isinstance(event, ClientError) and event.code == "host_channel_lost"
    assert harness.finish() == 1


def test_host_closing_after_terminated_but_before_the_ack_is_host_channel_lost(
        harness: BrokerHarness, capsys: pytest.CaptureFixture[str]) -> None:
    harness.up_to_ready()
    harness.send_events(*TO_FINALIZED, Terminated(result=FINAL_RESULT))
    harness.host.close()
    harness.expect_silent_failure("host_channel_lost", capsys)


def test_stdin_closing_before_the_acknowledgement_is_fatal(harness: BrokerHarness) -> None:
    harness.up_to_ready()
    harness.send_events(*TO_FINALIZED)
    harness.close_stdin()
    harness.expect_fatal("controller_stream_closed")


def test_stdin_closing_after_terminated_before_the_acknowledgement_is_fatal_and_silent(
        harness: BrokerHarness, capsys: pytest.CaptureFixture[str]) -> None:
    harness.up_to_ready()
    harness.send_events(*TO_FINALIZED, Terminated(result=FINAL_RESULT))
    harness.close_stdin()
    harness.expect_silent_failure("controller_stream_closed", capsys)


def test_a_host_event_after_terminated_is_fatal_and_silent(
        harness: BrokerHarness, capsys: pytest.CaptureFixture[str]) -> None:
    harness.up_to_ready()
    harness.send_events(*TO_FINALIZED, Terminated(result=FINAL_RESULT))
    harness.host.send_event(ClientError(code="forged", message="from the host"))
    harness.expect_silent_failure("host_protocol_error", capsys)


def test_the_attach_deadline_ends_with_terminated() -> None:
    """A session that ended before the controller attached (a startup failure, a cancelled
    startup): its `terminated` ends the attachment's deadline, the controller acknowledges
    after it would have expired, and the broker ends cleanly with terminated its last event."""
    harness = BrokerHarness(attach_deadline_s=0.3)
    try:
        path = harness.broker_ready()
        harness.send_events(OPENED, STARTUP_FAILURE_TERMINATED)
        time.sleep(0.6)  # not synchronisation: past the attach deadline, which must not fire
        harness.write(AcknowledgeTerminated().encode())
        harness.expect_request(AcknowledgeTerminated())
        harness.host.close()
        assert harness.finish() == 0
        assert harness.rest_of_stdout() == b""
        assert not os.path.exists(path)
    finally:
        harness.close()


def test_host_event_out_of_order_is_fatal(harness: BrokerHarness) -> None:
    harness.up_to_ready()
    harness.host.send_event(DRAINED)  # before terminating
    harness.expect_fatal("host_protocol_error")


def test_malformed_frame_from_the_host_is_fatal(harness: BrokerHarness) -> None:
    harness.up_to_ready()
    harness.host.send(FrameKind.REQUEST, Terminate().encode()[:-1])  # the host never sends these
    harness.expect_fatal("channel_protocol_error")


def test_a_descriptor_from_the_host_is_refused_and_closed(harness: BrokerHarness) -> None:
    harness.up_to_ready()
    near, far = socket.socketpair()
    with far:
        harness.host.send_with_descriptors(encode_json_frame(FrameKind.EVENT, Terminating(
            cause=Cause.HOST_CANCEL).to_json()), [near.fileno()])
        near.close()
        harness.expect_fatal("channel_protocol_error")
        assert closed_at_the_other_end(far)


# --------------------------------------------------------------------------------------------
# The `client` command itself
# --------------------------------------------------------------------------------------------


def run_client_command(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(CLIENT), "client"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def read_event(process: subprocess.Popen) -> Message:
    assert select.select([process.stdout], [], [], WAIT_S)[0], "the client wrote nothing"
    return decode_message(process.stdout.readline(), Direction.EVENT)


@pytest.mark.parametrize("socket_env, code", [
    (None, "no_session"), ("/nonexistent/channel.sock", "host_unavailable")])
def test_client_command_without_a_host(socket_env: Optional[str], code: str) -> None:
    env = {"PATH": os.environ.get("PATH", ""), "HOME": "/nonexistent"}
    if socket_env is not None:
        env[SESSION_SOCKET_ENV] = socket_env
    process = run_client_command(env)
    stdout, _ = process.communicate(timeout=WAIT_S)
    event = decode_message(stdout, Direction.EVENT)
    assert isinstance(event, ClientError) and event.code == code
    assert process.returncode == 1


def test_client_command_connects_to_the_host_socket() -> None:
    home = tempfile.mkdtemp(prefix="rb-")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(home, "channel.sock"))
    listener.listen(1)
    process = run_client_command({"PATH": os.environ.get("PATH", ""), "HOME": home,
                                  SESSION_SOCKET_ENV: os.path.join(home, "channel.sock")})
    try:
        assert select.select([listener], [], [], WAIT_S)[0], "the client did not connect"
        host = FramePeer(listener.accept()[0])
        first = read_event(process)
        assert isinstance(first, BrokerReady) and first.terminal_socket.startswith(home + "/")
        host.close()  # before opened: the client reports the lost channel and exits
        second = read_event(process)
        assert isinstance(second, ClientError) and second.code == "host_channel_lost"
        assert process.communicate(timeout=WAIT_S)[0] == b""
        assert process.returncode == 1
        assert os.listdir(home) == ["channel.sock"]  # the broker's directory is gone
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=WAIT_S)
        listener.close()
        shutil.rmtree(home)
