"""Hostile agents against a real `reploy serve`: the rules of reploy.py's "Directories a
container can write" section, on the real engine.

The workload cannot reach the agent's own dir (test_serve_boundary.py shows it), but serve
still treats everything in a session's disk as hostile: the agent itself may be compromised.
Such an agent is root in its container, with SETUID, SETGID, SETPCAP and KILL; the tests play it with
`docker exec -u 0:0` in the session's container (`as_agent`). It replaces output.log,
events.jsonl, agent-state.json, checkpoint archives and control.sock in /mnt/reploy-session/agent
with symlinks to a canary the test made on the host (a root-only file, a listening unix socket),
with FIFOs and directories (a server of its own on the control socket: test_serve_hostile_answers.py,
through tests/standin_agent.py); the workload (the exec route, `run`) nests a tree deeper than Python's recursion limit. Each test checks that no
canary byte appears in any API answer, SSE stream, snapshot archive or restored container, that
the canary socket never gets a connection, and that serve goes on: that session fails with a
clear status, the others (and the reaper) keep being served.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import tarfile
from pathlib import Path
from typing import Any, Callable

import pytest

from serve_harness import (  # noqa: F401  (fixtures)
    Api, ServeProcess, managed_workload, serve_factory, session_containers, sse_events,
)
from test_container_paths import (  # noqa: F401  (fixtures)
    CANARY, CanarySocket, canary, canary_socket,
)

pytestmark = pytest.mark.docker

SESSION_MOUNT = "/mnt/reploy-session"
AGENT_DIR = f"{SESSION_MOUNT}/agent"

def run(api: Api, sid: str, script: str, *args: str, expect_exit: int = 0) -> dict[str, Any]:
    """`sh -c script` in the session's container, as its runtime uid."""
    result = api.call("POST", f"/sessions/{sid}/exec", {"argv": ["sh", "-c", script, "sh", *args]})
    assert result["exitCode"] == expect_exit, result
    return result


def as_agent(server: ServeProcess, docker: Any, sid: str, script: str, *args: str) -> None:
    """`sh -c script` in the session's container as a compromised agent: root there, with the
    container's capabilities (SETUID, SETGID, SETPCAP, KILL)."""
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
    session = api.get(sid)  # paused, not active, the refusal kept (issue 26)
    assert session["state"] == "idle" and "checkpoint" not in session
    assert "checkpoint archive is refused" in session["lastFailure"]["reason"]
    assert "output.log is a symlink, not a regular file" in server.stderr

    assert b"still-here" in without_canary(json.dumps(run(api, sid, "echo still-here")).encode())
    api.call("DELETE", f"/sessions/{sid}", expect=204)
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
    # Seed 002's routes answer a failure the spec does not name 500; Reploy's own say 503.
    for path, body, expected in (("write", {"payload": "id\r"}, 500), ("read", {"offset": 0}, 500),
                                 ("snapshot", {}, 500), ("message", {"text": "id"}, 503),
                                 ("exec", {"argv": ["id"]}, 503),
                                 ("resize", {"columns": 90, "rows": 30}, 503)):
        status, document = answer(api, "POST", f"/sessions/{sid}/{path}", body)
        assert status == expected, (path, document)
        assert "control.sock is a symlink, not a socket" in document["error"], (path, document)
    assert api.get(sid)["state"] == "active"
    assert canary_socket.connections() == 0

    api.write(bystander, b"echo bystander-$((6*7))\r")
    api.wait_output(bystander, b"bystander-42")
    api.call("DELETE", f"/sessions/{sid}", expect=204)
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
    api.call("DELETE", f"/sessions/{sid}", expect=204)


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
    assert snapshot["checkpoint"]["sizeBytes"] == archive.stat().st_size
    assert CANARY.strip() not in archive.read_bytes()
    with tarfile.open(archive) as tar:
        assert all(CANARY.strip() not in tar.extractfile(m).read() for m in tar.getmembers() if m.isfile())

    assert api.call("POST", f"/sessions/{sid}/switch", {})["state"] == "active"
    result = run(api, sid, 'grep -rl CANARY- "$1" "$2"; cat "$1/to-canary"',
                 f"{SESSION_MOUNT}/workspace", "/mnt/reploy-home", expect_exit=1)
    without_canary(json.dumps(result).encode())
    assert result["stdout"] == ""

    run(api, sid, 'python3 -c "$1"', "import os\nfor _ in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\n")
    api.call("DELETE", f"/sessions/{sid}", expect=204)
    assert not os.path.lexists(session_dir) and api.call("GET", "/sessions")["sessions"] == []
    assert canary.read_bytes() == CANARY


def test_a_directory_too_large_for_one_download_is_refused_at_once_with_what_happened(
        serve_factory: Callable[..., ServeProcess]) -> None:
    """Issue 42: a directory whose files hold exactly the most one download carries (a sparse
    file of 8 GiB) makes a tar a few headers larger. The agent let it through and serve cut the
    body after 8 GiB, telling its log the agent had sent too much. The agent counts the tar's
    headers too: the download is refused before a byte goes, saying why."""
    import agent

    server = serve_factory()
    sid = server.api.create("big")["id"]
    run(server.api, sid, 'mkdir big && truncate -s "$1" big/sparse', str(agent.MAX_TRANSFER_BYTES))
    conn = http.client.HTTPConnection(server.api.host, server.api.port, timeout=60)
    try:  # the head first: a 200 would be followed by 8 GiB, which this test never reads
        conn.request("GET", f"/api/v1/sessions/{sid}/files/big", headers=server.api.auth_headers)
        response = conn.getresponse()
        assert response.status == 413, response.status
        answer = json.loads(response.read())
    finally:
        conn.close()
    assert answer["code"] == "too_large"
    assert f"the tree's tar would be over {agent.MAX_TRANSFER_BYTES} bytes" in answer["error"]
