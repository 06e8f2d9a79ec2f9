"""The NF4 products of a decode step, measured on the GPU: per projection of a BENCH.md shape
(QKV, O, gate/up, down) and row count, the engine's fused dequantize-and-multiply kernel with
its timed plan (kernels/nf4.py; at one row the CUDA kernel of kernels/nf4_cuda.py where it is built
and faster), bitsandbytes' own `Linear4bit` forward on the same packed
weights, and the library product on the weights dequantized to the compute dtype (what a
full-precision model reads), each in us per product and GB/s of the bytes it must read, beside
the measured copy bandwidth. Every candidate is timed from a CUDA graph that cycles over copies
of its weights (128 MB or more in all) so that, as in a forward, they are not served from L2.

    python -m bench.nf4_kernels [--shape gemma3-4b] [--n 1 8 64] [--out bench/results]

`--sweep` also times a wider grid of launches per projection and row count (tile rows and
columns, K step, warps, stages, K split for 0-16 programs per SM) and prints the fastest that
agree with the library's product, beside the planned one. `--sweep permute` times tiles
(one row as a tile of 16 too) whose codes are looked up by warp shuffle against tiles whose
codes are looked up by byte permutes (kernels/nf4.py, `permute`). `--sweep mma` times the
kernel that decodes the codes straight into mma.sync fragments (`mma`: tile shapes, K steps;
`mma-deep`: deeper pipelines, K split for up to 16 programs per SM) against the planned
launches for the row count. `--sweep wide-tiles` times tiles of 64 rows of x against 128 or 256
weight rows a program, which read x half or a quarter as often as tiles of 64.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from bench.throughput import SHAPES, copy_bandwidth, git_commit, source_digest, write_result
from engine.kernels import nf4, nf4_plan
from engine.kernels.small_linear import graph_ms

ROTATE_BYTES = 128 << 20


def projections(shape: str) -> dict[str, tuple[int, int]]:
    s = SHAPES[shape]
    hd, h, kv, hidden, inter = s["head_dim"], s["num_attention_heads"], s["num_key_value_heads"], s["hidden_size"], \
        s["intermediate_size"]
    return {"qkv": ((h + 2 * kv) * hd, hidden), "o": (hidden, h * hd), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter)}


def timed(fn, calls: int) -> float | None:
    """us per call of one replay of `calls` calls from a CUDA graph (None: not capturable)."""
    try:
        return graph_ms(fn, reps=1) * 1e3 / calls
    except Exception as exc:  # e.g. a library path that syncs with the host
        print(f"  (not timed: {type(exc).__name__}: {str(exc)[:80]})")
        torch.cuda.synchronize()
        return None


SWEEP_ONE_ROW = [(1, bn, bk, w, st, False) for bn in (4, 8, 16, 32) for bk in (256, 512, 1024) for w in (1, 2, 4)
                 for st in (3, 4) if bn * bk // 2 // (32 * w) >= 8]
SWEEP_TILES = [(bm, bn, bk, w, 3, sw) for bm in (16, 32, 64) for bn in (32, 64, 128) for bk in (64, 128, 256)
               for w in (4, 8) for sw in (False, True)]
# tiles whose codes are looked up by warp shuffle (the weight decoded whole: code x absmax,
# rounded) against tiles whose codes are looked up by byte permutes (the 7th field); one row too
SWEEP_PERMUTE = [(bm, bn, bk, w, 3, sw, perm) for bm in (16, 32, 64) for bn in (64, 128) for bk in (128, 256)
                 for w in (4, 8) for sw in (False, True) for perm in (False, True)]
# the planned launches with each code lookup: one row per program, and tiles of 16 rows
SWEEP_PERMUTE_PLANNED = [c + (perm,) for c in nf4_plan.NF4_CANDIDATES[1] if len(c) == 6 for perm in (False, True)]
SWEEP_PERMUTE_TILES = [c + (perm,) for c in nf4_plan.NF4_CANDIDATES[8] if len(c) == 6 and c[5]
                       for perm in (False, True)]
# the codes decoded into mma.sync fragments (8th field), 8 or 16 rows of x, beside the planned
# launches for the row count; `mma-deep`: deeper pipelines, K split for up to 16 programs per SM
SWEEP_MMA = [(bm, bn, bk, w, 3, False, False, True) for bm in (8, 16)
             for bn, w in ((32, 2), (64, 2), (64, 4), (128, 4), (128, 8)) for bk in (128, 256, 512)]
SWEEP_MMA_DEEP = [(8, bn, bk, w, st, False, False, True) for bn, w in ((32, 2), (64, 4)) for bk in (128, 256)
                  for st in (3, 4, 5)]
# tiles of 64 rows of x against 128 or 256 weight rows a program: each program reads all of its K
# slice of x, so wider weight tiles read x fewer times (at 64 rows x is 4x the bytes of the codes
# in a tile of 64 weight rows)
SWEEP_WIDE_TILES = [(64, bn, bk, w, st, sw) for bn in (128, 256) for bk in (64, 128) for w in (4, 8)
                    for st in (2, 3) for sw in (True, False)]
SWEEPS = {"grid": (SWEEP_ONE_ROW, SWEEP_TILES, (0, 2, 4, 8, 16)), "wide-tiles": ([], SWEEP_WIDE_TILES, (0, 2, 4)),
          "permute": ([], SWEEP_PERMUTE, (0, 2, 4, 8)),
          "permute-planned": (SWEEP_PERMUTE_PLANNED, SWEEP_PERMUTE_TILES, (0, 2, 4)), "mma": ([], SWEEP_MMA, (0, 2, 4)),
          "mma-deep": ([], SWEEP_MMA_DEEP, (0, 2, 4, 8, 16))}


def sweep(x: torch.Tensor, ws: list, dense: torch.Tensor, grid: str = "grid") -> list[dict]:
    """Launches of the NF4 kernels for x's row count from SWEEPS[grid] (its one-row launches for
    one row, and its tiles at the tile rows that cover the row count), each with K split for
    its numbers of programs per SM, timed as the plan times them; those that agree with the
    library's product on the dequantized first weight, fastest first."""
    m, k = x.shape
    n = ws[0].shape[0]
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    one_row, tiles, per_sms = SWEEPS[grid]
    if grid.startswith("mma"):  # the mma launches for the row count beside the planned ones without mma
        planned = nf4_plan.NF4_CANDIDATES[min(r for r in nf4_plan.NF4_CANDIDATES if r >= m)]
        cands = [c for c in tiles if c[0] == (8 if m <= 8 else 16)] + [c for c in planned if len(c) < 8]
    elif m == 1 and one_row:
        cands = one_row
    else:
        cands = [c for c in tiles if c[0] == min(64, max(16, 1 << (m - 1).bit_length()))]
    want = F.linear(x, dense)
    out, seen = [], []
    for cand in cands:
        for per_sm in per_sms:
            cfg = nf4.with_split(cand, m, n, k, sms, per_sm, shfl=True)
            if cfg in seen:
                continue
            seen.append(cfg)
            try:
                if not nf4_plan.agrees(nf4.nf4_matmul(x, ws[0], **cfg), want):
                    continue
            except Exception:  # a launch this GPU cannot compile (shared memory, registers)
                continue
            us = timed(lambda cfg=cfg: [nf4.nf4_matmul(x, w, **cfg) for w in ws], len(ws))
            if us:
                out.append({"us": us, "launch": cfg})
    return sorted(out, key=lambda r: r["us"])


def nf4_bytes(n: int, k: int) -> int:
    """The bytes an [n, k] NF4 weight's product must read: packed codes and float32 absmax."""
    return n * k // 2 + n * k // 64 * 4


def weight_copies(n: int, k: int, dtype: torch.dtype) -> tuple[list, list, list]:
    """Random [n, k] weights quantized to NF4 on the GPU as bitsandbytes' Linear4bit holds them,
    enough copies (ROTATE_BYTES or more) that a graph cycling over them reads from DRAM: the
    Linear4bit modules, their `nf4.NF4Weight` views, and enough of them dequantized to `dtype`."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import quantize_4bit

    mods = []
    for _ in range(max(2, math.ceil(ROTATE_BYTES / nf4_bytes(n, k)))):
        packed, state = quantize_4bit((torch.randn(n, k, device="cuda") * 0.02).to(dtype), blocksize=64,
                                      quant_type="nf4", compress_statistics=True)
        lin = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=dtype, quant_type="nf4", device="meta")
        lin.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, quant_type="nf4",
                                       bnb_quantized=True)
        mods.append(lin)
    ws = [nf4.from_bnb(m.weight) for m in mods]
    full = [nf4.dequantize(w) for w in ws[:max(2, math.ceil(ROTATE_BYTES / (n * k * 2)))]]
    return mods, ws, full


@torch.no_grad()
def main() -> None:
    import bitsandbytes as bnb

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="gemma3-4b", choices=sorted(SHAPES))
    ap.add_argument("--n", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--sweep", nargs="?", const="grid", choices=sorted(SWEEPS),
                    help="time a wider grid of launches (see the module doc)")
    a = ap.parse_args()
    dtype = torch.bfloat16
    bw = copy_bandwidth("cuda") / 2  # read bytes per second of a copy
    rows = []
    print(f"copy bandwidth (read side) {bw / 1e9:.0f} GB/s")
    print(f"{'proj':>8} {'N x K':>13} {'n':>3} {'nf4 us':>8} {'GB/s':>6} {'bnb us':>8} {'bf16 us':>8} "
          f"{'vs bnb':>7} {'vs bf16':>7}  launch", flush=True)
    for name, (n_out, k) in projections(a.shape).items():
        nbytes = nf4_bytes(n_out, k)
        mods, ws, full = weight_copies(n_out, k, dtype)
        plan = nf4_plan.plan_nf4(ws)
        for m in a.n:
            x = torch.randn(m, k, device="cuda").to(dtype)
            ours = timed(lambda: [nf4.linear(x, w, plan) for w in ws], len(ws))
            theirs = timed(lambda: [lin(x) for lin in mods], len(mods))
            lib = timed(lambda: [F.linear(x, w) for w in full], len(full))
            planned = [r for r in plan if r >= m]
            cfg = plan[min(planned)] if planned else None
            gbs = nbytes / (ours * 1e-6) / 1e9 if ours else None
            row = {"projection": name, "out": n_out, "in": k, "rows": m, "nf4_us": ours, "nf4_gb_s": gbs,
                   "bnb_us": theirs, "bf16_us": lib, "launch": cfg}
            if a.sweep:
                row["sweep"] = sweep(x, ws, full[0], a.sweep)
                best = row["sweep"][0] if row["sweep"] else None
                if best:
                    print(f"  sweep: {len(row['sweep'])} launches agree; fastest {best['us']:.1f} us "
                          f"({ours / best['us']:.2f}x the plan's): {best['launch']}")
                    for r in row["sweep"][1:5]:
                        print(f"         {r['us']:.1f} us: {r['launch']}")
                    kinds = {"shuffles": lambda c: not c["permute"] and not c["mma"],
                             "permutes": lambda c: c["permute"] and not c["mma"],
                             "mma fragments": lambda c: c["mma"]}
                    for kind, is_kind in kinds.items():  # the fastest launch of each code lookup
                        r = next((r for r in row["sweep"] if is_kind(r["launch"])), None)
                        if r:
                            print(f"    fastest, {kind}: {r['us']:.1f} us "
                                  f"({ours / r['us']:.2f}x the plan's): {r['launch']}")
            rows.append(row)

            def f(v, w=8):
                return f"{v:>{w}.1f}" if v else f"{'-':>{w}}"

            print(f"{name:>8} {f'{n_out}x{k}':>13} {m:>3} {f(ours)} {f(gbs, 6)} {f(theirs)} {f(lib)} "
                  f"{f(theirs / ours if ours and theirs else None, 6)}x {f(lib / ours if ours and lib else None, 6)}x"
                  f"  {cfg}", flush=True)
        mods = ws = full = []  # freed before the next projection's copies
        torch.cuda.empty_cache()
    result = {"bench": "nf4_kernels", "device": torch.cuda.get_device_name(), "shape": a.shape,
              "copy_read_bandwidth_bytes_s": bw, "rows": rows,
              "versions": {"torch": torch.__version__, "bitsandbytes": bnb.__version__, "commit": git_commit(),
                           "engine_source_sha256": source_digest()}}
    write_result(a.out, f"nf4-kernels-{a.shape}", result)


if __name__ == "__main__":
    main()
