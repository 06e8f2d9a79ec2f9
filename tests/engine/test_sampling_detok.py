"""Sampling (seeds, top-k, top-p), incremental detokenization, stop strings."""

import pytest
import torch

from engine import Engine, EngineConfig, FinishReason, Request, SamplingParams
from engine.core.types import EngineError
from engine.core.detokenizer import IncrementalDetokenizer
from engine.model.loader import LoadedModel
from engine.runner.sampler import make_generator, sample, sample_batch
from tests.helpers import run_all, tiny_loaded


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([5.0, 4.0, 3.0, 0.0, -1.0])
    seen_k = {sample(logits, SamplingParams(temperature=1.0, top_k=2), make_generator(s)) for s in range(200)}
    assert seen_k == {0, 1}
    probs = torch.softmax(logits, -1)  # p0 ~ 0.66, p0 + p1 ~ 0.90
    seen_p = {sample(logits, SamplingParams(temperature=1.0, top_p=0.8), make_generator(s)) for s in range(300)}
    assert seen_p == {0, 1} and probs[0] < 0.8
    assert sample(logits, SamplingParams(), make_generator(0)) == 0
    with pytest.raises(ValueError):
        sample(torch.tensor([float("nan"), 1.0]), SamplingParams(), make_generator(0))


def test_min_p_cuts_tokens_below_its_share_of_the_top_token_after_temperature():
    """vLLM's min_p: a token is kept when its probability (after temperature) is at least min_p
    times the top token's; rows without it in the same batch keep their whole support."""
    logits = torch.tensor([5.0, 4.0, 3.0, 0.0, -1.0])

    def support(params, n=300):
        return {sample(logits, params, make_generator(s)) for s in range(n)}

    assert support(SamplingParams(temperature=1.0, min_p=0.2)) == {0, 1}  # p1 / p0 = e^-1 = 0.37; p2 / p0 0.14
    assert support(SamplingParams(temperature=2.0, min_p=0.2)) == {0, 1, 2}  # flatter: p2 / p0 = e^-1
    assert support(SamplingParams(temperature=1.5, min_p=1.0)) == {0}
    gens = [make_generator(s) for s in range(600)]
    rows = [SamplingParams(temperature=1.0, min_p=0.5 if i % 2 else 0.0) for i in range(600)]
    tokens, ok = sample_batch(logits.expand(600, 5).contiguous(), rows, gens)
    assert all(ok)
    assert set(tokens[1::2]) == {0} and set(tokens[0::2]) >= {0, 1, 2}
    with pytest.raises(EngineError):
        SamplingParams(min_p=1.5).validate()


def test_seeds_that_differ_only_above_32_bits_draw_apart():
    """The whole 64-bit seed counts (torch's generator alone keeps its low 32 bits)."""
    def draws(seed):
        g = make_generator(seed)
        return [float(torch.rand((), generator=g)) for _ in range(4)]

    assert draws(5) == draws(5)
    for a, b in ((5, 5 + 2**32), (-1, 2**63 - 1), (0, 2**32), (7, 7 - 2**32)):
        assert draws(a) != draws(b), (a, b)


def test_extreme_top_p_and_temperature_sample_the_top_token():
    """A top_p below float32's range (5e-324 is 0 there) keeps the top token instead of none; a
    temperature near 0 is greedy instead of an overflow. Both were server errors (found by the
    API fuzz test)."""
    torch.manual_seed(3)
    logits = torch.randn(4, 50)
    top = logits.argmax(dim=-1).tolist()
    gens = [make_generator(i) for i in range(4)]
    tokens, ok = sample_batch(logits, [SamplingParams(temperature=1.0, top_p=5e-324)] * 4, gens)
    assert all(ok) and tokens == top
    assert SamplingParams(temperature=1e-30).greedy and not SamplingParams(temperature=0.01).greedy
    assert [sample(logits[i], SamplingParams(temperature=1e-30), gens[i]) for i in range(4)] == top


def test_batched_sampling_follows_each_rows_distribution_and_seed():
    """Rows with different temperature / top-k / top-p in one batch: each row's empirical
    frequencies match its own filtered softmax, and a row's token depends only on its own seed."""
    torch.manual_seed(0)
    logits = torch.randn(3, 12) * 2
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=3),
              SamplingParams(temperature=1.0, top_p=0.6)]
    draws = 3000
    counts = torch.zeros(3, 12)
    for s in range(draws):
        tokens, ok = sample_batch(logits, params, [make_generator(s * 3 + i) for i in range(3)])
        assert all(ok)
        for i, t in enumerate(tokens):
            counts[i, t] += 1
    for i, p in enumerate(params):
        x = logits[i] / p.temperature
        if p.top_k:
            x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
        if p.top_p < 1:
            sx, order = torch.sort(x, descending=True)
            pr = torch.softmax(sx, -1)
            sx = sx.masked_fill(torch.cumsum(pr, -1) - pr >= p.top_p, float("-inf"))
            x = torch.full_like(x, float("-inf")).scatter(0, order, sx)
        want = torch.softmax(x, -1)
        freq = counts[i] / draws
        assert bool(((want == 0) <= (freq == 0)).all()), f"row {i} drew a filtered token"
        assert (freq - want).abs().max() < 0.035, (i, freq, want)
    # alone or batched with other rows and params: the same token for the same seed
    for s in range(50):
        alone = sample_batch(logits[1:2], params[1:2], [make_generator(s)])[0][0]
        batched = sample_batch(logits, params, [make_generator(99), make_generator(s), make_generator(7)])[0][1]
        assert alone == batched
    bad = logits.clone()
    bad[2, 4] = float("nan")
    assert sample_batch(bad, params, [make_generator(i) for i in range(3)])[1] == [True, True, False]


def test_same_seed_same_tokens_alone_or_batched():
    cfg = EngineConfig(model="tiny-random", kv_policy="s5", kv_sink=2, kv_window=4, kv_cache_bytes=1 << 22)
    p = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    a = run_all(Engine(cfg, tiny_loaded(0)), [Request("a", [5, 6, 7], p)])["a"]
    others = [Request(f"o{i}", [9, i + 10, 11], SamplingParams(max_tokens=15, temperature=1.0, ignore_eos=True))
              for i in range(5)]
    b = run_all(Engine(cfg, tiny_loaded(0)), [Request("a", [5, 6, 7], p), *others], {"a": 2})["a"]
    c = run_all(Engine(cfg, tiny_loaded(0)), [Request("a", [5, 6, 7], SamplingParams(
        max_tokens=20, temperature=1.0, top_p=0.9, seed=43, ignore_eos=True))])["a"]
    assert a == b and a != c


def test_detokenizer_utf8_and_stop_strings(tokenizer):
    text = "Grüße aus 東京 🚀 and then STOP here"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tokenizer)
    deltas = [d.add(t)[0] for t in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)
    d = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    out, stopped = "", False
    for t in ids:
        delta, stopped = d.add(t)
        out += delta
        if stopped:
            break
    assert stopped and out == "Grüße aus 東京 🚀 and then " and "STOP" not in out


@pytest.mark.slow
def test_engine_stop_string_and_eos(embedded):
    engine = Engine(EngineConfig(model="embedded"), LoadedModel(embedded.model, embedded.tokenizer, "e"))
    ids = embedded.tokenizer("Count: one, two, three, four,")["input_ids"]
    texts = {}
    for rid, params in [("free", SamplingParams(max_tokens=12)), ("stop", SamplingParams(max_tokens=12, stop=(" six",)))]:
        engine.add_request(Request(rid, ids, params))
        out, last = [], None
        while engine.has_work():
            for o in engine.step():
                out += o.new_token_ids
                last = o
        # the engine ends the turn at the token that completes a stop string; the text, made by
        # the front end from the tokens with the same stop strings, ends right before it
        detok = IncrementalDetokenizer(embedded.tokenizer, params.stop)
        text, stopped = detok.add_many(out)
        texts[rid] = (text if stopped else text + detok.flush(), last.finish_reason)
    free, _ = texts["free"]
    assert " six" in free, free
    assert texts["stop"] == (free[: free.index(" six")], FinishReason.STOP)
