"""Server-sent events as the routes send them: `data: <json>\n\n` frames (LF only), ending with
`data: [DONE]\n\n`, through sse-starlette. Frames are encoded here, once, to bytes (msgspec's JSON
encoder): sse-starlette sends bytes as they are."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

DONE = b"data: [DONE]\n\n"
encode = msgspec.json.Encoder().encode  # an object's JSON, as bytes


def event(obj) -> bytes:
    """One `data:` frame holding `obj` as JSON."""
    return b"data: " + encode(obj) + b"\n\n"


def generation_failed(message: str | None) -> bytes:
    """The in-band error event of a stream whose generation failed after its first bytes (the
    status line is sent): the error envelope, as OpenAI's streams carry one. `[DONE]` follows."""
    return event({"error": {"message": message or "generation failed", "type": "server_error", "param": None,
                            "code": "generation_failed"}})


def response(frames: AsyncIterator[bytes], turn, headers: dict[str, str]) -> EventSourceResponse:
    """A streamed reply. However it ends (finished, failed or the client gone, whether or not its
    stream was being read), the turn is closed then: a request whose client left is aborted."""
    return EventSourceResponse(frames, sep="\n", headers=headers, ping=3600, background=BackgroundTask(turn.aclose))
