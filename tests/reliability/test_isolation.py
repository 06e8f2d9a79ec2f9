"""Isolation between sessions on the server's default model and weights (embedded, int8): 64
sessions x 5 turns run concurrently in one engine, each told its own secret key."""

import random

import pytest

from engine import Engine, EngineConfig, Request, SamplingParams
from bench.passkey import FILLER

SESSIONS, TURNS = 64, 5


@pytest.fixture(scope="module")
def int8_embedded(embedded_dir):
    from engine.model.loader import load_model

    return load_model(EngineConfig(model="embedded", quantization="int8"))


def session_turns(tok, key: int, rng: random.Random) -> list[list[int]]:
    """Turn 1 gives the key, turns 2-4 are unrelated text, turn 5 asks for it."""
    first = tok(f"There is important info hidden inside a lot of irrelevant text. Find it and memorize it.\n"
                f"The pass key is {key}. Remember it. {key} is the pass key. ")["input_ids"]
    middle = [tok(FILLER * rng.randrange(1, 3), add_special_tokens=False)["input_ids"] for _ in range(TURNS - 2)]
    last = tok("\nRemember it. The pass key is", add_special_tokens=False)["input_ids"]
    return [first, *middle, last]


def run_sessions(engine: Engine, turns: dict[int, list[list[int]]], tag: str) -> dict[int, list[list[int]]]:
    """Every session's turn i is submitted together (turn i+1 after all turn i finished), so up to
    64 rows prefill and decode in the same steps. Returns each session's output tokens per turn."""
    sids = {s: engine.create_session() for s in turns}
    out = {s: [] for s in turns}
    for i in range(TURNS):
        params = SamplingParams(max_tokens=8 if i == TURNS - 1 else 4, ignore_eos=True)
        got = {s: [] for s in turns}
        for s, sid in sids.items():
            engine.add_request(Request(f"{tag}-{s}-{i}", turns[s][i], params, session_id=sid))
        while engine.has_work():
            for o in engine.step():
                got[int(o.request_id.split("-")[1])].extend(o.new_token_ids)
                assert o.error is None, o.error
        for s in turns:
            out[s].append(got[s])
    for sid in sids.values():
        engine.close_session(sid)
    engine.check_invariants()
    return out


@pytest.mark.slow
def test_64_sessions_keep_their_own_secrets(int8_embedded):
    tok = int8_embedded.tokenizer
    rng = random.Random(64)
    keys = rng.sample(range(10000, 100000), SESSIONS)
    turns = {s: session_turns(tok, keys[s], rng) for s in range(SESSIONS)}
    cfg = EngineConfig(model="embedded", quantization="int8", max_rows=SESSIONS, max_num_batched_tokens=2048)
    engine = Engine(cfg, int8_embedded)
    out = run_sessions(engine, turns, "all")
    texts = {s: [tok.decode(t) for t in out[s]] for s in out}
    leaks = [(s, other) for s in texts for other in range(SESSIONS) if other != s
             for t in texts[s] if str(keys[other]) in t]
    recalled = [s for s in texts if str(keys[s]) in texts[s][-1]]
    print(f"\n{SESSIONS} sessions x {TURNS} turns: {len(recalled)}/{SESSIONS} recalled their own key, "
          f"{len(leaks)} outputs held another session's key")
    assert not leaks
    assert len(recalled) == SESSIONS, sorted(set(range(SESSIONS)) - set(recalled))
    # replaying a session's turns alone on a fresh row (same forward boundaries: under s5 the row
    # depends on where each forward starts) gives the tokens it got among 63 others
    replayed = rng.sample(range(SESSIONS), 8)
    fresh = Engine(cfg, int8_embedded)
    same = sum(run_sessions(fresh, {s: turns[s]}, "alone")[s] == out[s] for s in replayed)
    print(f"replay alone: {same}/{len(replayed)} sessions token-identical over {TURNS} turns")
    assert same == len(replayed)
