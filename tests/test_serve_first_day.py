"""A first heavy day (issue 46). A burst of creates, as a harness starting an eval makes it:
every create on its own connection, all sent at once, each answered (201, or 429/503 with
Retry-After), never a connection reset; the Python client retries what is safe to retry. And
serve's own edges: a port in use, an unbuilt workload, a health probe without the token."""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest

import reploy
import reploy_client
import reploy_serve
from serve_harness import (  # noqa: F401  (fixtures)
    ROOT, ServeProcess, managed_workload, seconds, serve_factory,
)

pytestmark = pytest.mark.docker

#: The burst: as many creates at once as serve's default --max-sessions admits.
BURST = 64
#: Each session's disk: small, so that the host's free space admits the whole burst.
BURST_DISK_MIB = 64


def create_at_once(server: ServeProcess, count: int) -> list[Any]:
    """`count` POST /sessions, each on its own new connection, released together: each is
    (status, Retry-After, body) or the exception its connection raised."""
    start = threading.Barrier(count)

    def create(index: int) -> Any:
        connection = http.client.HTTPConnection(server.api.host, server.api.port, timeout=300)
        body = json.dumps({"name": f"burst-{index}", "diskMib": BURST_DISK_MIB}).encode()
        headers = {**server.api.auth_headers, "Content-Type": "application/json"}
        try:
            start.wait()
            connection.request("POST", "/api/v1/sessions", body, headers)
            response = connection.getresponse()
            return response.status, response.getheader("Retry-After"), response.read()
        except OSError as e:
            return e
        finally:
            connection.close()

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(create, range(count)))


def test_a_burst_of_creates_is_answered_whole(serve_factory: Callable[..., ServeProcess]) -> None:
    server = serve_factory()
    answers = create_at_once(server, BURST)
    failures = [a for a in answers if isinstance(a, Exception)
                or not (a[0] == 201 or (a[0] in (429, 503) and a[1] is not None))]
    assert not failures, f"{len(failures)} of {BURST} creates failed: {failures[:5]}"
    created = [json.loads(a[2])["id"] for a in answers if a[0] == 201]
    listed = {s["id"] for s in server.api.call("GET", "/sessions")["sessions"]}
    assert set(created) <= listed


def test_a_burst_of_creates_through_the_python_client_all_succeed(
        serve_factory: Callable[..., ServeProcess]) -> None:
    """Each create on a client of its own (its own connection), all at once: every one
    returns a session (the client retries what is safe to retry)."""
    import reploy_client

    server = serve_factory()
    start = threading.Barrier(BURST // 2)

    def create(index: int) -> Any:
        with reploy_client.Client(server.ready["url"], token=server.ready["token"],
                                  allow_plain_http=True) as client:
            start.wait()
            try:
                return client.create(f"client-burst-{index}", diskMib=BURST_DISK_MIB).id
            except reploy_client.ReployError as e:
                return e

    with ThreadPoolExecutor(BURST // 2) as pool:
        created = list(pool.map(create, range(BURST // 2)))
    failures = [c for c in created if isinstance(c, Exception)]
    assert not failures, f"{len(failures)} of {BURST // 2} creates failed: {failures[:5]}"
    assert len(set(created)) == BURST // 2


# -- how serve starts, or refuses to ---------------------------------------------------------


def serve_once(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "reploy.py"), "serve", *args],
                          capture_output=True, timeout=120, stdin=subprocess.DEVNULL)


def test_a_port_in_use_is_one_line_and_exit_1(tmp_path: Path, managed_workload: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = serve_once("--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "s"),
                          "--workload-dir", str(managed_workload))
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["error"] == f"cannot listen on 127.0.0.1:{port}: Address already in use"
    assert proc.stderr.decode().splitlines() == [
        f"reploy: serve: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_an_unbuilt_workload_is_refused_at_start_saying_how_to_build_it(tmp_path: Path) -> None:
    unbuilt = tmp_path / "unbuilt"
    staged = subprocess.run([sys.executable, str(ROOT / "reploy.py"), "stage",
                             str(ROOT / "examples/managed/managed.blueprint.yaml"), "--dir", str(unbuilt)],
                            capture_output=True, timeout=60)
    assert staged.returncode == 0, staged.stderr
    proc = serve_once("--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "s"),
                      "--workload-dir", str(unbuilt))
    assert proc.returncode == 1
    assert (f"the workload deployment managed-workload in {unbuilt} is not built: run "
            f"`reploy build --dir {unbuilt}`") in proc.stderr.decode()


def test_healthz_answers_without_the_token(serve_factory: Callable[..., ServeProcess]) -> None:
    server = serve_factory()
    status, _, body = server.api.request("GET", "/api/v1/healthz", auth=False)
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    status, _, _ = server.api.request("GET", "/api/v1/config", auth=False)
    assert status == 401


def test_the_example_sessions_user_has_a_name(serve_factory: Callable[..., ServeProcess]) -> None:
    """examples/managed gives its runtime user a passwd entry: whoami answers."""
    server = serve_factory()
    sid = server.api.create("whoami")["id"]
    answer = server.api.call("POST", f"/sessions/{sid}/exec", {"argv": ["sh", "-c", "whoami; echo ~"]})
    assert answer["exitCode"] == 0, answer
    assert answer["stdout"] == "reploy\n/mnt/reploy-home\n"


# -- the session CLI, as people and pipelines use it ------------------------------------------


SID_A, SID_B, SID_C = "0123456789abcdef", "0123ffffffffffff", "fedcba9876543210"
LISTED = [(SID_A, "web"), (SID_B, "db"), (SID_C, "db")]


@pytest.mark.parametrize(("reference", "found"), [
    (SID_A, SID_A), ("fedcba9876543210", SID_C),  # an id is itself, listed or not
    ("aaaaaaaaaaaaaaaa", "aaaaaaaaaaaaaaaa"),
    ("web", SID_A), ("fed", SID_C), ("0123f", SID_B), ("0123456", SID_A),
])
def test_a_session_is_named_by_id_unique_name_or_unique_id_prefix(reference: str, found: str) -> None:
    assert reploy_serve.match_session(reference, LISTED) == found


@pytest.mark.parametrize(("reference", "error"), [
    ("db", "2 sessions are named 'db'"), ("0123", "2 session ids start with '0123'"),
    ("nosuch", "no session has the id, the name or an id starting with 'nosuch'"),
    ("", "no session"), ("0123456789abcdef0", "no session"), ("\x1b[2J", "'\\x1b[2J'"),
])
def test_a_reference_to_none_or_several_sessions_is_an_error(reference: str, error: str) -> None:
    with pytest.raises(reploy_client.ReployError, match=re.escape(error)):
        reploy_serve.match_session(reference, LISTED)


def test_the_list_table_shows_names_and_labels_as_text() -> None:
    table = reploy_serve.session_table([
        {"id": SID_A, "name": "x\x1b]0;pwned\x07", "workloadType": "shell", "state": "active",
         "cpus": 1, "diskMib": 64, "labels": {"team": "red\r\n", "a": "b"}}])
    header, row = table.splitlines()
    assert header.split() == ["ID", "NAME", "TYPE", "STATE", "CPUS", "DISK", "LABELS"]
    assert "\x1b" not in table and "\x07" not in table and "\r" not in table
    assert row.startswith(SID_A) and row.endswith("a=b,team=red\\x0d\\x0a") and "64M" in row


@pytest.mark.parametrize(("text", "seconds"), [("90m", 5400), ("1h", 3600), ("1.5h", 5400), ("1s", 1)])
def test_ttl_takes_a_duration(text: str, seconds: int) -> None:
    assert reploy_serve.ttl_seconds_argument(text) == seconds


@pytest.mark.parametrize("text", ["0s", "1500ms", "3600", "1h30m", ""])
def test_ttl_refuses_what_is_no_whole_duration(text: str) -> None:
    with pytest.raises(reploy.UsageError):
        reploy_serve.ttl_seconds_argument(text)


def session_cli(server: ServeProcess, *args: str, **kwargs: Any) -> subprocess.CompletedProcess:
    """`reploy session ACTION --server URL ARGS...`, authenticated by $REPLOY_TOKEN."""
    action, *rest = args
    return subprocess.run([sys.executable, str(ROOT / "reploy.py"), "session", action, "--server",
                           server.ready["url"], *rest], timeout=120, env=server.client_env(),
                          **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **kwargs})


def test_the_session_cli_for_pipelines_and_people(serve_factory: Callable[..., ServeProcess]) -> None:
    server = serve_factory()
    created = session_cli(server, "create", "--name", "first-day", "--ttl", "1h", "--label", "k=v")
    assert created.returncode == 0, created.stderr
    sid = json.loads(created.stdout)["id"]
    shown = server.api.get(sid)
    assert seconds(shown["expiresAt"]) - seconds(shown["createdAt"]) == 3600
    # By name and by id prefix.
    assert json.loads(session_cli(server, "get", "first-day").stdout)["id"] == sid
    assert json.loads(session_cli(server, "get", sid[:6]).stdout)["id"] == sid
    # An error: one line on stderr, nothing on stdout, exit 1.
    missing = session_cli(server, "get", "no-such-session")
    assert (missing.returncode, missing.stdout) == (1, b"")
    assert missing.stderr.decode().splitlines() == [
        "reploy: session get: no session has the id, the name or an id starting with "
        "'no-such-session' (not_found)"]
    gone = session_cli(server, "get", "ffffffffffffffff")
    assert (gone.returncode, gone.stdout) == (1, b"")
    assert gone.stderr.decode().endswith("(HTTP 404, not_found)\n")
    # One command line, run by sh -c; the argv form stays.
    for words in (["first-day", "echo a b | tr a-z A-Z", "--raw"], ["first-day", "--raw", "echo a b | tr a-z A-Z"],
                  ["--raw", "first-day", "echo a b | tr a-z A-Z"]):
        shell_line = session_cli(server, "exec", *words)
        assert (shell_line.returncode, shell_line.stdout) == (0, b"A B\n"), (words, shell_line.stderr)
    argv = session_cli(server, "exec", "first-day", "--raw", "--", "sh", "-c", "exit 3")
    assert argv.returncode == 3
    detached = json.loads(session_cli(server, "exec", "first-day", "--detach", "--", "sleep", "30").stdout)
    assert detached["detached"] is True and detached["pid"] > 0
    # A list in a pipe is JSON; on a terminal it is a table.
    assert [s["id"] for s in json.loads(session_cli(server, "list").stdout)["sessions"]] == [sid]
    leader, follower = pty.openpty()
    try:
        on_terminal = session_cli(server, "list", stdout=follower, stderr=subprocess.PIPE)
        assert on_terminal.returncode == 0
        os.close(follower)
        follower = -1
        table = read_until_eof(leader).decode()
    finally:
        if follower >= 0:
            os.close(follower)
        os.close(leader)
    assert table.split()[:7] == ["ID", "NAME", "TYPE", "STATE", "CPUS", "DISK", "LABELS"]
    assert f"{sid}  first-day" in table and "k=v" in table


def read_until_eof(fd: int) -> bytes:
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other side of the PTY closed
            return data
        if not chunk:
            return data
        data += chunk


def test_session_shell_is_a_terminal_on_the_session(serve_factory: Callable[..., ServeProcess]) -> None:
    """A real PTY as the user's terminal: its size reaches the session, typed lines run,
    Ctrl-C interrupts the foreground job as a byte, Ctrl-] leaves with exit 0."""
    server = serve_factory()
    server.api.create("terminal")
    pid, leader = pty.fork()
    if pid == 0:  # the child: the user's shell running `reploy session shell`
        os.environ.update(server.client_env())
        os.execv(sys.executable, [sys.executable, str(ROOT / "reploy.py"), "session", "shell",
                                  "terminal", "--server", server.ready["url"]])
    try:
        fcntl.ioctl(leader, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 111, 0, 0))
        seen = bytearray()

        def until(needle: bytes) -> None:
            deadline = time.monotonic() + 60
            while needle not in seen:
                assert time.monotonic() < deadline, f"never saw {needle!r} in {bytes(seen)[-500:]!r}"
                ready, _, _ = select.select([leader], [], [], 1)
                if ready:
                    seen.extend(os.read(leader, 65536))

        until(b"Ctrl-] leaves")
        os.write(leader, b"stty size; echo sum-$((6*7))\r")
        until(b"sum-42")
        assert b"33 111" in seen
        os.write(leader, b"sleep 300; echo not-interrupted\r")
        until(b"sleep 300")
        os.write(leader, b"\x03")
        os.write(leader, b"echo after-$((2+2))\r")
        until(b"after-4")
        assert b"\nnot-interrupted" not in seen  # the echo of the typed line holds it, not its output
        os.write(leader, b"\x1d")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(leader)
