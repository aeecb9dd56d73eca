"""The host's pure cores: the lifecycle table, durations, the result's `ok` rule."""

from __future__ import annotations

import itertools

import pytest

import reploy
from reploy import LIFECYCLE_TABLE, LifecycleError, LifecycleMachine, Phase, Transition
from reploy_session_client import Cause, RecoveryAction, SessionResult, Status


def machine_in(phase: Phase) -> LifecycleMachine:
    machine = LifecycleMachine()
    if phase is Phase.ACTIVE:
        machine.ready()
    elif phase is Phase.TERMINATING:
        machine.terminate(Cause.HOST_CANCEL)
    elif phase is Phase.TERMINATED:
        machine.terminate(Cause.HOST_CANCEL)
        machine.finish()
    assert machine.phase is phase
    return machine


def apply(machine: LifecycleMachine, transition: Transition) -> None:
    if transition is Transition.READY:
        machine.ready()
    elif transition is Transition.TERMINATE:
        machine.terminate(Cause.CONTROLLER_LOST)
    else:
        machine.finish()


@pytest.mark.parametrize("phase,transition", list(itertools.product(Phase, Transition)))
def test_every_edge_follows_the_table(phase: Phase, transition: Transition) -> None:
    machine = machine_in(phase)
    expected = LIFECYCLE_TABLE.get((phase, transition))
    if expected is None:
        with pytest.raises(LifecycleError):
            apply(machine, transition)
        assert machine.phase is phase  # an illegal call changes nothing
    else:
        apply(machine, transition)
        assert machine.phase is expected


def test_first_cause_is_latched() -> None:
    machine = LifecycleMachine()
    machine.ready()
    assert machine.terminate(Cause.WORKLOAD_EXIT) is True
    assert machine.terminate(Cause.CONTROLLER_TERMINATE) is False
    assert machine.terminate(Cause.HOST_CANCEL) is False
    assert machine.cause is Cause.WORKLOAD_EXIT


def test_startup_branch_never_reaches_ready() -> None:
    machine = LifecycleMachine()
    machine.terminate(Cause.STARTUP_FAILURE)
    machine.finish()
    assert not machine.reached_ready and machine.phase is Phase.TERMINATED


@pytest.mark.parametrize("text,ms", [("30s", 30000), ("100ms", 100), ("5m", 300000),
                                     ("1h", 3600000), ("1.5s", 1500), ("0s", 0)])
def test_durations(text: str, ms: int) -> None:
    assert reploy.parse_duration_ms(text) == ms


@pytest.mark.parametrize("text", ["30", "s", "1.0001s", "-1s", "1 s", "1d", "1e3ms", ""])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        reploy.parse_duration_ms(text)


#: What each cause implies for the other facts (the contract's by-cause rules).
CAUSE_FACTS = {
    Cause.CONTROLLER_LOST: {"controller_finalization_status": Status.of(
        "controller_finalization", "lost", reason="the controller closed the channel")},
    Cause.STARTUP_FAILURE: {"controller_finalization_status": Status.of(
        "controller_finalization", "startup-failed", reason="no attachment")},
    Cause.RUNTIME_OBSERVATION_LOST: {
        "runtime_observation_status": Status.of("runtime_observation", "lost", reason="gone"),
        "workload_output_finalization_status": Status.of("output_finalization", "failed",
                                                         reason="no end of file")},
}


def clean_session(cause: Cause = Cause.WORKLOAD_EXIT, code: int = 0) -> SessionResult:
    facts = dict(
        workload_status=Status.of("process", "exited", code=code),
        workload_output_finalization_status=Status.of("output_finalization", "drained"),
        runtime_observation_status=Status.of("runtime_observation", "maintained"),
        controller_finalization_status=Status.of("controller_finalization", "completed"),
        cleanup_status=Status.of("cleanup", "succeeded"),
        recovery_action=RecoveryAction.NONE)
    facts.update(CAUSE_FACTS.get(cause, {}))
    return SessionResult(cause=cause, **facts)


def clean_result(**changes: object) -> reploy.RunResult:
    result = reploy.RunResult(
        session_result=clean_session(), result_delivered=True, result_acknowledged=True,
        controller_status=Status.of("process", "exited", code=0),
        controller_output=Status.of("controller_output", "not-requested"),
        delivery_tail_cleanup_status=Status.of("cleanup", "succeeded"),
        delivery_tail_recovery_action=RecoveryAction.NONE)
    for name, value in changes.items():
        setattr(result, name, value)
    return result


def test_ok_needs_every_phase() -> None:
    assert clean_result().ok
    assert clean_result(session_result=clean_session(Cause.CONTROLLER_TERMINATE, 137)).ok
    failing = {
        "error": "boom",
        "session_result": clean_session(Cause.WORKLOAD_EXIT, 3),
        "result_delivered": False,
        "result_acknowledged": False,
        "controller_output": Status.of("controller_output", "file-discarded", reason="x"),
        "delivery_tail_cleanup_status": Status.of("cleanup", "failed", message="x"),
        "delivery_tail_recovery_action": RecoveryAction.RETRY_CLEANUP,
    }
    for name, value in failing.items():
        assert not clean_result(**{name: value}).ok, name
    for cause in (Cause.HOST_CANCEL, Cause.CONTROLLER_LOST, Cause.STARTUP_FAILURE,
                  Cause.RUNTIME_OBSERVATION_LOST):
        assert not clean_result(session_result=clean_session(cause)).ok, cause


def test_result_always_has_ten_keys_in_order() -> None:
    empty = reploy.RunResult(error="admission rejected: x").to_json()
    assert tuple(empty) == reploy.RESULT_KEYS
    assert empty["ok"] is False and all(
        empty[k] is None for k in reploy.RESULT_KEYS if k not in ("schema", "ok", "error"))
    assert tuple(clean_result().to_json()) == reploy.RESULT_KEYS


def test_the_workload_pty_size_is_asked_for_at_creation() -> None:
    """HostConfig.ConsoleSize is [rows, columns]; Docker 20.10 stores it but does not apply it
    to a Linux container (the host resizes right after start as well)."""
    import docker

    api = docker.APIClient(base_url="unix:///nonexistent.sock", version="1.41")  # no calls made
    spec = reploy.ContainerSpec(
        role="workload", image_id="sha256:" + "0" * 64, command=("/bin/sh",),
        runtime=reploy.Runtime(uid=1000, gid=1000, writable_paths=(), memory_mib=64, pids=64),
        environment={}, labels={}, tty=True, console_size=(123, 45))
    assert spec.create_kwargs(api)["host_config"]["ConsoleSize"] == [45, 123]
    plain = reploy.ContainerSpec(**{**spec.__dict__, "console_size": None})
    assert "ConsoleSize" not in plain.create_kwargs(api)["host_config"]


def test_a_root_supervisor_keeps_only_setuid_setgid_and_kill() -> None:
    """A managed session's agent.py: 0:0 with three capabilities, and everything else of the
    sandbox as for any container; HOME still belongs to the runtime uid:gid."""
    import docker

    api = docker.APIClient(base_url="unix:///nonexistent.sock", version="1.41")  # no calls made
    spec = reploy.ContainerSpec(
        role="managed", image_id="sha256:" + "0" * 64, command=("python3",),
        runtime=reploy.Runtime(uid=1000, gid=1000, writable_paths=("/tmp",), memory_mib=64, pids=64),
        environment={}, labels={}, root_supervisor=True)
    supervised = spec.create_kwargs(api)
    plain = reploy.ContainerSpec(**{**spec.__dict__, "root_supervisor": False}).create_kwargs(api)
    assert (supervised["user"], plain["user"]) == ("0:0", "1000:1000")
    assert sorted(supervised["host_config"]["CapAdd"]) == ["KILL", "SETGID", "SETUID"]
    assert "CapAdd" not in plain["host_config"]
    for kwargs in (supervised, plain):
        host = kwargs["host_config"]
        assert host["CapDrop"] == ["ALL"] and host["ReadonlyRootfs"] is True
        assert host["SecurityOpt"] == ["no-new-privileges:true"]
        assert "uid=1000,gid=1000" in host["Tmpfs"][reploy.CONTAINER_HOME] and "uid=1000" in host["Tmpfs"]["/tmp"]
