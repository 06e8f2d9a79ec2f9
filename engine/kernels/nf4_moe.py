"""A mixture-of-experts block at decode batch sizes on NF4 experts (Triton on CUDA, torch ops
elsewhere): kernels/moe.py's two expert stages reading 4-bit weights.

A layer's experts are two `NF4Weight`s (kernels/nf4.py) whose rows are the experts' rows in
expert order: gate/up [E * 2I, H] (expert e's gate rows at e * 2I, its up rows I after them) and
down [E * H, I] (expert e's rows at e * H). Each is bitsandbytes' NF4 packing of the expert tensor
viewed as 2-D (groups of 64 along a row), so a row of one expert is a row of the weight.

  expert_gate_up  per (token, chosen expert) pair: that expert's gate and up rows against the
                  token, each group of 64 decoded in registers (the code lookup and the
                  (even, odd) activation pairs of nf4.py's one-row kernel), its products summed
                  and scaled by the group's absmax once; then gelu_tanh(gate) * up
  expert_down     per pair: the expert's down rows against the pair's activation, weighted by
                  the router into a float32 partial; then moe's `_sum_pairs` adds each token's k
                  partials in order (no atomics), or, with `pairs`, the kernel after the block

Where kernels/nf4_cuda.py is built, `experts(..., tiles=launch)` runs both stages on its
tensor-core tiles instead (the pairs grouped by expert, up to 8 of one expert per tile, each
weight byte's two codes looked up at once, the codes rounded to bf16 as tensor cores take them;
the same roundings of the outputs, and the same `_sum_pairs`, or `pairs`).

The products are those of the exact weights (code x absmax in float32), within a rounding of
the library's, which rounds each weight to the compute dtype first; each product's output and
the activation are rounded to the compute dtype where the stock module rounds them, as in
moe.py. `experts_ref` is the same math on the dequantized weights (the kernels' test oracle).
"""

from __future__ import annotations

import torch

from engine.kernels import moe, nf4, nf4_cuda
from engine.kernels.launch import kernel_args
from engine.kernels.nf4 import NF4Weight

try:
    import triton
    import triton.language as tl

    from engine.kernels.launch import pdl_enter
    from engine.kernels.moe import store_activation, _sum_pairs
    from engine.kernels.nf4 import _codes, _gemv_tile, _x_tile
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None


def experts_ref(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: NF4Weight,
                down: NF4Weight) -> torch.Tensor:
    """`moe.experts_ref` on the dequantized weights of the experts chosen, and only those (x [T,
    H], experts and weights [T, k]; gate_up rows E * 2I, down rows E * H)."""
    H = x.shape[1]
    inter = down.shape[1]
    chosen, local = torch.unique(experts, return_inverse=True)  # the chosen experts as 0..u-1
    gu = torch.stack([nf4.dequantize(expert_rows(gate_up, e, 2 * inter)) for e in chosen.tolist()])
    dn = torch.stack([nf4.dequantize(expert_rows(down, e, H)) for e in chosen.tolist()])
    return moe.experts_ref(x, local.view(experts.shape), weights, gu, dn)


def expert_rows(w: NF4Weight, e: int, rows: int) -> NF4Weight:
    """Expert e's `rows` rows of a weight that holds the experts' rows in order (a view)."""
    lo = e * rows
    return NF4Weight(w.packed[lo:lo + rows], w.scales[lo:lo + rows], w.code, w.dtype)


if triton is not None:

    @triton.jit
    def _nf4_rows_dot(P, S, C, rows, nm, xr, k_hi, stride_p, stride_s, g, j, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SHFL: tl.constexpr, X16: tl.constexpr, BF16: tl.constexpr,
                      EVEN: tl.constexpr, STAGES: tl.constexpr):
        """Weight rows `rows` ([BLOCK_N], absolute) against the activation row xr over [0, k_hi):
        [BLOCK_N] float32, each group's products summed before its absmax scales them."""
        acc = tl.zeros([BLOCK_N, BLOCK_K // 64], tl.float32)
        for k0 in tl.range(0, k_hi, BLOCK_K, num_stages=STAGES):
            p, s = _gemv_tile(P, S, rows, nm, g, j, k0, k_hi, stride_p, stride_s, EVEN)
            hi, lo = _codes(p, C, SHFL)
            xe, xo = _x_tile(xr, g, j, k0, k_hi, X16, BF16, EVEN)
            acc += (tl.sum(hi * xe[None, :, :], axis=2) + tl.sum(lo * xo[None, :, :], axis=2)) * s
        return tl.sum(acc, axis=1)

    @triton.jit
    def _nf4_expert_gate_up(X, Experts, P, S, C, Act, H, inter, stride_p, stride_s, K: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SHFL: tl.constexpr, X16: tl.constexpr,
                            BF16: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr,
                            GDC: tl.constexpr = False):
        pdl_enter(GDC)
        p = tl.program_id(0).to(tl.int64)  # one (token, expert) pair
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = rn < inter
        e = tl.load(Experts + p).to(tl.int64)
        xr = X + (p // K) * H
        gi = tl.arange(0, BLOCK_K // 64)
        j = tl.arange(0, 32)
        gate_rows = e * 2 * inter + rn
        acc_g = _nf4_rows_dot(P, S, C, gate_rows, nm, xr, H, stride_p, stride_s, gi, j, BLOCK_N, BLOCK_K, SHFL,
                              X16, BF16, EVEN, STAGES)
        acc_u = _nf4_rows_dot(P, S, C, gate_rows + inter, nm, xr, H, stride_p, stride_s, gi, j, BLOCK_N, BLOCK_K,
                              SHFL, X16, BF16, EVEN, STAGES)
        store_activation(acc_g, acc_u, Act + p * inter + rn, nm)

    @triton.jit
    def _nf4_expert_down_pairs(Act, Experts, Weights, P, S, C, Part, H, inter, stride_p, stride_s,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SHFL: tl.constexpr, X16: tl.constexpr,
                               BF16: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr,
                               GDC: tl.constexpr = False):
        pdl_enter(GDC)
        p = tl.program_id(0).to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = rn < H
        e = tl.load(Experts + p).to(tl.int64)
        g = tl.arange(0, BLOCK_K // 64)
        j = tl.arange(0, 32)
        acc = _nf4_rows_dot(P, S, C, e * H + rn, nm, Act + p * inter, inter, stride_p, stride_s, g, j, BLOCK_N,
                            BLOCK_K, SHFL, X16, BF16, EVEN, STAGES)
        y = acc.to(Act.dtype.element_ty).to(tl.float32) * tl.load(Weights + p)
        tl.store(Part + p * H + rn, y, mask=nm)


# launch shapes for Gemma-4 26B-A4B experts in NF4 (hidden 2816, 704 per expert), the fastest on
# an H200 at 1 and 8 tokens (`python -m bench.tune_kernels --shape gemma4-26b-a4b --experts 1 8
# --nf4`): the gate/up stage by token count (the launch for the fewest tokens that covers T), the
# down stage one launch for both
GATE_UP = {1: dict(block_n=8, block_k=256, warps=2, stages=3),
           moe.MAX_TOKENS: dict(block_n=32, block_k=128, warps=2, stages=3)}
DOWN = dict(block_n=32, block_k=128, warps=2, stages=3)


def experts(x: torch.Tensor, experts_idx: torch.Tensor, weights: torch.Tensor, gate_up: NF4Weight,
            down: NF4Weight, gate_up_launch: dict | None = None, down_launch: dict | None = None,
            pdl: bool = False, shfl: bool = True, tiles: tuple[int, int] | None = None,
            pairs: bool = False) -> torch.Tensor:
    """See `experts_ref` (Triton, up to moe.MAX_TOKENS tokens; CUDA, or the interpreter in
    tests). The launches default to GATE_UP's for T tokens and DOWN; `shfl`: the code lookup by
    warp shuffle (CUDA only), else by loads. `tiles` (warps per block, blocks per SM): both stages
    on kernels/nf4_cuda.py's tensor-core tiles instead, where that kernel is built and takes the
    operands. `pairs`: the down stage's weighted float32 partials [T k, H], unsummed (as
    `moe.experts`)."""
    T, k = experts_idx.shape
    GU = gate_up_launch or GATE_UP[min(t for t in GATE_UP if t >= min(T, moe.MAX_TOKENS))]
    DN = down_launch or DOWN
    H = x.shape[1]
    inter = down.shape[1]
    if gate_up.shape[1] != H or down.shape[0] * 2 * inter != gate_up.shape[0] * H or x.dtype != gate_up.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not match NF4 experts {gate_up.shape}, {down.shape}")
    if x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:  # rows of whole, aligned (even, odd) pairs
        x = x.clone(memory_format=torch.contiguous_format)
    idx = experts_idx.contiguous()
    wts = weights.float().contiguous()
    if not T:
        return torch.empty((0, H), dtype=torch.float32 if pairs else x.dtype, device=x.device)
    args = kernel_args(pdl)

    def summed(part):
        if pairs:
            return part
        y = torch.empty((T, H), dtype=x.dtype, device=x.device)
        _sum_pairs[(T, triton.cdiv(H, 1024))](part, y, H, K=k, BLOCK=1024, num_warps=4, **args)
        return y

    if tiles is not None and nf4_cuda.extension() is not None and nf4_cuda.experts_fit(x, gate_up, down, tiles, k):
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        return summed(nf4_cuda.experts(x, idx, wts, gate_up, down, tiles, sms, pdl))
    common = dict(SHFL=shfl and x.is_cuda, X16=x.element_size() == 2, BF16=x.dtype == torch.bfloat16)
    act = torch.empty((T * k, inter), dtype=x.dtype, device=x.device)
    _nf4_expert_gate_up[(T * k, triton.cdiv(inter, GU["block_n"]))](
        x, idx, gate_up.packed, gate_up.scales, gate_up.code, act, H, inter, gate_up.packed.stride(0),
        gate_up.scales.stride(0), K=k, BLOCK_N=GU["block_n"], BLOCK_K=GU["block_k"], EVEN=H % GU["block_k"] == 0,
        STAGES=GU["stages"], num_warps=GU["warps"], **common, **args)
    part = torch.empty((T * k, H), dtype=torch.float32, device=x.device)
    _nf4_expert_down_pairs[(T * k, triton.cdiv(H, DN["block_n"]))](
        act, idx, wts, down.packed, down.scales, down.code, part, H, inter, down.packed.stride(0),
        down.scales.stride(0), BLOCK_N=DN["block_n"], BLOCK_K=DN["block_k"], EVEN=inter % DN["block_k"] == 0,
        STAGES=DN["stages"], num_warps=DN["warps"], **common, **args)
    return summed(part)
