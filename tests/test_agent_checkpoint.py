"""checkpoint / restore through real agents: round trips keeping offsets, drain bounds, hostile archives."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from agent_fixtures.harness import (FAKE_AGENT_ARGV, agent, short_dir, start_agent,  # noqa: F401
                                    wait_until)


DEEP_TREE = Path(__file__).resolve().parent / "agent_fixtures" / "deep_tree.py"


def checkpoint(process, checkpoint_id):
    result = process.result("checkpoint", id=checkpoint_id)
    assert result["path"] == str(process.agent_dir / f"checkpoint-{checkpoint_id}.tar")
    return result


def test_shell_round_trip_keeps_offsets_and_workspace(start_agent):
    source = start_agent("--workload", "shell")
    source.result("message", text="echo kept > notes.txt; echo saved-$((1+1))")
    source.read_until(b"saved-2\r\n")
    source.wait_status(lambda s: s["turn_state"] == "idle" and s["queue_depth"] == 0, "the shell idle")
    result = checkpoint(source, "snap1")
    log = source.read_bytes()[:result["log_bytes"]]
    assert result["log_bytes"] > 0 and result["bytes"] > 0
    assert source.status()["admission_open"] is False
    assert source.error("message", text="echo late")["code"] == "server_unavailable"
    assert [e for e in source.events() if e["type"] == "checkpoint"][0]["id"] == "snap1"
    source.stop()

    restored = start_agent("--workload", "shell", "--restore", result["path"], name="t")
    after = restored.read_until(b"[reploy: restored from checkpoint snap1]")
    assert after.startswith(log)
    assert (restored.session_dir / "workspace" / "notes.txt").read_text() == "kept\n"
    assert restored.status()["admission_open"] is True
    restored.result("message", text="cat notes.txt")
    restored.read_until(b"kept\r\n")  # the file's content (the typed line echoes "cat notes.txt")
    kinds = [e["type"] for e in restored.events()]
    assert kinds[:2] == ["restore", "session_start"]


def test_restore_in_the_same_session_dir_swaps_the_workspace(start_agent):
    source = start_agent("--workload", "shell")
    workspace = source.session_dir / "workspace"
    (workspace / "state.txt").write_text("at checkpoint")
    result = checkpoint(source, "same")
    source.stop()
    (workspace / "state.txt").write_text("changed later")
    (workspace / "extra.txt").write_text("new file")
    again = start_agent("--workload", "shell", "--restore", result["path"])
    assert (workspace / "state.txt").read_text() == "at checkpoint"
    assert not (workspace / "extra.txt").exists()
    assert not list(again.session_dir.glob(".restore-*"))


def test_agent_round_trip_through_await_restore_keeps_continue(start_agent):
    source = start_agent("--workload", "agent", "--agent-command", FAKE_AGENT_ARGV)
    source.result("message", text="write made.txt by the agent")
    source.read_until(b"done\n")
    source.wait_status(lambda s: s["turn_state"] == "idle", "the run to finish")
    assert source.status()["continue"] is True
    result = checkpoint(source, "agent-snap")
    log = source.read_bytes()
    source.stop()

    target = start_agent("--workload", "agent", "--agent-command", FAKE_AGENT_ARGV, "--await-restore", name="t")
    waiting = target.status()
    assert waiting["awaiting_restore"] is True and waiting["turn_state"] == "waiting"
    assert target.error("message", text="say hi")["code"] == "server_unavailable"
    assert target.result("restore", path=result["path"]) == {"type": "restore", "id": "agent-snap",
                                                            "log_bytes": len(log)}
    assert target.error("restore", path=result["path"])["code"] == "command_error"  # only once, on a fresh agent
    status = target.status()
    assert status["awaiting_restore"] is False and status["continue"] is True and status["admission_open"] is True
    assert target.read_bytes().startswith(log)
    assert (target.session_dir / "workspace" / "made.txt").read_text() == "by the agent"
    target.result("message", text="args")
    text = target.read_until(b'"args"]\n').decode()
    assert json.loads(text.splitlines()[-1])[0] == "--continue"


def test_checkpoint_that_cannot_drain_times_out_and_reopens_admission(start_agent):
    shell = start_agent("--workload", "shell")
    shell.result("message", text="cat")
    shell.wait_status(lambda s: s["turn_state"] == "in_progress", "cat in the foreground")
    error = shell.error("checkpoint", id="busy")
    assert error["code"] == "timeout" and "did not drain" in error["message"]
    assert shell.status()["admission_open"] is True
    assert shell.result("message", text="echo after")["delivery"] == "queued"
    assert not list(shell.session_dir.glob("*checkpoint-busy*"))


def hostile_archive(path, extra):
    """A valid shell archive plus the given extra members ((TarInfo, bytes) pairs)."""
    buffer = io.BytesIO()
    manifest = agent.Manifest("evil", agent.WorkloadKind.SHELL, 3, False).to_json()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in ((agent.ARCHIVE_MANIFEST, manifest), (agent.ARCHIVE_LOG, b"abc")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        for info, data in extra:
            archive.addfile(info, io.BytesIO(data) if data else None)
    path.write_bytes(buffer.getvalue())
    return path


def regular(name, data=b"x"):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def link(name, target, kind=tarfile.SYMTYPE):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


@pytest.mark.parametrize("extra, fragment", [
    ([regular("workspace/../../escaped")], "unsafe member name"),
    ([regular("/tmp/absolute")], "unsafe member name"),
    ([link("workspace/out", "/etc"), regular("workspace/out/passwd")], "escapes its tree"),
    ([link("workspace/hard", "/etc/passwd", tarfile.LNKTYPE)], "not a regular file, directory or symlink"),
])
def test_hostile_archives_are_refused_and_change_nothing(start_agent, short_dir, extra, fragment):
    archive = hostile_archive(short_dir / "evil.tar", extra)
    target = start_agent("--workload", "shell", "--await-restore")
    error = target.error("restore", path=str(archive))
    assert error["code"] == "command_error" and fragment in error["message"]
    assert target.status()["awaiting_restore"] is True
    assert not list(target.session_dir.glob(".restore-*"))
    assert list((target.session_dir / "workspace").iterdir()) == []
    assert not (short_dir / "escaped").exists()


def test_restore_at_startup_with_a_hostile_archive_fails_cleanly(start_agent, short_dir):
    archive = hostile_archive(short_dir / "evil.tar", [regular("workspace/../x")])
    process = start_agent("--workload", "shell", "--restore", str(archive), ready=False)
    assert process.proc.wait(15) == 1
    assert "unsafe member name" in process.stderr
    assert not (process.session_dir / agent.SOCKET_NAME).exists()


def test_an_archive_for_the_other_workload_is_refused(start_agent, short_dir):
    shell = start_agent("--workload", "shell")
    result = checkpoint(shell, "shell-one")
    target = start_agent("--workload", "agent", "--agent-command", FAKE_AGENT_ARGV, "--await-restore", name="t")
    error = target.error("restore", path=result["path"])
    assert error["code"] == "command_error" and "for the shell workload" in error["message"]


# ---- issue 26, item 2: checkpoints a workload cannot break (sparse files, deep trees, many entries)


def test_a_sparse_file_is_archived_by_its_data_and_restored_sparse(start_agent):
    source = start_agent("--workload", "shell")
    sparse = source.session_dir / "workspace" / "sparse"
    with open(sparse, "wb") as out:
        out.seek(100 << 20)
        out.write(b"middle")
        out.truncate(1 << 30)
    result = checkpoint(source, "sparse")
    assert result["bytes"] < 1 << 20  # the archive holds the data, not the gigabyte of holes
    with tarfile.open(result["path"]) as archive:
        member = archive.getmember("workspace/sparse")
        assert member.size == 1 << 30 and member.sparse and sum(n for _, n in member.sparse) < 1 << 20
    source.stop()
    sparse.unlink()

    start_agent("--workload", "shell", "--restore", result["path"])
    st = sparse.stat()
    assert st.st_size == 1 << 30 and st.st_blocks * 512 < 1 << 20  # restored sparse
    with open(sparse, "rb") as restored:
        restored.seek((100 << 20) - 3)
        assert restored.read(9) == b"\0\0\0middle"
        restored.seek(-4096, 2)
        assert restored.read() == bytes(4096)


def deep_tree(*args):
    """tests/agent_fixtures/deep_tree.py, run as the test's own process (the paths outgrow PATH_MAX)."""
    return subprocess.run([sys.executable, str(DEEP_TREE), *map(str, args)], check=True, capture_output=True,
                          text=True, timeout=120).stdout


def remove_deep_tree(workspace):
    """shutil.rmtree (the fixture's cleanup) recurses once per level: the agent's own removal does not."""
    fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
    try:
        agent.remove_entry(fd, "d")
    finally:
        os.close(fd)


def test_a_tree_1200_levels_deep_round_trips(start_agent):
    levels = 1200
    source = start_agent("--workload", "shell")
    workspace = source.session_dir / "workspace"
    deep_tree("make", workspace, levels)
    try:
        result = checkpoint(source, "deep")
        source.stop()
        remove_deep_tree(workspace)
        assert not (workspace / "d").exists()

        restored = start_agent("--workload", "shell", "--restore", result["path"])
        assert deep_tree("check", workspace) == f"{levels} at the bottom\n"
        again = checkpoint(restored, "again")  # the restored tree archives, and its old copy is removed, too
        restored.stop()
        start_agent("--workload", "shell", "--restore", again["path"])
        assert deep_tree("check", workspace) == f"{levels} at the bottom\n"
    finally:
        remove_deep_tree(workspace)
