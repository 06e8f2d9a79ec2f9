"""Per-layer windows refined on combined measurements: a local search around an allocation.

`bench.fidelity --ppl` solves per-layer windows from a window profile, each layer's effect
measured with the others at one base window; the effects of several layers changed together do
not quite add up. This search starts from an allocation (`--start`, one window per sliding
layer) and, per round, measures the decode-regime perplexity (bench/fidelity_core.py) with each
layer moved one step of GRID up and down while the others keep the current windows, solves the
windows within `--limit` sliding positions (sink + window per layer) on those local
measurements (engine/kv/windows.py's knapsack), and keeps the solution if its measured
perplexity is lower, else the best measured single exchange (one layer up, one down) that fits.
The result is then scored on the held-out documents, beside the starting allocation.

    python -m bench.fidelity_refine --start 256 512 128 128 128 64 64 128 160 128 256 160 160 64 160
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from bench import recall
from bench.fidelity import bounded_windows, scorer_model
from bench.fidelity_core import Scorer, profile_and_heldout
from engine import EngineConfig
from engine.kv.windows import solve_windows

GRID = (32, 64, 96, 128, 160, 192, 256, 320, 384, 512)  # 512: the native window (exact)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--start", type=int, nargs="+", required=True, help="a window per sliding layer (of GRID)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--limit", type=int, default=2560, help="sliding positions kept (sink + window, summed)")
    ap.add_argument("--docs", type=int, default=32, help="profile documents, and as many held out")
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--quantization", default="int8")
    ap.add_argument("--sink", type=int, default=EngineConfig.kv_sink)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="cpu-int8")
    a = ap.parse_args()
    a.quant = None if a.quantization in ("none", "") else a.quantization
    model, tok = scorer_model(a)
    profile_docs, heldout_docs = profile_and_heldout(tok, recall.corpus_text(), a.docs, a.docs)
    scorer = Scorer(model, profile_docs, sink=a.sink)
    types, layers = scorer.layer_types, scorer.sliding_layers()
    native_window = scorer.native_window
    if len(a.start) != len(layers) or any(w not in GRID for w in a.start):
        ap.error(f"--start: {len(layers)} windows, each one of {GRID}")
    out = Path(a.out) / f"fidelity-refine-{a.tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    res: dict = {"docs": a.docs, "sink": a.sink, "limit": a.limit, "start": a.start, "evals": [], "rounds": []}
    t0 = time.perf_counter()

    def per_layer(ws) -> list:
        return bounded_windows(types, {i: (w if w < native_window else None) for i, w in zip(layers, ws)})

    measured: dict[tuple, float] = {}

    def ppl(ws: list[int]) -> float:
        if tuple(ws) not in measured:
            measured[tuple(ws)] = scorer.ppl(per_layer(ws))
            res["evals"].append({"windows": ws, "ppl": measured[tuple(ws)]})
            out.write_text(json.dumps(res, indent=1))
            print(f"{ws} positions {sum(a.sink + w for w in ws)}: {measured[tuple(ws)]:.3f}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        return measured[tuple(ws)]

    res["native"] = scorer.ppl(bounded_windows(types, None))
    cur = list(a.start)
    best = ppl(cur)
    for r in range(a.rounds):
        cost: dict[int, dict[int, float]] = {}  # layer -> window -> change of log perplexity, the others at cur
        for k, i in enumerate(layers):
            g = GRID.index(cur[k])
            cost[i] = {cur[k]: 0.0}
            for step in (g - 1, g + 1):
                if 0 <= step < len(GRID):
                    ws = list(cur)
                    ws[k] = GRID[step]
                    cost[i][GRID[step]] = math.log(ppl(ws)) - math.log(best)
        solved = solve_windows(cost, {i: 1 for i in layers}, a.sink, native_window, a.limit)
        candidates = [[solved[i] for i in layers]] if solved else []
        exchanges = []  # one layer a step up, another a step down, within the limit
        for ki, i in enumerate(layers):
            for kj, j in enumerate(layers):
                for wu, cu in cost[i].items():
                    for wd, cd in cost[j].items():
                        if i != j and wu > cur[ki] and wd < cur[kj]:
                            ws = list(cur)
                            ws[ki], ws[kj] = wu, wd
                            if sum(a.sink + w for w in ws) <= a.limit and cu + cd < 0:
                                exchanges.append((cu + cd, ws))
        candidates += [ws for _, ws in sorted(exchanges)[:3]]
        for ws in candidates:
            if ppl(ws) < best:
                cur, best = ws, ppl(ws)
                break
        res["rounds"].append({"windows": cur, "ppl": best})
        print(f"round {r + 1}: {cur} {best:.3f} ({best / res['native'] - 1:+.2%} against native)", flush=True)
    held = Scorer(model, heldout_docs, sink=a.sink)
    res["heldout"] = {"native": held.ppl(bounded_windows(types, None)), "start": held.ppl(per_layer(a.start)),
                      "refined": held.ppl(per_layer(cur))}
    res["windows"], res["ppl"] = cur, best
    out.write_text(json.dumps(res, indent=1))
    h = res["heldout"]
    print(f"held-out: native {h['native']:.3f}, start {h['start']:.3f} ({h['start'] / h['native'] - 1:+.2%}), "
          f"refined {h['refined']:.3f} ({h['refined'] / h['native'] - 1:+.2%})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
