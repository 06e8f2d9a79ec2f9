"""The engine's objects form no reference cycles: a dropped engine (its runner, static decoder,
scheduler, session table, pool) is freed at once by reference counting, never left for the
garbage collector. That matters on CUDA: freeing an engine destroys its CUDA graphs, which CUDA
forbids while another engine is capturing, and a collection can start at any allocation."""

import gc
import threading
import weakref

import pytest

from engine import Engine, EngineConfig, Request
from engine.process import EngineCore
from tests.helpers import greedy, run_all, tiny_loaded

BASE = dict(model="tiny-random", kv_sink=2, kv_window=5, kv_cache_bytes=1 << 22, max_num_batched_tokens=64,
            max_rows=4, decode_graphs=True, max_graph_batch=4)


def exercised_engine(tmp_path, overlap: bool) -> Engine:
    """An engine that has run stateless requests, session turns (with rows given up, swapped and
    rebuilt: more sessions than rows), sampled rows, an abort and a failed request."""
    engine = Engine(EngineConfig(**BASE, overlap_steps=overlap, session_db=str(tmp_path / "s.db"), swap_bytes=1 << 12),
                    tiny_loaded(0))
    sids = [engine.create_session(owner="t") for _ in range(6)]
    for turn in range(2):
        reqs = [Request(f"{s}-{turn}", [3 + turn, 4, 5], greedy(4), session_id=s, owner="t") for s in sids]
        reqs.append(Request(f"free-{turn}", [1, 2, 3, 4], greedy(6, temperature=0.8, seed=turn)))
        run_all(engine, reqs, aborts={f"free-{turn}": 2} if turn else None)
    with pytest.raises(Exception):
        engine.add_request(Request("bad", [10**9], greedy(3)))
    engine.check_invariants()
    assert engine.stats["rebuilds"] + engine.stats["swaps_in"] > 0  # rows came back both ways
    return engine


@pytest.mark.parametrize("overlap", [False, True])
def test_a_dropped_engine_is_freed_by_reference_counting(tmp_path, overlap):
    gc.collect()
    gc.disable()
    try:
        engine = exercised_engine(tmp_path, overlap)
        core = EngineCore(engine, outboxes=[])
        parts = [engine, core, engine.runner, engine.scheduler, engine.sessions, engine.pool, engine.planner]
        assert engine.runner.decoder is not None
        parts.append(engine.runner.decoder)
        refs = [weakref.ref(p) for p in parts]
        engine.close()
        del engine, core, parts
        alive = [type(r()).__name__ for r in refs if r() is not None]
        assert alive == [], f"kept alive by a reference cycle: {alive}"
    finally:
        gc.enable()


def test_the_grammar_thread_ends_with_its_owner():
    """The thread that fills grammar masks for steps launched ahead belongs to the engine's
    `Grammars`: dropped (without `close`), it is freed by reference counting and its thread ends."""
    from engine.core.structured import Grammars

    gc.collect()
    gc.disable()
    try:
        grammars = Grammars(None, 64, (1,))
        assert grammars.fill_masks_async([None, None]).result() == (None, {})
        [thread] = [t for t in threading.enumerate() if t.name.startswith("s5serve-grammar-masks")]
        ref = weakref.ref(grammars)
        del grammars
        assert ref() is None
        thread.join(timeout=10)
        assert not thread.is_alive()
    finally:
        gc.enable()
