#!/usr/bin/env python3
"""Benchmarks controlled sessions end to end; prints one JSON line per figure.

Each line: name, unit, n, p50, p90, p99, baseline, ratio (p50 / baseline). Every baseline is
measured in this same run, on this same machine, interleaved with the figure it belongs to:
absolute times drift on a shared machine, ratios hold. A short table goes to stderr at the
end. bench/README.md says what each figure means.

  python3 bench/bench_sessions.py [--ready-only | --stream-only] [--against CHECKOUT]

The sessions run a bench controller (bench/controller, staged with the example driver
library) against the example busybox workload, through `python3 reploy.py controlled-session
run` exactly as a user runs it. The controller records what only it can see (when it read
`ready`, how fast `attach` delivers) in its output directory. Baselines do the same engine work
with the Docker SDK and nothing else, with containers built from reploy.ContainerSpec so the
sandbox flags are identical.

The role files are copied into a private directory first, so the whole run measures one
version of them even while someone edits the tree.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import importlib
import itertools
import json
import os
import py_compile
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import psutil

ROOT = Path(__file__).resolve().parents[1]
CONTROLLER_SOURCE = ROOT / "bench/controller"
DRIVER_SOURCE = ROOT / "examples/controller/context/reploy_driver.py"
WORKLOAD_BLUEPRINT = ROOT / "examples/workload/workload.blueprint.yaml"
#: What a granted session adds: the endpoint the example workload declares.
GRANT = ("--endpoint", "web")
SDK_BASELINE = CONTROLLER_SOURCE / "sdk_baseline.py"
sys.path[:0] = [str(CONTROLLER_SOURCE), str(CONTROLLER_SOURCE / "context"),
                str(DRIVER_SOURCE.parent), str(ROOT / "scripts")]

import bench_controller  # noqa: E402  (its Probe measures the direct-attach baselines)
from bundle import ROLE_FILES  # noqa: E402  (the role files a release ships; copied as a set)
import sdk_baseline  # noqa: E402  (the SDK baseline's engine calls, for the direct attach too)

MIB = bench_controller.MIB
#: Sessions (and SDK baselines) timed for ready and teardown.
READY_RUNS = 10
#: Sessions timed right after their derived controller image was removed.
UNCACHED_RUNS = 3
THROUGHPUT_ROUNDS = 3
THROUGHPUT_BYTES = 64 * MIB
ECHO_KEYSTROKES = 300
#: Concurrent live sessions for the memory figures.
DENSITY_SESSIONS = (1, 5, 10)
#: Hard bound on one session or baseline process; far above what any takes.
PROCESS_TIMEOUT_S = 180.0
#: How long concurrent sessions may take to all become live.
HOLD_DEADLINE_S = 120.0
#: Carried by every container the baselines create, and what they are removed by.
BASELINE_LABEL = "io.reploy.bench.baseline"
#: Bytes of a failing process's stderr repeated in the error.
STDERR_TAIL_BYTES = 2000


class BenchFailed(Exception):
    """A session or a baseline did not do what the measurement needs."""


# ============================================================================================
# Figures
# ============================================================================================


def percentiles(samples: list[float]) -> tuple[float, float, float]:
    """p50, p90, p99; a single sample is all three."""
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return cuts[49], cuts[89], cuts[98]


def figure(name: str, unit: str, samples: list[float], baseline: list[float]) -> dict[str, Any]:
    """One figure, printed as a JSON line at once so a failing later figure loses nothing."""
    p50, p90, p99 = percentiles(samples)
    base = percentiles(baseline)[0]
    line = {"name": name, "unit": unit, "n": len(samples), "p50": round(p50, 4),
            "p90": round(p90, 4), "p99": round(p99, 4), "baseline": round(base, 4),
            "ratio": round(p50 / base, 3)}
    print(json.dumps(line), flush=True)
    return line


def print_table(lines: list[dict[str, Any]]) -> None:
    header = (f"{'figure':<30} {'unit':<11} {'n':>4} {'p50':>10} {'p99':>10} {'baseline':>10} "
              f"{'ratio':>7}")
    rows = [f"{f['name']:<30} {f['unit']:<11} {f['n']:>4} {f['p50']:>10.2f} {f['p99']:>10.2f} "
            f"{f['baseline']:>10.2f} {f['ratio']:>7.2f}" for f in lines]
    print("\n".join([header, *rows]), file=sys.stderr)


def log(message: str) -> None:
    print(f"bench_sessions: {message}", file=sys.stderr, flush=True)


# ============================================================================================
# The baselines' containers: reploy's own ContainerSpec, labelled for the bench
# ============================================================================================


def load_reploy(roles_dir: Path) -> ModuleType:
    sys.path.insert(0, str(roles_dir))
    return importlib.import_module("reploy")


def workload_spec(reploy: ModuleType, deployment: Any, labels: dict[str, str]) -> Any:
    """The workload container exactly as ControlledSession.prepare specifies it."""
    return reploy.ContainerSpec(
        role="workload", image_id=deployment.current.image_id, command=(reploy.WORKLOAD_SHELL,),
        runtime=deployment.blueprint.runtime,
        environment={"HOME": reploy.CONTAINER_HOME, "TERM": reploy.WORKLOAD_TERM},
        labels=labels, tty=True, hostname="workload")


def controller_spec(reploy: ModuleType, backend: Any, plan: Any, output_dir: Path,
                    labels: dict[str, str]) -> Any:
    """The controller container as ControlledSession.prepare specifies it, less the session
    channel it has no use for: the derived image, the output directory, init."""
    runtime = plan.controller_blueprint.runtime
    return reploy.ContainerSpec(
        role="controller", runtime=runtime, command=plan.controller_argv,
        image_id=reploy.ensure_controller_image(backend, plan.controller.current.image_id),
        environment={"HOME": reploy.CONTAINER_HOME, "REPLOY_OUTPUT_DIR": reploy.OUTPUT_DIR_MOUNT},
        labels=labels, hostname="controller", init=True,
        mounts=(reploy.Mount(str(output_dir), reploy.OUTPUT_DIR_MOUNT, False),))


# ============================================================================================
# Timed processes: session hosts and baseline children
# ============================================================================================


@dataclass(frozen=True)
class Run:
    """One timed process and what it (or its controller) reported."""

    started_at: float  # time.time() just before the process was started
    ended_at: float  # time.time() just after it exited
    report: dict[str, Any]

    @property
    def ready_ms(self) -> float:
        return (self.report["ready_at"] - self.started_at) * 1000

    @property
    def teardown_ms(self) -> float:
        return (self.ended_at - self.report["exit_typed_at"]) * 1000


@dataclass
class Pending:
    """A started process, and how to read its report once it exits."""

    started_at: float
    proc: subprocess.Popen[bytes]
    read_report: Callable[[bytes], dict[str, Any]]

    def conclude(self) -> Run:
        stdout, stderr = self.proc.communicate(timeout=PROCESS_TIMEOUT_S)
        ended_at = time.time()
        try:
            report = self.read_report(stdout)
        except (BenchFailed, OSError, ValueError, KeyError) as e:
            raise BenchFailed(f"{' '.join(self.proc.args[1:4])} (exit {self.proc.returncode}): "
                              f"{e}\n{stderr[-STDERR_TAIL_BYTES:].decode(errors='replace')}") from e
        return Run(self.started_at, ended_at, report)


def launch(argv: list[str], read_report: Callable[[bytes], dict[str, Any]]) -> Pending:
    started_at = time.time()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    return Pending(started_at, proc, read_report)


@dataclass
class Bench:
    """The run's private directory, its copy of the role files and its two deployments."""

    work: Path
    reploy: ModuleType
    backend: Any
    controller_dir: Path
    workload_dir: Path
    numbers: Iterator[int]

    @property
    def roles_dir(self) -> Path:
        return self.work / "roles"

    def output_dir(self) -> Path:
        """A new output directory, the controller's to write (Reploy never re-owns one)."""
        path = self.work / "outputs" / str(next(self.numbers))
        path.mkdir(parents=True)
        runtime = self.reploy.load_deployment(self.controller_dir).built_blueprint().runtime
        os.chown(path, runtime.uid, runtime.gid)
        return path

    def cli_options(self, output_dir: Path) -> list[str]:
        return ["--controller-dir", str(self.controller_dir),
                "--workload-dir", str(self.workload_dir), "--output-dir", str(output_dir)]

    def start_session(self, *mode: str, output_dir: Path | None = None,
                      grant: tuple[str, ...] = ()) -> Pending:
        """`python3 reploy.py controlled-session run [GRANT] … -- run-bench MODE`, as a user
        runs it."""
        output_dir = output_dir or self.output_dir()
        return launch([sys.executable, str(self.roles_dir / "reploy.py"), "controlled-session",
                       "run", *self.cli_options(output_dir), *grant, "--", "run-bench", *mode],
                      lambda stdout: session_report(stdout, output_dir))

    def session(self, *mode: str, grant: tuple[str, ...] = ()) -> Run:
        return self.start_session(*mode, grant=grant).conclude()

    def baseline(self, order: str) -> Run:
        """One SDK baseline process in `order` (sdk_baseline.ORDERS), timed like a session's
        host."""
        output_dir = self.output_dir()
        spec_path = output_dir.with_suffix(".json")
        spec_path.write_text(json.dumps({**self.baseline_spec(output_dir), "order": order}))
        return launch([sys.executable, str(SDK_BASELINE), str(spec_path)], json.loads).conclude()

    def baseline_spec(self, output_dir: Path) -> dict[str, Any]:
        """What sdk_baseline.py creates: the session's two containers, planned by reploy's own
        admission from the options a session gets, as Engine API arguments."""
        reploy, api = self.reploy, self.backend.api
        args = reploy.build_parser().parse_args(
            ["controlled-session", "run", *self.cli_options(output_dir)])
        options = reploy.parse_run_options(args, ["run-bench", "baseline"])
        plan = reploy.plan(options, *reploy.admit(options))
        runtime = plan.controller_blueprint.runtime
        os.chown(output_dir, runtime.uid, runtime.gid)  # as the host does for --output-dir
        labels = {BASELINE_LABEL: plan.run_id}
        return {"workload": workload_spec(reploy, plan.workload, labels).create_kwargs(api),
                "controller": controller_spec(reploy, self.backend, plan, output_dir,
                                              labels).create_kwargs(api),
                "columns": options.columns, "rows": options.rows,
                "controller_report": str(output_dir / bench_controller.REPORT_NAME)}


def session_report(stdout: bytes, output_dir: Path) -> dict[str, Any]:
    """The controller's report, once the host's result says the session went right."""
    result = json.loads(stdout)
    if not result.get("ok"):
        raise BenchFailed(f"the session failed: {stdout.decode(errors='replace')}")
    return json.loads((output_dir / bench_controller.REPORT_NAME).read_text())


# ============================================================================================
# Setting up and cleaning up
# ============================================================================================


def reploy_cli(roles_dir: Path, *args: str) -> None:
    proc = subprocess.run([sys.executable, str(roles_dir / "reploy.py"), *args],
                          capture_output=True, timeout=PROCESS_TIMEOUT_S)
    if proc.returncode != 0:
        raise BenchFailed(f"reploy {args[0]}: {proc.stderr.decode(errors='replace')}")


def stage_and_build(roles_dir: Path, blueprint: Path, directory: Path) -> Path:
    reploy_cli(roles_dir, "stage", str(blueprint), "--dir", str(directory))
    reploy_cli(roles_dir, "build", "--dir", str(directory))
    return directory


def copy_role_files(checkout: Path, work: Path) -> Path:
    """The role files of a checkout, copied into work/roles (Bench.roles_dir), with their
    bytecode cached beside them as `pip install` leaves it, and as the first session on a
    machine that lets Python cache bytecode does: this machine sets PYTHONDONTWRITEBYTECODE,
    under which the host's siblings would be compiled afresh by every session
    (bench/README.md, "Controlled ready: the client's command line, the siblings' bytecode")."""
    roles_dir = work / "roles"
    roles_dir.mkdir(parents=True)
    for name in ROLE_FILES:
        shutil.copy2(checkout / name, roles_dir / name)
        if name.endswith(".py"):
            py_compile.compile(str(roles_dir / name), doraise=True)
    return roles_dir


def against(bench: Bench, checkout: Path) -> Bench:
    """The same deployments and watchdog, with another checkout's role files: its sessions
    time that version of the host against this one's in the same run."""
    work = bench.work / "against"
    copy_role_files(checkout, work)
    return replace(bench, work=work)


def prepare(work: Path) -> Bench:
    """Copy the role files, point the sessions at a watchdog of the bench's own (apart from
    any live sessions on the machine), then stage and build the bench controller and the
    workload."""
    roles_dir = copy_role_files(ROOT, work)
    source = work / "controller-source"
    shutil.copytree(CONTROLLER_SOURCE, source)
    shutil.copy2(DRIVER_SOURCE, source / "context")
    reploy = load_reploy(roles_dir)
    os.environ[reploy.reploy_watchdog.RUNTIME_DIR_ENV] = str(watchdog_dir(work))
    return Bench(
        work=work, reploy=reploy, backend=reploy.DockerBackend(),
        controller_dir=stage_and_build(roles_dir, source / "bench.blueprint.yaml",
                                       work / "controller"),
        workload_dir=stage_and_build(roles_dir, WORKLOAD_BLUEPRINT, work / "workload"),
        numbers=itertools.count())


def watchdog_dir(work: Path) -> Path:
    return work / "watchdog"


def await_watchdog_exit(bench: Bench) -> None:
    """The bench's watchdog exits a few seconds after its last session; wait for its lock."""
    runtime_dir = watchdog_dir(bench.work)
    try:
        fd = os.open(runtime_dir / bench.reploy.reploy_watchdog.LOCK_NAME, os.O_RDWR)
    except FileNotFoundError:
        return
    deadline = time.monotonic() + PROCESS_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                time.sleep(0.05)  # polling for a condition, with a deadline
        log(f"the watchdog of {runtime_dir} did not exit")
    finally:
        os.close(fd)


def sweep(bench: Bench) -> list[str]:
    """Remove whatever the run's sessions or baselines left, and name it: there should be
    nothing, since hosts and baselines clean up after themselves."""
    workload_dir = bench.reploy.load_deployment(bench.workload_dir).dir
    filters = [{"label": BASELINE_LABEL},
               {"label": f"{bench.reploy.reploy_watchdog.LABEL_WORKLOAD_DIR}={workload_dir}"}]
    left = []
    for container_filter in filters:
        for container in bench.backend.client.containers.list(all=True, filters=container_filter):
            left.append(f"container {container.short_id} {container.labels}")
            container.remove(force=True)
    remove_built_images(bench)
    return left


def remove_built_images(bench: Bench) -> None:
    """The images the run built (its two deployments, and the derived controller images made
    from them, which carry the same label): a run leaves none behind. Derived images go first:
    the engine refuses to remove a parent before its children."""
    reploy = bench.reploy
    ids = {reploy.load_deployment(d).deployment_id for d in (bench.controller_dir, bench.workload_dir)}
    images = [image for image in bench.backend.api.images(filters={"label": reploy.LABEL_DEPLOYMENT})
              if (image.get("Labels") or {}).get(reploy.LABEL_DEPLOYMENT) in ids]
    images.sort(key=lambda image: reploy.LABEL_DERIVED_BASE not in (image.get("Labels") or {}))
    for image in images:
        bench.backend.api.remove_image(image["Id"], force=True)


# ============================================================================================
# The measurements
# ============================================================================================


@dataclass
class ReadyRuns:
    """The ready and teardown runs of each kind, alternated so drift on the machine hits all
    alike."""

    sessions: list[Run]
    granted: list[Run]
    baselines: list[Run]  # the SDK in the overlapped order
    contract_baselines: list[Run]  # the SDK in seed 000's order
    other_sessions: list[Run]  # sessions of --against's role files


def ready_and_teardown(bench: Bench, other: Bench | None) -> ReadyRuns:
    """One run of each kind per round, in an order shuffled every round (seeded: the same on
    every run), so that no kind always follows the same one (bench/README.md, "Against the
    contract's order", says what a fixed order did)."""
    runs = ReadyRuns([], [], [], [], [])
    kinds: list[tuple[list[Run], Callable[[], Run]]] = [
        (runs.sessions, lambda: bench.session("session")),
        (runs.contract_baselines, lambda: bench.baseline("contract")),
        (runs.granted, lambda: bench.session("session", grant=GRANT)),
        (runs.baselines, lambda: bench.baseline("overlapped")),
    ]
    if other is not None:
        kinds.insert(1, (runs.other_sessions, lambda: other.session("session")))
    for round_number in range(READY_RUNS):
        order = list(kinds)
        random.Random(round_number).shuffle(order)
        for samples, timed_run in order:
            samples.append(timed_run())
    return runs


def uncached_ready_ms(bench: Bench) -> list[float]:
    """Ready of the first session after the derived controller image is gone, as after a new
    controller build: the host builds the image and probes it for python3 while starting."""
    controller = bench.reploy.load_deployment(bench.controller_dir)
    samples = []
    for _ in range(UNCACHED_RUNS):
        reference = bench.reploy.ensure_controller_image(bench.backend,
                                                         controller.current.image_id)
        bench.backend.remove_image(reference)
        samples.append(bench.session("session").ready_ms)
    return samples


def direct_stream(bench: Bench) -> dict[str, Any]:
    """The stream figures' baseline: the same Probe on the workload container's own attach
    stream, read here with the SDK, no session in between."""
    workload = bench.reploy.load_deployment(bench.workload_dir)
    spec = workload_spec(bench.reploy, workload, {BASELINE_LABEL: "direct"})
    api = bench.backend.api
    with contextlib.ExitStack() as owned:
        container_id = sdk_baseline.create_owned(api, spec.create_kwargs(api), owned)
        pty = sdk_baseline.start_attached(api, container_id, owned,
                                          bench.reploy.DEFAULT_COLUMNS, bench.reploy.DEFAULT_ROWS)
        probe = bench_controller.Probe(pty.sendall, pty.fileno())
        return {"throughput_mib_s": [probe.throughput(THROUGHPUT_BYTES)
                                     for _ in range(THROUGHPUT_ROUNDS)],
                "echo_ms": probe.echo_round_trips(ECHO_KEYSTROKES)}


def watchdog_mib(bench: Bench) -> float:
    """RSS of the machine's watchdog (the bench's own: see prepare()), found through the
    live sessions' manifests, which name it."""
    reploy_watchdog = bench.reploy.reploy_watchdog
    manifests = (bench.reploy.load_deployment(bench.workload_dir).state_dir / "watchdog").glob(
        "*.json")
    identities = {reploy_watchdog.Manifest.load(path).watchdog for path in manifests}
    if len(identities) != 1 or not reploy_watchdog.identity_alive(next(iter(identities))):
        raise BenchFailed(f"the live sessions name no single live watchdog: {identities}")
    pid = int(next(iter(identities)).split(":")[0])
    return psutil.Process(pid).memory_info().rss / MIB


def release(pending: Pending, output_dir: Path) -> None:
    """Tell a holding controller to end its session; a host whose controller is not holding
    (it failed on the way) is cancelled instead, which cleans up just the same."""
    try:
        fd = os.open(output_dir / bench_controller.RELEASE_FIFO_NAME,
                     os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno != errno.ENXIO:
            raise
        pending.proc.terminate()
        return
    with os.fdopen(fd, "w") as fifo:
        fifo.write("go\n")


def density_mib(bench: Bench, count: int) -> list[float]:
    """Host-side MiB per session while `count` sessions are live at once: its host's RSS plus
    its share of the watchdog's (divided by the `count` sessions it serves)."""
    held: list[tuple[Pending, Path]] = []
    try:
        for _ in range(count):
            output_dir = bench.output_dir()
            fifo = output_dir / bench_controller.RELEASE_FIFO_NAME
            os.mkfifo(fifo)
            os.chmod(fifo, 0o666)  # the controller's runtime user reads it
            held.append((bench.start_session("hold", output_dir=output_dir), output_dir))
        for _, output_dir in held:
            sdk_baseline.await_report(output_dir / bench_controller.HELD_NAME, HOLD_DEADLINE_S)
        watchdog_share_mib = watchdog_mib(bench) / count
        return [psutil.Process(pending.proc.pid).memory_info().rss / MIB + watchdog_share_mib
                for pending, _ in held]
    finally:
        for pending, output_dir in held:
            release(pending, output_dir)
        conclude_all([pending for pending, _ in held])


def conclude_all(pending: list[Pending]) -> None:
    """Wait for every process before reporting the first failure, so none outlives the bench."""
    failures = []
    for one in pending:
        try:
            one.conclude()
        except (BenchFailed, TimeoutError) as e:
            failures.append(e)
    if failures:
        raise failures[0]


def ready_figures(bench: Bench, other: Bench | None) -> tuple[list[dict[str, Any]], ReadyRuns]:
    """Ready and teardown, of every kind, interleaved (ready_and_teardown)."""
    log(f"ready and teardown: {READY_RUNS} sessions, {READY_RUNS} granted sessions, "
        f"{READY_RUNS} SDK baselines in each order"
        + (f" and {READY_RUNS} sessions of the other checkout" if other is not None else ""))
    runs = ready_and_teardown(bench, other)
    sessions, granted, baselines = runs.sessions, runs.granted, runs.baselines
    cached = [run.ready_ms for run in sessions]
    figures = [
        figure("session_ready", "ms", cached, [run.ready_ms for run in baselines]),
        figure("session_ready_vs_contract_order", "ms", cached,
               [run.ready_ms for run in runs.contract_baselines]),
        figure("session_teardown", "ms", [run.teardown_ms for run in sessions],
               [run.teardown_ms for run in baselines]),
        figure("session_ready_granted", "ms", [run.ready_ms for run in granted], cached),
        figure("session_teardown_granted", "ms", [run.teardown_ms for run in granted],
               [run.teardown_ms for run in sessions]),
    ]
    if other is not None:
        figures += [
            figure("session_ready_vs_against", "ms", cached,
                   [run.ready_ms for run in runs.other_sessions]),
            figure("session_teardown_vs_against", "ms", [run.teardown_ms for run in sessions],
                   [run.teardown_ms for run in runs.other_sessions]),
        ]
    return figures, runs


def stream_report(bench: Bench) -> dict[str, Any]:
    """One session's throughput rounds and echo round trips, as its controller measured them."""
    return bench.session("stream", str(THROUGHPUT_ROUNDS), str(THROUGHPUT_BYTES),
                         str(ECHO_KEYSTROKES)).report


def stream_figures(bench: Bench, other: Bench | None) -> list[dict[str, Any]]:
    """Throughput and echo of one session between two direct attaches (and, with --against,
    one session of the other checkout's right after ours, against the same direct ones)."""
    log(f"throughput ({THROUGHPUT_ROUNDS} x {THROUGHPUT_BYTES // MIB} MiB) and echo "
        f"({ECHO_KEYSTROKES} keystrokes): a direct attach, one session"
        + (", one of the other checkout" if other is not None else "")
        + ", a direct attach again")
    before = direct_stream(bench)
    stream = stream_report(bench)
    other_stream = stream_report(other) if other is not None else None
    after = direct_stream(bench)
    direct_mib_s = before["throughput_mib_s"] + after["throughput_mib_s"]
    direct_echo_ms = before["echo_ms"] + after["echo_ms"]
    figures = [figure("terminal_throughput", "MiB/s", stream["throughput_mib_s"], direct_mib_s),
               figure("keystroke_echo", "ms", stream["echo_ms"], direct_echo_ms)]
    if other_stream is not None:
        figures += [figure("terminal_throughput_against", "MiB/s",
                           other_stream["throughput_mib_s"], direct_mib_s),
                    figure("keystroke_echo_against", "ms", other_stream["echo_ms"],
                           direct_echo_ms)]
    return figures


def measure(bench: Bench, only: str | None, other: Bench | None) -> list[dict[str, Any]]:
    log("warm-up session (builds the derived controller image)")
    bench.session("session")
    if other is not None:
        other.session("session")
    if only == "stream":
        return stream_figures(bench, other)
    figures, runs = ready_figures(bench, other)
    if only == "ready":
        return figures
    log(f"ready without a cached derived controller image: {UNCACHED_RUNS} sessions")
    cached = [run.ready_ms for run in runs.sessions]
    figures.append(figure("session_ready_uncached", "ms", uncached_ready_ms(bench), cached))
    figures += stream_figures(bench, None)
    sdk_rss_mib = [run.report["rss_bytes"] / MIB for run in runs.baselines]
    for count in DENSITY_SESSIONS:
        log(f"host memory with {count} live session(s)")
        figures.append(figure(f"host_rss_per_session_{count}", "MiB", density_mib(bench, count),
                              sdk_rss_mib))
    return figures


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_sessions.py")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--ready-only", dest="only", action="store_const", const="ready",
                      help="only the ready and teardown figures")
    only.add_argument("--stream-only", dest="only", action="store_const", const="stream",
                      help="only the throughput and echo figures")
    parser.add_argument("--against", type=Path, metavar="CHECKOUT",
                        help="also time sessions of this checkout's role files (e.g. a "
                             "worktree of main), interleaved: the *_vs_against figures (with "
                             "--stream-only, the *_against figures)")
    args = parser.parse_args(argv)
    if args.against is not None and not all((args.against / name).is_file()
                                            for name in ROLE_FILES):
        parser.error(f"--against {args.against}: not a checkout holding {', '.join(ROLE_FILES)}")
    work = Path(tempfile.mkdtemp(prefix="reploy-bench-"))
    bench = None
    try:
        bench = prepare(work)
        try:
            other = against(bench, args.against) if args.against is not None else None
            figures = measure(bench, args.only, other)
        finally:
            left = sweep(bench)
        if left:
            raise BenchFailed(f"left behind (now removed): {left}")
    except (BenchFailed, TimeoutError) as e:
        log(f"failed: {e}")
        return 1
    finally:
        if bench is not None:
            await_watchdog_exit(bench)
        shutil.rmtree(work, ignore_errors=True)
    print_table(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
