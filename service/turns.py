"""From a validated body to an engine request: sampling params, prompt tokens, session prefix
reuse, admission. Shared by the OpenAI routes and the session routes."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine import Request, RequestOutput, SamplingParams
from engine.engine import Engine
from service.errors import APIError


@dataclass
class Turn:
    request_id: str
    stream: AsyncIterator[RequestOutput]
    num_prompt_tokens: int  # the whole prompt as the client sees it
    num_cached_tokens: int  # reused from the session's row
    started: float


def sampling_params(body, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    max_tokens = body.max_completion_tokens or body.max_tokens or 256
    top_k = body.top_k if body.top_k and body.top_k > 0 else 0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=top_k,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        stop=tuple(body.stop or ()),
        stop_token_ids=stop_token_ids,
        ignore_eos=body.ignore_eos,
    )


def require_ready(state) -> None:
    if state.draining:
        raise APIError(503, "server is draining", "draining")
    if not state.ready or state.worker is None or not state.worker.alive:
        raise APIError(503, state.load_error or "model is loading", "not_ready")


def check_model(state, model: str | None) -> None:
    if model not in (None, "", state.model_name):
        raise APIError(404, f"model {model!r} not found", "model_not_found", "model")


async def start_turn(state, prompt_ids: list[int], params: SamplingParams, session_id: str | None,
                     match_prefix: bool) -> Turn:
    """Submit a turn. With `match_prefix`, `prompt_ids` is the whole conversation: the stored
    history must be its prefix (only the rest is prefilled), else the session is re-prefilled."""
    require_ready(state)
    worker = state.worker
    if worker.num_active >= state.settings.max_queued:
        raise APIError(429, "too many requests in flight", "queue_full", headers={"Retry-After": "1"})
    rid = f"req-{uuid.uuid4().hex}"
    new_ids = prompt_ids

    def plan(engine: Engine) -> list[int]:
        if session_id is None or not match_prefix:
            return prompt_ids
        stored = engine.session_tokens(session_id)
        if stored and len(stored) < len(prompt_ids) and prompt_ids[: len(stored)] == stored:
            return prompt_ids[len(stored):]
        if stored:
            engine.reset_session(session_id)
        return prompt_ids

    if session_id is not None:
        new_ids = await worker.call(plan, worker.engine)
    stream = await worker.generate(Request(rid, new_ids, params, session_id))
    cached = len(prompt_ids) - len(new_ids) if match_prefix else 0
    return Turn(rid, stream, len(prompt_ids), cached, time.monotonic())
