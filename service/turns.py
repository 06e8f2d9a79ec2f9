"""From a validated body to an engine request and back: sampling params, tokenization off the
event loop, admission (429/503), text for the client (detokenized here, in the front end),
metering, the requests in flight, and cancellation when the client goes away. Shared by
the OpenAI routes and the session routes."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

from fastapi import Request as HTTPRequest

from engine import FinishReason, Request, SamplingParams
from engine.client import Delta, EngineDead, RequestStream
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.types import EngineError, TokenLogprobs
from service import chat
from service.errors import APIError, from_engine, respell, valid_text
from service.schemas import DEFAULT_MAX_TOKENS
from service.tokenize_worker import TokenizerGone, TokenizerProcess

log = logging.getLogger("s5serve")

# Set (for its own task) by the front end's warm-up request, which runs before the front end is ready.
WARM_UP: contextvars.ContextVar[bool] = contextvars.ContextVar("s5serve_warm_up", default=False)

# Texts longer than this are tokenized (and chat templates rendered) on a worker thread, so a huge
# prompt does not hold up the event loop; shorter ones cost less than the hop.
OFF_LOOP_CHARS = 2048


class InFlight:
    """This front end's requests in flight (submitted, not finished or abandoned), by id: what a
    drain waits for. Admission limits are the engine's (it sees every front end's requests)."""

    def __init__(self) -> None:
        self._ids: set[str] = set()

    def add(self, request_id: str) -> None:
        self._ids.add(request_id)

    def discard(self, request_id: str) -> bool:
        """Forget the request; False if it was not in flight."""
        if request_id not in self._ids:
            return False
        self._ids.discard(request_id)
        return True

    def ids(self) -> list[str]:
        return list(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


class TokenizerPool:
    """Where long texts are tokenized off the event loop. Plain text goes to a tokenizer process
    at the lowest CPU priority (service/tokenize_worker.py), where the tokenizer has a serialized
    form; the rest (chat templates, grammar checks, and plain text while that process is not
    running) to worker threads at a lower priority (Linux: per-thread nice)."""

    NICE = 10

    def __init__(self, workers: int = 2) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="s5serve-tokenize", initializer=self._lower)
        self._process = TokenizerProcess()

    @classmethod
    def _lower(cls) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), cls.NICE)
        except (OSError, AttributeError):  # not Linux, or not allowed: same priority as the loop
            pass

    async def start_process(self, tok) -> None:
        """Start the tokenizer process on `tok`'s serialized form (none for a tokenizer without
        one); if it cannot start, long texts stay with the threads."""
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None:
            return
        try:
            await self._process.start(await asyncio.to_thread(backend.to_str))
        except TokenizerGone as exc:
            log.warning("%s: long texts are tokenized in threads", exc)

    @property
    def process_running(self) -> bool:
        return self._process.alive

    async def run(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args, **kwargs))

    async def encode(self, tok, text: str, add_special_tokens: bool) -> list[int]:
        """`tok(text)["input_ids"]`: in the tokenizer process while it runs, else in a thread."""
        if self._process.alive:
            try:
                return await self._process.encode(text, add_special_tokens)
            except TokenizerGone:
                pass
        return await self.run(long_text_ids, tok, text, add_special_tokens)

    def close(self) -> None:
        self._process.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


async def tokenize(state, text: str, add_special_tokens: bool = True) -> list[int]:
    """`tokenizer(text)["input_ids"]`, off the event loop for long texts."""
    tok = state.tokenizer
    if len(text) > OFF_LOOP_CHARS:
        return await state.tokenizer_pool.encode(tok, text, add_special_tokens)
    return tok(text, add_special_tokens=add_special_tokens)["input_ids"]


def long_text_ids(tok, text: str, add_special_tokens: bool) -> list[int]:
    """The ids `tok(text)` gives, through the Rust tokenizer directly where there is one: it holds
    the GIL only to hand back the ids, where the Python wrapper holds it for several milliseconds
    of bookkeeping. A pool thread runs at a lower priority, and a GIL it holds while the engine's
    threads have the cores stalls the event loop (every live stream) until it is scheduled again."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return tok(text, add_special_tokens=add_special_tokens)["input_ids"]
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


async def render_chat(state, messages: list[dict[str, str]], history_len: int, tail: list[int],
                      generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
    """`chat.message_ids` (the template's tokens for what `messages` add to a conversation), off
    the event loop for long conversations: the template rendered on a worker thread, its text
    tokenized as long texts are. `tools`: for a template that takes them."""
    tok = state.tokenizer
    if sum(len(m["content"]) for m in messages) + (OFF_LOOP_CHARS if tools else 0) <= OFF_LOOP_CHARS:
        return chat.message_ids(tok, messages, history_len, tail, generation_prompt, tools)
    text, closing = await state.tokenizer_pool.run(chat.message_text, tok, messages, history_len, generation_prompt,
                                                   tools)
    ids = await state.tokenizer_pool.encode(tok, text, False)
    closing_ids = None if closing is None else tok(closing, add_special_tokens=False)["input_ids"]
    return chat.increment_ids(ids, closing_ids, tail)


def finish_reason_text(reason: FinishReason | None) -> str:
    """A turn's finish reason as the routes answer it: "length", "abort" (cancelled by its client
    or the server, as vLLM reports it), "error", else "stop"."""
    return _FINISH_TEXT.get(reason, "stop")


_FINISH_TEXT = {FinishReason.LENGTH: "length", FinishReason.ABORT: "abort", FinishReason.ERROR: "error"}


def engine_names(body) -> dict[str, str]:
    """The engine's names for this body's parameters where the body used another: the length
    limit it sent as `max_completion_tokens`."""
    return {"max_tokens": "max_completion_tokens"} if body.max_completion_tokens is not None else {}


def sampling_params(body, stop_token_ids: tuple[int, ...] = (), grammar: str | None = None) -> SamplingParams:
    given = [n for n in (body.max_completion_tokens, body.max_tokens) if n is not None]
    # 0 (session route only): an append; none given: DEFAULT_MAX_TOKENS, or what the context leaves
    max_tokens = given[0] if given else DEFAULT_MAX_TOKENS
    top_k = body.top_k if body.top_k and body.top_k > 0 else 0
    return SamplingParams(
        max_tokens=max_tokens,
        max_tokens_fit=not given,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=top_k,
        top_p=1.0 if body.top_p is None else body.top_p,
        min_p=body.min_p or 0.0,
        seed=body.seed,
        stop=tuple(valid_text(s, "stop") for s in (body.stop or ())),
        stop_token_ids=tuple(dict.fromkeys((*stop_token_ids, *(body.stop_token_ids or ())))),
        ignore_eos=body.ignore_eos,
        logprobs=body.num_logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=tuple((int(t), float(b)) for t, b in (body.logit_bias or {}).items()),
        min_tokens=body.min_tokens or 0,
        n=body.n,
        grammar=grammar,
    )


def require_ready(state) -> None:
    if state.draining:
        raise APIError(503, state.fatal or "server is draining", "draining", headers={"Retry-After": "5"})
    if not (state.ready or WARM_UP.get()) or state.engine is None or not state.engine.alive:
        raise APIError(503, state.load_error or "model is loading", "not_ready", headers={"Retry-After": "5"})


def check_supported(body) -> None:
    name = body.unsupported()
    if name is not None:
        raise APIError(400, f"{name} is not supported by this server yet; leave it out (or at its default)",
                       "unsupported_parameter", name)


def check_model(state, model: str | None) -> None:
    if model not in (None, "", state.model_name):
        raise APIError(404, f"model {model!r} not found", "model_not_found", "model")


async def engine_call(coro):
    """An EngineClient call, with its EngineError as the API's error."""
    try:
        return await coro
    except EngineError as err:
        raise from_engine(err) from err
    except EngineDead as err:
        raise APIError(503, f"the engine is not running: {err}", "engine_dead") from err


async def open_session(st, owner: str | None) -> str:
    """A new session of `owner` (within the per-key limit), its id."""
    limit = st.settings.max_sessions_per_key if owner is not None else None
    return await engine_call(st.engine.create_session(owner, limit))


@dataclass
class Chunk:
    """What a turn hands its route: the text and tokens since the last chunk, and the counts."""

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int  # tokens prefilled for this turn
    num_cached_tokens: int  # history tokens reused from the session's row
    num_output_tokens: int
    error: str | None
    logprobs: list[TokenLogprobs] | None = None  # per token of token_ids, where asked for


class Turn:
    """One request in flight, as its route sees it. Iterate it for `Chunk`s; `close()` (also
    called when the response ends, however it ends) aborts it if it has not finished."""

    def __init__(self, state, stream: RequestStream, detok: IncrementalDetokenizer | None,
                 num_prompt_tokens: int, started: float, fork: bool = False,
                 stop_token_ids: tuple[int, ...] = ()) -> None:
        self.state = state
        # the request's stop token ids: the one that ends the reply is not shown as text (as EOS,
        # a special token, is not), as vLLM leaves it out
        self.stop_token_ids = frozenset(stop_token_ids)
        self.fork = fork  # a choice after the first of n: its prompt was the first's prefill
        self.request_id = stream.request_id
        self.stream = stream
        self.detok = detok
        self.num_prompt_tokens = num_prompt_tokens  # the whole prompt as the client sees it
        # time.monotonic() when the request was submitted: its first tokens can arrive before
        # the engine's reply to the submission resumes the handler
        self.started = started
        self.finished = False
        self._stopped = False  # the text reached a stop string: nothing after it is shown
        self._last_arrival: float | None = None
        state.active.add(self.request_id)

    @property
    def stopped(self) -> bool:
        """Whether the text reached a stop string (what was shown ends before it)."""
        return self._stopped

    async def chunks(self) -> AsyncIterator[Chunk]:
        m = self.state.metrics
        async for d in self.stream:
            yield self._chunk(d, m)
            if d.finished:
                return

    def _chunk(self, d: Delta, m) -> Chunk:
        n = len(d.token_ids)
        if n:
            if self._last_arrival is None:  # the first output (a coalesced delta's arrived is its newest's)
                m.ttft.observe(self.stream.first_arrived - self.started)
                if not self.fork:
                    m.prefill_tokens.inc(d.num_prompt_tokens)
                    m.cached_tokens.inc(d.num_cached_tokens)
            else:  # coalesced tokens: the mean gap between them
                m.itl.observe((d.arrived - self._last_arrival) / n)
            self._last_arrival = d.arrived
            m.generation_tokens.inc(n)
        text = ""
        if self.detok is not None and not self._stopped:
            ids = d.token_ids
            if d.finished and d.finish_reason == FinishReason.STOP and ids and ids[-1] in self.stop_token_ids:
                ids = ids[:-1]
            text, self._stopped = self.detok.add_many(ids)
            if d.finished and d.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and not self._stopped:
                text += self.detok.flush()  # held text that never became a stop string
        if d.finished and self._last_arrival is None and d.finish_reason == FinishReason.LENGTH:  # an append
            m.prefill_tokens.inc(d.num_prompt_tokens)
            m.cached_tokens.inc(d.num_cached_tokens)
        if d.finished:
            self.finished = True
            m.finished.labels(d.finish_reason.value).inc()
            m.e2e.observe(time.monotonic() - self.started)
            self.state.active.discard(self.request_id)
        return Chunk(text, d.token_ids, d.finished, d.finish_reason, d.num_prompt_tokens, d.num_cached_tokens,
                     d.num_output_tokens, d.error, d.logprobs)

    async def aclose(self) -> None:
        """`close` as a coroutine: a response's background task then runs it on the event loop
        (a plain function would run on a worker thread, beside the loop's use of the same
        EngineClient socket and in-flight table)."""
        self.close()

    def close(self) -> None:
        """The response ended: abort the request if it still runs. Idempotent. Event loop only."""
        if self.state.active.discard(self.request_id) and not self.finished:
            self.state.metrics.finished.labels("abort").inc()
        self.stream.abort()


async def start_turn(state, prompt_ids: list[int], params: SamplingParams, session_id: str | None,
                     owner: str | None, match_prefix: bool, expect_history_len: int | None = None,
                     names: dict[str, str] | None = None) -> Turn:
    """Submit a turn. With `match_prefix`, `prompt_ids` is the whole conversation: the stored
    history must be its prefix (only the rest is prefilled), else the session is re-prefilled.
    `expect_history_len`: the history length `prompt_ids` was prepared against (see Request).
    `names`: the request's names for the engine's parameters, which its errors then use."""
    if params.n != 1:
        raise APIError(400, "n > 1 is not available here: a session has one row", "invalid_request", "n")
    return (await start_turns(state, prompt_ids, params, session_id, owner, match_prefix, expect_history_len,
                              names=names))[0]


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


async def start_turns(state, prompt_ids: list[int], params: SamplingParams, session_id: str | None,
                      owner: str | None, match_prefix: bool, expect_history_len: int | None = None,
                      request_id: str | None = None, names: dict[str, str] | None = None) -> list[Turn]:
    """`start_turn` for `params.n` completions of one prompt: one turn per completion (the
    engine prefills the prompt once and forks its row). `request_id`: the engine request's id
    (default: a new one)."""
    require_ready(state)
    m = state.metrics
    engine = state.engine
    rid = request_id or new_request_id()
    started = time.monotonic()
    request = Request(rid, prompt_ids, params, session_id, owner, match_prefix and session_id is not None,
                      expect_history_len)
    try:
        streams = await engine_call(engine.generate_all(request))
    except APIError as err:
        respell(err, names or {})
        raise
    m.prompt_tokens.inc(len(prompt_ids))
    return [Turn(state, stream, IncrementalDetokenizer(state.tokenizer, params.stop) if state.tokenizer is not None
                 else None, len(prompt_ids), started, fork=i > 0, stop_token_ids=params.stop_token_ids)
            for i, stream in enumerate(streams)]


Collected = tuple[str, list[int], Chunk | None, list[TokenLogprobs]]  # text, ids, last chunk, logprobs


async def collect(turn: Turn, request: HTTPRequest) -> Collected:
    """Non-streaming: gather the whole reply (text, token ids, the last chunk, the tokens'
    logprobs where asked for); abort if the client disconnects meanwhile (the last chunk is then
    None)."""
    return (await collect_all([turn], request))[0]


class _Gathered:
    """One choice's reply as it is gathered."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.last: Chunk | None = None

    async def consume(self, turn: Turn) -> None:
        async for chunk in turn.chunks():
            self.text.append(chunk.text)
            self.ids.extend(chunk.token_ids)
            self.logprobs.extend(chunk.logprobs or ())
            self.last = chunk
            if chunk.finish_reason == FinishReason.ERROR:
                raise APIError(500, chunk.error or "generation failed", "generation_failed")

    def result(self, finished: bool) -> Collected:
        return "".join(self.text), self.ids, self.last if finished else None, self.logprobs


async def collect_all(turns: list[Turn], request: HTTPRequest) -> list[Collected]:
    """`collect` for the turns of one request (its n choices), watched by one disconnect
    watcher: if the client leaves, every turn is aborted at once. A choice that fails ends the
    request (APIError) and aborts the others."""
    parts = [_Gathered() for _ in turns]
    tasks = [asyncio.ensure_future(part.consume(t)) for t, part in zip(turns, parts)]
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending | {gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:  # the client left
                return [part.result(finished=False) for part in parts]
            pending.discard(gone)
            for task in done:
                task.result()  # a failed choice raises here
    finally:
        gone.cancel()
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a second failure is not logged as unhandled
            task.cancel()
        for t in turns:
            t.close()
    return [part.result(finished=True) for part in parts]


async def _client_gone(request: HTTPRequest) -> None:
    """Returns when the client disconnects. The request's body has been read whole, so the
    server's next ASGI message for it is `http.disconnect`, sent when the connection closes (or
    once the response is complete). A server whose receive fails here never says the client
    left: the request then runs to its end."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - no disconnect signal from this server
        await asyncio.Future()
