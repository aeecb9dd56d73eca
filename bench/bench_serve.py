#!/usr/bin/env python3
"""Benchmarks `reploy serve`; prints one JSON line per figure (like bench/bench_agent.py).

Each line: name, unit, n, p50, p90, p99, baseline, ratio. Figures, not pass/fail:
  serve_create_to_prompt      POST /sessions until the shell's first prompt is readable, against
                              the raw Docker SDK with the same disk: a session disk of serve's
                              default size made and mounted the way serve makes it (image, mkfs.ext4,
                              loop mount, layout), then the same sandboxed container created and
                              started on it, polling the agent's socket until `status` answers (the
                              agent started as serve starts it, from serve's bytecode); one baseline
                              of each kind after each create
  serve_create_to_prompt_vs_diskless  the same creates, against that SDK baseline without the disk
                              (its session directory a plain one): what a session's own disk costs too
  serve_idle_to_active        a read of a paused (idle) session: unpause + the read
  serve_snapshot_to_active    a read of a snapshotted session: new container + restore + the read
  serve_sse_delivery          write `echo MARK` through the API until MARK arrives on the SSE stream, ms,
                              against a write + a long-poll read, both on the agent's socket directly
  serve_sse_delivery_bare_hop the same writes and stream through a bare HTTP hop the bench runs in
                              place of serve (one selector thread; no access check, store or parse
                              of the agent's answers), against the same baseline: what one bare
                              HTTP hop in Python costs on this path, before any work of serve's
  serve_write_kept_alive      POST /write of a shell line through reploy_client's kept-alive
                              connections, ms, against the same write on a new connection each
  serve_sse_delivery_streams_N  the same API write until MARK arrived on each of N concurrent SSE streams
                              of one session (N = 1, 10, 50), ms, one sample per stream and write, against
                              the same API write until it arrived on N concurrent long-poll readers of the
                              agent's socket; every reader must get every byte of the log in order
  serve_idle_memory           memory of one paused session container (cgroup usage), MiB, against the
                              floor: a bare `python3 -I -S` paused in the same image and sandbox; each
                              process's threads, CPU time, Pss and anonymous memory go to stderr
  serve_idle_memory_after_a_file_operation  the same once each session served one file operation (its
                              file workers' zygote started) and then none for the zygote's linger
                              (agent.DEFAULT_FILE_WORKER_LINGER_S, waited for until it is gone), against
                              the same floor (--only serve_idle_memory measures it)
  serve_memory_per_active_session_20  20 shell sessions live at once: each one's container (what docker
                              stats shows) plus serve's RSS growth / 20, MiB, against 20 containers of the
                              same image and sandbox flags running only /bin/sh on a TTY
  serve_memory_per_idle_session_20    the same once all 20 are idle (paused), against those shells paused
  serve_exec_true             POST /exec of `true` until its result, against the Docker SDK's exec_run
                              (exec create + start + inspect: what `docker exec` calls) in the same container
  serve_exec_while_a_session_burns_cores  POST /exec of `true` in one session while another runs 4 busy loops
                              (more than this host's cores; --session-cpus bounds it), ms, against the same
                              exec on the idle machine, in the same run
  serve_exec_while_60_readers_follow  the same while 60 SSE readers try to follow a session that prints
                              without pause (the reader bounds refuse most: stderr says how many were
                              admitted), against the idle machine
  serve_creates_at_once_N     N POST /sessions sent at once (N = 1, 8, 32, 64), each on its own
                              connection, until each is answered 201, s per create (p99 is the tail),
                              against N SDK creates at once of the same sandboxed container on the same
                              kind of disk (64 MiB here) until its agent answers; `_wall`: the whole burst
  serve_upload_throughput     PUT /files of a 64 MiB file, MiB/s, against the SDK's put_archive of the
                              same file (docker cp's API; its tar built beforehand, outside the timing)
  serve_download_throughput   GET /files of that file, MiB/s, against the SDK's get_archive of it, read whole

  python3 bench/bench_serve.py [--rounds N]
                              [--only serve_create_to_prompt|serve_idle_memory|sse|files|creates]
                              (needs the engine and the base images: make setup)
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import functools
import http.client
import io
import itertools
import json
import os
import selectors
import signal
import socket
import tarfile
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import docker  # noqa: E402
import docker.constants  # noqa: E402
import docker.models.containers  # noqa: E402
import psutil  # noqa: E402

import reploy  # noqa: E402
import reploy_client  # noqa: E402
import reploy_serve  # noqa: E402
from conftest import remove_built_images, stage_and_build, staged_deployment_ids  # noqa: E402
from serve_harness import DEADLINE_S, Api, ServeProcess, wait_until  # noqa: E402


def figure(name: str, unit: str, samples: list[float], baseline: list[float] | None = None) -> None:
    cuts = statistics.quantiles(samples, n=100, method="inclusive") if len(samples) > 1 else [samples[0]] * 99
    base = statistics.median(baseline) if baseline else None
    print(json.dumps({"name": name, "unit": unit, "n": len(samples), "p50": round(cuts[49], 4),
                      "p90": round(cuts[89], 4), "p99": round(cuts[98], 4),
                      "baseline": None if base is None else round(base, 4),
                      "ratio": None if base is None else round(cuts[49] / base, 3)}), flush=True)


MIB = 1024 * 1024
#: The label of the baselines' containers (each removed by the code that created it). Not the
#: session label, which tests' and the watchdog's sweeps take for an orphaned session's; nor
#: bench_sessions.py's, whose end-of-run sweep would take ours for its own leftovers.
BASELINE_LABELS = {"io.reploy.bench.serve-baseline": str(os.getpid())}


def read_once(api: Api, sid: str) -> None:
    """One access that reads nothing: a read past the end of the output."""
    api.call("POST", f"/sessions/{sid}/read", {"offset": 2**62})


def sdk_create(workload: Path, disk: bool,
               disk_mib: int = reploy_serve.DEFAULT_SESSION_DISK_MIB) -> float:
    """The same sandboxed container straight through the SDK, until its agent answers: one
    sample, in seconds (main alternates them with serve's creates, so load hits both alike).
    `disk`: its session directory is a disk of serve's default size, made and mounted first as
    serve makes one (timed), rather than a plain directory laid out alike."""
    deployment = reploy.load_deployment(workload)
    backend = reploy.DockerBackend()
    bytecode_dir = workload / "bytecode"  # the agent's, as serve compiles and mounts it
    reploy_serve.compile_agent_bytecode(bytecode_dir)
    directory = Path(tempfile.mkdtemp(prefix="bsb-", dir=workload.parent))  # serve's file system
    image, session_dir = directory / "s.img", directory / "s"
    runtime = deployment.blueprint.runtime
    if not disk:
        (session_dir / "workspace").mkdir(mode=0o700, parents=True)  # serve's layout, on no disk
        session_dir.chmod(0o755)
        shutil.chown(session_dir / "workspace", runtime.uid, runtime.gid)
    spec = reploy.ContainerSpec(
        role="managed", image_id=deployment.current.image_id,
        command=(*reploy_serve.AGENT_COMMAND, "serve", "--session-dir", reploy_serve.SESSION_MOUNT,
                 "--workload", "shell", "--home", reploy.CONTAINER_HOME, "--runtime-user", runtime.user),
        runtime=runtime, environment={"HOME": reploy.CONTAINER_HOME},
        labels=BASELINE_LABELS,
        mounts=(*reploy_serve.agent_mounts(bytecode_dir),
                reploy.Mount(str(session_dir), reploy_serve.SESSION_MOUNT, False)), init=True,
        root_supervisor=True)
    start = time.perf_counter()
    try:
        if disk:
            reploy_serve.make_session_disk(image, session_dir, disk_mib, runtime)
        container_id = backend.create(spec)
        try:
            backend.start(container_id)
            wait_until(lambda: _answers(session_dir / "agent"), "the baseline agent")
            return time.perf_counter() - start
        finally:
            backend.remove_container(container_id)
    finally:
        if disk:
            reploy_serve.remove_session_disk(image, session_dir)
        shutil.rmtree(directory, ignore_errors=True)


def _answers(agent_dir: Path) -> bool:
    try:
        reploy_serve.agent_call(agent_dir, "status", {})
        return True
    except reploy_serve.AgentCallError:
        return False


# --------------------------------------------------------------------------------------------
# Creates at once: a harness starting its samples
# --------------------------------------------------------------------------------------------

#: How many creates are sent at once, each on its own connection (serve_creates_at_once_N).
CREATE_BURSTS = (1, 8, 32, 64)
#: Each burst session's disk, and its baseline's: small, so the host's free space admits 64.
BURST_DISK_MIB = 64


def burst(count: int, create: Callable[[int], float]) -> tuple[float, list[float]]:
    """`count` calls of `create(index)` released at once: (wall time, each call's time), s."""
    start_line = threading.Barrier(count + 1)

    def timed(index: int) -> float:
        start_line.wait()
        return create(index)

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(timed, index) for index in range(count)]
        start_line.wait()
        start = time.perf_counter()
        samples = [future.result() for future in futures]
        return time.perf_counter() - start, samples


def create_bursts(workload: Path, base: Path) -> None:
    """serve_creates_at_once_N: N POST /sessions at once until each is answered 201, against N
    SDK creates at once of the same sandboxed container on the same kind of disk until its
    agent answers (sdk_create); per create and, as `_wall`, the whole burst. A serve of its
    own, so that the burst meets no session of the other figures."""
    server = ServeProcess(base / "bursts", workload, "--idle-after", "1h", "--snapshot-after", "2h",
                          "--max-sessions", str(max(CREATE_BURSTS)))
    try:
        for count in CREATE_BURSTS:
            def create(index: int) -> float:
                start = time.perf_counter()
                status, raw = server.api.raw("POST", "/api/v1/sessions", json.dumps(
                    {"name": f"burst-{index}", "diskMib": BURST_DISK_MIB}).encode(), timeout=600)
                if status != 201:
                    raise BenchFailed(f"a create of a burst of {count} answered {status}: {raw[:300]!r}")
                return time.perf_counter() - start

            wall, samples = burst(count, create)
            server.api.delete_all()
            sdk_wall, sdk_samples = burst(count, lambda _: sdk_create(workload, True, BURST_DISK_MIB))
            figure(f"serve_creates_at_once_{count}", "s", samples, sdk_samples)
            figure(f"serve_creates_at_once_{count}_wall", "s", [wall], [sdk_wall])
    finally:
        server.api.delete_all()
        server.stop()


# --------------------------------------------------------------------------------------------
# SSE delivery: readers of one session's output, on one selector thread
# --------------------------------------------------------------------------------------------

#: Concurrent SSE streams of one session for the fan-out figures (serve_sse_delivery_streams_N).
FANOUT_STREAMS = (1, 10, 50)
#: Bytes asked of one read on a socket, of the agent's log per long-poll.
READ_CHUNK_BYTES = 64 * 1024
#: How long the baseline's long-poll `read` waits in the agent: what serve's own streams ask.
LONG_POLL_MS = reploy_serve.SSE_LONG_POLL_MS
#: An SSE figure's writes come in this many blocks a side (`--rounds` writes each), alternating.
SSE_BLOCKS = 4


class BenchFailed(Exception):
    """A reader lost, reordered or never got bytes, or a session did not do what the bench needs."""


class LogReader:
    """Reads a session's output log from `start` on, through a non-blocking socket: keeps every
    byte in order and fails on a gap or an overlap. `ready` once its first answer came."""

    sock: socket.socket

    def __init__(self, offset: int) -> None:
        self.start = self.cursor = offset
        self.received = bytearray()
        self.ready = False

    def on_readable(self, selector: selectors.BaseSelector) -> None:
        raise NotImplementedError

    def _append(self, offset: int, payload: bytes, next_offset: int) -> None:
        if offset != self.cursor or next_offset != offset + len(payload):
            raise BenchFailed(f"bytes out of order: expected offset {self.cursor}, got "
                              f"{offset}..{next_offset} ({len(payload)} bytes)")
        self.received += payload
        self.cursor = next_offset

    def close(self) -> None:
        self.sock.close()


class SseReader(LogReader):
    """One `GET /sessions/{id}/stream?offset=` on a raw socket (so one selector serves them all);
    any event but `output` is a failure. It asks in HTTP/1.0, so the body is not chunked."""

    def __init__(self, api: Api, sid: str, offset: int) -> None:
        super().__init__(offset)
        self._pending = b""
        self._head_read = False
        self.sock = socket.create_connection((api.host, api.port), timeout=DEADLINE_S)
        head = [f"GET /api/v1/sessions/{sid}/stream?offset={offset} HTTP/1.0",
                f"Host: {api.host}:{api.port}",
                *(f"{name}: {value}" for name, value in api.auth_headers.items())]
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        self.sock.setblocking(False)

    def on_readable(self, selector: selectors.BaseSelector) -> None:
        data = self.sock.recv(READ_CHUNK_BYTES)
        if not data:
            raise BenchFailed(f"an SSE stream ended at offset {self.cursor}")
        self._pending += data
        if not self._head_read:  # the response's head; the stream's `: connected` makes it ready
            head, found, rest = self._pending.partition(b"\r\n\r\n")
            if not found:
                return
            if not head.startswith(b"HTTP/1.1 200 "):
                raise BenchFailed(f"the stream was refused: {head.splitlines()[0]!r}")
            self._pending, self._head_read = rest, True
        while b"\n\n" in self._pending:
            block, _, self._pending = self._pending.partition(b"\n\n")
            self._event(block)

    def _event(self, block: bytes) -> None:
        if block == b": connected":
            self.ready = True
            return
        fields = dict(line.decode().partition(": ")[::2] for line in block.split(b"\n")
                      if not line.startswith(b":"))
        if not fields:
            return  # a keepalive comment
        if fields.get("event") != "output":
            raise BenchFailed(f"an SSE stream got an event other than output at offset "
                              f"{self.cursor}: {block!r}")
        else:
            event = json.loads(fields["data"])
            self._append(event["offset"], base64.b64decode(event["payloadBase64"]), event["nextOffset"])


class AgentPoller(LogReader):
    """The baseline reader: long-poll `read` calls on the agent's control socket, one request
    per connection as the protocol has it, each from where the last one ended."""

    def __init__(self, session_dir: Path, offset: int) -> None:
        super().__init__(offset)
        self.ready = True
        self._dir_fd = os.open(session_dir, os.O_RDONLY | os.O_DIRECTORY)  # a short sun_path
        self._ask()

    def _ask(self) -> None:
        self._pending = b""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(f"/proc/self/fd/{self._dir_fd}/{reploy_serve.SOCKET_NAME}")
        self.sock.sendall(json.dumps({"id": "b", "method": "read", "params": {
            "offset": self.cursor, "max_bytes": READ_CHUNK_BYTES, "wait_ms": LONG_POLL_MS}}).encode()
            + b"\n")
        self.sock.setblocking(False)

    def on_readable(self, selector: selectors.BaseSelector) -> None:
        data = self.sock.recv(2 * READ_CHUNK_BYTES)
        if not data:
            raise BenchFailed(f"the agent closed a read at offset {self.cursor} without an answer")
        self._pending += data
        if not self._pending.endswith(b"\n"):
            return
        reply = json.loads(self._pending)
        if "error" in reply or reply["result"]["reset"]:
            raise BenchFailed(f"the agent's read at offset {self.cursor} failed: {reply}")
        result = reply["result"]
        self._append(result["offset"], base64.b64decode(result["data_b64"]), result["next_offset"])
        selector.unregister(self.sock)
        self.sock.close()
        self._ask()
        selector.register(self.sock, selectors.EVENT_READ, self)

    def close(self) -> None:
        self.sock.close()
        os.close(self._dir_fd)


class Fanout:
    """Readers of one session's output, read on one thread: `deliver` times one write until its
    marker has arrived whole on every reader; `check` fails loudly unless each reader got every
    byte of the log from where it started, in order. A reader's failure ends the thread and is
    raised by the next wait."""

    def __init__(self, readers: list[LogReader]) -> None:
        self.readers = readers
        self._selector = selectors.DefaultSelector()
        for reader in readers:
            self._selector.register(reader.sock, selectors.EVENT_READ, reader)
        self._changed = threading.Condition()
        self._needle = b""
        self._searched_from: dict[LogReader, int] = {}
        self._arrivals: dict[LogReader, float] = {}
        self._failure: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="fanout-reader")
        self._thread.start()

    def await_ready(self) -> None:
        self._await(lambda: all(reader.ready for reader in self.readers), "every stream to open")

    def _run(self) -> None:
        try:
            while not self._stopping:
                events = self._selector.select(0.1)
                arrived = time.perf_counter()  # the bytes were here when select returned
                with self._changed:
                    for key, _ in events:
                        reader = key.data
                        reader.on_readable(self._selector)
                        if (self._needle and reader not in self._arrivals
                                and reader.received.find(self._needle, self._searched_from[reader]) >= 0):
                            self._arrivals[reader] = arrived
                    self._changed.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the measuring thread
            with self._changed:
                self._failure = e
                self._changed.notify_all()

    def _await(self, condition: Callable[[], bool], what: str) -> None:
        with self._changed:
            done = self._changed.wait_for(lambda: self._failure is not None or condition(), DEADLINE_S)
            if self._failure is not None:
                raise BenchFailed(f"a reader failed while waiting for {what}") from self._failure
            if not done:
                raise BenchFailed(f"no {what} within {DEADLINE_S} s")

    def deliver(self, write: Callable[[bytes], None], index: int) -> list[float]:
        """Seconds from the start of `write(echo ...)` until the shell's echo of a fresh marker
        had arrived on each reader. The marker is quoted in the command, so the terminal's echo
        of the typed line never matches it: only the shell's output does."""
        tag = f"MK{index}"
        with self._changed:
            self._needle = f"{tag}Z\r\n".encode()
            self._searched_from = {reader: len(reader.received) for reader in self.readers}
            self._arrivals = {}
        start = time.perf_counter()
        write(f"echo {tag}''Z\r".encode())
        self._await(lambda: len(self._arrivals) == len(self.readers),
                    f"marker {tag} on all {len(self.readers)} readers")
        return [self._arrivals[reader] - start for reader in self.readers]

    def stop(self) -> None:
        self._stopping = True
        self._thread.join()
        self._selector.close()
        for reader in self.readers:
            reader.close()

    def check(self, log: Callable[[int], bytes]) -> None:
        """Every reader's bytes must be the log's (`log(offset)`: from there to its end) from
        where the reader started, in order, up to the last marker at least."""
        for number, reader in enumerate(self.readers):
            if not reader.received or reader.received != log(reader.start)[:len(reader.received)]:
                raise BenchFailed(f"reader {number} of {len(self.readers)} did not get the log's bytes "
                                  f"in order from offset {reader.start} ({len(reader.received)} bytes)")


class HopFollower(AgentPoller):
    """BareHop's follower: the baseline reader, whose every answer with bytes is also sent to
    each of `streams` as one `output` event of serve's encoder."""

    def __init__(self, session_dir: Path, offset: int, streams: list[socket.socket]) -> None:
        self._streams = streams
        super().__init__(session_dir, offset)

    def _append(self, offset: int, payload: bytes, next_offset: int) -> None:
        super()._append(offset, payload, next_offset)
        if payload:
            event = reploy_serve.sse_output(offset, payload)
            for stream in self._streams:
                stream.sendall(event)


class BareHop:
    """What serve's path costs any Python server at least: a bare HTTP hop written for the bench,
    on one selector thread, with nothing of serve's own: no access check, no store, no strict
    parse of the agent's answers, no thread hand-over. A `POST` is handed to `write` (the
    baseline's own write on the agent's socket) and answered 200; a `GET` is answered with an
    SSE head and kept; a HopFollower from `offset` pushes the output to every kept stream. A
    failure of its thread is raised by `close`."""

    def __init__(self, session_dir: Path, offset: int, write: Callable[[bytes], None]) -> None:
        self._write = write
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.api = Api(f"http://127.0.0.1:{self._listener.getsockname()[1]}", "bare-hop")
        self._streams: list[socket.socket] = []
        self._follower = HopFollower(session_dir, offset, self._streams)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._follower.sock, selectors.EVENT_READ, self._follower)
        self._requests: dict[socket.socket, bytearray] = {}
        self._failure: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="bare-hop")
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stopping:
                for key, _ in self._selector.select(0.1):
                    if key.data is self._follower:
                        self._follower.on_readable(self._selector)
                    elif key.fileobj is self._listener:
                        connection, _ = self._listener.accept()
                        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        self._requests[connection] = bytearray()
                        self._selector.register(connection, selectors.EVENT_READ, connection)
                    else:
                        self._receive(key.data)
        except BaseException as e:  # noqa: BLE001 - raised by close
            self._failure = e

    def _receive(self, connection: socket.socket) -> None:
        """A request's bytes; once it is whole, its answer."""
        data = connection.recv(READ_CHUNK_BYTES)
        pending = self._requests[connection]
        pending += data
        head, found, body = bytes(pending).partition(b"\r\n\r\n")
        if not data:
            raise BenchFailed("a client of the bare hop left mid-request")
        if not found:
            return
        fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:])
        if len(body) < int(fields.get(b"content-length", b"0")):
            return
        self._selector.unregister(connection)
        del self._requests[connection]
        connection.setblocking(True)
        if head.startswith(b"GET "):
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n: connected\n\n")
            self._streams.append(connection)
            return
        self._write(json.loads(body)["payload"].encode())
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
        connection.close()

    def close(self) -> None:
        self._stopping = True
        self._thread.join()
        self._selector.close()
        for connection in [*self._requests, *self._streams, self._listener]:
            connection.close()
        self._follower.close()
        if self._failure is not None:
            raise BenchFailed("the bare hop failed") from self._failure


_marker_numbers = itertools.count()


def timed_writes(fanout: Fanout, write: Callable[[bytes], None], rounds: int) -> list[float]:
    """`rounds` writes of a fresh marker each through `write`, ms until it arrived on each of
    the fan-out's readers (one sample per reader and write)."""
    return [seconds * 1000 for _ in range(rounds) for seconds in fanout.deliver(write, next(_marker_numbers))]


@contextlib.contextmanager
def opened(count: int, reader: Callable[[], LogReader], log: Callable[[int], bytes]) -> Iterator[Fanout]:
    """A Fanout over `count` freshly opened readers, once all are ready; on the way out they
    are closed, and checked against the log unless the block failed."""
    made: list[LogReader] = []
    try:
        for _ in range(count):
            made.append(reader())
    except BaseException:
        for opened_reader in made:
            opened_reader.close()
        raise
    fanout = Fanout(made)
    try:
        fanout.await_ready()
        yield fanout
    finally:
        fanout.stop()
    fanout.check(log)


def sse_delivery(api: Api, server: ServeProcess, sid: str, streams: int, blocks: int,
                 block_rounds: int, baseline_write: Callable[[bytes], None]) -> tuple[list[float], list[float]]:
    """Writes of `echo MARK` through the API, each timed until its marker arrived on every one
    of `streams` SSE streams of the session, in ms (one sample per stream and write); and as
    many through `baseline_write`, timed until the marker arrived on `streams` concurrent
    long-poll readers of the agent's control socket (the same fan-out, without serve). The two
    alternate in `blocks` blocks of `block_rounds` writes; between them serve has ended every
    stream (the store's viewer rows are gone), so neither side competes with the other."""
    session_dir = server.state_dir / "sessions" / sid / "agent"
    store = reploy_serve.SessionStore(server.state_dir / "sessions.db")
    api_write = functools.partial(api.write, sid)

    def log(offset: int) -> bytes:
        return api.read_all(sid, offset)

    def viewers() -> int:
        return store.viewer_count(sid, time.time())

    via_sse: list[float] = []
    via_agent: list[float] = []
    for _ in range(blocks):
        offset = reploy_serve.agent_call(session_dir, "status", {})["log_bytes"]
        with opened(streams, functools.partial(SseReader, api, sid, offset), log) as fanout:
            wait_until(lambda: viewers() == streams, f"{streams} viewers of session {sid}")
            via_sse += timed_writes(fanout, api_write, block_rounds)
        wait_until(lambda: viewers() == 0, f"serve to end session {sid}'s streams")
        offset = reploy_serve.agent_call(session_dir, "status", {})["log_bytes"]
        with opened(streams, functools.partial(AgentPoller, session_dir, offset), log) as fanout:
            via_agent += timed_writes(fanout, baseline_write, block_rounds)
    return via_sse, via_agent


def bare_hop_delivery(api: Api, server: ServeProcess, sid: str, blocks: int,
                      block_rounds: int) -> tuple[list[float], list[float]]:
    """serve_sse_delivery's writes and single stream through a BareHop instead of serve, ms,
    against the same baseline (the write and a long-poll `read` on the agent's socket), the two
    alternating in `blocks` blocks of `block_rounds` writes: what one HTTP hop in Python costs
    on this path before serve does anything of its own."""
    session_dir = server.state_dir / "sessions" / sid / "agent"
    write = agent_writer(server, sid)
    log = functools.partial(api.read_all, sid)
    via_hop: list[float] = []
    via_agent: list[float] = []
    for _ in range(blocks):
        offset = reploy_serve.agent_call(session_dir, "status", {})["log_bytes"]
        hop = BareHop(session_dir, offset, write)
        try:
            with opened(1, functools.partial(SseReader, hop.api, sid, offset), log) as fanout:
                via_hop += timed_writes(fanout, functools.partial(hop.api.write, sid), block_rounds)
        finally:
            hop.close()
        offset = reploy_serve.agent_call(session_dir, "status", {})["log_bytes"]
        with opened(1, functools.partial(AgentPoller, session_dir, offset), log) as fanout:
            via_agent += timed_writes(fanout, write, block_rounds)
    return via_hop, via_agent


def kept_alive_writes(api: Api, sid: str, rounds: int) -> tuple[list[float], list[float]]:
    """`POST /write` of one shell line through reploy_client (its kept-alive connections, as a
    program of the user's sends them), ms, and the same write on a new connection each (the
    bench's own client), alternating."""
    kept: list[float] = []
    fresh: list[float] = []
    with reploy_client.Client(api.url, token=api.auth_headers["Authorization"].removeprefix("Bearer "),
                              allow_plain_http=True) as client:
        session = client.session(sid)
        session.write(":\r")  # the connection is open before the first timing
        for _ in range(rounds):
            for samples, write in ((kept, lambda: session.write(":\r")), (fresh, lambda: api.write(sid, b":\r"))):
                start = time.perf_counter()
                write()
                samples.append((time.perf_counter() - start) * 1000)
    return kept, fresh


def agent_writer(server: ServeProcess, sid: str) -> Callable[[bytes], None]:
    """A write straight on the agent's control socket, no HTTP or serve in between."""
    session_dir = server.state_dir / "sessions" / sid / "agent"
    return lambda data: reploy_serve.agent_call(session_dir, "write", {"data_b64": base64.b64encode(data).decode()})


def main() -> int:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # clean up on the way out
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--only", choices=["serve_create_to_prompt", "serve_idle_memory", "sse", "files",
                                           "creates"],
                        help="measure this figure alone, the serve_sse_delivery figures with one "
                             "session created, the two file throughputs (after the creates the "
                             "others need), or the create bursts")
    args = parser.parse_args()
    rounds = args.rounds
    client = docker.from_env()
    base = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    workload = base / "workload"
    stage_and_build(ROOT / "examples/managed/managed.blueprint.yaml", workload)
    # The fan-out figures follow one session with up to 50 streams: past serve's default reader
    # bounds, which fair_share measures with a serve of its own.
    readers = str(max(FANOUT_STREAMS))
    server = ServeProcess(base / "state", workload, "--idle-after", "1h", "--snapshot-after", "2h",
                          "--max-session-readers", readers, "--max-readers", readers)
    api = server.api
    try:
        if args.only == "creates":
            create_bursts(workload, base)
            return 0
        creates, sdk_creates, diskless_creates, sessions = [], [], [], []
        for i in range(1 if args.only == "sse" else rounds):
            start = time.perf_counter()
            sid = api.create(f"bench-{i}")["id"]
            api.wait_output(sid, b"$ ")
            creates.append(time.perf_counter() - start)
            sessions.append(sid)
            if args.only not in ("sse", "files"):
                sdk_creates.append(sdk_create(workload, disk=True))
                diskless_creates.append(sdk_create(workload, disk=False))
        manager_view = reploy_serve.SessionStore(base / "state" / "sessions.db")
        container = client.containers.get(manager_view.get(sessions[0]).container_id)
        if args.only == "files":
            file_figures(api, sessions[0], container, base)
            return 0
        if args.only != "sse":
            figure("serve_create_to_prompt", "s", creates, sdk_creates)
            figure("serve_create_to_prompt_vs_diskless", "s", creates, diskless_creates)
        if args.only == "serve_idle_memory":
            floor = idle_python_memory(client, workload, rounds)
            figure("serve_idle_memory", "MiB", idle_rounds(client, api, base / "state", sessions)[1], floor)
            figure("serve_idle_memory_after_a_file_operation", "MiB",
                   idle_rounds(client, api, base / "state", sessions, file_operation=True)[1], floor)
        if args.only in ("serve_create_to_prompt", "serve_idle_memory"):
            return 0
        figure("serve_sse_delivery", "ms", *sse_delivery(api, server, sessions[0], 1, SSE_BLOCKS, rounds,
                                                          agent_writer(server, sessions[0])))
        figure("serve_sse_delivery_bare_hop", "ms", *bare_hop_delivery(api, server, sessions[0], SSE_BLOCKS, rounds))
        figure("serve_write_kept_alive", "ms", *kept_alive_writes(api, sessions[0], rounds * SSE_BLOCKS))
        for streams in FANOUT_STREAMS:
            figure(f"serve_sse_delivery_streams_{streams}", "ms",
                   *sse_delivery(api, server, sessions[0], streams, SSE_BLOCKS, rounds,
                                 functools.partial(api.write, sessions[0])))
        if args.only == "sse":
            return 0
        exec_times, sdk_exec_times = exec_round_trips(api, sessions[0], container, rounds * 4)
        figure("serve_exec_true", "ms", exec_times, sdk_exec_times)
        fair_share(client, workload, base / "fair-share", rounds * 4)
        file_figures(api, sessions[0], container, base)
        resumes, memory = idle_rounds(client, api, base / "state", sessions)
        figure("serve_idle_to_active", "s", resumes)
        figure("serve_idle_memory", "MiB", memory, idle_python_memory(client, workload, rounds))
        restores = []
        for sid in sessions:
            api.call("POST", f"/sessions/{sid}/snapshot", {})
            start = time.perf_counter()
            read_once(api, sid)
            restores.append(time.perf_counter() - start)
        figure("serve_snapshot_to_active", "s", restores)
        bare_running, bare_paused = bare_shell_memory(client, workload, MEMORY_SESSIONS)
        active, idle = session_memory(client, api, server, MEMORY_SESSIONS)
        figure(f"serve_memory_per_active_session_{MEMORY_SESSIONS}", "MiB", active, bare_running)
        figure(f"serve_memory_per_idle_session_{MEMORY_SESSIONS}", "MiB", idle, bare_paused)
        api.delete_all()
        create_bursts(workload, base)
    except BenchFailed as e:
        print(f"bench_serve: FAILED: {e}" + (f" ({e.__cause__!r})" if e.__cause__ else ""),
              file=sys.stderr, flush=True)
        return 1
    finally:
        api.delete_all()
        server.stop()
        left = sweep(client, server.state_dir)
        remove_built_images(client, staged_deployment_ids(base))  # staged anew each run: never reused
        shutil.rmtree(base, ignore_errors=True)
    if left:
        print(f"bench_serve: FAILED: left behind and now removed: {left}", file=sys.stderr, flush=True)
        return 1
    return 0


def idle_rounds(client: docker.DockerClient, api: Api, state_dir: Path, sessions: list[str],
                file_operation: bool = False) -> tuple[list[float], list[float]]:
    """Each session paused directly (what the reaper does): its container's memory (cgroup
    usage, MiB) and, on stderr, what each of its processes holds; then the time of the access
    that resumes it. (resume seconds, MiB) per session. With `file_operation`, each session
    first serves one (a stat of a missing file: it starts the file workers' zygote), and is
    paused once its zygote ended after its linger, as it has long before serve's --idle-after."""
    store = reploy_serve.SessionStore(state_dir / "sessions.db")
    resumes, memory = [], []
    containers = {sid: store.get(sid).container_id for sid in sessions}
    if file_operation:
        for sid in sessions:
            if api.raw("GET", f"/api/v1/sessions/{sid}/files/missing")[0] != 404:
                raise BenchFailed(f"session {sid}: a missing file was not a 404")
        for container_id in containers.values():
            wait_until(lambda: not any("zygote" in command for _, command in
                                       client.api.top(container_id, ps_args="-o pid,args")["Processes"] or []),
                       "the file workers' zygote to end after its linger",
                       timeout_s=reploy_serve.agent_role.DEFAULT_FILE_WORKER_LINGER_S + 30)
    for sid, container_id in containers.items():
        assert container_id is not None
        wait_until(lambda: api.call("GET", f"/sessions/{sid}/status")["agent"]["turnState"] == "idle",
                   "a quiet shell")
        _force_idle(state_dir, sid)
        memory.append(client.api.stats(container_id, stream=False)["memory_stats"]["usage"] / MIB)
        print(f"bench_serve: idle session {sid}: {process_breakdown(client, container_id)}",
              file=sys.stderr, flush=True)
        start = time.perf_counter()
        read_once(api, sid)
        resumes.append(time.perf_counter() - start)
    return resumes, memory


def process_breakdown(client: docker.DockerClient, container_id: str) -> str:
    """Each process of a container: its command, threads, the CPU time it has used (an idle
    session's: nearly all of it at its start), and from /proc/PID/smaps_rollup its proportional
    set (Pss) and the anonymous memory of it (heap and stacks: what it made)."""
    parts = []
    for pid, command in client.api.top(container_id, ps_args="-o pid,args")["Processes"] or []:
        with contextlib.suppress(OSError):  # gone in between
            rollup = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
            threads = next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                           if line.startswith("Threads:"))
            ticks = sum(map(int, Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13]))
            parts.append(f"[{command[:48]}] {threads} thread(s) cpu {ticks * 1000 // os.sysconf('SC_CLK_TCK')} ms "
                         f"Pss {int(rollup['Pss'].split()[0]) / 1024:.2f} "
                         f"anon {int(rollup['Anonymous'].split()[0]) / 1024:.2f} MiB")
    return "; ".join(parts)


def idle_python_memory(client: docker.DockerClient, workload: Path, count: int) -> list[float]:
    """The floor of serve_idle_memory: `count` containers of the same image and sandbox flags
    running only a bare `python3 -I -S` that sleeps, each paused; MiB (cgroup usage) each, as
    serve_idle_memory counts. Every container is removed at the end."""
    deployment = reploy.load_deployment(workload)
    backend = reploy.DockerBackend()
    spec = reploy.ContainerSpec(role="bench", image_id=deployment.current.image_id,
                                command=("python3", "-I", "-S", "-c", "import signal; print('up', flush=True); signal.pause()"),
                                runtime=deployment.blueprint.runtime, environment={},
                                labels=BASELINE_LABELS, init=True)
    samples = []
    for _ in range(count):
        container_id = backend.create(spec)
        try:
            backend.start(container_id)
            wait_until(lambda: bool(backend.log_tail(container_id)), "a bare python3")
            backend.pause(container_id)
            samples.append(client.api.stats(container_id, stream=False)["memory_stats"]["usage"] / MIB)
            print(f"bench_serve: idle python3 -I -S: {process_breakdown(client, container_id)}",
                  file=sys.stderr, flush=True)
        finally:
            backend.unpause(container_id)
            backend.remove_container(container_id)
    return samples


def sweep(client: docker.DockerClient, state_dir: Path) -> list[str]:
    """Remove whatever this run's sessions or baselines left, and name it: there should be
    nothing, since serve and the baselines remove their own containers."""
    left = []
    for labels in (BASELINE_LABELS, {reploy_serve.LABEL_STATE_DIR: str(state_dir)}):
        for container in client.containers.list(
                all=True, filters={"label": [f"{key}={value}" for key, value in labels.items()]}):
            left.append(f"container {container.short_id} {container.labels}")
            container.remove(force=True)
    return left


TRANSFER_BYTES = 64 * 1024 * 1024
TRANSFER_ROUNDS = 3
#: Where the SDK baseline puts its copy: the bind-mounted workspace (the container's root is read-only).
SDK_DIR = "/mnt/reploy-session/workspace"


def exec_round_trips(api: Api, sid: str, container: docker.models.containers.Container,
                     rounds: int) -> tuple[list[float], list[float]]:
    """`true` through POST /exec and through the SDK's exec_run, alternating, in milliseconds."""
    ours, sdk = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        assert api.call("POST", f"/sessions/{sid}/exec", {"argv": ["true"]})["exitCode"] == 0
        ours.append((time.perf_counter() - start) * 1000)
        start = time.perf_counter()
        assert container.exec_run(["true"]).exit_code == 0
        sdk.append((time.perf_counter() - start) * 1000)
    return ours, sdk


FAIR_SHARE_BURNERS = 4
FAIR_SHARE_READERS = 60


def exec_times(api: Api, sid: str, rounds: int) -> list[float]:
    """`true` through POST /exec, in milliseconds."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        assert api.call("POST", f"/sessions/{sid}/exec", {"argv": ["true"]})["exitCode"] == 0
        times.append((time.perf_counter() - start) * 1000)
    return times


def raw_stream(api: Api, sid: str) -> socket.socket | None:
    """An SSE reader that takes what comes and parses nothing; None when serve refused it (503)."""
    sock = socket.create_connection((api.host, api.port), timeout=DEADLINE_S)
    headers = "".join(f"{name}: {value}\r\n" for name, value in api.auth_headers.items())
    sock.sendall(f"GET /api/v1/sessions/{sid}/stream HTTP/1.1\r\nHost: {api.host}:{api.port}\r\n"
                 f"{headers}\r\n".encode())
    head = sock.recv(65536)
    if not head.startswith(b"HTTP/1.1 200"):
        if not head.startswith(b"HTTP/1.1 503"):
            raise BenchFailed(f"a stream answered {head[:40]!r}")
        sock.close()
        return None
    return sock


def fair_share(client: docker.DockerClient, workload: Path, state_dir: Path, rounds: int) -> None:
    """With a serve of serve's defaults and two sessions: the other session's exec while the busy
    one burns every core, and while 60 readers follow it printing without pause, each against
    the idle machine measured first."""
    server = ServeProcess(state_dir, workload, "--idle-after", "1h", "--snapshot-after", "2h")
    try:
        busy, other = (server.api.create(f"fair-{name}")["id"] for name in ("busy", "other"))
        server.api.wait_output(busy, b"$ ")
        contend(server.api, busy, other, rounds)
    finally:
        server.api.delete_all()
        server.stop()
        left = sweep(client, state_dir)
    if left:
        raise BenchFailed(f"fair share: left behind and now removed: {left}")


def contend(api: Api, busy: str, other: str, rounds: int) -> None:
    """fair_share's two figures, on `api`'s sessions."""
    idle = exec_times(api, other, rounds)
    api.write(busy, f"burners=; for i in $(seq {FAIR_SHARE_BURNERS}); do sh -c 'while :; do :; done' & "
                    "burners=\"$burners $!\"; done; echo BURN''ING\r".encode())
    api.wait_output(busy, b"BURNING")
    figure("serve_exec_while_a_session_burns_cores", "ms", exec_times(api, other, rounds), idle)
    api.write(busy, b"kill $burners; wait; echo STOP''PED\r")
    api.wait_output(busy, b"STOPPED")
    api.write(busy, b"while :; do echo tick; done\r")
    readers = [raw_stream(api, busy) for _ in range(FAIR_SHARE_READERS)]
    admitted = [sock for sock in readers if sock is not None]
    stop = threading.Event()

    def drain(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set() and sock.recv(1 << 16):
                pass
    threads = [threading.Thread(target=drain, args=(sock,), daemon=True) for sock in admitted]
    for thread in threads:
        thread.start()
    try:
        print(f"bench_serve: {len(admitted)} of {FAIR_SHARE_READERS} readers admitted, the rest refused (503)",
              file=sys.stderr, flush=True)
        figure(f"serve_exec_while_{FAIR_SHARE_READERS}_readers_follow", "ms", exec_times(api, other, rounds), idle)
    finally:
        stop.set()
        for sock in admitted:
            sock.close()
        for thread in threads:
            thread.join()
        api.write(busy, b"\x03")


def transfer_rates(api: Api, sid: str, container: docker.models.containers.Container,
                   base: Path) -> tuple[list[float], list[float], list[float], list[float]]:
    """MiB/s of PUT and GET /files of one 64 MiB file, and of put_archive and get_archive of it."""
    source = base / "transfer.bin"
    source.write_bytes(os.urandom(TRANSFER_BYTES))
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        tar.add(source, arcname="sdk.bin")
    tar_bytes = archive.getvalue()
    mib = TRANSFER_BYTES / (1024 * 1024)
    uploads, sdk_uploads, downloads, sdk_downloads = [], [], [], []
    for _ in range(TRANSFER_ROUNDS):
        conn = http.client.HTTPConnection(api.host, api.port, timeout=300, blocksize=1 << 20)
        with open(source, "rb") as body:
            start = time.perf_counter()
            conn.request("PUT", f"/api/v1/sessions/{sid}/files/bench.bin", body=body,
                         headers={**api.auth_headers, "Content-Type": "application/octet-stream",
                                  "Content-Length": str(TRANSFER_BYTES)})
            response = conn.getresponse()
            response.read()
            uploads.append(mib / (time.perf_counter() - start))
        assert response.status == 201, response.status
        start = time.perf_counter()
        conn.request("GET", f"/api/v1/sessions/{sid}/files/bench.bin", headers=api.auth_headers)
        response = conn.getresponse()
        received = 0
        while chunk := response.read(1 << 20):
            received += len(chunk)
        downloads.append(mib / (time.perf_counter() - start))
        conn.close()
        assert received == TRANSFER_BYTES
        start = time.perf_counter()
        assert container.put_archive(SDK_DIR, tar_bytes)
        sdk_uploads.append(mib / (time.perf_counter() - start))
        start = time.perf_counter()
        stream, _ = container.get_archive(f"{SDK_DIR}/sdk.bin")
        received = sum(len(chunk) for chunk in stream)
        sdk_downloads.append(mib / (time.perf_counter() - start))
        assert received >= TRANSFER_BYTES
    return uploads, sdk_uploads, downloads, sdk_downloads


def file_figures(api: Api, sid: str, container: docker.models.containers.Container, base: Path) -> None:
    uploads, sdk_uploads, downloads, sdk_downloads = transfer_rates(api, sid, container, base)
    figure("serve_upload_throughput", "MiB/s", uploads, sdk_uploads)
    figure("serve_download_throughput", "MiB/s", downloads, sdk_downloads)


# --------------------------------------------------------------------------------------------
# Memory per session: shell sessions against bare shells under the same sandbox flags
# --------------------------------------------------------------------------------------------

#: Sessions live at once for serve_memory_per_{active,idle}_session_N.
MEMORY_SESSIONS = 20


def containers_mib(client: docker.DockerClient, container_ids: list[str]) -> list[float]:
    """What `docker stats` shows for each container: its cgroup's memory usage less the
    inactive (reclaimable) file cache, in MiB; paused containers answer too. Asked concurrently
    (as many at once as the SDK keeps connections): the Engine answers each at its next
    once-a-second sample."""

    def mib(container_id: str) -> float:
        memory = client.api.stats(container_id, stream=False, one_shot=True)["memory_stats"]
        stats = memory.get("stats", {})
        return (memory["usage"] - stats.get("total_inactive_file", stats.get("inactive_file", 0))) / MIB

    with concurrent.futures.ThreadPoolExecutor(docker.constants.DEFAULT_MAX_POOL_SIZE) as pool:
        return list(pool.map(mib, container_ids))


def session_memory(client: docker.DockerClient, api: Api, server: ServeProcess,
                   count: int) -> tuple[list[float], list[float]]:
    """MiB per session, for `count` shell sessions created through the API: each session's
    container (containers_mib) plus serve's RSS growth since before they existed divided by
    `count`; first while all are active (containers running, shells at their prompt), then once
    all are idle (paused by the reaper's step). The sessions are deleted at the end."""
    serve = psutil.Process(server.proc.pid)
    rss_before = serve.memory_info().rss
    store = reploy_serve.SessionStore(server.state_dir / "sessions.db")
    sids: list[str] = []

    def per_session(what: str) -> list[float]:
        growth_mib = (serve.memory_info().rss - rss_before) / MIB
        print(f"bench_serve: {count} {what} sessions: serve's RSS grew {growth_mib:.1f} MiB",
              file=sys.stderr, flush=True)
        return [mib + growth_mib / count
                for mib in containers_mib(client, [store.get(sid).container_id for sid in sids])]

    try:
        for i in range(count):
            sids.append(api.create(f"memory-{i}")["id"])
        for sid in sids:
            api.wait_output(sid, b"$ ")
        active = per_session("active")
        for sid in sids:
            _force_idle(server.state_dir, sid)
            if store.get(sid).state is not reploy_serve.SessionState.IDLE:
                raise BenchFailed(f"session {sid} is {store.get(sid).state.value}, not idle, after the pause")
        idle = per_session("idle")
    finally:
        for sid in sids:
            api.call("DELETE", f"/sessions/{sid}", expect=204)
    return active, idle


def bare_shell_memory(client: docker.DockerClient, workload: Path, count: int) -> tuple[list[float], list[float]]:
    """The baseline: `count` containers of the same image under the same sandbox flags
    (reploy.ContainerSpec, the session's init, user and limits), each running only the shell on a
    TTY, as `docker run -it IMAGE /bin/sh` would; MiB per container while running, then paused.
    Every container is removed at the end."""
    deployment = reploy.load_deployment(workload)
    backend = reploy.DockerBackend()
    spec = reploy.ContainerSpec(role="bench", image_id=deployment.current.image_id, command=("/bin/sh",),
                                runtime=deployment.blueprint.runtime,
                                environment={"HOME": reploy.CONTAINER_HOME, "LANG": "C.UTF-8"},
                                labels=BASELINE_LABELS, tty=True, hostname="session", init=True)
    containers: list[str] = []

    def shell_runs(container_id: str) -> bool:
        processes = client.api.top(container_id)
        command = processes["Titles"].index("CMD")
        return any(row[command] == "/bin/sh" for row in processes["Processes"] or [])

    try:
        for _ in range(count):
            containers.append(backend.create(spec))
            backend.start(containers[-1])
        for container_id in containers:
            wait_until(functools.partial(shell_runs, container_id), "a baseline shell")
        running = containers_mib(client, containers)
        for container_id in containers:
            backend.pause(container_id)
        paused = containers_mib(client, containers)
    finally:
        for container_id in containers:
            backend.unpause(container_id)
            backend.remove_container(container_id)
    return running, paused


def _force_idle(state_dir: Path, sid: str) -> None:
    """The reaper's idle step, run now: a SessionManager on the same state dir (the store's
    leases keep it from clashing with the running serve)."""
    manager = reploy_serve.SessionManager(reploy_serve.ServeConfig(state_dir=state_dir, workload_dirs=()),
                                    reploy.DockerBackend())
    try:
        with manager.leased(sid) as lease:  # paused with the facts the reaper would record
            manager._pause(lease, manager._reap_decision(lease.record))
    finally:
        manager.close()


if __name__ == "__main__":
    sys.exit(main())
