"""Scheduler: which rows run in the next step, and how many tokens each. No torch, no asyncio.

Policy (continuous batching with chunked prefill):
  1. every running request that is decoding gets one token (oldest first);
  2. requests still prefilling continue, in admission order, with chunks that fit the token budget;
  3. waiting requests are admitted in arrival order while the budget, the per-step row limit and
     the KV capacity allow it (the check and the commit are the caller's `admit`, passed to
     each `schedule` call, so the scheduler holds no reference to its caller).
With a decode stall bound (`max_decode_stall_s` > 0), prompts come first while they wait: steps
2 and 3 take the budget before step 1, and decoding rows get only what they leave. So a burst of
prompts prefills in whole-budget steps, and a decoding row pauses through it, for at most the
bound: once some row has gone that long without a token, the next step decodes every row first.
A row then sees one long gap per burst rather than one per prefill step.
A request's prefill is one logical forward, or several when a row is rebuilt from a stored
transcript (`forward_ends`): a chunk never crosses the end of one, so each is replayed as it ran.
Admission is FIFO: a request that does not fit blocks those behind it, so big requests are not
starved by a stream of small ones. A prompt that a step can take whole (the budget less this
step's decodes, where they come first) is not split behind other prompt chunks: where the budget
left is short of it, it waits for the next step, which it starts. Its first chunk would only
lengthen a step whose rows it does not finish, and it ends in the next step either way; so in a
burst of such prompts each step ends with every prompt it started finished. With prompts first,
the budget such a step leaves is not given to decoding rows: they pause through the burst as
they would if the prompt had been split to fill it (else every step of the burst would be one
long gap of every stream).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import NamedTuple


@dataclass
class SchedRequest:
    request_id: str
    num_prompt_tokens: int  # tokens to prefill for this turn
    num_scheduled: int = 0  # prompt tokens scheduled in earlier steps and this one
    decoding: bool = False  # prefill done; each step feeds the last sampled token
    # ends (token counts) of the logical forwards that precede the last one; empty: the prefill
    # is one logical forward (chunked as the budget allows)
    forward_ends: list[int] = field(default_factory=list)
    _next_end: int = 0  # index into forward_ends of the next end not reached yet

    @property
    def num_remaining(self) -> int:
        return self.num_prompt_tokens - self.num_scheduled

    @property
    def next_piece(self) -> int:
        """Tokens to the end of the next logical forward (the rest of the prompt where no end is
        marked): the most one chunk may take."""
        if self._next_end < len(self.forward_ends):
            return self.forward_ends[self._next_end] - self.num_scheduled
        return self.num_remaining


class ScheduledChunk(NamedTuple):
    request_id: str
    num_tokens: int  # tokens to feed this step
    prefill_done: bool  # the last prompt token is in this chunk (always True for a decode)
    decode: bool = False  # feeds the last sampled token
    forward_done: bool = True  # a logical forward ends with this chunk (always at prefill_done)


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    admitted: list[str]  # request ids admitted this step (the caller already committed them)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, token_budget: int, max_seqs: int, max_decode_stall_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.token_budget = token_budget
        self.max_seqs = max_seqs
        self.max_decode_stall_s = max_decode_stall_s  # 0: decoding rows take one token every step
        self.clock = clock
        self.waiting: deque[SchedRequest] = deque()
        self.running: list[SchedRequest] = []
        self._stalled_since: float | None = None  # a decoding row has had no token since then

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: SchedRequest) -> None:
        self.waiting.append(req)

    def add_decoding(self, req: SchedRequest) -> None:
        """A request whose prefill another one did (a fork of its row): it decodes from the next step."""
        req.num_scheduled, req.decoding = req.num_prompt_tokens, True
        self.running.append(req)

    def remove(self, request_id: str) -> None:
        self.running = [r for r in self.running if r.request_id != request_id]
        self.waiting = deque(r for r in self.waiting if r.request_id != request_id)

    def is_waiting(self, request_id: str) -> bool:
        return any(r.request_id == request_id for r in self.waiting)

    def decoding(self) -> list[str] | None:
        """The running requests, when none waits, every one decodes and all fit one step: what
        `schedule` would give one token each (None otherwise). Asks; changes nothing."""
        if self.waiting or len(self.running) > min(self.max_seqs, self.token_budget):
            return None
        if not all(r.decoding for r in self.running):
            return None
        return [r.request_id for r in self.running]

    def schedule(self, admit: Callable[[str], bool]) -> SchedulerOutput:
        """The next step's chunks. `admit(request_id)` reserves what a waiting request needs (its
        row, its blocks) and returns True, or returns False and changes nothing."""
        budget, seqs = self.token_budget, self.max_seqs
        decoding = [r for r in self.running if r.decoding]
        now = self.clock() if decoding and self.max_decode_stall_s > 0 else 0.0
        prompts_first = bool(decoding) and self.max_decode_stall_s > 0 and (
            self._stalled_since is None or now - self._stalled_since < self.max_decode_stall_s)
        decodes: list[ScheduledChunk] = []
        if not prompts_first:
            budget, seqs = self._decodes(decoding, decodes, budget, seqs)
        prefills: list[ScheduledChunk] = []
        for r in self.running:
            if not r.decoding and budget > 0 and seqs > 0:
                prefills.append(self._prefill(r, budget))
                budget, seqs = budget - prefills[-1].num_tokens, seqs - 1
        admitted = []
        whole = self.token_budget - len(decodes)  # what a step gives prompts
        deferred = False  # a prompt waits for the next step to take it whole
        while self.waiting and budget > 0 and seqs > 0:
            r = self.waiting[0]
            if prefills and budget < r.next_piece <= whole:
                deferred = True
                break
            if not admit(r.request_id):
                break
            self.waiting.popleft()
            self.running.append(r)
            admitted.append(r.request_id)
            prefills.append(self._prefill(r, budget))
            budget, seqs = budget - prefills[-1].num_tokens, seqs - 1
        if prompts_first and not deferred:  # a burst's steps are the prompts': decoding rows pause through it
            self._decodes(decoding, decodes, budget, seqs)
        if len(decodes) == len(decoding):
            self._stalled_since = None
        elif self._stalled_since is None:
            self._stalled_since = now
        return SchedulerOutput(decodes + prefills, admitted)

    @staticmethod
    def _decodes(decoding: list[SchedRequest], chunks: list[ScheduledChunk], budget: int,
                 seqs: int) -> tuple[int, int]:
        """One token for each decoding row that fits, oldest first; the budget and rows left."""
        for r in decoding:
            if budget <= 0 or seqs <= 0:
                break
            chunks.append(ScheduledChunk(r.request_id, 1, True, decode=True))
            budget, seqs = budget - 1, seqs - 1
        return budget, seqs

    @staticmethod
    def _prefill(r: SchedRequest, budget: int) -> ScheduledChunk:
        piece = r.next_piece
        n = min(piece, budget)
        forward_done = n == piece and r._next_end < len(r.forward_ends)
        if forward_done:
            r._next_end += 1
        r.num_scheduled += n
        done = r.num_remaining == 0
        if done:
            r.decoding = True
        return ScheduledChunk(r.request_id, n, done, forward_done=forward_done or done)
