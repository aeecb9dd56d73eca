"""The shell workload over a real PTY, a real agent process and its real control socket."""

from __future__ import annotations

import base64
import errno
import os
import signal
import time

import psutil
import pytest

from agent_fixtures.harness import (SPAWN_RESET_SIGNALS, agent, hostile_start, pid_gone, read_window,  # noqa: F401
                                    short_dir, signal_dispositions, start_agent, wait_until)


@pytest.fixture
def shell(start_agent):
    return start_agent("--workload", "shell")


def test_status_describes_an_idle_shell(shell):
    status = shell.status()
    assert status["workload"] == "shell" and status["turn_state"] == "idle"
    assert status["running"] is True and status["exit_code"] is None
    assert (status["columns"], status["rows"]) == (80, 24)
    assert status["admission_open"] is True and status["awaiting_restore"] is False
    assert status["queue_depth"] == 0 and status["queue_bytes"] == 0
    assert pid_gone(status["pid"]) is False


def test_message_to_an_idle_shell_is_typed_as_one_line(shell):
    shell.wait_status(lambda s: s["log_bytes"] > 0, "the prompt")
    reply = shell.result("message", text='echo "x$((40+2))y"; echo "$TERM"')
    assert reply["delivery"] == "dispatched"
    output = shell.read_until(b"x42y\r\nxterm-256color\r\n")
    assert b'echo "x$((40+2))y"' in output  # the PTY echoed what was typed


def test_multi_line_messages_are_refused(shell):
    assert shell.error("message", text="echo a\necho b")["code"] == "invalid_request"


def test_write_sends_raw_bytes(shell):
    reply = shell.result("write", data_b64=base64.b64encode(b"echo raw-$((1+1))\r").decode())
    assert reply["bytes"] == len(b"echo raw-$((1+1))\r")
    shell.read_until(b"raw-2\r\n")


def test_resize_reaches_the_terminal(shell):
    assert shell.result("resize", columns=100, rows=30) == {"type": "resize", "columns": 100, "rows": 30}
    shell.result("message", text="stty size")
    shell.read_until(b"30 100\r\n")
    assert (shell.status()["columns"], shell.status()["rows"]) == (100, 30)


def test_message_while_a_job_runs_is_queued_then_delivered_after_interrupt(shell):
    assert shell.result("interrupt")["cancelled"] is False  # nothing in the foreground yet
    shell.result("message", text="cat")
    busy = shell.wait_status(lambda s: s["turn_state"] == "in_progress", "cat in the foreground")
    assert busy["pid"] is not None
    reply = shell.result("message", text='echo "q$((5*5))q"')
    assert reply == {"type": "message", "delivery": "queued", "queue_depth": 1}
    status = shell.status()
    assert status["queue_depth"] == 1 and status["queue_bytes"] == len('echo "q$((5*5))q"')
    assert b"q25q" not in shell.read_bytes()  # held, not typed into cat
    assert shell.result("interrupt")["cancelled"] is True
    shell.read_until(b"q25q\r\n")
    shell.wait_status(lambda s: s["turn_state"] == "idle" and s["queue_depth"] == 0, "the shell idle again")
    turns = [event for event in shell.events() if event["type"] in ("turn_start", "turn_end")]
    assert turns[0]["type"] == "turn_start"
    assert turns[1] == {**turns[1], "type": "turn_end", "turn": turns[0]["seq"], "outcome": "interrupted"}


def test_queued_bytes_limit_is_its_own_error(shell):
    """The queue's total bound (an agent's prompts, below one argument each, meet its count bound first)."""
    shell.result("message", text="cat")
    shell.wait_status(lambda s: s["turn_state"] == "in_progress", "cat in the foreground")
    message = "echo " + "p" * (1000 * 1024 - 5)
    accepted = 0
    while "result" in (reply := shell.call("message", text=message)):
        accepted += 1
    assert accepted == agent.MAX_QUEUED_BYTES // len(message)
    assert reply["error"]["code"] == "server_unavailable"
    assert "would exceed 8388608 bytes" in reply["error"]["message"]
    assert shell.status()["queue_bytes"] == accepted * len(message)


def test_queued_messages_are_delivered_in_order(shell):
    shell.result("message", text="cat")
    shell.wait_status(lambda s: s["turn_state"] == "in_progress", "cat in the foreground")
    for n in range(3):
        assert shell.result("message", text=f'echo "m$(({n}+100))"')["delivery"] == "queued"
    shell.result("interrupt")
    output = shell.read_until(b"m102\r\n")
    assert output.index(b"m100\r\n") < output.index(b"m101\r\n") < output.index(b"m102\r\n")


def test_shell_exit_is_reported_and_relaunch_starts_a_fresh_shell_keeping_the_log(shell):
    first_pid = shell.status()["pid"]
    shell.result("message", text="exit 7")
    status = shell.wait_status(lambda s: not s["running"], "the shell to exit")
    assert status["exit_code"] == 7 and status["turn_state"] == "waiting" and status["pid"] is None
    assert shell.error("message", text="echo hi") == {
        "code": "command_error", "message": "the shell has exited; relaunch starts a new one"}
    before = shell.read_bytes()
    assert b"[reploy: shell exited with status 7; relaunch starts a new one]" in before
    new_pid = shell.result("relaunch")["pid"]
    assert new_pid != first_pid and shell.status()["running"] is True
    output = shell.read_until(b"[reploy: shell relaunched]")
    assert output.startswith(before)
    shell.wait_status(lambda s: s["turn_state"] == "idle", "the new shell idle")
    shell.result("message", text='echo "again$((2+2))"')
    shell.read_until(b"again4\r\n")
    assert any(event["type"] == "relaunch" and event["pid"] == new_pid for event in shell.events())


def test_relaunch_of_a_running_shell_kills_its_jobs(shell):
    shell.result("message", text="sleep 1000")
    busy = shell.wait_status(lambda s: s["turn_state"] == "in_progress", "sleep in the foreground")
    old_shell = busy["pid"]
    shell.result("relaunch")
    wait_until(lambda: pid_gone(old_shell), "the old shell to die")
    end = [event for event in shell.events() if event["type"] == "turn_end"][-1]
    assert end["outcome"] == "interrupted" and end["reason"] == "relaunch"


def test_reads_replay_from_zero_and_offsets_past_the_end_reset(shell):
    # The sleep holds the next prompt back, so the log stays as it is while it is read.
    shell.result("message", text="echo replay; sleep 60")
    shell.read_until(b"replay\r\n")
    first = shell.read_bytes()
    assert shell.read_bytes() == first  # reading does not consume
    length = shell.status()["log_bytes"]
    beyond = shell.result("read", offset=length + 1000)
    assert beyond == {"type": "read", "offset": length + 1000, "next_offset": length, "length": length,
                      "reset": True, "data_b64": ""}
    middle = shell.result("read", offset=2, max_bytes=5)
    assert base64.b64decode(middle["data_b64"]) == first[2:7] and middle["next_offset"] == 7


def test_read_fd_answers_the_window_and_a_read_only_descriptor_of_the_log(shell):
    shell.result("message", text="echo windows; sleep 60")
    shell.read_until(b"windows\r\n")
    whole = shell.read_bytes()
    length = shell.status()["log_bytes"]
    window, data = read_window(shell, offset=0)  # no max_bytes: to the log's end
    assert window == {"type": "read_fd", "offset": 0, "next_offset": length, "length": length, "reset": False,
                      "kind": "bytes"} and data == whole
    window, data = read_window(shell, offset=2, max_bytes=5)
    assert (window["next_offset"], data) == (7, whole[2:7])
    window, data = read_window(shell, offset=length + 1000)
    assert (window["next_offset"], window["length"], window["reset"], data) == (length, length, True, b"")
    response, fds = agent.call_with_fds(shell.session_dir, "read_fd", {})
    try:
        assert os.fstat(fds[0]).st_ino == (shell.agent_dir / agent.LOG_NAME).stat().st_ino
        with pytest.raises(OSError) as refused:
            os.pwrite(fds[0], b"forged", 0)
        assert refused.value.errno == errno.EBADF
    finally:
        os.close(fds[0])
    assert shell.read_bytes() == whole


def test_long_poll_read_fd_returns_when_new_bytes_arrive(shell):
    shell.wait_status(lambda s: s["log_bytes"] > 0, "the prompt")
    end = shell.status()["log_bytes"]
    idle, data = read_window(shell, offset=end, wait_ms=50)
    assert idle["next_offset"] == end and data == b""
    shell.result("write", data_b64=base64.b64encode(b"x").decode())
    woke, data = read_window(shell, offset=end, wait_ms=agent.MAX_READ_WAIT_MS)
    assert woke["next_offset"] > end and data.startswith(b"x")


def test_long_poll_read_returns_when_new_bytes_arrive(shell):
    shell.wait_status(lambda s: s["log_bytes"] > 0, "the prompt")
    end = shell.status()["log_bytes"]
    idle = shell.result("read", offset=end, wait_ms=50)
    assert idle["data_b64"] == "" and idle["next_offset"] == end
    shell.result("write", data_b64=base64.b64encode(b"x").decode())
    woke = shell.result("read", offset=end, wait_ms=agent.MAX_READ_WAIT_MS)
    assert base64.b64decode(woke["data_b64"]).startswith(b"x")


def test_restore_needs_a_fresh_agent(shell):
    assert shell.error("restore", path="x.tar")["code"] == "command_error"


def test_shell_log_cap_ends_with_a_marker_and_stops_growing(start_agent):
    shell = start_agent("--workload", "shell", "--shell-log-cap-bytes", "2048")
    shell.result("message", text="i=0; while [ $i -lt 300 ]; do echo line-$i; i=$((i+1)); done; echo fin$((1+1))")
    output = shell.read_until(b"later output is discarded]\r\n")
    status = shell.status()
    assert status["log_capped"] is True and status["log_bytes"] == 2048 == len(output)
    assert b"line-0\r\n" in output and b"fin2" not in output
    shell.result("message", text="echo more")
    shell.wait_status(lambda s: s["turn_state"] == "idle" and s["queue_depth"] == 0, "echo to run")
    assert shell.read_bytes() == output


def test_sigterm_shuts_down_cleanly(shell, short_dir):
    shell_pid = shell.status()["pid"]
    assert shell.stop() == 0
    assert not (shell.session_dir / agent.SOCKET_NAME).exists()
    assert pid_gone(shell_pid)
    kinds = [event["type"] for event in shell.events()]
    assert kinds[0] == "session_start" and kinds[-1] == "session_end"
    assert shell.events()[-1]["reason"] == "SIGTERM"


def test_a_restarted_agent_serves_the_same_bytes_at_the_same_offsets(start_agent):
    first = start_agent("--workload", "shell")
    first.result("message", text="echo before-crash; sleep 1000")
    first.wait_status(lambda s: s["turn_state"] == "in_progress", "sleep in the foreground")
    before = first.read_until(b"before-crash\r\n")
    first.crash()
    second = start_agent("--workload", "shell")
    after = second.read_until(b"[reploy: agent restarted; earlier output is kept above]")
    assert after.startswith(before)
    events = second.events()
    starts = [e["seq"] for e in events if e["type"] == "turn_start"]
    ends = [e for e in events if e["type"] == "turn_end"]
    assert [e["turn"] for e in ends] == starts and ends[0]["outcome"] == "failed" and ends[0]["reason"] == "agent_died"
    kinds = [e["type"] for e in events]
    assert kinds.count("session_start") == 2 and kinds.count("session_end") == 1  # the crashed one, reconciled
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))


def test_interrupt_stops_a_job_even_when_the_agent_started_with_sigint_ignored(start_agent):
    """`agent.py serve ... &` from a script starts with SIGINT ignored; the shell and its jobs must not inherit that."""
    shell = start_agent("--workload", "shell", preexec_fn=hostile_start)
    ignored, blocked = signal_dispositions(shell.proc.pid)
    # The agent itself did start hostile (it catches SIGINT, SIGTERM and SIGHUP once serving; the rest stays).
    assert signal.SIGQUIT in ignored and signal.SIGUSR1 in blocked
    shell.result("message", text="sleep 1000")
    busy = shell.wait_status(lambda s: s["turn_state"] == "in_progress", "sleep in the foreground")
    [job] = wait_until(lambda: psutil.Process(busy["pid"]).children(), "the sleep job")
    ignored, blocked = signal_dispositions(job.pid)
    assert not ignored & set(SPAWN_RESET_SIGNALS) and blocked == set()
    assert shell.result("interrupt")["cancelled"] is True
    wait_until(lambda: pid_gone(job.pid), "the sleep to stop")
    shell.wait_status(lambda s: s["turn_state"] == "idle", "the shell idle again")
    assert [e["outcome"] for e in shell.events() if e["type"] == "turn_end"] == ["interrupted"]


def test_busy_follows_the_foreground_job_and_quiet_counts_from_its_end(shell):
    started = time.monotonic()
    idle = shell.wait_status(lambda s: s["quiet_ms"] >= 1000, "a quiet second")
    assert idle["busy"] is False
    shell.result("message", text="sleep 1")
    busy = shell.wait_status(lambda s: s["busy"], "the job in the foreground")
    assert busy["quiet_ms"] == 0 and busy["turn_state"] == "in_progress"
    after = shell.wait_status(lambda s: not s["busy"], "the job to end")
    # Quiet counts from the job's end, not from the agent's start: the job itself took at least a second.
    assert after["quiet_ms"] <= (time.monotonic() - started) * 1000 - 1000


def test_suspend_records_an_outbox_event_and_changes_nothing_else(shell):
    shell.result("message", text="sleep 1000")
    shell.wait_status(lambda s: s["busy"], "the job in the foreground")
    seq = shell.result("suspend", reason="max_busy")["seq"]
    [event] = [e for e in shell.events() if e["type"] == "suspend"]
    assert event == {**event, "seq": seq, "reason": "max_busy", "turn_state": "in_progress", "queue_depth": 0}
    assert shell.status()["turn_state"] == "in_progress"  # the job runs on
