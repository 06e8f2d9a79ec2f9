"""Capacity: concurrent sessions that fit one KV budget under each policy, and the aggregate
decode tok/s the engine reaches with the pool full.

For a context length L (prompt + generated tokens), one session takes its bounded layers' ring
slots plus the paged blocks of its exact layers for L positions (the pool's exact accounting).
A budget B admits N = B // that many sessions. The run then fills the pool with N sessions of
L-token prompts and decodes `--new-tokens` each, at most `--max-seqs` rows per step (several
steps per token round when N is larger). Speeds are printed against the bandwidth floor of the
same run: weights read once per step plus every stepped row's resident K/V.

    python -m bench.capacity --shape gemma3-4b --budget-gb 4 --context 1238 8192
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import date
from pathlib import Path

import torch

from bench.throughput import (SHAPES, copy_bandwidth, git_commit, prompts_for, run_engine, shape_models, source_digest,
                              step_weight_bytes)
from engine.core.config import EngineConfig
from engine.model.hf_adapter import geometry
from engine.kv.policy import layer_layouts
from engine.kv.rows import RowPool
from engine.model.loader import LoadedModel


def session_bytes(model, policy: str, length: int, device: str) -> tuple[int, int]:
    """(bytes one session of `length` positions holds, of which paged) under `policy`."""
    c = EngineConfig(kv_policy=policy)
    geo = geometry(model)
    layouts = layer_layouts(policy, geo.layer_types, geo.native_window, c.kv_sink, c.kv_window)
    dtype = next(model.parameters()).dtype
    pool = RowPool(layouts, geo.kv_shapes, dtype, device, num_rows=1,
                   block_size=c.kv_block_size, num_blocks=2)
    paged = pool.blocks_for(length) * pool.block_bytes
    return pool.ring_row_bytes + paged, paged


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gemma3-4b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget-gb", type=float, default=24.0, help="KV bytes for all sessions together (GiB)")
    ap.add_argument("--context", type=int, nargs="+", default=[1238, 8192], help="prompt tokens per session")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--policies", nargs="+", default=["s5", "native"])
    ap.add_argument("--max-seqs", type=int, default=256, help="rows per step")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    model, _ = shape_models(a.shape, a.device, dtype, with_hf=False)
    loaded = LoadedModel(model, None, a.shape)
    budget = int(a.budget_gb * (1 << 30))
    bandwidth, weights = copy_bandwidth(a.device), step_weight_bytes(model)
    rows = []
    print(f"{'context':>7} {'policy':>7} {'B/session':>11} {'sessions':>8} {'decode tok/s':>13} "
          f"{'vs floor':>8} {'TTFT s':>7}", flush=True)
    for ctx in a.context:
        length = ctx + a.new_tokens
        admitted = {}
        for policy in a.policies:
            per, paged = session_bytes(model, policy, length, a.device)
            n = budget // per
            admitted[policy] = n
            if n == 0:
                print(f"{ctx:>7} {policy:>7} {per:>11} {0:>8}  (the budget holds no session)", flush=True)
                continue
            prompts = prompts_for(None, model.config.vocab_size, n, ctx)
            res = run_engine(loaded, policy, prompts, a.new_tokens, a.device, max_rows=n,
                             max_num_seqs=min(n, a.max_seqs), max_num_batched_tokens=8192,
                             kv_cache_bytes=n * paged + (1 << 20))
            seqs = min(n, a.max_seqs)  # rows one step reads
            floor = n / ((-(-n // seqs)) * weights / bandwidth + n * per / bandwidth)
            rows.append({"context": ctx, "policy": policy, "session_bytes": per, "sessions": n, **res,
                         "floor_tok_s": floor})
            rate = res["decode_tok_s"] or res["decode_tail_tok_s"]  # no all-rows window: the tail rate
            print(f"{ctx:>7} {policy:>7} {per:>11} {n:>8} {rate:>13.1f} "
                  f"{rate / floor:>7.3f}x {res['ttft_s']:>7.1f}", flush=True)
        if admitted.get("native") and "s5" in admitted:
            print(f"  {ctx}: s5 admits {admitted['s5'] / admitted['native']:.2f}x the sessions of native", flush=True)
    import transformers

    result = {"bench": "capacity", "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device,
              "shape": a.shape, "dtype": a.dtype, "budget_bytes": budget, "new_tokens": a.new_tokens,
              "max_seqs": a.max_seqs, "copy_bandwidth_bytes_s": bandwidth, "weight_bytes": weights,
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "commit": git_commit(),
                           "engine_source_sha256": source_digest()},
              "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"capacity-{a.device.split(':')[0]}-{a.shape}-{date.today().isoformat()}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
