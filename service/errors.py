"""The OpenAI error envelope: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from engine.core.types import EngineError

# engine error code -> HTTP status
STATUS = {
    "session_not_found": 404,
    "session_busy": 409,
    "session_incompatible": 409,
    "session_evicted": 410,
    "duplicate_request_id": 409,
    "queue_full": 429,
    "too_many_sessions": 429,
    "too_many_requests": 429,
    "engine_unavailable": 503,
    "session_store_unavailable": 503,
}
TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 409: "conflict_error", 410: "not_found_error",
         413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers


def valid_text(text: str, param: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{param}: invalid unicode (lone surrogate)", "invalid_request", param) from exc
    return text


def respell(err: APIError, names: dict[str, str]) -> None:
    """Put `err` in the request's own names for its parameters (`names`: the engine's name ->
    the request's), in `param` and where the message names the parameter with its value."""
    new = names.get(err.param or "")
    if new is not None:
        err.message = err.message.replace(f"{err.param} (", f"{new} (")
        err.param = new


def from_engine(err: EngineError) -> APIError:
    status = STATUS.get(err.code, 400)
    # a retry soon finds room in a queue; a key's sessions are freed only by deletes and expiry
    retry = status == 429 and err.code != "too_many_sessions"
    return APIError(status, err.message, err.code, err.param, {"Retry-After": "1"} if retry else None)


def envelope(status: int, message: str, code: str, param: str | None = None) -> dict:
    kind = TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _union_member(tag: str) -> bool:
    """pydantic names a union member by its type: `str`, `list[int]`, `ContentPart`, `function-...`."""
    return "[" in tag or "-" in tag or tag in {"str", "int", "float", "bool", "none", "dict", "list"} or tag[:1].isupper()


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for a body FastAPI could not parse or validate: the first error, named by
    the field it is about; the body itself when it is not JSON or not an object."""
    first = errors[0] if errors else {}
    kind = first.get("type")
    where_in = first.get("loc", [])
    if where_in and where_in[0] in ("body", "query", "path", "header"):  # the field alone, as OpenAI names it
        where_in = where_in[1:]
    loc = [str(x) for x in where_in]
    if kind == "json_invalid":
        reason = (first.get("ctx") or {}).get("error") or "cannot be decoded"
        at = first.get("loc", [None])[-1]
        where = f" at character {at}" if isinstance(at, int) else ""
        return f"the request body is not valid JSON: {reason}{where}", None
    if not loc:
        empty = " (it is empty)" if kind == "missing" else ""
        return f"the request body must be a JSON object{empty}", None
    # a value that fits no member of a union: one error per member, their locations ending in
    # the member's type; name the field, not the member
    if len(loc) > 1 and _union_member(loc[-1]):
        loc = loc[:-1]
        return f"{'.'.join(loc)}: invalid type or value ({first.get('msg', 'invalid')})", ".".join(loc)
    return f"{'.'.join(loc)}: {first.get('msg', 'invalid request')}", ".".join(loc)


def refused(scope, status: int, code: str) -> None:
    """Count a request's error answer in `s5_rejections{code}`, once (a body over the limit gets
    its 413 while the app, whose read fails, makes another answer that is dropped): every one
    but a 500, a failure of work the server took on."""
    if status == 500 or scope.get("s5.refused"):
        return
    scope["s5.refused"] = True
    scope["app"].state.s5.metrics.rejections.labels(code).inc()


def install(app) -> None:
    """The error answers, each an envelope, each counted (`refused`)."""
    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        refused(request.scope, exc.status, exc.code)
        return JSONResponse(envelope(exc.status, exc.message, exc.code, exc.param), exc.status, headers=exc.headers)

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError):
        e = from_engine(exc)
        refused(request.scope, e.status, e.code)
        return JSONResponse(envelope(e.status, e.message, e.code, e.param), e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        msg, param = validation_message(list(exc.errors()))
        kind = request.headers.get("content-type", "")
        if param is None and kind and not _is_json(kind):  # a body never parsed: say why
            msg = f"the request body must be JSON sent with Content-Type: application/json (this one: {kind})"
        refused(request.scope, 400, "invalid_request")
        return JSONResponse(envelope(400, msg, "invalid_request", param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        status, route = exc.status_code, f"{request.method} {request.url.path}"
        code = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
        msg = str(exc.detail)
        if status == 404 and msg == "Not Found":  # no such route (routes' own 404s are APIErrors)
            msg = f"no route {route}"
        headers = exc.headers
        if status == 405:  # the router names the first route of the path; Allow lists every route's
            allowed = ", ".join(_methods_of(request))
            headers = {**{k: v for k, v in (exc.headers or {}).items() if k.lower() != "allow"}, "Allow": allowed}
            msg = f"method {request.method} is not allowed on {request.url.path} (allowed: {allowed})"
        refused(request.scope, status, code)
        return JSONResponse(envelope(status, msg, code), status, headers=headers)


METHODS = ("DELETE", "GET", "PATCH", "POST", "PUT")


def _methods_of(request: Request) -> list[str]:
    """The methods the app's routes take at this request's path (each asked of the router as a
    request of that method would be)."""
    routes = request.app.router.routes
    return [m for m in METHODS
            if any(r.matches({**request.scope, "method": m})[0] == Match.FULL for r in routes)]


def _is_json(content_type: str) -> bool:
    """Whether a Content-Type is JSON as FastAPI parses it (application/json or */*+json)."""
    main = content_type.split(";", 1)[0].strip().lower()
    return main == "application/json" or (main.startswith("application/") and main.endswith("+json"))


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413, whether its length is declared
    or it is streamed (chunked): the 413 goes out as soon as the body passes the limit, and what
    the app answers after that (it sees the read fail) is dropped."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(scope, send)
        seen, started, rejected = 0, False, False

        async def limited():
            nonlocal seen, rejected
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    if not started and not rejected:
                        rejected = True
                        await self._reject(scope, send)
                    raise _TooLarge()
            return msg

        async def guarded(msg):
            nonlocal started
            if not rejected:
                started = True
                await send(msg)

        try:
            await self.app(scope, limited, guarded)
        except _TooLarge:
            pass

    async def _reject(self, scope, send):
        refused(scope, 413, "body_too_large")
        body = JSONResponse(envelope(413, f"request body over {self.max_bytes} bytes", "body_too_large"), 413)
        await send({"type": "http.response.start", "status": 413, "headers": body.raw_headers})
        await send({"type": "http.response.body", "body": body.body})


class _TooLarge(Exception):
    pass
