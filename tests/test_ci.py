"""`.ci/run`, the CI entry point, in a stand-in checkout whose Makefile only reports what
`make lint` and `make test` would be given: the conformance fixtures beside the checkout are
required, lint runs first, and the Kubernetes cluster is up for the tests and down after."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from conftest import ROOT

REPORTING_MAKEFILE = ("lint:\n\t@echo lint\n"
                      "kube-up:\n\t@echo kube-up >&2\n"
                      "test:\n\t@echo \"$$REPLOY_CONFORMANCE_DIR|$$REPLOY_REQUIRE_CONFORMANCE|"
                      "$$REPLOY_REQUIRE_DOCKER|$$REPLOY_REQUIRE_KUBERNETES\"\n"
                      "kube-down:\n\t@echo kube-down\n")


def checkout(tmp_path: Path) -> Path:
    directory = tmp_path / "checkout"
    (directory / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci/run", directory / ".ci/run")
    (directory / "Makefile").write_text(REPORTING_MAKEFILE)
    return directory


def test_ci_fails_without_the_shared_fixtures_beside_the_checkout(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(checkout(tmp_path) / ".ci/run")], capture_output=True,
                          timeout=60)
    assert proc.returncode == 1 and proc.stdout == b""
    assert b"shared/conformance/reploy-v1 is missing" in proc.stderr


def test_ci_requires_the_shared_fixtures_by_their_absolute_path(tmp_path: Path) -> None:
    directory = checkout(tmp_path)
    (tmp_path / "shared/conformance/reploy-v1").mkdir(parents=True)
    proc = subprocess.run(["bash", ".ci/run"], cwd=directory, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().split() == [
        "lint", f"{tmp_path}/shared/conformance/reploy-v1|1|1|1", "kube-down"]
    assert proc.stderr.decode().split() == ["kube-up"]


def test_a_clone_elsewhere_finds_the_fixtures_beside_the_repository_it_came_from(
        tmp_path: Path) -> None:
    """A fresh clone in a temp dir has no ../shared; the repository it was cloned from does."""
    origin = tmp_path / "work/main"
    origin.mkdir(parents=True)
    (tmp_path / "work/shared/conformance/reploy-v1").mkdir(parents=True)
    directory = checkout(tmp_path / "elsewhere")
    subprocess.run(["git", "init", "-q", str(directory)], check=True, timeout=60)
    subprocess.run(["git", "-C", str(directory), "remote", "add", "origin", str(origin)],
                   check=True, timeout=60)
    proc = subprocess.run(["bash", ".ci/run"], cwd=directory, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().split() == [
        "lint", f"{tmp_path}/work/shared/conformance/reploy-v1|1|1|1", "kube-down"]
