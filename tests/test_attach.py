"""The real `attach --socket PATH` subprocess against a socket run by the test, which plays
the broker's listener and then the host (to which the broker hands the connection over).

Pipe mode (stdin is not a TTY): bytes relayed both ways, SIGINT becomes a typed Ctrl-C, exit 0
only after a drained end, stdin held back while the host does not read. PTY mode (stdin is a
PTY that is attach's controlling terminal): raw mode on and restored, SIGWINCH (and only
SIGWINCH) becomes a RESIZE frame, a typed 0x03 is just a byte.

Also home of AttachProcess, which test_broker.py uses to run the real attach.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import pytest

from reploy_session_client import TERMINAL_QUEUE_BYTES, FrameKind, encode_json_frame
from test_framing import WAIT_S, FramePeer, closed_at_the_other_end

CLIENT = Path(__file__).resolve().parent.parent / "reploy_session_client.py"

#: Runs the rest of argv with fd 0 as its controlling terminal (it must be a session leader).
AS_CONTROLLING_TTY = [
    sys.executable, "-c",
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.argv[1], sys.argv[1:])",
]


class AttachProcess:
    """The real attach as a subprocess; a thread drains its stdout so it never blocks."""

    def __init__(self, socket_path: str, stdin: object = subprocess.PIPE,
                 wrapper: Sequence[str] = (), new_session: bool = False) -> None:
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, str(CLIENT), "attach", "--socket", socket_path],
            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=new_session)
        self.output = bytearray()
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._drain_stdout, daemon=True)
        self.reader.start()

    def _drain_stdout(self) -> None:
        assert self.proc.stdout is not None
        while chunk := os.read(self.proc.stdout.fileno(), 1 << 16):
            with self.changed:
                self.output += chunk
                self.changed.notify_all()

    def wait_output(self, count_bytes: int) -> bytes:
        """Wait until at least count_bytes arrived on stdout; return all of it."""
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.output) >= count_bytes, WAIT_S), (
                f"attach wrote {len(self.output)} of {count_bytes} bytes")
            return bytes(self.output)

    def write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def close_stdin(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()

    def finish(self) -> int:
        """Wait for the exit and the end of stdout; the exit code."""
        code = self.proc.wait(WAIT_S)
        self.reader.join(WAIT_S)
        assert not self.reader.is_alive()
        return code

    def stderr(self) -> str:
        assert self.proc.stderr is not None and self.proc.poll() is not None
        return self.proc.stderr.read().decode()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(WAIT_S)
        self.reader.join(WAIT_S)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


def collect_input(peer: FramePeer, count_bytes: int) -> bytes:
    """INPUT bytes from the attachment until count_bytes arrived; any other frame fails."""
    data = b""
    while len(data) < count_bytes:
        frame = peer.next_frame()
        assert frame.kind is FrameKind.INPUT, frame
        data += frame.payload
    return data


Start = Callable[..., tuple[AttachProcess, FramePeer]]


@pytest.fixture
def fake_broker() -> Iterator[Start]:
    """start(**AttachProcess options) runs attach against a listening socket, returns both ends
    (the test's end speaks as the host does once the broker handed the connection over)."""
    directory = tempfile.mkdtemp(prefix="ra-")
    path = os.path.join(directory, "terminal.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    started: list[AttachProcess] = []
    peers: list[FramePeer] = []

    def start(**options: object) -> tuple[AttachProcess, FramePeer]:
        attach = AttachProcess(path, **options)  # type: ignore[arg-type]
        started.append(attach)
        assert select.select([listener], [], [], WAIT_S)[0], "attach did not connect"
        peers.append(FramePeer(listener.accept()[0]))
        return attach, peers[-1]

    yield start
    for attach in started:
        attach.close()
    for peer in peers:
        peer.close()
    listener.close()
    shutil.rmtree(directory)


def synchronise(attach: AttachProcess, peer: FramePeer) -> None:
    """Wait until attach relays output: its loop runs, so its signal handlers are in place."""
    peer.send(FrameKind.OUTPUT, b"sync")
    assert attach.wait_output(4) == b"sync"


DRAINED = {"status": "drained"}


# --------------------------------------------------------------------------------------------
# Pipe mode
# --------------------------------------------------------------------------------------------


def test_pipe_mode_relays_bytes_and_exits_0_once_drained(fake_broker: Start) -> None:
    attach, peer = fake_broker()
    typed = b"echo hi\n\x00\xff\x1b[A"
    attach.write(typed)
    attach.close_stdin()  # the end of input is not the end of the session
    assert collect_input(peer, len(typed)) == typed  # no RESIZE: stdin is not a TTY
    output = [b"hi\r\n", bytes(range(256)), b"\x1b]0;title\x07"]
    for chunk in output:
        peer.send(FrameKind.OUTPUT, chunk)
    peer.send_json(FrameKind.OUTPUT_END, DRAINED)
    assert attach.finish() == 0
    assert attach.output == b"".join(output)
    assert peer.read_until_eof() == []


def test_a_clean_end_without_output_exits_0(fake_broker: Start) -> None:
    attach, peer = fake_broker()
    peer.send_json(FrameKind.OUTPUT_END, DRAINED)
    assert attach.finish() == 0
    assert attach.output == b""


def test_failed_output_finalization_exits_1(fake_broker: Start) -> None:
    attach, peer = fake_broker()
    peer.send(FrameKind.OUTPUT, b"partial")
    peer.send_json(FrameKind.OUTPUT_END, {"status": "failed", "reason": "drain expired"})
    assert attach.finish() == 1
    assert attach.output == b"partial"
    assert "drain expired" in attach.stderr()


def test_host_closing_without_an_end_exits_1(fake_broker: Start) -> None:
    attach, peer = fake_broker()
    peer.send(FrameKind.OUTPUT, b"cut short")
    peer.close()
    assert attach.finish() == 1
    assert attach.output == b"cut short"
    assert "closed the terminal connection before output was finalized" in attach.stderr()


def test_a_malformed_frame_from_the_host_exits_1(fake_broker: Start) -> None:
    attach, peer = fake_broker()
    peer.sock.sendall((0).to_bytes(4, "big") + bytes([99]))
    assert attach.finish() == 1
    assert "unknown frame kind 99" in attach.stderr()


@pytest.mark.parametrize("kind", [FrameKind.INPUT, FrameKind.EVENT, FrameKind.RESIZE])
def test_a_frame_the_host_never_sends_exits_1(fake_broker: Start, kind: FrameKind) -> None:
    attach, peer = fake_broker()
    peer.send(FrameKind.OUTPUT, b"before")
    peer.send(kind, b"{}")
    peer.send(FrameKind.OUTPUT, b"after")  # never written: the stream is refused at once
    assert attach.finish() == 1
    assert attach.output == b"before"
    assert f"unexpected {kind.name} frame" in attach.stderr()


def test_a_descriptor_sent_to_attach_is_refused_and_closed(fake_broker: Start) -> None:
    attach, peer = fake_broker()
    near, far = socket.socketpair()
    with far:
        peer.send_with_descriptors(encode_json_frame(FrameKind.OUTPUT_END, DRAINED),
                                   [near.fileno()])
        near.close()
        assert attach.finish() == 1
        assert "a descriptor arrived with a OUTPUT_END frame" in attach.stderr()
        assert closed_at_the_other_end(far)


def test_stdin_is_held_back_while_the_host_does_not_read_then_flows_again(
        fake_broker: Start) -> None:
    """Backpressure with no credit frames: the host stops reading, attach stops reading its
    stdin once its queue is full (so our writes into its stdin pipe block), and once the host
    reads again every byte arrives, in order, and stdin flows again."""
    attach, peer = fake_broker()
    synchronise(attach, peer)
    assert attach.proc.stdin is not None
    stdin_fd = attach.proc.stdin.fileno()
    os.set_blocking(stdin_fd, False)
    pattern = bytes(range(256)) * 256  # 64 KiB, every byte value
    written = 0
    deadline = time.monotonic() + WAIT_S
    while True:  # until attach stops taking stdin: our pipe stays full
        assert written < 256 * TERMINAL_QUEUE_BYTES, "attach never held stdin back"
        try:
            written += os.write(stdin_fd, pattern[written % len(pattern):])
            deadline = time.monotonic() + 0.5
        except BlockingIOError:
            if time.monotonic() > deadline:
                break
            select.select([], [stdin_fd], [], deadline - time.monotonic())
    received = collect_input(peer, written)
    assert received == (pattern * (written // len(pattern) + 2))[:written]
    os.set_blocking(stdin_fd, True)
    attach.write(b"and more")  # stdin is read again
    assert collect_input(peer, 8) == b"and more"
    peer.send_json(FrameKind.OUTPUT_END, DRAINED)
    assert attach.finish() == 0


def test_no_broker_socket_exits_1() -> None:
    attach = AttachProcess("/nonexistent/reploy-controlled-session-x/terminal.sock")
    try:
        assert attach.finish() == 1
        assert "cannot connect" in attach.stderr()
    finally:
        attach.close()


def test_sigint_in_pipe_mode_is_sent_as_ctrl_c(fake_broker: Start) -> None:
    attach, peer = fake_broker()
    synchronise(attach, peer)
    attach.proc.send_signal(signal.SIGINT)
    assert collect_input(peer, 1) == b"\x03"
    peer.send_json(FrameKind.OUTPUT_END, DRAINED)
    assert attach.finish() == 0  # the signal did not end attach


def test_sigterm_ends_attach_with_1(fake_broker: Start) -> None:
    attach, peer = fake_broker()
    synchronise(attach, peer)
    attach.proc.send_signal(signal.SIGTERM)
    assert attach.finish() == 1


# --------------------------------------------------------------------------------------------
# PTY mode
# --------------------------------------------------------------------------------------------


def set_window_size(master_fd: int, columns: int, rows: int) -> None:
    fcntl.ioctl(master_fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))


def resize_frame(peer: FramePeer) -> Optional[dict]:
    frame = peer.next_frame()
    assert frame.kind is FrameKind.RESIZE, frame
    return frame.json()


@pytest.fixture
def pty_pair() -> Iterator[tuple[int, int]]:
    master_fd, slave_fd = pty.openpty()
    yield master_fd, slave_fd
    os.close(master_fd)
    os.close(slave_fd)


def test_pty_mode_raw_resize_and_typed_ctrl_c(fake_broker: Start,
                                               pty_pair: tuple[int, int]) -> None:
    master_fd, slave_fd = pty_pair
    set_window_size(master_fd, 100, 30)
    before = termios.tcgetattr(slave_fd)
    assert before[3] & termios.ICANON and before[3] & termios.ISIG
    attach, peer = fake_broker(stdin=slave_fd, wrapper=AS_CONTROLLING_TTY, new_session=True)
    synchronise(attach, peer)  # its loop runs: the terminal is raw by now
    raw = termios.tcgetattr(slave_fd)
    assert not raw[3] & (termios.ICANON | termios.ECHO | termios.ISIG)

    # No size went out on its own (the session's --columns/--rows hold); SIGWINCH sends one.
    set_window_size(master_fd, 120, 40)  # the kernel sends SIGWINCH to attach
    assert resize_frame(peer) == {"columns": 120, "rows": 40}

    # With ISIG off, 0x03 is input like any other byte: in order, between its neighbours.
    os.write(master_fd, b"ab\x03cd")
    assert collect_input(peer, 5) == b"ab\x03cd"

    peer.send(FrameKind.OUTPUT, b"bye")
    peer.send_json(FrameKind.OUTPUT_END, DRAINED)
    assert attach.finish() == 0
    assert attach.output == b"syncbye"
    assert termios.tcgetattr(slave_fd) == before
