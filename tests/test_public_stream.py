"""The public JSON Lines codec and the host result against golden fixtures, plus a fuzzer.

Fixtures: the shared public v1 conformance set and the project's own (testdata/controlled-session).
Every valid line must decode and re-encode byte for byte; every invalid line must be rejected
with its public code; decode_message must never fail any other way.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reploy
import reploy_session_client as wire
from conftest import require_shared_fixture, shared_fixture, skipped_without_shared_fixtures
from reploy_session_client import Direction, ProtocolError, decode_message

ROOT = Path(__file__).resolve().parent.parent
OWN = ROOT / "testdata" / "controlled-session"

#: The fixture files of each kind; a shared one is None where this checkout has none, and its
#: cases then skip (conftest.shared_fixture).
VALID_FIXTURES = {
    Direction.EVENT: [shared_fixture("client-v1-events.jsonl"), OWN / "events.jsonl"],
    Direction.REQUEST: [shared_fixture("client-v1-requests.jsonl"), OWN / "requests.jsonl"],
}
RUN_RESULT_FIXTURES = [shared_fixture("run-results-v1.jsonl"), OWN / "run-results.jsonl"]

#: The shared invalid requests carry no codes; these are the codes the contract implies.
SHARED_INVALID_CODES = {
    '"type":"input"}': "unknown_type",
    '"extra":true}': "invalid_request",
    "client-v2": "unsupported_schema",
    '"columns":0': "invalid_request",
    '"type":"complete","type"': "invalid_request",
}


def fixture_lines(path: Path) -> list[bytes]:
    with path.open("rb") as f:
        lines = f.readlines()
    assert lines and all(line.endswith(b"\n") for line in lines), path
    return lines


def valid_cases() -> list[Any]:
    cases = [
        pytest.param(line, direction, id=f"{path.parent.name}/{path.name}:{number}")
        for direction, paths in VALID_FIXTURES.items()
        for path in paths if path is not None
        for number, line in enumerate(fixture_lines(path), 1)
    ]
    if None in VALID_FIXTURES[Direction.EVENT] + VALID_FIXTURES[Direction.REQUEST]:
        cases.append(skipped_without_shared_fixtures(b"", Direction.EVENT))
    return cases


ALL_VALID = [(p.values[0], p.values[1]) for p in valid_cases() if not p.marks]


def test_fixtures_cover_every_message_type() -> None:
    seen = {(json.loads(line)["type"], direction) for line, direction in ALL_VALID}
    assert seen == {(cls.TYPE, cls.DIRECTION) for cls in wire.MESSAGE_TYPES.values()}


def test_own_events_cover_every_cause_and_process_status_kind() -> None:
    own = [json.loads(line) for line in fixture_lines(OWN / "events.jsonl")]
    causes = {e["cause"] for e in own if e["type"] == "terminating"}
    assert causes == {cause.value for cause in wire.Cause}
    kinds = {e["status"]["kind"] for e in own if e["type"] == "workload-exit"}
    assert kinds == set(wire.STATUS_FAMILIES["process"]) - {"unknown"}  # never announced
    startup = [e["result"] for e in own
               if e["type"] == "terminated" and e["result"]["cause"] == "startup-failure"]
    assert startup and startup[0]["workload_status"]["kind"] == "unavailable"
    assert startup[0]["controller_finalization_status"]["kind"] == "startup-failed"


@pytest.mark.parametrize("line, direction", valid_cases())
def test_valid_line_round_trips_byte_for_byte(line: bytes, direction: Direction) -> None:
    message = decode_message(line, direction)
    assert message.DIRECTION is direction
    assert message.encode() == line


@pytest.mark.parametrize("line, direction", valid_cases())
def test_valid_line_is_refused_in_the_other_direction(line: bytes, direction: Direction) -> None:
    other = Direction.REQUEST if direction is Direction.EVENT else Direction.EVENT
    with pytest.raises(ProtocolError) as info:
        decode_message(line, other)
    assert info.value.code == "unknown_type"


def own_invalid_cases() -> list[Any]:
    cases = []
    for row in map(json.loads, fixture_lines(OWN / "invalid-requests.jsonl")):
        if "line_base64" in row:
            line = base64.b64decode(row["line_base64"])
        else:
            line = row["line"].encode()
        if "pad_to_bytes" in row:
            line = pad_line(line, row["pad_to_bytes"])
        cases.append(pytest.param(line, row["expected_code"], id=row["rule"]))
    return cases


def pad_line(line: bytes, total_bytes: int) -> bytes:
    """Insert JSON whitespace before the final `}` until the line is total_bytes long."""
    assert line.endswith(b"}\n")
    return line[:-2] + b" " * (total_bytes - len(line)) + b"}\n"


@pytest.mark.parametrize("line, code", own_invalid_cases())
def test_own_invalid_request_is_rejected_with_its_code(line: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_message(line, Direction.REQUEST)
    assert info.value.code == code


def test_shared_invalid_requests_are_rejected_with_their_codes() -> None:
    lines = fixture_lines(require_shared_fixture("client-v1-invalid-requests.jsonl"))
    assert len(lines) == len(SHARED_INVALID_CODES)
    for line in lines:
        [code] = [code for marker, code in SHARED_INVALID_CODES.items() if marker in line.decode()]
        with pytest.raises(ProtocolError) as info:
            decode_message(line, Direction.REQUEST)
        assert info.value.code == code, line


def test_a_line_of_exactly_one_mebibyte_is_accepted() -> None:
    line = pad_line(wire.Terminate().encode(), wire.MAX_LINE_BYTES)
    assert len(line) == wire.MAX_LINE_BYTES
    assert decode_message(line, Direction.REQUEST) == wire.Terminate()


def test_an_event_that_would_exceed_one_mebibyte_cannot_be_encoded() -> None:
    overhead = len(wire.BrokerReady(terminal_socket="").encode())
    fits = wire.BrokerReady(terminal_socket="x" * (wire.MAX_LINE_BYTES - overhead))
    assert len(fits.encode()) == wire.MAX_LINE_BYTES
    with pytest.raises(ProtocolError) as info:
        wire.BrokerReady(terminal_socket="x" * (wire.MAX_LINE_BYTES - overhead + 1)).encode()
    assert info.value.code == "line_too_long"


S = '{"schema":"reploy-controlled-session-client-v1",'
GOOD_RESULT = {"cause": "workload-exit", "workload_status": {"kind": "exited", "code": 0},
               "workload_output_finalization_status": {"kind": "drained"},
               "runtime_observation_status": {"kind": "maintained"},
               "controller_finalization_status": {"kind": "completed"},
               "cleanup_status": {"kind": "succeeded"}, "recovery_action": "none"}


@pytest.mark.parametrize("line", [
    S + '"type":"workload-exit","status":{"kind":[]}}',
    S + '"type":"workload-exit","status":{"kind":"exited","code":1.5}}',
    S + '"type":"workload-exit","status":{"kind":"unknown"}}',
    S + '"type":"workload-exit","status":{"kind":"unavailable","code":1}}',
    S + '"type":"workload-exit","status":{"kind":"not-observed","reason":"x"}}',
    S + '"type":"diagnostic","code":"x","message":"two\\nlines"}',
    S + '"type":"diagnostic","code":"x","message":" padded"}',
    S + '"type":"diagnostic","code":"x","message":"\\u200bzero width"}',
    S + '"type":"diagnostic","code":"x","message":""}',
    S + '"type":"diagnostic","code":"x","message":"' + "é" * 257 + '"}',
    S + '"type":"diagnostic","code":"Not-Snake","message":"m"}',
    S + '"type":"workload-outputs-finalized","status":"failed","reason":"tab\\tinside"}',
    S + '"type":"terminating","cause":["workload-exit"]}',
    S + '"type":"terminating","cause":"power-failure"}',
    S + '"type":"workload-outputs-finalized","status":"failed"}',
    S + '"type":"workload-outputs-finalized","status":"drained","reason":"x"}',
    S + '"type":"workload-outputs-finalized","status":"drained","reason":null}',
    S + '"type":"diagnostic","code":"x","message":"\\ud800"}',
    S + '"type":"diagnostic","code":7,"message":"m"}',
    S + '"type":"opened","operations":["input","input"],"endpoints":[],"columns":80,"rows":24,'
        '"output_finalization_timeout_milliseconds":30000}',
    S + '"type":"opened","operations":[["input"]],"endpoints":[],"columns":80,"rows":24,'
        '"output_finalization_timeout_milliseconds":30000}',
    S + '"type":"opened","operations":[],"endpoints":[{"id":"a","scheme":"h","host":"w"}],'
        '"columns":80,"rows":24,"output_finalization_timeout_milliseconds":30000}',
    S + '"type":"opened","operations":[],"endpoints":[{"id":"a","scheme":"h","host":"w","port":0}],'
        '"columns":80,"rows":24,"output_finalization_timeout_milliseconds":30000}',
    S + '"type":"opened","operations":[],"endpoints":{},"columns":80,"rows":24,'
        '"output_finalization_timeout_milliseconds":0}',
    S + '"type":"terminated","result":{"cause":"workload-exit","workload_status":null,'
        '"workload_output_finalization_status":{"kind":{}},"runtime_observation_status":null,'
        '"controller_finalization_status":null,"cleanup_status":{"kind":"succeeded"},'
        '"recovery_action":"none"}}',
    S + '"type":"terminated","result":{"cause":"workload-exit","workload_status":null,'
        '"workload_output_finalization_status":null,"runtime_observation_status":null,'
        '"controller_finalization_status":null,"cleanup_status":null,"recovery_action":"none"}}',
    S + '"type":"terminated","result":{"cause":"workload-exit","workload_status":null,'
        '"workload_output_finalization_status":null,"runtime_observation_status":null,'
        '"controller_finalization_status":null,"cleanup_status":{"kind":"succeeded"},'
        '"recovery_action":{}}}',
    *(S + '"type":"terminated","result":' + json.dumps(result, separators=(",", ":")) + "}"
      for result in (
          dict(GOOD_RESULT, cause="controller-lost"),  # finalization must be lost
          dict(GOOD_RESULT, cause="startup-failure"),  # finalization must be startup-failed
          dict(GOOD_RESULT, cause="runtime-observation-lost"),
          dict(GOOD_RESULT, workload_status={"kind": "unknown"}),  # cause workload-exit
          dict(GOOD_RESULT, cleanup_status={"kind": "failed"}, recovery_action="retry-cleanup"),
          dict(GOOD_RESULT, cleanup_status={"kind": "failed", "message": "m"}),
          dict(GOOD_RESULT, cleanup_status={"kind": "succeeded"},
               recovery_action="reconcile-next-operation"),
          dict(GOOD_RESULT, cleanup_status={"kind": "failed", "reason": "m"},
               recovery_action="retry-cleanup"),
          dict(GOOD_RESULT, runtime_observation_status={"kind": "maintained", "reason": "m"}),
      )),
    S + '"type":"broker-ready","terminal_socket":' + "[" * 100_000 + "]" * 100_000 + "}",
], ids=lambda line: line[len(S):len(S) + 60])
def test_malformed_event_is_a_protocol_error(line: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_message(line.encode() + b"\n", Direction.EVENT)
    assert info.value.code == "invalid_request"


# --------------------------------------------------------------------------------------------
# The host result
# --------------------------------------------------------------------------------------------


def run_result_cases() -> list[Any]:
    cases = [
        pytest.param(line, id=f"{path.parent.name}/{path.name}:{number}")
        for path in RUN_RESULT_FIXTURES if path is not None
        for number, line in enumerate(fixture_lines(path), 1)
    ]
    if None in RUN_RESULT_FIXTURES:
        cases.append(skipped_without_shared_fixtures(b""))
    return cases


def ordered_pairs(line: bytes) -> list[tuple[str, Any]]:
    return json.loads(line, object_pairs_hook=lambda pairs: pairs)


def optional_status(family: str, value: Any) -> Optional[wire.Status]:
    return None if value is None else wire.Status.parse(family, value)


@pytest.mark.parametrize("line", run_result_cases())
def test_run_result_rebuilds_byte_for_byte(line: bytes) -> None:
    assert [key for key, _ in ordered_pairs(line)] == list(reploy.RESULT_KEYS)
    obj = wire.parse_strict_object(line[:-1], max_bytes=wire.MAX_LINE_BYTES)
    assert obj["schema"] == wire.RUN_RESULT_SCHEMA
    session = obj["session_result"]
    action = obj["delivery_tail_recovery_action"]
    result = reploy.RunResult(
        error=obj["error"],
        session_result=None if session is None else wire.SessionResult.parse(session),
        result_delivered=obj["result_delivered"],
        result_acknowledged=obj["result_acknowledged"],
        controller_status=optional_status("process", obj["controller_status"]),
        controller_output=optional_status("controller_output", obj["controller_output"]),
        delivery_tail_cleanup_status=optional_status(
            "cleanup", obj["delivery_tail_cleanup_status"]),
        delivery_tail_recovery_action=None if action is None else wire.RecoveryAction(action),
    )
    # The fixture's `ok` was set by hand from the seed's rule; RunResult computes its own.
    assert result.ok is obj["ok"]
    assert result.encode() == line


def test_run_result_fixtures_cover_every_shape() -> None:
    results = [json.loads(line) for p in RUN_RESULT_FIXTURES if p is not None
               for line in fixture_lines(p)]
    outputs = {r["controller_output"]["kind"] for r in results if r["controller_output"]}
    assert outputs == set(wire.STATUS_FAMILIES["controller_output"])
    causes = {r["session_result"]["cause"] for r in results if r["session_result"]}
    assert {"workload-exit", "controller-terminate", "host-cancel", "startup-failure"} <= causes
    assert any(all(r[key] is None for key in reploy.RESULT_KEYS[3:]) for r in results)
    assert any(r["result_delivered"] is False for r in results)
    assert any(r["result_delivered"] is True and r["result_acknowledged"] is False for r in results)
    actions = {r["delivery_tail_recovery_action"] for r in results} | {
        r["session_result"]["recovery_action"] for r in results if r["session_result"]}
    assert actions == {action.value for action in wire.RecoveryAction} | {None}
    assert {True, False} == {r["ok"] for r in results}


# --------------------------------------------------------------------------------------------
# Property: decode_message only ever raises ProtocolError, and what it accepts is canonical
# --------------------------------------------------------------------------------------------

#: Byte strings that tend to break parsers when spliced into a valid line.
NASTY_TOKENS = [
    b'"', b"{", b"}", b"[", b"]", b",", b":", b"\\", b"\n", b" ", b"\r", b"\x00", b"\xff",
    b"\xc3", b"\xed\xa0\x80", b"\\ud800", b"\\u0000", b"NaN", b"-Infinity", b"1e999", b"-0",
    b"null", b"true", b"1.0", b"9" * 4400, b'"kind":[]', b'"reason":null', b'"x":1',
    b'"type":"ready"', b'"schema":"reploy-controlled-session-client-v1"',
]

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=8) | st.sampled_from(["exited", "drained", "failed", "workload-exit"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["kind", "code", "reason", "id", "port", "x"]), inner, max_size=3),
    max_leaves=8,
)


def check_decode(line: bytes, direction: Direction) -> None:
    try:
        message = decode_message(line, direction)
    except ProtocolError:
        return
    canonical = message.encode()
    again = decode_message(canonical, direction)
    assert again == message
    assert again.encode() == canonical
    # Accepting a non-canonical spelling is fine (key order, spaces); accepting different
    # content is not: the canonical form must carry exactly the same JSON value.
    assert json.loads(line) == json.loads(canonical)


@st.composite
def mutated_lines(draw: st.DrawFn) -> tuple[bytes, Direction]:
    line, direction = draw(st.sampled_from(ALL_VALID))
    data = bytearray(line)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["insert", "delete", "flip", "duplicate"]))
        if action == "insert":
            data[at:at] = draw(st.sampled_from(NASTY_TOKENS))
        elif action == "delete":
            del data[at:at + draw(st.integers(1, 8))]
        elif action == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        else:
            data[at:at] = data[at:at + draw(st.integers(1, 40))]
    return bytes(data), direction


@st.composite
def retyped_lines(draw: st.DrawFn) -> tuple[bytes, Direction]:
    """A valid message with one field, at any depth, replaced by an arbitrary JSON value."""
    line, direction = draw(st.sampled_from(ALL_VALID))
    obj = json.loads(line)
    target = obj
    while True:
        key = draw(st.sampled_from(sorted(target)))
        if isinstance(target[key], dict) and target[key] and draw(st.booleans()):
            target = target[key]
            continue
        target[key] = draw(JSON_VALUES)
        break
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n", direction


FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=200), st.sampled_from(list(Direction)))
def test_random_bytes_never_crash_decode(data: bytes, direction: Direction) -> None:
    check_decode(data, direction)
    check_decode(data + b"\n", direction)


@FUZZ
@given(mutated_lines())
def test_mutated_lines_never_crash_decode(case: tuple[bytes, Direction]) -> None:
    check_decode(*case)


@FUZZ
@given(retyped_lines())
def test_retyped_fields_never_crash_decode(case: tuple[bytes, Direction]) -> None:
    check_decode(*case)
