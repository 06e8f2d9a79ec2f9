"""Weights brought into the GPU's L2 cache ahead of the product that reads them.

At a few rows a decode step is a chain of small kernels (norms, RoPE, attention over a few
windows) between the matrix products, and during those kernels the memory is nearly idle: the
step's time is their latency, not bytes. `prefetch` issues Hopper's bulk L2 prefetch
(`cp.async.bulk.prefetch.L2`) for regions of the next products' weights at such a point, so that
the weights stream in while the small kernels run and the product finds the first of them in L2.
A prefetch changes no value: it is a hint to the memory system, and what the products read is
the same.

The regions of one point (`Regions`: device addresses and byte counts, built once from the
model's weights) are one launch: each program takes one region's span of `PIECES` pieces, one
bulk prefetch a thread. Launched with PDL, the kernel issues its prefetches before it waits for
the kernel before it, and the kernels after it keep their order.
"""

from __future__ import annotations

import torch

from engine.kernels.launch import kernel_args

try:
    import triton
    import triton.language as tl

    from engine.kernels.launch import pdl_enter
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None

PIECE = 32 << 10  # bytes a thread's bulk prefetch asks for (a multiple of 16)
PIECES = 32  # one warp a program: a program's span is PIECE x PIECES bytes


if triton is not None:

    @triton.jit
    def _l2_prefetch_kernel(Regions, PIECE: tl.constexpr, PIECES: tl.constexpr, GDC: tl.constexpr = False):
        """Program (i, r): bytes i x span .. (i + 1) x span of region r, row r of Regions [R, 2]
        (int64: address, bytes)."""
        i = tl.program_id(0)
        r = tl.program_id(1)
        base = tl.load(Regions + 2 * r).to(tl.pointer_type(tl.uint8))
        nbytes = tl.load(Regions + 2 * r + 1)
        lo = i.to(tl.int64) * (PIECE * PIECES) + tl.arange(0, PIECES).to(tl.int64) * PIECE
        size = tl.minimum(tl.maximum(nbytes - lo, 0), PIECE).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [base + lo, size], dtype=tl.int32, is_pure=False, pack=1)
        pdl_enter(GDC)


def supported(device: torch.device) -> bool:
    """Bulk L2 prefetch is an sm_90 (Hopper) instruction."""
    return triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


class Regions:
    """The spans of weight memory one prefetch point brings into L2: (tensor, first byte, bytes)
    each, 16-byte aligned; the tensors are kept, so the addresses stay valid."""

    def __init__(self, spans: list[tuple[torch.Tensor, int, int]]) -> None:
        rows = []
        for t, start, nbytes in spans:
            start, nbytes = start // 16 * 16, min(nbytes, t.numel() * t.element_size() - start) // 16 * 16
            if nbytes > 0:
                rows.append((t.data_ptr() + start, nbytes))
        self.tensors = [t for t, _, _ in spans]
        self.table = torch.tensor(rows, dtype=torch.int64, device=spans[0][0].device) if rows else None
        self.programs = max((triton.cdiv(n, PIECE * PIECES) for _, n in rows), default=0)
        self.nbytes = sum(n for _, n in rows)


def prefetch(regions: Regions, pdl: bool = False) -> None:
    """One launch that asks L2 for every span of `regions`."""
    if regions.table is None:
        return
    _l2_prefetch_kernel[(regions.programs, regions.table.shape[0])](
        regions.table, PIECE=PIECE, PIECES=PIECES, num_warps=1, **kernel_args(pdl))
