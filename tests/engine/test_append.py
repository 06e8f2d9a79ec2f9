"""A session turn with `max_tokens` 0 is an append: its input is prefilled into the row and
committed, nothing is generated. It composes with later turns (the same output as one turn with
the inputs joined, where the KV policy makes forwards' boundaries invisible; the DESIGN mask with
the append's forward boundary under s5), rolls back when aborted, and survives a rebuild by replay
and a restart (the SessionDB records it as one forward with no decodes)."""

import random

import pytest

from engine import Engine, EngineConfig, EngineError, FinishReason, Request, SamplingParams
from tests.helpers import greedy, oracle_logits, tiny_loaded, tiny_reference

BASE = dict(model="tiny-random", kv_sink=2, kv_window=5, kv_cache_bytes=1 << 22, max_num_batched_tokens=16,
            max_rows=4)
APPEND = SamplingParams(max_tokens=0)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


class Recorder:
    """Every step's logits by (request id, position)."""

    def __init__(self, engine):
        self.logits = {}
        engine.logits_hook = lambda rid, pos, row: self.logits.__setitem__((rid, pos), row.detach().clone())


def turn(engine: Engine, rid: str, sid: str, prompt: list[int], params: SamplingParams) -> list:
    """Runs one request to its end; returns its outputs."""
    engine.add_request(Request(rid, prompt, params, session_id=sid))
    outs = []
    while engine.has_work():
        outs += [o for o in engine.step() if o.request_id == rid]
        engine.check_invariants()
    assert outs and outs[-1].finished and outs[-1].error is None
    return outs


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@pytest.mark.parametrize("policy", ["native", "full"])
def test_appends_then_a_turn_equal_one_turn_with_the_inputs_joined(policy):
    """Two appends (the first longer than the model's sliding window, chunked over steps), then a
    generating turn: its tokens and logits are those of one turn fed all three inputs."""
    doc, more, question = ids(1, 40), ids(2, 9), ids(3, 5)
    joined = Engine(EngineConfig(**BASE, kv_policy=policy), tiny_loaded(0))
    rec_joined = Recorder(joined)
    sid_j = joined.create_session()
    want = tokens(turn(joined, "q", sid_j, doc + more + question, greedy(12)))

    engine = Engine(EngineConfig(**BASE, kv_policy=policy), tiny_loaded(0))
    rec = Recorder(engine)
    sid = engine.create_session()
    outs = turn(engine, "a1", sid, doc, APPEND)
    assert len(outs) == 1 and outs[0].finish_reason == FinishReason.LENGTH
    assert outs[0].new_token_ids == [] and outs[0].num_output_tokens == 0 and outs[0].num_prompt_tokens == len(doc)
    info = engine.session_info(sid)
    assert info["history_tokens"] == info["kv_tokens"] == len(doc) and info["turns"] == 1
    assert info["resident_kv_bytes"] > 0 and info["state"] == "resident"
    outs = turn(engine, "a2", sid, more, APPEND)
    assert outs[-1].num_cached_tokens == len(doc) and outs[-1].num_prompt_tokens == len(more)
    assert engine.session_tokens(sid) == doc + more and engine.session_info(sid)["kv_tokens"] == len(doc + more)
    assert not rec.logits  # an append samples nothing
    got = tokens(turn(engine, "q", sid, question, greedy(12)))
    assert got == want
    assert engine.session_tokens(sid) == doc + more + question + got
    diff = max((rec.logits[k] - rec_joined.logits[k]).abs().max().item() for k in rec_joined.logits)
    assert rec.logits.keys() == rec_joined.logits.keys() and diff < 1e-4


def test_under_s5_the_append_is_a_forward_boundary():
    """Under s5 the turn after an append matches the DESIGN mask with a forward starting where
    the append ended (and so differs from one joined turn: bounded layers dropped the rest)."""
    sink, window = 2, 5
    doc, question = ids(4, 30), ids(5, 6)
    engine = Engine(EngineConfig(**BASE, kv_policy="s5"), tiny_loaded(0))
    rec = Recorder(engine)
    sid = engine.create_session()
    turn(engine, "a", sid, doc, APPEND)
    got = tokens(turn(engine, "q", sid, question, greedy(8)))
    toks = engine.session_tokens(sid)
    assert toks == doc + question + got
    n = len(doc) + len(question)
    starts = [0] * len(doc) + [len(doc)] * len(question) + list(range(n, len(toks)))
    ref = oracle_logits(tiny_reference(0), toks, starts, "s5", sink, window)
    one_forward = oracle_logits(tiny_reference(0), toks, [0] * n + list(range(n, len(toks))), "s5", sink, window)
    diff = max((lg - ref[pos]).abs().max().item() for (_, pos), lg in rec.logits.items())
    control = max((lg - one_forward[pos]).abs().max().item() for (_, pos), lg in rec.logits.items())
    assert len(rec.logits) == 8 and diff < 1e-4 and control > 1e-2


def test_an_aborted_append_rolls_back():
    turn1, doc, question = ids(6, 7), ids(7, 40), ids(8, 5)
    control = Engine(EngineConfig(**BASE), tiny_loaded(0))
    sid_c = control.create_session()
    first = tokens(turn(control, "t1", sid_c, turn1, greedy(4)))
    want = tokens(turn(control, "t2", sid_c, question, greedy(6)))

    engine = Engine(EngineConfig(**{**BASE, "max_num_batched_tokens": 8}), tiny_loaded(0))
    sid = engine.create_session()
    assert tokens(turn(engine, "t1", sid, turn1, greedy(4))) == first
    before = engine.session_info(sid)
    engine.add_request(Request("a", doc, APPEND, session_id=sid))
    engine.step()
    engine.step()  # 16 of its 41 tokens fed
    assert engine.session_info(sid)["kv_tokens"] > before["kv_tokens"]
    out = engine.abort("a")
    assert out.finish_reason == FinishReason.ABORT
    engine.check_invariants()
    after = engine.session_info(sid)
    assert (after["history_tokens"], after["kv_tokens"], after["turns"]) == \
        (before["history_tokens"], before["kv_tokens"], before["turns"])
    assert tokens(turn(engine, "t2", sid, question, greedy(6))) == want
    # an append that is the session's first turn, aborted, leaves the session empty with no row
    sid2 = engine.create_session()
    engine.add_request(Request("b", doc, APPEND, session_id=sid2))
    engine.step()
    engine.abort("b")
    engine.check_invariants()
    assert engine.session_tokens(sid2) == [] and engine.session_info(sid2)["kv_tokens"] == 0


def test_appends_are_rebuilt_by_replay_and_survive_a_restart(tmp_path):
    """Turn, append, turn, append, then the row is given up (released, or the process restarts
    with only the SessionDB): the next turn rebuilds it by replaying the forwards, appends included
    as one forward with no decodes, and gives the tokens and logits of a session that never left."""
    inputs = [(ids(9, 6), greedy(5)), (ids(10, 20), APPEND), (ids(11, 4), greedy(6)), (ids(12, 9), APPEND)]
    last = (ids(13, 3), greedy(8))

    def run(engine, sid, steps):
        return [tokens(turn(engine, f"t{i}", sid, p, sp)) for i, (p, sp) in steps]

    ref = Engine(EngineConfig(**BASE), tiny_loaded(0))
    rec_ref = Recorder(ref)
    sid_ref = ref.create_session()
    want = run(ref, sid_ref, enumerate([*inputs, last]))
    assert want[1] == want[3] == []
    want_last = {pos: lg for (rid, pos), lg in rec_ref.logits.items() if rid == "t4"}

    def check(engine, sid):
        rec = Recorder(engine)
        assert run(engine, sid, [(4, last)]) == [want[4]]
        assert engine.session_info(sid)["last_resume"]["path"] == "rebuild"
        got = {pos: lg for (rid, pos), lg in rec.logits.items() if rid == "t4"}
        assert got.keys() == want_last.keys()
        assert max((got[p] - want_last[p]).abs().max().item() for p in got) < 1e-4
        assert engine.session_tokens(sid) == ref.session_tokens(sid_ref)

    released = Engine(EngineConfig(**BASE), tiny_loaded(0))
    sid = released.create_session()
    assert run(released, sid, enumerate(inputs)) == want[:4]
    assert released.release_row(sid)
    check(released, sid)

    db = str(tmp_path / "sessions.sqlite3")
    first = Engine(EngineConfig(**BASE, session_db=db), tiny_loaded(0))
    sid = first.create_session()
    assert run(first, sid, enumerate(inputs)) == want[:4]
    first.close()
    restarted = Engine(EngineConfig(**BASE, session_db=db), tiny_loaded(0))
    info = restarted.session_info(sid)
    assert info["state"] == "stored" and info["turns"] == 4
    assert restarted.sessions[sid].forwards == [] and restarted.session_tokens(sid) == first.session_tokens(sid)
    assert restarted.sessions[sid].forwards == first.sessions[sid].forwards
    assert first.sessions[sid].forwards[1] == (1 + 20, 0) and first.sessions[sid].forwards[3] == (1 + 9, 0)
    check(restarted, sid)


def test_append_needs_a_session_and_a_turn_prepared_against_a_stale_history_is_refused():
    engine = Engine(EngineConfig(**BASE), tiny_loaded(0))
    with pytest.raises(EngineError) as err:
        engine.add_request(Request("x", [5, 6], APPEND))
    assert err.value.param == "max_tokens"
    sid = engine.create_session()
    turn(engine, "t1", sid, [5, 6, 7], greedy(3))
    assert engine.session_tail(sid, 2) == (6, engine.session_tokens(sid)[-2:])
    assert engine.session_tail(sid, 100) == (6, engine.session_tokens(sid))
    with pytest.raises(EngineError) as err:
        engine.add_request(Request("t2", [8], greedy(2), session_id=sid, expect_history_len=3))
    assert err.value.code == "session_busy"
    engine.check_invariants()
    turn(engine, "t2", sid, [8], greedy(2))  # prepared against the right length: accepted
    engine.add_request(Request("t3", [9], greedy(2), session_id=sid, expect_history_len=6 + 1 + 2))
    empty = engine.create_session()
    assert engine.session_tail(empty, 4) == (0, [])
