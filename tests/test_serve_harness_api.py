"""What harnesses (Inspect AI, E2B-shaped clients) need of serve, on the real engine: absolute
paths and cwd as the runtime user reaches them, permission errors that are never a silent
replace, machine-readable error codes, argv and stdin of realistic size, `Expect:
100-continue`, execs queued past the per-session limit, no timeout meaning none, a larger
output cap, detached execs, and exec users refused."""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import json
import socket
import uuid
from typing import Any, Callable

import pytest

import reploy_serve
from serve_harness import (  # noqa: F401  (fixtures)
    Api, ServeProcess, managed_workload, seconds, serve_factory, session_containers, wait_until,
)
from test_serve_harness import container_commands, exec_in, get, put, sh

pytestmark = pytest.mark.docker
MIB = 1024 * 1024


def error_of(api: Api, method: str, path: str, body: Any, status: int) -> str:
    """The `code` of an error answer that must have `status`."""
    got, raw = api.raw(method, "/api/v1" + path, None if body is None else json.dumps(body).encode())
    document = json.loads(raw)
    assert got == status and set(document) == {"error", "code"}, (got, document)
    assert document["code"] in reploy_serve.ERROR_CODES
    return document["code"]


def test_absolute_paths_and_permissions(serve_factory: Callable[..., ServeProcess],
                                        docker_engine: Any) -> None:
    server = serve_factory()
    api = server.api
    sid = api.create("paths")["id"]
    # Anywhere the runtime user can reach: /tmp is the blueprint's writable path.
    assert put(api, sid, "/tmp/deep/new.txt", b"hello", 5)[0] == 201
    assert put(api, sid, "%2Ftmp%2Fdeep%2Fother.txt", b"again", 5)[0] == 201
    assert get(api, sid, "/tmp/deep/new.txt")[:2] == (200, b"hello")
    assert sh(api, sid, "cat /tmp/deep/new.txt /tmp/deep/other.txt; stat -c %u /tmp/deep/new.txt") == (
        "helloagain1000\n")
    listing = api.call("GET", f"/sessions/{sid}/list//tmp/deep")
    assert listing["root"] == "container" and sorted(e["name"] for e in listing["entries"]) == [
        "new.txt", "other.txt"]
    assert sh(api, sid, "pwd", cwd="/usr/bin") == "/usr/bin\n"
    assert exec_in(api, sid, ["cat", "os-release"], cwd="/etc")["exitCode"] == 0
    # What the runtime user may not do, the kernel refuses: distinct statuses and codes.
    assert put(api, sid, "/etc/x", b"x", 1)[1]["code"] == "permission_denied"
    assert put(api, sid, "/etc/hostname", b"x", 1)[0] == 403
    sh(api, sid, "echo impervious > ro.txt; chmod -w ro.txt; echo secret > noread.txt; chmod -r noread.txt")
    status, document = put(api, sid, "ro.txt", b"this won't stick", 16)
    assert (status, document["code"]) == (403, "permission_denied") and "ro.txt" in document["error"]
    assert sh(api, sid, "cat ro.txt") == "impervious\n"  # never a silent replace
    assert error_of(api, "GET", f"/sessions/{sid}/files/noread.txt", None, 403) == "permission_denied"
    assert error_of(api, "GET", f"/sessions/{sid}/files//nope/x", None, 404) == "not_found"
    assert put(api, sid, "/tmp/deep", b"x", 1)[1]["code"] == "is_a_directory"
    assert put(api, sid, "ro.txt/x", b"x", 1)[1]["code"] == "not_a_directory"
    assert error_of(api, "POST", f"/sessions/{sid}/exec", {"argv": ["true"], "cwd": "/nope"}, 404) == "not_found"
    # The agent's own files stay out of reach: root's, 0700, whatever path names them.
    for path in ("/mnt/reploy-session/agent/control.sock", "/mnt/reploy-session/agent/output.log"):
        assert error_of(api, "GET", f"/sessions/{sid}/files/{path}", None, 403) == "permission_denied"
        assert put(api, sid, path, b"x", 1)[1]["code"] == "permission_denied"
    assert error_of(api, "GET", f"/sessions/{sid}/list//mnt/reploy-session/agent", None, 403) == (
        "permission_denied")
    # Symlinks on the way are refused as below the workspace; `..` too.
    sh(api, sid, "ln -s /etc /tmp/etc-link")
    assert error_of(api, "GET", f"/sessions/{sid}/files//tmp/etc-link/hostname", None, 422) == "path_refused"
    assert error_of(api, "GET", f"/sessions/{sid}/files/%2Ftmp%2F..%2Fetc", None, 422) == "path_refused"
    # Nobody but the runtime user: an exec naming a user is refused, root or not.
    for user in ("root", "nobody"):
        assert error_of(api, "POST", f"/sessions/{sid}/exec", {"argv": ["id"], "user": user}, 422) == (
            "user_unsupported")


def test_expect_100_continue_on_every_route(serve_factory: Callable[..., ServeProcess],
                                            docker_engine: Any) -> None:
    server = serve_factory()
    api = server.api
    body = json.dumps({"name": "continued"}).encode()

    def send(path: str, auth: bool) -> tuple[bytes, bytes]:
        """Headers with Expect: 100-continue; the body only after the interim answer. Returns
        (the first status line, all that came back)."""
        with socket.create_connection((api.host, api.port), timeout=60) as sock:
            headers = (f"POST /api/v1{path} HTTP/1.1\r\nHost: {api.host}:{api.port}\r\n"
                       "Content-Type: application/json\r\nExpect: 100-continue\r\n"
                       f"Content-Length: {len(body)}\r\n"
                       + (f"Authorization: {api.auth_headers['Authorization']}\r\n" if auth else "")
                       + "Connection: close\r\n\r\n")
            sock.sendall(headers.encode())
            first = sock.recv(65536)
            if first.startswith(b"HTTP/1.1 100 "):
                sock.sendall(body)
            answer = first
            while chunk := sock.recv(65536):
                answer += chunk
            return first.split(b"\r\n", 1)[0], answer

    first, answer = send("/sessions", auth=True)
    assert first == b"HTTP/1.1 100 Continue" and b"HTTP/1.1 201 Created" in answer
    created = json.loads(answer.rpartition(b"\r\n\r\n")[2])
    assert created["name"] == "continued"
    # Refused before the body is asked for: the final status, no 100.
    first, answer = send("/sessions", auth=False)
    assert first == b"HTTP/1.1 401 Unauthorized" and b"100 Continue" not in answer
    first, answer = send(f"/sessions/{created['id']}/nope", auth=True)
    assert first == b"HTTP/1.1 404 Not Found" and json.loads(answer.rpartition(b"\r\n\r\n")[2])["code"] == (
        "not_found")
    # A big upload as curl sends it.
    import http.client
    conn = http.client.HTTPConnection(api.host, api.port, timeout=120)
    data = b"z" * (2 * MIB)
    conn.putrequest("PUT", f"/api/v1/sessions/{created['id']}/files/big.bin")
    for name, value in {**api.auth_headers, "Content-Type": "application/octet-stream",
                        "Content-Length": str(len(data)), "Expect": "100-continue"}.items():
        conn.putheader(name, value)
    conn.endheaders()
    assert conn.sock.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
    conn.send(data)
    response = conn.getresponse()
    assert response.status == 201 and json.loads(response.read())["bytes"] == len(data)
    conn.close()


def test_exec_input_of_realistic_size(serve_factory: Callable[..., ServeProcess],
                                      docker_engine: Any) -> None:
    server = serve_factory()
    api = server.api
    sid = api.create("sizes")["id"]
    # ~1 MiB of argv in 64 KiB arguments (one argument is bounded by MAX_ARG_STRLEN, 128 KiB).
    chunk = "x" * (64 * 1024)
    result = exec_in(api, sid, ["printf", "%s", *([chunk] * 16)], maxOutputBytes=2 * MIB)
    assert result["exitCode"] == 0 and result["stdout"] == chunk * 16 and not result["stdoutTruncated"]
    # ~1.9 MiB: still the kernel's to take or refuse, never a 502.
    big = exec_in(api, sid, ["true", *([chunk] * 30)])
    assert big["exitCode"] == 0
    assert error_of(api, "POST", f"/sessions/{sid}/exec", {"argv": ["true", *([chunk] * 48)]}, 413) == (
        "too_large")  # past the kernel's ARG_MAX: refused with its reason
    # 64 MiB of stdin from an uploaded file, streamed by the command as the runtime user.
    size = 64 * MIB
    payload = b"a" * size
    assert put(api, sid, "/mnt/reploy-session/workspace/stdin.bin", payload, size)[0] == 201
    counted = exec_in(api, sid, ["sh", "-c", "wc -c; sha256sum"], stdinPath="/mnt/reploy-session/workspace/stdin.bin")
    assert counted["exitCode"] == 0 and counted["stdout"].split()[0] == str(size)
    inline = exec_in(api, sid, ["wc", "-c"], stdinBase64=base64.b64encode(b"b" * (3 * MIB)).decode())
    assert inline["stdout"].strip() == str(3 * MIB)
    assert error_of(api, "POST", f"/sessions/{sid}/exec",
                    {"argv": ["cat"], "stdinBase64": base64.b64encode(b"c" * (5 * MIB)).decode()},
                    413) == "too_large"
    # Output past 4 MiB, up to the 16 MiB cap asked for.
    out = exec_in(api, sid, ["head", "-c", str(10 * MIB), "/mnt/reploy-session/workspace/stdin.bin"], maxOutputBytes=16 * MIB)
    assert out["stdout"].encode() == payload[:10 * MIB] and not out["stdoutTruncated"]
    assert hashlib.sha256(payload).hexdigest() in sh(api, sid, "sha256sum stdin.bin")


def test_execs_queue_detach_and_run_without_a_timeout(serve_factory: Callable[..., ServeProcess],
                                                      docker_engine: Any) -> None:
    server = serve_factory()
    api = server.api
    sid = api.create("queue")["id"]
    # Ten at once against a limit of eight: the last two wait their turn, none is refused. The
    # first eight hold their slots until a file appears, put there through the files API (which
    # runs no exec); the last two cannot have started before that.
    sh(api, sid, "mkdir -p /tmp/q")
    script = 'echo $$ > /tmp/q/$1; while [ ! -e /tmp/q/go ]; do sleep 0.05; done; echo done-$1'

    def entries() -> list[str]:
        return sorted(e["name"] for e in api.call("GET", f"/sessions/{sid}/list//tmp/q")["entries"])

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        held = [pool.submit(exec_in, api, sid, ["sh", "-c", script, "sh", str(n)]) for n in range(8)]
        wait_until(lambda: len(entries()) == 8, "eight execs running")
        late = [pool.submit(exec_in, api, sid, ["sh", "-c", "ls /tmp/q | grep -c go"]) for _ in range(2)]
        assert put(api, sid, "/tmp/q/go", b"", 0)[0] == 201
        results = [f.result() for f in held + late]
    assert [r["stdout"] for r in results] == [f"done-{n}\n" for n in range(8)] + ["1\n"] * 2
    # No timeout given: none (past the old 60 s default is too slow to test; the agent sets no
    # deadline, so the answer carries timedOut false for a command that ran its course).
    assert exec_in(api, sid, ["sleep", "1"])["timedOut"] is False
    # Detached: answered at once, runs on past the call, output in the files it names.
    marker = f"302.{uuid.uuid4().int % 10**9:09d}"
    started = exec_in(api, sid, ["sh", "-c", f"echo started; echo oops >&2; exec sleep {marker}"], detach=True)
    assert started["detached"] is True and started["stdoutPath"].startswith("/mnt/reploy-home/.reploy/")
    wait_until(lambda: sh(api, sid, f"cat {started['stdoutPath']}") == "started\n", "the detached output")
    assert sh(api, sid, f"cat {started['stderrPath']}") == "oops\n"
    assert marker in sh(api, sid, f"tr '\\0' ' ' < /proc/{started['pid']}/cmdline")
    assert any(marker in c for c in container_commands(docker_engine, server, sid))
    # A plain `nohup cmd &` still dies with its exec: detach is the supported way.
    other = f"303.{uuid.uuid4().int % 10**9:09d}"
    sh(api, sid, f"nohup sleep {other} >/dev/null 2>&1 &")
    assert not any(other in c for c in container_commands(docker_engine, server, sid))
    assert any(marker in c for c in container_commands(docker_engine, server, sid))
    # Killed with the session.
    api.call("DELETE", f"/sessions/{sid}", expect=204)
    assert not session_containers(docker_engine, server.state_dir, sid)


def test_labels_filter_and_a_time_to_live(serve_factory: Callable[..., ServeProcess],
                                          docker_engine: Any) -> None:
    server = serve_factory()
    api = server.api
    one = api.create("one", labels={"inspect.eval": "e1", "sample": "1"})
    api.create("two", labels={"inspect.eval": "e1", "sample": "2"})
    other = api.create("other")
    assert one["labels"] == {"inspect.eval": "e1", "sample": "1"} and other["labels"] == {}
    assert "expiresAt" not in one and api.get(one["id"])["labels"] == one["labels"]

    def listed(query: str) -> list[str]:
        return [s["name"] for s in api.call("GET", f"/sessions{query}")["sessions"]]

    assert listed("?label=inspect.eval=e1") == ["one", "two"]
    assert listed("?label=inspect.eval=e1&label=sample=2") == ["two"]
    assert listed("?label=inspect.eval=e2") == [] and listed("") == ["one", "two", "other"]
    assert error_of(api, "GET", "/sessions?label=nokey", None, 400) == "bad_request"
    assert error_of(api, "POST", "/sessions", {"name": "x", "labels": {"k": "a b"}}, 400) == "bad_request"
    # Past its time to live the reaper deletes it, container and disk and all.
    brief = api.create("brief", labels={"inspect.eval": "e1"}, ttlSeconds=2)
    assert seconds(brief["expiresAt"]) - seconds(brief["createdAt"]) == pytest.approx(2, abs=0.01)
    # (The record leaves the list as the delete begins; its container and disk go after.)
    wait_until(lambda: not (server.state_dir / "sessions" / brief["id"]).exists(),
               "the reaper to delete the expired session")
    assert not session_containers(docker_engine, server.state_dir, brief["id"])
    assert error_of(api, "GET", f"/sessions/{brief['id']}", None, 404) == "not_found"
    assert listed("?label=inspect.eval=e1") == ["one", "two"]
