"""The engine's own forward for Gemma 3 decoders: the stock layer's math with its matrix products
and elementwise steps fused.

`hf_adapter.forward` runs the model's stock layers: per layer three projections for Q, K and V,
two for the MLP's gate and up, and about 30 elementwise kernels. At decode batch sizes those are
mostly launches and narrow matrix products that read their weights at a fraction of the memory
bandwidth. `FusedGemma3` computes the same function with, per layer:

  x -> [Q|K|V] = x Wqkv^T -> qk_norm_rope (in place) -> row attention (the step's, as the stock
  layer would call it) -> O = a Wo^T -> add_rmsnorm (residual, post-attention and pre-MLP norms)
  -> [G|U] = x Wgu^T -> gelu_mul -> D = m Wd^T -> add_rmsnorm (residual, post-MLP norm and the
  next layer's input norm, or the final norm after the last layer)

(gelu_mul is computed by the gate/up product's own kernels where an NF4 weight's product runs on
the CUDA kernel of kernels/nf4_cuda.py, or a planned `gemv` or `mma_rows` runs it: `project`'s
`gelu`.)

At a few rows (decode batches up to 8) each product is a matrix-vector product bound by reading
its weight; where one `gemv` kernel reads it faster than the library's product (timed per
projection and row count when the forward is built), that kernel runs it. Decode batches of 9-64
rows likewise take a planned `mma_rows` launch (tensor cores, K split where the columns are few)
where it is faster.

With `pdl` (on GPUs that support it, kernels/launch.py) the engine's kernels are launched with
programmatic dependent launch: each may be scheduled while the kernel before it runs, and waits on
the device before touching what that kernel writes, so the small kernels of a decode step stop
paying their launch in full (a `gemv` also reads its first weight tile before that wait). Only
small forwards do this (`launch.worthwhile`); larger ones measured slower with it.

The fused weights are built once by concatenating the stock weights; the stock modules' weights
are then rebound as views of them, so the model holds each weight once and its own forward still
works. Only a model whose every layer has the stock Gemma 3 structure with plain bias-free
`nn.Linear` projections, NF4 linears (bitsandbytes 4-bit weights repacked at preparation,
nf4_linear.py) or the CPU's int8 linears (quant.py) is taken (`build` says why not otherwise, and
the engine keeps the stock forward): other quantized linears and other families run through
`hf_adapter.forward`. NF4 projections run the fused dequantize-and-multiply kernel of
kernels/nf4.py at decode batch sizes (its launch per row count timed on the model's weights,
`plan_nf4`) and the library's product on the dequantized weight for prefill chunks; int8
projections run the int8 kernel at every row count, their Q/K/V
and gate/up rows fused like the others'.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import hf_adapter
from engine.kernels import launch
from engine.kernels.fused_ops import add_rmsnorm, gelu_mul, qk_norm_rope, qk_norm_rope_at, rmsnorm, rope_tables
from engine.kernels.rmsnorm import FusedRMSNorm
from engine.kernels import nf4
from engine.kernels.nf4 import NF4Weight
from engine.kernels.nf4_plan import plan_nf4
from engine.kernels.small_linear import MMA_COUNTS, SmallBatchLinear, gemv, mma_rows, plan_gemv, plan_key
from engine.model.nf4_linear import NF4Linear, fuse_nf4_rows
from engine.model.quant import Int8Linear, Int8Weight, fuse_int8

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights as the fused forwards of Gemma 3 and Gemma 4 read them."""

    index: int
    layer_type: str
    # the projections: full-precision weights, or all NF4 weights (bitsandbytes 4-bit models), or
    # all int8 weights (the CPU's int8 models, quant.py)
    wqkv: torch.Tensor | NF4Weight | Int8Weight  # [(H + 2 Hkv) D, hidden] (Gemma 4 without V: [(H + Hkv) D, hidden])
    wo: torch.Tensor | NF4Weight | Int8Weight
    wgu: torch.Tensor | NF4Weight | Int8Weight  # [2 I, hidden]
    wd: torch.Tensor | NF4Weight | Int8Weight
    in_norm: torch.Tensor
    post_attn: torch.Tensor
    pre_ff: torch.Tensor
    post_ff: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    heads: int
    kv_heads: int
    scaling: float


def layer_weights(index: int, layer, layer_type: str, qkv: list[nn.Linear], heads: int, kv_heads: int) -> dict:
    """`LayerWeights`' fields from a stock Gemma decoder layer; `qkv`: its Q, K (and V) projections."""
    attn, mlp = layer.self_attn, layer.mlp
    return dict(
        index=index, layer_type=layer_type, wqkv=fuse_rows(qkv), wo=attn.o_proj.weight,
        wgu=fuse_rows([mlp.gate_proj, mlp.up_proj]), wd=mlp.down_proj.weight,
        in_norm=layer.input_layernorm.weight, post_attn=layer.post_attention_layernorm.weight,
        pre_ff=layer.pre_feedforward_layernorm.weight, post_ff=layer.post_feedforward_layernorm.weight,
        q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight, heads=heads, kv_heads=kv_heads,
        scaling=float(attn.scaling))


@dataclass(frozen=True)
class _Layer(LayerWeights):
    softcap: float | None


def plain_linear(m) -> bool:
    """A bias-free linear whose weight is all there is to it (also the stock path's CUDA
    substitute for small batches, which computes the same product)."""
    return (type(m) is nn.Linear and m.bias is None) or type(m) is SmallBatchLinear


def projections_unsupported(linears: list, dtype: torch.dtype) -> str | None:
    """What a fused forward needs of a layer's projections: all plain bias-free linears of the
    model's dtype, or all NF4 linears computing in it (None: so they are)."""
    if all(plain_linear(m) and m.weight.dtype == dtype for m in linears):
        return None
    if all(type(m) is NF4Linear and m.dtype == dtype for m in linears):
        return None
    if dtype == torch.float32 and all(type(m) is Int8Linear and m.bias is None for m in linears):
        return None
    return "projections are neither plain bias-free linears of the model's dtype nor NF4 or int8 linears in it"


def _gemma_norm(m) -> bool:
    """Gemma's (1 + w) RMSNorm (also the stock path's fused CUDA substitute for it)."""
    return type(m).__name__ == "Gemma3RMSNorm" or (type(m) is FusedRMSNorm and m.offset == 1.0)


def decoder_unsupported(base, decoder_type: str, family: str) -> str | None:
    """What the fused forwards of both families need of the decoder itself: the family's class, the
    tanh GELU, and RoPE tables per layer type (None: all there)."""
    if type(base).__name__ != decoder_type:
        return f"{type(base).__name__} is not a {family} decoder"
    activation = getattr(base.config, "hidden_activation", None)
    if activation != "gelu_pytorch_tanh":
        return f"hidden_activation {activation!r}"
    if not hasattr(base, "rotary_emb") or "layer_type" not in inspect.signature(base.rotary_emb.forward).parameters:
        return "rotary embedding without per-layer-type tables"
    return None


def unsupported(model) -> str | None:
    """Why `FusedGemma3` cannot run this model (None: it can)."""
    base = model.get_decoder()
    why = decoder_unsupported(base, "Gemma3TextModel", "Gemma 3")
    if why is not None:
        return why
    dtype = base.embed_tokens.weight.dtype
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        why = projections_unsupported(linears, dtype)
        if why is not None:
            return why
        norms = [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                 layer.post_feedforward_layernorm, attn.q_norm, attn.k_norm]
        if not all(_gemma_norm(n) for n in norms):
            return "norms are not Gemma3RMSNorm"
    return None


def build(model, pdl: bool = False, cpu_ops=None) -> FusedGemma3 | None:
    """The fused forward, or None where the model runs the stock layers. `pdl`: launch the
    kernels with PDL where the device supports it; `cpu_ops`: the CPU's C kernels, or None."""
    why = unsupported(model)
    if why is not None:
        log.info("stock layer forward: %s", why)
        return None
    return FusedGemma3(model, pdl, cpu_ops)


def _rope_angles(rotary, layer_types, dtype, device) -> dict[str, tuple[torch.Tensor, float]] | None:
    """Per layer type, the rotary embedding's (inverse frequencies, attention scaling), where its
    tables are exactly `rope_tables` of them (checked here, on positions up to 64k; Gemma 4's
    partial "proportional" RoPE is one: its unrotated pairs have frequency 0); None where
    not (a position-dependent RoPE variant, or a transformers version that computes otherwise):
    the forward then keeps the module's tables."""
    out = {}
    positions = torch.cat([torch.arange(8192), torch.arange(8192, 65536, 61)]).to(device)
    probe = torch.zeros(1, dtype=dtype, device=device)
    for lt in layer_types:
        inv = getattr(rotary, f"{lt}_inv_freq", None)
        scaling = getattr(rotary, f"{lt}_attention_scaling", None)
        kind = getattr(rotary, "rope_type", None)
        kind = kind.get(lt) if isinstance(kind, dict) else kind
        if kind not in ("default", "linear", "proportional") or inv is None or scaling is None:
            return None
        inv = inv.detach().float().contiguous()
        cos, sin = rotary(probe, positions[None], lt)
        mine = rope_tables(positions, inv, float(scaling), dtype)
        if not (torch.equal(cos[0], mine[0]) and torch.equal(sin[0], mine[1])):
            return None
        out[lt] = (inv, float(scaling))
    return out


def fuse_rows(linears: list) -> torch.Tensor | NF4Weight | Int8Weight:
    """One [sum(out), in] weight; each linear's weight becomes a view of its rows (NF4 linears:
    one NF4 weight, fuse_nf4_rows; int8 linears: one int8 weight, fuse_int8)."""
    if all(type(m) is NF4Linear for m in linears):
        return fuse_nf4_rows(linears)
    if all(type(m) is Int8Linear for m in linears):
        fused, lo = fuse_int8([m.weight for m in linears]), 0
        for m in linears:
            m.rebind(fused.rows(lo, lo + m.out_features))
            lo += m.out_features
        return fused
    fused = torch.cat([m.weight.detach() for m in linears], dim=0)
    lo = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(fused[lo: lo + n], requires_grad=False)
        lo += n
    return fused


def plan_projection(weights: list, pdl_for, gelu: bool = False) -> dict[int, dict]:
    """The launches per row count for one projection of every layer (same-shaped weights): NF4
    weights' `plan_nf4`, else `plan_gemv`'s few-row products that beat the library's (`gelu`: the
    MLP's gate/up, planned as `project(..., gelu=True)` runs it)."""
    if isinstance(weights[0], NF4Weight):
        return plan_nf4(weights, pdl_for=pdl_for, gelu=gelu)
    if isinstance(weights[0], Int8Weight):
        return {}  # one kernel for every row count (quant.py)
    return plan_gemv(weights, pdl_for=pdl_for, gelu=gelu)


def project(x: torch.Tensor, w: torch.Tensor | NF4Weight, plan: dict[int, dict], pdl_for,
            gelu: bool = False, counts: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ w^T with `plan_projection`'s plan for w's projection. `gelu`: w is the MLP's
    [gate; up] weight and the result gelu_tanh(gate) x up: the product's own kernel computes it
    where that is NF4's CUDA kernel (`nf4.linear`'s `gelu`) or the planned `gemv` or `mma_rows`,
    one launch fewer; otherwise `gelu_mul` follows the product. `counts`: the forward's
    `FusedDecoder.counts`, which a planned `mma_rows` with its K split counts in."""
    pdl = pdl_for(x.shape[0])
    if isinstance(w, NF4Weight):
        return nf4.linear(x, w, plan, pdl, gelu=gelu)
    if isinstance(w, Int8Weight):
        y = w.matmul(x.contiguous())
    else:
        cfg = plan.get(plan_key(x.shape[0]))
        if cfg is not None and "mma" in cfg:
            return mma_rows(x, w, **cfg["mma"], counts=counts, pdl=pdl, gelu=gelu)
        if cfg is not None:
            return gemv(x, w, **cfg, pdl=pdl, gelu=gelu)
        y = F.linear(x, w)
    return gelu_mul(y, pdl=pdl) if gelu else y


class FusedDecoder:
    """What the engine's own forwards (Gemma 3 here, Gemma 4 in fused_gemma4.py) take from the
    stock decoder besides its layers: the embedding, the rotary embedding (and, where they match
    `rope_tables`, its angles for the kernels), the norm epsilon and the final norm; and whether
    its kernels are launched with PDL (`pdl`: asked for and supported by the device)."""

    def __init__(self, model, pdl: bool = False, cpu_ops=None) -> None:
        self.model = model
        self.cpu = cpu_ops  # the CPU's C kernels (kernels/cpu_ops.py), or None
        base = model.get_decoder()
        cfg = base.config
        self.pdl = pdl and launch.supported(base.embed_tokens.weight.device)
        self.embed = base.embed_tokens
        # the column blocks' counters of split `mma_rows` products (zero between products), one
        # set for the forward's products, which run one at a time on its stream
        dev = base.embed_tokens.weight.device
        self.counts = torch.zeros(MMA_COUNTS, dtype=torch.int32, device=dev) if dev.type == "cuda" else None
        self.rotary = base.rotary_emb
        self.eps = float(cfg.rms_norm_eps)
        self.final_norm = base.norm.weight
        self.layer_types = sorted(set(cfg.layer_types))
        dtype = base.embed_tokens.weight.dtype
        with torch.inference_mode():
            self.rope = _rope_angles(self.rotary, self.layer_types, dtype, base.embed_tokens.weight.device)
        with torch.no_grad():
            self.layers = [self._layer(i, layer, cfg) for i, layer in enumerate(base.layers)]

    def _layer(self, index: int, layer, cfg) -> LayerWeights:
        """The family's weights of one stock decoder layer."""
        raise NotImplementedError

    def pdl_for(self, tokens: int) -> bool:
        """Whether a forward (or product) of `tokens` tokens launches its kernels with PDL."""
        return self.pdl and launch.worthwhile(tokens, self.embed.weight.shape[1])

    def _embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, dict, bool]:
        """A forward's start: the embedded tokens h [T, hidden] (scaled by the embedding module),
        the RoPE tables per layer type (`_tables`), and whether its kernels launch with PDL."""
        h = self.embed(input_ids)
        return h, self._tables(h, positions), self.pdl_for(input_ids.shape[0])

    def _attend(self, qkv: torch.Tensor, L: LayerWeights, positions: torch.Tensor, tables: dict, step,
                softcap: float | None, pdl: bool, *norm) -> torch.Tensor:
        """A layer's attention from its fused projection qkv [T, ...]: Q and K norms and RoPE
        (`norm`: the family's further `qk_norm_rope` arguments), then the step's row attention.
        Returns [T, H * D]."""
        if L.layer_type in tables:
            cos, sin = tables[L.layer_type]
            q, k, v = qk_norm_rope(qkv, L.q_norm, L.k_norm, cos, sin, L.heads, L.kv_heads, self.eps, *norm, pdl=pdl,
                                   cpu=self.cpu)
        else:
            inv_freq, scaling = self.rope[L.layer_type]
            q, k, v = qk_norm_rope_at(qkv, L.q_norm, L.k_norm, positions, inv_freq, scaling, L.heads, L.kv_heads,
                                      self.eps, *norm, pdl=pdl)
        a = step.attend(L.index, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                        L.scaling, softcap)  # [1, T, H, D]
        return a.reshape(qkv.shape[0], -1)

    def _tables(self, h: torch.Tensor, positions: torch.Tensor) -> dict:
        """Per layer type, the RoPE tables (cos, sin [T, D]): the module's where the kernels cannot
        compute their entries themselves (`rope` None); off CUDA, `rope_tables` once per forward
        (not once per layer); else empty."""
        tables = {}
        if self.rope is None:
            for lt in self.layer_types:
                cos, sin = self.rotary(h, positions[None], lt)
                tables[lt] = (cos[0], sin[0])
        elif h.device.type != "cuda":
            for lt, (inv_freq, scaling) in self.rope.items():
                tables[lt] = rope_tables(positions, inv_freq, scaling, h.dtype)
        return tables


class FusedGemma3(FusedDecoder):
    layers: list[_Layer]

    @torch.no_grad()
    def __init__(self, model, pdl: bool = False, cpu_ops=None) -> None:
        super().__init__(model, pdl, cpu_ops)
        for a, b in zip(self.layers, self.layers[1:]):
            assert a.wqkv.shape == b.wqkv.shape  # one (H, Hkv, D) for all layers in Gemma 3
        # per projection, the row counts (decode batches of a few rows) where one gemv kernel
        # reads the weight faster than the library's product; measured here, on this GPU
        self.plans = {name: plan_projection([getattr(L, name) for L in self.layers], self.pdl_for, name == "wgu")
                      for name in ("wqkv", "wo", "wgu", "wd")}
        if any(self.plans.values()):
            log.info("gemv for few-row products: %s", {k: sorted(v) for k, v in self.plans.items()})

    def _layer(self, index: int, layer, cfg) -> _Layer:
        attn = layer.self_attn
        common = layer_weights(index, layer, cfg.layer_types[index], [attn.q_proj, attn.k_proj, attn.v_proj],
                               cfg.num_attention_heads, cfg.num_key_value_heads)
        return _Layer(**common, softcap=attn.attn_logit_softcapping)

    def _project(self, x: torch.Tensor, L: _Layer, name: str, gelu: bool = False) -> torch.Tensor:
        return project(x, getattr(L, name), self.plans[name], self.pdl_for, gelu, self.counts)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step,
                logits_index: torch.Tensor | None) -> torch.Tensor:
        """Same contract as `hf_adapter.forward`: logits [n, vocab] (float32) of the tokens at
        `logits_index` (None: all), attention through `step`."""
        h, tables, pdl = self._embed(input_ids, positions)
        eps, cpu = self.eps, self.cpu
        x = rmsnorm(h, self.layers[0].in_norm, eps, pdl=pdl, cpu=cpu)
        for n, L in enumerate(self.layers):
            a = self._attend(self._project(x, L, "wqkv"), L, positions, tables, step, L.softcap, pdl)
            o = self._project(a, L, "wo")
            h, x = add_rmsnorm(h, o, L.post_attn, L.pre_ff, eps, pdl=pdl, cpu=cpu)
            m = self._project(x, L, "wgu", gelu=True)
            d = self._project(m, L, "wd")
            nxt = self.layers[n + 1].in_norm if n + 1 < len(self.layers) else self.final_norm
            h, x = add_rmsnorm(h, d, L.post_ff, nxt, eps, pdl=pdl, cpu=cpu)
        if logits_index is not None:
            x = x[logits_index]
        return hf_adapter.output_logits(self.model, x)
