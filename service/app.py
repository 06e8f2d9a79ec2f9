"""create_app(): the FastAPI application and its lifespan (start the engine process, serve, drain).

The front end (this process) handles HTTP, tokenizes, detokenizes and frames SSE; the engine runs
in a process of its own, reached only through `EngineClient` (engine/client.py). With several
front ends (`s5serve serve --api-servers N`, service/frontends.py) the engine is started by their
parent and each app attaches to it (`FrontEnd`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI

import msgspec

from engine import ipc
from engine.client import Attach, EngineClient, EngineDead
from engine.model.source import load_tokenizer
from service.logprobs import TokenText
from service import chat, errors
from service.metrics import Metrics, SharedMetrics
from service.routes import ops, openai, responses, sessions
from service.settings import Settings
from service.turns import WARM_UP, InFlight, TokenizerPool

log = logging.getLogger("s5serve")


class FrontEnd(msgspec.Struct, frozen=True):
    """One of several front-end processes: the engine it attaches to, and where the front ends
    share their metrics."""

    attach: Attach
    metrics_dir: str


class AppState:
    """What the routes share: the engine client (the only path to the engine), requests in
    flight, metrics and lifecycle flags."""

    def __init__(self, settings: Settings, front_end: FrontEnd | None = None):
        self.settings = settings
        self.front_end = front_end  # None: the only front end, which starts the engine itself
        self.shared_metrics = (SharedMetrics(front_end.metrics_dir, front_end.attach.index)
                               if front_end is not None else None)
        self.engine: EngineClient | None = None
        self.model_name = settings.served_model_name or ""
        self.tokenizer = None
        self.end_of_turn_ids: tuple[int, ...] = ()  # where chat replies stop (chat.end_of_turn_ids)
        self.token_texts = TokenText(None)  # token id -> text and bytes, for logprobs
        self.max_model_len = 0
        self.metrics = Metrics()
        self.active = InFlight()  # requests in flight and their tenants
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        self.fatal: str | None = None  # the engine died: the process should exit non-zero
        self.on_fatal: Callable[[], None] | None = None  # set by the server runner (cli.py)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.tokenizer_pool = TokenizerPool()


def create_app(settings: Settings | None = None, front_end: FrontEnd | None = None) -> FastAPI:
    settings = settings or Settings()
    state = AppState(settings, front_end)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.metrics.watch_gc(True)
        tasks = [asyncio.create_task(_start(app, state)), asyncio.create_task(_loop_lag(state))]
        if front_end is None or front_end.attach.index == 0:  # one front end evicts for all
            tasks.append(asyncio.create_task(_expire(state)))
        if state.shared_metrics is not None:
            tasks.append(asyncio.create_task(_publish_metrics(state)))
        try:
            yield
        finally:
            state.draining = True
            for t in tasks:
                t.cancel()
            if state.shared_metrics is not None:
                state.shared_metrics.publish(state.metrics)  # the last of this front end's counts
            if state.engine is not None:
                await state.engine.shutdown()
            state.tokenizer_pool.close()
            state.metrics.watch_gc(False)

    # With API keys on, only /health and /ready answer without one: the interactive docs and the
    # schema route are off (the schema stays available in-process through app.openapi()).
    docs = {} if not settings.api_keys else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="s5serve", version="0.1.0", lifespan=lifespan, **docs)
    app.state.s5 = state
    errors.install(app)
    app.add_middleware(errors.BodyLimit, max_bytes=settings.max_body_bytes)
    app.include_router(ops.router)
    app.include_router(openai.router)
    app.include_router(sessions.router)
    app.include_router(responses.router)
    return app


async def _start(app: FastAPI, state: AppState) -> None:
    """Start the engine process and load the tokenizer (and start the tokenizer process) beside
    it; ready once all are."""
    settings = state.settings
    client = EngineClient(settings.engine, on_death=lambda why: _engine_died(state, why),
                          log_level=logging.getLogger().getEffectiveLevel() or logging.INFO,
                          attach=state.front_end.attach if state.front_end is not None else None,
                          limits=ipc.Limits(settings.max_queued, settings.max_requests_per_key))
    state.engine = client

    async def load_tokenizers():  # and the process that tokenizes long texts, beside the engine's start
        tok = await asyncio.to_thread(load_tokenizer, state.settings.engine)
        await state.tokenizer_pool.start_process(tok)
        return tok

    try:
        tokenizer, info = await asyncio.gather(load_tokenizers(), client.start())
        state.tokenizer = tokenizer
        state.end_of_turn_ids = chat.end_of_turn_ids(tokenizer)
        state.token_texts = TokenText(tokenizer)
        state.max_model_len = info.max_model_len
        state.model_name = state.model_name or info.model_name
        client.on_step = state.metrics.on_step
        await _warm_up(app, state)
        # What startup built (modules, the tokenizer's tables) lives as long as the server: moved
        # out of the collector's generations, a full collection walks only what requests allocate.
        gc.collect()
        gc.freeze()
        state.ready = True
        log.info("s5serve ready: model %s, kv policy %s, engine process %d", state.model_name,
                 state.settings.engine.kv_policy, info.pid)
    except Exception as exc:  # readiness answers 503 with the reason; `s5serve serve` exits 1
        log.error("startup failed: %s", exc)
        state.load_error = str(exc)
        if state.on_fatal is not None:
            state.on_fatal()


async def _warm_up(app: FastAPI, state: AppState) -> None:
    """One short streamed completion through this front end's own routes before it reports
    ready: a front end's first request pays one-time costs (validators built, code paths run for
    the first time) that would otherwise hold up the first clients' requests. It is counted in
    no metric."""
    metrics, state.metrics = state.metrics, Metrics()
    mark = WARM_UP.set(True)
    keys = state.settings.api_keys
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    body = {"prompt": [2, 3, 4], "max_tokens": 2, "stream": True}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://warm-up") as c:
            r = await c.post("/v1/completions", json=body, headers=headers)
            if r.status_code != 200:
                log.warning("front-end warm-up answered %d: %s", r.status_code, r.text[:200])
    except Exception as exc:  # the engine is up: serve anyway, only the first request pays more
        log.warning("front-end warm-up failed: %s: %s", type(exc).__name__, exc)
    finally:
        WARM_UP.reset(mark)
        state.metrics = metrics


def _engine_died(state: AppState, why: str, settle: float = 1.0) -> None:
    """The engine process is gone: /health and /ready answer 503 from now on, every stream has
    ended with an error event; new work is refused, those events get a moment to reach their
    clients, then the server exits non-zero so a supervisor restarts it."""
    state.fatal = f"engine failed: {why}"
    state.draining = True
    log.critical("%s; shutting down for a restart", state.fatal)
    if state.on_fatal is not None:
        asyncio.get_running_loop().call_later(settle, state.on_fatal)


async def _loop_lag(state: AppState, period: float = 0.02) -> None:
    """Measures how late the event loop wakes a timer: anything that blocks the loop (a
    synchronous call in a route, a slow serializer) shows up here and in /metrics."""
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(period)
        state.metrics.observe_loop_lag(max(0.0, loop.time() - t0 - period))


async def _publish_metrics(state: AppState, period: float = 1.0) -> None:
    """With several front ends: this one's measurements, for /metrics on any of them."""
    while True:
        await asyncio.sleep(period)
        state.shared_metrics.publish(state.metrics)


async def _expire(state: AppState) -> None:
    """Evict sessions idle for longer than the TTL."""
    period = min(5.0, max(0.05, state.settings.session_ttl_s / 4))
    while True:
        await asyncio.sleep(period)
        if state.engine is None or not state.engine.alive:
            continue
        try:
            gone = await state.engine.expire_idle(state.settings.session_ttl_s)
        except EngineDead:
            return
        if gone:
            state.metrics.evictions.labels("ttl").inc(len(gone))
