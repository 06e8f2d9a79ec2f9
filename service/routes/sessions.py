"""Session API: a session keeps its KV row between turns; each turn prefills only new input."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from engine import FinishReason
from engine.types import EngineError
from service.auth import tenant
from service.errors import APIError, from_engine
from service.routes.openai import end_of_turn_ids
from service.schemas import ERROR_RESPONSES, STREAM_RESPONSES, SessionGenerateRequest
from service.turns import collect, require_ready, sampling_params, start_turn, valid_text

router = APIRouter(prefix="/v1/sessions", responses=ERROR_RESPONSES)


async def _engine_call(st, fn, *args):
    try:
        return await st.worker.call(fn, *args)
    except EngineError as err:
        raise from_engine(err) from err


@router.post("")
async def create_session(request: Request, owner: str | None = Depends(tenant)):
    st = request.app.state.s5
    require_ready(st)
    sid = await _engine_call(st, st.worker.engine.create_session, None, owner)
    st.sessions.add(sid, owner)
    return {"id": sid, "object": "session", "created": int(time.time()), "model": st.model_name}


@router.get("/{session_id}")
async def get_session(session_id: str, request: Request, owner: str | None = Depends(tenant)):
    st = request.app.state.s5
    require_ready(st)
    st.sessions.check(session_id, owner)
    info = await _engine_call(st, st.worker.engine.session_info, session_id)
    return {"object": "session", **info}


@router.delete("/{session_id}")
async def delete_session(session_id: str, request: Request, owner: str | None = Depends(tenant)):
    """Idempotent: deleting a missing (or already deleted) session also answers 200."""
    st = request.app.state.s5
    require_ready(st)
    try:
        st.sessions.check(session_id, owner)
    except APIError:
        return {"id": session_id, "object": "session.deleted", "deleted": False}
    await _engine_call(st, st.worker.engine.close_session, session_id)
    st.sessions.remove(session_id)
    return {"id": session_id, "object": "session.deleted", "deleted": True}


@router.post("/{session_id}/generate", responses=STREAM_RESPONSES)
async def generate(session_id: str, body: SessionGenerateRequest, request: Request,
                   owner: str | None = Depends(tenant)):
    st = request.app.state.s5
    require_ready(st)
    st.sessions.check(session_id, owner)
    tok = st.tokenizer
    if (body.input is None) == (body.messages is None):
        raise APIError(400, "give exactly one of input or messages", "invalid_request", "input")
    if isinstance(body.input, list):
        ids = list(body.input)
    elif tok is None:
        raise APIError(400, "this model has no tokenizer; send token ids", "invalid_request", "input")
    elif body.input is not None:
        ids = tok(valid_text(body.input, "input"), add_special_tokens=False)["input_ids"]
    else:
        try:
            turns = [(("model" if m.role == "assistant" else "user"), valid_text(m.text(), "messages"))
                     for m in body.messages]
        except ValueError as exc:
            raise APIError(400, f"messages: {exc}", "invalid_request", "messages") from exc
        text = "".join(f"<start_of_turn>{role}\n{t}<end_of_turn>\n" for role, t in turns)
        ids = tok(text + "<start_of_turn>model\n", add_special_tokens=False)["input_ids"]
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
        async for out in turn.stream:
            if prefill_s is None:
                prefill_s = time.monotonic() - turn.started
            if out.new_token_ids and out.finish_reason != FinishReason.ERROR:
                yield json.dumps({"type": "token", "text": out.text_delta, "token_ids": out.new_token_ids})
            if out.finished:
                yield json.dumps(final(out, prefill_s))
        yield "[DONE]"

    return EventSourceResponse(events(), sep="\n", headers=headers, ping=3600)
