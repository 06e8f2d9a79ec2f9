"""n > 1: the prompt is prefilled once and its row forked. Each completion equals what a single
request with its seed gives; rows come back however the request ends; `RowPool.fork` copies a
row exactly and refuses (changing nothing) what it cannot do."""

from dataclasses import replace

import pytest
import torch

from engine import Engine, EngineConfig, Request, SamplingParams
from engine.core.types import FinishReason, fork_id
from engine.kv.policy import layer_layouts
from engine.kv.rows import RowPool
from tests.scenarios import OVERLAP_BASE
from tests.helpers import tiny_loaded

PROMPT = [5 + i % 400 for i in range(90)]  # longer than a step's 64-token budget: two prefill steps


def fresh(overlap: bool = False, policy: str = "s5") -> Engine:
    return Engine(EngineConfig(**OVERLAP_BASE, kv_policy=policy, overlap_steps=overlap), tiny_loaded(0))


def run(engine, requests, abort_after: dict[str, int] | None = None):
    for r in requests:
        engine.add_request(r)
    toks, reasons, lps = {}, {}, {}
    while engine.has_work():
        for o in engine.step():
            assert o.error is None, o.error
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            lps.setdefault(o.request_id, []).extend(o.logprobs or [])
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        for rid, n in (abort_after or {}).items():
            if rid not in reasons and len(toks.get(rid, [])) >= n:
                reasons[rid] = engine.abort(rid).finish_reason
        engine.check_invariants()
    return toks, reasons, lps


@pytest.mark.parametrize("overlap,policy", [(False, "s5"), (True, "s5"), (True, "native")])
def test_each_completion_equals_a_single_request_with_its_seed(overlap, policy):
    """Seeded sampling: completion i equals a request alone with seed + i (penalties and
    logprobs included); greedy: every completion equals the single greedy reply. The prompt is
    prefilled once; every row comes back."""
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=40, logprobs=2,
                            frequency_penalty=0.5)
    engine = fresh(overlap, policy)
    other = Request("other", [7, 8, 9], SamplingParams(max_tokens=6, ignore_eos=True))
    toks, _, lps = run(engine, [Request("p", PROMPT, replace(params, n=3)), other])
    assert engine.stats["prefill_tokens"] == len(PROMPT) + 3
    singles = fresh(overlap, policy)
    want, _, want_lps = run(singles, [Request(f"s{i}", PROMPT, replace(params, seed=40 + i))
                                      for i in range(3)])
    for i in range(3):
        assert toks[fork_id("p", i)] == want[f"s{i}"], i
        assert [x[1] for x in lps[fork_id("p", i)]] == [x[1] for x in want_lps[f"s{i}"]]
        assert max(abs(a[0] - b[0]) for a, b in zip(lps[fork_id("p", i)], want_lps[f"s{i}"])) < 1e-4
    assert len({tuple(toks[fork_id("p", i)]) for i in range(3)}) == 3  # the seeds differ
    assert engine.pool.used_rows() == []

    engine = fresh(overlap, policy)
    toks, _, _ = run(engine, [Request("g", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, n=4))])
    alone, _, _ = run(fresh(overlap, policy), [Request("a", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))])
    assert [toks[fork_id("g", i)] for i in range(4)] == [alone["a"]] * 4
    assert engine.stats["prefill_tokens"] == len(PROMPT)
    assert engine.pool.used_rows() == []


def test_rows_come_back_however_the_request_ends():
    engine = fresh()
    # aborted while its prompt is prefilled (before the fork): the rows held for the forks too
    engine.add_request(Request("early", PROMPT, SamplingParams(max_tokens=8, n=3)))
    engine.step()
    assert len(engine.pool.used_rows()) == 3
    engine.check_invariants()
    assert engine.abort("early").finish_reason == FinishReason.ABORT
    assert engine.pool.used_rows() == [] and not engine.has_work()
    # one completion aborted after the fork: the others run on
    toks, reasons, _ = run(engine, [Request("late", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, n=3))],
                           abort_after={fork_id("late", 1): 2})
    assert reasons == {"late": FinishReason.LENGTH, "late/1": FinishReason.ABORT, "late/2": FinishReason.LENGTH}
    assert len(toks["late"]) == len(toks["late/2"]) == 8 and len(toks["late/1"]) == 2
    assert engine.pool.used_rows() == []
    # n rows are not there: it waits until they are, and takes them all at once
    hold = [Request(f"h{i}", [3, 4], SamplingParams(max_tokens=20, ignore_eos=True)) for i in range(7)]
    toks, reasons, _ = run(engine, hold + [Request("wide", [3, 4], SamplingParams(max_tokens=3, ignore_eos=True, n=4))])
    assert all(len(toks[fork_id("wide", i)]) == 3 for i in range(4))
    assert engine.pool.used_rows() == []


@pytest.mark.parametrize("windows", [None, (3, 6)])
def test_fork_copies_a_row_exactly_and_refuses_what_it_cannot_do(windows):
    # windows: per-layer windows, one ring per window size (each ring's slots and positions copied)
    layouts = layer_layouts("s5", ["sliding_attention", "full_attention", "sliding_attention"], 32, 2, 6, windows)
    pool = RowPool(layouts, [(2, 8)] * len(layouts), torch.float32, "cpu", num_rows=4, block_size=4, num_blocks=20)
    src = pool.allocate_row()
    pool.reserve(src, 30)
    for layer in range(len(layouts)):  # random K/V where the row keeps positions 0..22
        k, v = pool.store(layer)
        k.normal_()
        v.normal_()
    pool.commit(src, 23, 0, True)
    dst = pool.allocate_row()
    assert not pool.can_fork(src, dst)  # no blocks for 23 positions yet
    with pytest.raises(RuntimeError):
        pool.fork(src, dst)
    assert pool.kv_len(dst) == 0
    pool.reserve(dst, 30)
    assert pool.can_fork(src, dst) and not pool.can_fork(src, src) and not pool.can_fork(dst, src)
    free = pool.num_free_blocks
    pool.fork(src, dst)
    a, b = pool.contents(src), pool.contents(dst)
    assert a[:2] == b[:2] and all(torch.equal(x, y) for x, y in zip(a[2] + a[3], b[2] + b[3]))
    # the 5 full blocks of positions 0..19 are shared (dst gave back the 5 it had reserved); the
    # partial block of 20..22 and the blocks after it are each row's own
    assert pool.row(src).blocks[:5] == pool.row(dst).blocks[:5] and pool.num_free_blocks == free + 5
    assert not set(pool.row(src).blocks[5:]) & set(pool.row(dst).blocks[5:])
    pool.check_invariants()
    assert not pool.can_fork(src, dst)  # no longer empty
    slot = torch.from_numpy(pool.paged_slots(dst, 23, 24))  # dst writes its next position: src unchanged
    for layer in pool.paged_layers:
        pool.write(layer, slot, torch.ones(1, 2, 8), torch.ones(1, 2, 8))
    pool.commit(dst, 24, 23, True)
    assert all(torch.equal(x, y) for x, y in zip(a[2] + a[3], pool.contents(src)[2] + pool.contents(src)[3]))
    pool.free_row(src)
    pool.check_invariants()
    assert pool.contents(dst)[0] == 24 and all(torch.equal(x[:23], y) for x, y in zip(pool.contents(dst)[2], b[2]))
    pool.free_row(dst)
    pool.check_invariants()
    assert pool.num_free_blocks == 19
