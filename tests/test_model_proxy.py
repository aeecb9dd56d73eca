"""The model proxy of `reploy serve` ("the model proxy"): its pure core (the request parser, the
byte redactor, the upstream URL), then its host side on real sockets without Docker: a unix
socket like a session's DIR/agent/model.sock, forwarded over TLS to a fake Messages API on
127.0.0.1 with a CA the test makes."""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import http.client
import http.server
import itertools
import json
import select
import socket
import ssl
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path
from typing import Callable, Iterator

import pytest
from hypothesis import given, settings, strategies as st

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import agent  # noqa: E402
import reploy_serve as rs  # noqa: E402
from model_upstream import (FakeMessagesApi, big_answer, chunk, dropped_when_reused,  # noqa: E402
                            held_answer, make_ca_and_server_cert, pieces_answer, sized_answer,
                            text_delta)

CREDENTIAL = "sk-ant-api03-TESTCREDENTIAL-0123456789abcdef"


def head(*lines: str) -> bytes:
    return "\r\n".join(lines).encode()


# -- the request parser ------------------------------------------------------------------------


def test_a_messages_request_is_forwarded_without_the_sandbox_credentials() -> None:
    request = rs.parse_model_request(head(
        "POST /v1/messages?beta=true HTTP/1.1", "Host: evil.example", "Authorization: Bearer x",
        "x-api-key: y", "Proxy-Authorization: z", "Cookie: c", "Content-Length: 12",
        "anthropic-version: 2023-06-01", "Accept-Encoding: gzip", "Connection: keep-alive"))
    assert (request.path, request.query, request.body_bytes) == ("/v1/messages", "beta=true", 12)
    assert request.headers == (("anthropic-version", "2023-06-01"),)


@pytest.mark.parametrize(("line", "status"), [
    ("GET /v1/messages HTTP/1.1", 403),
    ("POST /v1/models HTTP/1.1", 403),
    ("POST /v1/messages/../complete HTTP/1.1", 403),
    ("POST https://elsewhere.example/v1/messages HTTP/1.1", 403),
    ("CONNECT elsewhere.example:443 HTTP/1.1", 403),
    ("POST /v1/messages?x=<script> HTTP/1.1", 400),
    ("POST /v1/messages", 400),
])
def test_other_methods_paths_and_targets_are_refused_with_a_reason(line: str, status: int) -> None:
    with pytest.raises(rs.ModelRefusal) as refused:
        rs.parse_model_request(head(line, "Content-Length: 2"))
    assert refused.value.status == status and refused.value.reason


@pytest.mark.parametrize(("headers", "status"), [
    (("Transfer-Encoding: chunked",), 411),
    ((), 411),
    (("Content-Length: 1", "Content-Length: 1"), 400),
    (("Content-Length: -1",), 400),
    ((f"Content-Length: {rs.MAX_MODEL_BODY_BYTES + 1}",), 413),
    (("Bad Header: x", "Content-Length: 1"), 400),
])
def test_bodies_need_one_bounded_content_length(headers: tuple[str, ...], status: int) -> None:
    with pytest.raises(rs.ModelRefusal) as refused:
        rs.parse_model_request(head("POST /v1/messages HTTP/1.1", *headers))
    assert refused.value.status == status


def test_only_the_headers_the_messages_api_reads_are_forwarded() -> None:
    """An allow-list: headers that would tell a gateway where a request came from or what it
    was for (X-Forwarded-*, Forwarded, X-Original-URL) are dropped, as is any name it does not
    foresee; the API's own (content type, accept, user agent, anthropic-*) go through."""
    request = rs.parse_model_request(head(
        "POST /v1/messages HTTP/1.1", "Content-Type: application/json", "Accept: application/json",
        "User-Agent: claude-cli/2", "anthropic-version: 2023-06-01", "Anthropic-Beta: a,b",
        "X-Forwarded-For: 10.0.0.1", "X-Forwarded-Host: admin.internal", "Forwarded: for=10.0.0.1",
        "X-Original-URL: /admin", "X-Rewrite-URL: /admin", "X-Stainless-OS: Linux", "Via: 1.1 x",
        "Content-Length: 2"))
    assert request.headers == (("Content-Type", "application/json"), ("Accept", "application/json"),
                               ("User-Agent", "claude-cli/2"), ("anthropic-version", "2023-06-01"),
                               ("Anthropic-Beta", "a,b"))


def test_a_head_that_is_not_ascii_is_refused() -> None:
    with pytest.raises(rs.ModelRefusal):
        rs.parse_model_request("POST /v1/messages HTTP/1.1\r\nx: é\r\nContent-Length: 1".encode())


@pytest.mark.parametrize("url", ["http://127.0.0.1:1", "https://u:p@host", "https://host/?q=1",
                                 "https://", "https://host:99999", "ftp://host"])
def test_the_upstream_is_https_host_port_and_prefix_only(url: str) -> None:
    with pytest.raises(rs.UsageError):
        rs.parse_model_upstream(url, None, "x-api-key")


def test_a_gateway_prefix_is_kept() -> None:
    upstream = rs.parse_model_upstream("https://gw.internal:8443/anthropic/", None, "bearer")
    assert (upstream.host, upstream.port, upstream.base_path) == ("gw.internal", 8443, "/anthropic")


@pytest.mark.parametrize("flags", [["--model-upstream", "https://127.0.0.1:1"],
                                   ["--model-credential-file", "/nonexistent"],
                                   ["--model-upstream-ca", "/etc/hostname"],
                                   ["--model-upstream", "http://127.0.0.1:1", "--model-credential-file", "/x"],
                                   ["--model-auth", "basic"]])
def test_model_flag_misuse_is_a_usage_error(flags: list[str], tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "reploy_serve.py"), "serve", "--workload-dir",
                             str(tmp_path), "--state-dir", str(tmp_path / "state"), *flags],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "--model" in result.stderr


@pytest.mark.parametrize("mode", [0o644, 0o640])
def test_a_credential_file_open_to_others_is_refused_like_the_token_file(tmp_path: Path, mode: int) -> None:
    credential = tmp_path / "credential"
    credential.write_text(CREDENTIAL + "\n")
    credential.chmod(mode)
    with pytest.raises(rs.CredentialError, match="model credential file .* open to other users") as refused:
        rs.read_model_credential(credential)
    assert CREDENTIAL not in str(refused.value)
    credential.chmod(0o600)
    assert rs.read_model_credential(credential) == CREDENTIAL


# -- what the proxy holds: request bodies, by their Content-Length ------------------------------


def test_room_for_bodies_is_bounded_per_session_and_in_all_and_given_back() -> None:
    room = rs.ModelBodyRoom(session_bytes=100, total_bytes=150)
    with room.holding("s1", 60), room.holding("s1", 40):
        with pytest.raises(rs.ModelRefusal) as refused:
            with room.holding("s1", 1):
                pass
        assert refused.value.status == 429
        with room.holding("s2", 50):
            with pytest.raises(rs.ModelRefusal) as refused:
                with room.holding("s3", 1):
                    pass
            assert refused.value.status == 503
        with room.holding("s3", 50):  # s2's was given back
            pass
    with room.holding("s1", 100), room.holding("s2", 50):  # all of it, once more
        pass


# -- what the upstream's answer may be framed in: only what redaction sees through -----------


@pytest.mark.parametrize(("headers", "refused"), [
    ((), False),
    ((("Transfer-Encoding", "chunked"),), False),
    ((("transfer-encoding", "Chunked"), ("Content-Encoding", "identity")), False),
    ((("Transfer-Encoding", "gzip, chunked"),), True),
    ((("Transfer-Encoding", "chunked"), ("Transfer-Encoding", "gzip")), True),
    ((("Transfer-Encoding", "chunked "),), True),  # http.client would not take it off
    ((("Transfer-Encoding", "identity"),), True),
    ((("Content-Encoding", "gzip"),), True),
    ((("Content-Encoding", "identity, br"),), True),
    ((("Content-Encoding", ""),), True),
])
def test_an_answer_is_forwarded_only_in_framing_and_coding_redaction_sees_through(
        headers: tuple[tuple[str, str], ...], refused: bool) -> None:
    assert (rs.coding_refusal(headers) is not None) is refused


# -- the redactor (agent.Redactor's rule, over bytes) -----------------------------------------


def redacted_through(secret: str, pieces: list[bytes]) -> bytes:
    redactor = rs.BytesRedactor(secret)
    return b"".join(redactor.feed(piece) for piece in pieces) + redactor.finish()


def test_every_two_way_split_of_a_credential_is_redacted() -> None:
    data = f"a{CREDENTIAL}b{CREDENTIAL[:-1]}c{CREDENTIAL}".encode()
    expected = data.replace(CREDENTIAL.encode(), b"[REDACTED]")
    for cut in range(len(data) + 1):
        assert redacted_through(CREDENTIAL, [data[:cut], data[cut:]]) == expected


def test_every_byte_on_its_own_read_is_redacted() -> None:
    data = f"x{CREDENTIAL}{CREDENTIAL}y\xff".encode("latin-1")
    assert redacted_through(CREDENTIAL, [data[i:i + 1] for i in range(len(data))]) == \
        data.replace(CREDENTIAL.encode(), b"[REDACTED]")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=20), st.just(CREDENTIAL.encode()),
                          st.just(CREDENTIAL.encode()[:10])), max_size=8),
       st.lists(st.integers(min_value=0, max_value=400), max_size=6))
def test_any_split_of_any_stream_redacts_every_credential(parts: list[bytes], cuts: list[int]) -> None:
    data = b"".join(parts)
    points = sorted({min(c, len(data)) for c in cuts})
    pieces = [data[a:b] for a, b in itertools.pairwise([0, *points, len(data)])]
    assert redacted_through(CREDENTIAL, pieces) == data.replace(CREDENTIAL.encode(), b"[REDACTED]")


#: A credential whose start is also its end (a "border"): a match may begin inside the one before.
OVERLAPPING = "sk-a1b2sk-a1b2sk-a"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([b"s", b"k", b"-", b"a", b"1b2", b"x", OVERLAPPING.encode()]), max_size=24),
       st.lists(st.integers(min_value=0, max_value=200), max_size=6))
def test_a_self_overlapping_credential_is_redacted_as_one_pass_over_the_whole_stream(
        parts: list[bytes], cuts: list[int]) -> None:
    data = b"".join(parts)
    points = sorted({min(c, len(data)) for c in cuts})
    pieces = [data[a:b] for a, b in itertools.pairwise([0, *points, len(data)])]
    assert redacted_through(OVERLAPPING, pieces) == data.replace(OVERLAPPING.encode(), b"[REDACTED]")


#: Reads made of these, so that blank lines (LF and CRLF ones) fall anywhere, across reads too.
SSE_TOKENS = st.sampled_from([b"\n", b"\r", b"\r\n", b"\n\n", b"data: x", b"event: y", b"\x00", b"\xff"])


@given(st.lists(st.one_of(st.binary(max_size=30), st.lists(SSE_TOKENS, max_size=8).map(b"".join)), max_size=10))
def test_whole_events_pass_on_every_byte_in_order_cut_at_the_last_blank_line(pieces: list[bytes]) -> None:
    events = rs.WholeEvents()
    passed = [b"".join(events.feed(piece)) for piece in pieces]
    held = events.finish()
    assert all(p == b"" or p.endswith((b"\n\n", b"\r\n\r\n")) for p in passed)
    assert b"".join(passed) + held == b"".join(pieces)
    assert b"\n\n" not in held and b"\r\n\r\n" not in held  # nothing whole is held back


@pytest.mark.parametrize("pieces", [[b"data: a\n", b"\ndata: b"], [b"data: a\r\n\r", b"\ndata: b"],
                                    [b"data: a\r", b"\n\r\n"], [b"data: a", b"\n", b"\n"],
                                    [b"data: a\n", b"\ndata: b\n\ndata: c"],
                                    [b"data: a\r\n", b"\r\ndata: b\r\n\r\ndata: c"]])
def test_a_blank_line_split_across_two_reads_ends_the_event_at_once(pieces: list[bytes]) -> None:
    events = rs.WholeEvents()
    passed = b"".join(b"".join(events.feed(piece)) for piece in pieces)
    assert passed.startswith(b"data: a") and passed.endswith((b"\n\n", b"\r\n\r\n"))
    assert b"data: a" not in events.finish()


def test_a_read_ending_an_event_past_its_start_is_passed_on_as_a_view_not_a_copy() -> None:
    events = rs.WholeEvents()
    assert events.feed(b"data: a\n\ndata: b")[0] == b""
    read = b"-more\n\ndata: c"
    held, view = events.feed(read)
    assert (held, bytes(view)) == (b"data: b", b"-more\n\n") and view.obj is read
    assert events.finish() == b"data: c"


# -- the send to the client: a gather write, bounded in time as a whole ------------------------


def test_pieces_larger_than_the_socket_buffer_arrive_whole_and_in_order() -> None:
    pieces = [bytes([n]) * size for n, size in enumerate((1, 300_000, 7, 700_000, 0, 3))]
    left, right = socket.socketpair()
    with left, right:
        left.settimeout(30)
        received = bytearray()

        def read_all() -> None:
            while data := right.recv(65536):
                received.extend(data)
        reader = threading.Thread(target=read_all)
        reader.start()
        rs.send_pieces(left, [pieces[0], memoryview(pieces[1]), *pieces[2:]])
        left.shutdown(socket.SHUT_WR)
        reader.join(30)
        assert received == b"".join(pieces)
        assert left.gettimeout() == 30


def test_a_client_that_takes_nothing_ends_the_send_within_the_socket_timeout() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.settimeout(0.2)
        with pytest.raises(TimeoutError):
            rs.send_pieces(left, [b"x" * 4 * 1024 * 1024])
        assert left.gettimeout() == 0.2


# -- upstream keep-alive: the reuse and retry decisions, the pool (no sockets) ---------------------


@pytest.mark.parametrize(("read_to_end", "server_closes", "kept"),
                         [(True, False, True), (True, True, False), (False, False, False), (False, True, False)])
def test_a_connection_is_kept_only_after_a_whole_answer_the_upstream_did_not_close(
        read_to_end: bool, server_closes: bool, kept: bool) -> None:
    assert rs.keeps_connection(read_to_end, server_closes) is kept


@pytest.mark.parametrize(("reused", "body_sent", "error", "retried"), [
    (True, True, http.client.RemoteDisconnected("closed"), True),
    (True, True, ConnectionResetError(), True),
    (True, False, http.client.RemoteDisconnected("closed"), False),  # the body did not go out whole
    (False, True, http.client.RemoteDisconnected("closed"), False),  # a new connection failed: 502
    (True, True, TimeoutError(), False),  # the upstream may be working on it
    (True, True, http.client.BadStatusLine("garbage"), False),  # bytes of an answer came
])
def test_only_a_pooled_connection_closed_before_any_answer_is_retried(
        reused: bool, body_sent: bool, error: BaseException, retried: bool) -> None:
    assert rs.retries_on_fresh(reused, body_sent, error) is retried


class CountedClose(http.client.HTTPSConnection):
    """Never connected: the pool's bookkeeping only."""

    def __init__(self) -> None:
        super().__init__("127.0.0.1")
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


def test_the_pool_lends_each_connection_once_newest_first_and_closes_expired_and_surplus_ones() -> None:
    pool = rs.IdleUpstreams(size=2, idle_s=10.0)
    a, b, c = CountedClose(), CountedClose(), CountedClose()
    pool.put(a, now=0.0)
    pool.put(b, now=1.0)
    pool.put(c, now=2.0)  # over the size: the oldest goes
    assert a.closes == 1 and (b.closes, c.closes) == (0, 0)
    assert pool.take(now=3.0) is c and pool.take(now=3.0) is b and pool.take(now=3.0) is None
    pool.put(b, now=5.0)
    assert pool.take(now=15.0) is None and b.closes == 1  # idle 10 s: closed, never lent
    pool.put(c, now=20.0)
    pool.close()
    assert c.closes == 1 and pool.take(now=20.0) is None
    pool.put(a, now=21.0)  # a request that ended after the close
    assert a.closes == 2 and pool.take(now=21.0) is None


# -- the host side on real sockets ----------------------------------------------------------------


@pytest.fixture
def tls_listener(tmp_path: Path) -> Iterator[tuple[socket.socket, ssl.SSLContext, ssl.SSLContext]]:
    """(a listener on 127.0.0.1, its server context, a client context trusting the test's CA)."""
    ca, cert, key = make_ca_and_server_cert(tmp_path)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield listener, server, ssl.create_default_context(cafile=str(ca))


def tls_peer(listener: socket.socket, context: ssl.SSLContext, serve: Callable[[ssl.SSLSocket], None]) -> threading.Thread:
    def run() -> None:
        conn, _ = listener.accept()
        try:
            with context.wrap_socket(conn, server_side=True) as tls:
                serve(tls)
        except (OSError, ssl.SSLError):
            pass  # the client refused the handshake
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def batched(listener: socket.socket, context: ssl.SSLContext, hostname: str = "127.0.0.1") -> rs.BatchedTLSSocket:
    return rs.BatchedTLSSocket(socket.create_connection(listener.getsockname(), timeout=30), context, hostname)


def test_the_batched_tls_socket_checks_the_certificate_and_its_name(
        tls_listener: tuple[socket.socket, ssl.SSLContext, ssl.SSLContext]) -> None:
    listener, server, client = tls_listener
    tls_peer(listener, server, lambda tls: None)
    with pytest.raises(ssl.SSLCertVerificationError, match="match"):
        batched(listener, client, hostname="localhost")  # the certificate is for 127.0.0.1 only
    tls_peer(listener, server, lambda tls: None)
    with pytest.raises(ssl.SSLCertVerificationError):
        batched(listener, ssl.create_default_context())  # the system's roots: not the test's CA


def test_one_read_takes_every_record_that_has_arrived_and_a_close_is_an_end(
        tls_listener: tuple[socket.socket, ssl.SSLContext, ssl.SSLContext]) -> None:
    """200 KiB sent: once 100 KiB of it is in the client's TCP buffer, one recv_into returns more than one TLS
    record's 16 KiB (an SSLSocket returns one record a read). The peer's close without a TLS close then reads as
    the end (0), after every byte."""
    listener, server, client = tls_listener
    data = bytes(range(256)) * 800
    peer = tls_peer(listener, server, lambda tls: (tls.sendall(data), tls.recv(1)))
    sock = batched(listener, client)
    while struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0] < 100 * 1024:
        select.select([sock.fileno()], [], [], 30)  # more has arrived
    buffer = bytearray(1024 * 1024)
    got = sock.recv_into(buffer)
    assert got > 16 * 1024
    while got < len(data):
        got += sock.recv_into(memoryview(buffer)[got:])
    assert buffer[:got] == data
    sock.sendall(b"x")  # the peer closes its TCP side, with no TLS close
    peer.join(30)
    assert sock.recv_into(buffer) == 0
    sock.close()




@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[FakeMessagesApi]:
    (tmp_path / "tls").mkdir()
    with FakeMessagesApi(tmp_path / "tls") as api:
        yield api


def make_proxy(tmp_path: Path, url: str, ca: Path | None, auth: str = "x-api-key",
               request_deadline_s: float = rs.MODEL_REQUEST_DEADLINE_S) -> tuple[rs.ModelProxy, Path]:
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir(mode=0o700, exist_ok=True)
    proxy = rs.ModelProxy(rs.parse_model_upstream(url, ca, auth), CREDENTIAL, request_deadline_s)
    proxy.listen("s1", agent_dir)
    return proxy, agent_dir / agent.MODEL_SOCKET_NAME


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("127.0.0.1", timeout=60)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(str(self.unix_path))


def ask(path: Path, target: str = "/v1/messages?beta=true", method: str = "POST") -> http.client.HTTPResponse:
    connection = UnixHTTPConnection(path)
    connection.request(method, target, body=b'{"stream": true}', headers={
        "authorization": f"Bearer {rs.MODEL_PLACEHOLDER}", "x-api-key": rs.MODEL_PLACEHOLDER,
        "anthropic-version": "2023-06-01", "content-type": "application/json"})
    return connection.getresponse()


def test_the_answer_streams_before_the_upstream_finishes_with_the_real_credential(
        tmp_path: Path, upstream: FakeMessagesApi) -> None:
    release, finished = threading.Event(), threading.Event()
    upstream.plan = held_answer("first", "second", release, finished)
    proxy, sock = make_proxy(tmp_path, upstream.url, upstream.ca)
    try:
        response = ask(sock)
        assert response.status == 200 and response.getheader("request-id") == "req_fake"
        seen = b""
        while text_delta("first") not in seen:
            seen += response.read1(65536)
        assert not finished.is_set()  # the first delta came through while the rest was held
        release.set()
        rest = response.read()
        assert text_delta("second") in rest and finished.is_set()
    finally:
        release.set()
        proxy.close()
    (path, headers), = upstream.requests
    assert path == "/v1/messages?beta=true"
    assert headers["x-api-key"] == CREDENTIAL and "authorization" not in headers
    assert headers["host"] == f"127.0.0.1:{upstream.port}" and headers["anthropic-version"] == "2023-06-01"
    assert rs.MODEL_PLACEHOLDER not in json.dumps(headers)
    assert (sock.stat().st_mode & 0o777) == 0o600


def test_a_bearer_gateway_gets_the_credential_as_authorization(tmp_path: Path, upstream: FakeMessagesApi) -> None:
    release = threading.Event()
    release.set()
    upstream.plan = held_answer("a", "b", release, threading.Event())
    proxy, sock = make_proxy(tmp_path, upstream.url, upstream.ca, auth="bearer")
    try:
        assert ask(sock).read()
    finally:
        proxy.close()
    (_, headers), = upstream.requests
    assert headers["authorization"] == f"Bearer {CREDENTIAL}" and "x-api-key" not in headers


def test_a_credential_split_across_two_upstream_reads_is_redacted(tmp_path: Path, upstream: FakeMessagesApi) -> None:
    second = threading.Event()
    half = len(CREDENTIAL) // 2
    upstream.plan = pieces_answer([(b"data: start\n\ndata: token=" + CREDENTIAL[:half].encode(), None),
                                   (CREDENTIAL[half:].encode() + b" end\n\n", second)])
    proxy, sock = make_proxy(tmp_path, upstream.url, upstream.ca)
    try:
        response = ask(sock)
        seen = b""
        while b"start" not in seen:  # the whole event before, while the half credential is held back
            seen += response.read1(65536)
        second.set()
        seen += response.read()
    finally:
        second.set()
        proxy.close()
    assert seen == b"data: start\n\ndata: token=[REDACTED] end\n\n"


def test_a_chunked_answer_streams_chunk_by_chunk_and_keeps_its_connection(
        tmp_path: Path, upstream: FakeMessagesApi) -> None:
    """The framing real gateways send an SSE answer in: the first chunk reaches the CLI while the
    rest is held, the chunk framing and the trailer never do, and the connection serves the next
    request (its end was read exactly)."""
    release = threading.Event()
    first, second = text_delta("first"), text_delta("second")
    upstream.plan = pieces_answer([(chunk(first[:9]) + chunk(first[9:], b";x=1"), None),
                                   (chunk(second) + b"0\r\nx-end: 1\r\n\r\n", release)], chunked=True)
    proxy, sock = make_proxy(tmp_path, upstream.url, upstream.ca)
    try:
        response = ask(sock)
        seen = b""
        while first not in seen:
            seen += response.read1(65536)
        release.set()
        seen += response.read()
        assert seen == first + second
        upstream.plan = sized_answer("next")
        assert text_delta("next") in ask(sock).read()
    finally:
        release.set()
        proxy.close()
    assert upstream.connections == 1 and len(upstream.requests) == 2


def test_a_broken_chunked_answer_ends_with_an_error_event_and_its_connection(
        tmp_path: Path, upstream: FakeMessagesApi) -> None:
    upstream.plan = pieces_answer([(chunk(text_delta("whole")) + b"zz\r\ntoo long\r\n", None)], chunked=True)
    proxy, sock = make_proxy(tmp_path, upstream.url, upstream.ca)
    try:
        body = ask(sock).read()
        upstream.plan = sized_answer("next")
        assert text_delta("next") in ask(sock).read()
    finally:
        proxy.close()
    assert body.startswith(text_delta("whole")) and b"too long" not in body
    assert body.endswith(b"\n\n") and b"event: error" in body and b"broke off: IncompleteRead" in body
    assert upstream.connections == 2  # the broken one was not reused


def test_an_answer_over_the_cap_ends_with_an_explicit_error(tmp_path: Path, upstream: FakeMessagesApi) -> None:
    upstream.plan = big_answer(rs.MAX_MODEL_RESPONSE_BYTES + 1_000_000)
    proxy, sock = make_proxy(tmp_path, upstream.url, upstream.ca)
    try:
        body = ask(sock).read()
    finally:
        proxy.close()
    assert len(body) <= rs.MAX_MODEL_RESPONSE_BYTES + 1000
    assert body.endswith(b"\n\n") and b"event: error" in body[-400:] and b"cap" in body[-400:]


@pytest.mark.parametrize(("target", "method"), [("/v1/models", "GET"), ("/v1/complete", "POST"),
                                                ("http://127.0.0.1:1/v1/messages", "POST")])
def test_other_requests_are_403_and_never_reach_the_upstream(tmp_path: Path, upstream: FakeMessagesApi,
                                                             target: str, method: str) -> None:
    proxy, sock = make_proxy(tmp_path, upstream.url, upstream.ca)
    try:
        response = ask(sock, target, method)
        error = json.loads(response.read())
    finally:
        proxy.close()
    assert response.status == 403 and error["error"]["type"] == "permission_error"
    assert upstream.requests == []


def test_the_client_reads_a_refusal_that_came_before_its_body(tmp_path: Path, upstream: FakeMessagesApi) -> None:
    """The refusal is decided on the head; the body (more than a socket buffer holds) is read and dropped, so the
    client's send completes and it reads the 403 instead of a broken pipe."""
    proxy, sock = make_proxy(tmp_path, upstream.url, upstream.ca)
    try:
        connection = UnixHTTPConnection(sock)
        connection.request("POST", "/v1/complete", body=b"x" * (4 << 20), headers={"content-type": "application/json"})
        response = connection.getresponse()
        error = json.loads(response.read())
        connection.close()
    finally:
        proxy.close()
    assert response.status == 403 and error["error"]["type"] == "permission_error"
    assert upstream.requests == []


def test_an_unverified_upstream_and_an_unreachable_one_are_502(tmp_path: Path, upstream: FakeMessagesApi) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    for url, ca in ((upstream.url, None), (f"https://127.0.0.1:{port}", upstream.ca)):
        proxy, sock = make_proxy(tmp_path, url, ca)
        try:
            response = ask(sock)
            error = json.loads(response.read())
        finally:
            proxy.close()
        assert response.status == 502 and error["type"] == "error" and error["error"]["message"]
    assert upstream.requests == []


def test_requests_past_the_per_session_bound_are_429(tmp_path: Path, upstream: FakeMessagesApi) -> None:
    release = threading.Event()
    upstream.plan = held_answer("a", "b", release, threading.Event())
    proxy, sock = make_proxy(tmp_path, upstream.url, upstream.ca)
    try:
        held = [ask(sock) for _ in range(rs.MAX_MODEL_REQUESTS)]
        assert ask(sock).status == 429
        release.set()
        assert all(r.read() for r in held)
    finally:
        release.set()
        proxy.close()


def test_requests_in_a_row_share_one_upstream_connection_unless_it_says_close(
        tmp_path: Path, upstream: FakeMessagesApi) -> None:
    """Two whole answers with a length: one TLS connection. A Connection: close answer is not reused: the request
    after it opens a new one. Each request is its own connection from the relay's side."""
    proxy, sock = make_proxy(tmp_path, upstream.url, upstream.ca)
    try:
        upstream.plan = sized_answer("one")
        assert text_delta("one") in ask(sock).read()
        assert text_delta("one") in ask(sock).read()
        assert upstream.connections == 1 and len(upstream.requests) == 2
        upstream.plan = sized_answer("closing", close=True)
        assert text_delta("closing") in ask(sock).read()
        upstream.plan = sized_answer("after")
        assert text_delta("after") in ask(sock).read()
        assert upstream.connections == 2 and len(upstream.requests) == 4
    finally:
        proxy.close()
    assert all(headers["x-api-key"] == CREDENTIAL for _, headers in upstream.requests)


def test_an_idle_connection_the_upstream_closed_is_replaced_and_the_request_answered(
        tmp_path: Path, upstream: FakeMessagesApi) -> None:
    """The upstream drops every idle connection (as a server past its keep-alive bound does): the next request
    still gets its answer, on a new connection."""
    proxy, sock = make_proxy(tmp_path, upstream.url, upstream.ca)
    try:
        upstream.plan = sized_answer("one")
        assert text_delta("one") in ask(sock).read()
        upstream.close_idle()
        assert text_delta("one") in ask(sock).read()
    finally:
        proxy.close()
    assert upstream.connections == 2 and len(upstream.requests) == 2


def test_a_request_the_upstream_drops_on_a_pooled_connection_is_sent_once_more_on_a_new_one(
        tmp_path: Path, upstream: FakeMessagesApi) -> None:
    proxy, sock = make_proxy(tmp_path, upstream.url, upstream.ca)
    try:
        upstream.plan = dropped_when_reused(sized_answer("one"))
        assert text_delta("one") in ask(sock).read()
        response = ask(sock)
        assert response.status == 200 and text_delta("one") in response.read()
    finally:
        proxy.close()
    assert upstream.connections == 2 and len(upstream.requests) == 3  # the dropped one, then its retry


# -- what a hostile workload or upstream can make the proxy do (issue 42) ------------------


def unix_client(path: Path, timeout_s: float = 60) -> socket.socket:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(timeout_s)
    client.connect(str(path))
    return client


def messages_head(body_bytes: int) -> bytes:
    return b"POST /v1/messages HTTP/1.1\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % body_bytes


def status_of(client: socket.socket) -> int:
    """The status of the answer on client's connection (its first line)."""
    return int(client.makefile("rb").readline().split()[1])


@pytest.mark.parametrize("whole_head", [False, True])
def test_a_request_trickled_past_the_deadline_is_408_and_gives_its_slot_back(
        tmp_path: Path, upstream: FakeMessagesApi, whole_head: bool) -> None:
    """Each byte comes long before the deadline, the whole request never does: the deadline is
    the whole request's (head, or body after a whole head), not each read's. The client waits
    for an answer a quarter second after each byte it sends; then the next request gets a slot."""
    upstream.plan = sized_answer("after")
    proxy, sock = make_proxy(tmp_path, upstream.url, upstream.ca, request_deadline_s=1.0)
    trickle = iter((messages_head(1000) if whole_head else b"POST /v1/messages HTTP/1.1\r\nx-pad: ")
                   + b"x" * 1000)
    try:
        with unix_client(sock, timeout_s=0.25) as client:
            answer = b""
            for byte in trickle:  # 250 s of trickle: far past the per-read bound of old
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # answered since
                    client.sendall(bytes([byte]))
                with contextlib.suppress(TimeoutError):
                    answer = client.recv(4096)
                if answer:
                    break
        assert answer.startswith(b"HTTP/1.1 408 ") and b"did not arrive whole within 1 s" in answer
        for _ in range(rs.MAX_MODEL_REQUESTS + 1):  # every slot is free
            assert text_delta("after") in ask(sock).read()
    finally:
        proxy.close()
    assert len(upstream.requests) == rs.MAX_MODEL_REQUESTS + 1


def test_heads_still_arriving_hold_no_slot(tmp_path: Path, upstream: FakeMessagesApi) -> None:
    """Twice as many connections as a session has slots, each with half a head sent: a whole
    request still goes through at once, not 429."""
    upstream.plan = sized_answer("through")
    proxy, sock = make_proxy(tmp_path, upstream.url, upstream.ca)
    partial = [unix_client(sock) for _ in range(2 * rs.MAX_MODEL_REQUESTS)]
    try:
        for client in partial:
            client.sendall(b"POST /v1/messages HTTP/1.1\r\n")
        response = ask(sock)
        assert response.status == 200 and text_delta("through") in response.read()
    finally:
        for client in partial:
            client.close()
        proxy.close()


def test_a_request_past_the_sessions_bound_is_refused_before_its_body_is_sent(
        tmp_path: Path, upstream: FakeMessagesApi) -> None:
    """Every slot taken by an answer under way: one more request gets its 429 for its head alone,
    its 32 MiB body never sent (the proxy waited for it whole before)."""
    release = threading.Event()
    upstream.plan = held_answer("a", "b", release, threading.Event())
    proxy, sock = make_proxy(tmp_path, upstream.url, upstream.ca)
    try:
        held = [ask(sock) for _ in range(rs.MAX_MODEL_REQUESTS)]
        with unix_client(sock, timeout_s=20) as client:
            client.sendall(messages_head(rs.MAX_MODEL_BODY_BYTES))
            assert status_of(client) == 429
        release.set()
        assert all(text_delta("b") in response.read() for response in held)
    finally:
        release.set()
        proxy.close()


def test_bodies_past_the_sessions_room_are_refused_unread(tmp_path: Path, upstream: FakeMessagesApi) -> None:
    """Heads of the largest body, one more than the session's room holds, none of their bodies
    sent: the one past the room is 429 at once, the others wait for their bodies until the
    deadline (408)."""
    proxy, sock = make_proxy(tmp_path, upstream.url, upstream.ca, request_deadline_s=3.0)
    fitting = rs.MAX_MODEL_SESSION_BODIES_BYTES // rs.MAX_MODEL_BODY_BYTES
    assert fitting + 1 <= rs.MAX_MODEL_REQUESTS  # the room, not the slots, refuses
    clients = [unix_client(sock) for _ in range(fitting + 1)]
    try:
        for client in clients:
            client.sendall(messages_head(rs.MAX_MODEL_BODY_BYTES))
        statuses = sorted(status_of(client) for client in clients)
    finally:
        for client in clients:
            client.close()
        proxy.close()
    assert statuses == [408] * fitting + [429]
    assert upstream.requests == []


def test_sixteen_largest_bodies_at_once_grow_the_proxy_by_its_room_only(
        tmp_path: Path, upstream: FakeMessagesApi) -> None:
    """As many connections as a session's relay lets through, each sending the largest body while
    the answers are held: the proxy (in a process of its own, as serve) holds at most the
    session's room of bodies at once, every request is answered (200, or 429 before its body),
    and its peak resident size grows by about that room (it grew by every body, and copies of
    them, before)."""
    release = threading.Event()
    upstream.plan = held_answer("a", "b", release, threading.Event())
    proxy = subprocess.Popen([sys.executable, str(ROOT / "tests/model_proxy_process.py"), str(tmp_path),
                              upstream.url, str(upstream.ca)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert proxy.stdin is not None and proxy.stdout is not None

    def peak_rss() -> int:
        proxy.stdin.write("?\n")
        proxy.stdin.flush()
        return int(proxy.stdout.readline())

    body = b"{" + b" " * (rs.MAX_MODEL_BODY_BYTES - 2) + b"}"
    statuses: list[int] = []

    def post() -> None:
        with unix_client(tmp_path / "agent" / agent.MODEL_SOCKET_NAME, timeout_s=120) as client:
            client.sendall(messages_head(len(body)))
            client.sendall(body)
            statuses.append(status_of(client))
    try:
        proxy.stdin.write(CREDENTIAL + "\n")
        proxy.stdin.flush()
        assert proxy.stdout.readline() == "ready\n"
        before = peak_rss()
        posts = [threading.Thread(target=post) for _ in range(agent.MAX_RELAYED_CONNECTIONS)]
        for thread in posts:
            thread.start()
        for thread in posts:
            thread.join(300)
        grown = peak_rss() - before
    finally:
        release.set()
        proxy.stdin.close()
        proxy.wait(30)
    assert len(statuses) == agent.MAX_RELAYED_CONNECTIONS and set(statuses) <= {200, 429}
    assert 1 <= statuses.count(200) <= rs.MAX_MODEL_REQUESTS
    assert grown <= rs.MAX_MODEL_SESSION_BODIES_BYTES + 32 * 1024 * 1024, grown


@pytest.mark.parametrize("framing", [
    (("transfer-encoding", "gzip, chunked"),),
    (("transfer-encoding", "chunked"), ("transfer-encoding", "gzip")),
    (("transfer-encoding", "chunked"), ("content-encoding", "gzip")),
])
def test_an_answer_coded_past_what_redaction_sees_is_502(
        tmp_path: Path, upstream: FakeMessagesApi, framing: tuple[tuple[str, str], ...]) -> None:
    """The upstream echoes the credential in a gzip-coded chunked body: the client gets a 502,
    never the coded bytes (from which the credential would unzip)."""
    echoed = gzip.compress(text_delta(f"token={CREDENTIAL}"))

    def coded(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("content-type", "text/event-stream")
        for name, value in framing:
            handler.send_header(name, value)
        handler.send_header("connection", "close")
        handler.end_headers()
        handler.wfile.write(chunk(echoed) + chunk(b""))
    upstream.plan = coded
    proxy, sock = make_proxy(tmp_path, upstream.url, upstream.ca)
    try:
        response = ask(sock)
        body = response.read()
    finally:
        proxy.close()
    assert response.status == 502 and b"cannot be redacted" in body
    assert echoed not in body and b"\x1f\x8b" not in body


def test_headers_naming_a_requests_origin_never_reach_the_upstream(tmp_path: Path, upstream: FakeMessagesApi) -> None:
    """What the workload says about where a request came from (X-Forwarded-*, Forwarded,
    X-Original-URL) is not sent with the credential; the upstream is asked for an unencoded
    answer whatever the workload asked for."""
    upstream.plan = sized_answer("plain")
    proxy, sock = make_proxy(tmp_path, upstream.url, upstream.ca)
    try:
        connection = UnixHTTPConnection(sock)
        connection.request("POST", "/v1/messages", body=b"{}", headers={
            "content-type": "application/json", "anthropic-version": "2023-06-01",
            "x-forwarded-for": "10.0.0.1", "x-forwarded-host": "admin.internal", "forwarded": "for=10.0.0.1",
            "x-original-url": "/admin", "accept-encoding": "gzip, br"})
        assert text_delta("plain") in connection.getresponse().read()
    finally:
        proxy.close()
    (_, headers), = upstream.requests
    assert not {"x-forwarded-for", "x-forwarded-host", "forwarded", "x-original-url"} & set(headers)
    assert headers["accept-encoding"] == "identity" and headers["x-api-key"] == CREDENTIAL
