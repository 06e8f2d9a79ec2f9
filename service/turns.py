"""From a validated body to an engine request and back: sampling params, prompt tokens,
session prefix reuse, admission (429/503), metering, ownership of requests in flight, and
cancellation when the client goes away. Shared by the OpenAI routes and the session routes."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request as HTTPRequest

from engine import FinishReason, Request, RequestOutput, SamplingParams
from engine.engine import Engine
from engine.types import EngineError
from service.errors import APIError, from_engine


@dataclass
class Turn:
    request_id: str
    stream: AsyncIterator[RequestOutput]  # metered; leaving it early aborts the request
    num_prompt_tokens: int  # the whole prompt as the client sees it
    started: float


def valid_text(text: str, param: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{param}: invalid unicode (lone surrogate)", "invalid_request", param) from exc
    return text


def sampling_params(body, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    given = [n for n in (body.max_completion_tokens, body.max_tokens) if n is not None]
    max_tokens = given[0] if given else 256  # 0 (session route only): an append
    top_k = body.top_k if body.top_k and body.top_k > 0 else 0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=top_k,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        stop=tuple(valid_text(s, "stop") for s in (body.stop or ())),
        stop_token_ids=stop_token_ids,
        ignore_eos=body.ignore_eos,
    )


def require_ready(state) -> None:
    if state.draining:
        raise APIError(503, "server is draining", "draining", headers={"Retry-After": "5"})
    if not state.ready or state.worker is None or not state.worker.alive:
        raise APIError(503, state.load_error or "model is loading", "not_ready", headers={"Retry-After": "5"})


def check_model(state, model: str | None) -> None:
    if model not in (None, "", state.model_name):
        raise APIError(404, f"model {model!r} not found", "model_not_found", "model")


async def start_turn(state, prompt_ids: list[int], params: SamplingParams, session_id: str | None,
                     owner: str | None, match_prefix: bool, expect_history_len: int | None = None) -> Turn:
    """Submit a turn. With `match_prefix`, `prompt_ids` is the whole conversation: the stored
    history must be its prefix (only the rest is prefilled), else the session is re-prefilled.
    `expect_history_len`: the history length `prompt_ids` was prepared against (see Request)."""
    require_ready(state)
    m = state.metrics
    if session_id is not None:
        state.sessions.check(session_id, owner)
    worker = state.worker
    if worker.num_active >= state.settings.max_queued:
        m.rejections.labels("queue_full").inc()
        raise APIError(429, "too many requests in flight; retry later", "queue_full", headers={"Retry-After": "1"})
    rid = f"req-{uuid.uuid4().hex}"

    def plan(engine: Engine) -> list[int]:
        if session_id is None or not match_prefix:
            return prompt_ids
        stored = engine.session_tokens(session_id)
        if stored and len(stored) < len(prompt_ids) and prompt_ids[: len(stored)] == stored:
            return prompt_ids[len(stored):]
        if stored:
            engine.reset_session(session_id)  # the conversation diverged: prefill it again
        return prompt_ids

    try:
        new_ids = prompt_ids if session_id is None else await worker.call(plan, worker.engine)
        raw = await worker.generate(Request(rid, new_ids, params, session_id, expect_history_len))
    except EngineError as err:
        m.rejections.labels(err.code).inc()
        raise from_engine(err) from err
    m.prompt_tokens.inc(len(prompt_ids))
    state.active[rid] = owner
    started = time.monotonic()
    return Turn(rid, _metered(state, rid, raw, started), len(prompt_ids), started)


async def _metered(state, rid: str, raw: AsyncIterator[RequestOutput], started: float):
    m = state.metrics
    last, finished = None, False
    try:
        async for out in raw:
            now = time.monotonic()
            if out.new_token_ids:
                if last is None:
                    m.ttft.observe(now - started)
                    m.prefill_tokens.inc(out.num_prompt_tokens)
                    m.cached_tokens.inc(out.num_cached_tokens)
                else:
                    m.itl.observe(now - last)
                last = now
                m.generation_tokens.inc(len(out.new_token_ids))
            if out.finished and last is None and out.finish_reason == FinishReason.LENGTH:  # an append
                m.prefill_tokens.inc(out.num_prompt_tokens)
                m.cached_tokens.inc(out.num_cached_tokens)
            if out.finished:
                finished = True
                m.finished.labels(out.finish_reason.value).inc()
                m.e2e.observe(now - started)
            yield out
    finally:
        state.active.pop(rid, None)
        if not finished:  # the client went away: the request is aborted at the next step
            m.finished.labels("abort").inc()
        await raw.aclose()


async def collect(turn: Turn, request: HTTPRequest) -> tuple[str, list[int], RequestOutput | None]:
    """Non-streaming: gather the whole reply; abort if the client disconnects meanwhile."""
    text, ids, last = "", [], None

    async def consume():
        nonlocal text, last
        async for out in turn.stream:
            text += out.text_delta
            ids.extend(out.new_token_ids)
            last = out

    task = asyncio.ensure_future(consume())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()  # unwinds the stream, which aborts the request
            try:
                await task
            except asyncio.CancelledError:
                pass
            return text, ids, None
    await task
    if last is not None and last.finish_reason == FinishReason.ERROR:
        raise APIError(500, last.error or "generation failed", "generation_failed")
    return text, ids, last
