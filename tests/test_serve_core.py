"""The pure cores of `reploy serve`: the session state machine, the store's compare-and-swap
and leases (real SQLite, no Docker), request bodies, the SSE encoder, routes and the OpenAPI
document, the `session` client's requests."""

from __future__ import annotations

import base64
import concurrent.futures
import datetime
import json
import os
import random
import re
import subprocess
import sys
import threading
from pathlib import Path
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import agent  # noqa: E402
import reploy  # noqa: E402
import session_platform_rules  # noqa: E402  (the reference's route table, not production's)
import reploy_serve  # noqa: E402
from reploy_serve import SessionEvent as E, SessionState as S  # noqa: E402
from agent_fixtures import harness as agent_harness  # noqa: E402

# -- the state machine ------------------------------------------------------------------------


@pytest.mark.parametrize(("state", "event", "after"), [
    (S.CREATING, E.STARTED, S.ACTIVE),
    (S.CREATING, E.ROLLBACK, S.DELETING),
    (S.ACTIVE, E.PAUSED, S.IDLE),
    (S.IDLE, E.RESUMED, S.ACTIVE),
    (S.ACTIVE, E.CHECKPOINT, S.SNAPSHOTTING),
    (S.IDLE, E.CHECKPOINT, S.SNAPSHOTTING),
    (S.SNAPSHOTTING, E.CHECKPOINTED, S.SNAPSHOT),
    (S.SNAPSHOTTING, E.SNAPSHOT_FAILED, S.IDLE),
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
    assert len(legal) == 18
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
    # A session whose last snapshot failed: not again before its retry time (issue 26).
    ("failed, retry not yet", dict(state=S.IDLE, last_access=0, snapshot_retry_at=1200), None, 0, 1199, A.KEEP,
     ()),
    ("failed, retry due", dict(state=S.IDLE, last_access=0, snapshot_retry_at=1200), None, 0, 1200, A.SNAPSHOT,
     ()),
    ("failed, accessed since", dict(last_access=0, snapshot_retry_at=1200), NOT_BUSY, 0, 700, A.PAUSE, ()),
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


def test_a_failed_snapshot_waits_longer_each_time_and_never_past_the_bound() -> None:
    waits = [reploy_serve.snapshot_retry_after_s(n, 60.0) for n in range(1, 200)]
    assert waits[:4] == [60.0, 120.0, 240.0, 480.0]
    assert all(a <= b for a, b in zip(waits, waits[1:])) and max(waits) == reploy_serve.SNAPSHOT_RETRY_MAX_S


def test_the_last_failure_is_shown_until_a_step_succeeds() -> None:
    failed = _record(state=S.IDLE, last_access=100.0, failed_step="snapshot", failure="not enough space",
                     failed_at=150.0, snapshot_failures=2, snapshot_retry_at=400.0)
    doc = reploy_serve.session_json(failed, 10, 60)
    assert doc["lastFailure"] == {"step": "snapshot", "reason": "not enough space", "failures": 2,
                                  "at": "1970-01-01T00:02:30.000000Z", "retryAt": "1970-01-01T00:06:40.000000Z"}
    assert seconds(doc["snapshotAt"]) == 400.0  # the retry, not the idle clock's 160
    restore = reploy_serve.session_json(_record(state=S.SNAPSHOT, archive="a.tar", failed_step="restore",
                                                failure="the agent refused", failed_at=5.0), 10, 60)
    assert restore["lastFailure"] == {"step": "restore", "reason": "the agent refused",
                                      "at": "1970-01-01T00:00:05.000000Z"}
    assert "lastFailure" not in reploy_serve.session_json(replace(failed, **reploy_serve._NO_FAILURE), 10, 60)
    schema = json.loads((ROOT / "web/openapi.json").read_text())["components"]["schemas"]["Session"]
    for document in (doc, restore):
        assert set(document) <= set(schema["properties"])
        assert set(document["lastFailure"]) <= set(schema["properties"]["lastFailure"]["properties"])


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


def seconds(stamp: str) -> float:
    """An RFC 3339 date-time in UTC (`Z`) as a Unix time."""
    assert stamp.endswith("Z"), stamp
    return datetime.datetime.fromisoformat(stamp[:-1] + "+00:00").timestamp()


def test_session_json_counts_down_from_the_busy_stretch_and_stops_while_blocked() -> None:
    doc = reploy_serve.session_json(_record(last_access=100.0, busy_at=150.0), 10, 60)
    assert (seconds(doc["idleAt"]), seconds(doc["snapshotAt"]), doc["idleBlockedBy"]) == (160.0, 210.0, [])
    doc = reploy_serve.session_json(_record(last_access=100.0, idle_blocked_by=(B.BUSY, B.VIEWER)), 10, 60)
    assert "idleAt" not in doc and "snapshotAt" not in doc and doc["idleBlockedBy"] == ["busy", "viewer"]
    doc = reploy_serve.session_json(_record(state=S.IDLE, last_access=100.0), 10, 60)
    assert "idleAt" not in doc and seconds(doc["snapshotAt"]) == 160.0
    doc = reploy_serve.session_json(_record(state=S.SNAPSHOT, idle_blocked_by=(B.BUSY,), archive="a.tar",
                                            snapshot_bytes=5), 10, 60)
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
    touched = store.touch("0123456789abcdef", now=20)
    assert touched == store.get("0123456789abcdef") and touched.last_access == 20  # the row as left
    assert store.touch("fedcba9876543210", now=20) is None  # idle: the slow path resumes it
    assert store.acquire("0123456789abcdef", "owner", now=21)
    assert store.touch("0123456789abcdef", now=22) is None  # held: wait for the holder
    store.release("0123456789abcdef", "owner")
    assert store.touch("0123456789abcdef", now=23)


def test_store_lends_each_connection_to_one_thread_at_a_time(tmp_path: Path) -> None:
    """Many threads at once (each request has its own): every statement sees the truth, no
    connection is shared mid-statement, and only STORE_IDLE_CONNECTIONS stay open after."""
    store = reploy_serve.SessionStore(tmp_path / "s.db")
    store.insert(_record())
    threads = 4 * reploy_serve.STORE_IDLE_CONNECTIONS
    start = threading.Barrier(threads)

    def access(n: int) -> float:
        start.wait()
        touched = store.touch("0123456789abcdef", now=100 + n)
        assert touched is not None
        return touched.last_access

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        seen = list(pool.map(access, range(threads)))
    assert sorted(seen) == [100 + n for n in range(threads)]  # each its own statement's row
    assert 1 <= len(store._idle) <= reploy_serve.STORE_IDLE_CONNECTIONS
    store.close()
    assert store._idle == [] and store.get("0123456789abcdef") is not None  # still usable, unpooled
    assert store._idle == []


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


def _old_store(db: Path, record: reploy_serve.SessionRecord, version: int, added_columns: int) -> None:
    """A store as schema `version` made it (its first `added_columns` of _STORE_ADDED_COLUMNS), holding record."""
    import sqlite3

    old = sqlite3.connect(db)
    old.execute(reploy_serve._STORE_DDL)
    for column, declaration in reploy_serve._STORE_ADDED_COLUMNS[:added_columns]:
        old.execute(f"ALTER TABLE sessions ADD COLUMN {column} {declaration}")
    columns = reploy_serve._RECORD_COLUMNS[:13 + added_columns]
    values = {**record.__dict__, "spec": record.spec.to_json(), "state": record.state.value, "idle_blocked_by": ""}
    old.execute(f"INSERT INTO sessions ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                [values[c] for c in columns])
    old.execute(f"PRAGMA user_version={version}")
    old.commit()
    old.close()


def test_a_schema_1_store_gains_the_new_columns_in_place(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    record = _record()
    _old_store(db, record, version=1, added_columns=0)
    store = reploy_serve.SessionStore(db)
    assert store.get(record.id) == record  # busy_at None, idle_blocked_by ()
    reploy_serve.SessionStore(db)  # opening again changes nothing
    store.observe(record.id, S.ACTIVE, 5.0, (B.VIEWER,))
    assert store.get(record.id).idle_blocked_by == (B.VIEWER,)


def test_labels_and_a_time_to_live_are_stored_listed_and_filtered(tmp_path: Path) -> None:
    store = reploy_serve.SessionStore(tmp_path / "s.db")
    labelled = _record(labels=(("inspect.eval", "e1"), ("sample", "3")), expires_at=61.0)
    store.insert(labelled)
    assert store.get(labelled.id) == labelled
    doc = reploy_serve.session_json(labelled, idle_after_s=10, snapshot_after_s=60)
    assert doc["labels"] == {"inspect.eval": "e1", "sample": "3"} and seconds(doc["expiresAt"]) == 61.0
    assert "expiresAt" not in reploy_serve.session_json(_record(), 10, 60)
    assert (reploy_serve.is_expired(labelled, 60.9), reploy_serve.is_expired(labelled, 61.0)) == (False, True)
    assert not reploy_serve.is_expired(_record(), 10.0**9)
    # Repeated filters must all match.
    wanted = reploy_serve.label_filter("label=inspect.eval=e1&label=sample=3")
    assert wanted == (("inspect.eval", "e1"), ("sample", "3")) and reploy_serve.has_labels(labelled, wanted)
    assert not reploy_serve.has_labels(labelled, reploy_serve.label_filter("label=sample=3&label=x=y"))
    assert reploy_serve.label_filter("label=k=a=b") == (("k", "a=b"),)  # split at the first `=`
    for query in ("label=novalue", "label=bad%20key=v", "label=k=sp%20ace", "other=1"):
        with pytest.raises(reploy_serve.BadRequest):
            reploy_serve.label_filter(query)
    fields = reploy_serve.parse_body(b'{"name": "x", "labels": {"b": "2", "a": "1"}, "ttlSeconds": 600}', CREATE)
    request = reploy_serve.CreateRequest.from_fields(fields)
    assert (request.labels, request.ttl_s) == ((("a", "1"), ("b", "2")), 600)
    too_many = json.dumps({"name": "x", "labels": {f"k{n}": "v" for n in range(33)}}).encode()
    for raw in (too_many, b'{"name": "x", "labels": {"-k": "v"}}', b'{"name": "x", "labels": {"k": 1}}',
                b'{"name": "x", "labels": {"k": "a b"}}', b'{"name": "x", "ttlSeconds": 0}',
                b'{"name": "x", "labels": []}'):
        with pytest.raises(reploy_serve.BadRequest):
            reploy_serve.CreateRequest.from_fields(reploy_serve.parse_body(raw, CREATE))


@pytest.mark.parametrize("raw, says", [
    (b'{"name": "x", "cpus": 0}', "cpus: must be at least 0.01"),
    (b'{"name": "x", "cpus": -1}', "cpus: must be at least 0.01"),
    (b'{"name": "x", "cpus": 0.001}', "cpus: must be at least 0.01"),
    (b'{"name": "x", "cpus": "1"}', "cpus: must be a number"),
    (b'{"name": "x", "cpus": true}', "cpus: must be a number"),
    (b'{"name": "x", "cpus": null}', "cpus: must be a number"),
    (b'{"name": "x", "diskMib": 63}', "diskMib: must be from 64 to"),
    (b'{"name": "x", "diskMib": 96.0}', "diskMib: must be an integer"),
    (b'{"name": "x", "diskMib": "96"}', "diskMib: must be an integer"),
    (b'{"name": "x", "diskMib": 99999999999}', "diskMib: must be from 64 to"),
])
def test_a_create_s_cpus_and_disk_are_checked_at_the_body(raw: bytes, says: str) -> None:
    with pytest.raises(reploy_serve.BadRequest) as raised:
        create_request(raw)
    assert raised.value.status == 400 and says in str(raised.value)


def test_a_session_s_own_cpus_and_disk_default_to_and_stop_at_the_server_s() -> None:
    resources = reploy_serve.session_resources
    assert resources(create_request(b'{"name": "x"}'), 2.0, 512) == (2.0, 512)
    assert resources(create_request(b'{"name": "x", "cpus": 0.5, "diskMib": 96}'), 2.0, 512) == (0.5, 96)
    assert resources(create_request(b'{"name": "x", "cpus": 2, "diskMib": 512}'), 2.0, 512) == (2.0, 512)
    assert isinstance(create_request(b'{"name": "x", "cpus": 1}').cpus, float)
    for raw, says in ((b'{"name": "x", "cpus": 2.5}', "cpus: must be at most 2, this server's bound (--session-cpus)"),
                      (b'{"name": "x", "diskMib": 513}',
                       "diskMib: must be at most 512, this server's bound (--session-disk-mib)")):
        with pytest.raises(reploy_serve.BadRequest) as raised:
            resources(create_request(raw), 2.0, 512)
        assert str(raised.value) == says


def test_a_spec_stored_before_cpus_and_disk_reads_as_the_server_s(tmp_path: Path) -> None:
    own = _record(spec=replace(_record().spec, cpus=0.5, disk_mib=96))
    assert reploy_serve.SessionSpec.from_json(own.spec.to_json()) == own.spec
    old_doc = json.loads(own.spec.to_json())
    del old_doc["cpus"], old_doc["disk_mib"]
    old = reploy_serve.SessionSpec.from_json(json.dumps(old_doc))
    assert (old.cpus, old.disk_mib) == (None, None)
    config = reploy_serve.ServeConfig(tmp_path, (tmp_path,), session_cpus=1.5, session_disk_mib=300)
    assert (config.resources(old), config.resources(own.spec)) == ((1.5, 300), (0.5, 96))
    document = reploy_serve.session_json(own, 10, 60, config.resources(own.spec))
    assert (document["cpus"], document["diskMib"]) == (0.5, 96)


def test_a_schema_3_store_gains_labels_and_expiry(tmp_path: Path) -> None:
    record = _record()
    _old_store(tmp_path / "s.db", record, version=3, added_columns=3)
    store = reploy_serve.SessionStore(tmp_path / "s.db")
    assert store.get(record.id) == record and record.labels == () and record.expires_at is None


# -- request bodies ---------------------------------------------------------------------------

CREATE = reploy_serve.BODY_RULES["create"]


def create_request(raw: bytes) -> reploy_serve.CreateRequest:
    return reploy_serve.CreateRequest.from_fields(reploy_serve.parse_body(raw, CREATE))


@pytest.mark.parametrize("raw", [
    b"[]", b"{", b"null", b'"x"',
    b'{"name": "a"} {}',  # trailing data
    b'{"name": "a", "extra": 1}', b'{"name": "a", "workload": "shell"}',  # unknown fields
    b'{"name": "a", "name": "b"}',  # a duplicate key (Reploy's stricter choice)
    b'{"name": 1}', b'{"name": null}', b'{"name": "a", "model": null}', b'{"name": "a", "workloadType": null}',
    b'{"workloadType": "shell"}', b"{}",  # no name
    b'{"name": "a", "model": NaN}', b'\xff',
    b"[" * 100_000 + b"]" * 100_000,  # nesting past the recursion limit
    b'{"name": ' + b"1" * 5000 + b'}',  # past int()'s digits
    b'{"name": "\\ud800"}',  # a lone surrogate
    b'{"name": ""}', b'{"name": "   "}', b'{"name": " \\t\\n\\u00a0\\u3000 "}',  # nothing but white space
    b'{"name": "a", "workloadType": "vm"}', b'{"name": "a", "workloadType": ""}',
    b'{"name": "a", "workloadType": "agent"}',  # Reploy's internal name is not on the wire
    b'{"name": "a", "model": "m"}', b'{"name": "a", "workloadType": "shell", "model": "m"}',  # shell: no model
    b'{"name": "a", "workloadType": "claude-code", "model": ""}',
    b'{"name": "a", "workloadType": "claude-code", "model": " m"}',
    b'{"name": "a", "workloadType": "claude-code", "model": "m\\n"}',
    b'{"name": "a", "workloadType": "claude-code", "model": "bad model"}',
    b'{"name": "a", "workloadType": "claude-code", "model": "' + b"m" * 129 + b'"}',
    b'{"name": "a", "deployment": "d\\n"}',
])
def test_create_bodies_are_strict_and_every_refusal_is_400(raw: bytes) -> None:
    with pytest.raises(reploy_serve.ServeError) as raised:
        create_request(raw)
    assert raised.value.status == 400


@pytest.mark.parametrize(("raw", "expected"), [
    (b'{"name": "a"}', ("a", "shell", None)),  # seed 002's default workload type
    (b'{"name": "  two words \\u3000\\n"}', ("two words", "shell", None)),  # trimmed
    (b'{"name": "a\\nb"}', ("a\nb", "shell", None)),
    (b'{"name": "x' + b"y" * 5000 + b'"}', ("x" + "y" * 5000, "shell", None)),  # no maximum
    (b'{"name": "\\u001cx"}', ("\x1cx", "shell", None)),  # not White_Space: kept, as Go keeps it
    (b'{"name": "a", "workloadType": "shell"}', ("a", "shell", None)),
    (b'{"name": "a", "workloadType": "claude-code"}', ("a", "agent", "platform-default")),
    (b'{"name": "a", "workloadType": "claude-code", "model": "platform-default"}', ("a", "agent", "platform-default")),
    (b'{"name": "a", "workloadType": "claude-code", "model": "~anthropic/x:1"}', ("a", "agent", "~anthropic/x:1")),
])
def test_valid_create_bodies(raw: bytes, expected: tuple[str, str, Any]) -> None:
    request = create_request(raw)
    assert (request.name, request.workload, request.model) == expected


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
    read = reploy_serve.BODY_RULES["read"]
    assert reploy_serve.parse_body(b'{"offset": 9223372036854775807}', read)["offset"] == 2**63 - 1
    for raw in (b'{"offset": 9223372036854775808}', b'{"offset": -1}', b'{"offset": 1.5}', b'{"offset": "1"}',
                b'{"offset": null}', b'{"maxBytes": 4}', b'{"offset": true}'):
        with pytest.raises(reploy_serve.BadRequest):
            reploy_serve.parse_body(raw, read)
    write = reploy_serve.BODY_RULES["write"]
    assert reploy_serve.parse_body(b"  \n", write) == {}  # empty or white space: {}
    for raw in (b'{"payload": null}', b'{"payload": 5}', b'{"dataBase64": "eA=="}', b'{"payload": "x"} x'):
        with pytest.raises(reploy_serve.BadRequest):
            reploy_serve.parse_body(raw, write)
    assert reploy_serve.parse_body(b"", reploy_serve.BODY_RULES["empty"]) == {}
    rules = reploy_serve.BODY_RULES["resize"]
    with pytest.raises(reploy_serve.BadRequest):
        reploy_serve.parse_body(b'{"columns": true, "rows": 2}', rules)  # a bool is not an int
    with pytest.raises(reploy_serve.BadRequest):  # seed 002: every input error is 400
        reploy_serve.parse_body(b'{"columns": 0, "rows": 2}', rules)
    with pytest.raises(reploy_serve.PayloadTooLarge):
        reploy_serve.parse_body(b" " * (reploy_serve.MAX_BODY_BYTES + 1), rules)


def request_line_bytes(method: str, params: dict) -> int:
    """A request line as the agent's contract counts it (the JSON object, newline excluded), in
    whatever escaping a JSON encoder may choose: here the widest, ASCII-only."""
    return len(json.dumps({"id": "serve", "method": method, "params": params}).encode())


def test_the_largest_shell_write_part_fits_the_agents_request_line() -> None:
    data = b"\xff" * reploy_serve.MAX_WRITE_PART_BYTES
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


def test_session_json_counts_down_from_last_access_and_is_documented() -> None:
    doc = reploy_serve.session_json(_record(last_access=100.0), idle_after_s=10, snapshot_after_s=60)
    assert (seconds(doc["idleAt"]), seconds(doc["snapshotAt"])) == (110.0, 160.0)
    snapshot = reploy_serve.session_json(_record(state=S.SNAPSHOT, archive="checkpoint-v3.tar",
                                                 snapshot_bytes=10), 10, 60)
    assert "idleAt" not in snapshot and "snapshotAt" not in snapshot
    schema = json.loads((ROOT / "web/openapi.json").read_text())["components"]["schemas"]["Session"]
    for document in (doc, snapshot):
        assert set(schema["required"]) <= set(document) <= set(schema["properties"])


AGENT_SPEC = dict(workload="agent", model="platform-default")


@pytest.mark.parametrize(("record", "state", "phase", "pod", "checkpoint"), [
    (dict(state=S.ACTIVE, container_id="c1"), "active", None, "c1", False),
    (dict(state=S.IDLE, container_id="c1"), "idle", None, "c1", False),
    (dict(state=S.SNAPSHOT, archive="checkpoint-v4.tar", snapshot_bytes=7, checkpoint_at=50.0), "snapshot",
     None, None, True),
    # A step under way shows as the state a client has meanwhile, its name in `phase`.
    (dict(state=S.SNAPSHOTTING, container_id="c1", archive="checkpoint-v4.tar"), "active", "snapshotting", "c1",
     False),
    (dict(state=S.RESTORING, container_id="c2", archive="checkpoint-v4.tar", snapshot_bytes=7, checkpoint_at=50.0),
     "snapshot", "restoring", None, True),
])
def test_the_session_shows_seed_002s_three_states_and_its_pod_and_checkpoint(
        record: dict[str, Any], state: str, phase: Any, pod: Any, checkpoint: bool) -> None:
    doc = reploy_serve.session_json(_record(**record), 10, 60)
    assert (doc["state"], doc.get("phase"), doc.get("pod")) == (state, phase, pod)
    assert ("checkpoint" in doc) == checkpoint
    if checkpoint:
        assert doc["checkpoint"] == {"ref": "checkpoint-v4.tar", "sizeBytes": 7,
                                     "createdAt": "1970-01-01T00:00:50.000000Z"}
    assert None not in doc.values()


def test_the_session_speaks_seed_002s_workload_types_models_and_times() -> None:
    shell = reploy_serve.session_json(_record(created_at=1.5, last_access=1700000000.25), 10, 60)
    assert shell["workloadType"] == "shell" and "model" not in shell and "workload" not in shell
    assert shell["createdAt"] == "1970-01-01T00:00:01.500000Z"
    assert shell["lastAccess"] == "2023-11-14T22:13:20.250000Z"
    base = _record().spec
    for model, shown in (("platform-default", "platform-default"), ("m-1", "m-1"), (None, "platform-default")):
        spec = reploy_serve.replace(base, workload="agent", model=model)
        doc = reploy_serve.session_json(_record(spec=spec), 10, 60)
        assert (doc["workloadType"], doc["model"]) == ("claude-code", shown)


def test_created_and_deleted_sessions_are_not_shown() -> None:
    assert [state for state in S if reploy_serve.is_shown(_record(state=state))] == [
        S.ACTIVE, S.IDLE, S.SNAPSHOTTING, S.SNAPSHOT, S.RESTORING]
    assert [state for state in S if reploy_serve.has_container(_record(state=state))] == [
        S.ACTIVE, S.IDLE, S.SNAPSHOTTING]


def test_the_path_names_the_branch_that_served() -> None:
    assert reploy_serve.access_path("active", "read") == "active"
    assert reploy_serve.access_path("idle->active", "write") == "idle->active->write"
    assert reploy_serve.access_path("snapshot->restore", "read") == "snapshot->restore->read"


# -- text payloads: the UTF-8 length is the cursor's advance ------------------------------------


@pytest.mark.parametrize(("data", "text", "kept"), [
    (b"plain\r\n", "plain\r\n", 7),
    ("café €😀".encode(), "café €😀", 13),
    (b"\x1b[31mred\x00", "\x1b[31mred\x00", 9),  # control bytes are UTF-8 like any
    (b"a\xffb", "a?b", 3),  # an invalid byte: one byte for one byte
    (b"\xc0\x80", "??", 2),  # an overlong NUL
    (b"\xed\xa0\x80x", "???x", 4),  # an encoded surrogate
    (b"\xf4\x90\x80\x80", "????", 4),  # past U+10FFFF
    (b"\xe2\x82x", "??x", 3),  # a code point cut short by a byte that is not a continuation
    (b"\x80\x80ok", "??ok", 4),  # a read that starts inside a code point
    # The bytes end inside a code point that can still be completed: it waits for the next read.
    (b"ab\xc3", "ab", 2), (b"ab\xe2\x82", "ab", 2), (b"ab\xf0\x9f\x98", "ab", 2), (b"\xe2", "", 0),
    # ...unless it can never be completed: then its bytes are substituted now.
    (b"ab\xe0\x80", "ab??", 4), (b"ab\xed\xa0", "ab??", 4), (b"ab\xf4\x90", "ab??", 4), (b"ab\xc1", "ab?", 3),
    (b"ab\xf5", "ab?", 3), (b"ab\x82", "ab?", 3),
    (b"", "", 0),
])
def test_text_payloads_keep_the_length_invariant(data: bytes, text: str, kept: int) -> None:
    assert reploy_serve.text_payload(data) == (text, kept)
    assert len(text.encode()) == kept


def test_text_payloads_hold_the_invariant_for_any_bytes_and_keep_valid_text_exact() -> None:
    generator = random.Random(20250102)
    alphabet = [b"a", b"\xff", b"\x80", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"\xf0\x9f\x98\x80", b"\xed\xa0\x80",
                "é".encode(), "€".encode(), b"\x1b", b"\r\n"]
    for _ in range(3000):
        data = b"".join(generator.choice(alphabet) for _ in range(generator.randint(0, 12)))
        text, kept = reploy_serve.text_payload(data)
        assert len(text.encode()) == kept and len(data) - 3 <= kept <= len(data)
        assert text.encode() == bytes(b if b < 0x80 else ord("?") for b in data[:kept]) or "\udc80" not in text
        # Reading on from `kept` never changes what was answered: the text of a prefix is a prefix.
        whole, whole_kept = reploy_serve.text_payload(data + b"z")
        assert whole.startswith(text) and whole_kept == len(data) + 1
        valid = data.decode("utf-8", "ignore").encode()
        assert reploy_serve.text_payload(valid) == (valid.decode(), len(valid))


def test_text_payload_split_anywhere_joins_to_the_whole() -> None:
    """Two reads (the second from the first's cursor) give the text of one read."""
    data = "€ mixed \xff".encode() + b"\xff\xfe end \xf0\x9f\x98\x80"
    whole, _ = reploy_serve.text_payload(data)
    for cut in range(len(data) + 1):
        first, kept = reploy_serve.text_payload(data[:cut])
        second, _ = reploy_serve.text_payload(data[kept:])
        assert first + second == whole, cut


@pytest.mark.parametrize("cut", [0, 1, 2, 3])
def test_a_read_answer_is_encoded_in_slices_that_join_to_the_whole(cut: int) -> None:
    """Slices of READ_SLICE_BYTES cut code points and escapes anywhere; the pieces still make
    one JSON document whose payload is the whole text and whose payloadBase64 is the bytes."""
    slice_bytes = reploy_serve.READ_SLICE_BYTES
    unit = "€😀\x1b\"\\\n".encode() + b"\xff"
    data = b"x" * cut + unit * (2 * slice_bytes // len(unit) + 3)
    head = {"session": {"id": "s"}, "path": "active", "nextOffset": 9}
    pieces = list(reploy_serve.read_result_json(head, memoryview(data)))
    assert len(pieces) > 4 and max(map(len, pieces)) <= 6 * slice_bytes  # never the whole answer at once
    document = json.loads(b"".join(pieces))
    assert list(document) == ["session", "path", "nextOffset", "payload", "payloadBase64"]
    assert document["payload"] == data.decode("utf-8", "surrogateescape").replace("\udcff", "?")
    assert len(document["payload"].encode()) == len(data)
    assert base64.b64decode(document["payloadBase64"]) == data
    assert b"".join(reploy_serve.read_result_json(head, memoryview(b""))) == (
        b'{"session":{"id":"s"},"path":"active","nextOffset":9,"payload":"","payloadBase64":""}')


# -- agent read pages and log windows are hostile input ------------------------------------------


def page(**fields: Any) -> dict[str, Any]:
    return {"offset": 10, "next_offset": 13, "length": 20, "reset": False,
            "data_b64": base64.b64encode(b"abc").decode(), **fields}


def parse_read(answer: dict[str, Any], offset: int = 10) -> dict[str, Any]:
    """An agent's read answer (serve's follower long-polls with it) through its family's parser."""
    return reploy_serve.parse_agent_result("read", {"offset": offset, "max_bytes": 100},
                                           {"type": "read", **answer})


def test_a_consistent_read_page_is_taken() -> None:
    assert parse_read(page())["data"] == b"abc"
    assert parse_read(page(offset=30, next_offset=20, reset=True, data_b64=""), offset=30)["reset"]
    text = parse_read({"offset": 0, "next_offset": 2, "length": 2, "reset": False, "text": "é"}, 0)
    assert text["text"] == "é"


@pytest.mark.parametrize("answer", [
    page(offset=11), page(next_offset=14), page(length=12), page(reset="no"), page(length=True),
    page(length=-1), page(length=2**63), page(data_b64="not base64!"), page(data_b64=None),
    page(reset=True), page(offset=10, next_offset=20, reset=True, data_b64=""),  # reset at or below the length
    page(next_offset=10 + 200, length=1000, data_b64=base64.b64encode(b"x" * 200).decode()),  # past max_bytes
    page(text="abc"), {"offset": 10},
])
def test_an_inconsistent_read_page_is_refused(answer: dict[str, Any]) -> None:
    with pytest.raises(reploy_serve.AnswerInvalid):
        parse_read(answer)


LOG = b"0123456789abcdefghij"  #: the log a window is read from: 20 bytes


def window(**fields: Any) -> dict[str, Any]:
    return {"offset": 10, "next_offset": 13, "length": 20, "reset": False, "kind": "bytes", **fields}


def read_window(answer: dict[str, Any], tmp_path: Path, offset: int = 10, text: bool = False,
                log: bytes = LOG) -> Any:
    """An agent's read_fd answer as serve takes it: its family's parser, then the page read
    from a read-only descriptor of `log`."""
    checked = reploy_serve.parse_agent_result("read_fd", {"offset": offset, "max_bytes": 100},
                                              {"type": "read_fd", **answer})
    path = tmp_path / "output.log"
    path.write_bytes(log)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        reploy_serve.check_descriptor(fd, reploy_serve.ANSWER_DESCRIPTORS["read_fd"](checked))
        return reploy_serve.LogPage.from_window(checked, fd, text)
    finally:
        os.close(fd)


def test_a_consistent_log_window_is_read_from_its_descriptor(tmp_path: Path) -> None:
    taken = read_window(window(), tmp_path)
    assert (taken.data, taken.length_bytes, taken.past_end) == (b"abc", 20, False)
    whole = read_window(window(offset=0, next_offset=20), tmp_path, offset=0)
    assert whole.data == LOG
    past = read_window(window(offset=30, next_offset=20, reset=True), tmp_path, offset=30)
    assert (past.data, past.length_bytes, past.past_end) == (b"", 20, True)
    text = read_window(window(offset=0, next_offset=2, length=2, kind="text"), tmp_path, 0, True,
                       "é".encode())
    assert text.data == "é".encode()


@pytest.mark.parametrize("answer", [
    window(offset=11), window(next_offset=9), window(next_offset=21), window(length=12),
    window(reset="no"), window(length=True), window(length=-1), window(length=2**63),
    window(kind="text\r\n"), window(kind=None), window(reset=True),
    window(offset=10, next_offset=20, reset=True),  # a reset at or below the length
    window(offset=30, next_offset=25, reset=True),  # a reset not pointing at the length
    window(next_offset=10 + 101, length=1000),  # past max_bytes
    {"offset": 10, "next_offset": 13, "length": 20, "reset": False},
])
def test_an_inconsistent_log_window_is_refused(answer: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(reploy_serve.AnswerInvalid):
        read_window(answer, tmp_path)


def test_a_log_window_its_descriptor_cannot_fill_or_of_the_other_kind_is_a_bad_gateway(
        tmp_path: Path) -> None:
    with pytest.raises(reploy_serve.BadGateway, match="holds 10 of the 13 bytes"):
        read_window(window(offset=10, next_offset=23, length=30), tmp_path)  # the file has 20
    with pytest.raises(reploy_serve.BadGateway, match="workload's kind"):
        read_window(window(), tmp_path, text=True)  # claude-code output is text
    with pytest.raises(reploy_serve.BadGateway, match="workload's kind"):
        read_window(window(kind="text"), tmp_path)
    with pytest.raises(reploy_serve.BadGateway, match="not valid UTF-8"):
        read_window(window(kind="text"), tmp_path, text=True, log=b"0123456789\xe2\x82" + LOG)
    with pytest.raises(reploy_serve.BadGateway, match="not valid UTF-8"):  # ends inside a code point
        read_window(window(kind="text", next_offset=12), tmp_path, text=True, log=b"0123456789\xe2\x82\xac")


def test_a_log_descriptor_must_be_a_regular_file_open_only_for_reading(tmp_path: Path) -> None:
    path = tmp_path / "output.log"
    path.write_bytes(LOG)
    read_end, write_end = os.pipe()
    refused = [os.open(path, os.O_RDWR), os.open(path, os.O_WRONLY), os.open(tmp_path, os.O_RDONLY),
               read_end, write_end]
    try:
        for fd in refused:
            with pytest.raises(reploy_serve.AnswerInvalid, match="open for reading only"):
                reploy_serve.check_descriptor(fd, reploy_serve.AnswerDescriptor.LOG_TO_READ)
    finally:
        for fd in refused:
            os.close(fd)


def test_seed_002_routes_answer_only_the_spec_statuses() -> None:
    """On seed 002's routes a failure the spec does not name for that route becomes a 500 with
    its message; one it names keeps its status."""
    class Handler:
        def __init__(self, error: Exception) -> None:
            self.error = error

        @reploy_serve.spec_statuses
        def api_write(self, *args: Any) -> None:
            raise self.error

    for error, status in ((reploy_serve.TooManyRequests("queue full"), 429),
                          (reploy_serve.PayloadTooLarge("big"), 413),
                          (reploy_serve.ServiceUnavailable("no agent"), 500),
                          (reploy_serve.SessionConflict("busy"), 500),
                          (reploy.BackendError("docker"), 500)):
        with pytest.raises(reploy_serve.ServeError) as raised:
            Handler(error).api_write()
        assert (raised.value.status, str(raised.value)) == (status, str(error))
    spec_routes = {handler for handler in reploy_serve.SPEC_ERROR_STATUSES}
    assert spec_routes == {h for _, _, h in reploy_serve.API_ROUTES[:reploy_serve.API_ROUTES.index(
        ("GET", "/server", "get_server"))]}


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
    assert reploy_serve.sse_cursor("", "5") == 5  # ...when it is not empty
    assert reploy_serve.sse_cursor("9223372036854775807", None) == 2**63 - 1  # int64
    for text in ("-1", "x", "1.5", "+1", " 1", "9223372036854775808", "1" * 20):
        for last_event_id, offset in ((text, None), (None, text), (text, "5")):
            with pytest.raises(reploy_serve.BadRequest):
                reploy_serve.sse_cursor(last_event_id, offset)


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


#: Seed 002's routes (the compatibility reference, section 1), each with its operationId there.
SEED_002_ROUTES = session_platform_rules.ROUTES


def test_openapi_documents_exactly_the_routes_serve_has() -> None:
    """Seed 002's surface plus Reploy's: every route the server matches is documented, and
    nothing else is; seed 002's keep their operationIds and answer statuses no other."""
    spec = json.loads((ROOT / "web/openapi.json").read_text())
    documented = {(method.upper(), path) for path, item in spec["paths"].items() for method in item}
    served = {(method, path) for method, path, _ in reploy_serve.API_ROUTES}
    assert documented == served and set(SEED_002_ROUTES) <= served
    for method, path, handler in reploy_serve.API_ROUTES:
        assert reploy_serve.match_route(method, path.replace("{id}", "0123456789abcdef")
                                        .replace("{path}", "a/b"))[0] == handler
        operation = spec["paths"][path][method.lower()]
        if (method, path) in SEED_002_ROUTES:
            assert operation["operationId"] == SEED_002_ROUTES[(method, path)]
            errors = {int(code) for code in operation["responses"] if int(code) >= 400}
            assert errors - {401, 403, 415, 421, 500} == reploy_serve.SPEC_ERROR_STATUSES[handler], path
    for name, rules in (("CreateSessionRequest", "create"), ("ReadRequest", "read"),
                        ("WriteRequest", "write"), ("MessageRequest", "message"),
                        ("ResizeRequest", "resize"), ("ExecRequest", "exec")):
        schema = spec["components"]["schemas"][name]
        assert set(schema["properties"]) == set(reploy_serve.BODY_RULES[rules])
        assert set(schema.get("required", [])) == {k for k, r in reploy_serve.BODY_RULES[rules].items()
                                                   if r.required}


def test_openapi_states_each_pattern_and_enum_the_server_applies() -> None:
    """A client validating against the spec refuses what the server refuses (400), no more, no less."""
    schemas = json.loads((ROOT / "web/openapi.json").read_text())["components"]["schemas"]
    create = schemas["CreateSessionRequest"]["properties"]
    model = reploy_serve.BODY_RULES["create"]["model"]
    assert create["model"]["pattern"] == f"^({model.pattern.pattern})$" and not model.reserved
    assert create["workloadType"]["enum"] == list(reploy_serve.WORKLOAD_TYPES)
    assert create["workloadType"]["default"] == reploy_serve.DEFAULT_WORKLOAD_TYPE
    assert schemas["Session"]["properties"]["workloadType"]["enum"] == list(reploy_serve.WORKLOAD_TYPES)
    assert schemas["Session"]["properties"]["state"]["enum"] == ["active", "idle", "snapshot"]
    assert {state.value for state, _ in reploy_serve.WIRE_STATES.values()} == {"active", "idle", "snapshot"}
    assert schemas["Session"]["properties"]["phase"]["enum"] == [
        phase for _, phase in reploy_serve.WIRE_STATES.values() if phase]
    assert schemas["ReadRequest"]["properties"]["offset"]["minimum"] == 0


# -- the `session` client and `serve` usage ---------------------------------------------------


def create_args(**fields: Any) -> SimpleNamespace:
    defaults = {"workload_type": None, "model": None, "deployment": None, "ttl": None,
                "cpus": None, "disk_mib": None, "label": [], "egress": []}
    return SimpleNamespace(session_action="create", name="n", **{**defaults, **fields})


def test_client_requests() -> None:
    args = create_args(workload_type="claude-code", model="m")
    assert reploy_serve.client_request(args) == ("POST", "/sessions",
                                                 {"name": "n", "workloadType": "claude-code", "model": "m"})
    assert reploy_serve.client_request(create_args()) == ("POST", "/sessions", {"name": "n"})
    args = create_args(label=["task=a", "run=7=x", "empty="], ttl="1m", cpus=0.5, disk_mib=128)
    assert reploy_serve.client_request(args) == ("POST", "/sessions", {
        "name": "n", "ttlSeconds": 60, "cpus": 0.5, "diskMib": 128,
        "labels": {"task": "a", "run": "7=x", "empty": ""}})
    assert reploy_serve.client_request(create_args(egress=["api.example.org", "[::1]:8080"])) == (
        "POST", "/sessions", {"name": "n", "egress": ["api.example.org", "[::1]:8080"]})
    args = SimpleNamespace(session_action="list", label=["task=a b", "run=7"])
    assert reploy_serve.client_request(args) == ("GET", "/sessions?label=task%3Da+b&label=run%3D7", None)
    assert reploy_serve.client_request(SimpleNamespace(session_action="list", label=[])) == (
        "GET", "/sessions", None)
    for bad in ("novalue", "=v"):
        with pytest.raises(reploy_serve.UsageError, match="KEY=VALUE"):
            reploy_serve.client_request(create_args(label=[bad]))
    args = SimpleNamespace(session_action="read", id="x", offset=3, wait_ms=0)
    assert reploy_serve.client_request(args) == ("POST", "/sessions/x/read", {"offset": 3})
    args = SimpleNamespace(session_action="read", id="x", offset=0, wait_ms=500)
    assert reploy_serve.client_request(args) == ("POST", "/sessions/x/read", {"offset": 0, "waitMs": 500})
    args = SimpleNamespace(session_action="write", id="x", data="ls\r")
    assert reploy_serve.client_request(args) == ("POST", "/sessions/x/write", {"payload": "ls\r"})
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
def test_session_client_without_a_server_says_so_on_stderr(entry: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / entry), "session", "list",
                           "--server", "http://127.0.0.1:9"], capture_output=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (1, b"")
    assert proc.stderr == b"reploy: session list: no answer from http://127.0.0.1:9: [Errno 111] Connection refused\n"


@pytest.mark.parametrize(("words", "stdin", "complaint"), [
    (["write", "0123456789abcdef", "-"], b"ls \xff\r", b"stdin is not UTF-8"),  # a payload is text
    (["create", "--name", "n", "--workload-type", "agent"], b"", b"invalid choice"),  # the wire's names
    (["read", "0123456789abcdef", "--max-bytes", "4"], b"", b"unrecognized arguments"),
])
def test_session_client_usage_errors_send_nothing(words: list[str], stdin: bytes, complaint: bytes) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "reploy.py"), "session", *words, "--server",
                           "http://127.0.0.1:9"], input=stdin, capture_output=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (2, b"") and complaint in proc.stderr, proc.stderr


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


# -- the HTTP connections' threads (RequestThreads) ---------------------------------------------


def _served_by(threads: reploy_serve.RequestThreads, served: list[tuple[str, int]],
               done: threading.Semaphore, request: str) -> int:
    threads.run(request, None)
    assert done.acquire(timeout=30)
    return served[-1][1]


def test_a_new_connection_goes_to_a_thread_whose_connection_ended() -> None:
    served: list[tuple[str, int]] = []
    done = threading.Semaphore(0)

    def serve(request: Any, address: Any) -> None:
        served.append((request, threading.get_ident()))
        done.release()

    threads = reploy_serve.RequestThreads(serve, spare=1)
    first = _served_by(threads, served, done, "a")
    agent_harness.wait_until(lambda: threads.waiting == 1, "the thread to wait for a connection")
    assert _served_by(threads, served, done, "b") == first
    assert [request for request, _ in served] == ["a", "b"]
    agent_harness.wait_until(lambda: threads.waiting == 1, "the thread to wait again")
    threads.close()
    agent_harness.wait_until(lambda: all(t.ident != first for t in threading.enumerate()),
                             "the waiting thread to end at close")


def test_no_more_threads_wait_than_the_spare_bound() -> None:
    release = threading.Event()
    started = threading.Semaphore(0)
    idents: set[int] = set()

    def serve(request: Any, address: Any) -> None:
        idents.add(threading.get_ident())
        started.release()
        assert release.wait(30)

    threads = reploy_serve.RequestThreads(serve, spare=1)
    for request in range(3):  # three at once: three threads
        threads.run(request, None)
    for _ in range(3):
        assert started.acquire(timeout=30)
    assert len(idents) == 3
    release.set()
    agent_harness.wait_until(lambda: sum(t.ident in idents for t in threading.enumerate()) == 1,
                             "all but the one spare thread to end")
    assert threads.waiting == 1
    threads.close()


def test_a_session_tally_counts_each_session_and_all_and_forgets_a_session_at_zero() -> None:
    tally = reploy_serve.SessionTally()
    tally.add("a")
    tally.add("a", 4)
    tally.add("b", 2)
    assert (tally.of("a"), tally.of("b"), tally.of("c"), tally.total) == (5, 2, 0, 7)
    tally.remove("a", 5)
    assert (tally.of("a"), tally.total) == (0, 2) and "a" not in tally._held
    tally.remove("b")
    assert (tally.of("b"), tally.total) == (1, 1)
