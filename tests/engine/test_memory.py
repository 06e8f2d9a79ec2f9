"""Resident memory: bounded layers constant in context length; s5 saves the predicted bytes.

The bytes follow the KV geometry alone (layer kinds, KV heads, head size, window), so the model is
a tiny random one with the embedded model's geometry: its own (real) prefills would cost minutes
of a 2-core run and prove nothing more."""

import random

from transformers import AutoConfig

from engine import Engine, EngineConfig, Request
from engine.model.loader import LoadedModel, tiny_random_model
from tests.helpers import greedy, run_all


def test_s5_resident_bytes_at_1k_and_4k(embedded_dir):
    real = AutoConfig.from_pretrained(str(embedded_dir)).get_text_config()
    heads = real.num_key_value_heads
    model = tiny_random_model(0, hidden_size=64, intermediate_size=128, num_hidden_layers=real.num_hidden_layers,
                              layer_types=list(real.layer_types), num_key_value_heads=heads,
                              num_attention_heads=real.num_attention_heads, head_dim=real.head_dim,
                              sliding_window=real.sliding_window, query_pre_attn_scalar=real.query_pre_attn_scalar,
                              max_position_embeddings=8192)
    rng = random.Random(0)
    ids = [rng.randrange(3, 512) for _ in range(4096)]
    per_policy = {}
    for policy in ["s5", "native"]:
        cfg = EngineConfig(model="tiny-random", kv_policy=policy, max_num_batched_tokens=1024, max_rows=2)
        engine = Engine(cfg, LoadedModel(model, None, "tiny"))
        sizes = {}
        for n in (1024, 4096):
            sid = engine.create_session()
            run_all(engine, [Request(f"{policy}{n}", ids[:n], greedy(1), session_id=sid)])
            info = engine.session_info(sid)
            assert info["kv_tokens"] == n
            sizes[n] = info["resident_kv"]
            engine.check_invariants()
            engine.close_session(sid)
        per_policy[policy] = sizes
    s5, native = per_policy["s5"], per_policy["native"]
    # bounded layers hold the same bytes at 1k and 4k; exact layers follow the length
    assert s5[1024]["ring"] == s5[4096]["ring"]
    assert s5[4096]["paged"] > 3 * s5[1024]["paged"]
    assert s5[4096]["staging"] == 0
    geo_sliding = sum(1 for t in real.layer_types if t == "sliding_attention")
    cfg = real
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # K + V, float32
    predicted = geo_sliding * (cfg.sliding_window - (4 + 64)) * per_token
    assert native[4096]["total"] - s5[4096]["total"] == predicted
    print(f"\n4k tokens: native {native[4096]['total']} B, s5 {s5[4096]['total']} B, saved {predicted} B")
