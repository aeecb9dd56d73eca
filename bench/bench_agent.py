#!/usr/bin/env python3
"""Benchmarks agent.py's control socket; prints one JSON line per figure.

Each line: name, unit, n, p50, p90, p99, baseline, ratio. The baseline is a raw unix-socket server in this same
run that does the least a server can (answer one line per connection with a ready-made reply), so `ratio` is what
agent.py's protocol core, loop and log cost on top of the socket itself. Figures, not pass/fail.

The log figures read the same 32 MiB log in windows of MAX_READ_BYTES, each window one request:
  agent_read_throughput             `read_fd` (the answer carries a read-only descriptor of the log; the bench
                                    preads the window from it), against the raw server answering a ready-made
                                    `read` reply holding the same bytes: what moving a window costs against
                                    the socket carrying it
  agent_read_throughput_vs_bare_fd  the same samples, against a raw server that answers a ready-made `read_fd`
                                    reply with a descriptor of the log (the bench preads alike): agent.py's own cost
  agent_read_json_throughput        `read` (the bytes as base64 in the answer), against the first baseline
  agent_read_whole_log              one `read_fd` window of the whole log, then its pread, against a pread of
                                    the whole log from a descriptor the bench opened itself (what serve's API
                                    `read` does now, against reading the file)

  python3 bench/bench_agent.py
"""

from __future__ import annotations

import array
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
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import agent  # noqa: E402

STATUS_REQUESTS = 2000
RATE_BATCHES = 20
RATE_BATCH_REQUESTS = 100
READ_LOG_BYTES = 32 * agent.MIB
READ_ROUNDS = 3
WHOLE_LOG_ROUNDS = 10
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


def exchange_with_fds(path: Path, line: bytes) -> tuple[bytes, list[int]]:
    """One request line; the reply line and the descriptors it carried (the caller closes them)."""
    fds: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(path))
        sock.sendall(line)
        reply = bytearray()
        while not reply.endswith(b"\n"):
            chunk, ancillary, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(4), socket.MSG_CMSG_CLOEXEC)
            fds += agent.received_fds(ancillary)
            if not chunk:
                break
            reply += chunk
        return bytes(reply), fds


def exchange(path: Path, line: bytes) -> bytes:
    reply, fds = exchange_with_fds(path, line)
    for fd in fds:
        os.close(fd)
    return reply


def read_window(path: Path, line: bytes) -> tuple[dict[str, Any], bytes]:
    """One `read_fd` (or a ready-made reply of its shape): its result, and its window's bytes preads from the
    descriptor it carried."""
    reply, fds = exchange_with_fds(path, line)
    try:
        result = json.loads(reply)["result"]
        return result, os.pread(fds[0], result["next_offset"] - result["offset"], result["offset"])
    finally:
        for fd in fds:
            os.close(fd)


class BaselineServer:
    """One reply line per connection, chosen by `respond`, sent with a duplicate of `fd` when one is given;
    nothing else. Runs on a thread of this process."""

    def __init__(self, path: Path, respond: Callable[[bytes], bytes], fd: int = -1) -> None:
        self._respond = respond
        self._fd = fd
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
                reply = self._respond(bytes(request))
                if self._fd >= 0:
                    rights = array.array("i", [self._fd]).tobytes()
                    sent = conn.sendmsg([reply], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
                    reply = reply[sent:]
                if reply:
                    conn.sendall(reply)

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


def read_line(method: str, offset: int, max_bytes: int) -> bytes:
    return json.dumps({"id": "r", "method": method, "params": {"offset": offset, "max_bytes": max_bytes}}).encode() + b"\n"


def json_read_throughput(path: Path, total_bytes: int) -> list[float]:
    """MiB/s per `read` of MAX_READ_BYTES, over the whole log, READ_ROUNDS times."""
    samples = []
    for _ in range(READ_ROUNDS):
        offset = 0
        while offset < total_bytes:
            start = time.perf_counter()
            reply = json.loads(exchange(path, read_line("read", offset, agent.MAX_READ_BYTES)))["result"]
            elapsed = time.perf_counter() - start
            got = reply["next_offset"] - offset
            offset = reply["next_offset"]
            samples.append(got / agent.MIB / elapsed)
    return samples


def fd_read_throughput(path: Path, total_bytes: int, window_bytes: int, rounds: int) -> list[float]:
    """MiB/s per `read_fd` window of window_bytes and its pread, over the whole log, `rounds` times."""
    samples = []
    for _ in range(rounds):
        offset = 0
        while offset < total_bytes:
            start = time.perf_counter()
            result, data = read_window(path, read_line("read_fd", offset, window_bytes))
            elapsed = time.perf_counter() - start
            assert len(data) == result["next_offset"] - offset > 0, result
            offset = result["next_offset"]
            samples.append(len(data) / agent.MIB / elapsed)
    return samples


def bare_fd_read_throughput(path: Path, window_bytes: int, count: int) -> list[float]:
    """MiB/s per window of a raw server's ready-made `read_fd` reply and its pread."""
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        _, data = read_window(path, b"{}\n")
        samples.append(len(data) / agent.MIB / (time.perf_counter() - start))
        assert len(data) == window_bytes
    return samples


def file_read_throughput(log_path: Path, count: int) -> list[float]:
    """MiB/s per pread of the whole log from a descriptor opened here."""
    samples = []
    fd = os.open(log_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for _ in range(count):
            start = time.perf_counter()
            data = os.pread(fd, READ_LOG_BYTES, 0)
            samples.append(len(data) / agent.MIB / (time.perf_counter() - start))
    finally:
        os.close(fd)
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
    log_path = session_dir / agent.AGENT_DIR_NAME / agent.LOG_NAME
    log_path.write_bytes(os.urandom(READ_LOG_BYTES))
    proc = start_agent(session_dir)
    socket_path = session_dir / agent.AGENT_DIR_NAME / agent.SOCKET_NAME
    status_line = b'{"id":"b","method":"status","params":{}}\n'
    sample_status = exchange(socket_path, status_line)
    first_read = read_line("read", 0, agent.MAX_READ_BYTES)
    read_reply = exchange(socket_path, first_read)
    window_reply = exchange(socket_path, read_line("read_fd", 0, agent.MAX_READ_BYTES))
    log_fd = os.open(log_path, os.O_RDONLY | os.O_CLOEXEC)
    echo = BaselineServer(work / "echo.sock", lambda request: sample_status)
    blob = BaselineServer(work / "blob.sock", lambda request: read_reply)
    bare_fd = BaselineServer(work / "fd.sock", lambda request: window_reply, log_fd)
    try:
        print(f"bench_agent: agent pid {proc.pid}, log {READ_LOG_BYTES} bytes", file=sys.stderr)
        figure("agent_status_latency", "ms", timed(socket_path, status_line, STATUS_REQUESTS),
               timed(work / "echo.sock", status_line, STATUS_REQUESTS))
        figure("agent_status_rate", "requests/s", rates(socket_path, status_line), rates(work / "echo.sock",
                                                                                          status_line))
        windows = READ_ROUNDS * (READ_LOG_BYTES // agent.MAX_READ_BYTES)
        baseline_read = []
        for _ in range(windows):
            start = time.perf_counter()
            exchange(work / "blob.sock", first_read)
            baseline_read.append(agent.MAX_READ_BYTES / agent.MIB / (time.perf_counter() - start))
        fd_reads = fd_read_throughput(socket_path, READ_LOG_BYTES, agent.MAX_READ_BYTES, READ_ROUNDS)
        figure("agent_read_throughput", "MiB/s", fd_reads, baseline_read)
        figure("agent_read_throughput_vs_bare_fd", "MiB/s", fd_reads,
               bare_fd_read_throughput(work / "fd.sock", agent.MAX_READ_BYTES, windows))
        figure("agent_read_json_throughput", "MiB/s", json_read_throughput(socket_path, READ_LOG_BYTES), baseline_read)
        figure("agent_read_whole_log", "MiB/s",
               fd_read_throughput(socket_path, READ_LOG_BYTES, agent.MAX_LOG_WINDOW_BYTES, WHOLE_LOG_ROUNDS),
               file_read_throughput(log_path, WHOLE_LOG_ROUNDS))
    finally:
        echo.close()
        blob.close()
        bare_fd.close()
        os.close(log_fd)
        proc.send_signal(signal.SIGTERM)
        proc.wait(READY_DEADLINE_S)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
