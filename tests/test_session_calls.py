"""ControlledSession's off-loop Engine calls without an engine: a cleanup call that hangs is
cut off at --cleanup-timeout, and a signal cancels a planning call at once.

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
    """The one DockerBackend method these calls use: run `call` in a thread, report it."""

    def in_thread(self, tag: str, call: Callable[[Any], Any],
                  report: Callable[[str, Any], None]) -> None:
        def run() -> None:
            try:
                report(tag, call(None))
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


def test_a_hanging_cleanup_call_is_cut_off_at_its_deadline(
        session: reploy.ControlledSession) -> None:
    release = threading.Event()
    try:
        tag = session.begin_call("remove the workload container", lambda _api: release.wait())
        status = session.await_removals({"workload": tag}, 0.0)
    finally:
        release.set()
    assert status == reploy.failed(
        "cleanup", "remove the workload container: not finished within the cleanup timeout")


def test_a_failed_cleanup_call_says_what_failed(session: reploy.ControlledSession) -> None:
    def refuse(_api: Any) -> None:
        raise docker.errors.APIError("500 Server Error: engine timeout")

    deadline = reploy.time.monotonic() + 30
    status = session.await_removals(
        {"holder": session.begin_call("remove the holder container", refuse)}, deadline)
    assert status == reploy.failed(
        "cleanup", "remove the holder container: 500 Server Error: engine timeout")
    assert session.await_removals(
        {"holder": session.begin_call("remove it", lambda _api: None)}, deadline
    ) == reploy.succeeded()


def test_removals_run_at_once_and_are_all_awaited(session: reploy.ControlledSession) -> None:
    """Calls begun together overlap (as begin_removal begins them): the second runs while
    the first still waits for it."""
    first_may_end = threading.Event()

    def first(_api: Any) -> None:
        assert first_may_end.wait(30)

    deadline = reploy.time.monotonic() + 30
    removals = {"workload": session.begin_call("remove the workload container", first),
                "controller": session.begin_call("remove the controller container",
                                                 lambda _api: first_may_end.set())}
    assert session.await_removals(removals, deadline) == reploy.succeeded()


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
    assert session.cancelled_by == signum
    assert session.result.error == f"cancelled by {signal.Signals(signum).name}"
    assert session.machine.cause is reploy.Cause.HOST_CANCEL
