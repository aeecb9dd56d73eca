"""Set-up names no mirror: scripts/debian_mirror.py finds the Debian archive in the machine's own
apt configuration (what scripts/setup.sh hands debootstrap unless REPLOY_DEBIAN_MIRROR is set).
Each case writes an apt configuration under a temp root and runs the script on it. The host
names are reserved `.invalid` ones: the repository names no real mirror."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from conftest import ROOT

DEBIAN_12_SOURCES = """\
Types: deb
URIs: http://archive.invalid/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://archive.invalid/debian-security
Suites: bookworm-security
Components: main
"""


def find_mirror(root: Path, files: dict[str, str], codename: Optional[str] = "bookworm"
                ) -> subprocess.CompletedProcess:
    for name, text in files.items():
        path = root / "etc/apt" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "etc").mkdir(parents=True, exist_ok=True)
    if codename is not None:
        (root / "etc/os-release").write_text(f'ID=debian\nVERSION_CODENAME={codename}\n')
    return subprocess.run([sys.executable, str(ROOT / "scripts/debian_mirror.py"),
                           "--root", str(root)], capture_output=True, timeout=30)


@pytest.mark.parametrize("files,expected", [
    # Debian 12's own deb822 file: the release suite's archive, not security.
    ({"sources.list.d/debian.sources": DEBIAN_12_SOURCES}, "http://archive.invalid/debian"),
    # One-line sources.list: options in brackets, comments, deb-src and security skipped.
    ({"sources.list": "# deb http://old.invalid/debian bookworm main\n"
                      "deb-src http://src.invalid/debian bookworm main\n"
                      "deb http://security.invalid/debian-security bookworm-security main\n"
                      "deb [ arch=amd64 signed-by=/k.gpg ] http://lines.invalid/debian bookworm "
                      "main contrib # trailing comment\n"},
     "http://lines.invalid/debian"),
    # Third-party repositories read first: one without `main`, one for no Debian release.
    ({"sources.list.d/a-vendor.sources": "Types: deb\nURIs: https://vendor.invalid/linux/debian\n"
                                         "Suites: bookworm\nComponents: stable\n",
      "sources.list.d/b-node.list": "deb https://node.invalid/deb nodistro main\n",
      "sources.list.d/debian.sources": DEBIAN_12_SOURCES},
     "http://archive.invalid/debian"),
    # A disabled stanza, a folded URIs field, and a scheme debootstrap cannot fetch.
    ({"sources.list.d/debian.sources":
      "Types: deb\nURIs: http://disabled.invalid/debian\nSuites: bookworm\nComponents: main\n"
      "Enabled: no\n\n"
      "Types: deb\nURIs: mirror+file:/etc/apt/mirrors.txt\nSuites: bookworm\nComponents: main\n\n"
      "# an internal mirror\nTypes: deb deb-src\nURIs:\n http://internal.invalid/debian\n"
      "Suites: bookworm\nComponents: main non-free-firmware\n"},
     "http://internal.invalid/debian"),
    # sources.list is read before sources.list.d, as apt reads it.
    ({"sources.list": "deb file:/srv/debian bookworm main\n",
      "sources.list.d/debian.sources": DEBIAN_12_SOURCES},
     "file:/srv/debian"),
])
def test_the_archive_comes_from_apt_configuration(tmp_path: Path, files: dict[str, str],
                                                  expected: str) -> None:
    proc = find_mirror(tmp_path, files)
    assert (proc.returncode, proc.stdout.decode(), proc.stderr) == (0, expected + "\n", b"")


def test_this_machines_release_wins_over_an_earlier_one(tmp_path: Path) -> None:
    files = {"sources.list": "deb http://sid.invalid/debian sid main\n"
                             "deb http://stable.invalid/debian bookworm main\n"}
    assert find_mirror(tmp_path / "a", files).stdout == b"http://stable.invalid/debian\n"
    # Without a codename to prefer, the first release archive.
    assert find_mirror(tmp_path / "b", files, codename=None).stdout == b"http://sid.invalid/debian\n"


@pytest.mark.parametrize("files", [
    {},
    {"sources.list.d/debian.sources": "Types: deb\nURIs: http://security.invalid/debian-security\n"
                                      "Suites: bookworm-security\nComponents: main\n"},
])
def test_no_archive_is_a_clear_failure(tmp_path: Path, files: dict[str, str]) -> None:
    proc = find_mirror(tmp_path, files)
    assert proc.returncode == 1 and proc.stdout == b""
    assert b"REPLOY_DEBIAN_MIRROR" in proc.stderr


def test_setup_names_no_mirror_of_its_own() -> None:
    setup = (ROOT / "scripts/setup.sh").read_text()
    assert "://" not in setup
    assert "REPLOY_DEBIAN_MIRROR" in setup and "scripts/debian_mirror.py" in setup
