"""Per-row logits processing before a token is picked, and the logprobs of what was picked.

A row whose `SamplingParams.processed` is set (penalties, `logit_bias`, `min_tokens`) has its
logits changed, on the device, before its token is picked, greedy or sampled alike; rows that ask
for nothing never come here (they keep the step's precomputed greedy tokens). In the order vLLM
applies them:

    logit_bias          x[t] += bias[t]
    min_tokens          x[t] = -inf for EOS and stop token ids while fewer tokens were generated
    repetition_penalty  x[t] /= r where x[t] > 0, x[t] *= r elsewhere, for t in prompt + output
    frequency_penalty   x[t] -= f * count(t in output)
    presence_penalty    x[t] -= p * (t in output)

What a row remembers lives on the device in its `RowLogitsState` and is updated there from the
picked token (`record`), so steps launched ahead of the host (core/ahead.py) see every
token picked before them without a host sync.

Logprobs are the log-softmax of these processed logits (the logits greedy takes the argmax of and
sampling divides by its temperature), before temperature, top-k and top-p; `logprobs_pack` puts a
batch of them in one float tensor, so they reach the host in one copy.
"""

from __future__ import annotations

import torch

from engine.core.types import SamplingParams, TokenLogprobs
from engine.runner.transfer import to_device


class RowLogitsState:
    """One request's penalty state on the device: how often it generated each token (presence
    and frequency penalties), which tokens its prompt and output hold (repetition penalty), its
    biases and the ids `min_tokens` bans; and how many tokens were picked for it so far."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab: int, device: torch.device,
                 stop_ids: set[int]) -> None:
        self.params = params
        self.vocab = vocab
        self.picked = 0  # tokens picked for the row (counted at the pick, ahead of the host's apply)
        self.counts = None
        if params.presence_penalty or params.frequency_penalty:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)  # [V]
        self.seen = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)  # [V]
            ids = [t for t in prompt_ids if 0 <= t < vocab]
            if ids:
                self.seen[torch.tensor(ids, dtype=torch.long, device=device)] = True
        self.bias_ids = self.bias = None
        if params.logit_bias:
            self.bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=device)
            self.bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=device)
        self.banned = None
        ban = sorted(t for t in stop_ids | set(params.stop_token_ids) if 0 <= t < vocab) if params.min_tokens else []
        if ban:
            self.banned = torch.tensor(ban, dtype=torch.long, device=device)

    def fork(self) -> RowLogitsState:
        """A copy for a forked row (its own counts from here on)."""
        twin = object.__new__(RowLogitsState)
        twin.__dict__.update(self.__dict__)
        twin.counts = self.counts.clone() if self.counts is not None else None
        twin.seen = self.seen.clone() if self.seen is not None else None
        return twin

    def record(self, token: torch.Tensor) -> None:
        """The token [1] (on the device) picked for the row."""
        self.picked += 1
        if self.counts is not None:
            self.counts.index_add_(0, token, torch.ones(1, dtype=torch.float32, device=token.device))
        if self.seen is not None:
            self.seen.index_fill_(0, token, True)


def process(logits: torch.Tensor, states: list[RowLogitsState]) -> torch.Tensor:
    """The processed logits [m, V] (float32, a new tensor) of `logits` [m, V], row i by `states[i]`."""
    x = logits.float().clone()
    m, vocab = x.shape
    dev = x.device
    if any(s.vocab != vocab for s in states):
        raise ValueError("logits and penalty state disagree on the vocabulary size")
    biased = [i for i, s in enumerate(states) if s.bias is not None]
    if biased:
        rows = torch.cat([torch.full_like(states[i].bias_ids, i) for i in biased])
        cols = torch.cat([states[i].bias_ids for i in biased])
        x.index_put_((rows, cols), torch.cat([states[i].bias for i in biased]), accumulate=True)
    banning = [i for i, s in enumerate(states) if s.banned is not None and s.picked < s.params.min_tokens]
    if banning:
        rows = torch.cat([torch.full_like(states[i].banned, i) for i in banning])
        cols = torch.cat([states[i].banned for i in banning])
        x.index_put_((rows, cols), torch.full((), float("-inf"), device=dev))
    if any(s.seen is not None for s in states):
        seen = torch.stack([s.seen if s.seen is not None else torch.zeros(vocab, dtype=torch.bool, device=dev)
                            for s in states])
        r = to_device([s.params.repetition_penalty for s in states], torch.float32, dev)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if any(s.counts is not None for s in states):
        counts = torch.stack([s.counts if s.counts is not None else torch.zeros(vocab, device=dev) for s in states])
        freq = to_device([s.params.frequency_penalty for s in states], torch.float32, dev)[:, None]
        pres = to_device([s.params.presence_penalty for s in states], torch.float32, dev)[:, None]
        x = x - freq * counts - pres * (counts > 0).float()
    return x


def logprobs_pack(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """[m, 1 + 2k] float32 on the device: per row of `logits` [m, V], the log-softmax at its
    picked token (`tokens` [m]), then the k largest logprobs' token ids (as floats: exact below
    2**24, far past any vocabulary), then those logprobs."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens[:, None])
    if k == 0:
        return chosen
    top = torch.topk(lp, min(k, lp.shape[1]), dim=-1)
    return torch.cat([chosen, top.indices.float(), top.values], dim=1)


def logprobs_unpack(pack: list[list[float]], ks: list[int]) -> list[TokenLogprobs]:
    """`logprobs_pack`'s rows on the host, each cut to its own row's k."""
    out = []
    for row, k in zip(pack, ks):
        width = (len(row) - 1) // 2
        out.append((row[0], [int(t) for t in row[1:1 + k]], row[1 + width:1 + width + k]))
    return out
