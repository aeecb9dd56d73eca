"""Session disks matched by identity (issue 26, item 4), on a real `reploy serve`: a state dir
reached through a symlink leaks no mount or loop device and never blocks a create, and a serve
SIGKILLed at each disk step (reploy_serve.DiskStep) is repaired by the next start.

Serve is stopped at a step by the test-only DISK_STEP_STOP_ENV: it sends itself SIGSTOP there,
the test sees it stopped (its /proc state), SIGKILLs it, and starts another serve on the same
state dir, which must leave no record, image, mount point, mount, loop device or container of
the lost session, and then create, use and delete sessions as ever.
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil
import pytest

import reploy_serve
from conftest import SERVE_STATE_DIR_PREFIX, remove_session_disks, session_disk_loops, session_disk_mounts
from serve_harness import (  # noqa: F401  (fixtures)
    Api, ServeProcess, managed_workload, serve_factory, session_containers, wait_until,
)

pytestmark = pytest.mark.docker

CREATE_STEPS = (reploy_serve.DiskStep.IMAGE_MADE, reploy_serve.DiskStep.FS_MADE,
                reploy_serve.DiskStep.MOUNTED)


def records(state_dir: Path) -> list[tuple[str, str]]:
    with contextlib.closing(sqlite3.connect(state_dir / "sessions.db")) as db:
        return list(db.execute("SELECT id, state FROM sessions"))


def assert_nothing_left_of(state_dir: Path, sid: str) -> None:
    """No record, image, mount point, mount or loop device of session `sid`."""
    assert sid not in {record_id for record_id, _ in records(state_dir)}
    assert not (state_dir / "disks" / f"{sid}.img").exists()
    assert not (state_dir / "sessions" / sid).exists()
    canonical = str(state_dir.resolve())
    assert [p for p in session_disk_mounts(canonical + "/") if sid in p] == []
    assert [d for d in session_disk_loops(canonical + "/")
            if sid in (reploy_serve.loop_backing_file(d) or "")] == []


def assert_works(api: Api) -> None:
    """A session made, used and deleted."""
    sid = api.create("after")["id"]
    api.wait_output(sid, b"$ ")
    done = api.call("POST", f"/sessions/{sid}/exec", {"argv": ["sh", "-c", "echo ok > f && cat f"]})
    assert done["stdout"] == "ok\n", done
    api.call("DELETE", f"/sessions/{sid}", expect=204)


@pytest.fixture
def symlinked_state_dir() -> Iterator[Path]:
    """STATE reached through a symlink (BASE/link -> BASE/real); removed after serve_factory's
    teardown (requested first, it is torn down last)."""
    base = Path(tempfile.mkdtemp(prefix=SERVE_STATE_DIR_PREFIX))
    (base / "real").mkdir(mode=0o700)
    (base / "link").symlink_to(base / "real")
    yield base / "link"
    left = remove_session_disks(f"{base}/")
    shutil.rmtree(base, ignore_errors=True)
    assert not left, f"disks left under the symlinked state dir: {left}"


def test_a_symlinked_state_dir_leaks_no_mount_and_every_create_works(
        symlinked_state_dir: Path, serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    """Issue 26, item 4: each start left its probe disk mounted on an unlinked image, and every
    create then failed "already mounted". Now: nothing left by a start, a create, a delete or a
    restart, and the session's disk is its own mount at the canonical path."""
    real = symlinked_state_dir.resolve()
    server = serve_factory(state_dir=symlinked_state_dir)
    assert server.ready["state_dir"] == str(real)
    assert session_disk_mounts(f"{real}/") == [] and session_disk_loops(f"{real}/") == []
    sid = server.api.create("linked")["id"]
    server.api.wait_output(sid, b"$ ")
    assert session_disk_mounts(f"{real}/") == [str(real / "sessions" / sid)]
    assert reploy_serve.loop_backing_file(reploy_serve.mounted_device(real / "sessions" / sid)) == str(
        real / "disks" / f"{sid}.img")
    labels = [c.labels["io.reploy.serve.state-dir"] for c in session_containers(docker_engine, real)]
    assert labels == [str(real)]
    server.api.call("DELETE", f"/sessions/{sid}", expect=204)
    assert_nothing_left_of(symlinked_state_dir, sid)
    assert session_disk_mounts(f"{real}/") == [] and session_disk_loops(f"{real}/") == []
    server.stop()

    again = serve_factory(state_dir=symlinked_state_dir)
    assert session_disk_mounts(f"{real}/") == [] and session_disk_loops(f"{real}/") == []
    assert_works(again.api)
    assert records(symlinked_state_dir) == []
    assert session_disk_mounts(f"{real}/") == [] and session_disk_loops(f"{real}/") == []


def stopped(pid: int) -> bool:
    return psutil.Process(pid).status() == psutil.STATUS_STOPPED


@pytest.mark.parametrize("step", list(reploy_serve.DiskStep), ids=lambda step: step.value)
def test_serve_killed_at_each_disk_step_is_repaired_by_the_next_start(
        step: reploy_serve.DiskStep, serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    """Issue 26, item 4: serve SIGKILLed between two steps of a session disk's creation or
    deletion. The next start finishes the deletion or undoes the creation: nothing of the
    session stays (no record stuck in creating or deleting, no image, no mount, no loop device),
    and sessions work."""
    server = serve_factory(env={reploy_serve.DISK_STEP_STOP_ENV: step.value})
    if step in CREATE_STEPS:
        before = set(p.name for p in (server.state_dir / "disks").glob("*.img"))
        request: tuple[str, str, bytes] = ("POST", "/api/v1/sessions", b'{"name": "victim"}')
    else:
        sid = server.api.create("victim")["id"]
        server.api.wait_output(sid, b"$ ")
        request = ("DELETE", f"/api/v1/sessions/{sid}", b"")

    def call() -> None:
        with contextlib.suppress(OSError):  # serve dies under it
            server.api.request(*request, timeout=120)

    caller = threading.Thread(target=call)
    caller.start()
    wait_until(lambda: stopped(server.proc.pid), f"serve stopped at {step.value}")
    if step in CREATE_STEPS:
        [image] = set(p.name for p in (server.state_dir / "disks").glob("*.img")) - before
        sid = image.removesuffix(".img")
    left = dict(records(server.state_dir))
    assert left[sid] == ("creating" if step in CREATE_STEPS else "deleting")
    server.kill()
    caller.join()

    after = serve_factory(state_dir=server.state_dir)
    assert_nothing_left_of(server.state_dir, sid)
    assert not session_containers(docker_engine, server.state_dir, sid)
    assert after.api.call("GET", "/sessions")["sessions"] == []
    assert_works(after.api)
    assert records(server.state_dir) == []
