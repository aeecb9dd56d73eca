"""Privilege separation in agent.py, with real processes on this host: run as root with
--runtime-user 65534:65534 (the harness's RUNTIME_USER), the agent starts every process of the
workload and every file worker as that user, and the workload cannot signal, trace or enter the
agent. Also the strict parsers of what a file worker answers, fed by a hostile peer over a real
SOCK_SEQPACKET pair. (tests/test_serve_boundary.py does the same from inside real containers,
where the agent keeps only SETUID, SETGID, SETPCAP and KILL.)
"""

from __future__ import annotations

import array
import errno
import fcntl
import io
import json
import os
import signal
import socket
import struct
import tarfile
import threading
from pathlib import Path

import pytest

from agent_fixtures.harness import (AS_ROOT, FAKE_AGENT_ARGV, PYTHON, REACHABLE_FIXTURES, RUNTIME_GID,  # noqa: F401
                                    RUNTIME_UID, agent, download_bytes, run_exec, short_dir, start_agent,
                                    upload_bytes, wait_until, zygote_pids)

PROBE = REACHABLE_FIXTURES / "escape_probe.py"
as_root = pytest.mark.skipif(not AS_ROOT, reason="privilege separation needs the agent to run as root")


def identity(pid: int) -> dict[str, str]:
    """The Uid, Gid, Groups and CapEff and CapBnd lines of /proc/PID/status."""
    fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if ":\t" in line)
    return {key: fields[key].strip() for key in ("Uid", "Gid", "Groups", "CapEff", "CapBnd")}


NO_CAPABILITIES = "0" * 16
RUNTIME_IDENTITY = {"Uid": f"{RUNTIME_UID}\t" * 3 + f"{RUNTIME_UID}", "Gid": f"{RUNTIME_GID}\t" * 3 + f"{RUNTIME_GID}",
                    "Groups": "", "CapEff": NO_CAPABILITIES, "CapBnd": NO_CAPABILITIES}


@as_root
def test_the_shell_execs_agent_runs_and_file_workers_all_run_as_the_runtime_user(start_agent):
    shell = start_agent("--workload", "shell")
    assert identity(shell.status()["pid"]) == RUNTIME_IDENTITY
    assert zygote_pids(shell) == []  # started with the first file operation
    shell.result("list")
    [zygote] = zygote_pids(shell)
    assert identity(zygote) == RUNTIME_IDENTITY
    status = run_exec(shell, ["cat", "/proc/self/status"])["stdout"].decode()
    exec_identity = {key: value.strip() for key, value in (line.split(":\t", 1) for line in status.splitlines()
                                                           if ":\t" in line) if key in RUNTIME_IDENTITY}
    assert exec_identity == RUNTIME_IDENTITY
    shell.result("message", text="stat -c owner=%u $(tty)")
    shell.read_until(f"owner={RUNTIME_UID}".encode())  # its terminal is its own, as login(1) makes it
    assert "result" in upload_bytes(shell, "made-by-a-worker", b"x")
    assert (shell.workspace / "made-by-a-worker").stat().st_uid == RUNTIME_UID

    runner = start_agent("--workload", "agent", "--agent-command", FAKE_AGENT_ARGV, name="a")
    runner.result("message", text="hang")
    run = runner.wait_status(lambda s: s["pid"] is not None, "the run")["pid"]
    assert identity(run) == RUNTIME_IDENTITY


def environ_of(pid: int) -> dict[bytes, bytes]:
    return dict(entry.partition(b"=")[::2] for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if entry)


@as_root
def test_the_agents_credentials_stay_in_its_runs_and_nothing_it_starts_keeps_a_capability(start_agent):
    """--redact-env values reach the agent CLI's runs only: not the file-worker zygote (a minimal environment), nor
    an exec. A prompt on stdin is a read-only fd that cannot be linked; a run has no capability, bounding set
    included."""
    secret = "credential-" + os.urandom(8).hex()
    runner = start_agent("--workload", "agent", "--agent-command", FAKE_AGENT_ARGV, "--redact-env", "FAKE_SECRET",
                         env={"FAKE_SECRET": secret}, name="a")
    runner.result("list")  # starts the zygote
    [zygote] = zygote_pids(runner)
    assert set(environ_of(zygote)) <= {name.encode() for name in agent.ZYGOTE_ENV_NAMES}
    assert secret.encode() not in Path(f"/proc/{zygote}/cmdline").read_bytes()
    exec_environ = run_exec(runner, ["cat", "/proc/self/environ"])["stdout"]
    assert b"FAKE_SECRET" not in exec_environ and secret.encode() not in exec_environ and b"HOME=" in exec_environ
    runner.result("message", text="probe ".ljust(200 * 1024, "p"))  # too long for one argument: on stdin
    [line] = [line for line in runner.read_until(b"}}\n").decode().splitlines() if '"caps"' in line]
    probe = json.loads(line)
    assert probe["via"] == "stdin" and probe["stdin"] == "read-only" and probe["link"] != "linked"
    assert probe["caps"] == dict.fromkeys(("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"), NO_CAPABILITIES)
    assert not (runner.workspace / "linked-stdin").exists()


def test_a_prompt_file_is_read_only_and_never_linkable_even_by_its_owner(tmp_path):
    """prompt_input's fd: the command can read its prompt and do nothing else with the agent's file. Its owner
    passes fs.protected_hardlinks, so what refuses the link here is the file itself (O_TMPFILE | O_EXCL)."""
    with agent.prompt_input(tmp_path, "a long prompt") as fd:
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        assert os.read(fd, 100) == b"a long prompt"
        with pytest.raises(OSError) as written:
            os.write(fd, b"x")
        assert written.value.errno == errno.EBADF
        proc = os.open("/proc/self", os.O_RDONLY | os.O_DIRECTORY)
        try:  # linkat(AT_SYMLINK_FOLLOW) of the fd's magic link: what would give the file a name
            with pytest.raises(FileNotFoundError):
                os.link(f"fd/{fd}", tmp_path / "named", src_dir_fd=proc, follow_symlinks=True)
        finally:
            os.close(proc)
    assert list(tmp_path.iterdir()) == []


@as_root
def test_the_workload_cannot_signal_trace_or_enter_the_agent(start_agent):
    shell = start_agent("--workload", "shell")
    result = run_exec(shell, [PYTHON, str(PROBE), str(shell.session_dir), str(shell.agent_dir),
                              str(shell.proc.pid)])
    assert result["exit_code"] == 0, result["stderr"]
    [line] = [line for line in result["stdout"].decode().splitlines() if line.startswith("PROBE-RESULT ")]
    outcomes = json.loads(line.split(" ", 1)[1])
    assert outcomes.pop("uid") == RUNTIME_UID and outcomes.pop("agent_uid") == 0
    refused = {name for name in outcomes if name.startswith(("ptrace", "signal"))}
    assert {name: outcomes[name] for name in refused} == dict.fromkeys(refused, "EPERM")
    assert {name: value for name, value in outcomes.items() if name not in refused} == dict.fromkeys(
        set(outcomes) - refused, "EACCES")
    assert shell.status()["running"] is True  # the same agent, untouched


@as_root
def test_file_work_is_confined_by_the_kernel_as_the_runtime_user(start_agent):
    shell = start_agent("--workload", "shell")
    secret = shell.workspace / "roots-only"
    secret.write_bytes(b"not for the workload")
    secret.chmod(0o600)
    closed = shell.workspace / "closed"
    closed.mkdir(mode=0o755)  # root's: the runtime user may look, not write
    assert shell.result("stat", path="roots-only")["entry"]["size"] == 20  # metadata is visible
    error = shell.error("download", path="roots-only")
    assert error["message"] == "permission denied: roots-only"  # the stable words serve maps to 403
    refused = upload_bytes(shell, "closed/new.txt", b"x")
    assert "error" in refused and refused["error"]["message"].startswith("permission denied: closed")
    assert list(closed.iterdir()) == []
    assert download_bytes(shell, "closed")[0]["kind"] == "tar"  # reading what it may read works


@as_root
def test_a_killed_or_stopped_zygote_is_replaced(start_agent):
    """The workload may kill or stop its file workers' zygote: it is its own. The file verbs
    then fail (a stopped one: for one request) and the next request gets a new zygote."""
    shell = start_agent("--workload", "shell")
    shell.result("list")
    [zygote] = zygote_pids(shell)
    assert run_exec(shell, ["kill", "-9", str(zygote)])["exit_code"] == 0
    assert shell.result("list")["total"] == 0
    [zygote] = zygote_pids(shell)
    assert run_exec(shell, ["kill", "-STOP", str(zygote)])["exit_code"] == 0
    assert shell.error("list")["code"] in ("timeout", "command_error")
    assert wait_until(lambda: "result" in shell.call("list"), "a new zygote")
    assert zygote not in zygote_pids(shell)  # the stopped one is gone


def queued_bytes(inode: int) -> int:
    """Bytes waiting in the receive queue of the unix socket `inode`, as the kernel reports them over
    NETLINK_SOCK_DIAG (SOCK_DIAG_BY_FAMILY, UDIAG_SHOW_RQLEN); -1 when no such socket is open."""
    request = struct.pack("=BBHIII2I", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, inode, 0x10, 0xFFFFFFFF, 0xFFFFFFFF)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 4) as diag:  # NETLINK_SOCK_DIAG
        diag.send(struct.pack("=IHHII", 16 + len(request), 20, 1, 1, 0) + request)  # NLM_F_REQUEST
        answer = diag.recv(65536)
    length, kind = struct.unpack_from("=IH", answer)
    if kind != 20:  # NLMSG_ERROR: the socket is gone
        return -1
    offset = 16 + 16  # nlmsghdr, unix_diag_msg
    while offset + 4 <= length:
        size, attribute = struct.unpack_from("=HH", answer, offset)
        if attribute == 4:  # UNIX_DIAG_RQLEN: rqueue, wqueue
            return struct.unpack_from("=I", answer, offset + 4)[0]
        offset += (size + 3) & ~3
    raise AssertionError("the kernel left out UNIX_DIAG_RQLEN")


@as_root
def test_a_zygote_killed_with_a_hand_off_queued_costs_no_request(start_agent):
    """The race behind a killed zygote: the agent's hand-off was queued, the zygote dies before it reads
    it, the socket goes with it unread. Held open here (the zygote stopped first, then killed once the
    kernel shows the hand-off waiting): the missing word sends the same request to a new zygote."""
    shell = start_agent("--workload", "shell")
    (shell.workspace / "kept").write_bytes(b"x")
    shell.result("list")
    [zygote] = zygote_pids(shell)
    channel = int(os.readlink(f"/proc/{zygote}/fd/0").removeprefix("socket:[").removesuffix("]"))
    assert run_exec(shell, ["kill", "-STOP", str(zygote)])["exit_code"] == 0
    answers: list[dict] = []
    caller = threading.Thread(target=lambda: answers.append(shell.call("list")))
    caller.start()
    wait_until(lambda: queued_bytes(channel) > 0, "the hand-off queued in the stopped zygote")
    os.kill(zygote, signal.SIGKILL)
    caller.join()
    [answer] = answers
    assert "result" in answer and answer["result"]["total"] == 1, answer
    assert zygote not in zygote_pids(shell)


# ---------------------------------------------------------------------------------------------------------------------
# What a hostile worker may send: the parsers, and WorkerStream over a real SOCK_SEQPACKET pair


@pytest.mark.parametrize("data, fragment", [
    (b"not json", "not JSON"),
    (b'{"entry": {}, "done": {}}', "one {kind: fields} object"),
    (b'[1]', "one {kind: fields} object"),
    (b'{"surprise": {}}', "unknown message kind"),
    (b'{"done": 5}', "is not an object"),
    (b'{"done": {"n": NaN}}', "not JSON"),
    (b'{"done": {"a": 1, "a": 2}}', "not JSON"),
])
def test_malformed_worker_messages_are_refused(data, fragment):
    with pytest.raises(agent.WorkerProtocolError, match=fragment):
        agent.parse_worker_packet(data)


def test_a_worker_error_keeps_its_code_and_loses_control_characters():
    error = agent.worker_failure({"code": "disk_full", "message": "not enough space\r\nX-Injected: 1"})
    assert isinstance(error, agent.DiskFullError) and "\r" not in str(error) and "\n" not in str(error)
    assert isinstance(agent.worker_failure({"code": "shell", "message": "x"}), agent.WorkerProtocolError)
    with pytest.raises(agent.WorkerProtocolError):
        agent.worker_failure({"code": "command_error"})


GOOD_ENTRY = {"name": "a.txt", "type": "file", "size": 3, "mode": 0o644, "mtime": 1.5}


@pytest.mark.parametrize("changes", [
    {"name": "a/b"}, {"name": ".."}, {"name": "."}, {"name": ""}, {"name": "a\0b"}, {"name": "x" * 800},
    {"type": "bomb"}, {"size": -1}, {"size": True}, {"mode": 0o10000}, {"mtime": 1e15}, {"mtime": "now"},
    {"target": "/etc"}, {"extra": 1},
])
def test_a_hostile_listed_entry_is_refused(changes):
    with pytest.raises(agent.WorkerProtocolError):
        agent.check_listed_entry({**GOOD_ENTRY, **changes}, None)


def test_a_stat_must_describe_what_was_asked():
    assert agent.check_listed_entry(GOOD_ENTRY, "a.txt") == GOOD_ENTRY
    with pytest.raises(agent.WorkerProtocolError, match="not 'b.txt'"):
        agent.check_listed_entry(GOOD_ENTRY, "b.txt")
    root = {**GOOD_ENTRY, "name": ".", "type": "directory"}
    assert agent.check_listed_entry(root, ".") == root


@pytest.mark.parametrize("fields, with_fd", [
    ({"name": "../x", "type": "file", "mode": 0o644, "mtime": 0}, True),
    ({"name": "/abs", "type": "directory", "mode": 0o755, "mtime": 0}, False),
    ({"name": "a//b", "type": "directory", "mode": 0o755, "mtime": 0}, False),
    ({"name": "f", "type": "file", "mode": 0o644, "mtime": 0}, False),  # a file without its fd
    ({"name": "d", "type": "directory", "mode": 0o755, "mtime": 0}, True),  # an fd for a directory
    ({"name": "l", "type": "symlink", "mode": 0o777, "mtime": 0}, False),  # a link without a target
    ({"name": "p", "type": "fifo", "mode": 0o644, "mtime": 0}, False),
    ({"name": "x\udfff", "type": "directory", "mode": 0o755, "mtime": 0}, False),
])
def test_a_hostile_walk_entry_is_refused(fields, with_fd):
    with pytest.raises(agent.WorkerProtocolError):
        agent.check_walk_entry(fields, with_fd)


class ListedWalk(agent.Walk):
    """A walk given as a list: what a hostile worker could make the agent see."""

    def __init__(self, entries):
        self.entries = entries

    def __iter__(self):
        return iter(self.entries)


def entry(name, kind, mode=0o644, target=None):
    return agent.WalkEntry(name, kind, mode, 0, target)


def test_walked_entries_become_a_tar_without_setuid_bits_or_escaping_links(tmp_path):
    data = tmp_path / "data"
    data.write_bytes(b"payload")
    data.chmod(0o6755)
    walk = ListedWalk([(entry("d", "directory", 0o7777), None),
                       (entry("d/f", "file", 0o7777), os.open(data, os.O_RDONLY)),
                       (entry("d/in", "symlink", target="f"), None),
                       (entry("d/out", "symlink", target="../../etc"), None)])
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        assert agent.write_walked_entries(archive, walk) == 1  # the escaping link left out
    with tarfile.open(fileobj=io.BytesIO(buffer.getvalue())) as archive:
        members = {m.name: m for m in archive.getmembers()}
        assert sorted(members) == ["d", "d/f", "d/in"]
        assert members["d"].mode == 0o777 and members["d/f"].mode == 0o755
        assert archive.extractfile("d/f").read() == b"payload"


@pytest.mark.parametrize("entries", [
    [("d", "file"), ("d/x", "file")],  # below a file
    [("l", "symlink"), ("l/x", "directory")],  # below a symlink
    [("x/y", "directory")],  # before its parent
    [("a", "directory"), ("a", "directory")],  # twice
])
def test_a_hostile_walk_shape_is_refused(tmp_path, entries):
    source = tmp_path / "f"
    source.write_bytes(b"x")
    walk = ListedWalk([(entry(name, kind, target="t" if kind == "symlink" else None),
                        os.open(source, os.O_RDONLY) if kind == "file" else None) for name, kind in entries])
    with tarfile.open(fileobj=io.BytesIO(), mode="w") as archive, pytest.raises(agent.WorkerProtocolError):
        agent.write_walked_entries(archive, walk)


def test_a_walked_file_that_is_not_a_regular_file_is_refused():
    read_end, write_end = os.pipe()
    try:
        walk = ListedWalk([(entry("f", "file"), read_end)])
        with tarfile.open(fileobj=io.BytesIO(), mode="w") as archive, pytest.raises(
                agent.WorkerProtocolError, match="not a regular file"):
            agent.write_walked_entries(archive, walk)
    finally:
        os.close(write_end)
    with pytest.raises(OSError):
        os.fstat(read_end)  # closed by the writer, as every fd a walk hands over


def send(sock, data: bytes, fds=()):
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    sock.sendmsg([data], ancillary)


def test_a_worker_stream_refuses_oversized_messages_and_extra_fds_and_closes_them(tmp_path):
    open_before = len(os.listdir("/proc/self/fd"))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stream = agent.WorkerStream(ours, "test")
    files = [os.open(tmp_path, os.O_RDONLY) for _ in range(2)]
    try:
        send(theirs, b'{"done": {}}', files)
        with pytest.raises(agent.WorkerProtocolError, match="too many file descriptors"):
            stream.receive(5)
        send(theirs, json.dumps({"done": {"x": "y" * agent.WORKER_PACKET_BYTES}}).encode())
        with pytest.raises(agent.WorkerProtocolError, match="too large"):
            stream.receive(5)
        send(theirs, json.dumps({"error": {"code": "invalid_request", "message": "refused: x"}}).encode())
        with pytest.raises(agent.RequestError, match="refused: x"):
            stream.receive(5)
        theirs.close()
        with pytest.raises(agent.CommandError, match="ended without an answer"):
            stream.receive(5)
    finally:
        stream.close()
        for fd in files:
            os.close(fd)
    assert len(os.listdir("/proc/self/fd")) == open_before  # nothing received is left open


def test_a_silent_worker_times_out_and_says_so():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    silences = []
    stream = agent.WorkerStream(ours, "test", lambda: silences.append(1))
    try:
        with pytest.raises(agent.CommandError, match="said nothing for 0.2 s"):
            stream.receive(0.2)
        assert silences == [1]
    finally:
        stream.close()
        theirs.close()
