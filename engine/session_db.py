"""SessionDB: session transcripts on disk (SQLite), so sessions outlive the process.

What is stored is exactly what rebuilding a row needs and nothing the pool owns: the token
history and the boundaries of the logical forwards that computed it. Under restored-S5 a token's
K/V on later layers depends on which forward computed it (bounded layers drop all but sink+window
between forwards), so a row rebuilt with the same forwards holds the same K/V as the row that was
lost. Each committed turn appends one record: its new tokens (input + output) and its forwards as
(prefill, decodes): one forward of `prefill` tokens, then `decodes` one-token forwards.

Sessions are stored under a fingerprint of what makes their K/V meaningful (model, weights, KV
policy); a server started with another fingerprint leaves them in the file and does not load them.

One engine thread uses the connection (the engine is single-threaded). WAL mode with
synchronous=NORMAL: a committed turn survives a crash of the process.
"""

from __future__ import annotations

import sqlite3
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

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
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        self._db.close()

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

    # ---- writes (the engine thread, as sessions change) ----------------------------------------
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
