"""The conformance matrix on the real engine: every termination cause, every startup-failure
variant and every plan rejection this suite can reach, each checked as a strict outside
consumer checks it.

The controller is tests/controllers/strict_consumer.py, which speaks only the public stream
and keeps every event line exactly as it arrived. For each run the test checks, with its own
reading of the contract (tests/contract_rules.py, independent of reploy_session_client.py):
the printed host result, every recorded event line, the order of the stream, and that the
recorded `terminated` carries the printed session result. Nothing may be left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest

import contract_rules as rules
from conftest import LABEL_RUN, ROOT, stage_and_build
from test_cli import GOLDEN_PLAN_REJECTED
from test_controlled_session_failures import CONTROLLER_UID_GID, MOMENT_TIMEOUT_S, HostRun

pytestmark = pytest.mark.docker

LABEL_ROLE = "io.reploy.session.role"
LABEL_WATCHDOG = "io.reploy.session.watchdog"

CONSUMER_BLUEPRINT = """\
name: strict-consumer{suffix}
build:
  context: context
environment:
  runtime:
    user: "1000:1000"
  executables:
    consumer.main:
      argv: [{interpreter}, /opt/controller/strict_consumer.py]
  commands:
    consume:
      executable: consumer.main
      native_command: true
      trigger: [consume]
"""

#: A python3 that takes a few seconds to start: planning's python probe stays observable.
SLOW_PYTHON = "#!/bin/sh\nsleep 4\nexec /usr/bin/python3 \"$@\"\n"


def build_controller(base: Path, name: str, dockerfile: str, interpreter: str = "python3",
                     extra_files: Optional[dict[str, str]] = None) -> Path:
    source = base / f"{name}-source"
    (source / "context").mkdir(parents=True)
    shutil.copy(ROOT / "tests/controllers/strict_consumer.py", source / "context")
    for file_name, text in (extra_files or {}).items():
        (source / "context" / file_name).write_text(text)
    (source / "context/Dockerfile").write_text(dockerfile)
    (source / "controller.blueprint.yaml").write_text(
        CONSUMER_BLUEPRINT.format(suffix=f"-{name}", interpreter=interpreter))
    stage_and_build(source / "controller.blueprint.yaml", base / name)
    return base / name


@pytest.fixture(scope="session")
def matrix(deployments: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Path]:
    """The strict consumer and the variants the matrix needs, staged and built once."""
    base = tmp_path_factory.mktemp("matrix")
    consumer = ("FROM reploy-base/python:bookworm-1\n"
                "COPY strict_consumer.py /opt/controller/\n")
    shell_less = base / "shell-less-source"
    (shell_less / "context").mkdir(parents=True)
    (shell_less / "context/marker").write_text("no shell here\n")
    (shell_less / "context/Dockerfile").write_text("FROM scratch\nCOPY marker /marker\n")
    (shell_less / "workload.blueprint.yaml").write_text(
        "name: shell-less\nbuild:\n  context: context\nenvironment:\n"
        "  runtime:\n    user: \"1000:1000\"\n")
    stage_and_build(shell_less / "workload.blueprint.yaml", base / "shell-less")
    return {
        "consumer": build_controller(base, "consumer", consumer),
        "bad-interpreter": build_controller(base, "bad-interpreter", consumer,
                                            interpreter="/no/such/interpreter"),
        "no-python": build_controller(base, "no-python", "FROM reploy-base/busybox:1\n"
                                      "COPY strict_consumer.py /opt/controller/\n"),
        "workload": deployments["workload"],
        "shell-less": base / "shell-less",
    }


class Run(HostRun):
    """`reploy.py controlled-session run` with the strict consumer, as a user runs it; the
    moments and the manifest as for the scenario controller's HostRun."""

    def __init__(self, controller: Path, workload: Path, out: Path, mode: str, *extra: str
                 ) -> None:
        if not out.exists():  # made the controller's to write: Reploy never re-owns it
            out.mkdir(parents=True)
            os.chown(out, *CONTROLLER_UID_GID)
        self.out = out
        self.workload = workload
        for name in ("to-test", "from-test"):
            os.mkfifo(out / name)
            os.chmod(out / name, 0o666)
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "reploy.py"), "controlled-session", "run",
             "--controller-dir", str(controller), "--workload-dir", str(workload),
             "--output-dir", str(out), *extra, "--", "consume", *mode.split()],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def run_id(self) -> str:
        return self.manifest().run_id

    def finish(self) -> tuple[int, dict[str, Any], str]:
        """Exit code, the result (checked), stderr."""
        stdout, stderr = self.proc.communicate(timeout=240)
        assert stdout.count(b"\n") == 1 and stdout.endswith(b"\n"), (stdout, stderr[-3000:])
        result = rules.check_reploy_result_line(stdout)
        return self.proc.returncode, result, stderr.decode()

    def events(self) -> list[dict[str, Any]]:
        """The consumer's raw event lines, each checked, and their order checked."""
        path = self.out / "events.jsonl"
        events = [rules.check_event_line(line) for line in path.read_bytes().splitlines(True)]
        rules.check_event_sequence(events)
        return events

    def consumer(self) -> dict[str, Any]:
        return json.loads((self.out / "consumer.json").read_text())


@pytest.fixture
def runs() -> Any:
    started: list[Run] = []
    yield started
    for run in started:
        run.kill()


def start(runs: list[Run], *args: Any) -> Run:
    run = Run(*args)
    runs.append(run)
    return run


def assert_terminated_is_the_result(events: list[dict[str, Any]], result: dict[str, Any]) -> None:
    [terminated] = [e for e in events if e["type"] == "terminated"]
    assert terminated["result"] == result["session_result"]
    assert result["result_delivered"] is True


def assert_nothing_left(engine: Any, workload: Path, run_id: str) -> None:
    assert not engine.containers.list(all=True, filters={"label": f"{LABEL_RUN}={run_id}"})
    assert not engine.networks.list(filters={"label": f"{LABEL_RUN}={run_id}"})
    assert not (workload / ".reploy/sessions" / run_id).exists()
    assert not (workload / ".reploy/watchdog" / f"{run_id}.json").exists()


# ---------------------------------------------------------------------------------------------
# Termination causes that reach ready
# ---------------------------------------------------------------------------------------------

#: mode, extra options, cause, exit code, result_acknowledged
ENDINGS = {
    "workload exits 0": ("exit 0", (), "workload-exit", 0, True),
    "workload exits 3": ("exit 3", (), "workload-exit", 1, True),
    "controller terminates": ("terminate", ("--termination-grace", "100ms"),
                              "controller-terminate", 0, True),
    "no complete": ("no-complete", ("--controller-finalization-timeout", "1s"),
                    "workload-exit", 1, True),
}


@pytest.mark.parametrize("mode, extra, cause, code, acknowledged", ENDINGS.values(),
                         ids=ENDINGS.keys())
def test_ending(docker_engine: Any, matrix: dict[str, Path], tmp_path: Path, runs: list[Run],
                mode: str, extra: tuple[str, ...], cause: str, code: int,
                acknowledged: bool) -> None:
    run = start(runs, matrix["consumer"], matrix["workload"], tmp_path / "out", mode, *extra)
    exit_code, result, stderr = run.finish()
    events = run.events()
    assert result["session_result"]["cause"] == cause
    assert_terminated_is_the_result(events, result)
    assert result["result_acknowledged"] is acknowledged
    assert exit_code == code and result["ok"] is (code == 0)
    assert "could not kill" not in stderr  # an exit during the grace is no failure
    if mode == "no-complete":
        assert result["session_result"]["controller_finalization_status"]["kind"] == \
            "finalization-timeout"
        assert result["error"].startswith("controller finalization finalization-timeout: ")
    if mode == "exit 3":
        assert result["error"] == "the workload exited with code 3"


@pytest.mark.parametrize("mode", ["early-complete", "die"])
def test_controller_lost(docker_engine: Any, matrix: dict[str, Path], tmp_path: Path,
                         runs: list[Run], mode: str) -> None:
    """A controller that breaks the stream (complete before termination: the client fails it)
    or dies: controller-lost, with controller finalization `lost`."""
    run = start(runs, matrix["consumer"], matrix["workload"], tmp_path / "out", mode,
                "--termination-grace", "100ms")
    exit_code, result, _ = run.finish()
    session = result["session_result"]
    assert exit_code == 1 and session["cause"] == "controller-lost"
    assert session["controller_finalization_status"]["kind"] == "lost"
    assert result["result_delivered"] is False and result["result_acknowledged"] is False
    if mode == "early-complete":
        events = run.events()
        assert events[-1]["type"] == "client-error" and events[-1]["code"] == "premature_request"
        assert run.consumer()["client_exit"] == 1
    else:
        assert result["controller_status"] == {"kind": "exited", "code": 3}


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_host_cancel(docker_engine: Any, matrix: dict[str, Path], tmp_path: Path,
                     runs: list[Run], signum: int, code: int) -> None:
    run = start(runs, matrix["consumer"], matrix["workload"], tmp_path / "out", "hold",
                "--termination-grace", "100ms")
    run.wait_moment("active")
    run_id = run.run_id()
    run.proc.send_signal(signum)
    exit_code, result, _ = run.finish()
    assert exit_code == code and result["ok"] is False
    assert result["error"] == f"cancelled by {signal.Signals(signum).name}"
    assert result["session_result"]["cause"] == "host-cancel"
    assert_terminated_is_the_result(run.events(), result)
    assert result["result_acknowledged"] is True
    assert_nothing_left(docker_engine, matrix["workload"], run_id)


def test_runtime_observation_lost(docker_engine: Any, matrix: dict[str, Path], tmp_path: Path,
                                  runs: list[Run]) -> None:
    run = start(runs, matrix["consumer"], matrix["workload"], tmp_path / "out", "hold")
    run.wait_moment("active")
    run_id = run.run_id()
    [workload] = docker_engine.api.containers(filters={"label": [
        f"{LABEL_RUN}={run_id}", f"{LABEL_ROLE}=workload"]})
    docker_engine.api.remove_container(workload["Id"], force=True)
    exit_code, result, stderr = run.finish()
    session = result["session_result"]
    assert session is not None, (result, stderr)
    assert exit_code == 1 and session["cause"] == "runtime-observation-lost"
    assert session["workload_status"]["kind"] == "unavailable"
    assert session["workload_output_finalization_status"]["kind"] == "failed"
    assert_terminated_is_the_result(run.events(), result)
    assert_nothing_left(docker_engine, matrix["workload"], run_id)


def test_output_finalization_fails_while_the_host_is_suspended(
        docker_engine: Any, matrix: dict[str, Path], tmp_path: Path, runs: list[Run]) -> None:
    """Upstream's own host test: the workload traps SIGTERM and sleeps 5 s on it; after
    terminate/terminating the host is stopped (SIGSTOP) past the 30 s output deadline, then
    resumed. Finalization fails with a reason, attach exits 1, and every workload fact comes
    before workload-outputs-finalized: after `complete`, the next event is `terminated`."""
    run = start(runs, matrix["consumer"], matrix["workload"], tmp_path / "out", "trap-term")
    run.wait_moment("terminating")
    run.proc.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        # Not a synchronisation sleep: the scenario is the host being away past the deadline.
        time.sleep(31)
    finally:
        run.proc.send_signal(signal.SIGCONT)
    assert time.monotonic() - stopped_at > 30
    exit_code, result, _ = run.finish()
    events = run.events()  # the order check refuses anything but terminated after finalized
    finalized = next(e for e in events if e["type"] == "workload-outputs-finalized")
    assert finalized["status"] == "failed" and "30 s" in finalized["reason"]
    types = [e["type"] for e in events]
    assert types[types.index("workload-outputs-finalized") + 1] == "terminated"
    assert "workload-exit" in types[:types.index("workload-outputs-finalized")]
    consumer = run.consumer()
    assert consumer["sequence_errors"] == [] and consumer["attach_exit"] == 1
    assert consumer["client_exit"] == 0
    assert_terminated_is_the_result(events, result)
    assert result["session_result"]["cause"] == "controller-terminate"
    assert exit_code == 1 and result["ok"] is False


# ---------------------------------------------------------------------------------------------
# Startup failures
# ---------------------------------------------------------------------------------------------


def assert_startup_failure(result: dict[str, Any]) -> dict[str, Any]:
    session = result["session_result"]
    assert session["cause"] == "startup-failure"
    assert session["controller_finalization_status"]["kind"] == "startup-failed"
    assert result["error"].startswith("startup failed: ")
    return session


def test_startup_failure_without_an_attachment(docker_engine: Any, matrix: dict[str, Path],
                                               tmp_path: Path, runs: list[Run]) -> None:
    run = start(runs, matrix["consumer"], matrix["workload"], tmp_path / "out", "no-attach")
    exit_code, result, _ = run.finish()
    session = assert_startup_failure(result)
    assert session["workload_status"] == {"kind": "unavailable",
                                          "reason": "the workload never started"}
    events = run.events()
    assert [e["type"] for e in events] == ["broker-ready", "opened", "client-error"]
    assert events[-1]["code"] == "attach_timeout"
    assert result["result_delivered"] is False and exit_code == 1


def test_startup_failure_when_the_workload_cannot_start(docker_engine: Any,
                                                        matrix: dict[str, Path],
                                                        tmp_path: Path, runs: list[Run]) -> None:
    """A workload image without /bin/sh: the controller is attached, gets a startup-failure
    `terminated` right after `opened`, and acknowledges it."""
    run = start(runs, matrix["consumer"], matrix["shell-less"], tmp_path / "out", "exit 0")
    exit_code, result, _ = run.finish()
    session = assert_startup_failure(result)
    assert session["workload_status"]["kind"] == "unavailable"
    events = run.events()
    assert [e["type"] for e in events][:3] == ["broker-ready", "opened", "terminated"]
    assert_terminated_is_the_result(events, result)
    assert result["result_acknowledged"] is True and exit_code == 1


def test_startup_failure_when_the_controller_command_cannot_start(
        docker_engine: Any, matrix: dict[str, Path], tmp_path: Path, runs: list[Run]) -> None:
    run = start(runs, matrix["bad-interpreter"], matrix["workload"], tmp_path / "out", "exit 0")
    exit_code, result, _ = run.finish()
    assert_startup_failure(result)
    assert "no/such/interpreter" in result["error"]
    assert result["result_delivered"] is False and exit_code == 1


def test_startup_failure_when_the_startup_timeout_expires(
        docker_engine: Any, matrix: dict[str, Path], tmp_path: Path, runs: list[Run]) -> None:
    run = start(runs, matrix["consumer"], matrix["workload"], tmp_path / "out", "stall",
                "--startup-timeout", "15s", "--cleanup-timeout", "2s")
    exit_code, result, _ = run.finish()
    assert_startup_failure(result)
    assert "within the startup timeout" in result["error"]
    assert result["controller_status"] == {"kind": "exited", "code": 137}
    assert exit_code == 1


def test_startup_failure_when_the_controller_exits_first(
        docker_engine: Any, matrix: dict[str, Path], tmp_path: Path, runs: list[Run]) -> None:
    run = start(runs, matrix["consumer"], matrix["workload"], tmp_path / "out", "exit-early")
    exit_code, result, _ = run.finish()
    assert_startup_failure(result)
    assert result["controller_status"] == {"kind": "exited", "code": 5}
    assert "exited with code 5" in result["error"] and exit_code == 1


def test_startup_failure_when_the_output_directory_cannot_be_created(
        docker_engine: Any, matrix: dict[str, Path], tmp_path: Path) -> None:
    """Its nearest existing path is a directory (admission passes), but mkdir fails at
    preparation: the requested output is reported `failed` with its reason, never null."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "reploy.py"), "controlled-session", "run",
         "--controller-dir", str(matrix["consumer"]), "--workload-dir", str(matrix["workload"]),
         "--output-dir", f"/proc/reploy-no-such-dir-{tmp_path.name}", "--", "consume", "exit 0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=240)
    result = rules.check_reploy_result_line(proc.stdout)
    assert_startup_failure(result)
    output = result["controller_output"]
    assert output["kind"] == "failed" and "output directory" in output["reason"], output
    assert proc.returncode == 1 and result["ok"] is False


# ---------------------------------------------------------------------------------------------
# Plan rejections: nothing of the session ran
# ---------------------------------------------------------------------------------------------



def assert_plan_rejected(result: dict[str, Any], output: str = "directory-retained") -> None:
    assert result["error"].startswith("plan rejected: ")
    assert {**result, "error": None, "controller_output": None} == {
        **GOLDEN_PLAN_REJECTED, "error": None, "controller_output": None}
    assert result["controller_output"]["kind"] == output


def test_plan_rejected_without_python3(docker_engine: Any, matrix: dict[str, Path],
                                       tmp_path: Path, runs: list[Run]) -> None:
    run = start(runs, matrix["no-python"], matrix["workload"], tmp_path / "out", "exit 0")
    exit_code, result, _ = run.finish()
    assert_plan_rejected(result)
    assert "must provide python3" in result["error"] and exit_code == 1
    assert not list((matrix["workload"] / ".reploy/watchdog").glob("*.json"))


def test_plan_rejected_when_an_image_is_gone(docker_engine: Any, matrix: dict[str, Path],
                                             tmp_path: Path, runs: list[Run]) -> None:
    unique = ("FROM reploy-base/python:bookworm-1\n"
              f"LABEL io.reploy.test.unique={tmp_path.name}\n"
              "COPY strict_consumer.py /opt/controller/\n")
    controller = build_controller(tmp_path, "gone", unique)
    image_id = json.loads((controller / ".reploy/state.json").read_text())[
        "current_generation"]["image_id"]
    docker_engine.api.remove_image(image_id, force=True)
    run = start(runs, controller, matrix["workload"], tmp_path / "out", "exit 0")
    exit_code, result, _ = run.finish()
    assert_plan_rejected(result)
    assert f"the controller image {image_id} is gone" in result["error"] and exit_code == 1


# ---------------------------------------------------------------------------------------------
# Planning: the watchdog comes first, and a signal cancels promptly
# ---------------------------------------------------------------------------------------------


def wait_for_probe(engine: Any, workload: Path) -> tuple[str, dict[str, Any]]:
    """The run's python probe container while it runs, once the watchdog's manifest lists it
    (the host records a container right after the Engine names it)."""
    deadline = time.monotonic() + MOMENT_TIMEOUT_S
    while time.monotonic() < deadline:  # polling for a condition, with a deadline
        manifests = list((workload / ".reploy/watchdog").glob("*.json"))
        if manifests:
            [path] = manifests
            probes = engine.api.containers(all=True, filters={"label": [
                f"{LABEL_RUN}={path.stem}", f"{LABEL_ROLE}=python-probe"]})
            manifest = json.loads(path.read_text())
            if probes and probes[0]["Id"] in manifest["containers"]:
                return probes[0]["Id"], manifest
        time.sleep(0.05)
    raise AssertionError("no python probe container appeared in the manifest")


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_planning_cancels_the_probe(
        docker_engine: Any, matrix: dict[str, Path], tmp_path: Path, runs: list[Run],
        signum: int, code: int) -> None:
    """A new controller generation: the host builds the derived image and probes it for
    python3 (here a python3 that takes seconds to start). The watchdog is armed before the
    probe container exists, and the probe is labelled and listed in its manifest; a signal
    then cancels at once: 130/143, nothing ran, nothing is left."""
    controller = build_controller(
        tmp_path, "slow-python",
        "FROM reploy-base/python:bookworm-1\nCOPY strict_consumer.py /opt/controller/\n"
        "COPY python3 /usr/local/bin/python3\nRUN chmod 755 /usr/local/bin/python3\n"
        f"LABEL io.reploy.test.unique={tmp_path.name}\n",
        extra_files={"python3": SLOW_PYTHON})
    run = start(runs, controller, matrix["workload"], tmp_path / "out", "exit 0")
    probe_id, manifest = wait_for_probe(docker_engine, matrix["workload"])
    labels = docker_engine.api.inspect_container(probe_id)["Config"]["Labels"]
    assert labels[LABEL_RUN] == manifest["run_id"]
    # The probe was created labelled with the watchdog that was already running then.
    assert manifest["watchdog"] and labels[LABEL_WATCHDOG] == manifest["watchdog"]
    assert manifest["containers"][probe_id].items() <= labels.items()  # (+ the image's own)
    run.proc.send_signal(signum)
    exit_code, result, _ = run.finish()
    assert exit_code == code and result["ok"] is False
    assert result["error"] == f"cancelled by {signal.Signals(signum).name}"
    assert result["session_result"] is None
    assert result["controller_output"] == {"kind": "directory-retained"}
    assert_nothing_left(docker_engine, matrix["workload"], manifest["run_id"])


# ---------------------------------------------------------------------------------------------
# The workload PTY's size
# ---------------------------------------------------------------------------------------------


def test_the_pty_has_the_requested_size_before_the_first_command(
        docker_engine: Any, matrix: dict[str, Path], tmp_path: Path, runs: list[Run]) -> None:
    run = start(runs, matrix["consumer"], matrix["workload"], tmp_path / "out", "size",
                "--columns", "123", "--rows", "45")
    exit_code, result, _ = run.finish()
    assert exit_code == 0, result
    assert run.consumer()["first_size"] == "45 123"
