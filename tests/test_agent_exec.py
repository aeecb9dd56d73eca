"""exec through real agents: commands beside the workload, how they end, nothing left behind, the socket's
bounds kept by long-polls, and independence from a busy terminal or agent run."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import tarfile
import uuid

import psutil
import pytest

from agent_fixtures.harness import (AGENT_PY, AS_ROOT, FAKE_AGENT_ARGV, PYTHON, RUNTIME_USER,  # noqa: F401
                                    WORKLOAD_UID, agent, exec_finish, exec_start, run_exec, short_dir,
                                    start_agent, wait_until)


@pytest.fixture
def shell(start_agent):
    return start_agent("--workload", "shell", "--redact-env", "EXEC_TEST_SECRET",
                       env={"EXEC_TEST_SECRET": "s3cret-value", "EXEC_TEST_PLAIN": "plain"})


def marked(marker: str) -> list[psutil.Process]:
    """Live processes whose command line holds the marker."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if marker in " ".join(process.info["cmdline"] or []) and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


def sleeps(marker: str) -> int:
    return sum(1 for process in marked(marker) if process.info["cmdline"][:1] == ["sleep"])


def unique_sleep() -> str:
    """A sleep argument no other process has: 300.<random digits> seconds."""
    return f"300.{uuid.uuid4().int % 10**9:09d}"


def test_exit_codes_and_streams_apart(shell):
    ok = run_exec(shell, ["sh", "-c", "echo out; echo err >&2"])
    assert (ok["exit_code"], ok["signal"], ok["timed_out"], ok["killed"]) == (0, None, False, False)
    assert (ok["stdout"], ok["stderr"]) == (b"out\n", b"err\n")
    assert ok["duration_ms"] > 0 and ok["stdout_truncated"] is False
    three = run_exec(shell, ["sh", "-c", "printf partial; exit 3"])
    assert (three["exit_code"], three["signal"], three["stdout"]) == (3, None, b"partial")


def test_the_command_runs_in_the_workspace_with_the_sessions_home(shell):
    (shell.session_dir / "workspace" / "sub").mkdir()
    result = run_exec(shell, ["sh", "-c", 'pwd; echo "$HOME"; id -u; echo "$EXTRA $EXEC_TEST_PLAIN ${EXEC_TEST_SECRET:-unset}"'],
                      cwd="sub", env={"EXTRA": "given"})
    assert result["stdout"].decode().splitlines() == [
        str(shell.session_dir / "workspace" / "sub"), str(shell.session_dir / "home"), str(WORKLOAD_UID),
        "given plain unset"]  # redacted variables are for the agent CLI, not for execs


def test_a_signal_ends_it(shell):
    result = run_exec(shell, ["sh", "-c", "echo before; kill -TERM $$; echo after"])
    assert (result["exit_code"], result["signal"], result["stdout"]) == (None, "SIGTERM", b"before\n")


def test_a_timeout_kills_everything_it_started(shell):
    seconds = unique_sleep()
    # A background job, a child that left the session with setsid, and the command itself, all sleeping.
    result = run_exec(shell, ["sh", "-c", f"sleep {seconds} & setsid sleep {seconds} & sleep {seconds}"],
                      timeout_ms=500)
    assert (result["timed_out"], result["exit_code"], result["signal"]) == (True, None, "SIGKILL")
    assert result["duration_ms"] >= 500
    assert marked(seconds) == []  # the result is final only once nothing of it is left


@pytest.mark.parametrize("end", ["timeout", "exec_kill"])
def test_an_orphan_that_left_the_session_is_killed_too(shell, end):
    """`(setsid sleep &)`: the sleep leaves the session and its parent exits at once, so neither the session nor the
    parent chain leads to it, unless the command is its subreaper."""
    seconds = unique_sleep()
    exec_id = exec_start(shell, ["sh", "-c", f"(setsid sleep {seconds} &); sleep {seconds}"],
                         timeout_ms=60_000 if end == "exec_kill" else 3_000)
    wait_until(lambda: sleeps(seconds) == 2, "both sleeps")
    orphan = next(p for p in marked(seconds) if p.info["cmdline"][:1] == ["sleep"] and os.getsid(p.pid) == p.pid)
    [leader] = [p for p in marked(seconds) if p.info["cmdline"][:2] == ["sh", "-c"]]
    assert orphan.ppid() == leader.pid  # its own parent is gone: the command, its subreaper, took it in
    if end == "exec_kill":
        assert shell.result("exec_kill", exec_id=exec_id)["killed"] is True
    result = exec_finish(shell, exec_id)
    assert result["signal"] == "SIGKILL" and result["timed_out"] is (end == "timeout")
    assert marked(seconds) == []


def test_what_a_command_leaves_running_is_killed_when_it_exits(shell):
    seconds = unique_sleep()
    result = run_exec(shell, ["sh", "-c", f"sleep {seconds} > /dev/null 2>&1 & echo started"])
    assert (result["exit_code"], result["stdout"]) == (0, b"started\n")
    assert marked(seconds) == []


def test_exec_kill_ends_the_whole_group(shell):
    seconds = unique_sleep()
    exec_id = exec_start(shell, ["sh", "-c", f"sleep {seconds} & sleep {seconds}"])
    wait_until(lambda: sleeps(seconds) == 2, "both sleeps")
    assert shell.result("exec_kill", exec_id=exec_id) == {"type": "exec_kill", "exec_id": exec_id, "killed": True}
    result = exec_finish(shell, exec_id)
    assert (result["killed"], result["signal"], result["timed_out"]) == (True, "SIGKILL", False)
    assert marked(seconds) == []
    assert shell.error("exec_wait", exec_id=exec_id)["code"] == "command_error"  # released by exec_finish


def test_stdin_larger_than_a_pipe_buffer_is_fed(shell):
    data = os.urandom(300 * 1024)
    result = run_exec(shell, ["sha256sum"], stdin_b64=base64.b64encode(data).decode())
    import hashlib

    assert result["stdout"].split()[0].decode() == hashlib.sha256(data).hexdigest()
    assert run_exec(shell, ["cat"])["stdout"] == b""  # no stdin: /dev/null


def test_output_is_capped_per_stream_and_paged_under_the_line_bound(shell):
    capped = run_exec(shell, ["sh", "-c", "head -c 100000 /dev/zero; echo e >&2"], output_cap_bytes=1000)
    assert (capped["exit_code"], len(capped["stdout"]), capped["stdout_truncated"]) == (0, 1000, True)
    assert (capped["stderr"], capped["stderr_truncated"]) == (b"e\n", False)
    big = run_exec(shell, ["sh", "-c", "seq 1 120000"])  # about 780 KiB: three pages
    assert big["stdout"] == b"".join(b"%d\n" % n for n in range(1, 120001))
    assert big["stdout_truncated"] is False


def test_past_the_bound_execs_queue_in_order(shell):
    seconds = unique_sleep()
    running = [exec_start(shell, ["sleep", seconds]) for _ in range(agent.MAX_RUNNING_EXECS)]
    first = shell.result("exec", argv=["echo", "first"])
    second = shell.result("exec", argv=["echo", "second"])
    dropped = shell.result("exec", argv=["echo", "dropped"])
    assert (first["queued"], first["pid"], second["queued"]) == (True, None, True)
    waited = shell.result("exec_wait", exec_id=first["exec_id"], wait_ms=0)
    assert (waited["running"], waited["queued"], waited["pid"]) == (True, True, None)
    # A queued one that is killed never starts, and ends as killed.
    assert shell.result("exec_kill", exec_id=dropped["exec_id"])["killed"] is True
    gone = exec_finish(shell, dropped["exec_id"])
    assert (gone["killed"], gone["signal"], gone["pid"], gone["stdout"]) == (True, "SIGKILL", None, b"")
    # One slot frees: the first queued starts, then the next, in order.
    shell.result("exec_kill", exec_id=running[0])
    assert exec_finish(shell, first["exec_id"])["stdout"] == b"first\n"
    assert exec_finish(shell, second["exec_id"])["stdout"] == b"second\n"
    for exec_id in running[1:]:
        shell.result("exec_kill", exec_id=exec_id)
    for exec_id in running:
        exec_finish(shell, exec_id)
    assert marked(seconds) == []


def test_the_queue_is_bounded(shell):
    seconds = unique_sleep()
    running = [exec_start(shell, ["sleep", seconds]) for _ in range(agent.MAX_RUNNING_EXECS)]
    queued = [exec_start(shell, ["true"]) for _ in range(agent.MAX_QUEUED_EXECS)]
    refused = shell.error("exec", argv=["true"])
    assert refused["code"] == "server_unavailable" and "queue is full" in refused["message"]
    for batch in (queued, running):  # queued first: dropped, never started
        for exec_id in batch:
            shell.result("exec_kill", exec_id=exec_id)
        for exec_id in batch:
            assert exec_finish(shell, exec_id)["killed"] is True
    assert marked(seconds) == []


def test_a_detached_exec_outlives_its_call_and_dies_with_the_agent(start_agent):
    shell = start_agent("--workload", "shell")
    seconds = unique_sleep()
    started = shell.result("exec", argv=["sh", "-c", f"echo up; echo err >&2; exec sleep {seconds}"], detach=True)
    out, err = (shell.session_dir / "home" / ".reploy" / "detached" / f"{started['exec_id']}.{n}"
                for n in ("stdout", "stderr"))
    assert (started["stdout_path"], started["stderr_path"]) == (str(out), str(err))
    wait_until(lambda: out.read_bytes() == b"up\n" and err.read_bytes() == b"err\n", "the detached output")
    assert [p.pid for p in marked(seconds)] == [started["pid"]]
    # Not counted against the running bound, and stdin comes from a file, never the request.
    assert shell.error("exec", argv=["cat"], detach=True, stdin_b64="eA==")["code"] == "invalid_request"
    shell.stop()
    assert marked(seconds) == []


def test_an_absolute_cwd_starts_at_the_root(shell):
    assert run_exec(shell, ["pwd"], cwd="/usr/bin")["stdout"] == b"/usr/bin\n"


def test_stdin_from_a_file_and_no_timeout(shell):
    (shell.session_dir / "workspace" / "in.txt").write_bytes(b"from a file\n" * 1000)
    result = run_exec(shell, ["wc", "-l"], stdin_path="in.txt")
    assert result["stdout"].strip() == b"1000"
    assert shell.error("exec", argv=["cat"], stdin_path="missing")["message"].startswith("no such file")
    assert shell.error("exec", argv=["cat"], stdin_path="in.txt", stdin_b64="eA==")["code"] == "invalid_request"
    assert run_exec(shell, ["sleep", "0.1"])["timed_out"] is False  # none given: none


def test_exec_wait_long_polls_within_the_handler_bound(shell):
    exec_id = exec_start(shell, ["sleep", "30"])
    waiting = shell.result("exec_wait", exec_id=exec_id, wait_ms=300)
    assert waiting["running"] is True and waiting["exit_code"] is None and waiting["duration_ms"] >= 300
    shell.result("exec_kill", exec_id=exec_id)
    assert exec_finish(shell, exec_id)["killed"] is True


@pytest.mark.parametrize(("params", "code", "words"), [
    ({"argv": ["no-such-program-here"]}, "command_error", "cannot run"),
    ({"argv": ["true"], "cwd": "missing"}, "command_error", "no such file or directory: missing"),
    ({"argv": ["true"], "cwd": "link"}, "invalid_request", "refused: link is a symlink"),
    ({"argv": ["true"], "cwd": "../.."}, "invalid_request", "refused"),
    ({"argv": ["true"], "cwd": "/nonexistent-reploy"}, "command_error", "no such file or directory"),  # from /
])
def test_what_cannot_run_is_refused(shell, params, code, words):
    (shell.session_dir / "workspace" / "link").symlink_to("/etc")
    error = shell.error("exec", **params)
    assert error["code"] == code and words in error["message"]


def test_exec_while_the_terminal_is_busy_and_the_other_way_round(shell):
    shell.wait_status(lambda s: s["log_bytes"] > 0, "the prompt")
    shell.result("message", text="busybox top -d 1")  # busybox-static: scripts/setup.sh installs it
    busy = shell.wait_status(lambda s: s["turn_state"] == "in_progress", "top in the foreground")
    assert run_exec(shell, ["echo", "beside top"])["stdout"] == b"beside top\n"
    grown = shell.wait_status(lambda s: s["log_bytes"] > busy["log_bytes"], "top still drawing")
    assert grown["turn_state"] == "in_progress"
    assert shell.result("interrupt")["cancelled"] is True
    shell.wait_status(lambda s: s["turn_state"] == "idle", "the shell idle")
    exec_id = exec_start(shell, ["sleep", "30"])
    shell.result("message", text="echo typed-$((6*7))")
    shell.read_until(b"typed-42\r\n")  # typed and answered while the exec runs
    assert shell.result("exec_wait", exec_id=exec_id)["running"] is True
    shell.result("exec_kill", exec_id=exec_id)
    exec_finish(shell, exec_id)


def test_exec_beside_an_agent_run(start_agent):
    process = start_agent("--workload", "agent", "--agent-command", FAKE_AGENT_ARGV)
    process.result("message", text="hang")
    process.wait_status(lambda s: s["turn_state"] == "in_progress", "the run")
    assert run_exec(process, ["sh", "-c", "echo agent-side"])["stdout"] == b"agent-side\n"
    assert process.status()["turn_state"] == "in_progress"


def test_a_checkpoint_waits_for_running_execs_and_then_refuses_new_ones(shell):
    exec_id = exec_start(shell, ["sh", "-c", "sleep 0.5; echo written > marker.txt"])
    result = shell.result("checkpoint", id="with-exec")
    with tarfile.open(result["path"]) as archive:
        assert archive.extractfile("workspace/marker.txt").read() == b"written\n"
    assert exec_finish(shell, exec_id)["exit_code"] == 0
    assert shell.error("exec", argv=["true"])["code"] == "server_unavailable"


def test_the_child_starts_with_default_signal_dispositions_and_an_empty_mask(short_dir):
    """The agent's own parent ignored SIGQUIT and SIGHUP and blocked SIGUSR1; an exec sees none of that."""
    session_dir = short_dir / "sig"
    launcher = ("import os, signal, sys; signal.signal(signal.SIGQUIT, signal.SIG_IGN); "
                "signal.signal(signal.SIGHUP, signal.SIG_IGN); "
                "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1}); os.execv(sys.executable, sys.argv[1:])")
    identity = ["--runtime-user", RUNTIME_USER] if AS_ROOT else []
    proc = subprocess.Popen([PYTHON, "-c", launcher, PYTHON, str(AGENT_PY), "serve", "--session-dir",
                             str(session_dir), "--workload", "shell", *identity],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_until(lambda: "result" in agent.call(session_dir, "status", {}), "the agent")
        started = agent.call(session_dir, "exec", {"argv": ["cat", "/proc/self/status"]})["result"]
        final = wait_until(lambda: (lambda r: r if not r["running"] else None)(
            agent.call(session_dir, "exec_wait", {"exec_id": started["exec_id"], "wait_ms": 1000})["result"]),
            "the exec")
        status = dict(line.split(":\t", 1) for line in base64.b64decode(final["stdout_b64"]).decode().splitlines())
        ignored, blocked = int(status["SigIgn"], 16), int(status["SigBlk"], 16)
        for signum in agent.SPAWN_DEFAULT_SIGNALS:
            assert not ignored & (1 << (signum - 1)), signal.Signals(signum).name
        assert blocked == 0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)


def test_stopping_the_agent_kills_running_execs(shell):
    seconds = unique_sleep()
    exec_start(shell, ["sh", "-c", f"sleep {seconds} & sleep {seconds}"])
    wait_until(lambda: sleeps(seconds) == 2, "the sleeps")
    assert shell.stop() == 0
    assert marked(seconds) == []
