"""The bench controller: runs inside the controller container of a controlled session and
measures what only a controller can see, the moment it reads `ready` and how terminal bytes
come back through its `attach`. It writes what it measured as JSON to
$REPLOY_OUTPUT_DIR/report.json, where bench/bench_sessions.py reads it.

  python3 /opt/controller/bench_controller.py session
  python3 /opt/controller/bench_controller.py stream ROUNDS BYTES KEYSTROKES
  python3 /opt/controller/bench_controller.py hold
  python3 /opt/controller/bench_controller.py baseline

The bench also imports this file: its `Probe` measures the direct-attach baseline, so both arms
of the throughput and echo figures run the very same measuring code.

Wall-clock times are `time.time()`: a container shares the host's clock, so the bench can
subtract a time taken here from one taken on the host.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Callable

from reploy_driver import SessionDriver

MIB = 1024 * 1024
#: Bytes asked of the terminal per read; the size the host and the client move at a time.
READ_CHUNK_BYTES = 64 * 1024
#: Single-byte keystrokes, cycled, so a late echo of one key cannot pass for the next.
KEYS = b"abcdefghijklmnopqrstuvwxyz"
#: How long `session` and `hold` wait for any one lifecycle event.
EVENT_TIMEOUT_S = 60.0
#: Where `hold` waits for the bench's word to end the session (a FIFO the bench creates).
RELEASE_FIFO_NAME = "release"
#: What `hold` writes once its session is ready, so the bench knows it is live.
HELD_NAME = "held.json"
REPORT_NAME = "report.json"


class ProbeFailed(Exception):
    """The terminal did not answer as the measurement expects."""


def marker(name: str) -> tuple[str, bytes]:
    """A shell command printing a marker, and the marker as it arrives. The shell computes
    part of it, so the echo of the typed command can never match."""
    return f"echo @@{name}-$((6*7))@@", f"@@{name}-42@@".encode()


class Probe:
    """Types into a shell and times what comes back.

    `write` sends bytes to the terminal; `read_fd` is a blocking descriptor its output arrives
    on. Nothing is kept but the few bytes a marker may straddle, so 64 MiB costs no memory.
    """

    def __init__(self, write: Callable[[bytes], None], read_fd: int) -> None:
        self.write = write
        self.read_fd = read_fd
        self.leftover = b""

    def read_until(self, expected: bytes) -> int:
        """Consume output through `expected`; return how many bytes came before it."""
        buffered, skipped = self.leftover, 0
        while (found_at := buffered.find(expected)) < 0:
            keep = min(len(buffered), len(expected) - 1)
            skipped += len(buffered) - keep
            chunk = os.read(self.read_fd, READ_CHUNK_BYTES)
            if not chunk:
                raise ProbeFailed(f"the terminal closed before {expected!r}")
            buffered = buffered[len(buffered) - keep:] + chunk
        self.leftover = buffered[found_at + len(expected):]
        return skipped + found_at

    def sync(self) -> None:
        """Wait until the shell has run a command: everything before is behind us."""
        command, expected = marker("sync")
        self.write(f"{command}\n".encode())
        self.read_until(expected)

    def throughput(self, total_bytes: int) -> float:
        """MiB/s of `total_bytes` written by the workload to its terminal, as read here."""
        self.sync()
        command, expected = marker("end")
        started = time.perf_counter()
        self.write(f"head -c {total_bytes} /dev/zero; {command}\n".encode())
        received = self.read_until(expected)
        elapsed_s = time.perf_counter() - started
        if received < total_bytes:
            raise ProbeFailed(f"{received} bytes arrived of {total_bytes}")
        return total_bytes / MIB / elapsed_s

    def echo_round_trips(self, keystrokes: int) -> list[float]:
        """Milliseconds from typing one byte to reading its echo, one byte in flight at a time.
        The terminal is in raw mode with echo on, so the workload's kernel echoes each byte the
        moment it arrives: what is timed is the path there and back, not a line editor."""
        self.sync()
        raw_command, raw = marker("raw")
        sane_command, sane = marker("sane")
        self.write(f"stty raw; {raw_command}; head -c {keystrokes} >/dev/null; stty sane; "
                   f"{sane_command}\n".encode())
        self.read_until(raw)
        samples = []
        for index in range(keystrokes):
            key = bytes([KEYS[index % len(KEYS)]])
            started = time.perf_counter()
            self.write(key)
            self.read_until(key)
            samples.append((time.perf_counter() - started) * 1000)
        self.read_until(sane)
        return samples


class MeasuredSession(SessionDriver):
    """The driver's whole lifecycle, with its terminal output left to a Probe on this thread
    (no transcript and no reader thread in between) until `release_output` hands it back."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._released = threading.Event()

    def _read_output(self, fd: int) -> None:
        self._released.wait()
        super()._read_output(fd)

    def probe(self) -> Probe:
        assert self.attach is not None and self.attach.stdout is not None
        return Probe(self.type, self.attach.stdout.fileno())

    def release_output(self) -> None:
        self._released.set()


def output_path(name: str) -> str:
    return os.path.join(os.environ["REPLOY_OUTPUT_DIR"], name)


def write_json(name: str, obj: dict[str, Any]) -> None:
    """Write whole or not at all: the bench may be polling for this file."""
    with open(output_path(name + ".part"), "w") as f:
        json.dump(obj, f)
    os.rename(output_path(name + ".part"), output_path(name))


def end_session(session: SessionDriver, report: dict[str, Any]) -> dict[str, Any]:
    """Type `exit`, noting when, and follow the session to its end."""
    report["exit_typed_at"] = time.time()
    session.type("exit 0\n")
    outcome = session.finish()
    report["cause"] = (outcome.terminated or {}).get("result", {}).get("cause")
    return report


def session_mode(args: list[str]) -> dict[str, Any]:
    """Ready and teardown: the moment `ready` is read, then an immediate exit."""
    with SessionDriver(attach="pipe", timeout_s=EVENT_TIMEOUT_S) as session:
        session.start()
        return end_session(session, {"ready_at": time.time()})


def stream_mode(args: list[str]) -> dict[str, Any]:
    """Throughput rounds, then echo round trips, in one session."""
    rounds, total_bytes, keystrokes = (int(arg) for arg in args)
    with MeasuredSession(attach="pipe", timeout_s=EVENT_TIMEOUT_S) as session:
        session.start()
        probe = session.probe()
        report: dict[str, Any] = {
            "throughput_mib_s": [probe.throughput(total_bytes) for _ in range(rounds)],
            "echo_ms": probe.echo_round_trips(keystrokes),
        }
        session.release_output()
        return end_session(session, report)


def hold_mode(args: list[str]) -> dict[str, Any]:
    """Stay live until the bench says so: the bench measures memory meanwhile."""
    with SessionDriver(attach="pipe", timeout_s=EVENT_TIMEOUT_S) as session:
        session.start()
        write_json(HELD_NAME, {"ready_at": time.time()})
        with open(output_path(RELEASE_FIFO_NAME)) as fifo:
            fifo.readline()
        return end_session(session, {})


def baseline_mode(args: list[str]) -> dict[str, Any]:
    """The controller of the SDK baseline: no session to join, so it only says it runs."""
    return {"started_at": time.time()}


MODES = {"session": session_mode, "stream": stream_mode, "hold": hold_mode,
         "baseline": baseline_mode}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in MODES:
        print(f"usage: bench_controller.py {'|'.join(MODES)} [ARGS]", file=sys.stderr)
        return 2
    write_json(REPORT_NAME, MODES[argv[0]](argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
