"""ModelRunner: one batched forward per step over ragged rows; decode-only steps may take the
static (CUDA graph) path of decode_graph.py."""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import NamedTuple

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.model.prepare import prepare
from engine.runner.attention import ForwardChunk, StepAttention
from engine.runner.decode_graph import GraphDecoder, GreedyFetch
from engine.runner.sampler import asking_picks
from engine.kernels import launch
from engine.kv.rows import RowPool
from engine.core.structured import TokenMasks
from engine.core.types import SamplingParams, StepLogits
from engine.runner.token_mask import fast_greedy, masked_greedy
from engine.runner.transfer import to_device

log = logging.getLogger(__name__)


# SDPA backends for the eager (prefill and mixed) steps. Not cuDNN: its attention builds an
# execution plan per new shape, and a step's query blocks and key ranges change shape all the
# time; on an H200 that planning took 2 s of host time per 2,048-token prefill step of Gemma-3 4B
# (measured with `bench.profile_decode --prefill`), 20x the step's device time.
EAGER_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class RunnerInput(NamedTuple):
    chunk: ForwardChunk
    token_ids: list[int]  # the chunk's new tokens
    wants_logits: bool  # sample a token after the chunk's last position


class ModelRunner:
    def __init__(self, model, pool: RowPool, static_decode: int = 0, max_model_len: int = 0,
                 capture: bool = False, fused: bool = True, undoable: bool = False, pdl: bool = True,
                 nf4: bool = False, paged_decode=None, cpu_ops=None) -> None:
        """`static_decode` > 0: decode-only steps of up to that many rows run the fixed-size decode
        of decode_graph.py, captured as CUDA graphs when `capture`; `undoable`: their stores can
        be undone (steps launched ahead of the host). `fused`: the engine's own layer forward
        (fused_forward.py) where the model allows it, else the stock one. `pdl`: the engine's
        Triton kernels are launched with PDL where the device supports it (kernels/launch.py). `nf4`:
        bitsandbytes 4-bit linears run on the engine's NF4 kernels (EngineConfig.nf4_kernels).
        `paged_decode`: the CPU's paged decode attention kernel (kernels/cpu_attention.py), or None;
        `cpu_ops`: the CPU's kernels for the fused forward's elementwise steps (kernels/cpu_ops.py),
        or None."""
        self.model = model
        self.pool = pool
        self.paged_decode = paged_decode
        self.device = pool.device
        self.pdl = pdl and launch.supported(self.device)
        prepared = prepare(model, self.device, fused, self.pdl, nf4, cpu_ops)
        self.forward, self.fused = prepared.forward, prepared.fused
        capture = capture and prepared.capturable
        self.decoder = None
        if static_decode:  # the decoder gets what it calls, never the runner: no reference cycle
            hidden = model.get_input_embeddings().weight.shape[1]
            pdl = self.pdl
            self.decoder = GraphDecoder(self.forward, pool, static_decode, max_model_len, capture, undoable,
                                        lambda size: pdl and launch.worthwhile(size, hidden))

    def run(self, inputs: list[RunnerInput], sources: list[int] | None = None) -> StepLogits:
        """Runs the step: the logits of the rows that want them, whose inputs they belong to, and
        (static decode steps) their greedy tokens, computed inside the step's graph. `sources`
        (a static decode step only): per input, the lane of the previous static step whose
        greedy token it feeds, read on the device, or -1 (see `GraphDecoder.run`)."""
        if self.decoder is not None and self.decoder.accepts(inputs):
            return self.decoder.run(inputs, sources)
        assert sources is None, "tokens read on the device need the static decode step"
        step = StepAttention(self.pool, [i.chunk for i in inputs], self.paged_decode)
        by_chunk = {id(i.chunk): (n, i) for n, i in enumerate(inputs)}
        ids: list[int] = []
        logits_index, owners = [], []
        for chunk in step.order:
            n, inp = by_chunk[id(chunk)]
            ids.extend(inp.token_ids)
            if inp.wants_logits:
                logits_index.append(len(ids) - 1)
                owners.append(n)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [T_total]
        positions = step.positions.to(self.device)  # [T_total]
        index = torch.tensor(logits_index, dtype=torch.long, device=self.device)  # [n]
        with sdpa_kernel(EAGER_SDPA):
            logits = self.forward(input_ids, positions, step, index)  # [n, V]
        step.commit()
        return StepLogits(logits, owners, None)

    def fetch_picks(self, logits: torch.Tensor, greedy: torch.Tensor, params: list[SamplingParams],
                    generators: list[torch.Generator], states: list | None = None,
                    skip: Collection[int] = ()) -> GreedyFetch:
        """A static step's tokens on their way to the host, and left on the device for the step
        launched next: its greedy tokens [2, n] (token, finite), with the pick of each row that
        asks for more (sampling with its own generator, penalties, logprobs: `asking_picks`) in
        its lane, and those rows' logprobs. Lanes in `skip` (grammar rows, `pick_masked`) keep
        their greedy tokens here and are picked apart."""
        asking = [j for j, p in enumerate(params) if not p.plain and j not in skip]
        picks, logprobs = greedy, None
        if asking:
            states = states or [None] * len(params)
            idx = to_device(asking, torch.long, logits.device)
            got = asking_picks(logits.index_select(0, idx), [params[j] for j in asking],
                               [generators[j] for j in asking], [states[j] for j in asking])
            picks = greedy.clone()
            picks[:, idx] = got.tokens
            self.decoder.feed_next(picks[0])
            if got.logprobs is not None:
                logprobs = (got.logprobs, [asking[i] for i in got.logprob_rows], got.logprob_ks)
        return self.decoder.fetch(picks, logprobs)

    def pick_masked(self, logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                    generators: list[torch.Generator], states: list, bitmask: torch.Tensor,
                    lanes: list[int] | None = None) -> GreedyFetch:
        """Rows `rows` of `logits` picked under their grammars' masks (`bitmask[i]` for row
        `rows[i]`, sampled with `params[i]`, `generators[i]`, `states[i]`), on their way to the
        host as [2, r] (with their logprobs, lane i meaning `rows[i]`). `lanes`: the static step's
        lanes the picks go to on the device, for the step launched next. Greedy rows with nothing
        else asked (JSON mode) take one kernel (`masked_greedy`)."""
        dev = logits.device
        logprobs = None
        if fast_greedy(dev) and logits.stride(1) == 1 and all(
                p.greedy and p.logprobs is None and not p.processed for p in params):
            picks = masked_greedy(logits, rows, bitmask)
        else:
            got = asking_picks(logits.index_select(0, to_device(rows, torch.long, dev)), params, generators, states,
                               TokenMasks(list(range(len(rows))), bitmask))
            picks = got.tokens
            if got.logprobs is not None:
                logprobs = (got.logprobs, got.logprob_rows, got.logprob_ks)
        if lanes is not None:
            self.decoder.feed(lanes, picks[0])
        return self.decoder.fetch_apart(picks, logprobs)
