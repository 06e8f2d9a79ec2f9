"""A user's first request after the server has started: its TTFT against the next ones'.

Builds the engine on a random-weight BENCH.md shape as `s5serve serve` does, runs the engine
process's warm-up (`engine.process._warm_up`, or the prompt lengths given with --warm-up), then
times prompts of --prompt-len tokens one at a time: the first pays whatever the warm-up left
uncompiled (Triton kernel forms), the later ones are the steady TTFT. Run each setting in a
fresh process with an empty TRITON_CACHE_DIR to see a fresh container's first request:

    TRITON_CACHE_DIR=$(mktemp -d) python -m bench.first_request --shape gemma3-4b --weights bnb-4bit
    TRITON_CACHE_DIR=$(mktemp -d) python -m bench.first_request --shape gemma3-4b --weights bnb-4bit --warm-up 3
    TRITON_CACHE_DIR=$(mktemp -d) python -m bench.first_request --shape gemma4-26b-a4b --warm-up 3 48 49

Prints one line and appends a JSON object to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="gemma3-4b")
    ap.add_argument("--weights", choices=["bf16", "bnb-4bit"], default="bnb-4bit")
    ap.add_argument("--warm-up", type=int, nargs="*", default=None,
                    help="warm-up prompt lengths (default: the engine process's own)")
    ap.add_argument("--prompt-len", type=int, default=1238)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    from bench.throughput import prompts_for, shape_models, source_digest
    from engine import Engine, EngineConfig, Request, SamplingParams
    from engine.model.loader import LoadedModel, quantize_bnb4
    from engine.process import _warm_up, warm_up_lengths

    model, _ = shape_models(a.shape, "cuda", torch.bfloat16, with_hf=False)
    if a.weights == "bnb-4bit":
        model = quantize_bnb4(model, torch.bfloat16)  # in place: nothing else holds it
    loaded = LoadedModel(model, None, a.shape)
    cfg = EngineConfig(model="bench", device="cuda", kv_policy="s5", max_rows=1, kv_cache_bytes=2 << 30,
                       fused_layers=True, nf4_kernels=a.weights == "bnb-4bit")
    t = time.perf_counter()
    engine = Engine(cfg, loaded)
    built = time.perf_counter() - t
    lengths = tuple(a.warm_up) if a.warm_up is not None else warm_up_lengths(engine)
    t = time.perf_counter()
    _warm_up(engine, lengths)
    torch.cuda.synchronize()
    warmed = time.perf_counter() - t
    prompts = prompts_for(None, model.config.vocab_size, a.requests, a.prompt_len)
    ttfts = []
    for i, p in enumerate(prompts):
        t = time.perf_counter()
        engine.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=4, ignore_eos=True)))
        first = None
        while engine.has_work():
            if engine.step() and first is None:
                first = time.perf_counter() - t
        ttfts.append(first)
    row = {"shape": a.shape, "weights": a.weights, "warm_up": list(lengths), "prompt_len": a.prompt_len,
           "engine_build_s": built, "warm_up_s": warmed, "ttft_s": ttfts, "first_over_steady": ttfts[0] / ttfts[-1],
           "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"), "device": torch.cuda.get_device_name(),
           "source_digest": source_digest()}
    print(f"{a.shape} {a.weights} warm-up {list(lengths)}: build {built:.1f} s, warm-up {warmed:.2f} s, TTFT "
          + ", ".join(f"{x * 1e3:.1f}" for x in ttfts) + f" ms (first / last {row['first_over_steady']:.1f}x)",
          flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
