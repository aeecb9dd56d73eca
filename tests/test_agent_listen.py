"""`agent.py serve --listen HOST:PORT`: the same newline-JSON protocol over TCP, one request per connection.

The TCP listener is a second thin transport over the protocol core, so these tests check that it meets the same
framing limits, errors and verbs as the unix socket, and that it exists only when asked for. No Docker.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys

import pytest

from agent_fixtures.harness import (  # noqa: F401
    AGENT_PY, FAKE_AGENT_ARGV, agent, exchange_on, short_dir, start_agent)

SERVING_TCP_RE = re.compile(r"agent\.py: serving \S+ and tcp 127\.0\.0\.1:(\d+) ")


@pytest.fixture
def start_listening(start_agent):
    """start_listening(*args) -> (agent process, TCP port): an agent serving on 127.0.0.1 at a free port."""
    def start(*args):
        process = start_agent(*args, "--listen", "127.0.0.1:0")
        match = SERVING_TCP_RE.search(process.stderr)  # printed before the loop answers its first request
        assert match, process.stderr
        return process, int(match.group(1))
    return start


def tcp_exchange(port: int, payload: bytes, shutdown_write: bool = False) -> bytes:
    """Sends raw bytes to the TCP listener and returns everything received until the agent closes."""
    return exchange_on(socket.create_connection(("127.0.0.1", port), timeout=15), payload,
                       shutdown_write)


def tcp_call(port: int, method: str, **params) -> dict:
    reply = tcp_exchange(port, json.dumps({"id": method, "method": method, "params": params}).encode() + b"\n")
    assert reply.endswith(b"\n") and reply.count(b"\n") == 1, reply
    return json.loads(reply)


def test_status_over_tcp_is_the_unix_socket_status(start_listening):
    shell, port = start_listening("--workload", "shell")
    over_tcp = tcp_call(port, "status")
    over_unix = shell.call("status")
    assert over_tcp["id"] == "status" and over_tcp["result"]["type"] == "status"
    for key in ("workload", "pid", "running", "columns", "rows", "admission_open"):
        assert over_tcp["result"][key] == over_unix["result"][key], key


@pytest.mark.parametrize("payload, shutdown_write, request_id, fragment", [
    (b"garbage\n", False, "", "not a JSON document"),
    (b'{"id":"m1","method":"nope","params":{}}\n', False, "m1", "unknown method 'nope'"),
    (b'{"id":"m2","method":"status","params":{}}\n{"id":"m3"}\n', False, "", "data follows the request line"),
    (b'{"id":"n","method":"status"}', True, "", "request line must end with a newline"),
])
def test_tcp_framing_errors_are_the_unix_socket_errors(start_listening, payload, shutdown_write, request_id,
                                                       fragment):
    shell, port = start_listening("--workload", "shell")
    reply = json.loads(tcp_exchange(port, payload, shutdown_write))
    assert reply["id"] == request_id and reply["error"]["code"] == "invalid_request"
    assert fragment in reply["error"]["message"]


def test_tcp_request_over_one_mebibyte_is_rejected(start_listening):
    shell, port = start_listening("--workload", "shell")
    text = "x" * agent.MAX_REQUEST_BYTES
    payload = json.dumps({"id": "big", "method": "message", "params": {"text": text}}).encode() + b"\n"
    reply = json.loads(tcp_exchange(port, payload))
    assert reply["error"]["code"] == "invalid_request" and f"exceeds {agent.MAX_REQUEST_BYTES} bytes" in reply["error"]["message"]
    assert shell.status()["queue_depth"] == 0


def test_tcp_drives_the_agent_workload_queue_and_interrupt(start_listening):
    fake, port = start_listening("--workload", "agent", "--agent-command", FAKE_AGENT_ARGV)
    assert tcp_call(port, "message", text="hang")["result"]["delivery"] == "dispatched"
    fake.read_until(b"working")
    queued = tcp_call(port, "message", text="say after the interrupt")["result"]
    assert queued == {"type": "message", "delivery": "queued", "queue_depth": 1}
    status = tcp_call(port, "status")["result"]
    assert status["turn_state"] == "in_progress" and status["queue_depth"] == 1
    assert tcp_call(port, "interrupt")["result"] == {"type": "interrupt", "cancelled": True}
    text = fake.read_until(b"after the interrupt\n").decode()
    assert "working\n[reploy: interrupted]\n" in text
    fake.wait_status(lambda s: s["turn_state"] == "idle", "the queued run to finish")
    read = tcp_call(port, "read", offset=0)["result"]
    assert read["text"] == text and read["next_offset"] == len(text.encode())


def test_a_clean_shutdown_closes_the_tcp_listener(start_listening):
    shell, port = start_listening("--workload", "shell")
    assert shell.stop() == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=15).close()


def test_without_listen_the_agent_prints_no_tcp_address(start_agent):
    shell = start_agent("--workload", "shell")
    assert "agent.py: serving" in shell.stderr and " and tcp " not in shell.stderr


def test_a_taken_port_makes_serve_fail_and_free_the_unix_socket(start_listening, start_agent):
    first, port = start_listening("--workload", "shell")
    second = start_agent("--workload", "shell", "--listen", f"127.0.0.1:{port}", name="second", ready=False)
    assert second.proc.wait(15) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in second.stderr
    assert not (second.session_dir / agent.SOCKET_NAME).exists()
    assert tcp_call(port, "status")["result"]["workload"] == "shell"  # the first agent is untouched


@pytest.mark.parametrize("address", ["7000", "host:", ":7000", "127.0.0.1:65536", "127.0.0.1:-1", "h:x"])
def test_listen_usage_errors_exit_2(short_dir, address):
    result = subprocess.run([sys.executable, str(AGENT_PY), "serve", "--session-dir", str(short_dir / "s"),
                             "--workload", "shell", "--listen", address], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and result.stdout == "" and "--listen wants HOST:PORT" in result.stderr


def test_parse_listen_address_accepts_bracketed_ipv6():
    assert agent.parse_listen_address("[::1]:7000") == ("::1", 7000)
    assert agent.parse_listen_address("0.0.0.0:0") == ("0.0.0.0", 0)
    assert agent.format_listen_address("::1", 7000) == "[::1]:7000"


def test_descriptor_verbs_are_for_the_unix_socket_only(start_listening):
    """upload, download and read_fd answer with a file descriptor, which TCP cannot carry: refused there, nothing
    staged."""
    shell, port = start_listening("--workload", "shell")
    for method, params in (("upload", {"path": "f.txt", "size": 1}), ("download", {"path": ""}), ("read_fd", {})):
        error = tcp_call(port, method, **params)["error"]
        assert error["code"] == "invalid_request" and "only on the unix socket" in error["message"], error
    assert list((shell.session_dir / "workspace").iterdir()) == []
    assert shell.result("download", path="")["kind"] == "tar"  # the unix socket's client is served
