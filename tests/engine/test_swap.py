"""Rows of idle sessions move to host memory when rows run short and come back exactly."""

import random

import pytest

from engine import Engine, EngineConfig, Request
from tests.helpers import greedy, tiny_loaded
from tests.scenarios import converse, owner_of


@pytest.mark.parametrize("policy", ["s5", "native"])
def test_swapped_rows_come_back_exactly(policy):
    rng = random.Random(3)
    turns = [[([rng.randrange(3, 512) for _ in range(rng.randrange(2, 30))], 5) for _ in range(4)] for _ in range(5)]
    base = dict(model="tiny-random", kv_policy=policy, kv_sink=2, kv_window=5, kv_cache_bytes=1 << 22,
                max_num_batched_tokens=32)
    roomy = Engine(EngineConfig(**base, max_rows=8), tiny_loaded(0))
    tight = Engine(EngineConfig(**base, max_rows=2), tiny_loaded(0))
    want, _ = converse(roomy, turns)
    got, sids = converse(tight, turns)
    print(f"\n{policy}: {tight.stats['swaps_out']} rows swapped out, {tight.stats['swaps_in']} back, "
          f"{roomy.stats['swaps_out']} in the roomy engine")
    assert roomy.stats["swaps_out"] == 0 and tight.stats["swaps_out"] >= 10 and tight.stats["swaps_in"] >= 10
    assert got == want
    states = {tight.session_info(s, owner=owner_of(tight, s))["state"] for s in sids}
    assert "swapped" in states and tight.sessions.swapped_bytes == sum(tight.session_info(s, owner=owner_of(tight, s))["host_kv_bytes"] for s in sids)
    for s in sids:
        tight.close_session(s, owner=owner_of(tight, s))
    assert tight.sessions.swapped_bytes == 0
    tight.check_invariants()


def test_without_swap_space_rows_are_given_up_and_rebuilt():
    cfg = EngineConfig(model="tiny-random", max_rows=1, kv_cache_bytes=1 << 22, swap_bytes=0)
    engine = Engine(cfg, tiny_loaded(0))
    a, b = engine.create_session(), engine.create_session()
    for sid in (a, b):
        engine.add_request(Request(f"{sid}-0", [5, 6, 7], greedy(3), session_id=sid))
        while engine.has_work():
            engine.step()
    assert engine.stats["swaps_out"] == 0 and engine.stats["rows_released"] == 1
    assert engine.session_info(a)["state"] == "stored" and engine.session_info(a)["history_tokens"] == 6
    engine.add_request(Request("again", [8], greedy(2), session_id=a))  # the session is still there
    while engine.has_work():
        engine.step()
    assert engine.session_info(a)["last_resume"]["path"] == "rebuild" and engine.stats["rows_released"] == 2
    engine.check_invariants()


def test_idle_rows_make_room_when_kv_blocks_run_short():
    """Rows are plenty but the KV blocks are not: a request that needs the blocks idle sessions
    hold is admitted once their rows move to host memory (it would otherwise wait for ever), and
    those sessions come back exactly."""
    from engine import SamplingParams

    base = dict(model="tiny-random", kv_policy="native", max_rows=4, kv_cache_bytes=1 << 19, max_model_len=4096)
    tight = Engine(EngineConfig(**base), tiny_loaded(0))
    cap = (tight.pool.num_blocks - 1) * tight.pool.block_size
    sids = [tight.create_session() for _ in range(2)]
    for i, sid in enumerate(sids):
        tight.add_request(Request(f"t{i}", list(range(5, 5 + cap // 4)), greedy(4), session_id=sid))
    while tight.has_work():
        tight.step()
    assert tight.pool.num_free_rows >= 1  # a row is free; the blocks are what is short
    big = Request("big", [7] * (cap - 300), SamplingParams(max_tokens=256, max_tokens_fit=True, ignore_eos=True))
    tight.add_request(big)
    steps = 0
    while tight.has_work():
        tight.step()
        steps += 1
        assert steps < 1000, "the request never ran"
    assert tight.stats["swaps_out"] >= 1
    # the sessions resume as in an engine that never swapped them
    roomy = Engine(EngineConfig(**{**base, "kv_cache_bytes": 1 << 22}), tiny_loaded(0))
    twins = [roomy.create_session() for _ in range(2)]
    for i, sid in enumerate(twins):
        roomy.add_request(Request(f"t{i}", list(range(5, 5 + cap // 4)), greedy(4), session_id=sid))
        while roomy.has_work():
            roomy.step()
    for engine, ids in ((tight, sids), (roomy, twins)):
        for i, sid in enumerate(ids):
            engine.add_request(Request(f"u{i}", [9, 10], greedy(4), session_id=sid))
            while engine.has_work():
                engine.step()
    assert [tight.session_tokens(s) for s in sids] == [roomy.session_tokens(s) for s in twins]
    tight.check_invariants()
