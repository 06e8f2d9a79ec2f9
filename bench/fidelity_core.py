"""Perplexity under restored-S5 with any window per layer, from a full recompute under the
DESIGN.md section 1 mask of each layer (the engine matches that mask step by step:
tests/equivalence/test_s5_oracle.py).

A layer's window here is what its row keeps between forwards: None for an exact layer (full
attention; or a sliding layer under native, which keeps its whole native window), an int for a
bounded one (sink + that many recent positions). The forward runs the model's own modules one
decoder layer at a time, so each layer gets its own mask (transformers' forward takes one mask
per layer type).

Regimes (which forward computed each position):

    decode    a 1,024-token prefix as one forward, then 256 tokens each from its own forward
    prefill   the same prefix, then the 256 tokens as forwards of 128 (turns of a session)

Both score the tokens after the prefix (255 per document: each predicted from the one before it,
within the scored part, so the prefix is computed once for every setting).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SLIDING = "sliding_attention"
PREFIX, SCORED, TURN = 1024, 256, 128


def forward_starts(regime: str, prefix: int = PREFIX, scored: int = SCORED) -> torch.Tensor:
    """[prefix + scored] first position of the forward that computed each position."""
    head = torch.zeros(prefix, dtype=torch.long)
    tail = torch.arange(prefix, prefix + scored)
    if regime == "prefill":
        tail = prefix + (tail - prefix) // TURN * TURN
    elif regime != "decode":
        raise ValueError(f"unknown regime {regime!r}")
    return torch.cat([head, tail])


def layer_mask(fs: torch.Tensor, sliding: bool, native_window: int | None, sink: int,
               window: int | None) -> torch.Tensor:
    """[1, 1, T, T] bool. A query q of forward f sees key k iff k <= q, (sliding) q - k <
    native_window, and (bounded layer) k in f, or k < sink, or k >= start(f) - window."""
    t = fs.shape[0]
    q = torch.arange(t)[:, None]
    k = torch.arange(t)[None, :]
    m = k <= q
    if sliding and native_window:
        m &= (q - k) < native_window
    if window is not None:
        f = fs[:, None]
        m &= (fs[None, :] == f) | (k < sink) | (k >= f - window)
    return m[None, None]


class PrefixKV:
    """The cache a decoder layer's attention reads: each layer's K/V of the prefix (computed once,
    by the exact model: every policy computes the prefix in one forward, exactly), to which a
    forward over the scored tokens appends its own. Recording: the prefix forward stores them."""

    def __init__(self, kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        self.kv = kv if kv is not None else {}
        self.recording = kv is None

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, **kwargs):
        if self.recording:
            self.kv[layer_idx] = (k, v)
            return k, v
        pk, pv = self.kv[layer_idx]
        return torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)


@dataclass
class Scorer:
    """Scores documents under per-layer windows. Every setting computes the prefix exactly (one
    forward), so the prefix's K/V and hidden states are the exact model's: they are computed once
    per document, and a setting recomputes only the scored tokens, from the first bounded layer on
    (the exact model's hidden states entering each layer are kept)."""

    model: object  # a transformers causal LM (Gemma 3 family), any weights, sdpa attention
    docs: list[torch.Tensor]  # [1, PREFIX + SCORED] token ids each
    sink: int = 4

    def __post_init__(self) -> None:
        cfg = self.model.config
        self.layer_types = list(cfg.layer_types)
        self.native_window = cfg.sliding_window
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self._masks: dict = {}
        self._prefix: list[dict] = []  # per doc: layer -> prefix (k, v)
        self._hidden: dict[str, list[list[torch.Tensor]]] = {}  # regime -> doc -> per-layer input (scored part)
        self._exact_nll: dict[str, float] = {}

    def sliding_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == SLIDING]

    def _mask(self, regime: str, layer: int, window: int | None) -> torch.Tensor:
        sliding = self.layer_types[layer] == SLIDING
        key = (regime, sliding, window)
        if key not in self._masks:
            m = layer_mask(forward_starts(regime), sliding, self.native_window, self.sink, window)
            self._masks[key] = m[:, :, PREFIX:].contiguous()  # the scored queries' rows
        return self._masks[key]

    @torch.inference_mode()
    def _layers(self, h, first, last, pos, pe, masks, cache, keep=None):
        mm = self.model.model
        for i in range(first, last):
            if keep is not None:
                keep.append(h)
            out = mm.layers[i](h, attention_mask=masks[i], position_embeddings=pe[self.layer_types[i]],
                               position_ids=pos, cache=cache)
            h = out[0] if isinstance(out, tuple) else out
        return h

    @torch.inference_mode()
    def _prefill(self, ids: torch.Tensor) -> dict:
        mm = self.model.model
        pos = torch.arange(PREFIX)[None]
        h = mm.embed_tokens(ids[:, :PREFIX])
        pe = {t: mm.rotary_emb(h, pos, t) for t in set(self.layer_types)}
        masks = [layer_mask(torch.zeros(PREFIX, dtype=torch.long), kind == SLIDING, self.native_window, 0, None)
                 for kind in self.layer_types]
        cache = PrefixKV()
        self._layers(h, 0, len(mm.layers), pos, pe, masks, cache)
        return cache.kv

    @torch.inference_mode()
    def _run(self, d: int, regime: str, windows: list[int | None], first: int = 0,
             keep: list[torch.Tensor] | None = None) -> float:
        """Summed negative log-likelihood of the scored tokens of document `d`."""
        mm = self.model.model
        ids = self.docs[d]
        pos = torch.arange(PREFIX, ids.shape[1])[None]
        h = mm.embed_tokens(ids[:, PREFIX:]) if first == 0 else self._hidden[regime][d][first]
        pe = {t: mm.rotary_emb(h, pos, t) for t in set(self.layer_types)}
        masks = [self._mask(regime, i, w) for i, w in enumerate(windows)]
        h = self._layers(h, first, len(mm.layers), pos, pe, masks, PrefixKV(self._prefix[d]), keep)
        h = mm.norm(h[:, :-1])  # position p predicts p + 1
        logits = self.model.lm_head(h)[0].float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        lp = torch.log_softmax(logits, dim=-1)
        return -lp.gather(1, ids[0, PREFIX + 1 :, None]).sum().item()

    def ppl(self, windows: list[int | None], regime: str = "decode") -> float:
        """Perplexity over every document's scored tokens with `windows` (one per layer)."""
        if not self._prefix:
            self._prefix = [self._prefill(ids) for ids in self.docs]
        exact = [None] * len(self.layer_types)
        if regime not in self._hidden:  # the exact model once, keeping each layer's input
            self._hidden[regime] = [[] for _ in self.docs]
            self._exact_nll[regime] = sum(self._run(d, regime, exact, keep=self._hidden[regime][d])
                                          for d in range(len(self.docs)))
        bounded = [i for i, w in enumerate(windows) if w is not None]
        if not bounded:
            nll = self._exact_nll[regime]
        else:
            nll = sum(self._run(d, regime, windows, first=bounded[0]) for d in range(len(self.docs)))
        return math.exp(nll / (len(self.docs) * (SCORED - 1)))


def corpus_docs(tokenizer, text: str, n: int) -> list[torch.Tensor]:
    """`n` documents of PREFIX + SCORED tokens spread over the corpus, each starting with BOS."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    length = PREFIX + SCORED
    starts = [i * (len(ids) - length) // max(1, n - 1) for i in range(n)] if n > 1 else [0]
    return [torch.tensor([[tokenizer.bos_token_id] + ids[s : s + length - 1]]) for s in starts]


def profile_and_heldout(tokenizer, text: str, profile: int, heldout: int) -> tuple[list, list]:
    """`profile + heldout` documents spread over the corpus, dealt into two disjoint sets that
    interleave (a window allocation is chosen on the first and judged on the second)."""
    docs = corpus_docs(tokenizer, text, profile + heldout)
    total = profile + heldout
    mine = [(i * profile) % total < profile for i in range(total)]
    return [d for d, m in zip(docs, mine) if m], [d for d, m in zip(docs, mine) if not m]


class DecodeKV:
    """A prompt's exact K/V per layer, plus the tokens decoded after it under one setting."""

    def __init__(self, prefix: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv = dict(prefix)

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, **kwargs):
        pk, pv = self.kv[layer_idx]
        self.kv[layer_idx] = (torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2))
        return self.kv[layer_idx]


class Greedy:
    """Greedy continuations of one prompt under per-layer windows. The prompt is one forward, so
    every setting computes it exactly: it is run once (its K/V kept), and each setting decodes its
    tokens one forward each, bounded layers seeing sink + window of what came before."""

    def __init__(self, model, prompt: list[int], sink: int = 4) -> None:
        self.model, self.sink = model, sink
        cfg = model.config
        self.layer_types = list(cfg.layer_types)
        self.native_window = cfg.sliding_window
        self.n = len(prompt)
        with torch.inference_mode():
            mm = model.model
            ids = torch.tensor([prompt])
            pos = torch.arange(self.n)[None]
            h = mm.embed_tokens(ids)
            pe = {t: mm.rotary_emb(h, pos, t) for t in set(self.layer_types)}
            cache = PrefixKV()
            fs = torch.zeros(self.n, dtype=torch.long)
            for i, layer in enumerate(mm.layers):
                mask = layer_mask(fs, self.layer_types[i] == SLIDING, self.native_window, 0, None)
                out = layer(h, attention_mask=mask, position_embeddings=pe[self.layer_types[i]], position_ids=pos,
                            cache=cache)
                h = out[0] if isinstance(out, tuple) else out
            self.prefix = cache.kv
            self.first = int(self._logits(h[:, -1:]).argmax())

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(self.model.model.norm(h))[0, -1].float()
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    @torch.inference_mode()
    def tokens(self, windows: list[int | None], count: int) -> list[int]:
        mm = self.model.model
        cache = DecodeKV(self.prefix)
        out = [self.first]
        for q in range(self.n, self.n + count - 1):  # position q: the token decoded last, its own forward
            k = torch.arange(q + 1)
            h = mm.embed_tokens(torch.tensor([[out[-1]]]))
            pos = torch.tensor([[q]])
            pe = {t: mm.rotary_emb(h, pos, t) for t in set(self.layer_types)}
            for i, layer in enumerate(mm.layers):
                m = torch.ones(q + 1, dtype=torch.bool)
                if self.layer_types[i] == SLIDING:
                    m &= (q - k) < self.native_window
                if windows[i] is not None:
                    m &= (k == q) | (k < self.sink) | (k >= q - windows[i])
                o = layer(h, attention_mask=m[None, None, None], position_embeddings=pe[self.layer_types[i]],
                          position_ids=pos, cache=cache)
                h = o[0] if isinstance(o, tuple) else o
            out.append(int(self._logits(h).argmax()))
        return out
