#!/usr/bin/env python3
"""Benchmarks Reploy as a harness's sandbox (an Inspect-shaped sample); one JSON line per figure.

One sample: create a sandbox, upload 1 MiB, run 20 commands, read the file back, delete it.
Through reploy_client against a real `reploy serve`, against the same work done with the
Docker SDK (containers.run with the same image and sandbox flags, exec_run, put_archive,
get_archive, remove: what `docker run`/`docker exec`/`docker cp` call) in the same run.

  harness_sample_serial      seconds per sample, samples one after another
  harness_batch_parallel_8   seconds for 8 samples run at once (8 threads; one client, whose
                             connection pool serves them all)

Each line: name, unit, n, p50, p90, p99, baseline (the SDK's p50), ratio.

  python3 bench/bench_harness.py [--samples N] [--rounds N]   (needs the engine: make setup)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import os
import shutil
import signal
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import docker  # noqa: E402

import reploy  # noqa: E402
import reploy_client  # noqa: E402
from bench_serve import figure, sweep  # noqa: E402
from conftest import remove_built_images, stage_and_build, staged_deployment_ids  # noqa: E402
from serve_harness import ServeProcess  # noqa: E402

UPLOAD_BYTES = 1024 * 1024
EXECS_PER_SAMPLE = 20
PARALLEL = 8
SDK_WORKSPACE = "/mnt/workspace"
#: The baselines' containers, each removed by the code that made it (see bench_serve.py's).
BASELINE_LABELS = {"io.reploy.bench.harness-baseline": str(os.getpid())}


def reploy_sample(client: reploy_client.Client, payload: bytes) -> None:
    with client.create(name="bench-sample") as session:
        session.files.write("data/in.bin", payload)
        for _ in range(EXECS_PER_SAMPLE):
            if not session.exec(["test", "-s", "data/in.bin"], timeout=60).ok:
                raise RuntimeError("an exec failed")
        if session.files.read("data/in.bin") != payload:
            raise RuntimeError("the file came back changed")


def sdk_sample(engine: docker.DockerClient, image_id: str, user: str, payload: bytes) -> None:
    """The same sample with the SDK: the image, read-only root, caps dropped,
    no-new-privileges, no network, the runtime user, and a host directory of its own as the
    writable workspace (the engine refuses put_archive anywhere on a read-only root, a tmpfs
    included), as serve's sessions have one."""
    uid, gid = map(int, user.split(":"))
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        info = tarfile.TarInfo("in.bin")
        info.size, info.uid, info.gid = len(payload), uid, gid
        tar.addfile(info, io.BytesIO(payload))
    workspace = Path(tempfile.mkdtemp(prefix="bhw-"))
    os.chown(workspace, uid, gid)
    container = engine.containers.run(
        image_id, ["sleep", "infinity"], detach=True, read_only=True, cap_drop=["ALL"],
        security_opt=["no-new-privileges"], network_mode="none", user=user,
        volumes={str(workspace): {"bind": SDK_WORKSPACE, "mode": "rw"}}, working_dir=SDK_WORKSPACE,
        labels=BASELINE_LABELS, init=True)
    try:
        container.put_archive(SDK_WORKSPACE, archive.getvalue())
        for _ in range(EXECS_PER_SAMPLE):
            if container.exec_run(["test", "-s", "in.bin"]).exit_code != 0:
                raise RuntimeError("an SDK exec failed")
        stream, _ = container.get_archive(f"{SDK_WORKSPACE}/in.bin")
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.extractfile("in.bin")
            if member is None or member.read() != payload:
                raise RuntimeError("the SDK's file came back changed")
    finally:
        container.remove(force=True)
        shutil.rmtree(workspace, ignore_errors=True)


def timed(work: Callable[[], None]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def batch(work: Callable[[], None], count: int) -> float:
    """Seconds for `count` runs of `work` at once."""
    def run() -> None:
        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            for future in [pool.submit(work) for _ in range(count)]:
                future.result()
    return timed(run)


def main() -> int:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # clean up on the way out
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=8, help="serial samples")
    parser.add_argument("--rounds", type=int, default=3, help="parallel batches")
    args = parser.parse_args()
    engine = docker.from_env()
    base = Path(tempfile.mkdtemp(prefix="bench-harness-"))
    workload = base / "workload"
    stage_and_build(ROOT / "examples/managed/managed.blueprint.yaml", workload)
    deployment = reploy.load_deployment(workload)
    image_id, user = deployment.current.image_id, deployment.blueprint.runtime.user
    server = ServeProcess(base / "state", workload, "--idle-after", "1h", "--snapshot-after", "2h")
    payload = os.urandom(UPLOAD_BYTES)
    try:
        with reploy_client.Client(server.ready["url"], token=server.ready["token"]) as client:
            ours = lambda: reploy_sample(client, payload)  # noqa: E731
            sdk = lambda: sdk_sample(engine, image_id, user, payload)  # noqa: E731
            serial = [timed(ours) for _ in range(args.samples)]
            serial_sdk = [timed(sdk) for _ in range(args.samples)]
            figure("harness_sample_serial", "s", serial, serial_sdk)
            parallel = [batch(ours, PARALLEL) for _ in range(args.rounds)]
            parallel_sdk = [batch(sdk, PARALLEL) for _ in range(args.rounds)]
            figure(f"harness_batch_parallel_{PARALLEL}", "s", parallel, parallel_sdk)
    except (reploy_client.ReployError, RuntimeError, docker.errors.DockerException) as e:
        print(f"bench_harness: FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        server.api.delete_all()
        server.stop()
        left = sweep(engine, server.state_dir)
        for container in engine.containers.list(
                all=True, filters={"label": [f"{k}={v}" for k, v in BASELINE_LABELS.items()]}):
            left.append(f"container {container.short_id}")
            container.remove(force=True)
        remove_built_images(engine, staged_deployment_ids(base))
        shutil.rmtree(base, ignore_errors=True)
    if left:
        print(f"bench_harness: FAILED: left behind: {left}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
