"""Fused elementwise steps of a Gemma decoder layer (Triton on CUDA, torch ops elsewhere).

A stock Gemma 3 layer runs about 30 small kernels besides its matrix products: four RMSNorms of
the hidden state (each a chain of casts, a power, a mean, an rsqrt and two products), two more on
the query and key heads, RoPE (slices, a negation, a concatenation, four products, two sums), the
GELU-tanh gate and two residual adds. At decode batch sizes each of these reads and writes a few
kilobytes, so their launches, not their bytes, cost the time. Three kernels do the same work:

  add_rmsnorm   h' = h + norm(y) * (1 + w_post);  x = norm(h') * (1 + w_next)
                (the residual add after attention or the MLP, and the next norm: one read of h, y)
  qk_norm_rope  per head of the fused QKV output: RMSNorm of Q and K heads, then RoPE, in place
                (`qk_norm_rope_at` computes the RoPE tables' entries itself from the positions,
                as the stock rotary embedding does, instead of reading tables made by ~9 kernels
                per layer type)
  gelu_mul      gelu_tanh(gate) * up from the fused gate/up output

Gemma 4 layers use the same kernels with their own norm (`offset` 0: x * w, not x * (1 + w)), a
scale-free norm of the value heads (`v_norm`), values taken from the keys before their norm in
full-attention layers (`v_from_k`), and more than one norm of the residual stream after attention
(`also`: the dense MLP's, the experts' and the router's inputs).

Each rounds where the stock layer rounds to the activation dtype (after a norm, after the
activation, after the residual add), so in float32 they equal the stock ops to float rounding and
in bfloat16 they differ only by the stock ops' extra intermediate roundings. The torch versions
below are those stock ops; they run on the CPU and are the kernels' test oracles.
"""

from __future__ import annotations

import math

import torch

from engine.kernels import moe
from engine.kernels.launch import kernel_args

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice  # the accurate cos/sin, as torch's (not .approx)

    from engine.kernels.launch import pdl_enter
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.device.type == "cuda"


def _norm(x: torch.Tensor, w: torch.Tensor | None, eps: float, offset: float = 1.0) -> torch.Tensor:
    """Gemma's RMSNorm: float32 math, cast back to x's dtype; Gemma 3 scales by (1 + w) (offset
    1), Gemma 4 by w (offset 0), or not at all (w None)."""
    xf = x.float()
    if offset == 1.0:
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).type_as(x)
    y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (y if w is None else y * (offset + w.float())).type_as(x)


def rmsnorm_ref(x, w, eps, offset=1.0):
    return _norm(x, w, eps, offset)


def add_rmsnorm_ref(h, y, w_post, w_next, eps, offset=1.0, also=()):
    r = h + _norm(y, w_post, eps, offset)
    return (r, _norm(r, w_next, eps, offset), *(_norm(r, w, eps, offset) for w in also))


def qk_norm_rope_ref(qkv, wq, wk, cos, sin, heads, kv_heads, eps, offset=1.0, v_norm=False, v_from_k=False):
    """qkv [T, (H + 2 Hkv) * D] ([T, (H + Hkv) * D] with `v_from_k`: V is K before its norm);
    cos, sin [T, D]. Returns q [T, H, D], k, v [T, Hkv, D] (new tensors); `v_norm`: V gets a
    scale-free norm."""
    T = qkv.shape[0]
    x = qkv.view(T, heads + (1 if v_from_k else 2) * kv_heads, -1)
    if v_from_k:
        q, k = x.split([heads, kv_heads], dim=1)
        v = k
    else:
        q, k, v = x.split([heads, kv_heads, kv_heads], dim=1)
    if v_norm:
        v = _norm(v, None, eps, 0.0)
    q, k = _norm(q, wq, eps, offset), _norm(k, wk, eps, offset)
    c, s = cos[:, None, :].to(q.dtype), sin[:, None, :].to(q.dtype)

    def rot(t):
        half = t.shape[-1] // 2
        return torch.cat((-t[..., half:], t[..., :half]), dim=-1)

    return q * c + rot(q) * s, k * c + rot(k) * s, v


def layer_out_ref(h, d, e, w1, w2, w_post, scalar, w_next, eps, pairs=0):
    """The end of a Gemma 4 layer (norms with offset 0): with experts (e not None),
    s = norm(d; w1) + norm(e; w2), else s = d; h' = (h + norm(s; w_post)) * scalar; returns
    (h', norm(h'; w_next)). `pairs` k > 0: e is the experts' unsummed float32 partials [T k, N]
    (`moe.experts(..., pairs=True)`), each token's k added in order and rounded to h's dtype
    first (`moe.sum_pairs_ref`)."""
    if pairs and e is not None:
        e = moe.sum_pairs_ref(e, pairs, h.dtype)
    s = d if e is None else _norm(d, w1, eps, 0.0) + _norm(e, w2, eps, 0.0)
    r = (h + _norm(s, w_post, eps, 0.0)) * scalar
    return r, _norm(r, w_next, eps, 0.0)


def rope_tables(positions, inv_freq, scaling, dtype):
    """cos, sin [T, D] of `positions` [T]: the stock rotary embedding's math (float32 angles,
    both halves alike, times the attention scaling, cast to `dtype`)."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def gelu_mul_ref(gu):
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.gelu(g, approximate="tanh") * u


if triton is not None:

    @triton.jit
    def _rmsnorm_rows(X, W, Y, N, eps, offset, BLOCK: tl.constexpr, GDC: tl.constexpr = False):
        pdl_enter(GDC)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        x = tl.load(X + row * N + cols, mask=m, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
        tl.store(Y + row * N + cols, (x * r * (offset + w)).to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def _add_rmsnorm(H, Yin, Wp, Wn, Hout, X, W2, X2, W3, X3, N, eps, offset, BLOCK: tl.constexpr,
                     NOUT: tl.constexpr, GDC: tl.constexpr = False):
        pdl_enter(GDC)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        dt = Hout.dtype.element_ty
        y = tl.load(Yin + row * N + cols, mask=m, other=0.0).to(tl.float32)
        wp = tl.load(Wp + cols, mask=m, other=0.0).to(tl.float32)
        ry = tl.rsqrt(tl.sum(y * y, 0) / N + eps)
        yn = (y * ry * (offset + wp)).to(dt).to(tl.float32)
        h = tl.load(H + row * N + cols, mask=m, other=0.0).to(tl.float32)
        r = (h + yn).to(dt)
        tl.store(Hout + row * N + cols, r, mask=m)
        rf = r.to(tl.float32)
        rr = rf * tl.rsqrt(tl.sum(rf * rf, 0) / N + eps)
        wn = tl.load(Wn + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(X + row * N + cols, (rr * (offset + wn)).to(dt), mask=m)
        if NOUT > 1:
            w2 = tl.load(W2 + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(X2 + row * N + cols, (rr * (offset + w2)).to(dt), mask=m)
        if NOUT > 2:
            w3 = tl.load(W3 + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(X3 + row * N + cols, (rr * (offset + w3)).to(dt), mask=m)

    @triton.jit
    def _qk_norm_rope(QKV, Wq, Wk, V, Cos, Sin, Pos, InvFreq, stride_t, stride_v, stride_c, heads, eps, scaling,
                      offset, D: tl.constexpr, HALF: tl.constexpr, ANGLES: tl.constexpr, VNORM: tl.constexpr,
                      V_FROM_K: tl.constexpr, GDC: tl.constexpr = False):
        pdl_enter(GDC)
        t = tl.program_id(0).to(tl.int64)
        hd = tl.program_id(1)
        c = tl.arange(0, HALF)
        base = QKV + t * stride_t + hd * D
        dt = QKV.dtype.element_ty
        x1 = tl.load(base + c).to(tl.float32)
        x2 = tl.load(base + HALF + c).to(tl.float32)
        r = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
        if hd < heads:
            w1 = tl.load(Wq + c).to(tl.float32)
            w2 = tl.load(Wq + HALF + c).to(tl.float32)
        else:
            w1 = tl.load(Wk + c).to(tl.float32)
            w2 = tl.load(Wk + HALF + c).to(tl.float32)
            if VNORM:  # this K head's V head: a scale-free norm (of the raw K head with V_FROM_K)
                vbase = V + t * stride_v + (hd - heads) * D
                if V_FROM_K:
                    v1, v2, rv = x1, x2, r
                else:
                    v1 = tl.load(vbase + c).to(tl.float32)
                    v2 = tl.load(vbase + HALF + c).to(tl.float32)
                    rv = tl.rsqrt((tl.sum(v1 * v1, 0) + tl.sum(v2 * v2, 0)) / D + eps)
                tl.store(vbase + c, (v1 * rv).to(dt))
                tl.store(vbase + HALF + c, (v2 * rv).to(dt))
        n1 = (x1 * r * (offset + w1)).to(dt).to(tl.float32)
        n2 = (x2 * r * (offset + w2)).to(dt).to(tl.float32)
        if ANGLES:  # the table entries, computed as `rope_tables` computes them
            ang = tl.load(Pos + t).to(tl.float32) * tl.load(InvFreq + c)
            cs = (libdevice.cos(ang) * scaling).to(dt).to(tl.float32)
            sn = (libdevice.sin(ang) * scaling).to(dt).to(tl.float32)
        else:
            cs = tl.load(Cos + t * stride_c + c).to(dt).to(tl.float32)
            sn = tl.load(Sin + t * stride_c + c).to(dt).to(tl.float32)
        tl.store(base + c, (n1 * cs - n2 * sn).to(dt))
        tl.store(base + HALF + c, (n2 * cs + n1 * sn).to(dt))

    @triton.jit
    def _layer_out(H, Dd, Ee, W1, W2, Wp, Scalar, Wn, X, N, eps, HAS_E: tl.constexpr, BLOCK: tl.constexpr,
                   PAIRS: tl.constexpr = 0, GDC: tl.constexpr = False):
        pdl_enter(GDC)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        dt = H.dtype.element_ty
        d = tl.load(Dd + row * N + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_E:
            if PAIRS:  # the row's PAIRS float32 partials, added in order and rounded as moe's _sum_pairs
                e = tl.zeros([BLOCK], tl.float32)
                for j in tl.static_range(PAIRS):
                    e += tl.load(Ee + (row * PAIRS + j) * N + cols, mask=m, other=0.0)
                e = e.to(dt).to(tl.float32)
            else:
                e = tl.load(Ee + row * N + cols, mask=m, other=0.0).to(tl.float32)
            w1 = tl.load(W1 + cols, mask=m, other=0.0).to(tl.float32)
            w2 = tl.load(W2 + cols, mask=m, other=0.0).to(tl.float32)
            d1 = (d * tl.rsqrt(tl.sum(d * d, 0) / N + eps) * w1).to(dt).to(tl.float32)
            e2 = (e * tl.rsqrt(tl.sum(e * e, 0) / N + eps) * w2).to(dt).to(tl.float32)
            s = (d1 + e2).to(dt).to(tl.float32)
        else:
            s = d
        wp = tl.load(Wp + cols, mask=m, other=0.0).to(tl.float32)
        sn = (s * tl.rsqrt(tl.sum(s * s, 0) / N + eps) * wp).to(dt).to(tl.float32)
        h = tl.load(H + row * N + cols, mask=m, other=0.0).to(tl.float32)
        r = (h + sn).to(dt).to(tl.float32)
        r = (r * tl.load(Scalar).to(tl.float32)).to(dt)
        tl.store(H + row * N + cols, r, mask=m)
        rf = r.to(tl.float32)
        wn = tl.load(Wn + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(X + row * N + cols, (rf * tl.rsqrt(tl.sum(rf * rf, 0) / N + eps) * wn).to(dt), mask=m)

    @triton.jit
    def _gelu_mul(GU, Out, inter, BLOCK: tl.constexpr, GDC: tl.constexpr = False):
        pdl_enter(GDC)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < inter
        g = tl.load(GU + t * 2 * inter + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(GU + t * 2 * inter + inter + cols, mask=m, other=0.0).to(tl.float32)
        moe.store_activation(g, u, Out + t * inter + cols, m)


def _warps(n: int) -> int:
    return 4 if n <= 4096 else 8


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float = 1.0, pdl: bool = False,
            cpu=None) -> torch.Tensor:
    """x [T, N] contiguous. `pdl` (every kernel wrapper here): launch with PDL (kernels/launch.py;
    the caller checked that the device supports it). `cpu` (here and below): the CPU's C kernels
    (kernels/cpu_ops.py `CpuLayerOps`) for what they cover, or None: the torch references."""
    if not _use_triton(x):
        if cpu is not None and cpu.supports(x):
            return cpu.rmsnorm(x, w, eps, offset)
        return rmsnorm_ref(x, w, eps, offset)
    y = torch.empty_like(x)
    n = x.shape[-1]
    if x.shape[0]:
        _rmsnorm_rows[(x.shape[0],)](x, w, y, n, eps, float(offset), BLOCK=triton.next_power_of_2(n),
                                     num_warps=_warps(n), **kernel_args(pdl))
    return y


def add_rmsnorm(h, y, w_post, w_next, eps, offset=1.0, also=(), pdl=False, cpu=None):
    """h, y [T, N] contiguous. Returns (h + norm(y; w_post), norm(that; w_next), and its norm by
    each weight of `also` (up to two)); h is updated in place on CUDA and by the CPU kernel (it is
    the layer stack's own residual stream)."""
    if not _use_triton(h):
        if cpu is not None and not also and cpu.supports(h) and cpu.supports(y):
            return cpu.add_rmsnorm(h, y, w_post, w_next, eps, offset)
        return add_rmsnorm_ref(h, y, w_post, w_next, eps, offset, also)
    assert len(also) <= 2
    outs = [torch.empty_like(h) for _ in range(1 + len(also))]
    ws = [w_next, *also]
    pad_w, pad_x = ws + [w_next] * (3 - len(ws)), outs + [outs[0]] * (3 - len(outs))
    n = h.shape[-1]
    if h.shape[0]:
        _add_rmsnorm[(h.shape[0],)](h, y, w_post, pad_w[0], h, pad_x[0], pad_w[1], pad_x[1], pad_w[2], pad_x[2], n,
                                    eps, float(offset), BLOCK=triton.next_power_of_2(n), NOUT=len(outs),
                                    num_warps=_warps(n), **kernel_args(pdl))
    return (h, *outs)


def _qkv_heads(qkv, heads, kv_heads, v_from_k):
    T = qkv.shape[0]
    x = qkv.view(T, heads + (1 if v_from_k else 2) * kv_heads, -1)
    D = x.shape[-1]
    assert qkv.is_contiguous() and D % 2 == 0 and D == triton.next_power_of_2(D)
    return x, D


def _launch_qk_norm_rope(qkv, wq, wk, cos, sin, positions, inv_freq, scaling, heads, kv_heads, eps, offset,
                         v_norm, v_from_k, angles, pdl):
    x, D = _qkv_heads(qkv, heads, kv_heads, v_from_k)
    T = qkv.shape[0]
    if v_from_k:
        v = torch.empty((T, kv_heads, D), dtype=qkv.dtype, device=qkv.device)
        q, k = x.split([heads, kv_heads], dim=1)
    else:
        q, k, v = x.split([heads, kv_heads, kv_heads], dim=1)
    if T:
        _qk_norm_rope[(T, heads + kv_heads)](qkv, wq, wk, v, cos, sin, positions, inv_freq, qkv.stride(0),
                                               v.stride(0), cos.stride(0), heads, eps, float(scaling), float(offset),
                                               D=D, HALF=D // 2, ANGLES=angles, VNORM=v_norm or v_from_k,
                                               V_FROM_K=v_from_k, num_warps=1 if D <= 128 else 2,
                                               **kernel_args(pdl))
    return q, k, v


def qk_norm_rope(qkv, wq, wk, cos, sin, heads, kv_heads, eps, offset=1.0, v_norm=False, v_from_k=False,
                 pdl=False, cpu=None):
    """See `qk_norm_rope_ref`. On CUDA, Q and K (and V with `v_norm`) are normalised and rotated
    in place in `qkv`, and q, k, v are views of it (v a new tensor with `v_from_k`); so by the
    CPU kernel (Q and K only: no `v_norm`, no `v_from_k`)."""
    if not _use_triton(qkv):
        if cpu is not None and not (v_norm or v_from_k) and cpu.supports(qkv) and cpu.supports(cos):
            return cpu.qk_norm_rope(qkv, wq, wk, cos, sin, heads, kv_heads, eps, offset)
        return qk_norm_rope_ref(qkv, wq, wk, cos, sin, heads, kv_heads, eps, offset, v_norm, v_from_k)
    cos, sin = cos.contiguous(), sin.contiguous()
    return _launch_qk_norm_rope(qkv, wq, wk, cos, sin, cos, cos, 1.0, heads, kv_heads, eps, offset, v_norm,
                                v_from_k, False, pdl)


def qk_norm_rope_at(qkv, wq, wk, positions, inv_freq, scaling, heads, kv_heads, eps, offset=1.0, v_norm=False,
                    v_from_k=False, pdl=False):
    """`qk_norm_rope` with the RoPE tables of `rope_tables(positions, inv_freq, scaling)`; on
    CUDA the kernel computes their entries itself (no tables)."""
    if not _use_triton(qkv):
        cos, sin = rope_tables(positions, inv_freq, scaling, qkv.dtype)
        return qk_norm_rope_ref(qkv, wq, wk, cos, sin, heads, kv_heads, eps, offset, v_norm, v_from_k)
    assert inv_freq.dtype == torch.float32 and inv_freq.numel() * 2 == qkv.shape[1] // (
        heads + (1 if v_from_k else 2) * kv_heads)
    return _launch_qk_norm_rope(qkv, wq, wk, qkv, qkv, positions, inv_freq, scaling, heads, kv_heads, eps, offset,
                                v_norm, v_from_k, True, pdl)


def layer_out(h, d, e, w1, w2, w_post, scalar, w_next, eps, pdl=False, pairs=0):
    """See `layer_out_ref`; h [T, N] is updated in place on CUDA."""
    if not _use_triton(h):
        return layer_out_ref(h, d, e, w1, w2, w_post, scalar, w_next, eps, pairs)
    x = torch.empty_like(h)
    n = h.shape[-1]
    if h.shape[0]:
        has_e = e is not None
        _layer_out[(h.shape[0],)](h, d, e if has_e else d, w1 if has_e else w_post, w2 if has_e else w_post, w_post,
                                  scalar, w_next, x, n, eps, HAS_E=has_e, BLOCK=triton.next_power_of_2(n),
                                  PAIRS=pairs if has_e else 0, num_warps=_warps(n), **kernel_args(pdl))
    return h, x


def gelu_mul(gu: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """gu [T, 2I] contiguous -> gelu_tanh(gu[:, :I]) * gu[:, I:]."""
    if not _use_triton(gu):
        return gelu_mul_ref(gu)
    T, two_i = gu.shape
    inter = two_i // 2
    out = torch.empty((T, inter), dtype=gu.dtype, device=gu.device)
    block = 1024
    if T:
        _gelu_mul[(T, math.ceil(inter / block))](gu, out, inter, BLOCK=block, num_warps=4, **kernel_args(pdl))
    return out
