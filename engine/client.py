"""EngineClient: the front end's only way to the engine, which runs in a process of its own.

    client = EngineClient(config)
    info = await client.start()                  # spawns the engine process, waits until it is warm
    stream = await client.generate(request)      # raises EngineError if the engine refuses it
    async for delta in stream:                   # everything new since the last iteration
        ...
    await client.shutdown()

The engine publishes one message per step for all its rows; a receiver task on the event loop
routes each row's tokens to its `RequestStream`. A stream hands its consumer everything that
arrived since the consumer last asked (`Delta`): a consumer slower than the engine gets its tokens
coalesced instead of queued one by one, and the receiver's work per row per step is an append.
Leaving a stream before it finishes (an exception, a cancelled task, `aclose`) aborts the request
at the engine's next step boundary.

If the engine process dies (its loop failed, or it was killed), `alive` turns False at once, every
open stream ends with an error delta, calls in flight raise `EngineDead`, and `on_death` is called.

A server with several front-end processes starts the engine itself (`EngineProcess`, with one
outbox per front end); each front end's client then attaches to it (`Attach`): same API, except
that `shutdown` leaves the engine to the process that started it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from engine import ipc
from engine.core.config import EngineConfig
from engine.core.types import EngineError, FinishReason, Request, TokenLogprobs, fork_id

log = logging.getLogger("s5serve.client")

WAKE_GROUP = 32  # streams resumed per pass of the event loop (see EngineClient._receive)
_POLLIN = int(zmq.POLLIN)  # a plain int: the flag type's `&` builds enum members on every test


class EngineDead(RuntimeError):
    """The engine process is gone."""


class Delta:
    """What a stream hands its consumer: every token that arrived since the last delta, and the
    request's counts as of the newest of them."""

    __slots__ = ("token_ids", "logprobs", "finished", "finish_reason", "num_prompt_tokens", "num_cached_tokens",
                 "num_output_tokens", "error", "arrived")

    def __init__(self, token_ids: list[int], last: ipc.Output, arrived: float,
                 logprobs: list[TokenLogprobs] | None = None) -> None:
        self.token_ids = token_ids
        self.logprobs = logprobs  # per token of token_ids, where the request asked for logprobs
        self.finished = last.finished
        self.finish_reason = last.finish_reason
        self.num_prompt_tokens = last.num_prompt_tokens  # tokens prefilled for this turn
        self.num_cached_tokens = last.num_cached_tokens  # history tokens reused from the row
        self.num_output_tokens = last.num_output_tokens  # tokens generated so far
        self.error = last.error  # set with FinishReason.ERROR
        self.arrived = arrived  # time.monotonic() when the newest of these tokens arrived


class RequestStream:
    """One request's outputs, coalesced. Iterate it (`async for delta in stream`); the last delta
    has `finished` set."""

    def __init__(self, client: EngineClient, request_id: str) -> None:
        self.client = client
        self.request_id = request_id
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprobs] | None = None
        self._last: ipc.Output | None = None
        self._arrived = 0.0
        self.first_arrived: float | None = None  # time.monotonic() of its first output (the prefill's end)
        self._waiter: asyncio.Future | None = None  # the consumer's, while it waits for outputs
        self._done = False  # the final output arrived
        self._delivered = False  # ... and was handed out

    def _push(self, out: ipc.Output, now: float) -> bool:
        """Take one step's output; whether the consumer waits for it (then `_wake` it)."""
        self._ids += out.new_token_ids
        if out.logprobs is not None:
            self._logprobs = (self._logprobs or []) + out.logprobs
        self._last, self._arrived = out, now
        if self.first_arrived is None:
            self.first_arrived = now
        if out.finished:
            self._done = True
        return self._waiter is not None and not self._waiter.done()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def finished(self) -> bool:
        return self._done

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self._delivered:
            raise StopAsyncIteration
        try:
            while self._last is None or (not self._ids and not self._done):
                self._waiter = self.client._loop.create_future()
                await self._waiter
        except BaseException:
            self.abort()
            raise
        delta = Delta(self._ids, self._last, self._arrived, self._logprobs)
        self._ids, self._logprobs = [], None
        if self._done:
            self._delivered = True
            self.client._streams.pop(self.request_id, None)
        return delta

    def abort(self) -> None:
        """End the request at the engine's next step (a no-op once it finished)."""
        if not self._done:
            self._done = True
            self.client._streams.pop(self.request_id, None)
            self.client.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()


def watch_exit(proc: subprocess.Popen, loop: asyncio.AbstractEventLoop, on_exit: Callable[[int], None],
               name: str) -> None:
    """Call `on_exit(exit code)` on `loop` the moment `proc` ends: a daemon thread of its own
    waits for it (and so reaps it); nothing is called once the loop has closed."""
    def wait() -> None:
        code = proc.wait()
        try:
            loop.call_soon_threadsafe(on_exit, code)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass

    threading.Thread(target=wait, name=name, daemon=True).start()


class EngineProcess:
    """The engine process, as its parent sees it: `python -m engine.process`, a fresh interpreter
    (nothing of the parent, threads, CUDA state or its main module, is inherited), given its
    config and endpoints on stdin."""

    def __init__(self, config: EngineConfig, ends: ipc.Endpoints, log_level: int = logging.INFO) -> None:
        self.ends = ends
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.process", str(os.getpid()), str(log_level)],
                                     stdin=subprocess.PIPE)
        self.proc.stdin.write(msgspec.json.encode(config) + b"\n" + msgspec.json.encode(ends))
        self.proc.stdin.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def shutdown(self, timeout: float = 10.0) -> int:
        """Ask the engine to stop (it ends every request), kill it if it does not within `timeout`;
        its exit code. For a parent that holds no EngineClient of its own (blocking)."""
        if self.proc.poll() is None:
            ctx = zmq.Context(1)
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(self.ends.inbox)
            sock.send(ipc.encoder().encode(ipc.Shutdown()))
            sock.close()
            ctx.term()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("the engine did not stop within %.0f s; killing it", timeout)
                self.proc.kill()
        code = self.proc.wait()
        shutil.rmtree(self.ends.dir, ignore_errors=True)
        return code


class Attach(msgspec.Struct, frozen=True):
    """How a front end reaches an engine process that another process started: the endpoints,
    which outbox is this front end's, and the engine's pid (to see it end)."""

    ends: ipc.Endpoints
    index: int
    engine_pid: int


class EngineClient:
    def __init__(self, config: EngineConfig, on_death: Callable[[str], None] | None = None,
                 log_level: int = logging.INFO, attach: Attach | None = None,
                 limits: ipc.Limits | None = None) -> None:
        self.config = config
        self.on_death = on_death  # called once, on the event loop, if the engine process dies
        self.log_level = log_level
        self.attach = attach  # None: this client starts (and owns) the engine process
        self.limits = limits  # admission limits sent with every request (the engine applies them)
        self.index = attach.index if attach is not None else 0
        self.info: ipc.EngineInfo | None = None
        self.stats: ipc.EngineStats | None = None  # the newest snapshot the engine published
        self.on_step: Callable[[ipc.StepOutputs], None] | None = None  # metrics, on the event loop
        self.error: str | None = None  # why the engine is gone
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._encode = ipc.encoder().encode
        self._engine: EngineProcess | None = None
        self._engine_pid: int | None = None
        self._pidfd: int | None = None
        self._receiver: asyncio.Task | None = None
        self._stopping = False
        self._reaped = False

    # ---- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> ipc.EngineInfo:
        """Start the engine process (or attach to one another process started) and wait until it
        is loaded and warm. Raises RuntimeError (with the engine's reason) if it fails to start."""
        self._loop = asyncio.get_running_loop()
        ends = self.attach.ends if self.attach is not None else ipc.endpoints(1)
        self._ctx = zmq.Context(1)
        self._outbox = self._ctx.socket(zmq.PULL)
        self._outbox.setsockopt(zmq.LINGER, 0)
        self._outbox.bind(ends.outs[self.index])
        # The outbox is read by the event loop itself: its descriptor wakes `_frames` (below)
        # rather than a zmq.asyncio future per message.
        self._readable: asyncio.Future | None = None
        self._loop.add_reader(self._outbox.FD, self._on_readable)
        self._inbox = self._ctx.socket(zmq.PUSH)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.connect(ends.inbox)
        self._exited = self._loop.create_future()
        if self.attach is None:
            self._engine = EngineProcess(self.config, ends, self.log_level)
            self._engine_pid = self._engine.pid
            watch_exit(self._engine.proc, self._loop, self._on_exit, "s5serve-engine-watch")
        else:
            self._engine_pid = self.attach.engine_pid
            self._watch_foreign(self.attach.engine_pid)
        decode = ipc.decoder(ipc.FromEngine).decode
        first = asyncio.ensure_future(self._frames())
        try:
            done, _ = await asyncio.wait({first, self._exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not first.done():
                first.cancel()
        if first not in done:
            why = self.error or "the engine process exited while starting"
            await self._reap()
            raise RuntimeError(why)
        frames = first.result()
        msg = decode(frames[0].buffer)
        if isinstance(msg, ipc.Failed):
            self.error = msg.error
            await self._reap()
            raise RuntimeError(msg.error)
        assert isinstance(msg, ipc.Started), msg
        self.info = msg.info
        self._receiver = asyncio.create_task(self._receive(decode, frames[1:]), name="s5serve-engine-receiver")
        return self.info

    @property
    def alive(self) -> bool:
        return self.info is not None and self.error is None

    @property
    def pid(self) -> int | None:
        """The engine process's pid."""
        return self._engine_pid

    @property
    def num_active(self) -> int:
        """Requests submitted and not yet finished (or abandoned)."""
        return len(self._streams)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process, if this client started it (it ends every request), then
        release the sockets."""
        self._stopping = True
        if self._engine is None:  # attached: the engine is its starter's to stop
            await self._reap()
            return
        if self._engine.proc.poll() is None and self.error is None:
            self._send(ipc.Shutdown())
            try:
                await asyncio.wait_for(asyncio.shield(self._exited), timeout)
            except asyncio.TimeoutError:
                log.warning("the engine did not stop within %.0f s; killing it", timeout)
        await self._reap()

    async def _reap(self) -> None:
        if self._reaped:
            return
        self._reaped = self._stopping = True
        if self._engine is not None:
            if self._engine.proc.poll() is None:
                self._engine.proc.kill()
            await asyncio.shield(self._exited)
            shutil.rmtree(self._engine.ends.dir, ignore_errors=True)
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._receiver is not None:
            self._receiver.cancel()
        self._loop.remove_reader(self._outbox.FD)
        self._inbox.close()
        self._outbox.close()
        self._ctx.term()

    def _watch_foreign(self, pid: int) -> None:
        """An engine another process started: its pidfd turns readable the moment it ends (Linux)."""
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._on_exit(None)
            return
        self._loop.add_reader(self._pidfd, self._on_exit, None)

    def _on_exit(self, code: int | None) -> None:
        if self._pidfd is not None:  # a pidfd stays readable: one call is enough
            self._loop.remove_reader(self._pidfd)
        if not self._exited.done():
            self._exited.set_result(code)
        if not self._stopping:
            self._die(self.error or ("engine process exited" + (f" (code {code})" if code is not None else "")))

    def _die(self, why: str) -> None:
        first = self.error is None
        self.error = why
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDead(why))
        self._calls.clear()
        now = time.monotonic()
        for rid, stream in list(self._streams.items()):
            stream._push(ipc.Output(rid, [], True, FinishReason.ERROR, 0, 0, 0, why), now)
            stream._wake()
        self._streams.clear()
        if first:
            log.error("the engine is gone: %s", why)
            if self.on_death is not None:
                self.on_death(why)

    # ---- the receiver ------------------------------------------------------------------------------
    def _on_readable(self) -> None:
        # Reading the socket's events consumes what made its descriptor readable, so the
        # (level-triggered) reader does not fire again until something new arrives, whether or
        # not `_frames` waits now; `_frames` checks the events itself before it waits.
        try:
            self._outbox.getsockopt(zmq.EVENTS)
        except zmq.ZMQError:
            return
        if self._readable is not None and not self._readable.done():
            self._readable.set_result(None)

    async def _frames(self) -> list[zmq.Frame]:
        """Every message queued in the outbox, once there is at least one. zmq's descriptor only
        says that the socket's state changed, so the queue is read until zmq says it is empty."""
        outbox = self._outbox
        while True:
            frames = []
            while outbox.getsockopt(zmq.EVENTS) & _POLLIN:
                frames.append(outbox.recv(zmq.NOBLOCK, copy=False))
            if frames:
                return frames
            self._readable = self._loop.create_future()
            await self._readable

    async def _receive(self, decode, frames: list[zmq.Frame]) -> None:
        try:
            await self._route(decode, frames)
        except (zmq.ZMQError, asyncio.CancelledError):
            return
        except Exception as exc:  # noqa: BLE001 - nothing would route the engine's outputs any more
            log.exception("the engine's outputs could not be read")
            self._die(f"the front end failed to read the engine's outputs: {exc!r}")

    async def _route(self, decode, frames: list[zmq.Frame]) -> None:
        while True:
            frames = frames or await self._frames()
            waiting: dict[str, RequestStream] = {}  # streams whose consumer waits for these outputs
            for frame in frames:
                self._take(decode(frame.buffer), waiting)
            frames = []
            # Consumers resume in groups, one pass of the event loop each: a pass never runs more
            # than WAKE_GROUP streams' work, so timers and new requests wait at most that long.
            # This task yields after every group, the last too, so the next messages' first group
            # is not woken into the same pass. Steps that arrive meanwhile are read together next
            # time, their tokens coalesced.
            group = list(waiting.values())
            for i in range(0, len(group), WAKE_GROUP):
                for stream in group[i : i + WAKE_GROUP]:
                    stream._wake()
                await asyncio.sleep(0)

    def _take(self, msg, waiting: dict[str, RequestStream]) -> None:
        """One message from the engine: outputs into their streams, a reply to its call."""
        if isinstance(msg, ipc.StepOutputs):
            now, streams = time.monotonic(), self._streams
            for out in msg.outputs:
                stream = streams.get(out.request_id)
                if stream is not None and stream._push(out, now):
                    waiting[out.request_id] = stream
            if msg.stats is not None:
                self.stats = msg.stats
            if self.on_step is not None:
                self.on_step(msg)
        elif isinstance(msg, ipc.Reply):
            fut = self._calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                if msg.error is not None:
                    fut.set_exception(EngineError(msg.error.message, msg.error.code, msg.error.param))
                else:
                    fut.set_result(msg.result)
        elif isinstance(msg, ipc.Failed):
            self._die(msg.error)

    # ---- requests ---------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        self._inbox.send(self._encode(msg), zmq.NOBLOCK)

    def _future(self) -> tuple[int, asyncio.Future]:
        if not self.alive:
            raise EngineDead(self.error or "the engine is not running")
        call_id = next(self._ids)
        fut = self._loop.create_future()
        self._calls[call_id] = fut
        return call_id, fut

    async def generate(self, request: Request) -> RequestStream:
        """Submit a request; its stream. Raises EngineError (nothing changed) if it is refused."""
        return (await self.generate_all(request))[0]

    async def generate_all(self, request: Request) -> list[RequestStream]:
        """Submit a request; the streams of its `n` completions (index i under `fork_id(id, i)`).
        Raises EngineError (nothing changed) if it is refused."""
        call_id, fut = self._future()
        ids = [fork_id(request.request_id, i) for i in range(max(1, request.params.n))]
        streams = [RequestStream(self, rid) for rid in ids]
        for stream in streams:
            self._streams[stream.request_id] = stream
        try:
            try:
                self._send(ipc.Submit(call_id, self.index, request, self.limits))
            except (OverflowError, msgspec.EncodeError) as exc:  # a value no 64-bit field holds
                self._calls.pop(call_id, None)
                raise EngineError(f"the request holds a value out of range: {exc}") from exc
            await fut
        except BaseException:
            for rid in ids:
                self._streams.pop(rid, None)
            if not fut.done():  # cancelled while the engine decides: abort whatever it decided
                self.abort(request.request_id)
            raise
        return streams

    def abort(self, request_id: str) -> None:
        """End a request at the engine's next step boundary (no-op if it already ended)."""
        if self.alive:
            self._send(ipc.Abort([request_id]))

    async def call(self, method: str, *args: Any) -> Any:
        """Run an engine verb (ipc.CALLS) between steps; its result, or the EngineError it raised."""
        call_id, fut = self._future()
        self._send(ipc.Call(call_id, self.index, method, list(args)))
        return await fut

    # typed faces of `call`
    async def create_session(self, owner: str | None = None, max_per_owner: int | None = None) -> str:
        return await self.call("create_session", None, owner, max_per_owner)

    async def close_session(self, session_id: str, owner: str | None = None) -> bool:
        return await self.call("close_session", session_id, owner)

    async def reset_session(self, session_id: str, owner: str | None = None) -> None:
        await self.call("reset_session", session_id, owner)

    async def release_row(self, session_id: str, owner: str | None = None) -> bool:
        return await self.call("release_row", session_id, owner)

    async def session_info(self, session_id: str, owner: str | None = None) -> dict:
        return await self.call("session_info", session_id, owner)

    async def session_tokens(self, session_id: str, owner: str | None = None) -> list[int]:
        return await self.call("session_tokens", session_id, owner)

    async def cancel(self, request_id: str, owner: str | None = None) -> bool:
        """End a request of `owner` (and its n completions), whichever front end submitted it;
        False when no such request of this owner is in flight."""
        return await self.call("cancel", request_id, owner)

    async def expire_idle(self, ttl_seconds: float) -> list[str]:
        return await self.call("expire_idle", ttl_seconds)

    async def fresh_stats(self) -> ipc.EngineStats:
        """A snapshot taken now (between steps), not the last one published."""
        return msgspec.convert(await self.call("stats"), ipc.EngineStats)

    async def check_invariants(self) -> None:
        """Raises EngineError(code="invariant_violated") if the engine's books do not balance."""
        await self.call("check_invariants")
