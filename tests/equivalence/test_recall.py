"""Passkey recall with the embedded model: s5 recalls every case native recalls; the control
(sink+window on every layer) loses most of them, so this test can fail."""

import pytest

from engine import Engine, EngineConfig, Request
from engine.model_loader import LoadedModel
from engine.passkey import passkey_cases
from tests.helpers import greedy, run_all

pytestmark = pytest.mark.slow


def recall(embedded, policy, cases):
    cfg = EngineConfig(model="embedded", kv_policy=policy, max_num_batched_tokens=512, max_rows=8)
    engine = Engine(cfg, LoadedModel(embedded.model, embedded.tokenizer, "embedded"))
    reqs = [Request(f"c{i}", p, greedy(7)) for i, (p, _) in enumerate(cases)]
    out = run_all(engine, reqs)
    engine.check_invariants()
    hits = []
    for i, (_, key) in enumerate(cases):
        text = embedded.tokenizer.decode(out[f"c{i}"])
        hits.append(str(key) in text)
    return hits


@pytest.mark.parametrize("length", [500, 1500])
def test_passkey_recall(embedded, length):
    cases = passkey_cases(embedded.tokenizer, length, 8)
    native = recall(embedded, "native", cases)
    s5 = recall(embedded, "s5", cases)
    control = recall(embedded, "sink-window", cases)
    print(f"\n~{length} tokens: native {sum(native)}/8, s5 {sum(s5)}/8, sink+window everywhere {sum(control)}/8")
    assert sum(native) >= 5, "the model itself should recall most keys"
    assert all(s or not n for s, n in zip(s5, native)), "s5 lost a key that native recalled"
    assert sum(control) <= 2, "the control should lose most keys"
