"""A deadline is a barrier (issue 23): what the host first sees after a deadline did not happen
before it, however the host got there late. Real sockets and a real ControlledSession loop
feeding a real HostCore, no Docker: a pass that overruns the deadline stands in for a host
suspended and resumed past it. (The core's own rules are stepped in test_host_core.py.)"""

from __future__ import annotations

import selectors
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import reploy
import reploy_session_client as wire
from reploy import (
    Attached, Begin, ChannelConnected, Created, Deadline, Planned, Requested, Role, Started,
    Timer, WorkloadExited,
)
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


def draining(session: reploy.ControlledSession) -> None:
    """The core terminating a started session whose workload exited: only the output's end
    of file is missing for a drain. Stepped directly: no action is performed."""
    core = session.core
    for event in (Planned(), Created(Role.CONTROLLER), Begin(), Created(Role.WORKLOAD),
                  Started(Role.CONTROLLER), ChannelConnected(), Attached(),
                  Started(Role.WORKLOAD), Requested(wire.Terminate()), WorkloadExited(0)):
        core.handle(event)
    assert core.state.step is reploy.Step.DRAINING and Timer.OUTPUT in core.state.armed


def overrunning_pass(session: reploy.ControlledSession, deadline: float,
                     seen: Any = None) -> socket.socket:
    """A socket ready at once whose handler feeds `seen` (if any), then returns only past
    `deadline`."""
    ready, peer = socket.socketpair()

    def overrun(_mask: int) -> None:
        ready.recv(1)
        if seen is not None:
            session.feed(seen)
        time.sleep(max(0.0, deadline + OVERRUN_S - time.monotonic()))  # the scenario itself

    session.selector.register(ready, selectors.EVENT_READ, overrun)
    peer.send(b"x")
    peer.close()
    return ready


class Recorder:
    """Stands in for the core: records what it is fed, answers nothing."""

    def __init__(self, state: reploy.HostState) -> None:
        self.state = state
        self.fed: list[Any] = []

    def handle(self, event: Any) -> list[Any]:
        self.fed.append(event)
        return []


def test_an_event_seen_in_a_pass_past_a_deadline_is_fed_after_it(
        session: reploy.ControlledSession) -> None:
    recorder = Recorder(reploy.HostState(armed=frozenset({Timer.ACKNOWLEDGEMENT})))
    session.core = recorder  # type: ignore[assignment]
    deadline = time.monotonic() + 0.2
    session.due[Timer.ACKNOWLEDGEMENT] = deadline
    ready = overrunning_pass(session, deadline, Requested(wire.AcknowledgeTerminated()))
    try:
        session.loop_once()
    finally:
        session.selector.unregister(ready)
        ready.close()
    assert recorder.fed == [Deadline(Timer.ACKNOWLEDGEMENT),
                            Requested(wire.AcknowledgeTerminated())]


def test_an_event_seen_in_time_is_fed_before_the_deadline(
        session: reploy.ControlledSession) -> None:
    recorder = Recorder(reploy.HostState(armed=frozenset({Timer.ACKNOWLEDGEMENT})))
    session.core = recorder  # type: ignore[assignment]
    session.due[Timer.ACKNOWLEDGEMENT] = time.monotonic() + 60
    session.feed(Requested(wire.AcknowledgeTerminated()))
    assert recorder.fed == [Requested(wire.AcknowledgeTerminated())]


def test_an_end_of_file_seen_in_a_pass_past_the_deadline_is_no_drain(
        session: reploy.ControlledSession) -> None:
    """The PTY's end of file is ready, but the pass that reads it ends past the output
    deadline (the race of issue 23: it was reported drained)."""
    draining(session)
    pty, workload = socket.socketpair()
    pty.setblocking(False)
    workload.close()  # the workload's output ended: end of file is ready to be read
    session.relay.open_pty(pty)
    deadline = time.monotonic() + 0.2
    session.due[Timer.OUTPUT] = deadline
    ready = overrunning_pass(session, deadline)
    try:
        session.loop_once()
    finally:
        session.selector.unregister(ready)
        ready.close()
        session.relay.close_pty()
    assert session.relay.pty_eof  # it was seen, late
    status = session.core.state.output_status
    assert status is not None and status.kind == "failed"
    assert "did not reach end of file" in (status.reason or "")


def test_an_end_of_file_seen_in_time_is_a_drain(session: reploy.ControlledSession) -> None:
    draining(session)
    pty, workload = socket.socketpair()
    pty.setblocking(False)
    workload.close()
    session.relay.open_pty(pty)
    session.due[Timer.OUTPUT] = time.monotonic() + 30
    try:
        while session.core.state.output_status is None:
            session.loop_once()
    finally:
        session.relay.close_pty()
    assert session.core.state.output_status.kind == "drained"
