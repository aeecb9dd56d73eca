"""The pure cores of `reploy serve`: the session state machine, the store's compare-and-swap
and leases (real SQLite, no Docker), request bodies, the SSE encoder, routes and the OpenAPI
document, the `session` client's requests."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import agent  # noqa: E402
import reploy  # noqa: E402
import reploy_serve  # noqa: E402
from reploy_serve import SessionEvent as E, SessionState as S  # noqa: E402

# -- the state machine ------------------------------------------------------------------------


@pytest.mark.parametrize(("state", "event", "after"), [
    (S.CREATING, E.STARTED, S.ACTIVE),
    (S.CREATING, E.ROLLBACK, S.DELETING),
    (S.ACTIVE, E.PAUSED, S.IDLE),
    (S.IDLE, E.RESUMED, S.ACTIVE),
    (S.ACTIVE, E.CHECKPOINT, S.SNAPSHOTTING),
    (S.IDLE, E.CHECKPOINT, S.SNAPSHOTTING),
    (S.SNAPSHOTTING, E.CHECKPOINTED, S.SNAPSHOT),
    (S.SNAPSHOTTING, E.ROLLBACK, S.ACTIVE),
    (S.SNAPSHOT, E.RESTORE, S.RESTORING),
    (S.RESTORING, E.STARTED, S.ACTIVE),
    (S.RESTORING, E.ROLLBACK, S.SNAPSHOT),
    (S.ACTIVE, E.RELAUNCHED, S.ACTIVE),
    (S.IDLE, E.RELAUNCHED, S.ACTIVE),
    (S.ACTIVE, E.DELETE, S.DELETING),
    (S.IDLE, E.DELETE, S.DELETING),
    (S.SNAPSHOT, E.DELETE, S.DELETING),
    (S.DELETING, E.DELETE, S.DELETING),
])
def test_every_edge_of_the_table(state: S, event: E, after: S) -> None:
    assert reploy_serve.next_session_state(state, event) is after


def test_everything_else_is_illegal_and_a_conflict() -> None:
    legal = set(reploy_serve.SESSION_TRANSITIONS)
    assert len(legal) == 17
    for state in S:
        for event in E:
            if (state, event) not in legal:
                with pytest.raises(reploy_serve.IllegalTransition) as info:
                    reploy_serve.next_session_state(state, event)
                assert info.value.status == 409


def test_every_transitional_state_has_a_way_out() -> None:
    """Recovery needs an edge out of each transitional state that does not need the step that
    was under way (ROLLBACK, or DELETE for deleting)."""
    for state in set(S) - reploy_serve.STABLE_STATES:
        assert any((state, event) in reploy_serve.SESSION_TRANSITIONS
                   for event in (E.ROLLBACK, E.CHECKPOINTED, E.DELETE))


def _record(**overrides: object) -> reploy_serve.SessionRecord:
    spec = reploy_serve.SessionSpec(workload="shell", model=None, deployment="d", deployment_id="x",
                              image_id="sha256:1", generation=1,
                              runtime=reploy.Runtime(1000, 1000, ("/tmp",), 256, 128))
    values = dict(id="0123456789abcdef", name="n", spec=spec, state=S.ACTIVE, version=1,
                  created_at=1.0, last_access=1.0, state_since=1.0)
    values.update(overrides)
    return reploy_serve.SessionRecord(**values)  # type: ignore[arg-type]


def test_apply_bumps_the_version_and_dates_state_changes_only() -> None:
    record = _record()
    idle = reploy_serve.apply_session_event(record, E.PAUSED, now=5.0)
    assert (idle.state, idle.version, idle.state_since) == (S.IDLE, 2, 5.0)
    again = reploy_serve.apply_session_event(record, E.RELAUNCHED, now=7.0, container_id="c")
    assert (again.state_since, again.container_id, again.version) == (1.0, "c", 2)


def test_spec_round_trips_through_json() -> None:
    spec = _record().spec
    assert reploy_serve.SessionSpec.from_json(spec.to_json()) == spec


def test_lease_staleness() -> None:
    import reploy_watchdog

    me = f"h/{reploy_watchdog.process_identity()}/abcd"
    assert reploy_serve.lease_is_stale(None, 0, now=10, host="h")
    assert reploy_serve.lease_is_stale(me, expires=5, now=10, host="h")  # expired
    assert not reploy_serve.lease_is_stale(me, expires=50, now=10, host="h")  # live holder
    dead = "h/999999999:1.0/abcd"
    assert reploy_serve.lease_is_stale(dead, expires=50, now=10, host="h")  # holder's process is gone
    assert not reploy_serve.lease_is_stale(dead, expires=50, now=10, host="other")  # cannot tell: wait


# -- the reaper's decision --------------------------------------------------------------------

POLICY = reploy_serve.ReapPolicy(idle_after_s=60, snapshot_after_s=600, max_busy_s=3600)
A = reploy_serve.ReapAction
B = reploy_serve.IdleBlock
NOT_BUSY = reploy_serve.WorkloadFacts(busy=False, quiet_s=1e9)  # quiet since long before any access
BUSY = reploy_serve.WorkloadFacts(busy=True, quiet_s=0)


@pytest.mark.parametrize(("case", "record", "facts", "viewers", "now", "action", "blocked"), [
    # An active session: idle time runs from the last access...
    ("not yet due", dict(last_access=0), NOT_BUSY, 0, 59, A.KEEP, ()),
    ("idle on time", dict(last_access=0), NOT_BUSY, 0, 60, A.PAUSE, ()),
    ("snapshot on time", dict(last_access=0), NOT_BUSY, 0, 600, A.SNAPSHOT, ()),
    # ...or from the end of the last busy stretch, whichever is later: busy time is not idle time.
    ("a job ended 10 s ago", dict(last_access=0), reploy_serve.WorkloadFacts(False, 10), 0, 1000, A.KEEP, ()),
    ("a job ended 60 s ago", dict(last_access=0), reploy_serve.WorkloadFacts(False, 60), 0, 1000, A.PAUSE, ()),
    ("a busy stretch the record kept", dict(last_access=0, busy_at=950), NOT_BUSY, 0, 1000, A.KEEP, ()),
    ("an access after the busy stretch", dict(last_access=990, busy_at=500), NOT_BUSY, 0, 1000, A.KEEP, ()),
    # Busy or watched: never paused or snapshotted by the idle clock...
    ("busy", dict(last_access=0), BUSY, 0, 3599, A.KEEP, (B.BUSY,)),
    ("watched", dict(last_access=0), NOT_BUSY, 1, 3599, A.KEEP, (B.VIEWER,)),
    ("busy and watched", dict(last_access=0), BUSY, 2, 3599, A.KEEP, (B.BUSY, B.VIEWER)),
    # ...until nobody accessed it for max_busy: paused anyway (never snapshotted).
    ("busy past max_busy", dict(last_access=0), BUSY, 0, 3600, A.FORCE_PAUSE, (B.BUSY,)),
    ("watched past max_busy", dict(last_access=0), NOT_BUSY, 1, 9999, A.FORCE_PAUSE, (B.VIEWER,)),
    ("accessed while busy", dict(last_access=100), BUSY, 0, 3650, A.KEEP, (B.BUSY,)),
    # An agent that does not answer: not busy, the last access decides.
    ("no answer", dict(last_access=0, busy_at=10), None, 0, 70, A.PAUSE, ()),
    ("no answer, due to snapshot", dict(last_access=0), None, 0, 600, A.SNAPSHOT, ()),
    # A paused session: its frozen facts decide; it is never paused again.
    ("idle, not yet", dict(state=S.IDLE, last_access=0), None, 0, 599, A.KEEP, ()),
    ("idle, snapshot", dict(state=S.IDLE, last_access=0), None, 0, 600, A.SNAPSHOT, ()),
    ("idle, from the busy stretch", dict(state=S.IDLE, last_access=0, busy_at=100), None, 0, 650, A.KEEP, ()),
    ("idle, paused busy", dict(state=S.IDLE, last_access=0, idle_blocked_by=(B.BUSY,)), None, 0, 1e9,
     A.KEEP, (B.BUSY,)),
    ("idle, watched", dict(state=S.IDLE, last_access=0), None, 1, 1e9, A.KEEP, (B.VIEWER,)),
    ("idle, the viewer left", dict(state=S.IDLE, last_access=0, idle_blocked_by=(B.VIEWER,)), None, 0, 600,
     A.SNAPSHOT, ()),
    ("idle, live facts ignored", dict(state=S.IDLE, last_access=0), BUSY, 0, 600, A.SNAPSHOT, ()),
])
def test_reap_decisions(case: str, record: dict[str, Any], facts: Any, viewers: int, now: float,
                        action: Any, blocked: tuple[Any, ...]) -> None:
    decision = reploy_serve.decide_reap(_record(**record), facts, viewers, now, POLICY)
    assert (decision.action, decision.blocked_by) == (action, blocked), case


@pytest.mark.parametrize("state", sorted(set(S) - {S.ACTIVE, S.IDLE}, key=lambda s: s.value))
def test_the_reaper_leaves_every_other_state_alone(state: Any) -> None:
    for facts in (None, BUSY, NOT_BUSY):
        decision = reploy_serve.decide_reap(_record(state=state, last_access=0), facts, 1, 1e9, POLICY)
        assert (decision.action, decision.blocked_by) == (A.KEEP, ())


def test_reap_rules_hold_over_the_whole_grid() -> None:
    """The rules as properties, over every combination of state, facts, viewers, stored facts
    and time: nothing blocked is ever paused or snapshotted, busy work is never snapshotted,
    only an active session is paused, and nothing happens before its time."""
    for state in (S.ACTIVE, S.IDLE):
        for facts in (None, BUSY, NOT_BUSY, reploy_serve.WorkloadFacts(False, 30)):
            for viewers in (0, 1):
                for kept in ((), (B.BUSY,), (B.VIEWER,)):
                    for busy_at in (None, 0.0, 500.0):
                        for now in (0, 59, 60, 599, 600, 3599, 3600, 5000):
                            record = _record(state=state, last_access=0, busy_at=busy_at,
                                             idle_blocked_by=kept)
                            d = reploy_serve.decide_reap(record, facts, viewers, now, POLICY)
                            busy = (facts is not None and facts.busy if state is S.ACTIVE
                                    else B.BUSY in kept)
                            assert (B.BUSY in d.blocked_by) == busy
                            assert (B.VIEWER in d.blocked_by) == (viewers > 0)
                            if d.blocked_by:
                                assert d.action in (A.KEEP, A.FORCE_PAUSE)
                            if d.action is A.FORCE_PAUSE:
                                assert state is S.ACTIVE and now >= POLICY.max_busy_s
                            if busy:
                                assert d.action is not A.SNAPSHOT
                            if state is S.IDLE:
                                assert d.action in (A.KEEP, A.SNAPSHOT)
                            quiet = now - d.idle_since
                            if d.action is A.PAUSE:
                                assert POLICY.idle_after_s <= quiet < POLICY.snapshot_after_s
                            if d.action is A.SNAPSHOT:
                                assert quiet >= POLICY.snapshot_after_s
                            assert d.idle_since >= record.last_access


def test_workload_facts_come_from_the_agents_status() -> None:
    facts = reploy_serve.WorkloadFacts.from_status
    assert facts({"busy": True, "quiet_ms": 0, "turn_state": "in_progress", "queue_depth": 0}) == BUSY
    assert facts({"busy": False, "quiet_ms": 2500}) == reploy_serve.WorkloadFacts(False, 2.5)
    # An agent older than busy/quiet_ms: its turn state and queue say whether it is busy.
    assert facts({"turn_state": "in_progress", "queue_depth": 0}) == BUSY
    assert facts({"turn_state": "waiting", "queue_depth": 2}) == BUSY
    assert facts({"turn_state": "idle", "queue_depth": 0}) == reploy_serve.WorkloadFacts(False, None)
    assert facts({"turn_state": "waiting", "queue_depth": 0, "quiet_ms": True}) == reploy_serve.WorkloadFacts(False, None)


def test_an_agent_that_does_not_say_how_long_it_was_quiet_leaves_the_clock_to_the_last_access() -> None:
    record = _record(last_access=0, busy_at=5.0)
    decision = reploy_serve.decide_reap(record, reploy_serve.WorkloadFacts(False, None), 0, 70, POLICY)
    assert (decision.action, decision.busy_at, decision.idle_since) == (A.PAUSE, 5.0, 5.0)


def test_session_json_counts_down_from_the_busy_stretch_and_stops_while_blocked() -> None:
    doc = reploy_serve.session_json(_record(last_access=100.0, busy_at=150.0), 10, 60)
    assert (doc["idleAt"], doc["snapshotAt"], doc["idleBlockedBy"]) == (160.0, 210.0, [])
    doc = reploy_serve.session_json(_record(last_access=100.0, idle_blocked_by=(B.BUSY, B.VIEWER)), 10, 60)
    assert (doc["idleAt"], doc["snapshotAt"], doc["idleBlockedBy"]) == (None, None, ["busy", "viewer"])
    doc = reploy_serve.session_json(_record(state=S.IDLE, last_access=100.0), 10, 60)
    assert (doc["idleAt"], doc["snapshotAt"]) == (None, 160.0)
    doc = reploy_serve.session_json(_record(state=S.SNAPSHOT, idle_blocked_by=(B.BUSY,)), 10, 60)
    assert doc["idleBlockedBy"] == []


# -- the store ------------------------------------------------------------------------------


def test_store_compare_and_swap_is_fenced_by_version_and_lease(tmp_path: Path) -> None:
    one, two = reploy_serve.SessionStore(tmp_path / "s.db"), reploy_serve.SessionStore(tmp_path / "s.db")
    record = _record()
    one.insert(record)
    assert one.acquire(record.id, "owner-a", now=10)
    assert not two.acquire(record.id, "owner-b", now=10)  # held
    assert two.acquire(record.id, "owner-b", now=10, stale_owner="someone-else") is False
    saved = one.save(record, reploy_serve.apply_session_event(record, E.PAUSED, 10), "owner-a", now=10)
    assert two.get(record.id).state is S.IDLE and saved.version == 2
    with pytest.raises(reploy_serve.SessionConflict):  # stale version
        one.save(record, reploy_serve.apply_session_event(record, E.PAUSED, 10), "owner-a", now=10)
    with pytest.raises(reploy_serve.SessionConflict):  # not the lease holder
        two.save(saved, reploy_serve.apply_session_event(saved, E.RESUMED, 10), "owner-b", now=10)
    with pytest.raises(reploy_serve.SessionConflict):  # the lease expired
        one.save(saved, reploy_serve.apply_session_event(saved, E.RESUMED, 10), "owner-a",
                 now=10 + reploy_serve.LEASE_TTL_S + 1)
    assert two.acquire(record.id, "owner-b", now=10 + reploy_serve.LEASE_TTL_S + 1)  # expiry
    assert one.acquire(record.id, "owner-c", now=11, stale_owner="owner-b")  # a dead holder


def test_touch_only_refreshes_an_active_session_nobody_holds(tmp_path: Path) -> None:
    store = reploy_serve.SessionStore(tmp_path / "s.db")
    store.insert(_record())
    store.insert(_record(id="fedcba9876543210", state=S.IDLE))
    assert store.touch("0123456789abcdef", now=20)
    assert store.get("0123456789abcdef").last_access == 20
    assert not store.touch("fedcba9876543210", now=20)  # idle: the slow path resumes it
    assert store.acquire("0123456789abcdef", "owner", now=21)
    assert not store.touch("0123456789abcdef", now=22)  # held: wait for the holder
    store.release("0123456789abcdef", "owner")
    assert store.touch("0123456789abcdef", now=23)


def test_exactly_one_of_many_racing_acquirers_wins(tmp_path: Path) -> None:
    reploy_serve.SessionStore(tmp_path / "s.db").insert(_record())
    barrier = threading.Barrier(16)
    wins: list[str] = []

    def contend(name: str) -> None:
        store = reploy_serve.SessionStore(tmp_path / "s.db")
        barrier.wait()
        if store.acquire("0123456789abcdef", name, now=100):
            wins.append(name)

    threads = [threading.Thread(target=contend, args=(f"o{i}",)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(wins) == 1


def test_delete_is_fenced_by_the_lease(tmp_path: Path) -> None:
    store = reploy_serve.SessionStore(tmp_path / "s.db")
    record = _record()
    store.insert(record)
    store.acquire(record.id, "a", now=1)
    store.delete(record.id, "b")
    assert store.get(record.id) is not None
    store.delete(record.id, "a")
    assert store.get(record.id) is None


def test_observed_facts_need_no_lease_and_apply_only_to_the_state_seen(tmp_path: Path) -> None:
    store = reploy_serve.SessionStore(tmp_path / "s.db")
    record = _record()
    store.insert(record)
    store.acquire(record.id, "someone", now=1)  # facts are observations: a lease does not matter
    store.observe(record.id, S.ACTIVE, 42.0, (B.BUSY, B.VIEWER))
    seen = store.get(record.id)
    assert (seen.busy_at, seen.idle_blocked_by, seen.version) == (42.0, (B.BUSY, B.VIEWER), 1)
    store.observe(record.id, S.IDLE, 50.0, ())  # seen idle, but it is active: ignored
    assert store.get(record.id).busy_at == 42.0
    paused = store.save(seen, reploy_serve.apply_session_event(seen, E.PAUSED, 2, idle_blocked_by=(B.BUSY,)),
                        "someone", now=2)
    assert store.get(record.id).idle_blocked_by == (B.BUSY,) == paused.idle_blocked_by


def test_a_viewer_held_by_another_process_counts_until_it_expires(tmp_path: Path) -> None:
    """Each `serve` has its own connection; a viewer one holds must block another's reaper,
    and one whose `serve` died without removing it stops counting after VIEWER_TTL_S."""
    db = tmp_path / "s.db"
    store = reploy_serve.SessionStore(db)
    store.insert(_record())
    sid = "0123456789abcdef"
    holder = subprocess.run([sys.executable, "-c", f"""
import sys; sys.path.insert(0, {str(ROOT)!r}); import reploy_serve
reploy_serve.SessionStore(__import__("pathlib").Path({str(db)!r})).hold_viewer("v-other", {sid!r}, 100.0)
"""], capture_output=True, timeout=60)
    assert holder.returncode == 0, holder.stderr
    assert store.viewer_count(sid, now=100.0) == 1
    store.hold_viewer("v-mine", sid, now=110.0)
    assert store.viewer_count(sid, now=111.0) == 2
    assert store.viewer_count("fedcba9876543210", now=111.0) == 0
    assert store.viewer_count(sid, now=100.0 + reploy_serve.VIEWER_TTL_S) == 1  # the other one expired
    store.hold_viewer("v-mine", sid, now=130.0)  # a renewal, not a second viewer
    assert store.viewer_count(sid, now=131.0) == 1
    store.drop_viewer("v-mine")
    assert store.viewer_count(sid, now=131.0) == 0


def test_a_schema_1_store_gains_the_new_columns_in_place(tmp_path: Path) -> None:
    import sqlite3

    db = tmp_path / "s.db"
    old = sqlite3.connect(db)
    old.execute(reploy_serve._STORE_DDL)
    record = _record()
    columns = reploy_serve._RECORD_COLUMNS[:13]  # schema 1's columns
    values = {**record.__dict__, "spec": record.spec.to_json(), "state": record.state.value}
    old.execute(f"INSERT INTO sessions ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                [values[c] for c in columns])
    old.execute("PRAGMA user_version=1")
    old.commit()
    old.close()
    store = reploy_serve.SessionStore(db)
    assert store.get(record.id) == record  # busy_at None, idle_blocked_by ()
    reploy_serve.SessionStore(db)  # opening again changes nothing
    store.observe(record.id, S.ACTIVE, 5.0, (B.VIEWER,))
    assert store.get(record.id).idle_blocked_by == (B.VIEWER,)


# -- request bodies ---------------------------------------------------------------------------

CREATE = reploy_serve.BODY_RULES["create"]


@pytest.mark.parametrize(("raw", "error"), [
    (b"[]", reploy_serve.BadRequest),
    (b"{", reploy_serve.BadRequest),
    (b'{"name": "a", "workload": "shell"} {}', reploy_serve.BadRequest),  # trailing data
    (b'{"name": "a", "workload": "shell", "extra": 1}', reploy_serve.BadRequest),
    (b'{"name": "a", "name": "b", "workload": "shell"}', reploy_serve.BadRequest),
    (b'{"name": 1, "workload": "shell"}', reploy_serve.BadRequest),
    (b'{"workload": "shell"}', reploy_serve.BadRequest),
    (b'{"name": "a", "workload": "shell", "model": NaN}', reploy_serve.BadRequest),
    (b'\xff', reploy_serve.BadRequest),
    (b"[" * 100_000 + b"]" * 100_000, reploy_serve.BadRequest),  # nesting past the recursion limit
    (b'{"name": ' + b"1" * 5000 + b', "workload": "shell"}', reploy_serve.BadRequest),  # past int()'s digits
    (b'{"name": "\\ud800", "workload": "shell"}', reploy_serve.BadRequest),  # a lone surrogate
    (b'{"name": "a", "workload": "vm"}', reploy_serve.Unprocessable),
    (b'{"name": "../x", "workload": "shell"}', reploy_serve.Unprocessable),
    (b'{"name": "a", "workload": "agent", "model": "bad model"}', reploy_serve.Unprocessable),
])
def test_create_bodies_are_strict(raw: bytes, error: type) -> None:
    with pytest.raises(error):
        reploy_serve.parse_body(raw, CREATE)


@pytest.mark.parametrize("body", [
    {"name": "a\n", "workload": "shell"},  # `$` would let a trailing newline through: fullmatch
    {"name": "a", "workload": "agent", "model": "m\n"},
    {"name": "a", "workload": "agent", "model": "~m\n"},
    {"name": "a", "workload": "shell", "deployment": "d\n"},
    {"name": "a", "workload": "agent", "model": "platform-default"},  # seed 002's reserved alias
])
def test_trailing_newlines_and_the_reserved_model_are_refused(body: dict[str, str]) -> None:
    with pytest.raises(reploy_serve.Unprocessable):
        reploy_serve.parse_body(json.dumps(body).encode(), CREATE)


@pytest.mark.parametrize(("parse", "text"), [
    (reploy.parse_duration_ms, "5s\n"),
    (reploy.parse_duration_ms, "\u0665s"),  # a non-ASCII digit
    (lambda text: reploy_serve.sse_cursor(text, None), "5\n"),
    (lambda text: reploy_serve.match_route("GET", f"/sessions/{text}"), "0123456789abcdef\n"),
])
def test_every_parser_refuses_a_trailing_newline(parse: Any, text: str) -> None:
    with pytest.raises((ValueError, reploy_serve.ServeError)):
        parse(text)


@pytest.mark.parametrize(("path", "value"), [
    ("name", "demo\n"),
    ("environment.runtime.user", "1000:1000\n"),
    ("environment.executables", {"demo.main\n": {"argv": ["true"]}}),
    ("environment.workload.services", {"web": {"endpoints": {"web\n": {"scheme": "http", "port": 80}}}}),
])
def test_blueprint_names_refuse_a_trailing_newline(path: str, value: Any) -> None:
    doc: dict[str, Any] = {"name": "demo", "environment": {
        "runtime": {"user": "1000:1000"},
        "executables": {"demo.main": {"argv": ["true"]}},
        "commands": {"run": {"executable": "demo.main", "native_command": True, "trigger": ["run"]}}}}
    reploy.parse_blueprint(doc)  # valid as it stands
    *parents, leaf = path.split(".")
    node = doc
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    with pytest.raises(reploy.BlueprintError):
        reploy.parse_blueprint(doc)


def test_every_pattern_in_the_role_files_is_fullmatched() -> None:
    """`re.match(...$)` lets a trailing newline through; every pattern is used with fullmatch,
    so none needs (or has) anchors, and no role file calls .match()."""
    import agent
    import reploy_session_client
    import reploy_watchdog

    for module in (reploy, agent, reploy_session_client, reploy_watchdog):
        patterns = [v for v in vars(module).values() if isinstance(v, re.Pattern)]
        assert all(not p.pattern.startswith("^") and not p.pattern.endswith("$") for p in patterns)
        assert ".match(" not in Path(module.__file__).read_text()


def test_valid_bodies_and_ranges() -> None:
    assert reploy_serve.parse_body(b'{"name": "a b", "workload": "agent", "model": "~anthropic/x"}',
                             CREATE)["model"] == "~anthropic/x"
    assert reploy_serve.parse_body(b"", reploy_serve.BODY_RULES["empty"]) == {}
    rules = reploy_serve.BODY_RULES["resize"]
    with pytest.raises(reploy_serve.BadRequest):
        reploy_serve.parse_body(b'{"columns": true, "rows": 2}', rules)  # a bool is not an int
    with pytest.raises(reploy_serve.Unprocessable):
        reploy_serve.parse_body(b'{"columns": 0, "rows": 2}', rules)
    with pytest.raises(reploy_serve.PayloadTooLarge):
        reploy_serve.parse_body(b" " * (reploy_serve.MAX_BODY_BYTES + 1), rules)


def test_payloads_are_base64_and_bounded() -> None:
    assert reploy_serve.decode_payload(base64.b64encode(b"ls\r").decode(), "d", 3) == b"ls\r"
    with pytest.raises(reploy_serve.BadRequest):
        reploy_serve.decode_payload("not base64!", "d", 3)
    with pytest.raises(reploy_serve.PayloadTooLarge):
        reploy_serve.decode_payload(base64.b64encode(b"x" * 4).decode(), "d", 3)


def request_line_bytes(method: str, params: dict) -> int:
    """A request line as the agent's contract counts it (the JSON object, newline excluded), in
    whatever escaping a JSON encoder may choose: here the widest, ASCII-only."""
    return len(json.dumps({"id": "serve", "method": method, "params": params}).encode())


def test_the_largest_shell_write_fits_the_agents_request_line() -> None:
    data = b"\xff" * reploy_serve.MAX_WRITE_BYTES
    assert request_line_bytes("write", {"data_b64": base64.b64encode(data).decode()}) <= agent.MAX_REQUEST_BYTES


@pytest.mark.parametrize("unit", ["\x01", "é", "€", "😀", "a\x01😀"])
def test_a_message_of_the_largest_size_is_cut_into_parts_each_request_line_holds(unit: str) -> None:
    """A 1 MiB message travels as the agent's draft; every part, however its characters escape,
    fits one request line, and the parts put together are the message."""
    text = unit * (reploy_serve.MAX_PAYLOAD_BYTES // len(unit.encode()))
    parts = reploy_serve.message_parts(text)
    assert "".join(parts) == text and all(parts)
    for part in parts:
        assert len(part.encode()) <= reploy_serve.MAX_MESSAGE_PART_BYTES
        line = request_line_bytes("message", {"text": part, "draft": "0" * 16, "more": True})
        assert line <= agent.MAX_REQUEST_BYTES
    assert reploy_serve.message_parts("short") == ["short"]


def test_session_json_has_no_secret_and_counts_down_from_last_access() -> None:
    doc = reploy_serve.session_json(_record(last_access=100.0), idle_after_s=10, snapshot_after_s=60)
    assert (doc["idleAt"], doc["snapshotAt"]) == (110.0, 160.0)
    doc = reploy_serve.session_json(_record(state=S.SNAPSHOT), 10, 60)
    assert doc["idleAt"] is None and doc["snapshotAt"] is None
    schema = json.loads((ROOT / "web/openapi.json").read_text())["components"]["schemas"]["Session"]
    assert set(doc) == set(schema["required"]) == set(schema["properties"])


# -- SSE --------------------------------------------------------------------------------------


def test_output_events_carry_exact_byte_ranges() -> None:
    event = reploy_serve.sse_output(10, b"\x1b[31mred\xe2\x82")
    lines = event.decode().split("\n")
    assert lines[0] == "id: 20" and lines[1] == "event: output" and event.endswith(b"\n\n")
    data = json.loads(lines[2][len("data: "):])
    assert data["offset"] == 10 and data["nextOffset"] == 20
    assert len(base64.b64decode(data["payloadBase64"])) == data["nextOffset"] - data["offset"]


def test_reset_event_and_cursor_precedence() -> None:
    assert reploy_serve.sse_reset(7) == b'id: 7\nevent: reset\ndata: {"nextOffset":7}\n\n'
    assert reploy_serve.sse_cursor(None, None) == 0
    assert reploy_serve.sse_cursor(None, "5") == 5
    assert reploy_serve.sse_cursor("9", "5") == 9  # Last-Event-ID wins
    with pytest.raises(reploy_serve.BadRequest):
        reploy_serve.sse_cursor("-1", None)
    with pytest.raises(reploy_serve.BadRequest):
        reploy_serve.sse_cursor(None, "x")


@pytest.mark.parametrize(("data", "kept"), [
    (b"abc", 3), (b"ab\xc3", 2), (b"ab\xc3\xa9", 4), (b"\xe2\x82", 0), (b"\xe2\x82\xac", 3),
    (b"x\xf0\x9f\x98", 1), (b"x\xf0\x9f\x98\x80", 5), (b"", 0),
])
def test_agent_chunks_end_on_code_point_boundaries(data: bytes, kept: int) -> None:
    assert reploy_serve.utf8_complete_prefix(data) == data[:kept]


# -- routes and the OpenAPI document ----------------------------------------------------------


def test_routes_match_and_refuse() -> None:
    assert reploy_serve.match_route("GET", "/sessions") == ("list_sessions", None)
    assert reploy_serve.match_route("POST", "/sessions/0123456789abcdef/read") == ("read", "0123456789abcdef")
    with pytest.raises(reploy_serve.SessionNotFound):
        reploy_serve.match_route("GET", "/sessions/NOT-AN-ID")
    with pytest.raises(reploy_serve.SessionNotFound):
        reploy_serve.match_route("GET", "/nothing")
    with pytest.raises(reploy_serve.MethodNotAllowed) as info:
        reploy_serve.match_route("PUT", "/sessions")
    assert set(info.value.allowed) == {"GET", "POST"}


def test_openapi_documents_exactly_the_routes() -> None:
    spec = json.loads((ROOT / "web/openapi.json").read_text())
    documented = {(method.upper(), path) for path, item in spec["paths"].items() for method in item}
    served = {(method, path) for method, path, _ in reploy_serve.API_ROUTES}
    assert documented == served
    for name, rules in (("CreateSession", "create"), ("ReadRequest", "read"),
                        ("WriteRequest", "write"), ("MessageRequest", "message"),
                        ("ResizeRequest", "resize"), ("ExecRequest", "exec")):
        schema = spec["components"]["schemas"][name]
        assert set(schema["properties"]) == set(reploy_serve.BODY_RULES[rules])
        assert set(schema.get("required", [])) == {k for k, r in reploy_serve.BODY_RULES[rules].items()
                                                   if r.required}


def test_openapi_states_each_pattern_and_reserved_value_the_server_applies() -> None:
    """A client validating against the spec refuses what the server refuses (422), no more, no less."""
    schema = json.loads((ROOT / "web/openapi.json").read_text())["components"]["schemas"]["CreateSession"]
    for field, rule in reploy_serve.BODY_RULES["create"].items():
        documented = schema["properties"][field]
        if rule.pattern is not None and field != "deployment":  # a deployment is a name from /config
            assert documented["pattern"] in (f"^{rule.pattern.pattern}$", f"^({rule.pattern.pattern})$"), field
        for value in rule.reserved:
            assert {"not": {"enum": [value]}} in documented.get("allOf", []), (field, value)


# -- the `session` client and `serve` usage ---------------------------------------------------


def test_client_requests() -> None:
    args = SimpleNamespace(session_action="create", name="n", workload="agent", model="m",
                           deployment=None)
    assert reploy_serve.client_request(args) == ("POST", "/sessions",
                                           {"name": "n", "workload": "agent", "model": "m"})
    args = SimpleNamespace(session_action="read", id="x", offset=3, max_bytes=10, wait_ms=0)
    assert reploy_serve.client_request(args) == ("POST", "/sessions/x/read",
                                           {"offset": 3, "maxBytes": 10, "waitMs": 0})
    assert reploy_serve.client_request(SimpleNamespace(session_action="delete", id="x"))[:2] == (
        "DELETE", "/sessions/x")
    assert reploy_serve.client_request(SimpleNamespace(session_action="snapshot", id="x")) == (
        "POST", "/sessions/x/snapshot", {})


@pytest.mark.parametrize("extra", [
    ["--idle-after", "soon"],
    ["--agent-command", '["claude"]'],
    ["--agent-env", "REPLOY_SURELY_UNSET_VARIABLE"],
    ["--mount", "/nonexistent:/x"],
    ["--listen", "nowhere"],
    ["--models", '["a", "a"]'],
    ["--models", '"abc"'],  # a string is not a catalog
    ["--models", '[" a"]'],
    ["--models", '["a\\n"]'],
    ["--models", '["platform-default"]'],
    ["--models", '["a", 5]'],
    ["--default-model", "platform-default"],
    ["--default-model", "m\n"],
    ["--agent-env", "HOME\n"],
    ["--allow-host", "proxy.test\n"],
])
@pytest.mark.parametrize("entry", ["reploy.py", "reploy_serve.py"])
def test_serve_usage_errors_exit_2_with_nothing_on_stdout(extra: list[str], entry: str,
                                                          tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / entry), "serve", "--state-dir",
                           str(tmp_path), "--workload-dir", str(tmp_path), *extra],
                          capture_output=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == b"", proc.stderr


@pytest.mark.parametrize("entry", ["reploy.py", "reploy_serve.py"])
def test_session_client_without_a_server_prints_one_error_document(entry: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / entry), "session", "list",
                           "--server", "http://127.0.0.1:9"], capture_output=True, timeout=60)
    assert proc.returncode == 1
    assert "error" in json.loads(proc.stdout)


@pytest.mark.parametrize("words", [["serve", "--help"], ["session", "--help"],
                                   ["session", "exec", "--help"]])
def test_reploy_py_hands_serve_and_session_to_the_control_plane_unchanged(words: list[str]) -> None:
    """The host does not know serve's options: what `reploy.py serve|session` prints is what
    reploy_serve.py prints, and an interpreter option (-X dev) reaches the control plane."""
    host, control_plane = (
        subprocess.run([sys.executable, "-X", "dev", str(ROOT / entry), *words],
                       capture_output=True, timeout=60)
        for entry in ("reploy.py", "reploy_serve.py"))
    assert host.returncode == control_plane.returncode == 0
    assert host.stdout == control_plane.stdout and host.stdout.startswith(b"usage: reploy ")


def test_the_host_does_not_import_the_control_plane() -> None:
    """One direction only: reploy_serve.py imports reploy.py, never the other way round."""
    proc = subprocess.run([sys.executable, "-c", f"""
import sys; sys.path.insert(0, {str(ROOT)!r}); import reploy
print("reploy_serve" in sys.modules, "sqlite3" in sys.modules, "http.server" in sys.modules)
"""], capture_output=True, timeout=60)
    assert proc.stdout == b"False False False\n", proc.stderr
