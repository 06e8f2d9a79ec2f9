"""The frontier's engine checks (greedy agreement, needles, multi-turn recall), KV bytes per
session, and its table and plot, for bench/fidelity.py.

Settings are named: `native`, `s5-w<W>` (every sliding layer keeps W positions), `alloc-<f>`
(per-layer windows solved within f of native's sliding-layer bytes, from fidelity-ppl-*.json) and
`control` (sink + 64 on every layer).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from bench import recall
from engine import EngineConfig
from engine.kv.policy import layer_layouts
from engine.model.hf_adapter import geometry

CONTEXTS = (1024, 4096, 16384)


def setting_configs(ppl: dict) -> dict[str, dict]:
    """EngineConfig overrides per named setting of a fidelity-ppl JSON."""
    out = {"native": dict(kv_policy="native")}
    for w in sorted(ppl["uniform"], key=int):
        out[f"s5-w{w}"] = dict(kv_policy="s5", kv_window=int(w))
    out[f"s5-w{ppl['native_window']}"] = dict(kv_policy="s5", kv_window=int(ppl["native_window"]))
    for frac, al in ppl["allocations"].items():
        out[f"alloc-{float(frac):.3f}"] = dict(kv_policy="s5", kv_windows=tuple(al["windows"]))
    out["control"] = dict(kv_policy="sink-window", kv_window=64)
    return out


def session_bytes(geo, overrides: dict, context: int, item: int = 4, block: int = 16) -> dict:
    """K/V bytes a session of `context` tokens holds under a setting (as RowPool accounts them:
    paged layers by blocks, rings by their slots), and the positions its sliding layers keep."""
    cfg = EngineConfig(**overrides)
    lays = layer_layouts(cfg.kv_policy, geo.layer_types, geo.native_window, cfg.kv_sink, cfg.kv_window, cfg.kv_windows)
    total = sliding_positions = sliding_bytes = 0
    for lay, kind, (h, d) in zip(lays, geo.layer_types, geo.kv_shapes):
        pos_bytes = 2 * h * d * item
        n = -(-context // block) * block if lay.paged else lay.ring_slots
        total += n * pos_bytes
        if kind == "sliding_attention":
            sliding_positions += n
            sliding_bytes += n * pos_bytes
    return {"bytes": total, "sliding_positions": sliding_positions, "sliding_bytes": sliding_bytes}


def layer_windows(geo, overrides: dict) -> list[int | None]:
    """Per layer, a setting's bounded window (None: exact), for the recompute paths."""
    cfg = EngineConfig(**overrides)
    lays = layer_layouts(cfg.kv_policy, geo.layer_types, geo.native_window, cfg.kv_sink, cfg.kv_window, cfg.kv_windows)
    return [None if lay.paged or not lay.staged else lay.window for lay in lays]


def checks(a, names: list[str], configs: dict[str, dict]) -> dict:
    """Per setting: greedy agreement with native and the needle grid, from recomputes under each
    layer's DESIGN mask (fidelity_core.Greedy: a prompt is one exact forward, shared by every
    setting; the decoded tokens are forwards of their own), and multi-turn recall through the
    engine (bench/recall.py's)."""
    from bench.fidelity import scorer_model
    from bench.fidelity_core import Greedy
    from engine.model.loader import load_model

    model, tok = scorer_model(a)
    geo = geometry(model)
    windows = {n: layer_windows(geo, configs[n]) for n in names}
    res: dict = {"lengths": a.lengths, "depths": a.depths, "cases": a.cases, "gaps": a.gaps,
                 "agreement_prompts": a.agreement_prompts, "agreement_tokens": a.agreement_tokens}
    out = Path(a.out) / f"fidelity-checks-{a.tag}{a.part}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def note(msg):
        out.write_text(json.dumps(res, indent=1))
        print(f"{msg}  ({time.perf_counter() - t0:.0f} s)", flush=True)

    def greedy(prompt: list[int]) -> Greedy:
        """A prompt's exact forward, kept on disk (`--prompt-cache`) for later settings' runs."""
        if not a.prompt_cache:
            return Greedy(model, prompt, sink=a.sink)
        import hashlib

        import torch

        path = Path(a.prompt_cache) / (hashlib.sha1(str(prompt).encode()).hexdigest() + ".pt")
        if path.is_file():
            g = Greedy.__new__(Greedy)
            g.__dict__.update(torch.load(path, weights_only=False))
            g.model = model
            return g
        g = Greedy(model, prompt, sink=a.sink)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v for k, v in g.__dict__.items() if k != "model"}, path)
        return g

    if a.agreement_prompts:
        seqs: dict[str, list[list[int]]] = {n: [] for n in names}
        for p in recall.agreement_prompts(tok, a.agreement_prompts, 768):
            g = greedy(p)
            for n in names:
                seqs[n].append(g.tokens(windows[n], a.agreement_tokens))
        res["agreement"] = {n: recall.agreement(seqs[n], seqs["native"]) for n in names}
        note("agreement: " + ", ".join(f"{n} {v['token_agreement']:.1%}" for n, v in res["agreement"].items()))
    if a.lengths:
        maker = recall.NeedleMaker(tok)
        hits: dict[str, dict] = {n: {} for n in names}
        done = []
        for length in a.lengths:
            for depth in a.depths:
                rng = random.Random(length * 1000 + round(depth * 100))
                for c in range(a.cases):
                    needle = maker.make(length, depth, c, rng)
                    g = greedy(needle.prompt)
                    for n in names:
                        hits[n][(length, depth, c)] = needle.value in tok.decode(g.tokens(windows[n], 10))
            done.append(length)
            res["needles"] = {n: recall.cell_table(hits[n], done, a.depths, a.cases) for n in names}
            note(f"needles to {length}: " + ", ".join(f"{n} {sum(h.values())}" for n, h in hits.items()))
    if a.gaps:
        del model
        loaded = load_model(EngineConfig(model=a.model, quantization=a.quant))
        base = EngineConfig(model=a.model, quantization=a.quant, max_rows=8, max_num_batched_tokens=1024)
        mt = recall.multi_turn(loaded, base, names, a.gaps, a.cases, configs)
        res["multi_turn"] = {n: {str(g): sum(v for (gg, _), v in mt[n].items() if gg == g) for g in a.gaps}
                             for n in names}
        # per case (1: recalled), so settings compare case by case against native
        res["multi_turn_cases"] = {n: {str(g): [int(mt[n][(g, c)]) for c in range(a.cases)] for g in a.gaps}
                                   for n in names}
        note(f"multi-turn: {res['multi_turn']}")
        for n in names[1:]:
            pairs = [(mt["native"][k], mt[n][k]) for k in mt["native"]]
            note(f"multi-turn {n} against native, case by case: {sum(x and not y for x, y in pairs)} lost, "
                 f"{sum(y and not x for x, y in pairs)} gained of {len(pairs)}")
    print(f"wrote {out}")
    return res


def frontier(a, ppl: dict, found: dict | None, geo, held: dict | None = None) -> list[dict]:
    """One row per setting: perplexities (on the profile's document, and on held-out ones),
    agreement, recall, bytes; printed as a table."""
    configs = setting_configs(ppl)
    extra = [n for n in (held or {}).get("ppl", {}) if n.startswith("s5-w") and n not in configs]
    if extra:  # windows scored on the held-out documents only
        uniform = sorted([n for n in configs if n.startswith("s5-w")] + extra, key=lambda n: int(n[4:]))
        configs = {"native": configs["native"], **{n: configs.get(n, dict(kv_policy="s5", kv_window=int(n[4:])))
                                                   for n in uniform},
                   **{n: c for n, c in configs.items() if n != "native" and not n.startswith("s5-w")}}
    native = ppl["native"]
    rows = []
    for name, ov in configs.items():
        if name == "native":
            p = native
        elif name == "control":
            p = ppl.get("control", {})
        elif name.startswith("alloc-"):
            p = ppl["allocations"][next(f for f in ppl["allocations"] if f"alloc-{float(f):.3f}" == name)]
        else:
            w = int(name[4:])
            p = ppl["uniform"].get(str(w), ppl["uniform"].get(w, native if w >= ppl["native_window"] else {}))
        row = {"setting": name, "config": {k: list(v) if isinstance(v, tuple) else v for k, v in ov.items()},
               "ppl_decode": p.get("decode"), "ppl_prefill": p.get("prefill"),
               **{f"bytes_{c}": session_bytes(geo, ov, c)["bytes"] for c in CONTEXTS},
               **{k: v for k, v in session_bytes(geo, ov, CONTEXTS[-1]).items() if k.startswith("sliding")}}
        if held and name in held["ppl"]:
            row["heldout_decode"] = held["ppl"][name].get("decode")
            row["heldout_prefill"] = held["ppl"][name].get("prefill")
        if found:
            ag = (found.get("agreement") or {}).get(name)
            row["agreement"] = ag["token_agreement"] if ag else None
            if name in (found.get("needles") or {}):
                row["needles"] = sum(sum(r.values()) for r in found["needles"][name].values())
            if name in (found.get("multi_turn") or {}):
                row["multi_turn"] = sum(found["multi_turn"][name].values())
        rows.append(row)
    nat = rows[0]
    print(f"{'setting':>12} {'ppl decode':>11} {'prefill':>9} {'agree':>6} {'needles':>7} {'turns':>5} "
          f"{'sliding pos':>11} {'KiB@1k':>7} {'KiB@4k':>7} {'KiB@16k':>8}")
    for r in rows:
        rel = f"{r['ppl_decode']:.2f} {r['ppl_decode'] / nat['ppl_decode'] - 1:+.1%}" if r["ppl_decode"] else "-"
        pre = f"{r['ppl_prefill']:.2f}" if r.get("ppl_prefill") else "-"
        ag = f"{r['agreement']:.0%}" if r.get("agreement") is not None else "-"
        print(f"{r['setting']:>12} {rel:>11} {pre:>9} {ag:>6} {str(r.get('needles', '-')):>7} "
              f"{str(r.get('multi_turn', '-')):>5} {r['sliding_positions']:>11} "
              + " ".join(f"{r[f'bytes_{c}'] // 1024:>7}" for c in CONTEXTS))
    return rows


def markdown(rows: list[dict]) -> str:
    """The frontier as a markdown table (docs/fidelity.md)."""
    nat = rows[0]
    lines = ["| setting | sliding positions kept | KiB/session 1k / 4k / 16k | ppl decode, held-out docs (vs native) | "
             "ppl prefill, held-out docs | ppl decode, profile doc | ppl prefill, profile doc | greedy agreement | "
             "needles | multi-turn |", "|" + " --- |" * 10]

    def rel(r, key):
        return f"{r[key]:.2f} ({r[key] / nat[key] - 1:+.1%})" if r.get(key) and nat.get(key) else "-"

    for r in rows:
        dec, hpre = rel(r, "heldout_decode"), rel(r, "heldout_prefill")
        prof, pre = rel(r, "ppl_decode"), rel(r, "ppl_prefill")
        ag = f"{r['agreement']:.1%}" if r.get("agreement") is not None else "-"
        kib = " / ".join(str(r[f"bytes_{c}"] // 1024) for c in CONTEXTS)
        lines.append(f"| {r['setting']} | {r['sliding_positions']} | {kib} | {dec} | {hpre} | {prof} | {pre} | {ag} | "
                     f"{r.get('needles', '-')} | {r.get('multi_turn', '-')} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot written")
        return None
    key = "heldout_decode" if rows[0].get("heldout_decode") else "ppl_decode"
    nat = rows[0][key]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for kind, marker, color in (("s5-w", "o", "tab:blue"), ("alloc-", "s", "tab:green"), ("native", "*", "black"),
                                ("control", "x", "tab:red")):
        pts = sorted((r["sliding_bytes"] / 1024, r[key] / nat, r["setting"]) for r in rows
                     if r["setting"].startswith(kind) and r.get(key))
        if not pts:
            continue
        xs, ys, names = zip(*pts)
        ax.plot(xs, ys, marker=marker, color=color, linestyle="-" if kind == "s5-w" else "none",
                label={"s5-w": "s5, one window", "alloc-": "s5, per-layer windows"}.get(kind, kind))
        for x, y, n in pts:
            ax.annotate(n.replace("s5-", "").replace("alloc-", "b="), (x, y), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
    ax.axhline(1.05, color="grey", linestyle=":", linewidth=1)
    ax.axhline(1.02, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("K/V bytes per session on the sliding layers (KiB, log; the full layers add the same to each)")
    ax.set_ylabel("decode-regime perplexity / native" + (" (held-out documents)" if key == "heldout_decode" else ""))
    ax.set_title("restored-S5: text quality against memory")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return str(path)


def _merge(into: dict, part: dict) -> None:
    for key, value in part.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif isinstance(value, list) and isinstance(into.get(key), list):
            into[key] = sorted(set(into[key]) | set(value))
        else:
            into[key] = value


def report(a) -> dict:
    from transformers import AutoConfig

    from bench.fidelity import model_dir

    ppl = json.loads((Path(a.out) / f"fidelity-ppl-{a.tag}.json").read_text())
    found: dict = {}
    for path in sorted(Path(a.out).glob(f"fidelity-checks-{a.tag}*.json")):  # the parts, merged
        _merge(found, json.loads(path.read_text()))

    class _Shape:  # geometry() reads a model's config (and generation config) only
        def __init__(self, cfg):
            self.config, self.generation_config = cfg, cfg

    geo = geometry(_Shape(AutoConfig.from_pretrained(str(model_dir(a)))))
    held: dict = {}
    for path in sorted(Path(a.out).glob(f"fidelity-heldout-{a.tag}*.json")):  # the parts, merged
        _merge(held, json.loads(path.read_text()))
    rows = frontier(a, ppl, found, geo, held)
    print("\n" + markdown(rows) + "\n")
    png = plot(rows, Path(a.out) / f"fidelity-frontier-{a.tag}.png")
    result = {"bench": "fidelity", "model": a.model, "weights": a.quant or "float32", "rows": rows, "plot": png,
              "perplexity": {k: ppl[k] for k in ("docs", "scored_tokens", "sink", "native_window")},
              "regimes": {"decode": "1,024-token prefix, then 256 tokens one forward each",
                          "prefill": "1,024-token prefix, then 256 tokens as forwards of 128"},
              "checks": found, "heldout": held}
    path = Path(a.out) / f"fidelity-frontier-{a.tag}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return result
