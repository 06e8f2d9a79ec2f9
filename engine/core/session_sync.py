"""SharedStore: what a session table (sessions.py) asks of a store that other engine processes
(replicas) write too (session_db.PostgresSessionDB). It reads and leases; it never edits the
table: the table applies what it answers.

- `read` before a session is looked up: the table adopts a session created or continued by
  another replica, drops its row when the transcript moved on elsewhere (`changed_elsewhere`),
  or forgets a session deleted elsewhere.
- `begin_turn` / `end_turn` around every turn: the session's lease in the store, so two replicas
  never run turns of one session at once (the loser gets `session_busy`, a 409).
- `claim_idle`: the TTL is the store's: a replica drops its copy of a session idle here but used
  elsewhere, and evicts (deletes) only sessions idle everywhere, under their lease.

With the embedded SQLite store (one process per file) `shared` is False and the table asks
nothing of this object.
"""

from __future__ import annotations

import enum
import logging
import time

from engine.core.session_db import STORE_ERRORS, PostgresSessionDB, SessionDB, SharedSession
from engine.core.types import EngineError

log = logging.getLogger(__name__)


class Idle(enum.Enum):
    """What to do with a session idle here past the TTL (`SharedStore.claim_idle`)."""

    EVICT = "evict"  # idle everywhere: evict it, under the lease now held (`end_turn` after)
    FORGET = "forget"  # used elsewhere, or gone from the store: drop only this table's copy
    KEEP = "keep"  # the store could not be read: decide on a later pass


class SharedStore:
    def __init__(self, db: SessionDB | PostgresSessionDB | None, stats: dict[str, int]) -> None:
        """`db`: the table's store (the table owns and closes it); `stats`: the engine's counters."""
        self.shared = db is not None and db.shared
        self._db = db
        self._stats = stats

    def _failed(self, exc: Exception) -> EngineError:
        self._stats["session_db_errors"] += 1
        return EngineError(f"the session store failed: {exc}", code="session_store_unavailable")

    def read(self, session_id: str) -> SharedSession | None:
        """The store's record of the session; None if it has none."""
        try:
            return self._db.get(session_id)
        except STORE_ERRORS as exc:
            raise self._failed(exc) from exc

    def changed_elsewhere(self, session_id: str, version: int) -> bool:
        """Whether turns were committed to the session since this process last read or wrote it."""
        return self._db.stale(session_id, version)

    def begin_turn(self, session_id: str, history_loaded: bool) -> None:
        """Take the session's lease for a turn about to be queued; `session_busy` if another
        replica holds it, or (`history_loaded`: this table holds the history) committed a turn
        since this table read the session."""
        if not self.shared:
            return
        try:
            if not self._db.try_lease(session_id):
                raise EngineError("session has a turn in flight on another replica", code="session_busy",
                                  param="session_id")
            stored = self._db.get(session_id)
        except STORE_ERRORS as exc:
            raise self._failed(exc) from exc
        if stored is None or (history_loaded and self._db.stale(session_id, stored.version)):
            self.end_turn(session_id)
            raise EngineError("another turn of this session committed while this one was prepared; retry",
                              code="session_busy", param="session_id")

    def end_turn(self, session_id: str) -> None:
        """The turn ended (committed or rolled back), or an eviction did: give the lease back."""
        if not self.shared:
            return
        try:
            self._db.end_lease(session_id)
        except STORE_ERRORS as exc:  # the connection is gone, and the lease with it
            self._stats["session_db_errors"] += 1
            log.error("session %s: giving its lease back failed (%s)", session_id, exc)

    def claim_idle(self, session_id: str, ttl_seconds: float) -> Idle:
        """A stored session idle here past the TTL: EVICT (with its lease taken) if it is idle in
        the store too, FORGET this copy if it was used elsewhere or is gone, KEEP if the store
        cannot say."""
        try:
            stored = self._db.get(session_id)
            leased = stored is not None and self._db.try_lease(session_id)
        except STORE_ERRORS as exc:
            self._stats["session_db_errors"] += 1
            log.error("session %s: the store could not be read to expire it (%s)", session_id, exc)
            return Idle.KEEP
        if leased and time.time() - stored.last_used > ttl_seconds:
            return Idle.EVICT
        if leased:
            self.end_turn(session_id)
        return Idle.FORGET
