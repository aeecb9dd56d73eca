"""The test-side strict checker (tests/contract_rules.py) against the golden fixtures and
against one violation per rule, so a checker that accepts everything cannot pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

import contract_rules as rules
from contract_rules import ContractViolation

from conftest import require_shared_fixture, shared_fixture, skipped_without_shared_fixtures

ROOT = Path(__file__).resolve().parent.parent
OWN = ROOT / "testdata" / "controlled-session"

CHECKERS: dict[str, Callable[[bytes], dict[str, Any]]] = {
    "events": rules.check_event_line,
    "requests": rules.check_request_line,
    "results": rules.check_result_line,
}
#: Each fixture file and what its lines are; a shared file is None where this checkout has none.
FIXTURES = [
    (shared_fixture("client-v1-events.jsonl"), "events"), (OWN / "events.jsonl", "events"),
    (shared_fixture("client-v1-requests.jsonl"), "requests"), (OWN / "requests.jsonl", "requests"),
    (shared_fixture("run-results-v1.jsonl"), "results"), (OWN / "run-results.jsonl", "results"),
]


def fixture_cases() -> list[Any]:
    cases = [pytest.param(line, kind, id=f"{path.parent.name}/{path.name}:{number}")
             for path, kind in FIXTURES if path is not None
             for number, line in enumerate(path.read_bytes().splitlines(keepends=True), 1)]
    if any(path is None for path, _ in FIXTURES):
        cases.append(skipped_without_shared_fixtures(b"", "events"))
    return cases


@pytest.mark.parametrize("line, kind", fixture_cases())
def test_every_valid_fixture_line_is_accepted(line: bytes, kind: str) -> None:
    CHECKERS[kind](line)


def test_the_shared_invalid_requests_are_refused() -> None:
    for line in require_shared_fixture("client-v1-invalid-requests.jsonl").read_bytes(
            ).splitlines(True):
        with pytest.raises(ContractViolation):
            rules.check_request_line(line)


S = "reploy-controlled-session-client-v1"
GOOD_SESSION = {
    "cause": "workload-exit", "workload_status": {"kind": "exited", "code": 0},
    "workload_output_finalization_status": {"kind": "drained"},
    "runtime_observation_status": {"kind": "maintained"},
    "controller_finalization_status": {"kind": "completed"},
    "cleanup_status": {"kind": "succeeded"}, "recovery_action": "none"}
GOOD_RESULT = {
    "schema": "reploy-controlled-session-run-result-v1", "ok": True, "error": None,
    "session_result": GOOD_SESSION, "result_delivered": True, "result_acknowledged": True,
    "controller_status": {"kind": "exited", "code": 0},
    "controller_output": {"kind": "not-requested"},
    "delivery_tail_cleanup_status": {"kind": "succeeded"}, "delivery_tail_recovery_action": "none"}


def session(**changes: Any) -> dict[str, Any]:
    return {**GOOD_SESSION, **changes}


def line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


#: One violation per rule of issue 10 and the seed, each as a whole host result.
BAD_RESULTS = {
    "null inside session_result": {**GOOD_RESULT, "ok": False, "session_result": session(
        cause="startup-failure", workload_status=None,
        controller_finalization_status={"kind": "startup-failed", "reason": "r"})},
    "session_result null with delivery facts": {**GOOD_RESULT, "ok": False,
                                                "session_result": None},
    "session_result without delivery facts": {**GOOD_RESULT, "ok": False,
                                              "result_delivered": None},
    "unknown with a reason": {**GOOD_RESULT, "ok": False, "session_result": session(
        cause="host-cancel", workload_status={"kind": "unknown", "reason": "r"})},
    "exited without a code": {**GOOD_RESULT, "session_result": session(
        workload_status={"kind": "exited"})},
    "unavailable with a code": {**GOOD_RESULT, "ok": False, "session_result": session(
        cause="host-cancel", workload_status={"kind": "unavailable", "code": 1})},
    "an old process kind": {**GOOD_RESULT, "ok": False, "session_result": session(
        cause="host-cancel", workload_status={"kind": "not-started", "reason": "r"})},
    "workload-exit cause with unknown status": {**GOOD_RESULT, "ok": False,
                                                "session_result": session(
                                                    workload_status={"kind": "unknown"})},
    "drained with a reason": {**GOOD_RESULT, "session_result": session(
        workload_output_finalization_status={"kind": "drained", "reason": "r"})},
    "failed without a reason": {**GOOD_RESULT, "ok": False, "session_result": session(
        workload_output_finalization_status={"kind": "failed"})},
    "maintained with a reason": {**GOOD_RESULT, "session_result": session(
        runtime_observation_status={"kind": "maintained", "reason": "r"})},
    "succeeded cleanup with a message": {**GOOD_RESULT, "session_result": session(
        cleanup_status={"kind": "succeeded", "message": "m"})},
    "succeeded cleanup with a recovery action": {**GOOD_RESULT, "ok": False,
                                                 "session_result": session(
                                                     recovery_action="retry-cleanup")},
    "failed cleanup without a message": {**GOOD_RESULT, "ok": False, "session_result": session(
        cleanup_status={"kind": "failed"}, recovery_action="retry-cleanup")},
    "failed cleanup with recovery none": {**GOOD_RESULT, "ok": False, "session_result": session(
        cleanup_status={"kind": "failed", "message": "m"})},
    "cleanup reason instead of message": {**GOOD_RESULT, "ok": False, "session_result": session(
        cleanup_status={"kind": "failed", "reason": "m"}, recovery_action="retry-cleanup")},
    "an old recovery action": {**GOOD_RESULT, "ok": False, "session_result": session(
        cleanup_status={"kind": "failed", "message": "m"}, recovery_action="reconcile-by-label")},
    "failed delivery tail with recovery none": {
        **GOOD_RESULT, "ok": False,
        "delivery_tail_cleanup_status": {"kind": "failed", "message": "m"}},
    "delivery-tail action without its status": {**GOOD_RESULT, "ok": False,
                                                "delivery_tail_cleanup_status": None},
    "controller-lost without lost": {**GOOD_RESULT, "ok": False, "session_result": session(
        cause="controller-lost",
        controller_finalization_status={"kind": "not-completed", "reason": "r"})},
    "startup-failure without startup-failed": {**GOOD_RESULT, "ok": False,
                                               "session_result": session(
                                                   cause="startup-failure")},
    "observation lost with drained output": {**GOOD_RESULT, "ok": False,
                                             "session_result": session(
                                                 cause="runtime-observation-lost",
                                                 runtime_observation_status={"kind": "lost",
                                                                             "reason": "r"})},
    "a reason with a newline": {**GOOD_RESULT, "ok": False, "session_result": session(
        workload_output_finalization_status={"kind": "failed", "reason": "a\nb"})},
    "a reason with a format character": {**GOOD_RESULT, "ok": False, "session_result": session(
        workload_output_finalization_status={"kind": "failed", "reason": "a\u200bb"})},
    "a reason with surrounding space": {**GOOD_RESULT, "ok": False, "session_result": session(
        workload_output_finalization_status={"kind": "failed", "reason": " r"})},
    "a reason over 512 bytes": {**GOOD_RESULT, "ok": False, "session_result": session(
        workload_output_finalization_status={"kind": "failed", "reason": "é" * 257})},
    "an empty reason": {**GOOD_RESULT, "ok": False, "controller_output": {
        "kind": "failed", "reason": ""}},
    "ok against the seed's rule": {**GOOD_RESULT, "session_result": session(
        workload_status={"kind": "exited", "code": 3})},
    "not ok against the seed's rule": {**GOOD_RESULT, "ok": False},
    "keys out of order": dict(reversed(list(GOOD_RESULT.items()))),
}


def test_the_good_result_is_accepted() -> None:
    rules.check_result_line(line(GOOD_RESULT))


@pytest.mark.parametrize("bad", BAD_RESULTS.values(), ids=BAD_RESULTS.keys())
def test_each_rule_refuses_its_violation(bad: dict[str, Any]) -> None:
    with pytest.raises(ContractViolation):
        rules.check_result_line(line(bad))


def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"schema": S, "type": kind, **fields}


OPENED = event("opened", operations=["input", "resize", "terminate", "complete"], endpoints=[],
               columns=80, rows=24, output_finalization_timeout_milliseconds=30000)
START = [event("broker-ready", terminal_socket="/h/t.sock"), OPENED, event("ready")]
EXIT_0 = event("workload-exit", status={"kind": "exited", "code": 0})
FINALIZED = event("workload-outputs-finalized", status="drained")
TERMINATED = event("terminated", result=GOOD_SESSION)


def test_the_seed_sequence_is_accepted() -> None:
    rules.check_event_sequence([*START, EXIT_0, event("terminating", cause="workload-exit"),
                                FINALIZED, TERMINATED])


BAD_SEQUENCES = {
    "workload-exit after outputs-finalized": [
        *START, event("terminating", cause="controller-terminate"), FINALIZED, EXIT_0,
        event("terminated", result=session(cause="controller-terminate"))],
    "a diagnostic between finalized and terminated": [
        *START, EXIT_0, event("terminating", cause="workload-exit"), FINALIZED,
        event("diagnostic", code="x", message="m"), TERMINATED],
    "workload-exit after terminating as the cause": [
        *START, event("terminating", cause="workload-exit"), EXIT_0, FINALIZED, TERMINATED],
    "terminated disagreeing with workload-exit": [
        *START, EXIT_0, event("terminating", cause="workload-exit"), FINALIZED,
        event("terminated", result=session(workload_status={"kind": "exited", "code": 1}))],
    "terminated before finalized after ready": [
        *START, EXIT_0, event("terminating", cause="workload-exit"), TERMINATED],
    "an event after terminated": [
        *START, EXIT_0, event("terminating", cause="workload-exit"), FINALIZED, TERMINATED,
        event("diagnostic", code="x", message="m")],
    "a client-error after terminated": [
        *START, EXIT_0, event("terminating", cause="workload-exit"), FINALIZED, TERMINATED,
        event("client-error", code="host_channel_lost", message="m")],
    "a client-error after a startup failure's terminated": [
        START[0], START[1], event("terminated", result=session(
            cause="startup-failure", workload_status={"kind": "unavailable", "reason": "r"},
            controller_finalization_status={"kind": "startup-failed", "reason": "r"})),
        event("client-error", code="attach_timeout", message="m")],
    "workload-exit announcing unknown": [
        *START, event("workload-exit", status={"kind": "unknown"})],
}


@pytest.mark.parametrize("events", BAD_SEQUENCES.values(), ids=BAD_SEQUENCES.keys())
def test_each_order_rule_refuses_its_violation(events: list[dict[str, Any]]) -> None:
    with pytest.raises(ContractViolation):
        rules.check_event_sequence(events)


#: One violation per rule Reploy's own results keep beyond the public shapes (issue 23).
BAD_REPLOY_RESULTS = {
    "not ok without an error": {**GOOD_RESULT, "ok": False, "result_acknowledged": False},
    "ok with an error": {**GOOD_RESULT, "error": "x", "ok": False} | {"ok": True},
    "an error of two lines": {**GOOD_RESULT, "ok": False, "result_acknowledged": False,
                              "error": "the controller did not\nacknowledge the result"},
    "an error with an escape sequence": {**GOOD_RESULT, "ok": False, "error": "\x1b[2Jboom",
                                         "result_acknowledged": False},
    "an error past 512 bytes": {**GOOD_RESULT, "ok": False, "error": "x" * 513,
                                "result_acknowledged": False},
}


@pytest.mark.parametrize("obj", BAD_REPLOY_RESULTS.values(), ids=BAD_REPLOY_RESULTS.keys())
def test_each_reploy_result_rule_refuses_its_violation(obj: dict[str, Any]) -> None:
    with pytest.raises(ContractViolation):
        rules.check_reploy_result_line(line(obj))


def test_reploy_results_accept_a_summary_and_an_ok_result() -> None:
    rules.check_reploy_result_line(line(GOOD_RESULT))
    rules.check_reploy_result_line(line({**GOOD_RESULT, "ok": False, "result_acknowledged": False,
                                         "error": "the controller did not acknowledge the result"}))
