"""The host CLI without Docker: usage errors, blueprint validation, staging and admission."""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

import contract_rules
from conftest import ROOT, require_shared_fixture, run_reploy

CONTROLLER = ROOT / "examples/controller/controller.blueprint.yaml"
WORKLOAD = ROOT / "examples/workload/workload.blueprint.yaml"


def staged(tmp_path: Path, blueprint: Path, name: str, built: bool = True) -> Path:
    """Stage without Docker; mark it built with a made-up generation when asked."""
    directory = tmp_path / name
    proc = run_reploy("stage", str(blueprint), "--dir", str(directory))
    assert proc.returncode == 0, proc.stderr.decode()
    if built:
        mark_built(directory)
    return directory


def mark_built(directory: Path) -> None:
    """Record a made-up generation of the staged files, as `reploy build` would."""
    import yaml

    state_file = directory / ".reploy/state.json"
    state = json.loads(state_file.read_text())
    text = (directory / "blueprint.yaml").read_text()
    private_env = "private_env" in yaml.safe_load(text)["environment"] or (
        directory / ".env").exists()
    state["current_generation"] = {"number": 1, "image_id": "sha256:" + "0" * 64,
                                   "reference": "reploy/x:1",
                                   "blueprint_digest": hashlib.sha256(text.encode()).hexdigest(),
                                   "built_at": 0.0, "blueprint_text": text,
                                   "private_env": private_env}
    state_file.write_text(json.dumps(state))


def run_args(controller: Path, workload: Path, *extra: str) -> list[str]:
    return ["controlled-session", "run", "--controller-dir", str(controller),
            "--workload-dir", str(workload), *extra]


#: What pip writes for pyproject.toml's `reploy` entry point: a script that imports the module
#: and calls run_command (the line that renames argv[0] on Windows left out).
INSTALLED_COMMAND = ("import sys\n"
                     "from reploy import run_command\n"
                     "if __name__ == '__main__':\n"
                     "    sys.exit(run_command())\n")


def installed_command(directory: Path) -> tuple[list[str], dict[str, str]]:
    """The installed `reploy` command, written into `directory`, run on this checkout's
    modules: (the command, its environment)."""
    script = directory / "reploy"
    script.write_text(INSTALLED_COMMAND)
    return [sys.executable, str(script)], {**os.environ, "PYTHONPATH": str(ROOT)}


def test_the_installed_command_parses_with_the_signals_held() -> None:
    """The installed command imports reploy, so the hold of the script's first statement never
    ran: run_command holds SIGINT and SIGTERM before anything is parsed, as the script does
    (a controlled session's host lets them through once its handlers are in place)."""
    probe = ("import signal, sys, reploy\n"
             "reploy.main = lambda: print(sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),"
             " flush=True) or 0\n"  # main as run_command calls it: the mask it starts with
             "reploy.run_command()\n")
    done = subprocess.run([sys.executable, "-c", probe, "stage", "--help"], capture_output=True,
                          cwd=ROOT, timeout=60, check=True)
    assert done.stdout.decode().strip() == str(sorted([signal.SIGINT, signal.SIGTERM]))


@pytest.mark.parametrize("argv", [["serve", "--help"], ["session", "--help"],
                                  ["session", "list", "--nonsense"]])
def test_the_installed_command_hands_serve_and_session_over_as_reploy_py_does(
        tmp_path: Path, argv: list[str]) -> None:
    """`pip install .`'s `reploy serve` and `reploy session` run reploy_serve.py, exactly as
    `python3 reploy.py serve|session` does (they were usage errors of the host's parser)."""
    command, env = installed_command(tmp_path)
    installed = subprocess.run([*command, *argv], capture_output=True, env=env, timeout=60)
    script = subprocess.run([sys.executable, str(ROOT / "reploy.py"), *argv], capture_output=True,
                            timeout=60)
    assert (installed.returncode, installed.stdout, installed.stderr) == (
        script.returncode, script.stdout, script.stderr)
    assert b"invalid choice" not in installed.stderr  # the host's parser refused them before


@pytest.mark.parametrize("extra,message", [
    (["--", "run-controller", "--columns", "5"], None),  # after --: the controller's argument
    ([], "missing the controller command"),
    (["--columns", "100", "--", "x"], "--columns and --rows go together"),
    (["--columns", "0", "--rows", "10", "--", "x"], "--columns must be from 1 to 65535"),
    (["--columns", "10", "--rows", "65536", "--", "x"], "--rows must be from 1 to 65535"),
    (["--columns", "ten", "--rows", "10", "--", "x"], "'ten' is not a number written in ASCII"),
    (["--columns", "8_0", "--rows", "24", "--", "x"], "'8_0' is not a number written in ASCII"),
    (["--columns", "80", "--rows", "\u0662\u0664", "--", "x"], "--rows: '\u0662\u0664' is not"),
    (["--columns", "+80", "--rows", "24", "--", "x"], "'+80' is not a number"),
    (["--columns", " 80", "--rows", "24", "--", "x"], "' 80' is not a number"),
    (["--columns", "80\n", "--rows", "24", "--", "x"], "is not a number"),
    (["--columns", "\uff18\uff10", "--rows", "24", "--", "x"], "is not a number"),  # fullwidth
    (["--columns", "80", "--columns", "80", "--rows", "24", "--", "x"],
     "--columns was given more than once"),
    (["--startup-timeout", "20s", "--startup-timeout", "30s", "--", "x"],
     "--startup-timeout was given more than once"),
    (["--output-dir", "a", "--output-dir", "b", "--", "x"],
     "--output-dir was given more than once"),
    (["--workload-dir", "w2", "--", "x"], "--workload-dir was given more than once"),
    (["--work", "w", "--", "x"], "unrecognized arguments: --work"),
    (["--col", "80", "--rows", "24", "--", "x"], "unrecognized arguments: --col"),
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


@pytest.mark.parametrize("argv, message", [
    (["stage", "a.yaml", "--dir", "x", "--dir", "y"], "--dir was given more than once"),
    (["stage", "a.yaml", "--di", "x"], "the following arguments are required: --dir"),
    (["build", "--dir", "x", "--dir", "y"], "--dir was given more than once"),
    (["controlled-session", "cleanup", "--workload", "x"], "unrecognized arguments: --workload"),
])
def test_every_command_refuses_abbreviations_and_repeated_options(argv: list[str],
                                                                  message: str) -> None:
    proc = run_reploy(*argv)
    assert proc.returncode == 2 and proc.stdout == b""
    assert message in proc.stderr.decode()


#: Every command of `reploy`, in the order its help lists them: serve and session too, though
#: reploy_serve.py runs them.
COMMANDS = ("stage", "build", "controlled-session", "serve", "session")


def test_the_help_lists_every_command() -> None:
    proc = run_reploy("--help")
    assert proc.returncode == 0
    assert re.findall(r"^ {4}([a-z-]+)", proc.stdout.decode(), re.M) == list(COMMANDS)


def test_an_unknown_command_is_a_usage_error_that_names_every_command() -> None:
    proc = run_reploy("nosuch")
    assert proc.returncode == 2 and proc.stdout == b""
    stderr = proc.stderr.decode()
    assert "invalid choice: 'nosuch'" in stderr
    assert re.findall(r"'([a-z-]+)'", stderr.split("choose from", 1)[1]) == list(COMMANDS)


def parser_actions(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.Action]]:
    """Each argument of `parser` and of its commands, with the command it belongs to; a
    command's own entry in its parent's list counts as one."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from ((parser.prog, choice) for choice in action._choices_actions)
            for command in action.choices.values():
                yield from parser_actions(command)
        else:
            yield parser.prog, action


def test_every_command_and_option_has_help_that_gives_its_default() -> None:
    """An option not required says its default; one required says so."""
    import reploy

    unexplained = []
    for prog, action in parser_actions(reploy.build_parser()):
        optional = action.option_strings and not isinstance(
            action, (argparse._HelpAction, argparse._VersionAction))
        if not action.help or optional and not re.search(
                r"\bdefault\b" if not action.required else r"\(required\)", action.help):
            unexplained.append(f"{prog} {'/'.join(action.option_strings) or action.dest}")
    assert unexplained == []


def test_a_repeatable_option_may_be_repeated(tmp_path: Path) -> None:
    """--endpoint (a grant each) and cleanup's --workload-dir are lists, not single values."""
    proc = run_reploy(*run_args(tmp_path / "c", tmp_path / "w", "--endpoint", "a",
                                "--endpoint", "b", "--", "x"))
    assert proc.returncode == 1 and json.loads(proc.stdout)["error"].startswith(
        "admission rejected")


def test_missing_required_directories_is_usage_error() -> None:
    proc = run_reploy("controlled-session", "run", "--", "x")
    assert proc.returncode == 2 and proc.stdout == b""
    assert "--controller-dir" in proc.stderr.decode()


def admission_error(proc) -> str:  # noqa: ANN001
    assert proc.returncode == 1, proc.stderr.decode()
    result = contract_rules.check_reploy_result_line(proc.stdout)
    assert result["ok"] is False
    assert result["session_result"] is None and result["controller_output"] is None
    return result["error"]


def plan_rejected_line(path: Path) -> dict:
    """A fixture file's plan-rejected line."""
    return next(json.loads(line) for line in path.read_text().splitlines()
                if json.loads(line)["error"].startswith("plan rejected"))


#: The project's own plan-rejected fixture line: the shape every plan rejection prints. It is
#: the shared golden fixture's shape (test_the_plan_rejected_shape_is_the_shared_one).
GOLDEN_PLAN_REJECTED = plan_rejected_line(ROOT / "testdata/controlled-session/run-results.jsonl")


def test_the_plan_rejected_shape_is_the_shared_one() -> None:
    shared = plan_rejected_line(require_shared_fixture("run-results-v1.jsonl"))
    assert {**shared, "error": None} == {**GOLDEN_PLAN_REJECTED, "error": None}


def plan_rejection(proc, output: str = "not-requested") -> str:  # noqa: ANN001
    """A plan rejection: the golden fixture's shape, with its own error text."""
    assert proc.returncode == 1, proc.stderr.decode()
    assert proc.stdout.count(b"\n") == 1
    result = contract_rules.check_reploy_result_line(proc.stdout)
    assert result["error"].startswith("plan rejected: ")
    assert {**result, "error": None, "controller_output": None} == {
        **GOLDEN_PLAN_REJECTED, "error": None, "controller_output": None}
    assert result["controller_output"]["kind"] == output
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
    error = plan_rejection(run_reploy(*run_args(controller, workload, "--", "rm", "-rf")))
    assert "'rm' is not a command declared" in error
    source = tmp_path / "nonnative"
    shutil.copytree(CONTROLLER.parent, source)
    blueprint = source / "controller.blueprint.yaml"
    blueprint.write_text(blueprint.read_text().replace("native_command: true",
                                                       "native_command: false"))
    nonnative = staged(tmp_path, blueprint, "n")
    error = plan_rejection(run_reploy(*run_args(nonnative, workload, "--", "run-controller")))
    assert "not declared native_command: true" in error


def test_undeclared_endpoint_is_rejected(tmp_path: Path) -> None:
    controller = staged(tmp_path, CONTROLLER, "c")
    workload = staged(tmp_path, WORKLOAD, "w")
    error = plan_rejection(run_reploy(*run_args(controller, workload, "--endpoint", "db",
                                                "--", "run-controller")))
    assert "endpoint 'db' is not declared" in error
    # The requested output kind is reported: the directory exists and is kept as it was.
    (tmp_path / "o").mkdir()
    plan_rejection(run_reploy(*run_args(controller, workload, "--endpoint", "db", "--output-dir",
                                        str(tmp_path / "o"), "--", "run-controller")),
                   output="directory-retained")
    plan_rejection(run_reploy(*run_args(controller, workload, "--endpoint", "db", "--output-file",
                                        str(tmp_path / "o/f"), "--", "run-controller")),
                   output="file-discarded")
    assert list((tmp_path / "o").iterdir()) == []


def test_private_env_is_rejected(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(WORKLOAD.parent, source)
    (source / ".env").write_text("TOKEN=secret\n")
    proc = run_reploy("stage", str(source / "workload.blueprint.yaml"), "--dir",
                      str(tmp_path / "w"))
    assert json.loads(proc.stdout)["private_env"] is True
    assert (tmp_path / "w/.env").stat().st_mode & 0o777 == 0o600
    assert not (tmp_path / "w/context/.env").exists()  # never baked into the image
    mark_built(tmp_path / "w")
    controller = staged(tmp_path, CONTROLLER, "c")
    error = admission_error(run_reploy(*run_args(controller, tmp_path / "w", "--",
                                                 "run-controller")))
    assert error == (f"admission rejected: the workload deployment {tmp_path / 'w'} was built "
                     "with a private environment; controlled sessions do not support it")


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


def test_output_dir_that_is_not_a_directory_is_refused_at_admission(tmp_path: Path) -> None:
    """Refused before the session owns anything, as --output-file's checks are; not a startup
    failure with an errno and a null controller_output."""
    controller = staged(tmp_path, CONTROLLER, "c")
    workload = staged(tmp_path, WORKLOAD, "w")
    (tmp_path / "a-file").write_text("")
    for destination in (tmp_path / "a-file", tmp_path / "a-file/below"):
        error = admission_error(run_reploy(*run_args(
            controller, workload, "--output-dir", str(destination), "--", "run-controller")))
        assert error == f"admission rejected: --output-dir: {tmp_path / 'a-file'} exists and " \
            "is not a directory"


def test_root_controller_cannot_use_outputs(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(CONTROLLER.parent, source)
    blueprint = source / "controller.blueprint.yaml"
    blueprint.write_text(blueprint.read_text().replace('"1000:1000"', '"0:0"'))
    controller = staged(tmp_path, blueprint, "c")
    workload = staged(tmp_path, WORKLOAD, "w")
    error = plan_rejection(run_reploy(*run_args(
        controller, workload, "--output-dir", str(tmp_path / "o"), "--", "run-controller")),
        output="failed")
    assert "non-root controller runtime" in error
    assert not (tmp_path / "o").exists()


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


# ---------------------------------------------------------------------------------------------
# After valid parsing, exactly one JSON object on stdout, whatever happens
# ---------------------------------------------------------------------------------------------


def one_result(proc) -> dict:  # noqa: ANN001
    assert proc.returncode == 1, proc.stderr.decode()
    assert b"Traceback" not in proc.stderr, proc.stderr.decode()
    assert proc.stdout.count(b"\n") == 1 and proc.stdout.endswith(b"\n")
    return contract_rules.check_reploy_result_line(proc.stdout)


@pytest.mark.parametrize("corrupt,message", [
    (lambda state: [state], "must be a JSON object"),
    (lambda state: {k: v for k, v in state.items() if k != "deployment_id"},
     "missing key(s) deployment_id"),
    (lambda state: {**state, "surprise": 1}, "unknown key(s) surprise"),
    (lambda state: {**state, "deployment_id": 7}, "deployment_id has the wrong type"),
    (lambda state: {**state, "deployment_id": "../x"}, "not 32 hex digits"),
    (lambda state: {**state, "current_generation": {**state["current_generation"], "x": 1}},
     "current_generation: unknown key(s) x"),
    (lambda state: {**state, "current_generation": {"number": 1}}, "missing key(s)"),
    (lambda state: {**state, "current_generation": []}, "current_generation has the wrong type"),
    (lambda state: {**state, "current_generation": {**state["current_generation"],
                                                     "number": True}}, "number has the wrong"),
])
def test_corrupt_state_is_one_clear_result(tmp_path: Path, corrupt, message: str) -> None:  # noqa: ANN001
    controller = staged(tmp_path, CONTROLLER, "c")
    workload = staged(tmp_path, WORKLOAD, "w")
    state_file = workload / ".reploy/state.json"
    state_file.write_text(json.dumps(corrupt(json.loads(state_file.read_text()))))
    result = one_result(run_reploy(*run_args(controller, workload, "--", "run-controller")))
    assert result["error"].startswith("admission rejected: ") and message in result["error"]
    assert str(state_file) in result["error"]


@pytest.mark.parametrize("content", [b"", b"{", b"\xff\xfe", b"null", b'"text"'])
def test_unreadable_state_is_one_clear_result(tmp_path: Path, content: bytes) -> None:
    controller = staged(tmp_path, CONTROLLER, "c")
    workload = staged(tmp_path, WORKLOAD, "w")
    (workload / ".reploy/state.json").write_bytes(content)
    result = one_result(run_reploy(*run_args(controller, workload, "--", "run-controller")))
    assert result["error"].startswith("admission rejected: ")


def test_non_utf8_directory_is_one_clear_result(tmp_path: Path) -> None:
    controller = staged(tmp_path, CONTROLLER, "c")
    odd = os.fsencode(tmp_path) + b"/w-\xff"
    proc = subprocess.run([sys.executable, str(ROOT / "reploy.py"), "controlled-session", "run",
                           "--controller-dir", str(controller), "--workload-dir", odd,
                           "--", "run-controller"], capture_output=True, timeout=60)
    result = one_result(proc)
    assert result["error"] == (f"admission rejected: --workload-dir: {tmp_path}/w-\\xff "
                               "is not a UTF-8 path")


def test_staging_into_a_non_utf8_directory_prints_json(tmp_path: Path) -> None:
    odd = os.fsencode(tmp_path) + b"/s-\xff"
    proc = subprocess.run([sys.executable, str(ROOT / "reploy.py"), "stage", str(WORKLOAD),
                           "--dir", odd], capture_output=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.count(b"\n") == 1, proc.stderr.decode()
    assert json.loads(proc.stdout)["dir"] == f"{tmp_path}/s-\\xff"


@pytest.mark.parametrize("duration", ["9" * 400 + "s", "1s\n", "\u0661s", "1.0001s", "1.5ms",
                                      "1e3s", ".5s", "1.s", " 1s", "1 s", "-1s", "+1s"])
def test_bad_durations_are_usage_errors(tmp_path: Path, duration: str) -> None:
    proc = run_reploy(*run_args(tmp_path / "c", tmp_path / "w", "--cleanup-timeout", duration,
                                "--", "x"))
    assert proc.returncode == 2 and proc.stdout == b""
    assert "--cleanup-timeout" in proc.stderr.decode() and b"Traceback" not in proc.stderr


def test_exact_decimal_durations_are_accepted(tmp_path: Path) -> None:
    """1.001s is exactly 1001 ms (a float would make it 1000.9999...); it parses, so the run
    goes on to admission (which fails here, nothing being staged)."""
    proc = run_reploy(*run_args(tmp_path / "c", tmp_path / "w", "--cleanup-timeout", "1.001s",
                                "--termination-grace", "0.1s", "--", "x"))
    assert json.loads(proc.stdout)["error"].startswith("admission rejected")


# ---------------------------------------------------------------------------------------------
# Authority comes from the built generation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("role, declared, argv, message", [
    ("w", "web: {scheme: http, port: 8080}\n          admin: {scheme: http, port: 9090}",
     ["--endpoint", "admin", "--", "run-controller"], "endpoint 'admin' is not declared"),
    ("c", "trigger: [run-controller]\n    sneak:\n      executable: controller.main\n"
     "      native_command: true\n      trigger: [sneak]",
     ["--", "sneak"], "'sneak' is not a command declared"),
], ids=["endpoint", "command"])
def test_a_declaration_added_without_a_rebuild_grants_nothing(
        tmp_path: Path, role: str, declared: str, argv: list[str], message: str) -> None:
    """Staged blueprint.yaml edits count only after `reploy build`: authority comes from the
    blueprint recorded with the current generation."""
    directories = {"c": staged(tmp_path, CONTROLLER, "c"), "w": staged(tmp_path, WORKLOAD, "w")}
    blueprint = directories[role] / "blueprint.yaml"
    anchor = declared.split("\n")[0]
    assert anchor in blueprint.read_text()
    blueprint.write_text(blueprint.read_text().replace(anchor, declared))
    error = plan_rejection(run_reploy(*run_args(directories["c"], directories["w"], *argv)))
    assert message in error


def planned(controller: Path, workload: Path, *argv: str) -> tuple:
    """What a session is granted, as admission and planning decide it in the host: the two
    blueprints (runtime uid:gid, writable paths, limits, commands...), the controller's argv
    and the endpoints. (argv: host options, then `--` and the command.)"""
    import reploy

    cut = list(argv).index("--")
    options = reploy.parse_run_options(reploy.build_parser().parse_args(
        run_args(controller, workload, *argv[:cut])), list(argv[cut + 1:]))
    plan = reploy.plan(options, *reploy.admit(options))
    return (plan.controller_blueprint, plan.workload_blueprint, plan.controller_argv,
            plan.endpoints)


#: (role, text in the staged blueprint, what an edit makes of it): each field that grants or
#: refuses authority, changed in the staged file only.
STAGED_EDITS = {
    "controller uid:gid": ("c", 'user: "1000:1000"', 'user: "0:0"'),
    "workload uid:gid": ("w", 'user: "1000:1000"', 'user: "2000:2000"'),
    "writable paths": ("w", "writable_paths: [/tmp]", "writable_paths: [/tmp, /etc, /project]"),
    "controller writable paths": ("c", "    pids: 128",
                                  "    pids: 128\n    writable_paths: [/opt]"),
    "memory": ("c", "memory_mib: 256", "memory_mib: 4096"),
    "pids": ("w", "pids: 64", "pids: 4096"),
    "argv": ("c", "argv: [python3, /opt/controller/main.py]", "argv: [sh, -c, 'rm -rf /']"),
    "trigger": ("c", "trigger: [run-controller]", "trigger: [run-controller, --force]"),
    "endpoint port": ("w", "web: {scheme: http, port: 8080}", "web: {scheme: http, port: 22}"),
    "endpoint scheme": ("w", "web: {scheme: http, port: 8080}", "web: {scheme: tcp, port: 8080}"),
}


@pytest.mark.parametrize("role, text, edited", STAGED_EDITS.values(), ids=STAGED_EDITS.keys())
def test_a_staged_edit_without_a_rebuild_changes_nothing(tmp_path: Path, role: str, text: str,
                                                         edited: str) -> None:
    directories = {"c": staged(tmp_path, CONTROLLER, "c"), "w": staged(tmp_path, WORKLOAD, "w")}
    argv = ("--endpoint", "web", "--", "run-controller", "--verbose")
    before = planned(directories["c"], directories["w"], *argv)
    blueprint = directories[role] / "blueprint.yaml"
    assert text in blueprint.read_text()
    blueprint.write_text(blueprint.read_text().replace(text, edited))
    assert planned(directories["c"], directories["w"], *argv) == before


@pytest.mark.parametrize("built_with, staged_with", [(True, False), (False, True)],
                         ids=["dropped-after-build", "added-after-build"])
@pytest.mark.parametrize("how", ["env-file", "blueprint-field"])
def test_the_private_environment_is_the_built_generations(tmp_path: Path, how: str,
                                                          built_with: bool,
                                                          staged_with: bool) -> None:
    """A generation built with a private environment stays refused once the staging directory
    drops it; one built without it is not refused for what was staged after the build."""
    import reploy

    workload = staged(tmp_path, WORKLOAD, "w", built=False)
    blueprint = workload / "blueprint.yaml"
    plain = blueprint.read_text()
    with_field = plain.replace("  workload:\n", "  private_env: {TOKEN: x}\n  workload:\n")

    def set_private(present: bool) -> None:
        if how == "env-file":
            if present:
                (workload / ".env").write_text("TOKEN=secret\n")
            else:
                (workload / ".env").unlink(missing_ok=True)
        else:
            blueprint.write_text(with_field if present else plain)

    set_private(built_with)
    mark_built(workload)
    set_private(staged_with)
    options = reploy.parse_run_options(reploy.build_parser().parse_args(run_args(
        staged(tmp_path, CONTROLLER, "c"), workload)), ["run-controller"])
    if built_with:
        with pytest.raises(reploy.AdmissionError, match="built with a private environment"):
            reploy.admit(options)
    else:
        reploy.admit(options)


def test_an_older_generation_without_its_blueprint(tmp_path: Path) -> None:
    """State from before blueprints were recorded: used while the staged blueprint is the one
    it was built from (same digest), refused clearly once it differs."""
    controller = staged(tmp_path, CONTROLLER, "c")
    workload = staged(tmp_path, WORKLOAD, "w")
    state_file = workload / ".reploy/state.json"
    state = json.loads(state_file.read_text())
    del state["current_generation"]["blueprint_text"]
    state_file.write_text(json.dumps(state))
    error = plan_rejection(run_reploy(*run_args(controller, workload, "--endpoint", "admin",
                                                "--", "run-controller")))
    assert "endpoint 'admin' is not declared" in error  # planned from the unchanged blueprint
    blueprint = workload / "blueprint.yaml"
    blueprint.write_text(blueprint.read_text() + "\n")
    error = plan_rejection(run_reploy(*run_args(controller, workload, "--", "run-controller")))
    assert "older reploy" in error and "run reploy build" in error


def test_the_recorded_blueprint_must_match_its_digest(tmp_path: Path) -> None:
    controller = staged(tmp_path, CONTROLLER, "c")
    workload = staged(tmp_path, WORKLOAD, "w")
    state_file = workload / ".reploy/state.json"
    state = json.loads(state_file.read_text())
    state["current_generation"]["blueprint_text"] += "# edited\n"
    state_file.write_text(json.dumps(state))
    error = plan_rejection(run_reploy(*run_args(controller, workload, "--", "run-controller")))
    assert "does not match its digest" in error


def test_a_repeated_endpoint_is_one_grant(tmp_path: Path) -> None:
    import reploy

    controller = staged(tmp_path, CONTROLLER, "c")
    workload = staged(tmp_path, WORKLOAD, "w")
    options = reploy.parse_run_options(reploy.build_parser().parse_args(
        run_args(controller, workload, "--endpoint", "web", "--endpoint", "web")),
        ["run-controller"])
    planned = reploy.plan(options, *reploy.admit(options))
    assert [endpoint.id for endpoint in planned.endpoints] == ["web"]


# ---------------------------------------------------------------------------------------------
# Output directories: used as they are, never re-owned; unreachable ones refused by name
# ---------------------------------------------------------------------------------------------


def test_an_existing_output_dir_the_controller_cannot_write_is_refused(tmp_path: Path) -> None:
    """Reploy never re-owns or re-modes an existing directory (run as root, `--output-dir
    /tmp` once made /tmp the controller's): one the controller cannot write is refused."""
    controller = staged(tmp_path, CONTROLLER, "c")
    workload = staged(tmp_path, WORKLOAD, "w")
    out = tmp_path / "out"
    out.mkdir(mode=0o755)
    os.chown(out, 0, 0)
    error = plan_rejection(run_reploy(*run_args(controller, workload, "--output-dir", str(out),
                                                "--", "run-controller")),
                           output="directory-retained")
    assert error == (f"plan rejected: --output-dir: the controller's runtime 1000:1000 cannot "
                     f"write {out} (owner 0:0, mode 0755); Reploy never changes an existing "
                     "directory's owner or mode")
    assert (out.stat().st_uid, out.stat().st_gid, out.stat().st_mode & 0o7777) == (0, 0, 0o755)


@pytest.mark.parametrize("owner, mode", [((1000, 1000), 0o700), ((0, 1000), 0o2770),
                                         ((0, 0), 0o1777)])
def test_an_existing_output_dir_the_controller_can_write_is_planned_as_it_is(
        tmp_path: Path, owner: tuple[int, int], mode: int) -> None:
    controller = staged(tmp_path, CONTROLLER, "c")
    workload = staged(tmp_path, WORKLOAD, "w")
    out = tmp_path / "out"
    out.mkdir()
    os.chown(out, *owner)
    out.chmod(mode)
    planned(controller, workload, "--output-dir", str(out), "--", "run-controller")
    assert (out.stat().st_uid, out.stat().st_gid, out.stat().st_mode & 0o7777) == (*owner, mode)


#: Runs the host without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH: as root, it then meets
#: permission bits like any user (setpriv is util-linux's, in every Debian).
WITHOUT_DAC_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
                        "--inh-caps=-all"]


@pytest.mark.parametrize("option, below", [
    ("--output-dir", "out"), ("--output-dir", "out/deeper"), ("--output-file", "out.cast"),
    ("--output-file", "sub/out.cast")])
def test_an_output_path_under_a_parent_the_host_cannot_search_is_refused_by_name(
        tmp_path: Path, option: str, below: str) -> None:
    controller = staged(tmp_path, CONTROLLER, "c")
    workload = staged(tmp_path, WORKLOAD, "w")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    os.chown(locked, 1000, 1000)  # not the host's: it may not enter
    target = locked / below
    proc = subprocess.run([*WITHOUT_DAC_OVERRIDE, sys.executable, str(ROOT / "reploy.py"),
                           *run_args(controller, workload, option, str(target), "--",
                                     "run-controller")], capture_output=True, timeout=60)
    error = admission_error(proc)
    reached = target if option == "--output-dir" else target.parent
    first = locked / below.split("/")[0]
    assert error in (f"admission rejected: {option}: cannot reach {reached}: Permission denied",
                     f"admission rejected: {option}: cannot reach {first}: Permission denied")
    assert b"Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------------
# Signals before the session: admission blocked on a FIFO
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.parametrize("then", ["nothing", "a rejection"])
def test_a_signal_ends_an_admission_that_blocks(tmp_path: Path, signum: int, code: int,
                                                then: str) -> None:
    """state.json is a FIFO that stays empty: admission blocks reading it. A signal ends the
    run at once: 130/143 and one result, nothing else decided. A rejection admission finds
    after the signal (the FIFO then gets content that refuses the run) exits 130/143 all the
    same, its error naming the signal."""
    controller = staged(tmp_path, CONTROLLER, "c")
    workload = staged(tmp_path, WORKLOAD, "w")
    state = controller / ".reploy/state.json"
    state.unlink()
    os.mkfifo(state)
    proc = subprocess.Popen([sys.executable, str(ROOT / "reploy.py"),
                             *run_args(controller, workload, "--", "run-controller")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    writer = None
    try:
        deadline = time.monotonic() + 30
        while writer is None:  # opens once admission has the FIFO open (or is opening it)
            try:
                writer = os.open(state, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:  # ENXIO: no reader yet
                assert e.errno == errno.ENXIO and proc.poll() is None, proc.stderr
                assert time.monotonic() < deadline, "admission never opened state.json"
                time.sleep(0.02)  # polling for a condition, with a deadline
        proc.send_signal(signum)
        if then == "a rejection":
            os.write(writer, b"{}")
            os.close(writer)
            writer = None
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
        if writer is not None:
            os.close(writer)
        state.unlink()  # a FIFO left behind would block whoever reads the deployment next
    assert proc.returncode == code, stderr
    result = contract_rules.check_reploy_result_line(stdout)
    name = signal.Signals(signum).name
    if then == "nothing":
        assert result["error"] == f"cancelled by {name}"
        assert all(result[key] is None for key in contract_rules.RESULT_KEYS[3:])
    else:  # the signal and the rejection race: either way, the signal decides the exit code
        assert result["error"] == f"cancelled by {name}" or (
            result["error"].startswith("admission rejected: ")
            and result["error"].endswith(f"; received {name}")), result["error"]
