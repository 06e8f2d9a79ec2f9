"""Per-row sampling: greedy, temperature, top-k, top-p, seeded generators."""

from __future__ import annotations

import math

import torch

from engine.types import SamplingParams


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from `logits` [vocab]. Raises ValueError on non-finite logits."""
    logits = logits.float().cpu()
    if params.greedy:
        best = int(torch.argmax(logits))  # a NaN anywhere wins argmax, so one check suffices
        if not math.isfinite(float(logits[best])):
            raise ValueError("non-finite logits")
        return best
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
    if not bool(torch.isfinite(probs).all()):
        raise ValueError("non-finite logits")
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_batch(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Argmax of every row of `logits` [n, vocab] in one device call and one host sync; also
    whether each row's best logit is finite (a NaN anywhere in a row wins its argmax)."""
    best = torch.argmax(logits, dim=-1)  # [n]
    ok = torch.isfinite(logits.gather(1, best[:, None])[:, 0])  # [n]
    return best.tolist(), ok.tolist()
