"""Structured outputs in the engine (engine/core/structured.py): a grammar row's tokens follow
its grammar and end it, the rows beside it are untouched, and a bad grammar changes nothing; with
penalties and logprobs, and with n > 1 (each choice's matcher forked)."""

import itertools
import json
import math
import time
from collections import defaultdict
from dataclasses import replace

import jsonschema
import pytest
import torch
from llguidance import LLMatcher

from engine import Engine, EngineConfig, EngineError, Request, SamplingParams
from engine.core.types import fork_id
from engine.model.loader import LoadedModel, tiny_random_model
from service.structured import JSON_OPTIONS
from tests.engine.test_logits_process import reference_process
from tests.helpers import byte_tokenizer, run_all
from tests.scenarios import Recorder

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


def _grammar(schema=SCHEMA) -> str:
    return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)


@pytest.fixture(scope="module")
def tiny():
    """The tiny random model with a byte-level tokenizer of its 512 ids: the grammar engine builds
    masks for it as for any tokenizer (the served tests use the embedded model's)."""
    return LoadedModel(tiny_random_model(0), byte_tokenizer(), "tiny")


def _engine(tiny, **kw) -> Engine:
    return Engine(EngineConfig(model="tiny-random", max_rows=8, kv_cache_bytes=1 << 24, **kw), tiny)


@pytest.mark.parametrize("layout", ["eager", "static-overlap"])
def test_grammar_row_leaves_free_rows_unchanged(tiny, layout):
    """7 free rows (greedy and seeded sampling) give the same tokens alone and beside a grammar
    row (greedy or sampled), and the grammar rows' replies are valid JSON for the schema, ended by
    the grammar (stop) well before max_tokens; on eager steps, and on static steps launched ahead."""
    kw = {} if layout == "eager" else {"decode_graphs": True, "overlap_steps": True}
    engine = _engine(tiny, **kw)  # stateless requests: each run leaves it as it found it
    tok = tiny.tokenizer
    prompts = ["The capital of France is", "Once upon a time", "def fib(n):", "Roses are red,",
               "1, 2, 3,", "The weather today", "My favourite food"]
    free = [Request(f"f{i}", tok(p)["input_ids"],
                    SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0 if i % 2 else 0.9, seed=i))
            for i, p in enumerate(prompts)]
    alone = run_all(engine, free)
    ask = tok("A user record as JSON:")["input_ids"]
    ended = []
    engine_step = engine.step

    def step():  # the grammar row's last output, for its finish reason
        got = engine_step()
        ended.extend(o for o in got if o.request_id == "g" and o.finished)
        return got
    engine.step = step
    grammar_rows = [SamplingParams(max_tokens=40, grammar=_grammar()),
                    SamplingParams(max_tokens=40, grammar=_grammar(), temperature=0.8, seed=5)]
    for params in grammar_rows:
        crowd = run_all(engine, [Request("g", ask, params), *free])
        engine.check_invariants()
        assert {k: v for k, v in crowd.items() if k != "g"} == alone
        reply = json.loads(tok.decode(crowd["g"], skip_special_tokens=True))
        jsonschema.validate(reply, SCHEMA)
        assert ended.pop().finish_reason.value == "stop" and len(crowd["g"]) < 40


@pytest.mark.parametrize("policy,late", [("s5", False), ("native", False), ("s5", True)])
def test_grammar_rows_launch_ahead_and_equal_the_plain_order(tiny, policy, late, monkeypatch):
    """Grammar rows (greedy, sampled, with penalties and logprobs; stateless and on sessions)
    beside free rows keep steps launched ahead: nearly every step while they decode has one in
    flight with a grammar row in it. Every request's tokens, logprobs and finish reason equal the
    plain order's, and a session whose grammar ended a step before the host knew has its extra
    step undone: its row equals the plain order's. `late`: the grammar engine is at times slower
    than the device (every other step's masks take 50 ms; the device counts as done 20 ms after
    the host starts waiting for them), so grammar rows sit those steps out while the others go
    on, and come back, launched ahead again where their masks were quick: the same tokens
    again."""
    if late:
        from engine.core.ahead import AheadSteps
        from engine.core.structured import Grammars

        monkeypatch.setattr(AheadSteps, "_behind", staticmethod(lambda fetch: True))
        monkeypatch.setattr(AheadSteps, "_device_idle", staticmethod(lambda fetch: time.sleep(0.02) or True))
        fill = Grammars.step_masks
        calls = itertools.count()

        def slow(self, grammars, skip):
            if next(calls) % 2:
                time.sleep(0.05)
            return fill(self, grammars, skip)
        monkeypatch.setattr(Grammars, "step_masks", slow)

    def make(overlap):
        return Engine(EngineConfig(model="tiny-random", max_rows=8, kv_cache_bytes=1 << 24, kv_policy=policy,
                                   kv_sink=2, kv_window=5, decode_graphs=True, overlap_steps=overlap), tiny)

    tok = tiny.tokenizer
    ask = tok("A user record as JSON:")["input_ids"]
    regex = LLMatcher.grammar_from_regex("[a-z]{3,9} (yes|no)")

    def requests(sids):
        return [Request("g0", ask, SamplingParams(max_tokens=40, grammar=_grammar())),
                Request("g1", ask, SamplingParams(max_tokens=40, grammar=_grammar(), temperature=0.8, seed=5,
                                                  logprobs=2, presence_penalty=0.5), session_id=sids[0]),
                Request("g2", tok("Answer:")["input_ids"], SamplingParams(max_tokens=20, grammar=regex),
                        session_id=sids[1]),
                *[Request(f"f{i}", tok(p)["input_ids"], SamplingParams(max_tokens=12, ignore_eos=True,
                                                                       temperature=0.0 if i % 2 else 0.9, seed=i))
                  for i, p in enumerate(["Once upon a time", "def fib(n):", "Roses are red,"])]]

    runs = {}
    for overlap in (False, True):
        engine = make(overlap)
        sids = [engine.create_session(), engine.create_session()]
        for r in requests(sids):
            engine.add_request(r)
        got, ahead_with_grammar, sat_out = defaultdict(lambda: [[], [], None]), 0, 0
        while engine.has_work():
            for o in engine.step():
                assert o.error is None, o.error
                got[o.request_id][0] += o.new_token_ids
                got[o.request_id][1] += [round(lp[0], 4) for lp in o.logprobs or []]
                if o.finished:
                    got[o.request_id][2] = o.finish_reason
            pending = engine.ahead.pending if engine.ahead is not None else None
            ahead_with_grammar += pending is not None and any(lv.grammar is not None for lv in pending.lives)
            sat_out += pending is not None and bool(engine.ahead.late)
            engine.check_invariants()
        runs[overlap] = (dict(got), [engine.pool.contents(engine.sessions[s].row) for s in sids],
                         ahead_with_grammar, sat_out)
    (plain, plain_rows, _, _), (ahead, ahead_rows, launched, sat_out) = runs[False], runs[True]
    assert ahead == plain
    assert all(plain[g][2].value == "stop" and len(plain[g][0]) < 40 for g in ("g0", "g1", "g2"))
    assert launched >= (2 if late else 8)  # the grammar rows ran on steps launched ahead
    assert (sat_out >= 4) if late else (sat_out == 0)  # and, with a slow grammar engine, sat steps out
    for a, b in zip(plain_rows, ahead_rows):
        assert a[:2] == b[:2]  # length and ring positions
        assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a[2] + a[3], b[2] + b[3]))


def test_bad_grammar_changes_nothing(tiny):
    engine = _engine(tiny)
    bad = LLMatcher.grammar_from_json_schema(json.dumps({"type": "nonsense"}))
    with pytest.raises(EngineError) as err:
        engine.add_request(Request("bad", [2, 3, 4], SamplingParams(max_tokens=4, grammar=bad)))
    assert err.value.param == "response_format" and "nonsense" in err.value.message
    assert not engine.has_work()
    engine.check_invariants()
    ids = tiny.tokenizer("Answer:")["input_ids"]
    out = run_all(engine, [Request("ok", ids, SamplingParams(max_tokens=3, grammar=LLMatcher.grammar_from_regex("[0-9]{3}")))])
    assert tiny.tokenizer.decode(out["ok"]).isdigit() and len(tiny.tokenizer.decode(out["ok"])) == 3


def _allowed(matcher, vocab: int) -> torch.Tensor:
    """The tokens `matcher` (a RowGrammar) allows next, bit by bit from its mask: [vocab] bool."""
    bits = torch.empty((vocab + 31) // 32, dtype=torch.int32)
    matcher.fill_mask(bits)
    return (((bits.long()[:, None] >> torch.arange(32)) & 1).reshape(-1)[:vocab]).bool()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_grammar_row_with_penalties_and_logprobs(tiny, temperature):
    """A grammar row that also asks for penalties and logprobs: its reply parses under the
    schema, and each token's logprob and top logprobs are the log-softmax of the engine's own
    logits (recorded before sampling) penalized by the reference (penalties first), then masked
    by the grammar (a matcher of the same grammar fed the same tokens); every token is one the
    grammar allows, and a greedy token is the masked argmax. The mask and the penalties both
    change the numbers (the check would see either left out)."""
    engine = _engine(tiny)
    rec = Recorder(engine)
    tok = tiny.tokenizer
    vocab = engine.geometry.vocab_size
    prompt = tok("A user record as JSON:")["input_ids"]
    params = SamplingParams(max_tokens=40, grammar=_grammar(), logprobs=3, presence_penalty=0.8,
                            frequency_penalty=0.5, repetition_penalty=1.3, temperature=temperature, seed=11)
    engine.add_request(Request("g", prompt, params))
    toks, lps, last = [], [], None
    while engine.has_work():
        for o in engine.step():
            assert o.error is None, o.error
            toks += o.new_token_ids
            lps += o.logprobs or []
            last = o
        engine.check_invariants()
    jsonschema.validate(json.loads(tok.decode(toks, skip_special_tokens=True)), SCHEMA)
    assert last.finish_reason.value == "stop" and len(lps) == len(toks) < 40
    reference = engine.grammars.matcher(params.grammar)
    masked_away = penalized = 0
    for i, (t, (lp, top_ids, top_lps)) in enumerate(zip(toks, lps)):
        raw = rec.logits[("g", len(prompt) - 1 + i)]
        x = reference_process(raw, params, prompt, toks[:i], engine.eos_token_ids)
        allowed = _allowed(reference, vocab)
        ref = torch.log_softmax(x.masked_fill(~allowed, -math.inf), dim=-1)
        assert allowed[t], (i, t)
        assert abs(lp - ref[t].item()) < 1e-4, (i, lp, ref[t].item())
        want = torch.topk(ref, 3)
        assert torch.allclose(torch.tensor(top_lps, dtype=torch.float64), want.values, atol=1e-4)
        assert all(ref[u].item() == v or abs(ref[u].item() - v) < 1e-4 for u, v in zip(top_ids, top_lps))
        if temperature == 0.0:
            assert t == int(ref.argmax()) and top_ids[0] == t
        masked_away += int(not allowed[int(x.argmax())])
        unpenalized = torch.log_softmax(raw.double().masked_fill(~allowed, -math.inf), dim=-1)
        penalized += int(abs(unpenalized[t].item() - lp) > 1e-3)
        assert reference.accept(t)
    assert masked_away and penalized


def test_forked_choices_follow_the_grammar_each_on_its_own(tiny):
    """n = 3 with a grammar: the prompt's row and the grammar's matcher are forked after the
    prefill, and choice i gives exactly what a single request with seed + i gives; each parses."""
    engine = _engine(tiny)
    tok = tiny.tokenizer
    prompt = tok("A user record as JSON:")["input_ids"]
    params = SamplingParams(max_tokens=40, grammar=_grammar(), temperature=1.0, seed=21, presence_penalty=0.3)
    alone = run_all(engine, [Request(f"s{i}", prompt, replace(params, seed=21 + i)) for i in range(3)])
    engine.add_request(Request("p", prompt, replace(params, n=3)))
    forked = defaultdict(list)
    while engine.has_work():
        for o in engine.step():
            assert o.error is None, o.error
            forked[o.request_id] += o.new_token_ids
    engine.check_invariants()
    assert sorted(forked) == [fork_id("p", i) for i in range(3)]
    assert len({tuple(v) for v in alone.values()}) > 1  # the seeds give different replies
    for i in range(3):
        assert forked[fork_id("p", i)] == alone[f"s{i}"], i
        jsonschema.validate(json.loads(tok.decode(forked[fork_id("p", i)], skip_special_tokens=True)), SCHEMA)
