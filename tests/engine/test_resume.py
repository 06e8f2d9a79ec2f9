"""Rows given up come back exactly: a session whose row was freed (rows ran short with no host
memory left for swapping, or the process restarted and only its SessionDB transcript remains)
gets the row rebuilt on its next turn by replaying the forwards that computed its history, and
that turn's logits equal those of a session that never left."""

import pytest

from engine import Engine, EngineConfig, EngineError, Request
from tests.helpers import greedy, tiny_loaded
from tests.scenarios import Recorder, converse, max_logit_diff, owner_of, plan

BASE = dict(model="tiny-random", kv_sink=2, kv_window=5, kv_cache_bytes=1 << 22, max_num_batched_tokens=16)


@pytest.mark.parametrize(("policy", "static"), [("s5", False), ("sink-window", False), ("s5", True)])
def test_rows_given_up_are_rebuilt_exactly(policy, static):
    """`static`: decode steps and the replayed one-token forwards take the fixed-size decode path."""
    turns = plan(1)
    roomy = Engine(EngineConfig(**BASE, kv_policy=policy, max_rows=8), tiny_loaded(0))
    tight = Engine(EngineConfig(**BASE, kv_policy=policy, max_rows=2, swap_bytes=0, decode_graphs=static),
                   tiny_loaded(0))
    rec_roomy, rec_tight = Recorder(roomy), Recorder(tight)
    want, sids_r = converse(roomy, turns)
    got, sids_t = converse(tight, turns)
    diff = max_logit_diff(rec_roomy, rec_tight, dict(zip(sids_t, sids_r)))
    if static:
        assert tight.runner.decoder.steps > 100
    print(f"\n{policy}{' static' if static else ''}: {tight.stats['rebuilds']} rows rebuilt by replaying {tight.stats['rebuild_forwards']} "
          f"forwards, {tight.stats['swaps_out']} swapped; max |logit diff| vs never left {diff:.2e}")
    assert tight.stats["rebuilds"] >= 8 and roomy.stats["rebuilds"] == 0
    assert got == want and diff < 1e-4
    assert "rebuild" in {tight.session_info(s, owner=owner_of(tight, s))["last_resume"]["path"] for s in sids_t}


def test_replaying_the_forwards_is_what_makes_it_exact():
    """The control: the same rebuild prefilled as one forward (forget the boundaries) gives other
    logits under s5, because bounded layers keep only sink+window between forwards."""
    turns = plan(2, sessions=2)
    roomy = Engine(EngineConfig(**BASE, max_rows=8), tiny_loaded(0))
    naive = Engine(EngineConfig(**BASE, max_rows=8), tiny_loaded(0))
    rec_roomy, rec_naive = Recorder(roomy), Recorder(naive)
    want, sids_r = converse(roomy, turns)

    def forget(engine, sids, r):
        if r == len(turns[0]) - 1:
            for sid in sids:
                engine.release_row(sid, owner=owner_of(engine, sid))
                engine.sessions[sid].forwards = []  # no boundaries: one forward of the whole history

    got, sids_n = converse(naive, turns, before_round=forget)
    diff = max_logit_diff(rec_roomy, rec_naive, dict(zip(sids_n, sids_r)))
    print(f"\none-forward rebuild: max |logit diff| vs never left {diff:.2e}")
    assert diff > 1e-2


def crash(engine):
    """What a crashed process leaves: nothing closed or flushed; the kernel drops its file lock
    (SQLite) or closes its connection, and the leases with it (PostgreSQL)."""
    if engine.sessions.db.shared:
        engine.sessions.db.close()
    else:
        engine.sessions.db._lock.release()


def test_sessions_survive_a_restart(session_store):
    db = session_store
    turns = plan(3, sessions=4, turns=4)
    reference = Engine(EngineConfig(**BASE, max_rows=8), tiny_loaded(0))
    rec_ref = Recorder(reference)
    want, sids_ref = converse(reference, turns)

    first = Engine(EngineConfig(**BASE, max_rows=8, session_db=db), tiny_loaded(0))
    before, sids = converse(first, turns, rounds=range(3))
    assert before == [w[:3] for w in want]
    history = {sid: first.session_tokens(sid, owner=owner_of(first, sid)) for sid in sids}
    first.add_request(Request("cut", [7, 8, 9], greedy(30), session_id=sids[0], owner=owner_of(first, sids[0])))  # in flight at the "crash"
    first.step()
    crash(first)
    del first

    restarted = Engine(EngineConfig(**BASE, max_rows=8, session_db=db), tiny_loaded(0))
    rec = Recorder(restarted)
    assert set(restarted.sessions) == set(sids)
    for i, sid in enumerate(sids):
        info = restarted.session_info(sid, owner=owner_of(restarted, sid))
        assert info["state"] == "stored" and info["history_tokens"] == len(history[sid]) and info["turns"] == 3
        assert restarted.sessions[sid].owner == f"tenant-{i % 2}"
        assert restarted.session_tokens(sid, owner=owner_of(restarted, sid)) == history[sid]  # the turn in flight left no trace
    after, _ = converse(restarted, turns, sids=sids, rounds=[3])
    diff = max_logit_diff(rec_ref, rec, dict(zip(sids, sids_ref)))
    print(f"\nrestart: {len(sids)} sessions rebuilt by replaying {restarted.stats['rebuild_forwards']} forwards; "
          f"max |logit diff| of the next turn vs never restarted {diff:.2e}")
    assert [a[0] for a in after] == [w[3] for w in want] and diff < 1e-4
    assert all(restarted.session_info(s, owner=owner_of(restarted, s))["last_resume"]["path"] == "rebuild" for s in sids)

    # closing and resetting are stored too; another KV policy does not load these sessions
    restarted.close_session(sids[0], owner=owner_of(restarted, sids[0]))
    restarted.reset_session(sids[1], owner=owner_of(restarted, sids[1]))
    restarted.close()
    again = Engine(EngineConfig(**BASE, max_rows=8, session_db=db), tiny_loaded(0))
    assert set(again.sessions) == set(sids[1:]) and again.session_tokens(sids[1], owner=owner_of(again, sids[1])) == []
    assert again.session_tokens(sids[2], owner=owner_of(again, sids[2])) == history[sids[2]] + turns[2][3][0] + after[2][0]
    assert len(again.sessions) == 3
    again.close()
    other = Engine(EngineConfig(**{**BASE, "kv_window": 6}, max_rows=8, session_db=db), tiny_loaded(0))
    assert len(other.sessions) == 0
    # there a session answers its owner that it was kept under other settings, and names them;
    # to another owner it is missing, as any other owner's session is
    with pytest.raises(EngineError, match=r"kv_window 5 \(this server: 6\)") as err:
        other.session_info(sids[2], owner=owner_of(again, sids[2]))
    assert err.value.code == "session_incompatible"
    for sid, owner in ((sids[2], "someone else"), ("0" * 32, owner_of(again, sids[2]))):
        with pytest.raises(EngineError) as err:
            other.session_info(sid, owner=owner)
        assert err.value.code == "session_not_found"
    other.close()
    back = Engine(EngineConfig(**BASE, max_rows=8, session_db=db), tiny_loaded(0))  # left as they were
    assert set(back.sessions) == set(sids[1:])
    back.close()


def test_a_failing_session_store_fails_neither_the_turn_nor_the_engine(session_store):
    import sqlite3

    from engine import EngineError
    from engine.core.session_db import SessionStoreError

    db = session_store
    engine = Engine(EngineConfig(**BASE, max_rows=4, session_db=db), tiny_loaded(0))
    turns = plan(4, sessions=2, turns=2)
    _, (broken, fine) = converse(engine, turns, rounds=[0])
    real = engine.sessions.db.append_turn

    def disk_full(session_id, *args):
        if session_id == broken:
            raise (SessionStoreError if engine.sessions.db.shared else sqlite3.OperationalError)("database or disk is full")
        return real(session_id, *args)

    engine.sessions.db.append_turn = disk_full
    out, _ = converse(engine, turns, sids=[broken, fine], rounds=[1])
    assert all(len(o[0]) == t[1][1] for o, t in zip(out, turns))  # both turns completed
    assert engine.stats["session_db_errors"] == 1
    assert not engine.session_info(broken, owner=owner_of(engine, broken))["durable"] and engine.session_info(fine, owner=owner_of(engine, fine))["durable"]
    assert len(engine.session_tokens(broken, owner=owner_of(engine, broken))) == engine.session_info(broken, owner=owner_of(engine, broken))["history_tokens"]
    failure = SessionStoreError if engine.sessions.db.shared else sqlite3.OperationalError
    engine.sessions.db.create = lambda *a: (_ for _ in ()).throw(failure("disk I/O error"))
    with pytest.raises(EngineError) as err:
        engine.create_session()
    assert err.value.code == "session_store_unavailable" and len(engine.sessions) == 2
    engine.check_invariants()
    # after a restart the session whose transcript missed a turn is gone, not half restored
    kept = engine.session_tokens(fine, owner=owner_of(engine, fine))
    engine.close()
    restarted = Engine(EngineConfig(**BASE, max_rows=4, session_db=db), tiny_loaded(0))
    assert set(restarted.sessions) == {fine}
    assert restarted.session_tokens(fine, owner=owner_of(restarted, fine)) == kept
