"""The managed-session lifecycle on the real engine: the reaper's idle and snapshot policy, two
`serve` processes racing on one state dir, and `serve` killed in the middle of create,
snapshot and restore."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from serve_harness import (  # noqa: F401  (fixtures)
    ServeProcess, in_thread, managed_workload, serve_factory, session_containers, sse_events,
    wait_until,
)

pytestmark = pytest.mark.docker


def events_of(server: ServeProcess, sid: str, kind: str) -> list[dict[str, Any]]:
    outbox = server.state_dir / "sessions" / sid / "events.jsonl"
    return [e for e in map(json.loads, outbox.read_text().splitlines()) if e["type"] == kind]


def paused(docker_engine: Any, server: ServeProcess, sid: str) -> bool:
    [container] = session_containers(docker_engine, server.state_dir, sid)
    return container.attrs["State"]["Paused"]


def test_reaper_idles_then_snapshots_and_access_restores(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    server = serve_factory("--idle-after", "1s", "--snapshot-after", "4s")
    api = server.api
    sid, first = api.shell_ran("reaped", "echo first", b"first\r\n$ ")
    shell_pid = api.call("GET", f"/sessions/{sid}/status")["agent"]["pid"]
    wait_until(lambda: api.get(sid)["state"] == "idle", "the reaper to idle the session")
    assert paused(docker_engine, server, sid)
    # Neither get, status nor the stream count as access.
    stamp = api.get(sid)["lastAccess"]
    assert api.call("GET", f"/sessions/{sid}/status")["agent"] is None
    sse_events(api, sid, until=lambda ev: any(e.get("event") for e in ev))
    assert api.get(sid)["lastAccess"] == stamp and api.get(sid)["state"] == "idle"
    # A read resumes: processes were kept (same shell pid), output unchanged.
    assert api.read_all(sid) == first
    assert api.get(sid)["state"] == "active" and not paused(docker_engine, server, sid)
    assert api.call("GET", f"/sessions/{sid}/status")["agent"]["pid"] == shell_pid
    assert len(events_of(server, sid, "session_start")) == 1
    wait_until(lambda: api.get(sid)["state"] == "snapshot", "the reaper to snapshot the session")
    assert not session_containers(docker_engine, server.state_dir, sid)
    api.call("POST", f"/sessions/{sid}/message", {"text": "echo second"})
    assert api.wait_output(sid, b"second\r\n").startswith(first)
    assert api.get(sid)["state"] == "active"


def test_two_servers_never_double_act(serve_factory: Callable[..., ServeProcess],
                                      docker_engine: Any) -> None:
    one = serve_factory()
    two = serve_factory(state_dir=one.state_dir)
    sid = one.api.create("shared")["id"]
    one.api.wait_output(sid, b"$ ")
    assert two.api.get(sid)["state"] == "active"  # one store

    def race(path: str) -> list[Any]:
        barrier = threading.Barrier(4)
        runs = [in_thread(lambda api=api: (barrier.wait(), api.call("POST", path, {}))[1])
                for api in (one.api, two.api, one.api, two.api)]
        for thread, _ in runs:
            thread.join(timeout=120)
        return [box[0] for _, box in runs]

    snapshots = race(f"/sessions/{sid}/snapshot")
    assert all(s["state"] == "snapshot" for s in snapshots), snapshots
    assert len(events_of(one, sid, "checkpoint")) == 1
    switched = race(f"/sessions/{sid}/switch")
    assert all(s["state"] == "active" for s in switched), switched
    assert len(session_containers(docker_engine, one.state_dir, sid)) == 1
    assert len(events_of(one, sid, "restore")) == 1
    assert len(events_of(one, sid, "session_start")) == 2  # created, then restored once


def test_serve_killed_during_create_leaves_nothing(serve_factory: Callable[..., ServeProcess],
                                                   docker_engine: Any) -> None:
    server = serve_factory()
    in_thread(lambda: server.api.call("POST", "/sessions", {"name": "doomed", "workload": "shell"}, 201))
    wait_until(lambda: session_containers(docker_engine, server.state_dir), "the container")
    server.kill()
    assert (server.state_dir / "sessions.db").exists()
    after = serve_factory(state_dir=server.state_dir)  # startup reconciles
    assert after.api.call("GET", "/sessions")["sessions"] == []
    assert not session_containers(docker_engine, server.state_dir)
    assert not any((server.state_dir / "sessions").iterdir())


def test_serve_killed_during_restore_rolls_back(serve_factory: Callable[..., ServeProcess],
                                                docker_engine: Any) -> None:
    server = serve_factory()
    sid, before = server.api.shell_ran("restore-crash", "echo survived", b"survived\r\n$ ")
    server.api.call("POST", f"/sessions/{sid}/snapshot", {})
    in_thread(lambda: server.api.call("POST", f"/sessions/{sid}/switch", {}))
    wait_until(lambda: session_containers(docker_engine, server.state_dir, sid), "the new container")
    server.kill()
    after = serve_factory(state_dir=server.state_dir)
    assert after.api.get(sid)["state"] == "snapshot"
    assert not session_containers(docker_engine, server.state_dir, sid)
    assert after.api.read_all(sid).startswith(before)  # restores again, from the kept archive
    assert len(session_containers(docker_engine, server.state_dir, sid)) == 1


def test_serve_killed_during_snapshot_recovers(serve_factory: Callable[..., ServeProcess],
                                               docker_engine: Any) -> None:
    server = serve_factory()
    sid = server.api.create("snap-crash", "agent")["id"]
    server.api.call("POST", f"/sessions/{sid}/message", {"text": "hang"})
    server.api.wait_output(sid, b"working")
    in_thread(lambda: server.api.raw("POST", f"/api/v1/sessions/{sid}/snapshot", b"{}"))
    wait_until(lambda: server.api.get(sid)["state"] == "snapshotting", "snapshotting")
    server.kill()
    after = serve_factory(state_dir=server.state_dir)
    # The run never drained, so there is no archive: back to active, container kept.
    wait_until(lambda: after.api.get(sid)["state"] == "active", "recovery to active")
    assert len(session_containers(docker_engine, server.state_dir, sid)) == 1
    assert after.api.call("POST", f"/sessions/{sid}/interrupt", {})["cancelled"] is True
    wait_until(lambda: after.api.call("GET", f"/sessions/{sid}/status")["agent"]["admissionOpen"],
               "admission to reopen")
    assert after.api.call("POST", f"/sessions/{sid}/snapshot", {})["state"] == "snapshot"
    assert not session_containers(docker_engine, server.state_dir, sid)
