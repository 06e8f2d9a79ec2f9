"""The engine's intake of a burst of long prompts: what `Engine.add_request` costs per prompt (the
engine process takes in every queued submission between two steps, so a burst's prompts wait on
it), and its token-id check against the interpreter's loops (a set of the ids' types, min and
max) on the same ids in the same run. Tiny model, CPU.

    python -m bench.intake --prompts 256 --prompt-len 1238 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import timeit
from datetime import date
from pathlib import Path

from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.core.requests import token_ids_type, valid_token_ids
from engine.core.types import Request, SamplingParams


def interpreter_check(ids: list, vocab: int) -> bool:
    """The baseline: the ids' types as a set, then min and max, in the interpreter's C loops."""
    return set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1238)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    engine = Engine(EngineConfig(model="tiny-random", max_rows=a.prompts, max_model_len=4096, kv_cache_bytes=1 << 30))
    vocab = engine.geometry.vocab_size
    per_prompt = []
    for b in range(a.rounds + 1):  # the first burst warms up
        reqs = [Request(f"r{b}-{i}", [(i * 7 + j) % vocab for j in range(a.prompt_len)],
                        SamplingParams(max_tokens=512, ignore_eos=True)) for i in range(a.prompts)]
        t0 = time.perf_counter()
        for r in reqs:
            engine.add_request(r)
        per_prompt.append((time.perf_counter() - t0) / a.prompts)
        for r in reqs:
            engine.abort(r.request_id)
    ids = [(7 + j) % vocab for j in range(a.prompt_len)]
    kind = token_ids_type(vocab)
    assert valid_token_ids(ids, kind) and interpreter_check(ids, vocab)
    n = 2000
    check = min(timeit.repeat(lambda: valid_token_ids(ids, kind), number=n, repeat=5)) / n
    base = min(timeit.repeat(lambda: interpreter_check(ids, vocab), number=n, repeat=5)) / n
    add = statistics.median(per_prompt[1:])
    rows = [{"what": "token-id check (msgspec, one pass)", "us": check * 1e6, "over_interpreter_loops": check / base},
            {"what": "token-id check (interpreter loops, baseline)", "us": base * 1e6, "over_interpreter_loops": 1.0},
            {"what": "add_request, median burst", "us": add * 1e6, "over_interpreter_loops": None}]
    print(f"{a.prompts} prompts of {a.prompt_len} ids, {a.rounds} bursts")
    print(f"{'':46s} {'us per prompt':>14s} {'/ baseline':>11s}")
    for r in rows:
        ratio = f"{r['over_interpreter_loops']:.2f}" if r["over_interpreter_loops"] is not None else "-"
        print(f"{r['what']:46s} {r['us']:14.1f} {ratio:>11s}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"intake-cpu-{date.today().isoformat()}.json"
    path.write_text(json.dumps({"bench": "intake", "prompts": a.prompts, "prompt_len": a.prompt_len,
                                "bursts_us": [x * 1e6 for x in per_prompt[1:]], "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
