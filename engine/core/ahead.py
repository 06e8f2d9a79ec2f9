"""AheadSteps: steady decoding with the host one step behind the device (`EngineConfig.overlap_steps`).

While every running request decodes, the engine's next static decode step is launched, its tokens
read on the device (greedy picks, or each sampling row's draw), before the host applies the step
before it. So the host's work of a step (taking its tokens, building outputs, scheduling) runs
while the device computes the next one.

The next step feeds each row the token the pending step produces (read on the device); a row the
pending step finishes by length is left out (the host knows it in advance), one it finishes
otherwise (EOS, a stop string) was fed one token too many: each row launched ahead carries
`LiveRequest.ahead` = (lane, position), and the engine's `_finish` undoes that token's forward
(`RowPool.undo_decode`), so the row is exactly what the plain order of steps leaves.

The engine owns this object; it borrows the engine's runner, scheduler, pool, live requests and
counters, and is handed the engine's `apply` and `finish` for each step it applies (held for the
call only, so nothing here refers back to the engine).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from engine.core.requests import LiveRequest
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.types import FinishReason, RequestOutput, StepLogits, TokenLogprobs
from engine.kv.rows import RowPool
from engine.runner.attention import ForwardChunk
from engine.runner.decode_graph import GreedyFetch
from engine.runner.model_runner import ModelRunner, RunnerInput

# the engine's `_apply_safely(live, (token, finite), kv_len, logprobs)` and `_finish(live, reason, error=...)`
Apply = Callable[[LiveRequest, tuple[int, bool], int, TokenLogprobs | None], RequestOutput]
Finish = Callable[..., RequestOutput]


class Pending(NamedTuple):
    """A static decode step launched and not yet applied."""

    lives: list[LiveRequest]  # per lane
    positions: list[int]  # the position each lane fed
    fetch: GreedyFetch  # its tokens, on their way to the host


class AheadSteps:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, pool: RowPool, live: dict[str, LiveRequest],
                 stats: dict[str, int]) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.pool = pool
        self.live = live  # the engine's live requests: request id -> LiveRequest
        self.stats = stats
        self.pending: Pending | None = None  # a static decode step launched, not yet applied

    def launch(self, plan: SchedulerOutput, lives: list[LiveRequest], inputs: list[RunnerInput],
               out: StepLogits) -> bool:
        """Leave the step just run pending, if it is a static decode step of every running row:
        its tokens are picked on the device and copied to the host behind it (`step` applies
        it). False: the engine applies it now."""
        logits, owners, greedy = out
        if not (greedy is not None and len(owners) == len(inputs) and all(c.decode for c in plan.chunks)
                and all(lv.grammar is None for lv in lives)):  # a grammar's mask needs the token before
            return False
        try:
            self.pending = self._pend(lives, inputs, logits, greedy)
        except Exception:  # sampling failed: the plain path ends those rows with the error
            return False
        return True

    def _pend(self, lives: list[LiveRequest], inputs: list[RunnerInput], logits: torch.Tensor,
              greedy: torch.Tensor) -> Pending:
        """A launched static step, pending: its tokens picked on the device and on their way to
        the host; each row is marked as fed one token ahead."""
        fetch = self.runner.fetch_picks(logits, greedy, [lv.request.params for lv in lives],
                                        [lv.generator for lv in lives], [lv.logits_state for lv in lives])
        positions = [i.chunk.start for i in inputs]
        for lane, live in enumerate(lives):
            live.ahead = (lane, positions[lane])
        return Pending(lives, positions, fetch)

    def _is_live(self, live: LiveRequest) -> bool:
        return self.live.get(live.request_id) is live

    def step(self, apply: Apply, finish: Finish, hooked: bool) -> list[RequestOutput]:
        """Launch the next static decode step, if the next step is one, then apply the pending
        one while the device runs it. A sampling row draws its next token right after the launch,
        on the device, so its draws come in the order they would without the overlap. `hooked`:
        the engine calls a logits hook, which needs every step's logits on the host (nothing is
        launched ahead)."""
        prev, self.pending = self.pending, None
        chained, failure = [], None
        running = self.scheduler.decoding() if not hooked else None
        still = [(lane, lv) for lane, lv in enumerate(prev.lives) if self._is_live(lv)]
        if running is not None and set(running) == {lv.request_id for _, lv in still}:
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
                    self.pending = self._pend([lv for _, lv in chained], inputs, logits, greedy)
                except Exception as exc:
                    failure = f"sampling failed: {exc}"
        outputs = self._apply(prev, apply, finish)
        if failure is not None:
            outputs += [finish(lv, FinishReason.ERROR, error=failure) for _, lv in chained if self._is_live(lv)]
        if self.pending is not None and not any(self._is_live(lv) for lv in self.pending.lives):
            self.pending = None  # every row it fed ended (and was undone): nothing to apply
        return outputs

    def _apply(self, prev: Pending, apply: Apply, finish: Finish) -> list[RequestOutput]:
        for lane, live in enumerate(prev.lives):
            if live.ahead == (lane, prev.positions[lane]):
                live.ahead = None  # this step is being applied: nothing to undo any more
        lives = [(lane, lv) for lane, lv in enumerate(prev.lives) if self._is_live(lv)]
        try:
            tokens, finite = prev.fetch.result()
            logprobs = prev.fetch.lane_logprobs()
        except Exception as exc:
            return [finish(lv, FinishReason.ERROR, error=f"forward failed: {exc}") for _, lv in lives]
        return [apply(lv, (tokens[lane], finite[lane]), prev.positions[lane] + 1, logprobs.get(lane))
                for lane, lv in lives]
