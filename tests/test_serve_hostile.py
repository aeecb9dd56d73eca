"""Hostile agents against a real `reploy serve`: the rules of reploy.py's "Directories a
container can write" section, on the real engine.

The workload cannot reach the agent's own dir (test_serve_boundary.py shows it), but serve
still treats everything in a session's disk as hostile: the agent itself may be compromised.
Such an agent is root in its container, with SETUID, SETGID and KILL; the tests play it with
`docker exec -u 0:0` in the session's container (`as_agent`). It replaces output.log,
events.jsonl, agent-state.json, checkpoint archives and control.sock in /mnt/reploy-session/agent
with symlinks to a canary the test made on the host (a root-only file, a listening unix socket),
with FIFOs and directories, or serves its own answers on the control socket; the workload (the
exec route, `run`) nests a tree deeper than Python's recursion limit. Each test checks that no
canary byte appears in any API answer, SSE stream, snapshot archive or restored container, that
the canary socket never gets a connection, and that serve goes on: that session fails with a
clear status, the others (and the reaper) keep being served.
"""

from __future__ import annotations

import base64
import json
import os
import tarfile
from pathlib import Path
from typing import Any, Callable

import pytest

from serve_harness import (  # noqa: F401  (fixtures)
    Api, ServeProcess, managed_workload, serve_factory, session_containers, sse_events, wait_until,
)
from test_container_paths import (  # noqa: F401  (fixtures)
    CANARY, CanarySocket, canary, canary_socket,
)

pytestmark = pytest.mark.docker

SESSION_MOUNT = "/mnt/reploy-session"
AGENT_DIR = f"{SESSION_MOUNT}/agent"

#: A compromised agent's own server on control.sock, started as root in the container: it forks
#: into its own session (so it outlives the exec), binds beside control.sock and renames over
#: it, then tells the exec to end. It answers every request as argv[1] says.
FAKE_AGENT = r"""
import base64, json, os, socket, sys, threading, time
mode, path = sys.argv[1], "/mnt/reploy-session/agent/control.sock"
ready_r, ready_w = os.pipe()
if os.fork():
    os.close(ready_w)
    os.read(ready_r, 1)
    sys.exit(0)
os.setsid()
null = os.open("/dev/null", os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path + ".new")
server.listen(16)
os.rename(path + ".new", path)
os.write(ready_w, b"!")
ANSWERS = {"list": b'{"id":"serve","result":[]}\n', "deep": b"[" * 200000 + b"\n",
           "no-result": b'{"id":"serve"}\n'}
PAGE = base64.b64encode(b"x" * (1 << 20)).decode()
BIG_ENTRY = {"name": "x" * (3 << 20), "type": "file", "size": 0, "mode": 420, "mtime": 0}
pages = []
def flood(request):
    method = json.loads(request)["method"]
    if method == "exec":
        return {"exec_id": "flood"}
    if method == "stat":
        return {"entry": {**BIG_ENTRY, "name": ".", "type": "directory"}}
    if method == "list":  # one huge entry a page; after 40 pages (past any bound) none
        pages.append(1)
        return {"entries": [BIG_ENTRY] if len(pages) <= 40 else [], "total": 10 ** 9}
    return {"running": True, "stdout_b64": PAGE, "stderr_b64": "", "stdout_bytes": 0, "stderr_bytes": 0}
def answer(connection):
    try:
        request = connection.recv(1 << 20)
        if mode == "trickle":  # one byte at a time, each well inside any per-read timeout
            while True:
                connection.sendall(b" ")
                time.sleep(0.5)
        if mode == "flood":  # exec output without end
            connection.sendall(json.dumps({"id": "serve", "result": flood(request)}).encode() + b"\n")
            return
        connection.sendall(ANSWERS[mode])
    except OSError:
        pass
    finally:
        connection.close()
while True:
    connection, _ = server.accept()
    threading.Thread(target=answer, args=(connection,), daemon=True).start()
"""


def run(api: Api, sid: str, script: str, *args: str, expect_exit: int = 0) -> dict[str, Any]:
    """`sh -c script` in the session's container, as its runtime uid."""
    result = api.call("POST", f"/sessions/{sid}/exec", {"argv": ["sh", "-c", script, "sh", *args]})
    assert result["exitCode"] == expect_exit, result
    return result


def as_agent(server: ServeProcess, docker: Any, sid: str, script: str, *args: str) -> None:
    """`sh -c script` in the session's container as a compromised agent: root there, with the
    container's capabilities (SETUID, SETGID, KILL)."""
    [container] = session_containers(docker, server.state_dir, sid)
    result = container.exec_run(["sh", "-c", script, "sh", *args], user="0:0")
    assert result.exit_code == 0, result.output


def swap_for_link(server: ServeProcess, docker: Any, sid: str, name: str, target: Path) -> None:
    """Replace the agent's DIR/agent/name with a symlink to a host path, atomically."""
    as_agent(server, docker, sid, 'ln -sfn "$1" "$2/.swap" && mv -f "$2/.swap" "$2/$3"', str(target),
             AGENT_DIR, name)


def without_canary(data: bytes) -> bytes:
    """Asserts the canary is not in `data`, raw or in any base64 field of a JSON document."""
    assert CANARY.strip() not in data
    try:
        document = json.loads(data)
    except ValueError:
        return data

    def walk(value: Any, key: str = "") -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, k)
        elif isinstance(value, list):
            for v in value:
                walk(v, key)
        elif isinstance(value, str) and key.endswith("Base64"):
            assert CANARY.strip() not in base64.b64decode(value)
    walk(document)
    return data


def answer(api: Api, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    """(status, document) of one API call, checked for the canary."""
    status, raw = api.raw(method, "/api/v1" + path, None if body is None else json.dumps(body).encode())
    return status, json.loads(without_canary(raw))


def keepalives(count: int) -> Callable[[list[dict[str, Any]]], bool]:
    return lambda events: sum(1 for e in events if e.get("comment") == "keepalive") >= count


def streamed_bytes(events: list[dict[str, Any]]) -> bytes:
    return b"".join(base64.b64decode(e["data"]["payloadBase64"]) for e in events if e.get("event") == "output")


def test_symlinked_files_and_archives_never_yield_the_host_file(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any, canary: Path) -> None:
    server = serve_factory("--sse-keepalive", "200ms")
    api = server.api
    sid = api.create("hostile")["id"]
    api.wait_output(sid, b"$ ")
    for name in ("output.log", "events.jsonl", "agent-state.json",
                 *(f"checkpoint-v{n}.tar" for n in range(1, 41))):
        swap_for_link(server, docker_engine, sid, name, canary)

    events = sse_events(api, sid, offset=0, until=keepalives(2))
    assert CANARY.strip() not in streamed_bytes(events) and keepalives(2)(events)
    for method, path, body in (("POST", f"/sessions/{sid}/read", {"offset": 0}),
                               ("GET", f"/sessions/{sid}", None), ("GET", "/sessions", None),
                               ("GET", f"/sessions/{sid}/status", None)):
        status, _ = answer(api, method, path, body)
        assert status == 200
    status, refused = answer(api, "POST", f"/sessions/{sid}/snapshot", {})
    assert status == 409 and "checkpoint archive is refused" in refused["error"]
    assert "is a symlink, not a regular file" in refused["error"]
    session = api.get(sid)
    assert session["state"] == "active" and session["snapshotBytes"] is None
    assert "output.log is a symlink, not a regular file" in server.stderr

    assert b"still-here" in without_canary(json.dumps(run(api, sid, "echo still-here")).encode())
    api.call("DELETE", f"/sessions/{sid}")
    assert canary.read_bytes() == CANARY and (canary.stat().st_mode & 0o777) == 0o600


def test_a_control_socket_linked_to_a_host_socket_is_never_connected(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any,
        canary_socket: CanarySocket) -> None:
    server = serve_factory()
    api = server.api
    sid = api.create("hostile")["id"]
    bystander = api.create("bystander")["id"]
    swap_for_link(server, docker_engine, sid, "control.sock", canary_socket.path)

    status, document = answer(api, "GET", f"/sessions/{sid}/status")
    assert status == 200 and document["agent"] is None
    for path, body in (("write", {"dataBase64": base64.b64encode(b"id\r").decode()}),
                       ("read", {"offset": 0}), ("message", {"text": "id"}),
                       ("exec", {"argv": ["id"]}), ("resize", {"columns": 90, "rows": 30}),
                       ("snapshot", {})):
        status, document = answer(api, "POST", f"/sessions/{sid}/{path}", body)
        assert status == 503, (path, document)
        assert "control.sock is a symlink, not a socket" in document["error"], (path, document)
    assert api.get(sid)["state"] == "active"
    assert canary_socket.connections() == 0

    api.write(bystander, b"echo bystander-$((6*7))\r")
    api.wait_output(bystander, b"bystander-42")
    api.call("DELETE", f"/sessions/{sid}")
    assert canary_socket.path.exists() and canary_socket.connections() == 0


def test_a_fifo_output_log_does_not_hold_the_stream(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    server = serve_factory("--sse-keepalive", "200ms")
    api = server.api
    sid = api.create("hostile")["id"]
    as_agent(server, docker_engine, sid, f"rm {AGENT_DIR}/output.log && mkfifo {AGENT_DIR}/output.log")
    events = sse_events(api, sid, offset=0, until=keepalives(3))
    assert keepalives(3)(events) and not [e for e in events if e.get("event") == "output"]
    assert "output.log is a fifo, not a regular file" in server.stderr
    assert b"fine" in json.dumps(run(api, sid, "echo fine")).encode()
    api.call("DELETE", f"/sessions/{sid}")


@pytest.mark.parametrize("mode", ["list", "deep", "no-result", "trickle"])
def test_its_own_server_on_the_control_socket_fails_only_that_session(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any, mode: str) -> None:
    """The reaper asks every active session for its status each pass: answers that are not
    responses, JSON nested past the recursion limit or bytes trickled forever cost that session
    its answer, never the reaper, which still pauses an idle bystander."""
    server = serve_factory("--idle-after", "1s")
    api = server.api
    sid = api.create("hostile")["id"]
    as_agent(server, docker_engine, sid, 'python3 -c "$1" "$2"', FAKE_AGENT, mode)
    bystander = api.create("bystander")["id"]
    wait_until(lambda: api.get(bystander)["state"] == "idle" and api.get(sid)["state"] == "idle",
               "the reaper to pause both sessions", timeout_s=60)
    status, document = answer(api, "POST", f"/sessions/{sid}/write",
                              {"dataBase64": base64.b64encode(b"id\r").decode()})
    assert status == 503 and "agent" in document["error"]
    assert "Exception in thread" not in server.stderr and "internal error" not in server.stderr
    api.write(bystander, b"echo bystander-$((6*7))\r")
    api.wait_output(bystander, b"bystander-42")


def test_exec_output_and_listings_past_their_bounds_from_its_own_server_are_refused(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    """The agent keeps at most the cap of each exec stream and pages listings in bounded
    JSON; a server that sends more without end would grow serve's memory (one process for
    every session) for as long as the client waits."""
    server = serve_factory()
    api = server.api
    sid = api.create("hostile")["id"]
    as_agent(server, docker_engine, sid, 'python3 -c "$1" "$2"', FAKE_AGENT, "flood")
    status, document = answer(api, "POST", f"/sessions/{sid}/exec",
                              {"argv": ["true"], "maxOutputBytes": 65536})
    assert status == 503 and "more output than the cap" in document["error"]
    status, document = answer(api, "GET", f"/sessions/{sid}/list/")
    assert status == 503 and "listing is too large" in document["error"]


def test_junk_in_the_session_dir_does_not_stop_snapshot_restore_or_delete(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any, canary: Path) -> None:
    server = serve_factory()
    api = server.api
    sid = api.create("hostile")["id"]
    session_dir = server.state_dir / "sessions" / sid
    agent_dir = session_dir / "agent"
    as_agent(server, docker_engine, sid, 'mkdir "$1/checkpoint-x.tar" && echo junk > "$1/checkpoint-x.tar/f" && '
                                         'ln -s "$2" "$1/checkpoint-y.tar"', AGENT_DIR, str(canary))
    run(api, sid, 'ln -s "$2" "$1/workspace/to-canary"', SESSION_MOUNT, str(canary))

    snapshot = api.call("POST", f"/sessions/{sid}/snapshot", {})
    assert snapshot["state"] == "snapshot"
    [archive] = [p for p in agent_dir.iterdir() if p.name.startswith("checkpoint-")]
    assert archive.is_file() and not archive.is_symlink()
    assert snapshot["snapshotBytes"] == archive.stat().st_size
    assert CANARY.strip() not in archive.read_bytes()
    with tarfile.open(archive) as tar:
        assert all(CANARY.strip() not in tar.extractfile(m).read() for m in tar.getmembers() if m.isfile())

    assert api.call("POST", f"/sessions/{sid}/switch", {})["state"] == "active"
    result = run(api, sid, 'grep -rl CANARY- "$1" "$2"; cat "$1/to-canary"',
                 f"{SESSION_MOUNT}/workspace", "/mnt/reploy-home", expect_exit=1)
    without_canary(json.dumps(result).encode())
    assert result["stdout"] == ""

    run(api, sid, 'python3 -c "$1"', "import os\nfor _ in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\n")
    api.call("DELETE", f"/sessions/{sid}")
    assert not os.path.lexists(session_dir) and api.call("GET", "/sessions")["sessions"] == []
    assert canary.read_bytes() == CANARY
