"""Where a decode step's time goes on CUDA: engine step (host wall), graph replay (device time),
and the kernels of one static decode forward (count and the top ones by device time).

    python -m bench.profile_decode --shape gemma3-1b --n 1 64
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.throughput import SHAPES, prompts_for, shape_models
from engine import Engine, EngineConfig, Request, SamplingParams
from engine.model_loader import LoadedModel


def profile(loaded, n: int, policy: str, prompt_len: int) -> None:
    cfg = EngineConfig(model="bench", device="cuda", kv_policy=policy, max_rows=n, max_num_batched_tokens=4096,
                       kv_cache_bytes=max(2 << 30, n * (64 << 20)))
    engine = Engine(cfg, loaded)
    for i, p in enumerate(prompts_for(None, loaded.model.config.vocab_size, n, prompt_len)):
        engine.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=400, ignore_eos=True)))
    dec = engine.runner.decoder
    while dec.steps == 0:  # prefill, until the first decode-only step
        engine.step()
    for _ in range(5):
        engine.step()
    before = dec.steps
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        engine.step()
    host = (time.perf_counter() - t0) / 50
    assert dec.steps - before == 50, "steps did not take the graph path"
    size = next(b for b in dec.batches if b >= n)
    g = dec.graphs[size]
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(50):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    replay = e0.elapsed_time(e1) / 50 / 1000
    from torch.profiler import ProfilerActivity, profile as tprof

    with torch.inference_mode(), tprof(activities=[ProfilerActivity.CUDA]) as prof:
        dec._forward(dec.batches[size])
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels) / 1000
    print(f"\nN={n} {policy}: engine step {host * 1e3:.2f} ms, graph replay {replay * 1e3:.2f} ms, "
          f"eager forward {len(kernels)} kernels, {total:.2f} ms of kernel time")
    by = {}
    for e in kernels:
        c, t = by.get(e.name, (0, 0.0))
        by[e.name] = (c + 1, t + e.device_time / 1000)
    for name, (c, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:24]:
        print(f"  {t:7.3f} ms {c:5d}x  {name[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gemma3-1b")
    ap.add_argument("--n", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--policies", nargs="+", default=["s5"])
    ap.add_argument("--prompt-len", type=int, default=1238)
    a = ap.parse_args()
    model, _ = shape_models(a.shape, "cuda", torch.bfloat16)
    loaded = LoadedModel(model, None, a.shape)
    for n in a.n:
        for policy in a.policies:
            profile(loaded, n, policy, a.prompt_len)


if __name__ == "__main__":
    main()
