"""The trust boundary of a managed session (issue 21), from inside real sessions of a real
`reploy serve`: the workload (its shell, its execs) against its own agent, its disk and the host.

agent.py runs as root in the container keeping SETUID, SETGID, SETPCAP and KILL; the workload runs as
the blueprint's user (1000:1000). The agent's socket, log, outbox, state and checkpoints lie in
/mnt/reploy-session/agent (root's, 0700) on the session's own disk (an ext4 image, mounted
nosuid,nodev). Each test tries what the issue saw work and checks what the kernel answered:
the probe (tests/agent_fixtures/escape_probe.py) through the shell and through exec, the
impostor agent (tests/agent_fixtures/impostor.py), a disk filled with dd, a hard link to the
agent's outbox, a setuid file. The same scripts against the code before the change succeed at
every move (see the report of issue 21).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import sqlite3
import stat
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, Callable

import pytest

from conftest import session_disk_mounts, stage_and_build
from serve_harness import (  # noqa: F401  (fixtures)
    ROOT, Api, ServeProcess, managed_workload, serve_factory, session_containers, wait_until,
)

pytestmark = pytest.mark.docker

SESSION_MOUNT = "/mnt/reploy-session"
RUNTIME_UID = 1000  #: examples/managed's runtime user
#: What the kernel answers the workload for each move of the probe.
REFUSED = {
    "connect_socket": "EACCES", "rename_socket": "EACCES", "bind_beside_socket": "EACCES",
    "rename_agent_dir": "EACCES", "make_dir_beside": "EACCES", "bind_in_session_dir": "EACCES",
    "append_log": "EACCES", "truncate_log": "EACCES", "append_outbox": "EACCES",
    "truncate_outbox": "EACCES", "link_outbox": "EACCES", "link_log": "EACCES",
    "list_private": "EACCES", "read_state": "EACCES", "read_log": "EACCES",
    "read_memory": "EACCES", "read_environ": "EACCES", "list_fds": "EACCES",
    "ptrace_attach": "EPERM", "signal_probe": "EPERM", "signal_stop": "EPERM", "signal_term": "EPERM",
    "uid": RUNTIME_UID, "agent_uid": 0,
}


def run(api: Api, sid: str, script: str, *args: str) -> dict[str, Any]:
    """`sh -c script` in the session's container, as its runtime user."""
    return api.call("POST", f"/sessions/{sid}/exec", {"argv": ["sh", "-c", script, "sh", *args]})


def probe_result(text: str) -> dict[str, Any]:
    [line] = [line for line in text.splitlines() if line.startswith("PROBE-RESULT ")]
    return json.loads(line[len("PROBE-RESULT "):])


def test_the_workload_cannot_reach_its_agent_through_exec_or_the_shell(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    server = serve_factory()
    api = server.api
    sid = api.create("prober")["id"]
    prompt = api.wait_output(sid, b"$ ")
    outbox = server.state_dir / "sessions" / sid / "agent" / "events.jsonl"
    events_before = outbox.read_bytes()

    through_exec = run(api, sid, "python3 /opt/fake/escape_probe.py")
    assert through_exec["exitCode"] == 0, through_exec
    assert probe_result(through_exec["stdout"]) == REFUSED

    api.call("POST", f"/sessions/{sid}/message", {"text": "python3 /opt/fake/escape_probe.py"})
    typed = wait_until(lambda: re.search(rb"PROBE-RESULT [^\r\n]*\}\r\n", api.read_all(sid)),
                       "the probe's line on the terminal")
    assert probe_result(typed.group().decode()) == REFUSED

    # Nothing moved: the same agent answers, its log and outbox kept every byte.
    status = api.call("GET", f"/sessions/{sid}/status")["agent"]
    assert status["workload"] == "shell" and status["running"] is True
    assert api.read_all(sid).startswith(prompt)
    assert outbox.read_bytes().startswith(events_before)
    assert stat.S_ISSOCK(os.lstat(outbox.parent / "control.sock").st_mode)
    assert not list((server.state_dir / "sessions" / sid / "workspace").glob(".probe-[lo]*"))


def test_an_impostor_agent_cannot_take_the_control_sockets_place(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    """Issue 21, attack 1: a workload process moves control.sock aside and listens in its place,
    to answer serve's download with a header of its own. It cannot: every try is refused, serve
    keeps talking to the real agent, and the download is the file, as an attachment."""
    server = serve_factory()
    api = server.api
    sid = api.create("impostor")["id"]
    log = server.state_dir / "sessions" / sid / "workspace" / ".impostor.log"
    started = run(api, sid, 'echo hello > f && python3 /opt/fake/impostor.py "$1" "$2" 60',
                  f"{SESSION_MOUNT}/agent/control.sock", f"{SESSION_MOUNT}/workspace/.impostor.log")
    assert started["exitCode"] == 0, started

    def tries() -> list[dict[str, Any]]:
        return [json.loads(line) for line in log.read_text().splitlines()]

    wait_until(lambda: sum(1 for t in tries() if t.get("try") == "listen_in_place") >= 2,
               "two rounds of the impostor's tries")
    status, headers, body = api.request("GET", f"/api/v1/sessions/{sid}/files/f")
    assert (status, body) == (200, b"hello\n")
    assert headers["content-type"] == "application/octet-stream" and headers["content-length"] == "6"
    assert headers["content-disposition"].startswith("attachment")
    assert api.call("GET", f"/sessions/{sid}/list/")["entry"]["type"] == "directory"
    seen = tries()
    assert {t["try"] for t in seen} == {"move_aside", "listen_in_place", "listen_beside"}
    assert {t["outcome"] for t in seen} == {"EACCES"} and not [t for t in seen if "connection" in t]


def test_the_session_disk_bounds_what_the_workload_writes_on_the_host(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    """Issue 21, attack 5: `dd` of 300 MiB into the session. With a 128 MiB disk it gets ENOSPC;
    the host holds at most the disk's size (plus SESSION_DISK_MARGIN_MIB); the agent goes on
    (its own files grow into the part ext4 keeps for root), an upload answers 507, and a directory
    download (its tar through a pipe, needing no room) still works."""
    import reploy_serve

    quota_mib = 128
    server = serve_factory("--session-disk-mib", str(quota_mib))
    api = server.api
    sid = api.create("filler")["id"]
    api.wait_output(sid, b"$ ")
    session_dir = server.state_dir / "sessions" / sid
    image = server.state_dir / "disks" / f"{sid}.img"
    assert os.statvfs(session_dir).f_flag & (os.ST_NOSUID | os.ST_NODEV) == os.ST_NOSUID | os.ST_NODEV
    assert image.stat().st_size == quota_mib << 20

    assert run(api, sid, "mkdir small && echo kept > small/f")["exitCode"] == 0
    filled = run(api, sid, "dd if=/dev/zero of=big bs=1M count=300")
    assert filled["exitCode"] == 1 and "No space left on device" in filled["stderr"], filled
    assert (session_dir / "workspace" / "big").stat().st_size < quota_mib << 20
    assert image.stat().st_blocks * 512 <= (quota_mib + reploy_serve.SESSION_DISK_MARGIN_MIB) << 20

    api.call("POST", f"/sessions/{sid}/message", {"text": "echo still-$((6*7))"})
    api.wait_output(sid, b"still-42")
    status, _, body = api.request("PUT", f"/api/v1/sessions/{sid}/files/more.bin", os.urandom(1024),
                                  {"Content-Type": "application/octet-stream"})
    assert status == 507, body
    assert not (session_dir / "workspace" / "more.bin").exists()
    status, _, body = api.request("GET", f"/api/v1/sessions/{sid}/files/small")
    assert status == 200
    with tarfile.open(fileobj=io.BytesIO(body)) as archive:
        assert archive.extractfile("f").read() == b"kept\n"

    api.call("DELETE", f"/sessions/{sid}", expect=204)
    assert not image.exists() and not session_dir.exists()
    assert not [point for point in session_disk_mounts() if point.startswith(str(server.state_dir))]


def test_files_out_of_a_session_keep_no_setuid_bits_and_no_link_to_the_agent(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any, tmp_path: Path) -> None:
    """Issue 21, attack 10: a hard link from the workspace to the agent's outbox, and setuid
    files written by the workload. The link cannot be made; the setuid file lies on a nosuid
    disk, and leaves the session without its bits, as a tar member and through `session cp`."""
    server = serve_factory()
    api = server.api
    sid = api.create("links")["id"]
    linked = run(api, sid, f"ln {SESSION_MOUNT}/agent/events.jsonl leak")
    assert linked["exitCode"] == 1 and "Permission denied" in linked["stderr"], linked
    assert api.request("GET", f"/api/v1/sessions/{sid}/files/leak")[0] == 404

    made = run(api, sid, "cp /bin/sh tool && chmod 6755 tool && stat -c %a tool")
    assert made["stdout"] == "6755\n", made
    on_host = server.state_dir / "sessions" / sid / "workspace" / "tool"
    assert os.lstat(on_host).st_mode & 0o6000 == 0o6000
    assert os.statvfs(on_host).f_flag & os.ST_NOSUID  # the host's kernel ignores the bits there
    status, _, body = api.request("GET", f"/api/v1/sessions/{sid}/files/")
    assert status == 200
    with tarfile.open(fileobj=io.BytesIO(body)) as archive:
        assert archive.getmember("tool").mode == 0o755
    copied = subprocess.run([sys.executable, str(ROOT / "reploy.py"), "session", "cp", f"{sid}:tool",
                             str(tmp_path / "tool"), "--server", server.ready["url"]],
                            capture_output=True, env=server.client_env(), timeout=60)
    assert copied.returncode == 0, copied.stderr
    assert stat.S_IMODE((tmp_path / "tool").stat().st_mode) == 0o755


def test_a_deployment_that_runs_as_root_is_refused(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any, tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(ROOT / "examples" / "managed", source)
    blueprint = source / "managed.blueprint.yaml"
    blueprint.write_text(blueprint.read_text().replace("name: managed-workload", "name: root-workload")
                         .replace('user: "1000:1000"', 'user: "0:0"'))
    stage_and_build(blueprint, tmp_path / "root-workload")
    server = serve_factory("--workload-dir", str(tmp_path / "root-workload"))
    status, _, body = server.api.request("POST", "/api/v1/sessions", json.dumps(
        {"name": "as-root", "deployment": "root-workload"}).encode())
    # Create is seed 002's route: a failure its spec does not name is 500, with the reason.
    assert status == 500 and "runs as root" in json.loads(body)["error"]
    assert server.api.call("GET", "/sessions")["sessions"] == []
    assert not session_containers(docker_engine, server.state_dir)
    assert not any((server.state_dir / "disks").iterdir())


def test_session_disks_are_mounted_again_when_serve_starts(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    """What a host reboot leaves: no container and no mount, the images and the records. The
    next serve mounts every disk again, and the session comes back with its files; a disk whose
    record is gone (a lost store) is swept: unmounted and removed."""
    server = serve_factory()
    sid = server.api.create("rebooted")["id"]
    lost = server.api.create("lost")["id"]
    assert run(server.api, sid, "echo survived > kept.txt")["exitCode"] == 0
    server.kill()
    for container in session_containers(docker_engine, server.state_dir):
        container.remove(force=True)
    session_dir = server.state_dir / "sessions" / sid
    subprocess.run(["umount", str(session_dir)], check=True, timeout=60)
    assert str(session_dir) not in session_disk_mounts()
    with sqlite3.connect(server.state_dir / "sessions.db") as db:
        db.execute("DELETE FROM sessions WHERE id = ?", (lost,))

    after = serve_factory(state_dir=server.state_dir)
    assert str(session_dir) in session_disk_mounts()
    assert str(server.state_dir / "sessions" / lost) not in session_disk_mounts()
    assert sorted(p.name for p in (server.state_dir / "disks").glob("*.img")) == [f"{sid}.img"]
    assert not (server.state_dir / "sessions" / lost).exists()
    assert run(after.api, sid, "cat kept.txt")["stdout"] == "survived\n"
