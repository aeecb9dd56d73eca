"""A stand-in for the Messages API on 127.0.0.1 over HTTPS, with a CA the test makes (openssl).

Each POST is recorded (path with query, headers) and answered by the plan the test set: a
callable given the handler. The plans below are the shapes the proxy must carry: an SSE answer
held back after its first delta until the test says so, raw pieces written one by one (each
after an event the test sets), a body of N bytes, and an error answer. The SSE answers have the
Messages API's whole event sequence (message_start with its message, a text block, message_delta,
message_stop): the real Claude Code CLI takes nothing less as an answer.
"""

from __future__ import annotations

import http.server
import json
import socket
import ssl
import subprocess
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

HOLD_TIMEOUT_S = 60.0  #: a held answer gives up after this (the test failed: nothing saw the delta)


def make_ca_and_server_cert(directory: Path) -> tuple[Path, Path, Path]:
    """(ca.pem, server.pem, server.key): a CA of the test's own and a server certificate for
    IP 127.0.0.1 signed by it."""
    def run(*argv: str) -> None:
        subprocess.run(["openssl", *argv], check=True, capture_output=True, cwd=directory)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=reploy test CA")
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "2", "-extfile", "san.ext")
    return directory / "ca.pem", directory / "server.pem", directory / "server.key"


def sse_event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


def text_delta(text: str) -> bytes:
    return sse_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                             "delta": {"type": "text_delta", "text": text}})


Plan = Callable[[http.server.BaseHTTPRequestHandler], None]


def start_sse(handler: http.server.BaseHTTPRequestHandler, length: Optional[int] = None,
              close: bool = False, chunked: bool = False) -> None:
    """The answer's head: a body of `length` bytes, after which the connection stays open
    unless `close` (Connection: close); `chunked`, a chunked body (kept open too); neither,
    a body the close ends."""
    handler.send_response(200)
    handler.send_header("content-type", "text/event-stream")
    handler.send_header("request-id", "req_fake")
    if length is not None:
        handler.send_header("content-length", str(length))
    if chunked:
        handler.send_header("transfer-encoding", "chunked")
    if (length is None and not chunked) or close:
        handler.send_header("connection", "close")
    handler.end_headers()


def chunk(data: bytes, extension: bytes = b"") -> bytes:
    """One chunk of a chunked body as RFC 9112 section 7.1 frames it (b"" is the last one,
    with no trailer field)."""
    return b"%x%s\r\n%s\r\n" % (len(data), extension, data) + (b"\r\n" if not data else b"")


def message_opening() -> bytes:
    """message_start and the start of its one text block."""
    message = {"id": "msg_fake", "type": "message", "role": "assistant", "model": "fake-model",
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": 1, "output_tokens": 1}}
    return (sse_event("message_start", {"type": "message_start", "message": message})
            + sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": {"type": "text", "text": ""}}))


def message_closing() -> bytes:
    """The end of the text block and of the message."""
    return (sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
            + sse_event("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                          "usage": {"output_tokens": 2}})
            + sse_event("message_stop", {"type": "message_stop"}))


def held_answer(first: str, rest: str, release: threading.Event, finished: threading.Event) -> Plan:
    """The first delta, then nothing until `release` (the test saw the first delta downstream),
    then the rest; `finished` is set once the whole answer is written."""
    def plan(handler: http.server.BaseHTTPRequestHandler) -> None:
        start_sse(handler)
        handler.wfile.write(message_opening() + text_delta(first))
        release.wait(HOLD_TIMEOUT_S)
        handler.wfile.write(text_delta(rest) + message_closing())
        finished.set()
    return plan


def error_answer(status: int, kind: str, message: str) -> Plan:
    """The Messages API's error shape with that status."""
    def plan(handler: http.server.BaseHTTPRequestHandler) -> None:
        body = json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()
        handler.send_response(status)
        handler.send_header("content-type", "application/json")
        handler.send_header("content-length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    return plan


def pieces_answer(pieces: Iterable[tuple[bytes, Optional[threading.Event]]],
                  chunked: bool = False) -> Plan:
    """Each piece written on its own, after its event (None: at once), as the body the close
    ends or, `chunked`, as a chunked body's wire bytes (chunk() frames them; a test may also
    send broken ones)."""
    def plan(handler: http.server.BaseHTTPRequestHandler) -> None:
        start_sse(handler, chunked=chunked)
        for data, wait_for in pieces:
            if wait_for is not None:
                wait_for.wait(HOLD_TIMEOUT_S)
            handler.wfile.write(data)
    return plan


def sized_answer(text: str, close: bool = False) -> Plan:
    """A whole SSE answer with Content-Length: the connection may carry another request
    after it, unless `close` (Connection: close: the upstream closes it)."""
    def plan(handler: http.server.BaseHTTPRequestHandler) -> None:
        body = message_opening() + text_delta(text) + message_closing()
        start_sse(handler, len(body), close)
        handler.wfile.write(body)
    return plan


def dropped_when_reused(plan: Plan) -> Plan:
    """`plan` for a connection's first request; a later one on the same connection is read
    and the connection closed with no byte of an answer (an upstream ending an idle
    connection just as a request came in)."""
    answered: "weakref.WeakSet[http.server.BaseHTTPRequestHandler]" = weakref.WeakSet()

    def dropping(handler: http.server.BaseHTTPRequestHandler) -> None:
        if handler in answered:
            handler.close_connection = True
            return
        answered.add(handler)
        plan(handler)
    return dropping


def big_answer(total_bytes: int) -> Plan:
    """ping events padded to 60 kB (a CLI shows none of them) until total_bytes of body are
    written or the reader is gone."""
    def plan(handler: http.server.BaseHTTPRequestHandler) -> None:
        start_sse(handler)
        piece = sse_event("ping", {"type": "ping", "padding": "x" * 60_000})
        written = 0
        try:
            while written < total_bytes:
                handler.wfile.write(piece)
                written += len(piece)
        except OSError:
            pass
    return plan


class FakeMessagesApi:
    """The HTTPS listener on 127.0.0.1 (a port of its own); use as a context manager."""

    def __init__(self, directory: Path) -> None:
        self.ca, cert, key = make_ca_and_server_cert(directory)
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.connections = 0  #: TLS connections accepted (each with its handshake)
        self._open: "weakref.WeakSet[ssl.SSLSocket]" = weakref.WeakSet()
        self.plan: Plan = held_answer("", "", threading.Event(), threading.Event())
        api, lock = self, threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the API's own servers

            def setup(self) -> None:
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with lock:
                    api.connections += 1
                    api._open.add(self.request)
                super().setup()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", "0")))
                api.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                api.plan(self)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.url = f"https://127.0.0.1:{self.port}"

    def close_idle(self) -> None:
        """Ends every connection the fake accepted (call it between answers: they are idle)."""
        for connection in list(self._open):
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed

    def __enter__(self) -> "FakeMessagesApi":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
