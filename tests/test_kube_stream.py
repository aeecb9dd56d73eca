"""reploy_kube's I/O against a peer on loopback TLS that behaves as the apiserver cannot be made to: a Status for each
refusal, a trickle, an oversized answer; an exec stream that pings, fragments, answers out of order, sends garbage or
drops. The real apiserver's side is in test_kube_session.py."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import reploy_kube as kube  # noqa: E402

DEADLINE_S = 15.0


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed CA certificate for 127.0.0.1 and its key."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=reploy-test",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-addext", "basicConstraints=critical,CA:TRUE"],
                   check=True, capture_output=True)
    return cert, key


class Peer:
    """A TLS listener on loopback; each connection is handed to `handler` in a thread of its own."""

    def __init__(self, certificate: tuple[Path, Path], handler: Callable[[ssl.SSLSocket], None]) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(*certificate)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.handler = handler
        self.connections = 0
        self.threads: list[threading.Thread] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            thread = threading.Thread(target=self._serve, args=(raw,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, raw: socket.socket) -> None:
        raw.settimeout(DEADLINE_S)
        try:
            with self.context.wrap_socket(raw, server_side=True) as conn:
                self.handler(conn)
        except (OSError, ssl.SSLError):
            pass  # the client went away: what the test checks is on its side

    def api(self, certificate: tuple[Path, Path], deadline_s: float = kube.API_DEADLINE_S) -> kube.KubeApi:
        access = kube.ClusterAccess(server=f"https://127.0.0.1:{self.port}", ca=certificate[0], token="secret")
        return kube.KubeApi(access, deadline_s)

    def close(self) -> None:
        self.listener.close()
        for thread in self.threads:
            thread.join(DEADLINE_S)


@pytest.fixture
def peer(certificate) -> Iterator[Callable[[Callable[[ssl.SSLSocket], None]], Peer]]:
    peers: list[Peer] = []

    def start(handler: Callable[[ssl.SSLSocket], None]) -> Peer:
        peers.append(Peer(certificate, handler))
        return peers[-1]

    yield start
    for p in peers:
        p.close()


def read_head(conn: ssl.SSLSocket) -> tuple[str, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head.decode(), rest


def http_answer(status: str, body: bytes, extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}"
            f"Connection: close\r\n\r\n").encode() + body


# ---------------------------------------------------------------------------------------------------------------------
# REST


def test_a_request_is_verified_authenticated_and_parsed(peer, certificate):
    seen: list[str] = []

    def handler(conn: ssl.SSLSocket) -> None:
        head, _ = read_head(conn)
        seen.append(head)
        conn.sendall(http_answer("200 OK", b'{"kind":"PodList","items":[{"metadata":{"name":"p"}}]}'))

    server = peer(handler)
    items = server.api(certificate).list(kube.Resource.PODS, "ns", {"io.reploy.serve": "a"})
    assert items == [{"metadata": {"name": "p"}}]
    assert seen[0].startswith("GET /api/v1/namespaces/ns/pods?labelSelector=io.reploy.serve%3Da HTTP/1.1")
    assert "\r\nAuthorization: Bearer secret" in seen[0] + "\r\n"


def test_a_conflict_is_its_own_exception(peer, certificate):
    status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict", "code": 409,
              "message": "the object has been modified"}
    server = peer(lambda conn: (read_head(conn), conn.sendall(http_answer("409 Conflict",
                                                                          json.dumps(status).encode()))))
    with pytest.raises(kube.KubeConflict, match="has been modified"):
        server.api(certificate).replace(kube.Resource.CONFIG_MAPS, "ns",
                                        {"metadata": {"name": "c", "resourceVersion": "7"}})
    with pytest.raises(ValueError, match="resourceVersion"):
        server.api(certificate).replace(kube.Resource.CONFIG_MAPS, "ns", {"metadata": {"name": "c"}})


def test_a_trickling_answer_meets_the_whole_call_deadline(peer, certificate):
    stop = threading.Event()

    def handler(conn: ssl.SSLSocket) -> None:
        read_head(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while not stop.wait(0.1):  # a byte every 0.1 s: each read's own timeout would never fire
            conn.sendall(b" ")

    server = peer(handler)
    started = time.monotonic()
    with pytest.raises(kube.KubeTransportError, match="the deadline passed"):
        server.api(certificate, deadline_s=1.0).get(kube.Resource.PODS, "ns", "p")
    stop.set()
    assert time.monotonic() - started < DEADLINE_S


def test_an_oversized_answer_is_refused_before_it_is_read(peer, certificate):
    server = peer(lambda conn: (read_head(conn), conn.sendall(
        f"HTTP/1.1 200 OK\r\nContent-Length: {kube.API_MAX_RESPONSE_BYTES + 1}\r\n\r\n".encode())))
    with pytest.raises(kube.KubeTransportError, match="is refused"):
        server.api(certificate).get(kube.Resource.PODS, "ns", "p")


def test_an_untrusted_server_is_refused(peer, certificate, tmp_path):
    server = peer(lambda conn: None)
    other = tmp_path / "other.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(tmp_path / "k"), "-out", str(other), "-days", "1", "-subj", "/CN=other"],
                   check=True, capture_output=True)
    api = kube.KubeApi(kube.ClusterAccess(server=f"https://127.0.0.1:{server.port}", ca=other, token="t"))
    with pytest.raises(kube.KubeTransportError, match="TLS .* failed"):
        api.get(kube.Resource.PODS, "ns", "p")


# ---------------------------------------------------------------------------------------------------------------------
# The exec stream and the agent channel


def send(conn: ssl.SSLSocket, channel: kube.Channel, data: bytes, fragments: int = 1) -> None:
    payload = kube.channel_message(channel, data)
    size = max(1, -(-len(payload) // fragments))
    pieces = [payload[i:i + size] for i in range(0, len(payload), size)]
    for index, piece in enumerate(pieces):
        opcode = kube.Opcode.BINARY if index == 0 else kube.Opcode.CONTINUATION
        conn.sendall(kube.encode_frame(opcode, piece, None, fin=index == len(pieces) - 1))


def upgrade(conn: ssl.SSLSocket) -> tuple[str, kube.FrameDecoder, list[kube.WebSocketMessage]]:
    """Answers the client's handshake; the request head, a decoder of its frames, what came with the head."""
    head, rest = read_head(conn)
    key = next(line.split(": ", 1)[1] for line in head.split("\r\n") if line.startswith("Sec-WebSocket-Key: "))
    conn.sendall((f"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Accept: {kube.websocket_accept(key)}\r\n"
                  f"Sec-WebSocket-Protocol: {kube.EXEC_SUBPROTOCOL}\r\n\r\n").encode())
    decoder = kube.FrameDecoder(masked=True)
    return head, decoder, decoder.feed(rest)


def relay_peer(behaviour: str, pongs: list[bytes], heads: list[str]) -> Callable[[ssl.SSLSocket], None]:
    """A stand-in for the kubelet's stream of `agent.py relay`: it answers each request line by its id, after a ping,
    in fragments, the second of a pair before the first; or with garbage; or drops the connection."""

    def handler(conn: ssl.SSLSocket) -> None:
        head, decoder, messages = upgrade(conn)
        heads.append(head)
        send(conn, kube.Channel.STDOUT, b"")  # v4 announces its channels with empty messages
        conn.sendall(kube.encode_frame(kube.Opcode.PING, b"are you there", None))
        lines = kube.LineSplitter(1 << 20)
        waiting: list[dict] = []
        while True:
            for message in messages:
                if message.opcode is kube.Opcode.PONG:
                    pongs.append(message.payload)
                elif message.opcode is kube.Opcode.CLOSE:
                    conn.sendall(kube.encode_frame(kube.Opcode.CLOSE, message.payload, None))
                    return
                else:
                    channel, data = kube.split_channel(message)
                    assert channel is kube.Channel.STDIN
                    for line in lines.feed(data):
                        request = json.loads(line)
                        if behaviour == "drop":
                            return
                        if behaviour == "garbage":
                            send(conn, kube.Channel.STDOUT, b"<not json>\n")
                            continue
                        waiting.append(request)
                        if request["method"] == "first":
                            continue  # answered after the next one
                        for answered in reversed(waiting):
                            answer = json.dumps({"id": answered["id"], "result": {"echo": answered["params"]}})
                            send(conn, kube.Channel.STDOUT, answer.encode() + b"\n", fragments=3)
                        waiting.clear()
            chunk = conn.recv(65536)
            if not chunk:
                return
            messages = decoder.feed(chunk)

    return handler


def channel_for(server: Peer, certificate) -> kube.AgentChannel:
    return kube.AgentChannel(server.api(certificate), "ns", "reploy-session-a", ("agent.py", "relay"))


def test_calls_answered_in_any_order_over_one_stream(peer, certificate):
    pongs: list[bytes] = []
    heads: list[str] = []
    server = peer(relay_peer("answer", pongs, heads))
    channel = channel_for(server, certificate)
    try:
        results: dict[str, dict] = {}
        first = threading.Thread(target=lambda: results.update(first=channel.call("first", {"n": 1})))
        first.start()
        deadline = time.monotonic() + DEADLINE_S
        while not channel.connected and time.monotonic() < deadline:
            time.sleep(0.01)  # the first call opens the stream; the second shares it
        assert channel.call("second", {"n": 2})["result"] == {"echo": {"n": 2}}
        first.join(DEADLINE_S)
        assert results["first"]["result"] == {"echo": {"n": 1}}
        for n in range(20):
            assert channel.call("again", {"n": n})["result"] == {"echo": {"n": n}}
        assert channel.opened == 1 and server.connections == 1
        assert pongs == [b"are you there"]
        assert heads[0].startswith("GET /api/v1/namespaces/ns/pods/reploy-session-a/exec?command=agent.py&"
                                   "command=relay&container=agent&stdin=true&stdout=true&stderr=true&tty=false ")
    finally:
        channel.close()
    with pytest.raises(kube.AgentChannelError, match="closed"):
        channel.call("status", {})


def test_a_dropped_stream_fails_its_calls_retryable_and_the_next_call_reopens(peer, certificate):
    behaviours = iter(["drop", "answer"])
    handlers: list[Callable] = []
    server = peer(lambda conn: handlers.append(relay_peer(next(behaviours), [], [])) or handlers[-1](conn))
    channel = channel_for(server, certificate)
    try:
        with pytest.raises(kube.AgentChannelError, match="dropped") as dropped:
            channel.call("status", {})
        assert dropped.value.retryable
        assert channel.call("status", {})["result"] == {"echo": {}}
        assert channel.opened == 2 and server.connections == 2
    finally:
        channel.close()


def test_a_line_that_is_not_an_answer_breaks_the_stream(peer, certificate):
    behaviours = iter(["garbage", "answer"])
    server = peer(lambda conn: relay_peer(next(behaviours), [], [])(conn))
    channel = channel_for(server, certificate)
    try:
        with pytest.raises(kube.AgentChannelError, match="not an answer") as broken:
            channel.call("status", {})
        assert not broken.value.retryable
        assert channel.call("status", {})["result"] == {"echo": {}}
        assert channel.opened == 2
    finally:
        channel.close()


def test_exec_once_reports_output_and_exit_code(peer, certificate):
    def handler(conn: ssl.SSLSocket) -> None:
        head, _, _ = upgrade(conn)
        assert "stdin=false" in head
        send(conn, kube.Channel.STDOUT, b"out")
        send(conn, kube.Channel.STDERR, b"err", fragments=2)
        status = {"status": "Failure", "reason": "NonZeroExitCode", "message": "exit 7",
                  "details": {"causes": [{"reason": "ExitCode", "message": "7"}]}}
        send(conn, kube.Channel.ERROR, json.dumps(status).encode())
        conn.sendall(kube.encode_frame(kube.Opcode.CLOSE, kube.encode_close(1000), None))

    server = peer(handler)
    end, out, err = kube.exec_once(server.api(certificate), "ns", "p", "agent", ["sh"], deadline_s=DEADLINE_S)
    assert (end, out, err) == (kube.ExecEnd(7, "exit 7"), b"out", b"err")


def test_a_refused_exec_is_the_apiservers_error(peer, certificate):
    status = {"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403,
              "message": 'pods "p" is forbidden: User "serve" cannot get resource "pods/exec"'}
    server = peer(lambda conn: (read_head(conn), conn.sendall(http_answer("403 Forbidden",
                                                                          json.dumps(status).encode() + b"\n"))))
    with pytest.raises(kube.KubeApiError) as refused:
        kube.exec_once(server.api(certificate), "ns", "p", "agent", ["sh"], deadline_s=DEADLINE_S)
    assert (refused.value.code, refused.value.reason) == (403, "Forbidden")
    assert refused.value.message == status["message"]  # the Status that followed the head, read
