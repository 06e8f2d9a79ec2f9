"""`python -m bench.fidelity --quick` on float32 and on the served weights (int8): the
decode-regime perplexity of the shipped default (window 64) and of the recommended per-layer
allocation, on the corpus's first document, must stay within 1% (float32) and 3% (int8: its
activation rounding moves with the CPU's float paths) of the values measured when the reference
file was written (bench/results/fidelity-quick-cpu.json). About a minute on 2 cores."""

import json

import pytest
from transformers import AutoConfig

from bench import fidelity
from engine import EngineConfig
from engine.kv.windows import budget_windows
from engine.model.hf_adapter import geometry
from engine.model.source import EMBEDDED_NAME

# its own threads keep both cores busy: run alone, after the tests that run in parallel (Makefile: test)
pytestmark = [pytest.mark.slow, pytest.mark.serial]


class _Shape:  # geometry() reads a model's config and generation config only
    def __init__(self, cfg):
        self.config = self.generation_config = cfg


def test_fidelity_quick(embedded_dir, capsys):
    ref = json.loads(fidelity.QUICK_REFERENCE.read_text())
    assert set(ref["weights"]) == set(fidelity.QUICK_TOLERANCE) == {"float32", "int8"}
    for settings in ref["weights"].values():
        assert {"default", "budget"} <= set(settings), "the reference covers the default and the budget"
        assert all(s["decode_ppl"] > 1 for s in settings.values())
        assert settings["default"]["kv_window"] == EngineConfig.kv_window
    # the budget's windows are what the engine solves for it from the shipped profile
    budget = ref["weights"]["int8"]["budget"]
    assert {k: v for k, v in ref["weights"]["float32"]["budget"].items() if k != "decode_ppl"} == \
        {k: v for k, v in budget.items() if k != "decode_ppl"}
    geo = geometry(_Shape(AutoConfig.from_pretrained(str(embedded_dir))))
    assert list(budget_windows(EngineConfig(kv_budget=budget["kv_budget"]), EMBEDDED_NAME, geo, 4)) == budget["kv_windows"]
    code = fidelity.main(["--quick"])
    out = capsys.readouterr().out
    print(out)
    assert code == 0, out
    assert out.count("decode perplexity") == sum(len(s) for s in ref["weights"].values())
