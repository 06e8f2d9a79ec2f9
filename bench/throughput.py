"""decode-1238 throughput: the engine (s5, native) vs HF transformers generate, same prompts.

N concurrent requests, each a distinct ~1,238-token prompt, 128 greedy tokens, EOS ignored.
Aggregate decode tok/s = tokens generated while all N rows decode / that time (from the last
row's first token to the last token); TTFT is reported separately. Prints a table with ratios to HF generate
(batched, same model, same prompts, measured in this run) and writes JSON to bench/results/.

    python -m bench.throughput                       # CPU, embedded model, N = 1 8 16 32, float32 + int8
    python -m bench.throughput --n 1 8 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import time
from datetime import date
from pathlib import Path

import torch

from engine import Engine, EngineConfig, Request, SamplingParams
from engine.model.loader import load_model
from engine.model.nf4_experts import NF4Experts


def prompts_for(tokenizer, vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = "alpha river stone quiet market seven orange violin harbor meadow copper lantern".split()
    out = []
    for i in range(n):
        if tokenizer is None:
            out.append([rng.randrange(3, vocab) for _ in range(length)])
            continue
        text = f"Document {i}: " + " ".join(rng.choice(words) for _ in range(length * 2))
        out.append(tokenizer(text)["input_ids"][:length])
    return out


def first_tokens(engine, prompts, new_tokens: int = 2) -> float:
    """The prompts run to `new_tokens` tokens each; their mean TTFT. The engine's counters are
    reset after it, so that the run timed next counts only its own steps."""
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"warm{i}", p, SamplingParams(max_tokens=new_tokens, ignore_eos=True)))
    first = {}
    while engine.has_work():
        for o in engine.step():
            first.setdefault(o.request_id, time.perf_counter())
    engine.stats.update(steps=0, prefill_tokens=0, decode_tokens=0)
    if engine.runner.decoder is not None:
        engine.runner.decoder.steps = 0
    return sum(t - t0 for t in first.values()) / max(len(first), 1)


def run_engine(loaded, policy: str, prompts, new_tokens: int, device: str, warm_up: bool = False,
               **config) -> dict:
    """`config`: EngineConfig fields to override (capacity runs size the pool themselves).
    `warm_up`: the same prompts run first, untimed, to 2 tokens each, as `run_hf` warms HF
    generate: the first forward of each shape in a process pays one-time costs (Triton compiling
    the kernel variants that only prefill chunks launch, where its on-disk cache does not hold
    them yet; library setup) that are not the engine's steady TTFT. That first pass's mean TTFT
    is kept as `first_ttft_s` (None without `warm_up`)."""
    cfg = EngineConfig(**{"model": "bench", "device": device, "kv_policy": policy, "max_rows": max(len(prompts), 1),
                          "kv_cache_bytes": max(2 << 30, len(prompts) * (64 << 20)), **config})
    engine = Engine(cfg, loaded)
    first_ttft = first_tokens(engine, prompts) if warm_up else None
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", p, params))
    first, last, events, gaps = {}, {}, [], []
    while engine.has_work():
        for o in engine.step():
            now = time.perf_counter()
            first.setdefault(o.request_id, now)
            if o.request_id in last:
                gaps.append(now - last[o.request_id])
            last[o.request_id] = now
            events.append(now)
    # BENCH.md: decode rate measured with all N rows decoding, i.e. between the last row's first
    # token and the first row's last token (rows prefilled earlier start decoding earlier, so they
    # finish earlier too). The rate to the last row's last token, which also counts the tail where
    # fewer rows are left, is kept as `decode_tail_tok_s`.
    t_all, t_last, t_done = max(first.values()), max(last.values()), min(last.values())
    in_window = sum(1 for t in events if t_all < t <= t_done)
    per_session = (engine.pool.ring_row_bytes
                   + engine.pool.blocks_for(len(prompts[0]) + new_tokens) * engine.pool.block_bytes)
    dec = engine.runner.decoder
    res = {
        "decode_tok_s": in_window / (t_done - t_all) if in_window >= 8 * len(prompts) else None,
        "decode_tail_tok_s": sum(1 for t in events if t > t_all) / (t_last - t_all) if t_last > t_all else None,
        "all_rows_steps": in_window // len(prompts),
        "steps": engine.stats["steps"], "graph_steps": dec.steps if dec is not None else 0,
        "ttft_s": sum(first[r] - t0 for r in first) / len(first),
        "ttft_p50_s": sorted(first[r] - t0 for r in first)[len(first) // 2],
        "first_ttft_s": first_ttft,
        # each row's gaps between its tokens (prefill steps of other rows included)
        "itl_p50_s": sorted(gaps)[len(gaps) // 2] if gaps else None,
        "itl_p99_s": sorted(gaps)[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None,
        "kv_bytes_per_session": per_session,
        "token_budget": engine.scheduler.token_budget,
        "layers": "fused" if engine.runner.fused is not None else "stock",
        "pdl": engine.runner.pdl,
        "plans": launch_plans(engine.runner.fused),
    }
    del engine, dec  # the pool and the captured graphs go before the next run
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return res


class _StepClock:
    """A LogitsProcessor that only records when each generation step's logits arrive."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def launch_plans(fused) -> dict:
    """The fused forward's planned launches per projection and row count (`plan_gemv` in
    kernels/small_linear.py, `plan_nf4` in kernels/nf4_plan.py), as text; a row count absent from
    a projection's plan runs the library's product. Empty without a fused forward, or where
    nothing is timed (the CPU)."""
    if fused is None:
        return {}
    return {"/".join(map(str, key)) if isinstance(key, tuple) else key: {str(rows): repr(cfg) for rows, cfg in
                                                                        sorted(plan.items())}
            for key, plan in fused.plans.items()}


@torch.inference_mode()
def run_hf(model, prompts, new_tokens: int, pad_id: int, static: bool = False) -> dict:
    """Batched HF generate. Decode rate over the steps after the first token (every row decodes
    together in HF), the same definition as the engine's; TTFT = time to the first step.
    `static`: `cache_implementation="static"`, with which transformers compiles the decode step
    (BENCH.md's stronger peer); one untimed run of the same shape compiles it first."""
    from transformers import LogitsProcessorList

    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, n - len(p):] = torch.tensor(p)
        mask[i, n - len(p):] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    model.set_attn_implementation("sdpa")  # the model may be shared with an engine, which set its own
    clock = _StepClock()
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=pad_id, top_k=None, top_p=None,
              logits_processor=LogitsProcessorList([clock]))
    warm = {**kw, "logits_processor": LogitsProcessorList([_StepClock()])}
    if static:
        kw["cache_implementation"] = "static"
        warm["cache_implementation"] = "static"
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **warm)
    elif ids.is_cuda:  # the first forward of a shape pays library setup (kernel choice, handles)
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **warm)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    t = clock.times
    return {"decode_tok_s": len(prompts) * (len(t) - 1) / (t[-1] - t[0]), "ttft_s": t[0] - t0}


# BENCH.md model shapes (random weights, every 6th layer full attention). Gemma 3 unless "family".
SHAPES = {
    "gemma3-270m": dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=256, sliding_window=512, vocab_size=262144),
    "gemma3-1b": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=256, sliding_window=512, vocab_size=262144),
    "gemma3-4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, sliding_window=1024, vocab_size=262208),
    # The MoE stretch shape. Fixed by the issue: 30 layers, hidden 2816, 128 experts with top-8
    # routing, exact layers 5/11/17/23/29. The rest (heads, head sizes, the full layers' own K/V
    # shape with values equal to keys, MLP sizes, window) follows the published gemma-4-26B-A4B
    # configuration as we know it; the run records the config it used.
    "gemma4-26b-a4b": dict(family="gemma4", hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
                           num_global_key_value_heads=2, attention_k_eq_v=True, enable_moe_block=True,
                           num_experts=128, top_k_experts=8, moe_intermediate_size=704, sliding_window=1024,
                           hidden_size_per_layer_input=0, final_logit_softcapping=30.0, vocab_size=262144),
}


def shape_config(name: str):
    """The transformers config of a BENCH.md shape, and its causal-LM class."""
    fields = dict(SHAPES[name])
    if fields.pop("family", "gemma3") == "gemma4":
        from transformers import Gemma4ForCausalLM as cls, Gemma4TextConfig

        return Gemma4TextConfig(**fields, max_position_embeddings=32768), cls
    from transformers import Gemma3ForCausalLM as cls, Gemma3TextConfig

    return Gemma3TextConfig(**fields, max_position_embeddings=32768, query_pre_attn_scalar=256), cls


def shape_model_dir(name: str, workdir: Path, tokenizer: Path | None = None) -> str:
    """A `random:` model spec for the engine's loader: the shape's config written to `workdir`,
    beside the files of `tokenizer` (a directory holding a real tokenizer of the same vocabulary,
    for runs that detokenize or compile grammars as a served model would)."""
    import shutil

    config, _ = shape_config(name)
    config.save_pretrained(workdir)
    for f in Path(tokenizer).iterdir() if tokenizer else ():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
            shutil.copy(f, workdir / f.name)
    return f"random:{workdir}"


def shape_models(name: str, device: str, dtype: torch.dtype, with_hf: bool = True):
    """Two identical random-weight models of a BENCH.md shape: one for the engine, one for HF
    (None without `with_hf`)."""
    import copy

    fields = SHAPES[name]
    cfg, cls = shape_config(name)
    torch.manual_seed(0)
    with torch.device(device):
        model = cls._from_config(cfg, dtype=dtype).eval()
    if "num_experts" in fields and device.startswith("cuda"):
        # HF's baseline on the same experts product as the engine's stock layers (model_runner.
        # stock_experts_capturable): the default loop syncs with the host per expert
        model.set_experts_implementation("grouped_mm")
    if not with_hf:
        return model, None
    free = torch.cuda.mem_get_info()[0] if device.startswith("cuda") else 1 << 62
    if model.num_parameters() * dtype.itemsize > free / 3:  # no room for a second copy and the KV pool
        return model, model  # HF and the engine share it: main() runs every HF baseline first
    hf = copy.deepcopy(model)
    hf.set_attn_implementation("sdpa")
    return model, hf


def copy_bandwidth(device: str) -> float:
    """Copy bandwidth (read + write bytes per second) of a large copy on the device."""
    if not device.startswith("cuda"):
        src = torch.ones(1 << 30, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        return 2 * 5 * src.numel() / (time.perf_counter() - t0)
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * 10 * src.numel() / (start.elapsed_time(end) / 1000)


def step_weight_bytes(model, n_tokens: int = 1) -> int:
    """Bytes of weights one decode step of `n_tokens` rows reads: every parameter and buffer,
    except an input embedding table that is not also the output layer (a lookup reads one row per
    token), and, in a mixture-of-experts layer, only the experts the step routes to: with top-k of
    E experts routed uniformly, E * (1 - (1 - k/E)^n) distinct experts on average."""
    seen, total = set(), 0
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = getattr(head, "weight", None) is emb
    top_k = getattr(model.config.get_text_config(), "top_k_experts", None) or 0
    expert_params = {}
    for mod in model.modules():
        e = getattr(mod, "num_experts", None)
        if isinstance(e, int) and top_k:
            if isinstance(mod, NF4Experts):  # 2-D packed bytes and scales, the experts' rows in order
                experts = [mod.gate_up_packed, mod.gate_up_scales, mod.down_packed, mod.down_scales]
            else:
                experts = [t for t in mod.parameters(recurse=False) if t.dim() == 3 and t.shape[0] == e]
            for t in experts:
                expert_params[t.data_ptr()] = e
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() in seen or (t is emb and not tied):
            continue
        seen.add(t.data_ptr())
        nbytes = t.numel() * t.element_size()
        if t.data_ptr() in expert_params:
            e = expert_params[t.data_ptr()]
            nbytes = nbytes * (1 - (1 - min(top_k, e) / e) ** n_tokens)
        total += nbytes
    return int(total)


def bnb4_coverage(model) -> dict:
    """What of the decoder layers' weights are NF4: the parameters of bitsandbytes' 4-bit linears
    and of the experts the loader quantized (`NF4Experts`), and, by name within a layer, those of
    the other weights of two or more dimensions, left in the model's dtype."""
    nf4, left = 0, {}
    for layer in model.get_decoder().layers:
        for name, mod in layer.named_modules():
            if type(mod).__name__ == "Linear4bit":
                nf4 += mod.in_features * mod.out_features
                continue
            if isinstance(mod, NF4Experts):
                nf4 += 2 * (mod.gate_up_packed.numel() + mod.down_packed.numel())
                continue
            for p_name, p in mod.named_parameters(recurse=False):
                if p.dim() >= 2:
                    key = f"{name}.{p_name}" if name else p_name
                    left[key] = left.get(key, 0) + p.numel()
    return {"nf4_params": nf4, "left_in_dtype": left}


def source_digest() -> str:
    """Digest of the engine's source files, naming the code a result came from even where the
    tree is not a clean checkout."""
    import hashlib

    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent / "engine"
    for f in sorted([*root.rglob("*.py"), *root.rglob("*.c"), *root.rglob("*.cu")]):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def git_commit() -> str | None:
    """The checkout's commit (`-dirty` when the tree has changes); `source_digest` names the code
    exactly where the tree is a copy whose history is not its own."""
    try:
        return subprocess.check_output(["git", "describe", "--always", "--dirty"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return None


def write_result(out_dir: str | Path, stem: str, result: dict, tag: str = "") -> Path:
    """`result` as `<out_dir>/<stem>-<today>[-<tag>].json`; says where it went."""
    path = Path(out_dir) / f"{stem}-{date.today().isoformat()}{'-' + tag if tag else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return path


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def quality(loaded, reference, device: str, model: str, quantization: str, docs: int = 8) -> dict:
    """A quantized engine against the float32 one: greedy agreement (64 tokens from 16 corpus
    prompts of 1,024 tokens, s5), the quick passkey/needle grid of bench/recall.py, and perplexity
    on the corpus (`perplexity_vs_float32`)."""
    from bench import recall

    prompts = recall.agreement_prompts(loaded.tokenizer, 16, 1024)
    cfg = EngineConfig(model="bench", device=device, max_rows=8, max_num_batched_tokens=1024, kv_cache_bytes=1 << 30)
    agree = recall.agreement(recall.greedy_tokens(loaded, cfg, prompts), recall.greedy_tokens(reference, cfg, prompts))
    base = EngineConfig(model="bench", device=device, max_rows=8, max_num_batched_tokens=1024)
    lengths, depths, cases = [512, 1024, 2048], [0.0, 0.5, 1.0], 2
    grids = {w: recall.needle_grid(m, base, ["native", "s5"], lengths, depths, cases)
             for w, m in (("quantized", loaded), ("float32", reference))}
    tables = {p: recall.cell_table(grids["quantized"]["hits"][p], lengths, depths, cases) for p in ("native", "s5")}
    return {"greedy_agreement_vs_float32": agree,
            "recall_quick": {p: sum(grids["quantized"]["hits"][p].values()) for p in tables},
            "recall_quick_float32": {p: sum(grids["float32"]["hits"][p].values()) for p in tables},
            "recall_cells_differing_from_float32": {
                p: sorted(str(k) for k in grids["float32"]["hits"][p]
                          if grids["float32"]["hits"][p][k] != grids["quantized"]["hits"][p][k]) for p in tables},
            "recall_cases": len(grids["quantized"]["needles"]),
            "recall_regressions": recall.check_quick(tables),
            "perplexity": perplexity_vs_float32(model, quantization, docs)}


def perplexity_vs_float32(model: str, quantization: str, docs: int) -> dict:
    """Decode-regime perplexity (bench/fidelity_core.py) on `docs` documents of the recall corpus,
    float32 weights against `quantization`'s, with the exact model's layers and with the default
    s5 windows. Quantized weights run their decode products on every scored token (the numbers a
    decode step computes; bench/fidelity.py's scorer_model)."""
    from types import SimpleNamespace

    from bench import recall
    from bench.fidelity import bounded_windows, scorer_model
    from bench.fidelity_core import Scorer, corpus_docs

    out = {}
    for name, q in (("float32", None), (quantization, quantization)):
        net, tok = scorer_model(SimpleNamespace(model=model, quant=q))
        scorer = Scorer(net, corpus_docs(tok, recall.corpus_text(), docs), sink=EngineConfig.kv_sink)
        out[name] = {"exact": scorer.ppl([None] * len(scorer.layer_types)),
                     "s5": scorer.ppl(bounded_windows(scorer.layer_types, EngineConfig.kv_window))}
        del net, scorer
    out["ratio"] = {k: out[quantization][k] / out["float32"][k] for k in ("exact", "s5")}
    out["docs"] = docs
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random-weight BENCH.md shape")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weights", nargs="+", default=None,
                    help="engine weight precisions: float32 (the --dtype weights), int8 (CPU), bnb-4bit "
                         "(CUDA); default: float32 int8 on the CPU, float32 on CUDA")
    ap.add_argument("--n", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--prompt-len", type=int, default=1238)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--policies", nargs="+", default=["s5", "native"])
    ap.add_argument("--float32-policies", nargs="+", default=None,
                    help="policies for the float32 weights when int8 runs too (default: s5)")
    ap.add_argument("--layers", nargs="+", choices=["fused", "stock"], default=["fused"],
                    help="the engine's fused Gemma 3 / Gemma 4 layer forward, the stock transformers layers, or both "
                         "(models the fused forward does not take run stock either way)")
    ap.add_argument("--overlap", nargs="+", choices=["on", "off"], default=["on"],
                    help="steady decode steps launched ahead of the host (EngineConfig.overlap_steps; on: "
                         "the CUDA default), or applied in order, or both for an A/B in one run")
    ap.add_argument("--pdl", nargs="+", choices=["on", "off"], default=["on"],
                    help="the engine's kernels launched with programmatic dependent launch (EngineConfig.pdl; "
                         "on where the GPU supports it), or plainly, or both")
    ap.add_argument("--max-decode-stall-ms", nargs="+", type=float, default=[None],
                    help="the scheduler's decode stall bound (EngineConfig.max_decode_stall_ms; default: the "
                         "engine's, 1000 on CUDA and 0 on the CPU), or several for an A/B in one run")
    ap.add_argument("--max-batched-tokens", nargs="+", type=int, default=[None],
                    help="tokens per engine step (EngineConfig.max_num_batched_tokens; default: the engine's, "
                         "8192 on CUDA and 512 on the CPU), or several")
    ap.add_argument("--hf-static", action="store_true",
                    help="also HF generate with a static cache (compiled decode step; its first run per "
                         "shape and N compiles for a minute or more), reported beside the default")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="time each engine's first requests as they come (no untimed pass of the same prompts "
                         "first, which HF generate gets on CUDA; see run_engine)")
    ap.add_argument("--no-quality", action="store_true", help="skip agreement/recall/perplexity of quantized weights")
    ap.add_argument("--quality-docs", type=int, default=8, help="corpus documents (1,280 tokens) scored for perplexity")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="", help="suffix for the result file name")
    a = ap.parse_args()

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[a.dtype]
    weights = a.weights or (["float32", "int8"] if a.device == "cpu" and not a.shape else ["float32"])
    engines: dict[str, object] = {}
    hf_for: dict[str, object] = {}  # HF baseline per engine weights, where it differs from `hf`
    stock_for: dict[str, object] = {}  # the model the stock layers run, where not the engine's
    notes: list[str] = []  # printed before the table and kept in the result
    if a.shape:
        from engine.model.loader import LoadedModel

        model, hf = shape_models(a.shape, a.device, dtype)
        engines["float32"], a.model = LoadedModel(model, None, a.shape), a.shape
        if "bnb-4bit" in weights and hf is model:
            # no room for copies (shape_models): the one model is quantized in place, for the engine
            # and HF alike; HF generate runs first (below), before an engine build changes it
            from engine.model.loader import quantize_bnb4

            if "float32" in weights:
                ap.error(f"{a.shape}: no room for the {a.dtype} weights beside their 4-bit copy; "
                         "run --weights float32 and --weights bnb-4bit separately")
            engines["bnb-4bit"] = LoadedModel(quantize_bnb4(model, dtype), None, a.shape)
            hf_for["bnb-4bit"] = model
            if {"fused", "stock"} <= set(a.layers):
                notes.append("stock layers not run: with no room for a copy of the model, the fused forward's "
                             "build repacks the one model's 4-bit linears into the engine's NF4 linears "
                             "(model/nf4_linear.py), after which the stock layers would no longer run "
                             "bitsandbytes' own")
                a.layers = [x for x in a.layers if x != "stock"]
        elif "bnb-4bit" in weights:  # the same weights in NF4, for the engine and for HF alike
            import copy

            from engine.model.loader import quantize_bnb4

            engines["bnb-4bit"] = LoadedModel(quantize_bnb4(copy.deepcopy(model), dtype), None, a.shape)
            hf_for["bnb-4bit"] = quantize_bnb4(copy.deepcopy(hf), dtype)
            if {"fused", "stock"} <= set(a.layers):
                # the fused forward's first build repacks the 4-bit linears into the engine's NF4
                # linears (model/nf4_linear.py); the stock layers run bitsandbytes' own on a copy
                stock_for["bnb-4bit"] = LoadedModel(quantize_bnb4(copy.deepcopy(model), dtype), None, a.shape)
        if "float32" not in weights:
            del engines["float32"]
    else:
        from transformers import AutoModelForCausalLM

        from engine.model.source import embedded_dir

        for w in weights:
            engines[w] = load_model(EngineConfig(model=a.model, device=a.device, dtype=a.dtype,
                                                 quantization=None if w == "float32" else w))
        path = str(embedded_dir()) if a.model == "embedded" else a.model
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(a.device).eval()
    loaded = next(iter(engines.values()))
    weight_bytes = {w: step_weight_bytes(m.model) for w, m in engines.items()}  # at N=1
    coverage = bnb4_coverage(engines["bnb-4bit"].model) if "bnb-4bit" in engines else None
    if coverage and coverage["left_in_dtype"]:
        left = coverage["left_in_dtype"]
        notes.append(f"bnb-4bit here is not a 4-bit model: bitsandbytes quantizes nn.Linear modules only, so "
                     f"{coverage['nf4_params'] / 1e9:.2f}B parameters of the decoder layers are NF4 (attention, "
                     f"MLP, router linears) and {sum(left.values()) / 1e9:.2f}B stay {a.dtype} "
                     f"({', '.join(left)})")
    bandwidth = copy_bandwidth(a.device)
    vocab = loaded.model.config.vocab_size
    rows = []

    def hf_baselines(prompts, own: tuple[str, ...]) -> tuple[dict | None, dict | None, dict[str, dict]]:
        """HF generate on `prompts`: on `hf` (where an engine has no HF model of its own in hf_for),
        with a static cache too (--hf-static), and on hf_for's model for each engine weights in `own`."""
        on_hf = bool(set(engines) - set(hf_for))
        default = run_hf(hf, prompts, a.new_tokens, pad_id=0) if on_hf else None
        static = run_hf(hf, prompts, a.new_tokens, pad_id=0, static=True) if a.hf_static and on_hf else None
        return default, static, {w: run_hf(hf_for[w], prompts, a.new_tokens, pad_id=0) for w in own}

    # HF on the engine's own model (shape_models found no room for a copy): every HF run, at every N,
    # comes before the first engine build, which changes the model's modules (the fused forward
    # repacks 4-bit linears into the engine's NF4 linears; the stock layers fuse norms). Otherwise
    # HF runs at each N just before the engines, and on hf_for's model just before that weights'.
    shared = hf is loaded.model
    early = {n: hf_baselines(prompts_for(loaded.tokenizer, vocab, n, a.prompt_len), tuple(hf_for))
             for n in a.n} if shared else {}
    for note in notes:
        print(f"note: {note}", flush=True)
    print(f"{'n':>3} {'weights':>8} {'layers':>6} {'ahead':>5} {'pdl':>4} {'policy':>7} {'decode tok/s':>13} {'tail tok/s':>10} "
          f"{'HF tok/s':>9} {'vs HF':>6} {'vs floor':>8} {'TTFT s':>7} {'1st TTFT s':>10} {'HF TTFT s':>9} "
          f"{'KV B/session':>13}"
          + (f" {'HF static tok/s':>15} {'vs static':>9}" if a.hf_static else ""), flush=True)
    for n in a.n:
        prompts = prompts_for(loaded.tokenizer, vocab, n, a.prompt_len)
        hf_default, hf_static, hf_own = early[n] if shared else hf_baselines(prompts, ())
        for w, eng in engines.items():
            hf_res = (hf_own[w] if w in hf_own else
                      run_hf(hf_for[w], prompts, a.new_tokens, pad_id=0) if w in hf_for else hf_default)
            policies = a.policies if len(engines) == 1 or w != "float32" else (a.float32_policies or ["s5"])
            for layers, overlap, pdl, stall, budget, policy in [
                    (x, o, d, st, b, p) for x in a.layers for o in a.overlap for d in a.pdl
                    for st in a.max_decode_stall_ms for b in a.max_batched_tokens for p in policies]:
                ran = stock_for.get(w, eng) if layers == "stock" else eng
                res = run_engine(ran, policy, prompts, a.new_tokens, a.device, warm_up=not a.no_warm_up,
                                 fused_layers=layers == "fused",
                                 nf4_kernels=layers == "fused", overlap_steps=overlap == "on", pdl=pdl == "on",
                                 max_decode_stall_ms=stall, max_num_batched_tokens=budget)
                layers = res.pop("layers")
                pdl = "on" if res.pop("pdl") else "off"  # on: asked for and supported by the device
                floor = None
                if bandwidth:  # one step reads the weights once and every row's resident K/V
                    floor = n / ((step_weight_bytes(ran.model, n) + n * res["kv_bytes_per_session"]) / bandwidth)
                label = a.dtype if w == "float32" else w  # "float32" = the --dtype weights
                row = {"n": n, "weights": label, "layers": layers, "overlap": overlap, "pdl": pdl, "policy": policy,
                       "max_decode_stall_ms": stall, "max_batched_tokens": res.pop("token_budget"), **res, "hf_decode_tok_s": hf_res["decode_tok_s"],
                       "hf_ttft_s": hf_res["ttft_s"], "floor_tok_s": floor,
                       "hf_static_decode_tok_s": hf_static["decode_tok_s"] if hf_static and w not in hf_for else None,
                       "peak_memory_bytes": torch.cuda.max_memory_allocated() if a.device.startswith("cuda") else None}
                rows.append(row)
                rate = res["decode_tok_s"] or res["decode_tail_tok_s"]  # no all-rows window: the tail rate
                warm = res["first_ttft_s"] is not None
                vs_floor = f"{rate / floor:>7.3f}x" if floor else f"{'-':>8}"
                shown = f"{res['decode_tok_s']:>13.1f}" if res["decode_tok_s"] else f"{'(tail) ' + format(rate, '.1f'):>13}"
                print(f"{n:>3} {label:>8} {layers:>6} {overlap:>5} {pdl:>4} {policy:>7} {shown} {res['decode_tail_tok_s']:>10.1f} "
                      f"{hf_res['decode_tok_s']:>9.1f} {rate / hf_res['decode_tok_s']:>5.2f}x {vs_floor} "
                      f"{res['ttft_s']:>7.2f} {format(res['first_ttft_s'], '.2f') if warm else '-':>10} "
                      f"{hf_res['ttft_s']:>9.2f} {res['kv_bytes_per_session']:>13}"
                      + (f" {row['hf_static_decode_tok_s']:>15.1f} {rate / row['hf_static_decode_tok_s']:>8.2f}x"
                         if row["hf_static_decode_tok_s"] else "")
                      + (f"  (stall {'auto' if stall is None else format(stall, 'g')} ms, {row['max_batched_tokens']} tokens/step: TTFT "
                         f"p50 {res['ttft_p50_s']:.3f} s, ITL p50/p99 {res['itl_p50_s'] * 1e3:.2f}/"
                         f"{res['itl_p99_s'] * 1e3:.2f} ms)"
                         if len(a.max_decode_stall_ms) > 1 or len(a.max_batched_tokens) > 1 else ""), flush=True)
    qualities = {}
    if not a.no_quality and "float32" in engines and not a.shape:
        for w in engines:
            if w != "float32":
                qualities[w] = q = quality(engines[w], engines["float32"], a.device, a.model, w, a.quality_docs)
                ag, ppl, c = q["greedy_agreement_vs_float32"], q["perplexity"], q["recall_cases"]
                print(f"{w}: greedy agreement with float32 {ag['token_agreement']:.1%} of tokens, "
                      f"{ag['identical']}/{ag['prompts']} sequences identical; quick recall "
                      f"native {q['recall_quick']['native']}/{c} (float32 {q['recall_quick_float32']['native']}/{c}), "
                      f"s5 {q['recall_quick']['s5']}/{c} (float32 {q['recall_quick_float32']['s5']}/{c}); cells "
                      f"differing from float32: {sum(map(len, q['recall_cells_differing_from_float32'].values()))}; "
                      f"s5 cells below native-1: {len(q['recall_regressions'])}; perplexity over {ppl['docs']} documents "
                      f"exact {ppl[w]['exact']:.3f} vs {ppl['float32']['exact']:.3f} ({ppl['ratio']['exact']:.4f}x), "
                      f"s5 {ppl[w]['s5']:.3f} vs {ppl['float32']['s5']:.3f} ({ppl['ratio']['s5']:.4f}x)", flush=True)
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else cpu_name()
    commit = git_commit()
    import transformers

    result = {
        "bench": "throughput", "device": dev, "model": a.model, "dtype": a.dtype,
        "copy_bandwidth_bytes_s": bandwidth, "weight_bytes": weight_bytes,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "commit": commit,
                     "engine_source_sha256": source_digest()},
        "workload": {"name": "decode-1238", "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                     "greedy": True, "ignore_eos": True, "threads": torch.get_num_threads(),
                     "engine_warm_up": not a.no_warm_up},
        "rows": rows, "quality": qualities, "notes": notes, "bnb_4bit_coverage": coverage,
    }
    kind = "cuda" if a.device.startswith("cuda") else "cpu"
    write_result(a.out, f"throughput-{kind}{'-' + a.shape if a.shape else ''}", result, a.tag)


if __name__ == "__main__":
    main()
