"""`sampler.argmax_rows`, the CPU's chunked argmax, is torch's argmax: the first of equal maxima,
the first NaN where a row has one, rows of -inf, and vocabularies the chunking does not take."""

import pytest
import torch

from engine.runner.sampler import ARGMAX_CHUNK, argmax_rows, greedy_tokens


@pytest.mark.parametrize("vocab", [262_144, 8 * ARGMAX_CHUNK, 262_144 - 7, 300])
def test_argmax_rows_is_torchs(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g)
    top = x.max() + 1
    x[1, 5], x[1, vocab - 3] = top, top  # equal maxima far apart: the first
    x[2, 10 * 7 % vocab], x[2, vocab // 2] = top, top
    x[3, vocab - 1] = float("nan")  # NaN wins
    x[4, 3], x[4, vocab // 3] = float("nan"), float("nan")  # the first NaN
    x[5] = float("-inf")
    x[6, ARGMAX_CHUNK - 1 if vocab > ARGMAX_CHUNK else 0] = top  # a chunk's edge
    x[7, ARGMAX_CHUNK % vocab] = float("inf")
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))
    assert torch.equal(argmax_rows(x[:0]), torch.argmax(x[:0], dim=-1))
    strided = x[:, :vocab - vocab % 2][:, ::2]  # not contiguous
    assert torch.equal(argmax_rows(strided), torch.argmax(strided, dim=-1))
    best, ok = greedy_tokens(x)
    assert torch.equal(best, torch.argmax(x, dim=-1)) and ok.tolist() == [1, 1, 1, 0, 0, 0, 1, 0, 1]
