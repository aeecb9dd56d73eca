"""Admission by what the host can really give (issue 26, item 1) and limits that answer as
limits (item 9), on a real `reploy serve`.

The state dir lies on a small real file system: a loop-mounted ext4 of HOST_FS_MIB made by the
test. Serve admits as many 64 MiB session disks as it can hold beyond --min-free-mib, refuses the
next with 507 (saying what is free and what is promised), and then every session fills its disk
at once: each one's bytes, read back past the page cache (O_DIRECT), are what it was told it
wrote; the kernel logs no journal abort for any loop device involved; the API goes on answering.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import reploy_serve
from conftest import SERVE_STATE_DIR_PREFIX
from serve_harness import Api, ServeProcess, managed_workload, serve_factory  # noqa: F401  (fixtures)

pytestmark = pytest.mark.docker

HOST_FS_MIB = 300
DISK_MIB = reploy_serve.MIN_SESSION_DISK_MIB
RESERVE_MIB = 32
#: More than the host file system can hold: the loop ends at the first refusal.
MAX_TRIES = 8
#: Writes 1 MiB blocks of a pattern named by (seed, block number) until ENOSPC, fsyncs, prints
#: how many bytes write() said it wrote; then reads them back with O_DIRECT (from the disk, not
#: the page cache) and prints whether each byte is the pattern's.
FILL = r"""
import errno, hashlib, mmap, os, sys
path, seed, block = sys.argv[1], sys.argv[2].encode(), 1 << 20
def pattern(i):
    return hashlib.sha256(seed + i.to_bytes(8, "big")).digest() * (block // 32)
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
told, i = 0, 0
while True:
    try:
        n = os.write(fd, pattern(i))
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
        break
    told += n
    i += 1
    if n < block:
        break
os.fsync(fd)
os.close(fd)
fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
buffer, got, i, intact = mmap.mmap(-1, block), 0, 0, True
while got < told:
    n = os.readv(fd, [buffer])
    if n == 0:
        break
    intact = intact and buffer[:n] == pattern(i)[:n]
    got, i = got + n, i + 1
print(told, got, intact)
"""
JOURNAL_TROUBLE = re.compile(r"abort|data loss|error|remount", re.IGNORECASE)


def kernel_log() -> list[str]:
    done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=60)
    return done.stdout.splitlines() if done.returncode == 0 else []


@pytest.fixture
def small_state_fs() -> Iterator[Path]:
    """A state dir on a fresh HOST_FS_MIB ext4, loop-mounted; unmounted and removed after
    serve_factory's teardown (requested first, it is torn down last)."""
    base = Path(tempfile.mkdtemp(prefix=SERVE_STATE_DIR_PREFIX))
    image, mount_point = base / "host.img", base / "fs"
    mount_point.mkdir()
    with open(image, "wb") as f:
        f.truncate(HOST_FS_MIB << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, timeout=120)
    subprocess.run(["mount", "-o", "loop", str(image), str(mount_point)], check=True, timeout=120)
    try:
        yield mount_point / "state"
    finally:
        subprocess.run(["umount", str(mount_point)], check=True, timeout=120)
        shutil.rmtree(base)


def create(api: Api, name: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    status, headers, body = api.request("POST", "/api/v1/sessions", json.dumps({"name": name}).encode())
    return status, headers, json.loads(body)


def test_sessions_filling_their_disks_at_once_lose_no_byte_and_the_host_keeps_its_reserve(
        small_state_fs: Path, serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    server = serve_factory("--session-disk-mib", str(DISK_MIB), "--min-free-mib", str(RESERVE_MIB),
                           state_dir=small_state_fs)
    api = server.api
    host_loop = reploy_serve.mounted_device(small_state_fs.parent)
    log_before = set(kernel_log())
    sessions, refusal = [], None
    for i in range(MAX_TRIES):
        status, _, document = create(api, f"filler-{i}")
        if status != 201:
            refusal = (status, document["error"])
            break
        sessions.append(document["id"])
    assert len(sessions) >= 2 and refusal is not None, (sessions, refusal)
    assert refusal[0] == 507 and f"another session's {DISK_MIB} MiB disk" in refusal[1], refusal
    assert re.search(r"\d+ MiB free, \d+ MiB of it promised to the \d+ session disks", refusal[1]), refusal
    assert f"{RESERVE_MIB} MiB kept for serve's store and logs" in refusal[1]
    loops = {host_loop} | {reploy_serve.mounted_device(small_state_fs / "sessions" / sid) for sid in sessions}

    def fill(sid: str) -> list[str]:
        done = api.call("POST", f"/sessions/{sid}/exec",
                        {"argv": ["python3", "-c", FILL, "fill", sid], "timeoutMs": 600_000})
        assert done["exitCode"] == 0, done
        return done["stdout"].split()

    with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
        results = dict(zip(sessions, pool.map(fill, sessions)))
    for sid, (told, got, intact) in results.items():
        # Filled: all but what ext4 keeps for root, its journal and its metadata.
        assert int(told) > (DISK_MIB - 16) << 20 and got == told and intact == "True", (sid, results[sid])
    trouble = [line for line in set(kernel_log()) - log_before
               if any(loop and re.search(rf"\b{loop.removeprefix('/dev/')}\b", line) for loop in loops)
               and JOURNAL_TROUBLE.search(line)]
    assert trouble == []
    assert shutil.disk_usage(small_state_fs).free >= RESERVE_MIB << 20

    # The API keeps answering and the store keeps writing: still full, then room for one again.
    assert {s["id"] for s in api.call("GET", "/sessions")["sessions"]} == set(sessions)
    assert create(api, "one-more")[0] == 507
    api.call("DELETE", f"/sessions/{sessions[0]}", expect=204)
    status, _, document = create(api, "in-its-place")
    assert status == 201, document
    assert api.call("POST", f"/sessions/{document['id']}/exec", {"argv": ["true"]})["exitCode"] == 0


def test_a_create_past_max_sessions_answers_429_naming_the_limit(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    """Issue 26, item 9: it answered 500."""
    server = serve_factory("--max-sessions", "1")
    server.api.create("only")
    status, headers, document = create(server.api, "one-too-many")
    assert status == 429 and headers["retry-after"] == str(reploy_serve.LIMIT_RETRY_AFTER_S)
    assert "at most 1 sessions (--max-sessions)" in document["error"]
    assert len(server.api.call("GET", "/sessions")["sessions"]) == 1
