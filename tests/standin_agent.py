"""A stand-in for one managed session's agent: a server of the test's own on the session's
control socket, as the impostor of issue 21 was (a process listening in the agent's place) or
as a hostile or broken agent would answer.

It speaks the control socket's protocol (docs/agent.md: one request line, one response line per
connection). A request whose method has an entry in `answers` gets that answer; every other
request is relayed to the real agent, whose socket was moved aside, so the session keeps
working around the one family under test. Every request is recorded in `requests`.

Serve reaches the agent through one socket path; `control_socket()` is the one place that says
where it is, so a change of the session directory's layout is one edit here.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Union

import agent
import reploy_serve

#: An answer: a result's fields (sent as {"id", "result": {"type": method, **fields}}), a raw
#: response line, or a function of the request (its id, method and params) giving either, or
#: an iterator of raw pieces, each sent as it comes (a peer that trickles).
Reply = Union[dict[str, Any], bytes, Iterator[bytes]]
Answer = Union[dict[str, Any], bytes, Callable[[dict[str, Any]], Reply]]
STANDIN_SUFFIX = ".standin"
REAL_SUFFIX = ".real"


def control_socket(state_dir: Path, session_id: str) -> Path:
    """Where `serve` (state dir `state_dir`) reaches the agent of session `session_id`."""
    return state_dir / "sessions" / session_id / agent.AGENT_DIR_NAME / reploy_serve.SOCKET_NAME


def _bind_at(sock: socket.socket, path: Path) -> None:
    """bind(2) through /proc/self/fd, so a long directory cannot exceed sun_path."""
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        sock.bind(f"/proc/self/fd/{dir_fd}/{path.name}")
    finally:
        os.close(dir_fd)


def result_line(request: dict[str, Any], fields: dict[str, Any]) -> bytes:
    """The response line of a well-formed result."""
    return json.dumps({"id": request["id"], "result": {"type": request["method"], **fields}}).encode() + b"\n"


class StandInAgent:
    """Takes over `path` (the session's control socket) until close(), which puts the real
    agent's socket back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.real = path.with_name(path.name + REAL_SUFFIX)
        self.answers: dict[str, Answer] = {}
        self.requests: list[dict[str, Any]] = []
        self.stopping = threading.Event()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        staged = path.with_name(path.name + STANDIN_SUFFIX)
        _bind_at(self.server, staged)
        self.server.listen(64)
        self.server.settimeout(0.2)
        os.rename(path, self.real)
        os.rename(staged, path)
        self.thread = threading.Thread(target=self._accept, name="standin-agent", daemon=True)
        self.thread.start()

    def methods(self) -> list[str]:
        return [request.get("method", "") for request in list(self.requests)]

    def count(self, method: str) -> int:
        return self.methods().count(method)

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                connection, _ = self.server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            connection.settimeout(10)
            line = b""
            try:
                while not line.endswith(b"\n"):
                    chunk = connection.recv(1 << 20)
                    if not chunk:
                        return
                    line += chunk
                request = json.loads(line)
                self.requests.append(request)
                answer = self.answers.get(request.get("method", ""))
                if answer is None:
                    connection.sendall(self._relay(line))
                    return
                reply = answer(request) if callable(answer) else answer
                if isinstance(reply, dict):
                    connection.sendall(result_line(request, reply))
                elif isinstance(reply, bytes):
                    connection.sendall(reply)
                else:
                    for piece in reply:
                        connection.sendall(piece)
            except OSError:
                pass  # serve hung up (a deadline, a client gone): nothing to answer

    def _relay(self, line: bytes) -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as upstream:
            upstream.settimeout(15)
            dir_fd = os.open(self.real.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                upstream.connect(f"/proc/self/fd/{dir_fd}/{self.real.name}")
            finally:
                os.close(dir_fd)
            upstream.sendall(line)
            response = b""
            while not response.endswith(b"\n"):
                chunk = upstream.recv(1 << 20)
                if not chunk:
                    break
                response += chunk
            return response

    def close(self) -> None:
        """Stop answering and give the path back to the real agent."""
        self.stopping.set()
        self.thread.join(timeout=10)
        self.server.close()
        if self.real.exists():
            os.replace(self.real, self.path)
