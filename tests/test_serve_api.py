"""`reploy serve` end to end on the real engine: the REST API, SSE, the sandbox of session
containers, the error mapping, and the `reploy session` CLI on the same API."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from serve_harness import (  # noqa: F401  (fixtures)
    ROOT, ServeProcess, cli_error, in_thread, managed_workload, serve_factory, session_containers,
    sse_events, wait_until,
)

pytestmark = pytest.mark.docker
SECRET = "tok-3b1f9c2e77d04a55"


def cli(server: ServeProcess, *args: str, stdin: bytes = b"") -> tuple[int, Any]:
    proc = subprocess.run([sys.executable, str(ROOT / "reploy.py"), "session", *args,
                           "--server", server.ready["url"]],
                          input=stdin, capture_output=True, timeout=120, env=server.client_env())
    if proc.returncode == 1:
        return 1, cli_error(proc)
    return proc.returncode, json.loads(proc.stdout)


def test_shell_session_through_the_cli(serve_factory: Callable[..., ServeProcess],
                                       docker_engine: Any) -> None:
    server = serve_factory()
    code, session = cli(server, "create", "--name", "pipeline")
    assert code == 0 and session["state"] == "active" and session["workloadType"] == "shell"
    sid = session["id"]
    server.api.wait_output(sid, b"$ ")
    assert cli(server, "message", sid, "echo from-$((6*7))")[1]["delivery"] == "dispatched"
    server.api.wait_output(sid, b"from-42")
    code, written = cli(server, "write", sid, "-", stdin=b"id -u\r")
    assert code == 0 and written["path"] == "active" and written["session"]["id"] == sid
    out = server.api.wait_output(sid, b"\r\n1000\r\n")
    # Everything from the offset: at least what was seen (the next prompt may have come since).
    code, page = cli(server, "read", sid, "--offset", "0")
    assert code == 0 and base64.b64decode(page["payloadBase64"]).startswith(out)
    assert page["payload"].encode() == base64.b64decode(page["payloadBase64"]) and page["path"] == "active"
    code, tail = cli(server, "read", sid, "--offset", str(page["nextOffset"] - 2))
    assert code == 0 and tail["payload"] == page["payload"][-2:]
    status = cli(server, "status", sid)[1]
    assert status["agent"]["workload"] == "shell" and status["agent"]["running"] is True
    assert [s["id"] for s in cli(server, "list")[1]["sessions"]] == [sid]
    assert cli(server, "get", sid)[1]["name"] == "pipeline"
    code, missing = cli(server, "get", "0" * 16)
    assert code == 1 and missing["status"] == 404 and missing["error"]
    assert cli(server, "delete", sid) == (0, {"id": sid, "deleted": True})  # the CLI's note of the 204
    assert cli(server, "get", sid)[1]["status"] == 404
    assert not session_containers(docker_engine, server.state_dir)
    assert not (server.state_dir / "sessions" / sid).exists()


def test_the_cli_creates_with_labels_a_time_to_live_and_resources(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    """The create body's own fields as `session create` flags, and `session list --label`."""
    server = serve_factory("--egress-allow", "api.example.org", "--egress-allow", "198.51.100.7:8080")
    code, session = cli(server, "create", "--name", "tagged", "--label", "task=t.1", "--label", "run=7",
                        "--ttl", "1h", "--cpus", "0.5", "--disk-mib", "64",
                        "--egress", "198.51.100.7:8080")
    assert code == 0, session
    assert session["egress"] == ["198.51.100.7:8080"]
    assert session["labels"] == {"task": "t.1", "run": "7"}
    assert session["cpus"] == 0.5 and session["diskMib"] == 64 and "expiresAt" in session
    [container] = session_containers(docker_engine, server.state_dir, session["id"])
    assert container.attrs["HostConfig"]["NanoCpus"] == 500_000_000
    other = cli(server, "create", "--name", "plain")[1]["id"]
    assert [s["id"] for s in cli(server, "list", "--label", "task=t.1")[1]["sessions"]] == [session["id"]]
    assert cli(server, "list", "--label", "task=t.1", "--label", "run=8")[1]["sessions"] == []
    assert {s["id"] for s in cli(server, "list")[1]["sessions"]} == {session["id"], other}
    code, refused = cli(server, "create", "--name", "x", "--cpus", "1000")
    assert code == 1 and refused["status"] in (400, 422) and "cpus" in refused["error"]
    code, refused = cli(server, "create", "--name", "x", "--egress", "other.example.org")
    assert code == 1 and refused["status"] == 400 and "egress" in refused["error"]


def test_the_session_container_is_sandboxed(serve_factory: Callable[..., ServeProcess],
                                            docker_engine: Any) -> None:
    server = serve_factory()
    sid = server.api.create("sandbox")["id"]
    [container] = session_containers(docker_engine, server.state_dir, sid)
    host = container.attrs["HostConfig"]
    assert host["ReadonlyRootfs"] is True and host["CapDrop"] == ["ALL"]
    # The agent is root in the container, keeping only what it needs to start the workload as
    # the runtime user and to signal it; the workload is that user (the blueprint's 1000:1000).
    assert sorted(host["CapAdd"]) == ["KILL", "SETGID", "SETPCAP", "SETUID"]
    assert "no-new-privileges:true" in host["SecurityOpt"] and host["Privileged"] is False
    assert host["NetworkMode"] == "none" and host["PidsLimit"] == 128
    assert host["Memory"] == 256 * 1024 * 1024 and "uid=1000,gid=1000" in host["Tmpfs"]["/mnt/reploy-home"]
    assert container.attrs["Config"]["User"] == "0:0"
    assert container.attrs["Config"]["Entrypoint"][-2:] == ["--runtime-user", "1000:1000"]
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


def test_the_agent_runs_from_bytecode_serve_compiled_and_mounted_read_only(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    """The session's interpreter accepts serve's bytecode of agent.py (hash-checked against
    the mounted source) where the agent's own import looks for it; the workload cannot change it."""
    server = serve_factory()
    sid = server.api.create("bytecode")["id"]
    [container] = session_containers(docker_engine, server.state_dir, sid)
    binds = {b.split(":")[1]: b for b in container.attrs["HostConfig"]["Binds"]}
    assert binds["/opt/reploy/__pycache__"] == f"{server.state_dir / 'bytecode'}:/opt/reploy/__pycache__:ro"
    assert container.attrs["Config"]["Entrypoint"][:3] == ["python3", "-I", "-S"]
    name = Path(importlib.util.cache_from_source(str(ROOT / "agent.py"))).name
    server.api.wait_output(sid, b"$ ")
    server.api.call("POST", f"/sessions/{sid}/message", {"text": (
        "python3 -I -S -c 'import sys; print(sys.implementation.cache_tag)'; "
        "python3 -I -S -v -c \"import sys; sys.path.insert(0, '/opt/reploy'); import agent\" 2>&1 "
        "| grep -o \"code object from '/opt/reploy/__pycache__/[^']*'\"; "
        f"(: >> /opt/reploy/__pycache__/{name}) || echo bytecode-unwritable; echo finished-$((6 * 7))")})
    server.api.wait_output(sid, b"finished-42")
    output = server.api.read_all(sid)
    if f"\n{sys.implementation.cache_tag}\r\n".encode() not in output:
        pytest.skip("the image's python3 is another version than serve's: it compiles agent.py itself")
    assert f"code object from '/opt/reploy/__pycache__/{name}'".encode() in output
    assert b"bytecode-unwritable" in output  # root's, and the mount read-only (above)
    # The file workers' zygote (started by the first file operation) runs that bytecode too.
    assert server.api.raw("GET", f"/api/v1/sessions/{sid}/files/missing")[0] == 404
    [zygote] = [pid for pid, command in docker_engine.api.top(container.id, ps_args="-o pid,args")["Processes"]
                if command.endswith(" zygote")]
    script = Path(f"/proc/{zygote}/cmdline").read_bytes().split(b"\0")[-3].decode()
    assert script.startswith("/proc/self/fd/")
    with open(f"/proc/{zygote}/fd/{script.removeprefix('/proc/self/fd/')}", "rb") as code:
        assert code.read(4) == importlib.util.MAGIC_NUMBER


def test_snapshot_and_restore_keep_output_and_cursors(serve_factory: Callable[..., ServeProcess],
                                                      docker_engine: Any) -> None:
    server = serve_factory()
    api = server.api
    sid, before = api.shell_ran("snap", "echo kept > kept.txt; echo before", b"before\r\n$ ")
    snapped = api.call("POST", f"/sessions/{sid}/snapshot", {})
    assert snapped["state"] == "snapshot" and "pod" not in snapped
    assert not session_containers(docker_engine, server.state_dir, sid)
    archives = list((server.state_dir / "sessions" / sid / "agent").glob("checkpoint-*.tar"))
    assert len(archives) == 1
    assert snapped["checkpoint"]["sizeBytes"] == archives[0].stat().st_size
    assert snapped["checkpoint"]["ref"] == archives[0].name
    assert api.call("POST", f"/sessions/{sid}/snapshot", {}) == snapped  # idempotent
    # The stream has no container to follow (422) and never restores.
    assert api.raw("GET", f"/api/v1/sessions/{sid}/stream")[0] == 422
    assert api.get(sid)["state"] == "snapshot"
    # A read restores into a new container; the old bytes keep their offsets.
    page = api.call("POST", f"/sessions/{sid}/read", {"offset": 0})
    assert base64.b64decode(page["payloadBase64"]).startswith(before)
    assert page["path"] == "snapshot->restore->read" and page["session"]["state"] == "active"
    assert api.get(sid)["state"] == "active" and "checkpoint" not in api.get(sid)
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
    assert config == {"claudeCode": {"defaultModel": "m-default", "models": ["m-default", "m-other"]}}
    session = api.create("agent", "claude-code", model="m-other")
    sid = session["id"]
    assert session["model"] == "m-other" and session["workloadType"] == "claude-code"
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
    quiet = sse_events(api, sid, offset=length, until=lambda ev: {"comment": "keepalive"} in ev)
    assert quiet[0] == {"comment": "connected"} and quiet[1:] == [{"comment": "keepalive"}]
    # Seed 002's prompt through write: the payload is one prompt.
    written = api.call("POST", f"/sessions/{sid}/write", {"payload": "say via write é"})
    assert written["path"] == "active" and written["session"]["id"] == sid and set(written) == {"session", "path"}
    api.wait_output(sid, "via write é\n".encode())
    # claude-code cursors fall between code points; an offset inside one is the client's error.
    history = api.call("POST", f"/sessions/{sid}/read", {"offset": 0})["payload"]
    inside = len(history[:history.index("é")].encode()) + 1
    status, raw = api.raw("POST", f"/api/v1/sessions/{sid}/read", json.dumps({"offset": inside}).encode())
    assert status == 400 and "UTF-8 boundary" in json.loads(raw)["error"]
    status, raw = api.raw("POST", f"/api/v1/sessions/{sid}/write", b'{"payload": "say \\u0000"}')
    assert status == 400 and "NUL" in json.loads(raw)["error"]
    # Seed 002's 1 MiB prompt, through write and through message: it reaches the agent command whole
    # (in parts to the agent, then on the command's stdin, one argument being too small for it).
    for route in ("write", "message"):
        prompt = f"measure {route} ".ljust(1024 * 1024, "x")
        body = {"payload": prompt} if route == "write" else {"text": prompt}
        assert api.call("POST", f"/sessions/{sid}/{route}", body)
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
    huge = json.dumps({"payload": "x" * (1024 * 1024 + 1)}).encode()
    assert api.raw("POST", f"/api/v1/sessions/{sid}/write", huge)[0] == 413
    too_long = json.dumps({"text": "x" * (1024 * 1024 + 1)}).encode()
    assert api.raw("POST", f"/api/v1/sessions/{sid}/message", too_long)[0] == 413
    # Resizes are for shells.
    assert api.raw("POST", f"/api/v1/sessions/{sid}/resize", b'{"columns": 9, "rows": 9}')[0] == 422


def test_many_stream_clients_and_resume(serve_factory: Callable[..., ServeProcess],
                                        docker_engine: Any) -> None:
    # 8 streams, then more at once: serve may not yet have seen the first 8 leave (it looks
    # between long-polls), so the default bound of 8 readers of one session is raised.
    server = serve_factory("--max-session-readers", "16")
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
    # A cursor ahead of the log: reset with the length; the stream stays open and goes on from there.
    length = len(api.read_all(sid))  # the shell is quiet by now: its prompt came after END
    thread, box = in_thread(lambda: sse_events(api, sid, offset=length + 1000, until=lambda ev: any(
        e.get("event") == "output" for e in ev)))
    wait_until(lambda: "viewer" in api.get(sid)["idleBlockedBy"], "the stream to be open")
    api.call("POST", f"/sessions/{sid}/message", {"text": "echo after-reset"})
    thread.join(timeout=60)
    [reset, output] = [e for e in box[0] if e.get("event")]
    assert reset == {"id": str(length), "event": "reset", "data": {"nextOffset": length}}
    assert output["data"]["offset"] == length


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
    api.call("DELETE", f"/sessions/{sid}", expect=204)
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
        ("POST", "/api/v1/sessions", b'{"name": "x"} trailing', 400),
        ("POST", "/api/v1/sessions", b'{"name": "x", "nope": 1}', 400),
        ("POST", "/api/v1/sessions", b'{"name": "x", "workloadType": 7}', 400),
        ("POST", "/api/v1/sessions", b'{"name": "x", "workloadType": "vm"}', 400),
        ("POST", "/api/v1/sessions", b'{"name": "x", "deployment": "zzz"}', 400),
        ("POST", "/api/v1/sessions", b'{"name": "x", "model": "m"}', 400),
        ("POST", "/api/v1/sessions", b'{"name": " \\n "}', 400),
        ("POST", base + "/read", b'{"maxBytes": 1}', 400),
        ("POST", base + "/resize", b'{"columns": 0, "rows": 5}', 400),
        ("POST", base + "/message", b'{"text": "two\\nlines"}', 422),  # the agent refuses it
        ("GET", "/api/v1/sessions/0123456789abcdef", None, 404),
        ("GET", "/api/v1/sessions/not-an-id/status", None, 404),
        ("PUT", "/api/v1/sessions", None, 405),
    ]
    for method, path, body, status in cases:
        got, raw = api.raw(method, path, body)
        assert got == status, (method, path, body, raw)
        assert set(json.loads(raw)) == {"error", "code"}
    # A shell write has no bound but the body's: 2 MiB is typed whole (in parts), here into cat.
    api.wait_output(sid, b"$ ")
    api.call("POST", f"/sessions/{sid}/message", {"text": "stty -echo; wc -c; stty echo"})
    api.call("POST", f"/sessions/{sid}/write", {"payload": ("y" * 1023 + "\n") * 2048 + "\x04"})
    api.wait_output(sid, b"\r\n2097152\r\n")
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
        {"name": "nopy", "deployment": "demo-workload"}).encode())
    assert status == 500 and "python3" in json.loads(raw)["error"]  # seed 002: any other failure is 500
    assert other.api.call("GET", "/sessions")["sessions"] == []
    # Its image removed since it was built (the deployment names one the Engine lacks): the
    # container's create says so, and the session, its disk and record are undone.
    state_path = busybox / ".reploy" / "state.json"
    state = json.loads(state_path.read_text())
    state["current_generation"]["image_id"] = "sha256:" + "0" * 64
    state_path.write_text(json.dumps(state))
    status, raw = other.api.raw("POST", "/api/v1/sessions", json.dumps(
        {"name": "gone", "deployment": "demo-workload"}).encode())
    assert status == 500 and "the image of demo-workload is gone" in json.loads(raw)["error"]
    assert other.api.call("GET", "/sessions")["sessions"] == []
    # Too little free space for a new session: 507 (one of create's two limits), saying so.
    full = serve_factory("--min-free-mib", str(1 << 40))
    status, raw = full.api.raw("POST", "/api/v1/sessions", b'{"name": "x"}')
    assert status == 507 and "MiB free" in json.loads(raw)["error"]


def test_busy_agent_queue_interrupt_and_snapshot_conflict(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    server = serve_factory()
    api = server.api
    sid = api.create("busy", "claude-code")["id"]
    assert api.call("POST", f"/sessions/{sid}/message", {"text": "hang"})["delivery"] == "dispatched"
    api.wait_output(sid, b"working")
    for _ in range(64):
        assert api.call("POST", f"/sessions/{sid}/message", {"text": "say later"})["delivery"] == "queued"
    status, raw = api.raw("POST", f"/api/v1/sessions/{sid}/message", b'{"text": "one too many"}')
    assert status == 429, raw
    agent = api.call("GET", f"/sessions/{sid}/status")["agent"]
    assert agent["turnState"] == "in_progress" and agent["queueDepth"] == 64
    # The run cannot drain within the agent's bound: 409. The session is paused with its work
    # (issue 26: a failed snapshot never leaves it active), held busy, saying why; an access
    # resumes it.
    status, raw = api.raw("POST", f"/api/v1/sessions/{sid}/snapshot", b"{}")
    assert status == 409 and "busy" in json.loads(raw)["error"]
    session = api.get(sid)
    assert (session["state"], session["idleBlockedBy"]) == ("idle", ["busy"])
    assert "did not drain" in session["lastFailure"]["reason"]
    assert api.call("POST", f"/sessions/{sid}/interrupt", {})["cancelled"] is True
    api.wait_output(sid, b"[reploy: interrupted]")


def argv_of_next_run(server: ServeProcess, sid: str) -> list[str]:
    """The argv of the agent command's next run (the fake CLI's `args` says it)."""
    api = server.api
    runs = api.read_all(sid).count(b'"args"]')
    api.call("POST", f"/sessions/{sid}/message", {"text": "args"})
    out = wait_until(lambda: (lambda o: o if o.count(b'"args"]') > runs else None)(api.read_all(sid)),
                     "the run's argv")
    return json.loads([line for line in out.split(b"\n") if line.endswith(b'"args"]')][-1])


def test_platform_default_is_resolved_at_every_container_start(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    """Seed 002: a claude-code session made without a model keeps the platform-default alias,
    and each start of its container resolves it to the default of the serve starting it; a
    model given at create always wins."""
    first = serve_factory("--default-model", "m-first")
    alias = first.api.create("alias", "claude-code")
    pinned = first.api.create("pinned", "claude-code", model="m-pinned")
    assert (alias["model"], pinned["model"]) == ("platform-default", "m-pinned")
    assert "m-first" in argv_of_next_run(first, alias["id"])
    assert "m-pinned" in argv_of_next_run(first, pinned["id"])
    for model, extra in (("m-second", ("--default-model", "m-second")), (None, ())):
        for sid in (alias["id"], pinned["id"]):
            first.api.call("POST", f"/sessions/{sid}/snapshot", {})
        first.stop()
        first = serve_factory(*extra, state_dir=first.state_dir)
        argv = argv_of_next_run(first, alias["id"])  # an access: the container starts again
        assert (model in argv) if model else ("--model" not in argv), argv
        assert "m-pinned" in argv_of_next_run(first, pinned["id"])
        assert first.api.get(alias["id"])["model"] == "platform-default"
