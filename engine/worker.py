"""Worker: the one bridge between the synchronous engine and asyncio.

One dedicated thread owns the Engine and is the only caller of it. The event loop talks to it
through a command queue (`call` runs a function on the engine thread and awaits its result) and
receives outputs through one asyncio.Queue per request (filled with `call_soon_threadsafe`).
Leaving a request's stream early (the consumer is cancelled or stops iterating) aborts the request
at the next step boundary; the engine then frees its row or rolls its session back.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.engine import Engine
from engine.types import FinishReason, Request, RequestOutput

log = logging.getLogger("s5serve.worker")


class EngineDead(RuntimeError):
    pass


class Worker:
    def __init__(self, engine: Engine, on_step: Callable[[Engine, list[RequestOutput], float], None] | None = None):
        self.engine = engine
        self.on_step = on_step  # metrics hook, called on the engine thread after each step
        self._commands: queue.Queue = queue.Queue()
        self._channels: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None  # set if the engine loop died
        self.last_beat = time.monotonic()  # engine loop heartbeat

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="s5serve-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_active(self) -> int:
        return len(self._channels)

    # ---- API for the event loop -------------------------------------------------------------------
    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on the engine thread between steps; returns or raises its outcome."""
        if not self.alive:
            raise EngineDead("engine is not running")
        fut = self._loop.create_future()
        self._commands.put((fn, args, fut))
        return await fut

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Submit a request and stream its outputs. Raises EngineError before the first output
        if the engine refuses it."""
        channel: asyncio.Queue = asyncio.Queue()
        rid = request.request_id
        self._channels[rid] = channel
        try:
            await self.call(self.engine.add_request, request)
        except BaseException:
            self._channels.pop(rid, None)
            raise
        return self._stream(rid, channel)

    async def _stream(self, rid: str, channel: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                out = await channel.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._channels.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Abort at the next step boundary (no-op if the request already ended)."""
        if self.alive:
            self._commands.put((self.engine.abort, (request_id,), None))

    # ---- the engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self.last_beat = time.monotonic()
                self._drain(block=not engine.has_work())
                if self._stopping:
                    break
                if engine.has_work():
                    t0 = time.perf_counter()
                    outs = engine.step()
                    if self.on_step is not None:
                        self.on_step(engine, outs, time.perf_counter() - t0)
                    for out in outs:
                        self._deliver(out)
        except BaseException as exc:  # the engine itself failed: every stream ends with an error
            log.exception("engine loop died")
            self.error = exc
            for rid in list(self._channels):
                self._deliver(
                    RequestOutput(rid, [], "", True, FinishReason.ERROR, error=f"engine failed: {exc}")
                )

    def _drain(self, block: bool) -> None:
        """Run every queued command; when idle, wait briefly for the first one."""
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd is None:
                return
            fn, args, fut = cmd
            try:
                result, exc = fn(*args), None
            except Exception as e:  # noqa: BLE001 - handed to the caller
                result, exc = None, e
            if fn == self.engine.abort and isinstance(result, RequestOutput):
                self._deliver(result)
            if fut is not None:
                self._loop.call_soon_threadsafe(_settle, fut, result, exc)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, out: RequestOutput) -> None:
        channel = self._channels.get(out.request_id)
        if channel is not None:
            self._loop.call_soon_threadsafe(channel.put_nowait, out)


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.cancelled():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
