"""Stored responses of the OpenAI Responses API (`/v1/responses`, service/routes/responses.py).

A stored response is a record beside the session whose row holds its conversation: its owner
(the API key's tenant), the session, the session's history length once the response's turn
committed (`history_len`: the response is the session's latest while the session still holds
exactly that many tokens), the response it continued, the input messages it added (in the form
the chat template takes) and the response object as the API answers it.

Records live where transcripts live: in the session store's `responses` table (SQLite, or
`s5_responses` in PostgreSQL, shared by the replicas; the schemas are in session_db.py), so they
survive a restart; without a session store (`--session-db none`), in this process's memory. They are written and read through
the engine's verbs (`put_response`, `get_response`, `response_chain`, `delete_response`), on the
engine's loop, the one user of the store's connection. A record outlives its session (the TTL may
evict the session): the front end then rebuilds the conversation from the chain of records.
"""

from __future__ import annotations

import json
import time
from typing import Any

from engine.core.session_db import STORE_ERRORS, SessionStoreError
from engine.core.types import EngineError

# the columns of a record, in the order the tables hold them
FIELDS = ("id", "owner", "session_id", "previous_id", "created", "history_len", "messages", "body")

MAX_CHAIN = 10_000  # responses followed back from one response (a guard against a cycle of ids)


class _Table:
    """The records in an SQL table: SQLite (`?` parameters) or PostgreSQL (`%s`, psycopg errors
    turned into SessionStoreError, what the engine catches)."""

    def __init__(self, conn, table: str, mark: str, same: str) -> None:
        self._conn = conn
        self._table = table
        self._mark = mark  # the driver's parameter marker
        self._same = same  # NULL-safe equality (owners are NULL without API keys)

    def _run(self, sql: str, args: tuple = ()) -> tuple[list, int]:
        """(the rows a query returns, the rows a write changed)."""
        sql = sql.replace("{t}", self._table).replace("?", self._mark).replace("IS_SAME", self._same)
        try:
            cur = self._conn.execute(sql, args)
            return (cur.fetchall() if cur.description is not None else []), cur.rowcount
        except STORE_ERRORS:
            raise
        except Exception as exc:  # psycopg's errors
            if type(exc).__module__.split(".")[0] == "psycopg":
                raise SessionStoreError(f"{type(exc).__name__}: {exc}".strip()) from exc
            raise

    def put(self, rec: dict) -> None:
        row = tuple(json.dumps(rec[k]) if k in ("messages", "body") else rec[k] for k in FIELDS)
        self._run(f"INSERT INTO {{t}} ({', '.join(FIELDS)}) VALUES ({', '.join('?' * len(FIELDS))})", row)

    def get(self, response_id: str, owner: str | None) -> dict | None:
        rows, _ = self._run(f"SELECT {', '.join(FIELDS)} FROM {{t}} WHERE id = ? AND owner IS_SAME ?",
                            (response_id, owner))
        if not rows:
            return None
        rec = dict(zip(FIELDS, rows[0]))
        rec["messages"], rec["body"] = json.loads(rec["messages"]), json.loads(rec["body"])
        return rec

    def delete(self, response_id: str, owner: str | None) -> bool:
        return self._run("DELETE FROM {t} WHERE id = ? AND owner IS_SAME ?", (response_id, owner))[1] > 0

    def uses(self, session_id: str) -> int:
        return self._run("SELECT COUNT(*) FROM {t} WHERE session_id = ?", (session_id,))[0][0][0]


def sqlite_table(conn) -> _Table:
    return _Table(conn, "responses", "?", "IS")


def postgres_table(conn) -> _Table:
    return _Table(conn, "s5_responses", "%s", "IS NOT DISTINCT FROM")


class _Memory:
    """The records in this process's memory (no session store)."""

    def __init__(self) -> None:
        self._records: dict[str, dict] = {}

    def put(self, rec: dict) -> None:
        self._records[rec["id"]] = json.loads(json.dumps(rec))  # a copy, as a store would keep

    def get(self, response_id: str, owner: str | None) -> dict | None:
        rec = self._records.get(response_id)
        return json.loads(json.dumps(rec)) if rec is not None and rec["owner"] == owner else None

    def delete(self, response_id: str, owner: str | None) -> bool:
        if self.get(response_id, owner) is None:
            return False
        del self._records[response_id]
        return True

    def uses(self, session_id: str) -> int:
        return sum(r["session_id"] == session_id for r in self._records.values())


class ResponseStore:
    """The engine's verbs on stored responses. `table`: the session store's responses table, or
    None to keep them in memory."""

    def __init__(self, table: _Table | None, stats: dict[str, int]) -> None:
        self._table = table if table is not None else _Memory()
        self._stats = stats  # the engine's counters (store failures count as session_db_errors)

    def _store(self, fn, *args):
        try:
            return fn(*args)
        except STORE_ERRORS as exc:
            self._stats["session_db_errors"] += 1
            raise EngineError(f"the session store failed: {exc}", code="session_store_unavailable") from exc

    def put_response(self, record: dict[str, Any]) -> None:
        """Store a response (`FIELDS`; `created` is set here)."""
        missing = [k for k in FIELDS if k != "created" and k not in record]
        if missing:
            raise EngineError(f"a response record lacks {missing}")
        self._store(self._table.put, {**record, "created": time.time()})

    def get_response(self, response_id: str, owner: str | None) -> dict | None:
        """The record, for its owner only; None: no such response of this owner."""
        return self._store(self._table.get, response_id, owner)

    def response_chain(self, response_id: str, owner: str | None) -> tuple[list[dict], bool]:
        """The records from the conversation's first response to `response_id` (oldest first),
        and whether the chain is whole (False: a response on the way was deleted). ([], True)
        when `response_id` itself is not this owner's."""
        chain: list[dict] = []
        rid: str | None = response_id
        while rid is not None and len(chain) < MAX_CHAIN:
            rec = self.get_response(rid, owner)
            if rec is None:
                return chain[::-1], not chain
            chain.append(rec)
            rid = rec["previous_id"]
        return chain[::-1], rid is None

    def delete_response(self, response_id: str, owner: str | None) -> tuple[bool, str | None]:
        """(deleted, the session no stored response refers to any more, if this left one)."""
        rec = self.get_response(response_id, owner)
        if rec is None or not self._store(self._table.delete, response_id, owner):
            return False, None
        sid = rec["session_id"]
        orphan = sid if sid is not None and self._store(self._table.uses, sid) == 0 else None
        return True, orphan
