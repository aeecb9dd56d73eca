#!/usr/bin/env python3
"""Benchmarks agent.py's control socket; prints one JSON line per figure.

Each line: name, unit, n, p50, p90, p99, baseline, ratio. The baseline is a raw unix-socket server in this same
run that does the least a server can (answer one line per connection with a ready-made reply), so `ratio` is what
agent.py's protocol core, loop and log cost on top of the socket itself. Figures, not pass/fail.

  python3 bench/bench_agent.py
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import agent  # noqa: E402

STATUS_REQUESTS = 2000
RATE_BATCHES = 20
RATE_BATCH_REQUESTS = 100
READ_LOG_BYTES = 32 * agent.MIB
READ_ROUNDS = 3
READY_DEADLINE_S = 15.0


def percentiles(samples: list[float]) -> tuple[float, float, float]:
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return cuts[49], cuts[89], cuts[98]


def figure(name: str, unit: str, samples: list[float], baseline: list[float] | None) -> None:
    p50, p90, p99 = percentiles(samples)
    base = percentiles(baseline)[0] if baseline else None
    print(json.dumps({"name": name, "unit": unit, "n": len(samples), "p50": round(p50, 4), "p90": round(p90, 4),
                      "p99": round(p99, 4), "baseline": None if base is None else round(base, 4),
                      "ratio": None if base is None else round(p50 / base, 3)}), flush=True)


def exchange(path: Path, line: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(path))
        sock.sendall(line)
        reply = bytearray()
        while not reply.endswith(b"\n"):
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            reply += chunk
        return bytes(reply)


class BaselineServer:
    """One reply line per connection, chosen by `respond`; nothing else. Runs on a thread of this process."""

    def __init__(self, path: Path, respond: Callable[[bytes], bytes]) -> None:
        self._respond = respond
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(128)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                request = bytearray()
                while not request.endswith(b"\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    request += chunk
                conn.sendall(self._respond(bytes(request)))

    def close(self) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join()


def timed(path: Path, line: bytes, count: int) -> list[float]:
    """Per-request latencies in milliseconds, one connection each."""
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        exchange(path, line)
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def rates(path: Path, line: bytes) -> list[float]:
    """Requests per second, measured over batches of sequential requests."""
    samples = []
    for _ in range(RATE_BATCHES):
        start = time.perf_counter()
        for _ in range(RATE_BATCH_REQUESTS):
            exchange(path, line)
        samples.append(RATE_BATCH_REQUESTS / (time.perf_counter() - start))
    return samples


def read_throughput(path: Path, total_bytes: int) -> list[float]:
    """MiB/s per `read` of MAX_READ_BYTES, over the whole log, READ_ROUNDS times."""
    samples = []
    for _ in range(READ_ROUNDS):
        offset = 0
        while offset < total_bytes:
            line = json.dumps({"id": "r", "method": "read",
                               "params": {"offset": offset, "max_bytes": agent.MAX_READ_BYTES}}).encode() + b"\n"
            start = time.perf_counter()
            reply = json.loads(exchange(path, line))["result"]
            elapsed = time.perf_counter() - start
            got = reply["next_offset"] - offset
            offset = reply["next_offset"]
            samples.append(got / agent.MIB / elapsed)
    return samples


#: Run as root, the agent runs its workload as nobody (as in a managed session's container), and its
#: interpreter must be one that user can run.
RUNTIME_USER = ["--runtime-user", "65534:65534"] if os.geteuid() == 0 else []
PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") if RUNTIME_USER else sys.executable


def start_agent(session_dir: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([PYTHON, str(ROOT / "agent.py"), "serve", "--session-dir", str(session_dir),
                             "--workload", "shell", "--shell-log-cap-bytes", str(2 * READ_LOG_BYTES), *RUNTIME_USER],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + READY_DEADLINE_S
    while "result" not in agent.call(session_dir, "status", {}):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("bench_agent: the agent did not start")
        time.sleep(0.05)
    return proc


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="rb-"))
    work.chmod(0o755)  # the runtime user passes through it to the workspace
    session_dir = work / "s"
    (session_dir / agent.AGENT_DIR_NAME).mkdir(mode=0o700, parents=True)
    # A log already on disk: the agent serves it as it would after a restart.
    (session_dir / agent.AGENT_DIR_NAME / agent.LOG_NAME).write_bytes(os.urandom(READ_LOG_BYTES))
    proc = start_agent(session_dir)
    socket_path = session_dir / agent.AGENT_DIR_NAME / agent.SOCKET_NAME
    status_line = b'{"id":"b","method":"status","params":{}}\n'
    sample_status = exchange(socket_path, status_line)
    read_line = json.dumps({"id": "r", "method": "read", "params": {"max_bytes": agent.MAX_READ_BYTES}}).encode()
    read_reply = exchange(socket_path, read_line + b"\n")
    echo = BaselineServer(work / "echo.sock", lambda request: sample_status)
    blob = BaselineServer(work / "blob.sock", lambda request: read_reply)
    try:
        print(f"bench_agent: agent pid {proc.pid}, log {READ_LOG_BYTES} bytes", file=sys.stderr)
        figure("agent_status_latency", "ms", timed(socket_path, status_line, STATUS_REQUESTS),
               timed(work / "echo.sock", status_line, STATUS_REQUESTS))
        figure("agent_status_rate", "requests/s", rates(socket_path, status_line), rates(work / "echo.sock",
                                                                                          status_line))
        baseline_read = []
        for _ in range(READ_ROUNDS * (READ_LOG_BYTES // agent.MAX_READ_BYTES)):
            start = time.perf_counter()
            exchange(work / "blob.sock", read_line + b"\n")
            baseline_read.append(agent.MAX_READ_BYTES / agent.MIB / (time.perf_counter() - start))
        figure("agent_read_throughput", "MiB/s", read_throughput(socket_path, READ_LOG_BYTES), baseline_read)
    finally:
        echo.close()
        blob.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(READY_DEADLINE_S)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
