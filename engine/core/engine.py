"""Engine: the synchronous core. `step()` = schedule -> run -> apply.

The engine owns the model runner, the row pool, the scheduler and the session table. It is not
thread-safe: exactly one thread calls it (the engine process's loop, process.py). Every request's
lifetime ends in `_finish`, whatever the reason (stop, length, abort, error): a stateless
request's row is freed there, and a session's turn is either committed (history grows) or rolled
back to the last completed turn. A request is planned (checked, and its feed worked out) by
requests.py; sessions, their durability and where their rows are belong to sessions.py.

A request with `n` > 1 takes a row per completion at admission; the step that finishes its
prompt copies its row into the others (`_fork`, `RowPool.fork`), and each completion runs from
there as a request of its own (`fork_id`): the prompt is prefilled once.

A turn with `max_tokens` 0 is an append: its forward computes every token it feeds, nothing is
sampled, and the history it commits ends with a computed token.

A turn that a stop string ends commits the text the client got: its tokens up to the stop string,
and the tokens of the text of the one the stop string cut, if it began inside one. Where the row
computed a token past that (a stop string of several tokens), the turn's forwards are rolled back
and the next turn prefills its tokens.

Steady decoding overlaps the host with the device (`EngineConfig.overlap_steps`): while every
running request decodes, the next static decode step is launched, its tokens read on the device
(greedy picks, or each sampling row's draw), before the host applies the step before it
(`ahead.py`). A row that the applied step finishes (EOS, a stop string) was fed one token too
many: `_finish` undoes that token's forward (`RowPool.undo_decode`), so the row is exactly what
the plain order of steps leaves.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import torch

from engine.core.config import EngineConfig
from engine.core.detokenizer import kept_output
from engine.core.ahead import AheadSteps
from engine.core.requests import LiveRequest, RequestPlanner
from engine.core.responses import ResponseStore
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.session_db import SessionFileLock, open_session_db
from engine.core.sessions import Session, SessionTable, fingerprint
from engine.core.structured import Grammars
from engine.core.types import (EngineError, FinishReason, Request, RequestOutput, StepLogits, TokenLogprobs,
                               cancel_ids, fork_id)
from engine.kv.policy import layer_layouts
from engine.kv.windows import budget_windows
from engine.kv.rows import RowPool
from engine.model.hf_adapter import geometry
from engine.model.loader import LoadedModel, load_model
from engine.runner.attention import ForwardChunk
from engine.runner.model_runner import ModelRunner, RunnerInput
from engine.runner.sampler import pick_tokens

log = logging.getLogger(__name__)


class _Batch(NamedTuple):
    """A step's inputs, built from the scheduler's chunks."""

    inputs: list[RunnerInput]
    lives: list[LiveRequest]  # per input
    appended: list[LiveRequest]  # appends whose input is all fed by this step: they end with it


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 session_lock: SessionFileLock | None = None) -> None:
        """`session_lock`: the session file's lock, taken already (it passes to the store)."""
        self.config = config
        loaded = loaded or load_model(config)
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        geo = geometry(loaded.model)
        self.geometry = geo
        self.max_model_len = min(config.max_model_len or geo.max_position_embeddings, geo.max_position_embeddings)
        self.eos_token_ids = set(geo.eos_token_ids)
        dtype = next(loaded.model.parameters()).dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            dtype = torch.bfloat16  # quantized weights: K/V in the compute dtype
        # the windows of bounded layers: one for all, one per layer, or solved within a budget
        self.kv_windows = config.kv_windows
        if config.kv_budget is not None:
            self.kv_windows = budget_windows(config, loaded.name, geo, torch.empty((), dtype=dtype).element_size())
        self.layouts = layer_layouts(config.kv_policy, geo.layer_types, geo.native_window, config.kv_sink,
                                     config.kv_window, self.kv_windows)
        self.pool = RowPool.sized(self.layouts, geo.kv_shapes, dtype, config.device, config.max_rows,
                                  config.kv_block_size, config.kv_cache_bytes)
        capture = self.pool.device.type == "cuda"
        overlap = config.static_decode_batch > 0 and (
            config.overlap_steps if config.overlap_steps is not None else capture)
        self.runner = ModelRunner(loaded.model, self.pool, config.static_decode_batch, self.max_model_len,
                                  capture=capture, fused=config.fused_layers, undoable=overlap, pdl=config.pdl,
                                  nf4=config.nf4_kernels, paged_decode=_paged_decode_kernel(config, self.pool),
                                  cpu_ops=_cpu_layer_ops(config, self.pool))
        self.scheduler = Scheduler(config.token_budget, config.num_seqs_per_step, config.decode_stall_s)
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "steps": 0, "evictions": 0, "rows_released": 0,
                      "swaps_out": 0, "swaps_in": 0, "rebuilds": 0, "rebuild_forwards": 0, "session_db_errors": 0}
        # an SQLite file, or a PostgreSQL store shared by replicas (the table asks it through SharedStore)
        db = (open_session_db(config.session_db, fingerprint(loaded.name, config, geo.vocab_size, self.kv_windows),
                              session_lock) if config.session_db else None)
        self.sessions = SessionTable(self.pool, config.swap_bytes, self.stats, db)
        # stored responses of /v1/responses, in the same store (its verbs: ipc.CALLS)
        self.responses = ResponseStore(db.responses() if db is not None else None, self.stats)
        # structured outputs: the grammar engine's tokenizer and compiled grammars (core/structured.py)
        self.grammars = Grammars(self.tokenizer, geo.vocab_size, geo.eos_token_ids)
        self.planner = RequestPlanner(self.pool, geo.vocab_size, self.max_model_len, self.tokenizer, config.seed,
                                      self.grammars, self.eos_token_ids)
        self._live: dict[str, LiveRequest] = {}
        # steady decoding launched ahead of the host (ahead.py); None: steps applied in order
        self.ahead = (AheadSteps(self.runner, self.scheduler, self.pool, self._live, self.stats, self.grammars)
                      if overlap else None)
        # outputs of requests ended outside `step` by a session's end (closed or evicted with a turn
        # in flight); whoever runs the loop takes them and delivers them like a step's outputs
        self.ended_between_steps: list[RequestOutput] = []
        # the final outputs of completions (n > 1) whose request ended before its row was forked;
        # the step, or the abort, that ended it hands them on
        self._unforked_ends: list[RequestOutput] = []
        # Called with every row's logits before sampling: (request_id, position of the last fed
        # token, logits [vocab], a view). Tests use it to record logits and to inject faults (an
        # altered row or an exception fails that request only). None in serving.
        self.logits_hook: Callable[[str, int, torch.Tensor], None] | None = None

    def close(self) -> None:
        """Release what outlives a step (the SessionDB connection, the grammar thread). The engine
        is unusable after."""
        self.sessions.close()
        self.grammars.close()

    # ---- sessions (the verbs the front end calls) --------------------------------------------------
    def create_session(self, session_id: str | None = None, owner: str | None = None,
                       max_per_owner: int | None = None) -> str:
        """A new session of `owner`; refused (`too_many_sessions`) when the owner already holds
        `max_per_owner` sessions."""
        return self.sessions.create(session_id, owner, max_per_owner)

    def close_session(self, session_id: str, owner: str | None = None) -> bool:
        """Ends the session (aborting a turn in flight) and frees its row; one of this owner's
        that the store holds under other settings is deleted from it. Idempotent: False when
        there is no such session of this owner."""
        s = self.sessions.find(session_id)
        if s is None:
            return self.sessions.delete_stored_elsewhere(session_id, owner)
        if s.owner != owner:
            return False
        self._end_session(s)
        return True

    def reset_session(self, session_id: str, owner: str | None = None) -> None:
        """Forget the history (the row is emptied)."""
        self.sessions.reset(self.sessions.get(session_id, owner))

    def release_row(self, session_id: str, owner: str | None = None) -> bool:
        """Drop an idle session's row but keep its history; its next turn rebuilds the row by
        replaying the history's forwards."""
        s = self.sessions.get(session_id, owner)
        if s.busy is not None or s.row is None:
            return False
        self.sessions.give_up(s)
        return True

    def session_tokens(self, session_id: str, owner: str | None = None) -> list[int]:
        return list(self.sessions.history(self.sessions.get(session_id, owner)))

    def session_tail(self, session_id: str, num_tokens: int, owner: str | None = None) -> tuple[int, list[int]]:
        """(history length, its last `num_tokens` tokens): what a front end needs to prepare the
        next turn's input (whether BOS is due, which closing markup the history already holds)."""
        history = self.sessions.history(self.sessions.get(session_id, owner))
        return len(history), history[len(history) - min(num_tokens, len(history)):]

    def session_info(self, session_id: str, owner: str | None = None) -> dict:
        return {**self.sessions.info(self.sessions.get(session_id, owner)), "kv_policy": self.kv_policy_info()}

    def kv_policy_info(self) -> dict:
        """The KV policy in force: per layer, what its row keeps between forwards ("all": every
        position; an int: sink + that many recent positions; native's rings keep the model's
        window, exactly)."""
        cfg = self.config
        return {"policy": cfg.kv_policy, "sink": cfg.kv_sink, "native_window": self.geometry.native_window,
                "budget_bytes": cfg.kv_budget,
                "layer_windows": ["all" if lay.paged else lay.window for lay in self.layouts]}

    def evict_session(self, session_id: str, reason: str) -> None:
        self._end_session(self.sessions[session_id], evicted_because=reason)

    def expire_idle(self, ttl_seconds: float) -> list[str]:
        """Evict sessions idle for longer than `ttl_seconds`; returns their ids."""
        old = self.sessions.expired(ttl_seconds)
        for s in old:
            self._end_session(s, evicted_because="ttl")
        self.sessions.expired_done(old)
        return [s.session_id for s in old]

    def _end_session(self, s: Session, evicted_because: str | None = None) -> None:
        if s.busy is not None:
            self.ended_between_steps.append(self.abort(s.busy))
        self.sessions.remove(s, evicted_because)

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request: Request, max_in_flight: int | None = None,
                    max_per_owner: int | None = None) -> None:
        """Queue a request. Raises EngineError (and changes nothing) if it is invalid, or if
        `max_in_flight` requests (of any owner) or `max_per_owner` of its owner are already in
        flight (`queue_full`, `too_many_requests`)."""
        if request.request_id in self._live:
            raise EngineError("duplicate request id", code="duplicate_request_id")
        if max_in_flight is not None or max_per_owner is not None:
            every, held = self._in_flight(request.owner)
            client_request = cancel_ids(request.request_id)[2]  # another prompt of one in flight: counted
            if max_in_flight is not None and client_request not in every and len(every) >= max_in_flight:
                raise EngineError("too many requests in flight; retry later", code="queue_full")
            if (max_per_owner is not None and request.owner is not None and client_request not in held
                    and len(held) >= max_per_owner):
                raise EngineError(f"this key has {len(held)} requests in flight, the most allowed; retry later",
                                  code="too_many_requests")
        session = self.sessions.get(request.session_id, request.owner) if request.session_id is not None else None
        history = self.sessions.history(session) if session is not None else []
        live = self.planner.plan(request, session, history)
        if session is not None:
            self.sessions.begin_turn(session)
        # valid: from here on the request is committed
        if live.diverged:
            self.sessions.reset(session)
        self._live[request.request_id] = live
        if session is not None:
            session.busy = request.request_id
        self.scheduler.add(live.sched)

    def _in_flight(self, owner: str | None) -> tuple[set[str], set[str]]:
        """The client requests waiting or running, in all and of `owner`, in one pass: a
        request's n completions, and the prompts of a request of several, count once."""
        every, mine = set(), set()
        for rid, lv in self._live.items():
            base = cancel_ids(rid)[2]
            every.add(base)
            if lv.request.owner == owner:
                mine.add(base)
        return every, mine

    def cancel(self, request_id: str, owner: str | None = None) -> bool:
        """End a request of `owner`, every completion of it and, for a client's request of several
        prompts, every prompt's (`cancel_ids`; between steps; their final outputs are in
        `ended_between_steps`). False when no such request of this owner runs."""
        ids = [rid for rid, lv in self._live.items() if request_id in cancel_ids(rid) and lv.request.owner == owner]
        for rid in ids:
            self.ended_between_steps.append(self.abort(rid))
        return bool(ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now (between steps); rolls its session back. None if unknown. Where
        the request (n > 1) was not forked yet, its other completions' final outputs go to
        `ended_between_steps`."""
        live = self._live.get(request_id)
        if live is None:
            return None
        out = self._finish(live, FinishReason.ABORT)
        self.ended_between_steps += self._unforked_ends
        self._unforked_ends = []
        return out

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def _admit(self, request_id: str) -> bool:
        """The scheduler's admission: take a row and reserve blocks for a waiting request, or
        change nothing. Where rows ran out, an idle session gives its row up first."""
        live = self._live[request_id]
        session = self.sessions[live.request.session_id] if live.request.session_id is not None else None
        n = live.request.params.n  # n > 1: a row for each completion, forked after the prefill

        def fits() -> bool:
            resident = session is not None and session.row is not None
            if not resident and self.pool.num_free_rows < n:
                return False
            if not self.pool.can_reserve(session.row if resident else None, live.max_len):
                return False
            return n == 1 or n * self.pool.blocks_for(live.max_len) <= self.pool.num_free_blocks

        running = None
        while not fits():  # rows or blocks short: idle sessions' rows go first
            running = running or {rid for rid, lv in self._live.items() if lv.row is not None}
            if not self.sessions.make_room(running):
                return False
        if session is None:
            row, live.row_is_new = self.pool.allocate_row(), True
        else:
            row, live.row_is_new = self.sessions.take_row(session, live.max_len, len(live.forward_ends),
                                                          live.history_len)
            if not live.row_is_new:
                live.snapshot = self.pool.snapshot(row)
        self.pool.reserve(row, live.max_len)
        for _ in range(n - 1):
            live.fork_rows.append(self.pool.allocate_row())
            self.pool.reserve(live.fork_rows[-1], live.max_len)
        live.row = row
        live.forward_start = self.pool.kv_len(row)
        return True

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward's outputs. With a step in flight (`AheadSteps`), those are its outputs,
        and the next step is launched first where it can be."""
        outputs = self._step()
        if self._unforked_ends:
            outputs += self._unforked_ends
            self._unforked_ends = []
        return outputs

    def _step(self) -> list[RequestOutput]:
        if self.ahead is not None and self.ahead.pending is not None:
            return self.ahead.step(self._apply_safely, self._finish, self.logits_hook is not None)
        plan = self.scheduler.schedule(self._admit)
        if not plan.chunks:
            return []
        batch = self._batch(plan)
        self.stats["steps"] += 1
        try:
            out = self.runner.run(batch.inputs)
        except Exception as exc:  # the forward failed: end every request in it, keep serving
            return [self._finish(live, FinishReason.ERROR, error=f"forward failed: {exc}") for live in batch.lives]
        if self.ahead is not None and self.logits_hook is None and self.ahead.launch(plan, batch.lives, batch.inputs, out):
            return self.ahead.step(self._apply_safely, self._finish, False)
        return self._apply_step(batch, out)

    def _batch(self, plan: SchedulerOutput) -> _Batch:
        inputs, lives, appended = [], [], []
        for c in plan.chunks:
            live = self._live[c.request_id]
            start = self.pool.kv_len(live.row)
            if c.decode:
                tokens, fstart = [live.output_ids[-1]], start
                self.stats["decode_tokens"] += 1
            else:
                off = live.sched.num_scheduled - c.num_tokens
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
        return _Batch(inputs, lives, appended)

    def _apply_step(self, batch: _Batch, out: StepLogits) -> list[RequestOutput]:
        """Each row's token from the step's logits, applied. From here on a failure belongs to one
        request: it ends with an error, the rest go on."""
        logits, owners, greedy = out
        lives = [batch.lives[n] for n in owners]  # per logits row
        if any(lv.fork_rows for lv in lives):
            logits, greedy = self._fork(lives, logits), None
        failed: dict[int, str] = {}
        if self.logits_hook is not None:
            for j, live in enumerate(lives):
                try:
                    self.logits_hook(live.request_id, self.pool.kv_len(live.row) - 1, logits[j])
                except Exception as exc:
                    failed[j] = f"logits hook failed: {exc}"
        masks, grammar_failed = self.grammars.step_masks([lv.grammar for lv in lives], failed)
        failed.update(grammar_failed)
        picked, sampling_failed, logprobs = pick_tokens(
            logits, greedy, [lv.request.params for lv in lives], [lv.generator for lv in lives],
            [lv.logits_state for lv in lives], skip=failed, masks=masks)
        failed.update(sampling_failed)
        outputs = [self._finish(live, FinishReason.ERROR, error=failed[j]) if j in failed
                   else self._apply_safely(live, picked[j], self.pool.kv_len(live.row), logprobs.get(j))
                   for j, live in enumerate(lives)]
        outputs += [self._finish(live, FinishReason.LENGTH) for live in batch.appended]
        return outputs

    def _fork(self, lives: list[LiveRequest], logits: torch.Tensor) -> torch.Tensor:
        """Requests with n > 1 whose prompt this step finished: each row is copied into the rows
        held for the other completions, which join `lives` (and the step's logits, as copies of
        their parent's row) and run as requests of their own from here on."""
        parents = [(j, lv) for j, lv in enumerate(lives) if lv.fork_rows]
        copies = []
        for j, parent in parents:
            for index, row in enumerate(parent.fork_rows, start=1):
                self.pool.fork(parent.row, row)
                child = self.planner.fork(parent, index, row)
                self._live[child.request_id] = child
                self.scheduler.add_decoding(child.sched)
                lives.append(child)
                copies.append(j)
            parent.fork_rows = []
            parent.forks_pending = False
        return torch.cat([logits, logits[copies]])

    def _apply_safely(self, live: LiveRequest, picked: tuple[int, bool], kv_len: int,
                      logprobs: TokenLogprobs | None = None) -> RequestOutput:
        try:
            return self._apply(live, picked, kv_len, logprobs)
        except Exception as exc:  # detokenizer or bookkeeping: this request only
            if live.request_id not in self._live:
                raise  # it failed while ending: the engine's own state is in doubt
            log.exception("request %s failed in its step", live.request_id)
            return self._finish(live, FinishReason.ERROR, error=f"step failed: {exc}")

    def _apply(self, live: LiveRequest, picked: tuple[int, bool], kv_len: int,
               logprobs: TokenLogprobs | None = None) -> RequestOutput:
        """The token sampled after the step in which the row reached `kv_len` positions (and its
        logprobs, where the request wants them)."""
        token, finite = picked
        if not finite:
            return self._finish(live, FinishReason.ERROR, error="sampling failed: non-finite logits")
        live.output_ids.append(token)
        if live.grammar is not None and not live.grammar.accept(token):
            return self._finish(live, FinishReason.ERROR, error=f"grammar failed: {live.grammar.error}")
        reason = live.finish_reason(token, kv_len, self.eos_token_ids)
        lps = [logprobs] if logprobs is not None else None
        if reason is not None:
            return self._finish(live, reason, last_token=token, logprobs=lps)
        return self._output(live, [token], None, None, lps)

    def _output(self, live: LiveRequest, new_ids: list[int], reason: FinishReason | None,
                error: str | None = None, logprobs: list[TokenLogprobs] | None = None) -> RequestOutput:
        # in field order, positionally: one of these is built per row per step, and keywords
        # cost more than the rest of the call
        return RequestOutput(live.request_id, new_ids, reason is not None, reason, len(live.feed),
                             live.num_cached, len(live.output_ids), error, logprobs)

    def _finish(self, live: LiveRequest, reason: FinishReason, last_token=None, error=None,
                logprobs: list[TokenLogprobs] | None = None) -> RequestOutput:
        """The one place a request's lifetime ends."""
        rid = live.request_id
        if live.ahead is not None:  # a step launched ahead fed the row one token past its end
            lane, pos = live.ahead
            live.ahead = None
            self.pool.undo_decode(live.row, pos, self.runner.decoder.evicted_at(lane))
        self.scheduler.remove(rid)
        del self._live[rid]
        session = self.sessions.find(live.request.session_id) if live.request.session_id else None
        for row in live.fork_rows:  # n > 1, ended before its prompt was prefilled
            self.pool.free_row(row)
        live.fork_rows = []
        if live.forks_pending:  # the completions it would have forked end with it, as it ended
            live.forks_pending = False
            self._unforked_ends += [RequestOutput(fork_id(rid, i), [], True, reason, len(live.feed), live.num_cached,
                                                  0, error, None) for i in range(1, live.request.params.n)]
        if session is None:
            if live.row is not None:
                self.pool.free_row(live.row)
        elif reason in (FinishReason.STOP, FinishReason.LENGTH):
            kept, pending, computed_kept = self._turn_output(live)
            new = list(live.request.prompt_token_ids) + kept + pending
            if computed_kept:
                last_prefill = len(live.feed) - (live.forward_ends[-1] if live.forward_ends else 0)
                # the last sampled token is not fed (the next turn feeds it); an append sampled none
                self.sessions.commit_turn(session, live.history_len, new, last_prefill,
                                          max(len(live.output_ids) - 1, 0))
                self.pool.trim(live.row)
            else:  # the row computed tokens the history does not keep: the next turn prefills this one's
                self._roll_back(live, session)
                self.sessions.commit_turn(session, live.history_len, new, 0, 0)
        elif live.row is not None:  # abort or error: back to the last completed turn
            self._roll_back(live, session)
        if session is not None:
            session.busy = None
            session.last_used = time.monotonic()
            self.sessions.end_turn(session)
        new_ids = [last_token] if last_token is not None else []
        return self._output(live, new_ids, reason, error, logprobs)

    def _turn_output(self, live: LiveRequest) -> tuple[list[int], list[int], bool]:
        """A session turn's output as its history keeps it: the text the client got. Its sampled
        tokens; or, where a stop string ended it, those wholly before the stop string and the
        tokens of the text of the one it cut (`pending`: the next turn feeds them). And whether
        the row computed only kept tokens (the last sampled token is not fed)."""
        out = live.output_ids
        if live.detok is None or not live.detok.stopped:
            return out, [], True
        kept, pending = kept_output(self.planner.tokenizer, out, live.detok.text)
        return kept, pending, len(kept) >= len(out) - 1

    def _roll_back(self, live: LiveRequest, session: Session) -> None:
        """A session's row back to where its last completed turn left it (a row taken for this turn
        is freed: the next turn rebuilds it)."""
        if live.row_is_new:
            self.pool.free_row(live.row)
            session.row = None
        else:
            self.pool.restore(live.row, live.snapshot)

    def check_invariants(self) -> None:
        """The books balance: the pool's own, rows held by sessions and requests are exactly the
        pool's used rows, a busy session's turn is live, swapped bytes and owners add up."""
        self.pool.check_invariants()
        rows = self.sessions.rows()
        rows += [lv.row for lv in self._live.values() if lv.row is not None and lv.request.session_id is None]
        rows += [row for lv in self._live.values() for row in lv.fork_rows]
        assert sorted(rows) == self.pool.used_rows(), "engine and pool disagree on used rows"
        sessions = list(self.sessions.values())
        assert all(s.busy is None or s.busy in self._live for s in sessions), "a busy session's turn is gone"
        assert sum(s.swapped.nbytes for s in sessions if s.swapped is not None) == self.sessions.swapped_bytes, \
            "swapped bytes do not add up"
        owned = Counter(s.owner for s in sessions)
        assert all(self.sessions.owned[o] == n for o, n in owned.items()) and \
            sum(self.sessions.owned.values()) == len(sessions), "sessions per owner do not add up"


def _paged_decode_kernel(config: EngineConfig, pool: RowPool):
    """The CPU's paged decode attention kernel where the config asks for it and it builds."""
    if pool.device.type != "cpu" or not config.cpu_decode_attention:
        return None
    from engine.kernels.cpu_attention import CpuDecodeAttention

    return _cpu_kernel(CpuDecodeAttention, config, "decode attention gathers the keys for torch's SDPA")


def _cpu_layer_ops(config: EngineConfig, pool: RowPool):
    """The CPU's kernels for the fused forward's norms and RoPE where the config asks for them
    and they build."""
    if pool.device.type != "cpu" or not config.cpu_layer_ops:
        return None
    from engine.kernels.cpu_ops import CpuLayerOps

    return _cpu_kernel(CpuLayerOps, config, "the layers' norms and RoPE run as torch ops")


def _cpu_kernel(kind, config: EngineConfig, otherwise: str):
    from engine.kernels.native import KernelUnavailable
    from engine.model.source import default_cache_dir

    try:
        return kind(Path(config.cache_dir) if config.cache_dir else default_cache_dir())
    except KernelUnavailable as e:
        log.warning("%s; %s", e, otherwise)
        return None
