"""NF4 products of few rows in CUDA C++ (engine/kernels/cuda/nf4_gemv.cu, kernels/nf4_cuda.py)
against the engine's Triton kernels on the same weights: a grid of the kernel's launches (1-8
weight rows per warp on FMAs, one warp per row group or persistent warps; tiles of 16 weight
rows on tensor cores; block tiles of 32 weight rows per warp, x's rows in the block's ring; warps
per block, K split) per Gemma-3 projection, at one row of x or at `--rows` (above one the tiles, up
to 8, and the block tiles, up to 64), checked against the library's product on the dequantized
weight, beside the Triton-only plan's launch and the bf16 library product, timed the way
`bench.nf4_kernels` times them (CUDA graphs over copies of the weights, 128 MB or more, so none is
served from L2). The fastest three launches of each kind (FMAs, tiles) are timed again with one
stage left out (the source's MODE): without the lookups (the loads and the products on the raw
words), and without the weight loads (the lookups and products on made-up words), so the
differences say where the time goes; the fastest tile launches also with the weights' copies
prefetching 128 bytes per row into L2 (MODE 3, the product), with copies that read whole
32-byte sectors (MODE 4, the product), and with each ring stage copied from one contiguous span,
as a weight laid out tile by tile would be read (MODE 5: the loads of that layout, not a product).
At 33-64 rows of x the fastest three block tile launches are timed again without the lookups
(MODE 1: the mma on the raw words), without the mma (MODE 6: integer stand-ins on the looked-up
codes), without x's copies past the ring's first groups (MODE 2) and without the weights' (MODE 3),
so that the differences say which phase sets the block tiles' pace.

    python -m bench.nf4_cuda [--shape gemma3-4b] [--rows 1 8] [--out bench/results]
    python -m bench.nf4_cuda --profile 16,12,1,1 16,12,1,1:2   # for a profiler: these launches only

`--profile` runs the given launches (`rows,warps,split,blocks_per_sm`, `:mode` for a measurement
variant) on one row of x (`--x-rows`) against a Gemma-3 4B gate/up-shaped weight of random codes, `--reps`
times each, and times nothing: a profiler (Nsight Compute) attached to the process measures them.

The kernel is built by torch's extension loader (nvcc and ninja needed).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.nf4_kernels import nf4_bytes, projections, timed, weight_copies
from bench.throughput import SHAPES, copy_bandwidth, git_commit, source_digest, write_result
from engine.kernels import nf4, nf4_cuda, nf4_plan

# (weight rows per warp, warps per block, K split, blocks per SM: 0 for one warp per row group,
# else persistent warps that walk row groups with the next step's loads in flight), and tiles of
# 16 rows on tensor cores, one block per SM, K split 0 (the launcher spreads the work) or as given
LAUNCHES = ([(rows, warps, split, 0) for rows in (1, 2, 4, 8) for warps in (2, 4, 8) for split in (1, 2, 4)]
            + [(rows, warps, split, per_sm) for rows in (1, 2, 4) for warps in (4, 8) for split in (1, 2)
               for per_sm in (2, 4, 8)]
            + [(16, warps, split, 1) for warps in (8, 12, 16) for split in (0, 1, 2, 3, 4, 8, 16)]
            + [(32, warps, split, 1) for warps in nf4_cuda.BLOCK_WARPS for split in (0, 1, 2, 3, 4, 6)])


@torch.no_grad()
def main() -> None:
    import bitsandbytes as bnb

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="gemma3-4b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1],
                    help="rows of x (above one only the tensor-core tiles (up to 8) and block tiles (up to 64) "
                         "take them)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--profile", nargs="+", default=None, metavar="LAUNCH[:MODE]",
                    help="run these launches for a profiler and exit")
    ap.add_argument("--reps", type=int, default=3, help="--profile: runs of each launch")
    ap.add_argument("--x-rows", type=int, default=1, help="--profile: rows of x")
    a = ap.parse_args()
    if nf4_cuda.extension() is None:
        raise SystemExit("the CUDA NF4 kernel did not build here (a CUDA compiler and ninja are needed)")
    if a.profile:
        return profile(a.profile, a.reps, a.x_rows)
    dtype = torch.bfloat16
    bw = copy_bandwidth("cuda") / 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tile = nf4_cuda.TILE_ROWS
    print(f"copy bandwidth (read side) {bw / 1e9:.0f} GB/s")
    print(f"{'proj':>8} {'N x K':>13} {'rows':>4} {'triton us':>9} {'cuda us':>8} {'cuda/triton':>11} {'GB/s':>6} "
          f"{'floor us':>8} {'bf16 us':>8}  cuda launch (rows/warp, warps, split, blocks/SM); the same without the "
          f"lookups / without the weight loads", flush=True)
    rows_out = []
    for name, (n_out, k) in projections(a.shape).items():
        nbytes = nf4_bytes(n_out, k)
        _, ws, full = weight_copies(n_out, k, dtype)
        plan = nf4_plan.plan_nf4(ws, cuda=False)  # the Triton kernels alone
        for m in a.rows:
            x = torch.randn(m, k, device="cuda").to(dtype)
            want = F.linear(x, full[0])
            triton_us = timed(lambda: [nf4.linear(x, w, plan) for w in ws], len(ws))
            lib_us = timed(lambda: [F.linear(x, w) for w in full], len(full))
            results = []
            for launch in LAUNCHES:
                if not nf4_cuda.fits(x, ws[0], launch):
                    continue
                got = nf4_cuda.gemv(x, ws[0], launch, sms)
                desc = dict(zip(("rows_per_warp", "warps", "split", "blocks_per_sm"), launch))
                if not nf4_plan.agrees(got, want):
                    print(f"  {desc}: disagrees with the library's product")
                    continue
                us = timed(lambda launch=launch: [nf4_cuda.gemv(x, w, launch, sms) for w in ws], len(ws))
                if us:
                    results.append({"us": us, **desc, "launch": launch})
            results.sort(key=lambda r: r["us"])
            for r in ([r for r in results if r["rows_per_warp"] < tile][:3]
                      + [r for r in results if r["rows_per_warp"] == tile][:3]):
                # the same launches with one stage left out (MODE in the source)
                launch = r["launch"]
                r["loads_only_us"] = timed(lambda: [nf4_cuda.gemv(x, w, launch, sms, mode=1) for w in ws], len(ws))
                r["lookups_only_us"] = timed(lambda: [nf4_cuda.gemv(x, w, launch, sms, mode=2) for w in ws], len(ws))
                # the product with L2 fetching each row's 128 bytes around a copy (MODE 3), and with
                # copies that read whole 32-byte sectors (MODE 4)
                for mode, key in ((3, "l2_prefetch_us"), (4, "sector_copies_us")):
                    if launch[0] == tile and nf4_plan.agrees(nf4_cuda.gemv(x, ws[0], launch, sms, mode=mode), want):
                        r[key] = timed(lambda mode=mode: [nf4_cuda.gemv(x, w, launch, sms, mode=mode) for w in ws],
                                       len(ws))
                # the product's work with each stage copied from one contiguous span (MODE 5: the
                # loads of a weight laid out tile by tile; its sums are of other bytes)
                if launch[0] == tile and n_out % tile == 0:
                    r["tile_layout_us"] = timed(lambda: [nf4_cuda.gemv(x, w, launch, sms, mode=5) for w in ws],
                                                len(ws))
            if m > 32:  # the block tiles' measurement variants: each without one phase or one copy stream
                for r in [r for r in results if r["rows_per_warp"] == nf4_cuda.BLOCK_ROWS][:3]:
                    launch = r["launch"]
                    for mode, key in ((1, "no_lookups_us"), (6, "no_mma_us"), (2, "no_x_copies_us"),
                                      (3, "no_weight_copies_us")):
                        r[key] = timed(lambda mode=mode: [nf4_cuda.gemv(x, w, launch, sms, mode=mode) for w in ws],
                                       len(ws))
            best = results[0] if results else None
            floor_us = nbytes / bw * 1e6
            planned = min((r for r in plan if r >= m), default=None)
            rows_out.append({"projection": name, "out": n_out, "in": k, "x_rows": m, "triton_us": triton_us,
                             "triton_launch": plan.get(planned), "bf16_us": lib_us, "floor_us": floor_us,
                             "cuda": results})

            def desc(r):
                if "no_mma_us" in r:  # the block tiles' variants (None where a capture failed)
                    parts = [f"without the {what} {r[key]:.1f}" for what, key in
                             (("lookups", "no_lookups_us"), ("mma", "no_mma_us"), ("x copies", "no_x_copies_us"),
                              ("weight copies", "no_weight_copies_us")) if r.get(key) is not None]
                    return "; ".join([f"{r['launch']}"] + parts)
                if r.get("loads_only_us") is None or r.get("lookups_only_us") is None:
                    return f"{r['launch']}"
                l2 = f"; with the L2 prefetch {r['l2_prefetch_us']:.1f}" if r.get("l2_prefetch_us") else ""
                l2 += f"; whole-sector copies {r['sector_copies_us']:.1f}" if r.get("sector_copies_us") else ""
                l2 += f"; tile layout {r['tile_layout_us']:.1f}" if r.get("tile_layout_us") else ""
                return f"{r['launch']}; {r['loads_only_us']:.1f} / {r['lookups_only_us']:.1f}{l2}"

            if best:
                print(f"{name:>8} {f'{n_out}x{k}':>13} {m:>4} {triton_us:>9.1f} {best['us']:>8.1f} "
                      f"{best['us'] / triton_us:>11.2f} {nbytes / (best['us'] * 1e-6) / 1e9:>6.0f} {floor_us:>8.1f} "
                      f"{lib_us:>8.1f}  {desc(best)}", flush=True)
                for r in results[1:3]:
                    print(f"{'':>38} {r['us']:>8.1f}  {desc(r)}")
                for kind, pick in (("one warp per row group", lambda r: r["blocks_per_sm"] == 0),
                                   ("persistent warps", lambda r: r["blocks_per_sm"] > 0 and r["rows_per_warp"] < tile),
                                   ("tiles on tensor cores", lambda r: r["rows_per_warp"] == tile),
                                   ("block tiles", lambda r: r["rows_per_warp"] == nf4_cuda.BLOCK_ROWS)):
                    r = next((r for r in results if pick(r)), None)
                    if r:
                        print(f"{'':>12} fastest, {kind}: {r['us']:.1f} us {desc(r)}")
        ws = full = []
        torch.cuda.empty_cache()
    write_result(a.out, f"nf4-cuda-gemv-{a.shape}", {
        "bench": "nf4_cuda", "device": torch.cuda.get_device_name(), "shape": a.shape,
        "copy_read_bandwidth_bytes_s": bw, "rows": rows_out,
        "versions": {"torch": torch.__version__, "bitsandbytes": bnb.__version__, "commit": git_commit(),
                     "engine_source_sha256": source_digest()}})


def profile(launches: list[str], reps: int, x_rows: int = 1) -> None:
    """`launches` ("rows,warps,split,blocks_per_sm[:mode]") on `x_rows` rows of x against a
    Gemma-3 4B gate/up-shaped NF4 weight (random codes and absmax), `reps` times each, in turn."""
    n_out, k = projections("gemma3-4b")["gate_up"]
    w = nf4.NF4Weight(torch.randint(0, 256, (n_out, k // 2), dtype=torch.uint8, device="cuda"),
                      torch.rand(n_out, k // 64, device="cuda"), torch.linspace(-1, 1, 16, device="cuda"),
                      torch.bfloat16)
    x = torch.randn(x_rows, k, device="cuda").to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    runs = []
    for spec in launches:
        launch, _, mode = spec.partition(":")
        runs.append((tuple(int(v) for v in launch.split(",")), int(mode or 0)))
    for _ in range(reps):
        for launch, mode in runs:
            nf4_cuda.gemv(x, w, launch, sms, mode=mode)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
