"""Logits processing, logprobs, forks and grammar masks on a CUDA device (skipped without one),
inside captured decode graphs with steps launched ahead: the same numbers as the references the
CPU tests use, and the same tokens as steps applied in order."""

import json
import math
import time
from dataclasses import replace

import pytest
import torch

from engine import Engine, EngineConfig, Request, SamplingParams
from engine.core.types import fork_id
from engine.model.loader import LoadedModel
from tests.engine import test_forks
from tests.engine.test_logits_process import ASKING, PROMPTS, reference_process, run
from tests.helpers import byte_tokenizer, tiny_loaded
from tests.scenarios import OVERLAP_BASE, Recorder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PLAIN = Request("plain", [5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True))


def cuda_engine(overlap: bool, graphs: bool = True, tokenizer=None) -> Engine:
    loaded = tiny_loaded(0)
    loaded.model.cuda()
    cfg = EngineConfig(**{**OVERLAP_BASE, "decode_graphs": graphs}, kv_policy="s5", device="cuda",
                       overlap_steps=overlap)
    return Engine(cfg, LoadedModel(loaded.model, tokenizer, "tiny"))


def asking() -> list[Request]:
    return [Request(rid, PROMPTS[rid], p) for rid, p in ASKING.items()] + [replace(PLAIN)]


def test_cuda_logprobs_and_penalties_equal_the_reference():
    """On the device: each token's logprob and top logprobs equal a log-softmax of the engine's
    own logits after the reference processing (penalties, logit_bias, min_tokens), to 1e-4."""
    engine = cuda_engine(overlap=False, graphs=False)
    rec = Recorder(engine)
    toks, lps = run(engine, asking())
    checked = 0
    for rid, params in ASKING.items():
        prompt = PROMPTS[rid]
        for i, (tok, (lp, top_ids, top_lps)) in enumerate(zip(toks[rid], lps[rid])):
            raw = rec.logits[(rid, len(prompt) - 1 + i)].cpu()
            x = reference_process(raw, params, prompt, toks[rid][:i], engine.eos_token_ids) if params.processed \
                else raw.double()
            ref = torch.log_softmax(x, dim=-1)
            assert abs(lp - ref[tok].item()) < 1e-4 or (lp == -math.inf and ref[tok] == -math.inf)
            assert torch.allclose(torch.tensor(top_lps, dtype=torch.float64), torch.topk(ref, len(top_ids)).values,
                                  atol=1e-4)
            if params.greedy:
                assert tok == int(x.argmax())
            checked += 1
    assert checked == 48


def test_cuda_graphs_launched_ahead_pick_what_plain_steps_pick():
    """Rows asking for logprobs, penalties and biases, beside a plain row: captured graphs with
    steps launched ahead give the tokens of eager steps applied in order (logprobs to 1e-4), and
    the greedy rows give the CPU engine's tokens."""
    want, want_lp = run(cuda_engine(overlap=False, graphs=False), asking())
    fast = cuda_engine(overlap=True)
    got, got_lp = run(fast, asking())
    assert fast.ahead is not None and fast.runner.decoder.graphs
    assert got == want
    for rid in ASKING:
        assert [x[1] for x in got_lp[rid]] == [x[1] for x in want_lp[rid]]
        assert max(abs(a[0] - b[0]) for a, b in zip(got_lp[rid], want_lp[rid])) < 1e-4
    cpu, _ = run(Engine(EngineConfig(**OVERLAP_BASE, kv_policy="s5"), tiny_loaded(0)), asking())
    for rid in ("lp-greedy", "pen-greedy", "plain"):
        assert got[rid] == cpu[rid], rid


def test_cuda_forked_choices_equal_single_seeded_requests():
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=40, logprobs=2,
                            frequency_penalty=0.5)
    prompt = [5 + i % 400 for i in range(90)]
    engine = cuda_engine(overlap=True)
    toks, _, _ = test_forks.run(engine, [Request("p", prompt, replace(params, n=3)), replace(PLAIN)])
    want, _, _ = test_forks.run(cuda_engine(overlap=True), [Request(f"s{i}", prompt, replace(params, seed=40 + i))
                                               for i in range(3)])
    assert [toks[fork_id("p", i)] for i in range(3)] == [want[f"s{i}"] for i in range(3)]
    assert len({tuple(v) for v in want.values()}) == 3
    assert engine.stats["prefill_tokens"] == len(prompt) + 3 and engine.pool.used_rows() == []


def test_cuda_grammar_rows_inside_graphs_leave_free_rows_unchanged():
    """A grammar row (greedy and sampled) beside 6 free rows, with captured graphs and steps
    launched ahead: the free rows' tokens equal theirs alone, the grammar row's reply parses with
    the schema's keys and types and is ended by the grammar before max_tokens, and every row's
    tokens equal those of steps applied in order (the grammar row ran launched ahead)."""
    from llguidance import LLMatcher

    from service.structured import JSON_OPTIONS

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    tok = byte_tokenizer()
    engine = cuda_engine(overlap=True, tokenizer=tok)
    free = [Request(f"f{i}", [5 + i, 6, 7 + i], SamplingParams(max_tokens=10, ignore_eos=True,
                                                                temperature=0.0 if i % 2 else 0.9, seed=i))
            for i in range(6)]
    alone, _ = run(engine, [replace(r) for r in free])
    for params in (SamplingParams(max_tokens=60, grammar=grammar),
                   SamplingParams(max_tokens=60, grammar=grammar, temperature=0.8, seed=5, logprobs=2)):
        batch = [Request("g", tok("{")["input_ids"], params), *free]
        got, _ = run(engine, [replace(r) for r in batch])
        assert {k: v for k, v in got.items() if k != "g"} == alone
        plain, _ = run(cuda_engine(overlap=False, tokenizer=tok), [replace(r) for r in batch])
        assert plain == got
        assert len(got["g"]) < 60
        reply = json.loads(tok.decode(got["g"], skip_special_tokens=True))
        assert set(reply) == {"name", "ok"} and isinstance(reply["name"], str) and isinstance(reply["ok"], bool)
        assert len(reply["name"]) <= 8
    assert engine.pool.used_rows() == []


def test_cuda_greedy_grammar_rows_take_the_one_kernel_pick(monkeypatch):
    """Greedy grammar rows beside greedy free rows (JSON mode) are picked by the one-kernel masked
    argmax in steps launched ahead; every row's tokens equal those of steps applied in order,
    and equal again where the grammar engine is slow and the grammar rows sit steps out."""
    from llguidance import LLMatcher

    from engine.runner import model_runner
    from service.structured import JSON_OPTIONS

    calls = []
    kernel = model_runner.masked_greedy
    monkeypatch.setattr(model_runner, "masked_greedy", lambda *a: calls.append(1) or kernel(*a))
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    tok = byte_tokenizer()
    batch = [Request("g", tok("{")["input_ids"], SamplingParams(max_tokens=60, grammar=grammar)),
             Request("h", tok("A record:")["input_ids"], SamplingParams(max_tokens=60, grammar=grammar)),
             *[Request(f"f{i}", [5 + i, 6, 7 + i], SamplingParams(max_tokens=10, ignore_eos=True)) for i in range(5)]]
    got, _ = run(cuda_engine(overlap=True, tokenizer=tok), [replace(r) for r in batch])
    assert calls
    plain, _ = run(cuda_engine(overlap=False, tokenizer=tok), [replace(r) for r in batch])
    assert plain == got
    from engine.core.ahead import AheadSteps
    from engine.core.structured import Grammars

    fill = Grammars.step_masks
    monkeypatch.setattr(Grammars, "step_masks", lambda self, *a: time.sleep(0.005) or fill(self, *a))
    late = []
    settle = AheadSteps._advance_late
    monkeypatch.setattr(AheadSteps, "_advance_late", lambda self, *a, **k: late.append(len(self.late)) or settle(self, *a, **k))
    slow, _ = run(cuda_engine(overlap=True, tokenizer=tok), [replace(r) for r in batch])
    assert slow == plain and max(late) > 0
    for g in ("g", "h"):
        assert set(json.loads(tok.decode(got[g], skip_special_tokens=True))) == {"name", "ok"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_masked_greedy_kernel_equals_mask_then_argmax(dtype):
    """The one-kernel masked argmax against the mask then torch's argmax: the first of equal
    maxima, an all-banned row and a row with an allowed NaN flagged not finite."""
    from engine.runner.sampler import greedy_tokens
    from engine.runner.token_mask import apply_bitmask_, masked_greedy

    vocab, n = 262_144 + 7, 6
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(n, vocab, generator=g).to(dtype)
    bitmask = torch.randint(-(1 << 31), (1 << 31) - 1, (4, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    rows = [4, 1, 3, 0]
    bitmask[2] = 0  # row 3: everything banned
    bitmask[0, 5000 // 32] |= 1 << (5000 % 32)
    bitmask[0, 9000 // 32] |= 1 << (9000 % 32)
    logits[4, 5000] = logits[4, 9000] = 50.0  # a tie on row 4: the first wins
    bitmask[3, 700 // 32] |= 1 << (700 % 32)
    logits[0, 700] = float("nan")  # row 0: an allowed NaN
    x = logits.float().clone()
    apply_bitmask_(x, rows, bitmask)
    want = greedy_tokens(x)
    got = masked_greedy(logits.cuda(), rows, bitmask).cpu()
    assert got.shape == (2, 4)
    assert got[0, 0] == 5000 and got[1, 0] == 1
    assert got[0, 1] == want[0, 1] and got[1, 1] == 1
    assert got[1, 2] == 0 and want[1, 3] == 0
    assert got[1, 3] == 0 and want[1, 0] == 0


def test_cuda_bitmask_equals_the_cpus():
    """The device's kernel bans, in place and in the masked rows only, exactly the tokens the
    host's unpacking bans (and the device's unpacking agrees too)."""
    from engine.runner.token_mask import apply_bitmask_, masked

    vocab = 262_144 + 7  # a spare-bit tail in the last word
    g = torch.Generator().manual_seed(3)
    bitmask = torch.randint(-(1 << 31), (1 << 31) - 1, (3, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    logits = torch.randn(5, vocab, generator=g)
    rows = [4, 0, 2]
    want = logits.clone()
    want[rows] = masked(logits[rows], bitmask)
    got = logits.cuda()
    assert apply_bitmask_(got, rows, bitmask) is got
    assert torch.equal(got.cpu(), want)
    assert torch.equal(masked(logits[rows].cuda(), bitmask).cpu(), want[rows])


def test_cuda_asking_picks_never_wait_for_the_device():
    """The picks of a step launched ahead (sampling with top-k and top-p, penalties, logprobs, a
    grammar's mask) queue behind the forward without a host sync: under torch's sync debug mode
    set to error, a synchronizing call (a pageable copy to the device, an .item()) would raise."""
    from engine.runner.logits_process import RowLogitsState

    engine = cuda_engine(overlap=True)
    vocab = engine.geometry.vocab_size
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=1),
              SamplingParams(temperature=0.0, presence_penalty=0.5, repetition_penalty=1.2, logprobs=3),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.1, seed=4, frequency_penalty=0.3)]
    dev = torch.device("cuda")
    states = [RowLogitsState(p, [5, 6, 7], vocab, dev, set()) if p.processed else None for p in params]
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    logits = torch.randn(4, vocab, device=dev)
    greedy = torch.stack((logits.argmax(-1), torch.ones(4, dtype=torch.long, device=dev)))
    bits = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    bits[0, 2] = 0b110  # tokens 65 and 66
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fetch = engine.runner.fetch_picks(logits, greedy, params, generators, states, skip={1})
        masked = engine.runner.pick_masked(logits, [1], [params[1]], [generators[1]], [states[1]], bits, lanes=[1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens, finite = fetch.result()
    assert all(finite) and tokens[2] == int(greedy[0, 2])
    (token,), (ok,) = masked.result()
    assert ok and token in (65, 66) and int(engine.runner.decoder.last[1]) == token
