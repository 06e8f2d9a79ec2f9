"""Stored responses (engine/core/responses.py) on each session store backend, an SQLite file and a
real PostgreSQL database: a record reads back as written, for its owner only, survives the store
being closed and opened again (a restart), chains back to the conversation's first response, and
deleting the last response of a session names that session."""

import pytest

from engine.core.responses import ResponseStore
from engine.core.session_db import open_session_db


def record(rid, session_id, previous_id=None, owner="tenant-a", history_len=10):
    return {"id": rid, "owner": owner, "session_id": session_id, "previous_id": previous_id,
            "history_len": history_len, "messages": [{"role": "user", "content": f"question of {rid}"}],
            "body": {"id": rid, "object": "response", "output": [], "metadata": {"k": "v"}}}


def opened(target):
    db = open_session_db(target, "fingerprint")
    return db, ResponseStore(db.responses(), {"session_db_errors": 0})


@pytest.mark.parametrize("owner", ["tenant-a", None])  # None: the server runs without API keys
def test_records_round_trip_per_owner_and_survive_a_restart(session_store, owner):
    db, store = opened(session_store)
    first, second = record("resp_1", "s1", owner=owner), record("resp_2", "s1", "resp_1", owner=owner, history_len=25)
    store.put_response(first)
    store.put_response(second)
    other = "tenant-b" if owner is not None else "tenant-a"
    assert store.get_response("resp_1", other) is None  # another key's response is a missing one
    db.close()

    db, store = opened(session_store)  # a restart
    got = store.get_response("resp_2", owner)
    assert {k: got[k] for k in second} == second and got["created"] > 0
    chain, whole = store.response_chain("resp_2", owner)
    assert [r["id"] for r in chain] == ["resp_1", "resp_2"] and whole
    assert store.response_chain("resp_2", other) == ([], True)
    db.close()


def test_deleting_names_the_session_no_response_refers_to(session_store):
    db, store = opened(session_store)
    for rec in (record("resp_1", "s1"), record("resp_2", "s1", "resp_1"), record("resp_3", "s2", "resp_1")):
        store.put_response(rec)
    assert store.delete_response("resp_2", "tenant-b") == (False, None)  # not this owner's
    assert store.delete_response("resp_2", "tenant-a") == (True, None)  # resp_1 still refers to s1
    assert store.delete_response("resp_2", "tenant-a") == (False, None)
    # resp_3 continued resp_1 (a branch, in its own session): its chain now misses a response
    assert store.delete_response("resp_1", "tenant-a") == (True, "s1")
    chain, whole = store.response_chain("resp_3", "tenant-a")
    assert [r["id"] for r in chain] == ["resp_3"] and not whole
    db.close()
