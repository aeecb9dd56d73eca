"""Controlled sessions end to end on the real Docker engine, run as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import contract_rules
from conftest import ROOT, run_reploy

pytestmark = pytest.mark.docker

RESULT_KEYS = ["schema", "ok", "error", "session_result", "result_delivered",
               "result_acknowledged", "controller_status", "controller_output",
               "delivery_tail_cleanup_status", "delivery_tail_recovery_action"]


def run_scenario(deployments: dict[str, Path], out: Path, *scenario: str,
                 extra: tuple[str, ...] = ()) -> tuple[int, dict[str, Any], dict[str, Any]]:
    proc = run_reploy(
        "controlled-session", "run",
        "--controller-dir", str(deployments["controller"]),
        "--workload-dir", str(deployments["workload"]),
        "--output-dir", str(out), *extra, "--", "run-scenario", *scenario)
    stdout = proc.stdout.decode()
    assert stdout.endswith("\n") and stdout.count("\n") == 1, stdout
    result = contract_rules.check_reploy_result_line(proc.stdout)
    assert list(result) == RESULT_KEYS
    report = json.loads((out / "report.json").read_text())
    assert report["error"] is None, report["error"] + proc.stderr.decode()[-3000:]
    return proc.returncode, result, report


def assert_session_dirs_gone(deployments: dict[str, Path]) -> None:
    sessions = deployments["workload"] / ".reploy" / "sessions"
    assert not sessions.exists() or not any(sessions.iterdir())


@pytest.mark.parametrize("attach", ["pipe", "pty"])
def test_full_session_ends_by_workload_exit(docker_engine: Any, deployments: dict[str, Path],
                                           tmp_path: Path, attach: str) -> None:
    code, result, report = run_scenario(deployments, tmp_path / "out", "full", "--attach", attach)
    checks = report["checks"]
    expected_checks = {"cwd_persists", "interrupt_returns_shell", "raw_output_bytes",
                       "raw_input_bytes", "big_output_in_order", "structured_resize"}
    if attach == "pty":
        expected_checks.add("sigwinch_resize")
    assert set(checks) == expected_checks
    assert all(checks.values()), checks
    assert report["big_output_bytes"] >= 160 * 1024
    assert [e["type"] for e in report["events"]] == [
        "broker-ready", "opened", "ready", "workload-exit", "terminating",
        "workload-outputs-finalized", "terminated"]
    opened = report["events"][1]
    assert (opened["columns"], opened["rows"]) == (80, 24)
    assert opened["operations"] == ["input", "resize", "terminate", "complete"]
    assert opened["endpoints"] == []
    assert opened["output_finalization_timeout_milliseconds"] == 30000
    assert report["events"][3]["status"] == {"kind": "exited", "code": 0}
    assert report["client_exit"] == 0 and report["attach_exit"] == 0
    # The controller's copy of the result is the host's.
    assert report["terminated"]["result"] == result["session_result"]
    assert result["session_result"] == {
        "cause": "workload-exit",
        "workload_status": {"kind": "exited", "code": 0},
        "workload_output_finalization_status": {"kind": "drained"},
        "runtime_observation_status": {"kind": "maintained"},
        "controller_finalization_status": {"kind": "completed"},
        "cleanup_status": {"kind": "succeeded"},
        "recovery_action": "none"}
    assert result["ok"] is True and code == 0
    assert result["result_delivered"] is True and result["result_acknowledged"] is True
    assert result["controller_status"] == {"kind": "exited", "code": 0}
    assert result["controller_output"] == {"kind": "directory-retained"}
    assert_session_dirs_gone(deployments)


def test_controller_terminate_with_workload_running(docker_engine: Any,
                                                    deployments: dict[str, Path],
                                                    tmp_path: Path) -> None:
    code, result, report = run_scenario(deployments, tmp_path / "out", "terminate",
                                        extra=("--termination-grace", "200ms"))
    assert report["checks"] == {"shell_answered": True}
    types = [e["type"] for e in report["events"]]
    # terminating precedes the workload's exit when the controller asked for termination.
    assert types == ["broker-ready", "opened", "ready", "terminating", "workload-exit",
                     "workload-outputs-finalized", "terminated"]
    assert report["events"][3]["cause"] == "controller-terminate"
    session = result["session_result"]
    assert session["cause"] == "controller-terminate"
    # /bin/sh as PID 1 ignores SIGTERM: the grace expires and SIGKILL ends it.
    assert session["workload_status"] == {"kind": "exited", "code": 137}
    assert session["workload_output_finalization_status"] == {"kind": "drained"}
    assert result["ok"] is True and code == 0
    assert_session_dirs_gone(deployments)


def test_make_demo_prints_only_the_result(docker_engine: Any, tmp_path: Path) -> None:
    """The README's `make demo`: human text on stderr, one JSON result on stdout, so it can be
    piped into a JSON tool."""
    proc = subprocess.run(["make", "demo", f"DEMO_DIR={tmp_path / 'demo'}",
                           f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert proc.stdout.count(b"\n") == 1, proc.stdout[:500]
    result = contract_rules.check_reploy_result_line(proc.stdout)
    assert result["ok"] is True
    assert b"reploy.py controlled-session run" not in proc.stdout  # no recipe lines
