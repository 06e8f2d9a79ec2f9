"""Grammar masks on logits (runner/token_mask.py) against a bit-by-bit reference, and the sampler
picking masked rows apart from the rest (runner/sampler.py `pick_tokens`)."""

import torch

from engine.core.structured import TokenMasks
from engine.core.types import SamplingParams
from engine.runner.sampler import greedy_tokens, make_generator, pick_tokens
from engine.runner.token_mask import apply_bitmask_, masked


def _bits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 31), (1 << 31) - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=g)


def test_masks_ban_exactly_the_tokens_whose_bit_is_zero():
    vocab = 1000  # not a multiple of 32: the last word's spare bits are ignored
    bitmask, logits = _bits(3, vocab, 0), torch.randn(3, vocab)
    out = masked(logits, bitmask)
    for r in range(3):
        for t in range(vocab):
            allowed = (int(bitmask[r, t // 32]) >> (t % 32)) & 1
            assert out[r, t].item() == (logits[r, t].item() if allowed else float("-inf"))


def test_applied_in_place_to_the_masked_rows_only():
    vocab = 1000
    bitmask, logits = _bits(2, vocab, 1), torch.randn(5, vocab)
    x = logits.clone()
    assert apply_bitmask_(x, [1, 3], bitmask) is x
    assert torch.equal(x[[0, 2, 4]], logits[[0, 2, 4]])
    assert torch.equal(x[1], masked(logits[1:2], bitmask[:1])[0])
    assert torch.equal(x[3], masked(logits[3:4], bitmask[1:])[0])


def test_masked_rows_only_change_their_own_tokens():
    """Row 2 (greedy) and row 5 (sampled) under masks pick the best allowed token / a seeded draw
    among allowed tokens; every other row's token is what it is without any mask."""
    n, vocab = 8, 300
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0 if j % 2 == 0 else 0.9, seed=j) for j in range(n)]
    params[5] = SamplingParams(temperature=0.9, seed=5)

    def gens():
        return [make_generator(j) for j in range(n)]
    free, _, _ = pick_tokens(logits, greedy_tokens(logits), params, gens())
    bitmask = torch.zeros(2, (vocab + 31) // 32, dtype=torch.int32)
    bitmask[0, 3] = 0b1011  # tokens 96, 97, 99
    bitmask[1, 7] = 1 << 4  # token 228
    picked, failed, _ = pick_tokens(logits, greedy_tokens(logits), params, gens(),
                                 masks=TokenMasks([2, 5], bitmask))
    assert not failed
    assert {j: t for j, t in picked.items() if j not in (2, 5)} == {j: t for j, t in free.items() if j not in (2, 5)}
    allowed = [96, 97, 99]
    assert picked[2] == (allowed[int(torch.argmax(logits[2, allowed]))], True)
    assert picked[5] == (228, True)
