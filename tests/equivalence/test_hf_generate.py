"""Under native and full, the embedded model's greedy tokens equal HF generate, token for token:
alone, batched with staggered arrival and ragged lengths, and with chunked prefill."""

import random

import pytest

from engine import Engine, EngineConfig, Request
from engine.model.loader import LoadedModel
from tests.helpers import greedy, hf_greedy, run_all

pytestmark = pytest.mark.slow
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def prompts(tokenizer):
    rng = random.Random(0)
    words = "river stone lantern quiet market seven orange violin harbor meadow copper silent".split()
    out = []
    for n_words in [3, 9, 25, 60, 110, 170, 260, 420]:  # 8 prompts, ~5 to ~600 tokens
        text = " ".join(rng.choice(words) for _ in range(n_words))
        out.append(tokenizer(f"Story: {text}. Then")["input_ids"])
    return out


@pytest.fixture(scope="module")
def reference(embedded_reference, prompts):
    return [hf_greedy(embedded_reference, p, NEW_TOKENS) for p in prompts]


def make_engine(embedded, policy, budget):
    cfg = EngineConfig(model="embedded", kv_policy=policy, max_num_batched_tokens=budget, max_rows=8)
    return Engine(cfg, LoadedModel(embedded.model, embedded.tokenizer, "embedded"))


@pytest.mark.parametrize("policy", ["native", "full"])
def test_alone(embedded, prompts, reference, policy):
    engine = make_engine(embedded, policy, 2048)
    for i, p in enumerate(prompts):
        out = run_all(engine, [Request(f"r{i}", p, greedy(NEW_TOKENS))])
        assert out[f"r{i}"] == reference[i], f"prompt {i} ({len(p)} tokens)"
    engine.check_invariants()


@pytest.mark.parametrize("policy", ["native", "full"])
def test_batched_staggered_chunked(embedded, prompts, reference, policy):
    # budget 64: every prompt over 64 tokens is prefilled in chunks, mixed with other rows' decodes
    engine = make_engine(embedded, policy, 64)
    reqs = [Request(f"r{i}", p, greedy(NEW_TOKENS)) for i, p in enumerate(prompts)]
    arrivals = {f"r{i}": s for i, s in enumerate([0, 0, 1, 3, 4, 7, 9, 12])}
    out = run_all(engine, reqs, arrivals)
    for i in range(len(prompts)):
        assert out[f"r{i}"] == reference[i], f"prompt {i} ({len(prompts[i])} tokens)"
    engine.check_invariants()
    assert engine.pool.num_free_rows == engine.pool.num_rows
