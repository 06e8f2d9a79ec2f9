"""Kernels that probe PDL ordering on the GPU (tests/equivalence/test_cuda.py).

`late_copy` lets the next kernel be scheduled at once and writes its output only after a long
dependent chain of arithmetic: a kernel launched after it with PDL that reads that output before
its own wait reads what was there before. `early_read` is such a kernel, on purpose: it reads
before its wait. Together they show the window in which an early read goes wrong is open on this
GPU, so a kernel that reads the same output correctly behind `late_copy` is shown to wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _late_copy_kernel(Src, Dst, n, spins, BLOCK: tl.constexpr):
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()  # the next kernel may start now, long before the store
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(Src + i, mask=m, other=0.0)
    acc = tl.zeros([BLOCK], tl.float32)
    for _ in range(spins):  # acc goes 1, 1.5, 1.75, ...: a chain no compiler can drop
        acc = acc * 0.5 + 1.0
    tl.store(Dst + i, tl.where(acc > 1.0, x, -x), mask=m)


@triton.jit
def _early_read_kernel(Src, Dst, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(Src + i, mask=m, other=0.0)  # before the wait: may see what was there before
    tl.extra.cuda.gdc_wait()
    tl.store(Dst + i, x, mask=m)


def late_copy(src: torch.Tensor, dst: torch.Tensor, spins: int = 200_000) -> None:
    """dst <- src (contiguous, same size and dtype), written after `spins` dependent steps;
    launched with PDL, so the kernel after it may start while this one spins."""
    n = src.numel()
    _late_copy_kernel[(triton.cdiv(n, BLOCK),)](src, dst, n, spins, BLOCK=BLOCK, launch_pdl=True)


def early_read(src: torch.Tensor) -> torch.Tensor:
    """A copy of src read before this kernel's PDL wait (launched with PDL)."""
    out = torch.empty_like(src)
    n = src.numel()
    _early_read_kernel[(triton.cdiv(n, BLOCK),)](src, out, n, BLOCK=BLOCK, launch_pdl=True)
    return out
