"""Where a decode step's time goes on CUDA: engine step (host wall), graph replay (device time),
and the kernels of one static decode forward (count and the top ones by device time). With
`--prefill`: the wall time of each prefill step of N prompts arriving together, and the top
host-side ops and kernels of two of those steps.

    python -m bench.profile_decode --shape gemma3-1b --n 1 64
    python -m bench.profile_decode --shape gemma3-4b --n 8 --prefill --policies s5 native
    python -m bench.profile_decode --shape gemma4-26b-a4b --weights bnb-4bit --n 1 8
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.throughput import SHAPES, prompts_for, shape_models
from engine import Engine, EngineConfig, Request, SamplingParams
from engine.model.loader import LoadedModel


def started_engine(loaded, n: int, policy: str, prompt_len: int, batched_tokens: int, max_tokens: int) -> Engine:
    """An engine on the device with n prompts queued."""
    cfg = EngineConfig(model="bench", device="cuda", kv_policy=policy, max_rows=n,
                       max_num_batched_tokens=batched_tokens, kv_cache_bytes=max(2 << 30, n * (64 << 20)))
    engine = Engine(cfg, loaded)
    for i, p in enumerate(prompts_for(None, loaded.model.config.vocab_size, n, prompt_len)):
        engine.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    return engine


def profile(loaded, n: int, policy: str, prompt_len: int) -> None:
    engine = started_engine(loaded, n, policy, prompt_len, batched_tokens=4096, max_tokens=400)
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
    for name, (c, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:32]:
        print(f"  {t:7.3f} ms {c:5d}x  {name[:110]}")


def profile_prefill(loaded, n: int, policy: str, prompt_len: int) -> None:
    from torch.profiler import ProfilerActivity, profile as tprof

    engine = started_engine(loaded, n, policy, prompt_len, batched_tokens=2048, max_tokens=2)
    walls = []
    prof = None
    while engine.has_work():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if len(walls) == 2:
            with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.step()
                engine.step()
                torch.cuda.synchronize()
            walls += [(time.perf_counter() - t0) / 2] * 2
            continue
        engine.step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    print(f"\nprefill N={n} {policy}: {len(walls)} steps, {sum(walls):.2f} s; per step (s): "
          + " ".join(f"{w:.3f}" for w in walls[:12]))
    if prof is not None:
        avg = prof.key_averages()
        print("  top host ops (self CPU ms over 2 steps):")
        for e in sorted(avg, key=lambda e: -e.self_cpu_time_total)[:14]:
            print(f"  {e.self_cpu_time_total / 1e3:9.2f} ms {e.count:6d}x  {e.key[:100]}")
        print("  top kernels (device ms over 2 steps):")
        for e in sorted(avg, key=lambda e: -getattr(e, "self_device_time_total", 0))[:10]:
            print(f"  {getattr(e, 'self_device_time_total', 0) / 1e3:9.2f} ms {e.count:6d}x  {e.key[:100]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gemma3-1b")
    ap.add_argument("--n", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--policies", nargs="+", default=["s5"])
    ap.add_argument("--prompt-len", type=int, default=1238)
    ap.add_argument("--prefill", action="store_true", help="profile the prefill steps instead")
    ap.add_argument("--weights", choices=["bfloat16", "bnb-4bit"], default="bfloat16",
                    help="bnb-4bit: the decoder's linears and experts in NF4, as the loader quantizes them")
    a = ap.parse_args()
    model, _ = shape_models(a.shape, "cuda", torch.bfloat16, with_hf=False)
    if a.weights == "bnb-4bit":
        from engine.model.loader import quantize_bnb4

        model = quantize_bnb4(model, torch.bfloat16)
    loaded = LoadedModel(model, None, a.shape)
    for n in a.n:
        for policy in a.policies:
            (profile_prefill if a.prefill else profile)(loaded, n, policy, a.prompt_len)


if __name__ == "__main__":
    main()
