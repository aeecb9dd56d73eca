"""File verbs through real agents: uploads and downloads in chunks, trees as tar, listings, and every
hostile path and archive refused with nothing written, inside or outside the workspace."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import tarfile
import time

import pytest

from agent_fixtures.harness import (WORKLOAD_UID, agent, download_bytes, hand_over, short_dir,  # noqa: F401
                                    open_upload, start_agent, tree_snapshot, upload_bytes, wait_until,
                                    zygote_pids)


@pytest.fixture
def shell(start_agent):
    return start_agent("--workload", "shell")


@pytest.fixture
def outside(short_dir):
    """A directory beside the session that nothing may ever write into, and a workspace symlink to it."""
    path = short_dir / "outside"
    path.mkdir()
    return path


def workspace(process):
    return process.session_dir / "workspace"


def tar_of(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for info, content in members:
            info.size = len(content) if info.isfile() else 0
            archive.addfile(info, io.BytesIO(content) if info.isfile() else None)
    return buffer.getvalue()


def entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, mode
    return info


def no_staging_left(process) -> None:
    for root in (process.session_dir, workspace(process)):
        assert not [p for p in root.rglob(".reploy-upload-*")], list(root.rglob("*"))


def test_a_file_round_trip_in_chunks(shell):
    data = os.urandom(2 * agent.COPY_CHUNK_BYTES + 12345)
    committed = upload_bytes(shell, "deep/er/blob.bin", data)["result"]
    assert committed == {"type": "upload_commit", "transfer_id": committed["transfer_id"], "done": True,
                         "root": "workspace", "path": "deep/er/blob.bin", "kind": "file", "bytes": len(data),
                         "entries": 1, "sha256": hashlib.sha256(data).hexdigest()}
    target = workspace(shell) / "deep/er/blob.bin"
    assert target.read_bytes() == data
    assert stat.S_IMODE(target.stat().st_mode) == 0o644 and target.stat().st_uid == WORKLOAD_UID
    assert stat.S_IMODE((workspace(shell) / "deep").stat().st_mode) == 0o755
    opened, back = download_bytes(shell, "deep/er/blob.bin")
    assert back == data and opened["kind"] == "file" and opened["size"] == len(data)
    no_staging_left(shell)


def test_modes_are_made_sane_and_a_file_is_replaced(shell):
    assert "result" in upload_bytes(shell, "tool.sh", b"#!/bin/sh\n", mode=0o4777)
    assert stat.S_IMODE((workspace(shell) / "tool.sh").stat().st_mode) == 0o755
    assert "result" in upload_bytes(shell, "tool.sh", b"again")
    assert (workspace(shell) / "tool.sh").read_bytes() == b"again"


def test_stat_and_list(shell, outside):
    (workspace(shell) / "d").mkdir()
    (workspace(shell) / "d/f.txt").write_bytes(b"12345")
    (workspace(shell) / "link").symlink_to(outside)
    os.mkfifo(workspace(shell) / "fifo")
    listing = shell.result("list", path="")
    assert [(e["name"], e["type"]) for e in listing["entries"]] == [
        ("d", "directory"), ("fifo", "fifo"), ("link", "symlink")]
    assert listing["entries"][2]["target"] == str(outside) and listing["total"] == 3
    assert shell.result("stat", path="d/f.txt")["entry"] | {"mtime": 0} == {
        "name": "f.txt", "type": "file", "size": 5, "mode": 0o644, "mtime": 0}
    assert shell.error("list", path="d/f.txt")["message"] == "not a directory: d/f.txt"
    assert shell.error("stat", path="nope")["message"] == "no such file or directory: nope"


def test_a_long_listing_is_paged(shell):
    for n in range(1200):
        (workspace(shell) / f"f{n:04d}").touch()
    first = shell.result("list", path="")
    assert (len(first["entries"]), first["total"], first["next_offset"]) == (1000, 1200, 1000)
    rest = shell.result("list", path="", offset=first["next_offset"])
    assert [e["name"] for e in rest["entries"]] == [f"f{n:04d}" for n in range(1000, 1200)]


def test_the_home_root(shell):
    assert "result" in upload_bytes(shell, ".config/tool.ini", b"x=1", root="home")
    assert (shell.session_dir / "home/.config/tool.ini").read_bytes() == b"x=1"
    assert [e["name"] for e in shell.result("list", root="home")["entries"]] == [".config"]


def test_a_tree_round_trip_as_tar(shell):
    upload = tar_of((entry("./src", tarfile.DIRTYPE, mode=0o755), b""),
                    (entry("./src/main.py", mode=0o755), b"print('hi')\n"),
                    (entry("./src/data/blob", mode=0o600), os.urandom(100_000)),
                    (entry("./src/link", tarfile.SYMTYPE, "main.py"), b""),
                    (entry("./src/hard", tarfile.LNKTYPE, "src/main.py"), b""))
    result = upload_bytes(shell, "proj", gzip.compress(upload), kind="tar")["result"]
    assert result["entries"] == 5 and result["kind"] == "tar"
    root = workspace(shell) / "proj/src"
    assert os.readlink(root / "link") == "main.py" and (root / "hard").read_bytes() == b"print('hi')\n"
    assert stat.S_IMODE((root / "main.py").stat().st_mode) == 0o755
    opened, data = download_bytes(shell, "proj")
    assert opened["kind"] == "tar" and opened["size"] is None
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        names = {m.name: m for m in archive.getmembers()}
        assert sorted(names) == ["src", "src/data", "src/data/blob", "src/hard", "src/link", "src/main.py"]
        assert archive.extractfile("src/data/blob").read() == (root / "data/blob").read_bytes()
        assert names["src/link"].issym() and names["src/link"].linkname == "main.py"
    # A second tar merges into the existing tree.
    more = tar_of((entry("src/new.txt"), b"new"), (entry("src/main.py"), b"replaced"))
    assert "result" in upload_bytes(shell, "proj", more, kind="tar")
    assert (root / "new.txt").read_bytes() == b"new" and (root / "main.py").read_bytes() == b"replaced"
    assert (root / "data/blob").exists()
    no_staging_left(shell)


HOSTILE_ARCHIVES = {
    "dotdot": [(entry("ok.txt"), b"ok"), (entry("../x"), b"x")],
    "absolute": [(entry("ok.txt"), b"ok"), (entry("/tmp/x"), b"x")],
    "device": [(entry("ok.txt"), b"ok"), (entry("null", tarfile.CHRTYPE), b"")],
    "fifo": [(entry("ok.txt"), b"ok"), (entry("pipe", tarfile.FIFOTYPE), b"")],
    "hardlink-out": [(entry("ok.txt"), b"ok"), (entry("h", tarfile.LNKTYPE, "../../outside/x"), b"")],
    "symlink-out": [(entry("ok.txt"), b"ok"), (entry("s", tarfile.SYMTYPE, "../../outside"), b"")],
    "below-symlink": [(entry("s", tarfile.SYMTYPE, "."), b""), (entry("s/x"), b"x")],
}


@pytest.mark.parametrize("name", sorted(HOSTILE_ARCHIVES))
def test_hostile_archives_are_refused_with_nothing_written(shell, outside, name):
    (workspace(shell) / "keep.txt").write_bytes(b"kept")
    before = tree_snapshot(workspace(shell))
    response = upload_bytes(shell, "dest", tar_of(*HOSTILE_ARCHIVES[name]), kind="tar")
    assert response["error"]["message"].startswith("refused:"), response
    assert tree_snapshot(workspace(shell)) == before
    assert list(outside.iterdir()) == []
    no_staging_left(shell)


def test_hostile_paths_are_refused_with_nothing_written(shell, outside):
    (workspace(shell) / "out").symlink_to(outside)
    (workspace(shell) / "file.txt").write_bytes(b"plain")
    before = tree_snapshot(workspace(shell))
    for path in ("/etc/x", "../x", "a/../../x", "out/x", "out/deeper/x", "file.txt/x"):
        response = upload_bytes(shell, path, b"payload")
        assert "error" in response, (path, response)
        response = upload_bytes(shell, path, tar_of((entry("x"), b"x")), kind="tar")
        assert "error" in response, (path, response)
    assert upload_bytes(shell, "out", b"payload")["error"]["message"].startswith("conflict:")  # not through it
    assert upload_bytes(shell, "out", tar_of((entry("x"), b"x")), kind="tar")["error"]["code"] == "invalid_request"
    for verb in ("stat", "list", "download"):
        assert shell.error(verb, path="out/x")["message"].startswith("refused: out is a symlink")
    assert shell.error("download", path="out")["message"].startswith("refused: out is a symlink")
    assert tree_snapshot(workspace(shell)) == before
    assert list(outside.iterdir()) == []
    no_staging_left(shell)


def test_a_tar_that_would_replace_a_directory_with_a_file_is_refused(shell):
    (workspace(shell) / "d/sub").mkdir(parents=True)
    hand_over(workspace(shell) / "d")
    before = tree_snapshot(workspace(shell))
    response = upload_bytes(shell, "d", tar_of((entry("new.txt"), b"n"), (entry("sub"), b"file now")), kind="tar")
    assert response["error"]["message"].startswith("conflict: d/sub exists as a directory")
    assert tree_snapshot(workspace(shell)) == before
    assert upload_bytes(shell, "d", b"x")["error"]["message"].startswith("is a directory: d")


def staged(shell, path: str, data: bytes, **params) -> str:
    """An upload opened and `data` written into its staging (closed then): its transfer id."""
    opened, staging = open_upload(shell, path, **params)
    assert staging is not None
    try:
        os.pwrite(staging, data, 0)
    finally:
        os.close(staging)
    return opened["result"]["transfer_id"]


def test_a_digest_mismatch_writes_nothing(shell):
    transfer = staged(shell, "f.bin", b"abc")
    error = shell.error("upload_commit", transfer_id=transfer, sha256=hashlib.sha256(b"abd").hexdigest())
    assert error["message"].startswith("sha256 mismatch")
    assert not (workspace(shell) / "f.bin").exists()
    no_staging_left(shell)


def test_sizes_are_enforced(shell):
    """What the client staged is measured by the commit: more or less than announced is refused, nothing written."""
    assert shell.error("upload", path="x", size=agent.MAX_TRANSFER_BYTES + 1)["message"].startswith("too large")
    assert "mode is for file uploads" in shell.error("upload", path="d", kind="tar", mode=0o755)["message"]
    too_long = staged(shell, "x", b"abcd", size=3)
    assert shell.error("upload_commit", transfer_id=too_long)["message"].startswith("too large")
    too_short = staged(shell, "x", b"ab", size=3)
    assert "announced 3 bytes but 2" in shell.error("upload_commit", transfer_id=too_short)["message"]
    assert "no such upload" in shell.error("transfer_close", transfer_id=too_short)["message"]  # refused: dropped
    closed = staged(shell, "x", b"abc", size=3)
    assert shell.result("transfer_close", transfer_id=closed)["closed"] is True
    assert not (workspace(shell) / "x").exists()
    no_staging_left(shell)


def test_free_space_is_checked(shell):
    fd = os.open(workspace(shell), os.O_RDONLY)
    try:
        with pytest.raises(agent.DiskFullError, match="not enough space"):
            agent.require_free_space(fd, agent.free_bytes(fd), "the workspace")
        agent.require_free_space(fd, 0, "the workspace")
    finally:
        os.close(fd)


def test_only_files_and_directories_download(shell):
    os.mkfifo(workspace(shell) / "fifo")
    (workspace(shell) / "link").symlink_to("fifo")
    assert shell.error("download", path="fifo")["message"].startswith("refused: fifo is a fifo")
    assert shell.error("download", path="link")["message"].startswith("refused: link is a symlink")
    assert shell.error("download", path="nope")["message"] == "no such file or directory: nope"


def test_a_bounded_number_of_transfers_are_open(shell):
    opened = [shell.result("upload", path=f"f{n}")["transfer_id"] for n in range(agent.MAX_OPEN_TRANSFERS)]
    assert shell.error("upload", path="one-more")["code"] == "server_unavailable"
    assert shell.error("download", path="")["code"] == "server_unavailable"
    for transfer in opened:
        shell.result("transfer_close", transfer_id=transfer)
    no_staging_left(shell)


def test_an_agent_that_dies_mid_upload_leaves_nothing_behind(start_agent):
    """The staging is an unnamed file: it goes with the last fd on it, the agent's."""
    shell = start_agent("--workload", "shell")
    before = os.statvfs(workspace(shell))
    size_bytes = 8 * agent.COPY_CHUNK_BYTES
    staged(shell, "half.bin", os.urandom(size_bytes))  # the test's own copy of its staging closed
    blocks = before.f_bfree - os.statvfs(workspace(shell)).f_bfree
    shell.crash()
    assert list(workspace(shell).iterdir()) == []
    assert sorted(p.name for p in shell.agent_dir.iterdir()) == ["control.sock", "events.jsonl", "output.log"]
    assert blocks * before.f_frsize >= size_bytes // 2  # the bytes were on the workspace's file system...
    wait_until(lambda: os.statvfs(workspace(shell)).f_bfree >= before.f_bfree - blocks // 2, "the space back")


def test_uploads_survive_checkpoint_and_restore(start_agent):
    source = start_agent("--workload", "shell")
    data = os.urandom(300_000)
    assert "result" in upload_bytes(source, "kept/data.bin", data)
    result = source.result("checkpoint", id="files")
    assert source.error("upload", path="late")["code"] == "server_unavailable"  # admission closed
    source.stop()
    restored = start_agent("--workload", "shell", "--restore", result["path"], name="t")
    assert download_bytes(restored, "kept/data.bin")[1] == data


def test_a_closed_upload_keeps_no_descriptor_or_digest_job(shell):
    """Each open upload holds its staging twice (its own fd, its digest job's); closed, both go, and the job ends."""
    proc = f"/proc/{shell.proc.pid}"
    shell.result("stat", path="")  # the zygote started

    def held() -> tuple[int, int]:
        return len(os.listdir(f"{proc}/fd")), len(os.listdir(f"{proc}/task"))

    before = held()
    transfers = [staged(shell, f"f{n}", b"abc") for n in range(4)]
    assert held()[0] > before[0] + 4 and held()[1] > before[1]
    for transfer in transfers:
        shell.result("transfer_close", transfer_id=transfer)
    wait_until(lambda: held()[0] <= before[0] and held()[1] <= before[1], "the uploads' fds and jobs to go")
    no_staging_left(shell)


def test_a_pure_linger_waits_while_an_operation_is_open_and_counts_from_the_last_close():
    assert agent.zygote_linger_left(1, last_closed=0.0, now=1000.0, linger_s=60.0) is None
    assert agent.zygote_linger_left(0, last_closed=100.0, now=130.0, linger_s=60.0) == 30.0
    assert agent.zygote_linger_left(0, last_closed=100.0, now=160.0, linger_s=60.0) == 0.0
    assert agent.zygote_linger_left(0, last_closed=100.0, now=999.0, linger_s=60.0) == 0.0


def test_the_file_workers_end_once_unused_for_their_linger_and_start_again(start_agent):
    """An idle session holds no second interpreter: the zygote goes once no operation was open for the linger,
    and the next operation starts a new one."""
    shell = start_agent("--workload", "shell", "--file-worker-linger", "0.3")
    assert zygote_pids(shell) == []
    shell.result("stat", path="")
    [first] = zygote_pids(shell)
    wait_until(lambda: not zygote_pids(shell), "the zygote to end after its linger")
    assert shell.result("stat", path="")["entry"]["type"] == "directory"
    [second] = zygote_pids(shell)
    assert second != first


#: A tar reader slower than the linger: it pauses this long between reads.
SLOW_READ_PAUSE_S = 0.4


def test_a_tree_read_slower_than_the_linger_still_comes_whole(start_agent):
    """2,000 files: the worker's walk blocks on its socket while the tar waits for its reader, so the walk's
    operation stays open; the linger must not end the zygote (and the walk with it) under it."""
    shell = start_agent("--workload", "shell", "--file-worker-linger", "0.1")
    tree = workspace(shell) / "tree"
    tree.mkdir()
    for index in range(2000):
        (tree / f"f{index:04}").write_bytes(index.to_bytes(2, "big") * 1024)
    response, fds = agent.call_with_fds(shell.session_dir, "download", {"path": "tree"})
    opened = response["result"]
    data = b""
    with os.fdopen(fds[0], "rb") as source:
        while piece := source.read(1024 * 1024):
            data += piece
            time.sleep(SLOW_READ_PAUSE_S)
    assert shell.result("transfer_close", transfer_id=opened["transfer_id"])["closed"] is True
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        members = [m for m in archive.getmembers() if m.isfile()]
        assert len(members) == 2000
        assert archive.extractfile("f1999").read() == (1999).to_bytes(2, "big") * 1024
