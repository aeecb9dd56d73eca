"""The machine's watchdog without a Docker engine: its protocol and per-run state as a pure
core (every message rule, every transition), then the real process over real unix sockets:
exactly one per runtime directory however many hosts start it at once, replaced when killed,
gone after its last session, and a dead host's receipt even when the engine is unreachable."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import psutil
import pytest

import reploy_watchdog as wd
from conftest import ROOT, wait_watchdog_exit, watchdog_running

RUN_A, RUN_B = "a" * 32, "b" * 32
HOST, OTHER_HOST = "100:1700000000.5", "200:1700000001.25"
WATCHDOG = "300:1700000002.0"
WAIT_S = 60.0
RECEIPT_FIELDS = {"schema", "run_id", "time", "trigger", "host", "removed",
                  "cleanup_succeeded", "errors"}


def manifest_path(run_id: str, workload_dir: str = "/w") -> str:
    return str(wd.manifest_path_for(workload_dir, run_id))


def manifest(run_id: str, host: str = HOST, workload_dir: str = "/w") -> wd.Manifest:
    return wd.Manifest(run_id=run_id, host=host, watchdog="", containers={}, networks={},
                       paths=(), receipt_path=str(wd.receipt_path_for(workload_dir, run_id)))


def arm_line(run_id: str, **overrides: Any) -> bytes:
    fields = {"type": "arm", "run_id": run_id, "manifest": manifest_path(run_id),
              "docker_env": {}, **overrides}
    return json.dumps(fields).encode() + b"\n"


def disarm_line(run_id: str) -> bytes:
    return json.dumps({"type": "disarm", "run_id": run_id}).encode() + b"\n"


# ---------------------------------------------------------------------------------------------
# The codec
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("message, allowed", [
    (wd.Arm(RUN_A, manifest_path(RUN_A), (("DOCKER_HOST", "unix:///x.sock"),)), wd.HOST_MESSAGES),
    (wd.Disarm(RUN_A), wd.HOST_MESSAGES),
    (wd.Armed(RUN_A, WATCHDOG), wd.WATCHDOG_MESSAGES),
    (wd.Refused("no"), wd.WATCHDOG_MESSAGES),
])
def test_every_message_round_trips(message: wd.Message, allowed: frozenset[Any]) -> None:
    line = wd.encode(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert wd.decode(line[:-1], allowed) == message


BAD_HOST_LINES = {
    "not UTF-8": b'{"type": "disarm", "run_id": "\xff"}',
    "not JSON": b"{",
    "trailing data": disarm_line(RUN_A)[:-1] + b" {}",
    "not an object": b'["disarm"]',
    "NaN": b'{"type": "disarm", "run_id": NaN}',
    "duplicate field": b'{"type": "disarm", "run_id": "' + RUN_A.encode() + b'", "run_id": "x"}',
    "unknown field": b'{"type": "disarm", "run_id": "' + RUN_A.encode() + b'", "x": 1}',
    "missing field": b'{"type": "arm", "run_id": "' + RUN_A.encode() + b'", "docker_env": {}}',
    "no type": b'{"run_id": "' + RUN_A.encode() + b'"}',
    "unknown type": b'{"type": "status"}',
    "unhashable type": b'{"type": ["arm"]}',
    "a watchdog's message": b'{"type": "refused", "message": "x"}',
    "upper-case run id": disarm_line(RUN_A.upper())[:-1],
    "short run id": disarm_line("a" * 31)[:-1],
    "run id not a string": b'{"type": "disarm", "run_id": 7}',
    "relative manifest": arm_line(RUN_A, manifest=f"w/.reploy/watchdog/{RUN_A}.json")[:-1],
    "manifest not normalised": arm_line(
        RUN_A, manifest=f"/w/x/../.reploy/watchdog/{RUN_A}.json")[:-1],
    "manifest of another run": arm_line(RUN_A, manifest=manifest_path(RUN_B))[:-1],
    "manifest elsewhere": arm_line(RUN_A, manifest=f"/w/.reploy/other/{RUN_A}.json")[:-1],
    "manifest under /": arm_line(RUN_A, manifest=f"/.reploy/watchdog/{RUN_A}.json")[:-1],
    "manifest with NUL": arm_line(RUN_A, manifest=f"/w\0/.reploy/watchdog/{RUN_A}.json")[:-1],
    "docker_env not an object": arm_line(RUN_A, docker_env=[["DOCKER_HOST", "x"]])[:-1],
    "docker_env foreign name": arm_line(RUN_A, docker_env={"PATH": "/bin"})[:-1],
    "docker_env value not a string": arm_line(RUN_A, docker_env={"DOCKER_HOST": 1})[:-1],
    "docker_env too large": arm_line(
        RUN_A, docker_env={f"DOCKER_{i}": "x" for i in range(wd.MAX_DOCKER_ENV_ENTRIES + 1)})[:-1],
}


@pytest.mark.parametrize("case", sorted(BAD_HOST_LINES))
def test_a_host_message_breaking_a_rule_is_refused(case: str) -> None:
    with pytest.raises(wd.ProtocolError):
        wd.decode(BAD_HOST_LINES[case], wd.HOST_MESSAGES)


@pytest.mark.parametrize("line", [
    b'{"type": "armed", "run_id": "' + RUN_A.encode() + b'", "watchdog": "me"}',
    b'{"type": "armed", "run_id": "' + RUN_A.encode() + b'"}',
    b'{"type": "refused", "message": ""}',
    b'{"type": "refused", "message": "' + b"x" * (wd.MAX_REFUSAL_CHARS + 1) + b'"}',
    disarm_line(RUN_A)[:-1],  # a host's message
])
def test_a_watchdog_message_breaking_a_rule_is_refused(line: bytes) -> None:
    with pytest.raises(wd.ProtocolError):
        wd.decode(line, wd.WATCHDOG_MESSAGES)


def test_an_oversized_message_cannot_be_encoded() -> None:
    huge = tuple((f"DOCKER_{i}", "x" * wd.MAX_DOCKER_ENV_VALUE_CHARS) for i in range(8))
    with pytest.raises(wd.ProtocolError):
        wd.encode(wd.Arm(RUN_A, manifest_path(RUN_A), huge))


def test_line_buffer_reassembles_lines_and_bounds_them() -> None:
    buffer = wd.LineBuffer()
    line = disarm_line(RUN_A)
    assert buffer.feed(line[:5]) == []
    assert buffer.feed(line[5:] + line + line[:3]) == [line[:-1], line[:-1]]
    assert buffer.pending == line[:3]  # dropped if the stream ends here
    with pytest.raises(wd.ProtocolError):
        wd.LineBuffer().feed(b"x" * wd.MAX_MESSAGE_BYTES)
    with pytest.raises(wd.ProtocolError):
        wd.LineBuffer().feed(b"x" * wd.MAX_MESSAGE_BYTES + b"\n")


# ---------------------------------------------------------------------------------------------
# The per-run state
# ---------------------------------------------------------------------------------------------


def test_only_the_listed_transitions_exist() -> None:
    for phase in [None, *wd.RunPhase]:
        for event in wd.RunEvent:
            if (phase, event) in wd.RUN_TRANSITIONS:
                assert wd.next_phase(phase, event) == wd.RUN_TRANSITIONS[(phase, event)]
            else:
                with pytest.raises(RuntimeError):
                    wd.next_phase(phase, event)


def make_core(manifests: dict[str, Any] | None = None) -> wd.WatchdogCore:
    """A core whose disk holds `manifests` (path -> Manifest, or an exception to raise)."""
    disk = {manifest_path(run): manifest(run) for run in (RUN_A, RUN_B)}
    disk.update(manifests or {})

    def read(path: Path) -> wd.Manifest:
        found = disk.get(str(path), FileNotFoundError(str(path)))
        if isinstance(found, Exception):
            raise found
        return found

    return wd.WatchdogCore(WATCHDOG, read)


def armed_core(run_id: str = RUN_A, connection: int = 1) -> wd.WatchdogCore:
    core = make_core()
    core.connected(connection, HOST)
    assert core.received(connection, arm_line(run_id)) == [
        wd.Reply(connection, wd.Armed(run_id, WATCHDOG))]
    return core


def refused(actions: list[Any], connection: int) -> bool:
    return (len(actions) == 2 and actions[0].connection == connection
            and isinstance(actions[0].message, wd.Refused)
            and actions[1] == wd.Hangup(connection))


def test_arm_then_disarm_then_end_leaves_nothing() -> None:
    core = armed_core()
    assert core.runs[RUN_A].phase is wd.RunPhase.ARMED and not core.idle
    assert core.received(1, disarm_line(RUN_A)) == []
    assert RUN_A not in core.runs
    assert core.closed(1) == [] and core.idle


def test_the_connection_ending_while_armed_cleans_up() -> None:
    core = armed_core()
    docker_env = {"DOCKER_HOST": "unix:///other.sock"}
    core.connected(2, HOST)
    core.received(2, arm_line(RUN_B, docker_env=docker_env))
    assert core.closed(1) == [wd.Clean(RUN_A, Path(manifest_path(RUN_A)), "host-exited", ())]
    assert core.runs[RUN_A].phase is wd.RunPhase.CLEANING and not core.idle
    assert core.closed(2) == [wd.Clean(RUN_B, Path(manifest_path(RUN_B)), "host-exited",
                                       (("DOCKER_HOST", "unix:///other.sock"),))]
    core.cleaned(RUN_A)
    core.cleaned(RUN_B)
    assert core.idle


@pytest.mark.parametrize("partial", [b"", arm_line(RUN_A)[:-1], b'{"type": "ar'])
def test_a_connection_ending_before_its_arm_is_complete_changes_nothing(partial: bytes) -> None:
    core = armed_core(RUN_B, connection=7)
    core.connected(1, HOST)
    assert core.received(1, partial) == []
    assert core.closed(1) == []
    assert RUN_A not in core.runs and core.runs[RUN_B].phase is wd.RunPhase.ARMED


@pytest.mark.parametrize("reason, disk", [
    ("missing", {manifest_path(RUN_A): FileNotFoundError("gone")}),
    ("unreadable", {manifest_path(RUN_A): ValueError("not a manifest")}),
    ("another run", {manifest_path(RUN_A): manifest(RUN_B)}),
    ("another host", {manifest_path(RUN_A): manifest(RUN_A, host=OTHER_HOST)}),
])
def test_an_arm_whose_manifest_does_not_hold_is_refused(reason: str, disk: dict[str, Any]) -> None:
    core = make_core(disk)
    core.connected(1, HOST)
    assert refused(core.received(1, arm_line(RUN_A)), 1)
    assert core.idle


def test_a_run_armed_elsewhere_cannot_be_armed_again() -> None:
    core = armed_core()
    core.connected(2, HOST)
    assert refused(core.received(2, arm_line(RUN_A)), 2)
    assert core.runs[RUN_A].connection == 1 and 2 not in core.connections


@pytest.mark.parametrize("second", [
    arm_line(RUN_B), disarm_line(RUN_B), b"garbage\n", b'{"type": "armed"}\n'])
def test_a_violation_detaches_the_run_until_its_host_arms_again(second: bytes) -> None:
    core = armed_core()
    assert refused(core.received(1, second), 1)
    run = core.runs[RUN_A]
    assert run.phase is wd.RunPhase.DETACHED and run.connection is None and 1 not in core.connections
    assert core.check_hosts(lambda identity: True) == []
    core.connected(2, OTHER_HOST)  # another host cannot take it over
    assert refused(core.received(2, arm_line(RUN_A)), 2)
    core.connected(3, HOST)  # its own host can
    assert core.received(3, arm_line(RUN_A)) == [wd.Reply(3, wd.Armed(RUN_A, WATCHDOG))]
    assert core.closed(3)[0].trigger == "host-exited"


def test_a_detached_run_whose_host_is_gone_is_cleaned_up() -> None:
    core = armed_core()
    core.received(1, b"garbage\n")
    assert core.check_hosts(lambda identity: identity != HOST) == [
        wd.Clean(RUN_A, Path(manifest_path(RUN_A)), "host-process-gone", ())]
    core.connected(2, HOST)
    assert refused(core.received(2, arm_line(RUN_A)), 2)  # being cleaned up
    core.cleaned(RUN_A)
    assert core.idle


def test_an_armed_host_gone_without_end_of_file_is_hung_up_on_and_cleaned_up() -> None:
    """One check's grace for the end of file, then the run is the watchdog's."""
    core = armed_core()
    assert core.check_hosts(lambda identity: False) == []
    assert 1 in core.connections
    actions = core.check_hosts(lambda identity: False)
    assert actions == [wd.Hangup(1), wd.Clean(RUN_A, Path(manifest_path(RUN_A)),
                                              "host-process-gone", ())]
    assert 1 not in core.connections


def test_an_end_of_file_after_the_host_was_seen_gone_says_host_exited() -> None:
    """The race the grace exists for: the host is gone at a check, its end of file is read after."""
    core = armed_core()
    assert core.check_hosts(lambda identity: False) == []
    assert core.closed(1) == [wd.Clean(RUN_A, Path(manifest_path(RUN_A)), "host-exited", ())]
    assert core.check_hosts(lambda identity: False) == []  # cleaning: nothing twice


def test_a_host_seen_alive_again_gets_its_grace_again() -> None:
    core = armed_core()
    assert core.check_hosts(lambda identity: False) == []
    assert core.check_hosts(lambda identity: True) == []
    assert core.check_hosts(lambda identity: False) == []
    assert core.check_hosts(lambda identity: False)[-1].trigger == "host-process-gone"


@pytest.mark.parametrize("line", [disarm_line(RUN_B), disarm_line(RUN_A)])
def test_disarm_needs_the_run_this_connection_armed_once(line: bytes) -> None:
    core = make_core()
    core.connected(1, HOST)
    assert refused(core.received(1, line), 1)  # before any arm
    core = armed_core()
    core.received(1, disarm_line(RUN_A))
    assert refused(core.received(1, line), 1)  # after the disarm, or for another run
    assert core.idle


def test_one_arm_per_connection_even_in_one_read() -> None:
    core = make_core()
    core.connected(1, HOST)
    actions = core.received(1, arm_line(RUN_A) + arm_line(RUN_B))
    assert actions[0] == wd.Reply(1, wd.Armed(RUN_A, WATCHDOG)) and refused(actions[1:], 1)
    assert RUN_B not in core.runs and core.runs[RUN_A].phase is wd.RunPhase.DETACHED


def test_manifest_reading_refuses_every_other_format(tmp_path: Path) -> None:
    good = manifest(RUN_A).to_json()
    path = tmp_path / "m.json"
    path.write_text(json.dumps(good))
    assert wd.Manifest.load(path) == manifest(RUN_A)
    variants = [
        b"{", b"[]", b"\xff", json.dumps({**good, "schema": "reploy-watchdog-manifest-v0"}).encode(),
        json.dumps({k: v for k, v in good.items() if k != "paths"}).encode(),
        json.dumps({**good, "future": 1}).encode(),
        json.dumps({**good, "containers": ["c"]}).encode(),
        json.dumps({**good, "containers": {"c": {"label": 1}}}).encode(),
        json.dumps({**good, "paths": "/x"}).encode(),
        json.dumps({**good, "host": None}).encode(),
    ]
    for variant in variants:
        path.write_bytes(variant)
        with pytest.raises(ValueError):
            wd.Manifest.load(path)


# ---------------------------------------------------------------------------------------------
# The real process
# ---------------------------------------------------------------------------------------------


def test_a_process_identity_does_not_move_with_the_boot_time_a_process_cached(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel recomputes its boot time from the wall clock, and psutil caches it once per
    process: a long-lived process (a pytest run, a serve of days) and a fresh one (its watchdog)
    could name one process by create times a second apart, and every arm or lease check between
    them would fail. An identity is the start in clock ticks since boot, which does not move."""
    import psutil._pslinux as linux

    monkeypatch.setattr(linux, "BOOT_TIME", psutil.boot_time() - 1.0)  # this process drifted
    mine = wd.process_identity()
    assert mine == wd.process_identity(os.getpid()) and wd.identity_alive(mine)
    fresh = subprocess.run([sys.executable, "-c", "import sys, reploy_watchdog as w; "
                            "print(w.identity_alive(sys.argv[1]), w.process_identity(int(sys.argv[2])))",
                            mine, str(os.getpid())], cwd=ROOT, capture_output=True, text=True, check=True)
    assert fresh.stdout.split() == ["True", mine]
    pid, _, ticks = mine.partition(":")
    assert not wd.identity_alive(f"{pid}:{int(ticks) + 1}") and not wd.identity_alive("1:x")
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()  # reaped: its /proc entry is gone
    with pytest.raises(wd.ProcessGone):
        wd.process_identity(exited.pid)


def write_manifest(workload: Path, run_id: str, host: str | None = None) -> Path:
    channel_dir = wd.channel_dir_for(str(workload), run_id)
    channel_dir.mkdir(parents=True, exist_ok=True)
    path = wd.manifest_path_for(str(workload), run_id)
    wd.atomic_write_json(path, wd.Manifest(
        run_id=run_id, host=host or wd.process_identity(), watchdog="",
        containers={"c" * 64: {wd.LABEL_RUN: run_id}}, networks={}, paths=(str(channel_dir),),
        receipt_path=str(wd.receipt_path_for(str(workload), run_id))).to_json())
    return path


def environ(watchdog_dir: Path, tmp_path: Path) -> dict[str, str]:
    """A host environment pointing at the test's watchdog and at no Docker engine."""
    return {**os.environ, wd.RUNTIME_DIR_ENV: str(watchdog_dir),
            "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)  # polling for a condition, with a deadline


def watchdog_process(link: wd.WatchdogLink) -> psutil.Process:
    process = psutil.Process(int(link.watchdog.split(":")[0]))
    assert wd.process_identity(process.pid) == link.watchdog
    return process


def test_one_watchdog_serves_every_run_and_exits_after_the_last(
        watchdog_dir: Path, tmp_path: Path) -> None:
    env = environ(watchdog_dir, tmp_path)
    link_a = wd.arm(RUN_A, write_manifest(tmp_path, RUN_A), env)
    link_b = wd.arm(RUN_B, write_manifest(tmp_path, RUN_B), env)
    assert link_a.watchdog == link_b.watchdog
    process = watchdog_process(link_a)
    assert os.getsid(process.pid) == process.pid and process.ppid() != os.getpid()
    assert process.cmdline()[-3:] == ["serve", "--runtime-dir", str(watchdog_dir)]
    link_a.disarm()
    link_b.disarm()
    assert wait_watchdog_exit(watchdog_dir)
    assert not (watchdog_dir / wd.SOCKET_NAME).exists()
    assert not (tmp_path / ".reploy/incidents").exists()  # disarmed: no receipt
    link_c = wd.arm(RUN_A, write_manifest(tmp_path, RUN_A), env)  # a new one on demand
    assert link_c.watchdog != link_a.watchdog
    link_c.disarm()


def test_hosts_arming_at_once_start_exactly_one_watchdog(watchdog_dir: Path,
                                                         tmp_path: Path) -> None:
    env = environ(watchdog_dir, tmp_path)
    runs = [f"{i:032x}" for i in range(1, 7)]
    paths = {run: write_manifest(tmp_path, run) for run in runs}
    links: dict[str, wd.WatchdogLink] = {}
    barrier = threading.Barrier(len(runs))

    def host(run: str) -> None:
        barrier.wait()
        links[run] = wd.arm(run, paths[run], env)

    threads = [threading.Thread(target=host, args=(run,)) for run in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert sorted(links) == runs
    assert len({link.watchdog for link in links.values()}) == 1
    for link in links.values():
        link.disarm()
    assert wait_watchdog_exit(watchdog_dir)


HOST_SCRIPT = """
import sys, time
sys.path.insert(0, sys.argv[1])
import reploy_watchdog as wd
from pathlib import Path
workload, run_id = Path(sys.argv[2]), sys.argv[3]
path = wd.manifest_path_for(str(workload), run_id)
channel_dir = wd.channel_dir_for(str(workload), run_id)
channel_dir.mkdir(parents=True)
wd.atomic_write_json(path, wd.Manifest(
    run_id=run_id, host=wd.process_identity(), watchdog="",
    containers={"c" * 64: {wd.LABEL_RUN: run_id}}, networks={}, paths=(str(channel_dir),),
    receipt_path=str(wd.receipt_path_for(str(workload), run_id))).to_json())
link = wd.arm(run_id, path)
print(link.watchdog, flush=True)
time.sleep(3600)
"""


def start_host(tmp_path: Path, run_id: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """A host stand-in that arms a run and waits to be killed; returns it and its watchdog."""
    proc = subprocess.Popen([sys.executable, "-c", HOST_SCRIPT, str(ROOT), str(tmp_path), run_id],
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_a_dead_host_gets_its_receipt_even_without_an_engine(watchdog_dir: Path,
                                                             tmp_path: Path) -> None:
    env = environ(watchdog_dir, tmp_path)
    survivor = wd.arm(RUN_B, write_manifest(tmp_path, RUN_B), env)
    host, watchdog = start_host(tmp_path, RUN_A, env)
    assert watchdog == survivor.watchdog
    host.kill()  # end of file without a disarm
    host.wait()
    receipt_path = wd.receipt_path_for(str(tmp_path), RUN_A)
    manifest_path_a = wd.manifest_path_for(str(tmp_path), RUN_A)
    # What could not be removed stays in the manifest, for the next reconciliation.
    wait_for(lambda: receipt_path.exists() and wd.Manifest.load(manifest_path_a).paths == (),
             "the receipt, then the manifest narrowed to what remains")
    remaining = wd.Manifest.load(manifest_path_a)
    assert list(remaining.containers) == ["c" * 64] and remaining.watchdog == ""
    receipt = json.loads(receipt_path.read_text())
    assert set(receipt) == RECEIPT_FIELDS and receipt["run_id"] == RUN_A
    assert receipt["trigger"] == "host-exited" and receipt["cleanup_succeeded"] is False
    assert receipt["errors"] and receipt["errors"][0].startswith("the Docker engine failed")
    channel_dir = wd.channel_dir_for(str(tmp_path), RUN_A)
    assert receipt["removed"]["paths"] == [str(channel_dir)] and not channel_dir.exists()
    assert receipt_path.stat().st_mode & 0o777 == 0o600
    # The other run is untouched and still guarded by the same watchdog.
    assert wd.manifest_path_for(str(tmp_path), RUN_B).exists()
    assert not wd.receipt_path_for(str(tmp_path), RUN_B).exists()
    assert select.select([survivor], [], [], 0)[0] == []
    survivor.disarm()
    assert wait_watchdog_exit(watchdog_dir)


def test_a_killed_watchdog_is_replaced_on_the_next_arm(watchdog_dir: Path,
                                                       tmp_path: Path) -> None:
    env = environ(watchdog_dir, tmp_path)
    path = write_manifest(tmp_path, RUN_A)
    link = wd.arm(RUN_A, path, env)
    first = watchdog_process(link)
    first.kill()
    first.wait(WAIT_S)
    # The host learns it from its link: readable, at end of file.
    assert select.select([link], [], [], WAIT_S)[0] == [link]
    assert link.sock.recv(1) == b""
    link.close()
    assert (watchdog_dir / wd.SOCKET_NAME).exists()  # a SIGKILLed watchdog leaves its socket
    again = wd.arm(RUN_A, path, env)
    assert again.watchdog != link.watchdog and watchdog_process(again).is_running()
    again.disarm()
    assert wait_watchdog_exit(watchdog_dir)


def test_hostile_or_half_written_arms_do_not_disturb_other_runs(watchdog_dir: Path,
                                                                tmp_path: Path) -> None:
    env = environ(watchdog_dir, tmp_path)
    host, watchdog = start_host(tmp_path, RUN_A, env)
    dir_fd = wd.open_runtime_dir(watchdog_dir)
    try:
        half = wd.connect(dir_fd)
        assert half is not None
        half.sendall(arm_line(RUN_B)[:20])
        half.close()
        for line in (b"garbage\n", arm_line(RUN_A), arm_line(RUN_B)):
            # garbage; a run armed by someone else; a manifest that does not exist
            peer = wd.connect(dir_fd)
            assert peer is not None
            peer.sendall(line)
            peer.settimeout(WAIT_S)
            reply = wd.decode(peer.recv(wd.MAX_MESSAGE_BYTES).rstrip(b"\n"), wd.WATCHDOG_MESSAGES)
            assert isinstance(reply, wd.Refused), reply
            assert peer.recv(1) == b""  # and hung up on
            peer.close()
    finally:
        os.close(dir_fd)
    with pytest.raises(wd.WatchdogUnavailable, match="unreadable manifest"):
        wd.arm(RUN_B, wd.manifest_path_for(str(tmp_path), RUN_B), env)
    # The guarded run is unaffected: its host's death still gets it cleaned up.
    host.kill()
    host.wait()
    receipt_path = wd.receipt_path_for(str(tmp_path), RUN_A)
    wait_for(receipt_path.exists, "the receipt")
    assert json.loads(receipt_path.read_text())["trigger"] == "host-exited"
    assert psutil.Process(int(watchdog.split(":")[0])).is_running()
    assert wait_watchdog_exit(watchdog_dir)


def test_the_runtime_directory_must_be_private(tmp_path: Path) -> None:
    path = write_manifest(tmp_path, RUN_A)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(wd.WatchdogUnavailable, match="mode 0700"):
        wd.arm(RUN_A, path, {wd.RUNTIME_DIR_ENV: str(shared)})
    (tmp_path / "link").symlink_to(shared)
    with pytest.raises(wd.WatchdogUnavailable, match="runtime directory"):
        wd.arm(RUN_A, path, {wd.RUNTIME_DIR_ENV: str(tmp_path / "link")})
    with pytest.raises(wd.WatchdogUnavailable, match="absolute"):
        wd.arm(RUN_A, path, {wd.RUNTIME_DIR_ENV: "relative"})
    assert not (shared / wd.SOCKET_NAME).exists()


def test_the_default_runtime_directory_is_per_user() -> None:
    assert wd.runtime_dir({}).name == f"reploy-{os.getuid()}"
    assert wd.runtime_dir({wd.RUNTIME_DIR_ENV: "/x/y"}) == Path("/x/y")


def test_a_second_serve_leaves_the_running_watchdog_alone(watchdog_dir: Path,
                                                          tmp_path: Path) -> None:
    link = wd.arm(RUN_A, write_manifest(tmp_path, RUN_A), environ(watchdog_dir, tmp_path))
    proc = subprocess.run([sys.executable, str(ROOT / "reploy_watchdog.py"), "serve",
                           "--runtime-dir", str(watchdog_dir)], timeout=WAIT_S)
    assert proc.returncode == wd.EXIT_BUSY
    assert watchdog_running(watchdog_dir) and select.select([link], [], [], 0)[0] == []
    link.disarm()
    assert wait_watchdog_exit(watchdog_dir)


def test_a_watchdog_ignores_terminal_signals(watchdog_dir: Path, tmp_path: Path) -> None:
    env = environ(watchdog_dir, tmp_path)
    link = wd.arm(RUN_A, write_manifest(tmp_path, RUN_A), env)
    for signum in (signal.SIGINT, signal.SIGHUP):
        watchdog_process(link).send_signal(signum)
    # Still the same watchdog: it answers the next arm.
    other = wd.arm(RUN_B, write_manifest(tmp_path, RUN_B), env)
    assert other.watchdog == link.watchdog
    assert select.select([link], [], [], 0)[0] == []
    link.disarm()
    other.disarm()
    assert wait_watchdog_exit(watchdog_dir)
