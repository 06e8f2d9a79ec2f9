"""Session API: a session keeps its KV row between turns; each turn prefills only new input."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from engine import FinishReason
from engine.types import EngineError
from service import chat
from service.auth import tenant
from service.errors import APIError, from_engine
from service.schemas import ERROR_RESPONSES, STREAM_RESPONSES, SessionGenerateRequest
from service.turns import collect, require_ready, sampling_params, start_turn

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


async def _turn_input(st, session_id: str, body: SessionGenerateRequest, append: bool) -> tuple[int | None, list[int]]:
    """(the history length the input was prepared against, or None; the turn's new tokens)."""
    if isinstance(body.input, list):
        return None, list(body.input)
    tok = st.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer; send token ids", "invalid_request", "input")
    history_len, tail = await _engine_call(st, st.worker.engine.session_tail, session_id, chat.TAIL_TOKENS)
    if body.input is not None:
        return history_len, chat.text_ids(tok, body.input, history_len)
    msgs = chat.chat_messages(body.messages)
    return history_len, chat.message_ids(tok, msgs, history_len, tail, generation_prompt=not append)


@router.post("/{session_id}/generate", responses=STREAM_RESPONSES)
async def generate(session_id: str, body: SessionGenerateRequest, request: Request,
                   owner: str | None = Depends(tenant)):
    """Append input (text, token ids, or chat messages) to the session and stream the reply.
    `max_tokens: 0` appends only: the input is prefilled into the session's row and committed,
    and the answer reports the tokens appended and what the session holds."""
    st = request.app.state.s5
    require_ready(st)
    st.sessions.check(session_id, owner)
    if (body.input is None) == (body.messages is None):
        raise APIError(400, "give exactly one of input or messages", "invalid_request", "input")
    params = sampling_params(body, chat.end_of_turn_ids(st.tokenizer))
    append = params.max_tokens == 0
    history_len, ids = await _turn_input(st, session_id, body, append)
    if not ids:
        raise APIError(400, "input is empty", "invalid_request", "input")
    turn = await start_turn(st, ids, params, session_id, owner, match_prefix=False, expect_history_len=history_len)
    headers = {"X-Request-Id": turn.request_id}

    async def final(out, prefill_s) -> dict:
        reason = {FinishReason.LENGTH: "length", FinishReason.ERROR: "error", FinishReason.ABORT: "abort"}
        done = {
            "type": "done",
            "finish_reason": reason.get(out.finish_reason, "stop"),
            "prompt_tokens": out.num_prompt_tokens,
            "cached_tokens": out.num_cached_tokens,
            "completion_tokens": out.num_output_tokens,
            "prefill_seconds": prefill_s,
            "total_seconds": time.monotonic() - turn.started,
            **({"error": out.error} if out.error else {}),
        }
        if append and out.finish_reason == FinishReason.LENGTH:
            done["appended_tokens"] = len(ids)
            done.update(await _held(st, session_id))
        return done

    if not body.stream:
        text, ids_out, last = await collect(turn, request)
        if last is None:
            return JSONResponse({"text": text, "token_ids": ids_out, "type": "done", "finish_reason": "abort"})
        return JSONResponse({"text": text, "token_ids": ids_out, **await final(last, None)}, headers=headers)

    async def events():
        prefill_s = None
        async for out in turn.stream:
            if prefill_s is None:
                prefill_s = time.monotonic() - turn.started
            if out.new_token_ids and out.finish_reason != FinishReason.ERROR:
                yield json.dumps({"type": "token", "text": out.text_delta, "token_ids": out.new_token_ids})
            if out.finished:
                yield json.dumps(await final(out, prefill_s))
        yield "[DONE]"

    return EventSourceResponse(events(), sep="\n", headers=headers, ping=3600)


async def _held(st, session_id: str) -> dict:
    """What the session holds after an append (as GET /v1/sessions/{id} reports it)."""
    try:
        info = await _engine_call(st, st.worker.engine.session_info, session_id)
    except APIError:  # closed or evicted right after its turn
        return {}
    return {k: info[k] for k in ("history_tokens", "kv_tokens", "resident_kv_bytes")}
