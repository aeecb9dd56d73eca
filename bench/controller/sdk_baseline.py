#!/usr/bin/env python3
"""The SDK baseline: the engine work of one controlled session with nothing around it.

bench/bench_sessions.py runs this as its own process, timed like `reploy.py controlled-session
run`, to set a session's ready and teardown times against. It creates the session's two
containers from the Engine API arguments reploy.ContainerSpec produced (same images, same
sandbox flags), starts the controller, attaches to the workload before starting it and resizes
it, as the host does; then types `exit` into the workload, waits for it and removes both.
It imports the Docker SDK and the standard library only, as a hand-written host would.

Two orders: "overlapped" starts the workload at once, beside the controller (the least the
engine work costs); "contract" follows seed 000's order, the controller created and started
first and the workload started only once its program runs (the first moment a controller's
attach of the workload can be connected), so it is the least any host keeping the contract
can do.

  python3 bench/controller/sdk_baseline.py SPEC.json

SPEC.json: {"workload": {create kwargs}, "controller": {create kwargs}, "columns": N,
"rows": N, "controller_report": PATH, "order": "overlapped" | "contract"}. Ready is when both
the workload runs attached and the controller's program runs (it writes its start time to
controller_report). Prints one JSON object: ready_at, exit_typed_at (time.time()) and
rss_bytes (this process, when ready).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import docker

#: Bound on any one wait; far above what any takes.
TIMEOUT_S = 180.0
#: How often to look for the controller's report (the time it holds is its own, not ours).
POLL_INTERVAL_S = 0.005
#: The orders `run` knows (see the docstring).
ORDERS = ("overlapped", "contract")


def create_owned(api: docker.APIClient, kwargs: dict[str, Any],
                 owned: contextlib.ExitStack) -> str:
    """Create a container that `owned` removes when it closes."""
    container_id = api.create_container(**kwargs)["Id"]
    owned.callback(api.remove_container, container_id, force=True, v=True)
    return container_id


def attach(api: docker.APIClient, container_id: str,
           owned: contextlib.ExitStack) -> socket.socket:
    """Attach to a container's PTY (before its start, so no byte is missed), as a blocking
    socket that `owned` closes."""
    response = api.attach_socket(
        container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
    pty = getattr(response, "_sock", response)
    owned.callback(pty.close)
    pty.setblocking(True)
    return pty


def start_resized(api: docker.APIClient, container_id: str, columns: int, rows: int) -> None:
    """Start, then resize, as the host does."""
    api.start(container_id)
    api.resize(container_id, height=rows, width=columns)


def start_attached(api: docker.APIClient, container_id: str, owned: contextlib.ExitStack,
                   columns: int, rows: int) -> socket.socket:
    """Attach, start and resize; returns the PTY."""
    pty = attach(api, container_id, owned)
    start_resized(api, container_id, columns, rows)
    return pty


def await_report(path: Path, deadline_s: float = TIMEOUT_S) -> dict[str, Any]:
    """The JSON file another process writes (whole, by rename), once it is there."""
    deadline = time.monotonic() + deadline_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(POLL_INTERVAL_S)
    return json.loads(path.read_text())


def resident_bytes() -> int:
    """This process's RSS, read where psutil reads it."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """The controller first; the workload created and attached to while it starts, and
    started at once ("overlapped") or once the controller's program runs ("contract")."""
    api = docker.APIClient(timeout=TIMEOUT_S, **docker.utils.kwargs_from_env())
    report_path = Path(spec["controller_report"])
    with contextlib.ExitStack() as owned:
        controller_id = create_owned(api, spec["controller"], owned)
        api.start(controller_id)
        workload_id = create_owned(api, spec["workload"], owned)
        pty = attach(api, workload_id, owned)
        controller = await_report(report_path) if spec["order"] == "contract" else None
        start_resized(api, workload_id, spec["columns"], spec["rows"])
        workload_ready_at = time.time()
        controller = controller or await_report(report_path)
        rss_bytes = resident_bytes()
        exit_typed_at = time.time()
        pty.sendall(b"exit 0\n")
        api.wait(workload_id, timeout=TIMEOUT_S)
    return {"ready_at": max(workload_ready_at, controller["started_at"]),
            "exit_typed_at": exit_typed_at, "rss_bytes": rss_bytes}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: sdk_baseline.py SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    if spec.get("order") not in ORDERS:
        print(f"sdk_baseline.py: order must be one of {ORDERS}", file=sys.stderr)
        return 2
    print(json.dumps(run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
