"""The offline bundle for air-gapped hosts, used as such a host uses it.

`scripts/bundle.py --images` (what `make bundle IMAGES=1` runs) builds it on this connected
machine: wheels from pip's configured index, base images from the local engine. Everything after
that runs inside a fresh network namespace whose only interface is loopback (`unshare --net`,
as root), so nothing can reach another host: install.sh installs the bundle into a temp prefix,
and the installed launcher stages, builds and runs a controlled session between the bundled
example controller and workload. Damaged, mismatched and misdirected installs must be refused,
changing nothing. The bundle's contents are checked against its manifest and SHA256SUMS here,
with this file's own hashing, independently of bundle.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

from conftest import ROOT

import reploy

pytestmark = pytest.mark.docker

VERSION = reploy.__version__
TOP = f"reploy-{VERSION}-offline"
ROLE_FILES = ["reploy.py", "reploy_serve.py", "reploy_session_client.py", "reploy_watchdog.py", "agent.py",
              "reploy_client.py", "reploy_inspect.py"]
#: The images examples/*/Dockerfile build FROM.
EXAMPLE_BASE_IMAGES = ["reploy-base/browser:bookworm-1", "reploy-base/busybox:1",
                       "reploy-base/python:bookworm-1"]
RUNTIME_REQUIREMENTS = ["docker==7.1.0", "psutil==7.0.0", "PyYAML==6.0.3"]


def offline(*argv: Any, timeout: float = 300,
            env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    """argv in a new network namespace of its own: loopback is its only interface."""
    return subprocess.run(["unshare", "--net", "--", *map(str, argv)], capture_output=True,
                          timeout=timeout, env=env)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(tree: Path) -> dict[str, str]:
    """Every entry under tree: its kind, mode and content digest (or link target)."""
    found = {}
    for directory, dirs, files in os.walk(tree):
        for name in dirs + files:
            path = Path(directory, name)
            key = str(path.relative_to(tree))
            if path.is_symlink():
                found[key] = "link " + os.readlink(path)
            elif path.is_dir():
                found[key] = f"dir {path.stat().st_mode:o}"
            else:
                found[key] = f"file {path.stat().st_mode:o} {sha256(path)}"
    return found


def linked_copy(bundle: Path, destination: Path) -> Path:
    """A copy of the bundle made of hard links (cheap for the image tars); replace a file
    before changing it."""
    shutil.copytree(bundle, destination, copy_function=os.link)
    return destination


def replace_file(path: Path, data: bytes) -> None:
    """New content at path without writing through a hard link to the original."""
    path.unlink()
    path.write_bytes(data)


def refused(proc: subprocess.CompletedProcess, *phrases: str) -> str:
    """install.sh refused: exit 1, the reason on stderr and in the one JSON object."""
    stderr = proc.stderr.decode()
    assert proc.returncode == 1, stderr
    result = json.loads(proc.stdout)
    assert result["schema"] == "reploy-offline-install-v1" and result["ok"] is False
    for phrase in phrases:
        assert phrase in result["error"], result["error"]
    assert result["error"] in stderr
    return result["error"]


@pytest.fixture(scope="module")
def bundle(docker_client: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundle built once with --images, then unpacked with tar as a user would."""
    if os.geteuid() != 0:
        message = "unshare --net needs root"
        if os.environ.get("REPLOY_REQUIRE_DOCKER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    base = tmp_path_factory.mktemp("bundle")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/bundle.py"), "--images",
                           "--output-dir", str(base / "dist")], capture_output=True, timeout=900)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    result = json.loads(proc.stdout)
    archive = base / "dist" / f"{TOP}.tar.gz"
    assert result["ok"] is True and result["bundle"] == str(archive)
    assert (result["bytes"], result["sha256"]) == (archive.stat().st_size, sha256(archive))
    assert result["version"] == VERSION and result["images"] == EXAMPLE_BASE_IMAGES
    assert [p.name for p in (base / "dist").iterdir()] == [archive.name]  # no work files left
    subprocess.run(["tar", "-xzf", str(archive), "-C", str(base)], check=True, timeout=300)
    return base / TOP


@pytest.fixture(scope="module")
def installed(bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """install.sh's result for a fresh prefix, installed offline."""
    prefix = tmp_path_factory.mktemp("installed") / "prefix"
    proc = offline(bundle / "install.sh", "--prefix", prefix)
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


def test_the_bundle_holds_what_its_manifest_names(bundle: Path, docker_client: Any) -> None:
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["schema"] == "reploy-offline-bundle-v1" and manifest["version"] == VERSION
    assert manifest["python"]["minor"] == "%d.%d" % sys.version_info[:2]
    assert manifest["python"]["version"] == platform.python_version()
    assert manifest["machine"] == platform.machine()
    files = manifest["files"]
    for expected in [*ROLE_FILES, "README.md", "web/index.html", "web/openapi.json",
                     "docs/agent.md", "examples/controller/controller.blueprint.yaml",
                     "examples/workload/workload.blueprint.yaml"]:
        assert expected in files
    assert all(not f.startswith("tests/") for f in files if f != "tests/agent_fixtures/fake_claude.py")
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]
    for role_file in ROLE_FILES:
        assert (bundle / role_file).read_bytes() == (ROOT / role_file).read_bytes()
    # The run-time requirements and their dependencies; nothing the tests alone need.
    assert manifest["requirements"] == RUNTIME_REQUIREMENTS
    wheels = {w["name"].lower(): w for w in manifest["wheels"]}
    for requirement in RUNTIME_REQUIREMENTS:
        name, version = requirement.lower().split("==")
        assert wheels[name]["version"] == version
    assert {"requests", "urllib3"} <= set(wheels) and not {"pytest", "hypothesis"} & set(wheels)
    assert wheels["reploy"]["version"] == VERSION  # Reploy's own, from pyproject.toml
    assert "inspect_ai" not in set(wheels)  # an optional extra, never bundled
    assert all((bundle / w["file"]).is_file() for w in manifest["wheels"])
    assert manifest["installer"]["name"] == "pip" and (bundle / manifest["installer"]["file"]).is_file()
    # Each image tar is the image this engine has under that tag.
    assert [i["tags"] for i in manifest["images"]] == [[tag] for tag in EXAMPLE_BASE_IMAGES]
    for image in manifest["images"]:
        assert (bundle / image["file"]).stat().st_size > 0
        assert image["id"] == docker_client.images.get(image["tags"][0]).id
    # SHA256SUMS covers every other file exactly once, with the right digests.
    listed = {}
    for line in (bundle / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        assert name not in listed
        listed[name] = digest
    on_disk = {str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file()}
    assert set(listed) == on_disk - {"SHA256SUMS"}
    assert all(sha256(bundle / name) == digest for name, digest in listed.items())
    assert os.access(bundle / "install.sh", os.X_OK)


def test_offline_install_runs_a_controlled_session(docker_engine: Any, bundle: Path,
                                                   installed: dict[str, Any],
                                                   tmp_path: Path) -> None:
    interfaces = offline("cat", "/proc/net/dev").stdout.decode().splitlines()[2:]
    assert [line.split(":")[0].strip() for line in interfaces] == ["lo"]

    manifest = json.loads((bundle / "manifest.json").read_text())
    prefix = Path(installed["prefix"])
    app, launcher = prefix / "lib/reploy", prefix / "bin/reploy"
    assert installed["ok"] is True and installed["error"] is None
    assert (installed["version"], installed["app_dir"], installed["launcher"]) == (
        VERSION, str(app), str(launcher))
    assert installed["images"] == [{k: i[k] for k in ("file", "tags", "id")}
                                   for i in manifest["images"]]
    assert installed["wheels"] == [{"name": w["name"], "version": w["version"]}
                                   for w in manifest["wheels"]]
    assert installed["replaced"] is None
    for name in [*ROLE_FILES, "web/index.html", "manifest.json"]:
        assert (app / name).read_bytes() == (bundle / name).read_bytes()
    # The venv holds the bundled packages and answers for them itself.
    probe = offline(app / "venv/bin/python3", "-c",
                    "import docker, psutil, yaml, reploy_client; print(docker.__file__, docker.__version__)")
    assert probe.returncode == 0, probe.stderr.decode()
    where, docker_version = probe.stdout.decode().split()
    assert where.startswith(str(app / "venv/")) and docker_version == "7.1.0"
    assert offline(launcher, "--version").stdout.decode() == f"reploy {VERSION}\n"

    examples = app / "examples"
    for blueprint, directory in [(examples / "controller/controller.blueprint.yaml", "controller"),
                                 (examples / "workload/workload.blueprint.yaml", "workload")]:
        for command in (["stage", blueprint, "--dir", tmp_path / directory],
                        ["build", "--dir", tmp_path / directory]):
            proc = offline(launcher, *command)
            assert proc.returncode == 0, proc.stderr.decode()
            assert json.loads(proc.stdout)["ok"] is True
    proc = offline(launcher, "controlled-session", "run",
                   "--controller-dir", tmp_path / "controller", "--workload-dir", tmp_path / "workload",
                   "--output-dir", tmp_path / "artifacts", "--", "run-controller")
    result = json.loads(proc.stdout)
    assert proc.returncode == 0 and result["ok"] is True, (
        f"{result}\n{proc.stderr.decode(errors='replace')[-4000:]}")
    assert result["session_result"]["cleanup_status"] == {"kind": "succeeded"}


@pytest.mark.parametrize("damage", [
    "flip wheels/docker", "flip reploy.py", "flip manifest.json",
    "flip images/reploy-base_busybox_1.tar", "delete web/app.css",
])
def test_a_damaged_bundle_is_refused_changing_nothing(bundle: Path, installed: dict[str, Any],
                                                      tmp_path: Path, damage: str) -> None:
    copy = linked_copy(bundle, tmp_path / "copy")
    action, target = damage.split(" ")
    victim = next(p for p in sorted(copy.rglob("*")) if str(p.relative_to(copy)).startswith(target))
    if action == "flip":  # one byte, in the middle of the file
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x01
        replace_file(victim, bytes(data))
    else:
        victim.unlink()
    prefix = Path(installed["prefix"])
    before = snapshot(prefix)
    error = refused(offline(copy / "install.sh", "--prefix", prefix), "damaged",
                    str(victim.relative_to(copy)), "nothing was installed")
    assert "FAILED" in error
    assert snapshot(prefix) == before
    fresh = tmp_path / "fresh"
    refused(offline(copy / "install.sh", "--prefix", fresh), "damaged")
    assert not fresh.exists()


def test_another_python_minor_version_is_refused(bundle: Path, installed: dict[str, Any],
                                                 tmp_path: Path) -> None:
    copy = linked_copy(bundle, tmp_path / "copy")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["python"].update(minor="3.0", version="3.0.1")
    replace_file(copy / "manifest.json", json.dumps(manifest).encode())
    sums = [f"{sha256(copy / 'manifest.json')}  manifest.json" if line.endswith("  manifest.json")
            else line for line in (copy / "SHA256SUMS").read_text().splitlines()]
    replace_file(copy / "SHA256SUMS", ("\n".join(sums) + "\n").encode())
    prefix = Path(installed["prefix"])
    before = snapshot(prefix)
    refused(offline(copy / "install.sh", "--prefix", prefix), "Python 3.0",
            platform.python_version(), "nothing was installed")
    assert snapshot(prefix) == before


def test_a_failed_install_puts_the_earlier_one_back(bundle: Path, installed: dict[str, Any]
                                                    ) -> None:
    # No engine at this address: loading the images fails after the new venv was made.
    env = {**os.environ, "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    prefix = Path(installed["prefix"])
    before = snapshot(prefix)
    refused(offline(bundle / "install.sh", "--prefix", prefix, env=env), "images")
    assert snapshot(prefix) == before
    assert offline(prefix / "bin/reploy", "--version").returncode == 0


def test_what_install_sh_did_not_write_is_not_replaced(bundle: Path, tmp_path: Path) -> None:
    foreign_app = tmp_path / "a"
    (foreign_app / "lib/reploy").mkdir(parents=True)
    (foreign_app / "lib/reploy/notes.txt").write_text("mine")
    foreign_launcher = tmp_path / "b"
    (foreign_launcher / "bin").mkdir(parents=True)
    (foreign_launcher / "bin/reploy").write_text("#!/bin/sh\necho mine\n")
    for prefix, phrase in [(foreign_app, "is not a Reploy installation"),
                           (foreign_launcher, "is not a Reploy launcher")]:
        before = snapshot(prefix)
        refused(offline(bundle / "install.sh", "--prefix", prefix), phrase, "nothing was changed")
        assert snapshot(prefix) == before


@pytest.mark.parametrize("argv,message", [
    (["--prefix"], "--prefix needs a directory"),
    (["--prefix="], "--prefix needs a directory"),
    (["--bogus"], "unknown argument: --bogus"),
])
def test_install_usage_errors(bundle: Path, argv: list[str], message: str) -> None:
    proc = offline(bundle / "install.sh", *argv)
    assert (proc.returncode, proc.stdout) == (2, b"")
    assert message in proc.stderr.decode()
