"""The fused forward's elementwise steps on the CPU (cpu_ops.c), float32: Gemma's RMSNorm, the
residual add fused with the next norm, and the Q/K head norms with RoPE (in place, as on CUDA).
The engine's fused Gemma 3 forward calls them through `fused_ops` where it holds an instance;
without one (no C compiler, or switched off) it runs the torch references there."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.kernels import native

SOURCE = Path(__file__).with_name("cpu_ops.c")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class CpuLayerOps:
    """The compiled kernels. One instance per engine (the fused forward holds it)."""

    def __init__(self, cache_dir: Path) -> None:
        lib = native.load(SOURCE, Path(cache_dir), CFLAGS)
        self._norm = lib.rmsnorm_rows
        self._norm.argtypes = [_P, _P, _P, _I, _I, _F, _F]
        self._norm.restype = None
        self._add_norm = lib.add_rmsnorm_rows
        self._add_norm.argtypes = [_P] * 6 + [_I, _I, _F, _F]
        self._add_norm.restype = None
        self._qk = lib.qk_norm_rope_rows
        self._qk.argtypes = [_P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _F, _F]
        self._qk.restype = ctypes.c_int

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
        y = torch.empty_like(x)
        self._norm(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps, offset)
        return y

    def add_rmsnorm(self, h: torch.Tensor, y: torch.Tensor, w_post: torch.Tensor, w_next: torch.Tensor,
                    eps: float, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + norm(y; w_post), norm(that; w_next)); h is updated in place (the layer stack's
        own residual stream)."""
        x = torch.empty_like(h)
        self._add_norm(h.data_ptr(), y.data_ptr(), w_post.data_ptr(), w_next.data_ptr(), h.data_ptr(), x.data_ptr(),
                       h.shape[0], h.shape[1], eps, offset)
        return h, x

    def qk_norm_rope(self, qkv: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, heads: int, kv_heads: int, eps: float, offset: float):
        """Q and K heads of qkv [T, (H + 2 Hkv) * D] normalised and rotated in place; returns
        views q [T, H, D], k, v [T, Hkv, D]."""
        T = qkv.shape[0]
        x = qkv.view(T, heads + 2 * kv_heads, -1)
        D = x.shape[-1]
        cos, sin = cos.contiguous(), sin.contiguous()
        rc = self._qk(qkv.data_ptr(), qkv.stride(0), wq.data_ptr(), wk.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                      T, heads, kv_heads, D, eps, offset)
        if rc:
            raise ValueError(f"cpu qk_norm_rope: unsupported head size {D}")
        return x.split([heads, kv_heads, kv_heads], dim=1)
