"""The sandboxed-agent driver: a small trusted controller for an agent that runs in the workload.

Runs in the controller container as `drive-agent` (python3 /opt/controller/drive_agent.py); the
session must grant the workload endpoint `agent` (--endpoint agent) and give an --output-dir.

1. In the workload's shell it copies the project to a writable place and starts
   `agent.py serve --workload agent --listen 0.0.0.0:7000`, the data-plane agent with the coding
   agent CLI (here a fake that speaks stream-json and calls no model).
2. From then on it talks to the agent only through the granted endpoint, with typed requests of
   agent.py's newline-JSON protocol (one request per connection): `message`, `status`,
   `interrupt`, `read`. Busy, queued and cancelled are answers, never guesses from the screen.
3. It keeps every request and response in transcript.jsonl, the agent's output log in
   agent-output.txt and a summary in report.json, stops the agent with Ctrl-C, ends the session
   and keeps the terminated result in terminated.json.

Everything the agent sends back is workload data: read with a bound, parsed as JSON, never
evaluated.
"""

import itertools
import json
import os
import socket
import sys
import time
from typing import Any

from reploy_driver import SessionDriver, SessionFailed

ENDPOINT_ID = "agent"
SESSION_DIR = "/tmp/agent-session"  # in the workload: agent/ holds the output log, outbox, control.sock
WORKSPACE = "/tmp/project"  # the project copy the agent may modify (the image is read-only)
AGENT_COMMAND = '["python3", "/opt/agent/fake_claude.py", "{continue}", "--", "{prompt}"]'
MAX_RESPONSE_BYTES = 2 * 1024 * 1024  #: a read answers at most 512 KiB of text, JSON-escaped
REQUEST_TIMEOUT_S = 10.0  #: the agent answers every request within 5 s
IDLE_DEADLINE_S = 30.0
WAIT_MS = 1000  #: long-poll for new output while waiting for the agent


class AgentClient:
    """agent.py's protocol over TCP: one request line, one response line, per connection."""

    def __init__(self, host: str, port: int) -> None:
        self.address = (host, port)
        self.transcript: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self._started = time.monotonic()

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """The response document ({"id", "result"} or {"id", "error"}), as sent by the agent."""
        request = {"id": str(next(self._ids)), "method": method, "params": params}
        with socket.create_connection(self.address, timeout=REQUEST_TIMEOUT_S) as sock:
            sock.sendall(json.dumps(request).encode() + b"\n")
            received = bytearray()
            while not received.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk
                if len(received) > MAX_RESPONSE_BYTES:
                    raise SessionFailed(f"{method}: the agent's response exceeds "
                                        f"{MAX_RESPONSE_BYTES} bytes")
        try:
            response = json.loads(received)
        except ValueError as e:
            raise SessionFailed(f"{method}: the agent's response is not JSON: {e}") from None
        if not isinstance(response, dict) or response.get("id") != request["id"]:
            raise SessionFailed(f"{method}: the agent answered another request: {response!r:.200}")
        self.transcript.append({"t_s": round(time.monotonic() - self._started, 3),
                                "request": request, "response": response})
        return response

    def result(self, method: str, **params: Any) -> dict[str, Any]:
        response = self.call(method, **params)
        if not isinstance(response.get("result"), dict):
            raise SessionFailed(f"{method} failed: {response.get('error')!r:.300}")
        return response["result"]

    def read_all(self) -> str:
        """The agent's whole output log so far (reads never consume)."""
        text, offset = "", 0
        while True:
            piece = self.result("read", offset=offset, max_bytes=512 * 1024)
            if piece["next_offset"] <= offset:  # `length` is the whole log's, not this piece's
                return text
            text += piece["text"]
            offset = piece["next_offset"]

    def wait_for_output(self, needle: str) -> None:
        """Long-polls the output log until it holds needle."""
        deadline = time.monotonic() + IDLE_DEADLINE_S
        text, offset = "", 0
        while needle not in text:
            if time.monotonic() > deadline:
                raise SessionFailed(f"the agent never printed {needle!r}")
            piece = self.result("read", offset=offset, wait_ms=WAIT_MS)
            text += piece["text"]
            offset = piece["next_offset"]

    def wait_idle(self) -> dict[str, Any]:
        """Asks `status` until the agent is idle, long-polling for output in between."""
        deadline = time.monotonic() + IDLE_DEADLINE_S
        while True:
            status = self.result("status")
            if status["turn_state"] == "idle":
                return status
            if time.monotonic() > deadline:
                raise SessionFailed(f"the agent is still busy: {status}")
            self.result("read", offset=status["log_bytes"], wait_ms=WAIT_MS)


def start_agent(session: SessionDriver) -> None:
    """Starts agent.py in the workload's shell, in the foreground, and waits until it listens."""
    status, _ = session.run(f"rm -rf {WORKSPACE} && cp -r /project {WORKSPACE}")
    if status != 0:
        raise SessionFailed(f"copying the project exited {status}")
    session.type(f"python3 /opt/agent/agent.py serve --session-dir {SESSION_DIR} --workload agent "
                 f"--agent-command '{AGENT_COMMAND}' --workspace {WORKSPACE} "
                 f"--listen 0.0.0.0:7000\n")
    # A hint only ("agent.py: serving" is not in the typed line); the first status is the proof.
    session.expect(rb"agent\.py: serving \S+ and tcp 0\.0\.0\.0:7000")


def drive(agent: AgentClient, report: dict[str, Any]) -> None:
    """The scripted conversation. Every fact in the report is an answer from the agent."""
    report["status_at_start"] = agent.result("status")
    report["first_message"] = agent.result("message", text="say Hello from inside the sandbox")
    agent.wait_idle()
    report["edit_message"] = agent.result("message", text="write NOTES.md the agent was here")
    agent.wait_idle()
    # A long run: while it is in progress, the next message is queued, not typed into anything.
    report["busy_message"] = agent.result("message", text="hang")
    agent.wait_for_output("working")
    report["queued_message"] = agent.result("message", text="say queued while the agent was busy")
    report["status_while_busy"] = agent.result("status")
    report["interrupt"] = agent.result("interrupt")  # the receipt: was a run in flight?
    report["status_at_end"] = agent.wait_idle()  # the queued message ran after the interrupt


def main() -> int:
    output_dir = os.environ.get("REPLOY_OUTPUT_DIR")
    if not output_dir:
        print("drive-agent: run the session with --output-dir", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"error": None}
    agent = None
    with SessionDriver(attach="pipe") as session:
        try:
            opened = session.start()
            endpoint = session.granted_endpoint(opened, ENDPOINT_ID)
            report["endpoint"] = endpoint
            start_agent(session)
            agent = AgentClient(endpoint["host"], endpoint["port"])
            drive(agent, report)
            report["agent_output"] = "agent-output.txt"
            agent_output = agent.read_all()
            # What the agent changed in the project, seen through the terminal, after it stopped.
            session.type(b"\x03")  # Ctrl-C: agent.py shuts down cleanly on SIGINT
            # The marker is printed by printf, so the echo of the typed line never holds it.
            status, output = session.run(f"printf '@@%s@@\\n' notes; cat {WORKSPACE}/NOTES.md")
            notes = output.partition(b"@@notes@@\r\n")[2]
            report["notes_md"] = notes.decode(errors="replace").strip() if status == 0 else None
        except (SessionFailed, OSError, KeyError, TypeError) as e:  # a malformed answer included
            report["error"] = f"{type(e).__name__}: {e}"
            agent_output = ""
            print(f"drive-agent: {report['error']}", file=sys.stderr)
            tail = session.transcript[-2000:].decode(errors="replace")
            print(f"drive-agent: the terminal's last bytes: {tail!r}", file=sys.stderr)
            if session.close_if_never_ready():
                return 1  # nothing to end: the session never started
        with open(os.path.join(output_dir, "transcript.jsonl"), "w") as f:
            for exchange in agent.transcript if agent else []:
                f.write(json.dumps(exchange) + "\n")
        with open(os.path.join(output_dir, "agent-output.txt"), "w") as f:
            f.write(agent_output)
        with open(os.path.join(output_dir, "report.json"), "w") as f:
            json.dump(report, f, indent=2)
        # Every artifact is final: end the session (the robust sequence: drain, complete,
        # terminated, acknowledge).
        try:
            if report["error"] is None:
                session.type("exit 0\n")
            else:
                session.send("terminate")
            outcome = session.finish()
        except SessionFailed as e:
            print(f"drive-agent: the session did not end cleanly: {e}", file=sys.stderr)
            return 1
    with open(os.path.join(output_dir, "terminated.json"), "w") as f:
        json.dump(outcome.terminated, f, indent=2)
    return 0 if outcome.client_exit == 0 and report["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
