"""The OpenAI Responses API on sessions: /v1/responses.

A stored response's conversation lives in a session's KV row. A response that continues another
(`previous_response_id`) that is still its session's latest runs as the session's next turn: only
what its input adds is prefilled, and `usage.input_tokens_details.cached_tokens` reports the
history reused from the row. A response that branches off an earlier one (its session has moved
on), whose session expired, or that is not stored (`store: false`) starts from its conversation
rebuilt from the stored responses: every earlier response's input messages and output text,
rendered with the chat template and prefilled at once (in a new session when it is stored, in no
session when it is not). Either way the reply is what /v1/chat/completions gives for the whole
conversation. Responses belong to the API key that created them: another key's answers 404.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass

import msgspec
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from starlette.background import BackgroundTask

from engine import FinishReason
from engine.client import EngineDead
from service import chat, structured
from service import responses as rs
from service.auth import tenant
from service.errors import APIError, respell
from service.schemas import ERROR_RESPONSES, STREAM_RESPONSES
from service.turns import check_model, collect, engine_call, open_session, render_chat, require_ready, start_turn

router = APIRouter(prefix="/v1/responses", responses=ERROR_RESPONSES)
_encode = msgspec.json.Encoder().encode
# what the engine and the chat template call this API's parameters in their errors
_PARAMS = {"max_tokens": "max_output_tokens", "prompt": "input", "messages": "input", "response_format": "text.format"}


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"response {response_id} not found", "response_not_found", param)


@dataclass
class _Plan:
    """Where a response's turn runs and what it feeds."""

    session_id: str | None  # None: a stateless turn (store false)
    history_len: int  # tokens the session held before the turn
    ids: list[int]  # what the turn prefills after them
    new_session: bool  # created for this response: closed again if the turn does not complete


async def _in_place(st, prev: dict, messages: list[dict], owner: str | None) -> _Plan | None:
    """The next turn of the previous response's session, if the session still holds exactly
    that response's conversation."""
    try:
        history_len, tail = await engine_call(st.engine.call("session_tail", prev["session_id"], chat.TAIL_TOKENS,
                                                             owner))
    except APIError as err:
        # expired, or kept under other model or KV settings: rebuilt from the records
        if err.code in ("session_not_found", "session_evicted", "session_incompatible"):
            return None
        raise
    if history_len != prev["history_len"]:  # a branch: the session moved on past this response
        return None
    return _Plan(prev["session_id"], history_len, await render_chat(st, messages, history_len, tail, True), False)


async def _rebuilt(st, body, chain: list[dict], messages: list[dict], owner: str | None) -> _Plan:
    """A turn over the whole conversation: the stored responses' messages and replies, then
    `messages`; in a new session when the response is stored."""
    conversation = [m for rec in chain for m in [*rec["messages"],
                                                 {"role": "assistant", "content": rs.output_text(rec["body"])}]]
    ids = await render_chat(st, conversation + messages, 0, [], True)
    if not body.store:
        return _Plan(None, 0, ids, False)
    return _Plan(await open_session(st, owner), 0, ids, True)


async def _drop(st, plan: _Plan, owner: str | None) -> None:
    """Close a session created for a response whose turn did not complete."""
    if plan.new_session:
        with contextlib.suppress(EngineDead):  # the engine is gone: nothing is left to close
            await st.engine.close_session(plan.session_id, owner)


async def _chain(st, response_id: str, owner: str | None) -> list[dict]:
    """The stored responses from the conversation's first to `response_id`, oldest first."""
    chain, whole = await engine_call(st.engine.call("response_chain", response_id, owner))
    if not chain:
        raise _not_found(response_id, "previous_response_id")
    if not whole:
        raise APIError(404, f"response {chain[0]['previous_id']}, which response {response_id} continues, was "
                       "deleted: its conversation cannot be rebuilt", "response_not_found", "previous_response_id")
    return chain


async def _start(st, body, messages: list[dict], params, owner: str | None):
    """(plan, turn): the response's turn, submitted."""
    prev = None
    if body.previous_response_id is not None:
        prev = await engine_call(st.engine.call("get_response", body.previous_response_id, owner))
        if prev is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
    for attempt in range(2):
        plan = None
        if prev is not None and body.store and attempt == 0:
            plan = await _in_place(st, prev, messages, owner)
        if plan is None:  # the conversation from the stored responses (reading them only now)
            chain = await _chain(st, prev["id"], owner) if prev is not None else []
            plan = await _rebuilt(st, body, chain, messages, owner)
        try:
            return plan, await start_turn(st, plan.ids, params, plan.session_id, owner, match_prefix=False,
                                          expect_history_len=plan.history_len if plan.session_id else None)
        except APIError as err:
            await _drop(st, plan, owner)
            # a turn of the same session started meanwhile: this one branches off instead
            if err.code != "session_busy" or plan.new_session or attempt:
                raise
    raise AssertionError("unreachable")


def _record(response_id: str, owner, plan: _Plan, body, messages, last, obj: dict) -> dict:
    return {"id": response_id, "owner": owner, "session_id": plan.session_id,
            "previous_id": body.previous_response_id,
            "history_len": plan.history_len + len(plan.ids) + last.num_output_tokens,
            "messages": messages, "body": obj}


@router.post("", responses=STREAM_RESPONSES)
async def create_response(body: rs.ResponsesRequest, request: Request, owner: str | None = Depends(tenant)):
    st = request.app.state.s5
    require_ready(st)
    check_model(st, body.model)
    rs.check_supported(body)
    if st.tokenizer is None:
        raise APIError(400, "this model has no tokenizer", "invalid_request")
    messages = rs.input_messages(body)
    grammar = rs.text_grammar(body)
    if grammar is not None:
        grammar = await structured.checked(st, grammar, "text.format")
    params = rs.sampling(body, st.end_of_turn_ids, grammar)
    try:
        plan, turn = await _start(st, body, messages, params, owner)
    except APIError as err:  # the engine's and the chat template's names for this API's parameters
        respell(err, _PARAMS)
        raise
    response_id, item_id, created = rs.new_id("resp"), rs.new_id("msg"), int(time.time())
    headers = {"X-Request-Id": turn.request_id}

    def final(text: str, last) -> dict:
        status = rs.status_of(last.finish_reason)
        use = rs.usage(plan.history_len + len(plan.ids), last.num_cached_tokens, last.num_output_tokens)
        return rs.response_object(response_id, created, st.model_name, body, params, status,
                                  [rs.message_item(item_id, text, status)], use)

    async def keep(obj: dict, last) -> None:
        if body.store:
            await engine_call(st.engine.call("put_response", _record(response_id, owner, plan, body, messages,
                                                                     last, obj)))

    if not body.stream:
        kept = False
        try:
            text, _, last, _ = await collect(turn, request)
            if last is None:  # the client left
                return JSONResponse({}, 499)
            obj = final(text, last)
            if last.finish_reason == FinishReason.ABORT:  # cancelled: not kept, not continuable
                return JSONResponse({**obj, "status": "cancelled", "incomplete_details": None}, headers=headers)
            await keep(obj, last)
            kept = True
        finally:
            if not kept:
                await _drop(st, plan, owner)
        return JSONResponse(obj, headers=headers)

    seq = itertools.count()
    done = False

    def event(kind: str, **fields) -> bytes:
        data = _encode({"type": kind, "sequence_number": next(seq), **fields})
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    async def events():
        nonlocal done
        head = rs.response_object(response_id, created, st.model_name, body, params, "in_progress", [])
        yield event("response.created", response=head)
        yield event("response.in_progress", response=head)
        yield event("response.output_item.added", output_index=0, item=rs.message_item(item_id, "", "in_progress"))
        at = {"item_id": item_id, "output_index": 0, "content_index": 0}
        yield event("response.content_part.added", **at,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        text, last = [], None
        async for out in turn.chunks():
            if out.finish_reason == FinishReason.ERROR:
                yield event("error", code="generation_failed", message=out.error or "generation failed", param=None)
                err = {"code": "server_error", "message": out.error or "generation failed"}
                yield event("response.failed", response=rs.response_object(
                    response_id, created, st.model_name, body, params, "failed", [], error=err))
                return
            if out.text:
                text.append(out.text)
                yield event("response.output_text.delta", **at, delta=out.text, logprobs=[])
            last = out
        if last is None or not last.finished:
            return
        if last.finish_reason == FinishReason.ABORT:  # cancelled: not kept, not continuable
            yield event("response.failed", response=rs.response_object(
                response_id, created, st.model_name, body, params, "cancelled", []))
            return
        obj = final("".join(text), last)
        try:
            await keep(obj, last)
        except APIError as err:
            yield event("error", code=err.code, message=err.message, param=None)
            return
        done = True
        item = obj["output"][0]
        yield event("response.output_text.done", **at, text=item["content"][0]["text"], logprobs=[])
        yield event("response.content_part.done", **at, part=item["content"][0])
        yield event("response.output_item.done", output_index=0, item=item)
        yield event(f"response.{obj['status']}", response=obj)

    async def cleanup() -> None:
        """However the stream ends: the turn is closed (aborted if the client left), and a
        session created for a response that was not kept is closed."""
        turn.close()
        if not done:
            await _drop(st, plan, owner)

    return EventSourceResponse(events(), sep="\n", headers=headers, ping=3600, background=BackgroundTask(cleanup))


@router.get("/{response_id}")
async def get_response(response_id: str, request: Request, owner: str | None = Depends(tenant)):
    st = request.app.state.s5
    require_ready(st)
    rec = await engine_call(st.engine.call("get_response", response_id, owner))
    if rec is None:
        raise _not_found(response_id, "response_id")
    return rec["body"]


@router.get("/{response_id}/input_items")
async def input_items(response_id: str, request: Request, owner: str | None = Depends(tenant),
                      order: str = Query("desc", pattern="^(asc|desc)$"), limit: int = Query(20, ge=1, le=100),
                      after: str | None = None):
    """The input messages of a response (its instructions excluded), newest first by default."""
    st = request.app.state.s5
    require_ready(st)
    rec = await engine_call(st.engine.call("get_response", response_id, owner))
    if rec is None:
        raise _not_found(response_id, "response_id")
    skip = rec["body"]["instructions"] is not None
    items = [rs.input_item(response_id, i, m) for i, m in enumerate(rec["messages"][skip:])]
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [it["id"] for it in items]
        if after not in ids:
            raise APIError(400, f"after: no input item {after} in response {response_id}", "invalid_request", "after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


@router.delete("/{response_id}")
async def delete_response(response_id: str, request: Request, owner: str | None = Depends(tenant)):
    """Deletes the stored response; its session goes with the last response that refers to it."""
    st = request.app.state.s5
    require_ready(st)
    deleted, orphan = await engine_call(st.engine.call("delete_response", response_id, owner))
    if not deleted:
        raise _not_found(response_id, "response_id")
    if orphan is not None:
        try:
            info = await engine_call(st.engine.session_info(orphan, owner))
        except APIError:  # gone already (expired)
            info = None
        if info is not None and info["state"] != "busy":  # a turn in flight will refer to it
            await engine_call(st.engine.close_session(orphan, owner))
    return {"id": response_id, "object": "response.deleted", "deleted": True}
