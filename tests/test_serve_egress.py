"""Egress for a session through serve's egress proxy, in real sessions of a real `reploy serve`:
the session's network stays `none`; its HTTP(S)_PROXY is 127.0.0.1:EGRESS_RELAY_PORT in its own
network namespace, which the agent relays over DIR/agent/egress.sock to serve on the host.

The listeners are the test's own, on the host's 127.0.0.2: a loopback address, which the proxy
reaches only because the entry is that exact IP literal (the same port listed by the name
`localhost` is refused), and one that is not in the session's NO_PROXY, so ordinary clients
(urllib) take the proxy to it as they would to any host."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from serve_harness import (  # noqa: F401  (fixtures)
    Api, ServeProcess, managed_workload, serve_factory, wait_until,
)

import reploy_serve as rs

pytestmark = pytest.mark.docker

#: Run in the session: one request through the proxy its environment names. `connect` tunnels
#: (CONNECT) and sends a request inside; `absolute` sends an absolute-form request; `urllib`
#: lets urllib pick the proxy from the environment, as any client would.
PROBE = r"""
import http.client, os, sys, urllib.parse, urllib.request, urllib.error
mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
proxy = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
if mode == "urllib":
    try:
        answer = urllib.request.urlopen(f"http://{host}:{port}/by-urllib", timeout=60)
        print(answer.status, answer.read().decode())
    except urllib.error.HTTPError as e:
        print(e.code, e.read().decode())
    sys.exit(0)
c = http.client.HTTPConnection(proxy.hostname, proxy.port, timeout=60)
if mode == "connect":
    c.set_tunnel(host, port)
    c.request("GET", "/tunnelled")
else:
    c.request("GET", f"http://{host}:{port}/absolute")
r = c.getresponse()
print(r.status, r.read().decode())
"""


class Listener:
    """An HTTP/1.1 responder of the test's own: answers each request `hello <path>` and keeps
    the request lines it saw."""

    def __init__(self, host: str) -> None:
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        self.requests: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(60)
                data = b""
                with_head = False
                while not with_head:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                    with_head = b"\r\n\r\n" in data
                line = data.split(b"\r\n", 1)[0].decode(errors="replace")
                self.requests.append(line)
                body = f"hello {line.split(' ')[1] if ' ' in line else '?'}".encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                             % len(body) + body)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def listen_host(docker_engine: Any) -> str:
    """Where the test's listeners are: the host's loopback, but not the 127.0.0.1 of NO_PROXY."""
    return "127.0.0.2"


@pytest.fixture
def listeners(listen_host: str) -> Iterator[tuple[Listener, Listener]]:
    listed, unlisted = Listener(listen_host), Listener(listen_host)
    yield listed, unlisted
    listed.close()
    unlisted.close()


def run(api: Api, sid: str, *argv: str) -> dict[str, Any]:
    return api.call("POST", f"/sessions/{sid}/exec", {"argv": list(argv)})


def probe(api: Api, sid: str, mode: str, host: str, port: int) -> str:
    result = run(api, sid, "python3", "-c", PROBE, mode, host, str(port))
    assert result["exitCode"] == 0, result
    return str(result["stdout"]).strip()


def egress_events(server: ServeProcess, sid: str) -> list[dict[str, Any]]:
    outbox = server.state_dir / "sessions" / sid / "agent" / "events.jsonl"
    return [event for line in outbox.read_text().splitlines()
            if (event := json.loads(line))["type"] == "egress"]


def test_a_session_reaches_only_its_listed_hosts_and_each_decision_is_an_event(
        serve_factory: Callable[..., ServeProcess], listen_host: str,
        listeners: tuple[Listener, Listener]) -> None:
    listed, unlisted = listeners
    server = serve_factory("--egress-allow", f"{listen_host}:{listed.port}",
                           "--egress-allow", f"{listen_host}:{unlisted.port}",
                           "--egress-allow", f"localhost:{listed.port}")
    api = server.api
    assert api.call("GET", "/server")["egressAllow"] == [
        f"{listen_host}:{listed.port}", f"{listen_host}:{unlisted.port}", f"localhost:{listed.port}"]
    status, answer = api.raw("POST", "/api/v1/sessions", json.dumps(
        {"name": "e", "egress": ["elsewhere.example"]}).encode())
    assert status == 400 and b"not on this server's --egress-allow list" in answer
    created = api.create("egress", egress=[f"{listen_host}:{listed.port}", f"localhost:{listed.port}"])
    sid = created["id"]
    assert created["egress"] == [f"{listen_host}:{listed.port}", f"localhost:{listed.port}"]
    assert api.get(sid)["egress"] == created["egress"]

    environment = run(api, sid, "env")["stdout"]
    assert f"HTTPS_PROXY=http://127.0.0.1:{rs.EGRESS_RELAY_PORT}" in environment
    assert f"http_proxy=http://127.0.0.1:{rs.EGRESS_RELAY_PORT}" in environment

    # Allowed: the exact IP literal, private as it is, by CONNECT, absolute form and urllib.
    assert probe(api, sid, "connect", listen_host, listed.port) == "200 hello /tunnelled"
    assert probe(api, sid, "absolute", listen_host, listed.port) == "200 hello /absolute"
    assert probe(api, sid, "urllib", listen_host, listed.port) == "200 hello /by-urllib"
    wget = run(api, sid, "busybox", "wget", "-q", "-O", "-", f"http://{listen_host}:{listed.port}/by-wget")
    assert (wget["exitCode"], wget["stdout"]) == (0, "hello /by-wget"), wget
    assert listed.requests == ["GET /tunnelled HTTP/1.1", "GET /absolute HTTP/1.1",
                               "GET /by-urllib HTTP/1.1", "GET /by-wget HTTP/1.1"]

    # Refused: a host the server allows but this session did not list, and a listed name
    # that resolves to loopback. Neither listener saw a connection.
    refused = probe(api, sid, "absolute", listen_host, unlisted.port)
    assert refused.startswith("403 ") and "is not on this session's egress list" in refused
    by_name = probe(api, sid, "absolute", "localhost", listed.port)
    assert by_name.startswith("403 ") and "resolves to" in by_name and "a loopback address" in by_name
    assert unlisted.requests == [] and len(listed.requests) == 4

    # The workload cannot reach the proxy's socket but through the relay.
    direct = run(api, sid, "python3", "-c", (
        "import socket, errno\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n s.connect('/mnt/reploy-session/agent/egress.sock'); print('connected')\n"
        "except OSError as e: print(errno.errorcode[e.errno])\n"))
    assert direct["stdout"].strip() == "EACCES", direct

    events = wait_until(lambda: (lambda found: found if len(found) >= 6 else None)(
        egress_events(server, sid)), "six egress events in the outbox")
    allowed = [e for e in events if e["decision"] == "allowed"]
    assert len(allowed) == 4 and all(e["host"] == listen_host and e["port"] == listed.port
                                     and e["bytes_up"] > 0 and e["bytes_down"] > 0 for e in allowed)
    assert [(e["host"], e["reason"]) for e in events if e["decision"] == "refused"] == [
        (listen_host, f"{listen_host}:{unlisted.port} is not on this session's egress list"),
        ("localhost", "localhost resolves to 127.0.0.1, a loopback address; list that address "
                      "itself to allow it")]


def test_a_listed_host_that_never_answers_is_a_504_after_the_connect_bound(
        serve_factory: Callable[..., ServeProcess], listen_host: str) -> None:
    """serve's own bound, in a real session: the listener's accept backlog is full (one
    connection never accepted), so the kernel drops the proxy's SYN and its connect waits."""
    with socket.create_server((listen_host, 0), backlog=0) as full:
        port = full.getsockname()[1]
        with socket.create_connection((listen_host, port), timeout=60):
            server = serve_factory("--egress-allow", f"{listen_host}:{port}")
            sid = server.api.create("silent", egress=[f"{listen_host}:{port}"])["id"]
            answer = probe(server.api, sid, "absolute", listen_host, port)
    reason = (f"{listen_host}:{port} cannot be reached: {listen_host} did not answer in "
              f"{rs.EGRESS_CONNECT_TIMEOUT_S:.3g} s")
    assert answer == f"504 reploy egress proxy: {reason}"
    events = wait_until(lambda: egress_events(server, sid) or None, "the egress event")
    assert [(e["decision"], e["host"], e["port"], e["reason"]) for e in events] == [
        ("refused", listen_host, port, reason)]


def test_a_session_without_egress_has_no_proxy(
        serve_factory: Callable[..., ServeProcess], listen_host: str,
        listeners: tuple[Listener, Listener], tmp_path: Path) -> None:
    listed, _ = listeners
    server = serve_factory("--egress-allow", f"{listen_host}:{listed.port}")
    sid = server.api.create("plain")["id"]
    assert server.api.get(sid)["egress"] == []
    environment = run(server.api, sid, "env")["stdout"]
    assert "PROXY" not in environment.upper()
    reach = run(server.api, sid, "python3", "-c", (
        "import socket\n"
        f"s = socket.socket()\ns.settimeout(5)\n"
        f"try:\n s.connect(('127.0.0.1', {rs.EGRESS_RELAY_PORT})); print('connected')\n"
        "except OSError as e: print(type(e).__name__)\n"))
    assert reach["stdout"].strip() == "ConnectionRefusedError", reach
    assert not (server.state_dir / "sessions" / sid / "agent" / "egress.sock").exists()
    assert listed.requests == []


def test_egress_survives_a_snapshot_and_a_restart_of_serve(
        serve_factory: Callable[..., ServeProcess], listen_host: str,
        listeners: tuple[Listener, Listener]) -> None:
    """The list is the session's record's: a restored session, and a session of a new serve
    over the same state dir, get their proxy back; a snapshot has none listening; a serve whose
    --egress-allow dropped the entry refuses it."""
    listed, _ = listeners
    allow = ("--egress-allow", f"{listen_host}:{listed.port}")
    server = serve_factory(*allow)
    api = server.api
    sid = api.create("kept", egress=[f"{listen_host}:{listed.port}"])["id"]
    socket_path = server.state_dir / "sessions" / sid / "agent" / "egress.sock"
    api.call("POST", f"/sessions/{sid}/snapshot")
    wait_until(lambda: api.get(sid)["state"] == "snapshot", "the snapshot")
    assert not socket_path.exists() or not _listening(socket_path)
    assert api.call("POST", f"/sessions/{sid}/switch", {})["state"] == "active"
    assert probe(api, sid, "absolute", listen_host, listed.port) == "200 hello /absolute"
    server.stop()
    again = serve_factory(*allow, state_dir=server.state_dir)
    assert again.api.get(sid)["egress"] == [f"{listen_host}:{listed.port}"]
    assert probe(again.api, sid, "connect", listen_host, listed.port) == "200 hello /tunnelled"
    again.stop()
    # A serve whose list no longer holds the entry: the session keeps it on record, and is refused.
    narrower = serve_factory(state_dir=server.state_dir)
    refused = probe(narrower.api, sid, "absolute", listen_host, listed.port)
    assert refused.startswith("403 ") and "is not on this session's egress list" in refused
    assert listed.requests == ["GET /absolute HTTP/1.1", "GET /tunnelled HTTP/1.1"]


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


#: Run in the session: COUNT connections to the session's proxy, each a CONNECT whose target is
#: 15 KiB (no space: the reason quotes it) with terminal escapes, carriage returns and line
#: feeds of forged log lines in it (refused 400), each answer read to its end; prints how many
#: were refused.
REFUSAL_FLOOD = r"""
import os, socket, sys, urllib.parse
proxy = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
target = ("a\x1b[2K\rreploy:serve:forged\n" * 600)[:15 * 1024]
refused = 0
for _ in range(int(sys.argv[1])):
    with socket.create_connection((proxy.hostname, proxy.port), timeout=60) as s:
        s.sendall(f"CONNECT {target}:443 HTTP/1.1\r\n\r\n".encode())
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        refused += answer.startswith(b"HTTP/1.1 400 ")
print(refused)
"""
FLOOD_REFUSALS = 300


def test_a_flood_of_refusals_grows_serves_log_and_the_outbox_by_a_bound(
        serve_factory: Callable[..., ServeProcess], listen_host: str,
        listeners: tuple[Listener, Listener]) -> None:
    """Issue 42: 300 refused CONNECTs with 15 KiB targets, from a real session through its relay.
    serve logged each whole (about 4.5 MB here) and the outbox got an event each; now a
    session's refusals make at most LINES_PER_WINDOW + 1 lines (and events) a window, each cut,
    and nothing it sent reaches the log raw."""
    listed, _ = listeners
    server = serve_factory("--egress-allow", f"{listen_host}:{listed.port}")
    sid = server.api.create("flood", egress=[f"{listen_host}:{listed.port}"])["id"]
    log_before = server.stderr_path.stat().st_size
    result = run(server.api, sid, "python3", "-c", REFUSAL_FLOOD, str(FLOOD_REFUSALS))
    assert (result["exitCode"], result["stdout"].strip()) == (0, str(FLOOD_REFUSALS)), result
    with server.stderr_path.open("rb") as log:
        log.seek(log_before)
        grown = log.read()
    # Two windows at most (the flood may straddle a window's end), each its share and a summary.
    most_lines = 2 * (rs.LINES_PER_WINDOW + 1)
    assert len(grown) <= most_lines * (rs.MAX_LOGGED_CHARS + 200), len(grown)
    assert b"\x1b" not in grown and b"\r" not in grown
    assert all(line.startswith(b"reploy: ") for line in grown.splitlines())
    events = egress_events(server, sid)
    assert 0 < len(events) <= most_lines and all(e["decision"] == "refused" for e in events)


def test_refusals_never_take_the_disks_reserve(
        serve_factory: Callable[..., ServeProcess], listen_host: str,
        listeners: tuple[Listener, Listener]) -> None:
    """Issue 42: once the workload has filled its disk, what is left is the part ext4 keeps
    for root, for the agent's own log and outbox. Refused connections are the workload's doing:
    their events are written only outside that reserve (they took 3.5 of 4.7 MiB in 15 s)."""
    listed, _ = listeners
    server = serve_factory("--egress-allow", f"{listen_host}:{listed.port}", "--session-disk-mib", "64")
    sid = server.api.create("full", egress=[f"{listen_host}:{listed.port}"])["id"]
    filled = run(server.api, sid, "sh", "-c", "dd if=/dev/zero of=fill bs=1M; dd if=/dev/zero of=rest bs=1k")
    assert filled["exitCode"] == 1 and "No space left on device" in filled["stderr"], filled
    assert os.statvfs(server.state_dir / "sessions" / sid).f_bavail == 0
    outbox = server.state_dir / "sessions" / sid / "agent" / "events.jsonl"
    size_before = outbox.stat().st_size
    result = run(server.api, sid, "python3", "-c", REFUSAL_FLOOD, "20")
    assert (result["exitCode"], result["stdout"].strip()) == (0, "20"), result
    assert outbox.stat().st_size == size_before and egress_events(server, sid) == []
