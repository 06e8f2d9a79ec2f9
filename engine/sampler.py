"""Per-row sampling: greedy, temperature, top-k, top-p, seeded generators."""

from __future__ import annotations

import torch

from engine.types import SamplingParams


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from `logits` [vocab]. Raises ValueError on non-finite logits."""
    logits = logits.float().cpu()
    if not bool(torch.isfinite(logits).any()) or bool(torch.isnan(logits).any()):
        raise ValueError("non-finite logits")
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits / params.temperature
    if params.top_k and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = (cum - probs) >= params.top_p  # keep the smallest prefix reaching top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
