"""agent.py's pure cores, without processes: codec, text handling, queue, command template, archive rules."""

from __future__ import annotations

import base64
import errno
import fcntl
import io
import json
import os
import re
import tarfile

import pytest
from hypothesis import given, settings, strategies as st

from agent_fixtures.harness import agent

# ---------------------------------------------------------------------------------------------------------------------
# Framing


def test_framer_returns_the_line_once_the_newline_arrives():
    framer = agent.RequestFramer()
    assert framer.feed(b'{"id":') is None
    assert framer.feed(b'"1"}\n') == b'{"id":"1"}'


def test_framer_accepts_exactly_the_limit_and_rejects_one_more():
    assert agent.RequestFramer(max_bytes=4).feed(b"abcd\n") == b"abcd"
    with pytest.raises(agent.RequestError, match="exceeds 4 bytes"):
        agent.RequestFramer(max_bytes=4).feed(b"abcde\n")


def test_framer_rejects_an_over_long_line_before_its_newline():
    framer = agent.RequestFramer(max_bytes=4)
    assert framer.feed(b"abcd") is None
    with pytest.raises(agent.RequestError, match="exceeds"):
        framer.feed(b"e")


def test_framer_rejects_data_after_the_line():
    with pytest.raises(agent.RequestError, match="one request at a time"):
        agent.RequestFramer().feed(b"{}\n{}")


@pytest.mark.parametrize("data, message", [(b"", "empty request"), (b"{}", "must end with a newline")])
def test_framer_eof_before_newline_is_an_error(data, message):
    framer = agent.RequestFramer()
    framer.feed(data)
    with pytest.raises(agent.RequestError, match=message):
        framer.eof()


# ---------------------------------------------------------------------------------------------------------------------
# The request parser


def parse(document) -> agent.Request:
    return agent.parse_request(json.dumps(document).encode())


@pytest.mark.parametrize("method, params, expected", [
    ("message", {"text": "hi"}, agent.MessageParams("hi", None, False)),
    ("message", {"text": "hi", "draft": "0123456789abcdef", "more": True},
     agent.MessageParams("hi", "0123456789abcdef", True)),
    ("interrupt", {}, agent.NoParams()),
    ("relaunch", {}, agent.NoParams()),
    ("status", {}, agent.NoParams()),
    ("read", {}, agent.ReadParams(0, agent.DEFAULT_READ_BYTES, 0)),
    ("read", {"offset": 7, "max_bytes": 4, "wait_ms": agent.MAX_READ_WAIT_MS}, agent.ReadParams(7, 4, 4000)),
    ("read_fd", {}, agent.ReadParams(0, agent.MAX_LOG_WINDOW_BYTES, 0)),
    ("read_fd", {"offset": 7, "max_bytes": agent.MAX_READ_BYTES + 1, "wait_ms": 9},
     agent.ReadParams(7, agent.MAX_READ_BYTES + 1, 9)),
    ("write", {"data_b64": base64.b64encode(b"\x00\xff").decode()}, agent.WriteParams(b"\x00\xff")),
    ("resize", {"columns": 1, "rows": 65535}, agent.ResizeParams(1, 65535)),
    ("checkpoint", {"id": "snap-1.a_b"}, agent.CheckpointParams("snap-1.a_b", agent.ARCHIVE_PARTS)),
    ("checkpoint", {"id": "s", "include": ["home", "log"]}, agent.CheckpointParams("s", ("log", "home"))),
    ("restore", {"path": "x.tar"}, agent.RestoreParams("x.tar")),
    ("suspend", {"reason": "max_busy"}, agent.SuspendParams("max_busy")),
])
def test_every_method_parses_into_its_params(method, params, expected):
    request = parse({"id": "7", "method": method, "params": params})
    assert request == agent.Request("7", agent.Method(method), expected)


def test_params_may_be_omitted():
    assert parse({"id": "1", "method": "status"}).params == agent.NoParams()


@pytest.mark.parametrize("line", [b"not json", b"\xff\xfe", b"[1]", b'{"method":"status"}', b'{"id":5}',
                                  b'{"id":"' + b"x" * 300 + b'"}'])
def test_requests_without_a_readable_id_answer_with_an_empty_id(line):
    with pytest.raises(agent.RequestError) as caught:
        agent.parse_request(line)
    assert caught.value.request_id == ""
    assert caught.value.code == "invalid_request"


@pytest.mark.parametrize("document, message", [
    ({"id": "9", "method": "status", "extra": 1}, "unknown request fields: extra"),
    ({"id": "9", "method": "launch"}, "unknown method 'launch'"),
    ({"id": "9", "method": 3}, "method must be a string"),
    ({"id": "9", "method": "status", "params": []}, "params must be an object"),
    ({"id": "9", "method": "status", "params": {"x": 1}}, "unknown params for status: x"),
    ({"id": "9", "method": "message", "params": {}}, "params.text is required"),
    ({"id": "9", "method": "message", "params": {"text": ""}}, "params.text must not be empty"),
    ({"id": "9", "method": "message", "params": {"text": 5}}, "params.text must be a string"),
    ({"id": "9", "method": "message", "params": {"text": "x", "draft": "../x"}}, "params.draft must"),
    ({"id": "9", "method": "message", "params": {"text": "x", "more": 1}}, "params.more must"),
    ({"id": "9", "method": "read", "params": {"offset": True}}, "params.offset must be an integer"),
    ({"id": "9", "method": "read", "params": {"offset": -1}}, "params.offset must be between"),
    ({"id": "9", "method": "read", "params": {"max_bytes": 3}}, "params.max_bytes must be between"),
    ({"id": "9", "method": "read", "params": {"max_bytes": agent.MAX_READ_BYTES + 1}}, "max_bytes must be between"),
    ({"id": "9", "method": "read", "params": {"wait_ms": agent.MAX_READ_WAIT_MS + 1}}, "wait_ms must be between"),
    ({"id": "9", "method": "read_fd", "params": {"max_bytes": 3}}, "params.max_bytes must be between"),
    ({"id": "9", "method": "read_fd", "params": {"offset": 2**63}}, "params.offset must be between"),
    ({"id": "9", "method": "read_fd", "params": {"data_b64": ""}}, "unknown params for read_fd: data_b64"),
    ({"id": "9", "method": "write", "params": {"data_b64": "***"}}, "not valid base64"),
    ({"id": "9", "method": "resize", "params": {"columns": 0, "rows": 5}}, "columns must be between"),
    ({"id": "9", "method": "resize", "params": {"columns": 80}}, "params.rows is required"),
    ({"id": "9", "method": "checkpoint", "params": {"id": "../x"}}, "params.id must match"),
    ({"id": "9", "method": "checkpoint", "params": {"id": ".hidden"}}, "params.id must match"),
    ({"id": "9", "method": "checkpoint", "params": {"id": "snap\n"}}, "params.id must match"),
    ({"id": "9", "method": "checkpoint", "params": {"id": "a", "include": []}}, "params.include must be"),
    ({"id": "9", "method": "checkpoint", "params": {"id": "a", "include": ["home", "home"]}}, "params.include must be"),
    ({"id": "9", "method": "checkpoint", "params": {"id": "a", "include": ["etc"]}}, "params.include must be"),
    ({"id": "9", "method": "suspend", "params": {}}, "params.reason is required"),
    ({"id": "9", "method": "suspend", "params": {"reason": "max_busy\n"}}, "params.reason must match"),
    ({"id": "9", "method": "suspend", "params": {"reason": "Max busy"}}, "params.reason must match"),
])
def test_malformed_requests_with_an_id_echo_it(document, message):
    with pytest.raises(agent.RequestError, match=re.escape(message)) as caught:
        parse(document)
    assert caught.value.request_id == "9"


def test_duplicate_keys_are_rejected():
    with pytest.raises(agent.RequestError, match="duplicate field"):
        agent.parse_request(b'{"id":"1","method":"status","method":"read"}')


def test_responses_are_one_line_with_a_type_tagged_result_or_an_error():
    result = agent.encode_result("a", agent.Method.STATUS, {"pid": 3})
    error = agent.encode_error("b", "timeout", "slow")
    assert result.endswith(b"\n") and result.count(b"\n") == 1
    assert json.loads(result) == {"id": "a", "result": {"type": "status", "pid": 3}}
    assert json.loads(error) == {"id": "b", "error": {"code": "timeout", "message": "slow"}}


@pytest.mark.parametrize("error, code", [
    (agent.RequestError("x"), "invalid_request"), (agent.CommandError("x"), "command_error"),
    (agent.HandlerTimeout("x"), "timeout"), (agent.UnavailableError("x"), "server_unavailable"),
    (agent.ArchiveError("x"), "command_error"),
])
def test_each_exception_carries_its_wire_code(error, code):
    assert error.code == code


# ---------------------------------------------------------------------------------------------------------------------
# UTF-8 boundaries and the normaliser

SAMPLE = "aé€😀b\u00ff\U0001f600z"


def test_utf8_prefix_is_the_longest_whole_code_point_prefix_for_every_limit():
    data = SAMPLE.encode()
    for limit in range(len(data) + 2):
        prefix = agent.utf8_prefix(data, limit)
        prefix.decode("utf-8")  # whole code points only
        assert len(prefix) <= limit and data.startswith(prefix)
        longer = data[:len(prefix) + 1]
        assert len(prefix) == len(data) or len(longer) > limit or not _decodes(data[:limit])


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_normaliser_gives_the_same_text_for_every_split_point():
    data = SAMPLE.encode() + b"\xff\xc3"
    expected = data.decode("utf-8", errors="replace")
    for split in range(len(data) + 1):
        normaliser = agent.Utf8Normaliser()
        text = normaliser.feed(data[:split]) + normaliser.feed(data[split:]) + normaliser.finish()
        assert text == expected


def test_normaliser_holds_a_split_code_point_until_it_is_complete():
    normaliser = agent.Utf8Normaliser()
    assert normaliser.feed("€".encode()[:2]) == ""
    assert normaliser.feed("€".encode()[2:]) == "€"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=12), max_size=8))
def test_normaliser_matches_whole_decoding_for_any_chunking(chunks):
    normaliser = agent.Utf8Normaliser()
    text = "".join(normaliser.feed(chunk) for chunk in chunks) + normaliser.finish()
    assert text == b"".join(chunks).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------------------------------
# The redactor


def redact_in_chunks(secrets, chunks) -> str:
    redactor = agent.Redactor(secrets)
    return "".join(redactor.feed(chunk) for chunk in chunks) + redactor.finish()


def test_redactor_replaces_a_secret_split_across_every_position():
    text = "key=hunter22 and hunter22!"
    for split in range(len(text) + 1):
        assert redact_in_chunks(["hunter22"], [text[:split], text[split:]]) == "key=[REDACTED] and [REDACTED]!"


def test_redactor_prefers_the_longer_secret_that_starts_at_the_same_place():
    assert redact_in_chunks(["abc", "abcdef"], ["xxabc", "def yy"]) == "xx[REDACTED] yy"
    assert redact_in_chunks(["abc", "abcdef"], ["xxabc", "dex"]) == "xx[REDACTED]dex"


def test_redactor_emits_nothing_that_could_still_become_a_secret():
    redactor = agent.Redactor(["secret"])
    assert redactor.feed("a sec") == "a "
    assert redactor.feed("ond") == "second"


def test_redactor_waits_for_a_longer_secret_that_starts_before_a_shorter_match():
    assert redact_in_chunks(["a", "baa"], ["ba", "a"]) == "[REDACTED]"
    assert redact_in_chunks(["a", "baa"], ["xba", "ay"]) == "x[REDACTED]y"
    assert redact_in_chunks(["a", "baa"], ["xba", "b"]) == "xb[REDACTED]b"


def test_redactor_without_secrets_passes_text_through_at_once():
    assert agent.Redactor([]).feed("abc") == "abc"


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.text(alphabet="ab", min_size=1, max_size=4), min_size=1, max_size=3),
       st.text(alphabet="abc", max_size=30), st.lists(st.integers(0, 30), max_size=5))
def test_redactor_matches_whole_text_substitution_for_any_chunking(secrets, text, cuts):
    ordered = sorted(set(secrets), key=len, reverse=True)
    expected = re.sub("|".join(map(re.escape, ordered)), agent.REDACTED, text)
    bounds = sorted({0, len(text), *[min(cut, len(text)) for cut in cuts]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert redact_in_chunks(secrets, chunks) == expected


# ---------------------------------------------------------------------------------------------------------------------
# The stream-json projector


def events(*items) -> bytes:
    return b"".join(json.dumps(item).encode() + b"\n" for item in items)


def stream_event(event) -> dict:
    return {"type": "stream_event", "event": event}


BLOCK_START = stream_event({"type": "content_block_start", "content_block": {"type": "text", "text": "Hi"}})
DELTA = stream_event({"type": "content_block_delta", "delta": {"type": "text_delta", "text": " there"}})
MESSAGE_STOP = stream_event({"type": "message_stop"})
RESULT = {"type": "result", "result": "the result"}


def project(data: bytes, chunk: int = 0) -> str:
    projector = agent.StreamJsonProjector()
    pieces = [data[i:i + chunk] for i in range(0, len(data), chunk)] if chunk else [data]
    return "".join(projector.feed(piece) for piece in pieces) + projector.finish()


def test_projector_takes_block_starts_and_deltas_and_ends_the_message_with_a_newline():
    assert project(events(BLOCK_START, DELTA, MESSAGE_STOP, RESULT)) == "Hi there\n"


def test_projector_adds_no_newline_when_the_text_already_ends_with_one():
    delta = stream_event({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "x\n"}})
    assert project(events(delta, MESSAGE_STOP)) == "x\n"


def test_projector_uses_the_result_only_when_nothing_else_was_projected():
    assert project(events({"type": "system"}, MESSAGE_STOP, RESULT)) == "the result\n"


def test_projector_passes_non_json_lines_through_and_replaces_invalid_utf8():
    assert project(b"plain line\n\xffbad\n[1,2]\n") == "plain line\n\ufffdbad\n[1,2]\n"


def test_projector_drops_other_events_and_non_text_blocks():
    tool = stream_event({"type": "content_block_start", "content_block": {"type": "tool_use", "name": "x"}})
    thinking = stream_event({"type": "content_block_delta", "delta": {"type": "thinking_delta", "text": "hmm"}})
    assert project(events(tool, thinking, {"type": "assistant", "message": {}})) == ""


def test_projector_accepts_unwrapped_events():
    assert project(events({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "raw"}})) == "raw"


def test_projector_output_does_not_depend_on_how_stdout_was_split():
    data = events(BLOCK_START, DELTA, MESSAGE_STOP) + "é€ plain\n".encode() + events(RESULT) + b"tail"
    whole = project(data)
    assert whole == "Hi there\né€ plain\ntail\n"
    for chunk in range(1, 12):
        assert project(data, chunk) == whole


def test_projector_skips_an_over_long_line_with_one_marker():
    projector = agent.StreamJsonProjector(max_line_bytes=8)
    out = projector.feed(b"0123456789") + projector.feed(b"abcdef") + projector.feed(b"\nok\n")
    assert out == "\n[reploy: skipped a stream-json line over 8 bytes]\nok\n"


# ---------------------------------------------------------------------------------------------------------------------
# Merging a run's stdout and stderr into one log
# ---------------------------------------------------------------------------------------------------------------------


def merge(steps, log: str = "", max_held_chars: int = agent.MAX_HELD_STDERR_CHARS) -> str:
    """Drives a LineMerger the way the agent does: each call told whether the log so far ends a line."""
    merger = agent.LineMerger(max_held_chars)
    for stream, text in steps:
        at_line_start = log == "" or log.endswith("\n")
        log += merger.stdout(text, at_line_start) if stream == "out" else merger.stderr(text, at_line_start)
    return log + merger.finish(log == "" or log.endswith("\n"))


def test_a_stderr_line_waits_for_the_reply_line_it_arrived_in_to_end():
    assert merge([("out", "after"), ("err", "diagnostics here\n"), ("out", " stderr"), ("out", "\n")]) == \
        "after stderr\ndiagnostics here\n"


def test_stderr_goes_out_a_whole_line_at_a_time():
    merger = agent.LineMerger()
    assert merger.stderr("one\ntw", True) == "one\n"
    assert merger.stderr("o\nthr", True) == "two\n"
    assert merger.finish(True) == "thr"


def test_what_stderr_holds_at_the_end_goes_out_after_a_line_break():
    assert merge([("out", "reply"), ("err", "partial"), ("err", " diag\n")]) == "reply\npartial diag\n"


def test_held_stderr_is_bounded_and_then_goes_out_after_a_line_break():
    merger = agent.LineMerger(max_held_chars=8)
    assert merger.stderr("1234\n", False) == ""
    assert merger.stderr("5678", False) == "\n1234\n5678"
    assert merger.finish(False) == ""


def test_a_log_that_does_not_end_a_line_holds_stderr_back_even_before_any_stdout():
    assert merge([("err", "diag\n")], log="[earlier") == "[earlier\ndiag\n"
    merger = agent.LineMerger()
    assert merger.stderr("diag\n", False) == "" and merger.stdout("", True) == "diag\n"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["out", "err"]), st.text("ab\n", max_size=6)), max_size=12))
def test_no_line_mixes_the_two_streams_whatever_the_arrival_order(steps):
    """Tag each stream's characters apart (stdout a/b, stderr A/B); no merged line may hold both kinds, and each
    stream's text comes out whole and in order."""
    tagged = [(stream, text if stream == "out" else text.upper()) for stream, text in steps]
    merged = merge(tagged)
    stdout_text = "".join(text for stream, text in tagged if stream == "out")
    stderr_text = "".join(text for stream, text in tagged if stream == "err")
    for line in merged.split("\n"):
        assert not (set(line) & set("ab") and set(line) & set("AB")), merged
    assert [c for c in merged if c in "ab"] == [c for c in stdout_text if c in "ab"]
    assert [c for c in merged if c in "AB"] == [c for c in stderr_text if c in "AB"]
    expected_lines = [line for line in (stdout_text + "\n" + stderr_text).split("\n") if line]
    assert sorted(line for line in merged.split("\n") if line) == sorted(expected_lines)


# ---------------------------------------------------------------------------------------------------------------------
# The queue and the command template


def test_queue_is_fifo_and_counts_bytes():
    queue = agent.PromptQueue()
    queue.push("é")
    queue.push("b")
    assert (len(queue), queue.total_bytes) == (2, 3)
    assert queue.pop() == "é" and queue.total_bytes == 1


def test_queue_limits_are_each_their_own_error():
    with pytest.raises(agent.RequestError, match="message is 5 bytes; the limit is 4"):
        agent.PromptQueue(max_item_bytes=4).push("abcde")
    counted = agent.PromptQueue(max_items=2)
    counted.push("a")
    counted.push("b")
    with pytest.raises(agent.UnavailableError, match="2 messages are waiting"):
        counted.push("c")
    sized = agent.PromptQueue(max_total_bytes=5)
    sized.push("abc")
    with pytest.raises(agent.UnavailableError, match="would exceed 5 bytes"):
        sized.push("abc")
    sized.push("ab")
    assert sized.total_bytes == 5


def test_default_command_matches_the_claude_code_invocation():
    argv = agent.expand_command(agent.DEFAULT_AGENT_ARGV, "do it", None, False)
    assert argv == ["claude", "--permission-mode", "auto", "-p", "--output-format", "stream-json", "--verbose",
                    "--include-partial-messages", "--", "do it"]
    resumed = agent.expand_command(agent.DEFAULT_AGENT_ARGV, "-x", "opus", True)
    assert resumed[:4] == ["claude", "--continue", "--model", "opus"] and resumed[-2:] == ["--", "-x"]


def test_a_prompt_on_stdin_leaves_the_prompt_and_the_dashes_before_it_out():
    assert agent.expand_command(agent.DEFAULT_AGENT_ARGV, None, None, False) == [
        "claude", "--permission-mode", "auto", "-p", "--output-format", "stream-json", "--verbose",
        "--include-partial-messages"]
    assert agent.expand_command(("c", "--", "x", "{prompt}"), None, None, False) == ["c", "--", "x"]
    assert agent.expand_command(("c", "{prompt}", "--"), None, None, False) == ["c", "--"]


def drafts(**kwargs) -> agent.MessageDrafts:
    ids = iter(f"{n:016x}" for n in range(100))
    return agent.MessageDrafts(lambda: next(ids), **kwargs)


def test_a_draft_collects_its_parts_and_is_closed_by_the_last():
    table = drafts()
    assert table.add(None, "ab", 0.0) == ("0000000000000000", 2)
    assert table.add("0000000000000000", "é", 1.0) == ("0000000000000000", 4)
    assert table.take("0000000000000000", "!") == "abé!"
    with pytest.raises(agent.CommandError, match="no such draft"):
        table.take("0000000000000000", "x")


def test_drafts_are_bounded_in_number_and_size_and_expire():
    table = drafts(max_open=2, max_bytes=4)
    first, _ = table.add(None, "a", 0.0)
    second, _ = table.add(None, "b", 5.0)
    with pytest.raises(agent.UnavailableError, match="drafts are full"):
        table.add(None, "c", 5.0)
    with pytest.raises(agent.RequestError, match="too large"):
        table.add(first, "xxxx", 5.0)  # 5 bytes: dropped
    with pytest.raises(agent.RequestError, match="too large"):
        table.take(second, "xxxx")
    assert table.next_deadline() is None
    third, _ = table.add(None, "c", 10.0)
    assert table.next_deadline() == 10.0 + agent.DRAFT_IDLE_S
    table.expire(10.0 + agent.DRAFT_IDLE_S - 0.001)
    assert table.take(third, "d") == "cd"
    fourth, _ = table.add(None, "e", 20.0)
    table.expire(20.0 + agent.DRAFT_IDLE_S)
    with pytest.raises(agent.CommandError, match="no such draft"):
        table.add(fourth, "f", 21.0)


@pytest.mark.parametrize("template", [[], ["claude"], ["c", "{prompt}", "{prompt}"], ["c", "{model}", "{model}",
                                                                                    "{prompt}"], ["c", 3]])
def test_bad_command_templates_are_usage_errors(template):
    with pytest.raises(agent.UsageError):
        agent.validate_command_template(template)


# ---------------------------------------------------------------------------------------------------------------------
# The output log (a file, no processes)


def test_log_reads_never_consume_and_offsets_past_the_end_reset(tmp_path):
    log = agent.OutputLog(tmp_path / "log", 1000, text=False)
    log.append(b"hello ")
    log.append(b"world")
    assert log.read(0, 100).data == log.read(0, 100).data == b"hello world"
    piece = log.read(6, 3)
    assert (piece.data, piece.next_offset_bytes, piece.length_bytes, piece.reset) == (b"wor", 9, 11, False)
    assert log.read(11, 10) == agent.LogSlice(11, b"", 11, 11, False)
    assert log.read(50, 10) == agent.LogSlice(50, b"", 11, 11, True)


def test_log_survives_reopening_with_the_same_bytes_at_the_same_offsets(tmp_path):
    log = agent.OutputLog(tmp_path / "log", 1000, text=True)
    log.append("one €\n".encode())
    log.close()
    again = agent.OutputLog(tmp_path / "log", 1000, text=True)
    assert again.length_bytes == 8 and again.read(0, 100).data == "one €\n".encode()
    again.append(b"two")
    assert again.read(8, 100).data == b"two"


def test_log_cap_ends_the_log_with_a_marker_and_stops_growing(tmp_path):
    log = agent.OutputLog(tmp_path / "log", 200, text=False)
    assert log.append(b"a" * 40) == 40
    kept = log.append(b"b" * 200)
    assert log.capped and kept < 200
    content = log.read(0, 1000).data
    assert content.startswith(b"a" * 40 + b"b" * kept)
    assert content.endswith(b"[reploy: output log reached its cap of 200 bytes; later output is discarded]\r\n")
    assert log.length_bytes == 200
    assert log.append(b"more") == 0 and log.read(0, 1000).data == content
    log.close()
    assert agent.OutputLog(tmp_path / "log", 200, text=False).capped


def test_text_log_cuts_on_code_points_when_capped_and_when_read(tmp_path):
    log = agent.OutputLog(tmp_path / "log", 200, text=True)
    log.append(("€" * 100).encode())
    content = log.read(0, agent.MAX_READ_BYTES).data
    content.decode("utf-8")  # the cap cut between code points
    assert log.read(0, 4).data == "€".encode()
    with pytest.raises(agent.CommandError, match="not on a UTF-8 boundary"):
        log.read(1, 10)


def expected_window(content: bytes, text: bool, offset: int, max_bytes: int) -> tuple[int, int, int, bool] | None:
    """read's rules (docs/agent.md), worked out from the bytes themselves: None where a text read is refused."""
    def boundary(at: int) -> bool:
        return not text or at >= len(content) or content[at] & 0xC0 != 0x80
    if offset > len(content):
        return offset, len(content), len(content), True
    if not boundary(offset):
        return None
    end = min(offset + max_bytes, len(content))
    while not boundary(end):
        end -= 1
    return offset, end, len(content), False


def test_a_window_and_a_read_keep_reads_rules_at_every_offset_and_bound(tmp_path):
    """read_fd's window and read's slice, in both modes: a reset past the end, a text start inside a code point
    refused, a text end inside one backed over; the slice holds exactly the window's bytes."""
    for text, content in ((False, b"\xff\x80raw\xe2\x82 bytes\r\n"), (True, "aé€😀z\n".encode())):
        log = agent.OutputLog(tmp_path / f"log-{text}", 1000, text=text)
        log.append(content)
        for offset in range(len(content) + 3):
            for max_bytes in range(agent.MIN_READ_BYTES, len(content) + 2):
                expected = expected_window(content, text, offset, max_bytes)
                if expected is None:
                    for refused in (log.window, log.read):
                        with pytest.raises(agent.CommandError, match="not on a UTF-8 boundary"):
                            refused(offset, max_bytes)
                    continue
                window, piece = log.window(offset, max_bytes), log.read(offset, max_bytes)
                assert (window.offset_bytes, window.next_offset_bytes, window.length_bytes, window.reset) == expected
                assert (piece.offset_bytes, piece.next_offset_bytes, piece.length_bytes, piece.reset) == expected
                assert piece.data == content[offset:expected[1]]
        log.close()


def test_the_log_reader_is_a_read_only_descriptor_of_the_log_itself(tmp_path):
    log = agent.OutputLog(tmp_path / "log", 1000, text=False)
    log.append(b"first")
    reader = log.reader()
    try:
        assert fcntl.fcntl(reader, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        with pytest.raises(OSError) as refused:
            os.write(reader, b"x")
        assert refused.value.errno == errno.EBADF
        with pytest.raises(OSError):
            os.ftruncate(reader, 0)
        log.append(b" second")  # the very file the log appends to, not a copy
        assert os.pread(reader, 100, 0) == b"first second" == (tmp_path / "log").read_bytes()
    finally:
        os.close(reader)
        log.close()


def test_log_markers_start_on_a_fresh_line(tmp_path):
    log = agent.OutputLog(tmp_path / "log", 1000, text=True)
    log.append_marker("first")
    log.append(b"partial")
    log.append_marker("second")
    assert log.read(0, 1000).data == b"[reploy: first]\npartial\n[reploy: second]\n"


# ---------------------------------------------------------------------------------------------------------------------
# The outbox


def read_events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_outbox_seq_is_monotonic_across_reopening(tmp_path):
    path = tmp_path / "events.jsonl"
    outbox = agent.Outbox(path)
    outbox.emit(agent.EventKind.SESSION_START)
    outbox.close()
    agent.Outbox(path).emit(agent.EventKind.SESSION_END, reason="signal")
    assert [event["seq"] for event in read_events(path)] == [1, 2]


def test_outbox_reconcile_closes_what_a_dead_agent_left_open(tmp_path):
    path = tmp_path / "events.jsonl"
    outbox = agent.Outbox(path)
    outbox.emit(agent.EventKind.SESSION_START)
    finished = outbox.start_turn()
    outbox.end_turn(finished, agent.Outcome.COMPLETED)
    open_turn = outbox.start_turn()
    outbox.close()
    with open(path, "ab") as f:
        f.write(b'{"seq": 99, "ty')  # torn by the crash
    again = agent.Outbox(path)
    again.reconcile()
    again.reconcile()  # idempotent: nothing is closed twice
    events_ = [json.loads(line) for line in path.read_text().splitlines() if not line.startswith('{"seq": 99')]
    ends = [event for event in events_ if event["type"] == "turn_end"]
    assert [(end["turn"], end["outcome"]) for end in ends] == [(finished, "completed"), (open_turn, "failed")]
    assert events_[-1]["type"] == "session_end" and events_[-1]["reason"] == "agent_died"
    assert [event["seq"] for event in events_] == sorted({event["seq"] for event in events_})


# ---------------------------------------------------------------------------------------------------------------------
# Archive rules


def member(name, kind=tarfile.REGTYPE, size=0, linkname=""):
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = kind, size, linkname
    return info


BASE = [member(agent.ARCHIVE_MANIFEST, size=10), member(agent.ARCHIVE_LOG, size=5), member("workspace", tarfile.DIRTYPE)]
ALL = agent.ARCHIVE_PARTS


def test_a_plain_archive_passes():
    agent.check_archive_members(BASE + [member("workspace/a", size=3), member("home", tarfile.DIRTYPE),
                                        member("workspace/l", tarfile.SYMTYPE, linkname="a")], ALL)


def test_an_archive_holds_only_what_its_manifest_includes():
    home_only = [member(agent.ARCHIVE_MANIFEST, size=10), member("home", tarfile.DIRTYPE), member("home/a", size=1)]
    agent.check_archive_members(home_only, ("home",))  # no log needed
    for extra in (member(agent.ARCHIVE_LOG, size=1), member("workspace", tarfile.DIRTYPE)):
        with pytest.raises(agent.ArchiveError, match="unexpected member"):
            agent.check_archive_members(home_only + [extra], ("home",))


@pytest.mark.parametrize("extra, message", [
    ([member("/etc/passwd")], "unsafe member name"),
    ([member("workspace/../../x")], "unsafe member name"),
    ([member("workspace/./x")], "unsafe member name"),
    ([member("elsewhere/x")], "unexpected member"),
    ([member("workspace/a"), member("workspace/a")], "duplicate member"),
    ([member("workspace/h", tarfile.LNKTYPE, linkname="workspace/a")], "not a regular file, directory or symlink"),
    ([member("workspace/dev", tarfile.CHRTYPE)], "not a regular file, directory or symlink"),
    ([member("workspace/fifo", tarfile.FIFOTYPE)], "not a regular file, directory or symlink"),
    ([member("workspace/l", tarfile.SYMTYPE, linkname="/etc")], "escapes its tree"),
    ([member("workspace/l", tarfile.SYMTYPE, linkname="../home")], "escapes its tree"),
    ([member("workspace/d/l", tarfile.SYMTYPE, linkname="../../x")], "escapes its tree"),
    ([member("workspace/up", tarfile.SYMTYPE, linkname="."), member("workspace/l", tarfile.SYMTYPE,
                                                                    linkname="up/..")], "escapes its tree"),
    ([member("workspace/l", tarfile.SYMTYPE, linkname="d"), member("workspace/l/x")], "lies below a symlink"),
    ([member("home", tarfile.SYMTYPE, linkname="workspace")], "not a regular file, directory or symlink"),
])
def test_hostile_members_are_refused(extra, message):
    with pytest.raises(agent.ArchiveError, match=message):
        agent.check_archive_members(BASE + extra, ALL)


def test_archive_limits_on_entries_and_bytes():
    with pytest.raises(agent.ArchiveError, match="more than 3 entries"):
        agent.check_archive_members(BASE + [member("workspace/x")], ALL, max_entries=3)
    with pytest.raises(agent.ArchiveError, match="exceeds 20 bytes"):
        agent.check_archive_members(BASE + [member("workspace/x", size=6)], ALL, max_bytes=20)


def sparse_member(name, size, segments):
    info = member(name, size=size)
    info.sparse = segments
    return info


def test_a_sparse_members_data_counts_and_its_map_must_be_sane():
    """Issue 26: a restore counts a sparse member by its data, so a sparse file that fits restores, and seeks to each
    segment only once its map is in order and inside the member."""
    big = sparse_member("workspace/sparse", 1 << 40, [(0, 4), (1 << 39, 6), (1 << 40, 0)])
    agent.check_archive_members(BASE + [big], ALL, max_bytes=25)  # the manifest's 10, the log's 5 and its 10
    with pytest.raises(agent.ArchiveError, match="exceeds 25 bytes"):
        agent.check_archive_members(BASE + [sparse_member("workspace/s", 1 << 40, [(0, 11)])], ALL, max_bytes=25)
    for segments in ([(10, 4), (0, 4)], [(0, 8), (4, 4)], [(0, 4), (1 << 40, 1)], [(0, -1)]):
        with pytest.raises(agent.ArchiveError, match="out of order or past its size"):
            agent.check_archive_members(BASE + [sparse_member("workspace/s", 1 << 40, segments)], ALL)


def test_a_member_below_a_symlink_is_found_however_deep():
    deep = "workspace/" + "/".join(["d"] * 1200)
    links = [member("workspace/l", tarfile.SYMTYPE, linkname="d"), member("workspace/l/x")]
    with pytest.raises(agent.ArchiveError, match="lies below a symlink"):
        agent.check_archive_members(BASE + links, ALL)
    many_links = [member(f"workspace/l{n}", tarfile.SYMTYPE, linkname="d") for n in range(2000)]
    with pytest.raises(agent.ArchiveError, match="lies below a symlink"):
        agent.check_archive_members(BASE + many_links + [member("workspace/l1999/x")], ALL)
    agent.check_archive_members(BASE + [member(deep, size=1)] + links[:1], ALL)


@settings(max_examples=300, deadline=None)
@given(name=st.text(min_size=1, max_size=300), target=st.text(max_size=200),
       kind=st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE]),
       size=st.integers(0, 2 ** 40), mtime=st.integers(-10, 2 ** 40), sparse=st.booleans())
def test_a_members_measure_is_what_tarfile_writes(name, target, kind, size, mtime, sparse):
    """measure_tree sums tar_member_bytes before the archive exists; MeasuredSink then refuses a byte past it. So
    the measure must be exactly what tarfile writes, headers and padding, for any name, link, size and time."""
    info = tarfile.TarInfo(name)
    info.type, info.mtime = kind, mtime
    if kind == tarfile.SYMTYPE:
        info.linkname = target
    if kind == tarfile.REGTYPE:
        info.size = size
        if sparse:
            info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": name,
                                "GNU.sparse.realsize": str(size * 2)}
    try:
        header = info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
    except (ValueError, UnicodeEncodeError):  # what tarfile cannot write at all, no walk yields
        return
    assert agent.tar_member_bytes(info) == len(header) + size * (kind == tarfile.REGTYPE) + (
        -info.size % tarfile.BLOCKSIZE)


@pytest.mark.parametrize("missing", [agent.ARCHIVE_MANIFEST, agent.ARCHIVE_LOG])
def test_archive_must_hold_manifest_and_log(missing):
    with pytest.raises(agent.ArchiveError, match=f"lacks {missing}"):
        agent.check_archive_members([m for m in BASE if m.name != missing], ALL)


GOOD_MANIFEST = {"format": agent.ARCHIVE_FORMAT, "version": 2, "id": "a", "workload": "shell", "log_bytes": 0,
                 "continue": False, "include": ["log", "workspace", "home"]}


@pytest.mark.parametrize("changes, message", [
    (None, "must hold exactly"),
    ({"format": "x"}, "not a"),
    ({"version": 1}, "not a"),
    ({"workload": "vm"}, "workload is invalid"),
    ({"log_bytes": -1}, "log_bytes"),
    ({"id": "/x"}, "id is invalid"),
    ({"include": []}, "manifest include must be"),
    ({"include": ["home", "home"]}, "manifest include must be"),
])
def test_bad_manifests_are_refused(changes, message):
    document = {} if changes is None else {**GOOD_MANIFEST, **changes}
    with pytest.raises(agent.ArchiveError, match=message):
        agent.parse_manifest(json.dumps(document).encode())


def test_manifest_round_trips():
    for include in (agent.ARCHIVE_PARTS, ("home",)):
        manifest = agent.Manifest("snap", agent.WorkloadKind.AGENT, 12, True, include)
        assert agent.parse_manifest(manifest.to_json()) == manifest


def local_walk(root):
    """What a worker walks, walked here (the test owns these files)."""
    return agent.TreeWalk(os.open(root, os.O_RDONLY | os.O_DIRECTORY))


def local_measure(trees):
    """What a worker measures (the `measure` operation), measured here."""
    def measure(tree, max_entries):
        fd = os.open(trees[tree], os.O_RDONLY | os.O_DIRECTORY)
        try:
            return agent.measure_tree(fd, f"{tree}/", max_entries)
        finally:
            os.close(fd)
    return measure


def test_archive_written_then_restored_keeps_files_links_and_log_prefix(tmp_path):
    workspace, home = tmp_path / "ws", tmp_path / "home"
    (workspace / "sub").mkdir(parents=True)
    home.mkdir()
    (workspace / "sub" / "f.txt").write_text("content")
    (workspace / "sub" / "f.txt").chmod(0o4755)
    (workspace / "link").symlink_to("sub/f.txt")
    (workspace / "outside").symlink_to("/etc/passwd")  # would escape: left out, and counted
    log_path = tmp_path / "log"
    log_path.write_bytes(b"0123456789")
    manifest = agent.Manifest("snap", agent.WorkloadKind.SHELL, 4, False)
    archive = tmp_path / "a.tar"
    trees = {"workspace": workspace, "home": home}
    assert agent.write_archive(archive, manifest, log_path, lambda tree: local_walk(trees[tree]),
                               local_measure(trees)) == 1
    with tarfile.open(archive) as opened:
        assert agent.read_checked_archive(opened, agent.WorkloadKind.SHELL)[0] == manifest
        assert opened.extractfile(agent.ARCHIVE_LOG).read() == b"0123"
        assert opened.getmember("workspace/sub/f.txt").mode == 0o755  # no setuid going out
        with pytest.raises(agent.ArchiveError, match="for the shell workload"):
            agent.read_checked_archive(opened, agent.WorkloadKind.AGENT)
    target = tmp_path / "restored"
    target.mkdir()
    (target / "old.txt").write_text("replaced by the restore")
    with open(archive, "rb") as archive_file:
        agent.restore_tree(archive_file, target, "workspace")
    assert sorted(p.name for p in target.iterdir()) == ["link", "sub"]
    assert (target / "link").read_text() == "content"


def test_a_home_only_archive_leaves_log_and_workspace_out(tmp_path):
    home = tmp_path / "home"
    (home / ".config").mkdir(parents=True)
    (home / ".config" / "x").write_text("x")
    manifest = agent.Manifest("snap", agent.WorkloadKind.SHELL, 10, False, ("home",))
    archive = tmp_path / "a.tar"
    agent.write_archive(archive, manifest, tmp_path / "no-log", lambda tree: local_walk(home),
                        local_measure({"home": home}))
    with tarfile.open(archive) as opened:
        assert opened.getnames() == [agent.ARCHIVE_MANIFEST, "home", "home/.config", "home/.config/x"]


def test_a_checkpoint_is_exactly_what_was_measured_and_never_more(tmp_path):
    """The measure is the archive's size to the byte (long names, a sparse file and all); a tree that outgrows it
    while it is written fails the checkpoint at the measure instead of filling the disk."""
    home = tmp_path / "home"
    deep = home / ("n" * 120) / ("m" * 120)
    deep.mkdir(parents=True)
    (deep / "data").write_bytes(os.urandom(50_000))
    with open(home / "sparse", "wb") as sparse:
        sparse.seek(1 << 30)
        sparse.write(b"end")
    (home / "link").symlink_to("sparse")
    manifest = agent.Manifest("snap", agent.WorkloadKind.SHELL, 0, False, ("home",))
    measured = []

    def measure(tree, max_entries):
        measured.append(local_measure({"home": home})(tree, max_entries))
        return measured[-1]
    archive = tmp_path / "a.tar"
    agent.write_archive(archive, manifest, tmp_path / "no-log", lambda tree: local_walk(home), measure)
    fixed = [tarfile.TarInfo(agent.ARCHIVE_MANIFEST), tarfile.TarInfo("home")]
    fixed[0].size, fixed[1].type = len(manifest.to_json()), tarfile.DIRTYPE
    need = sum(agent.tar_member_bytes(info) for info in fixed) + measured[0][1] + 2 * tarfile.BLOCKSIZE
    assert archive.stat().st_size == need + -need % tarfile.RECORDSIZE < 1 << 20
    assert measured[0][0] == 5  # the two directories, data, sparse and link
    short = lambda tree, max_entries: (measured[0][0], measured[0][1] - 2 * tarfile.RECORDSIZE)  # noqa: E731 - lies
    with pytest.raises(agent.CommandError, match="outgrew"):
        agent.write_archive(tmp_path / "b.tar", manifest, tmp_path / "no-log", lambda tree: local_walk(home), short)
    assert (tmp_path / "b.tar").stat().st_size <= need - tarfile.RECORDSIZE


def test_a_truncated_archive_is_an_archive_error(tmp_path):
    bad = tmp_path / "bad.tar"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        info = tarfile.TarInfo(agent.ARCHIVE_LOG)
        info.size = 5000
        archive.addfile(info, io.BytesIO(b"x" * 5000))
    bad.write_bytes(buffer.getvalue()[:1024])
    config = agent.AgentConfig(session_dir=tmp_path / "s", workload=agent.WorkloadKind.SHELL)
    with pytest.raises(agent.ArchiveError):
        agent.prepare_restore(config, None, bad)  # refused before any worker would be asked
