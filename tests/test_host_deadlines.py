"""A deadline is a barrier (issue 23): what the host first sees after a deadline did not happen
before it, however the host got there late. Real sockets and a real ControlledSession loop, no
Docker: a pass that overruns the deadline stands in for a host suspended and resumed past it."""

from __future__ import annotations

import selectors
import socket
import time
from pathlib import Path
from typing import Iterator

import pytest

import reploy
from test_cli import CONTROLLER, WORKLOAD, run_args, staged

#: How far past the deadline the overrunning pass ends.
OVERRUN_S = 0.05


@pytest.fixture
def session(tmp_path: Path) -> Iterator[reploy.ControlledSession]:
    """A session as planned for two staged deployments, its loop ready; nothing started."""
    options = reploy.parse_run_options(reploy.build_parser().parse_args(run_args(
        staged(tmp_path, CONTROLLER, "c"), staged(tmp_path, WORKLOAD, "w"))),
        ["run-controller"])
    signals = reploy.HostSignals()  # its pipe only: no handler is installed
    controlled = reploy.ControlledSession(options, reploy.plan(options, *reploy.admit(options)),
                                          None, signals)  # type: ignore[arg-type]
    yield controlled
    controlled.notifier.close()
    controlled.selector.close()


def overrunning_pass(session: reploy.ControlledSession, deadline: float) -> socket.socket:
    """A socket ready at once whose handler returns only past `deadline`."""
    ready, peer = socket.socketpair()

    def overrun(_mask: int) -> None:
        ready.recv(1)
        time.sleep(max(0.0, deadline + OVERRUN_S - time.monotonic()))  # the scenario itself

    session.selector.register(ready, selectors.EVENT_READ, overrun)
    peer.send(b"x")
    peer.close()
    return ready


def test_a_condition_first_seen_after_the_deadline_did_not_hold_in_time(
        session: reploy.ControlledSession) -> None:
    deadline = time.monotonic() + 0.2
    ready = overrunning_pass(session, deadline)
    seen: list[bool] = []
    try:
        assert session.wait_until(lambda: seen.append(True) or len(seen) > 1, deadline,
                                  stop_on_latch=False) is False
    finally:
        session.selector.unregister(ready)
        ready.close()
    assert time.monotonic() > deadline


def test_a_condition_that_held_before_the_deadline_did(session: reploy.ControlledSession) -> None:
    assert session.wait_until(lambda: True, time.monotonic() + 0.2, stop_on_latch=False)
    assert session.wait_until(lambda: True, None)


def test_an_end_of_file_seen_in_a_pass_past_the_deadline_is_no_drain(
        session: reploy.ControlledSession) -> None:
    """The PTY's end of file is ready, but the pass that reads it ends past the output
    deadline (the race of issue 23: it was reported drained)."""
    pty, workload = socket.socketpair()
    pty.setblocking(False)
    workload.close()  # the workload's output ended: end of file is ready to be read
    session.relay.open_pty(pty)
    session.workload_started = True
    session.workload_exit = 0
    deadline = time.monotonic() + 0.2
    ready = overrunning_pass(session, deadline)
    try:
        status = session.finalize_output(deadline)
    finally:
        session.selector.unregister(ready)
        ready.close()
    assert session.relay.pty_eof  # it was seen, late
    assert status.kind == "failed" and "did not reach end of file" in (status.reason or "")


def test_an_end_of_file_seen_in_time_is_a_drain(session: reploy.ControlledSession) -> None:
    pty, workload = socket.socketpair()
    pty.setblocking(False)
    workload.close()
    session.relay.open_pty(pty)
    session.workload_started = True
    session.workload_exit = 0
    status = session.finalize_output(time.monotonic() + 5)
    assert status.kind == "drained"
