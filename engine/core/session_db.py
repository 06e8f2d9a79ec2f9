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
"""


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
    def __init__(self, path: str | Path, fingerprint: str) -> None:
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.fingerprint = fingerprint
        self._lock = SessionFileLock(path)  # SessionFileBusy if another process has the file
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(SCHEMA)
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
