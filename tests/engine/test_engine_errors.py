"""Bad input raises a clear EngineError and changes nothing; sessions roll back on abort."""

import math

import pytest

from engine import Engine, EngineConfig, EngineError, Request, SamplingParams
from tests.helpers import greedy, run_all, tiny_loaded


@pytest.fixture
def engine():
    cfg = EngineConfig(model="tiny-random", kv_policy="s5", kv_sink=2, kv_window=4, max_rows=4,
                       kv_cache_bytes=1 << 22, max_model_len=256)
    return Engine(cfg, tiny_loaded(0))


BAD = [
    ("empty prompt", dict(prompt=[]), "invalid_request"),
    ("token out of vocab", dict(prompt=[5, 99999]), "invalid_request"),
    ("negative token", dict(prompt=[-1]), "invalid_request"),
    ("boolean token", dict(prompt=[5, True]), "invalid_request"),
    ("float token", dict(prompt=[5, 6.0]), "invalid_request"),
    ("string token", dict(prompt=["5", 6]), "invalid_request"),
    ("token past int64", dict(prompt=[5, 2**70]), "invalid_request"),
    ("prompt not a list", dict(prompt="5 6"), "invalid_request"),
    ("over context", dict(prompt=[5] * 256), "context_length_exceeded"),
    ("max_tokens past context", dict(prompt=[5] * 200, params=SamplingParams(max_tokens=100)), "context_length_exceeded"),
    ("max_tokens 0", dict(params=SamplingParams(max_tokens=0)), "invalid_request"),
    ("temperature < 0", dict(params=SamplingParams(temperature=-0.5)), "invalid_request"),
    ("temperature NaN", dict(params=SamplingParams(temperature=math.nan)), "invalid_request"),
    ("top_p 0", dict(params=SamplingParams(top_p=0.0)), "invalid_request"),
    ("top_p > 1", dict(params=SamplingParams(top_p=1.5)), "invalid_request"),
    ("unknown session", dict(session_id="nope"), "session_not_found"),
    ("stop without tokenizer", dict(params=SamplingParams(stop=("x",))), "invalid_request"),
]


@pytest.mark.parametrize("name,kw,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_and_changes_nothing(engine, name, kw, code):
    before = (engine.pool.num_free_rows, engine.pool.num_free_blocks, engine.has_work())
    req = Request("r", kw.get("prompt", [5, 6, 7]), kw.get("params", greedy(4)), kw.get("session_id"))
    with pytest.raises(EngineError) as err:
        engine.add_request(req)
    assert err.value.code == code
    assert (engine.pool.num_free_rows, engine.pool.num_free_blocks, engine.has_work()) == before
    engine.check_invariants()
    assert run_all(engine, [Request("ok", [5, 6, 7], greedy(3))])["ok"]  # still serving


def test_second_concurrent_turn_is_refused(engine):
    sid = engine.create_session()
    engine.add_request(Request("t1", [5, 6, 7], greedy(5), sid))
    with pytest.raises(EngineError) as err:
        engine.add_request(Request("t2", [8], greedy(5), sid))
    assert err.value.code == "session_busy"
    while engine.has_work():
        engine.step()
    assert len(engine.session_tokens(sid)) == 3 + 5


def test_turns_never_reprefill_history_and_abort_rolls_back(engine):
    sid = engine.create_session()
    run_all(engine, [Request("t1", list(range(10, 40)), greedy(6), sid)])
    assert engine.stats["prefill_tokens"] == 30
    state = (engine.session_tokens(sid), engine.session_info(sid)["kv_tokens"])
    # a turn cancelled mid-decode (past the ring window) leaves the session as it was
    out = run_all(engine, [Request("t2", [50, 51, 52], greedy(20), sid)], aborts={"t2": 9})
    assert 0 < len(out["t2"]) < 20
    assert (engine.session_tokens(sid), engine.session_info(sid)["kv_tokens"]) == state
    engine.check_invariants()
    before = engine.stats["prefill_tokens"]
    third = run_all(engine, [Request("t3", [60, 61], greedy(6), sid)])["t3"]
    # only the uncomputed last token of turn 1 and the 2 new ones are prefilled
    assert engine.stats["prefill_tokens"] - before == 1 + 2
    # the same third turn on a session that never saw the cancelled one gives the same tokens
    twin = Engine(engine.config, tiny_loaded(0))
    sid2 = twin.create_session()
    run_all(twin, [Request("t1", list(range(10, 40)), greedy(6), sid2)])
    assert run_all(twin, [Request("t3", [60, 61], greedy(6), sid2)])["t3"] == third


def test_close_and_evict(engine):
    sid = engine.create_session()
    run_all(engine, [Request("t1", [5, 6, 7, 8], greedy(3), sid)])
    assert engine.release_row(sid)
    assert engine.session_info(sid)["state"] == "stored"
    out = run_all(engine, [Request("t2", [9], greedy(3), sid)])["t2"]
    assert len(out) == 3 and engine.session_info(sid)["kv_tokens"] == 4 + 3 + 1 + 2
    assert engine.session_info(sid)["last_resume"] == {"path": "rebuild", "tokens": 4 + 3, "forwards": 1 + 2 + 1}
    assert engine.close_session(sid) and not engine.close_session(sid)
    engine.check_invariants()
    assert engine.pool.num_free_rows == 4


def test_rows_running_out_swap_out_the_least_recently_used_idle_session(engine):
    """(With no swap space the session is closed instead: tests/engine/test_swap.py.)"""
    sids = [engine.create_session() for _ in range(4)]  # the engine has 4 rows
    for i, sid in enumerate(sids):
        run_all(engine, [Request(f"t{i}", [5 + i, 6, 7], greedy(2), sid)])
    run_all(engine, [Request("again", [9], greedy(2), sids[0])])  # sids[1] is now the oldest
    out = run_all(engine, [Request("stateless", [5, 6], greedy(3))])["stateless"]
    assert len(out) == 3
    info = engine.session_info(sids[1])
    assert info["state"] == "swapped" and info["host_kv_bytes"] > 0 and info["kv_tokens"] == 4
    assert engine.stats["swaps_out"] == 1 and engine.stats["rows_released"] == 0
    for sid in (sids[0], sids[2], sids[3]):
        assert engine.session_info(sid)["state"] == "resident"
    engine.check_invariants()


@pytest.mark.parametrize("cuda_lengths", [False, True])
@pytest.mark.parametrize("max_model_len,kv_cache_bytes", [(256, 1 << 22), (20, 1 << 22), (1024, 1 << 16)])
def test_the_engine_process_warm_up_leaves_no_trace(max_model_len, kv_cache_bytes, cuda_lengths):
    """The warm-up's prompts (clamped to a short context or a small KV cache; with
    `cuda_lengths`, those a CUDA engine warms up with) run to the end; afterwards no row is held,
    the counters read zero and the engine serves as it would have without it."""
    from engine.kernels import moe, nf4
    from engine.process import CUDA_WARM_UP_PROMPT, WARM_UP_PROMPTS, _warm_up, warm_up_lengths

    cfg = EngineConfig(model="tiny-random", kv_policy="s5", kv_sink=2, kv_window=4, max_rows=4,
                       kv_cache_bytes=kv_cache_bytes, max_model_len=max_model_len)
    warmed, fresh = Engine(cfg, tiny_loaded(0)), Engine(cfg, tiny_loaded(0))
    assert warm_up_lengths(warmed) == WARM_UP_PROMPTS  # a CPU engine
    _warm_up(warmed, WARM_UP_PROMPTS + (CUDA_WARM_UP_PROMPT,) if cuda_lengths else None)
    assert len(WARM_UP_PROMPTS) == 3 and max(WARM_UP_PROMPTS) > 32
    # the CUDA prompt's prefill is past every fused kernel's row limit
    assert CUDA_WARM_UP_PROMPT > max(nf4.MAX_KERNEL_ROWS, moe.MAX_TOKENS)
    assert not warmed.has_work() and warmed.pool.num_free_rows == warmed.pool.num_rows
    assert (warmed.stats["steps"], warmed.stats["prefill_tokens"], warmed.stats["decode_tokens"]) == (0, 0, 0)
    warmed.check_invariants()

    def requests():
        return [Request("a", [5, 6, 7], greedy(8)), Request("b", [9, 10], greedy(6))]

    assert run_all(warmed, requests()) == run_all(fresh, requests())


def test_a_default_max_tokens_is_lowered_to_the_room_left(engine):
    """max_tokens the client did not ask for (max_tokens_fit) ends where the context does instead
    of refusing the prompt; the same max_tokens asked for is refused (above)."""
    fit = SamplingParams(max_tokens=100, max_tokens_fit=True)
    out = run_all(engine, [Request("near", [5] * 200, fit)])["near"]
    assert len(out) == 256 - 200
    # on a session, the history counts too
    sid = engine.create_session()
    run_all(engine, [Request("t1", [5] * 150, greedy(1), sid)])
    out = run_all(engine, [Request("t2", [6] * 50, fit, sid)])["t2"]
    assert 150 + 1 + 50 + len(out) == 256
    # room enough: max_tokens itself
    assert len(run_all(engine, [Request("far", [5] * 10, fit)])["far"]) == 100
    engine.check_invariants()


def test_a_default_max_tokens_is_lowered_to_the_kv_cache():
    cfg = EngineConfig(model="tiny-random", kv_policy="native", max_rows=2, kv_cache_bytes=1 << 16,
                       max_model_len=4096)
    eng = Engine(cfg, tiny_loaded(0))
    cap = (eng.pool.num_blocks - 1) * eng.pool.block_size
    assert cap < 4096 - 64
    with pytest.raises(EngineError) as err:
        eng.add_request(Request("asked", [5] * 10, greedy(4000)))
    assert err.value.code == "kv_capacity_exceeded"
    out = run_all(eng, [Request("default", [5] * 10, SamplingParams(max_tokens=4000, max_tokens_fit=True))])
    assert len(out["default"]) == cap - 10
    eng.check_invariants()


def test_a_request_ended_before_its_fork_ends_its_other_completions():
    """n > 1: a request aborted while it waits for rows (its row not forked yet) ends every
    completion's stream, not only its own; nothing is held after."""
    from engine.core.types import FinishReason, fork_id

    cfg = EngineConfig(model="tiny-random", kv_policy="s5", kv_sink=2, kv_window=4, max_rows=2,
                       kv_cache_bytes=1 << 22, max_model_len=256)
    eng = Engine(cfg, tiny_loaded(0))
    two = SamplingParams(max_tokens=50, n=2, ignore_eos=True)
    eng.add_request(Request("a", [5, 6, 7], two))
    eng.add_request(Request("b", [8, 9], two))
    eng.step()  # a takes both rows and forks; b waits
    out = eng.abort("b")
    ends = [out] + eng.ended_between_steps
    assert sorted(o.request_id for o in ends) == ["b", fork_id("b", 1)]
    assert all(o.finished and o.finish_reason == FinishReason.ABORT and not o.new_token_ids for o in ends)
    assert eng.cancel("a")  # a forked: its completions end as requests of their own
    assert sorted(o.request_id for o in eng.ended_between_steps[1:]) == ["a", fork_id("a", 1)]
    assert not eng.has_work() and eng.pool.num_free_rows == 2
    eng.check_invariants()
