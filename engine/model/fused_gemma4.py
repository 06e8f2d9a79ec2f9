"""The engine's own forward for Gemma 4 text decoders (dense or with a mixture of experts): the
stock layer's math with its products and elementwise steps fused, as fused_forward.py does for
Gemma 3.

A stock Gemma 4 layer with experts runs some 150 kernels at a decode step: eleven RMSNorms (four
of them on the residual stream after attention or the MLPs), RoPE on queries and keys, the
router's softmax and top-k, and the experts' sort, gather, grouped products and scatter. Per
layer this forward runs:

  x -> [Q|K|V] = x Wqkv^T (full layers with values equal to keys: [Q|K]) -> qk_norm_rope (Q and
  K norms and RoPE, V's scale-free norm) -> row attention -> O = a Wo^T -> add_rmsnorm (residual,
  post-attention norm, and the three inputs of what follows: the dense MLP's, the experts' and
  the router's) -> dense MLP ([G|U] = x Wgu^T -> gelu_mul, in the product where `project`'s
  `gelu` can -> D = m Wd^T) and, beside it, router logits -> router_topk -> experts
  (kernels/moe.py) -> layer_out (the sum of each token's expert partials, the MLP and experts'
  post-norms, their sum, the post-MLP norm, the residual add, the layer scalar and the next
  layer's input norm)

Prefill chunks of more than `moe.MAX_TOKENS` tokens run the model's own experts module (its
grouped products have whole tiles of tokens per expert there). Models with per-layer input
embeddings or layers that share another layer's K/V keep the stock forward (`unsupported` says
why). bitsandbytes 4-bit models run their projections on the NF4 kernels (kernels/nf4.py, as in
fused_forward.py), their routers on a dequantized copy (`_experts` says why), and their experts,
which the loader quantizes to NF4 as well (nf4_experts.py: bitsandbytes quantizes `nn.Linear`
modules only), on the NF4 experts kernels (kernels/nf4_moe.py), or, at the token counts where
`nf4_plan.plan_experts` timed them faster and found them exact, on the CUDA kernel's tensor-core
tiles; prefill chunks run that module's grouped products.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.model import hf_adapter
from engine.model.fused_forward import (FusedDecoder, LayerWeights, decoder_unsupported, layer_weights, plan_projection,
                                        project, projections_unsupported)
from engine.model.kernel_check import gemma4_kernels_disagree
from engine.kernels.rmsnorm import FusedRMSNorm
from engine.kernels import moe, nf4, nf4_moe
from engine.kernels.nf4 import NF4Weight
from engine.kernels.nf4_plan import expert_tiles_for, plan_experts
from engine.model.nf4_experts import NF4Experts
from engine.kernels.fused_ops import add_rmsnorm, layer_out, rmsnorm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Experts:
    router: torch.Tensor  # [E, hidden] in the compute dtype (NF4 routers dequantized)
    router_in: torch.Tensor  # [hidden] float32: the router's input scale times hidden ** -0.5
    per_expert_scale: torch.Tensor  # [E]
    gate_up: torch.Tensor | NF4Weight  # [E, 2 I, hidden]; NF4: rows [E * 2 I, hidden]
    down: torch.Tensor | NF4Weight  # [E, hidden, I]; NF4: rows [E * hidden, I]
    top_k: int
    pre_norm: torch.Tensor  # the experts' input norm
    post_norm: torch.Tensor  # their output's
    post_mlp: torch.Tensor  # the dense MLP output's
    module: nn.Module  # the model's own experts module (prefill chunks)
    kernels: Callable  # decode batches: moe.experts, or nf4_moe.experts on NF4 weights
    reference: Callable  # their torch reference (kernel_check): moe.experts_ref or nf4_moe.experts_ref


@dataclass(frozen=True)
class _Layer(LayerWeights):
    scalar: torch.Tensor  # [1]
    v_from_k: bool  # the layer has no V projection (wqkv holds Q and K)
    experts: _Experts | None


def _norm_with(m, scale: bool) -> bool:
    """Gemma 4's RMSNorm, x * w (`scale`) or scale-free; with a scale also the stock path's fused
    CUDA substitute for it (offset 0), which an engine built earlier on the same model put in."""
    if type(m) is FusedRMSNorm:
        return scale and m.offset == 0.0
    return type(m).__name__ == "Gemma4RMSNorm" and bool(getattr(m, "with_scale", True)) == scale


def unsupported(model) -> str | None:
    """Why `FusedGemma4` cannot run this model (None: it can)."""
    base = model.get_decoder()
    why = decoder_unsupported(base, "Gemma4TextModel", "Gemma 4 text")
    if why is not None:
        return why
    if getattr(base.config, "hidden_size_per_layer_input", 0):
        return "per-layer input embeddings"
    dtype = base.embed_tokens.weight.dtype
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(attn, "is_kv_shared_layer", False):
            return "layers that share another layer's K/V"
        linears = [attn.q_proj, attn.k_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        linears += [attn.v_proj] if attn.v_proj is not None else []
        why = projections_unsupported(linears, dtype)
        if why is not None:
            return why
        norms = [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                 layer.post_feedforward_layernorm, attn.q_norm, attn.k_norm]
        if getattr(layer, "enable_moe_block", False):
            norms += [layer.post_feedforward_layernorm_1, layer.post_feedforward_layernorm_2,
                      layer.pre_feedforward_layernorm_2]
            ex, router = layer.experts, layer.router
            if isinstance(ex, NF4Experts):
                experts_ok = ex.dtype == dtype
            else:
                experts_ok = (isinstance(getattr(ex, "gate_up_proj", None), torch.Tensor)
                              and ex.gate_up_proj.dtype == dtype and ex.gate_up_proj.dim() == 3)
            if not (projections_unsupported([router.proj], dtype) is None and _norm_with(router.norm, False)
                    and experts_ok):
                return "experts or router of another form"
        if not (all(_norm_with(n, True) for n in norms) and _norm_with(attn.v_norm, False)):
            return "norms are not Gemma4RMSNorm"
        if not isinstance(getattr(layer, "layer_scalar", None), torch.Tensor):
            return "no layer scalar"
    return None


def build(model, pdl: bool = False) -> FusedGemma4 | None:
    """The fused forward, or None where the model runs the stock layers: a model it does not
    take, or (CUDA) kernels that disagree with their references on its weights. `pdl`: launch
    the kernels with PDL where the device supports it."""
    why = unsupported(model)
    if why is None:
        fused = FusedGemma4(model, pdl)
        why = gemma4_kernels_disagree(fused)
        if why is None:
            return fused
        why = f"the Gemma 4 kernels disagree with their references here ({why})"
        log.warning("stock layer forward: %s", why)
    else:
        log.info("stock layer forward: %s", why)
    return None


def _experts(layer) -> _Experts | None:
    if not getattr(layer, "enable_moe_block", False):
        return None
    r, ex = layer.router, layer.experts
    if isinstance(ex, NF4Experts):
        gate_up, down, kernels, reference = ex.gate_up, ex.down, nf4_moe.experts, nf4_moe.experts_ref
    else:
        gate_up, down, kernels, reference = (ex.gate_up_proj.detach(), ex.down_proj.detach(), moe.experts,
                                             moe.experts_ref)
    # A router of NF4 weights gets a copy in the compute dtype, made once here: its 128-odd
    # outputs are too few rows for the NF4 kernels to read at bandwidth, and the copy is what
    # bitsandbytes' own dequantize gives (nf4.dequantize), so its product is the reference's
    router = r.proj.weight
    if isinstance(router, NF4Weight):
        router = nf4.dequantize(router)
    return _Experts(
        router=router, router_in=(r.scale.detach().float() * float(r.scalar_root_size)).contiguous(),
        per_expert_scale=r.per_expert_scale.detach(), gate_up=gate_up, down=down,
        top_k=int(r.config.top_k_experts), pre_norm=layer.pre_feedforward_layernorm_2.weight,
        post_norm=layer.post_feedforward_layernorm_2.weight, post_mlp=layer.post_feedforward_layernorm_1.weight,
        module=ex, kernels=kernels, reference=reference)


class FusedGemma4(FusedDecoder):
    layers: list[_Layer]

    @torch.no_grad()
    def __init__(self, model, pdl: bool = False) -> None:
        super().__init__(model, pdl)
        # per projection and weight shape (full and sliding layers differ), the row counts where
        # one gemv kernel reads the weight faster than the library's product
        groups: dict[tuple, list[torch.Tensor]] = {}
        for L in self.layers:
            for name in ("wqkv", "wo", "wgu", "wd"):
                w = getattr(L, name)
                groups.setdefault((name, tuple(w.shape)), []).append(w)
            if L.experts is not None:
                groups.setdefault(("router", tuple(L.experts.router.shape)), []).append(L.experts.router)
        self.plans = {key: plan_projection(ws, self.pdl_for, key[0] == "wgu") for key, ws in groups.items()}
        if any(self.plans.values()):
            log.info("gemv for few-row products: %s", {k: sorted(v) for k, v in self.plans.items() if v})
        # per decode token count, whether NF4 experts run on the CUDA kernel's tensor-core tiles
        nf4_experts = [L.experts for L in self.layers
                       if L.experts is not None and isinstance(L.experts.gate_up, NF4Weight)]
        self.expert_tiles = plan_experts([(X.gate_up, X.down) for X in nf4_experts], nf4_experts[0].top_k,
                                         self.pdl_for) if nf4_experts else {}
        if any(self.expert_tiles.values()):
            log.info("NF4 experts on tensor-core tiles by token count: %s", self.expert_tiles)

    def _layer(self, index: int, layer, cfg) -> _Layer:
        attn = layer.self_attn
        qkv = [attn.q_proj, attn.k_proj] + ([attn.v_proj] if attn.v_proj is not None else [])
        common = layer_weights(index, layer, cfg.layer_types[index], qkv, attn.q_proj.out_features // attn.head_dim,
                               attn.k_proj.out_features // attn.head_dim)
        return _Layer(**common, scalar=layer.layer_scalar, v_from_k=attn.v_proj is None, experts=_experts(layer))

    def _project(self, x: torch.Tensor, w, name: str, gelu: bool = False) -> torch.Tensor:
        return project(x, w, self.plans[(name, tuple(w.shape))], self.pdl_for, gelu, self.counts)

    def _experts(self, X: _Experts, x_router: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The experts' output and how many partials a token has in it: the kernels leave each
        (token, expert) pair's float32 partial for `layer_out` to add (top_k), the model's own
        module sums them (0: the output is the sum)."""
        logits = self._project(x_router, X.router, "router")
        pdl = self.pdl_for(x.shape[0])
        weights, chosen = moe.router_topk(logits, X.top_k, X.per_expert_scale, pdl)
        if moe.use_kernels(x):
            kw = {"tiles": expert_tiles_for(self.expert_tiles, x.shape[0])} if isinstance(X.gate_up, NF4Weight) else {}
            return X.kernels(x, chosen, weights, X.gate_up, X.down, pdl=pdl, pairs=True, **kw), X.top_k
        return X.module(x, chosen.long(), weights), 0

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step,
                logits_index: torch.Tensor | None) -> torch.Tensor:
        """Same contract as `hf_adapter.forward`: logits [n, vocab] (float32) of the tokens at
        `logits_index` (None: all), attention through `step`."""
        h, tables, pdl = self._embed(input_ids, positions)
        eps = self.eps
        x = rmsnorm(h, self.layers[0].in_norm, eps, 0.0, pdl)
        for n, L in enumerate(self.layers):
            # offset 0 norms, V's scale-free norm, V from K where the layer has no V projection
            a = self._attend(self._project(x, L.wqkv, "wqkv"), L, positions, tables, step, None, pdl,
                             0.0, True, L.v_from_k)
            o = self._project(a, L.wo, "wo")
            X = L.experts
            if X is None:
                h, x = add_rmsnorm(h, o, L.post_attn, L.pre_ff, eps, 0.0, pdl=pdl)
            else:
                h, x, x_experts, x_router = add_rmsnorm(h, o, L.post_attn, L.pre_ff, eps, 0.0,
                                                        also=(X.pre_norm, X.router_in), pdl=pdl)
            d = self._project(self._project(x, L.wgu, "wgu", gelu=True), L.wd, "wd")
            e, pairs = (None, 0) if X is None else self._experts(X, x_router, x_experts)
            nxt = self.layers[n + 1].in_norm if n + 1 < len(self.layers) else self.final_norm
            h, x = layer_out(h, d, e, X.post_mlp if X else None, X.post_norm if X else None, L.post_ff, L.scalar,
                             nxt, eps, pdl, pairs)
        if logits_index is not None:
            x = x[logits_index]
        return hf_adapter.output_logits(self.model, x)
