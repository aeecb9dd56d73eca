"""Shared test fixtures: the real Docker engine, staged test deployments, leftover checks.

Docker tests are marked `docker`. Without an engine they skip, unless REPLOY_REQUIRE_DOCKER=1
(CI), where a missing engine is a failure. Every Docker test is followed by a check that no
container or network labelled as a Reploy session resource is left behind by it.

"Left behind by it" means: labelled resources that did not exist when the test started and
that belong to this pytest run (a controlled session's workload-dir label lies under this run's
base temp dir, a managed session's state-dir label starts with this run's prefix; resources
without either label count too). So parallel runs on one machine (as during development)
neither fail nor sweep each other; in CI nothing else runs anyway. Managed sessions' disks
count too: no file system may stay mounted under this run's serve state dirs, and no loop
device may stay backed by an image there.

Kubernetes tests are marked `kubernetes` (and `docker`): their cluster is scripts/kube-cluster.sh's
(tests/kube_fixture.py); without one they skip, unless REPLOY_REQUIRE_KUBERNETES=1 (CI).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from kube_fixture import kube_cluster  # noqa: F401 - a fixture

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LABEL_RUN = "io.reploy.session.live-run"
LABEL_WORKLOAD_DIR = "io.reploy.session.workload-dir"
LABEL_STATE_DIR = "io.reploy.serve.state-dir"
LABEL_DEPLOYMENT = "io.reploy.deployment"
LABEL_DERIVED_BASE = "io.reploy.derived.base-image"
#: How deep below the base temp dir a staged deployment's state file is looked for.
STAGED_STATE_MAX_DEPTH = 6
#: Where this run's `serve` processes keep their state (tests/serve_harness.py): short, for the
#: unix socket paths under it, and named by this pytest process, so that a managed-session
#: container tells which run it belongs to.
SERVE_STATE_DIR_PREFIX = f"rs-{os.getpid()}-"


#: The watchdog runtime directory of this pytest run (reploy_watchdog.RUNTIME_DIR_ENV names it
#: to every host the tests start): the run's sessions share a watchdog of their own, apart from
#: a developer's live sessions and from other runs. Short, for the socket path under it.
WATCHDOG_DIR = Path(tempfile.gettempdir()) / f"rw-{os.getpid()}"
WATCHDOG_DIR_ENV = "REPLOY_WATCHDOG_DIR"
#: How long a watchdog may take to exit once its last session is gone (it lingers 3 s).
WATCHDOG_EXIT_TIMEOUT_S = 30.0


#: The shared public v1 conformance fixtures (seed 000's golden lines) live outside this
#: repository, where REPLOY_CONFORMANCE_DIR names them (.ci/run sets it). Without them the tests
#: that read them skip, saying why; with REPLOY_REQUIRE_CONFORMANCE=1 (.ci/run) they must be
#: there: collection fails otherwise.
CONFORMANCE_DIR_ENV = "REPLOY_CONFORMANCE_DIR"
REQUIRE_CONFORMANCE_ENV = "REPLOY_REQUIRE_CONFORMANCE"
CONFORMANCE_FILES = ("client-v1-events.jsonl", "client-v1-requests.jsonl",
                     "client-v1-invalid-requests.jsonl", "run-results-v1.jsonl")


def conformance_problem() -> str | None:
    """Why the shared fixtures cannot be read here, or None when they can."""
    value = os.environ.get(CONFORMANCE_DIR_ENV, "")
    if not value:
        return (f"{CONFORMANCE_DIR_ENV} is not set: the shared public v1 fixtures are not part "
                "of this repository (.ci/run points it at ../shared/conformance/reploy-v1)")
    missing = [name for name in CONFORMANCE_FILES if not (Path(value) / name).is_file()]
    if missing:
        return f"{CONFORMANCE_DIR_ENV}={value} does not hold {', '.join(missing)}"
    return None


def shared_fixture(name: str) -> Path | None:
    """A shared fixture file, or None when this checkout has none (then its tests skip).
    Under REPLOY_REQUIRE_CONFORMANCE=1 its absence is an error, at collection already."""
    assert name in CONFORMANCE_FILES, name
    problem = conformance_problem()
    if problem is None:
        return Path(os.environ[CONFORMANCE_DIR_ENV]) / name
    if os.environ.get(REQUIRE_CONFORMANCE_ENV) == "1":
        raise RuntimeError(f"{REQUIRE_CONFORMANCE_ENV}=1, but {problem}")
    return None


def require_shared_fixture(name: str) -> Path:
    """A shared fixture file for the calling test, which skips (visibly) without it."""
    path = shared_fixture(name)
    if path is None:
        pytest.skip(conformance_problem() or "")
    return path


def skipped_without_shared_fixtures(*values: object) -> object:
    """The one parameter set that stands in for a missing shared file's lines: it skips,
    with the reason, instead of the lines the file would have given."""
    return pytest.param(*values, id="shared-fixtures-absent",
                        marks=pytest.mark.skip(reason=conformance_problem() or ""))


def pytest_report_header(config: pytest.Config) -> str:
    problem = conformance_problem()
    if problem is None:
        return f"shared conformance fixtures: {os.environ[CONFORMANCE_DIR_ENV]}"
    return f"shared conformance fixtures: absent, their tests skip ({problem})"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "docker: needs the real Docker engine")
    config.addinivalue_line("markers", "kubernetes: needs the cluster of scripts/kube-cluster.sh")
    WATCHDOG_DIR.mkdir(mode=0o700, exist_ok=True)
    os.environ[WATCHDOG_DIR_ENV] = str(WATCHDOG_DIR)


def pytest_unconfigure(config: pytest.Config) -> None:
    stop_watchdog(WATCHDOG_DIR)
    shutil.rmtree(WATCHDOG_DIR, ignore_errors=True)


def watchdog_running(runtime_dir: Path) -> bool:
    """True while a watchdog holds the runtime directory's lock."""
    import fcntl

    import reploy_watchdog

    try:
        fd = os.open(runtime_dir / reploy_watchdog.LOCK_NAME, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def wait_watchdog_exit(runtime_dir: Path, timeout_s: float = WATCHDOG_EXIT_TIMEOUT_S) -> bool:
    """Wait (with a deadline) until no watchdog serves the runtime directory."""
    deadline = time.monotonic() + timeout_s
    while watchdog_running(runtime_dir):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # polling for a condition, with a deadline
    return True


def stop_watchdog(runtime_dir: Path) -> None:
    """Let the runtime directory's watchdog exit on its own; kill it if it does not."""
    import psutil

    if wait_watchdog_exit(runtime_dir):
        return
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "serve" in cmdline and str(runtime_dir) in cmdline:
            process.kill()


def _engine() -> Any:
    import docker

    try:
        client = docker.from_env(timeout=60)
        client.ping()
        return client
    except Exception as e:  # noqa: BLE001 - any failure means no usable engine
        if os.environ.get("REPLOY_REQUIRE_DOCKER") == "1":
            pytest.fail(f"REPLOY_REQUIRE_DOCKER=1 but no Docker engine answers: {e}")
        pytest.skip(f"no Docker engine: {e}")


def labelled(client: Any) -> dict[str, tuple[str, dict[str, str]]]:
    """Every labelled session resource: id -> (kind, labels). One listing call per kind, so a
    resource removed meanwhile cannot make the listing itself fail."""
    found = {c["Id"]: ("container", c.get("Labels") or {})
             for c in client.api.containers(all=True, filters={"label": LABEL_RUN})}
    found.update({n["Id"]: ("network", n.get("Labels") or {})
                  for n in client.api.networks(filters={"label": LABEL_RUN})})
    return found


def ours(labels: dict[str, str], basetemp: Path) -> bool:
    """Labelled with a directory of this run (a controlled session's workload dir under the
    base temp dir, a managed session's state dir made by this run's serves), or with neither."""
    state_dir = labels.get(LABEL_STATE_DIR)
    if state_dir is not None:  # a managed session: ours if one of this run's serves made it
        return state_dir.startswith(str(Path(tempfile.gettempdir()) / SERVE_STATE_DIR_PREFIX))
    workload_dir = labels.get(LABEL_WORKLOAD_DIR)
    return workload_dir is None or workload_dir.startswith(str(basetemp))


def remove_resource(client: Any, resource_id: str, kind: str) -> None:
    import docker.errors

    try:
        if kind == "container":
            client.api.remove_container(resource_id, force=True)
        else:
            client.api.remove_network(resource_id)
    except docker.errors.NotFound:
        pass


#: Where this run's serves keep their state: a session disk mounted or a loop device backed
#: below it belongs to this run.
SERVE_STATE_PREFIX = str(Path(tempfile.gettempdir()) / SERVE_STATE_DIR_PREFIX)


def session_disk_mounts(prefix: str = SERVE_STATE_PREFIX) -> list[str]:
    """Mount points below `prefix` (of this run's session disks), from /proc/self/mountinfo."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split(" ")[4])
        if point.startswith(prefix):
            points.append(point)
    return points


def session_disk_loops(prefix: str = SERVE_STATE_PREFIX) -> list[str]:
    """Loop devices backed by a file below `prefix`."""
    loops = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            if backing.read_text().startswith(prefix):
                loops.append(f"/dev/{backing.parent.parent.name}")
    return loops


def remove_session_disks(prefix: str) -> list[str]:
    """Unmounts what is mounted below `prefix` and detaches the loop devices backed there;
    returns what that was (so a test that left any can fail, after the cleanup)."""
    left = session_disk_mounts(prefix)
    for point in reversed(left):
        subprocess.run(["umount", point], capture_output=True, timeout=60)
    loops = session_disk_loops(prefix)
    for device in loops:
        subprocess.run(["losetup", "-d", device], capture_output=True, timeout=60)
    return left + loops


@pytest.fixture(scope="session")
def docker_client(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import reploy_watchdog

    client = _engine()
    # Sweep what earlier, killed runs left (their host and watchdog are gone), so this run
    # starts clean; live sessions of other runs are not touched.
    reploy_watchdog.reconcile_orphans(client)
    yield client
    remove_built_images(client, staged_deployment_ids(tmp_path_factory.getbasetemp()))
    client.close()


def read_regular_file(path: Path) -> bytes:
    """A file's bytes, only when it is a regular file: a test may leave a FIFO (or a link)
    where a state file belongs, and opening it must neither block nor follow."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return file.read()


def staged_deployment_ids(basetemp: Path) -> set[str]:
    """The deployments this run staged: each `.reploy/state.json` a few levels below the base
    temp dir (tests stage there). The walk stops at STAGED_STATE_MAX_DEPTH, so the deep trees
    some tests build cost nothing."""
    ids: set[str] = set()
    pending = [(basetemp, 0)]
    while pending:
        directory, depth = pending.pop()
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            ids.add(json.loads(read_regular_file(directory / ".reploy/state.json"))["deployment_id"])
        if depth < STAGED_STATE_MAX_DEPTH:
            with contextlib.suppress(OSError), os.scandir(directory) as entries:
                pending += [(Path(entry.path), depth + 1) for entry in entries
                            if entry.is_dir(follow_symlinks=False)]
    return ids


def remove_built_images(client: Any, deployment_ids: set[str]) -> None:
    """The images `build` made for those deployments, and the derived controller images made
    from them (they carry the same label): a test run leaves no images of its own behind."""
    import docker.errors

    # A derived controller image is a child of its controller's: the engine refuses to remove a
    # parent before its children (409 even with force), so derived images go first.
    ours = [image for image in client.api.images(filters={"label": LABEL_DEPLOYMENT})
            if (image.get("Labels") or {}).get(LABEL_DEPLOYMENT) in deployment_ids]
    ours.sort(key=lambda image: LABEL_DERIVED_BASE not in (image.get("Labels") or {}))
    for image in ours:
        with contextlib.suppress(docker.errors.APIError):  # gone, or still in use
            client.api.remove_image(image["Id"], force=True)


@pytest.fixture
def docker_engine(docker_client: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A Docker test's engine; afterwards, nothing the test created may remain: no labelled
    container or network, and no session disk mounted (or its loop device attached)."""
    before = set(labelled(docker_client))
    disks_before = set(session_disk_mounts() + session_disk_loops())
    yield docker_client
    basetemp = tmp_path_factory.getbasetemp()
    left = {rid: (kind, labels) for rid, (kind, labels) in labelled(docker_client).items()
            if rid not in before and ours(labels, basetemp)}
    for rid, (kind, _) in left.items():
        remove_resource(docker_client, rid, kind)
    assert not left, f"session resources left behind: {[(k, r[:12]) for r, (k, _) in left.items()]}"
    disks_left = set(session_disk_mounts() + session_disk_loops()) - disks_before
    for disk in disks_left:
        remove_session_disks(disk)
    assert not disks_left, f"session disks left mounted: {sorted(disks_left)}"


@pytest.fixture
def watchdog_dir() -> Any:
    """A watchdog runtime directory of the test's own (pass it to hosts as
    REPLOY_WATCHDOG_DIR); whatever watchdog it still has at the end is stopped."""
    path = Path(tempfile.mkdtemp(prefix="rwt-"))
    yield path
    stop_watchdog(path)
    shutil.rmtree(path, ignore_errors=True)


def run_reploy(*args: str, timeout: float = 180, **kwargs: Any) -> subprocess.CompletedProcess:
    """`python3 reploy.py ARGS`, as a user runs it."""
    return subprocess.run([sys.executable, str(ROOT / "reploy.py"), *args],
                          capture_output=True, timeout=timeout, **kwargs)


def stage_and_build(blueprint: Path, directory: Path) -> dict[str, Any]:
    for command in (["stage", str(blueprint), "--dir", str(directory)],
                    ["build", "--dir", str(directory)]):
        proc = run_reploy(*command)
        assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


CONTROLLER_BLUEPRINT = """\
name: scenario-controller
build:
  context: context
environment:
  runtime:
    user: "1000:1000"
    memory_mib: 256
    pids: 128
  executables:
    scenario.main:
      argv: [python3, /opt/controller/scenario.py]
  commands:
    run-scenario:
      executable: scenario.main
      native_command: true
      trigger: [run-scenario]
"""


@pytest.fixture(scope="session")
def deployments(docker_client: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The test controller (tests/controllers) and the example workload, staged and built."""
    base = tmp_path_factory.mktemp("deployments")
    source = base / "controller-source"
    (source / "context").mkdir(parents=True)
    shutil.copy(ROOT / "examples/controller/context/reploy_driver.py", source / "context")
    shutil.copy(ROOT / "tests/controllers/scenario.py", source / "context")
    (source / "context/Dockerfile").write_text(
        "FROM reploy-base/python:bookworm-1\n"
        "COPY reploy_driver.py scenario.py /opt/controller/\n")
    (source / "controller.blueprint.yaml").write_text(CONTROLLER_BLUEPRINT)
    stage_and_build(source / "controller.blueprint.yaml", base / "controller")
    stage_and_build(ROOT / "examples/workload/workload.blueprint.yaml", base / "workload")
    return {"controller": base / "controller", "workload": base / "workload"}
