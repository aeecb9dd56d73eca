"""Managed sessions as a harness backend, on the real engine: exec (exit codes, signals, timeouts
that leave nothing behind, beside a busy terminal, a client that goes away), files in and out
(a 50 MiB file and a tree, checked by digests inside and out), hostile paths and archives refused
with nothing written, persistence across snapshot and restore, and the `session exec`/`cp` CLI."""

from __future__ import annotations

import base64
import hashlib
import http.client
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

import reploy_serve
from serve_harness import (  # noqa: F401  (fixtures)
    cli_error,
    ROOT, Api, ServeProcess, managed_workload, serve_factory, session_containers, wait_until,
)
from standin_agent import StandInAgent, control_socket

pytestmark = pytest.mark.docker
BIG_BYTES = 50 * 1024 * 1024


def exec_in(api: Api, sid: str, argv: list[str], expect: int = 200, **extra: Any) -> dict[str, Any]:
    return api.call("POST", f"/sessions/{sid}/exec", {"argv": argv, **extra}, expect)


def sh(api: Api, sid: str, script: str, **extra: Any) -> str:
    """The stdout of `sh -c script`, which must exit 0."""
    result = exec_in(api, sid, ["sh", "-c", script], **extra)
    assert result["exitCode"] == 0, result
    return result["stdout"]


def put(api: Api, sid: str, path: str, body: Any, size: int, content_type: str = "application/octet-stream",
        query: str = "") -> tuple[int, dict[str, Any]]:
    """A streamed upload: body is bytes or a file object of `size` bytes."""
    conn = http.client.HTTPConnection(api.host, api.port, timeout=120, blocksize=1 << 20)
    try:
        try:
            conn.request("PUT", f"/api/v1/sessions/{sid}/files/{path}{query}", body=body,
                         headers={**api.auth_headers, "Content-Type": content_type,
                                  "Content-Length": str(size)})
        except BrokenPipeError:
            pass  # refused before the whole body was sent: its answer is waiting
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def get(api: Api, sid: str, path: str, query: str = "") -> tuple[int, bytes, Optional[str]]:
    conn = http.client.HTTPConnection(api.host, api.port, timeout=120)
    try:
        conn.request("GET", f"/api/v1/sessions/{sid}/files/{path}{query}", headers=api.auth_headers)
        response = conn.getresponse()
        return response.status, response.read(), response.getheader("Content-Type")
    finally:
        conn.close()


def container_commands(docker_engine: Any, server: ServeProcess, sid: str) -> list[str]:
    """The command lines of every process in the session's container (the engine's `top`)."""
    [container] = session_containers(docker_engine, server.state_dir, sid)
    top = container.top(ps_args="-o pid,args")
    return [row[-1] for row in top["Processes"]]


def cli(server: ServeProcess, action: str, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "reploy.py"), "session", action, "--server",
                           server.ready["url"], *args], input=stdin, capture_output=True, timeout=300,
                          env=server.client_env())


def tar_bytes(*members: tuple[str, bytes, bytes, str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, kind, content, link in members:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.size = kind, link, len(content)
            archive.addfile(info, io.BytesIO(content) if content else None)
    return buffer.getvalue()


def test_exec_ends_and_leaves_nothing_behind(serve_factory: Callable[..., ServeProcess],
                                             docker_engine: Any) -> None:
    server = serve_factory()
    api = server.api
    sid = api.create("exec")["id"]
    ok = exec_in(api, sid, ["sh", "-c", 'echo out; echo err >&2; id -u; echo "$HOME"; pwd'])
    assert (ok["exitCode"], ok["signal"], ok["timedOut"]) == (0, None, False)
    assert ok["stdout"] == "out\n1000\n/mnt/reploy-home\n/mnt/reploy-session/workspace\n"
    assert (ok["stderrEncoding"], ok["stderr"]) == ("text", "err\n") and "stderrBase64" not in ok
    binary = exec_in(api, sid, ["printf", "\\001\\377"])
    assert (binary["stdoutEncoding"], base64.b64decode(binary["stdoutBase64"])) == ("base64", b"\x01\xff")
    assert "stdout" not in binary
    three = exec_in(api, sid, ["sh", "-c", "exit 3"])
    assert (three["exitCode"], three["signal"]) == (3, None)
    signalled = exec_in(api, sid, ["sh", "-c", "kill -TERM $$"])
    assert (signalled["exitCode"], signalled["signal"]) == (None, "SIGTERM")
    marker = f"300.{uuid.uuid4().int % 10**9:09d}"
    timed = exec_in(api, sid, ["sh", "-c", f"sleep {marker} & setsid sleep {marker} & sleep {marker}"],
                    timeoutMs=1000)
    assert (timed["timedOut"], timed["signal"], timed["exitCode"]) == (True, "SIGKILL", None)
    assert not [c for c in container_commands(docker_engine, server, sid) if marker in c]
    # A client that goes away takes its command with it.
    marker = f"301.{uuid.uuid4().int % 10**9:09d}"
    conn = http.client.HTTPConnection(api.host, api.port, timeout=30)
    conn.request("POST", f"/api/v1/sessions/{sid}/exec", json.dumps({"argv": ["sleep", marker]}),
                 {**api.auth_headers, "Content-Type": "application/json"})
    wait_until(lambda: any(marker in c for c in container_commands(docker_engine, server, sid)),
               "the sleep to start")
    conn.close()
    wait_until(lambda: not any(marker in c for c in container_commands(docker_engine, server, sid)),
               "the sleep to be killed after its client left")
    # Errors: a program that cannot run, a cwd through a symlink, a missing cwd.
    assert "cannot run" in api.call("POST", f"/sessions/{sid}/exec", {"argv": ["nope"]}, 422)["error"]
    sh(api, sid, "ln -s /etc etc-link")
    assert api.call("POST", f"/sessions/{sid}/exec", {"argv": ["true"], "cwd": "etc-link"}, 422)
    assert api.call("POST", f"/sessions/{sid}/exec", {"argv": ["true"], "cwd": "missing"}, 404)
    assert api.call("POST", f"/sessions/{sid}/exec", {"argv": "true"}, 400)


def test_exec_beside_top_in_the_terminal(serve_factory: Callable[..., ServeProcess],
                                         docker_engine: Any) -> None:
    server = serve_factory()
    api = server.api
    sid = api.create("busy")["id"]
    api.wait_output(sid, b"$ ")
    api.write(sid, b"top -d 1\r")
    api.wait_output(sid, b"PID")
    status = lambda: api.call("GET", f"/sessions/{sid}/status")["agent"]  # noqa: E731
    busy = wait_until(lambda: (lambda s: s if s["turnState"] == "in_progress" else None)(status()), "top")
    assert sh(api, sid, "echo beside-top") == "beside-top\n"
    wait_until(lambda: status()["logBytes"] > busy["logBytes"], "top to keep drawing")
    assert status()["turnState"] == "in_progress"
    api.write(sid, b"q")
    wait_until(lambda: status()["turnState"] == "idle", "top to quit")
    # The other way round: the terminal answers while an exec runs.
    thread_result: list[Any] = []
    runner = threading.Thread(target=lambda: thread_result.append(exec_in(api, sid, ["sleep", "3"])))
    runner.start()
    wait_until(lambda: any(c.startswith("sleep 3") for c in container_commands(docker_engine, server, sid)),
               "the exec's sleep")
    api.call("POST", f"/sessions/{sid}/message", {"text": "echo typed-$((6*7))"})
    api.wait_output(sid, b"typed-42\r\n")
    assert runner.is_alive()  # the terminal answered while the exec still ran
    runner.join(timeout=30)
    assert thread_result[0]["exitCode"] == 0


def test_files_in_and_out(serve_factory: Callable[..., ServeProcess], docker_engine: Any,
                          tmp_path: Path) -> None:
    server = serve_factory()
    api = server.api
    sid = api.create("files")["id"]
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        for _ in range(BIG_BYTES // (1 << 20)):
            f.write(os.urandom(1 << 20))
    digest = hashlib.sha256(big.read_bytes()).hexdigest()
    with open(big, "rb") as body:
        status, result = put(api, sid, "data/big.bin", body, BIG_BYTES)
    assert status == 201 and result["sha256"] == digest and result["bytes"] == BIG_BYTES
    assert sh(api, sid, "sha256sum data/big.bin").split()[0] == digest
    assert sh(api, sid, "stat -c '%u:%g %a' data/big.bin data") == "1000:1000 644\n1000:1000 755\n"
    status, data, content_type = get(api, sid, "data/big.bin")
    assert status == 200 and content_type == "application/octet-stream"
    assert hashlib.sha256(data).hexdigest() == digest
    listing = api.call("GET", f"/sessions/{sid}/list/data")
    [entry] = listing["entries"]
    assert {k: entry[k] for k in ("name", "type", "size", "mode")} == {
        "name": "big.bin", "type": "file", "size": BIG_BYTES, "mode": 0o644}
    assert listing["entry"]["type"] == "directory" and entry["mtime"] > 0
    # A small tree in and out through the CLI, like docker cp.
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text("alpha\n")
    (tree / "sub/b.sh").write_text("#!/bin/sh\necho beta\n")
    (tree / "sub/b.sh").chmod(0o755)
    (tree / "link").symlink_to("a.txt")
    proc = cli(server, "cp", str(tree), f"{sid}:")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["destination"] == f"{sid}:tree"
    assert sh(api, sid, "cat tree/a.txt; ./tree/sub/b.sh; readlink tree/link") == "alpha\nbeta\na.txt\n"
    out = tmp_path / "out"
    proc = cli(server, "cp", f"{sid}:tree", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "a.txt").read_text() == "alpha\n" and os.readlink(out / "link") == "a.txt"
    assert (out / "sub/b.sh").stat().st_mode & 0o777 == 0o755
    proc = cli(server, "cp", f"{sid}:tree/a.txt", str(tmp_path))
    assert proc.returncode == 0 and (tmp_path / "a.txt").read_text() == "alpha\n"
    # To stdout (`-`) the data is all there is: a file's bytes, a directory's tar, no summary line.
    proc = cli(server, "cp", f"{sid}:tree/a.txt", "-")
    assert proc.returncode == 0 and proc.stdout == b"alpha\n", proc.stderr
    proc = cli(server, "cp", f"{sid}:tree", "-")
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as archive:
        assert sorted(archive.getnames()) == ["a.txt", "link", "sub", "sub/b.sh"]
    assert proc.stdout.endswith(b"\0" * 512)
    # A directory downloads as a tar; the home is reachable too.
    status, data, content_type = get(api, sid, "tree")
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        assert sorted(archive.getnames()) == ["a.txt", "link", "sub", "sub/b.sh"]
    assert content_type == "application/x-tar"
    conn = http.client.HTTPConnection(api.host, api.port, timeout=120)
    conn.request("GET", f"/api/v1/sessions/{sid}/files/tree/a.txt", headers=api.auth_headers)
    response = conn.getresponse()
    assert response.read() == b"alpha\n" and response.headers.get_all("X-Content-Type-Options") == ["nosniff"]
    conn.close()
    assert put(api, sid, ".profile", b"export X=1\n", 11, query="?root=home")[0] == 201
    assert sh(api, sid, 'cat "$HOME/.profile"') == "export X=1\n"
    # The home is a 64 MiB tmpfs: 60 MiB would leave less than the agent keeps free.
    with open(big, "rb") as body:
        status, error = put(api, sid, "huge.bin", io.BytesIO(body.read(60 << 20)), 60 << 20, query="?root=home")
    assert status == 507 and "not enough space" in error["error"]
    # The CLI reads that early answer too, though the server refused before taking the body.
    proc = cli(server, "cp", str(big), f"{sid}:~/huge.bin")
    refused = cli_error(proc)
    assert refused["status"] == 507 and "not enough space" in refused["error"], refused
    assert sh(api, sid, 'ls -A "$HOME"') == ".profile\n"


def test_hostile_paths_and_archives_write_nothing(serve_factory: Callable[..., ServeProcess],
                                                  docker_engine: Any) -> None:
    server = serve_factory()
    api = server.api
    sid = api.create("hostile")["id"]
    sh(api, sid, "ln -s /etc etc; mkdir kept; echo ok > kept/ok.txt")
    before = sh(api, sid, "find . | sort; find /tmp | sort")
    cases = [
        ("%2Fetc%2Fx", b"x", "application/octet-stream", 403),  # absolute: /etc is root's
        ("/etc/x", b"x", "application/octet-stream", 403),  # absolute, an empty segment
        ("../x", b"x", "application/octet-stream", 422),
        ("kept/../../x", b"x", "application/octet-stream", 422),
        ("etc/passwd", b"x", "application/octet-stream", 422),  # through the symlink
        ("etc", b"x", "application/octet-stream", 409),  # onto the symlink itself
        ("kept", tar_bytes(("ok.txt", tarfile.REGTYPE, b"new", ""), ("../x", tarfile.REGTYPE, b"x", "")),
         "application/x-tar", 422),
        ("kept", tar_bytes(("null", tarfile.CHRTYPE, b"", "")), "application/x-tar", 422),
        ("kept", tar_bytes(("s", tarfile.SYMTYPE, b"", "/etc"), ("s/x", tarfile.REGTYPE, b"x", "")),
         "application/x-tar", 422),
        ("kept", tar_bytes(("h", tarfile.LNKTYPE, b"", "/etc/passwd")), "application/x-tar", 422),
        ("etc", tar_bytes(("x", tarfile.REGTYPE, b"x", "")), "application/x-tar", 422),
        ("kept/x", b"x", "text/plain", 415),
    ]
    for path, body, content_type, status in cases:
        got, document = put(api, sid, path, body, len(body), content_type)
        assert got == status, (path, got, document)
        assert set(document) == {"error", "code"}
    for route in ("files/etc/passwd", "list/etc/x", "files/etc", "files/..%2F..%2Fetc%2Fpasswd"):
        status, raw = api.raw("GET", f"/api/v1/sessions/{sid}/{route}")
        assert status == 422, (route, raw)
    link = api.call("GET", f"/sessions/{sid}/list/etc")  # described, never followed
    assert (link["entry"]["type"], link["entry"]["target"], link["entries"]) == ("symlink", "/etc", None)
    assert api.raw("GET", f"/api/v1/sessions/{sid}/files/missing")[0] == 404
    assert sh(api, sid, "find . | sort; find /tmp | sort") == before
    assert sh(api, sid, "cat kept/ok.txt") == "ok\n"


def announce_upload(api: Api, sid: str, path: str, size: int) -> tuple[int, dict[str, Any]]:
    """A PUT whose headers announce `size` bytes, and no byte of the body: the answer must come
    from the headers alone (a server waiting for the body fails the read's deadline)."""
    conn = http.client.HTTPConnection(api.host, api.port, timeout=30)
    try:
        conn.putrequest("PUT", f"/api/v1/sessions/{sid}/files/{path}")
        for name, value in {**api.auth_headers, "Content-Type": "application/octet-stream",
                            "Content-Length": str(size)}.items():
            conn.putheader(name, value)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_an_upload_announcing_more_than_the_bound_is_refused_before_its_body(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    """More than 8 GiB in Content-Length is 413 from serve itself, before a byte of the body is
    read: the agent is never asked to open an upload (the stand-in on its control socket
    relays and records every request), and nothing lands in the session. Exactly the bound
    passes serve's check and goes on to the agent, whose own free-space check refuses it."""
    server = serve_factory()
    api = server.api
    sid = api.create("too-big")["id"]
    before = sh(api, sid, "find . | sort")
    stand = StandInAgent(control_socket(server.state_dir, sid))
    try:
        status, document = announce_upload(api, sid, "big.bin", reploy_serve.MAX_UPLOAD_BYTES + 1)
        assert (status, document) == (413, {
            "error": f"the body exceeds {reploy_serve.MAX_UPLOAD_BYTES} bytes", "code": "too_large"})
        assert not [m for m in stand.methods() if m.startswith("upload")], stand.methods()
        status, document = announce_upload(api, sid, "big.bin", reploy_serve.MAX_UPLOAD_BYTES)
        assert status == 507 and "not enough space" in document["error"], (status, document)
        assert stand.count("upload") == 1
    finally:
        stand.close()
    assert sh(api, sid, "find . | sort") == before


def test_an_upload_is_committed_only_as_sent(serve_factory: Callable[..., ServeProcess],
                                            docker_engine: Any) -> None:
    """The body is spliced into the staging and hashed once, by the agent: given ?sha256=, the
    agent commits only bytes of that digest (another is 422 and the file there is left as it
    was); a body that ends before its Content-Length is 400 and lands nothing. The answer's
    sha256 is the digest of what was committed."""
    server = serve_factory()
    api = server.api
    sid = api.create("digests")["id"]
    data = os.urandom(3 * 1024 * 1024 + 5)
    digest = hashlib.sha256(data).hexdigest()
    # Spliced into each root's file system: the workspace's, the home's, the container's /tmp.
    for path, root, shown in (("d.bin", "workspace", "d.bin"), ("d.bin", "home", "$HOME/d.bin"),
                              ("/tmp/d.bin", "container", "/tmp/d.bin")):
        status, result = put(api, sid, path, data, len(data), query=f"?sha256={digest}&root={root}")
        assert status == 201 and result["sha256"] == digest and result["bytes"] == len(data), result
        assert sh(api, sid, f"sha256sum {shown}").split()[0] == digest
    other = os.urandom(len(data))
    status, result = put(api, sid, "d.bin", other, len(other), query=f"?sha256={digest}")
    assert status == 422 and result["error"].startswith("agent: sha256 mismatch"), (status, result)
    assert sh(api, sid, "sha256sum d.bin").split()[0] == digest
    status, result = put(api, sid, "d.bin", data, len(data), query="?sha256=" + "0" * 63)
    assert status == 400 and "sha256" in result["error"], (status, result)
    before = sh(api, sid, "find . | sort")
    conn = http.client.HTTPConnection(api.host, api.port, timeout=120)
    try:
        conn.putrequest("PUT", f"/api/v1/sessions/{sid}/files/short.bin")
        for name, value in {**api.auth_headers, "Content-Type": "application/octet-stream",
                            "Content-Length": str(len(data))}.items():
            conn.putheader(name, value)
        conn.endheaders(data[:2 * 1024 * 1024])
        assert conn.sock is not None
        conn.sock.shutdown(socket.SHUT_WR)
        response = conn.getresponse()
        document = json.loads(response.read())
    finally:
        conn.close()
    assert response.status == 400, (response.status, document)
    assert document["error"] == f"the body ended after {2 * 1024 * 1024} of {len(data)} bytes"
    assert sh(api, sid, "find . | sort") == before


def test_files_survive_snapshot_and_restore(serve_factory: Callable[..., ServeProcess],
                                            docker_engine: Any) -> None:
    server = serve_factory()
    api = server.api
    sid = api.create("persist")["id"]
    data = os.urandom(3 * 1024 * 1024)
    assert put(api, sid, "keep/data.bin", data, len(data))[0] == 201
    assert api.call("POST", f"/sessions/{sid}/snapshot", {})["state"] == "snapshot"
    assert not session_containers(docker_engine, server.state_dir, sid)
    status, back, _ = get(api, sid, "keep/data.bin")  # an access: restores the session
    assert status == 200 and back == data
    assert api.get(sid)["state"] == "active"
    assert api.call("POST", f"/sessions/{sid}/snapshot", {})["state"] == "snapshot"
    result = exec_in(api, sid, ["sha256sum", "keep/data.bin"])  # exec restores too
    assert result["stdout"].split()[0] == hashlib.sha256(data).hexdigest()


def test_session_exec_cli(serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    server = serve_factory()
    sid = server.api.create("cli")["id"]
    proc = cli(server, "exec", sid, "--env", "GREETING=hi", "--cwd", ".", "--", "sh", "-c",
               'echo "$GREETING"; exit 3')
    assert proc.returncode == 0
    assert {k: v for k, v in json.loads(proc.stdout).items() if k in ("exitCode", "stdout")} == {
        "exitCode": 3, "stdout": "hi\n"}
    raw = cli(server, "exec", sid, "--raw", "--stdin", "--", "sh", "-c", "cat; echo err >&2; exit 3",
              stdin=b"piped\n")
    assert (raw.returncode, raw.stdout, raw.stderr) == (3, b"piped\n", b"err\n")
    assert cli(server, "exec", sid, "--raw", "--", "sh", "-c", "kill -KILL $$").returncode == 137
    assert cli(server, "exec", sid, "--raw", "--timeout", "300ms", "--", "sleep", "30").returncode == 124
    missing = cli(server, "exec", sid, "--raw", "--", "no-such-program")
    assert missing.returncode == 126 and b"cannot run" in missing.stderr and missing.stdout == b""
    usage = cli(server, "exec", sid, "--", )
    assert usage.returncode == 2 and usage.stdout == b""
    # Ctrl-C: exit 130 with a one-line message (no traceback), and the command goes with the connection.
    marker = f"302.{uuid.uuid4().int % 10**9:09d}"
    interrupted = subprocess.Popen([sys.executable, str(ROOT / "reploy.py"), "session", "exec", "--server",
                                    server.ready["url"], sid, "--", "sleep", marker],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=server.client_env())
    wait_until(lambda: any(marker in c for c in container_commands(docker_engine, server, sid)), "the sleep")
    interrupted.send_signal(signal.SIGINT)
    out, err = interrupted.communicate(timeout=30)
    assert (interrupted.returncode, out, err) == (130, b"", b"reploy: session exec: interrupted\n")
    wait_until(lambda: not any(marker in c for c in container_commands(docker_engine, server, sid)),
               "the sleep to be killed after the CLI was interrupted")
