"""The engine's host work per decode step, without the model.

On a GPU a decode step is one graph replay plus the host's share: taking the sampled tokens,
building each row's output, scheduling the next step, writing its lanes and books. Applied in
order (`--overlap off`), none of that overlaps the replay: at 64 rows it was ~0.7 ms of a 4.7 ms
Gemma-3 4B step. With steps launched ahead (`on`, the CUDA default) it runs while the device
computes, and matters only where it outlasts the replay. This measures it alone: an engine on the CPU with a tiny random model takes N rows through prefill to ~`prompt_len`
tokens, then its static decode path runs with the model forward replaced by fixed logits, so what
is timed is everything but the forward (the greedy argmax over the tiny vocabulary included).

    python -m bench.host_step [--n 1 8 64 256] [--prompt-len 1238] [--overlap off on]

`--prefill` times the mixed steps instead (N prompts admitted together, 2,048 tokens per step:
the decoding rows plus prefill chunks), the forward again replaced by fixed logits. That is the
CPU path's host work (its masks and query blocks are built on the host); on CUDA a chunk's mask
is built on the device and a chunk attends in one call.

    python -m bench.host_step --prefill --n 64
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

from bench.throughput import cpu_name, git_commit, source_digest, write_result
from engine import Engine, EngineConfig, Request, SamplingParams
from engine.model.loader import LoadedModel, tiny_random_model


def host_us_per_step(n: int, prompt_len: int, steps: int, overlap: bool = False) -> float:
    model = tiny_random_model(0, num_hidden_layers=2)
    cfg = EngineConfig(model="tiny-random", device="cpu", kv_policy="s5", max_rows=n, decode_graphs=True,
                       max_num_batched_tokens=8192, kv_cache_bytes=n * (prompt_len + 2 * steps + 64) * 4096,
                       overlap_steps=overlap)
    engine = Engine(cfg, LoadedModel(model, None, "tiny"))
    vocab = model.config.vocab_size
    for i in range(n):
        prompt = [3 + (i * 7 + j) % (vocab - 3) for j in range(prompt_len)]
        engine.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=2 * steps + 32, ignore_eos=True)))
    dec = engine.runner.decoder
    while dec.steps == 0:  # prefill (the real forward), until the first decode-only step
        engine.step()
    fixed = {size: torch.zeros(size, vocab) for size in dec.batches}
    dec.forward = lambda ids, positions, step, logits_index: fixed[ids.shape[0]]  # the model, out of the timing
    for _ in range(20):
        engine.step()
    before = dec.steps
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    assert dec.steps - before == steps, "steps left the static decode path"
    return elapsed / steps * 1e6


def host_ms_per_mixed_step(n: int, prompt_len: int, chunk: int = 2048) -> float:
    model = tiny_random_model(0, num_hidden_layers=2)
    cfg = EngineConfig(model="tiny-random", device="cpu", kv_policy="s5", max_rows=n, decode_graphs=True,
                       max_num_batched_tokens=chunk, kv_cache_bytes=n * (prompt_len + 600) * 4096)
    engine = Engine(cfg, LoadedModel(model, None, "tiny"))
    vocab = model.config.vocab_size
    engine.runner.forward = lambda ids, positions, step, logits_index: torch.zeros(logits_index.shape[0], vocab)
    for i in range(n):
        prompt = [3 + (i * 7 + j) % (vocab - 3) for j in range(prompt_len)]
        engine.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=128, ignore_eos=True)))
    engine.step()  # the first step (allocations, first calls) out of the timing
    times = []
    for _ in range((n * prompt_len) // chunk - 1):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return sum(times) / len(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=1238)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3, help="best of this many timings per N")
    ap.add_argument("--overlap", nargs="+", choices=["off", "on"], default=["off"],
                    help="steps applied in order, or launched ahead of the host (EngineConfig.overlap_steps)")
    ap.add_argument("--prefill", action="store_true", help="the mixed (prefill) steps' host work instead")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    if a.prefill:
        print(f"{'N':>4} {'host ms per mixed step':>23}")
        for n in a.n:
            ms = min(host_ms_per_mixed_step(n, a.prompt_len) for _ in range(a.repeats))
            rows.append({"n": n, "host_ms_per_mixed_step": ms})
            print(f"{n:4} {ms:23.2f}")
    else:
        print(f"{'N':>4} {'ahead':>5} {'host us/step':>13} {'us/row':>8}")
        for n in a.n:
            for overlap in a.overlap:
                us = min(host_us_per_step(n, a.prompt_len, a.steps, overlap == "on") for _ in range(a.repeats))
                rows.append({"n": n, "overlap": overlap, "host_us_per_step": us, "host_us_per_row": us / n})
                print(f"{n:4} {overlap:>5} {us:13.0f} {us / n:8.1f}")
    result = {"bench": "host_step", "mode": "prefill" if a.prefill else "decode", "device": cpu_name(),
              "prompt_len": a.prompt_len, "steps": a.steps,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "commit": git_commit(), "engine_source_sha256": source_digest()},
              "rows": rows}
    write_result(a.out, f"{'host-prefill-step' if a.prefill else 'host-step'}-cpu", result, a.tag)


if __name__ == "__main__":
    main()
