"""Optional API keys. Each key is a tenant: sessions belong to the key that created them."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from service.errors import APIError


async def tenant(request: Request) -> str | None:
    """FastAPI dependency: the caller's tenant id (None when auth is off); 401 on a bad key.
    A coroutine, so FastAPI runs it on the event loop (a plain function costs a thread hop)."""
    keys = request.app.state.s5.settings.api_keys
    if not keys:
        return None
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise APIError(401, "missing API key (Authorization: Bearer ...)", "invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    match = None
    for key in keys:  # compare against every key, in constant time each
        if hmac.compare_digest(key.encode(), given.strip().encode()):
            match = key
    if match is None:
        raise APIError(401, "invalid API key", "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return hashlib.sha256(match.encode()).hexdigest()[:16]
