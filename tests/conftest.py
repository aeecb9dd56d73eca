"""Shared test fixtures: the real Docker engine, staged test deployments, leftover checks.

Docker tests are marked `docker`. Without an engine they skip, unless REPLOY_REQUIRE_DOCKER=1
(CI), where a missing engine is a failure. Every Docker test is followed by a check that no
container or network labelled as a Reploy session resource is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LABEL_RUN = "io.reploy.session.live-run"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "docker: needs the real Docker engine")


def _engine() -> Any:
    import docker

    try:
        client = docker.from_env(timeout=60)
        client.ping()
        return client
    except Exception as e:  # noqa: BLE001 - any failure means no usable engine
        if os.environ.get("REPLOY_REQUIRE_DOCKER") == "1":
            pytest.fail(f"REPLOY_REQUIRE_DOCKER=1 but no Docker engine answers: {e}")
        pytest.skip(f"no Docker engine: {e}")


def labelled_leftovers(client: Any) -> list[str]:
    names = [f"container {c.short_id} {c.labels.get(LABEL_RUN)}"
             for c in client.containers.list(all=True, filters={"label": LABEL_RUN})]
    names += [f"network {n.name}" for n in client.networks.list(filters={"label": LABEL_RUN})]
    return names


@pytest.fixture(scope="session")
def docker_client() -> Any:
    client = _engine()
    # Sweep what an earlier, killed run may have left, so this run starts clean.
    for container in client.containers.list(all=True, filters={"label": LABEL_RUN}):
        container.remove(force=True)
    for network in client.networks.list(filters={"label": LABEL_RUN}):
        network.remove()
    yield client
    client.close()


@pytest.fixture
def docker_engine(docker_client: Any) -> Any:
    """A Docker test's engine; afterwards, nothing labelled may remain."""
    yield docker_client
    left = labelled_leftovers(docker_client)
    for container in docker_client.containers.list(all=True, filters={"label": LABEL_RUN}):
        container.remove(force=True)
    for network in docker_client.networks.list(filters={"label": LABEL_RUN}):
        network.remove()
    assert not left, f"session resources left behind: {left}"


def run_reploy(*args: str, timeout: float = 180, **kwargs: Any) -> subprocess.CompletedProcess:
    """`python3 reploy.py ARGS`, as a user runs it."""
    return subprocess.run([sys.executable, str(ROOT / "reploy.py"), *args],
                          capture_output=True, timeout=timeout, **kwargs)


def stage_and_build(blueprint: Path, directory: Path) -> dict[str, Any]:
    for command in (["stage", str(blueprint), "--dir", str(directory)],
                    ["build", "--dir", str(directory)]):
        proc = run_reploy(*command)
        assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


CONTROLLER_BLUEPRINT = """\
name: scenario-controller
build:
  context: context
environment:
  runtime:
    user: "1000:1000"
    memory_mib: 256
    pids: 128
  executables:
    scenario.main:
      argv: [python3, /opt/controller/scenario.py]
  commands:
    run-scenario:
      executable: scenario.main
      native_command: true
      trigger: [run-scenario]
"""


@pytest.fixture(scope="session")
def deployments(docker_client: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The test controller (tests/controllers) and the example workload, staged and built."""
    base = tmp_path_factory.mktemp("deployments")
    source = base / "controller-source"
    (source / "context").mkdir(parents=True)
    shutil.copy(ROOT / "examples/controller/context/reploy_driver.py", source / "context")
    shutil.copy(ROOT / "tests/controllers/scenario.py", source / "context")
    (source / "context/Dockerfile").write_text(
        "FROM reploy-base/python:bookworm-1\n"
        "COPY reploy_driver.py scenario.py /opt/controller/\n")
    (source / "controller.blueprint.yaml").write_text(CONTROLLER_BLUEPRINT)
    stage_and_build(source / "controller.blueprint.yaml", base / "controller")
    stage_and_build(ROOT / "examples/workload/workload.blueprint.yaml", base / "workload")
    return {"controller": base / "controller", "workload": base / "workload"}
