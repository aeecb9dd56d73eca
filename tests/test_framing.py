"""The private framing: FrameDecoder, and FramedConnection over real sockets, descriptors
passed with frames (SCM_RIGHTS) included.

Also home of FramePeer, the test's own end of a framed socket, which test_broker.py,
test_attach.py and test_terminal_relay.py use to play the host, the broker and the attachment.
"""

from __future__ import annotations

import array
import collections
import os
import select
import socket
import threading
import time
from typing import Iterator

import pytest

from reploy_session_client import (
    MAX_FRAME_PAYLOAD_BYTES, MAX_RECEIVED_DESCRIPTORS, Frame, FrameDecoder, FrameKind,
    FramedConnection, FramingError, Message, ProtocolError, encode_compact, encode_frame,
    encode_json_frame,
)

#: The bound on every wait in these tests. Reached only when the code under test is broken.
WAIT_S = 10.0


class FramePeer:
    """The test's end of a framed connection: blocking writes, reads bounded by a deadline.
    Descriptors that arrive are collected in `descriptors`, in order, for the test to judge."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self.sock = sock
        self.decoder = FrameDecoder()
        self.frames: collections.deque[Frame] = collections.deque()
        self.descriptors: list[int] = []
        self.eof = False

    def send(self, kind: FrameKind, payload: bytes = b"") -> None:
        self.sock.sendall(encode_frame(kind, payload))

    def send_with_descriptors(self, data: bytes, descriptors: list[int]) -> None:
        """Raw bytes (a frame, or part of one) carrying descriptors, in one sendmsg."""
        assert socket.send_fds(self.sock, [data], descriptors) == len(data)

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
            data, ancillary, _, _ = self.sock.recvmsg(
                1 << 20, socket.CMSG_SPACE(MAX_RECEIVED_DESCRIPTORS * 4))
        except ConnectionResetError:
            data, ancillary = b"", []
        for _, _, cmsg in ancillary:
            self.descriptors += array.array("i", cmsg[:len(cmsg) - len(cmsg) % 4])
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
        for descriptor in self.descriptors:
            os.close(descriptor)
        self.descriptors.clear()


def closed_at_the_other_end(sock: socket.socket) -> bool:
    """True when every copy of the socket paired with `sock` is closed: `sock` reads end of
    file (within WAIT_S). How the tests see that a descriptor passed around was closed."""
    if not select.select([sock], [], [], WAIT_S)[0]:
        return False
    return sock.recv(1) == b""


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
    assert Frame(FrameKind.RESIZE, b'{"rows":1}').json() == {"rows": 1}
    for payload in (b'{"rows":1,"rows":2}', b"[]", b'{"rows":1} ', b"\xff"):
        with pytest.raises(ProtocolError):
            Frame(FrameKind.RESIZE, payload).json()


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


# --------------------------------------------------------------------------------------------
# FramedConnection: descriptors passed with frames
# --------------------------------------------------------------------------------------------

ATTACHED_FRAME = encode_json_frame(FrameKind.ATTACHED, {})
REQUEST_FRAME = encode_frame(FrameKind.REQUEST, b'{"schema":"s","type":"terminate"}')


@pytest.fixture
def receiver() -> Iterator[tuple[FramedConnection, FramePeer]]:
    """A connection that accepts descriptors with ATTACHED frames (the host's channel), and
    the test's end of it."""
    ours, theirs = socket.socketpair()
    conn = FramedConnection(ours, descriptor_kinds=frozenset({FrameKind.ATTACHED}))
    peer = FramePeer(theirs)
    yield conn, peer
    conn.close()
    peer.close()


@pytest.fixture
def passed() -> Iterator[list[socket.socket]]:
    """make() -> the far end of a new socketpair, whose near end the test passes around (and
    closes its own copy of): the far end sees end of file once every copy is closed."""
    far_ends: list[socket.socket] = []
    yield far_ends
    for sock in far_ends:
        sock.close()


def passable(far_ends: list[socket.socket]) -> int:
    """A descriptor to pass: the near end of a socketpair (detached: the caller owns it)."""
    near, far = socket.socketpair()
    far_ends.append(far)
    return near.detach()


def receive_frames(conn: FramedConnection, count: int) -> list[Frame]:
    frames: list[Frame] = []
    deadline = time.monotonic() + WAIT_S
    while len(frames) < count:
        assert select.select([conn], [], [], deadline - time.monotonic())[0], "no frame came"
        frames += conn.receive()
        assert not conn.eof
    return frames


def receive_until_refused(conn: FramedConnection) -> FramingError:
    deadline = time.monotonic() + WAIT_S
    while True:
        assert select.select([conn], [], [], deadline - time.monotonic())[0], "nothing came"
        try:
            conn.receive()
        except FramingError as e:
            return e
        assert not conn.eof, "the stream ended without a refusal"


def test_a_handed_over_descriptor_arrives_and_the_senders_copy_is_closed(pair, passed) -> None:
    conn, peer = pair
    conn.hand_over(ATTACHED_FRAME, (passable(passed),))
    (frame,) = flush_until_read(conn, peer, 1)
    assert (frame.kind, frame.payload) == (FrameKind.ATTACHED, b"{}")
    assert len(peer.descriptors) == 1
    received = socket.socket(fileno=peer.descriptors.pop())
    received.sendall(b"through")
    assert passed[0].recv(7) == b"through"  # the very socket that was passed
    received.close()
    assert closed_at_the_other_end(passed[0])  # the sender kept no copy


def test_closing_a_connection_closes_descriptors_it_never_sent(pair, passed) -> None:
    conn, _peer = pair
    conn.send(encode_frame(FrameKind.OUTPUT, b"x" * (1 << 20)), urgent=False)
    conn.hand_over(ATTACHED_FRAME, (passable(passed),))
    conn.close()  # nothing was flushed
    assert closed_at_the_other_end(passed[0])


def test_descriptors_belong_to_the_frame_they_came_with(receiver, passed) -> None:
    conn, peer = receiver
    peer.send_with_descriptors(REQUEST_FRAME, [])
    near = passable(passed)
    peer.send_with_descriptors(ATTACHED_FRAME, [near])
    os.close(near)
    request, attached = receive_frames(conn, 2)
    assert request.kind is FrameKind.REQUEST and request.descriptors == ()
    assert attached.kind is FrameKind.ATTACHED and len(attached.descriptors) == 1
    os.close(attached.descriptors[0])
    assert closed_at_the_other_end(passed[0])


@pytest.mark.parametrize("cut", range(1, len(ATTACHED_FRAME)))
def test_a_descriptor_sent_with_part_of_a_frame_belongs_to_that_frame(receiver, passed,
                                                                     cut: int) -> None:
    conn, peer = receiver
    near = passable(passed)
    peer.send_with_descriptors(ATTACHED_FRAME[:cut], [near])
    os.close(near)
    assert conn.receive() == []  # the frame is not complete: its descriptor waits with it
    peer.send_with_descriptors(ATTACHED_FRAME[cut:] + REQUEST_FRAME, [])
    attached, request = receive_frames(conn, 2)
    assert len(attached.descriptors) == 1 and request.descriptors == ()
    os.close(attached.descriptors[0])
    assert closed_at_the_other_end(passed[0])


def test_two_descriptors_with_one_frame_both_reach_the_receiver(receiver, passed) -> None:
    """The frame carries both: judging how many an ATTACHED may carry is the host's part
    (test_attachment_check.py), and it closes them."""
    conn, peer = receiver
    nears = [passable(passed), passable(passed)]
    peer.send_with_descriptors(ATTACHED_FRAME, nears)
    for near in nears:
        os.close(near)
    (attached,) = receive_frames(conn, 1)
    assert len(attached.descriptors) == 2
    for descriptor in attached.descriptors:
        os.close(descriptor)
    assert all(closed_at_the_other_end(far) for far in passed)


REFUSALS = {
    # A descriptor smuggled in with a frame that may not carry one.
    "with a REQUEST": lambda peer, fds: peer.send_with_descriptors(REQUEST_FRAME, fds),
    "with OUTPUT": lambda peer, fds: peer.send_with_descriptors(
        encode_frame(FrameKind.OUTPUT, b"hostile"), fds),
    # A descriptor whose frame never completes: the stream ends first.
    "with no frame": lambda peer, fds: (peer.send_with_descriptors(ATTACHED_FRAME[:3], fds),
                                        peer.sock.shutdown(socket.SHUT_WR)),
    # More than one read makes room for: the kernel truncates, we refuse the lot.
    "too many at once": lambda peer, fds: peer.send_with_descriptors(ATTACHED_FRAME, fds),
}


@pytest.mark.parametrize("how", REFUSALS)
def test_a_misplaced_descriptor_is_refused_and_closed(receiver, passed, how: str) -> None:
    conn, peer = receiver
    count = MAX_RECEIVED_DESCRIPTORS + 1 if how == "too many at once" else 1
    nears = [passable(passed) for _ in range(count)]
    REFUSALS[how](peer, nears)
    for near in nears:
        os.close(near)
    receive_until_refused(conn)
    assert all(closed_at_the_other_end(far) for far in passed)


def test_a_connection_without_descriptor_kinds_refuses_any_descriptor(pair, passed) -> None:
    """The attachment's side and the broker's: nothing may hand them a descriptor."""
    conn, peer = pair
    near = passable(passed)
    peer.send_with_descriptors(ATTACHED_FRAME, [near])
    os.close(near)
    error = receive_until_refused(conn)
    assert "ATTACHED" in error.message
    assert closed_at_the_other_end(passed[0])


def test_received_descriptors_are_close_on_exec(receiver, passed) -> None:
    conn, peer = receiver
    near = passable(passed)
    peer.send_with_descriptors(ATTACHED_FRAME, [near])
    os.close(near)
    (attached,) = receive_frames(conn, 1)
    assert not os.get_inheritable(attached.descriptors[0])
    os.close(attached.descriptors[0])
