"""Per-layer windows: the allocation solver against brute force, windows solved from a profile
within a byte budget, the config's checks, the pool's storage and books with rings of several
sizes (snapshots and swaps included), and the policy the engine reports."""

import itertools
import json
import math
import random

import pytest

from engine import Engine, EngineConfig
from engine.kv.policy import bounded_layers, layer_layouts
from engine.kv.windows import PROFILE_NAME, WindowProfile, solve_windows
from tests.helpers import tiny_loaded
from tests.scenarios import run_sessions

TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2  # the tiny model's layers


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("centered", [False, True])
def test_solver_is_exact(seed, centered):
    """Costs from the exact model (>= 0, the native window free), or around a base window (the
    base 0, smaller windows mostly dearer, larger ones and the native window cheaper)."""
    rng = random.Random(seed)
    layers = [0, 1, 3, 4]
    windows = [2, 4, 8]
    cost = {i: {w: rng.random() / w for w in windows} for i in layers}
    if centered:
        cost = {i: {2: rng.random(), 4: 0.0, 8: -rng.random() / 2, 16: -rng.random()} for i in layers}
    pbytes = {i: rng.choice([64, 128]) for i in layers}
    sink, native = 1, 16
    for budget in [0, 200, 1200, 2500, 5000, 100_000]:
        best = None
        for combo in itertools.product([*windows, native], repeat=len(layers)):
            used = sum((sink + w) * pbytes[i] for i, w in zip(layers, combo))
            c = sum(cost[i].get(w, 0.0) for i, w in zip(layers, combo))
            if used <= budget and (best is None or c < best[0] - 1e-12):
                best = (c, combo)
        got = solve_windows(cost, pbytes, sink, native, budget)
        if best is None:
            assert got is None
            continue
        got_cost = sum(cost[i].get(got[i], 0.0) for i in layers)
        assert sum((sink + got[i]) * pbytes[i] for i in layers) <= budget
        assert got_cost == pytest.approx(best[0])


def test_a_profile_around_a_base_window_costs_what_it_measured():
    p = WindowProfile(model="tiny", weights="float32", sink=2, native_window=16, native_ppl=10.0,
                      layer_ppl={0: {2: 12.0, 16: 10.5}, 3: {2: 11.5, 16: 10.9}}, uniform_ppl={4: 11.0},
                      scored_tokens=10, base_window=4, base_ppl=11.0)
    cost = p.cost()
    assert cost[0][4] == cost[3][4] == 0.0
    assert cost[0][2] == pytest.approx(math.log(12 / 11)) and cost[0][16] == pytest.approx(math.log(10.5 / 11))
    # room for one layer at the native window: the one it helps most
    assert solve_windows(cost, {0: 1, 3: 1}, 2, 16, (2 + 16) + (2 + 4)) == {0: 16, 3: 4}


def _profile(tmp_path) -> WindowProfile:
    """A made-up profile of the tiny model: layer 0 suffers most from small windows, 4 least."""
    layer_ppl = {0: {4: 30.0}, 1: {4: 14.0}, 3: {4: 12.0}, 4: {4: 10.5}}
    p = WindowProfile(model="tiny", weights="float32", sink=2, native_window=16, native_ppl=10.0,
                      layer_ppl=layer_ppl, uniform_ppl={2: 80.0, 4: 40.0, 8: 15.0}, scored_tokens=100)
    p.save(tmp_path / PROFILE_NAME)
    return WindowProfile.load(tmp_path / PROFILE_NAME)


def test_profile_cost_scales_measured_shares(tmp_path):
    p = _profile(tmp_path)
    cost = p.cost()
    assert cost[0][4] == pytest.approx(1.0986, abs=1e-4)  # measured: log(30 / 10)
    # unmeasured windows: the layer's share of the measured increase, times the uniform curve's
    assert cost[0][8] / cost[4][8] == pytest.approx(cost[0][4] / cost[4][4])
    assert sum(c[8] for c in cost.values()) == pytest.approx(0.4055, abs=1e-4)  # log(15 / 10)


def test_budget_solves_windows_from_the_profile_beside_the_model(tmp_path):
    from engine.model.loader import tiny_random_model

    model = tiny_random_model(0)
    model.save_pretrained(tmp_path)
    _profile(tmp_path)
    h, d = 2, 16  # the tiny model's K/V heads and head size
    pos_bytes = 2 * h * d * 4
    budget = (2 + 16) * pos_bytes + 3 * (2 + 4) * pos_bytes
    cfg = EngineConfig(model=str(tmp_path), kv_sink=2, kv_budget=budget, kv_cache_bytes=1 << 22)
    engine = Engine(cfg)
    solved = solve_windows(_profile(tmp_path).cost(), {i: pos_bytes for i in range(6)}, 2, 16, budget)
    assert engine.kv_windows == tuple(solved[i] for i in (0, 1, 3, 4))
    assert engine.kv_windows[0] == 16  # the most sensitive layer keeps its native window
    assert [lay.window for lay in engine.layouts if not lay.paged] == list(engine.kv_windows)
    assert engine.pool.ring_row_bytes <= budget
    info = engine.kv_policy_info()
    w = engine.kv_windows
    assert info["layer_windows"] == [w[0], w[1], "all", w[2], w[3], "all"] and info["budget_bytes"] == budget
    with pytest.raises(ValueError, match="below the smallest"):
        Engine(EngineConfig(model=str(tmp_path), kv_sink=2, kv_budget=pos_bytes, kv_cache_bytes=1 << 22))
    (tmp_path / PROFILE_NAME).unlink()
    with pytest.raises(ValueError, match="window profile"):
        Engine(cfg)


def test_config_and_layout_checks():
    with pytest.raises(ValueError, match="kv_windows"):
        EngineConfig(kv_policy="native", kv_windows=(4, 4))
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(kv_windows=(4,), kv_budget=100)
    with pytest.raises(ValueError, match=">= 1"):
        EngineConfig(kv_windows=(4, 0))
    assert EngineConfig(kv_windows=[3, 4]).kv_windows == (3, 4)
    with pytest.raises(ValueError, match="2 windows given for 4 bounded layers"):
        layer_layouts("s5", TYPES, 16, 2, 5, (3, 4))
    lays = layer_layouts("s5", TYPES, 16, 2, 5, (3, 4, 5, 6))
    assert [lay.window if not lay.paged else None for lay in lays] == [3, 4, None, 5, 6, None]
    assert bounded_layers("sink-window", TYPES) == list(range(6)) and bounded_layers("native", TYPES) == []


def test_pool_books_snapshots_and_swaps_with_rings_of_several_sizes():
    """Rows of a pool with three ring sizes: bytes follow each layer's window; a snapshot
    restores a cancelled turn and a swapped row comes back exactly."""
    windows = (3, 7, 3, 5)
    engine = Engine(EngineConfig(model="tiny-random", kv_sink=2, kv_windows=windows, kv_cache_bytes=1 << 22,
                                 max_num_batched_tokens=16, max_rows=4), tiny_loaded(0))
    pool = engine.pool
    assert sorted(r.window for r in pool.rings) == [3, 5, 7] and [len(r.layers) for r in pool.rings] == [2, 1, 1]
    results, _ = run_sessions(engine, [[9, 4], [30, 2]], random.Random(1), max_tokens=9)
    pool.check_invariants()
    def same(a, b):
        assert a[:2] == b[:2] and all(bool((x == y).all()) for x, y in zip(a[2] + a[3], b[2] + b[3]))

    for sid in results:
        row = engine.sessions[sid].row
        before = pool.contents(row)
        kv_len = before[0]
        for ring, pos in zip(pool.rings, before[1]):  # each ring holds sink + its own window
            assert sorted(p for p in pos if p >= 0) == [*range(2), *range(kv_len - ring.window, kv_len)]
        assert pool.resident_kv_bytes(row)["ring"] == sum((2 + w) * 2 * 2 * 16 * 4 for w in windows)
        snap = pool.snapshot(row)
        swapped = pool.swap_out(row)
        assert swapped.nbytes == kv_len * pool.paged_position_bytes + pool.ring_row_bytes
        new = pool.swap_in(swapped, kv_len)
        same(pool.contents(new), before)
        ring = pool.rings[0]
        pool.k[ring.layers[0]][ring.range(new)] = 0  # a turn that went wrong ...
        ring.pos[new] = -1
        pool.restore(new, snap)  # ... is undone
        same(pool.contents(new), before)
        engine.sessions[sid].row = new
        pool.check_invariants()


def test_session_info_reports_the_policy_in_force():
    engine = Engine(EngineConfig(model="tiny-random", kv_sink=2, kv_windows=(3, 7, 3, 5), kv_cache_bytes=1 << 22),
                    tiny_loaded(0))
    sid = engine.create_session()
    info = engine.session_info(sid)
    assert info["kv_policy"] == {"policy": "s5", "sink": 2, "native_window": 16, "budget_bytes": None,
                                 "layer_windows": [3, 7, "all", 3, 5, "all"]}
    json.dumps(info)


def test_serve_flags(capsys):
    from service.settings import parse_serve_args

    s = parse_serve_args(["--kv-windows", "3,7,3,5"])
    assert s.engine.kv_windows == (3, 7, 3, 5) and s.engine.kv_budget is None
    assert parse_serve_args(["--kv-budget", "2M"]).engine.kv_budget == 2 << 20
    with pytest.raises(SystemExit):
        parse_serve_args(["--kv-windows", "3,x"])
    assert "not a comma-separated list of windows" in capsys.readouterr().err
