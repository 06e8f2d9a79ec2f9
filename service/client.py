"""Python SDK for s5serve: `Client` (sync) and `AsyncClient`, sharing one SSE parser.

    from service.client import Client
    with Client("http://127.0.0.1:8000") as c, c.create_session() as s:
        for text in s.generate("My name is Ada.", max_tokens=32):
            print(text, end="", flush=True)
        print(s.info()["history_tokens"])

Leaving a `generate` iterator early closes the stream, which cancels the turn on the server
(the session rolls back to its last completed turn). Errors raise `S5Error` subclasses.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import httpx


class S5Error(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


class BadRequest(S5Error): ...
class AuthenticationError(S5Error): ...
class NotFound(S5Error): ...
class SessionBusy(S5Error): ...
class SessionEvicted(S5Error): ...
class RateLimited(S5Error): ...
class Unavailable(S5Error): ...
class GenerationFailed(S5Error): ...


_BY_STATUS = {400: BadRequest, 401: AuthenticationError, 404: NotFound, 409: SessionBusy,
              410: SessionEvicted, 413: BadRequest, 429: RateLimited, 503: Unavailable}


def _error(status: int, body: Any) -> S5Error:
    err = body.get("error", {}) if isinstance(body, dict) else {}
    cls = _BY_STATUS.get(status, S5Error)
    return cls(status, err.get("code") or "error", err.get("message") or str(body))


class SSEParser:
    """Feed SSE lines; get decoded `data:` payloads. `done` turns True at [DONE]. An in-band
    error event raises GenerationFailed. Shared by the sync and async clients."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self.done = False

    def feed(self, line: str) -> list[Any]:
        if self.done:
            return []
        if line.startswith("data:"):
            self._data.append(line[5:].lstrip(" "))
            return []
        if line != "" or not self._data:
            return []  # comments, other fields, keep-alives
        payload, self._data = "\n".join(self._data), []
        if payload == "[DONE]":
            self.done = True
            return []
        obj = json.loads(payload)
        if isinstance(obj, dict) and "error" in obj and "object" not in obj and "type" not in obj:
            err = obj["error"]
            raise GenerationFailed(200, err.get("code") or "error", err.get("message") or "")
        return [obj]


def parse_sse(lines: Iterable[str]) -> Iterator[Any]:
    parser = SSEParser()
    for line in lines:
        yield from parser.feed(line)
        if parser.done:
            return


def _gen_body(input: str | list[int] | None, messages: list[dict] | None, params: dict) -> dict:
    body = {"stream": True, **params}
    if messages is not None:
        body["messages"] = messages
    else:
        body["input"] = input
    return body


class Session:
    def __init__(self, client: "Client", session_id: str):
        self.client, self.id = client, session_id

    def generate(self, input: str | list[int] | None = None, *, messages: list[dict] | None = None,
                 **params: Any) -> Iterator[str]:
        """Append input (text, token ids, or chat messages) and stream the reply's text deltas."""
        for ev in self.client._stream(f"/v1/sessions/{self.id}/generate", _gen_body(input, messages, params)):
            if ev.get("type") == "token":
                yield ev["text"]
            elif ev.get("type") == "done":
                self.last = ev

    def info(self) -> dict:
        return self.client._json("GET", f"/v1/sessions/{self.id}")

    def close(self) -> None:
        self.client._json("DELETE", f"/v1/sessions/{self.id}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Client:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, timeout: float = 600):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)

    def _json(self, method: str, path: str, body: dict | None = None) -> Any:
        r = self.http.request(method, path, json=body)
        if r.status_code >= 400:
            raise _error(r.status_code, _safe_json(r))
        return r.json()

    def _stream(self, path: str, body: dict) -> Iterator[Any]:
        with self.http.stream("POST", path, json=body) as r:
            if r.status_code >= 400:
                r.read()
                raise _error(r.status_code, _safe_json(r))
            yield from parse_sse(r.iter_lines())

    def create_session(self) -> Session:
        return Session(self, self._json("POST", "/v1/sessions")["id"])

    def chat(self, messages: list[dict], **params: Any) -> Iterator[str]:
        """Stateless streaming chat completion: text deltas."""
        for ch in self._stream("/v1/chat/completions", {"messages": messages, "stream": True, **params}):
            for choice in ch.get("choices", []):
                if choice["delta"].get("content"):
                    yield choice["delta"]["content"]

    def close(self) -> None:
        self.http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncSession:
    def __init__(self, client: "AsyncClient", session_id: str):
        self.client, self.id = client, session_id

    async def generate(self, input: str | list[int] | None = None, *, messages: list[dict] | None = None,
                       **params: Any) -> AsyncIterator[str]:
        async for ev in self.client._stream(f"/v1/sessions/{self.id}/generate", _gen_body(input, messages, params)):
            if ev.get("type") == "token":
                yield ev["text"]
            elif ev.get("type") == "done":
                self.last = ev

    async def info(self) -> dict:
        return await self.client._json("GET", f"/v1/sessions/{self.id}")

    async def close(self) -> None:
        await self.client._json("DELETE", f"/v1/sessions/{self.id}")

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class AsyncClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, timeout: float = 600):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout)

    async def _json(self, method: str, path: str, body: dict | None = None) -> Any:
        r = await self.http.request(method, path, json=body)
        if r.status_code >= 400:
            raise _error(r.status_code, _safe_json(r))
        return r.json()

    async def _stream(self, path: str, body: dict) -> AsyncIterator[Any]:
        async with self.http.stream("POST", path, json=body) as r:
            if r.status_code >= 400:
                await r.aread()
                raise _error(r.status_code, _safe_json(r))
            parser = SSEParser()
            async for line in r.aiter_lines():
                for item in parser.feed(line):
                    yield item
                if parser.done:
                    return

    async def create_session(self) -> AsyncSession:
        return AsyncSession(self, (await self._json("POST", "/v1/sessions"))["id"])

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()


def _safe_json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return {"error": {"code": "http_error", "message": r.text[:200]}}
