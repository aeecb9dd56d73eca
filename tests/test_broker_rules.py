"""BrokerRules, the broker's pure lifecycle and request rules, against the seed.

Two layers: named cases, one per rule of the seed, and an exhaustive check. The exhaustive check
writes the seed's order as a small independent model (a phase plus two facts) and walks every
state reachable by the model and BrokerRules together, comparing their verdict on every event
and request from every state. The product of the two states is finite, so the walk is complete.
"""

from __future__ import annotations

import collections
import copy
from dataclasses import dataclass, replace
from typing import Optional, Union

import pytest

from reploy_session_client import (
    AcknowledgeTerminated, BrokerReady, BrokerRules, Cause, ClientError, Complete, Diagnostic,
    Direction, Message, Opened, ProtocolError, Ready, RecoveryAction, RequestVerdict, Resize,
    SessionResult, Status, Terminate, Terminated, Terminating, WorkloadExit,
    WorkloadOutputsFinalized,
)

FORWARD, IGNORE = RequestVerdict.FORWARD, RequestVerdict.IGNORE

BROKER_READY = BrokerReady(terminal_socket="/home/reploy-controlled-session-x/terminal.sock")
OPENED = Opened(operations=("input", "resize", "terminate", "complete"), endpoints=(),
                columns=80, rows=24, output_finalization_timeout_milliseconds=30000)
READY = Ready()
WORKLOAD_EXIT = WorkloadExit(status=Status.of("process", "exited", code=0))
DIAGNOSTIC = Diagnostic(code="future_code", message="m")
CLIENT_ERROR = ClientError(code="future_code", message="m")
DRAINED = WorkloadOutputsFinalized(status="drained")
FAILED = WorkloadOutputsFinalized(status="failed", reason="drain expired")
TERMINATING = {cause: Terminating(cause=cause) for cause in Cause}
TERMINATED = Terminated(result=SessionResult(
    cause=Cause.STARTUP_FAILURE,
    workload_status=Status.of("process", "unavailable", reason="the workload never started"),
    workload_output_finalization_status=Status.of("output_finalization", "drained"),
    runtime_observation_status=Status.of("runtime_observation", "maintained"),
    controller_finalization_status=Status.of("controller_finalization", "startup-failed",
                                             reason="no attachment"),
    cleanup_status=Status.of("cleanup", "succeeded"), recovery_action=RecoveryAction.NONE))

RESIZE, TERMINATE, COMPLETE, ACK = (Resize(columns=100, rows=30), Terminate(), Complete(),
                                    AcknowledgeTerminated())

EVENTS: list[Message] = [BROKER_READY, OPENED, READY, WORKLOAD_EXIT, DIAGNOSTIC, CLIENT_ERROR,
                         DRAINED, FAILED, TERMINATED, *TERMINATING.values()]
REQUESTS: list[Message] = [RESIZE, TERMINATE, COMPLETE, ACK]

#: Common prefixes of the event stream.
UP_TO_READY = [BROKER_READY, OPENED, READY]
UP_TO_FINALIZED = [*UP_TO_READY, TERMINATING[Cause.CONTROLLER_TERMINATE], DRAINED]
UP_TO_TERMINATED = [*UP_TO_FINALIZED, TERMINATED]
STARTUP_FAILED = [BROKER_READY, OPENED, TERMINATED]


def rules_after(history: list[Message]) -> BrokerRules:
    """Rules that have seen these events and allowed these requests, in this order."""
    rules = BrokerRules()
    for message in history:
        if message.DIRECTION is Direction.EVENT:
            rules.observe_event(message)
        else:
            rules.check_request(message)
    return rules


def host_error(rules: BrokerRules, event: Message) -> None:
    with pytest.raises(ProtocolError) as info:
        rules.observe_event(event)
    assert info.value.code == "host_protocol_error"


# --------------------------------------------------------------------------------------------
# Named cases: event order
# --------------------------------------------------------------------------------------------

ALLOWED_ORDERS = {
    "workload exit causes termination": [
        *UP_TO_READY, WORKLOAD_EXIT, TERMINATING[Cause.WORKLOAD_EXIT], DRAINED, TERMINATED],
    "controller terminate, exit after terminating": [
        *UP_TO_READY, TERMINATING[Cause.CONTROLLER_TERMINATE], WORKLOAD_EXIT, FAILED, TERMINATED],
    "no workload exit at all": [
        *UP_TO_READY, TERMINATING[Cause.RUNTIME_OBSERVATION_LOST], FAILED, TERMINATED],
    "startup failure: terminated right after opened": STARTUP_FAILED,
    "diagnostics anywhere between broker-ready and outputs-finalized": [
        BROKER_READY, DIAGNOSTIC, OPENED, DIAGNOSTIC, READY, DIAGNOSTIC,
        TERMINATING[Cause.CONTROLLER_LOST], DIAGNOSTIC, DRAINED, TERMINATED],
    "client-error anywhere before terminated": [
        BROKER_READY, CLIENT_ERROR, OPENED, CLIENT_ERROR, READY, CLIENT_ERROR, CLIENT_ERROR],
}


@pytest.mark.parametrize("events", ALLOWED_ORDERS.values(), ids=ALLOWED_ORDERS.keys())
def test_allowed_event_order(events: list[Message]) -> None:
    rules = rules_after(events)
    assert rules.seen == {event.TYPE for event in events}


#: (prefix that is accepted, the next event, which must be refused)
REFUSED_ORDERS = {
    "anything before broker-ready": ([], OPENED),
    "diagnostic before broker-ready": ([], DIAGNOSTIC),
    "broker-ready twice": ([BROKER_READY], BROKER_READY),
    "ready before opened": ([BROKER_READY], READY),
    "terminated before opened": ([BROKER_READY], TERMINATED),
    "opened twice": ([BROKER_READY, OPENED], OPENED),
    "workload-exit before ready": ([BROKER_READY, OPENED], WORKLOAD_EXIT),
    "terminating before ready": ([BROKER_READY, OPENED], TERMINATING[Cause.STARTUP_FAILURE]),
    "outputs-finalized before terminating": (UP_TO_READY, DRAINED),
    "ready twice": (UP_TO_READY, READY),
    "terminated after ready without terminating": (UP_TO_READY, TERMINATED),
    "terminating(workload-exit) without workload-exit": (
        UP_TO_READY, TERMINATING[Cause.WORKLOAD_EXIT]),
    "workload-exit before terminating with another cause": (
        [*UP_TO_READY, WORKLOAD_EXIT], TERMINATING[Cause.CONTROLLER_TERMINATE]),
    "workload-exit twice": ([*UP_TO_READY, WORKLOAD_EXIT], WORKLOAD_EXIT),
    "terminating twice": (
        [*UP_TO_READY, TERMINATING[Cause.HOST_CANCEL]], TERMINATING[Cause.HOST_CANCEL]),
    "terminated before outputs-finalized": (
        [*UP_TO_READY, TERMINATING[Cause.HOST_CANCEL]], TERMINATED),
    "outputs-finalized twice": (UP_TO_FINALIZED, FAILED),
    "terminated twice": (UP_TO_TERMINATED, TERMINATED),
    "diagnostic after terminated": (UP_TO_TERMINATED, DIAGNOSTIC),
    "client-error after terminated": (UP_TO_TERMINATED, CLIENT_ERROR),
    "client-error after a startup failure's terminated": (STARTUP_FAILED, CLIENT_ERROR),
    "diagnostic after outputs-finalized": (UP_TO_FINALIZED, DIAGNOSTIC),
    "workload-exit after outputs-finalized": (UP_TO_FINALIZED, WORKLOAD_EXIT),
    "workload-exit after terminated": (UP_TO_TERMINATED, WORKLOAD_EXIT),
    "ready after a startup failure": (STARTUP_FAILED, READY),
    "outputs-finalized after a startup failure": (STARTUP_FAILED, DRAINED),
}


@pytest.mark.parametrize("prefix, event", REFUSED_ORDERS.values(), ids=REFUSED_ORDERS.keys())
def test_refused_event_order(prefix: list[Message], event: Message) -> None:
    rules = rules_after(prefix)
    seen_before = set(rules.seen)
    host_error(rules, event)
    assert rules.seen == seen_before  # a refused event leaves no trace


# --------------------------------------------------------------------------------------------
# Named cases: request verdicts
# --------------------------------------------------------------------------------------------

#: (events seen and requests allowed so far, the request, its verdict or fatal code)
VERDICTS = {
    "resize before ready": ([BROKER_READY, OPENED], RESIZE, "premature_request"),
    "resize when ready": (UP_TO_READY, RESIZE, FORWARD),
    "resize again when ready": ([*UP_TO_READY, RESIZE], RESIZE, FORWARD),
    "resize after terminating": (
        [*UP_TO_READY, TERMINATING[Cause.HOST_CANCEL]], RESIZE, IGNORE),
    "resize after terminated": (UP_TO_TERMINATED, RESIZE, IGNORE),
    "resize after a startup failure": (STARTUP_FAILED, RESIZE, "premature_request"),
    "terminate before ready": ([BROKER_READY, OPENED], TERMINATE, "premature_request"),
    "terminate when ready": (UP_TO_READY, TERMINATE, FORWARD),
    "terminate repeated": ([*UP_TO_READY, TERMINATE], TERMINATE, IGNORE),
    "terminate after terminating": (
        [*UP_TO_READY, WORKLOAD_EXIT, TERMINATING[Cause.WORKLOAD_EXIT]], TERMINATE, IGNORE),
    "terminate after terminated": (UP_TO_TERMINATED, TERMINATE, IGNORE),
    "complete before terminating": (UP_TO_READY, COMPLETE, "premature_request"),
    "complete before outputs-finalized": (
        [*UP_TO_READY, TERMINATING[Cause.HOST_CANCEL]], COMPLETE, "premature_request"),
    "complete after outputs-finalized": (UP_TO_FINALIZED, COMPLETE, FORWARD),
    "complete after failed outputs-finalized": (
        [*UP_TO_READY, TERMINATING[Cause.HOST_CANCEL], FAILED], COMPLETE, FORWARD),
    "complete twice": ([*UP_TO_FINALIZED, COMPLETE], COMPLETE, "duplicate_request"),
    "complete after terminated": (UP_TO_TERMINATED, COMPLETE, "unauthorized_request"),
    "complete again after terminated": (
        [*UP_TO_FINALIZED, COMPLETE, TERMINATED], COMPLETE, "duplicate_request"),
    "complete after a startup failure": (STARTUP_FAILED, COMPLETE, "premature_request"),
    "acknowledge before terminated": (UP_TO_FINALIZED, ACK, "premature_request"),
    "acknowledge after terminated": (UP_TO_TERMINATED, ACK, FORWARD),
    "acknowledge after a startup failure": (STARTUP_FAILED, ACK, FORWARD),
    "acknowledge twice": ([*UP_TO_TERMINATED, ACK], ACK, "duplicate_request"),
}


@pytest.mark.parametrize("history, asked, expected", VERDICTS.values(), ids=VERDICTS.keys())
def test_request_verdict(history: list[Message], asked: Message,
                         expected: Union[RequestVerdict, str]) -> None:
    rules = rules_after(history)
    if isinstance(expected, RequestVerdict):
        assert rules.check_request(asked) is expected
    else:
        with pytest.raises(ProtocolError) as info:
            rules.check_request(asked)
        assert info.value.code == expected


def test_acknowledged_only_after_the_acknowledgement_was_allowed() -> None:
    rules = rules_after(UP_TO_TERMINATED)
    assert not rules.acknowledged
    with pytest.raises(ProtocolError):
        rules_after(UP_TO_FINALIZED).check_request(ACK)
    assert rules.check_request(ACK) is FORWARD
    assert rules.acknowledged


# --------------------------------------------------------------------------------------------
# Exhaustive: an independent model of the seed, walked together with BrokerRules
# --------------------------------------------------------------------------------------------

#: The lifecycle phases the controller can tell apart, in order.
NEXT_PHASE = {
    ("broker-ready", "start"): "broker-ready",
    ("opened", "broker-ready"): "opened",
    ("ready", "opened"): "ready",
    ("terminated", "opened"): "terminated",  # a startup failure
    ("terminating", "ready"): "terminating",
    ("workload-outputs-finalized", "terminating"): "finalized",
    ("terminated", "finalized"): "terminated",
}
BEGAN_TERMINATION = {"terminating", "finalized", "terminated"}


@dataclass(frozen=True)
class SeedModel:
    """The seed's 'Structured stream' section, restated as a phase and two facts."""

    phase: str = "start"
    became_ready: bool = False
    workload_exited: bool = False
    sent: frozenset[str] = frozenset()

    def on_event(self, event: Message) -> Optional["SeedModel"]:
        """The next state, or None when the seed does not allow the event here."""
        kind = event.TYPE
        if kind == "client-error":  # a fatal failure, reported on the stream until terminated
            return self if self.phase != "terminated" else None  # issue 23: nothing after it
        # Issue 10: every workload fact comes before workload-outputs-finalized; after it (the
        # controller sends complete) the next event is terminated.
        if kind == "diagnostic":
            return self if self.phase not in ("start", "finalized", "terminated") else None
        if kind == "workload-exit":
            allowed = (self.became_ready and self.phase not in ("finalized", "terminated")
                       and not self.workload_exited)
            return replace(self, workload_exited=True) if allowed else None
        if kind == "terminating":
            # "If workload exit causes termination, workload-exit precedes terminating; for
            # [any other cause], terminating precedes any later workload-exit."
            assert isinstance(event, Terminating)
            if (event.cause is Cause.WORKLOAD_EXIT) != self.workload_exited:
                return None
        phase = NEXT_PHASE.get((kind, self.phase))
        if phase is None:
            return None
        return replace(self, phase=phase, became_ready=self.became_ready or phase == "ready")

    def on_request(self, request: Message) -> tuple[Union[RequestVerdict, str], "SeedModel"]:
        kind, phase, sent = request.TYPE, self.phase, self.sent
        if kind in ("resize", "terminate"):
            if not self.became_ready:
                return "premature_request", self
            if phase in BEGAN_TERMINATION or kind in sent and kind == "terminate":
                return IGNORE, self
        elif kind == "complete":
            if kind in sent:
                return "duplicate_request", self
            if phase == "terminated" and self.became_ready:
                return "unauthorized_request", self
            if phase != "finalized":
                return "premature_request", self
        elif kind == "acknowledge-terminated":
            if kind in sent:
                return "duplicate_request", self
            if phase != "terminated":
                return "premature_request", self
        return FORWARD, replace(self, sent=sent | {kind})


def rules_outcome(rules: BrokerRules, message: Message) -> Union[RequestVerdict, str, None]:
    try:
        if message in REQUESTS:
            return rules.check_request(message)
        rules.observe_event(message)
        return None
    except ProtocolError as e:
        return e.code


def model_outcome(model: SeedModel, message: Message) -> tuple[Union[RequestVerdict, str, None],
                                                                Optional[SeedModel]]:
    if message in REQUESTS:
        verdict, after = model.on_request(message)
        return verdict, (after if isinstance(verdict, RequestVerdict) else None)
    after = model.on_event(message)
    return (None, after) if after is not None else ("host_protocol_error", None)


def walk_together() -> tuple[list[str], set[SeedModel]]:
    """Breadth-first over (model state, rules state); every message from every state."""
    start = (SeedModel(), BrokerRules(), ())
    queue = collections.deque([start])
    visited: set[tuple[SeedModel, frozenset[str], frozenset[str]]] = set()
    mismatches: list[str] = []
    while queue:
        model, rules, path = queue.popleft()
        key = (model, frozenset(rules.seen), frozenset(rules.sent))
        if key in visited:
            continue
        visited.add(key)
        for message in EVENTS + REQUESTS:
            after_rules = copy.deepcopy(rules)
            actual = rules_outcome(after_rules, message)
            expected, after_model = model_outcome(model, message)
            cause = f"({message.cause.value})" if isinstance(message, Terminating) else ""
            step = path + (message.TYPE + cause,)
            if actual != expected:
                mismatches.append(f"{' > '.join(step)}: rules {actual}, seed {expected}")
            elif after_model is not None:
                queue.append((after_model, after_rules, step))
    return mismatches, {model for model, _, _ in visited}


def test_rules_match_the_seed_from_every_reachable_state() -> None:
    mismatches, states = walk_together()
    assert not mismatches, "\n".join(mismatches[:20])
    # The walk really went everywhere: both branches to terminated, and the acknowledgement.
    assert SeedModel("terminated", True, True, frozenset({"complete", "acknowledge-terminated",
                                                          "terminate"})) in states
    assert SeedModel("terminated", False, False, frozenset({"acknowledge-terminated"})) in states
