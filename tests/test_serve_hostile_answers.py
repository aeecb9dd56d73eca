"""A real `reploy serve` against a hostile stand-in agent (standin_agent.py: a server of the test's
own on a real session's control socket, relaying what it does not answer to the real agent), for
every answer family serve reads: each invalid answer fails its one request with 502 and a clear
error, and the session, its record, the other sessions and the reaper go on. Also the attacks of
issue 21 that rode on such answers: a download size that wrote headers (1), an entry name that
reached another session (2), an upload commit that never ended (4), and `session cp` spooling an
endless archive (6).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.client
import io
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import reploy_serve
from serve_harness import (  # noqa: F401  (fixtures)
    cli_error,
    ROOT, Api, ServeProcess, in_thread, managed_workload, serve_factory, sse_events, wait_until,
)
from standin_agent import StandInAgent, WithFds, control_socket, pipe_of

pytestmark = pytest.mark.docker

TID = "ab" * 8  #: a transfer or exec id the stand-in hands out
FILE_ENTRY = {"name": "f.txt", "type": "file", "size": 5, "mode": 0o644, "mtime": 0}
DIR_ENTRY = {"name": "d", "type": "directory", "size": 0, "mode": 0o755, "mtime": 0}
#: What attack 1's download answered as its size: a Content-Length, then headers and a page.
INJECTED_SIZE = ("48\r\nContent-Type: text/html\r\n\r\n"
                 "<script>document.title='pwned'</script><!--")


@pytest.fixture
def hostile(serve_factory: Callable[..., ServeProcess], docker_engine: Any,
            ) -> Iterator[tuple[ServeProcess, str, str, StandInAgent]]:
    """A serve with a target session whose agent the stand-in answers for, and a bystander."""
    server = serve_factory()
    sid = server.api.create("target")["id"]
    bystander = server.api.create("bystander")["id"]
    server.api.wait_output(sid, b"$ ")
    stand = StandInAgent(control_socket(server.state_dir, sid))
    yield server, sid, bystander, stand
    stand.close()


def answer(api: Api, method: str, path: str, body: Any = None, raw: bytes = b"",
           content_type: str = "application/json") -> tuple[int, dict[str, Any]]:
    """(status, JSON document) of one API call."""
    data = raw or (None if body is None else json.dumps(body).encode())
    status, headers, response = api.request(method, "/api/v1" + path, data,
                                            headers={"Content-Type": content_type} if data else None)
    assert headers["content-type"] == "application/json", (path, headers)
    return status, json.loads(response)


def still_serving(server: ServeProcess, sid: str, bystander: str) -> None:
    """The target session still works through the relay, the bystander on its own, and serve
    logged no internal error."""
    api = server.api
    assert api.get(sid)["state"] == "active"
    api.write(sid, b"echo target-$((6*7))\r")
    api.wait_output(sid, b"target-42")
    api.write(bystander, b"echo bystander-$((6*7))\r")
    api.wait_output(bystander, b"bystander-42")
    assert "Traceback" not in server.stderr and "internal error" not in server.stderr


def commit_of(request: dict[str, Any], sha256: str) -> dict[str, Any]:
    return {"transfer_id": request["params"]["transfer_id"], "done": True, "root": "workspace",
            "path": "u.txt", "kind": "file", "bytes": 5, "entries": 1, "sha256": sha256}


#: (what, the API request, the stand-in's answers by method). Each answer breaks one rule of
#: docs/agent.md; the request must fail with 502, or on seed 002's routes (SEED_002_PATHS),
#: whose statuses are the spec's, with 500 and the same message.
FAMILIES: list[tuple[str, tuple[str, str, Any], dict[str, Any]]] = [
    ("read_fd: a window past the log's length", ("POST", "/read", {"offset": 0}),
     {"read_fd": {"offset": 0, "next_offset": 10, "length": 9, "reset": False, "kind": "bytes"}}),
    ("write: bytes is not a count", ("POST", "/write", {"payload": "id\r"}),
     {"write": {"bytes": "3\r\nX-Injected: 1"}}),
    ("message: an unknown delivery", ("POST", "/message", {"text": "id"}),
     {"message": {"delivery": "<script>", "queue_depth": 0}}),
    ("interrupt: cancelled is not a boolean", ("POST", "/interrupt", {}), {"interrupt": {"cancelled": "yes"}}),
    ("relaunch: a pid that is none", ("POST", "/relaunch", {}), {"relaunch": {"pid": -1}}),
    ("resize: another size", ("POST", "/resize", {"columns": 90, "rows": 30}),
     {"resize": {"columns": 1, "rows": 1}}),
    ("status: an unknown turn state", ("GET", "/status", None),
     {"status": {"workload": "shell", "turn_state": "pwned"}}),
    ("exec: an id that is a path", ("POST", "/exec", {"argv": ["true"]}),
     {"exec": {"exec_id": "../../x", "pid": 1}}),
    ("exec_wait: both an exit code and a signal", ("POST", "/exec", {"argv": ["true"]}),
     {"exec_wait": lambda r: {
         "exec_id": r["params"]["exec_id"], "running": False, "pid": 1, "exit_code": 0,
         "signal": "SIGKILL", "timed_out": False, "killed": False, "duration_ms": 1,
         **{f"{s}_{k}": v for s in ("stdout", "stderr")
            for k, v in (("b64", ""), ("next_offset", 0), ("bytes", 0), ("truncated", False))}}}),
    ("stat: an entry named with a path", ("GET", "/list/f.txt", None),
     {"stat": {"root": "workspace", "path": "f.txt", "entry": {**FILE_ENTRY, "name": "../f.txt"}}}),
    ("list: an entry name with a newline", ("GET", "/list/", None),
     {"list": lambda r: {"root": "workspace", "path": ".",
                         "entry": {**DIR_ENTRY, "name": "."}, "total": 1, "next_offset": 1,
                         "entries": [{**FILE_ENTRY, "name": "a\nb"}]}}),
    ("download: a size with CR LF", ("GET", "/files/f.txt", None),
     {"download": {"transfer_id": TID, "kind": "file", "size": INJECTED_SIZE, "entry": FILE_ENTRY}}),
    ("upload: an id that is none", ("PUT", "/files/u.txt", b"hello"),
     {"upload": {"transfer_id": "x"}}),
    ("upload_commit: not the digest asked for",
     ("PUT", f"/files/u.txt?sha256={hashlib.sha256(b'hello').hexdigest()}", b"hello"),
     {"upload_commit": lambda r: commit_of(r, "0" * 64)}),
    ("upload_commit: another upload's result", ("PUT", "/files/u.txt", b"hello"),
     {"upload_commit": lambda r: {**commit_of(r, hashlib.sha256(b"hello").hexdigest()), "bytes": 4}}),
    ("checkpoint: another id", ("POST", "/snapshot", {}),
     {"checkpoint": {"id": "other", "path": "x", "bytes": 1, "log_bytes": 1, "skipped_entries": 0}}),
]


SEED_002_PATHS = ("/read", "/write", "/snapshot")
FILE_ANSWER = {"kind": "file", "size": 5, "entry": FILE_ENTRY}
TAR_ANSWER = {"transfer_id": TID, "kind": "tar", "size": None, "entry": DIR_ENTRY}


def regular_file(tmp_path: Path, data: bytes = b"", flags: int = os.O_RDWR) -> int:
    path = tmp_path / f"fd-{time.monotonic_ns()}"
    path.write_bytes(data)
    return os.open(path, flags)


def hostile_descriptors(tmp_path: Path) -> list[tuple[str, tuple[str, str, Any], str, Callable[[], Any]]]:
    """(what, the API request, the method answered, the answer: fields and descriptors made
    anew for each request). Each must fail its request with 502, every descriptor closed."""
    def socket_fd() -> int:
        one, other = socket.socketpair()
        other.close()
        return one.detach()

    download = ("GET", "/files/f.txt", None)
    read = ("POST", "/read", {"offset": 0})
    window = {"offset": 0, "next_offset": 5, "length": 5, "reset": False, "kind": "bytes"}
    tree = ("GET", "/files/d", None)
    upload = ("PUT", "/files/u.txt", b"hello")
    staging = {"transfer_id": TID}
    return [
        ("a file's download without its descriptor", download, "download", lambda: FILE_ANSWER),
        ("a socket as the file to read", download, "download",
         lambda: WithFds(FILE_ANSWER, (socket_fd(),))),
        ("a directory as the file to read", download, "download",
         lambda: WithFds(FILE_ANSWER, (os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY),))),
        ("a file open only for writing", download, "download",
         lambda: WithFds(FILE_ANSWER, (regular_file(tmp_path, b"hello", os.O_WRONLY),))),
        ("two descriptors with a file", download, "download",
         lambda: WithFds(FILE_ANSWER, (regular_file(tmp_path, b"hello"), regular_file(tmp_path)))),
        ("six descriptors with a file", download, "download",
         lambda: WithFds(FILE_ANSWER, tuple(regular_file(tmp_path) for _ in range(6)))),
        ("a regular file as a tar's pipe", tree, "download",
         lambda: WithFds(TAR_ANSWER, (regular_file(tmp_path, b"tar"),))),
        ("a pipe's write end as a tar's pipe", tree, "download",
         lambda: WithFds(TAR_ANSWER, (os.dup(os.pipe()[1]),))),
        ("a log window without its descriptor", read, "read_fd", lambda: window),
        ("a log open for writing too", read, "read_fd",
         lambda: WithFds(window, (regular_file(tmp_path, b"hello"),))),
        ("a log's pipe", read, "read_fd", lambda: WithFds(window, (pipe_of(iter([b"hello"])),))),
        ("a log shorter than its window", read, "read_fd",
         lambda: WithFds(window, (regular_file(tmp_path, b"hell", os.O_RDONLY),))),
        ("an upload without its staging", upload, "upload", lambda: staging),
        ("a staging that holds bytes already", upload, "upload",
         lambda: WithFds(staging, (regular_file(tmp_path, b"planted"),))),
        ("a staging open only for reading", upload, "upload",
         lambda: WithFds(staging, (regular_file(tmp_path, b"", os.O_RDONLY),))),
        ("a memfd as the staging", upload, "upload",
         lambda: WithFds(staging, (os.memfd_create("staging"),))),
        ("a pipe as the staging", upload, "upload",
         lambda: WithFds(staging, (os.pipe()[1],))),
        ("a descriptor on an answer that takes none", ("GET", "/list/f.txt", None), "stat",
         lambda: WithFds({"root": "workspace", "path": "f.txt", "entry": FILE_ENTRY},
                         (regular_file(tmp_path),))),
        ("a descriptor on an error", download, "download",
         lambda: WithFds(json.dumps({"id": "serve", "error": {"code": "command_error",
                                                              "message": "conflict: no"}}).encode()
                         + b"\n", (regular_file(tmp_path),))),
    ]


def serve_fds(server: ServeProcess) -> int:
    """How many descriptors serve holds, besides its database's (one connection per handler
    thread, kept with the thread)."""
    fd_dir = f"/proc/{server.proc.pid}/fd"
    targets = []
    for name in os.listdir(fd_dir):
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            targets.append(os.readlink(f"{fd_dir}/{name}"))
    return sum(1 for target in targets if "sessions.db" not in target)


def test_hostile_descriptors_are_refused_and_closed(
        hostile: tuple[ServeProcess, str, str, StandInAgent], tmp_path: Path) -> None:
    """What the agent's answers carry is fstat'd before a byte moves: a socket, a directory, a
    file of the wrong mode, a pipe where a file is due (or the wrong end of one), two or more
    descriptors, none where one is due, one where none is: each fails its one request, and serve
    holds none of them after (it keeps no more descriptors than it had)."""
    server, sid, bystander, stand = hostile
    api = server.api
    assert answer(api, "GET", f"/sessions/{sid}/list/", None)[0] == 200  # serve's own fds opened
    before = serve_fds(server)
    for what, (method, path, body), verb, reply in hostile_descriptors(tmp_path):
        stand.answers[verb] = lambda request, reply=reply: reply()
        raw = body if isinstance(body, bytes) else b""
        status, document = answer(api, method, f"/sessions/{sid}{path}", None if raw else body, raw,
                                  "application/octet-stream" if raw else "application/json")
        stand.answers.clear()
        if what == "a descriptor on an error":
            assert status == 409 and "conflict: no" in document["error"], (what, status, document)
        else:
            assert status == (500 if path in SEED_002_PATHS else 502), (what, status, document)
            assert "session agent" in document["error"], (what, document)
    wait_until(lambda: serve_fds(server) <= before, "serve to hold no descriptor it was sent")
    assert not (tmp_path / "u.txt").exists()
    still_serving(server, sid, bystander)


def test_many_transfers_leave_no_descriptor_in_serve(
        hostile: tuple[ServeProcess, str, str, StandInAgent]) -> None:
    """Uploads and downloads of files and trees, whole and given up half way, through the real
    agent: serve holds no more descriptors after them than before."""
    server, sid, bystander, stand = hostile
    api = server.api
    data = os.urandom(3 * reploy_serve.COPY_CHUNK_BYTES + 7)

    def round_trip() -> None:
        status, _ = answer(api, "PUT", f"/sessions/{sid}/files/t/blob.bin", raw=data,
                           content_type="application/octet-stream")
        assert status == 201
        assert api.request("GET", f"/api/v1/sessions/{sid}/files/t/blob.bin")[2] == data
        status, headers, tar = api.request("GET", f"/api/v1/sessions/{sid}/files/t")
        assert status == 200 and headers["content-type"] == "application/x-tar"
        with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
            member = archive.extractfile("blob.bin")
            assert member is not None and member.read() == data
        for route in ("t/blob.bin", "t"):  # a client that leaves after the first bytes
            with socket.create_connection((api.host, api.port), timeout=30) as connection:
                connection.sendall(f"GET /api/v1/sessions/{sid}/files/{route} HTTP/1.1\r\n"
                                   f"Host: 127.0.0.1:{api.port}\r\n"
                                   f"Authorization: Bearer {server.ready['token']}\r\n\r\n".encode())
                assert connection.recv(1024).startswith(b"HTTP/1.1 200 ")

    round_trip()
    before = serve_fds(server)
    for _ in range(8):
        round_trip()
    wait_until(lambda: serve_fds(server) <= before, "serve to close every transfer's descriptor")
    still_serving(server, sid, bystander)


def test_every_answer_family_fails_only_its_request(
        hostile: tuple[ServeProcess, str, str, StandInAgent]) -> None:
    server, sid, bystander, stand = hostile
    api = server.api
    for what, (method, path, body), answers in FAMILIES:
        stand.answers.update(answers)
        raw = body if isinstance(body, bytes) else b""
        status, document = answer(api, method, f"/sessions/{sid}{path}", None if raw else body, raw,
                                  "application/octet-stream" if raw else "application/json")
        stand.answers.clear()
        assert status == (500 if path in SEED_002_PATHS else 502), (what, status, document)
        assert "session agent" in document["error"], (what, document)
        # A failed snapshot leaves the session paused, the reason kept (issue 26).
        assert api.get(sid)["state"] == ("idle" if path == "/snapshot" else "active"), what
    assert not json.dumps(api.call("POST", f"/sessions/{sid}/exec",
                                   {"argv": ["ls", "-a"]})["stdout"]).count("u.txt")
    still_serving(server, sid, bystander)


def test_a_download_size_cannot_write_headers(
        hostile: tuple[ServeProcess, str, str, StandInAgent]) -> None:
    """Attack 1: the size of a download holding CR LF, headers and a page. serve refuses the
    answer; the response is the API's JSON error, in a sandbox, and nothing of the page."""
    server, sid, bystander, stand = hostile
    stand.answers["download"] = {"transfer_id": TID, "kind": "file", "size": INJECTED_SIZE,
                                 "entry": {**FILE_ENTRY, "name": "report.html"}}
    with socket.create_connection((server.api.host, server.api.port), timeout=30) as connection:
        connection.sendall(f"GET /api/v1/sessions/{sid}/files/report.html HTTP/1.1\r\n"
                           f"Host: 127.0.0.1:{server.api.port}\r\n"
                           f"Authorization: Bearer {server.ready['token']}\r\n"
                           "Connection: close\r\n\r\n".encode())
        response = b""
        while chunk := connection.recv(65536):
            response += chunk
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {line.partition(":")[0].lower(): line.partition(":")[2].strip() for line in lines[1:]}
    assert lines[0].startswith("HTTP/1.1 502 ")
    assert headers["content-type"] == "application/json"
    assert headers["content-security-policy"] == "default-src 'none'; sandbox"
    assert headers["x-content-type-options"] == "nosniff"
    assert b"text/html" not in response and b"<script>" not in response
    assert "size" in json.loads(body)["error"]
    still_serving(server, sid, bystander)


def test_a_tar_that_fails_after_its_first_chunk_ends_visibly_incomplete(
        hostile: tuple[ServeProcess, str, str, StandInAgent], tmp_path: Path) -> None:
    """A directory's tar is made while it is sent, so a failure past its first chunk (here the
    session's disk filling up) comes after the 200: the body is chunked and ends without its
    last chunk, which the client sees as an incomplete transfer, never as a whole tar."""
    server, sid, bystander, stand = hostile
    first = b"t" * 1024

    stand.answers.update({
        "download": lambda r: WithFds(TAR_ANSWER, (pipe_of(iter([first])),)),
        "transfer_close": lambda r: json.dumps({"id": r["id"], "error": {
            "code": "disk_full", "message": "not enough space on the session's disk"}}).encode() + b"\n"})
    connection = http.client.HTTPConnection(server.api.host, server.api.port, timeout=30)
    try:
        connection.request("GET", f"/api/v1/sessions/{sid}/files/d",
                           headers={"Authorization": f"Bearer {server.ready['token']}"})
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("Transfer-Encoding") == "chunked"
        assert response.getheader("Content-Type") == "application/x-tar"
        with pytest.raises(http.client.IncompleteRead) as cut:
            response.read()
        assert cut.value.partial == first
    finally:
        connection.close()
    assert "ended early" in server.stderr and "not enough space" in server.stderr
    # `session cp` says so in one error and keeps nothing of the cut tar.
    out = tmp_path / "out"
    out.mkdir()
    stand.answers.update({
        "stat": {"root": "workspace", "path": "d", "entry": DIR_ENTRY},
        "list": {"root": "workspace", "path": "d", "entry": DIR_ENTRY, "entries": [], "total": 0,
                 "next_offset": 0}})
    proc = subprocess.run([sys.executable, str(ROOT / "reploy.py"), "session", "cp", "--server",
                           server.ready["url"], f"{sid}:d", str(out)], env=server.client_env(),
                          capture_output=True, timeout=120)
    assert b"Traceback" not in proc.stderr, proc.stderr
    assert "the download ended early" in cli_error(proc)["error"]
    assert list(out.iterdir()) == []
    stand.answers.clear()
    still_serving(server, sid, bystander)


def test_an_entry_name_cannot_reach_another_session(
        hostile: tuple[ServeProcess, str, str, StandInAgent]) -> None:
    """Attack 2 at the API: a listing that names `../../OTHER/files/drop` is refused whole, so
    no client ever builds a URL from it (the UI's own check: test_serve_ui.py)."""
    server, sid, bystander, stand = hostile
    name = f"../../{bystander}/files/drop"
    stand.answers["list"] = lambda r: {"root": "workspace", "path": ".", "entry": {**DIR_ENTRY, "name": "."},
                                       "entries": [{**DIR_ENTRY, "name": name}], "total": 1, "next_offset": 1}
    status, document = answer(server.api, "GET", f"/sessions/{sid}/list/")
    assert status == 502 and "one path component" in document["error"]
    assert name not in json.dumps(document)
    still_serving(server, sid, bystander)


def test_an_upload_commit_that_never_ends_stops_with_its_client(
        hostile: tuple[ServeProcess, str, str, StandInAgent]) -> None:
    """Attack 4: the agent answers upload_commit with done:false at once, for ever. serve asks
    at a bounded pace while the client waits, and stops (closing the transfer) once it left."""
    server, sid, bystander, stand = hostile
    stand.answers["upload_commit"] = lambda r: {"transfer_id": r["params"]["transfer_id"], "done": False}
    connection = socket.create_connection((server.api.host, server.api.port), timeout=30)
    connection.sendall(f"PUT /api/v1/sessions/{sid}/files/f.txt HTTP/1.1\r\n"
                       f"Host: 127.0.0.1:{server.api.port}\r\n"
                       f"Authorization: Bearer {server.ready['token']}\r\n"
                       "Content-Type: application/octet-stream\r\nContent-Length: 5\r\n\r\nhello".encode())
    wait_until(lambda: stand.count("upload_commit") >= 3, "serve to ask for the commit")
    started, first = time.monotonic(), stand.count("upload_commit")
    wait_until(lambda: stand.count("upload_commit") >= first + 8, "more commit polls")
    polls, elapsed = stand.count("upload_commit") - first, time.monotonic() - started
    assert polls <= elapsed / reploy_serve.AGENT_POLL_MIN_S + 2, (polls, elapsed)  # paced, never spinning
    connection.close()  # the client leaves
    wait_until(lambda: stand.count("transfer_close") == 1, "serve to give the transfer up")
    after = stand.count("upload_commit")
    server.api.call("GET", f"/sessions/{sid}/status")  # a round trip through the stand-in
    assert stand.count("upload_commit") == after
    still_serving(server, sid, bystander)


def trickle(stand: StandInAgent) -> Callable[[dict[str, Any]], Iterator[bytes]]:
    def pieces(_request: dict[str, Any]) -> Iterator[bytes]:
        while not stand.stopping.wait(0.5):  # each byte well inside any per-read timeout
            yield b" "
    return pieces


@pytest.mark.parametrize("mode", ["not-a-response", "deep", "no-result", "trickle"])
def test_hostile_status_answers_cost_that_session_its_answer_never_the_reaper(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any, mode: str) -> None:
    """The reaper asks every active session for its status each pass: answers that are not
    responses, JSON nested past the recursion limit or bytes trickled forever cost that session
    its answer, never the reaper, which still pauses an idle bystander."""
    server = serve_factory("--idle-after", "1s")
    api = server.api
    sid = api.create("hostile")["id"]
    stand = StandInAgent(control_socket(server.state_dir, sid))
    try:
        reply = {"not-a-response": b'{"id":"serve","result":[]}\n', "deep": b"[" * 200000 + b"\n",
                 "no-result": b'{"id":"serve"}\n', "trickle": trickle(stand)}[mode]
        stand.answers.update({"status": reply, "write": reply})
        bystander = api.create("bystander")["id"]
        wait_until(lambda: api.get(bystander)["state"] == "idle" and api.get(sid)["state"] == "idle",
                   "the reaper to pause both sessions", timeout_s=60)
        status, document = answer(api, "POST", f"/sessions/{sid}/write", {"payload": "id\r"})
        assert (status, "agent" in document["error"]) == (500, True)  # seed 002's route: 500
        assert "Exception in thread" not in server.stderr and "internal error" not in server.stderr
        api.write(bystander, b"echo bystander-$((6*7))\r")
        api.wait_output(bystander, b"bystander-42")
    finally:
        stand.close()


def test_exec_output_and_listings_past_their_bounds_are_refused(
        hostile: tuple[ServeProcess, str, str, StandInAgent]) -> None:
    """Pages that are each well-formed but never end: exec output past the cap asked for, and
    a listing that claims 10**9 entries. serve's memory stays bounded: the exec fails, the
    listing stops at MAX_LIST_ENTRIES."""
    server, sid, bystander, stand = hostile
    page = base64.b64encode(b"x" * (256 * 1024)).decode()

    def flood(request: dict[str, Any]) -> dict[str, Any]:
        offset = request["params"]["stdout_offset"]
        return {"exec_id": request["params"]["exec_id"], "running": True, "pid": 1, "exit_code": None,
                "signal": None, "timed_out": False, "killed": False, "duration_ms": 1,
                "stdout_b64": page, "stdout_next_offset": offset + 256 * 1024,
                "stdout_bytes": offset + 256 * 1024, "stdout_truncated": False,
                "stderr_b64": "", "stderr_next_offset": 0, "stderr_bytes": 0, "stderr_truncated": False}

    def pages(request: dict[str, Any]) -> dict[str, Any]:
        offset = request["params"]["offset"]
        entries = [{**FILE_ENTRY, "name": f"{offset + i:09d}"} for i in range(1000)]
        return {"root": "workspace", "path": ".", "entry": {**DIR_ENTRY, "name": "."},
                "entries": entries, "total": 10**9, "next_offset": offset + 1000}

    stand.answers.update({"exec_wait": flood, "list": pages})
    status, document = answer(server.api, "POST", f"/sessions/{sid}/exec",
                              {"argv": ["true"], "maxOutputBytes": 65536})
    assert status == 502 and "more output than the cap" in document["error"]
    listing = server.api.call("GET", f"/sessions/{sid}/list/")
    assert listing["truncated"] and len(listing["entries"]) == reploy_serve.MAX_LIST_ENTRIES
    assert stand.count("list") == reploy_serve.MAX_LIST_ENTRIES // 1000
    stand.answers.clear()
    still_serving(server, sid, bystander)


def test_a_stream_outlives_hostile_wakeups(
        hostile: tuple[ServeProcess, str, str, StandInAgent]) -> None:
    """The stream's long-poll wake-ups are agent `read`s: invalid ones only send it back to
    watching the output log, and it still delivers."""
    server, sid, bystander, stand = hostile
    stand.answers["read"] = b'{"id":"serve","result":{"type":"read","offset":"\\r\\n"}}\n'
    start = server.api.call("GET", f"/sessions/{sid}/status")["agent"]["logBytes"]

    def delivered(events: list[dict[str, Any]]) -> bool:
        return b"streamed-42" in b"".join(base64.b64decode(e["data"]["payloadBase64"])
                                          for e in events if e.get("event") == "output")

    stream, box = in_thread(lambda: sse_events(server.api, sid, offset=start, until=delivered))
    wait_until(lambda: stand.count("read") >= 2, "the stream to wait on hostile wake-ups")
    server.api.write(sid, b"echo streamed-$((6*7))\r")
    stream.join(timeout=60)
    assert box and not isinstance(box[0], BaseException) and delivered(box[0]), box
    stand.answers.clear()
    still_serving(server, sid, bystander)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_session_cp_from_an_endless_archive_leaves_no_spool_on_a_signal(
        hostile: tuple[ServeProcess, str, str, StandInAgent], tmp_path: Path, signum: int) -> None:
    """Attack 6: `session cp ID:DIR` of a tree whose tar never ends. The spool grows only up to
    the bound (test_serve_access.py checks the bound against a server of its own), and SIGTERM
    or SIGINT removes it before the CLI exits 128+N."""
    server, sid, bystander, stand = hostile
    stand.answers.update({
        "stat": {"root": "workspace", "path": "d", "entry": DIR_ENTRY},
        "list": {"root": "workspace", "path": "d", "entry": DIR_ENTRY, "entries": [], "total": 0,
                 "next_offset": 0},
        "download": lambda r: WithFds(TAR_ANSWER, (pipe_of(itertools.repeat(b"\0" * (1 << 20))),)),
        "transfer_close": {"transfer_id": TID, "closed": True}})
    out = tmp_path / "out"
    out.mkdir()
    cli = subprocess.Popen([sys.executable, str(ROOT / "reploy.py"), "session", "cp", "--server",
                            server.ready["url"], f"{sid}:d", str(out)], env=server.client_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: any(p.stat().st_size > 8 << 20 for p in out.glob(".reploy-cp-*")),
                   "the spool to grow")
        cli.send_signal(signum)
        stdout, stderr = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 128 + signum, stderr
    assert list(out.iterdir()) == [] and stdout == b""
    assert b"Traceback" not in stderr
    stand.answers.clear()
    still_serving(server, sid, bystander)


def hostile_tar(*members: tuple[str, bytes, str]) -> bytes:
    """A tar of (name, type, link target) members, each as written, unchecked: tarfile writes
    absolute names, `..` and devices as it is told (devices as /dev/null's numbers)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, kind, link in members:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mode = kind, link, 0o644
            info.devmajor, info.devminor = (1, 3) if kind == tarfile.CHRTYPE else (0, 0)
            data = b"escaped\n" if kind == tarfile.REGTYPE else b""
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data) if data else None)
    return buffer.getvalue()


def hostile_trees(outside: Path) -> dict[str, tuple[bytes, str]]:
    """What a hostile session answers for a directory, each with the word the refusal names.
    Everything that would leave the tree aims at `outside` (beside the destination), so a
    broken vetting shows there, not somewhere on the machine."""
    fine = ("fine.txt", tarfile.REGTYPE, "")  # a harmless member first: nothing of it lands
    return {
        "an absolute name": (hostile_tar(fine, (f"{outside}/absolute", tarfile.REGTYPE, "")),
                             "unsafe member name"),
        "a name with ..": (hostile_tar(fine, ("sub/../../../outside/dotdot", tarfile.REGTYPE, "")),
                           "unsafe member name"),
        "a symlink leaving the tree": (hostile_tar(fine, ("link", tarfile.SYMTYPE, str(outside))),
                                       "leaves the archive's tree"),
        "a relative symlink leaving it": (hostile_tar(fine, ("link", tarfile.SYMTYPE, "../../outside")),
                                          "leaves the archive's tree"),
        "a write through a symlink": (hostile_tar(fine, ("link", tarfile.SYMTYPE, "."),
                                                  ("link/x", tarfile.REGTYPE, "")),
                                      "lies below a symlink"),
        "a device": (hostile_tar(fine, ("null", tarfile.CHRTYPE, "")), "device node"),
        "a FIFO": (hostile_tar(fine, ("fifo", tarfile.FIFOTYPE, "")), "device node, FIFO"),
        "a hard link out of the tree": (hostile_tar(fine, ("passwd", tarfile.LNKTYPE, "/etc/passwd")),
                                        "hard link"),
    }


def test_session_cp_of_a_directory_vets_its_archive_and_writes_nothing(
        hostile: tuple[ServeProcess, str, str, StandInAgent], tmp_path: Path) -> None:
    """`session cp ID:DIR DEST` from a session whose agent answers the download with a hostile
    tar: each is refused whole, exit 1 with one JSON error naming the rule, and nothing is
    written: not in the destination (no spool, no staging, no member), not beside it."""
    server, sid, bystander, stand = hostile
    out, outside = tmp_path / "out", tmp_path / "outside"
    out.mkdir()
    outside.mkdir()
    for what, (archive, complaint) in hostile_trees(outside).items():
        stand.answers.update({
            "stat": {"root": "workspace", "path": "d", "entry": DIR_ENTRY},
            "list": {"root": "workspace", "path": "d", "entry": DIR_ENTRY, "entries": [],
                     "total": 0, "next_offset": 0},
            "download": lambda r, archive=archive: WithFds(TAR_ANSWER, (pipe_of(iter([archive])),)),
            "transfer_close": {"transfer_id": TID, "closed": True}})
        proc = subprocess.run([sys.executable, str(ROOT / "reploy.py"), "session", "cp", "--server",
                               server.ready["url"], f"{sid}:d", str(out)], env=server.client_env(),
                              capture_output=True, timeout=120)
        document = cli_error(proc)
        assert document["status"] is None and document["code"] is None, (what, document)
        assert document["error"].startswith(f"{sid}:d: refused: ") and complaint in document["error"], \
            (what, document)
        assert b"Traceback" not in proc.stderr
        assert stand.count("download") >= 1, what  # the archive was served, and vetted here
        assert list(out.iterdir()) == [] and list(outside.iterdir()) == [], what
        assert sorted(tmp_path.iterdir()) == [out, outside], what
        stand.answers.clear()
    still_serving(server, sid, bystander)
