"""Per-row sampling, batched on the logits' device: greedy, temperature, top-k, top-p, seeds.

Sampled rows draw by inverse CDF: each row's uniform number comes from its own seeded generator
(on the host, one float per row), and everything else runs on the device in a few batched ops,
so a row's token depends only on its logits and its own seed, alone or batched, and a step has
one host sync however many rows sample.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from engine.core.structured import TokenMasks
from engine.core.types import SamplingParams
from engine.runner.token_mask import pick_masked


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[2, n] int64 on the logits' device, computed there (no sync; capturable in a CUDA graph):
    each row's argmax of `logits` [n, vocab], and 1 where that best logit is finite (a NaN
    anywhere in a row wins its argmax)."""
    best = torch.argmax(logits, dim=-1)  # [n]
    ok = torch.isfinite(logits.gather(1, best[:, None])[:, 0])  # [n]
    return torch.stack((best, ok.long()))


def greedy_host(greedy: torch.Tensor) -> tuple[list[int], list[bool]]:
    """`greedy_tokens`' (or `sample_tokens`') result on the host: one copy, one sync."""
    best, ok = greedy.tolist()
    return best, [bool(x) for x in ok]


def greedy_batch(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Argmax of every row of `logits` [n, vocab] and whether each row's best logit is finite."""
    return greedy_host(greedy_tokens(logits))


def sample_batch(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator]) -> tuple[list[int], list[bool]]:
    """One token per row of `logits` [n, vocab] (temperature > 0 for every row); also whether the
    row's distribution was finite (a row with NaN/inf logits gets ok=False and must fail)."""
    return greedy_host(sample_tokens(logits, params, generators))


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator]) -> torch.Tensor:
    """`sample_batch` left on the device: [2, n] int64 (token, 1 where the row's distribution is
    finite), with no host sync (each row's uniform number is drawn on the host and copied)."""
    dev = logits.device
    n, vocab = logits.shape
    x = logits.float() / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        kth = torch.topk(x, max(ks), dim=-1).values  # [n, k_max], descending
        idx = torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None]
        cut = kth.gather(1, idx)
        cut = torch.where(torch.tensor(ks, device=dev)[:, None] > 0, cut, torch.full_like(cut, float("-inf")))
        x = x.masked_fill(x < cut, float("-inf"))
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        rows = torch.tensor(nucleus, device=dev)
        sub = x.index_select(0, rows)
        sorted_x, order = torch.sort(sub, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        top_p = torch.tensor([params[i].top_p for i in nucleus], device=dev)[:, None]
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p  # keep the smallest prefix reaching top_p
        drop[:, 0] = False  # and never less than the top token (a top_p below float32's range is 0)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = x.index_copy(0, rows, torch.full_like(sub, float("-inf")).scatter(1, order, sorted_x))
    probs = torch.softmax(x, dim=-1)
    ok = torch.isfinite(probs).all(dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.tensor([float(torch.rand((), generator=g)) for g in generators], device=dev)[:, None]
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=vocab - 1)[:, 0]
    return torch.stack((tokens, ok.long()))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from `logits` [vocab]. Raises ValueError on non-finite logits."""
    if params.greedy:
        tokens, ok = greedy_batch(logits[None])
    else:
        tokens, ok = sample_batch(logits[None], [params], [generator])
    if not ok[0]:
        raise ValueError("non-finite logits")
    return tokens[0]


def pick_tokens(logits: torch.Tensor, greedy: torch.Tensor | None, params: list[SamplingParams],
                generators: list[torch.Generator], skip: Collection[int] = (),
                masks: TokenMasks | None = None) -> tuple[dict, dict]:
    """A step's tokens: row j of `logits` [n, vocab] samples with `params[j]` and `generators[j]`
    (rows in `skip` are left out). `greedy`: the step's own greedy tokens [2, n], where it made
    them. Greedy rows are one device call and sampled rows another; rows with a grammar mask
    (`masks`) are picked on their own (token_mask.py), so the others keep the step's greedy
    tokens. Returns ({j: (token, finite)}, {j: error}): a sampling failure fails the sampled rows
    only."""
    masked = set(masks.rows) if masks is not None else set()
    greedy_rows = [j for j, p in enumerate(params) if p.greedy and j not in skip and j not in masked]
    sampled_rows = [j for j, p in enumerate(params) if not p.greedy and j not in skip and j not in masked]
    picked: dict[int, tuple[int, bool]] = {}
    failed: dict[int, str] = {}
    if greedy_rows:
        if len(greedy_rows) + len(masked) == len(params):  # every row greedy but the masked ones
            step_greedy = greedy if greedy is not None else greedy_tokens(logits)
            tokens, finite = greedy_host(step_greedy[:, greedy_rows] if masked else step_greedy)
        else:
            tokens, finite = greedy_batch(logits[greedy_rows])
        picked = {j: (t, ok) for j, t, ok in zip(greedy_rows, tokens, finite)}
    if sampled_rows:
        try:
            tokens, finite = sample_batch(logits[sampled_rows], [params[j] for j in sampled_rows],
                                          [generators[j] for j in sampled_rows])
            picked.update({j: (t, ok) for j, t, ok in zip(sampled_rows, tokens, finite)})
        except Exception as exc:
            failed = {j: f"sampling failed: {exc}" for j in sampled_rows}
    if masks is not None:
        masked_picked, masked_failed = pick_masked(logits, masks, params, generators)
        picked.update(masked_picked)
        failed.update(masked_failed)
    return picked, failed
