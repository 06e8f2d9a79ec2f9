"""A request's validation and its plan: what it feeds, how long its row may grow, how its row's
history is brought back. Planning changes nothing; the engine commits a plan (`LiveRequest`) only
once it is valid.

A session turn feeds `history[kv_len:] + new input` as one logical forward: history is never
prefilled twice. A session without a row (given up, or loaded from the SessionDB) replays the
logical forwards that computed its history, so its row is rebuilt exactly (`forward_ends`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Annotated

import msgspec
import torch

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.scheduler import SchedRequest
from engine.core.sessions import Session
from engine.core.structured import Grammars, RowGrammar
from engine.core.types import EngineError, FinishReason, Request, fork_id
from engine.kv.rows import RowPool, RowSnapshot
from engine.runner.logits_process import RowLogitsState
from engine.runner.sampler import make_generator


@dataclass
class LiveRequest:
    request: Request
    sched: SchedRequest
    feed: list[int]  # tokens this turn prefills: uncomputed history + new input
    num_cached: int  # history tokens already in the row
    history_len: int  # session history length when the turn began (rollback point)
    max_len: int  # positions this request may reach (context limit)
    generator: torch.Generator
    detok: IncrementalDetokenizer | None
    forward_ends: list[int] = field(default_factory=list)  # replayed forwards' ends within feed
    diverged: bool = False  # the prompt does not continue the session: it starts over (reset)
    row: int | None = None
    forward_start: int = 0  # row length when the current logical forward began
    snapshot: RowSnapshot | None = None  # row state to restore if the turn does not complete
    row_is_new: bool = False  # row allocated for this turn (rollback frees it)
    output_ids: list[int] = field(default_factory=list)
    # (lane, position) in the newest launched step, while its token is not applied yet
    ahead: tuple[int, int] | None = None
    # penalties, biases, min_tokens: what the sampler keeps for the row on the device
    logits_state: RowLogitsState | None = None
    grammar: RowGrammar | None = None  # structured output: the grammar's state after output_ids
    # n > 1: the empty rows (allocated and reserved at admission) its row is forked into once
    # the prompt is prefilled; completion i then runs as a request of its own, `fork_id(id, i)`
    fork_rows: list[int] = field(default_factory=list)
    # n > 1, its row not forked yet: were it to end now, its other completions end with it
    forks_pending: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def finish_reason(self, token: int, kv_len: int, eos_token_ids: set[int]) -> FinishReason | None:
        """Why the request ends with `token` (just appended to output_ids, and accepted by its
        grammar), sampled once its row reached `kv_len` positions; None: it goes on."""
        params = self.request.params
        if (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return FinishReason.STOP
        if self.detok is not None and self.detok.add(token)[1]:
            return FinishReason.STOP
        if self.grammar is not None and self.grammar.done:  # complete: nothing more may follow
            return FinishReason.STOP
        if len(self.output_ids) >= params.max_tokens or kv_len + 1 >= self.max_len:
            return FinishReason.LENGTH
        return None


class RequestPlanner:
    """Checks a request against the model and the pool, and plans it."""

    def __init__(self, pool: RowPool, vocab_size: int, max_model_len: int, tokenizer, seed: int,
                 grammars: Grammars, eos_token_ids: set[int] = frozenset()) -> None:
        self.pool = pool
        self.grammars = grammars
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = vocab_size
        self._token_ids = token_ids_type(vocab_size)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self._seeds = itertools.count(seed * 1_000_003)

    def plan(self, request: Request, session: Session | None, history: list[int]) -> LiveRequest:
        """The request's plan, given its session and that session's history. Raises EngineError
        (and changes nothing) when the request is invalid."""
        params = request.params
        params.validate()
        ids = prompt = request.prompt_token_ids
        if not ids:
            raise EngineError("prompt is empty", param="prompt")
        if request.append_only and session is None:
            raise EngineError("max_tokens 0 appends to a session: a request without one must generate",
                              param="max_tokens")
        vocab = self.vocab_size
        if not valid_token_ids(ids, self._token_ids):
            raise EngineError(f"token ids must be integers in [0, {vocab})", param="prompt")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise EngineError(f"logit_bias token ids must be in [0, {vocab})", param="logit_bias")
        if not valid_token_ids(list(params.stop_token_ids), self._token_ids):
            raise EngineError(f"stop_token_ids must be integers in [0, {vocab})", param="stop_token_ids")
        if params.n > 1 and session is not None:
            raise EngineError("n > 1 needs a request of its own: a session has one row", param="n")
        if params.stop and self.tokenizer is None:
            raise EngineError("stop strings need a tokenizer", param="stop")
        if session is not None and session.busy is not None:
            raise EngineError("session has a turn in flight", code="session_busy", param="session_id")
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
        max_len = self._check_length(len(history), len(ids), params.max_tokens, params.max_tokens_fit, params.n)
        if params.n > self.pool.num_rows or params.n * self.pool.blocks_for(max_len) > self.pool.num_blocks - 1:
            raise EngineError(f"n = {params.n} completions of {max_len} tokens each do not fit the KV cache "
                              f"({self.pool.num_rows} rows); lower n or max_tokens", code="kv_capacity_exceeded",
                              param="n")
        kv_len, forward_ends = 0, []
        if diverged or session is None:
            pass
        elif session.row is not None:
            kv_len = self.pool.kv_len(session.row)
        elif session.swapped is not None:
            kv_len = session.swapped.kv_len  # the turn brings the row back from host memory
        elif history:  # no row: rebuild it by replaying the forwards that computed the history
            for prefill, decodes in session.forwards:
                if not prefill:  # a turn whose tokens the next turn's prefill fed: no forward of its own
                    continue
                end = forward_ends[-1] if forward_ends else 0
                forward_ends += [end + prefill, *range(end + prefill + 1, end + prefill + decodes + 1)]
        grammar = None
        if params.grammar is not None and not request.append_only:
            grammar = self.grammars.matcher(params.grammar, params.stop_token_ids)
        feed = history[kv_len:] + list(ids)
        seed = params.seed if params.seed is not None else next(self._seeds)
        return LiveRequest(
            request=request,
            sched=SchedRequest(request.request_id, len(feed), forward_ends=forward_ends),
            feed=feed,
            num_cached=kv_len,
            history_len=len(history),
            max_len=max_len,
            generator=make_generator(seed),
            # stop strings are matched on the text (the front end detokenizes for the client)
            detok=IncrementalDetokenizer(self.tokenizer, params.stop) if params.stop else None,
            forward_ends=forward_ends,
            diverged=diverged,
            # repetition_penalty counts the prompt as sent (a session turn: the turn's input)
            logits_state=RowLogitsState(params, prompt, vocab, self.pool.device, self.eos_token_ids)
            if params.processed else None,
            grammar=grammar,
            forks_pending=params.n > 1,
        )

    def fork(self, parent: LiveRequest, index: int, row: int) -> LiveRequest:
        """Completion `index` of `parent` (n > 1), on `row`, a copy of the parent's row: it has
        the parent's prompt and state, its own generator (the parent's seed + index, when the
        request has a seed), its own penalty state and its own copy of the grammar's matcher, and
        decodes from the next step."""
        params = parent.request.params
        seed = params.seed + index if params.seed is not None else next(self._seeds)
        request = replace(parent.request, request_id=fork_id(parent.request_id, index),
                          params=replace(params, n=1, seed=seed))
        return LiveRequest(
            request=request,
            sched=SchedRequest(request.request_id, len(parent.feed)),
            feed=parent.feed,
            num_cached=parent.num_cached,
            history_len=parent.history_len,
            max_len=parent.max_len,
            generator=make_generator(seed),
            detok=IncrementalDetokenizer(self.tokenizer, params.stop) if params.stop else None,
            row=row,
            forward_start=parent.forward_start,
            row_is_new=True,
            logits_state=parent.logits_state.fork() if parent.logits_state is not None else None,
            grammar=parent.grammar.fork() if parent.grammar is not None else None,
        )

    def _check_length(self, num_history: int, num_input: int, max_tokens: int, fit: bool = False, n: int = 1) -> int:
        """The positions the request may reach; raises when they do not fit the model or the pool.
        `fit`: max_tokens is lowered to the room the model and the pool leave each of the `n`
        completions, if any."""
        if fit:
            room = self.max_model_len
            if self.pool.blocks_for(1):  # paged layers: the n rows share the cache's blocks
                room = min(room, (self.pool.num_blocks - 1) // n * self.pool.block_size)
            if num_history + num_input < self.max_model_len and room - num_history - num_input < 1:
                raise EngineError(
                    f"prompt ({num_history + num_input} tokens with history) leaves no room in the KV cache "
                    f"({room} tokens{' per completion' if n > 1 else ''}) for a generated token",
                    code="kv_capacity_exceeded",
                    param="prompt" if n == 1 else "n",
                )
            max_tokens = max(1, min(max_tokens, room - num_history - num_input))
        if num_history + num_input >= self.max_model_len:
            raise EngineError(
                f"history ({num_history}) + prompt ({num_input}) tokens reach the context limit of "
                f"{self.max_model_len} tokens",
                code="context_length_exceeded",
                param="prompt",
            )
        if num_history + num_input + max_tokens > self.max_model_len:
            raise EngineError(
                f"prompt ({num_history + num_input} tokens with history) + max_tokens ({max_tokens}) "
                f"exceed the context limit of {self.max_model_len} tokens",
                code="context_length_exceeded",
                param="max_tokens",
            )
        max_len = min(num_history + num_input + max_tokens, self.max_model_len)
        if self.pool.blocks_for(max_len) > self.pool.num_blocks - 1:
            raise EngineError(
                f"{max_len} tokens exceed the KV cache ({(self.pool.num_blocks - 1) * self.pool.block_size} "
                "tokens); lower max_tokens",
                code="kv_capacity_exceeded",
                param="max_tokens",
            )
        return max_len


def token_ids_type(vocab: int):
    """The type of a list of token ids of a `vocab`-token model, for `valid_token_ids`."""
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab)]]


def valid_token_ids(ids: list, kind) -> bool:
    """Whether `ids` is a list of ints (a bool is not one) within `kind`'s range
    (`token_ids_type`), checked in one pass in C (msgspec): about a fifth of the time of the
    interpreter's type, min and max loops (bench/intake.py). The engine process takes in every queued
    submission between two steps, so a burst of long prompts waits on this."""
    try:
        msgspec.convert(ids, kind)
    except msgspec.ValidationError:
        return False
    return True
