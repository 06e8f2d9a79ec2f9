"""Steps launched ahead of the host (`EngineConfig.overlap_steps`) change nothing a client or a
row can see: the same tokens, the same finish reasons, and rows (ring positions, lengths, K/V)
equal to an engine that applies each step before it launches the next, including
rows of turns that ended by a stop token one step before the host knew (their extra step is
undone), aborted turns, sampling rows (their draws on the device, in the same order) and
stateless requests mixed in. On the CPU the static decode step runs
uncaptured, with the same logic as on CUDA."""

import pytest

from engine import Request, SamplingParams
from engine.core.types import FinishReason
from tests.scenarios import check_turns_with_stops, drive, engines


@pytest.mark.parametrize("policy", ["s5", "native"])
def test_overlap_equals_plain_order(policy):
    # K/V to float rounding: a step with a row launched ahead (and then undone) has one more lane
    # than the plain order's, and the CPU's matrix products round by batch shape; a slot undone
    # wrongly would hold another token's K/V (differences of O(1))
    seen = check_turns_with_stops("cpu", policy, sessions=4, stateless=2, rounds=10, atol=1e-5)
    # the cases the overlap must undo did happen, on session rows (kept and compared above)
    assert seen["stopped_mid"] >= 4 and seen["aborted"] >= 3 and seen["undone_session_rows"] >= 4


def test_overlap_launches_ahead_and_undoes():
    """The overlap is really taken: steady decoding launches each step before applying the one
    before it, and a turn that stops one step early is undone at the ring layers."""
    _, ahead = engines("s5")
    sid = ahead.create_session()
    calls = []
    real = ahead.pool.undo_decode
    ahead.pool.undo_decode = lambda *a: (calls.append(a[:2]), real(*a))[1]
    first, _ = drive(ahead, [Request("a", [5, 6, 7], SamplingParams(max_tokens=12), session_id=sid)], {})
    toks = first["a"][0]
    assert len(toks) == 12 and not calls  # ended by length: known ahead, nothing to undo
    stop = toks[5]
    k = toks.index(stop)
    ahead.reset_session(sid)
    out, _ = drive(ahead, [Request("b", [5, 6, 7], SamplingParams(max_tokens=12, stop_token_ids=(stop,)),
                                   session_id=sid)], {})
    assert out["b"] == (toks[: k + 1], FinishReason.STOP)
    assert len(calls) == 1 and calls[0][1] == 3 + k  # the position fed one step past the stop
    assert ahead.pool.kv_len(ahead.sessions[sid].row) == 3 + k


def test_a_request_arriving_while_a_step_is_ahead():
    """A request that arrives while a step is launched ahead waits for the pending step to be
    applied (nothing more is launched ahead while it waits or prefills), then joins; the other
    rows go on. Every request's tokens equal the plain order's with the same arrival (after the
    first request's 5th token)."""
    plain, ahead = engines("s5")

    def run(engine):
        for i in range(3):
            engine.add_request(Request(f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=16, ignore_eos=True)))
        got, joined, pending_when_joined = {f"r{i}": [] for i in range(4)}, False, None
        while engine.has_work():
            for o in engine.step():
                got[o.request_id] += o.new_token_ids
            if not joined and len(got["r0"]) >= 5:
                pending_when_joined = engine.ahead is not None and engine.ahead.pending is not None
                engine.add_request(Request("r3", [9, 8, 7, 6], SamplingParams(max_tokens=10, ignore_eos=True)))
                joined = True
            engine.check_invariants()
        return got, pending_when_joined

    want, _ = run(plain)
    got, pending = run(ahead)
    assert pending  # it arrived with a step in flight
    assert got == want and [len(got[f"r{i}"]) for i in range(4)] == [16, 16, 16, 10]
