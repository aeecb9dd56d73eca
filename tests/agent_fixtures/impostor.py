"""The impostor agent of issue 21 (tests/test_serve_boundary.py): a workload process that tries to
take the control socket's place and pass every call through, answering a download with a `size`
that injects a header into serve's response.

Started from an exec, it forks into a session of its own (so it outlives the exec), then keeps
trying for SECONDS: move control.sock aside and listen in its place, or listen beside it and
rename over it. Each try appends one JSON line to LOG (`{"try": name, "outcome": "ok"|errno}`);
a connection it accepts appends `{"connection": ...}` and gets the injected answer. The parent
returns once the first round of tries is in the log.

    python3 impostor.py SOCKET LOG SECONDS
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time

#: What the impostor of the issue answered to `download`: a size that ends serve's headers and
#: starts a page of its own.
INJECTED = {"id": "serve", "result": {"type": "download", "transfer_id": "0" * 16, "kind": "file",
                                      "size": "5\r\nContent-Type: text/html\r\n\r\n<script>pwn()</script>",
                                      "entry": {"name": "f", "type": "file", "size": 5, "mode": 420,
                                                "mtime": 0}}}


def record(log: str, entry: dict) -> None:
    with open(log, "a") as f:
        f.write(json.dumps(entry) + "\n")


def attempt(log: str, name: str, action) -> object:
    try:
        result = action()
    except OSError as e:
        record(log, {"try": name, "outcome": errno.errorcode.get(e.errno or 0, str(e.errno))})
        return None
    record(log, {"try": name, "outcome": "ok"})
    return result


def listening(path: str) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(path)
        server.listen(8)
    except OSError:
        server.close()
        raise
    return server


def take_over(sock_path: str, log: str) -> list[socket.socket]:
    """One round of tries; the listening sockets any of them got."""
    got = []
    attempt(log, "move_aside", lambda: os.rename(sock_path, sock_path + ".real"))
    server = attempt(log, "listen_in_place", lambda: listening(sock_path))
    if server is not None:
        got.append(server)
    server = attempt(log, "listen_beside", lambda: listening(sock_path + ".new"))
    if server is not None:
        got.append(server)
        attempt(log, "rename_over", lambda: os.rename(sock_path + ".new", sock_path))
    return got


def main() -> int:
    sock_path, log, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    ready_read, ready_write = os.pipe()
    if os.fork():
        os.close(ready_write)
        os.read(ready_read, 1)
        return 0
    os.setsid()
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    servers = take_over(sock_path, log)
    os.write(ready_write, b"!")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for server in servers:
            server.settimeout(0.05)
            try:
                connection, _ = server.accept()
            except socket.timeout:
                continue
            with connection:
                request = connection.recv(1 << 20)
                record(log, {"connection": request[:200].decode(errors="replace")})
                connection.sendall(json.dumps(INJECTED).encode() + b"\n")
        if not servers:  # again each second: the boundary must hold, not only at first
            time.sleep(1.0)
            servers = take_over(sock_path, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
