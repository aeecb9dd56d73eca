"""agent.py on a full disk, with a real one: the session dir on a small tmpfs of its own (which,
unlike the ext4 of a managed session, keeps nothing back for root, so the agent's own files hit
ENOSPC too). The workload fills it; the agent goes on, its log loses whole appends and says how
many bytes, its outbox holds events until they fit, and the verbs that write answer disk_full.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import tarfile
from pathlib import Path
from typing import Iterator

import pytest

from agent_fixtures.harness import (AS_ROOT, AgentProcess, agent, run_exec, short_dir,  # noqa: F401
                                    start_agent, upload_bytes, download_bytes)

pytestmark = pytest.mark.skipif(not AS_ROOT, reason="mounting a small file system needs root")
DISK_KIB = 4096


@pytest.fixture
def small_disk(short_dir: Path) -> Iterator[Path]:
    """short_dir/s: a tmpfs of DISK_KIB, unmounted afterwards."""
    path = short_dir / "s"
    path.mkdir(mode=0o755)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_KIB}k,mode=0755,nosuid,nodev", "tmpfs", str(path)],
                   check=True, timeout=30)
    yield path
    subprocess.run(["umount", str(path)], check=True, timeout=30)


def fill(process: AgentProcess) -> None:
    filled = run_exec(process, ["sh", "-c", "dd if=/dev/zero of=fill bs=4k"])
    assert filled["exit_code"] == 1 and b"No space left on device" in filled["stderr"]


def test_the_log_and_outbox_survive_a_full_disk(small_disk: Path, start_agent) -> None:
    shell = start_agent("--workload", "shell")
    assert small_disk == shell.session_dir
    shell.read_until(b"$ ")
    fill(shell)
    before = shell.status()["log_bytes"]
    shell.result("message", text="yes lost | head -c 200000")  # more than the last page of the log holds
    shell.wait_status(lambda s: s["turn_state"] == "idle" and s["queue_depth"] == 0, "the output to end")
    kept = shell.status()["log_bytes"] - before
    assert kept < 200000
    assert upload_bytes(shell, "more.bin", b"x" * 1024)["error"]["code"] == "disk_full"

    assert run_exec(shell, ["rm", "fill"])["exit_code"] == 0
    shell.result("message", text="echo back-$((2+2))")
    log = shell.read_until(b"back-4\r\n").decode()
    # One marker per stretch of losses (a marker may fit where the output did not: a page's slack).
    lost = [int(n) for n in re.findall(r"\[reploy: (\d+) bytes of output were lost: the session's disk was full\]",
                                       log)]
    assert lost and kept + sum(lost) >= 200000  # all it printed, kept or counted (CRs added by the terminal)
    assert log.index("bytes of output were lost") < log.index("back-4")
    events = shell.events()  # every line whole, in order; the turns that ran while full included
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert sum(1 for e in events if e["type"] == "turn_start") >= 1
    assert shell.status()["running"] is True


def test_a_directory_download_needs_no_room_on_a_full_disk(small_disk: Path, start_agent) -> None:
    """Its tar goes through a pipe, never a spool on the session's disk."""
    shell = start_agent("--workload", "shell")
    assert run_exec(shell, ["sh", "-c", "mkdir d && head -c 1000000 /dev/urandom > d/blob"])["exit_code"] == 0
    fill(shell)
    opened, data = download_bytes(shell, "d")
    assert opened["kind"] == "tar"
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        member = archive.extractfile("blob")
        assert member is not None and len(member.read()) == 1000000
    assert [p.name for p in shell.agent_dir.iterdir() if not p.name.startswith(("control", "events", "output"))] == []
    json.dumps(shell.status())  # the agent answers on
