"""The managed-session lifecycle on the real engine: the reaper's idle and snapshot policy (and
the work and viewers it respects), two `serve` processes racing on one state dir, and `serve`
killed in the middle of create, snapshot and restore."""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable

import pytest

from serve_harness import (  # noqa: F401  (fixtures)
    ServeProcess, in_thread, managed_workload, seconds, serve_factory, session_containers,
    sse_events, wait_until,
)

pytestmark = pytest.mark.docker


def events_of(server: ServeProcess, sid: str, kind: str) -> list[dict[str, Any]]:
    outbox = server.state_dir / "sessions" / sid / "agent" / "events.jsonl"
    return [e for e in map(json.loads, outbox.read_text().splitlines()) if e["type"] == kind]


def paused(docker_engine: Any, server: ServeProcess, sid: str) -> bool:
    [container] = session_containers(docker_engine, server.state_dir, sid)
    return container.attrs["State"]["Paused"]


def reaped_past(server: ServeProcess, sid: str, past_s: float, blocked: list[str]) -> dict[str, Any]:
    """Waits until the reaper has had two passes (of 250 ms with --idle-after 1s) after the
    session's idle clock passed `past_s`, with `blocked` as its idleBlockedBy; returns it (the
    serve runs on this machine: its clock is ours)."""
    def due() -> Any:
        session = server.api.get(sid)
        start = session["lastAccess"] if session["state"] == "active" else session["stateSince"]
        return session if (session["idleBlockedBy"] == blocked
                           and time.time() >= seconds(start) + past_s + 0.5) else None
    return wait_until(due, f"the reaper to pass {past_s} s with {blocked}")


class Stream:
    """One SSE client on a thread (keepalives every 200 ms let it notice close() quickly)."""

    def __init__(self, server: ServeProcess, sid: str) -> None:
        self.closing = threading.Event()
        self.thread, _ = in_thread(lambda: sse_events(server.api, sid, until=lambda _: self.closing.is_set()))

    def close(self) -> None:
        self.closing.set()
        self.thread.join(timeout=30)


def foreground_sleep(server: ServeProcess, name: str) -> tuple[str, int]:
    """A shell session running `sleep 1000` in the foreground: its id and the shell's pid."""
    sid = server.api.create(name)["id"]
    server.api.wait_output(sid, b"$ ")
    server.api.call("POST", f"/sessions/{sid}/message", {"text": "sleep 1000"})
    status = wait_until(lambda: (lambda a: a if a["busy"] else None)(
        server.api.call("GET", f"/sessions/{sid}/status")["agent"]), "the sleep in the foreground")
    return sid, status["pid"]


def test_reaper_idles_then_snapshots_and_access_restores(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    server = serve_factory("--idle-after", "1s", "--snapshot-after", "4s")
    api = server.api
    sid, first = api.shell_ran("reaped", "echo first", b"first\r\n$ ")
    shell_pid = api.call("GET", f"/sessions/{sid}/status")["agent"]["pid"]
    wait_until(lambda: api.get(sid)["state"] == "idle", "the reaper to idle the session")
    assert paused(docker_engine, server, sid)
    session = api.get(sid)  # nothing held it back, and it did not go early
    assert session["idleBlockedBy"] == [] and seconds(session["stateSince"]) - seconds(session["lastAccess"]) >= 1.0
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
    in_thread(lambda: server.api.call("POST", "/sessions", {"name": "doomed"}, 201))
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
    sid = server.api.create("snap-crash", "claude-code")["id"]
    server.api.call("POST", f"/sessions/{sid}/message", {"text": "hang"})
    server.api.wait_output(sid, b"working")
    in_thread(lambda: server.api.raw("POST", f"/api/v1/sessions/{sid}/snapshot", b"{}"))
    wait_until(lambda: server.api.get(sid).get("phase") == "snapshotting", "snapshotting")
    assert server.api.get(sid)["state"] == "active"  # as seed 002 sees it until the archive is made
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


def test_a_streamed_foreground_job_survives_past_idle_after(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    server = serve_factory("--idle-after", "1s", "--sse-keepalive", "200ms")
    api = server.api
    sid, shell_pid = foreground_sleep(server, "watched-job")
    stream = Stream(server, sid)
    reaped_past(server, sid, 1.0, ["busy", "viewer"])
    assert api.get(sid)["state"] == "active" and not paused(docker_engine, server, sid)
    assert api.call("GET", f"/sessions/{sid}/status")["agent"]["turnState"] == "in_progress"
    # The job ends; the open stream alone still holds the session active.
    assert api.call("POST", f"/sessions/{sid}/interrupt", {})["cancelled"] is True
    reaped_past(server, sid, 1.0, ["viewer"])
    assert api.get(sid)["state"] == "active"
    # Nobody watches any more: idle, counted from the end of the job.
    stream.close()
    wait_until(lambda: api.get(sid)["state"] == "idle", "the reaper to idle the session")
    session = api.get(sid)
    assert session["idleBlockedBy"] == [] and paused(docker_engine, server, sid)
    assert api.call("GET", f"/sessions/{sid}/status")["agent"] is None  # passive, still idle
    assert api.call("POST", f"/sessions/{sid}/switch", {})["state"] == "active"
    assert api.call("GET", f"/sessions/{sid}/status")["agent"]["pid"] == shell_pid


def test_a_foreground_job_is_never_snapshotted_and_max_busy_pauses_it(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    policy = ("--idle-after", "1s", "--snapshot-after", "2s")
    first = serve_factory(*policy)
    sid, shell_pid = foreground_sleep(first, "busy-job")
    reaped_past(first, sid, 2.0, ["busy"])  # past --snapshot-after, no viewer: only the job holds it
    assert first.api.get(sid)["state"] == "active" and not paused(docker_engine, first, sid)
    assert not events_of(first, sid, "checkpoint") and "reaper" not in first.stderr  # never even tried
    first.stop()
    # The same sessions under a bound on work: paused anyway, with an outbox event, and kept.
    second = serve_factory(*policy, "--max-busy", "3s", state_dir=first.state_dir)
    wait_until(lambda: second.api.get(sid)["state"] == "idle", "the max-busy pause")
    assert paused(docker_engine, second, sid) and second.api.get(sid)["idleBlockedBy"] == ["busy"]
    [suspend] = events_of(second, sid, "suspend")
    assert suspend["reason"] == "max_busy" and suspend["turn_state"] == "in_progress"
    assert "pausing it anyway" in second.stderr
    reaped_past(second, sid, 2.0, ["busy"])  # frozen busy: past --snapshot-after, still no snapshot
    assert second.api.get(sid)["state"] == "idle" and not events_of(second, sid, "checkpoint")
    assert second.api.call("POST", f"/sessions/{sid}/switch", {})["state"] == "active"
    status = second.api.call("GET", f"/sessions/{sid}/status")["agent"]
    assert status["pid"] == shell_pid and status["turnState"] == "in_progress"  # the job went on


def test_a_viewer_in_one_serve_holds_off_the_reaper_of_another(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    watching = serve_factory("--sse-keepalive", "200ms")  # the default policy: never reaps here
    reaping = serve_factory("--idle-after", "1s", state_dir=watching.state_dir)
    sid = watching.api.create("cross-viewer")["id"]
    watching.api.wait_output(sid, b"$ ")
    stream = Stream(watching, sid)
    reaped_past(reaping, sid, 1.0, ["viewer"])
    assert reaping.api.get(sid)["state"] == "active"
    stream.close()
    wait_until(lambda: reaping.api.get(sid)["state"] == "idle", "the other serve to idle it")
