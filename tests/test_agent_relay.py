"""The agent's byte relay (agent.splice) and ModelRelay on top of it: loopback TCP in, a unix socket out, as in a claude-code session's
container. No Docker: real sockets, a unix listener of the test's own stands in for serve's
proxy beyond DIR/agent/model.sock."""

from __future__ import annotations

import contextlib
import hashlib
import socket
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import agent  # noqa: E402
import reploy_serve as rs  # noqa: E402

WAIT_S = 60.0  #: generous: a loaded machine; nothing here measures time
FLOOD_BYTES = 8 * agent.MIB + 12345  #: many socket buffers' worth, not a multiple of any buffer size


def flood(size: int, seed: bytes) -> bytes:
    """Bytes that differ along their length, so a lost, doubled or reordered piece shows."""
    blocks = (hashlib.sha256(seed + index.to_bytes(8, "big")).digest() for index in range(size // 32 + 1))
    return b"".join(blocks)[:size]


def read_all(sock: socket.socket, piece: int = agent.RECV_BYTES) -> bytes:
    sock.settimeout(WAIT_S)
    parts = []
    while chunk := sock.recv(piece):
        parts.append(chunk)
    return b"".join(parts)


def in_thread(work: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(work()), daemon=True)
    thread.start()
    return thread, result


def send_until_closed(sock: socket.socket, data: bytes) -> None:
    """sendall, ended by the test closing the socket under it."""
    with contextlib.suppress(OSError):
        sock.sendall(data)


@pytest.fixture
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(the relay's side, the client's side) of one loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname(), timeout=WAIT_S)
        accepted, _ = server.accept()
    with accepted, client:
        yield accepted, client


def test_a_flood_crosses_both_ways_intact_and_is_counted(tcp_pair: tuple[socket.socket, socket.socket]) -> None:
    relay_tcp, client = tcp_pair
    relay_unix, proxy = socket.socketpair()
    with relay_unix, proxy:
        down, up = flood(FLOOD_BYTES, b"down"), flood(FLOOD_BYTES // 3, b"up")
        relay, counts = in_thread(lambda: agent.splice(relay_tcp, relay_unix))
        senders = [in_thread(lambda: (client.sendall(up), client.shutdown(socket.SHUT_WR))),
                   in_thread(lambda: (proxy.sendall(down), proxy.shutdown(socket.SHUT_WR)))]
        received_by_proxy, reader = [], threading.Thread(target=lambda: received_by_proxy.append(read_all(proxy)))
        reader.start()
        assert read_all(client) == down
        reader.join(WAIT_S)
        relay.join(WAIT_S)
        for thread, _ in senders:
            thread.join(WAIT_S)
    assert received_by_proxy == [up]
    assert counts == [agent.Spliced(len(up), len(down))]


def test_a_half_close_is_passed_on_and_the_answer_still_comes_back(
        tcp_pair: tuple[socket.socket, socket.socket]) -> None:
    relay_tcp, client = tcp_pair
    relay_unix, proxy = socket.socketpair()
    with relay_unix, proxy:
        relay, counts = in_thread(lambda: agent.splice(relay_tcp, relay_unix))
        client.sendall(b"request")
        client.shutdown(socket.SHUT_WR)
        assert read_all(proxy) == b"request"  # the end of the request arrived as an end
        proxy.sendall(b"answer")
        proxy.close()
        assert read_all(client) == b"answer"
        relay.join(WAIT_S)
    assert counts == [agent.Spliced(len(b"request"), len(b"answer"))]


def test_a_slow_reader_behind_a_socket_with_a_timeout_gets_every_byte(
        tcp_pair: tuple[socket.socket, socket.socket]) -> None:
    """A socket with a timeout (non-blocking underneath): the relay waits while its peer's buffer is full instead
    of dropping or failing what does not fit."""
    relay_tcp, client = tcp_pair
    relay_unix, proxy = socket.socketpair()
    with relay_unix, proxy:
        relay_tcp.settimeout(WAIT_S)
        relay_unix.settimeout(WAIT_S)
        down = flood(FLOOD_BYTES, b"slow")
        relay, counts = in_thread(lambda: agent.splice(relay_tcp, relay_unix))
        sender, _ = in_thread(lambda: (proxy.sendall(down), proxy.shutdown(socket.SHUT_WR)))
        client.shutdown(socket.SHUT_WR)
        assert read_all(client, piece=4096) == down
        relay.join(WAIT_S)
        sender.join(WAIT_S)
    assert counts == [agent.Spliced(0, len(down))]


def test_a_relay_idle_past_its_bound_ends(tcp_pair: tuple[socket.socket, socket.socket]) -> None:
    relay_tcp, _ = tcp_pair
    relay_unix, proxy = socket.socketpair()
    with relay_unix, proxy:
        relay, counts = in_thread(lambda: agent.splice(relay_tcp, relay_unix, idle_timeout_s=0.2))
        relay.join(WAIT_S)
    assert counts == [agent.Spliced(0, 0, idle=True)]  # neither side sent a byte: it ended on its own


@pytest.mark.parametrize("stalled", ["tcp", "unix"])
def test_a_peer_that_stops_reading_cannot_hold_the_splice_past_its_idle_bound(
        tcp_pair: tuple[socket.socket, socket.socket], stalled: str) -> None:
    """Issue 42: one side floods, the other never reads. The splice's sends fill that side's buffers and then stop
    moving: the splice must not wait in a send, so its idle bound ends it (before, `sendall` held it until the
    reader went away)."""
    relay_tcp, client = tcp_pair
    relay_unix, proxy = socket.socketpair()
    with relay_unix, proxy:
        for sock in (relay_tcp, client, relay_unix, proxy):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        flooder = proxy if stalled == "tcp" else client
        relay, counts = in_thread(lambda: agent.splice(relay_tcp, relay_unix, idle_timeout_s=0.5))
        in_thread(lambda: send_until_closed(flooder, flood(FLOOD_BYTES, b"never read")))
        relay.join(WAIT_S)
        assert not relay.is_alive(), "the splice is still waiting on a peer that does not read"
        flooder.close()  # the flooder's own sendall ends with an error now
    [spliced] = counts
    assert isinstance(spliced, agent.Spliced) and spliced.idle
    assert 0 < spliced.one_to_other + spliced.other_to_one < FLOOD_BYTES


def test_the_relay_outlasts_every_silence_serves_proxies_keep() -> None:
    assert max(rs.EGRESS_IDLE_TIMEOUT_S, rs.MODEL_IDLE_TIMEOUT_S) < agent.RELAY_IDLE_TIMEOUT_S


def test_the_model_relay_carries_a_whole_answer_from_the_unix_socket_to_loopback(tmp_path: Path) -> None:
    """ModelRelay as the session runs it: a connection to its loopback port reaches DIR/agent/model.sock, the
    request goes there whole and the answer comes back whole."""
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir(mode=0o700)
    answer = flood(FLOOD_BYTES, b"answer")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(agent_dir / agent.MODEL_SOCKET_NAME))
    listener.listen(1)
    requests: list[bytes] = []

    def proxy() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(WAIT_S)
            requests.append(conn.recv(agent.RECV_BYTES))
            conn.sendall(answer)

    relay = agent.ModelRelay(agent_dir, 0)
    try:
        server, _ = in_thread(proxy)
        with socket.create_connection(relay.sock.getsockname(), timeout=WAIT_S) as cli:
            cli.sendall(b"POST /v1/messages HTTP/1.1\r\n\r\n")
            assert read_all(cli) == answer
        server.join(WAIT_S)
    finally:
        relay.close()
        listener.close()
    assert requests == [b"POST /v1/messages HTTP/1.1\r\n\r\n"]
