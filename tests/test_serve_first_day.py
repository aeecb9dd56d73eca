"""A first heavy day (issue 46). A burst of creates, as a harness starting an eval makes it:
every create on its own connection, all sent at once, each answered (201, or 429/503 with
Retry-After), never a connection reset; the Python client retries what is safe to retry. And
serve's own edges: a port in use, an unbuilt workload, a health probe without the token."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest

from serve_harness import (  # noqa: F401  (fixtures)
    ROOT, ServeProcess, managed_workload, serve_factory,
)

pytestmark = pytest.mark.docker

#: The burst: as many creates at once as serve's default --max-sessions admits.
BURST = 64
#: Each session's disk: small, so that the host's free space admits the whole burst.
BURST_DISK_MIB = 64


def create_at_once(server: ServeProcess, count: int) -> list[Any]:
    """`count` POST /sessions, each on its own new connection, released together: each is
    (status, Retry-After, body) or the exception its connection raised."""
    start = threading.Barrier(count)

    def create(index: int) -> Any:
        connection = http.client.HTTPConnection(server.api.host, server.api.port, timeout=300)
        body = json.dumps({"name": f"burst-{index}", "diskMib": BURST_DISK_MIB}).encode()
        headers = {**server.api.auth_headers, "Content-Type": "application/json"}
        try:
            start.wait()
            connection.request("POST", "/api/v1/sessions", body, headers)
            response = connection.getresponse()
            return response.status, response.getheader("Retry-After"), response.read()
        except OSError as e:
            return e
        finally:
            connection.close()

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(create, range(count)))


def test_a_burst_of_creates_is_answered_whole(serve_factory: Callable[..., ServeProcess]) -> None:
    server = serve_factory()
    answers = create_at_once(server, BURST)
    failures = [a for a in answers if isinstance(a, Exception)
                or not (a[0] == 201 or (a[0] in (429, 503) and a[1] is not None))]
    assert not failures, f"{len(failures)} of {BURST} creates failed: {failures[:5]}"
    created = [json.loads(a[2])["id"] for a in answers if a[0] == 201]
    listed = {s["id"] for s in server.api.call("GET", "/sessions")["sessions"]}
    assert set(created) <= listed


def test_a_burst_of_creates_through_the_python_client_all_succeed(
        serve_factory: Callable[..., ServeProcess]) -> None:
    """Each create on a client of its own (its own connection), all at once: every one
    returns a session (the client retries what is safe to retry)."""
    import reploy_client

    server = serve_factory()
    start = threading.Barrier(BURST // 2)

    def create(index: int) -> Any:
        with reploy_client.Client(server.ready["url"], token=server.ready["token"],
                                  allow_plain_http=True) as client:
            start.wait()
            try:
                return client.create(f"client-burst-{index}", diskMib=BURST_DISK_MIB).id
            except reploy_client.ReployError as e:
                return e

    with ThreadPoolExecutor(BURST // 2) as pool:
        created = list(pool.map(create, range(BURST // 2)))
    failures = [c for c in created if isinstance(c, Exception)]
    assert not failures, f"{len(failures)} of {BURST // 2} creates failed: {failures[:5]}"
    assert len(set(created)) == BURST // 2


# -- how serve starts, or refuses to ---------------------------------------------------------


def serve_once(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "reploy.py"), "serve", *args],
                          capture_output=True, timeout=120, stdin=subprocess.DEVNULL)


def test_a_port_in_use_is_one_line_and_exit_1(tmp_path: Path, managed_workload: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = serve_once("--listen", f"127.0.0.1:{port}", "--state-dir", str(tmp_path / "s"),
                          "--workload-dir", str(managed_workload))
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["error"] == f"cannot listen on 127.0.0.1:{port}: Address already in use"
    assert proc.stderr.decode().splitlines() == [
        f"reploy: serve: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_an_unbuilt_workload_is_refused_at_start_saying_how_to_build_it(tmp_path: Path) -> None:
    unbuilt = tmp_path / "unbuilt"
    staged = subprocess.run([sys.executable, str(ROOT / "reploy.py"), "stage",
                             str(ROOT / "examples/managed/managed.blueprint.yaml"), "--dir", str(unbuilt)],
                            capture_output=True, timeout=60)
    assert staged.returncode == 0, staged.stderr
    proc = serve_once("--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "s"),
                      "--workload-dir", str(unbuilt))
    assert proc.returncode == 1
    assert (f"the workload deployment managed-workload in {unbuilt} is not built: run "
            f"`reploy build --dir {unbuilt}`") in proc.stderr.decode()


def test_healthz_answers_without_the_token(serve_factory: Callable[..., ServeProcess]) -> None:
    server = serve_factory()
    status, _, body = server.api.request("GET", "/api/v1/healthz", auth=False)
    assert (status, json.loads(body)) == (200, {"status": "ok"})
    status, _, _ = server.api.request("GET", "/api/v1/config", auth=False)
    assert status == 401


def test_the_example_sessions_user_has_a_name(serve_factory: Callable[..., ServeProcess]) -> None:
    """examples/managed gives its runtime user a passwd entry: whoami answers."""
    server = serve_factory()
    sid = server.api.create("whoami")["id"]
    answer = server.api.call("POST", f"/sessions/{sid}/exec", {"argv": ["sh", "-c", "whoami; echo ~"]})
    assert answer["exitCode"] == 0, answer
    assert answer["stdout"] == "reploy\n/mnt/reploy-home\n"
