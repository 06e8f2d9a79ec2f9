"""Linear layers for few rows on CUDA (decode batches of up to 16 tokens).

At one to a few rows a linear layer is a matrix-vector product bound by reading the weight. The
library kernels pick tiles made for larger batches and read the narrow projections of a decoder
layer (K/V, Q, O: a few MB each) at a fraction of the memory bandwidth. `SmallBatchLinear`
substitutes for `nn.Linear` (as quantized linears do): up to `MAX_ROWS` rows it runs a split-K
Triton kernel that streams the weight once with enough programs to cover the GPU, writes one
partial per split and sums them in a second kernel (deterministic, no atomics); more rows, or a
very wide output (the vocabulary head), go to `F.linear` unchanged.

`gemv` is the one-kernel variant for the engine's fused forward: no split, each program streams a
few weight rows once for all the batch's rows (for the MLP's gate/up, with `gelu`, it also stores
the activation). `mma_rows` is its form for decode batches of 9-64 rows: each program multiplies
a tile of weight rows by all the batch's rows on tensor cores (as W x^T, the weight the wide
operand), with K split over several programs where there are too few column blocks to cover the
GPU; the last program of a column block to finish sums the float32 partials in split order, so the
result does not depend on timing and no second kernel runs. `plan_gemv` times both against
`F.linear` (followed by `gelu_mul` for gate/up) on a model's own weights and keeps one only where
it wins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.launch import kernel_args

try:
    import triton
    import triton.language as tl

    from engine.kernels.launch import pdl_enter
    from engine.kernels.moe import store_activation
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None

MAX_ROWS = 16
MAX_OUT = 16384  # wider outputs already run near the bandwidth in the library kernels
BLOCK_N, BLOCK_K = 32, 128


if triton is not None:

    @triton.jit
    def _partial_kernel(X, W, P, M, N, K, stride_xm, stride_wn, k_per,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k_lo = pid_k * k_per
        k_hi = tl.minimum(k_lo + k_per, K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            km = rk < k_hi
            x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & km[None, :], other=0.0)
            w = tl.load(W + rn[:, None] * stride_wn + rk[None, :], mask=(rn[:, None] < N) & km[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        ptr = P + (pid_k * BLOCK_M + rm[:, None]) * N + rn[None, :]
        tl.store(ptr, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _reduce_kernel(P, Y, M, N, stride_ym, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        idx = pid * BLOCK + tl.arange(0, BLOCK)  # over M * N
        m = idx // N
        n = idx % N
        ok = idx < M * N
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(SPLIT):
            acc += tl.load(P + (s * BLOCK_M + m) * N + n, mask=ok, other=0.0)
        tl.store(Y + m * stride_ym + n, acc.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _gemv_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                     MP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GELU: tl.constexpr = False,
                     GDC: tl.constexpr = False):
        """Y[:, n] = X @ W[n]; with GELU, W is [gate; up] (2N rows) and Y[:, n] = gelu_tanh(X @
        W[n]) * (X @ W[N + n]): the program streams both rows and stores the activation."""
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, MP)
        nm = rn < N
        mm = rm < M
        acc = tl.zeros([MP, BLOCK_N], tl.float32)
        acc_up = tl.zeros([MP, BLOCK_N], tl.float32)  # GELU only
        W_up = W + N * stride_wn
        k_first = 0
        if GDC:  # no kernel writes the weight: its first tile is read while the one before finishes
            w, w_up = _weight_tile(W, W_up, K, stride_wn, rn, nm, 0, BLOCK_K, GELU)
            pdl_enter(GDC)
            acc, acc_up = _tile_product(X, K, stride_xm, rm, mm, 0, w, w_up, acc, acc_up, BLOCK_K, GELU)
            k_first = BLOCK_K
        for k0 in range(k_first, K, BLOCK_K):
            w, w_up = _weight_tile(W, W_up, K, stride_wn, rn, nm, k0, BLOCK_K, GELU)
            acc, acc_up = _tile_product(X, K, stride_xm, rm, mm, k0, w, w_up, acc, acc_up, BLOCK_K, GELU)
        _store_rows(Y, stride_ym, rm, mm, rn, nm, acc, acc_up, GELU)

    @triton.jit
    def _mma_rows_kernel(X, W, Y, P, Counts, M, N, K, stride_xm, stride_wn, stride_ym, k_per, split,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT: tl.constexpr, IEEE: tl.constexpr, GELU: tl.constexpr = False,
                         GDC: tl.constexpr = False):
        """Y = X @ W^T on tensor cores as W X^T: the program's `BLOCK_N` weight rows are the
        product's left operand and X's rows (up to BLOCK_M) its columns. Each program takes
        `k_per` of K (`pid_k`'s slice); with SPLIT, the `split` programs of a column block each
        store a float32 partial, and the last of them to count itself done (`Counts`, one
        counter per column block, left at zero again) sums the partials in split order and
        stores Y, so the sum does not depend on which program finishes last. With GELU, W is
        [gate; up] (2N rows) and Y the activation."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        nm = rn < N
        mm = rm < M
        W_up = W + N * stride_wn
        k_lo = pid_k * k_per
        k_hi = tl.minimum(k_lo + k_per, K)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # GELU only
        k0 = k_lo
        if GDC:  # no kernel writes the weight: its first tile is read while the one before finishes
            w, w_up = _weight_tile(W, W_up, K, stride_wn, rn, nm, k0, BLOCK_K, GELU)
            pdl_enter(GDC)
            acc, acc_up = _mma_tile(X, stride_xm, rm, mm, k0, w, w_up, acc, acc_up, BLOCK_K, IEEE, GELU)
            k0 += BLOCK_K
        for kk in range(k0, k_hi, BLOCK_K):
            w, w_up = _weight_tile(W, W_up, K, stride_wn, rn, nm, kk, BLOCK_K, GELU)
            acc, acc_up = _mma_tile(X, stride_xm, rm, mm, kk, w, w_up, acc, acc_up, BLOCK_K, IEEE, GELU)
        out = Y + rm[None, :] * stride_ym + rn[:, None]
        mask = nm[:, None] & mm[None, :]
        if SPLIT:
            part = P + (pid_k * N + rn[:, None]) * BLOCK_M + rm[None, :]  # [split, N, BLOCK_M]
            tl.store(part, acc, mask=mask)
            if GELU:
                tl.store(part + split * N * BLOCK_M, acc_up, mask=mask)
            tl.debug_barrier()  # every thread's partial stored before the count
            done = tl.atomic_add(Counts + pid_n, 1, sem="acq_rel", scope="gpu")
            if done == split - 1:  # the last: sum in split order
                acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                for s in range(split):
                    sp = P + (s * N + rn[:, None]) * BLOCK_M + rm[None, :]
                    acc += tl.load(sp, mask=mask, other=0.0, cache_modifier=".cg")
                    if GELU:
                        acc_up += tl.load(sp + split * N * BLOCK_M, mask=mask, other=0.0, cache_modifier=".cg")
                _store_sums(out, mask, acc, acc_up, GELU)
                tl.atomic_xchg(Counts + pid_n, 0, sem="relaxed", scope="gpu")
        else:
            _store_sums(out, mask, acc, acc_up, GELU)

    @triton.jit
    def _mma_tile(X, stride_xm, rm, mm, k0, w, w_up, acc, acc_up, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                  GELU: tl.constexpr):
        """acc (and with GELU acc_up) plus the weight tile times x's rows `rm` (those in `mm`),
        columns k0 to k0 + BLOCK_K - 1, transposed: [BLOCK_N, BLOCK_M] on tensor cores (IEEE:
        float32 operands multiplied in float32, not TF32)."""
        rk = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(X + rm[None, :] * stride_xm + rk[:, None], mask=mm[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(w, xt, acc, input_precision="ieee")
            if GELU:
                acc_up = tl.dot(w_up, xt, acc_up, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
            if GELU:
                acc_up = tl.dot(w_up, xt, acc_up)
        return acc, acc_up

    @triton.jit
    def _store_sums(out, mask, acc, acc_up, GELU: tl.constexpr):
        """The sums acc at `out` (where `mask`) in its dtype, or with GELU the activation of the
        gate (acc) and up (acc_up) sums."""
        if GELU:
            store_activation(acc, acc_up, out, mask)
        else:
            tl.store(out, acc.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _store_rows(Y, stride_ym, rm, mm, rn, nm, acc, acc_up, GELU: tl.constexpr):
        """Y's rows `rm`, columns `rn` (those in `mm` and `nm`): `_store_sums` of acc [rows, columns]."""
        _store_sums(Y + rm[:, None] * stride_ym + rn[None, :], mm[:, None] & nm[None, :], acc, acc_up, GELU)

    @triton.jit
    def _weight_tile(W, W_up, K, stride_wn, rn, nm, k0, BLOCK_K: tl.constexpr, GELU: tl.constexpr):
        """Weight rows `rn` (those in `nm`), columns k0 to k0 + BLOCK_K - 1; with GELU also the same
        rows of W_up."""
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < K
        w = tl.load(W + rn[:, None] * stride_wn + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        w_up = w
        if GELU:
            w_up = tl.load(W_up + rn[:, None] * stride_wn + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        return w, w_up

    @triton.jit
    def _tile_product(X, K, stride_xm, rm, mm, k0, w, w_up, acc, acc_up, BLOCK_K: tl.constexpr,
                      GELU: tl.constexpr):
        """acc (and with GELU acc_up) plus x's rows `rm` (those in `mm`), columns k0 to
        k0 + BLOCK_K - 1, times the weight tile (and its up rows)."""
        rk = k0 + tl.arange(0, BLOCK_K)
        km = rk < K
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        acc += _rows_dot(x, w)
        if GELU:
            acc_up += _rows_dot(x, w_up)
        return acc, acc_up

    @triton.jit
    def _rows_dot(x, w):
        """x [MP, BLOCK_K] . w [BLOCK_N, BLOCK_K] -> [MP, BLOCK_N] in float32."""
        return tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


def _splits(n: int, k: int, sms: int) -> int:
    blocks = triton.cdiv(n, BLOCK_N)
    split = 1
    while blocks * split < 2 * sms and split * 2 * BLOCK_K <= k:
        split *= 2
    return split


def small_linear(x: torch.Tensor, weight: torch.Tensor, sms: int) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, last dim contiguous) @ weight[N, K].T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    split = _splits(n, k, sms)
    k_per = triton.cdiv(triton.cdiv(k, split), BLOCK_K) * BLOCK_K
    part = torch.empty((split, MAX_ROWS, n), dtype=torch.float32, device=x.device)
    _partial_kernel[(triton.cdiv(n, BLOCK_N), split)](
        x, weight, part, m, n, k, x.stride(0), weight.stride(0), k_per,
        BLOCK_M=MAX_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32, num_warps=4, num_stages=3)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block = 1024
    _reduce_kernel[(triton.cdiv(m * n, block),)](part, y, m, n, y.stride(0), SPLIT=split, BLOCK_M=MAX_ROWS,
                                                 BLOCK=block, num_warps=4)
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, block_n: int = 8, block_k: int = 512, warps: int = 4,
         stages: int = 3, pdl: bool = False, gelu: bool = False) -> torch.Tensor:
    """x [M, K] (a few rows, last dim contiguous) @ weight[N, K].T -> [M, N] in x's dtype, one
    kernel: each program streams `block_n` weight rows once for all M rows (no split, no reduce
    pass), so a matrix-vector product of a few MB is one launch that reads its weight once.
    `pdl` (kernels/launch.py): launched early, each program reads its first weight tile while
    the kernel before it finishes, and only then waits for x. `gelu`: weight is Gemma's MLP
    [gate; up] and the result `fused_ops.gelu_mul` of the product, [M, N / 2], to the same bits:
    each program streams `block_n` gate rows and their up rows and stores the activation, so no
    second kernel runs."""
    m, k = x.shape
    assert not gelu or weight.shape[0] % 2 == 0, "gelu takes a [gate; up] weight"
    n = weight.shape[0] // 2 if gelu else weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        MP=max(1, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, GELU=gelu, num_warps=warps,
        num_stages=stages, **kernel_args(pdl))
    return y


MMA_MIN_ROWS, MMA_MAX_ROWS = 9, 64  # the rows `mma_rows` takes


def mma_rows_fits(m: int, n: int, k: int, block_n: int, block_k: int, split: int) -> bool:
    """Whether `mma_rows` takes x [m, k] against a weight of n rows (gelu: n gate rows) with
    this tile and K split: whole K tiles per split, every split non-empty."""
    if not MMA_MIN_ROWS <= m <= MMA_MAX_ROWS or k % block_k:
        return False
    tiles = k // block_k
    return tiles % split == 0 and block_n <= max(16, triton.next_power_of_2(n))


def mma_rows(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int, warps: int, stages: int,
             split: int = 1, counts: torch.Tensor | None = None, pdl: bool = False,
             gelu: bool = False) -> torch.Tensor:
    """x [M, K] (9-64 rows, last dim contiguous) @ weight[N, K].T -> [M, N] in x's dtype, one
    kernel on tensor cores (`mma_rows_fits`). `split` > 1 splits K over that many programs per
    column block, which sum their float32 partials in a fixed order; `counts` is then an int32
    tensor of zeros with one entry per column block (left zero by the kernel; the caller owns it
    and runs one product at a time on it). `pdl` and `gelu` as for `gemv`."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gelu else weight.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cols = triton.cdiv(n, block_n)
    part = y
    if split > 1:
        assert counts is not None and counts.numel() >= cols and counts.dtype == torch.int32
        part = torch.empty(((2 if gelu else 1) * split, n, block_m), dtype=torch.float32, device=x.device)
    _mma_rows_kernel[(cols, split)](
        x, weight, y, part, counts if split > 1 else y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        k // split, split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split > 1,
        IEEE=x.dtype == torch.float32, GELU=gelu,
        num_warps=warps, num_stages=stages, **kernel_args(pdl))
    return y


class SmallBatchLinear(nn.Module):
    """`nn.Linear` (no bias) that runs `small_linear` up to `max_rows` rows (measured per shape)."""

    def __init__(self, linear: nn.Linear, max_rows: int, sms: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.max_rows = max_rows
        self.sms = sms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if rows == 0 or rows > self.max_rows or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight)
        flat = x.reshape(rows, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        return small_linear(flat, self.weight, self.sms).reshape(*x.shape[:-1], self.out_features)


def substitute_linears(model: nn.Module) -> dict[tuple[int, int], int]:
    """Replace bias-free CUDA `nn.Linear` layers of up to MAX_OUT outputs where the kernel beats
    `F.linear`: per weight shape, both are timed at 1, 2, 4, 8 and 16 rows, and the kernel serves
    up to the largest row count where it was faster at every count below. Returns
    {(out, in): max_rows} for the shapes substituted."""
    if triton is None:
        return {}
    limits: dict[tuple, int] = {}
    done: dict[tuple[int, int], int] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not (type(child) is nn.Linear and child.bias is None and child.weight.device.type == "cuda"
                    and child.out_features <= MAX_OUT and child.weight.is_contiguous()):
                continue
            key = (child.out_features, child.in_features, child.weight.dtype)
            if key not in limits:
                limits[key] = _rows_where_faster(child.weight)
            if limits[key]:
                sms = torch.cuda.get_device_properties(child.weight.device).multi_processor_count
                setattr(parent, name, SmallBatchLinear(child, limits[key], sms))
                done[key[:2]] = limits[key]
    return done


@torch.no_grad()
def _rows_where_faster(weight: torch.Tensor) -> int:
    sms = torch.cuda.get_device_properties(weight.device).multi_processor_count
    best = 0
    for rows in (1, 2, 4, 8, 16):
        x = torch.randn(rows, weight.shape[1], device=weight.device).to(weight.dtype)
        ours = graph_ms(lambda: small_linear(x, weight, sms))
        lib = graph_ms(lambda: F.linear(x, weight))
        if ours >= lib:
            break
        best = rows
    return best


# gemv launches tried per row count by `plan_gemv` (from `python -m bench.tune_kernels`, plain
# products: on an H100, among the gemv launches, programs of one or two weight rows were fastest
# for every Gemma-3 1B and 4B projection at one row and all but gate/up at two; those of four
# rows had won on an H200 before the narrower ones were tried; a K tile of 4,096, a whole row of
# 4B's gate/up or half of 1B's down in one load, was fastest for those two at one row, 3% and 9%
# ahead of the others). The gate/up plans with the activation try the same launches.
GEMV_CANDIDATES = (
    dict(block_n=4, block_k=1024, warps=4, stages=4),
    dict(block_n=4, block_k=1024, warps=4, stages=3),
    dict(block_n=2, block_k=1024, warps=2, stages=3),
    dict(block_n=2, block_k=1024, warps=4, stages=3),
    dict(block_n=2, block_k=2048, warps=2, stages=3),
    dict(block_n=2, block_k=2048, warps=4, stages=3),
    dict(block_n=1, block_k=2048, warps=4, stages=4),
    dict(block_n=2, block_k=4096, warps=4, stages=3),
)
GEMV_ROWS = (1, 2, 4, 8)
# `mma_rows` launches tried per row count by `plan_gemv` at MMA_ROWS, each with K split in
# MMA_SPLITS where it fits (`mma_rows_fits`)
MMA_CANDIDATES = (
    dict(block_n=32, block_k=128, warps=4, stages=4),
    dict(block_n=64, block_k=64, warps=4, stages=4),
    dict(block_n=64, block_k=128, warps=4, stages=4),
)
MMA_SPLITS = (1, 2, 4, 8)
MMA_ROWS = (16, 32, 64)
MMA_COUNTS = 4096  # column blocks a split `mma_rows` may count in (`FusedDecoder.counts`)


def plan_key(rows: int) -> int:
    """The planned row count whose launch a product of `rows` rows takes: its own up to the
    largest GEMV_ROWS, then the next of MMA_ROWS (a 12-row decode batch takes 16 rows' launch)."""
    if rows <= GEMV_ROWS[-1] or rows > MMA_ROWS[-1]:
        return rows
    return next(r for r in MMA_ROWS if r >= rows)


def gemv_fits(cfg: dict, rows: int, gelu: bool = False) -> bool:
    """Whether a launch's per-tile products ([rows, block_n, block_k] in float32, twice with
    `gelu`) come to at most 256 values a thread, as four weight rows of 1,024 columns on four
    warps do at eight rows of x; wider ones spill and are not timed."""
    mp = max(1, 1 << (rows - 1).bit_length())
    return mp * cfg["block_n"] * cfg["block_k"] * (2 if gelu else 1) <= 256 * 32 * cfg["warps"]


@torch.no_grad()
def plan_gemv(weights: list[torch.Tensor], rows: tuple[int, ...] = GEMV_ROWS + MMA_ROWS, pdl_for=None,
              gelu: bool = False) -> dict[int, dict]:
    """For each row count, the launch that beats `F.linear` on these same-shaped weights (a
    product with each, in order, as one forward runs its layers: the weights do not stay in L2
    between calls), timed from a CUDA graph, launched with PDL where `pdl_for(rows)` says the
    forward will launch it so: a `gemv` launch up to the largest GEMV_ROWS, `{"mma": launch}` of
    `mma_rows` at MMA_ROWS (kept only where it agrees with the library's product). Row counts
    where the library is fastest are absent. `gelu`: the MLP's gate/up weights, timed as
    `fused_forward.project` runs them: with the activation against `F.linear` followed by
    `fused_ops.gelu_mul`."""
    if triton is None or not weights or weights[0].device.type != "cuda":
        return {}
    from engine.kernels.fused_ops import gelu_mul

    w0 = weights[0]
    n, k = w0.shape[0] // 2 if gelu else w0.shape[0], w0.shape[1]
    counts = torch.zeros(MMA_COUNTS, dtype=torch.int32, device=w0.device)
    plan = {}
    for m in rows:
        x = torch.randn(m, k, device=w0.device).to(w0.dtype)
        pdl = pdl_for is not None and pdl_for(m)

        def library(w):
            return gelu_mul(F.linear(x, w), pdl=pdl) if gelu else F.linear(x, w)

        best = graph_ms(lambda: [library(w) for w in weights], reps=3)
        if m <= GEMV_ROWS[-1]:
            for cfg in (c for c in GEMV_CANDIDATES if gemv_fits(c, m, gelu)):
                t = graph_ms(lambda cfg=cfg: [gemv(x, w, **cfg, pdl=pdl, gelu=gelu) for w in weights], reps=3)
                if t < best:
                    best, plan[m] = t, cfg
            continue
        want = library(w0).float()
        for cfg in MMA_CANDIDATES:
            for split in MMA_SPLITS:
                if not mma_rows_fits(m, n, k, cfg["block_n"], cfg["block_k"], split):
                    continue
                launch = dict(cfg, split=split)
                try:
                    got = mma_rows(x, w0, **launch, counts=counts, pdl=pdl, gelu=gelu).float()
                except Exception:  # a launch this GPU cannot compile (shared memory: float32 tiles)
                    continue
                if not (got - want).norm() <= 2e-2 * want.norm():
                    continue
                t = graph_ms(lambda launch=launch: [mma_rows(x, w, **launch, counts=counts, pdl=pdl, gelu=gelu)
                                                    for w in weights], reps=3)
                if t < best:
                    best, plan[m] = t, {"mma": launch}
    return plan


def graph_ms(fn, reps: int = 20) -> float:
    """Device time (ms) of `reps` calls of `fn` replayed from a CUDA graph (the way decode steps
    run them: timing eager calls would measure Python launch cost instead)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
