"""The one-row NF4 product written in CUDA C++ (bench/cuda/nf4_gemv.cu) against the engine's
Triton kernels on the same weights: does a kernel outside Triton get past the one-row kernels'
third of the memory bandwidth?

The CUDA kernel is built on the GPU host by torch's extension loader (nvcc and ninja needed),
checked against the library's product on the dequantized weight, and timed per Gemma-3
projection at one row over a grid of launches (weight rows per warp, warps per block, K split),
beside the Triton plan's launch and the bf16 library product, the same way `bench.nf4_kernels`
times them (CUDA graphs over copies of the weights, 128 MB or more, so none is served from L2).
The fastest launches are timed again with one stage left out (the source's MODE): the loads
alone, and the lookups and products alone, so the difference says where the time goes.

    python -m bench.nf4_cuda [--shape gemma3-4b] [--out bench/results]
"""

from __future__ import annotations

import argparse
import math
import pathlib

import torch
import torch.nn.functional as F

from bench.nf4_kernels import ROTATE_BYTES, projections, timed
from bench.throughput import SHAPES, copy_bandwidth, git_commit, source_digest, write_result
from engine.kernels import nf4, nf4_plan

SOURCE = pathlib.Path(__file__).parent / "cuda" / "nf4_gemv.cu"
# (rows per warp, warps per block, K split, blocks per SM (0: one warp per row group, else persistent
# warps that walk row groups with the next step's loads in flight), lookup (0 shuffles, 1 half of
# them byte permutes; persistent only))
LAUNCHES = ([(rows, warps, split, 0, 0) for rows in (1, 2, 4, 8) for warps in (2, 4, 8) for split in (1, 2, 4)]
            + [(rows, warps, split, per_sm, lookup) for rows in (1, 2, 4) for warps in (4, 8) for split in (1, 2)
               for per_sm in (2, 4, 8) for lookup in (0, 1)])


def build():
    from torch.utils.cpp_extension import load_inline

    decl = ("void nf4_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor absmax, torch::Tensor code, "
            "torch::Tensor y, torch::Tensor partial, int64_t rows, int64_t warps, int64_t split, int64_t mode, "
            "int64_t blocks, int64_t lookup);")
    return load_inline("s5_bench_nf4_gemv", cpp_sources=decl, cuda_sources=SOURCE.read_text(), functions=["nf4_gemv"],
                       extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"], verbose=False)


@torch.no_grad()
def main() -> None:
    import bitsandbytes as bnb
    from bitsandbytes.functional import quantize_4bit

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="gemma3-4b", choices=sorted(SHAPES))
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    ext = build()
    dtype = torch.bfloat16
    bw = copy_bandwidth("cuda") / 2
    print(f"copy bandwidth (read side) {bw / 1e9:.0f} GB/s")
    print(f"{'proj':>8} {'N x K':>13} {'triton us':>9} {'cuda us':>8} {'cuda/triton':>11} {'GB/s':>6} {'floor us':>8} "
          f"{'bf16 us':>8}  cuda launch (rows/warp, warps, split, blocks/SM, lookup); the same without the "
          f"lookups / without the weight loads", flush=True)
    rows_out = []
    for name, (n_out, k) in projections(a.shape).items():
        nbytes = n_out * k // 2 + n_out * k // 64 * 4
        copies = max(2, math.ceil(ROTATE_BYTES / nbytes))
        ws = []
        for _ in range(copies):
            packed, state = quantize_4bit((torch.randn(n_out, k, device="cuda") * 0.02).to(dtype), blocksize=64,
                                          quant_type="nf4", compress_statistics=True)
            p = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, quant_type="nf4", bnb_quantized=True)
            ws.append(nf4.from_bnb(p))
        full = [nf4.dequantize(w) for w in ws[:max(2, math.ceil(ROTATE_BYTES / (n_out * k * 2)))]]
        plan = nf4_plan.plan_nf4(ws)
        x = torch.randn(1, k, device="cuda").to(dtype)
        want = F.linear(x, full[0])
        triton_us = timed(lambda: [nf4.linear(x, w, plan) for w in ws], len(ws))
        lib_us = timed(lambda: [F.linear(x, w) for w in full], len(full))
        y = torch.empty(1, n_out, device="cuda", dtype=dtype)
        results = []
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for rows, warps, split, per_sm, lookup in LAUNCHES:
            part = torch.empty(split, n_out, device="cuda", dtype=torch.float32)

            def call(w, rows=rows, warps=warps, split=split, part=part, blocks=per_sm * sms, lookup=lookup, mode=0):
                ext.nf4_gemv(x, w.packed, w.scales, w.code, y, part, rows, warps, split, mode, blocks, lookup)

            launch = {"rows_per_warp": rows, "warps": warps, "split": split, "blocks_per_sm": per_sm, "lookup": lookup}
            y.zero_()
            call(ws[0])
            if not nf4_plan.agrees(y, want):
                print(f"  {launch}: disagrees with the library's product")
                continue
            us = timed(lambda: [call(w) for w in ws], len(ws))
            if us:
                results.append({"us": us, **launch, "call": call})
        results.sort(key=lambda r: r["us"])
        for r in results[:3]:  # the same launches with one stage left out (MODE in the source)
            call = r.pop("call")
            r["loads_only_us"] = timed(lambda: [call(w, mode=1) for w in ws], len(ws))
            r["lookups_only_us"] = timed(lambda: [call(w, mode=2) for w in ws], len(ws))
        for r in results[3:]:
            r.pop("call")
        best = results[0] if results else None
        floor_us = nbytes / bw * 1e6
        row = {"projection": name, "out": n_out, "in": k, "triton_us": triton_us, "triton_launch": plan.get(1),
               "bf16_us": lib_us, "floor_us": floor_us, "cuda": results}
        rows_out.append(row)
        def desc(r):
            return (f"({r['rows_per_warp']}, {r['warps']}, {r['split']}, {r['blocks_per_sm']}, {r['lookup']}); "
                    f"{r['loads_only_us']:.1f} / {r['lookups_only_us']:.1f}")

        if best:
            print(f"{name:>8} {f'{n_out}x{k}':>13} {triton_us:>9.1f} {best['us']:>8.1f} {best['us'] / triton_us:>11.2f} "
                  f"{nbytes / (best['us'] * 1e-6) / 1e9:>6.0f} {floor_us:>8.1f} {lib_us:>8.1f}  {desc(best)}", flush=True)
            for r in results[1:3]:
                print(f"{'':>33} {r['us']:>8.1f}  {desc(r)}")
            for kind, pick in (("one warp per row group", lambda r: r["blocks_per_sm"] == 0),
                               ("persistent, shuffles", lambda r: r["blocks_per_sm"] and r["lookup"] == 0),
                               ("persistent, half permutes", lambda r: r["blocks_per_sm"] and r["lookup"] == 1)):
                r = next((r for r in results if pick(r)), None)
                if r:
                    print(f"{'':>12} fastest {kind}: {r['us']:.1f} us {r}")
        ws = full = []
        torch.cuda.empty_cache()
    write_result(a.out, f"nf4-cuda-gemv-{a.shape}", {
        "bench": "nf4_cuda", "device": torch.cuda.get_device_name(), "shape": a.shape,
        "copy_read_bandwidth_bytes_s": bw, "rows": rows_out,
        "versions": {"torch": torch.__version__, "bitsandbytes": bnb.__version__, "commit": git_commit(),
                     "engine_source_sha256": source_digest()}})


if __name__ == "__main__":
    main()
