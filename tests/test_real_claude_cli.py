"""The real Claude Code CLI (the pinned release scripts/setup.sh installs) in real claude-code
sessions of a real `reploy serve` with the model proxy: mounted read-only into the session
(--mount) and run as its agent command (--agent-command), it asks the fake Messages API of
tests/model_upstream.py over the agent's relay and serve's proxy, which reaches the fake over
TLS with a CA the test made. What the real CLI cannot be made to show (the 64 MiB cap's error
event, a workload dialling model.sock itself) stays with the fake CLI in
tests/test_serve_model_proxy.py.

Without the installed CLI these tests skip, saying why; under REPLOY_REQUIRE_DOCKER=1 (CI) they
fail, as a missing engine does."""

from __future__ import annotations

import os
import re
import socket
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from model_upstream import (
    FakeMessagesApi, error_answer, message_closing, message_opening, pieces_answer,
    text_delta,
)
from serve_harness import (  # noqa: F401  (fixtures)
    Api, ServeProcess, managed_workload, serve_factory, wait_until,
)
from test_serve_model_proxy import (  # noqa: F401  (fixtures)
    CREDENTIAL, SEARCH, assert_credential_beyond_the_session, held_answer_streams, model_api,
    model_session, run,
)

import agent as agent_role
import reploy_serve as rs

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parent.parent
CLI_VERSION = (ROOT / "scripts/claude-code.version").read_text().strip()
#: Where scripts/setup.sh installs it (its CLAUDE_CODE_DIR).
CLI_DIR = (Path(os.environ.get("REPLOY_CACHE_DIR")
                or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "reploy")
           / f"claude-code-{CLI_VERSION}")
CLI_MOUNT = "/opt/claude-code"
#: The agent's own default command line, with the mounted CLI for `claude`.
CLI_COMMAND = [f"{CLI_MOUNT}/bin/claude", *agent_role.DEFAULT_AGENT_ARGV[1:]]
FAILED_TURN = b"[reploy: the agent command exited with status 1]"


@pytest.fixture
def cli_serve(serve_factory: Callable[..., ServeProcess], tmp_path: Path
              ) -> Callable[[str, Path], tuple[ServeProcess, Api, str]]:
    """model_session's serve, running the installed real CLI in its claude-code sessions."""
    if not (CLI_DIR / "bin/claude").is_file():
        problem = f"the Claude Code CLI {CLI_VERSION} is not installed in {CLI_DIR} (scripts/setup.sh)"
        if os.environ.get("REPLOY_REQUIRE_DOCKER") == "1":
            pytest.fail(f"REPLOY_REQUIRE_DOCKER=1 but {problem}")
        pytest.skip(problem)

    def start(url: str, ca: Path) -> tuple[ServeProcess, Api, str]:
        return model_session(serve_factory, tmp_path, url, ca, "--mount", f"{CLI_DIR}:{CLI_MOUNT}",
                             "--agent-command", rs.json.dumps(CLI_COMMAND))
    return start


def test_the_real_cli_streams_an_answer_and_never_holds_the_credential(
        cli_serve: Callable[[str, Path], tuple[ServeProcess, Api, str]], model_api: FakeMessagesApi,
        docker_engine: Any) -> None:
    server, api, sid = cli_serve(model_api.url, model_api.ca)
    log, headers = held_answer_streams(model_api, api, sid, "say hello", timeout_s=120)
    assert headers["user-agent"].startswith(f"claude-cli/{CLI_VERSION} ")  # the real one asked
    assert "authorization" not in headers and rs.MODEL_PLACEHOLDER not in rs.json.dumps(headers)

    # The credential echoed back, split across two reads of the proxy: redacted in the log.
    second = threading.Event()
    event = text_delta("token=" + CREDENTIAL + " end")
    cut = event.index(CREDENTIAL.encode()) + len(CREDENTIAL) // 2
    model_api.plan = pieces_answer([(message_opening() + text_delta("echo:") + event[:cut], None),
                                    (event[cut:] + message_closing(), second)])
    try:
        api.call("POST", f"/sessions/{sid}/message", {"text": "echo it"})
        api.wait_output(sid, b"echo:", timeout_s=120)
        second.set()
        log = api.wait_output(sid, b"token=[REDACTED] end")
    finally:
        second.set()

    # An error answer is an error result of the CLI (is_error true), and a failed turn.
    model_api.plan = error_answer(400, "invalid_request_error", "the fake refuses this prompt")
    api.call("POST", f"/sessions/{sid}/message", {"text": "refused"})
    log = api.wait_output(sid, FAILED_TURN, timeout_s=120)
    assert len(model_api.requests) == 3

    # Nothing the runtime user can read holds the credential: every process's environ and
    # cmdline, HOME (where the CLI keeps its transcripts), /tmp, the whole file tree; nor the
    # session disk (the output log, the events, the checkpoint archive) or serve's state.
    needle = CREDENTIAL.encode()
    assert needle not in log
    assert run(api, sid, "sh", "-c", "test -s $HOME/.claude.json && ls $HOME/.claude")["exitCode"] == 0
    searched = run(api, sid, "python3", "-c", SEARCH, needle.hex())
    assert searched["exitCode"] == 0 and searched["stdout"].strip() == "[]", searched
    assert_credential_beyond_the_session(docker_engine, server, sid, needle)


def test_the_real_cli_ends_its_turn_when_the_upstream_is_unreachable(
        cli_serve: Callable[[str, Path], tuple[ServeProcess, Api, str]], model_api: FakeMessagesApi,
        docker_engine: Any) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    server, api, sid = cli_serve(f"https://127.0.0.1:{port}", model_api.ca)
    api.call("POST", f"/sessions/{sid}/message", {"text": "say hello"})
    log = api.wait_output(sid, FAILED_TURN, timeout_s=180)
    assert b"API Error: 502 the model upstream cannot be reached" in log
    # The CLI retried as often as the session's environment bounds it, and no more.
    attempts = re.findall(rf"session {sid}: model upstream: ", server.stderr)
    assert len(attempts) == 1 + int(rs.MODEL_CLI_ENVIRONMENT["CLAUDE_CODE_MAX_RETRIES"])
