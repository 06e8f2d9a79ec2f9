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

A row with a grammar samples under a mask that needs its previous token accepted. Its pick is
made apart from the step's, right before the next step is launched: the pending step is applied
right after a launch (its grammar rows first), their masks for the step just launched fill on the
grammar thread while the engine thread applies the other rows and the device runs the forward,
and at the next launch each grammar row whose mask is ready is picked on the device, where its
token feeds the new step like every row's. A row whose mask is still filling when the device has
finished the forward sits the next step out (`Late`): its logits row is kept, picked once the
mask is filled, and the row is fed again from the host in the first step launched after its
token is applied. So the other rows never wait for a grammar engine slower than the device, and
every row's tokens are those of the plain order.

The engine owns this object; it borrows the engine's runner, scheduler, pool, live requests and
counters, and is handed the engine's `apply` and `finish` for each step it applies (held for the
call only, so nothing here refers back to the engine).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.core.requests import LiveRequest
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.structured import Grammars
from engine.core.types import FinishReason, RequestOutput, StepLogits, TokenLogprobs
from engine.kv.rows import RowPool
from engine.runner.attention import ForwardChunk
from engine.runner.decode_graph import GreedyFetch
from engine.runner.model_runner import ModelRunner, RunnerInput

# the engine's `_apply_safely(live, (token, finite), kv_len, logprobs)` and `_finish(live, reason, error=...)`
Apply = Callable[[LiveRequest, tuple[int, bool], int, TokenLogprobs | None], RequestOutput]
Finish = Callable[..., RequestOutput]


# the host's work between giving up on a late mask and the next step's launch, which the device
# would otherwise wait for (the picks of the rows whose masks are ready, the launch itself)
LAUNCH_MARGIN_S = 0.3e-3


class Pending(NamedTuple):
    """A static decode step launched and not yet applied."""

    lives: list[LiveRequest]  # per lane
    positions: list[int]  # the position each lane fed
    logits: torch.Tensor  # [lanes, vocab]: valid until the next step is launched
    fetch: GreedyFetch  # its tokens on their way to the host (but the grammar lanes')
    masks: dict[int, Future]  # grammar lane -> its mask for this step's pick, filling
    launched: float  # when it was launched (host clock)


@dataclass
class Late:
    """A grammar row sitting out: its logits of the step it last ran in, picked once its mask is
    filled; the row is fed again from the host once that token is applied."""

    live: LiveRequest
    position: int  # the position that step fed
    logits: torch.Tensor  # [1, vocab]
    mask: Future  # its mask, filling
    fetch: GreedyFetch | None = None  # its pick on its way to the host, once queued


class AheadSteps:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, pool: RowPool, live: dict[str, LiveRequest],
                 stats: dict[str, int], grammars: Grammars) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.pool = pool
        self.live = live  # the engine's live requests: request id -> LiveRequest
        self.stats = stats
        self.grammars = grammars  # the engine's: grammar rows' masks, filled on its thread
        self.pending: Pending | None = None  # a static decode step launched, not yet applied
        self.late: list[Late] = []  # grammar rows sitting out; only while a step is pending
        # how long a step takes from its launch to its tokens on the host, where the host waited
        # for them (a running mean): a late mask is given up that long after the launch, less the
        # host's work before the next launch, so that the device does not wait for that work
        self.step_s = 0.0

    def launch(self, plan: SchedulerOutput, lives: list[LiveRequest], inputs: list[RunnerInput],
               out: StepLogits) -> bool:
        """Leave the step just run pending, if it is a static decode step of every running row:
        its tokens are picked on the device and copied to the host behind it (`step` applies
        it). False: the engine applies it now."""
        logits, owners, greedy = out
        if not (greedy is not None and len(owners) == len(inputs) and all(c.decode for c in plan.chunks)):
            return False
        try:
            fetch = self._fetch(lives, logits, greedy)
        except Exception:  # sampling failed: the plain path ends those rows with the error
            return False
        positions = [i.chunk.start for i in inputs]
        self._mark(lives, positions)
        self.pending = Pending(lives, positions, logits, fetch, self._fill(lives), time.perf_counter())
        return True

    def _fetch(self, lives: list[LiveRequest], logits: torch.Tensor, greedy: torch.Tensor) -> GreedyFetch:
        """A launched static step's tokens picked on the device (but the grammar rows', picked
        apart at the next launch) and on their way to the host."""
        return self.runner.fetch_picks(logits, greedy, [lv.request.params for lv in lives],
                                       [lv.generator for lv in lives], [lv.logits_state for lv in lives],
                                       skip={lane for lane, lv in enumerate(lives) if lv.grammar is not None})

    def _fill(self, lives: list[LiveRequest]) -> dict[int, Future]:
        """The masks of a step's grammar rows (by lane) for that step's picks, each filling on
        the grammar thread (its previous token is accepted)."""
        return {lane: self.grammars.fill_masks_async([lv.grammar]) for lane, lv in enumerate(lives)
                if lv.grammar is not None and self._is_live(lv)}

    @staticmethod
    def _mark(lives: list[LiveRequest], positions: list[int]) -> None:
        """Each row as fed one token ahead: undone if the row ends before that step is applied."""
        for lane, live in enumerate(lives):
            live.ahead = (lane, positions[lane])

    def _is_live(self, live: LiveRequest) -> bool:
        return self.live.get(live.request_id) is live

    @staticmethod
    def _behind(fetch: GreedyFetch) -> bool:
        """Whether a device runs the step `fetch` follows behind the host (not on the CPU: there
        a grammar row's mask is always waited for)."""
        return fetch.done is not None

    @staticmethod
    def _device_idle(fetch: GreedyFetch) -> bool:
        """Whether the device has finished the step `fetch` follows."""
        return fetch.ready()

    def _continues(self, prev: Pending, hooked: bool) -> bool:
        """Whether the next step can be launched ahead: every running request decodes, in the
        pending step or sitting out."""
        if hooked:
            return False
        running = self.scheduler.decoding()  # None: a request waits, or one prefills
        rows = {lv.request_id for lv in prev.lives if self._is_live(lv)}
        rows |= {late.live.request_id for late in self.late if self._is_live(late.live)}
        return running is not None and set(running) == rows

    def step(self, apply: Apply, finish: Finish, hooked: bool) -> list[RequestOutput]:
        """Launch the next static decode step, if the next step is one, then apply the pending
        one while the device runs it. A sampling row draws its next token right after the launch,
        on the device, so its draws come in the order they would without the overlap; a grammar
        row's pick is queued right before the launch, or later where its mask is late (see the
        module's docstring). `hooked`: the engine calls a logits hook, which needs every step's
        logits on the host (nothing is launched ahead)."""
        prev, self.pending = self.pending, None
        if not self._continues(prev, hooked):
            return self._settle(prev, apply, finish)
        outputs, picked = self._pick_grammar_lanes(prev, finish, wait=False)
        late_out, rejoin = self._advance_late(apply, finish)
        outputs += late_out
        chained = [(lane, lv) for lane, lv in enumerate(prev.lives)  # a grammar row only where picked just now
                   if self._is_live(lv) and (lv.grammar is None or lane in picked)
                   and len(lv.output_ids) + 1 < lv.request.params.max_tokens and prev.positions[lane] + 2 < lv.max_len]
        lives = [lv for _, lv in chained] + rejoin
        if not lives:
            return outputs + self._apply(prev, apply, finish, picked) + self._settle(None, apply, finish)
        inputs = []
        for live in lives:
            start = self.pool.kv_len(live.row)
            inputs.append(RunnerInput(ForwardChunk(live.row, 1, start, start, True), [live.output_ids[-1]], True))
        self.stats["steps"] += 1
        self.stats["decode_tokens"] += len(inputs)
        try:
            launched = time.perf_counter()
            logits, _, greedy = self.runner.run(inputs, [lane for lane, _ in chained] + [-1] * len(rejoin))
        except Exception as exc:  # the forward failed: its rows end once the pending step is applied
            outputs += self._apply(prev, apply, finish, picked)
            outputs += [finish(lv, FinishReason.ERROR, error=f"forward failed: {exc}") for lv in lives if self._is_live(lv)]
            return outputs + self._settle(None, apply, finish)
        positions = [i.chunk.start for i in inputs]
        self._mark(lives, positions)
        masks: dict[int, Future] = {}

        def fill() -> None:  # the pending step's grammar rows are applied: the new step's masks fill
            masks.update(self._fill(lives))
        outputs += self._apply(prev, apply, finish, picked, fill)
        try:
            self.pending = Pending(lives, positions, logits, self._fetch(lives, logits, greedy), masks, launched)
        except Exception as exc:
            outputs += [finish(lv, FinishReason.ERROR, error=f"sampling failed: {exc}") for lv in lives if self._is_live(lv)]
        if self.pending is not None and not any(self._is_live(lv) for lv in self.pending.lives):
            self.pending = None  # every row it fed ended (and was undone): nothing to apply
        if self.pending is None:
            outputs += self._settle(None, apply, finish)
        return outputs

    def _pick_grammar_lanes(self, prev: Pending, finish: Finish,
                            wait: bool) -> tuple[list[RequestOutput], dict[int, tuple[GreedyFetch, int]]]:
        """The pending step's grammar rows picked on the device under their masks, their tokens
        fed to the step launched next: {lane: (fetch, index in it)}. `wait`: for every mask;
        else for each only while the device still runs the pending step's forward, and a row
        whose mask is not ready by then sits out (`self.late`). A row whose grammar failed ends."""
        lanes = [lane for lane in prev.masks if self._is_live(prev.lives[lane])]
        futures = [prev.masks[lane] for lane in lanes]
        if wait or not self._behind(prev.fetch):
            futures_wait(futures)
        else:  # a device runs behind the host: wait while it is busy
            give_up = prev.launched + self.step_s - LAUNCH_MARGIN_S if self.step_s else math.inf
            while not all(f.done() for f in futures) and not self._device_idle(prev.fetch) \
                    and time.perf_counter() < give_up:
                futures_wait(futures, timeout=50e-6)
        outputs, ready, bits = [], [], []
        for lane in lanes:
            live = prev.lives[lane]
            if not prev.masks[lane].done():  # it sits out; the pending step fed it a token applied already
                live.ahead = None
                self.late.append(Late(live, prev.positions[lane], prev.logits[lane : lane + 1].clone(), prev.masks[lane]))
                continue
            mask, failed = prev.masks[lane].result()
            if failed:
                outputs.append(finish(live, FinishReason.ERROR, error=failed[0]))
            else:
                ready.append(lane)
                bits.append(mask.bitmask)
        if not ready:
            return outputs, {}
        lives = [prev.lives[lane] for lane in ready]
        try:
            fetch = self.runner.pick_masked(prev.logits, ready, [lv.request.params for lv in lives],
                                            [lv.generator for lv in lives], [lv.logits_state for lv in lives],
                                            torch.cat(bits), lanes=ready)
        except Exception as exc:
            return outputs + [finish(lv, FinishReason.ERROR, error=f"sampling failed: {exc}") for lv in lives], {}
        return outputs, {lane: (fetch, i) for i, lane in enumerate(ready)}

    def _advance_late(self, apply: Apply, finish: Finish,
                      wait: bool = False) -> tuple[list[RequestOutput], list[LiveRequest]]:
        """Rows sitting out: each whose mask is filled is picked (on its kept logits); each whose
        pick has landed is applied, and if it goes on, fed again (returned). `wait`: for all."""
        outputs, rejoin, still = [], [], []
        for late in self.late:
            live = late.live
            if not self._is_live(live):
                continue
            if late.fetch is None and (wait or late.mask.done()):
                mask, failed = late.mask.result()
                if failed:
                    outputs.append(finish(live, FinishReason.ERROR, error=failed[0]))
                    continue
                try:
                    late.fetch = self.runner.pick_masked(late.logits, [0], [live.request.params], [live.generator],
                                                         [live.logits_state], mask.bitmask)
                except Exception as exc:
                    outputs.append(finish(live, FinishReason.ERROR, error=f"sampling failed: {exc}"))
                    continue
            if late.fetch is not None and (wait or late.fetch.ready()):
                tokens, finite = late.fetch.result()
                outputs.append(apply(live, (tokens[0], finite[0]), late.position + 1, late.fetch.lane_logprobs().get(0)))
                if self._is_live(live):
                    rejoin.append(live)
                continue
            still.append(late)
        self.late = still
        return outputs, rejoin

    def _settle(self, prev: Pending | None, apply: Apply, finish: Finish) -> list[RequestOutput]:
        """The pending step (if any) and every row sitting out applied, waiting for whatever they
        need: nothing is left in flight (the engine's next step is a plain one)."""
        outputs: list[RequestOutput] = []
        if prev is not None:
            outputs, picked = self._pick_grammar_lanes(prev, finish, wait=True)
            outputs += self._apply(prev, apply, finish, picked)
        late_out, _ = self._advance_late(apply, finish, wait=True)
        return outputs + late_out

    def _apply(self, prev: Pending, apply: Apply, finish: Finish, picked: dict[int, tuple[GreedyFetch, int]],
               between: Callable[[], None] | None = None) -> list[RequestOutput]:
        """The pending step's tokens applied to its live rows (a grammar row's from its own pick;
        rows sitting out are not), grammar rows first; then `between()`, then the others."""
        for lane, live in enumerate(prev.lives):
            if live.ahead == (lane, prev.positions[lane]):
                live.ahead = None  # this step is being applied: nothing to undo any more
        lanes = [(lane, lv) for lane, lv in enumerate(prev.lives)
                 if self._is_live(lv) and (lv.grammar is None or lane in picked)]
        try:
            waits = prev.fetch.done is not None and not prev.fetch.ready()
            tokens, finite = prev.fetch.result()
            if waits:  # the tokens landed just now: the step took this long
                took = time.perf_counter() - prev.launched
                self.step_s = took if not self.step_s else 0.9 * self.step_s + 0.1 * took
            logprobs = prev.fetch.lane_logprobs()
            landed = {id(f): (f.result(), f.lane_logprobs()) for f, _ in picked.values()}  # one per pick call
            grammar = {}
            for lane, (fetch, i) in picked.items():
                (t, f), lps = landed[id(fetch)]
                grammar[lane] = ((t[i], f[i]), lps.get(i))
        except Exception as exc:
            outputs = [finish(lv, FinishReason.ERROR, error=f"forward failed: {exc}") for _, lv in lanes]
            if between is not None:
                between()
            return outputs

        def one(lane: int, live: LiveRequest) -> RequestOutput:
            token, lp = grammar[lane] if lane in grammar else ((tokens[lane], finite[lane]), logprobs.get(lane))
            return apply(live, token, prev.positions[lane] + 1, lp)
        outputs = [one(lane, lv) for lane, lv in lanes if lane in grammar]
        if between is not None:
            between()
        return outputs + [one(lane, lv) for lane, lv in lanes if lane not in grammar]
