"""Grammar masks on logits: the rows of a step that have a grammar sample only the tokens it
allows (engine/core/structured.py makes the masks; runner/sampler.py `asking_picks` applies them,
after the rows' penalties and before their picks and logprobs). Greedy and sampled rows alike, on
the logits' device; rows without a grammar never pass through here."""

from __future__ import annotations

import numpy as np
import torch


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [r, vocab] with every token whose bit in `bitmask` [r, ceil(vocab/32)] int32 (on
    the host) is 0 set to -inf (a new tensor, float32). The bits are unpacked on the host (one
    byte per token) and the mask copied to the logits' device."""
    vocab = logits.shape[1]
    banned = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    banned ^= 1
    banned = torch.from_numpy(banned).view(torch.bool).to(logits.device, non_blocking=True)
    return logits.float().masked_fill(banned, float("-inf"))
