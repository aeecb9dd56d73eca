"""A strict consumer of the public controlled-session contract, written for the tests.

It is the test side's own reading of seed 000 and of the rules strict outside consumers
apply (issue 10), deliberately independent of reploy_session_client.py: nothing here imports
the production codec, so a shared misreading cannot make both sides agree on a wrong answer.

  check_event_line(line)      one `reploy-controlled-session-client-v1` event -> dict
  check_request_line(line)    one request -> dict
  check_result_line(line)     the host's one `reploy-controlled-session-run-result-v1` -> dict
  check_reploy_result_line    the same, as Reploy prints it: a safe-text error whenever not ok
  check_event_sequence(evts)  the lifecycle order a controller following the seed relies on

Each raises ContractViolation naming the rule. Stdlib only.
"""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Any, Optional

CLIENT_SCHEMA = "reploy-controlled-session-client-v1"
RESULT_SCHEMA = "reploy-controlled-session-run-result-v1"
MAX_LINE_BYTES = 1 << 20
MAX_SAFE_TEXT_BYTES = 512

CAUSES = {"controller-terminate", "workload-exit", "host-cancel", "controller-lost",
          "runtime-observation-lost", "cleanup-containment-lost", "startup-failure"}
PROCESS_KINDS = {"unknown", "exited", "terminated", "unavailable"}
OUTPUT_KINDS = {"drained", "failed"}
OBSERVATION_KINDS = {"maintained", "lost"}
FINALIZATION_KINDS = {"completed", "lost", "finalization-timeout", "not-completed",
                      "startup-failed"}
CLEANUP_KINDS = {"succeeded", "failed"}
RECOVERY_ACTIONS = {"none", "retry-cleanup", "reconcile-next-operation"}
CLEANUP_FAILURE_RECOVERY = {"retry-cleanup", "reconcile-next-operation"}
CONTROLLER_OUTPUT_KINDS = {"not-requested", "directory-retained", "file-published",
                           "file-discarded", "failed"}
CONTROLLER_OUTPUT_SUCCESS = {"not-requested", "directory-retained", "file-published"}
OPERATIONS = {"input", "resize", "terminate", "complete"}
RESULT_KEYS = ("schema", "ok", "error", "session_result", "result_delivered",
               "result_acknowledged", "controller_status", "controller_output",
               "delivery_tail_cleanup_status", "delivery_tail_recovery_action")
SESSION_RESULT_KEYS = ("cause", "workload_status", "workload_output_finalization_status",
                       "runtime_observation_status", "controller_finalization_status",
                       "cleanup_status", "recovery_action")

_CODE = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*\Z")
_ENDPOINT_ID = re.compile(r"[a-z0-9]+(?:(?:__|[._]|-+)[a-z0-9]+)*\Z")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*\Z")


class ContractViolation(ValueError):
    """A line or a sequence a strict consumer rejects."""


def _require(condition: bool, rule: str) -> None:
    if not condition:
        raise ContractViolation(rule)


# -- JSON lines ---------------------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    _require(len(keys) == len(set(keys)), f"duplicate field in {keys}")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ContractViolation(f"non-standard JSON constant {name}")


def parse_line(line: bytes, limit: Optional[int] = MAX_LINE_BYTES) -> dict[str, Any]:
    """One newline-terminated UTF-8 JSON object, nothing before or after it."""
    _require(isinstance(line, bytes), "a line is bytes")
    _require(limit is None or len(line) <= limit, "line longer than 1 MiB")
    _require(line.endswith(b"\n"), "line not newline-terminated")
    body = line[:-1]
    _require(bool(body) and b"\n" not in body and body.strip() == body,
             "exactly one JSON object per line, no surrounding whitespace")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ContractViolation("line is not UTF-8") from None
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise ContractViolation(f"not JSON: {e.msg}") from None
    _require(isinstance(value, dict), "top level is an object")
    return value


def _keys(obj: Any, required: set[str], optional: frozenset[str] = frozenset(),
          where: str = "") -> dict[str, Any]:
    _require(isinstance(obj, dict), f"{where} is an object")
    missing, unknown = required - set(obj), set(obj) - required - optional
    _require(not missing, f"{where} misses {sorted(missing)}")
    _require(not unknown, f"{where} has unknown {sorted(unknown)}")
    return obj


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_safe_text(value: Any, where: str) -> None:
    """Non-empty, at most 512 UTF-8 bytes, no surrounding whitespace, no Cc or Cf character."""
    _require(isinstance(value, str) and value != "", f"{where} is non-empty text")
    _require(len(value.encode("utf-8", "surrogatepass")) <= MAX_SAFE_TEXT_BYTES,
             f"{where} is at most {MAX_SAFE_TEXT_BYTES} bytes")
    _require(value.strip() == value, f"{where} has no leading or trailing whitespace")
    _require(not any(unicodedata.category(c) in ("Cc", "Cf", "Cs") for c in value),
             f"{where} has no control or format characters")


def _optional_text(obj: dict[str, Any], name: str, where: str) -> bool:
    if name in obj:
        check_safe_text(obj[name], f"{where}.{name}")
        return True
    return False


# -- statuses ------------------------------------------------------------------------------------


def check_process_status(obj: Any, where: str, allow_unknown: bool = True) -> None:
    _keys(obj, {"kind"}, frozenset({"code", "reason"}), where)
    kind = obj["kind"]
    _require(kind in PROCESS_KINDS, f"{where}.kind {kind!r} is a process status kind")
    _optional_text(obj, "reason", where)
    if kind == "unknown":
        _require(allow_unknown, f"{where} may not be unknown")
        _require(set(obj) == {"kind"}, f"{where}: unknown carries neither code nor reason")
    elif kind == "exited":
        _require("code" in obj and _int(obj["code"]), f"{where}: exited carries an integer code")
    else:
        _require("code" not in obj, f"{where}: {kind} carries no code")


def _reasoned(obj: Any, kinds: set[str], without_reason: set[str], where: str,
              text_field: str = "reason") -> str:
    """A `{kind[, reason]}` status: kinds in without_reason have none, the others need one."""
    _keys(obj, {"kind"}, frozenset({text_field}), where)
    kind = obj["kind"]
    _require(kind in kinds, f"{where}.kind {kind!r} is one of {sorted(kinds)}")
    has_text = _optional_text(obj, text_field, where)
    if kind in without_reason:
        _require(not has_text, f"{where}: {kind} has no {text_field}")
    else:
        _require(has_text, f"{where}: {kind} requires a {text_field}")
    return kind


def _cleanup(status: Any, action: Any, where: str) -> None:
    kind = _reasoned(status, CLEANUP_KINDS, {"succeeded"}, where, "message")
    _require(action in RECOVERY_ACTIONS, f"{where}: recovery action {action!r} is known")
    if kind == "succeeded":
        _require(action == "none", f"{where}: succeeded cleanup has recovery action none")
    else:
        _require(action in CLEANUP_FAILURE_RECOVERY,
                 f"{where}: failed cleanup has retry-cleanup or reconcile-next-operation")


def check_session_result(obj: Any, where: str = "session_result") -> None:
    _keys(obj, set(SESSION_RESULT_KEYS), where=where)
    for name in SESSION_RESULT_KEYS:
        _require(obj[name] is not None, f"{where}.{name} is a value, never null")
    cause = obj["cause"]
    _require(cause in CAUSES, f"{where}.cause {cause!r} is a termination cause")
    check_process_status(obj["workload_status"], f"{where}.workload_status")
    output = _reasoned(obj["workload_output_finalization_status"], OUTPUT_KINDS, {"drained"},
                       f"{where}.workload_output_finalization_status")
    observation = _reasoned(obj["runtime_observation_status"], OBSERVATION_KINDS,
                            {"maintained"}, f"{where}.runtime_observation_status")
    finalization = _reasoned(obj["controller_finalization_status"], FINALIZATION_KINDS,
                             {"completed"}, f"{where}.controller_finalization_status")
    _cleanup(obj["cleanup_status"], obj["recovery_action"], where)
    if cause == "workload-exit":
        _require(obj["workload_status"]["kind"] != "unknown",
                 f"{where}: workload-exit needs a known workload status")
    if cause == "controller-lost":
        _require(finalization == "lost", f"{where}: controller-lost needs finalization lost")
    if cause == "startup-failure":
        _require(finalization == "startup-failed",
                 f"{where}: startup-failure needs finalization startup-failed")
    if cause == "runtime-observation-lost":
        _require(observation == "lost" and output == "failed",
                 f"{where}: runtime-observation-lost needs observation lost, output failed")


def session_succeeded(obj: dict[str, Any]) -> bool:
    status = obj["workload_status"]
    cause_ok = obj["cause"] == "controller-terminate" or (
        obj["cause"] == "workload-exit" and status["kind"] == "exited" and status["code"] == 0)
    return (cause_ok
            and obj["workload_output_finalization_status"]["kind"] == "drained"
            and obj["runtime_observation_status"]["kind"] == "maintained"
            and obj["controller_finalization_status"]["kind"] == "completed"
            and obj["cleanup_status"]["kind"] == "succeeded"
            and obj["recovery_action"] == "none")


# -- the host result ------------------------------------------------------------------------------


def check_result(obj: Any) -> dict[str, Any]:
    _keys(obj, set(RESULT_KEYS), where="result")
    _require(tuple(obj) == RESULT_KEYS, "result keys in contract order")
    _require(obj["schema"] == RESULT_SCHEMA, "result schema")
    _require(isinstance(obj["ok"], bool), "ok is a boolean")
    _require(obj["error"] is None or (isinstance(obj["error"], str) and obj["error"] != ""),
             "error is null or non-empty text")
    session = obj["session_result"]
    delivered, acknowledged = obj["result_delivered"], obj["result_acknowledged"]
    if session is None:
        _require(delivered is None and acknowledged is None,
                 "no session_result: result_delivered and result_acknowledged are null")
    else:
        check_session_result(session)
        _require(isinstance(delivered, bool) and isinstance(acknowledged, bool),
                 "with a session_result: result_delivered and result_acknowledged are booleans")
        _require(delivered or not acknowledged, "an undelivered result is not acknowledged")
    if obj["controller_status"] is not None:
        check_process_status(obj["controller_status"], "controller_status")
    output = obj["controller_output"]
    if output is not None:
        _reasoned(output, CONTROLLER_OUTPUT_KINDS, CONTROLLER_OUTPUT_SUCCESS, "controller_output")
    tail, action = obj["delivery_tail_cleanup_status"], obj["delivery_tail_recovery_action"]
    _require((tail is None) == (action is None),
             "delivery-tail cleanup status and recovery action are both null or both set")
    if tail is not None:
        _cleanup(tail, action, "delivery_tail")
    expected_ok = (obj["error"] is None and session is not None and session_succeeded(session)
                   and delivered is True and acknowledged is True
                   and output is not None and output["kind"] in CONTROLLER_OUTPUT_SUCCESS
                   and tail is not None and tail["kind"] == "succeeded" and action == "none")
    _require(obj["ok"] is expected_ok, f"ok is {expected_ok} by the seed's rule")
    return obj


def check_result_line(line: bytes) -> dict[str, Any]:
    return check_result(parse_line(line, limit=None))


def check_reploy_result_line(line: bytes) -> dict[str, Any]:
    """A result as Reploy prints it: check_result_line, and what upstream's own harness asks
    beyond the public shapes (whose fixtures may carry ok:false with a null error): `error`
    is null exactly when ok is true, and otherwise one line of safe text (issue 23)."""
    obj = check_result_line(line)
    if obj["ok"]:
        _require(obj["error"] is None, "an ok result has a null error")
    else:
        check_safe_text(obj["error"], "error of a result that is not ok")
    return obj


# -- events and requests --------------------------------------------------------------------------


def _endpoint(obj: Any, where: str) -> None:
    _keys(obj, {"id", "scheme", "host", "port"}, where=where)
    _require(isinstance(obj["id"], str) and len(obj["id"].encode()) <= 128
             and _ENDPOINT_ID.match(obj["id"]) is not None, f"{where}.id")
    _require(isinstance(obj["scheme"], str) and _SCHEME.match(obj["scheme"]) is not None,
             f"{where}.scheme")
    _require(obj["host"] == "workload", f"{where}.host is workload")
    _require(_int(obj["port"]) and 1 <= obj["port"] <= 65535, f"{where}.port")


def _dimension(value: Any, where: str) -> None:
    _require(_int(value) and 1 <= value <= 65535, f"{where} is an integer 1..65535")


def check_event(obj: dict[str, Any]) -> dict[str, Any]:
    _require(obj.get("schema") == CLIENT_SCHEMA, "event schema")
    kind = obj.get("type")
    base = {"schema", "type"}
    if kind == "broker-ready":
        _keys(obj, base | {"terminal_socket"}, where=kind)
        _require(isinstance(obj["terminal_socket"], str) and obj["terminal_socket"] != "",
                 "terminal_socket is a path")
    elif kind == "opened":
        _keys(obj, base | {"operations", "endpoints", "columns", "rows",
                           "output_finalization_timeout_milliseconds"}, where=kind)
        operations = obj["operations"]
        _require(isinstance(operations, list) and set(operations) <= OPERATIONS
                 and len(set(operations)) == len(operations), "opened.operations")
        _require(isinstance(obj["endpoints"], list), "opened.endpoints is a list")
        for index, endpoint in enumerate(obj["endpoints"]):
            _endpoint(endpoint, f"opened.endpoints[{index}]")
        ids = [e["id"] for e in obj["endpoints"]]
        _require(len(ids) == len(set(ids)), "opened endpoint ids are unique")
        _dimension(obj["columns"], "opened.columns")
        _dimension(obj["rows"], "opened.rows")
        timeout = obj["output_finalization_timeout_milliseconds"]
        _require(_int(timeout) and 1 <= timeout < 1 << 32, "opened output timeout")
    elif kind == "ready":
        _keys(obj, base, where=kind)
    elif kind == "workload-exit":
        _keys(obj, base | {"status"}, where=kind)
        check_process_status(obj["status"], "workload-exit.status", allow_unknown=False)
    elif kind == "terminating":
        _keys(obj, base | {"cause"}, where=kind)
        _require(obj["cause"] in CAUSES, "terminating.cause is a termination cause")
    elif kind in ("diagnostic", "client-error"):
        _keys(obj, base | {"code", "message"}, where=kind)
        _require(isinstance(obj["code"], str) and len(obj["code"]) <= 63
                 and _CODE.match(obj["code"]) is not None, f"{kind}.code is snake_case")
        check_safe_text(obj["message"], f"{kind}.message")
    elif kind == "workload-outputs-finalized":
        _keys(obj, base | {"status"}, frozenset({"reason"}), where=kind)
        _require(obj["status"] in OUTPUT_KINDS, "outputs-finalized status")
        has_reason = _optional_text(obj, "reason", kind)
        _require(has_reason == (obj["status"] == "failed"),
                 "outputs-finalized: drained has no reason, failed requires one")
    elif kind == "terminated":
        _keys(obj, base | {"result"}, where=kind)
        check_session_result(obj["result"], "terminated.result")
    else:
        raise ContractViolation(f"unknown event type {kind!r}")
    return obj


def check_event_line(line: bytes) -> dict[str, Any]:
    return check_event(parse_line(line))


def check_request_line(line: bytes) -> dict[str, Any]:
    obj = parse_line(line)
    _require(obj.get("schema") == CLIENT_SCHEMA, "request schema")
    kind = obj.get("type")
    if kind == "resize":
        _keys(obj, {"schema", "type", "columns", "rows"}, where=kind)
        _dimension(obj["columns"], "resize.columns")
        _dimension(obj["rows"], "resize.rows")
    elif kind in ("terminate", "complete", "acknowledge-terminated"):
        _keys(obj, {"schema", "type"}, where=kind)
    else:
        raise ContractViolation(f"unknown request type {kind!r}")
    return obj


# -- the lifecycle order --------------------------------------------------------------------------


def check_event_sequence(events: list[dict[str, Any]]) -> None:
    """The order of seed 000 as a controller following its robust sequence relies on it:
    broker-ready, opened, then ready or a startup-failure `terminated`; workload-exit precedes
    terminating exactly when it is the cause; after workload-outputs-finalized (when the
    controller sends complete) the next event is `terminated`; nothing at all follows
    `terminated`, not even a client-error (issue 23); a client-error ends the stream."""
    for event in events:
        check_event(event)
    types = [event["type"] for event in events]
    lifecycle = [t for t in types if t not in ("diagnostic", "client-error")]
    if "client-error" in types:
        _require(types.index("client-error") == len(types) - 1, "client-error ends the stream")
    _require(types[:1] == ["broker-ready"], "broker-ready comes first")
    for kind in ("broker-ready", "opened", "ready", "workload-exit", "terminating",
                 "workload-outputs-finalized", "terminated"):
        _require(lifecycle.count(kind) <= 1, f"{kind} at most once")
    if len(lifecycle) > 1:
        _require(lifecycle[1] == "opened", "opened follows broker-ready")
    if len(lifecycle) > 2:
        _require(lifecycle[2] in ("ready", "terminated"), "ready or terminated follows opened")
    if "terminated" in types:
        _require(types[-1] == "terminated", "nothing follows terminated")
    if "ready" not in lifecycle:
        _require(set(lifecycle) <= {"broker-ready", "opened", "terminated"},
                 "before ready only the startup-failure branch")
        return
    if "terminating" in lifecycle:
        cause = next(e["cause"] for e in events if e["type"] == "terminating")
        terminating_at = lifecycle.index("terminating")
        if "workload-exit" in lifecycle:
            exit_before = lifecycle.index("workload-exit") < terminating_at
            _require(exit_before == (cause == "workload-exit"),
                     "workload-exit precedes terminating exactly when it is the cause")
        else:
            _require(cause != "workload-exit", "a workload-exit cause is announced")
    if "workload-outputs-finalized" in lifecycle:
        at = types.index("workload-outputs-finalized")
        _require("terminating" in lifecycle[:lifecycle.index("workload-outputs-finalized")],
                 "workload-outputs-finalized follows terminating")
        _require(types[at + 1:at + 2] in ([], ["terminated"], ["client-error"]),
                 "only terminated follows workload-outputs-finalized")
    if "terminated" in lifecycle:
        _require("workload-outputs-finalized" in lifecycle,
                 "after ready, terminated follows workload-outputs-finalized")
        result = next(e["result"] for e in events if e["type"] == "terminated")
        if "terminating" in lifecycle:
            cause = next(e["cause"] for e in events if e["type"] == "terminating")
            _require(result["cause"] == cause, "terminated carries the latched cause")
        exits = [e["status"] for e in events if e["type"] == "workload-exit"]
        if exits:
            _require(result["workload_status"] == exits[0],
                     "terminated reports the workload status workload-exit announced")
        finalized = next(e for e in events if e["type"] == "workload-outputs-finalized")
        output = result["workload_output_finalization_status"]
        _require(output["kind"] == finalized["status"] and output.get("reason")
                 == finalized.get("reason"), "terminated repeats the output finalization")
