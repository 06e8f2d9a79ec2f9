"""Grammar masks on logits: the rows of a step that have a grammar sample only the tokens it
allows (engine/core/structured.py makes the masks; runner/sampler.py `asking_picks` applies them,
after the rows' penalties and before their picks and logprobs). Greedy and sampled rows alike, on
the logits' device; rows without a grammar never pass through here."""

from __future__ import annotations

import numpy as np
import torch


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [r, vocab] with every token whose bit in `bitmask` [r, ceil(vocab/32)] int32 (on
    the host) is 0 set to -inf (a new tensor, float32). On the CPU the bits are unpacked with
    numpy; on an accelerator the bits travel (4 bytes per 32 tokens, through pinned memory, so the
    host does not wait for the steps queued before) and are unpacked there."""
    vocab = logits.shape[1]
    if logits.device.type == "cpu":
        banned = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        banned ^= 1
        return logits.float().masked_fill(torch.from_numpy(banned).view(torch.bool), float("-inf"))
    bits = bitmask.pin_memory().to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(bits.shape[0], -1)[:, :vocab]
    return logits.float().masked_fill(allowed == 0, float("-inf"))
