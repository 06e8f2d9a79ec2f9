"""Every step's logits under every policy match a full recompute with the DESIGN.md mask."""

import random

import pytest

from engine import Engine, EngineConfig
from engine.kv.policy import bounded_layers
from engine.model.loader import LoadedModel
from tests.helpers import tiny_loaded, tiny_reference
from tests.scenarios import check_against_oracle, run_sessions


@pytest.mark.parametrize("policy", ["s5", "sink-window", "native", "full"])
@pytest.mark.parametrize(("seed", "static"), [(0, False), (1, False), (0, True)], ids=["eager-0", "eager-1", "static-0"])
def test_tiny_multiturn_mixed_batches_match_oracle(policy, seed, static):
    """`static`: decode-only steps take the fixed-size decode path (decode_graph.py, uncaptured on
    the CPU, with the reference decode attention), padded to buckets, at most 3 rows a batch."""
    sink, window = 2, 5
    rng = random.Random(seed)
    engine = Engine(
        EngineConfig(model="tiny-random", kv_policy=policy, kv_sink=sink, kv_window=window,
                     max_num_batched_tokens=rng.choice([7, 16, 64]), kv_cache_bytes=1 << 22, max_rows=8,
                     decode_graphs=static, max_graph_batch=3),
        tiny_loaded(seed),
    )
    turns = [[rng.randrange(1, 40) for _ in range(3 + rng.randrange(2))] for _ in range(5)]
    results, rec = run_sessions(engine, turns, rng, max_tokens=14 if static else 6)
    worst, n = check_against_oracle(engine, tiny_reference(seed), results, rec, policy, sink, window, 2e-4)
    decoder = engine.runner.decoder
    assert (decoder is not None and decoder.steps >= 10) == static
    print(f"\n{policy} seed={seed} {'static' if static else 'eager'}: {n} steps"
          f"{f' ({decoder.steps} static)' if static else ''}, max |diff| {worst:.2e}")


@pytest.mark.parametrize("policy", ["s5", "native", "full"])
@pytest.mark.parametrize("budget", [7, 40])
def test_query_blocks_of_long_chunks_match_oracle(policy, budget, monkeypatch):
    """Long prefill chunks attend in query blocks (each against only the keys it can see); with
    4-token blocks every chunk here is split, across staging, windows and later turns."""
    from engine.runner import attention

    monkeypatch.setattr(attention, "QUERY_BLOCK", 4)
    sink, window = 2, 5
    rng = random.Random(budget)
    engine = Engine(
        EngineConfig(model="tiny-random", kv_policy=policy, kv_sink=sink, kv_window=window,
                     max_num_batched_tokens=budget, kv_cache_bytes=1 << 22, max_rows=8),
        tiny_loaded(2),
    )
    turns = [[rng.randrange(5, 45) for _ in range(3)] for _ in range(4)]
    results, rec = run_sessions(engine, turns, rng)
    worst, n = check_against_oracle(engine, tiny_reference(2), results, rec, policy, sink, window, 2e-4)
    print(f"\n{policy} budget={budget} (query blocks of 4): {n} steps, max |diff| {worst:.2e}")


def test_tiny_without_sliding_layers_is_exact_under_every_policy():
    overrides = dict(num_hidden_layers=3, layer_types=["full_attention"] * 3)
    tokens = {}
    for policy in ["s5", "native", "full", "sink-window"]:
        if policy == "sink-window":
            continue  # the control bounds full layers too, by definition
        engine = Engine(EngineConfig(model="tiny-random", kv_policy=policy, kv_sink=1, kv_window=3,
                                     kv_cache_bytes=1 << 22), tiny_loaded(0, **overrides))
        assert all(lay.paged for lay in engine.layouts)
        rng = random.Random(5)
        results, rec = run_sessions(engine, [[20, 9, 4]], rng, max_tokens=8, stagger=False)
        check_against_oracle(engine, tiny_reference(0, **overrides), results, rec, "full", 0, 0, 2e-4)
        tokens[policy] = [v[0] for v in results.values()]
    assert tokens["s5"] == tokens["native"] == tokens["full"]


@pytest.mark.slow
def test_embedded_s5_multiturn_matches_oracle(embedded, embedded_reference):
    rng = random.Random(3)
    engine = Engine(EngineConfig(model="embedded", kv_policy="s5", max_num_batched_tokens=96, max_rows=4),
                    LoadedModel(embedded.model, embedded.tokenizer, "embedded"))
    turns = [[150, 40, 30], [90, 60, 20]]
    results, rec = run_sessions(engine, turns, rng, max_tokens=5)
    worst, n = check_against_oracle(engine, embedded_reference, results, rec, "s5", 4, 64, 5e-3)
    print(f"\nembedded s5: {n} steps, max |diff| {worst:.2e}")


@pytest.mark.parametrize(("policy", "static"), [("s5", True), ("sink-window", False)])
def test_gemma4_moe_with_per_layer_kv_shapes_matches_oracle(policy, static):
    """Gemma 4 (mixture of experts; full-attention layers with their own K/V heads and head size,
    values equal to keys): every step's logits match the DESIGN-mask oracle, as Gemma 3's do.
    s5 mixes paged and ring layers of different shapes (prefill eager, decode on the static step);
    the control makes every layer a ring, of two shapes."""
    pytest.importorskip("transformers.models.gemma4")
    from tests.helpers import tiny_gemma4

    sink, window = 2, 5
    rng = random.Random(4)
    engine = Engine(EngineConfig(model="tiny-gemma4", kv_policy=policy, kv_sink=sink, kv_window=window,
                                 max_num_batched_tokens=16, kv_cache_bytes=1 << 22, max_rows=8,
                                 decode_graphs=static, max_graph_batch=3),
                    LoadedModel(tiny_gemma4(0), None, "tiny-gemma4"))
    shapes = {tuple(engine.pool.store(i)[0].shape[1:]) for i in range(len(engine.layouts))}
    assert shapes == {(2, 16), (1, 32)}
    turns = [[rng.randrange(5, 30) for _ in range(2)] for _ in range(3)]
    results, rec = run_sessions(engine, turns, rng, max_tokens=8)
    assert (engine.runner.decoder is not None and engine.runner.decoder.steps >= 5) == static
    reference = tiny_gemma4(0)
    reference.set_attn_implementation("sdpa")
    worst, n = check_against_oracle(engine, reference, results, rec, policy, sink, window, 2e-4)
    engine.check_invariants()
    print(f"\ngemma4 moe {policy}{' static' if static else ''}: {n} steps, max |diff| {worst:.2e}")


@pytest.mark.parametrize(("policy", "windows", "static"), [
    ("s5", (3, 7, 1, 5), False), ("s5", (3, 7, 1, 5), True), ("s5", (2, 6, 6, 2), False),
    ("sink-window", (4, 2, 6, 3, 5, 2), False)])
def test_per_layer_windows_match_oracle(policy, windows, static):
    """Each bounded layer keeps its own window (kv_windows): its ring has sink + window slots, and
    every step's logits match the DESIGN-mask oracle with each layer's own window, over multi-turn
    sessions with chunked prefills, staging, decodes (eager, or the static decode step) and rows of
    several rings in one batch."""
    sink = 2
    rng = random.Random(len(windows) + windows[0])
    engine = Engine(EngineConfig(model="tiny-random", kv_policy=policy, kv_sink=sink, kv_windows=windows,
                                 max_num_batched_tokens=rng.choice([7, 16]), kv_cache_bytes=1 << 22, max_rows=8,
                                 decode_graphs=static, max_graph_batch=3), tiny_loaded(0))
    bounded = bounded_layers(policy, engine.geometry.layer_types)
    per_layer = [None] * len(engine.layouts)
    for i, w in zip(bounded, windows):
        per_layer[i] = w
    # storage and accounting follow each layer's window
    pool = engine.pool
    assert {r.window for r in pool.rings} == set(windows)
    for i in bounded:
        assert pool.store(i)[0].shape[0] == (pool.num_rows + 1) * (sink + per_layer[i])
    h, d = engine.geometry.kv_shapes[0]
    assert pool.ring_row_bytes == sum((sink + w) * 2 * h * d * 4 for w in windows)
    turns = [[rng.randrange(1, 40) for _ in range(3)] for _ in range(4)]
    results, rec = run_sessions(engine, turns, rng, max_tokens=12 if static else 6)
    assert (engine.runner.decoder is not None and engine.runner.decoder.steps >= 5) == static
    worst, n = check_against_oracle(engine, tiny_reference(0), results, rec, policy, sink, 0, 2e-4, per_layer)
    for sid in results:
        info = engine.session_info(sid)
        assert info["resident_kv"]["ring"] == pool.ring_row_bytes
    print(f"\n{policy} windows {windows}{' static' if static else ''}: {n} steps, max |diff| {worst:.2e}")


def test_per_layer_oracle_is_the_uniform_oracle_when_windows_agree():
    """The per-layer oracle (layers run one by one) gives the policy oracle's logits when every
    bounded layer has the same window: the two ways of computing the mask agree."""
    from tests.helpers import oracle_logits

    model = tiny_reference(1)
    rng = random.Random(0)
    tokens = [rng.randrange(3, 500) for _ in range(30)]
    fs = [0] * 12 + [12] * 6 + list(range(18, 30))
    per_layer = [5 if kind == "sliding_attention" else None for kind in model.config.layer_types]
    a = oracle_logits(model, tokens, fs, "s5", 2, 5)
    b = oracle_logits(model, tokens, fs, "s5", 2, 5, per_layer)
    assert (a - b).abs().max().item() < 1e-5
