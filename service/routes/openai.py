"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models (and a model by name)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from engine import FinishReason
from engine.core.types import prompt_id
from service import chat, sse, structured, tools
from service import logprobs as logprobs_format
from service.auth import tenant
from service.errors import APIError, valid_text
from service.schemas import ERROR_RESPONSES, MAX_PROMPTS, STREAM_RESPONSES, ChatCompletionRequest, CompletionRequest
from service.turns import (check_model, check_supported, collect_all, engine_names, finish_reason_text, new_request_id,
                           render_chat, require_ready, sampling_params, start_turns, tokenize)

router = APIRouter(prefix="/v1", responses=ERROR_RESPONSES)


def _model_card(st) -> dict:
    return {"id": st.model_name, "object": "model", "created": 0, "owned_by": "s5serve",
            "max_model_len": st.max_model_len}


@router.get("/models")
async def models(request: Request, owner: str | None = Depends(tenant)):
    st = request.app.state.s5
    require_ready(st)
    return {"object": "list", "data": [_model_card(st)]}


@router.get("/models/{model:path}")
async def model(model: str, request: Request, owner: str | None = Depends(tenant)):
    """The served model's card (a name with slashes, as `org/name`, included)."""
    st = request.app.state.s5
    require_ready(st)
    if model != st.model_name:
        raise APIError(404, f"model {model!r} not found", "model_not_found", "model")
    return _model_card(st)


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
    turns = await start_turns(st, ids, params, _session_id(request, body), owner, match_prefix=True,
                              names=engine_names(body))
    return await _respond(body, turns, request, chat=True, model=st.model_name, texts=st.token_texts, calls=setup)


@router.post("/completions", responses=STREAM_RESPONSES)
async def completions(body: CompletionRequest, request: Request, owner: str | None = Depends(tenant)):
    st = _serving(request, body)
    if body.echo and body.logprobs is not None:
        raise APIError(400, "logprobs with echo would need the prompt's logprobs, which this server does not "
                       "compute; leave one of them out", "invalid_request", "logprobs")
    prompts = _prompts(body.prompt)
    if len(prompts) > 1 and _session_id(request, body) is not None:
        raise APIError(400, "a session continues one prompt: send one prompt with session_id", "invalid_request",
                       "prompt")
    ids_of, echoes = [], []  # `echo`: each choice's text starts with its prompt's
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if st.tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send token ids", "invalid_request", "prompt")
            ids = await tokenize(st, valid_text(p, "prompt" if len(prompts) == 1 else f"prompt.{i}"))
        else:
            ids = list(p)
        ids_of.append(ids)
        if body.echo:
            echoes.append(p if isinstance(p, str) else (
                st.tokenizer.decode(ids, skip_special_tokens=True) if st.tokenizer else ""))
    params = sampling_params(body, grammar=await structured.grammar_of(st, body))
    rid = new_request_id()  # the X-Request-Id: cancelling it ends every prompt's request
    # each prompt a request of its own (with its n choices), all submitted at once, so that the
    # engine takes them in one step; one refused: the others are aborted and the request refused
    started = await asyncio.gather(*(start_turns(st, ids, params, _session_id(request, body), owner, match_prefix=True,
                                                 request_id=prompt_id(rid, i), names=engine_names(body))
                                     for i, ids in enumerate(ids_of)),
                                   return_exceptions=True)
    failed = [r for r in started if isinstance(r, BaseException)]
    if failed:
        for t in (t for r in started if not isinstance(r, BaseException) for t in r):
            t.close()
        raise failed[0]
    turns = [t for r in started for t in r]
    return await _respond(body, turns, request, chat=False, model=st.model_name, texts=st.token_texts,
                          echoes=[e for e in echoes for _ in range(params.n)] if body.echo else None)


def _prompts(prompt) -> list:
    """The prompts of a completions request, as OpenAI takes them: a text, a list of token ids, or
    a list of either (a choice per prompt, and per `n` of each, in order)."""
    if isinstance(prompt, str) or not prompt or not isinstance(prompt[0], (str, list)):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request", "invalid_request", "prompt")
    return list(prompt)


def _usage(turns: list, lasts: list) -> dict:
    """Each prompt once (its n completions share its prefill), every completion's tokens."""
    n = sum(last.num_output_tokens for last in lasts if last is not None)
    firsts = [(t, last) for t, last in zip(turns, lasts) if not t.fork]
    cached = sum(last.num_cached_tokens for _, last in firsts if last is not None)  # reused from the row
    prompt = sum(t.num_prompt_tokens for t, _ in firsts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": n,
        "total_tokens": prompt + n,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class _Choice:
    """One completion's place in a reply: its index, whether its first chunk went out, (the
    completions API's logprobs) where its next token's text starts, and, streamed under tools,
    its text held while it may be a call, with the token ids and logprobs not sent yet."""

    def __init__(self, index: int, echo: str, calls: tools.ToolSetup | None = None) -> None:
        self.index, self.first, self.last, self.echo = index, True, None, echo
        self.offsets = logprobs_format.TextOffsets(len(echo))
        self.held = tools.CallStream(calls) if calls is not None else None
        self.ids: list[int] = []
        self.lps: list = []

    def logprobs(self, texts: logprobs_format.TokenText, chat: bool, ids: list[int], lps) -> dict | None:
        if lps is None:
            return None
        if chat:
            return logprobs_format.chat(texts, ids, lps)
        return logprobs_format.completion(texts, ids, lps, self.offsets)


async def _merged(turns: list) -> AsyncIterator[tuple[int, object]]:
    """(index, chunk) of the turns' chunks, as they come; a turn's chunks stay in order. (One
    turn's chunks are read without it: `_respond` iterates them directly.)"""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, turn):
        try:
            async for out in turn.chunks():
                await queue.put((i, out))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, t)) for i, t in enumerate(turns)]
    try:
        open_ = len(turns)
        while open_:
            i, out = await queue.get()
            if out is None:
                open_ -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()


class _Turns:
    """The turns of one reply, closed together when the response ends."""

    def __init__(self, turns: list) -> None:
        self.turns = turns

    async def aclose(self) -> None:
        for t in self.turns:
            t.close()


async def _respond(body, turns: list, request: Request, chat: bool, model: str, texts,
                   echoes: list[str] | None = None, calls: tools.ToolSetup | None = None):
    """The reply, whole or streamed, with a choice per turn. With `calls` (a chat request that may
    call tools), a choice that is a call answers `tool_calls` (finish reason `tool_calls`)
    instead of content."""
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    headers = {"X-Request-Id": turns[0].request_id}
    wants_logprobs = body.num_logprobs is not None

    if not body.stream:
        results = await collect_all(turns, request)
        choices = []
        for i, (text, ids, last, lps) in enumerate(results):
            place = _Choice(i, echoes[i] if echoes else "")
            finish = finish_reason_text(last.finish_reason if last else None)
            message = {"role": "assistant", "content": text}
            made, made_finish = (tools.reply_calls(text, calls, finish == "length") if calls is not None
                                 else (None, None))
            if made is not None:
                message, finish = {"role": "assistant", "content": None, "tool_calls": made}, made_finish
            choice = {"index": i, "finish_reason": finish,
                      "logprobs": place.logprobs(texts, chat, ids, lps if wants_logprobs else None)}
            choice.update({"message": message} if chat else {"text": place.echo + text})
            if body.return_token_ids:
                choice["token_ids"] = ids
            choices.append(choice)
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
                             "usage": _usage(turns, [r[2] for r in results])}, headers=headers)

    chunk_obj = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": rid, "object": chunk_obj, "created": created, "model": model}
    # every chunk is `head` with one choice: its JSON up to the choice is encoded once; with
    # include_usage every chunk before the last also says `usage: null`, as OpenAI's do
    opening = sse.event({**head, "choices": []})[: -len(b"]}\n\n")]
    closing = b'],"usage":null}\n\n' if body.include_usage else b"]}\n\n"
    places = [_Choice(i, echoes[i] if echoes else "", calls) for i in range(len(turns))]

    def chunk(place: _Choice, delta_text: str | None, finish: str | None, token_ids: list[int] | None = None,
              lps=None, delta: dict | None = None) -> bytes:
        logprobs = place.logprobs(texts, chat, token_ids or [], lps) if wants_logprobs and lps else None
        if chat:
            if delta is None and place.first:
                delta = {"role": "assistant", "content": delta_text or ""}
            elif delta is None:
                delta = {"content": delta_text} if delta_text else {}
            choice = {"index": place.index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": place.index, "text": delta_text or "", "finish_reason": finish, "logprobs": logprobs}
        if body.return_token_ids:
            choice["token_ids"] = token_ids or []
        place.first = False
        return opening + sse.encode(choice) + closing

    def call_chunks(place: _Choice, made: list[dict], finish: str) -> list[bytes]:
        """Tool calls in OpenAI's delta format: per call, its index, id, type and name (the first
        with the reply's token ids and logprobs), then its arguments; then the finish."""
        out = []
        for k, call in enumerate(made):
            opening = {"index": k, "id": call["id"], "type": "function",
                       "function": {"name": call["function"]["name"], "arguments": ""}}
            lead = {"role": "assistant", "content": None} if place.first else {}
            arguments = {"index": k, "function": {"arguments": call["function"]["arguments"]}}
            out += [chunk(place, None, None, place.ids if k == 0 else None, place.lps if k == 0 else None,
                          delta={**lead, "tool_calls": [opening]}),
                    chunk(place, None, None, delta={"tool_calls": [arguments]})]
        return out + [chunk(place, None, finish, delta={})]

    async def events():
        failed = False
        one = len(turns) == 1
        async for item in turns[0].chunks() if one else _merged(turns):
            i, out = (0, item) if one else item
            place = places[i]
            place.last = out
            if out.finish_reason == FinishReason.ERROR:
                yield sse.generation_failed(out.error)
                failed = True
                break
            # token ids and logprobs go out with the text they make (held text: when it is released)
            text, made = out.text, None
            place.ids += out.token_ids
            place.lps += out.logprobs or ()
            if place.held is not None:
                text = place.held.feed(text)
                if out.finished:
                    rest, made = place.held.end(out.finish_reason == FinishReason.LENGTH)
                    text += rest
            if made is not None:
                for c in call_chunks(place, made, place.held.finish):
                    yield c
                continue
            holding = place.held is not None and place.held.holding is not False and not out.finished
            if text or (place.ids and not holding and (place.first or body.return_token_ids or wants_logprobs)):
                yield chunk(place, place.echo + text if place.first else text, None, place.ids, place.lps)
            if place.ids and not holding:
                place.ids, place.lps = [], []
            if out.finished:
                yield chunk(place, None, finish_reason_text(out.finish_reason))
        if not failed and body.include_usage:
            yield sse.event({**head, "choices": [], "usage": _usage(turns, [p.last for p in places])})
        yield sse.DONE

    return sse.response(events(), _Turns(turns), headers)
