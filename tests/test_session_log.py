"""What a session can make serve log (issue 42): LogTally, the pure rule (the first lines of each
window one by one, the rest counted into one summary), checked over every short sequence; then
SessionLog on top of it, writing serve's real stderr (escaped, cut, summarized by its thread)."""

from __future__ import annotations

import itertools
import socket
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import agent  # noqa: E402
import reploy_serve as rs  # noqa: E402

PER_WINDOW, WINDOW_S = 2, 3.0
#: Times of lines (in steps of a third of a window, so lines fall inside, at the edge of and
#: past a window) and the sessions they are of.
TIMES = (0.0, 1.0, 2.0, 3.0, 4.0, 7.0)
SESSIONS = ("a", "b")


def replay(lines: tuple[tuple[str, float], ...]) -> tuple[list[rs.Tallied], list[rs.LogSummary]]:
    tally = rs.LogTally(PER_WINDOW, WINDOW_S)
    verdicts, summaries = [], []
    for index, (session, now) in enumerate(lines):
        summaries += tally.ended(now)
        verdicts.append(tally.line(session, f"line {index}", now))
    return verdicts, summaries + tally.ended(float("inf"))


def sequences(length: int) -> itertools.chain[tuple[tuple[str, float], ...]]:
    """Every sequence of `length` lines, times not decreasing."""
    return itertools.chain.from_iterable(
        (tuple(zip(sessions, times)) for sessions in itertools.product(SESSIONS, repeat=length))
        for times in itertools.combinations_with_replacement(TIMES, length))


@pytest.mark.parametrize("length", range(1, 7))
def test_every_line_is_logged_once_or_counted_once_and_no_window_logs_more_than_its_share(length: int) -> None:
    for lines in sequences(length):
        verdicts, summaries = replay(lines)
        for session in SESSIONS:
            mine = [(now, verdict, index) for index, ((owner, now), verdict) in enumerate(zip(lines, verdicts))
                    if owner == session]
            counted = [index for _, verdict, index in mine if verdict is rs.Tallied.COUNTED]
            theirs = [summary for summary in summaries if summary.session_id == session]
            # Each counted line is in exactly one summary, and each summary names its last line.
            assert sum(summary.count for summary in theirs) == len(counted), lines
            assert all(summary.count > 0 and summary.window_s == WINDOW_S for summary in theirs)
            if counted:
                assert theirs[-1].last == f"line {counted[-1]}"
            # The windows: each starts at the first line at or past the last one's end, and logs
            # its first PER_WINDOW; so any span of one window logs at most twice that.
            start, seen = None, 0
            for now, verdict, _ in mine:
                if start is None or now >= start + WINDOW_S:
                    start, seen = now, 0
                seen += 1
                assert (verdict is rs.Tallied.ONE_BY_ONE) == (seen <= PER_WINDOW), lines
            logged = [now for now, verdict, _ in mine if verdict is rs.Tallied.ONE_BY_ONE]
            assert all(sum(t <= u < t + WINDOW_S for u in logged) <= 2 * PER_WINDOW for t in logged)
            # A line after a whole quiet window is always logged one by one.
            for (before, _, _), (now, verdict, _) in zip(mine, mine[1:]):
                if now - before >= WINDOW_S:
                    assert verdict is rs.Tallied.ONE_BY_ONE, lines
            # The first PER_WINDOW lines are always logged.
            assert all(verdict is rs.Tallied.ONE_BY_ONE for _, verdict, _ in mine[:PER_WINDOW])


def test_a_window_is_summarized_once_when_it_ends_and_at_the_session_s_end() -> None:
    tally = rs.LogTally(PER_WINDOW, WINDOW_S)
    assert [tally.line("a", f"{i}", 0.5) for i in range(4)] == [
        rs.Tallied.ONE_BY_ONE, rs.Tallied.ONE_BY_ONE, rs.Tallied.COUNTED, rs.Tallied.COUNTED]
    assert tally.ended(3.4) == []  # not over yet
    assert tally.ended(3.5) == [rs.LogSummary("a", 2, WINDOW_S, "3")]
    assert tally.ended(100.0) == []  # once
    for i in range(3):
        tally.line("b", f"b{i}", 10.0)
    assert tally.end_session("b") == [rs.LogSummary("b", 1, WINDOW_S, "b2")]
    assert tally.end_session("b") == [] and tally.line("b", "again", 10.5) is rs.Tallied.ONE_BY_ONE


def test_a_session_log_escapes_cuts_and_summarizes_in_its_own_time(capfd: pytest.CaptureFixture[str]) -> None:
    """Lines a sandbox chose: none of its control bytes reaches the log raw, each is cut, and
    the lines past a window's share come out as one summary when the window ends, with no
    further line to carry it (the log's own thread)."""
    summarized: list[rs.LogSummary] = []
    done = threading.Event()
    session_log = rs.SessionLog("test", lambda summary: (summarized.append(summary), done.set()),
                                window_s=0.2)
    try:
        forged = "refused: GET /\n2026-12-07 serve: token accepted\r\x1b[2K\x1b]0;x\x07" + "A" * 20_000
        logged = [session_log.line("s1", forged) for _ in range(50)]
        assert done.wait(60)
    finally:
        session_log.close()
    out, err = capfd.readouterr()
    assert out == ""
    assert logged == [True] * rs.LINES_PER_WINDOW + [False] * (50 - rs.LINES_PER_WINDOW)
    lines = err.splitlines(keepends=True)
    assert len(lines) == rs.LINES_PER_WINDOW + 1 and all(line.endswith("\n") for line in lines)
    assert all(line.startswith("reploy: serve: session s1: ") for line in lines)
    assert not any(char in err[:-1].replace("\n", "") for char in "\r\x1b\x07")
    assert "\\x0a2026-12-07 serve: token accepted\\x0d\\x1b[2K" in lines[0]
    assert max(map(len, lines)) < 2 * rs.MAX_LOGGED_CHARS
    assert "45 more test lines in 0.2 s, not logged one by one; the last: refused: GET /" in lines[-1]
    assert [summary.count for summary in summarized] == [45]


def test_the_model_proxy_logs_a_forged_request_line_escaped_and_a_flood_as_one_summary(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Issue 42: the model proxy's refusal quoted the raw method and path into serve's log, so a
    bare CR, LF or ESC in them started, rewrote or hid a line, and each refusal was a line. No
    upstream is reached: every request here is refused before that."""
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir(mode=0o700)
    proxy = rs.ModelProxy(rs.parse_model_upstream("https://127.0.0.1:9", None, "x-api-key"), "sk-unused")
    proxy.listen("s1", agent_dir)
    forged = (b"PUT\r\x1b[2Kreploy:serve:token-accepted /v1/x\nreploy:\x1b]0;t\x07" + b"B" * 30_000
              + b" HTTP/1.1\r\ncontent-length: 0\r\n\r\n")
    try:
        for _ in range(40):
            with socket.socket(socket.AF_UNIX) as client:
                client.settimeout(60)
                client.connect(str(agent_dir / agent.MODEL_SOCKET_NAME))
                client.sendall(forged)
                client.shutdown(socket.SHUT_WR)
                answer = b""
                while chunk := client.recv(65536):
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 403 ")
        proxy.close_session("s1")
    finally:
        proxy.close()
    err = capfd.readouterr().err
    lines = err.splitlines(keepends=True)
    assert len(lines) == rs.LINES_PER_WINDOW + 1, err[:2000]
    assert all(line.startswith("reploy: serve: session s1: ") and line.endswith("\n") for line in lines)
    assert not any(char in err for char in "\r\x1b\x07")
    assert "model request refused: PUT\\x0d\\x1b[2Kreploy:serve:token-accepted /v1/x\\x0areploy:" in lines[0]
    assert "35 more model proxy lines in 60 s" in lines[-1]
    assert len(err) < (rs.LINES_PER_WINDOW + 1) * 2 * rs.MAX_LOGGED_CHARS
