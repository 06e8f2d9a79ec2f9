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
one kernel sums them in a fixed order; no atomics), streams its weight tile once for all M rows,
decodes it in registers (code gather, times the group's absmax, rounded to the compute dtype
exactly as bnb's dequantize rounds) and multiplies: broadcast FMAs for a few rows, `tl.dot` for
16 or more. The activations are read at even and odd columns, against the high and low nibbles,
so the packed bytes never need reordering. `plan_nf4` times a few launches per row count on a
model's own weights and keeps the fastest (`launch_for` falls back to a fixed rule where there
is no plan). `dequantize` writes the whole weight in the compute dtype (prefill chunks).

Without Triton, or off CUDA (tests), `dequantize_ref` and `F.linear` compute the same function.
"""

from __future__ import annotations

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
    def _nf4_tile(P, S, C, rn, nm, k0, k_hi, stride_p, stride_s, OUT: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
        """The weight tile of rows rn, columns [k0, k0 + BLOCK_K), decoded: (even columns, odd
        columns), each [BLOCK_N, BLOCK_K / 2] in OUT (zero past k_hi and past the last row)."""
        G: tl.constexpr = BLOCK_K // 64
        rg = tl.arange(0, G)
        rb = tl.arange(0, 32)
        gm = (k0 + rg * 64) < k_hi
        m3 = nm[:, None, None] & gm[None, :, None]
        row = rn[:, None, None].to(tl.int64)
        p = tl.load(P + row * stride_p + (k0 // 2 + rg[None, :, None] * 32 + rb[None, None, :]), mask=m3, other=0)
        s = tl.load(S + row * stride_s + (k0 // 64 + rg[None, :, None]), mask=m3, other=0.0)
        hi = (tl.load(C + (p >> 4).to(tl.int32)) * s).to(OUT)
        lo = (tl.load(C + (p & 15).to(tl.int32)) * s).to(OUT)
        return tl.reshape(hi, [BLOCK_N, BLOCK_K // 2]), tl.reshape(lo, [BLOCK_N, BLOCK_K // 2])

    @triton.jit
    def _nf4_matmul_kernel(X, P, S, C, Y, M, N, K, stride_xm, stride_p, stride_s, k_per,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           SPLIT: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr, GDC: tl.constexpr = False):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rh = tl.arange(0, BLOCK_K // 2)
        nm = rn < N
        mm = rm < M
        k_lo = pid_k * k_per
        k_hi = tl.minimum(k_lo + k_per, K)
        pdl_enter(GDC)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        xrow = X + rm[:, None].to(tl.int64) * stride_xm
        for k0 in range(k_lo, k_hi, BLOCK_K):
            even, odd = _nf4_tile(P, S, C, rn, nm, k0, k_hi, stride_p, stride_s, X.dtype.element_ty, BLOCK_N,
                                  BLOCK_K)
            col = k0 + 2 * rh
            xm = mm[:, None] & (col < k_hi)[None, :]
            xe = tl.load(xrow + col[None, :], mask=xm, other=0.0)
            xo = tl.load(xrow + col[None, :] + 1, mask=xm, other=0.0)
            if DOT:
                if IEEE:
                    acc += tl.dot(xe, tl.trans(even), input_precision="ieee")
                    acc += tl.dot(xo, tl.trans(odd), input_precision="ieee")
                else:
                    acc += tl.dot(xe, tl.trans(even))
                    acc += tl.dot(xo, tl.trans(odd))
            else:
                acc += tl.sum(xe.to(tl.float32)[:, None, :] * even.to(tl.float32)[None, :, :], axis=2)
                acc += tl.sum(xo.to(tl.float32)[:, None, :] * odd.to(tl.float32)[None, :, :], axis=2)
        out = Y + (pid_k * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
        if SPLIT == 1:
            tl.store(out, acc.to(Y.dtype.element_ty), mask=mm[:, None] & nm[None, :])
        else:
            tl.store(out, acc, mask=mm[:, None] & nm[None, :])

    @triton.jit
    def _sum_splits_kernel(Part, Y, total, SPLIT: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr = False):
        pdl_enter(GDC)
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = idx < total
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(SPLIT):
            acc += tl.load(Part + s * total + idx, mask=ok, other=0.0)
        tl.store(Y + idx, acc.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _dequantize_kernel(P, S, C, W, N, K, stride_p, stride_s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        nm = rn < N
        even, odd = _nf4_tile(P, S, C, rn, nm, k0, K, stride_p, stride_s, W.dtype.element_ty, BLOCK_N, BLOCK_K)
        col = k0 + 2 * tl.arange(0, BLOCK_K // 2)
        ptr = W + rn[:, None].to(tl.int64) * K + col[None, :]
        m = nm[:, None] & (col < K)[None, :]
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
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, DOT=block_m >= 16,
        IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages, **args)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](out, y, m * n, SPLIT=split, BLOCK=block, num_warps=4,
                                                         **args)
    return y


def launch_for(m: int, n: int, k: int, sms: int) -> dict:
    """A launch for `m` rows without a timed plan: broadcast FMAs up to 8 rows (tiles kept to
    about 64 float32 products per thread), `tl.dot` from 16 (tiles of up to 64 rows), and as
    many K slices as it takes for about two programs per SM."""
    if m <= 8:
        mp = triton.next_power_of_2(max(m, 1))
        block_n, block_k = (32, 512) if mp == 1 else (16, 512 // mp) if mp <= 4 else (16, 128)
        block_m = mp
    else:
        block_m, block_n, block_k = min(64, max(16, triton.next_power_of_2(m))), 32, 256
    programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = 1
    while programs * split < 2 * sms and split * 2 * block_k <= k:
        split *= 2
    return dict(block_m=block_m, block_n=block_n, block_k=block_k, split=split, warps=4, stages=3)


def linear(x: torch.Tensor, w: NF4Weight, plan: dict[int, dict | None] | None = None, pdl: bool = False,
           sms: int = 132) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N]: the fused kernel up to MAX_KERNEL_ROWS rows, with the plan's
    launch for the smallest planned row count >= M (a plan's None: dequantize and the library
    product there), else `launch_for`'s; more rows dequantize W and run `F.linear`."""
    _check(x, w)
    m = x.shape[0]
    if not _use_triton(x):
        return F.linear(x, dequantize_ref(w))
    cfg: dict | None = None
    if m <= MAX_KERNEL_ROWS:
        planned = [r for r in (plan or {}) if r >= m]
        cfg = plan[min(planned)] if planned else launch_for(m, w.shape[0], w.shape[1], sms)
    if cfg is None:
        return F.linear(x, dequantize(w))
    return nf4_matmul(x, w, **cfg, pdl=pdl)


# launches `plan_nf4` times per row count (block_m, block_n, block_k, warps; 3 pipeline stages, and
# 4 too at one row); the K split of each is `launch_for`'s rule (about two programs per SM)
NF4_CANDIDATES = {
    1: ((1, 32, 512, 4), (1, 16, 512, 4), (1, 64, 256, 4), (1, 32, 256, 2)),
    2: ((2, 16, 512, 4), (2, 32, 256, 4), (16, 32, 256, 4)),
    4: ((4, 16, 256, 4), (4, 32, 128, 4), (16, 32, 256, 4)),
    8: ((8, 16, 128, 4), (16, 32, 256, 4), (16, 64, 128, 4)),
    16: ((16, 32, 256, 4), (16, 64, 128, 4), (16, 32, 512, 8)),
    32: ((32, 32, 256, 4), (32, 64, 128, 4), (16, 64, 256, 4)),
    64: ((64, 32, 256, 4), (64, 64, 128, 8), (32, 64, 256, 4)),
}


def _with_split(cand: tuple[int, int, int, int], m: int, n: int, k: int, sms: int, stages: int) -> dict:
    block_m, block_n, block_k, warps = cand
    programs = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = 1
    while programs * split < 2 * sms and split * 2 * block_k <= k:
        split *= 2
    return dict(block_m=block_m, block_n=block_n, block_k=block_k, split=split, warps=warps, stages=stages)


@torch.no_grad()
def plan_nf4(weights: list[NF4Weight], pdl_for=None) -> dict[int, dict]:
    """Per planned row count (NF4_CANDIDATES), the fastest `nf4_matmul` launch on these
    same-shaped weights (a product with each in turn, as a forward runs its layers), timed from
    a CUDA graph, launched with PDL where `pdl_for(rows)` says the forward will. Row counts above
    the largest planned one up to MAX_KERNEL_ROWS get `launch_for`'s launch."""
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
        for cand in cands:
            for stages in ((3, 4) if m == 1 else (3,)):
                cfg = _with_split(cand, m, n, k, sms, stages)
                try:
                    t = graph_ms(lambda cfg=cfg: [nf4_matmul(x, w, **cfg, pdl=pdl) for w in weights], reps=3)
                except Exception:  # a launch this GPU cannot compile (shared memory, registers)
                    continue
                if best is None or t < best:
                    best, plan[m] = t, cfg
    rows = max(NF4_CANDIDATES)
    while rows < MAX_KERNEL_ROWS:
        rows *= 2
        plan[rows] = launch_for(rows, n, k, sms)
    return plan
