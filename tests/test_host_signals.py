"""Signals from the first instant (issue 29): SIGINT and SIGTERM delivered to real hosts at
random points of their first seconds.

reploy.py holds both signals from its first statement (before that, the interpreter's own
start, nothing of the file runs and its defaults rule), across its re-execution, until the
host's handlers are in place. Each trial waits for the hold to show in /proc (the start of
the file's own code), then signals at a random instant spread over the rest of the start: the
first interpreter, the re-execution, the second interpreter, the imports, parsing, admission.
Admission then blocks without end on a FIFO where the controller's state.json belongs, so the
run cannot finish before the signal: every trial must end 130/143 with exactly one result
that the strict checker accepts, saying `cancelled by SIG...`. A command line that does not
parse stays a usage error whatever signal came: 2, nothing on stdout.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import contract_rules
from conftest import ROOT
from test_cli import CONTROLLER, WORKLOAD, run_args, staged

#: How many hosts are signalled, and how many at once (the machine has two cores).
TRIALS = 200
CONCURRENT_TRIALS = 4
#: The held signals' bits in /proc/PID/status's SigBlk (bit N-1 for signal N).
HELD_MASK = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
EXIT_FOR_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}
#: Bounds of waiting for a condition (not timing assertions: a trial past them has hung).
HOLD_DEADLINE_S = 60.0
RESULT_DEADLINE_S = 60.0


def signal_mask(pid: int, field: str) -> int:
    """A signal mask of the process's /proc status (SigBlk: blocked, SigCgt: with a handler);
    0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1], 16)
    except FileNotFoundError:
        pass
    return 0


def start_held(argv: list[str]) -> tuple[subprocess.Popen, float]:
    """A host started on `argv`, once its first statement has held the signals, and when."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "reploy.py"), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + HOLD_DEADLINE_S
    while signal_mask(proc.pid, "SigBlk") & HELD_MASK != HELD_MASK:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the host never held its signals"
        time.sleep(0.001)  # polling for a condition, with a deadline
    return proc, time.monotonic()


def signalled(argv: list[str], signum: int, delay_s: float) -> subprocess.CompletedProcess:
    """Run a host, signal it `delay_s` after its hold, and collect how it ended."""
    proc, held_at = start_held(argv)
    try:
        time.sleep(max(0.0, held_at + delay_s - time.monotonic()))  # the trial's random instant
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=RESULT_DEADLINE_S)
    finally:
        proc.kill()
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.fixture
def blocking_deployments(tmp_path: Path):
    """A controller whose state.json is a FIFO nobody writes (admission blocks reading it),
    and a workload; the FIFO is removed after (it would block whoever reads it next)."""
    controller = staged(tmp_path, CONTROLLER, "c")
    workload = staged(tmp_path, WORKLOAD, "w")
    state = controller / ".reploy/state.json"
    state.unlink()
    os.mkfifo(state)
    try:
        yield controller, workload
    finally:
        state.unlink()


def has_reader(fifo: Path) -> bool:
    """Whether someone has the FIFO open for reading, or is opening it (which a writer's
    opening, closed at once, lets through: the trial that asks is over then)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError as e:
        assert e.errno == errno.ENXIO, e  # no reader yet
        return False
    return True


def start_span_s(argv: list[str], fifo: Path) -> float:
    """How long this machine takes from a host's hold to its admission blocking on the FIFO:
    the span the trials' instants are spread over (and a little past it)."""
    proc, held_at = start_held(argv)
    try:
        deadline = time.monotonic() + RESULT_DEADLINE_S
        while not has_reader(fifo):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "admission never opened state.json"
            time.sleep(0.001)  # polling for a condition, with a deadline
        return time.monotonic() - held_at
    finally:
        proc.kill()
        proc.communicate()


def test_a_signal_at_any_instant_of_the_start_gets_one_result_and_its_exit_code(
        blocking_deployments: tuple[Path, Path]) -> None:
    controller, workload = blocking_deployments
    argv = run_args(controller, workload, "--", "run-controller")
    span_s = start_span_s(argv, controller / ".reploy/state.json") * 1.25
    rng = random.Random()
    trials = [(rng.choice(tuple(EXIT_FOR_SIGNAL)), rng.uniform(0.0, span_s))
              for _ in range(TRIALS)]
    with ThreadPoolExecutor(CONCURRENT_TRIALS) as pool:
        ended = list(pool.map(lambda trial: signalled(argv, *trial), trials))
    failures = []
    for (signum, delay_s), proc in zip(trials, ended):
        name = signal.Signals(signum).name
        try:
            result = contract_rules.check_reploy_result_line(proc.stdout)
            assert proc.returncode == EXIT_FOR_SIGNAL[signum]
            assert result["error"] == f"cancelled by {name}"
            assert all(result[key] is None for key in contract_rules.RESULT_KEYS[3:])
            assert b"Traceback" not in proc.stderr
        except (AssertionError, contract_rules.ContractViolation) as e:
            failures.append(f"{name} {delay_s:.3f}s after the hold: exit {proc.returncode}, "
                            f"{e!r}, stdout {proc.stdout[:200]!r}, stderr {proc.stderr[-300:]!r}")
    assert not failures, f"{len(failures)} of {TRIALS} (span {span_s:.2f}s):\n" + "\n".join(
        failures[:10])


@pytest.mark.parametrize("signum", tuple(EXIT_FOR_SIGNAL))
def test_a_signal_held_through_a_usage_error_leaves_it_a_usage_error(tmp_path: Path,
                                                                    signum: int) -> None:
    """Before valid parsing there is no result to give: the signal changes nothing."""
    proc = signalled(run_args(tmp_path / "c", tmp_path / "w", "--columns", "0", "--rows", "1",
                              "--", "x"), signum, 0.0)
    assert (proc.returncode, proc.stdout) == (2, b"")
    assert b"--columns must be from 1 to 65535" in proc.stderr


def test_a_sigint_the_host_was_started_ignoring_stays_ignored_at_every_instant(
        blocking_deployments: tuple[Path, Path]) -> None:
    """A background job of a non-interactive shell starts with SIGINT ignored, and the kernel
    discards an ignored signal before the file's first statement can hold it. So the host keeps
    the inherited disposition for the whole run, instead of honouring SIGINT only from its
    handlers on: whenever SIGINT comes, the run goes on, and the SIGTERM sent once the host's
    handlers are in place is the signal that ends it (143, `cancelled by SIGTERM`)."""
    controller, workload = blocking_deployments
    argv = run_args(controller, workload, "--", "run-controller")
    span_s = start_span_s(argv, controller / ".reploy/state.json") * 1.25
    rng = random.Random()
    delays = [rng.uniform(0.0, span_s) for _ in range(TRIALS // 8)]

    def trial(delay_s: float) -> subprocess.CompletedProcess:
        proc = subprocess.Popen([sys.executable, str(ROOT / "reploy.py"), *argv],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        try:
            started = time.monotonic()
            time.sleep(delay_s)  # the trial's random instant
            proc.send_signal(signal.SIGINT)
            deadline = started + RESULT_DEADLINE_S
            while not signal_mask(proc.pid, "SigCgt") & (1 << (signal.SIGTERM - 1)):
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the host never caught SIGTERM"
                time.sleep(0.001)  # polling for its handlers, with a deadline
            proc.send_signal(signal.SIGTERM)
            stdout, stderr = proc.communicate(timeout=RESULT_DEADLINE_S)
        finally:
            proc.kill()
            proc.wait()
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

    with ThreadPoolExecutor(CONCURRENT_TRIALS) as pool:
        ended = list(pool.map(trial, delays))
    failures = []
    for delay_s, proc in zip(delays, ended):
        try:
            result = contract_rules.check_reploy_result_line(proc.stdout)
            assert proc.returncode == EXIT_FOR_SIGNAL[signal.SIGTERM]
            assert result["error"] == "cancelled by SIGTERM"
        except (AssertionError, contract_rules.ContractViolation) as e:
            failures.append(f"SIGINT {delay_s:.3f}s after the start: exit {proc.returncode}, "
                            f"{e!r}, stdout {proc.stdout[:200]!r}, stderr {proc.stderr[-300:]!r}")
    assert not failures, f"{len(failures)} of {len(delays)} (span {span_s:.2f}s):\n" + "\n".join(
        failures[:10])
