"""Grammar masks on logits: the rows of a step that have a grammar sample only the tokens it
allows (engine/core/structured.py makes the masks; runner/sampler.py `asking_picks` applies them,
after the rows' penalties and before their picks and logprobs). Greedy and sampled rows alike, on
the logits' device; rows without a grammar never pass through here.

On a CUDA device one Triton kernel applies every masked row's bits in place (the bits travel as
4 bytes per 32 tokens, through pinned memory, so the host does not wait for the steps queued
before); it is the few launches a step with a grammar row adds to the host's work, which steps
launched ahead must keep within the device's step time."""

from __future__ import annotations

import numpy as np
import torch

from engine.runner.transfer import to_device

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None

BLOCK = 4096  # tokens per program: 128 words of bits

if triton is not None:

    @triton.jit
    def _ban_kernel(logits, rows, bits, vocab, logits_stride, bits_stride, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = t < vocab
        word = tl.load(bits + r * bits_stride + t // 32, mask=inside, other=-1)
        banned = ((word >> (t % 32)) & 1) == 0
        row = tl.load(rows + r).to(tl.int64)
        tl.store(logits + row * logits_stride + t, float("-inf"), mask=inside & banned)

    @triton.jit
    def _masked_argmax_kernel(logits, packed, out, vocab, logits_stride, packed_stride, out_stride,
                              BLOCK: tl.constexpr):
        r = tl.program_id(0)
        row = packed + r * packed_stride  # [logits row, bits...]
        src = tl.load(row).to(tl.int64)
        best = tl.full((), float("-inf"), tl.float32)
        best_i = tl.full((), 0, tl.int64)
        nan = tl.full((), 0, tl.int32)
        for start in range(0, vocab, BLOCK):
            t = start + tl.arange(0, BLOCK)
            word = tl.load(row + 1 + t // 32, mask=t < vocab, other=0)
            allowed = (((word >> (t % 32)) & 1) == 1) & (t < vocab)
            x = tl.load(logits + src * logits_stride + t, mask=allowed, other=float("-inf")).to(tl.float32)
            nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), 0))
            x = tl.where(x != x, float("-inf"), x)
            m = tl.max(x, 0)
            i = tl.argmax(x, 0).to(tl.int64)
            best_i = tl.where(m > best, start + i, best_i)
            best = tl.maximum(best, m)
        finite = (best > float("-inf")) & (best < float("inf")) & (nan == 0)
        tl.store(out + r, best_i)
        tl.store(out + out_stride + r, finite.to(tl.int64))


def fast_greedy(device: torch.device) -> bool:
    """Whether `masked_greedy` runs as one kernel on `device` (else the sampler's own path)."""
    return device.type == "cuda" and triton is not None


def masked_greedy(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """Greedy picks of rows `rows` of `logits` [n, vocab] under their masks (`bitmask[i]` for
    row `rows[i]`, int32 on the host), in one kernel: [2, len(rows)] int64 (token, 1 where its
    logit is finite: an all-banned row, or a NaN among its allowed logits, gives 0). The same
    tokens as `apply_bitmask_` then `greedy_tokens` (the first of equal maxima)."""
    packed = torch.cat([torch.tensor(rows, dtype=torch.int32)[:, None], bitmask], 1).pin_memory()
    packed = packed.to(logits.device, non_blocking=True)
    picks = torch.empty((2, len(rows)), dtype=torch.long, device=logits.device)
    _masked_argmax_kernel[(len(rows),)](logits, packed, picks, logits.shape[1], logits.stride(0),
                                        packed.stride(0), picks.stride(0), BLOCK=BLOCK)
    return picks


def apply_bitmask_(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """Sets every token of row `rows[i]` of `logits` [n, vocab] (float32) whose bit in
    `bitmask[i]` ([len(rows), ceil(vocab/32)] int32, on the host) is 0 to -inf, in place; returns
    `logits`."""
    vocab = logits.shape[1]
    if logits.device.type == "cuda" and triton is not None and logits.stride(1) == 1:
        bits = bitmask.pin_memory().to(logits.device, non_blocking=True)
        index = to_device(rows, torch.int32, logits.device)
        _ban_kernel[(len(rows), triton.cdiv(vocab, BLOCK))](logits, index, bits, vocab, logits.stride(0),
                                                             bits.stride(0), BLOCK=BLOCK)
        return logits
    index = to_device(rows, torch.long, logits.device)
    logits.index_copy_(0, index, masked(logits.index_select(0, index), bitmask))
    return logits


def masked(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [r, vocab] with every token whose bit in `bitmask` [r, ceil(vocab/32)] int32 (on
    the host) is 0 set to -inf (a new tensor, float32): the reference `apply_bitmask_` keeps to.
    On the CPU the bits are unpacked with numpy, elsewhere on the device."""
    vocab = logits.shape[1]
    if logits.device.type == "cpu":
        banned = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        banned ^= 1
        return logits.float().masked_fill(torch.from_numpy(banned).view(torch.bool), float("-inf"))
    bits = bitmask.pin_memory().to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(bits.shape[0], -1)[:, :vocab]
    return logits.float().masked_fill(allowed == 0, float("-inf"))
