"""ControlledSession's off-loop Engine calls without an engine: removals overlap and report
what failed, and a signal cancels a planning call at once. (That a removal past its deadline
is a cleanup failure is the core's rule: test_host_core.py.)

An Engine that hangs cannot be had on demand from the real one (stopping dockerd would hit
every other user of the machine), so the backend seam here runs plain Python callables that
block on an event the test controls; the session's own loop, notifier and signals are real.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import docker.errors
import pytest

import reploy
import reploy_session_client as wire


class ThreadBackend:
    """The one DockerBackend method these calls use: run `call` in a thread, report it. The
    call's Engine client is this object too: removing a container runs `removals[id]`."""

    def __init__(self) -> None:
        self.removals: dict[str, Callable[[Any], None]] = {}

    def remove_container(self, container_id: str, force: bool, v: bool) -> None:
        self.removals[container_id](self)

    def in_thread(self, tag: str, call: Callable[[Any], Any],
                  report: Callable[[str, Any], None]) -> None:
        def run() -> None:
            try:
                report(tag, call(self))
            except Exception as e:  # noqa: BLE001 - as DockerBackend.in_thread: reported
                report(tag, e)

        threading.Thread(target=run, daemon=True).start()


@pytest.fixture
def session(tmp_path: Path) -> Iterator[reploy.ControlledSession]:
    options = reploy.RunOptions(
        controller_dir=tmp_path, workload_dir=tmp_path, endpoints=(), columns=80, rows=24,
        output_file=None, output_dir=None, command=("x",),
        timeouts_ms={option.flag: option.default_ms for option in reploy.TIMEOUT_OPTIONS})
    deployment = reploy.Deployment(dir=tmp_path, deployment_id="0" * 32, blueprint=None,  # type: ignore[arg-type]
                                   blueprint_digest="", current=None)
    plan = reploy.SessionPlan("1" * 32, deployment, deployment, None, None, (), ())  # type: ignore[arg-type]
    with wire.SignalWakeup((signal.SIGINT, signal.SIGTERM)) as wakeup:
        controlled = reploy.ControlledSession(options, plan, ThreadBackend(), wakeup)  # type: ignore[arg-type]
        yield controlled
        controlled.notifier.close()
        controlled.selector.close()


def removals(session: reploy.ControlledSession, calls: dict[reploy.Role, Any]) -> list[Any]:
    """Remove these roles' containers (each removal runs `calls[role]`) as the core's Remove
    action does; what the core is fed, once every removal reported."""
    fed: list[Any] = []

    def handle(event: Any) -> list[Any]:
        fed.append(event)
        return []

    session.core.handle = handle  # type: ignore[method-assign]
    for role, call in calls.items():
        session.owned.containers[role.value] = f"{role.value}-id"
        session.owned.labels[f"{role.value}-id"] = {}
        session.backend.removals[f"{role.value}-id"] = call  # type: ignore[attr-defined]
    session.perform(reploy.Remove(tuple(calls)))
    while len([e for e in fed if isinstance(e, reploy.Removed)]) < len(calls):
        session.loop_once()
    return fed


def test_a_failed_removal_says_what_failed(session: reploy.ControlledSession) -> None:
    def refuse(_api: Any) -> None:
        raise docker.errors.APIError("500 Server Error: engine timeout")

    assert removals(session, {reploy.Role.HOLDER: refuse}) == [reploy.Removed(
        reploy.Role.HOLDER, "remove the holder container: 500 Server Error: engine timeout")]
    assert "holder" in session.owned.containers  # it may still be there: cleanup reconciles


def test_removals_run_at_once(session: reploy.ControlledSession) -> None:
    """Removals begun together overlap: the second runs while the first still waits for it."""
    first_may_end = threading.Event()

    def first(_api: Any) -> None:
        assert first_may_end.wait(30)

    fed = removals(session, {reploy.Role.WORKLOAD: first,
                             reploy.Role.CONTROLLER: lambda _api: first_may_end.set()})
    assert set(fed) == {reploy.Removed(reploy.Role.WORKLOAD),
                        reploy.Removed(reploy.Role.CONTROLLER)}
    assert session.owned.containers == {}  # each left the manifest as it went


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_cancels_a_planning_call(session: reploy.ControlledSession,
                                          signum: int) -> None:
    release = threading.Event()

    def build(_api: Any) -> str:
        os.kill(os.getpid(), signum)  # the user presses Ctrl-C while the image builds
        release.wait()
        return "sha256:never-used"

    try:
        assert session.off_loop("build the controller image", build) is None
    finally:
        release.set()
    assert session.core.state.error == f"cancelled by {signal.Signals(signum).name}"
    assert session.core.state.cause is reploy.Cause.HOST_CANCEL
