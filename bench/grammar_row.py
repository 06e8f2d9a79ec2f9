"""What one grammar row costs the batch it decodes in.

A batch of N rows (default 32) decodes N x `--steps` tokens on the CPU with the embedded model:
once with every row free, once with row 0 under a JSON-schema grammar (an array of short strings
that cannot end within the run, so the batch keeps its size) and the other N - 1 free. Both
batches run the same prompts and token counts, alternately, `--repeats` times. Reported: decode
throughput (tokens per second, all rows) with the grammar row as a ratio of the same batch
without it (median of the pairs), by wall time and by the process's CPU time (the CPU-time ratio
holds where other work shares the machine's cores; the wall one where it does not); the grammar
row's own tokens per step (below 1 where it sits steps out); and, timed on its own, the grammar
row's share of a step (its mask, the mask's application to its logits and its own pick) in
milliseconds of CPU time on one thread, best of 50, beside a free step's CPU time. Also the
engine's compile time of a first request's grammar.

    nice -n 10 python -m bench.grammar_row [--n 32] [--steps 8] [--repeats 3] [--sampled]

On a GPU, a BENCH.md shape with random weights and a real tokenizer of its vocabulary (the grammar
needs one); there steps keep launching ahead of the host with a grammar row in them (its mask is
filled while the device runs the next forward, and it sits a step out where the mask is late),
and the ratio measures what is left of its cost:

    python -m bench.grammar_row --shape gemma3-1b --tokenizer DIR --device cuda --dtype bfloat16 \
        --n 32 --steps 64 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from llguidance import LLMatcher

from bench.throughput import cpu_name, git_commit, shape_model_dir, source_digest, write_result
from engine import Engine, EngineConfig, Request, SamplingParams
from engine.model.loader import load_model
from engine.runner.sampler import pick_tokens
from service.structured import JSON_OPTIONS

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 200}
# a larger schema, for the engine's compile time (what a first request with it blocks steps for)
LARGE = {"type": "object", "additionalProperties": False, "required": [f"f{i}" for i in range(40)],
         "properties": {f"f{i}": [{"type": "string", "maxLength": 20}, {"type": "integer", "minimum": 0},
                                  {"enum": ["a", "b", "c"]}, {"type": "array", "items": {"type": "number"}},
                                  {"type": "object", "properties": {"x": {"type": "boolean"}, "y": {"type": "string"}},
                                   "required": ["x"]}][i % 5] for i in range(40)}}
WORDS = "the of and to in is was that for it with as his on be at by had are but from or".split()


def decode_rate(engine: Engine, n: int, steps: int, grammar: str | None, sampled: bool, tok) -> dict:
    """Tokens per wall second and per CPU second over `steps` decode steps of n rows."""
    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True, temperature=0.8 if sampled else 0.0, seed=1)
    for i in range(n):
        prompt = tok(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(12)))["input_ids"]
        p = SamplingParams(**{**params.__dict__, "grammar": grammar}) if (i == 0 and grammar) else params
        engine.add_request(Request(f"r{i}", prompt, p))
    while len(engine.scheduler.decoding() or ()) < n:  # prefill, until every row decodes
        engine.step()
    engine.step()  # a step launched ahead settles its tokens one step later: start from a settled one
    before, steps0 = engine.stats["decode_tokens"], engine.stats["steps"]
    row0 = 0  # row 0's tokens (the grammar row's, where there is one: it may sit steps out)
    t0, c0 = time.perf_counter(), time.process_time()
    while engine.stats["decode_tokens"] - before < n * steps:
        row0 += sum(len(o.new_token_ids) for o in engine.step() if o.request_id == "r0")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens, ran = engine.stats["decode_tokens"] - before, engine.stats["steps"] - steps0
    assert len(engine.scheduler.decoding() or ()) == n, "a row left the batch during the timing"
    for i in range(n):
        engine.abort(f"r{i}")
    return {"tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu, "ms_per_step": wall / ran * 1e3,
            "steps": ran, "row0_tokens_per_step": row0 / ran}


def grammar_row_ms(engine: Engine, grammar: str, n: int, vocab: int, sampled: bool, iters: int = 50) -> float:
    """The grammar row's own host work in one step of n rows, in ms of CPU time on one thread
    (the best of `iters`; wall times on a shared machine measure the neighbours): its mask filled
    mid-reply, applied to its logits row, its token picked."""
    row = engine.grammars.matcher(grammar)
    for t in engine.tokenizer('["ab", "cd", "e', add_special_tokens=False)["input_ids"]:
        assert row.accept(t)
    logits = torch.randn(n, vocab)
    params = [SamplingParams(temperature=0.8 if sampled else 0.0, seed=1, grammar=grammar)]
    generators = [torch.Generator().manual_seed(1)]
    grammars = [row] + [None] * (n - 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    best = float("inf")
    try:
        for _ in range(iters):
            t0 = time.thread_time()
            masks, failed = engine.grammars.step_masks(grammars, {})
            picked, _, _ = pick_tokens(logits[:1], None, params, generators, masks=masks)
            best = min(best, time.thread_time() - t0)
            assert not failed and picked
    finally:
        torch.set_num_threads(threads)
    return best * 1e3


def host_profile(engine: Engine, n: int, steps: int, grammar: str | None, sampled: bool, tok,
                 top: int = 25) -> list[dict]:
    """Where the host's time goes in `steps` decode steps (cProfile over `decode_rate`): the
    functions with the most time of their own, per step, in ms."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    decode_rate(engine, n, steps, grammar, sampled, tok)
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(f).name}:{line}:{name}", "calls_per_step": nc / steps,
             "own_ms_per_step": tt / steps * 1e3, "cumulative_ms_per_step": ct / steps * 1e3}
            for (f, line, name), (_, nc, tt, ct, _) in rows]


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else cpu_name()


def compile_ms(engine: Engine, schema: dict) -> float:
    """The engine's first compile of `schema` (its matcher), in milliseconds: what it blocks steps for."""
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    t0 = time.perf_counter()
    engine.grammars.matcher(grammar)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sampled", action="store_true", help="every row samples (temperature 0.8), not greedy")
    ap.add_argument("--quantization", default=None, help="default: int8 on the embedded model, none on a shape")
    ap.add_argument("--shape", default=None, help="a BENCH.md shape with random weights instead of the embedded model")
    ap.add_argument("--tokenizer", default=None, help="with --shape: a directory holding a tokenizer of its vocabulary")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--row-only", action="store_true", help="only the compile times and the row's own work")
    ap.add_argument("--profile", action="store_true",
                    help="also profile the host's work in a free and a grammar batch (cProfile), per function")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    if a.shape and not a.tokenizer:
        ap.error("--shape needs --tokenizer (a grammar is compiled against a real vocabulary)")
    model = "embedded"
    if a.shape:
        model = shape_model_dir(a.shape, Path(tempfile.mkdtemp(prefix="grammar-row-")), a.tokenizer)
    quantization = a.quantization or (None if a.shape else "int8")
    cfg = EngineConfig(model=model, quantization=quantization, device=a.device, dtype=a.dtype, max_rows=a.n,
                       kv_cache_bytes=(2 << 30) if a.device.startswith("cuda") else 512 << 20)
    loaded = load_model(cfg)
    label = f"{a.device.split(':')[0]}-{a.shape or 'embedded'}"
    engine = Engine(cfg, loaded)
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=JSON_OPTIONS)
    t0 = time.perf_counter()
    engine.grammars.matcher(grammar)  # builds the grammar tokenizer first
    first_ms = (time.perf_counter() - t0) * 1e3
    compile = {"bench_schema_ms": compile_ms(engine, {**SCHEMA, "minItems": 199}),
               "large_schema_ms": compile_ms(engine, LARGE), "first_grammar_with_tokenizer_build_ms": first_ms}
    print("compile:", ", ".join(f"{k} {v:.1f}" for k, v in compile.items()))
    row_ms = grammar_row_ms(engine, grammar, a.n, engine.geometry.vocab_size, a.sampled)
    print(f"grammar row's own work: {row_ms:.2f} ms CPU per step (one thread, best of 50)")
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "commit": git_commit(),
                "engine_source_sha256": source_digest()}
    if a.row_only:
        result = {"bench": "grammar_row", "mode": "row-only", "device": device_name(a.device),
                  "model": a.shape or "embedded", "dtype": a.dtype, "quantization": quantization, "n": a.n, "sampled": a.sampled, "schema": SCHEMA,
                  "grammar_row_cpu_ms_per_step": row_ms, "compile": compile,
                  "load_average_at_end": os.getloadavg(), "versions": versions}
        write_result(a.out, f"grammar-row-row-{label}", result, a.tag)
        return
    decode_rate(engine, a.n, 2, grammar, a.sampled, loaded.tokenizer)  # warm-up
    pairs = []
    print(f"{'run':>4} {'free tok/s':>11} {'grammar tok/s':>14} {'wall ratio':>11} {'cpu ratio':>10} "
          f"{'grammar row tokens/step':>24}")
    for r in range(a.repeats):
        free = decode_rate(engine, a.n, a.steps, None, a.sampled, loaded.tokenizer)
        gram = decode_rate(engine, a.n, a.steps, grammar, a.sampled, loaded.tokenizer)
        pair = {"free": free, "grammar": gram, "wall_ratio": gram["tokens_per_s"] / free["tokens_per_s"],
                "cpu_ratio": gram["tokens_per_cpu_s"] / free["tokens_per_cpu_s"]}
        pairs.append(pair)
        print(f"{r:4} {free['tokens_per_s']:11.1f} {gram['tokens_per_s']:14.1f} {pair['wall_ratio']:11.3f} "
              f"{pair['cpu_ratio']:10.3f} {gram['row0_tokens_per_step']:24.2f}")
    wall_ratio = statistics.median(p["wall_ratio"] for p in pairs)
    cpu_ratio = statistics.median(p["cpu_ratio"] for p in pairs)
    step_cpu_ms = statistics.median(a.n / p["free"]["tokens_per_cpu_s"] * 1e3 for p in pairs)
    print(f"median ratio (grammar row batch / free batch): wall {wall_ratio:.3f}, cpu {cpu_ratio:.3f}; "
          f"grammar row's own work {row_ms:.2f} ms per step (one thread, best of 50); a free step {step_cpu_ms:.0f} ms CPU")
    profiles = {}
    if a.profile:
        for name, g in (("free", None), ("grammar", grammar)):
            profiles[name] = host_profile(engine, a.n, a.steps, g, a.sampled, loaded.tokenizer)
            print(f"host time per step, {name} batch (cProfile), by own time:")
            print(f"  {'own ms':>7} {'cum ms':>7} {'calls':>6}  function")
            for r in profiles[name]:
                print(f"  {r['own_ms_per_step']:7.3f} {r['cumulative_ms_per_step']:7.3f} {r['calls_per_step']:6.1f}  {r['function']}")
    result = {"bench": "grammar_row", "device": device_name(a.device), "model": a.shape or "embedded",
              "dtype": a.dtype, "quantization": quantization, "overlap_steps": cfg.overlap_steps,
              "n": a.n, "steps": a.steps, "sampled": a.sampled, "schema": SCHEMA,
              "wall_ratio_median": wall_ratio, "cpu_ratio_median": cpu_ratio, "grammar_row_cpu_ms_per_step": row_ms,
              "free_step_cpu_ms_median": step_cpu_ms, "pairs": pairs, "compile": compile, "host_profile": profiles,
              "load_average_at_end": os.getloadavg(), "versions": versions}
    write_result(a.out, f"grammar-row-{label}", result, a.tag)


if __name__ == "__main__":
    main()
