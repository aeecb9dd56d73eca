"""Session disks (reploy_serve.py, "the session disks") without Docker: the mountinfo reader, and
real images made, mounted, filled, unmounted and removed (root only: mounting needs it)."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

import reploy_serve
from conftest import session_disk_loops, session_disk_mounts
from reploy import Runtime

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a session disk needs root")
RUNTIME = Runtime(uid=1000, gid=1000, writable_paths=(), memory_mib=256, pids=128)

MOUNTINFO = """\
22 1 252:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
95 22 7:3 / /state/sessions/a\\040b rw,nosuid,nodev,relatime shared:7 - ext4 /dev/loop3 rw
96 22 0:44 / /state/sessions/c rw,relatime - tmpfs tmpfs rw
97 96 7:4 / /state/sessions/c rw,nosuid - ext4 /dev/loop4 rw,discard
"""


def test_mountinfo_is_read_with_its_escapes_and_the_topmost_mount_wins() -> None:
    assert reploy_serve.mounted_device(Path("/state/sessions/a b"), MOUNTINFO) == "/dev/loop3"
    assert reploy_serve.mounted_device(Path("/state/sessions/c"), MOUNTINFO) == "/dev/loop4"
    assert reploy_serve.mounted_device(Path("/state/sessions"), MOUNTINFO) is None
    assert reploy_serve.loop_backing_file("/dev/vda") is None


@as_root
def test_a_disk_is_made_laid_out_bounded_and_removed(tmp_path: Path) -> None:
    image, mount_point = tmp_path / "s.img", tmp_path / "s"
    reploy_serve.make_session_disk(image, mount_point, reploy_serve.MIN_SESSION_DISK_MIB, RUNTIME)
    try:
        assert reploy_serve.loop_backing_file(reploy_serve.mounted_device(mount_point)) == str(image)
        layout = {p.name: (p.stat().st_uid, oct(p.stat().st_mode & 0o777)) for p in mount_point.iterdir()}
        assert layout == {"agent": (0, "0o700"), "workspace": (1000, "0o700")}
        assert (mount_point.stat().st_uid, oct(mount_point.stat().st_mode & 0o777)) == (0, "0o755")
        assert os.statvfs(mount_point).f_flag & (os.ST_NOSUID | os.ST_NODEV) == os.ST_NOSUID | os.ST_NODEV
        assert image.stat().st_blocks * 512 < 8 << 20  # sparse: what mkfs wrote, not the disk's size
        reploy_serve.mount_session_disk(image, mount_point)  # mounted already: nothing stacks
        assert session_disk_mounts(str(mount_point)) == [str(mount_point)]
        filled = subprocess.run(["dd", "if=/dev/zero", f"of={mount_point}/workspace/big", "bs=1M", "count=100"],
                                capture_output=True)
        assert filled.returncode != 0 and b"No space left on device" in filled.stderr
        margin = reploy_serve.SESSION_DISK_MARGIN_MIB
        assert image.stat().st_blocks * 512 <= (reploy_serve.MIN_SESSION_DISK_MIB + margin) << 20
    finally:
        reploy_serve.remove_session_disk(image, mount_point)
    assert not image.exists() and not mount_point.exists()
    assert session_disk_mounts(str(tmp_path)) == [] and session_disk_loops(str(tmp_path)) == []


@as_root
def test_something_else_mounted_in_its_place_is_refused_and_left_alone(tmp_path: Path) -> None:
    image, mount_point = tmp_path / "s.img", tmp_path / "s"
    reploy_serve.make_session_disk(image, mount_point, reploy_serve.MIN_SESSION_DISK_MIB, RUNTIME)
    reploy_serve.unmount_session_disk(image, mount_point)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], check=True)
    try:
        for step in (reploy_serve.mount_session_disk, reploy_serve.unmount_session_disk):
            with pytest.raises(reploy_serve.SessionDiskError, match="tmpfs mounted on it"):
                step(image, mount_point)
        assert reploy_serve.mounted_device(mount_point) == "tmpfs"
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)
        reploy_serve.remove_session_disk(image, mount_point)
    assert session_disk_loops(str(tmp_path)) == []


def test_a_missing_image_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(reploy_serve.SessionDiskError, match="disk image .* is missing"):
        reploy_serve.mount_session_disk(tmp_path / "gone.img", tmp_path / "s")


def test_admission_promises_only_what_the_host_can_still_give() -> None:
    """Issue 26, item 1: free space less what the live disks may still take less the reserve
    must hold the new quota plus its margin; the refusal says how much is free and promised."""
    mib, margin = 1 << 20, reploy_serve.SESSION_DISK_MARGIN_MIB
    assert reploy_serve.admission_refusal(free=(300 + 64 + 64 + margin) * mib, promised=300 * mib, disks=3,
                                          reserve=64 * mib, quota=64 * mib) is None
    refusal = reploy_serve.admission_refusal(free=(300 + 64 + 64 + margin) * mib - 1, promised=300 * mib,
                                             disks=3, reserve=64 * mib, quota=64 * mib)
    assert refusal is not None
    for fact in ("64 MiB disk", "428 MiB free", "300 MiB of it promised to the 3 session disks",
                 "64 MiB kept for serve's store and logs (--min-free-mib)"):
        assert fact in refusal
    # Overcommitted already (a state dir of an older serve): refused, never negative arithmetic.
    assert reploy_serve.admission_refusal(free=10 * mib, promised=500 * mib, disks=9, reserve=0, quota=mib)


@as_root
def test_a_disk_promises_what_it_has_not_written_yet(tmp_path: Path) -> None:
    image, mount_point = tmp_path / "s.img", tmp_path / "s"
    size = reploy_serve.MIN_SESSION_DISK_MIB << 20
    reploy_serve.make_session_disk(image, mount_point, reploy_serve.MIN_SESSION_DISK_MIB, RUNTIME)
    try:
        disks, promised = reploy_serve.disk_promises(tmp_path)
        margin = reploy_serve.SESSION_DISK_MARGIN_MIB << 20
        assert disks == 1 and size - (8 << 20) < promised <= size + margin
        (mount_point / "workspace" / "f").write_bytes(os.urandom(16 << 20))
        os.sync()
        assert reploy_serve.disk_promises(tmp_path)[1] <= promised - (16 << 20)
    finally:
        reploy_serve.remove_session_disk(image, mount_point)
    assert reploy_serve.disk_promises(tmp_path) == (0, 0)


@as_root
def test_an_image_still_attached_is_never_unlinked(tmp_path: Path) -> None:
    """Issue 26, item 4: a loop device a crash left on the image (nothing mounted from it) is
    detached before the image goes; an image still mounted elsewhere is kept, with the reason."""
    image, mount_point, elsewhere = tmp_path / "s.img", tmp_path / "s", tmp_path / "elsewhere"
    reploy_serve.make_session_disk(image, mount_point, reploy_serve.MIN_SESSION_DISK_MIB, RUNTIME)
    reploy_serve.unmount_session_disk(image, mount_point)
    subprocess.run(["losetup", "-f", str(image)], check=True)
    assert len(session_disk_loops(str(tmp_path))) == 1
    reploy_serve.remove_session_disk(image, mount_point)
    assert not image.exists() and not mount_point.exists() and session_disk_loops(str(tmp_path)) == []

    reploy_serve.make_session_disk(image, mount_point, reploy_serve.MIN_SESSION_DISK_MIB, RUNTIME)
    reploy_serve.unmount_session_disk(image, mount_point)
    elsewhere.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(elsewhere)], check=True)
    try:
        with pytest.raises(reploy_serve.SessionDiskError, match=f"still mounted at {elsewhere}; it is kept"):
            reploy_serve.remove_session_disk(image, mount_point)
        assert image.exists() and (elsewhere / "workspace").is_dir()
    finally:
        subprocess.run(["umount", str(elsewhere)], check=True)
    reploy_serve.remove_session_disk(image, mount_point)
    assert not image.exists() and session_disk_loops(str(tmp_path)) == []
    assert session_disk_mounts(str(tmp_path)) == []


@as_root
def test_an_unmount_refused_as_busy_waits_for_a_holder_of_a_moment_and_no_longer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """serve's own threads hold a file of a session's disk for moments (the output follower's
    read of the log): a delete's unmount that meets one is tried again until it lets go, and
    one that holds on past UNMOUNT_BUSY_TIMEOUT_S leaves the disk mounted, saying so."""
    image, mount_point = tmp_path / "s.img", tmp_path / "s"
    reploy_serve.make_session_disk(image, mount_point, reploy_serve.MIN_SESSION_DISK_MIB, RUNTIME)
    refused = threading.Event()
    run_disk_tool = reploy_serve._run_disk_tool

    def noting_refusals(argv: list[str], what: str) -> None:
        try:
            run_disk_tool(argv, what)
        except reploy_serve.SessionDiskError as e:
            if reploy_serve.UMOUNT_BUSY in str(e):
                refused.set()
            raise

    monkeypatch.setattr(reploy_serve, "_run_disk_tool", noting_refusals)
    outcome: list[BaseException | None] = []

    def unmount() -> None:
        try:
            reploy_serve.unmount_session_disk(image, mount_point)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            outcome.append(e)

    unmounting = threading.Thread(target=unmount)
    try:
        holder = os.open(mount_point / "workspace", os.O_RDONLY | os.O_DIRECTORY)
        try:
            monkeypatch.setattr(reploy_serve, "UNMOUNT_BUSY_TIMEOUT_S", 0.2)
            with pytest.raises(reploy_serve.SessionDiskError, match=reploy_serve.UMOUNT_BUSY):
                reploy_serve.unmount_session_disk(image, mount_point)
            assert refused.is_set() and reploy_serve.mounted_device(mount_point) is not None

            monkeypatch.setattr(reploy_serve, "UNMOUNT_BUSY_TIMEOUT_S", 60.0)
            refused.clear()
            unmounting.start()
            assert refused.wait(60), "the unmount never met the holder"
        finally:
            os.close(holder)  # the holder lets go while the unmount waits
        unmounting.join(60)
        assert outcome == [None] and reploy_serve.mounted_device(mount_point) is None
    finally:
        if unmounting.ident is not None:
            unmounting.join(60)
        reploy_serve.remove_session_disk(image, mount_point)
    assert not image.exists() and session_disk_loops(str(tmp_path)) == []


@as_root
def test_a_start_sweeps_what_an_older_serve_or_a_crash_left(tmp_path: Path) -> None:
    """Issue 26, item 4, as main left it with a symlinked state dir: a probe disk still mounted
    on its unlinked image. The start's sweep unmounts and detaches it and removes its mount point."""
    child = subprocess.Popen(["true"])
    child.wait()
    gone_pid = child.pid  # reaped: gone
    name = f".probe-{gone_pid}"
    image, mount_point = tmp_path / f"{name}.img", tmp_path / name
    reploy_serve.make_session_disk(image, mount_point, reploy_serve.MIN_SESSION_DISK_MIB, RUNTIME)
    image.unlink()  # what main's remove_session_disk did when it failed to match the mount
    assert session_disk_mounts(str(tmp_path)) == [str(mount_point)]
    reploy_serve.sweep_lost_disks(tmp_path)
    assert session_disk_mounts(str(tmp_path)) == [] and session_disk_loops(str(tmp_path)) == []
    assert list(tmp_path.iterdir()) == []
