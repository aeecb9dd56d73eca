"""reploy_client.py: its pure core (server URLs, paths, the error mapping, answer checks, SSE
events), and the session API against a real serve with real sessions."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import reploy_client
from serve_harness import ROOT, ServeProcess, cli_error, managed_workload, serve_processes  # noqa: F401 - a fixture

TOKEN = "k" * 43

# -- the pure core --------------------------------------------------------------------------


def test_the_client_imports_without_the_docker_sdk_or_the_host() -> None:
    """A harness imports the client without Reploy's host dependencies."""
    probe = ("import sys; sys.modules['docker'] = None; sys.modules['yaml'] = None; "
             "sys.modules['psutil'] = None; import reploy_client; "
             "assert 'reploy' not in sys.modules and 'reploy_serve' not in sys.modules")
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True, timeout=60)


@pytest.mark.parametrize(("path", "target"), [
    ("a/b.txt", ("workspace", "a/b.txt")), ("", ("workspace", "")),
    ("~/.config/x", ("home", ".config/x")), ("~", ("home", "")), ("/etc/passwd", ("workspace", "/etc/passwd")),
])
def test_file_targets(path: str, target: tuple[str, str]) -> None:
    assert reploy_client.file_target(path) == target


def test_file_routes_keep_the_routes_own_slashes() -> None:
    sid = "0123456789abcdef"
    assert reploy_client.file_route("files", sid, "workspace", "a b/c") == f"/sessions/{sid}/files/a%20b/c"
    assert reploy_client.file_route("list", sid, "home", "x", 0o755) == f"/sessions/{sid}/list/x?root=home&mode=0755"
    assert reploy_client.file_route("files", sid, "workspace", "/tmp/x") == f"/sessions/{sid}/files/%2Ftmp/x"
    assert reploy_client.file_route("files", sid, "home", "x", sha256="ab" * 32) == (
        f"/sessions/{sid}/files/x?root=home&sha256={'ab' * 32}")


@pytest.mark.parametrize(("status", "code", "reason", "kind"), [
    (404, "not_found", "x", FileNotFoundError), (403, "permission_denied", "x", PermissionError),
    (409, "is_a_directory", "x", IsADirectoryError), (409, "not_a_directory", "x", NotADirectoryError),
    (404, None, "agent: no such file or directory: a", FileNotFoundError),
    (409, None, "agent: cannot open a: Permission denied", PermissionError),
    (422, None, "agent: cannot run '/etc/passwd': Permission denied", PermissionError),
    (504, None, "agent: no answer in time", TimeoutError),
    (404, None, "no session 0123456789abcdef", reploy_client.ReployError),
    (400, "bad_request", "argv: required", reploy_client.ReployError),
])
def test_errors_map_by_code_then_by_stable_words(status: int, code: Any, reason: str, kind: type) -> None:
    error = reploy_client.error_for(status, code, reason)
    assert isinstance(error, kind) and isinstance(error, reploy_client.ReployError)
    assert (error.status, error.code, error.reason) == (status, code, reason)
    if kind is reploy_client.ReployError:
        assert not isinstance(error, OSError)


def test_an_error_document_carries_a_code_only_when_serve_sent_one() -> None:
    assert reploy_client.ReployError(404, None, "gone").document == {"error": "gone", "status": 404}
    assert reploy_client.ReployError(403, "permission_denied", "no").document == {
        "error": "no", "status": 403, "code": "permission_denied"}


def exec_answer(**changes: Any) -> dict[str, Any]:
    return {"execId": "e1", "exitCode": 3, "signal": None, "timedOut": False, "killed": False,
            "durationMs": 5.0, "stdout": "o", "stdoutBase64": base64.b64encode(b"o\xff").decode(),
            "stdoutTruncated": False, "stderr": "", "stderrBase64": "", "stderrTruncated": True,
            **changes}


def test_exec_answers_are_checked() -> None:
    result = reploy_client.parse_exec_result(exec_answer())
    assert (result.exit_code, result.stdout, result.stderr, result.timed_out, result.truncated) == (
        3, b"o\xff", b"", False, True)
    for bad in ({"exitCode": True}, {"exitCode": 256}, {"signal": "TERM"}, {"timedOut": 1},
                {"stdoutBase64": "!!"}, {"stderrBase64": None}):
        with pytest.raises(reploy_client.AnswerInvalid):
            reploy_client.parse_exec_result(exec_answer(**bad))


def test_exec_answers_carry_each_stream_in_the_form_they_name() -> None:
    result = reploy_client.parse_exec_result(exec_answer(
        stdoutEncoding="text", stdout="caf\u00e9", stdoutBase64=None,
        stderrEncoding="base64", stderr=None, stderrBase64=base64.b64encode(b"\x01\xff").decode()))
    assert (result.stdout, result.stderr) == ("caf\u00e9".encode(), b"\x01\xff")
    for bad in ({"stdoutEncoding": "hex"}, {"stdoutEncoding": "text", "stdout": 1},
                {"stdoutEncoding": "base64", "stdoutBase64": "!!"},
                {"stdoutEncoding": "text", "stdout": "\ud800"}):
        with pytest.raises(reploy_client.AnswerInvalid):
            reploy_client.parse_exec_result(exec_answer(**bad))


def test_the_client_knows_the_agents_exec_bounds() -> None:
    import agent

    assert reploy_client.MAX_INLINE_STDIN_BYTES == agent.MAX_EXEC_STDIN_BYTES
    assert reploy_client.DEFAULT_EXEC_OUTPUT_BYTES == agent.DEFAULT_EXEC_OUTPUT_CAP_BYTES
    assert reploy_client.MAX_EXEC_OUTPUT_BYTES == agent.MAX_EXEC_OUTPUT_CAP_BYTES
    # The answer it accepts holds both streams' base64 at the cap asked for, and not much more.
    for cap in (None, 0, 10, 10 << 20, 16 << 20):
        base64_bytes = ((cap if cap is not None else agent.DEFAULT_EXEC_OUTPUT_CAP_BYTES) + 2) // 3 * 4
        assert 2 * base64_bytes < reploy_client.exec_answer_limit(cap) <= 2 * base64_bytes + 64 * 1024


def test_exec_bodies() -> None:
    assert reploy_client.exec_body(["ls"], None, None, None, None, None) == {"argv": ["ls"]}
    assert reploy_client.exec_body(["cat"], "/tmp", {"A": "1"}, b"", 1.5, 10) == {
        "argv": ["cat"], "cwd": "/tmp", "env": {"A": "1"}, "stdinBase64": "", "timeoutMs": 1500,
        "maxOutputBytes": 10}
    assert reploy_client.exec_body(["wc"], None, None, None, None, None, stdin_path="f")["stdinPath"] == "f"
    with pytest.raises(ValueError):
        reploy_client.exec_body([], None, None, None, None, None)


def test_sse_events() -> None:
    payload = base64.b64encode(b"hi").decode()
    assert reploy_client.parse_sse_event([
        "id: 7", "event: output", f'data: {{"offset":5,"payloadBase64":"{payload}","nextOffset":7}}']
    ) == reploy_client.OutputChunk(5, b"hi", 7)
    assert reploy_client.parse_sse_event(["id: 9", "event: reset", 'data: {"nextOffset":9}']) == (
        reploy_client.OutputChunk(9, b"", 9, reset=True))
    assert reploy_client.parse_sse_event([": keepalive"]) is None
    with pytest.raises(reploy_client.AnswerInvalid):
        reploy_client.parse_sse_event(["data: [1]"])


def test_a_client_checks_its_server_and_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REPLOY_TOKEN", raising=False)
    with pytest.raises(ValueError, match="allow-plain-http"):
        reploy_client.Client("http://192.0.2.1:8080")
    assert reploy_client.Client("http://192.0.2.1:8080", allow_plain_http=True).token is None
    with pytest.raises(reploy_client.CredentialError):
        reploy_client.Client("http://127.0.0.1:1", token="short")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o644)
    with pytest.raises(reploy_client.CredentialError, match="open to other users"):
        reploy_client.Client("http://127.0.0.1:1", token_file=token_file)
    token_file.chmod(0o600)
    monkeypatch.setenv("REPLOY_TOKEN", "m" * 43)
    assert reploy_client.Client("http://127.0.0.1:1", token_file=token_file).token == TOKEN
    assert reploy_client.Client("http://127.0.0.1:1").token == "m" * 43

@contextlib.contextmanager
def local_server(method: str, answer: Callable[[Any], tuple[int, bytes, bool]]) -> Iterator[str]:
    """An HTTP/1.1 server on loopback whose every `method` request is answered with JSON by
    `answer(handler) -> (status, body, close the connection after it)`; its URL."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def respond(self) -> None:
            status, body, close, *headers = answer(self)
            self.send_response(status)
            for name, value in (headers[0] if headers else {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = close  # without a Connection: close header

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's
            pass

    setattr(Handler, f"do_{method}", Handler.respond)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_stale_keep_alive_connection_is_retried_once_on_a_new_one() -> None:
    """A server that drops each connection after its answer without saying so (an idle
    keep-alive timing out): the pooled connection fails before anything is answered on it,
    and the call goes through on a fresh one."""
    connections: list[int] = []

    def answer(handler: Any) -> tuple[int, bytes, bool]:
        connections.append(id(handler.connection))
        return 200, b'{"sessions": []}', True

    with local_server("GET", answer) as url, reploy_client.Client(url, token=TOKEN) as client:
        assert client.sessions() == [] and len(client.connections._idle) == 1
        assert client.sessions() == [] and client.sessions() == []
    assert len(connections) == 3


@pytest.mark.parametrize(("tries_made", "waited_s", "retry_after", "pause_s"), [
    (1, 0.0, None, reploy_client.RETRY_FIRST_PAUSE_S),  # refused or reset before sending
    (2, 0.25, None, 2 * reploy_client.RETRY_FIRST_PAUSE_S),
    (3, 0.75, None, 4 * reploy_client.RETRY_FIRST_PAUSE_S),
    (reploy_client.RETRY_TRIES, 0.0, None, None),  # the last try was made
    (1, 0.0, "7", 7.0), (1, 0.0, "0", 0.0),
    (1, reploy_client.RETRY_BUDGET_S - 5, "7", None),  # past the budget: the refusal stands
    (1, 0.0, "Wed, 21 Oct 2026 07:28:00 GMT", None), (1, 0.0, "-1", None), (1, 0.0, "1.5", None),
    (1, 0.0, "\u0661", None), (1, 0.0, "9999999", None),
])
def test_the_retry_policy(tries_made: int, waited_s: float, retry_after: Any, pause_s: Any) -> None:
    assert reploy_client.RetryPolicy().pause_s(tries_made, waited_s, retry_after) == pause_s


def test_a_refusal_with_retry_after_is_tried_again_within_the_budget() -> None:
    """429 with Retry-After twice, then 201: one call, three requests. A Retry-After past the
    budget is not waited for: the 429 is the answer."""
    answers = [(429, b'{"error": "busy", "code": "too_many_requests"}', False, {"Retry-After": "0"})] * 2
    answers.append((201, b'{"sessions": []}', False, {}))
    seen: list[str] = []

    def answer(handler: Any) -> Any:
        seen.append(handler.path)
        return answers[len(seen) - 1]

    with local_server("GET", answer) as url, reploy_client.Client(url, token=TOKEN) as client:
        assert client.request("GET", "/sessions").status == 201
    assert len(seen) == 3

    seen.clear()
    answers[0] = (429, b'{"error": "full", "code": "too_many_requests"}', False,
                  {"Retry-After": str(int(reploy_client.RETRY_BUDGET_S) + 1)})
    with local_server("GET", answer) as url, reploy_client.Client(url, token=TOKEN) as client:
        with pytest.raises(reploy_client.ReployError) as refused:
            client.sessions()
    assert refused.value.status == 429 and len(seen) == 1


def test_a_refused_connection_is_tried_again_until_serve_listens() -> None:
    """The port refuses connections until the policy is asked to wait the first time; the
    call then goes through on the next try. Without a listener at all, the call fails after
    its tries with the refusal named."""
    import http.server
    import socket

    placeholder = socket.socket()
    placeholder.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    port = placeholder.getsockname()[1]
    started: list[http.server.HTTPServer] = []

    class ListenOnFirstPause(reploy_client.RetryPolicy):
        def pause_s(self, tries_made: int, waited_s: float, retry_after: Any) -> Any:
            if not started:
                placeholder.close()
                server = http.server.HTTPServer(("127.0.0.1", port), Ok)
                threading.Thread(target=server.serve_forever, daemon=True).start()
                started.append(server)
            return super().pause_s(tries_made, waited_s, retry_after)

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "16")
            self.end_headers()
            self.wfile.write(b'{"sessions": []}')

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's
            pass

    try:
        with reploy_client.Client(f"http://127.0.0.1:{port}", token=TOKEN,
                                  retry=ListenOnFirstPause()) as client:
            assert client.sessions() == []
    finally:
        for server in started:
            server.shutdown()
            server.server_close()
        placeholder.close()

    unused = socket.socket()
    unused.bind(("127.0.0.1", 0))
    with unused, reploy_client.Client(f"http://127.0.0.1:{unused.getsockname()[1]}", token=TOKEN,
                                      retry=reploy_client.RetryPolicy(tries=2)) as client:
        with pytest.raises(reploy_client.ReployError, match="Connection refused"):
            client.sessions()


def test_a_write_sends_the_digest_of_its_bytes() -> None:
    """Files.write knows its bytes: their sha256 travels with them (?sha256=), so the session
    commits only what was sent."""
    puts: list[tuple[str, bytes]] = []

    def answer(handler: Any) -> tuple[int, bytes, bool]:
        puts.append((handler.path, handler.rfile.read(int(handler.headers["Content-Length"]))))
        return 201, b'{"path": "f", "bytes": 4}', False

    with local_server("PUT", answer) as url, reploy_client.Client(url, token=TOKEN) as client:
        client.session("0" * 16).files.write("d/f", "caf\u00e9")
    [(path, body)] = puts
    assert body == "caf\u00e9".encode() and path == (
        f"/api/v1/sessions/{'0' * 16}/files/d/f?sha256={hashlib.sha256(body).hexdigest()}")


# -- against a real serve -------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(docker_client: Any, managed_workload: Path) -> Iterator[ServeProcess]:  # noqa: F811
    with serve_processes(managed_workload) as start:
        yield start()


@pytest.fixture
def client(server: ServeProcess) -> Iterator[reploy_client.Client]:
    with reploy_client.Client(server.ready["url"], token=server.ready["token"]) as client:
        yield client


@pytest.mark.docker
def test_a_session_is_deleted_when_its_block_ends(client: reploy_client.Client) -> None:
    with client.create(name="block") as session:
        assert session.get()["state"] == "active"
        assert session.id in {s["id"] for s in client.sessions()}
    with pytest.raises(reploy_client.ReployError) as gone:
        session.get()
    assert gone.value.status == 404
    session.delete()  # already gone: not an error


@pytest.mark.docker
def test_exec_results_files_and_errors(client: reploy_client.Client) -> None:
    with client.create(name="exec") as s:
        seen: list[bytes] = []
        result = s.exec(["sh", "-c", 'printf "$A"; cat; printf err >&2; exit 3'], env={"A": "a="},
                        stdin=b"in\x00", timeout=30, on_stdout=seen.append)
        assert (result.exit_code, result.stdout, result.stderr, result.timed_out, result.truncated) == (
            3, b"a=in\x00", b"err", False, False)
        assert b"".join(seen) == b"a=in\x00"  # as it came (streamed), in pieces of any size
        assert s.exec(["sleep", "30"], timeout=0.5).timed_out
        capped = s.exec(["sh", "-c", "head -c 100 /dev/zero"], max_output_bytes=10)
        assert (len(capped.stdout), capped.truncated) == (10, True)

        s.files.write("sub/dir/f.txt", "caf\u00e9\r\n")
        assert s.files.read("sub/dir/f.txt") == "caf\u00e9\r\n".encode()
        with pytest.raises(reploy_client.ReployError) as mismatch:
            s.files.upload("sub/dir/f.txt", io.BytesIO(b"other"), 5, sha256="0" * 64)
        assert mismatch.value.status == 422 and s.files.read("sub/dir/f.txt") == "caf\u00e9\r\n".encode()
        assert s.exec(["cat", "f.txt"], cwd="sub/dir").stdout == "caf\u00e9\r\n".encode()
        names = [entry["name"] for entry in s.files.list("sub/dir")["entries"]]
        assert names == ["f.txt"]
        with pytest.raises(FileNotFoundError, match="missing/x.txt"):
            s.files.read("missing/x.txt")
        with pytest.raises(IsADirectoryError, match="sub"):
            s.files.read("sub")
        with pytest.raises(reploy_client.ReployError, match="more than 3"):
            s.files.read("sub/dir/f.txt", limit_bytes=3)
        s.exec(["chmod", "000", "sub/dir/f.txt"])
        with pytest.raises(PermissionError, match="sub/dir/f.txt"):
            s.files.read("sub/dir/f.txt")
        with pytest.raises(FileNotFoundError):
            s.exec(["no-such-program"])


@pytest.mark.docker
def test_container_paths_big_stdin_and_no_timeout(client: reploy_client.Client) -> None:
    """Paths from the container's `/`, stdin past the inline bound (through a file that is
    gone afterwards), and an exec with no timeout."""
    with client.create(name="harness") as s:
        s.files.write("/tmp/abs/f.txt", "abs\n")
        assert s.exec(["cat", "f.txt"], cwd="/tmp/abs").stdout == b"abs\n"
        assert [e["name"] for e in s.files.list("/tmp/abs")["entries"]] == ["f.txt"]
        big = b"a" * (reploy_client.MAX_INLINE_STDIN_BYTES + 1)
        assert s.exec(["wc", "-c"], stdin=big, timeout=120).stdout.split() == [str(len(big)).encode()]
        assert not [e for e in s.files.list("")["entries"]
                    if e["name"].startswith(reploy_client.STDIN_FILE_PREFIX)]
        assert s.exec(["sleep", "1"]).exit_code == 0  # no timeout given: none
        with pytest.raises(PermissionError):
            s.files.write("/etc/passwd", "x")


@pytest.mark.docker
def test_parallel_execs_share_one_client(client: reploy_client.Client) -> None:
    """Threads share the client; each call takes its own pooled connection, and serial calls
    reuse them (the pool never holds more than were open at once)."""
    with client.create(name="parallel") as s:
        results: list[Any] = [None] * 6

        def run(index: int) -> None:
            results[index] = s.exec(["sh", "-c", f"echo {index}"], timeout=30)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(6)]
        idle = len(client.connections._idle)
        assert 1 <= idle <= 6
        for _ in range(5):
            s.exec(["true"])
        assert len(client.connections._idle) == idle  # reused, none opened


@pytest.mark.docker
def test_the_output_log_reads_streams_messages_and_snapshots(client: reploy_client.Client) -> None:
    with client.create(name="log") as s:
        s.message("echo marker-$((6 * 7))")
        chunks = s.stream(0)
        seen = b""
        for chunk in chunks:
            seen += chunk.data
            if b"marker-42" in seen:
                break
        chunks.close()  # type: ignore[attr-defined]
        page = s.read(0)
        assert b"marker-42" in page.data and page.next_offset == len(page.data)
        assert s.read(page.next_offset + 10).data == b""
        assert s.snapshot()["state"] == "snapshot"
        assert b"marker-42" in s.read(0).data  # any access restores it


@pytest.mark.docker
def test_the_cli_says_serves_error_on_stderr(server: ServeProcess) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "reploy.py"), "session", "get", "0123456789abcdef",
                           "--server", server.ready["url"]], capture_output=True, timeout=60,
                          env=server.client_env())
    document = cli_error(proc)
    assert document["status"] == 404 and document["code"] == "not_found"
    assert "0123456789abcdef" in document["error"]
