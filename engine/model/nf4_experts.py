"""A mixture-of-experts model's experts in NF4, made once when a bnb-4bit model is loaded.

bitsandbytes quantizes `nn.Linear` modules only, so a Gemma 4 model loaded in 4 bits keeps its
experts (two 3-D parameters per layer, most of the model's bytes) in the model's dtype.
`quantize_experts` replaces each such experts module by an `NF4Experts`: both expert tensors
quantized by bitsandbytes (NF4, groups of 64, the same format as its 4-bit linears), viewed as
`NF4Weight`s whose rows are the experts' rows in expert order (kernels/nf4_moe.py). The module
computes what the stock experts module computes, on the dequantized weights:
  - up to `moe.MAX_TOKENS` tokens on CUDA (decode steps, captured in the step's graph): the NF4
    experts kernels, which read each chosen expert's 4-bit weight once;
  - more (prefill chunks), or off CUDA: both weights dequantized once to the compute dtype, the
    (token, expert) pairs sorted by expert, and two grouped products over them
    (`torch.nn.functional.grouped_mm`), with no host synchronisation.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import moe, nf4, nf4_moe
from engine.kernels.nf4 import NF4Weight

log = logging.getLogger(__name__)


def _nf4(w: torch.Tensor) -> NF4Weight:
    """A 2-D weight quantized by bitsandbytes (NF4, groups of 64, plain absmax) on its device."""
    import bitsandbytes as bnb

    p = bnb.nn.Params4bit(w.detach(), requires_grad=False, quant_type="nf4", blocksize=nf4.GROUP,
                          compress_statistics=False)
    return nf4.from_bnb(p.to(w.device))


class NF4Experts(nn.Module):
    """Gemma 4's experts (E experts, each a GELU-gated MLP of I units on H inputs) on NF4 weights:
    `gate_up` rows [E * 2I, H], `down` rows [E * H, I]. forward(x [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H], as the stock module."""

    def __init__(self, gate_up: NF4Weight, down: NF4Weight, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = gate_up.shape[1]
        self.intermediate_dim = down.shape[1]
        self.dtype = gate_up.dtype
        assert gate_up.shape[0] == 2 * num_experts * self.intermediate_dim
        assert down.shape == (num_experts * self.hidden_dim, self.intermediate_dim)
        for name, w in (("gate_up", gate_up), ("down", down)):
            self.register_buffer(f"{name}_packed", w.packed, persistent=False)
            self.register_buffer(f"{name}_scales", w.scales, persistent=False)
        self.register_buffer("code", gate_up.code, persistent=False)

    @classmethod
    def quantize(cls, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> NF4Experts:
        """From the stock module's [E, 2I, H] and [E, H, I] parameters."""
        E, two_i, H = gate_up_proj.shape
        gu = _nf4(gate_up_proj.reshape(E * two_i, H))
        dn = _nf4(down_proj.reshape(E * H, two_i // 2))
        return cls(gu, NF4Weight(dn.packed, dn.scales, gu.code, dn.dtype), E)

    @property
    def gate_up(self) -> NF4Weight:
        return NF4Weight(self.gate_up_packed, self.gate_up_scales, self.code, self.dtype)

    @property
    def down(self) -> NF4Weight:
        return NF4Weight(self.down_packed, self.down_scales, self.code, self.dtype)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        x = hidden_states.to(self.dtype)
        if moe.use_kernels(x):
            return nf4_moe.experts(x, top_k_index.int(), top_k_weights, self.gate_up, self.down)
        return self.grouped(x, top_k_index, top_k_weights)

    def grouped(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Any number of tokens: the weights dequantized, pairs sorted by expert, grouped products;
        each product's output and the activation rounded to the compute dtype, the k experts'
        weighted outputs summed in float32 (as `moe.experts_ref`)."""
        T, k = top_k_index.shape
        E, H, inter = self.num_experts, self.hidden_dim, self.intermediate_dim
        pairs = top_k_index.reshape(-1).long()
        order = torch.argsort(pairs, stable=True)
        counts = torch.zeros(E, dtype=torch.int32, device=x.device).index_add_(
            0, pairs, torch.ones_like(pairs, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xs = x[order // k]  # [T k, H], the pairs' tokens in expert order
        gu = nf4.dequantize(self.gate_up).view(E, 2 * inter, H)
        g, u = F.grouped_mm(xs, gu.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        del gu
        a = (F.gelu(g, approximate="tanh") * u).to(x.dtype)
        dn = nf4.dequantize(self.down).view(E, H, inter)
        y = F.grouped_mm(a, dn.transpose(-2, -1), offs=offs)  # [T k, H], expert order
        out = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, j) order
        return (out.float().view(T, k, H) * top_k_weights.float()[..., None]).sum(1).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"nf4, dtype={self.dtype}")


def _stock_experts(m: nn.Module) -> bool:
    gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3
            and gu.is_floating_point() and gu.shape[2] % nf4.GROUP == 0 and dn.shape[2] % nf4.GROUP == 0
            and gu.shape[1] == 2 * dn.shape[2])


@torch.no_grad()
def quantize_experts(model, device: torch.device | None = None) -> int:
    """Replace every experts module of the decoder layers that holds its experts as 3-D tensors
    in a float dtype (Gemma 4's) by an `NF4Experts` on `device` (default: where they are), one
    layer at a time: a layer's float tensors are copied there, quantized and freed before the
    next. Returns how many were replaced."""
    done = 0
    for layer in model.get_decoder().layers:
        ex = getattr(layer, "experts", None)
        if ex is None or not _stock_experts(ex):
            continue
        dev = device if device is not None else ex.gate_up_proj.device
        layer.experts = NF4Experts.quantize(ex.gate_up_proj.to(dev), ex.down_proj.to(dev))
        done += 1
    if done:
        log.info("%d experts modules quantized to NF4", done)
    return done
