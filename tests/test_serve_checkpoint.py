"""Issue 26, items 2 and 7, on the real engine: what a workload does to its own files cannot
break its session's snapshot or restore, nor make the reaper write to the host without end.

A snapshot archives the session's home (a tmpfs in the container) into the agent's dir on the
session's disk, an ext4 image on the host. Each test measures what the host wrote to that image
from outside: the write sectors of its loop device, after a sync. Before the change, the 1 GiB
sparse file filled the 64 MiB disk (507), the 1,200-level tree raised RecursionError, the reaper
rolled both back to active and tried again every pass, and a workspace the workload had made
unreadable (chmod 000) made every restore answer 500.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from serve_harness import (  # noqa: F401  (fixtures)
    Api, ServeProcess, managed_workload, seconds, serve_factory, session_containers, sse_events,
    wait_until,
)

pytestmark = pytest.mark.docker

MIB = 1 << 20
#: What a snapshot that writes next to nothing may still cost the disk: the archive's few
#: blocks, the outbox and log lines, ext4's journal and metadata.
SMALL_WRITE_BYTES = 8 * MIB


def run(api: Api, sid: str, script: str, timeout_ms: int = 60_000) -> dict[str, Any]:
    """python3 -c script in the session's container, as its runtime user; must exit 0."""
    result = api.call("POST", f"/sessions/{sid}/exec",
                      {"argv": ["python3", "-c", script], "timeoutMs": timeout_ms})
    assert result["exitCode"] == 0, result
    return result


def disk_written_bytes(server: ServeProcess, sid: str) -> int:
    """What the host has written to the session's disk image: its loop device's write sectors
    (/sys/block/loopN/stat, field 7), once everything dirty is synced."""
    image = str(server.state_dir / "disks" / f"{sid}.img")
    os.sync()
    [device] = [backing.parent.parent for backing in Path("/sys/block").glob("loop*/loop/backing_file")
                if backing.read_text().strip() == image]
    return int((device / "stat").read_text().split()[6]) * 512


def paused(docker_engine: Any, server: ServeProcess, sid: str) -> bool:
    [container] = session_containers(docker_engine, server.state_dir, sid)
    return container.attrs["State"]["Paused"]


SPARSE = """
import os
path = os.path.expanduser("~/sparse")
with open(path, "wb") as f:
    f.seek(100 << 20)
    f.write(b"middle")
    f.truncate(1 << 30)
"""

SPARSE_CHECK = """
import json, os
path = os.path.expanduser("~/sparse")
st = os.stat(path)
with open(path, "rb") as f:
    f.seek((100 << 20) - 3)
    middle = f.read(9)
print(json.dumps({"size": st.st_size, "allocated": st.st_blocks * 512, "middle": middle.hex()}))
"""


def snapshot_and_restore(server: ServeProcess, name: str, argv: list[str]) -> tuple[str, dict[str, Any]]:
    """A session whose home `argv` (run by exec) filled, snapshotted (writing next to nothing on
    the host, no failure) and switched back: its id and the snapshot."""
    api = server.api
    sid = api.create(name)["id"]
    api.wait_output(sid, b"$ ")
    assert api.call("POST", f"/sessions/{sid}/exec", {"argv": argv})["exitCode"] == 0
    before = disk_written_bytes(server, sid)
    snapshot = api.call("POST", f"/sessions/{sid}/snapshot", {})
    assert snapshot["state"] == "snapshot" and "lastFailure" not in snapshot
    assert disk_written_bytes(server, sid) - before < SMALL_WRITE_BYTES
    assert api.call("POST", f"/sessions/{sid}/switch", {})["state"] == "active"
    return sid, snapshot


def test_a_sparse_gigabyte_in_home_is_archived_by_its_data_and_restored_sparse(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    server = serve_factory("--session-disk-mib", "64")
    sid, snapshot = snapshot_and_restore(server, "sparse", ["python3", "-c", SPARSE])
    assert snapshot["checkpoint"]["sizeBytes"] < MIB
    restored = json.loads(run(server.api, sid, SPARSE_CHECK)["stdout"])
    assert restored == {"size": 1 << 30, "allocated": restored["allocated"],
                        "middle": (b"\0\0\0middle").hex()}
    assert restored["allocated"] < MIB  # sparse again, in the new container's home


def test_a_home_1200_levels_deep_snapshots_and_restores_intact(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    server = serve_factory("--session-disk-mib", "64")
    tree = ["python3", "/opt/fake/deep_tree.py"]
    sid, _ = snapshot_and_restore(server, "deep", [*tree, "make", "/mnt/reploy-home", "1200"])
    checked = server.api.call("POST", f"/sessions/{sid}/exec", {"argv": [*tree, "check", "/mnt/reploy-home"]})
    assert checked["stdout"] == "1200 at the bottom\n"


FILL = """
import os
with open("/mnt/reploy-session/workspace/fill", "wb") as f:
    try:
        while True:
            f.write(bytes(1 << 20))
            f.flush()
    except OSError as e:
        assert e.errno == 28  # ENOSPC: the workload filled what the disk gives it
with open(os.path.expanduser("~/data"), "wb") as f:
    f.write(os.urandom(20 << 20))
"""


def test_a_home_its_disk_cannot_hold_is_refused_before_a_byte_is_written(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    """The workload filled its disk; its home holds 20 MiB more than ext4 keeps for root. The
    snapshot is refused at once (saying how much is free and needed; seed 002's snapshot route
    names no 507, so it is its 500 with the message), writes nothing, and the agent's own files
    still grow."""
    server = serve_factory("--session-disk-mib", "64")
    api = server.api
    sid = api.create("full")["id"]
    api.wait_output(sid, b"$ ")
    run(api, sid, FILL)
    before = disk_written_bytes(server, sid)
    status, raw = api.raw("POST", f"/api/v1/sessions/{sid}/snapshot", b"{}")
    error = json.loads(raw)["error"]
    assert status == 500 and "not enough space in the session's disk (a checkpoint)" in error, raw
    assert disk_written_bytes(server, sid) - before < SMALL_WRITE_BYTES
    session = api.get(sid)
    assert session["state"] == "idle" and session["lastFailure"]["reason"] == error
    api.call("POST", f"/sessions/{sid}/message", {"text": "echo still-$((6*7))"})
    api.wait_output(sid, b"still-42")


#: 200,000 names of one empty file: the tree the walk sees is 200,000 empty files, and hard
#: links keep the home's inodes (kernel memory the container's limit counts) to one.
MANY = """
import os
home = os.path.expanduser("~")
os.mkdir(f"{home}/many")
open(f"{home}/many/0", "w").close()
fd = os.open(f"{home}/many", os.O_RDONLY | os.O_DIRECTORY)
for number in range(1, 200_000):
    os.link("0", str(number), src_dir_fd=fd, dst_dir_fd=fd)
"""


class Viewer:
    """One SSE client on a thread: while it is open the reaper leaves the session alone."""

    def __init__(self, api: Api, sid: str) -> None:
        self.closing = threading.Event()
        self.thread = threading.Thread(
            target=sse_events, args=(api, sid), kwargs={"until": lambda _: self.closing.is_set()}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.closing.set()
        self.thread.join(timeout=60)


def failure_after(api: Api, sid: str, failures: int) -> dict[str, Any]:
    return wait_until(lambda: (lambda s: s if s.get("lastFailure", {}).get("failures") == failures else None)(
        api.get(sid)), f"snapshot failure {failures} of session {sid}")


def test_a_home_of_200000_files_is_refused_with_the_reason_and_retried_with_a_growing_backoff(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    server = serve_factory("--idle-after", "1s", "--snapshot-after", "2s", "--sse-keepalive", "200ms",
                           "--session-disk-mib", "64")
    api = server.api
    sid = api.create("many")["id"]
    api.wait_output(sid, b"$ ")
    viewer = Viewer(api, sid)
    wait_until(lambda: api.get(sid)["idleBlockedBy"] == ["viewer"], "the viewer to hold the reaper off")
    run(api, sid, MANY, timeout_ms=600_000)
    before = disk_written_bytes(server, sid)
    viewer.close()

    first = failure_after(api, sid, 1)
    failure = first["lastFailure"]
    assert failure["step"] == "snapshot" and "more than 200000 entries" in failure["reason"], failure
    assert first["state"] == "idle" and "phase" not in first and paused(docker_engine, server, sid)
    second = failure_after(api, sid, 2)["lastFailure"]
    assert seconds(second["at"]) >= seconds(failure["retryAt"])  # not before its time
    assert (seconds(second["retryAt"]) - seconds(second["at"])
            > seconds(failure["retryAt"]) - seconds(failure["at"]))  # and the wait grows
    assert disk_written_bytes(server, sid) - before < SMALL_WRITE_BYTES  # refused before writing
    assert "more than 200000 entries" in server.stderr

    # An access resumes the session as it was; the failure stays shown until a snapshot succeeds.
    assert run(api, sid, "import os; print(len(os.listdir(os.path.expanduser('~/many'))))")["stdout"] == "200000\n"
    assert api.get(sid)["state"] == "active" and api.get(sid)["lastFailure"]["failures"] == 2
    run(api, sid, "import shutil, os; shutil.rmtree(os.path.expanduser('~/many'))")
    snapshot = api.call("POST", f"/sessions/{sid}/snapshot", {})
    assert snapshot["state"] == "snapshot" and "lastFailure" not in snapshot


def test_a_workspace_the_workload_shut_itself_out_of_is_restored_and_usable(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    """Issue 26, item 7: chmod 000 on the workspace, snapshot, switch. serve gives the
    workspace back to its user (owner and u+rwx) before the container starts."""
    server = serve_factory()
    api = server.api
    sid = api.create("shut-out")["id"]
    api.wait_output(sid, b"$ ")
    run(api, sid, "import os; open('/mnt/reploy-session/workspace/kept.txt', 'w').write('kept');"
                  "os.chmod('/mnt/reploy-session/workspace', 0)")
    assert api.call("POST", f"/sessions/{sid}/snapshot", {})["state"] == "snapshot"
    assert api.call("POST", f"/sessions/{sid}/switch", {})["state"] == "active"
    listed = run(api, sid, "import os; st = os.stat('.'); print(os.getcwd(), oct(st.st_mode & 0o700), "
                           "open('kept.txt').read())")
    assert listed["stdout"] == "/mnt/reploy-session/workspace 0o700 kept\n"


def test_a_restore_that_fails_says_why_and_keeps_the_archive(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    server = serve_factory()
    api = server.api
    sid = api.create("kept")["id"]
    api.wait_output(sid, b"$ ")
    run(api, sid, "import os; open(os.path.expanduser('~/note'), 'w').write('in the archive')")
    snapshot = api.call("POST", f"/sessions/{sid}/snapshot", {})
    archive = server.state_dir / "sessions" / sid / "agent" / snapshot["checkpoint"]["ref"]
    good = archive.read_bytes()
    archive.write_bytes(b"not a tar" * 100)

    status, raw = api.raw("POST", f"/api/v1/sessions/{sid}/switch", b"{}")
    assert status >= 500 and "restore" in json.loads(raw)["error"], raw
    session = api.get(sid)
    assert session["state"] == "snapshot" and session["checkpoint"]["ref"] == archive.name
    failure = session["lastFailure"]
    assert failure["step"] == "restore" and "cannot restore /mnt/reploy-session/agent/" in failure["reason"]
    assert archive.read_bytes() == b"not a tar" * 100  # kept as it was, nothing removed

    archive.write_bytes(good)
    assert "lastFailure" not in api.call("POST", f"/sessions/{sid}/switch", {})
    assert run(api, sid, "import os; print(open(os.path.expanduser('~/note')).read())")["stdout"] == \
        "in the archive\n"
