"""create_app(): the FastAPI application and its lifespan (load, warm up, serve, drain)."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from engine import Engine, Request, SamplingParams
from engine.model_loader import LoadedModel
from engine.worker import Worker
from service import errors
from service.metrics import Metrics
from service.routes import ops, openai, sessions
from service.sessions import SessionStore
from service.settings import Settings

log = logging.getLogger("s5serve")


class AppState:
    """What the routes share: the worker (the only path to the engine), tenants' sessions,
    requests in flight, metrics and lifecycle flags."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.worker: Worker | None = None
        self.model_name = settings.served_model_name or ""
        self.tokenizer = None
        self.max_model_len = 0
        self.metrics = Metrics()
        self.sessions = SessionStore()
        self.active: dict[str, str | None] = {}  # request id -> tenant, while it streams
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        self.fatal: str | None = None  # the engine loop died: the process should exit non-zero
        self.on_fatal: Callable[[], None] | None = None  # set by the server runner (cli.py)


def create_app(settings: Settings | None = None, loaded: LoadedModel | None = None) -> FastAPI:
    settings = settings or Settings()
    state = AppState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks = [asyncio.create_task(_start(state, loaded)), asyncio.create_task(_expire(state)),
                 asyncio.create_task(_watch(state)), asyncio.create_task(_loop_lag(state))]
        try:
            yield
        finally:
            state.draining = True
            for t in tasks:
                t.cancel()
            if state.worker is not None:
                await state.worker.stop()
                if not state.worker.alive:
                    state.worker.engine.close()

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
    return app


async def _start(state: AppState, loaded: LoadedModel | None) -> None:
    try:
        engine = await asyncio.to_thread(Engine, state.settings.engine, loaded)
        state.tokenizer = engine.tokenizer
        state.max_model_len = engine.max_model_len
        state.model_name = state.model_name or engine.model_name
        for sid, s in engine.sessions.items():  # sessions kept from before a restart (SessionDB)
            state.sessions.add(sid, s.owner)
        worker = Worker(engine, on_step=state.metrics.on_step)
        await worker.start()
        state.worker = worker
        stream = await worker.generate(Request("warmup", [2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True)))
        async for _ in stream:
            pass
        # Everything allocated so far (model, tokenizer, engine) lives as long as the process: move
        # it out of the collector's view so full collections stay short while serving.
        gc.collect()
        gc.freeze()
        state.ready = True
        log.info("s5serve ready: model %s, kv policy %s", state.model_name, state.settings.engine.kv_policy)
    except Exception as exc:  # readiness stays 503 and says why
        log.exception("startup failed")
        state.load_error = str(exc)


async def _watch(state: AppState, period: float = 0.2, settle: float = 1.0) -> None:
    """If the engine loop dies, /health and /ready already answer 503 (they read the worker) and
    every stream has ended with an error event; refuse new work, give those events a moment to
    reach their clients, then ask the server to exit (non-zero) so a supervisor restarts it."""
    while True:
        await asyncio.sleep(period)
        worker = state.worker
        if worker is not None and worker.error is not None:
            state.fatal = f"engine failed: {worker.error}"
            state.draining = True
            log.critical("%s; shutting down for a restart", state.fatal)
            await asyncio.sleep(settle)
            if state.on_fatal is not None:
                state.on_fatal()
            return


async def _loop_lag(state: AppState, period: float = 0.02) -> None:
    """Measures how late the event loop wakes a timer: anything that blocks the loop (a
    synchronous call in a route, a slow serializer) shows up here and in /metrics."""
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(period)
        state.metrics.observe_loop_lag(max(0.0, loop.time() - t0 - period))


async def _expire(state: AppState) -> None:
    """Evict sessions idle for longer than the TTL."""
    period = min(5.0, max(0.05, state.settings.session_ttl_s / 4))
    while True:
        await asyncio.sleep(period)
        if state.worker is None or not state.worker.alive:
            continue
        gone = await state.worker.call(state.worker.engine.expire_idle, state.settings.session_ttl_s)
        if gone:
            state.metrics.evictions.labels("ttl").inc(len(gone))
