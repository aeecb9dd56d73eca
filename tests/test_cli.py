"""The host CLI without Docker: usage errors, blueprint validation, staging and admission."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import ROOT, run_reploy

CONTROLLER = ROOT / "examples/controller/controller.blueprint.yaml"
WORKLOAD = ROOT / "examples/workload/workload.blueprint.yaml"


def staged(tmp_path: Path, blueprint: Path, name: str, built: bool = True) -> Path:
    """Stage without Docker; mark it built with a made-up generation when asked."""
    directory = tmp_path / name
    proc = run_reploy("stage", str(blueprint), "--dir", str(directory))
    assert proc.returncode == 0, proc.stderr.decode()
    if built:
        state_file = directory / ".reploy/state.json"
        state = json.loads(state_file.read_text())
        state["current_generation"] = {"number": 1, "image_id": "sha256:" + "0" * 64,
                                       "reference": "reploy/x:1", "blueprint_digest": "d",
                                       "built_at": 0.0}
        state_file.write_text(json.dumps(state))
    return directory


def run_args(controller: Path, workload: Path, *extra: str) -> list[str]:
    return ["controlled-session", "run", "--controller-dir", str(controller),
            "--workload-dir", str(workload), *extra]


@pytest.mark.parametrize("extra,message", [
    (["--", "run-controller", "--columns", "5"], None),  # after --: the controller's argument
    ([], "missing the controller command"),
    (["--columns", "100", "--", "x"], "--columns and --rows go together"),
    (["--columns", "0", "--rows", "10", "--", "x"], "--columns must be from 1 to 65535"),
    (["--columns", "10", "--rows", "65536", "--", "x"], "--rows must be from 1 to 65535"),
    (["--columns", "ten", "--rows", "10", "--", "x"], "invalid int value"),
    (["--startup-timeout", "14s", "--", "x"], "outside 15s through 5m"),
    (["--startup-timeout", "6m", "--", "x"], "outside 15s through 5m"),
    (["--termination-grace", "99ms", "--", "x"], "outside 100ms through 1m"),
    (["--controller-finalization-timeout", "2h", "--", "x"], "outside 1s through 1h"),
    (["--result-acknowledgement-timeout", "500ms", "--", "x"], "outside 1s through 1m"),
    (["--cleanup-timeout", "10m", "--", "x"], "outside 1s through 5m"),
    (["--cleanup-timeout", "soon", "--", "x"], "not a duration"),
    (["--output-file", "a", "--output-dir", "b", "--", "x"], "not allowed with argument"),
    (["--bogus", "--", "x"], "unrecognized arguments"),
])
def test_usage_errors_exit_2_with_nothing_on_stdout(tmp_path: Path, extra: list[str],
                                                    message: str | None) -> None:
    proc = run_reploy(*run_args(tmp_path / "c", tmp_path / "w", *extra))
    if message is None:  # a valid command line: not a usage error (admission fails instead)
        assert proc.returncode == 1
        assert json.loads(proc.stdout)["error"].startswith("admission rejected")
        return
    assert proc.returncode == 2
    assert proc.stdout == b""
    assert message in proc.stderr.decode()


def test_missing_required_directories_is_usage_error() -> None:
    proc = run_reploy("controlled-session", "run", "--", "x")
    assert proc.returncode == 2 and proc.stdout == b""
    assert "--controller-dir" in proc.stderr.decode()


def admission_error(proc) -> str:  # noqa: ANN001
    assert proc.returncode == 1, proc.stderr.decode()
    result = json.loads(proc.stdout)
    assert result["ok"] is False
    assert result["session_result"] is None and result["controller_output"] is None
    return result["error"]


def test_same_deployment_twice_is_rejected(tmp_path: Path) -> None:
    controller = staged(tmp_path, CONTROLLER, "c")
    error = admission_error(run_reploy(*run_args(controller, controller, "--", "run-controller")))
    assert "same deployment" in error
    # A second path to the same directory is the same deployment too.
    (tmp_path / "alias").symlink_to(controller)
    error = admission_error(run_reploy(*run_args(controller, tmp_path / "alias", "--",
                                                 "run-controller")))
    assert "same deployment" in error


def test_unbuilt_deployment_is_rejected(tmp_path: Path) -> None:
    controller = staged(tmp_path, CONTROLLER, "c")
    workload = staged(tmp_path, WORKLOAD, "w", built=False)
    error = admission_error(run_reploy(*run_args(controller, workload, "--", "run-controller")))
    assert "no built generation" in error


def test_undeclared_and_non_native_commands_are_rejected(tmp_path: Path) -> None:
    workload = staged(tmp_path, WORKLOAD, "w")
    controller = staged(tmp_path, CONTROLLER, "c")
    error = admission_error(run_reploy(*run_args(controller, workload, "--", "rm", "-rf")))
    assert "'rm' is not a command declared" in error
    source = tmp_path / "nonnative"
    shutil.copytree(CONTROLLER.parent, source)
    blueprint = source / "controller.blueprint.yaml"
    blueprint.write_text(blueprint.read_text().replace("native_command: true",
                                                       "native_command: false"))
    nonnative = staged(tmp_path, blueprint, "n")
    error = admission_error(run_reploy(*run_args(nonnative, workload, "--", "run-controller")))
    assert "not declared native_command: true" in error


def test_undeclared_endpoint_is_rejected(tmp_path: Path) -> None:
    controller = staged(tmp_path, CONTROLLER, "c")
    workload = staged(tmp_path, WORKLOAD, "w")
    error = admission_error(run_reploy(*run_args(controller, workload, "--endpoint", "db",
                                                 "--", "run-controller")))
    assert "endpoint 'db' is not declared" in error


def test_private_env_is_rejected(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(WORKLOAD.parent, source)
    (source / ".env").write_text("TOKEN=secret\n")
    proc = run_reploy("stage", str(source / "workload.blueprint.yaml"), "--dir",
                      str(tmp_path / "w"))
    assert json.loads(proc.stdout)["private_env"] is True
    assert (tmp_path / "w/.env").stat().st_mode & 0o777 == 0o600
    assert not (tmp_path / "w/context/.env").exists()  # never baked into the image
    staged(tmp_path, WORKLOAD, "w2")  # reuse the helper's "built" marking on a copy
    state = (tmp_path / "w2/.reploy/state.json").read_text()
    (tmp_path / "w/.reploy/state.json").write_text(state.replace(
        json.loads(state)["deployment_id"], json.loads(
            (tmp_path / "w/.reploy/state.json").read_text())["deployment_id"]))
    controller = staged(tmp_path, CONTROLLER, "c")
    error = admission_error(run_reploy(*run_args(controller, tmp_path / "w", "--",
                                                 "run-controller")))
    assert "private environment" in error


def test_output_file_needs_parent_and_no_destination(tmp_path: Path) -> None:
    controller = staged(tmp_path, CONTROLLER, "c")
    workload = staged(tmp_path, WORKLOAD, "w")
    error = admission_error(run_reploy(*run_args(
        controller, workload, "--output-file", str(tmp_path / "missing/out.cast"),
        "--", "run-controller")))
    assert "is not a directory" in error
    (tmp_path / "exists.cast").write_text("")
    error = admission_error(run_reploy(*run_args(
        controller, workload, "--output-file", str(tmp_path / "exists.cast"),
        "--", "run-controller")))
    assert "already exists" in error


def test_root_controller_cannot_use_outputs(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(CONTROLLER.parent, source)
    blueprint = source / "controller.blueprint.yaml"
    blueprint.write_text(blueprint.read_text().replace('"1000:1000"', '"0:0"'))
    controller = staged(tmp_path, blueprint, "c")
    workload = staged(tmp_path, WORKLOAD, "w")
    error = admission_error(run_reploy(*run_args(
        controller, workload, "--output-dir", str(tmp_path / "o"), "--", "run-controller")))
    assert "non-root controller runtime" in error


BLUEPRINT_ERRORS = [
    ("name: Bad_Name\nenvironment: {runtime: {user: '1:1'}}\n", "name:"),
    ("name: x\n", "environment: required field is missing"),
    ("name: x\nenvironment: {runtime: {user: root}}\n", "environment.runtime.user"),
    ("name: x\nenvironment: {runtime: {user: '1:1', pids: 1}}\n", "environment.runtime.pids"),
    ("name: x\nenvironment: {runtime: {user: '1:1', writable_paths: [tmp]}}\n",
     "environment.runtime.writable_paths[0]"),
    ("name: x\nenvironment: {runtime: {user: '1:1'}, commands: {go: {executable: a.b}}}\n",
     "environment.commands.go.executable"),
    ("name: x\nenvironment: {runtime: {user: '1:1'}, commands: {go: {native_command: yes}}}\n",
     "environment.commands.go.executable: required field is missing"),
    ("name: x\nenvironment: {runtime: {user: '1:1'}, executables: {main: {argv: [a]}}}\n",
     "environment.executables.main"),
    ("name: x\nenvironment: {runtime: {user: '1:1'}, workload: {services: {web: {endpoints: "
     "{web: {scheme: gopher, port: 1}}}}}}\n",
     "environment.workload.services.web.endpoints.web.scheme"),
    ("name: x\nenvironment: {runtime: {user: '1:1'}, workload: {services: {web: {endpoints: "
     "{web: {scheme: http, port: 70000}}}}}}\n",
     "environment.workload.services.web.endpoints.web.port"),
    ("name: x\nenvironment: {runtime: {user: '1:1'}, surprise: 1}\n",
     "environment: unknown field(s) surprise"),
    ("name: x\nbuild: {context: ../elsewhere}\nenvironment: {runtime: {user: '1:1'}}\n",
     "build.context"),
    ("name: [unclosed\n", "not valid YAML"),
]


@pytest.mark.parametrize("text,field", BLUEPRINT_ERRORS)
def test_bad_blueprints_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    blueprint = tmp_path / "bp.yaml"
    blueprint.write_text(text)
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    proc = run_reploy("stage", str(blueprint), "--dir", str(tmp_path / "d"))
    assert proc.returncode == 1
    result = json.loads(proc.stdout)
    assert result["ok"] is False and field in result["error"], result["error"]
    assert not (tmp_path / "d").exists()


def test_restaging_keeps_the_deployment_id_and_refuses_foreign_dirs(tmp_path: Path) -> None:
    first = json.loads(run_reploy("stage", str(WORKLOAD), "--dir", str(tmp_path / "w")).stdout)
    again = json.loads(run_reploy("stage", str(WORKLOAD), "--dir", str(tmp_path / "w")).stdout)
    assert first["deployment_id"] == again["deployment_id"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    proc = run_reploy("stage", str(WORKLOAD), "--dir", str(other))
    assert proc.returncode == 1 and "not a staging deployment" in json.loads(proc.stdout)["error"]
    assert (other / "precious.txt").read_text() == "keep me"
