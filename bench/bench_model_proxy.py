#!/usr/bin/env python3
"""Benchmarks serve's model proxy (ModelProxy, the host side of a claude-code session's model
access); prints one JSON line per figure, as bench/bench_agent.py does. No Docker: the proxy
listens on a unix socket like a session's DIR/agent/model.sock, in a process of its own as in
serve; the agent's in-container relay is not part of these figures.

  model_proxy_first_delta   a streaming POST /v1/messages until its first text delta is read, ms
  model_proxy_throughput    a 32 MiB SSE answer (text deltas of about 1 KiB of prose) read whole, MiB/s
  model_proxy_cpu           CPU time the proxy's process spent on one such answer, ms

Baseline of the first two: the same request, read by the same code, from the same fake
Messages API (tests/model_upstream.py, over TLS with a CA made here, in a process of its own)
reached directly, alternated with the proxied rounds in the same run. Each round opens new
connections (the proxy opens one upstream per request). Baseline of model_proxy_cpu: the CPU
time this process spent reading the answer directly (TLS and HTTP, what any client pays), so
its ratio is what the proxy costs in CPU against a bare reader of the answer: on a loaded
machine the two time figures swing from run to run, the CPU one much less.

  python3 bench/bench_model_proxy.py [--rounds N]
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import agent  # noqa: E402
import reploy_serve  # noqa: E402
from bench_agent import figure  # noqa: E402
from model_upstream import (  # noqa: E402
    FakeMessagesApi, message_closing, message_opening, start_sse, text_delta,
)

ANSWER_BYTES = 32 * agent.MIB
#: Prose-like text (the credential search's speed depends on the bytes it scans; a run of one
#: letter is a worst case no answer has).
DELTA_TEXT = "Sure: here is the function that parses its settings, with tests. " * 16
WRITE_BYTES = 64 * 1024  #: the fake writes its answer in pieces of this size
READ_BYTES = 64 * 1024
READY_DEADLINE_S = 30.0
CREDENTIAL = "sk-ant-bench-credential-0123456789abcdef"
FIRST_DELTA = b"content_block_delta"


def sse_body(total: int) -> bytes:
    """A whole Messages API answer of at least `total` bytes."""
    delta = text_delta(DELTA_TEXT)
    return message_opening() + delta * (total // len(delta) + 1) + message_closing()


def serve_upstream(directory: Path) -> None:
    """Role `upstream`: the fake answering every POST with the 32 MiB answer; prints its port."""
    body = sse_body(ANSWER_BYTES)

    def plan(handler: object) -> None:
        start_sse(handler)  # type: ignore[arg-type]
        view = memoryview(body)
        for start in range(0, len(body), WRITE_BYTES):
            handler.wfile.write(view[start:start + WRITE_BYTES])  # type: ignore[attr-defined]

    with FakeMessagesApi(directory) as api:
        api.plan = plan
        print(api.port, flush=True)
        sys.stdin.read()  # until the bench closes it


def serve_proxy(directory: Path, port: int) -> None:
    """Role `proxy`: ModelProxy to the fake, on directory/agent/model.sock; prints `ready`."""
    agent_dir = directory / "agent"
    agent_dir.mkdir(mode=0o700)
    proxy = reploy_serve.ModelProxy(reploy_serve.parse_model_upstream(
        f"https://127.0.0.1:{port}", directory / "ca.pem", "x-api-key"), CREDENTIAL)
    proxy.listen("bench", agent_dir)
    print("ready", flush=True)
    sys.stdin.read()
    proxy.close()


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over the proxy's unix socket (what the session's relay connects to)."""

    def __init__(self, path: Path) -> None:
        super().__init__("127.0.0.1", timeout=READY_DEADLINE_S)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(READY_DEADLINE_S)
        self.sock.connect(str(self.unix_path))


def one_answer(connection: http.client.HTTPConnection, cpu: Callable[[], float]
               ) -> tuple[float, float, float]:
    """(ms to the first delta, MiB/s of the whole answer, ms of cpu()) of one streaming request."""
    cpu_before = cpu()
    started = time.perf_counter()
    connection.request("POST", "/v1/messages?beta=true", body=b'{"stream": true}', headers={
        "x-api-key": reploy_serve.MODEL_PLACEHOLDER, "anthropic-version": "2023-06-01",
        "content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200, response.status
    first, total, seen = None, 0, b""
    while chunk := response.read1(READ_BYTES):
        total += len(chunk)
        if first is None:
            seen = seen[-len(FIRST_DELTA):] + chunk
            if FIRST_DELTA in seen:
                first = time.perf_counter()
    ended = time.perf_counter()
    connection.close()
    assert first is not None and total >= ANSWER_BYTES, total
    return (first - started) * 1000, total / agent.MIB / (ended - started), (cpu() - cpu_before) * 1000


def started(argv: list[str]) -> tuple[subprocess.Popen[str], str]:
    """A role of this script in its own process, and the first line it printed."""
    process = subprocess.Popen([sys.executable, __file__, *argv], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("role", nargs="*", help=argparse.SUPPRESS)  # upstream DIR | proxy DIR PORT
    args = parser.parse_args()
    if args.role[:1] == ["upstream"]:
        serve_upstream(Path(args.role[1]))
        return 0
    if args.role[:1] == ["proxy"]:
        serve_proxy(Path(args.role[1]), int(args.role[2]))
        return 0
    directory = Path(tempfile.mkdtemp(prefix="rbmp-"))
    processes: list[subprocess.Popen[str]] = []
    try:
        upstream, port = started(["upstream", str(directory)])
        processes.append(upstream)
        proxy, ready = started(["proxy", str(directory), port])
        processes.append(proxy)
        assert ready == "ready", ready
        tls = ssl.create_default_context(cafile=str(directory / "ca.pem"))
        proxy_cpu = psutil.Process(proxy.pid)
        ways: dict[str, tuple[Callable[[], http.client.HTTPConnection], Callable[[], float]]] = {
            "direct": (lambda: http.client.HTTPSConnection("127.0.0.1", int(port), context=tls,
                                                           timeout=READY_DEADLINE_S), time.process_time),
            "proxy": (lambda: UnixHTTPConnection(directory / "agent" / agent.MODEL_SOCKET_NAME),
                      lambda: sum(proxy_cpu.cpu_times()[:2]))}
        samples: dict[str, list[tuple[float, float, float]]] = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way, (connect, cpu) in ways.items():
                samples[way].append(one_answer(connect(), cpu))
        figure("model_proxy_first_delta", "ms", [s[0] for s in samples["proxy"]],
               [s[0] for s in samples["direct"]])
        figure("model_proxy_throughput", "MiB/s", [s[1] for s in samples["proxy"]],
               [s[1] for s in samples["direct"]])
        figure("model_proxy_cpu", "ms", [s[2] for s in samples["proxy"]],
               [s[2] for s in samples["direct"]])
    finally:
        for process in processes:
            assert process.stdin is not None
            process.stdin.close()
            process.wait(timeout=READY_DEADLINE_S)
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.umask(0o077)
    sys.exit(main())
