"""Shared test helpers: driving an engine to completion, and the DESIGN.md section 1 oracle."""

from __future__ import annotations

import torch

from engine import Engine, Request, SamplingParams
from engine.model.loader import tiny_random_model


def run_all(engine: Engine, requests: list[Request], arrivals: dict[str, int] | None = None,
            aborts: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Runs requests to completion; `arrivals[rid]` = step at which rid is added (default 0)."""
    arrivals = arrivals or {}
    aborts = aborts or {}
    pending = sorted(requests, key=lambda r: arrivals.get(r.request_id, 0))
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    step = 0
    while pending or engine.has_work():
        while pending and arrivals.get(pending[0].request_id, 0) <= step:
            engine.add_request(pending.pop(0))
        for rid, at in aborts.items():
            if at == step:
                engine.abort(rid)
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        step += 1
        assert step < 100_000
    return out


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def greedy_agreement(engine_for, lengths: tuple[int, ...], tokens: int) -> tuple[bool, float, int]:
    """Two engines, `engine_for(True)` and `engine_for(False)`, each given the same prompts at once
    (token ids from 3 + i, one request of `lengths[i]` tokens each) and run to `tokens` greedy
    tokens: whether their tokens are equal, the largest |logit difference| over every step of
    every request, and how many such steps there were."""
    outs, logits = [], []
    for which in (True, False):
        engine = engine_for(which)
        seen = {}
        engine.logits_hook = lambda rid, pos, row, seen=seen: seen.__setitem__((rid, pos), row.detach().clone())
        out = run_all(engine, [Request(f"r{i}", list(range(3 + i, 3 + i + n)), greedy(tokens))
                               for i, n in enumerate(lengths)])
        outs.append(out)
        logits.append(seen)
    diff = max((logits[0][k] - logits[1][k]).abs().max().item() for k in logits[1])
    return outs[0] == outs[1], diff, len(logits[1])


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, top_k=None, top_p=None)
    return out[0, len(prompt):].tolist()


def s5_mask(forward_starts: list[int], sink: int, window: int, native_window: int | None,
            sliding: bool, bounded: bool) -> torch.Tensor:
    """[T, T] bool: DESIGN.md section 1, written from the text, independent of the engine.

    forward_starts[p] = first position of the forward that computed position p.
    A query q in forward f sees k iff k <= q, (sliding) q - k < native_window, and, on a
    bounded layer, (k in f, or k < sink, or k >= start(f) - window)."""
    T = len(forward_starts)
    m = torch.zeros(T, T, dtype=torch.bool)
    for q in range(T):
        f = forward_starts[q]
        for k in range(q + 1):
            if sliding and native_window is not None and q - k >= native_window:
                continue
            if bounded and not (forward_starts[k] == f or k < sink or k >= f - window):
                continue
            m[q, k] = True
    return m


@torch.inference_mode()
def oracle_logits(model, tokens: list[int], forward_starts: list[int], policy: str, sink: int,
                  window: int, windows: list[int | None] | None = None) -> torch.Tensor:
    """Logits [T, V] of a full recompute of `tokens` (no cache) under the policy's mask.
    `windows`: per decoder layer, the window of a bounded layer (None: not bounded), instead of
    the policy's one `window`; the layers then run one by one, each with its own mask."""
    cfg = model.config
    W = cfg.sliding_window
    if windows is not None:
        return _per_layer_oracle(model, tokens, forward_starts, sink, windows)
    masks = {}
    for kind in set(cfg.layer_types):
        sliding = kind == "sliding_attention"
        bounded = (policy == "s5" and sliding) or policy == "sink-window"
        masks[kind] = s5_mask(forward_starts, sink, window, W, sliding, bounded)[None, None]
    ids = torch.tensor([tokens])
    out = model(input_ids=ids, position_ids=torch.arange(len(tokens))[None], attention_mask=masks,
                use_cache=False)
    return out.logits[0].float()


def _per_layer_oracle(model, tokens, forward_starts, sink, windows) -> torch.Tensor:
    cfg = model.config
    mm = model.model
    ids = torch.tensor([tokens])
    pos = torch.arange(len(tokens))[None]
    h = mm.embed_tokens(ids)
    pe = {kind: mm.rotary_emb(h, pos, kind) for kind in set(cfg.layer_types)}
    for i, layer in enumerate(mm.layers):
        kind = cfg.layer_types[i]
        sliding = kind == "sliding_attention"
        mask = s5_mask(forward_starts, sink, windows[i] or 0, cfg.sliding_window, sliding, windows[i] is not None)
        out = layer(h, attention_mask=mask[None, None], position_embeddings=pe[kind], position_ids=pos)
        h = out[0] if isinstance(out, tuple) else out
    logits = model.lm_head(mm.norm(h))[0].float()
    cap = getattr(cfg, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def tiny_gemma4(seed: int = 0, **overrides):
    """A small random Gemma-4 text model with what sets it apart from Gemma 3: a mixture of
    experts beside the dense MLP (8 experts, top-2), full-attention layers with their own K/V
    shape (head_dim 32, 1 K/V head vs 16 and 2) and values equal to keys there (k_eq_v)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
               attention_k_eq_v=True, sliding_window=16, enable_moe_block=True, num_experts=8, top_k_experts=2,
               moe_intermediate_size=32, hidden_size_per_layer_input=0, max_position_embeddings=4096,
               layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
               + ["full_attention"], final_logit_softcapping=30.0, eos_token_id=1)
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**{**cfg, **overrides})).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)  # sharper logits, as tiny_random_model
    return model


def tiny_loaded(seed: int = 0, **overrides):
    from engine.model.loader import LoadedModel

    return LoadedModel(tiny_random_model(seed, **overrides), None, "tiny")


def tiny_reference(seed: int = 0, **overrides):
    m = tiny_random_model(seed, **overrides)
    m.set_attn_implementation("sdpa")
    return m


def byte_tokenizer():
    """A byte-level BPE tokenizer of the tiny model's 512 ids (0 pad, 1 eos, 2 bos), trained here
    on JSON-like text, so that grammar masks can be built for a model that fits any test."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [json.dumps({"name": f"user{i}", "ok": i % 2 == 0, "n": i * 37}) for i in range(400)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>", "<eos>", "<bos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() <= 512 and tok.token_to_id("<eos>") == 1
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>")


def built_kernel(kind, cache_dir):
    """A CPU kernel object (`kind(cache_dir)`, compiled on first use), or the test skipped where
    this machine has no C compiler to build it."""
    import pytest

    from engine.kernels.native import KernelUnavailable

    try:
        return kind(cache_dir)
    except KernelUnavailable as e:
        pytest.skip(f"no C compiler here: {e}")
