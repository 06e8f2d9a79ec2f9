"""Per-row sampling, batched on the logits' device: greedy, temperature, top-k, top-p, min-p, seeds;
rows with penalties, biases or logprobs go through logits_process.py first, and rows with a
grammar through its mask (token_mask.py). A row's logits pass, in this order:

    penalties, logit_bias, min_tokens   logits_process.py `process`   (rows that ask for them)
    the grammar's mask                  token_mask.py `apply_bitmask_` (rows with a grammar)
    greedy argmax, or temperature, min-p, top-k, top-p and a seeded draw
and a row's logprobs are the log-softmax of the logits its token was picked from: processed and
masked, before temperature, min-p, top-k and top-p. Min-p (vLLM's order: after temperature, before
top-k and top-p) cuts the tokens whose probability is below min_p times the top token's.

Sampled rows draw by inverse CDF: each row's uniform number comes from its own seeded generator
(on the host, one float per row), and everything else runs on the device in a few batched ops,
so a row's token depends only on its logits and its own seed, alone or batched, and a step has
one host sync however many rows sample.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import torch

from engine.core.structured import TokenMasks
from engine.core.types import SamplingParams, TokenLogprobs
from engine.runner.logits_process import RowLogitsState, logprobs_pack, logprobs_unpack, process
from engine.runner.token_mask import apply_bitmask_
from engine.runner.transfer import to_device


def make_generator(seed: int) -> torch.Generator:
    """A row's generator for a request's 64-bit seed. torch's CPU generator (mt19937) keeps only
    the low 32 bits of its seed, so seeds that differ above them (5 and 5 + 2**32, -1 and 2**63 - 1)
    would draw alike: the whole seed is mixed (splitmix64's finalizer) and folded to 32 bits first."""
    x = seed & 0xFFFF_FFFF_FFFF_FFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    x ^= x >> 31
    g = torch.Generator(device="cpu")
    g.manual_seed((x ^ (x >> 32)) & 0xFFFF_FFFF)
    return g


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[2, n] int64 on the logits' device, computed there (no sync; capturable in a CUDA graph):
    each row's argmax of `logits` [n, vocab], and 1 where that best logit is finite (a NaN
    anywhere in a row wins its argmax)."""
    best = argmax_rows(logits)  # [n]
    ok = torch.isfinite(logits.gather(1, best[:, None])[:, 0])  # [n]
    return torch.stack((best, ok.long()))


ARGMAX_CHUNK = 1024


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(logits, dim=-1)` for logits [n, vocab]: the first of equal maxima, a NaN
    (the first) wins. On the CPU torch's argmax reads a 262k vocabulary at about 1.4 GB/s; there
    each row's maxima per 1,024-token chunk (a plain max reduction, vectorized), the first chunk
    holding the row's maximum, and the argmax inside it give the same index 7-13x faster."""
    n, vocab = logits.shape
    if logits.device.type != "cpu" or vocab % ARGMAX_CHUNK or vocab < 4 * ARGMAX_CHUNK or not n:
        return torch.argmax(logits, dim=-1)
    chunks = logits.reshape(n, vocab // ARGMAX_CHUNK, ARGMAX_CHUNK)
    best_chunk = chunks.amax(dim=-1).argmax(dim=-1)  # [n]
    inside = chunks[torch.arange(n), best_chunk].argmax(dim=-1)
    return best_chunk * ARGMAX_CHUNK + inside


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
    finite), with no host sync (each row's uniform number is drawn on the host, and copied with
    the other per-row values as queued copies: transfer.py)."""
    dev = logits.device
    n, vocab = logits.shape
    x = logits.float() / to_device([p.temperature for p in params], torch.float32, dev)[:, None]
    if any(p.min_p > 0.0 for p in params):
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p) (log(0) = -inf cuts nothing)
        floor = torch.log(to_device([p.min_p for p in params], torch.float32, dev))[:, None]
        x = x.masked_fill(x < x.amax(dim=-1, keepdim=True) + floor, float("-inf"))
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        kth = torch.topk(x, max(ks), dim=-1).values  # [n, k_max], descending
        idx = to_device([max(k, 1) - 1 for k in ks], torch.long, dev)[:, None]
        cut = kth.gather(1, idx)
        cut = torch.where(to_device(ks, torch.long, dev)[:, None] > 0, cut, torch.full_like(cut, float("-inf")))
        x = x.masked_fill(x < cut, float("-inf"))
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        rows = to_device(nucleus, torch.long, dev)
        sub = x.index_select(0, rows)
        sorted_x, order = torch.sort(sub, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        top_p = to_device([params[i].top_p for i in nucleus], torch.float32, dev)[:, None]
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p  # keep the smallest prefix reaching top_p
        drop[:, 0] = False  # and never less than the top token (a top_p below float32's range is 0)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = x.index_copy(0, rows, torch.full_like(sub, float("-inf")).scatter(1, order, sorted_x))
    probs = torch.softmax(x, dim=-1)
    ok = torch.isfinite(probs).all(dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    u = to_device([float(torch.rand((), generator=g)) for g in generators], torch.float32, dev)[:, None]
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


class Picks(NamedTuple):
    """Tokens picked on the device for rows that ask for more than a plain greedy token."""

    tokens: torch.Tensor  # [2, m] int64: token, 1 where the row's distribution is finite
    logprobs: torch.Tensor | None  # [l, 1 + 2k] `logprobs_pack` of the rows that want logprobs
    logprob_rows: list[int]  # which of the m rows those are
    logprob_ks: list[int]  # and how many top logprobs each wants


def asking_picks(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
                 states: list[RowLogitsState | None], masks: TokenMasks | None = None) -> Picks:
    """Row i of `logits` [m, V] processed by `states[i]` (where params ask), then masked by its
    grammar (where `masks` has a row for it: `masks.rows` index the m rows), then picked greedily
    or sampled, and its logprobs taken from the processed and masked logits; on the device, with
    no host sync (indices, values and masks travel as queued copies). Each processed row's state
    records its token."""
    dev = logits.device
    x = logits
    processed = [i for i, p in enumerate(params) if p.processed]
    if processed:
        rows = to_device(processed, torch.long, dev)
        x = logits.float().index_copy(0, rows, process(logits.index_select(0, rows), [states[i] for i in processed]))
    if masks is not None:  # in place, on a float32 copy of its own
        if x is logits:
            x = logits.float() if logits.dtype != torch.float32 else logits.clone()
        apply_bitmask_(x, masks.rows, masks.bitmask)
    tokens = greedy_tokens(x)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        rows = to_device(sampled, torch.long, dev)
        drawn = sample_tokens(x.index_select(0, rows), [params[i] for i in sampled], [generators[i] for i in sampled])
        tokens = tokens.index_copy(1, rows, drawn)
    for i in processed:
        states[i].record(tokens[0, i : i + 1])
    lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    pack = None
    ks = [params[i].logprobs for i in lp_rows]
    if lp_rows:
        rows = to_device(lp_rows, torch.long, dev)
        pack = logprobs_pack(x.index_select(0, rows), tokens[0].index_select(0, rows), max(ks))
    return Picks(tokens, pack, lp_rows, ks)


def pick_tokens(logits: torch.Tensor, greedy: torch.Tensor | None, params: list[SamplingParams],
                generators: list[torch.Generator], states: list[RowLogitsState | None] | None = None,
                skip: Collection[int] = (), masks: TokenMasks | None = None) -> tuple[dict, dict, dict]:
    """A step's tokens: row j of `logits` [n, vocab] samples with `params[j]`, `generators[j]`
    and `states[j]`, under its grammar's mask where `masks` has one for it (rows in `skip` are
    left out). `greedy`: the step's own greedy tokens [2, n], where it made them. Plain greedy
    rows take theirs (or one device call), and the rows that ask for more (sampling, penalties,
    logprobs, a grammar: `asking_picks`) another. Returns ({j: (token, finite)}, {j: error},
    {j: TokenLogprobs}): a failure there fails those rows only."""
    masked = set(masks.rows) if masks is not None else ()
    rows = [j for j in range(len(params)) if j not in skip]
    plain_rows = [j for j in rows if params[j].plain and j not in masked]
    asking = [j for j in rows if not params[j].plain or j in masked]
    picked: dict[int, tuple[int, bool]] = {}
    failed: dict[int, str] = {}
    logprobs: dict[int, TokenLogprobs] = {}
    if plain_rows:
        if len(plain_rows) == len(params):
            tokens, finite = greedy_host(greedy) if greedy is not None else greedy_batch(logits)
        elif greedy is not None:  # the step's greedy tokens of these rows: no argmax again
            tokens, finite = greedy_host(greedy[:, plain_rows])
        else:
            tokens, finite = greedy_batch(logits[plain_rows])
        picked = {j: (t, ok) for j, t, ok in zip(plain_rows, tokens, finite)}
    if asking:
        states = states or [None] * len(params)
        if masks is not None:  # the masks' rows, as indices into `asking` (both ascending)
            at = {j: i for i, j in enumerate(asking)}
            masks = TokenMasks([at[j] for j in masks.rows], masks.bitmask)
        try:
            picks = asking_picks(logits[asking], [params[j] for j in asking], [generators[j] for j in asking],
                                 [states[j] for j in asking], masks)
            tokens, finite = greedy_host(picks.tokens)
            if picks.logprobs is not None:
                lps = logprobs_unpack(picks.logprobs.tolist(), picks.logprob_ks)
                logprobs = {asking[i]: lp for i, lp in zip(picks.logprob_rows, lps)}
            picked.update({j: (t, ok) for j, t, ok in zip(asking, tokens, finite)})
        except Exception as exc:
            failed = {j: f"sampling failed: {exc}" for j in asking}
            logprobs = {}
    return picked, failed, logprobs
