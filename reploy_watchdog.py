#!/usr/bin/env python3
"""reploy_watchdog: cleans up after a Reploy host that died abruptly.

Role: one detached process per live controlled session, started by reploy.py before any
container of the session starts, in its own session (so the host's terminal signals miss it).

Peers:
  * the host, through a liveness pipe: a disarm byte means "I cleaned up myself, go quietly";
    end of file without it means the host died. The host's pid and create time are also
    watched with psutil, so a reused pid cannot pass for the host;
  * the manifest file the host keeps current (atomically replaced) naming exactly what the
    session owns: container and network ids with their labels, the paths to remove, and where
    the incident receipt goes;
  * the Docker Engine, through the Docker SDK.

On a trigger it removes exactly what the manifest names (after checking each resource's run
label, never by name alone), sweeps anything else carrying this run's label, removes the
listed paths, verifies absence and writes a fixed-field JSON incident receipt (mode 0600).
reploy.py reuses `reconcile_manifest` for orphans whose watchdog died too.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import selectors
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import psutil

# The Docker SDK is imported only when there is something to clean up: a watchdog spends its
# life waiting, and the SDK would double its memory for nothing (see cleanup()).

# ============================================================================================
# Constants
# ============================================================================================

#: Reploy's release: one value in all four role files (a test checks), named by the offline bundle.
__version__ = "0.1.0"

MANIFEST_SCHEMA = "reploy-watchdog-manifest-v1"
RECEIPT_SCHEMA = "reploy-incident-receipt-v1"
LABEL_RUN = "io.reploy.session.live-run"
#: "pid:create_time" of the host and of its watchdog, on every session container and network,
#: so orphans can be recognised by label alone once both processes are gone.
LABEL_HOST = "io.reploy.session.host"
LABEL_WATCHDOG = "io.reploy.session.watchdog"
#: The workload deployment directory, where the manifest and the receipts live.
LABEL_WORKLOAD_DIR = "io.reploy.session.workload-dir"
#: The host writes this byte before closing the pipe when it cleaned up itself.
DISARM_BYTE = b"D"
#: How often the host's pid is re-checked while the pipe stays open.
HOST_CHECK_INTERVAL_S = 1.0
#: Docker calls made while cleaning up must not hang forever.
DOCKER_TIMEOUT_S = 30

# ============================================================================================
# Types
# ============================================================================================


@dataclass(frozen=True)
class Manifest:
    """What one session owns. Written by the host, read here only when acting."""

    run_id: str
    host: str  # process identity "pid:create_time"
    watchdog: str  # likewise; "" until the host has started it
    containers: dict[str, dict[str, str]]  # container id -> labels
    #: network id -> labels. Hosts no longer create networks (a granted session's namespace is
    #: held by a container), but runs of earlier hosts on the same machine still name theirs,
    #: and one manifest format keeps old and new hosts reconciling each other's orphans.
    networks: dict[str, dict[str, str]]
    paths: tuple[str, ...]
    receipt_path: str

    @classmethod
    def load(cls, path: Path) -> "Manifest":
        obj = json.loads(path.read_text())
        if obj.pop("schema", None) != MANIFEST_SCHEMA:
            raise ValueError(f"{path}: not a watchdog manifest")
        try:
            obj["paths"] = tuple(obj["paths"])
            return cls(**obj)
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a watchdog manifest ({e})") from e

    def to_json(self) -> dict[str, Any]:
        return {"schema": MANIFEST_SCHEMA, "run_id": self.run_id, "host": self.host,
                "watchdog": self.watchdog, "containers": self.containers,
                "networks": self.networks, "paths": list(self.paths),
                "receipt_path": self.receipt_path}

    @property
    def abandoned(self) -> bool:
        """Neither the host nor its watchdog is alive to act on this manifest."""
        return not identity_alive(self.host) and not identity_alive(self.watchdog)


@dataclass
class CleanupReport:
    removed_containers: list[str] = field(default_factory=list)
    removed_networks: list[str] = field(default_factory=list)
    removed_paths: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def atomic_write_json(path: Path, obj: dict[str, Any], mode: int = 0o600) -> None:
    """Write JSON so a reader sees the old file or the new one, never a torn one.

    reploy.py writes deployment state with this too: one implementation of the rename dance.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def process_identity(process: Optional[psutil.Process] = None) -> str:
    """'pid:create_time': what a label or manifest stores to name one process exactly."""
    process = process or psutil.Process()
    return f"{process.pid}:{process.create_time()!r}"


def identity_alive(identity: str) -> bool:
    """True while the process named by a process_identity() string exists."""
    pid, _, create_time = identity.partition(":")
    try:
        process = psutil.Process(int(pid))
        return abs(process.create_time() - float(create_time)) < 0.01 and (
            process.status() != psutil.STATUS_ZOMBIE)
    except (ValueError, psutil.NoSuchProcess):
        return False


def manifest_path_for(workload_dir: str, run_id: str) -> Path:
    return Path(workload_dir) / ".reploy" / "watchdog" / f"{run_id}.json"


def receipt_path_for(workload_dir: str, run_id: str) -> Path:
    return Path(workload_dir) / ".reploy" / "incidents" / f"{run_id}.json"


def channel_dir_for(workload_dir: str, run_id: str) -> Path:
    return Path(workload_dir) / ".reploy" / "sessions" / run_id


# ============================================================================================
# Cleanup
# ============================================================================================


def remove_owned(manifest: Manifest, client: Any) -> CleanupReport:
    """Remove what the manifest names and anything else labelled with its run; verify."""
    import docker.errors
    report = CleanupReport()
    api = client.api
    wanted = {LABEL_RUN: manifest.run_id}
    swept = {c["Id"] for c in api.containers(all=True, filters={"label": f"{LABEL_RUN}={manifest.run_id}"})}
    for container_id in list(manifest.containers) + sorted(swept - set(manifest.containers)):
        try:
            labels = api.inspect_container(container_id)["Config"].get("Labels") or {}
        except docker.errors.NotFound:
            continue
        if any(labels.get(k) != v for k, v in wanted.items()):
            report.errors.append(f"container {container_id} does not carry this run's label; kept")
            continue
        try:
            api.remove_container(container_id, force=True, v=True)
            report.removed_containers.append(container_id)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            report.errors.append(f"remove container {container_id}: {e}")
    swept_networks = {n["Id"] for n in api.networks(filters={"label": f"{LABEL_RUN}={manifest.run_id}"})}
    for network_id in list(manifest.networks) + sorted(swept_networks - set(manifest.networks)):
        try:
            labels = api.inspect_network(network_id).get("Labels") or {}
        except docker.errors.NotFound:
            continue
        if labels.get(LABEL_RUN) != manifest.run_id:
            report.errors.append(f"network {network_id} does not carry this run's label; kept")
            continue
        try:
            api.remove_network(network_id)
            report.removed_networks.append(network_id)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            report.errors.append(f"remove network {network_id}: {e}")
    for path in manifest.paths:
        if os.path.lexists(path):
            try:
                shutil.rmtree(path)
                report.removed_paths.append(path)
            except OSError as e:
                report.errors.append(f"remove {path}: {e}")
    # Verify absence: a cleanup is only a success when nothing of the run remains.
    if api.containers(all=True, filters={"label": f"{LABEL_RUN}={manifest.run_id}"}):
        report.errors.append("containers of this run remain after cleanup")
    if api.networks(filters={"label": f"{LABEL_RUN}={manifest.run_id}"}):
        report.errors.append("networks of this run remain after cleanup")
    report.errors.extend(f"{p} remains after cleanup" for p in manifest.paths if os.path.lexists(p))
    return report


def reconcile_manifest(manifest_path: Path, trigger: str) -> dict[str, Any]:
    """Act on one manifest: clean up, write the receipt, drop the manifest. Returns the receipt."""
    import docker

    manifest = Manifest.load(manifest_path)
    try:
        client = docker.from_env(timeout=DOCKER_TIMEOUT_S)
        try:
            report = remove_owned(manifest, client)
        finally:
            client.close()
    except Exception as e:  # noqa: BLE001 - an unreachable engine still gets its receipt
        report = CleanupReport(errors=[f"the Docker engine failed: {e}"])
        for path in manifest.paths:  # what needs no engine is still cleaned up
            with contextlib.suppress(OSError):
                shutil.rmtree(path)
                report.removed_paths.append(path)
    receipt = {
        "schema": RECEIPT_SCHEMA,
        "run_id": manifest.run_id,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "trigger": trigger,
        "host": manifest.host,
        "removed": {"containers": report.removed_containers,
                    "networks": report.removed_networks,
                    "paths": report.removed_paths},
        "cleanup_succeeded": not report.errors,
        "errors": report.errors,
    }
    atomic_write_json(Path(manifest.receipt_path), receipt)
    with contextlib.suppress(FileNotFoundError):
        manifest_path.unlink()
    return receipt


def reconcile_orphans(client: Any, extra_manifests: tuple[Path, ...] = ()) -> list[dict[str, Any]]:
    """Clean up runs whose host and watchdog are both gone (a crash that took both).

    Runs are found by label and through `extra_manifests` (the manifests of deployments the
    caller is about to use, which also catch runs that died before creating anything). A run's
    manifest is used when it still exists, else one is rebuilt from the labels. Returns the
    receipts written.
    """
    runs: dict[str, dict[str, dict[str, dict[str, str]]]] = {}
    for kind, listing in (("containers", client.api.containers(all=True, filters={"label": LABEL_RUN})),
                          ("networks", client.api.networks(filters={"label": LABEL_RUN}))):
        for item in listing:
            labels = item.get("Labels") or {}
            run = runs.setdefault(labels[LABEL_RUN], {"containers": {}, "networks": {}})
            run[kind][item["Id"]] = labels
    for run_id, owned in sorted(runs.items()):
        labels = next(iter({**owned["containers"], **owned["networks"]}.values()))
        workload_dir = labels.get(LABEL_WORKLOAD_DIR)
        if not workload_dir:
            continue  # not a session resource of ours: no place for a receipt
        manifest = Manifest(
            run_id=run_id, host=labels.get(LABEL_HOST, ""),
            watchdog=labels.get(LABEL_WATCHDOG, ""), containers=owned["containers"],
            networks=owned["networks"], paths=(str(channel_dir_for(workload_dir, run_id)),),
            receipt_path=str(receipt_path_for(workload_dir, run_id)))
        path = manifest_path_for(workload_dir, run_id)
        if manifest.abandoned and not path.exists():
            atomic_write_json(path, manifest.to_json())
    receipts = []
    for path in sorted({manifest_path_for(labels.get(LABEL_WORKLOAD_DIR, ""), run_id)
                        for run_id, owned in runs.items()
                        for labels in [*owned["containers"].values(), *owned["networks"].values()]
                        if labels.get(LABEL_WORKLOAD_DIR)} | set(extra_manifests)):
        try:
            abandoned = path.exists() and Manifest.load(path).abandoned
        except (OSError, ValueError):
            continue  # unreadable: not ours to act on, and no reason to stop the others
        if abandoned:
            receipts.append(reconcile_manifest(path, "reconciled"))
    return receipts


# ============================================================================================
# The watch loop
# ============================================================================================


def watch(liveness_fd: int, host: str) -> str:
    """Block until the host disarms us ("disarmed") or dies (the trigger)."""
    os.set_blocking(liveness_fd, False)
    with selectors.DefaultSelector() as selector:
        selector.register(liveness_fd, selectors.EVENT_READ)
        while True:
            if selector.select(HOST_CHECK_INTERVAL_S):
                try:
                    data = os.read(liveness_fd, 64)
                except BlockingIOError:
                    continue
                if DISARM_BYTE in data:
                    return "disarmed"
                if not data:
                    return "host-exited"
            elif not identity_alive(host):
                return "host-process-gone"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="reploy_watchdog")
    parser.add_argument("--manifest", type=Path, required=True)
    parser.add_argument("--liveness-fd", type=int, required=True)
    parser.add_argument("--host", required=True, help="the host's pid:create_time")
    args = parser.parse_args(argv)
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_IGN)
    trigger = watch(args.liveness_fd, args.host)
    if trigger == "disarmed":
        return 0
    if not args.manifest.exists():
        return 0  # nothing was ever recorded, so nothing can be owned
    receipt = reconcile_manifest(args.manifest, trigger)
    return 0 if receipt["cleanup_succeeded"] else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # everything is cleaned up in main(); skip the interpreter's slow teardown
