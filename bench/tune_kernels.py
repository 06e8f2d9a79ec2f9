"""Launch settings of the decode kernels, measured on the GPU.

Three families of cases, on the BENCH.md shapes:
  attention  the decode attention of a ring layer (sink + window slots) and of a paged exact layer
             (on Gemma 4, with the exact layers' own K/V heads and head size), N rows of about 1,238
             tokens, N in 1..256, each storing its new token as a decode step does (a ring also
             keeping what the slot held, for the undo of a step launched ahead)
  linear     each projection of a decoder layer (QKV, O, gate/up, down) at 1..8 rows (`gemv`), or
             at 9..64 rows (`mma_rows`, and gate/up also with its activation)
  experts    (MoE shapes) the experts kernels' two stages at a few tokens, each routed to top-k
             random experts
Each candidate launch is timed from a CUDA graph that cycles over copies of its operands (256 MB
in all, or 128 copies of the smallest), so that, as in a forward where every layer reads its own
weights and K/V, they are mostly not served from L2. The table gives, per case, the current setting, the library (`F.linear`)
where there is one, and the best candidate, each in us and in GB/s of bytes that must be read,
beside the measured copy bandwidth. JSON goes to bench/results.

    python -m bench.tune_kernels [--shape gemma3-4b gemma3-1b] [--n 1 8 64 256] [--rows 1 2 4 8] [--quick]
    python -m bench.tune_kernels --shape gemma4-26b-a4b --experts 1 8   # the MoE kernels
    python -m bench.tune_kernels --shape gemma4-26b-a4b --n 1 8         # its attention
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from bench.throughput import SHAPES, copy_bandwidth, git_commit, source_digest
from engine.kernels import decode_attention as da
from engine.kernels import small_linear as sl

try:
    from triton.runtime.errors import OutOfResources as triton_errors
except ImportError:  # no Triton: every launch runs the reference
    triton_errors = ()

ROTATE_BYTES = 256 << 20
PROMPT = 1238


def graph_us(calls) -> float:
    """Device time per call of `calls` (one per operand copy), replayed from a CUDA graph (on the
    CPU, where the script only checks itself, wall time of one round)."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) * 1e6 / len(calls)
    reps = max(2, 256 // len(calls))
    return sl.graph_ms(lambda: [c() for c in calls], reps) * 1000 / (reps * len(calls))


def launch_us(make, cfg) -> float | None:
    """`graph_us` of the calls `make(cfg)` gives, or None where this GPU cannot run the launch
    (more shared memory than it has: found when it compiles, before any graph is captured)."""
    try:
        return graph_us(make(cfg))
    except triton_errors:
        return None


def copies_for(nbytes: int) -> int:
    return max(1, min(128, math.ceil(ROTATE_BYTES / max(nbytes, 1)))) if torch.cuda.is_available() else 1


def attention_cases(shape: dict, n: int, page: int, sink: int, window: int, dtype, dev, quick: bool,
                    seed: int = 0, layouts=("ring", "paged"), wide: bool = False):
    """Yields (layout, bytes read per call, current kwargs, candidate kwargs list, make_calls).
    `wide`: also 128-key blocks, one warp, and a ring in three or five splits."""
    g = torch.Generator(device=dev).manual_seed(seed)
    H = shape["num_attention_heads"]
    pos = torch.randint(PROMPT, PROMPT + 128, (n,), device=dev, generator=g)
    rows = torch.arange(n, device=dev)
    grid = list(itertools.product((16, 32, 64), (2, 4, 8), (1, 2, 3)) if not quick else
                itertools.product((16, 32), (4,), (2, 3)))
    if wide:
        grid = list(itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (1, 2, 3)))
    for layout in layouts:
        # the ring holds a sliding layer, the pages an exact one: on Gemma 4 fewer and wider K/V heads
        exact = layout == "paged" and "global_head_dim" in shape
        Hkv = shape["num_global_key_value_heads"] if exact else shape["num_key_value_heads"]
        D = shape["global_head_dim"] if exact else shape["head_dim"]
        scale = D ** -0.5
        if layout == "ring":
            slots = (n + 1) * (sink + window)
            per = n * (sink + window) * Hkv * D * 2 * dtype.itemsize
        else:
            blocks_per_row = math.ceil((PROMPT + 129) / page)
            slots = (n * blocks_per_row + 1) * page
            per = int(pos.sum() + n) * Hkv * D * 2 * dtype.itemsize
        ncopy = copies_for(slots * Hkv * D * 2 * dtype.itemsize)
        stores = [(torch.randn(slots, Hkv, D, device=dev, generator=g).to(dtype),
                   torch.randn(slots, Hkv, D, device=dev, generator=g).to(dtype)) for _ in range(ncopy)]
        q = torch.randn(n, H, D, device=dev, generator=g).to(dtype)
        k_new = torch.randn(n, Hkv, D, device=dev, generator=g).to(dtype)
        v_new = torch.randn(n, Hkv, D, device=dev, generator=g).to(dtype)
        if layout == "ring":
            # as the engine's steps launched ahead: the store also keeps what the slot held
            kept = (torch.empty(n, Hkv, D, device=dev, dtype=dtype), torch.empty(n, Hkv, D, device=dev, dtype=dtype))
            kw = dict(ring=(sink, window), evicted=kept)
            store_slot = rows * (sink + window) + sink + (pos - sink) % window
        else:
            perm = torch.randperm(n * blocks_per_row, device=dev, generator=g).int()
            table = perm.reshape(n, blocks_per_row)
            kw = dict(block_table=table, page=page)
            store_slot = table[rows, pos // page].long() * page + pos % page
        out = torch.empty_like(q)

        def make(cfg, stores=stores, q=q, k_new=k_new, v_new=v_new, kw=kw, store_slot=store_slot, out=out,
                 scale=scale):
            return [lambda ks=ks, vs=vs: da.decode_attention(
                q, ks, vs, rows, pos, scale=scale, k_new=k_new, v_new=v_new, store_slot=store_slot, out=out,
                **kw, **cfg) for ks, vs in stores]

        current = da.launch_for(layout == "paged", n, Hkv, D, dtype.itemsize)
        splits = current["splits"]
        split_options = {1, max(1, splits // 4), max(1, splits // 2), splits, min(64, splits * 2)}
        if wide and layout == "ring":
            split_options |= {3, 5}
        split_options = sorted(split_options)
        cands = []
        for b, w, st in grid:  # a ring takes no more splits than its blocks (decode_attention clamps them)
            splits_here = split_options if layout == "paged" else sorted(
                {min(s, max(1, math.ceil((sink + window) / b))) for s in split_options})
            cands += [c for s in splits_here if (c := dict(splits=s, block=b, warps=w, stages=st)) != current]
        yield layout, per, current, cands, make


def linear_cases(shape: dict, rows: int, dtype, sms: int, dev, seed: int = 0, wide: bool = False):
    g = torch.Generator(device=dev).manual_seed(seed)
    hid, inter = shape["hidden_size"], shape["intermediate_size"]
    H, Hkv, D = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    mp = max(1, 1 << (rows - 1).bit_length())
    # one or two weight rows a program: more programs than SMs by a larger factor, so the last
    # wave leaves fewer SMs idle (1B's down projection: 1,152 rows, 288 programs of 4 on 132 SMs)
    grid = [(bn, bk, w, st) for (bn, bk) in ((1, 1024), (1, 2048), (2, 512), (2, 1024), (2, 2048), (4, 512),
                                             (4, 1024), (8, 256), (8, 512), (16, 128), (16, 256))
            for w in (2, 4, 8) for st in (3, 4) if mp * bn * bk <= 128 * 32 * w and (bn <= 2 or w > 2)]
    if wide:  # deeper pipelines and longer K tiles: more of each program's weight bytes in flight
        grid += [(bn, bk, w, st) for (bn, bk) in ((1, 2048), (1, 4096), (2, 1024), (2, 2048), (2, 4096), (4, 1024))
                 for w in (2, 4, 8) for st in ((5, 6) if bk < 4096 else (3, 4, 5))
                 if mp * bn * bk <= 128 * 32 * w and (bn <= 2 or w > 2)]
    for name, (n, k) in {"qkv": ((H + 2 * Hkv) * D, hid), "o": (hid, H * D), "gate_up": (2 * inter, hid),
                         "down": (hid, inter)}.items():
        ncopy = copies_for(n * k * dtype.itemsize)
        ws = [torch.randn(n, k, device=dev, generator=g).to(dtype) for _ in range(ncopy)]
        x = torch.randn(rows, k, device=dev, generator=g).to(dtype)
        want = F.linear(x.float(), ws[0].float())

        def check(y):
            err = ((y.float() - want).norm() / want.norm()).item()
            assert err < 1e-2, err

        if rows >= sl.MMA_MIN_ROWS:  # tensor-core tiles, and gate/up also with the activation
            yield from mma_cases(name, n, k, x, ws, want, sms, dtype)
            continue
        lib = [lambda w=w: F.linear(x, w) for w in ws]
        split = [lambda w=w: sl.small_linear(x, w, sms) for w in ws]
        check(sl.small_linear(x, ws[0], sms))
        cands = {}
        for bn, bk, w_, st in grid:
            cfg = dict(block_n=bn, block_k=bk, warps=w_, stages=st)
            check(sl.gemv(x, ws[0], **cfg))
            cands[f"gemv bn{bn} bk{bk} w{w_} s{st}"] = [lambda w=w, cfg=cfg: sl.gemv(x, w, **cfg) for w in ws]
        yield name, n * k * dtype.itemsize, lib, split, cands


# `mma_rows` launches timed at 9-64 rows: (block_n, block_k, warps), each at 3 and 4 stages and K
# split in 1, 2, 4 or 8
MMA_GRID = ((32, 64, 4), (32, 128, 4), (64, 64, 4), (64, 128, 4), (128, 64, 8), (128, 128, 8))


def mma_cases(name: str, n: int, k: int, x, ws, want, sms: int, dtype):
    """A projection at 9-64 rows: the library against `mma_rows` launches; gate/up also as the
    forward runs it, with the activation (`gelu_mul` after the library's product). Yields as
    `linear_cases` does, the library's product in both the library and the split-K columns."""
    from engine.kernels.fused_ops import gelu_mul

    counts = torch.zeros(sl.MMA_COUNTS, dtype=torch.int32, device=x.device)
    for gelu in ((False, True) if name == "gate_up" else (False,)):
        ref = gelu_mul(want.to(dtype)).float() if gelu else want
        cands = {}
        for (bn, bk, w_), st, split in itertools.product(MMA_GRID, (3, 4), (1, 2, 4, 8)):
            if not sl.mma_rows_fits(x.shape[0], n // 2 if gelu else n, k, bn, bk, split):
                continue
            cfg = dict(block_n=bn, block_k=bk, warps=w_, stages=st, split=split, counts=counts, gelu=gelu)
            try:
                y = sl.mma_rows(x, ws[0], **cfg)
            except Exception:  # beyond this GPU's shared memory
                continue
            err = ((y.float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (name, cfg, err)
            cands[f"mma bn{bn} bk{bk} w{w_} s{st} split{split}"] = [lambda w=w, cfg=cfg: sl.mma_rows(x, w, **cfg)
                                                                    for w in ws]
        lib = [(lambda w=w: gelu_mul(F.linear(x, w))) if gelu else (lambda w=w: F.linear(x, w)) for w in ws]
        yield name + ("+gelu" if gelu else ""), n * k * dtype.itemsize, lib, lib, cands


def experts_cases(shape: dict, tokens: int, dtype, dev, seed: int = 0, in_nf4: bool = False):
    """The MoE kernels (engine/kernels/moe.py; `in_nf4`: kernels/nf4_moe.py on the experts in NF4) on
    one layer's experts: `tokens` tokens, each routed to top_k distinct random experts. Yields
    (stage, bytes of distinct experts' weights read, current launch, {name: launch}); stage
    "gate_up" times that kernel alone through `experts` with the down launch fixed, "down" the
    other way round; in NF4, where kernels/nf4_cuda.py is built, stage "both" times the two
    Triton kernels against that kernel's tensor-core tiles (`tiles`) for both stages. Each runs as
    the fused forward runs it: the pairs' partials left for the layer's end to add (`pairs`)."""
    from engine.kernels import moe, nf4, nf4_cuda, nf4_moe
    from engine.model.nf4_experts import NF4Experts

    g = torch.Generator(device=dev).manual_seed(seed)
    E, K, H, inter = shape["num_experts"], shape["top_k_experts"], shape["hidden_size"], shape["moe_intermediate_size"]
    gate_up = torch.randn(E, 2 * inter, H, device=dev, generator=g).to(dtype) * 0.02
    down = torch.randn(E, H, inter, device=dev, generator=g).to(dtype) * 0.02
    run, current_gu, current_dn, per_weight = moe.experts, moe.GATE_UP, moe.DOWN, dtype.itemsize
    grid = [dict(block_n=bn, block_k=bk, warps=wp) for bn, bk in ((2, 1024), (4, 512), (4, 1024), (8, 256), (8, 512),
                                                                  (16, 128), (16, 256)) for wp in (2, 4, 8)]
    gu_grid = dn_grid = grid  # the down stage split per pair, as the forward runs it (`pairs`)
    if in_nf4:
        ex = NF4Experts.quantize(gate_up, down)
        gate_up, down = nf4.dequantize(ex.gate_up).view(E, 2 * inter, H), nf4.dequantize(ex.down).view(E, H, inter)
        run, current_gu, current_dn, per_weight = nf4_moe.experts, nf4_moe.GATE_UP, nf4_moe.DOWN, 0.5 + 4 / 64
        nf4_grid = [dict(block_n=bn, block_k=bk, warps=wp, stages=st) for bn in (4, 8, 16, 32) for bk in (64, 128, 256)
                    for wp in (2, 4) for st in (2, 3)]
        gu_grid = dn_grid = nf4_grid
    # a few routings, cycled through by the timed calls (as layers route anew), so that the
    # experts chosen are mostly not in L2 from the call before
    idxs = [torch.rand(tokens, E, device=dev, generator=g).topk(K, dim=1).indices.int() for _ in range(8)]
    w = torch.rand(tokens, K, device=dev, generator=g)
    x = torch.randn(tokens, H, device=dev, generator=g).to(dtype)
    want = moe.experts_ref(x, idxs[0].long(), w, gate_up, down)
    distinct = sum(i.unique().numel() for i in idxs) / len(idxs)
    if in_nf4:
        gate_up, down = ex.gate_up, ex.down
    for stage, nbytes in (("gate_up", 2 * inter * H), ("down", H * inter)):
        cands = {}
        for launch in (gu_grid if stage == "gate_up" else dn_grid):
            kw = {"gate_up_launch": launch} if stage == "gate_up" else {"down_launch": launch}
            y = moe.sum_pairs_ref(run(x, idxs[0], w, gate_up, down, pairs=True, **kw), K, dtype)
            assert ((y.float() - want.float()).norm() / want.float().norm()).item() < 2e-2
            cands[str(launch)] = [lambda kw=kw, idx=idx: run(x, idx, w, gate_up, down, pairs=True, **kw)
                                  for idx in idxs]
        current = current_gu if stage == "gate_up" else current_dn
        if in_nf4 and stage == "gate_up":  # the launch by token count
            current = current[min(t for t in current if t >= tokens)]
        yield stage, int(distinct * nbytes * per_weight), current, cands
    if in_nf4 and nf4_cuda.extension() is not None and nf4_cuda.experts_fit(x, gate_up, down, top_k=K):
        # both stages: the Triton kernels at their current launches, and kernels/nf4_cuda.py's tiles
        cands = {"triton": [lambda idx=idx: run(x, idx, w, gate_up, down, pairs=True) for idx in idxs]}
        for tiles in nf4_cuda.EXPERT_LAUNCHES:
            if not nf4_cuda.experts_fit(x, gate_up, down, tiles, K):  # more shared memory than this GPU has
                continue
            y = moe.sum_pairs_ref(run(x, idxs[0], w, gate_up, down, tiles=tiles, pairs=True), K, dtype)
            assert ((y.float() - want.float()).norm() / want.float().norm()).item() < 2e-2
            cands[f"tiles {tiles}"] = [lambda tiles=tiles, idx=idx: run(x, idx, w, gate_up, down, tiles=tiles,
                                                                        pairs=True) for idx in idxs]
        yield "both", int(distinct * 3 * inter * H * per_weight), "triton", cands


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs="+", default=["gemma3-4b", "gemma3-1b"], choices=sorted(SHAPES))
    ap.add_argument("--n", type=int, nargs="*", default=None,
                    help="none: no attention (default 1 8 64 256, or none for an MoE shape with --experts)")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8], help="none: no projections")
    ap.add_argument("--quick", action="store_true", help="attention: 16- and 32-key blocks, 4 warps, 2-3 stages")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false",
                    help="attention: time the current launch only")
    ap.add_argument("--layouts", nargs="+", choices=["ring", "paged"], default=["ring", "paged"],
                    help="attention: these layouts")
    ap.add_argument("--attn-wide", action="store_true",
                    help="attention: also 128-key blocks, one warp, and a ring in three or five splits")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--experts", type=int, nargs="*", default=[],
                    help="MoE shapes (--shape gemma4-26b-a4b): these token counts through the experts kernels")
    ap.add_argument("--nf4", action="store_true", help="--experts: the NF4 experts kernels (needs bitsandbytes)")
    ap.add_argument("--wide", action="store_true",
                    help="projections: also 5-6 stages and K tiles of 4,096 (the engine's candidates are marked)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    dtype = torch.bfloat16
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 4
    bw = copy_bandwidth(dev)  # the floors' bandwidth, as bench.throughput measures it
    name_dev = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{name_dev}, {sms} SMs, copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    results = {"attention": [], "linear": [], "experts": []}
    meta = {"bench": "tune_kernels", "device": name_dev, "torch": torch.__version__,
            "transformers": transformers.__version__, "triton": da.triton.__version__ if da.triton else None, "copy_bandwidth_Bps": bw,
            "commit": git_commit(), "engine_source": source_digest(), "dtype": str(dtype), "page": a.page,
            "sink": a.sink, "window": a.window}
    out = Path(a.out) / f"tune-kernels-cuda-{date.today().isoformat()}{'-' + a.tag if a.tag else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        for name in a.shape:
            shape = SHAPES[name]
            moe_shape = "num_experts" in shape
            attention_n = a.n if a.n is not None else ([] if moe_shape and a.experts else [1, 8, 64, 256])
            if moe_shape and a.experts:
                if not cuda:
                    print(f"{name}: the experts kernels need CUDA")
                    continue
                print(f"\n{name} experts{' (NF4)' if a.nf4 else ''}, one layer (us for both kernels; floor: the "
                      f"chosen experts' weights read by the stage timed, the other stage's time included)")
                for tokens in a.experts:
                    for stage, nbytes, current, cands in experts_cases(shape, tokens, dtype, dev, in_nf4=a.nf4):
                        cur = graph_us(cands[str(current)]) if str(current) in cands else None
                        timed = sorted(((graph_us(c), k) for k, c in cands.items()), key=lambda t: t[0])
                        best_us, best = timed[0]
                        print(f"{stage:8} T={tokens:<3} floor {nbytes / bw * 1e6:6.1f} current "
                              f"{cur if cur is not None else float('nan'):7.1f} best {best_us:7.1f}  {best}")
                        results["experts"].append(dict(shape=name, nf4=a.nf4, stage=stage, tokens=tokens, bytes=nbytes,
                                                       current=current, current_us=cur, best=best, best_us=best_us,
                                                       top=[dict(us=t, launch=k) for t, k in timed[:6]]))
                out.write_text(json.dumps({**meta, **results}, indent=1))
            if attention_n:
                print(f"\n{name} decode attention, rows of ~{PROMPT} tokens (us; GB/s of K/V read)")
                print(f"{'layout':7} {'N':>4} {'floor':>7} {'current':>16} {'best':>16}  best launch")
            for n in attention_n:
                for layout, nbytes, current, cands, make in attention_cases(
                        shape, n, a.page, a.sink, a.window, dtype, dev, a.quick, layouts=a.layouts, wide=a.attn_wide):
                    cur = graph_us(make(current))
                    timed = [(cur, current)] + [(t, c) for c in (cands if a.sweep else [])
                                                if (t := launch_us(make, c)) is not None]
                    best_us, best = min(timed, key=lambda t: t[0])
                    floor = nbytes / bw * 1e6
                    print(f"{layout:7} {n:4} {floor:7.1f} {cur:8.1f} {nbytes / cur / 1e3:6.0f}GB/s "
                          f"{best_us:8.1f} {nbytes / best_us / 1e3:6.0f}GB/s  {best}")
                    results["attention"].append(dict(
                        shape=name, layout=layout, n=n, bytes=nbytes, floor_us=floor, current=current,
                        current_us=cur, best=best, best_us=best_us,
                        all=[dict(us=t, **c) for t, c in sorted(timed, key=lambda t: t[0])[:12]]))
            if a.rows and not moe_shape:
                print(f"\n{name} projections (us; GB/s of weight read)")
                print(f"{'proj':8} {'M':>2} {'floor':>6} {'F.linear':>15} {'split-K':>15} {'best ours':>15}"
                      f" {'engine cands':>12}  launch")
            engine_cands = {"gemv bn{block_n} bk{block_k} w{warps} s{stages}".format(**c) for c in sl.GEMV_CANDIDATES}
            engine_cands |= {"mma bn{block_n} bk{block_k} w{warps} s{stages}".format(**c) + f" split{split}"
                             for c in sl.MMA_CANDIDATES for split in sl.MMA_SPLITS}
            for rows in ([] if moe_shape else a.rows):  # an MoE shape's products: --experts
                for proj, nbytes, lib, split, cands in linear_cases(shape, rows, dtype, sms, dev, wide=a.wide):
                    t_lib, t_split = graph_us(lib), graph_us(split)
                    timed = sorted(((graph_us(c), k) for k, c in cands.items()), key=lambda t: t[0])
                    best_us, best = timed[0]
                    ours = min((t for t, k in timed if k in engine_cands), default=float("nan"))
                    floor = nbytes / bw * 1e6
                    print(f"{proj:8} {rows:2} {floor:6.1f} {t_lib:7.1f} {nbytes / t_lib / 1e3:5.0f}GB/s "
                          f"{t_split:7.1f} {nbytes / t_split / 1e3:5.0f}GB/s {best_us:7.1f} "
                          f"{nbytes / best_us / 1e3:5.0f}GB/s {ours:12.1f}  {best}")
                    results["linear"].append(dict(
                        shape=name, proj=proj, rows=rows, bytes=nbytes, floor_us=floor, f_linear_us=t_lib,
                        split_k_us=t_split, best=best, best_us=best_us, engine_candidates_best_us=ours,
                        top=[dict(us=t, launch=k) for t, k in timed[:6]]))
            out.write_text(json.dumps({**meta, **results}, indent=1))  # after each shape: a cut run keeps its part
            print(f"wrote {out}")


if __name__ == "__main__":
    main()
