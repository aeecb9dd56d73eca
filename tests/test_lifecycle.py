"""The host's pure cores: the lifecycle table, durations, the result's `ok` rule."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

import reploy
from reploy import (
    LIFECYCLE_TABLE, HostConfig, HostCore, HostTimeouts, LifecycleError, Phase, Transition,
    next_phase,
)
from reploy_session_client import Cause, RecoveryAction, SessionResult, Status


#: Every timeout option at its default.
DEFAULT_TIMEOUTS = HostTimeouts(*(option.default_ms / 1000 for option in reploy.TIMEOUT_OPTIONS))


@pytest.mark.parametrize("phase,transition", list(itertools.product(Phase, Transition)))
def test_every_edge_follows_the_table(phase: Phase, transition: Transition) -> None:
    expected = LIFECYCLE_TABLE.get((phase, transition))
    if expected is None:
        with pytest.raises(LifecycleError):
            next_phase(phase, transition)
    else:
        assert next_phase(phase, transition) is expected


def test_first_cause_is_latched() -> None:
    core = HostCore(HostConfig(DEFAULT_TIMEOUTS))
    core.handle(reploy.Planned())
    core.handle(reploy.Signalled("SIGINT"))  # nothing of a session yet: the delivery tail
    for later in (reploy.WorkloadExited(0), reploy.ChannelLost("x"), reploy.Signalled("SIGTERM")):
        core.handle(later)
    assert core.state.cause is Cause.HOST_CANCEL


def test_startup_branch_never_reaches_ready() -> None:
    core = HostCore(HostConfig(DEFAULT_TIMEOUTS))
    for event in (reploy.Planned(), reploy.Created(reploy.Role.CONTROLLER), reploy.Begin(),
                  reploy.Created(reploy.Role.WORKLOAD), reploy.Started(reploy.Role.CONTROLLER),
                  reploy.Deadline(reploy.Timer.STARTUP), reploy.Removed(reploy.Role.WORKLOAD)):
        core.handle(event)
    assert not core.state.reached_ready and core.state.phase is Phase.TERMINATED
    assert core.state.cause is Cause.STARTUP_FAILURE


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


# ---------------------------------------------------------------------------------------------
# The printed error: null exactly when ok, else one line naming each fact that made ok false
# ---------------------------------------------------------------------------------------------

STARTUP_FAILED = Status.of("controller_finalization", "startup-failed", reason="no attachment")


def session_with(cause: Cause = Cause.WORKLOAD_EXIT, code: int = 0,
                 **facts: object) -> SessionResult:
    session = clean_session(cause, code)
    return SessionResult(**{**session.__dict__, **facts})


#: Each failing fact of a run that ran, and what its error must say about it.
FAILING_FACTS = {
    "a non-zero workload exit": (
        {"session_result": clean_session(Cause.WORKLOAD_EXIT, 3)},
        ["the workload exited with code 3"]),
    "an unavailable workload status": (
        {"session_result": session_with(workload_status=Status.of(
            "process", "unavailable", reason="not observed within 30s"))},
        ["the workload's status is unavailable: not observed within 30s"]),
    "a lost controller": (
        {"session_result": clean_session(Cause.CONTROLLER_LOST)},
        ["the controller was lost: the controller closed the channel"]),
    "a lost observation": (
        {"session_result": clean_session(Cause.RUNTIME_OBSERVATION_LOST)},
        ["the runtime observation was lost: gone"]),
    "failed output finalization": (
        {"session_result": session_with(workload_output_finalization_status=Status.of(
            "output_finalization", "failed", reason="no end of file within 30 s"))},
        ["terminal output finalization failed: no end of file within 30 s"]),
    "a finalization timeout": (
        {"session_result": session_with(controller_finalization_status=Status.of(
            "controller_finalization", "finalization-timeout", reason="no complete within 1s"))},
        ["controller finalization finalization-timeout: no complete within 1s"]),
    "a failed workload cleanup": (
        {"session_result": session_with(
            cleanup_status=Status.of("cleanup", "failed", message="remove: busy"),
            recovery_action=RecoveryAction.RECONCILE_NEXT_OPERATION)},
        ["the workload's cleanup failed: remove: busy"]),
    "an undelivered result": (
        {"result_delivered": False, "result_acknowledged": False},
        ["the result was not delivered to the controller"]),
    "an unacknowledged result": (
        {"result_acknowledged": False}, ["the controller did not acknowledge the result"]),
    "a discarded output file": (
        {"controller_output": Status.of("controller_output", "file-discarded",
                                        reason="finalization did not complete")},
        ["controller output file-discarded: finalization did not complete"]),
    "a failed delivery-tail cleanup": (
        {"delivery_tail_cleanup_status": Status.of("cleanup", "failed", message="rm: EPERM"),
         "delivery_tail_recovery_action": RecoveryAction.RECONCILE_NEXT_OPERATION},
        ["the delivery tail's cleanup failed: rm: EPERM"]),
    "a startup failure the error explains": (
        {"error": "startup failed: no attachment",
         "session_result": session_with(Cause.STARTUP_FAILURE,
                                        controller_finalization_status=STARTUP_FAILED)},
        ["startup failed: no attachment"]),
    "a signal that came while the session ended": (
        {"result_acknowledged": False, "received_signal": "SIGTERM"},
        ["the controller did not acknowledge the result", "received SIGTERM"]),
    "a cancellation by a signal": (
        {"error": "cancelled by SIGINT", "received_signal": "SIGINT",
         "session_result": clean_session(Cause.HOST_CANCEL)},
        ["cancelled by SIGINT"]),
    "two failures at once": (
        {"session_result": clean_session(Cause.WORKLOAD_EXIT, 2), "result_acknowledged": False},
        ["the workload exited with code 2", "the controller did not acknowledge the result"]),
}


@pytest.mark.parametrize("changes, parts", FAILING_FACTS.values(), ids=FAILING_FACTS.keys())
def test_the_error_names_each_fact_that_made_ok_false(changes: dict[str, object],
                                                      parts: list[str]) -> None:
    result = clean_result(**changes)
    assert not result.ok
    assert result.summary() == "; ".join(parts)


def test_an_ok_result_has_no_error() -> None:
    assert clean_result().summary() is None
    assert clean_result(received_signal="SIGTERM").summary() is None  # it changed nothing


def test_the_error_is_one_bounded_line_of_safe_text() -> None:
    hostile = "/tmp/a\nb\x1b[2J\u202e" + "x" * 2000
    result = reploy.RunResult(error=f"admission rejected: {hostile}")
    summary = result.summary()
    assert summary is not None and summary.startswith("admission rejected: /tmp/a b [2J")
    assert len(summary.encode()) <= reploy.wire.MAX_SAFE_TEXT_BYTES
    assert summary.isprintable() and "\n" not in summary
    undecodable = reploy.RunResult(error=os.fsdecode(b"plan rejected: /w-\xff"))
    assert undecodable.summary() == "plan rejected: /w-\\xff"


def test_os_errors_read_as_words_with_their_path() -> None:
    error = PermissionError(13, "Permission denied", "/srv/out")
    assert reploy.error_text(error) == "Permission denied: /srv/out"
    assert reploy.error_text(OSError(2, "No such file or directory")) == \
        "No such file or directory"
    assert reploy.error_text(ValueError("bad")) == "bad"


@pytest.mark.parametrize("ok, signum, code", [
    (True, None, 0), (True, 15, 0), (False, None, 1), (False, 2, 130), (False, 15, 143)])
def test_the_exit_code_follows_ok_and_the_first_signal(ok: bool, signum: int | None,
                                                       code: int) -> None:
    result = clean_result() if ok else clean_result(result_acknowledged=False)
    assert reploy.exit_code(result, signum) == code


# ---------------------------------------------------------------------------------------------
# Containers run exactly the command Reploy chose
# ---------------------------------------------------------------------------------------------


def test_the_command_is_the_whole_entrypoint_and_the_image_adds_nothing() -> None:
    import docker

    api = docker.APIClient(base_url="unix:///nonexistent.sock", version="1.41")  # no calls made
    spec = reploy.ContainerSpec(
        role="workload", image_id="sha256:" + "0" * 64, command=("/bin/sh",),
        runtime=reploy.Runtime(uid=1000, gid=1000, writable_paths=(), memory_mib=64, pids=64),
        environment={}, labels={})
    kwargs = spec.create_kwargs(api)
    assert kwargs["entrypoint"] == ["/bin/sh"] and kwargs["command"] == []
    assert kwargs["healthcheck"] == {"Test": ["NONE"]}


# ---------------------------------------------------------------------------------------------
# The engine and the probe: refused, with a reason, unless the sandbox is really there
# ---------------------------------------------------------------------------------------------

LINUX_ENGINE = {"OSType": "linux", "SecurityOptions": ["name=seccomp,profile=default"]}


@pytest.mark.parametrize("info, local, platform, reason", [
    (LINUX_ENGINE, True, "darwin", "the host runs darwin, not Linux"),
    (LINUX_ENGINE, False, "linux", "not reached through a local unix socket"),
    ({**LINUX_ENGINE, "OSType": "windows"}, True, "linux", "runs windows containers"),
    ({"OSType": "linux", "SecurityOptions": ["name=apparmor", "name=rootless"]}, True, "linux",
     "it has no seccomp support"),
    ({"OSType": "linux", "SecurityOptions": []}, True, "linux", "it has no seccomp support"),
    ({"OSType": "linux", "SecurityOptions": ["name=seccomp,profile=unconfined"]}, True,
     "linux", "its default seccomp profile is unconfined"),
    ({"OSType": "linux", "SecurityOptions": ["name=seccomp,profile=unconfined",
                                             "name=rootless"]}, True, "linux", "unconfined"),
])
def test_an_engine_that_cannot_hold_the_sandbox_is_refused(info: dict, local: bool,
                                                           platform: str, reason: str) -> None:
    refusal = reploy.sandbox_refusal(info, local, platform)
    assert refusal is not None and reason in refusal


@pytest.mark.parametrize("options", [
    ["name=seccomp,profile=default"], ["name=seccomp,profile=default", "name=rootless"],
    ["name=seccomp,profile=/etc/docker/seccomp.json"], ["seccomp"],  # an old engine's form
])
def test_an_engine_with_a_seccomp_profile_is_accepted(options: list[str]) -> None:
    assert reploy.sandbox_refusal({"OSType": "linux", "SecurityOptions": options}, True,
                                  "linux") is None


RUNTIME = reploy.Runtime(uid=1000, gid=1000, writable_paths=(), memory_mib=64, pids=64)
PROBE_STATUS = {"Seccomp": "2", "NoNewPrivs": "1", "CapInh": "0" * 16, "CapPrm": "0" * 16,
                "CapEff": "0" * 16, "CapBnd": "0" * 16, "CapAmb": "0" * 16}


def probe_report(**changes: object) -> bytes:
    import json

    obj = {"version": reploy.__version__, "uid": 1000, "gid": 1000, "status": PROBE_STATUS}
    obj.update(changes)
    return json.dumps(obj).encode() + b"\n"


def test_a_probe_that_shows_the_sandbox_asked_for_passes() -> None:
    assert reploy.probe_refusal(0, probe_report(), b"", RUNTIME) is None


@pytest.mark.parametrize("code, report, errors, reason", [
    (127, b"", b"env: 'python3': No such file or directory\n",
     "exited with code 127: env: 'python3': No such file or directory"),
    (1, b"", b"Traceback...\nSyntaxError: invalid syntax\n", "SyntaxError: invalid syntax"),
    (0, b"", b"", "its report is unreadable"),
    (0, b"reploy-session-client 0.1.0\n", b"", "its report is unreadable"),
    (0, probe_report(version="0.0.9"), b"", "version '0.0.9'"),
    (0, probe_report(uid=0), b"", "runs as 0:1000, not as 1000:1000"),
    (0, probe_report(status={**PROBE_STATUS, "Seccomp": "0"}), b"", "Seccomp is '0', not '2'"),
    (0, probe_report(status={k: v for k, v in PROBE_STATUS.items() if k != "Seccomp"}), b"",
     "Seccomp is 'missing'"),
    (0, probe_report(status={**PROBE_STATUS, "NoNewPrivs": "0"}), b"", "NoNewPrivs is '0'"),
    (0, probe_report(status={**PROBE_STATUS, "CapBnd": "00000000a80425fb"}), b"",
     "CapBnd is '00000000a80425fb'"),
    (0, probe_report(status=[]), b"", "Seccomp is 'missing'"),
])
def test_the_probe_fails_closed(code: int, report: bytes, errors: bytes, reason: str) -> None:
    refusal = reploy.probe_refusal(code, report, errors, RUNTIME)
    assert refusal is not None and reason in refusal, refusal
    if code:
        assert refusal.startswith(reploy.CLIENT_NEEDS)


@pytest.mark.parametrize("owner, mode, writable", [
    ((1000, 1000), 0o700, True), ((1000, 5), 0o500, False), ((0, 1000), 0o770, True),
    ((0, 1000), 0o750, False), ((0, 0), 0o777, True), ((0, 0), 0o755, False),
    ((0, 0), 0o1777, True), ((1000, 0), 0o077, False),  # the owner's bits apply to the owner
])
def test_writable_by_reads_the_class_that_applies(owner: tuple[int, int], mode: int,
                                                  writable: bool) -> None:
    st = os.stat_result((mode | 0o40000, 0, 0, 2, owner[0], owner[1], 0, 0, 0, 0))
    assert reploy.writable_by(st, 1000, 1000) is writable


def test_a_root_supervisor_keeps_only_setuid_setgid_setpcap_and_kill() -> None:
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
    assert sorted(supervised["host_config"]["CapAdd"]) == ["KILL", "SETGID", "SETPCAP", "SETUID"]
    assert "CapAdd" not in plain["host_config"]
    for kwargs in (supervised, plain):
        host = kwargs["host_config"]
        assert host["CapDrop"] == ["ALL"] and host["ReadonlyRootfs"] is True
        assert host["SecurityOpt"] == ["no-new-privileges:true"]
        assert "uid=1000,gid=1000" in host["Tmpfs"][reploy.CONTAINER_HOME] and "uid=1000" in host["Tmpfs"]["/tmp"]


def installed_client(root: Path) -> Path:
    """The derived layer's files written under `root` as the layer installs them under
    CLIENT_PREFIX; the client module's directory."""
    for path, data, mode in reploy.derived_layer_files():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        target.chmod(mode)
    return root / reploy.CLIENT_MODULE_DIR.removeprefix(f"{reploy.CLIENT_PREFIX}/")


def bytecode_path(module_dir: Path) -> Path:
    """Where this interpreter looks for the client's bytecode."""
    return module_dir / "__pycache__" / f"reploy_session_client.{sys.implementation.cache_tag}.pyc"


def import_verbosely(module_dir: Path) -> str:
    """What `python3 -v` says while importing the client from `module_dir` (stderr)."""
    proc = subprocess.run(
        [sys.executable, "-v", "-c", f"import sys; sys.path.insert(0, {str(module_dir)!r}); "
         "import reploy_session_client"],
        capture_output=True, timeout=30, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr.decode(errors="replace")


def test_the_derived_layer_installs_a_launcher_the_client_and_its_bytecode(
        tmp_path: Path) -> None:
    """An interpreter of this version imports the client from the layer's bytecode, the
    client's source beside it unchanged, so the broker and `attach` compile nothing."""
    module_dir = installed_client(tmp_path)
    launcher = (tmp_path / "bin/reploy-session-client").read_text()
    assert launcher.startswith("#!/usr/bin/env python3\n")
    assert f"sys.path[0] = {reploy.CLIENT_MODULE_DIR!r}" in launcher
    assert (module_dir / "reploy_session_client.py").read_bytes() == \
        reploy.CLIENT_SOURCE.read_bytes()
    assert f"code object from '{bytecode_path(module_dir)}'" in import_verbosely(module_dir)


def test_the_layers_bytecode_is_refused_for_any_other_source(tmp_path: Path) -> None:
    """Checked against the source's hash: a client changed after the build is compiled from
    its source, never run from bytecode of another."""
    module_dir = installed_client(tmp_path)
    source = module_dir / "reploy_session_client.py"
    source.write_bytes(source.read_bytes() + b"\n# changed\n")
    said = import_verbosely(module_dir)
    assert f"code object from '{bytecode_path(module_dir)}'" not in said
    assert f"code object from {source}\n" in said  # compiled from the source
