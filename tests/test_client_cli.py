"""reploy-session-client's command line: the forms USAGE shows parse to what they ask for,
anything else is a usage error (exit 2, nothing on stdout), and the real program keeps those
exit codes and streams."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT

from reploy_session_client import (
    EXIT_USAGE, USAGE, Invocation, Mode, UsageError, parse_command_line)

CLIENT = ROOT / "reploy_session_client.py"


@pytest.mark.parametrize("argv,expected", [
    (["client"], Invocation(Mode.CLIENT)),
    (["probe"], Invocation(Mode.PROBE)),
    (["attach", "--socket", "/home/x/terminal.sock"],
     Invocation(Mode.ATTACH, "/home/x/terminal.sock")),
    (["attach", "--socket=/home/x/terminal.sock"],
     Invocation(Mode.ATTACH, "/home/x/terminal.sock")),
    (["attach", "--socket", "--socket"], Invocation(Mode.ATTACH, "--socket")),
    (["--version"], Invocation(Mode.VERSION)),
    (["-h"], Invocation(Mode.HELP)),
    (["--help"], Invocation(Mode.HELP)),
    (["attach", "--help"], Invocation(Mode.HELP)),
])
def test_each_form_parses_to_what_it_asks_for(argv: list[str], expected: Invocation) -> None:
    assert parse_command_line(argv) == expected


@pytest.mark.parametrize("argv", [
    [], ["bogus"], ["client", "extra"], ["probe", "--socket", "/x"], ["attach"],
    ["attach", "--socket"], ["attach", "--socket="], ["attach", "--socket", ""],
    ["attach", "/x"], ["attach", "--socket", "/x", "extra"], ["attach", "--sock", "/x"],
    ["--version", "client"], ["client", "--socket", "/x", "-h", "more"],
])
def test_anything_else_is_a_usage_error(argv: list[str]) -> None:
    with pytest.raises(UsageError):
        parse_command_line(argv)


def run_client(*argv: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, str(CLIENT), *argv], capture_output=True,
                          timeout=30, stdin=subprocess.DEVNULL)


def test_a_usage_error_exits_2_with_the_usage_on_stderr_only() -> None:
    proc = run_client("attach", "--sock", "/x")
    assert (proc.returncode, proc.stdout) == (EXIT_USAGE, b"")
    assert proc.stderr.decode().startswith(USAGE.splitlines()[0] + "\n")
    assert "attach takes exactly --socket PATH" in proc.stderr.decode()


def test_help_goes_to_stdout_and_exits_0() -> None:
    proc = run_client("--help")
    assert (proc.returncode, proc.stdout.decode(), proc.stderr) == (0, USAGE, b"")
