"""Session API: a session keeps its KV row between turns; each turn prefills only new input."""

from __future__ import annotations

import time

import msgspec
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

from engine import FinishReason
from service.auth import tenant
from service.errors import APIError
from service.routes.openai import end_of_turn_ids
from service.schemas import ERROR_RESPONSES, STREAM_RESPONSES, SessionGenerateRequest
from service.turns import collect, engine_call, require_ready, sampling_params, start_turn, tokenize, valid_text

router = APIRouter(prefix="/v1/sessions", responses=ERROR_RESPONSES)


@router.post("")
async def create_session(request: Request, owner: str | None = Depends(tenant)):
    st = request.app.state.s5
    require_ready(st)
    sid = await engine_call(st.engine.create_session(owner))
    return {"id": sid, "object": "session", "created": int(time.time()), "model": st.model_name}


@router.get("/{session_id}")
async def get_session(session_id: str, request: Request, owner: str | None = Depends(tenant)):
    st = request.app.state.s5
    require_ready(st)
    info = await engine_call(st.engine.session_info(session_id, owner))
    return {"object": "session", **info}


@router.delete("/{session_id}")
async def delete_session(session_id: str, request: Request, owner: str | None = Depends(tenant)):
    """Idempotent: deleting a missing (or already deleted) session also answers 200."""
    st = request.app.state.s5
    require_ready(st)
    deleted = await engine_call(st.engine.close_session(session_id, owner))
    return {"id": session_id, "object": "session.deleted", "deleted": deleted}


@router.post("/{session_id}/generate", responses=STREAM_RESPONSES)
async def generate(session_id: str, body: SessionGenerateRequest, request: Request,
                   owner: str | None = Depends(tenant)):
    st = request.app.state.s5
    require_ready(st)
    tok = st.tokenizer
    if (body.input is None) == (body.messages is None):
        raise APIError(400, "give exactly one of input or messages", "invalid_request", "input")
    if isinstance(body.input, list):
        ids = list(body.input)
    elif tok is None:
        raise APIError(400, "this model has no tokenizer; send token ids", "invalid_request", "input")
    elif body.input is not None:
        ids = await tokenize(st, valid_text(body.input, "input"), add_special_tokens=False)
    else:
        try:
            turns = [(("model" if m.role == "assistant" else "user"), valid_text(m.text(), "messages"))
                     for m in body.messages]
        except ValueError as exc:
            raise APIError(400, f"messages: {exc}", "invalid_request", "messages") from exc
        text = "".join(f"<start_of_turn>{role}\n{t}<end_of_turn>\n" for role, t in turns)
        ids = await tokenize(st, text + "<start_of_turn>model\n", add_special_tokens=False)
    if not ids:
        raise APIError(400, "input is empty", "invalid_request", "input")
    params = sampling_params(body, end_of_turn_ids(tok))
    turn = await start_turn(st, ids, params, session_id, owner, match_prefix=False)
    headers = {"X-Request-Id": turn.request_id}

    def final(out, prefill_s) -> dict:
        reason = {FinishReason.LENGTH: "length", FinishReason.ERROR: "error", FinishReason.ABORT: "abort"}
        return {
            "type": "done",
            "finish_reason": reason.get(out.finish_reason, "stop"),
            "prompt_tokens": out.num_prompt_tokens,
            "cached_tokens": out.num_cached_tokens,
            "completion_tokens": out.num_output_tokens,
            "prefill_seconds": prefill_s,
            "total_seconds": time.monotonic() - turn.started,
            **({"error": out.error} if out.error else {}),
        }

    if not body.stream:
        text, ids_out, last = await collect(turn, request)
        if last is None:
            return JSONResponse({"text": text, "token_ids": ids_out, "type": "done", "finish_reason": "abort"})
        return JSONResponse({"text": text, "token_ids": ids_out, **final(last, None)}, headers=headers)

    async def events():
        prefill_s = None
        async for out in turn.chunks():
            if prefill_s is None:
                prefill_s = time.monotonic() - turn.started
            if out.token_ids and out.finish_reason != FinishReason.ERROR:
                yield msgspec.json.encode({"type": "token", "text": out.text, "token_ids": out.token_ids}).decode()
            if out.finished:
                yield msgspec.json.encode(final(out, prefill_s)).decode()
        yield "[DONE]"

    return EventSourceResponse(events(), sep="\n", headers=headers, ping=3600, background=BackgroundTask(turn.close))
