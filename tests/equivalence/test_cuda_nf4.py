"""The NF4 kernels (kernels/nf4.py, kernels/nf4_moe.py) and the fused forwards on them, on a CUDA
device with bitsandbytes (skipped without either): each kernel against bitsandbytes' own
dequantize_4bit and the library product (or the stock experts math) on the same packed weights,
and the engine's greedy tokens on repacked 4-bit weights against the engine's stock layers on
bitsandbytes' own Linear4bit forward and the stock experts module on the dequantized experts."""

import random

import pytest
import torch
import torch.nn.functional as F

from engine import Engine, EngineConfig, Request
from engine.kernels import launch, moe, nf4, nf4_cuda, nf4_moe, nf4_plan
from engine.model.loader import LoadedModel, tiny_random_model
from engine.model.nf4_experts import NF4Experts
from tests.helpers import greedy, run_all, tiny_gemma4
from tests.scenarios import Recorder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def quantized(n: int, k: int, dtype, seed: int, **kw):
    import bitsandbytes as bnb

    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    return bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4", **kw).cuda()


def bnb_weight(p) -> torch.Tensor:
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(p.data, p.quant_state).reshape(p.quant_state.shape)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def worst_block_rel(a, b, rows: int = 32) -> float:
    """The largest relative error of any x row's outputs over any `rows` consecutive weight rows
    (one wrong weight row in 32 reads about 0.25)."""
    d, w = a.float() - b.float(), b.float()
    pad = (-w.shape[1]) % rows
    blocks = lambda t: F.pad(t, (0, pad)).view(t.shape[0], -1, rows).norm(dim=2)
    return (blocks(d) / blocks(w).clamp_min(1e-12)).max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nf4_kernels_match_bitsandbytes_dequantize_and_matmul(dtype):
    """Every planned launch (NF4_CANDIDATES: one row per program and tensor-core tiles, W x^T or
    x W^T, with and without K splits, codes by shuffle, loads or byte permutes, plain and PDL
    launches), launch_for's and the prefill path, at 1 to 300 rows, on Gemma-3 4B projection
    shapes and odd ones, against dequantize_4bit + F.linear on the same packed weight; the
    dequantization itself bit for bit."""
    pytest.importorskip("bitsandbytes")
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2  # the reference's own output rounding dominates
    worst = 0.0
    shapes = [(4096, 2560, True), (2560, 10240, True), (333, 448, False), (20480, 2560, True)]
    for i, (n, k, nested) in enumerate(shapes):
        p = quantized(n, k, dtype, i, compress_statistics=nested)
        want_w = bnb_weight(p)
        w = nf4.from_bnb(p)
        assert w.dtype == dtype and w.packed.data_ptr() == p.data.data_ptr()
        assert torch.equal(nf4.dequantize(w), want_w), "the kernels decode bnb's weight bit for bit"
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        pdl = launch.supported(torch.device("cuda"))
        for m in (1, 3, 8, 16, 33, 64, 100, 300):
            x = torch.randn(m, k, device="cuda").to(dtype)
            want = F.linear(x, want_w)
            launches = [None]  # nf4.linear without a plan: launch_for, or (300 rows) dequantize + F.linear
            if i < 2 and dtype == torch.bfloat16:  # the planned launches at this row count: codes by shuffle and by loads
                for rows, cands in nf4_plan.NF4_CANDIDATES.items():
                    if rows >= m:
                        launches += list({str(cfg): cfg for cfg in (nf4.with_split(c, m, n, k, sms, per_sm, shfl=True)
                                                                     for c in cands for per_sm in (0, 2, 4))}.values())
                        launches += [nf4.with_split(c, m, n, k, sms, shfl=False) for c in cands[:1]]
                        launches += [dict(nf4.with_split(c, m, n, k, sms, shfl=True), pdl=pdl) for c in cands]
                        break
                launches.append(dict(nf4.launch_for(m, n, k, sms, shfl=True), split=1))
                launches += [nf4.with_split(c, m, n, k, sms, per_sm) for c in  # the code lookup by byte permutes
                             ((16, 64, 128, 4, 3, True, True), (64, 128, 256, 8, 3, False, True)) for per_sm in (0, 4)]
            elif dtype == torch.float32:  # both kernels and both tile orientations on float32 activations
                launches += [dict(nf4.with_split(c, m, n, k, sms, shfl=True)) for c in
                             ((1, 16, 512, 4, 3, False), (16, 64, 128, 4, 3, True), (16, 32, 128, 4, 3, False))]
            for cfg in launches:
                got = nf4.linear(x, w) if cfg is None else nf4.nf4_matmul(x, w, **cfg)
                err = rel(got, want)
                assert err < tol, (n, k, m, cfg, err)
                worst = max(worst, err)
    print(f"nf4 {dtype}: worst relative error against dequantize_4bit + F.linear {worst:.1e}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nf4_mma_fragments_match_bitsandbytes_dequantize_and_matmul(dtype):
    """The kernel that decodes the codes into mma.sync fragments (`mma`: 8 and 16 rows of x per
    program; several tiles and K steps; K split or not; PDL), at 1 to 33
    rows, on Gemma-3 4B projection shapes and an odd one (rows not a multiple of 8, K not a
    multiple of the K step), against dequantize_4bit + F.linear on the same packed weight. A
    lane holding another fragment than the kernel assumes gives errors of order one."""
    pytest.importorskip("bitsandbytes")
    worst = 0.0
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pdl = launch.supported(torch.device("cuda"))
    for i, (n, k, nested) in enumerate([(4096, 2560, True), (2560, 10240, True), (333, 448, False)]):
        p = quantized(n, k, dtype, 10 + i, compress_statistics=nested)
        want_w = bnb_weight(p)
        w = nf4.from_bnb(p)
        for m in (1, 3, 8, 11, 16, 19, 33):
            x = torch.randn(m, k, device="cuda").to(dtype)
            want = F.linear(x, want_w)
            launches = []
            for bm in (8, 16):
                for bn, warps in ((64, 4), (32, 2), (128, 8)):
                    for bk in (128, 512):
                        for per_sm in (0, 4):
                            cand = (bm, bn, bk, warps, 3, False, False, True)
                            launches.append(nf4.with_split(cand, m, n, k, sms, per_sm))
            launches.append(dict(launches[0], pdl=pdl))
            for cfg in launches:
                err = rel(nf4.nf4_matmul(x, w, **cfg), want)
                assert err < 1.5e-2, (n, k, m, cfg, err)
                worst = max(worst, err)
    print(f"nf4 mma {dtype}: worst relative error against dequantize_4bit + F.linear {worst:.1e}")


def cuda_kernel() -> tuple[int, bool]:
    """The CUDA kernel built (skipped without bitsandbytes or a CUDA compiler): the device's
    multiprocessors and whether it launches with PDL."""
    pytest.importorskip("bitsandbytes")
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        pytest.skip("no CUDA compiler here: the engine keeps to the Triton kernels")
    assert nf4_cuda.extension() is not None, "the CUDA kernel builds where a compiler is installed"
    return torch.cuda.get_device_properties(0).multi_processor_count, launch.supported(torch.device("cuda"))


def test_nf4_cuda_one_row_kernel_matches_bitsandbytes_dequantize_and_matmul():
    """The CUDA kernel (kernels/nf4_cuda.py; built where a CUDA compiler is installed): its
    planned launches and others (1-8 weight rows per warp, one warp per row group or persistent
    warps, K split in 1-3 slices, also slices of one chunk; tiles of 16 rows on tensor cores in
    1-16 warps per block, K split 1-40 ways, 1-8 rows of x) on Gemma-3 4B projection shapes and
    odd ones (rows not a multiple of a warp's or a tile's; K of 64, 448, 768 and 1152: 1, 7, 12 and
    18 groups, slices shorter than a warp's ring), against dequantize_4bit + F.linear on the same
    packed weight, with and without PDL; a planned CUDA launch on an x it does not take (not
    16-byte aligned) runs the Triton kernel instead; planned launches replay from a CUDA graph, launched with PDL,
    the second reading what the first wrote."""
    sms, pdl = cuda_kernel()
    launches = list(nf4_cuda.CANDIDATES) + \
        [(r, 2, s, 0) for r in (1, 2, 4, 8) for s in (1, 3)] + \
        [(r, 4, s, b) for r in (1, 2, 4) for s in (1, 3) for b in (1, 8)] + \
        [(16, w_, s, 1) for w_ in (1, 8) for s in (0, 1, 3, 40)]
    worst, tiles = 0.0, 0
    shapes = [(4096, 2560), (2560, 10240), (333, 448), (20480, 2560), (7, 64), (45, 768), (1536, 1152)]
    for i, (n, k) in enumerate(shapes):
        p = quantized(n, k, torch.bfloat16, 20 + i, compress_statistics=i % 2 == 0)
        w = nf4.from_bnb(p)
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        want = F.linear(x, bnb_weight(p))
        assert nf4_cuda.fits(x, w)
        assert nf4_cuda.fits(x, w, (16, 8, 0, 1))
        for launch_ in launches:
            if not nf4_cuda.fits(x, w, launch_):
                continue
            err = rel(nf4_cuda.gemv(x, w, launch_, sms), want)
            assert err < 1.5e-2, (n, k, launch_, err)
            worst = max(worst, err)
            tiles += launch_[0] == nf4_cuda.TILE_ROWS
        for launch_ in nf4_cuda.CANDIDATES:  # with PDL, as a fused forward launches them
            if nf4_cuda.fits(x, w, launch_):
                assert torch.equal(nf4_cuda.gemv(x, w, launch_, sms, pdl), nf4_cuda.gemv(x, w, launch_, sms))
        buf = torch.randn(1, k + 1, device="cuda").to(torch.bfloat16)
        odd = buf[:, 1:]  # 2 bytes off a 16-byte boundary
        assert not nf4_cuda.fits(odd, w)
        for planned in (nf4_cuda.CANDIDATES[0], (16, 8, 0, 1)):
            plan = {1: {"cuda": planned}}
            assert rel(nf4.linear(odd, w, plan), F.linear(odd, bnb_weight(p))) < 1.5e-2
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # the CUDA launch between PDL-launched Triton ones, as in a forward
                outs = [nf4.linear(x, w, plan, pdl), nf4.linear(odd, w, plan, pdl)]
                outs.append(nf4.linear(outs[1][:, :k] if n >= k else x, w, plan, pdl))
            x.normal_()
            odd.normal_()
            graph.replay()
            assert torch.equal(outs[0], nf4.linear(x, w, plan)) and torch.equal(outs[1], nf4.linear(odd, w, plan))
            assert torch.equal(outs[2], nf4.linear(outs[1][:, :k] if n >= k else x, w, plan))
            assert rel(outs[0], F.linear(x, bnb_weight(p))) < 1.5e-2
        for m in (2, 3, 5, 8):  # 2-8 rows of x in tiles, K split or not
            xm = torch.randn(m, k + 256, device="cuda").to(torch.bfloat16)[:, 256:]  # rows k + 256 apart
            want_m = F.linear(xm, bnb_weight(p))
            for launch_ in ((16, 8, 0, 1), (16, 16, 1, 1), (16, 4, 3, 1)):
                # a block of 16 warps' rings takes 182 KiB of shared memory: more than some GPUs hold
                assert nf4_cuda.fits(xm, w, launch_) == nf4_cuda.tiles_supported(0, launch_[1])
                if not nf4_cuda.fits(xm, w, launch_):
                    continue
                err = rel(nf4_cuda.gemv(xm, w, launch_, sms, pdl), want_m)
                assert err < 1.5e-2, (n, k, m, launch_, err)
                worst = max(worst, err)
            assert not nf4_cuda.fits(xm, w, nf4_cuda.CANDIDATES[0])  # rows 1-8 per warp take one x row
            assert not nf4_cuda.fits(torch.randn(9, k, device="cuda").to(torch.bfloat16), w, (16, 8, 0, 1))
    held = [t for t in nf4_cuda.TILE_LAUNCHES + tuple((16, w_, 0, 1) for w_ in (1, 8) for _ in range(4))
            if nf4_cuda.tiles_supported(0, t[1])]
    assert tiles == len(shapes) * len(held), tiles  # every tile launch the GPU holds, on every shape
    print(f"nf4 cuda: worst relative error against dequantize_4bit + F.linear {worst:.1e}")


def test_nf4_cuda_block_tiles_match_bitsandbytes_dequantize_and_matmul():
    """The CUDA kernel's block tiles (4 or 8 warps of 32 weight rows, x's rows in the block's ring):
    1-64 rows of x (every count that changes how many of the mma's column blocks run, and counts
    between), K split or not, on Gemma-3 4B projection shapes and odd ones (rows not a multiple of a
    block's, K of 64 and 448: fewer groups than the ring's stages), against dequantize_4bit +
    F.linear on the same packed weight, as a whole and per x row and 32 weight rows; with PDL equal
    to without; replayed from a CUDA graph between PDL-launched Triton products; a planned block
    launch on an x it does not take (rows not 16-byte aligned) runs the Triton kernel instead."""
    sms, pdl = cuda_kernel()
    launches = list(nf4_cuda.BLOCK_LAUNCHES) + [(32, 4, 3, 1), (32, 8, 40, 1)]
    worst, runs = 0.0, 0
    shapes = [(4096, 2560), (2560, 10240), (333, 448), (20480, 2560), (7, 64), (2560, 2048)]
    for i, (n, k) in enumerate(shapes):
        p = quantized(n, k, torch.bfloat16, 40 + i, compress_statistics=i % 2 == 1)
        w, dense = nf4.from_bnb(p), bnb_weight(p)
        for m in (1, 2, 9, 16, 17, 31, 32, 33, 50, 64):
            xm = torch.randn(m, k + 64, device="cuda").to(torch.bfloat16)[:, 64:]  # rows k + 64 apart
            want = F.linear(xm, dense)
            for launch_ in launches:
                assert nf4_cuda.fits(xm, w, launch_) == nf4_cuda.blocks_supported(0, launch_[1])
                if not nf4_cuda.fits(xm, w, launch_):
                    continue
                got = nf4_cuda.gemv(xm, w, launch_, sms)
                err = rel(got, want)
                assert err < 1.5e-2 and worst_block_rel(got, want) < 3e-2, (n, k, m, launch_, err)
                worst = max(worst, err)
                runs += 1
                if launch_ in nf4_cuda.BLOCK_LAUNCHES[:2]:
                    assert torch.equal(nf4_cuda.gemv(xm, w, launch_, sms, pdl), got)
        assert not nf4_cuda.fits(torch.randn(65, k, device="cuda").to(torch.bfloat16), w, nf4_cuda.BLOCK_LAUNCHES[0])
        plan = {64: {"cuda": nf4_cuda.BLOCK_LAUNCHES[0]}}
        x = torch.randn(40, k, device="cuda").to(torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # the CUDA launch between PDL-launched Triton ones, as in a forward
            outs = [nf4.linear(x, w, {64: nf4.launch_for(64, n, k, sms)}, pdl), nf4.linear(x, w, plan, pdl)]
            outs.append(nf4.linear(outs[1][:, :k] if n >= k else x, w, plan, pdl))
        x.normal_()
        graph.replay()
        assert torch.equal(outs[1], nf4.linear(x, w, plan))
        assert torch.equal(outs[2], nf4.linear(outs[1][:, :k] if n >= k else x, w, plan))
        assert rel(outs[1], F.linear(x, dense)) < 1.5e-2
        odd = torch.randn(40, k + 1, device="cuda").to(torch.bfloat16)[:, 1:]  # rows 2 bytes off 16
        assert not nf4_cuda.fits(odd, w, plan[64]["cuda"])
        assert rel(nf4.linear(odd, w, plan), F.linear(odd, dense)) < 1.5e-2  # the Triton kernel instead
        # the measurement variants (bench.nf4_cuda): launched at 33-64 rows only; 1 and 6 never the
        # product (2 and 3 are where K fits the ring's first groups)
        for mode in ((1, 2, 3, 6) if nf4_cuda.fits(x, w, nf4_cuda.BLOCK_LAUNCHES[0]) else ()):
            got = nf4_cuda.gemv(x, w, nf4_cuda.BLOCK_LAUNCHES[0], sms, mode=mode)
            assert got.shape == outs[1].shape and (mode in (2, 3) or not torch.equal(got, outs[1]))
            with pytest.raises(RuntimeError, match="measurement modes"):
                nf4_cuda.gemv(x[:32], w, nf4_cuda.BLOCK_LAUNCHES[0], sms, mode=mode)
    assert runs >= len(shapes) * 10 * 3, runs  # the 8-warp blocks and more ran on every shape
    print(f"nf4 cuda block tiles: worst relative error against dequantize_4bit + F.linear {worst:.1e}")


def test_nf4_cuda_gate_up_with_its_activation_equals_the_product_then_gelu_mul():
    """`gelu=True` (the MLP's [gate; up] weight, gelu_tanh(gate) x up computed by the product's
    kernels): one-row, persistent, tile and block launches, each unsplit and K split, at 1-64 rows
    of x on Gemma-3 4B's gate/up shape and odd ones (I not a multiple of a tile's 8 rows, K of one
    group), against `fused_ops.gelu_mul` of the same launch's product (the same roundings: the
    activation's exp is CUDA's there, Triton's here, so an output may rarely differ by one bf16
    step) and of dequantize_4bit + F.linear; with PDL equal to without; `nf4.linear` with `gelu`
    on a planned launch that does not take x runs the Triton product and `gelu_mul`."""
    from engine.kernels import fused_ops

    sms, pdl = cuda_kernel()
    by_rows = {1: [nf4_cuda.CANDIDATES[0], (2, 2, 2, 0), (4, 8, 1, 8), (16, 12, 0, 1), (16, 8, 1, 1), (16, 8, 3, 1)],
               8: [(16, 8, 1, 1), (16, 8, 3, 1), (16, 12, 0, 1), (32, 8, 1, 1), (32, 8, 2, 1), (32, 4, 0, 1)],
               64: [(32, 8, 1, 1), (32, 8, 2, 1), (32, 4, 0, 1)]}
    runs, worst = 0, 0.0
    for i, (n, k) in enumerate([(20480, 2560), (2 * 1156, 448), (2 * 13, 64)]):
        p = quantized(n, k, torch.bfloat16, 60 + i)
        w, dense = nf4.from_bnb(p), bnb_weight(p)
        for m in (1, 2, 8, 9, 64):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            want = fused_ops.gelu_mul_ref(F.linear(x, dense))
            for launch_ in by_rows[min(r for r in by_rows if r >= m)]:
                if not nf4_cuda.fits(x, w, launch_):
                    continue
                got = nf4_cuda.gemv(x, w, launch_, sms, gelu=True)
                same = fused_ops.gelu_mul(nf4_cuda.gemv(x, w, launch_, sms))
                # the same roundings: at most one bf16 step apart where the two exps differ in
                # their last float32 bits, and that rarely (a rounding missed or added moves a
                # third of the outputs)
                assert got.shape == (m, n // 2), (n, k, m, launch_)
                assert ((got.float() - same.float()).abs() <= same.float().abs() * 2 ** -7).all(), (n, k, m, launch_)
                assert (got != same).float().mean().item() < 1e-2, (n, k, m, launch_)
                err = rel(got, want)
                assert err < 2e-2, (n, k, m, launch_, err)
                assert torch.equal(nf4_cuda.gemv(x, w, launch_, sms, pdl, gelu=True), got)
                worst, runs = max(worst, err), runs + 1
        odd = torch.randn(1, k + 1, device="cuda").to(torch.bfloat16)[:, 1:]  # 2 bytes off a 16-byte boundary
        got = nf4.linear(odd, w, {1: {"cuda": (16, 12, 0, 1)}}, gelu=True)
        assert rel(got, fused_ops.gelu_mul_ref(F.linear(odd, dense))) < 2e-2
    assert runs == 3 * (6 + 6 + 6 + 3 + 3), runs  # every launch, on every shape
    print(f"nf4 cuda gate/up with the activation: worst relative error {worst:.1e} over {runs} launches")


def test_nf4_products_replay_from_cuda_graphs_and_plans_choose_measured_launches():
    pytest.importorskip("bitsandbytes")
    ws = [nf4.from_bnb(quantized(2560, 2048, torch.bfloat16, s)) for s in range(4)]
    plan = nf4_plan.plan_nf4(ws)
    assert set(nf4_plan.NF4_CANDIDATES) <= set(plan) and max(plan) == nf4.MAX_KERNEL_ROWS
    print("plan:", {m: c and (c.get("cuda") or (c["block_m"], c["block_n"], c["block_k"], c["split"], c["warps"],
                                                 c["shfl"], c["permute"])) for m, c in plan.items()})
    assert all(plan[m] is not None for m in nf4_plan.NF4_CANDIDATES)
    assert all(plan[m]["shfl"] for m in nf4_plan.NF4_CANDIDATES if "cuda" not in plan[m]), \
        "the warp-shuffle code lookup agrees on this GPU"
    assert all(plan[m]["cuda"] in nf4_cuda.candidates(m) for m in nf4_plan.NF4_CANDIDATES if "cuda" in plan[m]), \
        "the CUDA kernel takes one row on FMAs or in tiles, 2-8 in tiles or block tiles, 9-64 in block tiles"
    assert all(plan[m] is None or "cuda" not in plan[m] for m in plan if m > nf4_cuda.MAX_X_ROWS)
    for m in (1, 5, 64, 200):  # 200: the planned kernel or the dequantized weight, captured either way
        x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
        eager = [nf4.linear(x, w, plan) for w in ws]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [nf4.linear(x, w, plan) for w in ws]
        x.normal_()
        graph.replay()
        again = [nf4.linear(x, w, plan) for w in ws]
        assert all(torch.equal(a, b) for a, b in zip(outs, again)) and not torch.equal(eager[0], again[0])
    # the same weights planned as an MLP's gate/up: the CUDA launches checked and timed with the
    # activation they compute, which `nf4.linear(..., gelu=True)` then runs, from a graph too
    from engine.kernels import fused_ops

    plan_g = nf4_plan.plan_nf4(ws, gelu=True)
    assert set(plan_g) == set(plan) and all(plan_g[m] is not None for m in nf4_plan.NF4_CANDIDATES)
    for m in (1, 5, 64, 200):
        x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [nf4.linear(x, w, plan_g, gelu=True) for w in ws]
        x.normal_()
        graph.replay()
        for w, out in zip(ws, outs):
            assert out.shape == (m, 1280) and torch.equal(out, nf4.linear(x, w, plan_g, gelu=True))
            assert rel(out, fused_ops.gelu_mul_ref(F.linear(x, nf4.dequantize(w)))) < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nf4_experts_match_bitsandbytes_dequantize_and_the_stock_math(dtype):
    """One Gemma-4 26B-A4B layer's experts (128, top 8, hidden 2816, 704 each) in NF4: the
    kernels (default and other launches, plain and PDL) at 1 to 64 tokens and the grouped path
    (prefill) at 65 and 300, routed at random and onto a few experts, against moe.experts_ref on bitsandbytes' dequantize_4bit of the same
    packed weights; the decode kernels replayed from a CUDA graph. In bf16, where the CUDA kernel
    builds, the same for its tensor-core tiles (nf4_cuda.EXPERT_LAUNCHES, plain and PDL)."""
    bnb = pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import dequantize_4bit

    E, H, inter, k = 128, 2816, 704, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    gu_f = (torch.randn(E, 2 * inter, H, device="cuda", generator=g) * 0.02).to(dtype)
    dn_f = (torch.randn(E, H, inter, device="cuda", generator=g) * 0.02).to(dtype)
    ex = NF4Experts.quantize(gu_f, dn_f)
    want = []  # bitsandbytes' own quantization of the same 2-D views: the same bytes, its dequantize
    for w, mine, shape in ((gu_f, ex.gate_up, (E, 2 * inter, H)), (dn_f, ex.down, (E, H, inter))):
        p = bnb.nn.Params4bit(w.reshape(-1, shape[2]), requires_grad=False, quant_type="nf4",
                              compress_statistics=False).cuda()
        assert torch.equal(p.data.reshape(-1), mine.packed.reshape(-1))
        want.append(dequantize_4bit(p.data, p.quant_state).view(shape))
        assert torch.equal(nf4.dequantize(mine).view(shape), want[-1])
        del p
    want_gu, want_dn = want
    del gu_f, dn_f, want
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    pdl = launch.supported(torch.device("cuda"))
    launches = [{}, dict(pdl=pdl), dict(shfl=False),
                dict(gate_up_launch=dict(block_n=4, block_k=128, warps=2, stages=2),
                     down_launch=dict(block_n=32, block_k=128, warps=4, stages=2))]
    tiles = dtype == torch.bfloat16 and nf4_cuda.extension() is not None
    if tiles:
        launches += [dict(tiles=t) for t in nf4_cuda.EXPERT_LAUNCHES if nf4_cuda.tiles_supported(0, t[0])] + \
            [dict(tiles=(8, 1), pdl=pdl)]
    worst = 0.0
    # random routing, and crowded routing (every token among the same 10 experts: up to 64 pairs
    # per expert, which the tiles take 8 at a time)
    for T, crowded in ((1, False), (2, False), (8, False), (8, True), (64, False), (64, True), (65, False),
                       (300, False)):
        idx = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=1).indices
        if crowded:
            idx = (torch.arange(k, device="cuda") * 7 + torch.randint(0, 3, (T, 1), device="cuda", generator=g)) % 10
        w = torch.rand(T, k, device="cuda", generator=g)
        x = torch.randn(T, H, device="cuda", generator=g).to(dtype)
        # tokens are independent: the reference (float32 copies of each pair's weights) 16 at a time
        want = torch.cat([moe.experts_ref(x[i:i + 16], idx[i:i + 16], w[i:i + 16], want_gu, want_dn)
                          for i in range(0, T, 16)])
        got = [ex(x, idx, w)]  # the kernels up to moe.MAX_TOKENS, then the grouped products
        assert nf4_cuda.experts_fit(x, ex.gate_up, ex.down, top_k=k) == (dtype == torch.bfloat16 and T * k <= 512)
        if T <= moe.MAX_TOKENS:
            got += [nf4_moe.experts(x, idx.int(), w, ex.gate_up, ex.down, **kw) for kw in launches]
        for y in got:
            assert y.dtype == dtype and y.shape == (T, H)
            err = rel(y, want)
            assert err < tol, (T, crowded, err)
            worst = max(worst, err)
    x = torch.randn(8, H, device="cuda", dtype=dtype)
    idx = torch.rand(8, E, device="cuda").topk(k, dim=1).indices.int()
    w = torch.rand(8, k, device="cuda")
    for kw in [{}] + ([dict(tiles=(8, 1), pdl=pdl)] if tiles else []):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = nf4_moe.experts(x, idx, w, ex.gate_up, ex.down, **kw)
        x.normal_()
        graph.replay()
        assert torch.equal(out, nf4_moe.experts(x, idx, w, ex.gate_up, ex.down, **kw))
    print(f"nf4 experts {dtype}: worst relative error against dequantize_4bit + the stock math {worst:.1e}")


def test_nf4_experts_plan_keeps_tiles_only_where_exact_and_timed_faster():
    """plan_experts on two Gemma-4 26B-A4B layers' NF4 experts: a launch (or None, the Triton
    kernels) per planned token count, each planned tile launch one of nf4_cuda.EXPERT_LAUNCHES
    that agrees with experts_ref, the lookup taking the smallest planned count that covers T; the
    plan is empty where the tiles cannot run (float32 experts)."""
    pytest.importorskip("bitsandbytes")
    E, H, inter, k = 128, 2816, 704, 8
    g = torch.Generator(device="cuda").manual_seed(1)
    layers = [NF4Experts.quantize((torch.randn(E, 2 * inter, H, device="cuda", generator=g) * 0.02).bfloat16(),
                                  (torch.randn(E, H, inter, device="cuda", generator=g) * 0.02).bfloat16())
              for _ in range(2)]
    plan = nf4_plan.plan_experts([(ex.gate_up, ex.down) for ex in layers], k)
    print("experts plan:", plan)
    if nf4_cuda.extension() is None:
        assert plan == {}
        return
    assert set(plan) == set(nf4_plan.EXPERT_TOKENS)
    assert all(t is None or t in nf4_cuda.EXPERT_LAUNCHES for t in plan.values())
    assert nf4_plan.expert_tiles_for(plan, 3) == plan[4] and nf4_plan.expert_tiles_for(plan, 65) is None
    for T, tiles in plan.items():
        if tiles is None:
            continue
        idx = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=1).indices
        w = torch.rand(T, k, device="cuda", generator=g)
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        want = nf4_moe.experts_ref(x, idx, w, layers[1].gate_up, layers[1].down)
        assert rel(nf4_moe.experts(x, idx.int(), w, layers[1].gate_up, layers[1].down, tiles=tiles), want) < 1.5e-2
    f32 = NF4Experts.quantize(torch.randn(E, 2 * inter, H, device="cuda") * 0.02,
                              torch.randn(E, H, inter, device="cuda") * 0.02)
    assert nf4_plan.plan_experts([(f32.gate_up, f32.down)], k) == {}


def stock_experts_on_dequantized(model) -> None:
    """Each NF4Experts replaced by the stock experts module holding its dequantized weights (the
    values bitsandbytes' dequantize_4bit gives; test_nf4_experts_... checks they are equal)."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    for layer in model.get_decoder().layers:
        ex = layer.experts
        if isinstance(ex, NF4Experts):
            stock = Gemma4TextExperts(model.config).to("cuda", ex.dtype)
            stock.gate_up_proj.data = nf4.dequantize(ex.gate_up).view_as(stock.gate_up_proj)
            stock.down_proj.data = nf4.dequantize(ex.down).view_as(stock.down_proj)
            layer.experts = stock


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_bnb4_checkpoint_is_quantized_on_its_way_to_the_device(family, tmp_path):
    """A bf16 checkpoint loaded with bnb-4bit (load_model): read on the CPU, each linear and each
    layer's experts quantized as they move to the GPU. The device's peak while loading stays well
    under the decoder's bf16 weights, and the model holds the same packed bytes as the same
    weights quantized on the device, so its engine gives the same greedy tokens."""
    pytest.importorskip("bitsandbytes")
    from engine.model.loader import load_model, quantize_bnb4
    from tests.helpers import byte_tokenizer

    def model():
        if family == "gemma3":
            return tiny_random_model(4, dtype=torch.bfloat16, num_hidden_layers=6, head_dim=64, hidden_size=512,
                                     intermediate_size=4096, num_attention_heads=4, num_key_value_heads=1)
        return tiny_gemma4(4, head_dim=64, global_head_dim=128, hidden_size=512, intermediate_size=128,
                           num_experts=64, moe_intermediate_size=512).to(torch.bfloat16)

    model().save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    decoder_bytes = sum(p.numel() * p.element_size() for p in model().get_decoder().layers.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    cfg = EngineConfig(model=str(tmp_path), device="cuda", dtype="bfloat16", quantization="bnb-4bit",
                       kv_policy="native", max_num_batched_tokens=64, kv_cache_bytes=1 << 24, max_rows=4)
    loaded = load_model(cfg)
    peak = torch.cuda.max_memory_allocated() - base
    print(f"bnb-4bit {family} from disk: device peak while loading {peak / 2**20:.0f} MiB, decoder in bf16 "
          f"{decoder_bytes / 2**20:.0f} MiB")
    assert peak < 0.7 * decoder_bytes
    in_memory = quantize_bnb4(model().cuda(), torch.bfloat16)
    for (name, a), (_, b) in zip(loaded.model.get_decoder().layers.named_modules(),
                                 in_memory.get_decoder().layers.named_modules()):
        assert type(a) is type(b), name
        if type(a).__name__ == "Linear4bit":
            assert torch.equal(a.weight.data, b.weight.data), name
        elif isinstance(a, NF4Experts):
            assert torch.equal(a.gate_up_packed, b.gate_up_packed) and torch.equal(a.down_scales, b.down_scales)
    assert any(isinstance(m, NF4Experts) for m in loaded.model.modules()) == (family == "gemma4")
    prompts = [[5, 9, 33, 7], list(range(40, 90))]
    outs = []
    for m in (loaded.model, in_memory):
        engine = Engine(cfg, LoadedModel(m, None, "tiny"))
        outs.append(run_all(engine, [Request(f"r{i}", p, greedy(12)) for i, p in enumerate(prompts)], {}))
    assert outs[0] == outs[1]


def nf4_engines(family: str, dtype, fused: bool, max_rows: int = 8):
    from engine.model.loader import quantize_bnb4

    if family == "gemma3":
        model = tiny_random_model(3, dtype=dtype, num_hidden_layers=6, head_dim=64, hidden_size=256,
                                  num_attention_heads=4, num_key_value_heads=1).cuda()
    else:  # widths that are whole groups of 64 everywhere
        model = tiny_gemma4(3, head_dim=64, global_head_dim=128, hidden_size=256, intermediate_size=128,
                            moe_intermediate_size=64).to("cuda", dtype)
    model = quantize_bnb4(model, dtype)
    if family == "gemma4" and not fused:
        stock_experts_on_dequantized(model)
    cfg = EngineConfig(model="tiny-random", device="cuda", dtype=str(dtype).split(".")[1], quantization="bnb-4bit",
                       kv_policy="native", max_num_batched_tokens=64, kv_cache_bytes=1 << 24, max_rows=max_rows,
                       fused_layers=fused, nf4_kernels=fused)
    engine = Engine(cfg, LoadedModel(model, None, "tiny"))
    kinds = {type(m).__name__ for m in model.get_decoder().layers.modules()}
    if fused:  # every 4-bit linear repacked, the fused forward on them (and on NF4 experts)
        assert engine.runner.fused is not None and "NF4Linear" in kinds and "Linear4bit" not in kinds
        assert ("NF4Experts" in kinds) == (family == "gemma4")
    else:  # bitsandbytes' own forward
        assert engine.runner.fused is None and "Linear4bit" in kinds and "NF4Linear" not in kinds
    return engine


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_nf4_engine_greedy_tokens_equal_the_engine_on_bitsandbytes(family):
    """The same NF4 weights: the engine's fused forward on the NF4 kernels (captured decode
    graphs, batches of 1 to 4 rows, prefill chunks through the dequantized weights) against its
    stock layers on bitsandbytes' Linear4bit. float32 compute: equal greedy tokens, logits to
    float rounding; bfloat16: tokens equal up to rounding-driven divergence."""
    pytest.importorskip("bitsandbytes")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 40, 130, 77)]
    for dtype in (torch.float32, torch.bfloat16):
        outs, recs = {}, {}
        for fused in (True, False):
            engine = nf4_engines(family, dtype, fused)
            recs[fused] = Recorder(engine)
            outs[fused] = run_all(engine, [Request(f"r{i}", p, greedy(24)) for i, p in enumerate(prompts)],
                                  {"r1": 3, "r2": 9})
            assert engine.runner.decoder.steps > 10
            engine.check_invariants()
        prefix = 0
        for r in outs[True]:
            for a, b in zip(outs[True][r], outs[False][r]):
                if a != b:
                    break
                prefix += 1
        common = recs[True].logits.keys() & recs[False].logits.keys()
        diff = max((recs[True].logits[k] - recs[False].logits[k]).abs().max().item() for k in common)
        total = 24 * len(prompts)
        print(f"nf4 {family} {dtype}: {prefix}/{total} tokens equal to bitsandbytes' path; max |logit diff| {diff:.2e}")
        if dtype == torch.float32:
            assert prefix == total and diff < 1e-3
        else:
            assert prefix >= 0.8 * total
