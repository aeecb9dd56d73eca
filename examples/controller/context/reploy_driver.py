"""A small driver for Reploy controllers: the robust sequence of seed 000, as a library.

It starts `reploy-session-client client`, reads broker-ready, starts one `attach` (over pipes or
under a PTY), and then lets the controller type into the workload's shell, wait for output,
send structured requests and finish the session correctly:

    with SessionDriver(attach="pipe") as session:
        session.start()                       # broker-ready, attach, opened, ready
        session.type("echo hi\\n")
        session.expect(rb"hi\\r?\\n")
        session.type("exit 0\\n")
        outcome = session.finish()            # drain, complete, terminated, acknowledge

Terminal output is untrusted workload data: it is only ever matched against, never parsed for
lifecycle facts, which come from the structured stream alone. Stdlib only.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import queue
import re
import struct
import subprocess
import termios
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

SCHEMA = "reploy-controlled-session-client-v1"
CLIENT = "reploy-session-client"


class SessionFailed(Exception):
    """The session did not go as the controller expected."""


def wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """The process's exit code, as soon as it exits. (Popen.wait with a timeout polls, with
    sleeps growing to 50 ms, so it can hear of an exit that late; a thread blocked in waitpid
    hears of it at once.)"""
    waiter = threading.Thread(target=proc.wait, daemon=True)
    waiter.start()
    waiter.join(timeout_s)
    if waiter.is_alive():
        raise subprocess.TimeoutExpired(proc.args, timeout_s)
    return proc.returncode


@dataclass
class Outcome:
    events: list[dict[str, Any]]  # every structured event, in order
    terminated: Optional[dict[str, Any]]  # the authoritative result
    client_exit: int
    attach_exit: int
    transcript: bytes  # every terminal byte the attachment delivered


class SessionDriver:
    def __init__(self, attach: str = "pipe", columns: int = 80, rows: int = 24,
                 timeout_s: float = 60.0,
                 wrap_attach: Optional[Callable[[list[str]], list[str]]] = None) -> None:
        """`wrap_attach` turns the attach argv into the command to run (pipe mode), e.g. to
        run it inside a recorder under a PTY wrapper."""
        if attach not in ("pipe", "pty"):
            raise ValueError("attach is 'pipe' or 'pty'")
        self.attach_mode = attach
        self.wrap_attach = wrap_attach
        self.columns, self.rows = columns, rows
        self.timeout_s = timeout_s
        self.events: list[dict[str, Any]] = []
        self._event_queue: "queue.Queue[Optional[dict[str, Any]]]" = queue.Queue()
        self._output = bytearray()
        self._output_cond = threading.Condition()
        self._output_closed = False
        self._scan_from = 0
        self._commands = 0
        self.client: Optional[subprocess.Popen[bytes]] = None
        self.attach: Optional[subprocess.Popen[bytes]] = None
        self._terminal_fd: Optional[int] = None  # where we type: pipe or PTY master

    # -- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> "SessionDriver":
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in (self.attach, self.client):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        if self._terminal_fd is not None:
            try:
                os.close(self._terminal_fd)
            except OSError:
                pass

    def start(self) -> dict[str, Any]:
        """Run the start of the sequence; returns the `opened` event."""
        self.client = subprocess.Popen([CLIENT, "client"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE)
        threading.Thread(target=self._read_events, daemon=True).start()
        ready = self.next_event("broker-ready")
        self._start_attach(ready["terminal_socket"])
        opened = self.next_event("opened")
        self.next_event("ready")
        return opened

    def _start_attach(self, socket_path: str) -> None:
        argv = [CLIENT, "attach", "--socket", socket_path]
        if self.wrap_attach is not None:
            argv = self.wrap_attach(argv)
        if self.attach_mode == "pipe":
            self.attach = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert self.attach.stdin is not None and self.attach.stdout is not None
            self._terminal_fd = os.dup(self.attach.stdin.fileno())
            self.attach.stdin.close()
            reader = self.attach.stdout.fileno()
        else:
            master, slave = pty.openpty()
            self.set_pty_size(master, self.columns, self.rows)
            self.attach = subprocess.Popen(
                argv, stdin=slave, stdout=slave, stderr=None, start_new_session=True,
                preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
            os.close(slave)
            self._terminal_fd = master
            reader = master
        threading.Thread(target=self._read_output, args=(reader,), daemon=True).start()

    @staticmethod
    def set_pty_size(fd: int, columns: int, rows: int) -> None:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))

    def resize_local_terminal(self, columns: int, rows: int) -> None:
        """PTY attach only: change our terminal's size; attach forwards it on SIGWINCH."""
        assert self.attach_mode == "pty" and self._terminal_fd is not None
        self.set_pty_size(self._terminal_fd, columns, rows)

    @staticmethod
    def granted_endpoint(opened: dict[str, Any], endpoint_id: str) -> dict[str, Any]:
        """The coordinates `opened` grants for an endpoint id, or a clear failure."""
        for endpoint in opened["endpoints"]:
            if endpoint["id"] == endpoint_id:
                return endpoint
        raise SessionFailed(f"the session grants no {endpoint_id!r} endpoint "
                            f"(run it with --endpoint {endpoint_id})")

    # -- the structured stream -----------------------------------------------------------

    def _read_events(self) -> None:
        assert self.client is not None and self.client.stdout is not None
        for line in self.client.stdout:
            event = json.loads(line)
            self._event_queue.put(event)
        self._event_queue.put(None)

    def next_event(self, expected_type: Optional[str] = None) -> dict[str, Any]:
        """The next structured event; fails if it is not the expected type."""
        try:
            event = self._event_queue.get(timeout=self.timeout_s)
        except queue.Empty:
            raise SessionFailed(f"no event within {self.timeout_s} s "
                                f"(waiting for {expected_type})") from None
        if event is None:
            raise SessionFailed(f"the broker closed its stream (waiting for {expected_type})")
        self.events.append(event)
        if event.get("type") == "client-error":
            raise SessionFailed(f"client-error: {event.get('code')}: {event.get('message')}")
        if expected_type is not None and event.get("type") != expected_type:
            if event.get("type") == "diagnostic":
                return self.next_event(expected_type)
            raise SessionFailed(f"expected {expected_type}, got {event}")
        return event

    def drain_events(self) -> list[dict[str, Any]]:
        """Every event left until the broker closes its stream, without judging them."""
        while True:
            try:
                event = self._event_queue.get(timeout=self.timeout_s)
            except queue.Empty:
                raise SessionFailed("the broker never closed its stream") from None
            if event is None:
                return self.events
            self.events.append(event)

    def send(self, request_type: str, **fields: Any) -> None:
        assert self.client is not None and self.client.stdin is not None
        line = json.dumps({"schema": SCHEMA, "type": request_type, **fields},
                          separators=(",", ":"))
        self.client.stdin.write(line.encode() + b"\n")
        self.client.stdin.flush()

    # -- the terminal --------------------------------------------------------------------

    def _read_output(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            with self._output_cond:
                if not data:
                    self._output_closed = True
                    self._output_cond.notify_all()
                    return
                self._output += data
                self._output_cond.notify_all()

    def type(self, text: str | bytes) -> None:
        data = text.encode() if isinstance(text, str) else text
        assert self._terminal_fd is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self._terminal_fd, view):]

    def expect(self, pattern: bytes, timeout_s: Optional[float] = None) -> re.Match[bytes]:
        """Wait until terminal output after the last match contains the regex."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        with self._output_cond:
            while True:
                match = regex.search(self._output, self._scan_from)
                if match:
                    self._scan_from = match.end()
                    return match
                remaining = deadline - time.monotonic()
                if self._output_closed or remaining <= 0:
                    tail = bytes(self._output[-400:])
                    why = ("the attachment's output ended" if self._output_closed
                           else f"not within {timeout_s or self.timeout_s:g} s")
                    raise SessionFailed(f"terminal output never matched {pattern!r} ({why}); "
                                        f"last bytes: {tail!r}")
                self._output_cond.wait(remaining)

    def run(self, command: str, timeout_s: Optional[float] = None) -> tuple[int, bytes]:
        """Type a shell command and wait for it to finish; returns (exit status, output).

        The end marker is computed by the shell ($?), so the echo of what we typed can never
        match it: only the command's real completion does.
        """
        self._commands += 1
        tag = f"@@reploy-done-{self._commands}"
        self.type(f"{command}; echo \"{tag}-$?@@\"\n")
        start = self._scan_from
        match = self.expect(re.escape(tag.encode()) + rb"-(\d+)@@", timeout_s)
        with self._output_cond:
            output = bytes(self._output[start:match.start()])
        return int(match.group(1)), output

    @property
    def transcript(self) -> bytes:
        with self._output_cond:
            return bytes(self._output)

    # -- the end -------------------------------------------------------------------------

    def close_if_never_ready(self) -> bool:
        """After a failure: if the session never became ready there is nothing to end. A
        startup-failure `terminated` is acknowledged (that branch takes no `complete`).
        True when the caller should stop here."""
        if "ready" in {event["type"] for event in self.events}:
            return False
        if self.events and self.events[-1]["type"] == "terminated":
            self.send("acknowledge-terminated")
            self.drain_events()
        return True

    def finish(self) -> Outcome:
        """Steps 4-7 of the robust sequence: drain, complete, terminated, acknowledge."""
        assert self.client is not None and self.attach is not None
        terminated = None
        seen = {e["type"] for e in self.events}
        while not {"terminating", "workload-outputs-finalized"} <= seen:
            event = self.next_event()
            seen.add(event["type"])
            if event["type"] == "terminated":  # the startup-failure branch: no complete
                terminated = event
                break
        attach_exit = wait_exit(self.attach, self.timeout_s)
        with self._output_cond:
            self._output_cond.wait_for(lambda: self._output_closed, timeout=self.timeout_s)
        if terminated is None:
            self.send("complete")
            terminated = self.next_event("terminated")  # the seed: nothing comes in between
        self.send("acknowledge-terminated")
        assert self.client.stdin is not None
        client_exit = wait_exit(self.client, self.timeout_s)
        return Outcome(list(self.events), terminated, client_exit, attach_exit, self.transcript)
