"""A session's greedy tokens are identical alone or among 7 others joining and leaving."""

import random

import pytest

from engine import Engine, EngineConfig, Request
from engine.model.loader import LoadedModel
from tests.helpers import greedy, run_all, tiny_loaded


def _check(engine_factory, vocab, n_tokens, prompt_len, seed):
    rng = random.Random(seed)
    target = Request("target", [rng.randrange(3, vocab) for _ in range(prompt_len)], greedy(n_tokens))
    alone = run_all(engine_factory(), [target])["target"]
    others = [
        Request(f"o{i}", [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 2 * prompt_len))],
                greedy(rng.randrange(2, n_tokens)))
        for i in range(7)
    ]
    arrivals = {f"o{i}": rng.randrange(0, n_tokens) for i in range(7)}
    arrivals["target"] = rng.randrange(0, 4)
    engine = engine_factory()
    crowd = run_all(engine, [target, *others], arrivals)["target"]
    engine.check_invariants()
    assert crowd == alone


@pytest.mark.parametrize("policy", ["s5", "native"])
@pytest.mark.parametrize("seed", range(3))
def test_tiny_batch_invariance(policy, seed):
    def factory():
        cfg = EngineConfig(model="tiny-random", kv_policy=policy, kv_sink=2, kv_window=6,
                           max_num_batched_tokens=24, kv_cache_bytes=1 << 22, max_rows=8)
        return Engine(cfg, tiny_loaded(seed))
    _check(factory, 512, 24, 40, seed)


@pytest.mark.slow
def test_embedded_batch_invariance(embedded):
    def factory():
        cfg = EngineConfig(model="embedded", kv_policy="s5", max_num_batched_tokens=128, max_rows=8)
        return Engine(cfg, LoadedModel(embedded.model, embedded.tokenizer, "embedded"))
    _check(factory, 20000, 16, 150, 7)
