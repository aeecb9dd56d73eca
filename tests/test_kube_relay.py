"""`agent.py relay`: the control socket's protocol over stdin and stdout (the Kubernetes agent channel's far end), with a
real agent and the relay as a real process on pipes."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from typing import Any, Iterator

import pytest

from agent_fixtures.harness import AGENT_PY, PYTHON, DEADLINE_S, agent, short_dir, start_agent  # noqa: F401


class Relay:
    """An `agent.py relay` child: request lines in, answer lines out, read with a deadline."""

    def __init__(self, session_dir) -> None:
        self.proc = subprocess.Popen([PYTHON, str(AGENT_PY), "relay", "--session-dir", str(session_dir)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._buffer = b""
        self._selector = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        self._selector.register(self.proc.stdout, selectors.EVENT_READ)

    def send(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line)
        self.proc.stdin.flush()

    def request(self, request_id: str, method: str, **params: Any) -> None:
        self.send(json.dumps({"id": request_id, "method": method, "params": params}).encode() + b"\n")

    def answer(self, timeout_s: float = DEADLINE_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "no answer line from the relay"
            if self._selector.select(remaining):
                chunk = os.read(self.proc.stdout.fileno(), 65536)  # type: ignore[union-attr]
                assert chunk, f"the relay ended: {self.proc.stderr.read()!r}"  # type: ignore[union-attr]
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        code = self.proc.wait(DEADLINE_S)
        self._selector.close()
        self.proc.stdout.close()  # type: ignore[union-attr]
        self.proc.stderr.close()  # type: ignore[union-attr]
        return code


@pytest.fixture
def shell(start_agent):
    return start_agent("--workload", "shell")


@pytest.fixture
def relay(shell) -> Iterator[Relay]:
    process = Relay(shell.session_dir)
    yield process
    if process.proc.poll() is None:
        process.proc.kill()
        process.proc.wait()


def test_answers_carry_their_request_ids(relay):
    relay.request("a", "status")
    relay.request("b", "write", data_b64="ZWNobyBoaQo=")
    answers = {a["id"]: a for a in (relay.answer(), relay.answer())}
    assert answers["a"]["result"]["type"] == "status" and answers["b"]["result"]["type"] == "write"


def test_a_long_poll_does_not_hold_the_calls_behind_it(relay, shell):
    for attempt in range(5):  # a read at the log's end waits, unless the shell prints meanwhile (its prompt)
        relay.request(f"poll{attempt}", "read", offset=shell.status()["log_bytes"], wait_ms=4000)
        relay.request(f"now{attempt}", "status")
        first, second = relay.answer(), relay.answer()
        if first["id"] == f"now{attempt}":
            assert "result" in first and second["id"] == f"poll{attempt}"
            return
        assert first["result"]["length"] > 0, "the read answered first without output: it was not long-polled"
    pytest.fail("the shell kept printing: no read waited")


def test_descriptor_verbs_and_kept_connections_are_refused(relay):
    relay.request("fd", "read_fd")
    answer = relay.answer()
    assert answer == {"id": "fd", "error": {"code": "invalid_request", "message":
                      "read_fd answers with a file descriptor, which cannot cross the relay's stream"}}
    relay.send(b'{"id":"k","method":"status","params":{},"keep":true}\n')
    assert relay.answer()["error"]["message"].startswith("keep: ")


def test_a_line_that_is_not_a_request_is_answered_and_the_next_one_served(relay):
    relay.send(b'{"id":"x","method":"nope"}\n')
    assert relay.answer() == {"id": "x", "error": {"code": "invalid_request", "message": "unknown method 'nope'"}}
    relay.send(b"not json\n")
    assert relay.answer()["id"] == ""
    relay.request("ok", "status")
    assert "result" in relay.answer()


def test_an_overlong_line_is_refused_and_skipped_whole(relay):
    relay.send(b"x" * (agent.MAX_REQUEST_BYTES + 10) + b"\n")
    assert relay.answer()["error"]["message"] == f"request line exceeds {agent.MAX_REQUEST_BYTES} bytes"
    relay.request("after", "status")
    assert relay.answer()["id"] == "after"


def test_stdin_end_waits_for_the_answers_in_flight(relay, shell):
    relay.request("poll", "read", offset=shell.status()["log_bytes"] + 10**6, wait_ms=1500)
    assert relay.proc.stdin is not None
    relay.proc.stdin.close()
    assert relay.answer()["id"] == "poll"
    assert relay.proc.wait(DEADLINE_S) == 0


def test_no_agent_is_server_unavailable(short_dir):
    (short_dir / "gone" / agent.AGENT_DIR_NAME).mkdir(parents=True)
    relay = Relay(short_dir / "gone")
    relay.request("a", "status")
    answer = relay.answer()
    assert answer["id"] == "a" and answer["error"]["code"] == "server_unavailable"
    assert relay.close() == 0


def test_the_in_flight_bound_holds_the_next_request_back(shell):
    """With room for one request, a status waits for the long-poll read before it; the read still answers."""
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    with open(stdin_r, "rb") as stdin, open(stdout_w, "wb") as stdout:
        relay = agent.StdioRelay(shell.session_dir, stdin, stdout, max_in_flight=1)
        offset = shell.status()["log_bytes"]
        requests = (json.dumps({"id": "poll", "method": "read", "params": {"offset": offset, "wait_ms": 1000}})
                    + "\n" + json.dumps({"id": "now", "method": "status", "params": {}}) + "\n").encode()
        os.write(stdin_w, requests)
        os.close(stdin_w)
        assert relay.run() == 0
    with open(stdout_r, "rb") as answers:
        ids = [json.loads(line)["id"] for line in answers.read().splitlines()]
    assert ids == ["poll", "now"]
