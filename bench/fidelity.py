"""The fidelity frontier of restored-S5: text quality against KV bytes per session, per window.

On the served weights (`--quantization int8` on the CPU by default); docs/fidelity.md gives the
commands behind each result.

`--ppl`: decode-regime perplexity (bench/fidelity_core.py) of native and of s5 at each window of
`--windows`; each sliding layer's perplexity with only its window changed (to each of
`--sens-windows`, the others exact or at `--base-window`), written as the model's window profile
(engine/kv/windows.py) beside the converted model and to bench/results/; the per-layer windows
solved from it for each budget of `--budgets`; then the prefill regime of each setting.
`--extend FILE` keeps an earlier run's measurements and measures only what it lacks.

`--heldout N`: the same settings on N documents the profile was not measured on.

`--checks`: per setting, greedy agreement with native, the needle grid and multi-turn recall
(bench/recall.py's). `--report`: the frontier table, JSON and a PNG of quality against KV bytes
per session (at 1k, 4k and 16k tokens).

    python -m bench.fidelity --ppl --docs 32 --base-window 160 --sens-windows 64 128 256 512
    python -m bench.fidelity --report
    python -m bench.fidelity --quick                        # CI: the shipped default's perplexity
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bench import recall
from bench.fidelity_core import SCORED, Scorer, corpus_docs, profile_and_heldout
from engine import EngineConfig
from engine.kv.windows import WindowProfile, profile_path, solve_windows
from engine.model.hf_adapter import geometry
from engine.model.loader import load_model

WINDOWS = (16, 32, 64, 128, 256)
CONTEXTS = (1024, 4096, 16384)


def scorer_model(a) -> tuple[object, object]:
    """The served weights as a stock transformers model with sdpa attention (the engine's own
    model object has the engine's attention installed). Int8 weights run every product on the
    int8 kernel, as the engine does: each scored token gets the numbers a decode step computes
    for it, since the kernel's rows do not depend on each other (engine/model/quant.py)."""
    loaded = load_model(EngineConfig(model=a.model, quantization=a.quant))
    model = loaded.model
    model.set_attn_implementation("sdpa")
    return model, loaded.tokenizer


def model_dir(a) -> Path:
    from engine.model.source import embedded_dir

    return embedded_dir() if a.model == "embedded" else Path(a.model)


def bounded_windows(layer_types: list[str], window: int | dict[int, int] | None, policy: str = "s5") -> list:
    """Per layer, the window of a bounded layer (None: exact) for a uniform or per-layer setting."""
    if window is None:
        return [None] * len(layer_types)
    if policy == "sink-window":
        return [window] * len(layer_types)
    pick = window.get if isinstance(window, dict) else (lambda i: window)
    return [pick(i) if kind == "sliding_attention" else None for i, kind in enumerate(layer_types)]


def perplexities(a) -> dict:
    """Native, uniform windows (both regimes), per-layer sensitivity, and the allocations solved
    from it for each budget (both regimes). Writes the profile and the results as they come."""
    model, tok = scorer_model(a)
    scorer = Scorer(model, profile_and_heldout(tok, recall.corpus_text(), a.docs, a.heldout)[0], sink=a.sink)
    types = scorer.layer_types
    g = geometry(model)
    t0 = time.perf_counter()
    res: dict = {"docs": a.docs, "scored_tokens": len(scorer.docs) * (SCORED - 1), "sink": a.sink,
                 "native_window": g.native_window, "uniform": {}, "sensitivity": {}, "allocations": {}}
    out = Path(a.out) / f"fidelity-ppl-{a.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.extend:  # an earlier run's measurements on the same documents, around the same window
        res = extended(a, g.native_window)
        res["allocations"] = {}

    def note(msg: str) -> None:
        out.write_text(json.dumps(res, indent=1))
        print(f"{msg}  ({time.perf_counter() - t0:.0f} s)", flush=True)

    # decode regime first (it decides the allocation), then the prefill regime of every setting
    if "native" not in res:
        res["native"] = {"decode": scorer.ppl(bounded_windows(types, None))}
        note(f"native decode: {res['native']['decode']:.3f}")
    first = [w for w in a.windows if w >= min(a.sens_windows) or w == a.base_window]  # what the allocation may choose
    for w in first:
        if w not in res["uniform"]:
            res["uniform"][w] = {"decode": scorer.ppl(bounded_windows(types, w))}
            note(f"s5 window {w} decode: {res['uniform'][w]['decode']:.3f}")
    base = bounded_windows(types, a.base_window)  # the other layers' windows while one changes
    res["base_window"] = a.base_window
    around = f"the others at {a.base_window}" if a.base_window else "the others exact"
    for w in a.sens_windows:
        for i in scorer.sliding_layers():
            if w in res["sensitivity"].get(i, {}):
                continue
            windows = list(base)
            windows[i] = w if w < g.native_window else None
            res["sensitivity"].setdefault(i, {})[w] = scorer.ppl(windows)
            note(f"  layer {i:>2} at window {w}, {around}: {res['sensitivity'][i][w]:.3f}")
    profile = WindowProfile(model=a.model, weights=a.quant or "float32", sink=a.sink, native_window=g.native_window,
                            native_ppl=res["native"]["decode"], layer_ppl=res["sensitivity"],
                            uniform_ppl={w: r["decode"] for w, r in res["uniform"].items()},
                            scored_tokens=res["scored_tokens"], base_window=a.base_window,
                            base_ppl=res["uniform"][a.base_window]["decode"] if a.base_window else None)
    for path in (profile_path(model_dir(a)), Path(a.out) / f"fidelity-profile-{a.tag}.json"):
        profile.save(path)
        print(f"wrote {path}")
    position_bytes = {i: 2 * h * d * 4 for i, (h, d) in enumerate(g.kv_shapes)}  # float32 K/V
    native_bytes = sum(g.native_window * position_bytes[i] for i in scorer.sliding_layers())
    for frac in a.budgets:
        solved = solve_windows(profile.cost(), position_bytes, a.sink, g.native_window, int(native_bytes * frac))
        if solved is not None:
            windows = [solved[i] for i in sorted(solved)]
            res["allocations"][frac] = {"windows": windows, "decode": scorer.ppl(bounded_windows(types, solved))}
            note(f"allocation within {frac:.3f} of native's sliding bytes {windows}: {res['allocations'][frac]}")
    for w in a.windows:
        if w not in res["uniform"]:
            res["uniform"][w] = {"decode": scorer.ppl(bounded_windows(types, w))}
            note(f"s5 window {w} decode: {res['uniform'][w]['decode']:.3f}")
    if a.control:
        res["control"] = {"decode": scorer.ppl(bounded_windows(types, 64, "sink-window"))}
        note(f"control (sink-window 64) decode: {res['control']['decode']:.3f}")
    if not a.no_prefill:
        res["native"]["prefill"] = scorer.ppl(bounded_windows(types, None), "prefill")
        note(f"native prefill: {res['native']['prefill']:.3f}")
        for w in a.windows:
            res["uniform"][w]["prefill"] = scorer.ppl(bounded_windows(types, w), "prefill")
            note(f"s5 window {w} prefill: {res['uniform'][w]['prefill']:.3f}")
        for frac, al in res["allocations"].items():
            al["prefill"] = scorer.ppl(bounded_windows(types, dict(zip(scorer.sliding_layers(), al["windows"]))), "prefill")
            note(f"allocation {frac:.3f} prefill: {al['prefill']:.3f}")
        if a.control:
            res["control"]["prefill"] = scorer.ppl(bounded_windows(types, 64, "sink-window"), "prefill")
            note(f"control prefill: {res['control']['prefill']:.3f}")
    return res


def extended(a, native_window: int) -> dict:
    """`--extend FILE`: an earlier `--ppl` result (its keys back to numbers), checked to be on the
    same documents, sink and base window, so that a run measures only what it lacks."""
    old = json.loads(Path(a.extend).read_text())
    same = (old["docs"], old["sink"], old["native_window"], old.get("base_window")) == (
        a.docs, a.sink, native_window, a.base_window)
    if not same:
        raise SystemExit(f"--extend {a.extend}: measured on other documents, sink or base window")
    old["uniform"] = {int(w): r for w, r in old["uniform"].items()}
    old["sensitivity"] = {int(i): {int(w): p for w, p in ws.items()} for i, ws in old["sensitivity"].items()}
    return old


def heldout(a) -> dict:
    """Decode- and prefill-regime perplexity of native, the uniform windows and the solved
    allocations (from fidelity-ppl-*.json) on documents the profile was not measured on: the
    allocation is chosen on the profile's document, so it is judged on others."""
    ppl = json.loads((Path(a.out) / f"fidelity-ppl-{a.tag}.json").read_text())
    model, tok = scorer_model(a)
    docs = profile_and_heldout(tok, recall.corpus_text(), ppl["docs"], a.heldout)[1]
    scorer = Scorer(model, docs, sink=a.sink)
    types = scorer.layer_types
    settings = {"native": None, **({} if a.skip_uniform else {f"s5-w{w}": int(w) for w in a.windows}),
                **({} if a.no_alloc else {f"alloc-{float(f):.3f}": dict(zip(scorer.sliding_layers(), al["windows"]))
                                          for f, al in ppl["allocations"].items()})}
    res = {"docs": len(docs), "scored_tokens": len(docs) * (SCORED - 1), "ppl": {}}
    out = Path(a.out) / f"fidelity-heldout-{a.tag}{a.part}.json"
    t0 = time.perf_counter()
    for regime in a.regimes:
        for name, w in settings.items():
            res["ppl"].setdefault(name, {})[regime] = scorer.ppl(bounded_windows(types, w), regime)
            out.write_text(json.dumps(res, indent=1))
            print(f"{name} {regime}: {res['ppl'][name][regime]:.3f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return res


QUICK_REFERENCE = Path(__file__).parent / "results" / "fidelity-quick-cpu.json"
# A rise over the reference that fails the check, per weights. Float32 perplexity is the same on
# every x86 CPU to 1e-5 (AVX2 and AVX-512 paths of torch alike), so 1% is a regression of the
# KV policy or the model code. The int8 weights quantize every activation: a last-bit difference
# in a float op upstream flips some roundings, and the same code reads up to 1.5% apart on CPUs
# whose float paths differ; 3% holds that and fails a real regression of the int8 path.
QUICK_TOLERANCE = {"float32": 0.01, "int8": 0.03}


def quick(a) -> int:
    """The CI check: decode-regime perplexity of the shipped default (and of each setting the
    reference file lists) on the corpus's first document, on float32 and on the served int8
    weights, against the values measured when the file was written; fails on a rise of more than
    QUICK_TOLERANCE. `--write-reference` records the values."""
    ref = json.loads(QUICK_REFERENCE.read_text()) if QUICK_REFERENCE.is_file() else {"weights": {}}
    default = {"default": {"kv_window": EngineConfig.kv_window}}
    bad = []
    for weights, tolerance in QUICK_TOLERANCE.items():
        a.quant = None if weights == "float32" else weights
        model, tok = scorer_model(a)
        scorer = Scorer(model, corpus_docs(tok, recall.corpus_text(), 1), sink=EngineConfig.kv_sink)
        types = scorer.layer_types
        settings = ref["weights"].get(weights) or default
        got = {}
        for name, s in settings.items():
            per_layer = dict(zip(scorer.sliding_layers(), s["kv_windows"])) if "kv_windows" in s else s["kv_window"]
            got[name] = scorer.ppl(bounded_windows(types, per_layer))
            want = s.get("decode_ppl")
            print(f"{weights} {name}: decode perplexity {got[name]:.4f}" + (f" (measured {want:.4f})" if want else ""))
            if want is not None and got[name] > want * (1 + tolerance):
                bad.append(f"{weights} {name}: {got[name]:.4f} > {want:.4f} + {tolerance:.0%}")
        if a.write_reference:
            ref["weights"][weights] = {n: {**settings[n], "decode_ppl": got[n]} for n in settings}
        del model, scorer
    if a.write_reference:
        ref["note"] = "decode-regime perplexity on the corpus's first document (bench/fidelity.py --quick)"
        QUICK_REFERENCE.write_text(json.dumps(ref, indent=1))
        print(f"wrote {QUICK_REFERENCE}")
    if bad:
        print("FAIL: perplexity rose by more than its tolerance:\n  " + "\n  ".join(bad))
        return 1
    return 0


def budget_settings(a, names: list[str]) -> dict[str, dict]:
    """The settings among `names` given as `budget-<size>` (`budget-5M`): the windows the engine
    solves for `--kv-budget <size>` from the model's window profile, K/V in float32 as on the CPU."""
    sizes = {n: n[len("budget-"):] for n in names if n.startswith("budget-")}
    if not sizes:
        return {}
    from engine.kv.windows import budget_windows
    from service.settings import parse_bytes

    loaded = load_model(EngineConfig(model=a.model, quantization=a.quant))
    geo = geometry(loaded.model)
    return {n: dict(kv_policy="s5", kv_windows=budget_windows(
        EngineConfig(model=a.model, quantization=a.quant, kv_policy="s5", kv_budget=parse_bytes(size)),
        loaded.name, geo, 4)) for n, size in sizes.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ppl", action="store_true", help="perplexities, sensitivity, profile, allocations")
    ap.add_argument("--sens-windows", type=int, nargs="+", default=[64],
                    help="windows at which each sliding layer alone is bounded (the native window: "
                         "exact; around the exact model the profile scales other windows by the "
                         "curve of every layer bounded together)")
    ap.add_argument("--base-window", type=int, default=None,
                    help="measure each layer's windows with every other sliding layer at this window "
                         "(default: exact), the operating point the allocation is made around")
    ap.add_argument("--extend", metavar="FILE", default=None,
                    help="--ppl: keep the measurements of this earlier result (same documents, sink and base "
                         "window) and measure only the windows it lacks")
    ap.add_argument("--budgets", type=float, nargs="+", default=[1 / 2, 1 / 3, 1 / 4],
                    help="per-layer allocations within these fractions of native's sliding-layer bytes")
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill regime")
    ap.add_argument("--heldout", type=int, default=0, help="score settings on this many other documents")
    ap.add_argument("--regimes", nargs="+", default=["decode", "prefill"])
    ap.add_argument("--checks", action="store_true", help="agreement, needles, multi-turn per setting")
    ap.add_argument("--report", action="store_true", help="the frontier table, JSON and plot")
    ap.add_argument("--settings", nargs="+", help="settings for --checks (default: all; see fidelity_report; "
                    "s5-w<N>: one window, budget-<size>: the windows --kv-budget <size> solves)")
    ap.add_argument("--lengths", type=int, nargs="*", default=[1024, 4096, 8192])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.25, 0.75])
    ap.add_argument("--cases", type=int, default=2)
    ap.add_argument("--gaps", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--agreement-prompts", type=int, default=8)
    ap.add_argument("--agreement-tokens", type=int, default=64)
    ap.add_argument("--skip-uniform", action="store_true", help="--heldout: native and the allocations only")
    ap.add_argument("--no-alloc", action="store_true", help="--heldout: native and the uniform windows only")
    ap.add_argument("--prompt-cache", help="directory keeping prompts' exact forwards for later --checks runs")
    ap.add_argument("--part", default="", help="--checks writes fidelity-checks-<tag><part>.json (the report merges all)")
    ap.add_argument("--quick", action="store_true", help="CI: the shipped settings' perplexity against the reference")
    ap.add_argument("--write-reference", action="store_true", help="with --quick: record the values measured")
    ap.add_argument("--control", action="store_true", help="also the control (sink+window 64 on every layer)")
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--quantization", default="int8", help="weights: int8 or none")
    ap.add_argument("--sink", type=int, default=EngineConfig.kv_sink)
    ap.add_argument("--windows", type=int, nargs="+", default=list(WINDOWS))
    ap.add_argument("--docs", type=int, default=2, help="corpus documents scored (255 tokens each)")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    a.quant = None if a.quantization in ("none", "None", "") else a.quantization
    a.tag = f"cpu-{a.quant or 'float32'}"
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if a.quick:
        return quick(a)
    if a.ppl:
        perplexities(a)
    if a.heldout:
        heldout(a)
    if a.checks:
        from bench.fidelity_report import checks, setting_configs

        path = Path(a.out) / f"fidelity-ppl-{a.tag}.json"
        ppl = json.loads(path.read_text()) if path.is_file() else {
            "uniform": {w: {} for w in a.windows}, "allocations": {}, "native_window": 512}
        configs = setting_configs(ppl)
        names = a.settings or list(configs)
        configs.update(budget_settings(a, [n for n in names if n not in configs]))
        configs.update({n: dict(kv_policy="s5", kv_window=int(n[4:])) for n in names if n not in configs})
        checks(a, ["native", *[n for n in names if n != "native"]], configs)
    if a.report:
        from bench.fidelity_report import report

        report(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
