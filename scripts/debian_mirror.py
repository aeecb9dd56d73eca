#!/usr/bin/env python3
"""debian_mirror.py: prints the Debian archive this machine's apt uses, for scripts/setup.sh.

setup.sh builds a base image with debootstrap, which needs a Debian mirror. Reploy names none of
its own: it takes the one apt is configured with, so set-up works wherever apt does, on a
network whose only mirror is an internal one too. Read in apt's order: the `deb` lines of
/etc/apt/sources.list, then /etc/apt/sources.list.d/ (`*.list` one-line files, `*.sources`
deb822 stanzas with `URIs:`). An archive qualifies when it is enabled, of type `deb`, has the
`main` component and a release suite (not `-security`, `-updates`, `-backports` or a flat
repository); one for this machine's own release (VERSION_CODENAME) wins, else the first.

Prints the URI and exits 0, or says on stderr that none qualifies and exits 1.
(REPLOY_DEBIAN_MIRROR overrides all of this; setup.sh reads it.)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Iterator, Optional

#: URI schemes debootstrap can fetch from.
FETCHABLE_SCHEMES = ("http://", "https://", "ftp://", "file:")
ONE_LINE_SOURCE = re.compile(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)((?:\s+\S+)*)\s*$")


def one_line_sources(text: str) -> Iterator[tuple[str, str, list[str]]]:
    """(uri, suite, components) of each `deb` line of a sources.list file."""
    for line in text.splitlines():
        match = ONE_LINE_SOURCE.match(line.split("#", 1)[0].strip())
        if match:
            yield match[1], match[2], match[3].split()


def deb822_sources(text: str) -> Iterator[tuple[str, str, list[str]]]:
    """(uri, suite, components) of each enabled `deb` stanza of a .sources file."""
    for stanza in re.split(r"\n[ \t]*\n", text):
        fields: dict[str, str] = {}
        key = None
        for line in stanza.splitlines():
            if line.startswith("#"):
                continue
            if line[:1] in (" ", "\t") and key is not None:  # a folded continuation line
                fields[key] += " " + line.strip()
            elif ":" in line:
                key, value = (part.strip() for part in line.split(":", 1))
                key = key.lower()
                fields[key] = value
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes") == "no":
            continue
        for uri in fields.get("uris", "").split():
            for suite in fields.get("suites", "").split():
                yield uri, suite, fields.get("components", "").split()


def configured_sources(etc_apt: Path) -> Iterator[tuple[str, str, list[str]]]:
    """Every configured source, in the order apt reads them."""
    if (etc_apt / "sources.list").is_file():
        yield from one_line_sources((etc_apt / "sources.list").read_text(errors="replace"))
    parts = etc_apt / "sources.list.d"
    for path in sorted(parts.iterdir()) if parts.is_dir() else ():
        if path.suffix == ".list":
            yield from one_line_sources(path.read_text(errors="replace"))
        elif path.suffix == ".sources":
            yield from deb822_sources(path.read_text(errors="replace"))


def release_codename(os_release: Path) -> str:
    if not os_release.is_file():
        return ""
    found = re.search(r"^VERSION_CODENAME=\"?([^\"\n]*)\"?$", os_release.read_text(), re.M)
    return found[1] if found else ""


def debian_mirror(root: Path) -> Optional[str]:
    """The archive debootstrap should use, from the apt configuration under `root`."""
    candidates = [(uri, suite) for uri, suite, components in configured_sources(root / "etc/apt")
                  if "main" in components and uri.startswith(FETCHABLE_SCHEMES)
                  and "-" not in suite and "/" not in suite]
    codename = release_codename(root / "etc/os-release")
    for uri, suite in candidates:
        if suite == codename:
            return uri
    return candidates[0][0] if candidates else None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="debian_mirror.py", description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/"),
                        help="read ROOT/etc/apt and ROOT/etc/os-release (default /)")
    args = parser.parse_args(argv)
    mirror = debian_mirror(args.root)
    if mirror is None:
        print(f"debian_mirror.py: apt's configuration under {args.root / 'etc/apt'} names no "
              f"Debian archive with a release suite and `main`; set REPLOY_DEBIAN_MIRROR",
              file=sys.stderr)
        return 1
    print(mirror)
    return 0


if __name__ == "__main__":
    sys.exit(main())
