"""Grammar masks on logits: the rows of a step that have a grammar sample only the tokens it
allows (engine/core/structured.py makes the masks). Greedy and sampled rows alike, on the logits'
device; rows without a grammar never pass through here."""

from __future__ import annotations

import numpy as np
import torch

from engine.core.structured import TokenMasks
from engine.core.types import SamplingParams

def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [r, vocab] with every token whose bit in `bitmask` [r, ceil(vocab/32)] int32 (on
    the host) is 0 set to -inf (a new tensor, float32). The bits are unpacked on the host (one
    byte per token) and the mask copied to the logits' device."""
    vocab = logits.shape[1]
    banned = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    banned ^= 1
    banned = torch.from_numpy(banned).view(torch.bool).to(logits.device, non_blocking=True)
    return logits.float().masked_fill(banned, float("-inf"))


def pick_masked(logits: torch.Tensor, masks: TokenMasks, params: list[SamplingParams],
                generators: list[torch.Generator]) -> tuple[dict, dict]:
    """Tokens of the rows in `masks` ({j: (token, finite)}, {j: error}), each as the sampler picks
    it (greedy, or its own seeded draw) from its masked logits."""
    from engine.runner.sampler import greedy_batch, sample_batch

    x = apply_bitmask(logits[masks.rows], masks.bitmask)
    greedy = [i for i, j in enumerate(masks.rows) if params[j].greedy]
    sampled = [i for i, j in enumerate(masks.rows) if not params[j].greedy]
    picked: dict[int, tuple[int, bool]] = {}
    failed: dict[int, str] = {}
    if greedy:
        tokens, finite = greedy_batch(x[greedy])
        picked = {masks.rows[i]: (t, ok) for i, t, ok in zip(greedy, tokens, finite)}
    if sampled:
        rows = [masks.rows[i] for i in sampled]
        try:
            tokens, finite = sample_batch(x[sampled], [params[j] for j in rows], [generators[j] for j in rows])
            picked.update({j: (t, ok) for j, t, ok in zip(rows, tokens, finite)})
        except Exception as exc:
            failed = {j: f"sampling failed: {exc}" for j in rows}
    return picked, failed
