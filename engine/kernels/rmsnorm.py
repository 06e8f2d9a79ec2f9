"""A fused RMSNorm for CUDA, substituted for a model's own norm modules (as quantized linears are).

transformers' RMSNorm runs ~10 kernels (casts, pow, mean, add, rsqrt, two products, the weight's
offset); a decoder layer of Gemma 3 has six of them, so at small batch sizes their launches are
most of a decode step's kernels. `FusedRMSNorm` computes the same float32 function in one kernel:
y = x * rsqrt(mean(x^2) + eps) * (offset + w), cast back to x's dtype.

`fuse_norms` replaces a module only after checking it: on a random input the fused module must
agree with the module it replaces (offset 1 for Gemma's `1 + weight`, else offset 0); a norm that
matches neither is left as it is.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None


if triton is not None:

    @triton.jit
    def _rmsnorm_kernel(X, W, Y, size1, size2, stride0, stride1, stride2, N, eps, offset, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        i2 = row % size2
        i1 = (row // size2) % size1
        i0 = row // (size1 * size2)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + i0 * stride0 + i1 * stride1 + i2 * stride2 + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * N + cols, (x * r * (offset + w)).to(Y.dtype.element_ty), mask=mask)


class FusedRMSNorm(nn.Module):
    def __init__(self, weight: nn.Parameter, eps: float, offset: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = float(eps)
        self.offset = float(offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        if x.dim() > 4 or x.stride(-1) != 1:
            x = x.contiguous()
        lead = [1] * (4 - x.dim()) + list(x.shape[:-1])
        strides = [0] * (4 - x.dim()) + list(x.stride()[:-1])
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rows = lead[0] * lead[1] * lead[2]
        if rows:
            _rmsnorm_kernel[(rows,)](x, self.weight, y, lead[1], lead[2], strides[0], strides[1], strides[2], n,
                                     self.eps, self.offset, BLOCK=triton.next_power_of_2(n),
                                     num_warps=4 if n <= 4096 else 8)
        return y


def norm_eps(module: nn.Module) -> float | None:
    """An RMSNorm module's epsilon, under either name transformers' norms give it (`eps`,
    `variance_epsilon`); None if it has neither."""
    for name in ("eps", "variance_epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def _is_rmsnorm(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("RMSNorm") and not isinstance(module, FusedRMSNorm) and isinstance(getattr(module, "weight", None), torch.Tensor)
            and module.weight.dim() == 1 and norm_eps(module) is not None)


@torch.no_grad()
def fuse_norms(model: nn.Module) -> int:
    """Replace the model's RMSNorm modules by FusedRMSNorm where it computes the same function
    (CUDA with Triton only). Returns how many were replaced."""
    if triton is None:
        return 0
    replaced, checked = 0, {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not _is_rmsnorm(child) or child.weight.device.type != "cuda":
                continue
            key = (type(child), child.weight.dtype, child.weight.numel())
            if key not in checked:
                checked[key] = _matching_offset(child)
                if checked[key] is None:
                    log.warning("%s: no fused form matches; kept as is", type(child).__name__)
            if checked[key] is not None:
                setattr(parent, name, FusedRMSNorm(child.weight, norm_eps(child), checked[key]))
                replaced += 1
    return replaced


def _matching_offset(norm: nn.Module) -> float | None:
    gen = torch.Generator(device=norm.weight.device).manual_seed(0)
    n = norm.weight.numel()
    x = torch.randn(3, 5, n, device=norm.weight.device, generator=gen).to(norm.weight.dtype) * 3
    want = norm(x).float()
    for offset in (1.0, 0.0):
        got = FusedRMSNorm(norm.weight, norm_eps(norm), offset)(x).float()
        if torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
            return offset
    return None
