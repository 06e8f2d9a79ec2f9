"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from engine import FinishReason
from service.errors import APIError
from service.schemas import ChatCompletionRequest, CompletionRequest
from service.turns import check_model, sampling_params, start_turn

router = APIRouter(prefix="/v1")


@router.get("/models")
async def models(request: Request):
    st = request.app.state.s5
    return {"object": "list", "data": [{"id": st.model_name, "object": "model", "created": 0, "owned_by": "s5serve"}]}


def _session_id(request: Request, body) -> str | None:
    return body.session_id or request.headers.get("x-session-id")


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    st = request.app.state.s5
    check_model(st, body.model)
    tok = st.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer", "invalid_request")
    try:
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    except Exception as exc:
        raise APIError(400, f"messages: {exc}", "invalid_request", "messages") from exc
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    stops = (eot,) if isinstance(eot, int) and eot != tok.unk_token_id else ()
    turn = await start_turn(st, ids, sampling_params(body, stops), _session_id(request, body), match_prefix=True)
    return await _respond(body, turn, chat=True, model=st.model_name)


@router.post("/completions")
async def completions(body: CompletionRequest, request: Request):
    st = request.app.state.s5
    check_model(st, body.model)
    p = body.prompt
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        if len(p) != 1:
            raise APIError(400, "only one prompt per request", "invalid_request", "prompt")
        p = p[0]
    if isinstance(p, str):
        if st.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send token ids", "invalid_request", "prompt")
        ids = st.tokenizer(p)["input_ids"]
    else:
        ids = list(p)
    turn = await start_turn(st, ids, sampling_params(body), _session_id(request, body), match_prefix=True)
    return await _respond(body, turn, chat=False, model=st.model_name)


def _usage(turn, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": turn.num_prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": turn.num_prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": turn.num_cached_tokens},
    }


def _finish(reason: FinishReason | None) -> str:
    return "length" if reason == FinishReason.LENGTH else "stop"


async def _respond(body, turn, chat: bool, model: str):
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    headers = {"X-Request-Id": turn.request_id}

    if not body.stream:
        text, last, n = "", None, 0
        async for out in turn.stream:
            text += out.text_delta
            n, last = out.num_output_tokens, out
        if last is not None and last.finish_reason == FinishReason.ERROR:
            raise APIError(500, last.error or "generation failed", "generation_failed")
        choice = {"index": 0, "finish_reason": _finish(last.finish_reason if last else None), "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model,
                             "choices": [choice], "usage": _usage(turn, n)}, headers=headers)

    chunk_obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta_text: str | None, finish: str | None, first: bool) -> str:
        if chat:
            delta = {"role": "assistant", "content": delta_text or ""} if first else (
                {"content": delta_text} if delta_text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
        return json.dumps({"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": [choice]})

    async def events():
        first, n = True, 0
        async for out in turn.stream:
            n = out.num_output_tokens
            if out.finish_reason == FinishReason.ERROR:
                yield json.dumps({"error": {"message": out.error, "type": "server_error", "param": None,
                                            "code": "generation_failed"}})
                break
            if out.text_delta or (first and not out.finished):
                yield chunk(out.text_delta, None, first)
                first = False
            if out.finished:
                yield chunk(None, _finish(out.finish_reason), False)
        if body.include_usage:
            yield json.dumps({"id": rid, "object": chunk_obj, "created": created, "model": model,
                              "choices": [], "usage": _usage(turn, n)})
        yield "[DONE]"

    return EventSourceResponse(events(), sep="\n", headers=headers, ping=3600)
