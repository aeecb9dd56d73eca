"""The output fan-out's pure core (LogFanout): one follower's slices of a session's log, many
readers with their own cursors, a bounded window, readers further behind reading their own
way, stalled readers dropped. No Docker, no sockets, no threads; the clock is fed in."""

from __future__ import annotations

import itertools
from typing import Optional

import pytest

from reploy_serve import FanoutStep, FanoutTake, LogFanout

STALL_S = 10.0


def fanout(window: int = 8, chunk: int = 4, text: bool = False) -> LogFanout:
    return LogFanout(window, chunk, STALL_S, text)


def looked(core: LogFanout, log: bytes, upto: int, now: float = 0.0) -> tuple[int, ...]:
    """The follower's look at a log that is `log[:upto]`: the slice from where it reads next."""
    at = core.next_read()
    return core.feed(upto, b"" if at is None else log[at:upto], now)


def drain(core: LogFanout, reader: int, log: bytes, now: float = 0.0) -> bytes:
    """Everything `reader` takes until it waits, reading from `log` itself when told BEHIND;
    the bytes must join up, each event starting where the last one ended."""
    got = bytearray()
    while True:
        take = core.take(reader, now)
        if take.step is FanoutStep.BEHIND:
            take = core.read_behind(reader, log[take.offset:], now)
        if take.step is not FanoutStep.OUTPUT:
            assert take.step is FanoutStep.WAIT, take
            return bytes(got)
        assert log[take.offset:take.offset + len(take.data)] == take.data
        got += take.data


def test_before_the_follower_looked_a_reader_waits_and_the_follower_starts_at_the_end() -> None:
    core = fanout()
    reader = core.join(0, 0.0)
    assert core.next_read() is None
    assert core.take(reader, 0.0) == FanoutTake(FanoutStep.WAIT)
    core.feed(100, b"", 0.0)
    assert (core.start, core.end, core.next_read()) == (100, 100, 100)


def test_readers_at_the_end_each_get_every_new_slice_from_the_one_window() -> None:
    log = b"0123456789abcdef"
    core = fanout(window=64, chunk=4)
    looked(core, log, 6)
    first, second = core.join(6, 0.0), core.join(6, 0.0)
    looked(core, log, 16)
    assert core.take(first, 0.0) == FanoutTake(FanoutStep.OUTPUT, 6, b"6789")  # at most a chunk
    assert drain(core, first, log) == b"abcdef"
    assert drain(core, second, log) == b"6789abcdef"
    assert core.take(second, 0.0) == FanoutTake(FanoutStep.WAIT)


def test_a_reader_from_far_back_reads_its_own_way_then_joins_the_window() -> None:
    log = bytes(range(64))
    core = fanout(window=8, chunk=4)
    looked(core, log, 40)
    reader = core.join(3, 0.0)
    assert core.take(reader, 0.0) == FanoutTake(FanoutStep.BEHIND, 3)
    looked(core, log, 48)
    assert drain(core, reader, log) == log[3:48]
    assert core.take(reader, 0.0).step is FanoutStep.WAIT


def test_the_window_is_bounded_and_a_reader_it_passed_falls_back_to_the_file() -> None:
    log = bytes(range(200))
    core = fanout(window=8, chunk=4)
    looked(core, log, 0)
    slow = core.join(0, 0.0)
    for upto in range(4, 200, 4):
        looked(core, log, upto)
        assert len(core.window) <= 8
    assert core.take(slow, 1.0) == FanoutTake(FanoutStep.BEHIND, 0)
    assert drain(core, slow, log, 1.0) == log[:196]


def test_the_window_keeps_only_what_a_reader_within_it_still_needs() -> None:
    log = bytes(range(32))
    core = fanout(window=16, chunk=16)
    looked(core, log, 0)
    reader = core.join(0, 0.0)
    looked(core, log, 10)
    assert drain(core, reader, log) == log[:10]
    looked(core, log, 12)
    assert (core.start, core.end) == (10, 12)  # what it took is gone
    core.leave(reader)
    looked(core, log, 14)
    assert (core.start, core.window) == (14, bytearray())  # no reader: nothing kept


def test_a_reader_that_takes_nothing_for_the_stall_bound_is_dropped_and_the_others_go_on() -> None:
    log = bytes(range(100))
    core = fanout(window=64, chunk=64)
    looked(core, log, 0)
    stalled, keeping_up = core.join(0, 0.0), core.join(0, 0.0)
    looked(core, log, 10, now=1.0)
    assert drain(core, keeping_up, log, 1.0) == log[:10]
    assert looked(core, log, 20, now=1.0 + STALL_S - 0.1) == ()
    assert drain(core, keeping_up, log, 1.0 + STALL_S - 0.1) == log[10:20]
    assert looked(core, log, 30, now=1.0 + STALL_S) == (stalled,)
    assert core.take(stalled, 20.0) == FanoutTake(FanoutStep.DROPPED)
    assert core.readers == 1
    assert drain(core, keeping_up, log, 20.0) == log[20:30]


def test_a_reader_idle_at_the_end_is_not_dropped_when_output_comes_after_a_long_quiet() -> None:
    log = bytes(range(10))
    core = fanout()
    looked(core, log, 0)
    reader = core.join(0, 0.0)
    assert core.take(reader, 0.0).step is FanoutStep.WAIT
    looked(core, log, 0, now=100.0)  # quiet: the follower looked and found nothing
    assert looked(core, log, 5, now=200.0) == ()
    assert looked(core, log, 6, now=200.0 + STALL_S - 1) == ()
    assert drain(core, reader, log, 200.0 + STALL_S - 1) == log[:6]


def test_a_reader_that_keeps_taking_from_behind_is_not_dropped() -> None:
    log = bytes(range(256))
    core = fanout(window=4, chunk=4)
    looked(core, log, 128)
    reader = core.join(0, 0.0)
    for step in range(1, 40):  # one chunk a tick, far behind, every tick longer than the bound
        now = step * STALL_S * 0.9
        assert looked(core, log, 128 + step, now) == ()
        take = core.take(reader, now)
        assert take.step is FanoutStep.BEHIND
        assert core.read_behind(reader, log[take.offset:], now).step is FanoutStep.OUTPUT


@pytest.mark.parametrize("cursor", [51, 1000])
def test_a_cursor_ahead_of_the_log_is_reset_to_its_length_and_goes_on_from_there(cursor: int) -> None:
    log = bytes(range(80))
    core = fanout()
    reader = core.join(cursor, 0.0)
    looked(core, log, 50)
    assert core.take(reader, 0.0) == FanoutTake(FanoutStep.RESET, 50)
    looked(core, log, 54)
    assert drain(core, reader, log) == log[50:54]


def test_a_log_that_shrank_starts_the_window_again_and_resets_readers_past_it() -> None:
    core = fanout()
    looked(core, b"x" * 20, 0)
    ahead, behind = core.join(0, 0.0), core.join(0, 0.0)
    looked(core, b"x" * 20, 20)
    assert drain(core, ahead, b"x" * 20) == b"x" * 20
    core.feed(3, b"", 0.0)  # the file was replaced
    assert (core.start, core.end) == (3, 3)
    assert core.take(ahead, 0.0) == FanoutTake(FanoutStep.RESET, 3)
    assert core.take(behind, 0.0) == FanoutTake(FanoutStep.BEHIND, 0)


def test_claude_code_text_is_never_cut_inside_a_code_point() -> None:
    log = "añ€😀z".encode()
    core = fanout(window=64, chunk=64, text=True)
    looked(core, log, 0)
    reader = core.join(0, 0.0)
    for upto in range(1, len(log) + 1):  # every way the follower may cut the log
        looked(core, log, upto)
        got = drain(core, reader, log)
        got.decode()  # whole code points only
    assert core.take(reader, 0.0).step is FanoutStep.WAIT


def test_a_text_reader_behind_the_window_waits_for_a_whole_code_point() -> None:
    core = fanout(window=64, chunk=64, text=True)
    reader = core.join(0, 0.0)
    looked(core, "€".encode(), 3)
    assert core.take(reader, 0.0) == FanoutTake(FanoutStep.BEHIND, 0)
    assert core.read_behind(reader, "€".encode()[:2], 0.0) == FanoutTake(FanoutStep.WAIT)
    assert core.read_behind(reader, "€".encode(), 0.0) == FanoutTake(FanoutStep.OUTPUT, 0, "€".encode())


def test_an_ended_follower_ends_every_reader_and_a_dropped_one_stays_dropped() -> None:
    core = fanout()
    looked(core, b"abc", 0)
    first, second = core.join(0, 0.0), core.join(0, 0.0)
    looked(core, b"abc", 3, now=0.0)
    assert core.take(first, 0.0).step is FanoutStep.OUTPUT
    assert looked(core, b"abc", 3, now=STALL_S) == (second,)
    assert core.next_step(second) is FanoutStep.DROPPED
    core.end_all()
    assert core.next_step(first) is core.take(first, 0.0).step is FanoutStep.ENDED
    assert core.next_step(second) is core.take(second, 0.0).step is FanoutStep.DROPPED
    assert core.read_behind(second, b"abc", 0.0).step is FanoutStep.DROPPED


#: The exhaustive schedules: the follower looks at a growing log (by 0, 1 or 3 bytes), or one of
#: two readers (one from the start, one from the log's end when it joined) takes.
LOG = "ab€cd😀efghijklmnopqrstuvwxyz".encode()
ACTIONS = ("grow0", "grow1", "grow3", "take_a", "take_b")


def run_schedule(schedule: tuple[str, ...], text: bool) -> None:
    core = LogFanout(4, 2, STALL_S, text)
    upto = 0
    looked(core, LOG, upto)
    readers = {core.join(0, 0.0): 0, core.join(1, 0.0): 1}  # the second: a cursor ahead, reset
    got: dict[int, bytearray] = {reader: bytearray() for reader in readers}
    cursors: dict[int, Optional[int]] = dict(readers)
    for action in schedule:
        if action.startswith("grow"):
            upto = min(upto + int(action[-1]), len(LOG))
            assert looked(core, LOG, upto) == ()  # the clock stands still: no one stalls
            assert len(core.window) <= 4
            continue
        reader = list(readers)[action == "take_b"]
        predicted = core.next_step(reader)  # what the follower decides a push or a wake-up from
        take = core.take(reader, 0.0)
        # the same step, but for text whose code point is not whole yet
        assert take.step is predicted or (text and (predicted, take.step) == (FanoutStep.OUTPUT, FanoutStep.WAIT))
        if take.step is FanoutStep.BEHIND:
            assert take.offset == cursors[reader] and take.offset < core.start
            take = core.read_behind(reader, LOG[take.offset:upto], 0.0)
        if take.step is FanoutStep.RESET:
            assert cursors[reader] is not None and cursors[reader] > upto  # type: ignore[operator]
            cursors[reader] = take.offset
        elif take.step is FanoutStep.OUTPUT:
            assert take.offset == cursors[reader] and 0 < len(take.data) <= 2
            assert take.data == LOG[take.offset:take.offset + len(take.data)]
            if text:
                take.data.decode()
            got[reader] += take.data
            cursors[reader] = take.offset + len(take.data)
        else:
            assert take.step is FanoutStep.WAIT
    for reader, start in readers.items():
        taken_from = 0 if start == 0 else cursors[reader] - len(got[reader])  # type: ignore[operator]
        assert bytes(got[reader]) == LOG[taken_from:cursors[reader]]


@pytest.mark.parametrize("text", [False, True])
def test_every_schedule_of_six_steps_gives_each_reader_its_bytes_in_order(text: bool) -> None:
    for schedule in itertools.product(ACTIONS, repeat=6):
        run_schedule(schedule, text)
