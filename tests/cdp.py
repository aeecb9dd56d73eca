"""Headless Chromium driven over the DevTools protocol with the stdlib: a minimal websocket
client (RFC 6455: masked text frames out, fragmented frames in, ping/pong) and a page API
(navigate, evaluate, wait_for, type, key, screenshot). Enough for the web UI tests, no npm.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1280,800", "--remote-debugging-port=0")


def find_chromium() -> Optional[str]:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class WebSocket:
    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        match = re.match(r"ws://([^/:]+):(\d+)(/.*)", url)
        assert match, url
        host, port, path = match.group(1), int(match.group(2)), match.group(3)
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                           "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        self.buffer = b""
        while b"\r\n\r\n" not in self.buffer:
            chunk = self.sock.recv(4096)
            assert chunk, "websocket handshake: connection closed"
            self.buffer += chunk
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 101"), head

    def _exact(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("websocket closed")
            self.buffer += chunk
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def _send_frame(self, opcode: int, payload: bytes) -> None:
        header = bytes([0x80 | opcode])
        n = len(payload)
        if n < 126:
            header += bytes([0x80 | n])
        elif n < 1 << 16:
            header += bytes([0x80 | 126]) + struct.pack("!H", n)
        else:
            header += bytes([0x80 | 127]) + struct.pack("!Q", n)
        mask = os.urandom(4)
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def send(self, text: str) -> None:
        self._send_frame(0x1, text.encode())

    def recv(self) -> str:
        message = b""
        while True:
            first, second = self._exact(2)
            n = second & 0x7F
            if n == 126:
                n = struct.unpack("!H", self._exact(2))[0]
            elif n == 127:
                n = struct.unpack("!Q", self._exact(8))[0]
            mask = self._exact(4) if second & 0x80 else None
            payload = self._exact(n)
            if mask:
                payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
            opcode = first & 0x0F
            if opcode == 0x9:
                self._send_frame(0xA, payload)
                continue
            if opcode == 0x8:
                raise ConnectionError("websocket closed by the browser")
            if opcode in (0x0, 0x1, 0x2):
                message += payload
                if first & 0x80:
                    return message.decode()

    def close(self) -> None:
        self.sock.close()


class Browser:
    """One headless Chromium with one page. close() ends the process and removes its profile.
    Protocol events that arrive while a call waits for its answer are kept in `events`."""

    def __init__(self, executable: str, *extra_flags: str) -> None:
        self.profile = Path(tempfile.mkdtemp(prefix="reploy-chromium-"))
        self.events: list[dict[str, Any]] = []
        self.proc = subprocess.Popen([executable, *CHROMIUM_FLAGS, *extra_flags,
                                      f"--user-data-dir={self.profile}",
                                      "about:blank"], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True)
        self.ids = itertools.count(1)
        self.ws: Optional[WebSocket] = None
        try:
            port = self._devtools_port()
            deadline = time.monotonic() + 30
            while True:
                pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
                page = next((p for p in pages if p.get("type") == "page"), None)
                if page or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert page, "chromium opened no page"
            self.ws = WebSocket(page["webSocketDebuggerUrl"])
            self.call("Page.enable")
            self.call("Runtime.enable")
        except BaseException:
            self.close()
            raise

    def _devtools_port(self) -> int:
        assert self.proc.stderr is not None
        found: list[int] = []
        done = threading.Event()

        def scan() -> None:
            for line in self.proc.stderr:  # type: ignore[union-attr]
                match = re.search(rb"DevTools listening on ws://[^:]+:(\d+)/", line)
                if match and not found:
                    found.append(int(match.group(1)))
                    done.set()
            done.set()

        threading.Thread(target=scan, daemon=True).start()  # also keeps draining stderr
        done.wait(timeout=30)
        assert found, "chromium did not report its DevTools port"
        return found[0]

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        assert self.ws is not None
        request_id = next(self.ids)
        self.ws.send(json.dumps({"id": request_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == request_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            if "method" in message:
                self.events.append(message)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout_s: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what} ({expression})")
            time.sleep(0.05)

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def type(self, text: str) -> None:
        """Text into the focused element, as an input method would."""
        self.call("Input.insertText", text=text)

    def key(self, key: str, code: str, key_code: int, text: str = "") -> None:
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=key, code=code,
                      windowsVirtualKeyCode=key_code, text=text if kind == "keyDown" else "")

    def enter(self) -> None:
        self.key("Enter", "Enter", 13, "\r")

    def screenshot(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
            self.ws = None
        if self.proc.poll() is None:  # the whole group: renderers and helpers too
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        shutil.rmtree(self.profile, ignore_errors=True)
