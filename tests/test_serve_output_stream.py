"""An SSE stream's connection as serve's two writers share it (OutputStream), and the follower's
delivery to a session's streams (OutputFollower.deliver): pushed without blocking where a
socket is free, a stream's own thread woken for everything else, the bytes in order either
way. Real unix socket pairs, no Docker."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from reploy_serve import (SSE_CHUNK_BYTES, FanoutStep, OutputFollower, OutputStream, http_chunk,
                          sse_output)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(serve's end, with a timeout as a stream's has; the client's end)."""
    ours, theirs = socket.socketpair()
    ours.settimeout(5.0)
    theirs.settimeout(5.0)
    try:
        yield ours, theirs
    finally:
        ours.close()
        theirs.close()


def chunked(data: bytes) -> bytes:
    """An HTTP/1.1 chunk, written here from the rule (size in hex, CRLF, data, CRLF)."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def receive(sock: socket.socket, count: int) -> bytes:
    got = bytearray()
    while len(got) < count:
        piece = sock.recv(count - len(got))
        assert piece, f"the stream ended after {len(got)} of {count} bytes"
        got += piece
    return bytes(got)


def stream_of(sock: socket.socket) -> OutputStream:
    return OutputStream(sock, lambda data: http_chunk(data, chunked=True))


def test_the_framing_is_one_chunk_per_piece_and_no_chunk_for_no_bytes() -> None:
    assert http_chunk(b"hello", chunked=True) == chunked(b"hello")
    assert http_chunk(b"", chunked=True) == b""  # an empty chunk would end the body
    assert http_chunk(b"hello", chunked=False) == b"hello"


def test_a_socket_without_a_timeout_is_refused_for_it_would_block_the_follower() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs, pytest.raises(ValueError, match="timeout"):
        stream_of(ours)


def test_a_push_the_socket_takes_whole_goes_out_at_once(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    stream = stream_of(ours)
    with stream.lock:
        assert stream.push(b"event one")
    assert receive(theirs, len(chunked(b"event one"))) == chunked(b"event one")


def test_what_a_full_socket_left_of_a_push_goes_first_when_the_stream_sends(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    stream = stream_of(ours)
    big, small = bytes(range(256)) * 4096, b"after it"
    with stream.lock:
        assert not stream.push(big)  # never blocks: most of it is left
    expected = chunked(big) + chunked(small)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(receive(theirs, len(expected))))
    reader.start()
    stream.send(small)  # the stream's thread: the push's rest, then its own
    reader.join()
    assert got == [expected]


def test_a_push_to_a_client_gone_raises_nothing_and_the_streams_own_send_fails(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    stream = stream_of(ours)
    theirs.close()
    with stream.lock:
        assert not stream.push(b"to nobody")
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        stream.send(b"")


def follower_with(streams: list[OutputStream], cursor: int) -> tuple[OutputFollower, list[int]]:
    follower = OutputFollower("s", text=False)
    follower.fanout.feed(cursor, b"", 0.0)  # the follower's first look: the log's end
    readers = []
    for stream in streams:
        reader = follower.fanout.join(cursor, 0.0)
        follower.streams[reader] = stream
        readers.append(reader)
    return follower, readers


@contextlib.contextmanager
def held_by_its_thread(stream: OutputStream) -> Iterator[None]:
    """The stream's lock held by another thread (its own, taking and sending), for the block."""
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with stream.lock:
            holding.set()
            done.wait()

    thread = threading.Thread(target=hold)
    thread.start()
    holding.wait()
    try:
        yield
    finally:
        done.set()
        thread.join()


def test_deliver_pushes_to_a_free_stream_and_wakes_the_one_whose_thread_is_taking() -> None:
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        for ours, theirs in pairs:
            ours.settimeout(5.0)
            theirs.setblocking(False)
        free, busy = (stream_of(ours) for ours, _ in pairs)
        follower, (free_reader, busy_reader) = follower_with([free, busy], 10)
        follower.fanout.feed(15, b"hello", 0.0)
        with held_by_its_thread(busy):  # between its own take and send: no push may come between
            follower.deliver(0.0)
        event = chunked(sse_output(10, b"hello"))
        pairs[0][1].setblocking(True)
        assert receive(pairs[0][1], len(event)) == event
        with pytest.raises(BlockingIOError):
            pairs[1][1].recv(1)  # nothing pushed to the busy one
        assert not free.woken.is_set()  # pushed: its thread sleeps on
        assert busy.woken.is_set()  # it takes for itself
        assert follower.fanout.next_step(free_reader) is FanoutStep.WAIT
        assert follower.fanout.next_step(busy_reader) is FanoutStep.OUTPUT
    finally:
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


def test_deliver_wakes_a_stream_with_more_than_one_event_to_take_and_leaves_caught_up_ones(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    behind, caught_up = stream_of(ours), stream_of(ours)
    follower, (behind_reader, caught_up_reader) = follower_with([behind, caught_up], 0)
    data = b"x" * (SSE_CHUNK_BYTES + 1)
    follower.fanout.feed(len(data), data, 0.0)
    follower.fanout.take(caught_up_reader, 0.0)
    follower.fanout.take(caught_up_reader, 0.0)  # it took both events itself
    follower.deliver(0.0)
    event = chunked(sse_output(0, data[:SSE_CHUNK_BYTES]))
    assert receive(theirs, len(event)) == event
    assert behind.woken.is_set()  # the last byte is its to take
    assert not caught_up.woken.is_set()
    assert follower.fanout.next_step(behind_reader) is FanoutStep.OUTPUT


def test_deliver_never_pushes_past_the_rest_of_a_push_that_a_full_socket_left(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    stream = stream_of(ours)
    follower, (reader,) = follower_with([stream], 0)
    first, second = b"a" * SSE_CHUNK_BYTES, b"b" * 100
    follower.fanout.feed(len(first), first, 0.0)
    follower.deliver(0.0)
    assert stream.has_unsent and stream.woken.is_set()  # the socket took part of it
    stream.woken.clear()
    follower.fanout.feed(len(first) + len(second), second, 0.0)
    follower.deliver(0.0)  # must not write the next event behind the rest, nor queue it
    assert stream.woken.is_set()
    assert follower.fanout.next_step(reader) is FanoutStep.OUTPUT  # left for the stream's thread
    expected = chunked(sse_output(0, first)) + chunked(sse_output(len(first), second))
    got: list[bytes] = []
    client = threading.Thread(target=lambda: got.append(receive(theirs, len(expected))))
    client.start()
    with stream.lock:  # the stream's thread: its take and its send
        take = follower.fanout.take(reader, 0.0)
        stream.send(follower.output_event(take.offset, take.data))
    client.join()
    assert got == [expected]


def test_an_ended_follower_wakes_every_stream(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, _ = pair
    streams = [stream_of(ours), stream_of(ours)]
    follower, readers = follower_with(streams, 0)
    follower.end()
    assert all(stream.woken.is_set() for stream in streams)
    assert {follower.fanout.next_step(reader) for reader in readers} == {FanoutStep.ENDED}


def test_settling_waits_out_a_push_under_way_so_the_socket_can_close_after(
        pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    stream = stream_of(ours)
    pushing, settled = threading.Event(), threading.Event()
    order: list[str] = []

    def follower_pushing() -> None:
        with stream.lock:
            pushing.set()
            # A settle that did not wait would be done well within this: it must not be.
            order.append("settled during the push" if settled.wait(0.5) else "pushed")
            stream.push(b"last")

    follower = threading.Thread(target=follower_pushing)
    follower.start()
    pushing.wait()
    stream.settle()
    settled.set()
    follower.join()
    assert order == ["pushed"]
    assert receive(theirs, len(chunked(b"last"))) == chunked(b"last")
