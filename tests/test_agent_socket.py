"""The control socket over real unix sockets: framing limits, error codes, ownership, the `call` CLI."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys

import pytest

from agent_fixtures.harness import (AGENT_PY, AS_ROOT, PYTHON, RUNTIME_USER, AgentProcess, agent,  # noqa: F401
                                    raw_exchange, short_dir, start_agent, wait_until)


@pytest.fixture
def shell(start_agent):
    return start_agent("--workload", "shell")


def response(data: bytes) -> dict:
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    return json.loads(data)


def test_socket_is_private_to_its_owner(shell):
    mode = os.lstat(shell.agent_dir / agent.SOCKET_NAME).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    directory = os.lstat(shell.agent_dir)
    assert stat.S_IMODE(directory.st_mode) == 0o700 and directory.st_uid == os.geteuid()


def test_one_request_one_response_per_connection(shell):
    reply = response(raw_exchange(shell.session_dir, b'{"id":"r1","method":"status","params":{}}\n'))
    assert reply["id"] == "r1" and reply["result"]["type"] == "status"


def test_a_kept_connection_serves_one_request_after_another(shell):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(shell.agent_dir / agent.SOCKET_NAME))
        answers = sock.makefile("rb")
        for number in range(3):
            sock.sendall(json.dumps({"id": f"k{number}", "method": "status", "params": {}, "keep": True}).encode()
                         + b"\n")
            reply = json.loads(answers.readline())
            assert reply["id"] == f"k{number}" and reply["result"]["type"] == "status"
        sock.sendall(b'{"id":"last","method":"status","params":{}}\n')  # without keep: the agent closes after it
        assert json.loads(answers.readline())["id"] == "last"
        assert answers.read() == b""


def test_a_request_pipelined_on_a_kept_connection_is_refused_and_closes_it(shell):
    line = b'{"id":"p","method":"status","params":{},"keep":true}\n'
    reply = response(raw_exchange(shell.session_dir, line + line))
    assert reply["error"]["code"] == "invalid_request" and "data follows the request line" in reply["error"]["message"]


def test_keep_must_be_a_boolean(shell):
    reply = response(raw_exchange(shell.session_dir, b'{"id":"b","method":"status","params":{},"keep":1}\n'))
    assert reply == {"id": "b", "error": {"code": "invalid_request", "message": "keep must be true or false"}}


def test_a_kept_connection_left_idle_is_closed_and_the_agent_serves_on(shell):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(agent.CLIENT_IDLE_TIMEOUT_S + 5)
        sock.connect(str(shell.agent_dir / agent.SOCKET_NAME))
        sock.sendall(b'{"id":"i","method":"status","params":{},"keep":true}\n')
        answers = sock.makefile("rb")
        assert json.loads(answers.readline())["id"] == "i"
        assert answers.read() == b""  # nothing more sent: closed by the agent at its idle bound, nothing said
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # a client that closes a kept one itself
        sock.settimeout(10)
        sock.connect(str(shell.agent_dir / agent.SOCKET_NAME))
        sock.sendall(b'{"id":"c","method":"status","params":{},"keep":true}\n')
        assert json.loads(sock.makefile("rb").readline())["id"] == "c"
    assert shell.status()["turn_state"] == "idle"


@pytest.mark.parametrize("payload, request_id, fragment", [
    (b"garbage\n", "", "not a JSON document"),
    (b'{"id":"m1","method":"nope","params":{}}\n', "m1", "unknown method 'nope'"),
    (b'{"id":"m2","method":"status","params":{}}\n{"id":"m3"}\n', "", "data follows the request line"),
    (b'{"id":"m4","method":"read","params":{"max_bytes":1}}\n', "m4", "max_bytes must be between"),
])
def test_malformed_requests_are_invalid_request_with_the_id_when_readable(shell, payload, request_id, fragment):
    reply = response(raw_exchange(shell.session_dir, payload))
    assert reply["id"] == request_id and reply["error"]["code"] == "invalid_request"
    assert fragment in reply["error"]["message"]


def test_a_request_without_a_newline_is_rejected(shell):
    reply = response(raw_exchange(shell.session_dir, b'{"id":"n","method":"status"}', shutdown_write=True))
    assert reply == {"id": "", "error": {"code": "invalid_request", "message": "request line must end with a newline"}}


def test_a_request_over_one_mebibyte_is_rejected(shell):
    text = "x" * agent.MAX_REQUEST_BYTES
    payload = json.dumps({"id": "big", "method": "message", "params": {"text": text}}).encode() + b"\n"
    reply = response(raw_exchange(shell.session_dir, payload))
    assert reply["error"]["code"] == "invalid_request" and f"exceeds {agent.MAX_REQUEST_BYTES} bytes" in reply["error"]["message"]
    assert shell.status()["queue_depth"] == 0


def test_a_silent_client_is_dropped(shell):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(agent.CLIENT_IDLE_TIMEOUT_S + 5)
        sock.connect(str(shell.agent_dir / agent.SOCKET_NAME))
        sock.sendall(b'{"id":"slow"')
        assert sock.recv(100) == b""  # closed by the agent, nothing said
    assert shell.status()["turn_state"] == "idle"  # and the agent still serves


def test_other_clients_are_served_while_one_long_polls(shell):
    length = shell.status()["log_bytes"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as waiting:
        waiting.connect(str(shell.agent_dir / agent.SOCKET_NAME))
        waiting.sendall(json.dumps({"id": "w", "method": "read",
                                    "params": {"offset": length, "wait_ms": 4000}}).encode() + b"\n")
        for _ in range(5):
            assert shell.status()["workload"] == "shell"
        shell.result("message", text="echo wake")
        waiting.settimeout(10)
        reply = json.loads(waiting.makefile("rb").readline())
    assert reply["id"] == "w" and reply["result"]["next_offset"] > length


def test_a_live_owner_makes_a_second_agent_refuse(shell, short_dir):
    second = AgentProcess(shell.session_dir, ["--workload", "shell"])
    try:
        assert second.proc.wait(15) == 1
    finally:
        second.cleanup()
    assert "another agent is serving" in second.stderr
    assert shell.status()["workload"] == "shell"  # the owner is untouched


def agent_dir_of(session):
    (session / agent.AGENT_DIR_NAME).mkdir(mode=0o700, parents=True)
    return session / agent.AGENT_DIR_NAME


def test_a_stale_socket_is_taken_over(start_agent, short_dir):
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(agent_dir_of(short_dir / "s") / agent.SOCKET_NAME))
    stale.close()  # the file stays, nobody listens
    shell = start_agent("--workload", "shell")
    assert shell.status()["workload"] == "shell"


def test_a_non_socket_file_at_the_path_is_never_deleted(start_agent, short_dir):
    path = agent_dir_of(short_dir / "s") / agent.SOCKET_NAME
    path.write_text("someone's file")
    process = start_agent("--workload", "shell", ready=False)
    assert process.proc.wait(15) == 1
    assert "exists and is not a socket" in process.stderr
    assert path.read_text() == "someone's file"


def test_shutdown_leaves_a_socket_that_is_not_ours(shell):
    path = shell.agent_dir / agent.SOCKET_NAME
    os.rename(path, shell.agent_dir / "moved.sock")
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        other.bind(str(path))
        assert shell.stop() == 0
        assert stat.S_ISSOCK(os.lstat(path).st_mode)  # still there: not the file the agent bound
    finally:
        other.close()


def run_call(session_dir, *args):
    return subprocess.run([sys.executable, str(AGENT_PY), "call", str(session_dir), *args],
                          capture_output=True, text=True, timeout=30)


def test_call_prints_one_json_document_and_exits_by_outcome(shell):
    ok = run_call(shell.session_dir, "status")
    assert ok.returncode == 0 and json.loads(ok.stdout)["result"]["type"] == "status" and ok.stdout.count("\n") == 1
    refused = run_call(shell.session_dir, "read", '{"max_bytes": 0}')
    assert refused.returncode == 1 and json.loads(refused.stdout)["error"]["code"] == "invalid_request"
    for usage in (["status", "not json"], ["status", "[1]"], ["bogus"]):
        bad = run_call(shell.session_dir, *usage)
        assert bad.returncode == 2 and bad.stdout == "" and bad.stderr


def test_call_without_an_agent_reports_server_unavailable(short_dir):
    result = run_call(short_dir, "status")
    assert result.returncode == 1
    assert json.loads(result.stdout)["error"]["code"] == "server_unavailable"


def serve_result(short_dir, *args):
    return subprocess.run([PYTHON, str(AGENT_PY), "serve", "--session-dir", str(short_dir / "s"), *args],
                          capture_output=True, text=True, timeout=30)


def test_serve_usage_errors_exit_2(short_dir):
    identity = ["--runtime-user", RUNTIME_USER] if AS_ROOT else []
    for args in (["--workload", "vm"], ["--workload", "agent", "--agent-command", '["claude"]'],
                 ["--workload", "shell", "--shell-log-cap-bytes", "10"],
                 ["--workload", "shell", "--workspace", str(short_dir)],
                 ["--workload", "shell", "--workspace", str(short_dir / "s" / agent.AGENT_DIR_NAME / "w")],
                 ["--workload", "shell", "--runtime-user", "1000"]):
        result = serve_result(short_dir, *identity, *args)
        assert result.returncode == 2 and result.stdout == "" and result.stderr, args
    assert not (short_dir / "s").exists()


def test_the_workload_never_runs_as_root(short_dir):
    for args, message in ((["--runtime-user", "0:0"], "may not run as root"),
                          ([], "needs --runtime-user" if AS_ROOT else None)):
        result = serve_result(short_dir, "--workload", "shell", *args)
        if message is None:  # not root: the agent's own identity is the workload's; nothing to refuse here
            continue
        assert result.returncode == 2 and result.stdout == "" and message in result.stderr, result.stderr
    assert not (short_dir / "s").exists()
