"""The Gemma 4 kernels checked against their torch references on a model's own weights, before a
fused forward is used on CUDA (fused_gemma4.build)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.kernels import fused_ops, moe
from engine.kernels.fused_ops import add_rmsnorm, layer_out, qk_norm_rope, qk_norm_rope_at

if TYPE_CHECKING:
    from engine.model.fused_gemma4 import FusedGemma4


@torch.no_grad()
def gemma4_kernels_disagree(fused: FusedGemma4) -> str | None:
    """On CUDA, each Gemma 4 kernel against its torch reference on this model's own weights
    (a full and a sliding layer, decode batches of 1 and 8 rows): what disagrees or fails to
    compile, else None. `fused_gemma4.build` keeps the stock forward where this finds something."""
    if not fused_ops._use_triton(fused.embed.weight):  # the torch path: the references themselves
        return None
    g = torch.Generator(device=fused.embed.weight.device).manual_seed(0)
    dtype = fused.embed.weight.dtype
    eps, tol = fused.eps, (2e-2 if dtype != torch.float32 else 1e-4)
    worst: dict[str, float] = {}

    def compare(name, got, want):
        for a, b in zip(got, want):
            err = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
            worst[name] = max(worst.get(name, 0.0), err)

    try:
        for L in {L.layer_type: L for L in fused.layers}.values():
            for T in (1, 8):
                pdl = fused.pdl_for(T)  # the kernels as a forward of T tokens launches them

                def rnd(n, scale=1.0):
                    return (torch.randn(T, n, device=g.device, generator=g) * scale).to(dtype)

                hidden = L.wo.shape[0]
                h, y = rnd(hidden, 3.0), rnd(hidden)
                X = L.experts
                also = () if X is None else (X.pre_norm, X.router_in)
                compare("add_rmsnorm", add_rmsnorm(h.clone(), y, L.post_attn, L.pre_ff, eps, 0.0, also, pdl),
                        fused_ops.add_rmsnorm_ref(h, y, L.post_attn, L.pre_ff, eps, 0.0, also))
                qkv = rnd(L.wqkv.shape[0])
                pos = torch.randint(0, 32768, (T,), device=g.device, generator=g)
                if fused.rope is None:
                    cos, sin = fused.rotary(qkv, pos[None], L.layer_type)
                    tables = (cos[0], sin[0])
                    got = qk_norm_rope(qkv.clone(), L.q_norm, L.k_norm, *tables, L.heads, L.kv_heads, eps, 0.0,
                                       True, L.v_from_k, pdl)
                else:
                    inv, scaling = fused.rope[L.layer_type]
                    tables = fused_ops.rope_tables(pos, inv, scaling, dtype)
                    got = qk_norm_rope_at(qkv.clone(), L.q_norm, L.k_norm, pos, inv, scaling, L.heads,
                                          L.kv_heads, eps, 0.0, True, L.v_from_k, pdl)
                compare("qk_norm_rope", got, fused_ops.qk_norm_rope_ref(
                    qkv, L.q_norm, L.k_norm, *tables, L.heads, L.kv_heads, eps, 0.0, True, L.v_from_k))
                d, e = rnd(hidden), rnd(hidden)
                args = (L.post_ff, L.scalar, fused.final_norm, eps)
                if X is None:
                    compare("layer_out", layer_out(h.clone(), d, None, None, None, *args, pdl=pdl),
                            fused_ops.layer_out_ref(h, d, None, None, None, *args))
                    continue
                compare("layer_out", layer_out(h.clone(), d, e, X.post_mlp, X.post_norm, *args, pdl=pdl),
                        fused_ops.layer_out_ref(h, d, e, X.post_mlp, X.post_norm, *args))
                part = torch.randn(T * X.top_k, hidden, device=g.device, generator=g) * 0.3  # the pairs' partials
                compare("layer_out of pairs", layer_out(h.clone(), d, part, X.post_mlp, X.post_norm, *args, pdl=pdl,
                                                        pairs=X.top_k),
                        fused_ops.layer_out_ref(h, d, part, X.post_mlp, X.post_norm, *args, pairs=X.top_k))
                logits = torch.randn(T, X.router.shape[0], device=g.device, generator=g)
                w, idx = moe.router_topk(logits, X.top_k, X.per_expert_scale, pdl)
                w_ref, idx_ref = moe.router_topk_ref(logits, X.top_k, X.per_expert_scale)
                if not torch.equal(idx.long().sort(1).values, idx_ref.sort(1).values):
                    return "router_topk chose other experts than its reference"
                x = rnd(hidden)[:2]  # the reference holds float32 copies of each pair's weights
                got = X.kernels(x, idx[:2], w[:2], X.gate_up, X.down, pdl=pdl, pairs=True)
                compare("experts", [moe.sum_pairs_ref(got, X.top_k, dtype)],
                        [X.reference(x, idx_ref[:2], w_ref[:2], X.gate_up, X.down)])
    except Exception as exc:  # a kernel that does not compile or launch here
        return f"{type(exc).__name__}: {exc}"
    bad = {k: f"{v:.1e}" for k, v in worst.items() if not v < tol}
    return f"relative error over {tol}: {bad}" if bad else None
