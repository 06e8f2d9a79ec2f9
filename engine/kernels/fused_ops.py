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

Each rounds where the stock layer rounds to the activation dtype (after a norm, after the
activation, after the residual add), so in float32 they equal the stock ops to float rounding and
in bfloat16 they differ only by the stock ops' extra intermediate roundings. The torch versions
below are those stock ops; they run on the CPU and are the kernels' test oracles.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice  # the accurate cos/sin, as torch's (not .approx)
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.device.type == "cuda"


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: float32 math, (1 + w) scale, cast back to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).type_as(x)


def rmsnorm_ref(x, w, eps):
    return _norm(x, w, eps)


def add_rmsnorm_ref(h, y, w_post, w_next, eps):
    r = h + _norm(y, w_post, eps)
    return r, _norm(r, w_next, eps)


def qk_norm_rope_ref(qkv, wq, wk, cos, sin, heads, kv_heads, eps):
    """qkv [T, (H + 2 Hkv) * D]; cos, sin [T, D]. Returns q [T, H, D], k, v [T, Hkv, D] (new tensors)."""
    T = qkv.shape[0]
    x = qkv.view(T, heads + 2 * kv_heads, -1)
    q, k, v = x.split([heads, kv_heads, kv_heads], dim=1)
    q, k = _norm(q, wq, eps), _norm(k, wk, eps)
    c, s = cos[:, None, :].to(q.dtype), sin[:, None, :].to(q.dtype)

    def rot(t):
        half = t.shape[-1] // 2
        return torch.cat((-t[..., half:], t[..., :half]), dim=-1)

    return q * c + rot(q) * s, k * c + rot(k) * s, v


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
    def _rmsnorm_rows(X, W, Y, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        x = tl.load(X + row * N + cols, mask=m, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
        tl.store(Y + row * N + cols, (x * r * (1.0 + w)).to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def _add_rmsnorm(H, Yin, Wp, Wn, Hout, X, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        dt = Hout.dtype.element_ty
        y = tl.load(Yin + row * N + cols, mask=m, other=0.0).to(tl.float32)
        wp = tl.load(Wp + cols, mask=m, other=0.0).to(tl.float32)
        ry = tl.rsqrt(tl.sum(y * y, 0) / N + eps)
        yn = (y * ry * (1.0 + wp)).to(dt).to(tl.float32)
        h = tl.load(H + row * N + cols, mask=m, other=0.0).to(tl.float32)
        r = (h + yn).to(dt)
        tl.store(Hout + row * N + cols, r, mask=m)
        rf = r.to(tl.float32)
        wn = tl.load(Wn + cols, mask=m, other=0.0).to(tl.float32)
        rr = tl.rsqrt(tl.sum(rf * rf, 0) / N + eps)
        tl.store(X + row * N + cols, (rf * rr * (1.0 + wn)).to(dt), mask=m)

    @triton.jit
    def _qk_norm_rope(QKV, Wq, Wk, Cos, Sin, Pos, InvFreq, stride_t, stride_c, heads, eps, scaling,
                      D: tl.constexpr, HALF: tl.constexpr, ANGLES: tl.constexpr):
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
        n1 = (x1 * r * (1.0 + w1)).to(dt).to(tl.float32)
        n2 = (x2 * r * (1.0 + w2)).to(dt).to(tl.float32)
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
    def _gelu_mul(GU, Out, inter, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < inter
        dt = Out.dtype.element_ty
        g = tl.load(GU + t * 2 * inter + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(GU + t * 2 * inter + inter + cols, mask=m, other=0.0).to(tl.float32)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = (0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * z)) - 1.0))).to(dt).to(tl.float32)
        tl.store(Out + t * inter + cols, (a * u).to(dt), mask=m)


def _warps(n: int) -> int:
    return 4 if n <= 4096 else 8


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] contiguous."""
    if not _use_triton(x):
        return rmsnorm_ref(x, w, eps)
    y = torch.empty_like(x)
    n = x.shape[-1]
    if x.shape[0]:
        _rmsnorm_rows[(x.shape[0],)](x, w, y, n, eps, BLOCK=triton.next_power_of_2(n), num_warps=_warps(n))
    return y


def add_rmsnorm(h, y, w_post, w_next, eps):
    """h, y [T, N] contiguous. Returns (h + norm(y; w_post), norm(that; w_next)); h is updated in
    place on CUDA (it is the layer stack's own residual stream)."""
    if not _use_triton(h):
        return add_rmsnorm_ref(h, y, w_post, w_next, eps)
    x = torch.empty_like(h)
    n = h.shape[-1]
    if h.shape[0]:
        _add_rmsnorm[(h.shape[0],)](h, y, w_post, w_next, h, x, n, eps, BLOCK=triton.next_power_of_2(n),
                                    num_warps=_warps(n))
    return h, x


def qk_norm_rope(qkv, wq, wk, cos, sin, heads, kv_heads, eps):
    """See `qk_norm_rope_ref`. On CUDA, Q and K are normalised and rotated in place in `qkv`, and
    q, k, v are views of it."""
    if not _use_triton(qkv):
        return qk_norm_rope_ref(qkv, wq, wk, cos, sin, heads, kv_heads, eps)
    T = qkv.shape[0]
    x = qkv.view(T, heads + 2 * kv_heads, -1)
    D = x.shape[-1]
    assert qkv.is_contiguous() and D % 2 == 0 and D == triton.next_power_of_2(D)
    cos, sin = cos.contiguous(), sin.contiguous()
    if T:
        _qk_norm_rope[(T, heads + kv_heads)](qkv, wq, wk, cos, sin, cos, cos, qkv.stride(0), cos.stride(0), heads,
                                               eps, 1.0, D=D, HALF=D // 2, ANGLES=False,
                                               num_warps=1 if D <= 128 else 2)
    return x.split([heads, kv_heads, kv_heads], dim=1)


def qk_norm_rope_at(qkv, wq, wk, positions, inv_freq, scaling, heads, kv_heads, eps):
    """`qk_norm_rope` with the RoPE tables of `rope_tables(positions, inv_freq, scaling)`; on
    CUDA the kernel computes their entries itself (no tables)."""
    if not _use_triton(qkv):
        cos, sin = rope_tables(positions, inv_freq, scaling, qkv.dtype)
        return qk_norm_rope_ref(qkv, wq, wk, cos, sin, heads, kv_heads, eps)
    T = qkv.shape[0]
    x = qkv.view(T, heads + 2 * kv_heads, -1)
    D = x.shape[-1]
    assert qkv.is_contiguous() and D % 2 == 0 and D == triton.next_power_of_2(D)
    assert inv_freq.dtype == torch.float32 and inv_freq.numel() == D // 2
    if T:
        _qk_norm_rope[(T, heads + kv_heads)](qkv, wq, wk, qkv, qkv, positions, inv_freq, qkv.stride(0), 0, heads,
                                               eps, float(scaling), D=D, HALF=D // 2, ANGLES=True,
                                               num_warps=1 if D <= 128 else 2)
    return x.split([heads, kv_heads, kv_heads], dim=1)


def gelu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2I] contiguous -> gelu_tanh(gu[:, :I]) * gu[:, I:]."""
    if not _use_triton(gu):
        return gelu_mul_ref(gu)
    T, two_i = gu.shape
    inter = two_i // 2
    out = torch.empty((T, inter), dtype=gu.dtype, device=gu.device)
    block = 1024
    if T:
        _gelu_mul[(T, math.ceil(inter / block))](gu, out, inter, BLOCK=block, num_warps=4)
    return out
