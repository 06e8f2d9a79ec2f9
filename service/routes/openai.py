"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from engine import FinishReason
from service import chat, sse, structured, tools
from service.auth import tenant
from service.errors import APIError, valid_text
from service.schemas import ERROR_RESPONSES, STREAM_RESPONSES, ChatCompletionRequest, CompletionRequest
from service.turns import (check_model, check_supported, collect, render_chat, require_ready, sampling_params,
                           start_turn, tokenize)

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


@router.get("/models")
async def models(request: Request, owner: str | None = Depends(tenant)):
    st = request.app.state.s5
    require_ready(st)
    card = {"id": st.model_name, "object": "model", "created": 0, "owned_by": "s5serve",
            "max_model_len": st.max_model_len}
    return {"object": "list", "data": [card]}


def _serving(request: Request, body):
    """The app state, once the server is ready and the body names this model (or none) and asks
    for nothing the server does not do."""
    st = request.app.state.s5
    require_ready(st)
    check_model(st, body.model)
    check_supported(body)
    return st


def _session_id(request: Request, body) -> str | None:
    return body.session_id or request.headers.get("x-session-id") or None


@router.post("/chat/completions", responses=STREAM_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request, owner: str | None = Depends(tenant)):
    st = _serving(request, body)
    tok = st.tokenizer
    if tok is None:
        raise APIError(400, "this model has no tokenizer", "invalid_request")
    setup = tools.setup_of(body)
    grammar = await structured.grammar_of(st, body)
    if setup is not None and setup.forced and grammar is not None:
        raise APIError(400, "tool_choice: a required or named tool call cannot also follow a response_format",
                       "invalid_request", "tool_choice")
    if setup is not None or tools.uses_tools(body.messages):
        msgs, fns = tools.template_messages(tok, body.messages, setup)
        ids = await render_chat(st, msgs, 0, [], generation_prompt=True, tools=fns)
    else:
        ids = await render_chat(st, chat.chat_messages(body.messages), 0, [], generation_prompt=True)
    if setup is not None and grammar is None:
        grammar = await structured.checked(st, setup.grammar(), "tools")
    elif setup is not None:  # auto beside a response_format: the reply follows the format, no call
        setup = None
    params = sampling_params(body, st.end_of_turn_ids, grammar)
    turn = await start_turn(st, ids, params, _session_id(request, body), owner, match_prefix=True)
    return await _respond(body, turn, request, chat=True, model=st.model_name, calls=setup)


@router.post("/completions", responses=STREAM_RESPONSES)
async def completions(body: CompletionRequest, request: Request, owner: str | None = Depends(tenant)):
    st = _serving(request, body)
    p = body.prompt
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        if len(p) != 1:
            raise APIError(400, "only one prompt per request", "invalid_request", "prompt")
        p = p[0]
    if isinstance(p, str):
        if st.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send token ids", "invalid_request", "prompt")
        ids = await tokenize(st, valid_text(p, "prompt"))
    else:
        ids = list(p)
    echo = ""  # `echo`: the reply's text starts with the prompt's
    if body.echo:
        echo = p if isinstance(p, str) else (st.tokenizer.decode(ids, skip_special_tokens=True) if st.tokenizer else "")
    params = sampling_params(body, grammar=await structured.grammar_of(st, body))
    turn = await start_turn(st, ids, params, _session_id(request, body), owner, match_prefix=True)
    return await _respond(body, turn, request, chat=False, model=st.model_name, echo=echo)


def _usage(turn, last) -> dict:
    n = last.num_output_tokens if last is not None else 0
    cached = last.num_cached_tokens if last is not None else 0  # positions reused from the row
    return {
        "prompt_tokens": turn.num_prompt_tokens,
        "completion_tokens": n,
        "total_tokens": turn.num_prompt_tokens + n,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _finish(reason: FinishReason | None) -> str:
    return "length" if reason == FinishReason.LENGTH else "stop"


async def _respond(body, turn, request: Request, chat: bool, model: str, echo: str = "",
                   calls: tools.ToolSetup | None = None):
    """The reply, whole or streamed. With `calls` (a chat request that may call tools), a reply
    that is a call answers `tool_calls` (finish reason `tool_calls`) instead of content."""
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    headers = {"X-Request-Id": turn.request_id}

    if not body.stream:
        text, ids, last = await collect(turn, request)
        finish = _finish(last.finish_reason if last else None)
        message = {"role": "assistant", "content": text}
        call = tools.parse_call(text, calls) if calls is not None else None
        if call is not None:
            message, finish = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
        choice = {"index": 0, "finish_reason": finish, "logprobs": None}
        choice.update({"message": message} if chat else {"text": echo + text})
        if body.return_token_ids:
            choice["token_ids"] = ids
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model,
                             "choices": [choice], "usage": _usage(turn, last)}, headers=headers)

    chunk_obj = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": rid, "object": chunk_obj, "created": created, "model": model}

    def chunk(delta_text: str | None, finish: str | None, first: bool, token_ids: list[int] | None = None,
              delta: dict | None = None) -> bytes:
        if chat:
            if delta is None and first:
                delta = {"role": "assistant", "content": delta_text or ""}
            elif delta is None:
                delta = {"content": delta_text} if delta_text else {}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
        if body.return_token_ids:
            choice["token_ids"] = token_ids or []
        return sse.event({**head, "choices": [choice]})

    def call_chunks(call: dict, first: bool) -> list[bytes]:
        """A tool call in OpenAI's delta format: its id, type and name, then its arguments."""
        opening = {"index": 0, "id": call["id"], "type": "function",
                   "function": {"name": call["function"]["name"], "arguments": ""}}
        lead = {"role": "assistant", "content": None} if first else {}
        arguments = {"index": 0, "function": {"arguments": call["function"]["arguments"]}}
        return [chunk(None, None, first, delta={**lead, "tool_calls": [opening]}),
                chunk(None, None, False, delta={"tool_calls": [arguments]}),
                chunk(None, "tool_calls", False, delta={})]

    async def events():
        first, last = True, None
        held = tools.CallStream(calls) if calls is not None else None
        async for out in turn.chunks():
            last = out
            if out.finish_reason == FinishReason.ERROR:
                err = {"message": out.error, "type": "server_error", "param": None, "code": "generation_failed"}
                yield sse.event({"error": err})
                break
            text = held.feed(out.text) if held is not None else out.text
            if out.finished and held is not None:
                rest, call = held.end()
                if call is not None:
                    for c in call_chunks(call, first):
                        yield c
                    continue
                text += rest
            if text or (out.token_ids and (first or body.return_token_ids) and held is None):
                yield chunk(echo + text if first else text, None, first, out.token_ids)
                first = False
            if out.finished:
                yield chunk(None, _finish(out.finish_reason), first)
        else:
            if body.include_usage:
                yield sse.event({**head, "choices": [], "usage": _usage(turn, last)})
        yield sse.DONE

    return sse.response(events(), turn, headers)
