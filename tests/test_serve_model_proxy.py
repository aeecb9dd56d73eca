"""Model access for claude-code sessions through serve's credential proxy, in real sessions of a
real `reploy serve`: the fake CLI (tests/agent_fixtures/fake_claude.py, scenario `model`) makes a
real streaming request to ANTHROPIC_BASE_URL (127.0.0.1 in the session's own network namespace),
the agent relays it over DIR/agent/model.sock, serve forwards it over TLS to a fake Messages API
on the host's 127.0.0.1 with a CA the test made (tests/model_upstream.py)."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from model_upstream import FakeMessagesApi, big_answer, held_answer, pieces_answer, text_delta
from serve_harness import (  # noqa: F401  (fixtures)
    Api, ServeProcess, managed_workload, serve_factory, wait_until,
)

import reploy_serve as rs

pytestmark = pytest.mark.docker

CREDENTIAL = "sk-ant-api03-DOCKERTESTCREDENTIAL-0123456789abcdef"
#: Run as the runtime user in the session: every file it can read (and every process's environ
#: and cmdline it can read) searched for the credential; prints the paths that hold it.
SEARCH = r"""
import os, stat, sys
needle = bytes.fromhex(sys.argv[1])  # as hex: its own cmdline must not hold it
found = []
for root, dirs, files in os.walk("/"):
    if root in ("/sys", "/dev") or root.startswith("/proc/"):
        dirs[:] = []
    if root == "/proc":
        dirs[:] = [d for d in dirs if d.isdigit()]
        continue
    names = files if not root.startswith("/proc/") else ["environ", "cmdline"]
    for name in names:
        path = os.path.join(root, name)
        try:  # non-blocking, and regular files only: a FIFO would hold the search
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            continue
        with os.fdopen(fd, "rb") as f:
            if (stat.S_ISREG(os.fstat(fd).st_mode) or root.startswith("/proc/")) and needle in f.read(64 << 20):
                found.append(path)
print(repr(found))
"""


@pytest.fixture
def model_api(tmp_path: Path) -> Iterator[FakeMessagesApi]:
    (tmp_path / "tls").mkdir()
    with FakeMessagesApi(tmp_path / "tls") as api:
        yield api


def model_session(serve_factory: Callable[..., ServeProcess], tmp_path: Path, url: str,
                  ca: Path, *extra: str) -> tuple[ServeProcess, Api, str]:
    """A serve with the model proxy to url (trusting ca) and extra options, and a claude-code
    session of it."""
    credential = tmp_path / "model-credential"
    fd = os.open(credential, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, CREDENTIAL.encode() + b"\n")
    os.close(fd)
    server = serve_factory("--model-upstream", url, "--model-upstream-ca", str(ca),
                           "--model-credential-file", str(credential), *extra)
    return server, server.api, server.api.create("model", "claude-code")["id"]


def run(api: Api, sid: str, *argv: str) -> dict[str, Any]:
    return api.call("POST", f"/sessions/{sid}/exec", {"argv": list(argv)})


def files_holding(root: Path, needle: bytes) -> list[str]:
    """Host side: every file below root (a session's disk) holding needle."""
    found = []
    for directory, _, files in os.walk(root):
        for name in files:
            path = Path(directory) / name
            if not path.is_symlink() and path.is_file() and needle in path.read_bytes():
                found.append(str(path))
    return found


def held_answer_streams(model_api: FakeMessagesApi, api: Api, sid: str, prompt: str,
                        timeout_s: float = 60) -> tuple[bytes, dict[str, str]]:
    """A prompt whose answer the fake holds after its first delta: that delta reaches the log
    while the rest is held, then the whole answer does. The log, and the one request's headers
    (to the Messages API's own path, with the real credential in x-api-key)."""
    release, finished = threading.Event(), threading.Event()
    model_api.plan = held_answer("Hello from ", "the fake model", release, finished)
    try:
        api.call("POST", f"/sessions/{sid}/message", {"text": prompt})
        api.wait_output(sid, b"Hello from ", timeout_s=timeout_s)
        assert not finished.is_set()  # the first delta reached the log while the rest was held
        release.set()
        log = api.wait_output(sid, b"Hello from the fake model")
    finally:
        release.set()
    (path, headers), = model_api.requests
    assert path == "/v1/messages?beta=true" and headers["x-api-key"] == CREDENTIAL
    return log, headers


def assert_credential_beyond_the_session(docker_engine: Any, server: ServeProcess, sid: str,
                                         needle: bytes) -> None:
    """Host side, after what the runtime user could read was searched: the credential is in no
    container's configuration, and once snapshot not on the session's disk (its archive
    included), in serve's state or in serve's log."""
    containers = docker_engine.containers.list(filters={"label": f"{rs.LABEL_RUN}={sid}"})
    assert containers and all(CREDENTIAL not in json.dumps(c.attrs) for c in containers)
    server.api.call("POST", f"/sessions/{sid}/snapshot")
    wait_until(lambda: server.api.get(sid)["state"] == "snapshot", "the snapshot")
    session_disk = server.state_dir / "sessions" / sid
    assert list((session_disk / "agent").glob("checkpoint-*")), "the archive is on the session disk"
    assert files_holding(session_disk, needle) == []
    assert files_holding(server.state_dir, needle) == []
    assert CREDENTIAL not in server.stderr


def test_an_answer_streams_into_the_log_and_the_credential_stays_on_the_host(
        serve_factory: Callable[..., ServeProcess], model_api: FakeMessagesApi, tmp_path: Path,
        docker_engine: Any) -> None:
    server, api, sid = model_session(serve_factory, tmp_path, model_api.url, model_api.ca)
    log, headers = held_answer_streams(model_api, api, sid, "model hi")
    assert "authorization" not in headers and rs.MODEL_PLACEHOLDER not in json.dumps(headers)

    needle = CREDENTIAL.encode()
    searched = run(api, sid, "python3", "-c", SEARCH, CREDENTIAL.encode().hex())
    assert searched["exitCode"] == 0 and searched["stdout"].strip() == "[]", searched
    run(api, sid, "sh", "-c", f"echo {CREDENTIAL} > $HOME/planted")
    planted = run(api, sid, "python3", "-c", SEARCH, CREDENTIAL.encode().hex())
    assert "/planted" in planted["stdout"], planted  # the search finds what is there
    run(api, sid, "sh", "-c", "rm $HOME/planted")
    environment = run(api, sid, "env")["stdout"]
    assert f"ANTHROPIC_AUTH_TOKEN={rs.MODEL_PLACEHOLDER}" in environment and CREDENTIAL not in environment
    assert needle not in log
    assert_credential_beyond_the_session(docker_engine, server, sid, needle)


def test_hostile_answers_and_a_hostile_workload(
        serve_factory: Callable[..., ServeProcess], model_api: FakeMessagesApi, tmp_path: Path,
        docker_engine: Any) -> None:
    server, api, sid = model_session(serve_factory, tmp_path, model_api.url, model_api.ca)

    # A credential the upstream echoes, split across two reads: the second waits until the
    # log shows the delta before it, so the proxy held half the credential in between.
    half = len(CREDENTIAL) // 2
    second = threading.Event()
    opening = text_delta("echo:")
    event = text_delta("token=" + CREDENTIAL + " end")
    cut = event.index(CREDENTIAL.encode()) + half
    model_api.plan = pieces_answer([(opening + event[:cut], None), (event[cut:], second)])
    try:
        api.call("POST", f"/sessions/{sid}/message", {"text": "model echo"})
        api.wait_output(sid, b"echo:")
        second.set()
        log = api.wait_output(sid, b"token=[REDACTED] end")
    finally:
        second.set()
    assert CREDENTIAL.encode() not in log

    # An answer over the cap ends with an explicit error, which the CLI reports.
    model_api.plan = big_answer(rs.MAX_MODEL_RESPONSE_BYTES + 2_000_000)
    api.call("POST", f"/sessions/{sid}/message", {"text": "model big"})
    api.wait_output(sid, b"API Error: the model upstream's answer is over 67108864 bytes", timeout_s=120)

    # The workload reaches the proxy only through the relay, and only the Messages API there.
    probe = run(api, sid, "python3", "-c", (
        "import socket, errno\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n s.connect('/mnt/reploy-session/agent/model.sock'); print('connected')\n"
        "except OSError as e: print(errno.errorcode[e.errno])\n"
        "import http.client\n"
        f"c = http.client.HTTPConnection('127.0.0.1', {rs.MODEL_RELAY_PORT})\n"
        "c.request('GET', '/v1/models'); r = c.getresponse(); print(r.status, r.read().decode())\n"))
    lines = probe["stdout"].splitlines()
    assert lines[0] == "EACCES", probe
    assert lines[1].startswith("403 ") and "permission_error" in lines[1], probe
    assert len(model_api.requests) == 2


def test_an_unreachable_upstream_ends_the_turn_with_an_error(
        serve_factory: Callable[..., ServeProcess], model_api: FakeMessagesApi, tmp_path: Path,
        docker_engine: Any) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    _, api, sid = model_session(serve_factory, tmp_path, f"https://127.0.0.1:{port}", model_api.ca)
    api.call("POST", f"/sessions/{sid}/message", {"text": "model hi"})
    log = api.wait_output(sid, b"[reploy: the agent command exited with status 1]")
    assert b"API Error: 502 the model upstream cannot be reached" in log
