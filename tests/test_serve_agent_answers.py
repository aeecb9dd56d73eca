"""serve's client of the agent's control socket (reploy_serve.py, agent_call) against peers
that are not a well-behaved agent: a symlink in the socket's place, answers that are not a
response, a peer that trickles bytes. Real unix sockets, no Docker.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

import reploy_serve
from test_container_paths import CanarySocket, box, canary_socket  # noqa: F401  (fixtures)


def test_agent_call_through_a_symlinked_control_socket_fails_and_never_connects(
        box: Path, canary_socket: CanarySocket) -> None:
    (box / "control.sock").symlink_to(canary_socket.path)
    with pytest.raises(reploy_serve.AgentCallError, match="control.sock is a symlink, not a socket") as raised:
        reploy_serve.agent_call(box, "status", {})
    assert raised.value.transport
    assert canary_socket.connections() == 0



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
                connection.sendall(self.answer)
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


@pytest.mark.parametrize("answer", [
    b"[]\n", b"5\n", b'"result"\n', b'{"id":"serve","result":[]}\n', b'{"id":"serve","result":null}\n',
    b'{"id":"serve","error":"boom"}\n', b'{"id":"serve"}\n', b"[" * 100_000 + b"\n", b"not json\n",
])
def test_an_answer_that_is_not_a_response_is_an_agent_call_error(box: Path, answer: bytes) -> None:
    fake = FakeAgent(box, answer)
    try:
        with pytest.raises(reploy_serve.AgentCallError) as raised:
            reploy_serve.agent_call(box, "status", {})
        assert raised.value.code == "server_unavailable"
    finally:
        fake.close()


def test_a_well_formed_error_answer_keeps_its_code(box: Path) -> None:
    fake = FakeAgent(box, b'{"id":"serve","error":{"code":"command_error","message":"no"}}\n')
    try:
        with pytest.raises(reploy_serve.AgentCallError, match="no") as raised:
            reploy_serve.agent_call(box, "status", {})
        assert raised.value.code == "command_error" and not raised.value.transport
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
