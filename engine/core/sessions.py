"""SessionTable: every session, its owner, its durability and where its row is.

A session's history is every token fed to the model, and every token it produced that the client
got: a turn that a stop string ended keeps its output up to the stop string (engine.py). Its row
holds K/V for all but possibly the last few (a sampled token is fed only by the next forward, and
a turn whose row computed tokens past its stop string is rolled back, its tokens left for the next
turn's prefill). The table also records the logical forwards that computed the history
(`forwards`: per turn, one prefill forward and then one-token decode forwards; (0, 0) for a turn
rolled back so), because under restored-S5 the K/V of bounded layers depends on where forwards
began and ended: a row that was given up is rebuilt exactly by replaying them.

Where a session's row is, between turns:
    resident  `row` is set: the row is in the pool
    swapped   `swapped` is set: the row was copied to host memory to free a pool row
    stored    neither: rebuilt by replay on the next turn (rows and host memory ran short, or the
              server restarted and the transcript came from the SessionDB)

A row leaves a session in one of three ways, each a method here: `give_up` (history kept, the next
turn replays it), `swap_out` (history and K/V kept in host memory) and `discard` (the session is
closed or reset). The table writes transcripts through the SessionDB; a failed write fails
neither the turn nor the engine (`store`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

from engine.core.session_db import STORE_ERRORS, PostgresSessionDB, SessionDB, StoredSession
from engine.core.session_sync import Idle, SharedStore
from engine.core.types import EngineError
from engine.kv.rows import RowPool, SwappedRow

log = logging.getLogger(__name__)

EVICTED_REMEMBERED = 100_000  # ids of sessions the engine closed, kept to say why a lookup fails


@dataclass
class Session:
    session_id: str
    owner: str | None = None  # opaque to the engine: the service's tenant, kept with the session
    # history (the last few may be uncomputed); None: still only in the SessionDB (loaded on first use)
    tokens: list[int] | None = field(default_factory=list)
    # the logical forwards that computed tokens[:kv_len]: (prefill, decodes) per turn
    forwards: list[tuple[int, int]] = field(default_factory=list)
    num_tokens: int = 0  # len(tokens), also while tokens is None
    row: int | None = None  # None: swapped or stored (see the module's docstring)
    swapped: SwappedRow | None = None  # the row, in host memory, while the session waits for one
    busy: str | None = None  # request id of the turn in flight
    num_turns: int = 0
    num_evictions: int = 0  # rows given up (swapped out or released)
    last_used: float = field(default_factory=time.monotonic)
    last_resume: dict | None = None  # how the row came back last time: swap-in or rebuild
    durable: bool = True  # its transcript is in the SessionDB (False after a failed write)


def fingerprint(model_name: str, config, vocab_size: int, kv_windows: tuple[int, ...] | None = None) -> str:
    """What a stored session's K/V depends on besides its tokens (`kv_windows`: the per-layer
    windows in force, if any)."""
    key = {"model": model_name, "dtype": config.dtype, "quantization": config.quantization,
           "kv_policy": config.kv_policy, "kv_sink": config.kv_sink, "kv_window": config.kv_window,
           "vocab": vocab_size}
    if kv_windows is not None:
        key["kv_windows"] = list(kv_windows)
    return json.dumps(key, sort_keys=True)


class SessionTable:
    def __init__(self, pool: RowPool, swap_bytes: int, stats: dict[str, int],
                 db: SessionDB | PostgresSessionDB | None = None) -> None:
        """`stats`: the engine's counters, which the table adds its events to."""
        self.pool = pool
        self.swap_bytes = swap_bytes  # most host bytes swapped rows may take
        self.stats = stats
        self.db = db
        self.sessions: dict[str, Session] = {}
        self.owned: Counter[str | None] = Counter()  # owner -> sessions held
        # sessions closed by the engine (LRU when rows ran out, or idle TTL): id -> reason.
        # Bounded; a later lookup of such an id raises `session_evicted`.
        self.evicted: OrderedDict[str, str] = OrderedDict()
        self.swapped_bytes = 0  # host bytes of swapped rows
        self.sync = SharedStore(db, stats)  # asked only where the store is shared by replicas
        if db is not None:
            self._load()

    def __len__(self) -> int:
        return len(self.sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.sessions

    def __iter__(self) -> Iterator[str]:
        return iter(self.sessions)

    def __getitem__(self, session_id: str) -> Session:
        return self.sessions[session_id]

    def values(self):
        return self.sessions.values()

    def close(self) -> None:
        """Release the SessionDB connection; the table is unusable after."""
        if self.db is not None:
            self.db.close()
            self.db = None

    def _load(self) -> None:
        stored, others = self.db.load()
        for st in stored:
            self._adopt(st)
        log.info("session store %s: %d sessions loaded", self.db.path, len(stored))
        if others:
            log.warning("session store %s: %d sessions stored under another model or KV policy are left as they "
                        "are (they answer session_incompatible here; a server started with their settings "
                        "serves them)", self.db.path, others)

    def _adopt(self, st: StoredSession) -> None:
        """A stored session enters the table; its history is read on its first turn."""
        last_used = time.monotonic() - max(0.0, time.time() - st.last_used)
        self.sessions[st.session_id] = Session(st.session_id, owner=st.owner, tokens=None, num_tokens=st.num_tokens,
                                               num_turns=st.num_turns, last_used=last_used)
        self.owned[st.owner] += 1
        self.evicted.pop(st.session_id, None)

    def _forget(self, s: Session) -> None:
        """Drop this table's copy of a session; the shared store keeps (or already dropped) it."""
        self.discard(s)
        del self.sessions[s.session_id]
        self.owned[s.owner] -= 1
        self.db.forget(s.session_id)

    # ---- a store shared by replicas ----------------------------------------------------------
    def refresh(self, session_id: str) -> None:
        """Bring the entry for `session_id` in line with a shared store: adopt a session created
        or continued elsewhere, forget one deleted elsewhere, and drop the row and history of one
        whose transcript moved on elsewhere (the next turn reads it and rebuilds the row)."""
        if not self.sync.shared:
            return
        local = self.sessions.get(session_id)
        if local is not None and local.busy is not None:
            return  # a turn of ours holds the lease: nothing else can have changed it
        stored = self.sync.read(session_id)
        if stored is None:
            if local is not None and local.durable:
                self._forget(local)
        elif local is None:
            self._adopt(stored)
        elif local.tokens is not None and self.sync.changed_elsewhere(session_id, stored.version):
            self.discard(local)
            local.tokens, local.forwards = None, []
            local.num_tokens, local.num_turns = stored.num_tokens, stored.num_turns

    def begin_turn(self, s: Session) -> None:
        """The session's lease for a turn about to be queued (`session_busy` if another replica
        holds it or committed a turn since this table read the session)."""
        self.sync.begin_turn(s.session_id, history_loaded=s.tokens is not None)

    def end_turn(self, s: Session) -> None:
        self.sync.end_turn(s.session_id)

    def expired(self, ttl_seconds: float) -> list[Session]:
        """Sessions to evict for idling longer than the TTL. On a shared store: those idle here and
        in the store (returned under their lease: `expired_done` gives it back) or held here only;
        a session idle here but used elsewhere is only dropped from this table."""
        if not self.sync.shared:
            return self.idle_since(ttl_seconds)
        evict = []
        for s in self.idle_since(ttl_seconds):
            verdict = self.sync.claim_idle(s.session_id, ttl_seconds) if s.durable else Idle.EVICT
            if verdict is Idle.EVICT:
                evict.append(s)
            elif verdict is Idle.FORGET:
                self._forget(s)
        return evict

    def expired_done(self, evicted: list[Session]) -> None:
        """The sessions `expired` returned are evicted: their leases go back."""
        for s in evicted:
            if s.durable:
                self.sync.end_turn(s.session_id)

    # ---- lookup -------------------------------------------------------------------------------
    def find(self, session_id: str) -> Session | None:
        return self.sessions.get(session_id)

    def get(self, session_id: str, owner: str | None) -> Session:
        """The session, for its owner: another owner's session is indistinguishable from a
        missing one."""
        self.refresh(session_id)
        s = self.sessions.get(session_id)
        if s is not None and s.owner != owner:
            s = None
        elif s is None and session_id in self.evicted:
            raise EngineError(f"session {session_id} was evicted ({self.evicted[session_id]})",
                              code="session_evicted", param="session_id")
        if s is None:
            self._check_stored_elsewhere(session_id, owner)
            raise EngineError(f"session {session_id} not found", code="session_not_found", param="session_id")
        return s

    def _stored_elsewhere(self, session_id: str, owner: str | None) -> str | None:
        """For a session of `owner` that the store holds under another model or KV policy (a
        server started with those settings serves it), the settings that differ; else None."""
        if self.db is None:
            return None
        try:
            found = self.db.stored_elsewhere(session_id)
        except STORE_ERRORS:
            return None
        if found is None or found[0] != owner:
            return None
        theirs, ours = json.loads(found[1]), json.loads(self.db.fingerprint)
        differ = ", ".join(f"{k} {theirs.get(k)} (this server: {ours.get(k)})"
                           for k in sorted(theirs.keys() | ours.keys()) if theirs.get(k) != ours.get(k))
        return differ or None

    def _check_stored_elsewhere(self, session_id: str, owner: str | None) -> None:
        """`session_incompatible`, naming the settings, for a session stored under others."""
        differ = self._stored_elsewhere(session_id, owner)
        if differ is not None:
            raise EngineError(f"session {session_id} was stored under other settings: {differ}; a server started "
                              f"with them serves it", code="session_incompatible", param="session_id")

    def delete_stored_elsewhere(self, session_id: str, owner: str | None) -> bool:
        """Delete a session of `owner` stored under other settings from the store (its owner
        asked); whether there was one."""
        if self._stored_elsewhere(session_id, owner) is None:
            return False
        try:
            self.db.delete(session_id)
        except STORE_ERRORS as exc:
            self.stats["session_db_errors"] += 1
            raise EngineError(f"the session store failed: {exc}", code="session_store_unavailable") from exc
        return True

    def history(self, s: Session) -> list[int]:
        if s.tokens is None:  # first use since the server started: read the transcript
            try:
                s.tokens, s.forwards = self.db.history(s.session_id)
            except STORE_ERRORS as exc:
                self.stats["session_db_errors"] += 1
                raise EngineError(f"the session store failed: {exc}", code="session_store_unavailable") from exc
            s.num_tokens = len(s.tokens)
        return s.tokens

    def info(self, s: Session) -> dict:
        kv = self.pool.resident_kv_bytes(s.row) if s.row is not None else {"total": 0}
        kv_tokens = self.pool.kv_len(s.row) if s.row is not None else (s.swapped.kv_len if s.swapped else 0)
        state = "resident" if s.row is not None else ("swapped" if s.swapped is not None else "stored")
        return {
            "id": s.session_id,
            "history_tokens": s.num_tokens,
            "kv_tokens": kv_tokens,
            "resident_kv_bytes": kv["total"],
            "resident_kv": kv,
            "host_kv_bytes": s.swapped.nbytes if s.swapped is not None else 0,
            "idle_seconds": 0.0 if s.busy else time.monotonic() - s.last_used,
            "state": "busy" if s.busy else state,
            "turns": s.num_turns,
            "evictions": s.num_evictions,
            "last_resume": s.last_resume,
            "durable": self.db is not None and s.durable,  # its transcript survives a restart
        }

    # ---- lifecycle ----------------------------------------------------------------------------
    def create(self, session_id: str | None, owner: str | None, max_per_owner: int | None) -> str:
        """A new session of `owner`; refused (`too_many_sessions`) when the owner already holds
        `max_per_owner` sessions."""
        sid = session_id or uuid.uuid4().hex  # 128 random bits
        if sid in self.sessions or sid in self.evicted:
            raise EngineError(f"session {sid} exists", code="session_exists")
        if max_per_owner is not None and self.owned[owner] >= max_per_owner:
            raise EngineError(f"this key holds {self.owned[owner]} sessions, the most allowed; delete some "
                              "(DELETE /v1/sessions/{id}) or let idle ones expire", code="too_many_sessions")
        if self.db is not None:
            try:
                self.db.create(sid, owner)
            except STORE_ERRORS as exc:
                self.stats["session_db_errors"] += 1
                raise EngineError(f"the session store failed: {exc}", code="session_store_unavailable") from exc
        self.sessions[sid] = Session(sid, owner=owner)
        self.owned[owner] += 1
        return sid

    def remove(self, s: Session, evicted_because: str | None = None) -> None:
        """Forget an idle session: its row, its swapped copy and its transcript. `evicted_because`:
        the engine closed it (a later lookup says why)."""
        assert s.busy is None, "a session with a turn in flight is removed after the turn ends"
        self.discard(s)
        del self.sessions[s.session_id]
        self.owned[s.owner] -= 1
        self.store(s, self.db.delete if self.db else None, s.session_id)
        if evicted_because is not None:
            self.evicted[s.session_id] = evicted_because
            while len(self.evicted) > EVICTED_REMEMBERED:
                self.evicted.popitem(last=False)
            self.stats["evictions"] += 1

    def reset(self, s: Session) -> None:
        """Forget the history (the row is emptied)."""
        if s.busy is not None:
            raise EngineError("session has a turn in flight", code="session_busy")
        self.discard(s)
        s.tokens, s.forwards, s.num_tokens = [], [], 0
        self.store(s, self.db.clear if self.db else None, s.session_id)

    def commit_turn(self, s: Session, history_len: int, new: list[int], last_prefill: int, num_decodes: int) -> None:
        """A completed turn: `new` (its input and output) follows the first `history_len` tokens,
        computed by one forward of `last_prefill` tokens and `num_decodes` one-token forwards."""
        s.tokens = s.tokens[:history_len] + new
        s.num_tokens = len(s.tokens)
        self.store(s, self.db.append_turn if self.db else None, s.session_id,
                   len(s.forwards), new, last_prefill, num_decodes, s.num_tokens)
        s.forwards.append((last_prefill, num_decodes))
        s.num_turns += 1

    def idle_since(self, ttl_seconds: float) -> list[Session]:
        """Sessions without a turn, idle for longer than `ttl_seconds`."""
        now = time.monotonic()
        return [s for s in self.sessions.values() if s.busy is None and now - s.last_used > ttl_seconds]

    def store(self, s: Session, write: Callable | None, *args) -> None:
        """A write of a session's transcript. A failure (disk full, a locked or broken file) fails
        neither the turn nor the engine: the session goes on in memory only, and its transcript is
        removed from the file, so a restart cannot bring back a history that misses turns."""
        if write is None or not s.durable:
            return
        try:
            write(*args)
        except STORE_ERRORS as exc:
            self.stats["session_db_errors"] += 1
            s.durable = False
            log.error("session %s: writing its transcript failed (%s); it continues in memory only",
                      s.session_id, exc)
            try:
                self.db.delete(s.session_id)
            except STORE_ERRORS:
                log.error("session %s: its stale transcript could not be removed either", s.session_id)

    # ---- rows ---------------------------------------------------------------------------------
    def give_up(self, s: Session) -> None:
        """Free the row, keep the history: the next turn rebuilds the row by replay."""
        self.pool.free_row(s.row)
        s.row = None
        s.num_evictions += 1
        self.stats["rows_released"] += 1

    def swap_out(self, s: Session) -> None:
        """Move the row to host memory: the next turn brings it back exactly, no recompute."""
        s.swapped = self.pool.swap_out(s.row)
        s.row = None
        s.num_evictions += 1
        self.swapped_bytes += s.swapped.nbytes
        self.stats["swaps_out"] += 1

    def discard(self, s: Session) -> None:
        """Drop the row and any swapped copy (the history is the caller's to keep or clear)."""
        if s.row is not None:
            self.pool.free_row(s.row)
            s.row = None
        self._drop_swapped(s)

    def _drop_swapped(self, s: Session) -> None:
        if s.swapped is not None:
            self.swapped_bytes -= s.swapped.nbytes
            s.swapped = None

    def make_room(self, running: Collection[str]) -> bool:
        """Rows or KV blocks ran out: the least recently used idle session that holds a row gives
        it up. Its row moves to host memory while swapped rows fit in `swap_bytes`; otherwise it
        is freed (the next turn replays the history). `running`: request ids of turns that use
        their row now; a session whose turn is still queued is idle too (without that, rows held
        by queued turns behind the one being admitted would never come free). False: no row can
        be freed."""
        idle = [s for s in self.sessions.values() if s.row is not None and s.busy not in running]
        if not idle:
            return False
        victim = min(idle, key=lambda s: (s.busy is not None, s.last_used))
        # a queued turn planned its feed from this row's length: that row must come back as it was
        if victim.busy is not None or self.swapped_bytes + self.pool.swap_nbytes(victim.row) <= self.swap_bytes:
            self.swap_out(victim)
        else:
            self.give_up(victim)
        return True

    def take_row(self, s: Session, max_len: int, replayed: int, history_len: int) -> tuple[int, bool]:
        """The session's row for a turn that may reach `max_len` positions: its resident row, its
        swapped row brought back, or a new row (to be rebuilt from `replayed` forwards of
        `history_len` tokens, where there is a history). (row, is_new). The caller checked that
        the pool can give what this takes, and reserves the turn's blocks."""
        if s.row is not None:
            row, new = s.row, False
        elif s.swapped is not None:
            s.last_resume = {"path": "swap-in", "tokens": s.swapped.kv_len, "forwards": 0}
            row = s.row = self.pool.swap_in(s.swapped, max_len)
            self._drop_swapped(s)
            self.stats["swaps_in"] += 1
            new = False
        else:
            row = s.row = self.pool.allocate_row()
            new = True
            if replayed or history_len:
                s.last_resume = {"path": "rebuild", "tokens": history_len, "forwards": replayed + 1}
                self.stats["rebuilds"] += 1
                self.stats["rebuild_forwards"] += replayed
        return row, new

    def rows(self) -> list[int]:
        return [s.row for s in self.sessions.values() if s.row is not None]
