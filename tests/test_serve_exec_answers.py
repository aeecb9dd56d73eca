"""What a command's output costs serve and its clients (issue 42, items 3 and 9), on the real
engine: an exec printing control bytes up to the 16 MiB cap is answered with each stream once,
within its base64, without serve holding it whole (its peak RSS, VmHWM, is measured), four at
once too, and the client takes every answer serve makes within the cap it asked for; a file
read through the client is bounded unless the caller raises the bound."""

from __future__ import annotations

import base64
import concurrent.futures
import json
from pathlib import Path
from typing import Any, Callable

import pytest

import reploy_client
from serve_harness import (  # noqa: F401  (fixtures)
    ServeProcess, managed_workload, serve_factory,
)

pytestmark = pytest.mark.docker
MIB = 1024 * 1024
CAP_BYTES = 16 * MIB
#: 16 MiB of 0x01 on stdout, and on stderr: six bytes each as JSON text.
CONTROL_BYTES = (f"head -c {CAP_BYTES} /dev/zero | tr '\\0' '\\1'; "
                 f"head -c {CAP_BYTES} /dev/zero | tr '\\0' '\\1' >&2")
#: What an answer may hold beyond its streams' base64: how the command ended, field names.
ANSWER_OVERHEAD_BYTES = 4096
#: serve's memory may grow by this much while it answers: pages of output, not the output.
SERVE_GROWTH_BYTES = 64 * MIB


def status_bytes(pid: int, name: str) -> int:
    """A /proc/PID/status size (VmRSS, VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {name} for {pid}")


def reset_peak(pid: int) -> int:
    """Starts the peak (VmHWM) of `pid` again from its resident size now, which it returns."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return status_bytes(pid, "VmRSS")


def base64_bytes(size_bytes: int) -> int:
    return (size_bytes + 2) // 3 * 4


def client_of(server: ServeProcess) -> reploy_client.Client:
    return reploy_client.Client(server.ready["url"], token_file=server.ready["token_file"])


def test_control_bytes_up_to_the_cap_are_answered_once_and_never_held_whole(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    server = serve_factory()
    api = server.api
    sid = api.create("control-bytes")["id"]
    pid = server.ready["pid"]
    before = reset_peak(pid)
    status, raw = api.raw("POST", f"/api/v1/sessions/{sid}/exec", json.dumps(
        {"argv": ["sh", "-c", CONTROL_BYTES], "maxOutputBytes": CAP_BYTES}).encode(), timeout=600)
    grown = status_bytes(pid, "VmHWM") - before
    print(f"answer {len(raw)} bytes; serve's peak RSS grew {grown} bytes from {before}")
    assert status == 200
    assert len(raw) <= 2 * base64_bytes(CAP_BYTES) + ANSWER_OVERHEAD_BYTES
    assert grown < SERVE_GROWTH_BYTES
    answer = json.loads(raw)
    for name in ("stdout", "stderr"):
        assert (answer[f"{name}Encoding"], answer[f"{name}Truncated"], name in answer) == (
            "base64", False, False)
        assert base64.b64decode(answer[f"{name}Base64"]) == b"\x01" * CAP_BYTES

    # Four at once, through the client, which takes what serve answers within the cap asked for.
    session = client_of(server).session(sid)
    before = reset_peak(pid)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: session.exec(["sh", "-c", CONTROL_BYTES], timeout=600,
                                                       max_output_bytes=CAP_BYTES), range(4)))
    grown = status_bytes(pid, "VmHWM") - before
    print(f"four at once: serve's peak RSS grew {grown} bytes from {before}")
    assert grown < SERVE_GROWTH_BYTES
    assert all(r.stdout == r.stderr == b"\x01" * CAP_BYTES and r.ok and not r.truncated
               for r in results)
    # At Inspect's 10 MiB cap: what is kept, and that more was dropped.
    capped = session.exec(["sh", "-c", CONTROL_BYTES], timeout=600, max_output_bytes=10 * MIB)
    assert (capped.stdout, capped.truncated) == (b"\x01" * 10 * MIB, True)


def test_a_file_read_is_bounded_unless_the_caller_raises_the_bound(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    server = serve_factory()
    session = client_of(server).create("read-bound")
    limit = reploy_client.DEFAULT_READ_LIMIT_BYTES
    assert session.exec(["sh", "-c", f"truncate -s 1G sparse.bin && truncate -s {limit + 1} over.bin"
                                      f" && truncate -s {limit} at.bin"]).ok
    me = Path("/proc/self")
    before = reset_peak(int(me.resolve().name))
    with pytest.raises(reploy_client.ReployError, match=f"sparse.bin: {1 << 30} bytes, more than {limit}") as e:
        session.files.read("sparse.bin")
    assert e.value.code == "too_large"
    with pytest.raises(reploy_client.ReployError, match="more than") as e:
        session.files.read("over.bin")
    assert e.value.code == "too_large"
    grown = status_bytes(int(me.resolve().name), "VmHWM") - before
    assert grown < limit // 2  # nothing of either file was read
    assert session.files.read("at.bin") == bytes(limit)
    assert session.files.read("over.bin", limit_bytes=limit + 1) == bytes(limit + 1)
