"""Python SDK for s5serve: `Client` (sync) and `AsyncClient`, one API with two faces. What each
call sends and how its answer reads (bodies, SSE parsing, events to text, errors) is written
once; each face only does the I/O.

    from service.client import Client
    with Client("http://127.0.0.1:8000") as c, c.create_session() as s:
        for text in s.generate("My name is Ada.", max_tokens=32):
            print(text, end="", flush=True)
        print(s.info()["history_tokens"])

    async with AsyncClient("http://127.0.0.1:8000") as c, c.create_session() as s:
        async for text in s.generate("My name is Ada.", max_tokens=32):
            print(text, end="", flush=True)

Leaving a `generate` iterator early closes the stream, which cancels the turn on the server
(the session rolls back to its last completed turn). The server's errors raise `S5Error`
subclasses, and so does a server that cannot be reached (`ConnectionFailed`). The streaming calls
yield one completion's text: they take neither `stream` nor `n` > 1 (TypeError, ValueError).
"""

from __future__ import annotations

import contextlib
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
class SessionIncompatible(S5Error): ...  # stored under another model or KV policy than the server's
class RateLimited(S5Error): ...
class Unavailable(S5Error): ...
class GenerationFailed(S5Error): ...
class ConnectionFailed(S5Error): ...  # the server was not reached, or the connection broke (status 0)


_BY_CODE = {"session_incompatible": SessionIncompatible}  # a code whose status other errors share
_BY_STATUS = {400: BadRequest, 401: AuthenticationError, 404: NotFound, 409: SessionBusy,
              410: SessionEvicted, 413: BadRequest, 429: RateLimited, 503: Unavailable}


def _error(status: int, body: Any) -> S5Error:
    err = body.get("error", {}) if isinstance(body, dict) else {}
    code = err.get("code") or "error"
    cls = _BY_CODE.get(code) or _BY_STATUS.get(status, S5Error)
    return cls(status, code, err.get("message") or str(body))


@contextlib.contextmanager
def _reaching():
    """A transport failure (refused, reset, timed out) as the SDK's error."""
    try:
        yield
    except httpx.TransportError as exc:
        raise ConnectionFailed(0, "connection_failed", f"{type(exc).__name__}: {exc}") from exc


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


# ---- what each call sends and how its answer reads: one implementation for both faces --------
def _session_body(input: str | list[int] | None, messages: list[dict] | None, params: dict,
                  stream: bool = True) -> dict:
    """A turn's body: input or messages as given (the server refuses both, or neither)."""
    _check_streamed("generate()", params)
    body = {**params, "stream": stream}
    if input is not None:
        body["input"] = input
    if messages is not None:
        body["messages"] = messages
    return body


def _streamed_body(call: str, key: str, value: Any, params: dict) -> dict:
    _check_streamed(call, params)
    return {key: value, **params, "stream": True}


def _check_streamed(call: str, params: dict) -> None:
    """The streaming calls yield one completion's text deltas."""
    if "stream" in params:
        raise TypeError(f"{call} streams its reply: it takes no `stream` parameter")
    if params.get("n", 1) != 1:
        raise ValueError(f"{call} streams one completion; for n > 1 use /v1/completions or /v1/chat/completions")


def _session_text(session: "Session | AsyncSession", ev: dict) -> str | None:
    """A token event's text ("" while held back: models without a tokenizer, a partial UTF-8
    character or stop string), None for other events; the final event is kept as `session.last`."""
    if ev.get("type") == "token":
        return ev["text"]
    if ev.get("type") == "done":
        session.last = ev
    return None


def _chat_text(chunk: dict) -> str | None:
    return next((c["delta"]["content"] for c in chunk.get("choices", []) if c["delta"].get("content")), None)


def _completion_text(chunk: dict) -> str | None:
    return next((c["text"] for c in chunk.get("choices", []) if c.get("text")), None)


def _sessions(session_id: str | None = None, generate: bool = False) -> str:
    return "/v1/sessions" + (f"/{session_id}" if session_id else "") + ("/generate" if generate else "")


class Session:
    """A server session (sync). `last`: the final event of the latest turn (token counts, and
    after an append what the session holds)."""

    def __init__(self, client: "Client", session_id: str):
        self.client, self.id = client, session_id
        self.last: dict | None = None

    def generate(self, input: str | list[int] | None = None, *, messages: list[dict] | None = None,
                 **params: Any) -> Iterator[str]:
        """Append input (text, token ids, or chat messages) and stream the reply's text deltas."""
        for ev in self.client._stream(_sessions(self.id, True), _session_body(input, messages, params)):
            text = _session_text(self, ev)
            if text is not None:  # every token, even one whose text is held back ("")
                yield text

    def append(self, input: str | list[int] | None = None, *, messages: list[dict] | None = None) -> dict:
        """Append input without generating (`max_tokens: 0`); returns what the session now holds
        (`appended_tokens`, `history_tokens`, `kv_tokens`, `resident_kv_bytes`)."""
        self.last = self.client._json("POST", _sessions(self.id, True),
                                      _session_body(input, messages, {"max_tokens": 0}, stream=False))
        return self.last

    def info(self) -> dict:
        return self.client._json("GET", _sessions(self.id))

    def close(self) -> None:
        self.client._json("DELETE", _sessions(self.id))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Client:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, timeout: float = 600):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)

    def _json(self, method: str, path: str, body: dict | None = None) -> Any:
        with _reaching():
            r = self.http.request(method, path, json=body)
        if r.status_code >= 400:
            raise _error(r.status_code, _safe_json(r))
        return r.json()

    def _stream(self, path: str, body: dict) -> Iterator[Any]:
        with _reaching(), self.http.stream("POST", path, json=body) as r:
            if r.status_code >= 400:
                r.read()
                raise _error(r.status_code, _safe_json(r))
            yield from parse_sse(r.iter_lines())

    def create_session(self) -> Session:
        """A new session; `with client.create_session() as s:` deletes it on exit."""
        return Session(self, self._json("POST", _sessions())["id"])

    def chat(self, messages: list[dict], **params: Any) -> Iterator[str]:
        """Stateless streaming chat completion: text deltas."""
        for ch in self._stream("/v1/chat/completions", _streamed_body("chat()", "messages", messages, params)):
            text = _chat_text(ch)
            if text:
                yield text

    def complete(self, prompt: str | list[int], **params: Any) -> Iterator[str]:
        """Stateless streaming text completion: text deltas."""
        for ch in self._stream("/v1/completions", _streamed_body("complete()", "prompt", prompt, params)):
            text = _completion_text(ch)
            if text:
                yield text

    def close(self) -> None:
        self.http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncSession:
    """A server session (async); the same API as `Session`, with `async for` and `await`."""

    def __init__(self, client: "AsyncClient", session_id: str):
        self.client, self.id = client, session_id
        self.last: dict | None = None

    async def generate(self, input: str | list[int] | None = None, *, messages: list[dict] | None = None,
                       **params: Any) -> AsyncIterator[str]:
        async for ev in self.client._stream(_sessions(self.id, True), _session_body(input, messages, params)):
            text = _session_text(self, ev)
            if text is not None:  # every token, even one whose text is held back ("")
                yield text

    async def append(self, input: str | list[int] | None = None, *, messages: list[dict] | None = None) -> dict:
        self.last = await self.client._json("POST", _sessions(self.id, True),
                                            _session_body(input, messages, {"max_tokens": 0}, stream=False))
        return self.last

    async def info(self) -> dict:
        return await self.client._json("GET", _sessions(self.id))

    async def close(self) -> None:
        await self.client._json("DELETE", _sessions(self.id))

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class _NewAsyncSession:
    """What `AsyncClient.create_session()` returns: await it for the session, or use it as
    `async with client.create_session() as s:` (the session is deleted on exit)."""

    def __init__(self, client: "AsyncClient"):
        self._client = client
        self._session: AsyncSession | None = None

    async def _create(self) -> AsyncSession:
        return AsyncSession(self._client, (await self._client._json("POST", _sessions()))["id"])

    def __await__(self):
        return self._create().__await__()

    async def __aenter__(self) -> AsyncSession:
        self._session = await self._create()
        return self._session

    async def __aexit__(self, *exc):
        await self._session.close()


class AsyncClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, timeout: float = 600):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout)

    async def _json(self, method: str, path: str, body: dict | None = None) -> Any:
        with _reaching():
            r = await self.http.request(method, path, json=body)
        if r.status_code >= 400:
            raise _error(r.status_code, _safe_json(r))
        return r.json()

    async def _stream(self, path: str, body: dict) -> AsyncIterator[Any]:
        with _reaching():
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

    def create_session(self) -> _NewAsyncSession:
        """`s = await client.create_session()`, or `async with client.create_session() as s:`."""
        return _NewAsyncSession(self)

    async def chat(self, messages: list[dict], **params: Any) -> AsyncIterator[str]:
        """Stateless streaming chat completion: text deltas."""
        async for ch in self._stream("/v1/chat/completions", _streamed_body("chat()", "messages", messages, params)):
            text = _chat_text(ch)
            if text:
                yield text

    async def complete(self, prompt: str | list[int], **params: Any) -> AsyncIterator[str]:
        """Stateless streaming text completion: text deltas."""
        async for ch in self._stream("/v1/completions", _streamed_body("complete()", "prompt", prompt, params)):
            text = _completion_text(ch)
            if text:
                yield text

    async def aclose(self) -> None:
        await self.http.aclose()

    close = aclose  # the same name as the sync client's

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()


def _safe_json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return {"error": {"code": "http_error", "message": r.text[:200]}}
