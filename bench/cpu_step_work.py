"""CPU time per decode step on the CPU path: the engine's fused layer forward against the stock
transformers layers, on the same int8 (or float32) weights, one thread, alternated in one run.

Wall-clock rates on a CPU shared with other work move with that work; the CPU time a decode step
costs this process on one thread moves far less, so this states what the fused forward saves per
token as work, beside the wall time it took (equal to it on an idle machine).

    python -m bench.cpu_step_work [--weights int8] [--n 1 8] [--repeats 3] [--new-tokens 24]

Each (layers, N) cell takes N rows through prefill of `--prompt-len` tokens, then times the decode
steps that follow; the table gives the median over the repeats and fused / stock.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.throughput import write_result
from engine import Engine, EngineConfig, Request, SamplingParams
from engine.model.loader import load_model


def decode_step_cost(loaded, weights: str, fused: bool, n: int, new_tokens: int, prompt_len: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per decode step of `n` rows."""
    cfg = EngineConfig(model="embedded", quantization="int8" if weights == "int8" else "none", max_rows=n,
                       kv_cache_bytes=1 << 28, session_db=None, fused_layers=fused)
    engine = Engine(cfg, loaded)
    for i in range(n):
        prompt = [2] + [(101 + 37 * i + 13 * t) % 20000 + 3 for t in range(prompt_len)]
        engine.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True)))
    produced: set[str] = set()
    while len(produced) < n:  # prefill until every row has its first token
        produced |= {o.request_id for o in engine.step() if o.new_token_ids}
    cpu0, wall0, steps = time.process_time(), time.perf_counter(), 0
    while engine.has_work():
        engine.step()
        steps += 1
    cost = ((time.process_time() - cpu0) / steps, (time.perf_counter() - wall0) / steps)
    engine.close()
    return cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", choices=["int8", "float32"], default="int8")
    ap.add_argument("--n", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(EngineConfig(model="embedded", quantization="int8" if a.weights == "int8" else "none"))
    runs: dict[str, list[tuple[float, float]]] = {}
    for _ in range(a.repeats):
        for n in a.n:
            for fused in (True, False):
                key = f"{n}/{'fused' if fused else 'stock'}"
                runs.setdefault(key, []).append(decode_step_cost(loaded, a.weights, fused, n, a.new_tokens,
                                                                 a.prompt_len))
    rows = []
    print(f"{'N':>3} {'fused cpu ms':>12} {'stock cpu ms':>12} {'fused/stock':>11} {'fused wall ms':>13} "
          f"{'stock wall ms':>13}")
    for n in a.n:
        med = {k: (statistics.median(c for c, _ in runs[f"{n}/{k}"]), statistics.median(w for _, w in runs[f"{n}/{k}"]))
               for k in ("fused", "stock")}
        ratio = med["fused"][0] / med["stock"][0]
        rows.append({"n": n, "fused_cpu_s": med["fused"][0], "stock_cpu_s": med["stock"][0], "fused_over_stock": ratio,
                     "fused_wall_s": med["fused"][1], "stock_wall_s": med["stock"][1],
                     "runs": {k: runs[f"{n}/{k}"] for k in ("fused", "stock")}})
        print(f"{n:>3} {med['fused'][0] * 1e3:>12.1f} {med['stock'][0] * 1e3:>12.1f} {ratio:>11.3f} "
              f"{med['fused'][1] * 1e3:>13.1f} {med['stock'][1] * 1e3:>13.1f}")
    result = {"bench": "cpu_step_work", "weights": a.weights, "threads": 1, "new_tokens": a.new_tokens,
              "prompt_len": a.prompt_len, "repeats": a.repeats, "torch": torch.__version__, "rows": rows}
    write_result(a.out, f"cpu-step-work-embedded-{a.weights}", result, a.tag)


if __name__ == "__main__":
    main()
