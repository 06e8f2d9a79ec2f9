"""SessionStore: which tenant owns which session. The engine owns the sessions themselves
(rows, history, eviction); this store only answers "may this caller touch that id?".
Another tenant's session is indistinguishable from a missing one (the same 404)."""

from __future__ import annotations

from service.errors import APIError


class SessionStore:
    def __init__(self) -> None:
        self._owner: dict[str, str | None] = {}

    def add(self, session_id: str, owner: str | None) -> None:
        self._owner[session_id] = owner

    def check(self, session_id: str, owner: str | None) -> None:
        if session_id not in self._owner or self._owner[session_id] != owner:
            raise APIError(404, f"session {session_id} not found", "session_not_found", "session_id")

    def remove(self, session_id: str) -> None:
        self._owner.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._owner)
