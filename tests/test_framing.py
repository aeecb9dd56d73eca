"""The private framing: FrameDecoder, DataWindow and FramedConnection over real sockets.

Also home of FramePeer, the test's own end of a framed socket, which test_broker.py and
test_attach.py use to play the host and the broker.
"""

from __future__ import annotations

import collections
import select
import socket
import threading
import time
from typing import Iterator

import pytest

from reploy_session_client import (
    DATA_WINDOW_BYTES, MAX_FRAME_PAYLOAD_BYTES, DataWindow, Frame, FrameDecoder, FrameKind,
    FramedConnection, FramingError, Message, ProtocolError, credit_frame, encode_compact,
    encode_frame, encode_json_frame,
)

#: The bound on every wait in these tests. Reached only when the code under test is broken.
WAIT_S = 10.0


class FramePeer:
    """The test's end of a framed connection: blocking writes, reads bounded by a deadline."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self.sock = sock
        self.decoder = FrameDecoder()
        self.frames: collections.deque[Frame] = collections.deque()
        self.eof = False

    def send(self, kind: FrameKind, payload: bytes = b"") -> None:
        self.sock.sendall(encode_frame(kind, payload))

    def send_json(self, kind: FrameKind, obj: dict) -> None:
        self.send(kind, encode_compact(obj))

    def send_event(self, event: Message) -> None:
        self.send(FrameKind.EVENT, event.encode()[:-1])

    def receive_once(self, deadline: float) -> bool:
        """One read; False when nothing came before the deadline."""
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([self.sock], [], [], remaining)[0]:
            return False
        try:
            data = self.sock.recv(1 << 20)
        except ConnectionResetError:
            data = b""
        if data:
            self.frames.extend(self.decoder.feed(data))
        else:
            self.eof = True
        return True

    def next_frame(self, skip: tuple[FrameKind, ...] = ()) -> Frame:
        """The next frame not of a kind in `skip`; fails at EOF or after WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while True:
            while self.frames:
                frame = self.frames.popleft()
                if frame.kind not in skip:
                    return frame
            assert not self.eof, "the peer closed while a frame was expected"
            assert self.receive_once(deadline), "no frame arrived in time"

    def read_until_eof(self) -> list[Frame]:
        """Every frame up to the peer's close; fails if it does not close in time."""
        deadline = time.monotonic() + WAIT_S
        while not self.eof:
            assert self.receive_once(deadline), "the peer did not close in time"
        frames = list(self.frames)
        self.frames.clear()
        return frames

    def close(self) -> None:
        self.sock.close()


# --------------------------------------------------------------------------------------------
# FrameDecoder
# --------------------------------------------------------------------------------------------

ONE_OF_EACH_KIND = [
    Frame(FrameKind.EVENT, b'{"schema":"reploy-controlled-session-client-v1","type":"ready"}'),
    Frame(FrameKind.OUTPUT, bytes(range(256))),
    Frame(FrameKind.OUTPUT, b""),
    Frame(FrameKind.OUTPUT_END, b'{"status":"failed","reason":"r"}'),
    Frame(FrameKind.REQUEST, b'{"schema":"reploy-controlled-session-client-v1","type":"complete"}'),
    Frame(FrameKind.INPUT, b"\x03\x00\xff\n"),
    Frame(FrameKind.CREDIT, b'{"bytes":65536}'),
    Frame(FrameKind.ATTACHED, b"{}"),
    Frame(FrameKind.RESIZE, b'{"columns":120,"rows":40}'),
]
STREAM = b"".join(encode_frame(f.kind, f.payload) for f in ONE_OF_EACH_KIND)


def test_every_kind_is_in_the_round_trip_stream() -> None:
    assert {f.kind for f in ONE_OF_EACH_KIND} == set(FrameKind)


@pytest.mark.parametrize("cut", range(len(STREAM) + 1))
def test_round_trip_split_at_every_byte_boundary(cut: int) -> None:
    decoder = FrameDecoder()
    frames = decoder.feed(STREAM[:cut])
    assert decoder.pending_bytes == cut - sum(5 + len(f.payload) for f in frames)
    frames += decoder.feed(STREAM[cut:])
    assert frames == ONE_OF_EACH_KIND
    assert decoder.pending_bytes == 0


def test_round_trip_one_byte_at_a_time() -> None:
    decoder = FrameDecoder()
    frames = [frame for i in range(len(STREAM)) for frame in decoder.feed(STREAM[i:i + 1])]
    assert frames == ONE_OF_EACH_KIND


def test_largest_payload_round_trips() -> None:
    payload = bytes(range(256)) * (MAX_FRAME_PAYLOAD_BYTES // 256)
    assert len(payload) == MAX_FRAME_PAYLOAD_BYTES
    assert FrameDecoder().feed(encode_frame(FrameKind.OUTPUT, payload)) == [
        Frame(FrameKind.OUTPUT, payload)]


def test_oversize_frame_is_refused_by_encoder_and_by_decoder_at_its_header() -> None:
    with pytest.raises(FramingError):
        encode_frame(FrameKind.OUTPUT, b"x" * (MAX_FRAME_PAYLOAD_BYTES + 1))
    header = (MAX_FRAME_PAYLOAD_BYTES + 1).to_bytes(4, "big") + bytes([FrameKind.OUTPUT])
    with pytest.raises(FramingError) as info:
        FrameDecoder().feed(header)  # refused before any payload arrives
    assert info.value.code == "channel_protocol_error"


@pytest.mark.parametrize("kind", [0, max(FrameKind) + 1, 255])
def test_unknown_frame_kind_is_refused(kind: int) -> None:
    decoder = FrameDecoder()
    assert decoder.feed(encode_frame(FrameKind.OUTPUT, b"ok")) == [Frame(FrameKind.OUTPUT, b"ok")]
    with pytest.raises(FramingError):
        decoder.feed((2).to_bytes(4, "big") + bytes([kind]) + b"{}")


def test_structured_payload_is_parsed_strictly() -> None:
    assert Frame(FrameKind.CREDIT, b'{"bytes":1}').json() == {"bytes": 1}
    for payload in (b'{"bytes":1,"bytes":2}', b"[]", b'{"bytes":1} ', b"\xff"):
        with pytest.raises(ProtocolError):
            Frame(FrameKind.CREDIT, payload).json()


# --------------------------------------------------------------------------------------------
# DataWindow
# --------------------------------------------------------------------------------------------


def credit(count: object) -> Frame:
    return Frame(FrameKind.CREDIT, encode_compact({"bytes": count}))


def test_window_accounting() -> None:
    window = DataWindow()
    assert window.available_bytes == DATA_WINDOW_BYTES
    assert window.take(1000) == 1000
    assert window.take(DATA_WINDOW_BYTES) == DATA_WINDOW_BYTES - 1000  # only what is left
    assert window.take(1) == 0
    window.grant(credit(600))
    assert window.take(1000) == 600
    window.grant(FrameDecoder().feed(credit_frame(DATA_WINDOW_BYTES))[0])
    assert window.available_bytes == DATA_WINDOW_BYTES


@pytest.mark.parametrize("count", [0, -1, True, 1.5, "1", None, DATA_WINDOW_BYTES + 1])
def test_invalid_credit_is_refused(count: object) -> None:
    window = DataWindow()
    window.take(DATA_WINDOW_BYTES)
    with pytest.raises(FramingError):
        window.grant(credit(count))


def test_credit_without_a_count_is_refused() -> None:
    with pytest.raises(FramingError):
        DataWindow().grant(Frame(FrameKind.CREDIT, b"{}"))


def test_credit_beyond_what_was_taken_is_refused() -> None:
    window = DataWindow()
    window.take(100)
    window.grant(credit(100))
    with pytest.raises(FramingError):
        window.grant(credit(1))


# --------------------------------------------------------------------------------------------
# FramedConnection over a real socketpair
# --------------------------------------------------------------------------------------------


@pytest.fixture
def pair() -> Iterator[tuple[FramedConnection, FramePeer]]:
    ours, theirs = socket.socketpair()
    conn, peer = FramedConnection(ours), FramePeer(theirs)
    yield conn, peer
    conn.close()
    peer.close()


def flush_until_read(conn: FramedConnection, peer: FramePeer, count: int) -> list[Frame]:
    """Flush and read in turn until `count` frames arrived."""
    deadline = time.monotonic() + WAIT_S
    while len(peer.frames) < count:
        conn.flush()
        peer.receive_once(deadline)
        assert time.monotonic() < deadline and not peer.eof
    return [peer.frames.popleft() for _ in range(count)]


def test_structured_frames_jump_ahead_of_queued_terminal_bytes(pair) -> None:
    conn, peer = pair
    conn.send(encode_frame(FrameKind.OUTPUT, b"a"), urgent=False)
    conn.send(encode_frame(FrameKind.OUTPUT, b"b"), urgent=False)
    conn.send(encode_json_frame(FrameKind.EVENT, {"n": 1}))
    conn.send(encode_json_frame(FrameKind.OUTPUT_END, {"status": "drained"}), urgent=False)
    conn.send(encode_json_frame(FrameKind.EVENT, {"n": 2}))
    frames = flush_until_read(conn, peer, 5)
    assert [(f.kind, f.payload) for f in frames] == [
        (FrameKind.EVENT, b'{"n":1}'), (FrameKind.EVENT, b'{"n":2}'),
        (FrameKind.OUTPUT, b"a"), (FrameKind.OUTPUT, b"b"),
        (FrameKind.OUTPUT_END, b'{"status":"drained"}')]
    assert not conn.wants_write and conn.pending_bulk_bytes == 0


def test_structured_frame_never_splits_a_partly_written_frame() -> None:
    ours, theirs = socket.socketpair()
    for sock, option in ((ours, socket.SO_SNDBUF), (theirs, socket.SO_RCVBUF)):
        sock.setsockopt(socket.SOL_SOCKET, option, 64 * 1024)
    conn, peer = FramedConnection(ours), FramePeer(theirs)
    try:
        bulk = [bytes([n]) * (512 * 1024) for n in range(3)]
        for payload in bulk:
            conn.send(encode_frame(FrameKind.OUTPUT, payload), urgent=False)
        conn.flush()
        # The first frame is in flight, the other two untouched.
        assert conn.wants_write and conn.pending_bulk_bytes == 2 * (5 + len(bulk[0]))
        conn.send(encode_json_frame(FrameKind.EVENT, {"urgent": True}))
        frames = flush_until_read(conn, peer, 4)
        assert [f.payload for f in frames] == [bulk[0], b'{"urgent":true}', bulk[1], bulk[2]]
    finally:
        conn.close()
        peer.close()


def test_large_payload_flushes_completely_under_backpressure(pair) -> None:
    conn, peer = pair
    payloads = [bytes([n % 251]) * 65536 + n.to_bytes(4, "big") for n in range(128)]  # ~8 MiB
    for payload in payloads:
        conn.send(encode_frame(FrameKind.OUTPUT, payload), urgent=False)
    conn.flush()
    assert conn.wants_write  # the kernel took only part: this is backpressure

    received: list[Frame] = []
    reader = threading.Thread(target=lambda: received.extend(
        peer.next_frame() for _ in payloads))
    reader.start()
    try:
        assert conn.drain_blocking(time.monotonic() + WAIT_S)
    finally:
        reader.join(WAIT_S)
    assert not reader.is_alive()
    assert [f.payload for f in received] == payloads
    assert conn.pending_bulk_bytes == 0


def test_drain_gives_up_at_its_deadline(pair) -> None:
    conn, _peer = pair
    for _ in range(64):
        conn.send(encode_frame(FrameKind.OUTPUT, b"x" * 65536), urgent=False)
    assert not conn.drain_blocking(time.monotonic())  # a deadline already passed
    assert conn.wants_write


def receive_to_eof(conn: FramedConnection, frames: list[Frame]) -> None:
    """Receive into `frames` until the peer's end of stream (or an exception)."""
    while not conn.eof:
        assert select.select([conn], [], [], WAIT_S)[0]
        frames += conn.receive()


@pytest.mark.parametrize("tail, refused", [
    (encode_frame(FrameKind.OUTPUT, b"truncated")[:-1], True),  # inside a frame
    (encode_frame(FrameKind.OUTPUT, b"whole"), False),  # between frames: a clean end
])
def test_end_of_stream_is_refused_only_inside_a_frame(pair, tail: bytes, refused: bool) -> None:
    conn, peer = pair
    peer.sock.sendall(encode_frame(FrameKind.EVENT, b'{"n":1}') + tail)
    peer.sock.shutdown(socket.SHUT_WR)
    frames: list[Frame] = []
    if refused:
        with pytest.raises(FramingError):
            receive_to_eof(conn, frames)
    else:
        receive_to_eof(conn, frames)
    assert frames == [Frame(FrameKind.EVENT, b'{"n":1}')] + (
        [] if refused else [Frame(FrameKind.OUTPUT, b"whole")])


def test_flush_to_a_closed_peer_raises(pair) -> None:
    conn, peer = pair
    peer.close()
    conn.send(encode_frame(FrameKind.OUTPUT, b"nobody"))
    with pytest.raises(OSError):
        conn.flush()
    conn.close()
    conn.close()  # idempotent
