"""`reploy serve` end to end on the real engine: the REST API, SSE, the sandbox of session
containers, the error mapping, and the `reploy session` CLI on the same API."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from serve_harness import (  # noqa: F401  (fixtures)
    ROOT, ServeProcess, in_thread, managed_workload, serve_factory, session_containers,
    sse_events, wait_until,
)

pytestmark = pytest.mark.docker
SECRET = "tok-3b1f9c2e77d04a55"


def cli(server: ServeProcess, *args: str, stdin: bytes = b"") -> tuple[int, Any]:
    proc = subprocess.run([sys.executable, str(ROOT / "reploy.py"), "session", *args,
                           "--server", server.ready["url"]],
                          input=stdin, capture_output=True, timeout=120, env=server.client_env())
    return proc.returncode, json.loads(proc.stdout)


def test_shell_session_through_the_cli(serve_factory: Callable[..., ServeProcess],
                                       docker_engine: Any) -> None:
    server = serve_factory()
    code, session = cli(server, "create", "--name", "pipeline", "--workload", "shell")
    assert code == 0 and session["state"] == "active" and session["workload"] == "shell"
    sid = session["id"]
    server.api.wait_output(sid, b"$ ")
    assert cli(server, "message", sid, "echo from-$((6*7))")[1]["delivery"] == "dispatched"
    server.api.wait_output(sid, b"from-42")
    assert cli(server, "write", sid, "-", stdin=b"id -u\r")[1] == {"bytes": 6}
    out = server.api.wait_output(sid, b"\r\n1000\r\n")
    # At most what was seen: the shell's next prompt may have grown the log since.
    code, page = cli(server, "read", sid, "--offset", "0", "--max-bytes", str(len(out)))
    assert code == 0 and base64.b64decode(page["payloadBase64"]) == out[:page["nextOffset"]]
    status = cli(server, "status", sid)[1]
    assert status["agent"]["workload"] == "shell" and status["agent"]["running"] is True
    assert [s["id"] for s in cli(server, "list")[1]["sessions"]] == [sid]
    assert cli(server, "get", sid)[1]["name"] == "pipeline"
    code, missing = cli(server, "get", "0" * 16)
    assert code == 1 and missing["status"] == 404 and missing["error"]
    assert cli(server, "delete", sid) == (0, {"id": sid, "deleted": True})
    assert not session_containers(docker_engine, server.state_dir)
    assert not (server.state_dir / "sessions" / sid).exists()


def test_the_session_container_is_sandboxed(serve_factory: Callable[..., ServeProcess],
                                            docker_engine: Any) -> None:
    server = serve_factory()
    sid = server.api.create("sandbox")["id"]
    [container] = session_containers(docker_engine, server.state_dir, sid)
    host = container.attrs["HostConfig"]
    assert host["ReadonlyRootfs"] is True and host["CapDrop"] == ["ALL"]
    # The agent is root in the container, keeping only what it needs to start the workload as
    # the runtime user and to signal it; the workload is that user (the blueprint's 1000:1000).
    assert sorted(host["CapAdd"]) == ["KILL", "SETGID", "SETUID"]
    assert "no-new-privileges:true" in host["SecurityOpt"] and host["Privileged"] is False
    assert host["NetworkMode"] == "none" and host["PidsLimit"] == 128
    assert host["Memory"] == 256 * 1024 * 1024 and "uid=1000,gid=1000" in host["Tmpfs"]["/mnt/reploy-home"]
    assert container.attrs["Config"]["User"] == "0:0"
    assert container.attrs["Config"]["Cmd"][-2:] == ["--runtime-user", "1000:1000"]
    labels = container.labels
    assert labels["io.reploy.session.live-run"] == sid
    assert labels["io.reploy.session.role"] == "managed"
    binds = {b.split(":")[1]: b for b in host["Binds"]}
    assert binds["/opt/reploy/agent.py"].endswith(":ro")
    assert binds["/mnt/reploy-session"].startswith(str(server.state_dir / "sessions" / sid))
    assert not any("docker.sock" in b for b in host["Binds"])
    server.api.wait_output(sid, b"$ ")
    server.api.call("POST", f"/sessions/{sid}/message",
                    {"text": "touch /x 2>/dev/null || echo rootfs-read-only; echo home=$HOME"})
    server.api.wait_output(sid, b"home=/mnt/reploy-home")
    assert b"rootfs-read-only" in server.api.read_all(sid)
    # The agent's control socket is the only way in: no published port, mode 0600.
    assert not container.attrs["NetworkSettings"]["Ports"]
    sock = server.state_dir / "sessions" / sid / "agent" / "control.sock"
    assert oct(os.stat(sock).st_mode & 0o777) == "0o600"
    assert oct(os.stat(sock.parent).st_mode & 0o777) == "0o700" and os.stat(sock.parent).st_uid == 0


def test_snapshot_and_restore_keep_output_and_cursors(serve_factory: Callable[..., ServeProcess],
                                                      docker_engine: Any) -> None:
    server = serve_factory()
    api = server.api
    sid, before = api.shell_ran("snap", "echo kept > kept.txt; echo before", b"before\r\n$ ")
    snapped = api.call("POST", f"/sessions/{sid}/snapshot", {})
    assert snapped["state"] == "snapshot" and snapped["snapshotBytes"] > 0
    assert not session_containers(docker_engine, server.state_dir, sid)
    archives = list((server.state_dir / "sessions" / sid / "agent").glob("checkpoint-*.tar"))
    assert len(archives) == 1
    assert api.call("POST", f"/sessions/{sid}/snapshot", {})["state"] == "snapshot"  # idempotent
    # The stream is passive: it shows the kept log and never restores.
    events = sse_events(api, sid, offset=0, until=lambda ev: any("event" in e for e in ev))
    assert events[-1]["event"] == "output"
    assert api.get(sid)["state"] == "snapshot"
    # A read restores into a new container; the old bytes keep their offsets.
    page = api.call("POST", f"/sessions/{sid}/read", {"offset": 0, "maxBytes": len(before)})
    assert base64.b64decode(page["payloadBase64"]) == before
    assert api.get(sid)["state"] == "active"
    assert len(session_containers(docker_engine, server.state_dir, sid)) == 1
    assert not list((server.state_dir / "sessions" / sid / "agent").glob("checkpoint-*.tar"))
    api.call("POST", f"/sessions/{sid}/message", {"text": "cat kept.txt"})
    after = api.wait_output(sid, b"kept\r\n")
    assert after.startswith(before) and b"restored from checkpoint" in after


def test_agent_session_streams_and_redacts(serve_factory: Callable[..., ServeProcess],
                                           docker_engine: Any) -> None:
    server = serve_factory("--agent-env", "FAKE_SECRET", "--default-model", "m-default",
                           "--models", '["m-default", "m-other"]', "--sse-keepalive", "200ms",
                           env={"FAKE_SECRET": SECRET})
    api = server.api
    config = api.call("GET", "/config")
    assert config["agent"] == {"defaultModel": "m-default", "models": ["m-default", "m-other"]}
    assert config["claudeCode"] == config["agent"]  # seed 002's key, beside ours
    session = api.create("agent", "agent", model="m-other")
    sid = session["id"]
    assert session["model"] == "m-other"
    result = api.call("POST", f"/sessions/{sid}/message", {"text": "args"})
    assert result["delivery"] == "dispatched"
    events = sse_events(api, sid, until=lambda ev: b"m-other" in b"".join(
        base64.b64decode(e["data"]["payloadBase64"]) for e in ev if e.get("event") == "output"))
    outputs = [e for e in events if e.get("event") == "output"]
    assert all(int(e["id"]) == e["data"]["nextOffset"] for e in outputs)
    api.call("POST", f"/sessions/{sid}/message", {"text": "secret"})
    text = api.wait_output(sid, b"err:[REDACTED]").decode()
    assert "token=[REDACTED] end" in text and SECRET not in text
    # Credentials appear in no response, log or the UI's config.
    for path in ("/config", "/sessions", f"/sessions/{sid}", f"/sessions/{sid}/status"):
        assert SECRET not in json.dumps(api.call("GET", path))
    assert SECRET not in server.stderr
    assert SECRET not in str(server.args)
    # Keepalive comments arrive while nothing is printed.
    length = api.get(sid) and len(api.read_all(sid))
    quiet = sse_events(api, sid, offset=length, until=lambda ev: any("comment" in e for e in ev))
    assert {"comment": "keepalive"} in quiet
    # Seed 002's prompt through write: the decoded UTF-8 bytes are one prompt, answered as message.
    prompt = "say via write é".encode()
    written = api.call("POST", f"/sessions/{sid}/write", {"dataBase64": base64.b64encode(prompt).decode()})
    assert written == {"delivery": "dispatched", "queueDepth": 0}
    api.wait_output(sid, "via write é\n".encode())
    status, raw = api.raw("POST", f"/api/v1/sessions/{sid}/write", b'{"dataBase64": "/w=="}')
    assert status == 422 and "UTF-8" in json.loads(raw)["error"]
    # Seed 002's 1 MiB prompt, through write and through message: it reaches the agent command whole
    # (in parts to the agent, then on the command's stdin, one argument being too small for it).
    for route in ("write", "message"):
        prompt = f"measure {route} ".ljust(1024 * 1024, "x")
        body = {"dataBase64": base64.b64encode(prompt.encode()).decode()} if route == "write" else {"text": prompt}
        assert api.call("POST", f"/sessions/{sid}/{route}", body)["delivery"] in ("dispatched", "queued")
        digest = hashlib.sha256(prompt.encode()).hexdigest()
        api.wait_output(sid, f'{{"via": "stdin", "bytes": {1024 * 1024}, "sha256": "{digest}"}}\n'.encode())
    # The CLI reads a prompt that one argument cannot hold from stdin (`-`), one trailing newline dropped.
    prompt = "measure cli ".ljust(200 * 1024, "y")
    code, sent = cli(server, "message", sid, "-", stdin=(prompt + "\n").encode())
    assert code == 0 and sent["delivery"] in ("dispatched", "queued")
    digest = hashlib.sha256(prompt.encode()).hexdigest()
    api.wait_output(sid, f'{{"via": "stdin", "bytes": {200 * 1024}, "sha256": "{digest}"}}\n'.encode())
    not_utf8 = subprocess.run([sys.executable, str(ROOT / "reploy.py"), "session", "message", sid, "-", "--server",
                               server.ready["url"]], input=b"say \xff", capture_output=True, timeout=120,
                              env=server.client_env())
    assert (not_utf8.returncode, not_utf8.stdout) == (2, b"") and b"not UTF-8" in not_utf8.stderr
    huge = base64.b64encode(b"x" * (1024 * 1024 + 1)).decode()
    assert api.raw("POST", f"/api/v1/sessions/{sid}/write", json.dumps({"dataBase64": huge}).encode())[0] == 413
    too_long = json.dumps({"text": "x" * (1024 * 1024 + 1)}).encode()
    assert api.raw("POST", f"/api/v1/sessions/{sid}/message", too_long)[0] == 413
    # Resizes are for shells.
    assert api.raw("POST", f"/api/v1/sessions/{sid}/resize", b'{"columns": 9, "rows": 9}')[0] == 422


def test_many_stream_clients_and_resume(serve_factory: Callable[..., ServeProcess],
                                        docker_engine: Any) -> None:
    server = serve_factory()
    api = server.api
    sid, full = api.shell_ran("fanout", "seq 1 3000 | tr -d '\\n'; echo END", b"END\r\n$ ")

    def collected(events: list[dict[str, Any]]) -> bytes:
        return b"".join(base64.b64decode(e["data"]["payloadBase64"])
                        for e in events if e.get("event") == "output")

    threads = [in_thread(lambda: collected(sse_events(
        api, sid, offset=0, until=lambda ev: len(collected(ev)) >= len(full)))) for _ in range(8)]
    for thread, _ in threads:
        thread.join(timeout=60)
    for _, box in threads:
        assert box[0][:len(full)] == full
    # Chunks are bounded; Last-Event-ID wins over ?offset=.
    events = sse_events(api, sid, offset=5, last_event_id="3",
                        until=lambda ev: any(e.get("event") for e in ev))
    first = next(e for e in events if e.get("event"))
    assert first["data"]["offset"] == 3
    assert first["data"]["nextOffset"] - first["data"]["offset"] <= 64 * 1024
    # A cursor ahead of the log: reset with the length, then the stream ends.
    length = len(api.read_all(sid))  # the shell is quiet by now: its prompt came after END
    events = sse_events(api, sid, offset=length + 1000)
    reset = [e for e in events if e.get("event")]
    assert reset == [{"id": str(length), "event": "reset", "data": {"nextOffset": length}}]


def test_a_stream_of_a_deleted_session_ends_without_a_reset(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    """Deleting a session ends its open streams; the log going before its directory must not
    read as a shrunken log (a `reset` would send viewers back to offset 0 of nothing)."""
    server = serve_factory()
    api = server.api
    sid, _ = api.shell_ran("gone", "echo here", b"here\r\n$ ")
    length = len(api.read_all(sid))
    thread, box = in_thread(lambda: sse_events(api, sid, offset=length))
    wait_until(lambda: "viewer" in api.get(sid)["idleBlockedBy"], "the stream to be open")
    api.call("DELETE", f"/sessions/{sid}")
    thread.join(timeout=60)
    assert not thread.is_alive(), "the stream of a deleted session did not end"
    assert [e for e in box[0] if e.get("event")] == []


def test_error_mapping(serve_factory: Callable[..., ServeProcess], docker_engine: Any,
                       tmp_path: Path) -> None:
    server = serve_factory()
    api = server.api
    sid = api.create("errors")["id"]
    base = f"/api/v1/sessions/{sid}"
    cases = [
        ("POST", "/api/v1/sessions", b'{"name": "x", "workload": "shell"} trailing', 400),
        ("POST", "/api/v1/sessions", b'{"name": "x", "workload": "shell", "nope": 1}', 400),
        ("POST", "/api/v1/sessions", b'{"name": "x", "workload": 7}', 400),
        ("POST", "/api/v1/sessions", b'{"name": "x", "workload": "vm"}', 422),
        ("POST", "/api/v1/sessions", b'{"name": "x", "workload": "shell", "deployment": "zzz"}', 422),
        ("POST", "/api/v1/sessions", b'{"name": "x", "workload": "shell", "model": "m"}', 422),
        ("POST", "/api/v1/sessions", b'{"name": "x", "workload": "agent", "model": "platform-default"}', 422),
        ("POST", "/api/v1/sessions", b'{"name": "x\\n", "workload": "shell"}', 422),
        ("POST", base + "/read", b'{"maxBytes": 1}', 422),
        ("POST", base + "/resize", b'{"columns": 0, "rows": 5}', 422),
        ("POST", base + "/message", b'{"text": "two\\nlines"}', 422),
        ("GET", "/api/v1/sessions/0123456789abcdef", None, 404),
        ("GET", "/api/v1/sessions/not-an-id/status", None, 404),
        ("PUT", "/api/v1/sessions", None, 405),
    ]
    for method, path, body, status in cases:
        got, raw = api.raw(method, path, body)
        assert got == status, (method, path, body, raw)
        assert set(json.loads(raw)) == {"error"}
    big = json.dumps({"dataBase64": base64.b64encode(b"x" * (1024 * 1024 + 1)).decode()}).encode()
    assert api.raw("POST", base + "/write", big)[0] == 413
    # An oversized body is refused from its Content-Length, before it is sent.
    import http.client

    conn = http.client.HTTPConnection(api.host, api.port, timeout=30)
    conn.putrequest("POST", base + "/write")
    for name, value in {**api.auth_headers, "Content-Type": "application/json"}.items():
        conn.putheader(name, value)
    conn.putheader("Content-Length", str(8 * 1024 * 1024 + 1))
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413 and "error" in json.loads(response.read())
    conn.close()
    # 503: a deployment whose image has no python3 cannot host the agent, and says so.
    from conftest import stage_and_build

    busybox = tmp_path / "busybox"
    stage_and_build(ROOT / "examples/workload/workload.blueprint.yaml", busybox)
    other = serve_factory("--workload-dir", str(busybox))
    status, raw = other.api.raw("POST", "/api/v1/sessions", json.dumps(
        {"name": "nopy", "workload": "shell", "deployment": "demo-workload"}).encode())
    assert status == 503 and "python3" in json.loads(raw)["error"]
    assert other.api.call("GET", "/sessions")["sessions"] == []
    # 507: too little free space for a new session.
    full = serve_factory("--min-free-mib", str(1 << 40))
    assert full.api.raw("POST", "/api/v1/sessions", b'{"name": "x", "workload": "shell"}')[0] == 507


def test_busy_agent_queue_interrupt_and_snapshot_conflict(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    server = serve_factory()
    api = server.api
    sid = api.create("busy", "agent")["id"]
    assert api.call("POST", f"/sessions/{sid}/message", {"text": "hang"})["delivery"] == "dispatched"
    api.wait_output(sid, b"working")
    for _ in range(64):
        assert api.call("POST", f"/sessions/{sid}/message", {"text": "say later"})["delivery"] == "queued"
    status, raw = api.raw("POST", f"/api/v1/sessions/{sid}/message", b'{"text": "one too many"}')
    assert status == 429, raw
    agent = api.call("GET", f"/sessions/{sid}/status")["agent"]
    assert agent["turnState"] == "in_progress" and agent["queueDepth"] == 64
    # The run cannot drain within the agent's bound: 409, and the session stays usable.
    status, raw = api.raw("POST", f"/api/v1/sessions/{sid}/snapshot", b"{}")
    assert status == 409 and "busy" in json.loads(raw)["error"]
    assert api.get(sid)["state"] == "active"
    assert api.call("POST", f"/sessions/{sid}/interrupt", {})["cancelled"] is True
    api.wait_output(sid, b"[reploy: interrupted]")
