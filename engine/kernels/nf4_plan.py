"""The launches of the NF4 kernels (kernels/nf4.py, and at 1-64 rows the CUDA kernel of
kernels/nf4_cuda.py) per row count, timed on a model's own weights when a fused forward is built,
and kept only where they agree with the library's product on the dequantized weight; and per
token count, whether a MoE model's NF4 experts run on the CUDA kernel's tensor-core tiles or on
the Triton kernels of kernels/nf4_moe.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import moe, nf4_cuda, nf4_moe
from engine.kernels.fused_ops import gelu_mul
from engine.kernels.nf4 import MAX_KERNEL_ROWS, NF4Weight, dequantize, launch_for, nf4_matmul, triton, with_split

# launches `plan_nf4` times per row count (block_m, block_n, block_k, warps, stages, swap[,
# permute[, mma]]): one row of x per program on FMAs (block_m 1), tiles of 16 to 64 rows on
# tensor cores (swap: as W x^T; permute: the codes looked up by byte permutes, faster than the
# shuffle in tiles of 16 rows, slower in tiles of 64 and in the one-row kernel), or up to 8 or 16
# rows with the codes decoded into mma.sync fragments (mma: fastest at 2 to 16 rows on most
# projections, slower than the one-row kernel at one). Each is tried without a K split and with
# K split for about 2 and about 4 programs per SM (`with_split`; the split is a launch argument,
# so all share one compiled kernel). Each set holds the launches that were fastest for some
# Gemma-3 4B projection at that row count on an H200, out of a wider sweep of tile shapes, warps
# and stages.
_MMA8 = ((8, 32, 128, 2, 3, False, False, True), (8, 32, 256, 2, 3, False, False, True),
         (8, 64, 256, 4, 3, False, False, True))
NF4_CANDIDATES = {
    1: ((1, 16, 512, 4, 3, False), (1, 8, 512, 4, 3, False), (1, 32, 256, 4, 3, False), (1, 32, 512, 8, 3, False),
        (1, 16, 512, 4, 2, False)),
    2: ((1, 32, 256, 4, 3, False), (1, 16, 512, 4, 3, False), (16, 64, 128, 4, 3, True),
        (16, 64, 256, 4, 3, True), (16, 64, 128, 4, 3, True, True)) + _MMA8,
    4: ((16, 64, 128, 4, 3, True), (16, 64, 256, 4, 3, True), (16, 32, 256, 4, 3, False),
        (16, 64, 128, 4, 3, True, True)) + _MMA8,
    8: ((16, 64, 128, 4, 3, True), (16, 64, 256, 4, 3, True), (16, 32, 128, 4, 3, False),
        (16, 64, 128, 4, 3, True, True)) + _MMA8,
    16: ((16, 64, 128, 4, 3, True), (16, 64, 256, 4, 3, True), (16, 32, 256, 4, 3, False),
         (16, 64, 128, 4, 3, True, True), (16, 32, 128, 2, 3, False, False, True),
         (16, 32, 256, 2, 3, False, False, True), (16, 64, 256, 2, 3, False, False, True)),
    32: ((32, 64, 128, 4, 3, True), (32, 64, 256, 4, 3, True), (32, 32, 256, 4, 3, False)),
    64: ((64, 64, 128, 4, 3, True), (64, 64, 128, 4, 2, False), (64, 32, 128, 4, 3, False),
         (64, 32, 256, 4, 3, False)),
}

TIMED_ELEMENTS = 1 << 22  # smaller weights take launch_for's launches (checked, not timed against others)


def agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    """A product within its dtype's rounding of the reference (relative norm of the difference)."""
    tol = 1e-4 if got.dtype == torch.float32 else 2e-2
    return bool(((got.float() - want.float()).norm() <= tol * want.float().norm()).item())


@torch.no_grad()
def plan_nf4(weights: list[NF4Weight], pdl_for=None, cuda: bool = True, gelu: bool = False) -> dict[int, dict | None]:
    """Per planned row count (NF4_CANDIDATES), the fastest `nf4_matmul` launch on these
    same-shaped weights (a product with each in turn, as a forward runs its layers), timed from
    a CUDA graph, launched with PDL where `pdl_for(rows)` says the forward will. Each launch is
    first checked against the library's product with the dequantized first weight, and only
    launches that agree are kept: those whose codes are looked up by warp shuffle, or, where
    none of them agrees at a row count, those that load them. Above the largest planned row
    count, up to MAX_KERNEL_ROWS, `launch_for`'s launch where it agrees and beats dequantizing
    the weight for the library's product, else None (that product). Weights under
    TIMED_ELEMENTS (test models) are planned with `launch_for`'s launches alone. At 1-64 rows of
    bf16 activations the CUDA kernel's launches (nf4_cuda.candidates, where it is built and
    `cuda`) that take x (`nf4_cuda.fits`) are checked and timed beside the Triton ones, as
    {"cuda": launch}. `gelu`: the weights are the MLP's gate/up, which `nf4.linear(..., gelu=True)`
    runs: the CUDA launches are checked and timed with the activation they compute, the Triton
    ones with `gelu_mul` after them."""
    if triton is None or not weights or weights[0].device.type != "cuda":
        return {}
    from engine.kernels.small_linear import graph_ms

    w0 = weights[0]
    n, k = w0.shape
    act = (lambda y, pdl: gelu_mul(y, pdl)) if gelu else (lambda y, pdl: y)  # what follows the product
    sms = torch.cuda.get_device_properties(w0.device).multi_processor_count
    dense = dequantize(w0)
    plan: dict[int, dict | None] = {}

    def good(x, cfg) -> bool:
        try:
            return agrees(nf4_matmul(x, w0, **cfg), F.linear(x, dense))
        except Exception:  # a launch this GPU cannot compile (shared memory, registers)
            return False

    shfl = True
    for m, cands in NF4_CANDIDATES.items():
        if n * k < TIMED_ELEMENTS:  # a small weight: launch_for's launch, checked, is as good as any
            c = launch_for(m, n, k, sms)
            cands = [(c["block_m"], c["block_n"], c["block_k"], c["warps"], c["stages"], c["swap"])]
        x = torch.randn(m, k, device=w0.device).to(w0.dtype)
        pdl = pdl_for is not None and pdl_for(m)
        for lookup in dict.fromkeys((shfl, False)):
            best, tried = None, []
            for cand in cands:
                for per_sm in (0, 2, 4):
                    cfg = with_split(cand, m, n, k, sms, per_sm, lookup)
                    if cfg in tried:
                        continue
                    tried.append(cfg)
                    if not good(x, cfg):
                        continue
                    t = graph_ms(lambda cfg=cfg: [act(nf4_matmul(x, w, **cfg, pdl=pdl), pdl) for w in weights],
                                 reps=3)
                    if best is None or t < best:
                        best, plan[m] = t, cfg
            if best is not None:
                break
            shfl = False  # the shuffle lookup disagrees (or does not compile) here: loads from now on
        if (m <= nf4_cuda.MAX_X_ROWS and cuda and n * k >= TIMED_ELEMENTS and x.dtype == torch.bfloat16
                and nf4_cuda.extension()):
            want = act(F.linear(x, dense), False)
            for launch in nf4_cuda.candidates(m):
                if not nf4_cuda.fits(x, w0, launch):
                    continue
                try:
                    if not agrees(nf4_cuda.gemv(x, w0, launch, sms, pdl, gelu=gelu), want):
                        continue
                except RuntimeError:  # a launch this GPU refuses (resources)
                    continue
                t = graph_ms(lambda launch=launch: [nf4_cuda.gemv(x, w, launch, sms, pdl, gelu=gelu) for w in weights],
                             reps=3)
                if best is None or t < best:
                    best, plan[m] = t, {"cuda": launch}
    rows = max(NF4_CANDIDATES)
    while rows < MAX_KERNEL_ROWS:  # launch_for's tiles of 64 rows, or the weight dequantized for the library
        rows *= 2
        x = torch.randn(rows, k, device=w0.device).to(w0.dtype)
        cfg = launch_for(rows, n, k, sms, shfl)
        pdl = pdl_for is not None and pdl_for(rows)
        plan[rows] = None
        if good(x, cfg):
            ours = graph_ms(lambda cfg=cfg: [nf4_matmul(x, w, **cfg, pdl=pdl) for w in weights], reps=3)
            lib = graph_ms(lambda: [F.linear(x, dequantize(w)) for w in weights], reps=3)
            plan[rows] = cfg if ours < lib else None
    return plan


# token counts the experts' plan times (decode batches up to moe.MAX_TOKENS take the smallest
# that covers them)
EXPERT_TOKENS = (1, 2, 4, 8, 16, 32, 64)


def expert_tiles_for(plan: dict[int, tuple[int, int] | None], tokens: int) -> tuple[int, int] | None:
    """The planned tile launch for `tokens` tokens (None: the Triton kernels)."""
    fit = [t for t in plan if t >= tokens]
    return plan[min(fit)] if fit else None


@torch.no_grad()
def plan_experts(layers: list[tuple[NF4Weight, NF4Weight]], top_k: int,
                 pdl_for=None) -> dict[int, tuple[int, int] | None]:
    """Per token count (EXPERT_TOKENS), the tensor-core tile launch of kernels/nf4_cuda.py
    (nf4_cuda.EXPERT_LAUNCHES) for both expert stages of these layers' NF4 experts ((gate_up,
    down) per layer, same shapes), where one agrees with `nf4_moe.experts_ref` and runs the
    layers faster than the Triton kernels (timed from a CUDA graph, each layer routed anew, with
    PDL where `pdl_for(tokens)` says the forward launches with it); else None, the Triton
    kernels. Empty where the CUDA kernel is not built or does not take the experts. Timed as the
    forward runs them: the pairs' partials left for the layer's end to add (`pairs`)."""
    from engine.kernels.small_linear import graph_ms

    if not layers or layers[0][0].device.type != "cuda" or nf4_cuda.extension() is None:
        return {}
    gate_up, down = layers[0]
    hidden, inter = gate_up.shape[1], down.shape[1]
    n_experts = gate_up.shape[0] // (2 * inter)
    dev = gate_up.device
    g = torch.Generator(device=dev).manual_seed(0)
    x0 = torch.empty(1, hidden, device=dev, dtype=torch.bfloat16)
    if gate_up.dtype != torch.bfloat16 or not nf4_cuda.experts_fit(x0, gate_up, down):
        return {}
    plan: dict[int, tuple[int, int] | None] = {}
    for tokens in EXPERT_TOKENS:
        if tokens > moe.MAX_TOKENS:
            break
        x = torch.randn(tokens, hidden, device=dev, generator=g).to(torch.bfloat16)
        idxs = [torch.rand(tokens, n_experts, device=dev, generator=g).topk(top_k, dim=1).indices.int()
                for _ in layers]
        w = torch.rand(tokens, top_k, device=dev, generator=g)
        pdl = pdl_for is not None and pdl_for(tokens)
        want = nf4_moe.experts_ref(x, idxs[0].long(), w, gate_up, down)

        def run(tiles):
            return [nf4_moe.experts(x, idx, w, gu, dn, pdl=pdl, tiles=tiles, pairs=True)
                    for idx, (gu, dn) in zip(idxs, layers)]

        best, plan[tokens] = graph_ms(lambda: run(None), reps=3), None
        for tiles in nf4_cuda.EXPERT_LAUNCHES:
            if not nf4_cuda.experts_fit(x, gate_up, down, tiles, top_k):
                continue
            try:
                if not agrees(nf4_moe.experts(x, idxs[0], w, gate_up, down, pdl=pdl, tiles=tiles), want):
                    continue
            except RuntimeError:  # a launch this GPU refuses (resources)
                continue
            t = graph_ms(lambda tiles=tiles: run(tiles), reps=3)
            if t < best:
                best, plan[tokens] = t, tiles
    return plan
