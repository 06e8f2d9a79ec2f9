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

A row with a grammar samples under a mask that needs its previous token accepted: with such rows
in the step, the pending step is applied right after the next forward is launched (its grammar
rows first), the masks are filled on the grammar thread while this thread applies the other rows
and the device runs that forward, and the picks are queued behind it (on the device, like every
asking row's), so the host's work still overlaps the device's.

The engine owns this object; it borrows the engine's runner, scheduler, pool, live requests and
counters, and is handed the engine's `apply` and `finish` for each step it applies (held for the
call only, so nothing here refers back to the engine).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple

import torch

from engine.core.requests import LiveRequest
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.structured import Grammars, TokenMasks
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
                 stats: dict[str, int], grammars: Grammars) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.pool = pool
        self.live = live  # the engine's live requests: request id -> LiveRequest
        self.stats = stats
        self.grammars = grammars  # the engine's: a step's grammar masks
        self.pending: Pending | None = None  # a static decode step launched, not yet applied

    def launch(self, plan: SchedulerOutput, lives: list[LiveRequest], inputs: list[RunnerInput],
               out: StepLogits) -> bool:
        """Leave the step just run pending, if it is a static decode step of every running row:
        its tokens are picked on the device and copied to the host behind it (`step` applies
        it). False: the engine applies it now."""
        logits, owners, greedy = out
        if not (greedy is not None and len(owners) == len(inputs) and all(c.decode for c in plan.chunks)):
            return False
        masks, failed = self.grammars.step_masks([lv.grammar for lv in lives], ())
        if failed:  # the plain path ends those rows with the grammar's error
            return False
        try:
            fetch = self._fetch(lives, logits, greedy, masks)
        except Exception:  # sampling failed: the plain path ends those rows with the error
            return False
        positions = [i.chunk.start for i in inputs]
        self._mark(lives, positions)
        self.pending = Pending(lives, positions, fetch)
        return True

    def _fetch(self, lives: list[LiveRequest], logits: torch.Tensor, greedy: torch.Tensor,
               masks: TokenMasks | None) -> GreedyFetch:
        """A launched static step's tokens picked on the device (under the grammar rows' masks)
        and on their way to the host."""
        return self.runner.fetch_picks(logits, greedy, [lv.request.params for lv in lives],
                                       [lv.generator for lv in lives], [lv.logits_state for lv in lives], masks)

    @staticmethod
    def _mark(lives: list[LiveRequest], positions: list[int]) -> None:
        """Each row as fed one token ahead: undone if the row ends before that step is applied."""
        for lane, live in enumerate(lives):
            live.ahead = (lane, positions[lane])

    def _is_live(self, live: LiveRequest) -> bool:
        return self.live.get(live.request_id) is live

    def _chainable(self, prev: Pending, hooked: bool) -> list[tuple[int, LiveRequest]]:
        """The pending step's lanes that the next step feeds: every running request is in it,
        and none ends by length at the pending step (the host knows that in advance)."""
        if hooked:
            return []
        running = self.scheduler.decoding()  # None: a request waits, or one prefills
        still = [(lane, lv) for lane, lv in enumerate(prev.lives) if self._is_live(lv)]
        if running is None or set(running) != {lv.request_id for _, lv in still}:
            return []
        return [(lane, live) for lane, live in still
                if len(live.output_ids) + 1 < live.request.params.max_tokens and prev.positions[lane] + 2 < live.max_len]

    def step(self, apply: Apply, finish: Finish, hooked: bool) -> list[RequestOutput]:
        """Launch the next static decode step, if the next step is one, then apply the pending
        one while the device runs it. A sampling row draws its next token right after the launch,
        on the device, so its draws come in the order they would without the overlap. A row with
        a grammar needs the pending step's token accepted before its mask for the next step can
        be filled: with such rows the pending step is applied right after the launch, the masks
        filled while the device still runs the forward, and the picks queued behind it. `hooked`:
        the engine calls a logits hook, which needs every step's logits on the host (nothing is
        launched ahead)."""
        prev, self.pending = self.pending, None
        chained = self._chainable(prev, hooked)
        lives = [lv for _, lv in chained]
        outputs: list[RequestOutput] = []
        failure = None
        if chained:
            inputs = []
            for live in lives:
                start = self.pool.kv_len(live.row)
                inputs.append(RunnerInput(ForwardChunk(live.row, 1, start, start, True), [0], True))
            self.stats["steps"] += 1
            self.stats["decode_tokens"] += len(inputs)
            try:
                logits, _, greedy = self.runner.run(inputs, [lane for lane, _ in chained])
            except Exception as exc:  # the forward failed: its rows end once the pending step is applied
                failure = f"forward failed: {exc}"
            else:
                positions = [i.chunk.start for i in inputs]
                self._mark(lives, positions)
                masks, failed = None, {}
                if any(lv.grammar is not None for lv in lives):
                    outputs, filling = self._apply_filling_masks(prev, lives, apply, finish)
                    prev = None
                    masks, failed = filling.result()
                outputs += [finish(lives[j], FinishReason.ERROR, error=error) for j, error in failed.items()]
                try:
                    self.pending = Pending(lives, positions, self._fetch(lives, logits, greedy, masks))
                except Exception as exc:
                    failure = f"sampling failed: {exc}"
        if prev is not None:
            outputs += self._apply(prev, apply, finish)
        if failure is not None:
            outputs += [finish(lv, FinishReason.ERROR, error=failure) for lv in lives if self._is_live(lv)]
        if self.pending is not None and not any(self._is_live(lv) for lv in self.pending.lives):
            self.pending = None  # every row it fed ended (and was undone): nothing to apply
        return outputs

    def _apply_filling_masks(self, prev: Pending, lives: list[LiveRequest], apply: Apply,
                             finish: Finish) -> tuple[list[RequestOutput], Future]:
        """The pending step applied, its grammar rows first; then the masks of the step just
        launched (`lives`) fill on the grammar thread, which lets go of the GIL, while this
        thread applies the other rows. Returns the outputs and the masks' future."""
        with_grammar = self._apply(prev, apply, finish, lambda lv: lv.grammar is not None)
        filling = self.grammars.fill_masks_async([lv.grammar if self._is_live(lv) else None for lv in lives])
        return with_grammar + self._apply(prev, apply, finish, lambda lv: lv.grammar is None), filling

    def _apply(self, prev: Pending, apply: Apply, finish: Finish,
               which: Callable[[LiveRequest], bool] | None = None) -> list[RequestOutput]:
        """The pending step's tokens applied to its live rows (those `which` selects)."""
        for lane, live in enumerate(prev.lives):
            if live.ahead == (lane, prev.positions[lane]):
                live.ahead = None  # this step is being applied: nothing to undo any more
        lives = [(lane, lv) for lane, lv in enumerate(prev.lives) if self._is_live(lv) and (which is None or which(lv))]
        try:
            tokens, finite = prev.fetch.result()
            logprobs = prev.fetch.lane_logprobs()
        except Exception as exc:
            return [finish(lv, FinishReason.ERROR, error=f"forward failed: {exc}") for _, lv in lives]
        return [apply(lv, (tokens[lane], finite[lane]), prev.positions[lane] + 1, logprobs.get(lane))
                for lane, lv in lives]
