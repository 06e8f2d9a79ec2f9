"""Structured outputs in the engine (engine/core/structured.py): a grammar row's tokens follow
its grammar and end it, the rows beside it are untouched, and a bad grammar changes nothing."""

import json

import jsonschema
import pytest
from llguidance import LLMatcher

from engine import Engine, EngineConfig, EngineError, Request, SamplingParams
from service.structured import JSON_OPTIONS
from tests.helpers import run_all

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


def _grammar(schema=SCHEMA) -> str:
    return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)


def _engine(embedded, **kw) -> Engine:
    return Engine(EngineConfig(model="embedded", max_rows=8, kv_cache_bytes=64 << 20, **kw), embedded)


@pytest.mark.parametrize("layout", ["eager", "static-overlap"])
def test_grammar_row_leaves_free_rows_unchanged(embedded, layout):
    """7 free rows (greedy and seeded sampling) give the same tokens alone and beside a grammar
    row (greedy or sampled), and the grammar rows' replies are valid JSON for the schema, ended by
    the grammar (stop) well before max_tokens. With decode graphs and steps launched ahead, the
    engine falls back to plain steps while the grammar row runs."""
    kw = {} if layout == "eager" else {"decode_graphs": True, "overlap_steps": True}
    engine = _engine(embedded, **kw)  # stateless requests: each run leaves it as it found it
    tok = embedded.tokenizer
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
    grammar_rows = [SamplingParams(max_tokens=40, grammar=_grammar(), temperature=0.8, seed=5)]
    if layout == "eager":
        grammar_rows.insert(0, SamplingParams(max_tokens=40, grammar=_grammar()))
    for params in grammar_rows:
        crowd = run_all(engine, [Request("g", ask, params), *free])
        engine.check_invariants()
        assert {k: v for k, v in crowd.items() if k != "g"} == alone
        reply = json.loads(tok.decode(crowd["g"], skip_special_tokens=True))
        jsonschema.validate(reply, SCHEMA)
        assert ended.pop().finish_reason.value == "stop" and len(crowd["g"]) < 40


def test_bad_grammar_changes_nothing(embedded):
    engine = _engine(embedded)
    bad = LLMatcher.grammar_from_json_schema(json.dumps({"type": "nonsense"}))
    with pytest.raises(EngineError) as err:
        engine.add_request(Request("bad", [2, 3, 4], SamplingParams(max_tokens=4, grammar=bad)))
    assert err.value.param == "response_format" and "nonsense" in err.value.message
    assert not engine.has_work()
    engine.check_invariants()
    ids = embedded.tokenizer("Answer:")["input_ids"]
    out = run_all(engine, [Request("ok", ids, SamplingParams(max_tokens=3, grammar=LLMatcher.grammar_from_regex("[0-9]{3}")))])
    assert embedded.tokenizer.decode(out["ok"]).isdigit() and len(embedded.tokenizer.decode(out["ok"])) == 3
