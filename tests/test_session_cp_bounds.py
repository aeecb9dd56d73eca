"""`session cp ID:PATH DST` is bounded by construction (issue 26, item 3).

What a download is comes from its own response (the Content-Type serve sets from what the
agent opened), never from the listing before it; only an uncompressed tar is read from a
session; the sum of its members' sizes (a sparse file at its full size) is checked against the
bound before the first byte is written; and a path the session changed between the listing and
the download is one clear error that writes nothing. First against a stand-in server (no
Docker), then with the issue's swap loop (renameat2(RENAME_EXCHANGE) of a directory and a gzip
bomb) inside a real session of a real `reploy serve`.
"""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, Callable

import pytest

import reploy_serve
from serve_harness import ROOT, ServeProcess, cli_error, managed_workload, serve_factory  # noqa: F401
from test_serve_access import SID, TOKEN, OtherServer, run_reploy

QUOTA_BYTES = 1 << 20
#: What `session cp` takes at most for that quota (copy_limit_bytes).
LIMIT_BYTES = QUOTA_BYTES + reploy_serve.agent_role.MAX_ARCHIVE_ENTRIES * reploy_serve.TAR_BYTES_PER_ENTRY
#: The session's own quota (its diskMib) wins over the server's bound (GET /server).
SESSION = json.dumps({"id": SID, "name": "n", "state": "active", "diskMib": QUOTA_BYTES >> 20}).encode()
CONFIG = json.dumps({"limits": {"sessionDiskBytes": 1 << 40}}).encode()
BOMB_BYTES = 1 << 30  #: the zeros a gzip bomb holds: far past LIMIT_BYTES


def listing(kind: str) -> bytes:
    entry = {"name": "d", "type": kind, "size": 0, "mode": 0o755, "mtime": 0}
    return json.dumps({"root": "workspace", "path": "d", "entry": entry, "entries": [],
                       "truncated": False}).encode()


def gzip_bomb(zero_bytes: int) -> bytes:
    """A gzip'd tar of one file of zeros: about a thousandth of its size."""
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=1) as compressed:
        header = tarfile.TarInfo("zeros")
        header.size = zero_bytes
        compressed.write(header.tobuf(format=tarfile.PAX_FORMAT))
        chunk = bytes(1 << 20)
        for _ in range(zero_bytes >> 20):
            compressed.write(chunk)
        compressed.write(bytes(2 * tarfile.BLOCKSIZE))
    return out.getvalue()


def sparse_tar(real_bytes: int) -> bytes:
    """An uncompressed tar of 10 KiB whose one member is a sparse file of real_bytes (PAX 1.0)."""
    out = io.BytesIO()
    sparse_map = b"1\n0\n0\n".ljust(tarfile.BLOCKSIZE, b"\0")
    member = tarfile.TarInfo("GNUSparseFile.0/big")
    member.size = len(sparse_map)
    member.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                          "GNU.sparse.name": "big", "GNU.sparse.realsize": str(real_bytes)}
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as archive:
        archive.addfile(member, io.BytesIO(sparse_map))
    return out.getvalue()


def a_small_tree_tar() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        member = tarfile.TarInfo("a.txt")
        member.size = 6
        archive.addfile(member, io.BytesIO(b"hello\n"))
    return out.getvalue()


def cp_from(listed: str, download: tuple[str, bytes], out: Path) -> dict[str, Any]:
    """`session cp SID:d OUT` against a stand-in serve that lists d as `listed` and then
    downloads it as `download` (content type, body); its JSON document."""
    server = OtherServer((404, "application/json", b'{"error": "no"}'), {
        "/api/v1/server": (200, "application/json", CONFIG),
        f"/api/v1/sessions/{SID}": (200, "application/json", SESSION),
        f"/api/v1/sessions/{SID}/list/d": (200, "application/json", listing(listed)),
        f"/api/v1/sessions/{SID}/files/d": (200, *download)})
    try:
        proc = run_reploy("session", "cp", f"{SID}:d", str(out), "--server", server.url,
                          env={"REPLOY_TOKEN": TOKEN})
    finally:
        server.close()
    assert b"Traceback" not in proc.stderr, proc.stderr
    return cli_error(proc) if proc.returncode == 1 else json.loads(proc.stdout)


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return gzip_bomb(BOMB_BYTES)


@pytest.mark.parametrize("listed, content_type, shown", [
    ("directory", "application/octet-stream", "listed as a directory, downloaded as a file"),
    ("file", "application/x-tar", "listed as a file, downloaded as a directory"),
], ids=["directory-then-file", "file-then-directory"])
def test_a_path_changed_between_listing_and_download_is_an_error_that_writes_nothing(
        tmp_path: Path, bomb: bytes, listed: str, content_type: str, shown: str) -> None:
    """The issue's race, as serve would answer it: what the listing saw is gone by the download
    (the bomb, where the directory was listed; a directory's tar, where a file was)."""
    body = bomb if content_type == "application/octet-stream" else a_small_tree_tar()
    document = cp_from(listed, (content_type, body), tmp_path)
    assert document["error"] == f"{SID}:d changed while it was copied: {shown}; nothing was written"
    assert list(tmp_path.iterdir()) == []


def test_a_compressed_tar_from_a_session_is_never_decompressed(tmp_path: Path, bomb: bytes) -> None:
    document = cp_from("directory", ("application/x-tar", bomb), tmp_path)
    assert "refused: not a readable uncompressed tar archive" in document["error"]
    assert list(tmp_path.iterdir()) == []


def test_a_tar_whose_members_exceed_the_bound_is_refused_before_its_first_byte(tmp_path: Path) -> None:
    """10 KiB of tar, one sparse member of 1 GiB: its size counts in full."""
    document = cp_from("directory", ("application/x-tar", sparse_tar(BOMB_BYTES)), tmp_path)
    assert f"the archive's content exceeds {LIMIT_BYTES} bytes" in document["error"]
    assert list(tmp_path.iterdir()) == []


def test_a_download_of_another_kind_is_refused(tmp_path: Path) -> None:
    document = cp_from("directory", ("text/html", b"<p>hi</p>"), tmp_path)
    assert document["error"] == f"{SID}:d: the download is 'text/html', neither a file nor a directory's tar"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("listed, download", [
    ("directory", ("application/x-tar", a_small_tree_tar())),
    ("file", ("application/octet-stream; charset=binary", b"just bytes\n")),
], ids=["tree", "file"])
def test_what_listing_and_download_agree_on_is_copied(tmp_path: Path, listed: str,
                                                      download: tuple[str, bytes]) -> None:
    document = cp_from(listed, download, tmp_path)
    kind = "tree" if listed == "directory" else "file"
    assert document["kind"] == kind and document["destination"] == str(tmp_path / "d")
    if kind == "tree":
        assert (tmp_path / "d" / "a.txt").read_bytes() == b"hello\n"
    else:
        assert (tmp_path / "d").read_bytes() == b"just bytes\n"
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # no spool left


# ---------------------------------------------------------------------------------------------
# The swap loop, inside a real session
# ---------------------------------------------------------------------------------------------

#: Run by the session's shell as its runtime user: swap workspace/d (a directory) with
#: workspace/bomb (a gzip'd tar of 1 GiB of zeros) for ever, as fast as it can.
SWAP_LOOP = """
import ctypes, os
os.chdir("/mnt/reploy-session/workspace")
libc = ctypes.CDLL(None, use_errno=True)
RENAME_EXCHANGE, AT_FDCWD = 2, -100
with open("swap.pid", "w") as pid_file:
    pid_file.write(str(os.getpid()))
print("SWAPPING-" + "LOOP", flush=True)
while True:
    if libc.renameat2(AT_FDCWD, b"d", AT_FDCWD, b"bomb", RENAME_EXCHANGE) != 0:
        raise OSError(ctypes.get_errno(), "renameat2")
"""
MAX_TRIES = 40
#: What the listing itself answers when the swap lands inside it (serve stats the path, then
#: lists it): a clear error before any download, so nothing is written either.
#: (serve's answer carries its machine-readable `code` too since the harness API, issue 28, whose
#: agent also says when the path turned into a directory under its look)
LISTING_RACES = ({"error": "agent: not a directory: d", "status": 409, "code": "not_a_directory"},
                 {"error": "agent: is a directory: d", "status": 409, "code": "is_a_directory"})


def tree_bytes(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*"))


@pytest.mark.docker
def test_session_cp_under_the_swap_loop_never_writes_past_its_bound(
        serve_factory: Callable[..., ServeProcess], tmp_path: Path, bomb: bytes) -> None:
    server = serve_factory("--session-disk-mib", "64")
    api = server.api
    sid = api.create("swap")["id"]
    for name, data in (("bomb", bomb), ("swap.py", SWAP_LOOP.encode())):
        status, _, body = api.request("PUT", f"/api/v1/sessions/{sid}/files/{name}", data,
                                      {"Content-Type": "application/octet-stream"})
        assert status in (200, 201), body
    made = api.call("POST", f"/sessions/{sid}/exec", {"argv": ["sh", "-c", "mkdir d && echo hello > d/a.txt"]})
    assert made["exitCode"] == 0, made
    api.call("POST", f"/sessions/{sid}/message", {"text": "python3 swap.py &"})
    api.wait_output(sid, b"SWAPPING-LOOP")
    limit_bytes = (64 << 20) + reploy_serve.agent_role.MAX_ARCHIVE_ENTRIES * reploy_serve.TAR_BYTES_PER_ENTRY
    outcomes: dict[str, int] = {"tree": 0, "file": 0, "changed": 0, "listing": 0}
    try:
        for attempt in range(MAX_TRIES):
            out = tmp_path / f"try-{attempt}"
            out.mkdir()
            proc = subprocess.run([sys.executable, str(ROOT / "reploy.py"), "session", "cp", f"{sid}:d",
                                   str(out), "--server", server.ready["url"]],
                                  capture_output=True, env=server.client_env(), timeout=120)
            document = cli_error(proc) if proc.returncode == 1 else json.loads(proc.stdout)
            assert tree_bytes(out) <= limit_bytes  # whatever happened
            if proc.returncode == 0:
                outcomes[document["kind"]] += 1
                copied = out / "d"
                if document["kind"] == "tree":  # the directory, whole
                    assert (copied / "a.txt").read_bytes() == b"hello\n"
                else:  # the bomb, as the file it is: never decompressed
                    assert copied.read_bytes() == bomb
            else:  # the race met between the listing and the download, or within the listing
                changed = "changed while it was copied" in document["error"]
                assert changed or document in LISTING_RACES, document
                assert list(out.iterdir()) == []
                outcomes["changed" if changed else "listing"] += 1
            assert not [p for p in out.rglob(".reploy-cp-*")]
            if outcomes["changed"] and attempt >= 9:
                break
    finally:
        stopped = api.call("POST", f"/sessions/{sid}/exec",
                           {"argv": ["sh", "-c", "kill $(cat swap.pid)"]})
    assert stopped["exitCode"] == 0, stopped
    assert outcomes["changed"] >= 1, outcomes  # the race was met, and refused
    print(f"session cp under the swap loop: {outcomes}")
