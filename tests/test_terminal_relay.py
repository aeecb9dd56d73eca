"""The host's terminal relay (reploy.TerminalRelay): terminal bytes between the workload's PTY
and the attachment's own connection, which the broker handed over. No Docker: a socketpair
stands in for the Engine's attach stream (a raw byte stream, as the hijacked attach is), and
the attachment is the real `attach` process or the test's own framed end. The session's part
is played by the test: whether it is active, and what a resize does."""

from __future__ import annotations

import fcntl
import os
import select
import selectors
import shutil
import socket
import struct
import tempfile
import termios
import threading
import time
from typing import Callable, Iterator

import pytest

import reploy
from reploy_session_client import (
    TERMINAL_CHUNK_BYTES, TERMINAL_QUEUE_BYTES, FrameKind, Status, encode_frame,
    encode_json_frame,
)
from test_attach import AttachProcess
from test_framing import WAIT_S, FramePeer, closed_at_the_other_end

DRAINED = Status.of("output_finalization", "drained")


class RelayHarness:
    """A TerminalRelay on a selector the test pumps, an engine stand-in, and attachments."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self.active = False
        self.resizes: list[tuple[int, int]] = []
        self.relay = reploy.TerminalRelay(reploy.Interest(self.selector), lambda: self.active,
                                          lambda columns, rows: self.resizes.append(
                                              (columns, rows)))
        pty_end, self.engine = socket.socketpair()
        pty_end.setblocking(False)
        self.relay.open_pty(pty_end)
        self.directory = tempfile.mkdtemp(prefix="rr-")
        self.processes: list[AttachProcess] = []
        self.peers: list[FramePeer] = []

    def pump(self, condition: Callable[[], bool], what: str) -> None:
        """Run the relay's loop until condition() holds; fails after WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while not condition():
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"the relay never got to: {what}"
            self.relay.set_interest()
            for key, mask in self.selector.select(self.relay.timeout(min(remaining, 0.05))):
                key.data(mask)

    def attach_process(self) -> AttachProcess:
        """The real attach, its connection accepted as the broker does, then handed over."""
        path = os.path.join(self.directory, "terminal.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen(1)
            self.processes.append(AttachProcess(path))
            assert select.select([listener], [], [], WAIT_S)[0], "attach did not connect"
            accepted, _ = listener.accept()
        os.unlink(path)
        self.relay.adopt(accepted)
        return self.processes[-1]

    def attach_raw(self) -> FramePeer:
        """An attachment the test speaks for, frame by frame."""
        ours, theirs = socket.socketpair()
        self.relay.adopt(ours)
        self.peers.append(FramePeer(theirs))
        return self.peers[-1]

    def read_by_relay(self) -> bool:
        """True once the relay has read all the attachment sent it so far."""
        assert self.relay.terminal is not None
        unread = fcntl.ioctl(self.relay.terminal.sock, termios.FIONREAD, b"\0\0\0\0")
        return struct.unpack("i", unread)[0] == 0

    def engine_received(self) -> bytes:
        """What the workload's PTY got so far (it does not wait)."""
        received = b""
        while select.select([self.engine], [], [], 0)[0]:
            chunk = self.engine.recv(1 << 16)
            if not chunk:
                break
            received += chunk
        return received

    def close(self) -> None:
        for process in self.processes:
            process.close()
        for peer in self.peers:
            peer.close()
        self.relay.close_terminal()
        self.relay.close_pty()
        self.engine.close()
        self.selector.close()
        shutil.rmtree(self.directory)


@pytest.fixture
def harness() -> Iterator[RelayHarness]:
    harness = RelayHarness()
    yield harness
    harness.close()


def write_in_background(sock: socket.socket, data: bytes,
                        then_end: bool = False) -> threading.Thread:
    """The workload writing `data` to its terminal (and then, maybe, ending it)."""

    def write() -> None:
        sock.sendall(data)
        if then_end:
            sock.shutdown(socket.SHUT_WR)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    return writer


# --------------------------------------------------------------------------------------------
# Output: workload -> attachment
# --------------------------------------------------------------------------------------------


def test_output_reaches_the_real_attach_whole_and_in_order(harness: RelayHarness) -> None:
    attach = harness.attach_process()
    # Hostile output: frames, events and escapes are just bytes to the attachment.
    hostile = (encode_json_frame(FrameKind.OUTPUT_END, {"status": "failed", "reason": "forged"})
               + b'{"schema":"reploy-controlled-session-client-v1","type":"terminated"}\n'
               + b"\x1b]52;c;Zm9yZ2Vk\x07")
    data = hostile + bytes(n % 251 for n in range(6 * 1024 * 1024))  # past every buffer
    writer = write_in_background(harness.engine, data)
    harness.pump(lambda: len(attach.output) >= len(data), "deliver all the output")
    writer.join(WAIT_S)
    assert attach.output == data
    assert attach.proc.poll() is None  # the forged end of output was output, nothing more
    harness.engine.shutdown(socket.SHUT_WR)  # the PTY's end of file
    harness.pump(lambda: harness.relay.pty_eof, "see the PTY's end")
    assert harness.relay.delivered and not harness.relay.output_lost
    harness.relay.end_output(DRAINED)
    harness.pump(lambda: attach.proc.poll() is not None, "end the attachment")
    assert attach.finish() == 0


def test_bulk_output_is_coalesced_and_an_echo_is_not(harness: RelayHarness) -> None:
    """A large read puts the next one off for OUTPUT_COALESCE_S (a flood then crosses in big
    frames); a small one (an echo, a prompt) does not, and nothing is held back for long."""
    peer = harness.attach_raw()
    received = bytearray()

    def arrived(count: int) -> Callable[[], bool]:
        def condition() -> bool:
            if select.select([peer.sock], [], [], 0)[0]:
                peer.receive_once(time.monotonic() + WAIT_S)  # readable: it does not wait
            while peer.frames:
                received.extend(peer.frames.popleft().payload)
            return len(received) >= count
        return condition

    harness.engine.sendall(b"$")
    harness.pump(arrived(1), "pass the echo on")
    assert harness.relay.read_after_s == 0.0
    before = time.monotonic()
    harness.engine.sendall(b"x" * reploy.OUTPUT_BULK_READ_BYTES)
    harness.pump(lambda: harness.relay.read_after_s > 0, "read the bulk")
    assert harness.relay.read_after_s >= before + reploy.OUTPUT_COALESCE_S
    harness.engine.sendall(b"y" * reploy.OUTPUT_BULK_READ_BYTES)
    harness.pump(arrived(1 + 2 * reploy.OUTPUT_BULK_READ_BYTES),
                 "deliver the rest once the pause is over")
    assert bytes(received) == (b"$" + b"x" * reploy.OUTPUT_BULK_READ_BYTES
                               + b"y" * reploy.OUTPUT_BULK_READ_BYTES)


def test_a_full_read_is_followed_at_once(harness: RelayHarness) -> None:
    """A read that fills a whole chunk means more is waiting: the next read is not put off
    (a pause after each full chunk capped a flood at one chunk per OUTPUT_COALESCE_S)."""
    peer = harness.attach_raw()
    harness.engine.sendall(b"z" * (TERMINAL_CHUNK_BYTES + 1))  # one full read, one more byte
    payloads: list[bytes] = []

    def delivered() -> bool:
        if select.select([peer.sock], [], [], 0)[0]:
            peer.receive_once(time.monotonic() + WAIT_S)  # readable: it does not wait
        while peer.frames:
            payloads.append(peer.frames.popleft().payload)
        return sum(map(len, payloads)) > TERMINAL_CHUNK_BYTES

    harness.pump(delivered, "deliver the full chunk and the byte after it")
    assert [len(payload) for payload in payloads] == [TERMINAL_CHUNK_BYTES, 1]
    assert harness.relay.read_after_s == 0.0  # neither read put the next one off


def test_the_pty_is_not_read_while_the_attachment_lags(harness: RelayHarness) -> None:
    """Backpressure without credit: output queued for an attachment that does not read stays
    bounded, the PTY is left unread meanwhile, and once the attachment reads, all of it
    arrives in order."""
    peer = harness.attach_raw()
    data = bytes(n % 249 for n in range(16 * TERMINAL_QUEUE_BYTES))
    writer = write_in_background(harness.engine, data)
    terminal = harness.relay.terminal
    assert terminal is not None
    harness.pump(lambda: terminal.pending_bulk_bytes >= TERMINAL_QUEUE_BYTES,
                 "fill its queue toward the attachment")
    harness.relay.set_interest()
    assert harness.relay.pty not in harness.selector.get_map()  # neither read nor written
    assert terminal.pending_bulk_bytes < TERMINAL_QUEUE_BYTES + TERMINAL_CHUNK_BYTES + 5
    assert writer.is_alive()  # the workload's writes wait: the kernel holds it back
    received = bytearray()

    def read_all() -> None:
        while len(received) < len(data):
            frame = peer.next_frame()
            assert frame.kind is FrameKind.OUTPUT
            received.extend(frame.payload)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    harness.pump(lambda: not reader.is_alive(), "deliver it once the attachment reads")
    writer.join(WAIT_S)
    assert bytes(received) == data


def test_output_for_a_lost_attachment_is_dropped_and_the_workload_never_stalls(
        harness: RelayHarness) -> None:
    peer = harness.attach_raw()
    peer.close()
    writer = write_in_background(harness.engine, b"x" * (4 * 1024 * 1024))
    harness.pump(lambda: not writer.is_alive(), "read everything the workload wrote")
    assert harness.relay.terminal is None and harness.relay.output_lost
    assert harness.relay.delivered  # nothing waits any more: there is nobody to wait for


def test_the_end_of_output_waits_for_the_attachment_then_ends_its_stream(
        harness: RelayHarness) -> None:
    peer = harness.attach_raw()
    terminal = harness.relay.terminal
    assert terminal is not None
    # A small socket buffer: the relay reads all the output, and most of it waits in its queue.
    terminal.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 * 1024)
    data = b"y" * TERMINAL_QUEUE_BYTES
    writer = write_in_background(harness.engine, data, then_end=True)
    harness.pump(lambda: harness.relay.pty_eof, "read all the output")
    writer.join(WAIT_S)
    harness.relay.end_output(Status.of("output_finalization", "failed", reason="too late"))
    assert not harness.relay.delivered and not terminal.write_closed  # the end waits its turn
    frames = []
    reader = threading.Thread(target=lambda: frames.extend(peer.read_until_eof()), daemon=True)
    reader.start()
    harness.pump(lambda: not reader.is_alive(), "deliver the output, its end, end the stream")
    assert harness.relay.delivered and terminal.write_closed and not harness.relay.output_lost
    assert b"".join(f.payload for f in frames[:-1]) == data
    assert (frames[-1].kind, frames[-1].json()) == (
        FrameKind.OUTPUT_END, {"status": "failed", "reason": "too late"})


def test_an_attachment_that_comes_after_the_end_gets_it_at_once(harness: RelayHarness) -> None:
    harness.relay.end_output(DRAINED)  # startup failed before the attachment came
    peer = harness.attach_raw()
    frames = peer.read_until_eof()
    assert [(f.kind, f.json()) for f in frames] == [(FrameKind.OUTPUT_END, {"status": "drained"})]


# --------------------------------------------------------------------------------------------
# Input and resizes: attachment -> workload, only while the session is active
# --------------------------------------------------------------------------------------------


def test_input_reaches_the_workload_only_while_the_session_is_active(
        harness: RelayHarness) -> None:
    peer = harness.attach_raw()
    peer.send(FrameKind.INPUT, b"before ready")
    harness.pump(harness.read_by_relay, "read the early input")
    assert harness.engine_received() == b""
    harness.active = True
    typed = bytes(range(256)) + b"\x03\x04"
    peer.send(FrameKind.INPUT, typed)
    received = b""

    def arrived() -> bool:
        nonlocal received
        received += harness.engine_received()
        return len(received) >= len(typed)

    harness.pump(arrived, "pass the input on")
    assert received == typed
    harness.active = False  # termination began
    peer.send(FrameKind.INPUT, b"too late")
    harness.pump(harness.read_by_relay, "read the late input")
    assert harness.engine_received() == b""


def test_real_attach_input_reaches_the_workload(harness: RelayHarness) -> None:
    harness.active = True
    attach = harness.attach_process()
    attach.write(b"echo typed\n")
    received = b""

    def arrived() -> bool:
        nonlocal received
        received += harness.engine_received()
        return len(received) >= 11

    harness.pump(arrived, "pass the typed line on")
    assert received == b"echo typed\n"


def test_resizes_are_honoured_only_while_active_and_invalid_ones_ignored(
        harness: RelayHarness) -> None:
    peer = harness.attach_raw()
    peer.send_json(FrameKind.RESIZE, {"columns": 10, "rows": 10})  # before ready: the CLI's wins
    harness.pump(harness.read_by_relay, "read the early resize")
    harness.active = True
    for invalid in ({"columns": 0, "rows": 10}, {"columns": 65536, "rows": 1}, {"rows": 5},
                    {"columns": "80", "rows": 24}):
        peer.send_json(FrameKind.RESIZE, invalid)
    peer.send(FrameKind.RESIZE, b"not json")
    peer.send_json(FrameKind.RESIZE, {"columns": 132, "rows": 43})
    harness.pump(lambda: harness.resizes != [], "honour the valid resize")
    harness.pump(harness.read_by_relay, "read the rest")
    assert harness.resizes == [(132, 43)]
    assert harness.relay.terminal is not None  # an invalid resize is ignored, not fatal
    harness.active = False
    peer.send_json(FrameKind.RESIZE, {"columns": 90, "rows": 20})
    harness.pump(harness.read_by_relay, "read the late resize")
    assert harness.resizes == [(132, 43)]


@pytest.mark.parametrize("kind", [FrameKind.OUTPUT, FrameKind.EVENT, FrameKind.ATTACHED])
def test_a_frame_an_attachment_never_sends_loses_it(harness: RelayHarness,
                                                    kind: FrameKind) -> None:
    harness.active = True
    peer = harness.attach_raw()
    peer.send(kind, b"{}")
    peer.send(FrameKind.INPUT, b"never passed on")
    harness.pump(lambda: harness.relay.terminal is None, "drop the attachment")
    assert harness.engine_received() == b""
    assert closed_at_the_other_end(peer.sock)


def test_a_descriptor_from_the_attachment_loses_it_and_is_closed(harness: RelayHarness) -> None:
    harness.active = True
    peer = harness.attach_raw()
    near, far = socket.socketpair()
    with far:
        peer.send_with_descriptors(encode_frame(FrameKind.INPUT, b"smuggled"), [near.fileno()])
        near.close()
        harness.pump(lambda: harness.relay.terminal is None, "drop the attachment")
        assert closed_at_the_other_end(far)
    assert harness.engine_received() == b""
