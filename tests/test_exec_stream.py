"""A streamed exec (issue 46 item 3): `"stream": true` answers NDJSON lines as the command runs,
the client's on_stdout/on_stderr get each piece as it comes, and `reploy session exec --raw`
passes it through. Each live test gates its command on a file the test makes only after it saw
the first output: output that arrived while the gate was shut came before the command ended.
The client checks each line as something a hostile session shaped."""

from __future__ import annotations

import base64
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import pytest

import reploy_client
import reploy_serve
from serve_harness import ROOT, ServeProcess, managed_workload, serve_factory, wait_until  # noqa: F401  (fixtures)

#: Prints a line on each stream, waits for the file `gate` in the workspace, prints again, exits 7.
GATED = ("echo first; echo early >&2; while [ ! -e gate ]; do sleep 0.05; done; "
         "echo second; echo late >&2; exit 7")
LINE = reploy_client.MAX_EXEC_LINE_BYTES

# -- the lines, pure --------------------------------------------------------------------------


def test_serves_lines_are_what_the_client_reads() -> None:
    page = bytes(range(256)) * 1024  # one agent page, every byte value
    line = reploy_client.parse_exec_line(reploy_serve.exec_output_line("stderr", page))
    assert (line.stream, line.data, line.end, line.error) == ("stderr", page, None, None)
    final = {"exec_id": "e1", "exit_code": None, "signal": "SIGKILL", "timed_out": True, "killed": False,
             "duration_ms": 12.5, "stdout_truncated": False, "stderr_truncated": True}
    end = reploy_client.parse_exec_line(reploy_serve.exec_end_line(final)).end
    assert end == reploy_client.ExecResult(exit_code=None, stdout=b"", stderr=b"", timed_out=True,
                                           truncated=True, signal="SIGKILL", duration_ms=12.5)
    error = reploy_client.parse_exec_line(b'{"error":"agent: gone","code":"unavailable"}\n').error
    assert error is not None and (error.status, error.code, error.reason) == (None, "unavailable", "agent: gone")


def end_line(**changes: Any) -> bytes:
    document = {"execId": "e1", "exitCode": 0, "signal": None, "timedOut": False, "killed": False,
                "durationMs": 1, "stdoutTruncated": False, "stderrTruncated": False, **changes}
    return json.dumps({k: v for k, v in document.items() if v != "absent"}).encode() + b"\n"


@pytest.mark.parametrize("line", [
    b'{"stdoutBase64":"aGk=","extra":1}\n',  # an unknown field beside a known one
    b'{"stdinBase64":"aGk="}\n',  # a field of no kind of line
    b'{"stdoutBase64":"aGk=","stderrBase64":"aGk="}\n',  # two kinds in one
    b'{"stdoutBase64":"aGk!"}\n', b'{"stdoutBase64":"aGk"}\n', b'{"stdoutBase64":7}\n',  # not base64
    b'{"stdoutBase64":"aGk=","stdoutBase64":"aGk="}\n',  # a duplicate key
    b'{"stdoutBase64":"aGk="}', b'{"stdoutBase64":"aGk="} \n', b'[1]\n', b'\n',  # unended, space, no object
    b'{"stdoutBase64":"' + b"A" * LINE + b'"}\n',  # longer than a line may be
    end_line(exitCode=256), end_line(exitCode=True), end_line(signal="KILL"), end_line(durationMs="1"),
    end_line(stdoutTruncated=0), end_line(killed="absent"), end_line(note="x"),
    b'{"error":"x","code":1}\n', b'{"error":"x","status":500}\n',
])
def test_a_hostile_line_is_refused(line: bytes) -> None:
    with pytest.raises(reploy_client.AnswerInvalid):
        reploy_client.parse_exec_line(line)


def test_the_line_bound_holds_one_agent_page_and_a_stream_is_never_detached() -> None:
    import agent

    page = reploy_serve.exec_output_line("stdout", b"\xff" * agent.EXEC_PAGE_BYTES)
    assert len(page) <= LINE and reploy_client.parse_exec_line(page).data == b"\xff" * agent.EXEC_PAGE_BYTES
    body = reploy_serve.parse_body(b'{"argv": ["true"], "stream": true, "detach": true}',
                                   reploy_serve.BODY_RULES["exec"])
    with pytest.raises(reploy_serve.BadRequest, match="stream"):
        reploy_serve.exec_params(body)
    streamed = reploy_serve.exec_params(reploy_serve.parse_body(b'{"argv": ["true"], "stream": true}',
                                                                reploy_serve.BODY_RULES["exec"]))
    assert "stream" not in streamed  # serve's own, never the agent's

# -- live ---------------------------------------------------------------------------------------


def gated(session: reploy_client.Session, run: Callable[[reploy_client.Session, threading.Event], Any],
          seen_first: threading.Event) -> Any:
    """`run(session, gate_open)` in a thread; once `seen_first` is set (by what run saw, while
    the gate is shut), the gate opens. Returns what run returned."""
    results: list[Any] = []
    gate_open = threading.Event()
    worker = threading.Thread(target=lambda: results.append(run(session, gate_open)), daemon=True)
    worker.start()
    try:
        assert seen_first.wait(60), "no output came while the command waited for its gate"
        assert worker.is_alive() and not gate_open.is_set()
    finally:
        gate_open.set()
        session.files.write("gate", b"")
        worker.join(120)
    assert results, "the exec did not return"
    return results[0]


@pytest.mark.docker
def test_the_clients_callbacks_get_output_before_the_command_ends(
        serve_factory: Callable[..., ServeProcess]) -> None:
    server = serve_factory()
    seen_first = threading.Event()
    stdout: list[tuple[bytes, bool]] = []  # each piece, and whether the gate was open when it came
    stderr: list[bytes] = []

    def run(session: reploy_client.Session, gate_open: threading.Event) -> reploy_client.ExecResult:
        def on_stdout(data: bytes) -> None:
            stdout.append((data, gate_open.is_set()))
            if b"first\n" in b"".join(piece for piece, _ in stdout):
                seen_first.set()
        return session.exec(["sh", "-c", GATED], timeout=120, on_stdout=on_stdout, on_stderr=stderr.append)

    with reploy_client.Client(server.ready["url"], token=server.ready["token"]) as client:
        with client.create(name="stream") as session:
            check_streamed(session, gated(session, run, seen_first), stdout, stderr)


def check_streamed(session: reploy_client.Session, result: reploy_client.ExecResult,
                   stdout: list[tuple[bytes, bool]], stderr: list[bytes]) -> None:
    assert (result.exit_code, result.stdout, result.stderr, result.timed_out, result.truncated) == (
        7, b"first\nsecond\n", b"early\nlate\n", False, False)
    assert b"".join(piece for piece, _ in stdout) == result.stdout and b"".join(stderr) == result.stderr
    assert not stdout[0][1] and stdout[0][0].startswith(b"first\n")
    # Without callbacks, the whole answer as before; a cap still holds in a stream.
    assert session.exec(["sh", "-c", "echo whole"]).stdout == b"whole\n"
    pieces: list[bytes] = []
    capped = session.exec(["sh", "-c", "head -c 100 /dev/zero"], max_output_bytes=10, on_stdout=pieces.append)
    assert (capped.stdout, capped.truncated, b"".join(pieces)) == (b"\0" * 10, True, b"\0" * 10)


def stream_request(server: ServeProcess, sid: str, body: dict[str, Any]) -> socket.socket:
    """A streamed exec's request on a raw connection, its answer unread."""
    data = json.dumps({**body, "stream": True}).encode()
    connection = socket.create_connection((server.api.host, server.api.port), timeout=60)
    connection.sendall(f"POST /api/v1/sessions/{sid}/exec HTTP/1.1\r\nHost: {server.api.host}:{server.api.port}\r\n"
                       f"Authorization: Bearer {server.ready['token']}\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return connection


@pytest.mark.docker
def test_the_stream_on_the_wire_its_errors_and_a_client_that_goes(
        serve_factory: Callable[..., ServeProcess]) -> None:
    server = serve_factory()
    api = server.api
    sid = api.create("wire")["id"]
    status, headers, body = api.request("POST", f"/api/v1/sessions/{sid}/exec", json.dumps(
        {"argv": ["sh", "-c", "printf a; printf b >&2; exit 3"], "stream": True}).encode())
    assert status == 200 and headers["content-type"] == "application/x-ndjson"
    assert headers["transfer-encoding"] == "chunked"
    lines = [json.loads(line) for line in body.splitlines()]
    assert {"stdoutBase64": base64.b64encode(b"a").decode()} in lines
    assert {"stderrBase64": base64.b64encode(b"b").decode()} in lines
    assert lines[-1] == {**{k: lines[-1][k] for k in ("execId", "durationMs")}, "exitCode": 3, "signal": None,
                         "timedOut": False, "killed": False, "stdoutTruncated": False, "stderrTruncated": False}
    # Errors before the command starts are ordinary answers, with their status.
    for bad, expect in (({"argv": ["true"], "detach": True}, 400), ({"argv": ["no-such-program"]}, 422),
                        ({"argv": ["true"], "stream": 1}, 400)):
        status, headers, body = api.request("POST", f"/api/v1/sessions/{sid}/exec",
                                            json.dumps({"stream": True, **bad}).encode())
        assert status == expect and headers["content-type"] == "application/json", (bad, body)
    # A client that goes away kills its command: the command's own pid is its first line.
    connection = stream_request(server, sid, {"argv": ["sh", "-c", "echo $$; exec sleep 1000"]})
    reader = connection.makefile("rb")
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        head += reader.readline()
    assert head.startswith(b"HTTP/1.1 200")
    reader.readline()  # the chunk's size
    pid = int(base64.b64decode(json.loads(reader.readline())["stdoutBase64"]))
    alive = {"argv": ["sh", "-c", f"kill -0 {pid}"]}
    assert api.call("POST", f"/sessions/{sid}/exec", alive)["exitCode"] == 0
    reader.close()
    connection.close()
    wait_until(lambda: api.call("POST", f"/sessions/{sid}/exec", alive)["exitCode"],
               "the command to be killed once its client went")


@pytest.mark.docker
def test_the_cli_passes_raw_output_through_as_it_comes(serve_factory: Callable[..., ServeProcess]) -> None:
    server = serve_factory()
    sid = server.api.create("cli-stream")["id"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "reploy.py"), "session", "exec", "--server",
                             server.ready["url"], sid, "--raw", "--", "sh", "-c", GATED],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=server.client_env())
    assert proc.stdout is not None and proc.stderr is not None
    try:
        early = b""
        deadline = time.monotonic() + 60
        while b"first\n" not in early and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))[0]:
                piece = os.read(proc.stdout.fileno(), 4096)
                if not piece:
                    break
                early += piece
        assert early == b"first\n", "the CLI showed nothing while the command waited for its gate"
        assert proc.poll() is None
    finally:
        server.api.call("POST", f"/sessions/{sid}/exec", {"argv": ["touch", "gate"]})
        out, err = proc.communicate(timeout=120)
    assert (proc.returncode, early + out, err) == (7, b"first\nsecond\n", b"early\nlate\n")
