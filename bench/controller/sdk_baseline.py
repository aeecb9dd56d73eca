#!/usr/bin/env python3
"""The SDK baseline: the engine work of one controlled session with nothing around it.

bench/bench_sessions.py runs this as its own process, timed like `reploy.py controlled-session
run`, to set a session's ready and teardown times against. It creates the session's two
containers from the Engine API arguments reploy.ContainerSpec produced (same images, same
sandbox flags), starts the controller, attaches to the workload before starting it and resizes
it, as the host does; then types `exit` into the workload, waits for it and removes both.
It imports the Docker SDK and the standard library only, as a hand-written host would.

  python3 bench/controller/sdk_baseline.py SPEC.json

SPEC.json: {"workload": {create kwargs}, "controller": {create kwargs}, "columns": N,
"rows": N, "controller_report": PATH}. Ready is when both the workload runs attached and the
controller's program runs (it writes its start time to controller_report). Prints one JSON
object: ready_at, exit_typed_at (time.time()) and rss_bytes (this process, when ready).
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


def create_owned(api: docker.APIClient, kwargs: dict[str, Any],
                 owned: contextlib.ExitStack) -> str:
    """Create a container that `owned` removes when it closes."""
    container_id = api.create_container(**kwargs)["Id"]
    owned.callback(api.remove_container, container_id, force=True, v=True)
    return container_id


def start_attached(api: docker.APIClient, container_id: str, owned: contextlib.ExitStack,
                   columns: int, rows: int) -> socket.socket:
    """Attach before start (no byte is missed) and resize after, as the host does; returns the
    PTY as a blocking socket."""
    response = api.attach_socket(
        container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
    pty = getattr(response, "_sock", response)
    owned.callback(pty.close)
    api.start(container_id)
    api.resize(container_id, height=rows, width=columns)
    pty.setblocking(True)
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
    api = docker.APIClient(timeout=TIMEOUT_S, **docker.utils.kwargs_from_env())
    with contextlib.ExitStack() as owned:
        workload_id = create_owned(api, spec["workload"], owned)
        controller_id = create_owned(api, spec["controller"], owned)
        api.start(controller_id)
        pty = start_attached(api, workload_id, owned, spec["columns"], spec["rows"])
        workload_ready_at = time.time()
        controller = await_report(Path(spec["controller_report"]))
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
    print(json.dumps(run(json.loads(Path(argv[0]).read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
