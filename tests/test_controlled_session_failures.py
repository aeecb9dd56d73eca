"""Controlled sessions when things go wrong, on the real engine: every termination cause,
the timeouts, host signals, abrupt host death and the watchdog, controller outputs, endpoint
grants, the sandbox and hostile terminal output."""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Optional

import psutil
import pytest

import contract_rules
import reploy_watchdog
from conftest import (
    LABEL_RUN, ROOT, WATCHDOG_DIR_ENV, run_reploy, stage_and_build, wait_watchdog_exit,
)
from reploy import CHANNEL_SOCKET_NAME, LABEL_ROLE

pytestmark = pytest.mark.docker

MOMENT_TIMEOUT_S = 60
#: A dead host's receipt comes within seconds; this bound only keeps a broken run finite.
RECEIPT_TIMEOUT_S = 60
RECEIPT_FIELDS = {"schema", "run_id", "time", "trigger", "host", "removed",
                  "cleanup_succeeded", "errors"}
GRANT = ("--endpoint", "web")
#: The runtime uid:gid of the test controllers (conftest.CONTROLLER_BLUEPRINT).
CONTROLLER_UID_GID = (1000, 1000)


class HostRun:
    """`reploy.py controlled-session run` as a child process the test can meet mid-session.

    The scenario controller names moments through the `to-test` FIFO in the output dir and
    waits on `from-test`; both are created here before the run starts.
    """

    def __init__(self, deployments: dict[str, Path], out: Path, scenario: str,
                 *extra: str, env: Optional[dict[str, str]] = None,
                 output_option: str = "--output-dir", output_path: Optional[Path] = None) -> None:
        out.mkdir(parents=True, exist_ok=True)
        os.chown(out, *CONTROLLER_UID_GID)  # the controller's to write: Reploy never re-owns it
        self.out = out
        self.workload = deployments["workload"]
        for name in ("to-test", "from-test"):
            os.mkfifo(out / name)
            os.chmod(out / name, 0o666)
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "reploy.py"), "controlled-session", "run",
             "--controller-dir", str(deployments["controller"]),
             "--workload-dir", str(self.workload),
             output_option, str(output_path or out), *extra, "--", "run-scenario", scenario],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})

    def wait_moment(self, expected: str) -> None:
        fd = os.open(self.out / "to-test", os.O_RDONLY | os.O_NONBLOCK)
        try:
            data = b""
            while not data.endswith(b"\n"):
                ready, _, _ = select.select([fd], [], [], MOMENT_TIMEOUT_S)
                if not ready:
                    raise AssertionError(f"the controller never reached {expected!r}: "
                                         + self.stderr_tail())
                chunk = os.read(fd, 100)
                if not chunk and self.proc.poll() is not None:
                    raise AssertionError(f"the host ended before {expected!r}: "
                                         + self.stderr_tail())
                data += chunk
        finally:
            os.close(fd)
        assert data.decode().strip() == expected

    def answer(self, line: str = "go") -> None:
        with open(self.out / "from-test", "w") as fifo:
            fifo.write(line + "\n")

    def manifest(self) -> reploy_watchdog.Manifest:
        """This host's manifest (sessions running at once share the workload's directory)."""
        manifests = [m for m in map(reploy_watchdog.Manifest.load,
                                    (self.workload / ".reploy/watchdog").glob("*.json"))
                     if m.host.partition(":")[0] == str(self.proc.pid)]
        assert len(manifests) == 1, manifests
        return manifests[0]

    def containers(self) -> dict[str, str]:
        """The session's containers, role -> id, as its manifest names them."""
        return {labels["io.reploy.session.role"]: container_id
                for container_id, labels in self.manifest().containers.items()}

    def finish(self) -> tuple[int, dict[str, Any], str]:
        stdout, stderr = self.proc.communicate(timeout=180)
        text = stdout.decode()
        assert text.count("\n") == 1 and text.endswith("\n"), (text, stderr.decode()[-3000:])
        return self.proc.returncode, contract_rules.check_reploy_result_line(stdout), \
            stderr.decode()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()

    def stderr_tail(self) -> str:
        """What the host said (its result, then its stderr), once it is killed or ended."""
        if self.proc.poll() is None:
            self.proc.kill()
        stdout, stderr = self.proc.communicate()
        return stdout.decode()[-1000:] + stderr.decode()[-3000:]

    def report(self) -> dict[str, Any]:
        return json.loads((self.out / "report.json").read_text())


@pytest.fixture
def host_runs() -> Any:
    runs: list[HostRun] = []
    yield runs
    for run in runs:
        run.kill()


def start(host_runs: list[HostRun], *args: Any, **kwargs: Any) -> HostRun:
    run = HostRun(*args, **kwargs)
    host_runs.append(run)
    return run


def run_to_end(deployments: dict[str, Path], out: Path, scenario: str, *extra: str,
               variant: str = "regular") -> tuple[int, dict[str, Any], dict[str, Any]]:
    proc = run_reploy("controlled-session", "run",
                      "--controller-dir", str(deployments["controller"]),
                      "--workload-dir", str(deployments["workload"]),
                      "--output-dir", str(out), *extra, "--", "run-scenario", scenario,
                      "--variant", variant)
    text = proc.stdout.decode()
    assert text.count("\n") == 1, (text, proc.stderr.decode()[-3000:])
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() \
        else {}
    return proc.returncode, contract_rules.check_reploy_result_line(proc.stdout), report


def session_roles(grant: tuple[str, ...]) -> set[str]:
    """The containers a session owns: a granted one adds the holder of its network namespace."""
    return {"controller", "workload"} | ({"holder"} if grant else set())


def assert_nothing_left(docker_engine: Any, deployments: dict[str, Path], run_id: str) -> None:
    assert not docker_engine.containers.list(all=True, filters={"label": f"{LABEL_RUN}={run_id}"})
    assert not docker_engine.networks.list(filters={"label": f"{LABEL_RUN}={run_id}"})
    assert not (deployments["workload"] / ".reploy/sessions" / run_id).exists()
    assert not (deployments["workload"] / ".reploy/watchdog" / f"{run_id}.json").exists()


# ---------------------------------------------------------------------------------------------
# Abrupt host death: the watchdog
# ---------------------------------------------------------------------------------------------


def watchdog_env(watchdog_dir: Path) -> dict[str, str]:
    """Hosts meeting the test's own watchdog, which the test may kill or watch exit."""
    return {WATCHDOG_DIR_ENV: str(watchdog_dir)}


def watchdog_of(manifest: reploy_watchdog.Manifest) -> psutil.Process:
    """The live watchdog a manifest names (its identity checked, so not a reused pid)."""
    assert reploy_watchdog.identity_alive(manifest.watchdog), manifest.watchdog
    return psutil.Process(int(manifest.watchdog.split(":")[0]))


def await_receipt(workload: Path, run_id: str) -> dict[str, Any]:
    """The run's incident receipt once the watchdog's cleanup is over (the receipt written,
    then the manifest dropped): within seconds of the death."""
    path = workload / ".reploy/incidents" / f"{run_id}.json"
    manifest = workload / ".reploy/watchdog" / f"{run_id}.json"
    deadline = time.monotonic() + RECEIPT_TIMEOUT_S
    while not path.exists() or manifest.exists():
        assert time.monotonic() < deadline, f"no receipt for {run_id}"
        time.sleep(0.05)  # polling for a condition, with a deadline
    assert path.stat().st_mode & 0o777 == 0o600
    receipt = json.loads(path.read_text())
    assert set(receipt) == RECEIPT_FIELDS and receipt["run_id"] == run_id
    return receipt


def assert_cleaned_up_after_death(docker_engine: Any, deployments: dict[str, Path],
                                  manifest: reploy_watchdog.Manifest,
                                  moment: str = "active") -> None:
    """The run's receipt says the watchdog removed what the manifest named, and nothing of
    the run remains; `moment` is the phase the host died in."""
    receipt = await_receipt(deployments["workload"], manifest.run_id)
    assert receipt["trigger"] == "host-exited", receipt
    assert receipt["cleanup_succeeded"] is True and receipt["errors"] == []
    # Once terminating, the host removes the workload while the controller finalizes: it
    # may be gone before the watchdog looks. Everything else is the watchdog's to remove.
    removed = set(receipt["removed"]["containers"])
    may_be_gone = {cid for cid, labels in manifest.containers.items()
                   if moment == "terminating" and labels[LABEL_ROLE] == "workload"}
    assert set(manifest.containers) - may_be_gone <= removed <= set(manifest.containers)
    assert str(deployments["workload"] / ".reploy/sessions" / manifest.run_id) in \
        receipt["removed"]["paths"]
    assert_nothing_left(docker_engine, deployments, manifest.run_id)


@pytest.mark.parametrize("scenario,moment,grant", [
    ("stall", "preparing", ()), ("hold", "active", ()), ("hold-terminating", "terminating", ()),
    ("stall", "preparing", GRANT), ("hold", "active", GRANT)])
def test_watchdog_cleans_up_after_host_sigkill(docker_engine: Any, deployments: dict[str, Path],
                                               tmp_path: Path, host_runs: list[HostRun],
                                               watchdog_dir: Path, scenario: str, moment: str,
                                               grant: tuple[str, ...]) -> None:
    run = start(host_runs, deployments, tmp_path / "out", scenario, *grant,
                env=watchdog_env(watchdog_dir))
    run.wait_moment(moment)
    manifest = run.manifest()
    assert set(run.containers()) == session_roles(grant)
    watchdog = watchdog_of(manifest)  # detached: a session of its own, not the host's child
    assert os.getsid(watchdog.pid) == watchdog.pid and watchdog.ppid() != run.proc.pid
    assert str(watchdog_dir) in watchdog.cmdline()
    run.proc.kill()
    run.proc.wait()
    assert_cleaned_up_after_death(docker_engine, deployments, manifest, moment)
    assert wait_watchdog_exit(watchdog_dir)  # it served this session only: it is gone too


@pytest.mark.parametrize("grant", [(), GRANT])
def test_cleanup_reconciles_when_host_and_watchdog_both_die(
        docker_engine: Any, deployments: dict[str, Path], tmp_path: Path,
        host_runs: list[HostRun], watchdog_dir: Path, grant: tuple[str, ...]) -> None:
    run = start(host_runs, deployments, tmp_path / "out", "hold", *grant,
                env=watchdog_env(watchdog_dir))
    run.wait_moment("active")
    manifest = run.manifest()
    assert set(run.containers()) == session_roles(grant)
    # Both die at once, as in a crash that takes the machine's processes: the watchdog is
    # stopped first, so it neither acts on the host's death nor leaves the host a link end
    # to re-arm on, then both are killed.
    watchdog = watchdog_of(manifest)
    watchdog.suspend()
    run.proc.kill()
    run.proc.wait()
    watchdog.kill()
    watchdog.wait(MOMENT_TIMEOUT_S)
    proc = run_reploy("controlled-session", "cleanup", "--workload-dir",
                      str(deployments["workload"]))
    result = json.loads(proc.stdout)
    assert proc.returncode == 0 and result["ok"] is True
    # The receipt is reconciliation's, not the watchdog's: this cleanup's, or (on a machine
    # where other Reploy runs share the engine) that of another reploy command that
    # reconciled the abandoned run first.
    [receipt] = [r for r in result["receipts"] if r["run_id"] == manifest.run_id] or [
        await_receipt(deployments["workload"], manifest.run_id)]
    assert receipt["trigger"] == "reconciled"
    assert sorted(receipt["removed"]["containers"]) == sorted(manifest.containers)
    assert_nothing_left(docker_engine, deployments, manifest.run_id)


@pytest.mark.parametrize("operation", ["build", "run"])
def test_the_next_build_or_run_reconciles_when_host_and_watchdog_both_die(
        docker_engine: Any, deployments: dict[str, Path], tmp_path: Path,
        host_runs: list[HostRun], watchdog_dir: Path, operation: str) -> None:
    """No `controlled-session cleanup` is needed: the next `build` of the workload, or the
    next run with it, reconciles the abandoned run before it does its own work, so when it
    returns the run's containers, channel directory and manifest are gone and its receipt
    says `reconciled`."""
    workload = deployments["workload"]
    run = start(host_runs, deployments, tmp_path / "out", "hold", env=watchdog_env(watchdog_dir))
    run.wait_moment("active")
    manifest = run.manifest()
    assert set(run.containers()) == session_roles(())
    watchdog = watchdog_of(manifest)  # both die, the watchdog unable to act (as above)
    watchdog.suspend()
    run.proc.kill()
    run.proc.wait()
    watchdog.kill()
    watchdog.wait(MOMENT_TIMEOUT_S)
    if operation == "build":
        proc = run_reploy("build", "--dir", str(workload))
        assert proc.returncode == 0 and json.loads(proc.stdout)["ok"] is True, proc.stderr
    else:
        code, result, _ = run_to_end(deployments, tmp_path / "next", "no-network")
        assert code == 0 and result["ok"] is True, result
    # Read at once, not awaited: the operation returned only after reconciling. (On a machine
    # where other Reploy runs share the engine, another reploy command may have been first:
    # every one reconciles what it finds abandoned, by label.)
    receipt = json.loads((workload / ".reploy/incidents" / f"{manifest.run_id}.json").read_text())
    assert receipt["trigger"] == "reconciled" and receipt["cleanup_succeeded"] is True, receipt
    assert sorted(receipt["removed"]["containers"]) == sorted(manifest.containers)
    assert str(workload / ".reploy/sessions" / manifest.run_id) in receipt["removed"]["paths"]
    assert_nothing_left(docker_engine, deployments, manifest.run_id)


def test_one_watchdog_guards_concurrent_sessions_and_cleans_up_only_the_dead(
        docker_engine: Any, deployments: dict[str, Path], tmp_path: Path,
        host_runs: list[HostRun], watchdog_dir: Path) -> None:
    """Five sessions at once, one watchdog: two hosts are killed at different phases
    (preparing, active); exactly their runs get receipts, the other three finish ok."""
    env = watchdog_env(watchdog_dir)
    plans = [("stall", "preparing"), ("hold", "active")] + [("hold-then-exit", "active")] * 3
    runs = [start(host_runs, deployments, tmp_path / f"out{i}", scenario, env=env)
            for i, (scenario, _) in enumerate(plans)]
    for run, (_, moment) in zip(runs, plans):
        run.wait_moment(moment)
    manifests = [run.manifest() for run in runs]
    assert len({m.watchdog for m in manifests}) == 1 and watchdog_of(manifests[0])
    for run in runs[:2]:
        run.proc.kill()
        run.proc.wait()
    for manifest in manifests[:2]:
        assert_cleaned_up_after_death(docker_engine, deployments, manifest)
    for run in runs[2:]:
        run.answer()
    for run, manifest in zip(runs[2:], manifests[2:]):
        code, result, _ = run.finish()
        assert code == 0 and result["ok"] is True, result
        assert_nothing_left(docker_engine, deployments, manifest.run_id)
    incidents = deployments["workload"] / ".reploy/incidents"
    ours = {m.run_id for m in manifests}
    assert {p.stem for p in incidents.glob("*.json")} & ours == {m.run_id for m in manifests[:2]}
    assert wait_watchdog_exit(watchdog_dir)  # the last session ended: so does the watchdog


@pytest.mark.parametrize("end", ["host-finishes", "host-killed"])
def test_a_watchdog_killed_mid_session_is_replaced(
        docker_engine: Any, deployments: dict[str, Path], tmp_path: Path,
        host_runs: list[HostRun], watchdog_dir: Path, end: str) -> None:
    """The host sees its watchdog's link end and re-arms a successor with its manifest; the
    successor guards the session from then on."""
    run = start(host_runs, deployments, tmp_path / "out", "hold-then-exit",
                env=watchdog_env(watchdog_dir))
    run.wait_moment("active")
    first = run.manifest()
    watchdog_of(first).kill()
    deadline = time.monotonic() + RECEIPT_TIMEOUT_S
    while (second := run.manifest()).watchdog in ("", first.watchdog):
        assert time.monotonic() < deadline, "the host never re-armed"
        time.sleep(0.05)  # polling for a condition, with a deadline
    assert watchdog_of(second) and second.containers == first.containers
    if end == "host-killed":
        run.proc.kill()
        run.proc.wait()
        assert_cleaned_up_after_death(docker_engine, deployments, second)
    else:
        run.answer()
        code, result, stderr = run.finish()
        assert code == 0 and result["ok"] is True, result
        assert "its successor now guards this session" in stderr
        assert_nothing_left(docker_engine, deployments, first.run_id)
        assert not (deployments["workload"] / ".reploy/incidents" / f"{first.run_id}.json").exists()
    assert wait_watchdog_exit(watchdog_dir)


def test_manifests_of_other_formats_are_left_alone(docker_engine: Any,
                                                   deployments: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """Reconciliation and sessions go on past manifests they cannot read, touching none."""
    manifests_dir = deployments["workload"] / ".reploy/watchdog"
    manifests_dir.mkdir(parents=True, exist_ok=True)
    junk = {f"{'e' * 31}{i}.json": body for i, body in enumerate(
        [b"{", b"[]", json.dumps({"schema": "reploy-watchdog-manifest-v9"}).encode(),
         json.dumps({"schema": reploy_watchdog.MANIFEST_SCHEMA, "run_id": 1}).encode()])}
    for name, body in junk.items():
        (manifests_dir / name).write_bytes(body)
    try:
        proc = run_reploy("controlled-session", "cleanup", "--workload-dir",
                          str(deployments["workload"]))
        assert proc.returncode == 0 and json.loads(proc.stdout)["ok"] is True, proc.stderr
        code, result, _ = run_to_end(deployments, tmp_path / "out", "exit-code")
        assert result["session_result"]["cause"] == "workload-exit", result
        assert all((manifests_dir / name).read_bytes() == body for name, body in junk.items())
    finally:
        for name in junk:
            (manifests_dir / name).unlink()


# ---------------------------------------------------------------------------------------------
# Termination causes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum,code,grant", [(signal.SIGINT, 130, ()), (signal.SIGTERM, 143, ()),
                                              (signal.SIGTERM, 143, GRANT)])
def test_host_signal_cancels_cleanly(docker_engine: Any, deployments: dict[str, Path],
                                     tmp_path: Path, host_runs: list[HostRun],
                                     signum: int, code: int, grant: tuple[str, ...]) -> None:
    run = start(host_runs, deployments, tmp_path / "out", "hold", *grant)
    run.wait_moment("active")
    run_id = run.manifest().run_id
    run.proc.send_signal(signum)
    exit_code, result, _ = run.finish()
    assert exit_code == code
    assert result["ok"] is False
    assert result["session_result"]["cause"] == "host-cancel"
    assert result["result_delivered"] is True and result["result_acknowledged"] is True
    assert result["error"] == f"cancelled by {signal.Signals(signum).name}"
    events = [e["type"] for e in run.report()["events"]]
    assert events[3:] == ["terminating", "workload-exit", "workload-outputs-finalized",
                          "terminated"]
    assert_nothing_left(docker_engine, deployments, run_id)


@pytest.mark.parametrize("scenario,grant", [("die", ()), ("close-stream", ()), ("die", GRANT)])
def test_controller_lost(docker_engine: Any, deployments: dict[str, Path], tmp_path: Path,
                         scenario: str, grant: tuple[str, ...]) -> None:
    code, result, report = run_to_end(deployments, tmp_path / "out", scenario,
                                      "--termination-grace", "100ms", *grant)
    session = result["session_result"]
    assert code == 1 and result["ok"] is False
    assert session["cause"] == "controller-lost"
    assert session["controller_finalization_status"]["kind"] == "lost"
    assert result["result_delivered"] is False
    assert result["error"].startswith(
        f"the controller was lost: {session['controller_finalization_status']['reason']}; ")
    assert "; the result was not delivered to the controller" in result["error"]
    if scenario == "die":
        assert result["controller_status"] == {"kind": "exited", "code": 3}
    else:
        assert report["client_exit"] == 1
        assert report["events"][-1]["type"] == "client-error"
        assert report["events"][-1]["code"] == "controller_stream_closed"


def test_workload_exit_with_non_zero_code(docker_engine: Any, deployments: dict[str, Path],
                                         tmp_path: Path) -> None:
    code, result, report = run_to_end(deployments, tmp_path / "out", "exit-code")
    session = result["session_result"]
    assert session["cause"] == "workload-exit"
    assert session["workload_status"] == {"kind": "exited", "code": 3}
    assert report["events"][3] == {"schema": "reploy-controlled-session-client-v1",
                                   "type": "workload-exit",
                                   "status": {"kind": "exited", "code": 3}}
    # Everything else succeeded, but a failing workload is not a successful session.
    assert result["result_acknowledged"] is True and result["controller_status"]["code"] == 0
    assert code == 1 and result["ok"] is False
    assert result["error"] == "the workload exited with code 3"


def test_runtime_observation_lost(docker_engine: Any, deployments: dict[str, Path],
                                  tmp_path: Path, host_runs: list[HostRun]) -> None:
    run = start(host_runs, deployments, tmp_path / "out", "hold")
    run.wait_moment("active")
    manifest = run.manifest()
    [workload_id] = [cid for cid, labels in manifest.containers.items()
                     if labels["io.reploy.session.role"] == "workload"]
    docker_engine.api.remove_container(workload_id, force=True)
    code, result, _ = run.finish()
    session = result["session_result"]
    assert code == 1 and session["cause"] == "runtime-observation-lost"
    assert session["runtime_observation_status"]["kind"] == "lost"
    assert session["workload_status"]["kind"] == "unavailable"
    assert result["result_acknowledged"] is True  # the controller still got its result
    assert_nothing_left(docker_engine, deployments, manifest.run_id)


@pytest.mark.parametrize("grant", [(), GRANT])
def test_startup_failure_when_the_attachment_never_comes(docker_engine: Any,
                                                         deployments: dict[str, Path],
                                                         tmp_path: Path,
                                                         grant: tuple[str, ...]) -> None:
    code, result, report = run_to_end(deployments, tmp_path / "out", "no-attach", *grant)
    assert code == 1 and result["session_result"]["cause"] == "startup-failure"
    assert result["session_result"]["workload_status"] == {  # it never started
        "kind": "unavailable", "reason": "the workload never started"}
    assert "no terminal attachment connected" in result["error"]
    assert [e["type"] for e in report["events"]] == ["broker-ready", "opened", "client-error"]
    assert report["events"][-1]["code"] == "attach_timeout"
    assert report["client_exit"] == 1


@pytest.mark.parametrize("variant, reason", [
    ("datagram", "the terminal attachment was refused: not a stream socket"),
    ("two", "the terminal attachment was refused: 2 descriptors instead of one"),
    ("pipe", "the terminal attachment was refused: not a socket"),
])
def test_a_refused_attachment_fails_startup_closed(docker_engine: Any,
                                                   deployments: dict[str, Path], tmp_path: Path,
                                                   variant: str, reason: str) -> None:
    """A broker hands the host something that is no attachment's connection: the host closes
    it, the session ends as a startup failure that says why, the workload never started, and
    the controller still gets (and acknowledges) its result."""
    code, result, report = run_to_end(deployments, tmp_path / "out", "rogue-handover",
                                      variant=variant)
    assert report.get("error") is None, report.get("error")
    assert code == 1 and result["error"] == f"startup failed: {reason}"
    session = result["session_result"]
    assert session["cause"] == "startup-failure"
    assert session["controller_finalization_status"] == {"kind": "startup-failed",
                                                         "reason": reason}
    assert session["workload_status"] == {"kind": "unavailable",
                                          "reason": "the workload never started"}
    assert [e["type"] for e in report["events"]] == ["opened", "terminated"]
    assert report["events"][-1]["result"] == session
    assert result["result_delivered"] is True and result["result_acknowledged"] is True
    assert all(closed is not False for closed in report["closed_by_host"])


def test_a_descriptor_smuggled_with_a_request_loses_the_channel(docker_engine: Any,
                                                                deployments: dict[str, Path],
                                                                tmp_path: Path) -> None:
    code, result, report = run_to_end(deployments, tmp_path / "out", "rogue-handover",
                                      variant="with-request")
    assert report.get("error") is None, report.get("error")
    assert code == 1 and result["session_result"]["cause"] == "startup-failure"
    assert "a descriptor arrived with a REQUEST frame" in result["error"]
    assert result["session_result"]["workload_status"] == {
        "kind": "unavailable", "reason": "the workload never started"}
    assert [e["type"] for e in report["events"]] == ["opened"]  # the channel was dropped
    assert result["result_delivered"] is False
    assert report["closed_by_host"] == [True]


def test_startup_failure_when_the_startup_timeout_expires(docker_engine: Any,
                                                          deployments: dict[str, Path],
                                                          tmp_path: Path,
                                                          host_runs: list[HostRun]) -> None:
    run = start(host_runs, deployments, tmp_path / "out", "stall", "--startup-timeout", "15s")
    code, result, stderr = run.finish()  # nobody reads to-test: the controller stays stuck
    assert code == 1 and result["session_result"]["cause"] == "startup-failure"
    assert "within the startup timeout" in stderr
    assert result["controller_status"]["kind"] == "exited"


def test_startup_failure_when_the_controller_command_cannot_start(
        docker_engine: Any, deployments: dict[str, Path], tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(ROOT / "examples/controller", source)
    blueprint = source / "controller.blueprint.yaml"
    blueprint.write_text(blueprint.read_text().replace("/opt/controller/main.py",
                                                       "/no/such/program").replace(
        "argv: [python3,", "argv: [/no/such/interpreter,"))
    stage_and_build(blueprint, tmp_path / "c")
    proc = run_reploy("controlled-session", "run", "--controller-dir", str(tmp_path / "c"),
                      "--workload-dir", str(deployments["workload"]), "--", "run-controller")
    result = contract_rules.check_reploy_result_line(proc.stdout)
    assert proc.returncode == 1 and result["session_result"]["cause"] == "startup-failure"
    assert "no/such/interpreter" in result["error"] and result["error"].startswith(
        "startup failed: ")


# ---------------------------------------------------------------------------------------------
# Timeouts
# ---------------------------------------------------------------------------------------------


def test_controller_finalization_timeout(docker_engine: Any, deployments: dict[str, Path],
                                         tmp_path: Path) -> None:
    code, result, report = run_to_end(deployments, tmp_path / "out", "no-complete",
                                      "--controller-finalization-timeout", "1s")
    status = result["session_result"]["controller_finalization_status"]
    assert status["kind"] == "finalization-timeout" and "1s" in status["reason"]
    assert code == 1 and result["ok"] is False
    assert result["error"] == f"controller finalization finalization-timeout: {status['reason']}"
    assert report["terminated"]["result"] == result["session_result"]


def test_result_acknowledgement_timeout(docker_engine: Any, deployments: dict[str, Path],
                                        tmp_path: Path) -> None:
    code, result, report = run_to_end(deployments, tmp_path / "out", "no-ack",
                                      "--result-acknowledgement-timeout", "1s")
    assert result["result_delivered"] is True and result["result_acknowledged"] is False
    assert code == 1 and result["ok"] is False
    assert result["error"] == "the controller did not acknowledge the result"
    assert report["client_exit"] == 1  # the host closed without an acknowledgement


def test_cleanup_timeout_stops_a_lingering_controller(docker_engine: Any,
                                                      deployments: dict[str, Path],
                                                      tmp_path: Path,
                                                      host_runs: list[HostRun]) -> None:
    run = start(host_runs, deployments, tmp_path / "out", "linger", "--cleanup-timeout", "2s")
    code, result, _ = run.finish()  # the controller waits on from-test, which never answers
    assert result["controller_status"] == {"kind": "exited", "code": 137}
    assert result["session_result"]["cause"] == "workload-exit"
    assert result["delivery_tail_cleanup_status"] == {"kind": "succeeded"}


def test_output_finalization_fails_at_its_deadline(docker_engine: Any,
                                                   deployments: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """The attachment stops reading during a flood: the 30 s drain deadline (counted from the
    start of termination) expires, the failure is reported, and it is never a success."""
    # The grace lets the endless writer fill every buffer between the PTY and the stopped
    # attachment before SIGKILL, so the PTY's end of file stays out of the host's reach.
    code, result, report = run_to_end(deployments, tmp_path / "out", "stall-output",
                                      "--termination-grace", "10s")
    assert report.get("error") is None, report.get("error")
    status = result["session_result"]["workload_output_finalization_status"]
    assert status["kind"] == "failed" and "30 s" in status["reason"]
    assert report["finalized"]["status"] == "failed" and report["finalized"]["reason"]
    assert result["session_result"]["cause"] == "controller-terminate"
    assert result["result_acknowledged"] is True
    assert report["attach_exit"] == 1  # the attachment learns the output is incomplete
    types = [e["type"] for e in report["events"]]
    assert types.index("terminating") < types.index("workload-outputs-finalized")
    assert types.index("workload-exit") > types.index("terminating")
    assert code == 1 and result["ok"] is False
    assert result["error"] == f"terminal output finalization failed: {status['reason']}"


def test_cleanup_failure_is_a_fact_and_can_be_reconciled(docker_engine: Any,
                                                         deployments: dict[str, Path],
                                                         tmp_path: Path,
                                                         host_runs: list[HostRun]) -> None:
    """A path the host cannot remove (an immutable file in the channel dir) makes the delivery
    tail fail with a reason and a recovery action; `controlled-session cleanup` finishes."""
    run = start(host_runs, deployments, tmp_path / "out", "hold-then-exit")
    run.wait_moment("active")
    manifest = run.manifest()
    pin = deployments["workload"] / ".reploy/sessions" / manifest.run_id / "pinned"
    pin.write_text("x")
    subprocess.run(["chattr", "+i", str(pin)], check=True)
    run.answer()
    try:
        code, result, _ = run.finish()
        # While the path stays pinned, reconciling fails too, and says so in its exit code.
        stuck = run_reploy("controlled-session", "cleanup", "--workload-dir",
                           str(deployments["workload"]))
    finally:
        subprocess.run(["chattr", "-i", str(pin)], check=True)
    assert code == 1 and result["ok"] is False
    assert result["session_result"]["cause"] == "workload-exit"
    assert result["delivery_tail_cleanup_status"]["kind"] == "failed"
    assert "pinned" in result["delivery_tail_cleanup_status"]["message"]
    assert result["delivery_tail_recovery_action"] == "reconcile-next-operation"
    assert result["error"] == ("the delivery tail's cleanup failed: "
                               + result["delivery_tail_cleanup_status"]["message"])
    assert stuck.returncode == 1, stuck.stderr
    stuck_report = json.loads(stuck.stdout)
    assert stuck_report["ok"] is False
    assert [r["cleanup_succeeded"] for r in stuck_report["receipts"]] == [False]
    proc = run_reploy("controlled-session", "cleanup", "--workload-dir",
                      str(deployments["workload"]))
    assert proc.returncode == 0, proc.stderr
    [receipt] = json.loads(proc.stdout)["receipts"]
    assert receipt["run_id"] == manifest.run_id and receipt["cleanup_succeeded"] is True
    assert_nothing_left(docker_engine, deployments, manifest.run_id)


# ---------------------------------------------------------------------------------------------
# Controller outputs
# ---------------------------------------------------------------------------------------------


def run_output_file(deployments: dict[str, Path], tmp_path: Path, variant: str,
                    destination: Path) -> tuple[int, dict[str, Any]]:
    proc = run_reploy("controlled-session", "run",
                      "--controller-dir", str(deployments["controller"]),
                      "--workload-dir", str(deployments["workload"]),
                      "--output-file", str(destination), "--termination-grace", "100ms",
                      "--", "run-scenario", "output-file", "--variant", variant)
    return proc.returncode, contract_rules.check_reploy_result_line(proc.stdout)


def test_output_file_is_published_after_finalization(docker_engine: Any,
                                                     deployments: dict[str, Path],
                                                     tmp_path: Path) -> None:
    destination = tmp_path / "artifact.txt"
    code, result = run_output_file(deployments, tmp_path, "regular", destination)
    assert code == 0 and result["ok"] is True
    assert result["controller_output"] == {"kind": "file-published"}
    assert destination.read_text() == "controller artifact\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact.txt"]  # staging removed


def test_output_file_beside_a_deep_tree_is_published_and_the_staging_removed(
        docker_engine: Any, deployments: dict[str, Path], tmp_path: Path) -> None:
    """The controller writes its staging dir: a tree nested 3000 deep there (past Python's
    recursion limit) is removed all the same, and the run ends with its result."""
    destination = tmp_path / "artifact.txt"
    code, result = run_output_file(deployments, tmp_path, "deep", destination)
    assert code == 0 and result["ok"] is True, result
    assert result["controller_output"] == {"kind": "file-published"}
    assert destination.read_text() == "controller artifact\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact.txt"]


@pytest.mark.parametrize("variant", ["symlink", "directory"])
def test_output_file_that_is_not_a_regular_file_is_not_published(
        docker_engine: Any, deployments: dict[str, Path], tmp_path: Path, variant: str) -> None:
    destination = tmp_path / "artifact.txt"
    code, result = run_output_file(deployments, tmp_path, variant, destination)
    assert code == 1 and result["ok"] is False
    assert result["controller_output"]["kind"] == "failed"
    assert "not a regular file" in result["error"]
    assert not os.path.lexists(destination)
    assert list(tmp_path.iterdir()) == []


def test_output_file_is_discarded_without_finalization(docker_engine: Any,
                                                       deployments: dict[str, Path],
                                                       tmp_path: Path) -> None:
    destination = tmp_path / "artifact.txt"
    code, result = run_output_file(deployments, tmp_path, "abandon", destination)
    assert code == 1 and result["session_result"]["cause"] == "controller-lost"
    assert result["controller_output"]["kind"] == "file-discarded"
    assert result["error"].endswith("; controller output file-discarded: "
                                    + result["controller_output"]["reason"])
    assert not destination.exists() and list(tmp_path.iterdir()) == []


def test_output_dir_is_kept_on_failure(docker_engine: Any, deployments: dict[str, Path],
                                       tmp_path: Path) -> None:
    code, result, report = run_to_end(deployments, tmp_path / "out", "no-ack",
                                      "--result-acknowledgement-timeout", "1s")
    assert code == 1 and result["controller_output"] == {"kind": "directory-retained"}
    assert report["terminated"]["type"] == "terminated"  # written by the controller, kept


# ---------------------------------------------------------------------------------------------
# Endpoint grants and the network
# ---------------------------------------------------------------------------------------------


class HostListener:
    """The test's own listener on every address of the host (0.0.0.0 and ::, one free port):
    the only thing on the host a session's probes aim at. Records every connection."""

    def __init__(self) -> None:
        self.peers: list[str] = []
        self.selector = selectors.DefaultSelector()
        self.stop_read, self.stop_write = os.pipe()
        self.selector.register(self.stop_read, selectors.EVENT_READ)
        v4 = socket.create_server(("0.0.0.0", 0))
        self.port = v4.getsockname()[1]
        v6 = socket.create_server(("::", self.port), family=socket.AF_INET6, dualstack_ipv6=False)
        for listener in (v4, v6):
            self.selector.register(listener, selectors.EVENT_READ)
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select():
                if key.fileobj == self.stop_read:
                    return
                conn, peer = key.fileobj.accept()  # type: ignore[union-attr]
                self.peers.append(peer[0])
                conn.close()

    def close(self) -> None:
        os.write(self.stop_write, b"x")
        self.thread.join()
        for key in list(self.selector.get_map().values()):
            if key.fileobj != self.stop_read:
                key.fileobj.close()  # type: ignore[union-attr]
        self.selector.close()
        os.close(self.stop_read)
        os.close(self.stop_write)


@pytest.fixture
def host_listener() -> Any:
    listener = HostListener()
    yield listener
    listener.close()


def host_addresses() -> list[str]:
    """Every address of every interface of the host (docker0's and any bridge's included),
    less IPv6 link-local ones, which need an interface to mean anything."""
    return sorted({address.address for addresses in psutil.net_if_addrs().values()
                   for address in addresses
                   if address.family in (socket.AF_INET, socket.AF_INET6)
                   and "%" not in address.address})


def engine_addresses(docker_engine: Any, container_ids: list[str]) -> list[str]:
    """Every address the engine gives these containers on any network (none, by design)."""
    found = set()
    for container_id in container_ids:
        networks = docker_engine.api.inspect_container(container_id)["NetworkSettings"]["Networks"]
        for network in (networks or {}).values():
            found.update(network.get(key) or "" for key in ("IPAddress", "GlobalIPv6Address",
                                                             "Gateway", "IPv6Gateway"))
    return sorted(found - {""})


def assert_sandboxed(docker_engine: Any, container_id: str) -> dict[str, Any]:
    """The sandbox flags every session container carries; returns the inspection."""
    info = docker_engine.api.inspect_container(container_id)
    host = info["HostConfig"]
    role = info["Config"]["Labels"]["io.reploy.session.role"]
    assert host["ReadonlyRootfs"] is True, role
    assert host["CapDrop"] == ["ALL"] and not host["CapAdd"], role
    assert host["SecurityOpt"] == ["no-new-privileges:true"], role
    assert host["Privileged"] is False and not host["Devices"], role
    assert not host["PortBindings"] and not host["PublishAllPorts"], role
    assert host["PidMode"] == "" and host["IpcMode"] == "private", role
    assert host["UsernsMode"] == "" and host["UTSMode"] == "", role
    assert host["PidsLimit"] > 0 and host["Memory"] > 0, role
    assert not info["Config"]["User"].startswith("0:"), role
    assert "/mnt/reploy-home" in host["Tmpfs"], role
    sources = [m["Source"] for m in info["Mounts"]]
    assert not any("docker.sock" in s for s in sources), role
    return info


def test_granted_session_is_one_loopback_namespace(docker_engine: Any,
                                                   deployments: dict[str, Path], tmp_path: Path,
                                                   host_runs: list[HostRun],
                                                   host_listener: HostListener) -> None:
    """The controller reaches the granted port; neither container reaches the host at any
    address it could know (the test's listener on all addresses sees nobody); inside both,
    the only interface is lo and there is no route."""
    run = start(host_runs, deployments, tmp_path / "out", "isolation", *GRANT)
    run.wait_moment("targets")
    addresses = host_addresses()
    run.answer(json.dumps({"serve": True, "port": host_listener.port, "addresses": addresses}))
    run.wait_moment("probed")
    report = run.report()
    run_id = run.manifest().run_id
    containers = run.containers()
    assert set(containers) == session_roles(GRANT)
    holder = assert_sandboxed(docker_engine, containers["holder"])
    assert holder["HostConfig"]["NetworkMode"] == "none"
    assert holder["HostConfig"]["ExtraHosts"] == ["workload:127.0.0.1"]
    assert holder["Mounts"] == [] and holder["Config"]["Tty"] is False
    assert holder["Config"]["Entrypoint"] == ["python3", "-S", "-c",
                                              "import signal; signal.pause()"]
    assert not holder["Config"]["Cmd"] and holder["Config"]["User"] == "65534:65534"
    for role in ("controller", "workload"):
        info = assert_sandboxed(docker_engine, containers[role])
        assert info["HostConfig"]["NetworkMode"] == f"container:{containers['holder']}", role
    assert engine_addresses(docker_engine, list(containers.values())) == []
    run.answer()
    code, result, _ = run.finish()
    assert report.get("error") is None, report.get("error")
    assert report["opened"]["endpoints"] == [
        {"id": "web", "scheme": "http", "host": "workload", "port": 8080}]
    assert report["checks"] == {"endpoint_reachable": True,
                                "workload_reaches_controller_listener": True}
    for role, seen in report["seen"].items():
        assert seen["interfaces"] == ["lo"] and seen["routes"] == [], (role, seen)
    assert set(addresses) | {"workload"} <= set(report["probed"])
    assert report["workload_reached"] == [] and report["controller_reached"] == []
    assert host_listener.peers == []
    assert code == 0 and result["ok"] is True
    assert_nothing_left(docker_engine, deployments, run_id)


def test_a_second_session_cannot_reach_the_first(docker_engine: Any,
                                                 deployments: dict[str, Path], tmp_path: Path,
                                                 host_runs: list[HostRun]) -> None:
    first = start(host_runs, deployments, tmp_path / "first", "serve", *GRANT)
    first.wait_moment("serving")
    assert first.report()["checks"] == {"endpoint_reachable": True}
    first_addresses = engine_addresses(docker_engine, list(first.containers().values()))
    second = start(host_runs, deployments, tmp_path / "second", "isolation", *GRANT)
    second.wait_moment("targets")
    port = first.report()["opened"]["endpoints"][0]["port"]
    second.answer(json.dumps({"serve": False, "port": port,
                              "addresses": host_addresses() + first_addresses}))
    second.wait_moment("probed")
    report = second.report()
    second.answer()
    first.answer()
    for run in (second, first):
        code, result, _ = run.finish()
        assert code == 0 and result["ok"] is True
    assert report.get("error") is None, report.get("error")
    assert report["checks"] == {"workload_reaches_controller_listener": True}
    assert set(first_addresses) <= set(report["probed"])
    assert report["workload_reached"] == [] and report["controller_reached"] == []


def test_without_grants_both_containers_have_only_loopback(docker_engine: Any,
                                                           deployments: dict[str, Path],
                                                           tmp_path: Path) -> None:
    code, result, report = run_to_end(deployments, tmp_path / "out", "no-network")
    assert report.get("error") is None, report.get("error")
    assert report["seen"] == {"controller": {"interfaces": ["lo"], "routes": []},
                              "workload": {"interfaces": ["lo"], "routes": []}}
    assert code == 0 and result["ok"] is True


def test_losing_the_namespace_holder_while_preparing_is_a_startup_failure(
        docker_engine: Any, deployments: dict[str, Path], tmp_path: Path,
        host_runs: list[HostRun]) -> None:
    """Before the session's containers have joined the holder's namespace there is nothing to
    join: a clear startup failure, at once (the startup timeout is far longer than the test
    waits, so a session that hung would fail it)."""
    run = start(host_runs, deployments, tmp_path / "out", "stall", *GRANT,
                "--startup-timeout", "5m", "--cleanup-timeout", "2s")
    run.wait_moment("preparing")
    run_id = run.manifest().run_id
    docker_engine.api.kill(run.containers()["holder"], signal="SIGKILL")
    code, result, stderr = run.finish()
    session = result["session_result"]
    assert code == 1 and result["ok"] is False and session["cause"] == "startup-failure"
    assert "network namespace holder" in stderr and "network namespace holder" in result["error"]
    assert session["workload_status"] == {"kind": "unavailable",
                                          "reason": "the workload never started"}
    assert_nothing_left(docker_engine, deployments, run_id)


@pytest.mark.parametrize("how", ["kill", "remove"])
def test_losing_the_namespace_holder_once_joined_changes_nothing(
        docker_engine: Any, deployments: dict[str, Path], tmp_path: Path,
        host_runs: list[HostRun], how: str) -> None:
    """Once the controller and the workload are in the holder's namespace it lives on in them:
    the endpoint still answers, only `lo` is there, the controller hears a diagnostic, and the
    session ends as its controller ends it, with nothing invented and nothing left behind."""
    run = start(host_runs, deployments, tmp_path / "out", "holder-loss", *GRANT,
                "--cleanup-timeout", "5s")
    run.wait_moment("serving")
    run_id = run.manifest().run_id
    holder = run.containers()["holder"]
    if how == "kill":
        docker_engine.api.kill(holder, signal="SIGKILL")
    else:
        docker_engine.api.remove_container(holder, force=True)
    run.answer()
    code, result, stderr = run.finish()
    report = run.report()
    assert report.get("error") is None, report.get("error")
    assert report["checks"] == {"endpoint_reachable": True,
                                "endpoint_reachable_after_holder_loss": True}
    assert report["diagnostic"]["code"] == "namespace_holder_lost"
    assert report["seen"] == {"controller": {"interfaces": ["lo"], "routes": []},
                              "workload": {"interfaces": ["lo"], "routes": []}}
    assert "network namespace holder" in stderr
    assert code == 0 and result["ok"] is True, result
    assert_nothing_left(docker_engine, deployments, run_id)


# ---------------------------------------------------------------------------------------------
# The sandbox, seen from the Engine and from inside
# ---------------------------------------------------------------------------------------------


def test_sandbox_audit(docker_engine: Any, deployments: dict[str, Path], tmp_path: Path,
                       host_runs: list[HostRun]) -> None:
    canary = "REPLOY_HOST_CANARY"
    run = start(host_runs, deployments, tmp_path / "out", "audit",
                env={canary: "must-not-leak"})
    run.wait_moment("audit-ready")
    manifest = run.manifest()
    for container_id, labels in manifest.containers.items():
        info = assert_sandboxed(docker_engine, container_id)
        role = labels["io.reploy.session.role"]
        assert info["HostConfig"]["NetworkMode"] == "none", role
        assert info["Config"]["User"] == "1000:1000", role
        assert not any(canary in e for e in info["Config"]["Env"]), role
        if role == "workload":
            assert info["Mounts"] == []
            assert info["Config"]["Entrypoint"] == ["/bin/sh"] and not info["Config"]["Cmd"]
            assert info["Config"]["Tty"] is True
        else:
            assert {(m["Destination"], m["RW"]) for m in info["Mounts"]} == {
                ("/run/reploy/session", False), ("/mnt/reploy-output", True)}
    report = run.report()
    controller = report["controller"]
    assert controller["status"]["CapEff"] == controller["status"]["CapBnd"] == "0" * 16
    assert controller["status"]["NoNewPrivs"] == "1" and controller["status"]["Seccomp"] == "2"
    assert controller["uid_gid"] == [1000, 1000]
    assert controller["root_write"] == "Read-only file system"
    assert controller["home_write"] == "ok"
    # The channel socket as the controller found it, before its broker claimed it; HOME in both.
    assert controller["channel_socket"] == {"type": "socket", "mode": 0o600, "uid": 1000,
                                            "gid": 1000, "filesystem": None}
    assert controller["home"] == {"type": "directory", "mode": 0o700, "uid": 1000, "gid": 1000,
                                  "filesystem": "tmpfs"}
    assert controller["docker_socket"] is False and controller["sees_workload_project"] is False
    assert controller["channel_mount_listing"] == []  # the socket path is gone after the claim
    assert controller["channel_mount_write"] == "Read-only file system"
    channel_dir = deployments["workload"] / ".reploy/sessions" / manifest.run_id
    info = channel_dir.stat()
    assert (info.st_mode & 0o777, info.st_uid, info.st_gid) == (0o700, 1000, 1000)
    assert canary not in controller["environ"]
    workload = report["workload_output"]
    assert "CapEff:\t0000000000000000" in workload and "CapBnd:\t0000000000000000" in workload
    assert "NoNewPrivs:\t1" in workload and "Seccomp:\t2" in workload
    assert "1000\r\n1000\r\n" in workload
    assert "Read-only file system" in workload
    assert "/run/reploy" in workload and "No such file or directory" in workload
    assert "no-client" in workload and "REPLOY_" not in workload and canary not in workload
    assert "@@home 700 1000:1000@@" in workload and "@@home-fs tmpfs@@" in workload
    run.answer()
    code, result, _ = run.finish()
    assert code == 0 and result["ok"] is True


def connect_at(path: Path) -> socket.socket:
    """A unix stream connection to `path`, through /proc/self/fd (the workload dir may be
    deeper than sun_path holds)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        sock.connect(f"/proc/self/fd/{dir_fd}/{path.name}")
    except OSError:
        sock.close()
        raise
    finally:
        os.close(dir_fd)
    return sock


def test_a_channel_peer_of_another_uid_is_refused_and_the_controller_awaited(
        docker_engine: Any, deployments: dict[str, Path], tmp_path: Path,
        host_runs: list[HostRun]) -> None:
    """While the controller holds off its broker, the test (another uid:gid: root) connects
    to the channel socket: the host closes that connection, says so on stderr, keeps
    listening, and takes the controller's own connection when it comes; the session ends ok."""
    assert (os.getuid(), os.getgid()) != CONTROLLER_UID_GID
    run = start(host_runs, deployments, tmp_path / "out", "hold-before-broker")
    run.wait_moment("channel-open")
    channel = deployments["workload"] / ".reploy/sessions" / run.manifest().run_id / CHANNEL_SOCKET_NAME
    with connect_at(channel) as intruder:
        intruder.settimeout(MOMENT_TIMEOUT_S)  # a deadline: the host's answer is to hang up
        assert intruder.recv(1) == b""
    assert channel.is_socket()  # still there for the controller
    run.answer()
    code, result, stderr = run.finish()
    assert code == 0 and result["ok"] is True, result
    assert result["session_result"]["cause"] == "workload-exit"
    assert (f"refused a channel peer with uid:gid {os.getuid()}:{os.getgid()} "
            f"(pid {os.getpid()})") in stderr


# ---------------------------------------------------------------------------------------------
# Hostile terminal output
# ---------------------------------------------------------------------------------------------


def test_terminal_output_cannot_forge_lifecycle_events(docker_engine: Any,
                                                       deployments: dict[str, Path],
                                                       tmp_path: Path) -> None:
    code, result, report = run_to_end(deployments, tmp_path / "out", "hostile")
    assert report.get("error") is None, report.get("error")
    assert [e["type"] for e in report["events"]] == [
        "broker-ready", "opened", "ready", "workload-exit", "terminating",
        "workload-outputs-finalized", "terminated"]
    assert report["terminated"]["result"] == result["session_result"]
    assert result["session_result"]["cause"] == "workload-exit"
    assert '"type":"terminated"' in report["transcript"]  # it did travel, as terminal bytes
    assert code == 0 and result["ok"] is True
