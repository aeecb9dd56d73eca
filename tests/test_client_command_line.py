"""reploy-session-client's command line: the two lines every session runs are taken without
argparse (parse_command), and every other line means what argparse makes of it, usage errors
(exit 2, stderr) included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import reploy_session_client as client

CLIENT = Path(__file__).resolve().parent.parent / "reploy_session_client.py"


def argparse_reading(argv: list[str]) -> tuple[str, object]:
    args = client.build_parser().parse_args(argv)
    return args.mode, getattr(args, "socket", None)


@pytest.mark.parametrize("argv", [
    ["client"],
    ["probe"],
    ["attach", "--socket", "/home/u/reploy-controlled-session-x/terminal.sock"],
    ["attach", "--socket", "relative path with spaces"],
    ["attach", "--socket=/s/terminal.sock"],
    ["attach", "--socket", "a", "--socket", "b"],
    ["attach", "--sock", "/s"],  # argparse's abbreviation
    ["attach", "--socket", ""],
    ["attach", "--socket", "-"],
])
def test_every_valid_line_means_what_argparse_makes_of_it(argv: list[str]) -> None:
    assert client.parse_command(argv) == argparse_reading(argv)


@pytest.mark.parametrize("argv", [
    [], ["client", "extra"], ["attach"], ["attach", "--socket"], ["attach", "--socket", "-x"],
    ["attach", "/s"], ["--socket", "/s", "attach"], ["clients"],
])
def test_every_other_line_is_argparse_s_usage_error(argv: list[str]) -> None:
    proc = subprocess.run([sys.executable, str(CLIENT), *argv], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=30)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "usage: reploy-session-client" in proc.stderr


@pytest.mark.parametrize("argv", [["client"], ["attach", "--socket", "/s/terminal.sock"]])
def test_the_lines_every_session_runs_never_import_argparse(argv: list[str]) -> None:
    probe = (f"import sys; sys.path.insert(0, {str(CLIENT.parent)!r}); "
             f"import reploy_session_client as c; print(c.parse_command({argv!r})); "
             "print('argparse' in sys.modules)")
    proc = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True,
                          check=True, timeout=30)
    mode = argv[0]
    assert proc.stdout.splitlines()[0].startswith(f"('{mode}'")
    assert proc.stdout.splitlines()[1] == "False"
