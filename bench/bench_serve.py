#!/usr/bin/env python3
"""Benchmarks `reploy serve`; prints one JSON line per figure (like bench/bench_agent.py).

Each line: name, unit, n, p50, p90, p99, baseline, ratio. Figures, not pass/fail:
  serve_create_to_prompt      POST /sessions until the shell's first prompt is readable, against
                              the raw Docker SDK creating+starting the same sandboxed container and
                              polling the agent's socket until `status` answers
  serve_idle_to_active        a read of a paused (idle) session: unpause + the read
  serve_snapshot_to_active    a read of a snapshotted session: new container + restore + the read
  serve_sse_delivery          write `echo MARK` through the API until MARK arrives on the SSE stream,
                              against the same write + a long-poll read on the agent socket
  serve_idle_memory           memory of one paused session container (cgroup usage), MiB
  serve_exec_true             POST /exec of `true` until its result, against the Docker SDK's exec_run
                              (exec create + start + inspect: what `docker exec` calls) in the same container
  serve_upload_throughput     PUT /files of a 64 MiB file, MiB/s, against the SDK's put_archive of the
                              same file (docker cp's API; its tar built beforehand, outside the timing)
  serve_download_throughput   GET /files of that file, MiB/s, against the SDK's get_archive of it, read whole

  python3 bench/bench_serve.py [--rounds N]    (needs the engine and the base images: make setup)
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import os
import tarfile
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import docker  # noqa: E402
import docker.models.containers  # noqa: E402

import reploy  # noqa: E402
from conftest import stage_and_build  # noqa: E402
from serve_harness import Api, ServeProcess, wait_until  # noqa: E402


def figure(name: str, unit: str, samples: list[float], baseline: list[float] | None = None) -> None:
    cuts = statistics.quantiles(samples, n=100, method="inclusive") if len(samples) > 1 else [samples[0]] * 99
    base = statistics.median(baseline) if baseline else None
    print(json.dumps({"name": name, "unit": unit, "n": len(samples), "p50": round(cuts[49], 4),
                      "p90": round(cuts[89], 4), "p99": round(cuts[98], 4),
                      "baseline": None if base is None else round(base, 4),
                      "ratio": None if base is None else round(cuts[49] / base, 3)}), flush=True)


def read_once(api: Api, sid: str) -> None:
    api.call("POST", f"/sessions/{sid}/read", {"offset": 0, "maxBytes": 4})


def sdk_baseline(workload: Path, rounds: int) -> list[float]:
    """The same sandboxed container straight through the SDK, until its agent answers."""
    deployment = reploy.load_deployment(workload)
    backend = reploy.DockerBackend()
    samples = []
    for _ in range(rounds):
        directory = Path(tempfile.mkdtemp(prefix="bsb-"))
        session_dir = directory / "s"
        session_dir.mkdir(mode=0o700)
        runtime = deployment.blueprint.runtime
        shutil.chown(session_dir, runtime.uid, runtime.gid)
        spec = reploy.ContainerSpec(
            role="managed", image_id=deployment.current.image_id,
            command=("python3", reploy.AGENT_MOUNT, "serve", "--session-dir", reploy.SESSION_MOUNT,
                     "--workload", "shell", "--home", reploy.CONTAINER_HOME),
            runtime=runtime, environment={"HOME": reploy.CONTAINER_HOME},
            labels={reploy.LABEL_RUN: "bench-baseline", reploy.LABEL_ROLE: "bench"},
            mounts=(reploy.Mount(str(reploy.AGENT_SOURCE), reploy.AGENT_MOUNT, True),
                    reploy.Mount(str(session_dir), reploy.SESSION_MOUNT, False)), init=True)
        start = time.perf_counter()
        container_id = backend.create(spec)
        try:
            backend.start(container_id)
            wait_until(lambda: _answers(session_dir), "the baseline agent")
            samples.append(time.perf_counter() - start)
        finally:
            backend.remove_container(container_id)
            shutil.rmtree(directory, ignore_errors=True)
    return samples


def _answers(session_dir: Path) -> bool:
    try:
        reploy.agent_call(session_dir, "status", {})
        return True
    except reploy.AgentCallError:
        return False


def sse_latency(api: Api, server: ServeProcess, sid: str, rounds: int) -> tuple[list[float], list[float]]:
    import http.client

    api.wait_output(sid, b"$ ")
    length = len(api.read_all(sid))
    conn = http.client.HTTPConnection(api.host, api.port, timeout=30)
    conn.request("GET", f"/api/v1/sessions/{sid}/stream?offset={length}", headers=api.auth_headers)
    response = conn.getresponse()
    seen: dict[str, float] = {}
    lock = threading.Condition()

    def pump() -> None:
        while True:
            line = response.fp.readline()
            if not line:
                return
            if line.startswith(b"data: "):
                payload = base64.b64decode(json.loads(line[6:])["payloadBase64"])
                with lock:
                    for token in payload.split():
                        seen.setdefault(token.decode(errors="replace"), time.perf_counter())
                    lock.notify_all()

    threading.Thread(target=pump, daemon=True).start()
    via_sse, via_socket = [], []
    session_dir = server.state_dir / "sessions" / sid
    for i in range(rounds):
        mark = f"M{i}x"
        start = time.perf_counter()
        api.write(sid, f"echo {mark}\r".encode())
        with lock:
            lock.wait_for(lambda: mark in seen, timeout=30)
        via_sse.append(seen[mark] - start)
        # Baseline: the agent's own write + long-poll read, no HTTP or SSE in between.
        offset = reploy.agent_call(session_dir, "status", {})["log_bytes"]
        mark = f"B{i}x"
        start = time.perf_counter()
        reploy.agent_call(session_dir, "write", {"data_b64": base64.b64encode(f"echo {mark}\r".encode()).decode()})
        data = b""
        while mark.encode() + b"\r\n" not in data:
            page = reploy.agent_call(session_dir, "read", {"offset": offset, "wait_ms": 2000})
            data += base64.b64decode(page["data_b64"])
            offset = page["next_offset"]
        via_socket.append(time.perf_counter() - start)
    conn.close()
    return via_sse, via_socket


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    rounds = parser.parse_args().rounds
    client = docker.from_env()
    base = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    workload = base / "workload"
    stage_and_build(ROOT / "examples/managed/managed.blueprint.yaml", workload)
    server = ServeProcess(base / "state", workload, "--idle-after", "1h", "--snapshot-after", "2h")
    api = server.api
    try:
        creates, sessions = [], []
        for i in range(rounds):
            start = time.perf_counter()
            sid = api.create(f"bench-{i}")["id"]
            api.wait_output(sid, b"$ ")
            creates.append(time.perf_counter() - start)
            sessions.append(sid)
        figure("serve_create_to_prompt", "s", creates, sdk_baseline(workload, rounds))
        via_sse, via_socket = sse_latency(api, server, sessions[0], rounds * 4)
        figure("serve_sse_delivery", "s", via_sse, via_socket)
        manager_view = reploy.SessionStore(base / "state" / "sessions.db")
        container = client.containers.get(manager_view.get(sessions[0]).container_id)
        exec_times, sdk_exec_times = exec_round_trips(api, sessions[0], container, rounds * 4)
        figure("serve_exec_true", "ms", exec_times, sdk_exec_times)
        uploads, sdk_uploads, downloads, sdk_downloads = transfer_rates(api, sessions[0], container, base)
        figure("serve_upload_throughput", "MiB/s", uploads, sdk_uploads)
        figure("serve_download_throughput", "MiB/s", downloads, sdk_downloads)
        # Idle: pause directly (what the reaper does), then time the access that resumes.
        resumes, memory = [], []
        for sid in sessions:
            container_id = manager_view.get(sid).container_id
            wait_until(lambda: api.call("GET", f"/sessions/{sid}/status")["agent"]["turnState"] == "idle",
                       "a quiet shell")
            _force_idle(base / "state", sid)
            stats = client.api.stats(container_id, stream=False)
            memory.append(stats["memory_stats"]["usage"] / (1024 * 1024))
            start = time.perf_counter()
            read_once(api, sid)
            resumes.append(time.perf_counter() - start)
        figure("serve_idle_to_active", "s", resumes)
        figure("serve_idle_memory", "MiB", memory)
        restores = []
        for sid in sessions:
            api.call("POST", f"/sessions/{sid}/snapshot", {})
            start = time.perf_counter()
            read_once(api, sid)
            restores.append(time.perf_counter() - start)
        figure("serve_snapshot_to_active", "s", restores)
    finally:
        api.delete_all()
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


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


def _force_idle(state_dir: Path, sid: str) -> None:
    """The reaper's idle step, run now: a SessionManager on the same state dir (the store's
    leases keep it from clashing with the running serve)."""
    manager = reploy.SessionManager(reploy.ServeConfig(state_dir=state_dir, workload_dirs=()),
                                    reploy.DockerBackend())
    try:
        with manager.leased(sid) as lease:  # paused with the facts the reaper would record
            manager._pause(lease, manager._reap_decision(lease.record))
    finally:
        manager.close()


if __name__ == "__main__":
    sys.exit(main())
