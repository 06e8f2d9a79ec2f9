"""Recall and fidelity of restored-S5 against native attention, on the embedded model.

Four measurements, each per KV policy (native; s5 with the default sink+window; s5 with a small
window; and the control, sink+window on every layer, full-attention layers included):

1. Needle grid: passkey and key-value needles (several phrasings, three kinds of filler, all
   generated here) at prompt lengths x depths, `--cases` per cell. A case is recalled when the
   greedy answer contains the needle's value.
2. Multi-turn recall: a needle in turn 1 of a session, 2-6 unrelated turns, then the question.
   This is what sessions do: every turn is a new forward, so s5's bounded layers have dropped the
   needle by the time it is asked for; only the exact full-attention layers still hold it.
3. Perplexity on a fixed public-domain corpus (bench/corpus): a 1,024-token prefix as one forward,
   then 512 tokens each scored from its own forward (the decode regime, the hardest for s5). The
   logits come from a full recompute under each policy's mask (DESIGN.md section 1), which the
   engine matches step by step (tests/equivalence/test_s5_oracle.py).
4. Greedy agreement: 64 greedy tokens through the engine from corpus prompts (768 tokens), compared
   position by position with native's.

Prints tables, writes JSON (and, with matplotlib installed, one depth x length heatmap per policy)
to bench/results/. `--quick` is the CI variant: it exits non-zero if any cell has s5 recall
below native recall minus one case.

    python -m bench.recall --quick          # ~6 minutes on 2 CPU cores
    python -m bench.recall                  # the full CPU grid (see README for its runtime)
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch

from engine import Engine, EngineConfig, Request, SamplingParams
from engine.model.hf_adapter import geometry
from engine.model.loader import LoadedModel, load_model

CORPUS = Path(__file__).parent / "corpus" / "devils_dictionary.txt"

# policy name -> EngineConfig overrides
POLICIES: dict[str, dict] = {
    "native": dict(kv_policy="native"),
    "s5": dict(kv_policy="s5"),
    "s5-w16": dict(kv_policy="s5", kv_window=16),
    "s5-w256": dict(kv_policy="s5", kv_window=256),
    "control": dict(kv_policy="sink-window"),
}

# (needle sentence, question that ends where the value should follow)
PASSKEY_PHRASINGS = [
    ("The pass key is {v}. Remember it. {v} is the pass key.", "What is the pass key? The pass key is"),
    ("The secret number is {v}. Keep it in mind: {v}.", "What is the secret number? The secret number is"),
    ("Note for later: the access code is {v}.", "What is the access code? The access code is"),
]
KV_PHRASINGS = [
    ("The {k} vault opens with the code {v}.", "Which code opens the {k} vault? The {k} vault opens with the code"),
    ("In the ledger, the {k} account has the number {v}.", "What is the number of the {k} account? The {k} account has the number"),
]
COLORS = "amber crimson silver violet golden emerald scarlet ivory cobalt copper".split()
NOUNS = "harbor lantern meadow orchard falcon citadel river garden beacon quarry".split()
FILLERS = ("repeat", "prose", "facts")
REPEAT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
HEAD = "There is important information hidden inside a lot of irrelevant text. Find it and memorize it."


def corpus_text() -> str:
    text = CORPUS.read_text()
    return text.split("\n\n", 1)[1]  # drop the provenance header


@dataclass
class Needle:
    prompt: list[int]
    value: str
    kind: str  # passkey | kv
    filler: str


class NeedleMaker:
    """Builds needle prompts of an exact-ish token length from sentences tokenized once."""

    def __init__(self, tokenizer, seed: int = 0) -> None:
        self.tok = tokenizer
        rng = random.Random(seed)
        prose = [s.strip() + "." for s in corpus_text().replace("\n", " ").split(". ") if len(s.strip()) > 20]
        facts = [f"The {rng.choice(COLORS)} {rng.choice(NOUNS)} was {rng.choice(['quiet', 'busy', 'closed', 'open', 'empty', 'crowded'])} "
                 f"on day {rng.randrange(1, 400)}." for _ in range(4000)]
        self.sentences = {"repeat": [REPEAT], "prose": prose, "facts": facts}
        self.ids = {k: [self._ids(" " + s) for s in v] for k, v in self.sentences.items()}

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def filler(self, kind: str, n_tokens: int, start: int) -> list[list[int]]:
        pool, out, total, i = self.ids[kind], [], 0, start
        while total < n_tokens:
            s = pool[i % len(pool)]
            out.append(s)
            total += len(s)
            i += 1
        return out

    def make(self, length: int, depth: float, case: int, rng: random.Random) -> Needle:
        filler = FILLERS[case % len(FILLERS)]
        value = str(rng.randrange(10000, 100000))
        if case % 2 == 0:
            needle, question = PASSKEY_PHRASINGS[(case // 2) % len(PASSKEY_PHRASINGS)]
            kind, key = "passkey", ""
        else:
            needle, question = KV_PHRASINGS[(case // 2) % len(KV_PHRASINGS)]
            kind, key = "kv", f"{rng.choice(COLORS)} {rng.choice(NOUNS)}"
        head = [self.tok.bos_token_id] + self._ids(HEAD)
        nd = self._ids(" " + needle.format(v=value, k=key))
        q = self._ids("\n" + question.format(k=key))
        budget = max(0, length - len(head) - len(nd) - len(q))
        sents = self.filler(filler, budget, start=rng.randrange(10**6))
        # trim to the budget, then put the needle before sentence `at`
        while sents and sum(map(len, sents)) > budget:
            sents.pop()
        at = round(depth * len(sents))
        body = [t for s in sents[:at] for t in s] + nd + [t for s in sents[at:] for t in s]
        return Needle(head + body + q, value, kind, filler)


def policy_config(name: str, base: EngineConfig, max_len: int, loaded: LoadedModel,
                  configs: dict[str, dict] | None = None) -> EngineConfig:
    """The base config under a policy (named in `configs`, default POLICIES), with paged KV for
    every row at `max_len` (+ answer)."""
    g = geometry(loaded.model)
    per_token = sum(2 * h * d * 4 for h, d in g.kv_shapes)  # upper bound: all layers paged
    need = base.max_rows * (max_len + 256) * per_token
    overrides = (configs or POLICIES)[name]
    return EngineConfig(**{**base.__dict__, **overrides, "kv_cache_bytes": max(base.kv_cache_bytes, need)})


def run_requests(engine: Engine, reqs: list[Request]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        for o in engine.step():
            if o.error:
                raise RuntimeError(f"{o.request_id}: {o.error}")
            out[o.request_id].extend(o.new_token_ids)
    engine.check_invariants()
    return out


def needle_grid(loaded, base, policies, lengths, depths, cases, configs: dict[str, dict] | None = None) -> dict:
    maker = NeedleMaker(loaded.tokenizer)
    needles = {}
    for length in lengths:
        for depth in depths:
            rng = random.Random(length * 1000 + round(depth * 100))
            for c in range(cases):
                needles[(length, depth, c)] = maker.make(length, depth, c, rng)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    res = {}
    for policy in policies:
        t0 = time.perf_counter()
        engine = Engine(policy_config(policy, base, max(lengths), loaded, configs), loaded)
        ids = {k: f"n{i}" for i, k in enumerate(needles)}
        out = run_requests(engine, [Request(ids[k], n.prompt, params) for k, n in needles.items()])
        hits = {k: needles[k].value in loaded.tokenizer.decode(out[ids[k]]) for k in needles}
        res[policy] = hits
        print(f"  needles {policy:>8}: {sum(hits.values())}/{len(hits)} in {time.perf_counter() - t0:.0f} s",
              flush=True)
    return {"needles": needles, "hits": res}


def multi_turn(loaded, base, policies, gaps, cases, configs: dict[str, dict] | None = None) -> dict:
    """The embedded model is a base model, so a session is one document fed in turns: turn 1
    carries the needle, each later turn more text (the model continues each turn for 16 tokens,
    which join the history), the last turn asks for the value."""
    tok = loaded.tokenizer
    maker = NeedleMaker(tok, seed=1)
    prose = maker.sentences["prose"]
    res = {}
    for policy in policies:
        engine = Engine(policy_config(policy, base, 4096, loaded, configs), loaded)
        hits = {}
        for gap in gaps:
            rng = random.Random(gap)
            sids = [engine.create_session() for _ in range(cases)]  # one session per case
            values = [str(rng.randrange(10000, 100000)) for _ in range(cases)]
            texts = []
            for c in range(cases):
                needle, question = PASSKEY_PHRASINGS[c % len(PASSKEY_PHRASINGS)]
                t = [HEAD + " " + needle.format(v=values[c]) + " "
                     + " ".join(prose[rng.randrange(len(prose))] for _ in range(4))]
                t += ["\n\n" + " ".join(prose[rng.randrange(len(prose))] for _ in range(6)) for _ in range(gap)]
                t += ["\n\n" + question]
                texts.append(t)
            for i in range(gap + 2):
                last = i == gap + 1
                reqs = []
                for c, sid in enumerate(sids):
                    ids = tok(texts[c][i], add_special_tokens=False)["input_ids"]
                    if i == 0:
                        ids = [tok.bos_token_id] + ids
                    params = SamplingParams(max_tokens=10 if last else 16, temperature=0.0, ignore_eos=not last)
                    reqs.append(Request(f"{sid}-{i}", ids, params, session_id=sid))
                out = run_requests(engine, reqs)
            for c, sid in enumerate(sids):
                hits[(gap, c)] = values[c] in tok.decode(out[f"{sid}-{gap + 1}"])
                engine.close_session(sid)
        res[policy] = hits
        print(f"  multi-turn {policy:>8}: {sum(hits.values())}/{len(hits)}", flush=True)
    return res


def policy_masks(forward_starts: torch.Tensor, layer_types, native_window, sink, window, policy) -> dict:
    """DESIGN.md section 1 masks [1, 1, T, T] per layer type, vectorised."""
    t = forward_starts.shape[0]
    q = torch.arange(t)[:, None]
    k = torch.arange(t)[None, :]
    f = forward_starts[:, None]
    masks = {}
    for kind in set(layer_types):
        sliding = kind == "sliding_attention"
        m = k <= q
        if sliding and native_window:
            m &= (q - k) < native_window
        if (POLICIES[policy]["kv_policy"] == "s5" and sliding) or POLICIES[policy]["kv_policy"] == "sink-window":
            m &= (forward_starts[None, :] == f) | (k < sink) | (k >= f - window)
        masks[kind] = m[None, None]
    return masks


@torch.inference_mode()
def perplexity(ref_model, tokenizer, policies, docs: int, prefix: int = 1024, scored: int = 512) -> dict:
    ids = tokenizer(corpus_text(), add_special_tokens=False)["input_ids"]
    length = prefix + scored
    starts = [i * (len(ids) - length) // max(1, docs - 1) for i in range(docs)] if docs > 1 else [0]
    cfg = ref_model.config
    fs = torch.cat([torch.zeros(prefix, dtype=torch.long), torch.arange(prefix, length)])
    res = {}
    for policy in policies:
        o = POLICIES[policy]
        window = o.get("kv_window", EngineConfig.kv_window)
        masks = policy_masks(fs, cfg.layer_types, cfg.sliding_window, EngineConfig.kv_sink, window, policy)
        nll, n = 0.0, 0
        for s in starts:
            x = torch.tensor([[tokenizer.bos_token_id] + ids[s : s + length - 1]])
            logits = ref_model(input_ids=x, attention_mask=masks, use_cache=False).logits[0].float()
            lp = torch.log_softmax(logits[prefix - 1 : length - 1], dim=-1)
            target = x[0, prefix:length]
            nll -= lp.gather(1, target[:, None]).sum().item()
            n += target.numel()
        res[policy] = float(torch.exp(torch.tensor(nll / n)))
        print(f"  perplexity {policy:>8}: {res[policy]:.3f} over {n} tokens", flush=True)
    return res


def agreement_prompts(tokenizer, num: int, length: int) -> list[list[int]]:
    ids = tokenizer(corpus_text(), add_special_tokens=False)["input_ids"]
    step = (len(ids) - length) // max(1, num)
    return [[tokenizer.bos_token_id] + ids[i * step : i * step + length - 1] for i in range(num)]


def greedy_tokens(loaded, cfg: EngineConfig, prompts, new_tokens: int = 64) -> list[list[int]]:
    engine = Engine(cfg, loaded)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    out = run_requests(engine, [Request(f"a{i}", p, params) for i, p in enumerate(prompts)])
    return [out[f"a{i}"] for i in range(len(prompts))]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Share of positions with the same token, and of sequences identical throughout."""
    same = sum(x == y for sa, sb in zip(a, b) for x, y in zip(sa, sb))
    total = sum(min(len(sa), len(sb)) for sa, sb in zip(a, b))
    return {"token_agreement": same / max(1, total), "identical": sum(sa == sb for sa, sb in zip(a, b)),
            "prompts": len(a)}


def cell_table(hits: dict, lengths, depths, cases) -> dict:
    return {f"{length}": {f"{depth:g}": sum(hits[(length, depth, c)] for c in range(cases)) for depth in depths}
            for length in lengths}


def check_quick(tables: dict) -> list[str]:
    """Cells where s5 recall < native recall - 1 case."""
    bad = []
    for length, row in tables["native"].items():
        for depth, n in row.items():
            s = tables["s5"][length][depth]
            if s < n - 1:
                bad.append(f"length {length} depth {depth}: s5 {s} < native {n} - 1")
    return bad


def heatmaps(tables: dict, lengths, depths, cases, out: Path, tag: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no heatmaps written")
        return []
    paths = []
    fig, axes = plt.subplots(1, len(tables), figsize=(3.2 * len(tables), 3.4), squeeze=False)
    for ax, (policy, table) in zip(axes[0], tables.items()):
        grid = [[table[f"{length}"][f"{d:g}"] / cases for length in lengths] for d in depths]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        ax.set_xticks(range(len(lengths)), [f"{length // 1024}k" if length >= 1024 else str(length) for length in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_title(policy)
        ax.set_xlabel("prompt tokens")
        if ax is axes[0][0]:
            ax.set_ylabel("needle depth")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{round(v * cases)}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="recall")
    path = out / f"recall-heatmap-{tag}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    paths.append(str(path))
    return paths


def main(argv: list[str] | None = None, loaded: LoadedModel | None = None, reference=None) -> int:
    """Runs the benchmark; `loaded` / `reference` (the float32 sdpa model for perplexity) may be
    passed in by a caller that already holds them. Returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the CI variant (fails on an s5 recall regression)")
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--quantization", default="int8", help="engine weights: int8 or none")
    ap.add_argument("--lengths", type=int, nargs="+")
    ap.add_argument("--depths", type=float, nargs="+")
    ap.add_argument("--cases", type=int)
    ap.add_argument("--policies", nargs="+", choices=sorted(POLICIES))
    ap.add_argument("--fidelity-policies", nargs="+", choices=sorted(POLICIES),
                    help="policies for perplexity and agreement (default: --policies, plus s5-w256 in the full run)")
    ap.add_argument("--gaps", type=int, nargs="+", help="unrelated turns between needle and question")
    ap.add_argument("--multi-turn-policies", nargs="+", choices=sorted(POLICIES),
                    help="policies for the multi-turn part (default: --policies)")
    ap.add_argument("--agreement-prompts", type=int)
    ap.add_argument("--agreement-len", type=int, default=768, help="prompt tokens for greedy agreement")
    ap.add_argument("--ppl-docs", type=int)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    quick = a.quick
    lengths = a.lengths or ([512, 1024, 2048] if quick else [512, 1024, 2048, 4096, 8192])
    depths = a.depths or ([0.0, 0.5, 1.0] if quick else [0.0, 0.25, 0.5, 0.75, 1.0])
    cases = a.cases or (2 if quick else 5)
    policies = a.policies or (["native", "s5", "control"] if quick else ["native", "s5", "s5-w16", "control"])
    fid_policies = a.fidelity_policies or (policies if quick or a.policies else [*policies, "s5-w256"])
    if "native" not in fid_policies:
        fid_policies = ["native", *fid_policies]
    # the quick variant keeps the whole needle grid it checks and a smaller sample of the rest
    gaps = a.gaps or ([2] if quick else [2, 3, 4, 5, 6])
    n_agree = a.agreement_prompts if a.agreement_prompts is not None else (4 if quick else 50)
    n_docs = a.ppl_docs if a.ppl_docs is not None else (1 if quick else 16)
    quant = None if a.quantization in ("none", "None", "") else a.quantization
    if quick and not {"native", "s5"} <= set(policies):
        ap.error("--quick compares s5 with native: keep both in --policies")

    base = EngineConfig(model=a.model, quantization=quant, max_rows=8, max_num_batched_tokens=1024)
    loaded = loaded or load_model(base)
    t_start = time.perf_counter()
    print(f"recall: lengths {lengths}, depths {depths}, {cases} cases/cell, policies {policies}, "
          f"weights {quant or 'float32'}", flush=True)
    phases = {}  # seconds per part of the run
    grid = needle_grid(loaded, base, policies, lengths, depths, cases)
    tables = {p: cell_table(grid["hits"][p], lengths, depths, cases) for p in policies}
    phases["needle_grid"] = time.perf_counter() - t_start
    mt_policies = a.multi_turn_policies or policies
    mt = multi_turn(loaded, base, mt_policies, gaps, max(2, cases))
    phases["multi_turn"] = time.perf_counter() - t_start - sum(phases.values())
    mt_by_gap = {p: {str(g): sum(v for (gg, _), v in mt[p].items() if gg == g) for g in gaps} for p in mt_policies}

    greedy_by_policy = {}
    if n_agree:
        prompts = agreement_prompts(loaded.tokenizer, n_agree, a.agreement_len)
        for p in fid_policies:
            greedy_by_policy[p] = greedy_tokens(loaded, policy_config(p, base, a.agreement_len + 64, loaded), prompts)
    agree = {p: agreement(greedy_by_policy[p], greedy_by_policy["native"]) for p in greedy_by_policy
             if "native" in greedy_by_policy}
    phases["agreement"] = time.perf_counter() - t_start - sum(phases.values())
    ppl = {}
    if n_docs:
        from transformers import AutoModelForCausalLM

        from engine.model.source import embedded_dir

        ref = reference
        if ref is None:
            path = str(embedded_dir()) if a.model == "embedded" else a.model
            ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
        ppl = perplexity(ref, loaded.tokenizer, fid_policies, n_docs)
        del ref
    elapsed = time.perf_counter() - t_start
    phases["perplexity"] = elapsed - sum(phases.values())

    # ---- report ---------------------------------------------------------------------------------
    print(f"\nneedle recall, cases recalled of {cases} per cell (length x depth)")
    print(f"{'length':>7} {'depth':>6} " + " ".join(f"{p:>8}" for p in policies))
    for length in lengths:
        for d in depths:
            print(f"{length:>7} {d:>6.0%} " + " ".join(f"{tables[p][str(length)][f'{d:g}']:>8}" for p in policies))
    total = len(lengths) * len(depths) * cases
    print(f"{'total':>14} " + " ".join(f"{sum(grid['hits'][p].values()):>8}" for p in policies) + f"  of {total}")
    by_kind = {p: {k: f"{sum(v for key, v in grid['hits'][p].items() if grid['needles'][key].kind == k)}"
                      f"/{sum(1 for key in grid['needles'] if grid['needles'][key].kind == k)}"
                   for k in ("passkey", "kv")} for p in policies}
    by_filler = {p: {f: f"{sum(v for key, v in grid['hits'][p].items() if grid['needles'][key].filler == f)}"
                        f"/{sum(1 for key in grid['needles'] if grid['needles'][key].filler == f)}"
                     for f in FILLERS} for p in policies}
    for p in policies:
        print(f"  {p:>8}: by needle {by_kind[p]}, by filler {by_filler[p]}")
    print(f"\nmulti-turn recall (needle in turn 1, question after N unrelated turns; of {max(2, cases)} per gap)")
    print(f"{'gap':>4} " + " ".join(f"{p:>8}" for p in mt_policies))
    for g in gaps:
        print(f"{g:>4} " + " ".join(f"{mt_by_gap[p][str(g)]:>8}" for p in mt_policies))
    if ppl or agree:
        print("\nfidelity on the corpus")
        print(f"{'policy':>8} {'perplexity':>10} {'token agreement':>16} {'identical 64':>13}")
        for p in fid_policies:
            pp = f"{ppl[p]:>10.3f}" if p in ppl else f"{'-':>10}"
            ag = agree.get(p)
            print(f"{p:>8} {pp} {ag['token_agreement'] if ag else 0:>15.1%} "
                  f"{(str(ag['identical']) + '/' + str(ag['prompts'])) if ag else '-':>13}")
    print(f"\nran in {elapsed / 60:.1f} min (" + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items()) + ")")

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{'quick-' if quick else ''}{'cpu' if base.device == 'cpu' else 'cuda'}-{quant or 'float32'}"
    bad = check_quick(tables) if {"native", "s5"} <= set(policies) else []
    pngs = [] if quick else heatmaps(tables, lengths, depths, cases, out, tag)
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        commit = None
    import transformers

    result = {
        "bench": "recall", "quick": quick, "model": loaded.name, "weights": quant or "float32",
        "seconds": phases,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "commit": commit},
        "lengths": lengths, "depths": depths, "cases_per_cell": cases, "policies": policies,
        "fidelity_policies": fid_policies, "policy_configs": {p: POLICIES[p] for p in {*policies, *fid_policies}},
        "needle_recall": tables, "needle_by_kind": by_kind, "needle_by_filler": by_filler,
        "multi_turn_recall": mt_by_gap, "multi_turn_cases_per_gap": max(2, cases),
        "perplexity": ppl, "perplexity_regime": "1024-token prefix forward, then 512 tokens one forward each",
        "greedy_agreement_vs_native": agree, "agreement_new_tokens": 64, "agreement_prompt_tokens": a.agreement_len,
        "regressions": bad, "runtime_s": elapsed, "heatmaps": pngs,
    }
    path = out / f"recall-{tag}-{date.today().isoformat()}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}" + (f" and {', '.join(pngs)}" if pngs else ""))
    if bad:
        print("FAIL: s5 recall fell below native recall minus one case in:\n  " + "\n  ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
