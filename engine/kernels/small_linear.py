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
the activation). `plan_gemv` times it against `F.linear` (followed by `gelu_mul` for gate/up) on
a model's own weights and keeps it only where it wins.
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
    def _store_rows(Y, stride_ym, rm, mm, rn, nm, acc, acc_up, GELU: tl.constexpr):
        """Y's rows `rm`, columns `rn` (those in `mm` and `nm`): the sums in Y's dtype, or with GELU
        the activation of the gate (acc) and up (acc_up) sums."""
        out = Y + rm[:, None] * stride_ym + rn[None, :]
        if GELU:
            store_activation(acc, acc_up, out, mm[:, None] & nm[None, :])
        else:
            tl.store(out, acc.to(Y.dtype.element_ty), mask=mm[:, None] & nm[None, :])

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


def gemv_fits(cfg: dict, rows: int, gelu: bool = False) -> bool:
    """Whether a launch's per-tile products ([rows, block_n, block_k] in float32, twice with
    `gelu`) come to at most 256 values a thread, as four weight rows of 1,024 columns on four
    warps do at eight rows of x; wider ones spill and are not timed."""
    mp = max(1, 1 << (rows - 1).bit_length())
    return mp * cfg["block_n"] * cfg["block_k"] * (2 if gelu else 1) <= 256 * 32 * cfg["warps"]


@torch.no_grad()
def plan_gemv(weights: list[torch.Tensor], rows: tuple[int, ...] = GEMV_ROWS, pdl_for=None,
              gelu: bool = False) -> dict[int, dict]:
    """For each row count, the `gemv` launch that beats `F.linear` on these same-shaped weights
    (a product with each, in order, as one forward runs its layers: the weights do not stay in L2
    between calls), timed from a CUDA graph, launched with PDL where `pdl_for(rows)` says the
    forward will launch it so. Row counts where the library is fastest are absent. `gelu`: the
    MLP's gate/up weights, timed as `fused_forward.project` runs them: `gemv(..., gelu=True)`
    against `F.linear` followed by `fused_ops.gelu_mul`."""
    if triton is None or not weights or weights[0].device.type != "cuda":
        return {}
    from engine.kernels.fused_ops import gelu_mul

    w0 = weights[0]
    plan = {}
    for m in rows:
        x = torch.randn(m, w0.shape[1], device=w0.device).to(w0.dtype)
        pdl = pdl_for is not None and pdl_for(m)
        best = graph_ms(lambda: [gelu_mul(F.linear(x, w), pdl=pdl) if gelu else F.linear(x, w) for w in weights],
                        reps=3)
        for cfg in (c for c in GEMV_CANDIDATES if gemv_fits(c, m, gelu)):
            t = graph_ms(lambda cfg=cfg: [gemv(x, w, **cfg, pdl=pdl, gelu=gelu) for w in weights], reps=3)
            if t < best:
                best, plan[m] = t, cfg
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
