"""The host's check of what the broker hands over as the attachment (reploy.attachment_socket):
exactly one descriptor, a connected unix stream socket whose peer runs as the controller's
uid:gid. Everything else is refused, and every descriptor it was given is closed. No Docker;
real sockets, pipes and files. (test_controlled_session_failures.py runs a broker that hands
over the wrong things to a real session, which then fails closed.)"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from typing import Callable, Iterator

import pytest

import reploy
from test_framing import closed_at_the_other_end

OWN = (os.getuid(), os.getgid())


@pytest.fixture
def far_ends() -> Iterator[list[socket.socket]]:
    ends: list[socket.socket] = []
    yield ends
    for sock in ends:
        sock.close()


def stream_connection(far_ends: list[socket.socket]) -> int:
    """The broker's side of an accepted attachment, as a descriptor; its peer in far_ends."""
    with tempfile.TemporaryDirectory(prefix="ra-") as directory:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with listener:
            listener.bind(os.path.join(directory, "terminal.sock"))
            listener.listen(1)
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.connect(os.path.join(directory, "terminal.sock"))
            far_ends.append(client)
            accepted, _ = listener.accept()
    return accepted.detach()


def is_closed(descriptor: int) -> bool:
    try:
        fcntl.fcntl(descriptor, fcntl.F_GETFD)
    except OSError:
        return True
    return False


def test_a_connected_stream_unix_socket_is_accepted(far_ends) -> None:
    sock = reploy.attachment_socket((stream_connection(far_ends),), *OWN)
    with sock:
        assert (sock.family, sock.type) == (socket.AF_UNIX, socket.SOCK_STREAM)
        sock.sendall(b"to the attachment")
        assert far_ends[0].recv(64) == b"to the attachment"


def socketpair_end(far_ends: list[socket.socket], kind: int) -> int:
    near, far = socket.socketpair(socket.AF_UNIX, kind)
    far_ends.append(far)
    return near.detach()


def tcp_connection(far_ends: list[socket.socket]) -> int:
    """A connected TCP socket on loopback, to a listener of the test's own."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
    far_ends.append(accepted)
    return client.detach()


def listening_socket(far_ends: list[socket.socket]) -> int:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0reploy-test-" + os.urandom(8).hex())  # abstract: no file to clean up
    listener.listen(1)
    return listener.detach()


def unconnected_socket(far_ends: list[socket.socket]) -> int:
    return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).detach()


REFUSED: dict[str, tuple[Callable[[list[socket.socket]], int], str]] = {
    "a datagram socket": (lambda ends: socketpair_end(ends, socket.SOCK_DGRAM),
                          "not a stream socket"),
    "a seqpacket socket": (lambda ends: socketpair_end(ends, socket.SOCK_SEQPACKET),
                           "not a stream socket"),
    "a TCP connection": (tcp_connection, "not a unix socket"),
    "a listening socket": (listening_socket, "a listening socket"),
    "an unconnected socket": (unconnected_socket, "not a connected socket"),
}


@pytest.mark.parametrize("what", REFUSED)
def test_a_socket_of_the_wrong_kind_is_refused_and_closed(far_ends, what: str) -> None:
    make, reason = REFUSED[what]
    descriptor = make(far_ends)
    with pytest.raises(reploy.AttachmentRefused, match=reason):
        reploy.attachment_socket((descriptor,), *OWN)
    assert is_closed(descriptor)


@pytest.mark.parametrize("kind", ["pipe", "file"])
def test_a_descriptor_that_is_no_socket_is_refused_and_closed(kind: str, tmp_path) -> None:
    if kind == "pipe":
        descriptor, write_end = os.pipe()
    else:
        descriptor = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    with pytest.raises(reploy.AttachmentRefused, match="not a socket"):
        reploy.attachment_socket((descriptor,), *OWN)
    assert is_closed(descriptor)
    if kind == "pipe":
        with pytest.raises(BrokenPipeError):  # no read end is left open anywhere
            os.write(write_end, b"x")
        os.close(write_end)


@pytest.mark.parametrize("count", [0, 2, 3])
def test_anything_but_exactly_one_descriptor_is_refused_and_all_are_closed(far_ends,
                                                                           count: int) -> None:
    descriptors = tuple(stream_connection(far_ends) for _ in range(count))
    with pytest.raises(reploy.AttachmentRefused, match=f"{count} descriptors instead of one"):
        reploy.attachment_socket(descriptors, *OWN)
    assert all(closed_at_the_other_end(far) for far in far_ends)


def test_a_peer_of_another_uid_or_gid_is_refused_and_closed(far_ends) -> None:
    uid, gid = OWN
    for expected in ((uid + 1, gid), (uid, gid + 1)):
        with pytest.raises(reploy.AttachmentRefused, match=f"its peer runs as {uid}:{gid}"):
            reploy.attachment_socket((stream_connection(far_ends),), *expected)
    assert all(closed_at_the_other_end(far) for far in far_ends)
