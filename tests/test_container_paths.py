"""The host's helpers for directories a container can write (reploy.py, "Directories a container
can write"; agent.py's connect_unix_at and `call`), on real files, FIFOs and unix sockets.

Each hostile entry points at a canary the test made (a root-only file, a listening socket): the
checks are that no canary byte is read, the canary socket never sees a connection, nothing
blocks, and the error names what was found. No Docker: test_serve_hostile.py does the same
through a real session's container.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

import agent
import reploy
import reploy_watchdog
from agent_fixtures.harness import AGENT_PY

CANARY = b"CANARY-host-secret-0123456789\n"


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    """A host file only root may read, outside the directory under test."""
    path = tmp_path / "canary"
    path.write_bytes(CANARY)
    path.chmod(0o600)
    return path


@pytest.fixture
def box(tmp_path: Path) -> Path:
    """The directory a container could write."""
    path = tmp_path / "box"
    path.mkdir()
    return path


class CanarySocket:
    """A listening unix socket of the host's, mode 0600, that must never get a connection.
    (test_serve_hostile.py uses it too.)"""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:  # through /proc so that a long tmp_path cannot exceed sun_path
            self.sock.bind(f"/proc/self/fd/{dir_fd}/{path.name}")
        finally:
            os.close(dir_fd)
        path.chmod(0o600)
        self.sock.listen(8)
        self.sock.setblocking(False)

    def connections(self) -> int:
        count = 0
        while True:
            try:
                connection, _ = self.sock.accept()
            except BlockingIOError:
                return count
            connection.close()
            count += 1

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def canary_socket(tmp_path: Path) -> Iterator[CanarySocket]:
    listener = CanarySocket(tmp_path / "host.sock")
    yield listener
    listener.close()


def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def make_socket(path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()


# -- files -------------------------------------------------------------------------------------


def test_a_regular_file_is_read(box: Path) -> None:
    (box / "output.log").write_bytes(b"hello")
    with reploy.opened_dir(box) as dir_fd:
        fd = reploy.open_regular_file(dir_fd, "output.log")
        assert reploy.regular_file_size(dir_fd, "output.log") == 5
    try:
        assert os.read(fd, 100) == b"hello"
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind, make", [
    ("symlink", None), ("fifo", make_fifo), ("socket", make_socket), ("directory", Path.mkdir),
])
def test_anything_but_a_regular_file_is_refused_without_reading_or_blocking(
        box: Path, canary: Path, kind: str, make: object) -> None:
    entry = box / "output.log"
    if make is None:
        entry.symlink_to(canary)
    else:
        make(entry)  # type: ignore[operator]
    with reploy.opened_dir(box) as dir_fd:
        with pytest.raises(reploy.ContainerPathError, match=f"output.log is a {kind}, not a regular file"):
            reploy.open_regular_file(dir_fd, "output.log")  # a FIFO without a writer: at once
        with pytest.raises(reploy.ContainerPathError, match=f"is a {kind}"):
            reploy.regular_file_size(dir_fd, "output.log")
    assert canary.read_bytes() == CANARY


def test_a_missing_file_is_file_not_found_and_has_no_size(box: Path) -> None:
    with reploy.opened_dir(box) as dir_fd:
        with pytest.raises(FileNotFoundError):
            reploy.open_regular_file(dir_fd, "output.log")
        assert reploy.regular_file_size(dir_fd, "output.log") is None


def test_the_directory_itself_is_not_followed(tmp_path: Path, box: Path) -> None:
    (box / "output.log").write_bytes(b"x")
    link = tmp_path / "link"
    link.symlink_to(box)
    with pytest.raises(OSError) as raised:
        with reploy.opened_dir(link):
            pass
    assert raised.value.errno in (errno.ELOOP, errno.ENOTDIR)


# -- sockets -----------------------------------------------------------------------------------


def test_a_socket_is_connected_through_its_checked_inode(tmp_path: Path) -> None:
    """Also from a directory deeper than sun_path's 108 bytes could name."""
    deep = tmp_path / ("d" * 100) / ("e" * 100)
    deep.mkdir(parents=True)
    server = CanarySocket(deep / "control.sock")
    try:
        with reploy.opened_dir(deep) as dir_fd:
            with agent.connect_unix_at(dir_fd, "control.sock", 5.0):
                pass
        assert server.connections() == 1
    finally:
        server.close()


@pytest.mark.parametrize("kind", ["symlink", "file", "fifo"])
def test_a_control_socket_that_is_not_a_socket_is_never_connected(
        box: Path, canary_socket: CanarySocket, kind: str) -> None:
    entry = box / "control.sock"
    if kind == "symlink":
        entry.symlink_to(canary_socket.path)
    elif kind == "file":
        entry.write_bytes(b"")
    else:
        os.mkfifo(entry)
    with reploy.opened_dir(box) as dir_fd:
        with pytest.raises(OSError, match=f"control.sock is a {kind}, not a socket") as raised:
            agent.connect_unix_at(dir_fd, "control.sock", 5.0)
    assert raised.value.errno == errno.ENOTSOCK
    assert canary_socket.connections() == 0


def test_agent_py_call_through_a_symlinked_control_socket_fails_and_never_connects(
        box: Path, canary_socket: CanarySocket) -> None:
    (box / agent.AGENT_DIR_NAME).mkdir()
    (box / agent.AGENT_DIR_NAME / "control.sock").symlink_to(canary_socket.path)
    proc = subprocess.run([sys.executable, str(AGENT_PY), "call", str(box), "status"],
                          capture_output=True, timeout=30)
    assert proc.returncode == 1
    assert "control.sock is a symlink, not a socket" in json.loads(proc.stdout)["error"]["message"]
    assert canary_socket.connections() == 0


# -- removal -----------------------------------------------------------------------------------


def make_deep_tree(root: Path, depth: int) -> None:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(depth):
            os.mkdir("d", dir_fd=fd)
            (Path(f"/proc/self/fd/{fd}") / f"file-{level}").write_bytes(b"x")
            next_fd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = next_fd
    finally:
        os.close(fd)


def test_a_tree_deeper_than_the_recursion_limit_is_removed(box: Path) -> None:
    make_deep_tree(box, sys.getrecursionlimit() * 3)
    reploy_watchdog.remove_tree(box)
    assert not os.path.lexists(box)


def test_a_dead_hosts_deep_output_staging_is_removed_by_its_reconciliation(
        box: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The watchdog and `controlled-session cleanup` remove a controller-written tree the same
    way (here with no engine to answer, so only the paths can go)."""
    make_deep_tree(box, sys.getrecursionlimit() * 3)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    manifest_path = tmp_path / "manifest.json"
    manifest = reploy_watchdog.Manifest(
        run_id="f" * 32, host="", watchdog="", containers={}, networks={}, paths=(str(box),),
        receipt_path=str(tmp_path / "receipt.json"))
    receipt = reploy_watchdog.reconcile_manifest(manifest, manifest_path, "reconciled")
    assert receipt["removed"]["paths"] == [str(box)] and not os.path.lexists(box)
    assert receipt["cleanup_succeeded"] is False  # the engine's part could not be checked
    assert reploy_watchdog.Manifest.load(manifest_path).paths == ()


def test_removal_follows_no_link_and_empties_every_kind_of_entry(
        tmp_path: Path, box: Path, canary: Path, canary_socket: CanarySocket) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"keep")
    (box / "sub" / "deeper").mkdir(parents=True)
    (box / "sub" / "to-canary").symlink_to(canary)
    (box / "sub" / "deeper" / "to-outside").symlink_to(outside)
    (box / "to-socket").symlink_to(canary_socket.path)
    os.mkfifo(box / "sub" / "fifo")
    make_socket(box / "sub" / "deeper" / "sock")
    os.link(box / "sub" / "fifo", box / "hard-link")
    (box / "sub" / "deeper").chmod(0o000)  # root removes it all the same
    reploy_watchdog.remove_tree(box)
    assert not os.path.lexists(box)
    assert canary.read_bytes() == CANARY and (outside / "keep").read_bytes() == b"keep"
    assert canary_socket.path.exists() and canary_socket.connections() == 0


def test_removing_an_entry_that_is_a_link_to_a_directory_removes_the_link_only(
        box: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"keep")
    (box / "checkpoint-x.tar").symlink_to(outside)
    with reploy.opened_dir(box) as dir_fd:
        reploy_watchdog.remove_entry(dir_fd, "checkpoint-x.tar")
    assert not os.path.lexists(box / "checkpoint-x.tar")
    assert (outside / "keep").read_bytes() == b"keep"


def test_remove_tree_of_nothing_is_file_not_found(box: Path) -> None:
    with pytest.raises(FileNotFoundError):
        reploy_watchdog.remove_tree(box / "missing")


# -- publication of a staged file --------------------------------------------------------------


def test_a_staged_regular_file_is_published_as_a_hard_link_never_clobbering(tmp_path: Path,
                                                                            box: Path) -> None:
    (box / "out.txt").write_bytes(b"artifact")
    destination = tmp_path / "out.txt"
    reploy.publish_regular_file(box, destination)
    assert destination.read_bytes() == b"artifact"
    assert os.stat(destination).st_ino == os.stat(box / "out.txt").st_ino
    with pytest.raises(FileExistsError):
        reploy.publish_regular_file(box, destination)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_a_staged_entry_that_is_not_a_regular_file_is_not_published(
        tmp_path: Path, box: Path, canary: Path, kind: str) -> None:
    staged = box / "out.txt"
    if kind == "symlink":
        staged.symlink_to(canary)
    elif kind == "fifo":
        os.mkfifo(staged)
    else:
        staged.mkdir()
    destination = tmp_path / "out.txt"
    with pytest.raises(reploy.ContainerPathError, match=f"out.txt is a {kind}, not a regular file"):
        reploy.publish_regular_file(box, destination)
    assert not os.path.lexists(destination)


# -- agent.py's own session dir ----------------------------------------------------------------


@pytest.mark.parametrize("mode, owner", [(0o777, None), (0o720, None), (0o700, 12345)])
def test_the_agent_refuses_a_session_dir_others_could_write(tmp_path: Path, mode: int,
                                                            owner: int | None) -> None:
    session_dir = tmp_path / "s"
    session_dir.mkdir()
    session_dir.chmod(mode)
    if owner is not None:
        os.chown(session_dir, owner, owner)
    identity = ["--runtime-user", "65534:65534"] if os.geteuid() == 0 else []
    proc = subprocess.run([sys.executable, str(AGENT_PY), "serve", "--session-dir", str(session_dir),
                           "--workload", "shell", *identity], capture_output=True, timeout=30)
    assert proc.returncode == 1
    assert b"owned by uid" in proc.stderr and b"writable by no one else" in proc.stderr
    assert list(session_dir.iterdir()) == []  # nothing made or opened in it


def test_require_private_dir_accepts_a_private_dir(tmp_path: Path) -> None:
    session_dir = tmp_path / "s"
    session_dir.mkdir(mode=0o700)
    agent.require_private_dir(session_dir, 0o077)  # the agent's own dir: open to no one else
    session_dir.chmod(0o755)
    agent.require_private_dir(session_dir, 0o022)  # the session dir: writable by no one else
    with pytest.raises(agent.StartupError, match="open to no one else"):
        agent.require_private_dir(session_dir, 0o077)
    assert stat.S_IMODE(os.stat(session_dir).st_mode) == 0o755


def test_the_host_compiles_agent_py_only_when_it_publishes_a_file(tmp_path: Path) -> None:
    """agent.py is 6,000 lines, and compiling them sat on every session's way to `ready`: the
    host imports it only for an --output-file publish, the one user of these helpers."""
    staging, destination = tmp_path / "staging", tmp_path / "out" / "result.txt"
    staging.mkdir()
    destination.parent.mkdir()
    (staging / destination.name).write_bytes(b"published\n")
    script = ("import sys, reploy\n"
              "before = 'agent' in sys.modules\n"
              "reploy.publish_regular_file(*map(reploy.Path, sys.argv[1:]))\n"
              "print(before, 'agent' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(staging), str(destination)],
                          capture_output=True, text=True, timeout=120,
                          cwd=Path(reploy.__file__).parent)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"]
    assert destination.read_bytes() == b"published\n"
