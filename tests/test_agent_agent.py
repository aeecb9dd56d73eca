"""The agent workload, driven through a real agent process by the fake stream-json CLI (no model is called)."""

from __future__ import annotations

import hashlib
import json
import signal

import psutil
import pytest

from agent_fixtures.harness import (FAKE_AGENT_ARGV, SPAWN_RESET_SIGNALS, agent, hostile_start,  # noqa: F401
                                    pid_gone, read_window, short_dir, signal_dispositions, start_agent, wait_until)

SECRET = "sk-fake-0123456789abcdef"


@pytest.fixture
def start_fake(start_agent):
    def start(*args, **kwargs):
        return start_agent("--workload", "agent", "--agent-command", FAKE_AGENT_ARGV, *args, **kwargs)
    return start


@pytest.fixture
def fake(start_fake):
    return start_fake()


def run_prompt(fake, prompt, until: bytes) -> str:
    """Sends one prompt, waits for `until` in the log and for the worker to go idle; returns the log text."""
    assert fake.result("message", text=prompt)["delivery"] in ("dispatched", "queued")
    fake.read_until(until)
    fake.wait_status(lambda s: s["turn_state"] == "idle", "the run to finish")
    return fake.read_bytes().decode()


def turn_ends(fake):
    return [event for event in fake.events() if event["type"] == "turn_end"]


def test_deltas_are_projected_and_the_result_is_not_repeated(fake):
    assert fake.status()["turn_state"] == "idle" and fake.status()["pid"] is None
    reply = fake.result("message", text="say hello from the fake")
    assert reply == {"type": "message", "delivery": "dispatched", "queue_depth": 0}
    text = run_prompt(fake, "say second", b"second\n")
    assert text == "hello from the fake\nsecond\n"
    assert [end["outcome"] for end in turn_ends(fake)] == ["completed", "completed"]


def test_read_answers_text_on_code_point_boundaries(fake):
    run_prompt(fake, "say aé€😀z", "😀z\n".encode())
    piece = fake.result("read", offset=0, max_bytes=4)
    assert piece["text"] == "aé" and piece["next_offset"] == 3
    assert fake.result("read", offset=3, max_bytes=4)["text"] == "€"
    assert fake.error("read", offset=4)["code"] == "command_error"  # inside €


def test_read_fd_windows_fall_on_code_point_boundaries(fake):
    run_prompt(fake, "say aé€😀z", "😀z\n".encode())
    window, data = read_window(fake, offset=0, max_bytes=4)
    assert (window["kind"], window["next_offset"], data) == ("text", 3, "aé".encode())
    assert read_window(fake, offset=3, max_bytes=6)[1] == "€".encode()  # the next 3 bytes would cut 😀
    assert read_window(fake, offset=0)[1] == fake.read_bytes()
    refused = fake.error("read_fd", offset=4)  # inside €
    assert refused["code"] == "command_error" and "UTF-8 boundary" in refused["message"]


def test_continue_only_after_a_first_success_and_persisted(start_fake, short_dir):
    fake = start_fake("--model", "opus-x")
    first = json.loads(run_prompt(fake, "args", b"]\n").splitlines()[0])
    assert "--continue" not in first and first[:2] == ["--model", "opus-x"]
    assert fake.status()["continue"] is True
    fake.stop()
    restarted = start_fake("--model", "opus-x")
    text = run_prompt(restarted, "args", b'["--continue"')
    assert json.loads(text.splitlines()[-1])[:3] == ["--continue", "--model", "opus-x"]


def test_a_failed_first_run_does_not_enable_continue(fake):
    text = run_prompt(fake, "fail", b"exited with status 3]")
    assert "fake: something broke\n" in text
    assert fake.status()["continue"] is False
    assert turn_ends(fake)[-1]["outcome"] == "failed" and turn_ends(fake)[-1]["exit_code"] == 3


def test_an_error_result_is_a_failed_turn_even_when_the_command_exits_0(fake):
    """The real CLI says "subtype": "success" with "is_error": true: is_error decides, and its text is shown even
    after a partial answer (the reason the turn failed)."""
    text = run_prompt(fake, "error API Error: overloaded", b"reported an error result")
    assert "partial answer\nAPI Error: overloaded\n" in text
    assert turn_ends(fake)[-1]["outcome"] == "failed" and turn_ends(fake)[-1]["exit_code"] == 0
    assert fake.status()["continue"] is False


def test_stderr_is_kept_whole_beside_the_reply_and_plain_lines_pass_through(fake):
    """The diagnostic comes while the reply's line is open; whichever pipe the agent reads first, neither line is
    torn."""
    text = run_prompt(fake, "stderr diagnostics here", b"after stderr\n")
    assert sorted(text.splitlines(keepends=True)) == ["after stderr\n", "diagnostics here\n"]
    text = run_prompt(fake, "plain not json at all", b"not json at all\n")
    assert text.endswith("not json at all\n")


def test_result_text_is_used_when_nothing_else_was_projected(fake):
    assert run_prompt(fake, "result only the result", b"only the result\n") == "only the result\n"


def test_split_code_points_are_held_and_invalid_bytes_replaced(fake):
    text = run_prompt(fake, "utf8", "\ufffd\n".encode())
    assert "é€😀\ufffd\n" in text


def test_secrets_are_redacted_even_when_split(start_fake):
    fake = start_fake("--redact-env", "FAKE_SECRET", env={"FAKE_SECRET": SECRET})
    text = run_prompt(fake, "secret", b"err:[REDACTED]\n")
    assert SECRET not in text and SECRET[:8] not in text
    assert "token=[REDACTED] end" in text and "err:[REDACTED]\n" in text


def test_per_run_cap_marks_the_run_and_the_next_run_starts_fresh(start_fake):
    fake = start_fake("--per-run-cap-bytes", "2500")
    text = run_prompt(fake, "big 6000", b"the rest of its output is discarded]\n")
    assert text.count("x") == 2500
    text = run_prompt(fake, "say next one", b"next one\n")
    assert text.endswith("next one\n")


def test_cumulative_cap_ends_the_log_and_refuses_new_messages(start_fake):
    fake = start_fake("--cumulative-cap-bytes", "3000")
    text = run_prompt(fake, "big 5000", b"later output is discarded]\n")
    status = fake.status()
    assert status["log_capped"] is True and status["log_bytes"] == 3000 == len(text.encode())
    error = fake.error("message", text="say more")
    assert error["code"] == "command_error" and "cumulative output cap of 3000 bytes" in error["message"]


def test_queue_limits_and_interrupt_then_the_next_prompt_runs(fake):
    fake.result("message", text="hang")
    fake.read_until(b"working")
    status = fake.status()
    assert status["turn_state"] == "in_progress" and status["pid"] is not None
    for n in range(agent.MAX_QUEUED_PROMPTS):
        assert fake.result("message", text=f"say queued {n}")["delivery"] == "queued"
    full = fake.error("message", text="say one too many")
    assert full == {"code": "server_unavailable", "message": "queue is full: 64 messages are waiting"}
    assert fake.status()["queue_depth"] == 64
    run_pid = status["pid"]
    assert fake.result("interrupt") == {"type": "interrupt", "cancelled": True}
    text = fake.read_until(b"queued 0\n").decode()
    assert "working\n[reploy: interrupted]\n" in text
    assert pid_gone(run_pid)
    assert turn_ends(fake)[0]["outcome"] == "interrupted"


def test_interrupt_kills_grandchildren(fake):
    pid_file = fake.workspace / "grandchild.pid"  # where the run (the runtime user) may write
    fake.result("message", text=f"grandchild {pid_file}")
    fake.read_until(b"spawned")
    grandchild = int(wait_until(lambda: pid_file.exists() and pid_file.read_text(), "the grandchild pid"))
    assert not pid_gone(grandchild)
    assert fake.result("interrupt")["cancelled"] is True
    wait_until(lambda: pid_gone(grandchild), "the grandchild to die")
    fake.read_until(b"[reploy: interrupted]\n")
    assert fake.result("interrupt")["cancelled"] is False


def test_run_timeout_kills_the_run_with_an_interrupted_marker(start_fake):
    fake = start_fake("--run-timeout", "0.5")
    text = run_prompt(fake, "hang", b"the run exceeded its 0.5 s timeout]\n")
    assert "working\n[reploy: interrupted: the run exceeded its 0.5 s timeout]\n" in text
    end = turn_ends(fake)[-1]
    assert end["outcome"] == "interrupted" and end["reason"] == "timeout"


def test_a_missing_agent_command_fails_the_turn_and_the_session_goes_on(start_agent):
    missing = json.dumps(["/nonexistent/claude", "{prompt}"])
    fake = start_agent("--workload", "agent", "--agent-command", missing)
    fake.result("message", text="anything")
    fake.read_until(b"[reploy: cannot start the agent command:")
    assert turn_ends(fake)[-1]["reason"] == "spawn_failed"
    assert fake.status()["turn_state"] == "idle"


def test_a_prompt_holding_a_nul_is_refused_and_the_session_goes_on(fake):
    """A prompt becomes an argv element, which cannot hold a NUL: refused up front, no turn begun."""
    assert fake.error("message", text="say a\0b") == {
        "code": "invalid_request", "message": "params.text: an agent prompt cannot hold a NUL"}
    assert not [e for e in fake.events() if e["type"] == "turn_start"]
    assert fake.status()["queue_depth"] == 0
    run_prompt(fake, "say after", b"after\n")
    assert [e["outcome"] for e in turn_ends(fake)] == ["completed"]


def measured(fake, prompt: str) -> dict:
    """Runs the fake's `measure` scenario on prompt, sent as one message or as a draft in parts when it is longer
    than a part; what the command said it received."""
    before = len(turn_ends(fake))
    data = prompt.encode()
    step = agent.MAX_MESSAGE_PART_BYTES
    if len(data) <= step:
        reply = fake.result("message", text=prompt)
    else:
        parts = [data[i:i + step].decode() for i in range(0, len(data), step)]  # ASCII: any cut is a boundary
        draft = None
        for part in parts[:-1]:
            answer = fake.result("message", text=part, more=True, **({"draft": draft} if draft else {}))
            assert answer["delivery"] == "drafted"
            draft = answer["draft"]
        assert answer["draft_bytes"] == len(data) - len(parts[-1].encode())
        reply = fake.result("message", text=parts[-1], draft=draft)
    assert reply["delivery"] in ("dispatched", "queued")
    fake.wait_status(lambda s: s["turn_state"] == "idle" and len(turn_ends(fake)) > before, "the run to finish")
    return json.loads(fake.read_bytes().decode().splitlines()[-1])


def test_a_prompt_too_long_for_one_argument_goes_to_the_command_on_stdin(fake):
    """Linux refuses one argument of 128 KiB or more, so a longer prompt goes on stdin, with `-- {prompt}` left out of
    the argv; up to seed 002's 1 MiB, sent in parts."""
    for size, via in ((agent.MAX_ARGV_PROMPT_BYTES, "argv"), (agent.MAX_ARGV_PROMPT_BYTES + 1, "stdin"),
                      (agent.MAX_PROMPT_BYTES, "stdin")):
        prompt = "measure " + "x" * (size - len("measure "))
        assert measured(fake, prompt) == {"via": via, "bytes": size,
                                          "sha256": hashlib.sha256(prompt.encode()).hexdigest()}
    assert [e["outcome"] for e in turn_ends(fake)] == ["completed"] * 3


def test_a_message_over_the_limit_is_refused_and_its_draft_dropped(fake):
    part = "x" * agent.MAX_MESSAGE_PART_BYTES
    draft = fake.result("message", text=part, more=True)["draft"]
    for _ in range(agent.MAX_PROMPT_BYTES // agent.MAX_MESSAGE_PART_BYTES - 1):
        fake.result("message", text=part, more=True, draft=draft)
    error = fake.error("message", text="x", draft=draft)
    assert error["code"] == "invalid_request" and error["message"].startswith("too large:")
    assert fake.error("message", text="x", draft=draft)["code"] == "command_error"  # gone
    assert not [e for e in fake.events() if e["type"] == "turn_start"]


def test_relaunch_forgets_the_conversation(fake):
    run_prompt(fake, "say one", b"one\n")
    assert fake.status()["continue"] is True
    assert fake.result("relaunch") == {"type": "relaunch", "pid": None}
    assert fake.status()["continue"] is False
    fake.read_until(b"[reploy: relaunched: the next prompt starts a new conversation]\n")
    first = fake.read_bytes()
    text = run_prompt(fake, "args", b'"args"]\n')
    assert "--continue" not in text[len(first):]


def test_shell_verbs_are_refused_for_the_agent_workload(fake):
    assert fake.error("write", data_b64="eA==") == {"code": "command_error",
                                                    "message": "write is only for the shell workload"}
    assert fake.error("resize", columns=10, rows=10)["code"] == "command_error"


def test_turns_pair_up_in_the_outbox(fake):
    run_prompt(fake, "say a", b"a\n")
    run_prompt(fake, "fail", b"status 3]")
    events = fake.events()
    starts = [e for e in events if e["type"] == "turn_start"]
    ends = turn_ends(fake)
    assert [s["seq"] for s in starts] == [e["turn"] for e in ends]
    assert [e["outcome"] for e in ends] == ["completed", "failed"]
    assert all(s["prompt_bytes"] > 0 for s in starts)


def test_a_run_starts_with_default_signals_even_when_the_agent_did_not(start_agent):
    """The run is `exec sleep` itself, so its dispositions are exactly what agent.py gave it: SIGTERM (interrupt's
    signal) ends it at once, not SIGKILL after the grace."""
    sleeper = json.dumps(["/bin/sh", "-c", "exec sleep 1000", "sh", "{prompt}"])
    runner = start_agent("--workload", "agent", "--agent-command", sleeper, preexec_fn=hostile_start)
    runner.result("message", text="anything")
    run = runner.wait_status(lambda s: s["turn_state"] == "in_progress", "the run")["pid"]
    wait_until(lambda: psutil.Process(run).name() == "sleep", "the run to exec sleep")
    ignored, blocked = signal_dispositions(run)
    assert not ignored & set(SPAWN_RESET_SIGNALS) and blocked == set()
    assert runner.result("interrupt")["cancelled"] is True
    runner.wait_status(lambda s: s["turn_state"] == "idle", "the run to end")
    end = turn_ends(runner)[-1]
    assert end["outcome"] == "interrupted" and end["exit_code"] == -signal.SIGTERM


def test_an_agent_run_or_a_queued_prompt_is_busy(fake):
    assert fake.status()["busy"] is False
    fake.result("message", text="hang")
    fake.result("message", text="say later")
    status = fake.wait_status(lambda s: s["turn_state"] == "in_progress", "the run")
    assert status["busy"] is True and status["quiet_ms"] == 0 and status["queue_depth"] == 1
    fake.result("interrupt")  # the queued prompt runs next, then nothing is left
    fake.read_until(b"later\n")
    assert fake.wait_status(lambda s: s["turn_state"] == "idle", "the queue to drain")["busy"] is False
