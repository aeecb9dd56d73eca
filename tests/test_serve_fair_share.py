"""Fair share among managed sessions: each session container's CPU bound and block-I/O weight,
the bounds on output stream readers (503 past them, the limit named), and a reader that cannot
keep up dropped while the others go on (a real serve, real sockets). Speed itself is measured by
bench/bench_serve.py, never asserted here."""

from __future__ import annotations

import base64
import http.client
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

import reploy_serve
from serve_harness import (  # noqa: F401  (fixtures)
    ROOT, Api, ServeProcess, in_thread, managed_workload, serve_factory, session_containers, wait_until,
)


def test_a_reader_past_either_bound_is_refused_with_the_limit_named() -> None:
    refusal = reploy_serve.reader_refusal
    assert refusal(1, 5, 2, 6) is None
    assert "--max-session-readers 2" in refusal(2, 2, 2, 6)
    assert "--max-readers 6" in refusal(1, 6, 2, 6)
    assert "--max-session-readers" in refusal(2, 6, 2, 6)  # the session's own bound first


@pytest.mark.parametrize("flag, value, says", [
    ("--session-cpus", "0", "--session-cpus: from 0.01"), ("--session-cpus", "1000", "--session-cpus: from"),
    ("--session-cpus", "nan", "--session-cpus: from"), ("--session-cpus", "one", "invalid float value"),
    ("--max-session-readers", "0", "--max-session-readers: at least 1"),
    ("--max-readers", "0", "--max-readers: at least 1"),
])
def test_bad_fair_share_flags_are_usage_errors(tmp_path: Path, flag: str, value: str, says: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "reploy.py"), "serve", "--state-dir", str(tmp_path / "s"),
                           "--workload-dir", str(tmp_path), flag, value], capture_output=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (2, b"") and says in proc.stderr.decode()
    assert not (tmp_path / "s").exists()


@pytest.mark.docker
def test_session_containers_carry_the_cpu_bound_and_the_blkio_weight(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    server = serve_factory("--session-cpus", "0.5")
    sid = server.api.create("bounded")["id"]
    [container] = session_containers(docker_engine, server.state_dir, sid)
    host = container.attrs["HostConfig"]
    assert host["NanoCpus"] == 500_000_000
    # Asked for always; an engine whose kernel cannot weigh block I/O discards it and says so.
    assert host["BlkioWeight"] == reploy_serve.SESSION_BLKIO_WEIGHT or (
        host["BlkioWeight"] == 0 and "Block I/O weight" in server.stderr), server.stderr
    default = serve_factory()
    sid = default.api.create("default")["id"]
    [container] = session_containers(docker_engine, default.state_dir, sid)
    assert container.attrs["HostConfig"]["NanoCpus"] == reploy_serve.DEFAULT_SESSION_CPUS * 1e9


def workspace_df_kib(api: Api, sid: str) -> int:
    """The size of the session's workspace file system as its workload's `df` shows it (KiB)."""
    done = api.call("POST", f"/sessions/{sid}/exec", {"argv": ["df", "-P", "-k", "."]})
    assert done["exitCode"] == 0, done
    return int(done["stdout"].splitlines()[1].split()[1])


@pytest.mark.docker
def test_a_session_has_its_own_cpus_and_disk_within_the_server_s_bounds(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    """Issue 28's provider config: create's `cpus` and `diskMib` reach the container's NanoCpus
    and the size of the session's disk; past the server's own bound they are 400; without them
    the server's apply."""
    server = serve_factory("--session-disk-mib", "256")
    api = server.api
    own = api.create("own", cpus=0.5, diskMib=96)
    assert (own["cpus"], own["diskMib"]) == (0.5, 96)
    [container] = session_containers(docker_engine, server.state_dir, own["id"])
    assert container.attrs["HostConfig"]["NanoCpus"] == 500_000_000
    assert (server.state_dir / "disks" / f"{own['id']}.img").stat().st_size == 96 << 20
    # ext4's own metadata and journal take a little of it; nothing near the server's 256 MiB.
    assert 80 << 10 < workspace_df_kib(api, own["id"]) <= 96 << 10
    assert api.get(own["id"])["diskMib"] == 96
    for body, says in (({"cpus": 1.5}, "cpus: must be at most 1, this server's bound (--session-cpus)"),
                       ({"diskMib": 257}, "diskMib: must be at most 256, this server's bound (--session-disk-mib)"),
                       ({"cpus": 0}, "cpus: must be at least 0.01"), ({"diskMib": 63}, "diskMib: must be from 64")):
        refused = api.call("POST", "/sessions", {"name": "too much", **body}, 400)
        assert says in refused["error"], refused
    default = api.create("default")
    assert (default["cpus"], default["diskMib"]) == (reploy_serve.DEFAULT_SESSION_CPUS, 256)
    [container] = session_containers(docker_engine, server.state_dir, default["id"])
    assert container.attrs["HostConfig"]["NanoCpus"] == reploy_serve.DEFAULT_SESSION_CPUS * 1e9
    assert (server.state_dir / "disks" / f"{default['id']}.img").stat().st_size == 256 << 20
    assert 220 << 10 < workspace_df_kib(api, default["id"]) <= 256 << 10
    assert {s["id"] for s in api.call("GET", "/sessions")["sessions"]} == {own["id"], default["id"]}


def open_stream(api: Api, sid: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection(api.host, api.port, timeout=60)
    conn.request("GET", f"/api/v1/sessions/{sid}/stream", headers=api.auth_headers)
    return conn, conn.getresponse()


def connected_stream(api: Api, sid: str) -> http.client.HTTPConnection:
    conn, response = open_stream(api, sid)
    assert response.status == 200 and response.readline() == b": connected\n"
    return conn


@pytest.mark.docker
def test_readers_past_the_bounds_answer_503_saying_which(serve_factory: Callable[..., ServeProcess],
                                                         docker_engine: Any) -> None:
    server = serve_factory("--max-session-readers", "2", "--max-readers", "3")
    api = server.api
    first, second = (api.create(name)["id"] for name in ("first", "second"))
    held = [connected_stream(api, first), connected_stream(api, first)]
    conn, refused = open_stream(api, first)
    assert refused.status == 503 and refused.getheader("Retry-After") == "5"
    assert "--max-session-readers 2" in json.loads(refused.read())["error"]
    conn.close()
    held.append(connected_stream(api, second))
    conn, refused = open_stream(api, second)
    assert refused.status == 503 and "--max-readers 3" in json.loads(refused.read())["error"]
    conn.close()
    held.pop(0).close()  # a reader that leaves gives its place back

    def admitted() -> Optional[http.client.HTTPConnection]:
        conn, response = open_stream(api, first)
        if response.status == 200:
            return conn
        conn.close()
        return None
    held.append(wait_until(admitted, "a place freed by a reader that left"))
    for conn in held:
        conn.close()


class StreamReader(threading.Thread):
    """Follows one session's stream from offset 0 and keeps the output bytes, until `needle` is
    in them; `in_order` stays true while each event starts where the last one ended."""

    def __init__(self, api: Api, sid: str) -> None:
        super().__init__(daemon=True)
        self.conn, self.response = open_stream(api, sid)
        assert self.response.status == 200
        self.output = bytearray()
        self.in_order = True
        self.needle = b""
        self.found = threading.Event()
        self.lock = threading.Lock()

    def wait_for(self, needle: bytes) -> None:
        with self.lock:
            self.needle = needle
            if needle in self.output:
                self.found.set()
        assert self.found.wait(60), f"{needle!r} never reached the reader that keeps up"
        self.found.clear()

    def run(self) -> None:
        try:
            for line in self.response:
                if line.startswith(b"data: "):
                    event = json.loads(line[6:])
                    chunk = base64.b64decode(event["payloadBase64"])
                    with self.lock:
                        self.in_order &= event["offset"] == len(self.output)
                        self.output += chunk
                        if self.needle and self.needle in self.output[-(len(chunk) + len(self.needle)):]:
                            self.found.set()
        except (http.client.HTTPException, OSError):
            pass  # close() cut the stream short

    def close(self) -> None:
        assert self.conn.sock is not None
        self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.join(60)
        self.conn.close()


@pytest.mark.docker
def test_a_reader_that_cannot_keep_up_is_dropped_while_the_others_go_on(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    server = serve_factory()
    api = server.api
    sid = api.create("flood")["id"]
    api.wait_output(sid, b"$ ")
    keeping_up = StreamReader(api, sid)
    keeping_up.start()
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    stalled.connect((api.host, api.port))
    headers = "".join(f"{name}: {value}\r\n" for name, value in api.auth_headers.items())
    stalled.sendall(f"GET /api/v1/sessions/{sid}/stream HTTP/1.1\r\nHost: {api.host}:{api.port}\r\n"
                    f"{headers}\r\n".encode())
    try:
        # Far more output than the stalled reader's buffers and serve's send buffer hold.
        api.write(sid, b"head -c 8000000 /dev/zero | tr '\\0' x; echo FLOOD-''DONE\r")
        keeping_up.wait_for(b"FLOOD-DONE")
        wait_until(lambda: "dropped a reader of session" in server.stderr, "the stalled reader dropped")
        stalled.settimeout(60)
        while stalled.recv(1 << 20):  # what the kernel held for it, then the end: serve closed it
            pass
        api.write(sid, b"echo AFTER-''DROP\r")
        keeping_up.wait_for(b"AFTER-DROP")
        assert keeping_up.in_order and api.read_all(sid).startswith(bytes(keeping_up.output))
    finally:
        stalled.close()
        keeping_up.close()


def following(api: Api) -> dict[str, int]:
    return api.call("GET", "/server")["outputFollowing"]


@pytest.mark.docker
def test_the_streams_and_waiting_reads_of_a_session_share_one_follower_and_one_agent_wait(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    """Issue 30: however many read a session's output, serve has one follower of it, whose one
    agent long-poll at a time is every reader's wake-up; each stream still gets every byte in
    order, and the follower stops once its last reader left."""
    server = serve_factory()
    api = server.api
    sid = api.create("fan-out")["id"]
    api.wait_output(sid, b"$ ")
    readers = [StreamReader(api, sid) for _ in range(reploy_serve.DEFAULT_MAX_SESSION_READERS)]
    for reader in readers:
        reader.start()
    try:
        for reader in readers:
            reader.wait_for(b"$ ")
        end = len(api.read_all(sid))
        waiting = [in_thread(lambda: api.call("POST", f"/sessions/{sid}/read",
                                              {"offset": end, "waitMs": 4000})) for _ in range(3)]
        for n in range(4):
            api.write(sid, f"echo MARK-''{n}\r".encode())
            for reader in readers:
                reader.wait_for(f"MARK-{n}".encode())
        for thread, answers in waiting:
            thread.join(60)
            [answer] = answers
            assert answer["nextOffset"] > end and base64.b64decode(answer["payloadBase64"])
        stats = following(api)
        assert stats["followers"] == 1 and stats["mostAgentWaitsAtOnce"] == 1, stats
        log = api.read_all(sid)
        for reader in readers:
            assert reader.in_order and log.startswith(bytes(reader.output))
    finally:
        for reader in readers:
            reader.close()
    wait_until(lambda: following(api)["followers"] == 0, "the follower to stop after its last reader")
    waits = following(api)["agentWaits"]
    api.write(sid, b"echo QUIET\r")
    api.wait_output(sid, b"QUIET")
    assert following(api)["agentWaits"] == waits  # no reader, no follower: nothing waits on the agent


@pytest.mark.docker
def test_streams_from_far_behind_the_follower_s_window_get_the_whole_log_in_order(
        serve_factory: Callable[..., ServeProcess], docker_engine: Any) -> None:
    """A log several times the follower's window: streams from 0 read it from the file
    themselves, then take from the window with the reader already live, and both keep every
    byte in order through more output."""
    server = serve_factory()
    api = server.api
    sid = api.create("far-behind")["id"]
    api.wait_output(sid, b"$ ")
    live = StreamReader(api, sid)
    live.start()
    try:
        flood = 3 * reploy_serve.FANOUT_WINDOW_BYTES
        api.write(sid, f"head -c {flood} /dev/zero | tr '\\0' y; echo FLOOD-''DONE\r".encode())
        live.wait_for(b"FLOOD-DONE")
        late = StreamReader(api, sid)
        late.start()
        try:
            late.wait_for(b"FLOOD-DONE")
            api.write(sid, b"echo AFTER-''CATCH-UP\r")
            for reader in (live, late):
                reader.wait_for(b"AFTER-CATCH-UP")
            log = api.read_all(sid)
            assert len(log) > flood
            for reader in (live, late):
                assert reader.in_order and log.startswith(bytes(reader.output))
        finally:
            late.close()
    finally:
        live.close()
