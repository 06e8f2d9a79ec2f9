"""Session API: a session keeps its KV row between turns; each turn prefills only new input."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from engine import FinishReason
from service.errors import APIError
from service.schemas import SessionGenerateRequest
from service.turns import require_ready, sampling_params, start_turn

router = APIRouter(prefix="/v1/sessions")


@router.post("")
async def create_session(request: Request):
    st = request.app.state.s5
    require_ready(st)
    sid = await st.worker.call(st.worker.engine.create_session)
    return {"id": sid, "object": "session", "created": int(time.time()), "model": st.model_name}


@router.get("/{session_id}")
async def get_session(session_id: str, request: Request):
    st = request.app.state.s5
    require_ready(st)
    info = await st.worker.call(st.worker.engine.session_info, session_id)
    return {"object": "session", **info}


@router.delete("/{session_id}")
async def delete_session(session_id: str, request: Request):
    st = request.app.state.s5
    require_ready(st)
    await st.worker.call(st.worker.engine.close_session, session_id)
    return {"id": session_id, "object": "session.deleted", "deleted": True}


@router.post("/{session_id}/generate")
async def generate(session_id: str, body: SessionGenerateRequest, request: Request):
    st = request.app.state.s5
    tok = st.tokenizer
    if (body.input is None) == (body.messages is None):
        raise APIError(400, "give exactly one of input or messages", "invalid_request", "input")
    if isinstance(body.input, list):
        ids = list(body.input)
    elif tok is None:
        raise APIError(400, "this model has no tokenizer; send token ids", "invalid_request", "input")
    elif body.input is not None:
        ids = tok(body.input, add_special_tokens=False)["input_ids"]
    else:
        text = "".join(
            f"<start_of_turn>{'model' if m.role == 'assistant' else 'user'}\n{m.text()}<end_of_turn>\n"
            for m in body.messages
        ) + "<start_of_turn>model\n"
        ids = tok(text, add_special_tokens=False)["input_ids"]
    stops = ()
    if tok is not None:
        eot = tok.convert_tokens_to_ids("<end_of_turn>")
        stops = (eot,) if isinstance(eot, int) and eot != tok.unk_token_id else ()
    turn = await start_turn(st, ids, sampling_params(body, stops), session_id, match_prefix=False)
    headers = {"X-Request-Id": turn.request_id}

    def final(out, prefill_s) -> dict:
        return {
            "type": "done",
            "finish_reason": "length" if out.finish_reason == FinishReason.LENGTH else (
                "error" if out.finish_reason == FinishReason.ERROR else "stop"),
            "prompt_tokens": out.num_prompt_tokens,
            "cached_tokens": out.num_cached_tokens,
            "completion_tokens": out.num_output_tokens,
            "prefill_seconds": prefill_s,
            "total_seconds": time.monotonic() - turn.started,
            **({"error": out.error} if out.error else {}),
        }

    if not body.stream:
        text, ids_out, prefill_s, last = "", [], None, None
        async for out in turn.stream:
            prefill_s = prefill_s if prefill_s is not None else time.monotonic() - turn.started
            text += out.text_delta
            ids_out += out.new_token_ids
            last = out
        return JSONResponse({"text": text, "token_ids": ids_out, **final(last, prefill_s)}, headers=headers)

    async def events():
        prefill_s = None
        async for out in turn.stream:
            prefill_s = prefill_s if prefill_s is not None else time.monotonic() - turn.started
            if out.new_token_ids and out.finish_reason != FinishReason.ERROR:
                yield json.dumps({"type": "token", "text": out.text_delta, "token_ids": out.new_token_ids})
            if out.finished:
                yield json.dumps(final(out, prefill_s))
        yield "[DONE]"

    return EventSourceResponse(events(), sep="\n", headers=headers, ping=3600)
