"""Resident memory: bounded layers constant in context length; s5 saves the predicted bytes."""

import pytest

from engine import Engine, EngineConfig, Request
from engine.model.loader import LoadedModel
from tests.helpers import greedy, run_all


@pytest.mark.slow
def test_s5_resident_bytes_at_1k_and_4k(embedded):
    tok = embedded.tokenizer
    text = "Once upon a time in a quiet valley there was a little mill by the river. " * 400
    ids = tok(text)["input_ids"]
    per_policy = {}
    for policy in ["s5", "native"]:
        cfg = EngineConfig(model="embedded", kv_policy=policy, max_num_batched_tokens=1024, max_rows=2)
        engine = Engine(cfg, LoadedModel(embedded.model, tok, "embedded"))
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
    geo_sliding = sum(1 for t in embedded.model.config.layer_types if t == "sliding_attention")
    cfg = embedded.model.config
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # K + V, float32
    predicted = geo_sliding * (cfg.sliding_window - (4 + 64)) * per_token
    assert native[4096]["total"] - s5[4096]["total"] == predicted
    print(f"\n4k tokens: native {native[4096]['total']} B, s5 {s5[4096]['total']} B, saved {predicted} B")
