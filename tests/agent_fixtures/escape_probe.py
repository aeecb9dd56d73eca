"""What a hostile workload tries against its own session's agent (tests/test_serve_boundary.py).

Run inside a managed session as its runtime user (through the shell or through exec), it tries
each move a workload could make on the agent and its private dir, and prints one line:
`PROBE-RESULT {json}` (also written to WORKSPACE/.probe-result.json), where every attempt maps to
"ok" (it worked) or the errno name the kernel answered. Every move that works is one the boundary
should have refused; the last ones signal the agent, so where they work the agent is gone.

    python3 escape_probe.py [SESSION_DIR [AGENT_DIR [AGENT_PID]]]

SESSION_DIR is /mnt/reploy-session by default, AGENT_DIR its agent/ (before issue 21 the agent's
files lay in the session dir itself: give that as AGENT_DIR too); AGENT_PID is found by its
command line unless given (on a host running several agents, give it).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import socket
import sys
from typing import Callable

PTRACE_ATTACH = 16
PTRACE_DETACH = 17


def outcome(attempt: Callable[[], object]) -> str:
    try:
        attempt()
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, str(e.errno))
    return "ok"


def agent_pid() -> int:
    """The agent's process: the one running `agent.py serve` (its command line is public), as a
    script or, as serve starts it, imported from its bytecode (`python3 -c "...import agent..."`)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            runs_agent = any(arg.endswith(b"agent.py") or b"import agent;" in arg for arg in argv)
            if runs_agent and b"serve" in argv:
                return int(entry)
    raise SystemExit("no agent.py serve process in sight")


def ptrace_attach(pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.ptrace(PTRACE_ATTACH, pid, None, None) != 0:
        raise OSError(ctypes.get_errno(), "ptrace")
    libc.ptrace(PTRACE_DETACH, pid, None, None)


def connect(path: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)


def bind(path: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)
        os.unlink(path)


def open_close(path: str, flags: int) -> None:
    os.close(os.open(path, flags))


def main() -> int:
    session = sys.argv[1] if len(sys.argv) > 1 else "/mnt/reploy-session"
    private = sys.argv[2] if len(sys.argv) > 2 else f"{session}/agent"
    workspace = f"{session}/workspace"
    pid = int(sys.argv[3]) if len(sys.argv) > 3 else agent_pid()
    attempts: dict[str, Callable[[], object]] = {
        # the control socket: connect to it, move it, put another in its place
        "connect_socket": lambda: connect(f"{private}/control.sock"),
        "rename_socket": lambda: os.rename(f"{private}/control.sock", f"{private}/moved.sock"),
        "bind_beside_socket": lambda: bind(f"{private}/control.sock.new"),
        "rename_agent_dir": lambda: os.rename(private, f"{session}/agent.moved"),
        "make_dir_beside": lambda: os.mkdir(f"{session}/agent.new"),
        "bind_in_session_dir": lambda: bind(f"{session}/control.sock"),
        # the output log and the outbox: write, truncate
        "append_log": lambda: open_close(f"{private}/output.log", os.O_WRONLY | os.O_APPEND),
        "truncate_log": lambda: open_close(f"{private}/output.log", os.O_WRONLY | os.O_TRUNC),
        "append_outbox": lambda: open_close(f"{private}/events.jsonl", os.O_WRONLY | os.O_APPEND),
        "truncate_outbox": lambda: open_close(f"{private}/events.jsonl", os.O_WRONLY | os.O_TRUNC),
        # its files: hard-link them into the workspace, read its state
        "link_outbox": lambda: os.link(f"{private}/events.jsonl", f"{workspace}/.probe-outbox"),
        "link_log": lambda: os.link(f"{private}/output.log", f"{workspace}/.probe-log"),
        "list_private": lambda: os.listdir(private),
        "read_state": lambda: open_close(f"{private}/agent-state.json", os.O_RDONLY),
        "read_log": lambda: open_close(f"{private}/output.log", os.O_RDONLY),
        # the agent's process: look into it, trace it, signal it (last: a signal that worked ends it)
        "read_memory": lambda: open_close(f"/proc/{pid}/mem", os.O_RDONLY),
        "read_environ": lambda: open_close(f"/proc/{pid}/environ", os.O_RDONLY),
        "list_fds": lambda: os.listdir(f"/proc/{pid}/fd"),
        "ptrace_attach": lambda: ptrace_attach(pid),
        "signal_probe": lambda: os.kill(pid, 0),
        "signal_stop": lambda: os.kill(pid, signal.SIGSTOP) or os.kill(pid, signal.SIGCONT),
        "signal_term": lambda: os.kill(pid, signal.SIGTERM),
    }
    results: dict[str, object] = {"uid": os.getuid(), "agent_uid": os.stat(f"/proc/{pid}").st_uid}
    results.update((name, outcome(attempt)) for name, attempt in attempts.items())
    with open(f"{workspace}/.probe-result.json", "w") as f:  # what a stopped agent no longer relays
        json.dump(results, f, sort_keys=True)
    print("PROBE-RESULT " + json.dumps(results, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
