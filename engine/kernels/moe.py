"""A mixture-of-experts block at decode batch sizes (Triton on CUDA, torch ops elsewhere).

Gemma 4's MoE block routes each token to `top_k` of `E` experts (each a GELU-gated MLP) and sums
their outputs weighted by the router. The stock module runs it as a loop over the experts hit (a
host sync per expert) or, with transformers' `grouped_mm` implementation, as about a dozen
kernels that sort the (token, expert) pairs, gather, multiply by groups and scatter back. At a
few tokens per step the work is reading the chosen experts' weights once; three kernels do it:

  router_topk    softmax of the router logits (float32), the top-k experts, their weights
                 renormalised over the k and multiplied by the per-expert scale
  expert_gate_up per (token, chosen expert) pair: that expert's gate and up rows against the
                 token, then gelu_tanh(gate) * up, each program a few rows of one pair
  expert_down    per token: each chosen expert's down rows against its pair's activation,
                 weighted and summed over the k experts in float32 (no scatter, no atomics);
                 or split (DOWN["split"]): per pair into float32 partials, then a sum per token
                 in the same order (the same result, more and smaller programs); with `pairs`
                 the partials themselves, for the kernel after the block to add (Gemma 4's
                 fused_ops.layer_out), one launch fewer

`experts_ref` is the same math in torch ops: the CPU path for a handful of tokens and the
kernels' test oracle. The kernels round where the stock module rounds (each product's output and
the activation to the weights' dtype) except the weighted sum, which they keep in float32 before
one rounding where the stock module adds bfloat16 partial sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.launch import kernel_args

try:
    import triton
    import triton.language as tl

    from engine.kernels.launch import pdl_enter
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None

# decode batches up to this many tokens run the kernels; more (prefill chunks) run the model's
# own experts module, whose grouped products then have whole tiles of tokens per expert
MAX_TOKENS = 64


def router_topk_ref(logits: torch.Tensor, top_k: int, per_expert_scale: torch.Tensor):
    """logits [T, E] -> (weights [T, k] float32, experts [T, k] int64), as Gemma 4's router."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    w, idx = torch.topk(probs, k=top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    return w * per_expert_scale[idx], idx


def experts_ref(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """x [T, H]; experts, weights [T, k]; gate_up [E, 2I, H]; down [E, H, I] -> [T, H] in x's dtype."""
    T, k = experts.shape
    pairs = experts.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)  # [T k, H]
    gu = torch.einsum("ph,pnh->pn", xs.float(), gate_up[pairs].float()).to(x.dtype)
    g, u = gu.chunk(2, dim=-1)
    a = F.gelu(g, approximate="tanh") * u  # [T k, I]
    y = torch.einsum("pi,phi->ph", a.float(), down[pairs].float()).to(x.dtype)  # [T k, H]
    return (y.float().view(T, k, -1) * weights.float()[..., None]).sum(1).to(x.dtype)


def sum_pairs_ref(part: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """The pairs' float32 partials [T k, H] (`experts(..., pairs=True)`) -> [T, H] in `dtype`: each
    token's k partials added in order, as `_sum_pairs` adds them."""
    part = part.view(-1, top_k, part.shape[-1])
    out = part[:, 0].clone()
    for j in range(1, top_k):
        out += part[:, j]
    return out.to(dtype)


if triton is not None:

    @triton.jit
    def _router_topk(Logits, Scale, Wout, Iout, E, K: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr = False):
        pdl_enter(GDC)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < E
        z = tl.load(Logits + t * E + cols, mask=m, other=float("-inf")).to(tl.float32)
        p = tl.exp(z - tl.max(z, 0))
        p = p / tl.sum(p, 0)
        p = tl.where(m, p, -1.0)
        kk = tl.arange(0, K)
        vals = tl.zeros([K], tl.float32)
        idxs = tl.zeros([K], tl.int32)
        for j in tl.static_range(K):
            best = tl.max(p, 0)
            at = tl.min(tl.where(p == best, cols, BLOCK), 0)  # the lowest index among ties
            vals = tl.where(kk == j, best, vals)
            idxs = tl.where(kk == j, at, idxs)
            p = tl.where(cols == at, -1.0, p)
        vals = vals / tl.sum(vals, 0)
        scale = tl.load(Scale + idxs).to(tl.float32)
        tl.store(Wout + t * K + kk, vals * scale)
        tl.store(Iout + t * K + kk, idxs)

    @triton.jit
    def _expert_gate_up(X, Experts, GU, Act, H, inter, stride_ge, K: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GDC: tl.constexpr = False):
        pdl_enter(GDC)
        p = tl.program_id(0).to(tl.int64)  # one (token, expert) pair
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = rn < inter
        e = tl.load(Experts + p).to(tl.int64)
        x_row = X + (p // K) * H
        wg = GU + e * stride_ge + rn[:, None] * H
        wu = wg + inter * H
        acc_g = tl.zeros([BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            km = rk < H
            x = tl.load(x_row + rk, mask=km, other=0.0).to(tl.float32)
            g = tl.load(wg + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
            u = tl.load(wu + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
            acc_g += tl.sum(g * x[None, :], axis=1)
            acc_u += tl.sum(u * x[None, :], axis=1)
        store_activation(acc_g, acc_u, Act + p * inter + rn, nm)

    @triton.jit
    def store_activation(acc_g, acc_u, out, mask):
        """gelu_tanh(gate) * up from float32 sums, each product's output and the activation
        rounded to the output's dtype, where the stock module rounds them. Every Triton kernel
        that stores Gemma's MLP activation stores it here (the experts', `fused_ops.gelu_mul`'s,
        `small_linear.gemv`'s with `gelu`)."""
        dt = out.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = (0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * z)) - 1.0))).to(dt).to(tl.float32)
        tl.store(out, (a * u).to(dt), mask=mask)

    @triton.jit
    def _expert_down(Act, Experts, Weights, D, Y, H, inter, stride_de, K: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GDC: tl.constexpr = False):
        pdl_enter(GDC)
        t = tl.program_id(0).to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = rn < H
        dt = Y.dtype.element_ty
        out = tl.zeros([BLOCK_N], tl.float32)
        for j in tl.static_range(K):
            p = t * K + j
            e = tl.load(Experts + p).to(tl.int64)
            w_row = D + e * stride_de + rn[:, None] * inter
            acc = tl.zeros([BLOCK_N], tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                km = rk < inter
                a = tl.load(Act + p * inter + rk, mask=km, other=0.0).to(tl.float32)
                w = tl.load(w_row + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(w * a[None, :], axis=1)
            out += acc.to(dt).to(tl.float32) * tl.load(Weights + p)
        tl.store(Y + t * H + rn, out.to(dt), mask=nm)

    @triton.jit
    def _expert_down_pairs(Act, Experts, Weights, D, Part, H, inter, stride_de, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GDC: tl.constexpr = False):
        """`_expert_down` split by pair: each program one pair's rows, weighted, into a float32
        partial (more, smaller programs; `_sum_pairs` adds each token's k partials in order)."""
        pdl_enter(GDC)
        p = tl.program_id(0).to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = rn < H
        e = tl.load(Experts + p).to(tl.int64)
        w_row = D + e * stride_de + rn[:, None] * inter
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            km = rk < inter
            a = tl.load(Act + p * inter + rk, mask=km, other=0.0).to(tl.float32)
            w = tl.load(w_row + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * a[None, :], axis=1)
        y = acc.to(Act.dtype.element_ty).to(tl.float32) * tl.load(Weights + p)
        tl.store(Part + p * H + rn, y, mask=nm)

    @triton.jit
    def _sum_pairs(Part, Y, H, K: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr = False):
        pdl_enter(GDC)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < H
        out = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(K):
            out += tl.load(Part + (t * K + j) * H + cols, mask=m, other=0.0)
        tl.store(Y + t * H + cols, out.to(Y.dtype.element_ty), mask=m)


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.device.type == "cuda"


def use_kernels(x: torch.Tensor) -> bool:
    return _use_triton(x) and x.shape[0] <= MAX_TOKENS


def router_topk(logits: torch.Tensor, top_k: int, per_expert_scale: torch.Tensor, pdl: bool = False):
    """See `router_topk_ref`; on CUDA the experts come back as int32. `pdl` (here and in
    `experts`): launched with PDL (kernels/launch.py; the caller checked the device)."""
    if not _use_triton(logits):
        return router_topk_ref(logits, top_k, per_expert_scale)
    T, E = logits.shape
    assert logits.is_contiguous() and top_k == triton.next_power_of_2(top_k)
    w = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    idx = torch.empty((T, top_k), dtype=torch.int32, device=logits.device)
    if T:
        _router_topk[(T,)](logits, per_expert_scale, w, idx, E, K=top_k, BLOCK=triton.next_power_of_2(E),
                           num_warps=1, **kernel_args(pdl))
    return w, idx


# launch shapes for Gemma-4 26B-A4B experts (hidden 2816, 704 per expert): the fastest on an H200
# at 1 and 8 tokens (`python -m bench.tune_kernels --experts`; the split down stage beat the fused
# one by 1-4% at both)
GATE_UP = dict(block_n=4, block_k=1024, warps=2)
DOWN = dict(block_n=8, block_k=256, warps=4, split=True)  # split: per pair, then a sum per token


def experts(x: torch.Tensor, experts_idx: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor, gate_up_launch: dict | None = None, down_launch: dict | None = None,
            pdl: bool = False, pairs: bool = False) -> torch.Tensor:
    """See `experts_ref` (CUDA, up to MAX_TOKENS tokens). The launches default to GATE_UP and
    DOWN (`python -m bench.tune_kernels --experts` times others). The pairs' programs run in
    token order: sorted by expert (pairs sharing an expert side by side) was 10% slower at 8
    tokens on an H200, the sort included. `pairs`: the split down stage's weighted float32
    partials [T k, H], unsummed (`sum_pairs_ref` is their sum)."""
    GU, DN = gate_up_launch or GATE_UP, down_launch or DOWN
    T, k = experts_idx.shape
    E, two_i, H = gate_up.shape
    inter = two_i // 2
    assert x.is_contiguous() and gate_up.is_contiguous() and down.is_contiguous() and down.shape == (E, H, inter)
    idx = experts_idx.contiguous()
    wts = weights.float().contiguous()
    act = torch.empty((T * k, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((T * k, H) if pairs else (T, H), dtype=torch.float32 if pairs else x.dtype, device=x.device)
    if T:
        _expert_gate_up[(T * k, triton.cdiv(inter, GU["block_n"]))](
            x, idx, gate_up, act, H, inter, gate_up.stride(0), K=k, BLOCK_N=GU["block_n"], BLOCK_K=GU["block_k"],
            num_warps=GU["warps"], **kernel_args(pdl))
        if DN.get("split") or pairs:
            part = y if pairs else torch.empty((T * k, H), dtype=torch.float32, device=x.device)
            _expert_down_pairs[(T * k, triton.cdiv(H, DN["block_n"]))](
                act, idx, wts, down, part, H, inter, down.stride(0), BLOCK_N=DN["block_n"], BLOCK_K=DN["block_k"],
                num_warps=DN["warps"], **kernel_args(pdl))
            if not pairs:
                _sum_pairs[(T, triton.cdiv(H, 1024))](part, y, H, K=k, BLOCK=1024, num_warps=4,
                                                      **kernel_args(pdl))
        else:
            _expert_down[(T, triton.cdiv(H, DN["block_n"]))](
                act, idx, wts, down, y, H, inter, down.stride(0), K=k, BLOCK_N=DN["block_n"],
                BLOCK_K=DN["block_k"], num_warps=DN["warps"], **kernel_args(pdl))
    return y
