"""Row pool: books balance after 1,000 mixed cycles; a reused row behaves like a fresh one."""

import random

import torch

from engine import Engine, EngineConfig, Request
from engine.kv.policy import LayerLayout, layer_layouts
from engine.kv.rows import RowPool
from tests.helpers import greedy, run_all, tiny_loaded


def test_layouts_per_policy():
    types = ["sliding_attention", "full_attention"]
    s5 = layer_layouts("s5", types, 512, 4, 64)
    assert s5 == [LayerLayout(False, 4, 64, True, 512), LayerLayout(True, attn_window=None)]
    assert layer_layouts("native", types, 512, 4, 64)[0] == LayerLayout(False, 0, 512, False, 512)
    assert all(lay.paged for lay in layer_layouts("full", types, 512, 4, 64))
    assert not any(lay.paged for lay in layer_layouts("sink-window", types, 512, 4, 64))


def test_thousand_alloc_free_cycles_keep_invariants():
    rng = random.Random(0)
    layouts = layer_layouts("s5", ["sliding_attention", "full_attention"], 32, 2, 6)
    pool = RowPool(layouts, [(2, 8)] * len(layouts), torch.float32, "cpu", num_rows=6, block_size=4, num_blocks=80)
    live = {}
    for cycle in range(1000):
        if live and (rng.random() < 0.5 or not pool.can_allocate_row()):
            row = rng.choice(list(live))
            pool.free_row(row)
            del live[row]
        else:
            length = rng.choice([rng.randrange(1, 8), rng.randrange(40, 120)])
            if pool.can_allocate_row() and pool.can_reserve(None, length):
                row = pool.allocate_row()
                pool.reserve(row, length)
                pool.commit(row, length, 0, True)
                live[row] = length
            else:
                assert not pool.can_reserve(None, length) or not pool.can_allocate_row()
        pool.check_invariants()
    for row in list(live):
        pool.free_row(row)
    pool.check_invariants()
    assert pool.num_free_rows == 6 and pool.num_free_blocks == 79


def test_reused_rows_give_the_same_tokens_as_fresh_ones():
    """1,000 request lifetimes through 4 rows; each request's tokens match a fresh engine's."""
    rng = random.Random(1)
    cfg = EngineConfig(model="tiny-random", kv_policy="s5", kv_sink=2, kv_window=4, max_rows=4,
                       max_num_batched_tokens=64, kv_cache_bytes=1 << 20, kv_block_size=8)
    model = tiny_loaded(0, num_hidden_layers=3)
    engine = Engine(cfg, model)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.choice([2, 5, 30, 70]))] for _ in range(12)]
    expected = {}
    for i, p in enumerate(prompts):
        fresh = Engine(cfg, model)
        expected[i] = run_all(fresh, [Request("x", p, greedy(3))])["x"]
    served = 0
    while served < 1000:
        batch = [(served + j, rng.randrange(len(prompts))) for j in range(rng.randrange(1, 9))]
        reqs = [Request(f"r{n}", prompts[k], greedy(3)) for n, k in batch]
        aborts = {f"r{n}": rng.randrange(0, 4) for n, _ in batch if rng.random() < 0.2}
        out = run_all(engine, reqs, aborts=aborts)
        for n, k in batch:
            if f"r{n}" not in aborts:
                assert out[f"r{n}"] == expected[k], f"request {n} saw stale K/V"
        served += len(batch)
        engine.check_invariants()
    assert engine.pool.num_free_rows == 4
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - 1
