"""Two engines (two replicas' engine processes, in one test process) on one PostgreSQL store: a
session moves between them with its transcript, exactly; one turn at a time across both (the
lease); a deletion or another tenant's key is seen by both."""

import time

import pytest

from engine import Engine, EngineConfig, EngineError, Request
from tests.helpers import greedy, tiny_loaded
from tests.scenarios import plan

BASE = dict(model="tiny-random", kv_sink=2, kv_window=5, kv_cache_bytes=1 << 22, max_num_batched_tokens=16)


def turn(engine, sid, rid, ids, n, owner="tenant"):
    engine.add_request(Request(rid, ids, greedy(n), session_id=sid, owner=owner))
    out = []
    while engine.has_work():
        for o in engine.step():
            assert o.error is None, o.error
            out += o.new_token_ids
    engine.check_invariants()
    return out


@pytest.fixture
def replicas(postgres):
    db = postgres.database()
    a = Engine(EngineConfig(**BASE, max_rows=4, session_db=db), tiny_loaded(0))
    b = Engine(EngineConfig(**BASE, max_rows=4, session_db=db), tiny_loaded(0))
    yield a, b
    a.close()
    b.close()


def test_a_session_moves_between_replicas_exactly(replicas):
    a, b = replicas
    turns = plan(5, sessions=1, turns=5)[0]
    reference = Engine(EngineConfig(**BASE, max_rows=4), tiny_loaded(0))
    ref_sid = reference.create_session(owner="tenant")
    want = [turn(reference, ref_sid, f"r{i}", ids, n) for i, (ids, n) in enumerate(turns)]

    sid = a.create_session(owner="tenant")
    got = [turn(a, sid, "a0", *turns[0]), turn(a, sid, "a1", *turns[1])]
    got.append(turn(b, sid, "b2", *turns[2]))  # B never saw it: it takes it from the store, rebuilds the row
    assert b.session_info(sid, owner="tenant")["last_resume"]["path"] == "rebuild"
    got.append(turn(a, sid, "a3", *turns[3]))  # A's row and history are a turn behind: dropped, rebuilt
    assert a.session_info(sid, owner="tenant")["last_resume"]["path"] == "rebuild"
    got.append(turn(b, sid, "b4", *turns[4]))
    assert got == want
    assert a.session_tokens(sid, owner="tenant") == b.session_tokens(sid, owner="tenant") \
        == reference.session_tokens(ref_sid, owner="tenant")
    assert a.stats["rebuilds"] == 1 and b.stats["rebuilds"] == 2


def test_one_turn_at_a_time_across_replicas(replicas):
    a, b = replicas
    sid = a.create_session(owner="tenant")
    turn(a, sid, "a0", [5, 6, 7], 3)
    a.add_request(Request("a1", [8, 9], greedy(4), session_id=sid, owner="tenant"))  # queued: holds the lease
    with pytest.raises(EngineError) as busy:
        b.add_request(Request("b1", [10], greedy(4), session_id=sid, owner="tenant"))
    assert busy.value.code == "session_busy"
    assert b.session_info(sid, owner="tenant")["turns"] == 1  # the loser changed nothing
    while a.has_work():
        a.step()
    assert turn(b, sid, "b2", [11], 2) and b.session_info(sid, owner="tenant")["turns"] == 3
    # a turn that ends without committing gives the lease back too
    b.add_request(Request("b3", [12], greedy(8), session_id=sid, owner="tenant"))
    b.step()
    b.abort("b3")
    assert turn(a, sid, "a4", [13], 2) and a.session_info(sid, owner="tenant")["turns"] == 4


def test_tenants_and_deletions_hold_across_replicas(replicas):
    a, b = replicas
    sid = a.create_session(owner="alice")
    turn(a, sid, "a0", [5, 6, 7], 2, owner="alice")
    with pytest.raises(EngineError) as other:
        b.session_info(sid, owner="mallory")
    assert other.value.code == "session_not_found"
    with pytest.raises(EngineError) as other:
        b.add_request(Request("m", [1], greedy(1), session_id=sid, owner="mallory"))
    assert other.value.code == "session_not_found"
    assert b.close_session(sid, owner="alice")
    with pytest.raises(EngineError) as gone:
        a.session_info(sid, owner="alice")
    assert gone.value.code == "session_not_found" and sid not in a.sessions
    a.check_invariants()


def test_ttl_is_the_stores(replicas):
    a, b = replicas
    sid = a.create_session(owner="tenant")
    turn(a, sid, "a0", [5, 6, 7], 2)
    time.sleep(1.2)
    turn(b, sid, "b1", [8], 2)  # B used it just now; A's copy has been idle for over a second
    assert a.expire_idle(1.0) == [] and sid not in a.sessions  # only A's copy goes
    assert a.session_info(sid, owner="tenant")["turns"] == 2  # still there for A, from the store
    time.sleep(0.05)
    assert b.expire_idle(0.01) == [sid]  # idle everywhere: evicted and deleted
    with pytest.raises(EngineError) as gone:
        a.session_info(sid, owner="tenant")
    assert gone.value.code == "session_not_found"
