"""`.ci/run`, the CI entry point, in a stand-in checkout whose Makefile only reports what
`make test` would be given: the conformance fixtures beside the checkout are required."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from conftest import ROOT

REPORTING_MAKEFILE = ("test:\n\t@echo \"$$REPLOY_CONFORMANCE_DIR|$$REPLOY_REQUIRE_CONFORMANCE|"
                      "$$REPLOY_REQUIRE_DOCKER\"\n")


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
    assert proc.stdout.decode().strip() == f"{tmp_path}/shared/conformance/reploy-v1|1|1"
