"""The engine process's own cost: N rows decoded by the engine in this process
(`bench.throughput.run_engine`) against the same prompts through the engine process, driven by an
`EngineClient` with no HTTP in between, alternating for `--rounds` rounds. Decode tok/s counts
the tokens that arrive while every row decodes (from the last row's first token to the first
row's last), as `bench.throughput` and `bench.serve` do (the process side through
`bench.serve.summarize` itself).

    python -m bench.process_overhead --n 32 --new-tokens 192 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

from bench.serve import engine_settings, summarize
from bench.throughput import run_engine
from engine import EngineConfig, Request, SamplingParams
from engine.client import EngineClient
from engine.model.loader import load_model


async def through_process(cfg: EngineConfig, prompts: list[list[int]], new_tokens: int) -> dict:
    """The prompts through the engine process, all at once; each stream's deltas in the form
    `bench.serve.summarize` reads (arrival time, tokens), so the decode window is the same."""
    client = EngineClient(cfg)
    await client.start()
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    t0 = time.monotonic()

    async def one(i: int, prompt: list[int]) -> dict:
        stream = await client.generate(Request(f"p{i}", prompt, params))
        return {"sent": t0, "error": None, "chunks": [(d.arrived, len(d.token_ids)) async for d in stream if d.token_ids]}

    try:
        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await client.shutdown()
    summary = summarize(results, slo_ttft=float("inf"), slo_tpot=float("inf"))
    return {"decode_tok_s": summary["decode_tok_s"], "ttft_s": summary["ttft_s"]["mean"]}


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
    loaded = load_model(EngineConfig(model=a.model, quantization=quant))
    vocab = loaded.model.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(min(1000, vocab // 2), min(200000, vocab)) for _ in range(a.prompt_len)]
               for _ in range(a.n)]
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
