"""Session API: a session keeps its KV row between turns; each turn prefills only new input."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from engine import FinishReason
from engine.core.detokenizer import kept_output
from service import chat, sse, structured
from service import logprobs as logprobs_format
from service.auth import tenant
from service.errors import APIError, valid_text
from service.schemas import ERROR_RESPONSES, STREAM_RESPONSES, SessionGenerateRequest
from service.turns import (check_supported, collect, engine_call, engine_names, finish_reason_text, open_session,
                           render_chat, require_ready, sampling_params, start_turn, tokenize)

router = APIRouter(prefix="/v1/sessions", responses=ERROR_RESPONSES)


@router.post("")
async def create_session(request: Request, owner: str | None = Depends(tenant)):
    st = request.app.state.s5
    require_ready(st)
    sid = await open_session(st, owner)
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


async def _turn_input(st, session_id: str, owner: str | None, body: SessionGenerateRequest,
                      append: bool) -> tuple[int | None, list[int]]:
    """(the history length the input was prepared against, or None; the turn's new tokens)."""
    if isinstance(body.input, list):
        return None, list(body.input)
    tok = st.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer; send token ids", "invalid_request", "input")
    history_len, tail = await engine_call(st.engine.call("session_tail", session_id, chat.TAIL_TOKENS, owner))
    if body.input is not None:  # BOS (the tokenizer's special tokens) only on the first turn
        return history_len, await tokenize(st, valid_text(body.input, "input"),
                                           add_special_tokens=history_len == 0)
    msgs = chat.chat_messages(body.messages)
    return history_len, await render_chat(st, msgs, history_len, tail, generation_prompt=not append)


@router.post("/{session_id}/generate", responses=STREAM_RESPONSES)
async def generate(session_id: str, body: SessionGenerateRequest, request: Request,
                   owner: str | None = Depends(tenant)):
    """Append input (text, token ids, or chat messages) to the session and stream the reply.
    `max_tokens: 0` appends only: the input is prefilled into the session's row and committed,
    and the answer reports the tokens appended and what the session holds."""
    st = request.app.state.s5
    require_ready(st)
    if (body.input is None) == (body.messages is None):
        raise APIError(400, "give exactly one of input or messages", "invalid_request", "input")
    check_supported(body)
    if body.n != 1:
        raise APIError(400, "n > 1 is not available on a session: a session has one row (use /v1/completions "
                       "or /v1/chat/completions without a session)", "invalid_request", "n")
    params = sampling_params(body, st.end_of_turn_ids, await structured.grammar_of(st, body))
    append = params.max_tokens == 0
    history_len, ids = await _turn_input(st, session_id, owner, body, append)
    if not ids:
        raise APIError(400, "input is empty", "invalid_request", "input")
    # the engine names a turn's input `prompt`; this route's field is another
    names = {"prompt": "input" if body.input is not None else "messages", **engine_names(body)}
    turn = await start_turn(st, ids, params, session_id, owner, match_prefix=False, expect_history_len=history_len,
                            names=names)
    headers = {"X-Request-Id": turn.request_id}

    async def final(out, sampled: list[int]) -> dict:
        """The done event; `sampled`: the turn's sampled tokens."""
        first = turn.stream.first_arrived  # the prefill's end
        prefill_s = first - turn.started if first is not None else None
        done = {
            "type": "done",
            "finish_reason": finish_reason_text(out.finish_reason),
            "prompt_tokens": out.num_prompt_tokens,
            "cached_tokens": out.num_cached_tokens,
            "completion_tokens": out.num_output_tokens,
            "prefill_seconds": prefill_s,
            "total_seconds": time.monotonic() - turn.started,
        }
        if turn.stopped:  # the session keeps the text before the stop string, not every sampled token
            kept, pending = kept_output(st.tokenizer, sampled, turn.detok.text)
            done["kept_token_ids"] = kept + pending
        if append and out.finish_reason == FinishReason.LENGTH:
            done["appended_tokens"] = len(ids)
            done.update(await _held(st, session_id, owner))
        return done

    if not body.stream:
        text, ids_out, last, lps = await collect(turn, request)
        extra = {"logprobs": logprobs_format.session(ids_out, lps)} if params.logprobs is not None else {}
        if last is None:
            return JSONResponse({"text": text, "token_ids": ids_out, **extra, "type": "done", "finish_reason": "abort"})
        return JSONResponse({"text": text, "token_ids": ids_out, **extra, **await final(last, ids_out)},
                            headers=headers)

    async def events():
        sampled: list[int] = []
        async for out in turn.chunks():
            if out.finish_reason == FinishReason.ERROR:  # the turn rolls back: no done event
                yield sse.generation_failed(out.error)
                break
            sampled += out.token_ids
            if out.token_ids:
                event = {"type": "token", "text": out.text, "token_ids": out.token_ids}
                if out.logprobs is not None:
                    event["logprobs"] = logprobs_format.session(out.token_ids, out.logprobs)
                yield sse.event(event)
            if out.finished:
                yield sse.event(await final(out, sampled))
        yield sse.DONE

    return sse.response(events(), turn, headers)


async def _held(st, session_id: str, owner: str | None) -> dict:
    """What the session holds after an append (as GET /v1/sessions/{id} reports it)."""
    try:
        info = await engine_call(st.engine.session_info(session_id, owner))
    except APIError:  # closed or evicted right after its turn
        return {}
    return {k: info[k] for k in ("history_tokens", "kv_tokens", "resident_kv_bytes")}
