"""The same engine on a CUDA device (skipped without one): float32 tiny models must match the
DESIGN mask oracle and HF generate exactly as on the CPU; bfloat16 must agree closely."""

import random

import pytest
import torch

from engine import Engine, EngineConfig, Request
from engine.model_loader import LoadedModel, tiny_random_model
from tests.equivalence.test_s5_oracle import check_against_oracle, run_sessions
from tests.helpers import greedy, hf_greedy, run_all

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("policy", ["s5", "native"])
def test_cuda_oracle_multiturn(policy):
    rng = random.Random(0)
    model = tiny_random_model(0).cuda()
    cfg = EngineConfig(model="tiny-random", device="cuda", kv_policy=policy, kv_sink=2, kv_window=5,
                       max_num_batched_tokens=16, kv_cache_bytes=1 << 22)
    engine = Engine(cfg, LoadedModel(model, None, "tiny"))
    results, rec = run_sessions(engine, [[12, 5, 3], [30, 2, 7], [4, 9, 9]], rng)
    ref = tiny_random_model(0)
    ref.set_attn_implementation("sdpa")
    rec.logits = {k: v.cpu() for k, v in rec.logits.items()}
    check_against_oracle(engine, ref, results, rec, policy, 2, 5, 1e-3)


def test_cuda_native_equals_hf_generate_64_steps():
    model = tiny_random_model(1, num_hidden_layers=6).cuda()
    ref = tiny_random_model(1, num_hidden_layers=6).cuda()
    ref.set_attn_implementation("sdpa")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 40, 130)]
    cfg = EngineConfig(model="tiny-random", device="cuda", kv_policy="native", max_num_batched_tokens=32,
                       kv_cache_bytes=1 << 24)
    engine = Engine(cfg, LoadedModel(model, None, "tiny"))
    out = run_all(engine, [Request(f"r{i}", p, greedy(64)) for i, p in enumerate(prompts)], {"r1": 3, "r2": 9})
    for i, p in enumerate(prompts):
        expected = hf_greedy(ref, p, 64)
        assert out[f"r{i}"] == expected
    engine.check_invariants()
