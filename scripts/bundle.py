#!/usr/bin/env python3
"""bundle.py: builds Reploy's offline bundle, dist/reploy-VERSION-offline.tar.gz (`make bundle`).

For air-gapped hosts: machines with Docker and python3, but no package index and no Debian
mirror. Run it on a connected machine with the Python minor version and platform of the target
(the wheels are that interpreter's). The archive holds one directory, reploy-VERSION-offline/:

  reploy.py reploy_serve.py reploy_session_client.py reploy_watchdog.py agent.py
  reploy_client.py reploy_inspect.py   the Python client and the Inspect AI provider
  README.md web/ docs/ examples/
  tests/agent_fixtures/fake_claude.py   the stand-in agent CLI examples/sandboxed-agent copies in
  wheels/         the run-time requirements (requirements-runtime.txt, not the test-only ones)
                  and their dependencies, from pip's configured index, for this interpreter,
                  and Reploy's own wheel (pyproject.toml), which install.sh puts in the venv too
  installer/      pip's own wheel: install.sh runs pip from it, so a host whose python3 lacks
                  ensurepip (Debian without python3-venv) installs all the same
  images/         with --images: the base images the examples build FROM, saved with the Docker
                  SDK (image.save), one tar each
  manifest.json   the version, the Python and machine it was built for, and the files above
  install.sh      the installer (scripts/install.sh)
  SHA256SUMS      every other file, in sha256sum(1) format

Prints one JSON object describing the bundle; messages go to stderr. Exit 0, 1 on failure.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Optional

# ============================================================================================
# Constants
# ============================================================================================

ROOT = Path(__file__).resolve().parent.parent
ROLE_FILES = ("reploy.py", "reploy_serve.py", "reploy_session_client.py", "reploy_watchdog.py",
              "agent.py", "reploy_client.py", "reploy_inspect.py")
#: Whole trees bundled as the checkout tracks them (git's ignore rules leave out prepared copies).
APP_TREES = ("web", "docs", "examples")
APP_EXTRA_FILES = ("README.md", "tests/agent_fixtures/fake_claude.py")
RUNTIME_REQUIREMENTS = ROOT / "requirements-runtime.txt"
INSTALLER_SOURCE = ROOT / "scripts" / "install.sh"
PROJECT_FILE = ROOT / "pyproject.toml"
BUNDLE_SCHEMA = "reploy-offline-bundle-v1"
RESULT_SCHEMA = "reploy-bundle-result-v1"
#: zlib level for the archive: the image tars dominate, and 9 costs twice the time for ~1%.
GZIP_LEVEL = 6
VERSION_LINE = re.compile(r'^__version__ = "([^"]+)"$', re.M)
FROM_LINE = re.compile(r"^\s*FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", re.I | re.M)


class BundleError(Exception):
    """Something the bundle needs is missing or inconsistent; the message says what."""


# ============================================================================================
# What goes in
# ============================================================================================


def release_version() -> str:
    """The `__version__` all role files agree on."""
    versions = {}
    for name in ROLE_FILES:
        found = VERSION_LINE.findall((ROOT / name).read_text(encoding="utf-8"))
        if len(found) != 1:
            raise BundleError(f"{name} must define __version__ exactly once")
        versions[name] = found[0]
    if len(set(versions.values())) != 1:
        raise BundleError(f"the role files disagree on __version__: {versions}")
    return versions[ROLE_FILES[0]]


def app_files() -> list[str]:
    """Checkout-relative paths of everything installed beside reploy.py."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard",
             "--", *APP_TREES], capture_output=True, check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError) as e:
        raise BundleError(f"listing {', '.join(APP_TREES)} needs a git checkout: {e}") from e
    paths = sorted({*ROLE_FILES, *APP_EXTRA_FILES, *(p for p in listed.split("\0") if p)})
    for path in paths:
        if (ROOT / path).is_symlink():
            raise BundleError(f"{path} is a symbolic link; the bundle holds regular files only")
    # A tracked file deleted in the working tree is not part of what is being bundled.
    return [path for path in paths if (ROOT / path).is_file()]


def example_base_images() -> list[str]:
    """The images the examples' Dockerfiles build FROM (stage names left out)."""
    images = set()
    for dockerfile in sorted((ROOT / "examples").rglob("Dockerfile")):
        stages = set()
        for image, stage in FROM_LINE.findall(dockerfile.read_text(encoding="utf-8")):
            if image not in stages:
                images.add(image)
            if stage:
                stages.add(stage)
    return sorted(images)


def wheel_entry(path: Path, stage: Path) -> dict[str, str]:
    name, version = path.name.split("-")[:2]
    return {"file": path.relative_to(stage).as_posix(), "name": name, "version": version}


def pip(*args: str) -> None:
    """pip with the machine's own configuration (its index); its chatter goes to stderr."""
    proc = subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check",
                           "--quiet"], stdout=sys.stderr)
    if proc.returncode != 0:
        raise BundleError(f"pip {' '.join(args)} failed (exit {proc.returncode}; see above)")


def build_project_wheel(stage: Path, wheels: Path) -> None:
    """Reploy's own wheel (pyproject.toml: the `reploy` command, the role modules, the client
    and the Inspect provider), built from a copy of the staged files so that the checkout
    gets no build/ or egg-info."""
    with tempfile.TemporaryDirectory(prefix=".reploy-wheel-") as source:
        for name in (*ROLE_FILES, "README.md"):
            shutil.copy(stage / name, Path(source) / name)
        shutil.copytree(stage / "web", Path(source) / "web")
        shutil.copy(PROJECT_FILE, Path(source) / PROJECT_FILE.name)
        pip("wheel", "--no-deps", "--wheel-dir", str(wheels), source)


def download_wheels(stage: Path) -> tuple[list[dict[str, str]], dict[str, str]]:
    """The run-time wheels, Reploy's own and pip's, for this interpreter and platform."""
    wheels, installer = stage / "wheels", stage / "installer"
    pip("download", "--only-binary=:all:", "--dest", str(wheels), "-r", str(RUNTIME_REQUIREMENTS))
    build_project_wheel(stage, wheels)
    pip("download", "--only-binary=:all:", "--no-deps", "--dest", str(installer),
        f"pip=={importlib.metadata.version('pip')}")
    (installer_wheel,) = installer.glob("pip-*.whl")
    return ([wheel_entry(p, stage) for p in sorted(wheels.glob("*.whl"))],
            wheel_entry(installer_wheel, stage))


def save_images(stage: Path, tags: list[str]) -> list[dict[str, Any]]:
    """Each tag's image as a tar under images/, through the Docker SDK."""
    import docker
    import docker.errors

    directory = stage / "images"
    directory.mkdir()
    saved = []
    try:
        client = docker.from_env(timeout=300)
        for tag in tags:
            try:
                image = client.images.get(tag)
            except docker.errors.ImageNotFound:
                raise BundleError(f"base image {tag} is not in the local engine: run "
                                  f"`make setup` (scripts/setup.sh) first") from None
            path = directory / (re.sub(r"[/:]", "_", tag) + ".tar")
            with path.open("wb") as out:
                for chunk in image.save(named=tag):
                    out.write(chunk)
            saved.append({"file": path.relative_to(stage).as_posix(), "tags": [tag],
                          "id": image.id})
        client.close()
    except docker.errors.DockerException as e:
        raise BundleError(f"saving the base images needs the Docker engine: {e}") from e
    return saved


# ============================================================================================
# Writing it
# ============================================================================================


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_checksums(stage: Path) -> None:
    """SHA256SUMS over every other file, as `sha256sum --check` reads it."""
    lines = [f"{sha256_file(path)}  {path.relative_to(stage).as_posix()}\n"
             for path in sorted(stage.rglob("*")) if path.is_file()]
    (stage / "SHA256SUMS").write_text("".join(lines), encoding="utf-8")


def owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def build_bundle(output_dir: Path, with_images: bool) -> dict[str, Any]:
    version = release_version()
    top = f"reploy-{version}-offline"
    output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".reploy-bundle-", dir=output_dir) as work:
        stage = Path(work) / top
        files = app_files()
        for path in files:
            (stage / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / path, stage / path)
        wheels, installer = download_wheels(stage)
        images = save_images(stage, example_base_images()) if with_images else []
        manifest = {
            "schema": BUNDLE_SCHEMA, "version": version,
            "python": {"implementation": sys.implementation.name,
                       "version": platform.python_version(),
                       "minor": "%d.%d" % sys.version_info[:2]},
            "machine": platform.machine(),
            "requirements": [line.strip() for line in
                             RUNTIME_REQUIREMENTS.read_text(encoding="utf-8").splitlines()
                             if line.strip() and not line.startswith("#")],
            "files": files, "wheels": wheels, "installer": installer, "images": images,
        }
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n",
                                             encoding="utf-8")
        shutil.copy(INSTALLER_SOURCE, stage / "install.sh")
        (stage / "install.sh").chmod(0o755)
        write_checksums(stage)
        archive = output_dir / f"{top}.tar.gz"
        partial = Path(work) / archive.name
        with tarfile.open(partial, "w:gz", compresslevel=GZIP_LEVEL) as tar:
            tar.add(stage, arcname=top, filter=owned_by_root)
        os.replace(partial, archive)
    return {"schema": RESULT_SCHEMA, "ok": True, "error": None, "bundle": str(archive),
            "bytes": archive.stat().st_size, "sha256": sha256_file(archive), "version": version,
            "python": manifest["python"]["minor"], "machine": manifest["machine"],
            "wheels": [w["file"].split("/")[-1] for w in wheels],
            "images": [tag for image in images for tag in image["tags"]]}


# ============================================================================================
# CLI
# ============================================================================================


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="bundle.py", description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", type=Path, default=ROOT / "dist")
    parser.add_argument("--images", action="store_true",
                        help="also save the examples' base images into the bundle")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C does, so the work directory is removed either way.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        result = build_bundle(args.output_dir.absolute(), args.images)
    except BundleError as e:
        print(f"bundle.py: {e}", file=sys.stderr)
        print(json.dumps({"schema": RESULT_SCHEMA, "ok": False, "error": str(e)}))
        return 1
    print(f"bundle.py: wrote {result['bundle']} ({result['bytes']} bytes)", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
