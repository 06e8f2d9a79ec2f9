"""Engine: the synchronous core. `step()` = schedule -> run -> apply.

The engine owns the model runner, the row pool, the scheduler and the sessions. It is not
thread-safe: exactly one thread calls it (the engine process's loop, process.py). Every request's lifetime ends in `_finish`,
whatever the reason (stop, length, abort, error): a stateless request's row is freed there, and a
session's turn is either committed (history grows) or rolled back to the last completed turn.

A session's history is every token fed to or produced by the model. The row holds K/V for all but
possibly the last one (a sampled token is fed only by the next forward), so a new turn feeds
`history[kv_len:] + new input` as one logical forward: history is never prefilled twice.
A turn with `max_tokens` 0 is an append: its forward computes every token it feeds, nothing is
sampled, and the history it commits ends with a computed token.

Steady decoding overlaps the host with the device (`EngineConfig.overlap_steps`): while every
running request decodes, the next static decode step is launched, its tokens read on the device
(greedy picks, or each sampling row's draw), before the host applies the step before it
(`_step_ahead`). A row that the applied step
finishes (EOS, a stop string) was fed one token too many: `_finish` undoes that token's forward
(`RowPool.undo_decode`), so the row is exactly what the plain order of steps leaves.

A session also records the logical forwards that computed its history (`forwards`: per turn, one
prefill forward and then one-token decode forwards). A session whose row was given up (rows ran
short and host memory for swapping too, or the server restarted with a SessionDB) gets it back on
its next turn by replaying those forwards: under restored-S5 the K/V of bounded layers depends on
where forwards began and ended, so only the same forwards rebuild the same row.
"""

from __future__ import annotations

import itertools
import json
import logging
import sqlite3
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from engine.runner.attention import ForwardChunk
from engine.core.config import EngineConfig
from engine.runner.decode_graph import GreedyFetch
from engine.core.detokenizer import IncrementalDetokenizer
from engine.model.hf_adapter import geometry
from engine.kv.policy import layer_layouts
from engine.kv.rows import RowPool, RowSnapshot, SwappedRow
from engine.model.loader import LoadedModel, load_model
from engine.runner.model_runner import ModelRunner, RunnerInput
from engine.runner.sampler import greedy_batch, greedy_host, make_generator, sample_batch, sample_tokens
from engine.core.scheduler import Scheduler, SchedRequest
from engine.core.session_db import SessionDB
from engine.core.types import EngineError, FinishReason, Request, RequestOutput

log = logging.getLogger(__name__)


@dataclass
class _Session:
    session_id: str
    owner: str | None = None  # opaque to the engine: the service's tenant, kept with the session
    # history (the last may be uncomputed); None: still only in the SessionDB (loaded on first use)
    tokens: list[int] | None = field(default_factory=list)
    # the logical forwards that computed tokens[:kv_len]: (prefill, decodes) per turn
    forwards: list[tuple[int, int]] = field(default_factory=list)
    num_tokens: int = 0  # len(tokens), also while tokens is None
    row: int | None = None  # None: no row yet, swapped to host memory, or given up (rebuilt by replay)
    swapped: SwappedRow | None = None  # the row, in host memory, while the session waits for one
    busy: str | None = None  # request id of the turn in flight
    num_turns: int = 0
    num_evictions: int = 0  # rows given up (swapped out or released)
    last_used: float = field(default_factory=time.monotonic)
    last_resume: dict | None = None  # how the row came back last time: swap-in or rebuild
    durable: bool = True  # its transcript is in the SessionDB (False after a failed write)


@dataclass
class _Live:
    request: Request
    sched: SchedRequest
    feed: list[int]  # tokens this turn prefills: uncomputed history + new input
    num_cached: int  # history tokens already in the row
    history_len: int  # session history length when the turn began (rollback point)
    max_len: int  # positions this request may reach (context limit)
    generator: torch.Generator
    detok: IncrementalDetokenizer | None
    row: int | None = None
    forward_start: int = 0  # row length when the current logical forward began
    forward_ends: list[int] = field(default_factory=list)  # replayed forwards' ends within feed
    snapshot: RowSnapshot | None = None  # row state to restore if the turn does not complete
    row_is_new: bool = False  # row allocated for this turn (rollback frees it)
    output_ids: list[int] = field(default_factory=list)
    # (lane, position) in the newest launched step, while its token is not applied yet
    ahead: tuple[int, int] | None = None


class _Pending(NamedTuple):
    """A static decode step launched and not yet applied (see `_step_ahead`)."""

    lives: list[_Live]  # per lane
    positions: list[int]  # the position each lane fed
    fetch: GreedyFetch  # its greedy tokens, on their way to the host


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        loaded = loaded or load_model(config)
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        geo = geometry(loaded.model)
        self.geometry = geo
        self.max_model_len = min(config.max_model_len or geo.max_position_embeddings, geo.max_position_embeddings)
        self.eos_token_ids = set(geo.eos_token_ids)
        self.layouts = layer_layouts(
            config.kv_policy, geo.layer_types, geo.native_window, config.kv_sink, config.kv_window
        )
        dtype = next(loaded.model.parameters()).dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            dtype = torch.bfloat16  # quantized weights: K/V in the compute dtype
        item = torch.empty((), dtype=dtype).element_size()
        paged_bytes = sum(2 * h * d * item for (h, d), lay in zip(geo.kv_shapes, self.layouts) if lay.paged)
        block_bytes = config.kv_block_size * max(paged_bytes, 1)
        self.pool = RowPool(
            self.layouts,
            geo.kv_shapes,
            dtype,
            config.device,
            num_rows=config.max_rows,
            block_size=config.kv_block_size,
            num_blocks=max(2, config.kv_cache_bytes // block_bytes + 1),
        )
        capture = self.pool.device.type == "cuda"
        overlap = config.static_decode_batch > 0 and (
            config.overlap_steps if config.overlap_steps is not None else capture)
        self.runner = ModelRunner(loaded.model, self.pool, config.static_decode_batch, self.max_model_len,
                                  capture=capture, fused=config.fused_layers, undoable=overlap, pdl=config.pdl)
        self.overlap = overlap
        self._pending: _Pending | None = None  # a static decode step launched, not yet applied
        self.scheduler = Scheduler(config.max_num_batched_tokens, config.num_seqs_per_step, self)
        self.sessions: dict[str, _Session] = {}
        self._owned: Counter[str | None] = Counter()  # owner -> sessions held
        # sessions closed by the engine (LRU when rows ran out, or idle TTL): id -> reason.
        # Bounded; a later lookup of such an id raises `session_evicted`.
        self.evicted: OrderedDict[str, str] = OrderedDict()
        self._live: dict[str, _Live] = {}
        # outputs of requests ended outside `step` by a session's end (closed or evicted with a turn
        # in flight); whoever runs the loop takes them and delivers them like a step's outputs
        self.ended_between_steps: list[RequestOutput] = []
        self._seeds = itertools.count(config.seed * 1_000_003)
        # Called with every row's logits before sampling: (request_id, position of the last fed
        # token, logits [vocab], a view). Tests use it to record logits and to inject faults (an
        # altered row or an exception fails that request only). None in serving.
        self.logits_hook: Callable[[str, int, torch.Tensor], None] | None = None
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "steps": 0, "evictions": 0, "rows_released": 0,
                      "swaps_out": 0, "swaps_in": 0, "rebuilds": 0, "rebuild_forwards": 0, "session_db_errors": 0}
        self.swapped_bytes = 0  # host bytes of swapped rows
        self.db: SessionDB | None = None
        if config.session_db:
            self.db = SessionDB(config.session_db, self._fingerprint(loaded.name))
            self._load_sessions()

    def close(self) -> None:
        """Release what outlives a step (the SessionDB connection). The engine is unusable after."""
        if self.db is not None:
            self.db.close()
            self.db = None

    def _fingerprint(self, model_name: str) -> str:
        """What a stored session's K/V depends on besides its tokens."""
        c = self.config
        return json.dumps({"model": model_name, "dtype": c.dtype, "quantization": c.quantization,
                           "kv_policy": c.kv_policy, "kv_sink": c.kv_sink, "kv_window": c.kv_window,
                           "vocab": self.geometry.vocab_size}, sort_keys=True)

    def _load_sessions(self) -> None:
        stored, others = self.db.load()
        now_wall, now = time.time(), time.monotonic()
        for st in stored:
            self.sessions[st.session_id] = _Session(
                st.session_id, owner=st.owner, tokens=None, num_tokens=st.num_tokens, num_turns=st.num_turns,
                last_used=now - max(0.0, now_wall - st.last_used))
            self._owned[st.owner] += 1
        log.info("session store %s: %d sessions loaded%s", self.db.path, len(stored),
                 f", {others} stored under another model or KV policy left as they are" if others else "")

    # ---- sessions -----------------------------------------------------------------------------
    def create_session(self, session_id: str | None = None, owner: str | None = None,
                       max_per_owner: int | None = None) -> str:
        """A new session of `owner`; refused (`too_many_sessions`) when the owner already holds
        `max_per_owner` sessions."""
        sid = session_id or uuid.uuid4().hex  # 128 random bits
        if sid in self.sessions or sid in self.evicted:
            raise EngineError(f"session {sid} exists", code="session_exists")
        if max_per_owner is not None and self._owned[owner] >= max_per_owner:
            raise EngineError(f"this key holds {self._owned[owner]} sessions, the most allowed; delete some "
                              "(DELETE /v1/sessions/{id}) or let idle ones expire", code="too_many_sessions")
        if self.db is not None:
            try:
                self.db.create(sid, owner)
            except sqlite3.Error as exc:
                self.stats["session_db_errors"] += 1
                raise EngineError(f"the session store failed: {exc}", code="session_store_unavailable") from exc
        self.sessions[sid] = _Session(sid, owner=owner)
        self._owned[owner] += 1
        return sid

    def close_session(self, session_id: str, owner: str | None = None) -> bool:
        """Ends the session (aborting a turn in flight) and frees its row. Idempotent: False when
        there is no such session of this owner."""
        s = self.sessions.get(session_id)
        if s is None or s.owner != owner:
            return False
        self._close(s)
        return True

    def _close(self, s: _Session) -> None:
        session_id = s.session_id
        if s.busy is not None:
            self.ended_between_steps.append(self.abort(s.busy))
        if s.row is not None:
            self.pool.free_row(s.row)
        self._drop_swapped(s)
        del self.sessions[session_id]
        self._owned[s.owner] -= 1
        self._store(s, self.db.delete if self.db else None, session_id)

    def reset_session(self, session_id: str, owner: str | None = None) -> None:
        """Forget the history (the row is emptied)."""
        self._reset(self._session(session_id, owner))

    def _reset(self, s: _Session) -> None:
        session_id = s.session_id
        if s.busy is not None:
            raise EngineError("session has a turn in flight", code="session_busy")
        if s.row is not None:
            self.pool.free_row(s.row)
            s.row = None
        self._drop_swapped(s)
        s.tokens, s.forwards, s.num_tokens = [], [], 0
        self._store(s, self.db.clear if self.db else None, session_id)

    def release_row(self, session_id: str, owner: str | None = None) -> bool:
        """Drop an idle session's row but keep its history; its next turn rebuilds the row by
        replaying the history's forwards."""
        s = self._session(session_id, owner)
        if s.busy is not None or s.row is None:
            return False
        self._give_up_row(s)
        return True

    def _give_up_row(self, s: _Session) -> None:
        self.pool.free_row(s.row)
        s.row = None
        s.num_evictions += 1
        self.stats["rows_released"] += 1

    def session_tokens(self, session_id: str, owner: str | None = None) -> list[int]:
        return list(self._history(self._session(session_id, owner)))

    def session_tail(self, session_id: str, num_tokens: int, owner: str | None = None) -> tuple[int, list[int]]:
        """(history length, its last `num_tokens` tokens): what a front end needs to prepare the
        next turn's input (whether BOS is due, which closing markup the history already holds)."""
        history = self._history(self._session(session_id, owner))
        return len(history), history[len(history) - min(num_tokens, len(history)):]

    def _history(self, s: _Session) -> list[int]:
        if s.tokens is None:  # first use since the server started: read the transcript
            try:
                s.tokens, s.forwards = self.db.history(s.session_id)
            except sqlite3.Error as exc:
                self.stats["session_db_errors"] += 1
                raise EngineError(f"the session store failed: {exc}", code="session_store_unavailable") from exc
            s.num_tokens = len(s.tokens)
        return s.tokens

    def _store(self, s: _Session, write, *args) -> None:
        """A write of a session's transcript. A failure (disk full, a locked or broken file) fails
        neither the turn nor the engine: the session goes on in memory only, and its transcript is
        removed from the file, so a restart cannot bring back a history that misses turns."""
        if write is None or not s.durable:
            return
        try:
            write(*args)
        except sqlite3.Error as exc:
            self.stats["session_db_errors"] += 1
            s.durable = False
            log.error("session %s: writing its transcript failed (%s); it continues in memory only",
                      s.session_id, exc)
            try:
                self.db.delete(s.session_id)
            except sqlite3.Error:
                log.error("session %s: its stale transcript could not be removed either", s.session_id)

    def session_info(self, session_id: str, owner: str | None = None) -> dict:
        s = self._session(session_id, owner)
        kv = self.pool.resident_kv_bytes(s.row) if s.row is not None else {"total": 0}
        kv_tokens = self.pool.kv_len(s.row) if s.row is not None else (s.swapped.kv_len if s.swapped else 0)
        state = "resident" if s.row is not None else ("swapped" if s.swapped is not None else "stored")
        return {
            "id": s.session_id,
            "history_tokens": s.num_tokens,
            "kv_tokens": kv_tokens,
            "resident_kv_bytes": kv["total"],
            "resident_kv": kv,
            "host_kv_bytes": s.swapped.nbytes if s.swapped is not None else 0,
            "idle_seconds": 0.0 if s.busy else time.monotonic() - s.last_used,
            "state": "busy" if s.busy else state,
            "turns": s.num_turns,
            "evictions": s.num_evictions,
            "last_resume": s.last_resume,
            "durable": self.db is not None and s.durable,  # its transcript survives a restart
        }

    def _session(self, session_id: str, owner: str | None) -> _Session:
        """The session, for its owner: another owner's session is indistinguishable from a
        missing one."""
        s = self.sessions.get(session_id)
        if s is not None and s.owner != owner:
            s = None
        elif s is None and session_id in self.evicted:
            raise EngineError(f"session {session_id} was evicted ({self.evicted[session_id]})",
                              code="session_evicted", param="session_id")
        if s is None:
            raise EngineError(f"session {session_id} not found", code="session_not_found", param="session_id")
        return s

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. Raises EngineError (and changes nothing) if it is invalid."""
        if request.request_id in self._live:
            raise EngineError("duplicate request id", code="duplicate_request_id")
        params = request.params
        params.validate()
        ids = request.prompt_token_ids
        if not ids:
            raise EngineError("prompt is empty", param="prompt")
        if request.append_only and request.session_id is None:
            raise EngineError("max_tokens 0 appends to a session: a request without one must generate",
                              param="max_tokens")
        vocab = self.geometry.vocab_size
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab for t in ids):
            raise EngineError(f"token ids must be integers in [0, {vocab})", param="prompt")
        if params.stop and self.tokenizer is None:
            raise EngineError("stop strings need a tokenizer", param="stop")
        session = self._session(request.session_id, request.owner) if request.session_id is not None else None
        if session is not None and session.busy is not None:
            raise EngineError("session has a turn in flight", code="session_busy", param="session_id")
        history = self._history(session) if session is not None else []
        if request.expect_history_len is not None and request.expect_history_len != len(history):
            raise EngineError("another turn of this session committed while this one was prepared; retry",
                              code="session_busy", param="session_id")
        diverged = False
        if request.match_prefix and history:  # the prompt is the whole conversation
            if len(history) < len(ids) and ids[: len(history)] == history:
                ids = ids[len(history):]
                request = replace(request, prompt_token_ids=ids, match_prefix=False)
            else:  # it does not continue the stored history: the session starts over with it
                history, diverged = [], True
        if len(history) + len(ids) >= self.max_model_len:
            raise EngineError(
                f"history ({len(history)}) + prompt ({len(ids)}) tokens reach the context limit of "
                f"{self.max_model_len} tokens",
                code="context_length_exceeded",
                param="prompt",
            )
        if len(history) + len(ids) + params.max_tokens > self.max_model_len:
            raise EngineError(
                f"prompt ({len(history) + len(ids)} tokens with history) + max_tokens ({params.max_tokens}) "
                f"exceed the context limit of {self.max_model_len} tokens",
                code="context_length_exceeded",
                param="max_tokens",
            )
        max_len = min(len(history) + len(ids) + params.max_tokens, self.max_model_len)
        if self.pool.blocks_for(max_len) > self.pool.num_blocks - 1:
            raise EngineError(
                f"{max_len} tokens exceed the KV cache ({(self.pool.num_blocks - 1) * self.pool.block_size} "
                "tokens); lower max_tokens",
                code="kv_capacity_exceeded",
                param="max_tokens",
            )
        # valid: from here on the request is committed
        if diverged:
            self._reset(session)
        kv_len, forward_ends = 0, []
        if session is not None and session.row is not None:
            kv_len = self.pool.kv_len(session.row)
        elif session is not None and session.swapped is not None:
            kv_len = session.swapped.kv_len  # the turn brings the row back from host memory
        elif history:  # no row: rebuild it by replaying the forwards that computed the history
            for prefill, decodes in session.forwards:
                end = forward_ends[-1] if forward_ends else 0
                forward_ends += [end + prefill, *range(end + prefill + 1, end + prefill + decodes + 1)]
        feed = history[kv_len:] + list(ids)
        seed = params.seed if params.seed is not None else next(self._seeds)
        # stop strings are matched on the text (the front end detokenizes for the client)
        detok = IncrementalDetokenizer(self.tokenizer, params.stop) if params.stop else None
        live = _Live(
            request=request,
            sched=SchedRequest(request.request_id, len(feed), forward_ends=forward_ends),
            feed=feed,
            num_cached=kv_len,
            history_len=len(history),
            max_len=max_len,
            generator=make_generator(seed),
            detok=detok,
            forward_ends=forward_ends,
        )
        self._live[request.request_id] = live
        if session is not None:
            session.busy = request.request_id
        self.scheduler.add(live.sched)

    def try_admit(self, request_id: str) -> bool:
        """KVCapacity for the scheduler: take a row and reserve blocks, or change nothing."""
        live = self._live[request_id]
        session = self.sessions.get(live.request.session_id) if live.request.session_id else None
        row = session.row if session is not None else None
        if row is None and not self.pool.can_allocate_row() and not self._evict_idle_row():
            return False
        if not self.pool.can_reserve(row, live.max_len):
            return False
        if row is None and session is not None and session.swapped is not None:  # back from host memory
            session.last_resume = {"path": "swap-in", "tokens": session.swapped.kv_len, "forwards": 0}
            row = session.row = self.pool.swap_in(session.swapped, live.max_len)
            self._drop_swapped(session)
            self.stats["swaps_in"] += 1
            live.snapshot = self.pool.snapshot(row)
        elif row is None:
            row = self.pool.allocate_row()
            live.row_is_new = True
            if session is not None:
                session.row = row
            if live.forward_ends or live.history_len:  # a row rebuilt from the transcript
                session.last_resume = {"path": "rebuild", "tokens": live.history_len,
                                       "forwards": len(live.forward_ends) + 1}
                self.stats["rebuilds"] += 1
                self.stats["rebuild_forwards"] += len(live.forward_ends)
        elif session is not None:
            live.snapshot = self.pool.snapshot(row)
        self.pool.reserve(row, live.max_len)
        live.row = row
        live.forward_start = self.pool.kv_len(row)
        return True

    def _evict_idle_row(self) -> bool:
        """Rows ran out: the least recently used idle session that holds one gives it up. Its row
        moves to host memory while swapped rows fit in `swap_bytes` (the next turn brings it back
        exactly, no recompute); otherwise the row is freed and the next turn rebuilds it by
        replaying the session's forwards (exact, at the cost of recomputing them)."""
        # idle: no turn, or a turn still queued (it does not use its row yet; without this, rows
        # held by queued turns behind the one being admitted would never come free)
        idle = [s for s in self.sessions.values()
                if s.row is not None and (s.busy is None or self._live[s.busy].row is None)]
        if not idle:
            return False
        victim = min(idle, key=lambda s: (s.busy is not None, s.last_used))
        # a queued turn planned its feed from this row's length: that row must come back as it was
        if self.swapped_bytes + self._row_bytes(victim.row) <= self.config.swap_bytes or victim.busy is not None:
            victim.swapped = self.pool.swap_out(victim.row)
            victim.row = None
            victim.num_evictions += 1
            self.swapped_bytes += victim.swapped.nbytes
            self.stats["swaps_out"] += 1
            return True
        self._give_up_row(victim)
        return True

    def _row_bytes(self, row: int) -> int:
        """Host bytes a swap of this row takes: its ring slots and the positions it holds."""
        paged = self.pool.kv_len(row) * self.pool.paged_position_bytes
        return paged + self.pool.ring_row_bytes

    def _drop_swapped(self, s: _Session) -> None:
        if s.swapped is not None:
            self.swapped_bytes -= s.swapped.nbytes
            s.swapped = None

    def evict_session(self, session_id: str, reason: str) -> None:
        self._close(self.sessions[session_id])
        self.evicted[session_id] = reason
        while len(self.evicted) > 100_000:
            self.evicted.popitem(last=False)
        self.stats["evictions"] += 1

    def expire_idle(self, ttl_seconds: float) -> list[str]:
        """Evict sessions idle for longer than `ttl_seconds`; returns their ids."""
        now = time.monotonic()
        old = [s.session_id for s in self.sessions.values() if s.busy is None and now - s.last_used > ttl_seconds]
        for sid in old:
            self.evict_session(sid, "ttl")
        return old

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now (between steps); rolls its session back. None if unknown."""
        live = self._live.get(request_id)
        if live is None:
            return None
        return self._finish(live, FinishReason.ABORT)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward's outputs. With a step in flight (`_step_ahead`), those are its outputs,
        and the next step is launched first where it can be."""
        if self._pending is not None:
            return self._step_ahead()
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return []
        inputs: list[RunnerInput] = []
        lives: list[_Live] = []
        appended: list[_Live] = []  # appends whose input is all fed by this step: they end with it
        for c in plan.chunks:
            live = self._live[c.request_id]
            start = self.pool.kv_len(live.row)
            if c.decode:
                tokens, fstart = [live.output_ids[-1]], start
                self.stats["decode_tokens"] += 1
            else:
                off = live.sched.num_computed - c.num_tokens
                tokens, fstart = live.feed[off : off + c.num_tokens], live.forward_start
                self.stats["prefill_tokens"] += c.num_tokens
                if c.forward_done and not c.prefill_done:  # a replayed forward ends: the next begins
                    live.forward_start = start + c.num_tokens
            chunk = ForwardChunk(live.row, c.num_tokens, start, fstart, c.forward_done)
            append_done = c.prefill_done and live.request.append_only
            inputs.append(RunnerInput(chunk, tokens, wants_logits=c.prefill_done and not append_done))
            lives.append(live)
            if append_done:
                appended.append(live)
        self.stats["steps"] += 1
        try:
            logits, owners, greedy = self.runner.run(inputs)
        except Exception as exc:  # the forward failed: end every request in it, keep serving
            return [self._finish(live, FinishReason.ERROR, error=f"forward failed: {exc}") for live in lives]
        if (self.overlap and greedy is not None and len(owners) == len(inputs) and self.logits_hook is None
                and all(c.decode for c in plan.chunks)):
            try:
                picks = self._picks(logits, greedy, lives)
            except Exception:  # sampling failed: the plain path below ends those rows with the error
                picks = None
            if picks is not None:
                fetch = self.runner.decoder.fetch(picks)
                positions = [i.chunk.start for i in inputs]
                for lane, live in enumerate(lives):
                    live.ahead = (lane, positions[lane])
                self._pending = _Pending(lives, positions, fetch)
                return self._step_ahead()
        # From here on a failure belongs to one request: it ends with an error, the rest go on.
        failed: dict[int, str] = {}
        if self.logits_hook is not None:
            for j, n in enumerate(owners):
                try:
                    self.logits_hook(lives[n].request.request_id, self.pool.kv_len(lives[n].row) - 1, logits[j])
                except Exception as exc:
                    failed[j] = f"logits hook failed: {exc}"
        greedy_rows = [j for j, n in enumerate(owners) if lives[n].request.params.greedy and j not in failed]
        sampled_rows = [j for j, n in enumerate(owners) if not lives[n].request.params.greedy and j not in failed]
        picked: dict[int, tuple[int, bool]] = {}
        if greedy_rows:  # all greedy rows in one device call (made by the step itself where it can)
            if len(greedy_rows) < len(owners):
                tokens, finite = greedy_batch(logits[greedy_rows])
            else:
                tokens, finite = greedy_host(greedy) if greedy is not None else greedy_batch(logits)
            picked = {j: (t, ok) for j, t, ok in zip(greedy_rows, tokens, finite)}
        if sampled_rows:  # all sampled rows batched on the device, each with its own generator
            try:
                tokens, finite = sample_batch(logits[sampled_rows], [lives[owners[j]].request.params for j in sampled_rows],
                                              [lives[owners[j]].generator for j in sampled_rows])
                picked.update({j: (t, ok) for j, t, ok in zip(sampled_rows, tokens, finite)})
            except Exception as exc:
                failed.update({j: f"sampling failed: {exc}" for j in sampled_rows})
        outputs = []
        for j, n in enumerate(owners):
            live = lives[n]
            if j in failed:
                outputs.append(self._finish(live, FinishReason.ERROR, error=failed[j]))
                continue
            outputs.append(self._apply_safely(live, picked[j], self.pool.kv_len(live.row)))
        outputs += [self._finish(live, FinishReason.LENGTH) for live in appended]
        return outputs

    def _apply_safely(self, live: _Live, picked: tuple[int, bool], kv_len: int) -> RequestOutput:
        try:
            return self._apply(live, picked, kv_len)
        except Exception as exc:  # detokenizer or bookkeeping: this request only
            if live.request.request_id not in self._live:
                raise  # it failed while ending: the engine's own state is in doubt
            log.exception("request %s failed in its step", live.request.request_id)
            return self._finish(live, FinishReason.ERROR, error=f"step failed: {exc}")

    def _picks(self, logits: torch.Tensor, greedy: torch.Tensor, lives: list[_Live]) -> torch.Tensor:
        """Every lane's token and finiteness [2, n], left on the device: the step's greedy tokens,
        with each sampling row's draw (its own generator, as `sample_batch` draws) in its lane.
        The next step launched ahead feeds these."""
        sampled = [j for j, lv in enumerate(lives) if not lv.request.params.greedy]
        if not sampled:
            return greedy
        idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
        drawn = sample_tokens(logits.index_select(0, idx), [lives[j].request.params for j in sampled],
                              [lives[j].generator for j in sampled])
        picks = greedy.clone()
        picks[:, idx] = drawn
        self.runner.decoder.feed_next(picks[0])
        return picks

    def _step_ahead(self) -> list[RequestOutput]:
        """Launch the next static decode step, if the next step is one, then apply the pending
        one while the device runs it. The next step feeds each row the token the pending step
        produces (read on the device); a row the pending step finishes by length is left out (the
        host knows it in advance), one it finishes otherwise is undone when it ends (`_finish`).
        A sampling row draws its next token right after the launch, on the device, so its draws
        come in the order they would without the overlap."""
        prev, self._pending = self._pending, None
        chained, failure = [], None
        running = self.scheduler.decoding() if self.logits_hook is None else None
        still = [(lane, lv) for lane, lv in enumerate(prev.lives) if self._live.get(lv.request.request_id) is lv]
        if running is not None and set(running) == {lv.request.request_id for _, lv in still}:
            for lane, live in still:
                p = prev.positions[lane]
                if len(live.output_ids) + 1 < live.request.params.max_tokens and p + 2 < live.max_len:
                    chained.append((lane, live))
        if chained:
            inputs = []
            for _, live in chained:
                start = self.pool.kv_len(live.row)
                inputs.append(RunnerInput(ForwardChunk(live.row, 1, start, start, True), [0], True))
            self.stats["steps"] += 1
            self.stats["decode_tokens"] += len(inputs)
            try:
                logits, _, greedy = self.runner.run(inputs, [lane for lane, _ in chained])
            except Exception as exc:  # the forward failed: its rows end once the pending step is applied
                failure = f"forward failed: {exc}"
            else:
                try:
                    fetch = self.runner.decoder.fetch(self._picks(logits, greedy, [lv for _, lv in chained]))
                except Exception as exc:
                    failure = f"sampling failed: {exc}"
            if failure is None:
                positions = [i.chunk.start for i in inputs]
                for lane, (_, live) in enumerate(chained):
                    live.ahead = (lane, positions[lane])
                self._pending = _Pending([lv for _, lv in chained], positions, fetch)
        outputs = self._apply_pending(prev)
        if failure is not None:
            outputs += [self._finish(lv, FinishReason.ERROR, error=failure) for _, lv in chained
                        if self._live.get(lv.request.request_id) is lv]
        if self._pending is not None and not any(self._live.get(lv.request.request_id) is lv
                                                 for lv in self._pending.lives):
            self._pending = None  # every row it fed ended (and was undone): nothing to apply
        return outputs

    def _apply_pending(self, prev: _Pending) -> list[RequestOutput]:
        for lane, live in enumerate(prev.lives):
            if live.ahead == (lane, prev.positions[lane]):
                live.ahead = None  # this step is being applied: nothing to undo any more
        lives = [(lane, lv) for lane, lv in enumerate(prev.lives) if self._live.get(lv.request.request_id) is lv]
        try:
            tokens, finite = prev.fetch.result()
        except Exception as exc:
            return [self._finish(lv, FinishReason.ERROR, error=f"forward failed: {exc}") for _, lv in lives]
        return [self._apply_safely(lv, (tokens[lane], finite[lane]), prev.positions[lane] + 1)
                for lane, lv in lives]

    def _apply(self, live: _Live, picked: tuple[int, bool], kv_len: int) -> RequestOutput:
        """The token sampled after the step in which the row reached `kv_len` positions."""
        params = live.request.params
        token, finite = picked
        if not finite:
            return self._finish(live, FinishReason.ERROR, error="sampling failed: non-finite logits")
        live.output_ids.append(token)
        reason = None
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            reason = FinishReason.STOP
        elif live.detok is not None and live.detok.add(token)[1]:
            reason = FinishReason.STOP
        if reason is None and (len(live.output_ids) >= params.max_tokens or kv_len + 1 >= live.max_len):
            reason = FinishReason.LENGTH
        if reason is not None:
            return self._finish(live, reason, last_token=token)
        return self._output(live, [token], None)

    def _output(self, live, new_ids, reason, error=None) -> RequestOutput:
        # in field order, positionally: one of these is built per row per step, and keywords
        # cost more than the rest of the call
        return RequestOutput(live.request.request_id, new_ids, reason is not None, reason, len(live.feed),
                             live.num_cached, len(live.output_ids), error)

    def _finish(self, live: _Live, reason: FinishReason, last_token=None, error=None) -> RequestOutput:
        """The one place a request's lifetime ends."""
        rid = live.request.request_id
        if live.ahead is not None:  # a step launched ahead fed the row one token past its end
            lane, pos = live.ahead
            live.ahead = None
            self.pool.undo_decode(live.row, pos, self.runner.decoder.evicted_at(lane))
        self.scheduler.remove(rid)
        del self._live[rid]
        completed = reason in (FinishReason.STOP, FinishReason.LENGTH)
        session = self.sessions.get(live.request.session_id) if live.request.session_id else None
        if session is None:
            if live.row is not None:
                self.pool.free_row(live.row)
        elif completed:
            new = list(live.request.prompt_token_ids) + live.output_ids
            session.tokens = session.tokens[: live.history_len] + new
            session.num_tokens = len(session.tokens)
            last_prefill = len(live.feed) - (live.forward_ends[-1] if live.forward_ends else 0)
            # the last sampled token is not fed (the next turn feeds it); an append sampled none
            num_decodes = max(len(live.output_ids) - 1, 0)
            self._store(session, self.db.append_turn if self.db else None, session.session_id,
                        len(session.forwards), new, last_prefill, num_decodes, session.num_tokens)
            session.forwards.append((last_prefill, num_decodes))
            session.num_turns += 1
            self.pool.trim(live.row)
        elif live.row is not None:  # abort or error: back to the last completed turn
            if live.row_is_new:
                self.pool.free_row(live.row)
                session.row = None
            else:
                self.pool.restore(live.row, live.snapshot)
        if session is not None:
            session.busy = None
            session.last_used = time.monotonic()
        new_ids = [last_token] if last_token is not None else []
        return self._output(live, new_ids, reason, error)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        rows = [s.row for s in self.sessions.values() if s.row is not None]
        rows += [lv.row for lv in self._live.values() if lv.row is not None and lv.request.session_id is None]
        assert sorted(rows) == self.pool.used_rows(), "engine and pool disagree on used rows"
