"""The engine process's own cost: N rows decoded by the engine in this process
(`bench.throughput.run_engine`) against the same prompts through the engine process, driven by an
`EngineClient` with no HTTP in between, alternating for `--rounds` rounds. Decode tok/s counts
the tokens that arrive while every row decodes (from the last row's first token to the first
row's last), as `bench.throughput` and `bench.serve` do.

    python -m bench.process_overhead --n 32 --new-tokens 192 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

from bench.serve import engine_settings
from bench.throughput import run_engine
from engine import EngineConfig, Request, SamplingParams
from engine.client import EngineClient
from engine.model.loader import load_model


async def through_process(cfg: EngineConfig, prompts: list[list[int]], new_tokens: int) -> dict:
    client = EngineClient(cfg)
    await client.start()
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    arrivals: dict[int, list[float]] = {}

    async def one(i: int, prompt: list[int]) -> None:
        stream = await client.generate(Request(f"p{i}", prompt, params))
        times: list[float] = []
        async for delta in stream:
            times += [delta.arrived] * len(delta.token_ids)
        arrivals[i] = times

    t0 = time.monotonic()
    try:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await client.shutdown()
    start = max(t[0] for t in arrivals.values())
    end = min(t[-1] for t in arrivals.values())
    tokens = sum(sum(1 for x in t if start <= x <= end) for t in arrivals.values())
    return {"decode_tok_s": tokens / (end - start), "ttft_s": sum(t[0] - t0 for t in arrivals.values()) / len(prompts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--quantization", default="int8")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=1238)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    quant = None if a.quantization in ("none", "") else a.quantization
    settings = {k: v for k, v in engine_settings(argparse.Namespace(device="cpu", max_batched_tokens=None,
                                                                    max_decode_stall_ms=None), a.n).items()
                if v is not None}
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 200000) for _ in range(a.prompt_len)] for _ in range(a.n)]
    loaded = load_model(EngineConfig(model=a.model, quantization=quant))
    run_engine(loaded, "s5", prompts[:2], 8, "cpu", **settings)  # warm-up, as the process warms itself up
    cfg = EngineConfig(model=a.model, quantization=quant, **settings)
    rounds = []
    for k in range(a.rounds):
        alone = run_engine(loaded, "s5", prompts, a.new_tokens, "cpu", **settings)
        proc = asyncio.run(through_process(cfg, prompts, a.new_tokens))
        rounds.append({"in_process_decode_tok_s": alone["decode_tok_s"], "in_process_ttft_s": alone["ttft_s"],
                       "process_decode_tok_s": proc["decode_tok_s"], "process_ttft_s": proc["ttft_s"],
                       "ratio": proc["decode_tok_s"] / alone["decode_tok_s"]})
        r = rounds[-1]
        print(f"round {k + 1}: in process {r['in_process_decode_tok_s']:.1f} tok/s, engine process "
              f"{r['process_decode_tok_s']:.1f} ({r['ratio']:.3f}); TTFT {r['in_process_ttft_s']:.1f} / "
              f"{r['process_ttft_s']:.1f} s", flush=True)
    out = Path(a.out) / f"process-overhead-cpu-{a.model}-n{a.n}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"n": a.n, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                               "settings": settings, "rounds": rounds}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
