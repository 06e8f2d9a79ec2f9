"""Scenarios several test modules drive an engine through: multi-turn conversations, logits
recorded per (request, position), the DESIGN.md oracle check over recorded sessions, and the
plain-order vs launched-ahead comparison."""

from __future__ import annotations

import random

from engine import Engine, EngineConfig, Request, SamplingParams
from engine.core.types import FinishReason
from tests.helpers import greedy, oracle_logits, tiny_loaded


class Recorder:
    """Every step's logits by (request id, position); installed as the engine's logits hook."""

    def __init__(self, engine: Engine | None = None):
        self.logits = {}  # (rid, pos) -> logits
        if engine is not None:
            engine.logits_hook = self

    def __call__(self, rid, pos, logits):
        self.logits[(rid, pos)] = logits.detach().clone()


def plan(seed, sessions=5, turns=4):
    """Per session, per turn: (input ids, max_tokens); outputs longer than the window."""
    rng = random.Random(seed)
    return [[([rng.randrange(3, 512) for _ in range(rng.randrange(1, 20))], rng.randrange(1, 12))
             for _ in range(turns)] for _ in range(sessions)]


def owner_of(engine, sid):
    """The tenant a session belongs to (sessions answer their own owner only)."""
    return engine.sessions[sid].owner if sid in engine.sessions else None


def converse(engine, turns, sids=None, rounds=None, before_round=None):
    """All sessions submit round r together; returns (outputs per session per round, sids)."""
    sids = sids or [engine.create_session(owner=f"tenant-{i % 2}") for i in range(len(turns))]
    out = [[] for _ in sids]
    for r in rounds or range(len(turns[0])):
        if before_round is not None:
            before_round(engine, sids, r)
        got = {sid: [] for sid in sids}
        for sid, t in zip(sids, turns):
            engine.add_request(Request(f"{sid}-{r}", t[r][0], greedy(t[r][1]), session_id=sid,
                                       owner=owner_of(engine, sid)))
        while engine.has_work():
            for o in engine.step():
                assert o.error is None, o.error
                got[o.request_id.rsplit("-", 1)[0]].extend(o.new_token_ids)
            engine.check_invariants()
        for i, sid in enumerate(sids):
            out[i].append(got[sid])
    return out, sids


def max_logit_diff(a: Recorder, b: Recorder, rename: dict[str, str]) -> float:
    keys = [(rid, pos) for rid, pos in b.logits]
    assert keys
    return max((a.logits[(rename.get(rid.rsplit("-", 1)[0], rid.rsplit("-", 1)[0]) + "-" + rid.rsplit("-", 1)[1], pos)]
                - b.logits[(rid, pos)]).abs().max().item() for rid, pos in keys)


def run_sessions(engine, turns_per_session, rng, max_tokens=6, stagger=True):
    """Drives several sessions through multi-turn conversations, interleaved in one engine.
    Returns {sid: (tokens, forward_starts, [request ids])}."""
    rec = Recorder(engine)
    sids = [engine.create_session() for _ in turns_per_session]
    queue = {sid: list(turns) for sid, turns in zip(sids, turns_per_session)}
    starts = {sid: [] for sid in sids}
    rids = {sid: [] for sid in sids}
    inflight = {}
    step = 0
    vocab = engine.geometry.vocab_size
    while any(queue.values()) or inflight or engine.has_work():
        for sid in sids:
            if sid in inflight or not queue[sid]:
                continue
            if stagger and rng.random() < 0.5:
                continue
            n = queue[sid].pop(0)
            hist = engine.session_tokens(sid)
            kv = engine.session_info(sid)["kv_tokens"]
            prompt = [rng.randrange(3, vocab) for _ in range(n)]
            rid = f"{sid}-{len(rids[sid])}"
            engine.add_request(Request(rid, prompt, greedy(max_tokens), session_id=sid))
            feed = len(hist) - kv + n
            fs = starts[sid][:kv]
            fs += range(len(fs), kv)  # the previous turn's decoded tokens: a forward each
            starts[sid] = fs + [kv] * feed
            inflight[sid] = rid
            rids[sid].append(rid)
        for o in engine.step():
            sid = o.request_id.rsplit("-", 1)[0]
            if o.finished:
                del inflight[sid]
            elif o.new_token_ids:
                pass
        step += 1
        assert step < 10_000
    out = {}
    for sid in sids:
        toks = engine.session_tokens(sid)
        fs = starts[sid]
        while len(fs) < len(toks):
            fs.append(len(fs))  # each decoded token is a forward of its own
        out[sid] = (toks, fs, rids[sid])
    engine.check_invariants()
    return out, rec


def check_against_oracle(engine, ref_model, results, rec, policy, sink, window, atol, windows=None):
    """`windows`: per layer, a bounded layer's own window (None: not bounded), see oracle_logits."""
    worst = 0.0
    n = 0
    for sid, (toks, fs, rids) in results.items():
        ref = oracle_logits(ref_model, toks, fs, policy, sink, window, windows)
        for (rid, pos), lg in rec.logits.items():
            if rid in rids:
                worst = max(worst, (lg - ref[pos]).abs().max().item())
                n += 1
    assert n > 0
    assert worst < atol, f"{policy}: max |logit diff| {worst} over {n} steps"
    return worst, n


# ---- steps launched ahead against the plain order ------------------------------------------------
OVERLAP_BASE = dict(model="tiny-random", kv_sink=2, kv_window=5, kv_cache_bytes=1 << 22, max_num_batched_tokens=64,
            max_rows=8, decode_graphs=True, max_graph_batch=8)


def engines(policy: str, device: str = "cpu"):
    """The same model twice: steps applied in order, and steps launched ahead."""
    def make(overlap):
        loaded = tiny_loaded(0)
        loaded.model.to(device)
        return Engine(EngineConfig(**OVERLAP_BASE, kv_policy=policy, device=device, overlap_steps=overlap), loaded)

    plain, ahead = make(False), make(True)
    assert plain.ahead is None and ahead.ahead is not None
    return plain, ahead


def row_state(engine: Engine, sid: str):
    """Everything the session's row holds: length, ring positions, ring K/V, paged K/V, and the
    session's transcript."""
    s = engine.sessions[sid]
    return (*engine.pool.contents(s.row), list(s.tokens), list(s.forwards))


def drive(engine: Engine, requests: list[Request], abort_at: dict[str, int]):
    """Runs the requests; aborts rid once it has `abort_at[rid]` tokens. Returns per request
    (tokens, finish reason) and the number of step calls."""
    for r in requests:
        engine.add_request(r)
    got = {r.request_id: [[], None] for r in requests}
    calls = 0
    while engine.has_work():
        outs = engine.step()
        calls += 1
        for o in outs:
            got[o.request_id][0].extend(o.new_token_ids)
            if o.finished:
                got[o.request_id][1] = o.finish_reason
        for rid, n in abort_at.items():
            if got[rid][1] is None and len(got[rid][0]) >= n:
                o = engine.abort(rid)
                got[rid][1] = o.finish_reason
        engine.check_invariants()
        assert calls < 10_000
    return {rid: (toks, reason) for rid, (toks, reason) in got.items()}, calls


def check_turns_with_stops(device: str, policy: str, sessions: int, stateless: int, rounds: int,
                           atol: float) -> dict[str, int]:
    """Sessions converse, all in each round (so steps batch them), with stateless requests mixed
    in, greedy and sampling alike; many turns end by a stop token mid-decode, and every other
    round one session's turn is aborted. Asserts equal outputs and rows (K/V within `atol`); returns what happened."""
    plain, ahead = engines(policy, device)
    rng = random.Random(7)
    vocab = plain.geometry.vocab_size
    # frequent enough stop tokens that many turns end by one mid-decode (counted)
    stops = tuple(rng.sample(range(3, vocab), vocab // 3))
    sids = {e: [e.create_session() for _ in range(sessions)] for e in (plain, ahead)}
    undone = []  # rows whose one extra step was undone
    real = ahead.pool.undo_decode
    ahead.pool.undo_decode = lambda row, *a: (undone.append(row), real(row, *a))[1]
    seen = {"stopped_mid": 0, "aborted": 0, "max_kv_diff": 0.0}
    n = sessions + stateless
    for r in range(rounds):
        reqs = {e: [] for e in (plain, ahead)}
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 12))] for _ in range(n)]
        budgets = [rng.randrange(4, 16) for _ in range(n)]
        abort_at = {f"s{r}-0": 3} if r % 2 else {}
        for e in (plain, ahead):
            for i in range(n):
                # all but the first of several requests stop early where they can; every other
                # request samples (its own seed, some with top-k or top-p), the rest are greedy
                sampling = {} if i % 2 == 0 else dict(temperature=0.9, seed=1000 * r + i,
                                                      top_k=(0, 20)[r % 2], top_p=(1.0, 0.8)[(r // 2) % 2])
                params = SamplingParams(max_tokens=budgets[i], stop_token_ids=stops if i or n == 1 else (), **sampling)
                sid = sids[e][i] if i < sessions else None
                reqs[e].append(Request(f"s{r}-{i}", prompts[i], params, session_id=sid))
        want, _ = drive(plain, reqs[plain], abort_at)
        got, _ = drive(ahead, reqs[ahead], abort_at)
        assert got == want, f"round {r}"
        for toks, reason in want.values():
            seen["stopped_mid"] += reason == FinishReason.STOP and len(toks) >= 2
            seen["aborted"] += reason == FinishReason.ABORT
        for a, b in zip(sids[plain], sids[ahead]):
            pa, pb = row_state(plain, a), row_state(ahead, b)
            assert pa[:2] == pb[:2] and pa[4:] == pb[4:]
            diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(pa[2] + pa[3], pb[2] + pb[3]))
            seen["max_kv_diff"] = max(seen["max_kv_diff"], diff)
            assert diff <= atol, (r, diff)
    assert ahead.pool.used_rows() == plain.pool.used_rows()
    session_rows = {ahead.sessions[sid].row for sid in sids[ahead]}
    seen["undone_session_rows"] = len([row for row in undone if row in session_rows])
    return seen
