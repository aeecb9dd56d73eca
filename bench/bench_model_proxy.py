#!/usr/bin/env python3
"""Benchmarks serve's model proxy (ModelProxy, the host side of a claude-code session's model
access); prints one JSON line per figure, as bench/bench_agent.py does. Without --relay no
Docker: the proxy listens on a unix socket like a session's DIR/agent/model.sock, in a process
of its own as in serve.

  model_proxy_first_delta   a streaming POST /v1/messages until its first text delta is read, ms
  model_proxy_throughput    a 32 MiB SSE answer (text deltas of about 1 KiB of prose) read whole, MiB/s
  model_proxy_cpu           CPU time the proxy's process spent on one such answer, ms
  model_proxy_cpu_upstream  CPU time the fake spent on one answer to the proxy, ms; baseline: on
                            one answer to the reader, direct
  model_proxy_cpu_reader    CPU time the reader spent on one answer through the proxy (plain HTTP
                            on a unix socket), ms; baseline: on one answer, direct (TLS)
  model_proxy_cpu_all       CPU time of every process on one answer, ms: the fake, the proxy and
                            the reader; baseline: the fake and the reader, direct
  model_proxy_cpu_bound     the throughput that CPU time allows on this machine's cores, MiB/s:
                            the answer over max(the busiest process's CPU, all of it / cores);
                            its ratio is what model_proxy_throughput's would be if only CPU bound it
  model_proxy_core_cpu      CPU time of the proxy's pure core (BytesRedactor, WholeEvents) on that
                            answer in reads of MODEL_BATCH_BYTES (what one read of the upstream takes
                            while the answer arrives faster than it goes out), ms; baseline: one
                            bytes.find of the credential in each read, the scan no redaction can
                            skip (no I/O: a steady figure)
  model_relay_first_delta   (--relay) the first two, from inside a claude-code session of a real
  model_relay_throughput    serve: 127.0.0.1:8137 -> the agent's relay -> model.sock -> ModelProxy

Baseline of the time figures: the same request, read by the same code (bench/model_reader.py),
from the same fake Messages API (tests/model_upstream.py, over TLS with a CA made here, in a
process of its own) reached directly, alternated with the proxied rounds in the same run. The
reader opens a new connection every round, both ways (the CLI, one process per turn, does);
the proxy keeps its upstream connections open between requests (its pool), as in serve.
Baseline of model_proxy_cpu: the CPU time this process spent reading the answer directly (TLS
and HTTP, what any client pays), so its ratio is what the proxy costs in CPU against a bare
reader of the answer: on a loaded machine the two time figures swing from run to run, the CPU
one much less. CPU times are each process's own clock (time.process_time: all its threads,
ended ones too), which the fake and the proxy report when asked on their stdin.

  python3 bench/bench_model_proxy.py [--rounds N] [--relay]   (--relay: the engine and the
                                                              base images, make setup)
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import socket
import ssl
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import agent  # noqa: E402
import reploy_serve  # noqa: E402
from bench_agent import figure  # noqa: E402
from model_reader import read_answer  # noqa: E402
from model_upstream import (  # noqa: E402
    FakeMessagesApi, message_closing, message_opening, start_sse, text_delta,
)

ANSWER_BYTES = 32 * agent.MIB
#: Prose-like text (the credential search's speed depends on the bytes it scans; a run of one
#: letter is a worst case no answer has).
DELTA_TEXT = "Sure: here is the function that parses its settings, with tests. " * 16
WRITE_BYTES = 64 * 1024  #: the fake writes its answer in pieces of this size
READY_DEADLINE_S = 30.0
#: Shaped like an Anthropic API key (sk-ant-api03-, 93 URL-safe base64 characters, AA: 108 bytes),
#: fixed from run to run. Its length matters: bytes.find skips ahead by up to the needle's length,
#: so the proxy's credential scan of a 32 MiB answer takes about 1.5 ms with this one and 5 ms
#: with a 40-byte one (bench/README.md).
CREDENTIAL = "sk-ant-api03-" + "".join(random.Random(27).choices(
    string.ascii_letters + string.digits + "-_", k=93)) + "AA"


def sse_body(total: int) -> bytes:
    """A whole Messages API answer of at least `total` bytes."""
    delta = text_delta(DELTA_TEXT)
    return message_opening() + delta * (total // len(delta) + 1) + message_closing()


def answer_cpu_queries() -> None:
    """A role's stdin until the bench closes it: each line is answered with the CPU seconds
    this process has spent so far."""
    for _ in sys.stdin:
        print(time.process_time(), flush=True)


def serve_upstream(directory: Path) -> None:
    """Role `upstream`: the fake answering every POST with the 32 MiB answer; prints its port."""
    body = sse_body(ANSWER_BYTES)

    def plan(handler: object) -> None:
        start_sse(handler, len(body))  # type: ignore[arg-type]  # a length: kept alive
        view = memoryview(body)
        for start in range(0, len(body), WRITE_BYTES):
            handler.wfile.write(view[start:start + WRITE_BYTES])  # type: ignore[attr-defined]

    with FakeMessagesApi(directory) as api:
        api.plan = plan
        print(api.port, flush=True)
        answer_cpu_queries()


def serve_proxy(directory: Path, port: int) -> None:
    """Role `proxy`: ModelProxy to the fake, on directory/agent/model.sock; prints `ready`."""
    agent_dir = directory / "agent"
    agent_dir.mkdir(mode=0o700)
    proxy = reploy_serve.ModelProxy(reploy_serve.parse_model_upstream(
        f"https://127.0.0.1:{port}", directory / "ca.pem", "x-api-key"), CREDENTIAL)
    proxy.listen("bench", agent_dir)
    print("ready", flush=True)
    answer_cpu_queries()
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


class Role:
    """A role of this script in its own process (upstream, proxy), asked for its CPU time."""

    def __init__(self, argv: list[str]) -> None:
        self.process = subprocess.Popen([sys.executable, __file__, *argv], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self.first_line = self.read_line()

    def read_line(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def cpu_s(self) -> float:
        assert self.process.stdin is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        return float(self.read_line())

    def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=READY_DEADLINE_S)


@dataclass(frozen=True)
class Answer:
    """One streaming request read whole, and the CPU time each process spent on it, ms."""

    first_ms: float
    mib_s: float
    cpu_ms: dict[str, float]  # by process: upstream, proxy, reader

    def cpu_bound_mib_s(self, cores: int) -> float:
        """The throughput the CPU time alone allows: none runs faster than its busiest process,
        nor than all of them spread over every core."""
        busiest_s = max(max(self.cpu_ms.values()), sum(self.cpu_ms.values()) / cores) / 1000
        return ANSWER_BYTES / agent.MIB / busiest_s


def one_answer(connection: http.client.HTTPConnection, roles: dict[str, Role]) -> Answer:
    """One streaming request, and the CPU time of the roles and of this process (the reader)."""
    clocks: dict[str, Callable[[], float]] = {name: role.cpu_s for name, role in roles.items()}
    clocks["reader"] = time.process_time
    before = {name: clock() for name, clock in clocks.items()}
    first_ms, mib_s, total = read_answer(connection, reploy_serve.MODEL_PLACEHOLDER)
    assert total >= ANSWER_BYTES, total
    return Answer(first_ms, mib_s, {name: (clock() - before[name]) * 1000
                                    for name, clock in clocks.items()})


def core_cpu_ms(reads: list[bytes]) -> tuple[float, float]:
    """(ms of this thread's CPU time for the proxy's pure core over the reads, as _stream runs it,
    ms for one bytes.find of the credential in each read)."""
    redactor, events = reploy_serve.BytesRedactor(CREDENTIAL), reploy_serve.WholeEvents()
    started, passed = time.thread_time(), 0
    for piece in reads:  # each output dropped before the next read, as once the proxy sent it
        passed += sum(map(len, events.feed(redactor.feed(piece))))
    core_s = time.thread_time() - started
    assert passed + sum(map(len, events.feed(redactor.finish()))) + len(events.finish()) == sum(map(len, reads))
    secret, started = CREDENTIAL.encode(), time.thread_time()
    for piece in reads:
        piece.find(secret)
    return core_s * 1000, (time.thread_time() - started) * 1000


def relay_samples(directory: Path, port: str, rounds: int) -> tuple[list[tuple[float, float]],
                                                                     list[tuple[float, float]]]:
    """(relayed, direct) samples: model_reader.py in a claude-code session of a real serve
    whose proxy forwards to the fake on `port`, alternated with the same reader here, direct."""
    from conftest import stage_and_build
    from serve_harness import ServeProcess

    workload = directory / "workload"
    stage_and_build(ROOT / "examples/managed/managed.blueprint.yaml", workload)
    credential = directory / "credential"
    credential.write_text(CREDENTIAL + "\n")
    server = ServeProcess(directory / "state", workload, "--idle-after", "1h",
                          "--snapshot-after", "2h", "--model-upstream", f"https://127.0.0.1:{port}",
                          "--model-upstream-ca", str(directory / "ca.pem"),
                          "--model-credential-file", str(credential))
    reader = (ROOT / "bench" / "model_reader.py").read_text()
    tls = ssl.create_default_context(cafile=str(directory / "ca.pem"))
    relayed, direct = [], []
    try:
        sid = server.api.create("bench-relay", "claude-code")["id"]
        for _ in range(rounds):
            answer = server.api.call("POST", f"/sessions/{sid}/exec", {"argv": [
                "python3", "-c", reader, "127.0.0.1", str(reploy_serve.MODEL_RELAY_PORT), "-",
                reploy_serve.MODEL_PLACEHOLDER]})
            assert answer["exitCode"] == 0, answer
            first_ms, mib_s, total = json.loads(answer["stdout"])
            assert total >= ANSWER_BYTES, total
            relayed.append((first_ms, mib_s))
            first_ms, mib_s, _ = read_answer(http.client.HTTPSConnection(
                "127.0.0.1", int(port), context=tls, timeout=READY_DEADLINE_S),
                reploy_serve.MODEL_PLACEHOLDER)
            direct.append((first_ms, mib_s))
        server.api.delete_all()
    finally:
        server.stop()
    return relayed, direct


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--relay", action="store_true",
                        help="also through the relay of a real claude-code session (Docker)")
    parser.add_argument("role", nargs="*", help=argparse.SUPPRESS)  # upstream DIR | proxy DIR PORT
    args = parser.parse_args()
    if args.role[:1] == ["upstream"]:
        serve_upstream(Path(args.role[1]))
        return 0
    if args.role[:1] == ["proxy"]:
        serve_proxy(Path(args.role[1]), int(args.role[2]))
        return 0
    directory = Path(tempfile.mkdtemp(prefix="rbmp-"))
    roles: list[Role] = []
    try:
        upstream = Role(["upstream", str(directory)])
        roles.append(upstream)
        port = upstream.first_line
        proxy = Role(["proxy", str(directory), port])
        roles.append(proxy)
        assert proxy.first_line == "ready", proxy.first_line
        tls = ssl.create_default_context(cafile=str(directory / "ca.pem"))
        ways: dict[str, Callable[[], http.client.HTTPConnection]] = {
            "direct": lambda: http.client.HTTPSConnection("127.0.0.1", int(port), context=tls,
                                                          timeout=READY_DEADLINE_S),
            "proxy": lambda: UnixHTTPConnection(directory / "agent" / agent.MODEL_SOCKET_NAME)}
        answers: dict[str, list[Answer]] = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way, connect in ways.items():
                answers[way].append(one_answer(connect(), {"upstream": upstream, "proxy": proxy}))
        proxied, direct = answers["proxy"], answers["direct"]
        cores = len(os.sched_getaffinity(0))
        figure("model_proxy_first_delta", "ms", [a.first_ms for a in proxied], [a.first_ms for a in direct])
        figure("model_proxy_throughput", "MiB/s", [a.mib_s for a in proxied], [a.mib_s for a in direct])
        figure("model_proxy_cpu", "ms", [a.cpu_ms["proxy"] for a in proxied],
               [a.cpu_ms["reader"] for a in direct])
        for process in ("upstream", "reader"):
            figure(f"model_proxy_cpu_{process}", "ms", [a.cpu_ms[process] for a in proxied],
                   [a.cpu_ms[process] for a in direct])
        figure("model_proxy_cpu_all", "ms", [sum(a.cpu_ms.values()) for a in proxied],
               [sum(a.cpu_ms.values()) for a in direct])
        figure("model_proxy_cpu_bound", "MiB/s", [a.cpu_bound_mib_s(cores) for a in proxied],
               [a.cpu_bound_mib_s(cores) for a in direct])
        body = sse_body(ANSWER_BYTES)
        reads = [body[start:start + reploy_serve.MODEL_BATCH_BYTES]
                 for start in range(0, len(body), reploy_serve.MODEL_BATCH_BYTES)]
        core = [core_cpu_ms(reads) for _ in range(args.rounds)]
        figure("model_proxy_core_cpu", "ms", [c[0] for c in core], [c[1] for c in core])
        if args.relay:
            relayed, relay_direct = relay_samples(directory, port, args.rounds)
            figure("model_relay_first_delta", "ms", [s[0] for s in relayed], [s[0] for s in relay_direct])
            figure("model_relay_throughput", "MiB/s", [s[1] for s in relayed], [s[1] for s in relay_direct])
    finally:
        for role in roles:
            role.stop()
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.umask(0o077)
    sys.exit(main())
