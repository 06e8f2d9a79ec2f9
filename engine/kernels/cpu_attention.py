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
        fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 5 + [ctypes.c_float]
        fn.restype = ctypes.c_int
        self._fn = fn

    @staticmethod
    def supports(q: torch.Tensor, pool_k: torch.Tensor, softcap: float | None) -> bool:
        heads, head_dim = q.shape[0], q.shape[-1]
        return (softcap is None and q.dtype == pool_k.dtype == torch.float32 and head_dim % 8 == 0
                and heads % pool_k.shape[1] == 0 and heads // pool_k.shape[1] <= 16)

    def __call__(self, q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor,
                 lo: torch.Tensor, hi: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, H, D]; pool_k, pool_v [S, Hkv, D]; slots [B, L] int64; lo, hi [B] int32: row b's
        query sees the keys at slots[b, lo[b]:hi[b]]. -> [B, H, D]."""
        b, h, d = q.shape
        q, slots = q.contiguous(), slots.contiguous()
        out = torch.empty(b, h, d, dtype=torch.float32)
        rc = self._fn(q.data_ptr(), pool_k.data_ptr(), pool_v.data_ptr(), slots.data_ptr(), lo.data_ptr(),
                      hi.data_ptr(), out.data_ptr(), b, h, pool_k.shape[1], d, slots.shape[1], scale)
        if rc:
            raise MemoryError("cpu decode attention: no memory for the scores") if rc == -1 else ValueError(
                "cpu decode attention: unsupported shape")
        return out
