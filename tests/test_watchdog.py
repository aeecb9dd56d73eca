"""The watchdog without a Docker engine: a host that dies still gets its incident receipt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import reploy_watchdog
from conftest import ROOT


def test_receipt_is_written_when_the_engine_is_unreachable(tmp_path: Path) -> None:
    run_id = "f" * 32
    channel_dir = tmp_path / ".reploy/sessions" / run_id
    channel_dir.mkdir(parents=True)
    manifest_path = reploy_watchdog.manifest_path_for(str(tmp_path), run_id)
    receipt_path = reploy_watchdog.receipt_path_for(str(tmp_path), run_id)
    manifest = reploy_watchdog.Manifest(
        run_id=run_id, host=reploy_watchdog.process_identity(), watchdog="",
        containers={"c" * 64: {reploy_watchdog.LABEL_RUN: run_id}}, networks={},
        paths=(str(channel_dir),), receipt_path=str(receipt_path))
    reploy_watchdog.atomic_write_json(manifest_path, manifest.to_json())
    read_fd, write_fd = os.pipe()
    watchdog = subprocess.Popen(
        [sys.executable, str(ROOT / "reploy_watchdog.py"), "--manifest", str(manifest_path),
         "--liveness-fd", str(read_fd), "--host", manifest.host],
        pass_fds=(read_fd,), env={**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no.sock"})
    os.close(read_fd)
    os.close(write_fd)  # the host "dies": end of file without the disarm byte
    assert watchdog.wait(timeout=60) == 1  # it could not clean up everything
    receipt = json.loads(receipt_path.read_text())
    assert receipt["trigger"] == "host-exited" and receipt["cleanup_succeeded"] is False
    assert receipt["errors"] and receipt["errors"][0].startswith("the Docker engine failed")
    assert receipt["removed"]["paths"] == [str(channel_dir)] and not channel_dir.exists()
    assert receipt_path.stat().st_mode & 0o777 == 0o600
    assert not manifest_path.exists()
