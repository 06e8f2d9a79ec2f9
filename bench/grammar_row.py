"""What one grammar row costs the batch it decodes in.

A batch of N rows (default 32) decodes `--steps` steps on the CPU with the embedded model: once
with every row free, once with row 0 under a JSON-schema grammar (an array of short strings that
cannot end within the run, so the batch keeps its size) and the other N - 1 free. Both batches
run the same prompts and token counts, alternately, `--repeats` times; the result is decode
throughput (tokens per second, all rows) with the grammar row as a ratio of the same batch
without it (median of the pairs), and the host time spent on the grammar row per step (its mask,
the mask's application and its own pick).

    nice -n 10 python -m bench.grammar_row [--n 32] [--steps 24] [--repeats 3] [--sampled]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date
from pathlib import Path

import torch
import transformers
from llguidance import LLMatcher

from bench.throughput import cpu_name, git_commit, source_digest
from engine import Engine, EngineConfig, Request, SamplingParams
from engine.model.loader import load_model
from service.structured import JSON_OPTIONS

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 200}
# a larger schema, for the engine's compile time (what a first request with it blocks steps for)
LARGE = {"type": "object", "additionalProperties": False, "required": [f"f{i}" for i in range(40)],
         "properties": {f"f{i}": [{"type": "string", "maxLength": 20}, {"type": "integer", "minimum": 0},
                                  {"enum": ["a", "b", "c"]}, {"type": "array", "items": {"type": "number"}},
                                  {"type": "object", "properties": {"x": {"type": "boolean"}, "y": {"type": "string"}},
                                   "required": ["x"]}][i % 5] for i in range(40)}}
WORDS = "the of and to in is was that for it with as his on be at by had are but from or".split()


def decode_rate(engine: Engine, n: int, steps: int, grammar: str | None, sampled: bool, tok) -> tuple[float, float]:
    """(tokens per second over `steps` decode steps of n rows, seconds per step)."""
    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True, temperature=0.8 if sampled else 0.0, seed=1)
    for i in range(n):
        prompt = tok(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(12)))["input_ids"]
        p = SamplingParams(**{**params.__dict__, "grammar": grammar}) if (i == 0 and grammar) else params
        engine.add_request(Request(f"r{i}", prompt, p))
    while len(engine.scheduler.decoding() or ()) < n:  # prefill, until every row decodes
        engine.step()
    before = engine.stats["decode_tokens"]
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    tokens = engine.stats["decode_tokens"] - before
    assert tokens == n * steps, "a row left the batch during the timing"
    for i in range(n):
        engine.abort(f"r{i}")
    return tokens / elapsed, elapsed / steps


def compile_ms(engine: Engine, schema: dict) -> float:
    """The engine's first compile of `schema` (its matcher), in milliseconds: what it blocks steps for."""
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    t0 = time.perf_counter()
    engine.grammars.matcher(grammar)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sampled", action="store_true", help="every row samples (temperature 0.8), not greedy")
    ap.add_argument("--quantization", default="int8")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    cfg = EngineConfig(model="embedded", quantization=a.quantization, max_rows=a.n, kv_cache_bytes=512 << 20)
    loaded = load_model(cfg)
    engine = Engine(cfg, loaded)
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=JSON_OPTIONS)
    t0 = time.perf_counter()
    engine.grammars.matcher(grammar)  # builds the grammar tokenizer first
    first_ms = (time.perf_counter() - t0) * 1e3
    compile = {"bench_schema_ms": compile_ms(engine, {**SCHEMA, "minItems": 199}),
               "large_schema_ms": compile_ms(engine, LARGE), "first_grammar_with_tokenizer_build_ms": first_ms}
    print("compile:", ", ".join(f"{k} {v:.1f}" for k, v in compile.items()))
    decode_rate(engine, a.n, 4, grammar, a.sampled, loaded.tokenizer)  # warm-up
    pairs = []
    print(f"{'run':>4} {'free tok/s':>11} {'grammar tok/s':>14} {'ratio':>6}")
    for r in range(a.repeats):
        free, free_step = decode_rate(engine, a.n, a.steps, None, a.sampled, loaded.tokenizer)
        gram, gram_step = decode_rate(engine, a.n, a.steps, grammar, a.sampled, loaded.tokenizer)
        pairs.append({"free_tokens_per_s": free, "grammar_tokens_per_s": gram, "ratio": gram / free,
                      "free_ms_per_step": free_step * 1e3, "grammar_ms_per_step": gram_step * 1e3})
        print(f"{r:4} {free:11.1f} {gram:14.1f} {gram / free:6.3f}")
    ratio = statistics.median(p["ratio"] for p in pairs)
    extra_ms = statistics.median(p["grammar_ms_per_step"] - p["free_ms_per_step"] for p in pairs)
    print(f"median ratio {ratio:.3f} (grammar row batch / free batch), {extra_ms:+.2f} ms per step")
    result = {"bench": "grammar_row", "device": cpu_name(), "model": "embedded", "quantization": a.quantization,
              "n": a.n, "steps": a.steps, "sampled": a.sampled, "schema": SCHEMA,
              "ratio_median": ratio, "extra_ms_per_step_median": extra_ms, "pairs": pairs, "compile": compile,
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "commit": git_commit(), "engine_source_sha256": source_digest()}}
    out = Path(a.out) / f"grammar-row-cpu-embedded-{date.today().isoformat()}{'-' + a.tag if a.tag else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
