"""The few-row product with the step before it taken in (`gemv_add_rmsnorm`, `gemv_gelu`)
against the same step as a kernel of its own followed by the product, timed on the GPU.

Per BENCH.md shape and row count, the three products of a Gemma 3 layer that follow such a step:
Q/K/V and gate/up after `add_rmsnorm`, down after `gelu_mul`. Each is timed three ways from a CUDA
graph that cycles over copies of the weight (as a forward's layers each read their own), with
PDL as the engine's decode steps launch: the step's kernel then `F.linear` (the library), the
step's kernel then `gemv`, and the one kernel; each `gemv` launch of `GEMV_CANDIDATES`, the
fastest two-kernel launch reported with the one-kernel time of the same launch. Prints a table,
writes JSON to bench/results.

    python -m bench.gemv_prologue [--shape gemma3-1b gemma3-4b] [--rows 1 2 4 8]
"""

from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.throughput import SHAPES, git_commit, source_digest
from bench.tune_kernels import copies_for, graph_us
from engine.kernels import fused_ops, launch
from engine.kernels import small_linear as sl


def cases(shape: dict, rows: int, dtype, dev, pdl: bool, seed: int = 0):
    """Yields (product, weight bytes, {way: calls}) for the products that follow a step."""
    g = torch.Generator(device=dev).manual_seed(seed)
    hid, inter = shape["hidden_size"], shape["intermediate_size"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * shape["head_dim"]
    h = (torch.randn(rows, hid, device=dev, generator=g) * 3).to(dtype)
    y = torch.randn(rows, hid, device=dev, generator=g).to(dtype)
    wp, wn = ((torch.randn(hid, device=dev, generator=g) * 0.3).to(dtype) for _ in range(2))
    gu = torch.randn(rows, 2 * inter, device=dev, generator=g).to(dtype)
    eps = 1e-6

    scratch = h.clone()  # add_rmsnorm updates its residual in place; the one kernel does not

    def norm():
        return fused_ops.add_rmsnorm(scratch, y, wp, wn, eps, pdl=pdl)[1]

    for name, (n, k) in {"qkv after add_rmsnorm": (qkv, hid), "gate_up after add_rmsnorm": (2 * inter, hid),
                         "down after gelu_mul": (hid, inter)}.items():
        ws = [torch.randn(n, k, device=dev, generator=g).to(dtype) for _ in range(copies_for(n * k * dtype.itemsize))]
        gelu = name.startswith("down")
        step = (lambda: fused_ops.gelu_mul(gu, pdl=pdl)) if gelu else norm
        ways = {"library": [lambda w=w: F.linear(step(), w) for w in ws]}
        for i, cfg in enumerate(sl.GEMV_CANDIDATES):
            ways[f"gemv {i}"] = [lambda w=w, cfg=cfg: sl.gemv(step(), w, **cfg, pdl=pdl) for w in ws]
            if gelu:
                one = [lambda w=w, cfg=cfg: sl.gemv_gelu(gu, w, **cfg, pdl=pdl) for w in ws]
            else:
                one = [lambda w=w, cfg=cfg: sl.gemv_add_rmsnorm(h, y, wp, wn, eps, 1.0, w, **cfg, pdl=pdl)[1]
                       for w in ws]
            ways[f"one kernel {i}"] = one
            # the one kernel computes what the two do (bf16: the norms' sums may round apart)
            x = fused_ops.gelu_mul(gu) if gelu else fused_ops.add_rmsnorm(h.clone(), y, wp, wn, eps)[1]
            want = sl.gemv(x, ws[0], **cfg).float()
            err = ((one[0]().float() - want).norm() / want.norm()).item()
            assert err < 1e-2, (name, cfg, err)
        yield name, n * k * dtype.itemsize, ways


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs="+", default=["gemma3-1b", "gemma3-4b"], choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    dev = "cuda"
    dtype = torch.bfloat16
    pdl = launch.supported(torch.device(dev))
    rows_out = []
    print(f"{torch.cuda.get_device_name()}, PDL {pdl}; us per product (step + product), bf16")
    print(f"{'shape':10} {'rows':>4}  {'product':26} {'step + library':>14} {'step + gemv':>12} {'one kernel':>11} "
          f"{'one / two':>9}")
    for shape_name in args.shape:
        shape = SHAPES[shape_name]
        for rows in args.rows:
            for name, nbytes, ways in cases(shape, rows, dtype, dev, pdl):
                t = {way: graph_us(calls) for way, calls in ways.items()}
                best = min(range(len(sl.GEMV_CANDIDATES)), key=lambda i: t[f"gemv {i}"])
                two, one = t[f"gemv {best}"], t[f"one kernel {best}"]
                print(f"{shape_name:10} {rows:>4}  {name:26} {t['library']:>14.2f} {two:>12.2f} {one:>11.2f} "
                      f"{one / two:>9.3f}")
                rows_out.append(dict(shape=shape_name, rows=rows, product=name, weight_bytes=nbytes, us=t,
                                     launch=sl.GEMV_CANDIDATES[best], two_kernels_us=two, one_kernel_us=one,
                                     one_over_two=one / two))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gemv-prologue-cuda-{date.today().isoformat()}{'-' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, pdl=pdl,
                                    commit=git_commit(), engine_source=source_digest(), rows=rows_out), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
