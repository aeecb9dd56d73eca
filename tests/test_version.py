"""One release version: the same `__version__` in the five role files, shown by `--version`."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

import agent
import reploy
import reploy_serve
import reploy_session_client
import reploy_watchdog


def test_the_five_role_files_carry_one_version() -> None:
    versions = {module.__name__: module.__version__
                for module in (reploy, reploy_serve, reploy_session_client, reploy_watchdog, agent)}
    assert len(set(versions.values())) == 1, versions
    assert re.fullmatch(r"\d+\.\d+\.\d+", reploy.__version__)


@pytest.mark.parametrize("script,prog", [
    ("reploy.py", "reploy"),
    ("reploy_serve.py", "reploy"),
    ("reploy_session_client.py", "reploy-session-client"),
    ("agent.py", "agent.py"),
    ("reploy_watchdog.py", "reploy_watchdog"),
])
def test_version_flag_prints_it_and_exits_0(script: str, prog: str) -> None:
    # An engine address that cannot answer: --version must not need Docker.
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    proc = subprocess.run([sys.executable, str(ROOT / script), "--version"], capture_output=True,
                          timeout=30, env=env)
    assert (proc.returncode, proc.stderr) == (0, b"")
    assert proc.stdout.decode() == f"{prog} {reploy.__version__}\n"
