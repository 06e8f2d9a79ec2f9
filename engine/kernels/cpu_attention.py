"""Decode attention on the CPU from the paged K/V pool (cpu_attention.c): one query token per
row, each row's visible keys read where the pool holds them, instead of gathered into a copy
for SDPA. Float32, no logit softcap, up to 16 query heads per K/V head."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.kernels import native

SOURCE = Path(__file__).with_name("cpu_attention.c")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")


class CpuDecodeAttention:
    """The compiled kernel. One instance per engine (the model runner holds it)."""

    def __init__(self, cache_dir: Path) -> None:
        fn = native.load(SOURCE, Path(cache_dir), CFLAGS).cpu_decode_attention
        fn.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int] * 5 + [ctypes.c_float]
        fn.restype = ctypes.c_int
        self._fn = fn

    @staticmethod
    def supports(q: torch.Tensor, pool_k: torch.Tensor, softcap: float | None) -> bool:
        heads, head_dim = q.shape[0], q.shape[-1]
        return (softcap is None and q.dtype == pool_k.dtype == torch.float32 and head_dim % 8 == 0
                and heads % pool_k.shape[1] == 0 and heads // pool_k.shape[1] <= 16)

    def __call__(self, q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor,
                 lo: torch.Tensor, hi: torch.Tensor, scale: float, k_new: torch.Tensor | None = None,
                 v_new: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, D]; pool_k, pool_v [S, Hkv, D]; slots [B, L] int64; lo, hi [B] int32: row b's
        query sees the keys at slots[b, lo[b]:hi[b]]; with k_new, v_new [B, Hkv, D] (a key and
        value per row the pool does not hold yet), those too, as entry hi[b] - 1 (then the slots'
        entries are [lo[b], hi[b] - 1)). -> [B, H, D]."""
        b, h, d = q.shape
        q, slots = q.contiguous(), slots.contiguous()
        kx = vx = 0
        if k_new is not None:
            k_new, v_new = k_new.contiguous(), v_new.contiguous()
            kx, vx = k_new.data_ptr(), v_new.data_ptr()
        out = torch.empty(b, h, d, dtype=torch.float32)
        rc = self._fn(q.data_ptr(), pool_k.data_ptr(), pool_v.data_ptr(), slots.data_ptr(), lo.data_ptr(),
                      hi.data_ptr(), kx, vx, out.data_ptr(), b, h, pool_k.shape[1], d, slots.shape[1], scale)
        if rc:
            raise MemoryError("cpu decode attention: no memory for the scores") if rc == -1 else ValueError(
                "cpu decode attention: unsupported shape")
        return out
