"""SessionDB: session transcripts on disk (SQLite), so sessions outlive the process.

What is stored is exactly what rebuilding a row needs and nothing the pool owns: the token
history and the boundaries of the logical forwards that computed it. Under restored-S5 a token's
K/V on later layers depends on which forward computed it (bounded layers drop all but sink+window
between forwards), so a row rebuilt with the same forwards holds the same K/V as the row that was
lost. Each committed turn appends one record: its new tokens (input + output) and its forwards as
(prefill, decodes): one forward of `prefill` tokens, then `decodes` one-token forwards.

Sessions are stored under a fingerprint of what makes their K/V meaningful (model, weights, KV
policy); a server started with another fingerprint leaves them in the file and does not load them.

The engine process's loop is the one user of the connection (the engine is single-threaded).
WAL mode with synchronous=NORMAL: a committed turn survives a crash of the process.

One process per file: a SessionDB holds an exclusive lock (`SessionFileLock`, flock on
`<file>.lock`) for as long as it is open, so a second server on the same file fails at once
(`SessionFileBusy`) instead of both writing and each losing the other's turns. The server probes
the lock before it starts anything slow; its engine process's SessionDB then holds it.

`PostgresSessionDB` keeps the same records in PostgreSQL (`--session-db postgresql://...`), shared
by every replica of a cluster. It is `shared`: another process may commit turns of a session this
one holds in memory, so each stored session carries a `version` (bumped by every write of its
transcript) and the store remembers the version this process last read or wrote (`stale`). A turn
runs under the session's lease: a PostgreSQL advisory lock held by this process's connection
(`try_lease`, `end_lease`), so two replicas cannot run turns of one session at once, and a replica
that dies drops its leases with its connection. `open_session_db` picks the backend from the
target's form.
"""

from __future__ import annotations

import os
import sqlite3
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock (one server per file is then on the user)
    fcntl = None  # type: ignore[assignment]

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    owner TEXT,
    fingerprint TEXT NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL,
    num_tokens INTEGER NOT NULL DEFAULT 0,
    num_turns INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS turns (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    tokens BLOB NOT NULL,
    prefill INTEGER NOT NULL,
    decodes INTEGER NOT NULL,
    PRIMARY KEY (session_id, seq)
) WITHOUT ROWID;
-- stored responses of /v1/responses (engine/core/responses.py); they outlive their sessions
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT,
    session_id TEXT,
    previous_id TEXT,
    created REAL NOT NULL,
    history_len INTEGER NOT NULL,
    messages TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_session ON responses(session_id);
"""


class SessionStoreError(RuntimeError):
    """A read or write of a shared session store failed (the SQLite store raises sqlite3.Error)."""


# what a failing store raises, whichever the backend
STORE_ERRORS = (sqlite3.Error, SessionStoreError)


class SessionFileBusy(RuntimeError):
    """Another process has the session file open."""


class SessionFileLock:
    """An exclusive lock on a session file: flock on `<file>.lock` beside it, held until
    `release` (or until the process ends: the kernel drops the lock with the process, so a crash
    leaves no stale lock). The lock file itself stays; it records the holder's pid for the
    message a second process gets."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser().absolute()
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._fd: int | None = None
        if fcntl is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            raise SessionFileBusy(
                f"the session file {self.path} is in use by another s5serve process"
                f"{f' (pid {holder})' if holder.isdigit() else ''}; one server per file: stop that "
                f"server, or start this one with its own file (--session-db FILE, or --session-db "
                f"none to keep sessions in memory only)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> SessionFileLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass(frozen=True)
class StoredSession:
    session_id: str
    owner: str | None
    created: float  # wall-clock seconds
    last_used: float
    num_tokens: int
    num_turns: int


def _pack(tokens: list[int]) -> bytes:
    a = array("i", tokens)
    if a.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte C ints
        raise RuntimeError("token ids are stored as 32-bit integers")
    return a.tobytes()


def _unpack(blob: bytes) -> list[int]:
    a = array("i")
    a.frombytes(blob)
    return a.tolist()


class SessionDB:
    shared = False  # one process per file: what this process holds in memory is the truth

    def __init__(self, path: str | Path, fingerprint: str, lock: SessionFileLock | None = None) -> None:
        """`lock`: the file's lock, taken by the caller before (the engine process takes it
        before loading the model, so a second server on the file stops at once); it passes to
        this store. None: taken here (SessionFileBusy if another process has the file)."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fingerprint = fingerprint
        self._lock = lock if lock is not None else SessionFileLock(path)
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(SCHEMA)
            # a store that opens but cannot be written (a read-only file or mount) would refuse
            # every new session while the server reports ready: find out now, with a write undone
            self._db.executescript("BEGIN IMMEDIATE; CREATE TABLE write_probe (x); ROLLBACK;")
        except sqlite3.Error as err:
            self._lock.release()
            raise SessionStoreError(f"cannot use the session database {path}: {err} (fix the file or its "
                                    f"permissions, give another --session-db, or --session-db none to keep "
                                    f"sessions in memory only)") from err
        except BaseException:
            self._lock.release()
            raise

    def close(self) -> None:
        self._db.close()
        self._lock.release()

    # ---- reads (startup, and a session's first turn after it) ----------------------------------
    def load(self) -> tuple[list[StoredSession], int]:
        """This fingerprint's sessions (no tokens), and how many others the file holds."""
        rows = self._db.execute(
            "SELECT id, owner, created, last_used, num_tokens, num_turns FROM sessions WHERE fingerprint = ?",
            (self.fingerprint,)).fetchall()
        (others,) = self._db.execute("SELECT COUNT(*) FROM sessions WHERE fingerprint != ?",
                                     (self.fingerprint,)).fetchone()
        return [StoredSession(*r) for r in rows], others

    def stored_elsewhere(self, session_id: str) -> tuple[str | None, str] | None:
        """(owner, fingerprint) of a session the file holds under another fingerprint, or None."""
        return self._db.execute("SELECT owner, fingerprint FROM sessions WHERE id = ? AND fingerprint != ?",
                                (session_id, self.fingerprint)).fetchone()

    def history(self, session_id: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(tokens, forwards) of a stored session, turn records in order."""
        tokens: list[int] = []
        forwards: list[tuple[int, int]] = []
        for blob, prefill, decodes in self._db.execute(
                "SELECT tokens, prefill, decodes FROM turns WHERE session_id = ? ORDER BY seq", (session_id,)):
            tokens += _unpack(blob)
            forwards.append((prefill, decodes))
        return tokens, forwards

    # ---- writes (the engine's loop, as sessions change) ----------------------------------------
    def create(self, session_id: str, owner: str | None) -> None:
        now = time.time()
        self._db.execute("INSERT INTO sessions (id, owner, fingerprint, created, last_used) VALUES (?, ?, ?, ?, ?)",
                         (session_id, owner, self.fingerprint, now, now))

    def append_turn(self, session_id: str, seq: int, tokens: list[int], prefill: int, decodes: int,
                    num_tokens: int) -> None:
        with self._db:  # one transaction: the turn and the session's totals together
            self._db.execute("BEGIN")
            self._db.execute("INSERT INTO turns (session_id, seq, tokens, prefill, decodes) VALUES (?, ?, ?, ?, ?)",
                             (session_id, seq, _pack(tokens), prefill, decodes))
            self._db.execute("UPDATE sessions SET last_used = ?, num_tokens = ?, num_turns = ? WHERE id = ?",
                             (time.time(), num_tokens, seq + 1, session_id))

    def clear(self, session_id: str) -> None:
        """Forget the history, keep the session."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM turns WHERE session_id = ?", (session_id,))
            self._db.execute("UPDATE sessions SET num_tokens = 0, num_turns = 0, last_used = ? WHERE id = ?",
                             (time.time(), session_id))

    def delete(self, session_id: str) -> None:
        self._db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))

    def responses(self):
        """The stored responses' table on this connection (engine/core/responses.py)."""
        from engine.core.responses import sqlite_table

        return sqlite_table(self._db)


# ---- PostgreSQL: one store for every replica ------------------------------------------------------
PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS s5_sessions (
    id TEXT PRIMARY KEY,
    owner TEXT,
    fingerprint TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL,
    last_used DOUBLE PRECISION NOT NULL,
    num_tokens INTEGER NOT NULL DEFAULT 0,
    num_turns INTEGER NOT NULL DEFAULT 0,
    version BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS s5_turns (
    session_id TEXT NOT NULL REFERENCES s5_sessions(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    tokens BYTEA NOT NULL,
    prefill INTEGER NOT NULL,
    decodes INTEGER NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE TABLE IF NOT EXISTS s5_responses (
    id TEXT PRIMARY KEY,
    owner TEXT,
    session_id TEXT,
    previous_id TEXT,
    created DOUBLE PRECISION NOT NULL,
    history_len INTEGER NOT NULL,
    messages TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS s5_responses_session ON s5_responses(session_id);
"""
# Serializes the schema's creation when several replicas start at once (an advisory lock key of
# the one-argument form; session leases use the two-argument form, another key space).
_SCHEMA_LOCK = 0x5355_5345_5353


def is_postgres_url(target: str | None) -> bool:
    return bool(target) and target.split("://", 1)[0] in ("postgresql", "postgres")


def redact(target: str) -> str:
    """The target without a password, for logs and messages."""
    if not is_postgres_url(target):
        return target
    scheme, rest = target.split("://", 1)
    if "@" in rest.split("/", 1)[0]:
        creds, host = rest.split("@", 1)
        return f"{scheme}://{creds.split(':', 1)[0]}@{host}"
    return target


def _lease_key(session_id: str) -> tuple[int, int]:
    """Two signed 32-bit ints from 64 bits of the session id's hash (the advisory lock's key)."""
    import hashlib

    h = hashlib.blake2b(session_id.encode(), digest_size=8).digest()
    return int.from_bytes(h[:4], "big", signed=True), int.from_bytes(h[4:], "big", signed=True)


@dataclass(frozen=True)
class SharedSession(StoredSession):
    version: int  # bumped by every write of the transcript, whichever process made it


class PostgresSessionDB:
    """Session transcripts in PostgreSQL (psycopg 3), shared by the replicas of a cluster.

    One connection, used by the engine's loop only (the engine is single-threaded), in autocommit
    mode with explicit transactions for multi-statement writes. TCP keepalives make the server
    notice a vanished replica's connection (and drop its leases) within about half a minute; a
    replica process that dies closes its connection, and the leases go at once."""

    shared = True
    KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}

    def __init__(self, url: str, fingerprint: str) -> None:
        self.path = redact(url)  # what logs name
        self.fingerprint = fingerprint
        self._url = url
        self._seen: dict[str, int] = {}  # session id -> version this process last read or wrote
        self._conflicted: set[str] = set()  # writes refused: another process owns the transcript now
        self._db = self._connect()
        with self._errors(), self._db.transaction():
            self._db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            for statement in filter(str.strip, PG_SCHEMA.split(";")):
                self._db.execute(statement)

    def _connect(self):
        import psycopg

        try:
            return psycopg.connect(self._url, autocommit=True, connect_timeout=10, **self.KEEPALIVES)
        except psycopg.Error as exc:
            raise SessionStoreError(f"cannot connect to the session store {self.path}: {exc}") from None

    def _errors(self):
        """Translates psycopg's errors into SessionStoreError (what the engine catches)."""
        import contextlib

        import psycopg

        @contextlib.contextmanager
        def translate():
            try:
                yield
            except psycopg.Error as exc:
                raise SessionStoreError(f"{type(exc).__name__}: {exc}".strip()) from exc

        return translate()

    def close(self) -> None:
        self._db.close()  # leases held by this connection go with it

    # ---- reads ----------------------------------------------------------------------------------
    def load(self) -> tuple[list[StoredSession], int]:
        with self._errors():
            rows = self._db.execute(
                "SELECT id, owner, created, last_used, num_tokens, num_turns FROM s5_sessions "
                "WHERE fingerprint = %s", (self.fingerprint,)).fetchall()
            (others,) = self._db.execute("SELECT COUNT(*) FROM s5_sessions WHERE fingerprint != %s",
                                         (self.fingerprint,)).fetchone()
        return [StoredSession(*r) for r in rows], others

    def get(self, session_id: str) -> SharedSession | None:
        """The stored session (no tokens), or None: not stored under this fingerprint."""
        with self._errors():
            row = self._db.execute(
                "SELECT id, owner, created, last_used, num_tokens, num_turns, version FROM s5_sessions "
                "WHERE id = %s AND fingerprint = %s", (session_id, self.fingerprint)).fetchone()
        return SharedSession(*row) if row is not None else None

    def stored_elsewhere(self, session_id: str) -> tuple[str | None, str] | None:
        """(owner, fingerprint) of a session stored under another fingerprint, or None."""
        with self._errors():
            return self._db.execute("SELECT owner, fingerprint FROM s5_sessions WHERE id = %s AND fingerprint != %s",
                                    (session_id, self.fingerprint)).fetchone()

    def stale(self, session_id: str, version: int) -> bool:
        """Whether `version` is not the one this process last read or wrote."""
        return self._seen.get(session_id) != version

    def history(self, session_id: str) -> tuple[list[int], list[tuple[int, int]]]:
        tokens: list[int] = []
        forwards: list[tuple[int, int]] = []
        with self._errors(), self._db.transaction():
            self._db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            row = self._db.execute("SELECT version FROM s5_sessions WHERE id = %s", (session_id,)).fetchone()
            for blob, prefill, decodes in self._db.execute(
                    "SELECT tokens, prefill, decodes FROM s5_turns WHERE session_id = %s ORDER BY seq",
                    (session_id,)):
                tokens += _unpack(bytes(blob))
                forwards.append((prefill, decodes))
        if row is not None:
            self._seen[session_id] = row[0]
        return tokens, forwards

    # ---- leases ---------------------------------------------------------------------------------
    def try_lease(self, session_id: str) -> bool:
        """Take the session's lease for a turn; False: another process holds it."""
        with self._errors():
            (got,) = self._db.execute("SELECT pg_try_advisory_lock(%s, %s)", _lease_key(session_id)).fetchone()
        return bool(got)

    def end_lease(self, session_id: str) -> None:
        with self._errors():
            self._db.execute("SELECT pg_advisory_unlock(%s, %s)", _lease_key(session_id))

    # ---- writes ---------------------------------------------------------------------------------
    def create(self, session_id: str, owner: str | None) -> None:
        now = time.time()
        with self._errors():
            self._db.execute("INSERT INTO s5_sessions (id, owner, fingerprint, created, last_used) "
                             "VALUES (%s, %s, %s, %s, %s)", (session_id, owner, self.fingerprint, now, now))
        self._seen[session_id] = 0

    def _bump(self, session_id: str, assignments: str, args: tuple, checked: bool = True) -> None:
        """Within a transaction: one write of the transcript. `checked`: refused unless the stored
        version is the one this process last saw (another process committed meanwhile: its
        transcript wins)."""
        where, check = ("AND version = %s", (self._seen.get(session_id, -1),)) if checked else ("", ())
        row = self._db.execute(f"UPDATE s5_sessions SET {assignments}, version = version + 1 "
                               f"WHERE id = %s {where} RETURNING version", (*args, session_id, *check)).fetchone()
        if row is None:
            self._conflicted.add(session_id)
            raise SessionStoreError(f"session {session_id} was changed by another replica")
        self._seen[session_id] = row[0]

    def append_turn(self, session_id: str, seq: int, tokens: list[int], prefill: int, decodes: int,
                    num_tokens: int) -> None:
        with self._errors(), self._db.transaction():
            self._bump(session_id, "last_used = %s, num_tokens = %s, num_turns = %s",
                       (time.time(), num_tokens, seq + 1))
            self._db.execute("INSERT INTO s5_turns (session_id, seq, tokens, prefill, decodes) "
                             "VALUES (%s, %s, %s, %s, %s)", (session_id, seq, _pack(tokens), prefill, decodes))

    def clear(self, session_id: str) -> None:
        with self._errors(), self._db.transaction():
            self._bump(session_id, "num_tokens = 0, num_turns = 0, last_used = %s", (time.time(),), checked=False)
            self._db.execute("DELETE FROM s5_turns WHERE session_id = %s", (session_id,))

    def delete(self, session_id: str) -> None:
        self._seen.pop(session_id, None)
        if session_id in self._conflicted:  # a refused write: the transcript is another's, keep it
            self._conflicted.discard(session_id)
            return
        with self._errors():
            self._db.execute("DELETE FROM s5_sessions WHERE id = %s", (session_id,))

    def forget(self, session_id: str) -> None:
        """This process no longer holds the session in memory."""
        self._seen.pop(session_id, None)

    def responses(self):
        """The stored responses' table on this connection (engine/core/responses.py)."""
        from engine.core.responses import postgres_table

        return postgres_table(self._db)


def open_session_db(target: str, fingerprint: str, lock: SessionFileLock | None = None) -> SessionDB | PostgresSessionDB:
    """A PostgreSQL store for a postgresql:// (or postgres://) URL, else an SQLite file (`lock`:
    its lock, already taken: `SessionDB`)."""
    if is_postgres_url(target):
        return PostgresSessionDB(target, fingerprint)
    return SessionDB(target, fingerprint, lock)
