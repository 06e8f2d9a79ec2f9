"""bitsandbytes NF4 weights through the engine's own kernels: one fused dequantize-and-multiply
for decode batches, a dequantize to the compute dtype for prefill chunks.

bitsandbytes stores a 4-bit weight [N, K] as the row-major flattening of its elements in groups
of `GROUP` (64) consecutive values: per group one absolute maximum (float32, or itself quantized
to 8 bits per 256 groups with an offset, "nested"), and per element a 4-bit index into the
16-entry NF4 code table, two to a byte, the earlier element in the high nibble. It dequantizes
an element as `code[index] * absmax` in float32, rounded once to the compute dtype.

`NF4Weight` is that weight as the kernels read it, made once at load (`from_bnb`): bnb's packed
bytes viewed as [N, K / 2] uint8 (a row's groups are whole when K is a multiple of 64, the only
case taken), the groups' absmax decoded once to float32 [N, K / 64] (bnb's own decoding of the
nested form, so the values are its values), and the code table. Rows of several projections
with one input are concatenated (`fuse`), as the bf16 forward fuses Q/K/V and gate/up.

`nf4_matmul` (x [M, K] @ W^T): each program owns `block_n` output columns and a `k_per` slice
of K (split-K where there are too few columns to cover the GPU: float32 partials per split, then
one kernel sums them in a fixed order; no atomics), streams its weight once for all M rows, a
few whole groups per step ([block_n, 32] bytes and one scale per row each), decodes them in
registers (code gather, times the group's absmax, rounded to the compute dtype exactly as bnb's
dequantize rounds) and multiplies: broadcast FMAs into per-column partial sums for a few rows
(reduced once at the end), `tl.dot` for 16 or more. The activations are read at even and odd
columns, against the high and low nibbles, so the packed bytes never need reordering.
`plan_nf4` times a few launches per row count on a model's own weights and keeps the fastest
(`launch_for` is a fixed rule for where there is no plan); from 128 rows it also weighs the
library's product on the dequantized weight. `dequantize` writes the whole weight in the compute
dtype (prefill chunks).

Without Triton, or off CUDA (tests), `dequantize_ref` and `F.linear` compute the same function.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.launch import kernel_args

try:
    import triton
    import triton.language as tl

    from engine.kernels.launch import pdl_enter
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None

GROUP = 64  # elements per absmax group: the bitsandbytes blocksize taken
MAX_KERNEL_ROWS = 256  # more rows (prefill chunks) dequantize the weight and run the library product


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.device.type == "cuda"


@dataclass(frozen=True)
class NF4Weight:
    """A [N, K] NF4 weight: packed [N, K / 2] uint8 (element 2j of a row in byte j's high nibble,
    2j + 1 in its low nibble), scales [N, K / 64] float32 (each group's absmax), code [16]
    float32 (the NF4 table), dtype: the compute dtype its products and dequantization give."""

    packed: torch.Tensor
    scales: torch.Tensor
    code: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], 2 * self.packed.shape[1]

    @property
    def device(self) -> torch.device:
        return self.packed.device


def refusal(weight) -> str | None:
    """Why a bitsandbytes `Params4bit` cannot become an `NF4Weight` (None: it can)."""
    qs = getattr(weight, "quant_state", None)
    if qs is None:
        return "not quantized"
    if qs.quant_type != "nf4":
        return f"quant_type {qs.quant_type!r} (NF4 only)"
    if qs.blocksize != GROUP:
        return f"blocksize {qs.blocksize} (64 only)"
    if len(qs.shape) != 2 or qs.shape[1] % GROUP:
        return f"shape {tuple(qs.shape)}: rows that are not whole groups of 64"
    if qs.code.numel() != 16:
        return "a code table of other than 16 entries"
    return None


@torch.no_grad()
def from_bnb(weight) -> NF4Weight:
    """The kernels' view of a quantized bitsandbytes `Params4bit`: its packed bytes (the same
    memory), its groups' absmax decoded to float32 as bnb's dequantize decodes them, its code."""
    why = refusal(weight)
    if why is not None:
        raise ValueError(f"NF4 kernels cannot take this weight: {why}")
    qs = weight.quant_state
    n, k = qs.shape
    packed = weight.data.reshape(-1).view(torch.uint8)  # any quant_storage dtype holds the same bytes
    if packed.numel() != n * k // 2:
        raise ValueError(f"packed weight of {packed.numel()} bytes for shape {(n, k)}")
    absmax = qs.absmax
    if qs.nested:
        from bitsandbytes.functional import dequantize_blockwise

        absmax = dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
    scales = absmax.float().reshape(n, k // GROUP).contiguous()
    code = qs.code.to(device=packed.device, dtype=torch.float32).contiguous()
    return NF4Weight(packed.view(n, k // 2), scales, code, qs.dtype)


def fuse(weights: list[NF4Weight]) -> NF4Weight:
    """One weight whose rows are those of `weights` in order (same K, code and dtype)."""
    w0 = weights[0]
    for w in weights[1:]:
        if w.shape[1] != w0.shape[1] or w.dtype != w0.dtype or not torch.equal(w.code, w0.code):
            raise ValueError("only NF4 weights of one input width, dtype and code table fuse")
    return NF4Weight(torch.cat([w.packed for w in weights]), torch.cat([w.scales for w in weights]), w0.code,
                     w0.dtype)


def dequantize_ref(w: NF4Weight) -> torch.Tensor:
    """The weight [N, K] in its compute dtype, in torch ops: code[index] * absmax in float32,
    rounded once."""
    n, k = w.shape
    idx = torch.stack([w.packed >> 4, w.packed & 15], dim=-1).reshape(n, k).long()
    vals = w.code[idx].view(n, k // GROUP, GROUP) * w.scales[..., None]
    return vals.reshape(n, k).to(w.dtype)


if triton is not None:

    @triton.jit
    def _nf4_group(P, S, C, rn, nm, kg, k_hi, stride_p, stride_s, OUT: tl.constexpr):
        """The group of 64 columns from kg of weight rows rn, decoded: (even columns, odd columns),
        each [BLOCK_N, 32] in OUT (zero past k_hi and past the last row)."""
        ok = nm & ((rn * 0 + kg) < k_hi)
        row = rn.to(tl.int64)
        rb = tl.arange(0, 32)
        p = tl.load(P + row[:, None] * stride_p + (kg // 2 + rb)[None, :], mask=ok[:, None], other=0)
        s = tl.load(S + row * stride_s + kg // 64, mask=ok, other=0.0)[:, None]
        hi = (tl.load(C + (p >> 4).to(tl.int32)) * s).to(OUT)
        lo = (tl.load(C + (p & 15).to(tl.int32)) * s).to(OUT)
        return hi, lo

    @triton.jit
    def _x_group(xrow, mm, kg, k_hi):
        """The activations' even and odd columns of the group from kg: [BLOCK_M, 32] each."""
        col = kg + 2 * tl.arange(0, 32)
        xm = mm[:, None] & (col < k_hi)[None, :]
        return tl.load(xrow + col[None, :], mask=xm, other=0.0), tl.load(xrow + col[None, :] + 1, mask=xm, other=0.0)

    @triton.jit
    def _nf4_matmul_kernel(X, P, S, C, Y, M, N, K, stride_xm, stride_p, stride_s, k_per,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PARTIAL: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr, GDC: tl.constexpr = False):
        """Each step of the K loop decodes BLOCK_K / 64 whole groups, one [BLOCK_N, 32] tile of
        bytes each (no reshape: a group's scale is one value per row)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        nm = rn < N
        mm = rm < M
        k_lo = pid_k * k_per
        k_hi = tl.minimum(k_lo + k_per, K)
        pdl_enter(GDC)
        xrow = X + rm[:, None].to(tl.int64) * stride_xm
        OUT: tl.constexpr = X.dtype.element_ty
        if DOT:  # tensor cores: [BLOCK_M, 32] x [32, BLOCK_N] twice per group
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                for g in tl.static_range(BLOCK_K // 64):
                    even, odd = _nf4_group(P, S, C, rn, nm, k0 + 64 * g, k_hi, stride_p, stride_s, OUT)
                    xe, xo = _x_group(xrow, mm, k0 + 64 * g, k_hi)
                    if IEEE:
                        acc += tl.dot(xe, tl.trans(even), input_precision="ieee")
                        acc += tl.dot(xo, tl.trans(odd), input_precision="ieee")
                    else:
                        acc += tl.dot(xe, tl.trans(even))
                        acc += tl.dot(xo, tl.trans(odd))
        else:  # broadcast FMAs into per-column partial sums, reduced over K once at the end
            acc3 = tl.zeros([BLOCK_M, BLOCK_N, 32], tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                for g in tl.static_range(BLOCK_K // 64):
                    even, odd = _nf4_group(P, S, C, rn, nm, k0 + 64 * g, k_hi, stride_p, stride_s, OUT)
                    xe, xo = _x_group(xrow, mm, k0 + 64 * g, k_hi)
                    acc3 += xe.to(tl.float32)[:, None, :] * even.to(tl.float32)[None, :, :]
                    acc3 += xo.to(tl.float32)[:, None, :] * odd.to(tl.float32)[None, :, :]
            acc = tl.sum(acc3, axis=2)
        out = Y + (pid_k * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
        if PARTIAL:  # float32 partials of this K slice, summed by _sum_splits_kernel
            tl.store(out, acc, mask=mm[:, None] & nm[None, :])
        else:
            tl.store(out, acc.to(Y.dtype.element_ty), mask=mm[:, None] & nm[None, :])

    @triton.jit
    def _sum_splits_kernel(Part, Y, total, split, BLOCK: tl.constexpr, GDC: tl.constexpr = False):
        pdl_enter(GDC)
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = idx < total
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(split):
            acc += tl.load(Part + s * total + idx, mask=ok, other=0.0)
        tl.store(Y + idx, acc.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _dequantize_kernel(P, S, C, W, N, K, stride_p, stride_s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = rn < N
        for g in tl.static_range(BLOCK_K // 64):
            kg = tl.program_id(1) * BLOCK_K + 64 * g
            even, odd = _nf4_group(P, S, C, rn, nm, kg, K, stride_p, stride_s, W.dtype.element_ty)
            ptr = W + rn[:, None].to(tl.int64) * K + (kg + 2 * tl.arange(0, 32))[None, :]
            m = nm[:, None] & ((kg + 2 * tl.arange(0, 32)) < K)[None, :]
            tl.store(ptr, even, mask=m)
            tl.store(ptr + 1, odd, mask=m)


def dequantize(w: NF4Weight) -> torch.Tensor:
    """The weight [N, K] in its compute dtype (the same values as `dequantize_ref`)."""
    if not _use_triton(w.packed):
        return dequantize_ref(w)
    n, k = w.shape
    out = torch.empty((n, k), dtype=w.dtype, device=w.device)
    bn, bk = 16, 256
    _dequantize_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        w.packed, w.scales, w.code, out, n, k, w.packed.stride(0), w.scales.stride(0), BLOCK_N=bn, BLOCK_K=bk,
        num_warps=4)
    return out


def _check(x: torch.Tensor, w: NF4Weight) -> None:
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not match an NF4 weight of shape {w.shape}")
    if x.dtype != w.dtype:
        raise ValueError(f"x is {x.dtype}, the NF4 weight computes in {w.dtype}")


def nf4_matmul(x: torch.Tensor, w: NF4Weight, block_m: int, block_n: int, block_k: int, split: int,
               warps: int = 4, stages: int = 3, pdl: bool = False) -> torch.Tensor:
    """x [M, K] (last dim contiguous) @ W^T -> [M, N] in x's dtype, W decoded in registers:
    programs of `block_m` rows x `block_n` columns over K in `split` slices (1: no partials)."""
    _check(x, w)
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    if block_k % GROUP or block_m & (block_m - 1) or block_n & (block_n - 1):
        raise ValueError("block_k must be a multiple of 64, block_m and block_n powers of two")
    k_per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    args = kernel_args(pdl)
    _nf4_matmul_kernel[(triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))](
        x, w.packed, w.scales, w.code, out, m, n, k, x.stride(0), w.packed.stride(0), w.scales.stride(0), k_per,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=split > 1, DOT=block_m >= 16,
        IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages, **args)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](out, y, m * n, split, BLOCK=block, num_warps=4,
                                                         **args)
    return y


def launch_for(m: int, n: int, k: int, sms: int) -> dict:
    """A launch for `m` rows without a timed plan: broadcast FMAs up to 8 rows, `tl.dot` from 16
    (tiles of up to 64 rows), K split for about two programs per SM."""
    if m <= 8:
        mp = triton.next_power_of_2(max(m, 1))
        cand = (mp, 16 if mp == 8 else 32, 512 if mp == 1 else 256, 4)
    else:
        cand = (min(64, max(16, triton.next_power_of_2(m))), 32, 256, 4)
    return _with_split(cand, m, n, k, sms, 3)


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def linear(x: torch.Tensor, w: NF4Weight, plan: dict[int, dict | None] | None = None,
           pdl: bool = False) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N]: up to MAX_KERNEL_ROWS rows the fused kernel, with the plan's
    launch for the smallest planned row count >= M (without one, `launch_for`'s; a planned None:
    as for more rows); more rows dequantize W and run `F.linear`."""
    _check(x, w)
    m = x.shape[0]
    if not _use_triton(x):
        return F.linear(x, dequantize_ref(w))
    cfg = None
    if m <= MAX_KERNEL_ROWS:
        planned = [r for r in (plan or {}) if r >= m]
        if planned:
            cfg = plan[min(planned)]
        else:
            sms = 4  # Triton's interpreter on the CPU
            if x.is_cuda:
                sms = _sms(x.device.index if x.device.index is not None else torch.cuda.current_device())
            cfg = launch_for(m, w.shape[0], w.shape[1], sms)
    if cfg is None:
        return F.linear(x, dequantize(w))
    return nf4_matmul(x, w, **cfg, pdl=pdl)


# launches `plan_nf4` times per row count (block_m, block_n, block_k, warps; 3 pipeline stages, and
# 4 too at one row). Broadcast-FMA tiles (block_m < 16) keep block_m x block_n x 32 float32
# partial sums, at most 32 per thread. Each is tried with K split for about 2 and about 4
# programs per SM (`_with_split`).
NF4_CANDIDATES = {
    1: ((1, 32, 512, 4), (1, 64, 256, 4), (1, 64, 512, 8), (1, 128, 256, 8), (1, 16, 1024, 4)),
    2: ((2, 32, 256, 4), (2, 64, 256, 8), (16, 32, 256, 4)),
    4: ((4, 32, 256, 4), (4, 16, 512, 4), (16, 32, 256, 4)),
    8: ((8, 16, 256, 4), (8, 32, 128, 8), (16, 32, 256, 4), (16, 64, 128, 4)),
    16: ((16, 32, 256, 4), (16, 64, 128, 4), (16, 32, 512, 8), (16, 64, 256, 8)),
    32: ((32, 32, 256, 4), (32, 64, 128, 4), (32, 64, 256, 8)),
    64: ((64, 32, 256, 4), (64, 64, 128, 8), (64, 64, 256, 8), (32, 64, 256, 4)),
}


def _with_split(cand: tuple[int, int, int, int], m: int, n: int, k: int, sms: int, stages: int,
                per_sm: int = 2) -> dict:
    """`cand` as `nf4_matmul`'s launch, K split in two until there are `per_sm` programs per SM
    (or a slice would be under two K blocks)."""
    block_m, block_n, block_k, warps = cand
    programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = 1
    while programs * split < per_sm * sms and split * 2 * block_k <= k:
        split *= 2
    return dict(block_m=block_m, block_n=block_n, block_k=block_k, split=split, warps=warps, stages=stages)


@torch.no_grad()
def plan_nf4(weights: list[NF4Weight], pdl_for=None) -> dict[int, dict | None]:
    """Per planned row count (NF4_CANDIDATES), the fastest `nf4_matmul` launch on these
    same-shaped weights (a product with each in turn, as a forward runs its layers), timed from
    a CUDA graph, launched with PDL where `pdl_for(rows)` says the forward will. Above the
    largest planned row count, up to MAX_KERNEL_ROWS, `launch_for`'s launch where it beats
    dequantizing the weight for the library's product, else None (that product)."""
    if triton is None or not weights or weights[0].device.type != "cuda":
        return {}
    from engine.kernels.small_linear import graph_ms

    w0 = weights[0]
    n, k = w0.shape
    sms = torch.cuda.get_device_properties(w0.device).multi_processor_count
    plan: dict[int, dict] = {}
    for m, cands in NF4_CANDIDATES.items():
        x = torch.randn(m, k, device=w0.device).to(w0.dtype)
        pdl = pdl_for is not None and pdl_for(m)
        best = None
        tried = []
        for cand in cands:
            for stages, per_sm in [(st, p) for st in ((3, 4) if m == 1 else (3,)) for p in (2, 4)]:
                cfg = _with_split(cand, m, n, k, sms, stages, per_sm)
                if cfg in tried:
                    continue
                tried.append(cfg)
                try:
                    t = graph_ms(lambda cfg=cfg: [nf4_matmul(x, w, **cfg, pdl=pdl) for w in weights], reps=3)
                except Exception:  # a launch this GPU cannot compile (shared memory, registers)
                    continue
                if best is None or t < best:
                    best, plan[m] = t, cfg
    rows = max(NF4_CANDIDATES)
    while rows < MAX_KERNEL_ROWS:  # launch_for's tiles of 64 rows, or the weight dequantized for the library
        rows *= 2
        x = torch.randn(rows, k, device=w0.device).to(w0.dtype)
        cfg = launch_for(rows, n, k, sms)
        pdl = pdl_for is not None and pdl_for(rows)
        ours = graph_ms(lambda cfg=cfg: [nf4_matmul(x, w, **cfg, pdl=pdl) for w in weights], reps=3)
        lib = graph_ms(lambda: [F.linear(x, dequantize(w)) for w in weights], reps=3)
        plan[rows] = cfg if ours < lib else None
    return plan
