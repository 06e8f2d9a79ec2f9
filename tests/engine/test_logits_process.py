"""Logprobs, penalties, logit_bias and min_tokens: the engine's numbers against references written
here from the definitions (OpenAI's penalties, HF/vLLM's repetition penalty) on the logits the
engine recorded; plain rows untouched by rows that ask; the same with steps launched ahead."""

import math
import random

import pytest
import torch

from engine import Engine, EngineConfig, EngineError, Request, SamplingParams
from engine.runner.logits_process import RowLogitsState, process
from tests.helpers import tiny_loaded
from tests.scenarios import OVERLAP_BASE, Recorder, engines

VOCAB = 512  # the tiny random model's


def reference_process(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                      stop_ids: set[int]) -> torch.Tensor:
    """One row's processed logits, element by element, from the definitions."""
    x = logits.double().clone()
    for t, b in params.logit_bias:
        x[t] += b
    if len(output) < params.min_tokens:
        for t in stop_ids | set(params.stop_token_ids):
            x[t] = -math.inf
    r = params.repetition_penalty
    for t in set(prompt) | set(output):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return x


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        max_tokens=20, presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 2.0)]),
        logit_bias=tuple((t, rng.uniform(-100, 100)) for t in rng.sample(range(VOCAB), rng.randrange(0, 4))),
        min_tokens=rng.choice([0, 3]), stop_token_ids=(7,))


def test_penalties_and_bias_against_the_reference_on_random_logits():
    """`process` over a batch of rows, each with its own params and history, equals the
    element-wise reference; `record` keeps the history the reference is given."""
    rng = random.Random(0)
    torch.manual_seed(0)
    stop_ids = {1}
    for trial in range(20):
        params = [random_params(rng) for _ in range(5)]
        params = [p if p.processed else SamplingParams(max_tokens=20, presence_penalty=0.5) for p in params]
        prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))] for _ in params]
        outputs = [[rng.randrange(40) for _ in range(rng.randrange(0, 8))] for _ in params]
        states = [RowLogitsState(p, pr, VOCAB, torch.device("cpu"), stop_ids) for p, pr in zip(params, prompts)]
        for s, out in zip(states, outputs):
            for t in out:
                s.record(torch.tensor([t]))
        logits = torch.randn(len(params), VOCAB) * 4
        got = process(logits, states)
        for i, p in enumerate(params):
            want = reference_process(logits[i], p, prompts[i], outputs[i], stop_ids)
            assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), trial
            fin = torch.isfinite(want)
            assert (got[i][fin].double() - want[fin]).abs().max() < 1e-4, (trial, i, p)


def run(engine, requests):
    for r in requests:
        engine.add_request(r)
    toks = {r.request_id: [] for r in requests}
    lps = {r.request_id: [] for r in requests}
    while engine.has_work():
        for o in engine.step():
            assert o.error is None, o.error
            toks[o.request_id] += o.new_token_ids
            lps[o.request_id] += o.logprobs or []
        engine.check_invariants()
    return toks, lps


ASKING = {
    "lp-greedy": SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5),
    "lp-sampled": SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3, temperature=0.9, seed=5, top_k=40),
    "pen-greedy": SamplingParams(max_tokens=12, ignore_eos=True, logprobs=4, frequency_penalty=1.2,
                                 presence_penalty=0.4, repetition_penalty=1.5, logit_bias=((9, 3.0), (25, -2.0))),
    "pen-sampled": SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0, temperature=1.1, seed=9,
                                  frequency_penalty=-0.5, repetition_penalty=0.8, min_tokens=4, stop_token_ids=(25,)),
}
PROMPTS = {"lp-greedy": [5, 6, 7], "lp-sampled": [11, 12], "pen-greedy": [5, 6, 7, 25, 25], "pen-sampled": [40, 41, 42]}


def test_logprobs_are_the_log_softmax_of_the_logits_the_engine_sampled_from():
    """Every token's logprob and top logprobs equal a log-softmax of the engine's own logits (as
    recorded before sampling) after the reference processing, to 1e-4; a greedy token is the
    top logprob; a processed greedy row picks the reference's argmax."""
    engine = Engine(EngineConfig(**OVERLAP_BASE, kv_policy="s5"), tiny_loaded(0))
    rec = Recorder(engine)
    reqs = [Request(rid, PROMPTS[rid], p) for rid, p in ASKING.items()]
    reqs.append(Request("plain", [5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True)))
    toks, lps = run(engine, reqs)
    assert lps["plain"] == []
    checked = 0
    for rid, params in ASKING.items():
        prompt = PROMPTS[rid]
        assert len(lps[rid]) == len(toks[rid]) == 12
        for i, (tok, (lp, top_ids, top_lps)) in enumerate(zip(toks[rid], lps[rid])):
            raw = rec.logits[(rid, len(prompt) - 1 + i)]
            x = reference_process(raw, params, prompt, toks[rid][:i], engine.eos_token_ids) if params.processed \
                else raw.double()
            ref = torch.log_softmax(x, dim=-1)
            assert abs(lp - ref[tok].item()) < 1e-4 or (lp == -math.inf and ref[tok] == -math.inf)
            assert len(top_ids) == params.logprobs and len(top_lps) == params.logprobs
            want_top = torch.topk(ref, params.logprobs)
            assert torch.allclose(torch.tensor(top_lps, dtype=torch.float64), want_top.values, atol=1e-4)
            assert all(abs(ref[t].item() - v) < 1e-4 for t, v in zip(top_ids, top_lps))
            if params.greedy:
                assert tok == int(x.argmax())
                if top_ids:
                    assert top_ids[0] == tok and top_lps[0] == lp
            if rid == "pen-sampled" and i < params.min_tokens:
                assert tok not in engine.eos_token_ids | {25}
            checked += 1
    assert checked == 48
    assert toks["plain"] == toks["lp-greedy"]  # logprobs change nothing about the tokens


@pytest.mark.parametrize("overlap", [False, True])
def test_plain_rows_are_unchanged_beside_rows_that_ask(overlap):
    """Plain greedy and sampled rows give the same tokens alone and batched with rows that ask
    for logprobs, penalties and biases (and the rows that ask give theirs, alone or batched)."""
    def fresh():
        return Engine(EngineConfig(**OVERLAP_BASE, kv_policy="s5", overlap_steps=overlap), tiny_loaded(0))

    plain = [Request("g", [5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True)),
             Request("s", [8, 9], SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=3))]
    asking = [Request(rid, PROMPTS[rid], p) for rid, p in ASKING.items()]
    alone, _ = run(fresh(), plain)
    asked_alone = run(fresh(), asking)
    mixed = fresh()
    together, lps = run(mixed, plain + asking)
    assert (mixed.ahead is not None) == overlap
    assert {k: together[k] for k in alone} == alone
    assert {k: together[k] for k in asked_alone[0]} == asked_alone[0]
    for rid in ASKING:
        assert [a[1] for a in lps[rid]] == [a[1] for a in asked_alone[1][rid]]
        assert max(abs(a[0] - b[0]) for a, b in zip(lps[rid], asked_alone[1][rid])) < 1e-4
    # a penalty changes the tokens (else these tests would prove nothing)
    assert together["pen-greedy"] != together["g"]


@pytest.mark.parametrize("policy", ["s5", "native"])
def test_asking_rows_the_same_launched_ahead(policy):
    """Steps launched ahead of the host pick the same tokens, with the same logprobs, for rows
    with penalties, biases, min_tokens and logprobs as the plain order of steps."""
    plain, ahead = engines(policy)
    reqs = lambda: [Request(rid, PROMPTS[rid], p) for rid, p in ASKING.items()]  # noqa: E731
    want, want_lp = run(plain, reqs())
    got, got_lp = run(ahead, reqs())
    assert got == want
    for rid in ASKING:
        assert [x[1] for x in got_lp[rid]] == [x[1] for x in want_lp[rid]]
        assert max(abs(a[0] - b[0]) for a, b in zip(got_lp[rid], want_lp[rid])) < 1e-5
    assert ahead.stats["steps"] == plain.stats["steps"]


def test_logit_bias_forces_and_bans_tokens_and_min_tokens_holds_eos_back():
    engine = Engine(EngineConfig(**OVERLAP_BASE, kv_policy="s5"), tiny_loaded(0))
    free, _ = run(engine, [Request("free", [5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True))])
    top = free["free"][0]
    toks, _ = run(engine, [
        Request("forced", [5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True, logit_bias=((321, 100.0),))),
        Request("forced-sampled", [5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0,
                                                            seed=1, logit_bias=((321, 100.0),))),
        Request("banned", [5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True,
                                                    logit_bias=tuple((t, -100.0) for t in set(free["free"])))),
        # the free run's first token ends this one at once, unless min_tokens holds it back
        Request("stops", [5, 6, 7], SamplingParams(max_tokens=10, stop_token_ids=(top,))),
        Request("held", [5, 6, 7], SamplingParams(max_tokens=10, stop_token_ids=(top,), min_tokens=4)),
    ])
    assert toks["forced"] == toks["forced-sampled"] == [321] * 10
    assert not set(toks["banned"]) & set(free["free"]) and len(toks["banned"]) == 10
    assert toks["stops"] == [top]
    assert len(toks["held"]) > 4 and top not in toks["held"][:4]
    assert engine.pool.used_rows() == []


def test_bad_parameters_are_refused_with_their_name_and_change_nothing():
    engine = Engine(EngineConfig(**OVERLAP_BASE, kv_policy="s5"), tiny_loaded(0))
    sid = engine.create_session()
    bad = [(dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"),
           (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
           (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(logit_bias=((3, 101.0),)), "logit_bias"),
           (dict(logit_bias=((VOCAB, 1.0),)), "logit_bias"), (dict(logit_bias=((-1, 1.0),)), "logit_bias"),
           (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=9), "min_tokens"), (dict(n=0), "n"),
           (dict(n=9), "n")]  # more completions than the pool's 8 rows
    for kw, param in bad:
        with pytest.raises(EngineError) as err:
            engine.add_request(Request("bad", [5, 6], SamplingParams(max_tokens=8, **kw)))
        assert err.value.param == param, kw
    with pytest.raises(EngineError) as err:
        engine.add_request(Request("bad", [5, 6], SamplingParams(max_tokens=8, n=2), session_id=sid))
    assert err.value.param == "n"
    assert not engine.has_work() and engine.pool.used_rows() == []
    assert engine.session_info(sid)["history_tokens"] == 0
    engine.check_invariants()
