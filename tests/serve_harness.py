"""Runs real `reploy.py serve` processes for the managed-session tests, and talks to them.

Every client here authenticates as the server's user: `Api` sends the token of the server's
start line as `Authorization: Bearer`, `ServeProcess.client_env()` gives the `reploy session`
CLI $REPLOY_TOKEN, and a browser logs in through `login_url`. Tests that attack the server
pass `auth=False` and their own headers.

Synchronisation is by real conditions with deadlines (`wait_until`), never by sleeping.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest

from agent_fixtures import harness as agent_harness
from cdp import Browser, find_chromium
from conftest import SERVE_STATE_DIR_PREFIX, remove_session_disks

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "agent_fixtures"
#: The fake Claude CLI (tests/agent_fixtures/fake_claude.py), mounted read-only at /opt/fake.
FAKE_AGENT_COMMAND = json.dumps(["python3", "/opt/fake/fake_claude.py", "{continue}", "{model}",
                                 "--", "{prompt}"])
DEADLINE_S = 30.0
LABEL_STATE_DIR = "io.reploy.serve.state-dir"


def seconds(stamp: str) -> float:
    """A Session's date-time (RFC 3339, UTC, `Z`) as a Unix time."""
    import datetime

    assert stamp.endswith("Z"), stamp
    return datetime.datetime.fromisoformat(stamp[:-1] + "+00:00").timestamp()


def wait_until(condition: Callable[[], Any], what: str, timeout_s: float = DEADLINE_S) -> Any:
    """agent_fixtures.harness.wait_until, with the longer deadline containers need."""
    return agent_harness.wait_until(condition, what, timeout_s)


class Api:
    """A minimal JSON client of one serve's /api/v1, authenticated with its token."""

    def __init__(self, url: str, token: str) -> None:
        parsed = urllib.parse.urlsplit(url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.url = url
        self.auth_headers = {"Authorization": f"Bearer {token}"}

    def request(self, method: str, path: str, body: Optional[bytes] = None,
                headers: Optional[dict[str, str]] = None, auth: bool = True,
                timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
        """One request: (status, headers with lowercase names, body). A body is sent as JSON
        unless `headers` say otherwise; `auth=False` sends no credentials of ours."""
        sent = {**(self.auth_headers if auth else {}),
                **({"Content-Type": "application/json"} if body is not None else {}),
                **(headers or {})}
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=sent)
            response = conn.getresponse()
            return (response.status, {k.lower(): v for k, v in response.getheaders()},
                    response.read())
        finally:
            conn.close()

    def raw(self, method: str, path: str, body: Optional[bytes] = None,
            headers: Optional[dict[str, str]] = None, timeout: float = 60) -> tuple[int, bytes]:
        status, _, data = self.request(method, path, body, headers, timeout=timeout)
        return status, data

    def call(self, method: str, path: str, body: Any = None, expect: int = 200) -> Any:
        """One JSON call that must answer `expect`: its document (None for an empty body)."""
        data = None if body is None else json.dumps(body).encode()
        status, raw = self.raw(method, "/api/v1" + path, data)
        document = json.loads(raw) if raw else None
        assert status == expect, f"{method} {path}: {status} {document}"
        return document

    def create(self, name: str = "t", workload_type: Optional[str] = None, **extra: Any) -> dict[str, Any]:
        """A session; without a workload type, seed 002's default (shell)."""
        body = {"name": name, **({"workloadType": workload_type} if workload_type else {}), **extra}
        return self.call("POST", "/sessions", body, 201)

    def get(self, sid: str) -> dict[str, Any]:
        return self.call("GET", f"/sessions/{sid}")

    def read_all(self, sid: str, offset: int = 0) -> bytes:
        """The output from `offset` to its end as one read answers it: the exact bytes (ours,
        payloadBase64), up to the cursor the answer gives."""
        import base64

        return base64.b64decode(self.call("POST", f"/sessions/{sid}/read", {"offset": offset})["payloadBase64"])

    def wait_output(self, sid: str, needle: bytes, timeout_s: float = DEADLINE_S) -> bytes:
        return wait_until(lambda: (lambda out: out if needle in out else None)(self.read_all(sid)),
                          f"{needle!r} in session {sid}'s output", timeout_s)

    def shell_ran(self, name: str, command: str, until: bytes) -> tuple[str, bytes]:
        """A new shell session that ran `command`: its id and its output up to `until`."""
        sid = self.create(name)["id"]
        self.wait_output(sid, b"$ ")
        self.call("POST", f"/sessions/{sid}/message", {"text": command})
        return sid, self.wait_output(sid, until)

    def write(self, sid: str, data: bytes) -> None:
        """Seed 002's write: the payload is text (UTF-8)."""
        self.call("POST", f"/sessions/{sid}/write", {"payload": data.decode()})

    def delete_all(self) -> None:
        for session in self.call("GET", "/sessions")["sessions"]:
            self.call("DELETE", f"/sessions/{session['id']}", expect=204)


class ServeProcess:
    """One `python3 reploy.py serve` child on a loopback port. reploy.py hands `serve` over to
    reploy_serve.py by executing it in the same process: the start line's pid shows it."""

    def __init__(self, state_dir: Path, workload_dir: Path, *extra: str,
                 env: Optional[dict[str, str]] = None) -> None:
        self.state_dir = state_dir
        self.stderr_path = state_dir.parent / f"serve-{os.getpid()}-{time.monotonic_ns()}.stderr"
        # Options given once only: the test's own, or these defaults.
        listen = () if "--listen" in extra else ("--listen", "127.0.0.1:0")
        agent = () if "--agent-command" in extra else ("--agent-command", FAKE_AGENT_COMMAND)
        self.args = [sys.executable, str(ROOT / "reploy.py"), "serve", *listen,
                     "--state-dir", str(state_dir), "--workload-dir", str(workload_dir),
                     "--mount", f"{FIXTURES}:/opt/fake", *agent, *extra]
        with open(self.stderr_path, "ab") as stderr:
            self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=stderr, env={**os.environ, **(env or {})})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise AssertionError(f"serve did not start: {self.stderr}")
        self.ready = json.loads(line)
        assert self.ready["ok"], self.ready
        assert self.ready["pid"] == self.proc.pid, "the hand-over to reploy_serve.py is an exec"
        self.api = Api(self.ready["url"], self.ready["token"])

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def client_env(self) -> dict[str, str]:
        """The environment of a `reploy session` call that authenticates as the user does."""
        return {**os.environ, "REPLOY_TOKEN": self.ready["token"]}

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        return self.proc.returncode


_CLI_ERROR = re.compile(r"reploy: session [a-z]+: (.*?)(?: \((?:HTTP ([0-9]{3})(?:, ([a-z_]+))?|([a-z_]+))\))?\n")


def cli_error(proc: subprocess.CompletedProcess) -> dict[str, Any]:
    """A failed `reploy session` call as it reports one: exit 1, nothing on stdout, one line on
    stderr, `reploy: session ACTION: REASON`, then `(HTTP STATUS, CODE)` as serve said them.
    Its parts as {"error", "status", "code"} (None where not said)."""
    assert proc.returncode == 1 and proc.stdout == b"", (proc.returncode, proc.stdout, proc.stderr)
    text = proc.stderr.decode()
    match = _CLI_ERROR.fullmatch(text)
    assert match is not None, text
    reason, status, code, only_code = match.groups()
    return {"error": reason, "status": int(status) if status else None, "code": code or only_code}


def session_containers(client: Any, state_dir: Path, session_id: Optional[str] = None) -> list[Any]:
    labels = [f"{LABEL_STATE_DIR}={state_dir}"]
    if session_id:
        labels.append(f"io.reploy.session.live-run={session_id}")
    # The SDK inspects each listed container: one the server removes meanwhile is skipped, not an error.
    return client.containers.list(all=True, filters={"label": labels}, ignore_removed=True)


def sweep_killed_runs(client: Any) -> None:
    """Remove the session containers and state dirs of test runs that were killed before their
    teardown: a harness state dir (tempdir/rs-PID-*/state) whose pytest process is gone and
    that no live `serve` process uses."""
    import psutil

    in_use = set()
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "serve" in cmdline and "--state-dir" in cmdline:
            in_use.add(cmdline[cmdline.index("--state-dir") + 1])
    run = re.compile(re.escape(str(Path(tempfile.gettempdir()) / "rs-")) + r"(\d+)-")
    for container in client.containers.list(all=True, filters={"label": LABEL_STATE_DIR}, ignore_removed=True):
        state_dir = container.labels[LABEL_STATE_DIR]
        match = run.match(state_dir)
        if match and not psutil.pid_exists(int(match.group(1))) and state_dir not in in_use:
            container.remove(force=True)
            remove_session_disks(state_dir + "/")
            shutil.rmtree(Path(state_dir).parent, ignore_errors=True)


@pytest.fixture(scope="session")
def managed_workload(docker_client: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/managed (python3 + busybox top/vi), staged and built once; first, what killed
    runs left is swept."""
    from conftest import stage_and_build

    sweep_killed_runs(docker_client)
    directory = tmp_path_factory.mktemp("managed") / "workload"
    stage_and_build(ROOT / "examples/managed/managed.blueprint.yaml", directory)
    return directory


@contextlib.contextmanager
def serve_processes(managed_workload: Path) -> Iterator[Callable[..., ServeProcess]]:
    """Starts serve processes (a fresh state dir unless given); afterwards deletes every session
    through the API of a live one, stops them all and removes the state dirs, failing when a
    session disk was left mounted."""
    started: list[ServeProcess] = []
    temp_dirs: list[Path] = []

    def start(*extra: str, state_dir: Optional[Path] = None, env: Optional[dict[str, str]] = None) -> ServeProcess:
        if state_dir is None:
            # Short, so the host-side socket paths stay readable in failures.
            state_dir = Path(tempfile.mkdtemp(prefix=SERVE_STATE_DIR_PREFIX)) / "state"
            temp_dirs.append(state_dir.parent)
        process = ServeProcess(state_dir, managed_workload, *extra, env=env)
        started.append(process)
        return process

    yield start
    live = [p for p in started if p.proc.poll() is None]
    try:
        for state_dir in {p.state_dir for p in started}:
            server = next((p for p in live if p.state_dir == state_dir), None)
            if server is None:  # every serve on this state dir was killed: start one to clean up
                server = start(state_dir=state_dir)
                live.append(server)
            server.api.delete_all()
    finally:
        for process in started:
            process.stop()
        disks_left = [disk for directory in temp_dirs for disk in remove_session_disks(f"{directory}/")]
        for directory in temp_dirs:
            shutil.rmtree(directory, ignore_errors=True)
    assert not disks_left, f"session disks left mounted after every session was deleted: {disks_left}"


@pytest.fixture
def serve_factory(docker_engine: Any, managed_workload: Path) -> Iterator[Callable[..., ServeProcess]]:
    """serve_processes() for one test; the docker_engine check then asserts no container is
    left."""
    with serve_processes(managed_workload) as start:
        yield start


def start_browser(*flags: str) -> Browser:
    """Headless Chromium (Debian's, scripts/setup.sh installs it); skips without it only when
    REPLOY_REQUIRE_DOCKER is unset."""
    executable = find_chromium()
    if executable is None:
        if os.environ.get("REPLOY_REQUIRE_DOCKER") == "1":
            pytest.fail("REPLOY_REQUIRE_DOCKER=1 but chromium is not installed (scripts/setup.sh)")
        pytest.skip("chromium is not installed")
    return Browser(executable, *flags)


@pytest.fixture
def browser() -> Iterator[Browser]:
    instance = start_browser()
    yield instance
    instance.close()


def log_in(browser: Browser, server: ServeProcess) -> None:
    """What the user does: open the start line's login_url; the UI then shows its sessions."""
    browser.navigate(server.ready["login_url"])
    browser.wait_for(f"location.href === {json.dumps(server.ready['url'] + '/')} && "
                     "!!document.querySelector('[data-test=sessions]')", "the logged-in UI")


def sse_events(api: Api, sid: str, offset: Optional[int] = None, last_event_id: Optional[str] = None,
               until: Callable[[list[dict[str, Any]]], bool] = lambda events: False,
               timeout_s: float = DEADLINE_S) -> list[dict[str, Any]]:
    """Reads one SSE connection until `until(events)` holds or the server ends it. Comments
    are returned as {"comment": text}. The body arrives chunked; http.client takes the chunks
    apart."""
    conn = http.client.HTTPConnection(api.host, api.port, timeout=timeout_s)
    path = f"/api/v1/sessions/{sid}/stream" + (f"?offset={offset}" if offset is not None else "")
    conn.request("GET", path, headers={**api.auth_headers,
                                       **({"Last-Event-ID": last_event_id} if last_event_id else {})})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    assert response.getheader("Content-Type") == "text/event-stream"
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    try:
        while not until(events):
            line = response.readline()
            if not line:
                break
            text = line.decode().rstrip("\n")
            if text == "":
                if current:
                    events.append(current)
                current = {}
            elif text.startswith(":"):
                events.append({"comment": text[1:].strip()})
            else:
                key, _, value = text.partition(": ")
                current[key] = json.loads(value) if key == "data" else value
    finally:
        conn.close()
    return events


class LoopbackSite:
    """A small web server on 127.0.0.1 and a port of its own (so another origin than any serve):
    answers GET for the paths published on it, 404 otherwise, and records every request's
    headers. A context manager: leaving it stops the server."""

    def __init__(self) -> None:
        self.pages: dict[str, tuple[str, bytes]] = {}
        self.requests: list[dict[str, str]] = []
        site = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                site.requests.append(dict(self.headers.items()))
                content_type, data = site.pages.get(self.path, ("text/plain", b""))
                self.send_response(200 if data else 404)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def publish(self, path: str, content_type: str, data: bytes) -> str:
        self.pages[path] = (content_type, data)
        return self.url + path

    def __enter__(self) -> "LoopbackSite":
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Runs target on a thread; the list receives its result or exception."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(target())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box
