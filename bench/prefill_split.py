"""How far a prompt prefilled in two turns of a session is from the same prompt prefilled at once.

A session turn (or a request that reuses a session's prefix) prefills only its new tokens,
attending the ones already in the row; a stateless request prefills the whole prompt in one
forward. Mathematically the two compute the same thing; in floating point the sums run in
another order. This measures the gap on the embedded model: the prompt's first k tokens are
appended to a session (max_tokens 0), the rest is the next turn, and each greedy step's logits
are compared with the one-forward request's, for every split point k.

    python -m bench.prefill_split                      # int8 (as served on the CPU) and float32

Prints a table of the largest |logit difference| per generated token and writes
bench/results/prefill-split-cpu-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", default="Once upon a time there was a")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--weights", nargs="+", default=["int8", "float32"], choices=["int8", "float32"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    from engine import Engine, EngineConfig, Request, SamplingParams
    from engine.model.loader import load_model

    result = {"prompt": a.prompt, "new_tokens": a.new_tokens, "weights": {}}
    for weights in a.weights:
        cfg = EngineConfig(model="embedded", quantization="int8" if weights == "int8" else None, max_rows=4,
                           kv_cache_bytes=64 << 20)
        loaded = load_model(cfg)
        engine = Engine(cfg, loaded)
        ids = loaded.tokenizer(a.prompt)["input_ids"]
        logits: dict[str, list[torch.Tensor]] = {}
        engine.logits_hook = lambda rid, pos, row: logits.setdefault(rid, []).append(row.float().clone())
        params = SamplingParams(max_tokens=a.new_tokens, ignore_eos=True)

        def run(request):
            engine.add_request(request)
            while engine.has_work():
                engine.step()

        run(Request("whole", ids, params))
        rows, tokens_differ = [], []
        for k in range(2, len(ids)):
            sid = engine.create_session()
            run(Request(f"head{k}", ids[:k], SamplingParams(max_tokens=0), sid))
            run(Request(f"split{k}", ids[k:], params, sid))
            gaps = [(w - s).abs().max().item() for w, s in zip(logits["whole"], logits[f"split{k}"])]
            same = [int(w.argmax()) == int(s.argmax()) for w, s in zip(logits["whole"], logits[f"split{k}"])]
            rows.append({"split_at": k, "max_abs_logit_gap": gaps, "same_greedy_token": same})
            tokens_differ.append(not all(same))
            print(f"{weights:8s} split at {k:2d}: " + " ".join(f"{g:8.1e}" for g in gaps)
                  + ("" if all(same) else "   (a greedy token differs)"))
        result["weights"][weights] = rows
    path = Path(a.out) if a.out else (Path(__file__).parent / "results"
                                      / f"prefill-split-cpu-{datetime.date.today().isoformat()}.json")
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
