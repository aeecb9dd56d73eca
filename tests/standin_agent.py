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

import array
import json
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Union

import agent
import reploy_serve

@dataclass(frozen=True)
class WithFds:
    """A reply (fields or a raw line) sent with these file descriptors (SCM_RIGHTS) on its
    first bytes; the stand-in closes its copies once sent."""

    reply: Union[dict[str, Any], bytes]
    fds: tuple[int, ...]


#: An answer: a result's fields (sent as {"id", "result": {"type": method, **fields}}), a raw
#: response line, either with descriptors (WithFds), or a function of the request (its id,
#: method and params) giving one of those, or an iterator of raw pieces, each sent as it comes
#: (a peer that trickles).
Reply = Union[dict[str, Any], bytes, WithFds, Iterator[bytes]]
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


def send_with_fds(connection: socket.socket, data: bytes, fds: tuple[int, ...]) -> None:
    """data, the fds on its first bytes, then the stand-in's copies of them closed."""
    try:
        if fds:
            rights = array.array("i", fds).tobytes()
            sent = connection.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
            data = data[sent:]
        connection.sendall(data)
    finally:
        for fd in fds:
            os.close(fd)


def pipe_of(pieces: Iterator[bytes]) -> int:
    """The read end of a pipe a thread writes pieces into, then closes (or stops writing when
    the reader closed its end): what a directory download's answer carries."""
    read_end, write_end = os.pipe()

    def feed() -> None:
        with open(write_end, "wb", buffering=0) as sink:
            for piece in pieces:
                try:
                    sink.write(piece)
                except BrokenPipeError:
                    return
    threading.Thread(target=feed, name="standin-tar-pipe", daemon=True).start()
    return read_end


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
                reply = (self._relay(line) if answer is None
                         else answer(request) if callable(answer) else answer)
                fds: tuple[int, ...] = ()
                if isinstance(reply, WithFds):
                    fds = reply.fds
                    reply = reply.reply
                if isinstance(reply, (dict, bytes)):
                    send_with_fds(connection, result_line(request, reply) if isinstance(reply, dict)
                                  else reply, fds)
                else:
                    for piece in reply:
                        connection.sendall(piece)
            except OSError:
                pass  # serve hung up (a deadline, a client gone): nothing to answer

    def _relay(self, line: bytes) -> WithFds:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as upstream:
            upstream.settimeout(15)
            dir_fd = os.open(self.real.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                upstream.connect(f"/proc/self/fd/{dir_fd}/{self.real.name}")
            finally:
                os.close(dir_fd)
            upstream.sendall(line)
            response = b""
            fds: list[int] = []
            while not response.endswith(b"\n"):
                chunk, ancillary, _, _ = upstream.recvmsg(1 << 20, socket.CMSG_SPACE(4 * 4))
                fds += agent.received_fds(ancillary)
                if not chunk:
                    break
                response += chunk
            return WithFds(response, tuple(fds))

    def close(self) -> None:
        """Stop answering and give the path back to the real agent."""
        self.stopping.set()
        self.thread.join(timeout=10)
        self.server.close()
        if self.real.exists():
            os.replace(self.real, self.path)
