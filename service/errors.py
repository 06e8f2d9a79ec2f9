"""The OpenAI error envelope: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.types import EngineError

# engine error code -> HTTP status
STATUS = {
    "session_not_found": 404,
    "session_busy": 409,
    "duplicate_request_id": 409,
    "queue_full": 429,
    "engine_unavailable": 503,
}
TYPES = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error",
         429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers


def from_engine(err: EngineError) -> APIError:
    return APIError(STATUS.get(err.code, 400), err.message, err.code, err.param)


def envelope(status: int, message: str, code: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error"), "param": param, "code": code}}


def install(app) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError):
        return JSONResponse(envelope(exc.status, exc.message, exc.code, exc.param), exc.status, headers=exc.headers)

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError):
        e = from_engine(exc)
        return JSONResponse(envelope(e.status, e.message, e.code, e.param), e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(envelope(400, msg, "invalid_request", ".".join(loc) or None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(envelope(exc.status_code, str(exc.detail), code), exc.status_code)
