"""A session table (sessions.py) on a shared store (session_db.PostgresSessionDB): what keeps it in
line with a store that other engine processes (replicas) write too.

- `refresh` before a session is looked up: a session created or continued by another replica is
  taken from the store (its row is rebuilt from the transcript on its next turn); one whose
  transcript moved on elsewhere drops its row and history here and reads them again; one deleted
  elsewhere is forgotten here.
- `begin_turn` / `end_turn` around every turn: the session's lease in the store, so two replicas
  never run turns of one session at once (the loser gets `session_busy`, a 409).
- `expired` / `expired_done`: the TTL is the store's: a replica drops its copy of a session idle
  here but used elsewhere, and evicts (deletes) only sessions idle everywhere, under their lease.

With the embedded SQLite store (one process per file) `expired` is the table's `idle_since` and
the rest do nothing.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from engine.core.session_db import STORE_ERRORS
from engine.core.types import EngineError

if TYPE_CHECKING:
    from engine.core.sessions import Session, SessionTable

log = logging.getLogger(__name__)


def _shared(table: SessionTable) -> bool:
    return table.db is not None and table.db.shared


def _store_failed(table: SessionTable, exc: Exception) -> EngineError:
    table.stats["session_db_errors"] += 1
    return EngineError(f"the session store failed: {exc}", code="session_store_unavailable")


def refresh(table: SessionTable, session_id: str) -> None:
    """Bring the table's entry for `session_id` in line with the shared store."""
    if not _shared(table):
        return
    local = table.sessions.get(session_id)
    if local is not None and local.busy is not None:
        return  # a turn of ours holds the lease: nothing else can have changed it
    try:
        stored = table.db.get(session_id)
    except STORE_ERRORS as exc:
        raise _store_failed(table, exc) from exc
    if stored is None:
        if local is not None and local.durable:
            _forget(table, local)  # deleted (or expired) by another replica
        return
    if local is None:
        from engine.core.sessions import Session

        table.sessions[session_id] = Session(
            session_id, owner=stored.owner, tokens=None, num_tokens=stored.num_tokens, num_turns=stored.num_turns,
            last_used=time.monotonic() - max(0.0, time.time() - stored.last_used))
        table.owned[stored.owner] += 1
        table.evicted.pop(session_id, None)
    elif local.tokens is not None and table.db.stale(session_id, stored.version):
        # turns committed by another replica: this row and history are behind; the next turn
        # reads the transcript and rebuilds the row from it
        table.discard(local)
        local.tokens, local.forwards = None, []
        local.num_tokens, local.num_turns = stored.num_tokens, stored.num_turns


def begin_turn(table: SessionTable, session: Session) -> None:
    """Take the session's lease for a turn about to be queued; `session_busy` if another replica
    holds it, or committed a turn since this table read the session."""
    if not _shared(table):
        return
    db = table.db
    try:
        if not db.try_lease(session.session_id):
            raise EngineError("session has a turn in flight on another replica", code="session_busy",
                              param="session_id")
        stored = db.get(session.session_id)
    except STORE_ERRORS as exc:
        raise _store_failed(table, exc) from exc
    if stored is None or (session.tokens is not None and db.stale(session.session_id, stored.version)):
        _end_lease(table, session.session_id)
        raise EngineError("another turn of this session committed while this one was prepared; retry",
                          code="session_busy", param="session_id")


def end_turn(table: SessionTable, session: Session) -> None:
    """The turn ended (committed or rolled back): give the lease back."""
    if _shared(table):
        _end_lease(table, session.session_id)


def expired(table: SessionTable, ttl_seconds: float) -> list[Session]:
    """Sessions to evict for idling longer than the TTL. On a shared store: those idle here and in
    the store (returned with their lease taken: `expired_done` gives it back), or held here only;
    a session idle here but used elsewhere is only dropped from this table."""
    if not _shared(table):
        return table.idle_since(ttl_seconds)
    now_wall = time.time()
    evict = []
    for s in table.idle_since(ttl_seconds):
        if not s.durable:  # not in the store: it lives here only
            evict.append(s)
            continue
        try:
            stored = table.db.get(s.session_id)
            leased = stored is not None and table.db.try_lease(s.session_id)
        except STORE_ERRORS as exc:
            table.stats["session_db_errors"] += 1
            log.error("session %s: the store could not be read to expire it (%s)", s.session_id, exc)
            continue
        if leased and now_wall - stored.last_used > ttl_seconds:
            evict.append(s)
            continue
        if leased:
            _end_lease(table, s.session_id)
        _forget(table, s)  # used (or in a turn) elsewhere, or already gone: only this copy goes
    return evict


def expired_done(table: SessionTable, evicted: list[Session]) -> None:
    """The sessions `expired` returned are evicted: their leases go back."""
    if _shared(table):
        for s in evicted:
            if s.durable:
                _end_lease(table, s.session_id)


def _forget(table: SessionTable, s: Session) -> None:
    """Drop the table's copy of a session; the store keeps (or already dropped) the session."""
    table.discard(s)
    del table.sessions[s.session_id]
    table.owned[s.owner] -= 1
    table.db.forget(s.session_id)


def _end_lease(table: SessionTable, session_id: str) -> None:
    try:
        table.db.end_lease(session_id)
    except STORE_ERRORS as exc:  # the connection is gone, and the lease with it
        table.stats["session_db_errors"] += 1
        log.error("session %s: giving its lease back failed (%s)", session_id, exc)
