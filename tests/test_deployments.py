"""Deployments on the real engine: builds, generations, the derived controller image."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import docker.errors
import pytest

import reploy
from conftest import LABEL_RUN, ROOT, run_reploy, stage_and_build

pytestmark = pytest.mark.docker


def test_builds_record_generations_atomically(docker_engine: Any, tmp_path: Path) -> None:
    first = stage_and_build(ROOT / "examples/workload/workload.blueprint.yaml", tmp_path / "w")
    proc = run_reploy("build", "--dir", str(tmp_path / "w"))
    second = json.loads(proc.stdout)
    assert proc.returncode == 0 and second["ok"] is True
    assert first["generation"]["number"] == 1 and second["generation"]["number"] == 2
    assert first["deployment_id"] == second["deployment_id"]
    state = json.loads((tmp_path / "w/.reploy/state.json").read_text())
    recorded = state["current_generation"].pop("blueprint_text")
    assert state["current_generation"] == second["generation"]
    # The generation keeps the exact blueprint it was built from: a session's authority.
    assert recorded == (tmp_path / "w/blueprint.yaml").read_text()
    assert hashlib.sha256(recorded.encode()).hexdigest() == second["generation"][
        "blueprint_digest"]
    assert [p.name for p in (tmp_path / "w/.reploy").iterdir()] == ["state.json"]  # no temp files
    image = docker_engine.images.get(second["generation"]["image_id"])
    assert image.labels[reploy.LABEL_DEPLOYMENT] == second["deployment_id"]
    assert second["generation"]["reference"] in image.tags


def test_build_failure_keeps_the_current_generation(docker_engine: Any, tmp_path: Path) -> None:
    stage_and_build(ROOT / "examples/workload/workload.blueprint.yaml", tmp_path / "w")
    before = (tmp_path / "w/.reploy/state.json").read_text()
    (tmp_path / "w/context/Dockerfile").write_text("FROM reploy-base/busybox:1\nRUN exit 3\n")
    proc = run_reploy("build", "--dir", str(tmp_path / "w"))
    assert proc.returncode == 1 and json.loads(proc.stdout)["ok"] is False
    assert (tmp_path / "w/.reploy/state.json").read_text() == before


def test_derived_controller_image_is_cached_and_adds_one_layer(docker_engine: Any,
                                                               deployments: dict[str, Path]) -> None:
    backend = reploy.DockerBackend()
    controller = reploy.load_deployment(deployments["controller"])
    base_id = controller.current.image_id
    first = reploy.ensure_controller_image(backend, base_id)
    second = reploy.ensure_controller_image(backend, base_id)
    assert first == second
    derived = docker_engine.images.get(first)
    base = docker_engine.images.get(base_id)
    assert derived.attrs["RootFS"]["Layers"][:-1] == base.attrs["RootFS"]["Layers"]
    assert derived.labels[reploy.LABEL_DERIVED_BASE] == base_id


def test_the_derived_image_runs_the_client_from_the_layers_bytecode(
        docker_engine: Any, deployments: dict[str, Path]) -> None:
    """In the example controller (Debian's python3, this interpreter's version), on a
    read-only root as in a session, the installed command imports the client from the
    bytecode the host compiled into the layer: the broker and `attach` compile nothing."""
    controller = reploy.load_deployment(deployments["controller"])
    derived = reploy.ensure_controller_image(reploy.DockerBackend(), controller.current.image_id)
    bytecode = (f"{reploy.CLIENT_MODULE_DIR}/__pycache__/reploy_session_client."
                f"{sys.implementation.cache_tag}.pyc")
    container = docker_engine.containers.create(
        derived, ["reploy-session-client", "--version"], user="1000:1000", read_only=True,
        environment={"PYTHONVERBOSE": "1"}, labels={LABEL_RUN: "h5-derived-bytecode"})
    try:
        container.start()
        assert container.wait(timeout=60)["StatusCode"] == 0
        assert container.logs(stdout=True, stderr=False) == \
            f"reploy-session-client {reploy.__version__}\n".encode()
        assert f"code object from '{bytecode}'".encode() in container.logs(stdout=False,
                                                                          stderr=True)
    finally:
        container.remove(force=True)


def test_controller_without_python_is_refused_clearly(docker_engine: Any,
                                                      deployments: dict[str, Path],
                                                      tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(ROOT / "examples/controller", source)
    (source / "context/Dockerfile").write_text("FROM reploy-base/busybox:1\n")
    stage_and_build(source / "controller.blueprint.yaml", tmp_path / "c")
    proc = run_reploy("controlled-session", "run", "--controller-dir", str(tmp_path / "c"),
                      "--workload-dir", str(deployments["workload"]), "--", "run-controller")
    result = json.loads(proc.stdout)
    assert proc.returncode == 1 and result["ok"] is False
    assert result["error"].startswith("plan rejected: ")  # nothing of the session ran
    assert "must provide python3" in result["error"]
    assert result["session_result"] is None
    assert not any(t.startswith("reploy/controller-derived") for image in
                   docker_engine.images.list() for t in image.tags
                   if image.labels.get(reploy.LABEL_DERIVED_BASE) ==
                   json.loads((tmp_path / "c/.reploy/state.json").read_text())[
                       "current_generation"]["image_id"])


def test_killing_a_container_that_is_not_running_is_not_an_error(docker_engine: Any) -> None:
    """The termination grace's SIGKILL can reach a workload that just exited on its own: the
    Engine answers 409 (not running), which is what the kill wanted, so nobody is told of a
    failure (the `could not kill the workload: 409` note)."""
    container_id = docker_engine.api.create_container(
        "reploy-base/busybox:1", command=["true"], labels={LABEL_RUN: "i10-kill-check"})["Id"]
    try:
        with pytest.raises(docker.errors.APIError) as refused:
            docker_engine.api.kill(container_id, signal="SIGKILL")
        assert refused.value.status_code == 409  # what the Engine says to a plain kill
        reploy.kill_if_running(docker_engine.api, container_id, "SIGKILL")  # quiet
        reploy.remove_container_quietly(docker_engine.api, container_id)
        reploy.kill_if_running(docker_engine.api, container_id, "SIGKILL")  # gone: quiet too
    finally:
        reploy.remove_container_quietly(docker_engine.api, container_id)


def test_the_workload_shell_check_reads_the_engines_stat_of_the_created_container(
        docker_engine: Any, tmp_path: Path) -> None:
    """The workload runs under the Engine's init, so an image whose /bin/sh cannot run is
    found before the start (seed 000's startup failure), from the created container's files."""
    (tmp_path / "Dockerfile").write_text(
        "FROM reploy-base/busybox:1\n"
        "RUN mkdir /probe && touch /probe/plain && chmod 0644 /probe/plain"
        " && ln -s /nowhere /probe/dangling && ln -s /probe/plain /probe/to-plain"
        " && ln -s /bin/busybox /probe/to-busybox && mkdir -m 0755 /probe/dir\n")
    image, _ = docker_engine.images.build(path=str(tmp_path), rm=True, forcerm=True,
                                          labels={LABEL_RUN: "h9-shell-check"})
    container = docker_engine.containers.create(image.id, ["/bin/sh"],
                                                labels={LABEL_RUN: "h9-shell-check"})
    backend = reploy.DockerBackend()
    try:
        verdicts = {path: backend.unexecutable(container.id, path) for path in (
            "/bin/sh", "/probe/to-busybox", "/probe/plain", "/probe/to-plain",
            "/probe/dangling", "/probe/dir", "/probe/missing")}
    finally:
        container.remove(force=True)
        docker_engine.images.remove(image.id, force=True)
    assert verdicts == {
        "/bin/sh": None, "/probe/to-busybox": None,
        "/probe/plain": "the image's /probe/plain is not an executable file",
        "/probe/to-plain": "the image's /probe/to-plain is not an executable file",
        "/probe/dangling": "the image has no /probe/dangling",
        "/probe/dir": "the image's /probe/dir is not an executable file",
        "/probe/missing": "the image has no /probe/missing"}


@pytest.mark.parametrize("header", [
    "", "not base64!", base64.b64encode(b"[1]").decode(), base64.b64encode(b"{").decode(),
    base64.b64encode(b'{"mode": "493"}').decode(),
    base64.b64encode(b'{"mode": true, "linkTarget": ""}').decode(),
    base64.b64encode(b'{"mode": 493, "linkTarget": 7}').decode()])
def test_an_engine_path_stat_that_is_not_the_documented_shape_is_a_backend_error(
        header: str) -> None:
    with pytest.raises(reploy.BackendError, match="path stat"):
        reploy.PathStat.parse(header)
    assert reploy.PathStat.parse(base64.b64encode(
        b'{"name": "sh", "mode": 134218239, "linkTarget": "/bin/busybox"}').decode()) == \
        reploy.PathStat(134218239, "/bin/busybox")
