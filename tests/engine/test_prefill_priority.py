"""A decode stall bound (`max_decode_stall_ms`) changes when rows get their tokens, never which:
a burst of prompts prefills in whole-budget steps while a decoding row pauses, and every row's
tokens equal those of the engine that decodes every step."""

from engine import Engine, EngineConfig, Request
from tests.helpers import greedy, tiny_loaded

BASE = dict(model="tiny", max_rows=8, max_num_batched_tokens=16, kv_window=8, kv_cache_bytes=1 << 22)


def drive(engine: Engine) -> tuple[dict[str, list[int]], list[list[str]]]:
    """One row decoding, then a burst of 4 prompts of 40 tokens; each row's tokens and, per step,
    which rows got a token."""
    out: dict[str, list[int]] = {}
    steps = []
    engine.add_request(Request("live", list(range(3, 13)), greedy(24)))
    for _ in range(3):
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    for i in range(4):
        engine.add_request(Request(f"p{i}", [(7 * i + j) % 500 + 3 for j in range(40)], greedy(6)))
    while engine.has_work():
        got = engine.step()
        steps.append([o.request_id for o in got if o.new_token_ids])
        for o in got:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out, steps


def test_a_burst_prefills_first_and_the_tokens_are_unchanged():
    plain, plain_steps = drive(Engine(EngineConfig(**BASE, max_decode_stall_ms=0), tiny_loaded(0)))
    first, first_steps = drive(Engine(EngineConfig(**BASE, max_decode_stall_ms=60_000), tiny_loaded(0)))
    assert first == plain and len(first["live"]) == 24 and all(len(first[f"p{i}"]) == 6 for i in range(4))
    # the burst is 160 prompt tokens in 16-token steps: 10 steps; decoding every step, the live row
    # takes a token in each, so the prompts need 11 steps; prompts first, it waits through all 10
    burst_plain = next(k for k, s in enumerate(plain_steps) if "p3" in s)
    burst_first = next(k for k, s in enumerate(first_steps) if "p3" in s)
    assert burst_first == 9 < burst_plain
    assert not any("live" in s for s in first_steps[:burst_first + 1])
    assert sum("live" in s for s in plain_steps[:burst_plain + 1]) == burst_plain + 1


def test_the_stall_bound_and_the_step_budget_are_resolved_per_device():
    cpu, cuda = EngineConfig(model="tiny"), EngineConfig(model="tiny", device="cuda")
    assert (cpu.decode_stall_s, cpu.token_budget) == (0.0, 512)
    assert (cuda.decode_stall_s, cuda.token_budget) == (1.0, 8192)
    given = EngineConfig(model="tiny", device="cuda", max_decode_stall_ms=250, max_num_batched_tokens=2048)
    assert (given.decode_stall_s, given.token_budget) == (0.25, 2048)
